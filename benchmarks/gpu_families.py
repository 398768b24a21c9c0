"""benchmarks/gpu.py's `mfu` and `reference` parts: stage-2 LoRA MFU of the families at real block width, and
difftune's stage-2 step against DiffSynth-Studio's own on the same GPU, blocks and data.

Each family's DiT is built at its real width with a few blocks (`--mfu_blocks`), beside text encoders of the real output
width with one or two layers and the tests' small VAEs (stage 1 only feeds the cache): Qwen-Image (24 heads of 128,
text 3584), FLUX.1 (24 heads of 128, double:single blocks 1:2, T5 4096 / CLIP 768), Wan 14B (40 heads of 128, FFN
13824, UMT5 4096), Z-Image (30 heads of 128, one refiner of each kind, Qwen3 2560), ACE-Step v1.5 (16 heads /
8 KV heads of 128, MLP 6144, its condition encoder 2048 and Qwen3 1024 wide with a layer each, the release's VAE, a
30 s clip) and LTX-2.0 (32 video heads of 128 and 32 audio heads of 64; Gemma-3 128 wide with its 48 layers, the
connectors' inputs; 121 frames at 512x512 with sound). Per family: stage 1 into a
cache, then stage 2 (bf16, LoRA rank 32 on the family's reference targets, batch 1) with and without gradient
checkpointing. The model FLOPs of a step are counted, not modelled: torch's `FlopCounterMode` over one warm-up step of
the run without checkpointing (matrix products and torch's attention kernels, forward and backward; where the
attention ran in a kernel the counter does not know, one more short run with `--attention_backend native` counts
them; on a CPU, SDPA's kernel is not counted either, and no MFU is given). MFU is those FLOPs over the median step
time over the card's dense bf16 peak.

`reference`: DiffSynth-Studio trains the same Qwen-Image blocks from its own stage-1 cache with
`benchmarks/peer_diffsynth.py` (the peers benchmark's runner: its `DiffusionTrainingModule`, `launch_training_task`),
on the GPU, in bf16, with and without its gradient checkpointing; difftune ÷ reference step time (difftune's from the
`mfu` part when it ran first). The reference needs its `diffsynth` package: `--ds-python` (a venv that has it) or
`--diffsynth_src` (a DiffSynth-Studio checkout, put on the path of this python); without either the part says so and
skips. FLUX.1, Wan and Z-Image have no reference runner
yet (peer_diffsynth.py builds DiffSynth's Qwen-Image classes only).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
import traceback
from pathlib import Path

from common import ROOT, child_command, fresh, ratio, run_child, step_time

FAMILIES = ("qwen_image", "flux", "wan", "z_image", "ace_step", "ltx2")
COUNTED_STEP = 1  # FLOPs counted between optimizer steps 1 and 2 (a warm-up step: timing drops it)
ATTENTION_OPS = ("_scaled_dot_product", "scaled_dot_product")


# -- configurations --------------------------------------------------------------------------------------------

def family_config(family: str, blocks: int, resolution: int, quick: bool):
    """The family's benchmark configuration: real width with `blocks` blocks, or the tests' tiny model (`quick`)."""
    if family == "qwen_image":
        import common

        return common.quick() if quick else common.realwidth(blocks, 2, resolution)
    from split_vs_unsplit import FAMILIES, Config  # the split benchmark's family table

    if quick and family in FAMILIES:
        return FAMILIES[family].config(quick=True)
    if family == "flux":
        return Config("realwidth", dict(
            num_layers=blocks, num_single_layers=2 * blocks, num_attention_heads=24, attention_head_dim=128,
            axes_dims_rope=(16, 56, 56), clip_hidden=768, clip_layers=1, clip_intermediate=3072, t5_hidden=4096,
            t5_layers=1, t5_heads=64, t5_d_kv=64, t5_d_ff=10240), resolution=resolution)
    if family == "wan":
        # 17 frames at 512x512: 5 latent frames of 32x32 patches, 5,120 tokens (Wan's 81 at 480x832 are 32,760)
        return Config("realwidth", dict(
            num_layers=blocks, num_attention_heads=40, attention_head_dim=128, ffn_dim=13824, text_dim=4096,
            t5_layers=1, t5_heads=64, t5_d_kv=64, t5_d_ff=10240), resolution=min(resolution, 512), num_frames=17)
    if family == "z_image":
        return Config("realwidth", dict(
            dim=3840, n_heads=30, axes_dims=(32, 48, 48), n_layers=blocks, n_refiner_layers=1, text_hidden=2560,
            text_layers=1, text_heads=32, text_head_dim=128, text_intermediate=9728), resolution=resolution)
    if family == "ace_step":
        # ACE-Step v1.5 turbo's DiT at its width (16 heads / 8 KV heads of 128, MLP 6144) with `blocks` layers, its
        # 2048-wide condition encoder and 1024-wide Qwen3 with one layer each, the release's Oobleck VAE and 64
        # latent channels; a 30 s clip (750 latent frames, 375 DiT tokens); `resolution` does not apply to audio
        return Config("realwidth", dict(
            dit=dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=blocks, num_attention_heads=16,
                     num_key_value_heads=8, head_dim=128),
            conditioner=dict(hidden_size=2048, intermediate_size=6144, num_lyric_encoder_hidden_layers=1,
                             num_timbre_encoder_hidden_layers=1, num_attention_heads=16, num_key_value_heads=8,
                             head_dim=128),
            text=dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=1, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=128),
            vae=dict(encoder_hidden_size=128, decoder_channels=128), channels=64), resolution=0, seconds=30)
    if family == "ltx2":
        # LTX-2.0 19B's DiT at its width (32 video heads of 128, 32 audio heads of 64) with `blocks` blocks; Gemma-3
        # 128 wide with the 48 layers the text connectors read (49 hidden states) and the connectors at its width
        # (the DiT projects the context to its own 4096 / 2048), the tests' small VAEs (8 video, 2 audio latent
        # channels): they only feed the cache. 121 frames at 512x512 with sound (16 latent frames of 16x16: 4,096
        # video tokens, 126 sound tokens; the reference's 768x512 clips of 121 frames are 6,144 + 126)
        return Config("realwidth", dict(
            dit=dict(num_attention_heads=32, audio_num_attention_heads=32, num_layers=blocks),
            gemma=dict(hidden_size=128), video_vae=dict(latent_channels=8, block_out_channels=[16, 32, 64, 128],
                                                        layers_per_block=[1, 1, 1, 1, 1],
                                                        decoder_block_out_channels=[16, 32, 64]),
            audio_channels=2), resolution=min(resolution, 512), num_frames=121)
    raise SystemExit(f"unknown family {family}")


def _set(flags: list[str], name: str, value: str) -> list[str]:
    out = list(flags)
    if name in out:
        out[out.index(name) + 1] = value
    else:
        out += [name, value]
    return out


def family_flags(family: str, wd: Path, cfg, n: int, dtype: str):
    """(fn() -> stage-1 flags, fn(output, repeat, checkpointing, extra) -> stage-2 flags) of `family` on `n` samples,
    its model and data written (or reused). Building a run's flags empties its output folder (the cache for stage 1)."""
    if family == "qwen_image":
        from common import device_workspace, train_flags

        ws = device_workspace(wd, cfg, n)
        def s1():
            return train_flags(ws, "sft:data_process", wd / "cache", components=("text_encoder", "vae"))

        def s2(output, repeat):
            return train_flags(ws, "sft:train", output, dataset=wd / "cache", repeat=repeat,
                               components=("transformer",))
    else:  # the split benchmark's family table
        from split_vs_unsplit import DIT, FAMILIES
        from split_vs_unsplit import flags as split_flags

        prep = FAMILIES[family].prepare(wd, cfg, n)
        def s1():
            return split_flags(prep, cfg, "sft:data_process", wd / "cache", components=prep.stage1)

        def s2(output, repeat):
            return split_flags(prep, cfg, "sft:train", output, dataset=wd / "cache", repeat=repeat,
                               components=(DIT,))

    def stage2(output: Path, repeat: int, checkpointing: bool, extra=()) -> list[str]:
        flags = _set(_set(s2(output, repeat), "--torch_dtype", dtype), "--lora_rank", str(cfg.lora_rank))
        return flags + (["--use_gradient_checkpointing"] if checkpointing else []) + list(extra)

    def stage1() -> list[str]:
        return _set(s1(), "--torch_dtype", dtype)

    return stage1, stage2


