"""Float-bit helpers the Triton kernels share: powers of two and power-of-two scale exponents
taken from the float32 bits (never a floating ``log2``, as :func:`dsv4.layers.fp8.ceil_log2`),
UE8M0 scale bytes decoded from the bits, round-to-nearest-even to bf16 on the bits, and the
fp8 / fp4 quantisers' constants as constexpr globals. Triton is imported guarded."""

from __future__ import annotations

from dsv4.kernels.fused_input_proj import triton_available
from dsv4.layers.fp8 import FP8_AMAX_FLOOR, FP8_E4M3_MAX
from dsv4.layers.quant_sim import FP4_AMAX_FLOOR, FP4_E2M1_MAX

if triton_available():
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    FP8_MAX = tl.constexpr(FP8_E4M3_MAX)
    FP8_FLOOR = tl.constexpr(FP8_AMAX_FLOOR)
    FP4_MAX = tl.constexpr(FP4_E2M1_MAX)
    FP4_FLOOR = tl.constexpr(FP4_AMAX_FLOOR)

    @triton.jit
    def pow2(k):
        """2^k as float32 for an int32 k in the normal range [-126, 127], from the bits."""
        return ((k + 127) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def ue8m0(b):
        """2^(b - 127) as float32 for UE8M0 scale bytes ``b`` (int32), from the bits: exact,
        byte 0 the subnormal 2^-127. Byte 255 (the format's NaN) gives +inf here; a caller
        that must see NaN checks it."""
        v = (b << 23).to(tl.float32, bitcast=True)
        return tl.where(b == 0, 5.877471754111438e-39, v)

    @triton.jit
    def ceil_log2(x):
        """ceil(log2(x)) of a positive normal float32 x, from its exponent and mantissa bits."""
        bits = x.to(tl.int32, bitcast=True)
        return ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)

    @triton.jit
    def scale_exponent(amax, FLOOR: tl.constexpr, QMAX: tl.constexpr):
        """k of the power-of-two scale 2^k = 2^ceil(log2(max(amax, FLOOR) * (1 / QMAX))), the
        official simulations' rule (the product in float32, as theirs)."""
        return ceil_log2(tl.maximum(amax, FLOOR) * (1.0 / QMAX))

    @triton.jit
    def rint(x, LIBDEVICE: tl.constexpr):
        """x (|x| < 2^22) rounded to an integer, ties to even: libdevice's ``rint`` on a GPU;
        without it (Triton's CPU interpreter), NumPy's fp32 add rounds to nearest even, and
        1.5 * 2^23 leaves no fraction bits."""
        if LIBDEVICE:
            return libdevice.rint(x)
        else:
            return (x + 12582912.0) - 12582912.0

    @triton.jit
    def round_minifloat(y, MANT: tl.constexpr, MIN_EXP: tl.constexpr, LIBDEVICE: tl.constexpr):
        """float32 y rounded to a float format of MANT mantissa bits and smallest normal
        2^MIN_EXP, as float32 (ties to even, subnormals included, no saturation: clamp first):
        scaled so that the grid step is 1, rounded, scaled back (both scalings exact). E4M3:
        MANT 3, MIN_EXP -6."""
        e = tl.maximum(((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, MIN_EXP)
        return rint(y * pow2(MANT - e), LIBDEVICE) * pow2(e - MANT)

    @triton.jit
    def rounded(x, dtype: tl.constexpr):
        """fp32 x rounded to ``dtype`` (to nearest, ties to even), still as fp32. bf16 is rounded
        on the bits: Triton's CPU interpreter truncates fp32 -> bf16 casts, the GPU rounds; this
        way both give the torch result (and the cast of the rounded value is exact)."""
        if dtype == tl.bfloat16:
            b = x.to(tl.int32, bitcast=True)
            b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
            return b.to(tl.float32, bitcast=True)
        else:
            return x.to(dtype).to(tl.float32)
