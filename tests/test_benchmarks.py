"""The benchmarks' smoke modes: each script runs end to end on the tiny model and prints its ratios.

Every script runs as a subprocess (`--quick --no-doc`, so docs/benchmarks.md is never touched), the way a
user runs it; the last stdout line is the JSON result. The scripts whose --quick runs stay in their process (the split
benchmark's ten families, overhead, batching, batched stage 1, host overhead, gpu.py's CPU parts, peers) share one
subprocess, run one after another as `__main__`. The peers benchmark needs DiffSynth-Studio's own venv (see benchmarks/peers.py);
without it the test checks that the script says how to make it and skips.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DS_PYTHON = Path(os.environ.get("DIFFTUNE_BENCH_DS_PYTHON", "/tmp/dsvenv/bin/python"))


def run_quick(script: str, tmp_path: Path, *extra: str, timeout: int = 180) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--no-doc",
                           "--workdir", str(tmp_path), *extra],
                          capture_output=True, text=True, timeout=timeout, cwd=str(ROOT), env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stdout[-2000:]
    return json.loads(lines[-1])


def assert_ratios(result: dict, keys: list[str]) -> None:
    for key in keys:
        value = result[key]
        assert isinstance(value, float) and math.isfinite(value) and value > 0, (key, value)
    for name, target in result.get("targets", {}).items():
        assert set(target) == {"target", "value", "met"}, name


# The in-process smoke runs (their --quick runs stay in this process by design, and the benchmarks' own helpers reset
# accelerate between runs) share ONE interpreter, one after another: one start (imports ~10 s) instead of sixteen.
# Each: (script, its extra arguments); "{workdir}" in them is the job's own folder, also its --workdir.
SPLIT_FAMILIES = ("qwen_image", "flux", "wan", "z_image", "flux2", "krea2", "ernie_image", "ideogram4", "ace_step",
                  "ltx2", "stable_diffusion", "stable_diffusion_xl")
SMOKES = {**{family: ("split_vs_unsplit.py", ("--family", family)) for family in SPLIT_FAMILIES},
          "overhead": ("overhead.py", ()), "batched_stage1": ("batched_stage1.py", ()), "batching": ("batching.py", ()),
          "host_overhead": ("host_overhead.py", ("--families", "qwen_image,z_image")),
          "gpu": ("gpu.py", ("--parts", "mfu,reference", "--families", "z_image", "--out", "{workdir}/out")),
          "peers": ("peers.py", ("--ds-python", str(DS_PYTHON), *(("--images", "2") if DS_PYTHON.is_file() else ())))}
SMOKE_RUNNER = r"""
import contextlib, io, json, runpy, sys, traceback
for name, script, argv in json.loads(sys.argv[1]):
    sys.argv = [script, *argv]
    out, record = io.StringIO(), {"name": name}
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (0, None):
            record["error"] = f"exit {stop.code}: {out.getvalue()[-2000:]}"
    except BaseException:
        record["error"] = traceback.format_exc()[-4000:]
    lines = [line for line in out.getvalue().splitlines() if line.startswith("{")]
    if "error" not in record:
        record["result"] = json.loads(lines[-1]) if lines else None  # gpu.py writes files, no JSON line
    print("SMOKE " + json.dumps(record), flush=True)
