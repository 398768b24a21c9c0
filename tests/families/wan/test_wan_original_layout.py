"""Wan-AI's original T5 and CLIP files map onto transformers' UMT5 and CLIP vision classes.

Each check runs the ORIGINAL layout's maths, written out here from the tensors as Wan's modules compute them
(T5: unscaled attention with a per-layer relative-position bias, RMS norms, gate = GELU-tanh(gate) * fc1;
CLIP: pre-norm ViT, fused qkv, exact GELU, the penultimate block's output), and compares it with the
transformers model loaded from the converted tensors.
"""

import math

import torch
import torch.nn.functional as F

from difftune.families.wan.original_layout import _T5_BLOCK, clip_vision_from_wan, umt5_from_wan


def _rms(x, w, eps=1e-6):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _bucket(rel, num_buckets=32, max_dist=128):
    num_buckets //= 2  # bidirectional
    out = (rel > 0).long() * num_buckets
    rel = rel.abs()
    exact = num_buckets // 2
    large = exact + (torch.log(rel.float().clamp(min=1) / exact) / math.log(max_dist / exact)
                     * (num_buckets - exact)).long()
    return out + torch.where(rel < exact, rel, large.clamp(max=num_buckets - 1))


def _wan_t5(sd, ids, heads):
    x = sd["token_embedding.weight"][ids]
    n = ids.shape[1]
    rel = torch.arange(n)[None, :] - torch.arange(n)[:, None]
    layers = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks."))
    for i in range(layers):
        p = lambda name: sd[f"blocks.{i}.{name}"]  # noqa: E731
        bias = p("pos_embedding.embedding.weight")[_bucket(rel)].permute(2, 0, 1)[None]
        h = _rms(x, p("norm1.weight"))
        q, k, v = (h @ p(f"attn.{c}.weight").t() for c in "qkv")
        split = lambda t: t.view(1, n, heads, -1).transpose(1, 2)  # noqa: E731
        attn = torch.softmax(split(q) @ split(k).transpose(-1, -2) + bias, -1)
        x = x + (attn @ split(v)).transpose(1, 2).reshape(1, n, -1) @ p("attn.o.weight").t()
        h = _rms(x, p("norm2.weight"))
        h = F.gelu(h @ p("ffn.gate.0.weight").t(), approximate="tanh") * (h @ p("ffn.fc1.weight").t())
        x = x + h @ p("ffn.fc2.weight").t()
    return _rms(x, sd["norm.weight"])


def test_wan_t5_file_gives_umt5_the_same_output():
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    heads = 4
    model = UMT5EncoderModel(UMT5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=heads,
                                        feed_forward_proj="gated-gelu", dense_act_fn="gelu_new")).eval()
    # The original file: Wan's names for the model's tensors (random, so every tensor matters).
    inverse = {v: k for k, v in _T5_BLOCK.items()}
    original = {"token_embedding.weight": torch.randn(100, 32), "norm.weight": 1 + 0.1 * torch.randn(32)}
    for key, value in model.state_dict().items():
        if key.startswith("encoder.block."):
            i, rest = key.split(".", 3)[2:]
            original[f"blocks.{i}.{inverse[rest]}"] = torch.randn_like(value) * 0.2
    converted = umt5_from_wan(original)
    model.load_state_dict(converted, strict=True)  # every tensor placed, none left over
    ids = torch.tensor([[5, 17, 3, 99, 42, 1, 0, 7]])
    with torch.no_grad():
        theirs = model(input_ids=ids).last_hidden_state
    ours = _wan_t5(original, ids, heads)
    assert (theirs - ours).abs().max() < 1e-5


