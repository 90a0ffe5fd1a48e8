"""One paged store of a layer's cache: rows in blocks, a block table per sequence slot.

Row i of a sequence (its position for window rows, its entry index for compressed entries and
indexer keys) lives in logical block i // block_size at offset i % block_size; the slot's block
table maps the logical block to a physical one (-1: not held). A flat row index
``physical * block_size + offset`` addresses the storage (what a paged kernel takes).

The table is kept on the host (the allocator's truth) and mirrored on the device, where the
forward turns (slot, row) into flat rows without a host round trip. A CPU store keeps a mirror
of its own too, so the CPU runs every copy a GPU needs: a table change that never reaches the
mirror fails there as it would on a GPU (the table and its mirror were once one tensor on the
CPU, which hid a fork's rows that waited for a later step's copy).

The storage holds one block more than the allocator hands out: the padding block, the first
(and only) block of the padding slot's table row (``padding_slot``). The padded tokens of a
fixed-shape step write their rows there (position 0, entry 0), where no sequence reads; it
starts as zeros, so whatever a padded query reads there is finite.
"""

from __future__ import annotations

import torch

from dsv4.cache.blocks import BlockAllocator, CacheCapacityError
from dsv4.cache.formats import RowFormat
from dsv4.config import ceil_div
from dsv4.host_copy import upload_into

_BOX_CELLS = 16384
"""A table sync copies the box around several changed slots in one copy while it holds at
most this many cells (64 KiB of int32) or 4x the changed ones."""


