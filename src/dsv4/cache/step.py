"""A forward step's view of one layer's cache, and the step metadata every layer shares.

The layer processes a call as one or more steps of at most ``step_tokens`` tokens. A step's
metadata depends only on its sequences (their lengths, slots and token counts) and on the layer
type's compressor rings, not on the layer:

* per token: its position and its sequence's slot;
* per compressor: the entries the step completes (slot, entry index) and, for each of their
  ``coff * ratio`` source positions, where that raw row is: in the slot's ring (positions before
  the step), in this step's rows, or nowhere (entry 0's missing previous block);
* per compressor: which of this step's raw rows the rings keep.

:func:`build_metadata` builds it on the host; one host-to-device copy puts it on the device,
where :class:`StepMetadata` holds its parts as views. A :class:`CacheStep` is one pool's view of
a step: the pool (its stores and block tables) with the step's metadata. A layer called on its
own plans its steps itself (:meth:`CacheStep.plan`); a model builds one
:class:`~dsv4.cache.plan.StepPlan` per step, which builds and uploads the metadata once and
hands every layer its :class:`CacheStep`.

The device side then writes, selects and attends for every sequence in single batched operations.
:class:`CallTransaction` makes a multi-step call all-or-nothing: on failure every sequence gets
back its length, rings and blocks as they were before the call.

A padded step (``pad_to`` = (B, Q), for CUDA graphs: docs/design.md, "The step plan and the
decode runner") has fixed shapes: B * Q tokens (B sequences of at most Q tokens; the real ones
first), the padded ones at position 0 in the pool's padding slot; B * ceil(Q / ratio) entry jobs
per compressor, the unused ones for the padding slot (from the step's first raw row: finite, and
stored where no sequence reads); and per ratio a fixed width of visible entries
(:attr:`StepMetadata.visible_caps`) in place of the step's own.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dsv4.cache.blocks import CacheCapacityError
from dsv4.cache.pool import AttentionCache, CachePool, RingSpec
from dsv4.host_copy import upload


@dataclass
class EntryJobs:
    """The entries one step completes for one compressor store."""

    count: int
    slots: torch.Tensor
    """[E] slot of each entry's sequence."""
    entries: torch.Tensor
    """[E] entry index j (rows j * ratio .. j * ratio + ratio - 1 complete it)."""
    ring_src: torch.Tensor
    """[E, coff * ratio] flat row of the ring (``ring.view(-1, width)``) holding each source
    position, or -1."""
    call_src: torch.Tensor
    """[E, coff * ratio] index into this step's raw rows, or -1 (both -1: no such position)."""
    keep_dst: torch.Tensor
    """[K] flat ring rows this step's rows go to at commit ..."""
    keep_src: torch.Tensor
    """[K] ... from these step rows (the last ring-length positions of each sequence)."""


RingSpecs = tuple[tuple[str, RingSpec], ...]
"""A layer type's compressor rings by store name (:attr:`CachePool.rings`)."""


def ring_specs(pool: CachePool) -> RingSpecs:
    return tuple((name, spec) for name, (spec, _) in pool.rings.items())


@dataclass(frozen=True)
class HostMetadata:
    """A step's metadata on the host (:func:`build_metadata`): one int64 buffer and how it
    splits - or only how it splits, for a padded decode step whose values the device writes
    from a seed (:func:`padded_decode_layout`)."""

    buffer: torch.Tensor | None
    """The values (None: written on the device, :mod:`dsv4.kernels.decode_metadata`)."""
    shapes: list[tuple[int, ...]]
    jobs: list[tuple[str, int, int]]
    """(store, E, K) per compressor."""
    seq_ids: torch.Tensor
    """[T] index into the step's sequences of each token (-1: a padded token)."""
    tokens: int
    visible_caps: dict[int, int] | None
    query_bucket: int | None = None
    """Padded steps: the tokens each sequence's slots hold (Q; else None)."""
    positions: torch.Tensor | None = None
    """[T] the tokens' positions on the host (None: the buffer's first T values)."""

    @property
    def size(self) -> int:
        """The metadata's int64 values."""
        return sum(_numel(s) for s in self.shapes)

    @property
    def host_positions(self) -> torch.Tensor:
        if self.positions is not None:
            return self.positions
        assert self.buffer is not None
        return self.buffer[:self.tokens]


