"""Wan2.2-Animate-14B: the released file recognised as the DiT and the animate adapter, the adapter's key
conversion (against diffusers' own converter), our loading + forward equal to diffusers' WanAnimateTransformer3DModel
built from the converted file, and the units equal to WanAnimatePipeline's preparation (fp32, tiny)."""

import pytest
import torch
from PIL import Image

from difftune.core.units import run_unit
from difftune.families.wan.animate import (ADAPTER_PREFIXES, ANIMATE_ADAPTER_ORIGINAL, ANIMATE_DIT_ORIGINAL,
                                           WanAnimateInpaint, WanAnimatePoseLatents, WanAnimateVideoSplit,
                                           animate_adapter_from_original, animate_adapter_to_original, face_pixels,
                                           i2v_mask)
from difftune.families.wan.components import DIT_ORIGINAL
from difftune.families.wan.dit_forward import wan_dit_forward
from difftune.families.wan.pipeline import WanVideoPipeline
from difftune.families.wan.testing.animate import (animate_file_state, tiny_animate_transformer,
                                                   write_tiny_animate_original)
from difftune.models.detect import detect_component, match_header
from difftune.models.load import load_component


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return write_tiny_animate_original(tmp_path_factory.mktemp("animate") / "Wan2.2-Animate-14B")


@pytest.fixture()
def known(repo, monkeypatch):
    for spec, label, config in repo[1]:
        monkeypatch.setitem(spec.known_configs, label, config)
    return repo[0]


def test_official_animate_file_is_recognised_as_the_dit_and_the_adapter():
    from accelerate import init_empty_weights
    from diffusers import WanAnimateTransformer3DModel

    with init_empty_weights():
        model = WanAnimateTransformer3DModel(added_kv_proj_dim=5120)  # Wan2.2-Animate-14B's sizes
    header = {k: tuple(v.shape) for k, v in animate_file_state(model).items()}
    assert header["face_adapter.fuser_blocks.7.linear1_kv.weight"] == (10240, 5120)
    assert header["motion_encoder.enc.net_app.convs.8.weight"] == (512, 512, 4, 4)
    assert header["motion_encoder.enc.net_app.convs.1.conv1.1.bias"] == (1, 32, 1, 1)  # 512 px level: 32 channels
    assert match_header(header, [DIT_ORIGINAL]) is None
    dit = match_header(header, [DIT_ORIGINAL, ANIMATE_DIT_ORIGINAL])
    adapter = match_header(header, [ANIMATE_ADAPTER_ORIGINAL])
    assert dit.spec is ANIMATE_DIT_ORIGINAL and dit.config["in_channels"] == 36 and dit.config["image_dim"] == 1280
    assert adapter.label == "Wan2.2-Animate-14B" and adapter.config["num_face_blocks"] == 8


def test_adapter_keys_match_diffusers_converter_and_invert():
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    model = tiny_animate_transformer(face_size=512)  # the released depth: seven residual levels
    original = animate_file_state(model)
    adapter = {k: v for k, v in original.items() if k.startswith(ADAPTER_PREFIXES)}
    ours = animate_adapter_from_original(adapter)
    theirs = {k: v for k, v in convert_wan_transformer_to_diffusers(dict(original)).items()
              if k.startswith(ADAPTER_PREFIXES)}
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    back = animate_adapter_to_original(ours)
    assert back.keys() == adapter.keys() and all(torch.equal(back[k], adapter[k]) for k in back)
    # fixed blur kernels, where a file has them, are dropped (diffusers computes them)
    with_kernel = {**adapter, "motion_encoder.enc.net_app.convs.1.conv2.0.kernel": torch.ones(4, 4)}
    assert animate_adapter_from_original(with_kernel).keys() == ours.keys()


