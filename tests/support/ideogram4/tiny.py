"""Tiny random Ideogram-4 models at the hub ids the reference's scripts name, in their layouts:
DiffSynth-Studio/ideogram-4-bf16-repackage holds `transformer/` and `unconditional_transformer/` in Ideogram's
original names (fused `attention.qkv`), `text_encoder/model.safetensors` (a saved Qwen3VLModel) and `vae/` (diffusers'
AutoencoderKLFlux2), as bare weight files; the tokenizer the reference defaults to is ideogram-ai/ideogram-4-fp8's
`tokenizer/`. The text encoder keeps the 36 layers Ideogram reads 13 of, at a width of 16. Seeded: two processes
write identical files."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..common import TinyFamily, quiet_hf, register_tiny, write_example_dataset
from ..parts import tiny_flux2_vae
from ..qwen_parts import TinyQwen3VLSpec, qwen3_vl_tokenizer, tiny_qwen3_vl

REPACKAGE = "DiffSynth-Studio/ideogram-4-bf16-repackage"
TOKENIZER_REPO = "ideogram-ai/ideogram-4-fp8"
# One user turn as Qwen3-VL's template renders a text-only message.
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m['content'] is string %}"
                 "{{ m['content'] }}{% else %}{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}"
                 "{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TEXT_LAYERS = 36


@dataclass
class TinyIdeogram4Spec:
    text_hidden: int = 16
    head_dim: int = 16
    heads: int = 2
    layers: int = 2
    intermediate: int = 64
    adaln_dim: int = 16
    text_head_dim: int = 8
    text_intermediate: int | None = None  # default: twice the text width
    vae_width: int = 8


def ideogram4_tokenizer():
    tok = qwen3_vl_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_text_encoder(spec: TinyIdeogram4Spec | None = None):
    """Qwen3VLModel (the backbone a saved text_encoder/ holds)."""
    spec = spec or TinyIdeogram4Spec()
    tvl = TinyQwen3VLSpec(hidden=spec.text_hidden, layers=TEXT_LAYERS, heads=2, kv_heads=1, head_dim=spec.text_head_dim,
                          intermediate=spec.text_intermediate or 2 * spec.text_hidden, vision_hidden=16, vision_depth=1,
                          tie_word_embeddings=False, seed=3)
    return tiny_qwen3_vl(tvl, vocab_size=len(ideogram4_tokenizer())).model


def tiny_dit(spec: TinyIdeogram4Spec | None = None, seed: int = 0):
    from diffusers import Ideogram4Transformer2DModel

    from difftune.families.ideogram4.components import mrope_section
    from difftune.families.ideogram4.units import ACTIVATION_LAYERS

    spec = spec or TinyIdeogram4Spec()
    torch.manual_seed(seed)
    dit = Ideogram4Transformer2DModel(
        in_channels=128, num_layers=spec.layers, attention_head_dim=spec.head_dim, num_attention_heads=spec.heads,
        intermediate_size=spec.intermediate, adaln_dim=spec.adaln_dim,
        llm_features_dim=spec.text_hidden * len(ACTIVATION_LAYERS), mrope_section=mrope_section(spec.head_dim))
    # the released DiT's embeddings and norms are far from their initial values: random ones show every path
    with torch.no_grad():
        for name, p in dit.named_parameters():
            if name.endswith("norm_q.weight") or name.endswith("norm_k.weight") or "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif "final_layer.linear" in name or "adaln_modulation" in name:
                p.copy_(0.05 * torch.randn_like(p))
    return dit.eval()


def tiny_vae(spec: TinyIdeogram4Spec | None = None):
    return tiny_flux2_vae(latent_channels=32, width=(spec or TinyIdeogram4Spec()).vae_width, seed=2)


def _save(state: dict, path: Path) -> Path:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return path


def write_tiny_ideogram4_hub(base: str | os.PathLike, spec: TinyIdeogram4Spec | None = None,
                             tokenizer_beside: bool = False) -> Path:
    """The tiny repackage and the tokenizer under `base` at the hub ids the scripts name; returns `base`.
    `tokenizer_beside`: a copy of the tokenizer in the repackage's `tokenizer/` too (found without a flag)."""
    from difftune.families.ideogram4.components import original_dit_keys

    quiet_hf()
    base = Path(base)
    repo = base / REPACKAGE
    _save(original_dit_keys(tiny_dit(spec, seed=0).state_dict()),
          repo / "transformer" / "diffusion_pytorch_model.safetensors")
    _save(original_dit_keys(tiny_dit(spec, seed=1).state_dict()),
          repo / "unconditional_transformer" / "diffusion_pytorch_model.safetensors")
    _save(tiny_text_encoder(spec).state_dict(), repo / "text_encoder" / "model.safetensors")
    _save(tiny_vae(spec).state_dict(), repo / "vae" / "diffusion_pytorch_model.safetensors")
    ideogram4_tokenizer().save_pretrained(base / TOKENIZER_REPO / "tokenizer")
    if tokenizer_beside:
        ideogram4_tokenizer().save_pretrained(repo / "tokenizer")
    return base


def hub_paths(base: str | os.PathLike, uncond: bool = False) -> list[str]:
    repo = Path(base) / REPACKAGE
    dits = ["transformer"] + (["unconditional_transformer"] if uncond else [])
    return [str(repo / d / "diffusion_pytorch_model.safetensors") for d in dits] + [
        str(repo / "text_encoder" / "model.safetensors"), str(repo / "vae" / "diffusion_pytorch_model.safetensors")]


def load_tiny_ideogram4(base: str | os.PathLike, uncond: bool = True, torch_dtype=torch.float32):
    from difftune.families.ideogram4.pipeline import Ideogram4Pipeline
    from difftune.models import ModelConfig

    return Ideogram4Pipeline.from_pretrained(
        torch_dtype=torch_dtype, model_configs=[ModelConfig(p) for p in hub_paths(base, uncond)],
        tokenizer_config=ModelConfig(str(Path(base) / TOKENIZER_REPO / "tokenizer")))


def _tiny_ideogram4(folder) -> TinyFamily:
    base = write_tiny_ideogram4_hub(Path(folder) / "hub", tokenizer_beside=True)
    from difftune.families.ideogram4.components import LORA_TARGET_MODULES

    return TinyFamily(model_paths=hub_paths(base), lora_base_model="dit", lora_target_modules=LORA_TARGET_MODULES,
                      write_dataset=lambda root: write_example_dataset(root, n=2, size=(32, 32)),
                      flags=("--max_pixels", "1024"),
                      optional_slots=("dit_uncond",))


register_tiny("ideogram4", _tiny_ideogram4)

__all__ = ["CHAT_TEMPLATE", "REPACKAGE", "TOKENIZER_REPO", "TinyIdeogram4Spec", "hub_paths", "ideogram4_tokenizer",
           "load_tiny_ideogram4", "tiny_dit", "tiny_text_encoder", "tiny_vae", "write_tiny_ideogram4_hub"]
