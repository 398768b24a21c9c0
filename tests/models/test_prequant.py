"""Pre-quantised weight files (models/prequant.py): bitsandbytes 4-bit saves, ComfyUI fp8_scaled files and fp8 files
with per-row weight_scale tensors are recognised at their weights' own shapes, load packed or decoded, and a LoRA
trains on them; other quantised layouts are refused in one line."""

import dataclasses
import json
import re
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import LORA_TARGETS, make_image_dataset, run_train
from difftune.errors import UserError
from difftune.models import ModelConfig
from difftune.models.prequant import (QuantizedWeight, convert_packed, install_quantized, logical_shapes,
                                      split_prequantized, unpack_state_dict)
from difftune.models.quant import QuantOption
from support import TinyQwenImageSpec, tiny_qwen_image_paths, write_tiny_qwen_image

KEEP = ("img_mod.1", "txt_mod.1", "norm_out.linear", "img_in", "txt_in", "proj_out", "timestep_embedder.linear_1",
        "timestep_embedder.linear_2")
COMFY = "model.diffusion_model."


@pytest.fixture(scope="module")
def bnb():
    return pytest.importorskip("bitsandbytes")


@pytest.fixture(scope="module")
def ao():
    return pytest.importorskip("torchao")


def _bnb_linear(weight, quant_type="nf4", nested=False, bias=None):
    import bitsandbytes as bnb

    out_f, in_f = weight.shape
    layer = bnb.nn.Linear4bit(in_f, out_f, bias=bias is not None, compute_dtype=torch.float32, quant_type=quant_type,
                              compress_statistics=nested)
    layer.weight = bnb.nn.Params4bit(weight.clone(), requires_grad=False, quant_type=quant_type,
                                     compress_statistics=nested)
    if bias is not None:
        layer.bias = torch.nn.Parameter(bias.clone(), requires_grad=False)
    return layer.to("cpu")


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("nested", [False, True])
def test_a_bitsandbytes_save_decodes_as_bitsandbytes_does(bnb, quant_type, nested):
    torch.manual_seed(0)
    weight = torch.randn(96, 192)
    layer = _bnb_linear(weight, quant_type, nested, bias=torch.randn(96))
    state = {f"blocks.0.ff.{k}": v for k, v in layer.state_dict().items()}
    assert split_prequantized(layer.state_dict())[1]["weight"].shape == (96, 192)  # a module's own weight too
    assert "blocks.0.ff.weight.quant_state.bitsandbytes__" + quant_type in state
    plain, packed = split_prequantized(state)
    assert set(plain) == {"blocks.0.ff.bias"} and set(packed) == {"blocks.0.ff.weight"}
    qw = packed["blocks.0.ff.weight"]
    assert qw.kind == quant_type and qw.shape == (96, 192)
    want = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state).float()
    assert torch.equal(qw.dequantize(torch.float32), want)
    assert torch.equal(qw.dequantize(torch.float32, native=False), want)  # no bitsandbytes needed: the same numbers
    assert 0.05 < ((want - weight).norm() / weight.norm()).item() < 0.15  # and they are 4-bit weights
    # rows cut on block boundaries stay packed (a fused qkv split in three)
    assert torch.equal(qw.rows(32, 64).dequantize(native=False), want[32:64]) and qw.rows(32, 64).shape == (32, 192)
    assert torch.equal(qw.rows(32, 64).dequantize(), want[32:64])
    assert QuantizedWeight("nf4", (3, 10), qw.data, stats=qw.stats).rows(1, 2) is None  # 10 values: not a block
    # unpack_state_dict: the same names, normal tensors
    unpacked = unpack_state_dict(state, torch.bfloat16)
    assert set(unpacked) == {"blocks.0.ff.weight", "blocks.0.ff.bias"}
    assert unpacked["blocks.0.ff.weight"].dtype == torch.bfloat16 and unpacked["blocks.0.ff.weight"].shape == (96, 192)


def test_fp8_layouts_decode_weight_times_scale():
    torch.manual_seed(0)
    weight = torch.randn(48, 64)
    per_row = weight.abs().amax(dim=1) / 448
    stored = (weight / per_row[:, None]).to(torch.float8_e4m3fn)
    one = weight.abs().max() / 448
    comfy = {"scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn),
             f"{COMFY}a.weight": (weight / one).to(torch.float8_e4m3fn),
             f"{COMFY}a.scale_weight": one.reshape(()), f"{COMFY}a.scale_input": torch.tensor(1.0),
             f"{COMFY}a.bias": torch.zeros(48)}
    plain, packed = split_prequantized(comfy)
    assert set(plain) == {f"{COMFY}a.bias"} and set(packed) == {f"{COMFY}a.weight"}
    got = packed[f"{COMFY}a.weight"].dequantize()
    assert torch.equal(got, comfy[f"{COMFY}a.weight"].float() * one)
    assert 0 < ((got - weight).norm() / weight.norm()).item() < 0.05
    # compressed-tensors / Ideogram-4 fp8: one scale per output row, [out] or [out, 1]
    for scale in (per_row, per_row[:, None]):
        plain, packed = split_prequantized({"b.weight": stored, "b.weight_scale": scale,
                                            "b.input_scale": torch.ones(1)})
        assert plain == {} and torch.equal(packed["b.weight"].dequantize(), stored.float() * per_row[:, None])
        assert torch.equal(packed["b.weight"].rows(16, 32).dequantize(), (stored.float() * per_row[:, None])[16:32])


