"""layers.linear.grouped_linear: the grouped wo_a product of the base path and the cuda
platform's long calls."""

from __future__ import annotations

import torch

from dsv4.layers.linear import grouped_linear


def _case(dtype: torch.dtype, grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 4, 64, generator=g).to(dtype)  # [T, G, C]
    w = torch.randn(4, 32, 64, generator=g).to(dtype)  # [G, R, C]
    return x.requires_grad_(grad), w.requires_grad_(grad)


def test_equals_the_per_group_products_in_row_layout():
    for dtype in (torch.float64, torch.bfloat16):
        x, w = _case(dtype)
        y = grouped_linear(x, w)
        assert y.shape == (37, 4 * 32) and y.dtype == dtype and y.is_contiguous()
        want = torch.cat([x[:, i] @ w[i].t() for i in range(4)], dim=1)
        assert torch.equal(y, want) if dtype == torch.float64 else \
            torch.allclose(y.float(), want.float(), rtol=2 ** -7, atol=1e-2)


def test_differentiable_under_autograd():
    x, w = _case(torch.float64, grad=True)
    y = grouped_linear(x, w)
    y.sum().backward()
    assert x.grad is not None and w.grad is not None
    # d(sum y)/dx[t, g, c] = sum_r w[g, r, c]
    assert torch.allclose(x.grad, w.detach().sum(1)[None].expand_as(x))
    with torch.no_grad():  # the out= GEMM: the same values
        assert torch.allclose(grouped_linear(x, w), y.detach())
