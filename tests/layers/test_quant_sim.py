"""Official DSV4 quantisation simulations against brute-force oracles (docs/spec.md §6)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4.layers.quant_sim import (
    fp4_block_sim,
    fp8_block_sim,
    hadamard_rotate,
    index_fp8_sim,
    indexer_quant_sim,
)

FAST = settings(max_examples=30, deadline=None)
DTYPES = [torch.bfloat16, torch.float32, torch.float64]
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def e4m3_grid() -> torch.Tensor:
    """Non-negative finite E4M3FN values decoded from the bits; index parity = mantissa LSB."""
    return torch.tensor(
        [
            (b & 7) / 8 * 2.0**-6 if b >> 3 == 0 else (1 + (b & 7) / 8) * 2.0 ** ((b >> 3) - 7)
            for b in range(0x7F)
        ],
        dtype=torch.float64,
    )


def nearest_even(y: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Round |y| to the nearest grid point, ties to the even index; sign restored (the oracle)."""
    d = (y.abs().unsqueeze(-1) - grid).abs()
    cand = d == d.min(dim=-1, keepdim=True).values
    even = cand & (torch.arange(len(grid)) % 2 == 0)
    idx = torch.where(even.any(-1), even.to(torch.int8).argmax(-1), cand.to(torch.int8).argmax(-1))
    return torch.sign(y) * grid[idx]


def oracle_sigma(x: torch.Tensor, block: int, floor: float, qmax: float) -> torch.Tensor:
    """Per-block 2^ceil(log2(max(amax, floor) * (1/qmax))) with the product rounded like the code:
    float32 for bf16/fp32 inputs, float64 for float64 inputs. Shape [..., nblocks, 1], float64."""
    amax = x.double().reshape(*x.shape[:-1], -1, block).abs().amax(-1, keepdim=True)
    out = torch.empty_like(amax)
    flat, res = amax.reshape(-1), out.view(-1)
    for i, a in enumerate(flat.tolist()):
        if x.dtype == torch.float64:
            t = float(max(a, floor) * (1.0 / qmax))
        else:
            t = float(np.float32(max(np.float32(a), np.float32(floor))) * np.float32(1.0 / qmax))
        m, e = math.frexp(t)
        res[i] = math.ldexp(1.0, e - 1 if m == 0.5 else e)
    return out


def sim_oracle(x: torch.Tensor, block: int, floor: float, qmax: float, grid: torch.Tensor):
    sigma = oracle_sigma(x, block, floor, qmax)
    v = x.double().reshape(*x.shape[:-1], -1, block)
    want = nearest_even((v / sigma).clamp(-qmax, qmax), grid) * sigma
    return want.reshape(x.shape), sigma


@st.composite
def tensors(draw, block: int, max_blocks: int = 8):
    """Random tensors [lead..., nblocks * block] with a random dtype, magnitude and zero blocks."""
    lead = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    nblocks = draw(st.integers(1, max_blocks))
    dtype = draw(st.sampled_from(DTYPES))
    shift = draw(st.integers(-30, 30))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(*lead, nblocks * block, generator=gen, dtype=torch.float64) * 2.0**shift
    if draw(st.booleans()):  # heavy tails: outliers dominate a block's scale
        x = x * torch.exp(2 * torch.randn(x.shape, generator=gen, dtype=torch.float64))
    if draw(st.booleans()):
        x.reshape(-1, block)[0] = 0.0
    return x.to(dtype)


# ---------------------------------------------------------------- FP8 block-64


@FAST
@given(tensors(block=64))
def test_fp8_sim_matches_oracle(x: torch.Tensor) -> None:
    got = fp8_block_sim(x)
    want, sigma = sim_oracle(x, 64, 1e-4, 448.0, e4m3_grid())
    assert got.dtype == x.dtype and got.shape == x.shape
    assert torch.equal(got.double(), want)
    # values are e4m3 values times the block's power-of-two scale
    q = got.double().reshape(sigma.shape[:-1] + (64,)) / sigma
    assert torch.isin(q.abs(), e4m3_grid()).all()


