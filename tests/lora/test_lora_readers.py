"""Issue 25, items 10-13: the LoRA file difftune writes by default loads at the trained strength in diffusers, in
ComfyUI and in DiffSynth-Studio's own loader, for Qwen-Image, FLUX.1 and Wan, checked on the weights; each other
layout does what docs/lora_files.md says. A tiny DiT per family gets a LoRA of random A and B (alpha 8, rank 4, so a
reader that drops alpha shows) on the family's default targets (`support.lora_readers.KnownLora`).

diffusers runs here; DiffSynth-Studio's loader is its step-by-step rewrite (`support.lora_readers`; the
`diffsynth` package is no dependency); ComfyUI's own code and the real `diffsynth` run in
`benchmarks/lora_readers.py` (its test at the end runs where a ComfyUI checkout and that venv are given), which also
shows the rewrite equal to the real loader.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import run_train, train_args
from difftune.core.family import get_family
from support.lora_readers import KnownLora, max_difference, reference_weights

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ("qwen_image", "flux", "wan")
TOLERANCE = 1e-5
# (family, layout) -> (diffusers reads it whole, DiffSynth-Studio reads it whole): docs/lora_files.md's table.
# FLUX's kohya file in diffusers: see tests/families/flux/test_flux.py (diffusers' reader needs FLUX.1's widths).
READS = {("qwen_image", "diffusers"): (True, False), ("qwen_image", "comfyui"): (True, True),
         ("qwen_image", "kohya"): (True, False),
         ("flux", "diffusers"): (True, True), ("flux", "comfyui"): (False, False), ("flux", "kohya"): (None, True),
         ("wan", "diffusers"): (True, False), ("wan", "comfyui"): (True, True), ("wan", "kohya"): (True, False)}
DEFAULT = {"qwen_image": "comfyui", "flux": "diffusers", "wan": "comfyui"}


@pytest.fixture(scope="module", params=FAMILIES)
def known(request, tmp_path_factory):
    return KnownLora(request.param, tmp_path_factory.mktemp(f"readers_{request.param}"))


def default_layout(family: str, *flags) -> str:
    """What `difftune train` writes with no --lora_format, as the command resolves it."""
    from difftune.training.config import RunConfig
    from difftune.training.stages import lora_format

    spec = get_family(family)
    config = RunConfig.from_namespace(train_args("--dataset_base_path", ".", "--family", family,
                                                 "--lora_base_model", "dit", *flags)).with_family(spec)
    return lora_format(config, spec, "dit")


def test_the_default_layout_is_the_one_every_reader_takes(known):
    assert default_layout(known.family) == DEFAULT[known.family] == known.spec.lora_default_format


def test_the_default_file_loads_at_the_trained_strength_in_diffusers(known, tmp_path):
    path = known.save(tmp_path / "lora.safetensors", default_layout(known.family))
    got = known.diffusers_updates(path)
    assert set(got) == set(known.intended)  # every module, no other
    assert max_difference(got, known.intended) <= TOLERANCE


def test_the_default_file_loads_at_the_trained_strength_in_diffsynth_studio(known, tmp_path):
    path = known.save(tmp_path / "lora.safetensors", default_layout(known.family))
    fused, skipped = known.reference_result(path)
    assert skipped == set()
    assert max_difference(fused, reference_weights(known.family, known.trained())) <= TOLERANCE


@pytest.mark.parametrize("layout", ["diffusers", "comfyui", "kohya"])
def test_each_layout_is_read_as_the_docs_say(known, tmp_path, layout):
    """Where a reader takes the file, at the trained strength; where the docs say it does not, it really does not
    (so the table is no guess)."""
    in_diffusers, in_diffsynth = READS[(known.family, layout)]
    path = known.save(tmp_path / f"{layout}.safetensors", layout)
    fused, skipped = known.reference_result(path)
    want = reference_weights(known.family, known.trained())
    assert (not skipped and max_difference(fused, want) <= TOLERANCE) == in_diffsynth, (len(skipped),)
    if in_diffusers is not None:
        got = known.diffusers_updates(path)
        whole = set(got) == set(known.intended) and max_difference(got, known.intended) <= TOLERANCE
        assert whole == in_diffusers


def test_every_layout_reimports_into_difftune_exactly(known, tmp_path):
    from difftune.lora import load_lora_file

    for layout in ("diffusers", "comfyui", "kohya"):
        imported = load_lora_file(known.save(tmp_path / f"{layout}.safetensors", layout),
                                  converters=known.spec.lora_converters)
        comp = imported.select("transformer")
        sd, alphas = imported.components[comp], imported.alphas[comp]
        model_paths = {p for p in alphas}
        if comp in imported.unresolved:
            continue  # kohya's flat names resolve against a model: covered by the fuse tests
        got = {p: (alphas[p] / sd[f"{p}.lora_A.weight"].shape[0]) * (sd[f"{p}.lora_B.weight"] @
                                                                     sd[f"{p}.lora_A.weight"]) for p in model_paths}
        assert max_difference(got, known.intended) <= TOLERANCE, layout


# -- the commands -------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_a_plain_training_run_writes_the_default_layout(family, tmp_path):
    from support import tiny_family

    t = tiny_family(family, tmp_path / "models")
    meta = t.write_dataset(tmp_path / "data")
    run_train("--task", "sft", "--family", family, "--dataset_base_path", meta.parent, "--dataset_metadata_path", meta,
              "--output_path", tmp_path / "out", "--model_paths", json.dumps(t.model_paths), "--torch_dtype",
              "float32", "--learning_rate", 1e-2, "--max_steps", 1, "--seed", 5, "--no_progress",
              "--enable_tensorboard_log", "false", *t.flags, "--lora_base_model", "dit", "--lora_target_modules",
              t.lora_target_modules, "--lora_rank", 2)
    keys = load_file(str(next((tmp_path / "out").glob("*.safetensors")))).keys()
    prefix = {"comfyui": "diffusion_model.", "diffusers": "transformer."}[DEFAULT[family]]
    assert keys and all(k.startswith(prefix) for k in keys)
    assert any(k.endswith(".alpha") for k in keys) == (DEFAULT[family] == "comfyui")


def test_a_text_encoder_lora_keeps_the_diffusers_layout():
    assert default_layout("wan", "--lora_base_model", "text_encoder") == "diffusers"


def test_align_to_opensource_format_writes_kohya_as_the_reference_does():
    assert default_layout("flux", "--align_to_opensource_format") == "kohya"
    assert default_layout("flux", "--align_to_opensource_format", "--lora_format", "kohya") == "kohya"
    from difftune.errors import UserError

    with pytest.raises(UserError, match="--lora_format diffusers: --align_to_opensource_format asks for the kohya"):
        default_layout("flux", "--align_to_opensource_format", "--lora_format", "diffusers")


def test_the_reference_proj_out_target_is_its_single_blocks_only(known):
    """The reference's `proj_out` names its single blocks' output layers (its final layer is `final_proj_out`):
    FLUX's default targets here train the same modules, so no module is one its loader cannot read."""
    if known.family != "flux":
        pytest.skip("FLUX's alias")
    assert "proj_out" not in known.intended and "single_transformer_blocks.0.proj_out" in known.intended


