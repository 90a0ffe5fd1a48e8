"""Sparse multi-query attention with the attention sink (docs/spec.md §5.8), reading a
paged cache.

Every key is a latent row and the value is the same row (V = K). A query at position p sees the
window rows max(0, p - window + 1) .. p and the compressed rows named in its selection (-1 pads),
both given as flat rows of a paged store and read through the store's format. The sink adds
e^(sink_h - m) to the denominator only. Logits, softmax and accumulation run in ``acc_dtype``;
queries are processed in chunks sized from a workspace budget, so memory stays bounded on long
prefills (O(T x (window + k)) indices, a fixed workspace for the rows).
"""

from __future__ import annotations

import torch

from dsv4.cache.store import PagedStore


def sparse_mqa_paged(q: torch.Tensor, kv_store: PagedStore, win_rows: torch.Tensor,
                     cmp_store: PagedStore | None, cmp_rows: torch.Tensor | None,
                     sink: torch.Tensor, scale: float, acc_dtype: torch.dtype,
                     workspace_bytes: int) -> torch.Tensor:
    """o [T, heads, d] for queries ``q`` [T, heads, d]: ``win_rows`` [T, W] are flat rows of
    ``kv_store`` (-1: before position 0), ``cmp_rows`` [T, k] flat rows of ``cmp_store`` (-1
    pads) or None."""
    t, h, d = q.shape
    k = 0 if cmp_rows is None else cmp_rows.shape[1]
    n = win_rows.shape[1] + k
    per_query = (n * (d + 2 * h) + h * d) * torch.finfo(acc_dtype).bits // 8
    block = max(1, min(t, workspace_bytes // max(per_query, 1)))
    out = torch.empty_like(q)
    sink_f = sink.to(acc_dtype)
    for s in range(0, t, block):
        e = min(t, s + block)
        keys = kv_store.read(win_rows[s:e], acc_dtype)  # [t, W, d]
        valid = win_rows[s:e] >= 0
        if cmp_rows is not None and k:
            assert cmp_store is not None
            keys = torch.cat((keys, cmp_store.read(cmp_rows[s:e], acc_dtype)), dim=1)
            valid = torch.cat((valid, cmp_rows[s:e] >= 0), dim=1)
        out[s:e] = _attend(q[s:e], keys, valid, sink_f, scale, acc_dtype)
    return out


def _attend(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
            scale: float, acc_dtype: torch.dtype) -> torch.Tensor:
    """Softmax with the sink over each query's own rows ``keys`` [t, n, d] (V = K)."""
    logits = torch.einsum("thd,tnd->thn", q.to(acc_dtype), keys) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    m = torch.maximum(logits.amax(dim=-1), sink[None, :])  # the window is never empty
    probs = torch.exp(logits - m[..., None])
    denom = probs.sum(dim=-1) + torch.exp(sink[None, :] - m)
    o = torch.einsum("thn,tnd->thd", probs, keys)
    return (o / denom[..., None]).to(q.dtype)