@FAST
@given(tensors(block=64))
def test_fp8_sim_idempotent_and_bounded(x: torch.Tensor) -> None:
    y = fp8_block_sim(x)
    assert torch.equal(fp8_block_sim(y), y)
    x64, blocks = x.double(), x.double().reshape(-1, 64)
    amax = blocks.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    sigma_bound = (2 * amax / 448).expand_as(blocks).reshape(x.shape)  # sigma < 2 amax / 448
    err = (y.double() - x64).abs()
    assert torch.all(err <= x64.abs() * 2.0**-4 + sigma_bound * 2.0**-10)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_sim_exact_power_of_two_scale(dtype: torch.dtype) -> None:
    """amax = 448 * 2^k must give sigma = 2^k exactly (a float log2 can round to k + 1)."""
    for k in range(-20, 20):
        x = torch.zeros(64, dtype=torch.float64)
        x[0], x[1] = 448.0 * 2.0**k, 2.0**k * 1.125  # 1.125 is on the grid only if sigma = 2^k
        y = fp8_block_sim(x.to(dtype)).double()
        assert y[0].item() == x[0].item() and y[1].item() == x[1].item(), k


def test_fp8_sim_float64_single_rounding_and_ties() -> None:
    x = torch.zeros(8, dtype=torch.float64)
    x[:6] = torch.tensor(
        [448.0, 1.0625 + 1e-12, 1.0625 - 1e-12, 1.0625, 1.1875, -1.1875], dtype=torch.float64
    )
    assert fp8_block_sim(x, block=8)[:6].tolist() == [448.0, 1.125, 1.0, 1.0, 1.25, -1.25]


def test_fp8_sim_dtype_contract_and_noncontiguous() -> None:
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(5, 512, generator=gen).to(torch.bfloat16)
    x = full[:, :448]  # a non-contiguous slice, as the compressor passes it
    y = fp8_block_sim(x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, fp8_block_sim(x.contiguous()))
    assert torch.equal(y, fp8_block_sim(x.float()).to(torch.bfloat16))  # computed in fp32
    assert not torch.equal(y, x)


def test_fp8_sim_zero_block_and_floor() -> None:
    x = torch.zeros(2, 64)
    x[1, 0] = 1e-6  # below the 1e-4 floor: sigma = 2^ceil(log2(1e-4/448)) = 2^-22
    y = fp8_block_sim(x)
    assert torch.equal(y[0], x[0])
    assert y[1, 0].item() == 4.0 * 2.0**-22  # 1e-6 / 2^-22 = 4.19 -> 4.0 (step 1/2 in [4, 8))


def test_fp8_sim_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="multiple"):
        fp8_block_sim(torch.zeros(3, 100))
    with pytest.raises(TypeError):
        fp8_block_sim(torch.zeros(64, dtype=torch.int32))


# ---------------------------------------------------------------- Hadamard


