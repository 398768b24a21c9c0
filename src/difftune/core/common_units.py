"""Units whose maths several families share. A family subclasses them under its own name (unit names are part
of a cache's fingerprint) and supplies what differs, e.g. how its VAE normalises latents."""

from __future__ import annotations

from ..errors import UserError
from ..media.image import images_to_tensor
from .units import PipelineUnit


class ShapeChecker(PipelineUnit):
    """Round height and width up to multiples of the target's primary stream's `division`."""

    inputs = ("height", "width")
    outputs = ("height", "width")

    def process(self, pipe, height, width):
        if height is None or width is None:
            raise UserError("height and width are required (or an input image to take them from)")
        f = pipe.stream.division
        return {"height": -(-int(height) // f) * f, "width": -(-int(width) // f) * f}


class InputImageEmbedder(PipelineUnit):
    """Encode the input image: clean latents in training; noised to the first timestep for image-to-image.

    `encode(pipe, images)` is the family's VAE encode (normalisation included); it is called with the unit's
    view of the pipeline, so it reaches only the declared models."""

    inputs = ("input_image", "noise", "height", "width")
    outputs = ("latents", "input_latents")
    models = ("vae",)
    encode = None  # staticmethod(vae_encode) in the family's subclass

    def process(self, pipe, input_image, noise, height, width):
        if input_image is None:
            return {"latents": noise}
        input_latents = type(self).encode(pipe, images_to_tensor(input_image, height, width))
        if pipe.scheduler.training:
            return {"latents": noise, "input_latents": input_latents}
        latents = pipe.scheduler.add_noise(input_latents, noise, pipe.scheduler.sigmas[0])
        return {"latents": latents, "input_latents": input_latents}
