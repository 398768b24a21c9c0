"""Tiny, randomly initialised FLUX.2 models in the layouts the reference's scripts name, and tiny data sets.

`write_tiny_flux2_hub(base)` lays out, under a model base path, what the scripts load: black-forest-labs/
FLUX.2-klein-4B and FLUX.2-klein-9B (transformer/, text_encoder/ (Qwen3 causal LM), vae/, tokenizer/, scheduler/,
model_index.json), FLUX.2-klein-base-4B and -base-9B (transformer/), and with `dev` FLUX.2-dev (transformer/,
text_encoder/ (a Mistral-3 file), vae/, tokenizer/). Depths are the real ones (klein-4B 5 + 20 blocks, 9B 8 + 24,
dev 8 + 48; the scripts name every single block), widths tiny; the text encoders have the layers whose hidden
states are read (27 of Qwen3 for klein, 30 of Mistral for dev). Everything is seeded: two processes write
bit-identical files.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..common import TinyFamily, quiet_hf, register_tiny, write_example_dataset

ORG = "black-forest-labs"
KLEIN_4B, KLEIN_9B = f"{ORG}/FLUX.2-klein-4B", f"{ORG}/FLUX.2-klein-9B"
KLEIN_BASE_4B, KLEIN_BASE_9B = f"{ORG}/FLUX.2-klein-base-4B", f"{ORG}/FLUX.2-klein-base-9B"
DEV = f"{ORG}/FLUX.2-dev"
SCHEDULER_CONFIG = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0,
                    "use_dynamic_shifting": True, "time_shift_type": "exponential", "base_image_seq_len": 256,
                    "max_image_seq_len": 4096, "base_shift": 0.5, "max_shift": 1.15}


@dataclass
class TinyFlux2Spec:
    """Sizes of a tiny FLUX.2 (per model: depths as released, widths tiny)."""

    heads: int = 2
    head_dim: int = 16  # four RoPE axes of 4
    text_layers: int = 27  # klein reads hidden states 9, 18 and 27
    vae_channels: int = 8
    # overrides of a released model's sizes (the benchmark's proportions): double blocks, single blocks, text width
    double: int | None = None
    single: int | None = None
    text_hidden: int | None = None
    text_intermediate: int | None = None  # default: 2 x the text width
    seed: int = 0

    def sizes(self, size: str) -> tuple[int, int, int]:
        double, single, text = SIZES[size]
        return self.double or double, self.single or single, self.text_hidden or text


# (double blocks, single blocks, text encoder width) per released model
SIZES = {"4B": (5, 20, 32), "9B": (8, 24, 48), "dev": (8, 48, 32)}


def tiny_dit(spec: TinyFlux2Spec, size: str = "4B", *, guidance: bool = False, seed: int = 0):
    from diffusers import Flux2Transformer2DModel

    double, single, text = spec.sizes(size)
    torch.manual_seed(spec.seed + seed)
    dit = Flux2Transformer2DModel(
        patch_size=1, in_channels=128, num_layers=double, num_single_layers=single, attention_head_dim=spec.head_dim,
        num_attention_heads=spec.heads, joint_attention_dim=3 * text, timestep_guidance_channels=32,
        axes_dims_rope=[spec.head_dim // 4] * 4, guidance_embeds=guidance)
    return dit.eval()


def klein_tokenizer():
    """Qwen3's byte-level tokenizer in miniature with its chat template (thinking switched off on request)."""
    from ..z_image.tiny import z_image_tokenizer

    return z_image_tokenizer()


def tiny_qwen3(spec: TinyFlux2Spec, tok, hidden: int, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(spec.seed + 100 + seed)
    config = Qwen3Config(vocab_size=len(tok), hidden_size=hidden,
                         intermediate_size=spec.text_intermediate or 2 * hidden,
                         num_hidden_layers=spec.text_layers, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=hidden // 2, max_position_embeddings=1024, rope_theta=1e6, tie_word_embeddings=True,
                         bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
                         eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tok.pad_token_id)
    return Qwen3ForCausalLM(config).eval()


def tiny_vae(spec: TinyFlux2Spec):
    """The FLUX.2 autoencoder at the released 32 latent channels (128 once patched), tiny widths."""
    from ..parts import tiny_flux2_vae

    return tiny_flux2_vae(latent_channels=32, width=spec.vae_channels, seed=spec.seed + 3)


# Mistral-Small-3.1's turns as its chat template renders a system and a user message (text content parts).
DEV_CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['content'] is string %}{% set t = m['content'] %}"
                     "{% else %}{% set t = m['content'] | map(attribute='text') | join('') %}{% endif %}"
                     "{% if m['role'] == 'system' %}{{ '[SYSTEM_PROMPT]' + t + '[/SYSTEM_PROMPT]' }}"
                     "{% else %}{{ '[INST]' + t + '[/INST]' }}{% endif %}{% endfor %}")
