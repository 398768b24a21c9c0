"""The latent-diffusion UNet and its 4-channel KL autoencoder (diffusers' `UNet2DConditionModel` and `AutoencoderKL`
at the CompVis / Stability layouts): the autoencoder's configs and latent maths, one denoiser call, and the DDPM
training schedule the UNets were trained on (diffusers' `scheduler_config.json` of those repositories)."""

from __future__ import annotations

from typing import Any

import torch

from ..core.checkpointing import set_gradient_checkpointing

VAE_SCALE = 8
LATENT_CHANNELS = 4

# CompVis' KL-f8 autoencoder (SD 1.x / 2.x vae/); the SDXL one has the same tensors and another scale.
KL_F8_VAE_CONFIG = {
    "_class_name": "AutoencoderKL",
    "act_fn": "silu",
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "in_channels": 3,
    "latent_channels": 4,
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "out_channels": 3,
    "sample_size": 512,
    "scaling_factor": 0.18215,
}
KL_F8_XL_VAE_CONFIG = {**KL_F8_VAE_CONFIG, "sample_size": 1024, "scaling_factor": 0.13025, "force_upcast": True}
VAE_MARKER_KEYS = ("encoder.conv_in.weight", "decoder.conv_in.weight", "quant_conv.weight", "post_quant_conv.weight")
UNET_MARKER_KEYS = ("conv_in.weight", "time_embedding.linear_1.weight", "down_blocks.0.resnets.0.conv1.weight",
                    "conv_out.weight")

# The schedule every SD 1.x / SDXL UNet was trained on (their scheduler/scheduler_config.json): scaled-linear betas
# 0.00085 .. 0.012 over 1000 steps; sampling spaces its steps as diffusers' pipelines do ("leading", offset 1).
DDPM_SCHEDULER_CONFIG = {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012,
                         "beta_schedule": "scaled_linear", "clip_sample": False, "set_alpha_to_one": False,
                         "steps_offset": 1}
# Zero terminal SNR (Lin et al.): the betas rescaled so the last timestep is pure noise, sampled from it ("trailing"
# spacing); only a v-predicting model can learn that step (its noise is the input itself).
ZERO_TERMINAL_SNR = {"rescale_betas_zero_snr": True, "timestep_spacing": "trailing"}


# The single-file (LDM / SGM) checkpoints community models ship as: every model in one file behind these prefixes.
LDM_UNET_PREFIX, LDM_VAE_PREFIX = "model.diffusion_model.", "first_stage_model."


def unet_from_ldm(state: dict) -> dict:
    """A single file's UNet (`model.diffusion_model.*`, the original names) in diffusers' names, by diffusers' own
    converter; nothing from a file without it. The converter reads only the layers per level (2 in every SD 1.x /
    SDXL UNet) and whether the UNet has SDXL's text-time embedding."""
    if not any(k.startswith(LDM_UNET_PREFIX) for k in state):
        return {}
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

    config = {"layers_per_block": 2, "addition_embed_type": "text_time" if is_xl_file(state) else None,
              "class_embed_type": None}
    return convert_ldm_unet_checkpoint({k: v for k, v in state.items() if k.startswith(LDM_UNET_PREFIX)}, config)


def is_xl_file(state: dict) -> bool:
    """Whether a single file's UNet has SDXL's text-time embedding (its companions then are SDXL's, and not an SD
    1.x family's, though the autoencoder's tensors are alike)."""
    return f"{LDM_UNET_PREFIX}label_emb.0.0.weight" in state


def only_in(xl: bool, convert):
    """`convert` for the files of one of the two families only (nothing from the other's)."""
    return lambda state: convert(state) if is_xl_file(state) == xl else {}


def vae_from_ldm(state: dict) -> dict:
    """A single file's autoencoder (`first_stage_model.*`) in diffusers' names; nothing from a file without it."""
    part = {k: v for k, v in state.items() if k.startswith(LDM_VAE_PREFIX)}
    if not part:
        return {}
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    return convert_ldm_vae_checkpoint(part, KL_F8_VAE_CONFIG)


def _shift(vae) -> float:
    return float(getattr(vae.config, "shift_factor", None) or 0.0)


def vae_encode(pipe, images: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) in [-1, 1] -> latents z * scaling_factor, the posterior's mean (deterministic: a cached draw and
    a fresh one are the same; docs/reference_differences.md)."""
    vae = pipe.vae
    z = vae.encode(images.to(device=pipe.device, dtype=vae.dtype)).latent_dist.mode()
    return ((z.float() - _shift(vae)) * vae.config.scaling_factor).to(pipe.torch_dtype)


def vae_decode(pipe, latents: torch.Tensor) -> torch.Tensor:
    vae = pipe.vae
    z = latents.to(device=pipe.device, dtype=torch.float32) / vae.config.scaling_factor + _shift(vae)
    return vae.decode(z.to(vae.dtype)).sample


def unet_call(unet, latents: torch.Tensor, timestep: torch.Tensor, prompt_embeds: torch.Tensor, *,
              added_cond_kwargs: dict[str, torch.Tensor] | None = None, use_gradient_checkpointing: bool = False,
              use_gradient_checkpointing_offload: bool = False, **_: Any) -> torch.Tensor:
    """latents (B, 4, h, w), integer timesteps (B,) or (1,) in [0, 1000) -> the UNet's prediction (B, 4, h, w)."""
    b = latents.shape[0]
    dtype = unet.dtype
    t = timestep.to(device=latents.device).reshape(-1).expand(b)
    set_gradient_checkpointing(unet, use_gradient_checkpointing, use_gradient_checkpointing_offload)
    extra = None if added_cond_kwargs is None else {k: v.to(device=latents.device, dtype=dtype)
                                                     for k, v in added_cond_kwargs.items()}
    out = unet(latents.to(dtype), t, encoder_hidden_states=prompt_embeds.to(device=latents.device, dtype=dtype),
               added_cond_kwargs=extra, return_dict=False)[0]
    return out.to(latents.dtype)


__all__ = ["DDPM_SCHEDULER_CONFIG", "ZERO_TERMINAL_SNR", "KL_F8_VAE_CONFIG", "LDM_UNET_PREFIX", "LDM_VAE_PREFIX", "KL_F8_XL_VAE_CONFIG", "LATENT_CHANNELS", "UNET_MARKER_KEYS",
           "VAE_MARKER_KEYS", "VAE_SCALE", "is_xl_file", "only_in", "unet_call", "unet_from_ldm", "vae_decode", "vae_encode", "vae_from_ldm"]
