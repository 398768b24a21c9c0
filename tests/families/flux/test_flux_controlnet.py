"""FLUX.1 ControlNets: recognition of the released layouts, the control image's encoding and the denoiser call
against diffusers' FluxControlNetPipeline computations (fp32, tiny), inpaint-mask channel vs the reference; a fully
trained ControlNet or value controller is saved in names that load back."""

import numpy as np
import pytest
import torch
from PIL import Image

from difftune.core.latents import pack_latents
from difftune.errors import UserError
from difftune.families.flux.controlnet import (CONTROLNET, INFUSENET_CONFIG,
                                               INPAINTING_BETA_CONFIG, UNION_ALPHA_CONFIG, UPSCALER_CONFIG,
                                               FluxControlNetEmbedder, controlnet_config_from_weights)
from difftune.families.flux.model_fn import model_fn_flux
from difftune.families.flux.model_fn import image_ids
from support.flux import (TINY_CONTROLNETS, run_unit_on, tiny_controlnet_config, with_config,
                                            write_tiny_controlnet)
from difftune.models.detect import match_header, read_header
from difftune.models.load import load_component


def _image(size=(32, 32), seed=0):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


@pytest.mark.parametrize("config", [UNION_ALPHA_CONFIG, UPSCALER_CONFIG, INFUSENET_CONFIG, INPAINTING_BETA_CONFIG])
def test_release_configs_are_read_off_their_weights(config):
    """Each release's sizes (the reference's registry) are recognised from the weights alone, at full size, in the
    released names (no `models.0.`) as in the reference's trained files (with it)."""
    shapes = CONTROLNET.signature(config)
    assert all(k.startswith("models.0.") for k in shapes)
    assert controlnet_config_from_weights(shapes) == config
    released = {k[len("models.0."):]: s for k, s in shapes.items()}
    for header in (released, shapes):
        match = match_header(header, [CONTROLNET])
        assert match.spec is CONTROLNET and match.config == config


@pytest.mark.parametrize("kind", sorted(TINY_CONTROLNETS))
def test_tiny_controlnets_load_by_their_own_names(tmp_path, kind):
    path = write_tiny_controlnet(tmp_path, kind)
    config = tiny_controlnet_config(kind)
    loaded = load_component(str(path), [with_config(CONTROLNET, config)], torch_dtype=torch.float32)
    net = loaded.module.net
    assert type(net).__name__ == ("FluxControlNetWithExtraCondition" if kind == "inpaint" else "FluxControlNetModel")
    header = read_header(path)
    state = net.state_dict()
    assert set(state) == set(header)  # diffusers' names: nothing renamed, nothing left over
    from safetensors.torch import load_file
    assert all(torch.equal(state[k], v) for k, v in load_file(str(path)).items())


def _diffusers_pipe(models, controlnet):
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxControlNetPipeline

    return FluxControlNetPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=models["vae"],
                                  text_encoder=models["text_encoder"], tokenizer=models["tokenizer"],
                                  text_encoder_2=models["text_encoder_2"], tokenizer_2=models["tokenizer_2"],
                                  transformer=models["dit"], controlnet=controlnet)


def _controlnet(tmp_path, kind):
    from difftune.families.flux.controlnet import FluxControlNetWithExtraCondition
    from diffusers import FluxControlNetModel

    path = write_tiny_controlnet(tmp_path / kind, kind)
    config = tiny_controlnet_config(kind)
    cls = FluxControlNetWithExtraCondition if config.get("extra_condition_channels") else FluxControlNetModel
    model = cls.from_config({k: v for k, v in config.items() if k != "_class_name"})
    from safetensors.torch import load_file
    model.load_state_dict(load_file(str(path)))
    return model.eval()


@torch.no_grad()
def test_control_image_encoding_matches_diffusers(flux_models, tmp_path):
    """controlnet_conditioning (packed) == FluxControlNetPipeline.prepare_image -> vae.encode -> shift/scale -> pack;
    a control image of another size is resized to the output as diffusers does; the mode index is Union's."""
    controlnet = _controlnet(tmp_path, "union")
    pipe = _diffusers_pipe(flux_models, controlnet)
    image = _image((48, 40), seed=1)
    out = run_unit_on(FluxControlNetEmbedder(), {"vae": flux_models["vae"]}, controlnet_image=image,
                      controlnet_processor_id="depth", height=32, width=48, batch_size=1)
    ref = pipe.prepare_image(image, 48, 32, 1, 1, "cpu", torch.float32)
    ref = pipe.vae.encode(ref).latent_dist.sample(torch.Generator().manual_seed(0))
    ref = (ref - pipe.vae.config.shift_factor) * pipe.vae.config.scaling_factor
    ref = pipe._pack_latents(ref, 1, 16, ref.shape[2], ref.shape[3])
    assert out["controlnet_conditioning"].shape == (1, 16, 4, 6)
    assert (pack_latents(out["controlnet_conditioning"]) - ref).abs().max() <= 1e-5
    assert out["controlnet_mode"].tolist() == [2]


