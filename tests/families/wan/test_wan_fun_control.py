"""Fun-Control and Fun-Control-Camera: PAI's DiT files recognised from their headers (ref_conv, control_adapter,
the channel counts), the reference image's tokens, the camera adapter and the Plücker embedding against
step-by-step rewrites of the reference's formulas, and the units' values (a non-finite or singular camera value is
one line)."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from difftune.core.units import run_unit
from difftune.errors import UserError
from difftune.families.wan.camera import (WanCameraControl, WanCameraImageLatents, camera_dit_inputs, camera_poses,
                                          pack_camera_latents, plucker_embedding)
from difftune.families.wan.components import DIT_ORIGINAL, WAN_DIT_CONFIGS
from difftune.families.wan.dit_forward import wan_dit_forward
from difftune.families.wan.dit_keys import dit_to_original
from difftune.families.wan.fun_control import (FUN_DIT_CONFIGS, FUN_DIT_ORIGINAL, WanFunControlEmbedder,
                                               WanFunReferenceEmbedder, fun_control_dit_inputs, reference_tokens)
from difftune.families.wan.pipeline import WanVideoPipeline
from support.wan.fun_control import tiny_fun_transformer, write_tiny_fun_original
from difftune.families.wan.units import WanImageEmbedderCLIP, vae_encode, video_tensor
from difftune.models.detect import detect_component, match_header
from difftune.models.load import load_component


@pytest.mark.parametrize("label", sorted(FUN_DIT_CONFIGS))
def test_official_fun_headers_are_recognised(label):
    header = dit_to_original(FUN_DIT_ORIGINAL.signature(FUN_DIT_CONFIGS[label]))
    config = FUN_DIT_CONFIGS[label]
    assert ("ref_conv.weight" in header) == bool(config["ref_conv_channels"])
    assert ("control_adapter.residual_blocks.0.conv2.weight" in header) == bool(config["control_adapter_in_channels"])
    if config["control_adapter_in_channels"]:
        assert header["control_adapter.conv.weight"][1:] == (24 * 64, 2, 2)
    assert match_header(header, [DIT_ORIGINAL]) is None  # the plain DiT spec does not take them
    match = match_header(header, [DIT_ORIGINAL, FUN_DIT_ORIGINAL])
    assert match.spec is FUN_DIT_ORIGINAL and match.label == label


def test_plain_wan_headers_are_not_taken_for_fun_ones():
    for label in ("Wan2.1-T2V-1.3B", "Wan2.1-I2V-14B", "Wan2.2-I2V-A14B expert", "Wan2.1-Fun-1.3B-InP"):
        header = dit_to_original(DIT_ORIGINAL.signature(WAN_DIT_CONFIGS[label]))
        assert match_header(header, [FUN_DIT_ORIGINAL]) is None


@pytest.mark.parametrize("variant", ["control_v11", "camera_a14b"])
def test_tiny_fun_files_load_with_their_tensors(tmp_path, monkeypatch, variant):
    root, known = write_tiny_fun_original(tmp_path / "repo", variant)
    for spec, label, config in known:
        monkeypatch.setitem(spec.known_configs, label, config)
    folder = root if variant == "control_v11" else root / "high_noise_model"
    path = str(folder / "diffusion_pytorch_model.safetensors")
    det = detect_component(path, [DIT_ORIGINAL, FUN_DIT_ORIGINAL])
    assert det.spec is FUN_DIT_ORIGINAL and det.source == "weights match tiny"
    loaded = load_component(path, [DIT_ORIGINAL, FUN_DIT_ORIGINAL], torch_dtype=torch.float32).module
    expected = tiny_fun_transformer(variant, seed=30).state_dict()
    assert loaded.state_dict().keys() == expected.keys()
    assert all(torch.equal(loaded.state_dict()[k], expected[k]) for k in expected)


def test_reference_tokens_are_a_leading_frame_of_the_dit():
    """ref_conv's tokens sit where a frame's patch tokens would: RoPE frame 0, dropped by the head. With the
    patch embedding of a frame as the prefix, the result is the DiT on that frame and the clip, minus frame 0."""
    dit = tiny_fun_transformer("control_v11")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 48, 3, 4, 6, generator=g)
    t, text, image = torch.tensor([500.0]), torch.randn(1, 5, 32, generator=g), torch.randn(1, 4, 32, generator=g)
    with torch.no_grad():
        prefix = dit.patch_embedding(x[:, :, :1]).flatten(2).transpose(1, 2)
        ours = wan_dit_forward(dit, x[:, :, 1:], t, text, image, prefix_tokens=prefix)
        whole = dit(x, t, text, image, return_dict=False)[0][:, :, 1:]
    assert (ours - whole).abs().max() <= 1e-5
    # ref_conv itself: a 2 x 2 stride-2 convolution of the first latent frame (the reference's formula)
    z = torch.randn(1, 16, 1, 4, 6, generator=g)
    w, b = dit.ref_conv.weight, dit.ref_conv.bias
    manual = torch.stack([torch.stack([(z[0, :, 0, 2 * r:2 * r + 2, 2 * c:2 * c + 2][None] * w).sum((1, 2, 3)) + b
                                       for c in range(3)]) for r in range(2)]).reshape(6, -1)[None]
    with torch.no_grad():
        assert (reference_tokens(dit, z) - manual).abs().max() <= 1e-5


def test_camera_adapter_is_the_reference_formula():
    dit = tiny_fun_transformer("camera")
    adapter = dit.control_adapter
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 24, 2, 32, 48, generator=g)
    b, c, f, h, w = x.shape
    # pixel unshuffle by 8: channel c * 64 + 8 * dy + dx takes pixel (8y + dy, 8x + dx)
    frames = x.permute(0, 2, 1, 3, 4).reshape(b * f, c, h // 8, 8, w // 8, 8)
    frames = frames.permute(0, 1, 3, 5, 2, 4).reshape(b * f, c * 64, h // 8, w // 8)
    y = F.conv2d(frames, adapter.conv.weight, adapter.conv.bias, stride=2)
    block = adapter.residual_blocks[0]
    y = y + F.conv2d(F.relu(F.conv2d(y, block.conv1.weight, block.conv1.bias, padding=1)), block.conv2.weight,
                     block.conv2.bias, padding=1)
    manual = y.reshape(b, f, *y.shape[1:]).permute(0, 2, 1, 3, 4)
    with torch.no_grad():
        assert (adapter(x) - manual).abs().max() <= 1e-5


def _plucker_by_pixel(poses, height, width):
    """The reference's rays, one pixel at a time: intrinsics for 1280 x 720 rescaled to the sample, the ray
    through the pixel centre in camera coordinates, rotated into the first camera's frame."""
    out = np.zeros((len(poses), height, width, 6))
    w2c0 = np.vstack([np.asarray(poses[0][7:19]).reshape(3, 4), [0, 0, 0, 1]])
    for n, p in enumerate(poses):
        fx, fy, cx, cy = p[1:5]
        if 1280 / 720 > width / height:
            fx = height * 1280 / 720 * fx / width
        else:
            fy = width / (1280 / 720) * fy / height
        fx, fy, cx, cy = fx * width, fy * height, cx * width, cy * height
        c2w = np.linalg.inv(np.vstack([np.asarray(p[7:19]).reshape(3, 4), [0, 0, 0, 1]]))
        rel = np.eye(4) if n == 0 else w2c0 @ c2w
        for y in range(height):
            for x in range(width):
                d = np.array([(x + 0.5 - cx) / fx, (y + 0.5 - cy) / fy, 1.0])
                d = rel[:3, :3] @ (d / np.linalg.norm(d))
                out[n, y, x] = np.concatenate([np.cross(rel[:3, 3], d), d])
    return out


