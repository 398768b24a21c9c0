"""Krea-2 and Ideogram-4 given each other's Qwen3-VL (tracebacks inside the DiT before), Krea-2 given the FLUX.2 VAE
(the Krea-2 DiT file was blamed before): one line naming the part that does not fit."""

from __future__ import annotations

import pytest

from difftune.errors import UserError
from difftune.models import ModelConfig
from support.flux2 import write_tiny_klein
from support.ideogram4.tiny import TOKENIZER_REPO, hub_paths, write_tiny_ideogram4_hub
from support.krea2.tiny import krea2_model_paths, write_tiny_krea2_hub


@pytest.fixture(scope="module")
def hubs(tmp_path_factory):
    root = tmp_path_factory.mktemp("krea2_fit")
    return (write_tiny_krea2_hub(root / "krea2", turbo=False), write_tiny_ideogram4_hub(root / "ideogram4"),
            write_tiny_klein(root / "klein", shard=False))


def _one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


def _refusal(pipeline, configs, ideo) -> str:
    """`pipeline.from_pretrained` on `configs` (Ideogram-4's tokenizer) refused in one line: its message."""
    with pytest.raises(UserError) as err:
        pipeline.from_pretrained(torch_dtype="float32", model_configs=configs,
                                 tokenizer_config=ModelConfig(str(ideo / TOKENIZER_REPO / "tokenizer")))
    return _one_line(err)


def test_krea2_with_ideogram4s_text_encoder(hubs):
    from difftune.families.krea2 import Krea2Pipeline

    krea, ideo, _ = hubs
    paths = krea2_model_paths(krea)
    text = _refusal(Krea2Pipeline, [ModelConfig(p) for p in (paths[0], hub_paths(ideo)[1], paths[2])], ideo)
    assert "text_encoder" in text and "16" in text and "32" in text and "text_hidden_dim" in text


def test_ideogram4_with_krea2s_text_encoder(hubs):
    from difftune.families.ideogram4.pipeline import Ideogram4Pipeline

    krea, ideo, _ = hubs
    paths = hub_paths(ideo)
    text = _refusal(Ideogram4Pipeline, [ModelConfig(p) for p in (paths[0], krea2_model_paths(krea)[1], paths[2])],
                    ideo)
    assert "text_encoder" in text and "416" in text and "208" in text and "llm_features_dim" in text


def test_a_training_run_refuses_the_mismatch_at_setup(hubs, tmp_path):
    """`difftune train` checks the parts before anything is loaded or written."""
    from conftest import setup_run

    krea, ideo, _ = hubs
    paths = krea2_model_paths(krea)
    with pytest.raises(UserError) as err:
        setup_run("--model_paths", f'["{paths[0]}", "{hub_paths(ideo)[1]}", "{paths[2]}"]',
                  "--dataset_base_path", tmp_path, "--output_path", tmp_path / "out")
    assert "text_hidden_dim" in _one_line(err)


def test_krea2_with_the_flux2_vae_blames_the_vae(hubs):
    """Without --family the recognition error came from the family that knows the VAE (Ideogram-4) and named the
    Krea-2 DiT file; the family of the DiT given speaks now, and names the VAE."""
    from difftune.core.family import recognise

    krea, _, klein = hubs
    paths = krea2_model_paths(krea)
    vae = str(klein / "vae" / "diffusion_pytorch_model.safetensors")
    with pytest.raises(UserError) as err:
        recognise([ModelConfig(p) for p in (paths[0], paths[1], vae)], log=lambda *a: None)
    text = _one_line(err)
    assert str(klein / "vae") in text and not text.startswith(paths[0]), text
    assert paths[1] not in text  # the text encoder fits: it is not named
