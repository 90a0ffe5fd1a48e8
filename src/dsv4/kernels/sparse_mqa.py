"""Sparse MQA attention with the attention sink over paged row stores (decode and prefill).

Entry point ``sparse_mqa(q, win_store, win_idx, cmp_store, cmp_idx, sink, scale, fmt,
rows_per_block)`` -> o [T, H, d] bf16; ``sparse_mqa_reference`` is the torch oracle (gather +
dequantise + softmax), also the path off CUDA without the interpreter.

Inputs (docs/spec.md §5.8): q [T, H, d] bf16 (last dim contiguous). Each query t attends to
the rows ``win_idx[t]`` [W] of ``win_store`` and ``cmp_idx[t]`` [K] of ``cmp_store`` (int32 flat
row indices, -1 = masked; K may be 0 / ``cmp_store`` None); every query has at least one valid
window row. V = K (the value is the full row). sink [H] fp32 adds e^(sink_h - m) to the
denominator only:

    o[t, h] = sum_j e^(l_j - m) k_j / (sum_j e^(l_j - m) + e^(sink_h - m)),  l_j = scale q.k_j

Stores (a flat row r lives in block r // B at offset r % B, B = ``rows_per_block``):

* ``"bf16"``: [num_blocks, B, d] bf16 (the last two dims contiguous).
* ``"fp8_ds_mla"``: uint8 [num_blocks, block_bytes]. With rope 64 and nope n = d - 64, a row's
  data is n e4m3 bytes (tile i = dims 64i..64i+63 has scale 2^(byte_i - 127)) then 64 bf16 rope
  dims: Dr = n + 128 bytes (576 at d=512). Its scales are n/64 ue8m0 bytes padded to
  Sr = 8 ceil(n/512) bytes. Block layout: [B rows' data][B rows' scale groups], block_bytes >=
  B (Dr + Sr) (rounded up to a multiple of Dr by the writer; the kernel uses the block stride).
  Row r: data at block*stride + off*Dr, scales at block*stride + B*Dr + off*Sr. This is
  FlashMLA's "V4" layout (584 bytes per token).

Numerics: fp32 logits (q.k from bf16 operands, exact products), online softmax with a running
max in fp32 (base-2 exponentials with scale*log2(e) folded in), fp32 accumulator; on the GPU the
probabilities are rounded to bf16 for the P.V MMA (as the official kernel does); output bf16.
fp8 rows are dequantised in registers to bf16 (exact: e4m3 x 2^k). Under Triton's CPU
interpreter both MMAs run on fp32 operands (its bf16 dot is wrong on this install), so P is not
rounded to bf16 there.

Work split: one program per (query, block of BH heads, KV chunk) and, with ``block_dv`` < d,
per block of output columns (each such program scores whole rows and multiplies P by its
columns only: a smaller accumulator, for 64-head wgmma tiles): every gathered row is loaded
once per head block (MQA: all heads share the keys). With ``split`` > 1 (long index lists, few
queries) each program writes an fp32 partial (acc, max, sum) and a second kernel merges them,
one program per (query, head, column slice) reducing over all chunks at once (a fixed reduction
tree: deterministic), then applies the sink.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from dsv4.kernels.bound_launch import launch
from dsv4.kernels.launch import _INTERPRET, pdl_args, triton_available
from dsv4.layers.rotary import rotate_rope_dims

__all__ = [
    "SparseMqaConfig",
    "choose_sparse_config",
    "fp8_ds_mla_layout",
    "gather_rows",
    "sparse_mqa",
    "sparse_mqa_reference",
]

ROPE = 64
FMTS = ("bf16", "fp8_ds_mla")


def fp8_ds_mla_layout(d: int, rows_per_block: int) -> tuple[int, int, int]:
    """(data bytes per row Dr, scale bytes per row Sr, minimal block bytes rounded to Dr)."""
    n = d - ROPE
    if n <= 0 or n % 64:
        raise ValueError(f"fp8_ds_mla needs d - 64 to be a positive multiple of 64, got d={d}")
    dr = n + 2 * ROPE
    sr = 8 * -(-(n // 64) // 8)
    raw = rows_per_block * (dr + sr)
    return dr, sr, -(-raw // dr) * dr


# ---------------------------------------------------------------------------------- reference


def gather_rows(store: torch.Tensor, idx: torch.Tensor, fmt: str, d: int,
                rows_per_block: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows ``idx`` (any shape, -1 gives zeros) of a store, dequantised: [*idx.shape, d]."""
    B = rows_per_block
    r = idx.long().clamp(min=0)
    blk, off = r // B, r % B
    if fmt == "bf16":
        rows = store.reshape(-1, d)[blk * B + off].to(dtype)  # logical [blocks, B, d] order
    elif fmt == "fp8_ds_mla":
        dr, sr, _ = fp8_ds_mla_layout(d, B)
        n = d - ROPE
        if store.dtype != torch.uint8 or store.dim() != 2 or store.shape[1] < B * (dr + sr):
            raise ValueError(f"fp8_ds_mla store must be uint8 [blocks, >= {B * (dr + sr)}]")
        cs = store.contiguous()
        flat = cs.reshape(-1)
        base = blk * cs.stride(0)
        data = flat[(base + off * dr)[..., None] + torch.arange(dr, device=store.device)]
        sc = flat[(base + B * dr + off * sr)[..., None] + torch.arange(n // 64,
                                                                         device=store.device)]
        nope = data[..., :n].contiguous().view(torch.float8_e4m3fn).to(dtype)
        scale = torch.exp2(sc.to(dtype) - 127).repeat_interleave(64, dim=-1)
        rope = data[..., n:].contiguous().view(torch.bfloat16).to(dtype)
        rows = torch.cat((nope * scale, rope), dim=-1)
    else:
        raise ValueError(f"fmt must be one of {FMTS}, got {fmt!r}")
    return rows.masked_fill((idx < 0)[..., None], 0)


