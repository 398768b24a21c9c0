"""Video-As-Prompt: the released transformer file gives both slots (the Wan I2V DiT and the branch, in the
reference's MotWanModel names); model_fn equals a step-by-step rewrite of the reference's `model_fn_wan_video`
VAP path (`diffsynth/models/wan_video_mot.py`, Wan's DiTBlock) on the same values, in float32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from difftune.families.wan.components import WAN_DIT_CONFIGS
from support.wan.vap import (MOT_LAYERS, TRANSFORMER_FOLDER, tiny_vap_branch, tiny_vap_dit,
                                               write_tiny_vap)
from difftune.families.wan.vap.keys import VAP, VAP_14B_CONFIG, VAP_DIT, released_name, vap_from_released
from difftune.families.wan.vap.model import model_fn_wan_vap
from difftune.models.detect import match_header
from difftune.models.load import load_component


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return write_tiny_vap(tmp_path_factory.mktemp("models"))


def test_one_file_gives_the_dit_and_the_branch(models):
    from difftune.families.wan import FAMILY
    from difftune.models.detect import detect_components

    files = [str(models / TRANSFORMER_FOLDER / "diffusion_pytorch_model.safetensors")]
    dit_det, vap_det = detect_components(files, FAMILY.components)  # the DiT, then its companion
    assert dit_det.spec is VAP_DIT and dit_det.source.endswith("config.json")
    assert vap_det.spec is VAP and vap_det.config["mot_layers"] == MOT_LAYERS and vap_det.config["num_heads"] == 1
    dit = load_component(files, detected=dit_det, torch_dtype=torch.float32).module
    vap = load_component(files, detected=vap_det, torch_dtype=torch.float32).module
    assert all(torch.equal(dit.state_dict()[k], v) for k, v in tiny_vap_dit().state_dict().items())
    # the branch in the reference's MotWanModel names: what `pipe.vap.load_state_dict` takes
    reference = tiny_vap_branch()
    assert set(vap.state_dict()) == set(reference.state_dict())
    assert "blocks.0.self_attn.q.weight" in reference.state_dict() and "img_emb.proj.1.weight" in reference.state_dict()
    assert all(torch.equal(vap.state_dict()[k], v) for k, v in reference.state_dict().items())


def test_the_14b_file_is_recognised_from_its_shapes():
    dit_config = dict(WAN_DIT_CONFIGS["Wan2.1-I2V-14B"], _class_name="WanTransformer3DMOTModel")
    dit_sig = VAP_DIT.signature(dit_config)
    vap_sig = VAP.signature(VAP_14B_CONFIG)
    released = dict(dit_sig)
    for key, shape in vap_sig.items():
        if key.startswith("blocks."):
            _, block, rest = key.split(".", 2)
            key = f"blocks.{VAP_14B_CONFIG['mot_layers'][int(block)]}.{rest}"
        released[released_name(key)] = shape
    assert released["blocks.36.attn1_mot_ref.to_q.weight"] == (5120, 5120)
    assert set(vap_from_released({k: 0 for k in released})) == set(vap_sig)
    assert match_header(released, [VAP_DIT]).label.startswith("Video-As-Prompt-Wan2.1-14B")
    assert match_header(released, [VAP]).label == "Video-As-Prompt-Wan2.1-14B"


# -- the reference, step by step ------------------------------------------------------------------------------

def sinusoid(dim, position):
    s = torch.outer(position.double(), torch.pow(10000, -torch.arange(dim // 2).double().div(dim // 2)))
    return torch.cat([torch.cos(s), torch.sin(s)], dim=1).to(position.dtype)


def freqs_1d(dim, start=0, end=64):
    f = 1.0 / (10000 ** (torch.arange(0, dim, 2)[: dim // 2].double() / dim))
    f = torch.outer(torch.arange(start, end), f)
    return torch.polar(torch.ones_like(f), f)


def grid_freqs(head_dim, f, h, w, start=0):
    dims = (head_dim - 2 * (head_dim // 3), head_dim // 3, head_dim // 3)
    t0, t1, t2 = freqs_1d(dims[0], start), freqs_1d(dims[1]), freqs_1d(dims[2])
    return torch.cat([t0[:f].view(f, 1, 1, -1).expand(f, h, w, -1), t1[:h].view(1, h, 1, -1).expand(f, h, w, -1),
                      t2[:w].view(1, 1, w, -1).expand(f, h, w, -1)], dim=-1).reshape(f * h * w, 1, -1)


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


class Wan:
    """The reference's WanModel pieces over a weight dict in its names."""

    def __init__(self, sd, heads, image_tokens):
        self.sd, self.heads, self.image_tokens = sd, heads, image_tokens

    def lin(self, x, p):
        return F.linear(x, self.sd[p + ".weight"], self.sd[p + ".bias"])

    def mlp(self, x, p):
        d_in, d_out = self.sd[p + ".1.weight"].shape[1], self.sd[p + ".3.weight"].shape[0]
        x = F.layer_norm(x, (d_in,), self.sd[p + ".0.weight"], self.sd[p + ".0.bias"])
        x = self.lin(F.gelu(self.lin(x, p + ".1")), p + ".3")
        return F.layer_norm(x, (d_out,), self.sd[p + ".4.weight"], self.sd[p + ".4.bias"])

    def qkv(self, p, x, freqs):
        q = rms(self.lin(x, p + ".q"), self.sd[p + ".norm_q.weight"])
        k = rms(self.lin(x, p + ".k"), self.sd[p + ".norm_k.weight"])
        return rope(q, freqs, self.heads), rope(k, freqs, self.heads), self.lin(x, p + ".v")

    def cross(self, p, x, y):
        img, ctx = y[:, :self.image_tokens], y[:, self.image_tokens:]
        q = rms(self.lin(x, p + ".q"), self.sd[p + ".norm_q.weight"])
        out = attend(q, rms(self.lin(ctx, p + ".k"), self.sd[p + ".norm_k.weight"]), self.lin(ctx, p + ".v"),
                     self.heads)
        if p + ".k_img.weight" in self.sd:
            out = out + attend(q, rms(self.lin(img, p + ".k_img"), self.sd[p + ".norm_k_img.weight"]),
                               self.lin(img, p + ".v_img"), self.heads)
        return self.lin(out, p + ".o")


