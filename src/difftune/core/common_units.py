"""Units whose maths several families share. A family subclasses them under its own name (unit names are part
of a cache's fingerprint) and supplies what differs, e.g. how its VAE normalises latents."""

from __future__ import annotations

from ..errors import UserError
from ..media.image import images_to_tensor
from .latents import seeded_noise
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


class NoiseInitializer(PipelineUnit):
    """Initial noise of the target's primary stream (its `noise_shape` for the size) from `seed`, drawn on
    `rand_device` (the CPU by default, so a seed gives the same noise anywhere)."""

    inputs = ("height", "width", "seed", "batch_size", "rand_device")
    outputs = ("noise",)

    def process(self, pipe, height, width, seed, batch_size, rand_device):
        noise = seeded_noise(pipe.stream.noise_shape(pipe, height, width), seed, batch_size,
                             device=rand_device or "cpu")
        return {"noise": noise.to(device=pipe.device, dtype=pipe.torch_dtype)}


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
