"""Parts of one FLUX.2 run that do not fit each other are refused in one line naming what does not fit: a tokenizer
that is not its text encoder's (klein's Qwen3 given FLUX.2-dev's Mistral tokenizer, by the family's default or by
--tokenizer_path, and the reverse), a tokenizer folder without tokenizer.json (a tokenizer that encodes every prompt
to nothing), a text encoder of another family or size for the DiT, a DiT file with a tensor missing."""

from __future__ import annotations

import shutil

import pytest

from difftune.errors import UserError
from difftune.families.flux2.pipeline import Flux2Pipeline
from difftune.models import ModelConfig
from support.flux2 import DEV, KLEIN_4B, KLEIN_9B, hub_entry, hub_paths, write_tiny_flux2_hub


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    return write_tiny_flux2_hub(tmp_path_factory.mktemp("flux2_fit_hub"), dev=True)


def _configs(hub, dit=KLEIN_4B, encoder=KLEIN_4B, vae=KLEIN_4B):
    return [ModelConfig(hub_entry(hub, dit, "transformer")), ModelConfig(hub_entry(hub, encoder, "text_encoder")),
            ModelConfig(hub_entry(hub, vae, "vae"))]


def _load(configs, tokenizer=None):
    return Flux2Pipeline.from_pretrained(torch_dtype="float32", model_configs=configs,
                                         tokenizer_config=None if tokenizer is None else ModelConfig(str(tokenizer)))


def _one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


def test_klein_with_its_own_tokenizer_loads(hub):
    pipe = _load(_configs(hub), hub / KLEIN_4B / "tokenizer")
    assert len(pipe.tokenizer("a cat").input_ids) > 0


def test_klein_without_tokenizer_folder_refuses_the_dev_default(hub, tmp_path, monkeypatch):
    """No tokenizer/ beside klein's text encoder: the family's default is FLUX.2-dev's Mistral tokenizer, which
    klein's Qwen3 cannot read (it loaded and trained before)."""
    monkeypatch.setenv("DIFFTUNE_MODEL_BASE_PATH", str(hub))
    away = tmp_path / "klein" / "text_encoder"
    away.mkdir(parents=True)
    for path in hub_paths(hub, KLEIN_4B, "text_encoder", "*"):
        shutil.copy(path, away)
    files = sorted(str(p) for p in away.glob("*.safetensors"))
    configs = _configs(hub)
    configs[1] = ModelConfig(files if len(files) > 1 else files[0])
    with pytest.raises(UserError) as err:
        _load(configs)
    text = _one_line(err)
    assert "FLUX.2-dev" in text and "--tokenizer_path" in text and "text_encoder" in text
    assert "<|im_end|>" in text


@pytest.mark.parametrize("dit,tokenizer_repo", [(KLEIN_4B, DEV), (DEV, KLEIN_4B)])
def test_another_familys_tokenizer_is_refused(hub, dit, tokenizer_repo):
    """--tokenizer_path of the other text encoder's tokenizer: klein's Qwen3 with the Mistral tokenizer (no Qwen
    chat tokens), dev's Mistral with klein's Qwen tokenizer (261 tokens for a 260-row embedding)."""
    configs = _configs(hub, dit, dit, dit)
    with pytest.raises(UserError) as err:
        _load(configs, hub / tokenizer_repo / "tokenizer")
    text = _one_line(err)
    assert str(hub / tokenizer_repo / "tokenizer") in text and "does not fit" in text
    if dit == DEV:
        assert "261" in text and "260" in text


def test_a_tokenizer_folder_without_tokenizer_json_is_refused(hub, tmp_path):
    """Without tokenizer.json transformers builds a 5-token tokenizer from tokenizer_config.json alone that encodes
    every prompt to no tokens: refused, naming the folder."""
    folder = tmp_path / "tokenizer"
    shutil.copytree(hub / KLEIN_4B / "tokenizer", folder)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(UserError) as err:
        _load(_configs(hub), folder)
    text = _one_line(err)
    assert str(folder) in text and "no tokens" in text


@pytest.mark.parametrize("dit,encoder,words", [
    (KLEIN_4B, KLEIN_9B, ("48", "144", "96", "joint_attention_dim")),  # the 9B's Qwen3-8B on the 4B's DiT
    (KLEIN_4B, DEV, ("MistralModel", "Qwen3Model", "guidance")),  # dev's Mistral-3 on klein (it ran before)
    (DEV, KLEIN_4B, ("Qwen3Model", "MistralModel", "guidance")),  # klein's Qwen3 on dev (it ran before)
])
def test_a_text_encoder_of_another_model_is_refused(hub, dit, encoder, words):
    """The DiT reads three of the text encoder's hidden states stacked (3 x its width): another size's encoder was a
    shape traceback inside the DiT, another family's (same tiny widths) ran and trained on the wrong encoder."""
    with pytest.raises(UserError) as err:
        _load(_configs(hub, dit, encoder, dit), hub / encoder / "tokenizer")
    text = _one_line(err)
    assert "text_encoder" in text and "dit" in text
    for word in words:
        assert word in text, (word, text)


def test_a_dit_file_with_a_tensor_missing_names_it(hub, tmp_path):
    """BFL's single file without one tensor: a KeyError traceback from reading the sizes before, now the tensor."""
    from safetensors.torch import load_file, save_file

    from support.flux2 import write_bfl_single_file

    state = load_file(str(write_bfl_single_file(hub, KLEIN_4B, tmp_path / "full.safetensors")))
    for key, name in (("model.diffusion_model.txt_in.weight", "context_embedder.weight"),
                      ("model.diffusion_model.double_blocks.0.img_attn.norm.key_norm.scale",
                       "transformer_blocks.0.attn.norm_k.weight")):
        cut = {k: v for k, v in state.items() if k != key}
        path = tmp_path / "cut.safetensors"
        save_file(cut, str(path))
        configs = _configs(hub)
        configs[0] = ModelConfig(str(path))
        with pytest.raises(UserError) as err:
            _load(configs, hub / KLEIN_4B / "tokenizer")
        text = _one_line(err)
        assert str(path) in text and name in text and "missing" in text, text

