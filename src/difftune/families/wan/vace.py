"""VACE (Wan2.1-VACE-1.3B, VACE-Wan2.1-1.3B-Preview, Wan2.1-VACE-14B, Wan2.2-VACE-Fun-A14B experts).

The released files hold a Wan T2V DiT and, beside it, the VACE branch (`vace_patch_embedding`, `vace_blocks.*`):
VACE blocks that read the patch-embedded video tokens and a 96-channel context (the VAE latents of the control
video's inactive and reactive parts, 16 + 16, and the 8x8 pixel mask folded onto 64 channels), and whose outputs
("hints") are added after the DiT blocks they serve. As in the reference, one file fills two slots: `dit` (the DiT,
diffusers' `WanTransformer3DModel`) and `vace` (`WanVACEModel` here: diffusers' `WanVACETransformerBlock`s under
the key names of diffusers' `WanVACETransformer3DModel`), so `--trainable_models vace` / `--lora_base_model vace`
train the branch alone and a trained branch's keys are the diffusers class's own.

`vace_reference_image` is one more leading latent frame: of the context (its latents, zeros for the reactive part,
a zero mask) and of the denoised latents (training: its clean latents lead the clip's; sampling: the noise has one
frame more, dropped before decoding).
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from diffusers.models.transformers.transformer_wan_vace import WanVACETransformerBlock
from PIL import Image
from torch import nn

from ...core.features import ALIGNED_FRAMES, IMAGE, Feature
from ...core.units import PipelineUnit
from ...errors import UserError
from ...media.image import as_image_list
from ...models.detect import ComponentSpec
from .components import REFERENCE_LORA_TARGETS, WAN_DIT_CONFIGS, _dit_from_original, _strip_comfy_prefix
from .dit_forward import BlockInputs, run_checkpointed
from .units import (WanInputVideoEmbedder, WanNoiseInitializer, _per_sample, latent_frames, vae_encode,
                    vae_scales, video_tensor)

CONTEXT_CHANNELS = 96  # 16 inactive + 16 reactive latents, 8 x 8 mask positions


class WanVACEModel(ModelMixin, ConfigMixin):
    """The VACE branch: `vace_patch_embedding` and one `WanVACETransformerBlock` per entry of `vace_layers` (the DiT
    block after which its hint is added). Keys as diffusers' `WanVACETransformer3DModel`'s."""

    _supports_gradient_checkpointing = True
    _no_split_modules = ["WanVACETransformerBlock"]
    _keep_in_fp32_modules = ["scale_shift_table", "norm1", "norm2", "norm3"]

    @register_to_config
    def __init__(self, vace_layers: tuple[int, ...] = tuple(range(0, 30, 2)), vace_in_channels: int = CONTEXT_CHANNELS,
                 num_attention_heads: int = 12, attention_head_dim: int = 128, ffn_dim: int = 8960,
                 patch_size: tuple[int, int, int] = (1, 2, 2), cross_attn_norm: bool = True,
                 qk_norm: str | None = "rms_norm_across_heads", eps: float = 1e-6,
                 added_kv_proj_dim: int | None = None):
        super().__init__()
        if 0 not in vace_layers:
            raise ValueError("VACE layers must include layer 0")
        inner = num_attention_heads * attention_head_dim
        self.vace_patch_embedding = nn.Conv3d(vace_in_channels, inner, kernel_size=patch_size, stride=patch_size)
        self.vace_blocks = nn.ModuleList([
            WanVACETransformerBlock(inner, ffn_dim, num_attention_heads, qk_norm, cross_attn_norm, eps,
                                    added_kv_proj_dim, apply_input_projection=i == 0, apply_output_projection=True)
            for i in range(len(vace_layers))])
        self.gradient_checkpointing = False

    def hints(self, inputs: BlockInputs, vace_context: torch.Tensor) -> list[torch.Tensor]:
        """One hint per VACE layer (B, L, D) from the block inputs and the (B, 96, F, H, W) context."""
        hidden = inputs.hidden_states
        c = self.vace_patch_embedding(vace_context.to(self.vace_patch_embedding.weight.dtype))
        c = c.flatten(2).transpose(1, 2)
        if c.shape[1] > hidden.shape[1]:
            raise UserError(f"the VACE context has {c.shape[1]} tokens, more than the video's {hidden.shape[1]}: "
                            f"vace_video must not be longer than the clip")
        c = torch.cat([c, c.new_zeros(c.shape[0], hidden.shape[1] - c.shape[1], c.shape[2])], dim=1)
        out = []
        for block in self.vace_blocks:
            hint, c = run_checkpointed(self, block, hidden, inputs.encoder_hidden_states, c, inputs.timestep_proj,
                                       inputs.rotary_emb)
            out.append(hint)
        return out

    def block_hook(self, vace_context: torch.Tensor, vace_scale=1.0):
        """The `wan_dit_forward` hook: hint k (times the scale: one number, or one per layer) is added after DiT
        block `vace_layers[k]`."""
        layers = list(self.config.vace_layers)
        scales = list(vace_scale) if isinstance(vace_scale, (list, tuple, torch.Tensor)) else [vace_scale] * len(layers)
        if len(scales) != len(layers):
            raise UserError(f"vace_scale: {len(scales)} values for {len(layers)} VACE layers")

        def hook(inputs: BlockInputs):
            by_layer = dict(zip(layers, zip(self.hints(inputs, vace_context), scales)))

            def after(i, hidden):
                if i not in by_layer:
                    return hidden
                hint, scale = by_layer[i]
                return hidden + hint.to(hidden.device, hidden.dtype) * scale

            return after

        return hook


# -- the released files ----------------------------------------------------------------------------------------
def vace_config(heads: int, ffn: int, layers: tuple[int, ...]) -> dict:
    return {"_class_name": "WanVACEModel", "vace_layers": list(layers), "vace_in_channels": CONTEXT_CHANNELS,
            "num_attention_heads": heads, "attention_head_dim": 128, "ffn_dim": ffn, "patch_size": [1, 2, 2],
            "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "added_kv_proj_dim": None}


# The reference's VaceWanModel: every second of the 1.3B DiT's 30 blocks; every fifth of the 14B's 40 (the
# Wan2.2-VACE-Fun-A14B experts have the 14B layout: the reference knows no other).
VACE_CONFIGS = {
    "Wan2.1-VACE-1.3B / VACE-Wan2.1-1.3B-Preview": vace_config(12, 8960, tuple(range(0, 30, 2))),
    "Wan2.1-VACE-14B / Wan2.2-VACE-Fun-A14B expert": vace_config(40, 13824, tuple(range(0, 40, 5))),
}
VACE_DIT_CONFIGS = {
    "Wan2.1-VACE-1.3B / VACE-Wan2.1-1.3B-Preview (DiT)": WAN_DIT_CONFIGS["Wan2.1-T2V-1.3B"],
    "Wan2.1-VACE-14B / Wan2.2-VACE-Fun-A14B expert (DiT)": WAN_DIT_CONFIGS["Wan2.1-T2V-14B / Wan2.2-T2V-A14B expert"],
}


def _is_vace(key: str) -> bool:
    return key.startswith("vace_")


def vace_from_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The VACE branch of a released VACE file (Wan's names: vace_blocks.N.self_attn.q, before_proj, after_proj,
    norm3 = the cross-attention norm) in diffusers' names (attn1.to_q, proj_in, proj_out, norm2)."""
    if not any(_is_vace(k) for k in state):
        raise KeyError("no VACE tensors")
    return {k: v for k, v in _dit_from_original({k: v for k, v in state.items() if _is_vace(k)}).items()}