@pytest.mark.parametrize("direction, size", [("LeftUp", (8, 12)), ("In", (12, 8)), ("RightDown", (8, 8))])
def test_plucker_embedding_is_the_reference_formula(direction, size):
    height, width = size
    poses = camera_poses(direction, 5, speed=0.05)
    assert poses[0][9] == 0 and poses[1][9] == pytest.approx(0.05 * (("Left" in direction) - ("Right" in direction)))
    ours = plucker_embedding(poses, height, width)
    assert ours.shape == (5, height, width, 6)
    assert np.abs(ours.numpy() - _plucker_by_pixel(poses, height, width)).max() < 1e-5


def test_camera_latents_pack_four_frames_per_latent_frame():
    plucker = torch.randn(9, 4, 6, 6)
    packed = pack_camera_latents(plucker)
    assert packed.shape == (1, 24, 3, 4, 6)
    padded = [0, 0, 0, 0] + list(range(1, 9))  # the first frame stands for a whole group
    for t in range(3):
        for c in range(6):
            for k in range(4):
                assert torch.equal(packed[0, 4 * c + k, t], plucker[padded[4 * t + k], :, :, c])
    with pytest.raises(Exception, match="camera_control_direction"):
        camera_poses("Sideways", 3)


# -- units and model_fn parts ----------------------------------------------------------------------------------
def _pipe(clip=False):
    from diffusers import AutoencoderKLWan
    from transformers import CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(4)
    pipe = WanVideoPipeline(torch_dtype=torch.float32)
    pipe.vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                temperal_downsample=[False, True, True]).eval()
    if clip:
        pipe.image_encoder = CLIPVisionModel(CLIPVisionConfig(hidden_size=32, intermediate_size=37,
                                                              num_hidden_layers=2, num_attention_heads=2,
                                                              image_size=32, patch_size=8)).eval()
    return pipe


