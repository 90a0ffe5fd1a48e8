"""Float-bit helpers the Triton kernels share: powers of two and power-of-two scale exponents
taken from the float32 bits (never a floating ``log2``, as :func:`dsv4.layers.fp8.ceil_log2`),
UE8M0 scale bytes decoded from the bits, round-to-nearest-even to bf16 on the bits, e4m3 bytes
from the bits (the paged stores and pre-quantised GEMM activations), and the
fp8 / fp4 quantisers' constants as constexpr globals. Triton is imported guarded."""

from __future__ import annotations

from dsv4.layers.fp8 import FP8_AMAX_FLOOR, FP8_E4M3_MAX
from dsv4.layers.quant_sim import FP4_AMAX_FLOOR, FP4_E2M1_MAX

try:  # guarded here too (not via fused_input_proj, which imports this module's helpers)
    import triton as _triton  # noqa: F401

    _HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the machine
    _HAVE_TRITON = False

if _HAVE_TRITON:
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

    @triton.jit
    def act_quant_block(xt, AXIS: tl.constexpr, EMULATE: tl.constexpr):
        """The official activation quantisation (docs/spec.md §6.3) of one 128-wide K
        block of x, fp32 ``xt``, each token's 128 values along ``AXIS``: (q, sigma) with
        sigma = 2^ceil(log2(max(amax, 1e-4) / 448)) per token and q = e4m3(clamp(x / sigma,
        +-448)) rounded to nearest even - as float8e4nv for an fp8 MMA, or (EMULATE, Triton's
        CPU interpreter, which has no fp8 arithmetic) the same value as float32."""
        k = scale_exponent(tl.max(tl.abs(xt), axis=AXIS), FP8_FLOOR, FP8_MAX)
        y = xt * pow2(-k)[None, :] if AXIS == 0 else xt * pow2(-k)[:, None]
        y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
        # interpreted: e4m3's grid as float32, subnormals included
        q = round_minifloat(y, 3, -6, False) if EMULATE else y.to(tl.float8e4nv)
        return q, pow2(k)

    @triton.jit
    def minifloat_code(y, MANT: tl.constexpr, MIN_EXP: tl.constexpr):
        """The magnitude code (no sign bit) of float32 ``y`` rounded to a float format of MANT
        mantissa bits and smallest normal 2^MIN_EXP, ties to even, subnormals included; no
        saturation (clamp first). Integer arithmetic on the bits:
        the 24-bit significand shifted right by 23 - MANT (normal) plus the subnormal distance,
        rounded to nearest even; the exponent field added after (a carry into it is right)."""
        a = y.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        ef = a >> 23
        e = tl.maximum(ef, 1) - 127
        m = (a & 0x7FFFFF) | tl.where(ef != 0, 0x800000, 0)
        s = tl.minimum(23 - MANT + tl.maximum(MIN_EXP - e, 0), 30)  # >= 20; 30: all to 0
        one = tl.zeros_like(s) + 1
        q = m >> s
        rem = m & ((one << s) - 1)
        half = one << (s - 1)
        up = (rem > half) | ((rem == half) & ((q & 1) == 1))
        q = q + up.to(tl.int32)
        return q + (tl.maximum(e - MIN_EXP, 0) << MANT)

    @triton.jit
    def sign_bit(y):
        """1 where float32 ``y`` has its sign bit set (-0.0 included), else 0 (int32)."""
        return (y.to(tl.int32, bitcast=True) >> 31) & 1

    @triton.jit
    def e4m3_bytes(x, k):
        """E4M3 bytes (int32) of x [T, C] scaled by 2^-k [T], clamped to +-448, RNE."""
        y = x * pow2(-k)[:, None]
        y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
        return minifloat_code(y, 3, -6) | (sign_bit(y) << 7)