def _faces(n, size, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(1, 3, n, size, size, generator=g) * 2 - 1


def test_loading_the_file_gives_diffusers_animate_transformer_outputs(known):
    from diffusers import WanAnimateTransformer3DModel
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
    from safetensors.torch import load_file

    path = str(known / "diffusion_pytorch_model.safetensors")
    det = detect_component(path, [DIT_ORIGINAL, ANIMATE_DIT_ORIGINAL])
    assert det.spec is ANIMATE_DIT_ORIGINAL and det.source == "weights match tiny"
    dit = load_component(path, [DIT_ORIGINAL, ANIMATE_DIT_ORIGINAL], torch_dtype=torch.float32).module
    adapter = load_component(path, [ANIMATE_ADAPTER_ORIGINAL], torch_dtype=torch.float32).module
    # diffusers' class from the converted file: diffusers' converter for the DiT, ours for the adapter (diffusers'
    # assumes 512 px faces; the two agree there, test_adapter_keys_match_diffusers_converter_and_invert)
    state = load_file(path)
    adapter_keys = {k for k in state if k.startswith(ADAPTER_PREFIXES)}
    converted = convert_wan_transformer_to_diffusers({k: v for k, v in state.items() if k not in adapter_keys})
    converted.update(animate_adapter_from_original({k: state[k] for k in adapter_keys}))
    ref = WanAnimateTransformer3DModel.from_config(tiny_animate_transformer().config).eval()
    ref.load_state_dict(converted, strict=True)
    g = torch.Generator().manual_seed(1)
    x, t = torch.randn(1, 36, 3, 4, 6, generator=g), torch.tensor([811.0])
    text, image = torch.randn(1, 7, 32, generator=g), torch.randn(1, 4, 32, generator=g)
    pose, faces = torch.randn(1, 16, 2, 4, 6, generator=g), _faces(5, 32, 2)
    with torch.no_grad():
        theirs = ref(x, t, text, image, pose_hidden_states=pose, face_pixel_values=faces, return_dict=False)[0]
        ours = wan_dit_forward(dit, x, t, text, image, patch_residual=adapter.pose_residual(pose),
                               block_hooks=[adapter.block_hook(adapter.motion_vectors(faces))])
        no_face = wan_dit_forward(dit, x, t, text, image, patch_residual=adapter.pose_residual(pose))
        other_face = wan_dit_forward(dit, x, t, text, image, patch_residual=adapter.pose_residual(pose),
                                     block_hooks=[adapter.block_hook(adapter.motion_vectors(
                                         torch.full_like(faces, -1.0)))])
    assert (ours - theirs).abs().max() <= 1e-5
    assert (ours - no_face).abs().max() > 1e-4 and (ours - other_face).abs().max() > 1e-4
    with pytest.raises(Exception, match="animate_face_video"), torch.no_grad():
        wan_dit_forward(dit, x, t, text, image,
                        block_hooks=[adapter.block_hook(adapter.motion_vectors(_faces(9, 32, 3)))])


def test_faces_not_at_the_encoder_size_are_resized():
    import torch.nn.functional as F

    from difftune.families.wan.animate import WanAnimateAdapter
    from difftune.families.wan.testing.animate import tiny_animate_configs

    model = tiny_animate_transformer()
    adapter = WanAnimateAdapter.from_config(tiny_animate_configs(model)[1]).eval()
    adapter.load_state_dict({k: v for k, v in model.state_dict().items() if k.startswith(ADAPTER_PREFIXES)})
    small = _faces(5, 64, 4)
    big = F.interpolate(small[0].transpose(0, 1), size=(32, 32), mode="bilinear", align_corners=False,
                        antialias=True).transpose(0, 1)[None]
    with torch.no_grad():
        assert torch.equal(adapter.motion_vectors(small), adapter.motion_vectors(big))
        motion = adapter.motion_vectors(big)
    assert motion.shape == (1, 3, 3, 16) and torch.equal(motion[:, 0], torch.zeros(1, 3, 16))


# -- units against WanAnimatePipeline ----------------------------------------------------------------------------
def _pipe():
    from diffusers import AutoencoderKLWan

    torch.manual_seed(4)
    pipe = WanVideoPipeline(torch_dtype=torch.float32)
    pipe.vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                temperal_downsample=[False, True, True]).eval()
    return pipe


def _clip(n, size, seed):
    g = torch.Generator().manual_seed(seed)
    return [Image.fromarray((torch.rand(size[1], size[0], 3, generator=g) * 255).byte().numpy()) for _ in range(n)]


def _diffusers_pipe(vae):
    from diffusers import FlowMatchEulerDiscreteScheduler, WanAnimatePipeline

    return WanAnimatePipeline(tokenizer=None, text_encoder=None, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(),
                              image_processor=None, image_encoder=None, transformer=tiny_animate_transformer())


