"""The decode step's small elementwise stages, one Triton launch each.

Entry points (inputs on a CUDA device, or CPU tensors under ``TRITON_INTERPRET=1``):

* ``latent_norms(qr_kv, q_weight, kv_weight, eps) -> (qr, kv)``: both weighted RMSNorms of the
  fused ``[qr | kv]`` latent (``q_norm`` and ``kv_norm``) in one launch.
* ``rope_heads(x, positions, inv_freq, ...)``: x [T, H, D] (or [T, D]) -> RoPE at ``positions`` on
  the last ``2 * len(inv_freq)`` dims, optionally after a per-head RMS normalisation (no weight,
  the query heads), inverse (negated sin, the output path), or followed by an E4M3 simulation
  with a power-of-two scale per block of the first ``fp8_dims`` dims (the kv rows' nope dims,
  block 64; the indexer's ``fp8`` numerics, block 128 over the whole head).
* ``rope_heads_and_row(heads, row, positions, inv_freq, ...)``: the query heads' RMS + RoPE
  and the kv rows' RoPE + fp8 simulation in one launch (a column of programs for the rows).
* ``rope_hadamard_fp4(x, positions, inv_freq)``: RoPE, then the indexer's official numerics:
  Walsh-Hadamard rotation of each head (as MMAs against +-1 tiles built in the kernel), FP4
  E2M1 block-32 simulation.

The math is that of the torch path, :mod:`dsv4.layers.norm`, :mod:`dsv4.layers.rotary` and
:mod:`dsv4.layers.quant_sim`: fp32 statistics and math, one rounding to the output dtype where
the torch path rounds (after RoPE, after the Hadamard). RoPE pairs are interleaved
(x[2i], x[2i+1]), so each program loads a head's even and odd elements as two [heads, D/2]
tiles; nope pairs take angle 0 (cos 1, sin 0: unchanged, exactly). The angle is
fp32(position) * inv_freq in fp32 as :meth:`RotaryEmbedding.cos_sin`; it is reduced modulo 2 pi
in float64 before the fp32 cos / sin, so positions up to 1M keep full accuracy whatever the
backend's cos / sin do with large arguments. Quantiser exponents come from the float bits (as
:func:`dsv4.layers.fp8.ceil_log2`), rounding is to nearest, ties to even, built from ``floor``.
Differences from the torch path: the order of fp32 sums (mean of squares, the Hadamard as an
MMA instead of butterflies) and cos / sin to an ulp, so a bf16 output can differ by one ulp and,
rarely, a simulated value by one quantisation step.

Positions are a device tensor read in the kernel: no host sync, CUDA-graph capturable.
"""

from __future__ import annotations

import torch

from dsv4.kernels.bound_launch import launch
from dsv4.kernels.launch import _INTERPRET, pdl_args, triton_available
from dsv4.layers.fp8 import E4M3_MANTISSA_BITS, E4M3_MIN_NORMAL_EXP
from dsv4.layers.quant_sim import E2M1_MANTISSA_BITS, E2M1_MIN_NORMAL_EXP

__all__ = ["kernels_usable", "latent_norms", "rope_hadamard_fp4",
           "rope_heads", "rope_heads_and_row"]

FP4_BLOCK = 32
"""Values per FP4 scale of the indexer's Hadamard numerics."""
MMA_MIN = 16
"""Smallest MMA tile side: the Hadamard kernel pads its head block to it."""


def kernels_usable(x: torch.Tensor) -> bool:
    """Host-side test: the kernels can run on ``x``'s device (CUDA with Triton, or the CPU
    interpreter)."""
    return triton_available() and (x.device.type == "cuda" or _INTERPRET)


