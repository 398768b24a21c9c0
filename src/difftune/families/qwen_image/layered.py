"""Qwen-Image-Layered (and DiffSynth-Studio's -Layered-Control, -Control-V2): an image taken apart into RGBA layers.

A variant of the Qwen-Image family with its own pipeline class, `QwenImageLayeredPipeline`: the latent layout (a stack
of layers), `model_fn`, guidance and sampling differ. The text encoder is Qwen-Image's; the transformer and the VAE are
the same diffusers classes with other configs, so the class is chosen from the weights (the transformer's layer-3D
RoPE, the VAE's four input channels) or, where a stage names neither, from the data columns (`layer_input_image`,
`layer_num`): a row's `image` is then a list of layer files.

Layout: a stack of L + 1 latents is (B, 16, L + 1, h, w), the first being the composite (the reference's training
data lists it first; Qwen-Image-Layered-Control, with `layer_num` 0, generates only the layer it is asked for).
The denoiser sees each layer's 2x2 patch tokens in turn, then any context / edit tokens, then the input image's
tokens, with the layer-3D RoPE (the input image at layer index -1) and the "is RGB" flag 0, as diffusers'
`QwenImageLayeredPipeline` and the reference both call it. The loss is the reference's: flow matching over the whole
stack at one timestep per sample.

Sampling follows diffusers' `QwenImageLayeredPipeline` (the model authors' pipeline): sigmas linspace(1, 0, N + 1)
shifted with mu = sqrt(input-image tokens / 256) and plain classifier-free guidance. (DiffSynth-Studio samples with
Qwen-Image's linear mu instead; training does not depend on it.)
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Any

import torch
from PIL import Image

from ...core.checkpointing import set_gradient_checkpointing
from ...core.options import sample_input
from ...core.latents import pack_latents, seeded_noise, unpack_latents
from ...core.target import ImageStream, Target, make_grid
from ...core.units import PipelineUnit
from ...errors import UserError
from ...media.image import as_image_list, tensor_to_images
from .context import CONTEXT, QwenImageContextImageEmbedder
from .edit_plus import EDIT, QwenImageEditImageEmbedder, QwenImageEditPromptEmbedder
from .encoding import DIVISION_FACTOR, VAE_SCALE, encode_rgba, set_zero_cond_t, vae_decode
from .pipeline import CALL_DEFAULTS, QwenImageBasePipeline
from .prompt import QwenImagePromptEmbedder
from .units import QwenImageInputImageEmbedder, QwenImageShapeChecker

LAYER_COLUMNS = ("layer_input_image", "layer_num")


def is_layered_dit(dit) -> bool:
    return bool(getattr(getattr(dit, "config", None), "use_layer3d_rope", False))


def claims_layered(context) -> bool:
    """Qwen-Image-Layered's runs: its transformer, its RGBA VAE, or layer columns in the data."""
    dit, vae = context.config("dit") or {}, context.config("vae") or {}
    return bool(dit.get("use_layer3d_rope")) or vae.get("input_channels") == 4 or context.has(*LAYER_COLUMNS)


def _row(data) -> str:
    row = data.get("_row")
    return f"row {row + 1}" if isinstance(row, int) else "this sample"


def _layer_count(value, where: str) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise UserError(f"{where}: layer_num must be a whole number >= 0 (the layers besides the first), got {value!r}")
    return value


# -- data -----------------------------------------------------------------------------------------------------------

def data_operators(config) -> dict:
    """The reference's loaders: `layer_input_image` and the items of a list-valued `image` as RGBA (alpha kept),
    a single `image` as RGB."""
    from ...data import RouteByListing, UnifiedDataset

    def image_operator(mode):
        factor = DIVISION_FACTOR
        return UnifiedDataset.default_image_operator(
            base_path=config.dataset_base_path, height=config.height, width=config.width,
            max_pixels=config.max_pixels, height_division_factor=factor, width_division_factor=factor, mode=mode)

    return {"image": RouteByListing(image_operator("RGB"), image_operator("RGBA")),
            "layer_input_image": image_operator("RGBA")}


