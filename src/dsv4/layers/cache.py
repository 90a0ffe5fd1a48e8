"""Per-sequence attention state of one layer.

The window rows, compressed entries and indexer keys are kept for the whole history up to
``max_seq_len``, keyed by absolute position. The compressors' raw rows [a_p | b_p + ape] are only
read for the entries of the current and (ratio 4) the previous block, so each is a ring of the
last ``coff * ratio`` positions (8 rows at ratio 4, 128 at ratio 128; the row of position p at
p % rows). A forward writes only rows at or after ``length`` (ring rows it replaces are older
than any entry still to come reads), and advances ``length`` last, so a call that fails
half-way leaves the cache logically unchanged.

A :class:`CachePool` holds several sequences' caches in shared tensors with a leading slot
dimension; each of its caches is a view of one slot and behaves like any other cache, and a
decode batch of caches from one pool reads and writes all sequences with single indexed
operations (``DeepseekV4Attention.forward_mqa_batched``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv4.config import ceil_div


@dataclass
class AttentionCache:
    layer_id: int
    compress_ratio: int
    max_seq_len: int
    kv: torch.Tensor
    """[max_seq_len, head_dim]: post-norm, post-RoPE, post-simulation kv row of each position."""
    raw: torch.Tensor | None = None
    """[coff * r, 2 * coff * head_dim] (acc dtype): main compressor per-token partial rows, the
    last coff * r positions (a ring)."""
    compressed: torch.Tensor | None = None
    """[ceil(max_seq_len / r), head_dim]: main compressed entries."""
    idx_raw: torch.Tensor | None = None
    """[8, 4 * index_head_dim] (acc dtype): indexer compressor partial rows, the last 8
    positions (a ring)."""
    idx_keys: torch.Tensor | None = None
    """[ceil(max_seq_len / 4), index_head_dim]: indexer key entries."""
    length: int = 0
    pool: CachePool | None = field(default=None, repr=False, compare=False)
    """The pool this cache is a slot of (None: a cache of its own)."""
    slot: int = -1
    """This cache's slot in ``pool``."""

    @classmethod
    def allocate(cls, *, layer_id: int, compress_ratio: int, max_seq_len: int, head_dim: int,
                 index_head_dim: int, dtype: torch.dtype, acc_dtype: torch.dtype,
                 device: torch.device) -> AttentionCache:
        kv, raw, compressed, idx_raw, idx_keys = _state_tensors(
            (), compress_ratio, max_seq_len, head_dim, index_head_dim, dtype, acc_dtype, device)
        return cls(layer_id=layer_id, compress_ratio=compress_ratio, max_seq_len=max_seq_len,
                   kv=kv, raw=raw, compressed=compressed, idx_raw=idx_raw, idx_keys=idx_keys)

    def num_compressed(self, length: int | None = None) -> int:
        """Entries complete after ``length`` tokens (default: the current length)."""
        n = self.length if length is None else length
        return n // self.compress_ratio if self.compress_ratio else 0

    def reset(self) -> None:
        """Start a new sequence in this cache (rows are overwritten before they are read)."""
        self.length = 0

    @property
    def device(self) -> torch.device:
        return self.kv.device

    @property
    def dtype(self) -> torch.dtype:
        return self.kv.dtype


@dataclass(repr=False, eq=False)
class CachePool:
    """``slots`` caches of one layer in shared tensors [slots, ...] (see the module docstring)."""

    kv: torch.Tensor
    """[slots, max_seq_len, head_dim]"""
    raw: torch.Tensor | None
    compressed: torch.Tensor | None
    idx_raw: torch.Tensor | None
    idx_keys: torch.Tensor | None
    slot_ids: torch.Tensor
    """arange(slots) on the device: a call's slot indices are built from views of it, so no
    host-to-device copy is needed (CUDA-graph capturable)."""
    caches: list[AttentionCache]

    @classmethod
    def allocate(cls, slots: int, *, layer_id: int, compress_ratio: int, max_seq_len: int,
                 head_dim: int, index_head_dim: int, dtype: torch.dtype, acc_dtype: torch.dtype,
                 device: torch.device) -> CachePool:
        if slots <= 0:
            raise ValueError(f"a cache pool needs at least one slot, got {slots}")
        kv, raw, compressed, idx_raw, idx_keys = _state_tensors(
            (slots,), compress_ratio, max_seq_len, head_dim, index_head_dim, dtype, acc_dtype,
            device)
        pool = cls(kv=kv, raw=raw, compressed=compressed, idx_raw=idx_raw, idx_keys=idx_keys,
                   slot_ids=torch.arange(slots, device=device), caches=[])

        def row(t: torch.Tensor | None, i: int) -> torch.Tensor | None:
            return None if t is None else t[i]

        for i in range(slots):
            pool.caches.append(AttentionCache(
                layer_id=layer_id, compress_ratio=compress_ratio, max_seq_len=max_seq_len,
                kv=kv[i], raw=row(raw, i), compressed=row(compressed, i),
                idx_raw=row(idx_raw, i), idx_keys=row(idx_keys, i), pool=pool, slot=i))
        return pool

    def slots_of(self, caches: list[AttentionCache]) -> torch.Tensor:
        """Slot indices [len(caches)] on the device, without a host-to-device copy."""
        return torch.cat([self.slot_ids[c.slot:c.slot + 1] for c in caches])


_State = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None,
               torch.Tensor | None]


def _state_tensors(lead: tuple[int, ...], r: int, max_seq_len: int, head_dim: int,
                   index_head_dim: int, dtype: torch.dtype, acc_dtype: torch.dtype,
                   device: torch.device) -> _State:
    """The state tensors of a cache (``lead`` = ()) or a pool (``lead`` = (slots,)).

    The row stores (kv, and the raw-row rings) are written before they are read (a forward
    reads rows up to its last position only), so they are left uninitialised: a pool sized for
    its longest sequence then commits no memory for rows a shorter one never reaches. The entry
    stores are zeroed: a -1 selection pad gathers entry 0 (weight 0) before it may exist, and a
    zero keeps that product finite. ``tests/test_pooled_decode.py`` fills the row stores with NaN
    to prove the first claim."""
    if max_seq_len <= 0:
        raise ValueError(f"max_seq_len={max_seq_len} must be positive")

    def rows(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return new_row_store((*lead, *shape), dt, device)

    def zeros(*shape: int) -> torch.Tensor:
        return torch.zeros(*lead, *shape, dtype=dtype, device=device)

    raw = compressed = idx_raw = idx_keys = None
    if r:
        coff = 2 if r == 4 else 1
        raw = rows(coff * r, 2 * coff * head_dim, dt=acc_dtype)
        compressed = zeros(ceil_div(max_seq_len, r), head_dim)
    if r == 4:
        idx_raw = rows(2 * 4, 4 * index_head_dim, dt=acc_dtype)
        idx_keys = zeros(ceil_div(max_seq_len, 4), index_head_dim)
    return rows(max_seq_len, head_dim), raw, compressed, idx_raw, idx_keys


def new_row_store(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
                  ) -> torch.Tensor:
    """Allocation of a per-position row store (uninitialised; see :func:`_state_tensors`)."""
    return torch.empty(shape, dtype=dtype, device=device)