def _wan_clip_penultimate(sd, pixels, heads):
    v = lambda k: sd[f"visual.{k}"]  # noqa: E731
    x = F.conv2d(pixels, v("patch_embedding.weight"), stride=v("patch_embedding.weight").shape[-1])
    x = x.flatten(2).transpose(1, 2)
    x = torch.cat([v("cls_embedding").expand(x.shape[0], -1, -1), x], 1) + v("pos_embedding")
    x = F.layer_norm(x, x.shape[-1:], v("pre_norm.weight"), v("pre_norm.bias"), 1e-5)
    layers = 1 + max(int(k.split(".")[2]) for k in sd if k.startswith("visual.transformer."))
    for i in range(layers - 1):  # Wan's use_31_block: all blocks but the last
        p = lambda k: v(f"transformer.{i}.{k}")  # noqa: E731
        h = F.layer_norm(x, x.shape[-1:], p("norm1.weight"), p("norm1.bias"), 1e-5)
        q, k, val = F.linear(h, p("attn.to_qkv.weight"), p("attn.to_qkv.bias")).chunk(3, -1)
        split = lambda t: t.view(t.shape[0], t.shape[1], heads, -1).transpose(1, 2)  # noqa: E731
        o = F.scaled_dot_product_attention(split(q), split(k), split(val)).transpose(1, 2).flatten(2)
        x = x + F.linear(o, p("attn.proj.weight"), p("attn.proj.bias"))
        h = F.layer_norm(x, x.shape[-1:], p("norm2.weight"), p("norm2.bias"), 1e-5)
        x = x + F.linear(F.gelu(F.linear(h, p("mlp.0.weight"), p("mlp.0.bias"))), p("mlp.2.weight"), p("mlp.2.bias"))
    return x


def test_wan_clip_file_gives_clip_vision_the_same_penultimate_features():
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    torch.manual_seed(0)
    dim, heads, layers, patch, size = 32, 4, 3, 4, 16
    model = CLIPVisionModelWithProjection(CLIPVisionConfig(
        hidden_size=dim, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=heads, patch_size=patch,
        image_size=size, projection_dim=24, hidden_act="gelu", layer_norm_eps=1e-5)).eval()
    tokens = (size // patch) ** 2 + 1
    r = lambda *s: torch.randn(*s) * 0.2  # noqa: E731
    original = {"visual.patch_embedding.weight": r(dim, 3, patch, patch), "visual.cls_embedding": r(1, 1, dim),
                "visual.pos_embedding": r(1, tokens, dim), "visual.pre_norm.weight": 1 + r(dim),
                "visual.pre_norm.bias": r(dim), "visual.post_norm.weight": 1 + r(dim), "visual.post_norm.bias": r(dim),
                "visual.head": r(dim, 24), "textual.token_embedding.weight": r(10, 8), "log_scale": torch.tensor(4.6)}
    for i in range(layers):
        for name, shape in {"norm1": (dim,), "norm2": (dim,), "attn.to_qkv": (3 * dim, dim), "attn.proj": (dim, dim),
                            "mlp.0": (64, dim), "mlp.2": (dim, 64)}.items():
            original[f"visual.transformer.{i}.{name}.weight"] = (1 + r(*shape)) if "norm" in name else r(*shape)
            original[f"visual.transformer.{i}.{name}.bias"] = r(shape[0])
    converted = clip_vision_from_wan(original)
    result = model.load_state_dict(converted, strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"vision_model.embeddings.position_ids"}
    pixels = torch.randn(2, 3, size, size)
    with torch.no_grad():
        theirs = model(pixel_values=pixels, output_hidden_states=True).hidden_states[-2]
    assert (theirs - _wan_clip_penultimate(original, pixels, heads)).abs().max() < 1e-5
    assert torch.equal(converted["visual_projection.weight"], original["visual.head"].t())


def test_tiny_original_dit_and_vae_writers_invert_diffusers_converters():
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers, convert_wan_vae_to_diffusers

    from support.wan.original import wan_dit_to_original, wan_vae_to_original

    torch.manual_seed(0)
    for kwargs in ({}, {"image_dim": 16, "added_kv_proj_dim": 16}):  # T2V, and I2V's image branch
        dit = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                    out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, **kwargs)
        state = dit.state_dict()
        original = wan_dit_to_original(state)
        assert any(k.startswith("blocks.0.self_attn.q.") for k in original) and "head.modulation" in original
        back = convert_wan_transformer_to_diffusers(dict(original))
        assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                           temperal_downsample=[False, True, True])
    state = vae.state_dict()
    back = convert_wan_vae_to_diffusers(wan_vae_to_original(state))
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)


