"""The lightning indexer's decode selection in two Triton launches (docs/spec.md §5.7).

Entry point ``indexer_topk(q, weights, keys, fmt, rows_per_block, block_table, tok_slot, pos,
width, topk, weight_scale)`` -> entry indices [T, topk] int64 (-1 pads), the contract of
:meth:`dsv4.layers.indexer.Indexer.select_paged`, which is the oracle (and the path off CUDA
without Triton's interpreter):

1. **Scores** (``_score_kernel``, one program per query - or per group of a verify step's
   queries of one sequence, which share each key tile (``choose_score_group``; a group's loop
   loads the next tile's keys before it scores this one: ``GROUP_STAGES``) - and run of
   tiles of ``SCORE_BLOCK`` entries, a few programs per SM over all queries:
   ``choose_score_programs``):
   the entries' keys are read from the paged ``idx_keys`` store as stored (through the block
   table of the query's sequence), dequantised in registers, and
   ``score[t, j] = sum_h (w[t, h] * weight_scale) * relu(<q[t, h], K[j]>)`` in fp32 goes to a
   workspace [T, width]; -inf where j >= (pos + 1) // 4 (invisible). Tiles wholly beyond the
   query's visible entries only write -inf. ``indexer_scores(tma=True)`` (``_page_score_kernel``,
   an fp8 store of 64-row blocks) copies each tile, one page, into shared memory by the TMA
   instead, pipelined ahead of the MMA: the same scores. ``indexer_topk`` takes the page
   copies, one query a program, wherever they apply (:func:`page_copies_apply`: the serving
   configuration's fp8 index keys on a GPU).
2. **Top-k** (``_topk_kernel``, one program per query): a radix select on order-preserving 32-bit
   keys of the fp32 scores (up to 4 passes of 8-bit histograms over the visible entries,
   fewer once every entry of the k-th's bin is needed; none when k covers every visible
   entry) finds the k-th largest score v and how many entries equal to v are still needed
   (or a bin's lower bound and the whole bin); a compaction pass then
   takes every entry above v and, of those equal to v, the lowest-indexed ones (the tie rule);
   a bitonic sort of the k taken entries on (score, -index) writes them in the torch path's
   order: score descending, equal scores by ascending entry index. -1 pads the rest. -0.0 and
   +0.0 count as equal (relu zeroes make many exact zeros). On long rows with few queries
   (``choose_split``) each row is cut into P chunks instead, one program each
   (``_topk_split_kernel``, grid [T, P]): every program selects its chunk's top k into a
   candidate workspace (entries and their scores), counts itself in an arrival counter the
   score launch zeroed, and the row's last program to arrive merges the P * k candidates the
   same way (held in registers when they fit one merge block) - the same
   selection, with P programs on the row's passes instead of one. A row (or a split row's
   chunk) that fits one scan block is read once into registers and every pass and the take
   run on it there (``HELD``); a wider one is read again for each pass. With the passes'
   early exit (:func:`_radix_select`), one C4 layer at 64K, M = 16, H100, 2026-12-07
   (``benchmarks/results/2026-12-07-h100/decode-step-verify/topk-64k/``): Flash 209.2 ->
   201.3 us, Pro 335.8 -> 315.7; on rows of many exact ties the exit never fires, and its
   check, then a reduction of its own, cost there (docs/performance.md, "Held rows and early
   exit"; since 2f8453c the pass's max carries it).

Store formats (``fmt``, rows of ``D`` values; a flat row r lives in block r // B at offset
r % B, B = ``rows_per_block``, blocks ``block_stride`` elements apart):

* ``"bf16"``: [blocks, B, D] bf16 (the ``auto`` / ``bf16`` index formats of a bf16 layer); read
  with :func:`dsv4.kernels.sparse_mqa._fetch_rows`.
* ``"fp8"``: uint8, blocks ``keys.stride(0)`` bytes apart (the store's own [blocks, B, row_bytes]
  view, or [blocks, block_bytes]); per block B rows of D e4m3 bytes, then B rows of D/128
  little-endian float32 scales (:class:`dsv4.cache.formats.IndexFp8Format`).
* ``"fp4"``: uint8 likewise; per block B rows of D/2 bytes of E2M1 nibbles (element
  2i low, 2i+1 high), then B rows of D/32 UE8M0 bytes (:class:`dsv4.cache.formats.
  IndexFp4Format`).

The score MMA takes the key tile as its left operand, [BN entries, D] x [D, heads]: on sm_90 the
keys are dequantised straight into the wgmma's register operand (only their raw bytes pass
through shared memory, for the layout change), the query's heads sit in shared memory once per
program, and the sum over heads runs along each row of the accumulator, inside a warp. With the
heads on the left ([heads, D] x [D, BN], until d61917b) every tile's dequantised keys were
written to shared memory as the right operand and the head sum crossed the program's warps
through shared memory: 12-21 % slower in the probe, and a Flash C4 verify step at 64K, M = 16,
1 + 3 tokens took 420.3 us against 386.7 (H100, 2026-12-06, ``score-keys-rows/``).

Numerics: dequantised keys are exact in bf16 (e4m3 or e2m1 times a power of two), so on a GPU
q [bf16] . K runs as a bf16 MMA with exact products and fp32 accumulation; the ReLU, the head
weights and the sum over heads are fp32. Under the CPU interpreter the MMA runs on fp32 operands
(its bf16 dot is wrong on this install). Scores differ from the torch path's only in summation
order (~1e-7 relative), so selections agree except where two scores are that close; exact ties
(equal keys, zero queries) stay exact ties and follow the tie rule.

Limits: ``indexer_topk`` is meant for decode-sized steps (the layer takes it for at most
``KERNEL_MAX_TOKENS`` queries, or at most ``VERIFY_MAX_TOKENS`` per sequence; larger steps share
one sequence's keys between many queries, which the torch path's GEMMs do better). The score
workspace is [queries, width] fp32, in chunks of queries that fit ``workspace_bytes`` (at least
one query: 1 MiB at width 256K).
Nothing syncs with the host and every shape comes from the host's arguments, so a step can be
captured in a CUDA graph (the workspace comes from the caching allocator).
"""

from __future__ import annotations

import torch

from dsv4.cache.formats import DenseFormat, IndexFp4Format, IndexFp8Format, RowFormat
from dsv4.kernels.bound_launch import launch
from dsv4.kernels.launch import _INTERPRET, pdl_args, triton_available
from dsv4.kernels.sparse_mqa import _n_sm

__all__ = ["KERNEL_MAX_TOKENS", "VERIFY_MAX_TOKENS", "check_key_store", "index_kernel_format",
           "indexer_scores", "indexer_topk", "topk_entries", "choose_merge_block", "choose_scan",
           "choose_score_group",
           "choose_digit_bits", "choose_score_programs", "choose_split"]

FMTS = ("bf16", "fp8", "fp4")
KERNEL_MAX_TOKENS = 64
"""Steps of more queries take the torch path (prefill: its GEMMs share the keys) ..."""
VERIFY_MAX_TOKENS = 8
"""... unless no sequence brings more than this many (decode and speculative verify steps of up
to 7 drafts: each query reads its own sequence's keys, and the decode runner's fixed-shape steps
stay on this kernel, whose launches a CUDA graph can replay)."""
SCORE_BLOCK = 64
"""Entries per scoring program (one page of the default block size)."""
SCORE_PROGRAMS_PER_SM = 4
"""Scoring programs per SM (fewer: each loads its query once for more tiles; the interpreter
counts one SM, so its tests run programs of several tiles) ..."""
WIDE_SCORE_PROGRAMS_PER_SM = 8
"""... and when that many would still give each program ``WIDE_SCORE_MIN_TILES`` tiles
(:func:`choose_score_programs`)."""
WIDE_SCORE_MIN_TILES = 16
"""Tiles a program must keep for the wider grid (fewer: its query loads cost more)."""
SCORE_GROUPS = (1, 4)
"""Queries a scoring program may take (``indexer_scores``' ``group``): 8 spills at 8 and 16
warps (sm_90 compile: 64 / 192 bytes of stack; ``benchmarks/aot_sm90_regs.py steps``); 2 lost
to one query a program in the layer (:func:`choose_score_group`), so it was deleted."""
GROUP_WARPS = 8
"""Warps of a scoring program of several queries (their stacked heads and the MMA's result
are 4x one query's: with the keys on the MMA's M side 236 registers, no stack; 4 and 16
warps spill)."""
GROUP_STAGES = 2
"""A scoring group's loop fetches the next tile's keys before it scores this one (2; 0: each
tile's keys loaded where they are scored). A group's program has 8 warps at 224-255 registers,
alone on its SM, so nothing else hides its loads' latency. H100, 2026-12-06 (``benchmarks/
results/2026-12-06-h100/decode-step-verify/64k-prefetch/``), one C4 layer at 64K, M = 16, k = 3
/ 7: Flash 389.2 / 535.5 -> 374.6 / 512.1 us, Pro 497.1 / 706.5 -> 474.4 / 687.5."""
SCAN_BLOCK = 1024
"""Scores per iteration of the top-k program's passes on rows narrower than
``WIDE_SCAN_BLOCK``."""
WIDE_SCAN_BLOCK = 4096
"""... and on rows at least this wide (:func:`choose_scan`)."""
SCAN_WARPS = 8
"""Warps of the top-k program."""
MAX_SPLIT = 16
"""Most programs a top-k row may be cut into (the ``split`` override)."""
PREFERRED_SPLIT = 8
"""Programs per long top-k row where the SMs have room (:func:`choose_split`) ..."""
SPLIT_CANDIDATES_PER_SM = 1024
"""... and room: chunk programs times k, per SM, over all rows (two programs at k = 512)."""


