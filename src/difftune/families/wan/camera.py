"""Fun-Control-Camera (PAI's Wan2.1-Fun-V1.1-{1.3B,14B}-Control-Camera, Wan2.2-Fun-A14B-Control-Camera).

A camera move (`camera_control_direction`: Left, Right, Up, Down, In, Out or a combination such as LeftUp, and
`camera_control_speed` per frame) becomes one camera pose per frame (CameraCtrl's pose rows: frame, fx, fy, cx,
cy, two unused, the 3 x 4 world-to-camera matrix), then per-pixel Plücker rays (moment o x d and direction d of
the ray through each pixel centre, relative to the first camera), packed four frames to a latent frame (24
channels). The DiT's `control_adapter` (pixel-unshuffle by 8, a 2 x 2 convolution to the DiT width, one residual
block) turns them into a residual on the patch-embedded video (`wan_dit_forward(patch_residual=...)`).

The image condition: the Wan2.1 DiTs (32 input channels) take the input image's latents as the first latent frame
of an otherwise zero 16-channel condition; the Wan2.2 A14B one (36) the usual I2V condition (mask + latents).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ...core.features import VALUE, Feature
from ...core.units import PipelineUnit
from ...errors import UserError
from .units import _per_sample, latent_frames, vae_encode, vae_scales, video_tensor
from .image_features import dit_extra_channels

DIRECTIONS = ("Left", "Right", "Up", "Down", "In", "Out")
DEFAULT_SPEED = 1 / 54
# The first camera: normalised intrinsics (fx, fy, cx, cy) and the identity world-to-camera matrix.
DEFAULT_ORIGIN = (0, 0.532139961, 0.946026558, 0.5, 0.5, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0)
POSE_SIZE = (1280, 720)  # the (width, height) the pose intrinsics are given for
PLUCKER_CHANNELS = 6


class WanCameraAdapter(nn.Module):
    """The DiT's `control_adapter` (the reference's SimpleAdapter; its key names: conv, residual_blocks.0.conv1 /
    conv2): (B, C, F, H, W) pixel-rate camera embedding -> (B, D, F, H/16, W/16)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size=(2, 2), num_residual_blocks: int = 1):
        super().__init__()
        self.pixel_unshuffle = nn.PixelUnshuffle(8)
        self.conv = nn.Conv2d(in_channels * 64, out_channels, kernel_size=tuple(kernel_size),
                              stride=tuple(kernel_size))
        self.residual_blocks = nn.Sequential(*[_Residual(out_channels) for _ in range(num_residual_blocks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, f, h, w = x.shape
        y = self.residual_blocks(self.conv(self.pixel_unshuffle(x.transpose(1, 2).reshape(b * f, c, h, w))))
        return y.view(b, f, *y.shape[1:]).transpose(1, 2)


class _Residual(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.conv1 = nn.Conv2d(dim, dim, kernel_size=3, padding=1)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(dim, dim, kernel_size=3, padding=1)

    def forward(self, x):
        return x + self.conv2(self.relu(self.conv1(x)))


# -- camera poses and Plücker rays ------------------------------------------------------------------------------
def camera_poses(direction: str, length: int, speed: float = DEFAULT_SPEED, origin=DEFAULT_ORIGIN) -> list[list]:
    """One pose row per frame: each frame moves the previous one by `speed` (Left/Right on entry 9, Up/Down on 13,
    In/Out on 18 of the row, as the reference's generator)."""
    if not isinstance(direction, str) or not direction or not any(d in direction for d in DIRECTIONS):
        raise UserError(f"camera_control_direction {direction!r}: expected a combination of {', '.join(DIRECTIONS)} "
                        f"(e.g. Left, RightUp)")
    step = {9: ("Left", "Right"), 13: ("Up", "Down"), 18: ("Out", "In")}
    rows = [list(_origin(origin))]
    while len(rows) < length:
        row = list(rows[-1])
        for index, (plus, minus) in step.items():
            row[index] += speed * ((plus in direction) - (minus in direction))
        rows.append(row)
    return rows


def plucker_embedding(poses: list[list], height: int, width: int) -> torch.Tensor:
    """(frames, height, width, 6) Plücker rays (o x d, d) of the pixel centres, in the first camera's frame."""
    poses = np.asarray(poses, dtype=np.float64)
    fx, fy, cx, cy = (poses[:, i].copy() for i in range(1, 5))
    # the intrinsics are for POSE_SIZE: rescale the axis the sample's aspect ratio crops
    pose_ratio, ratio = POSE_SIZE[0] / POSE_SIZE[1], width / height
    if pose_ratio > ratio:
        fx = height * pose_ratio * fx / width
    else:
        fy = width / pose_ratio * fy / height
    intrinsics = torch.as_tensor(np.stack([fx * width, fy * height, cx * width, cy * height], axis=1),
                                 dtype=torch.float32)
    w2c = np.tile(np.eye(4), (len(poses), 1, 1))
    w2c[:, :3, :] = poses[:, 7:19].reshape(-1, 3, 4)
    c2w = np.linalg.inv(w2c)
    relative = np.concatenate([np.eye(4)[None], w2c[0] @ c2w[1:]]).astype(np.float32)
    c2w = torch.as_tensor(relative)
    rows = torch.linspace(0, height - 1, height, dtype=torch.float32) + 0.5
    cols = torch.linspace(0, width - 1, width, dtype=torch.float32) + 0.5
    j, i = torch.meshgrid(rows, cols, indexing="ij")
    i, j = i.reshape(1, -1), j.reshape(1, -1)
    fx, fy, cx, cy = (intrinsics[:, k:k + 1] for k in range(4))
    d = torch.stack([(i - cx) / fx, (j - cy) / fy, torch.ones_like((i - cx) / fx)], dim=-1)  # (F, HW, 3)
    d = d / d.norm(dim=-1, keepdim=True)
    # rotated by elementwise products, not a matmul: float32 under mixed-precision autocast too
    d = (d[..., None, :] * c2w[:, None, :3, :3]).sum(-1)
    o = c2w[:, None, :3, 3].expand_as(d)
    return torch.cat([torch.linalg.cross(o, d, dim=-1), d], dim=-1).reshape(len(poses), height, width, 6)


def pack_camera_latents(plucker: torch.Tensor, temporal: int = 4) -> torch.Tensor:
    """(F, H, W, 6) -> (1, 6 * temporal, latent frames, H, W): the first frame repeated to a full group, then each
    group of `temporal` frames stacked on channels (channel = 4 * ray channel + frame in group)."""
    video = plucker.permute(3, 0, 1, 2)  # (6, F, H, W)
    video = torch.cat([video[:, :1].repeat(1, temporal, 1, 1), video[:, 1:]], dim=1)
    c, f, h, w = video.shape
    return video.view(c, f // temporal, temporal, h, w).transpose(0, 1).reshape(f // temporal, c * temporal, h, w) \
        .transpose(0, 1).unsqueeze(0)


def _missing(value) -> bool:
    # an empty cell: None, blank text, or a float NaN (how table readers give one); the text "nan" is no empty cell
    return value is None or (isinstance(value, str) and not value.strip()) or (isinstance(value, float)
                                                                              and value != value)


def _speed(value) -> float:
    if _missing(value):
        return DEFAULT_SPEED
    try:
        speed = float(value)
    except (TypeError, ValueError):
        speed = None
    if speed is None or not np.isfinite(speed):  # inf / nan would reach the loss as NaN poses
        raise UserError(f"camera_control_speed {value!r}: expected a finite number (per frame, e.g. 0.0185)")
    return speed


def _origin(value) -> tuple:
    """The first camera's pose row: a list of 19 numbers, or a metadata cell holding them ("[0, 0.53, ...]" or
    separated by spaces or commas)."""
    if _missing(value):
        return DEFAULT_ORIGIN
    numbers = value
    if isinstance(value, str):
        numbers = value.strip().strip("[]()").replace(",", " ").split()
    try:
        row = tuple(float(v) for v in numbers)
    except (TypeError, ValueError):
        row = ()
    if len(row) != len(DEFAULT_ORIGIN) or not np.isfinite(row).all():
        raise UserError(f"camera_control_origin {value!r}: expected {len(DEFAULT_ORIGIN)} numbers, all finite (a "
                        f"CameraCtrl pose row: frame, fx, fy, cx, cy, two unused, the 3 x 4 world-to-camera matrix), e.g. "
                        f"{' '.join(f'{v:g}' for v in DEFAULT_ORIGIN)}")
    rotation = np.asarray(row[7:19], dtype=np.float64).reshape(3, 4)[:, :3]
    if abs(np.linalg.det(rotation)) < 1e-12:  # every later pose is taken relative to this one's inverse
        raise UserError(f"camera_control_origin {value!r}: its 3 x 3 rotation (entries 8-10, 12-14, 16-18) is not "
                        f"invertible (determinant 0); the default origin's is the identity")
    return row


class WanCameraControl(PipelineUnit):
    """The camera embedding (B, 24, latent frames, H, W) from the direction and speed: no model."""

    feature = "camera"
    inputs = ("camera_control_direction", "camera_control_speed", "camera_control_origin", "num_frames", "height",
              "width", "batch_size")
    outputs = ("control_camera_latents",)
    skip_without = ("camera_control_direction",)

    def process(self, pipe, camera_control_direction, camera_control_speed, camera_control_origin, num_frames,
                height, width, batch_size):
        n = int(batch_size or 1)
        out = []
        for direction, speed, origin in zip(_per_sample(camera_control_direction, n),
                                            _per_sample(camera_control_speed, n),
                                            _per_sample(camera_control_origin, n)):
            poses = camera_poses(direction, int(num_frames), _speed(speed), origin)
            out.append(pack_camera_latents(plucker_embedding(poses, int(height), int(width))))
        return {"control_camera_latents": torch.cat(out).to(pipe.device, pipe.torch_dtype)}


class WanCameraImageLatents(PipelineUnit):
    """The Wan2.1 camera DiTs' image condition, in place of the I2V one: the input image VAE-encoded alone as the
    first latent frame, zeros after it (B, 16, latent frames, h, w)."""

    feature = "camera_image"
    replaces = ("WanImageEmbedderVAE",)
    inputs = ("input_image", "num_frames", "height", "width", "batch_size")
    outputs = ("camera_image_latents",)
    models = ("vae",)

    def process(self, pipe, input_image, num_frames, height, width, batch_size):
        if input_image is None:
            raise UserError("camera control needs the first frame: --extra_inputs input_image")
        channels, spatial, temporal = vae_scales(pipe.vae)
        out = []
        for image in _per_sample(input_image, int(batch_size or 1)):
            first = vae_encode(pipe, video_tensor([image], height, width))
            rest = first.new_zeros(1, channels, latent_frames(num_frames, temporal) - 1, *first.shape[3:])
            out.append(torch.cat([first, rest], dim=2))
        return {"camera_image_latents": torch.cat(out).to(pipe.torch_dtype)}


def camera_dit_inputs(dit, latents: torch.Tensor, control_camera_latents: torch.Tensor,
                      camera_image_latents: torch.Tensor | None = None, condition: torch.Tensor | None = None):
    """model_fn's part: (the DiT's input: latents and the image condition on channels, the patch residual)."""
    adapter = getattr(dit, "control_adapter", None)
    if adapter is None:
        raise UserError("camera_control_direction was given but this Wan DiT has no camera control adapter "
                        "(a Fun-Control-Camera DiT has one)")
    extra = dit.config.in_channels - dit.config.out_channels
    image = camera_image_latents if extra == latents.shape[1] else condition
    if image is None or image.shape[1] != extra:
        raise UserError(f"this camera DiT takes a {extra}-channel image condition: give the first frame "
                        f"(--extra_inputs input_image)")
    x = torch.cat([latents, image.to(latents.dtype)], dim=1)
    return x, adapter(control_camera_latents.to(adapter.conv.weight.dtype))


class _Camera(Feature):
    def check(self, context, features):
        dit = context.config("dit")
        if dit is None:
            return
        if not dit.get("control_adapter_in_channels"):
            raise UserError("camera_control_direction: this Wan DiT has no camera control adapter (a "
                            "Fun-Control-Camera DiT has one)")
        if "i2v" not in features:
            raise UserError("camera control needs the first frame: --extra_inputs input_image")

    def denoise(self, pipe, call):
        """The image condition on the channels and the adapter's residual on the patch grid (a Fun-Control DiT's
        own channels come first)."""
        if call.channels_done:
            return
        dit, v = call.dit, call.values
        call.x, call.patch_residual = camera_dit_inputs(dit, call.x, v["control_camera_latents"],
                                                        v.get("camera_image_latents"), v.get("condition"))
        if dit.config.image_dim is not None and call.image_embeds is None:
            raise UserError("this camera DiT needs the CLIP image embedding of the first frame: load the image "
                            "encoder too")
        call.image_embeds = call.image_embeds if dit.config.image_dim is not None else None
        call.channels_done = True


CAMERA_INPUTS = ("camera_control_direction", "camera_control_speed", "camera_control_origin")
CAMERA = _Camera("camera", columns=("camera_control_direction",), data_inputs=CAMERA_INPUTS,
                 model_fn_inputs=("control_camera_latents",), units=(WanCameraControl(),),
                 inputs={name: VALUE for name in CAMERA_INPUTS}, call_inputs={name: None for name in CAMERA_INPUTS},
                 description="Fun-Control-Camera: a camera move as Plücker rays through the DiT's control adapter")
# The Wan2.1 camera DiTs take the input image's latents alone (16 channels) instead of the I2V condition (20)
CAMERA_IMAGE = Feature("camera_image", when=lambda c: c.has("camera_control_direction") and c.has("input_image")
                       and dit_extra_channels(c) == 16, model_fn_inputs=("camera_image_latents",),
                       data_inputs=("input_image",), units=(WanCameraImageLatents(),),
                       description="Wan2.1 Fun-Control-Camera: the first frame's latents as the image condition")

__all__ = ["DEFAULT_ORIGIN", "DEFAULT_SPEED", "WanCameraAdapter", "WanCameraControl", "WanCameraImageLatents",
           "camera_dit_inputs", "camera_poses", "pack_camera_latents", "plucker_embedding", "CAMERA", "CAMERA_IMAGE"]
