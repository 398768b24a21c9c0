"""Wan2.2-Animate-14B: the released file recognised as the DiT and the animate adapter, the adapter's key
conversion (against diffusers' own converter), our loading + forward equal to diffusers' WanAnimateTransformer3DModel
built from the converted file, the units equal to WanAnimatePipeline's preparation, and the whole sampling loop
equal to WanAnimatePipeline's (fp32, tiny)."""

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
from support.wan.animate import (animate_file_state, tiny_animate_transformer,
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
    from support.wan.animate import tiny_animate_configs

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
    from support.wan.animate import tiny_animate_configs

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


# -- the whole sampling loop against WanAnimatePipeline ----------------------------------------------------------
@pytest.fixture(scope="module")
def sampling_pipes(tmp_path_factory):
    """Ours (the tiny I2V 14B repository with the tiny Animate DiT and adapter) and diffusers' WanAnimatePipeline on
    the same weights: the same UMT5, VAE, CLIP, scheduler config and WanAnimateTransformer3DModel."""
    import diffusers.pipelines.wan.pipeline_wan as t2v_module
    import diffusers.pipelines.wan.pipeline_wan_animate as animate_module
    import diffusers.pipelines.wan.pipeline_wan_i2v as i2v_module
    from diffusers import WanAnimatePipeline, WanImageToVideoPipeline, WanTransformer3DModel

    from difftune.families.wan.animate import WanAnimateAdapter
    from support.wan.animate import tiny_animate_configs
    from difftune.models import ModelConfig
    from support import tiny_wan_paths, write_tiny_wan

    root = write_tiny_wan(tmp_path_factory.mktemp("animate_sampling") / "i2v", "i2v")
    # diffusers 0.42's I2V and Animate modules call ftfy without checking it is installed
    i2v_module.basic_clean = animate_module.basic_clean = t2v_module.basic_clean
    ours = WanVideoPipeline.from_pretrained(
        torch_dtype=torch.float32, model_configs=[ModelConfig(p[0]) for p in tiny_wan_paths(root).values()],
        tokenizer_config=ModelConfig(str(root / "tokenizer")),
        image_processor_config=ModelConfig(str(root / "image_processor")))
    ref = tiny_animate_transformer(seed=1)
    dit_config, adapter_config = tiny_animate_configs(ref)
    state = ref.state_dict()
    dit = WanTransformer3DModel(**{k: v for k, v in dit_config.items() if not k.startswith("_")}).eval()
    dit.load_state_dict({k: v for k, v in state.items() if not k.startswith(ADAPTER_PREFIXES)})
    adapter = WanAnimateAdapter.from_config(adapter_config).eval()
    adapter.load_state_dict({k: v for k, v in state.items() if k.startswith(ADAPTER_PREFIXES)})
    ours.dit, ours.animate_adapter = dit, adapter
    base = WanImageToVideoPipeline.from_pretrained(str(root), torch_dtype=torch.float32)
    theirs = WanAnimatePipeline(tokenizer=base.tokenizer, text_encoder=base.text_encoder, vae=base.vae,
                                scheduler=base.scheduler, image_processor=base.image_processor,
                                image_encoder=base.image_encoder, transformer=ref)
    theirs.set_progress_bar_config(disable=True)
    return ours, theirs


def _standardized(pipe, latents):
    """diffusers' WanAnimatePipeline returns its latents for output_type="latent" destandardized (as its VAE
    decodes them): back to the sampler's space."""
    mean = torch.tensor(pipe.vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(pipe.vae.config.latents_std).view(1, -1, 1, 1, 1)
    return (latents - mean) / std


def _reference_condition(theirs, image, num_frames, height, width):
    """The reference's animate-mode condition (its I2V unit: the character image then num_frames - 1 zero frames,
    VAE-encoded as one clip, mask 1 on the first frame), in diffusers' terms."""
    pixels = theirs.vae_image_processor.preprocess(image, height=height, width=width).unsqueeze(2)
    clip = torch.cat([pixels, torch.zeros(1, 3, num_frames - 1, height, width)], dim=2)
    return _standardized(theirs, theirs.vae.encode(clip).latent_dist.mode())


def _sampling_inputs(mode):
    image, pose, face = _clip(1, (48, 32), 5)[0], _clip(5, (48, 32), 2), _clip(5, (32, 32), 3)
    ours = dict(input_image=image, animate_pose_video=pose, animate_face_video=face)
    theirs = dict(image=image, pose_video=pose, face_video=face, mode=mode)
    if mode == "replace":
        background, mask = _clip(5, (48, 32), 6), _mask_clip(5, (48, 32))
        ours.update(animate_inpaint_video=background, animate_mask_video=mask)
        theirs.update(background_video=background, mask_video=mask)
    return ours, theirs


@pytest.mark.parametrize("mode, cfg", [("replace", 1.0), ("replace", 5.0), ("animate", 5.0)])
@torch.no_grad()
def test_sampling_equals_diffusers_wan_animate_pipeline(sampling_pipes, monkeypatch, mode, cfg):
    """The whole sampling loop (character image with its CLIP embedding, pose latents, face tokens, the black face
    on the unguided side, the replacement condition) == diffusers' WanAnimatePipeline (fp32, tiny, latents, same
    noise). One segment: our 9-frame clip is their segment_frame_length 5 (the pose frames) behind the character's
    latent frame, which both drop after sampling.

    Animate mode differs by design: the reference (DiffSynth-Studio) conditions on its I2V unit's latents (the
    character image then zero frames, one VAE clip), diffusers (after Wan-AI's code) on the image's latents then a
    separately encoded all-zero segment. The first latent frame agrees (the VAE is causal), the rest do not; in
    animate mode diffusers is handed the reference's condition, and everything else is compared."""
    from difftune.families.wan.animate import i2v_mask

    ours, theirs = sampling_pipes
    our_inputs, their_inputs = _sampling_inputs(mode)
    if mode == "animate":
        own = theirs.prepare_prev_segment_cond_latents
        reference = torch.cat([i2v_mask(3, 4, 6, 1)[None], _reference_condition(theirs, our_inputs["input_image"],
                                                                                  9, 32, 48)], dim=1)
        gaps = []

        def prepare_prev_segment_cond_latents(*args, **kwargs):
            diffusers_own = own(*args, **kwargs)
            gaps.append((diffusers_own - reference[:, :, 1:]).abs().max().item())
            return reference[:, :, 1:]

        monkeypatch.setattr(theirs, "prepare_prev_segment_cond_latents", prepare_prev_segment_cond_latents)
    a = ours("a dancer", negative_prompt="blurry", height=32, width=48, num_frames=9, num_inference_steps=3,
             cfg_scale=cfg, seed=3, progress=False, output_type="latent", **our_inputs)
    b = theirs(prompt="a dancer", negative_prompt="blurry", height=32, width=48, segment_frame_length=5,
               num_inference_steps=3, guidance_scale=cfg, generator=torch.Generator("cpu").manual_seed(3),
               output_type="latent", **their_inputs).frames
    assert a.shape == (1, 16, 2, 4, 6) and b.shape == (1, 16, 3, 4, 6)  # the character's frame dropped
    diff = (a - _standardized(theirs, b)[:, :, 1:]).abs().max().item()
    print(f"wan Animate {mode} (cfg {cfg}) vs WanAnimatePipeline: latents max difference {diff:.2e}")
    assert diff <= 1e-5
    if mode == "replace" and cfg == 1.0:  # decoded: the pose video's 5 frames, as diffusers decodes them
        import numpy as np

        frames = theirs.video_processor.postprocess_video(theirs.vae.decode(b[:, :, 1:]).sample, output_type="np")
        mine = ours.postprocess(a)[0]
        assert len(mine) == frames.shape[1] == 5
        pixels = np.abs(np.round(frames[0] * 255).astype(int) - np.stack([np.asarray(f) for f in mine])).max()
        assert pixels <= 1
    if mode == "animate":
        print(f"diffusers' own animate condition vs the reference's: max difference {gaps[0]:.2e}")
        assert gaps[0] > 1e-3
