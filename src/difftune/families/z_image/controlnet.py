"""The Turbo Fun ControlNets (Union / Tile 2.1 and their 8-step variants, the `controlnet` feature): the control
context a control image makes, and the DiT's forward with the ControlNet, over diffusers' `ZImageTransformer2DModel`
and `ZImageControlNetModel` modules.

The forward follows the reference (and VideoX-Fun, the model authors' code): the control noise refiner's hints are
added to the DiT's own image stream after each refiner layer, and a sample without an inpaint image encodes an
all-zero (mid grey) one. diffusers' `ZImageControlNetPipeline` differs in both; `ZImagePipeline(...,
control_compat="diffusers")` samples as it does.
"""

from __future__ import annotations

import torch
from PIL import Image
from torch.nn.utils.rnn import pad_sequence

from ...core.checkpointing import gradient_checkpoint_forward
from ...core.features import IMAGE, Feature
from ...core.options import sample_input
from ...core.units import PipelineUnit
from ...errors import UserError
from ...media.image import images_to_tensor
from ...parts.flux_ae import LATENT_CHANNELS, VAE_SCALE, vae_encode
from .attention import use_joint_qk
from .units import omni_dit

PATCH = "2-1"  # the only patch size (2) and frame patch size (1) Z-Image has
CONTROL_COLUMNS = ("controlnet_image", "controlnet_inpaint_mask", "controlnet_inpaint_image")


class ZImageControlEmbedder(PipelineUnit):
    """The Fun ControlNet's control context (B, 33, 1, h, w): the control image's latents, the inpaint mask (1 where
    to paint) and the inpaint image's latents, the reference's layout. Without an inpaint image the reference
    encodes an all-zero image (mid grey), which is what its training saw; `control_inpaint_latents="zeros"` gives
    diffusers' (and VideoX-Fun's) zero latents instead."""

    feature = "controlnet"
    inputs = ("controlnet_image", "controlnet_inpaint_mask", "controlnet_inpaint_image", "height", "width",
              "batch_size", "control_inpaint_latents")
    outputs = ("control_context",)
    models = ("vae",)

    def process(self, pipe, controlnet_image, controlnet_inpaint_mask, controlnet_inpaint_image, height, width,
                batch_size, control_inpaint_latents):
        if controlnet_image is None and controlnet_inpaint_mask is None:
            return {}
        b = int(batch_size or 1)
        h, w = height // VAE_SCALE, width // VAE_SCALE
        if controlnet_image is not None:
            control = vae_encode(pipe, images_to_tensor(_batch_images(controlnet_image, b), height, width))
        else:
            control = torch.full((b, LATENT_CHANNELS, h, w), -1.0, device=pipe.device, dtype=pipe.torch_dtype)
        if controlnet_inpaint_mask is not None:
            mask = images_to_tensor(_batch_images(controlnet_inpaint_mask, b), height, width).float() / 2 + 0.5
            image = images_to_tensor(_batch_images(controlnet_inpaint_image, b), height, width).float()
            image = image.to(mask.device) * (mask < 0.5)
            mask = torch.nn.functional.interpolate(1 - mask, (h, w), mode="nearest")[:, :1]
        else:
            mask = torch.zeros((b, 1, h, w))
            image = torch.zeros((b, 3, height, width))
        if control_inpaint_latents == "zeros" and controlnet_inpaint_mask is None:
            inpaint = torch.zeros_like(control)
        else:
            inpaint = vae_encode(pipe, image)
        mask = mask.to(device=pipe.device, dtype=pipe.torch_dtype)
        context = torch.cat([control, mask, inpaint.to(control.device)], dim=1)
        return {"control_context": context.unsqueeze(2)}


def _batch_images(images, batch_size: int) -> list[Image.Image]:
    if images is None:
        raise UserError("controlnet_inpaint_mask needs controlnet_inpaint_image (the image to paint into)")
    items = [images] if isinstance(images, Image.Image) else list(images)
    if len(items) == 1:
        items = items * batch_size
    if len(items) != batch_size or not all(isinstance(i, Image.Image) for i in items):
        raise UserError(f"controlnet images: expected one image or one per prompt ({batch_size}), got {len(items)}")
    return items