@pytest.mark.parametrize("state, message", [
    ({"a.weight": torch.zeros(4, 2, dtype=torch.int8), "a.SCB": torch.ones(4)}, "a bitsandbytes 8-bit save"),
    ({"a.weight": torch.zeros(4, 2, dtype=torch.uint8), "a.weight_scale": torch.ones(4, 1),
      "a.weight_scale_2": torch.ones(())}, "an nvfp4 checkpoint"),
    ({"a.weight": torch.zeros(4, 2, dtype=torch.int8), "a.weight_scale": torch.ones(()),
      "a.comfy_quant": torch.tensor(list(b'{"format": "int8_tensorwise"}'), dtype=torch.uint8)},
     "a ComfyUI comfy_quant checkpoint in the int8_tensorwise format"),
    ({"a.weight.absmax": torch.ones(4), "a.weight.quant_map": torch.ones(16)},
     "a bitsandbytes 4-bit save: a.weight is missing beside its absmax, quant_map"),
    ({"a.weight": torch.zeros(8, 1, dtype=torch.uint8), "a.weight.absmax": torch.ones(1),
      "a.weight.quant_map": torch.ones(16)}, "a bitsandbytes 4-bit save: a.weight has 0 quant_state records"),
    ({"a.weight": torch.zeros(4, 4, dtype=torch.float8_e4m3fn), "a.weight_scale": torch.ones(3)},
     "an fp8 checkpoint with weight scales: a.weight's scale has 3 values for 4 rows"),
])
def test_unknown_or_broken_quantised_layouts_are_refused_in_one_line(tmp_path, state, message):
    from difftune.models.detect import check_files

    path = tmp_path / "dit.safetensors"
    save_file(state, str(path))
    with pytest.raises(UserError, match=re.escape(f"{path}: {message}")) as err:
        check_files([str(path)])
    assert "\n" not in str(err.value) and "--quant_options" in str(err.value)


# -- tiny Qwen-Image DiTs saved pre-quantised -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """Layers 64 wide: bitsandbytes' CPU inference path packs weights in blocks of 64 input features."""
    spec = TinyQwenImageSpec(attention_head_dim=32, axes_dims_rope=(8, 12, 12))
    return write_tiny_qwen_image(tmp_path_factory.mktemp("prequant"), spec)


def _plain_dit(repo):
    from difftune.families.qwen_image.components import DIT
    from difftune.models import load_component

    return load_component(ModelConfig(str(repo / "transformer")), [DIT], torch_dtype=torch.float32).module