def build_metadata(starts: list[int], slots: list[int], counts: list[int], specs: RingSpecs,
                   pad_to: tuple[int, int] | None = None, pad_slot: int = -1,
                   visible_caps: dict[int, int] | None = None) -> HostMetadata:
    """The step's metadata on the host; ``pad_to`` = (B, Q): a padded step of B sequences of
    at most Q tokens each, padding in ``pad_slot`` (module docstring)."""
    if pad_to is not None:
        b, q = pad_to
        if len(starts) > b or max(counts) > q:
            raise ValueError(f"a padded step of {b} sequences of at most {q} tokens cannot hold "
                             f"{len(starts)} sequences of up to {max(counts)} tokens")
        if q == 1:
            host, shapes, jobs, seq_ids = _decode_metadata(starts, slots, counts, list(specs), b,
                                                           pad_slot)
        else:
            host, shapes, jobs, seq_ids = _padded(
                _step_metadata(starts, slots, counts, list(specs)), specs, b, q, pad_slot)
        return HostMetadata(host, shapes, jobs, seq_ids, b * q, dict(visible_caps or {}), q)
    build = _decode_metadata if all(n == 1 for n in counts) else _step_metadata
    host, shapes, jobs, seq_ids = build(starts, slots, counts, list(specs))
    return HostMetadata(host, shapes, jobs, seq_ids, sum(counts), None)


def padded_decode_layout(b: int, m: int, specs: RingSpecs, visible_caps: dict[int, int] | None,
                         positions: torch.Tensor | None = None) -> HostMetadata:
    """:func:`build_metadata`'s result for a padded decode step (``pad_to`` = (``b``, 1), ``m``
    real sequences) without the values: the device writes them from the step's seed
    (:mod:`dsv4.kernels.decode_metadata`). ``positions``: the ``b`` padded positions on the
    host (the seed's first part)."""
    shapes: list[tuple[int, ...]] = [(b,), (b,)]
    jobs: list[tuple[str, int, int]] = []
    for name, spec in specs:
        src = spec.sources
        shapes += [(b,), (b,), (b, src), (b, src), (b,), (b,)]
        jobs.append((name, b, b))
    seq_ids = torch.arange(b)
    seq_ids[m:] = -1
    return HostMetadata(None, shapes, jobs, seq_ids, b, dict(visible_caps or {}), 1, positions)


@dataclass(frozen=True)
class StepMetadata:
    """A step's metadata on the device, split into its parts (read-only to every user)."""

    pos: torch.Tensor
    """[T] int64 position of each token (device)."""
    tok_slot: torch.Tensor
    """[T] int64 slot of each token's sequence (device)."""
    pos_host: torch.Tensor
    tok_seq_host: torch.Tensor
    """[T] index into the step's sequences of each token (host; -1: padding)."""
    jobs: dict[str, EntryJobs]
    visible_caps: dict[int, int] | None
    """Padded steps: the fixed width of visible entries per ratio (else None: the step's own)."""
    query_bucket: int | None = None
    """Padded steps: the tokens per sequence of the fixed layout, Q (else None): what a kernel
    choice that must not change between a bucket's steps depends on, not the step's counts."""

    @classmethod
    def split(cls, host: HostMetadata, dev: torch.Tensor,
              views: list[torch.Tensor] | None = None) -> StepMetadata:
        """The parts of ``dev`` (``host.buffer`` on the device, or a slice of a bigger copy);
        ``views``: those parts made before (:func:`metadata_views`) over the same memory."""
        if views is None:
            views = metadata_views(host.shapes, dev)
        jobs = {name: EntryJobs(e, *views[2 + 6 * k: 8 + 6 * k])
                for k, (name, e, _k) in enumerate(host.jobs)}
        return cls(views[0], views[1], host.host_positions, host.seq_ids, jobs,
                   host.visible_caps, host.query_bucket)


