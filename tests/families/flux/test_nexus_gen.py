"""Nexus-Gen: edit_decoder.bin (a plain tensor state dict) holds the DiT in the reference's FluxDiT names and the
embedding merger; both are recognised from it, the DiT converts to diffusers' names exactly, and the merger
computes the reference's formula."""

import math

import torch

from difftune.families.flux.components import DIT_BFL
from difftune.families.flux.nexus_gen import (NEXUS_AR, NEXUS_DIT, NEXUS_MERGER, NexusGenEmbeddingMerger,
                                              convert_nexus_dit, convert_nexus_merger, editing_messages_text,
                                              editing_text_ids, nexus_ar_key)
from support.flux.flex2 import tiny_flux_transformer
from support.flux.nexus_gen import write_tiny_nexus_decoder
from difftune.models.detect import match_header


def _load(path):
    return torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)


def test_both_models_recognised_from_the_decoder_file(tmp_path):
    path = write_tiny_nexus_decoder(tmp_path)
    assert path.name == "edit_decoder.bin"
    shapes = {k: tuple(v.shape) for k, v in _load(path).items()}
    assert "pipe.dit.blocks.0.attn.a_to_qkv.weight" in shapes and "embedding_merger.projector.1.weight" in shapes
    assert match_header(shapes, [DIT_BFL]) is None
    dit = match_header(shapes, [DIT_BFL, NEXUS_DIT])
    assert dit.spec is NEXUS_DIT and dit.config["guidance_embeds"] and dit.config["in_channels"] == 64
    merger = match_header(shapes, [NEXUS_MERGER])
    assert merger.config["hidden_size"] == 32 and merger.config["num_attention_heads"] == 2
    assert merger.config["num_key_value_heads"] == 1 and merger.config["mrope_section"] == [2, 3, 3]
    # the release's merger: one Qwen2.5-VL-7B layer, projector to 4 x 4096 then 4096
    sig = NEXUS_MERGER.signature(NEXUS_MERGER.known_configs["DiffSynth-Studio/Nexus-GenV2 embedding merger"])
    assert sig["layers.0.self_attn.k_proj.weight"] == (512, 3584) and sig["projector.1.weight"] == (16384, 3584)


def test_dit_converts_to_the_diffusers_weights_exactly(tmp_path):
    path = write_tiny_nexus_decoder(tmp_path)
    converted = convert_nexus_dit(_load(path))
    expected = tiny_flux_transformer(seed=0).state_dict()
    assert set(converted) == set(expected)
    for k, v in expected.items():
        assert torch.equal(converted[k], v), k


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rot_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def _positions(grid):
    # the reference merger's positions: t * 2, rows and columns scaled by 72 / grid size (fractional)
    t, h, w = grid
    gh, gw = h // 2, w // 2
    rows = torch.arange(gh).view(-1, 1).expand(gh, gw).flatten() * (72 / h)
    cols = torch.arange(gw).view(1, -1).expand(gh, gw).flatten() * (72 / w)
    return torch.stack([torch.zeros(gh * gw), rows, cols])  # (3, n)


def _reference(sd, embeds, grid, ref, ref_grid, heads=2, kv=1, hd=16, section=(2, 3, 3)):
    pos = torch.cat([_positions(grid), _positions(ref_grid)], dim=-1)
    x = torch.cat([embeds, ref], dim=1)
    inv = 1.0 / (1e6 ** (torch.arange(0, hd, 2).float() / hd))
    freqs = pos[..., None] * inv  # (3, n, hd/2)
    emb = torch.cat([freqs, freqs], -1)
    sizes = list(section) * 2
    cos = torch.cat([c[i % 3] for i, c in enumerate(emb.cos().split(sizes, -1))], -1)
    sin = torch.cat([c[i % 3] for i, c in enumerate(emb.sin().split(sizes, -1))], -1)
    n = x.shape[1]
    h = _rms(x, sd["layers.0.input_layernorm.weight"])
    q = (h @ sd["layers.0.self_attn.q_proj.weight"].T + sd["layers.0.self_attn.q_proj.bias"]).view(1, n, heads, hd)
    k = (h @ sd["layers.0.self_attn.k_proj.weight"].T + sd["layers.0.self_attn.k_proj.bias"]).view(1, n, kv, hd)
    v = (h @ sd["layers.0.self_attn.v_proj.weight"].T + sd["layers.0.self_attn.v_proj.bias"]).view(1, n, kv, hd)
    q, k, v = (z.transpose(1, 2) for z in (q, k, v))
    q, k = q * cos + _rot_half(q) * sin, k * cos + _rot_half(k) * sin
    k, v = k.expand(1, heads, n, hd), v.expand(1, heads, n, hd)
    att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd), -1) @ v  # no causal mask
    x = x + att.transpose(1, 2).reshape(1, n, -1) @ sd["layers.0.self_attn.o_proj.weight"].T
    h = _rms(x, sd["layers.0.post_attention_layernorm.weight"])
    gate, up = h @ sd["layers.0.mlp.gate_proj.weight"].T, h @ sd["layers.0.mlp.up_proj.weight"].T
    x = x + (torch.nn.functional.silu(gate) * up) @ sd["layers.0.mlp.down_proj.weight"].T
    p = _rms(x, sd["projector.0.weight"]) @ sd["projector.1.weight"].T + sd["projector.1.bias"]
    p = torch.nn.functional.silu(_rms(p, sd["projector.2.weight"]))
    return _rms(p @ sd["projector.4.weight"].T + sd["projector.4.bias"], sd["projector.5.weight"])