def _fp8_state(module, comfy: bool) -> dict:
    """The DiT's blocks' Linear weights in fp8 with scales: ComfyUI's fp8_scaled layout (one scale per weight,
    prefixed keys, a scaled_fp8 marker) or the per-row weight_scale layout (Ideogram-4's fp8 release)."""
    state = {k: v.clone() for k, v in module.state_dict().items()}
    for name, layer in module.named_modules():
        if type(layer) is not torch.nn.Linear or not name.startswith("transformer_blocks."):
            continue
        w = layer.weight.detach()
        scale = (w.abs().max() if comfy else w.abs().amax(dim=1)) / 448
        state[f"{name}.weight"] = (w / (scale if comfy else scale[:, None])).to(torch.float8_e4m3fn)
        state[f"{name}.{'scale_weight' if comfy else 'weight_scale'}"] = scale.reshape(() if comfy else (-1,))
        state[f"{name}.{'scale_input' if comfy else 'input_scale'}"] = torch.ones(() if comfy else (1,))
    if comfy:
        state = {COMFY + k: v for k, v in state.items()}
        state["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    return state


@pytest.fixture(scope="module")
def saved(repo, tmp_path_factory):
    """{layout: transformer folder} of the tiny DiT saved NF4 (bitsandbytes' own layout), ComfyUI fp8_scaled and fp8
    with per-row scales, each with the repository's config.json beside it."""
    from difftune.models.quant import quantize_linears

    pytest.importorskip("bitsandbytes")
    root = tmp_path_factory.mktemp("saved")
    out = {}
    nf4 = _plain_dit(repo)
    quantize_linears(nf4, QuantOption("bitsandbytes_nf4", KEEP), torch.float32)
    states = {"nf4": {k: v.detach().clone().contiguous() for k, v in nf4.state_dict().items()},
              "fp8_scaled": _fp8_state(_plain_dit(repo), comfy=True), "fp8_rows": _fp8_state(_plain_dit(repo), False)}
    assert any(k.endswith(".weight.quant_state.bitsandbytes__nf4") for k in states["nf4"])
    for layout, state in states.items():
        folder = root / layout / "transformer"
        folder.mkdir(parents=True)
        shutil.copy(repo / "transformer" / "config.json", folder / "config.json")
        save_file(state, str(folder / "diffusion_pytorch_model.safetensors"))
        out[layout] = folder
    return out


@pytest.mark.parametrize("layout", ["nf4", "fp8_scaled", "fp8_rows"])
def test_a_bare_pre_quantised_file_is_recognised_by_its_weights_shapes(repo, saved, layout):
    from difftune.families.qwen_image.components import DIT
    from difftune.models.detect import detect_component, header_shapes, read_header, strip_comfyui_prefix

    config = json.loads((repo / "transformer" / "config.json").read_text())
    tiny = dataclasses.replace(DIT, known_configs={"tiny Qwen-Image": config})  # what the file is matched against
    bare = saved[layout].parent / "bare"
    bare.mkdir(exist_ok=True)
    shutil.copy(saved[layout] / "diffusion_pytorch_model.safetensors", bare / "dit.safetensors")
    packed = header_shapes(read_header(bare / "dit.safetensors"))
    det = detect_component(ModelConfig(str(bare / "dit.safetensors")), [tiny])
    assert det.source == "weights match tiny Qwen-Image"
    plain = {k: v for f in tiny_qwen_image_paths(repo)["transformer"] for k, v in header_shapes(read_header(f)).items()}
    assert {strip_comfyui_prefix(k): v for k, v in det.shapes.items()} == plain  # as the full-precision file
    key = "transformer_blocks.0.attn.to_q.weight"
    assert plain[key] == (64, 64) and logical_shapes(str(bare / "dit.safetensors"), packed) == det.shapes
    if layout == "nf4":
        assert packed[key] == (64 * 64 // 2, 1)  # packed, yet recognised


def _load(folder, **kw):
    from difftune.families.qwen_image.components import DIT
    from difftune.models import load_component

    notes = []
    module = load_component(ModelConfig(str(folder), **kw), [DIT], torch_dtype=torch.float32, log=notes.append).module
    return module, notes


def test_an_nf4_save_loads_as_bitsandbytes_layers_or_decoded_without_it(repo, saved, bnb, monkeypatch):
    from difftune.models.quant import quantize_linears

    module, notes = _load(saved["nf4"])
    to_q = module.transformer_blocks[0].attn.to_q
    assert isinstance(to_q, bnb.nn.Linear4bit) and to_q.weight.dtype == torch.uint8
    assert notes == [f"dit: 24 weights of {saved['nf4'] / 'diffusion_pytorch_model.safetensors'} kept as stored (nf4)"]
    assert type(module.transformer_blocks[0].img_mod[1]) is torch.nn.Linear  # kept in full precision by its writer
    # the same 4-bit numbers as quantising the full-precision weights on load
    online = _plain_dit(repo)
    quantize_linears(online, QuantOption("bitsandbytes_nf4", KEEP), torch.float32)
    x = torch.randn(2, 64, requires_grad=True)
    out = to_q(x)
    assert torch.equal(out, online.transformer_blocks[0].attn.to_q(x))
    out.sum().backward()
    assert x.grad.abs().max() > 0  # a gradient reaches the input: a LoRA trains on top
    want = bnb.functional.dequantize_4bit(to_q.weight.data, to_q.weight.quant_state).float()
    # without bitsandbytes: decoded to the compute dtype, with a note
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    decoded, notes = _load(saved["nf4"])
    layer = decoded.transformer_blocks[0].attn.to_q
    assert type(layer) is torch.nn.Linear and layer.weight.dtype == torch.float32 and torch.equal(layer.weight, want)
    assert len(notes) == 1 and re.match(r"note: 24 pre-quantised 4-bit weights of QwenImageTransformer2DModel decoded "
                                        r"to float32: bitsandbytes is not installed", notes[0])


def test_an_nf4_save_is_decoded_for_full_training_or_another_method(saved, bnb, ao):
    decoded, notes = _load(saved["nf4"], decode_prequantized=True)
    assert type(decoded.transformer_blocks[0].attn.to_q) is torch.nn.Linear and notes == []
    int8, _ = _load(saved["nf4"], quant=QuantOption("torchao_int8_w8a16"))  # decoded, then quantised as asked
    assert type(int8.transformer_blocks[0].attn.to_q.weight).__name__ == "Int8Tensor"
    weight = int8.transformer_blocks[0].attn.to_q.weight.dequantize()
    assert torch.allclose(weight, decoded.transformer_blocks[0].attn.to_q.weight, rtol=0.02, atol=0.02)
    # the option's full-precision layers are decoded, the rest stays 4-bit
    part, _ = _load(saved["nf4"], quant=QuantOption("bitsandbytes_nf4", ("to_q",)))
    assert type(part.transformer_blocks[0].attn.to_q) is torch.nn.Linear
    assert isinstance(part.transformer_blocks[0].attn.to_k, sys.modules["bitsandbytes"].nn.Linear4bit)


@pytest.mark.parametrize("layout", ["fp8_scaled", "fp8_rows"])
def test_an_fp8_file_keeps_fp8_storage_with_torchao_or_is_decoded(repo, saved, ao, layout, monkeypatch):
    module, notes = _load(saved[layout])
    weight = module.transformer_blocks[0].attn.to_q.weight
    assert type(weight).__name__ == "Float8Tensor" and weight.qdata.dtype == torch.float8_e4m3fn
    # every Linear of the blocks (their modulation layers too): 14 a block
    assert notes == [f"dit: 28 weights of {saved[layout] / 'diffusion_pytorch_model.safetensors'} kept as stored (fp8)"]
    file = load_file(str(saved[layout] / "diffusion_pytorch_model.safetensors"))
    prefix = COMFY if layout == "fp8_scaled" else ""
    stored = file[f"{prefix}transformer_blocks.0.attn.to_q.weight"]
    scale = file[f"{prefix}transformer_blocks.0.attn.to_q.{'scale_weight' if prefix else 'weight_scale'}"]
    want = stored.float() * scale.reshape(-1, 1)
    assert torch.equal(weight.qdata, stored) and torch.equal(weight.dequantize(), want)  # the file's own bytes
    full = _plain_dit(repo).transformer_blocks[0].attn.to_q.weight
    assert 0 < ((want - full).norm() / full.norm()).item() < 0.05
    assert type(module.img_in.weight) is torch.nn.Parameter  # stored in full (outside the blocks): stays so
    monkeypatch.setitem(sys.modules, "torchao", None)
    decoded, notes = _load(saved[layout])
    assert torch.equal(decoded.transformer_blocks[0].attn.to_q.weight, want)
    assert len(notes) == 1 and "note: 28 pre-quantised fp8 weights of QwenImageTransformer2DModel decoded to " \
                               "float32: " \
                               "torchao is not installed" in notes[0]


def test_install_quantized_decodes_layers_that_pass_no_gradient(bnb):
    """A backend whose layers pass no gradient to their input here (a missing kernel) would leave a LoRA on top
    untrained: the probe finds it and the weights are decoded instead."""
    torch.manual_seed(0)
    layer = _bnb_linear(torch.randn(32, 64))
    _, packed = split_prequantized({f"0.{k}": v for k, v in layer.state_dict().items()})
    model = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False, device="meta"))
    original = bnb.nn.Linear4bit.forward
    try:
        bnb.nn.Linear4bit.forward = lambda self, x: torch.zeros(x.shape[0], 32)  # no path back to x
        notes = []
        assert install_quantized(model, packed, torch.float32, log=notes.append) == {"0.weight": "decoded"}
    finally:
        bnb.nn.Linear4bit.forward = original
    assert type(model[0]) is torch.nn.Linear and torch.equal(model[0].weight, packed["0.weight"].dequantize())
    assert "its layers pass no gradient here" in notes[0]


