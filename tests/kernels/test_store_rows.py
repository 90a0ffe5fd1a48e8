"""The one-launch cache write (``dsv4.kernels.store_rows``) against the torch path
(``store.write(store.flat_rows(slots, rows), values)``): two identical paged stores (same block
tables, same random initial bytes), one written each way; every byte of the storage must agree.

Every stored format (dense bf16, ``fp8_ds_mla`` at the tiny and the real head dims, index ``fp8``
and ``fp4``), block sizes 16 and 64, several slots, rows crossing blocks, pairs that must be
skipped (row < 0, a released block, a block never grown), and adversarial values: all-zero and
-0.0 tiles, amax below the floor, amax exactly at ``qmax * 2^k`` (and one bf16 ulp above),
E4M3 / E2M1 grid values and rounding ties (normal and subnormal) at that scale. Small shapes under
Triton's CPU interpreter (TRITON_INTERPRET=1) or on a GPU; Flash shapes and CUDA-graph capture
on a GPU only.

The torch path is given only the held pairs: a ``-1`` flat row there is not skipped (a packed
format scatters it into the last block's last row), the kernel skips it.
"""

from __future__ import annotations

import pytest
import torch

from dsv4.cache.formats import RowFormat, index_format, kv_format
from dsv4.cache.store import PagedStore
from dsv4.kernels.fused_input_proj import triton_available
from dsv4.kernels.store_rows import store_rows, store_rows_problem

from conftest import KERNEL_DEV, kernel_runs, needs_gpu

DEV = KERNEL_DEV
BF16 = torch.bfloat16

# (name, format factory, quantisation tile, qmax) -- tile 0: dense
FORMATS = {
    "bf16": (lambda d, r: kv_format("bf16", d, r, BF16), 0, 0.0),
    "fp8_ds_mla": (lambda d, r: kv_format("fp8_ds_mla", d, r, BF16), 64, 448.0),
    "fp8": (lambda d, r: index_format("fp8", d, BF16), 128, 448.0),
    "fp4": (lambda d, r: index_format("fp4", d, BF16), 32, 6.0),
}
E4M3_GRID = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def raw(store: PagedStore) -> torch.Tensor:
    """Every byte of the store's storage (padding included)."""
    return torch.empty(0, dtype=torch.uint8, device=store.data.device).set_(
        store.data.untyped_storage())


def twin_stores(fmt: RowFormat, block: int, device: str, seed: int = 0,
                num_blocks: int = 12, max_seqs: int = 4, max_logical: int = 6
                ) -> tuple[PagedStore, PagedStore]:
    """Two stores with the same block tables and the same random initial bytes: slot 0 holds
    rows 0 .. 3B + 4 with its logical block 1 released, slot 2 rows 0 .. B + 2, slot 3 one
    block, slot 1 nothing; a spacer sequence allocated and released first scatters the blocks."""
    stores = []
    for _ in range(2):
        s = PagedStore("kv", fmt, block, num_blocks, max_seqs, max_logical, torch.device(device))
        s.grow(1, 2 * block)
        s.grow(0, 3 * block + 5)
        s.grow(2, block + 3)
        s.release_all(1)
        s.grow(3, block)
        # release logical block 1 of slot 0 (release_before would release block 0 too)
        phys = s._blocks[0][1]
        s.alloc.release(phys)
        s._blocks[0][1] = -1
        s.table[0, 1] = -1
        s._mark(0, 1, 2)
        s.sync()
        stores.append(s)
    a, b = stores
    assert torch.equal(a.table, b.table)
    g = torch.Generator().manual_seed(seed)
    init = torch.randint(0, 256, (raw(a).numel(),), generator=g, dtype=torch.uint8)
    raw(a).copy_(init)
    raw(b).copy_(init)
    return a, b


