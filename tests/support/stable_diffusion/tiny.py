"""Tiny, randomly initialised Stable Diffusion 1.x models in the layout the reference's scripts name, and tiny data.

`write_tiny_sd_hub(base)` lays out, under a model base path (`DIFFTUNE_MODEL_BASE_PATH`), what both scripts load:
`AI-ModelScope/stable-diffusion-v1-5` with `unet/`, `vae/`, `text_encoder/model.safetensors` (each beside its
config.json, as the release), `tokenizer/` and `scheduler/`. Everything is seeded: two processes write bit-identical
files.

`wide=True` gives the UNet a 512-channel block and a 512-wide time embedding: the reference's automatic LoRA targets
(`--lora_target_modules ""`: Linear layers of at least 512 features in block lists) are then that block's ResNet
time projections, as 17 of SD 1.5's 121 are."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..common import TinyFamily, quiet_hf, register_tiny, write_example_dataset
from ..tokenizers import clip_tokenizer

REPO = "AI-ModelScope/stable-diffusion-v1-5"
SCHEDULER_CONFIG = {"_class_name": "PNDMScheduler", "beta_end": 0.012, "beta_schedule": "scaled_linear",
                    "beta_start": 0.00085, "clip_sample": False, "num_train_timesteps": 1000,
                    "set_alpha_to_one": False, "skip_prk_steps": True, "steps_offset": 1, "trained_betas": None}


@dataclass
class TinySDSpec:
    channels: tuple = (32, 64)
    text_hidden: int = 32
    text_layers: int = 2
    vae_width: int = 8
    wide: bool = False
    seed: int = 0


def tiny_unet(spec: TinySDSpec):
    from diffusers import UNet2DConditionModel

    torch.manual_seed(spec.seed)
    channels = (spec.channels[0], 512) if spec.wide else spec.channels
    extra = {"time_embedding_dim": 512, "mid_block_type": None} if spec.wide else {}
    return UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=channels,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=spec.text_hidden, attention_head_dim=8, norm_num_groups=8, **extra).eval()


def tiny_vae(spec: TinySDSpec):
    from diffusers import AutoencoderKL

    torch.manual_seed(spec.seed + 1)
    c = spec.vae_width
    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                         up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(c,) * 4, layers_per_block=1,
                         latent_channels=4, norm_num_groups=4, sample_size=64, scaling_factor=0.18215).eval()


def tiny_text_encoder(spec: TinySDSpec, tok):
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(spec.seed + 2)
    return CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tok), hidden_size=spec.text_hidden, intermediate_size=37, num_hidden_layers=spec.text_layers,
        num_attention_heads=2, max_position_embeddings=77, projection_dim=spec.text_hidden, hidden_act="quick_gelu",
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)).eval()


def write_tiny_sd(repo: str | os.PathLike, spec: TinySDSpec | None = None) -> Path:
    """stable-diffusion-v1-5's diffusers layout: unet/, vae/, text_encoder/, tokenizer/, scheduler/."""
    quiet_hf()
    spec = spec or TinySDSpec()
    repo = Path(repo)
    tok = clip_tokenizer()
    tok.save_pretrained(repo / "tokenizer")
    tiny_unet(spec).save_pretrained(repo / "unet")
    tiny_vae(spec).save_pretrained(repo / "vae")
    tiny_text_encoder(spec, tok).save_pretrained(repo / "text_encoder")
    (repo / "scheduler").mkdir(parents=True, exist_ok=True)
    (repo / "scheduler" / "scheduler_config.json").write_text(json.dumps(SCHEDULER_CONFIG, indent=2))
    return repo


def write_tiny_sd_hub(base: str | os.PathLike, spec: TinySDSpec | None = None) -> Path:
    """The tiny models under `base` at the hub id the scripts name; returns `base`."""
    base = Path(base)
    write_tiny_sd(base / REPO, spec)
    return base


def sd_model_paths(base: str | os.PathLike) -> list[str]:
    """--model_paths of the tiny SD 1.5 (the scripts' three files), the UNet first (the family's own model)."""
    repo = Path(base) / REPO
    return [str(repo / "unet" / "diffusion_pytorch_model.safetensors"), str(repo / "text_encoder" / "model.safetensors"),
            str(repo / "vae" / "diffusion_pytorch_model.safetensors")]


def load_tiny_sd(base: str | os.PathLike, dtype=torch.float32):
    """The tiny models of `write_tiny_sd_hub(base)` as a `StableDiffusionPipeline`."""
    from difftune.families.stable_diffusion.pipeline import StableDiffusionPipeline
    from difftune.models import ModelConfig

    return StableDiffusionPipeline.from_pretrained(
        torch_dtype=dtype, device="cpu", model_configs=[ModelConfig(p) for p in sd_model_paths(base)],
        tokenizer_config=ModelConfig(str(Path(base) / REPO / "tokenizer")))


def _tiny_sd(folder: Path) -> TinyFamily:
    base = write_tiny_sd_hub(folder / "hub")
    return TinyFamily(model_paths=sd_model_paths(base), lora_base_model="unet", lora_target_modules="to_q,to_v,ff.net.2",
                      write_dataset=lambda root: write_example_dataset(root, n=2, size=(32, 32)),
                      flags=("--height", "32", "--width", "32"),
                      trainable_cases={"text_encoder_lora": ("--lora_base_model", "text_encoder",
                                                             "--lora_target_modules", "q_proj,v_proj")})


register_tiny("stable_diffusion", _tiny_sd)

__all__ = ["REPO", "TinySDSpec", "load_tiny_sd", "sd_model_paths", "tiny_text_encoder", "tiny_unet", "tiny_vae",
           "write_tiny_sd", "write_tiny_sd_hub"]
