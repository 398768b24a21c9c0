"""LTX-2 LoRA files where users load them, without training: a LoRA of random A and B (rank 4, alpha 8: each
update is 2 B A) on the tiny LTX-2.3 DiT's modules for the reference's targets (to_k,to_q,to_v,to_out.0: the 48
attention projections of both streams and the two cross-modal attentions) plus three modules whose official names
differ from diffusers' (proj_in / patchify_proj, audio_proj_in / audio_patchify_proj, time_embed.linear /
adaln_single.linear), saved in each layout the family writes, and the weights each reader ends up with: diffusers'
`LTX2Pipeline.load_lora_weights`, the reference's GeneralLoRALoader (support.lora_readers, on the DiT under the
official names its class has), ComfyUI's LTXAV key map and loader (rewritten there) and difftune's own reader.

Who reads which (asserted to 1e-6 against W + 2 B A over the 51 modules; measured 0.0 for diffusers and ComfyUI,
6e-8 for difftune's fuse):

| file | diffusers | reference | ComfyUI | difftune |
|---|---|---|---|---|
| default (`diffusion_model.` + official names, alpha folded) | yes | yes | yes | yes |
| diffusers (`transformer.`) | yes | none | none | yes |
| comfyui (`.alpha` tensors) | refused | yes | yes | yes |
| kohya (`lora_unet_`) | none | none | yes | yes |
"""

from __future__ import annotations

import copy

import pytest
from safetensors.torch import load_file

from difftune.families.ltx2 import FAMILY
from difftune.families.ltx2 import names as N
from support.lora_readers import comfyui_lora_updates, comfyui_ltxav_key_map, diffsynth_fuse, diffsynth_general_convert
from support.lora_readers import max_difference, random_lora, save_dit_lora, with_updates
from support.ltx2 import tiny as T

RANK, ALPHA = 4, 8.0
LAYOUTS = ("reference", "diffusers", "comfyui", "kohya")
BOUND = 1e-6
RENAMED = ("proj_in", "audio_proj_in", "time_embed.linear")


def _official(path: str) -> str:
    return N.dit_to_original({path: None}, prefix="").popitem()[0]


@pytest.fixture(scope="module")
def known(tmp_path_factory):
    """(the DiT without the LoRA, {module: its update}, {layout: the file})."""
    from difftune.util import names

    base = T.tiny_ltx2_dit("2.3")
    config, sd, intended = random_lora(FAMILY, copy.deepcopy(base), names(FAMILY.lora_target_modules) + list(RENAMED),
                                       RANK, ALPHA, seed=1)
    root = tmp_path_factory.mktemp("ltx2_lora")
    files = {layout: save_dit_lora(FAMILY, root / f"{layout}.safetensors", sd, config, layout) for layout in LAYOUTS}
    return base, intended, files


def _diffusers_pipe(base):
    import diffusers

    return diffusers.LTX2Pipeline(scheduler=None, vae=None, audio_vae=None, text_encoder=None, tokenizer=None,
                                  connectors=None, transformer=copy.deepcopy(base), vocoder=None)


def test_the_targets_and_the_default_layout(known):
    """The reference's targets are the 48 attention projections (six attentions a block, two blocks); the default
    file writes every module under `diffusion_model.` in the official names, B with alpha / rank folded in, no
    `.alpha` tensor."""
    base, intended, files = known
    attention = [p for p in intended if p.rsplit(".", 1)[-1] in ("to_q", "to_k", "to_v") or p.endswith("to_out.0")]
    assert len(attention) == 48 and len(intended) == 51
    assert FAMILY.lora_default_format == "reference"
    keys = set(load_file(str(files["reference"])))
    want = {f"diffusion_model.{_official(p)}.lora_{s}.weight" for p in intended for s in "AB"}
    assert keys == want
    assert "diffusion_model.patchify_proj.lora_A.weight" in keys and not any(k.endswith(".alpha") for k in keys)


@pytest.mark.parametrize("layout", ["reference", "diffusers"])
def test_diffusers_applies_exactly_the_update(known, layout):
    """`load_lora_weights` (LTX2LoraLoaderMixin converts `diffusion_model.` files from the official names): every
    module's delta is the trained update, none left out, and fused the weights are W + 2 B A."""
    from peft.tuners.lora import LoraLayer

    base, intended, files = known
    pipe = _diffusers_pipe(base)
    pipe.load_lora_weights(str(files[layout]), adapter_name="file")
    deltas = {name: layer.get_delta_weight("file").detach()
              for name, layer in pipe.transformer.named_modules() if isinstance(layer, LoraLayer)}
    assert set(deltas) == set(intended)
    assert max_difference(deltas, intended) <= BOUND
    pipe.fuse_lora(components=["transformer"])
    pipe.unload_lora_weights()
    assert max_difference(pipe.transformer.state_dict(), with_updates(base.state_dict(), intended)) <= BOUND


