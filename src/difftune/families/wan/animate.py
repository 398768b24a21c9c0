"""Wan2.2-Animate-14B: character animation from a pose video and a face video.

The released file holds the I2V 14B DiT and, beside it, the animate adapter: `pose_patch_embedding` (the pose
video's VAE latents, patch-embedded and added to every latent frame but the first), the motion encoder (each face
frame -> a motion vector), the face encoder (motion vectors -> per-latent-frame face tokens) and the face adapter
(a cross-attention from the video tokens to the face tokens of their own frame, added after every fifth DiT
block). As in the reference, one file fills two slots: `dit` (diffusers' `WanTransformer3DModel`) and
`animate_adapter` (`WanAnimateAdapter` here, built from diffusers' Wan-Animate modules with the key names of
diffusers' `WanAnimateTransformer3DModel`), so `--trainable_models animate_adapter` trains the adapter alone and
a LoRA on `dit` does not reach the face adapter's attention.

Training follows the reference: the clip's first frame is the input image (the I2V condition), and the pose and
face videos are cut to the clip's length minus 4 frames (one latent frame fewer: the first latent frame has none).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from diffusers.models.transformers.transformer_wan_animate import (WanAnimateFaceBlockAttnProcessor,
                                                                    WanAnimateFaceBlockCrossAttention,
                                                                    WanAnimateFaceEncoder, WanAnimateMotionEncoder)
from PIL import Image
from torch import nn

from ...core.features import ALIGNED_FRAMES, Feature
from ...core.units import PipelineUnit
from ...errors import UserError
from ...media.image import as_image_list
from ...models.detect import ComponentSpec
from .components import WAN_DIT_CONFIGS, _dit_from_original, _strip_comfy_prefix
from .dit_forward import BlockInputs, run_checkpointed
from .units import _per_sample, vae_encode, vae_scales, video_tensor

ADAPTER_PREFIXES = ("pose_patch_embedding.", "motion_encoder.", "face_encoder.", "face_adapter.")
INJECT_EVERY = 5  # the face adapter follows DiT blocks 0, 5, 10, ...
SPLIT_FRAMES = 4  # training: pose / face videos are the clip minus its last 4 frames (one latent frame)


class WanAnimateAdapter(ModelMixin, ConfigMixin):
    """The `animate_adapter` slot: pose embedding, motion and face encoders, face adapter blocks."""

    _supports_gradient_checkpointing = True
    _keep_in_fp32_modules = ["motion_synthesis_weight"]

    @register_to_config
    def __init__(self, num_attention_heads: int = 40, attention_head_dim: int = 128, num_face_blocks: int = 8,
                 latent_channels: int = 16, patch_size: tuple[int, int, int] = (1, 2, 2), eps: float = 1e-6,
                 motion_encoder_channel_sizes: dict | None = None, motion_encoder_size: int = 512,
                 motion_style_dim: int = 512, motion_dim: int = 20, motion_encoder_dim: int = 512,
                 face_encoder_hidden_dim: int = 1024, face_encoder_num_heads: int = 4,
                 inject_face_latents_blocks: int = INJECT_EVERY, motion_encoder_batch_size: int = 8):
        super().__init__()
        inner = num_attention_heads * attention_head_dim
        self.pose_patch_embedding = nn.Conv3d(latent_channels, inner, kernel_size=patch_size, stride=patch_size)
        self.motion_encoder = WanAnimateMotionEncoder(size=motion_encoder_size, style_dim=motion_style_dim,
                                                      motion_dim=motion_dim, out_dim=motion_encoder_dim,
                                                      channels=motion_encoder_channel_sizes)
        self.face_encoder = WanAnimateFaceEncoder(in_dim=motion_encoder_dim, out_dim=inner,
                                                  hidden_dim=face_encoder_hidden_dim, num_heads=face_encoder_num_heads)
        head = inner // num_attention_heads
        self.face_adapter = nn.ModuleList([
            WanAnimateFaceBlockCrossAttention(dim=inner, heads=num_attention_heads, dim_head=head, eps=eps,
                                              cross_attention_dim_head=head,
                                              processor=WanAnimateFaceBlockAttnProcessor())
            for _ in range(num_face_blocks)])
        self.gradient_checkpointing = False

    def pose_residual(self, pose_latents: torch.Tensor) -> torch.Tensor:
        """(B, 16, F-1, h, w) pose latents -> the (B, D, F, h/2, w/2) patch residual (zero on the first frame)."""
        pose = self.pose_patch_embedding(pose_latents.to(self.pose_patch_embedding.weight.dtype))
        return torch.cat([torch.zeros_like(pose[:, :, :1]), pose], dim=2)

    def motion_vectors(self, face_pixel_values: torch.Tensor) -> torch.Tensor:
        """(B, 3, T, H, W) face frames in [-1, 1] -> (B, latent frames, heads + 1, D) face tokens, a zero first
        frame in front. Frames not at the motion encoder's size are resized (bilinear) to it."""
        b, c, t, h, w = face_pixel_values.shape
        frames = face_pixel_values.transpose(1, 2).reshape(b * t, c, h, w)
        size = self.config.motion_encoder_size
        if (h, w) != (size, size):
            frames = F.interpolate(frames.float(), size=(size, size), mode="bilinear", align_corners=False,
                                   antialias=True)
        frames = frames.to(self.pose_patch_embedding.weight.dtype)
        batches = torch.split(frames, self.config.motion_encoder_batch_size)
        motion = torch.cat([run_checkpointed(self, self.motion_encoder, batch) for batch in batches])
        motion = self.face_encoder(motion.view(b, t, -1))
        return torch.cat([torch.zeros_like(motion[:, :1]), motion], dim=1)

    def block_hook(self, face_motion: torch.Tensor):
        """The `wan_dit_forward` hook: after every `inject_face_latents_blocks`-th DiT block, the face adapter's
        cross-attention to the face tokens (`motion_vectors`) of each video token's own latent frame."""
        every = self.config.inject_face_latents_blocks
        motion = face_motion

        def hook(inputs: BlockInputs):
            if inputs.hidden_states.shape[1] % motion.shape[1]:
                raise UserError(f"the face video gives {motion.shape[1]} latent frames, the clip "
                                f"{inputs.hidden_states.shape[1]} tokens: animate_face_video must have the clip's "
                                f"frames minus 4")

            def after(i, hidden):
                if i % every or i // every >= len(self.face_adapter):
                    return hidden
                out = run_checkpointed(self, self.face_adapter[i // every], hidden, motion.to(hidden.dtype))
                return hidden + out.to(hidden.device)

            return after

        return hook


def animate_inputs(adapter, pose_latents: torch.Tensor | None, face_motion: torch.Tensor | None):
    """model_fn's part: (the pose residual on the patch grid, the face adapter's block hook)."""
    if adapter is None:
        raise UserError("animate_pose_video / animate_face_video were given but no animate adapter is loaded (the "
                        "Wan2.2-Animate-14B file holds one)")
    if pose_latents is None or face_motion is None:
        raise UserError("Wan-Animate needs both animate_pose_video and animate_face_video")
    return adapter.pose_residual(pose_latents), adapter.block_hook(face_motion)


# -- the released file -----------------------------------------------------------------------------------------
_CONVS = re.compile(r"motion_encoder\.enc\.net_app\.convs\.(\d+)\.(.+)")


def _motion_key(key: str, last: int) -> str | None:
    """A released motion-encoder key -> diffusers' (None for the fixed blur kernels, which diffusers computes)."""
    if key == "motion_encoder.dec.direction.weight":
        return "motion_encoder.motion_synthesis_weight"
    if key.startswith("motion_encoder.enc.fc."):
        return "motion_encoder.motion_network." + key[len("motion_encoder.enc.fc."):]
    m = _CONVS.fullmatch(key)
    if m is None:
        raise KeyError(key)
    i, rest = int(m[1]), m[2]
    if rest.endswith(".kernel"):
        return None
    if i == 0:
        return {"0.weight": "motion_encoder.conv_in.weight", "1.bias": "motion_encoder.conv_in.act_fn.bias"}[rest]
    if i == last:
        return {"weight": "motion_encoder.conv_out.weight"}[rest]
    block = f"motion_encoder.res_blocks.{i - 1}."
    return block + {"conv1.0.weight": "conv1.weight", "conv1.1.bias": "conv1.act_fn.bias",
                    "conv2.1.weight": "conv2.weight", "conv2.2.bias": "conv2.act_fn.bias",
                    "skip.1.weight": "conv_skip.weight"}[rest]


def animate_adapter_from_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors of a released Animate file (Wan's names) in diffusers' names: motion encoder convs and
    fc layers at any depth, the face encoder's causal convs, the face blocks' fused k/v split in two."""
    if not any(k.startswith("motion_encoder.") for k in state):
        raise KeyError("not a Wan-Animate file")
    convs = [int(m[1]) for k in state if (m := _CONVS.fullmatch(k))]
    last = max(convs) if convs else -1
    out = {}
    for key, value in state.items():
        if key.startswith("pose_patch_embedding."):
            out[key] = value
        elif key.startswith("motion_encoder."):
            new = _motion_key(key, last)
            if new is not None:
                out[new] = value.reshape(-1) if new.endswith("act_fn.bias") else value
        elif key.startswith("face_encoder."):
            out[re.sub(r"\.(conv1_local|conv2|conv3)\.conv\.", r".\1.", key)] = value
        elif m := re.fullmatch(r"face_adapter\.fuser_blocks\.(\d+)\.(.+)", key):
            block, rest = f"face_adapter.{m[1]}.", m[2]
            if rest.startswith("linear1_kv."):
                k, v = value.chunk(2, dim=0)
                out[block + "to_k." + rest[len("linear1_kv."):]] = k
                out[block + "to_v." + rest[len("linear1_kv."):]] = v
            else:
                out[block + {"linear1_q": "to_q", "linear2": "to_out", "q_norm": "norm_q",
                             "k_norm": "norm_k"}[rest.split(".")[0]] + rest[rest.index("."):]] = value
    return out


def animate_adapter_to_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A `WanAnimateAdapter` state dict in the released file's names (the inverse of the above; activation biases
    as the released (1, C, 1, 1))."""
    blocks = {int(m[1]) for k in state if (m := re.match(r"motion_encoder\.res_blocks\.(\d+)\.", k))}
    last = len(blocks) + 1
    res = {"conv1.weight": "conv1.0.weight", "conv1.act_fn.bias": "conv1.1.bias", "conv2.weight": "conv2.1.weight",
           "conv2.act_fn.bias": "conv2.2.bias", "conv_skip.weight": "skip.1.weight"}
    out = {}
    for key, value in state.items():
        if key.startswith("pose_patch_embedding."):
            out[key] = value
        elif key == "motion_encoder.motion_synthesis_weight":
            out["motion_encoder.dec.direction.weight"] = value
        elif key.startswith("motion_encoder.motion_network."):
            out["motion_encoder.enc.fc." + key[len("motion_encoder.motion_network."):]] = value
        elif key == "motion_encoder.conv_in.weight":
            out["motion_encoder.enc.net_app.convs.0.0.weight"] = value
        elif key == "motion_encoder.conv_in.act_fn.bias":
            out["motion_encoder.enc.net_app.convs.0.1.bias"] = value.view(1, -1, 1, 1)
        elif key == "motion_encoder.conv_out.weight":
            out[f"motion_encoder.enc.net_app.convs.{last}.weight"] = value
        elif m := re.fullmatch(r"motion_encoder\.res_blocks\.(\d+)\.(.+)", key):
            name = f"motion_encoder.enc.net_app.convs.{int(m[1]) + 1}.{res[m[2]]}"
            out[name] = value.view(1, -1, 1, 1) if name.endswith(".bias") else value
        elif key.startswith("face_encoder."):
            out[re.sub(r"\.(conv1_local|conv2|conv3)\.", r".\1.conv.", key)] = value
        elif m := re.fullmatch(r"face_adapter\.(\d+)\.(to_q|to_k|to_v|to_out|norm_q|norm_k)\.(.+)", key):
            block = f"face_adapter.fuser_blocks.{m[1]}."
            if m[2] == "to_k":
                out[block + "linear1_kv." + m[3]] = torch.cat([value, state[key.replace(".to_k.", ".to_v.")]])
            elif m[2] != "to_v":
                out[block + {"to_q": "linear1_q", "to_out": "linear2", "norm_q": "q_norm",
                             "norm_k": "k_norm"}[m[2]] + "." + m[3]] = value
    return out


def _is_adapter(key: str) -> bool:
    return key.startswith(ADAPTER_PREFIXES)


def animate_dit_from_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if not any(k.startswith("motion_encoder.") for k in state):
        raise KeyError("not a Wan-Animate file")
    return _dit_from_original({k: v for k, v in state.items() if not _is_adapter(k)})


def animate_adapter_config(heads: int = 40, head_dim: int = 128, face_blocks: int = 8, **motion) -> dict:
    return {"_class_name": "WanAnimateAdapter", "num_attention_heads": heads, "attention_head_dim": head_dim,
            "num_face_blocks": face_blocks, "latent_channels": 16, "patch_size": [1, 2, 2], "eps": 1e-6,
            "motion_encoder_channel_sizes": None, "motion_encoder_size": 512, "motion_style_dim": 512,
            "motion_dim": 20, "motion_encoder_dim": 512, "face_encoder_hidden_dim": 1024,
            "face_encoder_num_heads": 4, "inject_face_latents_blocks": INJECT_EVERY,
            "motion_encoder_batch_size": 8, **motion}


_FOREIGN = ("WanModel", "WanAnimateModel")

ANIMATE_DIT_ORIGINAL = ComponentSpec(
    name="dit", library="diffusers", class_name="WanTransformer3DModel", extra_slots=("dit2",),
    known_configs={"Wan2.2-Animate-14B (DiT)": WAN_DIT_CONFIGS["Wan2.1-I2V-14B"]},
    marker_keys=("patch_embedding.weight", "head.modulation", "motion_encoder.dec.direction.weight"),
    normalize_key=_strip_comfy_prefix, convert_state_dict=animate_dit_from_original, foreign_config_classes=_FOREIGN,
    description="the DiT of Wan2.2-Animate-14B (its adapter fills `animate_adapter`)")

ANIMATE_ADAPTER_ORIGINAL = ComponentSpec(
    name="animate_adapter", library=__name__, class_name="WanAnimateAdapter", companion=True,
    known_configs={"Wan2.2-Animate-14B": animate_adapter_config()},
    marker_keys=("pose_patch_embedding.weight", "motion_encoder.dec.direction.weight",
                 "face_adapter.fuser_blocks.0.linear1_kv.weight"),
    normalize_key=_strip_comfy_prefix,
    convert_state_dict=lambda state: animate_adapter_from_original({k: v for k, v in state.items()
                                                                    if _is_adapter(k)}),
    foreign_config_classes=_FOREIGN,
    description="the animate adapter of Wan2.2-Animate-14B (pose embedding, motion / face encoders, face adapter)")


# -- units ----------------------------------------------------------------------------------------------------
def _clips(value, batch_size: int) -> list:
    if isinstance(value, (list, tuple)) and value and not isinstance(value[0], Image.Image):
        return list(value)
    return [value] * batch_size


class WanAnimateVideoSplit(PipelineUnit):
    """Training: the pose / face (/ inpaint background and mask) videos cut to the clip's frames minus 4, as the
    reference's (the first latent frame, the input image's, has no pose or face)."""

    feature = "animate"
    inputs = ("input_video", "animate_pose_video", "animate_face_video", "animate_inpaint_video",
              "animate_mask_video")
    outputs = ("animate_pose_video", "animate_face_video", "animate_inpaint_video", "animate_mask_video")
    skip_without = ("input_video",)

    def process(self, pipe, input_video, animate_pose_video, animate_face_video, animate_inpaint_video,
                animate_mask_video):
        clips = _clips(input_video, 1)
        keep = len(as_image_list(clips[0])) - SPLIT_FRAMES

        def cut(video):
            if video is None:
                return None
            if isinstance(video, (list, tuple)) and video and not isinstance(video[0], Image.Image):
                return [as_image_list(v)[:keep] for v in video]
            return as_image_list(video)[:keep]

        return {"animate_pose_video": cut(animate_pose_video), "animate_face_video": cut(animate_face_video),
                "animate_inpaint_video": cut(animate_inpaint_video), "animate_mask_video": cut(animate_mask_video)}


class WanAnimatePoseLatents(PipelineUnit):
    """The pose video's VAE latents (B, 16, latent frames, h, w)."""

    feature = "animate"
    inputs = ("animate_pose_video", "height", "width", "batch_size")
    outputs = ("pose_latents",)
    models = ("vae",)
    skip_without = ("animate_pose_video",)

    def process(self, pipe, animate_pose_video, height, width, batch_size):
        clips = _clips(animate_pose_video, int(batch_size or 1))
        latents = torch.cat([vae_encode(pipe, video_tensor(as_image_list(c), height, width)) for c in clips])
        return {"pose_latents": latents.to(pipe.torch_dtype)}


def face_pixels(face_video, batch_size: int, device, dtype) -> torch.Tensor:
    """Face frames (a clip per sample) as (B, 3, T, H, W) in [-1, 1], at their loaded size (the adapter resizes to
    its motion encoder's)."""
    clips = [as_image_list(c) for c in _clips(face_video, batch_size)]
    w, h = clips[0][0].size
    return torch.cat([video_tensor(c, h, w) for c in clips]).to(device, dtype)


class WanAnimateFaceMotion(PipelineUnit):
    """The face tokens (B, latent frames, heads + 1, D) from the face frames, through the adapter's motion and face
    encoders: cached by stage 1 when the adapter is frozen (a LoRA on the DiT), recomputed in stage 2 from the
    cached frames when it is trained. The unguided prediction's tokens are those of a black face video (-1
    everywhere, the reference's and diffusers' unconditional face), which sampling gives as its negative side."""

    feature = "animate"
    inputs = ("batch_size",)
    cfg_inputs = {"animate_face_video": ("animate_face_video", "negative_animate_face_video")}
    cfg_outputs = {"face_motion": ("face_motion", "negative_face_motion")}
    models = ("animate_adapter",)
    skip_without = ("animate_face_video",)

    def process(self, pipe, batch_size, animate_face_video):
        pixels = face_pixels(animate_face_video, int(batch_size or 1), pipe.device, pipe.torch_dtype)
        return {"face_motion": pipe.animate_adapter.motion_vectors(pixels)}


def i2v_mask(frames: int, h: int, w: int, known: int = 1, pixels: torch.Tensor | None = None,
             temporal: int = 4) -> torch.Tensor:
    """The 4-channel I2V mask over `latent frames` (`frames` = latent frames): the first `known` pixel frames 1 (or
    the given per-pixel-frame mask), the first frame standing for `temporal` frames."""
    m = torch.zeros(1, (frames - 1) * temporal + 1, h, w) if pixels is None else pixels.clone()
    m[:, :known] = 1
    m = torch.cat([m[:, :1].repeat_interleave(temporal, dim=1), m[:, 1:]], dim=1)
    return m.view(1, m.shape[1] // temporal, temporal, h, w).transpose(1, 2)[0]


class WanAnimateInpaint(PipelineUnit):
    """Replacement mode: the condition is the input image (mask 1) as one leading latent frame, then the
    background video's latents behind the inverted character mask (nearest-resized to the latents)."""

    feature = "animate_replace"
    replaces = ("WanImageEmbedderVAE",)
    inputs = ("animate_inpaint_video", "animate_mask_video", "input_image", "height", "width", "batch_size")
    outputs = ("condition",)
    models = ("vae",)

    def process(self, pipe, animate_inpaint_video, animate_mask_video, input_image, height, width, batch_size):
        if animate_inpaint_video is None or animate_mask_video is None:
            return {}
        if input_image is None:
            raise UserError("animate replacement needs the character image: --extra_inputs input_image")
        n = int(batch_size or 1)
        _, _, temporal = vae_scales(pipe.vae)
        out = []
        for background, mask, image in zip(_clips(animate_inpaint_video, n), _clips(animate_mask_video, n),
                                           _per_sample(input_image, n)):
            z = vae_encode(pipe, video_tensor(as_image_list(background), height, width))[0]
            _, t, h, w = z.shape
            ref = vae_encode(pipe, video_tensor([image], height, width))[0]
            y_ref = torch.cat([i2v_mask(1, h, w, 1, temporal=temporal).to(ref), ref])
            masks = (video_tensor(as_image_list(mask), height, width)[0] + 1) / 2  # (3, T, H, W) in [0, 1]
            keep = F.interpolate((1 - masks).transpose(0, 1), size=(h, w), mode="nearest")[:, 0]  # (T, h, w)
            y_bg = torch.cat([i2v_mask(t, h, w, 0, keep[None], temporal).to(z), z])
            out.append(torch.cat([y_ref, y_bg], dim=1)[None])
        return {"condition": torch.cat(out).to(pipe.torch_dtype)}



FACE_SIZE = 512  # Wan2.2-Animate's face frames (the reference's and diffusers' size)


class _Animate(Feature):
    def operators(self, config):
        """animate_face_video: its frames cropped and resized to 512 x 512 (the reference's face operator), not to
        the clip's size."""
        from ...data import UnifiedDataset

        frames = config.frames
        if frames is None:
            return {}
        return {"animate_face_video": UnifiedDataset.default_video_operator(
            config.dataset_base_path, FACE_SIZE, FACE_SIZE, config.max_pixels, 16, 16, **frames.as_dict())}

    def negatives(self, values):
        """The unguided prediction sees a black face (-1 everywhere)."""
        face = values.get("animate_face_video")
        if face is None:
            return {}
        return {"negative_animate_face_video": [Image.new("RGB", f.size) for f in as_image_list(face)]}

    def denoise(self, pipe, call):
        """The pose residual on the patch grid and the face adapter after its blocks."""
        call.checkpointing(pipe.animate_adapter)
        call.patch_residual, hook = animate_inputs(pipe.animate_adapter, call.values.get("pose_latents"),
                                                   call.values.get("face_motion"))
        call.block_hooks.append(hook)

    def finish(self, pipe, latents, values):
        """The character's leading latent frame goes (the reference and diffusers decode the pose video's frames
        only, num_frames - 4)."""
        return latents[:, :, 1:] if values.get("pose_latents") is not None else latents


ANIMATE_INPUTS = ("animate_pose_video", "animate_face_video")
REPLACE_INPUTS = ("animate_inpaint_video", "animate_mask_video")
ANIMATE = _Animate(
    "animate", columns=ANIMATE_INPUTS, model_fn_inputs=("pose_latents", "face_motion"),
    units=(WanAnimateVideoSplit(), WanAnimatePoseLatents(), WanAnimateFaceMotion()),
    slots=("animate_adapter",), loss_models=("animate_adapter",),
    needs={"animate_adapter": "the Wan2.2-Animate-14B file (it holds the animate adapter)"},
    inputs={name: ALIGNED_FRAMES for name in ANIMATE_INPUTS}, call_inputs={name: None for name in ANIMATE_INPUTS},
    description="Wan2.2-Animate: a pose video (patch residual) and a face video (face adapter)")
ANIMATE_REPLACE = Feature(
    "animate_replace", columns=REPLACE_INPUTS, requires=("animate",), units=(WanAnimateInpaint(),),
    inputs={name: ALIGNED_FRAMES for name in REPLACE_INPUTS}, call_inputs={name: None for name in REPLACE_INPUTS},
    description="Wan2.2-Animate replacement mode: a background video and character mask as the image condition")

__all__ = ["ANIMATE_ADAPTER_ORIGINAL", "ANIMATE_DIT_ORIGINAL", "WanAnimateAdapter", "WanAnimateFaceMotion",
           "WanAnimateInpaint", "WanAnimatePoseLatents", "WanAnimateVideoSplit", "animate_adapter_config",
           "animate_adapter_from_original", "animate_adapter_to_original", "animate_dit_from_original",
           "animate_inputs", "face_pixels", "i2v_mask", "ANIMATE", "ANIMATE_REPLACE", "FACE_SIZE"]
