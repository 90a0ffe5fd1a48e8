"""One-launch decode input projections of a DSV4 attention layer.

At decode the layer's input GEMMs (``fused_wqa_wkv``, the main compressor score GEMM, the indexer
``weights_proj`` and the indexer compressor score GEMM) all read the same activation x [M, K] and
are memory-bound: the time is the weight bytes over HBM bandwidth. This module packs their weights
into one buffer and runs them as ONE Triton launch that reads x and every weight row once and
writes each segment into its own output in its own dtype (bf16 or fp32).

How the work is cut (small M): the weight rows are split into G row groups of equal size (ragged
by at most one row, masked to a power-of-two tile) and K into S equal splits, so that G * S
programs, all resident at once, each stream the same number of bytes and finish together. With
S > 1 each program writes an fp32 partial to a workspace; the last program of a group to arrive
(an acq_rel counter per group) sums the S partials in split order (0..S-1) and writes the outputs.
The order is fixed, so the result is deterministic and CUDA-graph replay equals eager bit for bit;
the counter is reset by that last program, so the launch is replayable. No float atomics.

A leading fp8 segment (``fused_wqa_wkv`` as stored: e4m3 with 128x128 block scales that multiply)
is dequantised in the kernel: per 128-wide K block the fp8 tile is widened to bf16 (exact), one
MMA gives the block product, and the block's scale multiplies it into the fp32 accumulator. fp8
groups hold twice the rows of bf16 groups so that every program moves the same bytes.

Dispatch (``choose_config``, tuned on an H200, see docs/performance.md): the split-K kernel for
M <= 64; for M > 64 with bf16 weights one cuBLAS fp32 GEMM plus one scatter/cast launch; a layer
with a single bf16 segment (SWA) is one ``torch.mm``. Programmatic dependent launch (``pdl``) is
implemented but off by default: it measured slower.

The pure-PyTorch ``fused_input_projections_reference`` is the kernel's oracle (float32 math).
Without the kernel (no Triton, or a CPU tensor outside the interpreter) the call computes each
segment as the unpacked layer's module does (``fused_input_projections_as_modules``), so a
packed layer there gives the unpacked layer's values bit for bit. Triton is imported guarded:
this module imports on a machine without it.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dsv4.kernels.bound_launch import launch
from dsv4.kernels.launch import _HAVE_TRITON, _INTERPRET, pdl_args, triton_available
from dsv4.layers.quant_sim import fp8_block_sim

__all__ = [
    "KernelConfig",
    "PackedInputWeights",
    "Segment",
    "SplitKWorkspace",
    "choose_config",
    "fused_input_projections",
    "fused_input_projections_as_modules",
    "fused_input_projections_reference",
    "pack_input_weights",
    "segment_views",
    "triton_available",
]

FP8_BLOCK = 128
MAX_SEGMENTS = 5


@dataclass
class Segment:
    """One projection inside the packed buffer: its name, its rows (= output columns), its dtype."""

    name: str
    rows: int
    out_dtype: torch.dtype


@dataclass
class PackedInputWeights:
    """The input-projection weights of one layer, packed for a single launch.

    ``weight`` holds the bf16 segments' rows back to back in ``segments`` order. When
    ``fp8_weight`` is set, ``segments[0]`` is an fp8 segment stored in ``fp8_weight`` [N8, K]
    (float8_e4m3fn) with ``fp8_scale`` [N8/128, K/128] (float32, multiplies), and ``weight``
    holds ``segments[1:]``.
    """

    weight: torch.Tensor
    segments: list[Segment]
    fp8_weight: torch.Tensor | None = None
    fp8_scale: torch.Tensor | None = None
    fp8_scale_pow2: bool = False  # every scale a power of two (ue8m0): folded into x, exactly
    _workspace: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def K(self) -> int:  # noqa: N802 - the GEMM's K
        return int(self.weight.shape[1])

    @property
    def n_fp8(self) -> int:
        return 0 if self.fp8_weight is None else int(self.fp8_weight.shape[0])

    @property
    def n_bf16(self) -> int:
        return int(self.weight.shape[0])

    @property
    def n_total(self) -> int:
        return self.n_fp8 + self.n_bf16

    def weight_bytes(self) -> int:
        b = self.weight.numel() * self.weight.element_size()
        if self.fp8_weight is not None and self.fp8_scale is not None:
            b += self.fp8_weight.numel() + self.fp8_scale.numel() * 4
        return b


def pack_input_weights(
    segments_with_tensors: Sequence[tuple],
    *,
    device: torch.device | str | None = None,
) -> PackedInputWeights:
    """Pack ``[(name, weight, out_dtype), ...]`` into one buffer, in output order.

    ``weight`` is a [rows, K] tensor (copied into the packed bf16 buffer as bf16), or for the
    first segment only a pair ``(w_fp8 [rows, K] float8_e4m3fn, scale [rows/128, K/128])`` to keep
    it fp8 (scale as float32 or float8_e8m0fnu; it multiplies).
    """
    if not segments_with_tensors:
        raise ValueError("pack_input_weights: no segments")
    segs: list[Segment] = []
    bf16_parts: list[torch.Tensor] = []
    fp8_w = fp8_s = None
    K = None
    for i, item in enumerate(segments_with_tensors):
        if len(item) != 3:
            raise ValueError(f"segment {i}: expected (name, weight, out_dtype), "
                             f"got {len(item)} items")
        name, w, out_dtype = item
        if out_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"segment {name!r}: out_dtype must be bf16 or fp32, got {out_dtype}")
        if isinstance(w, (tuple, list)):
            if i != 0:
                raise ValueError(f"segment {name!r}: only the first segment may stay fp8")
            fp8_w, fp8_s = w
            if fp8_w.dtype != torch.float8_e4m3fn or fp8_w.dim() != 2:
                raise ValueError(f"segment {name!r}: fp8 weight must be 2-D float8_e4m3fn")
            rows, k = fp8_w.shape
            if rows % FP8_BLOCK or k % FP8_BLOCK:
                raise ValueError(f"segment {name!r}: fp8 weight {tuple(fp8_w.shape)} "
                                 "is not 128-aligned")
            if tuple(fp8_s.shape) != (rows // FP8_BLOCK, k // FP8_BLOCK):
                raise ValueError(f"segment {name!r}: scale shape {tuple(fp8_s.shape)} != "
                                 f"{(rows // FP8_BLOCK, k // FP8_BLOCK)}")
        else:
            if w.dim() != 2:
                raise ValueError(f"segment {name!r}: weight must be 2-D, got {w.dim()}-D")
            rows, k = w.shape
            bf16_parts.append(w)
        if K is None:
            K = k
        elif k != K:
            raise ValueError(f"segment {name!r}: K={k} differs from K={K}")
        segs.append(Segment(name, int(rows), out_dtype))
    if len(segs) > MAX_SEGMENTS:
        raise ValueError(f"at most {MAX_SEGMENTS} segments, got {len(segs)}")
    first = bf16_parts[0] if bf16_parts else fp8_w
    assert first is not None and K is not None
    dev = torch.device(device) if device is not None else first.device
    if bf16_parts:
        weight = torch.cat([p.to(device=dev, dtype=torch.bfloat16) for p in bf16_parts])
    else:  # an fp8-only layer (SWA): an empty bf16 buffer keeps the layout uniform
        weight = torch.empty(0, K, device=dev, dtype=torch.bfloat16)
    weight = weight.contiguous()
    if fp8_w is not None and fp8_s is not None:
        fp8_w = fp8_w.to(dev).contiguous()
        fp8_s = fp8_s.to(device=dev, dtype=torch.float32).contiguous()
    pow2 = False
    if fp8_s is not None:
        mant, _ = torch.frexp(fp8_s)
        pow2 = bool(((mant == 0.5) & (fp8_s > 0)).all())
    return PackedInputWeights(weight=weight, segments=segs, fp8_weight=fp8_w, fp8_scale=fp8_s,
                              fp8_scale_pow2=pow2)


def segment_views(packed: PackedInputWeights) -> dict[str, torch.Tensor]:
    """Zero-copy row views into ``packed.weight``, one per bf16 segment (for ``param.set_``)."""
    views: dict[str, torch.Tensor] = {}
    row = 0
    for i, seg in enumerate(packed.segments):
        if i == 0 and packed.fp8_weight is not None:
            continue
        views[seg.name] = packed.weight[row : row + seg.rows]
        row += seg.rows
    return views


def _fp8_segment_weight_f32(packed: PackedInputWeights) -> torch.Tensor | None:
    """The fp8 segment's weight dequantised in float32 (its block scales multiply), or None."""
    if packed.fp8_weight is None or packed.fp8_scale is None:
        return None
    s = packed.fp8_scale.float()
    s = s.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
    return packed.fp8_weight.float() * s