if triton_available():
    import triton
    import triton.language as tl

    from dsv4.kernels._float_bits import (
        FP4_FLOOR,
        FP4_MAX,
        FP8_FLOOR,
        FP8_MAX,
        pow2,
        rounded,
        scale_exponent,
    )
    from dsv4.kernels.launch import let_next_kernel_launch, wait_for_prior_kernel

    if _INTERPRET:
        from dsv4.kernels._interpreter import patch_interpreter_index

        patch_interpreter_index()

    @triton.jit
    def rope_cos_sin(pos, inv_freq, SIGN: tl.constexpr):
        """cos and SIGN * sin of the angle fp32(pos) * inv_freq (RotaryEmbedding.cos_sin's
        rounding); the angle is reduced to [-pi, pi] in float64 first. Shared by the kernels."""
        angle = pos.to(tl.float32) * inv_freq
        a = angle.to(tl.float64)
        two_pi = tl.full(angle.shape, 6.283185307179586, tl.float64)
        turns = tl.floor(a / two_pi + 0.5)
        r = (a - turns * two_pi).to(tl.float32)
        return tl.cos(r), tl.sin(r) * SIGN

    @triton.jit
    def _quant_dequant(v, k, QMAX: tl.constexpr, MANT: tl.constexpr, MIN_EXP: tl.constexpr):
        """round_minifloat(clamp(v / 2^k, +-QMAX)) * 2^k: MANT mantissa bits, smallest normal
        2^MIN_EXP, ties to even (dsv4.layers.fp8.round_minifloat)."""
        y = tl.minimum(tl.maximum(v * pow2(-k), -QMAX), QMAX)
        e = ((tl.abs(y).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 126  # |y| < 2^e
        s = tl.maximum(e, MIN_EXP + 1) - 1 - MANT
        z = y * pow2(-s)
        f = tl.floor(z)
        d = z - f
        odd = (f.to(tl.int32) & 1) == 1
        up = (d > 0.5) | ((d == 0.5) & odd)
        return (f + up.to(tl.float32)) * pow2(s) * pow2(k)

    @triton.jit
    def _latent_norms_kernel(x_ptr, sxt, wq_ptr, wkv_ptr, q_ptr, sqt, kv_ptr, skt, eps_q,
                             eps_kv, QR: tl.constexpr, KV: tl.constexpr, BQ: tl.constexpr,
                             BKV: tl.constexpr, PDL: tl.constexpr = False):
        wait_for_prior_kernel(PDL)
        t = tl.program_id(0).to(tl.int64)
        row = x_ptr + t * sxt
        oq = tl.arange(0, BQ)
        mq = oq < QR
        xq = tl.load(row + oq, mask=mq, other=0.0).to(tl.float32)
        rq = tl.rsqrt(tl.sum(xq * xq, axis=0) / QR + eps_q)
        wq = tl.load(wq_ptr + oq, mask=mq, other=0.0).to(tl.float32)
        q_dt = q_ptr.dtype.element_ty
        qv = rounded(xq * rq * wq, q_dt)
        tl.store(q_ptr + t * sqt + oq, qv.to(q_dt), mask=mq)
        ok = tl.arange(0, BKV)
        mk = ok < KV
        xk = tl.load(row + QR + ok, mask=mk, other=0.0).to(tl.float32)
        rk = tl.rsqrt(tl.sum(xk * xk, axis=0) / KV + eps_kv)
        wk = tl.load(wkv_ptr + ok, mask=mk, other=0.0).to(tl.float32)
        kv_dt = kv_ptr.dtype.element_ty
        tl.store(kv_ptr + t * skt + ok, rounded(xk * rk * wk, kv_dt).to(kv_dt), mask=mk)
        let_next_kernel_launch(PDL)

    @triton.jit
    def _load_rotated(x_ptr, sxt, sxh, pos_ptr, freq_ptr, H, eps, t, h, j,
                      D2: tl.constexpr, NOPE2: tl.constexpr, NORM: tl.constexpr,
                      SIGN: tl.constexpr, BH: tl.constexpr, BD2: tl.constexpr):
        """The even / odd elements [BH, BD2] of heads h of token t, RMS-normalised (NORM) and
        rotated, in fp32, and the mask of the heads' [BH, 2 * BD2] elements; pairs j >= NOPE2
        carry RoPE. The heads are read as contiguous rows (vector loads) and split into pairs
        in registers."""
        d = tl.arange(0, 2 * BD2)
        m = (h < H)[:, None] & (d < 2 * D2)[None, :]
        x = tl.load(x_ptr + t * sxt + h[:, None] * sxh + d[None, :], mask=m, other=0.0)
        xe, xo = tl.split(tl.reshape(x.to(tl.float32), [BH, BD2, 2]))
        if NORM:
            r = tl.rsqrt(tl.sum(xe * xe + xo * xo, axis=1) / (2 * D2) + eps)
            xe = xe * r[:, None]
            xo = xo * r[:, None]
        jr = j - NOPE2
        freq = tl.load(freq_ptr + jr, mask=(jr >= 0) & (j < D2), other=0.0)
        c, s = rope_cos_sin(tl.load(pos_ptr + t), freq, SIGN)
        ye = xe * c[None, :] - xo * s[None, :]
        yo = xe * s[None, :] + xo * c[None, :]
        return ye, yo, m

    @triton.jit
    def _rope_heads_kernel(x_ptr, sxt, sxh, o_ptr, sot, soh, pos_ptr, freq_ptr, H, eps,
                           D2: tl.constexpr, NOPE2: tl.constexpr, BH: tl.constexpr,
                           BD2: tl.constexpr, NORM: tl.constexpr, SIGN: tl.constexpr,
                           QPAIRS: tl.constexpr, QBLOCK: tl.constexpr, PDL: tl.constexpr = False,
                           x2_ptr=None, sx2t=0, o2_ptr=None, so2t=0, ROW: tl.constexpr = False,
                           QPAIRS2: tl.constexpr = 0, QBLOCK2: tl.constexpr = 0):
        """Program (t, b): heads b * BH .. of token t. With ROW, the grid has one more column:
        its programs (t, last) rotate row t of the second tensor ``x2`` [T, 2 * D2] instead (no
        norm, its own fp8 simulation QPAIRS2 / QBLOCK2) - the kv row beside the query heads."""
        wait_for_prior_kernel(PDL)
        t = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, BD2)
        h = tl.program_id(1) * BH + tl.arange(0, BH)
        if ROW:  # noqa: SIM102 - a constexpr beside a runtime test
            if tl.program_id(1) == tl.num_programs(1) - 1:
                _rope_store(x2_ptr, sx2t, 0, o2_ptr, so2t, 0, pos_ptr, freq_ptr, 1, 0.0, t,
                            tl.arange(0, BH), j, D2, NOPE2, BH, BD2, False, SIGN, QPAIRS2,
                            QBLOCK2)
            else:
                _rope_store(x_ptr, sxt, sxh, o_ptr, sot, soh, pos_ptr, freq_ptr, H, eps, t, h,
                            j, D2, NOPE2, BH, BD2, NORM, SIGN, QPAIRS, QBLOCK)
        else:
            _rope_store(x_ptr, sxt, sxh, o_ptr, sot, soh, pos_ptr, freq_ptr, H, eps, t, h, j,
                        D2, NOPE2, BH, BD2, NORM, SIGN, QPAIRS, QBLOCK)
        let_next_kernel_launch(PDL)

    @triton.jit
    def _rope_store(x_ptr, sxt, sxh, o_ptr, sot, soh, pos_ptr, freq_ptr, H, eps, t, h, j,
                    D2: tl.constexpr, NOPE2: tl.constexpr, BH: tl.constexpr,
                    BD2: tl.constexpr, NORM: tl.constexpr, SIGN: tl.constexpr,
                    QPAIRS: tl.constexpr, QBLOCK: tl.constexpr):
        """Heads ``h`` of token t rotated (:func:`_load_rotated`), rounded to the output dtype,
        the first QPAIRS pairs E4M3-simulated per QBLOCK pairs, stored."""
        ye, yo, m = _load_rotated(x_ptr, sxt, sxh, pos_ptr, freq_ptr, H, eps, t, h, j, D2,
                                  NOPE2, NORM, SIGN, BH, BD2)
        out_dt = o_ptr.dtype.element_ty
        ye = rounded(ye, out_dt)
        yo = rounded(yo, out_dt)
        if QBLOCK > 0:  # E4M3 with a power-of-two scale per QBLOCK pairs, of pairs < QPAIRS
            a = tl.maximum(tl.abs(ye), tl.abs(yo))
            k = tl.zeros([BH, BD2], dtype=tl.int32)
            for b in tl.static_range(QPAIRS // QBLOCK):
                inb = ((j >= b * QBLOCK) & (j < (b + 1) * QBLOCK))[None, :]
                kb = scale_exponent(tl.max(tl.where(inb, a, 0.0), axis=1), FP8_FLOOR,
                                    FP8_MAX)
                k = tl.where(inb, kb[:, None], k)
            q = (j < QPAIRS)[None, :]
            ye = tl.where(q, _quant_dequant(ye, k, FP8_MAX, E4M3_MANT, E4M3_MIN_EXP), ye)
            yo = tl.where(q, _quant_dequant(yo, k, FP8_MAX, E4M3_MANT, E4M3_MIN_EXP), yo)
        d = tl.arange(0, 2 * BD2)
        y = tl.reshape(tl.join(ye, yo), [BH, 2 * BD2])  # pairs back in place: one row each
        tl.store(o_ptr + t * sot + h[:, None] * soh + d[None, :], y.to(out_dt), mask=m)

    @triton.jit
    def _hadamard_sign(v):
        """(-1)^popcount(v) for int32 v >= 0: the Sylvester Hadamard entry H[i, k], v = i & k."""
        v = v ^ (v >> 16)
        v = v ^ (v >> 8)
        v = v ^ (v >> 4)
        v = v ^ (v >> 2)
        v = v ^ (v >> 1)
        return 1 - 2 * (v & 1)

    @triton.jit
    def _rope_hadamard_fp4_kernel(x_ptr, sxt, sxh, o_ptr, sot, soh, pos_ptr, freq_ptr, H,
                                  D2: tl.constexpr, NOPE2: tl.constexpr, BH: tl.constexpr,
                                  HSCALE: tl.constexpr, DOT_DT: tl.constexpr,
                                  DOT_PREC: tl.constexpr, PDL: tl.constexpr = False):
        wait_for_prior_kernel(PDL)
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BH + tl.arange(0, BH)
        j = tl.arange(0, D2)
        ye, yo, _ = _load_rotated(x_ptr, sxt, sxh, pos_ptr, freq_ptr, H, 0.0, t, h, j, D2,
                                  NOPE2, False, 1, BH, D2)
        out_dt = o_ptr.dtype.element_ty
        # the rotated query in the layer dtype is the Hadamard's input (exact as MMA operands)
        ye = rounded(ye, out_dt).to(DOT_DT)
        yo = rounded(yo, out_dt).to(DOT_DT)
        row = (2 * j)[:, None]
        c = tl.arange(0, FP4_BLK)
        for b in tl.static_range(2 * D2 // FP4_BLK):
            col = (c + b * FP4_BLK)[None, :]
            he = _hadamard_sign(row & col).to(tl.float32).to(DOT_DT)  # H rows 2j, block b's columns
            ho = _hadamard_sign((row + 1) & col).to(tl.float32).to(DOT_DT)
            acc = tl.dot(ye, he, input_precision=DOT_PREC)
            acc = tl.dot(yo, ho, acc, input_precision=DOT_PREC)
            v = rounded(acc * HSCALE, out_dt)
            k = scale_exponent(tl.max(tl.abs(v), axis=1), FP4_FLOOR, FP4_MAX)
            q = _quant_dequant(v, k[:, None], FP4_MAX, E2M1_MANT, E2M1_MIN_EXP)
            out = o_ptr + t * sot + h[:, None] * soh + col
            tl.store(out, q.to(out_dt), mask=(h < H)[:, None])
        let_next_kernel_launch(PDL)

    # module constants as the kernels see them (constexpr globals)
    E4M3_MANT = tl.constexpr(E4M3_MANTISSA_BITS)
    E4M3_MIN_EXP = tl.constexpr(E4M3_MIN_NORMAL_EXP)
    E2M1_MANT = tl.constexpr(E2M1_MANTISSA_BITS)
    E2M1_MIN_EXP = tl.constexpr(E2M1_MIN_NORMAL_EXP)
    FP4_BLK = tl.constexpr(FP4_BLOCK)


# ---------------------------------------------------------------------------------- launch


def _require(x: torch.Tensor) -> None:
    if not kernels_usable(x):
        raise RuntimeError("the rope/norm kernels need Triton and a CUDA tensor (or "
                           "TRITON_INTERPRET=1)")


def _heads_view(x: torch.Tensor) -> torch.Tensor:
    """x as [T, H, D] with a contiguous last dim ([T, D] is one head)."""
    if x.dim() == 2:
        x = x.unsqueeze(1)
    if x.dim() != 3:
        raise ValueError(f"x must be [T, D] or [T, H, D], got {tuple(x.shape)}")
    return x if x.stride(2) == 1 else x.contiguous()


def _pair_dims(d: int, inv_freq: torch.Tensor) -> tuple[int, int]:
    """(D/2, index of the first RoPE pair)."""
    rope = 2 * inv_freq.numel()
    if d % 2 or rope > d:
        raise ValueError(f"head dim {d} must be even and hold the {rope} RoPE dims")
    return d // 2, (d - rope) // 2


def latent_norms(qr_kv: torch.Tensor, q_weight: torch.Tensor, kv_weight: torch.Tensor,
                 eps_q: float, eps_kv: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_norm(qr_kv[:, :R]), kv_norm(qr_kv[:, R:])) with R = len(q_weight), in one launch:
    weighted RMSNorms (:class:`dsv4.layers.norm.RMSNorm`), fp32 statistics, outputs in qr_kv's
    dtype."""
    _require(qr_kv)
    qr_rank, kv_dim = q_weight.numel(), kv_weight.numel()
    if qr_kv.dim() != 2 or qr_kv.shape[1] != qr_rank + kv_dim:
        raise ValueError(f"qr_kv must be [T, {qr_rank + kv_dim}], got {tuple(qr_kv.shape)}")
    x = qr_kv if qr_kv.stride(1) == 1 else qr_kv.contiguous()
    t = x.shape[0]
    qr = torch.empty(t, qr_rank, dtype=x.dtype, device=x.device)
    kv = torch.empty(t, kv_dim, dtype=x.dtype, device=x.device)
    if t:
        bq, bkv = triton.next_power_of_2(qr_rank), triton.next_power_of_2(kv_dim)
        launch(_latent_norms_kernel, (t,),
            x, x.stride(0), q_weight.contiguous(), kv_weight.contiguous(), qr, qr.stride(0), kv,
            kv.stride(0), eps_q, eps_kv, QR=qr_rank, KV=kv_dim, BQ=bq, BKV=bkv,
            num_warps=8 if bq >= 2048 else 4, **pdl_args(x.device))
    return qr, kv


def rope_heads(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, *,
               norm_eps: float | None = None, inverse: bool = False, fp8_dims: int = 0,
               fp8_block: int = 0, out_dtype: torch.dtype | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """RoPE of x [T, H, D] (or [T, D]) at ``positions`` [T] on its last 2 * len(inv_freq) dims.

    ``norm_eps``: first x / sqrt(mean(x^2) + eps) per head (no weight). ``inverse``: rotate by
    the negated angle. ``fp8_block`` > 0: then E4M3 quant-dequant of the first ``fp8_dims``
    dims (after rounding to the output dtype) with a power-of-two scale per ``fp8_block`` dims,
    the rule of :func:`dsv4.layers.quant_sim.fp8_block_sim`. Returns a new contiguous tensor of
    x's shape in ``out_dtype`` (default x's dtype), or ``out`` (x's shape, contiguous last dim,
    any other strides; it may be x itself: each program reads its heads before writing them).
    """
    _require(x)
    xh = _heads_view(x)
    positions = positions.contiguous()
    t, n_heads, d = xh.shape
    d2, nope2 = _pair_dims(d, inv_freq)
    if fp8_block and (fp8_block % 2 or fp8_dims % fp8_block or fp8_dims > d):
        raise ValueError(f"fp8_dims={fp8_dims} must be a multiple of the even fp8_block="
                         f"{fp8_block} and at most {d}")
    if out is None:
        out = torch.empty(xh.shape, dtype=out_dtype or x.dtype, device=x.device)
        oh = out
    else:
        oh = out.unsqueeze(1) if out.dim() == 2 else out
        if tuple(oh.shape) != tuple(xh.shape) or oh.stride(2) != 1 or out.device != x.device:
            raise ValueError(f"out must have x's shape {tuple(x.shape)} and a contiguous last "
                             f"dim on {x.device}, got {tuple(out.shape)} {out.stride()}")
    if t and n_heads:
        bd2 = triton.next_power_of_2(d2)
        bh = min(triton.next_power_of_2(n_heads), max(1, 2048 // bd2))
        grid = (t, triton.cdiv(n_heads, bh))
        launch(_rope_heads_kernel, grid,
            xh, xh.stride(0), xh.stride(1), oh, oh.stride(0), oh.stride(1), positions,
            inv_freq, n_heads, 0.0 if norm_eps is None else norm_eps, D2=d2, NOPE2=nope2,
            BH=bh, BD2=bd2, NORM=norm_eps is not None, SIGN=-1 if inverse else 1,
            QPAIRS=fp8_dims // 2 if fp8_block else 0, QBLOCK=fp8_block // 2, num_warps=4,
            **pdl_args(xh.device))
    return out if out.shape == x.shape else out.view(x.shape)


def rope_heads_and_row(heads: torch.Tensor, row: torch.Tensor, positions: torch.Tensor,
                       inv_freq: torch.Tensor, *, norm_eps: float, fp8_dims: int = 0,
                       fp8_block: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """In one launch: ``rope_heads(heads, positions, inv_freq, norm_eps=norm_eps)`` (the query
    heads [T, H, D]) and ``rope_heads(row, positions, inv_freq, fp8_dims=fp8_dims,
    fp8_block=fp8_block)`` (the kv rows [T, D], same D) - the same values as the two calls,
    bit for bit. Returns (heads', row') as new contiguous tensors in the inputs' dtypes."""
    _require(heads)
    xh = _heads_view(heads)
    positions = positions.contiguous()
    t, n_heads, d = xh.shape
    if row.dim() != 2 or tuple(row.shape) != (t, d) or row.device != heads.device:
        raise ValueError(f"row must be [{t}, {d}] on {heads.device} beside heads "
                         f"{tuple(heads.shape)}, got {tuple(row.shape)} on {row.device}")
    d2, nope2 = _pair_dims(d, inv_freq)
    if fp8_block and (fp8_block % 2 or fp8_dims % fp8_block or fp8_dims > d):
        raise ValueError(f"fp8_dims={fp8_dims} must be a multiple of the even fp8_block="
                         f"{fp8_block} and at most {d}")
    xr = row if row.stride(1) == 1 else row.contiguous()
    out = torch.empty(xh.shape, dtype=heads.dtype, device=heads.device)
    out_row = torch.empty(xr.shape, dtype=row.dtype, device=row.device)
    if t and n_heads:
        bd2 = triton.next_power_of_2(d2)
        bh = min(triton.next_power_of_2(n_heads), max(1, 2048 // bd2))
        grid = (t, triton.cdiv(n_heads, bh) + 1)  # + the rows' column
        launch(_rope_heads_kernel, grid,
            xh, xh.stride(0), xh.stride(1), out, out.stride(0), out.stride(1), positions,
            inv_freq, n_heads, norm_eps, D2=d2, NOPE2=nope2, BH=bh, BD2=bd2, NORM=True,
            SIGN=1, QPAIRS=0, QBLOCK=0, x2_ptr=xr, sx2t=xr.stride(0), o2_ptr=out_row,
            so2t=out_row.stride(0), ROW=True, QPAIRS2=fp8_dims // 2 if fp8_block else 0,
            QBLOCK2=fp8_block // 2, num_warps=4, **pdl_args(xh.device))
    return out.view(heads.shape), out_row


def rope_hadamard_fp4(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, *,
                      block_h: int | None = None) -> torch.Tensor:
    """RoPE of x [T, H, D] (D a power of two, >= 32) at ``positions``, then per head the
    rotation H_D v / sqrt(D) and the FP4 E2M1 block-32 simulation
    (:func:`dsv4.layers.quant_sim.indexer_quant_sim`), each stage rounded to x's dtype as the
    torch path rounds. Returns a new contiguous tensor of x's shape and dtype. ``block_h``:
    heads per program (16, 32 or 64; default by the call's size)."""
    _require(x)
    xh = _heads_view(x)
    positions = positions.contiguous()
    t, n_heads, d = xh.shape
    if d < 2 * MMA_MIN or d & (d - 1):
        raise ValueError(f"head dim {d} must be a power of two >= {2 * MMA_MIN}")
    if block_h not in (None, 16, 32, 64):
        raise ValueError(f"block_h must be 16, 32 or 64, got {block_h}")
    d2, nope2 = _pair_dims(d, inv_freq)
    out = torch.empty(xh.shape, dtype=x.dtype, device=x.device)
    if t and n_heads:
        # heads per program: the MMA's minimum for short calls (more programs), 64 heads on
        # wgmma once there are programs to fill the GPU (the +-1 tiles built once per 64 heads)
        bh = block_h or (64 if t * n_heads >= 64 * 256 and n_heads >= 64 else MMA_MIN)
        grid = (t, triton.cdiv(n_heads, bh))
        # under the interpreter the MMA runs on fp32 operands (its bf16 dot is wrong on the
        # test install); the operands are bf16 values and +-1 either way, products exact
        launch(_rope_hadamard_fp4_kernel, grid,
            xh, xh.stride(0), xh.stride(1), out, out.stride(0), out.stride(1), positions,
            inv_freq, n_heads, D2=d2, NOPE2=nope2, BH=bh, HSCALE=d ** -0.5,
            DOT_DT=tl.float32 if _INTERPRET else tl.bfloat16,
            DOT_PREC="ieee" if _INTERPRET else "tf32", num_warps=4, **pdl_args(xh.device))
    return out.view(x.shape)