def controlled_forward(dit, controlnet, x_list: list, t: torch.Tensor, caps: list, control_context: torch.Tensor,
                       scale: float, refiner_hints: bool, ckpt: bool = False, offload: bool = False) -> list:
    """The DiT with a Fun ControlNet (2.1: Union, Tile and their 8-step variants), over diffusers' modules.

    The control context is embedded at the image tokens' positions; the control noise refiner (its first block
    fed the embedded image tokens) gives one hint per DiT refiner layer, added after that layer; the control
    blocks run on [control tokens, prompt tokens] beside the unified sequence and give one hint per control place,
    added after that DiT layer. `refiner_hints=False` leaves the refiner hints out of the DiT's own stream (they
    still shape the stream the control blocks see): diffusers' `ZImageControlNetPipeline`; the reference and
    VideoX-Fun add them (True)."""
    device = x_list[0].device

    def run(module, *args):
        return gradient_checkpoint_forward(module, ckpt, offload, *args)

    adaln = dit.t_embedder(t * dit.t_scale).type_as(x_list[0])
    x, cap, x_size, x_pos, cap_pos, x_pad, cap_pad = dit.patchify_and_embed(x_list, caps, 2, 1)
    x_lens = [len(i) for i in x]
    x = dit.all_x_embedder[PATCH](torch.cat(x, dim=0))
    x, x_freqs, x_mask, _, _ = dit._prepare_sequence(list(x.split(x_lens)), x_pos, x_pad, dit.x_pad_token, None,
                                                     device)
    c = controlnet.control_all_x_embedder[PATCH](torch.cat(controlnet.patchify(list(control_context), 2, 1)))
    c = torch.where(torch.cat(x_pad).unsqueeze(-1), dit.x_pad_token.to(c.dtype), c)
    c = pad_sequence(list(c.split(x_lens)), batch_first=True, padding_value=0.0)
    for layer in controlnet.control_noise_refiner:
        c = run(layer, c, x, x_mask, x_freqs, adaln)
    r_hints, c = torch.unbind(c)[:-1], torch.unbind(c)[-1]
    r_places = {p: i for i, p in enumerate(controlnet.config.control_refiner_layers_places)}
    hinted = plain = x
    for i, layer in enumerate(dit.noise_refiner):
        hinted = run(layer, hinted, x_mask, x_freqs, adaln)
        if i in r_places:
            hinted = hinted + r_hints[r_places[i]] * scale
        if not refiner_hints:
            plain = run(layer, plain, x_mask, x_freqs, adaln)
    cap_lens = [len(i) for i in cap]
    cap = dit.cap_embedder(torch.cat(cap, dim=0))
    cap, cap_freqs, cap_mask, _, _ = dit._prepare_sequence(list(cap.split(cap_lens)), cap_pos, cap_pad,
                                                           dit.cap_pad_token, None, device)
    for layer in dit.context_refiner:
        cap = run(layer, cap, cap_mask, cap_freqs)

    def unify(stream):
        return dit._build_unified_sequence(stream, x_freqs, x_lens, None, cap, cap_freqs, cap_lens, None, None, None,
                                           None, None, False, device)

    unified, freqs, mask, _ = unify(hinted)
    control = pad_sequence([torch.cat([c[i][:x_lens[i]], cap[i][:cap_lens[i]]]) for i in range(len(x_lens))],
                           batch_first=True, padding_value=0.0)
    for layer in controlnet.control_layers:
        control = run(layer, control, unified, mask, freqs, adaln)
    hints = {p: h * scale for p, h in zip(controlnet.config.control_layers_places, torch.unbind(control)[:-1])}
    if not refiner_hints:
        unified = unify(plain)[0]
    for i, layer in enumerate(dit.layers):
        unified = run(layer, unified, mask, freqs, adaln)
        if i in hints:
            unified = unified + hints[i]
    unified = dit.all_final_layer[PATCH](unified, c=adaln)
    return dit.unpatchify(list(unified.unbind(dim=0)), x_size, 2, 1)