def test_merger_is_the_reference_formula(tmp_path):
    path = write_tiny_nexus_decoder(tmp_path)
    state = _load(path)
    sd = convert_nexus_merger(state)
    model = NexusGenEmbeddingMerger.from_config(match_header({k: tuple(v.shape) for k, v in state.items()},
                                                             [NEXUS_MERGER]).config)
    missing, unexpected = model.load_state_dict(sd)
    assert not missing and not unexpected
    torch.manual_seed(0)
    embeds, ref = torch.randn(1, 81, 32), torch.randn(1, 12, 32)
    grid, ref_grid = torch.tensor([[1, 18, 18]]), torch.tensor([[1, 6, 8]])
    with torch.no_grad():
        out = model.eval()(embeds, grid, ref, ref_grid)
    assert out.shape == (1, 93, 32)
    torch.testing.assert_close(out, _reference(sd, embeds, (1, 18, 18), ref, (1, 6, 8)), atol=1e-4, rtol=1e-4)


def test_text_ids_place_the_tokens_on_the_latent_grid():
    ids = editing_text_ids(8, 12, (1, 18, 18), (1, 6, 8))
    assert ids.shape == (81 + 12, 3)
    assert torch.equal(ids[:81, 0], torch.zeros(81)) and torch.equal(ids[81:, 0], torch.ones(12))
    torch.testing.assert_close(ids[9 * 4 + 2, 1:], torch.tensor([4 * 8 / 18, 2 * 12 / 18]))
    torch.testing.assert_close(ids[81 + 4 * 1 + 3, 1:], torch.tensor([1 * 8 / 6, 3 * 12 / 8]))


def test_ar_names_and_messages():
    # Nexus-GenV2's files carry transformers 4.49's Qwen2.5-VL names plus its two own tensors
    assert nexus_ar_key("visual.blocks.0.attn.qkv.weight") == "model.model.visual.blocks.0.attn.qkv.weight"
    assert nexus_ar_key("model.layers.0.mlp.up_proj.weight") == \
        "model.model.language_model.layers.0.mlp.up_proj.weight"
    assert nexus_ar_key("lm_head.weight") == "model.lm_head.weight"
    assert nexus_ar_key("vision_head.weight") == "vision_head.weight"
    for k in ("visual.x", "model.layers.0.x", "lm_head.weight"):
        assert nexus_ar_key(nexus_ar_key(k)) == nexus_ar_key(k)
    sig = NEXUS_AR.signature(NEXUS_AR.known_configs["DiffSynth-Studio/Nexus-GenV2 (Qwen2.5-VL-7B)"])
    assert sig["vision_head.weight"] == (3584, 3584) and sig["image_prefill_embeds.weight"] == (81, 3584)
    text = editing_messages_text("make it red")
    vision = "<|vision_start|><|image_pad|><|vision_end|>"
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                    f"{vision} make it red<|im_end|>\n<|im_start|>assistant\nHere is the image: {vision}<|im_end|>\n")


def test_ar_release_recognised_and_its_pass_reads_image_and_instruction(tmp_path):
    import dataclasses

    import numpy as np
    from PIL import Image
    from safetensors.torch import load_file

    from difftune.families.flux.nexus_gen import NexusGenAR, nexus_target_embeddings
    from support.flux.nexus_gen import write_tiny_nexus_ar
    from support import qwen_vl_processor

    path, config = write_tiny_nexus_ar(tmp_path)
    sd = load_file(path)
    assert "vision_head.weight" in sd and "model.layers.0.self_attn.q_proj.weight" in sd and "visual.merger.mlp.0.weight" in sd
    spec = dataclasses.replace(NEXUS_AR, known_configs={"tiny": config})
    assert match_header({k: tuple(v.shape) for k, v in sd.items()}, [spec]).config == config
    model = NexusGenAR.from_config(config)
    missing, unexpected = model.load_state_dict({nexus_ar_key(k): v for k, v in sd.items()}, strict=False)
    assert not unexpected and set(missing) <= {"model.lm_head.weight"}  # tied to the embeddings when absent
    proc = qwen_vl_processor(tmp_path / "processor")

    def image(seed):
        return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (64, 96, 3), dtype=np.uint8))

    predicted, reference, grid = nexus_target_embeddings(model.eval(), proc, "make it red", image(0))
    # 81 predicted embeddings of the 252 x 252 placeholder (18 x 18 patches), the reference's own (56 x 84 px)
    assert predicted.shape == (81, 32) and reference.shape == (6, 32)
    assert grid.tolist() == [[1, 4, 6], [1, 18, 18]]
    assert not torch.allclose(predicted, nexus_target_embeddings(model, proc, "make it red", image(1))[0])
    assert not torch.allclose(predicted, nexus_target_embeddings(model, proc, "make it blue", image(0))[0])
    with torch.no_grad():
        model.image_prefill_embeds.weight.add_(1.0)
    assert not torch.allclose(predicted, nexus_target_embeddings(model, proc, "make it red", image(0))[0])