DEV_TEXT_LAYERS = 30  # dev reads hidden states 10, 20 and 30


def dev_tokenizer():
    from ..parts import mistral_tokenizer

    tok = mistral_tokenizer()
    tok.chat_template = DEV_CHAT_TEMPLATE
    return tok


def tiny_dev_text_encoder(spec: TinyFlux2Spec, tok):
    """FLUX.2-dev's text encoder class (`Mistral3ForConditionalGeneration`) around a tiny Mistral-Small-3.1."""
    from difftune.parts.mistral3 import MISTRAL_SMALL_3_1_TEXT_CONFIG

    from ..parts import tiny_mistral3, tiny_text_config

    cfg = tiny_text_config(MISTRAL_SMALL_3_1_TEXT_CONFIG, vocab_size=len(tok), hidden=32, layers=DEV_TEXT_LAYERS)
    cfg["tie_word_embeddings"] = True  # transformers ties the tiny model's head anyway: say so, so it is not stored
    return tiny_mistral3(cfg, conditional_generation=True, seed=spec.seed + 7)


def _save(model, folder: Path, shard: bool) -> None:
    model.save_pretrained(folder, max_shard_size="1MB" if shard else "10GB")


def _write_scheduler(repo: Path) -> None:
    (repo / "scheduler").mkdir(parents=True, exist_ok=True)
    (repo / "scheduler" / "scheduler_config.json").write_text(json.dumps(SCHEDULER_CONFIG, indent=2))


def write_tiny_klein(repo: str | os.PathLike, size: str = "4B", spec: TinyFlux2Spec | None = None, *,
                     shard: bool = True) -> Path:
    """A distilled klein's layout: transformer/, text_encoder/, vae/, tokenizer/, scheduler/, model_index.json (what
    diffusers' `Flux2KleinPipeline.from_pretrained` reads)."""
    quiet_hf()
    spec = spec or TinyFlux2Spec()
    repo = Path(repo)
    tok = klein_tokenizer()
    tok.save_pretrained(repo / "tokenizer")
    _save(tiny_dit(spec, size, seed=1 if size == "4B" else 2), repo / "transformer", shard)
    _save(tiny_qwen3(spec, tok, spec.sizes(size)[2], seed=0 if size == "4B" else 1), repo / "text_encoder", shard)
    tiny_vae(spec).save_pretrained(repo / "vae")
    _write_scheduler(repo)
    index = {"_class_name": "Flux2KleinPipeline", "_diffusers_version": "0.42.1", "is_distilled": True,
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
             "text_encoder": ["transformers", "Qwen3ForCausalLM"], "tokenizer": ["transformers", "Qwen2Tokenizer"],
             "transformer": ["diffusers", "Flux2Transformer2DModel"], "vae": ["diffusers", "AutoencoderKLFlux2"]}
    (repo / "model_index.json").write_text(json.dumps(index, indent=2))
    return repo


def write_tiny_flux2_hub(base: str | os.PathLike, spec: TinyFlux2Spec | None = None, *, shard: bool = True,
                         dev: bool = False) -> Path:
    """The tiny klein models (and FLUX.2-dev with `dev`) under `base` at the hub ids the scripts name; returns
    `base`."""
    spec = spec or TinyFlux2Spec()
    base = Path(base)
    write_tiny_klein(base / KLEIN_4B, "4B", spec, shard=shard)
    write_tiny_klein(base / KLEIN_9B, "9B", spec, shard=shard)
    for repo, size, seed in ((KLEIN_BASE_4B, "4B", 3), (KLEIN_BASE_9B, "9B", 4)):
        _save(tiny_dit(spec, size, seed=seed), base / repo / "transformer", shard)
        _write_scheduler(base / repo)
    if dev:
        write_tiny_dev(base / DEV, spec, shard=shard)
    return base


def write_tiny_dev(repo: str | os.PathLike, spec: TinyFlux2Spec | None = None, *, shard: bool = True) -> Path:
    """FLUX.2-dev's layout: transformer/ (8 + 48 blocks, guidance embedder), text_encoder/ (a whole Mistral-3 in
    transformers 4's layout), vae/, tokenizer/, scheduler/, model_index.json."""
    from ..parts import write_mistral3_folder

    quiet_hf()
    spec = spec or TinyFlux2Spec()
    repo = Path(repo)
    tok = dev_tokenizer()
    tok.save_pretrained(repo / "tokenizer")
    _save(tiny_dit(spec, "dev", guidance=True, seed=6), repo / "transformer", shard)
    write_mistral3_folder(tiny_dev_text_encoder(spec, tok), repo / "text_encoder")
    tiny_vae(spec).save_pretrained(repo / "vae")
    _write_scheduler(repo)
    index = {"_class_name": "Flux2Pipeline", "_diffusers_version": "0.42.1",
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
             "text_encoder": ["transformers", "Mistral3ForConditionalGeneration"],
             "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
             "transformer": ["diffusers", "Flux2Transformer2DModel"], "vae": ["diffusers", "AutoencoderKLFlux2"]}
    (repo / "model_index.json").write_text(json.dumps(index, indent=2))
    return repo


