"""The FLUX.2 autoencoder (diffusers' `AutoencoderKLFlux2`: 32 latent channels at 1/8 of the image, a 2x2 patch
and a BatchNorm's running statistics that normalise the patched latents): its config, its recognition markers and
the latent maths the pipelines built on it share. FLUX.2 (dev / klein), ERNIE-Image and Ideogram-4 ship it, each as
a diffusers `vae/` folder.

Latent layouts:
  * channel-major patches (FLUX.2, ERNIE-Image): (B, 32, h, w) -> (B, 32*4, h/2, w/2), channel index c*4 + 2*p + q,
    which is the order the BatchNorm's 128 statistics are kept in;
  * tokens: (B, C, H, W) <-> (B, H*W, C) (FLUX.2's sequence, row-major);
  * patch-major tokens (Ideogram-4): (B, 32, h, w) -> (B, (h/2)*(w/2), 4*32), channel index (2*p + q)*32 + c.
"""

from __future__ import annotations

import torch

VAE_SCALE = 8  # image pixels per latent pixel
PATCH = 2  # latent pixels per side of a patch
LATENT_CHANNELS = 32
PATCHED_CHANNELS = LATENT_CHANNELS * PATCH * PATCH

# black-forest-labs/FLUX.2-dev vae/config.json (also FLUX.2-klein's, PaddlePaddle/ERNIE-Image's and Ideogram-4's).
FLUX2_VAE_CONFIG = {
    "_class_name": "AutoencoderKLFlux2",
    "act_fn": "silu",
    "batch_norm_eps": 0.0001,
    "batch_norm_momentum": 0.1,
    "block_out_channels": [128, 256, 512, 512],
    "decoder_block_out_channels": None,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "in_channels": 3,
    "latent_channels": 32,
    "layers_per_block": 2,
    "mid_block_add_attention": True,
    "norm_num_groups": 32,
    "out_channels": 3,
    "patch_size": [2, 2],
    "sample_size": 1024,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "use_post_quant_conv": True,
    "use_quant_conv": True,
}
# diffusers' names; the BatchNorm's statistics tell it from the FLUX.1 AE (which has the same convolutions' names).
FLUX2_VAE_MARKER_KEYS = ("encoder.conv_in.weight", "decoder.conv_in.weight", "bn.running_mean", "bn.running_var")


def flux2_vae_config_from_weights(shapes: dict) -> dict | None:
    """An AutoencoderKLFlux2 of any width and depth from its weights (tiny test models; the official one is matched
    by `FLUX2_VAE_CONFIG`)."""
    if "bn.running_var" not in shapes or "encoder.conv_in.weight" not in shapes:
        return None
    downs = sorted({int(k.split(".")[2]) for k in shapes if k.startswith("encoder.down_blocks.")})
    widths = [shapes[f"encoder.down_blocks.{i}.resnets.0.conv1.weight"][0] for i in downs]
    latent = shapes["decoder.conv_in.weight"][1]
    patch = int(round((shapes["bn.running_var"][0] / latent) ** 0.5))
    layers = len({k.split(".")[4] for k in shapes if k.startswith("encoder.down_blocks.0.resnets.")})
    groups = 32 if all(w % 32 == 0 for w in widths) else min(widths)
    return {**FLUX2_VAE_CONFIG, "block_out_channels": widths, "latent_channels": latent,
            "down_block_types": ["DownEncoderBlock2D"] * len(widths), "up_block_types": ["UpDecoderBlock2D"] * len(widths),
            "layers_per_block": layers, "norm_num_groups": groups, "patch_size": [patch, patch],
            "use_quant_conv": "quant_conv.weight" in shapes, "use_post_quant_conv": "post_quant_conv.weight" in shapes,
            "mid_block_add_attention": "encoder.mid_block.attentions.0.to_q.weight" in shapes}


# -- layouts ------------------------------------------------------------------------------------------