@pytest.mark.parametrize("how", ["online", "pre-quantised"])
def test_bitsandbytes_cpu_kernel_gets_only_the_shapes_it_takes(bnb, monkeypatch, capsys, how):
    """On a CPU with AVX512-BF16, bitsandbytes repacks a 4-bit weight for its fused kernel on the layer's first
    no-gradient forward, and the repacking asserts unless out_features is a multiple of 32 and in_features of the
    block size ("N must be divisible by block_n" on Ideogram-4's tiny NF4 text encoder). That route is forced here on
    any CPU: the layers it cannot take give the dequantised weight's matmul, with one note; the one it takes goes
    through the kernel."""
    import bitsandbytes.functional as bnb_f

    from difftune.models import bnb4bit
    from difftune.models.quant import quantize_linears

    native = bnb_f.has_avx512bf16()  # this machine's build has the kernel itself
    monkeypatch.setattr(bnb.nn.modules, "has_avx512bf16", lambda: True)  # read by Linear4bit's constructor
    monkeypatch.setattr(bnb4bit, "_noted", False)
    torch.manual_seed(0)
    shapes = {"tall": (48, 64), "narrow": (64, 32), "fits": (64, 128)}  # [out, in]; NF4 blocks of 64
    if how == "online":
        model = torch.nn.ModuleDict({k: torch.nn.Linear(i, o, bias=False) for k, (o, i) in shapes.items()})
        quantize_linears(model, QuantOption("bitsandbytes_nf4"), torch.float32)
    else:
        sources = {k: _bnb_linear(torch.randn(o, i)) for k, (o, i) in shapes.items()}  # bitsandbytes' own saves
        state = {f"{k}.{n}": v for k, src in sources.items() for n, v in src.state_dict().items()}
        model = torch.nn.ModuleDict({k: torch.nn.Linear(i, o, bias=False, device="meta") for k, (o, i) in shapes.items()})
        assert set(install_quantized(model, split_prequantized(state)[1], torch.float32).values()) == {"nf4"}
    assert all(isinstance(layer, bnb.nn.Linear4bit) for layer in model.values())
    model.eval()  # as load_component leaves every model
    want = {k: bnb.functional.dequantize_4bit(m.weight.data, m.weight.quant_state) for k, m in model.items()}
    calls = []
    if not native:  # no CPU kernel in this build: record the call and answer for it
        def gemv(A, B, out=None, state=None, **_):
            calls.append(list(state.shape))
            return torch.nn.functional.linear(A.float(), want["fits"])

        monkeypatch.setattr(bnb_f, "gemv_4bit", gemv)
    capsys.readouterr()
    for name, layer in model.items():
        x = torch.randn(3, layer.in_features)
        ref = torch.nn.functional.linear(x, want[name])
        with torch.no_grad():
            outs = [layer(x), layer(x)]
        # the kernel computes in bfloat16 (its input, absmax and output rounded to 8 significant bits): measured
        # 3.3e-3 of the output's scale, on weights of any scale (randn here, 16x nn.Linear's init); else float32
        tol = 1e-2 * ref.abs().max().item() if name == "fits" else 1e-5
        assert all(torch.allclose(out, ref, rtol=1e-5, atol=tol) for out in outs), name
        assert getattr(layer.weight.quant_state, "packing_format_for_cpu", False) == (name == "fits"), name
        if native and how == "pre-quantised" and name == "fits":  # the same numbers as bitsandbytes' own layer
            with torch.no_grad():
                assert torch.equal(outs[0], sources[name].eval()(x))
    assert native or calls == [[64, 128], [64, 128]]
    assert [ln for ln in capsys.readouterr().out.splitlines() if "4-bit kernel" in ln] == [
        "note: bitsandbytes' CPU 4-bit kernel cannot take a [48, 64] layer (out_features 48 is not a multiple of 32); "
        "such layers run with their weights dequantised"]
    # with a gradient to take, bitsandbytes' own path (no kernel) as before: a LoRA on top trains
    x = torch.randn(3, 32, requires_grad=True)
    model["narrow"](x).sum().backward()
    assert x.grad.abs().max() > 0


