"""Tiny, randomly initialised Krea-2 models at the hub ids the reference's scripts name, in their layouts:
`krea/Krea-2-Raw/raw.safetensors` and `krea/Krea-2-Turbo/turbo.safetensors` (Krea's single files, original names),
`Qwen/Qwen3-VL-4B-Instruct/` (the causal LM's files and its tokenizer at the root) and `Qwen/Qwen-Image/vae/`.
The text encoder keeps Qwen3-VL-4B's 36 layers (the DiT reads hidden states 2..35) at a tiny width. Seeded."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..common import TinyFamily, quiet_hf, register_tiny, write_example_dataset
from ..qwen_parts import TinyQwen3VLSpec, write_tiny_qwen3_vl, write_tiny_qwen_image_vae

KREA2_RAW_REPO, KREA2_TURBO_REPO = "krea/Krea-2-Raw", "krea/Krea-2-Turbo"
KREA2_QWEN3_VL_REPO, KREA2_VAE_REPO = "Qwen/Qwen3-VL-4B-Instruct", "Qwen/Qwen-Image"
KREA2_TEXT_SPEC = TinyQwen3VLSpec(hidden=32, layers=36, heads=2, kv_heads=1, head_dim=16, intermediate=64,
                            vision_hidden=32, vision_depth=1)


@dataclass
class TinyKrea2Spec:
    hidden_heads: int = 4
    head_dim: int = 16
    kv_heads: int = 2
    layers: int = 2
    intermediate: int = 96
    text_hidden: int = 32  # the tiny Qwen3-VL's width
    text_heads: int = 2
    text_intermediate: int = 64
    seed: int = 0


def tiny_krea2_dit(spec: TinyKrea2Spec | None = None, seed: int | None = None):
    """diffusers' Krea2Transformer2DModel at tiny sizes; the zero-initialised parts (modulation tables, the final
    layer) given random values so a test sees them."""
    from diffusers import Krea2Transformer2DModel

    from difftune.families.krea2.components import rope_axes

    spec = spec or TinyKrea2Spec()
    torch.manual_seed(spec.seed if seed is None else seed)
    dit = Krea2Transformer2DModel(
        in_channels=64, num_layers=spec.layers, attention_head_dim=spec.head_dim,
        num_attention_heads=spec.hidden_heads, num_key_value_heads=spec.kv_heads, intermediate_size=spec.intermediate,
        timestep_embed_dim=32, text_hidden_dim=spec.text_hidden, num_text_layers=12,
        text_num_attention_heads=spec.text_heads, text_num_key_value_heads=spec.text_heads,
        text_intermediate_size=spec.text_intermediate, axes_dims_rope=tuple(rope_axes(spec.head_dim)))
    g = torch.Generator().manual_seed(100 + (spec.seed if seed is None else seed))
    with torch.no_grad():
        for _, p in sorted(dit.named_parameters()):
            if not p.abs().sum():
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return dit.eval()


def write_krea2_single_file(path: Path, dit) -> Path:
    """A DiT as Krea's single file: the original names (`first`, `blocks.N.attn.wq`, flat modulation tables)."""
    from safetensors.torch import save_file

    from difftune.families.krea2.components import original_dit_keys

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in original_dit_keys(dit.state_dict()).items()}, str(path))
    return path


def write_tiny_krea2_hub(base: str | os.PathLike, spec: TinyKrea2Spec | None = None,
                         text_spec: TinyQwen3VLSpec = KREA2_TEXT_SPEC, vae_base_dim: int = 8,
                         turbo: bool = True) -> Path:
    """Every repository the four Krea-2 scripts name, under a model base path (the benchmark's sizes through
    `spec`, `text_spec`, `vae_base_dim`)."""
    quiet_hf()
    base = Path(base)
    write_krea2_single_file(base / KREA2_RAW_REPO / "raw.safetensors", tiny_krea2_dit(spec, seed=0))
    if turbo:
        write_krea2_single_file(base / KREA2_TURBO_REPO / "turbo.safetensors", tiny_krea2_dit(spec, seed=1))
    write_tiny_qwen3_vl(base / KREA2_QWEN3_VL_REPO, text_spec)
    write_tiny_qwen_image_vae(base / KREA2_VAE_REPO / "vae", base_dim=vae_base_dim)
    return base


