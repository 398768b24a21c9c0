"""Split training against one-stage training on the same model, data and flags, for each family of the table.

Per family, three runs of the CLI path, one process each: `sft` (one stage), `sft:data_process` (stage 1: the text
encoders and the VAE, into a cache) and `sft:train` (stage 2: the DiT alone, from that cache), on a CPU-scale model
with the release's proportions. Where the family's entry says how, this process then times its stage-1 work apart
(one prompt's encode, one image's or clip's), to give its share of a one-stage step. Prints one JSON line per family
(the ratios side by side) and writes the family's section of docs/benchmarks.md.

    .venv/bin/python benchmarks/split_vs_unsplit.py --family qwen_image    # the proportional model (~3 min here)
    .venv/bin/python benchmarks/split_vs_unsplit.py --family flux --quick  # smoke run on the tests' tiny model
    .venv/bin/python benchmarks/split_vs_unsplit.py --family wan --variant vace   # one variant (the section: it alone)
    .venv/bin/python benchmarks/split_vs_unsplit.py --family all           # every family, one after another

The family table (`FAMILIES`, at the end) is the only part that names a family: per family, how its tiny model and
data are written, what its runs load and train, its configurations, the reference's step count, what is timed apart
and what its record and section add.
"""

from __future__ import annotations

import importlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import (PROMPTS, _measure_child, base_parser, cache_bytes, child_command, child_main,  # noqa: E402
                    data_wait_share, emit, fresh, machine, machine_line, median_seconds, param_counts, ratio,
                    resolve_doc, reuse_or_write, run_child, run_difftune, split_figures, split_rows, table, update_doc,
                    verdict, workdir_of, write_images)

DIT = "transformer"  # the component stage 2 trains; every other one is stage 1's
SPLIT_HEADER = ["metric", "one stage", "split (stage 2)", "split ÷ one stage"]
# per run size: (with --quick, without); a family's entry replaces some
DEFAULTS = {"samples": (2, 4), "epochs": (1, 1), "repeat": (2, 4), "warmup": (1, 3)}


@dataclass
class Config:
    """A family's model configuration and the fixed resolution it is measured at."""

    name: str  # "quick", "proportional", "realwidth" (benchmarks/gpu_families.py)
    spec: dict = field(default_factory=dict)  # the settings of the family's tiny-model writer
    resolution: int = 64
    lora_rank: int = 32
    num_frames: int = 0  # clips: frames per clip; 0 for images
    seconds: float = 0.0  # audio clips: the seconds a clip trains (0 for images and videos)


QUICK = Config("quick", lora_rank=4)  # the tests' tiny model: for smoke runs only (the step is overhead, not compute)


@dataclass
class Prepared:
    """A family's model and data on disk, and what its runs are given."""

    repo: Path
    metadata: Path
    paths: dict  # component -> its weight file(s), in the one-stage run's order; the DiT is DIT
    lora_targets: str
    tokenizer: Path | None = None
    lora_base: str = "dit"
    num_frames: int = 0
    extra_flags: tuple = ()
    counted: dict | None = None  # name -> the glob under `repo` whose parameters it has (default: {component}/*)
    nested: dict = field(default_factory=dict)  # name -> a component its files hold too (its count taken off)
    known: list = field(default_factory=list)  # [module, spec, label, config]: registered in the training process
    keys: dict = field(default_factory=dict)  # name -> the key prefixes of its files it counts (default: every key)

    @property
    def stage1(self) -> tuple:
        return tuple(c for c in self.paths if c != DIT)


@dataclass(frozen=True)
class Family:
    """One row of the family table (see FAMILIES)."""

    benchmark: str  # the record's name and its section of docs/benchmarks.md
    label: str  # its name in the summary line
    prepare: Callable  # (workdir, cfg, n) -> Prepared: the model (reused when the same spec is there) and n samples
    proportional: Callable  # (variant) -> Config: the release's proportions at CPU scale
    real: dict  # the release's parameters per component
    release: str | Callable  # its name in the section (or (record) -> it)
    parts: dict  # component -> its name in the section, the DiT first
    lora_on: str | Callable  # what the LoRA trains, in the section (or (record) -> it)
    notes: str | Callable = ""  # more of the section's first sentence (prompts, data)
    quick: Callable = lambda variant: QUICK
    ref_repeat: int = 50  # the reference's --dataset_repeat at its --num_epochs 5
    samples: str = "images"  # what an epoch is made of: the record's key and the flag (--images, --clips)
    defaults: dict = field(default_factory=dict)  # DEFAULTS it changes
    encode: Callable | None = None  # (prep, cfg, threads) -> {"<name>_encode_s" or "<name>_s": seconds}, timed apart
    timings: dict = field(default_factory=dict)  # those keys -> what each times, in the section
    variants: tuple = ()  # runs measured side by side, the first at the record's top level, the others under their name
    extra: Callable | None = None  # (record, cfg, runs, work) -> more of the record
    note: Callable | None = None  # (record) -> the end of the timings sentence
    table: Callable | None = None  # (record) -> its table, where split_rows is not all of it

    def config(self, quick: bool, variant: str | None = None) -> Config:
        variant = variant or (self.variants[0] if self.variants else None)
        return (self.quick if quick else self.proportional)(variant)

    def size(self, quick: bool, name: str) -> int:
        return {**DEFAULTS, **self.defaults}[name][0 if quick else 1]


# -- the runs -----------------------------------------------------------------------------------------------------

def flags(prep: Prepared, cfg, task: str, output: Path, *, dataset: Path | None = None, epochs: int = 1,
          repeat: int = 1, components=None) -> list[str]:
    """The reference's LoRA command (fp32 on this CPU: it has no native bf16) at a fixed resolution. `output` is
    emptied first: every run is measured from scratch (a stage 1 would otherwise resume). A file two components
    share (ACE-Step's DiT and its condition encoder) is given once."""
    fresh(output)
    res = str(cfg.resolution)
    out = ["--task", task, "--output_path", str(output),
           "--model_paths", json.dumps(list(dict.fromkeys(prep.paths[c] for c in components or prep.paths)))]
    out += ["--tokenizer_path", str(prep.tokenizer)] if prep.tokenizer else []
    out += ["--height", res, "--width", res] if cfg.resolution else []  # audio: no resolution
    out += ["--num_frames", str(prep.num_frames)] if prep.num_frames else []
    out += ["--torch_dtype", "float32", "--learning_rate", "1e-4", "--num_epochs", str(epochs), "--dataset_repeat",
            str(repeat), "--lora_base_model", prep.lora_base, "--lora_target_modules", prep.lora_targets,
            "--lora_rank", str(cfg.lora_rank), "--seed", "0", "--no_progress", "--enable_tensorboard_log", "false",
            *prep.extra_flags]
    if dataset is None:
        return out + ["--dataset_base_path", str(prep.metadata.parent), "--dataset_metadata_path", str(prep.metadata)]
    return out + ["--dataset_base_path", str(dataset)]


def register(known) -> None:
    """Configs a family's files are recognised by that are no official one (a benchmark's sizes): registered in the
    process that trains, as the tests register theirs."""
    for module, spec, label, config in known:
        getattr(importlib.import_module(module), spec).known_configs[label] = config


def run(argv: list, prep: Prepared, isolated: bool, threads: int) -> dict:
    """`run_difftune`, with `prep.known` registered first (in a child of this script when isolated)."""
    if isolated and prep.known:
        return run_child(child_command(sys.executable, Path(__file__), {"argv": argv, "known": prep.known}), threads)
    register(prep.known)
    return run_difftune(argv, isolated, threads)


def _child(payload: dict) -> dict:
    register(payload["known"])
    return _measure_child({"kind": "difftune", "argv": payload["argv"]})


def count_params(prep: Prepared) -> dict:
    counts = param_counts(prep.repo, prep.counted or {c: f"{c}/*.safetensors" for c in prep.paths})
    for name, prefixes in prep.keys.items():  # a part of its files: only the keys it reads
        counts[name] = _prefix_count(prep.repo, (prep.counted or {})[name], prefixes)
    for name, inside in prep.nested.items():
        counts[name] -= counts[inside]
    return counts


def _prefix_count(repo: Path, pattern: str, prefixes: tuple) -> int:
    """Parameters of the tensors whose names start with one of `prefixes`, in the files `pattern` matches."""
    from safetensors import safe_open

    total = 0
    for path in sorted(repo.glob(pattern)):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                if key.startswith(tuple(prefixes)):
                    n = 1
                    for d in f.get_slice(key).get_shape():
                        n *= d
                    total += n
    return total


def share_key(timing: str) -> str:
    """The record's key of a timing's share: "qwen3_encode_s" -> "qwen3_share_of_one_stage_step", "vace_context_s" ->
    "vace_context_share_of_one_stage_step"."""
    return timing.removesuffix("_s").removesuffix("_encode") + "_share_of_one_stage_step"


def measure(name: str, fam: Family, cfg, variant, wd: Path, n: int, epochs: int, repeat: int, warmup: int,
            isolated: bool, threads: int) -> dict:
    """One configuration's three runs and apart timings: its figures."""
    prep = fam.prepare(wd, cfg, n)
    params = count_params(prep)
    work = wd / name / (variant or "")
    runs = {"one": run(flags(prep, cfg, "sft", work / "one", epochs=epochs, repeat=repeat), prep, isolated, threads)}
    runs["stage1"] = run(flags(prep, cfg, "sft:data_process", work / "cache", components=prep.stage1), prep,
                         isolated, threads)
    runs["stage2"] = run(flags(prep, cfg, "sft:train", work / "two", dataset=work / "cache", epochs=epochs,
                               repeat=repeat, components=(DIT,)), prep, isolated, threads)
    enc = fam.encode(prep, cfg, threads) if fam.encode else {}
    # the reference trains --num_epochs 5 --dataset_repeat ref_repeat
    figures = split_figures(runs["one"], runs["stage1"], runs["stage2"], warmup, ref_steps=n * 5 * fam.ref_repeat,
                            tag=f"5x{fam.ref_repeat}")
    t1, dit = figures["step_time_one_stage_s"], params[DIT]
    r = {**({"variant": variant} if variant else {}), "config": cfg.name, "resolution": cfg.resolution,
         **({"num_frames": prep.num_frames} if prep.num_frames else {}),
         **({"clip_seconds": cfg.seconds} if getattr(cfg, "seconds", None) else {}), fam.samples: n, "epochs": epochs,
         "repeat": repeat, "steps": runs["one"]["steps"], "warmup_steps": warmup, "lora_rank": cfg.lora_rank,
         "isolated_processes": isolated, "params": params, "params_over_dit": {k: v / dit for k, v in params.items()},
         "real_params_over_dit": {k: fam.real[k] / fam.real[DIT] for k in params if k in fam.real}, **figures, **enc}
    r.update({share_key(k): ratio(s, t1) for k, s in enc.items()})
    if enc:  # what stage 2 no longer does, from the two runs' step times
        r["cached_share_of_one_stage_step"] = 1.0 - figures["step_time_stage2_s"] / t1
    if fam.extra:
        r.update(fam.extra(r, cfg, runs, work))
    return r


