"""The Qwen-Image VAE (diffusers' `AutoencoderKLQwenImage`, a one-frame video VAE, x8, 16 channels): its official
config, its ComponentSpec and the normalised encode/decode of images."""

from __future__ import annotations

import torch

from ..models.detect import ComponentSpec

# Qwen/Qwen-Image's vae/config.json.
QWEN_IMAGE_VAE_CONFIG = {
    "_class_name": "AutoencoderKLQwenImage",
    "attn_scales": [],
    "base_dim": 96,
    "dim_mult": [1, 2, 4, 4],
    "dropout": 0.0,
    "latents_mean": [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                     0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921],
    "latents_std": [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.916],
    "num_res_blocks": 2,
    "temperal_downsample": [False, True, True],
    "z_dim": 16,
}
QWEN_IMAGE_VAE_MARKER_KEYS = ("encoder.conv_in.weight", "decoder.conv_in.weight", "quant_conv.weight",
                              "post_quant_conv.weight")


def qwen_image_vae_spec(extra_configs: dict[str, dict] | None = None) -> ComponentSpec:
    """The VAE slot: the official Qwen-Image VAE plus a family's own variants of it (label -> config)."""
    return ComponentSpec(
        name="vae", library="diffusers", class_name="AutoencoderKLQwenImage",
        known_configs={"Qwen/Qwen-Image VAE": QWEN_IMAGE_VAE_CONFIG, **(extra_configs or {})},
        marker_keys=QWEN_IMAGE_VAE_MARKER_KEYS, description="Qwen-Image VAE")


def convert_original_vae(state: dict) -> dict:
    """The VAE in its original single-file layout (ComfyUI's `qwen_image_vae.safetensors`: `encoder.conv1`,
    `encoder.downsamples.N`, `decoder.middle.N`, `conv1` / `conv2` for the quant convs) -> diffusers' names, by
    diffusers' own single-file converter for that layout (its names are AutoencoderKLQwenImage's too)."""
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    if "encoder.conv1.weight" not in state or "decoder.middle.0.residual.0.gamma" not in state:
        raise KeyError("not the original single-file VAE layout")
    return convert_wan_vae_to_diffusers(dict(state))


def vae_config_from_weights(shapes: dict) -> dict | None:
    """A Qwen-Image VAE of any width (diffusers' names, two residual blocks per level as the original layout has):
    the base width from the first convolution, each level's multiple from its first residual block."""
    if "encoder.conv_in.weight" not in shapes or "encoder.down_blocks.0.conv1.weight" not in shapes:
        return None
    base = shapes["encoder.conv_in.weight"][0]
    mult = [shapes[f"encoder.down_blocks.{3 * i}.conv2.weight"][0] // base for i in range(4)]
    return {**QWEN_IMAGE_VAE_CONFIG, "base_dim": base, "dim_mult": mult, "z_dim": shapes["conv1.weight"][0] // 2
            if "conv1.weight" in shapes else shapes["quant_conv.weight"][0] // 2}


def qwen_image_vae_original_spec() -> ComponentSpec:
    """The VAE slot for the Qwen-Image VAE saved in its original single-file layout (ComfyUI's split file)."""
    return ComponentSpec(
        name="vae", library="diffusers", class_name="AutoencoderKLQwenImage",
        known_configs={"Qwen/Qwen-Image VAE": QWEN_IMAGE_VAE_CONFIG},
        marker_keys=("encoder.conv1.weight", "decoder.middle.0.residual.0.gamma", "conv1.weight"),
        convert_state_dict=convert_original_vae,
        infer_config=vae_config_from_weights, description="Qwen-Image VAE, original single-file layout")


def _latent_stats(vae, dtype, device):
    mean = torch.tensor(vae.config.latents_mean, dtype=dtype, device=device).view(1, -1, 1, 1)
    std = torch.tensor(vae.config.latents_std, dtype=dtype, device=device).view(1, -1, 1, 1)
    return mean, std


def vae_encode(pipe, images: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) in [-1, 1] -> normalised latents (B, 16, H/8, W/8), the posterior mode (deterministic), in the
    pipeline's dtype."""
    vae = pipe.vae
    x = images.to(device=pipe.device, dtype=vae.dtype).unsqueeze(2)  # the VAE is a video VAE: one frame
    z = vae.encode(x).latent_dist.mode()[:, :, 0]
    mean, std = _latent_stats(vae, z.dtype, z.device)
    return ((z - mean) / std).to(pipe.torch_dtype)


def vae_decode(pipe, latents: torch.Tensor) -> torch.Tensor:
    """Normalised latents (B, 16, h, w) -> images (B, C, 8h, 8w) in about [-1, 1]."""
    vae = pipe.vae
    latents = latents.to(vae.dtype)
    mean, std = _latent_stats(vae, latents.dtype, latents.device)
    return vae.decode((latents * std + mean).unsqueeze(2)).sample[:, :, 0]


__all__ = ["QWEN_IMAGE_VAE_CONFIG", "QWEN_IMAGE_VAE_MARKER_KEYS", "convert_original_vae", "qwen_image_vae_original_spec",
           "qwen_image_vae_spec", "vae_config_from_weights", "vae_decode", "vae_encode"]
