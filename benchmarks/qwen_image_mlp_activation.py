"""Qwen-Image's MLP activation at the release's width: the official tanh-GELU (diffusers, ComfyUI; what difftune runs)
against the reference's x * sigmoid(1.702 x) (DiffSynth-Studio's `ApproximateGELU` in qwen_image_dit.py).

Not a test: a measurement for docs/reference_differences.md. One MLP of the release's size (3072 -> 12288 -> 3072,
diffusers' `FeedForward(activation_fn="gelu-approximate")`, seeded random weights; no released weights here), on
tokens of a LayerNorm'd stream (mean 0, std 1), with the first projection scaled so that the activation's input
has each standard deviation of the sweep (the trained model's is unknown here). Printed per row: the activation's
largest difference over the inputs seen, the MLP output's relative L2 difference, and the relative difference of the
gradient a rank-16 LoRA on the first projection gets (lora_B's, for a fixed random upstream gradient).

    .venv/bin/python benchmarks/qwen_image_mlp_activation.py [--tokens 256] [--threads 2]
"""

from __future__ import annotations

import argparse

import torch


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def measure(tokens: int, std: float, dim: int = 3072, inner: int = 12288, rank: int = 16, seed: int = 0) -> dict:
    from diffusers.models.attention import FeedForward

    torch.manual_seed(seed)
    mlp = FeedForward(dim=dim, dim_out=dim, activation_fn="gelu-approximate").float()
    proj, out = mlp.net[0].proj, mlp.net[2]
    x = torch.randn(tokens, dim)
    with torch.no_grad():
        pre = proj(x)
        proj.weight.mul_(std / pre.std())
        proj.bias.zero_()
        pre = proj(x)
    a = torch.randn(rank, dim) / dim ** 0.5
    upstream = torch.randn(tokens, dim)
    results = {}
    for name, act in (("tanh", lambda h: torch.nn.functional.gelu(h, approximate="tanh")), ("quick", quick_gelu)):
        b = torch.zeros(inner, rank, requires_grad=True)
        h = proj(x) + (x @ a.T) @ b.T
        y = out(act(h))
        (y * upstream).sum().backward()
        results[name] = (y.detach(), b.grad.clone())
    (y_t, g_t), (y_q, g_q) = results["tanh"], results["quick"]
    gap = (torch.nn.functional.gelu(pre, approximate="tanh") - quick_gelu(pre)).abs().max().item()
    return {"std": std, "act_max_abs": gap, "out_rel": ((y_t - y_q).norm() / y_t.norm()).item(),
            "grad_rel": ((g_t - g_q).norm() / g_t.norm()).item()}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [measure(args.tokens, std) for std in (0.5, 1.0, 2.0, 4.0)]
    print("| activation input std | activation max abs diff | MLP output rel. L2 diff | LoRA grad rel. L2 diff |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['std']:g} | {r['act_max_abs']:.3g} | {r['out_rel']:.3g} | {r['grad_rel']:.3g} |")
    return rows


if __name__ == "__main__":
    main()
