"""Halves of diffusers' LTX-2 VAEs, as DiffSynth-Studio's Repackage files hold them: `video_vae_encoder`,
`video_vae_decoder`, `audio_vae_encoder`, `audio_vae_decoder` (each with the latent statistics). Stage 1 needs only
the encoders and sampling only the decoders, so a slot holds one half: the class is diffusers' with the other half
removed after construction (the configs are diffusers' own, so a half loads from any file that has it)."""

from __future__ import annotations

import functools

from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video


def _half(base, keep: str, name: str, doc: str):
    drop = "decoder" if keep == "encoder" else "encoder"
    init = base.__init__

    @functools.wraps(init)  # the same signature: diffusers builds it from the same config
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        delattr(self, drop)

    def missing(self, *args, **kwargs):
        raise RuntimeError(f"{name} holds the {keep} only")

    attrs = {"__init__": __init__, "__doc__": doc, "__module__": __name__}
    attrs["decode" if keep == "encoder" else "encode"] = missing
    return type(name, (base,), attrs)


LTX2VideoVAEEncoder = _half(AutoencoderKLLTX2Video, "encoder", "LTX2VideoVAEEncoder",
                            "The LTX-2 video VAE's encoder and latent statistics (AutoencoderKLLTX2Video's).")
LTX2VideoVAEDecoder = _half(AutoencoderKLLTX2Video, "decoder", "LTX2VideoVAEDecoder",
                            "The LTX-2 video VAE's decoder and latent statistics (AutoencoderKLLTX2Video's).")
LTX2AudioVAEEncoder = _half(AutoencoderKLLTX2Audio, "encoder", "LTX2AudioVAEEncoder",
                            "The LTX-2 audio VAE's encoder and latent statistics (AutoencoderKLLTX2Audio's).")
LTX2AudioVAEDecoder = _half(AutoencoderKLLTX2Audio, "decoder", "LTX2AudioVAEDecoder",
                            "The LTX-2 audio VAE's decoder and latent statistics (AutoencoderKLLTX2Audio's).")

__all__ = ["LTX2AudioVAEDecoder", "LTX2AudioVAEEncoder", "LTX2VideoVAEDecoder", "LTX2VideoVAEEncoder"]