# -- the record, the section --------------------------------------------------------------------------------------

def _text(value, r: dict) -> str:
    return value(r) if callable(value) else value


def _millions(count: int) -> str:
    return f"{count / 1e6:.2f}M" if count >= 1e6 else f"{count / 1e6:.3f}M"


def head(fam: Family, r: dict) -> str:
    """The section's sentences on the model and what was timed apart."""
    p, q, real = r["params"], r["params_over_dit"], r["real_params_over_dit"]
    sizes = []
    for c, label in fam.parts.items():
        if c not in p:
            continue
        size = f"{label} {_millions(p[c])}"
        if c != DIT:
            first = len(sizes) == 1
            rel = f"{q[c]:.3g}x the DiT" if first else f"{q[c]:.3g}x"
            if c in real:
                rel += f"; {_text(fam.release, r) if first else 'real'} {real[c]:.3g}x"
            size += f" ({rel})"
        sizes.append(size)
    notes = _text(fam.notes, r)
    clips = f", {r['num_frames']}-frame clips" if "num_frames" in r else ""
    at = (f"{r['clip_seconds']:g} s 48 kHz stereo clips" if "clip_seconds" in r else
          f"{r['resolution']}x{r['resolution']}")
    text = (f"{'**' + r['variant'].upper() + '.** ' if 'variant' in r else ''}Config `{r['config']}`{clips} at "
            f"{at}: {', '.join(sizes)}; LoRA rank {r['lora_rank']} on "
            f"{_text(fam.lora_on, r)}; fp32{'; ' + notes if notes else ''}; stage 1 took {r['stage1_seconds']:.1f} s "
            f"(model loading included), peak RSS {r['peak_rss_stage1_mib']:.0f} MiB.")
    timed = [k for k in fam.timings if k in r]
    if not timed:
        return text
    pieces = [f"{fam.timings[k]} {r[k]:.3f} s ({100 * r[share_key(k)]:.0f}%)" for k in timed]
    first = timed[0]
    pieces[0] = f"{fam.timings[first]} takes {r[first]:.3f} s ({100 * r[share_key(first)]:.0f}% of a one-stage step)"
    listed = pieces[0] if len(pieces) == 1 else ", ".join(pieces[:-1]) + " and " + pieces[-1]
    return (f"{text} The work stage 2 leaves out is {100 * r['cached_share_of_one_stage_step']:.0f}% of a one-stage "
            f"step (1 - the step-time ratio). Timed apart in the benchmark's own process afterwards, {listed}"
            f"{fam.note(r) if fam.note else ''}.")


def render(fam: Family, runs: dict, info: dict) -> str:
    tag = f"5x{fam.ref_repeat}"
    parts = []
    if fam.variants:  # the variants side by side
        shares = [k for k in fam.timings if any(k in r for r in runs.values())]
        parts.append(table(
            ["variant", "step time ratio", "total time ratio", f"projected (5 x {fam.ref_repeat})",
             "stage-2 peak RSS ratio", "stage-2 peak RSS above the baseline, ratio",
             *(f"{fam.timings[k]} ÷ one-stage step" for k in shares)],
            [[v.upper(), r["step_time_ratio"], r["total_time_ratio"], r[f"projected_total_time_ratio_{tag}"],
              r["peak_rss_ratio"], r["peak_rss_above_baseline_ratio"], *(r.get(share_key(k), "") for k in shares)]
             for v, r in runs.items()]))
    for r in runs.values():
        parts += [head(fam, r), fam.table(r) if fam.table else
                  table(SPLIT_HEADER, split_rows(r, f"{r[fam.samples]} {fam.samples}", fam.ref_repeat, tag))]
    return "\n\n".join(parts + [machine_line(info)])


def summary_line(fam: Family, r: dict) -> str:
    tag = f"5x{fam.ref_repeat}"
    timed = [f"{fam.timings[k]} {r[share_key(k)]:.2f}" for k in fam.timings if k in r]
    shares = f"; timed apart, of a one-stage step: {', '.join(timed)}" if timed else ""
    return (f"{fam.label}{' ' + r['variant'] if 'variant' in r else ''} split / one stage: total time "
            f"{r['total_time_ratio']:.3f} (projected to 5 epochs x repeat {fam.ref_repeat}: "
            f"{r[f'projected_total_time_ratio_{tag}']:.3f}), step time {r['step_time_ratio']:.3f}, stage-2 peak RSS "
            f"{r['peak_rss_ratio']:.3f} ({r['peak_rss_above_baseline_ratio']:.3f} above the baseline){shares}")


def bench(name: str, args) -> dict:
    """One family's benchmark: its variants' runs, its section of the doc, its JSON line."""
    fam = FAMILIES[name]
    variants = fam.variants or (None,)
    if args.variant in fam.variants:
        variants = (args.variant,)
    n = getattr(args, fam.samples) or fam.size(args.quick, "samples")
    epochs = args.epochs or fam.size(args.quick, "epochs")
    repeat = args.repeat or fam.size(args.quick, "repeat")
    warmup = args.warmup if args.warmup is not None else fam.size(args.quick, "warmup")
    info = machine(args.threads)
    runs = {}
    with workdir_of(args) as wd:
        for variant in variants:
            runs[variant] = measure(name, fam, fam.config(args.quick, variant), variant, wd, n, epochs, repeat,
                                    warmup, not args.quick, args.threads)
    top = (fam.variants or (None,))[0]
    result = {"benchmark": fam.benchmark, **({"variants": list(variants)} if fam.variants else {}),
              **runs.get(top, {}), **{v: r for v, r in runs.items() if v != top}, "machine": info}
    update_doc(resolve_doc(args), fam.benchmark, render(fam, runs, info))
    for r in runs.values():
        print(summary_line(fam, r), file=sys.stderr)
    emit(result)
    return result


def parser():
    variants = {v for fam in FAMILIES.values() for v in fam.variants}
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--family", required=True,
                   help=f"{', '.join(FAMILIES)}; several, comma-separated; or all (one after another)")
    p.add_argument("--variant", choices=sorted(variants) + ["both"], default=None,
                   help="one variant of a family that has them (" + "; ".join(
                       f"{n}: {'|'.join(f.variants)}" for n, f in FAMILIES.items() if f.variants)
                   + "); default both")
    p.add_argument("--images", type=int, default=None, help="images per epoch (image families)")
    p.add_argument("--clips", type=int, default=None, help="clips per epoch (video families)")
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--repeat", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None, help="step intervals left out of the step time")
    return p


def main(argv=None) -> dict:
    """The record of the one family asked for; {family: record} for several."""
    p = parser()
    args = p.parse_args(argv)
    names = list(FAMILIES) if args.family == "all" else args.family.split(",")
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        p.error(f"unknown family {', '.join(unknown)} (known: {', '.join(FAMILIES)}, all)")
    if args.variant not in (None, "both") and not any(args.variant in FAMILIES[n].variants for n in names):
        p.error(f"--variant {args.variant}: none of {', '.join(names)} has it")
    results = {n: bench(n, args) for n in names}
    return results[names[0]] if len(names) == 1 else results


# -- the family table ---------------------------------------------------------------------------------------------
# Each family's writer comes from the tests' support package (tests/support, put on the path by common.py).

def _images(wd: Path, cfg, n: int) -> Path:
    """`n` images at the configuration's resolution (shared by every image family of a workdir)."""
    metadata = wd / f"data-{cfg.resolution}-{n}" / "metadata.csv"
    if not metadata.is_file():
        write_images(metadata.parent, n, cfg.resolution)
    return metadata


def _files(paths: dict, components) -> dict:
    """{component: its file, or its shards}, from a support writer's {component: [files]}."""
    return {c: paths[c] if len(paths[c]) > 1 else paths[c][0] for c in components}


def _folders(repo: Path, components=(DIT, "text_encoder", "vae")) -> dict:
    return {c: str(next((repo / c).glob("*.safetensors"))) for c in components}


def _times(**timed) -> dict:
    """{key: the median seconds of fn()} for each key=fn: one encode each, fp32, no grad (median_seconds')."""
    return {key: median_seconds(fn) for key, fn in timed.items()}


# Qwen-Image: head width 128 and rope axes (16, 56, 56) as the real DiT, a text encoder with ~0.4x the DiT's
# parameters and the real MLP-to-width ratio, the smallest of the tiny VAEs (stage 1 as cheap as it can be: the
# conservative choice for split training); see common.proportional.
QWEN_TARGETS = {"peak_rss_ratio": 0.75, "total_time_ratio": 0.8, "cache_bytes_ratio": 1.02,
                "data_wait_share_stage2": 0.02}  # issue 6


def _qwen_image(wd: Path, cfg, n: int) -> Prepared:
    from difftune.families.qwen_image.components import LORA_TARGET_MODULES
    from support import tiny_qwen_image_paths

    ws = common.prepare(wd, cfg, n)
    return Prepared(ws.repo, ws.metadata, _files(tiny_qwen_image_paths(ws.repo), (DIT, "text_encoder", "vae")),
                    LORA_TARGET_MODULES)


