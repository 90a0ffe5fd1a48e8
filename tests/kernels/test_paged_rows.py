"""The paged-rows kernels (dsv4.kernels.paged_rows) against PagedStore.flat_rows: window rows
and entry rows of a step, over slots with released and never-held blocks; the visible-entries
selection against the torch path's."""

from __future__ import annotations

import pytest
import torch

from dsv4.cache.formats import kv_format
from dsv4.cache.store import PagedStore

from conftest import KERNEL_DEV, kernel_runs, needs_gpu

DEV = KERNEL_DEV


def _store(block: int, device: str = DEV, seed: int = 0) -> tuple[PagedStore, list[int]]:
    """Four slots holding 0, 1, 5 and 9 blocks' worth of rows (blocks allocated in a shuffled
    order); slot 3 released its first two blocks (a window that moved on)."""
    fmt = kv_format("bf16", 64, 16, torch.bfloat16)
    store = PagedStore("kv", fmt, block, 40, 4, 12, torch.device(device))
    g = torch.Generator().manual_seed(seed)
    store.alloc.allocate(int(torch.randint(1, 5, (1,), generator=g)))  # physical != logical
    lengths = [0, block - 3, 5 * block - 1, 9 * block]
    for slot, n in enumerate(lengths):
        store.grow(slot, n)
    store.release_before(3, 2 * block + 1)
    store.sync()
    return store, lengths


