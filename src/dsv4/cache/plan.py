"""One step plan for all layers of a model: the step's metadata built and uploaded once.

Every layer of a model holds the same sequences at the same lengths, so a step's positions,
slots and compressor jobs are the same in every layer (of a type); only the block tables differ,
and they live in each layer's pool. A :class:`StepPlan` is built once per step over the step's
sequences - one cache per layer for each, as a model keeps them - and:

1. checks the sequences (alive, one pool per layer, the same length in every layer, room for
   the step's tokens) and the layers' block needs, then takes every pool's blocks (all checked
   before any is taken: a pool that lacks blocks raises with nothing taken anywhere);
2. builds the metadata on the host once per distinct (slots, layer type) - normally one per
   layer type - and uploads all of it in one host-to-device copy (or writes it into a fixed
   device buffer, for a CUDA graph that reads it there: ``into``);
3. hands each layer its :class:`~dsv4.cache.step.CacheStep` (``layer(x, plan=plan)``);
4. at the end of the step, :meth:`commit` advances every sequence's length and releases the
   window blocks no query reads any more; :meth:`rollback` instead gives back the blocks the
   step took and the ring rows it replaced, so that a step that failed in any layer leaves
   every cache as it was. ``with plan:`` does one or the other.

A padded plan (``pad_to``, ``visible_caps``) has the fixed shapes a captured CUDA graph
replays (:mod:`dsv4.cache.step`; the decode runner, :mod:`dsv4.runner`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch

from dsv4.cache.pool import AttentionCache, CachePool
from dsv4.cache.step import (
    CacheStep,
    HostMetadata,
    StepMetadata,
    build_metadata,
    metadata_views,
    padded_decode_layout,
    ring_specs,
    take_blocks,
)
from dsv4.host_copy import upload, upload_into
from dsv4.kernels.decode_metadata import (
    JOBS,
    POS,
    decode_seed,
    expand_decode_metadata,
    seed_usable,
)

BufferFor = Callable[[int, tuple[int, ...]], torch.Tensor]
"""(metadata size, the metadata group of each layer) -> the device buffer to write it into."""


class StepPlanError(ValueError):
    """A step plan's sequences or a layer's use of the plan is invalid; nothing was changed."""


@dataclass
class _MetadataLaunch:
    """A seeded plan's metadata launch (:func:`~dsv4.kernels.decode_metadata.expand_decode_metadata`
    over ``buffer``), and whether it was queued."""

    seed_at: int
    table_at: int
    sections: int
    b: int
    sources: int
    buffer: torch.Tensor | None = None
    queued: bool = False


class StepPlan:
    """One step of ``seq_lens[i]`` tokens (default: 1, a decode step) for each sequence
    ``caches[i]`` (its cache in every layer, as a model keeps them), for every layer.

    ``positions`` (device, [T]) and ``seq_lens`` are the step's; a layer called with
    ``plan=plan`` takes its step from the plan (:meth:`step_for`). Padded plans (``pad_to`` =
    (sequences, tokens per sequence), ``visible_caps``) and ``into`` serve the decode runner:
    ``into`` is the int64 device buffer the metadata is written into, or a function of (its
    size, which metadata group each layer reads) that returns it - a graph captured over one
    such layout replays only plans of the same.

    ``metadata_on_device``: a padded decode plan (``pad_to`` = (B, 1)) with ``into`` uploads
    only the metadata's seed (the B positions and slots, after the metadata's place in the
    buffer) and leaves the values to one device launch, which the caller queues with
    :meth:`write_metadata` before any layer runs the step - the decode runner does, so that its
    graphs replay the launch and a step's host work is the seed alone. Other plans, and every
    plan on a CUDA device without Triton, build the metadata on the host whatever this says."""

    def __init__(self, caches: Sequence[Sequence[AttentionCache]],
                 seq_lens: Sequence[int] | None = None, *,
                 pad_to: tuple[int, int] | None = None,
                 visible_caps: dict[int, int] | None = None,
                 into: torch.Tensor | BufferFor | None = None,
                 metadata_on_device: bool = False) -> None:
        seqs, self.pools, self.starts, self.columns = _checked(caches)
        self.slots = [[c.slot for c in column] for column in self.columns]
        counts = token_counts(seq_lens, len(seqs))
        total = sum(counts)
        if pad_to is not None and (
                not isinstance(pad_to, tuple) or len(pad_to) != 2
                or any(isinstance(v, bool) or not isinstance(v, int) for v in pad_to)
                or pad_to[0] < len(seqs) or pad_to[1] < max(counts)):
            raise StepPlanError(f"pad_to={pad_to!r} must be (sequences, tokens per sequence) of "
                                f"at least ({len(seqs)}, {max(counts)})")
        self.caches = seqs
        self.seq_lens = counts
        ends = [a + n for a, n in zip(self.starts, counts, strict=True)]
        longest = max(ends)
        for pool in self.pools:
            if longest > pool.max_seq_len:
                i = ends.index(longest)
                raise StepPlanError(
                    f"sequence {i}: {self.starts[i]} cached + {counts[i]} new tokens exceed "
                    f"layer {pool.layer_id}'s max_seq_len={pool.max_seq_len}")
            if total > pool.step_tokens:
                raise StepPlanError(
                    f"{total} tokens exceed layer {pool.layer_id}'s step_tokens="
                    f"{pool.step_tokens}: a plan is one step (call the layers without a plan, "
                    "which split the call into steps)")
        self._done = False
        # the rings: a step of at most max_rollback tokens per sequence replaces only ring rows
        # no retry reads (the rings' history); longer ones replace rows the step's own entries
        # read, so keep those pools' rows of these sequences for a rollback
        self._rings: dict[int, dict[str, torch.Tensor]] = {}
        longest = max(counts)
        for k, pool in enumerate(self.pools):
            if pool.rings and longest > pool.max_rollback:
                self._rings[k] = pool.snapshot_rings(self.slots[k])
        self._grown = take_blocks(list(zip(self.pools, self.slots, strict=True)), self.starts,
                                  ends)
        self._pending: _MetadataLaunch | None = None
        try:
            self.steps = self._metadata(pad_to, visible_caps, into, metadata_on_device)
        except BaseException:
            self._give_back_blocks()  # nothing taken survives a plan that was not made
            raise

    # ------------------------------------------------------------------ metadata
    def _metadata(self, pad_to: tuple[int, int] | None, visible_caps: dict[int, int] | None,
                  into: torch.Tensor | BufferFor | None, on_device: bool
                  ) -> dict[int, CacheStep]:
        """Each pool's CacheStep, the metadata built once per (slots, ring specs) and uploaded
        in one copy - or, for a padded decode plan ``on_device`` into a caller's buffer, its
        seed uploaded after the metadata's place and the values left to
        :meth:`write_metadata`."""
        groups = _groups(self.pools, self.slots, pad_to is not None)
        device = self.pools[0].device
        hosts: list[HostMetadata] = []
        pending: _MetadataLaunch | None = None
        if (on_device and pad_to is not None and pad_to[1] == 1 and into is not None
                and any(specs for _slots, _pad, specs in groups) and seed_usable(device)):
            sent, pending = self._seed(groups, pad_to[0], visible_caps, hosts)
            size = pending.seed_at + sent.numel()
        else:
            for (slots, pad_slot, specs), _ in groups.items():
                hosts.append(build_metadata(self.starts, list(slots), self.seq_lens, specs,
                                            pad_to, pad_slot, visible_caps))
            parts = [h.buffer for h in hosts if h.buffer is not None]
            sent = torch.cat(parts) if len(parts) > 1 else parts[0]
            size = sent.numel()
        keep = None
        if callable(into):  # the caller picks the buffer by the layout (a graph's buffer)
            layout = [0] * len(self.pools)
            for g, members in enumerate(groups.values()):
                for k in members:
                    layout[k] = g
            into = into(size, tuple(layout))
        made: dict[tuple[Any, ...], list[torch.Tensor]] | None = None
        if into is not None:
            if into.dtype != torch.int64 or into.device != device or into.dim() != 1 \
                    or into.numel() != size:
                raise StepPlanError(f"into: an int64 [{size}] tensor on {device} "
                                    f"(got {into.dtype} {tuple(into.shape)} on {into.device})")
            upload_into(into[size - sent.numel():], sent)  # the metadata, or its seed
            dev = into
            # a buffer the caller keeps (the runner's, per bucket): its parts' views are made
            # once per layout and kept on it (views are ~1 us of host time each)
            made = into.__dict__.setdefault("_dsv4_metadata_views", {})
        else:
            dev, keep = upload(sent, device)
        if pending is not None:
            pending.buffer = dev
            self._pending = pending
        self.num_metadata = size
        steps: dict[int, CacheStep] = {}
        offset = 0
        for host, members in zip(hosts, groups.values(), strict=True):
            n = host.size
            if made is None:
                meta = StepMetadata.split(host, dev[offset:offset + n])
            else:
                key = (offset, tuple(host.shapes))
                views = made.get(key)
                if views is None:
                    views = made[key] = metadata_views(host.shapes, dev[offset:offset + n])
                meta = StepMetadata.split(host, dev, views)
            offset += n
            for k in members:
                pool = self.pools[k]
                steps[id(pool)] = CacheStep(pool, self.columns[k], list(self.starts),
                                            list(self.seq_lens), meta, keep)
        self._first = steps[id(self.pools[0])]
        return steps

    def _seed(self, groups: dict[tuple[Any, ...], list[int]], b: int,
              visible_caps: dict[int, int] | None, hosts: list[HostMetadata]
              ) -> tuple[torch.Tensor, _MetadataLaunch]:
        """The host side of a padded decode plan of ``b`` sequences whose metadata the device
        writes: each group's layout into ``hosts``; returns the seed
        (:func:`~dsv4.kernels.decode_metadata.decode_seed`), which goes after the metadata's
        place in the buffer, and the launch's arguments (its buffer not yet known)."""
        sections: list[tuple[int, ...]] = []
        seeds: list[tuple[list[int], int]] = []
        offset = sources = 0
        for g, (slots, pad_slot, specs) in enumerate(groups):
            seeds.append((list(slots), pad_slot))
            sections.append((POS, offset, g, 0, 0, 0, 0, pad_slot))
            offset += 2 * b
            for _name, spec in specs:
                sections.append((JOBS, offset, g, spec.rows, spec.sources, spec.ratio,
                                 spec.coff, pad_slot))
                offset += 2 * b * (spec.sources + 2)
                sources = max(sources, spec.sources)
        seed_at = offset  # the positions, then each group's slots, then the table
        table = [(kind, out, seed_at + (1 + g) * b, *rest) for kind, out, g, *rest in sections]
        seed = decode_seed(self.starts, b, seeds, table)
        positions = seed[:b]
        hosts += [padded_decode_layout(b, len(self.starts), specs, visible_caps, positions)
                  for _slots, _pad, specs in groups]
        launch = _MetadataLaunch(seed_at, seed_at + (1 + len(seeds)) * b, len(table), b, sources)
        return seed, launch

    # ------------------------------------------------------------------ the layers' view
    @property
    def positions(self) -> torch.Tensor:
        """[T] int64 positions of the step's tokens on the device (padded: B * Q of them)."""
        self._check_written()
        return self._first.pos

    @property
    def num_tokens(self) -> int:
        return self._first.num_tokens

    def _check_written(self) -> None:
        if self._pending is not None and not self._pending.queued:
            raise StepPlanError("this plan's metadata is written on the device: call "
                                "plan.write_metadata() before the step reads it")

    def write_metadata(self) -> None:
        """Queue the launch that writes the step's metadata from its seed on the current stream
        (a plan made with ``metadata_on_device`` that took it; otherwise nothing to do). Again
        inside a CUDA-graph capture, to capture it."""
        pending = self._pending
        if pending is None:
            return
        assert pending.buffer is not None
        expand_decode_metadata(pending.buffer, pending.seed_at, pending.table_at,
                               pending.sections, pending.b, pending.sources)
        pending.queued = True

    def step_for(self, layer: Any) -> CacheStep:
        """The :class:`CacheStep` of ``layer`` (a :class:`~dsv4.DeepseekV4Attention`): its
        pool's, found by layer id (a plan holds one pool per layer)."""
        if self._done:
            raise StepPlanError("this plan's step is over (committed or rolled back): build a "
                                "new plan for the next step")
        self._check_written()
        for pool in self.pools:
            if pool.layer_id == layer.layer_id:
                if (pool.compress_ratio != layer.compress_ratio or pool.dtype != layer.dtype
                        or pool.device != layer.device):
                    raise StepPlanError(
                        f"the plan's layer {pool.layer_id} caches (ratio {pool.compress_ratio}, "
                        f"{pool.dtype} on {pool.device}) do not belong to this layer (ratio "
                        f"{layer.compress_ratio}, {layer.dtype} on {layer.device})")
                return self.steps[id(pool)]
        held = sorted(p.layer_id for p in self.pools)
        raise StepPlanError(f"the plan holds no caches of layer {layer.layer_id} (it holds "
                            f"layers {held})")

    # ------------------------------------------------------------------ end of step
    def commit(self) -> None:
        """The step ran in every layer: advance every sequence's length in every pool and
        release the window blocks no query reads any more."""
        self._finish()
        rows: dict[tuple[int, int], list[int]] = {}  # the same for every pool of one window
        for step in self.steps.values():
            pool = step.pool
            key = (pool.window, pool.max_rollback)
            if key not in rows:
                rows[key] = pool.window_release_rows(self.starts, self.seq_lens)
            step.commit(release_rows=rows[key])

    def rollback(self) -> None:
        """The step failed: every pool as before the plan (blocks, ring rows, lengths)."""
        self._finish()
        self._give_back_blocks()  # lengths change only at commit
        for k, saved in self._rings.items():
            self.pools[k].restore_rings(self.slots[k], saved)

    def _give_back_blocks(self) -> None:
        """The blocks this plan took go back, last taken first (the free lists as before)."""
        for pool, name, slot, before in reversed(self._grown):
            pool.stores[name].shrink_to(slot, before)
        for pool in {id(p): p for p, _, _, _ in self._grown}.values():
            for store in pool.stores.values():
                store.sync()

    def _finish(self) -> None:
        if self._done:
            raise StepPlanError("this plan's step was already committed or rolled back")
        self._done = True

    def __enter__(self) -> StepPlan:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._done:
            return
        if kind is None:
            self.commit()
        else:
            self.rollback()

    def __repr__(self) -> str:
        if "steps" not in self.__dict__:  # __init__ raised (a traceback's locals show it)
            return "StepPlan(not made)"
        state = "done" if self._done else "open"
        return (f"StepPlan({len(self.caches)} sequence(s), {sum(self.seq_lens)} token(s), "
                f"{len(self.pools)} layer(s), {state})")