"""


@pytest.fixture(scope="module")
def smokes(tmp_path_factory):
    root = tmp_path_factory.mktemp("smokes")
    jobs = []
    for name, (script, extra) in SMOKES.items():
        workdir = root / name
        workdir.mkdir()
        argv = ["--quick", "--no-doc", "--workdir", str(workdir), *(a.format(workdir=workdir) for a in extra)]
        jobs.append((name, str(ROOT / "benchmarks" / script), argv))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", SMOKE_RUNNER, json.dumps(jobs)], capture_output=True, text=True,
                          timeout=1500, cwd=str(ROOT), env=env)
    records = {}
    for line in proc.stdout.splitlines():
        if line.startswith("SMOKE "):
            record = json.loads(line[len("SMOKE "):])
            records[record["name"]] = record
    return records, proc, root


def smoke(smokes, name: str) -> dict:
    records, proc, _ = smokes
    record = records.get(name)
    assert record is not None, f"rc {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert "error" not in record, record["error"]
    assert name == "gpu" or record["result"] is not None, f"{name}: no JSON line"
    return record["result"]


def test_split_vs_unsplit_quick(smokes):
    r = smoke(smokes, "qwen_image")
    assert r["benchmark"] == "split_vs_unsplit" and r["steps"] > 0
    assert_ratios(r, ["step_time_ratio", "peak_rss_ratio", "total_time_ratio", "projected_total_time_ratio_5x50",
                      "cache_bytes_ratio", "data_wait_share_stage2"])
    # the cached tensors are part of the cache files, so the ratio is at least 1
    assert r["cache_bytes_ratio"] >= 1


def test_overhead_quick(smokes):
    r = smoke(smokes, "overhead")
    assert r["benchmark"] == "overhead"
    assert_ratios(r, ["overhead_ratio", "step_time_difftune_s", "step_time_minimal_s"])


def test_batched_stage1_quick(smokes):
    r = smoke(smokes, "batched_stage1")
    assert r["benchmark"] == "batched_stage1" and r["batch_size"] > 1
    assert_ratios(r, ["batched_speedup", "samples_per_s_one_at_a_time", "samples_per_s_batched"])


def test_peers_quick(smokes):
    r = smoke(smokes, "peers")
    if not DS_PYTHON.is_file():
        assert "skipped" in r and "pip install diffsynth" in r["skipped"]
        pytest.skip(f"DiffSynth-Studio's venv ({DS_PYTHON}) is absent: the peers benchmark skipped itself")
    assert_ratios(r, ["step_time_one_stage_ratio", "step_time_stage2_ratio", "peak_rss_one_stage_ratio",
                      "peak_rss_stage2_ratio", "cache_bytes_ratio", "stage1_seconds_ratio"])


# A peer child imported as DiffSynth's venv runs it, on a CPU-only torch: there torchvision's CUDA wheel fails to import
# until its op schemas are defined, so the first import of diffusers or of difftune's families (which may import
# torchvision) is recorded with whether they were defined by then. torchvision itself is kept out (no stand-in is the
# real one). Both children share one interpreter: it imports torch (what the children import before anything else)
# and forks one process a child, so each child's imports start from torch alone, as in its own venv's process.
PEER_IMPORT = r"""
import importlib, importlib.abc, json, os, sys, traceback
import torch

torch.version.cuda = None


def schemas():
    return hasattr(torch.ops.torchvision, "nms")


class PeerVenv(importlib.abc.MetaPathFinder):
    first = None

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            return None  # absent: only the order of the imports is checked
        if PeerVenv.first is None and (name == "diffusers" or name.startswith("difftune.families")):
            PeerVenv.first = {"module": name, "shim": schemas()}
        return None


sys.path.insert(0, sys.argv[2])
for child in sys.argv[1].split(","):
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            sys.meta_path.insert(0, PeerVenv())
            importlib.import_module(child)
            print("PEER " + json.dumps({"child": child, "first": PeerVenv.first, "shim_after": schemas()}))
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    print("EXIT " + json.dumps({"child": child, "rc": os.waitstatus_to_exitcode(status)}), flush=True)
"""
PEER_CHILDREN = ("peer_diffsynth", "peer_diffusers")


@pytest.fixture(scope="module")
def peer_imports():
    """child -> (its exit status, its report), both children imported in one interpreter's forks."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", PEER_IMPORT, ",".join(PEER_CHILDREN), str(ROOT / "benchmarks")],
                          capture_output=True, text=True, timeout=300, cwd=str(ROOT), env=env)
    found = {}
    for line in proc.stdout.splitlines():
        for tag in ("PEER ", "EXIT "):
            if line.startswith(tag):
                record = json.loads(line[len(tag):])
                found.setdefault(record["child"], {})[tag.strip()] = record
    return found, proc


@pytest.mark.parametrize("child", PEER_CHILDREN)
def test_a_peer_child_defines_torchvisions_schemas_before_difftunes_families_import(peer_imports, child):
    """benchmarks/common.py imports difftune's families (diffusers, transformers, which may import torchvision): in
    DiffSynth's venv the torchvision shim must be in place before that, or the child dies at its imports."""
    found, proc = peer_imports
    records = found.get(child, {})
    assert records.get("EXIT", {}).get("rc") == 0 and "PEER" in records, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = records["PEER"]
    assert report["first"] is not None and report["first"]["shim"], report
    assert report["shim_after"]


