"""LongCat-Video: the released dit/ layout is recognised and loads; model_fn equals a step-by-step rewrite of the
reference's `model_fn_longcat_video` + `LongCatVideoTransformer3DModel` on the same values (float32), with and
without a continuation prefix."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from difftune.families.wan.components import DIT, DIT_ORIGINAL
from difftune.families.wan.longcat.keys import LONGCAT_DIT, LONGCAT_VIDEO_CONFIG, infer_longcat_config
from difftune.families.wan.longcat.model import model_fn_longcat
from support.wan.longcat import DIT_FOLDER, tiny_longcat_dit, write_tiny_longcat
from difftune.models.detect import detect_component, match_header
from difftune.models.load import load_component

SPECS = [DIT, DIT_ORIGINAL, LONGCAT_DIT]


def test_released_layout_is_recognised_and_loads(tmp_path):
    models = write_tiny_longcat(tmp_path / "models")
    weights = models / DIT_FOLDER / "diffusion_pytorch_model.safetensors"
    det = detect_component(str(weights), SPECS)
    assert det.spec is LONGCAT_DIT and det.source.endswith("config.json")
    assert (models / "Wan-AI/Wan2.1-T2V-14B/Wan2.1_VAE.pth").is_file()
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(weights, bare)
    loaded = load_component(str(bare / weights.name), SPECS, torch_dtype=torch.float32)
    reference = tiny_longcat_dit()
    assert all(torch.equal(loaded.module.state_dict()[k], v) for k, v in reference.state_dict().items())
    assert loaded.module.config.num_heads == 2 and loaded.module.config.depth == 2


def test_the_released_config_is_recognised_from_its_shapes():
    signature = LONGCAT_DIT.signature(LONGCAT_VIDEO_CONFIG)
    assert signature["blocks.47.ffn.w1.weight"] == (11008, 4096)
    assert signature["blocks.0.attn.q_norm.weight"] == (128,)
    assert infer_longcat_config(signature) == LONGCAT_VIDEO_CONFIG
    match = match_header(signature, SPECS)
    assert match.spec is LONGCAT_DIT and match.label == "LongCat-Video"


# -- the reference, step by step -------------------------------------------------------------------------------

def rotate_half(x):
    x = x.reshape(*x.shape[:-1], -1, 2)
    x1, x2 = x.unbind(-1)
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def ref_rope_freqs(head_dim, grid):
    n_t, n_h, n_w = grid
    dim_t, dim_h = head_dim - 4 * (head_dim // 6), 2 * (head_dim // 6)
    def axis(n, d):
        freqs = 1.0 / (10000 ** (torch.arange(0, d, 2)[: (d // 2)].float() / d))
        g = torch.from_numpy(np.linspace(0, n, n, endpoint=False, dtype=np.float32)).float()
        f = torch.einsum("..., f -> ... f", g, freqs)
        return f.repeat_interleave(2, dim=-1)
    ft, fh, fw = axis(n_t, dim_t), axis(n_h, dim_h), axis(n_w, dim_h)
    freqs = torch.cat([ft[:, None, None, :].expand(n_t, n_h, n_w, -1), fh[None, :, None, :].expand(n_t, n_h, n_w, -1),
                       fw[None, None, :, :].expand(n_t, n_h, n_w, -1)], dim=-1)
    return freqs.reshape(n_t * n_h * n_w, -1)


def ref_rms(x, w):
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(x) * w


def sdpa_bsd(q, k, v, heads):
    b = q.shape[0]
    q, k, v = (t.reshape(b, t.shape[1], heads, -1).transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)


def ref_forward(dit, latents, timestep, context, longcat_latents=None):
    sd = {k: v.float() for k, v in dit.state_dict().items()}
    c = dit.config
    lin = lambda x, p, bias=True: F.linear(x, sd[p + ".weight"], sd[p + ".bias"] if bias else None)  # noqa: E731
    latents = latents.clone()
    num_cond = 0
    if longcat_latents is not None:
        latents[:, :, :longcat_latents.shape[2]] = longcat_latents
        num_cond = longcat_latents.shape[2]
    context = context.unsqueeze(0)
    mask = torch.any(context != 0, dim=-1)[:, 0].to(torch.int64)
    B, _, T, H, W = latents.shape
    N_t, N_h, N_w = T, H // 2, W // 2
    timestep = timestep.unsqueeze(1).expand(-1, N_t).clone()
    timestep[:, :num_cond] = 0
    x = F.conv3d(latents, sd["x_embedder.proj.weight"], sd["x_embedder.proj.bias"], stride=(1, 2, 2))
    x = x.flatten(2).transpose(1, 2)
    half = c.frequency_embedding_size // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(0, half, dtype=torch.float32) / half)
    args = timestep.float().flatten()[:, None] * freqs[None]
    t = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    t = lin(F.silu(lin(t, "t_embedder.mlp.0")), "t_embedder.mlp.2").reshape(B, N_t, -1)
    y = lin(F.gelu(lin(context, "y_embedder.y_proj.0"), approximate="tanh"), "y_embedder.y_proj.2")
    y = y * mask[:, None, :, None]
    mask = mask * 0 + 1
    y = y.squeeze(1).masked_select(mask.squeeze(1).squeeze(1).unsqueeze(-1) != 0).view(1, -1, x.shape[-1])
    heads, hidden = c.num_heads, c.hidden_size
    hd = hidden // heads
    rope = ref_rope_freqs(hd, (N_t, N_h, N_w))
    cos, sin = rope.cos()[None, None], rope.sin()[None, None]
    N = x.shape[1]
    for i in range(c.depth):
        p = f"blocks.{i}."
        mod = lin(F.silu(t), p + "adaLN_modulation.1").unsqueeze(2).chunk(6, dim=-1)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mod
        xm = (F.layer_norm(x.view(B, N_t, -1, hidden), (hidden,), eps=1e-6) * (scale_msa + 1) + shift_msa).view(B, N, hidden)
        qkv = lin(xm, p + "attn.qkv").view(B, N, 3, heads, hd).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = ref_rms(q, sd[p + "attn.q_norm.weight"]), ref_rms(k, sd[p + "attn.k_norm.weight"])
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        bsd = lambda z: z.transpose(1, 2).flatten(2)  # noqa: E731
        if num_cond:
            cut = num_cond * (N // N_t)
            a = torch.cat([sdpa_bsd(bsd(q[:, :, :cut]), bsd(k[:, :, :cut]), bsd(v[:, :, :cut]), heads),
                           sdpa_bsd(bsd(q[:, :, cut:]), bsd(k), bsd(v), heads)], dim=1)
        else:
            a = sdpa_bsd(bsd(q), bsd(k), bsd(v), heads)
        a = lin(a, p + "attn.proj")
        x = x + (gate_msa * a.view(B, -1, N // N_t, hidden)).view(B, -1, hidden)
        xn = F.layer_norm(x, (hidden,), sd[p + "pre_crs_attn_norm.weight"], sd[p + "pre_crs_attn_norm.bias"], eps=1e-6)
        cut = num_cond * (N // N_t)
        qc = ref_rms(lin(xn[:, cut:], p + "cross_attn.q_linear").view(1, -1, heads, hd), sd[p + "cross_attn.q_norm.weight"])
        kv = lin(y, p + "cross_attn.kv_linear").view(1, -1, 2, heads, hd)
        kc, vc = kv.unbind(2)
        kc = ref_rms(kc, sd[p + "cross_attn.k_norm.weight"])
        o = lin(sdpa_bsd(qc.flatten(2), kc.flatten(2), vc.flatten(2), heads).view(B, -1, hidden), p + "cross_attn.proj")
        x = x + torch.cat([torch.zeros(B, cut, hidden), o], dim=1)
        xm = (F.layer_norm(x.view(B, -1, N // N_t, hidden), (hidden,), eps=1e-6) * (scale_mlp + 1) + shift_mlp).view(B, -1, hidden)
        f = F.linear(F.silu(F.linear(xm, sd[p + "ffn.w1.weight"])) * F.linear(xm, sd[p + "ffn.w3.weight"]), sd[p + "ffn.w2.weight"])
        x = x + (gate_mlp * f.view(B, -1, N // N_t, hidden)).view(B, -1, hidden)
    shift, scale = lin(F.silu(t), "final_layer.adaLN_modulation.1").unsqueeze(2).chunk(2, dim=-1)
    x = (F.layer_norm(x.view(B, N_t, -1, hidden), (hidden,), eps=1e-6) * (scale + 1) + shift).view(B, N, hidden)
    x = lin(x, "final_layer.linear")
    x = x.reshape(B, N_t, N_h, N_w, 1, 2, 2, -1).permute(0, 7, 1, 4, 2, 5, 3, 6).reshape(B, -1, N_t, N_h * 2, N_w * 2)
    return -x.float()


@pytest.mark.parametrize("prefix", [0, 1])
def test_model_fn_equals_the_reference(prefix):
    dit = tiny_longcat_dit()
    g = torch.Generator().manual_seed(5)
    latents = torch.randn(1, 16, 3, 4, 6, generator=g)
    context = torch.randn(1, 9, 32, generator=g)
    context[:, 6:] = 0  # the prompt's padding (UMT5's embeddings are zero past the prompt)
    timestep = torch.tensor([713.0])
    cond = torch.randn(1, 16, prefix, 4, 6, generator=g) if prefix else None
    with torch.no_grad():
        ours = model_fn_longcat(dit, latents, timestep, context, longcat_latents=cond)
        ref = ref_forward(dit, latents, timestep, context, cond)
    assert ours.dtype == torch.float32 and ours.shape == latents.shape
    assert (ours - ref).abs().max() < 2e-5, (ours - ref).abs().max()
    with torch.no_grad():
        other = model_fn_longcat(dit, latents, torch.tensor([100.0]), context, longcat_latents=cond)
    assert (other - ours).abs().max() > 1e-3


def test_lora_targets_are_module_names():
    from difftune.families.wan.longcat.keys import LORA_TARGET_MODULES

    names = {n for n, _ in tiny_longcat_dit().named_modules()}
    for target in LORA_TARGET_MODULES.split(","):
        assert any(n.endswith("." + target) for n in names), target