def _segment_weights_f32(packed: PackedInputWeights) -> list[torch.Tensor]:
    views = segment_views(packed)
    w8 = _fp8_segment_weight_f32(packed)
    return [w8 if i == 0 and w8 is not None else views[seg.name].float()
            for i, seg in enumerate(packed.segments)]


def fused_input_projections_as_modules(
    x: torch.Tensor, packed: PackedInputWeights, act_quant: bool = False
) -> list[torch.Tensor]:
    """Each segment's product as the unpacked layer computes it: a segment in x's dtype as
    ``Linear.forward`` does (one GEMM in that dtype), an fp32 segment as ``Linear.forward_fp32``
    (x and the weight upcast), the fp8 segment's x through ``fp8_block_sim`` under
    ``act_quant`` as ``_fp8_linear_input`` does. The call's path where the kernel does not run:
    float32 math cast to bf16 (the reference) rounds a few values differently from a bf16 GEMM,
    and a packed layer must give what the unpacked one gives."""
    xq = fp8_block_sim(x, FP8_BLOCK) if act_quant else x
    views = segment_views(packed)
    w8 = _fp8_segment_weight_f32(packed)
    out = []
    for i, seg in enumerate(packed.segments):
        dt = seg.out_dtype
        if i == 0 and w8 is not None:
            # the float32 product rounded, as dequantize_fp8_block gives it for any scale
            w, xi = w8.to(dt), xq
        else:
            w, xi = views[seg.name].to(dt), x
        out.append(torch.nn.functional.linear(xi.to(dt), w))
    return out


