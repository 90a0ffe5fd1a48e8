"""Caches filled with a synthetic history, for benchmarks at long contexts (64K tokens per
sequence, many sequences) where a real prefill would take longer than the measurement.

:func:`fill_history` gives each sequence ``context`` positions: the window rows the next step
reads, every compressed entry and indexer key, and the compressors' ring rows, all random
(seeded, generated on the pool's device), then sets the lengths. Main kv values are made
fp8-representable the way the layer writes them (``fp8_block_sim`` of the nope dims), so bf16
and ``fp8_ds_mla`` caches filled with the same seed hold the same rows and the steps that read
them can be compared. Only the blocks a step can read are held (window rows before
``context - window + 1`` are never allocated, as after a real prefill).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dsv4.cache.pool import AttentionCache
from dsv4.cache.store import PagedStore
from dsv4.config import ceil_div
from dsv4.layers.quant_sim import fp8_block_sim

CHUNK_ROWS = 1 << 15


def _hold(store: PagedStore, slot: int, first: int, rows: int) -> None:
    """Give an empty slot the blocks of rows ``first .. rows - 1`` (earlier logical blocks are
    marked released, -1)."""
    if store.num_logical(slot):
        raise ValueError(f"{store.name} store: slot {slot} already holds rows")
    b = store.block_size
    lo, hi = first // b, ceil_div(rows, b)
    if hi > store.max_logical:
        raise ValueError(f"{store.name} store: {rows} rows exceed the table")
    new = store.alloc.allocate(hi - lo) if hi > lo else []
    store._blocks[slot] = [-1] * lo + list(new)
    if new:
        store.table[slot, lo:hi] = torch.tensor(new, dtype=torch.int32)
    store._mark(slot, 0, hi)
    store.sync()


def _random_rows(n: int, dim: int, gen: torch.Generator, device: torch.device,
                 dtype: torch.dtype, nope: int | None) -> torch.Tensor:
    v = torch.randn(n, dim, generator=gen, device=device, dtype=torch.float32)
    if nope:
        v = torch.cat((fp8_block_sim(v[:, :nope]), v[:, nope:]), dim=1)
    return v.to(dtype)


def fill_history(caches: list[AttentionCache], context: int | Sequence[int],
                 seed: int = 0) -> None:
    """Give each (empty) cache ``context`` positions of synthetic history (module docstring),
    or cache i ``context[i]`` of them. Sequence i's values come from seed ``seed + i``, whatever
    the pool's formats."""
    contexts = [context] * len(caches) if isinstance(context, int) else list(context)
    if len(contexts) != len(caches):
        raise ValueError(f"{len(contexts)} contexts for {len(caches)} caches")
    for i, (c, context) in enumerate(zip(caches, contexts, strict=True)):
        pool = c.pool
        if c.length:
            raise ValueError("fill_history needs empty caches")
        if context + 1 > c.max_seq_len:
            raise ValueError(f"context {context} leaves no room in max_seq_len={c.max_seq_len}")
        dev = pool.device
        gen = torch.Generator(device=dev).manual_seed(seed + i)
        nope = pool.cfg.head_dim - pool.cfg.qk_rope_head_dim
        slot = torch.tensor([c.slot], device=dev)
        for name in ("kv", "compressed", "idx_keys"):
            store = pool.stores.get(name)
            if store is None:
                continue
            if name == "kv":
                first, rows = max(0, context - pool.window + 1), context
            else:
                first, rows = 0, context // (pool.compress_ratio if name == "compressed" else 4)
            _hold(store, c.slot, first, rows)
            for a in range(first, rows, CHUNK_ROWS):
                e = min(rows, a + CHUNK_ROWS)
                flat = store.flat_rows(slot, torch.arange(a, e, device=dev))
                store.write(flat, _random_rows(e - a, store.fmt.dim, gen, dev, pool.dtype,
                                               None if name == "idx_keys" else nope))
        for _, ring in pool.rings.values():
            ring[c.slot] = torch.randn(ring.shape[1:], generator=gen, device=dev,
                                       dtype=torch.float32).to(ring.dtype)
        pool._lengths[c.slot] = context