def vace_dit_from_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The DiT of a released VACE file: everything but the VACE branch, in diffusers' names."""
    if not any(_is_vace(k) for k in state):
        raise KeyError("not a VACE file")
    return _dit_from_original({k: v for k, v in state.items() if not _is_vace(k)})


def vace_to_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A `WanVACEModel` state dict in the released files' names (for `--full_format original`)."""
    from .dit_keys import dit_to_original

    out = {}
    for key, value in dit_to_original(state).items():
        out[key.replace(".proj_in.", ".before_proj.").replace(".proj_out.", ".after_proj.")] = value
    return out


# The reference's LoRA target names (q,k,v,o,ffn.0,ffn.2) on the VACE blocks: the DiT blocks' modules, as diffusers'
VACE_LORA_TARGETS = REFERENCE_LORA_TARGETS

# Wan-AI's config.json beside the VACE files (class VaceWanModel; VideoX-Fun's VaceWanTransformer3DModel for the
# Wan2.2 VACE-Fun experts) is not in diffusers' terms: the weights are recognised instead.
_FOREIGN = ("WanModel", "VaceWanModel", "VaceWanTransformer3DModel")

VACE_DIT_ORIGINAL = ComponentSpec(
    name="dit", library="diffusers", class_name="WanTransformer3DModel", extra_slots=("dit2",),
    known_configs=VACE_DIT_CONFIGS,
    marker_keys=("patch_embedding.weight", "head.modulation", "vace_blocks.0.after_proj.weight"),
    normalize_key=_strip_comfy_prefix, convert_state_dict=vace_dit_from_original, foreign_config_classes=_FOREIGN,
    description="the DiT of a Wan VACE file (Wan-AI's original layout; its VACE branch fills `vace`)")

