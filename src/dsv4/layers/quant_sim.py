"""The official DSV4 quantisation simulations (quant-dequant), docs/spec.md §6.1 and §6.2.

The official model stores the KV nope dims as FP8 block-64 and the indexer vectors as
Hadamard-rotated FP4 block-32; a bf16 reference must reproduce that rounding to match it. Each
function returns a tensor of the input's dtype, computed in float32 (bf16/fp16/fp32 inputs) or in
float64 (float64 inputs). Scale exponents come from the float's bits, never from ``log2``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dsv4.layers.fp8 import (
    FP8_AMAX_FLOOR,
    FP8_E4M3_MAX,
    ceil_log2,
    compute_dtype,
    pow2,
    round_e4m3,
    round_minifloat,
)

FP4_E2M1_MAX = 6.0
"""Largest E2M1 magnitude; the grid is {0, 0.5, 1, 1.5, 2, 3, 4, 6}."""
FP4_AMAX_FLOOR = 6.0 * 2.0**-126
"""amax floor of the official FP4 quantiser: keeps the scale a normal float32 power of two."""
E2M1_MANTISSA_BITS = 1
E2M1_MIN_NORMAL_EXP = 0


def _blocks(x: Tensor, block: int, what: str) -> Tensor:
    """View the last dim as [..., n // block, block] in the compute dtype."""
    if not x.is_floating_point():
        raise TypeError(f"{what} needs a floating-point input, got {x.dtype}")
    if block <= 0 or x.dim() == 0 or x.shape[-1] % block != 0:
        shape = tuple(x.shape)
        raise ValueError(f"{what}: last dim of shape {shape} must be a multiple of block={block}")
    return x.to(compute_dtype(x.dtype)).reshape(*x.shape[:-1], x.shape[-1] // block, block)


def pow2_block_scale(blocks: Tensor, floor: float, qmax: float) -> Tensor:
    """``2^ceil(log2(max(amax, floor) * (1/qmax)))`` per block, shape [..., nblocks, 1].

    Multiplies by the reciprocal like the official kernel (``amax * fp8_max_inv``): the bits of
    that product decide the exponent.
    """
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp_min(floor)
    # a Python scalar multiplies in amax's dtype (fp32 x fp32(1/qmax), as the official kernel);
    # unlike new_tensor it needs no host-to-device copy (CUDA-graph capturable)
    return pow2(ceil_log2(amax * (1.0 / qmax)), blocks.dtype)


def fp8_block_quantize(x: Tensor, block: int, what: str = "fp8_block_quantize"
                       ) -> tuple[Tensor, Tensor]:
    """x's last dim in blocks of ``block`` values quantised to E4M3 with a power-of-two scale
    each: (the e4m3 values [..., nblocks, block], the scales [..., nblocks, 1]), both in x's
    compute dtype; ``what`` names the caller in a shape error."""
    v = _blocks(x, block, what)
    sigma = pow2_block_scale(v, FP8_AMAX_FLOOR, FP8_E4M3_MAX)
    return round_e4m3((v / sigma).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)), sigma


def fp8_block_sim(x: Tensor, block: int = 64) -> Tensor:
    """FP8 E4M3 quant-dequant with a power-of-two (UE8M0) scale per ``block`` values (§6.1).

    Applied by the official model to the KV nope dims; matches the ``fp8_ds_mla`` cache format.
    """
    q, sigma = fp8_block_quantize(x, block, "fp8_block_sim")
    return (q * sigma).reshape(x.shape).to(x.dtype)


INDEX_FP8_BLOCK = 128
"""Values per scale of the engines' fp8 indexer keys (one scale per 128-vector)."""


def index_fp8_sim(x: Tensor) -> Tensor:
    """The engines' fp8 indexer-key numerics: E4M3 with a power-of-two scale per 128 values.

    Not an official simulation: vLLM's DeepSeek-V4 ``fp8`` indexer cache stores unrotated keys
    (no Hadamard) as E4M3 with ``scale = 2^ceil(log2(max(amax, 1e-4) * (1/448)))`` per 128-vector,
    the rule of :func:`fp8_block_sim` at block 128. It is exactly what the ``fp8`` index row
    format (:mod:`dsv4.cache.formats`) stores, so a row written and read back equals this.
    """
    q, sigma = fp8_block_quantize(x, INDEX_FP8_BLOCK, "index_fp8_sim")
    return (q * sigma).reshape(x.shape).to(x.dtype)


def round_e2m1(y: Tensor) -> Tensor:
    """Round to the FP4 E2M1 grid ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}, ties to even; no saturation."""
    return round_minifloat(y, E2M1_MANTISSA_BITS, E2M1_MIN_NORMAL_EXP)


def fp4_block_sim(x: Tensor, block: int = 32) -> Tensor:
    """FP4 E2M1 quant-dequant with a power-of-two scale per ``block`` values (§6.2)."""
    v = _blocks(x, block, "fp4_block_sim")
    sigma = pow2_block_scale(v, FP4_AMAX_FLOOR, FP4_E2M1_MAX)
    q = round_e2m1((v / sigma).clamp(-FP4_E2M1_MAX, FP4_E2M1_MAX))
    return (q * sigma).reshape(x.shape).to(x.dtype)


def hadamard_rotate(x: Tensor) -> Tensor:
    """``v <- H_n v / sqrt(n)`` over the last dim, H_n the Sylvester (natural-order) Hadamard.

    Orthogonal, so dot products are unchanged in exact arithmetic; it only spreads outliers
    before FP4 rounding. A fast Walsh-Hadamard transform: log2(n) butterfly stages.
    """
    if not x.is_floating_point():
        raise TypeError(f"hadamard_rotate needs a floating-point input, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("hadamard_rotate needs at least one dim")
    n = x.shape[-1]
    if n <= 0 or n & (n - 1):
        raise ValueError(f"hadamard_rotate: last dim {n} must be a power of two")
    lead = x.shape[:-1]
    v = x.to(compute_dtype(x.dtype)).reshape(-1, n)
    h = 1
    while h < n:
        # H_2h = [[H_h, H_h], [H_h, -H_h]] on each group of 2h consecutive entries.
        pairs = v.view(-1, n // (2 * h), 2, h)
        a, b = pairs[:, :, 0, :], pairs[:, :, 1, :]
        v = torch.stack((a + b, a - b), dim=2).reshape(-1, n)
        h *= 2
    return (v * (n**-0.5)).reshape(*lead, n).to(x.dtype)


def indexer_quant_sim(x: Tensor) -> Tensor:
    """The indexer's simulation: Hadamard rotation (result in x's dtype), then FP4 block-32."""
    return fp4_block_sim(hadamard_rotate(x))


INDEX_NUMERICS = ("hadamard_fp4", "fp8")
"""The indexer's simulated numerics: the official Hadamard + FP4, or the engines' fp8 (e4m3 with
a power-of-two scale per 128-vector, no Hadamard)."""


def index_numerics_sim(x: Tensor, numerics: str | None) -> Tensor:
    """Apply the indexer numerics ``numerics`` (one of :data:`INDEX_NUMERICS`, or None: none)
    to indexer queries or keys."""
    if numerics is None:
        return x
    if numerics == "hadamard_fp4":
        return indexer_quant_sim(x)
    if numerics == "fp8":
        return index_fp8_sim(x)
    raise ValueError(f"unknown indexer numerics {numerics!r}; valid: {list(INDEX_NUMERICS)}")