def _qwen_image_extra(r: dict, cfg, runs: dict, work: Path) -> dict:
    """The cache's bytes, the loader's waits and the targets of issue 6."""
    one, s1, s2 = runs["one"], runs["stage1"], runs["stage2"]
    cb = cache_bytes(work / "cache")
    out = {"process_wall_ratio": ratio(s1["wall_seconds"] + s2["wall_seconds"], one["wall_seconds"]),
           "cache_bytes_per_sample": cb["disk_bytes"] / max(1, cb["samples"]),
           "cached_tensor_bytes_per_sample": cb["tensor_bytes"] / max(1, cb["samples"]),
           "cache_bytes_ratio": ratio(cb["disk_bytes"], cb["tensor_bytes"]),
           "data_wait_share_stage2": data_wait_share(s2, r["warmup_steps"]),
           "data_wait_share_one_stage": data_wait_share(one, r["warmup_steps"])}
    values = {**r, **out}
    out["targets"] = {k: {"target": f"<= {t}", "value": values[k], "met": values[k] <= t}
                      for k, t in QWEN_TARGETS.items()}
    return out


def _qwen_image_table(r: dict) -> str:
    """split_rows with issue 6's targets beside them, and the rows of the cache and the loader."""
    def checked(key, bound=None, shown="≤ {}"):
        bound = QWEN_TARGETS[key] if bound is None else bound
        return [shown.format(bound), verdict(r[key], bound)]

    total, projected, step, rss, above = split_rows(r, f"{r['images']} images", 50, "5x50")
    rows = [total + checked("total_time_ratio"),
            ["same, whole processes (interpreter start and imports included)", "", "", r["process_wall_ratio"], "—",
             "—"],
            projected + checked("projected_total_time_ratio_5x50", 0.8, "(≤ {})"), step + ["—", "—"],
            rss + checked("peak_rss_ratio"), above + checked("peak_rss_above_baseline_ratio", 0.75, "(≤ {})"),
            ["cache bytes on disk ÷ bytes of the cached tensors", "", f"{r['cache_bytes_per_sample']:.0f} B/sample",
             r["cache_bytes_ratio"], *checked("cache_bytes_ratio")],
            ["share of a step waiting for data", r["data_wait_share_one_stage"], r["data_wait_share_stage2"], "",
             *checked("data_wait_share_stage2", shown="≤ {} (stage 2)")]]
    return table(SPLIT_HEADER + ["target", "verdict"], rows)


# FLUX.1: head width 128 and rope axes (16, 56, 56) as FLUX.1's DiT, double:single blocks 1:2 as its 19:38; the T5
# encoder 0.39x the DiT's parameters (gated-GELU, 4 heads of 64), CLIP and the AE about 0.01x each. 256x256 gives
# 256 image tokens next to T5's 512 prompt tokens.
def _flux(wd: Path, cfg, n: int) -> Prepared:
    from difftune.families.flux.components import LORA_TARGET_MODULES
    from support import TinyFluxSpec, tiny_flux_paths, write_tiny_flux

    repo = reuse_or_write(wd / f"flux-{cfg.name}", cfg.spec,
                          lambda repo: write_tiny_flux(repo, TinyFluxSpec(**cfg.spec), shard=False))
    return Prepared(repo, _images(wd, cfg, n),
                    _files(tiny_flux_paths(repo), (DIT, "text_encoder", "text_encoder_2", "vae")), LORA_TARGET_MODULES)


# Wan2.1-T2V-1.3B: heads of 128 as Wan's DiT (3 of them; ffn 5.8x the width as its 8960 / 1536), UMT5 with heads of 64
# (d_ff 2.9x d_model against UMT5-XXL's 2.5x, to reach its 4.4x the DiT); 17 frames at 128x128 give 5 latent frames
# of 8x8 patches. VACE (Wan2.1-VACE-1.3B's LoRA run: the branch trained, a control clip and a reference image per
# row): 4 DiT blocks, the branch after blocks 0 and 2 (0.49x the DiT, as the real one's 15 of 30), UMT5 at 8 layers
# to stay 4.4x. A one-stage VACE step also VAE-encodes the control clip (twice: its inactive and reactive parts, as
# the reference and diffusers do, even without a mask) and the reference image; stage 2 reads that from the cache.
WAN_SPEC = dict(num_layers=3, num_attention_heads=3, attention_head_dim=128, ffn_dim=2240, text_dim=768,
                vae_base_dim=8, vae_res_blocks=2, vae_dim_mult=(1, 2, 4, 4), t5_layers=6, t5_heads=12, t5_d_kv=64,
                t5_d_ff=2240)
VACE_FLAGS = ("--data_file_keys", "video,vace_video,vace_reference_image",
              "--extra_inputs", "vace_video,vace_reference_image")  # the reference's Wan2.1-VACE-1.3B.sh


def _wan_proportional(variant: str) -> Config:
    if variant == "vace":
        return Config("proportional", {**WAN_SPEC, "num_layers": 4, "t5_layers": 8, "t5_d_ff": 2100,
                                       "vace_layers": (0, 2)}, resolution=128, num_frames=17)
    return Config("proportional", WAN_SPEC, resolution=128, num_frames=17)


def _wan_quick(variant: str) -> Config:  # VACE: the branch after the tiny DiT's first of 2 blocks
    return Config("quick", {"vace_layers": (0,)} if variant == "vace" else {}, resolution=32, lora_rank=4,
                  num_frames=5)


def _wan(wd: Path, cfg: Config, n: int) -> Prepared:
    from support import TinyWanSpec, tiny_wan_paths, write_example_video_dataset, write_tiny_wan

    spec = dict(cfg.spec)
    layers = tuple(spec.pop("vace_layers", ()))
    repo = wd / (f"wan-{cfg.name}-vace" if layers else f"wan-{cfg.name}")

    def write(repo):
        write_tiny_wan(repo, "t2v", TinyWanSpec(**spec))
        if layers:  # the released layout: the DiT (of transformer/'s config) and the branch in one file
            from support.wan.vace import vace_transformer, write_vace_file

            config = json.loads((repo / "transformer" / "config.json").read_text())
            configs = write_vace_file(repo / "vace", vace_transformer(config, layers, seed=20))
            (repo / "vace_configs.json").write_text(json.dumps(configs))

    reuse_or_write(repo, cfg.spec, write)
    data = wd / f"{'vace' if layers else 't2v'}-clips-{cfg.resolution}-{cfg.num_frames}-{n}"
    if not (data / "metadata.csv").is_file():
        from support.wan.variant_data import write_vace_dataset

        (write_vace_dataset if layers else write_example_video_dataset)(data, n, cfg.num_frames,
                                                                         (cfg.resolution, cfg.resolution))
    prep = Prepared(repo, data / "metadata.csv", _files(tiny_wan_paths(repo), (DIT, "text_encoder", "vae")),
                    "q,k,v,o,ffn.0,ffn.2", tokenizer=repo / "tokenizer", num_frames=cfg.num_frames)
    if layers:  # bare VACE files are recognised against known configs; the benchmark's sizes are no official one
        dit, vace = json.loads((repo / "vace_configs.json").read_text())
        prep.paths[DIT] = str(repo / "vace" / "diffusion_pytorch_model.safetensors")
        prep.lora_base, prep.extra_flags = "vace", VACE_FLAGS  # as the reference's LoRA scripts
        prep.counted = {c: f"{c}/*.safetensors" for c in (DIT, "text_encoder", "vae", "vace")}
        prep.nested = {"vace": DIT}  # the VACE file holds the DiT (transformer/'s config) and the branch
        prep.known = [["difftune.families.wan.vace", "VACE_DIT_ORIGINAL", "benchmark", dit],
                      ["difftune.families.wan.vace", "VACE_ORIGINAL", "benchmark", vace]]
    return prep


def _wan_encode(prep: Prepared, cfg: Config, threads: int) -> dict:
    """One VAE encode of a clip and one UMT5 encode of a 512-token prompt; for VACE also the VACE context of one row
    (the pipeline's unit: the control clip's two encodes and the reference image's)."""
    import torch
    from diffusers import AutoencoderKLWan
    from transformers import AutoTokenizer, UMT5EncoderModel

    torch.set_num_threads(threads)
    vae = AutoencoderKLWan.from_pretrained(prep.repo / "vae").eval()
    t5 = UMT5EncoderModel.from_pretrained(prep.repo / "text_encoder").eval()
    ids = AutoTokenizer.from_pretrained(prep.tokenizer)(["a red ball rolling across a blue background"],
                                                        padding="max_length", max_length=512, truncation=True,
                                                        return_tensors="pt")
    clip = torch.rand(1, 3, cfg.num_frames, cfg.resolution, cfg.resolution) * 2 - 1
    timed = {"vae_encode_s": lambda: vae.encode(clip).latent_dist.mode(),
             "umt5_encode_s": lambda: t5(ids.input_ids, attention_mask=ids.attention_mask)}
    if cfg.spec.get("vace_layers"):
        import csv

        from PIL import Image

        from difftune.core.units import run_unit
        from difftune.families.wan.pipeline import WanVideoPipeline
        from difftune.families.wan.vace import WanVaceEmbedder
        from difftune.media.video import read_video

        pipe = WanVideoPipeline(torch_dtype=torch.float32)
        pipe.vae = vae
        with prep.metadata.open() as f:
            row = next(csv.DictReader(f))
        data = prep.metadata.parent
        values = {"vace_video": read_video(data / row["vace_video"]), "vace_video_mask": None,
                  "vace_reference_image": Image.open(data / row["vace_reference_image"]).convert("RGB"),
                  "height": cfg.resolution, "width": cfg.resolution, "num_frames": cfg.num_frames, "batch_size": 1}
        timed["vace_context_s"] = lambda: run_unit(pipe, WanVaceEmbedder(), dict(values))
    return _times(**timed)


def _wan_extra(r: dict, cfg: Config, runs: dict, work: Path) -> dict:
    vae_s = r["vae_encode_s"] + r.get("vace_context_s", 0.0)  # every VAE call a one-stage step makes
    out = {"vae_share_of_cached_work": ratio(vae_s, vae_s + r["umt5_encode_s"])}
    if cfg.spec.get("vace_layers"):
        out["vace_layers"] = list(cfg.spec["vace_layers"])
    return out