def test_split_pose_and_face_units():
    pipe = _pipe()
    clip, pose, face = _clip(9, (48, 32), 1), _clip(9, (48, 32), 2), _clip(9, (24, 24), 3)
    values = {"input_video": clip, "animate_pose_video": pose, "animate_face_video": face,
              "animate_inpaint_video": None, "animate_mask_video": None, "height": 32, "width": 48, "batch_size": 1}
    for unit in (WanAnimateVideoSplit(), WanAnimatePoseLatents()):
        run_unit(pipe, unit, values)
    assert values["animate_pose_video"] == pose[:5] and values["animate_face_video"] == face[:5]
    theirs = _diffusers_pipe(pipe.vae)
    with torch.no_grad():
        expected = theirs.prepare_pose_latents(theirs.video_processor.preprocess_video(pose[:5], height=32, width=48))
    assert values["pose_latents"].shape == (1, 16, 2, 4, 6)
    assert (values["pose_latents"] - expected).abs().max() <= 1e-5
    faces = theirs.video_processor.preprocess_video(face[:5], height=24, width=24)
    assert (face_pixels(values["animate_face_video"], 1, "cpu", torch.float32) - faces).abs().max() <= 1e-6
    # the unguided side's face video is black: -1 everywhere, as diffusers' and the reference's
    black = [Image.new("RGB", f.size) for f in face[:5]]
    assert torch.equal(face_pixels(black, 1, "cpu", torch.float32), torch.full_like(faces, -1.0))


def _mask_clip(n, size):
    frames = []
    for i in range(n):
        m = Image.new("RGB", size, (0, 0, 0))
        m.paste((255, 255, 255), (8 * i % size[0], 0, 8 * i % size[0] + 16, 16))
        frames.append(m)
    return frames


def test_replacement_condition_equals_diffusers():
    pipe = _pipe()
    image, background, mask = _clip(1, (48, 32), 5)[0], _clip(5, (48, 32), 6), _mask_clip(5, (48, 32))
    values = run_unit(pipe, WanAnimateInpaint(), {"animate_inpaint_video": background, "animate_mask_video": mask,
                                                  "input_image": image, "height": 32, "width": 48, "batch_size": 1})
    theirs = _diffusers_pipe(pipe.vae)
    with torch.no_grad():
        ref = theirs.prepare_reference_image_latents(
            theirs.vae_image_processor.preprocess(image, height=32, width=48).float(), 1, device="cpu")
        seg = theirs.prepare_prev_segment_cond_latents(
            None, background_video=theirs.video_processor.preprocess_video(background, height=32, width=48),
            mask_video=theirs.video_processor_for_mask.preprocess_video(mask, height=32, width=48), batch_size=1,
            segment_frame_length=5, start_frame=0, height=32, width=48, prev_segment_cond_frames=1, task="replace",
            dtype=torch.float32, device="cpu")
    expected = torch.cat([ref, seg], dim=2)
    assert values["condition"].shape == expected.shape == (1, 20, 3, 4, 6)
    assert (values["condition"] - expected).abs().max() <= 1e-5
    assert torch.equal(i2v_mask(2, 4, 6, 1)[:, 0], torch.ones(4, 4, 6))


def test_face_motion_unit_and_what_the_split_caches():
    from difftune.core.graph import split_units
    from difftune.families.wan.animate import WanAnimateAdapter, WanAnimateFaceMotion
    from difftune.families.wan.testing.animate import tiny_animate_configs

    model = tiny_animate_transformer()
    adapter = WanAnimateAdapter.from_config(tiny_animate_configs(model)[1]).eval()
    pipe = WanVideoPipeline(torch_dtype=torch.float32)
    pipe.animate_adapter = adapter
    assert pipe.models["animate_adapter"] is adapter
    faces = _faces(5, 32, 7)
    frames = [Image.fromarray(((f.permute(1, 2, 0) + 1) * 127.5).round().clamp(0, 255).byte().numpy())
              for f in faces[0].unbind(1)]
    with torch.no_grad():
        motion = run_unit(pipe, WanAnimateFaceMotion(), {"animate_face_video": frames, "batch_size": 1})
        assert torch.equal(motion["face_motion"],
                           adapter.motion_vectors(face_pixels(frames, 1, "cpu", torch.float32)))
    units = [WanAnimateVideoSplit(), WanAnimatePoseLatents(), WanAnimateFaceMotion()]
    reads = ("input_latents", "pose_latents", "face_motion")
    # a LoRA on the DiT: the adapter is frozen, its face tokens are cached (not the face frames)
    lora = split_units(units, ["dit"], reads, loss_models=("dit", "animate_adapter"))
    assert not lora.stage2 and "face_motion" in lora.frontier and "animate_face_video" not in lora.frontier
    # the adapter trained: only the face-token unit moves to stage 2, which reads the cached (cut) face frames
    full = split_units(units, ["animate_adapter"], reads, loss_models=("dit", "animate_adapter"))
    assert [u.name for u in full.stage2] == ["WanAnimateFaceMotion"]
    assert {"animate_face_video", "pose_latents"} <= set(full.frontier) and "face_motion" not in full.frontier
    assert "vae" not in full.stage2_models
