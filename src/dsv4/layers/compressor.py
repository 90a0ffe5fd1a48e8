"""The KV compressor: gated softmax pooling of r tokens into one compressed entry.

Per token p the projection gives [a_p | s_p] (fp32); b_p = s_p + ape[p mod r] is recorded once.
Entry j (complete at p = j*r + r - 1) is a per-channel softmax over its candidate tokens of b,
weighting a; ratio 4 overlaps (coff = 2: the previous block uses channels [0, d), the current block
channels [d, 2d); entry 0 has no previous block), ratio 128 does not. Then RMSNorm, RoPE at j*r and
the official quantisation simulation (docs/spec.md §5.6).
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4.config import DSV4Config
from dsv4.layers.linear import MergedLinear
from dsv4.layers.norm import RMSNorm
from dsv4.layers.quant_sim import fp8_block_sim, index_numerics_sim
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

    def compress_jobs(self, ring: torch.Tensor, rows: torch.Tensor, ring_src: torch.Tensor,
                      call_src: torch.Tensor, entries: torch.Tensor, rotary: RotaryEmbedding,
                      out_dtype: torch.dtype, simulate_quant: bool, index_numerics: str
                      ) -> torch.Tensor:
        """Entries ``entries`` [E] of several sequences at once [E, dim]. Source position i of
        entry e (its ``coff * ratio`` raw rows, oldest first) is ring row ``ring_src[e, i]`` of
        ``ring.view(-1, raw_width)`` or this call's row ``rows[call_src[e, i]]``; where both are
        -1 the position does not exist (entry 0's previous block): a = 0 and score -inf, so
        its candidates get weight 0 (masked, not zero-weighted)."""
        r, width = self.ratio, self.raw_width
        from_ring = ring.view(-1, width)[ring_src.clamp(min=0)]
        from_call = rows[call_src.clamp(min=0)].to(from_ring.dtype)
        src = torch.where((call_src >= 0)[..., None], from_call, from_ring)
        missing = ((ring_src < 0) & (call_src < 0))[..., None]
        src = torch.where(missing, self._no_previous_block(src), src)
        cur = src[:, -r:]
        prev = src[:, :r] if self.coff == 2 else None
        return self._pool(cur, prev, entries * r, rotary, out_dtype, simulate_quant,
                          index_numerics)

    def _no_previous_block(self, raw: torch.Tensor) -> torch.Tensor:
        """The stand-in row [1, 1, raw_width] for entry 0's missing previous block: a = 0 and
        score -inf, so its candidates get weight 0."""
        width = self.coff * self.dim
        pad = torch.zeros(1, 1, 2 * width, dtype=raw.dtype, device=raw.device)
        pad[..., width:] = float("-inf")
        return pad

    def _pool(self, cur: torch.Tensor, prev: torch.Tensor | None, positions: torch.Tensor,
              rotary: RotaryEmbedding, out_dtype: torch.dtype, simulate_quant: bool,
              index_numerics: str) -> torch.Tensor:
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
                u = index_numerics_sim(u, index_numerics)
            else:
                u = torch.cat((fp8_block_sim(u[:, : d - self.rope_dim]), u[:, d - self.rope_dim:]),
                              dim=-1)
        return u.to(out_dtype)