def test_batching_quick(smokes):
    r = smoke(smokes, "batching")
    assert r["benchmark"] == "batching" and r["images"] > 0
    assert_ratios(r, ["stage2_samples_per_s_batch1", "stage2_samples_per_s_batch2", "stage2_samples_per_s_batch4",
                      "stage2_speedup_batch2", "stage2_speedup_batch4", "stage1_batched_speedup"])


def test_flux_split_vs_unsplit_quick(smokes):
    r = smoke(smokes, "flux")
    assert r["benchmark"] == "flux_split_vs_unsplit" and r["steps"] > 0
    assert_ratios(r, ["total_time_ratio", "projected_total_time_ratio_5x50", "step_time_ratio", "peak_rss_ratio",
                      "peak_rss_above_baseline_ratio"])
    assert set(r["params"]) == {"transformer", "text_encoder", "text_encoder_2", "vae"}


def test_wan_split_vs_unsplit_quick(smokes):
    r = smoke(smokes, "wan")
    assert r["benchmark"] == "wan_split_vs_unsplit" and r["steps"] == 4 and r["num_frames"] == 5
    assert_ratios(r, ["total_time_ratio", "projected_total_time_ratio_5x100", "step_time_ratio", "peak_rss_ratio",
                      "vae_share_of_one_stage_step", "umt5_share_of_one_stage_step"])
    assert set(r["params"]) == {"transformer", "text_encoder", "vae"} and r["params"]["transformer"] > 0
    # VACE (the default runs both): a control clip and a reference image per row, the LoRA on the branch
    v = r["vace"]
    assert v["variant"] == "vace" and v["steps"] == 4 and v["vace_layers"] == [0]
    assert_ratios(v, ["total_time_ratio", "projected_total_time_ratio_5x100", "step_time_ratio", "peak_rss_ratio",
                      "vae_share_of_one_stage_step", "vace_context_share_of_one_stage_step"])
    assert set(v["params"]) == {"transformer", "text_encoder", "vae", "vace"} and v["params"]["vace"] > 0
    # stage 2 skips UMT5 and five VAE calls (the clip, the control clip twice, the reference image twice): ~7x shorter
    assert v["step_time_stage2_s"] < v["step_time_one_stage_s"]


def test_sharded_memory_quick(tmp_path):
    """FSDP2 on 2 CPU processes holds half of the parameters and AdamW state per process (the issue's figure)."""
    r = run_quick("sharded_memory.py", tmp_path, timeout=300)
    assert r["benchmark"] == "sharded_memory" and r["engine_line_fsdp2"].startswith("engine: FSDP2 over 2 processes")
    assert_ratios(r, ["params_plus_optimizer_ratio_fsdp2", "state_ratio_fsdp2", "peak_rss_ratio_fsdp2"])
    assert abs(r["params_plus_optimizer_ratio_fsdp2"] - 0.5) < 0.01  # every block tensor is split in two
    assert len(r["fsdp2_per_process"]) == 2 and r["max_diff_fsdp2_vs_one"] <= 1e-5


