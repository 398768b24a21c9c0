"""Wan's image-conditioned features: image-to-video's VAE condition, CLIP's image tokens and TI2V-5B's clean first
frame. Their part of the denoiser call is the DiT's own inputs (model_fn.py), so they declare units and inputs only."""

from __future__ import annotations

from ...core.features import Feature
from .units import WanImageEmbedderCLIP, WanImageEmbedderFused, WanImageEmbedderVAE


def latent_channels(context) -> int:
    """The run's latent channels: the VAE's (48 for Wan2.2's TI2V VAE), else the DiT's, else 16."""
    vae, dit = context.config("vae") or {}, context.config("dit") or {}
    return int(vae.get("z_dim") or dit.get("out_channels") or 16)


def dit_extra_channels(context) -> int | None:
    """The DiT's input channels beyond the latents' (the conditions it takes on channels), None when no DiT."""
    dit = context.config("dit")
    if not dit or dit.get("in_channels") is None:
        return None
    return int(dit["in_channels"]) - int(dit.get("out_channels") or dit["in_channels"])


CLIP = Feature("clip", when=lambda c: c.has("input_image") and c.config("image_encoder") is not None,
               model_fn_inputs=("image_embeds", "end_image_embeds"), data_inputs=("input_image", "end_image"),
               units=(WanImageEmbedderCLIP(),),
               description="Wan2.1 I2V 14B / FLF2V: CLIP's embedding of the input (and end) image")
I2V = Feature("i2v", when=lambda c: c.has("input_image") and latent_channels(c) != 48,
              model_fn_inputs=("condition",), data_inputs=("input_image", "end_image"),
              units=(WanImageEmbedderVAE(),),
              description="image-to-video (Wan2.1 I2V / FLF2V, Wan2.2 I2V-A14B): the input (and end) image as the "
                          "known frames of a VAE-encoded condition")
TI2V = Feature("ti2v", when=lambda c: c.has("input_image") and latent_channels(c) == 48,
               model_fn_inputs=("first_frame_latents",), data_inputs=("input_image",),
               units=(WanImageEmbedderFused(),),
               description="Wan2.2 TI2V-5B: the input image as the clean first latent frame")

__all__ = ["CLIP", "I2V", "TI2V", "dit_extra_channels", "latent_channels"]