VACE_ORIGINAL = ComponentSpec(
    name="vace", library=__name__, class_name="WanVACEModel", extra_slots=("vace2",), known_configs=VACE_CONFIGS,
    companion=True,
    marker_keys=("vace_patch_embedding.weight", "vace_blocks.0.before_proj.weight", "vace_blocks.0.after_proj.weight"),
    normalize_key=_strip_comfy_prefix, convert_state_dict=vace_from_original, foreign_config_classes=_FOREIGN,
    description="the VACE branch of a Wan VACE file (vace_patch_embedding, vace_blocks)")


# -- units ----------------------------------------------------------------------------------------------------
def _mask_tensor(frames, height: int, width: int) -> torch.Tensor:
    """Mask frames -> (1, 3, F, H, W) in [0, 1] (white: the part to generate), resized as the clips are."""
    arrays = []
    for frame in as_image_list(frames):
        frame = frame.convert("RGB")
        if frame.size != (width, height):
            frame = frame.resize((width, height), Image.LANCZOS)
        arrays.append(np.asarray(frame, dtype=np.float32) / 255.0)
    return torch.from_numpy(np.stack(arrays)).permute(3, 0, 1, 2).unsqueeze(0).contiguous()


def _references(value) -> list[Image.Image]:
    """vace_reference_image: one image or several (each one leading latent frame)."""
    if value is None:
        return []
    refs = [value] if isinstance(value, Image.Image) else list(value)
    if not all(isinstance(r, Image.Image) for r in refs):
        raise UserError("vace_reference_image must be an image (or a list of images)")
    return refs


def reference_latents(pipe, refs: list[Image.Image], height: int, width: int) -> torch.Tensor | None:
    """Each reference image VAE-encoded alone, as one latent frame: (1, C, len(refs), h, w)."""
    if not refs:
        return None
    return torch.cat([vae_encode(pipe, video_tensor([r], height, width)) for r in refs], dim=2)


