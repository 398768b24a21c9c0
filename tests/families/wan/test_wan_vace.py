"""VACE: the released file recognised as two models (the DiT and the VACE branch), its key conversion, and our
loading + forward equal to diffusers' WanVACETransformer3DModel built from the converted file; the VACE context
unit equal to WanVACEPipeline's prepare_video_latents / prepare_masks (fp32, tiny)."""

import pytest
import torch
from PIL import Image

from difftune.core.units import run_unit
from difftune.families.wan.components import DIT_ORIGINAL, _dit_from_original
from difftune.families.wan.dit_forward import wan_dit_forward
from difftune.families.wan.pipeline import WanVideoPipeline
from support.wan.vace import (tiny_vace_transformer, vace_file_state, write_tiny_vace_original)
from difftune.families.wan.vace import (VACE_DIT_ORIGINAL, VACE_ORIGINAL, WanVaceEmbedder, WanVaceInputVideoEmbedder,
                                        WanVaceNoiseInitializer, vace_from_original, vace_to_original)
from difftune.models.detect import match_header
from difftune.models.load import load_component


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return write_tiny_vace_original(tmp_path_factory.mktemp("vace") / "Wan2.1-VACE-1.3B", "1.3b")


@pytest.fixture()
def known(repo, monkeypatch):
    for spec, label, config in repo[1]:
        monkeypatch.setitem(spec.known_configs, label, config)
    return repo[0]


def _official_header(size):
    """A full-size released VACE file's {key: shape} (Wan's names), from diffusers' class at that size."""
    from accelerate import init_empty_weights
    from diffusers import WanVACETransformer3DModel

    from difftune.families.wan.vace import VACE_CONFIGS, VACE_DIT_CONFIGS

    dit = next(c for k, c in VACE_DIT_CONFIGS.items() if size in k)
    vace = next(c for k, c in VACE_CONFIGS.items() if size in k)
    kwargs = {k: v for k, v in dit.items() if not k.startswith("_")}
    with init_empty_weights():
        model = WanVACETransformer3DModel(**kwargs, vace_layers=vace["vace_layers"], vace_in_channels=96)
    return {k: tuple(v.shape) for k, v in vace_file_state(model).items()}


@pytest.mark.parametrize("size, blocks", [("1.3B", 15), ("14B", 8)])
def test_official_vace_files_are_recognised_as_the_dit_and_the_vace_branch(size, blocks):
    header = _official_header(size)
    assert f"vace_blocks.{blocks - 1}.after_proj.weight" in header and "vace_blocks.0.before_proj.weight" in header
    assert "vace_blocks.1.before_proj.weight" not in header
    assert match_header(header, [DIT_ORIGINAL]) is None  # the plain DiT spec does not take a VACE file
    dit = match_header(header, [DIT_ORIGINAL, VACE_DIT_ORIGINAL])
    vace = match_header(header, [VACE_ORIGINAL])
    assert dit.spec is VACE_DIT_ORIGINAL and size in dit.label and dit.config["in_channels"] == 16
    assert vace.spec is VACE_ORIGINAL and size in vace.label and len(vace.config["vace_layers"]) == blocks
    # neither VACE spec takes a plain T2V file
    plain = {k: s for k, s in header.items() if not k.startswith("vace_")}
    assert match_header(plain, [VACE_DIT_ORIGINAL, VACE_ORIGINAL]) is None


def test_vace_keys_convert_to_diffusers_names_and_back():
    state = vace_file_state(tiny_vace_transformer())
    assert "vace_blocks.0.self_attn.q.weight" in state and "vace_blocks.1.after_proj.bias" in state
    assert "vace_blocks.0.norm3.weight" in state and "vace_blocks.0.modulation" in state  # Wan's names
    branch = vace_from_original(state)
    assert "vace_blocks.0.attn1.to_q.weight" in branch and "vace_blocks.0.proj_in.weight" in branch
    assert not any(k.startswith("blocks.") for k in branch)
    back = vace_to_original(branch)
    assert back.keys() == {k for k in state if k.startswith("vace_")}
    assert all(torch.equal(back[k], state[k]) for k in back)


def test_tiny_repo_files_are_recognised_from_their_headers(known):
    from difftune.models.detect import detect_component

    path = str(known / "diffusion_pytorch_model.safetensors")
    dit = detect_component(path, [DIT_ORIGINAL, VACE_DIT_ORIGINAL])
    vace = detect_component(path, [VACE_ORIGINAL])
    assert (dit.name, dit.spec, vace.name, vace.spec) == ("dit", VACE_DIT_ORIGINAL, "vace", VACE_ORIGINAL)
    assert dit.source == vace.source == "weights match tiny"  # Wan's config.json (VaceWanModel) passed over