def metadata_views(shapes: list[tuple[int, ...]], dev: torch.Tensor) -> list[torch.Tensor]:
    """``dev`` split into parts of ``shapes``."""
    views = list(torch.split(dev, [_numel(s) for s in shapes]))
    # split already gives the 1-D pieces their shape (a view is ~1 us of host time each)
    return [v if len(s) == 1 else v.view(s) for v, s in zip(views, shapes, strict=True)]


@dataclass
class CacheStep:
    """One pool's view of a step: the pool, the step's sequences (``caches``, their lengths
    ``starts`` and token ``counts``) and the step's metadata."""

    pool: CachePool
    caches: list[AttentionCache]
    starts: list[int]
    counts: list[int]
    meta: StepMetadata
    _keepalive: torch.Tensor | None = field(default=None, repr=False)
    _most_visible: dict[int, int] = field(default_factory=dict, repr=False)
    """:meth:`max_visible` of the whole step, by ratio (its stages ask more than once)."""

    @property
    def pos(self) -> torch.Tensor:
        """[T] int64 position of each token (device)."""
        return self.meta.pos

    @property
    def tok_slot(self) -> torch.Tensor:
        """[T] int64 slot of each token's sequence (device)."""
        return self.meta.tok_slot

    @property
    def pos_host(self) -> torch.Tensor:
        return self.meta.pos_host

    @property
    def tok_seq_host(self) -> torch.Tensor:
        """[T] index into ``caches`` of each token (host; -1: a padded token)."""
        return self.meta.tok_seq_host

    @property
    def jobs(self) -> dict[str, EntryJobs]:
        return self.meta.jobs

    @property
    def num_tokens(self) -> int:
        return int(self.pos_host.shape[0])

    # ------------------------------------------------------------------ planning (host)
    @classmethod
    def plan(cls, pool: CachePool, caches: list[AttentionCache], counts: list[int]
             ) -> CacheStep:
        """A step of ``counts[i]`` tokens for each of ``caches`` (sequences of ``pool``, checked
        by the layer): takes the blocks it writes, builds and uploads its metadata."""
        slots = [c.slot for c in caches]
        starts = [pool._lengths[s] for s in slots]
        take_blocks([(pool, slots)], starts, [a + n for a, n in zip(starts, counts, strict=True)])
        host = build_metadata(starts, slots, counts, ring_specs(pool))
        assert host.buffer is not None
        dev, keep = upload(host.buffer, pool.device)
        return cls(pool, caches, starts, list(counts), StepMetadata.split(host, dev), keep)

    # ------------------------------------------------------------------ device side
    def window_rows(self, window: int) -> torch.Tensor:
        """[T, window] flat rows of the kv store each query sees (positions p - window + 1 ..
        p, oldest first); -1 before position 0."""
        rows = self.pos[:, None] - (window - 1) + torch.arange(window, device=self.pos.device)
        rows = torch.where(rows >= 0, rows, -1)
        return self.pool.stores["kv"].flat_rows(self.tok_slot[:, None], rows)

    def entry_rows(self, name: str, entries: torch.Tensor,
                   token_slots: torch.Tensor | None = None) -> torch.Tensor:
        """Flat rows of store ``name`` for per-query entry indices ``entries`` [T, k] (-1 kept)."""
        slots = self.tok_slot[:, None] if token_slots is None else token_slots
        return self.pool.stores[name].flat_rows(slots, entries)

    def ring(self, name: str) -> torch.Tensor:
        return self.pool.rings[name][1]

    def max_visible(self, ratio: int, a: int = 0, b: int | None = None) -> int:
        """The most entries any query of tokens a .. b - 1 sees (host arithmetic); a padded
        step's fixed width for ``ratio`` (whatever a and b)."""
        caps = self.meta.visible_caps
        if caps is not None:
            return caps[ratio]
        whole = a == 0 and b is None
        if whole and ratio in self._most_visible:
            return self._most_visible[ratio]
        p = self.pos_host[a:b]
        n = int((p.max() + 1) // ratio) if p.numel() else 0
        if whole:
            self._most_visible[ratio] = n
        return n

    def single_sequence(self, a: int, b: int) -> int | None:
        """The index (into ``caches``) of the one sequence tokens a .. b - 1 belong to, or None."""
        first, last = int(self.tok_seq_host[a]), int(self.tok_seq_host[b - 1])
        return first if first == last and first >= 0 else None

    # ------------------------------------------------------------------ end of step
    def keep_ring_rows(self, name: str, rows: torch.Tensor) -> None:
        """Copy the step's raw rows ``rows`` [T, raw_width] that compressor store ``name``'s
        rings keep (the last ring-length positions of each sequence) into the rings."""
        job = self.jobs[name]
        spec, ring = self.pool.rings[name]
        ring.view(-1, spec.width)[job.keep_dst] = rows[job.keep_src].to(ring.dtype)

    def commit(self, release_from: list[int] | None = None,
               release_rows: list[int] | None = None) -> None:
        """Advance the lengths and release the window blocks the sequences no longer need
        (:meth:`CachePool.window_release_row`, or ``release_rows`` computed by the caller for
        several pools at once) - host work; the rings' rows are kept before
        (:meth:`keep_ring_rows`). ``release_from[i]``: release only among logical blocks from
        this index (a multi-step call keeps the blocks it started with until it ends)."""
        pool = self.pool
        lengths, slots = pool._lengths, [c.slot for c in self.caches]
        for slot, a, n in zip(slots, self.starts, self.counts, strict=True):
            lengths[slot] = a + n
        if release_rows is None:
            release_rows = pool.window_release_rows(self.starts, self.counts)
        pool.stores["kv"].release_before_each(slots, release_rows, release_from)
        pool.stores["kv"].sync()


def take_blocks(pools: list[tuple[CachePool, list[int]]], starts: list[int], ends: list[int]
                ) -> list[tuple[CachePool, str, int, int]]:
    """Give sequence i (in slot ``slots[i]`` of each (pool, slots) pair, holding ``starts[i]``
    positions) the blocks that hold its rows up to position ``ends[i]`` - all checked before any
    is taken (a pool that lacks blocks raises :class:`CacheCapacityError` naming it, with nothing
    taken anywhere) - and copy every changed block table of these pools to the device: the
    blocks taken here and what changed since the last step (a fork's new table rows, which no
    block taken may follow: the step would read the child's rows through a stale mirror).
    Returns (pool, store, slot, logical blocks before) of each table that grew (what an undo
    shrinks back to).

    Only sequences whose rows cross into a new logical block can need one (a sequence holds the
    logical blocks of its rows: growing, forking and truncating keep that), so a decode step
    looks at a few sequences, not every sequence of every store of every layer."""
    crossing: dict[int, list[int]] = {}  # rows per position -> the sequences that may grow

    def may_grow(per: int, b: int) -> list[int]:
        key = per * 1_000_003 + b
        if key not in crossing:
            crossing[key] = [i for i, (a, e) in enumerate(zip(starts, ends, strict=True))
                             if -(-(e // per) // b) > -(-(a // per) // b)]
        return crossing[key]

    grows: list[tuple[CachePool, str, list[int], list[int]]] = []
    for pool, slots in pools:
        r = pool.compress_ratio
        for name, store in pool.stores.items():
            per = 1 if name == "kv" else r
            idx = may_grow(per, store.block_size)
            if not idx:
                continue
            sub = [slots[i] for i in idx]
            rows_each = [ends[i] // per for i in idx]
            missing = store.blocks_needed_each(sub, rows_each)
            per_store = sum(missing)
            if per_store > store.alloc.num_free:
                raise CacheCapacityError(
                    f"layer {pool.layer_id} cache pool, {name} store: this call needs "
                    f"{per_store} more block(s) but {store.alloc.num_free} of "
                    f"{store.alloc.num_blocks} are free (free finished sequences or make a larger "
                    "pool)")
            keep = [i for i, k in enumerate(missing) if k]
            grows.append((pool, name, [sub[i] for i in keep], [rows_each[i] for i in keep]))
    grown = []
    for pool, name, slots_, rows_ in grows:  # each store's blocks in one call
        befores = pool.stores[name].grow_each(slots_, rows_)
        grown += [(pool, name, s, b) for s, b in zip(slots_, befores, strict=True)]
    for pool, _ in pools:
        for store in pool.stores.values():
            store.sync()  # nothing to copy (no host work) where no row changed
    return grown


class CallTransaction:
    """All-or-nothing for a call of several steps over the same sequences: ``rollback`` restores
    lengths, ring rows and block tables as they were at the start."""

    def __init__(self, pool: CachePool, caches: list[AttentionCache], snapshot_rings: bool
                 ) -> None:
        self.pool = pool
        self.caches = caches
        self.lengths = [pool._lengths[c.slot] for c in caches]
        self.logical = {name: [s.num_logical(c.slot) for c in caches]
                        for name, s in pool.stores.items()}
        self.slots = [c.slot for c in caches]
        self.rings = pool.snapshot_rings(self.slots) if snapshot_rings else {}

    def window_release_from(self) -> list[int]:
        """Blocks a step may release: those taken during this call (rollback restores the rest)."""
        return self.logical["kv"]

    def finish(self) -> None:
        """The call succeeded: release the window blocks its sequences no longer need, as for
        one step of all the call's tokens."""
        kv = self.pool.stores["kv"]
        for c, a in zip(self.caches, self.lengths, strict=True):
            n = self.pool._lengths[c.slot] - a
            kv.release_before(c.slot, self.pool.window_release_row(a, n))
        kv.sync()

    def rollback(self) -> None:
        """The host's changes undone first (block tables, lengths), then the device's (the
        rings' saved rows, the tables' mirrors) - except under a CUDA-graph capture, which ran
        none of the call's device work and cannot copy from the host: the tables' changes stay
        marked and go with the next sync."""
        for name, store in self.pool.stores.items():
            for c, n in zip(self.caches, self.logical[name], strict=True):
                store.shrink_to(c.slot, n)
        for c, n in zip(self.caches, self.lengths, strict=True):
            self.pool._lengths[c.slot] = n
        if _capturing(self.pool.device):
            return
        self.pool.restore_rings(self.slots, self.rings)
        for store in self.pool.stores.values():
            store.sync()


def _capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is capturing a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


Metadata = tuple[torch.Tensor, list[tuple[int, ...]], list[tuple[str, int, int]], torch.Tensor]
"""(the host buffer, its parts' shapes, (store, E, K) per compressor, each token's sequence)."""


def _step_metadata(starts: list[int], slots: list[int], counts: list[int],
                   specs: list[tuple[str, RingSpec]]) -> Metadata:
    """A step's metadata (:meth:`CacheStep.plan`) for any counts, vectorised in NumPy: per token
    its position and slot; per compressor the entries completed, their sources and the ring rows
    kept.

    Every part is written in place into one buffer, each source array through one flat index
    (no [E, 1] x [sources] broadcasts, no concatenation), powers of two divided by shifts; a
    step of one sequence (a long prefill's) uses its scalars, not per-row gathers: 2x less
    host time than building the parts and concatenating them at 8192 tokens (dev CPU,
    ``benchmarks/plan_cost.py prefill``)."""
    m = len(counts)
    n_arr = np.asarray(counts, dtype=np.int64)
    a_arr = np.asarray(starts, dtype=np.int64)
    s_arr = np.asarray(slots, dtype=np.int64)
    ends = np.cumsum(n_arr)
    begins = ends - n_arr
    t = int(ends[-1]) if m else 0
    jobs = []
    sizes = [t, t]
    for name, spec in specs:
        first_j = a_arr // spec.ratio
        per_seq = (a_arr + n_arr) // spec.ratio - first_j  # entries j = a // r .. (a + n) // r - 1
        kept = np.minimum(n_arr, spec.rows)  # the last min(n, rows) positions stay in the ring
        e, k = int(per_seq.sum()), int(kept.sum())
        jobs.append((name, spec, first_j, per_seq, kept, e, k))
        sizes += [e, e, e * spec.sources, e * spec.sources, k, k]
    buf = np.empty(sum(sizes), dtype=np.int64)
    parts = np.split(buf, np.cumsum(sizes)[:-1])

    def spread(per: np.ndarray) -> tuple[Any, np.ndarray]:
        """For ``per[i]`` items of each sequence i: each item's sequence (the scalar 0 in a
        step of one sequence) and its index among its sequence's items."""
        if m == 1:
            return 0, np.arange(int(per[0]), dtype=np.int64)
        seq = np.repeat(np.arange(m), per)
        return seq, np.arange(seq.shape[0], dtype=np.int64) - (np.cumsum(per) - per)[seq]

    seq_t, within = spread(n_arr)
    np.add(within, a_arr[seq_t], out=parts[0])
    parts[1][:] = s_arr[seq_t]
    shapes: list[tuple[int, ...]] = [(t,), (t,)]
    job_meta: list[tuple[str, int, int]] = []
    for i, (name, spec, first_j, per_seq, kept, e, k) in enumerate(jobs):
        cr, src, ratio = spec.rows, spec.sources, spec.ratio
        slot_e, entry_e, ring_src, call_src, keep_dst, keep_src = parts[2 + 6 * i: 8 + 6 * i]
        e_seq, e_i = spread(per_seq)
        slot_e[:] = s_arr[e_seq]
        np.add(e_i, first_j[e_seq], out=entry_e)
        if e:
            f = np.arange(e * src, dtype=np.int64)  # flat source f: entry f // src, f % src
            row = _div(f, src)
            f_seq = e_seq if m == 1 else e_seq[row]
            q = (entry_e[row] - (spec.coff - 1)) * ratio + _mod(f, src)  # its position
            d = q - a_arr[f_seq]  # >= 0: row d of its sequence in this step
            before = d < 0
            np.add(d, begins[f_seq], out=call_src)
            call_src[before] = -1
            np.add(_mod(q, cr), s_arr[f_seq] * cr, out=ring_src)
            ring_src[~before | (q < 0)] = -1  # in the ring: positions 0 .. a - 1 only
        k_seq, k_i = spread(kept)
        kq = k_i + (a_arr + n_arr - kept)[k_seq]
        np.add(_mod(kq, cr), s_arr[k_seq] * cr, out=keep_dst)
        np.add(kq - a_arr[k_seq], begins[k_seq], out=keep_src)
        shapes += [(e,), (e,), (e, src), (e, src), (k,), (k,)]
        job_meta.append((name, e, k))
    seq_ids = np.zeros(t, dtype=np.int64) if m == 1 else seq_t
    return torch.from_numpy(buf), shapes, job_meta, torch.from_numpy(seq_ids)


def _div(x: np.ndarray, n: int) -> np.ndarray:
    """x // n (a shift where n is a power of two)."""
    return x >> (n.bit_length() - 1) if n & (n - 1) == 0 else x // n


def _mod(x: np.ndarray, n: int) -> np.ndarray:
    """x % n, Python's sign (a mask where n is a power of two)."""
    return x & (n - 1) if n & (n - 1) == 0 else x % n


def _job_padding(spec: RingSpec, pad_slot: int) -> tuple[int, int, int, int, int, int]:
    """What a padded step writes into each compressor part's unused places (padded tokens are
    at position 0 in ``pad_slot``): (job slot, entry, ring source, call source, kept-row
    destination, kept-row source). An unused job makes entry 0 of the padding slot from the
    step's first raw row (finite values), a padded token keeps that row in the padding slot's
    ring: both land where no sequence reads."""
    return pad_slot, 0, -1, 0, pad_slot * spec.rows, 0


def _decode_metadata(starts: list[int], slots: list[int], counts: list[int],
                     specs: list[tuple[str, RingSpec]], pad_to: int | None = None,
                     pad_slot: int = -1) -> Metadata:
    """:func:`_step_metadata` for a decode step (every count 1) in plain Python: the same buffer
    in a fraction of the host time (NumPy's per-call cost dominates arrays this small); where
    the step's work reaches :data:`DECODE_NUMPY_WORK`, :func:`_decode_metadata_numpy`.
    ``pad_to``: ``pad_to`` tokens and jobs per compressor, padded with :func:`_job_padding`'s
    values."""
    m = len(starts)
    t = m if pad_to is None else pad_to
    done_of = completing(starts, specs)
    if decode_work(done_of, specs, t, pad_to) >= DECODE_NUMPY_WORK:
        return _decode_metadata_numpy(starts, slots, specs, done_of, pad_to, pad_slot)
    pads = t - m
    flat = list(starts) + [0] * pads + list(slots) + [pad_slot] * pads
    shapes: list[tuple[int, ...]] = [(t,), (t,)]
    job_meta: list[tuple[str, int, int]] = []
    for (name, spec), done in zip(specs, done_of, strict=True):
        cr, src, ratio, coff = spec.rows, spec.sources, spec.ratio, spec.coff
        ring_src: list[int] = []
        call_src: list[int] = []
        for i in done:
            a, s = starts[i], slots[i]
            first = (a // ratio - coff + 1) * ratio
            for q in range(first, first + src):
                ring_src.append(s * cr + q % cr if 0 <= q < a else -1)
                call_src.append(i + q - a if q >= a else -1)  # q == a: this step's row i
        e = len(done) if pad_to is None else pad_to
        unused = e - len(done)
        p_slot, p_entry, p_ring, p_call, p_keep_dst, p_keep_src = _job_padding(spec, pad_slot)
        flat += [slots[i] for i in done] + [p_slot] * unused
        flat += [starts[i] // ratio for i in done] + [p_entry] * unused
        flat += ring_src + [p_ring] * (src * unused) + call_src + [p_call] * (src * unused)
        flat += [s * cr + a % cr for a, s in zip(starts, slots, strict=True)]
        flat += [p_keep_dst] * pads + list(range(m)) + [p_keep_src] * pads
        shapes += [(e,), (e,), (e, src), (e, src), (t,), (t,)]
        job_meta.append((name, e, t))
    # through an int64 array: torch.tensor of a Python list costs ~4x as much host time
    host = (torch.frombuffer(array("q", flat), dtype=torch.int64) if flat
            else torch.zeros(0, dtype=torch.int64))  # frombuffer refuses an empty buffer
    seq_ids = torch.arange(t)
    if pads:
        seq_ids[m:] = -1
    return host, shapes, job_meta, seq_ids


def completing(starts: list[int], specs: list[tuple[str, RingSpec]]) -> list[list[int]]:
    """Per compressor, the sequences (by index) whose decode token at ``starts[i]`` completes
    an entry (entry ``starts[i] // ratio``)."""
    return [[i for i, a in enumerate(starts) if (a + 1) % spec.ratio == 0]
            for _name, spec in specs]


def decode_work(done_of: list[list[int]], specs: list[tuple[str, RingSpec]], tokens: int,
                pad_to: int | None) -> int:
    """A decode step's metadata work, as :data:`DECODE_NUMPY_WORK` counts it: ``tokens``
    (padded ones included) plus, per compressor, the sources of its job rows - the entries
    completed (``done_of``, :func:`completing`), or in a padded step all ``pad_to`` rows."""
    return tokens + sum((len(d) if pad_to is None else pad_to) * spec.sources
                        for d, (_name, spec) in zip(done_of, specs, strict=True))


DECODE_NUMPY_WORK = 352
"""Decode steps whose work (:func:`decode_work`: tokens, padded ones included, plus per compressor
the sources of its job rows) reaches this build their metadata in NumPy. Calibrated on the 2-core
development CPU, a C4 pool's two compressors, both paths forced and alternating
(``benchmarks/plan_cost.py``, ``benchmarks/results/2026-12-06-cpu/plan-cost/``): plain Python costs
about 11 us + 0.16 us a unit of work, NumPy about 55 us + 0.02 us a unit (16 sequences, none
completing: 17 against 54 us; 64, a quarter completing: 71 against 69; 64, all: 189 against 81;
128, a quarter: 135 against 82). A padded row costs plain Python less than a completed one (a list
repeated, about 0.03 us), NumPy nearly nothing: the decode runner's steps (C128 pools padded to
their bucket: 128 sources a job row) are the case, same file."""


def _decode_metadata_numpy(starts: list[int], slots: list[int],
                           specs: list[tuple[str, RingSpec]], done_of: list[list[int]],
                           pad_to: int | None, pad_slot: int) -> Metadata:
    """:func:`_decode_metadata`'s buffer, vectorised over the sequences (its arguments;
    ``done_of``: per compressor, the sequences whose token completes an entry)."""
    m = len(starts)
    t = m if pad_to is None else pad_to
    pads = t - m
    a = np.asarray(starts, dtype=np.int64)
    s = np.asarray(slots, dtype=np.int64)

    def fill(n: int, value: int) -> np.ndarray:
        return np.full(n, value, dtype=np.int64)

    parts = [a, fill(pads, 0), s, fill(pads, pad_slot)]
    shapes: list[tuple[int, ...]] = [(t,), (t,)]
    job_meta: list[tuple[str, int, int]] = []
    for (name, spec), done_list in zip(specs, done_of, strict=True):
        cr, src, ratio = spec.rows, spec.sources, spec.ratio
        done = np.asarray(done_list, dtype=np.int64)
        a_d, s_d = a[done, None], s[done, None]
        q = (a_d // ratio - spec.coff + 1) * ratio + np.arange(src)[None, :]
        ring_src = np.where((q >= 0) & (q < a_d), s_d * cr + q % cr, -1)
        call_src = np.where(q >= a_d, done[:, None] + q - a_d, -1)  # q == a: row i
        e = done.shape[0] if pad_to is None else pad_to
        unused = e - done.shape[0]
        p_slot, p_entry, p_ring, p_call, p_keep_dst, p_keep_src = _job_padding(spec, pad_slot)
        parts += [s_d[:, 0], fill(unused, p_slot), a_d[:, 0] // ratio, fill(unused, p_entry),
                  ring_src.reshape(-1), fill(src * unused, p_ring),
                  call_src.reshape(-1), fill(src * unused, p_call),
                  s * cr + a % cr, fill(pads, p_keep_dst),
                  np.arange(m, dtype=np.int64), fill(pads, p_keep_src)]
        shapes += [(e,), (e,), (e, src), (e, src), (t,), (t,)]
        job_meta.append((name, e, t))
    seq_ids = torch.arange(t)
    if pads:
        seq_ids[m:] = -1
    return torch.from_numpy(np.concatenate(parts)), shapes, job_meta, seq_ids


def _padded(real: Metadata, specs: RingSpecs, b: int, q: int, pad_slot: int) -> Metadata:
    """A step's metadata (:func:`_step_metadata`) padded to B * Q tokens and, per compressor,
    B * ceil(Q / ratio) entry jobs (the most Q tokens of a sequence complete) and B * min(Q,
    ring rows) kept rows, padded with :func:`_job_padding`'s values."""
    host, shapes, jobs, seq_ids = real
    parts = list(torch.split(host, [_numel(s) for s in shapes]))
    t = b * q

    def pad(part: torch.Tensor, size: int, value: int) -> torch.Tensor:
        return torch.cat((part, part.new_full((size - part.numel(),), value)))

    out = [pad(parts[0], t, 0), pad(parts[1], t, pad_slot)]
    out_shapes: list[tuple[int, ...]] = [(t,), (t,)]
    out_jobs: list[tuple[str, int, int]] = []
    for k, (name, spec) in enumerate(specs):
        e, kept = b * -(-q // spec.ratio), b * min(q, spec.rows)
        src = spec.sources
        slots_e, entries, ring_src, call_src, keep_dst, keep_src = parts[2 + 6 * k: 8 + 6 * k]
        p_slot, p_entry, p_ring, p_call, p_keep_dst, p_keep_src = _job_padding(spec, pad_slot)
        out += [pad(slots_e, e, p_slot), pad(entries, e, p_entry), pad(ring_src, e * src, p_ring),
                pad(call_src, e * src, p_call), pad(keep_dst, kept, p_keep_dst),
                pad(keep_src, kept, p_keep_src)]
        out_shapes += [(e,), (e,), (e, src), (e, src), (kept,), (kept,)]
        out_jobs.append((name, e, kept))
    ids = torch.cat((seq_ids, seq_ids.new_full((t - seq_ids.numel(),), -1)))
    return torch.cat(out), out_shapes, out_jobs, ids


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
