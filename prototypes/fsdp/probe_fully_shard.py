"""Probe: torch's fully_shard on CPU tensors over gloo (2 processes), and accelerate's FSDP2 prepare forced on."""
import sys
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

mode = sys.argv[1]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True, state_dict_type="SHARDED_STATE_DICT")
acc = Accelerator(cpu=True, fsdp_plugin=plugin)
print(f"rank={acc.process_index} given plugin: type={acc.state.distributed_type} "
      f"fsdp_plugin={getattr(acc.state, 'fsdp_plugin', None) is not None}", flush=True)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
init = model[0].weight.detach().sum().item()
if mode == "raw":
    from torch.distributed.fsdp import fully_shard
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
else:  # force accelerate's own FSDP2 path
    acc.state.distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = plugin
    model, opt = acc.prepare(model, opt)
w = model[0].weight
print(f"rank={acc.process_index} {type(model).__name__} {type(w).__name__} local={tuple(w.to_local().shape)} "
      f"placements={w.placements}", flush=True)
x = torch.randn(4, 8, generator=torch.Generator().manual_seed(acc.process_index))
loss = model(x).square().mean()
if mode == "raw":
    loss.backward()
else:
    acc.backward(loss)
opt.step()
print(f"rank={acc.process_index} step ok, loss={loss.item():.6f}, full weight sum={w.full_tensor().sum().item():.6f} init={init:.6f} opt_is_dtensor={type(opt.param_groups[0]['params'][0]).__name__}",
      flush=True)