def test_gpu_section_is_rendered_from_the_recorded_runs():
    """docs/benchmarks.md's GPU section is exactly what benchmarks/gpu.py renders from the raw results it cites, and
    the FLOP count behind its MFU is the closed form for the shapes it names."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu

    runs = sorted((ROOT / "benchmarks" / "results").glob("gpu-*"))
    assert len(runs) >= 2
    body = gpu.render(runs)
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    assert f"<!-- bench:gpu -->\n{body.strip()}\n<!-- /bench:gpu -->" in doc
    split = json.loads((runs[0] / "split.json").read_text())
    assert split["dtype"] == "bfloat16" and split["resolution"] == 1024 and split["image_tokens"] == 4096
    fwd = gpu.dit_flops(split["spec"], 4096, round(split["text_tokens"]))
    d, s, blocks = 24 * 128, 4096 + round(split["text_tokens"]), split["spec"]["num_layers"]
    assert fwd["attention"] == blocks * 4 * s * s * d
    assert gpu.training_flops(fwd, full=False, recompute=True)["hardware"] == split["dit_hardware_flops_per_step"]
    assert gpu.training_flops(fwd, full=False, recompute=True)["model"] == split["dit_model_flops_per_step"]


@pytest.fixture(scope="module")
def host_overhead(smokes):
    return smoke(smokes, "host_overhead")


def test_host_overhead_quick(host_overhead):
    """The tiny Qwen-Image's stage-2 LoRA step (bf16, rank 32, 12 targets, checkpointing) dispatches at most 0.6x
    the operators of the earlier behaviour, with far fewer casts (docs/performance.md)."""
    r = host_overhead
    q = r["families"]["qwen_image"]
    assert r["benchmark"] == "host_overhead" and q["before"]["ops"] > 0
    assert q["ops_ratio"] <= 0.6, q
    assert q["after"]["to_copy"] <= 0.4 * q["before"]["to_copy"], q
    assert r["targets"]["ops_ratio_qwen_image"]["met"]


def test_gpu_mfu_and_reference_parts_smoke(smokes):
    """benchmarks/gpu.py's issue-33 parts on this CPU with the tiny Z-Image: stage 1, stage 2 with and without
    checkpointing, the FLOPs of a step counted (the checkpointed step recomputes the forward: more FLOPs); no MFU
    without a GPU's peak; the reference part says how to give it DiffSynth-Studio when it cannot import it."""
    import importlib.util

    smoke(smokes, "gpu")
    out = smokes[2] / "gpu" / "out"
    mfu = json.loads((out / "mfu.json").read_text())
    z = mfu["families"]["z_image"]
    assert "error" not in z, z
    plain, ckpt = z["no_checkpointing"], z["checkpointing"]
    assert z["model_flops_per_step"] == plain["step_flops_counted"] > 0
    assert plain["step_flops_counted"] < ckpt["step_flops_counted"] < 2 * plain["step_flops_counted"]
    assert plain["steps"] == ckpt["steps"] == 4 and plain["step_time_s"] > 0 and ckpt["step_time_s"] > 0
    assert plain["mfu"] is None and mfu["peak_flops"] is None  # no GPU: no peak to divide by
    reference = json.loads((out / "reference.json").read_text())
    if importlib.util.find_spec("diffsynth") is None:
        assert "--ds-python" in reference["skipped"] and "--diffsynth_src" in reference["skipped"]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu

    assert "| z_image | " in gpu.render([out])


def test_host_overhead_z_image(host_overhead):
    """The tiny Z-Image's step (six RMSNorms a block) also dispatches at most 0.6x the earlier operators: its queries
    and keys are normed and rotated together (docs/performance.md)."""
    r = host_overhead
    z = r["families"]["z_image"]
    assert set(r["families"]) == {"qwen_image", "z_image"} and z["before"]["ops"] > 0
    assert z["ops_ratio"] <= 0.6, z
    assert z["after"]["to_copy"] <= 0.4 * z["before"]["to_copy"], z


def test_krea2_split_vs_unsplit_quick(smokes):
    r = smoke(smokes, "krea2")
    assert r["benchmark"] == "krea2_split_vs_unsplit" and r["steps"] == 4
    assert r["params"]["transformer"] > 0 and r["qwen3_vl_encode_s"] > 0 and r["step_time_ratio"] > 0


# Families whose split benchmark reports the same record: its projection key and the shares timed apart
SAME_RECORD = {"flux2": ("5x50", "qwen3"), "z_image": ("5x50", "qwen3"), "ernie_image": ("5x50", "text"),
               "ideogram4": ("5x100", "text")}


@pytest.mark.parametrize("family", sorted(SAME_RECORD))
def test_family_split_vs_unsplit_quick(smokes, family):
    projection, text = SAME_RECORD[family]
    r = smoke(smokes, family)
    assert r["benchmark"] == f"{family}_split_vs_unsplit" and r["steps"] == 4
    assert_ratios(r, ["total_time_ratio", f"projected_total_time_ratio_{projection}", "step_time_ratio",
                      "peak_rss_ratio", f"{text}_share_of_one_stage_step", "vae_share_of_one_stage_step"])
    assert set(r["params"]) == {"transformer", "text_encoder", "vae"} and r["params"]["transformer"] > 0
    if family == "ideogram4":  # stage 2 runs the DiT alone: Qwen3-VL's 36 layers and the AE are left out of its steps
        assert r["step_time_stage2_s"] < r["step_time_one_stage_s"]


