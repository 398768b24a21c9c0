"""LoRA-Encoder: the released encoder is recognised by its own names and computes the reference's formula; LoRA
files reach it in the reference's fused layout."""

import math
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from difftune.errors import UserError
from difftune.families.flux.lora_encoder import (LORA_ENCODER, LORA_ENCODER_CONFIG, FluxLoRAEncoder,
                                                 FluxLoRAEncoderEmbedder, FluxLoRAEncoderInputs, lora_encoder_key,
                                                 lora_layers, read_lora_for_encoder, reference_lora)
from support.flux.lora_encoder import write_reference_named_lora, write_tiny_lora_encoder
from difftune.models.detect import match_header, read_header


def test_released_file_recognised_and_loads_by_its_names(tmp_path):
    path = write_tiny_lora_encoder(tmp_path)
    header = read_header(path)
    assert "encoders.0.attn.to_q.weight" in header and "encoders.0.fc1.weight" in header  # the release's names
    match = match_header(header, [LORA_ENCODER])
    assert match.config["dit_width"] == 64 and match.config["num_double_blocks"] == 1
    assert match.config["num_single_blocks"] == 1 and match.config["embed_dim"] == 32
    model = FluxLoRAEncoder.from_config(match.config)
    missing, unexpected = model.load_state_dict({lora_encoder_key(k): v for k, v in load_file(path).items()})
    assert not missing and not unexpected
    # the release's config: 19 + 38 blocks of FLUX.1-dev, 16 probes, one CLIP layer of 4096 (32 heads)
    sig = LORA_ENCODER.signature(LORA_ENCODER_CONFIG)
    assert sig["embedder.model_dict.blocks___18___attn___a_to_qkv.x"] == (1, 16, 3072)
    assert sig["embedder.model_dict.single_blocks___37___proj_out.x"] == (1, 16, 15360)
    assert sig["embedder.proj_dict.to_qkv_mlp.weight"] == (4096, 21504)
    assert sig["encoders.0.mlp.fc1.weight"] == (8192, 4096) and sig["special_embeds"] == (1, 1, 4096)


def _ln(x, sd, name):
    return torch.nn.functional.layer_norm(x, x.shape[-1:], sd[f"{name}.weight"], sd[f"{name}.bias"], 1e-5)