def token_counts(seq_lens: Sequence[int] | None, n: int) -> list[int]:
    """The step's token count of each of ``n`` sequences (default 1: a decode step), checked."""
    if seq_lens is None:
        return [1] * n
    counts = list(seq_lens)
    if len(counts) != n or any(isinstance(c, bool) or not isinstance(c, int) or c <= 0
                               for c in counts):
        raise StepPlanError(f"seq_lens={counts} must give a positive token count for each of "
                            f"the {n} sequence(s)")
    return counts


def _checked(caches: Any) -> tuple[list[list[AttentionCache]], list[CachePool], list[int],
                                   list[list[AttentionCache]]]:
    """(the sequences' cache lists, the pool of each layer, each sequence's length, each layer's
    caches), checked:
    live caches, one pool per layer (and layer id), every sequence once per pool and at one
    length in every layer. One pass over the caches (a model's step checks L x M of them)."""
    if isinstance(caches, AttentionCache) or not isinstance(caches, Sequence) or not caches:
        raise StepPlanError("caches: give one list per sequence of its cache in every layer "
                            "(caches[i][k]: sequence i, layer k)")
    seqs = [list(seq) if isinstance(seq, Sequence) and not isinstance(seq, AttentionCache)
            else None for seq in caches]
    first = seqs[0]
    for i, seq in enumerate(seqs):
        if not seq:
            raise StepPlanError(f"caches[{i}] must be a non-empty list of the sequence's "
                                "caches, one per layer")
        if first is not None and len(seq) != len(first):
            raise StepPlanError(f"caches[{i}] has {len(seq)} caches; caches[0] has {len(first)} "
                                "(one per layer for every sequence)")
    assert first is not None
    pools: list[CachePool] = []
    starts: list[int] = []
    columns: list[list[AttentionCache]] = []
    for k in range(len(first)):
        c0 = first[k]
        if not isinstance(c0, AttentionCache):
            raise StepPlanError(f"caches[0][{k}] is a {type(c0).__name__}, not an AttentionCache")
        pool = c0.pool
        handles, lengths = pool._handles, pool._lengths
        column = [seq[k] for seq in seqs]  # type: ignore[index]
        for i, c in enumerate(column):
            # a live cache of this pool is the handle of its slot (a freed one no longer is)
            if not isinstance(c, AttentionCache) or c.pool is not pool \
                    or handles[c.slot] is not c:
                raise StepPlanError(_column_problem(c, i, k))
        lens = [lengths[c.slot] for c in column]
        if not k:
            starts = lens
        elif lens != starts:
            i = next(i for i, (a, b) in enumerate(zip(starts, lens, strict=True)) if a != b)
            raise StepPlanError(f"sequence {i} holds {starts[i]} tokens in its first layer's "
                                f"cache but {lens[i]} in layer {pool.layer_id}'s")
        if len({c.slot for c in column}) != len(column):
            raise StepPlanError(f"a sequence appears twice in layer {pool.layer_id}'s caches")
        pools.append(pool)
        columns.append(column)
    ids = [p.layer_id for p in pools]
    if len(set(ids)) != len(ids):
        raise StepPlanError(f"two caches of one sequence belong to the same layer id ({ids}): a "
                            "plan takes one pool per layer")
    return seqs, pools, starts, columns  # type: ignore[return-value]