# -- the measured child ----------------------------------------------------------------------------------------

def flops_child(payload: dict) -> dict:
    """In a child process: a measured stage-2 run with torch's FLOP counter over one optimizer step."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.utils.flop_counter import FlopCounterMode

    from common import measure_difftune

    counter, seen = FlopCounterMode(display=False), [0]

    def hook(*_):
        seen[0] += 1
        if seen[0] == payload["step"]:
            counter.__enter__()
        elif seen[0] == payload["step"] + 1:
            counter.__exit__(None, None, None)

    handle = register_optimizer_step_post_hook(hook)
    try:
        record = measure_difftune(payload["argv"])
    finally:
        handle.remove()
    if seen[0] <= payload["step"]:
        raise RuntimeError(f"{seen[0]} optimizer steps: too few to count step {payload['step']}")
    by_op = {str(op): int(v) for op, v in counter.get_flop_counts().get("Global", {}).items()}
    record.update(step_flops=int(counter.get_total_flops()), flops_by_op=by_op,
                  attention_counted=any(a in op for op in by_op for a in ATTENTION_OPS),
                  device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")
    return record


def counted_run(argv: list[str], threads: int, isolated: bool = True) -> dict:
    """`flops_child` in a fresh process (GPU memory and allocator peaks its own), or in this one (smoke runs)."""
    payload = {"kind": "flops", "argv": argv, "step": COUNTED_STEP}
    if isolated:
        return run_child(child_command(sys.executable, Path(__file__).with_name("gpu.py"), payload), threads)
    from common import reset_accelerate

    try:
        return flops_child(payload)
    finally:
        reset_accelerate()


# -- parts -----------------------------------------------------------------------------------------------------

def _summary(record: dict, warmup: int) -> dict:
    return {"step_time_s": step_time(record, warmup), "steps": record.get("steps"),
            "gpu_peak_allocated_mib": record.get("gpu_peak_allocated_mib"), "run_seconds": record.get("run_seconds"),
            "step_flops_counted": record.get("step_flops"), "attention_counted": record.get("attention_counted")}


def part_mfu(wd: Path, args, peak: float | None) -> dict:
    """Per family: stage 1, then stage 2 with and without checkpointing; MFU from counted model FLOPs."""
    from common import run_difftune

    warmup = max(args.warmup, COUNTED_STEP + 1)
    out = {"families": {}, "dtype": args.dtype, "blocks": None if args.quick else args.mfu_blocks,
           "images": args.images, "repeat": args.repeat, "warmup_steps": warmup, "peak_flops": peak}
    for family in args.families.split(","):
        if time.monotonic() > getattr(args, "deadline", float("inf")):  # --budget spent: the next parts' time
            out["families"][family] = {"error": "skipped: out of time (--budget)"}
            continue
        try:
            cfg = family_config(family, args.mfu_blocks, args.resolution, args.quick)
            fwd = wd / family
            s1, stage2 = family_flags(family, fwd, cfg, args.images, args.dtype)
            isolated = not args.quick  # smoke runs stay in this process (seconds, not a process start each)
            run_difftune(s1(), isolated, args.threads)
            runs = {}
            for ckpt in (False, True):
                runs[ckpt] = counted_run(stage2(fwd / "two", args.repeat, ckpt), args.threads, isolated)
            model_flops = runs[False]["step_flops"]
            if not runs[False]["attention_counted"] and runs[False]["device"] != "cpu":
                # the attention ran in a kernel the counter does not know (flash3, ...): count it with SDPA's
                model_flops = counted_run(stage2(fwd / "count", COUNTED_STEP + 1, False,
                                                 ["--attention_backend", "native"]), args.threads,
                                          isolated)["step_flops"]
            r = {"config": cfg.name, "spec": {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.spec.items()},
                 "resolution": cfg.resolution, "lora_rank": cfg.lora_rank, "model_flops_per_step": model_flops}
            for ckpt, key in ((False, "no_checkpointing"), (True, "checkpointing")):
                s = _summary(runs[ckpt], warmup)
                s["mfu"] = model_flops / s["step_time_s"] / peak if peak else None
                r[key] = s
            out["families"][family] = r
        except Exception as e:  # the next family still runs
            out["families"][family] = {"error": f"{type(e).__name__}: {e}"[-3000:],
                                       "traceback": traceback.format_exc()[-3000:]}
        print(f"mfu {family}: {'error' if 'error' in out['families'][family] else 'ok'}", flush=True)
    return out


def diffsynth_python(args) -> tuple[str | None, dict, str | None]:
    """(python, extra environment, why not) for running DiffSynth-Studio's `diffsynth` package."""
    if args.ds_python:
        if not Path(args.ds_python).is_file():
            return None, {}, f"--ds-python {args.ds_python}: no such file"
        return args.ds_python, {}, None
    if args.diffsynth_src:
        src = Path(args.diffsynth_src).resolve()
        if not (src / "diffsynth" / "__init__.py").is_file():
            return None, {}, f"--diffsynth_src {src}: no diffsynth/ package in it"
        path = [str(src), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]  # run_child's path, the checkout first
        return sys.executable, {"PYTHONPATH": os.pathsep.join(path).rstrip(os.pathsep)}, None
    if importlib.util.find_spec("diffsynth") is not None:
        return sys.executable, {}, None
    return None, {}, ("DiffSynth-Studio's `diffsynth` package is not importable here: give --ds-python (a venv with "
                      "`pip install diffsynth==2.1.12`) or --diffsynth_src (a DiffSynth-Studio checkout)")


