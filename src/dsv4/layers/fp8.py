"""FP8 block-scaled weights: E8M0 scales, block dequantisation and quantisation.

Checkpoint format (docs/spec.md §3.2): an E4M3 weight [N, K] and an E8M0 scale
[ceil(N/128), ceil(K/128)]; the real weight is ``fp8(Wq[n, k]) * 2^(S[n//128, k//128] - 127)``.
The scale **multiplies** (vLLM's name ``weight_scale_inv`` notwithstanding).

The exact helpers here (``ceil_log2``, ``round_minifloat``) are shared with
:mod:`dsv4.layers.quant_sim`; they avoid floating-point ``log2`` and double rounding so that the
simulations are bit-exact in float32 and float64 alike. All functions are pure and device-agnostic.
"""

from __future__ import annotations

import torch
from torch import Tensor

FP8_E4M3_MAX = 448.0
"""Largest finite ``float8_e4m3fn`` magnitude (OCP E4M3)."""
FP8_E4M3FNUZ_MAX = 240.0
"""Largest finite ``float8_e4m3fnuz`` magnitude (gfx942)."""
FP8_AMAX_FLOOR = 1e-4
"""amax floor of the official power-of-two FP8 quantiser (OFF-KERNEL ``act_quant``)."""
E4M3_MANTISSA_BITS = 3
E4M3_MIN_NORMAL_EXP = -6
E8M0_BIAS = 127
E8M0_NAN_BYTE = 255

_FP8_DTYPES = (
    torch.float8_e4m3fn,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2,
    torch.float8_e5m2fnuz,
)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else (bf16, fp16, fp32, fp8) is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def ceil_log2(t: Tensor) -> Tensor:
    """Exact ``ceil(log2(t))`` for positive finite ``t`` as int32.

    Uses the float's exponent and mantissa (like the official ``fast_log2_ceil``) instead of
    ``torch.log2``, whose rounding can push an exact power of two to the next exponent.
    """
    mantissa, exponent = torch.frexp(t)  # t = mantissa * 2^exponent, mantissa in [0.5, 1)
    return exponent - (mantissa == 0.5).to(exponent.dtype)


def pow2(exponent: Tensor, dtype: torch.dtype) -> Tensor:
    """``2^exponent`` for an integer tensor, exact in ``dtype``'s normal and subnormal range."""
    return torch.exp2(exponent.to(dtype))


def round_minifloat(y: Tensor, mantissa_bits: int, min_normal_exp: int) -> Tensor:
    """Round ``y`` to the nearest value of a small float format, ties to even, in y's dtype.

    The format has ``mantissa_bits`` explicit mantissa bits and smallest normal ``2^min_normal_exp``
    (subnormals below it). No saturation: clamp ``y`` to the format's range first. Done as one
    rounding step in y's dtype, so float64 inputs are not double-rounded through float32 (which
    ``Tensor.to(float8)`` does).
    """
    _, exponent = torch.frexp(y.abs())  # |y| in [2^(e-1), 2^e)
    exponent = exponent.clamp_min(min_normal_exp + 1)
    step = pow2(exponent - 1 - mantissa_bits, y.dtype)
    return torch.round(y / step) * step  # torch.round is round-half-to-even


def round_e4m3(y: Tensor) -> Tensor:
    """Round to the nearest ``float8_e4m3fn`` value (ties to even), staying in y's dtype.

    ``y`` must already be clamped to ±448. float32 and narrower use the native cast; float64 uses
    the exact emulation to avoid double rounding.
    """
    if y.dtype == torch.float64:
        return round_minifloat(y, E4M3_MANTISSA_BITS, E4M3_MIN_NORMAL_EXP)
    return y.to(torch.float8_e4m3fn).to(y.dtype)


