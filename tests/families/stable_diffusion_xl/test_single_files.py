"""Single-file community checkpoints (the original LDM / SGM layout: Illustrious, Pony, NoobAI, the SD 1.5 fine-tunes)
through diffusers' own converters, offline, with the configs difftune ships: at the real sizes from the header alone,
each family takes its own file's UNet, autoencoder and text encoders and nothing of the other's; a tiny SDXL single
file (its configs added to the known ones, as the official ones are) trains and samples as its diffusers folders."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from difftune.models.detect import match_header


def _meta_state(cls, config, library="diffusers"):
    if library == "diffusers":
        with torch.device("meta"):
            return cls.from_config(config).state_dict()
    import transformers

    cfg = transformers.CLIPTextConfig.from_dict(dict(config))
    with torch.device("meta"):
        return cls(cfg).state_dict()


def _sd15_header() -> dict:
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel

    from difftune.families.stable_diffusion.components import SD15_UNET_CONFIG
    from difftune.parts.clip import CLIP_L_TEXT_CONFIG
    from difftune.parts.ldm import KL_F8_VAE_CONFIG
    from support.ldm_files import ldm_clip, ldm_unet, ldm_vae

    state = {**ldm_unet(_meta_state(UNet2DConditionModel, SD15_UNET_CONFIG)),
             **ldm_vae(_meta_state(AutoencoderKL, KL_F8_VAE_CONFIG)),
             **ldm_clip(_meta_state(CLIPTextModel, CLIP_L_TEXT_CONFIG, "transformers"), "cond_stage_model.transformer."),
             "cond_stage_model.transformer.text_model.embeddings.position_ids": torch.empty(1, 77, device="meta")}
    return {k: tuple(v.shape) for k, v in state.items()}


def _sdxl_header() -> dict:
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    from difftune.families.stable_diffusion_xl.components import SDXL_UNET_CONFIG
    from difftune.parts.clip import CLIP_BIGG_TEXT_CONFIG, CLIP_L_TEXT_CONFIG
    from difftune.parts.ldm import KL_F8_XL_VAE_CONFIG
    from support.ldm_files import ldm_clip, ldm_unet, ldm_vae, open_clip

    state = {**ldm_unet(_meta_state(UNet2DConditionModel, SDXL_UNET_CONFIG)),
             **ldm_vae(_meta_state(AutoencoderKL, KL_F8_XL_VAE_CONFIG)),
             **ldm_clip(_meta_state(CLIPTextModel, CLIP_L_TEXT_CONFIG, "transformers"),
                        "conditioner.embedders.0.transformer."),
             **open_clip(_meta_state(CLIPTextModelWithProjection, CLIP_BIGG_TEXT_CONFIG, "transformers"))}
    return {k: tuple(v.shape) for k, v in state.items()}


def _found(family: str, header: dict) -> dict[str, str]:
    """slot -> the known config its part of the file matched, as recognition's main and companion passes find."""
    import importlib

    specs = importlib.import_module(f"difftune.families.{family}.components").COMPONENTS
    found = {}
    main = match_header(header, [s for s in specs if not s.companion])
    if main is not None:
        found[main.spec.name] = main.label
    for spec in (s for s in specs if s.companion):
        match = match_header(header, [spec])
        if match is not None:
            found[spec.name] = match.label
    return found


def test_an_sd15_single_file_at_the_real_size_is_sd15s_and_not_sdxls():
    header = _sd15_header()
    assert _found("stable_diffusion", header) == {
        "unet": "stable-diffusion-v1-5 unet", "vae": "stable-diffusion-v1-5 vae (KL-f8)",
        "text_encoder": "CLIP ViT-L/14 text model"}
    assert _found("stable_diffusion_xl", header) == {}


def test_an_sdxl_single_file_at_the_real_size_is_sdxls_and_not_sd15s():
    header = _sdxl_header()
    assert _found("stable_diffusion_xl", header) == {
        "unet": "stable-diffusion-xl-base-1.0 unet", "vae": "stable-diffusion-xl-base-1.0 vae (KL-f8)",
        "text_encoder": "CLIP ViT-L/14 text model", "text_encoder_2": "OpenCLIP ViT-bigG/14 text model"}
    assert _found("stable_diffusion", header) == {}


@pytest.fixture
def tiny_single_file(tmp_path, monkeypatch):
    """The tiny SDXL as one SGM-layout file; its configs known as the official ones are."""
    from safetensors.torch import load_file, save_file

    from difftune.families.stable_diffusion_xl import components as c
    from support.ldm_files import ldm_clip, ldm_unet, ldm_vae, open_clip
    from support.stable_diffusion_xl import REPO, write_tiny_sdxl_hub

    hub = write_tiny_sdxl_hub(tmp_path / "hub")
    repo = hub / REPO
    parts = {name: load_file(str(next((repo / name).glob("*.safetensors"))))
             for name in ("unet", "vae", "text_encoder", "text_encoder_2")}
    state = {**ldm_unet(parts["unet"]), **ldm_vae(parts["vae"]),
             **ldm_clip(parts["text_encoder"], c.CLIP_PREFIX), **open_clip(parts["text_encoder_2"])}
    path = tmp_path / "tiny-sdxl-finetune.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    for spec, folder in ((c.UNET_SINGLE_FILE, "unet"), (c.VAE_SINGLE_FILE, "vae"),
                         (c.TEXT_ENCODER_SINGLE_FILE, "text_encoder"), (c.TEXT_ENCODER_2_SINGLE_FILE, "text_encoder_2")):
        monkeypatch.setitem(spec.known_configs, "tiny", json.loads((repo / folder / "config.json").read_text()))
    return hub, path


def test_a_tiny_sdxl_single_file_trains_and_samples_as_its_folders(tiny_single_file, tmp_path):
    from conftest import run_train
    from difftune.families.stable_diffusion_xl.pipeline import StableDiffusionXLPipeline
    from difftune.models import ModelConfig
    from support import write_example_dataset
    from support.stable_diffusion_xl import REPO, load_tiny_sdxl

    hub, path = tiny_single_file
    repo = hub / REPO
    pipe = StableDiffusionXLPipeline.from_pretrained(
        torch_dtype=torch.float32, device="cpu", model_configs=[ModelConfig(str(path))],
        tokenizer_config=ModelConfig(str(repo / "tokenizer")), tokenizer_2_config=ModelConfig(str(repo / "tokenizer_2")))
    folders = load_tiny_sdxl(hub)
    for slot in ("unet", "vae", "text_encoder", "text_encoder_2"):
        ours, theirs = getattr(pipe, slot).state_dict(), getattr(folders, slot).state_dict()
        assert ours.keys() == theirs.keys(), slot
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), slot
    kw = dict(height=32, width=32, seed=1, num_inference_steps=2)
    assert np.array_equal(np.asarray(pipe("a cat", **kw)), np.asarray(folders("a cat", **kw)))

    meta = write_example_dataset(tmp_path / "data", n=2, size=(32, 32))
    run_train("--dataset_base_path", tmp_path / "data", "--dataset_metadata_path", meta, "--height", 32, "--width", 32,
              "--model_paths", json.dumps([str(path)]), "--tokenizer_path", repo / "tokenizer",
              "--tokenizer_2_path", repo / "tokenizer_2", "--lora_base_model", "unet", "--lora_target_modules",
              "to_q", "--lora_rank", 2, "--max_steps", 1, "--no_progress", "--output_path", tmp_path / "out")
    assert sorted((tmp_path / "out").glob("*.safetensors"))