def _wan_note(r: dict) -> str:
    return (f": the VAE is {100 * r['vae_share_of_cached_work']:.0f}% of the cached work (these apart timings and the "
            f"runs' steps were taken at different moments of a loaded machine, so their shares need not add up)")


# Z-Image-Turbo: heads of 128 and rope axes (32, 48, 48) as Z-Image's DiT (2 heads, 4 layers and 2 + 2 refiners
# against 30 heads, 30 layers and 2 + 2), Qwen3 with heads of 128 and its MLP at 3.3x the width (the real one's 3.8x)
# to reach 0.65x the DiT, the AE at about FLUX.1's 0.014x; 256x256 gives 256 image tokens.
def _z_image(wd: Path, cfg: Config, n: int) -> Prepared:
    from difftune.families.z_image.components import LORA_TARGET_MODULES
    from support import TinyZImageSpec, write_tiny_z_image_turbo

    repo = reuse_or_write(wd / f"z-image-{cfg.name}", cfg.spec,
                          lambda repo: write_tiny_z_image_turbo(repo, TinyZImageSpec(**cfg.spec), shard=False))
    return Prepared(repo, _images(wd, cfg, n), _folders(repo), LORA_TARGET_MODULES, tokenizer=repo / "tokenizer")


def _qwen3_encode(prep: Prepared, cfg: Config, threads: int, vae_class: str, chat: bool) -> dict:
    """One Qwen3 encode of a prompt padded to 512 tokens (all hidden states) and one VAE encode of an image."""
    import diffusers
    import torch
    from transformers import AutoTokenizer, Qwen3Model

    torch.set_num_threads(threads)
    vae = getattr(diffusers, vae_class).from_pretrained(prep.repo / "vae").eval()
    qwen = Qwen3Model.from_pretrained(prep.repo / "text_encoder").eval()
    tok = AutoTokenizer.from_pretrained(prep.tokenizer)
    text = (tok.apply_chat_template([{"role": "user", "content": PROMPTS[0]}], tokenize=False,
                                    add_generation_prompt=True, enable_thinking=False) if chat else
            f"<|im_start|>user\n{PROMPTS[0]}<|im_end|>\n<|im_start|>assistant\n")
    ids = tok([text], padding="max_length", max_length=512, truncation=True, return_tensors="pt")
    image = torch.rand(1, 3, cfg.resolution, cfg.resolution) * 2 - 1
    mask = ids.attention_mask if chat else ids.attention_mask.bool()
    return _times(vae_encode_s=lambda: vae.encode(image).latent_dist.mode(),
                          qwen3_encode_s=lambda: qwen(ids.input_ids, attention_mask=mask, output_hidden_states=True))


# FLUX.2-klein-4B: its depths (5 double, 20 single blocks) at 2 heads of 128 (its 24), Qwen3 at 27 layers (the deepest
# it reads) 256 wide with a 4x MLP to reach about the DiT's size, the autoencoder at 32 channels (about 0.02x);
# 256x256 gives 256 image tokens beside the prompt's 512.
def _flux2(wd: Path, cfg: Config, n: int) -> Prepared:
    from difftune.families.flux2.components import LORA_TARGET_MODULES
    from support.flux2 import TinyFlux2Spec, write_tiny_klein

    repo = reuse_or_write(wd / f"flux2-klein-{cfg.name}", cfg.spec,
                          lambda repo: write_tiny_klein(repo, "4B", TinyFlux2Spec(**cfg.spec), shard=False))
    return Prepared(repo, _images(wd, cfg, n), _folders(repo), LORA_TARGET_MODULES, tokenizer=repo / "tokenizer")


# Krea-2-Raw: heads of 128 with 4:1 grouped queries and the MLP at 2.67x as Krea-2's DiT (4 heads, 4 layers against 48
# and 28); Qwen3-VL with its 36 layers (the DiT reads states up to the 35th) at a width that makes it 0.33x the DiT,
# its MLP at 3.8x as the 4B's; the Qwen-Image VAE at about the real 0.01x; 256x256 gives 256 image tokens.
KREA2_FILES = {DIT: "krea/Krea-2-Raw/raw.safetensors", "text_encoder": "Qwen/Qwen3-VL-4B-Instruct/model.safetensors",
               "vae": "Qwen/Qwen-Image/vae/diffusion_pytorch_model.safetensors"}


def _krea2(wd: Path, cfg: Config, n: int) -> Prepared:
    from difftune.families.krea2.components import LORA_TARGET_MODULES
    from support.krea2.tiny import KREA2_TEXT_SPEC, TinyKrea2Spec, write_tiny_krea2_hub
    from support.qwen_parts import TinyQwen3VLSpec

    spec = cfg.spec
    text = TinyQwen3VLSpec(**spec["text"]) if spec.get("text") else KREA2_TEXT_SPEC
    repo = reuse_or_write(wd / f"krea2-{cfg.name}", spec, lambda repo: write_tiny_krea2_hub(
        repo, TinyKrea2Spec(**spec.get("dit", {})), text, spec.get("vae_base_dim", 8), turbo=False))
    return Prepared(repo, _images(wd, cfg, n), {c: str(repo / f) for c, f in KREA2_FILES.items()}, LORA_TARGET_MODULES,
                    tokenizer=repo / "Qwen" / "Qwen3-VL-4B-Instruct", counted=KREA2_FILES)


def _krea2_encode(prep: Prepared, cfg: Config, threads: int) -> dict:
    """One Qwen3-VL prompt encode (the family's own: the 12 tapped states of the 546-token sequence diffusers and the
    reference encode) and one VAE encode of an image."""
    import torch

    from difftune.families.krea2.prompt import text_hidden_states
    from support.krea2.tiny import load_tiny_krea2

    torch.set_num_threads(threads)
    pipe = load_tiny_krea2(prep.repo)
    image = torch.rand(1, 3, 1, cfg.resolution, cfg.resolution) * 2 - 1
    return _times(vae_encode_s=lambda: pipe.vae.encode(image).latent_dist.mode(),
                          qwen3_vl_encode_s=lambda: text_hidden_states(pipe, ["a photo of a cat on a sofa"]))


# ERNIE-Image: heads of 128 and RoPE axes (32, 48, 48) as its DiT (2 heads and 4 layers against 32 and 36, the MLP at
# 3x the width as there), Ministral-3 with heads of 128, one KV head per two and its MLP at 3.25x the width (a little
# above 9216 / 3072, for the embedding the byte vocabulary lacks) to reach 0.42x the DiT, the AE at about FLUX.2's
# 0.01x; 256x256 gives 256 image tokens.
def _ernie_image(wd: Path, cfg: Config, n: int) -> Prepared:
    from difftune.families.ernie_image.components import LORA_TARGET_MODULES
    from support.ernie_image import TinyErnieImageSpec, write_tiny_ernie_image

    repo = reuse_or_write(wd / f"ernie-image-{cfg.name}", cfg.spec,
                          lambda repo: write_tiny_ernie_image(repo, TinyErnieImageSpec(**cfg.spec), shard=False))
    return Prepared(repo, _images(wd, cfg, n), _folders(repo), LORA_TARGET_MODULES, tokenizer=repo / "tokenizer")


def _ernie_image_encode(prep: Prepared, cfg: Config, threads: int) -> dict:
    """One Ministral-3 encode of a prompt (its own tokens, unpadded, as diffusers and the reference encode it) and one
    AE encode of an image."""
    import torch
    from diffusers import AutoencoderKLFlux2
    from transformers import AutoTokenizer

    from difftune.families.ernie_image.pipeline import ErnieImagePipeline
    from difftune.models import ModelConfig

    torch.set_num_threads(threads)
    vae = AutoencoderKLFlux2.from_pretrained(prep.repo / "vae").eval()
    pipe = ErnieImagePipeline.from_pretrained(torch_dtype=torch.float32, model_configs=[
        ModelConfig(prep.paths["text_encoder"])], tokenizer_config=ModelConfig(str(prep.tokenizer)))
    ids = torch.tensor([AutoTokenizer.from_pretrained(prep.tokenizer)(PROMPTS[0])["input_ids"]])
    image = torch.rand(1, 3, cfg.resolution, cfg.resolution) * 2 - 1
    return _times(vae_encode_s=lambda: vae.encode(image).latent_dist.mode(),
                          text_encode_s=lambda: pipe.text_encoder(input_ids=ids, output_hidden_states=True))


# Ideogram-4 (the unconditional DiT is not loaded for training): the DiT at width 256 (2 heads of 128, 4 blocks, its
# MLP 2.67x the width as the real one's), Qwen3-VL with its 36 layers at width 64 and an MLP of 400 to reach about
# 0.88x the DiT, the FLUX.2 AE at a width of 8; 256x256 gives 256 image tokens.
IDEOGRAM4_REPO = "DiffSynth-Studio/ideogram-4-bf16-repackage"


def _ideogram4(wd: Path, cfg: Config, n: int) -> Prepared:
    from difftune.families.ideogram4.components import REFERENCE_LORA_TARGETS
    from support.ideogram4 import TinyIdeogram4Spec, write_tiny_ideogram4_hub

    hub = reuse_or_write(wd / f"ideogram4-{cfg.name}", cfg.spec, lambda hub: write_tiny_ideogram4_hub(
        hub, TinyIdeogram4Spec(**cfg.spec), tokenizer_beside=True))
    repo = hub / IDEOGRAM4_REPO
    return Prepared(repo, _images(wd, cfg, n), _folders(repo), REFERENCE_LORA_TARGETS, tokenizer=repo / "tokenizer")


