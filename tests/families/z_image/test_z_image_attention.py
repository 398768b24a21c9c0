"""Z-Image's joint q/k processor (families/z_image/attention.py) computes what diffusers' processor computes: the same
outputs bit for bit and the same gradients, with fewer operators."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from difftune.families.z_image import attention as z_attention
from difftune.families.z_image.model_fn import model_fn_z_image
from support.z_image.tiny import TinyZImageSpec, tiny_dit


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _step(dit, latents, prompts, mask, ckpt):
    """One model_fn call and its backward: the output, every parameter's gradient, the operators dispatched."""
    count = _Count()
    with count:
        out = model_fn_z_image(dit, latents, torch.tensor([700.0, 300.0]), prompts, mask,
                               use_gradient_checkpointing=ckpt)
        out.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in dit.named_parameters() if p.grad is not None}
    return out.detach(), grads, sum(count.ops.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ckpt", [False, True])
def test_joint_qk_equals_diffusers_processor(monkeypatch, dtype, ckpt):
    """A padded batch of two prompts (masks in the attention), every parameter trained (the q/k norms' weights too):
    the output is bit-identical; the gradients equal (the norms' weight gradients within float rounding: their sums
    run in another order)."""
    dit = tiny_dit(TinyZImageSpec(seed=3)).to(dtype).train()
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(2, 16, 8, 8, generator=g).to(dtype)
    prompts = torch.randn(2, 7, dit.config.cap_feat_dim, generator=g).to(dtype)
    mask = torch.tensor([[1] * 7, [1] * 5 + [0] * 2])
    results = {}
    for joint in (False, True):
        monkeypatch.setattr(z_attention, "JOINT_QK", joint)
        model = copy.deepcopy(dit)
        results[joint] = _step(model, latents, prompts, mask, ckpt)
        kinds = {type(m.processor).__name__ for m in model.modules() if hasattr(m, "processor")}
        assert kinds == ({"JointQKAttnProcessor"} if joint else {"ZSingleStreamAttnProcessor"})
    (out0, grads0, ops0), (out1, grads1, ops1) = results[False], results[True]
    assert torch.equal(out0, out1)
    assert grads0.keys() == grads1.keys() and len(grads0) > 0
    norm_tol = 1e-5 if dtype == torch.float32 else 1e-2  # of the gradient's largest value
    for name, g0 in grads0.items():
        if "norm_q" in name or "norm_k" in name:
            assert (g0 - grads1[name]).abs().max() <= norm_tol * g0.abs().max(), name
        else:
            assert torch.equal(g0, grads1[name]), name
    assert ops1 < 0.93 * ops0, (ops0, ops1)


def test_joint_qk_runs_diffusers_code_where_norms_differ():
    """Norms the joint path cannot share (other eps) run diffusers' processor code, with its result."""
    dit = tiny_dit(TinyZImageSpec(seed=4))
    block = dit.layers[0]
    reference = copy.deepcopy(block)
    block.attention.norm_k.eps = 1e-3
    reference.attention.norm_k.eps = 1e-3
    z_attention.use_joint_qk(block)
    assert isinstance(block.attention.processor, z_attention.JointQKAttnProcessor)
    assert not z_attention._joint_norms(block.attention)
    x = torch.randn(1, 32, dit.config.dim)
    half = block.attention.norm_q.weight.shape[0] // 2
    freqs = torch.polar(torch.ones(1, 32, half), torch.randn(1, 32, half))
    adaln = torch.randn(1, min(dit.config.dim, 256))
    assert torch.equal(block(x, None, freqs, adaln), reference(x, None, freqs, adaln))
