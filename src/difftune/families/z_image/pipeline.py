"""`ZImagePipeline`: Z-Image, Z-Image-Turbo, Z-Image-Omni-Base (text-to-image and image(s)-to-image) and the Turbo
Fun ControlNets: inference and the training hooks.

One pipeline class with three features (`core/features.py`): `edit` (Omni-Base's edit images: VAE latents, SigLIP2
features and the prompt cut around the images' slots), `controlnet` (a Fun ControlNet's control image) and `omni`
(Omni-Base's DiT, read from its config). None changes the latent layout, the sampler or the guidance; which forward
the DiT runs follows from the loaded DiT (as in the reference), so no variant class is needed and stage 1 may name
no DiT. The row, the call and the stage-1 batches are the base pipeline's, from its target (images) and features (the
call's inputs by the reference's names: `call_inputs()`; edit.py and controlnet.py say what each takes).
"""

from __future__ import annotations

from ...core.pipeline import PromptImagePipeline
from ...core.target import ImageStream, Target
from ...errors import UserError
from ...parts.flux_ae import LATENT_CHANNELS, VAE_SCALE, vae_decode
from .components import SCHEDULER_CONFIG
from .controlnet import CONTROLNET
from .edit import EDIT, OMNI
from .model_fn import model_fn_z_image
from .prompt import ZImagePromptEmbedder
from .units import DIVISION_FACTOR, ZImageInputImageEmbedder, ZImageNoiseInitializer, ZImageShapeChecker

# Every sampling default of the family (the reference's and Z-Image-Turbo's: 8 steps without guidance). `cfg_scale`
# is the reference's (nega + s * (posi - nega)); diffusers' `guidance_scale` g is s = 1 + g.
CALL_DEFAULTS = {"height": 1024, "width": 1024, "num_inference_steps": 8, "cfg_scale": 1.0}


class ZImagePipeline(PromptImagePipeline):
    settings = frozenset({"batch_size", "rand_device", "use_gradient_checkpointing",
                          "use_gradient_checkpointing_offload", "control_inpaint_latents"})
    features = (EDIT, CONTROLNET, OMNI)  # each its own module (edit.py, controlnet.py)
    call_defaults = CALL_DEFAULTS
    target = Target((ImageStream(channels=LATENT_CHANNELS, scale=VAE_SCALE, patch=2,
                                 division=DIVISION_FACTOR, decoder=vae_decode),))
    scheduler_config = SCHEDULER_CONFIG  # a static shift of 3, which the reference also trains at
    base_units = (ZImageShapeChecker, ZImageNoiseInitializer, ZImageInputImageEmbedder, ZImagePromptEmbedder)

    # -- model_fn -------------------------------------------------------------------------------------
    def model_fn(self, latents, timestep, prompt_embeds, prompt_embeds_mask=None, **inputs):
        if self.dit is None:
            raise UserError("no Z-Image DiT loaded")
        return model_fn_z_image(self.dit, latents, timestep, prompt_embeds, prompt_embeds_mask, pipe=self,
                                features=self.features, **inputs)

    def set_timesteps(self, values, num_inference_steps: int, denoising_strength: float = 1.0) -> None:
        """Z-Image's static shift; image-to-image takes the reference's schedule (all steps from sigma = strength)."""
        self.scheduler.set_timesteps(num_inference_steps, denoising_strength=denoising_strength,
                                     strength_mode="diffsynth" if denoising_strength < 1 else "diffusers")


__all__ = ["CALL_DEFAULTS", "ZImagePipeline"]