# -- ComfyUI's own code and the real DiffSynth-Studio loader ------------------------------------------------------

def test_real_comfyui_and_diffsynth_studio_read_the_default_file(tmp_path):
    """benchmarks/lora_readers.py in a venv with ComfyUI's and DiffSynth-Studio's requirements
    ($DIFFTUNE_LORA_READERS_PYTHON) and a ComfyUI checkout ($DIFFTUNE_COMFYUI); see the script's docstring."""
    python, comfyui = os.environ.get("DIFFTUNE_LORA_READERS_PYTHON"), os.environ.get("DIFFTUNE_COMFYUI")
    if not python or not comfyui:
        pytest.skip("set DIFFTUNE_LORA_READERS_PYTHON and DIFFTUNE_COMFYUI (benchmarks/lora_readers.py says how)")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([python, str(ROOT / "benchmarks" / "lora_readers.py"), "--comfyui", comfyui, "--no-doc",
                           "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for family in FAMILIES:
        row = results[f"{family}/default"]
        assert row["diffusers"] <= TOLERANCE and row["diffusers_missing"] == 0, row
        assert row["comfyui"] <= TOLERANCE and row["comfyui_not_loaded"] == 0, row
        assert row["diffsynth"] <= TOLERANCE and row["diffsynth_skipped"] == 0, row
    assert all(row["rewrite_vs_real"] == 0.0 for row in results.values())  # the tests' rewrite is the loader
    assert results["wan/diffusers"]["comfyui_not_loaded"] == 40  # the old default: every key "not loaded"
