"""Probe: what accelerate makes of an FSDP2 launch config on a machine without CUDA."""
import os, sys
import torch
from accelerate import Accelerator
cpu = sys.argv[1] == "cpu"
acc = Accelerator(cpu=cpu)
st = acc.state
print(f"rank={acc.process_index} cpu={cpu} world={acc.num_processes} type={st.distributed_type} "
      f"fsdp_plugin={getattr(st, 'fsdp_plugin', None) is not None} device={acc.device} "
      f"dist_init={torch.distributed.is_initialized()} "
      f"backend={torch.distributed.get_backend() if torch.distributed.is_initialized() else None}", flush=True)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
opt = torch.optim.AdamW(model.parameters())
m, o = acc.prepare(model, opt)
print(f"rank={acc.process_index} prepared={type(m).__name__} weight={type(next(m.parameters())).__name__}", flush=True)
