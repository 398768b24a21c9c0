"""Stable Diffusion 1.x: sampling equals diffusers' StableDiffusionPipeline, the training loss is diffusers' DDPM
epsilon loss, `--lora_target_modules ""` picks what the reference picks on SD 1.5, parts that do not fit are named."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from difftune.errors import UserError

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    from support.stable_diffusion import write_tiny_sd_hub

    return write_tiny_sd_hub(tmp_path_factory.mktemp("sd_hub"))


def _diffusers_pipe(hub):
    from diffusers import AutoencoderKL, DDIMScheduler, UNet2DConditionModel
    from diffusers import StableDiffusionPipeline as Theirs
    from transformers import CLIPTextModel, CLIPTokenizer

    from support.stable_diffusion import REPO

    repo = hub / REPO
    return Theirs(vae=AutoencoderKL.from_pretrained(repo / "vae"), unet=UNet2DConditionModel.from_pretrained(repo / "unet"),
                  text_encoder=CLIPTextModel.from_pretrained(repo / "text_encoder"),
                  tokenizer=CLIPTokenizer.from_pretrained(repo / "tokenizer"),
                  scheduler=DDIMScheduler.from_pretrained(repo / "scheduler"), safety_checker=None,
                  feature_extractor=None, requires_safety_checker=False)


def test_sampling_equals_diffusers_stable_diffusion_pipeline(hub):
    from difftune.core.latents import seeded_noise
    from support.stable_diffusion import load_tiny_sd

    ours = load_tiny_sd(hub)("a red circle", negative_prompt="a blue square", height=32, width=48, seed=3,
                             num_inference_steps=4, cfg_scale=7.5)
    noise = seeded_noise((4, 4, 6), 3, 1, device="cpu")
    theirs = _diffusers_pipe(hub)("a red circle", negative_prompt="a blue square", height=32, width=48,
                                  num_inference_steps=4, guidance_scale=7.5, latents=noise, output_type="np").images[0]
    ours = np.asarray(ours, dtype=np.float64) / 255
    assert ours.shape == theirs.shape == (32, 48, 3)
    assert np.abs(ours - theirs).max() <= 1.5 / 255  # 8-bit rounding of the same image
    assert ours.std() > 0.01


def test_training_loss_is_the_epsilon_mse_on_diffusers_ddpm_noising(hub):
    """One training step's loss: MSE(unet(add_noise(x0, n, t), t, text), n) with diffusers' DDPMScheduler."""
    from diffusers import DDPMScheduler

    from support.stable_diffusion import load_tiny_sd

    pipe = load_tiny_sd(hub)
    pipe.scheduler.set_training()
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(1, 4, 4, 4, generator=g)
    noise = torch.randn(1, 4, 4, 4, generator=g)
    t = torch.tensor([417])
    text = pipe.text_encoder(torch.tensor([[0, 5, 6, 1]]))[0]
    noisy = pipe.scheduler.add_noise(x0, noise, t)
    ddpm = DDPMScheduler.from_pretrained(hub / "AI-ModelScope/stable-diffusion-v1-5/scheduler")
    torch.testing.assert_close(noisy, ddpm.add_noise(x0, noise, t), rtol=0, atol=1e-6)
    assert torch.equal(pipe.scheduler.training_target(x0, noise, t), noise)
    pred = pipe.model_fn(noisy, t, text)
    want = pipe.unet(noisy, t, encoder_hidden_states=text).sample
    torch.testing.assert_close(pred, want)


def test_auto_targets_on_sd15_are_the_references_121():
    """`--lora_target_modules ""` on SD 1.5's UNet (diffusers' class, the official config, meta tensors) picks the
    modules the reference's own rule picks on its own SD 1.5 UNet class (the list in the JSON beside this file)."""
    from diffusers import UNet2DConditionModel

    from difftune.families.stable_diffusion.components import SD15_UNET_CONFIG
    from difftune.lora.auto_targets import auto_target_modules

    reference = json.loads((HERE / "reference_auto_targets_sd15.json").read_text())["targets"]
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(SD15_UNET_CONFIG)
    ours = auto_target_modules(unet)
    assert len(ours) == len(reference) == 121
    assert sorted(ours) == sorted(reference)
    assert sum(t.endswith("time_emb_proj") for t in ours) == 17
    # none in the 320-channel blocks; in the mid block (lists of one) only what sits in the lists of more inside it:
    # to_out (Linear, Dropout) and ff.net, not the queries, keys and values
    assert not any(t.startswith(("down_blocks.0.", "up_blocks.3.")) for t in ours)
    assert not any(t.startswith("mid_block.") and t.endswith(("to_q", "to_k", "to_v")) for t in ours)


