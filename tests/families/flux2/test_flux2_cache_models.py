"""A cache records the models its values came from (the manifest's `models`), and stage 2 checks its DiT against
them: a cache of FLUX.2-dev's stage 1 does not train klein's DiT."""

from __future__ import annotations

import pytest

from difftune.errors import UserError
from support.flux2 import DEV, write_tiny_flux2_hub


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    return write_tiny_flux2_hub(tmp_path_factory.mktemp("flux2_cache_hub"), dev=True)


def _one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


def test_a_cache_of_devs_stage_1_does_not_train_klein(hub, tmp_path):
    """Stage 1 with FLUX.2-dev's Mistral-3 and VAE, stage 2 with klein's DiT: one family, so the cache's family
    check passed and klein trained on Mistral prompts. The manifest records each stage-1 model (its class, config
    and the values it made), and stage 2 checks its DiT against them."""
    import json

    from conftest import run_train, setup_run
    from difftune.cache import CacheManifest
    from support import write_example_dataset
    from support.flux2 import dev_model_paths, klein_model_paths

    meta = write_example_dataset(tmp_path / "data", n=2, size=(32, 32))
    common = ["--family", "flux2", "--lora_base_model", "dit", "--lora_target_modules", "to_q", "--max_pixels", 1024,
              "--torch_dtype", "float32", "--no_progress", "--enable_tensorboard_log", "false"]
    run_train("--task", "sft:data_process", "--dataset_base_path", tmp_path / "data", "--dataset_metadata_path", meta,
              "--model_paths", json.dumps(dev_model_paths(hub)[1:]), "--tokenizer_path", hub / DEV / "tokenizer",
              "--output_path", tmp_path / "cache", *common)
    manifest = CacheManifest.load(tmp_path / "cache")
    assert manifest.models["text_encoder"]["class"] == "MistralModel"
    assert "prompt_embeds" in manifest.models["text_encoder"]["values"]
    assert manifest.models["vae"]["class"] == "AutoencoderKLFlux2"
    klein_dit = klein_model_paths(hub)[0]
    with pytest.raises(UserError) as err:
        setup_run("--task", "sft:train", "--dataset_base_path", tmp_path / "cache", "--model_paths",
                  json.dumps([klein_dit]), "--output_path", tmp_path / "two", *common)
    text = _one_line(err)
    assert "MistralModel" in text and str(tmp_path / "cache") in text and "dit" in text
    # dev's own DiT trains from it
    setup_run("--task", "sft:train", "--dataset_base_path", tmp_path / "cache", "--model_paths",
              json.dumps(dev_model_paths(hub)[:1]), "--output_path", tmp_path / "two", *common)