def part_reference(wd: Path, args) -> dict:
    """difftune's stage 2 against DiffSynth-Studio's on the same Qwen-Image blocks, data and GPU. The mfu part's
    Qwen-Image model, data, cache and step times are reused when it ran first in this run (same flags)."""
    import json

    import torch

    from common import device_workspace, run_difftune
    from peers import template_drop

    python, env, why = diffsynth_python(args)
    if why:
        return {"skipped": why}
    cfg = family_config("qwen_image", args.mfu_blocks, args.resolution, args.quick)
    fwd = wd / "qwen_image"
    stage1, stage2 = family_flags("qwen_image", fwd, cfg, args.images, args.dtype)
    ws = device_workspace(fwd, cfg, args.images)
    warmup = max(args.warmup, COUNTED_STEP + 1)
    mfu_file = Path(args.out) / "mfu.json"
    measured = json.loads(mfu_file.read_text()).get("families", {}).get("qwen_image", {}) if mfu_file.is_file() else {}
    if "error" in measured or measured.get("config") != cfg.name:
        measured = {}
    if not measured and not any((fwd / "cache").rglob("*.safetensors")):
        run_difftune(stage1(), True, args.threads)
    base = {"spec": {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.tiny_spec().__dict__.items()},
            "repo": str(ws.repo), "resolution": cfg.resolution, "data": str(ws.data), "metadata": str(ws.metadata),
            "rank": cfg.lora_rank, "drop": template_drop(ws.repo), "epochs": 1, "repeat": args.repeat,
            "device": "cuda" if torch.cuda.is_available() else "cpu", "dtype": args.dtype}
    script = Path(__file__).with_name("peer_diffsynth.py")
    run_child(child_command(python, script, dict(base, task="sft:data_process", models=["text_encoder", "vae"],
                                                 output=str(fresh(fwd / "ds-cache")))), args.threads, env=env)
    out = {"family": "qwen_image", "config": cfg.name, "blocks": None if args.quick else args.mfu_blocks,
           "resolution": cfg.resolution, "dtype": args.dtype, "lora_rank": cfg.lora_rank, "warmup_steps": warmup,
           "difftune_from_mfu_part": bool(measured)}
    for ckpt, key in ((False, "no_checkpointing"), (True, "checkpointing")):
        if measured:
            t_dt, peak_dt = measured[key]["step_time_s"], measured[key]["gpu_peak_allocated_mib"]
        else:
            dt = run_difftune(stage2(fwd / "two", args.repeat, ckpt), True, args.threads)
            t_dt, peak_dt = step_time(dt, warmup), dt.get("gpu_peak_allocated_mib")
        ds = run_child(child_command(python, script, dict(base, task="sft:train", models=["dit"], checkpointing=ckpt,
                                                          cache=str(fwd / "ds-cache"),
                                                          output=str(fresh(fwd / "ds-two")))), args.threads, env=env)
        t_ds = step_time(ds, warmup)
        out[key] = {"difftune_step_s": t_dt, "reference_step_s": t_ds, "difftune_over_reference": ratio(t_dt, t_ds),
                    "speedup": ratio(t_ds, t_dt), "difftune_peak_allocated_mib": peak_dt,
                    "reference_peak_allocated_mib": ds.get("gpu_peak_allocated_mib")}
    out["not_covered"] = "FLUX.1, Wan, Z-Image: no DiffSynth-Studio runner in benchmarks/peer_diffsynth.py yet"
    return out


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:.1%}"