def wan_names(state):
    """diffusers' Wan DiT names -> the reference's (WanVideoDiTFromDiffusers' table, written out)."""
    table = {"attn1.to_q": "self_attn.q", "attn1.to_k": "self_attn.k", "attn1.to_v": "self_attn.v",
             "attn1.to_out.0": "self_attn.o", "attn1.norm_q": "self_attn.norm_q", "attn1.norm_k": "self_attn.norm_k",
             "attn2.to_q": "cross_attn.q", "attn2.to_k": "cross_attn.k", "attn2.to_v": "cross_attn.v",
             "attn2.to_out.0": "cross_attn.o", "attn2.norm_q": "cross_attn.norm_q",
             "attn2.norm_k": "cross_attn.norm_k", "attn2.add_k_proj": "cross_attn.k_img",
             "attn2.add_v_proj": "cross_attn.v_img", "attn2.norm_added_k": "cross_attn.norm_k_img",
             "ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2", "norm2": "norm3"}
    top = {"condition_embedder.text_embedder.linear_1": "text_embedding.0",
           "condition_embedder.text_embedder.linear_2": "text_embedding.2",
           "condition_embedder.time_embedder.linear_1": "time_embedding.0",
           "condition_embedder.time_embedder.linear_2": "time_embedding.2",
           "condition_embedder.time_proj": "time_projection.1",
           "condition_embedder.image_embedder.norm1": "img_emb.proj.0",
           "condition_embedder.image_embedder.ff.net.0.proj": "img_emb.proj.1",
           "condition_embedder.image_embedder.ff.net.2": "img_emb.proj.3",
           "condition_embedder.image_embedder.norm2": "img_emb.proj.4", "proj_out": "head.head",
           "patch_embedding": "patch_embedding"}
    out = {}
    for key, value in state.items():
        if key == "scale_shift_table":
            out["head.modulation"] = value
            continue
        if key.startswith("blocks."):
            _, i, rest = key.split(".", 2)
            if rest == "scale_shift_table":
                out[f"blocks.{i}.modulation"] = value
                continue
            module, _, leaf = rest.rpartition(".")
            out[f"blocks.{i}.{table[module]}.{leaf}"] = value
            continue
        module, _, leaf = key.rpartition(".")
        out[f"{top[module]}.{leaf}"] = value
    return out


