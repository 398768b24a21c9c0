"""GPU memory against model offload (issue 34): peak GPU memory and step time of a LoRA step at real width, against
the number of blocks offloaded (`--blocks_to_swap N`), with bf16 and with torchao int8 bases.

Prepared for a GPU lease, not run on this CPU machine (there `--quick` runs the same code on tiny widths):
- `qwen`: Qwen-Image's DiT at full depth and width (60 blocks, 24 heads of 128, text width 3584; ~20B parameters,
  random weights, bf16), LoRA rank 32 on the reference's 12 target modules, gradient checkpointing, one 1024x1024
  image (4096 image tokens) and 256 text tokens, under bf16 autocast.
- `wan`: Wan 14B's block width (40 heads of 128, FFN 13824, text width 4096), `--wan_blocks` of its 40 blocks, at
  480x832x81 (21 x 30 x 52 = 32760 tokens after the patch), LoRA rank 32 on attention and FFN.
For each setting, the model's frozen weights start on the host; `training.offload.ModelOffloader` places them (the
same code `--enable_model_cpu_offload` / `--blocks_to_swap` runs); after one warm-up step, `--steps` timed steps.
Each result is written to `--out/<part>.json` as soon as it is measured (a part cut short keeps what it had).

    python benchmarks/gpu_memory.py --out DIR                 # on the GPU machine (~6-8 minutes on an H100)
    python benchmarks/gpu_memory.py --quick --out DIR         # smoke run on a CPU (tiny widths)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

QWEN_TARGETS = ("to_q,to_k,to_v,add_q_proj,add_k_proj,add_v_proj,to_out.0,to_add_out,img_mlp.net.2,img_mod.1,"
                "txt_mlp.net.2,txt_mod.1")
WAN_TARGETS = "attn1.to_q,attn1.to_k,attn1.to_v,attn1.to_out.0,attn2.to_q,attn2.to_k,attn2.to_v,attn2.to_out.0," \
              "ffn.net.0.proj,ffn.net.2"
GIB = 2 ** 30


def random_init(model: torch.nn.Module, dtype) -> torch.nn.Module:
    """Materialise a meta-device model on the host with small random weights (no full-precision copy)."""
    model = model.to(dtype).to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.uniform_(-0.02, 0.02)
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.zero_()
        for name, b in model.named_buffers():  # computed buffers (rotary tables) are rebuilt by their owners
            if b.is_floating_point():
                b.zero_()
    return model


def qwen_model(quick: bool):
    from diffusers import QwenImageTransformer2DModel

    cfg = dict(num_layers=4, num_attention_heads=2, attention_head_dim=32, joint_attention_dim=64,
               axes_dims_rope=(8, 12, 12)) if quick else dict(num_layers=60)
    with torch.device("meta"):
        model = QwenImageTransformer2DModel(**cfg)
    model = random_init(model, torch.bfloat16)
    # the rotary tables are computed at init (plain attributes, left on the meta device): rebuild them on the host
    model.pos_embed = QwenImageTransformer2DModel(**{**cfg, "num_layers": 1}).pos_embed
    return model, cfg


def qwen_inputs(cfg: dict, quick: bool, device):
    side = 8 if quick else 64  # 1024 / 8 (VAE) / 2 (patch)
    text = 16 if quick else 256
    return dict(hidden_states=torch.randn(1, side * side, 64, device=device, dtype=torch.bfloat16),
                encoder_hidden_states=torch.randn(1, text, cfg.get("joint_attention_dim", 3584), device=device,
                                                  dtype=torch.bfloat16),
                encoder_hidden_states_mask=torch.ones(1, text, device=device, dtype=torch.bool),
                timestep=torch.tensor([0.5], device=device), img_shapes=[[(1, side, side)]], return_dict=False)


def wan_model(quick: bool, blocks: int):
    from diffusers import WanTransformer3DModel

    cfg = dict(num_layers=4, num_attention_heads=2, attention_head_dim=32, ffn_dim=128, text_dim=64, freq_dim=32) \
        if quick else dict(num_layers=blocks)
    with torch.device("meta"):
        model = WanTransformer3DModel(**cfg)
    model = random_init(model, torch.bfloat16)
    model.rope = _wan_rope(cfg.get("attention_head_dim", 128))  # its cos / sin tables, computed again
    return model, cfg


def _wan_rope(head_dim: int):
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    return WanRotaryPosEmbed(head_dim, (1, 2, 2), 1024)


def wan_inputs(cfg: dict, quick: bool, device):
    frames, h, w = (1, 8, 8) if quick else (21, 60, 104)  # 81 frames, 480x832 after the VAE (4x time, 8x space)
    return dict(hidden_states=torch.randn(1, 16, frames, h, w, device=device, dtype=torch.bfloat16),
                timestep=torch.tensor([500], device=device),
                encoder_hidden_states=torch.randn(1, 512 if not quick else 8, cfg.get("text_dim", 4096),
                                                  device=device, dtype=torch.bfloat16), return_dict=False)


def int8(model) -> None:
    from difftune.models.quant import QuantOption, quantize_linears

    blocks = max((m for m in model.modules() if isinstance(m, torch.nn.ModuleList)), key=len)
    quantize_linears(blocks, QuantOption("torchao_int8_w8a16"), torch.bfloat16)


def measure(model, inputs, swap: int, device, steps: int) -> dict:
    from difftune.training.offload import ModelOffloader

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
    started = time.perf_counter()
    offloader = ModelOffloader(model, device, blocks_to_swap=swap)
    placed = time.perf_counter() - started
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    try:
        for i in range(steps + 1):
            t0 = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                out = model(**inputs)[0]
            out.float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - t0)
        result = {"blocks_to_swap": swap, "blocks": offloader.num_blocks, "step_s": sum(times) / len(times),
                  "place_s": placed, "resident_gib": offloader.resident_bytes() / GIB,
                  "host_gib": offloader.host_bytes / GIB, "onloads_per_step": offloader.onloads / (steps + 1)}
        if cuda:
            result.update(peak_allocated_gib=torch.cuda.max_memory_allocated() / GIB,
                          peak_reserved_gib=torch.cuda.max_memory_reserved() / GIB)
    except torch.OutOfMemoryError as err:
        result = {"blocks_to_swap": swap, "oom": str(err).splitlines()[0]}
    finally:
        del opt
        offloader.remove(to="cpu")
    return result


def part(name: str, build, inputs_of, swaps, device, steps: int, quick: bool, out: Path, bases) -> dict:
    from difftune.core.checkpointing import set_gradient_checkpointing
    from difftune.lora import inject_lora

    rows = []
    for base in bases:
        started = time.perf_counter()
        model, cfg = build()
        model.requires_grad_(False)
        if base == "int8":
            int8(model)
        inject_lora(model, (QWEN_TARGETS if name == "qwen" else WAN_TARGETS).split(","), 32)
        set_gradient_checkpointing(model, True)
        model.train()
        built = time.perf_counter() - started
        inputs = inputs_of(cfg, quick, device)
        for swap in swaps(model):
            row = {"base": base, "build_s": built, **measure(model, inputs, swap, device, steps)}
            rows.append(row)
            print(json.dumps({name: row}), flush=True)
            (out.parent / f"{out.name}-{name}.json").write_text(json.dumps({"part": name, "device": str(device), "rows": rows},
                                                         indent=1))
        del model
    return {"part": name, "rows": rows}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--parts", default="qwen,wan")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--wan_blocks", type=int, default=8, help="of Wan 14B's 40 blocks (time: ~1 s per block-step)")
    p.add_argument("--quick", action="store_true", help="tiny widths on the CPU (a smoke run)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    results = {}
    plans = {
        "qwen": (lambda: qwen_model(args.quick), qwen_inputs,
                 {"bf16": lambda m: [0, 16, 30, 60] if not args.quick else [0, 2, 4],
                  "int8": lambda m: [0, 30, 60] if not args.quick else [0, 4]}),
        "wan": (lambda: wan_model(args.quick, args.wan_blocks), wan_inputs,
                {"bf16": lambda m: [0, args.wan_blocks // 2, args.wan_blocks] if not args.quick else [0, 4],
                 "int8": lambda m: [args.wan_blocks] if not args.quick else [4]}),
    }
    for name in args.parts.split(","):
        build, inputs_of, per_base = plans[name]
        for base, swaps in per_base.items():
            try:
                results.setdefault(name, []).extend(
                    part(name, build, inputs_of, swaps, device, args.steps, args.quick, args.out / base, [base])["rows"])
            except Exception:  # the next part still runs; the error is kept
                (args.out / f"{name}-{base}.error.txt").write_text(traceback.format_exc())
                traceback.print_exc()
    summary = {"benchmark": "gpu_memory", "device": str(device), "results": results}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
