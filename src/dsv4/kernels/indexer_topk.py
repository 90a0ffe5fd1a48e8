"""The lightning indexer's decode selection in two Triton launches (dsv4-attention.md §5.7).

Entry point ``indexer_topk(q, weights, keys, fmt, rows_per_block, block_table, tok_slot, pos,
width, topk, weight_scale)`` -> entry indices [T, topk] int64 (-1 pads), the contract of
:meth:`dsv4.layers.indexer.Indexer.select_paged`, which is the oracle (and the path off CUDA
without Triton's interpreter):

1. **Scores** (``_score_kernel``, one program per query and run of tiles of ``SCORE_BLOCK``
   entries, about ``SCORE_PROGRAMS_PER_SM`` programs per SM over all queries):
   the entries' keys are read from the paged ``idx_keys`` store as stored (through the block
   table of the query's sequence), dequantised in registers, and
   ``score[t, j] = sum_h (w[t, h] * weight_scale) * relu(<q[t, h], K[j]>)`` in fp32 goes to a
   workspace [T, width]; -inf where j >= (pos + 1) // 4 (invisible). Tiles wholly beyond the
   query's visible entries only write -inf.
2. **Top-k** (``_topk_kernel``, one program per query): a radix select on order-preserving 32-bit
   keys of the fp32 scores (4 passes of 8-bit histograms over the visible entries; none when
   k covers every visible entry) finds the k-th largest score v and how many entries equal to
   v are still needed; a compaction pass then
   takes every entry above v and, of those equal to v, the lowest-indexed ones (the tie rule);
   a bitonic sort of the k taken entries on (score, -index) writes them in the torch path's
   order: score descending, equal scores by ascending entry index. -1 pads the rest. -0.0 and
   +0.0 count as equal (relu zeroes make many exact zeros). Opt-in, not yet timed on a GPU:
   ``method="two_level"`` (``_topk_two_level_kernel``) makes two passes over the row instead
   of five - a histogram of the top 10 bits, then a split into the entries of larger coarse
   digits (taken) and those of the k-th's coarse digit (candidates, in a workspace) - and
   resolves the other bits over the candidates only; the same selection.

Store formats (``fmt``, rows of ``D`` values; a flat row r lives in block r // B at offset
r % B, B = ``rows_per_block``, blocks ``block_stride`` elements apart):

* ``"bf16"``: [blocks, B, D] bf16 (the ``auto`` / ``bf16`` index formats of a bf16 layer); read
  with :func:`dsv4.kernels.sparse_mqa._load_rows`.
* ``"fp8"``: uint8, blocks ``keys.stride(0)`` bytes apart (the store's own [blocks, B, row_bytes]
  view, or [blocks, block_bytes]); per block B rows of D e4m3 bytes, then B rows of D/128
  little-endian float32 scales (:class:`dsv4.cache.formats.IndexFp8Format`).
* ``"fp4"``: uint8 likewise; per block B rows of D/2 bytes of E2M1 nibbles (element
  2i low, 2i+1 high), then B rows of D/32 UE8M0 bytes (:class:`dsv4.cache.formats.
  IndexFp4Format`).

Numerics: dequantised keys are exact in bf16 (e4m3 or e2m1 times a power of two), so on a GPU
q [bf16] . K runs as a bf16 MMA with exact products and fp32 accumulation; the ReLU, the head
weights and the sum over heads are fp32. Under the CPU interpreter the MMA runs on fp32 operands
(its bf16 dot is wrong on this install). Scores differ from the torch path's only in summation
order (~1e-7 relative), so selections agree except where two scores are that close; exact ties
(equal keys, zero queries) stay exact ties and follow the tie rule.

Limits: ``indexer_topk`` is meant for decode-sized steps (the layer takes it for at most
``KERNEL_MAX_TOKENS`` queries; larger steps share one sequence's keys between many queries,
which the torch path's GEMMs do better). The score workspace is [queries, width] fp32, in
chunks of queries that fit ``workspace_bytes`` (at least one query: 1 MiB at width 256K).
Nothing syncs with the host and every shape comes from the host's arguments, so a step can be
captured in a CUDA graph (the workspace comes from the caching allocator).
"""