class PagedStore:
    def __init__(self, name: str, fmt: RowFormat, block_size: int, num_blocks: int,
                 max_seqs: int, max_logical: int, device: torch.device,
                 padding_slot: int | None = None) -> None:
        self.name = name
        self.fmt = fmt
        self.block_size = block_size
        self.max_logical = max_logical
        self.alloc = BlockAllocator(num_blocks, f"{name} store")
        self.block_bytes = fmt.block_bytes(block_size)
        self.data = fmt.allocate(num_blocks + 1, block_size, device)
        self.table = torch.full((max_seqs, max_logical), -1, dtype=torch.int32)
        self._cells = self.table.numpy()
        """The host table's memory as a numpy array: the allocator writes the table through it
        (a numpy write of a few cells costs ~0.3 us, a torch indexed write ~5 us: at 64
        sequences x 8 layers a step that opens or releases a block each wrote 512 times)."""
        if padding_slot is not None:  # the padding block (module docstring), never released
            self._cells[padding_slot, 0] = num_blocks
            # zeros: a padded step's unused compressor jobs may leave entry 0 unwritten
            # (``compress_entries(skip_slot=)``), and what a padded query reads must be finite
            self.data[num_blocks].zero_()
        self.table_dev = self.table.clone() if device.type == "cpu" else self.table.to(device)
        self._blocks: list[list[int]] = [[] for _ in range(max_seqs)]
        """Physical block of each logical block per slot (-1: released), the host's truth."""
        self._released_below = [0] * max_seqs
        """Per slot: every logical block below this one is released (-1), so
        :meth:`release_before` scans from here - a decode step's window release then costs the
        same at any context instead of a pass over all of a sequence's earlier blocks."""
        self._dirty: dict[int, tuple[int, int]] = {}

    # ------------------------------------------------------------------ queries
    def held_blocks(self, slot: int) -> int:
        return sum(1 for b in self._blocks[slot] if b >= 0)

    def num_logical(self, slot: int) -> int:
        return len(self._blocks[slot])

    def blocks_needed(self, slot: int, rows: int) -> int:
        """New blocks slot needs to hold rows 0 .. rows - 1 (the released ones stay released)."""
        return self.blocks_needed_each([slot], [rows])[0]

    def blocks_needed_each(self, slots: list[int], rows: list[int]) -> list[int]:
        """:meth:`blocks_needed` of each (slot, rows) pair, in one call: a step's plan asks it
        for every sequence of every store (192 calls a step at 64 sequences, ~40 % of the
        plan's host time as separate calls)."""
        b, held = self.block_size, self._blocks
        return [max(0, -(-n // b) - len(held[s])) for s, n in zip(slots, rows, strict=True)]

    def holds_rows(self, slot: int, first: int, end: int) -> bool:
        if end <= first:
            return True
        held = self._blocks[slot]
        hi = ceil_div(end, self.block_size)
        return hi <= len(held) and all(b >= 0 for b in held[first // self.block_size: hi])

    # ------------------------------------------------------------------ changes
    def grow(self, slot: int, rows: int) -> int:
        """Hold rows 0 .. rows - 1 (allocate the missing blocks); returns how many logical
        blocks the slot had before (what :meth:`shrink_to` restores)."""
        return self.grow_each([slot], [rows])[0]

    def grow_each(self, slots: list[int], rows: list[int]) -> list[int]:
        """:meth:`grow` of each (slot, rows) pair, in one call: every check before any block is
        taken, the blocks taken in one allocation (in the order the separate calls would take
        them: the same blocks each) and written into the host table in one assignment. A step in
        which 64 sequences open a block in each of 8 layers' stores took ~6 ms of host time in
        separate calls (a table write each), 10x a step's plan on the dev CPU."""
        if len(set(slots)) != len(slots):
            raise ValueError(f"{self.name} store: grow_each takes each slot once, got {slots}")
        held = self._blocks
        befores = [len(held[s]) for s in slots]
        afters = [k + n for k, n in zip(befores, self.blocks_needed_each(slots, rows),
                                        strict=True)]
        if afters and max(afters) > self.max_logical:
            r = rows[afters.index(max(afters))]
            raise CacheCapacityError(f"{self.name} store: {r} rows exceed the table's "
                                     f"{self.max_logical * self.block_size} rows per sequence")
        total = sum(afters) - sum(befores)
        if not total:
            return befores
        new = self.alloc.allocate(total)
        ii: list[int] = []
        jj: list[int] = []
        at = 0
        for s, lo, hi in zip(slots, befores, afters, strict=True):
            if hi > lo:
                held[s] += new[at:at + hi - lo]
                at += hi - lo
                ii += [s] * (hi - lo)
                jj += range(lo, hi)
                self._mark(s, lo, hi)
        self._cells[ii, jj] = new
        return befores

    def shrink_to(self, slot: int, logical: int) -> None:
        """Undo :meth:`grow`: release the logical blocks from ``logical`` on."""
        held = self._blocks[slot]
        if len(held) <= logical:
            return
        for b in reversed(held[logical:]):  # last taken first: the free list as before
            if b >= 0:
                self.alloc.release(b)
        end = len(held)
        del held[logical:]
        self._released_below[slot] = min(self._released_below[slot], logical)
        self._cells[slot, logical:end] = -1
        self._mark(slot, logical, end)

    def release_before(self, slot: int, first_row: int, from_logical: int = 0) -> None:
        """Release the slot's blocks whose rows all lie before ``first_row`` (window rows no
        query can read any more), only among logical blocks ``from_logical`` and later."""
        self.release_before_each([slot], [first_row], [from_logical])

    def release_before_each(self, slots: list[int], first_rows: list[int],
                            from_logical: list[int] | None = None) -> None:
        """:meth:`release_before` of each slot, in one call (a step's commit: its sequences).
        Scans only the blocks from the slot's watermark (or ``from_logical``, if higher) to the
        new first row's block: none at all in all but one step in a block's worth."""
        b, blocks, watermark = self.block_size, self._blocks, self._released_below
        for k, (slot, first_row) in enumerate(zip(slots, first_rows, strict=True)):
            below = watermark[slot]
            if first_row // b <= below:
                continue  # the common case: nothing past the watermark to release
            floor = 0 if from_logical is None else from_logical[k]
            held = blocks[slot]
            last = min(first_row // b, len(held))
            if last <= max(floor, below):
                continue  # nothing between the watermark (or floor) and ``last``
            changed = [i for i in range(max(floor, below), last) if held[i] >= 0]
            for i in changed:
                self.alloc.release(held[i])
                held[i] = -1
            if floor <= below:  # everything below ``last`` is released now
                watermark[slot] = last
            if changed:  # one write of the span (its other entries are -1 already): a long
                # prefill releases hundreds of blocks, one indexed write each cost ~5 us
                self._cells[slot, changed[0]:changed[-1] + 1] = -1
                self._mark(slot, changed[0], changed[-1] + 1)

    def shared_partial_block(self, slot: int, rows: int) -> int | None:
        """The logical block holding row ``rows`` (the next row written after a truncation to
        ``rows`` rows) when it also holds earlier rows and is shared with another sequence (a
        fork): the one block a truncation must copy before writing there. None otherwise."""
        if not rows % self.block_size:
            return None  # the next row starts a block: nothing before it to keep
        logical = rows // self.block_size
        held = self._blocks[slot]
        if logical >= len(held) or held[logical] < 0:
            return None
        return logical if self.alloc.refcount(held[logical]) > 1 else None

    def make_private(self, slot: int, logical: int) -> None:
        """Give the slot its own copy of a shared logical block (copy-on-write); needs a free
        block."""
        held = self._blocks[slot]
        old = held[logical]
        (new,) = self.alloc.allocate(1)
        b = self.block_size
        offsets = torch.arange(b, device=self.data.device)
        self.fmt.copy_rows(self.data, old * b + offsets, new * b + offsets)
        self.alloc.release(old)
        held[logical] = new
        self._cells[slot, logical] = new
        self._mark(slot, logical, logical + 1)

    def release_all(self, slot: int) -> None:
        self.shrink_to(slot, 0)

    def check_fork(self, src: int, rows: int) -> None:
        """Raise if forking ``rows`` rows of ``src`` would need more blocks than are free."""
        if rows % self.block_size and self.alloc.num_free < 1:
            raise CacheCapacityError(f"{self.name} store: no free block for the forked "
                                     "sequence's partial block")

    def fork(self, src: int, dst: int, rows: int) -> None:
        """Give ``dst`` the first ``rows`` rows of ``src``: full blocks shared, the partial last
        block copied (it is the one the two sequences will write next)."""
        full = rows // self.block_size
        held = self._blocks[src]
        mine = []
        for i in range(full):
            if held[i] >= 0:
                self.alloc.share(held[i])
            mine.append(held[i])
        if rows % self.block_size:
            (copy,) = self.alloc.allocate(1)
            b = self.block_size
            offsets = torch.arange(rows % b, device=self.data.device)
            self.fmt.copy_rows(self.data, held[full] * b + offsets, copy * b + offsets)
            mine.append(copy)
        self._blocks[dst] = mine
        self._released_below[dst] = 0  # a lower bound: the first release scans from 0
        self._cells[dst] = -1
        self._cells[dst, :len(mine)] = mine
        self._mark(dst, 0, self.max_logical)

    def _mark(self, slot: int, lo: int, hi: int) -> None:
        old = self._dirty.get(slot)
        self._dirty[slot] = (lo, hi) if old is None else (min(lo, old[0]), max(hi, old[1]))

    def sync(self) -> None:
        """Copy the changed parts of the host table to the device mirror: one copy of the box
        around them where it is small (a step in which many sequences open a block, e.g. a
        batch of equal lengths, is one copy, not one per sequence), else one per slot."""
        dirty = self._dirty
        if not dirty:
            return
        if len(dirty) > 1:
            s0, s1 = min(dirty), max(dirty) + 1
            lo = min(r[0] for r in dirty.values())
            hi = max(r[1] for r in dirty.values())
            changed = sum(r[1] - r[0] for r in dirty.values())
            if (s1 - s0) * (hi - lo) <= max(_BOX_CELLS, 4 * changed):
                # the device mirrors the host everywhere outside the changed parts
                upload_into(self.table_dev[s0:s1, lo:hi], self.table[s0:s1, lo:hi])
                dirty.clear()
                return
        for slot, (lo, hi) in dirty.items():
            upload_into(self.table_dev[slot, lo:hi], self.table[slot, lo:hi])
        dirty.clear()

    # ------------------------------------------------------------------ device side
    def flat_rows(self, slots: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Flat storage row of (slot, row) pairs (broadcast); -1 where ``rows`` < 0 or the row's
        block is not held. Device ops only."""
        b = self.block_size
        logical = (rows.clamp(min=0) // b).clamp(max=self.max_logical - 1)
        phys = self.table_dev[slots, logical].long()
        return torch.where((rows >= 0) & (phys >= 0), phys * b + rows % b, -1)

    def read(self, flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.fmt.read(self.data, flat, dtype, validate=False)  # rows from the table

    def write(self, flat: torch.Tensor, values: torch.Tensor) -> None:
        self.fmt.write(self.data, flat, values, validate=False)