def _ideogram4_encode(prep: Prepared, cfg: Config, threads: int) -> dict:
    """One prompt's Qwen3-VL features (all 36 layers, 13 of them read) and one AE encode of an image."""
    import torch

    from difftune.families.ideogram4.pipeline import Ideogram4Pipeline
    from difftune.families.ideogram4.units import text_features, vae_encode
    from difftune.models import ModelConfig

    torch.set_num_threads(threads)
    pipe = Ideogram4Pipeline.from_pretrained(
        torch_dtype=torch.float32, model_configs=[ModelConfig(prep.paths[c]) for c in prep.stage1],
        tokenizer_config=ModelConfig(str(prep.tokenizer)))
    image = torch.rand(1, 3, cfg.resolution, cfg.resolution) * 2 - 1
    return _times(vae_encode_s=lambda: vae_encode(pipe, image),
                          text_encode_s=lambda: text_features(pipe, PROMPTS[0]))


# ACE-Step 1.5 turbo (text-to-music): the release's widths 2048 (DiT) : 2048 (condition encoder) : 1024 (Qwen3) at
# 256 : 256 : 128, heads of 128 with one KV head per two and the MLPs at 3x the width, as there; the DiT's 24 layers at
# 4, the condition encoder's 8 lyric + 4 timbre layers at 1 + 1 (its MLP at 3.75x to reach the real 0.39x the DiT)
# and Qwen3's 28 at 8 (0.39x as the real one: at an eighth of the width its tiny embedding adds little). Latent
# channels 8, not the release's 64: the Oobleck encoder's width is twice the latent channels at its full-rate (48 kHz)
# layers, so 64 channels would be the release's own 128-wide encoder, seconds per clip on this CPU; at 8 it is 16 wide
# (multiples 1, 2, 2, 4, 4 for about the real 0.1x the DiT) at the release's strides. 6 s clips (150 latent frames,
# 75 DiT tokens) against the 750 frames of silence latent the timbre encoder always reads. In the release's layout:
# the DiT and the condition encoder in one file (stage 1 loads it for the condition encoder, stage 2 for the DiT);
# the VAE's latent is half its `encoder_hidden_size` wide, which must be 2 x `channels`.
ACE_STEP_FILES = {DIT: "acestep-v15-turbo/model.safetensors", "conditioner": "acestep-v15-turbo/model.safetensors",
                  "text_encoder": "Qwen3-Embedding-0.6B/model.safetensors",
                  "vae": "vae/diffusion_pytorch_model.safetensors"}
ACE_STEP_KEYS = {DIT: ("decoder.",), "conditioner": ("encoder.", "null_condition_emb")}  # the rest: the FSQ tokenizer
ACE_STEP_SPEC = dict(
    dit=dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=2,
             num_key_value_heads=1, head_dim=128),
    conditioner=dict(hidden_size=256, intermediate_size=960, num_lyric_encoder_hidden_layers=1,
                     num_timbre_encoder_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=128),
    text=dict(hidden_size=128, intermediate_size=384, num_hidden_layers=8, num_attention_heads=2,
              num_key_value_heads=1, head_dim=128),
    vae=dict(encoder_hidden_size=16, channel_multiples=[1, 2, 2, 4, 4], decoder_channels=12), channels=8)


def _write_ace_step(hub: Path, spec: dict) -> Path:
    """The release's layout under `hub` at `spec`'s sizes (the tests' tiny writer for an empty spec)."""
    from support.ace_step.tiny import REPO, write_tiny_ace_step_hub

    if not spec:
        return write_tiny_ace_step_hub(hub)
    import torch
    from diffusers import AceStepTransformer1DModel, AutoencoderOobleck
    from diffusers.pipelines.ace_step.modeling_ace_step import AceStepConditionEncoder
    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3Model

    from difftune.families.ace_step.components import (ACE_STEP_VAE_CONFIG, SAMPLE_RATE, original_conditioner_keys,
                                                       original_dit_keys)
    from support.z_image.tiny import z_image_tokenizer

    c, repo = spec["channels"], hub / REPO
    dit_file = repo / ACE_STEP_FILES[DIT]
    torch.manual_seed(0)
    dit = AceStepTransformer1DModel(**spec["dit"], in_channels=3 * c, audio_acoustic_hidden_dim=c, patch_size=2,
                                    encoder_hidden_size=spec["conditioner"]["hidden_size"])
    cond = AceStepConditionEncoder(**spec["conditioner"], text_hidden_dim=spec["text"]["hidden_size"],
                                   timbre_hidden_dim=c)
    tokenizer = z_image_tokenizer()
    text = Qwen3Model(Qwen3Config(vocab_size=len(tokenizer), **spec["text"]))
    vae = AutoencoderOobleck(**{**{k: v for k, v in ACE_STEP_VAE_CONFIG.items() if not k.startswith("_")},
                                **spec["vae"], "decoder_input_channels": c, "sampling_rate": SAMPLE_RATE})
    state = {**original_dit_keys(dit.state_dict()), **original_conditioner_keys(cond.state_dict()),
             "tokenizer.quantizer.project_in.weight": torch.randn(4, c),
             "detokenizer.proj_out.weight": torch.randn(c, 4)}
    dit_file.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(dit_file))
    dit_file.with_name("config.json").write_text(json.dumps(
        {"architectures": ["AceStepConditionGenerationModel"], "model_type": "acestep",
         "hidden_size": spec["dit"]["hidden_size"]}))
    torch.save(torch.randn(1, c, 800) * 0.1, dit_file.with_name("silence_latent.pt"))
    text.save_pretrained(repo / "Qwen3-Embedding-0.6B")
    tokenizer.save_pretrained(repo / "Qwen3-Embedding-0.6B")
    vae.save_pretrained(repo / "vae")
    return repo


def _ace_step(wd: Path, cfg: Config, n: int) -> Prepared:
    """The model, and `n` 48 kHz stereo clips of `cfg.seconds` (their whole seconds train) with prompts and lyrics."""
    from difftune.families.ace_step.components import LORA_TARGET_MODULES
    from support.ace_step.tiny import REPO, write_ace_step_dataset

    hub = reuse_or_write(wd / f"ace-step-{cfg.name}", cfg.spec, lambda hub: _write_ace_step(hub, cfg.spec))
    repo = hub / REPO
    data = wd / f"ace-step-clips-{cfg.seconds:g}-{n}"
    if not (data / "metadata.json").is_file():
        write_ace_step_dataset(data, n, seconds=cfg.seconds + 0.3)  # cut to its whole seconds, as the reference
    return Prepared(repo, data / "metadata.json", {c: str(repo / f) for c, f in ACE_STEP_FILES.items()},
                    LORA_TARGET_MODULES, tokenizer=repo / "Qwen3-Embedding-0.6B", counted=ACE_STEP_FILES,
                    keys=ACE_STEP_KEYS, extra_flags=("--data_file_keys", "audio"))


# LTX-2.0 19B (text to video with its sound): the release's head widths (video 128, audio 64: recognition reads the
# head counts off the widths), its 32 video + 32 audio heads at 4 + 4 (widths 512 and 256 against 4096 and 2048) and
# its 48 blocks at 3. The text connectors run at Gemma's width (their heads are 128 wide and the projection in front
# takes Gemma's 49 stacked hidden states), so Gemma is 128 wide, which makes that projection alone 0.8M: the DiT is
# sized for the connectors to come near the real 0.076x. Gemma-3 keeps its 48 layers (the connectors' 49 inputs) at
# width 128 (4 heads of 64, 2 KV heads, MLP 544: 0.62x the DiT as the real language model), its SigLIP tower (loaded,
# never run on text) at 2 layers of 128; the byte tokenizer's 353 tokens stand in for the 262k vocabulary (a 1.0B
# embedding of the real 11.8B). The video VAE encoder has the release's blocks and 32x / 8x compression, its widths
# 2, 4, 8 and 16x the latent channels as there, at 6 latent channels (the release's 128: widths 12..96 against
# 256..2048) with 2 layers a block and 1 in the middle (the release: 4, 6, 6, 2 and 2). The audio VAE's
# width is tied to its latent channels (its statistics normalise the packed channels x 16 mel bins): at 1 latent
# channel (the release's 8) its encoder is still 16 wide, about 9x the release's share. The decoders and the vocoder
# (in the Repackage layout, not used to train) are small. Clips of 9 frames at 256x256 with sound: 2 latent frames of
# 8x8 video tokens and 9 sound tokens; the prompt is padded to 1024 tokens for Gemma, as the reference pads it.
LTX2_REPACKAGE, LTX2_GEMMA = "DiffSynth-Studio/LTX-2-Repackage", "google/gemma-3-12b-it-qat-q4_0-unquantized"
LTX2_FILES = {DIT: "transformer.safetensors", "text_encoder_post_modules": "text_encoder_post_modules.safetensors",
              "video_vae_encoder": "video_vae_encoder.safetensors",
              "audio_vae_encoder": "audio_vae_encoder.safetensors"}
LTX2_SPEC = dict(
    dit=dict(num_attention_heads=4, audio_num_attention_heads=4, num_layers=3),
    gemma=dict(hidden_size=128, intermediate_size=544, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
               query_pre_attn_scalar=64),
    vision=dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2),
    video_vae=dict(latent_channels=6, block_out_channels=[12, 24, 48, 96], layers_per_block=[2, 2, 2, 2, 1],
                   decoder_block_out_channels=[12, 24, 48]),
    audio_channels=1)


