"""A store's window release scans only the blocks that may still be held
(``PagedStore._released_below``): any sequence of grows, releases (with and without a call's
``from_logical`` floor, one slot at a time or a step's slots at once), shrinks and forks leaves
every block table and the free list exactly as a store that scans every logical block from 0,
one slot at a time, does."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dsv4.cache.blocks import CacheCapacityError
from dsv4.cache.formats import DenseFormat
from dsv4.cache.store import PagedStore

B, SLOTS, LOGICAL = 4, 3, 24


class _ScanFromZero(list):
    """``_released_below`` that always answers 0 and forgets what it is told (the old scan)."""

    def __getitem__(self, i):  # type: ignore[override]
        return 0

    def __setitem__(self, i, v):  # type: ignore[override]
        pass


def _store() -> PagedStore:
    return PagedStore("kv", DenseFormat("auto", 8, torch.float32), B, 64, SLOTS, LOGICAL,
                      torch.device("cpu"))


OPS = st.one_of(
    st.tuples(st.just("grow"), st.integers(0, SLOTS - 1), st.integers(0, B * 12)),
    st.tuples(st.just("release"), st.integers(0, SLOTS - 1), st.integers(0, B * 14),
              st.integers(0, 6)),
    st.tuples(st.just("shrink"), st.integers(0, SLOTS - 1), st.integers(0, 12)),
    st.tuples(st.just("release_each"), st.lists(st.integers(0, B * 14), min_size=SLOTS,
                                                max_size=SLOTS),
              st.none() | st.lists(st.integers(0, 6), min_size=SLOTS, max_size=SLOTS)),
    st.tuples(st.just("fork"), st.integers(0, SLOTS - 1), st.integers(0, SLOTS - 1),
              st.integers(0, B * 6)),
)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(OPS, min_size=1, max_size=40))
@example(ops=[("grow", 0, 40), ("release", 0, 32, 0), ("shrink", 0, 3), ("grow", 0, 40),
              ("release", 0, 36, 0)])  # shrunk below the watermark, grown again
@example(ops=[("grow", 0, 40), ("release", 0, 12, 5), ("release", 0, 24, 0)])  # a floor
@example(ops=[("grow", 0, 40), ("release", 0, 32, 0), ("fork", 0, 1, 36),
              ("release", 1, 40, 0)])  # a fork of a released prefix
def test_release_scans_from_the_watermark_like_from_zero(ops):
    fast, slow = _store(), _store()
    slow._released_below = _ScanFromZero([0] * SLOTS)
    for op in ops:
        for store in (fast, slow):
            kind = op[0]
            if kind == "grow":
                _, slot, rows = op
                if store.blocks_needed(slot, rows) <= store.alloc.num_free:
                    store.grow(slot, rows)
            elif kind == "release":
                _, slot, first_row, floor = op
                store.release_before(slot, first_row, floor)
            elif kind == "release_each":  # the fast store batched, the slow one per slot
                _, firsts, floors = op
                if store is fast:
                    store.release_before_each(list(range(SLOTS)), firsts, floors)
                else:
                    for slot in range(SLOTS):
                        store.release_before(slot, firsts[slot],
                                             0 if floors is None else floors[slot])
            elif kind == "shrink":
                _, slot, logical = op
                store.shrink_to(slot, logical)
            else:
                _, src, dst, rows = op
                if src != dst and store.holds_rows(src, 0, rows) and store.alloc.num_free:
                    store.shrink_to(dst, 0)
                    store.fork(src, dst, rows)
        assert fast._blocks == slow._blocks
        assert torch.equal(fast.table, slow.table)
        assert fast.alloc.num_free == slow.alloc.num_free
        for slot in range(SLOTS):  # the invariant the scan relies on
            held = fast._blocks[slot]
            below = fast._released_below[slot]
            assert below <= len(held) and all(b == -1 for b in held[:below])


def test_a_long_sequences_window_release_does_not_rescan_its_history():
    """After the first release, a step's release looks at the blocks above the watermark only
    (a spy on the held list's reads)."""
    store = _store()
    store.grow(0, B * 20)
    store.release_before(0, B * 18)
    assert store._released_below[0] == 18

    class Reads(list):
        count = 0

        def __getitem__(self, i):
            Reads.count += 1
            return super().__getitem__(i)

    store._blocks[0] = Reads(store._blocks[0])
    store.release_before(0, B * 19)
    # the one block between the watermark and the new boundary: its test and its release
    # (a scan from 0 reads all 19)
    assert Reads.count == 2 and store._released_below[0] == 19


def _mirrored(slots: int = SLOTS) -> PagedStore:
    """A store whose table has a device mirror of its own (on the CPU here; a GPU's is
    another tensor too)."""
    store = PagedStore("kv", DenseFormat("auto", 8, torch.float32), B, 256, slots, LOGICAL,
                       torch.device("cpu"))
    store.table_dev = store.table.clone()
    return store


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(OPS, min_size=1, max_size=30), every=st.integers(1, 4))
def test_the_device_table_mirrors_the_host_after_every_sync(ops, every):
    """Whatever grows, releases, shrinks and forks ran since the last sync - one slot or
    several, near or far apart - after ``sync`` the device mirror equals the host table."""
    store = _mirrored()
    for i, op in enumerate(ops):
        kind = op[0]
        if kind == "grow" and store.blocks_needed(op[1], op[2]) <= store.alloc.num_free:
            store.grow(op[1], op[2])
        elif kind == "release":
            store.release_before(op[1], op[2], op[3])
        elif kind == "release_each":
            store.release_before_each(list(range(SLOTS)), op[1], op[2])
        elif kind == "shrink":
            store.shrink_to(op[1], op[2])
        elif kind == "fork":
            _, src, dst, rows = op
            if src != dst and store.holds_rows(src, 0, rows) and store.alloc.num_free:
                store.shrink_to(dst, 0)
                store.fork(src, dst, rows)
        if i % every == every - 1 or i == len(ops) - 1:
            store.sync()
            assert torch.equal(store.table_dev, store.table), ops[:i + 1]