def _images(n, seed, size=(48, 32)):
    g = torch.Generator().manual_seed(seed)
    return [Image.fromarray((torch.rand(size[1], size[0], 3, generator=g) * 255).byte().numpy()) for _ in range(n)]


def test_control_and_reference_units():
    pipe = _pipe(clip=True)
    control, ref = _images(5, 1), _images(1, 2)[0]
    values = {"control_video": control, "reference_image": ref, "height": 32, "width": 48, "batch_size": 1}
    run_unit(pipe, WanFunControlEmbedder(), values)
    run_unit(pipe, WanFunReferenceEmbedder(), values)
    with torch.no_grad():
        assert torch.equal(values["control_latents"], vae_encode(pipe, video_tensor(control, 32, 48)))
        assert torch.equal(values["reference_latents"], vae_encode(pipe, video_tensor([ref], 32, 48)))
        clip = run_unit(pipe, WanImageEmbedderCLIP(), {"input_image": ref, "end_image": None, "height": 32,
                                                       "width": 48, "batch_size": 1})["image_embeds"]
    assert torch.equal(values["reference_image_embeds"], clip)
    # without a CLIP encoder (Wan2.2-Fun-A14B-Control): the latents only
    values = run_unit(_pipe(), WanFunReferenceEmbedder(), {"reference_image": ref, "height": 32, "width": 48,
                                                           "batch_size": 1})
    assert "reference_image_embeds" not in values and values["reference_latents"].shape == (1, 16, 1, 4, 6)


def test_fun_control_channels_follow_the_reference():
    g = torch.Generator().manual_seed(0)
    latents, control = torch.randn(1, 16, 2, 4, 6, generator=g), torch.randn(1, 16, 2, 4, 6, generator=g)
    condition, embeds = torch.randn(1, 20, 2, 4, 6, generator=g), torch.randn(1, 4, 32, generator=g)
    ref_embeds = torch.randn(1, 4, 32, generator=g)
    v21 = tiny_fun_transformer("control")  # 48 channels, CLIP
    x, e = fun_control_dit_inputs(v21, latents, control, condition, embeds)
    assert torch.equal(x, torch.cat([latents, control, condition[:, 4:]], dim=1)) and e is embeds
    x, e = fun_control_dit_inputs(v21, latents, control)  # no input image: zeros, and a zero CLIP embedding
    assert torch.equal(x[:, 32:], torch.zeros(1, 16, 2, 4, 6)) and torch.equal(e, torch.zeros(1, 257, 32))
    x, e = fun_control_dit_inputs(v21, latents, control, None, None, ref_embeds)
    assert e is ref_embeds  # the reference image's CLIP embedding stands in
    a14b = tiny_fun_transformer("control_a14b")  # 52 channels: the whole I2V condition, no CLIP
    x, e = fun_control_dit_inputs(a14b, latents, control, condition, None, ref_embeds)
    assert torch.equal(x, torch.cat([latents, control, condition], dim=1)) and e is None
    with torch.no_grad():
        out = wan_dit_forward(a14b, x, torch.tensor([300.0]), torch.randn(1, 5, 32, generator=g),
                              prefix_tokens=reference_tokens(a14b, torch.randn(1, 16, 1, 4, 6, generator=g)))
    assert out.shape == (1, 16, 2, 4, 6)


