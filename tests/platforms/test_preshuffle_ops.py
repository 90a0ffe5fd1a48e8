"""AITER preshuffle platform ops: (16, 16) layout, per-token group quant, blockscale GEMM."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4.layers.fp8 import dequantize_fp8_block, e8m0_to_float, quantize_fp8_block
from dsv4.platforms.preshuffle_ops import (
    blockscale_gemm_preshuffled,
    per_token_group_quant_fp8,
    shuffle_weight,
    shuffled_index,
    unshuffle_weight,
)

FAST = settings(max_examples=30, deadline=None)
DTYPES = [torch.float8_e4m3fn, torch.bfloat16]
_BITS = {1: torch.uint8, 2: torch.int16}


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bits, so comparisons are exact for every dtype (and NaN patterns compare equal)."""
    return t.view(_BITS[t.element_size()])


def random_weight(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bit patterns of ``dtype``, so a misplaced element almost surely shows."""
    view = _BITS[torch.empty((), dtype=dtype).element_size()]
    info = torch.iinfo(view)
    raw = torch.randint(info.min, info.max + 1, shape, generator=gen, dtype=torch.int64)
    return raw.to(view).view(dtype)


@st.composite
def shuffle_cases(draw):
    n = 16 * draw(st.integers(1, 12))
    k = 32 * draw(st.integers(1, 12))
    lead = tuple(draw(st.lists(st.integers(1, 3), max_size=1)))
    dtype = draw(st.sampled_from(DTYPES))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    return random_weight((*lead, n, k), dtype, gen)


# ---------------------------------------------------------------- the (16, 16) layout


@FAST
@given(shuffle_cases())
def test_shuffle_round_trip(w: torch.Tensor) -> None:
    s = shuffle_weight(w)
    assert s.shape == w.shape and s.dtype == w.dtype
    assert torch.equal(bits(unshuffle_weight(s)), bits(w))
    assert torch.equal(bits(shuffle_weight(unshuffle_weight(w))), bits(w))


@FAST
@given(shuffle_cases())
def test_shuffle_matches_flat_index_formula(w: torch.Tensor) -> None:
    n_, k_ = w.shape[-2:]
    e = w.element_size()
    n = torch.arange(n_)[:, None].expand(n_, k_)
    k = torch.arange(k_)[None, :].expand(n_, k_)
    f = shuffled_index(n, k, n_, k_, e)
    assert isinstance(f, torch.Tensor)
    s = bits(shuffle_weight(w)).reshape(*w.shape[:-2], n_ * k_)
    assert torch.equal(s[..., f], bits(w))
    # shuffle is a genuine permutation, and never the identity: every valid shape has > 1 tile
    assert torch.equal(f.flatten().sort().values, torch.arange(n_ * k_))
    assert not torch.equal(f.flatten(), torch.arange(n_ * k_))
    assert not torch.equal(bits(shuffle_weight(w)), bits(w))


@FAST
@given(shuffle_cases())
def test_unshuffle_matches_inverse_formula(w: torch.Tensor) -> None:
    """docs/upstream.md A.4 inverse mapping, written independently: flat f -> (n, k)."""
    n_, k_ = w.shape[-2:]
    p = 16 // w.element_size()
    f = torch.arange(n_ * k_)
    tau, iota = f // (16 * p), f % (16 * p)
    n = 16 * (tau // (k_ // p)) + iota // p
    k = p * (tau % (k_ // p)) + iota % p
    s = bits(shuffle_weight(w)).reshape(*w.shape[:-2], n_ * k_)
    assert torch.equal(bits(w)[..., n, k], s)


@FAST
@given(shuffle_cases())
def test_shuffle_matches_aiter_five_axis_form(w: torch.Tensor) -> None:
    """AITER's own phrasing: [N/16, 16, K/32, 32/P, P] permuted to [N/16, K/32, 32/P, 16, P]."""
    n_, k_ = w.shape[-2:]
    p = 16 // w.element_size()
    b = bits(w).reshape(-1, n_ // 16, 16, k_ // 32, 32 // p, p).permute(0, 1, 3, 4, 2, 5)
    assert torch.equal(bits(shuffle_weight(w)), b.contiguous().reshape(bits(w).shape))


def test_shuffle_first_tiles_explicitly() -> None:
    """fp8 [16, 32]: the second 16-column tile lands after the whole first tile."""
    w = torch.arange(16 * 32, dtype=torch.int32).reshape(16, 32).to(torch.uint8)
    s = shuffle_weight(w.view(torch.float8_e4m3fn)).view(torch.uint8).flatten()
    assert torch.equal(s[:256], w[:, :16].flatten())
    assert torch.equal(s[256:], w[:, 16:].flatten())


@pytest.mark.parametrize(
    ("shape", "dtype", "match"),
    [
        ((24, 64), torch.bfloat16, "N % 16"),
        ((32, 48), torch.float8_e4m3fn, "K % 32"),
        ((32, 64), torch.float32, "1- and 2-byte"),
        ((64,), torch.bfloat16, "2 dims"),
    ],
)
def test_shuffle_preconditions(shape: tuple[int, ...], dtype: torch.dtype, match: str) -> None:
    w = torch.zeros(shape, dtype=dtype)
    for fn in (shuffle_weight, unshuffle_weight):
        with pytest.raises(ValueError, match=match):
            fn(w)


def test_shuffle_rejects_other_layouts() -> None:
    with pytest.raises(ValueError, match="layout"):
        shuffle_weight(torch.zeros(32, 64, dtype=torch.bfloat16), layout=(32, 16))


# ---------------------------------------------------------------- per-token group quantisation


@FAST
@given(
    m=st.integers(1, 20),
    groups=st.integers(1, 4),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    shift=st.integers(-10, 10),
    seed=st.integers(0, 2**31 - 1),
)
def test_per_token_quant_transposed_scale_bytes(
    m: int, groups: int, dtype: torch.dtype, shift: int, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, 128 * groups, generator=gen) * 2.0**shift).to(dtype)
    q_t, s_t = per_token_group_quant_fp8(x, transpose_scale=True)
    q_p, s_p = per_token_group_quant_fp8(x, transpose_scale=False)
    assert torch.equal(bits(q_t), bits(q_p))
    assert s_t.shape == s_p.shape == (m, groups) and s_t.dtype == s_p.dtype == torch.float32
    assert s_p.is_contiguous() and s_t.stride() == (1, m)
    assert torch.equal(s_t, s_p)  # same logical values
    flat = s_t.as_strided((m * groups,), (1,), s_t.storage_offset())
    assert torch.equal(flat, s_p.t().contiguous().flatten())  # bytes = plain transposed


@FAST
@given(
    m=st.integers(1, 12),
    groups=st.integers(1, 3),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    seed=st.integers(0, 2**31 - 1),
)
def test_per_token_quant_matches_definition(
    m: int, groups: int, dtype: torch.dtype, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, 128 * groups, generator=gen) * torch.rand(m, 1, generator=gen)).to(dtype)
    q, s = per_token_group_quant_fp8(x, transpose_scale=False)
    xf = x.float().reshape(m, groups, 128)
    want_s = xf.abs().amax(-1).clamp_min(1e-10) / 448.0
    assert torch.equal(s, want_s)
    y = xf * (1.0 / want_s).unsqueeze(-1)  # fp32, as the kernel computes it
    grid = torch.arange(0x7F, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).double()
    d = (y.double().abs().unsqueeze(-1) - grid).abs()
    cand = d == d.min(-1, keepdim=True).values
    even = cand & (torch.arange(0x7F) % 2 == 0)
    idx = torch.where(even.any(-1), even.to(torch.int8).argmax(-1), cand.to(torch.int8).argmax(-1))
    want_q = torch.sign(y.double()) * grid[idx]
    assert torch.equal(q.double().reshape(m, groups, 128), want_q)
    assert q.double().abs().amax() <= 448.0


