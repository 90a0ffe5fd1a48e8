"""FP8 block-scaled weights: E8M0 decoding, exact helpers, dequantise/quantise round trips."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4.layers.fp8 import (
    FP8_E4M3_MAX,
    ceil_log2,
    dequantize_fp8_block,
    e8m0_to_float,
    quantize_fp8_block,
    round_e4m3,
)

FAST = settings(max_examples=30, deadline=None)


def e4m3_table() -> tuple[torch.Tensor, torch.Tensor]:
    """All non-negative finite E4M3FN values (decoded from the bit layout) and their bytes."""
    values, codes = [], []
    for b in range(0x7F):  # 0x7F is NaN
        e, m = b >> 3, b & 7
        values.append(m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
        codes.append(b)
    return torch.tensor(values, dtype=torch.float64), torch.tensor(codes)


def nearest_e4m3(y: torch.Tensor) -> torch.Tensor:
    """Brute-force round-to-nearest-even onto the E4M3 grid, in float64 (the oracle)."""
    vals, codes = e4m3_table()
    y = y.to(torch.float64)
    d = (y.abs().unsqueeze(-1) - vals).abs()
    cand = d == d.min(dim=-1, keepdim=True).values
    even = cand & (codes % 2 == 0)
    idx = torch.where(even.any(-1), even.to(torch.int8).argmax(-1), cand.to(torch.int8).argmax(-1))
    return torch.sign(y) * vals[idx]


def py_ceil_log2(x: float) -> int:
    """ceil(log2(x)) from Python's exact frexp (independent of the code under test)."""
    m, e = math.frexp(x)
    return e - 1 if m == 0.5 else e