def test_camera_units_and_inputs():
    pipe = _pipe()
    image = _images(1, 3)[0]
    values = {"camera_control_direction": "Left", "camera_control_speed": "0.02", "camera_control_origin": None,
              "input_image": image, "num_frames": 5, "height": 32, "width": 48, "batch_size": 1}
    run_unit(pipe, WanCameraControl(), values)
    run_unit(pipe, WanCameraImageLatents(), values)
    expected = pack_camera_latents(plucker_embedding(camera_poses("Left", 5, 0.02), 32, 48))
    assert torch.equal(values["control_camera_latents"], expected) and expected.shape == (1, 24, 2, 32, 48)
    image_latents = values["camera_image_latents"]
    with torch.no_grad():
        assert torch.equal(image_latents[:, :, :1], vae_encode(pipe, video_tensor([image], 32, 48)))
    assert torch.equal(image_latents[:, :, 1:], torch.zeros(1, 16, 1, 4, 6))

    g = torch.Generator().manual_seed(5)
    latents, condition = torch.randn(1, 16, 2, 4, 6, generator=g), torch.randn(1, 20, 2, 4, 6, generator=g)
    camera = values["control_camera_latents"]
    v21, a14b = tiny_fun_transformer("camera"), tiny_fun_transformer("camera_a14b")
    with torch.no_grad():
        x, residual = camera_dit_inputs(v21, latents, camera, image_latents, condition)
        assert torch.equal(x, torch.cat([latents, image_latents], dim=1))
        assert torch.equal(residual, v21.control_adapter(camera)) and residual.shape == (1, 16, 2, 2, 3)
        x, _ = camera_dit_inputs(a14b, latents, camera, image_latents, condition)
        assert torch.equal(x, torch.cat([latents, condition], dim=1))
        t, text = torch.tensor([700.0]), torch.randn(1, 5, 32, generator=g)
        moved = wan_dit_forward(a14b, x, t, text, patch_residual=camera_dit_inputs(a14b, latents, camera, None,
                                                                                   condition)[1])
        still = wan_dit_forward(a14b, x, t, text)
    assert (moved - still).abs().max() > 1e-4
    with pytest.raises(Exception, match="control adapter"):
        camera_dit_inputs(tiny_fun_transformer("control"), latents, camera, image_latents)
    assert math.isclose(camera_poses("Up", 2, speed=0.1)[1][13], 0.1)


def test_camera_origin_from_a_metadata_cell():
    """camera_control_origin as a CSV cell gives (a list in text, numbers apart) the same poses as the list; an empty
    cell is the default origin; anything else is one line naming the column and the 19 numbers it takes."""
    from difftune.errors import UserError
    from difftune.families.wan.camera import DEFAULT_ORIGIN, DEFAULT_SPEED, _speed

    shifted = [*DEFAULT_ORIGIN[:9], 0.25, *DEFAULT_ORIGIN[10:]]
    expected = camera_poses("Up", 5, 0.02, shifted)
    assert expected[0][9] == 0.25 and expected[4][13] == pytest.approx(4 * 0.02)
    for cell in (str(shifted), " ".join(map(str, shifted)), ",".join(map(str, shifted)), tuple(shifted)):
        assert camera_poses("Up", 5, 0.02, cell) == expected
    assert camera_poses("Up", 5, 0.02, float("nan")) == camera_poses("Up", 5, 0.02)
    assert _speed(float("nan")) == DEFAULT_SPEED  # an empty speed cell: the default speed
    for bad in ("0 0.5 0.9", "left", [1, 2]):
        with pytest.raises(UserError, match=r"camera_control_origin .*expected 19 numbers"):
            camera_poses("Up", 5, 0.02, bad)


class _Pipe:
    device, torch_dtype = "cpu", None


def _camera(speed="0.02", origin=None):
    pipe = _Pipe()
    pipe.torch_dtype = torch.float32
    return WanCameraControl().process(pipe, "Left", speed, origin, 5, 16, 16, 1)


@pytest.mark.parametrize("speed", ["inf", "nan", "-Infinity", float("-inf"), "1e400", 1e400])
def test_non_finite_camera_speed_names_the_column(speed):
    with pytest.raises(UserError, match=r"^camera_control_speed .*: expected a finite number"):
        _camera(speed)
    assert torch.isfinite(_camera("0.02")["control_camera_latents"]).all()
    assert torch.isfinite(_camera(None)["control_camera_latents"]).all()  # no value: the default speed
    assert torch.isfinite(_camera(float("nan"))["control_camera_latents"]).all()  # an empty cell, as read


def test_singular_or_non_finite_camera_origin_is_one_line():
    """A pose whose 3 x 4 world-to-camera matrix cannot be inverted raised numpy's LinAlgError."""
    singular = "0 0.53 0.94 0.5 0.5 0 0 " + " ".join(["0"] * 12)
    with pytest.raises(UserError) as err:
        _camera(origin=singular)
    msg = str(err.value)
    assert msg.startswith("camera_control_origin") and "not invertible" in msg and "\n" not in msg
    with pytest.raises(UserError, match=r"^camera_control_origin .*: expected 19 numbers, all finite"):
        _camera(origin="0 0.53 0.94 0.5 0.5 0 0 1 0 0 nan 0 1 0 0 0 0 1 0")
