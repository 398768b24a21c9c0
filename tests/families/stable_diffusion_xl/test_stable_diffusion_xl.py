"""SDXL: sampling equals diffusers' StableDiffusionXLPipeline, the pooled prompt is bigG's end-of-text embedding (not
the start token the reference pools), the time ids carry a training picture's real size and crop, and the kohya file
in the original UNet names loads in diffusers with every module used."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from difftune.errors import UserError


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    from support.stable_diffusion_xl import write_tiny_sdxl_hub

    return write_tiny_sdxl_hub(tmp_path_factory.mktemp("sdxl_hub"))


def _diffusers_pipe(hub):
    from diffusers import AutoencoderKL, DDIMScheduler, UNet2DConditionModel
    from diffusers import StableDiffusionXLPipeline as Theirs
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    from support.stable_diffusion_xl import REPO

    repo = hub / REPO
    return Theirs(vae=AutoencoderKL.from_pretrained(repo / "vae"), unet=UNet2DConditionModel.from_pretrained(repo / "unet"),
                  text_encoder=CLIPTextModel.from_pretrained(repo / "text_encoder"),
                  text_encoder_2=CLIPTextModelWithProjection.from_pretrained(repo / "text_encoder_2"),
                  tokenizer=CLIPTokenizer.from_pretrained(repo / "tokenizer"),
                  tokenizer_2=CLIPTokenizer.from_pretrained(repo / "tokenizer_2"),
                  scheduler=DDIMScheduler.from_pretrained(repo / "scheduler"), force_zeros_for_empty_prompt=False)


def test_sampling_equals_diffusers_stable_diffusion_xl_pipeline(hub):
    from difftune.core.latents import seeded_noise
    from support.stable_diffusion_xl import load_tiny_sdxl

    ours = load_tiny_sdxl(hub)("a red circle", negative_prompt="a blue square", height=32, width=48, seed=5,
                               num_inference_steps=4, cfg_scale=5.0)
    noise = seeded_noise((4, 4, 6), 5, 1, device="cpu")
    theirs = _diffusers_pipe(hub)("a red circle", negative_prompt="a blue square", height=32, width=48,
                                  num_inference_steps=4, guidance_scale=5.0, latents=noise, output_type="np").images[0]
    ours = np.asarray(ours, dtype=np.float64) / 255
    assert ours.shape == theirs.shape == (32, 48, 3)
    assert np.abs(ours - theirs).max() <= 1.5 / 255
    assert ours.std() > 0.01


def test_the_pooled_prompt_is_the_end_of_text_embedding_and_differs_per_prompt(hub):
    from difftune.families.stable_diffusion_xl.pipeline import SDXLPromptEmbedder
    from support.stable_diffusion_xl import load_tiny_sdxl

    pipe = load_tiny_sdxl(hub)
    out = SDXLPromptEmbedder().embed(pipe, ["a red circle", "a green triangle"])
    assert out["prompt_embeds"].shape == (2, 77, 64)  # CLIP-L 32 + bigG 32
    ids = pipe.tokenizer_2(["a red circle"], padding="max_length", max_length=77, return_tensors="pt").input_ids
    two = pipe.text_encoder_2(ids, output_hidden_states=True)
    eos = int((ids[0] == pipe.tokenizer_2.eos_token_id).nonzero()[0])
    want = pipe.text_encoder_2.text_projection(two.last_hidden_state[0, eos])
    torch.testing.assert_close(out["pooled_prompt_embeds"][0], want)
    # the reference's (the start token's, which the causal mask shows only itself) is one vector for every prompt
    bos = pipe.text_encoder_2.text_projection(two.last_hidden_state[0, 0])
    assert (out["pooled_prompt_embeds"][0] - bos).abs().max() > 1e-3
    assert (out["pooled_prompt_embeds"][0] - out["pooled_prompt_embeds"][1]).abs().max() > 1e-3


def test_time_ids_carry_the_training_pictures_original_size_and_crop(tmp_path):
    from difftune.data.operators import ImageCropAndResize
    from difftune.families.stable_diffusion_xl.pipeline import SDXLTimeIds

    picture = Image.new("RGB", (90, 40))  # wide: scaled to cover 32 x 32 -> 72 x 32, cropped 20 px from the left
    cropped = ImageCropAndResize(32, 32, height_division_factor=8, width_division_factor=8)(picture)
    assert cropped.size == (32, 32)
    pipe = type("P", (), {"device": "cpu"})()
    ids = SDXLTimeIds().process(pipe, [cropped], 32, 32, 1)["add_time_ids"]
    assert ids.tolist() == [[40, 90, 0, 20, 32, 32]]
    # a size alone (sampling): its own original, no crop
    assert SDXLTimeIds().process(pipe, None, 64, 48, 2)["add_time_ids"].tolist() == [[64, 48, 0, 0, 64, 48]] * 2


def test_the_kohya_file_in_ldm_names_loads_in_diffusers_with_every_module(hub, tmp_path):
    """The default LoRA file (kohya, original UNet names): ComfyUI's key map has every module of it, diffusers' SDXL
    loader reads every module of it and the UNet's output moves by what difftune's own loader fuses."""
    from difftune.families.stable_diffusion_xl import FAMILY
    from difftune.lora.formats import save_lora
    from support.stable_diffusion_xl import load_tiny_sdxl

    pipe = load_tiny_sdxl(hub)
    g = torch.Generator().manual_seed(0)
    state = {}
    for name, module in pipe.unet.named_modules():
        if isinstance(module, torch.nn.Linear) and name.endswith(("attn1.to_q", "attn2.to_k", "ff.net.2")):
            state[f"{name}.lora_A.weight"] = torch.randn(2, module.in_features, generator=g) / 4
            state[f"{name}.lora_B.weight"] = torch.randn(module.out_features, 2, generator=g) / 4
    path = save_lora(tmp_path / "lora.safetensors", {"unet": state}, {"unet": (2, 2, "to_q,to_k,ff.net.2")},
                     layout="kohya", denoiser="unet", native_names=FAMILY.lora_native_names)
    from safetensors.torch import load_file

    keys = load_file(str(path))
    assert all(k.startswith(("lora_unet_input_blocks_", "lora_unet_output_blocks_", "lora_unet_middle_block_"))
               for k in keys), sorted(keys)[:3]
    assert len(keys) == 3 * len(state) // 2
    # ComfyUI's SDXL key map (comfy/lora.py model_lora_keys_unet: `lora_unet_` + each LDM state-dict key of its
    # UNet, `.weight` cut and dots as underscores) holds every module of the file
    from support.ldm_files import ldm_unet

    comfy = {"lora_unet_" + k[len("model.diffusion_model."):-len(".weight")].replace(".", "_")
             for k in ldm_unet(pipe.unet.state_dict()) if k.endswith(".weight")}
    modules = {k.split(".")[0] for k in keys}
    assert modules <= comfy, sorted(modules - comfy)[:3]

    x = torch.randn(1, 4, 4, 4, generator=g)
    text = torch.randn(1, 77, 64, generator=g)
    added = {"text_embeds": torch.randn(1, 32, generator=g), "time_ids": torch.tensor([[32.0, 32, 0, 0, 32, 32]])}
    t = torch.tensor([500])
    theirs = _diffusers_pipe(hub)
    base = theirs.unet(x, t, encoder_hidden_states=text, added_cond_kwargs=added).sample
    theirs.load_lora_weights(str(path))
    loaded = sum("lora_A" in n for n, _ in theirs.unet.named_parameters())
    assert loaded == len(state) // 2
    moved = theirs.unet(x, t, encoder_hidden_states=text, added_cond_kwargs=added).sample
    pipe.load_lora(pipe.unet, str(path))
    ours = pipe.unet(x, t, encoder_hidden_states=text, added_cond_kwargs=added).sample
    assert (moved - base).abs().max() > 1e-3
    torch.testing.assert_close(moved, ours, rtol=1e-4, atol=1e-5)


def test_a_bigg_encoder_of_another_width_is_named(hub, tmp_path):
    from difftune.families.stable_diffusion_xl.pipeline import StableDiffusionXLPipeline
    from difftune.models import ModelConfig
    from support.stable_diffusion_xl import REPO, TinySDXLSpec, tiny_text_encoders
    from support.tokenizers import clip_tokenizer

    _, two = tiny_text_encoders(TinySDXLSpec(text_2_hidden=48), clip_tokenizer())
    two.save_pretrained(tmp_path / "te2")
    repo = hub / REPO
    configs = [ModelConfig(str(repo / "unet" / "diffusion_pytorch_model.safetensors")),
               ModelConfig(str(repo / "text_encoder" / "model.safetensors")),
               ModelConfig(str(tmp_path / "te2" / "model.safetensors")),
               ModelConfig(str(repo / "vae" / "diffusion_pytorch_model.safetensors"))]
    with pytest.raises(UserError, match="are 80 wide together and the unet .* cross-attends to 64-wide"):
        StableDiffusionXLPipeline.from_pretrained(torch_dtype=torch.float32, device="cpu", model_configs=configs)


def test_stage_1_caches_each_pictures_own_time_ids(hub, tmp_path):
    """Through the data set and stage 1 (the cache): a 48 x 40 picture trained at 32 x 32 is told its original
    size (40, 48) and its crop (3 px from the left after the cover resize to 38 x 32)."""
    import json

    from safetensors.torch import load_file

    from conftest import run_train
    from support import write_example_dataset
    from support.stable_diffusion_xl import sdxl_model_paths

    meta = write_example_dataset(tmp_path / "data", n=2, size=(48, 40))
    run_train("--task", "sft:data_process", "--dataset_base_path", tmp_path / "data", "--dataset_metadata_path", meta,
              "--model_paths", json.dumps(sdxl_model_paths(hub)), "--height", 32, "--width", 32,
              "--output_path", tmp_path / "cache", "--lora_base_model", "unet", "--lora_target_modules", "to_q",
              "--no_progress")
    ids = [v.tolist() for f in sorted((tmp_path / "cache").rglob("*.safetensors"))
           for k, v in load_file(str(f)).items() if k.endswith("/add_time_ids")]
    assert ids == [[40.0, 48.0, 0.0, 3.0, 32.0, 32.0]] * 2


def test_v_prediction_with_zero_terminal_snr_trains_and_samples_as_diffusers(hub, tmp_path):
    """--v_parameterization --zero_terminal_snr --min_snr_gamma: the velocity target, the rescaled schedule (the last
    step pure noise, weighed 0 by min-SNR), and sampling equal to diffusers' pipeline with the same DDIM schedule."""
    import json

    from diffusers import DDIMScheduler, DDPMScheduler

    from conftest import run_train
    from difftune.core.features import RunContext
    from difftune.core.latents import seeded_noise
    from difftune.families.stable_diffusion_xl import FAMILY, SDXLOptions
    from difftune.families.stable_diffusion_xl.pipeline import StableDiffusionXLZeroTerminalSNRPipeline as ZT
    from support import write_example_dataset
    from support.stable_diffusion_xl import REPO, load_tiny_sdxl, sdxl_model_paths

    options = SDXLOptions(v_parameterization=True, zero_terminal_snr=True)
    assert FAMILY.pipeline_for(RunContext(options=options)) is ZT
    with pytest.raises(UserError, match="--zero_terminal_snr needs --v_parameterization"):
        SDXLOptions(zero_terminal_snr=True)

    scheduler = ZT.default_scheduler()
    ddpm = DDPMScheduler.from_pretrained(hub / REPO / "scheduler", rescale_betas_zero_snr=True,
                                         prediction_type="v_prediction")
    torch.testing.assert_close(scheduler.train.alphas_cumprod, ddpm.alphas_cumprod)
    assert float(scheduler.train.alphas_cumprod[-1]) < 1e-6  # the last step: pure noise
    x0, noise, t = torch.randn(1, 4, 4, 4), torch.randn(1, 4, 4, 4), torch.tensor([999])
    torch.testing.assert_close(scheduler.training_target(x0, noise, t), ddpm.get_velocity(x0, noise, t))
    scheduler.set_training(min_snr_gamma=5.0)
    assert float(scheduler.loss_weight(t)[0]) == 0.0  # v: min(SNR, 5) / (SNR + 1) at SNR 0

    meta = write_example_dataset(tmp_path / "data", n=2, size=(32, 32))
    run_train("--dataset_base_path", tmp_path / "data", "--dataset_metadata_path", meta, "--height", 32, "--width", 32,
              "--model_paths", json.dumps(sdxl_model_paths(hub)), "--lora_base_model", "unet",
              "--lora_target_modules", "to_q", "--lora_rank", 2, "--max_steps", 2, "--no_progress",
              "--v_parameterization", "--zero_terminal_snr", "--min_snr_gamma", 5, "--output_path", tmp_path / "out")
    assert sorted((tmp_path / "out").glob("*.safetensors"))

    pipe = load_tiny_sdxl(hub)
    ours = ZT(device="cpu", torch_dtype=torch.float32)
    for name in ("unet", "text_encoder", "text_encoder_2", "vae", "tokenizer", "tokenizer_2"):
        setattr(ours, name, getattr(pipe, name))
    ours.spec = pipe.spec
    image = ours("a red circle", height=32, width=32, seed=2, num_inference_steps=4, cfg_scale=5.0)
    theirs = _diffusers_pipe(hub)
    theirs.scheduler = DDIMScheduler.from_config(theirs.scheduler.config, rescale_betas_zero_snr=True,
                                                 timestep_spacing="trailing", prediction_type="v_prediction")
    want = theirs("a red circle", height=32, width=32, num_inference_steps=4, guidance_scale=5.0,
                  latents=seeded_noise((4, 4, 4), 2, 1, device="cpu"), output_type="np").images[0]
    assert np.abs(np.asarray(image, dtype=np.float64) / 255 - want).max() <= 1.5 / 255
