"""LoRA files of each family of manifest.py with a lora part, where users load them, at the trained strength: one
training (rank 4, alpha 8: alpha / rank is 2; same seed) saved in each of the entry's layouts. Each file's keys are
its layout's (and every module one of ComfyUI's key map where the entry gives it); diffusers' load_lora_weights uses
every tensor of the layouts it reads, at the trained strength, and samples what difftune samples with the file
fused, and refuses the layouts it refuses; the reference's GeneralLoRALoader (support.lora_readers) fuses the comfyui
file to difftune's weights and finds none of the default file's modules; and the checks only one family makes."""

from __future__ import annotations

import importlib
import re

import pytest
import torch
from safetensors.torch import load_file

from conftest import run_train
from families.manifest import FAMILIES as ENTRIES, diffusers_with_lora, fused
from support import write_example_dataset
from support.lora_readers import diffsynth_fuse, diffsynth_general_convert

FAMILIES = tuple(name for name, f in ENTRIES.items() if f.lora)


def pytest_generate_tests(metafunc):
    families = [ENTRIES[f] for f in metafunc.module.FAMILIES]
    cases = {
        "layout": [pytest.param((f, layout), id=f"{f.name}-{layout.name}") for f in families for layout in f.lora.layouts],
        "diffusers_reads": [pytest.param((f, name), id=f"{f.name}-{name}") for f in families
                            for name in f.lora.diffusers_reads],
        "diffusers_refuses": [pytest.param((f, name), id=f"{f.name}-{name}") for f in families
                              for name in f.lora.diffusers_refuses],
        "reference_reads": [pytest.param(f, id=f.name) for f in families if f.lora.reference_reads_comfyui],
        "own_check": [pytest.param((f, c), id=f"{f.name}-{c.__name__.removeprefix('_' + f.name + '_')}")
                      for f in families for c in f.lora.own],
    }
    for arg, params in cases.items():
        if arg in metafunc.fixturenames:
            metafunc.parametrize(arg, params)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """family -> (its support module, its tiny hub, layout -> the LoRA file), trained when a test first asks."""
    built = {}

    def get(family):
        if family.name not in built:
            support = importlib.import_module(family.support)
            hub = family.hub(support, tmp_path_factory.mktemp(f"{family.name}_hub"))
            root = tmp_path_factory.mktemp(f"{family.name}_lora")
            meta = write_example_dataset(root / "data", n=2, size=(32, 32))
            lora, files = family.lora, {}
            for layout in lora.layouts:
                run_train("--task", "sft", "--dataset_base_path", root / "data", "--dataset_metadata_path", meta,
                          "--output_path", root / layout.name, *lora.train(support, hub), "--torch_dtype", "float32",
                          "--learning_rate", 5e-2, "--max_steps", 2, "--seed", 5, "--no_progress", "--max_pixels",
                          1024, "--enable_tensorboard_log", "false", "--lora_base_model", "dit",
                          "--lora_target_modules", lora.target_modules, "--lora_rank", 4, "--lora_alpha", 8,
                          *layout.flags)
                files[layout.name] = next((root / layout.name).glob("*.safetensors"))
            built[family.name] = support, hub, files
        return built[family.name]
    return get


def _modules(keys) -> set[str]:
    """The LoRA modules of a file's keys, behind either prefix."""
    return {re.sub(r"^(transformer|diffusion_model)\.", "", k).rpartition(".lora_")[0] for k in keys if ".lora_" in k}


def test_the_files_keys_are_their_layouts(layout, trained):
    family, layout = layout
    keys = load_file(str(trained(family)[2][layout.name])).keys()
    ends = (".lora_A.weight", ".lora_B.weight", *((".alpha",) if layout.alpha else ()))
    stray = [k for k in keys if not (k.startswith(layout.prefix) and k.endswith(ends))]
    assert not stray, stray[:5]  # no .alpha where the layout folds alpha into B
    modules = _modules(keys)
    assert len(modules) == family.lora.modules
    if layout.comfyui_map:
        unmapped = [m for m in modules if not re.fullmatch(layout.comfyui_map, m)]
        assert not unmapped, unmapped[:5]


def test_diffusers_loads_every_tensor_and_samples_as_difftune(diffusers_reads, trained):
    from peft.utils import get_peft_model_state_dict

    family, layout = diffusers_reads
    support, hub, files = trained(family)
    lora = family.lora
    saved = load_file(str(files[layout]))
    theirs, warnings = diffusers_with_lora(lora.diffusers(support, hub), files[layout])
    assert warnings == []
    loaded = get_peft_model_state_dict(theirs.transformer, adapter_name="ours")
    assert {k.rpartition(".lora_")[0] for k in loaded} == _modules(saved)  # every module of the file, nothing else
    # the strength: B @ A as diffusers applies it is the trained alpha / rank (2) times the comfyui file's B @ A
    plain = load_file(str(files["comfyui"]))
    module, comfyui = lora.strength
    ab = plain[f"diffusion_model.{comfyui}.lora_B.weight"] @ plain[f"diffusion_model.{comfyui}.lora_A.weight"]
    config = theirs.transformer.peft_config["ours"]
    scale = config.alpha_pattern.get(module, config.lora_alpha) / config.rank_pattern.get(module, config.r)
    theirs_ab = loaded[f"{module}.lora_B.weight"] @ loaded[f"{module}.lora_A.weight"] * scale
    assert float(plain[f"diffusion_model.{comfyui}.alpha"]) == 8.0
    assert torch.allclose(theirs_ab, 2 * ab, atol=1e-6)
    diff, moved = lora.samples(support, hub, theirs, files[layout])
    print(f"{family.name} {layout} LoRA: diffusers vs difftune fused, max difference {diff:.2e}; the LoRA moves "
          f"diffusers' latents by {moved:.2e}")
    assert diff <= 1e-5 and moved > 1e-3


def test_diffusers_refuses_the_layout(diffusers_refuses, trained):
    family, layout = diffusers_refuses
    support, hub, files = trained(family)
    with pytest.raises(ValueError, match=family.lora.diffusers_refuses[layout]):
        diffusers_with_lora(family.lora.diffusers(support, hub), files[layout])


def test_the_reference_loader_reads_the_comfyui_file_at_the_trained_strength(reference_reads, trained):
    family = reference_reads
    support, hub, files = trained(family)
    lora = family.lora
    base = lora.ours(support, hub).dit.state_dict()
    weights = {k[: -len(".weight")]: v for k, v in base.items() if k.endswith(".weight") and v.dim() == 2}
    theirs, unmatched = diffsynth_fuse(weights, load_file(str(files["comfyui"])), diffsynth_general_convert)
    assert unmatched == set()
    mine = fused(lora, support, hub, files[lora.default]).dit.state_dict()
    diff = max((theirs[k] - mine[f"{k}.weight"]).abs().max().item() for k in theirs)
    moved = max((theirs[k] - weights[k]).abs().max().item() for k in theirs)
    print(f"{family.name} comfyui LoRA fused by the reference's loader vs difftune's default file fused: {diff:.2e} "
          f"(the LoRA moves the weights by {moved:.2e})")
    assert diff <= 1e-6 and moved > lora.reference_moves
    # the default file's transformer.<module> names: none is a module of the reference's DiT
    _, unmatched = diffsynth_fuse(weights, load_file(str(files[lora.default])), diffsynth_general_convert)
    assert len(unmatched) == lora.modules and all(n.startswith("transformer.") for n in unmatched)


def test_the_familys_own_check(own_check, trained, tmp_path):
    family, check = own_check
    check(*trained(family), tmp_path)
