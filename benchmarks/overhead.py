"""Framework overhead: difftune's stage-2 LoRA step against a minimal hand-written loop.

The minimal loop is what one would write by hand: the diffusers transformer, peft LoRA on the same modules
with the same rank, the flow-matching loss, AdamW, the same cached samples held in memory. Both run in
fresh processes with the same thread count, alternating, and step times are medians after warm-up.

    .venv/bin/python benchmarks/overhead.py            # the proportional model (~2 min here)
    .venv/bin/python benchmarks/overhead.py --quick    # smoke run on the tests' tiny model
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (LORA_TARGETS, base_parser, child_command, child_main, emit, machine, machine_line,  # noqa: E402
                    prepare, proportional, quick, ratio, reset_accelerate, resolve_doc, run_child,
                    run_difftune, status_kb, step_intervals, table, train_flags, update_doc, verdict,
                    workdir_of)


def load_cache_samples(cache_dir: str) -> list[tuple]:
    """(input_latents, prompt_embeds, prompt_embeds_mask) per sample, read straight from the shards."""
    from safetensors.torch import load_file

    samples = []
    for index_path in sorted(Path(cache_dir).rglob("shard-*.json")):
        index = json.loads(index_path.read_text())
        tensors = load_file(str(index_path.with_suffix(".safetensors")))
        for entry in index["samples"].values():
            samples.append(tuple(tensors[entry[name]["tensor"]["key"]]
                                 for name in ("input_latents", "prompt_embeds", "prompt_embeds_mask")))
    return samples


def pack(latents):
    """(B, 16, h, w) -> (B, h/2 * w/2, 64): 2x2 patches, as the Qwen-Image transformer takes them."""
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def measure_minimal(repo: str, cache: str, steps: int, rank: int, seed: int = 0) -> dict:
    """The hand-written loop, instrumented like the difftune runs (optimizer-step stamps, VmHWM)."""
    import torch
    from diffusers import QwenImageTransformer2DModel
    from peft import LoraConfig
    from torch.optim.optimizer import register_optimizer_step_post_hook

    stamps: list[float] = []
    hook = register_optimizer_step_post_hook(lambda *a: stamps.append(time.perf_counter()))
    rss_before = status_kb("VmRSS")
    start = time.perf_counter()
    dit = QwenImageTransformer2DModel.from_pretrained(f"{repo}/transformer", torch_dtype=torch.float32)
    dit.requires_grad_(False)
    torch.manual_seed(seed)
    dit.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=LORA_TARGETS.split(",")))
    dit.train()
    params = [p for p in dit.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)
    samples = load_cache_samples(cache)
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(samples), generator=gen).tolist()
    for step in range(steps):
        x0, embeds, mask = samples[order[step % len(samples)]]
        x0 = x0[None].float()
        h, w = x0.shape[-2:]
        sigma = torch.rand(1, generator=gen)
        noise = torch.randn(x0.shape, generator=gen)
        noisy = (1 - sigma) * x0 + sigma * noise
        pred = dit(hidden_states=pack(noisy), timestep=sigma, encoder_hidden_states=embeds[None],
                   encoder_hidden_states_mask=mask[None], img_shapes=[[(1, h // 2, w // 2)]], return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(pred.float(), pack(noise - x0).float())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    end = time.perf_counter()
    hook.remove()
    return {"step_stamps": stamps, "run_seconds": end - start, "rss_before_kb": rss_before,
            "vmhwm_kb": status_kb("VmHWM"), "steps": steps, "loader_waits": []}


def run_minimal(kwargs: dict, isolated: bool, threads: int) -> dict:
    if isolated:
        return run_child(child_command(sys.executable, Path(__file__), {"kind": "minimal", "kwargs": kwargs}), threads)
    import torch

    torch.set_num_threads(threads)
    return measure_minimal(**kwargs)


def main(argv=None) -> dict:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=None)
    p.add_argument("--repeat", type=int, default=None, help="steps = images x repeat (one epoch)")
    p.add_argument("--rounds", type=int, default=None, help="alternating difftune/minimal pairs")
    p.add_argument("--warmup", type=int, default=None)
    args = p.parse_args(argv)
    cfg = quick() if args.quick else proportional()
    n = args.images or (2 if args.quick else 8)
    repeat = args.repeat or (4 if args.quick else 4)
    rounds = args.rounds or (1 if args.quick else 2)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    isolated = not args.quick
    info = machine(args.threads)
    ours, theirs = [], []
    with workdir_of(args) as wd:
        ws = prepare(wd, cfg, n)
        cache = wd / "cache-overhead"
        run_difftune(train_flags(ws, "sft:data_process", cache, components=("text_encoder", "vae")), isolated,
                     args.threads)
        steps = n * repeat
        for r in range(rounds):
            ours.append(run_difftune(train_flags(ws, "sft:train", wd / f"ours-{r}", dataset=cache, repeat=repeat,
                                                 components=("transformer",)), isolated, args.threads))
            theirs.append(run_minimal({"repo": str(ws.repo), "cache": str(cache), "steps": steps,
                                       "rank": cfg.lora_rank}, isolated, args.threads))
            reset_accelerate()
    t_ours = statistics.median([x for run in ours for x in step_intervals(run, warmup)])
    t_min = statistics.median([x for run in theirs for x in step_intervals(run, warmup)])
    per_round = [ratio(statistics.median(step_intervals(a, warmup)), statistics.median(step_intervals(b, warmup)))
                 for a, b in zip(ours, theirs)]
    result = {
        "benchmark": "overhead", "config": cfg.name, "resolution": cfg.resolution, "steps_per_run": steps,
        "rounds": rounds, "warmup_steps": warmup, "isolated_processes": isolated,
        "step_time_difftune_s": t_ours, "step_time_minimal_s": t_min, "overhead_ratio": ratio(t_ours, t_min),
        "overhead_ratio_per_round": per_round,
        "peak_rss_difftune_mib": max(r["vmhwm_kb"] for r in ours) / 1024,
        "peak_rss_minimal_mib": max(r["vmhwm_kb"] for r in theirs) / 1024,
        "machine": info,
    }
    result["targets"] = {"overhead_ratio": {"target": "<= 1.05", "value": result["overhead_ratio"],
                                            "met": result["overhead_ratio"] <= 1.05}}
    update_doc(resolve_doc(args), "overhead", render(result))
    emit(result)
    return result


def render(r: dict) -> str:
    rows = [["step time (s, median after warm-up)", r["step_time_difftune_s"], r["step_time_minimal_s"],
             r["overhead_ratio"], "≤ 1.05", verdict(r["overhead_ratio"], 1.05)],
            ["per round", "", "", " / ".join(f"{x:.3f}" for x in r["overhead_ratio_per_round"]), "", ""],
            ["peak RSS (MiB, VmHWM)", r["peak_rss_difftune_mib"], r["peak_rss_minimal_mib"],
             ratio(r["peak_rss_difftune_mib"], r["peak_rss_minimal_mib"]), "—", "—"]]
    head = (f"Config `{r['config']}` at {r['resolution']}x{r['resolution']}, {r['steps_per_run']} steps per run, "
            f"{r['rounds']} alternating round(s) of fresh processes, first {r['warmup_steps']} steps left out.")
    return "\n\n".join([head, table(["metric", "difftune stage 2", "minimal loop", "difftune ÷ minimal", "target",
                                     "verdict"], rows), machine_line(r["machine"])])


def _minimal_child(payload: dict) -> dict:
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    return measure_minimal(**payload["kwargs"])


if __name__ == "__main__":
    if "--child" in sys.argv:  # a measured child process (see run_minimal)
        child_main(_minimal_child)
    else:
        main()
