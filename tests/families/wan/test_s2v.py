"""Wan2.2-S2V: the released layout is recognised and loads; the DiT and the audio features equal a step-by-step
rewrite of the reference's formulas (`diffsynth/models/wan_video_dit_s2v.py`, `model_fn_wans2v`,
`diffsynth/models/wav2vec.py`) on the same values, in float32; audio too short for wav2vec2 is one line naming the
file."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from difftune.data.operators import DataError
from difftune.errors import UserError
from difftune.families.wan.components import DIT, DIT_ORIGINAL
from difftune.families.wan.s2v.keys import (AUDIO_ENCODER, S2V_14B_CONFIG, S2V_DIT, WAV2VEC2_XLSR_CONFIG,
                                            infer_s2v_config)
from difftune.families.wan.s2v.model import model_fn_wan_s2v
from difftune.families.wan.s2v.units import load_audio_processor, s2v_audio_embeds
from support.audio import write_wav
from support.wan.s2v import WAV2VEC_FOLDER, tiny_wav2vec2, write_tiny_s2v
from difftune.models.detect import detect_component, match_header
from difftune.models.load import load_component

SPECS = [DIT, S2V_DIT, DIT_ORIGINAL, AUDIO_ENCODER]


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return write_tiny_s2v(tmp_path_factory.mktemp("Wan2.2-S2V-14B"))


# -- recognition ---------------------------------------------------------------------------------------------

def test_released_layout_is_recognised_and_loads(repo, tmp_path):
    det = detect_component(str(repo / "diffusion_pytorch_model.safetensors"), SPECS)
    assert det.spec is S2V_DIT and det.source.endswith("config.json")
    # the same file bare (no config.json): its sizes give the config
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(repo / "diffusion_pytorch_model.safetensors", bare)
    det_bare = detect_component(str(bare / "diffusion_pytorch_model.safetensors"), SPECS)
    assert det_bare.spec is S2V_DIT and det_bare.source == "weights match the sizes in the weights"
    for key in ("dim", "num_layers", "audio_dim", "audio_layers", "num_audio_token", "cond_dim", "ffn_dim"):
        assert det_bare.config[key] == det.config[key], key
    loaded = load_component(str(bare / "diffusion_pytorch_model.safetensors"), SPECS, torch_dtype=torch.float32)
    from safetensors.torch import load_file

    state = load_file(str(repo / "diffusion_pytorch_model.safetensors"))
    model_state = loaded.module.state_dict()
    assert set(model_state) == set(state)
    assert all(torch.equal(model_state[k], state[k]) for k in state)


def test_the_14b_config_is_recognised_from_its_shapes():
    signature = S2V_DIT.signature(S2V_14B_CONFIG)
    assert signature["blocks.39.self_attn.q.weight"] == (5120, 5120)
    assert signature["casual_audio_encoder.weights"] == (1, 25, 1, 1)
    assert signature["audio_injector.injector.11.q.weight"] == (5120, 5120)
    assert infer_s2v_config(signature) == S2V_14B_CONFIG
    match = match_header(signature, SPECS)
    assert match.spec is S2V_DIT and match.label == "Wan2.2-S2V-14B"


def test_wav2vec2_file_in_older_names_loads(repo):
    path = repo / WAV2VEC_FOLDER / "model.safetensors"
    det = detect_component(str(path), SPECS)
    assert det.spec is AUDIO_ENCODER
    loaded = load_component(str(path), SPECS, torch_dtype=torch.float32)
    module = loaded.module
    reference = tiny_wav2vec2()
    assert all(torch.equal(module.state_dict()[k], v) for k, v in reference.state_dict().items())
    # the released 300M file's shapes, in its names, match the known config
    from difftune.families.wan.s2v.keys import wav2vec2_from_file

    signature = AUDIO_ENCODER.signature(WAV2VEC2_XLSR_CONFIG)
    old = {k.replace("parametrizations.weight.original0", "weight_g")
           .replace("parametrizations.weight.original1", "weight_v"): s for k, s in signature.items()}
    assert set(wav2vec2_from_file({k: 0 for k in old})) == set(signature)
    match = match_header(old, SPECS)
    assert match.spec is AUDIO_ENCODER and match.label == "wav2vec2-large-xlsr-53"


# -- the reference's formulas, step by step ------------------------------------------------------------------

def ref_sinusoid(dim, position):
    sinusoid = torch.outer(position.double(), torch.pow(10000, -torch.arange(dim // 2).double().div(dim // 2)))
    return torch.cat([torch.cos(sinusoid), torch.sin(sinusoid)], dim=1).to(position.dtype)


def ref_freqs(head_dim, end=1024):
    def one(dim):
        freqs = 1.0 / (10000 ** (torch.arange(0, dim, 2)[: dim // 2].double() / dim))
        freqs = torch.outer(torch.arange(end), freqs)
        return torch.polar(torch.ones_like(freqs), freqs)
    return torch.cat([one(head_dim - 2 * (head_dim // 3)), one(head_dim // 3), one(head_dim // 3)], dim=1)


def ref_rope(x, freqs, heads):
    b, s, _ = x.shape
    xc = torch.view_as_complex(x.double().reshape(b, s, heads, -1, 2))
    return torch.view_as_real(xc * freqs).flatten(2).to(x.dtype)


def ref_rms(x, w, eps=1e-6):
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def ref_attn(sd, p, x, y, heads, freqs=None):
    q = ref_rms(F.linear(x, sd[p + "q.weight"], sd[p + "q.bias"]), sd[p + "norm_q.weight"])
    k = ref_rms(F.linear(y, sd[p + "k.weight"], sd[p + "k.bias"]), sd[p + "norm_k.weight"])
    v = F.linear(y, sd[p + "v.weight"], sd[p + "v.bias"])
    if freqs is not None:
        q, k = ref_rope(q, freqs, heads), ref_rope(k, freqs, heads)
    b = q.shape[0]
    q, k, v = (t.reshape(b, t.shape[1], heads, -1).transpose(1, 2) for t in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
    return F.linear(o, sd[p + "o.weight"], sd[p + "o.bias"])


def ref_causal_conv(sd, p, x, stride=1):
    w = sd[p + "conv.weight"]
    return F.conv1d(F.pad(x, (w.shape[-1] - 1, 0), mode="replicate"), w, sd[p + "conv.bias"], stride=stride)


def ref_audio_encoder(sd, features, tokens):
    """CausalAudioEncoder + MotionEncoder_tc as the reference writes them (einops patterns spelled out)."""
    w = F.silu(sd["casual_audio_encoder.weights"])
    x = ((features * w) / w.sum(dim=1, keepdim=True)).sum(dim=1).permute(0, 2, 1)  # b t c
    e = "casual_audio_encoder.encoder."
    x = x.permute(0, 2, 1)  # b c t
    x_ori = x.clone()
    b = x.shape[0]
    hidden = sd[e + "conv3.conv.weight"].shape[0]
    ln = lambda t, n: F.layer_norm(t, (n,), eps=1e-6)  # noqa: E731
    x = ref_causal_conv(sd, e + "conv1_local.", x)
    x = x.reshape(b, tokens, -1, x.shape[-1]).reshape(b * tokens, -1, x.shape[-1]).permute(0, 2, 1)
    x = F.silu(ln(x, hidden // 4)).permute(0, 2, 1)
    x = ref_causal_conv(sd, e + "conv2.", x, 2).permute(0, 2, 1)
    x = F.silu(ln(x, hidden // 2)).permute(0, 2, 1)
    x = ref_causal_conv(sd, e + "conv3.", x, 2).permute(0, 2, 1)
    x = F.silu(ln(x, hidden))
    x = x.reshape(b, tokens, x.shape[1], hidden).permute(0, 2, 1, 3)
    x_local = torch.cat([x, sd[e + "padding_tokens"].repeat(b, x.shape[1], 1, 1)], dim=-2)
    g = ref_causal_conv(sd, e + "conv1_global.", x_ori).permute(0, 2, 1)
    g = F.silu(ln(g, hidden // 4)).permute(0, 2, 1)
    g = ref_causal_conv(sd, e + "conv2.", g, 2).permute(0, 2, 1)
    g = F.silu(ln(g, hidden // 2)).permute(0, 2, 1)
    g = ref_causal_conv(sd, e + "conv3.", g, 2).permute(0, 2, 1)
    g = F.silu(ln(g, hidden))
    g = F.linear(g, sd[e + "final_linear.weight"], sd[e + "final_linear.bias"])
    return g.reshape(b, 1, g.shape[1], hidden).permute(0, 2, 1, 3), x_local


def ref_model_fn(dit, latents, timestep, context, audio_input, pose):
    """model_fn_wans2v + WanS2VModel's pieces, batch 1, drop_motion_frames=True."""
    sd = {k: v.float() for k, v in dit.state_dict().items()}
    c = dit.config
    heads, dim = c.num_heads, c.dim
    lin = lambda x, p: F.linear(x, sd[p + ".weight"], sd[p + ".bias"])  # noqa: E731
    origin_ref = latents[:, :, 0:1]
    x = latents[:, :, 1:]
    context = lin(F.gelu(lin(context, "text_embedding.0"), approximate="tanh"), "text_embedding.2")
    # cal_audio_emb
    audio_input = torch.cat([audio_input[..., 0:1].repeat(1, 1, 1, 73), audio_input], dim=-1)
    glob, local = ref_audio_encoder(sd, audio_input, c.num_audio_token)
    glob, merged = glob[:, 19:], local[:, 19:]
    conv = lambda t, p: F.conv3d(t, sd[p + ".weight"], sd[p + ".bias"], stride=(1, 2, 2))  # noqa: E731
    x = conv(x, "patch_embedding") + conv(pose, "cond_encoder")
    f, h, w = x.shape[2:]
    x = x.flatten(2).transpose(1, 2)
    seq_len_x = x.shape[1]
    r = conv(origin_ref, "patch_embedding")
    rh, rw = r.shape[3:]
    x = torch.cat([x, r.flatten(2).transpose(1, 2)], dim=1)
    mask = torch.cat([torch.zeros([1, seq_len_x]), torch.ones([1, rh * rw])], dim=1).long()
    # rope_precompute: the clip's grid from 0, the reference at frame 30 (f_sam = [30])
    table = ref_freqs(dim // heads)
    c0 = (dim // heads) // 2
    split = table.split([c0 - 2 * (c0 // 3), c0 // 3, c0 // 3], dim=1)
    def grid(f0, nf, nh, nw):
        fs = np.linspace(f0, f0 + nf - 1, nf).astype(int).tolist()
        hs = np.linspace(0, nh - 1, nh).astype(int).tolist()
        ws = np.linspace(0, nw - 1, nw).astype(int).tolist()
        return torch.cat([split[0][fs].view(nf, 1, 1, -1).expand(nf, nh, nw, -1),
                          split[1][hs].view(1, nh, 1, -1).expand(nf, nh, nw, -1),
                          split[2][ws].view(1, 1, nw, -1).expand(nf, nh, nw, -1)], dim=-1).reshape(nf * nh * nw, 1, -1)
    freqs = torch.cat([grid(0, f, h, w), grid(30, 1, rh, rw)])
    x = x + sd["trainable_cond_mask.weight"][mask[0]][None]
    timestep = torch.cat([timestep, torch.zeros([1], dtype=timestep.dtype)])
    t = lin(F.silu(lin(ref_sinusoid(c.freq_dim, timestep), "time_embedding.0")), "time_embedding.2")
    t_mod = lin(F.silu(t), "time_projection.1").unflatten(1, (6, dim)).unsqueeze(2).transpose(0, 2)
    inject = {b: n for n, b in enumerate(i for i in c.audio_inject_layers if i < c.num_layers)}
    for i in range(c.num_layers):
        p = f"blocks.{i}."
        mods = (sd[p + "modulation"].unsqueeze(2) + t_mod).chunk(6, dim=1)
        mods = [torch.cat([m[:, :, 0].expand(1, seq_len_x, dim), m[:, :, 1].expand(1, x.shape[1] - seq_len_x, dim)],
                          dim=1) for m in mods]
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mods
        ln = lambda t: F.layer_norm(t, (dim,), eps=1e-6)  # noqa: E731
        x = x + gate_msa * ref_attn(sd, p + "self_attn.", ln(x) * (1 + scale_msa) + shift_msa,
                                    ln(x) * (1 + scale_msa) + shift_msa, heads, freqs)
        n3 = F.layer_norm(x, (dim,), sd[p + "norm3.weight"], sd[p + "norm3.bias"], eps=1e-6)
        x = x + ref_attn(sd, p + "cross_attn.", n3, context, heads)
        x = x + gate_mlp * lin(F.gelu(lin(ln(x) * (1 + scale_mlp) + shift_mlp, p + "ffn.0"), approximate="tanh"),
                               p + "ffn.2")
        if i in inject:
            a = f"audio_injector.injector_adain_layers.{inject[i]}.linear"
            frames = merged.shape[1]
            hs = x[:, :seq_len_x].clone().reshape(1 * frames, seq_len_x // frames, dim)
            temb = lin(F.silu(glob.reshape(frames, 1, dim)[:, 0]), a)
            shift, scale = temb.chunk(2, dim=1)
            hs = F.layer_norm(hs, (dim,), eps=1e-5) * (1 + scale[:, None]) + shift[:, None]
            audio = merged.reshape(frames, -1, dim)
            out = ref_attn(sd, f"audio_injector.injector.{inject[i]}.", hs, audio, heads)
            x = x.clone()
            x[:, :seq_len_x] = x[:, :seq_len_x] + out.reshape(1, seq_len_x, dim)
    x = x[:, :seq_len_x]
    shift, scale = (sd["head.modulation"] + t[:-1].unsqueeze(1)).chunk(2, dim=1)
    x = lin(F.layer_norm(x, (dim,), eps=1e-6) * (1 + scale) + shift, "head.head")
    x = x.reshape(1, f, h, w, 1, 2, 2, -1).permute(0, 7, 1, 4, 2, 5, 3, 6).reshape(1, -1, f, h * 2, w * 2)
    return torch.cat([origin_ref, x], dim=2)


def test_dit_equals_the_reference_formula():
    from support.wan.s2v import tiny_s2v_dit

    dit = tiny_s2v_dit()
    g = torch.Generator().manual_seed(3)
    latents = torch.randn(1, 16, 3, 4, 6, generator=g)  # reference frame + 2 latent frames (9-frame clip)
    context = torch.randn(1, 7, 32, generator=g)
    audio = torch.randn(1, 3, 32, 8, generator=g)  # (1, layers, hidden, num_frames - 1)
    pose = torch.randn(1, 16, 2, 4, 6, generator=g)
    timestep = torch.tensor([637.0])
    with torch.no_grad():
        ours = model_fn_wan_s2v(dit, latents, timestep, context, audio, pose, first_frame_latents=latents[:, :, :1])
        ref = ref_model_fn(dit, latents, timestep, context, audio, pose)
    assert ours.shape == ref.shape == latents.shape
    assert torch.equal(ours[:, :, 0], latents[:, :, 0])
    assert (ours - ref).abs().max() < 2e-5, (ours - ref).abs().max()
    # every input moves the prediction
    with torch.no_grad():
        other_audio = model_fn_wan_s2v(dit, latents, timestep, context, audio * 0.5, pose)
        other_pose = model_fn_wan_s2v(dit, latents, timestep, context, audio, None)
        other_ref = model_fn_wan_s2v(dit, latents, timestep, context, audio, pose,
                                     first_frame_latents=torch.zeros_like(latents[:, :, :1]))
    for other in (other_audio, other_pose, other_ref):
        assert (other[:, :, 1:] - ours[:, :, 1:]).abs().max() > 1e-3


def test_dit_gradients_reach_every_trained_part():
    from support.wan.s2v import tiny_s2v_dit

    dit = tiny_s2v_dit()
    g = torch.Generator().manual_seed(4)
    out = model_fn_wan_s2v(dit, torch.randn(1, 16, 2, 4, 4, generator=g), torch.tensor([300.0]),
                           torch.randn(1, 5, 32, generator=g), torch.randn(1, 3, 32, 4, generator=g),
                           torch.randn(1, 16, 1, 4, 4, generator=g))
    out[:, :, 1:].square().mean().backward()
    unused = {n for n, p in dit.named_parameters() if p.grad is None or not p.grad.abs().sum()}
    # only the motion-frame packer (motion frames are dropped in training, as in the reference)
    assert unused == {"frame_packer.proj.weight", "frame_packer.proj.bias", "frame_packer.proj_2x.weight",
                      "frame_packer.proj_2x.bias", "frame_packer.proj_4x.weight", "frame_packer.proj_4x.bias"}


# -- the audio features ---------------------------------------------------------------------------------------

def ref_audio_feats(model, processor, audio, num_frames, fps=16, video_rate=30):
    """WanS2VAudioEncoder.get_audio_feats_per_inference(...)[0] with batch_frames = num_frames - 1, m = 0."""
    values = processor(audio, sampling_rate=16000, return_tensors="pt").input_values
    res = model(values, output_hidden_states=True)
    feat = torch.cat(res.hidden_states)
    feat = feat.transpose(1, 2)
    out_len = int(feat.shape[2] / 50.0 * video_rate)
    feat = F.interpolate(feat, size=out_len, align_corners=True, mode="linear").transpose(1, 2)
    num_layers, audio_frame_num, audio_dim = feat.shape
    batch_frames = num_frames - 1
    scale = video_rate / fps
    min_batch_num = int(audio_frame_num / (batch_frames * scale)) + 1
    bucket_num = min_batch_num * batch_frames
    padd = math.ceil(min_batch_num * batch_frames / fps * video_rate) - audio_frame_num
    # get_sample_indices(original_fps=30, total_frames=..., target_fps=fps, num_sample=bucket_num, fixed_start=0)
    total = audio_frame_num + padd
    required = bucket_num / fps
    assert required <= total / video_rate
    points = np.linspace(0, required, bucket_num, endpoint=False)
    idx = np.clip(np.round(points * video_rate).astype(int), 0, total - 1)
    stride = int(video_rate / fps)
    rows = []
    for bi in idx:
        if bi < audio_frame_num:
            chosen = [min(max(c, 0), audio_frame_num - 1) for c in range(bi, bi + stride, stride)]
            rows.append(feat[:, chosen].flatten(start_dim=-2, end_dim=-1))
        else:
            rows.append(torch.zeros([num_layers, audio_dim]))
    bucket = torch.stack(rows).unsqueeze(0).permute(0, 2, 3, 1)
    return bucket[..., :batch_frames]


@pytest.mark.parametrize("seconds,num_frames", [(0.42, 13), (1.3, 9)])
def test_audio_features_equal_the_reference(repo, seconds, num_frames):
    model = tiny_wav2vec2()
    processor = load_audio_processor(str(repo / WAV2VEC_FOLDER))
    t = np.arange(int(seconds * 16000)) / 16000
    audio = (0.4 * np.sin(2 * np.pi * 220 * t) + 0.1 * np.sin(2 * np.pi * 1375 * t)).astype(np.float32)
    with torch.no_grad():
        ours = s2v_audio_embeds(model, processor, audio, num_frames)
        ref = ref_audio_feats(model, processor, audio, num_frames)
    assert ours.shape == ref.shape == (1, 3, 32, num_frames - 1)
    assert torch.equal(ours, ref)
    if seconds < 0.5:  # 12 frames at 16 fps outlast 0.42 s of audio: the last ones are zero
        assert not ours[..., -1].any() and ours[..., 0].abs().sum() > 0
    other = s2v_audio_embeds(model, processor, audio[::-1].copy(), num_frames)
    assert not torch.equal(other, ours)


def test_audio_too_short_for_the_encoder_is_one_line_naming_the_file(tmp_path):
    """20 ms of audio reached wav2vec2's first convolution (400 samples wide) and ended in a conv1d traceback."""
    from difftune.families.wan.s2v import WanS2VPipeline
    from difftune.families.wan.s2v.units import S2V_MIN_AUDIO_SECONDS

    class Config:
        dataset_base_path = str(tmp_path)

    path = write_wav(tmp_path / "short.wav", np.full((320, 1), 0.1), 16000)
    op = WanS2VPipeline.data_operators(Config())["input_audio"]
    context = {"where": "row 2", "key": "input_audio"}
    for run in (op.check, op):
        with pytest.raises(DataError) as err:
            run("short.wav", context)
        msg = str(err.value)
        assert "\n" not in msg and msg.startswith("row 2 'input_audio'") and str(path) in msg
        assert "0.02 s" in msg and f"{S2V_MIN_AUDIO_SECONDS:g} s" in msg
    ok = write_wav(tmp_path / "ok.wav", np.full((800, 1), 0.1), 16000)
    assert op("ok.wav", context).shape == (800,)


def test_s2v_audio_embeds_refuses_a_waveform_shorter_than_the_encoder_takes(tmp_path):
    repo = write_tiny_s2v(tmp_path / "s2v")
    processor = load_audio_processor(str(repo / WAV2VEC_FOLDER))
    with pytest.raises(UserError, match=r"^input_audio: 320 samples \(0\.02 s\) at 16000 Hz; wav2vec2 needs at "
                                        r"least 400"):
        s2v_audio_embeds(tiny_wav2vec2(), processor, np.zeros(320, np.float32), 5)
