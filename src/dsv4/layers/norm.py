"""RMSNorm with statistics in fp32 (or fp64 when the layer runs in float64)."""

from __future__ import annotations

import torch
from torch import nn


def rms_normalize(x: torch.Tensor, eps: float, acc_dtype: torch.dtype) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dim, computed in ``acc_dtype`` (no weight)."""
    xf = x.to(acc_dtype)
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, acc_dtype: torch.dtype = torch.float32,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
        y = rms_normalize(x, self.eps, acc_dtype) * self.weight.to(acc_dtype)
        return y.to(out_dtype or x.dtype)