def test_a_layout_converter_splits_packed_weights_by_rows_or_gets_them_decoded(bnb):
    """A family's converter written for plain tensors (a fused qkv split into q, k, v) runs on packed weights: rows
    cut from a weight stay packed; anything else gets the weights decoded, with a note."""
    torch.manual_seed(0)
    qkv = _bnb_linear(torch.randn(3 * 64, 64))
    fp8 = torch.randn(3 * 64, 64).to(torch.float8_e4m3fn)
    _, packed = split_prequantized({**{f"a.qkv.{k}": v for k, v in qkv.state_dict().items()},
                                    "b.qkv.weight": fp8, "b.qkv.weight_scale": torch.rand(3 * 64)})
    state = {**packed, "a.norm.weight": torch.ones(64)}

    def split(sd):
        out = {"a.norm.weight": sd["a.norm.weight"]}
        for p in ("a", "b"):
            q, k, v = sd[f"{p}.qkv.weight"].chunk(3, dim=0)
            out.update({f"{p}.to_q.weight": q, f"{p}.to_k.weight": k, f"{p}.to_v.weight": v})
        return out

    notes = []
    out = convert_packed(split, state, notes.append)
    assert notes == [] and torch.equal(out["a.norm.weight"], torch.ones(64))
    for p in ("a", "b"):
        full = packed[f"{p}.qkv.weight"].dequantize()
        for i, name in enumerate(("to_q", "to_k", "to_v")):
            part = out[f"{p}.{name}.weight"]
            assert isinstance(part, QuantizedWeight) and part.shape == (64, 64)
            assert torch.equal(part.dequantize(), full[64 * i:64 * (i + 1)])
    # not rows: that weight is decoded, the others stay packed
    out = convert_packed(lambda sd: {"t": sd["b.qkv.weight"].t(), "a": sd["a.qkv.weight"]}, state, notes.append)
    assert torch.equal(out["t"], packed["b.qkv.weight"].dequantize().t()) and out["a"] is packed["a.qkv.weight"]
    assert notes == ["note: 1 pre-quantised weights decoded: converting the layout needs them in full "
                     "(e.g. b.qkv.weight)"]
    # a weight used both renamed and concatenated: everything is decoded
    out = convert_packed(lambda sd: {"c": torch.cat([sd["a.qkv.weight"], sd["b.qkv.weight"]]), "a": sd["a.qkv.weight"]},
                         state, notes.append)
    assert torch.equal(out["c"], torch.cat([packed["a.qkv.weight"].dequantize(), packed["b.qkv.weight"].dequantize()]))
    assert torch.equal(out["a"], packed["a.qkv.weight"].dequantize())
    assert notes[-1] == "note: the pre-quantised weights are decoded: converting the layout needs them in full"


