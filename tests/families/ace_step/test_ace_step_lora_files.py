"""ACE-Step LoRA files where users load them, without training: a LoRA of random A and B (rank 4, alpha 8: each
update is 2 B A) on the tiny DiT's modules for the reference's targets (q_proj,k_proj,v_proj,o_proj,gate_proj,
up_proj,down_proj, through the family's aliases), saved in each layout the family writes, and the weights each reader
ends up with: diffusers' `AceStepPipeline.load_lora_weights`, the reference's GeneralLoRALoader (rewritten in
support.lora_readers, on the DiT under the reference's module names), ComfyUI's key map and loader (rewritten there
too) and difftune's own reader.

Who reads which (asserted to 1e-6 against W + 2 B A over the 22 targeted modules, each measured 0.0; the
updates are up to 0.47):

| file | diffusers | reference | ComfyUI | difftune |
|---|---|---|---|---|
| default (diffusers) | yes | none of its modules | none | yes |
| reference | yes | yes | none | yes |
| comfyui | refused | none | yes | yes |
| kohya | refused | none | yes | yes |

The reference's DiT names its modules as the release (`layers.N.self_attn.q_proj`, no `decoder.`), so the
default file's `transformer.layers.N.self_attn.to_q` names no module of it: hence `--lora_format reference`.
ComfyUI and difftune also read the official trainer's `base_model.model.` files and LyCORIS's `lycoris_` ones."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file

from difftune.families.ace_step import FAMILY
from difftune.families.ace_step.components import to_original
from support.lora_readers import comfyui_lora_updates, diffsynth_fuse, diffsynth_general_convert, max_difference
from support.lora_readers import random_lora, save_dit_lora, with_updates

C, RANK, ALPHA = 8, 4, 8.0
LAYOUTS = ("diffusers", "reference", "comfyui", "kohya")
BOUND = 1e-6
REFERENCE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _dit():
    from diffusers import AceStepTransformer1DModel

    torch.manual_seed(0)
    return AceStepTransformer1DModel(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     num_key_value_heads=1, head_dim=16, in_channels=3 * C,
                                     audio_acoustic_hidden_dim=C, patch_size=2, sliding_window=4,
                                     encoder_hidden_size=24).eval()


@pytest.fixture(scope="module")
def known(tmp_path_factory):
    """(the DiT without the LoRA, {module: its update}, {layout: the file})."""
    from difftune.util import names

    base = _dit()
    config, sd, intended = random_lora(FAMILY, copy.deepcopy(base), names(FAMILY.lora_target_modules), RANK,
                                       ALPHA, seed=1)
    root = tmp_path_factory.mktemp("ace_step_lora")
    files = {layout: save_dit_lora(FAMILY, root / f"{layout}.safetensors", sd, config, layout) for layout in LAYOUTS}
    return base, intended, files


def test_the_targets_are_every_module_the_reference_puts_lora_on(known):
    """The aliases give diffusers' DiT the reference's modules: each attention projection (self and cross) and
    the MLP's three, in both layers: 22 modules."""
    base, intended, _ = known
    reference = {to_original(n) for n, m in base.named_modules() if isinstance(m, torch.nn.Linear)}
    want = {n for n in reference if n.rsplit(".", 1)[-1] in REFERENCE_TARGETS}
    assert {to_original(p) for p in intended} == want and len(want) == 22


@pytest.mark.parametrize("layout", ["diffusers", "reference"])
def test_diffusers_applies_exactly_the_update(known, layout):
    """`load_lora_weights` (AceStepLoraLoaderMixin renames an original-named file's attention projections): every
    module's delta is the trained update, none left out, and fused the weights are W + 2 B A."""
    import diffusers
    from peft.tuners.lora import LoraLayer

    base, intended, files = known
    pipe = diffusers.AceStepPipeline(vae=None, text_encoder=None, tokenizer=None, transformer=copy.deepcopy(base),
                                     condition_encoder=None, scheduler=None)
    pipe.load_lora_weights(str(files[layout]), adapter_name="file")
    deltas = {name: layer.get_delta_weight("file").detach()
              for name, layer in pipe.transformer.named_modules() if isinstance(layer, LoraLayer)}
    assert set(deltas) == set(intended)
    assert max_difference(deltas, intended) <= BOUND
    pipe.fuse_lora(components=["transformer"])
    pipe.unload_lora_weights()
    assert max_difference(pipe.transformer.state_dict(), with_updates(base.state_dict(), intended)) <= BOUND


@pytest.mark.parametrize("layout", ["comfyui", "kohya"])
def test_diffusers_refuses_the_comfyui_layouts(known, layout):
    """Their `.alpha` tensors fail diffusers' check that every key names a LoRA (comfyui); kohya's flattened names
    fail its conversion."""
    import diffusers

    base, _, files = known
    pipe = diffusers.AceStepPipeline(vae=None, text_encoder=None, tokenizer=None, transformer=copy.deepcopy(base),
                                     condition_encoder=None, scheduler=None)
    with pytest.raises((ValueError, IndexError, KeyError)):
        pipe.load_lora_weights(str(files[layout]), adapter_name="file")