def fused_input_projections_reference(
    x: torch.Tensor, packed: PackedInputWeights, act_quant: bool = False
) -> list[torch.Tensor]:
    """float32 math (fp8 dequantised), cast per segment. Runs on any device. ``act_quant``:
    the fp8 segment multiplies ``fp8_block_sim(x, 128)`` (§6.3), the others x."""
    xf = x.float()
    xq = fp8_block_sim(xf, FP8_BLOCK) if act_quant else xf
    return [((xq if i == 0 and packed.fp8_weight is not None else xf) @ w.t()).to(seg.out_dtype)
            for i, (seg, w) in enumerate(zip(packed.segments, _segment_weights_f32(packed),
                                             strict=True))]


# ----------------------------------------------------------------------------------------------
# Triton kernel (lazy)


if _HAVE_TRITON:  # guarded: the module (reference, packing) must import without Triton
    import triton
    import triton.language as tl
else:  # pragma: no cover - depends on the machine
    triton = tl = None


def _interpreting() -> bool:
    """Triton's CPU interpreter (TRITON_INTERPRET=1, read when dsv4.kernels.launch was
    imported)."""
    return _HAVE_TRITON and _INTERPRET


@dataclass(frozen=True)
class KernelConfig:
    """Tile configuration. ``groups``/``groups8`` = 0 means ceil(rows / block_n)."""

    block_m: int = 16
    block_n: int = 64  # bf16 rows per program tile
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    swap: bool = True  # compute out^T = W x^T: the weight rows are the MMA's M side
    groups: int = 0
    groups8: int = 0
    block_n8: int = 0  # fp8 rows per program tile; 0 = 2 * block_n
    pdl: bool = False  # programmatic dependent launch (griddepcontrol)
    prefetch: int = 0  # with pdl: bytes of each weight row prefetched to L2 before the wait
    cublas: bool = False  # one cuBLAS fp32 GEMM + one scatter/cast launch (large M, bf16 only)


def _smem_bytes(c: KernelConfig, bn: int) -> int:
    return c.num_stages * (bn * c.block_k * 2 + c.block_m * c.block_k * 2) + 2048


def _split_for(groups: int, nkb: int, cap: int, lo: int) -> int:
    """Smallest divisor of nkb with lo <= groups * s <= cap; else the largest that fits cap."""
    divs = [d for d in range(1, nkb + 1) if nkb % d == 0]
    for d in divs:
        if lo <= groups * d <= cap:
            return d
    fit = [d for d in divs if groups * d <= cap]
    return fit[-1] if fit else 1


