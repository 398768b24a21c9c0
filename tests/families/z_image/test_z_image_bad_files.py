"""A bad `ip-adapter.bin` among the weights (garbage bytes, or another model's tensors: a SigLIP whose patch embedding
is a convolution, as FLUX.1-Redux's or an IP-Adapter's image tower) ended in `ValueError: too many values to unpack`
inside Z-Image's SigLIP2 recognition, which reads a Linear patch embedding's two sizes; now one line naming the
file."""

from __future__ import annotations

import os

import pytest
import torch

from difftune.core.family import recognise
from difftune.errors import UserError
from difftune.models import ModelConfig


def _files(tmp_path):
    garbage = tmp_path / "garbage" / "ip-adapter.bin"
    garbage.parent.mkdir()
    garbage.write_bytes(os.urandom(4096))
    conv = tmp_path / "conv" / "ip-adapter.bin"
    conv.parent.mkdir()
    torch.save({"embeddings.patch_embedding.weight": torch.zeros(8, 3, 2, 2), "post_layernorm.weight": torch.zeros(8),
                "embeddings.position_embedding.weight": torch.zeros(4, 8)}, conv)
    lone = tmp_path / "lone" / "ip-adapter.bin"
    lone.parent.mkdir()
    torch.save({"embeddings.patch_embedding.weight": torch.zeros(8), "post_layernorm.weight": torch.zeros(8)}, lone)
    return garbage, conv, lone


@pytest.mark.parametrize("family", [None, "z_image"])
def test_a_bad_ip_adapter_file_is_named(tmp_path, family):
    for path in _files(tmp_path):
        with pytest.raises(UserError) as err:
            recognise([ModelConfig(str(path))], family, log=lambda *a: None)
        text = str(err.value)
        assert "\n" not in text and text.startswith(str(path)), text