@pytest.mark.parametrize("kind", ["union", "upscaler", "infusenet"])
@torch.no_grad()
def test_denoiser_call_matches_diffusers(flux_models, tmp_path, kind):
    """model_fn with a ControlNet == FluxControlNetPipeline's step: controlnet(...) residuals into transformer(...)."""
    dit = flux_models["dit"]
    controlnet = _controlnet(tmp_path, kind)
    g = torch.Generator().manual_seed(3)
    latents, cond = torch.randn(1, 16, 4, 6, generator=g), torch.randn(1, 16, 4, 6, generator=g)
    prompt, pooled = torch.randn(1, 7, 32, generator=g), torch.randn(1, 32, generator=g)
    t, guidance = torch.tensor([700.0]), torch.tensor([3.5])
    mode = torch.tensor([4]) if kind == "union" else None
    ours = model_fn_flux(dit, latents, t, prompt, pooled, guidance, controlnet=controlnet,
                                  controlnet_conditioning=cond, controlnet_mode=mode, controlnet_scale=0.7)
    tokens, img_ids = pack_latents(latents), image_ids(2, 3, "cpu", torch.float32)
    txt_ids = torch.zeros(7, 3)
    samples, single = controlnet(hidden_states=tokens, controlnet_cond=pack_latents(cond),
                                 controlnet_mode=None if mode is None else mode.view(-1, 1), conditioning_scale=0.7,
                                 timestep=t / 1000, guidance=guidance, pooled_projections=pooled,
                                 encoder_hidden_states=prompt, txt_ids=txt_ids, img_ids=img_ids, return_dict=False)
    ref = dit(hidden_states=tokens, timestep=t / 1000, guidance=guidance, pooled_projections=pooled,
              encoder_hidden_states=prompt, txt_ids=txt_ids, img_ids=img_ids, controlnet_block_samples=samples,
              controlnet_single_block_samples=single, return_dict=False)[0]
    plain = model_fn_flux(dit, latents, t, prompt, pooled, guidance)
    assert (pack_latents(ours) - ref).abs().max() <= 1e-5
    assert (ours - plain).abs().max() > 1e-3  # the ControlNet changes the prediction
    other = model_fn_flux(dit, latents, t, prompt, pooled, guidance, controlnet=controlnet,
                                   controlnet_conditioning=cond.flip(-1), controlnet_mode=mode)
    assert (other - ours).abs().max() > 1e-3  # and so does the control image


def _reference_inpaint_condition(vae, image, mask):
    """The reference's FluxImageUnit_ControlNet with an inpaint mask, step by step: pixels where the resized mask
    is light blacked out, VAE-encoded, then 1 - the mask's lightness (own size, nearest) as a 17th channel."""
    m = np.asarray(mask.resize(image.size).convert("RGB"), dtype=np.float32) / 127.5 - 1
    arr = np.array(image)
    arr[m.mean(axis=-1) > 0] = 0
    x = torch.from_numpy(arr.astype(np.float32) / 127.5 - 1).permute(2, 0, 1)[None]
    z = vae.encode(x).latent_dist.mode()
    z = (z - vae.config.shift_factor) * vae.config.scaling_factor
    light = (torch.from_numpy(np.asarray(mask.convert("RGB"), dtype=np.float32) / 127.5 - 1).permute(2, 0, 1)[None]
             + 1) / 2
    keep = 1 - torch.nn.functional.interpolate(light.mean(dim=1, keepdim=True), size=z.shape[-2:])
    return torch.cat([z, keep], dim=1)