# -- a LoRA on a pre-quantised base ------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout, extra", [("nf4", ()), ("fp8_scaled", ()), ("nf4", ("--enable_model_cpu_offload",))])
def test_a_lora_trains_on_a_pre_quantised_dit_and_loads_in_diffusers_with_every_key_used(repo, saved, layout, extra,
                                                                                        tmp_path, bnb, ao, capsys):
    from diffusers import QwenImagePipeline as DiffusersQwenImage, QwenImageTransformer2DModel
    from peft.tuners.lora import LoraLayer

    meta = make_image_dataset(tmp_path / "data", n=2)
    paths = tiny_qwen_image_paths(repo)
    summary = run_train(
        "--dataset_base_path", meta.parent, "--dataset_metadata_path", meta, "--max_pixels", 4096,
        "--model_paths", json.dumps([str(saved[layout]), paths["text_encoder"], paths["vae"][0]]),
        "--lora_base_model", "dit", "--lora_target_modules", LORA_TARGETS, "--lora_rank", 4, "--learning_rate", 1e-3,
        "--num_epochs", 2, "--output_path", tmp_path / "out", "--torch_dtype", "float32",
        "--use_gradient_checkpointing", *extra)
    kind, n = ("nf4", 24) if layout == "nf4" else ("fp8", 28)
    out = capsys.readouterr().out
    # the base trained on stayed packed (and streamed block by block with model offload)
    assert f"dit: {n} weights of {saved[layout] / 'diffusion_pytorch_model.safetensors'} kept as stored ({kind})" in out
    assert ("model offload: dit" in out) == bool(extra)
    losses = summary["losses"]
    assert len(losses) == 4 and all(0 < v < 10 for v in losses) and len(set(losses)) == 4
    path = tmp_path / "out" / "epoch-1.safetensors"
    lora = load_file(str(path))
    b = "diffusion_model.transformer_blocks.0.attn.to_q.lora_B.weight"  # on a packed layer
    assert b in lora and lora[b].abs().max().item() > 0  # B starts at zero: it trained
    transformer = QwenImageTransformer2DModel.from_pretrained(str(repo / "transformer"))
    state = DiffusersQwenImage.lora_state_dict(str(path))
    transformer.load_lora_adapter(state, prefix="transformer", adapter_name="file")
    layers = {n: m for n, m in transformer.named_modules() if isinstance(m, LoraLayer) and "file" in m.lora_A}
    in_file = {k[len("diffusion_model."):-len(".lora_A.weight")] for k in lora if k.endswith(".lora_A.weight")}
    assert set(layers) == in_file and len(in_file) > 10  # every key of the file is used
    for name, layer in layers.items():
        b, a = (lora[f"diffusion_model.{name}.lora_{x}.weight"].float() for x in "BA")
        want = b @ a
        assert torch.allclose(layer.get_delta_weight("file").float(), want, atol=1e-6)


@pytest.mark.parametrize("layout", ["nf4", "fp8_scaled", "fp8_rows"])
def test_in_bfloat16_a_peft_lora_on_a_packed_layer_gets_gradients(saved, layout, bnb, ao):
    from peft import LoraConfig, inject_adapter_in_model

    from difftune.families.qwen_image.components import DIT
    from difftune.models import load_component

    module = load_component(ModelConfig(str(saved[layout])), [DIT], torch_dtype=torch.bfloat16,
                            log=lambda m: None).module
    packed = module.transformer_blocks[0].attn.to_q
    assert (type(packed).__name__, type(packed.weight).__name__) in {("Linear4bit", "Params4bit"),
                                                                      ("Linear", "Float8Tensor")}
    module = inject_adapter_in_model(LoraConfig(r=4, target_modules=["to_q"], init_lora_weights=False), module)
    layer = module.transformer_blocks[0].attn.to_q
    layer.train()
    x = torch.randn(2, 64, dtype=torch.bfloat16, requires_grad=True)
    out = layer(x)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and x.grad.abs().max() > 0
    assert layer.lora_A["default"].weight.grad.abs().max() > 0 and layer.lora_B["default"].weight.grad.abs().max() > 0


