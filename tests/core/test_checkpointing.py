"""core/checkpointing.checkpoint_function: the function diffusers' blocks are checkpointed through takes keyword
arguments (diffusers' Wan-Animate-2 blocks receive their KV cache and settings by name), with and without the CPU
offload of the saved inputs, and gives the gradients a plain call gives."""

import pytest
import torch

from difftune.core.checkpointing import checkpoint_function


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x, scale=None, shift=0.0, note=None):
        self.calls += 1
        assert note == "kept"  # a non-tensor keyword arrives as given
        return self.lin(x) * scale + shift


@pytest.mark.parametrize("offload", [False, True])
def test_keyword_arguments_reach_the_block_and_gradients_match(offload):
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(3, 4, requires_grad=True)
    scale = torch.randn(3, 4, requires_grad=True)
    plain = block(x, scale=scale, shift=1.5, note="kept").sum()
    grads = torch.autograd.grad(plain, (x, scale, block.lin.weight))
    block.calls = 0
    out = checkpoint_function(offload)(block, x, scale=scale, shift=1.5, note="kept").sum()
    again = torch.autograd.grad(out, (x, scale, block.lin.weight))
    assert torch.equal(plain, out)
    assert all(torch.allclose(a, b) for a, b in zip(grads, again))
    assert block.calls == 2  # the block ran again in backward: its activations were not kept