def _write_ltx2(hub: Path, spec: dict) -> None:
    """DiffSynth-Studio/LTX-2-Repackage's seven files and the Gemma-3 folder (google/gemma-3-12b-it-qat-q4_0-
    unquantized: two shards with their index, config.json, the tokenizer) under `hub` at `spec`'s sizes (the tests'
    tiny LTX-2.0 for an empty spec)."""
    from support.ltx2.tiny import write_tiny_gemma3, write_tiny_ltx2_repackage

    if not spec:
        write_tiny_ltx2_repackage(hub / LTX2_REPACKAGE, "2")
        write_tiny_gemma3(hub / LTX2_GEMMA)
        return
    import torch
    from safetensors.torch import save_file
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from difftune.families.ltx2 import names as N
    from support.ltx2.tiny import (GEMMA3_SHARDS, gemma3_hub_names, gemma3_tokenizer, ltx2_classes, tiny_configs,
                                   tiny_gemma3_config)

    d, gemma, vae, audio = spec["dit"], spec["gemma"], spec["video_vae"], spec["audio_channels"]
    width, audio_width = d["num_attention_heads"] * 128, d["audio_num_attention_heads"] * 64  # 2.0's head widths
    configs = tiny_configs("2")
    configs["dit"].update(d, attention_head_dim=128, cross_attention_dim=width, audio_attention_head_dim=64,
                          audio_cross_attention_dim=audio_width, caption_channels=gemma["hidden_size"],
                          in_channels=vae["latent_channels"], out_channels=vae["latent_channels"],
                          audio_in_channels=16 * audio, audio_out_channels=16 * audio)
    configs["connectors"].update(
        caption_channels=gemma["hidden_size"], video_connector_num_attention_heads=gemma["hidden_size"] // 128,
        audio_connector_num_attention_heads=gemma["hidden_size"] // 128,
        video_connector_num_learnable_registers=128, audio_connector_num_learnable_registers=128)
    configs["video_vae"].update(vae)
    configs["audio_vae"].update(latent_channels=audio, base_channels=16 * audio)
    classes, parts = ltx2_classes("2"), {}
    for i, (part, cls) in enumerate(classes.items()):
        torch.manual_seed(i)
        parts[part] = {k: v.detach().contiguous() for k, v in cls(**configs[part]).state_dict().items()}
    for name, state in N.split_single_file(N.diffusers_to_single_file(parts)).items():
        (hub / LTX2_REPACKAGE).mkdir(parents=True, exist_ok=True)
        save_file(state, str(hub / LTX2_REPACKAGE / name), metadata={"format": "pt"})
    folder, tok = hub / LTX2_GEMMA, gemma3_tokenizer()
    config = tiny_gemma3_config(len(tok))
    config["text_config"].update(gemma)
    config["vision_config"].update(spec.get("vision", {}))
    torch.manual_seed(10)
    model = Gemma3ForConditionalGeneration(Gemma3Config.from_dict(config))
    state = gemma3_hub_names({k: v.detach().contiguous() for k, v in model.state_dict().items()})
    folder.mkdir(parents=True, exist_ok=True)
    shards = ({k: v for k, v in state.items() if k.startswith("language_model.")},
              {k: v for k, v in state.items() if not k.startswith("language_model.")})
    weight_map = {}
    for name, shard in zip(GEMMA3_SHARDS, shards):  # the language model first, the vision tower and projector next
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(v.numel() * v.element_size() for v in state.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tok.save_pretrained(str(folder))
    (folder / "special_tokens_map.json").write_text(json.dumps(  # as write_tiny_gemma3's (the hub folder's)
        {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
         "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"},
        indent=2))


def _ltx2_clips(root: Path, n: int, frames: int, size: int) -> Path:
    """`n` clips (a moving circle, 24 fps) with a stereo tone each as their sound track (a little longer than the
    clip: the family cuts it to the clip's length) and metadata.csv (video,input_audio,prompt), as the reference's
    LTX-2-T2AV example data."""
    from support.audio import tone, write_clip_with_audio
    from support.video import moving_circle_frames

    root.mkdir(parents=True, exist_ok=True)
    lines = ["video,input_audio,prompt"]
    for i in range(n):
        picture = moving_circle_frames(frames, (size, size), color=(220, (40 + 50 * i) % 256, 40),
                                       background=(40, 60, 220))
        wave = tone((300.0 * (i + 1), 450.0 * (i + 1)), seconds=frames / 24 + 0.1, rate=16000)
        write_clip_with_audio(root / f"clip{i}.mp4", picture, wave, fps=24)
        lines.append(f"clip{i}.mp4,clip{i}.mp4,{PROMPTS[i % len(PROMPTS)]} with a tone of {300 * (i + 1)} hertz")
    (root / "metadata.csv").write_text("\n".join(lines) + "\n")
    return root / "metadata.csv"


def _ltx2(wd: Path, cfg: Config, n: int) -> Prepared:
    """The model in the release's layout (the reference's LTX-2-T2AV-splited.sh loads these five) and `n` clips."""
    from difftune.families.ltx2.components import LORA_TARGET_MODULES
    from support.ltx2.tiny import GEMMA3_SHARDS

    hub = reuse_or_write(wd / f"ltx2-{cfg.name}", cfg.spec, lambda hub: _write_ltx2(hub, cfg.spec))
    metadata = wd / f"ltx2-clips-{cfg.resolution}-{cfg.num_frames}-{n}" / "metadata.csv"
    if not metadata.is_file():
        _ltx2_clips(metadata.parent, n, cfg.num_frames, cfg.resolution)
    counted = {c: f"{LTX2_REPACKAGE}/{f}" for c, f in LTX2_FILES.items()}
    counted["text_encoder"] = f"{LTX2_GEMMA}/model-*.safetensors"
    paths = {c: str(hub / f) for c, f in counted.items() if c != "text_encoder"}
    paths["text_encoder"] = tuple(str(hub / LTX2_GEMMA / s) for s in GEMMA3_SHARDS)  # one model in two shards
    # the reference's LTX2-T2AV flags: the clip and its own sound track, at the default --frame_rate 24
    return Prepared(hub, metadata, paths, LORA_TARGET_MODULES, tokenizer=hub / LTX2_GEMMA, counted=counted,
                    num_frames=cfg.num_frames,
                    extra_flags=("--data_file_keys", "video,input_audio", "--extra_inputs", "input_audio"))


def _ltx2_encode(prep: Prepared, cfg: Config, threads: int) -> dict:
    """One prompt through Gemma-3 (1024 tokens, all 49 hidden states) and the text connectors, one video VAE encode
    of a clip and one audio VAE encode of its sound (16 kHz stereo, the clip's length)."""
    import torch

    from difftune.core.units import run_unit
    from difftune.families.ltx2.pipeline import LTX2Pipeline
    from difftune.families.ltx2.units import LTX2PromptEmbedder, encode_audio, encode_video
    from difftune.models import ModelConfig

    torch.set_num_threads(threads)
    pipe = LTX2Pipeline.from_pretrained(
        torch_dtype=torch.float32, model_configs=[ModelConfig(list(p) if isinstance(p, tuple) else p)
                                                  for c, p in prep.paths.items() if c != DIT],
        tokenizer_config=ModelConfig(str(prep.tokenizer)))
    clip = torch.rand(1, 3, cfg.num_frames, cfg.resolution, cfg.resolution) * 2 - 1
    wave = torch.rand(1, 2, int(cfg.num_frames / 24 * 16000)) * 0.2 - 0.1
    return _times(text_encode_s=lambda: run_unit(pipe, LTX2PromptEmbedder(), {"prompt": PROMPTS[0]}),
                  vae_encode_s=lambda: encode_video(pipe, clip), audio_vae_encode_s=lambda: encode_audio(pipe, wave))


# Stable Diffusion 1.5 and SDXL (the UNet families; the UNet is the benchmark's DIT, stage 2's model): the releases'
# UNet layouts (SD 1.5: four levels of 2 ResNets, cross-attention in the first three, 8 heads; SDXL: three levels,
# 1 / 2 / 10 transformer layers, heads of 64 against 32 here, linear projections, text-time conditioning) at a tenth of
# the widths (32 .. 128 against 320 .. 1280); CLIP-L with its 12 layers at width 96 (MLP 320: 0.14x SD's UNet, 0.048x
# SDXL's as the real ones), bigG with its 32 layers at width 128 (MLP 560, projection 128: 0.26x the UNet), the KL-f8
# VAE's layout at widths 12 .. 48 (a tenth of 128 .. 512); only its encoder and quant_conv are stage 1's and counted.
# The byte tokenizer's 514 tokens stand in for CLIP's 49,408 (a 38M embedding of the real CLIP-L's 123M). Prompts are
# 77 tokens, as the family pads them; 256x256 gives a 32x32 latent (the releases': 64x64 at 512, 128x128 at 1024).
SD_FILES = {DIT: "unet/diffusion_pytorch_model.safetensors", "text_encoder": "text_encoder/model.safetensors",
            "vae": "vae/diffusion_pytorch_model.safetensors"}
SDXL_FILES = {DIT: "unet/diffusion_pytorch_model.safetensors", "text_encoder": "text_encoder/model.safetensors",
              "text_encoder_2": "text_encoder_2/model.safetensors", "vae": "vae/diffusion_pytorch_model.safetensors"}
SD_VAE_KEYS = {"vae": ("encoder.", "quant_conv.")}  # the VAE encoder: what stage 1 runs
CLIP_L_SPEC = dict(hidden_size=96, intermediate_size=320, num_hidden_layers=12, num_attention_heads=2)
SD_SPEC = dict(unet=dict(block_out_channels=[32, 64, 128, 128]), text=CLIP_L_SPEC, vae_width=12)
SDXL_SPEC = dict(unet=dict(block_out_channels=[32, 64, 128], attention_head_dim=[1, 2, 4], addition_time_embed_dim=32),
                 text=CLIP_L_SPEC, text_2=dict(hidden_size=128, intermediate_size=560, num_hidden_layers=32,
                                               num_attention_heads=2, projection_dim=128), vae_width=12)


def _write_sd(hub: Path, spec: dict, xl: bool) -> Path:
    """The release's diffusers folders (unet/, text_encoder/ (, text_encoder_2/), vae/, tokenizer/ (, tokenizer_2/),
    scheduler/) under `hub` at `spec`'s sizes (the tests' tiny model for an empty spec); returns the repo."""
    if xl:
        from support.stable_diffusion_xl.tiny import REPO, SCHEDULER_CONFIG, write_tiny_sdxl as write_tiny
    else:
        from support.stable_diffusion.tiny import REPO, SCHEDULER_CONFIG, write_tiny_sd as write_tiny
    repo = hub / REPO
    if not spec:
        return write_tiny(repo)
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from difftune.parts.clip import CLIP_BIGG_TEXT_CONFIG, CLIP_L_TEXT_CONFIG
    from difftune.parts.ldm import KL_F8_VAE_CONFIG, KL_F8_XL_VAE_CONFIG
    from support.tokenizers import clip_tokenizer

    def bare(config):
        return {k: v for k, v in config.items() if not k.startswith("_")}

    tok = clip_tokenizer()
    ids = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id)
    torch.manual_seed(2)
    texts = {"text_encoder": CLIPTextModel(CLIPTextConfig(**{**bare(CLIP_L_TEXT_CONFIG), **ids, **spec["text"]}))}
    width = spec["text"]["hidden_size"]
    if xl:
        from difftune.families.stable_diffusion_xl.components import SDXL_UNET_CONFIG as unet_config

        two = {**bare(CLIP_BIGG_TEXT_CONFIG), **ids, **spec["text_2"]}
        torch.manual_seed(3)
        texts["text_encoder_2"] = CLIPTextModelWithProjection(CLIPTextConfig(**two))
        extra = dict(cross_attention_dim=width + two["hidden_size"], projection_class_embeddings_input_dim=(
            6 * spec["unet"]["addition_time_embed_dim"] + two["projection_dim"]))
    else:
        from difftune.families.stable_diffusion.components import SD15_UNET_CONFIG as unet_config

        extra = dict(cross_attention_dim=width)
    torch.manual_seed(0)
    UNet2DConditionModel(**{**bare(unet_config), **spec["unet"], **extra}).save_pretrained(repo / "unet")
    w = spec["vae_width"]
    torch.manual_seed(1)
    vae = {**bare(KL_F8_XL_VAE_CONFIG if xl else KL_F8_VAE_CONFIG), "block_out_channels": [w, 2 * w, 4 * w, 4 * w],
           "norm_num_groups": 4}
    AutoencoderKL(**vae).save_pretrained(repo / "vae")
    for name, model in texts.items():
        model.save_pretrained(repo / name)
    for name in ("tokenizer", "tokenizer_2") if xl else ("tokenizer",):
        tok.save_pretrained(repo / name)
    (repo / "scheduler").mkdir(parents=True, exist_ok=True)
    (repo / "scheduler" / "scheduler_config.json").write_text(json.dumps(SCHEDULER_CONFIG, indent=2))
    return repo


