"""Tiny, randomly initialised ERNIE-Image models in the layout the reference's scripts name, and tiny data sets.

`write_tiny_ernie_image_hub(base)` lays out, under a model base path (`DIFFTUNE_MODEL_BASE_PATH`), what both scripts
load: `PaddlePaddle/ERNIE-Image` with `transformer/` (sharded), `text_encoder/model.safetensors` (a whole Mistral-3
in transformers 4's layout, vision tower included, with the multimodal config.json), `vae/` (the FLUX.2
autoencoder), `tokenizer/` and `scheduler/`. Everything is seeded: two processes write bit-identical files.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..common import TinyFamily, quiet_hf, register_tiny, write_example_dataset
from ..parts import mistral_tokenizer, tiny_flux2_vae, tiny_mistral3, tiny_text_config, write_mistral3_folder

REPO = "PaddlePaddle/ERNIE-Image"
SCHEDULER_CONFIG = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0,
                    "use_dynamic_shifting": False}


@dataclass
class TinyErnieImageSpec:
    """Sizes of a tiny ERNIE-Image: the official latent layout (128 patched channels), a narrow DiT and encoder."""

    hidden: int = 64
    heads: int = 2  # head 32: RoPE axes 8/12/12 as the official 32/48/48 of 128
    layers: int = 2
    ffn: int = 96
    text_hidden: int = 32
    text_layers: int = 3
    text_heads: int = 2
    text_head_dim: int = 16
    text_intermediate: int = 64
    vae_width: int = 8
    seed: int = 0


def _randomise(module: torch.nn.Module, seed: int, scale: float = 0.05) -> None:
    """Give zero-initialised parts (the shared AdaLN, the final linear) random values, so a test sees them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(module.named_parameters()):
            if not p.abs().sum():
                p.copy_(torch.randn(p.shape, generator=g) * scale)


def tiny_dit(spec: TinyErnieImageSpec, seed: int = 0):
    from diffusers import ErnieImageTransformer2DModel

    torch.manual_seed(spec.seed + seed)
    head = spec.hidden // spec.heads
    dit = ErnieImageTransformer2DModel(hidden_size=spec.hidden, num_attention_heads=spec.heads,
                                       num_layers=spec.layers, ffn_hidden_size=spec.ffn, in_channels=128,
                                       out_channels=128, patch_size=1, text_in_dim=spec.text_hidden,
                                       rope_axes_dim=(head // 4, head * 3 // 8, head * 3 // 8))
    _randomise(dit, spec.seed + seed + 100)
    return dit.eval()


def tiny_text_encoder(spec: TinyErnieImageSpec, tok):
    """ERNIE-Image's class, diffusers' `Mistral3Model` (a Ministral-3 language model and a Pixtral tower)."""
    from difftune.parts.mistral3 import MINISTRAL3_3B_TEXT_CONFIG

    cfg = tiny_text_config(MINISTRAL3_3B_TEXT_CONFIG, vocab_size=len(tok), hidden=spec.text_hidden,
                           layers=spec.text_layers, heads=spec.text_heads, head_dim=spec.text_head_dim,
                           intermediate=spec.text_intermediate)
    return tiny_mistral3(cfg, seed=spec.seed + 2)


def tiny_vae(spec: TinyErnieImageSpec):
    return tiny_flux2_vae(latent_channels=32, width=spec.vae_width, seed=spec.seed + 3)


def write_tiny_ernie_image(repo: str | os.PathLike, spec: TinyErnieImageSpec | None = None, *, shard: bool = True
                           ) -> Path:
    """PaddlePaddle/ERNIE-Image's layout: transformer/, text_encoder/, vae/, tokenizer/, scheduler/."""
    quiet_hf()
    spec = spec or TinyErnieImageSpec()
    repo = Path(repo)
    tok = mistral_tokenizer()
    tok.save_pretrained(repo / "tokenizer")
    tiny_dit(spec).save_pretrained(repo / "transformer", max_shard_size="100KB" if shard else "10GB")
    write_mistral3_folder(tiny_text_encoder(spec, tok), repo / "text_encoder")
    tiny_vae(spec).save_pretrained(repo / "vae")
    (repo / "scheduler").mkdir(parents=True, exist_ok=True)
    (repo / "scheduler" / "scheduler_config.json").write_text(json.dumps(SCHEDULER_CONFIG, indent=2))
    return repo


def write_tiny_ernie_image_hub(base: str | os.PathLike, spec: TinyErnieImageSpec | None = None, *,
                               shard: bool = True) -> Path:
    """The tiny models under `base` at the hub id the scripts name; returns `base`."""
    base = Path(base)
    write_tiny_ernie_image(base / REPO, spec, shard=shard)
    return base


def hub_paths(base: str | os.PathLike, folder: str, pattern: str = "*.safetensors") -> list[str]:
    return sorted(str(p) for p in (Path(base) / REPO / folder).glob(pattern))


def ernie_image_model_paths(base: str | os.PathLike) -> list:
    """--model_paths entries (a shard list where a model is sharded) of the tiny ERNIE-Image."""
    entries = [hub_paths(base, f) for f in ("transformer", "text_encoder", "vae")]
    return [e if len(e) > 1 else e[0] for e in entries]


def load_tiny_ernie_image(base: str | os.PathLike, dtype=torch.float32):
    """The tiny models of `write_tiny_ernie_image_hub(base)` as an `ErnieImagePipeline`."""
    from difftune.families.ernie_image.pipeline import ErnieImagePipeline
    from difftune.models import ModelConfig

    configs = [ModelConfig(e) for e in ernie_image_model_paths(base)]
    return ErnieImagePipeline.from_pretrained(torch_dtype=dtype, device="cpu", model_configs=configs,
                                              tokenizer_config=ModelConfig(str(Path(base) / REPO / "tokenizer")))


def _tiny_ernie_image(folder: Path) -> TinyFamily:
    from difftune.families.ernie_image.components import LORA_TARGET_MODULES

    base = write_tiny_ernie_image_hub(folder / "hub")
    return TinyFamily(model_paths=ernie_image_model_paths(base), lora_base_model="dit",
                      lora_target_modules=LORA_TARGET_MODULES,
                      write_dataset=lambda root: write_example_dataset(root, n=2, size=(32, 32)),
                      flags=("--max_pixels", "1024"),
                      trainable_cases={"text_encoder_lora": ("--lora_base_model", "text_encoder",
                                                             "--lora_target_modules", "q_proj,v_proj")})


register_tiny("ernie_image", _tiny_ernie_image)

__all__ = ["REPO", "TinyErnieImageSpec", "ernie_image_model_paths", "hub_paths", "load_tiny_ernie_image",
           "tiny_dit", "tiny_text_encoder", "tiny_vae", "write_tiny_ernie_image", "write_tiny_ernie_image_hub"]
