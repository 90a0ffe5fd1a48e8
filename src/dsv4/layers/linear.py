"""Linear layers: plain floating weights, or fp8 e4m3 weights with ue8m0 128x128 block scales.

The block scale multiplies (docs/spec.md §3.2). The reference forward dequantises the weight
into the activation dtype, which is exact in bf16 and float64 for every realistic scale.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dsv4.config import ceil_div
from dsv4.layers.fp8 import dequantize_fp8_block
from dsv4.layers.weight_layout import canonical, require_canonical

FP8_BLOCK = 128


def grouped_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y [T, G * R] with columns g*R .. g*R + R - 1 = x[:, g] @ w[g]^T, for x [T, G, C] and
    w [G, R, C] (``wo_a``'s output groups): one batched GEMM over the groups, written straight
    into the [T, G, R] rows (a [G, T, R] result would need a copy to flatten). Under autograd
    (an ``out=`` GEMM is not differentiable) the einsum and its copy."""
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return torch.einsum("tgc,grc->tgr", x, w).flatten(1)
    y = torch.empty(x.shape[0], x.shape[1], w.shape[1], dtype=torch.result_type(x, w),
                    device=x.device)
    torch.bmm(x.transpose(0, 1), w.transpose(1, 2), out=y.transpose(0, 1))
    return y.flatten(1)


def frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class Linear(nn.Module):
    """y = x @ W^T without bias. ``fp8=True`` stores W as e4m3 plus a ``scale`` parameter."""

    def __init__(self, in_features: int, out_features: int, *, fp8: bool, dtype: torch.dtype,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.is_fp8 = fp8
        self.dsv4_name = "weight"
        """Full name used in errors (set by the owning layer)."""
        wdtype = torch.float8_e4m3fn if fp8 else dtype
        self.weight = frozen(torch.empty(out_features, in_features, dtype=wdtype, device=device))
        if fp8:
            shape = (ceil_div(out_features, FP8_BLOCK), ceil_div(in_features, FP8_BLOCK))
            self.scale: nn.Parameter | None = frozen(
                torch.empty(shape, dtype=torch.float8_e8m0fnu, device=device))
        else:
            self.register_parameter("scale", None)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The canonical weight as a floating tensor of ``dtype`` (exact for bf16/fp32/fp64)."""
        w = canonical(self.weight)
        if self.scale is None:
            return w.to(dtype)
        return dequantize_fp8_block(w, self.scale, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        require_canonical(self.weight, self._qualname())
        return F.linear(x, self.dequantized_weight(x.dtype))

    def forward_fp32(self, x: torch.Tensor, acc_dtype: torch.dtype) -> torch.Tensor:
        """x @ W^T with an ``acc_dtype`` (fp32 or fp64) output; the portable fallback of
        ``torch.mm(..., out_dtype=torch.float32)``: both operands upcast, products exact."""
        require_canonical(self.weight, self._qualname())
        return F.linear(x.to(acc_dtype), self.dequantized_weight(acc_dtype))

    def _qualname(self) -> str:
        return self.dsv4_name

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fp8={self.is_fp8}"


class MergedLinear(Linear):
    """Several linears over the same input stored as one, row shards back to back.

    ``fused_wqa_wkv`` = wq_a | wkv; ``fused_wkv_wgate`` = wkv | wgate. Each shard loads separately
    from its official checkpoint name; with fp8 the shard boundaries must fall on 128-row blocks so
    that the merged scale is the row-concatenation of the shard scales.
    """

    def __init__(self, in_features: int, shard_sizes: Sequence[int], *, fp8: bool,
                 dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        super().__init__(in_features, sum(shard_sizes), fp8=fp8, dtype=dtype, device=device)
        if fp8 and any(s % FP8_BLOCK for s in shard_sizes[:-1]):
            raise ValueError(f"fp8 shard sizes {list(shard_sizes)} must be multiples of "
                             f"{FP8_BLOCK} (except the last)")
        self.shard_sizes = tuple(shard_sizes)

    def shard_rows(self, index: int) -> slice:
        start = sum(self.shard_sizes[:index])
        return slice(start, start + self.shard_sizes[index])

    def shard_scale_rows(self, index: int) -> slice:
        rows = self.shard_rows(index)
        return slice(rows.start // FP8_BLOCK, ceil_div(rows.stop, FP8_BLOCK))
