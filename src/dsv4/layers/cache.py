"""Per-sequence attention state of one layer.

Everything is keyed by absolute position and kept for the whole history up to ``max_seq_len``
(dsv4-attention.md §8.2 allows "the full history"): the window rows, the compressor's raw rows
[a_p | b_p + ape], the compressed entries and the indexer keys. A forward writes only rows at or
after ``length`` and advances ``length`` last, so a call that fails half-way leaves the cache
logically unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    """[max_seq_len, 2 * coff * head_dim] (acc dtype): main compressor per-token partial rows."""
    compressed: torch.Tensor | None = None
    """[ceil(max_seq_len / r), head_dim]: main compressed entries."""
    idx_raw: torch.Tensor | None = None
    """[max_seq_len, 4 * index_head_dim] (acc dtype): indexer compressor partial rows."""
    idx_keys: torch.Tensor | None = None
    """[ceil(max_seq_len / 4), index_head_dim]: indexer key entries."""
    length: int = 0

    @classmethod
    def allocate(cls, *, layer_id: int, compress_ratio: int, max_seq_len: int, head_dim: int,
                 index_head_dim: int, dtype: torch.dtype, acc_dtype: torch.dtype,
                 device: torch.device) -> AttentionCache:
        if max_seq_len <= 0:
            raise ValueError(f"max_seq_len={max_seq_len} must be positive")
        r = compress_ratio
        cache = cls(layer_id=layer_id, compress_ratio=r, max_seq_len=max_seq_len,
                    kv=torch.zeros(max_seq_len, head_dim, dtype=dtype, device=device))
        if r:
            coff = 2 if r == 4 else 1
            cache.raw = torch.zeros(max_seq_len, 2 * coff * head_dim, dtype=acc_dtype,
                                    device=device)
            cache.compressed = torch.zeros(ceil_div(max_seq_len, r), head_dim, dtype=dtype,
                                           device=device)
        if r == 4:
            cache.idx_raw = torch.zeros(max_seq_len, 4 * index_head_dim, dtype=acc_dtype,
                                        device=device)
            cache.idx_keys = torch.zeros(ceil_div(max_seq_len, 4), index_head_dim, dtype=dtype,
                                         device=device)
        return cache

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
