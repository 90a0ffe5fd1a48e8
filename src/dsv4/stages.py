"""The stages of one attention step and the override points inside them.

A step of :class:`dsv4.attention.DeepseekV4Attention` is six stages, called in this order
(docs/spec.md §8.3):

1. ``_run_parallel_input_projections(x)``: the four GEMMs that read x (:class:`InputProjections`);
2. ``_query_and_kv_rows(qr_kv, step)``: the latent norms, the query heads, the window's kv rows
   and, where the C4 indexer decides, its query (:class:`QueryAndRows`);
3. ``_write_cache(step, kv, kv_score, idx_kv_score)``: the kv rows and every compressed entry
   the step completes into the paged stores; returns the raw rows the rings keep;
4. ``_select(step, index_query, idx_weights)``: what each query attends to
   (:class:`Selection`): its window rows and its compressed entries (the indexer's top-k, or
   every visible entry);
5. ``_attend_and_project(q, step, selection)``: sparse MQA with the sink, then the output path;
6. ``_keep_rings(step, raw)``: the compressors' rings keep this step's raw rows (last, so that a
   failure before leaves every cache as it was).

Each stage's default implementation calls the fine override points listed for it in
:data:`STAGES`. A platform overrides a fine point (the seeds' ROCm path overrides
``_fused_wqa_wkv_gemm``: docs/upstream.md A) or a whole stage, where it fuses the launches of
several points into one. A stage override answers for the fine points it replaces: a subclass
that overrides a fine point must also be the one whose stage calls it (the contract checker,
:mod:`dsv4.testing.contract`, reports a fine point whose stage was replaced above it). Nothing
is passed between stages except their return values.

The step has one branch point, stage 2, with two branches: it may leave the query heads and
the indexer's query computing on side streams (:attr:`QueryAndRows.heads_ready`,
:attr:`QueryAndRows.index_query_ready`). The stages between do not read them and run beside
that work; the step makes its stream wait for each before the first stage that reads it (the
indexer's query before stage 4, the heads before stage 5).

Above the stages, one call-level point: ``_run_pool(x, pool, caches, counts)`` runs a plain
call's tokens of one pool as steps (eagerly, by default); a platform may run the same steps
another way (the ``cuda`` platform replays decode steps as CUDA graphs).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class InputProjections(NamedTuple):
    """What the input stage returns: absent projections (by layer type) are None."""

    qr_kv: torch.Tensor
    """[T, q_lora_rank + head_dim] in the layer dtype: ``x @ [wq_a | wkv]^T``."""
    kv_score: torch.Tensor | None
    """[T, 2 * coff * head_dim] fp32 (acc dtype): the main compressor's ``[kv | score]``."""
    idx_kv_score: torch.Tensor | None
    """[T, 2 * coff * index_head_dim] fp32: the indexer compressor's ``[kv | score]`` (C4)."""
    idx_weights: torch.Tensor | None
    """[T, index_n_heads] in the layer dtype: the indexer's head weights, unscaled (C4)."""


class QueryAndRows(NamedTuple):
    """What stage 2 returns."""

    heads: torch.Tensor
    """[T, heads, head_dim] in the layer dtype: the query heads (stage 5 reads them)."""
    rows: torch.Tensor
    """[T, head_dim]: the window rows this step stores (stage 3)."""
    index_query: torch.Tensor | None = None
    """[T, index_n_heads, index_head_dim]: the C4 indexer's query where it decides this step
    (stage 4 reads it); None otherwise (SWA and C128 layers, steps where every query takes all
    its visible entries)."""
    heads_ready: torch.cuda.Event | None = None
    """None where ``heads`` are complete in the step's stream order; else the event a side
    stream recorded after the heads' launches (the step waits for it before stage 5)."""
    index_query_ready: torch.cuda.Event | None = None
    """As ``heads_ready``, for ``index_query`` (the step waits for it before stage 4)."""


class Selection(NamedTuple):
    """What each query of a step attends to, as flat rows of the step's paged stores (int64, or
    int32 where the platform's attention reads int32; -1 pads)."""

    window_rows: torch.Tensor
    """[T, window] rows of the ``kv`` store: positions ``pos - window + 1 .. pos`` of the
    query's sequence, oldest first; -1 before position 0 or where a block is released."""
    entries: torch.Tensor | None
    """[T, k] int64 compressed entry indices, -1 pads; None for SWA-only layers."""
    entry_rows: torch.Tensor | None
    """[T, k] rows of the ``compressed`` store for ``entries`` (-1 pads stay -1)."""


STAGES: dict[str, tuple[str, ...]] = {
    "_run_parallel_input_projections": (
        "_fused_wqa_wkv_gemm", "_compressor_kv_score_gemm", "_indexer_kv_score_gemm",
        "_indexer_weights_gemm", "_fused_compressor_score_gemm",
        "_fused_input_projections_gemm"),
    "_query_and_kv_rows": ("_latent_norms", "_wq_b_gemm", "_query_heads", "_kv_rows",
                           "_indexer_wq_b_gemm", "_indexer_query"),
    "_write_cache": ("_store_rows", "_raw_rows", "_compress_entries"),
    "_select": ("_window_rows", "_indexer_select", "_visible_entries", "_entry_rows"),
    "_attend_and_project": ("forward_mqa", "_o_proj"),
    "_keep_rings": ("_keep_ring_rows",),
}
"""Each stage and the fine override points its default implementation calls, in step order."""

FINE_POINTS: tuple[str, ...] = tuple(p for points in STAGES.values() for p in points)

STAGE_OF: dict[str, str] = {p: stage for stage, points in STAGES.items() for p in points}
"""The stage that calls each fine point."""

CALL_POINTS: tuple[str, ...] = ("_run_pool",)
"""How a plain call's steps run (above the stages)."""

OVERRIDE_POINTS: tuple[str, ...] = (*CALL_POINTS, *STAGES, *FINE_POINTS)
"""Every name a platform may override: the call level, the stages, then the fine points."""