def test_full_training_of_a_pre_quantised_dit_trains_its_decoded_weights(repo, saved, tmp_path, bnb):
    meta = make_image_dataset(tmp_path / "data", n=1)
    paths = tiny_qwen_image_paths(repo)
    run_train("--dataset_base_path", meta.parent, "--dataset_metadata_path", meta, "--max_pixels", 4096,
              "--model_paths", json.dumps([str(saved["nf4"]), paths["text_encoder"], paths["vae"][0]]),
              "--trainable_models", "dit", "--learning_rate", 1e-3, "--num_epochs", 1,
              "--output_path", tmp_path / "out", "--torch_dtype", "float32")
    trained = load_file(str(next((tmp_path / "out").glob("*.safetensors"))))
    key = next(k for k in trained if k.endswith("transformer_blocks.0.attn.to_q.weight"))
    file = load_file(str(saved["nf4"] / "diffusion_pytorch_model.safetensors"))
    _, packed = split_prequantized(file)
    start = packed["transformer_blocks.0.attn.to_q.weight"].dequantize()
    assert trained[key].shape == (64, 64) and trained[key].dtype == torch.float32  # full weights, not 4-bit codes
    assert 0 < (trained[key] - start).abs().max() < 0.1  # trained from the decoded weights


# -- FLUX.1 in BFL's single-file layout: the converter splits packed fused weights -------------------------------------