def random_fp8(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random finite E4M3FN bytes (NaN patterns 0x7F/0xFF excluded)."""
    b = torch.randint(0, 0x7F, shape, generator=gen, dtype=torch.int32)
    sign = torch.randint(0, 2, shape, generator=gen, dtype=torch.int32) << 7
    return (b | sign).to(torch.uint8).view(torch.float8_e4m3fn)


# ---------------------------------------------------------------- E8M0 and exact helpers


def test_e8m0_decodes_every_byte() -> None:
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = e8m0_to_float(b.view(torch.float8_e8m0fnu), torch.float64)
    want = [math.ldexp(1.0, i - 127) for i in range(255)]
    assert got[:255].tolist() == want
    assert math.isnan(got[255].item())
    got32 = e8m0_to_float(b.view(torch.float8_e8m0fnu))
    assert got32.dtype == torch.float32
    assert torch.equal(got32[:255], got[:255].to(torch.float32))


def test_e8m0_accepts_float_scale_and_rejects_integers() -> None:
    s = torch.tensor([0.5, 3.0], dtype=torch.float32)
    assert torch.equal(e8m0_to_float(s, torch.float64), s.double())
    with pytest.raises(TypeError):
        e8m0_to_float(torch.tensor([1, 2]))


def test_ceil_log2_exact_at_and_around_powers_of_two() -> None:
    for dtype, lo, hi in ((torch.float32, -149, 127), (torch.float64, -1074, 1023)):
        k = torch.arange(lo, hi + 1)
        p = torch.exp2(k.to(dtype))
        assert torch.equal(ceil_log2(p), k.to(torch.int32))
        up = torch.nextafter(p, torch.full_like(p, math.inf))
        assert torch.equal(ceil_log2(up[:-1]), (k + 1).to(torch.int32)[:-1])
        down = torch.nextafter(p, torch.zeros_like(p))  # below 2^(lo+1) is 2^lo itself: skip
        assert torch.equal(ceil_log2(down[2:]), k.to(torch.int32)[2:])


@FAST
@given(st.lists(st.floats(2.0**-126, 2.0**126, width=32), min_size=1, max_size=50))
def test_ceil_log2_matches_math(xs: list[float]) -> None:
    want = [py_ceil_log2(x) for x in xs]
    assert ceil_log2(torch.tensor(xs, dtype=torch.float32)).tolist() == want


def test_round_e4m3_matches_oracle_on_midpoints_and_neighbours() -> None:
    vals, _ = e4m3_table()
    mids = (vals[1:] + vals[:-1]) / 2
    y = torch.cat([vals, mids, torch.nextafter(mids, mids * 2), torch.nextafter(mids, mids * 0)])
    y = torch.cat([y, -y])
    want = nearest_e4m3(y)
    assert torch.equal(round_e4m3(y), want)  # float64: exact emulation
    y32 = y.to(torch.float32)
    assert torch.equal(round_e4m3(y32).double(), nearest_e4m3(y32))  # float32: native cast


def test_round_e4m3_float64_is_not_double_rounded() -> None:
    y = torch.tensor([1.0625 + 1e-12, 1.0625 - 1e-12, 1.0625, 1.1875], dtype=torch.float64)
    assert round_e4m3(y).tolist() == [1.125, 1.0, 1.0, 1.25]


# ---------------------------------------------------------------- dequantisation


@FAST
@given(
    n=st.integers(1, 300),
    k=st.integers(1, 300),
    block=st.sampled_from([(128, 128), (16, 32), (7, 5)]),
    float_scale=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_dequantize_matches_elementwise_definition(
    n: int, k: int, block: tuple[int, int], float_scale: bool, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    w = random_fp8((n, k), gen)
    gn, gk = -(-n // block[0]), -(-k // block[1])
    sbytes = torch.randint(127 - 20, 127 + 20, (gn, gk), generator=gen, dtype=torch.int32)
    scale = sbytes.to(torch.uint8).view(torch.float8_e8m0fnu)
    if float_scale:
        scale = torch.exp2((sbytes - 127).to(torch.float32))
    rows = torch.arange(n)[:, None] // block[0]
    cols = torch.arange(k)[None, :] // block[1]
    want = w.to(torch.float64) * torch.exp2((sbytes[rows, cols] - 127).to(torch.float64))
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        got = dequantize_fp8_block(w, scale, dtype, block)
        assert got.dtype == dtype and got.shape == (n, k)
        assert torch.equal(got.double(), want)  # exact: e4m3 times 2^e fits bf16


def test_dequantize_to_bf16_equals_float32_rounded_over_the_whole_scale_range() -> None:
    """The bf16 fast path (computed in bf16 for whole blocks) gives the bits of the float32
    product rounded once to bf16, for every E8M0 byte (tiny, huge, NaN) and every E4M3 value."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randint(0, 256, (256, 4096), generator=gen, dtype=torch.int32)
    w = w.to(torch.uint8).view(torch.float8_e4m3fn)  # 2 x 32 blocks, every byte many times
    sbytes = torch.cat([torch.arange(0, 32), torch.arange(223, 255)]).to(torch.uint8)
    scale = sbytes.reshape(2, 32).contiguous().view(torch.float8_e8m0fnu)
    scale[1, 5] = torch.tensor(255, dtype=torch.uint8).view(torch.float8_e8m0fnu)  # NaN
    got = dequantize_fp8_block(w, scale, torch.bfloat16)
    want = dequantize_fp8_block(w, scale, torch.float32).to(torch.bfloat16)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan) and nan.any()
    assert got.isinf().any() and (got == 0).any()  # the range's ends were reached
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


def test_dequantize_scale_multiplies() -> None:
    w = torch.full((128, 128), 3.0).to(torch.float8_e4m3fn)
    s = torch.tensor([[130]], dtype=torch.uint8).view(torch.float8_e8m0fnu)  # 2^3
    assert torch.all(dequantize_fp8_block(w, s, torch.float32) == 24.0)


@pytest.mark.parametrize(
    ("wshape", "sshape"),
    [((256, 200), (2, 1)), ((256, 256), (2, 3)), ((256,), (2, 2)), ((256, 256), (4,))],
)
def test_dequantize_rejects_bad_shapes(wshape: tuple[int, ...], sshape: tuple[int, ...]) -> None:
    w = torch.zeros(wshape).to(torch.float8_e4m3fn)
    s = torch.ones(sshape)
    with pytest.raises(ValueError, match="shape"):
        dequantize_fp8_block(w, s, torch.float32)


