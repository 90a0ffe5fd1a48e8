"""The indexer's decode selection kernels (``dsv4.kernels.indexer_topk``) against the torch path
(``Indexer.select_paged``) and a float64 evaluation: every index key format, several sequences of
one pool at different positions, multi-token steps, exact ties, rows with fewer visible entries
than k. Small shapes under Triton's CPU interpreter (TRITON_INTERPRET=1) or on a GPU; Flash / Pro
shapes, long contexts and CUDA-graph capture on a GPU only.

Keys are written through the cache's own formats (``fill_history`` / ``store.write``), so the
kernels read exactly the bytes the layer stores.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from dsv4 import DSV4Config
from dsv4.bench.synthetic_cache import fill_history
from dsv4.cache.pool import CachePool
from dsv4.cache.step import CacheStep
from dsv4.kernels.indexer_topk import (
    index_kernel_format,
    indexer_scores,
    indexer_topk,
    page_copies_apply,
    topk_entries,
)
from dsv4.layers.indexer import Indexer, stable_topk
from dsv4.layers.quant_sim import fp4_block_sim

from conftest import KERNEL_DEV, kernel_runs, needs_gpu

DEV = KERNEL_DEV
FORMATS = ("bf16", "fp8", "fp4")
BF16 = torch.bfloat16


def tiny_cfg(topk: int = 8, max_len: int = 4096) -> DSV4Config:
    return DSV4Config.preset("tiny").replace(index_topk=topk,
                                             max_position_embeddings=max(4096, max_len))


def make_step(cfg: DSV4Config, fmt: str, lengths: list[int], counts: list[int], *,
              block_size: int = 16, seed: int = 0, device: str = DEV) -> CacheStep:
    """A step of ``counts[i]`` tokens after ``lengths[i]`` positions of random history for each
    sequence of one pool (the entries the step completes written too, as the layer does before
    it selects). A sequence added and freed first scatters the others' blocks."""
    max_len = max(n + c for n, c in zip(lengths, counts, strict=True)) + 1
    pool = CachePool(cfg, cfg.layer_of_ratio(4), max_seqs=len(lengths) + 1, max_seq_len=max_len,
                     dtype=BF16, acc_dtype=torch.float32, device=device,
                     index_format_name=fmt, block_size=block_size)
    spacer = pool.add_sequence()
    fill_history([spacer], min(max_len - 1, 4 * 3 * block_size), seed=seed + 100)
    caches = [pool.add_sequence() for _ in lengths]
    spacer.free()
    for i, (c, n) in enumerate(zip(caches, lengths, strict=True)):
        if n:
            fill_history([c], n, seed=seed + i)
    step = CacheStep.plan(pool, caches, counts)
    job = step.jobs["idx_keys"]
    if job.count:
        g = torch.Generator(device=device).manual_seed(seed + 50)
        store = step.pool.stores["idx_keys"]
        store.write(store.flat_rows(job.slots, job.entries),
                    torch.randn(job.count, cfg.index_head_dim, generator=g, device=device).to(BF16))
    return step