def test_tiny_original_t5_and_clip_writers_invert_our_converters():
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection, UMT5Config, UMT5EncoderModel

    from support.wan.original import clip_vision_to_wan, umt5_to_wan

    t5 = UMT5EncoderModel(UMT5Config(vocab_size=50, d_model=16, d_kv=4, d_ff=24, num_layers=2, num_heads=4,
                                     feed_forward_proj="gated-gelu")).state_dict()
    back = umt5_from_wan(umt5_to_wan(t5))
    assert back.keys() == t5.keys() and all(torch.equal(back[k], t5[k]) for k in t5)
    clip = CLIPVisionModelWithProjection(CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                                          num_attention_heads=2, patch_size=4, image_size=16,
                                                          projection_dim=8)).state_dict()
    back = clip_vision_from_wan(clip_vision_to_wan(clip))
    assert back.keys() == set(clip) - {"vision_model.embeddings.position_ids"}
    assert all(torch.equal(back[k], clip[k]) for k in back)


def test_wan22_vae_original_names_round_trip_and_fit_diffusers():
    from diffusers import AutoencoderKLWan

    from difftune.families.wan.original_layout import wan22_vae_from_original
    from support.wan.original import wan22_vae_to_original

    vae = AutoencoderKLWan(base_dim=8, decoder_base_dim=12, z_dim=6, in_channels=12, out_channels=12, patch_size=2,
                           dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                           temperal_downsample=[False, True, True], is_residual=True)
    state = vae.state_dict()
    original = wan22_vae_to_original(state)
    assert "encoder.downsamples.1.downsamples.2.time_conv.weight" in original  # the resample closes each level
    assert "decoder.upsamples.0.upsamples.3.resample.1.weight" in original
    back = wan22_vae_from_original(original)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)


def test_a_wrapped_pth_state_dict_is_unwrapped(tmp_path):
    from difftune.models.detect import read_header

    torch.save({"model_state": {"conv1.weight": torch.zeros(2, 2)}}, tmp_path / "vae.pth")
    assert read_header(tmp_path / "vae.pth") == {"conv1.weight": (2, 2)}


def test_official_clip_and_wan22_vae_configs_recognise_full_size_original_headers():
    """Headers shaped as the real files (built on meta tensors from the official configs, then renamed to the
    original layout) are recognised as the CLIP ViT-H/14 and the Wan2.2 VAE, not as the Wan2.1 VAE."""
    from difftune.families.wan import FAMILY
    from difftune.families.wan.components import CLIP_VIT_H14_CONFIG, IMAGE_ENCODER_ORIGINAL, VAE22_ORIGINAL, \
        WAN22_VAE_CONFIG
    from difftune.models.detect import match_header
    from support.wan.original import clip_vision_to_wan, wan22_vae_to_original

    vae = VAE22_ORIGINAL.build(WAN22_VAE_CONFIG).state_dict()
    header = {k: tuple(v.shape) for k, v in wan22_vae_to_original(vae).items()}
    match = match_header(header, FAMILY.components)
    assert match is not None and match.spec is VAE22_ORIGINAL and match.label == "Wan2.2 VAE"
    assert len(WAN22_VAE_CONFIG["latents_mean"]) == len(WAN22_VAE_CONFIG["latents_std"]) == 48
    clip = IMAGE_ENCODER_ORIGINAL.build(CLIP_VIT_H14_CONFIG).state_dict()
    header = {k: tuple(v.shape) for k, v in clip_vision_to_wan(clip).items()}
    header["textual.token_embedding.weight"] = (250002, 1024)  # the text tower the file also holds
    assert header["visual.pos_embedding"] == (1, 257, 1280) and header["visual.head"] == (1280, 1024)
    match = match_header(header, FAMILY.components)
    assert match is not None and match.spec is IMAGE_ENCODER_ORIGINAL
