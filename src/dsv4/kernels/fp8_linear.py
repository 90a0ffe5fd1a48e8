"""fp8 weight-streaming GEMMs: y = x @ W^T with W kept as e4m3 + ue8m0 128x128 block scales.

Entry points:

* ``fp8_linear(x [M, K] bf16, weight [N, K] float8_e4m3fn, scale [N/128, K/128]) -> y [M, N]``
* ``fp8_grouped_linear(x [M, G, Kg], weight [G*R, Kg], scale [G*R/128, Kg/128]) -> y [M, G, R]``:
  group g multiplies x[:, g, :] by weight rows g*R .. g*R + R - 1 (``wo_a``: o viewed as
  [M, G, heads/G * head_dim]), all groups in one launch.
* ``fp8_linear_reference`` / ``fp8_grouped_linear_reference``: dequantise + matmul (the oracle,
  and the path taken on a machine without Triton or off CUDA).
* ``fp8_dequantize(weight, scale) -> [N, K] bf16``: the dequantised weight in one pass (read
  e4m3 + scales, write bf16), for long calls that run a bf16 GEMM on it: the same values as
  :func:`dsv4.layers.fp8.dequantize_fp8_block` (whose PyTorch ops take two passes).

``scale`` is ``torch.float8_e8m0fnu`` (byte e means 2^(e-127); it multiplies), raw ``uint8`` bytes
of the same meaning, or float32 (any positive value). N, K (R, Kg) must be multiples of 128.
Output bf16 (default) or float32 (``out_dtype``), accumulation in fp32.

Numerics: per 128-wide K block the kernel widens the e4m3 tile to bf16 (exact), forms the block
product with one MMA (fp32 accumulation) and adds it times the block's scale to the fp32
accumulator. An e4m3 value times 2^k is exactly representable in bf16 (4 significant bits, the
exponent stays in range for every realistic k), so with ue8m0 scales the result equals the bf16
GEMM with the dequantised weight up to the order of the fp32 additions, and multiplying a
block product by 2^k is exact too. (Under Triton's CPU interpreter the MMA runs on fp32
operands: the interpreter's bf16 dot is wrong on the test install (torch 2.13, Triton 3.6,
NumPy 2.4); the products are the same exact values.) The weight must be in the canonical [N, K]
row-major layout (not a preshuffled one).

How the work is cut (the weights are streamed once; decode M is tiny): programs = M tiles x
weight row tiles x K splits. With split-K > 1 every program writes an fp32 partial to a workspace
and the last program of a tile to arrive (acq_rel counter) sums the partials in split order and
writes y: deterministic, graph-replayable (the counter is reset), no float atomics - the same
protocol as :mod:`dsv4.kernels.fused_input_proj`. Small M uses the swapped MMA (weight rows on the
MMA's M side, x^T as the narrow N side); larger M uses plain tiles. ``choose_config`` picks by M.
``Fp8GemmConfig(act_fp8=True)`` changes the numerics to the official FP8 linear's
(docs/spec.md §6.3): each token's 128-wide K block of x is quantised in the kernel to e4m3
with the power-of-two scale 2^ceil(log2(max(amax, 1e-4) / 448)) (RNE, clamped to +-448) and
multiplied by the e4m3 weight tile with an fp8 x fp8 MMA; block products times both scales sum
in fp32. Equal to the product of ``fp8_block_sim(x, 128)`` and the dequantised weight up to the
order of the fp32 additions (the off-GPU fallback computes exactly that; on Hopper the fp8 MMA
keeps about 14 bits of a block's running sum, ~1e-4 relative). The cuda platform runs it under
``cfg.act_quant`` (:mod:`dsv4.platforms.cuda_linears`), with the tiles
``choose_fp8_config(act_fp8=True)`` picks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from dsv4.kernels.bound_launch import launch
from dsv4.kernels.fused_input_proj import SplitKWorkspace
from dsv4.kernels.launch import _INTERPRET, pdl_args, triton_available
from dsv4.layers.fp8 import e8m0_to_float
from dsv4.layers.quant_sim import fp8_block_quantize, fp8_block_sim

__all__ = [
    "Fp8GemmConfig",
    "block_scale_values",
    "choose_fp8_config",
    "fp8_dequantize",
    "fp8_grouped_linear",
    "fp8_grouped_linear_reference",
    "fp8_linear",
    "fp8_linear_reference",
    "quantize_activations",
    "simulate_activations",
]

BLOCK = 128


# ---------------------------------------------------------------------------------- reference


def block_scale_values(scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A weight's 128x128 block scales as ``dtype`` values: ``float8_e8m0fnu``, its raw
    ``uint8`` bytes (the same meaning) or float (taken as it is)."""
    return e8m0_to_float(scale.view(torch.float8_e8m0fnu) if scale.dtype == torch.uint8
                         else scale, dtype)


