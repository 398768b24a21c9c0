"""Probe: accelerate's get_state_dict / save_state / load_state under FSDP2 on 2 CPU processes (gloo), with the
tiny Qwen-Image DiT; what files they write and whether a resume restores the weights and optimizer.

    accelerate launch --config_file examples/accelerate/fsdp.yaml --num_processes 2 --mixed_precision no \
        prototypes/fsdp/probe_accelerate_state.py <tiny repo> <out dir> [FULL_STATE_DICT|SHARDED_STATE_DICT]
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
from accelerate import Accelerator
from diffusers import QwenImageTransformer2DModel

import engine

repo, out = Path(sys.argv[1]), Path(sys.argv[2])
kind = sys.argv[3] if len(sys.argv) > 3 else "SHARDED_STATE_DICT"
os.environ["FSDP_STATE_DICT_TYPE"] = kind  # the plugin reads the launcher's variables
acc = Accelerator(cpu=True)
engine.fsdp_on_cpu(acc)
acc.state.fsdp_plugin.transformer_cls_names_to_wrap = ["QwenImageTransformerBlock"]


def build():
    torch.manual_seed(0)
    dit = QwenImageTransformer2DModel.from_pretrained(repo / "transformer", torch_dtype=torch.float32)
    return dit, torch.optim.AdamW(dit.parameters(), lr=1e-3)


def step(dit, opt):
    g = torch.Generator().manual_seed(acc.process_index)
    x = torch.randn(1, 16, 64, generator=g)
    enc = torch.randn(1, 5, 32, generator=g)
    y = dit(hidden_states=x, encoder_hidden_states=enc, encoder_hidden_states_mask=torch.ones(1, 5),
            timestep=torch.tensor([0.5]), img_shapes=[[(1, 4, 4)]], return_dict=False)[0]
    loss = y.square().mean()
    if os.environ.get("PROBE_ALL_GRADS") == "1":  # every parameter gets a (zero) gradient, so optimizer state
        loss = loss + 0.0 * sum((p.full_tensor() if hasattr(p, "full_tensor") else p).sum() for p in dit.parameters())
    acc.backward(loss)
    opt.step()
    opt.zero_grad()


dit, opt = build()
dit, opt = acc.prepare(dit, opt)
step(dit, opt)
full = acc.get_state_dict(dit)
if acc.is_main_process:
    print(f"get_state_dict: {len(full)} tensors, types {sorted({type(v).__name__ for v in full.values()})}, "
          f"devices {sorted({str(v.device) for v in full.values()})}", flush=True)
else:
    print(f"get_state_dict on rank {acc.process_index}: {len(full)} entries", flush=True)
try:
    acc.save_state(str(out))
    acc.wait_for_everyone()
    if acc.is_main_process:
        print("save_state files:", sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()), flush=True)
except Exception as e:  # noqa: BLE001
    print(f"save_state failed on rank {acc.process_index}: {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)
    raise SystemExit(0)
before = {k: v.full_tensor().clone() for k, v in dit.state_dict().items()}
step(dit, opt)  # move away, then load back
try:
    acc.load_state(str(out))
    after = {k: v.full_tensor() for k, v in dit.state_dict().items()}
    diff = max((before[k] - after[k]).abs().max().item() for k in before)
    print(f"load_state on rank {acc.process_index}: max |restored - saved| = {diff:.3e}", flush=True)
except Exception as e:  # noqa: BLE001
    print(f"load_state failed on rank {acc.process_index}: {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)