def test_the_official_sd15_unet_is_recognised_from_its_header_alone(tmp_path):
    from diffusers import UNet2DConditionModel

    from difftune.families.stable_diffusion.components import SD15_UNET_CONFIG, UNET

    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(SD15_UNET_CONFIG)
    shapes = {k: tuple(v.shape) for k, v in unet.state_dict().items()}
    assert UNET.signature(UNET.known_configs["stable-diffusion-v1-5 unet"]) == shapes


def test_an_sdxl_unet_folder_is_named_for_its_own_family(hub, tmp_path):
    from difftune.core.family import recognise
    from difftune.models import ModelConfig
    import shutil

    from support.stable_diffusion import REPO, sd_model_paths

    repo = tmp_path / "repo"
    shutil.copytree(hub / REPO, repo)
    config = json.loads((repo / "unet" / "config.json").read_text())
    (repo / "unet" / "config.json").write_text(json.dumps({**config, "addition_embed_type": "text_time"}))
    paths = [str(repo / Path(p).relative_to(hub / REPO)) for p in sd_model_paths(hub)]
    with pytest.raises(UserError, match="addition_embed_type 'text_time'.*stable_diffusion_xl family trains it"):
        recognise([ModelConfig(p) for p in paths], "stable_diffusion", log=lambda *a: None)


def test_a_text_encoder_of_another_width_is_named(hub, tmp_path):
    from support.stable_diffusion import REPO, TinySDSpec, tiny_text_encoder
    from support.tokenizers import clip_tokenizer
    from difftune.families.stable_diffusion.pipeline import StableDiffusionPipeline
    from difftune.models import ModelConfig

    tiny_text_encoder(TinySDSpec(text_hidden=48), clip_tokenizer()).save_pretrained(tmp_path / "te")
    repo = hub / REPO
    configs = [ModelConfig(str(repo / "unet" / "diffusion_pytorch_model.safetensors")),
               ModelConfig(str(tmp_path / "te" / "model.safetensors")),
               ModelConfig(str(repo / "vae" / "diffusion_pytorch_model.safetensors"))]
    with pytest.raises(UserError, match="text_encoder .* is 48 wide and the unet .* cross-attends to 32-wide"):
        StableDiffusionPipeline.from_pretrained(torch_dtype=torch.float32, device="cpu", model_configs=configs)