def layered_training_inputs(pipe, data: dict[str, Any], base) -> dict[str, Any]:
    """A Qwen-Image-Layered row as pipeline inputs: `image` is the stack of layers (the composite first),
    `layer_input_image` the image they are taken from, `layer_num` the layers besides the first (len(image) - 1)."""
    where = _row(data)
    layers = data.get("image")
    if not isinstance(layers, list) or not layers or not all(isinstance(i, Image.Image) for i in layers):
        raise UserError(f"{where}: Qwen-Image-Layered's 'image' must be a list of layer image files (a JSON list, "
                        f"the composite first), listed in --data_file_keys")
    sizes = {i.size for i in layers}
    if len(sizes) > 1:
        raise UserError(f"{where}: the layers of 'image' differ in size ({', '.join(f'{w}x{h}' for w, h in sorted(sizes))}); "
                        f"a stack needs one size")
    count = len(layers) - 1
    layer_num = data.get("layer_num")
    if layer_num is not None and _layer_count(layer_num, where) != count:
        raise UserError(f"{where}: layer_num is {layer_num} but 'image' lists {len(layers)} layers (layer_num + 1 "
                        f"are expected: the composite first)")
    condition = data.get("layer_input_image")
    if not isinstance(condition, Image.Image):
        raise UserError(f"{where}: Qwen-Image-Layered needs 'layer_input_image' (the image the layers are taken "
                        f"from) as an image file: name it in --extra_inputs and --data_file_keys")
    values = base(pipe, {**data, "image": None, **{k: None for k in LAYER_COLUMNS}})
    width, height = layers[0].size
    values.update(layer_images=layers, layer_input_image=condition, layer_num=count, height=height, width=width)
    return values


# -- units ----------------------------------------------------------------------------------------------------------