DIGIT_BITS = 8
"""Bits of the order key each radix-select pass over a row decides (32 / DIGIT_BITS passes of
2 ** DIGIT_BITS-bin histograms) ..."""
SPLIT_DIGIT_BITS = 4
"""... and in split rows whose chunks scan ``SCAN_BLOCK`` scores an iteration
(:func:`choose_digit_bits`)."""


def choose_digit_bits(split: int, block: int) -> int:
    """Radix digit bits for a top-k launch of ``split`` programs per row scanning ``block``
    scores an iteration. H200, k = 512 (``benchmarks/topk_probe.py``, 2026-12-05; every
    variant bit-equal), us per call: 16K entries, 1 and 16 rows (8 chunks of 2048, 1024-wide
    scans, 4096-wide merge) 37.9-39.1 at 8 bits, 31.2-32.2 at 4, 38.7-39.9 at 2; one program
    on 4K entries (4096-wide scan) 21.1-22.0 at 8, 23.2-24.3 at 4, 33.9-35.6 at 2, and on 16K
    entries 64.0-64.5 at 8, 66.6-67.9 at 4. So 4 bits only where it won: split rows with
    1024-wide chunk scans; 8 elsewhere (k = 1024, 64 rows and 64K entries not probed)."""
    return SPLIT_DIGIT_BITS if split > 1 and block == SCAN_BLOCK else DIGIT_BITS


def choose_scan(width: int) -> tuple[int, int]:
    """(scores per iteration, warps) of the top-k program for rows of ``width`` entries. Each
    of its five passes over a row is a chain of iterations, each with a fixed cost (the loads'
    latency, the histogram's merge across warps through shared memory, barriers) beside its
    per-score work: fewer, wider iterations pay it less often, but a block wider than the row
    wastes its lanes. H200,
    k = 512 (``benchmarks/topk_probe.py``, 2026-12-04; every variant bit-equal): 4096 x 8 warps
    against 1024 x 8 at 4K entries 26.1 -> 20.5 us, 16K 85.5 -> 62.0, 64K 352 -> 239 (8192 x
    16: 34.2 / 61.7 / 226; 2048 x 8 and 4096 x 16 between); below 4K entries not probed."""
    return (WIDE_SCAN_BLOCK if width >= WIDE_SCAN_BLOCK else SCAN_BLOCK), SCAN_WARPS


def choose_split(width: int, topk: int, rows: int, n_sm: int) -> int:
    """Programs per top-k row (a power of two): one program's passes over a row cost about
    its length, so P programs on chunks of width / P cut that P-fold, and the row's last
    program then merges P * topk candidates, a cost that grows with P. H200, k = 512
    (``benchmarks/topk_probe.py``, 2026-12-04; each row's zero fill of ~1.8 us included,
    every variant bit-equal to one program), us per call:

    ==========  ====  =========  =====  =====  =====  ======
    entries     rows  1 program  P = 2  P = 4  P = 8  P = 16
    ==========  ====  =========  =====  =====  =====  ======
    4K          1-64  21.1-21.7  24.9   27.0   27.7   47.3
    16K         1-16  63.3       50.4   41.5   38.1   53.8
    16K         64    63.7       51.4   50.2   63.3   89.5
    64K         1-16  239-243    143    86     61-72  88-96
    64K         64    244        145    125    137    173
    ==========  ====  =========  =====  =====  =====  ======

    So: one program under 16 * topk entries (measured at 8 * topk: the split lost); else the
    largest power of two up to 8 with P^2 <= 2 * width / topk (the chunks' passes and the merge
    balanced: 8 at 16K and 64K entries for k = 512, measured best; 4 for Pro's k = 1024 at 16K
    entries, which the step ran with, unchanged within 2 %; the 2026-12-04 probe: 50.8 us, the
    best), halved while the rows' programs would hold more than ``SPLIT_CANDIDATES_PER_SM``
    candidates per SM (rows * P * topk: two programs per SM at k = 512 - at 64 rows 4, the best
    there; one at k = 1024 - at 64 rows of 16K entries 2, 62.1 us against 68.7 at 4, of 64K
    149.7 against 153.7; 2026-12-04). Between 8 and 16 * topk entries not measured."""
    if width < 16 * topk or rows >= 2 * n_sm:
        return 1
    p = 1
    while p < PREFERRED_SPLIT and (2 * p) ** 2 * topk <= 2 * width:
        p *= 2
    while p > 1 and rows * p * topk > SPLIT_CANDIDATES_PER_SM * n_sm:
        p //= 2
    return p


