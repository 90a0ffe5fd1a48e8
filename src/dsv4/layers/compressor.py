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

    def write_raw_rows(self, kv_score: torch.Tensor, start: int, raw: torch.Tensor) -> None:
        """Record [a_p | s_p + ape[p mod r]] for positions start .. start + T - 1.

        ``kv_score`` may be a row-strided view (the fused GEMM's split); it is read, never kept.
        """
        t = kv_score.shape[0]
        width = self.coff * self.dim
        pos = torch.arange(start, start + t, device=kv_score.device)
        rows = raw[start:start + t]
        rows[:, :width] = kv_score[:, :width]
        rows[:, width:] = kv_score[:, width:] + self.ape.to(raw.dtype)[pos % self.ratio]

    def write_raw_rows_at(self, kv_score: torch.Tensor, slots: torch.Tensor,
                          positions: torch.Tensor, raw_pool: torch.Tensor) -> None:
        """As :meth:`write_raw_rows` for one token per slot of a pool: row b goes to
        ``raw_pool[slots[b], positions[b]]`` (same arithmetic, one indexed write)."""
        width = self.coff * self.dim
        ape = self.ape.to(raw_pool.dtype)[positions % self.ratio]
        raw_pool[slots, positions] = torch.cat(
            (kv_score[:, :width].to(raw_pool.dtype), kv_score[:, width:] + ape), dim=-1)

    def compress(self, raw: torch.Tensor, j0: int, j1: int, rotary: RotaryEmbedding,
                 out_dtype: torch.dtype, simulate_quant: bool) -> torch.Tensor:
        """Entries j0 .. j1 - 1 from the raw rows (which must hold every position they need)."""
        r = self.ratio
        n = j1 - j0
        width = 2 * self.coff * self.dim
        cur = raw[j0 * r: j1 * r].view(n, r, width)
        prev = None
        if self.coff == 2:
            if j0 == 0:
                # entry 0 has no previous block: its candidates are masked, not zero-weighted
                prev = torch.cat((self._no_previous_block(raw).expand(1, r, width),
                                  raw[: (j1 - 1) * r].view(n - 1, r, width)))
            else:
                prev = raw[(j0 - 1) * r: (j1 - 1) * r].view(n, r, width)
        positions = torch.arange(j0, j1, device=raw.device) * r
        return self._pool(cur, prev, positions, rotary, out_dtype, simulate_quant)

    def compress_at(self, raw_pool: torch.Tensor, slots: torch.Tensor, entries: torch.Tensor,
                    rotary: RotaryEmbedding, out_dtype: torch.dtype, simulate_quant: bool
                    ) -> torch.Tensor:
        """Entry ``entries[b]`` of pool slot ``slots[b]``, one per row [K, dim]: what
        :meth:`compress` gives for that entry of that slot's raw rows (``raw_pool`` [S, L, ...])."""
        r = self.ratio
        rows = entries[:, None] * r + torch.arange(r, device=raw_pool.device)  # [K, r]
        cur = raw_pool[slots[:, None], rows]
        prev = None
        if self.coff == 2:
            prev = raw_pool[slots[:, None], (rows - r).clamp(min=0)]
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