def sylvester(n: int) -> torch.Tensor:
    """H[i, j] = (-1)^popcount(i & j): the natural-order Sylvester matrix, built directly."""
    i = torch.arange(n)
    bits = torch.tensor([bin(v).count("1") for v in range(n)])
    return (1 - 2 * (bits[i[:, None] & i[None, :]] % 2)).to(torch.float64)


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16, 32, 64, 128, 256])
def test_hadamard_matches_explicit_matrix(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(3, 2, n, generator=gen, dtype=torch.float64)
    want = x @ sylvester(n).T / math.sqrt(n)
    torch.testing.assert_close(hadamard_rotate(x), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(hadamard_rotate(x.float()), want.float(), rtol=1e-5, atol=1e-5)


@FAST
@given(
    logn=st.integers(0, 9),
    rows=st.integers(1, 6),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**31 - 1),
)
def test_hadamard_is_orthogonal_involution(
    logn: int, rows: int, dtype: torch.dtype, seed: int
) -> None:
    n = 2**logn
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    hx = hadamard_rotate(x)
    torch.testing.assert_close(hadamard_rotate(hx), x, rtol=tol, atol=tol)
    torch.testing.assert_close(hx.norm(dim=-1), x.norm(dim=-1), rtol=tol, atol=tol)


def test_hadamard_natural_order_and_dtype() -> None:
    e = torch.zeros(2, 128, dtype=torch.float64)
    e[0, 0], e[1, 1] = 1.0, 1.0
    h = hadamard_rotate(e) * math.sqrt(128)
    ones = torch.ones(128, dtype=torch.float64)
    torch.testing.assert_close(h[0], ones)  # first column of H is all ones
    torch.testing.assert_close(h[1], torch.tensor([1.0, -1.0] * 64, dtype=torch.float64))
    xb = torch.randn(4, 128).to(torch.bfloat16)
    assert hadamard_rotate(xb).dtype == torch.bfloat16
    assert torch.equal(hadamard_rotate(xb), hadamard_rotate(xb.float()).to(torch.bfloat16))


def test_hadamard_rejects_non_power_of_two() -> None:
    with pytest.raises(ValueError, match="power of two"):
        hadamard_rotate(torch.zeros(4, 96))


# ---------------------------------------------------------------- FP4 block-32


@FAST
@given(tensors(block=32))
def test_fp4_sim_matches_oracle(x: torch.Tensor) -> None:
    got = fp4_block_sim(x)
    want, sigma = sim_oracle(x, 32, 6.0 * 2.0**-126, 6.0, E2M1)
    assert got.dtype == x.dtype and got.shape == x.shape
    assert torch.equal(got.double(), want)
    q = got.double().reshape(sigma.shape[:-1] + (32,)) / sigma
    assert torch.isin(q.abs(), E2M1).all()
    assert torch.equal(fp4_block_sim(got), got)  # idempotent


def test_fp4_ties_round_to_even() -> None:
    v = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -5.0, 0.26, 4.99]
    want = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -1.0, -4.0, 0.5, 4.0]
    for dtype in DTYPES:
        x = torch.zeros(32, dtype=dtype)
        x[: len(v)] = torch.tensor(v, dtype=dtype)  # amax 6 -> sigma = 1
        got = fp4_block_sim(x).double()[: len(v)].tolist()
        assert got == [float(torch.tensor(w, dtype=dtype)) for w in want], dtype


def test_fp4_scale_is_power_of_two_ceiling() -> None:
    x = torch.zeros(3, 32)
    x[0, 0], x[1, 0], x[2, 0] = 6.0 * 8, 6.0 * 8 * 1.2, 1e-40
    y = fp4_block_sim(x)
    assert y[0, 0].item() == 48.0  # amax / 6 = 8 exactly -> sigma 8
    assert y[1, 0].item() == 64.0  # sigma 16, 57.6 / 16 = 3.6 -> 4
    # below the 6 * 2^-126 floor: sigma = 2^-126, 1e-40 / sigma rounds to 0
    assert torch.isfinite(y).all() and y[2, 0].item() == 0.0


# ---------------------------------------------------------------- indexer simulation


def test_indexer_quant_sim_is_rotation_then_fp4() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 128, generator=gen) * torch.exp(torch.randn(6, 128, generator=gen))
    xb = x.to(torch.bfloat16)
    y = indexer_quant_sim(xb)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, fp4_block_sim(hadamard_rotate(xb)))
    assert not torch.equal(y, fp4_block_sim(xb))  # the rotation is applied


# ---------------------------------------------------------------- engines' fp8 indexer keys


@FAST
@given(tensors(block=128, max_blocks=3))
def test_index_fp8_sim_matches_oracle(x: torch.Tensor) -> None:
    """E4M3 with one power-of-two scale per 128-vector (amax floor 1e-4), no rotation."""
    got = index_fp8_sim(x)
    want, sigma = sim_oracle(x, 128, 1e-4, 448.0, e4m3_grid())
    assert got.dtype == x.dtype and got.shape == x.shape
    assert torch.equal(got.double(), want)
    assert torch.equal(index_fp8_sim(got), got)  # idempotent
    assert torch.equal(got, fp8_block_sim(x, block=128))


def test_index_fp8_sim_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="index_fp8_sim"):
        index_fp8_sim(torch.zeros(2, 64))
    with pytest.raises(TypeError):
        index_fp8_sim(torch.zeros(128, dtype=torch.int64))
