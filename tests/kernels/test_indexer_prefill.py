"""The indexer's prefill selection (``dsv4.kernels.indexer_prefill``: tiled scoring, then the
decode module's top-k) against the torch path (``Indexer.select_paged``) and a float64
evaluation: every index key format, steps of one and of several sequences (from position 0 and
after cached history: chunked prefill), widths that are not multiples of the tiles, fewer visible
entries than k, exact ties, a workspace that forces several chunks. Small shapes (the tiny
preset, small tiles) under Triton's CPU interpreter (TRITON_INTERPRET=1) or on a GPU; Flash
shapes at a few thousand tokens on a GPU only.

The step helpers come from test_indexer_topk (keys written through the cache's own formats).
The interpreter's top-k program takes ~70 ms a query: the cases keep to ~100 queries each.
"""

from __future__ import annotations

import pytest
import torch
from test_indexer_topk import (
    BF16,
    DEV,
    FORMATS,
    assert_matches_torch_path,
    assert_scores_match,
    assert_valid_selection,
    flash_ties_cfg,
    indexer,
    integer_keys,
    make_step,
    queries,
    scores_f64,
    tiny_cfg,
    torch_path,
)

from dsv4 import DSV4Config
from dsv4.cache.step import CacheStep
from dsv4.kernels.indexer_prefill import (
    _chunks,
    indexer_topk_prefill,
    prefill_kernel_problem,
    prefill_scores,
    prefill_tiles,
    select_prefill,
    step_runs,
)
from dsv4.kernels.indexer_topk import index_kernel_format

from conftest import kernel_runs, needs_gpu

SMALL = {"block_q": 16, "block_n": 16}
"""Tiles small enough that the interpreter's small steps span several of each."""


def run_prefill(cfg: DSV4Config, step: CacheStep, q: torch.Tensor, w: torch.Tensor, *,
                workspace_bytes: int = 256 << 20, **tiling: int) -> torch.Tensor:
    got = select_prefill(step, q, w, indexer(cfg), workspace_bytes, **tiling)
    assert got.dtype == torch.long and got.shape == (step.num_tokens, cfg.index_topk)
    return got


def check_against_torch(cfg: DSV4Config, step: CacheStep, q: torch.Tensor, w: torch.Tensor,
                        **kw: int) -> torch.Tensor:
    got = run_prefill(cfg, step, q, w, **kw)
    s64, tol = scores_f64(cfg, step, q, w, step.max_visible(4))
    assert_matches_torch_path(got, torch_path(cfg, step, q, w), s64, tol, cfg.index_topk)
    return got


# ---------------------------------------------------------------------------- host side


def test_tile_table_from_the_steps_runs():
    cfg = tiny_cfg(8)
    step = make_step(cfg, "bf16", [0, 30, 5], [40, 3, 17], device="cpu")
    slots = [c.slot for c in step.caches]
    runs = step_runs(step)
    assert runs == [(0, 40, slots[0]), (40, 3, slots[1]), (43, 17, slots[2])]
    tiles = prefill_tiles(runs, 16)
    assert tiles.dtype == torch.int32
    assert tiles.tolist() == [[0, 16, slots[0]], [16, 16, slots[0]], [32, 8, slots[0]],
                              [40, 3, slots[1]], [43, 16, slots[2]], [59, 1, slots[2]]]
    assert torch.equal(prefill_tiles(tiles, 16), tiles)  # already cut: the same table
    # chunks of whole tiles, at least one each
    assert _chunks(tiles, 32) == [(0, 2, 0, 32), (2, 6, 32, 28)]
    assert _chunks(tiles, 1) == [(i, i + 1, int(tiles[i, 0]), int(tiles[i, 1]))
                                 for i in range(6)]
    with pytest.raises(ValueError, match="in order"):
        prefill_tiles([(0, 4, 1), (5, 3, 2)], 16)


