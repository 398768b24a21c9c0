"""A toy model family, written from docs/adding_a_family.md and nothing else.

Three tiny models (a conv "image encoder", an embedding + linear "prompt encoder", a denoiser of
gradient-checkpointed blocks), four units, a model_fn and the pipeline; registered so that
`difftune train --family toy` trains it one-stage or split, through the same code as Qwen-Image.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from torch import nn

from support import register_tiny
from difftune import (BasePipeline, ComponentSpec, FamilySpec, PipelineUnit, UserError,
                      gradient_checkpoint_forward, images_to_tensor, register_family)
from difftune.core.features import IMAGE, Feature
from difftune.core.target import ImageStream, Target

PATCH = 4  # the image encoder's stride: latents are 1/4 of the image
PROMPT_LENGTH = 16  # prompts are byte-tokenised to a fixed length, so no padding mask is needed


# -- the models (diffusers ModelMixin + ConfigMixin: from_config and save_pretrained for free) --------------

class ToyImageEncoder(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(self, latent_channels: int = 4):
        super().__init__()
        self.conv = nn.Conv2d(3, latent_channels, PATCH, stride=PATCH)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.conv(images)


class ToyPromptEncoder(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(self, dim: int = 16):
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.proj(self.embed(ids))


class ToyBlock(nn.Module):
    """Modulated conv block: the unit of gradient checkpointing."""

    def __init__(self, channels: int, dim: int):
        super().__init__()
        self.modulation = nn.Linear(dim, 2 * channels)
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        scale, shift = self.modulation(cond)[:, :, None, None].chunk(2, dim=1)
        return x + self.conv(torch.nn.functional.silu(x * (1 + scale) + shift))


class ToyDenoiser(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(self, latent_channels: int = 4, dim: int = 16, num_blocks: int = 2):
        super().__init__()
        self.time_embed = nn.Linear(1, dim)
        self.blocks = nn.ModuleList(ToyBlock(latent_channels, dim) for _ in range(num_blocks))
        self.out = nn.Conv2d(latent_channels, latent_channels, 1)


# -- the units ------------------------------------------------------------------------------------------

class ToyShapeChecker(PipelineUnit):
    inputs = ("height", "width")
    outputs = ("height", "width")

    def process(self, pipe, height, width):
        if height is None or width is None:
            raise UserError("height and width are required (or an input image to take them from)")
        f = pipe.stream.division
        return {"height": -(-int(height) // f) * f, "width": -(-int(width) // f) * f}


class ToyNoiseInitializer(PipelineUnit):
    inputs = ("height", "width", "seed", "batch_size")
    outputs = ("noise",)

    def process(self, pipe, height, width, seed, batch_size):
        generator = torch.Generator("cpu")
        generator.manual_seed(int(seed)) if seed is not None else generator.seed()
        shape = (batch_size or 1, 4, height // PATCH, width // PATCH)
        return {"noise": torch.randn(shape, generator=generator).to(pipe.device, pipe.torch_dtype)}


class ToyImageEncoderUnit(PipelineUnit):
    """Clean latents in training (the loss noises them); noised to the first timestep for image-to-image."""

    inputs = ("input_image", "noise", "height", "width")
    outputs = ("latents", "input_latents")
    models = ("image_encoder",)

    def process(self, pipe, input_image, noise, height, width):
        if input_image is None:
            return {"latents": noise}
        images = images_to_tensor(input_image, height, width).to(pipe.device, pipe.torch_dtype)
        input_latents = pipe.image_encoder(images)
        if pipe.scheduler.training:
            return {"latents": noise, "input_latents": input_latents}
        latents = pipe.scheduler.add_noise(input_latents, noise, pipe.scheduler.sigmas[0])
        return {"latents": latents, "input_latents": input_latents}


def tokenize(prompts: list[str]) -> torch.Tensor:
    rows = [list(p.encode("utf-8"))[:PROMPT_LENGTH] for p in prompts]
    return torch.tensor([r + [0] * (PROMPT_LENGTH - len(r)) for r in rows])


class ToyReferenceUnit(PipelineUnit):
    """The "reference" feature: an optional reference image, encoded at the output size; model_fn adds it."""

    inputs = ("reference_image", "height", "width")
    outputs = ("reference_latents",)
    models = ("image_encoder",)
    feature = "reference"

    def process(self, pipe, reference_image, height, width):
        if reference_image is None:
            return {}
        images = images_to_tensor(reference_image, height, width).to(pipe.device, pipe.torch_dtype)
        return {"reference_latents": pipe.image_encoder(images)}


class ToyPromptEncoderUnit(PipelineUnit):
    cfg_inputs = {"prompt": ("prompt", "negative_prompt")}
    cfg_outputs = {"prompt_emb": ("prompt_emb", "negative_prompt_emb")}
    models = ("prompt_encoder",)

    def process(self, pipe, prompt):
        if prompt is None:
            return {}
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        return {"prompt_emb": pipe.prompt_encoder(tokenize(prompts).to(pipe.device)).to(pipe.torch_dtype)}


# -- model_fn -------------------------------------------------------------------------------------------

def model_fn_toy(denoiser, latents, timestep, prompt_emb, reference_latents=None, use_gradient_checkpointing=False,
                 use_gradient_checkpointing_offload=False, **_: Any) -> torch.Tensor:
    """One denoiser call: latents (B, 4, h, w), timestep (B,) in [0, 1000] -> velocity (B, 4, h, w)."""
    t = timestep.to(latents.device, latents.dtype).reshape(-1, 1).expand(latents.shape[0], 1)
    cond = denoiser.time_embed(t / 1000) + prompt_emb.mean(dim=1)
    x = latents if reference_latents is None else latents + reference_latents.to(latents.dtype)
    for block in denoiser.blocks:
        x = gradient_checkpoint_forward(block, use_gradient_checkpointing, use_gradient_checkpointing_offload,
                                        x, cond=cond)
    return denoiser.out(x)


# -- the pipeline ---------------------------------------------------------------------------------------

REFERENCE = Feature("reference", columns=("reference_image",), model_fn_inputs=("reference_latents",),
                    inputs={"reference_image": IMAGE})


def _preview(pipe, latents):
    """A preview without a decoder model: the first three latent channels, upsampled (validation renders it)."""
    return torch.nn.functional.interpolate(latents[:, :3].float(), scale_factor=PATCH).tanh()


class ToyPipeline(BasePipeline):
    model_names = ("denoiser", "image_encoder", "prompt_encoder")
    loss_models = ("denoiser",)
    settings = frozenset({"batch_size", "use_gradient_checkpointing", "use_gradient_checkpointing_offload"})
    model_fn_inputs = ("prompt_emb",)
    features = (REFERENCE,)
    data_inputs = ("image", "prompt", "seed")
    # what it generates: images of 4-channel latents at 1/4 the size (every row has one); decoded only as a preview
    target = Target((ImageStream(channels=4, scale=PATCH, division=PATCH, decoder=_preview, decode_models=(),
                                 required=True),))
    call_defaults = {"height": 32, "width": 32, "num_inference_steps": 4, "cfg_scale": 1.0}
    scheduler_config = {"shift": 3.0}  # a static time shift (diffusers' defaults otherwise)
    base_units = (ToyShapeChecker, ToyNoiseInitializer, ToyImageEncoderUnit, ToyReferenceUnit, ToyPromptEncoderUnit)

    def model_fn(self, latents, timestep, prompt_emb, reference_latents=None, **settings):
        return model_fn_toy(self.denoiser, latents, timestep, prompt_emb, reference_latents, **settings)

    def __call__(self, prompt: str, height: int = 32, width: int = 32, num_inference_steps: int = 4,
                 seed: int | None = None, cfg_scale: float = 1.0, input_image=None, denoising_strength: float = 1.0,
                 reference_image=None, output_type: str = "latent"):
        """Latents by default (the toy's decode is only a preview)."""
        values = {**self.prompt_values(prompt, ""), "height": height, "width": width, "seed": seed,
                  "input_image": input_image, "reference_image": reference_image}
        return self.generate(values, cfg_scale=cfg_scale, num_inference_steps=num_inference_steps,
                             denoising_strength=denoising_strength, progress=False, output_type=output_type)


# -- registration ---------------------------------------------------------------------------------------

FAMILY = register_family(FamilySpec(
    name="toy", pipeline=ToyPipeline,
    components=tuple(ComponentSpec(name=slot, library=__name__, class_name=cls.__name__)
                     for slot, cls in (("denoiser", ToyDenoiser), ("image_encoder", ToyImageEncoder),
                                       ("prompt_encoder", ToyPromptEncoder))),
    lora_prefixes={"denoiser": "denoiser", "prompt_encoder": "prompt_encoder"},
    lora_target_modules="modulation,conv"))


def write_toy_models(root, seed: int = 0) -> dict[str, str]:
    """Random toy weights saved as diffusers does (config.json + diffusion_pytorch_model.safetensors)."""
    root = Path(root)
    torch.manual_seed(seed)
    paths = {}
    for slot, cls in (("denoiser", ToyDenoiser), ("image_encoder", ToyImageEncoder),
                      ("prompt_encoder", ToyPromptEncoder)):
        cls().save_pretrained(root / slot)
        paths[slot] = str(root / slot / "diffusion_pytorch_model.safetensors")
    return paths


def _tiny(folder):
    from support import TinyFamily, write_example_dataset

    paths = write_toy_models(folder)
    return TinyFamily(model_paths=list(paths.values()), lora_base_model="denoiser",
                      lora_target_modules="modulation", write_dataset=lambda root: write_example_dataset(
                          root, n=2, size=(32, 24)),
                      trainable_cases={"prompt_encoder_lora": ("--lora_base_model", "prompt_encoder",
                                                               "--lora_target_modules", "proj"),
                                       "full_denoiser": ("--trainable_models", "denoiser")})


register_tiny("toy", _tiny)
