"""Tiny, randomly initialised SDXL models in the layout the reference's scripts name, and tiny data.

`write_tiny_sdxl_hub(base)` lays out, under a model base path (`DIFFTUNE_MODEL_BASE_PATH`), what both scripts load:
`stabilityai/stable-diffusion-xl-base-1.0` with `unet/`, `vae/`, `text_encoder/model.safetensors` (CLIP-L),
`text_encoder_2/model.safetensors` (bigG with its projection), each beside its config.json, `tokenizer/`,
`tokenizer_2/` and `scheduler/`. The UNet has SDXL's two layers per level (the LDM names count by them), text-time
conditioning and linear projections; everything is seeded."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..common import TinyFamily, quiet_hf, register_tiny, write_example_dataset
from ..tokenizers import clip_tokenizer

REPO = "stabilityai/stable-diffusion-xl-base-1.0"
SCHEDULER_CONFIG = {"_class_name": "EulerDiscreteScheduler", "beta_end": 0.012, "beta_schedule": "scaled_linear",
                    "beta_start": 0.00085, "clip_sample": False, "interpolation_type": "linear",
                    "num_train_timesteps": 1000, "prediction_type": "epsilon", "sample_max_value": 1.0,
                    "set_alpha_to_one": False, "skip_prk_steps": True, "steps_offset": 1,
                    "timestep_spacing": "leading", "trained_betas": None, "use_karras_sigmas": False}


@dataclass
class TinySDXLSpec:
    channels: tuple = (32, 64)
    text_hidden: int = 32
    text_2_hidden: int = 32
    projection: int = 32
    time_dim: int = 8
    sdxl_blocks: bool = False  # SDXL's block layout at tiny widths (the scripts' workspace)
    seed: int = 0


def tiny_unet(spec: TinySDXLSpec):
    from diffusers import UNet2DConditionModel

    torch.manual_seed(spec.seed)
    if spec.sdxl_blocks:  # SDXL's three levels and 1 / 2 / 10 transformer layers: every module the scripts name
        levels = {"block_out_channels": (32, 64, 64), "attention_head_dim": (2, 4, 4),
                  "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                  "up_block_types": ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
                  "transformer_layers_per_block": (1, 2, 10)}
    else:
        levels = {"block_out_channels": spec.channels, "attention_head_dim": (4, 8),
                  "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D"),
                  "up_block_types": ("CrossAttnUpBlock2D", "UpBlock2D"), "transformer_layers_per_block": (1, 1)}
    return UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=2, **levels,
        cross_attention_dim=spec.text_hidden + spec.text_2_hidden, norm_num_groups=8,
        use_linear_projection=True, addition_embed_type="text_time",
        addition_time_embed_dim=spec.time_dim, projection_class_embeddings_input_dim=spec.time_dim * 6 + spec.projection
    ).eval()


def tiny_vae(spec: TinySDXLSpec):
    from diffusers import AutoencoderKL

    torch.manual_seed(spec.seed + 1)
    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                         up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8,) * 4, layers_per_block=1,
                         latent_channels=4, norm_num_groups=4, sample_size=64, scaling_factor=0.13025,
                         force_upcast=True).eval()


def _clip_config(tok, hidden: int, projection: int, act: str):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=37, num_hidden_layers=3,
                          num_attention_heads=2, max_position_embeddings=77, projection_dim=projection, hidden_act=act,
                          bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


def tiny_text_encoders(spec: TinySDXLSpec, tok):
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(spec.seed + 2)
    one = CLIPTextModel(_clip_config(tok, spec.text_hidden, spec.text_hidden, "quick_gelu")).eval()
    torch.manual_seed(spec.seed + 3)
    two = CLIPTextModelWithProjection(_clip_config(tok, spec.text_2_hidden, spec.projection, "gelu")).eval()
    return one, two


def write_tiny_sdxl(repo: str | os.PathLike, spec: TinySDXLSpec | None = None) -> Path:
    quiet_hf()
    spec = spec or TinySDXLSpec()
    repo = Path(repo)
    tok = clip_tokenizer()
    tok.save_pretrained(repo / "tokenizer")
    tok.save_pretrained(repo / "tokenizer_2")
    tiny_unet(spec).save_pretrained(repo / "unet")
    tiny_vae(spec).save_pretrained(repo / "vae")
    one, two = tiny_text_encoders(spec, tok)
    one.save_pretrained(repo / "text_encoder")
    two.save_pretrained(repo / "text_encoder_2")
    (repo / "scheduler").mkdir(parents=True, exist_ok=True)
    (repo / "scheduler" / "scheduler_config.json").write_text(json.dumps(SCHEDULER_CONFIG, indent=2))
    return repo


def write_tiny_sdxl_hub(base: str | os.PathLike, spec: TinySDXLSpec | None = None) -> Path:
    base = Path(base)
    write_tiny_sdxl(base / REPO, spec)
    return base


def sdxl_model_paths(base: str | os.PathLike) -> list[str]:
    """--model_paths of the tiny SDXL (the scripts' four files), the UNet first (the family's own model)."""
    repo = Path(base) / REPO
    return [str(repo / "unet" / "diffusion_pytorch_model.safetensors"),
            str(repo / "text_encoder" / "model.safetensors"), str(repo / "text_encoder_2" / "model.safetensors"),
            str(repo / "vae" / "diffusion_pytorch_model.safetensors")]


def load_tiny_sdxl(base: str | os.PathLike, dtype=torch.float32):
    from difftune.families.stable_diffusion_xl.pipeline import StableDiffusionXLPipeline
    from difftune.models import ModelConfig

    repo = Path(base) / REPO
    return StableDiffusionXLPipeline.from_pretrained(
        torch_dtype=dtype, device="cpu", model_configs=[ModelConfig(p) for p in sdxl_model_paths(base)],
        tokenizer_config=ModelConfig(str(repo / "tokenizer")), tokenizer_2_config=ModelConfig(str(repo / "tokenizer_2")))


def _tiny_sdxl(folder: Path) -> TinyFamily:
    base = write_tiny_sdxl_hub(folder / "hub")
    return TinyFamily(model_paths=sdxl_model_paths(base), lora_base_model="unet", lora_target_modules="to_q,to_v,ff.net.2",
                      write_dataset=lambda root: write_example_dataset(root, n=2, size=(40, 32)),
                      flags=("--height", "32", "--width", "32"),
                      trainable_cases={"text_encoder_2_lora": ("--lora_base_model", "text_encoder_2",
                                                               "--lora_target_modules", "q_proj,v_proj")})


register_tiny("stable_diffusion_xl", _tiny_sdxl)

__all__ = ["REPO", "TinySDXLSpec", "load_tiny_sdxl", "sdxl_model_paths", "tiny_text_encoders", "tiny_unet", "tiny_vae",
           "write_tiny_sdxl", "write_tiny_sdxl_hub"]