def _dequant(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    n, k = weight.shape
    sf = block_scale_values(scale, dtype)
    w = weight.to(dtype).view(n // BLOCK, BLOCK, k // BLOCK, BLOCK) * sf[:, None, :, None]
    return w.view(n, k)


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                         out_dtype: torch.dtype = torch.bfloat16,
                         acc_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x [M, K] @ dequant(weight, scale)^T in ``acc_dtype`` (float32 or float64), cast."""
    _check_weight(weight, scale)
    return (x.to(acc_dtype) @ _dequant(weight, scale, acc_dtype).t()).to(out_dtype)


def fp8_grouped_linear_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                                 out_dtype: torch.dtype = torch.bfloat16,
                                 acc_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """y[m, g] = x[m, g] @ W_g^T with W_g = rows g*R .. g*R+R-1 of the dequantised weight."""
    _check_weight(weight, scale)
    M, G, Kg = x.shape
    w = _dequant(weight, scale, acc_dtype).view(G, -1, Kg)
    return torch.einsum("mgk,grk->mgr", x.to(acc_dtype), w).to(out_dtype)


def _check_weight(weight: torch.Tensor, scale: torch.Tensor) -> None:
    if weight.dim() != 2 or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"weight must be 2-D float8_e4m3fn, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    n, k = weight.shape
    if n % BLOCK or k % BLOCK:
        raise ValueError(f"weight {tuple(weight.shape)}: N and K must be multiples of {BLOCK}")
    if tuple(scale.shape) != (n // BLOCK, k // BLOCK):
        raise ValueError(f"scale shape {tuple(scale.shape)} != {(n // BLOCK, k // BLOCK)}")
    if scale.dtype not in (torch.float8_e8m0fnu, torch.uint8, torch.float32):
        raise ValueError(f"scale must be float8_e8m0fnu, uint8 bytes or float32, got {scale.dtype}")


# ---------------------------------------------------------------------------------- config


@dataclass(frozen=True)
class Fp8GemmConfig:
    block_m: int = 16
    block_n: int = 64  # weight rows per program tile; divides 128 or is 128
    split_k: int = 1
    swap: bool = True  # weight rows on the MMA's M side (small M)
    num_warps: int = 4
    num_stages: int = 3
    act_fp8: bool = False  # activations quantised to e4m3 per 128 (§6.3): fp8 x fp8 MMAs


SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)
"""The split-K counts :func:`choose_fp8_config` picks from 33 to 128 tokens (rounded down to one
of them): the ones its tile sweep measured."""

MIN_BLOCKS_PER_PROGRAM = 8
"""From 33 to 128 tokens no split leaves a program fewer 128-wide K blocks than this: shorter
programs never fill their pipeline, and each split adds a partial's write and read (H100 sweep,
2026-12-07: the indexer's ``wq_b``, K = 1024, at 64 tokens 10.4 us in 2 splits, 5.7 in one)."""


def choose_fp8_config(M: int, n_rows: int, K: int, n_sm: int = 132, act_fp8: bool = False
                      ) -> Fp8GemmConfig:
    """The tiles of an ``M``-token call: a small table by M. ``n_rows`` = all weight rows
    (G*R), ``K`` = the per-row length, ``act_fp8``: the activations quantised to e4m3 (§6.3;
    from 33 tokens the cuda platform passes them quantised once, ``x_scales``).

    * M <= 32: swapped tiles (weight rows on the MMA's M side) of 16 or 32 tokens x 64 rows, K
      split so that about 3 programs per SM stream equal bytes and none streams more than 16
      K blocks; at most 16 tokens under ``act_fp8``, 128-row tiles at half that split where
      they still give 1.5 programs per SM (the q projections, Pro ``wo_b``). 3 pipeline
      stages (H200 GEMM probes, 2026-12-03).
    * 32 < M <= 128: 64 x 64 tiles of 4 warps and 4 pipeline stages, non-swapped under
      ``act_fp8`` (swapped for bf16 activations: ``wo_a``; the other GEMMs on bf16 x, with
      ``act_quant`` off, take that tile unmeasured), about 2 programs per SM, none under
      :data:`MIN_BLOCKS_PER_PROGRAM` K blocks. From the tile sweep of every Flash / Pro
      C4 GEMM as the layer calls it (H100, 2026-12-07, ``benchmarks/results/2026-12-07-h100/
      gemm-tiles/``): at 64 tokens Flash ``wo_b`` 22.1 -> 19.6 us, ``wo_a`` 30.1 -> 25.5, the
      indexer's ``wq_b`` 10.4 -> 5.7, Pro ``wo_b`` 59.8 -> 53.0 against the tiles this
      replaced (64 x 128 of 8 warps, or swapped), within 10 % of the sweep's best tile on every
      shape at 64 and 128 tokens; in the layer, one C4 layer's graph, a step of 64 tokens 10-20
      us faster (``decode-step-verify/gemm-tiles/``).
    * M > 128: 64 x 128 non-swapped tiles of 8 warps, split only where the tiles alone leave
      SMs idle; 4 stages under ``act_fp8`` (verify steps of 128 tokens, 2026-12-07). The long
      calls' route takes over at the platform's ``fp8_gemm_max_tokens``.

    The sweep's own winners at <= 32 tokens (the indexer's ``wq_b`` unsplit, 4 stages for Pro's
    ``wq_b``, 128-row tiles at 17-32 tokens) lost in the layer at 64K context: one-token steps
    3.5-13 us slower, where the indexer's GEMM runs on a side stream beside the q heads' GEMM
    (at 512, Pro 2-4 us faster). They are not taken.
    """
    nkb = K // BLOCK

    if M > 128:
        tiles = -(-M // 64) * (n_rows // 128)
        return Fp8GemmConfig(block_m=64, block_n=128,
                             split_k=max(1, min(nkb, -(-n_sm // tiles), 16)), swap=False,
                             num_warps=8, num_stages=4 if act_fp8 else 3, act_fp8=act_fp8)
    if M > 32:
        tiles = -(-M // 64) * (n_rows // 64)
        want = max(1, min(round(2 * n_sm / tiles), nkb // MIN_BLOCKS_PER_PROGRAM, 16))
        return Fp8GemmConfig(block_m=64, block_n=64, split_k=max(s for s in SPLITS if s <= want),
                             swap=not act_fp8, num_warps=4, num_stages=4, act_fp8=act_fp8)
    bm = 16 if M <= 16 else 32
    tiles = n_rows // 64
    split = max(1, min(max(-(-3 * n_sm // tiles), -(-nkb // 16)), nkb, 16))
    bn = 64
    if act_fp8 and M <= 16 and (n_rows // 128) * max(1, split // 2) >= 1.5 * n_sm:
        bn, split = 128, max(1, split // 2)
    return Fp8GemmConfig(block_m=bm, block_n=bn, split_k=split, swap=True, num_warps=4,
                         num_stages=3, act_fp8=act_fp8)


# ---------------------------------------------------------------------------------- kernel

if triton_available():
    import triton
    import triton.language as tl

    from dsv4.kernels.launch import let_next_kernel_launch, wait_for_prior_kernel

    if _INTERPRET:
        from dsv4.kernels._interpreter import patch_interpreter_index

        patch_interpreter_index()

    from dsv4.kernels._float_bits import (
        FP8_FLOOR,
        FP8_MAX,
        act_quant_block,
        e4m3_bytes,
        pow2,
        rounded,
        scale_exponent,
        ue8m0,
    )
    from dsv4.kernels.fused_input_proj import _fence_gpu

    @triton.jit
    def _scale_raw(sc_ptr, idx, SCALE_F32: tl.constexpr):
        """The stored scale of block ``idx`` as loaded: the float32 or the e8m0 byte."""
        return tl.load(sc_ptr + idx)

    @triton.jit
    def _scale_value(raw, SCALE_F32: tl.constexpr):
        """The multiplier of a stored scale (:func:`_scale_raw`)."""
        if SCALE_F32:
            v = raw
        else:
            b = raw.to(tl.int32)
            v = tl.where(b == 255, float("nan"), ue8m0(b))  # byte 255 is the format's NaN
        return v

    @triton.jit
    def _quantized_x(x_ptrs, mask, INTERP: tl.constexpr):
        """A tile of pre-quantised x (e4m3 bytes; 0 where masked) as the fp8 MMA's operand,
        or (interpreted) its values as float32."""
        xq = tl.load(x_ptrs, mask=mask, other=0).to(tl.float8e4nv, bitcast=True)
        if INTERP:
            xq = xq.to(tl.float32)
        return xq

    @triton.jit
    def _gemm_tile(x_ptr, sxm, sxg, w_ptr, sc_ptr, stride_sc, y_ptr, sym, syg, ws_ptr, cnt_ptr,
                   M, R, Kg, m_ws, n_tiles, G, xs_ptr, sxs, pid_m, tile, split,
                   BM: tl.constexpr, BN: tl.constexpr, SPLIT_K: tl.constexpr,
                   SWAP: tl.constexpr, SCALE_F32: tl.constexpr, FENCE: tl.constexpr,
                   DOT_DT: tl.constexpr, DOT_PREC: tl.constexpr, ACT_FP8: tl.constexpr,
                   X_FP8: tl.constexpr, INTERP: tl.constexpr):
        """One program's share of the GEMM: K split ``split`` of output tile ``tile`` (group g
        = tile // n_tiles, its row tile n0 = (tile % n_tiles) * BN) for token tile ``pid_m``;
        with SPLIT_K > 1 the partial goes to the workspace and the last split to arrive sums
        them in split order."""
        BK: tl.constexpr = 128
        g = tile // n_tiles
        n0 = (tile % n_tiles) * BN  # first row within the group
        row0 = g * R + n0  # first row of the weight
        offs_n = tl.arange(0, BN)
        offs_m = pid_m * BM + tl.arange(0, BM)
        m_mask = offs_m < M
        offs_k = tl.arange(0, BK)
        nkb = Kg // BK
        kb0 = split * nkb // SPLIT_K
        kb1 = (split + 1) * nkb // SPLIT_K
        w_ptrs = w_ptr + (row0 + offs_n).to(tl.int64)[:, None] * Kg + (kb0 * BK + offs_k)[None, :]
        x_base = x_ptr + g * sxg
        if SWAP:
            x_ptrs = x_base + offs_m[None, :] * sxm + (kb0 * BK + offs_k)[:, None]
            acc = tl.zeros([BN, BM], dtype=tl.float32)
        else:
            x_ptrs = x_base + offs_m[:, None] * sxm + (kb0 * BK + offs_k)[None, :]
            acc = tl.zeros([BM, BN], dtype=tl.float32)
        sc_row = sc_ptr + (row0 // BK) * stride_sc
        # each block's scale is read one iteration ahead and decoded where it is used: a scale
        # load inside the iteration that needs it held the iteration (and the next tile's
        # copy) for a global-load latency
        raw_next = _scale_raw(sc_row, kb0, SCALE_F32)
        for kb in range(kb0, kb1):
            s = _scale_value(raw_next, SCALE_F32)
            raw_next = _scale_raw(sc_row, tl.minimum(kb + 1, kb1 - 1), SCALE_F32)
            if ACT_FP8:
                # fp8 x fp8 MMA (the weight tile as stored), each token's block product times
                # its activation scale and the weight block's scale; interpreted: fp32 operands
                # of the same values. X_FP8: x arrives quantised (e4m3 bytes, float32 scales
                # [M, Kg / 128]), else each program quantises its tile here
                w = tl.load(w_ptrs, eviction_policy="evict_first")
                if INTERP:
                    w = w.to(tl.float32)
                if X_FP8:
                    sx = tl.load(xs_ptr + offs_m * sxs + kb, mask=m_mask, other=0.0)
                if SWAP:
                    if X_FP8:
                        xq = _quantized_x(x_ptrs, m_mask[None, :], INTERP)
                    else:
                        xt = tl.load(x_ptrs, mask=m_mask[None, :], other=0.0).to(tl.float32)
                        xq, sx = act_quant_block(xt, 0, INTERP)
                    acc += tl.dot(w, xq, input_precision=DOT_PREC) * (sx * s)[None, :]
                else:
                    if X_FP8:
                        xq = _quantized_x(x_ptrs, m_mask[:, None], INTERP)
                    else:
                        xt = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0).to(tl.float32)
                        xq, sx = act_quant_block(xt, 1, INTERP)
                    acc += tl.dot(xq, tl.trans(w), input_precision=DOT_PREC) * (sx * s)[:, None]
            else:
                # e4m3 -> bf16 is exact; under the interpreter the MMA runs in fp32 (its bf16
                # dot of a converted operand is wrong); the products are exact in fp32 either way
                w = tl.load(w_ptrs, eviction_policy="evict_first").to(DOT_DT)
                if SWAP:
                    xt = tl.load(x_ptrs, mask=m_mask[None, :], other=0.0).to(DOT_DT)
                    acc += tl.dot(w, xt, input_precision=DOT_PREC) * s
                else:
                    xt = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0).to(DOT_DT)
                    acc += tl.dot(xt, tl.trans(w), input_precision=DOT_PREC) * s
            w_ptrs += BK
            x_ptrs += BK
        cols = n0 + offs_n  # output column within the group
        if SWAP:
            y_ptrs = y_ptr + offs_m[None, :] * sym + g * syg + cols[:, None]
            y_mask = m_mask[None, :] & (cols < R)[:, None]
            p_off = offs_m[None, :] * R + cols[:, None]
        else:
            y_ptrs = y_ptr + offs_m[:, None] * sym + g * syg + cols[None, :]
            y_mask = m_mask[:, None] & (cols < R)[None, :]
            p_off = offs_m[:, None] * R + cols[None, :]
        if SPLIT_K == 1:
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
        else:
            # partials: ws[split, group, m, col] (fp32), one slab per split
            G_slab = m_ws * R
            slab = G * G_slab
            p_base = ws_ptr + g * G_slab
            tl.store(p_base + split * slab + p_off, acc, mask=y_mask)
            if FENCE:
                _fence_gpu()
            tl.debug_barrier()
            cnt_idx = pid_m * (G * n_tiles) + tile
            old = tl.atomic_add(cnt_ptr + cnt_idx, 1, sem="acq_rel", scope="gpu")
            if old == SPLIT_K - 1:  # last to arrive: sum in split order
                if FENCE:
                    _fence_gpu()
                tot = tl.zeros_like(acc)
                for s_i in tl.static_range(SPLIT_K):
                    tot += tl.load(p_base + s_i * slab + p_off, mask=y_mask, other=0.0,
                                   cache_modifier=".cg")
                tl.store(y_ptrs, tot.to(y_ptr.dtype.element_ty), mask=y_mask)
                tl.atomic_xchg(cnt_ptr + cnt_idx, 0, sem="relaxed", scope="gpu")

    @triton.jit(do_not_specialize=["M", "m_ws", "m_tiles"])
    def _fp8_gemm_kernel(
        x_ptr, sxm, sxg, w_ptr, sc_ptr, stride_sc, y_ptr, sym, syg, ws_ptr, cnt_ptr,
        M, R, Kg, m_ws, n_tiles, m_tiles, G,
        xs_ptr, sxs,
        BM: tl.constexpr, BN: tl.constexpr, SPLIT_K: tl.constexpr, SWAP: tl.constexpr,
        SCALE_F32: tl.constexpr, FENCE: tl.constexpr, DOT_DT: tl.constexpr,
        DOT_PREC: tl.constexpr, ACT_FP8: tl.constexpr = False, X_FP8: tl.constexpr = False,
        INTERP: tl.constexpr = False, PDL: tl.constexpr = False,
    ):
        wait_for_prior_kernel(PDL)
        pid = tl.program_id(0)
        pid_m = pid % m_tiles
        rest = pid // m_tiles
        _gemm_tile(x_ptr, sxm, sxg, w_ptr, sc_ptr, stride_sc, y_ptr, sym, syg, ws_ptr, cnt_ptr,
                   M, R, Kg, m_ws, n_tiles, G, xs_ptr, sxs, pid_m, rest // SPLIT_K,
                   rest % SPLIT_K, BM, BN, SPLIT_K, SWAP, SCALE_F32, FENCE, DOT_DT, DOT_PREC,
                   ACT_FP8, X_FP8, INTERP)
        let_next_kernel_launch(PDL)


    @triton.jit
    def _dequant_kernel(w_ptr, sc_ptr, stride_sc, o_ptr, K, BN: tl.constexpr, BK: tl.constexpr,
                        SCALE_F32: tl.constexpr, PDL: tl.constexpr = False):
        """One [BN, BK] tile (inside one 128 x 128 scale block) of the dequantised weight."""
        wait_for_prior_kernel(PDL)
        rows = tl.program_id(0) * BN + tl.arange(0, BN)
        k0 = tl.program_id(1) * BK
        s = _scale_value(_scale_raw(sc_ptr + (tl.program_id(0) * BN // 128) * stride_sc,
                                    k0 // 128, SCALE_F32), SCALE_F32)
        offs = rows.to(tl.int64)[:, None] * K + (k0 + tl.arange(0, BK))[None, :]
        w = tl.load(w_ptr + offs, eviction_policy="evict_first").to(tl.float32)
        tl.store(o_ptr + offs, rounded(w * s, tl.bfloat16).to(tl.bfloat16))
        let_next_kernel_launch(PDL)


    @triton.jit
    def _act_quant_kernel(x_ptr, sxm, q_ptr, s_ptr, M, K, BM: tl.constexpr,
                          SIM: tl.constexpr = False, PDL: tl.constexpr = False):
        """Rows ``BM`` tokens x one 128-wide K block of x quantised as :func:`act_quant_block`
        does it in the GEMM: e4m3 bytes into ``q`` [M, K], the scale 2^k into ``s`` [M, K/128];
        ``SIM``: instead the value each byte stands for times its scale, in ``q``'s dtype (the
        quant-dequant of ``fp8_block_sim``; exact in bf16), and ``s`` unused."""
        wait_for_prior_kernel(PDL)
        offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
        kb = tl.program_id(1)
        offs_k = kb * 128 + tl.arange(0, 128)
        mask = offs_m < M
        xt = tl.load(x_ptr + offs_m[:, None] * sxm + offs_k[None, :], mask=mask[:, None],
                     other=0.0).to(tl.float32)
        if SIM:  # e4m3's grid as float32 (integer arithmetic on the bits), scaled back
            q, sx = act_quant_block(xt, 1, True)
            tl.store(q_ptr + offs_m[:, None] * K + offs_k[None, :],
                     (q * sx[:, None]).to(q_ptr.dtype.element_ty), mask=mask[:, None])
        else:
            k = scale_exponent(tl.max(tl.abs(xt), axis=1), FP8_FLOOR, FP8_MAX)
            tl.store(q_ptr + offs_m[:, None] * K + offs_k[None, :],
                     e4m3_bytes(xt, k).to(tl.uint8), mask=mask[:, None])
            tl.store(s_ptr + offs_m * (K // 128) + kb, pow2(k), mask=mask)
        let_next_kernel_launch(PDL)


# ---------------------------------------------------------------------------------- launch


@functools.lru_cache(maxsize=8)
def _n_sm(idx: int) -> int:
    return torch.cuda.get_device_properties(idx).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (132, an H200's, off CUDA)."""
    if device.type != "cuda":
        return 132
    return _n_sm(device.index if device.index is not None else torch.cuda.current_device())


_WORKSPACES: dict[str, SplitKWorkspace] = {}
"""Each device's split-K workspace: the launches of the step's own stream (one at a time)."""

_SIDE_WORKSPACES: dict[tuple[str, int], SplitKWorkspace] = {}


def side_stream_workspace(stream: torch.cuda.Stream) -> SplitKWorkspace:
    """The split-K workspace of launches on ``stream``, a side stream whose launches run while
    others run on the step's stream (a stage's branch): its own, since two launches running at
    once on one workspace would race on its partials and counters. One per side stream (the
    launches on it are ordered)."""
    return _SIDE_WORKSPACES.setdefault((str(stream.device), stream.stream_id), SplitKWorkspace())


def _launch(x3: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, y3: torch.Tensor,
            config: Fp8GemmConfig | None, workspace: SplitKWorkspace | None,
            x_scales: torch.Tensor | None = None) -> None:
    """x3 [M, G, Kg] (last dim contiguous), y3 [M, G, R] (last dim contiguous); with
    ``x_scales`` [M, Kg / 128] float32, x3 holds e4m3 values (a uint8 view) and the launch runs
    the act_fp8 numerics on them."""
    M, G, Kg = x3.shape
    R = y3.shape[2]
    cfg = config or choose_fp8_config(M, G * R, Kg, sm_count(x3.device),
                                      act_fp8=x_scales is not None)
    bn = cfg.block_n
    if not (bn in (16, 32, 64, 128) and R % bn == 0):
        raise ValueError(f"block_n={bn} must be 16/32/64/128 and divide R={R}")
    n_tiles = R // bn
    m_tiles = -(-M // cfg.block_m)
    m_ws = m_tiles * cfg.block_m
    split = max(1, min(cfg.split_k, Kg // BLOCK))
    if split > 1:
        if workspace is None:
            workspace = _WORKSPACES.setdefault(str(x3.device), SplitKWorkspace())
        ws, cnt = workspace.get(x3.device, split * G * m_ws * R, m_tiles * G * n_tiles)
    else:
        ws, cnt = y3, y3  # unused
    sc_f32 = scale.dtype == torch.float32
    sc = scale if sc_f32 else scale.view(torch.uint8)
    grid = (m_tiles * G * n_tiles * split,)
    xs = x_scales if x_scales is not None else sc  # unused without X_FP8
    launch(_fp8_gemm_kernel, grid,
        x3, x3.stride(0), x3.stride(1), weight, sc, sc.stride(0), y3, y3.stride(0), y3.stride(1),
        ws, cnt, M, R, Kg, m_ws, n_tiles, m_tiles, G, xs, xs.stride(0),
        BM=cfg.block_m, BN=bn, SPLIT_K=split, SWAP=cfg.swap, SCALE_F32=sc_f32,
        FENCE=not _INTERPRET, DOT_DT=tl.float32 if _INTERPRET else tl.bfloat16,
        DOT_PREC="ieee" if _INTERPRET else "tf32", ACT_FP8=cfg.act_fp8 or x_scales is not None,
        X_FP8=x_scales is not None, INTERP=_INTERPRET,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(x3.device),
    )


def _act_sim(x: torch.Tensor, config: Fp8GemmConfig | None) -> torch.Tensor:
    """x as the kernel sees it: quantised per 128 (§6.3, exact in bf16) under ``act_fp8``."""
    return fp8_block_sim(x, BLOCK) if config is not None and config.act_fp8 else x


def _kernel_runs_on(device: torch.device) -> bool:
    """The kernels take work on ``device``: Triton, and CUDA or the interpreter."""
    return triton_available() and (device.type == "cuda" or _INTERPRET)


def _use_kernel(x: torch.Tensor) -> bool:
    """The kernel takes the call (:func:`_kernel_runs_on`); x must then be bf16."""
    use = _kernel_runs_on(x.device)
    if use and x.dtype != torch.bfloat16:
        raise ValueError(f"x must be bf16 for the kernel, got {x.dtype}")
    return use


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] bf16 quantised per token and 128-wide K block as an ``act_fp8`` GEMM quantises
    it (docs/spec.md §6.3): (e4m3 values [M, K], float32 scales 2^k [M, K / 128]), one launch
    on CUDA. ``fp8_linear(values, w, s, x_scales=scales)`` then gives, bit for bit, what
    ``fp8_linear(x, w, s, config=<act_fp8>)`` gives, without each of its programs quantising
    its own copy of x's tile."""
    if x.dim() != 2 or x.shape[1] % BLOCK or x.dtype != torch.bfloat16:
        raise ValueError(f"x must be bf16 [M, K] with K a multiple of {BLOCK}, got {x.dtype} "
                         f"{tuple(x.shape)}")
    M, K = x.shape
    if not _kernel_runs_on(x.device) or M == 0:
        q, sigma = fp8_block_quantize(x, BLOCK, "quantize_activations")
        return q.view(M, K).to(torch.float8_e4m3fn), sigma.view(M, K // BLOCK)
    q = torch.empty(M, K, device=x.device, dtype=torch.float8_e4m3fn)
    s = torch.empty(M, K // BLOCK, device=x.device, dtype=torch.float32)
    _launch_act_quant(x, q.view(torch.uint8), s, sim=False)
    return q, s


def _launch_act_quant(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, sim: bool) -> None:
    """One ``_act_quant_kernel`` launch over x [M, K] bf16: e4m3 bytes into ``q`` and scales
    into ``s``, or (``sim``) the scaled-back values into ``q`` (``s`` unused)."""
    x = x if x.stride(1) == 1 else x.contiguous()
    M, K = x.shape
    bm = 16
    launch(_act_quant_kernel, (-(-M // bm), K // BLOCK), x, x.stride(0), q, s, M, K, BM=bm,
           SIM=sim, num_warps=4, **pdl_args(x.device))


def simulate_activations(x: torch.Tensor) -> torch.Tensor:
    """``fp8_block_sim(x, 128)`` (docs/spec.md §6.3: x [M, K] quantised per token and 128-wide
    K block to e4m3 with a power-of-two scale, then scaled back) bit for bit where x is finite,
    in one launch where the kernels run (bf16 x on CUDA or under the interpreter): one read of
    x and one write, where the PyTorch operations pass over it in float32 a dozen times. A
    block holding an infinity comes out as infinities, as the streaming GEMMs' own quantisation
    makes it (``fp8_block_sim`` saturates it instead). The long calls' input to a bf16 GEMM on
    the dequantised weight (:mod:`dsv4.platforms.cuda_linears`)."""
    if x.dim() != 2 or x.shape[1] % BLOCK:
        raise ValueError(f"x must be [M, K] with K a multiple of {BLOCK}, got {tuple(x.shape)}")
    M, K = x.shape
    if x.dtype != torch.bfloat16 or not _kernel_runs_on(x.device) or M == 0:
        return fp8_block_sim(x, BLOCK)
    y = torch.empty(M, K, device=x.device, dtype=x.dtype)
    _launch_act_quant(x, y, y, sim=True)
    return y


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, *,
               out: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
               config: Fp8GemmConfig | None = None,
               workspace: SplitKWorkspace | None = None,
               x_scales: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ (weight * scale)^T, without materialising the dequantised weight.

    ``x`` bf16 [M, K] (rows may be strided, columns contiguous); ``weight`` float8_e4m3fn [N, K]
    contiguous; ``scale`` [N/128, K/128] (e8m0 / uint8 bytes / float32). ``out`` (optional)
    [M, N] bf16 or float32 with contiguous columns. A split-K launch uses ``workspace`` (default:
    one per device, shared: do not run two launches concurrently on different streams; grow it
    with one eager call before CUDA-graph capture). ``x_scales``: x is already quantised
    (:func:`quantize_activations`' pair: e4m3 ``x`` [M, K] contiguous, float32 ``x_scales``
    [M, K / 128]); the GEMM runs the ``act_fp8`` numerics on it (``config`` defaults to the
    ``act_fp8`` table's tiles; its ``act_fp8`` flag is implied).
    """
    _check_weight(weight, scale)
    N, K = weight.shape
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"x must be [M, {K}], got {tuple(x.shape)}")
    M = x.shape[0]
    if x_scales is not None:
        _check_quantized(x, x_scales)
    y = out if out is not None else torch.empty(M, N, device=x.device, dtype=out_dtype)
    if tuple(y.shape) != (M, N) or y.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"out must be [{M}, {N}] bf16/float32, got {tuple(y.shape)} {y.dtype}")
    use = _use_kernel(x) if x_scales is None else _kernel_runs_on(x.device)
    if M == 0:
        return y
    if not use:
        xs = (_act_sim(x, config) if x_scales is None else
              (x.float().view(M, -1, BLOCK) * x_scales[..., None]).view(M, K))
        y.copy_(fp8_linear_reference(xs, weight, scale, y.dtype))
        return y
    if x_scales is not None:
        x = x.view(torch.uint8)
    x = x if x.stride(1) == 1 else x.contiguous()
    if y.stride(1) != 1:
        raise ValueError("out must have contiguous columns")
    _launch(x.unsqueeze(1), weight.contiguous(), scale.contiguous(), y.unsqueeze(1), config,
            workspace, x_scales)
    return y


def _check_quantized(x: torch.Tensor, x_scales: torch.Tensor) -> None:
    M, K = x.shape
    if x.dtype != torch.float8_e4m3fn or x.stride(1) != 1:
        raise ValueError(f"with x_scales, x must be float8_e4m3fn with contiguous columns, got "
                         f"{x.dtype} strides {x.stride()}")
    if (x_scales.dtype != torch.float32 or tuple(x_scales.shape) != (M, K // BLOCK)
            or x_scales.stride(1) != 1 or x_scales.device != x.device):
        raise ValueError(f"x_scales must be float32 [{M}, {K // BLOCK}] with contiguous columns "
                         f"on {x.device}, got {x_scales.dtype} {tuple(x_scales.shape)} on "
                         f"{x_scales.device}")


def fp8_grouped_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, *,
                       out: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
                       config: Fp8GemmConfig | None = None,
                       workspace: SplitKWorkspace | None = None) -> torch.Tensor:
    """y [M, G, R] with y[:, g] = x[:, g] @ (W rows g*R .. g*R+R-1)^T, one launch (``wo_a``).

    ``x`` bf16 [M, G, Kg] (last dim contiguous; e.g. o [M, H, d] viewed as [M, G, H/G*d]);
    ``weight`` float8_e4m3fn [G*R, Kg]; ``scale`` [G*R/128, Kg/128]; R and Kg multiples of 128
    (so every group owns whole scale blocks). ``out`` optional [M, G, R], last dim contiguous.
    """
    _check_weight(weight, scale)
    if x.dim() != 3 or x.shape[2] != weight.shape[1] or weight.shape[0] % x.shape[1]:
        raise ValueError(f"x must be [M, G, {weight.shape[1]}] with G dividing "
                         f"{weight.shape[0]}, got {tuple(x.shape)}")
    M, G, Kg = x.shape
    R = weight.shape[0] // G
    if R % BLOCK:
        raise ValueError(f"rows per group R={R} must be a multiple of {BLOCK}")
    y = out if out is not None else torch.empty(M, G, R, device=x.device, dtype=out_dtype)
    if tuple(y.shape) != (M, G, R) or y.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"out must be [{M}, {G}, {R}] bf16/float32, got {tuple(y.shape)}")
    use = _use_kernel(x)
    if M == 0:
        return y
    if not use:
        y.copy_(fp8_grouped_linear_reference(_act_sim(x, config), weight, scale, y.dtype))
        return y
    if x.stride(2) != 1:
        x = x.contiguous()
    if y.stride(2) != 1:
        raise ValueError("out must have a contiguous last dim")
    _launch(x, weight.contiguous(), scale.contiguous(), y, config, workspace)
    return y


def fp8_dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The bf16 weight ``weight * scale`` [N, K] in one pass over it (e4m3 times the block's
    scale in fp32, rounded once to bf16: exact for ue8m0 scales, the values of
    :func:`dsv4.layers.fp8.dequantize_fp8_block`). Off CUDA without the interpreter: that
    function."""
    _check_weight(weight, scale)
    n, k = weight.shape
    if not _kernel_runs_on(weight.device):
        return _dequant(weight, scale, torch.float32).to(torch.bfloat16)
    out = torch.empty(n, k, device=weight.device, dtype=torch.bfloat16)
    sc_f32 = scale.dtype == torch.float32
    sc = (scale if sc_f32 else scale.view(torch.uint8)).contiguous()
    bn, bk = 32, 128
    launch(_dequant_kernel, (n // bn, k // bk), weight.contiguous(), sc, sc.stride(0), out, k,
           BN=bn, BK=bk, SCALE_F32=sc_f32, num_warps=4, **pdl_args(out.device))
    return out
