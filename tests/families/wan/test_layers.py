"""The Wan variants' shared layers (families/wan/layers.py) against diffusers' and textbook formulas."""

import math

import pytest
import torch
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

from difftune.families.wan.layers import (RMSNorm, WanAttention, attend, pair_tables, rope_axis_dims,
                                          rope_grid_angles, rotate)


@pytest.mark.parametrize("head_dim", [8, 12, 128])
def test_rope_tables_are_diffusers_wan_tables(head_dim):
    grid = (3, 4, 5)
    ours = rope_grid_angles(head_dim, grid)
    cos, sin = pair_tables(WanRotaryPosEmbed(head_dim, (1, 2, 2), 64)(torch.zeros(1, 1, 3, 8, 10)))
    assert ours.shape == (math.prod(grid), head_dim // 2) and sum(rope_axis_dims(head_dim)) == head_dim
    assert torch.allclose(ours.cos().float(), cos[0, :, 0].float(), atol=1e-6)
    assert torch.allclose(ours.sin().float(), sin[0, :, 0].float(), atol=1e-6)
    # frames numbered from frame0: the table of the later frames
    shifted = rope_grid_angles(head_dim, (1, 4, 5), frame0=2)
    assert torch.equal(shifted, ours[2 * 20:])


def test_rotate_is_a_complex_product():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, 3, 8, generator=g, dtype=torch.float64)
    angles = torch.randn(7, 4, generator=g, dtype=torch.float64)
    expected = torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2)).contiguous())
                                  * torch.polar(torch.ones_like(angles), angles)[None, :, None]).flatten(-2)
    out = rotate(x, angles.cos()[None, :, None], angles.sin()[None, :, None])
    assert torch.allclose(out, expected, atol=1e-12)
    # returned in x's dtype whatever the tables'; converting x first gives the same values
    low = rotate(x.float(), angles.cos()[None, :, None], angles.sin()[None, :, None])
    assert low.dtype == torch.float32
    assert torch.equal(low, rotate(x.float(), angles.cos()[None, :, None], angles.sin()[None, :, None],
                                   torch.float64))


def test_attention_is_softmax_attention():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 5, 3, 4, generator=g) for _ in range(3))
    weights = torch.softmax(torch.einsum("bshd,bthd->bhst", q, k) / 2.0, dim=-1)
    expected = torch.einsum("bhst,bthd->bshd", weights, v).flatten(2)
    assert torch.allclose(attend(q, k, v), expected, atol=1e-6)
    mask = torch.rand(5, 5, generator=g) > 0.3
    mask[:, 0] = True
    masked = torch.softmax((torch.einsum("bshd,bthd->bhst", q, k) / 2.0).masked_fill(~mask, -math.inf), dim=-1)
    assert torch.allclose(attend(q, k, v, mask), torch.einsum("bhst,bthd->bshd", masked, v).flatten(2), atol=1e-6)


def test_wan_attention_reads_image_tokens_only_with_its_image_projections():
    torch.manual_seed(2)
    attn = WanAttention(16, 2, image_input=True)
    x, context = torch.randn(1, 6, 16), torch.randn(1, 9, 16)
    text_only = attn(x, context[:, 4:])
    with_image = attn(x, context, image_tokens=4)
    q, k, v = attn.qkv(x, context[:, :4])
    img = attn.split(attn.norm_k_img(attn.k_img(context[:, :4]))), attn.split(attn.v_img(context[:, :4]))
    assert torch.allclose(with_image - text_only, attn.o(attend(q, *img)) - attn.o.bias, atol=1e-6)
    assert not any(n.endswith("_img.weight") for n, _ in WanAttention(16, 2).named_parameters())


def test_rms_norm_normalises_in_float32_then_scales_by_its_weight():
    norm = RMSNorm(8)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    y = x.float()
    assert torch.equal(norm(x), (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16() * norm.weight)