def sparse_mqa_reference(q: torch.Tensor, win_store: torch.Tensor, win_idx: torch.Tensor,
                         cmp_store: torch.Tensor | None, cmp_idx: torch.Tensor | None,
                         sink: torch.Tensor, scale: float, fmt: str, rows_per_block: int,
                         acc_dtype: torch.dtype = torch.float32,
                         out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The same contract as :func:`sparse_mqa`, in torch (``acc_dtype`` float32 or float64)."""
    T, H, d = q.shape
    keys = [gather_rows(win_store, win_idx, fmt, d, rows_per_block, acc_dtype)]
    masks = [win_idx >= 0]
    if cmp_store is not None and cmp_idx is not None and cmp_idx.shape[1] > 0:
        keys.append(gather_rows(cmp_store, cmp_idx, fmt, d, rows_per_block, acc_dtype))
        masks.append(cmp_idx >= 0)
    k = torch.cat(keys, dim=1)  # [T, L, d]
    valid = torch.cat(masks, dim=1)
    logits = torch.einsum("thd,tld->thl", q.to(acc_dtype), k) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    s = sink.to(acc_dtype)[None, :]
    m = torch.maximum(logits.amax(dim=-1), s)
    p = torch.exp(logits - m[..., None])
    den = p.sum(dim=-1) + torch.exp(s - m)
    return (torch.einsum("thl,tld->thd", p, k) / den[..., None]).to(out_dtype)


# ---------------------------------------------------------------------------------- config


@dataclass(frozen=True)
class SparseMqaConfig:
    block_h: int = 32  # heads per program (>= 16: the MMA's M side)
    block_n: int = 32  # gathered rows per tile
    split: int = 0  # KV chunks per query; 0 = choose
    num_warps: int = 8
    num_stages: int = 2
    block_dv: int = 0  # output columns per program (a power of two >= 64 dividing d); 0 = all d


def choose_sparse_config(T: int, H: int, d: int, L: int, n_sm: int = 132,
                         fmt: str = "bf16") -> SparseMqaConfig:
    """Tiles by query count T from the H200 tile probes (``dsv4 bench attention-kernels`` at
    decode sizes, ``dsv4 bench prefill`` at 4K / 16K queries; benchmarks/results/
    2026-12-05-h200/attention-kernels/ and 2026-12-03-h200/attention-prefill/), 8 warps at
    d = 512:

    * bf16: 1-4 queries 16 heads x 32 rows, 1 stage (Flash 9.6 us against 12.1 for 32 x 32);
      16-255 queries with >= 64 heads 64 x 16, 3 stages, Hopper's wgmma (Flash 16 queries 27.1
      against 37.1, Pro 64 queries 223 against 284); 256 and more 32 x 64, 2 stages (prefill:
      13.2 ms against 22.2 at 64 heads x 16K queries x 640 rows); else 32 x 32, 2 stages.
    * fp8_ds_mla (rows dequantised in registers, 1 stage): 1-4 queries 16 x 32 at <= 64 heads,
      32 x 16 above (Flash 10.3 us, Pro 20.4); 16 and more with >= 64 heads 64 x 16 on wgmma
      (672 bytes of register spill in the sm_90 compile and still the fastest: Flash 64 queries
      139 us against 176); else 32 x 16.

    Between the measured query counts the nearer rule holds. Few programs: the index list is
    split so that about one program per SM runs (two per SM wrote twice the fp32 partials,
    [heads, 512] per chunk and query, and was slower: 53 against 40 us at 16 fp8 queries).
    d < 512 (tiny configs): up to 64 heads x 64 rows, 4 warps, 2 stages."""
    if d >= 512:
        if fmt == "fp8_ds_mla":
            stages = 1
            if T <= 4:
                bh, bn = (16, 32) if H <= 64 else (32, 16)
            elif T >= 16 and H >= 64:
                bh, bn = 64, 16
            else:
                bh, bn = 32, 16
        elif T <= 4:
            bh, bn, stages = 16, 32, 1
        elif T >= 256:
            bh, bn, stages = 32, 64, 2
        elif T >= 16 and H >= 64:
            bh, bn, stages = 64, 16, 3
        else:
            bh, bn, stages = 32, 32, 2
        warps = 8
    else:
        bh, bn, stages, warps = 64, 64, 2, 4
    bh = max(16, min(bh, 1 << (H - 1).bit_length()))
    progs = T * -(-H // bh)
    split = 1
    if progs < n_sm:
        split = max(1, min(-(-L // bn), -(-n_sm // progs), 64))
    return SparseMqaConfig(block_h=bh, block_n=bn, split=split, num_warps=warps,
                           num_stages=stages)


# ---------------------------------------------------------------------------------- kernel

LOG2E = 1.4426950408889634
MAX_SPLIT = 256
"""KV chunks per query at most (a larger ``SparseMqaConfig.split`` is clamped): the combine
kernel holds every chunk's partial of a column slice at once."""
COMBINE_TILE = 4096
"""fp32 partials per combine program (splits x columns): 32 registers a thread at 4 warps."""

