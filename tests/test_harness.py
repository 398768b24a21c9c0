"""The test harness's own shortcuts compute what they stand in for."""

import pytest
import torch
import torch.nn.functional as F

from conftest import conv3d_by_frames


@pytest.mark.parametrize("batch,cin,cout,kernel,stride,padding,dilation", [
    (1, 3, 2, (3, 3, 3), (1, 1, 1), (0, 0, 0), (1, 1, 1)),  # Wan's causal conv: the time padding done before
    (2, 2, 4, (3, 3, 3), (1, 1, 1), (1, 1, 1), (1, 1, 1)),
    (1, 4, 4, (3, 1, 1), (2, 1, 1), (0, 0, 0), (1, 1, 1)),  # the time downsampling conv
    (1, 2, 2, (3, 3, 3), (1, 2, 2), (2, 1, 0), (2, 1, 1)),
    (1, 4, 2, (1, 1, 1), (1, 1, 1), (0, 0, 0), (1, 1, 1)),
])
def test_conv3d_by_frames_is_conv3d(batch, cin, cout, kernel, stride, padding, dilation):
    torch.manual_seed(0)
    x = torch.randn(batch, cin, 7, 18, 22, requires_grad=True)
    weight = torch.randn(cout, cin, *kernel, requires_grad=True)
    bias = torch.randn(cout, requires_grad=True)
    want = F.conv3d(x, weight, bias, stride, padding, dilation)
    got = conv3d_by_frames(x, weight, bias, stride, padding, dilation)
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(want.square().sum(), (x, weight, bias))
    for a, b in zip(torch.autograd.grad(got.square().sum(), (x, weight, bias)), grads):
        assert torch.allclose(a, b, atol=1e-3, rtol=1e-4)
