"""The pipeline's side of In-Context control, EliGen and the Blockwise ControlNet: the data columns and call
arguments they take, and the values `model_fn` reads."""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image

from ...errors import UserError
from ...parts.controlnet import ControlNetInput
from ...util import text_list

IMAGE_INPUTS = ("context_image", "eligen_entity_masks", "blockwise_controlnet_image", "blockwise_controlnet_inpaint_mask")


def _loaded(value):
    """An image column's value when the data set loaded it (named by --data_file_keys / --extra_inputs); a column
    no flag names stays file names and is not used, as in the reference."""
    images = value if isinstance(value, list) else [value]
    return value if value is not None and images and all(isinstance(v, Image.Image) for v in images) else None


def control_training_inputs(data: dict[str, Any]) -> dict[str, Any]:
    row = data.get("_row", "?") if not isinstance(data.get("_row"), int) else data["_row"] + 1
    data = {**data, **{k: _loaded(data.get(k)) for k in IMAGE_INPUTS}}
    masks = data.get("eligen_entity_masks")
    prompts = None if masks is None else \
        text_list(data.get("eligen_entity_prompts"), "eligen_entity_prompts", f"row {row}")
    if (prompts is None) != (masks is None):
        given = "eligen_entity_prompts" if masks is None else "eligen_entity_masks"
        raise UserError(f"row {row}: {given} without its other half (EliGen needs eligen_entity_prompts and "
                        f"eligen_entity_masks, one prompt per mask image)")
    if data.get("blockwise_controlnet_inpaint_mask") is not None and data.get("blockwise_controlnet_image") is None:
        raise UserError(f"row {row}: blockwise_controlnet_inpaint_mask without blockwise_controlnet_image")
    return {"context_image": data.get("context_image"), "eligen_entity_prompts": prompts,
            "eligen_entity_masks": masks, "blockwise_controlnet_image": data.get("blockwise_controlnet_image"),
            "blockwise_controlnet_inpaint_mask": data.get("blockwise_controlnet_inpaint_mask")}


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


def control_call_inputs(batch: int, negatives: list[str], context_image, eligen_entity_prompts, eligen_entity_masks,
                        eligen_enable_on_negative: bool, blockwise_controlnet_image,
                        blockwise_controlnet_inpaint_mask, blockwise_controlnet_inputs=None) -> dict[str, Any]:
    """`QwenImagePipeline.__call__`'s control arguments as values (one copy per prompt of the batch)."""
    if blockwise_controlnet_inputs is not None:
        if blockwise_controlnet_image is not None:
            raise UserError("give blockwise_controlnet_inputs or blockwise_controlnet_image, not both")
        blockwise_controlnet_image, blockwise_controlnet_inpaint_mask = controlnet_from_inputs(
            blockwise_controlnet_inputs)
    prompts = text_list(eligen_entity_prompts, "eligen_entity_prompts", "(call)")
    if (prompts is None) != (eligen_entity_masks is None):
        raise UserError("EliGen needs both eligen_entity_prompts and eligen_entity_masks")

    def each(value):
        return value if value is None or batch == 1 else [value] * batch

    out = {"context_image": each(context_image), "eligen_entity_prompts": each(prompts),
           "eligen_entity_masks": each(eligen_entity_masks), "blockwise_controlnet_image": each(blockwise_controlnet_image),
           "blockwise_controlnet_inpaint_mask": each(blockwise_controlnet_inpaint_mask)}
    if eligen_enable_on_negative and prompts is not None:  # the negative prompt in every entity's place
        per = [[n] * len(prompts) for n in negatives]
        out["negative_eligen_entity_prompts"] = per[0] if batch == 1 else per
    return out


def check_controlnet_fed(controlnet, conditioning) -> None:
    """A loaded ControlNet with no control image while training would be trained / kept for nothing."""
    if controlnet is not None and conditioning is None and torch.is_grad_enabled():
        raise UserError("a Blockwise ControlNet is loaded but the sample has no blockwise_controlnet_image (name "
                        "the column in --extra_inputs and --data_file_keys), so it would be ignored")


__all__ = ["ControlNetInput", "check_controlnet_fed", "control_call_inputs", "control_training_inputs"]