def choose_score_programs(n_tiles: int, rows: int, n_sm: int,
                          programs_per_sm: int | None = None) -> int:
    """Tiles per scoring program (its grid: ``rows`` x ceil(n_tiles / tiles)): about
    ``programs_per_sm`` programs per SM over all rows; by default ``WIDE_SCORE_PROGRAMS_PER_SM``
    where each program still scans at least ``WIDE_SCORE_MIN_TILES`` tiles, else
    ``SCORE_PROGRAMS_PER_SM``. H200 (``benchmarks/score_probe.py``, 2026-12-04; fp8 keys, 64
    heads, us per call, 4 / 8 per SM): 16K entries x 64 rows 112.5 / 108.8, 64K x 16 109.7 /
    107.7, 64K x 64 451.6 / 411.8 (each program 16-61 tiles at 8); where 8 per SM leaves 1-4
    tiles a program the query loads cost more: 4K x 16 9.9 / 11.5, 64K x 1 9.3 / 11.2, 16K x 16
    29.2 / 29.3, 4K x 64 28.7 / 29.4."""
    def tiles_at(per_sm: int) -> int:
        progs = max(1, min(n_tiles, -(-per_sm * n_sm // rows)))
        return -(-n_tiles // progs)
    if programs_per_sm is not None:
        return tiles_at(programs_per_sm)
    wide = tiles_at(WIDE_SCORE_PROGRAMS_PER_SM)
    return wide if wide >= WIDE_SCORE_MIN_TILES else tiles_at(SCORE_PROGRAMS_PER_SM)


def choose_score_group(tokens_per_seq: int) -> int:
    """Queries a scoring program takes (``indexer_scores``' ``group``) in a step whose longest
    sequence brings ``tokens_per_seq`` tokens: the largest of ``SCORE_GROUPS`` not above it -
    4 from 4 tokens on (a verify step of 1 + 3 or more: its queries share each key tile's table
    read, load and dequantisation and one stacked MMA), else 1. H100, one C4 layer at 64K,
    M = 16, both rules in one call (``benchmarks/results/2026-12-06-h100/decode-step-verify/
    64k-one-query-below-4/``), us at 1 + 1 / 1 + 2
    tokens: groups of 2 (the rule before) Flash 274.9 / 384.2, Pro 423.2 / 505.6; one query a
    program 270.5 / 330.6 and 413.7 / 452.0 (1 + 3 unchanged, 374.3 / 371.6 and 467.9 /
    472.2). The score probe had found the same with the next tile prefetched (16K x 16 x 2
    queries, 60.4 against 45.9 us). Groups of 4 against one query a program at 1 + 3 / 1 + 7:
    Flash 427.5 -> 421.5 and 689.8 -> 636.6 us in the step (``score-groups/``)."""
    return max(g for g in SCORE_GROUPS if g <= max(1, tokens_per_seq))


def choose_merge_block(candidates: int) -> int:
    """Candidates per iteration of the split top-k's merge (a row's last program): the scan
    width :func:`choose_scan` gives that many entries, whatever the chunks scan - a 4096-wide
    merge beside a 4096-wide chunk scan spills 80-104 bytes (8 warps, sm_90 compile) and is
    still the faster (64K entries, P = 8: 60.5 us against 70.6 with a 1024-wide merge; H200,
    2026-12-04)."""
    return choose_scan(candidates)[0]


def index_kernel_format(fmt: RowFormat) -> str:
    """The kernels' name for an index key format ("bf16", "fp8", "fp4"), or "" where they cannot
    read it (a float32 / float64 dense store, a dim that is not a power of two)."""
    d = fmt.dim
    if d < 32 or d & (d - 1):
        return ""
    if isinstance(fmt, DenseFormat):
        return "bf16" if fmt.storage_dtype == torch.bfloat16 else ""
    if isinstance(fmt, IndexFp8Format):
        return "fp8" if d >= 128 else ""
    if isinstance(fmt, IndexFp4Format):
        return "fp4"
    return ""


if triton_available():
    import triton
    import triton.language as tl

    from dsv4.kernels._float_bits import ue8m0
    from dsv4.kernels.launch import let_next_kernel_launch, wait_for_prior_kernel
    from dsv4.kernels.sparse_mqa import _fetch_rows

    if _INTERPRET:
        from dsv4.kernels._interpreter import patch_interpreter_index

        patch_interpreter_index()

    @triton.jit
    def _fetch_index_keys(st_ptr, tab_ptr, slot, stab, j, limit, max_logical, blk_stride, B,
                          D: tl.constexpr, FMT: tl.constexpr, BN: tl.constexpr):
        """The global loads of :func:`_load_index_keys`, as stored: (values, scales) of entries
        ``j`` [BN] - bf16 rows (twice), fp8 e4m3 bytes [BN, D] and float32 scales
        [BN, D / 128], or fp4 nibble bytes [BN, D / 2] and UE8M0 bytes [BN, D / 32]; zeros
        (unit scales) where not held. :func:`_index_keys_from` finishes them; apart, a tile's
        loads can be issued before the previous tile is scored."""
        logical = j // B
        seen = (j < limit) & (logical < max_logical)
        phys = tl.load(tab_ptr + slot * stab + logical, mask=seen, other=-1)
        valid = seen & (phys >= 0)
        off = j % B
        p = tl.where(valid, phys, 0).to(tl.int64)
        if FMT == 0:
            k, _, _ = _fetch_rows(st_ptr, p * B + off, valid, blk_stride, B, D, False, 0, 0, 0)
            return k, k
        elif FMT == 1:
            base = p * blk_stride
            e = tl.load(st_ptr + (base + off * D)[:, None] + tl.arange(0, D)[None, :],
                        mask=valid[:, None], other=0)
            NS: tl.constexpr = D // 128
            sp = (st_ptr + base + B * D + off * (4 * NS)).to(tl.pointer_type(tl.float32))
            sc = tl.load(sp[:, None] + tl.arange(0, NS)[None, :], mask=valid[:, None], other=0.0)
            return e, sc
        else:
            base = p * blk_stride
            HALF: tl.constexpr = D // 2
            NS4: tl.constexpr = D // 32
            b = tl.load(st_ptr + (base + off * HALF)[:, None] + tl.arange(0, HALF)[None, :],
                        mask=valid[:, None], other=0)
            sb = tl.load(st_ptr + (base + B * HALF + off * NS4)[:, None]
                         + tl.arange(0, NS4)[None, :], mask=valid[:, None], other=127)
            return b, sb

    @triton.jit
    def _index_keys_from(e, sc, D: tl.constexpr, FMT: tl.constexpr, BN: tl.constexpr,
                         DT: tl.constexpr):
        """[BN, D] keys in DT from :func:`_fetch_index_keys`' loads (fp8 and fp4 dequantised:
        exact in bf16)."""
        if FMT == 0:
            return e.to(DT)
        elif FMT == 1:
            v = e.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            NS: tl.constexpr = D // 128
            scale = tl.reshape(tl.broadcast_to(sc[:, :, None], (BN, NS, 128)), (BN, D))
            return (v * scale).to(DT)
        else:
            b = e.to(tl.int32)
            nib = tl.reshape(tl.join(b & 15, b >> 4), (BN, D))  # element 2i low, 2i + 1 high
            ex = (nib >> 1) & 3
            man = nib & 1
            # E2M1 magnitude times 2: 0, 1 (subnormal) or (2 + m) << (e - 1) (normal)
            twice = tl.where(ex == 0, man, (2 + man) << tl.maximum(ex - 1, 0))
            mag = twice.to(tl.float32) * 0.5
            val = tl.where((nib & 8) != 0, -mag, mag)
            NS4: tl.constexpr = D // 32
            scale = ue8m0(sc.to(tl.int32))
            scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BN, NS4, 32)), (BN, D))
            return (val * scale).to(DT)

    @triton.jit
    def _load_index_keys(st_ptr, tab_ptr, slot, stab, j, limit, max_logical, blk_stride, B,
                         D: tl.constexpr, FMT: tl.constexpr, BN: tl.constexpr,
                         DT: tl.constexpr):
        """[BN, D] keys in DT of entries ``j`` [BN] of the sequence in ``slot``, found through its
        block-table row; zeros for entries >= ``limit``, beyond the table or in an unheld
        block. FMT: 0 bf16, 1 fp8, 2 fp4."""
        e, sc = _fetch_index_keys(st_ptr, tab_ptr, slot, stab, j, limit, max_logical,
                                  blk_stride, B, D, FMT, BN)
        return _index_keys_from(e, sc, D, FMT, BN, DT)

    @triton.jit
    def _tile_scores(q, w, keys_ptr, tab_ptr, slot, stab, j, visible, max_logical, blk_stride,
                     B, D: tl.constexpr, FMT: tl.constexpr, BN: tl.constexpr,
                     DT: tl.constexpr, PREC: tl.constexpr):
        """[BN] fp32 scores of entries ``j`` for one query (``q`` [HP, D], head weights ``w``
        [HP] times the weight scale): sum over heads of w * relu(q . K[j]); -inf from
        ``visible`` on. Every format's keys reach the MMA as the same dequantised values (fp8:
        e4m3 x its block's scale, exact in bf16), so an fp8 store scores exactly as a bf16
        store of those keys. (Applying an fp8 row's power-of-two scale to its score instead was
        bit-equal under the interpreter but not on an H100, 2026-12-05, so it was withdrawn.)"""
        k = _load_index_keys(keys_ptr, tab_ptr, slot, stab, j, visible, max_logical,
                             blk_stride, B, D, FMT, BN, DT)
        # the keys on the MMA's M side (module docstring): the head sum runs along each row
        logits = tl.dot(k, tl.trans(q), input_precision=PREC)  # [BN, HP] fp32
        s = tl.sum(tl.maximum(logits, 0.0) * w[None, :], axis=1)
        return tl.where(j < visible, s, float("-inf"))

    @triton.jit
    def _query_heads(q_ptr, sqt, sqh, w_ptr, swt, t, weight_scale, H: tl.constexpr,
                     HP: tl.constexpr, D: tl.constexpr, DT: tl.constexpr):
        """Query ``t``'s heads [HP, D] in DT and their weights [HP] times the weight scale
        (fp32); rows from H on zero."""
        heads = tl.arange(0, HP)
        h_ok = heads < H
        q = tl.load(q_ptr + t.to(tl.int64) * sqt + heads[:, None] * sqh
                    + tl.arange(0, D)[None, :], mask=h_ok[:, None], other=0.0).to(DT)
        w = tl.load(w_ptr + t.to(tl.int64) * swt + heads, mask=h_ok, other=0.0)
        return q, w.to(tl.float32) * weight_scale

    @triton.jit
    def _group_queries(q_ptr, sqt, sqh, w_ptr, swt, s_ptr, sst, slot_ptr, pos_ptr, weight_scale,
                       z_ptr, T, H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr,
                       DT: tl.constexpr, ZERO: tl.constexpr, QG: tl.constexpr):
        """A scoring group's queries t0 = g * QG .. t0 + QG - 1 (program (g, p)): (t0, the
        lead's slot, which of them are of the lead's sequence, each one's visible entries and
        the lead's, their heads stacked [QG * HP, D] in DT - row r is head r % HP of query t0 +
        r // HP, zeros past T and H - their head weights [QG * HP] times the weight scale, and
        their score rows [QG, 1]); with ZERO, program (g, 0) zeroes their arrival counts."""
        t0 = tl.program_id(0) * QG
        ti = t0 + tl.arange(0, QG)
        t_ok = ti < T
        if ZERO:  # noqa: SIM102 - a constexpr beside a runtime test
            if tl.program_id(1) == 0:
                tl.store(z_ptr + ti, tl.zeros([QG], tl.int32), mask=t_ok)
        lead = tl.load(slot_ptr + t0)
        share = t_ok & (tl.load(slot_ptr + ti, mask=t_ok, other=-1) == lead)
        vis = tl.where(t_ok, ((tl.load(pos_ptr + ti, mask=t_ok, other=0) + 1) // 4), 0)
        vis = vis.to(tl.int32)
        vis_lead = tl.max(tl.where(share, vis, 0), axis=0)
        cols = tl.arange(0, D)
        r = tl.arange(0, QG * HP)
        r_tok = t0 + r // HP
        r_ok = (r_tok < T) & (r % HP < H)
        qs = tl.load(q_ptr + r_tok.to(tl.int64)[:, None] * sqt + (r % HP)[:, None] * sqh
                     + cols[None, :], mask=r_ok[:, None], other=0.0).to(DT)
        ws = tl.load(w_ptr + r_tok.to(tl.int64) * swt + r % HP, mask=r_ok, other=0.0)
        return (t0, lead, share, vis, vis_lead, qs, ws.to(tl.float32) * weight_scale,
                s_ptr + ti.to(tl.int64)[:, None] * sst)

    @triton.jit
    def _stacked_tile_scores(k, qs, ws, j, vis, QG: tl.constexpr, HP: tl.constexpr,
                             BN: tl.constexpr, PREC: tl.constexpr):
        """[QG, BN] fp32 scores of one key tile ``k`` [BN, D] (entries ``j``) for a group's
        stacked heads ``qs`` [QG * HP, D] with weights ``ws``; -inf from each query's ``vis``
        on. The keys sit on the MMA's M side: the head sum runs along each row."""
        logits = tl.dot(k, tl.trans(qs), input_precision=PREC)  # [BN, QG * HP]
        return _weighted_rows(logits, ws, 1.0, j, vis, QG, HP, BN)

    @triton.jit
    def _weighted_rows(logits, ws, row_scale, j, vis, QG: tl.constexpr, HP: tl.constexpr,
                       BN: tl.constexpr):
        """[QG, BN] scores from one tile's logits [BN, QG * HP]: each query's sum over its
        heads of ``ws`` times relu(logit), times ``row_scale`` (1, or [BN, 1] per entry);
        -inf from each query's ``vis`` on."""
        weighted = tl.maximum(logits, 0.0) * ws[None, :]
        s = tl.sum(tl.reshape(weighted, (BN, QG, HP)), axis=2) * row_scale
        return tl.trans(tl.where(j[:, None] < vis[None, :], s, float("-inf")))

    @triton.jit
    def _fp8_heads(qs, ws):
        """Stacked head rows ``qs`` [R, D] as e4m3 with a power-of-two scale each, 2^ceil(log2(
        amax / 448)) (exact for rows of the official FP4 or fp8 simulations, whose values are
        e2m1 / e4m3 grid points times power-of-two block scales: FP4 blocks within 2^14 of the
        row's largest block scale), and the head weights ``ws`` [R] times those scales:
        relu(s * x) = s * relu(x) for s > 0."""
        qf = qs.to(tl.float32)
        amax = tl.max(tl.abs(qf), axis=1)
        sig = tl.exp2(tl.ceil(tl.log2(tl.maximum(amax, 1e-30) / 448.0)))
        q8 = (qf / sig[:, None]).to(tl.float8e4nv)
        return q8, ws * sig

    @triton.jit
    def _fp8_tile_scores(e, sc, q8, ws, j, vis, QG: tl.constexpr, HP: tl.constexpr,
                         BN: tl.constexpr):
        """:func:`_stacked_tile_scores` of one page's e4m3 key bytes ``e`` [BN, 128] (uint8)
        with their scales ``sc`` [BN] against e4m3 head rows ``q8`` (weights ``ws`` carrying
        the rows' scales): one fp8 MMA, fp32 accumulation, the key scales applied to the
        weighted head sums."""
        logits = tl.dot(e.to(tl.float8e4nv, bitcast=True), tl.trans(q8))  # [BN, QG * HP]
        return _weighted_rows(logits, ws, sc[:, None], j, vis, QG, HP, BN)

    @triton.jit
    def _stray_queries_tile(q_ptr, sqt, sqh, w_ptr, swt, s_ptr, sst, keys_ptr, blk_stride,
                            tab_ptr, stab, max_logical, slot_ptr, pos_ptr, width, B,
                            weight_scale, T, t0, lead, jb, H: tl.constexpr, HP: tl.constexpr,
                            D: tl.constexpr, BN: tl.constexpr, FMT: tl.constexpr,
                            DT: tl.constexpr, PREC: tl.constexpr, QG: tl.constexpr):
        """Tile ``jb`` of the group's queries that are not of the lead's sequence (groups need
        not align with sequences): each scores it alone, through its own block table."""
        j = jb * BN + tl.arange(0, BN)
        for u in tl.static_range(QG):
            t = t0 + u
            if t < T:
                slot = tl.load(slot_ptr + t)
                if slot != lead:  # another sequence's query: its own keys
                    visible = ((tl.load(pos_ptr + t) + 1) // 4).to(tl.int32)
                    if jb * BN < visible:
                        q, w = _query_heads(q_ptr, sqt, sqh, w_ptr, swt, t, weight_scale,
                                            H, HP, D, DT)
                        su = _tile_scores(q, w, keys_ptr, tab_ptr, slot.to(tl.int64), stab,
                                          j, visible, max_logical, blk_stride, B, D, FMT,
                                          BN, DT, PREC)
                    else:
                        su = tl.full([BN], float("-inf"), tl.float32)
                    tl.store(s_ptr + t.to(tl.int64) * sst + j, su, mask=j < width)

    @triton.jit
    def _group_scores(q_ptr, sqt, sqh, w_ptr, swt, s_ptr, sst, keys_ptr, blk_stride,
                      tab_ptr, stab, max_logical, slot_ptr, pos_ptr, width, tiles, B,
                      weight_scale, z_ptr, T, H: tl.constexpr, HP: tl.constexpr,
                      D: tl.constexpr, BN: tl.constexpr, FMT: tl.constexpr, DT: tl.constexpr,
                      PREC: tl.constexpr, ZERO: tl.constexpr, QG: tl.constexpr,
                      PREFETCH: tl.constexpr):
        """:func:`_score_kernel`'s program (g, p) for QG queries t0 = g * QG .. t0 + QG - 1:
        the queries of the lead's sequence (t0's slot; a verify step's 1 + k tokens sit next to
        each other) share each tile's keys - one block-table read, one load and one
        dequantisation - and one MMA of their stacked heads [QG * HP, D] against them; a query
        of another sequence in the group (groups need not align with sequences) scores the
        tile on its own after. The same scores as one query a program, up to the summation
        order of the wider product."""
        t0, lead, share, vis, vis_lead, qs, ws, rows = _group_queries(
            q_ptr, sqt, sqh, w_ptr, swt, s_ptr, sst, slot_ptr, pos_ptr, weight_scale, z_ptr, T,
            H, HP, D, DT, ZERO, QG)
        first = tl.program_id(1) * tiles
        # PREFETCH: tile i + 1's key loads issued before tile i is scored (a program of 4
        # queries is alone on its SM: nothing else hides its load latency)
        if PREFETCH:
            mine = tl.minimum(vis_lead, (first + tiles) * BN)
            e, sc = _fetch_index_keys(keys_ptr, tab_ptr, lead.to(tl.int64), stab,
                                      first * BN + tl.arange(0, BN), mine, max_logical,
                                      blk_stride, B, D, FMT, BN)
        for i in range(0, tiles):
            jb = first + i
            j = jb * BN + tl.arange(0, BN)
            if PREFETCH:
                e_next, sc_next = _fetch_index_keys(keys_ptr, tab_ptr, lead.to(tl.int64), stab,
                                                    j + BN, mine, max_logical, blk_stride, B,
                                                    D, FMT, BN)
            if jb * BN < vis_lead:
                if PREFETCH:
                    k = _index_keys_from(e, sc, D, FMT, BN, DT)
                else:
                    k = _load_index_keys(keys_ptr, tab_ptr, lead.to(tl.int64), stab, j,
                                         vis_lead, max_logical, blk_stride, B, D, FMT, BN, DT)
                s = _stacked_tile_scores(k, qs, ws, j, vis, QG, HP, BN, PREC)
            else:
                s = tl.full([QG, BN], float("-inf"), tl.float32)
            tl.store(rows + j[None, :], s, mask=share[:, None] & (j < width)[None, :])
            _stray_queries_tile(q_ptr, sqt, sqh, w_ptr, swt, s_ptr, sst, keys_ptr, blk_stride,
                                tab_ptr, stab, max_logical, slot_ptr, pos_ptr, width, B,
                                weight_scale, T, t0, lead, jb, H, HP, D, BN, FMT, DT, PREC, QG)
            if PREFETCH:
                e, sc = e_next, sc_next

    @triton.jit(do_not_specialize=["width", "tiles", "T"])
    def _score_kernel(q_ptr, sqt, sqh, w_ptr, swt, s_ptr, sst, keys_ptr, blk_stride,
                      tab_ptr, stab, max_logical, slot_ptr, pos_ptr, width, tiles, B,
                      weight_scale, z_ptr, T, H: tl.constexpr, HP: tl.constexpr,
                      D: tl.constexpr, BN: tl.constexpr, FMT: tl.constexpr, DT: tl.constexpr,
                      PREC: tl.constexpr, ZERO: tl.constexpr = False,
                      PIPE: tl.constexpr = 0, QG: tl.constexpr = 1,
                      PDL: tl.constexpr = False):
        """Program (t, p): query t's entries of tiles p * tiles .. p * tiles + tiles - 1; with
        ZERO, program (t, 0) also sets ``z[t]`` to 0 (the split top-k's arrival count). PIPE
        > 0: the tiles holding visible entries in a loop of their own, software-pipelined over
        PIPE stages (no branch inside it), then the rest written -inf (the same scores).
        QG > 1: program (g, p) scores queries g * QG .. g * QG + QG - 1 (of ``T``) together
        (:func:`_group_scores`)."""
        wait_for_prior_kernel(PDL)
        if QG > 1:
            _group_scores(q_ptr, sqt, sqh, w_ptr, swt, s_ptr, sst, keys_ptr, blk_stride,
                          tab_ptr, stab, max_logical, slot_ptr, pos_ptr, width, tiles, B,
                          weight_scale, z_ptr, T, H, HP, D, BN, FMT, DT, PREC, ZERO, QG,
                          PIPE > 0)
        else:
            t = tl.program_id(0)
            if ZERO:  # noqa: SIM102 - a constexpr beside a runtime test
                if tl.program_id(1) == 0:
                    tl.store(z_ptr + t, 0)
            visible = ((tl.load(pos_ptr + t) + 1) // 4).to(tl.int32)
            slot = tl.load(slot_ptr + t).to(tl.int64)
            q, w = _query_heads(q_ptr, sqt, sqh, w_ptr, swt, t, weight_scale, H, HP, D, DT)
            if PIPE > 0:
                first = tl.program_id(1) * tiles
                # tiles of this program that hold a visible entry: 0 .. n_vis - 1
                n_vis = tl.minimum(tl.maximum((visible + BN - 1) // BN - first, 0), tiles)
                for i in tl.range(0, n_vis, num_stages=PIPE):
                    j = (first + i) * BN + tl.arange(0, BN)
                    s = _tile_scores(q, w, keys_ptr, tab_ptr, slot, stab, j, visible, max_logical,
                                     blk_stride, B, D, FMT, BN, DT, PREC)
                    tl.store(s_ptr + t.to(tl.int64) * sst + j, s, mask=j < width)
                for i in range(n_vis, tiles):
                    j = (first + i) * BN + tl.arange(0, BN)
                    tl.store(s_ptr + t.to(tl.int64) * sst + j, tl.full([BN], float("-inf"),
                                                                       tl.float32), mask=j < width)
            else:
                for i in range(0, tiles):
                    jb = tl.program_id(1) * tiles + i
                    j = jb * BN + tl.arange(0, BN)
                    if jb * BN < visible:
                        s = _tile_scores(q, w, keys_ptr, tab_ptr, slot, stab, j, visible,
                                         max_logical, blk_stride, B, D, FMT, BN, DT, PREC)
                    else:
                        s = tl.full([BN], float("-inf"), tl.float32)
                    tl.store(s_ptr + t.to(tl.int64) * sst + j, s, mask=j < width)
        let_next_kernel_launch(PDL)

    @triton.jit(do_not_specialize=["width", "tiles", "T"])
    def _page_score_kernel(q_ptr, sqt, sqh, w_ptr, swt, s_ptr, sst, vals, scales, keys_ptr,
                           blk_stride, tab_ptr, stab, max_logical, slot_ptr, pos_ptr, width,
                           tiles, B, weight_scale, z_ptr, T, H: tl.constexpr,
                           HP: tl.constexpr, D: tl.constexpr, BN: tl.constexpr,
                           DT: tl.constexpr, PREC: tl.constexpr, ZERO: tl.constexpr,
                           QG: tl.constexpr, STAGES: tl.constexpr, F8: tl.constexpr = False,
                           PDL: tl.constexpr = False):
        """:func:`_score_kernel` on an fp8 store whose tiles are its pages (``BN`` = rows a
        block): program (g, p) scores queries g * QG .. g * QG + QG - 1 over tiles p * tiles
        .. p * tiles + tiles - 1 of the lead's sequence, each tile's e4m3 bytes and scales
        copied by the tensor-memory accelerator (``vals`` [blocks, BN, D] and ``scales``
        [blocks, BN * D / 128] descriptors) into shared memory STAGES-deep ahead of the MMA, at
        the block-table entry's page (-1, an unheld block: zeros, as the gather reads). The
        same dequantised keys and MMA as :func:`_group_scores`; a query of another sequence
        in the group scores its tiles after, through the gather path. F8 (D = 128, one query a
        program): the keys' e4m3 bytes go to an fp8 MMA as stored, against each head row
        quantised to e4m3 with a power-of-two scale (:func:`_fp8_heads`); both scales,
        positive, multiply after it."""
        wait_for_prior_kernel(PDL)
        t0, lead, share, vis, vis_lead, qs, ws, rows = _group_queries(
            q_ptr, sqt, sqh, w_ptr, swt, s_ptr, sst, slot_ptr, pos_ptr, weight_scale, z_ptr, T,
            H, HP, D, DT, ZERO, QG)
        if F8:
            q8, ws = _fp8_heads(qs, ws)
        first = tl.program_id(1) * tiles
        n_vis = tl.minimum(tl.maximum((vis_lead + BN - 1) // BN - first, 0), tiles)
        tab = tab_ptr + lead.to(tl.int64) * stab
        NS: tl.constexpr = D // 128
        for i in tl.range(0, n_vis, num_stages=STAGES):
            jb = first + i
            page = tl.load(tab + jb, mask=jb < max_logical, other=-1)
            e = tl.reshape(vals.load([page, 0, 0]), (BN, D))
            sc = tl.reshape(scales.load([page, 0]), (BN, NS))
            j = jb * BN + tl.arange(0, BN)
            if F8:
                s = _fp8_tile_scores(e, tl.reshape(sc, (BN,)), q8, ws, j, vis, QG, HP, BN)
            else:
                k = _index_keys_from(e, sc, D, 1, BN, DT)  # as the gather's fp8 keys
                s = _stacked_tile_scores(k, qs, ws, j, vis, QG, HP, BN, PREC)
            tl.store(rows + j[None, :], s, mask=share[:, None] & (j < width)[None, :])
        for i in range(n_vis, tiles):
            j = (first + i) * BN + tl.arange(0, BN)
            tl.store(rows + j[None, :], tl.full([QG, BN], float("-inf"), tl.float32),
                     mask=share[:, None] & (j < width)[None, :])
        if QG > 1:  # queries of other sequences in the group: their own keys, gathered
            for i in range(0, tiles):
                _stray_queries_tile(q_ptr, sqt, sqh, w_ptr, swt, s_ptr, sst, keys_ptr,
                                    blk_stride, tab_ptr, stab, max_logical, slot_ptr, pos_ptr,
                                    width, B, weight_scale, T, t0, lead, first + i, H, HP, D,
                                    BN, 1, DT, PREC, QG)
        let_next_kernel_launch(PDL)

    @triton.jit
    def _order_key(x):
        """int32 keys ordered as the fp32 values ``x`` (non-NaN), with -0.0 equal to +0.0."""
        b = x.to(tl.int32, bitcast=True)
        b = tl.where(b == -2147483648, 0, b)
        return b ^ ((b >> 31) & 0x7FFFFFFF)

    @triton.jit
    def _digit_histogram(u, m, prefix, level: tl.constexpr, DB: tl.constexpr):
        """Histogram of the DB-bit digit ``level`` (from the top) of the unsigned-order keys
        ``u`` (mask ``m``) whose higher digits equal ``prefix``'s."""
        shift: tl.constexpr = 32 - DB * (level + 1)
        if level > 0:  # the digits above this one equal the prefix's
            m = m & ((u >> (shift + DB)) == (prefix >> (shift + DB)))
        return tl.histogram((u >> shift) & ((1 << DB) - 1), 1 << DB, mask=m)

    @triton.jit
    def _radix_select(row, visible, need, lanes, BLOCK: tl.constexpr, DB: tl.constexpr,
                      cand=None, MASKED: tl.constexpr = False):
        """(prefix, need): the ``need``-th largest order key of the row's ``visible`` scores as
        an unsigned-order prefix (key ^ sign bit), and how many of the entries equal to it are
        still to be taken; up to 32 / DB passes of DB-bit histograms from the top. The passes
        stop early once every entry of the prefix's bin is needed: the prefix's lower bits
        stay zero and ``need`` counts the whole bin, so the take (entries above the prefix,
        then up to ``need`` equal to it) takes the same entries. With MASKED the row is a
        split row's candidate scores, written by other programs (read through L2), and those
        whose entry ``cand[j]`` is -1 (no candidate) do not count."""
        bins = tl.arange(0, 1 << DB)
        prefix = need * 0
        done = need * 0
        for level in tl.static_range(32 // DB):
            if done == 0:
                hist = tl.zeros([1 << DB], tl.int32)
                for c in range(0, visible, BLOCK):
                    offs = c + lanes
                    m = offs < visible
                    if MASKED:
                        x = tl.load(row + offs, mask=m, other=0.0, cache_modifier=".cg")
                        m = m & (tl.load(cand + offs, mask=m, other=-1,
                                         cache_modifier=".cg") >= 0)
                    else:
                        x = tl.load(row + offs, mask=m, other=0.0)
                    u = _order_key(x) ^ -2147483648
                    hist += _digit_histogram(u, m, prefix, level, DB)
                digit, need, done = _pick_digit(hist, bins, need)
                prefix = prefix | (digit << (32 - DB * (level + 1)))
        return prefix, need

    @triton.jit
    def _radix_select_held(u, m, need, DB: tl.constexpr):
        """:func:`_radix_select` on keys already in registers: ``u`` unsigned-order keys, mask
        ``m``."""
        bins = tl.arange(0, 1 << DB)
        prefix = need * 0
        done = need * 0
        for level in tl.static_range(32 // DB):
            if done == 0:
                digit, need, done = _pick_digit(_digit_histogram(u, m, prefix, level, DB),
                                                bins, need)
                prefix = prefix | (digit << (32 - DB * (level + 1)))
        return prefix, need

    @triton.jit
    def _pick_digit(hist, bins, need):
        """(digit, need, whole): the bin of ``hist`` that holds the need-th largest entry, how
        many of that bin's entries are still needed once every entry of a larger bin is taken,
        and 1 where that is all of them (no later pass can change what is taken), else 0."""
        at_or_above = tl.cumsum(hist, axis=0, reverse=True)  # entries of this digit or larger
        # the largest digit with at least ``need`` entries at or above it, in the high bits;
        # the low bit: exactly ``need`` there (the whole bin is needed)
        found = tl.max(tl.where(at_or_above >= need,
                                2 * bins + (at_or_above == need).to(tl.int32), -1), axis=0)
        digit = found >> 1
        above = tl.sum(tl.where(bins == digit, at_or_above - hist, 0), axis=0)
        return digit, need - above, found & 1

    @triton.jit
    def _taking(taken, ties, key, m, kth, need):
        """Which of a chunk's entries (keys ``key``, mask ``m``) to take, in order: those whose
        key is above ``kth``, and those equal to it while fewer than ``need`` equal ones
        (``ties`` so far) were seen. Returns (take mask, each taken one's slot after
        ``taken``, the new taken, the new ties)."""
        eq = m & (key == kth)
        eq_i = eq.to(tl.int32)
        take = (m & (key > kth)) | (eq & (ties + tl.cumsum(eq_i, axis=0) - eq_i < need))
        take_i = take.to(tl.int32)
        return (take, taken + tl.cumsum(take_i, axis=0) - take_i, taken + tl.sum(take_i, axis=0),
                ties + tl.sum(eq_i, axis=0))

    @triton.jit
    def _take_chunk(out, taken, ties, idx, key, m, kth, need):
        """Append to ``out`` (after ``taken``) the chunk's entries ``idx`` :func:`_taking`
        takes; returns the new (taken, ties)."""
        take, dst, taken, ties = _taking(taken, ties, key, m, kth, need)
        tl.store(out + dst, idx.to(tl.int64), mask=take)
        return taken, ties

    @triton.jit
    def _take_candidates(cand, cscore, first, taken, ties, idx, x, key, m, kth, need):
        """:func:`_take_chunk` into a split row's candidate slots from ``first`` on: the entries
        ``idx`` (int32) in ``cand``, their scores ``x`` at the same places in ``cscore``."""
        take, dst, taken, ties = _taking(taken, ties, key, m, kth, need)
        tl.store(cand + first + dst, idx, mask=take)
        tl.store(cscore + first + dst, x, mask=take)
        return taken, ties

    @triton.jit
    def _write_taken(row, out, take_n, K: tl.constexpr, KP: tl.constexpr, SORT: tl.constexpr,
                     BY_INDEX: tl.constexpr):
        """``out[:take_n]`` holds the taken entries (written by this program): order them -
        ``SORT``: by score descending, equal scores by ascending entry index; else with
        ``BY_INDEX`` by ascending index (else they are in that order already) - and pad the
        rest of the K slots with -1."""
        slots = tl.arange(0, KP)
        if SORT or BY_INDEX:
            tl.debug_barrier()
            got = slots < take_n
            # written by other threads of this program: read through L2 (".cg"), not L1
            idx = tl.load(out + slots, mask=got, other=0, cache_modifier=".cg").to(tl.int32)
            if SORT:
                key = _order_key(tl.load(row + idx, mask=got, other=0.0)).to(tl.int64)
                packed = (key << 32) | (2147483647 - idx).to(tl.int64)
            else:
                packed = (2147483647 - idx).to(tl.int64)
            packed = tl.where(got, packed, -9223372036854775808)
            packed = tl.sort(packed, descending=True)
            idx = tl.where(slots < take_n, 2147483647 - packed.to(tl.int32), -1)
            tl.store(out + slots, idx.to(tl.int64), mask=slots < K)
        else:
            tl.store(out + slots, tl.full([KP], -1, tl.int64), mask=(slots >= take_n) & (slots < K))

    @triton.jit(do_not_specialize=["width"])
    def _topk_kernel(s_ptr, sst, pos_ptr, o_ptr, sot, width, K: tl.constexpr,
                     KP: tl.constexpr, BLOCK: tl.constexpr, SORT: tl.constexpr,
                     DB: tl.constexpr = 8, HELD: tl.constexpr = False,
                     PDL: tl.constexpr = False):
        """Program t: query t's top K (module docstring); ``HELD``: the row (``width``) fits
        one block of BLOCK scores, read once into registers."""
        wait_for_prior_kernel(PDL)
        t = tl.program_id(0)
        row = s_ptr + t.to(tl.int64) * sst
        out = o_ptr + t.to(tl.int64) * sot
        visible = tl.minimum(((tl.load(pos_ptr + t) + 1) // 4).to(tl.int32), width)
        take_n = tl.minimum(visible, K)
        lanes = tl.arange(0, BLOCK)
        # radix select, DB bits a pass from the top, on u = key ^ sign bit (unsigned order): the
        # take_n-th largest key is ``prefix``; ``need`` of the entries equal to it are taken.
        # With every visible entry taken (visible <= K: short contexts) the passes are skipped:
        # prefix 0 is the lowest key, which no score has (it is a NaN's), so all are above it
        prefix = take_n * 0
        need = take_n
        if HELD:  # the row fits one block: loaded once, every pass and the compaction on it
            m = lanes < visible
            key = _order_key(tl.load(row + lanes, mask=m, other=0.0))
            if visible > K:
                prefix, need = _radix_select_held(key ^ -2147483648, m, need, DB)
            _take_chunk(out, take_n * 0, take_n * 0, lanes, key, m, prefix ^ -2147483648,
                        need)
        else:
            if visible > K:
                prefix, need = _radix_select(row, visible, need, lanes, BLOCK, DB)
            kth = prefix ^ -2147483648
            # compaction: every entry above the k-th key, then the lowest-indexed equal ones
            taken = take_n * 0
            ties = take_n * 0
            for c in range(0, visible, BLOCK):
                offs = c + lanes
                m = offs < visible
                key = _order_key(tl.load(row + offs, mask=m, other=0.0))
                # (what _take_chunk does, inline: through the helper this kernel spilled 8
                # bytes at 4096-score iterations, sm_90; at 2f8453c it does not, but holds
                # 172 registers against 128 inline, not timed)
                eq = m & (key == kth)
                eq_i = eq.to(tl.int32)
                take = ((m & (key > kth))
                        | (eq & (ties + tl.cumsum(eq_i, axis=0) - eq_i < need)))
                take_i = take.to(tl.int32)
                dst = taken + tl.cumsum(take_i, axis=0) - take_i
                tl.store(out + dst, offs.to(tl.int64), mask=take)
                taken += tl.sum(take_i, axis=0)
                ties += tl.sum(eq_i, axis=0)
        _write_taken(row, out, take_n, K, KP, SORT, False)
        let_next_kernel_launch(PDL)

    @triton.jit(do_not_specialize=["width", "chunk"])
    def _topk_split_kernel(s_ptr, sst, pos_ptr, o_ptr, sot, c_ptr, sct, arr_ptr, width, chunk,
                           K: tl.constexpr, KP: tl.constexpr, P: tl.constexpr,
                           BLOCK: tl.constexpr, MBLOCK: tl.constexpr, SORT: tl.constexpr,
                           DB: tl.constexpr = 8, HELD: tl.constexpr = False,
                           PDL: tl.constexpr = False):
        """Program (t, c): the top K of query t's visible entries among c * chunk .. c * chunk +
        chunk - 1 into the row's K candidate slots of chunk c (ascending entry index, -1 pads),
        each with its score in the row's score half of the workspace; then it counts itself in
        ``arr[t]`` (zero before the launch), and the row's last program to arrive merges the
        row's P * K candidates into its K entries - from registers where they fit one merge
        block (``MBLOCK``): one read of them for every radix pass - and sets the count back to
        zero (a held counter tensor serves the next launch). Any entry of
        the row's top K is in its chunk's top K (the same order: score, then lower index), so
        the selection is the one-program kernel's."""
        wait_for_prior_kernel(PDL)
        t = tl.program_id(0)
        c = tl.program_id(1)
        row = s_ptr + t.to(tl.int64) * sst
        cand = c_ptr + t.to(tl.int64) * sct
        visible = tl.minimum(((tl.load(pos_ptr + t) + 1) // 4).to(tl.int32), width)
        lo = c * chunk
        n = tl.maximum(tl.minimum(visible - lo, chunk), 0)
        take_n = tl.minimum(n, K)
        lanes = tl.arange(0, BLOCK)
        prefix = take_n * 0
        need = take_n
        # the candidates' scores beside their entries, [P * K] float32 after the [P * K] int32
        # indices: the merge reads them in one coalesced load, not through the indices
        cscore = (cand + P * K).to(tl.pointer_type(tl.float32))
        slots = cand + c * K
        if HELD:  # the chunk fits one block: loaded once, every pass and the take on it
            m = lanes < n
            x = tl.load(row + lo + lanes, mask=m, other=0.0)
            key = _order_key(x)
            if n > K:
                prefix, need = _radix_select_held(key ^ -2147483648, m, need, DB)
            _take_candidates(cand, cscore, c * K, take_n * 0, take_n * 0, lo + lanes, x, key,
                             m, prefix ^ -2147483648, need)
        else:
            if n > K:
                prefix, need = _radix_select(row + lo, n, need, lanes, BLOCK, DB)
            kth = prefix ^ -2147483648
            taken = take_n * 0
            ties = take_n * 0
            for i in range(0, n, BLOCK):
                offs = i + lanes
                m = offs < n
                x = tl.load(row + lo + offs, mask=m, other=0.0)
                taken, ties = _take_candidates(cand, cscore, c * K, taken, ties, lo + offs, x,
                                               _order_key(x), m, kth, need)
        ks = tl.arange(0, KP)
        tl.store(slots + ks, tl.full([KP], -1, tl.int32), mask=(ks >= take_n) & (ks < K))
        # every thread's candidates written before the count (the release), and the merging
        # program reads the others' after it (the acquire)
        tl.debug_barrier()
        arrived = tl.atomic_add(arr_ptr + t, 1, sem="acq_rel", scope="gpu")
        if arrived == P - 1:
            out = o_ptr + t.to(tl.int64) * sot
            total = tl.minimum(visible, K)
            mprefix = total * 0
            mneed = total
            if P * K <= MBLOCK:  # every candidate in registers: one read for all the passes
                v = tl.arange(0, MBLOCK)
                idx = tl.load(cand + v, mask=v < P * K, other=-1, cache_modifier=".cg")
                mv = idx >= 0
                mkey = _order_key(tl.load(cscore + v, mask=mv, other=0.0,
                                          cache_modifier=".cg"))
                if visible > K:
                    mprefix, mneed = _radix_select_held(mkey ^ -2147483648, mv, mneed, DB)
                _take_chunk(out, total * 0, total * 0, idx, mkey, mv, mprefix ^ -2147483648,
                            mneed)
            else:
                mlanes = tl.arange(0, MBLOCK)
                if visible > K:
                    mprefix, mneed = _radix_select(cscore, P * K, mneed, mlanes, MBLOCK, DB,
                                                   cand, True)
                mkth = mprefix ^ -2147483648
                taken = total * 0
                ties = total * 0
                for i in range(0, P * K, MBLOCK):
                    v = i + mlanes
                    idx = tl.load(cand + v, mask=v < P * K, other=-1, cache_modifier=".cg")
                    mv = idx >= 0
                    mkey = _order_key(tl.load(cscore + v, mask=mv, other=0.0,
                                              cache_modifier=".cg"))
                    taken, ties = _take_chunk(out, taken, ties, idx, mkey, mv, mkth, mneed)
            _write_taken(row, out, total, K, KP, SORT, False)
            tl.store(arr_ptr + t, 0)  # every program of the row has counted: zero for reuse
        let_next_kernel_launch(PDL)


def _check_available(device: torch.device) -> None:
    if not (triton_available() and (device.type == "cuda" or _INTERPRET)):
        raise RuntimeError("the indexer kernels need Triton and a CUDA device (or "
                           "TRITON_INTERPRET=1); use Indexer.select_paged elsewhere")


def check_key_store(keys: torch.Tensor, fmt: str, d: int) -> None:
    """Raise ValueError unless ``keys`` is an index key store the kernels read in format
    ``fmt`` with rows of ``d`` values (bf16 [blocks, B, d] contiguous rows; fp8 / fp4 uint8
    bytes with a block stride of a multiple of 4 bytes)."""
    if fmt == "bf16" and (keys.dtype != torch.bfloat16 or keys.dim() != 3
                          or keys.stride(2) != 1 or keys.stride(1) != d):
        raise ValueError(f"a bf16 key store must be [blocks, B, {d}] with contiguous rows")
    if fmt != "bf16" and (keys.dtype != torch.uint8 or keys.stride(-1) != 1
                          or keys.stride(0) % 4):
        raise ValueError(f"an {fmt} key store must be uint8 with contiguous bytes and a block "
                         "stride that is a multiple of 4 bytes")


PAGE_ROWS = 64
"""Rows a block of the stores ``indexer_scores(tma=True)`` copies: pages of 16 rows faulted on
an H100 (2026-12-07, one query a program: "misaligned address"; groups of 4 passed, but there
each program had one tile). Likely cause, not confirmed on a GPU: a 16-row page's scales are a
64-byte copy, and the pipeline's second buffer for them then sits 64 bytes into shared memory,
where the TMA's destination wants 128-byte alignment (the sm_90 compile's buffers: 3 x 1 x 16
float32). 64 is the default block size and the one timed."""
PAGE_STAGES = 5
"""Pipeline stages of the page-copy score loop (``indexer_scores(tma=True)``): Triton 3.6's
pipeliner keeps 2 pages in flight at 5 and 6, 3 at 7 (the block-table read ahead of each copy
takes stages of its own; sm_90 compile). H100, 2026-12-07 (``benchmarks/results/2026-12-07-h100/
score-tma/``), 16 sequences, us at 7 / 5 stages: 16K entries, 1 query each 19.98 / 18.51, 4
queries each 54.89 / 54.27; 64K entries 60.79 / 58.85, 213.55 / 212.29."""


def page_copies_apply(keys: torch.Tensor, fmt: str, rows_per_block: int, d: int) -> bool:
    """Whether :func:`indexer_topk` scores by page copies (``indexer_scores(tma=True)``, one query
    a program) on this store: an fp8 store of ``PAGE_ROWS``-row blocks of 128 or 256 values a
    row, 16-byte aligned, on a CUDA device. H100, 2026-12-07, one C4 layer at 64K, M = 16
    (``benchmarks/results/2026-12-07-h100/decode-step-verify/64k-page-copies-fp8/``), us at
    k = 0 / 3 gathered (queries of a verify step in groups of 4) against page copies: Flash
    197.4 / 353.9 -> 187.5 / 325.9, Pro 306.2 / 448.5 -> 296.1 / 419.6."""
    return (fmt == "fp8" and keys.is_cuda and rows_per_block == PAGE_ROWS
            and d % 128 == 0 and d <= 256 and keys.stride(0) % 16 == 0
            and keys.data_ptr() % 16 == 0)


def _check_page_store(keys: torch.Tensor, fmt: str, rows_per_block: int, block: int | None,
                      d: int, stages: int | None) -> None:
    """Raise ValueError unless ``indexer_scores(tma=True)`` can copy the store's pages."""
    bad = []
    if fmt != "fp8":
        bad.append(f"fmt {fmt!r} (fp8 only)")
    if (block or SCORE_BLOCK) != rows_per_block:
        bad.append(f"tiles of {block or SCORE_BLOCK} entries against blocks of "
                   f"{rows_per_block} rows (a tile is a page)")
    elif rows_per_block != PAGE_ROWS:
        bad.append(f"blocks of {rows_per_block} rows ({PAGE_ROWS} only)")
    if d % 128 or d > 256:
        bad.append(f"rows of {d} values (128 or 256)")
    if keys.stride(0) % 16 or keys.data_ptr() % 16:
        bad.append(f"a block stride of {keys.stride(0)} bytes or a base address that is not "
                   "16-byte aligned")
    if stages is not None and (isinstance(stages, bool) or not isinstance(stages, int)
                               or not 1 <= stages <= 8):
        bad.append(f"stages={stages!r} (1 .. 8)")
    if bad:
        raise ValueError("indexer_scores(tma=True): " + "; ".join(bad))


def _page_descriptors(keys: torch.Tensor, rows: int, d: int, fp8_values: bool = False
                      ) -> tuple[object, object]:
    """Tensor descriptors of an fp8 store's pages: the e4m3 bytes [blocks, rows, d] (typed as
    e4m3 with ``fp8_values``: the fp8 MMA then reads the copied page from shared memory as its
    operand, where uint8 bytes pass through registers for the bitcast) and the float32 scales
    [blocks, rows * d / 128] of each block."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    nb, stride = keys.shape[0], keys.stride(0)
    vals = torch.as_strided(keys.view(torch.float8_e4m3fn) if fp8_values else keys,
                            (nb, rows, d), (stride, d, 1))
    n = nb * stride
    flat = torch.as_strided(keys, (n,), (1,))
    f32 = flat.view(torch.float32)
    ns = rows * d // 128
    scales = torch.as_strided(f32, (nb, ns), (stride // 4, 1), f32.storage_offset()
                              + rows * d // 4)
    return (TensorDescriptor(vals, list(vals.shape), list(vals.stride()), [1, rows, d]),
            TensorDescriptor(scales, list(scales.shape), list(scales.stride()), [1, ns]))


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, fmt: str,
                   rows_per_block: int, block_table: torch.Tensor, tok_slot: torch.Tensor,
                   pos: torch.Tensor, width: int, weight_scale: float,
                   out: torch.Tensor | None = None,
                   zero: torch.Tensor | None = None, block: int | None = None,
                   stages: int | None = None,
                   programs_per_sm: int | None = None, group: int | None = None,
                   num_warps: int | None = None, tma: bool = False,
                   fp8_mma: bool = False) -> torch.Tensor:
    """Scores [T, width] fp32 (-inf where invisible) of every query ``q`` [T, H, D] (bf16; head
    dims contiguous) with head weights ``weights`` [T, H] over the entries 0 .. width - 1 of its
    sequence (slot ``tok_slot`` [T], position ``pos`` [T]) in the paged store ``keys``
    (module docstring; ``block_table`` [slots, logical blocks] int32). ``zero``: a [T] int32
    tensor the same launch sets to 0 (:func:`topk_entries`' ``arrivals``). Overrides, the same
    scores at another speed (``benchmarks/score_probe.py``): ``block`` entries per tile (16 ..
    256, a power of two; default ``SCORE_BLOCK``), ``stages`` (one query a program: 0, the
    one loop with a branch per tile, the default, or 1 .. 4, the visible tiles' own loop,
    software-pipelined over that many stages; a group: 0 or 2, the next tile's keys fetched
    ahead, default ``GROUP_STAGES``), ``programs_per_sm`` (default ``SCORE_PROGRAMS_PER_SM``),
    ``group`` (queries a program, one of ``SCORE_GROUPS``, sharing each key tile where they are
    of one sequence: a verify step's 1 + k tokens; default 1), ``num_warps`` (default 4, with
    a group of more than one query ``GROUP_WARPS``) and ``tma`` (an fp8 store of ``PAGE_ROWS``-
    row blocks only: each tile, one page, copied into shared memory by the TMA,
    :func:`_page_score_kernel`; ``stages`` then counts its pipeline's stages, 1 .. 8, default
    ``PAGE_STAGES``; :func:`indexer_topk`'s choice where :func:`page_copies_apply`).
    ``fp8_mma`` (with ``tma``, rows of 128 values; :func:`indexer_topk`'s choice where the
    caller vouches for ``fp8_queries``): the page's e4m3 bytes go to an fp8 MMA as stored,
    against each query head quantised to e4m3 with a power-of-two scale - exact products where
    the queries carry the official FP4 or the fp8 simulation (docs/spec.md §6.2), otherwise a
    rounding of q - accumulated at the fp8 MMA's precision; one query a program (groups of 4
    lost, stacked on the MMA's N or looped over each copied page: H100, 2026-12-07,
    docs/performance.md, "Tried and lost")."""
    if fmt not in FMTS:
        raise ValueError(f"fmt must be one of {FMTS}, got {fmt!r}")
    if block is not None and (isinstance(block, bool) or not isinstance(block, int)
                              or not 16 <= block <= 256 or block & (block - 1)):
        raise ValueError(f"indexer_scores: block must be a power of two 16 .. 256, got "
                         f"{block!r}")
    if not tma and stages is not None and (isinstance(stages, bool)
                                           or not isinstance(stages, int)
                                           or not 0 <= stages <= 4):
        raise ValueError(f"indexer_scores: stages must be 0 .. 4, got {stages!r}")
    if programs_per_sm is not None and (isinstance(programs_per_sm, bool)
                                        or not isinstance(programs_per_sm, int)
                                        or programs_per_sm < 1):
        raise ValueError(f"indexer_scores: programs_per_sm must be an int >= 1, got "
                         f"{programs_per_sm!r}")
    if group is not None and (isinstance(group, bool) or group not in SCORE_GROUPS):
        raise ValueError(f"indexer_scores: group must be one of {SCORE_GROUPS}, got {group!r}")
    if fp8_mma and not (tma and q.shape[-1] == 128):
        raise ValueError(f"indexer_scores: fp8_mma needs tma=True and rows of 128 values, got "
                         f"tma={tma!r} and rows of {q.shape[-1]}")
    if fp8_mma and group not in (None, 1):
        raise ValueError(f"indexer_scores: fp8_mma scores one query a program, got group="
                         f"{group!r}")
    if tma:
        _check_page_store(keys, fmt, rows_per_block, block, q.shape[-1], stages)
    elif group is not None and group > 1 and stages not in (None, 0, 2):
        raise ValueError(f"indexer_scores: stages={stages} with group={group}: a group's loop "
                         "is 0 (plain) or 2 (the next tile's keys fetched ahead)")
    if num_warps is not None and (isinstance(num_warps, bool) or num_warps not in (1, 2, 4, 8,
                                                                                   16)):
        raise ValueError(f"indexer_scores: num_warps must be 1, 2, 4, 8 or 16, got "
                         f"{num_warps!r}")
    _check_available(q.device)
    t, h, d = q.shape
    s = out if out is not None else torch.empty(t, width, device=q.device,
                                                dtype=torch.float32)
    if zero is not None and (zero.dtype != torch.int32 or zero.device != q.device
                             or zero.shape != (t,) or not zero.is_contiguous()):
        raise ValueError(f"indexer_scores: zero must be a contiguous [{t}] int32 tensor on "
                         f"{q.device}, got {zero.dtype} {tuple(zero.shape)} on {zero.device}")
    if t == 0:
        return s
    if width == 0:
        if zero is not None:
            zero.zero_()
        return s
    if q.stride(2) != 1:
        q = q.contiguous()
    check_key_store(keys, fmt, d)
    table = block_table if block_table.dtype == torch.int32 else block_table.int()
    # a few programs per SM over all queries, each loading its query once for its tiles
    bn = block or SCORE_BLOCK
    n_tiles = -(-width // bn)
    n_sm = _n_sm(q.device.index or 0) if q.device.type == "cuda" else 1
    qg = group or 1
    programs = -(-t // qg)
    tiles = choose_score_programs(n_tiles, programs, n_sm, programs_per_sm)
    if tma:
        vals, scales = _page_descriptors(keys, rows_per_block, d, fp8_values=fp8_mma)
        launch(_page_score_kernel, (programs, -(-n_tiles // tiles)),
            q, q.stride(0), q.stride(1), weights, weights.stride(0), s, s.stride(0), vals,
            scales, keys, keys.stride(0), table, table.stride(0), table.shape[1], tok_slot,
            pos, width, tiles, rows_per_block, float(weight_scale),
            zero if zero is not None else s, t, H=h, HP=max(16, 1 << (h - 1).bit_length()),
            D=d, BN=bn, DT=tl.float32 if _INTERPRET else tl.bfloat16,
            PREC="ieee" if _INTERPRET else "tf32", ZERO=zero is not None, QG=qg,
            STAGES=stages or PAGE_STAGES, F8=fp8_mma,
            num_warps=num_warps or (4 if qg == 1 else GROUP_WARPS),
            **pdl_args(q.device))
        return s
    launch(_score_kernel, (programs, -(-n_tiles // tiles)),
        q, q.stride(0), q.stride(1), weights, weights.stride(0), s, s.stride(0), keys,
        keys.stride(0), table, table.stride(0), table.shape[1], tok_slot, pos, width, tiles,
        rows_per_block, float(weight_scale), zero if zero is not None else s, t,
        H=h, HP=max(16, 1 << (h - 1).bit_length()), D=d, BN=bn,
        FMT=FMTS.index(fmt), DT=tl.float32 if _INTERPRET else tl.bfloat16,
        PREC="ieee" if _INTERPRET else "tf32", ZERO=zero is not None,
        PIPE=stages if stages is not None else (GROUP_STAGES if qg > 1 else 0),
        QG=qg, num_warps=num_warps or (4 if qg == 1 else GROUP_WARPS), **pdl_args(q.device))
    return s


def topk_entries(scores: torch.Tensor, pos: torch.Tensor, topk: int, *, sort: bool = True,
                 out: torch.Tensor | None = None, block: int | None = None,
                 num_warps: int | None = None, split: int | None = None,
                 merge_block: int | None = None, digit_bits: int | None = None,
                 arrivals: torch.Tensor | None = None) -> torch.Tensor:
    """Per row of ``scores`` [T, width]: the min(topk, visible) highest-scoring of its visible
    entries j < min((pos + 1) // 4, width), ties to the lower index, as [T, topk] int64 with
    -1 pads; ``sort``: in the torch path's order (score descending, ties by index), else
    ascending entry index. ``block`` (a power of two >= 16; at least a row's width, or a split
    row's chunk, holds it in registers for every pass) and ``num_warps`` override
    :func:`choose_scan`, ``split`` (a power of two, 1 .. MAX_SPLIT) :func:`choose_split` and
    ``merge_block`` (a power of two >= 16) :func:`choose_merge_block` and ``digit_bits``
    (2, 4 or 8: the radix select's bits per pass over a row) :func:`choose_digit_bits`: the same
    selection, another speed. With a split of P > 1 each row's entries are cut into P
    chunks, one program each, and the row's last program merges their P * topk candidates
    (``_topk_split_kernel``); it counts arrivals in ``arrivals`` [T] int32, which must be zero
    when the launch starts and is zero again after it (:func:`indexer_scores` zeroes it with
    ``zero=``; a caller may also keep one zeroed tensor for all its calls on one stream; left
    out, a zeroed tensor is made - one more launch). Nonzero counts are not detected: the rows
    would not be merged."""
    for name, b in (("block", block), ("merge_block", merge_block)):
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 16
                              or b & (b - 1)):
            raise ValueError(f"topk_entries: {name} must be a power of two >= 16, got {b!r}")
    if num_warps is not None and num_warps not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"topk_entries: num_warps must be 1, 2, 4, 8, 16 or 32, got "
                         f"{num_warps!r}")
    if split is not None and (isinstance(split, bool) or not isinstance(split, int)
                              or not 1 <= split <= MAX_SPLIT or split & (split - 1)):
        raise ValueError(f"topk_entries: split must be a power of two 1 .. {MAX_SPLIT}, got "
                         f"{split!r}")
    if digit_bits is not None and (isinstance(digit_bits, bool) or digit_bits not in (2, 4, 8)):
        raise ValueError(f"topk_entries: digit_bits must be 2, 4 or 8, got {digit_bits!r}")
    _check_available(scores.device)
    t, width = scores.shape
    o = out if out is not None else torch.empty(t, topk, device=scores.device,
                                                dtype=torch.long)
    if t == 0 or topk == 0:
        return o
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    kp = max(2, 1 << (topk - 1).bit_length())
    if split is None:
        n_sm = _n_sm(scores.device.index or 0) if scores.device.type == "cuda" else 1
        split = choose_split(width, topk, t, n_sm)
    if split == 1:
        auto_block, auto_warps = choose_scan(width)
        b = block or auto_block
        launch(_topk_kernel, (t,), scores, scores.stride(0), pos, o, o.stride(0), width,
               K=topk, KP=kp, BLOCK=b, SORT=sort, DB=digit_bits or choose_digit_bits(1, b),
               HELD=width <= b, num_warps=num_warps or auto_warps, **pdl_args(scores.device))
        return o
    if arrivals is None:
        arrivals = torch.zeros(t, device=scores.device, dtype=torch.int32)
    elif (arrivals.dtype != torch.int32 or arrivals.device != scores.device
          or arrivals.shape != (t,) or not arrivals.is_contiguous()):
        raise ValueError(f"topk_entries: arrivals must be a contiguous [{t}] int32 tensor on "
                         f"{scores.device}, got {arrivals.dtype} {tuple(arrivals.shape)} on "
                         f"{arrivals.device}")
    chunk = -(-width // split)
    auto_block, auto_warps = choose_scan(chunk)
    # per row: P * topk candidate entries (int32), then their scores (float32 bits)
    cand = torch.empty(t, 2 * split * topk, device=scores.device, dtype=torch.int32)
    b = block or auto_block
    launch(_topk_split_kernel, (t, split),
        scores, scores.stride(0), pos, o, o.stride(0), cand, cand.stride(0), arrivals, width,
        chunk, K=topk, KP=kp, P=split, BLOCK=b,
        MBLOCK=merge_block or choose_merge_block(split * topk), SORT=sort,
        DB=digit_bits or choose_digit_bits(split, b), HELD=chunk <= b,
        num_warps=num_warps or auto_warps, **pdl_args(scores.device))
    return o


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, fmt: str,
                 rows_per_block: int, block_table: torch.Tensor, tok_slot: torch.Tensor,
                 pos: torch.Tensor, width: int, topk: int, weight_scale: float, *,
                 workspace_bytes: int = 256 << 20, sort: bool = True,
                 split: int | None = None, group: int | None = None,
                 tma: bool | None = None, fp8_queries: bool = False) -> torch.Tensor:
    """Top-k entries [T, topk] int64 (-1 pads) per query: :func:`indexer_scores` then
    :func:`topk_entries`, in chunks of queries whose scores fit ``workspace_bytes``. ``width``
    bounds every query's visible entries (host arithmetic, e.g. ``step.max_visible(4)``).
    ``split`` overrides :func:`choose_split`; with a split the score launch zeroes the top-k's
    arrival counts, so the step stays two launches. ``sort`` as in :func:`topk_entries`;
    ``tma``: score by page copies (default: where :func:`page_copies_apply`; they take one
    query a program, whatever ``group``); else ``group`` as in :func:`indexer_scores` (the
    query chunks then hold whole groups). ``fp8_queries``: the caller's word that every head
    row of q is exact in e4m3 with a power-of-two scale (the indexer numerics' simulation,
    docs/spec.md §6.2); the page copies of 128-value rows then score with the fp8 MMA
    (:func:`indexer_scores`' ``fp8_mma``: H100, 2026-12-07, 64K entries, 16 sequences x 4
    queries, the score launch 209.3 -> 103.7 us; docs/performance.md)."""
    t = q.shape[0]
    out = torch.empty(t, topk, device=q.device, dtype=torch.long)
    if t == 0:
        return out
    if tma is None:
        tma = page_copies_apply(keys, fmt, rows_per_block, q.shape[-1])
    if tma:
        group = 1
    fp8_mma = bool(tma) and fp8_queries and q.shape[-1] == 128
    qg = group or 1
    chunk = min(t, max(qg, workspace_bytes // max(1, 4 * width) // qg * qg))
    if split is None:
        n_sm = _n_sm(q.device.index or 0) if q.device.type == "cuda" else 1
        split = choose_split(width, topk, chunk, n_sm)
    ws = torch.empty(chunk, width, device=q.device, dtype=torch.float32)
    arrivals = (torch.empty(chunk, device=q.device, dtype=torch.int32) if split > 1 else None)
    for a in range(0, t, chunk):
        b = min(t, a + chunk)
        arr = arrivals[:b - a] if arrivals is not None else None
        s = indexer_scores(q[a:b], weights[a:b], keys, fmt, rows_per_block, block_table,
                           tok_slot[a:b], pos[a:b], width, weight_scale, out=ws[:b - a],
                           zero=arr, group=group, tma=tma, fp8_mma=fp8_mma)
        topk_entries(s, pos[a:b], topk, sort=sort, out=out[a:b], split=split, arrivals=arr)
    return out