@torch.no_grad()
def test_inpaint_condition_matches_the_reference_and_feeds_the_extra_channels(flux_models, tmp_path):
    image = _image((32, 32), seed=2)
    mask = Image.new("L", (40, 40), 0)
    mask.paste(255, (8, 8, 30, 24))
    out = run_unit_on(FluxControlNetEmbedder(), {"vae": flux_models["vae"]}, controlnet_image=image,
                      controlnet_inpaint_mask=mask, height=32, width=32)
    cond = out["controlnet_conditioning"]
    assert cond.shape == (1, 17, 4, 4)
    assert (cond - _reference_inpaint_condition(flux_models["vae"], image, mask)).abs().max() <= 1e-5
    inpaint = _controlnet(tmp_path, "inpaint")
    latents = torch.randn(1, 16, 4, 4, generator=torch.Generator().manual_seed(0))
    args = (flux_models["dit"], latents, torch.tensor([500.0]), torch.randn(1, 5, 32), torch.randn(1, 32))
    a = model_fn_flux(*args, controlnet=inpaint, controlnet_conditioning=cond)
    cond2 = cond.clone()
    cond2[:, 16] = 1 - cond2[:, 16]
    b = model_fn_flux(*args, controlnet=inpaint, controlnet_conditioning=cond2)
    assert (a - b).abs().max() > 1e-4  # the mask channel reaches the ControlNet
    with pytest.raises(UserError, match="inpaint"):
        model_fn_flux(*args, controlnet=inpaint, controlnet_conditioning=cond[:, :16])


def test_union_needs_a_mode_and_bad_modes_are_one_line_errors(flux_models, tmp_path):
    union = _controlnet(tmp_path, "union")
    args = (flux_models["dit"], torch.zeros(1, 16, 4, 4), torch.tensor([500.0]), torch.zeros(1, 5, 32),
            torch.zeros(1, 32))
    with pytest.raises(UserError, match="controlnet_processor_id"):
        model_fn_flux(*args, controlnet=union, controlnet_conditioning=torch.zeros(1, 16, 4, 4))
    with pytest.raises(UserError) as e:
        run_unit_on(FluxControlNetEmbedder(), {"vae": flux_models["vae"]}, controlnet_image=_image(),
                    controlnet_processor_id="sketch", height=32, width=32)
    assert "sketch" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("kind", ["upscaler", "union"])
@torch.no_grad()
def test_sampling_equals_flux_controlnet_pipeline(flux_repo, flux_models, tmp_path, kind):
    """The whole sampling loop with a ControlNet == diffusers' FluxControlNetPipeline (fp32, tiny, latents)."""
    from difftune import FluxImagePipeline
    from difftune.models import ModelConfig
    from support import tiny_flux_paths

    paths = tiny_flux_paths(flux_repo)
    ours = FluxImagePipeline.from_pretrained(
        torch_dtype=torch.float32, model_configs=[ModelConfig(p if len(p) > 1 else p[0]) for p in paths.values()],
        tokenizer_1_config=ModelConfig(str(flux_repo / "tokenizer")),
        tokenizer_2_config=ModelConfig(str(flux_repo / "tokenizer_2")))
    controlnet = _controlnet(tmp_path, kind)
    ours.vae, ours.controlnet = flux_models["vae"], controlnet  # the fixture's near-deterministic VAE encode
    from diffusers import FlowMatchEulerDiscreteScheduler

    theirs = _diffusers_pipe(flux_models, controlnet)
    theirs.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(str(flux_repo / "scheduler"))  # the repo's
    theirs.set_progress_bar_config(disable=True)
    image = _image((48, 32), seed=4)
    mode = {"processor": "depth", "index": 2} if kind == "union" else None
    a = ours("a red circle", controlnet_image=image, controlnet_scale=0.7, height=32, width=48,
             num_inference_steps=3, seed=7, progress=False, output_type="latent",
             controlnet_processor_id=mode and mode["processor"])
    # FluxControlNetPipeline draws the control image's VAE sample from the generator before the noise: it is given
    # the noise FluxPipeline draws for seed 7 (which is ours)
    noise = pack_latents(torch.randn(1, 16, 4, 6, generator=torch.Generator().manual_seed(7)))
    b = theirs("a red circle", control_image=image, controlnet_conditioning_scale=0.7, height=32, width=48,
               num_inference_steps=3, guidance_scale=3.5, generator=torch.Generator().manual_seed(0), latents=noise,
               control_mode=mode and mode["index"], output_type="latent").images
    plain = ours("a red circle", height=32, width=48, num_inference_steps=3, seed=7, progress=False,
                 output_type="latent")
    diff = (pack_latents(a) - b).abs().max().item()
    print(f"flux ControlNet ({kind}) vs FluxControlNetPipeline: latents max difference {diff:.2e}")
    assert diff <= 1e-5
    assert (a - plain).abs().max() > 1e-3  # the ControlNet steered the sample