def dev_model_paths(base: str | os.PathLike) -> list:
    return [hub_entry(base, DEV, f) for f in ("transformer", "text_encoder", "vae")]


def load_tiny_dev(base: str | os.PathLike, dtype=torch.float32):
    from difftune.families.flux2.pipeline import Flux2Pipeline
    from difftune.models import ModelConfig

    return Flux2Pipeline.from_pretrained(torch_dtype=dtype, device="cpu",
                                         model_configs=[ModelConfig(p) for p in dev_model_paths(base)],
                                         tokenizer_config=ModelConfig(str(Path(base) / DEV / "tokenizer")))


def write_bfl_single_file(base: str | os.PathLike, repo: str, path: str | os.PathLike) -> Path:
    """`repo`'s tiny DiT as BFL's single file behind ComfyUI's `model.diffusion_model.`."""
    from safetensors.torch import load_file, save_file

    from difftune.families.flux2.components import bfl_dit_keys

    state = {}
    for f in hub_paths(base, repo, "transformer"):
        state.update(load_file(f))
    path = Path(path)
    save_file({"model.diffusion_model." + k: v.contiguous() for k, v in bfl_dit_keys(state).items()}, str(path))
    return path


def hub_paths(base: str | os.PathLike, repo: str, folder: str, pattern: str = "*.safetensors") -> list[str]:
    return sorted(str(p) for p in (Path(base) / repo / folder).glob(pattern))


def hub_entry(base, repo: str, folder: str):
    paths = hub_paths(base, repo, folder)
    return paths if len(paths) > 1 else paths[0]


def klein_model_paths(base: str | os.PathLike, dit_repo: str = KLEIN_4B) -> list:
    """--model_paths entries: `dit_repo`'s transformer with the matching distilled klein's text encoder and VAE."""
    encoder_repo = KLEIN_9B if "9B" in dit_repo else KLEIN_4B
    return [hub_entry(base, dit_repo, "transformer"), hub_entry(base, encoder_repo, "text_encoder"),
            hub_entry(base, encoder_repo, "vae")]


def load_tiny_klein(base: str | os.PathLike, dit_repo: str = KLEIN_4B, dtype=torch.float32):
    """The tiny models of `write_tiny_flux2_hub(base)` as a `Flux2Pipeline`."""
    from difftune.families.flux2.pipeline import Flux2Pipeline
    from difftune.models import ModelConfig

    encoder_repo = KLEIN_9B if "9B" in dit_repo else KLEIN_4B
    configs = [ModelConfig(p) for p in klein_model_paths(base, dit_repo)]
    return Flux2Pipeline.from_pretrained(torch_dtype=dtype, device="cpu", model_configs=configs,
                                         tokenizer_config=ModelConfig(str(Path(base) / encoder_repo / "tokenizer")))


def _tiny_flux2(folder: Path) -> TinyFamily:
    from difftune.families.flux2.components import LORA_TARGET_MODULES

    from ..common import TinyVariant
    from .scripts import write_edit_dataset

    base = write_tiny_flux2_hub(folder / "hub")
    variants = {"edit": TinyVariant(flags=("--data_file_keys", "image,edit_image", "--extra_inputs", "edit_image",
                                           "--edit_image_auto_resize", "false"), write_dataset=write_edit_dataset)}
    return TinyFamily(model_paths=klein_model_paths(base), lora_base_model="dit",
                      lora_target_modules=LORA_TARGET_MODULES,
                      write_dataset=lambda root: write_example_dataset(root, n=2, size=(32, 32)),
                      flags=("--max_pixels", "1024", "--tokenizer_path", str(base / KLEIN_4B / "tokenizer")),
                      trainable_cases={"text_encoder_lora": ("--lora_base_model", "text_encoder",
                                                             "--lora_target_modules", "q_proj,v_proj")},
                      # measured: the DiT LoRA within 3e-5; the text encoder's q/v LoRA 4.7e-5 after 4 steps (lr 1e-3):
                      # its 27 layers pass gradients of ~1e-8 to the early layers, which Adam's first steps scale
                      # up to a part of lr (the field's note)
                      split_tolerance=1e-4, variants=variants)


register_tiny("flux2", _tiny_flux2)

__all__ = ["DEV", "dev_model_paths", "dev_tokenizer", "hub_entry", "hub_paths", "KLEIN_4B", "KLEIN_9B",
           "KLEIN_BASE_4B", "KLEIN_BASE_9B", "klein_model_paths", "klein_tokenizer", "load_tiny_dev",
           "load_tiny_klein", "SIZES", "tiny_dit", "tiny_qwen3", "tiny_vae", "TinyFlux2Spec",
           "write_bfl_single_file", "write_tiny_dev", "write_tiny_flux2_hub", "write_tiny_klein"]
