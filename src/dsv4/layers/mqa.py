"""Sparse multi-query attention with the attention sink (dsv4-attention.md §5.8).

Every key is a latent row and the value is the same row (V = K). A query at position p sees the
window rows max(0, p - window + 1) .. p and the compressed rows named in its selection (-1 pads).
The sink adds e^(sink_h - m) to the denominator only. Logits, softmax and accumulation run in
``acc_dtype``; queries are processed in blocks so memory stays bounded on long prefills.
:func:`sparse_mqa_batched` is the same for one query per sequence of a cache pool.
"""

from __future__ import annotations

import torch


def sparse_mqa_with_sink(q: torch.Tensor, positions: torch.Tensor, start: int,
                         kv_rows: torch.Tensor, window: int, compressed: torch.Tensor | None,
                         selection: torch.Tensor | None, sink: torch.Tensor, scale: float,
                         acc_dtype: torch.dtype, block_elems: int = 1 << 24) -> torch.Tensor:
    """o [T, heads, d] for queries ``q`` [T, heads, d] at ``positions`` = start .. start + T - 1.

    ``start`` is passed as a Python int so that no device value is read back (no host sync;
    CUDA-graph capturable). ``kv_rows[i]`` is the window row of position i (at least up to
    start + T - 1); ``selection`` [T, k] indexes ``compressed``.
    """
    t, h, d = q.shape
    out = torch.empty_like(q)
    k_sel = 0 if selection is None else selection.shape[1]
    per_query = h * (window + k_sel) + k_sel * d
    block = max(1, min(t, block_elems // max(per_query, 1)))
    sink_f = sink.to(acc_dtype)
    for s in range(0, t, block):
        e = min(t, s + block)
        out[s:e] = _attend_block(q[s:e], positions[s:e], start + s, kv_rows, window, compressed,
                                 None if selection is None else selection[s:e], sink_f, scale,
                                 acc_dtype)
    return out


def _attend_block(q: torch.Tensor, pos: torch.Tensor, p_first: int, kv_rows: torch.Tensor,
                  window: int, compressed: torch.Tensor | None, selection: torch.Tensor | None,
                  sink: torch.Tensor, scale: float, acc_dtype: torch.dtype) -> torch.Tensor:
    p_last = p_first + q.shape[0] - 1
    lo = max(0, p_first - window + 1)
    k_win = kv_rows[lo: p_last + 1].to(acc_dtype)
    qf = q.to(acc_dtype)
    logits_w = torch.einsum("thd,wd->thw", qf, k_win) * scale
    key_pos = torch.arange(lo, p_last + 1, device=q.device)
    visible_w = (key_pos[None, :] <= pos[:, None]) & (key_pos[None, :] > pos[:, None] - window)
    logits_w = logits_w.masked_fill(~visible_w[:, None, :], float("-inf"))
    parts = [logits_w]
    k_cmp = None
    if selection is not None and compressed is not None and selection.shape[1] > 0:
        k_cmp = compressed[selection.clamp(min=0)].to(acc_dtype)  # [t, k, d]
        logits_c = torch.einsum("thd,tkd->thk", qf, k_cmp) * scale
        logits_c = logits_c.masked_fill((selection < 0)[:, None, :], float("-inf"))
        parts.append(logits_c)
    logits = torch.cat(parts, dim=-1)
    m = torch.maximum(logits.amax(dim=-1), sink[None, :])  # the window is never empty
    probs = torch.exp(logits - m[..., None])
    denom = probs.sum(dim=-1) + torch.exp(sink[None, :] - m)
    n_w = k_win.shape[0]
    o = torch.einsum("thw,wd->thd", probs[..., :n_w], k_win)
    if k_cmp is not None:
        o = o + torch.einsum("thk,tkd->thd", probs[..., n_w:], k_cmp)
    return (o / denom[..., None]).to(q.dtype)


def sparse_mqa_batched(q: torch.Tensor, positions: torch.Tensor, kv_pool: torch.Tensor,
                       slots: torch.Tensor, window: int, compressed_pool: torch.Tensor | None,
                       selection: torch.Tensor | None, sink: torch.Tensor, scale: float,
                       acc_dtype: torch.dtype) -> torch.Tensor:
    """o [B, heads, d] for one query per sequence: ``q[b]`` at ``positions[b]`` attends to the
    window rows and the selected compressed rows of slot ``slots[b]`` of the pool tensors
    (``kv_pool`` [S, L, d], ``compressed_pool`` [S, n, d]); ``selection`` [B, k], -1 pads.
    Window rows before position 0 are masked, so every query sees exactly the rows
    :func:`sparse_mqa_with_sink` gives it."""
    rows = positions[:, None] - (window - 1) + torch.arange(window, device=q.device)  # [B, w]
    k_win = kv_pool[slots[:, None], rows.clamp(min=0)].to(acc_dtype)  # [B, w, d]
    qf = q.to(acc_dtype)
    logits = torch.einsum("bhd,bwd->bhw", qf, k_win) * scale
    logits = logits.masked_fill((rows < 0)[:, None, :], float("-inf"))
    k_cmp = None
    if selection is not None and compressed_pool is not None and selection.shape[1] > 0:
        k_cmp = compressed_pool[slots[:, None], selection.clamp(min=0)].to(acc_dtype)  # [B,k,d]
        logits_c = torch.einsum("bhd,bkd->bhk", qf, k_cmp) * scale
        logits_c = logits_c.masked_fill((selection < 0)[:, None, :], float("-inf"))
        logits = torch.cat((logits, logits_c), dim=-1)
    sink = sink.to(acc_dtype)
    m = torch.maximum(logits.amax(dim=-1), sink[None, :])  # the window is never empty
    probs = torch.exp(logits - m[..., None])
    denom = probs.sum(dim=-1) + torch.exp(sink[None, :] - m)
    o = torch.einsum("bhw,bwd->bhd", probs[..., :window], k_win)
    if k_cmp is not None:
        o = o + torch.einsum("bhk,bkd->bhd", probs[..., window:], k_cmp)
    return (o / denom[..., None]).to(q.dtype)
