"""FLF2V's image position embedding under Wan-AI's own key name, and the Fun-InP 1.3B DiT: recognised from the
released files' headers (full size, nothing loaded) and converted both ways."""

import torch

from difftune.families.wan.components import DIT_ORIGINAL, WAN_DIT_CONFIGS, _dit_from_original
from difftune.families.wan.dit_keys import dit_to_original
from difftune.models.detect import match_header


def _original_header(label):
    """The released file's {key: shape}, in Wan-AI's names, from the official config's tensors."""
    return {k: s for k, s in dit_to_original(DIT_ORIGINAL.signature(WAN_DIT_CONFIGS[label])).items()}


def test_flf2v_header_in_wan_names_is_recognised_as_flf2v():
    header = _original_header("Wan2.1-FLF2V-14B")
    # Wan-AI's file names the tensor img_emb.emb_pos (the reference's MLP.emb_pos), never diffusers' name
    assert header["img_emb.emb_pos"] == (1, 514, 1280)
    assert not any(k.startswith("condition_embedder") for k in header)
    match = match_header(header, [DIT_ORIGINAL])
    assert match is not None and match.label == "Wan2.1-FLF2V-14B"
    # without the position embedding it is the I2V 14B DiT, not FLF2V
    del header["img_emb.emb_pos"]
    assert match_header(header, [DIT_ORIGINAL]).label == "Wan2.1-I2V-14B"


def test_flf2v_position_embedding_converts_both_ways():
    torch.manual_seed(0)
    pos = torch.randn(1, 6, 4)
    state = {"img_emb.emb_pos": pos, "patch_embedding.weight": torch.randn(8, 4, 1, 2, 2)}
    converted = _dit_from_original(state)
    assert torch.equal(converted["condition_embedder.image_embedder.pos_embed"], pos)
    assert "img_emb.emb_pos" not in converted
    assert torch.equal(dit_to_original(converted)["img_emb.emb_pos"], pos)


def test_fun_inp_13b_header_is_recognised_as_the_13b_i2v_dit():
    header = _original_header("Wan2.1-Fun-1.3B-InP")
    # the I2V 1.3B DiT: 36 input channels, CLIP image branch (1280 -> 1536), no position embedding
    assert header["patch_embedding.weight"] == (1536, 36, 1, 2, 2)
    assert header["img_emb.proj.1.weight"] == (1280, 1280) and header["img_emb.proj.3.weight"] == (1536, 1280)
    assert header["blocks.29.cross_attn.k_img.weight"] == (1536, 1536)
    match = match_header(header, [DIT_ORIGINAL])
    assert match is not None and match.label == "Wan2.1-Fun-1.3B-InP"
    assert match.config["image_dim"] == 1280 and match.config["added_kv_proj_dim"] == 1536


def test_tiny_flf2v_file_keeps_wan_names_and_loads_its_position_embedding(tmp_path, monkeypatch):
    from safetensors import safe_open

    from support.wan.flf2v_inp import tiny_flf2v_transformer, write_tiny_flf2v_original
    from difftune.models.load import load_component

    root, known = write_tiny_flf2v_original(tmp_path / "Wan2.1-FLF2V-14B-720P")
    for spec, label, config in known:
        monkeypatch.setitem(spec.known_configs, label, config)
    path = str(root / "diffusion_pytorch_model.safetensors")
    with safe_open(path, "pt") as f:
        keys = set(f.keys())
    assert "img_emb.emb_pos" in keys and not any(k.startswith("condition_embedder") for k in keys)
    loaded = load_component(path, [DIT_ORIGINAL], torch_dtype=torch.float32).module
    expected = tiny_flf2v_transformer().state_dict()
    assert loaded.state_dict().keys() == expected.keys()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in expected.items())
    assert expected["condition_embedder.image_embedder.pos_embed"].abs().sum() > 0


def test_tiny_fun_inp_repo_is_recognised_as_an_i2v_dit_with_clip(tmp_path, monkeypatch):
    from support.wan.flf2v_inp import write_tiny_fun_inp_original
    from difftune.models.detect import detect_component

    root, known = write_tiny_fun_inp_original(tmp_path / "Wan2.1-Fun-1.3B-InP")
    for spec, label, config in known:
        monkeypatch.setitem(spec.known_configs, label, config)
    assert (root / "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth").is_file()
    det = detect_component(str(root / "diffusion_pytorch_model.safetensors"), [DIT_ORIGINAL])
    assert det.source == "weights match tiny fun-inp" and det.config["in_channels"] == 36
    assert det.config["image_dim"] is not None
