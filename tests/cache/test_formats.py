"""Stored row formats of the paged cache against an independent byte-level re-implementation.

The reference encoders here work on Python floats and numpy bytes (nearest grid point with ties
to the even code, scales from ``math.frexp``, bf16 bits by integer rounding, ``struct`` for
float32): they share no helper with :mod:`dsv4.cache.formats`.
"""

from __future__ import annotations

import functools
import math
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4.cache.formats import (
    INDEX_FORMATS,
    KV_FORMATS,
    DenseFormat,
    RowFormat,
    index_format,
    kv_format,
)
from dsv4.layers.quant_sim import fp4_block_sim, fp8_block_sim, index_fp8_sim, indexer_quant_sim

FAST = settings(max_examples=25, deadline=None)
DTYPES = [torch.bfloat16, torch.float32, torch.float64]

# FlashMLA tests/quant.py (MODEL1_FP8Sparse): bytes_per_token = 448 + 2 * 64 + 7 + 1 = 584 and
# size_per_block_padded = ceil(64 * 584 / 576) * 576 = 65 * 576 = 37440 for 64 tokens per block.
FLASHMLA_MODEL1_BLOCK_BYTES_64 = 37440


# ---------------------------------------------------------------- independent reference encoders


def e4m3_magnitudes() -> np.ndarray:
    """Magnitude of E4M3FN codes 0..126 decoded from the bits (127 is NaN)."""
    out = []
    for b in range(0x7F):
        exp, man = b >> 3, b & 7
        out.append(man / 8 * 2.0**-6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7))
    return np.array(out)


