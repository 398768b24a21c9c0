"""Broken, contradictory or hostile pre-quantised files and quantisation flags (issue 48): each refused in one line
naming the file and key (or the flags), before any native kernel reads a tensor."""

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from difftune.errors import UserError
from difftune.models.prequant import split_prequantized

KEY = "blk.ff.weight"


@pytest.fixture(scope="module")
def bnb():
    return pytest.importorskip("bitsandbytes")


def nf4_state(quant_type="nf4", nested=False, shape=(64, 128)):
    """One Linear weight as bitsandbytes saves it (Linear4bit.state_dict's keys)."""
    import bitsandbytes.functional as F

    torch.manual_seed(0)
    data, state = F.quantize_4bit(torch.randn(*shape), blocksize=64, compress_statistics=nested, quant_type=quant_type)
    out = {KEY: data, "blk.ff.bias": torch.zeros(shape[0])}
    out.update({f"{KEY}.{k}": v.clone() for k, v in state.as_dict(packed=True).items()})
    return out


def record(state, quant_type="nf4"):
    key = f"{KEY}.quant_state.bitsandbytes__{quant_type}"
    return key, json.loads(bytes(state[key].tolist()).decode())


def with_record(state, source="nf4", name=None, **changes):
    """The weight's quant_state record with `changes`, renamed bitsandbytes__`name`."""
    key, meta = record(state, source)
    meta.update(changes)
    state = {k: v for k, v in state.items() if k != key}
    state[f"{KEY}.quant_state.bitsandbytes__{name or source}"] = torch.tensor(list(json.dumps(meta).encode()),
                                                                                  dtype=torch.uint8)
    return state


def refused(tmp_path, state, message):
    """Saved and read back as the loader reads it: one line naming the file and the key."""
    path = tmp_path / "dit.safetensors"
    save_file(state, str(path))
    with pytest.raises(UserError) as err:
        split_prequantized(load_file(str(path)), str(path))
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"{path}: ") and message in text, text
    return path


def _short_absmax(s):
    return {**s, f"{KEY}.absmax": s[f"{KEY}.absmax"][:3].clone()}


@pytest.mark.parametrize("change, message", [
    (_short_absmax, f"{KEY}.absmax has 3 values for the 128 blocks of 64 of [64, 128]"),
    (lambda s: {**s, f"{KEY}.absmax": torch.cat([s[f"{KEY}.absmax"]] * 2)},
     f"{KEY}.absmax has 256 values for the 128 blocks"),
    (lambda s: {**s, f"{KEY}.quant_map": s[f"{KEY}.quant_map"][:8].clone()},
     f"{KEY}.quant_map is float32 [8], not the 16 values of a 4-bit code"),
    (lambda s: with_record(s, shape=[32, 128]),  # smaller than the packed weight: was read as its first half
     f"{KEY} is uint8 [4096, 1] (4096 bytes), not the packed 4-bit codes its quant_state describes (2048 bytes"),
    (lambda s: with_record(s, blocksize=48), f"{KEY}: its quant_state says blocksize 48"),
    (lambda s: with_record(s, blocksize=-64), f"{KEY}: its quant_state says blocksize -64"),
    (lambda s: with_record(s, dtype="int8"), f"{KEY}: its quant_state says dtype 'int8'"),
    (lambda s: with_record(s, shape=[64, 0]), f"{KEY}: its quant_state says shape [64, 0], not a list of sizes"),
])
def test_a_4bit_quant_state_that_does_not_fit_its_weight_is_refused_before_any_kernel(tmp_path, bnb, change, message):
    """A short absmax was 'kept as stored (nf4)', then bitsandbytes read past its end (NaN here, exit 139 on a real
    model)."""
    refused(tmp_path, change(nf4_state()), message)


def test_a_short_absmax_is_refused_at_recognition_from_the_header_alone(tmp_path, bnb):
    from difftune.models.detect import check_files

    path = tmp_path / "dit.safetensors"
    save_file(_short_absmax(nf4_state()), str(path))
    with pytest.raises(UserError, match=re.escape(f"{path}: a bitsandbytes 4-bit save: {KEY}.absmax has 3 values")):
        check_files([str(path)])


