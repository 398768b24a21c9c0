"""Probe: a pickle-free DeepSpeed ZeRO training state through DeepSpeed's public per-parameter accessors
(deepspeed.utils.safe_get/set_full_fp32_param, safe_get/set_full_optimizer_state), on 2 CPU processes (gloo).

Run A: 2 steps, save (full fp32 weights + AdamW moments per parameter, safetensors; the step count), 2 more steps.
Run B: a fresh engine, load that state, 2 steps. A and B must end with the same weights.

    torchrun --nproc_per_node 2 --master_port <port> probe_deepspeed_resume.py <stage> <out dir>
"""
import json
import os
import sys

import torch

stage, out = int(sys.argv[1]), sys.argv[2]
import deepspeed
from deepspeed.utils import (safe_get_full_fp32_param, safe_get_full_optimizer_state, safe_set_full_fp32_param,
                             safe_set_full_optimizer_state)
from safetensors.torch import load_file, save_file

deepspeed.init_distributed(dist_backend="gloo")
rank = torch.distributed.get_rank()
KEYS = ("exp_avg", "exp_avg_sq")


def engine():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": stage}}
    return deepspeed.initialize(model=model, optimizer=opt, config=config)[0]


def steps(e, first, n):
    for i in range(first, first + n):
        g = torch.Generator().manual_seed(100 * i + rank)
        loss = e(torch.randn(4, 16, generator=g)).square().mean()
        e.backward(loss)
        e.step()


def base_state(e):
    return e.optimizer.optimizer.state  # torch AdamW over DeepSpeed's flat fp32 partitions


def full_weights(e):
    return {n: safe_get_full_fp32_param(p).detach().cpu().clone() for n, p in e.module.named_parameters()}


a = engine()
steps(a, 0, 2)
tensors = {}
for name, p in a.module.named_parameters():  # collective under ZeRO-3: every rank calls it
    tensors[f"param/{name}"] = safe_get_full_fp32_param(p).detach().cpu().contiguous()
    for key in KEYS:
        tensors[f"{key}/{name}"] = safe_get_full_optimizer_state(p, key).detach().cpu().contiguous()
step_counts = sorted({int(s["step"]) for s in base_state(a).values()})
if rank == 0:
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "state.safetensors"))
    with open(os.path.join(out, "state.json"), "w") as f:
        json.dump({"step": step_counts}, f)
torch.distributed.barrier()
steps(a, 2, 2)
wa = full_weights(a)

b = engine()
saved = load_file(os.path.join(out, "state.safetensors"))
step = json.load(open(os.path.join(out, "state.json")))["step"][0]
b_state_before = len(base_state(b))
# The base optimizer creates its state at its first step: make it now (zero moments, step 0) over DeepSpeed's flat
# fp32 partitions, and let ZeRO-1/2 link each parameter's fragment to it, so the setters below have a target.
flats = getattr(b.optimizer, "fp32_partitioned_groups_flat", None) or \
    [f for g in b.optimizer.optimizer.param_groups for f in g["params"]]  # ZeRO-3 / ZeRO-1,2
for flat in flats:
        base_state(b).setdefault(flat, {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(flat),
                                        "exp_avg_sq": torch.zeros_like(flat)})
if hasattr(b.optimizer, "_lazy_init_hp_params_optimizer_state"):
    b.optimizer._lazy_init_hp_params_optimizer_state()
for name, p in b.module.named_parameters():
    safe_set_full_fp32_param(p, saved[f"param/{name}"])
    for key in KEYS:
        safe_set_full_optimizer_state(p, saved[f"{key}/{name}"], key)
for s in base_state(b).values():
    s["step"] = torch.tensor(float(step))
# The module's own (low-precision) copy of the weights is refreshed from the fp32 partitions only after a step:
# write it too (ZeRO-3: gathered, changed on rank 0, partitioned again on leaving the context).
with torch.no_grad():
    for name, p in b.module.named_parameters():
        if stage == 3:
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                if rank == 0:
                    p.copy_(saved[f"param/{name}"])
        else:
            p.copy_(saved[f"param/{name}"])
steps(b, 2, 2)
wb = full_weights(b)
diff = max((wa[n] - wb[n]).abs().max().item() for n in wa)
moved = max((wa[n] - saved[f"param/{n}"]).abs().max().item() for n in wa)
print(f"rank={rank} ZeRO-{stage}: optimizer state entries at init={b_state_before}, saved step={step_counts}, "
      f"max |resumed - uninterrupted| = {diff:.3e} (the last 2 steps moved weights by {moved:.3e})", flush=True)