def queries(cfg: DSV4Config, t: int, seed: int = 0, device: str = DEV
            ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(t, cfg.index_n_heads, cfg.index_head_dim, generator=g, device=device)
    w = torch.randn(t, cfg.index_n_heads, generator=g, device=device)
    return q.to(BF16), w.to(BF16)


def indexer(cfg: DSV4Config) -> Indexer:
    return Indexer(cfg, dtype=BF16, f32_dtype=torch.float32, device="meta")


def flash_ties_cfg() -> DSV4Config:
    """Flash with 32 index heads: index_weight_scale = (32 * 128)^-0.5 = 2^-6, so integer
    scores times the weights stay exact whatever order a kernel or cuBLAS sums the heads in
    (with 64 heads the scale is 2^-6.5 and the orders round apart: ties break differently)."""
    return dataclasses.replace(DSV4Config.preset("flash"), index_n_heads=32)


def run_kernels(cfg: DSV4Config, step: CacheStep, q: torch.Tensor, w: torch.Tensor, *,
                width: int | None = None, sort: bool = True,
                workspace_bytes: int = 256 << 20, split: int | None = None,
                group: int | None = None, tma: bool | None = None,
                fp8_queries: bool = False) -> torch.Tensor:
    store = step.pool.stores["idx_keys"]
    return indexer_topk(q, w, store.data, index_kernel_format(store.fmt), store.block_size,
                        store.table_dev, step.tok_slot, step.pos,
                        step.max_visible(4) if width is None else width, cfg.index_topk,
                        cfg.index_weight_scale, workspace_bytes=workspace_bytes, sort=sort,
                        split=split, group=group, tma=tma, fp8_queries=fp8_queries)


def torch_path(cfg: DSV4Config, step: CacheStep, q: torch.Tensor, w: torch.Tensor
               ) -> torch.Tensor:
    """``Indexer.select_paged`` in full fp32 (TF32 off: another test may have turned it on)."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return indexer(cfg).select_paged(step, q, w, torch.float32, 256 << 20)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def scores_f64(cfg: DSV4Config, step: CacheStep, q: torch.Tensor, w: torch.Tensor, width: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 scores [T, width], -inf where invisible; a bound on each row's rounding error)
    from the keys read back through the store's format."""
    store = step.pool.stores["idx_keys"]
    ents = torch.arange(width, device=q.device)
    out = torch.full((q.shape[0], width), float("-inf"), dtype=torch.float64, device=q.device)
    tol = torch.zeros(q.shape[0], dtype=torch.float64, device=q.device)
    for t in range(q.shape[0]):
        keys = store.read(store.flat_rows(step.tok_slot[t:t + 1], ents), torch.float64)
        qt, wt = q[t].double(), w[t].double() * cfg.index_weight_scale
        s = (qt @ keys.T).relu().T @ wt
        vis = int(step.pos_host[t] + 1) // 4
        out[t, :vis] = s[:vis]
        bound = (qt.abs() @ keys.abs().T).T @ wt.abs()
        tol[t] = 1e-5 * float(bound[:vis].max()) if vis else 0.0
    return out, tol


def assert_scores_match(s: torch.Tensor, want: torch.Tensor, tol: torch.Tensor) -> None:
    """Kernel scores ``s`` against the float64 ones of :func:`scores_f64`: fp32 of the same
    shape, -inf exactly where invisible, each finite score within its row's bound."""
    assert s.dtype == torch.float32 and s.shape == want.shape
    assert torch.equal(torch.isinf(s), torch.isinf(want))
    fin = torch.isfinite(want)
    assert ((s.double() - want).abs()[fin] <= tol[:, None].expand_as(want)[fin]).all()


def assert_valid_selection(got: torch.Tensor, scores: torch.Tensor, tol: torch.Tensor, k: int
                           ) -> None:
    """Each row: min(k, visible) distinct visible entries, then -1; sorted by score (within
    ``tol``); no entry left out scores more than ``tol`` above one taken."""
    got, scores, tol = got.cpu(), scores.cpu(), tol.cpu()
    for t in range(got.shape[0]):
        vis = int(torch.isfinite(scores[t]).sum())
        n = min(k, vis)
        row = got[t]
        assert (row[n:] == -1).all(), (t, row)
        taken = row[:n]
        assert (taken >= 0).all() and (taken < vis).all(), (t, row)
        assert taken.unique().numel() == n
        s = scores[t, taken]
        assert (s[1:] <= s[:-1] + tol[t]).all(), (t, s)
        left = torch.ones(vis, dtype=torch.bool)
        left[taken] = False
        if n and left.any():
            assert float(scores[t, :vis][left].max()) <= float(s.min()) + float(tol[t])


def assert_by_ascending_entry(sel: torch.Tensor) -> None:
    """Each row's entries by ascending index, the -1 padding after them (the top-k without its
    final sort)."""
    kept = torch.where(sel >= 0, sel, torch.iinfo(sel.dtype).max)
    assert torch.equal(kept, kept.sort(dim=1).values)


def assert_matches_torch_path(got: torch.Tensor, want: torch.Tensor, scores: torch.Tensor,
                              tol: torch.Tensor, k: int, ordered: bool = True) -> None:
    """The torch path's sets, in score order. Under the interpreter both sum in fp32 alike
    enough to give its order too; on a GPU the kernel's MMA sums in another order than cuBLAS,
    so two scores within rounding of each other may come in either order. ``ordered=False``
    (the top-k without its final sort): the same sets by ascending entry, then -1."""
    assert torch.equal(got.sort(dim=1).values, want.sort(dim=1).values)
    if ordered:
        assert_valid_selection(got, scores, tol, k)
        if DEV == "cpu":
            assert torch.equal(got, want)
        return
    assert_by_ascending_entry(got)
    by_score = scores.gather(1, got.clamp(min=0)).masked_fill(got < 0, float("-inf"))
    order = by_score.argsort(dim=1, descending=True, stable=True)
    assert_valid_selection(got.gather(1, order), scores, tol, k)


# ---------------------------------------------------------------------------- small shapes


CASES = {  # lengths, tokens per sequence, index_topk, rows per block
    "decode": ([100, 7, 250, 61], [1, 1, 1, 1], 16, 16),
    "multi_token": ([37, 130], [3, 5], 8, 16),
    "long_row": ([4500], [2], 32, 64),  # > one scan block of 1024 entries
    "few_visible": ([0, 2, 9, 40], [1, 1, 1, 1], 16, 16),  # 0, 0, 2, 10 visible < k
    "none_visible": ([0, 1], [1, 2], 4, 16),  # width 0
}


@kernel_runs
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_the_torch_path(fmt, case):
    lengths, counts, topk, block = CASES[case]
    cfg = tiny_cfg(topk, max(lengths) + 8)
    step = make_step(cfg, fmt, lengths, counts, block_size=block, seed=len(case))
    q, w = queries(cfg, step.num_tokens, seed=3)
    got = run_kernels(cfg, step, q, w)
    assert got.dtype == torch.long and got.shape == (step.num_tokens, topk)
    s64, tol = scores_f64(cfg, step, q, w, step.max_visible(4))
    assert_matches_torch_path(got, torch_path(cfg, step, q, w), s64, tol, topk)


@kernel_runs
@pytest.mark.parametrize("fmt", FORMATS)
def test_scores_match_float64_and_mask_the_invisible(fmt):
    cfg = tiny_cfg(8)
    step = make_step(cfg, fmt, [90, 33, 200], [1, 2, 1], seed=1)
    q, w = queries(cfg, step.num_tokens, seed=4)
    width = step.max_visible(4) + 37  # an upper bound beyond every query's entries
    store = step.pool.stores["idx_keys"]
    s = indexer_scores(q, w, store.data, index_kernel_format(store.fmt), store.block_size,
                       store.table_dev, step.tok_slot, step.pos, width, cfg.index_weight_scale)
    want, tol = scores_f64(cfg, step, q, w, width)
    assert want.shape == (step.num_tokens, width)
    assert_scores_match(s, want, tol)
    # the same selection with the wider bound, and in ascending entry order unsorted
    got = run_kernels(cfg, step, q, w)
    assert torch.equal(run_kernels(cfg, step, q, w, width=width), got)
    unsorted = run_kernels(cfg, step, q, w, sort=False)
    n = (got >= 0).sum(dim=1)
    for t in range(got.shape[0]):
        assert torch.equal(unsorted[t, :n[t]], got[t, :n[t]].sort().values)
        assert (unsorted[t, n[t]:] == -1).all()


@kernel_runs
@pytest.mark.parametrize("kw", [dict(), dict(stages=2), dict(block=128)], ids=["loop", "pipe2",
                                                                            "bn128"])
def test_fp8_scores_equal_those_of_the_same_keys_in_bf16(kw):
    """An fp8 store scores as a bf16 store of its dequantised keys (exact in bf16) with the
    same block tables: the score kernel hands the MMA the same values for both. Bit for bit
    under the interpreter; on a GPU the two loads may compile to different MMA paths (the bf16
    rows straight from memory, the fp8 ones dequantised in registers), whose fp32 sums differ
    in their last bits (on an H100, 2026-12-05, twice: not bit-equal, equal to 4 digits), so
    there both must lie within the fp32 rounding bound of the float64 scores of those keys."""
    cfg = tiny_cfg(8)
    steps = [make_step(cfg, fmt, [90, 0, 333, 1000], [1, 2, 1, 1], seed=2)
             for fmt in ("fp8", "bf16")]
    st8, st16 = (st.pool.stores["idx_keys"] for st in steps)
    assert torch.equal(st8.table_dev, st16.table_dev)
    flat = torch.arange(st8.data.shape[0] * st8.block_size, device=st8.data.device)
    keys = st8.read(flat, torch.float32)
    st16.write(flat, keys.to(BF16))  # rows no query sees may hold any bytes: not exact there
    q, w = queries(cfg, steps[0].num_tokens, seed=5)
    width = steps[0].max_visible(4) + 37
    got = [indexer_scores(q * 4, w, st.data, index_kernel_format(st.fmt), st.block_size,
                          st.table_dev, step.tok_slot, step.pos, width, cfg.index_weight_scale,
                          **kw)
           for st, step in zip((st8, st16), steps, strict=True)]
    assert torch.isfinite(got[0]).sum() > 300
    if DEV == "cpu":
        assert torch.equal(got[0], got[1])
    want, tol = scores_f64(cfg, steps[0], q * 4, w, width)
    for s in got:
        assert_scores_match(s, want, tol)


@kernel_runs
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kw", [dict(stages=1), dict(stages=3), dict(block=128),
                                dict(block=32, stages=2, programs_per_sm=1),
                                dict(block=128, stages=2, programs_per_sm=16)],
                         ids=["pipe1", "pipe3", "bn128", "bn32-pipe2-1pps", "bn128-pipe2-16pps"])