from __future__ import annotations

import torch

from dsv4.cache.formats import DenseFormat, IndexFp4Format, IndexFp8Format, RowFormat
from dsv4.kernels.launch import _INTERPRET, pdl_args, triton_available
from dsv4.kernels.sparse_mqa import _n_sm

__all__ = ["KERNEL_MAX_TOKENS", "check_key_store", "index_kernel_format", "indexer_scores",
           "indexer_topk", "topk_entries"]

FMTS = ("bf16", "fp8", "fp4")
KERNEL_MAX_TOKENS = 64
"""Steps of more queries take the torch path (prefill: its GEMMs share the keys)."""
SCORE_BLOCK = 64
"""Entries per scoring program (one page of the default block size)."""
SCORE_PROGRAMS_PER_SM = 4
"""Scoring programs per SM (fewer: each loads its query once for more tiles; the interpreter
counts one SM, so its tests run programs of several tiles)."""
SCAN_BLOCK = 1024
"""Scores per iteration of the top-k program's passes on rows narrower than
``WIDE_SCAN_BLOCK``."""
WIDE_SCAN_BLOCK = 4096
"""... and on rows at least this wide (:func:`choose_scan`)."""
SCAN_WARPS = 8
"""Warps of the top-k program."""
TWO_LEVEL_SCAN = (1024, 16)
"""(scores per iteration, warps) of the two-level top-k program (sm_90 compile, 10 coarse bits:
64 registers; 4096 x 16 107, 2048 x 16 spills; 12 bits: 128, and 254 at 8 warps)."""
TWO_LEVEL_COARSE_BITS = 10
"""Bits of the two-level top-k's first histogram (8 .. 15). Triton builds a histogram with
one ballot per bit and, per element, work for each of a thread's bins/32 bins: 4096 bins cost
~16x what 1024 do a pass, while each bit fewer roughly doubles the candidates (1024 bins:
half-octave buckets of the scores). Untimed: ``benchmarks/topk_probe.py`` tries 10 to 12."""


