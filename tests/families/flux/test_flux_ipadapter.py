"""The InstantX FLUX IP-Adapter: ip-adapter.bin (nested pickle) recognised and loaded by its own names (and the
reference's saved names); SigLIP's pooled features from the whole-SigLIP file; the image attention against a
step-by-step rewrite of the reference's formula (double and single blocks)."""

import math

import numpy as np
import pytest
import torch
from PIL import Image

from difftune.families.flux.attention import use_feature_attention
from difftune.families.flux.model_fn import model_fn_flux
from difftune.families.flux.ipadapter import (IPADAPTER, IPADAPTER_IMAGE_ENCODER, FluxIPAdapterImageEncoder,
                                              ipadapter_key, ipadapter_native_keys)
from support.flux import run_unit_on, with_config, write_tiny_ipadapter, write_tiny_siglip
from support.flux.variants import tiny_ipadapter_config
from difftune.models.detect import detect_component
from difftune.models.files import load_pth
from difftune.models.load import load_component


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("ipa")
    return {"ipadapter": write_tiny_ipadapter(root / "FLUX.1-dev-IP-Adapter"),
            "siglip": write_tiny_siglip(root / "siglip-so400m-patch14-384")}


@pytest.fixture(scope="module")
def ipadapter(files):
    spec = with_config(IPADAPTER, tiny_ipadapter_config())
    return load_component(str(files["ipadapter"]), [spec], torch_dtype=torch.float32).module


def test_release_is_read_by_its_own_names(files, ipadapter):
    assert detect_component(str(files["ipadapter"]), [with_config(IPADAPTER, tiny_ipadapter_config())]).name == \
        "ipadapter"
    raw = load_pth(files["ipadapter"])  # {"image_proj": ..., "ip_adapter": ...} flattened
    assert {k.split(".")[0] for k in raw} == {"image_proj", "ip_adapter"}
    native = ipadapter_native_keys(ipadapter.state_dict())
    assert set(native) == set(raw) and all(torch.equal(native[k], raw[k]) for k in raw)
    # what the reference saves with --remove_prefix_in_ckpt pipe.ipadapter.
    assert ipadapter_key("ipadapter_modules.3.to_k_ip.weight") == "ip_adapter.3.to_k_ip.weight"
    assert ipadapter_key("image_proj.proj.2.bias") == "image_proj.ff.net.2.bias"
    full = IPADAPTER.signature(IPADAPTER.known_configs["InstantX/FLUX.1-dev-IP-Adapter"])
    assert full["image_proj.ff.net.2.weight"] == (128 * 4096, 2304) and full["ip_adapter.56.to_v_ip.weight"] == \
        (3072, 4096)
    assert IPADAPTER.infer_config(full) == IPADAPTER.known_configs["InstantX/FLUX.1-dev-IP-Adapter"]


def _image(seed):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (40, 30, 3), dtype=np.uint8))


@torch.no_grad()
def test_siglip_pooled_features_from_the_whole_siglip_file(files):
    from safetensors.torch import load_file
    from transformers import SiglipConfig, SiglipModel

    encoder = load_component(str(files["siglip"]), [IPADAPTER_IMAGE_ENCODER], torch_dtype=torch.float32).module
    whole = SiglipModel(SiglipConfig.from_json_file(str(files["siglip"].parent / "config.json"))).eval()
    whole.load_state_dict(load_file(str(files["siglip"])))
    images = [_image(0), _image(1)]
    out = run_unit_on(FluxIPAdapterImageEncoder(), {"ipadapter_image_encoder": encoder}, ipadapter_images=images)
    pixels = torch.stack([torch.from_numpy(np.asarray(i.resize((28, 28), Image.BICUBIC), dtype=np.float32) / 127.5 - 1)
                          .permute(2, 0, 1) for i in images])
    ref = whole.vision_model(pixel_values=pixels).pooler_output
    assert out["ipadapter_image_embeds"].shape == (1, 2, 128)
    assert (out["ipadapter_image_embeds"][0] - ref).abs().max() <= 1e-5
    assert out["negative_ipadapter_image_embeds"].abs().max() == 0


def _attend(q, k, v):
    """softmax(q k^T / sqrt(d)) v over (B, H, S, D)."""
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1) @ v


def _rms(x, eps):
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)


def _heads(x, d):
    return x.view(x.shape[0], x.shape[1], -1, d).transpose(1, 2)  # (B, H, S, D)


def _rope(x, rope):
    from diffusers.models.embeddings import apply_rotary_emb
    return apply_rotary_emb(x.transpose(1, 2), rope, sequence_dim=1).transpose(1, 2)


