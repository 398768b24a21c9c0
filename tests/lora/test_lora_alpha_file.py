"""A LoRA file whose alpha is negative, absurd or not finite (a .alpha tensor, diffusers' adapter metadata or
difftune's trained alpha) is refused naming the file and the module, as `--lora_alpha -4` is: it trained and saved
-4 before, and 1e30 failed later as 'non-finite loss' without naming the file."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from difftune.errors import UserError
from difftune.lora.formats import ADAPTER_METADATA_KEY, load_lora_file, save_lora


def _comfyui(path, alpha):
    g = torch.Generator().manual_seed(0)
    save_file({"diffusion_model.blocks.0.to_q.lora_A.weight": torch.randn(4, 8, generator=g),
               "diffusion_model.blocks.0.to_q.lora_B.weight": torch.randn(8, 4, generator=g),
               "diffusion_model.blocks.0.to_q.alpha": torch.tensor(float(alpha))}, str(path))
    return path


@pytest.mark.parametrize("alpha", [-4.0, 0.0, 1e30])
def test_an_alpha_tensor_out_of_range_is_refused(tmp_path, alpha):
    path = _comfyui(tmp_path / "lora.safetensors", alpha)
    with pytest.raises(UserError) as err:
        load_lora_file(path)
    text = str(err.value)
    assert "\n" not in text and text.startswith(str(path)) and "blocks.0.to_q" in text and f"{alpha:g}" in text


def test_a_sane_alpha_loads(tmp_path):
    lora = load_lora_file(_comfyui(tmp_path / "lora.safetensors", 2.0))
    assert list(lora.alphas.values())[0]["blocks.0.to_q"] == 2.0


@pytest.mark.parametrize("alpha", [-4, 1e30, float("nan")])
def test_an_alpha_in_the_metadata_out_of_range_is_refused(tmp_path, alpha):
    g = torch.Generator().manual_seed(0)
    path = tmp_path / "lora.safetensors"
    meta = {ADAPTER_METADATA_KEY: json.dumps({"transformer.r": 4, "transformer.lora_alpha": alpha,
                                              "transformer.target_modules": ["to_q"]})}
    save_file({"transformer.blocks.0.to_q.lora_A.weight": torch.randn(4, 8, generator=g),
               "transformer.blocks.0.to_q.lora_B.weight": torch.randn(8, 4, generator=g)}, str(path), metadata=meta)
    with pytest.raises(UserError) as err:
        load_lora_file(path)
    text = str(err.value)
    assert text.startswith(str(path)) and "alpha" in text and "blocks.0.to_q" in text


@pytest.mark.parametrize("alpha", [-4.0, 1e30])
def test_difftunes_own_file_with_a_trained_alpha_out_of_range_is_refused(tmp_path, alpha):
    """A file saved with alpha -4 or 1e30 (written before --lora_alpha was checked) does not continue training."""
    g = torch.Generator().manual_seed(0)
    sd = {"blocks.0.to_q.lora_A.weight": torch.randn(4, 8, generator=g),
          "blocks.0.to_q.lora_B.weight": torch.randn(8, 4, generator=g)}
    path = tmp_path / "lora.safetensors"
    save_lora(path, {"transformer": sd}, {"transformer": (4, alpha, ["to_q"])})
    with pytest.raises(UserError) as err:
        load_lora_file(path)
    assert str(path) in str(err.value) and f"{alpha:g}" in str(err.value)