def test_the_reference_loader_reads_the_reference_file_and_no_other(known):
    """GeneralLoRALoader on the DiT under the reference's names (`to_original`, no `decoder.`): the reference file
    updates every targeted module by its update (alpha folded, no `.alpha`) and skips none; the default file's
    `transformer.layers...to_q`, the comfyui file's `decoder.layers...` (its `diffusion_model` dropped) and kohya's
    flat names name no module of it, so they change nothing."""
    base, intended, files = known
    weights = {to_original(k[: -len(".weight")]): v for k, v in base.state_dict().items()
               if k.endswith(".weight") and v.dim() == 2}
    fused, skipped = diffsynth_fuse(weights, load_file(str(files["reference"])), diffsynth_general_convert)
    assert not skipped
    want = {**weights, **{to_original(p): weights[to_original(p)] + d for p, d in intended.items()}}
    assert max_difference(fused, want) <= BOUND
    for layout in ("diffusers", "comfyui", "kohya"):
        fused, skipped = diffsynth_fuse(weights, load_file(str(files[layout])), diffsynth_general_convert)
        assert len(skipped) == len(intended), layout
        assert max_difference(fused, weights) == 0, layout


def test_comfyui_maps_every_key_of_its_layouts_at_alpha_over_rank(known):
    """ComfyUI's model keys are `diffusion_model.decoder.<original DiT key>`: the comfyui file (its generic map)
    and the kohya file (`lora_unet_`) have every key read, each update at alpha / rank = 8 / 4 (B stored unfolded
    beside an alpha of 8); the default and reference files it does not read at all."""
    base, intended, files = known
    keys = [f"diffusion_model.decoder.{to_original(k)}" for k in base.state_dict()]
    want = {f"diffusion_model.decoder.{to_original(p)}.weight": d for p, d in intended.items()}
    for layout in ("comfyui", "kohya"):
        lora = load_file(str(files[layout]))
        assert {v.item() for k, v in lora.items() if k.endswith(".alpha")} == {ALPHA}
        updates, unread = comfyui_lora_updates(keys, lora)
        assert not unread, layout
        assert set(updates) == set(want) and max_difference(updates, want) <= BOUND, layout
    for layout in ("diffusers", "reference"):
        lora = load_file(str(files[layout]))
        updates, unread = comfyui_lora_updates(keys, lora)
        assert not updates and unread == set(lora), layout


@pytest.mark.parametrize("layout", LAYOUTS)
def test_difftune_reads_every_layout_back_to_the_update(known, layout):
    """`load_lora_file` with the family's converters, fused into a fresh DiT: every module, W + 2 B A."""
    from difftune.lora import fuse_lora, load_lora_file

    base, intended, files = known
    lora = load_lora_file(files[layout], converters=FAMILY.lora_converters)
    model = copy.deepcopy(base)
    fused = fuse_lora(model, lora, component=FAMILY.lora_prefix("dit"))
    assert set(fused) == set(intended)
    assert max_difference(model.state_dict(), with_updates(base.state_dict(), intended)) <= BOUND


def test_the_other_files_comfyuis_ace_step_branch_maps(known, tmp_path):
    """ComfyUI's ACEStep15 branch also maps the official trainer's `base_model.model.<path>` (peft's file, alpha
    folded as the reference file's) and LyCORIS's `lycoris_<path with _>` (with `.alpha`): written here from the
    reference and kohya files, both apply the update in ComfyUI, in difftune and (the first) in diffusers."""
    import diffusers
    from safetensors.torch import save_file

    from difftune.lora import fuse_lora, load_lora_file

    base, intended, files = known
    official = {f"base_model.model.{k}": v for k, v in load_file(str(files["reference"])).items()}
    lycoris = {k.replace("lora_unet_decoder_", "lycoris_"): v for k, v in load_file(str(files["kohya"])).items()}
    keys = [f"diffusion_model.decoder.{to_original(k)}" for k in base.state_dict()]
    want = {f"diffusion_model.decoder.{to_original(p)}.weight": d for p, d in intended.items()}
    for name, sd in (("official", official), ("lycoris", lycoris)):
        updates, unread = comfyui_lora_updates(keys, sd)
        assert not unread and max_difference(updates, want) <= BOUND, name
        path = tmp_path / f"{name}.safetensors"
        save_file(sd, str(path))
        model = copy.deepcopy(base)
        fuse_lora(model, load_lora_file(path, converters=FAMILY.lora_converters), component="transformer")
        assert max_difference(model.state_dict(), with_updates(base.state_dict(), intended)) <= BOUND, name
    pipe = diffusers.AceStepPipeline(vae=None, text_encoder=None, tokenizer=None, transformer=copy.deepcopy(base),
                                     condition_encoder=None, scheduler=None)
    pipe.load_lora_weights(str(tmp_path / "official.safetensors"))
    pipe.fuse_lora(components=["transformer"])
    pipe.unload_lora_weights()
    assert max_difference(pipe.transformer.state_dict(), with_updates(base.state_dict(), intended)) <= BOUND