def test_a_double_quantised_state_is_checked_too(tmp_path, bnb):
    state = nf4_state(nested=True)
    refused(tmp_path, {**state, f"{KEY}.nested_absmax": torch.ones(3)},
            f"{KEY}.nested_absmax has 3 values for the 1 blocks of 256 of its 128 absmax")
    refused(tmp_path, {**state, f"{KEY}.absmax": torch.ones(128)},
            f"{KEY}.absmax is float32, not the 8-bit codes of a double-quantised save")
    bad = state[f"{KEY}.nested_absmax"].clone()
    bad[0] = float("inf")
    refused(tmp_path, {**state, f"{KEY}.nested_absmax": bad}, f"{KEY}.nested_absmax holds non-finite values")
    refused(tmp_path, with_record(state, nested_offset=None), f"{KEY}: its quant_state says nested_offset None")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_absmax_is_refused_naming_the_key(tmp_path, bnb, value):
    """It trained to 'non-finite loss' before."""
    state = nf4_state()
    absmax = state[f"{KEY}.absmax"].clone()
    absmax[5] = value
    refused(tmp_path, {**state, f"{KEY}.absmax": absmax}, f"{KEY}.absmax holds non-finite values (NaN or inf)")


@pytest.mark.parametrize("name, value", [("weight_scale", float("nan")), ("scale_weight", float("inf"))])
def test_a_non_finite_fp8_scale_is_refused_naming_the_key(tmp_path, name, value):
    scale = torch.rand(8) + 0.5
    scale[2] = value
    state = {"a.weight": torch.randn(8, 16).to(torch.float8_e4m3fn), f"a.{name}": scale}
    refused(tmp_path, state, f"a.{name} holds non-finite values (NaN or inf)")


@pytest.mark.parametrize("name, values, said", [("weight_scale", [0.5, -0.5], "negative values"),
                                               ("weight_scale", [0.0, 0.0], "only zeros"),
                                               ("scale_weight", [-1.0], "negative values"),
                                               ("scale_weight", [0.0], "only zeros")])
