"""Step1X-Edit: one released file holds the DiT (FLUX.1 without guidance, BFL's names) and the connector; both are
recognised from it, and the connector computes the reference's formula; `difftune sample` takes the reference
image's size, as the Python call does."""

import math

import torch
from safetensors.torch import load_file

from difftune.families.flux.components import DIT_BFL
from difftune.families.flux.step1x import (STEP1X_CONNECTOR, STEP1X_CONNECTOR_CONFIG, STEP1X_DIT, Step1XConnector,
                                           convert_step1x_connector, split_quoted, step1x_chat_text, step1x_tokens)
from support.flux.step1x import write_tiny_step1x
from difftune.models.detect import match_header, read_header


def test_both_models_recognised_from_the_one_file(tmp_path):
    path = write_tiny_step1x(tmp_path)
    assert path.name == "step1x-edit-i1258.safetensors"
    header = read_header(path)
    assert match_header(header, [DIT_BFL]) is None  # the connector's tensors are not FLUX's
    dit = match_header(header, [DIT_BFL, STEP1X_DIT])
    assert dit.spec is STEP1X_DIT and dit.config["guidance_embeds"] is False
    connector = match_header(header, [STEP1X_CONNECTOR])
    assert connector.config == {"_class_name": "Step1XConnector", "in_channels": 32, "num_attention_heads": 2,
                                "attention_head_dim": 16, "num_layers": 2, "pooled_dim": 32}
    sig = STEP1X_CONNECTOR.signature(STEP1X_CONNECTOR_CONFIG)
    assert sig["refiner.proj_in.weight"] == (4096, 3584) and sig["global_proj_out.weight"] == (768, 3584)
    assert sig["refiner.token_refiner.refiner_blocks.1.attn.to_q.weight"] == (4096, 4096)


def _ln(x, sd, name):
    return torch.nn.functional.layer_norm(x, x.shape[-1:], sd[f"{name}.weight"], sd[f"{name}.bias"], 1e-6)


def _lin(x, sd, name):
    return x @ sd[f"{name}.weight"].T + sd[f"{name}.bias"]