def _column_problem(c: Any, i: int, k: int) -> str:
    if not isinstance(c, AttentionCache):
        return f"caches[{i}][{k}] is a {type(c).__name__}, not an AttentionCache"
    if not c.alive:
        return f"caches[{i}][{k}] was freed"
    return (f"caches[{i}][{k}] is in another pool than caches[0][{k}]: a plan takes one pool per "
            "layer")


def _groups(pools: list[CachePool], slots: list[list[int]], padded: bool
            ) -> dict[tuple[Any, ...], list[int]]:
    """The layers (by index) that read one copy of the metadata: those whose pools hold the
    sequences in the same slots (and padding slot) and have the same compressor rings."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for k, pool in enumerate(pools):
        key = (tuple(slots[k]), pool.pad_slot if padded else -1, ring_specs(pool))
        groups.setdefault(key, []).append(k)
    return groups


def truncate_sequences(caches: Sequence[Sequence[AttentionCache]], lengths: Sequence[int]
                       ) -> None:
    """Truncate sequence i (its cache in every layer, ``caches[i]``) to ``lengths[i]``
    positions - a speculative step's rollback of its rejected drafts - every layer checked
    before any changes (:meth:`CachePool.truncate_many`)."""
    seqs, pools, _, columns = _checked(caches)
    if len(lengths) != len(seqs):
        raise StepPlanError(f"{len(lengths)} lengths for {len(seqs)} sequence(s)")
    plans = [pool.check_truncation(column, lengths)
             for pool, column in zip(pools, columns, strict=True)]
    for pool, plan in zip(pools, plans, strict=True):
        pool.apply_truncation(plan)
