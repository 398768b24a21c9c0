"""Probe: DeepSpeed ZeRO on 2 CPU processes (gloo), through accelerate and directly.

    accelerate launch --config_file <zero config> --num_processes 2 probe_deepspeed.py accelerate-cpu|accelerate-nocpu|accelerate-gloo
    torchrun --nproc_per_node 2 probe_deepspeed.py raw <stage> <out dir>
"""
import os
import sys

import torch

mode = sys.argv[1]


def model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def batch(rank):
    g = torch.Generator().manual_seed(rank)
    return torch.randn(4, 16, generator=g)


if mode.startswith("accelerate"):
    from accelerate import Accelerator

    if mode == "accelerate-gloo":  # no cpu=True (that drops DeepSpeed): name the backend instead
        from accelerate.utils import InitProcessGroupKwargs

        acc = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    else:
        acc = Accelerator(cpu=mode == "accelerate-cpu")
    print(f"rank={acc.process_index} world={acc.num_processes} type={acc.state.distributed_type} "
          f"device={acc.device} dist_init={torch.distributed.is_initialized()}", flush=True)
    plugin = getattr(acc.state, "deepspeed_plugin", None)
    if plugin is not None:
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 4
    model, opt = model_and_optimizer()
    try:
        model, opt = acc.prepare(model, opt)
        loss = model(batch(acc.process_index)).square().mean()
        acc.backward(loss)
        opt.step()
        print(f"rank={acc.process_index} prepared={type(model).__name__} step ok", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"rank={acc.process_index} prepare/step failed: {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)
    raise SystemExit(0)

# raw: deepspeed.initialize with ZeRO-<stage> on the CPU accelerator
import faulthandler

faulthandler.dump_traceback_later(int(os.environ.get("PROBE_HANG_S", "90")), exit=True)  # show where it hangs
import deepspeed

stage, out = int(sys.argv[2]), sys.argv[3]
offload = len(sys.argv) > 4 and sys.argv[4] == "offload"
deepspeed.init_distributed(dist_backend="gloo")
rank = torch.distributed.get_rank()
model, opt = model_and_optimizer()
config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
          "zero_optimization": {"stage": stage}, "bf16": {"enabled": False}}
if offload:
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if stage == 3:
        config["zero_optimization"]["offload_param"] = {"device": "cpu"}
    opt = None
    config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2}}
engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=opt,
                                               model_parameters=model.parameters() if opt is None else None,
                                               config=config)
for _ in range(2):
    loss = engine(batch(rank)).square().mean()
    engine.backward(loss)
    engine.step()
local = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in engine.module.parameters())
print(f"rank={rank} ZeRO-{stage}{' offload' if offload else ''}: 2 steps ok, loss={loss.item():.6f}, "
      f"optimizer={type(getattr(engine.optimizer, 'optimizer', engine.optimizer)).__name__}, "
      f"local param elements={local} of {sum(p.ds_numel if hasattr(p, 'ds_numel') else p.numel() for p in engine.module.parameters())}",
      flush=True)
engine.save_checkpoint(out, tag="step-2")
torch.distributed.barrier()
if rank == 0:
    files = sorted(os.path.relpath(os.path.join(d, f), out) for d, _, fs in os.walk(out) for f in fs)
    print("save_checkpoint files:", files, flush=True)