def test_score_overrides_give_the_same_scores(fmt, kw):
    """The score launch's tile width, pipelined loop and programs per SM change its speed, not
    its scores: programs holding only invisible tiles, a tile cut by the visible end and one by
    the width, queries with nothing visible."""
    cfg = tiny_cfg(8)
    step = make_step(cfg, fmt, [90, 0, 333, 1000], [1, 2, 1, 1], seed=2)
    q, w = queries(cfg, step.num_tokens, seed=5)
    args = score_args(cfg, step, q, w, step.max_visible(4) + 37)
    assert_same_scores(indexer_scores(*args, **kw), indexer_scores(*args))


def score_args(cfg: DSV4Config, step: CacheStep, q: torch.Tensor, w: torch.Tensor,
               width: int) -> tuple:
    """``indexer_scores``' positional arguments for the step's index key store."""
    store = step.pool.stores["idx_keys"]
    return (q, w, store.data, index_kernel_format(store.fmt), store.block_size, store.table_dev,
            step.tok_slot, step.pos, width, cfg.index_weight_scale)


def assert_same_scores(got: torch.Tensor, want: torch.Tensor) -> None:
    """The same -inf (invisible) pattern; the values up to the summation order of a wider
    matrix product (the interpreter's numpy product too rounds by its shape)."""
    vis = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), vis)
    torch.testing.assert_close(got[vis], want[vis], rtol=1e-5, atol=1e-6)


@kernel_runs
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", ["verify", "ragged"])
@pytest.mark.parametrize("stages", [0, 2])
def test_score_groups_give_the_same_scores(fmt, shape, stages):
    """Queries scored a group a program - a verify step's tokens sharing their sequence's key
    tiles - score as one query a program: groups aligned with the sequences ("verify": 4 + 4 +
    4 tokens) and groups cut across them ("ragged": 1 + 3 + 2 + 1 + 5 tokens, a sequence with
    nothing visible, a last group short of queries), with the arrival counts zeroed; the
    group's loop plain and with the next tile's keys fetched ahead (``stages=2``)."""
    lengths, counts = {"verify": ([90, 333, 1000], [4, 4, 4]),
                       "ragged": ([90, 0, 333, 7, 1000], [1, 3, 2, 1, 5])}[shape]
    cfg = tiny_cfg(8)
    step = make_step(cfg, fmt, lengths, counts, seed=7)
    q, w = queries(cfg, step.num_tokens, seed=8)
    width = step.max_visible(4) + 37
    args = score_args(cfg, step, q, w, width)
    zero = torch.full((step.num_tokens,), 7, dtype=torch.int32, device=DEV)
    got = indexer_scores(*args, group=4, zero=zero, stages=stages, programs_per_sm=1)
    assert not zero.any()
    assert_same_scores(got, indexer_scores(*args))
    s64, tol = scores_f64(cfg, step, q, w, width)
    assert_scores_match(got, s64, tol)


def page_case(shape: str, fp4_queries: bool = False
              ) -> tuple[DSV4Config, CacheStep, torch.Tensor, torch.Tensor, int, list]:
    """A page-copy scoring case of an fp8 store of 64-row blocks: (cfg, step, q, w, width,
    :func:`score_args` with the longest sequence's second block not held), sequences of 1 + 3
    tokens (``verify``) or ragged counts; ``fp4_queries``: q of the official FP4 simulation."""
    lengths, counts = {"verify": ([90, 333, 1000], [4, 4, 4]),
                       "ragged": ([90, 0, 333, 7, 1000], [1, 3, 2, 1, 5])}[shape]
    cfg = tiny_cfg(8)
    step = make_step(cfg, "fp8", lengths, counts, block_size=64, seed=7)
    q, w = queries(cfg, step.num_tokens, seed=8)
    if fp4_queries:
        q = fp4_block_sim(q.float() * 3).to(BF16)
    width = step.max_visible(4) + 37
    args = list(score_args(cfg, step, q, w, width))
    table = args[5].clone()
    table[step.tok_slot[-1], 1] = -1  # the longest sequence's second block: not held
    args[5] = table
    return cfg, step, q, w, width, args


@kernel_runs
@pytest.mark.parametrize("shape", ["verify", "ragged"])
@pytest.mark.parametrize("group", [1, 4])
def test_page_copied_scores_give_the_same_scores(shape, group):
    """``tma=True`` (an fp8 store's pages copied whole into shared memory, a tile a page) scores
    as the gathering loads do: one query a program and groups, aligned with the sequences and
    cut across them, a block the table does not hold (zeros, as gathered) and the tiles past
    the visible end."""
    _, step, _, _, _, args = page_case(shape)
    zero = torch.full((step.num_tokens,), 7, dtype=torch.int32, device=DEV)
    got = indexer_scores(*args, tma=True, group=group, zero=zero, programs_per_sm=1)
    assert not zero.any()
    assert_same_scores(got, indexer_scores(*args))


@kernel_runs
@pytest.mark.parametrize("shape", ["verify", "ragged"])
def test_fp8_mma_page_scores_match_float64(shape):
    """``fp8_mma=True``: the pages' e4m3 bytes against e4m3 query heads in an fp8 MMA. On
    queries of the official FP4 simulation (e2m1 grid points times power-of-two scales: exact
    in e4m3 with the head's scale) the products are exact, so the scores match the float64
    ones within the fp8 MMA's accumulation (2^-12 of the row's bound of |terms|; the bf16
    path's bound is 1e-5), -inf where invisible, zeros from an unheld block."""
    cfg, step, q, w, width, args = page_case(shape, fp4_queries=True)
    got = indexer_scores(*args, tma=True, fp8_mma=True, programs_per_sm=1)
    s64, tol = scores_f64(cfg, step, q, w, width)
    unheld = (step.tok_slot == step.tok_slot[-1])[:, None] & torch.isfinite(s64)
    unheld[:, :64] = False
    unheld[:, 128:] = False
    assert unheld.any()
    assert_scores_match(got, torch.where(unheld, 0.0, s64), tol * 25)