def render(mfu: dict | None, reference: dict | None) -> list[str]:
    """The doc's paragraphs and tables for the two parts."""
    from common import table

    parts = []
    if mfu:
        rows, done = [], [r for r in mfu["families"].values() if "error" not in r]
        for family, r in mfu["families"].items():
            if "error" in r:
                rows.append([family, "error", "", "", "", ""])
                continue
            n, c = r["no_checkpointing"], r["checkpointing"]
            rows.append([family, r["model_flops_per_step"] / 1e12, n["step_time_s"], _pct(n["mfu"]), c["step_time_s"],
                         _pct(c["mfu"])])
        names = sorted({r["config"] for r in done}) or ["-"]
        ranks = sorted({r["lora_rank"] for r in done}) or ["-"]
        blocks = f"{mfu['blocks']} real-width blocks per family" if mfu["blocks"] else "the tests' tiny models"
        parts.append(f"**Stage-2 LoRA MFU** (`--parts mfu`, configuration {', '.join(names)}): {blocks}, "
                     f"{mfu['dtype']}, LoRA rank {', '.join(map(str, ranks))} on the reference "
                     f"targets, batch 1, default flags; model FLOPs counted by torch's FlopCounterMode over one step "
                     f"without checkpointing; step time the median after {mfu['warmup_steps']} warm-up steps.")
        parts.append(table(["family", "model TFLOP / step", "step (s), no checkpointing", "MFU",
                            "step (s), checkpointing", "MFU"], rows))
    if reference and "skipped" not in reference:
        rows = [[k.replace("_", " "), reference[k]["difftune_step_s"], reference[k]["reference_step_s"],
                 reference[k]["speedup"]] for k in ("no_checkpointing", "checkpointing")]
        parts.append(f"**difftune against DiffSynth-Studio's own stage 2** (`--parts reference`): the same "
                     f"{reference['blocks'] or 'tiny'} Qwen-Image blocks, data and GPU, {reference['dtype']}.")
        parts.append(table(["gradient checkpointing", "difftune step (s)", "DiffSynth-Studio step (s)",
                            "difftune speed-up"], rows))
    return parts