def test_dequantize_rejects_bad_block() -> None:
    with pytest.raises(ValueError, match="block"):
        dequantize_fp8_block(torch.zeros(4, 4), torch.ones(1, 1), torch.float32, (0, 128))


# ---------------------------------------------------------------- quantisation


@FAST
@given(
    n=st.integers(1, 300),
    k=st.integers(1, 300),
    shift=st.integers(-12, 12),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
    seed=st.integers(0, 2**31 - 1),
)
def test_quantize_then_dequantize_is_close(
    n: int, k: int, shift: int, dtype: torch.dtype, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen, dtype=torch.float64) * 2.0**shift).to(dtype)
    q, s = quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (n, k)
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (-(-n // 128), -(-k // 128))
    w64 = w.double()
    blocks = torch.zeros(s.shape[0] * 128, s.shape[1] * 128, dtype=torch.float64)
    blocks[:n, :k] = w64.abs()
    amax = blocks.view(s.shape[0], 128, s.shape[1], 128).amax(dim=(1, 3))
    sigma = e8m0_to_float(s, torch.float64)
    want_exp = [[py_ceil_log2(max(a, 1e-4) / 448.0) for a in row] for row in amax.tolist()]
    assert torch.equal(sigma, torch.exp2(torch.tensor(want_exp, dtype=torch.float64)))
    d = dequantize_fp8_block(q, s, torch.float64)
    sig = sigma.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    err = (d - w64).abs()
    assert torch.all(err <= w64.abs() * 2.0**-4 + sig * 2.0**-10)
    assert torch.equal(d, nearest_e4m3(w64 / sig) * sig)


@FAST
@given(
    n=st.integers(1, 300),
    k=st.integers(1, 300),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_quantize_of_dequantize_returns_the_same_bytes(
    n: int, k: int, dtype: torch.dtype, seed: int
) -> None:
    """Valid checkpoints (each block's max |q| in (224, 448]) survive a load/save cycle exactly."""
    gen = torch.Generator().manual_seed(seed)
    q = random_fp8((n, k), gen).view(torch.uint8).clone()
    big = [b for b in range(0x7F) if (b >> 3) == 15 or b == 0x77]  # 240 and 256..448
    gn, gk = -(-n // 128), -(-k // 128)
    pick = torch.tensor(big)[torch.randint(0, len(big), (gn, gk), generator=gen)]
    q[::128, ::128] = pick.to(torch.uint8) | (q[::128, ::128] & 0x80)
    q8 = q.view(torch.float8_e4m3fn)
    s = torch.randint(110, 150, (gn, gk), generator=gen).to(torch.uint8)
    w = dequantize_fp8_block(q8, s.view(torch.float8_e8m0fnu), dtype)
    q2, s2 = quantize_fp8_block(w)
    assert torch.equal(q2.view(torch.uint8), q)
    assert torch.equal(s2.view(torch.uint8), s)


def test_quantize_saturates_and_floors() -> None:
    w = torch.zeros(128, 256)
    w[0, 0] = 448.0 * 4  # exactly 448 * 2^2: scale 2^2, value 448
    q, s = quantize_fp8_block(w)
    assert s.view(torch.uint8).tolist() == [[129, 127 - 22]]  # second block: 1e-4 floor
    assert q.to(torch.float32)[0, 0].item() == FP8_E4M3_MAX
    assert torch.equal(dequantize_fp8_block(q, s, torch.float32), w)


def test_quantize_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        quantize_fp8_block(torch.zeros(4))
    with pytest.raises(TypeError):
        quantize_fp8_block(torch.zeros(4, 4, dtype=torch.int32))


def test_e4m3_table_is_the_torch_format() -> None:
    """Guards the oracle itself: the hand-decoded table must be torch's float8_e4m3fn."""
    vals, codes = e4m3_table()
    torch_vals = codes.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)
    assert torch.equal(vals, torch_vals)
    assert vals.max().item() == FP8_E4M3_MAX
    assert np.all(np.diff(vals.numpy()) > 0)