def mask_latents(mask: torch.Tensor, spatial: int = 8, temporal: int = 4) -> torch.Tensor:
    """(1, 3, F, H, W) pixel mask -> (1, spatial^2, latent frames, H/spatial, W/spatial): its first channel's
    8 x 8 pixel blocks as channels, frames resampled nearest-exact to the latent frames."""
    m = mask[0, 0]
    f, h, w = m.shape
    m = m.view(f, h // spatial, spatial, w // spatial, spatial).permute(2, 4, 0, 1, 3).flatten(0, 1)
    m = torch.nn.functional.interpolate(m[None], size=(latent_frames(f, temporal), h // spatial, w // spatial),
                                        mode="nearest-exact")
    return m


class WanVaceEmbedder(PipelineUnit):
    """The VACE context (B, 96, frames, h, w): the control video split by the mask into its inactive (mask 0) and
    reactive (mask 1) parts, each VAE-encoded, and the mask folded onto 64 channels; a reference image leads as
    its own latents, zeros, and a zero mask. No control video: black frames; no mask: all reactive."""

    feature = "vace"
    inputs = ("vace_video", "vace_video_mask", "vace_reference_image", "height", "width", "num_frames", "batch_size")
    outputs = ("vace_context",)
    models = ("vae",)

    def process(self, pipe, vace_video, vace_video_mask, vace_reference_image, height, width, num_frames,
                batch_size):
        if vace_video is None and vace_video_mask is None and vace_reference_image is None:
            return {}
        n = int(batch_size or 1)
        _, spatial, temporal = vae_scales(pipe.vae)
        out = []
        for video, mask, refs in zip(_per_clip(vace_video, n), _per_clip(vace_video_mask, n),
                                     _per_sample(vace_reference_image, n)):
            frames = num_frames if video is None else len(as_image_list(video))
            pixels = torch.zeros(1, 3, frames, height, width) if video is None else video_tensor(video, height, width)
            m = torch.ones_like(pixels) if mask is None else _mask_tensor(mask, height, width)
            if m.shape != pixels.shape:
                raise UserError(f"vace_video_mask has {m.shape[2]} frames, vace_video {pixels.shape[2]}")
            inactive = vae_encode(pipe, pixels * (1 - m))
            reactive = vae_encode(pipe, pixels * m)
            latents = torch.cat([inactive, reactive], dim=1)
            masks = mask_latents(m, spatial, temporal).to(latents)
            ref = reference_latents(pipe, _references(refs), height, width)
            if ref is not None:
                latents = torch.cat([torch.cat([ref, torch.zeros_like(ref)], dim=1), latents], dim=2)
                masks = torch.cat([masks.new_zeros(1, masks.shape[1], ref.shape[2], *masks.shape[3:]), masks], dim=2)
            out.append(torch.cat([latents, masks], dim=1))
        return {"vace_context": torch.cat(out).to(pipe.torch_dtype)}


def _per_clip(value, batch_size: int) -> list:
    """One clip (a list of frames) per sample: a stage-1 batch gives a list of clips."""
    if isinstance(value, (list, tuple)) and value and not isinstance(value[0], Image.Image) \
            and len(value) == batch_size:
        return list(value)
    return [value] * batch_size


class WanVaceNoiseInitializer(WanNoiseInitializer):
    """The noise with one more leading latent frame per reference image (the frames dropped after sampling)."""

    feature = "vace"
    replaces = ("WanNoiseInitializer",)
    inputs = WanNoiseInitializer.inputs + ("vace_reference_image",)

    def process(self, pipe, height, width, num_frames, seed, rand_device, batch_size, vace_reference_image=None):
        refs = len(_references(_per_sample(vace_reference_image, int(batch_size or 1))[0]))
        _, _, temporal = vae_scales(pipe.vae)
        # diffusers' WanVACEPipeline: the noise of num_frames + 4 per reference image, one draw
        return super().process(pipe, height, width, int(num_frames) + temporal * refs, seed, rand_device, batch_size)


class WanVaceInputVideoEmbedder(WanInputVideoEmbedder):
    """Training: the clean latents of the reference image(s) lead the clip's (the loss covers them, as in the
    reference)."""

    feature = "vace"
    replaces = ("WanInputVideoEmbedder",)
    inputs = WanInputVideoEmbedder.inputs + ("vace_reference_image", "batch_size")

    def process(self, pipe, input_video, noise, height, width, vace_reference_image=None, batch_size=None):
        out = super().process(pipe, input_video, noise, height, width)
        if "input_latents" not in out or vace_reference_image is None:
            return out
        latents = out["input_latents"]
        refs = [reference_latents(pipe, _references(r), height, width)
                for r in _per_sample(vace_reference_image, latents.shape[0])]
        if any(r is None for r in refs):
            return out
        out["input_latents"] = torch.cat([torch.cat(refs).to(latents), latents], dim=2)
        return out


def reference_frame_count(vace_reference_image) -> int:
    """Leading latent frames the reference images add (dropped from sampled latents before decoding)."""
    return len(_references(_per_sample(vace_reference_image, 1)[0]))



class _Vace(Feature):
    def denoise(self, pipe, call):
        """The branch's hints after its DiT blocks (the low-noise expert's own branch where it has one)."""
        vace = pipe.vace2 if call.low_noise and pipe.vace2 is not None else pipe.vace
        if vace is None:
            raise UserError("VACE inputs were given but no VACE model is loaded (a Wan VACE file holds one)")
        call.checkpointing(vace)
        call.block_hooks.append(vace.block_hook(call.values["vace_context"], call.settings.get("vace_scale", 1.0)))

    def finish(self, pipe, latents, values):
        """The reference images' leading latent frames go before decoding."""
        references = reference_frame_count(values.get("vace_reference_image"))
        return latents[:, :, references:] if references else latents


VACE_INPUTS = ("vace_video", "vace_video_mask", "vace_reference_image")
VACE = _Vace("vace", columns=VACE_INPUTS, model_fn_inputs=("vace_context",),
             units=(WanVaceNoiseInitializer(), WanVaceInputVideoEmbedder(), WanVaceEmbedder()),
             slots=("vace", "vace2"), loss_models=("vace",),
             needs={"vace": "a VACE file (its DiT file holds the VACE branch)"},
             inputs={"vace_video": ALIGNED_FRAMES, "vace_video_mask": ALIGNED_FRAMES, "vace_reference_image": IMAGE},
             call_inputs={name: None for name in VACE_INPUTS}, call_settings={"vace_scale": 1.0},
             description="VACE: the control video, its mask and reference images as the VACE branch's context")

__all__ = ["CONTEXT_CHANNELS", "VACE_CONFIGS", "VACE_DIT_ORIGINAL", "VACE_LORA_TARGETS", "VACE_ORIGINAL", "WanVACEModel",
           "WanVaceEmbedder", "WanVaceInputVideoEmbedder", "WanVaceNoiseInitializer", "mask_latents",
           "reference_frame_count", "reference_latents", "vace_dit_from_original", "vace_from_original",
           "vace_to_original", "VACE"]