def e8m0_to_float(scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Decode an E8M0 scale (byte e means ``2^(e-127)``, 255 is NaN) or cast a float scale.

    Decoded from the raw bytes, so it does not depend on a backend supporting e8m0 casts.
    """
    if scale.dtype == torch.float8_e8m0fnu:
        byte = scale.view(torch.uint8)
        value = pow2(byte.to(torch.int32) - E8M0_BIAS, compute_dtype(dtype))
        value = torch.where(byte == E8M0_NAN_BYTE, torch.full_like(value, float("nan")), value)
        return value.to(dtype)
    if not scale.is_floating_point():
        raise TypeError(f"block scale must be float8_e8m0fnu or floating point, got {scale.dtype}")
    return scale.to(dtype)


def float_to_e8m0(exponent: Tensor) -> Tensor:
    """Encode integer exponents k (``2^k``) as ``float8_e8m0fnu`` bytes ``k + 127``."""
    if bool(((exponent < -E8M0_BIAS) | (exponent > E8M0_NAN_BYTE - 1 - E8M0_BIAS)).any()):
        raise ValueError("exponent outside the E8M0 range [-127, 127]")
    return (exponent + E8M0_BIAS).to(torch.uint8).view(torch.float8_e8m0fnu)


def _check_block(block: tuple[int, int]) -> tuple[int, int]:
    if len(block) != 2 or any(int(b) <= 0 for b in block):
        raise ValueError(f"block must be two positive ints, got {block}")
    return int(block[0]), int(block[1])


def _expand_blocks(scale: Tensor, shape: tuple[int, int], block: tuple[int, int]) -> Tensor:
    """Broadcast a per-block tensor [ceil(N/bn), ceil(K/bk)] to [N, K] (ragged edges cropped)."""
    bn, bk = block
    full = scale.repeat_interleave(bn, dim=0).repeat_interleave(bk, dim=1)
    return full[: shape[0], : shape[1]]


def dequantize_fp8_block(
    weight: Tensor,
    scale: Tensor,
    dtype: torch.dtype,
    block: tuple[int, int] = (128, 128),
) -> Tensor:
    """``W[n, k] = float(weight[n, k]) * scale[n // bn, k // bk]`` (the scale multiplies).

    Exact in float32/bf16 for every realistic scale (an E4M3 value times a power of two keeps
    its 4 significant bits), so a reference can dequantise once at load.
    """
    bn, bk = _check_block(block)
    if weight.dim() != 2:
        raise ValueError(f"fp8 weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    if scale.dim() != 2:
        raise ValueError(f"fp8 block scale must be 2-D, got shape {tuple(scale.shape)}")
    n, k = weight.shape
    expected = (-(-n // bn), -(-k // bk))
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"fp8 block scale has shape {tuple(scale.shape)}, expected {expected} for a weight of "
            f"shape [{n}, {k}] with block ({bn}, {bk})"
        )
    if not (weight.dtype in _FP8_DTYPES or weight.is_floating_point()):
        raise TypeError(f"fp8 weight must be a float8 or floating tensor, got {weight.dtype}")
    if n % bn or k % bk:  # ragged edge blocks: expand the scale and crop
        cdt = compute_dtype(dtype)
        s = e8m0_to_float(scale, cdt)
        return (weight.to(cdt) * _expand_blocks(s, (n, k), (bn, bk))).to(dtype)
    # Whole blocks: broadcast the scale over a [N/bn, bn, K/bk, bk] view (no expanded copy).
    # An fp8 weight with an E8M0 (power-of-two) scale dequantised to bf16 is computed in bf16:
    # both factors are exact in bf16 and the product keeps the E4M3 value's 4 significant bits,
    # so it equals the float32 product rounded to bf16, in 2 passes over the weight instead of 4.
    direct = (dtype == torch.bfloat16 and weight.dtype == torch.float8_e4m3fn
              and scale.dtype == torch.float8_e8m0fnu)
    cdt = dtype if direct else compute_dtype(dtype)
    s = e8m0_to_float(scale, cdt)[:, None, :, None]
    blocks = weight.view(n // bn, bn, k // bk, bk).to(cdt) * s
    return blocks.view(n, k).to(dtype)


def quantize_fp8_block(w: Tensor, block: tuple[int, int] = (128, 128)) -> tuple[Tensor, Tensor]:
    """Quantise a 2-D weight to (E4M3 weight, E8M0 block scale), the checkpoint format.

    Per block: ``scale = 2^ceil(log2(max(amax, 1e-4) / 448))`` and
    ``q = e4m3(clamp(w / scale, ±448))``. Power-of-two scales make the division exact, so
    ``quantize(dequantize(q, s)) == (q, s)`` whenever each block of q reaches above 224.
    """
    bn, bk = _check_block(block)
    if w.dim() != 2:
        raise ValueError(f"weight to quantise must be 2-D [N, K], got shape {tuple(w.shape)}")
    if not w.is_floating_point():
        raise TypeError(f"weight to quantise must be floating point, got {w.dtype}")
    n, k = w.shape
    gn, gk = -(-n // bn), -(-k // bk)
    cdt = compute_dtype(w.dtype)
    x = w.to(cdt)
    padded = torch.zeros(gn * bn, gk * bk, dtype=cdt, device=w.device)
    padded[:n, :k] = x
    amax = padded.abs().view(gn, bn, gk, bk).amax(dim=(1, 3))
    exponent = ceil_log2(amax.clamp_min(FP8_AMAX_FLOOR) / FP8_E4M3_MAX)
    sigma = _expand_blocks(pow2(exponent, cdt), (n, k), (bn, bk))
    q = round_e4m3((x / sigma).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX))
    return q.to(torch.float8_e4m3fn), float_to_e8m0(exponent)