@pytest.mark.parametrize("family,projection", [("stable_diffusion", "5x50"), ("stable_diffusion_xl", "5x10")])
def test_stable_diffusion_split_vs_unsplit_quick(smokes, family, projection):
    """SD 1.5's and SDXL's rows: the UNet alone in stage 2; CLIP-L (and bigG) and the VAE's encoder (its encoder.* and
    quant_conv.* counted) cached in stage 1."""
    r = smoke(smokes, family)
    assert r["benchmark"] == f"{family}_split_vs_unsplit" and r["steps"] == 4
    parts = {"transformer", "text_encoder", "vae"} | ({"text_encoder_2"} if family.endswith("_xl") else set())
    assert set(r["params"]) == parts == set(r["real_params_over_dit"]) and all(v > 0 for v in r["params"].values())
    timed = ["text_share_of_one_stage_step", "vae_share_of_one_stage_step"]
    assert_ratios(r, ["total_time_ratio", f"projected_total_time_ratio_{projection}", "step_time_ratio",
                      "peak_rss_ratio", *timed, *(["text_2_share_of_one_stage_step"] if "text_encoder_2" in parts
                                                    else [])])


def test_ace_step_split_vs_unsplit_quick(smokes):
    """ACE-Step's row: 48 kHz stereo clips with prompts and lyrics, the condition encoder (in the DiT's file) counted
    and cached in stage 1, the DiT alone in stage 2."""
    r = smoke(smokes, "ace_step")
    assert r["benchmark"] == "ace_step_split_vs_unsplit" and r["steps"] == 4 and r["clips"] == 2
    assert r["clip_seconds"] == 1
    assert set(r["params"]) == {"transformer", "conditioner", "text_encoder", "vae"}
    assert all(v > 0 for v in r["params"].values())
    assert_ratios(r, ["total_time_ratio", "projected_total_time_ratio_5x50", "step_time_ratio", "peak_rss_ratio"])
    assert r["step_time_stage2_s"] < r["step_time_one_stage_s"]


def test_ltx2_split_vs_unsplit_quick(smokes):
    """LTX-2's row: clips with their sound, the Repackage files and the Gemma-3 folder as a user has them; Gemma-3,
    the text connectors and both VAE encoders counted and cached in stage 1, the DiT alone in stage 2."""
    r = smoke(smokes, "ltx2")
    assert r["benchmark"] == "ltx2_split_vs_unsplit" and r["steps"] == 4 and r["clips"] == 2 and r["num_frames"] == 9
    assert set(r["params"]) == {"transformer", "text_encoder", "text_encoder_post_modules", "video_vae_encoder",
                                "audio_vae_encoder"}
    assert all(v > 0 for v in r["params"].values()) and set(r["real_params_over_dit"]) == set(r["params"])
    assert_ratios(r, ["total_time_ratio", "projected_total_time_ratio_5x100", "step_time_ratio", "peak_rss_ratio",
                      "text_share_of_one_stage_step", "vae_share_of_one_stage_step"])
    assert r["step_time_stage2_s"] < r["step_time_one_stage_s"]


def test_fidelity_quick(tmp_path):
    """benchmarks/fidelity.py --quick: Z-Image's and Wan's stage-1 values, loss and LoRA gradients of one step agree
    with the reference's own code (DiffSynth-Studio's venv) within the targets: loss 1e-5, gradients 1e-4 (rel. L2 over all LoRA tensors);
    for Z-Image at the reference's value of the forced timestep (its table's fp32 rounding, one ulp off difftune's at
    that index, is docs/reference_differences.md's "Training-table rounding")."""
    if not DS_PYTHON.is_file():
        pytest.skip(f"DiffSynth-Studio's venv ({DS_PYTHON}) is absent: the fidelity benchmark needs it")
    r = run_quick("fidelity.py", tmp_path, "--ds-python", str(DS_PYTHON), timeout=900)
    assert r["benchmark"] == "fidelity" and set(r["families"]) == {"z_image", "wan"}
    for family, row in r["families"].items():
        assert "error" not in row, row.get("error")
        assert max(row["stage1"].values()) <= 1e-5, (family, row["stage1"])
        assert row["loss_rel"] <= r["targets"]["loss"], (family, row["loss_rel"])
        assert row["lora_tensors"] > 0
        if row["timestep_difftune"] != row["timestep_reference"]:  # the documented table rounding
            assert row["met_at_reference_timestep"], (family, row["aligned_timestep"])
        else:
            assert row["grad_rel_l2_all"] <= r["targets"]["grad"], (family, row["grad_rel_l2_all"])
            assert row["met"]
