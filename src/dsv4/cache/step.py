"""A forward step's view of the cache: where each token's rows go and what it may read.

The layer processes a call as one or more steps of at most ``step_tokens`` tokens. For a step,
:meth:`CacheStep.plan` (host side) validates nothing more (the layer did), takes the blocks the
step writes, and builds the step's metadata in one host-to-device copy (which the layers after
the first of a model's step take as it is: :data:`_last_uploaded`):

* per token: its position and its sequence's slot;
* per compressor: the entries the step completes (slot, entry index) and, for each of their
  ``coff * ratio`` source positions, where that raw row is: in the slot's ring (positions before
  the step), in this step's rows, or nowhere (entry 0's missing previous block);
* per compressor: which of this step's raw rows the rings keep.

The device side then writes, selects and attends for every sequence in single batched operations.
:class:`CallTransaction` makes a multi-step call all-or-nothing: on failure every sequence gets
back its length, rings and blocks as they were before the call.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import numpy as np
import torch

from dsv4.cache.pool import AttentionCache, CachePool, RingSpec
from dsv4.host_copy import upload, upload_once
from dsv4.usage import env_switch


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
    """[K] ... from these step rows (the last ``coff * ratio`` positions of each sequence)."""


@dataclass
class CacheStep:
    pool: CachePool
    caches: list[AttentionCache]
    starts: list[int]
    counts: list[int]
    pos: torch.Tensor
    """[T] int64 position of each token (device)."""
    tok_slot: torch.Tensor
    """[T] int64 slot of each token's sequence (device)."""
    pos_host: torch.Tensor
    tok_seq_host: torch.Tensor
    """[T] index into ``caches`` of each token (host)."""
    jobs: dict[str, EntryJobs] = field(default_factory=dict)
    _keepalive: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.pos_host.shape[0])

    # ------------------------------------------------------------------ planning (host)
    @classmethod
    def plan(cls, pool: CachePool, caches: list[AttentionCache], counts: list[int]
             ) -> CacheStep:
        slots = [c.slot for c in caches]
        starts = [pool._lengths[s] for s in slots]
        ends = [a + n for a, n in zip(starts, counts, strict=True)]
        r = pool.compress_ratio
        # blocks first, all checked before any is taken
        needs: list[tuple[str, int, int]] = []
        for name, store in pool.stores.items():
            rows_each = ends if name == "kv" else [e // r for e in ends]
            missing = store.blocks_needed_each(slots, rows_each)
            per_store = sum(missing)
            if per_store:
                needs += [(name, s, n) for s, n, k in zip(slots, rows_each, missing, strict=True)
                          if k]
            if per_store > store.alloc.num_free:
                from dsv4.cache.blocks import CacheCapacityError

                raise CacheCapacityError(
                    f"layer {pool.layer_id} cache pool, {name} store: this call needs "
                    f"{per_store} more block(s) but {store.alloc.num_free} of "
                    f"{store.alloc.num_blocks} are free (free finished sequences or make a larger "
                    "pool)")
        for name, s, rows in needs:
            pool.stores[name].grow(s, rows)
        for store in pool.stores.values():
            store.sync()

        specs = tuple((name, spec) for name, (spec, _) in pool.rings.items())
        meta = _uploaded_metadata(starts, slots, counts, specs, pool.device)
        step = cls(pool, caches, starts, list(counts), meta.views[0], meta.views[1],
                   meta.pos_host, meta.seq_ids, _keepalive=meta.keep)
        job_meta, views = meta.job_meta, meta.views
        for k_job, (name, e, _k) in enumerate(job_meta):
            v = views[2 + 6 * k_job: 8 + 6 * k_job]
            step.jobs[name] = EntryJobs(e, *v)
        return step

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
        """The most entries any query of tokens a .. b - 1 sees (host arithmetic)."""
        p = self.pos_host[a:b]
        return int((p.max() + 1) // ratio) if p.numel() else 0

    def single_sequence(self, a: int, b: int) -> int | None:
        """The index (into ``caches``) of the one sequence tokens a .. b - 1 belong to, or None."""
        first, last = int(self.tok_seq_host[a]), int(self.tok_seq_host[b - 1])
        return first if first == last else None

    # ------------------------------------------------------------------ end of step
    def keep_ring_rows(self, name: str, rows: torch.Tensor) -> None:
        """Copy the step's raw rows ``rows`` [T, raw_width] that compressor store ``name``'s
        rings keep (the last ``coff * ratio`` positions of each sequence) into the rings."""
        job = self.jobs[name]
        spec, ring = self.pool.rings[name]
        ring.view(-1, spec.width)[job.keep_dst] = rows[job.keep_src].to(ring.dtype)

    def commit(self, release_from: list[int] | None = None) -> None:
        """Advance the lengths, release window blocks no query can read (host work; the rings'
        rows are kept before, :meth:`keep_ring_rows`). ``release_from[i]``: release only among
        logical blocks from this index (a multi-step call keeps the blocks it started with
        until it ends)."""
        kv, lengths, window = self.pool.stores["kv"], self.pool._lengths, self.pool.window
        slots = [c.slot for c in self.caches]
        ends = [a + n for a, n in zip(self.starts, self.counts, strict=True)]
        for slot, end in zip(slots, ends, strict=True):
            lengths[slot] = end
        kv.release_before_each(slots, [max(0, e - window + 1) for e in ends], release_from)
        kv.sync()


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
        self.rings: dict[str, torch.Tensor] = {}
        if snapshot_rings:
            slots = upload_once(torch.tensor([c.slot for c in caches]), pool.device)
            self.rings = {name: ring[slots].clone() for name, (_, ring) in pool.rings.items()}

    def window_release_from(self) -> list[int]:
        """Blocks a step may release: those taken during this call (rollback restores the rest)."""
        return self.logical["kv"]

    def finish(self) -> None:
        """The call succeeded: release every window block no query can read any more."""
        kv = self.pool.stores["kv"]
        for c in self.caches:
            kv.release_before(c.slot, max(0, self.pool._lengths[c.slot] - self.pool.window + 1))
        kv.sync()

    def rollback(self) -> None:
        for name, store in self.pool.stores.items():
            for c, n in zip(self.caches, self.logical[name], strict=True):
                store.shrink_to(c.slot, n)
            store.sync()
        if self.rings:
            slots = upload_once(torch.tensor([c.slot for c in self.caches]),
                                self.pool.device)
            for name, saved in self.rings.items():
                self.pool.rings[name][1][slots] = saved
        for c, n in zip(self.caches, self.lengths, strict=True):
            self.pool._lengths[c.slot] = n


Metadata = tuple[torch.Tensor, list[tuple[int, ...]], list[tuple[str, int, int]], torch.Tensor]
"""(the host buffer, its parts' shapes, (store, E, K) per compressor, each token's sequence)."""


@dataclass(frozen=True)
class _Uploaded:
    """A step's metadata on the device, split into its parts (read-only to every user)."""

    key: tuple
    views: list[torch.Tensor]
    pos_host: torch.Tensor
    seq_ids: torch.Tensor
    job_meta: list[tuple[str, int, int]]
    keep: torch.Tensor | None


_last_uploaded: dict[tuple[torch.device, tuple], _Uploaded] = {}
"""The last step metadata uploaded to each device for each layer type (its rings' specs).
Every layer of a model plans the same step (each pool holds the same sequences at the same
lengths: the same positions, slots and, per ring spec, the same entry jobs - only the block
tables differ, and they live in the stores), so the layers after the first of each type reuse
its buffer and device copy: one host build, one host-to-device copy and one split a step per
layer type instead of one per layer (``benchmarks/plan_cost.py``). Keyed by layer type so
that interleaved types (C4, C128, C4, ...) do not evict each other; taken only on the stream
that made it (another stream could read it before its copy landed, or after the allocator
reused it); never during CUDA-graph capture (a captured copy's memory belongs to its graph)."""


_SHARING = env_switch("DSV4_SHARE_STEP_METADATA", default=True)


def set_metadata_sharing(on: bool) -> bool:
    """Whether the layers of a step share its uploaded metadata (:data:`_last_uploaded`; on by
    default, ``DSV4_SHARE_STEP_METADATA=0`` in the environment turns it off); returns the
    previous value. Off, every layer builds and uploads its own (and nothing is kept)."""
    global _SHARING
    if not isinstance(on, bool):
        raise TypeError(f"set_metadata_sharing: on must be a bool, got {on!r}")
    prev, _SHARING = _SHARING, on
    if not on:
        _last_uploaded.clear()
    return prev


def forget_uploaded_metadata() -> None:
    """Drop the shared step metadata (:data:`_last_uploaded`): the next step of every layer
    builds and uploads its own, as the first layer of a step does (the decode-step bench counts
    a layer's launches this way)."""
    _last_uploaded.clear()


def _uploaded_metadata(starts: list[int], slots: list[int], counts: list[int],
                       specs: tuple[tuple[str, RingSpec], ...], device: torch.device
                       ) -> _Uploaded:
    """The step's metadata on ``device``: the last one built there where it is the same step
    (the same starts, slots, counts and ring specs, on the same stream), else built, uploaded
    and split."""
    stream = None
    capturing = False
    if device.type == "cuda":
        stream = torch.cuda.current_stream(device).cuda_stream
        capturing = torch.cuda.is_current_stream_capturing()
    key = (tuple(starts), tuple(slots), tuple(counts), stream)
    share = _SHARING and not capturing
    last = _last_uploaded.get((device, specs)) if share else None
    if last is not None and last.key == key:
        return last
    build = _decode_metadata if all(n == 1 for n in counts) else _step_metadata
    host, shapes, job_meta, seq_ids = build(starts, slots, counts, list(specs))
    dev, keep = upload(host, device)
    views = list(torch.split(dev, [_numel(s) for s in shapes]))
    # split already gives the 1-D pieces their shape (a view is ~1 us of host time each)
    views = [v if len(s) == 1 else v.view(s) for v, s in zip(views, shapes, strict=True)]
    made = _Uploaded(key, views, host[:sum(counts)], seq_ids, job_meta, keep)
    if share:
        _last_uploaded[(device, specs)] = made
    return made


def _step_metadata(starts: list[int], slots: list[int], counts: list[int],
                   specs: list[tuple[str, RingSpec]]) -> Metadata:
    """A step's metadata (:meth:`CacheStep.plan`) for any counts, vectorised in NumPy: per token
    its position and slot; per compressor the entries completed, their sources and the ring rows
    kept."""
    t = sum(counts)
    n_arr = np.asarray(counts, dtype=np.int64)
    a_arr = np.asarray(starts, dtype=np.int64)
    s_arr = np.asarray(slots, dtype=np.int64)
    begins = np.concatenate(([0], np.cumsum(n_arr)[:-1]))
    seq_ids = np.repeat(np.arange(len(starts)), n_arr)
    pos = a_arr[seq_ids] + np.arange(t) - begins[seq_ids]
    parts = [pos, s_arr[seq_ids]]
    shapes: list[tuple[int, ...]] = [(t,), (t,)]
    job_meta: list[tuple[str, int, int]] = []
    for name, spec in specs:
        cr, ratio = spec.rows, spec.ratio
        # entries j = a // ratio .. (a + n) // ratio - 1 of each sequence
        first_j = a_arr // ratio
        per_seq = (a_arr + n_arr) // ratio - first_j
        e_seq = np.repeat(np.arange(len(starts)), per_seq)
        e = int(e_seq.shape[0])
        e_j = first_j[e_seq] + _ramp(per_seq)
        a_e, s_e, tb_e = a_arr[e_seq, None], s_arr[e_seq, None], begins[e_seq, None]
        q = (e_j[:, None] - spec.coff + 1) * ratio + np.arange(cr)[None, :]
        ring_src = np.where((q >= 0) & (q < a_e), s_e * cr + q % cr, -1)
        call_src = np.where(q >= a_e, tb_e + q - a_e, -1)
        # the last min(n, cr) positions of each sequence stay in its ring
        kept = np.minimum(n_arr, cr)
        k_seq = np.repeat(np.arange(len(starts)), kept)
        k = int(k_seq.shape[0])
        kq = (a_arr + n_arr - kept)[k_seq] + _ramp(kept)
        parts += [s_arr[e_seq], e_j, ring_src.reshape(-1), call_src.reshape(-1),
                  s_arr[k_seq] * cr + kq % cr, begins[k_seq] + kq - a_arr[k_seq]]
        shapes += [(e,), (e,), (e, cr), (e, cr), (k,), (k,)]
        job_meta.append((name, e, k))
    host = torch.from_numpy(np.concatenate(parts).astype(np.int64, copy=False))
    return host, shapes, job_meta, torch.from_numpy(seq_ids)


def _decode_metadata(starts: list[int], slots: list[int], counts: list[int],
                     specs: list[tuple[str, RingSpec]]) -> Metadata:
    """:func:`_step_metadata` for a decode step (every count 1) in plain Python: the same buffer
    in a fraction of the host time (NumPy's per-call cost dominates arrays this small)."""
    m = len(starts)
    flat = list(starts) + list(slots)
    shapes: list[tuple[int, ...]] = [(m,), (m,)]
    job_meta: list[tuple[str, int, int]] = []
    for name, spec in specs:
        cr, ratio, coff = spec.rows, spec.ratio, spec.coff
        done = [i for i, a in enumerate(starts) if (a + 1) % ratio == 0]  # entry a // ratio
        ring_src: list[int] = []
        call_src: list[int] = []
        for i in done:
            a, s = starts[i], slots[i]
            first = (a // ratio - coff + 1) * ratio
            for q in range(first, first + cr):
                ring_src.append(s * cr + q % cr if 0 <= q < a else -1)
                call_src.append(i + q - a if q >= a else -1)  # q == a: this step's row i
        flat += [slots[i] for i in done] + [starts[i] // ratio for i in done]
        flat += ring_src + call_src
        flat += [s * cr + a % cr for a, s in zip(starts, slots, strict=True)] + list(range(m))
        e = len(done)
        shapes += [(e,), (e,), (e, cr), (e, cr), (m,), (m,)]
        job_meta.append((name, e, m))
    # through an int64 array: torch.tensor of a Python list costs ~4x as much host time
    host = (torch.frombuffer(array("q", flat), dtype=torch.int64) if flat
            else torch.zeros(0, dtype=torch.int64))  # frombuffer refuses an empty buffer
    return host, shapes, job_meta, torch.arange(m)


def _ramp(lengths: np.ndarray) -> np.ndarray:
    """0 .. n_i - 1 for each n_i of ``lengths``, concatenated."""
    total = int(lengths.sum())
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.arange(total, dtype=np.int64) - starts


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