# -- the feature ---------------------------------------------------------------------------------------------------

class _ControlNet(Feature):
    def check(self, context, features):
        dit = context.config("dit")
        has_control = context.has(*CONTROL_COLUMNS)
        if context.config("controlnet") is not None and not has_control:
            raise UserError("a Fun ControlNet is loaded but the data has no control image: add the column "
                            "controlnet_image (--data_file_keys image,controlnet_image --extra_inputs "
                            "controlnet_image)")
        if has_control and dit is not None and context.config("controlnet") is None:
            raise UserError("controlnet_image: no Fun ControlNet loaded; add its file (e.g. PAI/Z-Image-Turbo-"
                            "Fun-Controlnet-Union-2.1:Z-Image-Turbo-Fun-Controlnet-Union-2.1.safetensors) to the "
                            "model flags")
        if dit is not None and omni_dit(context):
            raise UserError("the Fun ControlNets work with Z-Image(-Turbo)'s DiT, not Omni-Base's")

    def call_values(self, given, values):
        """The call's control images as values; `controlnet_scale` and `control_compat` ("diffusers": zero inpaint
        latents and no refiner hints in the DiT's stream, as diffusers' `ZImageControlNetPipeline`) as settings."""
        compat = given.get("control_compat", "reference")
        if compat not in ("reference", "diffusers"):
            raise UserError(f"control_compat must be 'reference' or 'diffusers', got {compat!r}")
        values = {name: given.get(name) for name in CONTROL_COLUMNS}
        values["control_inpaint_latents"] = "zeros" if compat == "diffusers" else "encoded"
        return values, {"control_scale": given.get("controlnet_scale", 1.0),
                        "control_refiner_hints": compat == "reference"}

    def denoise(self, pipe, call):
        """The DiT's forward with the ControlNet's hints in place of the plain one."""
        if call.omni:
            raise UserError("the Fun ControlNet works with Z-Image(-Turbo)'s DiT, not Omni-Base's")
        controlnet = pipe.models.get("controlnet") if pipe is not None else None
        if controlnet is None:
            raise UserError("controlnet_image given but no ControlNet loaded: add the Fun ControlNet's file to "
                            "--model_paths / --model_id_with_origin_paths")
        use_joint_qk(controlnet)
        v = call.values
        context = v["control_context"].to(call.dtype)
        scale = 1.0 if v.get("control_scale") is None else v["control_scale"]
        hints = v.get("control_refiner_hints", True)
        call.forward = lambda c: controlled_forward(c.dit, controlnet, c.x, c.t, c.caps, context, scale, hints,
                                                    c.use_gradient_checkpointing,
                                                    c.use_gradient_checkpointing_offload)


CONTROLNET = _ControlNet(
    "controlnet", columns=CONTROL_COLUMNS, models=("controlnet",), model_fn_inputs=("control_context",),
    units=(ZImageControlEmbedder(),), slots=("controlnet",), loss_models=("controlnet",),
    inputs=dict.fromkeys(CONTROL_COLUMNS, IMAGE),
    call_inputs={**dict.fromkeys(CONTROL_COLUMNS), "controlnet_scale": 1.0, "control_compat": "reference"},
    flags={"controlnet_image": sample_input("Fun ControlNet: the control image.", load="RGB"),
           "controlnet_inpaint_mask": sample_input("Fun ControlNet: where to paint (white), with "
                                                   "--controlnet_inpaint_image.", load="RGB"),
           "controlnet_inpaint_image": sample_input("Fun ControlNet: the image to paint into.", load="RGB"),
           "controlnet_scale": sample_input("Fun ControlNet: the strength of its hints (default 1).", kind=float),
           "control_compat": sample_input("Fun ControlNet: 'reference' (default: the reference's and the model "
                                          "authors' forward) or 'diffusers' (as ZImageControlNetPipeline).",
                                          choices=("reference", "diffusers"))},
    description="Z-Image-Turbo Fun ControlNet (Union / Tile 2.1 and 8-step): a control image")