def layered_noise(pipe, height, width, seed, rand_device, batch_size, layer_num) -> torch.Tensor:
    """(B, 16, layers + 1, h, w) noise, drawn (B, layers + 1, 16, h, w) as diffusers and the reference draw it."""
    n = _layer_count(layer_num, "layer_num") + 1
    noise = seeded_noise((n, 16, height // VAE_SCALE, width // VAE_SCALE), seed, batch_size, rand_device)
    return noise.permute(0, 2, 1, 3, 4).contiguous().to(device=pipe.device, dtype=pipe.torch_dtype)


class QwenImageLayerStackEmbedder(PipelineUnit):
    """Training on Qwen-Image-Layered: the clean latents of the layer stack, each RGBA layer encoded with the RGBA VAE:
    input_latents (1, 16, layers + 1, h, w)."""

    inputs = ("layer_images", "height", "width")
    outputs = ("input_latents",)
    models = ("vae",)
    skip_without = ("layer_images",)

    def process(self, pipe, layer_images, height, width):
        latents = encode_rgba(pipe, as_image_list(layer_images), height, width)
        return {"input_latents": latents.permute(1, 0, 2, 3).unsqueeze(0)}


class QwenImageLayerInputEmbedder(PipelineUnit):
    """The image to take apart (RGBA; an RGB one gets an opaque alpha), resized to the output size and encoded:
    layer_input_latents (B, 16, h, w)."""

    inputs = ("layer_input_image", "height", "width", "batch_size")
    outputs = ("layer_input_latents",)
    models = ("vae",)
    skip_without = ("layer_input_image",)

    def process(self, pipe, layer_input_image, height, width, batch_size):
        latents = encode_rgba(pipe, as_image_list(layer_input_image), height, width)
        if latents.shape[0] == 1 and (batch_size or 1) > 1:  # one image for several prompts
            latents = latents.expand(batch_size, *latents.shape[1:])
        return {"layer_input_latents": latents}


# -- model_fn -------------------------------------------------------------------------------------------------------

def model_fn_qwen_image_layered(dit, latents: torch.Tensor, timestep: torch.Tensor, prompt_embeds: torch.Tensor,
                                prompt_embeds_mask: torch.Tensor | None = None,
                                layer_input_latents: torch.Tensor | None = None,
                                context_latents: torch.Tensor | None = None, edit_latents=None,
                                use_gradient_checkpointing: bool = False,
                                use_gradient_checkpointing_offload: bool = False, zero_cond_t: bool = False,
                                **_: Any) -> torch.Tensor:
    """One denoiser call on a layer stack: latents (B, 16, L + 1, h, w) -> velocity of the same shape.

    Tokens: each layer's patches in turn, then context, edit and input-image tokens (the reference's order; the
    layer-3D RoPE gives the last entry, the input image, layer index -1)."""
    if latents.dim() != 5:
        raise UserError("the transformer is Qwen-Image-Layered's: it generates a stack of layers (the data's 'image' "
                        "a list of layers with layer_input_image and layer_num; sampling: layer_input_image= and "
                        "layer_num=)")
    if not is_layered_dit(dit):
        raise UserError("layer stacks (a list-valued 'image', layer_input_image, layer_num) need Qwen-Image-Layered's "
                        "transformer (layer-3D RoPE); the transformer loaded is a plain Qwen-Image one")
    if layer_input_latents is None:
        raise UserError("Qwen-Image-Layered needs layer_input_image (the image the layers are taken from)")
    b, _, frames, h, w = latents.shape
    tokens = torch.cat([pack_latents(latents[:, :, i]) for i in range(frames)], dim=1)
    image_len = tokens.shape[1]
    shapes = [(1, h // 2, w // 2)] * frames
    edits = [] if edit_latents is None else list(edit_latents) if isinstance(edit_latents, (list, tuple)) \
        else [edit_latents]
    for extra in [c for c in (context_latents,) if c is not None] + edits + [layer_input_latents]:
        tokens = torch.cat([tokens, pack_latents(extra.to(tokens.dtype))], dim=1)
        shapes.append((1, extra.shape[-2] // 2, extra.shape[-1] // 2))
    set_gradient_checkpointing(dit, use_gradient_checkpointing, use_gradient_checkpointing_offload)
    set_zero_cond_t(dit, zero_cond_t)
    timestep = timestep.to(device=latents.device, dtype=latents.dtype).expand(b)
    is_rgb = None
    if getattr(dit.config, "use_additional_t_cond", False):
        is_rgb = torch.zeros(b, dtype=torch.long, device=latents.device)  # 0: RGBA layers, as both pipelines pass
    out = dit(hidden_states=tokens, timestep=timestep / 1000, encoder_hidden_states=prompt_embeds,
              encoder_hidden_states_mask=prompt_embeds_mask, img_shapes=[shapes] * b, additional_t_cond=is_rgb,
              return_dict=False)[0]
    n = (h // 2) * (w // 2)
    out = out[:, :image_len]
    return torch.stack([unpack_latents(out[:, i * n:(i + 1) * n], h, w) for i in range(frames)], dim=2)


# -- the pipeline ---------------------------------------------------------------------------------------------------

def layered_mu(height: int, width: int) -> float:
    """diffusers' time shift for Qwen-Image-Layered: sqrt of the input image's 2x2-patch tokens over 256."""
    return math.sqrt((-(-height // DIVISION_FACTOR)) * (-(-width // DIVISION_FACTOR)) / 256)


def decode_layers(pipe, latents: torch.Tensor) -> torch.Tensor:
    """(B, 16, L + 1, h, w) -> images (B, L + 1, 4, H, W) in [-1, 1], one layer at a time."""
    return torch.stack([torch.stack([vae_decode(pipe, latents[b:b + 1, :, i])[0] for i in range(latents.shape[2])])
                        for b in range(latents.shape[0])])


class QwenImageLayeredNoiseInitializer(PipelineUnit):
    """The initial noise of a stack of `layer_num` + 1 layers, (B, 16, layers + 1, h, w)."""

    inputs = ("height", "width", "seed", "rand_device", "batch_size", "layer_num")
    outputs = ("noise",)

    def process(self, pipe, height, width, seed, rand_device, batch_size, layer_num):
        if layer_num is None:
            raise UserError("Qwen-Image-Layered needs layer_num (how many layers besides the first)")
        rand_device = rand_device or "cpu"
        if isinstance(rand_device, (list, tuple)):
            rand_device = rand_device[0]
        return {"noise": layered_noise(pipe, height, width, seed, rand_device, batch_size, layer_num)}


class QwenImageLayeredContextImageEmbedder(QwenImageContextImageEmbedder):
    """Layered-Control-V2's control image, through the RGBA VAE."""

    @staticmethod
    def encode(pipe, images, height, width) -> torch.Tensor:
        return encode_rgba(pipe, images, height, width)


def _before(unit, *names: str):
    unit.before = names
    return unit


# Its features: the edit images encoded before the image to take apart, the control image through the RGBA VAE.
LAYERED_EDIT = replace(EDIT, units=(_before(QwenImageEditImageEmbedder(), "QwenImageLayerInputEmbedder"),
                                    QwenImageEditPromptEmbedder()))
LAYERED_CONTEXT = replace(CONTEXT, units=(QwenImageLayeredContextImageEmbedder(),))


@dataclass(frozen=True, eq=False)
class LayerStack(ImageStream):
    """Per prompt a stack of RGBA layers: one file per layer (NAME-layer<k>.EXT), a row of layers over white in
    validation."""

    def postprocess(self, pipe, latents, output_type="pil"):
        """"pt": a tensor (B, L + 1, 4, H, W) in [0, 1]."""
        if output_type == "latent":
            return latents
        images = decode_layers(pipe, latents)
        if output_type == "pt":
            return (images.float() / 2 + 0.5).clamp(0, 1)
        return [tensor_to_images(stack) for stack in images]

    def write(self, output, path, **options):
        root, ext = os.path.splitext(path)
        written = []
        for k, layer in enumerate(output):
            written += super().write(layer, f"{root}-layer{k}{ext}")
        return written

    def preview(self, outputs, path):
        from ...io import atomic_save_image

        grid = make_grid([make_grid(stack) for stack in outputs], columns=1)
        atomic_save_image(grid, path)
        return grid, None


class QwenImageLayeredPipeline(QwenImageBasePipeline):
    """Take an image apart into RGBA layers (DiffSynth-Studio's Qwen-Image-Layered, -Layered-Control, -V2)."""

    model_fn_inputs = ("prompt_embeds", "prompt_embeds_mask", "layer_input_latents")
    features = (LAYERED_EDIT, LAYERED_CONTEXT)
    data_inputs = (*QwenImageBasePipeline.data_inputs, *LAYER_COLUMNS)
    encode_alone = True  # stacks are encoded one at a time
    sample_flags = {"layer_input_image": sample_input("Qwen-Image-Layered: the image to take apart (RGBA).",
                                                      load="RGBA"),
                    "layer_num": sample_input("Qwen-Image-Layered: layers besides the first (writes NAME-layer<k>.png "
                                              "per layer).", kind=int)}
    target = Target((LayerStack(channels=16, scale=VAE_SCALE, patch=2, division=DIVISION_FACTOR),))

    base_units = (QwenImageShapeChecker, QwenImageLayeredNoiseInitializer, QwenImageInputImageEmbedder,
                  QwenImageLayerStackEmbedder, QwenImageLayerInputEmbedder, QwenImagePromptEmbedder)

    @classmethod
    def claims(cls, context) -> bool:
        return claims_layered(context)

    @classmethod
    def data_operators(cls, config) -> dict:
        return data_operators(config)

    def model_fn(self, latents, timestep, prompt_embeds, prompt_embeds_mask=None, edit_latents=None,
                 layer_input_latents=None, **settings):
        return model_fn_qwen_image_layered(self.dit, latents, timestep, prompt_embeds, prompt_embeds_mask,
                                           layer_input_latents, edit_latents=edit_latents, **settings)

    def combine_cfg(self, posi, nega, cfg_scale):
        return nega + cfg_scale * (posi - nega)  # plain guidance (diffusers' cfg_normalize=False)

    def set_timesteps(self, values, num_inference_steps, denoising_strength=1.0):
        latents = values.get("latents")
        if isinstance(latents, torch.Tensor):
            height, width = (side * VAE_SCALE for side in latents.shape[-2:])
        else:
            height, width = int(values["height"]), int(values["width"])
        self.scheduler.set_timesteps(num_inference_steps, mu=layered_mu(height, width))

    def training_inputs(self, data):
        return layered_training_inputs(self, data, QwenImageBasePipeline.training_inputs)

    def __call__(self, prompt, negative_prompt="", cfg_scale: float = CALL_DEFAULTS["cfg_scale"],
                 height: int | None = CALL_DEFAULTS["height"], width: int | None = CALL_DEFAULTS["width"],
                 num_inference_steps: int = CALL_DEFAULTS["num_inference_steps"], seed: int | None = None,
                 layer_input_image=None, layer_num: int | None = None, rand_device: str = "cpu",
                 progress: bool = True, output_type: str = "pil", zero_cond_t: bool = False, **inputs):
        """Take `layer_input_image` apart into `layer_num` + 1 RGBA layers (per prompt: a list of images; "pt": a
        tensor (B, L + 1, 4, H, W) in [0, 1]; "latent": the latents). `inputs`: the features' (Layered-Control's
        control image, edit images) by the reference's names."""
        if layer_input_image is None:
            raise UserError("Qwen-Image-Layered sampling needs layer_input_image (the image to take apart)")
        if layer_num is None:
            raise UserError("Qwen-Image-Layered sampling needs layer_num (how many layers besides the first)")
        if height is None or width is None:
            width, height = as_image_list(layer_input_image)[0].size
        values = self.prompt_values(prompt, negative_prompt)
        values.update(self.feature_values(inputs, values))
        values.update({"height": height, "width": width, "seed": seed, "rand_device": rand_device,
                       "layer_input_image": layer_input_image, "layer_num": layer_num})
        out = self.generate(values, cfg_scale=cfg_scale, num_inference_steps=num_inference_steps,
                            settings={"zero_cond_t": zero_cond_t}, progress=progress, output_type=output_type)
        return out[0] if isinstance(prompt, str) and output_type == "pil" else out


__all__ = ["LAYERED_CONTEXT", "LAYERED_EDIT", "QwenImageLayerInputEmbedder", "QwenImageLayerStackEmbedder",
           "QwenImageLayeredPipeline", "claims_layered",
           "data_operators", "decode_layers", "is_layered_dit", "layered_noise", "layered_training_inputs",
           "model_fn_qwen_image_layered"]