def _reference(sd, lora, width, heads):
    # the reference's FluxLoRAEncoder step by step, on the release's names
    tokens = []
    for name, kind, _, _ in lora_layers(width, 1, 1):
        key = name.replace(".", "___")
        x = sd[f"embedder.model_dict.{key}.x"] @ lora[f"{name}.lora_A.weight"].T @ lora[f"{name}.lora_B.weight"].T
        x = _ln(x, sd, f"embedder.model_dict.{key}.layer_norm")
        p = kind.replace(".", "___")
        tokens.append(x @ sd[f"embedder.proj_dict.{p}.weight"].T + sd[f"embedder.proj_dict.{p}.bias"])
    h = torch.cat([sd["special_embeds"]] + tokens, dim=1)
    n, d = h.shape[1], h.shape[2]
    x = _ln(h, sd, "encoders.0.layer_norm1")
    q, k, v = (x @ sd[f"encoders.0.attn.to_{c}.weight"].T + sd[f"encoders.0.attn.to_{c}.bias"] for c in "qkv")
    q, k, v = (t.view(1, n, heads, d // heads).transpose(1, 2) for t in (q, k, v))
    att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // heads), dim=-1) @ v
    att = att.transpose(1, 2).reshape(1, n, d) @ sd["encoders.0.attn.to_out.weight"].T + sd["encoders.0.attn.to_out.bias"]
    h = h + att
    x = _ln(h, sd, "encoders.0.layer_norm2") @ sd["encoders.0.fc1.weight"].T + sd["encoders.0.fc1.bias"]
    x = x * torch.sigmoid(1.702 * x)
    h = h + x @ sd["encoders.0.fc2.weight"].T + sd["encoders.0.fc2.bias"]
    out = _ln(h[:, :1], sd, "final_layer_norm")
    return out @ sd["final_linear.weight"].T + sd["final_linear.bias"]


def _tokens(model, loras, scale):
    pipe = SimpleNamespace(lora_encoder=model, torch_dtype=torch.float32)
    out = FluxLoRAEncoderEmbedder().process(pipe, [loras], scale)
    assert out["negative_lora_encoder_embeds"] is None  # the reference adds them to the positive prompt only
    return out["lora_encoder_embeds"]


def test_encoder_is_the_reference_formula(tmp_path):
    path = write_tiny_lora_encoder(tmp_path)
    sd = load_file(path)
    match = match_header(read_header(path), [LORA_ENCODER])
    model = FluxLoRAEncoder.from_config(match.config)
    model.load_state_dict({lora_encoder_key(k): v for k, v in sd.items()})
    lora = read_lora_for_encoder(str(write_reference_named_lora(tmp_path / "a.safetensors")))
    with torch.no_grad():
        out = model.eval()(lora)
    assert out.shape == (1, 1, 32)
    torch.testing.assert_close(out, _reference(sd, lora, 64, 2), atol=1e-4, rtol=1e-4)
    # another LoRA gives other tokens; the scale multiplies them
    other = read_lora_for_encoder(str(write_reference_named_lora(tmp_path / "b.safetensors", seed=1)))
    with torch.no_grad():
        two = _tokens(model, [lora, other], 0.5)
    assert two.shape == (1, 2, 32)
    torch.testing.assert_close(two[:, :1], out * 0.5)
    assert not torch.allclose(two[:, :1], two[:, 1:])


def test_diffusers_lora_is_fused_as_the_reference_fuses_it():
    g = torch.Generator().manual_seed(0)
    w, r = 8, 2

    def ad(o, i, scale=1.0):
        return (torch.randn(r, i, generator=g), torch.randn(o, r, generator=g), scale)

    adapters = {f"transformer_blocks.0.attn.to_{c}": ad(w, w, 0.5) for c in "qkv"}
    adapters.update({f"single_transformer_blocks.0.attn.to_{c}": ad(w, w) for c in "qkv"})
    adapters["single_transformer_blocks.0.proj_out"] = ad(w, 5 * w, 2.0)
    adapters["x_embedder"] = ad(w, 4)  # not read by the encoder
    fused = reference_lora(adapters, w)
    assert set(fused) == {f"{n}.lora_{x}.weight" for n in ("blocks.0.attn.a_to_qkv", "single_blocks.0.to_qkv_mlp",
                                                            "single_blocks.0.proj_out") for x in "AB"}
    delta = fused["blocks.0.attn.a_to_qkv.lora_B.weight"] @ fused["blocks.0.attn.a_to_qkv.lora_A.weight"]
    parts = [adapters[f"transformer_blocks.0.attn.to_{c}"] for c in "qkv"]
    torch.testing.assert_close(delta, torch.cat([s * b @ a for a, b, s in parts]))
    # the single block's MLP part is absent: zero rows (4 widths) in the fused up
    single = fused["single_blocks.0.to_qkv_mlp.lora_B.weight"] @ fused["single_blocks.0.to_qkv_mlp.lora_A.weight"]
    assert single.shape == (7 * w, w) and not single[3 * w:].any()
    a, b, s = adapters["single_transformer_blocks.0.proj_out"]
    torch.testing.assert_close(fused["single_blocks.0.proj_out.lora_B.weight"] @ fused["single_blocks.0.proj_out.lora_A.weight"], s * b @ a)


def test_unit_reads_paths_and_refuses_a_partial_lora(tmp_path):
    path = write_reference_named_lora(tmp_path / "a.safetensors")
    out = FluxLoRAEncoderInputs().process(None, str(path), 1)
    assert len(out["lora_encoder_loras"]) == 1 and len(out["lora_encoder_loras"][0]) == 1  # one sample, one LoRA
    assert torch.equal(out["lora_encoder_loras"][0][0]["blocks.0.ff_a.0.lora_A.weight"],
                       load_file(path)["blocks.0.ff_a.0.lora_A.weight"])
    sd = load_file(path)
    sd.pop("blocks.0.ff_a.0.lora_A.weight")
    sd.pop("blocks.0.ff_a.0.lora_B.weight")
    save_file(sd, str(tmp_path / "partial.safetensors"))
    torch.manual_seed(0)
    model = FluxLoRAEncoder(dit_width=64, num_double_blocks=1, num_single_blocks=1, embed_dim=32,
                            intermediate_size=64, num_attention_heads=2, num_embeds_per_lora=4)
    partial = FluxLoRAEncoderInputs().process(None, str(tmp_path / "partial.safetensors"), 1)
    with pytest.raises(UserError, match="no blocks.0.ff_a.0"):
        _tokens(model, partial["lora_encoder_loras"][0], 2.0)
    with pytest.raises(UserError, match="lora_encoder_inputs: expected a LoRA file path"):
        FluxLoRAEncoderInputs().process(None, 3, 1)
    with pytest.raises(UserError, match="no such LoRA file"):
        FluxLoRAEncoderInputs().process(None, str(tmp_path / "absent.safetensors"), 1)


def test_diffusers_layout_file_is_read_at_its_alpha(tmp_path):
    from difftune.families.flux.lora_encoder import lora_layers

    g = torch.Generator().manual_seed(0)
    w, r = 64, 2
    sd = {}
    for c in "qkv":
        sd[f"transformer.transformer_blocks.0.attn.to_{c}.lora_A.weight"] = torch.randn(r, w, generator=g)
        sd[f"transformer.transformer_blocks.0.attn.to_{c}.lora_B.weight"] = torch.randn(w, r, generator=g)
        sd[f"transformer.transformer_blocks.0.attn.to_{c}.alpha"] = torch.tensor(1.0)
    save_file(sd, str(tmp_path / "d.safetensors"))
    fused = read_lora_for_encoder(str(tmp_path / "d.safetensors"))
    delta = fused["blocks.0.attn.a_to_qkv.lora_B.weight"] @ fused["blocks.0.attn.a_to_qkv.lora_A.weight"]
    expected = torch.cat([0.5 * sd[f"transformer.transformer_blocks.0.attn.to_{c}.lora_B.weight"]
                          @ sd[f"transformer.transformer_blocks.0.attn.to_{c}.lora_A.weight"] for c in "qkv"])
    torch.testing.assert_close(delta, expected)  # alpha 1 / rank 2, as the reference's sqrt(alpha / rank) on A and B
    assert set(n for n, *_ in lora_layers(w, 1, 0)) > {"blocks.0.attn.a_to_qkv"}
