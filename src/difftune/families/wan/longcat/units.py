"""LongCat-Video's input (`longcat_video`, the frames a continuation starts from), its feature and unit."""

from __future__ import annotations

from ....core.features import Feature
from ....core.units import PipelineUnit
from ..units import vae_encode, video_tensor
from ..variant import dit_class

FEATURE = "longcat"


class LongCatVideoEmbedder(PipelineUnit):
    """`longcat_video` (the frames a continuation starts from) -> their VAE latents, kept clean in front."""

    feature = FEATURE
    inputs = ("longcat_video", "height", "width")
    outputs = ("longcat_latents",)
    models = ("vae",)
    skip_without = ("longcat_video",)

    def process(self, pipe, longcat_video, height, width):
        return {"longcat_latents": vae_encode(pipe, video_tensor(longcat_video, height, width)).to(pipe.torch_dtype)}


def is_longcat(context) -> bool:
    return dit_class(context) == "LongCatVideoTransformer3DModel"


LONGCAT = Feature(name=FEATURE, when=lambda c: is_longcat(c) or c.has("longcat_video"),
                  model_fn_inputs=("longcat_latents",), data_inputs=("longcat_video",),
                  description="LongCat-Video: its own text-to-video DiT over Wan's VAE and UMT5 (with longcat_video, "
                              "a continuation of that clip's first frames, given clean)")


__all__ = ["FEATURE", "LONGCAT", "LongCatVideoEmbedder", "is_longcat"]