def test_per_token_quant_scale_is_not_power_of_two_and_zero_rows() -> None:
    x = torch.zeros(2, 256)
    x[0, 0] = 1.0
    q, s = per_token_group_quant_fp8(x)
    assert s[0, 0].item() == torch.tensor(1.0 / 448.0).item()  # amax / 448, not 2^-8 or 2^-9
    assert s[1, 1].item() == torch.tensor(1e-10 / 448.0).item()
    assert q.float()[0, 0].item() == 448.0 and torch.all(q.float().flatten()[1:] == 0)


def test_per_token_quant_fnuz_max() -> None:
    x = torch.randn(3, 128)
    q, s = per_token_group_quant_fp8(x, fp8_max=240.0, quant_dtype=torch.float8_e4m3fnuz)
    assert q.dtype == torch.float8_e4m3fnuz
    assert torch.equal(s, (x.abs().amax(-1, keepdim=True) / 240.0))
    assert q.float().abs().amax().item() == 240.0


def test_per_token_quant_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="multiple"):
        per_token_group_quant_fp8(torch.zeros(2, 100))
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        per_token_group_quant_fp8(torch.zeros(2, 2, 128))


# ---------------------------------------------------------------- the preshuffled GEMM


def make_case(m: int, n: int, k: int, seed: int):
    """Activations quantised per token, a block-quantised weight (ragged N allowed), shuffled."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen) * torch.exp(torch.randn(n, 1, generator=gen))
    wq, ws8 = quantize_fp8_block(w)
    x_q, x_s = per_token_group_quant_fp8(x)
    return x_q, x_s, wq, ws8


def reference_f64(x_q, x_s, wq, ws) -> torch.Tensor:
    """The A.6 definition in float64, by explicit block indexing (no code under test)."""
    m, k = x_q.shape
    n = wq.shape[0]
    kk = torch.arange(k) // 128
    x = x_q.double() * x_s.double()[:, kk]
    w = wq.double() * ws.double()[torch.arange(n)[:, None] // 128, kk[None, :]]
    return x @ w.T


@FAST
@given(
    m=st.integers(1, 24),
    n=st.integers(1, 20).map(lambda a: 16 * a),
    k=st.integers(1, 4).map(lambda b: 128 * b),
    seed=st.integers(0, 2**31 - 1),
)
def test_gemm_matches_float64_definition(m: int, n: int, k: int, seed: int) -> None:
    x_q, x_s, wq, ws8 = make_case(m, n, k, seed)
    ws = e8m0_to_float(ws8)
    ws_shuf = shuffle_weight(wq)
    want = reference_f64(x_q, x_s, wq, ws)
    got = blockscale_gemm_preshuffled(x_q, ws_shuf, x_s, ws, torch.float32)
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert ((got.double() - want).norm() / want.norm()).item() <= 1e-6
    got_bf16 = blockscale_gemm_preshuffled(x_q, ws_shuf, x_s, ws, torch.bfloat16)
    assert torch.equal(got_bf16, got.to(torch.bfloat16))  # fp32 accumulate, then cast
    assert torch.equal(blockscale_gemm_preshuffled(x_q, ws_shuf, x_s, ws8, torch.float32), got)


@FAST
@given(
    m=st.integers(4, 24),
    n=st.integers(1, 20).map(lambda a: 16 * a),
    k=st.integers(1, 4).map(lambda b: 128 * b),
    seed=st.integers(0, 2**31 - 1),
)
def test_plain_gemm_over_shuffled_weight_is_garbage(m: int, n: int, k: int, seed: int) -> None:
    """The vllm#51821 failure: a plain dequantise + matmul over a preshuffled weight."""
    x_q, x_s, wq, ws8 = make_case(m, n, k, seed)
    want = reference_f64(x_q, x_s, wq, e8m0_to_float(ws8))
    x = x_q.float() * x_s.repeat_interleave(128, dim=1)
    plain = x @ dequantize_fp8_block(shuffle_weight(wq), ws8, torch.float32).T
    assert ((plain.double() - want).norm() / want.norm()).item() > 0.5
    canonical = x @ dequantize_fp8_block(wq, ws8, torch.float32).T  # control: same path, unshuffled
    assert ((canonical.double() - want).norm() / want.norm()).item() <= 1e-6


