"""Qwen-Image Blockwise ControlNet (DiffSynth-Studio's `Qwen-Image-Blockwise-ControlNet-{Canny,Depth,Inpaint}`).

The model: an input projection of the VAE-encoded control image's 2x2 patch tokens, and one block per DiT block
(RMSNorm of the image stream and of the control tokens, summed, Linear-GELU-Linear) whose output is added to the
noisy image tokens after that DiT block. The inpaint variant's control tokens carry 4 more channels: the (inverted)
inpaint mask at latent resolution, one per 2x2 patch position.

The pipeline slot holds `QwenImageBlockwiseMultiControlNet`, whose one network sits at `models.0.` as in the
reference's pipeline, so the reference's `--remove_prefix_in_ckpt pipe.blockwise_controlnet.models.0.` saves
trained weights in the released files' layout (`img_in.weight`, `controlnet_blocks.<i>.*`), and released files
load with `models.0.` added to their keys.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from diffusers.models.normalization import RMSNorm
from torch import nn

from ...core.features import RAW, Feature
from ...core.latents import pack_latents
from ...core.units import PipelineUnit
from ...errors import UserError, row_label
from ...media.image import as_image_list
from ...models.detect import ComponentSpec
from ...parts.controlnet import ControlNetInput, encode_control_images
from .feature import loaded, per_prompt

IN_DIM = 64  # 16 latent channels x a 2x2 patch
INPAINT_EXTRA_DIM = 4  # the mask channel x a 2x2 patch


class BlockwiseControlBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.x_rms = RMSNorm(dim, eps=1e-6)
        self.y_rms = RMSNorm(dim, eps=1e-6)
        self.input_proj = nn.Linear(dim, dim)
        self.act = nn.GELU()
        self.output_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.output_proj(self.act(self.input_proj(self.x_rms(x) + self.y_rms(y))))


class QwenImageBlockwiseControlNet(ModelMixin, ConfigMixin):
    """One Blockwise ControlNet, with the released checkpoints' key names."""

    @register_to_config
    def __init__(self, num_layers: int = 60, in_dim: int = IN_DIM, additional_in_dim: int = 0, dim: int = 3072):
        super().__init__()
        self.img_in = nn.Linear(in_dim + additional_in_dim, dim)
        self.controlnet_blocks = nn.ModuleList([BlockwiseControlBlock(dim) for _ in range(num_layers)])

    def zero_init(self) -> None:
        """The reference's starting point for training from scratch: projections in and out are zero, so the
        untrained ControlNet leaves the DiT's output unchanged."""
        for linear in [self.img_in, *(b.output_proj for b in self.controlnet_blocks)]:
            nn.init.zeros_(linear.weight)
            nn.init.zeros_(linear.bias)


class QwenImageBlockwiseMultiControlNet(ModelMixin, ConfigMixin):
    """The `blockwise_controlnet` slot: the network at `models.0` (the reference's pipeline names it so)."""

    @register_to_config
    def __init__(self, num_layers: int = 60, in_dim: int = IN_DIM, additional_in_dim: int = 0, dim: int = 3072):
        super().__init__()
        self.models = nn.ModuleList([QwenImageBlockwiseControlNet(num_layers, in_dim, additional_in_dim, dim)])

    @property
    def net(self) -> QwenImageBlockwiseControlNet:
        return self.models[0]

    def condition(self, conditioning: torch.Tensor) -> torch.Tensor:
        """VAE latents of the control image (B, 16 [+1 mask], h, w) -> control tokens (B, h/2*w/2, dim)."""
        net = self.net
        want = net.img_in.in_features
        tokens = pack_latents(conditioning.to(net.img_in.weight.dtype))
        if tokens.shape[-1] != want:
            kind = "an inpaint mask" if want > IN_DIM else "no inpaint mask"
            raise UserError(f"the Blockwise ControlNet takes {want} input channels per token ({kind}), the control "
                            f"image gives {tokens.shape[-1]}: give blockwise_controlnet_inpaint_mask exactly when "
                            f"the ControlNet is an Inpaint one")
        return net.img_in(tokens)

    def residual(self, block_index: int, image: torch.Tensor, control: torch.Tensor) -> torch.Tensor:
        """What block `block_index` adds to the noisy image tokens `image` (B, n, dim) after that DiT block."""
        return self.net.controlnet_blocks[block_index](image, control)