def _inputs(model, frames=3, refs=0, seed=1):
    g = torch.Generator().manual_seed(seed)
    c = model.config
    x = torch.randn(1, 16, frames + refs, 4, 6, generator=g)
    context = torch.randn(1, 96, frames + refs, 4, 6, generator=g)
    text = torch.randn(1, 7, c.text_dim, generator=g)
    return x, torch.tensor([637.0]), text, context


def test_loading_the_file_gives_diffusers_vace_transformer_outputs(known):
    from diffusers import WanVACETransformer3DModel
    from safetensors.torch import load_file

    path = str(known / "diffusion_pytorch_model.safetensors")
    dit = load_component(path, [DIT_ORIGINAL, VACE_DIT_ORIGINAL], torch_dtype=torch.float32).module
    vace = load_component(path, [VACE_ORIGINAL], torch_dtype=torch.float32).module
    # diffusers' class from the converted file (its own single-file converter's names)
    state = _dit_from_original(load_file(path))
    full_config = {**{k: v for k, v in dit.config.items() if not k.startswith("_")},
                   "vace_layers": list(vace.config.vace_layers), "vace_in_channels": 96}
    ref = WanVACETransformer3DModel(**full_config).eval()
    ref.load_state_dict(state, strict=True)
    x, t, text, context = _inputs(ref)
    scale = torch.tensor([0.7, 1.3])
    with torch.no_grad():
        theirs = ref(x, t, text, control_hidden_states=context, control_hidden_states_scale=scale,
                     return_dict=False)[0]
        ours = wan_dit_forward(dit, x, t, text, block_hooks=[vace.block_hook(context, scale)])
        plain = wan_dit_forward(dit, x, t, text)
    assert (ours - theirs).abs().max() <= 1e-5
    assert (ours - plain).abs().max() > 1e-3  # the hints matter
    with pytest.raises(Exception, match="vace_scale"):
        vace.block_hook(context, [1.0, 1.0, 1.0])


def test_wan_dit_forward_is_the_diffusers_forward_without_hooks():
    from diffusers import WanTransformer3DModel

    from support.wan.common import tiny_dit_kwargs

    torch.manual_seed(0)
    dit = WanTransformer3DModel(**tiny_dit_kwargs(2, in_channels=36, image=True)).eval()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 36, 3, 4, 6, generator=g)
    text, image = torch.randn(2, 5, 32, generator=g), torch.randn(2, 4, 32, generator=g)
    with torch.no_grad():
        for t in (torch.tensor([10.0, 900.0]), torch.rand(2, 3 * 2 * 3, generator=g) * 1000):  # per-token too
            assert torch.equal(wan_dit_forward(dit, x, t, text, image), dit(x, t, text, image, return_dict=False)[0])


# -- the VACE context unit against diffusers' WanVACEPipeline ----------------------------------------------------
def _tiny_vae():
    from diffusers import AutoencoderKLWan

    torch.manual_seed(4)
    return AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                            temperal_downsample=[False, True, True]).eval()


def _clip(n, size, seed):
    g = torch.Generator().manual_seed(seed)
    return [Image.fromarray((torch.rand(size[1], size[0], 3, generator=g) * 255).byte().numpy()) for _ in range(n)]


