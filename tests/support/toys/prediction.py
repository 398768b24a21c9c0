"""`toy_eps` and `toy_v`: image families whose denoisers predict the noise (epsilon) and the velocity (v), trained
with DDPM's forward process and sampled with DDIM steps (core/target.py's prediction types; schedulers/diffusion.py).
Latents are a 4x4 patch encoding of the image (4 channels); the denoiser is the toys' sequence model."""

from __future__ import annotations

import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from torch import nn

from difftune import BasePipeline, FamilySpec, PipelineUnit, images_to_tensor, register_family
from difftune.core.batch import SAME
from difftune.core.common_units import ShapeChecker
from difftune.core.target import EPSILON, V_PREDICTION, ImageStream, Target
from support import TinyFamily, register_tiny, write_example_dataset

from .common import PromptUnit, SeqDenoiser, TextEncoder, components, save_models, seeded

PATCH = 4


class ImageAE(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(self, channels: int = 4):
        super().__init__()
        self.encoder = nn.Conv2d(3, channels, PATCH, stride=PATCH)

    def encode(self, images):
        return self.encoder(images)


def decode(pipe, latents):  # a preview: the first three channels, upsampled
    return torch.nn.functional.interpolate(latents[:, :3].float(), scale_factor=PATCH).tanh()


class Noise(PipelineUnit):
    inputs = ("height", "width", "seed", "batch_size")
    outputs = ("noise",)

    def process(self, pipe, height, width, seed, batch_size):
        return {"noise": seeded((batch_size or 1, *pipe.stream.noise_shape(pipe, height, width)), seed, pipe)}


class Encoder(PipelineUnit):
    """Clean latents in training; noised to the first DDIM timestep for image-to-image."""

    inputs = ("input_image", "noise", "height", "width")
    outputs = ("latents", "input_latents")
    models = ("vae",)

    def process(self, pipe, input_image, noise, height, width):
        if input_image is None:
            return {"latents": noise}
        clean = pipe.vae.encode(images_to_tensor(input_image, height, width).to(pipe.device, pipe.torch_dtype))
        if pipe.scheduler.training:
            return {"latents": noise, "input_latents": clean}
        return {"latents": pipe.scheduler.start_latents(clean, noise), "input_latents": clean}


def model_fn(pipe, latents, timestep, prompt_emb, use_gradient_checkpointing=False,
             use_gradient_checkpointing_offload=False, **_):
    b, c, h, w = latents.shape
    (out,) = pipe.dit.run([latents.flatten(2).transpose(1, 2)], timestep.float(), prompt_emb,
                          use_gradient_checkpointing, use_gradient_checkpointing_offload)
    return out.transpose(1, 2).reshape(b, c, h, w)


def make_family(name: str, prediction: str):
    """One family: its own model classes (recognition tells families apart by them), pipeline and spec."""
    classes = {slot: type(f"{name.title().replace('_', '')}{base.__name__}", (base,), {"__module__": __name__})
               for slot, base in (("dit", SeqDenoiser), ("text_encoder", TextEncoder), ("vae", ImageAE))}
    globals().update({cls.__name__: cls for cls in classes.values()})  # importable by name, as recognition loads

    pipeline = type(f"{name.title().replace('_', '')}Pipeline", (BasePipeline,), {
        "__module__": __name__, "model_names": ("dit", "text_encoder", "vae"), "loss_models": ("dit",),
        "settings": frozenset({"batch_size", "use_gradient_checkpointing", "use_gradient_checkpointing_offload"}),
        "model_fn_inputs": ("prompt_emb",), "data_inputs": ("image", "prompt", "seed"),
        "input_batching": {"height": SAME, "width": SAME},
        "call_defaults": {"height": 32, "width": 32, "num_inference_steps": 4, "cfg_scale": 1.0},
        "target": Target((ImageStream(channels=4, scale=PATCH, division=PATCH, decoder=decode,
                                      decode_models=()),), prediction=prediction),
        "scheduler_config": {"num_train_timesteps": 1000, "beta_schedule": "scaled_linear"},
        "base_units": (ShapeChecker, Noise, Encoder, PromptUnit), "model_fn": model_fn})
    spec = register_family(FamilySpec(name=name, pipeline=pipeline, components=components(__name__, classes),
                                      lora_prefixes={"dit": "transformer"}, lora_target_modules="modulation,mlp"))

    def tiny(folder):
        return TinyFamily(model_paths=save_models(folder, classes), lora_base_model="dit", lora_target_modules="mlp",
                          write_dataset=lambda root: write_example_dataset(root, n=2, size=(32, 24)))

    register_tiny(name, tiny)
    return spec


EPS = make_family("toy_eps", EPSILON)
V = make_family("toy_v", V_PREDICTION)