def choose_scan(width: int) -> tuple[int, int]:
    """(scores per iteration, warps) of the top-k program for rows of ``width`` entries. Each
    of its five passes over a row is a chain of iterations, each with a fixed cost (the loads'
    latency, the histogram's merge across warps through shared memory, barriers) beside its
    per-score work: fewer, wider iterations pay it less often, but a block wider than the row
    wastes its lanes. H200,
    k = 512 (``benchmarks/topk_probe.py``, session 26; every variant bit-equal): 4096 x 8 warps
    against 1024 x 8 at 4K entries 26.1 -> 20.5 us, 16K 85.5 -> 62.0, 64K 352 -> 239 (8192 x
    16: 34.2 / 61.7 / 226; 2048 x 8 and 4096 x 16 between); below 4K entries not probed."""
    return (WIDE_SCAN_BLOCK if width >= WIDE_SCAN_BLOCK else SCAN_BLOCK), SCAN_WARPS


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
    from dsv4.kernels.sparse_mqa import _load_rows

    if _INTERPRET:
        from dsv4.kernels._interpreter import patch_interpreter_index

        patch_interpreter_index()

    @triton.jit
    def _load_index_keys(st_ptr, tab_ptr, slot, stab, j, limit, max_logical, blk_stride, B,
                         D: tl.constexpr, FMT: tl.constexpr, BN: tl.constexpr,
                         DT: tl.constexpr):
        """[BN, D] keys in DT of entries ``j`` [BN] of the sequence in ``slot``, found through its
        block-table row; zeros for entries >= ``limit``, beyond the table or in an unheld
        block. FMT: 0 bf16, 1 fp8, 2 fp4."""
        logical = j // B
        seen = (j < limit) & (logical < max_logical)
        phys = tl.load(tab_ptr + slot * stab + logical, mask=seen, other=-1)
        valid = seen & (phys >= 0)
        off = j % B
        cols = tl.arange(0, D)
        p = tl.where(valid, phys, 0).to(tl.int64)
        if FMT == 0:
            k = _load_rows(st_ptr, p * B + off, valid, blk_stride, B, D, False, 0, 0, 0, BN, DT)
        elif FMT == 1:
            base = p * blk_stride
            e = tl.load(st_ptr + (base + off * D)[:, None] + cols[None, :], mask=valid[:, None],
                        other=0)
            e = e.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            NS: tl.constexpr = D // 128
            sp = (st_ptr + base + B * D + off * (4 * NS)).to(tl.pointer_type(tl.float32))
            sc = tl.load(sp[:, None] + tl.arange(0, NS)[None, :], mask=valid[:, None], other=0.0)
            sc = tl.reshape(tl.broadcast_to(sc[:, :, None], (BN, NS, 128)), (BN, D))
            k = (e * sc).to(DT)
        else:
            base = p * blk_stride
            HALF: tl.constexpr = D // 2
            NS4: tl.constexpr = D // 32
            b = tl.load(st_ptr + (base + off * HALF)[:, None] + tl.arange(0, HALF)[None, :],
                        mask=valid[:, None], other=0).to(tl.int32)
            nib = tl.reshape(tl.join(b & 15, b >> 4), (BN, D))  # element 2i low, 2i + 1 high
            ex = (nib >> 1) & 3
            man = nib & 1
            # E2M1 magnitude times 2: 0, 1 (subnormal) or (2 + m) << (e - 1) (normal)
            twice = tl.where(ex == 0, man, (2 + man) << tl.maximum(ex - 1, 0))
            mag = twice.to(tl.float32) * 0.5
            val = tl.where((nib & 8) != 0, -mag, mag)
            sb = tl.load(st_ptr + (base + B * HALF + off * NS4)[:, None]
                         + tl.arange(0, NS4)[None, :], mask=valid[:, None], other=127)
            sc = ue8m0(sb.to(tl.int32))
            sc = tl.reshape(tl.broadcast_to(sc[:, :, None], (BN, NS4, 32)), (BN, D))
            k = (val * sc).to(DT)
        return k

    @triton.jit(do_not_specialize=["width", "tiles"])
    def _score_kernel(q_ptr, sqt, sqh, w_ptr, swt, s_ptr, sst, keys_ptr, blk_stride,
                      tab_ptr, stab, max_logical, slot_ptr, pos_ptr, width, tiles, B,
                      weight_scale, H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr,
                      BN: tl.constexpr, FMT: tl.constexpr, DT: tl.constexpr,
                      PREC: tl.constexpr, PDL: tl.constexpr = False):
        """Program (t, p): query t's entries of tiles p * tiles .. p * tiles + tiles - 1."""
        wait_for_prior_kernel(PDL)
        t = tl.program_id(0)
        visible = ((tl.load(pos_ptr + t) + 1) // 4).to(tl.int32)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        heads = tl.arange(0, HP)
        h_ok = heads < H
        cols = tl.arange(0, D)
        q = tl.load(q_ptr + t.to(tl.int64) * sqt + heads[:, None] * sqh + cols[None, :],
                    mask=h_ok[:, None], other=0.0).to(DT)
        w = tl.load(w_ptr + t.to(tl.int64) * swt + heads, mask=h_ok, other=0.0)
        w = w.to(tl.float32) * weight_scale
        for i in range(0, tiles):
            jb = tl.program_id(1) * tiles + i
            j = jb * BN + tl.arange(0, BN)
            if jb * BN < visible:
                k = _load_index_keys(keys_ptr, tab_ptr, slot, stab, j, visible, max_logical,
                                     blk_stride, B, D, FMT, BN, DT)
                logits = tl.dot(q, tl.trans(k), input_precision=PREC)  # [HP, BN] fp32
                s = tl.sum(tl.maximum(logits, 0.0) * w[:, None], axis=0)
                s = tl.where(j < visible, s, float("-inf"))
            else:
                s = tl.full([BN], float("-inf"), tl.float32)
            tl.store(s_ptr + t.to(tl.int64) * sst + j, s, mask=j < width)
        let_next_kernel_launch(PDL)

    @triton.jit
    def _order_key(x):
        """int32 keys ordered as the fp32 values ``x`` (non-NaN), with -0.0 equal to +0.0."""
        b = x.to(tl.int32, bitcast=True)
        b = tl.where(b == -2147483648, 0, b)
        return b ^ ((b >> 31) & 0x7FFFFFFF)

    @triton.jit
    def _radix_select(row, visible, need, lanes, bins, BLOCK: tl.constexpr):
        """(prefix, need): the ``need``-th largest order key of the row's ``visible`` scores as
        an unsigned-order prefix (key ^ sign bit), and how many of the entries equal to it are
        still to be taken; 4 passes of 8-bit histograms from the top."""
        prefix = need * 0
        for level in tl.static_range(4):
            shift = 24 - 8 * level  # constexpr: level is unrolled
            hist = tl.zeros([256], tl.int32)
            for c in range(0, visible, BLOCK):
                offs = c + lanes
                m = offs < visible
                u = _order_key(tl.load(row + offs, mask=m, other=0.0)) ^ -2147483648
                if level > 0:
                    m = m & ((u >> (shift + 8)) == (prefix >> (shift + 8)))
                hist += tl.histogram((u >> shift) & 255, 256, mask=m)
            digit, need = _pick_digit(hist, bins, need)
            prefix = prefix | (digit << shift)
        return prefix, need

    @triton.jit
    def _pick_digit(hist, bins, need):
        """(digit, need): the bin of ``hist`` that holds the need-th largest entry, and how many
        of that bin's entries are still needed once every entry of a larger bin is taken."""
        total = tl.sum(hist, axis=0)
        above = total - tl.cumsum(hist, axis=0)  # entries of a larger digit than the bin's
        digit = tl.max(tl.where(above + hist >= need, bins, -1), axis=0)
        return digit, need - tl.sum(tl.where(bins == digit, above, 0), axis=0)

    @triton.jit
    def _take_chunk(out, taken, ties, idx, key, m, kth, need):
        """Append to ``out`` (after ``taken``), in order, the chunk's entries ``idx`` (mask
        ``m``) whose key is above ``kth``, and those equal to it while fewer than ``need``
        equal ones (``ties`` so far) were seen; returns the new (taken, ties)."""
        eq = m & (key == kth)
        eq_i = eq.to(tl.int32)
        take = (m & (key > kth)) | (eq & (ties + tl.cumsum(eq_i, axis=0) - eq_i < need))
        take_i = take.to(tl.int32)
        tl.store(out + taken + tl.cumsum(take_i, axis=0) - take_i, idx.to(tl.int64), mask=take)
        return taken + tl.sum(take_i, axis=0), ties + tl.sum(eq_i, axis=0)

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
                     PDL: tl.constexpr = False):
        wait_for_prior_kernel(PDL)
        t = tl.program_id(0)
        row = s_ptr + t.to(tl.int64) * sst
        out = o_ptr + t.to(tl.int64) * sot
        visible = tl.minimum(((tl.load(pos_ptr + t) + 1) // 4).to(tl.int32), width)
        take_n = tl.minimum(visible, K)
        lanes = tl.arange(0, BLOCK)
        bins = tl.arange(0, 256)
        # radix select, 8 bits a pass from the top, on u = key ^ sign bit (unsigned order): the
        # take_n-th largest key is ``prefix``; ``need`` of the entries equal to it are taken.
        # With every visible entry taken (visible <= K: short contexts) the passes are skipped:
        # prefix 0 is the lowest key, which no score has (it is a NaN's), so all are above it
        prefix = take_n * 0
        need = take_n
        if visible > K:
            prefix, need = _radix_select(row, visible, need, lanes, bins, BLOCK)
        kth = prefix ^ -2147483648
        # compaction: every entry above the k-th key, then the lowest-indexed equal ones
        taken = take_n * 0
        ties = take_n * 0
        for c in range(0, visible, BLOCK):
            offs = c + lanes
            m = offs < visible
            key = _order_key(tl.load(row + offs, mask=m, other=0.0))
            # (what _take_chunk does, inline: through the helper this kernel spilled 8 bytes at
            # 4096-score iterations, sm_90)
            eq = m & (key == kth)
            eq_i = eq.to(tl.int32)
            take = (m & (key > kth)) | (eq & (ties + tl.cumsum(eq_i, axis=0) - eq_i < need))
            take_i = take.to(tl.int32)
            dst = taken + tl.cumsum(take_i, axis=0) - take_i
            tl.store(out + dst, offs.to(tl.int64), mask=take)
            taken += tl.sum(take_i, axis=0)
            ties += tl.sum(eq_i, axis=0)
        _write_taken(row, out, take_n, K, KP, SORT, False)
        let_next_kernel_launch(PDL)

    @triton.jit
    def _candidate_level(row, cand, n_cand, prefix, need, lanes, SHIFT: tl.constexpr,
                         NBITS: tl.constexpr, BLOCK: tl.constexpr):
        """One radix level over the candidates (entry indices ``cand[:n_cand]``) whose key
        matches ``prefix`` above bit SHIFT + NBITS: the NBITS-bit digit below that."""
        hist = tl.zeros([256], tl.int32)
        for c in range(0, n_cand, BLOCK):
            mc = c + lanes < n_cand
            idx = tl.load(cand + c + lanes, mask=mc, other=0, cache_modifier=".cg")
            u = _order_key(tl.load(row + idx, mask=mc, other=0.0)) ^ -2147483648
            mc = mc & ((u >> (SHIFT + NBITS)) == (prefix >> (SHIFT + NBITS)))
            hist += tl.histogram((u >> SHIFT) & ((1 << NBITS) - 1), 256, mask=mc)
        digit, need = _pick_digit(hist, tl.arange(0, 256), need)
        return prefix | (digit << SHIFT), need

    @triton.jit(do_not_specialize=["width"])
    def _topk_two_level_kernel(s_ptr, sst, pos_ptr, o_ptr, sot, c_ptr, sct, width,
                               K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr,
                               SORT: tl.constexpr, COARSE: tl.constexpr = 10,
                               PDL: tl.constexpr = False):
        wait_for_prior_kernel(PDL)
        t = tl.program_id(0)
        row = s_ptr + t.to(tl.int64) * sst
        out = o_ptr + t.to(tl.int64) * sot
        cand = c_ptr + t.to(tl.int64) * sct
        visible = tl.minimum(((tl.load(pos_ptr + t) + 1) // 4).to(tl.int32), width)
        take_n = tl.minimum(visible, K)
        lanes = tl.arange(0, BLOCK)
        # pass 1: a histogram of the top COARSE bits of u = key ^ sign bit (unsigned order)
        # finds the coarse digit of the take_n-th largest key
        LOW: tl.constexpr = 32 - COARSE  # the bits below the coarse digit
        BINS: tl.constexpr = 1 << COARSE
        hist = tl.zeros([BINS], tl.int32)
        for c in range(0, visible, BLOCK):
            offs = c + lanes
            m = offs < visible
            u = _order_key(tl.load(row + offs, mask=m, other=0.0)) ^ -2147483648
            hist += tl.histogram((u >> LOW) & (BINS - 1), BINS, mask=m)
        coarse, need = _pick_digit(hist, tl.arange(0, BINS), take_n)
        # pass 2: entries of a larger coarse digit are taken, those of the digit become the
        # candidates; both in entry order
        n_out = take_n * 0
        n_cand = take_n * 0
        for c in range(0, visible, BLOCK):
            offs = c + lanes
            m = offs < visible
            u = _order_key(tl.load(row + offs, mask=m, other=0.0)) ^ -2147483648
            d = (u >> LOW) & (BINS - 1)
            hi = (m & (d > coarse)).to(tl.int32)
            eq = (m & (d == coarse)).to(tl.int32)
            tl.store(out + n_out + tl.cumsum(hi, axis=0) - hi, offs.to(tl.int64), mask=hi > 0)
            tl.store(cand + n_cand + tl.cumsum(eq, axis=0) - eq, offs, mask=eq > 0)
            n_out += tl.sum(hi, axis=0)
            n_cand += tl.sum(eq, axis=0)
        tl.debug_barrier()
        # the LOW other bits (8, 8, then the rest) over the candidates only (usually few; all
        # of them when every score ties)
        prefix = coarse << LOW
        prefix, need = _candidate_level(row, cand, n_cand, prefix, need, lanes, LOW - 8, 8,
                                        BLOCK)
        prefix, need = _candidate_level(row, cand, n_cand, prefix, need, lanes, LOW - 16, 8,
                                        BLOCK)
        prefix, need = _candidate_level(row, cand, n_cand, prefix, need, lanes, 0, LOW - 16,
                                        BLOCK)
        kth = prefix ^ -2147483648
        taken = n_out
        ties = take_n * 0
        for c in range(0, n_cand, BLOCK):
            mc = c + lanes < n_cand
            idx = tl.load(cand + c + lanes, mask=mc, other=0, cache_modifier=".cg")
            key = _order_key(tl.load(row + idx, mask=mc, other=0.0))
            taken, ties = _take_chunk(out, taken, ties, idx, key, mc, kth, need)
        _write_taken(row, out, take_n, K, KP, SORT, True)
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


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, fmt: str,
                   rows_per_block: int, block_table: torch.Tensor, tok_slot: torch.Tensor,
                   pos: torch.Tensor, width: int, weight_scale: float,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Scores [T, width] fp32 (-inf where invisible) of every query ``q`` [T, H, D] (bf16; head
    dims contiguous) with head weights ``weights`` [T, H] over the entries 0 .. width - 1 of its
    sequence (slot ``tok_slot`` [T], position ``pos`` [T]) in the paged store ``keys``
    (module docstring; ``block_table`` [slots, logical blocks] int32)."""
    if fmt not in FMTS:
        raise ValueError(f"fmt must be one of {FMTS}, got {fmt!r}")
    _check_available(q.device)
    t, h, d = q.shape
    s = out if out is not None else torch.empty(t, width, device=q.device,
                                                dtype=torch.float32)
    if t == 0 or width == 0:
        return s
    if q.stride(2) != 1:
        q = q.contiguous()
    check_key_store(keys, fmt, d)
    table = block_table if block_table.dtype == torch.int32 else block_table.int()
    # about SCORE_PROGRAMS_PER_SM programs per SM, each loading its query once for its tiles
    n_tiles = -(-width // SCORE_BLOCK)
    n_sm = _n_sm(q.device.index or 0) if q.device.type == "cuda" else 1
    progs = max(1, min(n_tiles, -(-SCORE_PROGRAMS_PER_SM * n_sm // t)))
    tiles = -(-n_tiles // progs)
    _score_kernel[(t, -(-n_tiles // tiles))](
        q, q.stride(0), q.stride(1), weights, weights.stride(0), s, s.stride(0), keys,
        keys.stride(0), table, table.stride(0), table.shape[1], tok_slot, pos, width, tiles,
        rows_per_block, float(weight_scale),
        H=h, HP=max(16, 1 << (h - 1).bit_length()), D=d, BN=SCORE_BLOCK,
        FMT=FMTS.index(fmt), DT=tl.float32 if _INTERPRET else tl.bfloat16,
        PREC="ieee" if _INTERPRET else "tf32", num_warps=4, **pdl_args(q.device))
    return s


TOPK_METHODS = ("radix", "two_level")


def topk_entries(scores: torch.Tensor, pos: torch.Tensor, topk: int, *, sort: bool = True,
                 out: torch.Tensor | None = None, block: int | None = None,
                 num_warps: int | None = None, method: str = "radix",
                 coarse_bits: int = TWO_LEVEL_COARSE_BITS) -> torch.Tensor:
    """Per row of ``scores`` [T, width]: the min(topk, visible) highest-scoring of its visible
    entries j < min((pos + 1) // 4, width), ties to the lower index, as [T, topk] int64 with
    -1 pads; ``sort``: in the torch path's order (score descending, ties by index), else
    ascending entry index. ``block`` (a power of two >= 16) and ``num_warps`` override
    :func:`choose_scan` (the same selection, another speed). ``method``: ``"radix"`` (four
    8-bit passes over every visible score, then a compaction pass) or ``"two_level"`` (not
    yet timed on a GPU: a histogram pass of the top ``coarse_bits`` bits (8 .. 15) and a split
    pass over every score, the other bits over the coarse digit's candidates only, in a
    [T, width] int32 workspace) - the same selection either way."""
    if method not in TOPK_METHODS:
        raise ValueError(f"topk_entries: method must be one of {TOPK_METHODS}, got {method!r}")
    if (isinstance(coarse_bits, bool) or not isinstance(coarse_bits, int)
            or not 8 <= coarse_bits <= 15):
        raise ValueError(f"topk_entries: coarse_bits must be 8 .. 15, got {coarse_bits!r}")
    if block is not None and (isinstance(block, bool) or not isinstance(block, int)
                              or block < 16 or block & (block - 1)):
        raise ValueError(f"topk_entries: block must be a power of two >= 16, got {block!r}")
    if num_warps is not None and num_warps not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"topk_entries: num_warps must be 1, 2, 4, 8, 16 or 32, got "
                         f"{num_warps!r}")
    _check_available(scores.device)
    t, width = scores.shape
    auto_block, auto_warps = choose_scan(width) if method == "radix" else TWO_LEVEL_SCAN
    o = out if out is not None else torch.empty(t, topk, device=scores.device,
                                                dtype=torch.long)
    if t == 0 or topk == 0:
        return o
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    kp = max(2, 1 << (topk - 1).bit_length())
    if method == "two_level":
        cand = torch.empty(t, max(1, width), device=scores.device, dtype=torch.int32)
        _topk_two_level_kernel[(t,)](
            scores, scores.stride(0), pos, o, o.stride(0), cand, cand.stride(0), width, K=topk,
            KP=kp, BLOCK=block or auto_block, SORT=sort, COARSE=coarse_bits,
            num_warps=num_warps or auto_warps, **pdl_args(scores.device))
        return o
    _topk_kernel[(t,)](scores, scores.stride(0), pos, o, o.stride(0), width, K=topk, KP=kp,
                       BLOCK=block or auto_block, SORT=sort, num_warps=num_warps or auto_warps,
                       **pdl_args(scores.device))
    return o


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, fmt: str,
                 rows_per_block: int, block_table: torch.Tensor, tok_slot: torch.Tensor,
                 pos: torch.Tensor, width: int, topk: int, weight_scale: float, *,
                 workspace_bytes: int = 256 << 20, sort: bool = True) -> torch.Tensor:
    """Top-k entries [T, topk] int64 (-1 pads) per query: :func:`indexer_scores` then
    :func:`topk_entries`, in chunks of queries whose scores fit ``workspace_bytes``. ``width``
    bounds every query's visible entries (host arithmetic, e.g. ``step.max_visible(4)``)."""
    t = q.shape[0]
    out = torch.empty(t, topk, device=q.device, dtype=torch.long)
    if t == 0:
        return out
    chunk = max(1, min(t, workspace_bytes // max(1, 4 * width)))
    ws = torch.empty(chunk, width, device=q.device, dtype=torch.float32)
    for a in range(0, t, chunk):
        b = min(t, a + chunk)
        s = indexer_scores(q[a:b], weights[a:b], keys, fmt, rows_per_block, block_table,
                           tok_slot[a:b], pos[a:b], width, weight_scale, out=ws[:b - a])
        topk_entries(s, pos[a:b], topk, sort=sort, out=out[a:b])
    return out