def test_gemm_requires_column_major_scale() -> None:
    x_q, x_s, wq, ws8 = make_case(8, 32, 256, 0)
    w = shuffle_weight(wq)
    with pytest.raises(ValueError, match="column-major"):
        blockscale_gemm_preshuffled(x_q, w, x_s.contiguous(), ws8, torch.bfloat16)
    x_q1, x_s1, _, _ = make_case(1, 32, 256, 1)  # M = 1: both layouts are the same bytes
    blockscale_gemm_preshuffled(x_q1, w, x_s1.contiguous(), ws8, torch.bfloat16)


@pytest.mark.parametrize("bad", ["k", "x_scale", "w_scale", "n16", "dims"])
def test_gemm_rejects_inconsistent_shapes(bad: str) -> None:
    x_q, x_s, wq, ws8 = make_case(4, 32, 256, 0)
    w = shuffle_weight(wq)
    if bad == "k":
        x_q, x_s = per_token_group_quant_fp8(torch.randn(4, 128))
        match = "K="
    elif bad == "x_scale":
        x_s = x_s[:, :1]
        match = "x_scale"
    elif bad == "w_scale":
        ws8 = e8m0_to_float(ws8)[:, :1]
        match = "w_scale"
    elif bad == "n16":
        w = torch.zeros(24, 256, dtype=torch.float8_e4m3fn)
        ws8 = torch.ones(1, 2)
        match = "N % 16"
    else:
        x_q = x_q.unsqueeze(0)
        match = "2-D"
    with pytest.raises(ValueError, match=match):
        blockscale_gemm_preshuffled(x_q, w, x_s, ws8, torch.bfloat16)
