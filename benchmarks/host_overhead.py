"""Host overhead of a stage-2 LoRA step: the torch operators it dispatches, before and after, for each family.

On a GPU a step whose kernels are small waits on the host issuing them; the count of operators dispatched per
optimizer step measures that cost on any machine. Each family's tiny model (the tests' writers) trains its split
stage 2 from a cache on the CPU with default flags (bf16, LoRA rank 32 on the family's reference targets, gradient
checkpointing), in this process, with a `TorchDispatchMode` counting every operator between two optimizer steps
(the third step: the first ones create the optimizer's state). "before" is the earlier behaviour: `--lora_compute
fp32` (fp32 adapters, autocast casting around each), `--loss_readback_steps 1` (the loss read back every step) and,
switched here, torch's own per-tensor AdamW loop on the CPU (`foreach=None`), the attention masks passed as they
were built and Z-Image's queries and keys normed and rotated apart (diffusers' own processor). Prints the counts side
by side and one JSON line.

    .venv/bin/python benchmarks/host_overhead.py                  # every family, into docs/performance.md
    .venv/bin/python benchmarks/host_overhead.py --quick          # Qwen-Image only
"""

from __future__ import annotations

import collections
import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (DOC, ROOT, base_parser, emit, machine, machine_line, ratio, resolve_doc, table,  # noqa: E402
                    update_doc, workdir_of)

PERFORMANCE_DOC = ROOT / "docs" / "performance.md"

FAMILIES = ("qwen_image", "flux", "wan", "z_image")
BEFORE_FLAGS = ["--lora_compute", "fp32", "--loss_readback_steps", "1"]
MEASURED_STEP = 3  # operators between the 2nd and 3rd optimizer steps


def _bf16_rank32(flags: list[str]) -> list[str]:
    out = list(flags)
    out[out.index("--torch_dtype") + 1] = "bfloat16"
    out[out.index("--lora_rank") + 1] = "32"
    return out


def family_runs(family: str, wd: Path):
    """(stage-1 flags, stage-2 flags) of `family`'s tiny model, as its split benchmark builds them."""
    from split_vs_unsplit import DIT
    from split_vs_unsplit import FAMILIES as SPLIT
    from split_vs_unsplit import flags

    if family not in FAMILIES:
        raise SystemExit(f"unknown family {family}")
    cfg = SPLIT[family].config(quick=True)
    prep = SPLIT[family].prepare(wd, cfg, 2)
    s1 = flags(prep, cfg, "sft:data_process", wd / "cache", components=prep.stage1)
    s2 = flags(prep, cfg, "sft:train", wd / "two", dataset=wd / "cache", repeat=2, components=(DIT,))
    return _bf16_rank32(s1), _bf16_rank32(s2) + ["--use_gradient_checkpointing"]


@contextlib.contextmanager
def earlier_behaviour():
    """What no flag selects any more: AdamW's per-tensor loop on the CPU, attention masks kept when nothing is
    padded, Z-Image's queries and keys normed and rotated apart (diffusers' processor)."""
    import torch

    import difftune.training.fit as fit
    from difftune.core import attention
    from difftune.families.z_image import attention as z_attention

    make = fit.make_optimizer

    def per_tensor(params, config, accelerator=None):
        return torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=config.weight_decay)

    fit.make_optimizer, attention.DROP_UNPADDED_MASKS, z_attention.JOINT_QK = per_tensor, False, False
    try:
        yield
    finally:
        fit.make_optimizer, attention.DROP_UNPADDED_MASKS, z_attention.JOINT_QK = make, True, True


def count_step(argv: list[str]) -> dict:
    """Operators dispatched between optimizer steps MEASURED_STEP - 1 and MEASURED_STEP of one training run."""
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.utils._python_dispatch import TorchDispatchMode

    from common import reset_accelerate
    from difftune.cli.args import training_parser
    from difftune.training.recipe import run

    class Counter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: collections.Counter = collections.Counter()
            self.at_steps: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    args = training_parser().parse_args(argv)
    counter = Counter()
    hook = register_optimizer_step_post_hook(lambda *_: counter.at_steps.append(collections.Counter(counter.ops)))
    try:
        with counter:
            run(args)
    finally:
        hook.remove()
        reset_accelerate()
    if len(counter.at_steps) < MEASURED_STEP:
        raise RuntimeError(f"only {len(counter.at_steps)} optimizer steps: raise the repeat count")
    step = counter.at_steps[MEASURED_STEP - 1] - counter.at_steps[MEASURED_STEP - 2]
    return {"ops": sum(step.values()), "to_copy": step["aten._to_copy"], "top": step.most_common(12)}


def measure_family(family: str, wd: Path) -> dict:
    from common import fresh, run_difftune

    s1, s2 = family_runs(family, wd)
    run_difftune(s1, isolated=False)
    out = s2[s2.index("--output_path") + 1]
    with earlier_behaviour():
        fresh(Path(out))
        before = count_step(s2 + BEFORE_FLAGS)
    fresh(Path(out))
    after = count_step(s2)
    return {"before": before, "after": after, "ops_ratio": ratio(after["ops"], before["ops"]),
            "to_copy_ratio": ratio(after["to_copy"], max(1, before["to_copy"]))}


def render(result: dict) -> str:
    rows = [[f, r["before"]["ops"], r["after"]["ops"], f"{r['ops_ratio']:.3f}", r["before"]["to_copy"],
             r["after"]["to_copy"]] for f, r in result["families"].items()]
    return "\n".join([
        "Operators dispatched per stage-2 optimizer step of each family's tiny model (bf16 mixed precision, LoRA "
        "rank 32 on the reference's targets, gradient checkpointing), counted with a `TorchDispatchMode` "
        "(`benchmarks/host_overhead.py`). Before: `--lora_compute fp32 --loss_readback_steps 1`, AdamW's "
        "per-tensor loop, attention masks kept, Z-Image's q/k norms and RoPE apart (diffusers' processor).", "",
        table(["family", "operators before", "operators after", "after / before", "`_to_copy` before",
               "`_to_copy` after"], rows), "", machine_line(result["machine"])])


def main(argv=None) -> dict:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--families", default=None, help=f"comma-separated, of {', '.join(FAMILIES)} (default: all; "
                                                    "--quick: qwen_image)")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    families = args.families.split(",") if args.families else (["qwen_image"] if args.quick else list(FAMILIES))
    result = {"benchmark": "host_overhead", "families": {}, "machine": machine(args.threads)}
    with workdir_of(args) as wd:
        for family in families:
            result["families"][family] = measure_family(family, wd / family)
    for family, r in result["families"].items():
        print(f"{family:>10}: {r['before']['ops']:6d} -> {r['after']['ops']:6d} operators per step "
              f"({r['ops_ratio']:.3f}x), _to_copy {r['before']['to_copy']} -> {r['after']['to_copy']}")
    if "qwen_image" in result["families"]:
        value = result["families"]["qwen_image"]["ops_ratio"]
        result["targets"] = {"ops_ratio_qwen_image": {"target": "<= 0.6", "value": value, "met": value <= 0.6}}
    doc = resolve_doc(args)
    update_doc(PERFORMANCE_DOC if doc == DOC else doc, "host_overhead", render(result))  # its table: performance.md
    emit(result)
    return result


if __name__ == "__main__":
    main()