def _queries(lengths: list[int], t: int, device: str, seed: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    slots = torch.randint(0, len(lengths), (t,), generator=g)
    pos = torch.stack([torch.randint(0, max(1, lengths[int(s)]), (1,), generator=g)[0]
                       for s in slots])
    return pos.to(device), slots.to(device)


@kernel_runs
@pytest.mark.parametrize("out", [torch.int64, torch.int32])
@pytest.mark.parametrize("block,window,t", [(16, 8, 5), (16, 128, 33), (64, 128, 64),
                                            (64, 300, 3), (16, 1, 4)])
def test_window_rows_match_the_store(block, window, t, out):
    from dsv4.kernels.paged_rows import window_flat_rows

    store, lengths = _store(block)
    pos, slots = _queries(lengths, t, DEV, seed=block + window)
    rows = pos[:, None] - (window - 1) + torch.arange(window, device=DEV)
    want = store.flat_rows(slots[:, None], torch.where(rows >= 0, rows, -1))
    got = window_flat_rows(store, pos, slots, window, dtype=out)
    assert got.dtype == out and torch.equal(got.long(), want)
    assert (got == -1).any()  # positions before 0 and released blocks are covered


@kernel_runs
@pytest.mark.parametrize("out", [torch.int64, torch.int32])
@pytest.mark.parametrize("dtype", [torch.long, torch.int32])
@pytest.mark.parametrize("block,k,t", [(16, 7, 6), (64, 512, 16), (16, 300, 2)])
def test_entry_rows_match_the_store(block, k, t, dtype, out):
    from dsv4.kernels.paged_rows import entry_flat_rows

    store, lengths = _store(block, seed=k)
    _, slots = _queries(lengths, t, DEV, seed=k)
    g = torch.Generator().manual_seed(k + t)
    entries = torch.randint(-1, 10 * block, (t, k), generator=g).to(DEV)
    entries[:, -3:] = -1
    want = store.flat_rows(slots[:, None], entries)
    got = entry_flat_rows(store, entries.to(dtype), slots, dtype=out)
    assert got.dtype == out and torch.equal(got.long(), want)
    # a non-contiguous view (a column slice) reads the same rows
    assert torch.equal(entry_flat_rows(store, entries[:, ::2].to(dtype), slots,
                                       dtype=out).long(),
                       store.flat_rows(slots[:, None], entries[:, ::2]))


@kernel_runs
def test_flat_row_dtypes_are_checked():
    from dsv4.kernels.paged_rows import entry_flat_rows, window_flat_rows

    store, lengths = _store(16)
    pos, slots = _queries(lengths, 3, DEV, seed=0)
    with pytest.raises(ValueError, match="int64 or int32"):
        window_flat_rows(store, pos, slots, 8, dtype=torch.int16)
    store.alloc.num_blocks = 1 << 28  # 2^32 rows of 16: past int32 (the check reads the count)
    with pytest.raises(ValueError, match="do not fit int32"):
        entry_flat_rows(store, torch.zeros(3, 4, dtype=torch.long, device=DEV), slots,
                        dtype=torch.int32)


@kernel_runs
@pytest.mark.parametrize("ratio", [4, 128])
def test_visible_entries_match_the_torch_path(ratio):
    """Every entry j < (pos + 1) // ratio, ascending, -1 after: the values of the base layer's
    selection at positions around the ratio's multiples, the step's widest row and wider ones
    (several loop iterations of the kernel), and a step that sees none yet."""
    from dsv4.attention import _every_visible_entry
    from dsv4.kernels.paged_rows import visible_entry_rows

    store, _ = _store(16, seed=ratio)
    pos = torch.tensor([0, ratio - 2, ratio - 1, ratio, 3 * ratio + 1, 700 * ratio - 1, 5],
                       device=DEV)
    slots = torch.zeros_like(pos)
    widest = int((pos.max() + 1) // ratio)
    for n in (widest, widest + 300):
        got = visible_entry_rows(store, pos, slots, n, ratio)[0]
        assert got.dtype == torch.long and got.shape == (7, n)
        assert torch.equal(got.cpu(), _every_visible_entry(pos.cpu(), n, ratio))
    early = torch.tensor([0, 1, 2], device=DEV)
    assert visible_entry_rows(store, early, early * 0, 0, ratio)[0].shape == (3, 0)


@kernel_runs
@pytest.mark.parametrize("out", [torch.int64, torch.int32])
@pytest.mark.parametrize("block,ratio", [(16, 4), (64, 4), (16, 128)])
def test_visible_entry_rows_in_one_launch(block, ratio, out):
    """The visible entries and their flat rows in one launch: the values of
    the torch selection and ``entry_flat_rows`` of it, on slots with released and never-held
    blocks, rows narrower and wider than the kernel's loop block."""
    from dsv4.attention import _every_visible_entry
    from dsv4.kernels.paged_rows import (
        entry_flat_rows,
        visible_entry_rows,
        window_flat_rows,
    )

    store, lengths = _store(block, seed=ratio)
    kv, _ = _store(16 if block == 64 else 64, seed=ratio + 1)  # another store, other tables
    pos, slots = _queries(lengths, 9, DEV, seed=block)
    pos = pos * (ratio // 4 if ratio > 4 else 1)  # C128: positions that see some entries
    widest = int((pos.max() + 1) // ratio)
    for n in (widest, widest + 300, 0):
        entries, rows, win = visible_entry_rows(store, pos, slots, n, ratio, dtype=out)
        want = _every_visible_entry(pos.cpu(), n, ratio).to(DEV)
        assert entries.dtype == torch.long and torch.equal(entries, want) and win is None
        assert rows.dtype == out and torch.equal(rows, entry_flat_rows(store, want, slots, out))
        # the kv store's window rows in the same launch (the second column of programs)
        for w in (128, 7):
            e2, r2, win = visible_entry_rows(store, pos, slots, n, ratio, out, (kv, w))
            assert torch.equal(e2, want) and torch.equal(r2, rows)
            assert win is not None and win.dtype == out
            assert torch.equal(win, window_flat_rows(kv, pos, slots, w, out))
    none = torch.zeros(0, dtype=torch.long, device=DEV)
    e, r, _ = visible_entry_rows(store, none, none, 5, ratio)
    assert e.shape == r.shape == (0, 5)
    with pytest.raises(ValueError, match="ratio >= 1"):
        visible_entry_rows(store, pos, slots, 4, 0)
    with pytest.raises(ValueError, match="pos"):
        visible_entry_rows(store, pos, slots[:-1], 4, ratio)


@kernel_runs
@pytest.mark.parametrize("out", [torch.int64, torch.int32])
@pytest.mark.parametrize("k", [512, 7, 0])
def test_entry_and_window_rows_in_one_launch(k, out):
    from dsv4.kernels.paged_rows import entry_and_window_rows, entry_flat_rows, window_flat_rows

    store, lengths = _store(64, seed=k)
    kv, kv_lengths = _store(16, seed=k + 1)
    pos, slots = _queries(kv_lengths, 12, DEV, seed=k)
    g = torch.Generator().manual_seed(k)
    entries = torch.randint(-1, 10 * 64, (12, k), generator=g).to(DEV)
    rows, win = entry_and_window_rows(store, entries, pos, slots, (kv, 128), out)
    assert rows.dtype == win.dtype == out
    assert torch.equal(rows, entry_flat_rows(store, entries, slots, out))
    assert torch.equal(win, window_flat_rows(kv, pos, slots, 128, out))
    with pytest.raises(ValueError, match="window must be"):
        entry_and_window_rows(store, entries, pos, slots, (kv, 0), out)
    with pytest.raises(ValueError, match="rows"):
        entry_and_window_rows(store, entries, pos[:-1], slots, (kv, 8), out)


@kernel_runs
def test_empty_steps_and_bad_shapes():
    from dsv4.kernels.paged_rows import entry_flat_rows, window_flat_rows

    store, _ = _store(16)
    none = torch.zeros(0, dtype=torch.long, device=DEV)
    assert window_flat_rows(store, none, none, 8).shape == (0, 8)
    assert entry_flat_rows(store, torch.zeros(3, 0, dtype=torch.long, device=DEV),
                           torch.zeros(3, dtype=torch.long, device=DEV)).shape == (3, 0)
    with pytest.raises(ValueError, match="pos"):
        window_flat_rows(store, torch.zeros(2, dtype=torch.long, device=DEV), none, 8)
    with pytest.raises(ValueError, match="window"):
        window_flat_rows(store, none, none, 0)
    with pytest.raises(ValueError, match=r"rows \(4,\)"):
        entry_flat_rows(store, torch.zeros(4, dtype=torch.long, device=DEV), none)


@needs_gpu
def test_graph_replay_follows_new_positions_and_tables():
    from dsv4.kernels.paged_rows import entry_flat_rows, window_flat_rows

    store, lengths = _store(64, device="cuda")
    pos, slots = _queries(lengths, 16, "cuda", seed=1)
    entries = torch.randint(0, 500, (16, 512), device="cuda")
    window_flat_rows(store, pos, slots, 128)
    entry_flat_rows(store, entries, slots)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        win = window_flat_rows(store, pos, slots, 128)
        ent = entry_flat_rows(store, entries, slots)
    pos.copy_(pos.flip(0))
    entries.random_(0, 600)
    store.grow(1, 6 * 64)
    store.sync()
    graph.replay()
    rows = pos[:, None] - 127 + torch.arange(128, device="cuda")
    assert torch.equal(win, store.flat_rows(slots[:, None], torch.where(rows >= 0, rows, -1)))
    assert torch.equal(ent, store.flat_rows(slots[:, None], entries))