def _reference(sd, x, t, mask, heads):
    # the reference's Qwen2Connector step by step on the release's names (connector.*)
    c = lambda n: f"connector.{n}"  # noqa: E731
    m = mask.float().unsqueeze(-1)
    pooled = _lin((x * m).sum(1) / m.sum(1) * (1 + sd[c("scale_factor")]), sd, c("global_proj_out"))
    s = "connector.S."
    half = 128
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
    args = t[:, None] * freqs[None]
    t_emb = _lin(torch.nn.functional.silu(_lin(torch.cat([torch.cos(args), torch.sin(args)], -1), sd,
                                               s + "t_embedder.mlp.0")), sd, s + "t_embedder.mlp.2")
    ctx = _lin(torch.nn.functional.silu(_lin((x * m).sum(1) / m.sum(1), sd, s + "c_embedder.linear_1")), sd,
               s + "c_embedder.linear_2")
    cond = t_emb + ctx
    h = _lin(x, sd, s + "input_embedder")
    b, n, d = h.shape
    attn_mask = (mask[:, None, None, :].bool() & mask[:, None, :, None].bool())
    attn_mask[:, :, :, 0] = True
    for i in range(2):
        blk = f"{s}individual_token_refiner.blocks.{i}."
        gate_msa, gate_mlp = _lin(torch.nn.functional.silu(cond), sd, blk + "adaLN_modulation.1").chunk(2, dim=1)
        q, k, v = _lin(_ln(h, sd, blk + "norm1"), sd, blk + "self_attn_qkv").view(b, n, 3, heads, d // heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-1, -2) / math.sqrt(d // heads)).masked_fill(~attn_mask, float("-inf"))
        att = (torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(b, n, d)
        h = h + _lin(att, sd, blk + "self_attn_proj") * gate_msa[:, None]
        f = _lin(torch.nn.functional.silu(_lin(_ln(h, sd, blk + "norm2"), sd, blk + "mlp.fc1")), sd, blk + "mlp.fc2")
        h = h + f * gate_mlp[:, None]
    return h, pooled


def test_connector_is_the_reference_formula(tmp_path):
    path = write_tiny_step1x(tmp_path)
    sd = load_file(path)
    model = Step1XConnector.from_config(match_header(read_header(path), [STEP1X_CONNECTOR]).config)
    missing, unexpected = model.load_state_dict(convert_step1x_connector(sd))
    assert not missing and not unexpected
    torch.manual_seed(0)
    x = torch.randn(2, 6, 32)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    t = torch.tensor([0.3, 0.9])
    with torch.no_grad():
        tokens, pooled = model.eval()(x, t, mask)
    ref_tokens, ref_pooled = _reference(sd, x, t, mask, 2)
    torch.testing.assert_close(pooled, ref_pooled, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tokens, ref_tokens, atol=1e-4, rtol=1e-4)


def test_prompt_text_and_quote_split():
    text = step1x_chat_text('make the sign say "OK"')
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nGiven a")
    assert "User Prompt:Picture 1: <|vision_start|><|image_pad|><|vision_end|>make the sign" in text
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    pieces = split_quoted(text)
    # after character 155, quoted characters become pieces of their own in curly quotes
    # (the closing quote starts the next piece, as the reference's loop leaves it)
    assert pieces[-3:] == ["“O”", "“K”", '"<|im_end|>\n<|im_start|>assistant\n']
    assert pieces[-4].endswith('say "') and len(pieces) == 4
    assert pieces[0] + "OK" + pieces[-1] == text


def test_reference_latents_follow_with_the_same_ids():
    from difftune.core.latents import pack_latents
    from difftune.families.flux.model_fn import image_ids

    tokens, ids = pack_latents(torch.randn(2, 16, 4, 6)), image_ids(2, 3, "cpu", torch.float32)
    ref = torch.randn(1, 16, 4, 6)
    out, out_ids = step1x_tokens(tokens, ids, ref)
    assert out.shape == (2, 12, 64) and torch.equal(out[:, 6:], pack_latents(ref).expand(2, -1, -1))
    assert torch.equal(out_ids[6:], ids)  # (0, row, column) again, as the reference's prepare_image_ids


def _image(seed, size=(96, 64)):
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def test_qwenvl_embedding_follows_the_reference_steps(tmp_path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    from difftune.families.flux.step1x import step1x_embed, step1x_input_ids
    from support.flux.step1x import step1x_processor, write_tiny_qwen25vl

    folder = write_tiny_qwen25vl(tmp_path / "qwen")
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(folder)).eval()
    proc = step1x_processor(folder)
    image = _image(0)
    plain = step1x_chat_text("make it red")
    inputs = proc(text=[plain], images=[image], return_tensors="pt")
    # the reference's image bounds: 256 to 324 merged patches
    assert 256 <= int(inputs["image_grid_thw"].prod()) // 4 <= 324
    # without quotes the piecewise tokenization is the processor's own
    assert torch.equal(step1x_input_ids(proc.tokenizer, plain, inputs["input_ids"]), inputs["input_ids"])
    quoted = step1x_chat_text('write "AB"')
    q_inputs = proc(text=[quoted], images=[image], return_tensors="pt")
    q_ids = step1x_input_ids(proc.tokenizer, quoted, q_inputs["input_ids"])
    # each quoted character is tokenized alone, its curly quotes stripped: a byte-level tokenizer gives the same ids
    assert torch.equal(q_ids, q_inputs["input_ids"])
    # the reference drops 217 hidden states: the system prompt and prefix in Qwen's tokenizer; the tiny byte-level
    # tokenizer splits them into more tokens, so it drops those before the image instead
    drop = int((inputs["input_ids"][0] == proc.tokenizer.convert_tokens_to_ids("<|vision_start|>")).nonzero()[0, 0])
    assert drop > 217
    with torch.no_grad():
        emb, mask = step1x_embed(model, proc, "make it red", image, drop=drop)
        hidden = model.model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                             pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
                             output_hidden_states=True).hidden_states[-1][0]
        other_image, _ = step1x_embed(model, proc, "make it red", _image(1), drop=drop)
        other_prompt, _ = step1x_embed(model, proc, "make it blue", image, drop=drop)
    # the last hidden states after the first `drop`, at most 640, zero-padded, with their mask
    n = min(640, hidden.shape[0] - drop)
    assert emb.shape == (640, 32) and int(mask.sum()) == n
    torch.testing.assert_close(emb[:n], hidden[drop:drop + n])
    assert not emb[n:].any()
    assert not torch.allclose(emb, other_image) and not torch.allclose(emb, other_prompt)


def test_step1x_samples_at_the_reference_images_size_in_the_cli_as_in_python():
    """`difftune sample` passed the family's 1024 x 1024 where the Python call takes the reference image's size."""
    import inspect

    from difftune.families.flux.step1x import Step1XEditPipeline

    params = inspect.signature(Step1XEditPipeline.__call__).parameters
    accepted = {*params, *Step1XEditPipeline.call_inputs(), *Step1XEditPipeline.call_settings()}
    cli = {k: v for k, v in Step1XEditPipeline.call_defaults.items() if k in accepted}  # as `difftune sample`
    assert cli["height"] is None and cli["width"] is None
    assert all(params[k].default == v for k, v in cli.items())