@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    """A tiny FLUX.1 repository and its transformer as BFL single files (fused qkv / linear1, the final modulation's
    halves swapped), saved NF4 (bitsandbytes' layout without double quantisation, as Ideogram-4's nf4 release) and
    ComfyUI fp8_scaled (prefixed keys): every 2-D weight of the blocks and of the final layer packed."""
    from safetensors.torch import load_file as read

    from difftune.families.flux.bfl import bfl_transformer_from_diffusers
    from support import tiny_flux_paths, write_tiny_flux

    bnb = pytest.importorskip("bitsandbytes")
    root = tmp_path_factory.mktemp("flux")
    repo = write_tiny_flux(root / "repo")
    dit = {}
    for f in tiny_flux_paths(repo)["transformer"]:
        dit.update(read(f))
    bfl = {k: v.contiguous() for k, v in bfl_transformer_from_diffusers(dit).items()}
    packed = [k for k, v in bfl.items() if v.dim() == 2 and k.endswith(".weight")
              and k.startswith(("double_blocks.", "single_blocks.", "final_layer."))]
    nf4, fp8 = dict(bfl), {"scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn)}
    for key in packed:
        data, state = bnb.functional.quantize_4bit(bfl[key], blocksize=64, compress_statistics=False, quant_type="nf4")
        nf4[key] = data
        nf4.update({f"{key}.{k}": v.clone() for k, v in state.as_dict(packed=True).items()})
    for key, value in bfl.items():
        if key in packed:
            scale = value.abs().max() / 448
            fp8[COMFY + key] = (value / scale).to(torch.float8_e4m3fn)
            fp8[COMFY + key[:-len("weight")] + "scale_weight"] = scale.reshape(())
        else:
            fp8[COMFY + key] = value
    files = {"bfl": root / "flux1-dev.safetensors", "nf4": root / "flux1-dev-nf4.safetensors",
             "fp8_scaled": root / "flux1-dev-fp8-scaled.safetensors"}
    for name, state in (("bfl", bfl), ("nf4", nf4), ("fp8_scaled", fp8)):
        save_file(state, str(files[name]))
    return repo, files, len(packed)


def _tiny_flux_known(repo, monkeypatch):
    """The tiny FLUX.1's configs among the known ones (FLUX's size inference assumes heads of 128)."""
    from difftune.families.flux.components import DIT, VAE

    for spec, folder in ((DIT, "transformer"), (VAE, "vae")):
        monkeypatch.setitem(spec.known_configs, "tiny", json.loads((repo / folder / "config.json").read_text()))


@pytest.mark.parametrize("layout", ["nf4", "fp8_scaled"])
def test_a_bfl_flux_file_saved_pre_quantised_loads_with_its_fused_weights_split_packed(flux, layout, bnb, ao,
                                                                                      monkeypatch):
    from difftune.families.flux import FAMILY
    from difftune.models.load import load_component

    repo, files, _ = flux
    _tiny_flux_known(repo, monkeypatch)
    notes = []
    got = load_component(str(files[layout]), FAMILY.components, torch_dtype=torch.float32, log=notes.append)
    plain = load_component(str(files["bfl"]), FAMILY.components, torch_dtype=torch.float32).module
    assert got.source.startswith("weights match")
    module = got.module
    to_q = module.transformer_blocks[0].attn.to_q  # a third of the packed double_blocks.0.img_attn.qkv
    if layout == "nf4":
        assert isinstance(to_q, bnb.nn.Linear4bit)
        weight = bnb.functional.dequantize_4bit(to_q.weight.data, to_q.weight.quant_state).float()
    else:
        assert type(to_q.weight).__name__ == "Float8Tensor"
        weight = to_q.weight.dequantize()
    full = plain.transformer_blocks[0].attn.to_q.weight
    assert weight.shape == full.shape and 0 < ((weight - full).norm() / full.norm()).item() < 0.15
    # the final modulation's halves are swapped by concatenation: that one weight is decoded
    assert type(module.norm_out.linear) is torch.nn.Linear and type(module.norm_out.linear.weight) is torch.nn.Parameter
    assert notes[0] == "note: 1 pre-quantised weights decoded: converting the layout needs them in full " \
                       "(e.g. final_layer.adaLN_modulation.1.weight)"
    assert re.fullmatch(rf"dit: \d+ weights of {re.escape(str(files[layout]))} kept as stored "
                        rf"\({'nf4' if layout == 'nf4' else 'fp8'}\)", notes[1])


@pytest.mark.parametrize("layout", ["nf4", "fp8_scaled"])
def test_a_lora_trains_on_a_bare_pre_quantised_flux_file_and_loads_in_diffusers(flux, layout, tmp_path, bnb, ao,
                                                                                capsys, monkeypatch):
    """`--model_paths` names the bare single file: the family and the model are recognised from its weights."""
    from diffusers import FluxPipeline, FluxTransformer2DModel
    from peft.tuners.lora import LoraLayer

    from difftune.families.flux.components import LORA_TARGET_MODULES
    from support import tiny_flux_paths, write_example_dataset

    repo, files, _ = flux
    _tiny_flux_known(repo, monkeypatch)
    meta = write_example_dataset(tmp_path / "data", n=2, size=(48, 32))
    paths = tiny_flux_paths(repo)
    models = [str(files[layout]), paths["text_encoder"], paths["text_encoder_2"], paths["vae"]]
    run_train("--dataset_base_path", meta.parent, "--dataset_metadata_path", meta, "--output_path", tmp_path / "out",
              "--model_paths", json.dumps([m if isinstance(m, str) or len(m) > 1 else m[0] for m in models]),
              "--torch_dtype", "float32", "--learning_rate", 1e-2, "--max_steps", 2, "--no_progress",
              "--max_pixels", 4096, "--lora_base_model", "dit", "--lora_target_modules", LORA_TARGET_MODULES,
              "--lora_rank", 4)
    out = capsys.readouterr().out
    assert "family: flux (recognised from the weights)" in out and f"weights of {files[layout]} kept as stored" in out
    path = next((tmp_path / "out").glob("*.safetensors"))
    lora = load_file(str(path))
    transformer = FluxTransformer2DModel.from_pretrained(str(repo / "transformer"))
    transformer.load_lora_adapter(FluxPipeline.lora_state_dict(str(path)), prefix="transformer", adapter_name="file")
    layers = {n: m for n, m in transformer.named_modules() if isinstance(m, LoraLayer) and "file" in m.lora_A}
    a_keys = [k for k in lora if k.endswith(".lora_A.weight")]
    assert len(layers) == len(a_keys) > 10  # every LoRA of the file lands on a layer
    for name, layer in layers.items():
        a = next(k for k in a_keys if ("." + k).endswith(f".{name}.lora_A.weight"))
        b = a.replace(".lora_A.", ".lora_B.")
        assert torch.allclose(layer.get_delta_weight("file").float(), lora[b].float() @ lora[a].float(), atol=1e-6)
    q = next(k for k in lora if ("." + k).endswith(".transformer_blocks.0.attn.to_q.lora_B.weight"))
    assert lora[q].abs().max() > 0  # trained on the packed layer


def test_a_hub_entry_naming_a_pre_quantised_file_loads_as_the_reference_scripts_name_it(saved, tmp_path, monkeypatch,
                                                                                       bnb):
    """`--model_id_with_origin_paths owner/model-nf4:transformer/diffusion_pytorch_model.safetensors` (the form of the
    reference's Ideogram-4-nf4.sh) on an offline hub folder."""
    from difftune.families.qwen_image.components import DIT
    from difftune.models import load_component, parse_model_configs

    folder = tmp_path / "models" / "owner" / "model-nf4" / "transformer"
    shutil.copytree(saved["nf4"], folder)
    monkeypatch.setenv("DIFFTUNE_MODEL_BASE_PATH", str(tmp_path / "models"))
    monkeypatch.setenv("DIFFTUNE_SKIP_DOWNLOAD", "true")
    entry = "owner/model-nf4:transformer/diffusion_pytorch_model.safetensors"
    [config] = parse_model_configs(model_id_with_origin_paths=entry)
    notes = []
    module = load_component(config, [DIT], torch_dtype=torch.float32, log=notes.append).module
    assert isinstance(module.transformer_blocks[1].img_mlp.net[2], bnb.nn.Linear4bit)
    assert notes == [f"dit: 24 weights of {folder / 'diffusion_pytorch_model.safetensors'} kept as stored (nf4)"]