def test_clip_skip_2_samples_as_diffusers_clip_skip_1_and_trains(hub, tmp_path):
    """kohya's --clip_skip 2 (the second-to-last layer through the final layer norm) is diffusers' clip_skip=1; the
    run's flag reaches training."""
    from conftest import run_train
    from difftune.core.latents import seeded_noise
    from support import write_example_dataset
    from support.stable_diffusion import load_tiny_sd, sd_model_paths

    pipe = load_tiny_sd(hub)
    kw = dict(negative_prompt="", height=32, width=32, seed=4, num_inference_steps=3, cfg_scale=7.5)
    ours = np.asarray(pipe("a red circle", clip_skip=2, **kw), dtype=np.float64) / 255
    plain = np.asarray(pipe("a red circle", **kw), dtype=np.float64) / 255
    # diffusers' clip_skip=1 (hidden_states[-2] through the final layer norm), computed here: diffusers 0.42's own
    # reaches for `text_encoder.text_model`, which transformers 5's CLIPTextModel no longer has
    them = _diffusers_pipe(hub)

    def embeds(prompt):
        ids = them.tokenizer([prompt], padding="max_length", max_length=77, truncation=True, return_tensors="pt")
        hidden = them.text_encoder(ids.input_ids, output_hidden_states=True).hidden_states[-2]
        return them.text_encoder.final_layer_norm(hidden)

    with torch.no_grad():
        theirs = them(prompt_embeds=embeds("a red circle"), negative_prompt_embeds=embeds(""), height=32, width=32,
                      num_inference_steps=3, guidance_scale=7.5, latents=seeded_noise((4, 4, 4), 4, 1, device="cpu"),
                      output_type="np").images[0]
    assert np.abs(ours - theirs).max() <= 1.5 / 255
    assert np.abs(ours - plain).max() > 2 / 255
    with pytest.raises(UserError, match="--clip_skip 3: the text encoder has 2 layers"):
        pipe("a red circle", clip_skip=3, **kw)

    meta = write_example_dataset(tmp_path / "data", n=2, size=(32, 32))
    for skip in (1, 2):
        run_train("--dataset_base_path", tmp_path / "data", "--dataset_metadata_path", meta, "--height", 32,
                  "--width", 32, "--model_paths", json.dumps(sd_model_paths(hub)), "--lora_base_model", "unet",
                  "--lora_target_modules", "to_k", "--lora_rank", 2, "--learning_rate", 1e-2, "--max_steps", 1,
                  "--no_progress", "--clip_skip", skip, "--output_path", tmp_path / f"skip{skip}")
    from safetensors.torch import load_file

    one, two = (load_file(str(next((tmp_path / f"skip{s}").glob("*.safetensors")))) for s in (1, 2))
    assert any(not torch.equal(one[k], two[k]) for k in one)  # to_k reads the prompt: another layer, another LoRA


def test_the_default_kohya_file_loads_in_diffusers_with_every_module_at_our_strength(hub, tmp_path):
    """SD 1.x's default LoRA file (kohya's layout in diffusers' module paths, which ComfyUI's and A1111's maps
    know too): diffusers' loader reads every module and moves the UNet as difftune's own loader does."""
    from difftune.lora.formats import save_lora
    from support.stable_diffusion import load_tiny_sd

    pipe = load_tiny_sd(hub)
    g = torch.Generator().manual_seed(0)
    state = {}
    for name, module in pipe.unet.named_modules():
        if isinstance(module, torch.nn.Linear) and name.endswith(("attn1.to_q", "attn2.to_v", "ff.net.2")):
            state[f"{name}.lora_A.weight"] = torch.randn(2, module.in_features, generator=g) / 4
            state[f"{name}.lora_B.weight"] = torch.randn(module.out_features, 2, generator=g) / 4
    path = save_lora(tmp_path / "lora.safetensors", {"unet": state}, {"unet": (2, 3, "to_q,to_v,ff.net.2")},
                     layout="kohya", denoiser="unet")
    from safetensors.torch import load_file

    keys = load_file(str(path))
    assert all(k.startswith("lora_unet_down_blocks_") or k.startswith("lora_unet_up_blocks_")
               or k.startswith("lora_unet_mid_block_") for k in keys), sorted(keys)[:3]
    x, text, t = torch.randn(1, 4, 4, 4, generator=g), torch.randn(1, 77, 32, generator=g), torch.tensor([300])
    theirs = _diffusers_pipe(hub)
    base = theirs.unet(x, t, encoder_hidden_states=text).sample
    theirs.load_lora_weights(str(path))
    assert sum("lora_A" in n for n, _ in theirs.unet.named_parameters()) == len(state) // 2
    moved = theirs.unet(x, t, encoder_hidden_states=text).sample
    pipe.load_lora(pipe.unet, str(path))
    assert (moved - base).abs().max() > 1e-3
    torch.testing.assert_close(moved, pipe.unet(x, t, encoder_hidden_states=text).sample, rtol=1e-4, atol=1e-5)