def patchify(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, 4C, H/2, W/2), channel-major (the BatchNorm's order)."""
    b, c, h, w = latents.shape
    x = latents.reshape(b, c, h // PATCH, PATCH, w // PATCH, PATCH).permute(0, 1, 3, 5, 2, 4)
    return x.reshape(b, c * PATCH * PATCH, h // PATCH, w // PATCH)


def unpatchify(latents: torch.Tensor) -> torch.Tensor:
    """The inverse of `patchify`."""
    b, c, h, w = latents.shape
    x = latents.reshape(b, c // (PATCH * PATCH), PATCH, PATCH, h, w).permute(0, 1, 4, 2, 5, 3)
    return x.reshape(b, c // (PATCH * PATCH), h * PATCH, w * PATCH)


def to_tokens(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H*W, C), row-major."""
    b, c, h, w = latents.shape
    return latents.reshape(b, c, h * w).transpose(1, 2)


def from_tokens(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(B, H*W, C) -> (B, C, H, W): the inverse of `to_tokens`."""
    b, _, c = tokens.shape
    return tokens.transpose(1, 2).reshape(b, c, height, width)


def patch_major_tokens(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, (H/2)*(W/2), 4C) with channel index (2p + q)*C + c (Ideogram-4's token layout)."""
    b, c, h, w = latents.shape
    x = latents.reshape(b, c, h // PATCH, PATCH, w // PATCH, PATCH).permute(0, 2, 4, 3, 5, 1)
    return x.reshape(b, (h // PATCH) * (w // PATCH), PATCH * PATCH * c)


def from_patch_major_tokens(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The inverse of `patch_major_tokens`; `height` and `width` are the latent's (before patching)."""
    b, _, d = tokens.shape
    c = d // (PATCH * PATCH)
    x = tokens.reshape(b, height // PATCH, width // PATCH, PATCH, PATCH, c).permute(0, 5, 1, 3, 2, 4)
    return x.reshape(b, c, height, width)


# -- the BatchNorm's statistics -------------------------------------------------------------------------

def bn_stats(vae, eps: float | None = None, device=None, dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The running mean and std (sqrt(var + eps)) as 1-D tensors over the patched channels. `eps` defaults to the
    config's `batch_norm_eps`; ERNIE-Image's pipeline uses its trained 1e-5 instead."""
    eps = vae.config.batch_norm_eps if eps is None else eps
    mean = vae.bn.running_mean.to(device=device, dtype=torch.float32)
    std = torch.sqrt(vae.bn.running_var.to(device=device, dtype=torch.float32) + eps)
    return mean.to(dtype or mean.dtype), std.to(dtype or std.dtype)


def normalize(latents: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, channel_dim: int = 1) -> torch.Tensor:
    """(z - mean) / std along `channel_dim` (1 for (B, C, H, W), -1 for tokens)."""
    shape = [1] * latents.ndim
    shape[channel_dim] = -1
    return (latents - mean.view(shape).to(latents)) / std.view(shape).to(latents)


def denormalize(latents: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, channel_dim: int = 1) -> torch.Tensor:
    shape = [1] * latents.ndim
    shape[channel_dim] = -1
    return latents * std.view(shape).to(latents) + mean.view(shape).to(latents)


# -- encode / decode ------------------------------------------------------------------------------------

def encode(vae, images: torch.Tensor, eps: float | None = None) -> torch.Tensor:
    """(B, 3, H, W) in [-1, 1] -> patched, normalised latents (B, 128, H/16, W/16), the posterior's mode
    (deterministic, as the pipelines' `argmax` sample mode)."""
    z = vae.encode(images.to(dtype=vae.dtype)).latent_dist.mode()
    mean, std = bn_stats(vae, eps, device=z.device)
    return normalize(patchify(z.float()), mean, std)


def decode(vae, latents: torch.Tensor, eps: float | None = None) -> torch.Tensor:
    """The inverse of `encode`: (B, 128, h, w) patched, normalised latents -> (B, 3, 16h, 16w) in about [-1, 1]."""
    mean, std = bn_stats(vae, eps, device=latents.device)
    z = unpatchify(denormalize(latents.float(), mean, std))
    return vae.decode(z.to(vae.dtype), return_dict=False)[0]


__all__ = ["FLUX2_VAE_CONFIG", "FLUX2_VAE_MARKER_KEYS", "LATENT_CHANNELS", "PATCH", "PATCHED_CHANNELS", "VAE_SCALE",
           "bn_stats", "decode", "denormalize", "encode", "flux2_vae_config_from_weights", "from_patch_major_tokens",
           "from_tokens", "normalize", "patch_major_tokens", "patchify", "to_tokens", "unpatchify"]