def _model_key(key: str) -> str:
    """Released files hold one network's keys; the slot keeps it under `models.0.`."""
    return key if key.startswith("models.") else "models.0." + key


_BLOCK = re.compile(r"^models\.0\.controlnet_blocks\.(\d+)\.")


def _config_from_weights(shapes: dict[str, tuple[int, ...]]) -> dict | None:
    """Every size of this model shows in its weights: the config is read from them (any depth and width)."""
    proj = shapes.get("models.0.img_in.weight")
    if proj is None or len(proj) != 2 or proj[1] < IN_DIM:
        return None
    blocks = {int(m.group(1)) for k in shapes if (m := _BLOCK.match(k))}
    if not blocks:
        return None
    return {"num_layers": max(blocks) + 1, "in_dim": IN_DIM, "additional_in_dim": proj[1] - IN_DIM, "dim": proj[0]}


CANNY_DEPTH_CONFIG = {"num_layers": 60, "in_dim": IN_DIM, "additional_in_dim": 0, "dim": 3072}
INPAINT_CONFIG = {**CANNY_DEPTH_CONFIG, "additional_in_dim": INPAINT_EXTRA_DIM}

BLOCKWISE_CONTROLNET = ComponentSpec(
    name="blockwise_controlnet", library=__name__, class_name="QwenImageBlockwiseMultiControlNet",
    known_configs={"DiffSynth-Studio/Qwen-Image-Blockwise-ControlNet-Canny/Depth": CANNY_DEPTH_CONFIG,
                   "DiffSynth-Studio/Qwen-Image-Blockwise-ControlNet-Inpaint": INPAINT_CONFIG},
    marker_keys=("models.0.img_in.weight", "models.0.controlnet_blocks.0.x_rms.weight"),
    normalize_key=_model_key, infer_config=_config_from_weights,
    description="Qwen-Image Blockwise ControlNet")


# -- the unit -------------------------------------------------------------------------------------------------

class QwenImageBlockwiseControlNetEmbedder(PipelineUnit):
    """VAE-encode the Blockwise ControlNet's control image (plus the inpaint mask as a 17th channel for the
    Inpaint ControlNet). Only the VAE: the ControlNet itself runs in `model_fn`, so a trainable
    ControlNet leaves this encode in stage 1 and the cache holds the latents."""

    inputs = ("blockwise_controlnet_image", "blockwise_controlnet_inpaint_mask", "height", "width")
    outputs = ("blockwise_controlnet_conditioning",)
    models = ("vae",)
    feature = "blockwise_controlnet"
    before = ("QwenImagePromptEmbedder",)  # the family encodes prompts after every image

    def process(self, pipe, blockwise_controlnet_image, blockwise_controlnet_inpaint_mask, height, width):
        if blockwise_controlnet_image is None:
            if blockwise_controlnet_inpaint_mask is not None:
                raise UserError("blockwise_controlnet_inpaint_mask is given without blockwise_controlnet_image")
            return {}
        from .units import vae_encode

        images = as_image_list(blockwise_controlnet_image)
        masks = blockwise_controlnet_inpaint_mask
        masks = [None] * len(images) if masks is None else as_image_list(masks)
        if len(masks) != len(images):
            raise UserError(f"{len(images)} blockwise_controlnet_image(s) but {len(masks)} inpaint mask(s)")
        out = encode_control_images(pipe, images, masks, height, width, vae_encode, mask_at_image_size=True)
        return {"blockwise_controlnet_conditioning": torch.cat(out).to(pipe.torch_dtype)}


# -- the feature: the reference's call input, its values and its part of the denoiser call -----------------------

def controlnet_from_inputs(inputs) -> tuple[Any, Any]:
    """(image, inpaint mask) of `blockwise_controlnet_inputs`; what this pipeline cannot do is refused."""
    inputs = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
    if len(inputs) != 1:
        raise UserError(f"blockwise_controlnet_inputs: {len(inputs)} given; one Blockwise ControlNet is supported")
    c = inputs[0]
    if (c.controlnet_id, c.scale, c.start, c.end) != (0, 1.0, 1.0, 0.0) or c.inpaint_image is not None or \
            c.processor_id is not None:
        raise UserError("blockwise_controlnet_inputs: only image and inpaint_mask are supported (controlnet_id 0, "
                        "scale 1, start 1, end 0, no inpaint_image / processor_id)")
    if c.image is None:
        raise UserError("blockwise_controlnet_inputs: the ControlNetInput has no image")
    return c.image, c.inpaint_mask