def test_kernel_problem_names_the_reason():
    from dsv4.cache.formats import index_format
    from dsv4.kernels.fused_input_proj import _INTERPRET, triton_available

    q = torch.zeros(3, 8, 128, dtype=BF16, device=DEV)
    fp8 = index_format("fp8", 128, BF16)
    usable = triton_available() and (DEV == "cuda" or _INTERPRET)
    assert (prefill_kernel_problem(q, fp8) == "") == usable
    if usable:
        assert "bf16" in prefill_kernel_problem(q.float(), fp8)
        assert prefill_kernel_problem(q, index_format("auto", 128, torch.float32))
        assert "head_dim" in prefill_kernel_problem(q[..., :64], fp8)


# ---------------------------------------------------------------------------- small shapes


CASES = {  # lengths before the step, tokens per sequence, index_topk, rows per block
    # sequences from 0 and after history (chunked prefill), width 37 (not a tile multiple),
    # topk above the visible entries of the early queries
    "several": ([0, 45, 130, 0], [24, 13, 19, 5], 16, 16),
}


@kernel_runs
@pytest.mark.parametrize("fmt", FORMATS)
def test_several_sequences_match_the_torch_path(fmt):
    lengths, counts, topk, block = CASES["several"]
    cfg = tiny_cfg(topk, max(lengths) + max(counts) + 8)
    step = make_step(cfg, fmt, lengths, counts, block_size=block, seed=3)
    q, w = queries(cfg, step.num_tokens, seed=4)
    assert step.max_visible(4) % 16
    check_against_torch(cfg, step, q, w, **SMALL)


@kernel_runs
@pytest.mark.parametrize(("fmt", "length", "count", "tiling"), [
    ("bf16", 0, 50, {}),  # the default tiles (64 x 128): a partial query tile, one entry tile
    ("fp8", 201, 30, SMALL),  # a chunk of one sequence after history
    ("fp4", 3, 50, {"block_q": 32, "block_n": 16}),
])
def test_one_sequence_matches_the_torch_path(fmt, length, count, tiling):
    cfg = tiny_cfg(8, length + count + 8)
    step = make_step(cfg, fmt, [length], [count], block_size=16, seed=length)
    q, w = queries(cfg, step.num_tokens, seed=5)
    check_against_torch(cfg, step, q, w, **tiling)


@kernel_runs
@pytest.mark.parametrize("fmt", FORMATS)
def test_scores_match_float64_and_mask_the_invisible(fmt):
    cfg = tiny_cfg(8)
    step = make_step(cfg, fmt, [90, 0, 33], [21, 37, 12], seed=1)
    q, w = queries(cfg, step.num_tokens, seed=6)
    width = step.max_visible(4) + 21  # an upper bound beyond every query's entries
    store = step.pool.stores["idx_keys"]
    s = prefill_scores(q, w, store.data, index_kernel_format(store.fmt), store.block_size,
                       store.table_dev, step.pos, width, cfg.index_weight_scale,
                       step_runs(step), **SMALL)
    want, tol = scores_f64(cfg, step, q, w, width)
    assert want.shape == (step.num_tokens, width)
    assert_scores_match(s, want, tol)
    assert (s[torch.isinf(s)] < 0).all()
    fin = torch.isfinite(want)
    # relative to each row's magnitude too (~1e-5)
    scale = want.masked_fill(~fin, 0).abs().amax(dim=1, keepdim=True).clamp(min=1e-30)
    assert (((s.double() - want).abs() / scale)[fin] <= 1e-5).all()