def pairs(block: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n distinct (slot, row) pairs: held rows of slots 0, 2, 3 (crossing blocks) and a few that
    must be skipped (row -1, the released block of slot 0, slot 1's unheld rows, rows past the
    grown blocks, a row past the table's last logical block)."""
    held = ([(0, r) for r in range(0, block)] + [(0, r) for r in range(2 * block, 3 * block + 5)]
            + [(2, r) for r in range(block + 3)] + [(3, r) for r in range(block)])
    skipped = [(0, -1), (0, block + 1), (1, 0), (1, 5), (3, block + 2), (2, 6 * block + 7)]
    g = torch.Generator().manual_seed(seed)
    pick = [held[i] for i in torch.randperm(len(held), generator=g)[: n - len(skipped)].tolist()]
    allp = pick + skipped
    order = torch.randperm(len(allp), generator=g).tolist()
    slots = torch.tensor([allp[i][0] for i in order], dtype=torch.int64)
    rows = torch.tensor([allp[i][1] for i in order], dtype=torch.int64)
    return slots, rows


def adversarial(n: int, dim: int, tile: int, qmax: float, dtype: torch.dtype, seed: int
                ) -> torch.Tensor:
    """[n, dim] values, each quantisation tile one of: random normal at a random scale, zeros,
    -0.0, amax below the floor, exact boundary amax ``qmax * 2^k`` with grid values and ties
    (normal and subnormal) at scale 2^k and signed zeros, one bf16 ulp above the boundary."""
    g = torch.Generator().manual_seed(seed)
    t = tile or 32
    v = torch.randn(n, dim // t, t, generator=g, dtype=torch.float64)
    grid = E2M1_GRID if qmax == 6.0 else E4M3_GRID
    ties = (grid[1:] + grid[:-1]) / 2
    cand = torch.cat((grid, ties, grid / 4 + grid[1] / 8))  # values, ties, sub-grid fractions
    kinds = torch.randint(0, 7, (n, dim // t), generator=g)
    for i in range(n):
        for j in range(dim // t):
            kind = int(kinds[i, j])
            e = int(torch.randint(-20, 21, (1,), generator=g))
            if kind == 0:  # random normal at a random scale
                v[i, j] *= 2.0 ** e
            elif kind == 1:
                v[i, j] = 0.0
            elif kind == 2:
                v[i, j] = -0.0
            elif kind == 3:  # amax below the floor (1e-4 / 6 * 2^-126)
                v[i, j] *= (5e-6 if qmax != 6.0 else 1e-39)
            else:  # on the grid at scale 2^e: amax exactly qmax * 2^e (or an ulp above)
                idx = torch.randint(0, cand.numel(), (t,), generator=g)
                sign = torch.where(torch.rand(t, generator=g) < 0.5, -1.0, 1.0)
                row = cand[idx].double() * sign
                row[int(torch.randint(0, t, (1,), generator=g))] = qmax * (
                    -1.0 if kind == 5 else 1.0)
                if kind == 6:  # just above the boundary (after the bf16 cast): the next exponent
                    row[row.abs().argmax()] *= 1.0 + 2.0 ** -7
                row[int(torch.randint(0, t, (1,), generator=g))] = -0.0
                v[i, j] = row * 2.0 ** e
    return v.reshape(n, dim).to(dtype)


def write_both(a: PagedStore, b: PagedStore, slots: torch.Tensor, rows: torch.Tensor,
               values: torch.Tensor) -> None:
    dev = a.data.device
    slots, rows, values = slots.to(dev), rows.to(dev), values.to(dev)
    flat = a.flat_rows(slots, rows)
    keep = flat >= 0
    a.write(flat[keep], values[keep])  # the torch path, held pairs only
    assert store_rows_problem(b, values) == ""
    store_rows(b, slots, rows, values)


def assert_same_bytes(a: PagedStore, b: PagedStore) -> None:
    ra, rb = raw(a), raw(b)
    diff = (ra != rb).nonzero().flatten()
    assert diff.numel() == 0, f"{diff.numel()} bytes differ, first at {diff[:8].tolist()}"


CASES = [  # (format, dim, rope)
    ("bf16", 128, 64), ("bf16", 512, 64),
    ("fp8_ds_mla", 128, 64), ("fp8_ds_mla", 512, 64), ("fp8_ds_mla", 576, 0),
    ("fp8", 128, 0), ("fp8", 384, 0),
    ("fp4", 128, 0), ("fp4", 96, 0),
]


@kernel_runs
@pytest.mark.parametrize("name,dim,rope", CASES)
@pytest.mark.parametrize("block", [16, 64])
def test_store_rows_writes_the_torch_bytes(name: str, dim: int, rope: int, block: int) -> None:
    make, tile, qmax = FORMATS[name]
    a, b = twin_stores(make(dim, rope), block, DEV, seed=block + dim)
    slots, rows = pairs(block, 24, seed=dim + block)
    values = adversarial(slots.numel(), dim, tile, qmax, BF16, seed=dim * block)
    write_both(a, b, slots, rows, values)
    assert_same_bytes(a, b)


@kernel_runs
@pytest.mark.parametrize("name,dim,rope", [("bf16", 128, 64), ("fp8_ds_mla", 128, 64),
                                            ("fp8", 128, 0), ("fp4", 128, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_rows_other_value_dtypes(name: str, dim: int, rope: int,
                                       dtype: torch.dtype) -> None:
    """float32 values (more mantissa than bf16: ties of the bf16 rope / dense cast, and values
    between the E4M3 grid's ties) and float16 values write the torch path's bytes too."""
    make, tile, qmax = FORMATS[name]
    a, b = twin_stores(make(dim, rope), 16, DEV, seed=3)
    slots, rows = pairs(16, 20, seed=4)
    values = adversarial(slots.numel(), dim, tile, qmax, torch.float64, seed=5)
    if dtype == torch.float32:  # bf16 rounding ties, and a random low mantissa elsewhere
        noise = torch.randn(values.shape, dtype=torch.float64,
                            generator=torch.Generator().manual_seed(6))
        tied = values * (1.0 + 2.0 ** -8)
        values = torch.where(noise > 0, tied, values * (1.0 + noise * 1e-4))
    else:
        values = values.clamp(-60000.0, 60000.0)
    write_both(a, b, slots, rows, values.to(dtype))
    assert_same_bytes(a, b)


@kernel_runs
def test_store_rows_dense_float32_store() -> None:
    """An ``auto`` store of a float32 layer (dense float32) takes bf16 and float32 values."""
    fmt = kv_format("auto", 128, 64, torch.float32)
    a, b = twin_stores(fmt, 16, DEV, seed=7)
    slots, rows = pairs(16, 12, seed=8)
    for dtype in (BF16, torch.float32):
        values = torch.randn(slots.numel(), 128, generator=torch.Generator().manual_seed(9))
        write_both(a, b, slots, rows, values.to(dtype))
        assert_same_bytes(a, b)


@kernel_runs
def test_store_rows_empty_and_skipped_only() -> None:
    """N == 0 writes nothing; pairs that are all skipped write nothing."""
    a, b = twin_stores(kv_format("fp8_ds_mla", 128, 64, BF16), 16, DEV, seed=10)
    before = raw(b).clone()
    empty = torch.zeros(0, dtype=torch.int64, device=DEV)
    store_rows(b, empty, empty, torch.zeros(0, 128, dtype=BF16, device=DEV))
    slots = torch.tensor([0, 1, 3, 2], device=DEV)
    rows = torch.tensor([-5, 3, 16, 1000], device=DEV)
    store_rows(b, slots, rows, torch.randn(4, 128, device=DEV).to(BF16))
    assert torch.equal(raw(b), before)


@kernel_runs
def test_store_rows_problem_reasons() -> None:
    kv = PagedStore("kv", kv_format("fp8_ds_mla", 128, 64, BF16), 16, 4, 2, 4,
                    torch.device(DEV))
    ok = torch.zeros(3, 128, dtype=BF16, device=DEV)
    assert store_rows_problem(kv, ok) == ""
    assert store_rows_problem(kv, ok.float()) == ""
    assert "float64" in store_rows_problem(kv, ok.double())
    assert "int32" in store_rows_problem(kv, ok.int())
    assert "[N, 128]" in store_rows_problem(kv, torch.zeros(3, 64, dtype=BF16, device=DEV))
    assert "[N, 128]" in store_rows_problem(kv, torch.zeros(128, dtype=BF16, device=DEV))
    half = PagedStore("kv", kv_format("auto", 128, 64, torch.float16), 16, 4, 2, 4,
                      torch.device(DEV))
    assert "float16" in store_rows_problem(half, ok)
    with pytest.raises(TypeError, match="float64"):
        store_rows(kv, torch.zeros(3, dtype=torch.int64, device=DEV),
                   torch.zeros(3, dtype=torch.int64, device=DEV), ok.double())
    with pytest.raises(ValueError, match="rows must be"):
        store_rows(kv, torch.zeros(3, dtype=torch.int64, device=DEV),
                   torch.zeros(2, dtype=torch.int64, device=DEV), ok)
    with pytest.raises(TypeError, match="slots must be int64"):
        store_rows(kv, torch.zeros(3, device=DEV), torch.zeros(3, dtype=torch.int64,
                                                               device=DEV), ok)


@kernel_runs
def test_store_rows_problem_cpu_store_without_interpreter(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    import dsv4.kernels.store_rows as mod

    monkeypatch.setattr(mod, "_INTERPRET", False)
    kv = PagedStore("kv", kv_format("bf16", 128, 64, BF16), 16, 4, 2, 4, torch.device("cpu"))
    assert "CUDA" in store_rows_problem(kv, torch.zeros(1, 128, dtype=BF16))


@pytest.mark.skipif(triton_available(), reason="checks the reason given without Triton")
def test_store_rows_problem_without_triton() -> None:
    kv = PagedStore("kv", kv_format("bf16", 128, 64, BF16), 16, 4, 2, 4, torch.device("cpu"))
    assert "Triton" in store_rows_problem(kv, torch.zeros(1, 128, dtype=BF16))


# ------------------------------------------------------------------------------ GPU only

FLASH = [("fp8_ds_mla", 512, 64), ("bf16", 512, 64), ("fp8", 128, 0), ("fp4", 128, 0)]


def flash_stores(name: str, dim: int, rope: int, seed: int) -> tuple[PagedStore, PagedStore]:
    make, _, _ = FORMATS[name]
    return twin_stores(make(dim, rope), 64, "cuda", seed=seed, num_blocks=40, max_seqs=8,
                       max_logical=16)


@needs_gpu
@pytest.mark.cuda
@pytest.mark.parametrize("name,dim,rope", FLASH)
@pytest.mark.parametrize("n", [1, 16, 64])
def test_store_rows_flash_shapes(name: str, dim: int, rope: int, n: int) -> None:
    make, tile, qmax = FORMATS[name]
    a, b = flash_stores(name, dim, rope, seed=n)
    slots, rows = pairs(64, max(n, 7), seed=n)
    slots, rows = slots[:n], rows[:n]
    values = adversarial(n, dim, tile, qmax, BF16, seed=n + dim)
    write_both(a, b, slots, rows, values)
    assert_same_bytes(a, b)


@needs_gpu
@pytest.mark.cuda
@pytest.mark.parametrize("name,dim,rope", FLASH)
def test_store_rows_graph_replay(name: str, dim: int, rope: int) -> None:
    """Captured once, replayed on new values and rows: the bytes of the torch path each time."""
    from dsv4.runner import capture_graph

    make, tile, qmax = FORMATS[name]
    a, b = flash_stores(name, dim, rope, seed=1)
    n = 16
    s0, r0 = pairs(64, n, seed=20)
    slots, rows = s0.cuda(), r0.cuda()
    values = adversarial(n, dim, tile, qmax, BF16, seed=21).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up off the capture
        store_rows(b, slots, rows, values)
    torch.cuda.current_stream().wait_stream(side)
    flat = a.flat_rows(slots, rows)
    a.write(flat[flat >= 0], values[flat >= 0])
    graph = torch.cuda.CUDAGraph()
    with capture_graph(graph):
        store_rows(b, slots, rows, values)
    for seed in (22, 23):
        s1, r1 = pairs(64, n, seed=seed)
        slots.copy_(s1)
        rows.copy_(r1)
        values.copy_(adversarial(n, dim, tile, qmax, BF16, seed=seed))
        graph.replay()
        flat = a.flat_rows(slots, rows)
        keep = flat >= 0
        a.write(flat[keep], values[keep])
        torch.cuda.synchronize()
        assert_same_bytes(a, b)