if triton_available():
    import triton
    import triton.language as tl

    from dsv4.kernels._float_bits import rounded, ue8m0
    from dsv4.kernels.launch import let_next_kernel_launch, wait_for_prior_kernel
    from dsv4.kernels.rope_norm import rope_cos_sin

    if _INTERPRET:
        from dsv4.kernels._interpreter import patch_interpreter_index

        patch_interpreter_index()

    @triton.jit
    def _fetch_rows(st_ptr, rows, valid, blk_stride, B, D: tl.constexpr, FP8: tl.constexpr,
                    NOPE: tl.constexpr, DR: tl.constexpr, SR: tl.constexpr, C0=0,
                    DW: tl.constexpr = 0):
        """The global loads of :func:`_load_rows` (columns C0 .. C0 + DW, DW = 0: all D), as
        stored: fp8 rows (e4m3 bytes, the scale bytes of their 64-dim tiles, the bf16 rope
        dims), or the bf16 rows (twice, the second unused). :func:`_rows_from` finishes them;
        apart, a tile's loads can be issued before the previous tile is computed."""
        W: tl.constexpr = D if DW == 0 else DW
        r = tl.where(valid, rows, 0)
        blk = (r // B).to(tl.int64)
        off = r % B
        cols = C0 + tl.arange(0, W)
        if FP8:
            base = blk * blk_stride
            d_ptr = st_ptr + (base + off * DR)[:, None]
            m_nope = valid[:, None] & (cols < NOPE)[None, :]
            m_rope = valid[:, None] & (cols >= NOPE)[None, :]
            e = tl.load(d_ptr + cols[None, :], mask=m_nope, other=0)
            # one scale byte per 64-dim tile: [BN, W/64]
            tiles = C0 // 64 + tl.arange(0, W // 64)
            sb = tl.load(st_ptr + (base + B * DR + off * SR)[:, None] + tiles[None, :],
                         mask=valid[:, None] & (tiles < NOPE // 64)[None, :], other=127)
            rp = (d_ptr + NOPE).to(tl.pointer_type(tl.bfloat16))
            rope = tl.load(rp + (cols - NOPE)[None, :], mask=m_rope, other=0.0)
            return e, sb, rope
        else:
            ptr = st_ptr + (blk * blk_stride + off * D)[:, None] + cols[None, :]
            k = tl.load(ptr, mask=valid[:, None], other=0.0)
            return k, k, k

    @triton.jit
    def _rows_from(e, sb, rope, D: tl.constexpr, FP8: tl.constexpr, NOPE: tl.constexpr,
                   BN: tl.constexpr, DT: tl.constexpr, C0=0, DW: tl.constexpr = 0):
        """[BN, DW] rows in DT from :func:`_fetch_rows`' loads: fp8 rows dequantised (bf16 on
        a GPU: e4m3 x 2^k is exact in bf16, half the registers of fp32; fp32 under the
        interpreter), bf16 rows cast."""
        W: tl.constexpr = D if DW == 0 else DW
        if FP8:
            cols = C0 + tl.arange(0, W)
            is_nope = cols < NOPE
            v = e.to(tl.float8e4nv, bitcast=True).to(DT)
            sc = ue8m0(sb.to(tl.int32)).to(DT)  # exact in bf16 too
            sc = tl.reshape(tl.broadcast_to(sc[:, :, None], (BN, W // 64, 64)), (BN, W))
            return tl.where(is_nope[None, :], v * sc, rope.to(DT))
        else:
            return e.to(DT)

    @triton.jit
    def _load_rows(st_ptr, rows, valid, blk_stride, B, D: tl.constexpr, FP8: tl.constexpr,
                   NOPE: tl.constexpr, DR: tl.constexpr, SR: tl.constexpr, BN: tl.constexpr,
                   DT: tl.constexpr, C0=0, DW: tl.constexpr = 0):
        """[BN, DW] rows (columns C0 .. C0 + DW of the D-wide rows; DW = 0: all D) in DT, zeros
        where not valid (fp8 rows dequantised, :func:`_rows_from`). C0 is a multiple of 64."""
        e, sb, rope = _fetch_rows(st_ptr, rows, valid, blk_stride, B, D, FP8, NOPE, DR, SR, C0,
                                  DW)
        return _rows_from(e, sb, rope, D, FP8, NOPE, BN, DT, C0, DW)

    @triton.jit
    def _tile_rows(idx_ptr, j, hi, BN: tl.constexpr):
        """The rows of index-list entries j .. j + BN (-1 at and past ``hi``) and their mask."""
        offs = j + tl.arange(0, BN)
        rows = tl.load(idx_ptr + offs, mask=offs < hi, other=-1)
        return rows, rows >= 0

    @triton.jit
    def _attend_tile(q, m_i, l_i, acc, k, v, valid, qk_scale, DOT_DT: tl.constexpr,
                     DOT_PREC: tl.constexpr):
        """One tile of the online softmax: scores of q against rows k, P.V into acc."""
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [BH, BN], log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DT), v, input_precision=DOT_PREC)
        return m_new, l_i, acc

    @triton.jit
    def _attend(q, m_i, l_i, acc, st_ptr, idx_ptr, lo, hi, blk_stride, B, qk_scale, c0,
                D: tl.constexpr, DV: tl.constexpr, BN: tl.constexpr, FP8: tl.constexpr,
                NOPE: tl.constexpr, DR: tl.constexpr, SR: tl.constexpr, DOT_DT: tl.constexpr,
                DOT_PREC: tl.constexpr):
        """Online softmax over rows lo .. hi of one index list; acc holds output columns
        c0 .. c0 + DV (DV < D: the scores use whole rows, P.V this program's columns)."""
        for j in range(lo, hi, BN):
            rows, valid = _tile_rows(idx_ptr, j, hi, BN)
            k = _load_rows(st_ptr, rows, valid, blk_stride, B, D, FP8, NOPE, DR, SR, BN,
                           DOT_DT)
            if DV == D:
                v = k
            else:  # this program's output columns of the same rows (from the cache)
                v = _load_rows(st_ptr, rows, valid, blk_stride, B, D, FP8, NOPE, DR, SR,
                               BN, DOT_DT, c0, DV)
            m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k, v, valid, qk_scale, DOT_DT,
                                         DOT_PREC)
        return m_i, l_i, acc

    @triton.jit
    def _inverse_rope_tile(o, t, c0, pos_ptr, freq_ptr, R: tl.constexpr, W: tl.constexpr,
                           NOPE2: tl.constexpr, OUT_DT: tl.constexpr):
        """o [R, W] fp32 (columns c0 .. c0 + W of R output rows of query t) as the output
        path's inverse RoPE makes them from the stored bf16 output: rounded to OUT_DT as the
        store would, pairs (2i, 2i + 1) from pair NOPE2 on rotated by the negated angle in fp32
        (:func:`dsv4.kernels.rope_norm.rope_cos_sin`, as the ``rope_heads`` kernel), rounded
        again - its values bit for bit; nope pairs unchanged."""
        x = o.to(OUT_DT).to(tl.float32)
        xe, xo = tl.split(tl.reshape(x, [R, W // 2, 2]))
        jr = c0 // 2 + tl.arange(0, W // 2) - NOPE2
        freq = tl.load(freq_ptr + jr, mask=jr >= 0, other=0.0)
        c, s = rope_cos_sin(tl.load(pos_ptr + t), freq, -1)
        ye = rounded(xe * c[None, :] - xo * s[None, :], OUT_DT)
        yo = rounded(xe * s[None, :] + xo * c[None, :], OUT_DT)
        return tl.reshape(tl.join(ye, yo), [R, W])

    @triton.jit(do_not_specialize=["T", "W", "KC", "chunk", "n_split"])
    def _sparse_mqa_kernel(
        q_ptr, sqt, sqh, o_ptr, sot, soh, sink_ptr, ws_acc, ws_ml,
        win_ptr, widx_ptr, swi, w_blk, cmp_ptr, cidx_ptr, sci, c_blk,
        T, H, W, KC, B, chunk, n_split, qk_scale,
        D: tl.constexpr, DV: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr,
        SPLIT: tl.constexpr, FP8: tl.constexpr, NOPE: tl.constexpr, DR: tl.constexpr,
        SR: tl.constexpr, DOT_DT: tl.constexpr, DOT_PREC: tl.constexpr,
        PDL: tl.constexpr = False,
        pos_ptr=None, freq_ptr=None, ROPE_NOPE2: tl.constexpr = -1,
    ):
        wait_for_prior_kernel(PDL)
        pid = tl.program_id(0)
        n_hb = tl.cdiv(H, BH)
        split = pid % n_split
        rest = pid // n_split
        dvb = rest % (D // DV)  # which DV output columns (DV = D: all)
        rest = rest // (D // DV)
        hb = rest % n_hb
        t = rest // n_hb
        heads = hb * BH + tl.arange(0, BH)
        h_mask = heads < H
        dims = tl.arange(0, D)
        q = tl.load(q_ptr + t.to(tl.int64) * sqt + heads[:, None] * sqh + dims[None, :],
                    mask=h_mask[:, None], other=0.0).to(DOT_DT)
        c0 = dvb * DV
        cols = c0 + tl.arange(0, DV)
        m_i = tl.full([BH], -1e30, tl.float32)  # finite: a fully masked tile leaves it alone
        l_i = tl.zeros([BH], tl.float32)
        acc = tl.zeros([BH, DV], tl.float32)
        j0 = split * chunk
        j1 = tl.minimum(j0 + chunk, W + KC)
        m_i, l_i, acc = _attend(q, m_i, l_i, acc, win_ptr, widx_ptr + t.to(tl.int64) * swi,
                                tl.minimum(j0, W), tl.minimum(j1, W), w_blk, B, qk_scale, c0,
                                D, DV, BN, FP8, NOPE, DR, SR, DOT_DT, DOT_PREC)
        if KC > 0:
            m_i, l_i, acc = _attend(q, m_i, l_i, acc, cmp_ptr, cidx_ptr + t.to(tl.int64) * sci,
                                    tl.maximum(j0, W) - W, tl.maximum(j1, W) - W, c_blk, B,
                                    qk_scale, c0, D, DV, BN, FP8, NOPE, DR, SR, DOT_DT,
                                    DOT_PREC)
        if SPLIT:  # partial (acc, max, sum) for the combine kernel
            row = (split * T + t).to(tl.int64) * H + heads  # ws[split, t, h]
            tl.store(ws_acc + row[:, None] * D + cols[None, :], acc, mask=h_mask[:, None])
            if dvb == 0:  # every column block has the same (max, sum)
                tl.store(ws_ml + row * 2, m_i, mask=h_mask)
                tl.store(ws_ml + row * 2 + 1, l_i, mask=h_mask)
        else:
            s2 = tl.load(sink_ptr + heads, mask=h_mask, other=0.0) * 1.4426950408889634
            m_f = tl.maximum(m_i, s2)
            fac = tl.exp2(m_i - m_f)
            den = l_i * fac + tl.exp2(s2 - m_f)
            o = acc * (fac / den)[:, None]
            if ROPE_NOPE2 >= 0:  # the output path's inverse RoPE, in this store
                o = _inverse_rope_tile(o, t, c0, pos_ptr, freq_ptr, BH, DV, ROPE_NOPE2,
                                       o_ptr.dtype.element_ty)
            tl.store(o_ptr + t.to(tl.int64) * sot + heads[:, None] * soh + cols[None, :],
                     o.to(o_ptr.dtype.element_ty), mask=h_mask[:, None])
        let_next_kernel_launch(PDL)

    @triton.jit(do_not_specialize=["T", "n_split"])
    def _combine_kernel(ws_acc, ws_ml, sink_ptr, o_ptr, sot, soh, T, H,
                        n_split, D: tl.constexpr, SP: tl.constexpr, BD: tl.constexpr,
                        PDL: tl.constexpr = False, pos_ptr=None, freq_ptr=None,
                        ROPE_NOPE2: tl.constexpr = -1):
        """One program per (query, head, BD output columns): every split's partial of that
        slice at once ([SP, BD] tile, SP = n_split padded), weighted by 2^(m_s - m) and summed
        over the splits in one reduction (no loop over splits: a decode step of one query has
        ~40 splits, and a loop of dependent loads over them took ~20 us)."""
        wait_for_prior_kernel(PDL)
        pid = tl.program_id(0)
        n_db = D // BD
        db = pid % n_db
        rest = pid // n_db
        h = rest % H
        t = rest // H
        s = tl.arange(0, SP)
        s_mask = s < n_split
        row = (s * T + t).to(tl.int64) * H + h  # ws[split, t, h]
        m_s = tl.load(ws_ml + row * 2, mask=s_mask, other=-1e30)
        l_s = tl.load(ws_ml + row * 2 + 1, mask=s_mask, other=0.0)
        s2 = tl.load(sink_ptr + h) * 1.4426950408889634
        m_f = tl.maximum(tl.max(m_s, 0), s2)
        f = tl.exp2(m_s - m_f)  # 0 for the padding (m = -1e30)
        den = tl.sum(l_s * f, 0) + tl.exp2(s2 - m_f)
        cols = db * BD + tl.arange(0, BD)
        acc = tl.load(ws_acc + row[:, None] * D + cols[None, :], mask=s_mask[:, None],
                      other=0.0)
        o = tl.sum(acc * f[:, None], 0) / den
        if ROPE_NOPE2 >= 0:  # the output path's inverse RoPE, in this store
            o = tl.reshape(_inverse_rope_tile(tl.reshape(o, [1, BD]), t, db * BD, pos_ptr,
                                              freq_ptr, 1, BD, ROPE_NOPE2,
                                              o_ptr.dtype.element_ty), [BD])
        tl.store(o_ptr + t.to(tl.int64) * sot + h * soh + cols, o.to(o_ptr.dtype.element_ty))
        let_next_kernel_launch(PDL)


@functools.lru_cache(maxsize=8)
def _n_sm(idx: int) -> int:
    return torch.cuda.get_device_properties(idx).multi_processor_count


def _store_args(store: torch.Tensor, fmt: str, d: int, B: int) -> tuple[torch.Tensor, int]:
    """(tensor to pass, block stride in its elements), validating the layout."""
    if fmt == "bf16":
        if store.dtype != torch.bfloat16 or store.dim() != 3 or store.shape[1:] != (B, d) \
                or store.stride(2) != 1 or store.stride(1) != d:
            raise ValueError(f"bf16 store must be [blocks, {B}, {d}] bf16 with contiguous rows, "
                             f"got {store.dtype} {tuple(store.shape)}")
        return store, store.stride(0)
    dr, sr, _ = fp8_ds_mla_layout(d, B)
    if store.dtype != torch.uint8 or store.dim() != 2 or store.shape[1] < B * (dr + sr) \
            or store.stride(1) != 1:
        raise ValueError(f"fp8_ds_mla store must be uint8 [blocks, >= {B * (dr + sr)}] with "
                         f"contiguous bytes, got {store.dtype} {tuple(store.shape)}")
    return store, store.stride(0)


def sparse_mqa(q: torch.Tensor, win_store: torch.Tensor, win_idx: torch.Tensor,
               cmp_store: torch.Tensor | None, cmp_idx: torch.Tensor | None,
               sink: torch.Tensor, scale: float, fmt: str, rows_per_block: int, *,
               out: torch.Tensor | None = None,
               config: SparseMqaConfig | None = None,
               inverse_rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """o [T, H, d] bf16 (see the module docstring for shapes, layouts and numerics).

    ``win_idx`` [T, W], ``cmp_idx`` [T, K] int32 (rows contiguous); both stores share ``fmt``
    and ``rows_per_block``. ``out``: optional [T, H, d] with a contiguous last dim. The split-KV
    workspace is allocated per call (a graph-captured caller should pass ``config`` with
    ``split=1`` or capture after a warm-up; the allocation is from the caching allocator).
    ``inverse_rope`` = (positions [T] int on q's device, inv_freq [r / 2] float32): the output
    path's inverse RoPE of o's last r dims applied as o is written (the launch that writes o
    rotates it; the values of ``rope_heads(o[..., -r:], positions, inv_freq, inverse=True)``
    on the unrotated output, bit for bit under the interpreter), instead of its own launch.
    """
    if fmt not in FMTS:
        raise ValueError(f"fmt must be one of {FMTS}, got {fmt!r}")
    T, H, d = q.shape
    if inverse_rope is not None:
        positions, inv_freq = inverse_rope
        if (positions.shape != (T,) or positions.dtype.is_floating_point
                or positions.device != q.device):
            raise ValueError(f"inverse_rope positions must be [{T}] integers on {q.device}, got "
                             f"{positions.dtype} {tuple(positions.shape)} on {positions.device}")
        if (inv_freq.dim() != 1 or inv_freq.dtype != torch.float32 or inv_freq.device != q.device
                or not 0 < 2 * inv_freq.numel() <= d):
            raise ValueError(f"inverse_rope inv_freq must be [1 .. {d // 2}] float32 on "
                             f"{q.device}, got {inv_freq.dtype} {tuple(inv_freq.shape)} on "
                             f"{inv_freq.device}")
    if d & (d - 1) or d < 128:
        raise ValueError(f"head dim must be a power of two >= 128, got {d}")
    if win_idx.dim() != 2 or win_idx.shape[0] != T or win_idx.shape[1] == 0:
        raise ValueError(f"win_idx must be [T={T}, W>0], got {tuple(win_idx.shape)}")
    has_cmp = cmp_store is not None and cmp_idx is not None and cmp_idx.shape[1] > 0
    if has_cmp and (cmp_idx is None or cmp_idx.dim() != 2 or cmp_idx.shape[0] != T):
        raise ValueError("cmp_idx must be [T, K]")
    o = out if out is not None else torch.empty(T, H, d, device=q.device, dtype=torch.bfloat16)
    if T == 0:
        return o
    if not (triton_available() and (q.device.type == "cuda" or _INTERPRET)):
        o.copy_(sparse_mqa_reference(q, win_store, win_idx, cmp_store, cmp_idx, sink, scale,
                                     fmt, rows_per_block, out_dtype=o.dtype))
        if inverse_rope is not None:  # the torch layers' own rotation
            o.copy_(rotate_rope_dims(o, *inverse_rope, torch.float32, inverse=True))
        return o
    if q.dtype != torch.bfloat16:
        raise ValueError(f"q must be bf16 for the kernel, got {q.dtype}")
    B = rows_per_block
    ws_t, w_blk = _store_args(win_store, fmt, d, B)
    if has_cmp:
        assert cmp_store is not None and cmp_idx is not None
        cs_t, c_blk = _store_args(cmp_store, fmt, d, B)
        cidx = cmp_idx.to(torch.int32).contiguous()
        KC = cidx.shape[1]
    else:
        cs_t, c_blk, cidx, KC = ws_t, 0, win_idx, 0
    widx = win_idx.to(torch.int32).contiguous()
    W = widx.shape[1]
    L = W + KC
    n_sm = _n_sm(q.device.index or 0) if q.device.type == "cuda" else 132
    cfg = config or choose_sparse_config(T, H, d, L, n_sm, fmt)
    if cfg.split == 0:
        cfg = SparseMqaConfig(**{**cfg.__dict__,
                                 "split": choose_sparse_config(T, H, d, L, n_sm, fmt).split})
    bn = cfg.block_n
    chunk = -(-L // min(cfg.split, MAX_SPLIT))
    chunk = -(-chunk // bn) * bn
    split = -(-L // chunk)
    if q.stride(2) != 1:
        q = q.contiguous()
    n_hb = -(-H // cfg.block_h)
    dv = cfg.block_dv or d
    if dv & (dv - 1) or dv < 64 or d % dv:
        raise ValueError(f"block_dv={cfg.block_dv} must be 0 or a power of two >= 64 dividing "
                         f"the head dim {d}")
    sink_f = sink.to(torch.float32).contiguous()
    rope_args: dict[str, object] = {}
    if inverse_rope is not None:  # in whichever launch writes o
        rope_args = {"pos_ptr": inverse_rope[0].contiguous(),
                     "freq_ptr": inverse_rope[1].contiguous(),
                     "ROPE_NOPE2": (d - 2 * inverse_rope[1].numel()) // 2}
    if split > 1:
        ws_acc = torch.empty(split * T * H * d, device=q.device, dtype=torch.float32)
        ws_ml = torch.empty(split * T * H * 2, device=q.device, dtype=torch.float32)
    else:
        ws_acc = ws_ml = sink_f
    n = d - ROPE
    dr, sr, _ = fp8_ds_mla_layout(d, B) if fmt == "fp8_ds_mla" else (0, 0, 0)
    dot_dt = tl.float32 if _INTERPRET else tl.bfloat16
    launch(_sparse_mqa_kernel, (T * n_hb * (d // dv) * split,),
        q, q.stride(0), q.stride(1), o, o.stride(0), o.stride(1), sink_f, ws_acc, ws_ml,
        ws_t, widx, widx.stride(0), w_blk, cs_t, cidx, cidx.stride(0), c_blk,
        T, H, W, KC, B, chunk, split, float(scale) * LOG2E,
        D=d, DV=dv, BH=cfg.block_h, BN=bn, SPLIT=split > 1, FP8=fmt == "fp8_ds_mla", NOPE=n,
        DR=dr, SR=sr,
        DOT_DT=dot_dt, DOT_PREC="ieee" if _INTERPRET else "tf32", num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl_args(q.device),
        **({} if split > 1 else rope_args),
    )
    if split > 1:
        sp = triton.next_power_of_2(split)
        bd = max(16, min(d, COMBINE_TILE // sp))  # [sp, bd] fp32 partials per program
        launch(_combine_kernel, (T * H * (d // bd),), ws_acc, ws_ml, sink_f, o, o.stride(0),
               o.stride(1), T, H, split, D=d, SP=sp, BD=bd, num_warps=4,
               **pdl_args(ws_acc.device), **rope_args)
    return o