def reference_model_fn(dit, vap, latents, timestep, context, clip_feature, y, vap_hidden_state, vap_clip_feature,
                       context_vap, image_tokens):
    sd = {k: v.float() for k, v in wan_names(dit.state_dict()).items()}
    vsd = {k: v.float() for k, v in vap.state_dict().items()}
    heads = dit.config.num_attention_heads
    dim = heads * dit.config.attention_head_dim
    main, branch = Wan(sd, heads, image_tokens), Wan(vsd, heads, image_tokens)
    t = main.lin(F.silu(main.lin(sinusoid(16, timestep), "time_embedding.0")), "time_embedding.2")
    t_mod = main.lin(F.silu(t), "time_projection.1").unflatten(1, (6, dim))
    context = main.lin(F.gelu(main.lin(context, "text_embedding.0"), approximate="tanh"), "text_embedding.2")
    x = torch.cat([latents, y], dim=1)
    context = torch.cat([main.mlp(clip_feature, "img_emb.proj"), context], dim=1)
    x = F.conv3d(x, sd["patch_embedding.weight"], sd["patch_embedding.bias"], stride=(1, 2, 2))
    f, h, w = x.shape[2:]
    x = x.flatten(2).transpose(1, 2)
    freqs = grid_freqs(dim // heads, f, h, w)
    # VAP
    x_vap = F.conv3d(vap_hidden_state, vsd["patch_embedding.weight"], vsd["patch_embedding.bias"], stride=(1, 2, 2))
    x_vap = x_vap.flatten(2).transpose(1, 2)
    clean = torch.ones(timestep.shape, dtype=timestep.dtype)
    tv = branch.lin(F.silu(branch.lin(sinusoid(16, clean), "time_embedding.0")), "time_embedding.2")
    t_mod_vap = branch.lin(F.silu(tv), "time_projection.1").unflatten(1, (6, dim))
    freqs_vap = grid_freqs(dim // heads, f, h, w, start=-f)
    ctx_vap = branch.lin(F.gelu(branch.lin(context_vap, "text_embedding.0"), approximate="tanh"), "text_embedding.2")
    ctx_vap = torch.cat([branch.mlp(vap_clip_feature, "img_emb.proj"), ctx_vap], dim=1)
    ln = lambda z: F.layer_norm(z, (dim,), eps=1e-6)  # noqa: E731
    mapping = {b: n for n, b in enumerate(vap.config.mot_layers)}
    for i in range(dit.config.num_layers):
        p = f"blocks.{i}"
        mods = (sd[p + ".modulation"] + t_mod).chunk(6, dim=1)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mods
        n3 = lambda z, s, pp: F.layer_norm(z, (dim,), s[pp + ".norm3.weight"], s[pp + ".norm3.bias"], eps=1e-6)  # noqa: E731
        if i in mapping:
            vp = f"blocks.{mapping[i]}"
            vm = (vsd[vp + ".modulation"] + t_mod_vap.float()).chunk(6, dim=1)
            vshift, vscale, vgate, vc_shift, vc_scale, vc_gate = vm
            q, k, v = main.qkv(p + ".self_attn", ln(x) * (1 + scale_msa) + shift_msa, freqs)
            qm, km, vmv = branch.qkv(vp + ".self_attn", ln(x_vap) * (1 + vscale) + vshift, freqs_vap)
            joint = attend(torch.cat([q, qm], dim=-2), torch.cat([k, km], dim=-2), torch.cat([v, vmv], dim=-2), heads)
            a, am = joint[:, :q.shape[1]], joint[:, q.shape[1]:]
            x = x + gate_msa * main.lin(a, p + ".self_attn.o")
            x_vap = x_vap + branch.lin(am, vp + ".self_attn.o") * vgate
            x = x + main.cross(p + ".cross_attn", n3(x, sd, p), context)
            x = x + gate_mlp * main.lin(F.gelu(main.lin(ln(x) * (1 + scale_mlp) + shift_mlp, p + ".ffn.0"),
                                               approximate="tanh"), p + ".ffn.2")
            x_vap = x_vap + branch.cross(vp + ".cross_attn", n3(x_vap, vsd, vp), ctx_vap)
            hv = ln(x_vap) * (1 + vc_scale) + vc_shift
            x_vap = x_vap + branch.lin(F.gelu(branch.lin(hv, vp + ".ffn.0"), approximate="tanh"), vp + ".ffn.2") * vc_gate
        else:
            q, k, v = main.qkv(p + ".self_attn", ln(x) * (1 + scale_msa) + shift_msa, freqs)
            x = x + gate_msa * main.lin(attend(q, k, v, heads), p + ".self_attn.o")
            x = x + main.cross(p + ".cross_attn", n3(x, sd, p), context)
            x = x + gate_mlp * main.lin(F.gelu(main.lin(ln(x) * (1 + scale_mlp) + shift_mlp, p + ".ffn.0"),
                                               approximate="tanh"), p + ".ffn.2")
    shift, scale = (sd["head.modulation"] + t.unsqueeze(1)).chunk(2, dim=1)
    x = main.lin(ln(x) * (1 + scale) + shift, "head.head")
    return x.reshape(1, f, h, w, 1, 2, 2, -1).permute(0, 7, 1, 4, 2, 5, 3, 6).reshape(1, -1, f, h * 2, w * 2)


def _inputs(seed=6):
    from support import CLIP_TOKENS

    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(latents=r(1, 16, 2, 4, 6), context=r(1, 512, 32), clip_feature=r(1, CLIP_TOKENS, 32),
                y=r(1, 20, 2, 4, 6), vap_hidden_state=r(1, 36, 2, 4, 6), vap_clip_feature=r(1, CLIP_TOKENS, 32),
                context_vap=r(1, 512, 32)), CLIP_TOKENS


def test_model_fn_equals_the_reference():
    dit, vap = tiny_vap_dit(), tiny_vap_branch()
    values, tokens = _inputs()
    timestep = torch.tensor([421.0])
    with torch.no_grad():
        ours = model_fn_wan_vap(dit, vap, values["latents"], timestep, values["context"],
                                image_embeds=values["clip_feature"], condition=values["y"],
                                vap_hidden_state=values["vap_hidden_state"],
                                vap_clip_feature=values["vap_clip_feature"], context_vap=values["context_vap"])
        ref = reference_model_fn(dit, vap, timestep=timestep, image_tokens=tokens, **values)
    assert ours.shape == ref.shape == values["latents"].shape
    assert (ours - ref).abs().max() < 5e-5, (ours - ref).abs().max()  # fp32 round-off over 128-wide heads
    # the reference clip moves the prediction
    with torch.no_grad():
        other = model_fn_wan_vap(dit, vap, values["latents"], timestep, values["context"],
                                 image_embeds=values["clip_feature"], condition=values["y"],
                                 vap_hidden_state=values["vap_hidden_state"].flip(2),
                                 vap_clip_feature=values["vap_clip_feature"], context_vap=values["context_vap"])
    assert (other - ours).abs().max() > 1e-3


def test_training_the_branch_reaches_all_of_it():
    dit, vap = tiny_vap_dit(), tiny_vap_branch(mot_layers=(0, 1))  # a branch block beside both DiT blocks
    dit.requires_grad_(False)
    values, _ = _inputs(7)
    out = model_fn_wan_vap(dit, vap, values["latents"], torch.tensor([300.0]), values["context"],
                           image_embeds=values["clip_feature"], condition=values["y"],
                           vap_hidden_state=values["vap_hidden_state"], vap_clip_feature=values["vap_clip_feature"],
                           context_vap=values["context_vap"], use_gradient_checkpointing=True)
    out.square().mean().backward()
    # in the last joint self-attention the branch's keys and values serve the clip's queries; its own queries,
    # output projection, cross-attention and FFN feed only branch tokens nothing reads: they get no gradient (as
    # in the reference); everything else does
    without = {n for n, p in vap.named_parameters() if p.grad is None or not p.grad.abs().sum()}
    last = ("blocks.1.self_attn.q.", "blocks.1.self_attn.norm_q.", "blocks.1.self_attn.o.", "blocks.1.cross_attn.",
            "blocks.1.norm3.", "blocks.1.ffn.")
    assert without == {n for n, _ in vap.named_parameters() if n.startswith(last)}, without