def choose_config(M: int, packed: PackedInputWeights, n_sm: int = 132) -> KernelConfig:
    """Tile choice from the H200 sweeps (benchmarks/results/2026-12-02-h200/input-projections/).

    M <= 32: swap (weight rows on the MMA's M side), split K so that about two programs per SM
    stream equal bytes, all resident; 64-row bf16 tiles, and 32-row fp8 tiles when a segment is
    fp8 (the fp8 programs are the slow ones: smaller tiles). 32 < M <= 64: few splits (the x
    tile is as large as the weight tile and split-K re-reads it). M > 64: bf16 weights go to
    cuBLAS (one fp32 GEMM) plus one scatter/cast launch; with an fp8 segment, 64x64 tiles.
    A layer of one bf16-out bf16 segment (SWA) is one cuBLAS GEMM at every M (see the caller).
    """
    K = packed.K
    bk = 128 if K % 128 == 0 else 64 if K % 64 == 0 else 32 if K % 32 == 0 else 16
    fp8 = packed.fp8_weight is not None
    if M > 64 and not fp8:
        return KernelConfig(block_m=128, block_n=64, block_k=bk, cublas=True)
    if M <= 32 and fp8:  # fp8 programs are the slow ones: 32-row fp8 tiles (a probe)
        c = KernelConfig(block_m=16 if M <= 16 else 32, block_n=64 if K <= 4096 else 32,
                         block_n8=32, block_k=bk, num_stages=3)
        lo = 3 * n_sm
    elif M <= 32:
        c = KernelConfig(block_m=16 if M <= 16 else 32, block_n=64, block_k=bk, num_stages=3)
        lo = int(1.9 * n_sm)
    elif M <= 64 and fp8:
        c = KernelConfig(block_m=64, block_n=32, block_k=bk, num_stages=3)
        lo = int(1.5 * n_sm)
    elif M <= 64:
        c = KernelConfig(block_m=64, block_n=64, block_k=bk, num_stages=4, swap=False)
        lo = n_sm // 2
    else:
        return KernelConfig(block_m=64, block_n=64, block_k=bk, num_stages=3, swap=False)
    m_tiles = -(-M // c.block_m)
    g = (-(-packed.n_bf16 // c.block_n) + -(-packed.n_fp8 // (c.block_n8 or 2 * c.block_n)))
    g *= m_tiles
    per_sm = max(1, min(228 * 1024 // _smem_bytes(c, c.block_n), 65536 // (128 * 32 * c.num_warps)))
    if c.block_n8:  # the fp8 probe's best had more programs than fit at once (s=4 on Pro C4)
        per_sm = 5
    s = _split_for(g, K // bk, per_sm * n_sm, lo)
    return KernelConfig(**{**c.__dict__, "split_k": s})


if _HAVE_TRITON:
    from dsv4.kernels._float_bits import act_quant_block
    from dsv4.kernels.launch import let_next_kernel_launch, wait_for_prior_kernel

    @triton.jit
    def _fence_gpu():
        tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)

    @triton.jit
    def _prefetch_l2(addr, NBYTES: tl.constexpr):
        # addr: int64 tensor of byte addresses (0 = skip); one bulk L2 prefetch per element
        nbytes = tl.full(addr.shape, NBYTES, tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.u64 p, $1, 0; "
            "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [addr, nbytes], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _store_seg(acc, o_ptr, so, seg_lo, seg_hi, r_lo, r_hi, rows, offs_m, m_mask,
                   SWAP: tl.constexpr):
        # only rows of this segment that this program owns: a ragged group's tile overhangs
        # into the next group's rows, which that group's program writes
        r_mask = (rows >= seg_lo) & (rows < seg_hi) & (rows >= r_lo) & (rows < r_hi)
        col = rows - seg_lo
        if SWAP:
            ptrs = o_ptr + offs_m[None, :] * so + col[:, None]
            mask = r_mask[:, None] & m_mask[None, :]
        else:
            ptrs = o_ptr + offs_m[:, None] * so + col[None, :]
            mask = m_mask[:, None] & r_mask[None, :]
        tl.store(ptrs, acc.to(o_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _write_out(acc, rows, r_lo, r_hi, offs_m, m_mask,
                   o0, s0, o1, s1, o2, s2, o3, s3, o4, s4, e0, e1, e2, e3, e4,
                   SWAP: tl.constexpr):
        # rows: global row ids of the tile; [r_lo, r_hi): rows this program owns. Segment i is
        # [e_{i-1}, e_i); unused slots have e_i = e_{i-1} and are skipped at run time.
        if r_lo < e0:
            _store_seg(acc, o0, s0, 0, e0, r_lo, r_hi, rows, offs_m, m_mask, SWAP)
        if (r_lo < e1) & (r_hi > e0) & (e1 > e0):
            _store_seg(acc, o1, s1, e0, e1, r_lo, r_hi, rows, offs_m, m_mask, SWAP)
        if (r_lo < e2) & (r_hi > e1) & (e2 > e1):
            _store_seg(acc, o2, s2, e1, e2, r_lo, r_hi, rows, offs_m, m_mask, SWAP)
        if (r_lo < e3) & (r_hi > e2) & (e3 > e2):
            _store_seg(acc, o3, s3, e2, e3, r_lo, r_hi, rows, offs_m, m_mask, SWAP)
        if (r_lo < e4) & (r_hi > e3) & (e4 > e3):
            _store_seg(acc, o4, s4, e3, e4, r_lo, r_hi, rows, offs_m, m_mask, SWAP)

    @triton.jit
    def _fp8_scales(sc_ptr, stride_sc, lo, offs_n, n_mask, kb, FOLD: tl.constexpr):
        """The fp32 scales of K block ``kb`` for a tile's rows: one value when the tile lies in
        one 128-row scale block (FOLD), else one per row."""
        if FOLD:
            return tl.load(sc_ptr + (lo // 128) * stride_sc + kb)
        else:
            return tl.load(sc_ptr + (offs_n // 128) * stride_sc + kb, mask=n_mask, other=0.0)

    @triton.jit
    def _group(x_ptr, stride_xm, M, K, w_ptr, sc_ptr, stride_sc, ws_ptr, cnt_ptr, m_ws, n_total,
               o0, s0, o1, s1, o2, s2, o3, s3, o4, s4, e0, e1, e2, e3, e4,
               lo, hi, row_base, split, pid_m, cnt_idx,
               IS_FP8: tl.constexpr, FOLD: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
               BK: tl.constexpr, SPLIT_K: tl.constexpr, SWAP: tl.constexpr,
               USE_PDL: tl.constexpr, PREFETCH: tl.constexpr, FENCE: tl.constexpr,
               ACT: tl.constexpr, INTERP: tl.constexpr, DOT_DT: tl.constexpr,
               DOT_PREC: tl.constexpr):
        offs_n = lo + tl.arange(0, BN)  # rows of this weight tensor
        n_mask = offs_n < hi
        offs_m = pid_m * BM + tl.arange(0, BM)
        m_mask = offs_m < M
        offs_k = tl.arange(0, BK)
        nkb = K // BK
        kb0 = split * nkb // SPLIT_K
        kb1 = (split + 1) * nkb // SPLIT_K
        w_ptrs = w_ptr + offs_n[:, None] * K + (kb0 * BK + offs_k)[None, :]
        if SWAP:
            x_ptrs = x_ptr + offs_m[None, :] * stride_xm + (kb0 * BK + offs_k)[:, None]
            acc = tl.zeros([BN, BM], dtype=tl.float32)
        else:
            x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (kb0 * BK + offs_k)[None, :]
            acc = tl.zeros([BM, BN], dtype=tl.float32)
        if USE_PDL:
            if PREFETCH > 0:  # weights do not depend on the previous kernel: start streaming
                row_addr = (w_ptr + offs_n * K + kb0 * BK).to(tl.int64, bitcast=True)
                _prefetch_l2(tl.where(n_mask, row_addr, 0), PREFETCH)
            tl.extra.cuda.gdc_wait()  # the next kernel may launch at the kernel's end
        if IS_FP8:  # each block's scale is read one iteration ahead (fp8_linear's reason)
            sc_next = _fp8_scales(sc_ptr, stride_sc, lo, offs_n, n_mask, tl.minimum(kb0, nkb - 1),
                                  FOLD)
        for kb in range(kb0, kb1):
            w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0, eviction_policy="evict_first")
            if SWAP:
                xt = tl.load(x_ptrs, mask=m_mask[None, :], other=0.0)
            else:
                xt = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            # DOT_DT: bf16 on a GPU (the loads' own type: no conversion); float32 under the
            # interpreter, whose bf16 dot is wrong (products of bf16 / e4m3 values are exact
            # in fp32 either way)
            if IS_FP8:
                wb = w.to(DOT_DT)  # e4m3 -> bf16 is exact
                if ACT:  # §6.3: x quantised per token and 128-wide block, dequantised (exact
                    # in bf16): the bf16 MMA then gives the official product
                    xq, sx = act_quant_block(xt.to(tl.float32), 0 if SWAP else 1, INTERP)
                    if SWAP:
                        xt = (xq.to(tl.float32) * sx[None, :]).to(DOT_DT)
                    else:
                        xt = (xq.to(tl.float32) * sx[:, None]).to(DOT_DT)
                else:
                    xt = xt.to(DOT_DT)
                sc = sc_next
                sc_next = _fp8_scales(sc_ptr, stride_sc, lo, offs_n, n_mask,
                                      tl.minimum(kb + 1, kb1 - 1), FOLD)
                if FOLD:  # the tile lies in one 128-row scale block; a power of two: exact
                    xs = (xt.to(tl.float32) * sc).to(DOT_DT)
                    if SWAP:  # noqa: SIM108
                        acc = tl.dot(wb, xs, acc, input_precision=DOT_PREC)
                    else:
                        acc = tl.dot(xs, tl.trans(wb), acc, input_precision=DOT_PREC)
                else:
                    if SWAP:
                        acc += tl.dot(wb, xt, input_precision=DOT_PREC) * sc[:, None]
                    else:
                        acc += tl.dot(xt, tl.trans(wb), input_precision=DOT_PREC) * sc[None, :]
            else:
                w = w.to(DOT_DT)
                xt = xt.to(DOT_DT)
                if SWAP:  # noqa: SIM108
                    acc = tl.dot(w, xt, acc, input_precision=DOT_PREC)
                else:
                    acc = tl.dot(xt, tl.trans(w), acc, input_precision=DOT_PREC)
            w_ptrs += BK
            x_ptrs += BK

        rows = row_base + offs_n  # global row ids = output columns
        r_lo = row_base + lo
        r_hi = row_base + hi
        if SPLIT_K == 1:
            _write_out(acc, rows, r_lo, r_hi, offs_m, m_mask,
                       o0, s0, o1, s1, o2, s2, o3, s3, o4, s4, e0, e1, e2, e3, e4, SWAP)
        else:
            if SWAP:
                p_off = offs_m[None, :] * n_total + rows[:, None]
                p_mask = n_mask[:, None] & m_mask[None, :]
            else:
                p_off = offs_m[:, None] * n_total + rows[None, :]
                p_mask = m_mask[:, None] & n_mask[None, :]
            slab = m_ws * n_total
            tl.store(ws_ptr + split * slab + p_off, acc, mask=p_mask)
            if FENCE:
                _fence_gpu()
            tl.debug_barrier()
            old = tl.atomic_add(cnt_ptr + cnt_idx, 1, sem="acq_rel", scope="gpu")
            if old == SPLIT_K - 1:  # last to arrive: sum the partials in split order
                if FENCE:
                    _fence_gpu()
                tot = tl.zeros_like(acc)
                for s in tl.static_range(SPLIT_K):
                    tot += tl.load(ws_ptr + s * slab + p_off, mask=p_mask, other=0.0,
                                   cache_modifier=".cg")
                _write_out(tot, rows, r_lo, r_hi, offs_m, m_mask,
                           o0, s0, o1, s1, o2, s2, o3, s3, o4, s4, e0, e1, e2, e3, e4, SWAP)
                tl.atomic_xchg(cnt_ptr + cnt_idx, 0, sem="relaxed", scope="gpu")

    _RUNTIME_INTS = ["M", "n16", "n8", "m_ws", "s0", "s1", "s2", "s3", "s4", "e0", "e1", "e2",
                     "e3", "e4", "m_tiles", "g16", "g8", "stride_sc"]

    @triton.jit(do_not_specialize=_RUNTIME_INTS)
    def fused_input_proj_kernel(
        x_ptr, stride_xm, M, K,
        w_ptr, n16, w8_ptr, sc_ptr, stride_sc, n8,
        ws_ptr, cnt_ptr, m_ws,
        o0, s0, o1, s1, o2, s2, o3, s3, o4, s4, e0, e1, e2, e3, e4,
        m_tiles, g16, g8,
        BM: tl.constexpr, BN: tl.constexpr, BN8: tl.constexpr, BK: tl.constexpr,
        SPLIT_K: tl.constexpr, SWAP: tl.constexpr, HAS_FP8: tl.constexpr, FOLD: tl.constexpr,
        USE_PDL: tl.constexpr, PREFETCH: tl.constexpr, FENCE: tl.constexpr,
        ACT: tl.constexpr = False, INTERP: tl.constexpr = False,
        DOT_DT: tl.constexpr = tl.bfloat16, DOT_PREC: tl.constexpr = "tf32",
    ):
        pid = tl.program_id(0)
        pid_m = pid % m_tiles
        rest = pid // m_tiles
        grp = rest // SPLIT_K
        split = rest % SPLIT_K
        cnt_idx = pid_m * (g8 + g16) + grp
        n_total = n8 + n16
        if HAS_FP8 and grp < g8:
            lo = grp * n8 // g8
            hi = (grp + 1) * n8 // g8
            _group(x_ptr, stride_xm, M, K, w8_ptr, sc_ptr, stride_sc, ws_ptr, cnt_ptr, m_ws,
                   n_total, o0, s0, o1, s1, o2, s2, o3, s3, o4, s4, e0, e1, e2, e3, e4,
                   lo, hi, 0, split, pid_m, cnt_idx,
                   True, FOLD, BN8, BM, 128, SPLIT_K, SWAP, USE_PDL, PREFETCH // 2, FENCE,
                   ACT, INTERP, DOT_DT, DOT_PREC)
        else:
            g = grp - g8
            lo = g * n16 // g16
            hi = (g + 1) * n16 // g16
            _group(x_ptr, stride_xm, M, K, w_ptr, sc_ptr, stride_sc, ws_ptr, cnt_ptr, m_ws,
                   n_total, o0, s0, o1, s1, o2, s2, o3, s3, o4, s4, e0, e1, e2, e3, e4,
                   lo, hi, n8, split, pid_m, cnt_idx,
                   False, False, BN, BM, BK, SPLIT_K, SWAP, USE_PDL, PREFETCH, FENCE,
                   False, INTERP, DOT_DT, DOT_PREC)
        let_next_kernel_launch(USE_PDL)

    @triton.jit(do_not_specialize=["M", "s0", "s1", "s2", "s3", "s4", "e0", "e1", "e2", "e3",
                                   "e4"])
    def scatter_kernel(y_ptr, M, n_total,
                       o0, s0, o1, s1, o2, s2, o3, s3, o4, s4, e0, e1, e2, e3, e4,
                       BM: tl.constexpr, BN: tl.constexpr, PDL: tl.constexpr = False):
        """Cast/split the fp32 GEMM output y [M, n_total] into the segment outputs."""
        wait_for_prior_kernel(PDL)
        offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
        c0 = tl.program_id(1) * BN
        cols = c0 + tl.arange(0, BN)
        m_mask = offs_m < M
        y = tl.load(y_ptr + offs_m[:, None] * n_total + cols[None, :],
                    mask=m_mask[:, None] & (cols < n_total)[None, :], other=0.0)
        _write_out(y, cols, c0, tl.minimum(c0 + BN, n_total), offs_m, m_mask,
                   o0, s0, o1, s1, o2, s2, o3, s3, o4, s4, e0, e1, e2, e3, e4, False)
        let_next_kernel_launch(PDL)


def _kernel():
    return fused_input_proj_kernel


class SplitKWorkspace:
    """fp32 partials and arrival counters for split-K launches; grows on demand.

    One workspace may serve every layer that runs on one stream (launches are ordered and each
    launch leaves its counters at zero). Grow it before CUDA-graph capture (one eager call at
    the largest M), since it cannot be allocated during capture.
    """

    def __init__(self) -> None:
        self.partials: torch.Tensor | None = None
        self.counters: torch.Tensor | None = None
        self._retired: list[torch.Tensor] = []
        """Buffers replaced by a growth, kept alive: a CUDA graph captured before the growth
        still points at them (it never runs concurrently with newer launches of the stream)."""

    def get(self, device, n_partials: int, n_counters: int) -> tuple[torch.Tensor, torch.Tensor]:
        grow_p = self.partials is None or self.partials.numel() < n_partials
        grow_c = self.counters is None or self.counters.numel() < n_counters
        if grow_p or grow_c:
            if torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("fused_input_projections: the split-K workspace must grow "
                                   "before CUDA-graph capture; run one eager call first")
            old = (self.partials if grow_p else None, self.counters if grow_c else None)
            self._retired += [t for t in old if t is not None]
            if grow_p:
                self.partials = torch.empty(n_partials, device=device, dtype=torch.float32)
            if grow_c:
                self.counters = torch.zeros(n_counters, device=device, dtype=torch.int32)
        assert self.partials is not None and self.counters is not None
        return self.partials, self.counters


def _check_outputs(out, packed, M, device):
    if len(out) != len(packed.segments):
        raise ValueError(f"out: expected {len(packed.segments)} tensors, got {len(out)}")
    for o, seg in zip(out, packed.segments, strict=True):
        if tuple(o.shape) != (M, seg.rows) or o.dtype != seg.out_dtype or o.device != device:
            raise ValueError(f"out[{seg.name!r}]: expected ({M}, {seg.rows}) {seg.out_dtype} on "
                             f"{device}, got {tuple(o.shape)} {o.dtype} on {o.device}")
        if seg.rows > 1 and o.stride(1) != 1:
            raise ValueError(f"out[{seg.name!r}]: columns must be contiguous")


# canonical output dtype per slot (the DSV4 C4 order): unused slots get a dummy of this dtype so
# that C4, C128 and SWA layers share one compiled kernel
_SLOT_DTYPES = (torch.bfloat16, torch.float32, torch.float32, torch.bfloat16, torch.float32)


def _out_args(packed: PackedInputWeights, out: list[torch.Tensor]) -> list:
    ends = list(itertools.accumulate(s.rows for s in packed.segments))
    dummies = packed._workspace.setdefault(("dummy", str(out[0].device)), {})
    oargs: list = []
    for i in range(MAX_SEGMENTS):
        if i < len(out):
            oargs += [out[i], out[i].stride(0)]
        else:
            dt = _SLOT_DTYPES[i]
            if dt not in dummies:
                dummies[dt] = torch.empty(16, device=out[0].device, dtype=dt)
            oargs += [dummies[dt], 0]
    return oargs + ends + [ends[-1]] * (MAX_SEGMENTS - len(out))


def fused_input_projections(
    x: torch.Tensor,
    packed: PackedInputWeights,
    out: list[torch.Tensor] | None = None,
    *,
    config: KernelConfig | None = None,
    workspace: SplitKWorkspace | None = None,
    act_quant: bool = False,
) -> list[torch.Tensor]:
    """y_s = x @ W_s^T for every segment s, in one launch; returns one tensor per segment.
    ``act_quant``: the fp8 segment's x quantised in the kernel as the official code does
    (docs/spec.md §6.3; the result is ``fp8_block_sim(x, 128)``'s product), the bf16
    segments' x as it is; needs an fp8 segment.

    Pass ``out`` (same shapes/dtypes as returned) to reuse buffers, e.g. under CUDA graphs. A
    split-K launch needs a ``workspace`` (default: one cached on ``packed``; layers on one stream
    can share one): run one eager call at the largest M before capturing a graph, and never run
    two launches that share a workspace concurrently. Large M with bf16 weights runs as one
    cuBLAS fp32 GEMM plus one scatter/cast launch.
    """
    if x.dim() != 2 or x.shape[1] != packed.K:
        raise ValueError(f"x must be [M, {packed.K}], got {tuple(x.shape)}")
    M = int(x.shape[0])
    if out is None:
        out = [torch.empty(M, s.rows, device=x.device, dtype=s.out_dtype) for s in packed.segments]
    else:
        _check_outputs(out, packed, M, x.device)
    if act_quant and packed.fp8_weight is None:
        raise ValueError("act_quant quantises the fp8 segment's input; this pack has none")
    if M == 0:
        return out
    if not triton_available() or (x.device.type != "cuda" and not _interpreting()):
        for o, r in zip(out, fused_input_projections_as_modules(x, packed, act_quant),
                        strict=True):
            o.copy_(r)
        return out
    if x.dtype != torch.bfloat16 and not _interpreting():
        raise ValueError(f"x must be bf16, got {x.dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    has_fp8 = packed.fp8_weight is not None
    if config is None and not has_fp8 and len(packed.segments) == 1 \
            and packed.segments[0].out_dtype == torch.bfloat16:
        # one bf16 GEMM (SWA layer): nothing to fuse, and cuBLAS measured faster
        torch.mm(x, packed.weight.t(), out=out[0])
        return out
    cfg = config or choose_config(M, packed, _n_sm(x.device))
    K = packed.K
    oargs = _out_args(packed, out)
    if cfg.cublas:
        if has_fp8:
            raise ValueError("the cuBLAS path takes bf16 weights only")
        y = torch.mm(x, packed.weight.t(), out_dtype=torch.float32)
        grid = (-(-M // 32), -(-packed.n_total // 128))
        launch(scatter_kernel, grid, y, M, packed.n_total, *oargs, BM=32, BN=128, num_warps=4,
               **pdl_args(y.device))
        return out
    if K % cfg.block_k or (has_fp8 and K % 128):
        raise ValueError(f"K={K} is not a multiple of block_k={cfg.block_k} (and 128 for fp8)")
    bn8 = cfg.block_n8 or 2 * cfg.block_n
    m_tiles = -(-M // cfg.block_m)
    g16 = (cfg.groups or -(-packed.n_bf16 // cfg.block_n)) if packed.n_bf16 else 0
    g8 = (cfg.groups8 or -(-packed.n_fp8 // bn8)) if has_fp8 else 0
    if (g16 and -(-packed.n_bf16 // g16) > cfg.block_n) or (g8 and -(-packed.n_fp8 // g8) > bn8):
        raise ValueError(f"config {cfg}: groups too few for the tile")
    # scale folding needs every fp8 tile inside one 128-row scale block and power-of-two scales
    fold = bool(has_fp8 and packed.fp8_scale_pow2 and 128 % bn8 == 0
                and packed.n_fp8 == g8 * bn8)
    n_total = packed.n_total
    m_ws = m_tiles * cfg.block_m
    if cfg.split_k > 1:
        if workspace is None:
            workspace = packed._workspace.setdefault(str(x.device), SplitKWorkspace())
        ws, cnt = workspace.get(x.device, cfg.split_k * m_ws * n_total, m_tiles * (g8 + g16))
    else:
        ws, cnt = x, x  # unused
    w8 = packed.fp8_weight if has_fp8 else packed.weight
    sc = packed.fp8_scale if has_fp8 else packed.weight
    stride_sc = packed.fp8_scale.stride(0) if packed.fp8_scale is not None else 0
    grid1 = (m_tiles * (g8 + g16) * cfg.split_k,)
    # PDL: the config's probe option or the process-wide switch (dsv4.kernels.launch)
    pdl = cfg.pdl or pdl_args(x.device)["PDL"]
    launch_kw = {"launch_pdl": True} if pdl else {}
    # L2 prefetch per weight row: within this program's K range, a multiple of 32 bytes
    pf = min(cfg.prefetch, (K // cfg.split_k) * 2) // 32 * 32 if cfg.pdl else 0
    launch(fused_input_proj_kernel, grid1,
        x, x.stride(0), M, K,
        packed.weight, packed.n_bf16, w8, sc, stride_sc, packed.n_fp8,
        ws, cnt, m_ws,
        *oargs,
        m_tiles, g16, g8,
        BM=cfg.block_m, BN=cfg.block_n, BN8=bn8, BK=cfg.block_k,
        SPLIT_K=cfg.split_k, SWAP=cfg.swap, HAS_FP8=has_fp8, FOLD=fold, USE_PDL=pdl,
        PREFETCH=pf, FENCE=not _interpreting(), ACT=act_quant, INTERP=_interpreting(),
        DOT_DT=tl.float32 if _interpreting() else tl.bfloat16,
        DOT_PREC="ieee" if _interpreting() else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_kw,
    )
    return out


@functools.lru_cache(maxsize=8)
def _n_sm_idx(idx: int) -> int:
    return torch.cuda.get_device_properties(idx).multi_processor_count


def _n_sm(device: torch.device) -> int:
    return _n_sm_idx(device.index if device.index is not None else torch.cuda.current_device())
