"""One layer's paged cache: sequences, their block tables, and the stores their rows live in.

A :class:`CachePool` holds, for up to ``max_seqs`` sequences of one layer:

* ``kv``: window rows (post-norm, post-RoPE kv of each position), kept only as far back as
  attention and a truncation (``max_rollback``) can read them: after a step, blocks whose rows
  all lie before ``length - window + 1 - max_rollback`` go back to the free list
  (:meth:`CachePool.window_release_row`);
* ``compressed`` (ratio 4 and 128): the compressed entries, ``ratio`` positions each;
* ``idx_keys`` (ratio 4): the indexer's keys, one per entry;
* the compressors' raw rows ``[a_p | s_p + ape]`` (fp32) of the last ``coff * ratio`` positions,
  as a small ring per sequence slot (``raw``, and ``idx_raw`` at ratio 4).

Every table and ring has one row more than ``max_seqs``: the padding slot
(:attr:`CachePool.pad_slot`), never handed to a sequence, holding only the padding blocks. The
padded tokens of a fixed-shape step (:class:`dsv4.cache.plan.StepPlan` with ``pad_to``) belong
to it: their cache writes land in its padding block (:class:`~dsv4.cache.store.PagedStore`),
their ring rows in its ring row: nowhere a sequence reads.

Each store is paged (:mod:`dsv4.cache.store`): rows live in blocks of ``block_size`` rows handed out
by one allocator per store, a sequence's block table maps its logical blocks to physical ones,
and rows are stored in a :mod:`dsv4.cache.formats` format (exact, bf16, or the engines' fp8 /
fp4 layouts). Sequences are added, grown on demand, forked (full blocks shared, the partial block
and the rings copied) and freed. A call that would need more blocks than are free raises
:class:`~dsv4.cache.blocks.CacheCapacityError` before anything is written.

An :class:`AttentionCache` is one sequence's handle; the layer's forward takes a list of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dsv4.cache.blocks import CacheCapacityError
from dsv4.cache.formats import RowFormat, index_format, kv_format
from dsv4.cache.store import PagedStore
from dsv4.config import DSV4Config, ceil_div
from dsv4.host_copy import upload_once

BLOCK_SIZE = 64
"""Rows per block in every store (FlashMLA's page size): 64 positions of window rows, 64
compressed entries (256 positions at ratio 4, 8192 at ratio 128), 64 indexer keys."""


@dataclass(frozen=True)
class RingSpec:
    """A compressor's raw-row ring: the last ``rows`` positions (row of position p at p % rows):
    the ``sources`` positions an entry pools, and ``history`` more, so that a sequence can be
    truncated back by ``history + 1`` positions (:attr:`CachePool.max_rollback`)."""

    ratio: int
    coff: int
    width: int
    history: int = 0

    @property
    def sources(self) -> int:
        """Source positions of one entry (its block and, at ratio 4, the one before)."""
        return self.coff * self.ratio

    @property
    def rows(self) -> int:
        return self.sources + self.history


class AttentionCache:
    """One sequence's cache in one layer: a slot of a :class:`CachePool`.

    ``length`` is the number of positions processed. ``fork()`` starts a new sequence sharing this
    one's prefix; ``free()`` gives its blocks back. Pass it (or a list of them) to the layer."""

    __slots__ = ("pool", "slot", "_live")

    def __init__(self, pool: CachePool, slot: int) -> None:
        self.pool = pool
        self.slot = slot
        self._live = True

    @property
    def length(self) -> int:
        return self.pool._lengths[self.slot]

    @property
    def alive(self) -> bool:
        return self._live

    @property
    def layer_id(self) -> int:
        return self.pool.layer_id

    @property
    def compress_ratio(self) -> int:
        return self.pool.compress_ratio

    @property
    def max_seq_len(self) -> int:
        return self.pool.max_seq_len

    @property
    def dtype(self) -> torch.dtype:
        return self.pool.dtype

    @property
    def device(self) -> torch.device:
        return self.pool.device

    def num_compressed(self, length: int | None = None) -> int:
        """Entries complete after ``length`` tokens (default: the current length)."""
        n = self.length if length is None else length
        return n // self.compress_ratio if self.compress_ratio else 0

    def fork(self) -> AttentionCache:
        """A new sequence in the same pool that starts with this one's prefix (for parallel
        samples or a shared prompt): full blocks are shared, not copied. Needs a free slot; see
        :meth:`CachePool.fork`."""
        return self.pool.fork(self)

    def free(self) -> None:
        """Give this sequence's blocks and slot back to the pool; the cache cannot be used
        afterwards (a layer call with it is an error naming it)."""
        self.pool.free(self)

    def reset(self) -> None:
        """Start a new sequence in this slot: every block goes back, the length is 0."""
        self.pool.reset(self)

    def truncate(self, length: int) -> None:
        """Forget the positions from ``length`` on (see :meth:`CachePool.truncate`)."""
        self.pool.truncate(self, length)

    def rows(self, store: str, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Rows ``start .. end - 1`` of this sequence in ``store`` (``kv``: window rows by
        position, only those still held; ``compressed``, ``idx_keys``: entries), read back
        through the store's format in the layer dtype."""
        return self.pool.read_rows(self, store, start, end)

    def held_bytes(self) -> int:
        """Bytes of storage this sequence holds (blocks in every store, and its rings)."""
        return self.pool.held_bytes(self)

    def __repr__(self) -> str:
        state = "" if self._live else ", freed"
        return (f"AttentionCache(layer={self.layer_id}, ratio={self.compress_ratio}, "
                f"slot={self.slot}, length={self.length if self._live else '-'}, "
                f"max_seq_len={self.max_seq_len}{state})")


class CachePool:
    """The paged cache of one layer for up to ``max_seqs`` sequences (see the module docstring).

    ``capacity_tokens`` sizes the entry stores (total positions of all live sequences, default
    ``max_seqs * max_seq_len``); ``step_tokens`` is the most tokens one forward step writes (the
    layer splits longer calls), which sizes the window store. ``max_rollback``: how many
    positions a sequence can always be truncated back by (default 1: one decode step; a
    speculative decoder verifying k drafted tokens a step needs k), which sizes the compressors'
    rings and how long window blocks are kept."""

    def __init__(self, cfg: DSV4Config, layer_id: int, *, max_seqs: int, max_seq_len: int,
                 dtype: torch.dtype, acc_dtype: torch.dtype, device: torch.device | str,
                 capacity_tokens: int | None = None, step_tokens: int | None = None,
                 kv_format_name: str | None = None, index_format_name: str | None = None,
                 block_size: int = BLOCK_SIZE, max_rollback: int = 1) -> None:
        for name, v in (("max_seqs", max_seqs), ("max_seq_len", max_seq_len),
                        ("block_size", block_size), ("max_rollback", max_rollback)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name}={v!r} must be a positive integer")
        if max_seq_len > cfg.max_position_embeddings:
            raise ValueError(f"max_seq_len={max_seq_len} must be in 1 .. max_position_embeddings="
                             f"{cfg.max_position_embeddings}")
        capacity = max_seqs * max_seq_len if capacity_tokens is None else capacity_tokens
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise ValueError(f"capacity_tokens={capacity_tokens!r} must be a positive integer")
        step = min(cfg.max_step_tokens, max_seqs * max_seq_len) if step_tokens is None \
            else step_tokens
        if isinstance(step, bool) or not isinstance(step, int) or step <= 0:
            raise ValueError(f"step_tokens={step_tokens!r} must be a positive integer")
        self.cfg = cfg
        self.layer_id = layer_id
        self.compress_ratio = r = cfg.compress_ratio(layer_id)
        self.max_seqs = max_seqs
        self.max_seq_len = max_seq_len
        self.capacity_tokens = capacity
        self.step_tokens = step
        self.window = cfg.sliding_window
        self.max_rollback = max_rollback
        self.block_size = block_size
        self.dtype = dtype
        self.acc_dtype = acc_dtype
        self.device = torch.device(device)
        self.kv_format: RowFormat = kv_format(kv_format_name or cfg.kv_cache_dtype, cfg.head_dim,
                                              cfg.qk_rope_head_dim, dtype)
        self.index_format: RowFormat | None = None
        b = block_size
        # window rows: each slot keeps at most window - 1 + 2 * max_rollback committed rows (+ one
        # block of straddle), and one step adds at most step_tokens rows over all sequences
        per_slot = ceil_div(self.window - 1 + 2 * max_rollback, b) + 2
        self.stores: dict[str, PagedStore] = {
            "kv": PagedStore("kv", self.kv_format, b,
                             max_seqs * per_slot + ceil_div(step, b), max_seqs + 1,
                             ceil_div(max_seq_len, b), self.device, max_seqs)}
        self.rings: dict[str, tuple[RingSpec, torch.Tensor]] = {}
        if r:
            coff = 2 if r == 4 else 1
            n_entries = ceil_div(max_seq_len, r)
            n_blocks = ceil_div(ceil_div(capacity, r), b) + max_seqs
            self.stores["compressed"] = PagedStore(
                "compressed", self.kv_format, b, n_blocks, max_seqs + 1, ceil_div(n_entries, b),
                self.device, max_seqs)
            spec = RingSpec(r, coff, 2 * coff * cfg.head_dim, max_rollback - 1)
            self.rings["compressed"] = (spec, self._ring(spec))
        if r == 4:
            self.index_format = index_format(index_format_name or cfg.index_cache_dtype,
                                             cfg.index_head_dim, dtype)
            self.stores["idx_keys"] = PagedStore(
                "idx_keys", self.index_format, b, self.stores["compressed"].alloc.num_blocks,
                max_seqs + 1, self.stores["compressed"].max_logical, self.device, max_seqs)
            spec = RingSpec(4, 2, 4 * cfg.index_head_dim, max_rollback - 1)
            self.rings["idx_keys"] = (spec, self._ring(spec))
        self.pad_slot = max_seqs
        """The padding slot: a row of every table (its one block: the store's padding block) and
        ring, no sequence's."""
        self._lengths = [0] * max_seqs
        self._handles: list[AttentionCache | None] = [None] * max_seqs
        self._free_slots = list(range(max_seqs - 1, -1, -1))

    def _ring(self, spec: RingSpec) -> torch.Tensor:
        # written before read (a compress reads only rows of positions already processed); the
        # padding slot's row is only written (zeros: what a padded job reads is finite)
        ring = torch.empty(self.max_seqs + 1, spec.rows, spec.width, dtype=self.acc_dtype,
                           device=self.device)
        ring[self.max_seqs].zero_()
        return ring

    # ------------------------------------------------------------------ sequences
    @property
    def sequences(self) -> list[AttentionCache]:
        return [h for h in self._handles if h is not None]

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def add_sequence(self) -> AttentionCache:
        """A new, empty sequence (its blocks are taken as it grows)."""
        if not self._free_slots:
            raise CacheCapacityError(f"layer {self.layer_id} cache pool: all {self.max_seqs} "
                                     "sequence slots are in use (free one or make a larger pool)")
        slot = self._free_slots.pop()
        handle = AttentionCache(self, slot)
        self._handles[slot] = handle
        self._lengths[slot] = 0
        return handle

    def _own(self, cache: AttentionCache, what: str) -> int:
        if not isinstance(cache, AttentionCache) or cache.pool is not self:
            raise ValueError(f"{what}: the cache is not a sequence of this pool")
        if not cache.alive:
            raise ValueError(f"{what}: the sequence was freed")
        return cache.slot

    def free(self, cache: AttentionCache) -> None:
        """Give a sequence's blocks and slot back; its handle can no longer be used."""
        slot = self._own(cache, "free")
        for store in self.stores.values():
            store.release_all(slot)
        self._lengths[slot] = 0
        self._handles[slot] = None
        cache._live = False
        self._free_slots.append(slot)

    def reset(self, cache: AttentionCache) -> None:
        """Start a new sequence in ``cache``'s slot: every block goes back, the length is 0;
        the handle stays usable (unlike :meth:`free`)."""
        slot = self._own(cache, "reset")
        for store in self.stores.values():
            store.release_all(slot)
        self._lengths[slot] = 0

    def fork(self, cache: AttentionCache) -> AttentionCache:
        """A new sequence with ``cache``'s prefix: its full blocks are shared (reference-counted
        and never written: writes go to positions at or after the length, which lie in the
        partial last block or beyond), the partial last block of each store and the rings are
        copied. Needs a free slot and one free block per store with a partial block."""
        src = self._own(cache, "fork")
        if not self._free_slots:
            raise CacheCapacityError(f"layer {self.layer_id} cache pool: no free sequence slot "
                                     "to fork into")
        length = self._lengths[src]
        rows = {name: self._rows_held(name, length) for name in self.stores}
        for name, store in self.stores.items():  # check every store before changing any
            store.check_fork(src, rows[name])
        child = self.add_sequence()
        for name, store in self.stores.items():
            store.fork(src, child.slot, rows[name])
        for _, ring in self.rings.values():
            ring[child.slot] = ring[src]
        self._lengths[child.slot] = length
        return child

    def window_release_row(self, start: int, count: int) -> int:
        """The first window row a sequence keeps after a step of ``count`` tokens from position
        ``start`` (its blocks before it go back). A truncation back by up to ``max_rollback``
        positions from the step's end reads the window of the position it ends at. A step of at
        most ``max_rollback + 1`` tokens (a decode or verify step) releases as one token would,
        so that a verify step truncated to its accepted tokens holds exactly what a step of
        only those would; a longer one (a prefill chunk) releases all it can."""
        return self.window_release_rows([start], [count])[0]

    def window_release_rows(self, starts: Sequence[int], counts: Sequence[int]) -> list[int]:
        """:meth:`window_release_row` of each sequence of a step (one pass for all of them)."""
        r, back = self.max_rollback, self.max_rollback + self.window - 1
        return [max(0, (a + 1 if n <= r + 1 else a + n) - back)
                for a, n in zip(starts, counts, strict=True)]

    def snapshot_rings(self, slots: Sequence[int]) -> dict[str, torch.Tensor]:
        """Copies of the compressors' ring rows of the sequences in ``slots``, by store name
        (what :meth:`restore_rings` puts back after a failed step)."""
        if not self.rings:
            return {}
        idx = upload_once(torch.tensor(list(slots)), self.device)
        return {name: ring[idx].clone() for name, (_, ring) in self.rings.items()}

    def restore_rings(self, slots: Sequence[int], saved: dict[str, torch.Tensor]) -> None:
        """Put back ring rows taken by :meth:`snapshot_rings` of the same ``slots``."""
        if not saved:
            return
        idx = upload_once(torch.tensor(list(slots)), self.device)
        for name, rows in saved.items():
            self.rings[name][1][idx] = rows

    def truncate(self, cache: AttentionCache, length: int) -> None:
        """Forget positions ``length`` .. current length - 1 (rejected draft tokens, or to
        re-run a step): every store, ring, block table and free list as if they had never been
        written - the blocks only they filled go back, a block shared with a fork that the next
        writes would reach is copied first.

        Always possible for ``length >= current length - max_rollback`` (the compressors' rings
        and the window hold what position ``length`` needs); further back where that state is
        still held, else an error with nothing changed. :meth:`truncate_many` does several
        sequences at once."""
        self.truncate_many([cache], [length])

    def truncate_many(self, caches: Sequence[AttentionCache], lengths: Sequence[int]) -> None:
        """:meth:`truncate` of each cache to its length, all checked before any changes (a
        speculative step's rollback: one call per layer, not one per sequence and layer;
        :func:`dsv4.cache.plan.truncate_sequences` does a model's layers)."""
        self.apply_truncation(self.check_truncation(caches, lengths))

    def check_truncation(self, caches: Sequence[AttentionCache], lengths: Sequence[int]
                         ) -> list[tuple[int, int, dict[str, int | None]]]:
        """:meth:`truncate_many`'s checks (errors name the cache and the fix); returns what
        :meth:`apply_truncation` does: (slot, length, the block each store copies)."""
        if len(caches) != len(lengths):
            raise ValueError(f"truncate: {len(caches)} caches but {len(lengths)} lengths")
        plan: list[tuple[int, int, dict[str, int | None]]] = []
        need_copy = dict.fromkeys(self.stores, 0)
        for cache, length in zip(caches, lengths, strict=True):
            slot = self._own(cache, "truncate")
            cur = self._lengths[slot]
            if isinstance(length, bool) or not isinstance(length, int) \
                    or not 0 <= length <= cur:
                raise ValueError(f"truncate: length={length!r} must be an integer in 0 .. {cur}")
            if length == cur:
                continue
            self._check_held(slot, cur, length)
            copies = {name: store.shared_partial_block(slot, self._rows_held(name, length))
                      for name, store in self.stores.items()}
            for name, block in copies.items():
                need_copy[name] += block is not None
            plan.append((slot, length, copies))
        for name, store in self.stores.items():  # every copy checked before any is made
            if need_copy[name] > store.alloc.num_free:
                raise CacheCapacityError(
                    f"truncate: the {name} store's blocks at the new lengths are shared with a "
                    f"fork and there are {store.alloc.num_free} free blocks to copy "
                    f"{need_copy[name]} into")
        return plan

    def apply_truncation(self, plan: list[tuple[int, int, dict[str, int | None]]]) -> None:
        """Carry out a checked truncation (:meth:`check_truncation`)."""
        for slot, length, copies in plan:
            for name, store in self.stores.items():
                store.shrink_to(slot, ceil_div(self._rows_held(name, length), store.block_size))
                shared = copies[name]
                if shared is not None:
                    store.make_private(slot, shared)
            self._lengths[slot] = length
        if plan:
            for store in self.stores.values():
                store.sync()

    def _check_held(self, slot: int, cur: int, length: int) -> None:
        """Raise (naming the fix) unless the state position ``length`` needs is still held: the
        window rows before it and the compressors' ring rows the next entry pools."""
        first_window_row = max(0, length - self.window + 1)
        if not self.stores["kv"].holds_rows(slot, first_window_row, length):
            raise ValueError(f"truncate to {length}: the window rows from {first_window_row} were "
                             f"already freed (a pool keeps {self.max_rollback} position(s) of "
                             "rollback: new_cache_pool(max_rollback=...))")
        for spec, _ in self.rings.values():
            needed_from = max(0, (length // spec.ratio - spec.coff + 1) * spec.ratio)
            if needed_from < cur - spec.rows:
                raise ValueError(f"truncate to {length}: the raw rows from position "
                                 f"{needed_from} were overwritten (the pool keeps "
                                 f"{self.max_rollback} position(s) of rollback: "
                                 "new_cache_pool(max_rollback=...))")

    def read_rows(self, cache: AttentionCache, name: str, start: int = 0,
                  end: int | None = None) -> torch.Tensor:
        """Rows ``start .. end - 1`` of ``cache``'s sequence in store ``name`` (``kv``: window
        rows by position, only those still held; ``compressed``, ``idx_keys``: entries), read
        back through the store's format in the layer dtype: for inspecting and testing a cache
        (:meth:`AttentionCache.rows`)."""
        slot = self._own(cache, "rows")
        if name not in self.stores:
            raise ValueError(f"store {name!r}: this layer's stores are {list(self.stores)}")
        n = self._rows_held(name, self._lengths[slot])
        end = n if end is None else end
        if not 0 <= start <= end <= n:
            raise ValueError(f"rows {start} .. {end}: the sequence has {n} rows in {name!r}")
        store = self.stores[name]
        if not store.holds_rows(slot, start, end):
            raise ValueError(f"rows {start} .. {end} of {name!r} are no longer held (window rows "
                             "before the window are freed)")
        rows = torch.arange(start, end, device=self.device)
        slots = torch.full_like(rows, slot)
        return store.read(store.flat_rows(slots, rows), self.dtype)

    # ------------------------------------------------------------------ accounting
    def _rows_held(self, name: str, length: int) -> int:
        """Rows of store ``name`` that ``length`` positions fill."""
        if name == "kv":
            return length
        return length // self.compress_ratio

    def held_bytes(self, cache: AttentionCache) -> int:
        """Bytes of storage ``cache``'s sequence holds now: its blocks in every store (shared
        blocks of a fork counted for each holder) plus its compressor rings."""
        slot = self._own(cache, "held_bytes")
        total = sum(store.held_blocks(slot) * store.block_bytes for store in self.stores.values())
        for spec, ring in self.rings.values():
            total += spec.rows * spec.width * ring.element_size()
        return total

    def storage_bytes(self) -> int:
        """Bytes the pool allocated (every store and ring, all slots)."""
        total = sum(s.data.numel() * s.data.element_size() for s in self.stores.values())
        return total + sum(r.numel() * r.element_size() for _, r in self.rings.values())

    def blocks_in_use(self) -> dict[str, int]:
        """Blocks taken per store (``kv``, ``compressed``, ``idx_keys``), over all sequences:
        with :attr:`num_free_slots`, what the pool has left."""
        return {name: s.alloc.num_blocks - s.alloc.num_free for name, s in self.stores.items()}

    # ------------------------------------------------------------------ steps
    def __repr__(self) -> str:
        used = ", ".join(f"{k} {v}/{self.stores[k].alloc.num_blocks}"
                         for k, v in self.blocks_in_use().items())
        return (f"CachePool(layer={self.layer_id}, ratio={self.compress_ratio}, "
                f"sequences={len(self.sequences)}/{self.max_seqs}, max_seq_len={self.max_seq_len}"
                f", kv={self.kv_format.name}"
                + (f", index={self.index_format.name}" if self.index_format else "")
                + f", blocks used: {used})")