def _sd(wd: Path, cfg: Config, n: int, xl: bool = False) -> Prepared:
    from difftune.families.stable_diffusion.components import LORA_TARGET_MODULES

    from support.stable_diffusion.tiny import REPO as SD_REPO
    from support.stable_diffusion_xl.tiny import REPO as SDXL_REPO

    files = SDXL_FILES if xl else SD_FILES
    hub = reuse_or_write(wd / f"{'sdxl' if xl else 'sd'}-{cfg.name}", cfg.spec,
                         lambda hub: _write_sd(hub, cfg.spec, xl))
    repo = hub / (SDXL_REPO if xl else SD_REPO)
    return Prepared(repo, _images(wd, cfg, n), {c: str(repo / f) for c, f in files.items()}, LORA_TARGET_MODULES,
                    lora_base="unet", counted=files, keys=SD_VAE_KEYS,
                    # stage 1's CLIP-L and VAE alone fit FLUX.1's and both SD families' slots: the family is named
                    extra_flags=("--family", "stable_diffusion_xl" if xl else "stable_diffusion"))


def _sd_encode(prep: Prepared, cfg: Config, threads: int) -> dict:
    """One prompt through CLIP-L (and bigG; 77 tokens, their hidden states) and one VAE encode of an image (its
    posterior mean, as the family caches it)."""
    import torch
    from diffusers import AutoencoderKL
    from transformers import AutoTokenizer, CLIPTextModel, CLIPTextModelWithProjection

    torch.set_num_threads(threads)
    vae = AutoencoderKL.from_pretrained(prep.repo / "vae").eval()
    ids = AutoTokenizer.from_pretrained(prep.repo / "tokenizer")([PROMPTS[0]], padding="max_length", max_length=77,
                                                                  truncation=True, return_tensors="pt").input_ids
    image = torch.rand(1, 3, cfg.resolution, cfg.resolution) * 2 - 1
    one = CLIPTextModel.from_pretrained(prep.repo / "text_encoder").eval()
    timed = {"text_encode_s": lambda: one(ids, output_hidden_states=True)}
    if "text_encoder_2" in prep.paths:
        two = CLIPTextModelWithProjection.from_pretrained(prep.repo / "text_encoder_2").eval()
        timed["text_2_encode_s"] = lambda: two(ids, output_hidden_states=True)
    timed["vae_encode_s"] = lambda: vae.encode(image).latent_dist.mode()
    return _times(**timed)


def _variant_is(name: str, then: str, otherwise: str) -> Callable:
    return lambda r: then if r.get("variant") == name else otherwise


