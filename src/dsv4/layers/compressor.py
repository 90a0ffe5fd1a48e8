"""The KV compressor: gated softmax pooling of r tokens into one compressed entry.

Per token p the projection gives [a_p | s_p] (fp32); b_p = s_p + ape[p mod r] is recorded once.
Entry j (complete at p = j*r + r - 1) is a per-channel softmax over its candidate tokens of b,
weighting a; ratio 4 overlaps (coff = 2: the previous block uses channels [0, d), the current block
channels [d, 2d); entry 0 has no previous block), ratio 128 does not. Then RMSNorm, RoPE at j*r and
the official quantisation simulation (dsv4-attention.md §5.6).
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4.config import DSV4Config
from dsv4.layers.linear import MergedLinear
from dsv4.layers.norm import RMSNorm
from dsv4.layers.quant_sim import fp8_block_sim, indexer_quant_sim
from dsv4.layers.rotary import RotaryEmbedding


class Compressor(nn.Module):
    def __init__(self, cfg: DSV4Config, *, dim: int, ratio: int, for_indexer: bool,
                 dtype: torch.dtype, f32_dtype: torch.dtype,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if ratio not in (4, 128):
            raise ValueError(f"compress ratio must be 4 or 128, got {ratio}")
        self.ratio = ratio
        self.coff = 2 if ratio == 4 else 1
        self.dim = dim
        self.for_indexer = for_indexer
        self.rope_dim = cfg.qk_rope_head_dim
        width = self.coff * dim
        self.fused_wkv_wgate = MergedLinear(cfg.hidden_size, [width, width], fp8=False,
                                            dtype=dtype, device=device)
        self.ape = nn.Parameter(torch.zeros(ratio, width, dtype=f32_dtype, device=device),
                                requires_grad=False)
        self.norm = RMSNorm(dim, cfg.rms_norm_eps, dtype=dtype, device=device)

    @property
    def raw_width(self) -> int:
        return 2 * self.coff * self.dim

    @property
    def ring_rows(self) -> int:
        """Raw rows a cache keeps: the last ``coff * ratio`` positions (row of position p at
        p % ring_rows). An entry needs its own block and, at ratio 4, the previous one."""
        return self.coff * self.ratio

    def raw_rows(self, kv_score: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
                 ) -> torch.Tensor:
        """[a_p | s_p + ape[p mod r]] for the tokens at ``positions`` [T, raw_width], in ``dtype``.

        ``kv_score`` may be a row-strided view (the fused GEMM's split); it is read, never kept.
        """
        width = self.coff * self.dim
        ape = self.ape.to(dtype)[positions % self.ratio]
        return torch.cat((kv_score[:, :width].to(dtype), (kv_score[:, width:] + ape).to(dtype)),
                         dim=-1)

    def first_row_needed(self, j0: int) -> int:
        """The earliest position whose raw row entries j0, j0 + 1, ... read."""
        return max(0, (j0 - self.coff + 1) * self.ratio)

    def ring_rows_between(self, ring: torch.Tensor, first: int, end: int) -> torch.Tensor:
        """Rows of positions first .. end - 1 from a cache's ring (all within its last
        ``ring_rows`` positions), in position order."""
        if end <= first:
            return ring[:0]
        return ring[torch.arange(first, end, device=ring.device) % self.ring_rows]

    def store_ring_rows(self, ring: torch.Tensor, rows: torch.Tensor, start: int) -> None:
        """Keep the rows of positions start .. start + T - 1 that the ring holds: the last
        ``ring_rows`` of them."""
        end = start + rows.shape[0]
        first = max(start, end - self.ring_rows)
        ring[torch.arange(first, end, device=ring.device) % self.ring_rows] = rows[first - start:]

    def write_raw_rows_at(self, kv_score: torch.Tensor, slots: torch.Tensor,
                          positions: torch.Tensor, ring_pool: torch.Tensor) -> None:
        """One token per slot of a pool: its raw row goes to ``ring_pool[slots[b], positions[b] %
        ring_rows]`` (one indexed write). The row it replaces is ``ring_rows`` positions older,
        which no entry from this token's block on reads."""
        ring_pool[slots, positions % self.ring_rows] = self.raw_rows(kv_score, positions,
                                                                     ring_pool.dtype)

    def compress(self, src: torch.Tensor, base: int, j0: int, j1: int, rotary: RotaryEmbedding,
                 out_dtype: torch.dtype, simulate_quant: bool) -> torch.Tensor:
        """Entries j0 .. j1 - 1 from raw rows ``src``, whose row i is position ``base + i`` and
        which hold every position from :meth:`first_row_needed` (j0) to j1 * ratio - 1."""
        r = self.ratio
        n = j1 - j0
        width = 2 * self.coff * self.dim
        cur = src[j0 * r - base: j1 * r - base].view(n, r, width)
        prev = None
        if self.coff == 2:
            if j0 == 0:
                # entry 0 has no previous block: its candidates are masked, not zero-weighted
                prev = torch.cat((self._no_previous_block(src).expand(1, r, width),
                                  src[: (j1 - 1) * r - base].view(n - 1, r, width)))
            else:
                prev = src[(j0 - 1) * r - base: (j1 - 1) * r - base].view(n, r, width)
        positions = torch.arange(j0, j1, device=src.device) * r
        return self._pool(cur, prev, positions, rotary, out_dtype, simulate_quant)

    def compress_at(self, raw_pool: torch.Tensor, slots: torch.Tensor, entries: torch.Tensor,
                    rotary: RotaryEmbedding, out_dtype: torch.dtype, simulate_quant: bool
                    ) -> torch.Tensor:
        """Entry ``entries[b]`` of pool slot ``slots[b]``, one per row [K, dim]: what
        :meth:`compress` gives for that entry of that slot's raw-row ring (``raw_pool``
        [S, ring_rows, raw_width]); the entry's rows must be the ring's latest."""
        r, ring = self.ratio, self.ring_rows
        rows = entries[:, None] * r + torch.arange(r, device=raw_pool.device)  # [K, r]
        cur = raw_pool[slots[:, None], rows % ring]
        prev = None
        if self.coff == 2:
            prev = raw_pool[slots[:, None], (rows - r).clamp(min=0) % ring]
            first = (entries == 0)[:, None, None]
            prev = torch.where(first, self._no_previous_block(raw_pool), prev)
        return self._pool(cur, prev, entries * r, rotary, out_dtype, simulate_quant)

    def _no_previous_block(self, raw: torch.Tensor) -> torch.Tensor:
        """The stand-in row [1, 1, raw_width] for entry 0's missing previous block: a = 0 and
        score -inf, so its candidates get weight 0."""
        width = self.coff * self.dim
        pad = torch.zeros(1, 1, 2 * width, dtype=raw.dtype, device=raw.device)
        pad[..., width:] = float("-inf")
        return pad

    def _pool(self, cur: torch.Tensor, prev: torch.Tensor | None, positions: torch.Tensor,
              rotary: RotaryEmbedding, out_dtype: torch.dtype, simulate_quant: bool
              ) -> torch.Tensor:
        """Entries from their blocks of raw rows: ``cur`` [n, r, raw_width], ``prev`` the previous
        blocks (ratio 4) or None; ``positions`` [n] = j * r of each entry."""
        d = self.dim
        width = self.coff * d
        if prev is None:
            a, b = cur[..., :d], cur[..., d:]
        else:
            a = torch.cat((prev[..., :d], cur[..., d:width]), dim=1)
            b = torch.cat((prev[..., width: width + d], cur[..., width + d:]), dim=1)
        weights = torch.softmax(b, dim=1)
        pooled = (weights * a).sum(dim=1)
        acc = cur.dtype
        u = self.norm(pooled, acc_dtype=acc, out_dtype=acc)
        u = rotary.rotate(u, positions, acc)
        if simulate_quant:
            if self.for_indexer:
                u = indexer_quant_sim(u)
            else:
                u = torch.cat((fp8_block_sim(u[:, : d - self.rope_dim]), u[:, d - self.rope_dim:]),
                              dim=-1)
        return u.to(out_dtype)
