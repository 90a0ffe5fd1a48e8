"""Exact PyTorch emulations of the AITER preshuffle platform's ops (docs/upstream.md A.4-A.6).

The ROCm path preshuffles FP8 weights into AITER's (16, 16) tile layout and runs a blockscale GEMM
that reads that layout. Feeding such a weight to a plain GEMM silently computes a permuted product
(the vllm#51821 regression), so these emulations exist to make the layout and its GEMM testable on
any device: CPU CI checks the whole platform without the hardware.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dsv4.layers.fp8 import FP8_AMAX_FLOOR, FP8_E4M3_MAX, dequantize_fp8_block
from dsv4.layers.quant_sim import pow2_block_scale

SHUFFLE_LAYOUT = (16, 16)
"""AITER's blockscale B layout: 16 rows x 16 bytes per tile."""
QUANT_GROUP = 128
"""Activation quantisation group along K (one fp32 scale per row and 128 columns)."""
AMAX_FLOOR = 1e-10
"""AITER's amax floor for the per-token group quantiser (not the official 1e-4)."""

_BITS_VIEW = {1: torch.uint8, 2: torch.int16}


def _tile_cols(element_size: int) -> int:
    """P = elements per 16-byte tile row: 16 for 1-byte types, 8 for 2-byte types."""
    if element_size not in _BITS_VIEW:
        raise ValueError(
            f"the (16, 16) shuffle supports 1- and 2-byte element types, got {element_size} bytes"
        )
    return 16 // element_size


def _check_shuffle_args(t: Tensor, layout: tuple[int, int], what: str) -> tuple[int, int, int]:
    if tuple(layout) != SHUFFLE_LAYOUT:
        raise ValueError(f"{what}: only layout {SHUFFLE_LAYOUT} is supported, got {layout}")
    if t.dim() < 2:
        raise ValueError(f"{what} needs a tensor of at least 2 dims, got shape {tuple(t.shape)}")
    n, k = t.shape[-2], t.shape[-1]
    if n % 16 or k % 32:
        raise ValueError(
            f"{what}: shape [..., {n}, {k}] needs N % 16 == 0 and K % 32 == 0 (in elements)"
        )
    return n, k, _tile_cols(t.element_size())


def _swap_tile_axes(t: Tensor, split: tuple[int, int, int, int]) -> Tensor:
    """View the last two dims as ``split``, swap its two middle axes, return a contiguous copy.

    Done on an integer view of the bits so that it is a pure byte permutation for every dtype.
    """
    bits = t.view(_BITS_VIEW[t.element_size()])
    lead = bits.shape[:-2]
    out = bits.reshape(*lead, *split).transpose(-3, -2).contiguous()
    return out.reshape(bits.shape).view(t.dtype)