PROMPT = "one {} encode of a prompt"
IMAGE = "one {} encode of an image"
FAMILIES = {
    "qwen_image": Family(
        "split_vs_unsplit", "Qwen-Image", _qwen_image, lambda variant: common.proportional(),
        # the DiT, Qwen2.5-VL-7B, the Qwen-Image VAE
        real={DIT: 20.4e9, "text_encoder": 8.3e9, "vae": 0.1269e9}, release="Qwen-Image",
        parts={DIT: "DiT", "text_encoder": "text encoder", "vae": "VAE"},
        lora_on="the 12 reference target modules", quick=lambda variant: common.quick(),
        defaults={"samples": (2, 8), "epochs": (1, 2), "repeat": (3, 4)}, extra=_qwen_image_extra,
        table=_qwen_image_table),
    "flux": Family(
        "flux_split_vs_unsplit", "FLUX", _flux, lambda variant: Config("proportional", dict(
            num_layers=2, num_single_layers=4, num_attention_heads=2, attention_head_dim=128,
            axes_dims_rope=(16, 56, 56), clip_hidden=64, clip_layers=2, clip_intermediate=110, t5_hidden=256,
            t5_layers=4, t5_heads=4, t5_d_kv=64, t5_d_ff=820, vae_channels=12), resolution=256),
        # FLUX.1-dev: T5-XXL, CLIP-L, the AE, the DiT
        real={"text_encoder_2": 4.7e9, "text_encoder": 0.123e9, "vae": 0.084e9, DIT: 11.9e9}, release="FLUX.1-dev",
        parts={DIT: "DiT", "text_encoder_2": "T5", "text_encoder": "CLIP", "vae": "AE"},
        lora_on="FLUX's default targets", notes="T5 prompts padded to 512 tokens"),
    "wan": Family(
        "wan_split_vs_unsplit", "Wan", _wan, _wan_proportional, quick=_wan_quick,
        # Wan2.1-T2V-1.3B (the DiT of VACE-1.3B too), Wan2.1-VACE-1.3B's branch (vace.VACE_CONFIGS: 15 blocks)
        real={DIT: 1.3e9, "text_encoder": 5.7e9, "vae": 0.13e9, "vace": 0.735e9},
        release=_variant_is("vace", "Wan2.1-VACE-1.3B", "Wan2.1-T2V-1.3B"),
        parts={DIT: "DiT", "text_encoder": "UMT5", "vae": "VAE", "vace": "VACE branch"},
        lora_on=_variant_is("vace", "the branch's q,k,v,o,ffn.0,ffn.2", "the DiT's q,k,v,o,ffn.0,ffn.2"),
        notes=lambda r: "UMT5 prompts padded to 512 tokens" + (
            f"; the VACE branch after DiT blocks {r['vace_layers']}; rows with a control clip and a reference image"
            if "vace_layers" in r else ""),
        # the reference's Wan2.1-T2V-1.3B.sh and Wan2.1-VACE-1.3B.sh (LoRA) train --num_epochs 5 --dataset_repeat 100
        ref_repeat=100, samples="clips", defaults={"samples": (2, 2), "warmup": (1, 2)}, encode=_wan_encode,
        timings={"vae_encode_s": "one VAE encode of a clip",
                 "vace_context_s": "the VACE context of a row (the control clip's two encodes and the reference "
                                   "image's)",
                 "umt5_encode_s": "one UMT5 encode"},
        variants=("t2v", "vace"), extra=_wan_extra, note=_wan_note),
    "z_image": Family(
        "z_image_split_vs_unsplit", "Z-Image", _z_image, lambda variant: Config("proportional", dict(
            dim=256, n_heads=2, axes_dims=(32, 48, 48), n_layers=4, n_refiner_layers=2, text_hidden=384,
            text_layers=3, text_heads=3, text_head_dim=128, text_intermediate=1250, vae_channels=16), resolution=256),
        # the S3-DiT, Qwen3-4B (tied embeddings, loaded without an LM head), the FLUX.1 AE
        real={DIT: 6.15e9, "text_encoder": 4.02e9, "vae": 0.0838e9}, release="Z-Image-Turbo",
        parts={DIT: "DiT", "text_encoder": "Qwen3", "vae": "AE"}, lora_on="to_q,to_k,to_v,to_out.0,w1,w2,w3",
        notes="prompts padded to 512 tokens for Qwen3",
        encode=lambda prep, cfg, threads: _qwen3_encode(prep, cfg, threads, "AutoencoderKL", chat=False),
        timings={"qwen3_encode_s": PROMPT.format("Qwen3"), "vae_encode_s": IMAGE.format("AE")}),
    "flux2": Family(
        "flux2_split_vs_unsplit", "FLUX.2", _flux2, lambda variant: Config("proportional", dict(
            heads=2, head_dim=128, text_hidden=256, text_intermediate=1024, vae_channels=32), resolution=256),
        # the DiT (5 + 20 blocks, 3072 wide), Qwen3-4B loaded without its LM head, the FLUX.2 autoencoder
        real={DIT: 3.88e9, "text_encoder": 3.6e9, "vae": 0.084e9}, release="FLUX.2-klein-4B",
        parts={DIT: "DiT", "text_encoder": "Qwen3", "vae": "autoencoder"}, lora_on="the reference's targets",
        notes="prompts padded to 512 tokens (hidden states 9, 18, 27 read)",
        encode=lambda prep, cfg, threads: _qwen3_encode(prep, cfg, threads, "AutoencoderKLFlux2", chat=True),
        timings={"qwen3_encode_s": PROMPT.format("Qwen3"), "vae_encode_s": IMAGE.format("autoencoder")}),
    "krea2": Family(
        "krea2_split_vs_unsplit", "Krea-2", _krea2, lambda variant: Config("proportional", dict(
            dit=dict(hidden_heads=4, head_dim=128, kv_heads=1, layers=4, intermediate=1367, text_hidden=96,
                     text_heads=1, text_intermediate=259),
            text=dict(hidden=96, layers=36, heads=3, kv_heads=1, head_dim=32, intermediate=365, vision_hidden=32,
                      vision_depth=1),
            vae_base_dim=12), resolution=256),
        # Krea-2-Raw's DiT, Qwen3-VL-4B-Instruct loaded as Qwen3VLModel (no LM head), the Qwen-Image VAE
        real={DIT: 12.82e9, "text_encoder": 4.438e9, "vae": 0.1269e9}, release="Krea-2-Raw",
        parts={DIT: "DiT", "text_encoder": "Qwen3-VL", "vae": "VAE"}, lora_on="the reference's targets",
        notes="prompts encoded at 512 tokens, their real tokens kept", encode=_krea2_encode,
        timings={"qwen3_vl_encode_s": PROMPT.format("Qwen3-VL"), "vae_encode_s": IMAGE.format("VAE")}),
    "ernie_image": Family(
        "ernie_image_split_vs_unsplit", "ERNIE-Image", _ernie_image, lambda variant: Config("proportional", dict(
            hidden=256, heads=2, layers=4, ffn=768, text_hidden=256, text_layers=2, text_heads=2, text_head_dim=128,
            text_intermediate=832, vae_width=10), resolution=256),
        # the DiT (hidden 4096, 36 layers, MLP 12288), Ministral-3 3B's language model (26 layers of 3072, its
        # 131072-token embedding tied; the vision tower is not loaded), the FLUX.2 AE
        real={DIT: 7.97e9, "text_encoder": 3.43e9, "vae": 0.084e9}, release="ERNIE-Image's loaded language model",
        parts={DIT: "DiT", "text_encoder": "text encoder file", "vae": "AE"}, lora_on="to_q,to_k,to_v,to_out.0",
        notes="the text encoder's file holds its small vision tower, which is not loaded", encode=_ernie_image_encode,
        timings={"text_encode_s": PROMPT.format("Ministral-3"), "vae_encode_s": IMAGE.format("AE")}),
    "ideogram4": Family(
        "ideogram4_split_vs_unsplit", "Ideogram-4", _ideogram4, lambda variant: Config("proportional", dict(
            head_dim=128, heads=2, layers=4, intermediate=683, adaln_dim=32, text_hidden=64, text_head_dim=32,
            text_intermediate=400, vae_width=8), resolution=256),
        # the DiT (34 blocks of 4608, SwiGLU 12288, the 53248-wide text projection), Qwen3-VL-8B without its LM
        # head, the FLUX.2 AE
        real={DIT: 9.3e9, "text_encoder": 8.15e9, "vae": 0.084e9}, release="the release",
        parts={DIT: "DiT", "text_encoder": "Qwen3-VL", "vae": "AE"}, lora_on="the reference's targets",
        # the reference's lora/Ideogram-4-bf16-repackage.sh trains --num_epochs 5 --dataset_repeat 100
        ref_repeat=100, encode=_ideogram4_encode,
        timings={"text_encode_s": PROMPT.format("Qwen3-VL"), "vae_encode_s": IMAGE.format("AE")}),
    "ace_step": Family(
        "ace_step_split_vs_unsplit", "ACE-Step", _ace_step,
        lambda variant: Config("proportional", ACE_STEP_SPEC, resolution=0, seconds=6),
        # acestep-v15-turbo's DiT and condition encoder (one file), Qwen3-Embedding-0.6B, the Oobleck VAE: diffusers'
        # and transformers' classes at the release configs (components.py), counted on the meta device
        real={DIT: 1.5755e9, "conditioner": 0.6084e9, "text_encoder": 0.5958e9, "vae": 0.1687e9},
        release="ACE-Step v1.5 turbo",
        parts={DIT: "DiT", "conditioner": "condition encoder", "text_encoder": "Qwen3-Embedding", "vae": "VAE"},
        lora_on="the reference's targets (q,k,v,o,gate,up,down_proj)",
        notes="8 latent channels (the release's 64 would make the VAE its own 128-wide encoder); captions at most 256 "
              "tokens, lyrics through Qwen3's embedding table; the condition encoder (in the DiT's file) is stage 1's",
        quick=lambda variant: Config("quick", resolution=0, lora_rank=4, seconds=1),
        samples="clips", defaults={"samples": (2, 4)}),
    "ltx2": Family(
        "ltx2_split_vs_unsplit", "LTX-2", _ltx2,
        lambda variant: Config("proportional", LTX2_SPEC, resolution=256, num_frames=9),
        # LTX-2.0 19B: the DiT, Gemma-3-12B as the family loads it (Gemma3ForConditionalGeneration: the language
        # model 11.766B, its SigLIP tower 0.417B and the projector 0.004B; the LM head is tied to the embedding), the
        # text connectors, the two VAE encoders (the Repackage files: each with its latent statistics); diffusers'
        # and transformers' classes at the release configs (components.py's DIT_CONFIG, CONNECTORS_CONFIG,
        # VIDEO_VAE_CONFIG, AUDIO_VAE_CONFIG; Gemma3Config with the 12B's text sizes, hidden 3840, 48 layers, 16
        # heads / 8 KV heads of 256, MLP 15360, vocabulary 262208, and its vision tower, SigLIP So400m/14 at 896:
        # 1152 wide, 27 layers, MLP 4304, where Gemma3Config's default is a 768-wide, 12-layer SigLIP), counted on
        # the meta device
        real={DIT: 18.876e9, "text_encoder": 12.187e9, "text_encoder_post_modules": 1.4315e9,
              "video_vae_encoder": 0.6941e9, "audio_vae_encoder": 0.02133e9},
        release="LTX-2.0 19B",
        parts={DIT: "DiT", "text_encoder": "Gemma-3", "text_encoder_post_modules": "text connectors",
               "video_vae_encoder": "video VAE encoder", "audio_vae_encoder": "audio VAE encoder"},
        lora_on="the reference's targets (to_k,to_q,to_v,to_out.0)",
        notes="the release's head widths at 4 + 4 heads and 3 of its 48 blocks; Gemma 128 wide with its 48 layers "
              "and a 353-token vocabulary, prompts padded to 1024 tokens; 6 video and 1 audio latent channels (the "
              "release's 128 and 8); the audio VAE encoder about 9x its real share (its width is tied to the latent "
              "channels x 16 mel bins); clips with their sound at 24 fps: 128 video and 9 sound tokens against the "
              "6,144 + 126 of the reference's 768x512 clips of 121 frames, so the encodes are a far larger share of "
              "a one-stage step here than at the release's sizes",
        quick=lambda variant: Config("quick", resolution=64, lora_rank=4, num_frames=9),
        # the reference's LTX-2-T2AV-splited.sh trains stage 2 --num_epochs 5 --dataset_repeat 100
        ref_repeat=100, samples="clips", defaults={"samples": (2, 4), "warmup": (1, 2)}, encode=_ltx2_encode,
        timings={"text_encode_s": "one Gemma-3 and connectors encode of a prompt",
                 "vae_encode_s": "one video VAE encode of a clip",
                 "audio_vae_encode_s": "one audio VAE encode of its sound"}),
    "stable_diffusion": Family(
        "stable_diffusion_split_vs_unsplit", "SD 1.5", _sd,
        lambda variant: Config("proportional", SD_SPEC, resolution=256),
        # stable-diffusion-v1-5: the UNet (SD15_UNET_CONFIG), CLIP-L (parts/clip.py's CLIP_L_TEXT_CONFIG), the KL-f8
        # VAE's encoder and quant_conv (parts/ldm.py's KL_F8_VAE_CONFIG), counted on the meta device
        real={DIT: 859.52e6, "text_encoder": 123.06e6, "vae": 34.164e6}, release="SD 1.5",
        parts={DIT: "UNet", "text_encoder": "CLIP-L", "vae": "VAE encoder"},
        lora_on="the family's default targets (to_q,to_k,to_v,to_out.0,ff.net.0.proj,ff.net.2,proj_in,proj_out)",
        notes="prompts padded to 77 tokens; CLIP's 49,408-token vocabulary at the byte tokenizer's 514",
        quick=lambda variant: Config("quick", resolution=32, lora_rank=4), encode=_sd_encode,
        timings={"text_encode_s": PROMPT.format("CLIP-L"), "vae_encode_s": IMAGE.format("VAE")}),
    "stable_diffusion_xl": Family(
        "stable_diffusion_xl_split_vs_unsplit", "SDXL", lambda wd, cfg, n: _sd(wd, cfg, n, xl=True),
        lambda variant: Config("proportional", SDXL_SPEC, resolution=256),
        # stable-diffusion-xl-base-1.0: the UNet (SDXL_UNET_CONFIG), CLIP-L, OpenCLIP bigG with its projection
        # (CLIP_BIGG_TEXT_CONFIG), the VAE's encoder and quant_conv, counted on the meta device
        real={DIT: 2567.46e6, "text_encoder": 123.06e6, "text_encoder_2": 694.66e6, "vae": 34.164e6},
        release="SDXL base 1.0",
        parts={DIT: "UNet", "text_encoder": "CLIP-L", "text_encoder_2": "bigG", "vae": "VAE encoder"},
        lora_on="the family's default targets (to_q,to_k,to_v,to_out.0,ff.net.0.proj,ff.net.2,proj_in,proj_out)",
        notes="prompts padded to 77 tokens for both encoders; CLIP's 49,408-token vocabulary at the byte tokenizer's "
              "514",
        quick=lambda variant: Config("quick", resolution=32, lora_rank=4),
        # the reference's lora/stable-diffusion-xl-base-1.0.sh trains --num_epochs 5 --dataset_repeat 10
        ref_repeat=10, encode=_sd_encode,
        timings={"text_encode_s": PROMPT.format("CLIP-L"), "text_2_encode_s": PROMPT.format("bigG"),
                 "vae_encode_s": IMAGE.format("VAE")}),
}


if __name__ == "__main__":
    if "--child" in sys.argv:
        child_main(_child)
    else:
        main()
