"""The lightning indexer of ratio-4 layers: scores compressed entries, picks the top-k per query.

q_I comes from the normalised q latent (``indexer.wq_b``), head weights from x
(``indexer.weights_proj``, scaled by index_head_dim^-1/2 * index_n_heads^-1/2), keys from the
indexer's own ratio-4 compressor. score[t, j] = sum_h w[t, h] * relu(<q_I[t, h], K[j]>) over the
visible entries j < (p + 1) // 4 (docs/spec.md §5.7).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from dsv4.config import DSV4Config
from dsv4.layers.compressor import Compressor
from dsv4.layers.linear import Linear
from dsv4.layers.quant_sim import index_numerics_sim
from dsv4.layers.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from dsv4.cache.step import CacheStep


class Indexer(nn.Module):
    def __init__(self, cfg: DSV4Config, *, dtype: torch.dtype, f32_dtype: torch.dtype,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.n_heads = cfg.index_n_heads
        self.head_dim = cfg.index_head_dim
        self.topk = cfg.index_topk
        self.weight_scale = cfg.index_weight_scale
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, fp8=cfg.fp8_weights,
                           dtype=dtype, device=device)
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads, fp8=False, dtype=dtype,
                                   device=device)
        self.compressor = Compressor(cfg, dim=self.head_dim, ratio=4, for_indexer=True,
                                     dtype=dtype, f32_dtype=f32_dtype, device=device)

    def has_choice(self, visible: int) -> bool:
        """Whether a query seeing ``visible`` compressed entries gets a selection that depends
        on the scores: more than ``topk`` of them (else it takes them all)."""
        return visible > self.topk

    def rotate_query(self, q: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                     acc_dtype: torch.dtype, numerics: str | None) -> torch.Tensor:
        """q_I [T, n_heads, head_dim] from the projected latent ``q`` [T, n_heads * head_dim] (the
        layer computes ``wq_b`` of the normalised latent through its ``_indexer_wq_b_gemm``
        override point): RoPE, then the indexer numerics' simulation (``hadamard_fp4``: the
        official Hadamard + FP4; ``fp8``: the engines' fp8 with a power-of-two scale per vector;
        None: none)."""
        q = q.unflatten(-1, (self.n_heads, self.head_dim))
        q = rotary.rotate(q, positions, acc_dtype)
        return index_numerics_sim(q, numerics)

    def select(self, q: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor,
               positions: torch.Tensor, acc_dtype: torch.dtype) -> torch.Tensor:
        """Top-k entry indices [T, index_topk] per query, padded with -1.

        ``head_weights`` is the raw ``weights_proj`` output [T, n_heads]; ``keys`` holds every
        entry that exists after this chunk [n, head_dim], or each query's own sequence's entries
        [T, n, head_dim] (a pooled decode batch); entry j is visible to position p iff
        j < (p + 1) // 4, and a query takes min(index_topk, visible) entries.
        """
        t = q.shape[0]
        out = torch.full((t, self.topk), -1, dtype=torch.long, device=q.device)
        n = keys.shape[-2]
        if n == 0:
            return out
        w = head_weights.to(acc_dtype) * self.weight_scale
        pattern = "thd,nd->thn" if keys.dim() == 2 else "thd,tnd->thn"
        logits = torch.einsum(pattern, q.to(acc_dtype), keys.to(acc_dtype)).relu_()
        scores = torch.einsum("thn,th->tn", logits, w)
        del logits  # the top-k's scratch reuses it
        visible = (positions + 1) // 4
        invisible = torch.arange(n, device=q.device)[None, :] >= visible[:, None]
        scores = scores.masked_fill(invisible, float("-inf"))
        k = min(self.topk, n)
        values, idx = stable_topk(scores, k)
        out[:, :k] = idx.masked_fill(values == float("-inf"), -1)
        return out

    def select_paged(self, step: CacheStep, q: torch.Tensor, head_weights: torch.Tensor,
                     acc_dtype: torch.dtype, workspace_bytes: int) -> torch.Tensor:
        """:meth:`select` for every query of a cache step, keys read from the step's paged
        ``idx_keys`` store, in chunks of queries sized from ``workspace_bytes`` (never a full
        queries x entries score matrix). A chunk of one sequence's queries reads its keys
        once; a chunk spanning sequences reads each query's own sequence's keys."""
        store = step.pool.stores["idx_keys"]
        t = step.num_tokens
        n_all = step.max_visible(4)
        item = torch.finfo(acc_dtype).bits // 8
        # per query: its logits for every head and entry, its scores and top-k scratch; keys
        # are read once per chunk of one sequence, once per query in a chunk spanning several
        own_keys = self.head_dim if step.single_sequence(0, t) is None else 0
        per_query = max(1, n_all) * (self.n_heads + own_keys + 4) * item
        chunk = max(1, min(t, workspace_bytes // per_query))
        out = []
        for a in range(0, t, chunk):
            b = min(t, a + chunk)
            n = step.max_visible(4, a, b)
            ents = torch.arange(n, device=q.device)[None, :]
            if step.single_sequence(a, b) is not None:
                keys = store.read(store.flat_rows(step.tok_slot[a:a + 1, None], ents),
                                  acc_dtype)[0]
            else:
                keys = store.read(store.flat_rows(step.tok_slot[a:b, None], ents), acc_dtype)
            out.append(self.select(q[a:b], head_weights[a:b], keys, step.pos[a:b], acc_dtype))
        return out[0] if len(out) == 1 else torch.cat(out)


SORT_BELOW = 4096
"""Rows of fewer entries are simply sorted (one op; faster than the selection's ~15 small ops
at decode sizes, and the same result)."""


def stable_topk(scores: torch.Tensor, k: int, sort_below: int = SORT_BELOW
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``k`` of a stable descending sort of each row of ``scores`` [t, n] (values,
    indices), without sorting all n: exact ties (common: relu zeroes every head) go to the
    lower entry index, so prefill, chunked prefill and decode select the same set in the same
    order. ``torch.topk`` finds the k-th largest value v; every entry above v is taken and, of
    those equal to v, the lowest-indexed ones that complete k; a stable sort of those k gives
    the order. Rows of fewer than ``sort_below`` entries are sorted whole."""
    t, n = scores.shape
    if k >= n or n < sort_below:  # every entry, or few: the sort itself
        values, idx = scores.sort(dim=-1, descending=True, stable=True)
        return values[:, :k], idx[:, :k]
    if k == 0:
        return scores[:, :0], torch.zeros_like(scores[:, :0], dtype=torch.long)
    kth = scores.topk(k, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)
    above = scores > kth
    tied = scores == kth
    room = k - above.sum(dim=-1, keepdim=True, dtype=torch.int32)
    take = above | (tied & (tied.cumsum(dim=-1, dtype=torch.int32) <= room))
    del above, tied
    # the k taken entries of each row, ascending: the j-th taken one goes to column j (the rest
    # to a spare column k); no host sync (nonzero() would wait for the device)
    slot = (take.cumsum(dim=-1) - 1).masked_fill_(~take, k)
    entries = torch.arange(n, device=scores.device).expand(t, n)
    idx = scores.new_empty((t, k + 1), dtype=torch.long).scatter_(1, slot, entries)[:, :k]
    values, order = scores.gather(1, idx).sort(dim=-1, descending=True, stable=True)
    return values, idx.gather(1, order)