def check_controlnet_fed(controlnet, conditioning) -> None:
    """A loaded ControlNet with no control image while training would be trained / kept for nothing."""
    if controlnet is not None and conditioning is None and torch.is_grad_enabled():
        raise UserError("a Blockwise ControlNet is loaded but the sample has no blockwise_controlnet_image (name "
                        "the column in --extra_inputs and --data_file_keys), so it would be ignored")


class _BlockwiseControlNet(Feature):
    def row_values(self, pipe, data, values):
        image = loaded(data.get("blockwise_controlnet_image"))
        mask = loaded(data.get("blockwise_controlnet_inpaint_mask"))
        if mask is not None and image is None:
            raise UserError(f"{row_label(data)}: blockwise_controlnet_inpaint_mask without "
                            f"blockwise_controlnet_image")
        return {"blockwise_controlnet_image": image, "blockwise_controlnet_inpaint_mask": mask}

    def call_values(self, given, values):
        image, mask = given.get("blockwise_controlnet_image"), given.get("blockwise_controlnet_inpaint_mask")
        if given.get("blockwise_controlnet_inputs") is not None:
            if image is not None:
                raise UserError("give blockwise_controlnet_inputs or blockwise_controlnet_image, not both")
            image, mask = controlnet_from_inputs(given["blockwise_controlnet_inputs"])
        n = values["batch_size"]
        return {"blockwise_controlnet_image": per_prompt(image, n),
                "blockwise_controlnet_inpaint_mask": per_prompt(mask, n)}, {}

    def signature(self, sample):
        return ()  # encoded at the output's size: control images of any size share a stage-1 batch

    def denoise(self, pipe, call):
        """The ControlNet's residual on the noisy image's tokens after each DiT block. It runs whenever the
        ControlNet is loaded: a training sample without a control image is refused."""
        controlnet = pipe.models.get("blockwise_controlnet") if pipe is not None else None
        conditioning = call.values.get("blockwise_controlnet_conditioning")
        check_controlnet_fed(controlnet, conditioning)
        if conditioning is None:
            return
        if controlnet is None:
            raise UserError("a blockwise_controlnet_image is given but no Blockwise ControlNet is loaded: add its "
                            "weights (e.g. DiffSynth-Studio/Qwen-Image-Blockwise-ControlNet-Canny:model.safetensors)")
        image_len = call.tokens.shape[1]
        control = controlnet.condition(conditioning)
        if control.shape[1] != image_len:
            raise UserError(f"the Blockwise ControlNet's control image gives {control.shape[1]} tokens, the output "
                            f"{image_len}: give the control image the output's size")
        depth, blocks = len(controlnet.net.controlnet_blocks), len(call.dit.transformer_blocks)
        if depth != blocks:
            raise UserError(f"the Blockwise ControlNet has {depth} blocks but the DiT has {blocks}")

        def add_control(i, hidden):
            image = hidden[:, :image_len]
            return torch.cat([image + controlnet.residual(i, image, control.to(image.dtype)), hidden[:, image_len:]],
                             dim=1)

        call.block_residuals.append(add_control)


CONTROL_INPUTS = ("blockwise_controlnet_image", "blockwise_controlnet_inpaint_mask")
BLOCKWISE = _BlockwiseControlNet(
    "blockwise_controlnet", columns=CONTROL_INPUTS[:1], data_inputs=CONTROL_INPUTS,
    model_fn_inputs=("blockwise_controlnet_conditioning",), units=(QwenImageBlockwiseControlNetEmbedder(),),
    slots=("blockwise_controlnet",), loss_models=("blockwise_controlnet",),
    inputs=dict.fromkeys(CONTROL_INPUTS, RAW),
    call_inputs={**dict.fromkeys(CONTROL_INPUTS), "blockwise_controlnet_inputs": None},
    description="Blockwise ControlNet: a control image's residuals after each DiT block")