@kernel_runs
@pytest.mark.parametrize("tma", [True, None])
def test_fp8_queries_select_within_the_fp8_mma_bound(tma):
    """``indexer_topk(fp8_queries=True)`` on queries of the official FP4 simulation: with page
    copies (forced, or by default on a GPU) the fp8 MMA's scores, so a valid selection within
    its accumulation bound (that of :func:`test_fp8_mma_page_scores_match_float64`), in
    chunks and with a split top-k; without them (the interpreter's default) the torch path's."""
    cfg = tiny_cfg(16, 4600)
    step = make_step(cfg, "fp8", [4500, 130, 37], [4, 3, 1], block_size=64, seed=11)
    q, w = queries(cfg, step.num_tokens, seed=12)
    q = fp4_block_sim(q.float() * 3).to(BF16)
    s64, tol = scores_f64(cfg, step, q, w, step.max_visible(4))
    copies = tma or (tma is None and DEV == "cuda")
    want = torch_path(cfg, step, q, w)
    for kw in (dict(), dict(workspace_bytes=4 * step.max_visible(4)), dict(split=2)):
        got = run_kernels(cfg, step, q, w, tma=tma, fp8_queries=True, **kw)
        if copies:
            assert_valid_selection(got, s64, tol * 25, cfg.index_topk)
        else:
            assert_matches_torch_path(got, want, s64, tol, cfg.index_topk)


@pytest.mark.parametrize("kw, message", [
    (dict(), "fp8_mma needs tma=True and rows of 128 values"),
    (dict(tma=True, group=4), "fp8_mma scores one query a program, got group=4")])
def test_fp8_mma_names_what_it_cannot_score(kw, message):
    with pytest.raises(ValueError, match=message):
        indexer_scores(torch.zeros(1, 1, 128, dtype=BF16), torch.zeros(1, 1, dtype=BF16),
                       torch.zeros(1, 64 * 132, dtype=torch.uint8), "fp8", 64,
                       torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.long),
                       torch.zeros(1, dtype=torch.long), 8, 1.0, fp8_mma=True, **kw)


@pytest.mark.parametrize("kw, message", [
    (dict(), "fmt 'bf16' \\(fp8 only\\)"),
    (dict(block=32), "tiles of 32 entries against blocks of 16 rows"),
    (dict(block=16), "blocks of 16 rows \\(64 only\\)"),
    (dict(stages=9), "stages=9")])
def test_page_copied_scores_name_what_they_cannot_copy(kw, message):
    with pytest.raises(ValueError, match=message):
        indexer_scores(torch.zeros(1, 1, 128, dtype=BF16), torch.zeros(1, 1, dtype=BF16),
                       torch.zeros(1, 16, 128, dtype=BF16), "bf16", 16,
                       torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.long),
                       torch.zeros(1, dtype=torch.long), 8, 1.0, tma=True, **kw)


@kernel_runs
def test_grouped_selection_matches_the_torch_path():
    """``indexer_topk`` with scoring groups (the gathering loads: ``tma=False``) and by its
    default (on a GPU the page copies, one query a program, for this fp8 store of 64-row
    blocks), in workspace chunks of whole groups and with a split top-k: the torch path's
    selection."""
    cfg = tiny_cfg(16, 4600)
    step = make_step(cfg, "fp8", [4500, 130, 37], [4, 3, 1], block_size=64, seed=11)
    q, w = queries(cfg, step.num_tokens, seed=12)
    s64, tol = scores_f64(cfg, step, q, w, step.max_visible(4))
    want = torch_path(cfg, step, q, w)
    for tma in (False, None):
        for kw in (dict(), dict(workspace_bytes=4 * step.max_visible(4)), dict(split=2)):
            got = run_kernels(cfg, step, q, w, group=4, tma=tma, **kw)
            assert_matches_torch_path(got, want, s64, tol, cfg.index_topk)


def test_page_copies_apply_to_fp8_pages_on_a_gpu():
    """``indexer_topk`` copies pages (by default) only where ``indexer_scores(tma=True)`` can:
    an fp8 store of 64-row blocks with 128- or 256-value rows, on a CUDA device."""
    dev = KERNEL_DEV
    on_gpu = dev == "cuda"
    fp8 = torch.zeros(3, 64 * 132, dtype=torch.uint8, device=dev)
    assert page_copies_apply(fp8, "fp8", 64, 128) == on_gpu
    assert not page_copies_apply(fp8, "fp8", 16, 128)
    assert not page_copies_apply(fp8, "fp4", 64, 128)
    assert not page_copies_apply(fp8, "fp8", 64, 64)
    assert not page_copies_apply(fp8[:, 4:], "fp8", 64, 128)  # a base off 16-byte alignment
    assert not page_copies_apply(fp8.cpu(), "fp8", 64, 128)


@pytest.mark.parametrize("kw", [dict(block=8), dict(block=512), dict(block=48), dict(stages=5),
                                dict(stages=-1), dict(stages=True), dict(programs_per_sm=0),
                                dict(programs_per_sm=2.0), dict(group=3), dict(group=True),
                                dict(group=16), dict(group=2), dict(num_warps=3),
                                dict(group=4, stages=3)])
def test_score_overrides_are_checked(kw):
    name = next(iter(kw))
    message = ("indexer_scores: stages=3 with group=4" if len(kw) > 1
               else f"indexer_scores: {name} must be")
    with pytest.raises(ValueError, match=message):
        indexer_scores(torch.zeros(1, 1, 32, dtype=BF16), torch.zeros(1, 1, dtype=BF16),
                       torch.zeros(1, 16, 32, dtype=BF16), "bf16", 16,
                       torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.long),
                       torch.zeros(1, dtype=torch.long), 8, 1.0, **kw)