def test_many_slots_opening_a_block_in_one_step_sync_in_one_copy(monkeypatch):
    """A step in which 16 sequences of equal length each open a block: one copy of the box
    around the changed cells, not 16; far-apart changes in a wide table stay one per slot."""
    import dsv4.cache.store as store_module

    copies: list[tuple[int, ...]] = []
    real = store_module.upload_into

    def counting(dst: torch.Tensor, host: torch.Tensor) -> None:
        copies.append(tuple(dst.shape))
        real(dst, host)

    monkeypatch.setattr(store_module, "upload_into", counting)
    store = _mirrored(slots=16)
    for slot in range(16):
        store.grow(slot, B * 3)
    store.sync()
    copies.clear()
    for slot in range(16):
        store.grow(slot, B * 3 + 1)  # the fourth block of each
    store.sync()
    assert copies == [(16, 1)]
    assert torch.equal(store.table_dev, store.table)


def test_the_padding_block_starts_as_zeros():
    """The padding slot's block (where a padded step's tokens and unused jobs land) starts as
    zeros in every stored format: a padded step may leave its entry 0 unwritten, and what a
    padded query reads there must be finite. The blocks handed to sequences stay uninitialised."""
    from dsv4.cache.formats import index_format, kv_format

    for fmt in (DenseFormat("bf16", 16, torch.bfloat16),
                kv_format("fp8_ds_mla", 512, 64, torch.bfloat16),
                index_format("fp4", 128, torch.bfloat16)):
        # storage the allocator reuses: the blocks freed by a store filled with non-zeros
        old = PagedStore("s", fmt, 4, 3, 3, 4, torch.device("cpu"), padding_slot=2)
        old.data.fill_(0x7F if old.data.dtype == torch.uint8 else 7.0)
        del old
        store = PagedStore("s", fmt, 4, 3, 3, 4, torch.device("cpu"), padding_slot=2)
        assert store.table[2, 0] == 3
        assert not store.data[3].any()


@settings(max_examples=200, deadline=None)
@given(start=st.lists(st.integers(0, B * 8), min_size=SLOTS, max_size=SLOTS),
       grow=st.lists(st.integers(0, B * 12), min_size=SLOTS, max_size=SLOTS),
       order=st.permutations(list(range(SLOTS))))
def test_grow_each_takes_the_blocks_separate_grows_take(start, grow, order):
    """``grow_each`` (a step's sequences in one call: one allocation, one table write) leaves
    the tables, the blocks held and the free list as separate ``grow`` calls in the same order;
    a pair past the table's length is refused before any block is taken."""
    one, each = _store(), _store()
    for slot, rows in enumerate(start):
        one.grow(slot, rows)
        each.grow(slot, rows)
    want = [one.grow(s, grow[s]) for s in order]
    assert each.grow_each(order, [grow[s] for s in order]) == want
    assert torch.equal(one.table, each.table)
    assert one._blocks == each._blocks and one.alloc._free == each.alloc._free
    table, free = each.table.clone(), list(each.alloc._free)
    try:
        each.grow_each(order, [B * LOGICAL + 1 if s == order[-1] else B * 16 for s in order])
    except CacheCapacityError:
        pass
    else:
        raise AssertionError("a pair past the table's length was not refused")
    assert torch.equal(each.table, table) and each.alloc._free == free


def test_grow_each_refuses_a_slot_twice():
    store = _store()
    with pytest.raises(ValueError, match="grow_each takes each slot once"):
        store.grow_each([0, 1, 0], [B, B, 2 * B])
    assert store.alloc.num_free == 64 and not store._blocks[0]
