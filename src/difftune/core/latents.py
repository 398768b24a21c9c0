"""Latent maths several families share: 2x2 patch tokens (Qwen-Image, FLUX) and seeded initial noise."""

from __future__ import annotations

import torch


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) latents -> (B, H/2*W/2, C*4) tokens of 2x2 patches (channel-major within a token)."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The inverse of `pack_latents` for latent size (height, width)."""
    b, _, d = tokens.shape
    x = tokens.view(b, height // 2, width // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, d // 4, height, width)


def seeded_noise(shape: tuple[int, ...], seed, batch_size: int | None, device: str = "cpu") -> torch.Tensor:
    """Initial noise (B, *shape) in float32 drawn on `device`: one generator per sample when `seed` is a list
    (training samples, each from its own seed), else one for the whole batch as diffusers draws it; no seed:
    a random one."""

    def draw(n, s):
        generator = torch.Generator(device)
        generator.manual_seed(int(s)) if s is not None else generator.seed()
        return torch.randn((n, *shape), generator=generator, device=device, dtype=torch.float32)

    if isinstance(seed, (list, tuple)):
        return torch.cat([draw(1, s) for s in seed])
    return draw(batch_size or 1, seed)