def integer_keys(step: CacheStep, distinct: int, seed: int) -> None:
    """Overwrite every held key with one of ``distinct`` integer rows (exact in every format):
    many exact ties at every score. With integer queries and weights the scores are exact in fp32
    in any summation order only when ``index_weight_scale`` is a power of two (tiny presets,
    :func:`flash_ties_cfg`; Flash's own 64 x 128 heads give 2^-6.5)."""
    store = step.pool.stores["idx_keys"]
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(-4, 5, (distinct, store.fmt.dim), generator=g).float()
    dev = step.tok_slot.device
    for c, start, count in zip(step.caches, step.starts, step.counts, strict=True):
        ents = torch.arange((start + count) // 4, device=dev)
        flat = store.flat_rows(torch.full_like(ents, c.slot), ents)
        pick = torch.randint(0, distinct, (flat.numel(),), generator=g)
        store.write(flat, rows[pick].to(flat.device, BF16))


@kernel_runs
@pytest.mark.parametrize("fmt", FORMATS)
def test_exact_ties_go_to_the_lower_entry_index(fmt):
    cfg = tiny_cfg(16)
    step = make_step(cfg, fmt, [180, 97, 300], [1, 1, 2], seed=2)
    integer_keys(step, distinct=3, seed=7)
    g = torch.Generator().manual_seed(8)
    q = torch.randint(-2, 3, (step.num_tokens, 8, 128), generator=g).to(DEV, BF16)
    w = torch.randint(-3, 4, (step.num_tokens, 8), generator=g).to(DEV, BF16)
    got = run_kernels(cfg, step, q, w)
    assert torch.equal(got, torch_path(cfg, step, q, w))
    # zero queries: every score is 0 (+0 or -0), the lowest entries in index order
    zero = run_kernels(cfg, step, torch.zeros_like(q), w)
    want = torch.arange(16, device=got.device).expand_as(got)
    assert torch.equal(zero, want)
    assert torch.equal(zero, torch_path(cfg, step, torch.zeros_like(q), w))


@kernel_runs
@pytest.mark.parametrize("split", [1, 4, 16])
@pytest.mark.parametrize("scan", [None, (16, 1), (4096, 16)], ids=["auto", "16", "4096"])
@pytest.mark.parametrize("k", [1, 5, 64])
def test_topk_of_constructed_scores(k, scan, split):
    """The top-k kernel alone on rows built to be hard: many exact ties (and -0.0 beside +0.0),
    visible counts above, at and below k and the width (capped at it), none visible; with the
    default scan, many narrow iterations, and one iteration wider than the row; one program
    per row and rows cut into 4 and 16 chunks (some of them empty)."""
    width = 2100
    g = torch.Generator().manual_seed(k)
    s = torch.randint(-3, 4, (6, width), generator=g).float() * 0.25
    s[0] = torch.randn(width, generator=g)
    s[1, ::2], s[1, 1::2] = -0.0, 0.0
    pos = torch.tensor([4 * width - 1, 4 * width + 50, 4 * 1000 - 1, 4 * 3 - 1, 2, 4 * 1025 + 2])
    block, warps = scan or (None, None)
    got = topk_entries(s.to(DEV), pos.to(DEV), k, block=block, num_warps=warps,
                       split=split).cpu()
    vis = ((pos + 1) // 4).clamp(max=width)
    masked = s.masked_fill(torch.arange(width)[None, :] >= vis[:, None], float("-inf"))
    values, idx = stable_topk(masked, k)
    assert torch.equal(got, idx.masked_fill(values == float("-inf"), -1))
    assert torch.equal(got[1], torch.arange(k))


@kernel_runs
@pytest.mark.parametrize("digit_bits", [2, 4])
@pytest.mark.parametrize("split", [1, 4])
def test_narrower_radix_digits_select_the_same(digit_bits, split):
    """``digit_bits``: 16 passes of 2 bits or 8 of 4 instead of 4 of 8 - the same selection
    (order included) on normal scores, quarter-step ties with exact zeros, -0.0 beside +0.0,
    one value everywhere, scores that differ only in their lowest bits, negative scores
    (the sign bit's digit), and short rows."""
    width, k = 3000, 300
    g = torch.Generator().manual_seed(digit_bits)
    s = torch.randn(7, width, generator=g)
    s[1] = torch.randint(-3, 4, (width,), generator=g).float() * 0.25
    s[1, ::4] = 0.0
    s[2, ::2], s[2, 1::2] = -0.0, 0.0
    s[3] = -1.5
    s[4] = 1.0 + torch.randint(0, 64, (width,), generator=g).float() * 2.0 ** -23
    s[5] = -torch.rand(width, generator=g) - 1.0
    pos = torch.tensor([4 * width - 1] * 6 + [4 * 200])
    args = (s.to(DEV), pos.to(DEV), k)
    want = topk_entries(*args, split=split).cpu()
    got = topk_entries(*args, split=split, digit_bits=digit_bits).cpu()
    assert torch.equal(got, want)
    vis = ((pos + 1) // 4).clamp(max=width)
    masked = s.masked_fill(torch.arange(width)[None, :] >= vis[:, None], float("-inf"))
    values, idx = stable_topk(masked, k)
    assert torch.equal(got, idx.masked_fill(values == float("-inf"), -1))


@kernel_runs
@pytest.mark.parametrize("merge_block", [16, 256, 2048, 4096])
def test_held_and_streamed_merges_select_the_same(merge_block):
    """The split top-k's merge holds the P * k candidates in registers where they fit one
    merge block (2048, 4096 here) and streams them in blocks otherwise (16, 256): the same
    selection either way, sorted and by index, on ties, equal rows and short rows."""
    width, k, split = 3000, 512, 4
    g = torch.Generator().manual_seed(11)
    s = torch.randn(5, width, generator=g)
    s[1] = torch.randint(-3, 4, (width,), generator=g).float() * 0.25
    s[2] = 0.5
    s[3, 2000:2600] += 8.0  # the best entries in one chunk
    pos = torch.tensor([4 * width - 1] * 4 + [4 * 700])
    args = (s.to(DEV), pos.to(DEV), k)
    for sort in (True, False):
        want = topk_entries(*args, sort=sort, split=1).cpu()
        got = topk_entries(*args, sort=sort, split=split, merge_block=merge_block).cpu()
        assert torch.equal(got, want), sort


@kernel_runs
@pytest.mark.parametrize("split", [1, 4])
def test_held_and_streamed_rows_select_the_same(split):
    """A row (split 1) or chunk (split 4) that fits its scan block is read once and selected in
    registers (``HELD``); with a 64-score block the same rows stream through every pass: the
    same selection, sorted and by index, with 8- and 4-bit digits, on ties, one value
    everywhere, scores that differ in their lowest bits, and rows cut short."""
    width, k = 900, 100
    g = torch.Generator().manual_seed(5)
    s = torch.randn(6, width, generator=g)
    s[1] = torch.randint(-3, 4, (width,), generator=g).float() * 0.25
    s[1, ::4] = 0.0
    s[2] = -0.75
    s[3] = 1.0 + torch.randint(0, 64, (width,), generator=g).float() * 2.0 ** -23
    pos = torch.tensor([4 * width - 1] * 4 + [4 * 300, 4 * 60])
    args = (s.to(DEV), pos.to(DEV), k)
    vis = ((pos + 1) // 4).clamp(max=width)
    masked = s.masked_fill(torch.arange(width)[None, :] >= vis[:, None], float("-inf"))
    values, idx = stable_topk(masked, k)
    want = idx.masked_fill(values == float("-inf"), -1)
    for sort in (True, False):
        for bits in (8, 4):
            held = topk_entries(*args, sort=sort, split=split, block=1024, digit_bits=bits)
            streamed = topk_entries(*args, sort=sort, split=split, block=64, digit_bits=bits)
            assert torch.equal(held.cpu(), streamed.cpu()), (sort, bits)
            got = held.cpu() if sort else held.cpu().sort(dim=1).values
            assert torch.equal(got, want if sort else want.sort(dim=1).values), (sort, bits)


@kernel_runs
@pytest.mark.parametrize("sort", [True, False])
@pytest.mark.parametrize("split", [2, 4, 8, 16])
def test_a_split_row_selects_like_one_program(sort, split):
    """Rows cut into chunks, k = 512 of 5000 entries (a chunk narrower than k at 16): normal
    scores, quarter-step ties with a quarter exact zeros, one value everywhere (the tie rule
    alone decides, across chunks), near-equal scores that differ only in their low bits, a
    row whose best entries sit in one chunk, and short rows (chunks past the visible end)."""
    width, k = 5000, 512
    g = torch.Generator().manual_seed(3)
    s = torch.randn(7, width, generator=g)
    s[1] = torch.randint(-3, 4, (width,), generator=g).float() * 0.25
    s[1, ::4] = 0.0
    s[2] = 1.5
    s[3] = 1.0 + torch.randint(0, 64, (width,), generator=g).float() * 2.0 ** -23
    s[4, 3000:3700] += 10.0  # the top 512 all in one or two chunks
    pos = torch.tensor([4 * width - 1, 4 * width - 1, 4 * width - 1, 4 * 4000, 4 * width - 1,
                        4 * 600, 4 * 300])
    args = (s.to(DEV), pos.to(DEV), k)
    one = topk_entries(*args, sort=sort, split=1).cpu()
    arrivals = torch.zeros(7, dtype=torch.int32, device=DEV)
    got = topk_entries(*args, sort=sort, split=split, arrivals=arrivals).cpu()
    assert torch.equal(got, one)
    assert not arrivals.any()  # the merging programs set the counts back to zero
    again = topk_entries(*args, sort=sort, split=split, arrivals=arrivals).cpu()
    assert torch.equal(again, one)
    if not sort:  # ascending entry index, -1 pads last
        row = got[5]
        assert torch.equal(row[row >= 0], row[row >= 0].sort().values)
    vis = ((pos + 1) // 4).clamp(max=width)
    masked = s.masked_fill(torch.arange(width)[None, :] >= vis[:, None], float("-inf"))
    values, idx = stable_topk(masked, k)
    want = idx.masked_fill(values == float("-inf"), -1)
    assert torch.equal(got if sort else got.sort(dim=1).values,
                       want if sort else want.sort(dim=1).values)


def test_the_split_rule():
    from dsv4.kernels.indexer_topk import MAX_SPLIT, PREFERRED_SPLIT, choose_split

    assert choose_split(16 * 512 - 1, 512, 1, 132) == 1  # too short to pay for a merge
    assert choose_split(4096, 512, 1, 132) == 1
    assert choose_split(16384, 512, 1, 132) == PREFERRED_SPLIT == 8
    assert choose_split(65536, 512, 16, 132) == 8
    assert choose_split(1 << 20, 512, 1, 132) == PREFERRED_SPLIT  # never more than preferred
    assert choose_split(16384, 1024, 1, 132) == 4  # Pro's k: the merge weighs twice as much
    assert choose_split(16384 - 1, 1024, 1, 132) == 1
    assert choose_split(16384, 512, 64, 132) == 4  # at most two programs per SM
    assert choose_split(16384, 512, 200, 132) == 1  # the rows fill the SMs already
    assert choose_split(16384, 1024, 64, 132) == 2  # k = 1024: one program per SM
    assert choose_split(65536, 1024, 64, 132) == 2
    assert choose_split(65536, 1024, 16, 132) == 8
    for width in (2048, 5000, 16384, 1 << 18):
        for rows in (1, 3, 16, 64, 100, 300):
            for k in (512, 1024):
                p = choose_split(width, k, rows, 132)
                assert p & (p - 1) == 0 and 1 <= p <= MAX_SPLIT
                assert p == 1 or rows * p * k <= 1024 * 132


def test_the_scan_widens_on_wide_rows():
    from dsv4.kernels.indexer_topk import SCAN_BLOCK, WIDE_SCAN_BLOCK, choose_scan

    assert choose_scan(WIDE_SCAN_BLOCK - 1)[0] == SCAN_BLOCK
    assert choose_scan(WIDE_SCAN_BLOCK)[0] == choose_scan(1 << 18)[0] == WIDE_SCAN_BLOCK


def test_the_digit_bits_rule():
    from dsv4.kernels.indexer_topk import SCAN_BLOCK, WIDE_SCAN_BLOCK, choose_digit_bits

    assert choose_digit_bits(8, SCAN_BLOCK) == 4  # measured faster (16K entries, k = 512)
    assert choose_digit_bits(1, SCAN_BLOCK) == 8
    assert choose_digit_bits(1, WIDE_SCAN_BLOCK) == 8  # measured slower at 4 bits
    assert choose_digit_bits(4, WIDE_SCAN_BLOCK) == 8


def test_the_merge_block_rule():
    from dsv4.kernels.indexer_topk import SCAN_BLOCK, WIDE_SCAN_BLOCK, choose_merge_block

    assert choose_merge_block(8 * 512) == WIDE_SCAN_BLOCK  # spills beside 4096-wide chunks,
    assert choose_merge_block(16 * 512) == WIDE_SCAN_BLOCK  # measured faster anyway
    assert choose_merge_block(2 * 512) == SCAN_BLOCK


@pytest.mark.parametrize("kw", [dict(block=1000), dict(block=8), dict(block=True),
                                dict(num_warps=3), dict(num_warps=64), dict(split=3),
                                dict(split=0), dict(split=32), dict(split=True),
                                dict(split=4.0), dict(merge_block=100), dict(digit_bits=3),
                                dict(digit_bits=16), dict(digit_bits=True)])
def test_scan_overrides_are_checked(kw):
    name = next(iter(kw))
    with pytest.raises(ValueError, match=f"topk_entries: {name} must be"):
        topk_entries(torch.zeros(1, 8), torch.zeros(1, dtype=torch.long), 2, **kw)


@kernel_runs
def test_chunked_workspace_gives_the_same_selection():
    cfg = tiny_cfg(8)
    step = make_step(cfg, "fp8", [120, 40, 77], [2, 1, 3], seed=5)
    q, w = queries(cfg, step.num_tokens, seed=6)
    whole = run_kernels(cfg, step, q, w)
    one_row = run_kernels(cfg, step, q, w, workspace_bytes=4 * step.max_visible(4))
    assert torch.equal(whole, one_row)


@kernel_runs
@pytest.mark.parametrize("sort", [True, False])
def test_split_steps_give_the_same_selection(sort):
    """``indexer_topk`` with its rows cut into chunks (the score launch zeroing the arrival
    counts, in workspace chunks of one and of all queries) selects what one program does."""
    cfg = tiny_cfg(32, 4600)
    step = make_step(cfg, "fp8", [4500, 900, 3000], [2, 1, 1], block_size=64, seed=9)
    q, w = queries(cfg, step.num_tokens, seed=10)
    one = run_kernels(cfg, step, q, w, sort=sort, split=1)
    for split in (2, 8):
        assert torch.equal(run_kernels(cfg, step, q, w, sort=sort, split=split), one)
        one_row = run_kernels(cfg, step, q, w, sort=sort, split=split,
                              workspace_bytes=4 * step.max_visible(4))
        assert torch.equal(one_row, one)


@kernel_runs
def test_the_score_launch_zeroes_the_arrival_counts():
    cfg = tiny_cfg(8)
    step = make_step(cfg, "bf16", [90, 33], [1, 2], seed=1)
    q, w = queries(cfg, step.num_tokens, seed=4)
    store = step.pool.stores["idx_keys"]
    args = (q, w, store.data, "bf16", store.block_size, store.table_dev, step.tok_slot,
            step.pos, step.max_visible(4), cfg.index_weight_scale)
    zero = torch.full((step.num_tokens,), 7, dtype=torch.int32, device=DEV)
    plain = indexer_scores(*args)
    assert torch.equal(indexer_scores(*args, zero=zero), plain)
    assert not zero.any()
    for bad in (torch.zeros(step.num_tokens, dtype=torch.long, device=DEV),
                torch.zeros(step.num_tokens + 1, dtype=torch.int32, device=DEV)):
        with pytest.raises(ValueError, match="indexer_scores: zero must be"):
            indexer_scores(*args, zero=bad)
    with pytest.raises(ValueError, match="topk_entries: arrivals must be"):
        topk_entries(plain, step.pos, 4, split=2, arrivals=bad)


def cuda_layer_shell(cfg: DSV4Config):
    """A CudaAttention holding only what ``_indexer_select`` reads: its constructor needs a CUDA
    device (streams, events), the interpreter runs on the CPU."""
    from dsv4.platforms.cuda import CudaAttention

    layer = CudaAttention.__new__(CudaAttention)
    nn.Module.__init__(layer)
    layer.cfg = cfg
    layer.acc_dtype = torch.float32
    layer.indexer = indexer(cfg)
    layer.use_step_kernels(True)  # the constructor's default
    return layer


@kernel_runs
def test_cuda_platform_takes_the_kernels_for_decode_and_prefill_steps():
    from dsv4.kernels.indexer_topk import KERNEL_MAX_TOKENS

    cfg = tiny_cfg(8)
    layer = cuda_layer_shell(cfg)
    step = make_step(cfg, "fp4", [60, 150], [1, 1], seed=9)
    q, w = queries(cfg, 2, seed=10)
    assert layer._indexer_kernel_format(step, q) == "fp4"
    layer.use_step_kernels(False)  # the switch of the step kernels: the torch path
    assert layer._indexer_kernel_format(step, q) == ""
    layer.use_step_kernels(True)
    s64, tol = scores_f64(cfg, step, q, w, step.max_visible(4))
    want = torch_path(cfg, step, q, w)
    unsorted = layer._indexer_select(step, q, w)  # by ascending entry index
    assert_by_ascending_entry(unsorted)
    assert_matches_torch_path(unsorted, want, s64, tol, 8, ordered=False)
    assert torch.equal(unsorted.sort(dim=1).values, want.sort(dim=1).values)
    assert layer._indexer_kernel_format(step, q.float()) == ""  # a float32 layer's queries
    # prefill-sized: the tiled kernel (dsv4.kernels.indexer_prefill), the same selection
    big = make_step(cfg, "bf16", [0], [KERNEL_MAX_TOKENS + 1], seed=11)
    assert layer._indexer_kernel_format(big, q) == "bf16"
    qb, wb = queries(cfg, KERNEL_MAX_TOKENS + 1, seed=12)
    import dsv4.platforms.cuda as cuda
    from dsv4 import DeepseekV4Attention

    calls = []
    real = cuda.select_prefill
    cuda.select_prefill = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        got = layer._indexer_select(big, qb, wb)
    finally:
        cuda.select_prefill = real
    assert len(calls) == 1
    assert torch.equal(got, DeepseekV4Attention._indexer_select(layer, big, qb, wb))
    # a verify step: its sequences' 1 + 3 queries scored four a program, the same selection
    verify = make_step(cfg, "fp8", [60, 150], [4, 4], seed=13)
    qv, wv = queries(cfg, 8, seed=14)
    s64, tol = scores_f64(cfg, verify, qv, wv, verify.max_visible(4))
    groups = []
    real_scores = cuda.indexer_topk
    cuda.indexer_topk = lambda *a, **k: groups.append(k["group"]) or real_scores(*a, **k)
    try:
        got = layer._indexer_select(verify, qv, wv)
    finally:
        cuda.indexer_topk = real_scores
    assert groups == [4]
    assert_matches_torch_path(got, torch_path(cfg, verify, qv, wv), s64, tol, 8, ordered=False)
    # the same step's counts unpadded and padded to a layout of 4 tokens a sequence (a runner's
    # bucket): the layout decides the group, so every step of a bucket scores as its graph
    cuda.indexer_topk = lambda *a, **k: groups.append(k["group"]) or real_scores(*a, **k)
    try:
        for bucket in (None, 4):
            padded = dataclasses.replace(
                verify, counts=[3, 2],
                meta=dataclasses.replace(verify.meta, query_bucket=bucket))
            layer._indexer_select(padded, qv, wv)
    finally:
        cuda.indexer_topk = real_scores
    assert groups == [4, 1, 4]


def test_formats_the_kernels_read():
    from dsv4.cache.formats import index_format

    assert [index_kernel_format(index_format(n, 128, BF16)) for n in ("auto", "bf16", "fp8",
                                                                       "fp4")] == \
        ["bf16", "bf16", "fp8", "fp4"]
    assert index_kernel_format(index_format("auto", 128, torch.float32)) == ""
    assert index_kernel_format(index_format("bf16", 128, torch.float32)) == "bf16"


# ---------------------------------------------------------------------------- GPU: full shapes


@needs_gpu
@pytest.mark.cuda
@pytest.mark.parametrize("preset", ["flash", "pro"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_flash_and_pro_shapes(preset, fmt):
    cfg = DSV4Config.preset(preset)
    lengths = [65536, 1000, 20001, 4099, 2050, 130]
    step = make_step(cfg, fmt, lengths, [1] * len(lengths), block_size=64, seed=1,
                     device="cuda")
    q, w = queries(cfg, step.num_tokens, seed=2, device="cuda")
    got = run_kernels(cfg, step, q, w)
    s64, tol = scores_f64(cfg, step, q, w, step.max_visible(4))
    assert_valid_selection(got, s64, tol, cfg.index_topk)
    want = torch_path(cfg, step, q, w)
    # the same selection as the torch path, up to swaps of scores within rounding of each other
    same = (got.sort(dim=1).values == want.sort(dim=1).values).all(dim=1)
    assert int(same.sum()) >= got.shape[0] - 1


@needs_gpu
@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS)
def test_sixty_four_queries_of_sixteen_sequences(fmt):
    """A verify step's shape (16 sequences of 1 + 3 tokens), scored one query a program and
    four: valid selections, and the grouped scores those of one query a program."""
    cfg = DSV4Config.preset("flash")
    lengths = [1000 * (i + 1) + 3 * i for i in range(16)]
    step = make_step(cfg, fmt, lengths, [4] * 16, block_size=64, seed=3, device="cuda")
    q, w = queries(cfg, 64, seed=4, device="cuda")
    s64, tol = scores_f64(cfg, step, q, w, step.max_visible(4))
    for group in (1, 4):
        assert_valid_selection(run_kernels(cfg, step, q, w, group=group), s64, tol,
                               cfg.index_topk)
    store = step.pool.stores["idx_keys"]
    args = (q, w, store.data, index_kernel_format(store.fmt), store.block_size,
            store.table_dev, step.tok_slot, step.pos, step.max_visible(4),
            cfg.index_weight_scale)
    one = indexer_scores(*args)
    vis = torch.isfinite(one)
    got = indexer_scores(*args, group=4)
    assert torch.equal(torch.isfinite(got), vis)
    torch.testing.assert_close(got[vis], one[vis], rtol=1e-5, atol=1e-5)


@needs_gpu
@pytest.mark.cuda
def test_a_million_positions():
    cfg = DSV4Config.preset("pro")
    step = make_step(cfg, "fp8", [1_000_000, 300_001], [1, 1], block_size=64, seed=5,
                     device="cuda")
    q, w = queries(cfg, 2, seed=6, device="cuda")
    got = run_kernels(cfg, step, q, w)
    s64, tol = scores_f64(cfg, step, q, w, step.max_visible(4))
    assert_valid_selection(got, s64, tol, cfg.index_topk)


@needs_gpu
@pytest.mark.cuda
def test_ties_at_flash_shapes():
    cfg = flash_ties_cfg()
    step = make_step(cfg, "fp4", [9000, 3000], [1, 1], block_size=64, seed=7, device="cuda")
    integer_keys(step, distinct=5, seed=8)
    g = torch.Generator().manual_seed(9)
    q = torch.randint(-2, 3, (2, 32, 128), generator=g).to("cuda", BF16)
    w = torch.randint(-3, 4, (2, 32), generator=g).to("cuda", BF16)
    assert torch.equal(run_kernels(cfg, step, q, w), torch_path(cfg, step, q, w))
    zero = run_kernels(cfg, step, torch.zeros_like(q), w)
    assert torch.equal(zero, torch.arange(512, device="cuda").expand(2, 512))


@needs_gpu
@pytest.mark.cuda
@pytest.mark.parametrize("split", [None, 1, 8])
def test_graph_replay_equals_eager(split):
    """Captured and replayed (twice: a split's arrival counts must start from zero at every
    replay, which the captured score launch sees to) the step selects what it does eagerly."""
    from dsv4.runner import capture_graph

    cfg = DSV4Config.preset("flash")
    step = make_step(cfg, "fp8", [30000, 5000, 777], [1, 1, 1], block_size=64, seed=10,
                     device="cuda")
    q, w = queries(cfg, 3, seed=11, device="cuda")
    eager = run_kernels(cfg, step, q, w, split=split)
    assert torch.equal(eager, run_kernels(cfg, step, q, w, split=1))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run_kernels(cfg, step, q, w, split=split)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with capture_graph(graph):
        out = run_kernels(cfg, step, q, w, split=split)
    for _ in range(2):
        out.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


@needs_gpu
@pytest.mark.cuda
def test_cuda_layer_decode_selects_like_the_reference():
    from dsv4 import DeepseekV4Attention
    from dsv4.platforms.cuda import CudaAttention
    from dsv4.testing.random_weights import random_layer_weights

    cfg = DSV4Config.preset("tiny")
    lid = cfg.layer_of_ratio(4)
    layer = CudaAttention(cfg, lid, device="cuda", dtype=BF16)
    layer.load_weights(random_layer_weights(cfg, lid, seed=1).items())
    step = make_step(cfg, "fp8", [300, 41], [1, 1], block_size=64, seed=12, device="cuda")
    q, w = queries(cfg, 2, seed=13, device="cuda")
    assert layer._indexer_kernel_format(step, q) == "fp8"
    want = DeepseekV4Attention._indexer_select(layer, step, q, w)
    s64, tol = scores_f64(cfg, step, q, w, step.max_visible(4))
    got = layer._indexer_select(step, q, w)  # the top-k without its final sort
    assert_matches_torch_path(got, want, s64, tol, cfg.index_topk, ordered=False)


def test_the_score_group_rule():
    from dsv4.kernels.indexer_topk import SCORE_GROUPS, choose_score_group

    assert [choose_score_group(n) for n in range(0, 10)] == [1, 1, 1, 1, 4, 4, 4, 4, 4, 4]
    assert max(SCORE_GROUPS) == 4  # 8 queries a program spill (SCORE_GROUPS' note)


def test_the_score_grid_rule():
    from dsv4.kernels.indexer_topk import choose_score_programs

    tiles = 65536 // 64
    assert choose_score_programs(tiles, 64, 132) == 61  # 8 per SM: 17 programs a row
    assert choose_score_programs(tiles, 16, 132) == 16  # 8 per SM: 66 programs a row
    assert choose_score_programs(16384 // 64, 64, 132) == 16
    assert choose_score_programs(16384 // 64, 16, 132) == 8  # 8 per SM leaves 4: stay at 4
    assert choose_score_programs(tiles, 1, 132) == 2  # capped by the tiles either way
    assert choose_score_programs(64, 16, 132) == 2
    assert choose_score_programs(tiles, 64, 132, programs_per_sm=4) == 114  # the override
    for n_tiles in (1, 7, 64, 256, 1024, 5000):
        for rows in (1, 3, 16, 64, 300):
            t = choose_score_programs(n_tiles, rows, 132)
            assert 1 <= t <= n_tiles and -(-n_tiles // t) * t >= n_tiles