def _mask_clip(n, size):
    w, h = size
    frames = []
    for i in range(n):
        m = Image.new("RGB", size, (0, 0, 0))
        m.paste((255, 255, 255), (i * 4 % w, 0, i * 4 % w + w // 2, h // 2))
        frames.append(m)
    return frames


@pytest.mark.parametrize("with_mask, with_ref", [(False, False), (True, True), (True, False)])
def test_vace_context_equals_diffusers_prepare_video_latents_and_masks(with_mask, with_ref):
    from diffusers import FlowMatchEulerDiscreteScheduler, WanVACEPipeline

    vae = _tiny_vae()
    pipe = WanVideoPipeline(torch_dtype=torch.float32)
    pipe.vae = vae
    size, n = (48, 32), 5
    video, mask, ref = _clip(n, size, 1), _mask_clip(n, size) if with_mask else None, \
        (_clip(1, size, 2)[0] if with_ref else None)
    values = {"vace_video": video, "vace_video_mask": mask, "vace_reference_image": ref, "height": 32, "width": 48,
              "num_frames": n, "batch_size": 1}
    ours = run_unit(pipe, WanVaceEmbedder(), values)["vace_context"]

    theirs_pipe = WanVACEPipeline(tokenizer=None, text_encoder=None, vae=vae,
                                  scheduler=FlowMatchEulerDiscreteScheduler(), transformer=tiny_vace_transformer())
    v, m, refs = theirs_pipe.preprocess_conditions(video, mask, [ref] if ref is not None else None, 1, 32, 48, n,
                                                   torch.float32, "cpu")
    with torch.no_grad():
        latents = theirs_pipe.prepare_video_latents(v, m, refs)
        masks = theirs_pipe.prepare_masks(m, refs)
    theirs = torch.cat([latents, masks], dim=1)
    assert ours.shape == theirs.shape == (1, 96, 2 + int(with_ref), 4, 6)
    assert (ours - theirs).abs().max() <= 1e-5


def test_reference_image_leads_the_training_latents_and_the_noise():
    pipe = WanVideoPipeline(torch_dtype=torch.float32)
    pipe.vae = _tiny_vae()
    pipe.scheduler.set_training()
    clip, ref = _clip(5, (48, 32), 1), _clip(1, (48, 32), 2)[0]
    values = {"height": 32, "width": 48, "num_frames": 5, "seed": 0, "rand_device": "cpu", "batch_size": 1,
              "input_video": clip, "vace_reference_image": ref}
    run_unit(pipe, WanVaceNoiseInitializer(), values)
    assert values["noise"].shape == (1, 16, 3, 4, 6)  # 2 latent frames + 1 for the reference
    run_unit(pipe, WanVaceInputVideoEmbedder(), values)
    from difftune.families.wan.units import vae_encode, video_tensor

    with torch.no_grad():
        expected = torch.cat([vae_encode(pipe, video_tensor([ref], 32, 48)),
                              vae_encode(pipe, video_tensor(clip, 32, 48))], dim=2)
    assert torch.equal(values["input_latents"], expected)
    # no reference: the base unit's values
    values = {"height": 32, "width": 48, "num_frames": 5, "seed": 0, "rand_device": "cpu", "batch_size": 1}
    run_unit(pipe, WanVaceNoiseInitializer(), values)
    assert values["noise"].shape == (1, 16, 2, 4, 6)


def test_gradient_checkpointing_of_dit_and_branch_keeps_the_gradients():
    from diffusers import WanTransformer3DModel

    from difftune.core.checkpointing import set_gradient_checkpointing
    from support.wan.vace import tiny_vace_configs
    from difftune.families.wan.vace import WanVACEModel

    full = tiny_vace_transformer()
    dit_config, vace_config = tiny_vace_configs(full)
    state = full.state_dict()
    dit = WanTransformer3DModel.from_config(dit_config)
    dit.load_state_dict({k: v for k, v in state.items() if not k.startswith("vace_")})
    vace = WanVACEModel.from_config(vace_config)
    vace.load_state_dict({k: v for k, v in state.items() if k.startswith("vace_")})
    x, t, text, context = _inputs(full)
    grads = []
    for enabled in (False, True):
        for model in (dit, vace):
            set_gradient_checkpointing(model, enabled)
            model.zero_grad()
        wan_dit_forward(dit, x, t, text, block_hooks=[vace.block_hook(context)]).square().mean().backward()
        grads.append([p.grad.clone() for p in vace.parameters()])
    assert vace.gradient_checkpointing and vace.vace_blocks[0].proj_in.weight.grad.abs().sum() > 0
    assert all((a - b).abs().max() <= 1e-6 for a, b in zip(*grads))


@pytest.mark.parametrize("with_ref", [False, True])
@torch.no_grad()
def test_sampling_equals_diffusers_wan_vace_pipeline(tmp_path, with_ref):
    """The whole sampling loop with a VACE branch (control video, mask, and a reference image) == diffusers'
    WanVACEPipeline (fp32, tiny, latents; diffusers keeps the reference's leading latent frame, sampling drops it)."""
    import diffusers.pipelines.wan.pipeline_wan as t2v_module
    import diffusers.pipelines.wan.pipeline_wan_vace as vace_module
    from diffusers import WanPipeline, WanTransformer3DModel, WanVACEPipeline

    from support.wan.common import tiny_dit_kwargs
    from difftune.families.wan.vace import WanVACEModel
    from difftune.models import ModelConfig
    from support import tiny_wan_paths, write_tiny_wan

    vace_module.basic_clean = t2v_module.basic_clean  # diffusers 0.42 calls ftfy without checking it is installed
    root = write_tiny_wan(tmp_path / "t2v", "t2v")
    ours = WanVideoPipeline.from_pretrained(
        torch_dtype=torch.float32, model_configs=[ModelConfig(p[0]) for p in tiny_wan_paths(root).values()],
        tokenizer_config=ModelConfig(str(root / "tokenizer")))
    ref = tiny_vace_transformer(seed=1)
    kw = tiny_dit_kwargs(4)
    state = ref.state_dict()
    dit = WanTransformer3DModel(**kw).eval()
    dit.load_state_dict({k: v for k, v in state.items() if not k.startswith("vace_")})
    vace = WanVACEModel(vace_layers=(0, 2), num_attention_heads=kw["num_attention_heads"],
                        attention_head_dim=kw["attention_head_dim"], ffn_dim=kw["ffn_dim"],
                        patch_size=kw["patch_size"], cross_attn_norm=kw["cross_attn_norm"], qk_norm=kw["qk_norm"],
                        eps=kw["eps"]).eval()
    vace.load_state_dict({k: v for k, v in state.items() if k.startswith("vace_")})
    ours.dit, ours.vace = dit, vace
    base = WanPipeline.from_pretrained(str(root), torch_dtype=torch.float32)
    theirs = WanVACEPipeline(tokenizer=base.tokenizer, text_encoder=base.text_encoder, vae=base.vae,
                             scheduler=base.scheduler, transformer=ref)
    theirs.set_progress_bar_config(disable=True)
    video = _clip(9, (48, 32), 1)
    mask = _mask_clip(9, (48, 32))
    reference = _clip(1, (48, 32), 5)[0] if with_ref else None
    kw2 = dict(height=32, width=48, num_frames=9, num_inference_steps=4)
    a = ours("a red fox", negative_prompt="blurry", cfg_scale=5.0, seed=3, progress=False, output_type="latent",
             vace_video=video, vace_video_mask=mask, vace_reference_image=reference, **kw2)
    b = theirs(prompt="a red fox", negative_prompt="blurry", guidance_scale=5.0, video=video, mask=mask,
               reference_images=[reference] if with_ref else None, generator=torch.Generator("cpu").manual_seed(3),
               output_type="latent", **kw2).frames
    assert b.shape[2] == a.shape[2] + int(with_ref)
    diff = (a - b[:, :, int(with_ref):]).abs().max().item()
    print(f"wan VACE (reference image: {with_ref}) vs WanVACEPipeline: latents max difference {diff:.2e}")
    assert diff <= 1e-5
    plain = ours("a red fox", negative_prompt="blurry", cfg_scale=5.0, seed=3, progress=False, output_type="latent",
                 **kw2)
    assert (a - plain).abs().max() > 1e-3  # the branch steered the sample


@pytest.mark.parametrize("trained", ["lora", "full"])
def test_a_vace_lora_and_a_trainable_vace_train_the_same_one_stage_and_split(known, tmp_path, trained):
    """VACE's branch trained (a LoRA on it, or the whole branch) from a control clip and a reference image: split
    training (stage 1 caches the prompt, the VACE context and the latents; stage 2 loads the DiT and the branch)
    equals one-stage training."""
    import json

    from conftest import run_train
    from safetensors.torch import load_file

    from support.wan.scripts import vace as write_vace_data

    meta = write_vace_data(tmp_path / "data")
    models = [str(known / "diffusion_pytorch_model.safetensors"), str(known / "models_t5_umt5-xxl-enc-bf16.pth"),
              str(known / "Wan2.1_VAE.pth")]
    what = (["--lora_base_model", "vace", "--lora_target_modules", "q,k,v,o,ffn.0,ffn.2", "--lora_rank", "4"]
            if trained == "lora" else ["--trainable_models", "vace"])
    common = ["--model_paths", json.dumps(models), "--tokenizer_path", str(known / "google" / "umt5-xxl"),
              "--data_file_keys", "video,vace_video,vace_reference_image",
              "--extra_inputs", "vace_video,vace_reference_image", "--height", "32", "--width", "48",
              "--torch_dtype", "float32", "--learning_rate", "1e-3", "--dataset_repeat", "2", "--num_epochs", "1",
              "--seed", "5", "--no_progress", "--enable_tensorboard_log", "false", *what]
    data = ["--dataset_base_path", tmp_path / "data", "--dataset_metadata_path", meta]
    run_train("--task", "sft", *data, "--output_path", tmp_path / "one", *common)
    run_train("--task", "sft:split", *data, "--output_path", tmp_path / "two", *common)
    a, b = (load_file(str(tmp_path / d / "epoch-0.safetensors")) for d in ("one", "two"))
    assert a.keys() == b.keys() and a
    prefix = "transformer.vace_" if trained == "lora" else "pipe.vace.vace_"  # the branch's LoRA / its own weights
    assert all(k.startswith(prefix) for k in a), sorted(a)[:3]
    diff = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    print(f"wan VACE ({trained}) one-stage vs split: max difference {diff:.2e}")
    assert diff <= 1e-5
