"""Parts of one ERNIE-Image run that do not fit each other are refused in one line naming the text encoder's file,
before anything is loaded (`ErnieImagePipeline.check_models`): FLUX.2-dev's Mistral-Small text encoder (30 layers,
as wide as the tiny DiT reads: it trained without a word before), a Ministral-3 of another width than the DiT's
text_in_dim (a shape traceback inside the DiT before), one too shallow for the second-to-last hidden state."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from difftune.errors import UserError
from difftune.families.ernie_image.pipeline import ErnieImagePipeline
from difftune.models import ModelConfig
from support.ernie_image import REPO, write_tiny_ernie_image_hub
from support.ernie_image.tiny import TinyErnieImageSpec, tiny_text_encoder
from support.parts import mistral_tokenizer, write_mistral3_folder


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    return write_tiny_ernie_image_hub(tmp_path_factory.mktemp("ernie_fit_hub"), shard=False) / REPO


def _load(hub: Path, encoder: Path):
    configs = [ModelConfig(str(next((hub / "transformer").glob("*.safetensors")))), ModelConfig(str(encoder)),
               ModelConfig(str(next((hub / "vae").glob("*.safetensors"))))]
    return ErnieImagePipeline.from_pretrained(torch_dtype="float32", device="cpu", model_configs=configs,
                                              tokenizer_config=ModelConfig(str(hub / "tokenizer")))


def _refusal(hub, encoder) -> str:
    with pytest.raises(UserError) as err:
        _load(hub, encoder)
    text = str(err.value)
    assert "\n" not in text and "text_encoder" in text and str(encoder) in text, text
    return text


def test_its_own_text_encoder_loads(hub):
    pipe = _load(hub, hub / "text_encoder" / "model.safetensors")
    assert type(pipe.text_encoder).__name__ == "Ministral3Model"


def test_flux2_devs_mistral_text_encoder_is_refused(hub, tmp_path):
    from support.flux2.tiny import TinyFlux2Spec, dev_tokenizer, tiny_dev_text_encoder

    folder = write_mistral3_folder(tiny_dev_text_encoder(TinyFlux2Spec(), dev_tokenizer()), tmp_path / "dev_te")
    text = _refusal(hub, folder / "model.safetensors")
    assert "MistralModel" in text and "Ministral3Model" in text, text


@pytest.mark.parametrize("change,words", [
    ({"text_hidden": 48}, ("48", "32", "text_in_dim")),  # another width than the DiT reads
    ({"text_layers": 1}, ("1 layer", "second-to-last")),  # hidden_states[-2] would be the embeddings
])
def test_a_ministral3_that_does_not_fit_the_dit_is_refused(hub, tmp_path, change, words):
    spec = replace(TinyErnieImageSpec(), **change)
    folder = write_mistral3_folder(tiny_text_encoder(spec, mistral_tokenizer()), tmp_path / "te")
    text = _refusal(hub, folder / "model.safetensors")
    for word in words:
        assert word in text, (word, text)