@kernel_runs
@pytest.mark.parametrize("fmt", FORMATS)
def test_exact_ties_go_to_the_lower_entry_index(fmt):
    cfg = tiny_cfg(8)
    step = make_step(cfg, fmt, [150, 0], [9, 12], seed=2)
    integer_keys(step, distinct=3, seed=7)
    g = torch.Generator().manual_seed(8)
    q = torch.randint(-2, 3, (step.num_tokens, 8, 128), generator=g).to(DEV, BF16)
    w = torch.randint(-3, 4, (step.num_tokens, 8), generator=g).to(DEV, BF16)
    assert torch.equal(run_prefill(cfg, step, q, w, **SMALL), torch_path(cfg, step, q, w))
    # zero queries: every score is 0 (+0 or -0), the lowest visible entries in index order
    zero = run_prefill(cfg, step, torch.zeros_like(q), w, **SMALL)
    vis = ((step.pos.cpu() + 1) // 4).clamp(max=8)
    ramp = torch.arange(8)
    want = torch.where(ramp[None, :] < vis[:, None], ramp[None, :], -1)
    assert torch.equal(zero.cpu(), want)
    assert torch.equal(zero, torch_path(cfg, step, torch.zeros_like(q), w))


@kernel_runs
def test_a_small_workspace_forces_chunks_with_the_same_result():
    cfg = tiny_cfg(8)
    step = make_step(cfg, "fp8", [120, 0], [19, 18], seed=5)
    q, w = queries(cfg, step.num_tokens, seed=6)
    whole = run_prefill(cfg, step, q, w, **SMALL)
    # one query tile (16 rows) a chunk: 4 chunks, two of them a run's tail tile (3, 2 rows)
    width = step.max_visible(4)
    tiny_ws = run_prefill(cfg, step, q, w, workspace_bytes=4 * width, **SMALL)
    assert torch.equal(whole, tiny_ws)


@kernel_runs
def test_unsorted_is_ascending_entry_order():
    cfg = tiny_cfg(8)
    step = make_step(cfg, "bf16", [60], [17], seed=9)
    q, w = queries(cfg, step.num_tokens, seed=10)
    store = step.pool.stores["idx_keys"]
    args = (q, w, store.data, "bf16", store.block_size, store.table_dev, step.pos,
            step.max_visible(4), 8, cfg.index_weight_scale, step_runs(step))
    got = indexer_topk_prefill(*args, **SMALL)
    unsorted = indexer_topk_prefill(*args, sort=False, **SMALL)
    n = (got >= 0).sum(dim=1)
    for t in range(got.shape[0]):
        assert torch.equal(unsorted[t, :n[t]], got[t, :n[t]].sort().values)
        assert (unsorted[t, n[t]:] == -1).all()


# ---------------------------------------------------------------------------- GPU: full shapes


@needs_gpu
@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS)
def test_flash_shapes(fmt):
    """64 heads x 128, topk 512: a prefill from 0 and two chunked prefills after history, some
    thousands of queries. The kernel's MMA sums in another order than cuBLAS: selections are
    the torch path's sets, up to swaps of scores within rounding of each other (checked against
    float64 with a tolerance), in score order within that tolerance."""
    cfg = DSV4Config.preset("flash")
    step = make_step(cfg, fmt, [0, 6001, 2500], [3000, 1200, 333], block_size=64, seed=1,
                     device="cuda")
    q, w = queries(cfg, step.num_tokens, seed=2, device="cuda")
    got = select_prefill(step, q, w, indexer(cfg), 256 << 20)
    want = torch_path(cfg, step, q, w)
    s64, tol = scores_f64(cfg, step, q, w, step.max_visible(4))
    assert_valid_selection(got, s64, tol, cfg.index_topk)
    same = (got.sort(dim=1).values == want.sort(dim=1).values).all(dim=1)
    assert int(same.sum()) >= got.shape[0] * 99 // 100
    # a workspace of a few query tiles: the same selection
    assert torch.equal(select_prefill(step, q, w, indexer(cfg), 3 * 64 * 4 * 4096), got)


@needs_gpu
@pytest.mark.cuda
def test_ties_at_flash_shapes():
    cfg = flash_ties_cfg()  # 32 index heads: integer scores stay exact in any summation order
    step = make_step(cfg, "fp4", [4000, 0], [300, 2500], block_size=64, seed=7, device="cuda")
    integer_keys(step, distinct=5, seed=8)
    g = torch.Generator().manual_seed(9)
    q = torch.randint(-2, 3, (step.num_tokens, 32, 128), generator=g).to("cuda", BF16)
    w = torch.randint(-3, 4, (step.num_tokens, 32), generator=g).to("cuda", BF16)
    assert torch.equal(select_prefill(step, q, w, indexer(cfg)), torch_path(cfg, step, q, w))
    zero = torch.zeros_like(q)
    assert torch.equal(select_prefill(step, zero, w, indexer(cfg)),
                       torch_path(cfg, step, zero, w))