E4M3 = e4m3_magnitudes()
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def nearest_code(y: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Index of the nearest grid magnitude to |y|, ties to the even index."""
    d = np.abs(np.abs(y)[:, None] - grid[None, :])
    best = d.min(axis=1, keepdims=True)
    cand = d == best
    even = cand & (np.arange(len(grid)) % 2 == 0)
    return np.where(even.any(axis=1), even.argmax(axis=1), cand.argmax(axis=1))


def pow2_exponent(block: np.ndarray, floor: float, qmax: float, wide: bool) -> int:
    """ceil(log2(max(amax, floor) * (1/qmax))) with the product rounded in float32 (or float64)."""
    amax = float(np.abs(block).max())
    if wide:
        t = max(amax, floor) * (1.0 / qmax)
    else:
        t = float(np.float32(max(np.float32(amax), np.float32(floor))) * np.float32(1.0 / qmax))
    m, e = math.frexp(t)
    return e - 1 if m == 0.5 else e


def ref_e4m3_bytes(block: np.ndarray, wide: bool) -> tuple[np.ndarray, int]:
    e = pow2_exponent(block, 1e-4, 448.0, wide)
    y = np.clip(block / 2.0**e, -448.0, 448.0)
    code = nearest_code(y, E4M3).astype(np.uint8) | (np.signbit(y).astype(np.uint8) << 7)
    return code, e


def bf16_bits(x: float) -> int:
    """Round-to-nearest-even bf16 bits of a finite float in bf16's range (single rounding)."""
    if abs(x) < 2.0**-126:  # subnormal: a fixed step of 2^-133
        r = round(x * 2.0**133) * 2.0**-133
    else:
        m, e = math.frexp(x)
        r = round(m * 256.0) * 2.0 ** (e - 8)  # 8 significant bits, ties to even
    r = math.copysign(r, x)  # keep the sign of a zero
    (bits,) = struct.unpack("<I", struct.pack("<f", r))
    return bits >> 16


def ref_fp8_ds_mla_row(v: np.ndarray, wide: bool, nope: int) -> tuple[bytes, bytes]:
    """(data, scales) bytes of one row: nope E4M3 per 64 + rope bf16; UE8M0 + zero pad."""
    tiles = nope // 64
    data, scales = bytearray(), bytearray()
    for t in range(tiles):
        code, e = ref_e4m3_bytes(v[t * 64 : (t + 1) * 64], wide)
        data += code.tobytes()
        scales.append(e + 127)
    for x in v[nope:]:
        data += struct.pack("<H", bf16_bits(float(x)))
    scales += bytes(8 * math.ceil(tiles / 8) - tiles)
    return bytes(data), bytes(scales)


def ref_index_fp8_row(v: np.ndarray, wide: bool) -> tuple[bytes, bytes]:
    data, scales = bytearray(), bytearray()
    for b in range(len(v) // 128):
        code, e = ref_e4m3_bytes(v[b * 128 : (b + 1) * 128], wide)
        data += code.tobytes()
        scales += struct.pack("<f", 2.0**e)
    return bytes(data), bytes(scales)


def ref_index_fp4_row(v: np.ndarray, wide: bool) -> tuple[bytes, bytes]:
    nibbles, scales = [], bytearray()
    for b in range(len(v) // 32):
        block = v[b * 32 : (b + 1) * 32]
        e = pow2_exponent(block, 6.0 * 2.0**-126, 6.0, wide)
        y = np.clip(block / 2.0**e, -6.0, 6.0)
        code = nearest_code(y, E2M1) | (np.signbit(y).astype(np.int64) << 3)
        nibbles += code.tolist()
        scales.append(e + 127)
    data = bytes(lo | (hi << 4) for lo, hi in zip(nibbles[0::2], nibbles[1::2], strict=True))
    return data, bytes(scales)


def raw_blocks(store: torch.Tensor, block_bytes: int) -> np.ndarray:
    """The whole storage behind a store as [num_blocks, block_bytes] bytes, padding included."""
    flat = torch.empty(0, dtype=torch.uint8).set_(store.untyped_storage())
    return flat.numpy()[: store.shape[0] * block_bytes].reshape(store.shape[0], block_bytes)


def expected_blocks(fmt: RowFormat, ref, store, rows, values, wide) -> np.ndarray:
    """Zeroed blocks with the reference bytes of ``rows`` placed by the documented layout."""
    nb, r = store.shape[0], store.shape[1]
    bb = fmt.block_bytes(r)
    out = np.zeros((nb, bb), dtype=np.uint8)
    v64 = values.double().numpy()
    for row, v in zip(rows.tolist(), v64, strict=True):
        data, scales = ref(v, wide)
        blk, off = divmod(row, r)
        db, sb = len(data), len(scales)
        out[blk, off * db : (off + 1) * db] = np.frombuffer(data, dtype=np.uint8)
        out[blk, r * db + off * sb : r * db + (off + 1) * sb] = np.frombuffer(scales, np.uint8)
    return out


def sample_rows(n: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows with varied magnitudes per 32 values: zeros, below the floors, large, negative."""
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn(n, dim, generator=gen, dtype=torch.float64)
    groups = v.view(n, dim // 32, 32)
    shift = torch.randint(-12, 12, (n, dim // 32, 1), generator=gen).double()
    groups.mul_(2.0**shift)
    groups[0, 0] = 0.0  # a zero block
    groups[0, 1] *= 1e-9  # below both amax floors
    groups[-1, -1] *= 1e6
    v[-1, 3] = 0.0
    v[-1, 5] = -0.0
    v[:, 7] = 448.0 * 2.0**-3  # an exact power-of-two boundary in tile 0
    return v.to(dtype)


# ---------------------------------------------------------------- byte layouts


LAYOUTS = [
    ("fp8_ds_mla", 512, 64, ref_fp8_ds_mla_row),
    ("fp8_ds_mla", 128, 64, ref_fp8_ds_mla_row),  # the tiny model: 1 tile
    ("fp8_ds_mla", 704, 64, ref_fp8_ds_mla_row),  # 10 tiles: 16 scale bytes per row
    ("fp8", 128, 0, ref_index_fp8_row),
    ("fp8", 256, 0, ref_index_fp8_row),
    ("fp4", 128, 0, ref_index_fp4_row),
]


def make_format(name: str, dim: int, rope: int, dtype: torch.dtype) -> RowFormat:
    if name in KV_FORMATS:
        return kv_format(name, dim, rope, dtype)
    return index_format(name, dim, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("name", "dim", "rope", "ref"), LAYOUTS)
def test_bytes_match_independent_layout(name, dim, rope, ref, dtype) -> None:
    fmt = make_format(name, dim, rope, dtype)
    r = 16
    store = fmt.allocate(3, r)
    raw_blocks(store, fmt.block_bytes(r))[:] = 0  # padding and unwritten rows read back as 0
    rows = torch.tensor([0, 17, 47, 20, 15])  # block 0, 1, 2, 1, 0
    values = sample_rows(len(rows), dim, dtype, seed=dim + len(name))
    fmt.write(store, rows, values)
    wide = dtype == torch.float64
    row_ref = functools.partial(ref, nope=dim - rope) if name == "fp8_ds_mla" else ref
    want = expected_blocks(fmt, row_ref, store, rows, values, wide)
    got = raw_blocks(store, fmt.block_bytes(r))
    assert np.array_equal(got, want)


def test_sizes_at_d512_and_index_formats() -> None:
    kv = kv_format("fp8_ds_mla", 512, 64, torch.bfloat16)
    assert kv.row_bytes() == 584
    assert kv.block_bytes(64) == FLASHMLA_MODEL1_BLOCK_BYTES_64 == 65 * 576
    assert kv.block_bytes(1) == 2 * 576  # 584 bytes padded to the next 576 multiple
    store = kv.allocate(2, 64)
    assert store.shape == (2, 64, 584) and store.stride() == (37440, 584, 1)
    assert store.untyped_storage().nbytes() == 2 * 37440
    tiny = kv_format("fp8_ds_mla", 128, 64, torch.bfloat16)  # 64 + 128 data + 8 scale bytes
    assert tiny.row_bytes() == 200 and tiny.block_bytes(64) == 67 * 192
    fp8 = index_format("fp8", 128, torch.bfloat16)
    assert fp8.row_bytes() == 132 and fp8.block_bytes(64) == 64 * 132 == 8448
    fp4 = index_format("fp4", 128, torch.bfloat16)
    assert fp4.row_bytes() == 68 and fp4.block_bytes(64) == 64 * 68 == 4352
    bf16 = kv_format("bf16", 512, 64, torch.float32)
    assert bf16.row_bytes() == 1024 and bf16.block_bytes(64) == 65536
    auto = kv_format("auto", 512, 64, torch.float32)
    assert auto.row_bytes() == 2048 and auto.allocate(1, 64).dtype == torch.float32


def test_fp4_nibble_order_and_codes() -> None:
    """Element 2j is the low nibble, 2j+1 the high one; codes are sign << 3 | magnitude index."""
    fmt = index_format("fp4", 32, torch.float32)
    store = fmt.allocate(1, 1)
    v = torch.zeros(1, 32)
    v[0, :4] = torch.tensor([6.0, -0.5, 1.5, -4.0])  # amax 6: scale 1
    fmt.write(store, torch.tensor([0]), v)
    assert store[0, 0, :2].tolist() == [0x7 | (0x9 << 4), 0x3 | (0xE << 4)]
    assert store[0, 0, 16] == 127  # scale 2^0


# ---------------------------------------------------------------- round trips and the simulations


@st.composite
def row_values(draw, dim: int, dtypes=tuple(DTYPES)):
    """[N, dim] values: random dtype and magnitude, heavy tails, zero / tiny / huge blocks."""
    n = draw(st.integers(1, 6))
    dtype = draw(st.sampled_from(dtypes))
    lim = 100 if dtype == torch.float64 else 40
    shift = draw(st.integers(-lim, lim))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(n, dim, generator=gen, dtype=torch.float64) * 2.0**shift
    if draw(st.booleans()):
        x = x * torch.exp(2 * torch.randn(x.shape, generator=gen, dtype=torch.float64))
    kind = draw(st.sampled_from(["none", "zero", "tiny", "huge", "negative"]))
    blocks = x.view(n, dim // 32, 32)
    if kind == "zero":
        blocks[0, 0] = 0.0
    elif kind == "tiny":
        blocks[0, -1] = blocks[0, -1] * 1e-12 / blocks[0, -1].abs().max().clamp_min(1e-300)
    elif kind == "huge":
        blocks[-1, 0, 0] = 3.0e37 if dtype != torch.float64 else 1e30
    elif kind == "negative":
        x = -x.abs()
    return x.to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, so that -0.0 and 0.0 differ."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def fp8_ds_mla_oracle(v: torch.Tensor, nope: int) -> torch.Tensor:
    """What the format must give: the official FP8 simulation on nope, rope rounded to bf16."""
    rope = v[:, nope:]
    if v.dtype == torch.float64:  # single rounding, as the reference bf16_bits
        rope = torch.tensor(
            [[struct.unpack("<f", struct.pack("<I", bf16_bits(x) << 16))[0] for x in r]
             for r in rope.tolist()],
            dtype=torch.float64,
        ).reshape(rope.shape)
    else:
        rope = rope.to(torch.bfloat16).to(v.dtype)
    return torch.cat((fp8_block_sim(v[:, :nope]), rope), dim=1)


def write_read(fmt: RowFormat, v: torch.Tensor, seed: int = 0) -> torch.Tensor:
    r = 8
    nblocks = (len(v) + r - 1) // r + 1
    store = fmt.allocate(nblocks, r)
    rows = torch.randperm(nblocks * r, generator=torch.Generator().manual_seed(seed))[: len(v)]
    fmt.write(store, rows, v)
    return fmt.read(store, rows, v.dtype)


@FAST
@given(row_values(dim=128), st.integers(0, 1000))
def test_fp8_ds_mla_round_trip_is_the_official_simulation(v: torch.Tensor, seed: int) -> None:
    fmt = kv_format("fp8_ds_mla", 128, 64, v.dtype)
    got = write_read(fmt, v, seed)
    assert got.dtype == v.dtype
    assert torch.equal(bits(got), bits(fp8_ds_mla_oracle(v, 64)))


@FAST
@given(row_values(dim=512), st.integers(0, 1000))
def test_fp8_ds_mla_lossless_on_simulated_rows(v: torch.Tensor, seed: int) -> None:
    """read(write(v)) == v bitwise when the nope dims already went through fp8_block_sim."""
    nope = 448
    rope = v[:, nope:].to(torch.bfloat16).to(v.dtype)
    sim = torch.cat((fp8_block_sim(v[:, :nope]), rope), dim=1)
    fmt = kv_format("fp8_ds_mla", 512, 64, v.dtype)
    assert not fmt.exact
    assert torch.equal(bits(write_read(fmt, sim, seed)), bits(sim))


@FAST
@given(row_values(dim=128), st.integers(0, 1000))
def test_index_fp8_round_trip_is_index_fp8_sim(v: torch.Tensor, seed: int) -> None:
    fmt = index_format("fp8", 128, v.dtype)
    want = index_fp8_sim(v)
    assert torch.equal(bits(write_read(fmt, v, seed)), bits(want))
    assert torch.equal(bits(write_read(fmt, want, seed)), bits(want))  # lossless on the sim


@FAST
@given(row_values(dim=128), st.integers(0, 1000))
def test_index_fp4_round_trip_is_fp4_block_sim(v: torch.Tensor, seed: int) -> None:
    """The engines' MXFP4 rule is the official FP4 simulation's: same scale, same rounding."""
    fmt = index_format("fp4", 128, v.dtype)
    want = fp4_block_sim(v)
    assert torch.equal(bits(write_read(fmt, v, seed)), bits(want))
    assert torch.equal(bits(write_read(fmt, want, seed)), bits(want))  # lossless on the sim
    rotated = indexer_quant_sim(v)  # Hadamard + FP4: also stored without loss
    assert torch.equal(bits(write_read(fmt, rotated, seed)), bits(rotated))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_dense_formats(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    v = (torch.randn(5, 64, generator=gen) * 1e3).to(dtype)
    v[0, 0] = -0.0
    auto = kv_format("auto", 64, 32, dtype)
    assert auto.exact and isinstance(auto, DenseFormat)
    assert torch.equal(bits(write_read(auto, v)), bits(v))
    bf16 = index_format("bf16", 64, dtype)
    assert bf16.exact == (dtype == torch.bfloat16)
    assert torch.equal(write_read(bf16, v), v.to(torch.bfloat16).to(dtype))
    store = auto.allocate(2, 4)
    auto.write(store, torch.tensor([6]), v[:1])
    assert torch.equal(store[1, 2], v[0])


def test_float64_beyond_e8m0_saturates() -> None:
    """Scale exponents are clamped to 127: a float64 tile beyond 448 * 2^127 saturates."""
    fmt = kv_format("fp8_ds_mla", 128, 64, torch.float64)
    v = torch.zeros(1, 128, dtype=torch.float64)
    v[0, 0], v[0, 1] = 1e300, -1.0e40
    got = write_read(fmt, v)
    # -1e40 / 2^127 = -58.8, which rounds to -60 on the E4M3 grid (step 4 in [32, 64))
    assert got[0, 0].item() == 448.0 * 2.0**127 and got[0, 1].item() == -60.0 * 2.0**127
    fp4 = index_format("fp4", 32, torch.float64)
    w = torch.zeros(1, 32, dtype=torch.float64)
    w[0, 0] = -1e300
    assert write_read(fp4, w)[0, 0].item() == -6.0 * 2.0**127


# ---------------------------------------------------------------- addressing


ALL = [
    ("auto", 128, 64), ("bf16", 128, 64), ("fp8_ds_mla", 128, 64), ("fp8_ds_mla", 512, 64),
    ("fp8", 128, 0), ("fp4", 128, 0),
]


def as_bytes(store: torch.Tensor) -> np.ndarray:
    return torch.empty(0, dtype=torch.uint8).set_(store.untyped_storage()).numpy().copy()


@pytest.mark.parametrize(("name", "dim", "rope"), ALL)
def test_missing_rows_read_as_zeros_any_shape(name, dim, rope) -> None:
    fmt = make_format(name, dim, rope, torch.float32)
    store = fmt.allocate(2, 4)
    torch.empty(0, dtype=torch.uint8).set_(store.untyped_storage()).fill_(0xFF)  # NaN garbage
    v = sample_rows(2, dim, torch.float32, seed=1)
    fmt.write(store, torch.tensor([5, 2]), v)
    rows = torch.tensor([[5, -1, 2], [-1, -1, 5]])
    got = fmt.read(store, rows, torch.bfloat16)
    assert got.shape == (2, 3, dim) and got.dtype == torch.bfloat16
    assert torch.equal(got[0, 1], torch.zeros(dim, dtype=torch.bfloat16))
    assert torch.equal(got[1, :2], torch.zeros(2, dim, dtype=torch.bfloat16))
    one = fmt.read(store, torch.tensor([5]), torch.float32)[0]
    assert torch.equal(got[0, 0], one.to(torch.bfloat16)) and torch.equal(got[1, 2], got[0, 0])
    none = fmt.read(store, torch.full((3,), -1), torch.float64)
    assert torch.equal(none, torch.zeros(3, dim, dtype=torch.float64))
    assert fmt.read(store, torch.zeros(0, dtype=torch.int64), torch.float32).shape == (0, dim)


def row_byte_offsets(fmt: RowFormat, rows_per_block: int, row: int) -> list[int]:
    """Storage byte offsets of one row by the documented layout (data, then scales)."""
    blk, off = divmod(row, rows_per_block)
    base = blk * fmt.block_bytes(rows_per_block)
    if isinstance(fmt, DenseFormat):
        rb = fmt.row_bytes()
        return list(range(base + off * rb, base + (off + 1) * rb))
    db, sb = fmt.data_bytes, fmt.scale_bytes  # type: ignore[attr-defined]
    scales = base + rows_per_block * db
    return list(range(base + off * db, base + (off + 1) * db)) + list(
        range(scales + off * sb, scales + (off + 1) * sb)
    )


@pytest.mark.parametrize(("name", "dim", "rope"), ALL)
def test_write_touches_only_its_row(name, dim, rope) -> None:
    fmt = make_format(name, dim, rope, torch.bfloat16)
    store = fmt.allocate(3, 4)
    gen = torch.Generator().manual_seed(7)
    raw = torch.empty(0, dtype=torch.uint8).set_(store.untyped_storage())
    raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))
    before = as_bytes(store)
    fmt.write(store, torch.tensor([6]), sample_rows(1, dim, torch.bfloat16, seed=2))
    changed = set(np.nonzero(before != as_bytes(store))[0].tolist())
    assert changed and changed <= set(row_byte_offsets(fmt, 4, 6))


@pytest.mark.parametrize(("name", "dim", "rope"), ALL)
def test_copy_rows_copies_bytes(name, dim, rope) -> None:
    fmt = make_format(name, dim, rope, torch.float32)
    store = fmt.allocate(2, 4)
    raw = torch.empty(0, dtype=torch.uint8).set_(store.untyped_storage())
    raw.copy_(torch.randint(0, 256, raw.shape, generator=torch.Generator().manual_seed(5),
                            dtype=torch.uint8))
    v = sample_rows(3, dim, torch.float32, seed=4)
    fmt.write(store, torch.tensor([0, 1, 2]), v)
    before = as_bytes(store)
    values = fmt.read(store, torch.tensor([0, 1, 2]), torch.float32)
    fmt.copy_rows(store, torch.tensor([0, 1, 2]), torch.tensor([5, 6, 1]))  # overlapping
    after = as_bytes(store)
    for src, dst in ((0, 5), (1, 6), (2, 1)):  # every byte, scales and pad included
        assert np.array_equal(after[row_byte_offsets(fmt, 4, dst)],
                              before[row_byte_offsets(fmt, 4, src)])
    got = fmt.read(store, torch.tensor([5, 6, 1, 0]), torch.float32)
    assert torch.equal(bits(got[:3]), bits(values)) and torch.equal(bits(got[3]), bits(values[0]))
    untouched = set(range(len(before))) - {
        i for r in (5, 6, 1) for i in row_byte_offsets(fmt, 4, r)
    }
    idx = sorted(untouched)
    assert np.array_equal(after[idx], before[idx])


@pytest.mark.parametrize(("name", "dim", "rope"), ALL)
def test_empty_calls(name, dim, rope) -> None:
    fmt = make_format(name, dim, rope, torch.float32)
    store = fmt.allocate(1, 4)
    empty = torch.zeros(0, dtype=torch.int64)
    fmt.write(store, empty, torch.zeros(0, dim))
    fmt.copy_rows(store, empty, empty)
    assert fmt.read(store, empty.reshape(0, 3), torch.float32).shape == (0, 3, dim)
    assert fmt.allocate(0, 4).shape[:2] == (0, 4)


@pytest.mark.parametrize(("name", "dim", "rope"), ALL)
def test_strided_values_and_int32_rows(name, dim, rope) -> None:
    fmt = make_format(name, dim, rope, torch.bfloat16)
    wide = sample_rows(3, 2 * dim, torch.bfloat16, seed=9)
    v = wide[:, dim // 2 : dim // 2 + dim]  # a non-contiguous slice, as a caller may pass
    a, b = fmt.allocate(2, 4), fmt.allocate(2, 4)
    fmt.write(a, torch.tensor([1, 4, 7], dtype=torch.int32), v)
    fmt.write(b, torch.tensor([1, 4, 7]), v.contiguous())
    rows = torch.tensor([7, 1, 4], dtype=torch.int32)
    got, want = fmt.read(a, rows, torch.bfloat16), fmt.read(b, rows, torch.bfloat16)
    assert torch.equal(bits(got), bits(want))


# ---------------------------------------------------------------- errors


def test_unknown_names_list_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="auto, bf16, fp8_ds_mla"):
        kv_format("fp8", 512, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="auto, bf16, fp8, fp4"):
        index_format("fp8_ds_mla", 128, torch.bfloat16)
    assert KV_FORMATS == ("auto", "bf16", "fp8_ds_mla")
    assert INDEX_FORMATS == ("auto", "bf16", "fp8", "fp4")


def test_bad_dims_and_dtypes() -> None:
    with pytest.raises(ValueError, match="multiple of 64"):
        kv_format("fp8_ds_mla", 512, 96, torch.bfloat16)  # nope 416
    with pytest.raises(ValueError, match="multiple of 64"):
        kv_format("fp8_ds_mla", 64, 64, torch.bfloat16)  # no nope dims
    with pytest.raises(ValueError, match="multiple of 128"):
        index_format("fp8", 96, torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 32"):
        index_format("fp4", 48, torch.bfloat16)
    with pytest.raises(ValueError, match="positive"):
        kv_format("auto", 0, 0, torch.bfloat16)
    with pytest.raises(TypeError, match="floating"):
        kv_format("auto", 128, 64, torch.int32)
    with pytest.raises(TypeError):
        index_format("fp8", 128, torch.float8_e4m3fn)


@pytest.mark.parametrize(("name", "dim", "rope"), ALL)
def test_bad_calls(name, dim, rope) -> None:
    fmt = make_format(name, dim, rope, torch.float32)
    store = fmt.allocate(2, 4)
    rows = torch.tensor([1, 2])
    v = torch.zeros(2, dim)
    with pytest.raises(ValueError, match=rf"\[N, {dim}\]"):
        fmt.write(store, rows, torch.zeros(2, dim + 32))
    with pytest.raises(ValueError, match="value rows"):
        fmt.write(store, rows, torch.zeros(3, dim))
    with pytest.raises(TypeError, match="floating"):
        fmt.write(store, rows, torch.zeros(2, dim, dtype=torch.int64))
    with pytest.raises(TypeError, match="integer"):
        fmt.write(store, rows.float(), v)
    with pytest.raises(ValueError, match=">= 0"):
        fmt.write(store, torch.tensor([1, -1]), v)
    with pytest.raises(ValueError, match="distinct"):
        fmt.write(store, torch.tensor([3, 3]), v)
    with pytest.raises(IndexError, match="out of range"):
        fmt.write(store, torch.tensor([1, 8]), v)
    with pytest.raises(IndexError, match="out of range"):
        fmt.read(store, torch.tensor([8]), torch.float32)
    with pytest.raises(TypeError, match="floating"):
        fmt.read(store, rows, torch.int32)
    with pytest.raises(ValueError):
        fmt.copy_rows(store, torch.tensor([1, 2]), torch.tensor([3]))
    with pytest.raises((TypeError, ValueError)):
        fmt.write(torch.zeros(2, 4, dim + 1), rows, v)
    with pytest.raises((TypeError, ValueError)):
        fmt.read(store.clone().to(torch.float64), rows, torch.float32)