def test_a_negative_or_zero_fp8_scale_is_refused_naming_the_key(tmp_path, name, values, said):
    """A negative scale flipped the weight's sign and an all-zero one erased it, with exit 0."""
    scale = torch.tensor(values * (8 // len(values)))
    state = {"a.weight": torch.randn(8, 16).to(torch.float8_e4m3fn), f"a.{name}": scale}
    refused(tmp_path, state, f"a.{name} holds {said} (a scale is positive)")


def test_a_negative_absmax_is_refused_naming_the_key(tmp_path, bnb):
    state = nf4_state()
    absmax = state[f"{KEY}.absmax"].clone()
    absmax[1] = -absmax[1]
    refused(tmp_path, {**state, f"{KEY}.absmax": absmax}, f"{KEY}.absmax holds negative values")


def test_a_quant_type_that_contradicts_the_quant_map_is_named_a_mismatch(tmp_path, bnb):
    nf4 = nf4_state()
    # the record says fp4, the codes and their table are nf4's: bitsandbytes' kernels would decode them as fp4
    refused(tmp_path, with_record(nf4, name="fp4", quant_type="fp4"),
            f"{KEY}: a mismatch: its quant_state says fp4 but its quant_map is nf4's code table")
    refused(tmp_path, with_record(nf4_state("fp4"), "fp4", name="nf4", quant_type="nf4"),
            f"{KEY}: a mismatch: its quant_state says nf4 but its quant_map is fp4's code table")
    refused(tmp_path, with_record(nf4, quant_type="fp4"),
            f"{KEY}: a mismatch: its record is quant_state.bitsandbytes__nf4 but says quant_type 'fp4'")
    refused(tmp_path, {**nf4, f"{KEY}.quant_map": torch.linspace(-1, 1, 16)},
            f"{KEY}: a mismatch: its quant_state says nf4 but its quant_map is neither nf4's nor fp4's code table")


def test_a_float_weight_beside_an_nf4_state_is_refused(tmp_path, bnb):
    """It was 'kept as stored (nf4)', then failed in a kernel (or read its float bytes as 4-bit codes)."""
    state = nf4_state()
    refused(tmp_path, {**state, KEY: torch.randn(64, 128)},
            f"{KEY} is float32 [64, 128] (32768 bytes), not the packed 4-bit codes its quant_state describes "
            f"(4096 bytes of uint8 for [64, 128])")
    # bitsandbytes' quant_storage (the same bytes as another dtype, [n, 1]) is still its layout
    bf16 = {**state, KEY: state[KEY].reshape(-1).view(torch.bfloat16).reshape(-1, 1)}
    packed = split_prequantized(bf16)[1][KEY]
    assert torch.equal(packed.dequantize(native=False), split_prequantized(state)[1][KEY].dequantize(native=False))


@pytest.mark.parametrize("layout", ["weight_scale", "scale_weight", "marker"])
def test_an_fp8_weight_without_its_scale_in_a_scaled_file_is_refused(tmp_path, layout):
    """It was used unscaled (~2500x too large with real scales)."""
    stored = torch.randn(8, 16).to(torch.float8_e4m3fn)
    state = {"a.weight": stored, "b.weight": stored.clone(), "norm.weight": torch.ones(16)}
    if layout == "marker":  # ComfyUI's scaled_fp8 marker says every fp8 weight has a scale_weight
        state["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    else:
        state[f"a.{layout}"] = torch.full((8,), 1e-3) if layout == "weight_scale" else torch.tensor(1e-3)
    refused(tmp_path, state, "b.weight is fp8 without its weight_scale / scale_weight (1 such weight(s)), so it "
                             "would be used unscaled" if layout != "marker" else "(2 such weight(s))")


def test_a_plain_fp8_file_with_no_scales_at_all_loads_as_plain_fp8():
    """By design: its values are the weights."""
    stored = torch.randn(8, 16).to(torch.float8_e4m3fn)
    plain, packed = split_prequantized({"a.weight": stored, "a.input_scale": torch.ones(1)})
    assert packed == {} and plain["a.weight"] is stored


def test_an_nf4_file_with_full_precision_layers_loads_packed_or_in_fp8(tmp_path, bnb):
    """Issue 48 saw 'silu_cpu not implemented for Byte' (layers kept in full precision) and 'Promotion for Float8
    Types' (--fp8_models on an NF4 file); on today's code both load and run: pinned here."""
    import shutil

    from difftune.families.qwen_image.components import DIT
    from difftune.models import ModelConfig, load_component
    from difftune.models.quant import QuantOption, quantize_linears
    from support import TinyQwenImageSpec, write_tiny_qwen_image

    spec = TinyQwenImageSpec(attention_head_dim=32, axes_dims_rope=(8, 12, 12))  # 64 wide: bitsandbytes' CPU blocks
    repo = write_tiny_qwen_image(tmp_path / "repo", spec)
    module = load_component(ModelConfig(str(repo / "transformer")), [DIT], torch_dtype=torch.float32).module
    quantize_linears(module, QuantOption("bitsandbytes_nf4", ("img_mod.1", "txt_mod.1", "img_in", "proj_out")),
                     torch.float32)
    folder = tmp_path / "nf4"
    folder.mkdir()
    shutil.copy(repo / "transformer" / "config.json", folder)
    save_file({k: v.detach().clone().contiguous() for k, v in module.state_dict().items()},
              str(folder / "diffusion_pytorch_model.safetensors"))
    for fp8 in (False, True):
        loaded = load_component(ModelConfig(str(folder), fp8_components=("dit",) if fp8 else ()), [DIT],
                                torch_dtype=torch.float32, log=lambda m: None).module
        to_q, mod = loaded.transformer_blocks[0].attn.to_q, loaded.transformer_blocks[0].img_mod[1]
        assert to_q.weight.dtype == (torch.float8_e4m3fn if fp8 else torch.uint8)  # fp8: decoded, then stored fp8
        assert mod.weight.dtype == (torch.float8_e4m3fn if fp8 else torch.float32)
        x = torch.randn(1, mod.in_features)
        with torch.no_grad():
            assert torch.isfinite(loaded.transformer_blocks[0].img_mod(x)).all()
            assert torch.isfinite(to_q(torch.randn(1, to_q.in_features))).all()