@pytest.mark.parametrize("trained", ["lora", "full"])
def test_a_controlnet_lora_and_a_trainable_controlnet_train_the_same_one_stage_and_split(flux_repo, tmp_path,
                                                                                         trained):
    """The ControlNet trained (a LoRA on it, or the whole ControlNet, as the full scripts do) from a control image
    column: split training (stage 1 caches the prompt, the control image's latents and the target's; stage 2 loads
    the DiT and the ControlNet) equals one-stage training."""
    import json

    from conftest import run_train
    from safetensors.torch import load_file

    from support import tiny_flux_paths, write_example_dataset

    meta = write_example_dataset(tmp_path / "data", n=2, size=(48, 32))
    rows = meta.read_text().splitlines()
    for i in range(1, len(rows)):
        name = f"control_{i}.png"
        _image((48, 32), seed=10 + i).save(tmp_path / "data" / name)
        rows[i] = f"{rows[i]},{name}"
    meta.write_text("\n".join([rows[0] + ",controlnet_image", *rows[1:]]) + "\n")
    models = [p if len(p) > 1 else p[0] for p in tiny_flux_paths(flux_repo).values()]
    from support.flux.contract import ContractModels

    models.append(ContractModels(tmp_path / "variants", flux_repo).controlnet("upscaler"))  # random output blocks
    what = (["--lora_base_model", "controlnet", "--lora_target_modules", "to_q,to_k,to_v", "--lora_rank", "4"]
            if trained == "lora" else ["--trainable_models", "controlnet"])
    common = ["--model_paths", json.dumps(models), "--data_file_keys", "image,controlnet_image",
              "--extra_inputs", "controlnet_image", "--max_pixels", "4096", "--torch_dtype", "float32",
              "--learning_rate", "1e-3", "--dataset_repeat", "2", "--num_epochs", "1", "--seed", "5", "--no_progress",
              "--enable_tensorboard_log", "false", *what]
    data = ["--dataset_base_path", tmp_path / "data", "--dataset_metadata_path", meta]
    run_train("--task", "sft", *data, "--output_path", tmp_path / "one", *common)
    run_train("--task", "sft:split", *data, "--output_path", tmp_path / "two", *common)
    a, b = (load_file(str(tmp_path / d / "epoch-0.safetensors")) for d in ("one", "two"))
    assert a.keys() == b.keys() and a
    prefix = "controlnet." if trained == "lora" else "pipe.controlnet."
    assert all(k.startswith(prefix) for k in a), sorted(a)[:3]
    diff = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    print(f"flux ControlNet ({trained}) one-stage vs split: max difference {diff:.2e}")
    assert diff <= 1e-5


@pytest.mark.parametrize("slot", ["controlnet", "value_controller"])
def test_a_fully_trained_controlnet_or_value_controller_saves_in_names_that_load_back(slot):
    """`--full_format original` writes the released file's names (`models.0.` / `encoders.0.` dropped); the default
    writes the slot's names, `pipe.<slot>.` less --remove_prefix_in_ckpt, as the reference's trained files. Either
    loads back as the model it was; before, `--full_format original` was refused for both."""
    from difftune.core.family import get_family
    from difftune.training.config import RunConfig
    from difftune.training.stages import full_converters

    family = get_family("flux")
    spec = next(c for c in family.components if c.name == slot)
    label, config = next(iter(spec.known_configs.items()))
    state = {k: torch.empty(s, device="meta") for k, s in spec.signature(config).items()}
    native = family.full_native_keys[slot](state)
    assert not any(k.startswith(("models.0.", "encoders.0.")) for k in native)
    for saved in ({k: tuple(v.shape) for k, v in native.items()},  # --full_format original
                  {f"{slot}.{k}": tuple(v.shape) for k, v in state.items()},  # --remove_prefix_in_ckpt pipe.
                  {f"pipe.{slot}.{k}": tuple(v.shape) for k, v in state.items()}):
        match = match_header(saved, [spec])
        assert match is not None and match.label == label
    run = RunConfig(trainable_models=slot, full_format="original")
    assert full_converters(run, family) == {slot: family.full_native_keys[slot]}
