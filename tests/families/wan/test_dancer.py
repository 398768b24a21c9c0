"""Wan-Dancer-14B: both released files are recognised and load (Wan-AI's names plus the Dancer's modules), a full
checkpoint goes back to those names, and model_fn equals a step-by-step rewrite of the reference's Dancer path of
`model_fn_wan_video` (WanModel with the wantodance modules, `wantodance_get_single_freqs`) on the same values, on
the local (30 fps) and the global (7.5 fps) path, in float32."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from difftune.errors import UserError
from difftune.families.wan.components import DIT, DIT_ORIGINAL
from difftune.families.wan.dancer.keys import DANCER_14B_CONFIG, DANCER_DIT, dancer_to_original
from difftune.families.wan.dancer.model import model_fn_wan_dancer
from difftune.families.wan.dancer.units import keyframe_mask, music_features
from support.wan.dancer import FILES, tiny_dancer_dit, write_tiny_dancer
from difftune.models.detect import detect_component, match_header
from difftune.models.load import load_component

SPECS = [DIT, DANCER_DIT, DIT_ORIGINAL]  # the Dancer first: its file also has DIT_ORIGINAL's marker keys


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return write_tiny_dancer(tmp_path_factory.mktemp("models"))


@pytest.mark.parametrize("which,seed", [("global", 41), ("local", 42)])
def test_released_files_are_recognised_and_load(root, which, seed):
    path = str(root / FILES[which])
    det = detect_component(path, SPECS)
    assert det.spec is DANCER_DIT and det.config["music_inject_layers"] == [0, 1]
    module = load_component(path, SPECS, torch_dtype=torch.float32).module
    reference = tiny_dancer_dit(seed)
    assert set(module.state_dict()) == set(reference.state_dict())
    assert all(torch.equal(module.state_dict()[k], v) for k, v in reference.state_dict().items())
    # back to the released names: the file itself
    from safetensors.torch import load_file

    released = load_file(path)
    back = dancer_to_original(module.state_dict())
    assert set(back) == set(released) and all(torch.equal(back[k], released[k]) for k in released)


def test_the_14b_file_is_recognised_from_its_shapes():
    signature = DANCER_DIT.signature(DANCER_14B_CONFIG)
    original = {k: tuple(v.shape) for k, v in dancer_to_original(
        {k: torch.empty(s, device="meta") for k, s in signature.items()}).items()}
    assert original["music_injector.injector.7.q.weight"] == (5120, 5120)
    assert original["blocks.39.self_attn.q.weight"] == (5120, 5120)
    assert original["music_encoder.1.self_attn.in_proj_weight"] == (768, 256)
    match = match_header(original, SPECS)
    assert match.spec is DANCER_DIT and match.label == "Wan-Dancer-14B"
    assert DANCER_DIT.infer_config(DANCER_DIT.model_shapes(original)) == DANCER_14B_CONFIG


# -- the reference, step by step ------------------------------------------------------------------------------

def sinusoid(dim, position):
    s = torch.outer(position.double(), torch.pow(10000, -torch.arange(dim // 2).double().div(dim // 2)))
    return torch.cat([torch.cos(s), torch.sin(s)], dim=1).to(position.dtype)


def freqs_1d(dim, end):
    f = 1.0 / (10000 ** (torch.arange(0, dim, 2)[: dim // 2].double() / dim))
    f = torch.outer(torch.arange(end), f)
    return torch.polar(torch.ones_like(f), f)


def get_single_freqs(freqs, frame_num, fps):
    total_frame = int(30.0 / (fps + 1e-6) * frame_num + 0.5)
    interval = 30.0 / (fps + 1e-6)
    f0 = freqs[:total_frame]
    new = torch.zeros((frame_num, f0.shape[1]), dtype=f0.dtype)
    new[0] = f0[0]
    new[-1] = f0[total_frame - 1]
    for i in range(1, frame_num - 1):
        pos = i * interval
        low = int(pos)
        high = min(low + 1, total_frame - 1)
        wh = pos - low
        new[i] = f0[low] * (1.0 - wh) + f0[high] * wh
    return new


def rope(x, freqs, heads):
    b, s, _ = x.shape
    xc = torch.view_as_complex(x.double().reshape(b, s, heads, -1, 2))
    return torch.view_as_real(xc * freqs).flatten(2).to(x.dtype)


def rms(x, w):
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w


def attend(q, k, v, heads):
    b = q.shape[0]
    q, k, v = (t.reshape(b, t.shape[1], heads, -1).transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)


def rotate_half(x):
    x = x.reshape(*x.shape[:-1], -1, 2)
    x1, x2 = x.unbind(-1)
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def reference(sd, heads, latents, timestep, context, clip_feature, y, refimage, music, fps):
    lin = lambda x, p: F.linear(x, sd[p + ".weight"], sd[p + ".bias"])  # noqa: E731
    dim = sd["patch_embedding.weight"].shape[0]
    hd = dim // heads

    def mlp(x, p):
        d_in, d_out = sd[p + ".1.weight"].shape[1], sd[p + ".3.weight"].shape[0]
        x = F.layer_norm(x, (d_in,), sd[p + ".0.weight"], sd[p + ".0.bias"])
        return F.layer_norm(lin(F.gelu(lin(x, p + ".1")), p + ".3"), (d_out,), sd[p + ".4.weight"], sd[p + ".4.bias"])

    def cross(p, x, ctx):
        img, txt = ctx[:, :257 if ctx.shape[1] > 600 else 17], ctx[:, 257 if ctx.shape[1] > 600 else 17:]
        q = rms(lin(x, p + ".q"), sd[p + ".norm_q.weight"])
        out = attend(q, rms(lin(txt, p + ".k"), sd[p + ".norm_k.weight"]), lin(txt, p + ".v"), heads)
        if p + ".k_img.weight" in sd:
            out = out + attend(q, rms(lin(img, p + ".k_img"), sd[p + ".norm_k_img.weight"]), lin(img, p + ".v_img"),
                               heads)
        return lin(out, p + ".o")

    t = lin(F.silu(lin(sinusoid(16, timestep), "time_embedding.0")), "time_embedding.2")
    t_mod = lin(F.silu(t), "time_projection.1").unflatten(1, (6, dim))
    context = lin(F.gelu(lin(context, "text_embedding.0"), approximate="tanh"), "text_embedding.2")
    x = torch.cat([latents, y], dim=1)
    context = torch.cat([mlp(clip_feature, "img_emb.proj"), context], dim=1)
    patch = "patch_embedding_global" if int(fps + 0.5) != 30 else "patch_embedding"
    x = F.conv3d(x, sd[patch + ".weight"], sd[patch + ".bias"], stride=(1, 2, 2))
    f, h, w = x.shape[2:]
    x = x.flatten(2).transpose(1, 2)
    end = int(22350 / 8 + 0.5)
    tables = [freqs_1d(hd - 2 * (hd // 3), end), freqs_1d(hd // 3, end), freqs_1d(hd // 3, end)]
    f0 = tables[0][:f] if int(fps + 0.5) == 30 else get_single_freqs(tables[0], f, fps)
    freqs = torch.cat([f0.view(f, 1, 1, -1).expand(f, h, w, -1), tables[1][:h].view(1, h, 1, -1).expand(f, h, w, -1),
                       tables[2][:w].view(1, 1, w, -1).expand(f, h, w, -1)], dim=-1).reshape(f * h * w, 1, -1)
    context = torch.cat([mlp(refimage, "img_emb_refimage.proj"), context], dim=1)
    # music: projection, two pre-norm layers with rotated queries / keys, two bilinear resizes
    m = lin(music, "music_projection")
    for layer in range(2):
        p = f"music_encoder.{layer}"
        d = m.shape[-1]
        hn = F.layer_norm(m, (d,), sd[p + ".norm1.weight"], sd[p + ".norm1.bias"])
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2)[: d // 2].float() / d))
        ang = torch.einsum("..., f -> ... f", torch.arange(m.shape[0]).float(), inv).repeat_interleave(2, dim=-1)
        qk = hn * ang.cos() + rotate_half(hn) * ang.sin()
        wq, wk, wv = sd[p + ".self_attn.in_proj_weight"].chunk(3)
        bq, bk, bv = sd[p + ".self_attn.in_proj_bias"].chunk(3)
        a = attend(F.linear(qk, wq, bq)[None], F.linear(qk, wk, bk)[None], F.linear(hn, wv, bv)[None], 4)[0]
        m = m + lin(a, p + ".self_attn.out_proj")
        hn = F.layer_norm(m, (d,), sd[p + ".norm2.weight"], sd[p + ".norm2.bias"])
        m = m + lin(F.gelu(lin(hn, p + ".linear1")), p + ".linear2")
    m = F.interpolate(m[None, None], size=(149, 4800), mode="bilinear")
    m = F.interpolate(m, size=(latents.shape[2] * 8, dim), mode="bilinear").squeeze(1)
    ln = lambda z: F.layer_norm(z, (dim,), eps=1e-6)  # noqa: E731
    for i in range(2):
        p = f"blocks.{i}"
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (sd[p + ".modulation"] + t_mod).chunk(6, 1)
        hx = ln(x) * (1 + scale_msa) + shift_msa
        q = rope(rms(lin(hx, p + ".self_attn.q"), sd[p + ".self_attn.norm_q.weight"]), freqs, heads)
        k = rope(rms(lin(hx, p + ".self_attn.k"), sd[p + ".self_attn.norm_k.weight"]), freqs, heads)
        x = x + gate_msa * lin(attend(q, k, lin(hx, p + ".self_attn.v"), heads), p + ".self_attn.o")
        n3 = F.layer_norm(x, (dim,), sd[p + ".norm3.weight"], sd[p + ".norm3.bias"], eps=1e-6)
        x = x + cross(p + ".cross_attn", n3, context)
        x = x + gate_mlp * lin(F.gelu(lin(ln(x) * (1 + scale_mlp) + shift_mlp, p + ".ffn.0"), approximate="tanh"),
                               p + ".ffn.2")
        # wantodance_after_transformer_block
        rows = m.shape[1]
        hs = ln(x.reshape(rows, -1, dim))
        qi = rms(lin(hs, f"music_injector.injector.{i}.q"), sd[f"music_injector.injector.{i}.norm_q.weight"])
        ki = rms(lin(m.reshape(rows, 1, dim), f"music_injector.injector.{i}.k"),
                 sd[f"music_injector.injector.{i}.norm_k.weight"])
        out = lin(attend(qi, ki, lin(m.reshape(rows, 1, dim), f"music_injector.injector.{i}.v"), heads),
                  f"music_injector.injector.{i}.o")
        x = x + out.reshape(1, -1, dim)
    head = "head_global" if int(fps + 0.5) != 30 else "head"
    shift, scale = (sd[head + ".modulation"] + t.unsqueeze(1)).chunk(2, dim=1)
    x = lin(ln(x) * (1 + scale) + shift, head + ".head")
    return x.reshape(1, f, h, w, 1, 2, 2, -1).permute(0, 7, 1, 4, 2, 5, 3, 6).reshape(1, -1, f, h * 2, w * 2)


@pytest.mark.parametrize("fps", [30.0, 7.5])
def test_model_fn_equals_the_reference(fps):
    dit = tiny_dancer_dit()
    g = torch.Generator().manual_seed(8)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    latents, y = r(1, 16, 3, 8, 8), r(1, 20, 3, 8, 8)  # 4 x 4 tokens a frame: two music rows each
    context, clip, ref, music = r(1, 512, 32), r(1, 17, 32), r(1, 17, 32), r(50, 35)
    timestep = torch.tensor([555.0])
    sd = {k: v.float() for k, v in dancer_to_original(dit.state_dict()).items()}
    with torch.no_grad():
        ours = model_fn_wan_dancer(dit, latents, timestep, context, image_embeds=clip, condition=y,
                                   wantodance_refimage_feature=ref, music_feature=music, wantodance_fps=fps)
        theirs = reference(sd, 1, latents, timestep, context, clip, y, ref, music, fps)
    assert ours.shape == theirs.shape == latents.shape
    assert (ours - theirs).abs().max() < 2e-5, (ours - theirs).abs().max()
    with torch.no_grad():
        other = model_fn_wan_dancer(dit, latents, timestep, context, image_embeds=clip, condition=y,
                                    wantodance_refimage_feature=ref, music_feature=music.flip(0), wantodance_fps=fps)
    assert (other - ours).abs().max() > 1e-4  # the music moves the prediction


def test_keyframe_mask_is_the_reference_mask():
    mask = [1, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 1]
    num_frames, height, width = 13, 16, 24
    msk = torch.zeros(1, num_frames, height // 8, width // 8)
    msk[:, torch.tensor(mask) == 1, :, :] = torch.ones(1, height // 8, width // 8)
    msk = torch.concat([torch.repeat_interleave(msk[:, 0:1], repeats=4, dim=1), msk[:, 1:]], dim=1)
    msk = msk.view(1, msk.shape[1] // 4, 4, height // 8, width // 8).transpose(1, 2)[0]
    assert torch.equal(keyframe_mask(mask, num_frames, height, width), msk[None])
    with pytest.raises(UserError, match="12 entries, the clip 13 frames"):
        keyframe_mask(mask[:-1], num_frames, height, width)


def test_music_features_need_librosa_or_give_35_per_frame(tmp_path):
    from support.audio import tone, write_audio

    path = write_audio(tmp_path / "music.wav", tone((330.0, 440.0), seconds=1.0, rate=22050), 22050)
    try:
        import librosa  # noqa: F401
    except ImportError:
        with pytest.raises(UserError, match=r"librosa is not installed: pip install .difftune\[audio\]"):
            music_features(str(path))
        return
    feats = music_features(str(path))
    assert feats.shape[1] == 35 and abs(feats.shape[0] - 31) <= 1 and feats.dtype == torch.float32
