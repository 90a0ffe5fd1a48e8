"""The lightning indexer's selection of prefill-sized steps, tiled (docs/spec.md §5.7).

:mod:`dsv4.kernels.indexer_topk` loads each query once and re-reads the keys for every query:
right for decode (at most ``KERNEL_MAX_TOKENS`` queries), wasteful for prefill, where many
queries of one sequence see the same keys (a 64K-token prompt: 16K entries per query). Here the
queries of one sequence share the keys through tiles:

1. **Scores** (``_prefill_score_kernel``, program (entry tile, query tile)): a query tile is up to
   ``block_q`` consecutive rows of the step that all belong to ONE sequence (a host-built tile
   table of (start row, rows, slot), :func:`prefill_tiles`); an entry tile is ``block_n``
   consecutive entries of that sequence. The program reads its entry tile's keys once, as
   stored (bf16 / fp8 / fp4, through the sequence's block table, dequantised in registers by
   :func:`dsv4.kernels.indexer_topk._load_index_keys`), then for each head h:
   ``s = q_tile[:, h] @ K^T`` ([block_q, D] x [D, block_n], one MMA) and
   ``acc += (w[:, h] * weight_scale) * relu(s)`` in fp32. Entries a query cannot see
   (j >= (pos + 1) // 4) get -inf. A tile wholly invisible to every query of the query tile
   (its first entry >= (max pos of the tile + 1) // 4: causality) only writes -inf (no key
   reads, no MMAs). The fp32 scores go to a workspace [chunk rows, width].
2. **Top-k**: :func:`dsv4.kernels.indexer_topk.topk_entries` on the chunk's scores (radix
   select, the tie rule: of equal scores the lower entry index; the torch path's order).

The result is :meth:`dsv4.layers.indexer.Indexer.select_paged`'s (same entries, same order up to
fp32 summation order of scores within rounding of each other; exact ties stay exact ties).

Tile sizes (Hopper: H100 / H200), overridable per call for tuning:

* ``BLOCK_Q = 64`` queries: one warpgroup MMA's M (wgmma needs M = 64 per warpgroup).
* ``BLOCK_N = 64`` entries: the MMA's N. Per head a program reads its query tile's slice
  [64, 128] bf16 (16 KiB) for 2 * 64 * 64 * 128 = 1 MFLOP: 64 FLOP per query byte (the queries
  are re-read for every entry tile, from L2: the grid runs the entry tiles of a query tile next
  to each other), while the keys (16 KiB bf16) are read once for 64 heads.
* ``NUM_WARPS = 4``, ``NUM_STAGES = 3``: the head loop's query loads pipelined ahead of the
  MMAs. Chosen from an sm_90 compile on a machine without a GPU
  (``benchmarks/aot_sm90_regs.py steps``, Triton 3.6): 64 x 64 at 4 warps takes 127 registers
  a thread and no spill; 64 x 128 (at 4 or 8 warps, 1-3 stages) spilled 112-272 bytes a thread
  with bf16 and fp8 keys (the dequantised key tile and the accumulator live together); 128 x 64
  at 8 warps fits too (186-246 registers). Not timed on a GPU yet.

So a Flash / Pro program (64 heads x 128 dims) runs 64 MMAs of 64 x 64 x 128.

Numerics as in the decode kernel: on a GPU the MMA takes bf16 operands (dequantised keys are
exact in bf16) with fp32 accumulation (``input_precision="tf32"`` is moot for bf16); under the
CPU interpreter it runs on fp32 operands with ``"ieee"`` (its bf16 dot is wrong on this
install). ReLU, head weights and the sum over heads are fp32.

Expected cost (not measured yet), Flash, one 64K-token prompt from position 0 (16K entries,
8K visible to a query on average): 2 * 64 * 128 * 64K * 8K = 8.8 TFLOP of bf16 MMA (~12-15 ms
at 600-700 TFLOP/s; the per-head ReLU * weight epilogue adds ~1e11 fp32 operations on top);
queries 1 GiB from HBM, re-read per entry tile from L2 (~128 GiB at BLOCK_N = 64); keys
4 MiB bf16 (2 MiB fp8, 1 MiB fp4) re-read per query tile from L2 (~2 GiB); scores 4 GiB written
(half of them -inf) and ~10 GiB read back by the top-k's passes over the visible entries.

Memory: the score workspace is [rows, width] fp32 in chunks of whole query tiles whose scores fit
``workspace_bytes`` (at least one tile: 64 x 4 x width bytes). The only host work is the tile
table (from host data: ``step.tok_seq_host`` and the caches' slots) and its upload (pinned,
asynchronous); nothing reads a device tensor back. Prefill is not graph-captured, so the tile
table's host-to-device copy need not be capturable (it is asynchronous from pinned memory).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from dsv4.cache.formats import RowFormat
from dsv4.host_copy import upload
from dsv4.kernels.bound_launch import launch
from dsv4.kernels.indexer_topk import FMTS, check_key_store, index_kernel_format, topk_entries
from dsv4.kernels.launch import _INTERPRET, pdl_args, triton_available

if TYPE_CHECKING:
    from dsv4.cache.step import CacheStep
    from dsv4.layers.indexer import Indexer

__all__ = ["BLOCK_N", "BLOCK_Q", "NUM_STAGES", "NUM_WARPS", "indexer_topk_prefill",
           "prefill_kernel_problem", "prefill_scores", "prefill_tiles", "select_prefill",
           "step_runs"]

BLOCK_Q = 64
"""Queries per tile (the MMA's M)."""
BLOCK_N = 64
"""Entries per tile (the MMA's N)."""
NUM_WARPS = 4
NUM_STAGES = 3


def prefill_kernel_problem(q: torch.Tensor, key_format: RowFormat) -> str:
    """Host-side test, no sync: '' when :func:`indexer_topk_prefill` can select for queries
    ``q`` [T, H, D] over an ``idx_keys`` store of row format ``key_format``; else the reason."""
    if not triton_available():
        return "Triton is not installed"
    if not (q.device.type == "cuda" or _INTERPRET):
        return f"queries on {q.device.type}: the kernel needs a CUDA device (or TRITON_INTERPRET=1)"
    if q.dtype != torch.bfloat16:
        return f"queries are {q.dtype}: the kernel takes bf16 queries"
    if q.dim() != 3:
        return f"queries must be [T, heads, head_dim], got {tuple(q.shape)}"
    if not index_kernel_format(key_format):
        return f"index key format {type(key_format).__name__} (dim {key_format.dim}) unreadable"
    if q.shape[2] != key_format.dim:
        return f"query head_dim {q.shape[2]} != key dim {key_format.dim}"
    return ""


# ---------------------------------------------------------------------------- host: tile table


def step_runs(step: CacheStep) -> list[tuple[int, int, int]]:
    """(start row, rows, slot) of each run of consecutive tokens of one sequence in ``step``
    (host data only: ``tok_seq_host`` and the caches' slots)."""
    seq = step.tok_seq_host.numpy()
    t = int(seq.shape[0])
    if t == 0:
        return []
    cuts = (np.flatnonzero(np.diff(seq)) + 1).tolist()
    starts = [0, *cuts]
    ends = [*cuts, t]
    return [(a, b - a, int(step.caches[int(seq[a])].slot)) for a, b in zip(starts, ends,
                                                                          strict=True)]


def prefill_tiles(runs: Sequence[tuple[int, int, int]] | torch.Tensor, block_q: int = BLOCK_Q
                  ) -> torch.Tensor:
    """The tile table [tiles, 3] int32 (host) of (start row, rows, slot): each run (start row,
    rows, slot) of one sequence's consecutive rows cut into tiles of at most ``block_q`` rows.
    The runs must cover rows 0 .. T - 1 in order (a tile table already cut is returned as is)."""
    rs = runs.tolist() if isinstance(runs, torch.Tensor) else list(runs)
    out: list[tuple[int, int, int]] = []
    nxt = 0
    for start, rows, slot in rs:
        start, rows, slot = int(start), int(rows), int(slot)
        if start != nxt or rows <= 0:
            raise ValueError(f"runs must cover the rows in order without gaps: run {start, rows}"
                             f" after row {nxt}")
        out += [(a, min(block_q, start + rows - a), slot)
                for a in range(start, start + rows, block_q)]
        nxt = start + rows
    return torch.tensor(out, dtype=torch.int32).reshape(-1, 3)


def _chunks(tiles: torch.Tensor, cap_rows: int) -> list[tuple[int, int, int, int]]:
    """(first tile, end tile, first row, rows) of consecutive whole tiles of at most ``cap_rows``
    rows together (at least one tile each)."""
    rows = tiles[:, 1].tolist()
    starts = tiles[:, 0].tolist()
    out = []
    i, n = 0, len(rows)
    while i < n:
        total, j = rows[i], i + 1
        while j < n and total + rows[j] <= cap_rows:
            total += rows[j]
            j += 1
        out.append((i, j, starts[i], total))
        i = j
    return out


# ---------------------------------------------------------------------------- the kernel


if triton_available():
    import triton
    import triton.language as tl

    from dsv4.kernels.indexer_topk import _load_index_keys
    from dsv4.kernels.launch import let_next_kernel_launch, wait_for_prior_kernel

    @triton.jit(do_not_specialize=["width", "row0"])
    def _prefill_score_kernel(q_ptr, sqt, sqh, w_ptr, swt, swh, s_ptr, sst, keys_ptr,
                              blk_stride, tab_ptr, stab, max_logical, tiles_ptr, pos_ptr,
                              width, row0, B, weight_scale, H: tl.constexpr, D: tl.constexpr,
                              BQ: tl.constexpr, BN: tl.constexpr, FMT: tl.constexpr,
                              DT: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr = False):
        """Program (e, i): entries e * BN .. e * BN + BN - 1 of query tile i's sequence for the
        tile's rows; scores to the workspace's rows (tile start - row0) onwards."""
        wait_for_prior_kernel(PDL)
        jb = tl.program_id(0)
        ti = tl.program_id(1)
        start = tl.load(tiles_ptr + ti * 3)
        n_rows = tl.load(tiles_ptr + ti * 3 + 1)
        slot = tl.load(tiles_ptr + ti * 3 + 2).to(tl.int64)
        r = tl.arange(0, BQ)
        r_ok = r < n_rows
        rows = (start + r).to(tl.int64)
        p = tl.load(pos_ptr + rows, mask=r_ok, other=-1)
        vis = ((p + 1) // 4).to(tl.int32)  # 0 for rows beyond the tile
        vis_max = tl.max(vis, axis=0)
        j = jb * BN + tl.arange(0, BN)
        if jb * BN < vis_max:
            k = _load_index_keys(keys_ptr, tab_ptr, slot, stab, j, vis_max, max_logical,
                                 blk_stride, B, D, FMT, BN, DT)
            kt = tl.trans(k)  # [D, BN], read once for every head
            cols = tl.arange(0, D)
            q_rows = q_ptr + rows[:, None] * sqt + cols[None, :]
            w_rows = w_ptr + rows * swt
            acc = tl.zeros([BQ, BN], tl.float32)
            for h in range(0, H):
                qh = tl.load(q_rows + h * sqh, mask=r_ok[:, None], other=0.0).to(DT)
                wh = tl.load(w_rows + h * swh, mask=r_ok, other=0.0).to(tl.float32)
                s = tl.dot(qh, kt, input_precision=PREC)  # [BQ, BN] fp32
                acc += tl.maximum(s, 0.0) * (wh * weight_scale)[:, None]
            acc = tl.where(j[None, :] < vis[:, None], acc, float("-inf"))
        else:
            acc = tl.full([BQ, BN], float("-inf"), tl.float32)
        out = s_ptr + (rows - row0)[:, None] * sst + j[None, :]
        tl.store(out, acc, mask=r_ok[:, None] & (j < width)[None, :])
        let_next_kernel_launch(PDL)


def _check(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, fmt: str) -> None:
    if fmt not in FMTS:
        raise ValueError(f"fmt must be one of {FMTS}, got {fmt!r}")
    if not (triton_available() and (q.device.type == "cuda" or _INTERPRET)):
        raise RuntimeError("the prefill indexer kernel needs Triton and a CUDA device (or "
                           "TRITON_INTERPRET=1); use Indexer.select_paged elsewhere")
    if q.dim() != 3 or weights.shape != q.shape[:2]:
        raise ValueError(f"q must be [T, H, D] and weights [T, H], got {tuple(q.shape)} and "
                         f"{tuple(weights.shape)}")
    d = q.shape[2]
    if d < 16 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {d}")
    check_key_store(keys, fmt, d)


def _launch(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, fmt: str,
            rows_per_block: int, table: torch.Tensor, pos: torch.Tensor, width: int,
            weight_scale: float, tiles_dev: torch.Tensor, row0: int, out: torch.Tensor,
            block_q: int, block_n: int, num_warps: int, num_stages: int) -> None:
    """Scores of the tiles ``tiles_dev`` [n, 3] (rows row0 .. of the step) into ``out``."""
    n = tiles_dev.shape[0]
    if n == 0 or width == 0:
        return
    launch(_prefill_score_kernel, (triton.cdiv(width, block_n), n),
        q, q.stride(0), q.stride(1), weights, weights.stride(0), weights.stride(1), out,
        out.stride(0), keys, keys.stride(0), table, table.stride(0), table.shape[1], tiles_dev,
        pos, width, row0, rows_per_block, float(weight_scale),
        H=q.shape[1], D=q.shape[2], BQ=block_q, BN=block_n, FMT=FMTS.index(fmt),
        DT=tl.float32 if _INTERPRET else tl.bfloat16, PREC="ieee" if _INTERPRET else "tf32",
        num_warps=num_warps, num_stages=num_stages, **pdl_args(q.device))


def _prepare(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, fmt: str,
             block_table: torch.Tensor, runs: Sequence[tuple[int, int, int]] | torch.Tensor,
             block_q: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check(q, weights, keys, fmt)
    if block_q < 16 or block_q & (block_q - 1):
        raise ValueError(f"block_q must be a power of two >= 16, got {block_q}")
    if q.stride(2) != 1:
        q = q.contiguous()
    table = block_table if block_table.dtype == torch.int32 else block_table.int()
    tiles = prefill_tiles(runs, block_q)
    covered = int(tiles[-1, 0] + tiles[-1, 1]) if tiles.shape[0] else 0
    if covered != q.shape[0]:
        raise ValueError(f"the runs cover {covered} rows, the step has {q.shape[0]}")
    return q, table, tiles


def prefill_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, fmt: str,
                   rows_per_block: int, block_table: torch.Tensor, pos: torch.Tensor,
                   width: int, weight_scale: float,
                   runs: Sequence[tuple[int, int, int]] | torch.Tensor, *,
                   block_q: int = BLOCK_Q, block_n: int = BLOCK_N, num_warps: int = NUM_WARPS,
                   num_stages: int = NUM_STAGES) -> torch.Tensor:
    """Scores [T, width] fp32 (-inf where invisible) of every query in one launch (no chunking:
    for tests and tools; :func:`indexer_topk_prefill` bounds its workspace). Arguments as
    :func:`indexer_topk_prefill`'s."""
    q, table, tiles = _prepare(q, weights, keys, fmt, block_table, runs, block_q)
    s = torch.empty(q.shape[0], width, device=q.device, dtype=torch.float32)
    _launch(q, weights, keys, fmt, rows_per_block, table, pos, width, weight_scale,
            upload(tiles, q.device)[0], 0, s, block_q, block_n, num_warps, num_stages)
    return s


def indexer_topk_prefill(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, fmt: str,
                         rows_per_block: int, block_table: torch.Tensor, pos: torch.Tensor,
                         width: int, topk: int, weight_scale: float,
                         runs: Sequence[tuple[int, int, int]] | torch.Tensor, *,
                         workspace_bytes: int = 256 << 20, sort: bool = True,
                         block_q: int = BLOCK_Q, block_n: int = BLOCK_N,
                         num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES
                         ) -> torch.Tensor:
    """Top-k entries [T, topk] int64 (-1 pads) per query, the contract of
    :meth:`dsv4.layers.indexer.Indexer.select_paged`.

    ``q`` [T, H, D] bf16 (head dims contiguous), ``weights`` [T, H] (raw ``weights_proj``
    output; scaled by ``weight_scale`` in the kernel), ``keys`` the paged ``idx_keys`` store's
    data in format ``fmt`` ("bf16" / "fp8" / "fp4", :func:`dsv4.kernels.indexer_topk.
    index_kernel_format`), ``rows_per_block`` its block size, ``block_table`` [slots, logical
    blocks] (int32), ``pos`` [T] int64 positions (device), ``width`` a host bound on every
    query's visible entries (``step.max_visible(4)``), ``runs`` the host table (start row,
    rows, slot) of the step's runs of one sequence's consecutive rows, covering rows 0 .. T - 1
    in order (:func:`step_runs`; cut into query tiles of ``block_q`` rows here, so an already
    cut tile table works too). ``sort``: the torch path's order (score descending, ties by
    ascending index), else ascending entry index. ``block_q`` / ``block_n`` / ``num_warps`` /
    ``num_stages``: the tiling (module docstring), for tuning.

    Queries go in chunks of whole query tiles whose [rows, width] fp32 scores fit
    ``workspace_bytes`` (at least one tile); per chunk one scoring launch and one top-k launch.
    No host sync: the tile table is built from host data and uploaded asynchronously."""
    t = q.shape[0]
    out = torch.empty(t, topk, device=q.device, dtype=torch.long)
    if t == 0 or topk == 0:
        return out
    if width <= 0:
        return out.fill_(-1)
    q, table, tiles = _prepare(q, weights, keys, fmt, block_table, runs, block_q)
    chunks = _chunks(tiles, max(1, workspace_bytes // (4 * width)))
    tiles_dev = upload(tiles, q.device)[0]
    ws = torch.empty(max(c[3] for c in chunks), width, device=q.device, dtype=torch.float32)
    for i, j, row0, rows in chunks:
        s = ws[:rows]
        _launch(q, weights, keys, fmt, rows_per_block, table, pos, width, weight_scale,
                tiles_dev[i:j], row0, s, block_q, block_n, num_warps, num_stages)
        topk_entries(s, pos[row0:row0 + rows], topk, sort=sort, out=out[row0:row0 + rows])
    return out


def select_prefill(step: CacheStep, idx_q: torch.Tensor, idx_weights: torch.Tensor,
                   indexer: Indexer, workspace_bytes: int = 256 << 20, *,
                   block_q: int = BLOCK_Q, block_n: int = BLOCK_N, num_warps: int = NUM_WARPS,
                   num_stages: int = NUM_STAGES) -> torch.Tensor:
    """``indexer.select_paged(step, idx_q, idx_weights, ...)``'s result [T, indexer.topk] for a
    prefill-sized step through :func:`indexer_topk_prefill` (keys from the step's ``idx_keys``
    store; raises where :func:`prefill_kernel_problem` names a problem); the tiling arguments
    as :func:`indexer_topk_prefill`'s."""
    store = step.pool.stores["idx_keys"]
    problem = prefill_kernel_problem(idx_q, store.fmt)
    if problem:
        raise RuntimeError(f"select_prefill: {problem}")
    return indexer_topk_prefill(
        idx_q, idx_weights, store.data, index_kernel_format(store.fmt), store.block_size,
        store.table_dev, step.pos, step.max_visible(4), indexer.topk, indexer.weight_scale,
        step_runs(step), workspace_bytes=workspace_bytes, block_q=block_q, block_n=block_n,
        num_warps=num_warps, num_stages=num_stages)
