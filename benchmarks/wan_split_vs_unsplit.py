"""Wan (video): split training against one-stage training on the same model, clips and flags, for T2V and VACE.

The Wan family at CPU scale with Wan2.1-T2V-1.3B's proportions (UMT5-XXL's encoder 4.4x the DiT's parameters,
the Wan2.1 VAE 0.1x: 5.7B and 0.13B against 1.3B; the VAE keeps Wan2.1's structure, two blocks per level at
widths x1, x2, x4, x4), three runs of the CLI path, one process each: `sft` (one stage), `sft:data_process`
(stage 1: UMT5, the VAE) and `sft:train` (stage 2: the DiT alone, from the cache). Also times, in this process,
one VAE encode of a clip and one UMT5 encode of a prompt, to give their share of a one-stage step.

The VACE variant is Wan2.1-VACE-1.3B's run (its LoRA script's flags: a LoRA on the VACE branch, a control clip
and a reference image per row), the branch after every second DiT block as the real one's 15 of 30. Its one-stage
step also VAE-encodes the control clip (twice: its inactive and reactive parts, as the reference and diffusers do,
even without a mask) and the reference image; stage 2 reads that VACE context from the cache. Timed apart here
too: the VACE context of one row. Prints one JSON line (T2V's figures at the top level, VACE's under "vace");
writes one section of docs/benchmarks.md with both.

    .venv/bin/python benchmarks/wan_split_vs_unsplit.py            # the proportional models (a few minutes here)
    .venv/bin/python benchmarks/wan_split_vs_unsplit.py --quick    # smoke run on the tests' tiny model
    .venv/bin/python benchmarks/wan_split_vs_unsplit.py --variant vace   # one of the two (the doc then holds it alone)
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (_measure_child, base_parser, child_command, child_main, emit, fresh, machine,  # noqa: E402
                    machine_line, median_seconds, param_counts, ratio, resolve_doc, reuse_or_write, run_child,
                    run_difftune, split_figures, split_rows, table, update_doc, workdir_of)

COMPONENTS = ("transformer", "text_encoder", "vae")
REAL = {"transformer": 1.3e9, "text_encoder": 5.7e9, "vae": 0.13e9,  # Wan2.1-T2V-1.3B, the DiT of VACE-1.3B
        "vace": 0.735e9}  # Wan2.1-VACE-1.3B's branch (vace.VACE_CONFIGS: 15 blocks)
VARIANTS = ("t2v", "vace")
VACE_FLAGS = ["--data_file_keys", "video,vace_video,vace_reference_image",
              "--extra_inputs", "vace_video,vace_reference_image"]  # the reference's Wan2.1-VACE-1.3B.sh


@dataclass
class WanBench:
    name: str
    spec: dict  # TinyWanSpec fields
    resolution: int
    num_frames: int
    lora_rank: int = 32
    vace_layers: tuple = ()  # VACE: the DiT blocks its branch's hints follow; empty for T2V

    @property
    def variant(self) -> str:
        return "vace" if self.vace_layers else "t2v"


def proportional(variant: str = "t2v") -> WanBench:
    """Heads of 128 as Wan's DiT (3 of them; ffn 5.8x the width as its 8960 / 1536), UMT5 with heads of 64 (d_ff 2.9x
    d_model against UMT5-XXL's 2.5x, to reach its 4.4x the DiT); 17 frames at 128x128 give 5 latent frames of 8x8
    patches. VACE: 4 DiT blocks, the branch after blocks 0 and 2 (0.49x the DiT), UMT5 at 8 layers to stay 4.4x."""
    spec = dict(num_layers=3, num_attention_heads=3, attention_head_dim=128, ffn_dim=2240, text_dim=768,
                vae_base_dim=8, vae_res_blocks=2, vae_dim_mult=(1, 2, 4, 4),
                t5_layers=6, t5_heads=12, t5_d_kv=64, t5_d_ff=2240)
    if variant == "vace":
        return WanBench("proportional", {**spec, "num_layers": 4, "t5_layers": 8, "t5_d_ff": 2100}, resolution=128,
                        num_frames=17, vace_layers=(0, 2))
    return WanBench("proportional", spec, resolution=128, num_frames=17)


def quick(variant: str = "t2v") -> WanBench:
    return WanBench("quick", {}, resolution=32, num_frames=5, lora_rank=4,
                    vace_layers=(0,) if variant == "vace" else ())  # the tiny DiT's 2 blocks


@dataclass
class Prepared:
    repo: Path
    metadata: Path
    paths: dict  # component -> its weight file
    known: list  # [module, spec, label, config]: what recognises a bare VACE file of this size (see run)


def prepare(workdir: Path, cfg: WanBench, n: int) -> Prepared:
    from support import TinyWanSpec, tiny_wan_paths, write_example_video_dataset, write_tiny_wan

    repo = workdir / f"wan-{cfg.name}" if not cfg.vace_layers else workdir / f"wan-{cfg.name}-vace"

    def write(repo):
        write_tiny_wan(repo, "t2v", TinyWanSpec(**cfg.spec))
        if cfg.vace_layers:  # the released layout: the DiT (of transformer/'s config) and the branch in one file
            from support.wan.vace import vace_transformer, write_vace_file

            config = json.loads((repo / "transformer" / "config.json").read_text())
            configs = write_vace_file(repo / "vace", vace_transformer(config, cfg.vace_layers, seed=20))
            (repo / "vace_configs.json").write_text(json.dumps(configs))

    settings = cfg.spec if not cfg.vace_layers else {**cfg.spec, "vace_layers": cfg.vace_layers}
    reuse_or_write(repo, settings, write)
    paths = {c: files[0] for c, files in tiny_wan_paths(repo).items()}
    known = []
    if cfg.vace_layers:
        paths["transformer"] = str(repo / "vace" / "diffusion_pytorch_model.safetensors")
        dit, vace = json.loads((repo / "vace_configs.json").read_text())
        known = [["difftune.families.wan.vace", "VACE_DIT_ORIGINAL", "benchmark", dit],
                 ["difftune.families.wan.vace", "VACE_ORIGINAL", "benchmark", vace]]
    data = workdir / f"{cfg.variant}-clips-{cfg.resolution}-{cfg.num_frames}-{n}"
    metadata = data / "metadata.csv"
    if not metadata.is_file():
        if cfg.vace_layers:
            from support.wan.variant_data import write_vace_dataset

            write_vace_dataset(data, n, cfg.num_frames, (cfg.resolution, cfg.resolution))
        else:
            write_example_video_dataset(data, n, cfg.num_frames, (cfg.resolution, cfg.resolution))
    return Prepared(repo, metadata, paths, known)


def flags(prep: Prepared, cfg, task, output, *, dataset=None, repeat=1, components=COMPONENTS) -> list:
    fresh(output)
    res = str(cfg.resolution)
    lora_on = "vace" if cfg.vace_layers else "dit"  # as the reference's LoRA scripts
    out = ["--task", task, "--output_path", str(output),
           "--model_paths", json.dumps([prep.paths[c] for c in components]),
           "--tokenizer_path", str(prep.repo / "tokenizer"), "--height", res, "--width", res,
           "--num_frames", str(cfg.num_frames), "--torch_dtype", "float32", "--learning_rate", "1e-4",
           "--num_epochs", "1", "--dataset_repeat", str(repeat), "--lora_base_model", lora_on,
           "--lora_target_modules", "q,k,v,o,ffn.0,ffn.2", "--lora_rank", str(cfg.lora_rank), "--seed", "0",
           "--no_progress", "--enable_tensorboard_log", "false"] + (VACE_FLAGS if cfg.vace_layers else [])
    if dataset is None:
        return out + ["--dataset_base_path", str(prep.metadata.parent), "--dataset_metadata_path", str(prep.metadata)]
    return out + ["--dataset_base_path", str(dataset)]


def register(known) -> None:
    """Bare VACE files are recognised against known configs (Wan's config.json beside them is passed over), and
    the benchmark's sizes are no official one: registered in the process that trains, as the tests register theirs."""
    import importlib

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


def encode_times(prep: Prepared, cfg: WanBench, threads: int, repeats: int = 3) -> dict:
    """Median seconds of one VAE encode of a clip and one UMT5 encode of a 512-token prompt, fp32, no grad —
    the stage-1 work a one-stage step repeats; for VACE also the VACE context of one row (the pipeline's unit:
    the control clip's two encodes and the reference image's)."""
    import torch
    from diffusers import AutoencoderKLWan
    from transformers import AutoTokenizer, UMT5EncoderModel

    torch.set_num_threads(threads)
    repo = prep.repo
    vae = AutoencoderKLWan.from_pretrained(repo / "vae").eval()
    t5 = UMT5EncoderModel.from_pretrained(repo / "text_encoder").eval()
    tok = AutoTokenizer.from_pretrained(repo / "tokenizer")
    clip = torch.rand(1, 3, cfg.num_frames, cfg.resolution, cfg.resolution) * 2 - 1
    ids = tok(["a red ball rolling across a blue background"], padding="max_length", max_length=512,
              truncation=True, return_tensors="pt")
    out = {"vae_encode_s": median_seconds(lambda: vae.encode(clip).latent_dist.mode(), repeats),
           "umt5_encode_s": median_seconds(lambda: t5(ids.input_ids, attention_mask=ids.attention_mask), repeats)}
    if cfg.vace_layers:
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
        out["vace_context_s"] = median_seconds(lambda: run_unit(pipe, WanVaceEmbedder(), dict(values)), repeats)
    return out


def measure(cfg: WanBench, wd: Path, n: int, repeat: int, warmup: int, isolated: bool, threads: int) -> dict:
    """One variant's three runs and apart timings: its figures."""
    prep = prepare(wd, cfg, n)
    params = param_counts(prep.repo, {c: f"{c}/*.safetensors" for c in COMPONENTS})
    if cfg.vace_layers:  # the VACE file holds the DiT (transformer/'s config) and the branch
        params["vace"] = param_counts(prep.repo, {"vace": "vace/*.safetensors"})["vace"] - params["transformer"]
    work = wd / cfg.variant
    one = run(flags(prep, cfg, "sft", work / "one", repeat=repeat), prep, isolated, threads)
    s1 = run(flags(prep, cfg, "sft:data_process", work / "cache", components=("text_encoder", "vae")), prep,
             isolated, threads)
    s2 = run(flags(prep, cfg, "sft:train", work / "two", dataset=work / "cache", repeat=repeat,
                   components=("transformer",)), prep, isolated, threads)
    enc = encode_times(prep, cfg, threads)
    # the reference's Wan2.1-T2V-1.3B.sh and Wan2.1-VACE-1.3B.sh (LoRA) train --num_epochs 5 --dataset_repeat 100
    figures = split_figures(one, s1, s2, warmup, ref_steps=n * 5 * 100, tag="5x100")
    t1 = figures["step_time_one_stage_s"]
    dit = params["transformer"]
    result = {
        "variant": cfg.variant, "config": cfg.name, "resolution": cfg.resolution, "num_frames": cfg.num_frames,
        "clips": n, "repeat": repeat, "steps": one["steps"], "warmup_steps": warmup, "lora_rank": cfg.lora_rank,
        "isolated_processes": isolated, "params": params, "params_over_dit": {k: v / dit for k, v in params.items()},
        "real_params_over_dit": {k: REAL[k] / REAL["transformer"] for k in params}, **figures, **enc,
        "vae_share_of_one_stage_step": ratio(enc["vae_encode_s"], t1),
        "umt5_share_of_one_stage_step": ratio(enc["umt5_encode_s"], t1),
        # what stage 2 no longer does, from the two runs' step times; and the VAE's part of it, from the apart timings
        "cached_share_of_one_stage_step": 1.0 - figures["step_time_stage2_s"] / t1,
    }
    vae_s = enc["vae_encode_s"] + enc.get("vace_context_s", 0.0)  # every VAE call a one-stage step makes
    result["vae_share_of_cached_work"] = ratio(vae_s, vae_s + enc["umt5_encode_s"])
    if cfg.vace_layers:
        result["vace_layers"] = list(cfg.vace_layers)
        result["vace_context_share_of_one_stage_step"] = ratio(enc["vace_context_s"], t1)
    return result


def main(argv=None) -> dict:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--variant", choices=("t2v", "vace", "both"), default="both")
    p.add_argument("--clips", type=int, default=None)
    p.add_argument("--repeat", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None, help="step intervals left out of the step time")
    args = p.parse_args(argv)
    variants = VARIANTS if args.variant == "both" else (args.variant,)
    n = args.clips or 2
    repeat = args.repeat or (2 if args.quick else 4)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    info = machine(args.threads)
    runs = {}
    with workdir_of(args) as wd:
        for variant in variants:
            cfg = quick(variant) if args.quick else proportional(variant)
            runs[variant] = measure(cfg, wd, n, repeat, warmup, not args.quick, args.threads)
    result = {"benchmark": "wan_split_vs_unsplit", "variants": list(variants), **runs.get("t2v", {}),
              **({"vace": runs["vace"]} if "vace" in runs else {}), "machine": info}
    update_doc(resolve_doc(args), "wan_split_vs_unsplit", render(runs, info))
    for variant, r in runs.items():
        print(f"Wan {variant} split / one stage: total time {r['total_time_ratio']:.3f} (projected to 5 epochs x "
              f"repeat 100: {r['projected_total_time_ratio_5x100']:.3f}), step time {r['step_time_ratio']:.3f}, "
              f"stage-2 peak RSS {r['peak_rss_ratio']:.3f} ({r['peak_rss_above_baseline_ratio']:.3f} above the "
              f"baseline); VAE encode {r['vae_share_of_one_stage_step']:.2f} of a one-stage step"
              + (f", VACE context {r['vace_context_share_of_one_stage_step']:.2f}" if variant == "vace" else ""),
              file=sys.stderr)
    emit(result)
    return result


NAMES = {"t2v": "T2V", "vace": "VACE"}


def render(runs: dict, info: dict) -> str:
    summary = table(
        ["variant", "step time ratio", "total time ratio", "projected (5 x 100)", "stage-2 peak RSS ratio",
         "stage-2 peak RSS above the baseline, ratio", "VAE encode of the clip ÷ one-stage step",
         "VACE context ÷ one-stage step"],
        [[NAMES[v], r["step_time_ratio"], r["total_time_ratio"], r["projected_total_time_ratio_5x100"],
          r["peak_rss_ratio"], r["peak_rss_above_baseline_ratio"], r["vae_share_of_one_stage_step"],
          r.get("vace_context_share_of_one_stage_step", "")] for v, r in runs.items()])
    parts = [summary]
    for variant, r in runs.items():
        parts += [head(r), table(["metric", "one stage", "split (stage 2)", "split ÷ one stage"],
                                 split_rows(r, f"{r['clips']} clips", ref_repeat=100, tag="5x100"))]
    return "\n\n".join(parts + [machine_line(info)])


def head(r: dict) -> str:
    p, q, real = r["params"], r["params_over_dit"], r["real_params_over_dit"]
    vace = r["variant"] == "vace"
    model = (f"Wan2.1-VACE-1.3B {real['text_encoder']:.2f}x" if vace else
             f"Wan2.1-T2V-1.3B {real['text_encoder']:.2f}x")
    branch = (f", VACE branch {p['vace'] / 1e6:.2f}M after DiT blocks {r['vace_layers']} ({q['vace']:.2f}x; real "
              f"{real['vace']:.2f}x); rows with a control clip and a reference image; LoRA rank {r['lora_rank']} on "
              f"the branch's" if vace else f"; LoRA rank {r['lora_rank']} on the DiT's")
    context = (f", the VACE context of a row (the control clip's two encodes and the reference image's) "
               f"{r['vace_context_s']:.3f} s ({100 * r['vace_context_share_of_one_stage_step']:.0f}%)" if vace else "")
    return (f"**{NAMES[r['variant']]}.** Config `{r['config']}`, {r['num_frames']}-frame clips at "
            f"{r['resolution']}x{r['resolution']}: DiT {p['transformer'] / 1e6:.2f}M, UMT5 "
            f"{p['text_encoder'] / 1e6:.2f}M ({q['text_encoder']:.2f}x the DiT; {model}), VAE {p['vae'] / 1e6:.3f}M "
            f"({q['vae']:.3f}x; real {real['vae']:.3f}x){branch} q,k,v,o,ffn.0,ffn.2; "
            f"fp32; UMT5 prompts padded to 512 tokens; stage 1 took {r['stage1_seconds']:.1f} s (model loading "
            f"included), peak RSS {r['peak_rss_stage1_mib']:.0f} MiB. The work stage 2 leaves out is "
            f"{100 * r['cached_share_of_one_stage_step']:.0f}% of a one-stage step (1 - the step-time ratio). "
            f"Timed apart in the benchmark's own process afterwards, one VAE encode of a clip takes "
            f"{r['vae_encode_s']:.3f} s ({100 * r['vae_share_of_one_stage_step']:.0f}% of a one-stage step){context} "
            f"and one UMT5 encode {r['umt5_encode_s']:.3f} s ({100 * r['umt5_share_of_one_stage_step']:.0f}%): the "
            f"VAE is {100 * r['vae_share_of_cached_work']:.0f}% of the cached work (these apart timings and the runs' "
            f"steps were taken at different moments of a loaded machine, so their shares need not add up).")


if __name__ == "__main__":
    if "--child" in sys.argv:
        child_main(_child)
    else:
        main()