def test_diffusers_refuses_or_ignores_the_comfyui_layouts(known):
    """The comfyui file's `.alpha` tensors fail diffusers' check that every key names a LoRA; kohya's
    `lora_unet_` names are no prefix it knows, so it loads nothing."""
    base, _, files = known
    with pytest.raises(ValueError, match="lora"):
        _diffusers_pipe(base).load_lora_weights(str(files["comfyui"]), adapter_name="file")
    from peft.tuners.lora import LoraLayer

    pipe = _diffusers_pipe(base)
    pipe.load_lora_weights(str(files["kohya"]), adapter_name="file")
    assert not any(isinstance(m, LoraLayer) for m in pipe.transformer.modules())


def test_the_reference_loader_reads_the_default_and_comfyui_files(known):
    """GeneralLoRALoader on the DiT under the official names (the reference's LTX2 DiT class has them): it drops a
    leading `diffusion_model`, so the default file (alpha folded) and the comfyui file (`.alpha` scaling the down)
    update every module by its update; the diffusers file's `transformer.` and kohya's flat names name none."""
    base, intended, files = known
    weights = {_official(k[: -len(".weight")]): v for k, v in base.state_dict().items()
               if k.endswith(".weight") and v.dim() == 2}
    want = {**weights, **{_official(p): weights[_official(p)] + d for p, d in intended.items()}}
    for layout in ("reference", "comfyui"):
        fused, skipped = diffsynth_fuse(weights, load_file(str(files[layout])), diffsynth_general_convert)
        assert not skipped, layout
        assert max_difference(fused, want) <= BOUND, layout
    for layout in ("diffusers", "kohya"):
        fused, skipped = diffsynth_fuse(weights, load_file(str(files[layout])), diffsynth_general_convert)
        assert len(skipped) == len(intended), layout
        assert max_difference(fused, weights) == 0, layout


def test_comfyui_maps_every_key_of_its_files_at_the_trained_strength(known):
    """ComfyUI's LTXAV model keys are `diffusion_model.<official DiT key>`: the default file (no alpha: scale 1 on
    the folded B), the comfyui and kohya files (an alpha of 8 beside the unfolded B) have every key read, each update
    the trained one; the diffusers file it does not read at all."""
    base, intended, files = known
    keys = list(N.dit_to_original(base.state_dict(), prefix="diffusion_model."))
    want = {f"diffusion_model.{_official(p)}.weight": d for p, d in intended.items()}
    for layout in ("reference", "comfyui", "kohya"):
        lora = load_file(str(files[layout]))
        alphas = {v.item() for k, v in lora.items() if k.endswith(".alpha")}
        assert alphas == (set() if layout == "reference" else {ALPHA}), layout
        updates, unread = comfyui_lora_updates(keys, lora, key_map=comfyui_ltxav_key_map)
        assert not unread, layout
        assert set(updates) == set(want) and max_difference(updates, want) <= BOUND, layout
    lora = load_file(str(files["diffusers"]))
    updates, unread = comfyui_lora_updates(keys, lora, key_map=comfyui_ltxav_key_map)
    assert not updates and unread == set(lora)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_difftune_reads_every_layout_back_to_the_update(known, layout):
    """`load_lora_file` with the family's converter (official names -> diffusers'), fused into a fresh DiT: every
    module, W + 2 B A."""
    from difftune.lora import fuse_lora, load_lora_file

    base, intended, files = known
    lora = load_lora_file(files[layout], converters=FAMILY.lora_converters)
    model = copy.deepcopy(base)
    fused = fuse_lora(model, lora, component=FAMILY.lora_prefix("dit"))
    assert set(fused) == set(intended)
    assert max_difference(model.state_dict(), with_updates(base.state_dict(), intended)) <= BOUND


def test_the_reference_trainers_own_file_reads_back(known, tmp_path):
    """The reference's trainer saves the DiT's peft state: bare official names with the adapter name
    (`<path>.lora_A.default.weight`), no alpha (alpha = rank, as its loader reads it). difftune reads it onto
    diffusers' modules (the renamed ones included) at that strength."""
    from safetensors.torch import save_file

    from difftune.lora import fuse_lora, load_lora_file

    base, intended, files = known
    folded = load_file(str(files["reference"]))
    bare = {k.removeprefix("diffusion_model.").replace(".lora_A.", ".lora_A.default.")
            .replace(".lora_B.", ".lora_B.default."): v for k, v in folded.items()}
    assert "patchify_proj.lora_A.default.weight" in bare
    path = tmp_path / "reference_trainer.safetensors"
    save_file(bare, str(path))
    model = copy.deepcopy(base)
    fused = fuse_lora(model, load_lora_file(path, converters=FAMILY.lora_converters), component="transformer")
    assert set(fused) == set(intended)
    assert max_difference(model.state_dict(), with_updates(base.state_dict(), intended)) <= BOUND