def krea2_model_paths(base: str | os.PathLike, repo: str = KREA2_RAW_REPO) -> list[str]:
    base = Path(base)
    dit = base / repo / ("raw.safetensors" if repo == KREA2_RAW_REPO else "turbo.safetensors")
    return [str(dit), str(base / KREA2_QWEN3_VL_REPO / "model.safetensors"),
            str(base / KREA2_VAE_REPO / "vae" / "diffusion_pytorch_model.safetensors")]


def load_tiny_krea2(base: str | os.PathLike, repo: str = KREA2_RAW_REPO, torch_dtype=torch.float32):
    """Our pipeline on the tiny files (tokenizer found beside the text encoder)."""
    from difftune.families.krea2 import Krea2Pipeline
    from difftune.models import ModelConfig

    return Krea2Pipeline.from_pretrained(torch_dtype=torch_dtype, device="cpu",
                                         model_configs=[ModelConfig(p) for p in krea2_model_paths(base, repo)])


def diffusers_krea2(pipe, is_distilled: bool = False):
    """diffusers' Krea2Pipeline on the same models as our pipeline `pipe` (its scheduler from Krea-2's config)."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers import Krea2Pipeline as DiffusersKrea2

    from difftune.families.krea2.components import SCHEDULER_CONFIG
    from difftune.families.krea2.prompt import PREFIX, SUFFIX, token_count

    ref = DiffusersKrea2(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG), vae=pipe.vae,
                         text_encoder=pipe.text_encoder, tokenizer=pipe.tokenizer, transformer=pipe.dit,
                         is_distilled=is_distilled)
    # diffusers hard-codes the official tokenizer's template lengths (34, 5): the tiny tokenizer's instead
    ref.prompt_template_encode_start_idx = token_count(pipe.tokenizer, PREFIX)
    ref.prompt_template_encode_num_suffix_tokens = token_count(pipe.tokenizer, SUFFIX)
    ref.set_progress_bar_config(disable=True)
    return ref


def _tiny_krea2(folder: Path) -> TinyFamily:
    from difftune.families.krea2.components import LORA_TARGET_MODULES

    base = write_tiny_krea2_hub(folder / "hub")
    return TinyFamily(model_paths=krea2_model_paths(base), lora_base_model="dit",
                      lora_target_modules=LORA_TARGET_MODULES,
                      write_dataset=lambda root: write_example_dataset(root, n=2, size=(32, 32)),
                      flags=("--max_pixels", "1024"),
                      trainable_cases={"text_encoder_lora": ("--lora_base_model", "text_encoder",
                                                             "--lora_target_modules", "q_proj,v_proj")},
                      # measured: the text encoder's q/v LoRA 1.06e-5 (1 CPU thread) to 2.66e-5 (2 threads), after
                      # 2 or 4 steps (lr 1e-3), on layers.20 / .11's q_proj: stage 1 encodes the two images as one
                      # VAE batch, latents within 1.8e-7 of one at a time (0.0 apart, and so the LoRAs, with
                      # --data_process_batch_size 1); Adam's first steps scale that round-off up (the field's note)
                      split_tolerance=1e-4)


register_tiny("krea2", _tiny_krea2)

__all__ = ["KREA2_QWEN3_VL_REPO", "KREA2_RAW_REPO", "KREA2_TEXT_SPEC", "KREA2_TURBO_REPO", "KREA2_VAE_REPO",
           "TinyKrea2Spec", "diffusers_krea2", "krea2_model_paths", "load_tiny_krea2", "tiny_krea2_dit",
           "write_krea2_single_file", "write_tiny_krea2_hub"]