def shuffle_weight(w: Tensor, layout: tuple[int, int] = SHUFFLE_LAYOUT) -> Tensor:
    """AITER ``shuffle_weight``: store 16 x P tiles in row-major tile order (same shape/dtype).

    [N, K] -> view [N/16, 16, K/P, P] -> swap middle axes -> [N/16, K/P, 16, P] -> [N, K].
    """
    n, k, p = _check_shuffle_args(w, layout, "shuffle_weight")
    return _swap_tile_axes(w, (n // 16, 16, k // p, p))


def unshuffle_weight(s: Tensor, layout: tuple[int, int] = SHUFFLE_LAYOUT) -> Tensor:
    """Inverse of :func:`shuffle_weight`: recovers the canonical [N, K] weight exactly."""
    n, k, p = _check_shuffle_args(s, layout, "unshuffle_weight")
    return _swap_tile_axes(s, (n // 16, k // p, 16, p))


def shuffled_index(
    n: Tensor | int, k: Tensor | int, N: int, K: int, elem_size: int
) -> Tensor | int:
    """Flat position of ``W[n, k]`` in the shuffled buffer (A.4's forward-mapping formula).

    ``((n // 16) * (K / P) + k // P) * 16P + (n % 16) * P + k % P``; an independent statement of
    the layout used to check :func:`shuffle_weight`. ``N`` does not enter the formula; it is taken
    so that call sites name the whole shape.
    """
    p = _tile_cols(elem_size)
    return ((n // 16) * (K // p) + k // p) * (16 * p) + (n % 16) * p + k % p


def per_token_group_quant_fp8(
    x: Tensor,
    group: int = QUANT_GROUP,
    fp8_max: float = FP8_E4M3_MAX,
    transpose_scale: bool = True,
    quant_dtype: torch.dtype = torch.float8_e4m3fn,
    official: bool = False,
) -> tuple[Tensor, Tensor]:
    """AITER per-token group FP8 quantisation (A.5): fp32 scale ``max(1e-10, amax) / fp8_max``.

    The scale is NOT a power of two (unlike the official quantiser, which ``official`` selects:
    ``2^ceil(log2(max(amax, 1e-4) / fp8_max))``, docs/spec.md §6.3). With
    ``transpose_scale`` the scale has logical shape [M, K/group] but column-major storage
    (strides (1, M)), which is what the preshuffled GEMM requires.
    """
    if x.dim() != 2:
        raise ValueError(f"per_token_group_quant_fp8 needs x [M, K], got shape {tuple(x.shape)}")
    m, k = x.shape
    if group <= 0 or k % group:
        raise ValueError(f"per_token_group_quant_fp8: K={k} must be a multiple of group={group}")
    xf = x.to(torch.float32).reshape(m, k // group, group)
    if official:
        scale = pow2_block_scale(xf, FP8_AMAX_FLOOR, fp8_max)
    else:
        amax = xf.abs().amax(dim=-1, keepdim=True).clamp_min(AMAX_FLOOR)
        scale = amax / fp8_max
    # |x * (1/s)| <= fp8_max up to one rounding; the clamp only saturates that last ulp.
    x_q = (xf * (1.0 / scale)).clamp(-fp8_max, fp8_max).to(quant_dtype).reshape(m, k)
    scale = scale.reshape(m, k // group)
    if transpose_scale:  # explicit strides: .t().contiguous().t() keeps row-major when M == 1
        scale = torch.empty_strided((m, k // group), (1, m), device=x.device).copy_(scale)
    return x_q, scale


def _is_column_major(t: Tensor) -> bool:
    """Strides (1, M) for a 2-D [M, G] tensor; size-1 dims may carry any stride."""
    m, g = t.shape
    return (m == 1 or t.stride(0) == 1) and (g == 1 or t.stride(1) == m)


def blockscale_gemm_preshuffled(
    x_q: Tensor,
    w_shuffled: Tensor,
    x_scale: Tensor,
    w_scale: Tensor,
    out_dtype: torch.dtype,
) -> Tensor:
    """AITER ``gemm_a8w8_blockscale_bpreshuffle`` reference (A.6), computed in float32.

    ``Y[m, n] = sum_k (x_q[m, k] x_s[m, k // 128]) (W[n, k] w_s[n // 128, k // 128])`` with
    W = unshuffle(w_shuffled). ``w_scale`` may be fp32 or E8M0 (upcast, as vLLM does before
    dispatch).
    """
    if x_q.dim() != 2 or w_shuffled.dim() != 2:
        raise ValueError(
            f"blockscale GEMM needs 2-D x_q and weight, got {tuple(x_q.shape)} and "
            f"{tuple(w_shuffled.shape)}"
        )
    m, k = x_q.shape
    n, kw = w_shuffled.shape
    if kw != k:
        raise ValueError(f"blockscale GEMM: x_q has K={k} but the weight has K={kw}")
    if k % QUANT_GROUP:
        raise ValueError(f"blockscale GEMM: K={k} must be a multiple of {QUANT_GROUP}")
    groups = k // QUANT_GROUP
    if x_scale.dim() != 2 or tuple(x_scale.shape) != (m, groups):
        raise ValueError(
            f"blockscale GEMM: x_scale has shape {tuple(x_scale.shape)}, expected ({m}, {groups})"
        )
    if not _is_column_major(x_scale):
        raise ValueError(
            f"blockscale GEMM: x_scale must be column-major (strides (1, {m})), got strides "
            f"{x_scale.stride()}; quantise with transpose_scale=True"
        )
    w_groups = (-(-n // QUANT_GROUP), groups)
    if w_scale.dim() != 2 or tuple(w_scale.shape) != w_groups:
        raise ValueError(
            f"blockscale GEMM: w_scale has shape {tuple(w_scale.shape)}, expected {w_groups}"
        )
    w = dequantize_fp8_block(unshuffle_weight(w_shuffled), w_scale, torch.float32)
    xs = x_scale.to(torch.float32).repeat_interleave(QUANT_GROUP, dim=1)
    x = x_q.to(torch.float32) * xs
    return (x @ w.t()).to(out_dtype)