def _reference_ip(tokens, block, d, q, scale):
    """The reference's interact_with_ipadapter: k = RMSNorm(to_k_ip(tokens)) per head (eps 1e-5, no weight)."""
    k = _rms(_heads(block.to_k_ip(tokens), d), 1e-5)
    v = _heads(block.to_v_ip(tokens), d)
    out = _attend(q, k, v)
    return scale * out.transpose(1, 2).flatten(2)


@torch.no_grad()
def test_image_attention_follows_the_reference_formula(flux_models, ipadapter):
    dit = flux_models["dit"]
    use_feature_attention(dit)
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(1, 2, 128, generator=g)
    kv = ipadapter(embeds)
    weight = ipadapter.image_proj.ff.net[0].proj.weight
    tokens = torch.nn.functional.layer_norm(
        torch.nn.functional.linear(torch.nn.functional.gelu(torch.nn.functional.linear(
            embeds.reshape(2, -1), weight, ipadapter.image_proj.ff.net[0].proj.bias)),
            ipadapter.image_proj.ff.net[2].weight, ipadapter.image_proj.ff.net[2].bias).reshape(2, 4, 32),
        (32,), ipadapter.image_proj.norm.weight, ipadapter.image_proj.norm.bias).reshape(1, 8, 32)
    d = dit.config.attention_head_dim
    img, txt = torch.randn(1, 6, 32, generator=g), torch.randn(1, 5, 32, generator=g)
    rope = dit.pos_embed(torch.cat([torch.zeros(5, 3), torch.randn(6, 3, generator=g)]))
    scale = 0.6

    attn = dit.transformer_blocks[0].attn
    img_out, txt_out = attn(hidden_states=img, encoder_hidden_states=txt, image_rotary_emb=rope, ip_kv=kv,
                            ip_scale=scale)
    qa, ka, va = (_heads(p(img), d) for p in (attn.to_q, attn.to_k, attn.to_v))
    qb, kb, vb = (_heads(p(txt), d) for p in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
    qa, ka, qb, kb = attn.norm_q(qa), attn.norm_k(ka), attn.norm_added_q(qb), attn.norm_added_k(kb)
    out = _attend(_rope(torch.cat([qb, qa], 2), rope), _rope(torch.cat([kb, ka], 2), rope), torch.cat([vb, va], 2))
    out = out.transpose(1, 2).flatten(2)
    ref_img = out[:, 5:] + _reference_ip(tokens, ipadapter.ip_adapter[0], d, qa, scale)  # unroped image queries
    assert (img_out - attn.to_out[0](ref_img)).abs().max() <= 1e-5
    assert (txt_out - attn.to_add_out(out[:, :5])).abs().max() <= 1e-5

    single = dit.single_transformer_blocks[0].attn
    x = torch.randn(1, 11, 32, generator=g)
    got = single(hidden_states=x, image_rotary_emb=rope, ip_kv=kv, ip_scale=scale)
    q, k, v = (_heads(p(x), d) for p in (single.to_q, single.to_k, single.to_v))
    q, k = _rope(single.norm_q(q), rope), _rope(single.norm_k(k), rope)
    ref = _attend(q, k, v).transpose(1, 2).flatten(2) + _reference_ip(tokens, ipadapter.ip_adapter[1], d, q, scale)
    assert (got - ref).abs().max() <= 1e-5  # every token's roped query; single blocks follow the double ones


@torch.no_grad()
def test_ip_adapter_in_the_denoiser(flux_models, ipadapter):
    dit = flux_models["dit"]
    g = torch.Generator().manual_seed(1)
    latents, prompt, pooled = torch.randn(1, 16, 4, 4, generator=g), torch.randn(1, 5, 32, generator=g), \
        torch.randn(1, 32, generator=g)
    args = (dit, latents, torch.tensor([600.0]), prompt, pooled, torch.tensor([1.0]))
    embeds = torch.randn(1, 1, 128, generator=g)
    plain = model_fn_flux(*args)
    with_ip = model_fn_flux(*args, ipadapter=ipadapter, ipadapter_image_embeds=embeds)
    other = model_fn_flux(*args, ipadapter=ipadapter, ipadapter_image_embeds=-embeds)
    off = model_fn_flux(*args, ipadapter=ipadapter, ipadapter_image_embeds=embeds, ipadapter_scale=0.0)
    assert (with_ip - plain).abs().max() > 1e-4 and (with_ip - other).abs().max() > 1e-4
    assert (off - plain).abs().max() <= 1e-5
