"""AttriCtrl: the released value controller is recognised by its own names and computes the reference's formula."""

import math
from types import SimpleNamespace

import pytest
import torch

from difftune.errors import UserError
from difftune.families.flux.value_control import (ATTRICTRL_CONFIG, VALUE_CONTROLLER, FluxValueControlEmbedder,
                                                  FluxValueEncoder, extend_prompt)
from support.flux.value_control import write_tiny_value_controller
from difftune.models.detect import match_header, read_header


def test_released_file_recognised(tmp_path):
    path = write_tiny_value_controller(tmp_path)
    assert path.name == "brightness.safetensors" and path.parent.name == "models"
    header = read_header(path)
    assert "positional_embedding" in header  # the release's names
    match = match_header(header, [VALUE_CONTROLLER])
    assert match.config == {"_class_name": "FluxMultiValueEncoder", "dim_in": 16, "dim_out": 32, "prefer_len": 4}
    # the slot keeps it at encoders.0 (the reference's `pipe.value_controller.encoders.0.`)
    sig = VALUE_CONTROLLER.signature(ATTRICTRL_CONFIG)
    assert sig == {"encoders.0.prefer_value_embedder.0.weight": (4096, 256),
                   "encoders.0.prefer_value_embedder.0.bias": (4096,),
                   "encoders.0.prefer_value_embedder.2.weight": (4096, 4096),
                   "encoders.0.prefer_value_embedder.2.bias": (4096,), "encoders.0.positional_embedding": (32, 4096)}
    assert match_header({"encoders.0." + k: s for k, s in header.items()}, [VALUE_CONTROLLER]).config == match.config


def _reference(model, value):
    # the reference's SingleValueEncoder step by step: value * 1000 as a flipped sinusoidal timestep (half = dim/2,
    # exponent -ln(1e4) * i / half), MLP, repeated prefer_len times + positional embedding
    sd = model.state_dict()
    half = model.config.dim_in // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
    args = value * 1000 * freqs
    emb = torch.cat([torch.cos(args), torch.sin(args)])
    h = emb @ sd["prefer_value_embedder.0.weight"].T + sd["prefer_value_embedder.0.bias"]
    h = torch.nn.functional.silu(h) @ sd["prefer_value_embedder.2.weight"].T + sd["prefer_value_embedder.2.bias"]
    return h[None].expand(model.config.prefer_len, -1) + sd["positional_embedding"]


def test_encoder_is_the_reference_formula():
    torch.manual_seed(0)
    model = FluxValueEncoder(dim_in=16, dim_out=8, prefer_len=3)
    with torch.no_grad():
        out = model(torch.tensor([0.3, 0.8]))
    assert out.shape == (2, 3, 8)
    torch.testing.assert_close(out[0], _reference(model, 0.3), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1], _reference(model, 0.8), atol=1e-5, rtol=1e-5)


def test_unit_reads_csv_text_and_refuses_non_numbers():
    torch.manual_seed(0)
    model = FluxValueEncoder(dim_in=16, dim_out=8, prefer_len=3)
    pipe = SimpleNamespace(value_controller=model, device="cpu", torch_dtype=torch.float32)
    unit = FluxValueControlEmbedder()
    with torch.no_grad():
        one = unit.process(pipe, "0.3", 1)["value_embeds"]
        batch = unit.process(pipe, ["0.3", 0.8], 2)["value_embeds"]
        torch.testing.assert_close(one[0], _reference(model, 0.3), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(batch[1], _reference(model, 0.8), atol=1e-5, rtol=1e-5)
    assert unit.process(pipe, None, 1) == {}
    with pytest.raises(UserError, match="value_controller_inputs: expected a number"):
        unit.process(pipe, "bright", 1)


def test_value_tokens_follow_the_prompt_tokens():
    prompt, value = torch.randn(2, 5, 8), torch.randn(2, 3, 8)
    out = extend_prompt(prompt, value, None)
    assert out.shape == (2, 8, 8) and torch.equal(out[:, :5], prompt) and torch.equal(out[:, 5:], value)
    assert extend_prompt(prompt) is prompt
