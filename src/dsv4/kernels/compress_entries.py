"""One-launch compressed entries: :meth:`Compressor.compress_jobs` as a single Triton kernel.

A step completes E entries per compressor. The PyTorch path builds them in ~40 small ops (gather
of the source raw rows from the ring or this step's rows, the entry-0 stand-in, softmax, weighted
sum, RMSNorm, RoPE, the numerics simulation, cast). Here one program makes one entry, all ``d``
channels of it (d = 512 at most: the main compressor's head dim), so RMSNorm's sum of squares
stays in the program:

1. gather: source position i of the entry (``coff * ratio`` of them, oldest first) is ring row
   ``ring_src[e, i]`` or step row ``call_src[e, i]``; both -1 is entry 0's missing previous block
   (a = 0, score -inf: weight 0). Candidate i reads a from channels ``[blk * d, blk * d + d)`` and
   its score from ``coff * d`` further on, blk = i // ratio (ratio 4: the previous block uses the
   first half of a and of the score, the current block the second half; ratio 128: blk = 0);
2. a per-channel softmax over the candidates, online in tiles of candidates (ratio 128 has 128),
   and the weighted sum of a, in fp32;
3. RMSNorm with the norm weight, RoPE at position j * ratio on the last ``rope_dim`` channels
   (interleaved pairs);
4. the numerics simulation: the main compressor's FP8 block-64 quant-dequant of the non-rope
   channels, or the indexer's ``fp8`` (E4M3, one scale per 128) or ``hadamard_fp4`` (Sylvester
   Hadamard butterflies, then E2M1 block-32); scales are powers of two from the float's bits and
   rounding is exact (ties to even), as :mod:`dsv4.layers.quant_sim` does;
5. the cast to the layer dtype.

Numerics against the PyTorch path: the same fp32 operations, in another summation order (the
softmax denominator, the weighted sum, the sum of squares), so the values before the simulation
agree to a few fp32 ulps; a quantiser's rounding can then differ on a value sitting at a tie
of the grid (one grid step), rarely. On a GPU cos / sin are libdevice's (torch's own functions
for float32); under Triton's CPU interpreter NumPy's.

The raw rows the entries pool (:func:`raw_rows`: the score GEMM's rows plus ``ape``; a C4
layer's two compressors in one launch with :func:`raw_rows_pair`) and the rows the rings keep
(:func:`keep_ring_rows`; both rings in one launch with :func:`keep_ring_rows_pair`) are one
launch each too.

E comes from the host (the jobs' shape), nothing is read back: the launch can be captured in a
CUDA graph. Triton is imported guarded: this module imports on a machine without it.
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

import torch

from dsv4.cache.store import PagedStore
from dsv4.kernels.bound_launch import launch
from dsv4.kernels.launch import _INTERPRET, pdl_args, triton_available
from dsv4.kernels.store_rows import store_row_target
from dsv4.layers.compressor import Compressor
from dsv4.layers.quant_sim import INDEX_FP8_BLOCK
from dsv4.layers.rotary import RotaryEmbedding

__all__ = ["EntryCompress", "RowStore", "compress_entries", "compress_entries_pair",
           "keep_ring_rows", "keep_ring_rows_pair", "keep_ring_rows_problem",
           "kernel_unsupported", "launch_constants", "raw_rows", "raw_rows_pair",
           "raw_rows_problem", "sim_mode", "store_constants"]

SIM_NONE, SIM_KV_FP8, SIM_INDEX_FP8, SIM_INDEX_FP4 = 0, 1, 2, 3
KV_FP8_BLOCK = 64
FP4_BLOCK = 32
MAX_DIM = 512


def sim_mode(comp: Compressor, simulate_quant: bool, index_numerics: str | None) -> int:
    """Which numerics simulation the kernel applies (``SIM_*``), as ``Compressor._pool`` does."""
    if not simulate_quant:
        return SIM_NONE
    if not comp.for_indexer:
        return SIM_KV_FP8
    if index_numerics is None:
        return SIM_NONE
    modes = {"fp8": SIM_INDEX_FP8, "hadamard_fp4": SIM_INDEX_FP4}
    if index_numerics not in modes:
        raise ValueError(f"unknown indexer numerics {index_numerics!r}; valid: {sorted(modes)}")
    return modes[index_numerics]


def kernel_unsupported(comp: Compressor, rows: torch.Tensor, out_dtype: torch.dtype,
                       simulate_quant: bool, index_numerics: str | None) -> str | None:
    """Why the kernel cannot take this compress (host-side test), or None when it can."""
    if not triton_available():
        return "Triton is not installed"
    if rows.device.type != "cuda" and not _INTERPRET:
        return f"the kernel runs on CUDA (rows are on {rows.device.type})"
    if rows.dtype != torch.float32:
        return f"the kernel pools in float32 (raw rows are {rows.dtype})"
    if out_dtype != torch.bfloat16:
        return f"the kernel writes bf16 entries (layer dtype {out_dtype})"
    d, rope = comp.dim, comp.rope_dim
    if d & (d - 1) or d > MAX_DIM or rope > d or rope % 2:
        return f"dim {d} / rope dim {rope}: the kernel takes a power of two dim <= {MAX_DIM}"
    mode = sim_mode(comp, simulate_quant, index_numerics)
    block = {SIM_KV_FP8: KV_FP8_BLOCK, SIM_INDEX_FP8: INDEX_FP8_BLOCK,
             SIM_INDEX_FP4: FP4_BLOCK}.get(mode, 1)
    if (mode == SIM_KV_FP8 and (d - rope) % block) or d % block:
        return f"dim {d} / rope dim {rope} do not split into the simulation's blocks of {block}"
    return None


# ---------------------------------------------------------------------------------- kernel

if triton_available():
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    from dsv4.kernels.launch import let_next_kernel_launch, wait_for_prior_kernel

    if _INTERPRET:
        from dsv4.kernels._interpreter import patch_interpreter_index

        patch_interpreter_index()

    from dsv4.kernels._float_bits import (
        FP4_FLOOR,
        FP4_MAX,
        FP8_FLOOR,
        FP8_MAX,
        pow2,
        round_minifloat,
        rounded,
        scale_exponent,
    )
    from dsv4.kernels.store_rows import store_row

    @triton.jit
    def _exp(x, LIBDEVICE: tl.constexpr):
        if LIBDEVICE:  # the CUDA math library's expf (torch's)
            return libdevice.exp(x)
        else:
            return tl.exp(x)

    @triton.jit
    def _rsqrt(x, LIBDEVICE: tl.constexpr):
        if LIBDEVICE:  # the CUDA math library's rsqrtf (torch's)
            return libdevice.rsqrt(x)
        else:
            return 1.0 / tl.sqrt(x)

    @triton.jit
    def _rope_interleaved(x, pos, freq_ptr, D: tl.constexpr, ROPE: tl.constexpr,
                          LIBDEVICE: tl.constexpr):
        """GPT-J RoPE of the last ROPE channels of x [D] (fp32) at position ``pos`` (int):
        pairs (x[2i], x[2i+1]), angle = float32(pos) * inv_freq, cos / sin in fp32."""
        even, odd = tl.split(tl.reshape(x, (D // 2, 2)))
        k = tl.arange(0, D // 2) - (D - ROPE) // 2
        is_rope = k >= 0
        freq = tl.load(freq_ptr + tl.where(is_rope, k, 0), mask=is_rope, other=0.0)
        angle = pos.to(tl.float32) * freq
        if LIBDEVICE:  # the CUDA math library's cosf / sinf (torch's), full range reduction
            cos, sin = libdevice.cos(angle), libdevice.sin(angle)
        else:
            cos, sin = tl.cos(angle), tl.sin(angle)
        cos = tl.where(is_rope, cos, 1.0)
        sin = tl.where(is_rope, sin, 0.0)
        return tl.reshape(tl.join(even * cos - odd * sin, even * sin + odd * cos), (D,))

    @triton.jit
    def _block_quant_dequant(v, FLOOR: tl.constexpr, QMAX: tl.constexpr, MANT: tl.constexpr,
                             MIN_EXP: tl.constexpr, LIBDEVICE: tl.constexpr):
        """Quant-dequant of the rows of v [blocks, block], a power-of-two scale per row:
        2^ceil(log2(max(amax, FLOOR) * (1 / QMAX)))."""
        k = scale_exponent(tl.max(tl.abs(v), 1), FLOOR, QMAX)
        y = v * pow2(-k)[:, None]
        y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
        return round_minifloat(y, MANT, MIN_EXP, LIBDEVICE) * pow2(k)[:, None]

    @triton.jit
    def _hadamard(v, D: tl.constexpr, LOG2D: tl.constexpr, SCALE: tl.constexpr):
        """H_D v / sqrt(D), H_D the Sylvester Hadamard: log2(D) butterfly stages, each on groups
        of 2h consecutive values (a, b) -> (a + b, a - b), as ``quant_sim.hadamard_rotate``."""
        for s in tl.static_range(LOG2D):  # h = 2 ** s, inline: shapes need constexprs
            g = tl.permute(tl.reshape(v, (D // (2 ** (s + 1)), 2, 2 ** s)), (0, 2, 1))
            a, b = tl.split(g)
            v = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), (D,))
        return v * SCALE

    @triton.jit
    def _simulate(u, D: tl.constexpr, ROPE: tl.constexpr, SIM: tl.constexpr,
                  LOG2D: tl.constexpr, HSCALE: tl.constexpr, LIBDEVICE: tl.constexpr):
        if SIM == 1:  # main compressor: FP8 E4M3 block-64 on the non-rope channels
            blocks = tl.reshape(u, (D // 64, 64))
            q = _block_quant_dequant(blocks, FP8_FLOOR, FP8_MAX, 3, -6, LIBDEVICE)
            nope = tl.arange(0, D // 64) < (D - ROPE) // 64
            u = tl.reshape(tl.where(nope[:, None], q, blocks), (D,))
        elif SIM == 2:  # indexer fp8: E4M3, one scale per 128 channels
            u = tl.reshape(_block_quant_dequant(tl.reshape(u, (D // 128, 128)), FP8_FLOOR,
                                                FP8_MAX, 3, -6, LIBDEVICE), (D,))
        elif SIM == 3:  # indexer hadamard_fp4: Hadamard, then E2M1 block-32
            v = tl.reshape(_hadamard(u, D, LOG2D, HSCALE), (D // 32, 32))
            u = tl.reshape(_block_quant_dequant(v, FP4_FLOOR, FP4_MAX, 1, 0, LIBDEVICE), (D,))
        return u

    @triton.jit
    def _compress_entries_kernel(
        ring_ptr, rows_ptr, rsrc_ptr, csrc_ptr, s_src, ent_ptr, w_ptr, freq_ptr, out_ptr, s_out,
        eps, v_ptr, slot_ptr, st_ptr, tab_ptr, st_tab, n_seqs, max_logical, B, BLK,
        R: tl.constexpr, COFF: tl.constexpr, D: tl.constexpr, ROPE: tl.constexpr,
        BC: tl.constexpr, SIM: tl.constexpr, LOG2D: tl.constexpr, HSCALE: tl.constexpr,
        LIBDEVICE: tl.constexpr,
        STORE: tl.constexpr = False, OUT_F32: tl.constexpr = False, FMT: tl.constexpr = 0,
        DP: tl.constexpr = 1, NOPE: tl.constexpr = 1, NT: tl.constexpr = 1,
        TP: tl.constexpr = 1, S_ROPE: tl.constexpr = 0, RP: tl.constexpr = 1,
        SB: tl.constexpr = 0, PADP: tl.constexpr = 1, IN_BF16: tl.constexpr = False,
        skip_slot=-1, SKIP: tl.constexpr = False, PDL: tl.constexpr = False,
    ):
        """One program an entry (module docstring). STORE: the program then also writes its
        entry into the paged store (``st_ptr`` ...: :func:`dsv4.kernels.store_rows.store_row`
        with FMT ... IN_BF16, the store's ROPE as S_ROPE) as row ``ent[e]`` of slot
        ``slot[e]``, reading back the values it wrote through ``v_ptr`` (``out``, or its int16
        view for bf16); OUT_F32 (the interpreter's fp32 ``out``): those values rounded to bf16
        first, as the host's cast of ``out`` rounds them. SKIP (with STORE): a job of slot
        ``skip_slot`` does nothing - neither its entry nor its ``out`` row is written."""
        wait_for_prior_kernel(PDL)
        e = tl.program_id(0).to(tl.int64)
        run = True
        if SKIP:
            run = tl.load(slot_ptr + e) != skip_slot
        if run:
            _make_entry(ring_ptr, rows_ptr, rsrc_ptr, csrc_ptr, s_src, ent_ptr, w_ptr, freq_ptr,
                        out_ptr, s_out, eps, v_ptr, slot_ptr, st_ptr, tab_ptr, st_tab, n_seqs,
                        max_logical, B, BLK, e, R, COFF, D, ROPE, BC, SIM, LOG2D, HSCALE,
                        LIBDEVICE, STORE, OUT_F32, FMT, DP, NOPE, NT, TP, S_ROPE, RP, SB, PADP,
                        IN_BF16)
        let_next_kernel_launch(PDL)

    @triton.jit
    def _compress_entries_pair_kernel(
        ring_ptr, rows_ptr, rsrc_ptr, csrc_ptr, s_src, ent_ptr, w_ptr, freq_ptr, out_ptr, s_out,
        eps, v_ptr, slot_ptr, st_ptr, tab_ptr, st_tab, n_seqs, max_logical, B, BLK, skip_slot,
        E, ring2_ptr, rows2_ptr, rsrc2_ptr, csrc2_ptr, s_src2, ent2_ptr, w2_ptr, freq2_ptr,
        out2_ptr, s_out2, eps2, v2_ptr, slot2_ptr, st2_ptr, tab2_ptr, st_tab2, n_seqs2,
        max_logical2, B2, BLK2, skip_slot2, E2,
        R: tl.constexpr, COFF: tl.constexpr, D: tl.constexpr, ROPE: tl.constexpr,
        BC: tl.constexpr, SIM: tl.constexpr, LOG2D: tl.constexpr, HSCALE: tl.constexpr,
        STORE: tl.constexpr, OUT_F32: tl.constexpr, FMT: tl.constexpr, DP: tl.constexpr,
        NOPE: tl.constexpr, NT: tl.constexpr, TP: tl.constexpr, S_ROPE: tl.constexpr,
        RP: tl.constexpr, SB: tl.constexpr, PADP: tl.constexpr, IN_BF16: tl.constexpr,
        SKIP: tl.constexpr,
        R2: tl.constexpr, COFF2: tl.constexpr, D2: tl.constexpr, ROPE2: tl.constexpr,
        BC2: tl.constexpr, SIM2: tl.constexpr, LOG2D2: tl.constexpr, HSCALE2: tl.constexpr,
        STORE2: tl.constexpr, OUT_F322: tl.constexpr, FMT2: tl.constexpr, DP2: tl.constexpr,
        NOPE2: tl.constexpr, NT2: tl.constexpr, TP2: tl.constexpr, S_ROPE2: tl.constexpr,
        RP2: tl.constexpr, SB2: tl.constexpr, PADP2: tl.constexpr, IN_BF162: tl.constexpr,
        SKIP2: tl.constexpr,
        LIBDEVICE: tl.constexpr, PDL: tl.constexpr = False,
    ):
        """:func:`_compress_entries_kernel` for two compressors in one launch: program (e, 0)
        makes the first's entry e (e < E), program (e, 1) the second's (e < E2); the second's
        arguments and constants are the first's names with a 2 added."""
        wait_for_prior_kernel(PDL)
        e = tl.program_id(0).to(tl.int64)
        if tl.program_id(1) == 0:
            if _pair_job_runs(e, E, slot_ptr, skip_slot, SKIP):
                _make_entry(ring_ptr, rows_ptr, rsrc_ptr, csrc_ptr, s_src, ent_ptr, w_ptr,
                            freq_ptr, out_ptr, s_out, eps, v_ptr, slot_ptr, st_ptr, tab_ptr,
                            st_tab, n_seqs, max_logical, B, BLK, e, R, COFF, D, ROPE, BC, SIM,
                            LOG2D, HSCALE, LIBDEVICE, STORE, OUT_F32, FMT, DP, NOPE, NT, TP,
                            S_ROPE, RP, SB, PADP, IN_BF16)
        else:
            if _pair_job_runs(e, E2, slot2_ptr, skip_slot2, SKIP2):
                _make_entry(ring2_ptr, rows2_ptr, rsrc2_ptr, csrc2_ptr, s_src2, ent2_ptr,
                            w2_ptr, freq2_ptr, out2_ptr, s_out2, eps2, v2_ptr, slot2_ptr,
                            st2_ptr, tab2_ptr, st_tab2, n_seqs2, max_logical2, B2, BLK2, e, R2,
                            COFF2, D2, ROPE2, BC2, SIM2, LOG2D2, HSCALE2, LIBDEVICE, STORE2,
                            OUT_F322, FMT2, DP2, NOPE2, NT2, TP2, S_ROPE2, RP2, SB2, PADP2,
                            IN_BF162)
        let_next_kernel_launch(PDL)

    @triton.jit
    def _pair_job_runs(e, n, slot_ptr, skip_slot, SKIP: tl.constexpr):
        """Whether a pair part's job ``e`` runs: one of its ``n`` jobs and, with SKIP, not of
        slot ``skip_slot`` (the single launch's test, for a grid sized by the larger part)."""
        run = e < n
        if SKIP:
            run = run & (tl.load(slot_ptr + e, mask=run, other=skip_slot) != skip_slot)
        return run

    @triton.jit
    def _make_entry(ring_ptr, rows_ptr, rsrc_ptr, csrc_ptr, s_src, ent_ptr, w_ptr, freq_ptr,
                    out_ptr, s_out, eps, v_ptr, slot_ptr, st_ptr, tab_ptr, st_tab, n_seqs,
                    max_logical, B, BLK, e, R: tl.constexpr, COFF: tl.constexpr,
                    D: tl.constexpr, ROPE: tl.constexpr, BC: tl.constexpr, SIM: tl.constexpr,
                    LOG2D: tl.constexpr, HSCALE: tl.constexpr, LIBDEVICE: tl.constexpr,
                    STORE: tl.constexpr, OUT_F32: tl.constexpr, FMT: tl.constexpr,
                    DP: tl.constexpr, NOPE: tl.constexpr, NT: tl.constexpr, TP: tl.constexpr,
                    S_ROPE: tl.constexpr, RP: tl.constexpr, SB: tl.constexpr,
                    PADP: tl.constexpr, IN_BF16: tl.constexpr):
        """:func:`_compress_entries_kernel`'s work for job ``e``."""
        ch = tl.arange(0, D)
        width: tl.constexpr = 2 * COFF * D
        m = tl.full([D], -1e30, tl.float32)  # finite: a tile of missing candidates adds 0
        den = tl.zeros([D], tl.float32)
        acc = tl.zeros([D], tl.float32)
        for c0 in range(0, COFF * R, BC):
            ci = c0 + tl.arange(0, BC)
            rs = tl.load(rsrc_ptr + e * s_src + ci)
            cs = tl.load(csrc_ptr + e * s_src + ci)
            in_call = cs >= 0
            in_ring = (rs >= 0) & (cs < 0)
            col = ((ci // R) * D)[:, None] + ch[None, :]  # a's channel; the score's is + COFF*D
            call_at = rows_ptr + (tl.maximum(cs, 0).to(tl.int64) * width)[:, None] + col
            ring_at = ring_ptr + (tl.maximum(rs, 0).to(tl.int64) * width)[:, None] + col
            a = tl.where(in_call[:, None], tl.load(call_at, mask=in_call[:, None], other=0.0),
                         tl.load(ring_at, mask=in_ring[:, None], other=0.0))
            b = tl.where(in_call[:, None],
                         tl.load(call_at + COFF * D, mask=in_call[:, None], other=0.0),
                         tl.load(ring_at + COFF * D, mask=in_ring[:, None], other=0.0))
            b = tl.where((in_call | in_ring)[:, None], b, float("-inf"))
            m_new = tl.maximum(m, tl.max(b, 0))
            p = _exp(b - m_new[None, :], LIBDEVICE)
            scale = _exp(m - m_new, LIBDEVICE)
            den = den * scale + tl.sum(p, 0)
            acc = acc * scale + tl.sum(p * a, 0)
            m = m_new
        pooled = acc / den
        # RMSNorm (fp32 statistics) with the norm weight
        inv_rms = _rsqrt(tl.sum(pooled * pooled, 0) / D + eps, LIBDEVICE)
        u = pooled * inv_rms * tl.load(w_ptr + ch).to(tl.float32)
        u = _rope_interleaved(u, tl.load(ent_ptr + e) * R, freq_ptr, D, ROPE, LIBDEVICE)
        u = _simulate(u, D, ROPE, SIM, LOG2D, HSCALE, LIBDEVICE)
        if STORE and OUT_F32:
            u = rounded(u, tl.bfloat16)
        tl.store(out_ptr + e * s_out + ch, u.to(out_ptr.dtype.element_ty))
        if STORE:
            tl.debug_barrier()  # the row's values, written by every thread, read back by all
            store_row(st_ptr, v_ptr + e * s_out, tl.load(slot_ptr + e).to(tl.int64),
                      tl.load(ent_ptr + e).to(tl.int64), tab_ptr, st_tab, n_seqs, max_logical,
                      B, BLK, FMT, D, DP, NOPE, NT, TP, S_ROPE, RP, SB, PADP, IN_BF16)


    @triton.jit
    def _raw_rows_kernel(ks_ptr, s_ks, pos_ptr, ape_ptr, out_ptr, s_out, R: tl.constexpr,
                         WIDTH: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
                         ks2_ptr=None, s_ks2=0, ape2_ptr=None, out2_ptr=None, s_out2=0,
                         WIDTH2: tl.constexpr = 0, BLOCK2: tl.constexpr = 0,
                         v_ptr=None, s_v=0, slot_ptr=None, row_ptr=None, st_ptr=None,
                         tab_ptr=None, st_tab=0, n_seqs=0, max_logical=0, B=0, BLK=0,
                         STORE_COL: tl.constexpr = 0, FMT: tl.constexpr = 0,
                         D: tl.constexpr = 1, DP: tl.constexpr = 1, NOPE: tl.constexpr = 1,
                         NT: tl.constexpr = 1, TP: tl.constexpr = 1, ROPE: tl.constexpr = 0,
                         RP: tl.constexpr = 1, SB: tl.constexpr = 0, PADP: tl.constexpr = 1,
                         IN_BF16: tl.constexpr = False):
        """Row t: [a | s + ape[pos mod R]] from the score GEMM's row [a | s] (fp32); with
        WIDTH2 > 0 programs (t, 1) do the same for a second compressor of the same ratio. With
        STORE_COL > 0, programs (t, STORE_COL) write row t of ``v`` (the step's window rows)
        into a paged store instead: :func:`dsv4.kernels.store_rows.store_row` as row
        ``row[t]`` of slot ``slot[t]`` (``st_ptr`` ... ``BLK``, FMT ... IN_BF16 its
        arguments)."""
        wait_for_prior_kernel(PDL)
        t = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1)
        # the store's branch is compiled only where STORE_COL > 0 (its pointers are None else)
        if STORE_COL > 0:
            if col == STORE_COL:
                store_row(st_ptr, v_ptr + t * s_v, tl.load(slot_ptr + t).to(tl.int64),
                          tl.load(row_ptr + t).to(tl.int64), tab_ptr, st_tab, n_seqs,
                          max_logical, B, BLK, FMT, D, DP, NOPE, NT, TP, ROPE, RP, SB, PADP,
                          IN_BF16)
            else:
                _raw_rows_column(ks_ptr, s_ks, pos_ptr, ape_ptr, out_ptr, s_out, t, col, R,
                                 WIDTH, BLOCK, ks2_ptr, s_ks2, ape2_ptr, out2_ptr, s_out2,
                                 WIDTH2, BLOCK2)
        else:
            _raw_rows_column(ks_ptr, s_ks, pos_ptr, ape_ptr, out_ptr, s_out, t, col, R, WIDTH,
                             BLOCK, ks2_ptr, s_ks2, ape2_ptr, out2_ptr, s_out2, WIDTH2, BLOCK2)
        let_next_kernel_launch(PDL)

    @triton.jit
    def _raw_rows_column(ks_ptr, s_ks, pos_ptr, ape_ptr, out_ptr, s_out, t, col,
                         R: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr, ks2_ptr,
                         s_ks2, ape2_ptr, out2_ptr, s_out2, WIDTH2: tl.constexpr,
                         BLOCK2: tl.constexpr):
        """Row t of the first compressor (column 0) or, with WIDTH2 > 0, the second (1)."""
        if WIDTH2 > 0:  # noqa: SIM102 - a constexpr beside a runtime test
            if col == 1:
                _raw_row(ks2_ptr, s_ks2, pos_ptr, ape2_ptr, out2_ptr, s_out2, t, R, WIDTH2,
                         BLOCK2)
            else:
                _raw_row(ks_ptr, s_ks, pos_ptr, ape_ptr, out_ptr, s_out, t, R, WIDTH, BLOCK)
        else:
            _raw_row(ks_ptr, s_ks, pos_ptr, ape_ptr, out_ptr, s_out, t, R, WIDTH, BLOCK)

    @triton.jit
    def _raw_row(ks_ptr, s_ks, pos_ptr, ape_ptr, out_ptr, s_out, t, R: tl.constexpr,
                 WIDTH: tl.constexpr, BLOCK: tl.constexpr):
        ape_row = (tl.load(pos_ptr + t) % R) * WIDTH
        lanes = tl.arange(0, BLOCK)
        for c in tl.static_range(0, 2 * WIDTH, BLOCK):
            col = c + lanes
            m = col < 2 * WIDTH
            v = tl.load(ks_ptr + t * s_ks + col, mask=m, other=0.0)
            score = col >= WIDTH
            add = tl.load(ape_ptr + ape_row + col - WIDTH, mask=m & score, other=0.0)
            tl.store(out_ptr + t * s_out + col, v + add, mask=m)


    @triton.jit
    def _keep_rows_kernel(ring_ptr, rows_ptr, s_rows, dst_ptr, src_ptr, WIDTH: tl.constexpr,
                          BLOCK: tl.constexpr, PDL: tl.constexpr = False, K1=0,
                          ring2_ptr=None, rows2_ptr=None, s_rows2=0, dst2_ptr=None,
                          src2_ptr=None, K2=0, WIDTH2: tl.constexpr = 0,
                          BLOCK2: tl.constexpr = 0):
        """Ring row dst[k] (of the [-1, WIDTH] view) = step row src[k]; with WIDTH2 > 0,
        programs (k, 0) do that for k < K1 and programs (k, 1) the second ring's k < K2."""
        wait_for_prior_kernel(PDL)
        k = tl.program_id(0)
        if WIDTH2 > 0:
            if tl.program_id(1) == 1:
                if k < K2:
                    _keep_row(ring2_ptr, rows2_ptr, s_rows2, dst2_ptr, src2_ptr, k, WIDTH2,
                              BLOCK2)
            elif k < K1:
                _keep_row(ring_ptr, rows_ptr, s_rows, dst_ptr, src_ptr, k, WIDTH, BLOCK)
        else:
            _keep_row(ring_ptr, rows_ptr, s_rows, dst_ptr, src_ptr, k, WIDTH, BLOCK)
        let_next_kernel_launch(PDL)

    @triton.jit
    def _keep_row(ring_ptr, rows_ptr, s_rows, dst_ptr, src_ptr, k, WIDTH: tl.constexpr,
                  BLOCK: tl.constexpr):
        dst = tl.load(dst_ptr + k).to(tl.int64)
        src = tl.load(src_ptr + k).to(tl.int64)
        lanes = tl.arange(0, BLOCK)
        for c in tl.static_range(0, WIDTH, BLOCK):
            col = c + lanes
            m = col < WIDTH
            tl.store(ring_ptr + dst * WIDTH + col, tl.load(rows_ptr + src * s_rows + col, mask=m),
                     mask=m)


def keep_ring_rows_problem(ring: torch.Tensor, rows: torch.Tensor, keep_dst: torch.Tensor,
                           keep_src: torch.Tensor) -> str | None:
    """Why :func:`keep_ring_rows` refuses these arguments (None: it takes them)."""
    width = ring.shape[-1]
    if ring.dtype != torch.float32 or rows.dtype != torch.float32 or not ring.is_contiguous():
        return (f"keep_ring_rows kernel: a contiguous float32 ring and float32 rows, got "
                f"{ring.dtype} ring, {rows.dtype} rows")
    if rows.dim() != 2 or rows.shape[1] != width or rows.stride(1) != 1:
        return (f"keep_ring_rows kernel: rows must be [T, {width}] with contiguous columns, "
                f"got {tuple(rows.shape)}")
    if keep_dst.shape != keep_src.shape or keep_dst.dim() != 1:
        return (f"keep_dst {tuple(keep_dst.shape)} and keep_src {tuple(keep_src.shape)} must "
                "be the same [K]")
    return None


def keep_ring_rows_pair(first: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                        second: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
                        ) -> None:
    """:func:`keep_ring_rows` of two rings, each (ring, rows, keep_dst, keep_src) - a C4 layer's
    main and indexer compressor rings at the end of a step - in one launch."""
    for args in (first, second):
        why = keep_ring_rows_problem(*args)
        if why is not None:
            raise ValueError(why)
    (r1, x1, d1, s1), (r2, x2, d2, s2) = first, second
    k1, k2 = d1.shape[0], d2.shape[0]
    w1, w2 = r1.shape[-1], r2.shape[-1]
    if max(k1, k2):
        launch(_keep_rows_kernel, (max(k1, k2), 2),
            r1, x1, x1.stride(0), d1, s1, WIDTH=w1,
            BLOCK=min(1024, triton.next_power_of_2(w1)), K1=k1, ring2_ptr=r2, rows2_ptr=x2,
            s_rows2=x2.stride(0), dst2_ptr=d2, src2_ptr=s2, K2=k2, WIDTH2=w2,
            BLOCK2=min(1024, triton.next_power_of_2(w2)), num_warps=4, **pdl_args(r1.device))


def keep_ring_rows(ring: torch.Tensor, rows: torch.Tensor, keep_dst: torch.Tensor,
                   keep_src: torch.Tensor) -> None:
    """``ring.view(-1, width)[keep_dst] = rows[keep_src]`` (:meth:`dsv4.cache.step.CacheStep.
    keep_ring_rows`) as one launch: float32 ring and rows, one program a kept row."""
    why = keep_ring_rows_problem(ring, rows, keep_dst, keep_src)
    if why is not None:
        raise ValueError(why)
    width = ring.shape[-1]
    k = keep_dst.shape[0]
    if k:
        launch(_keep_rows_kernel, (k,), ring, rows, rows.stride(0), keep_dst, keep_src,
               WIDTH=width, BLOCK=min(1024, triton.next_power_of_2(width)), num_warps=4,
               **pdl_args(ring.device))


def raw_rows_problem(comp: Compressor, kv_score: torch.Tensor, positions: torch.Tensor
                     ) -> str | None:
    """Why :func:`raw_rows` refuses these arguments (None: it takes them)."""
    width = comp.coff * comp.dim
    if kv_score.dtype != torch.float32 or comp.ape.dtype != torch.float32:
        return (f"raw_rows kernel: fp32 scores and ape only, got {kv_score.dtype} and "
                f"{comp.ape.dtype}")
    if kv_score.dim() != 2 or kv_score.shape[1] != 2 * width or kv_score.stride(1) != 1:
        return (f"raw_rows kernel: kv_score must be [T, {2 * width}] with contiguous "
                f"columns, got {tuple(kv_score.shape)} strides {kv_score.stride()}")
    if positions.shape != kv_score.shape[:1]:
        return (f"positions {tuple(positions.shape)} do not match kv_score's "
                f"{kv_score.shape[0]} rows")
    return None


class RowStore(NamedTuple):
    """Rows for :func:`raw_rows` (or :func:`raw_rows_pair`) to store in its launch: what
    :func:`dsv4.kernels.store_rows.store_rows` takes - ``values`` [T, store dim] (one row a
    token of the raw rows' call) as row ``rows[t]`` of the sequence in slot ``slots[t]`` of
    ``store`` ([T] int64 or int32 each; a pair whose row is < 0 or whose block is not held is
    skipped)."""

    store: PagedStore
    slots: torch.Tensor
    rows: torch.Tensor
    values: torch.Tensor


def _row_store_launch(job: RowStore, t: int, device: torch.device) -> dict[str, object]:
    """The raw rows kernel's arguments and constants for storing ``job`` in its programs of
    column STORE_COL (set by the caller); ValueError naming the problem where the store kernel
    cannot take the rows or they do not match the call's ``t`` tokens."""
    store, slots, rows, values = job
    name = getattr(store, "name", "?")
    target = store_row_target(store, values.dtype, device)
    if isinstance(target, str):
        raise ValueError(f"raw_rows kernel, {name} store: {target}")
    if values.dim() != 2 or tuple(values.shape) != (t, store.fmt.dim):
        raise ValueError(f"raw_rows kernel, {name} store: values must be [T={t}, "
                         f"{store.fmt.dim}], got {tuple(values.shape)}")
    for what, x in (("slots", slots), ("rows", rows)):
        if (not isinstance(x, torch.Tensor) or x.shape != (t,) or x.device != device
                or x.dtype not in (torch.int64, torch.int32)):
            raise ValueError(f"raw_rows kernel, {name} store: {what} must be int64 or int32 "
                             f"[T={t}] on {device}, got {getattr(x, 'dtype', type(x).__name__)} "
                             f"{tuple(getattr(x, 'shape', ()))}")
    if values.stride(1) != 1:
        values = values.contiguous()
    v = values.view(torch.int16) if values.dtype == torch.bfloat16 else values
    (st, table, st_tab, n_seqs, max_logical, b, blk), consts = target
    return dict(v_ptr=v, s_v=v.stride(0), slot_ptr=slots.contiguous(), row_ptr=rows.contiguous(),
                st_ptr=st, tab_ptr=table, st_tab=st_tab, n_seqs=n_seqs,
                max_logical=max_logical, B=b, BLK=blk, **consts)


def raw_rows_pair(first: tuple[Compressor, torch.Tensor], second: tuple[Compressor, torch.Tensor],
                  positions: torch.Tensor, store: RowStore | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`raw_rows` of two compressors of the same ratio (a C4 layer's main and indexer
    compressor), each (compressor, its score GEMM's output), in one launch: the same rows;
    ``store`` as in :func:`raw_rows`."""
    outs = []
    for comp, score in (first, second):
        why = raw_rows_problem(comp, score, positions)
        if why is not None:
            raise ValueError(why)
        outs.append(torch.empty(score.shape[0], 2 * comp.coff * comp.dim, dtype=torch.float32,
                                device=score.device))
    (c1, k1), (c2, k2) = first, second
    # (both match positions' tokens: raw_rows_problem)
    if c1.ratio != c2.ratio or k1.device != k2.device:
        raise ValueError(f"raw_rows_pair: the ratios {c1.ratio} / {c2.ratio} must match, the "
                         f"scores be on one device ({k1.device} / {k2.device})")
    t = k1.shape[0]
    w1, w2 = c1.coff * c1.dim, c2.coff * c2.dim
    stored = {} if store is None else {**_row_store_launch(store, t, k1.device), "STORE_COL": 2}
    if t:
        launch(_raw_rows_kernel, (t, 3 if stored else 2),
            k1, k1.stride(0), positions, c1.ape.contiguous(), outs[0], outs[0].stride(0),
            R=c1.ratio, WIDTH=w1, BLOCK=min(1024, triton.next_power_of_2(2 * w1)),
            ks2_ptr=k2, s_ks2=k2.stride(0), ape2_ptr=c2.ape.contiguous(), out2_ptr=outs[1],
            s_out2=outs[1].stride(0), WIDTH2=w2,
            BLOCK2=min(1024, triton.next_power_of_2(2 * w2)), num_warps=4, **stored,
            **pdl_args(k1.device))
    return outs[0], outs[1]


def raw_rows(comp: Compressor, kv_score: torch.Tensor, positions: torch.Tensor,
             store: RowStore | None = None) -> torch.Tensor:
    """:meth:`Compressor.raw_rows` in fp32 as one launch (one program a token): [T, raw_width]
    float32 from the score GEMM's fp32 output ``kv_score`` [T, raw_width] (a row-strided view is
    read as it is) and ``positions`` [T]. The same one fp32 addition per score channel, so the
    rows are bit-equal to the torch path's. ``store``: the same launch also writes those rows
    (a step's window rows, one a token) into their paged store, byte for byte what
    :func:`~dsv4.kernels.store_rows.store_rows` writes - one launch a step instead of two
    (ValueError, before anything is launched, where the store kernel cannot take them)."""
    why = raw_rows_problem(comp, kv_score, positions)
    if why is not None:
        raise ValueError(why)
    width = comp.coff * comp.dim
    t = kv_score.shape[0]
    out = torch.empty(t, 2 * width, dtype=torch.float32, device=kv_score.device)
    stored = ({} if store is None
              else {**_row_store_launch(store, t, kv_score.device), "STORE_COL": 1})
    if t:
        launch(_raw_rows_kernel, (t, 2 if stored else 1), kv_score, kv_score.stride(0),
               positions, comp.ape.contiguous(), out, out.stride(0), R=comp.ratio, WIDTH=width,
               BLOCK=min(1024, triton.next_power_of_2(2 * width)), num_warps=4, **stored,
               **pdl_args(kv_score.device))
    return out


class EntryCompress(NamedTuple):
    """One compressor's part of :func:`compress_entries_pair`: :func:`compress_entries`'
    arguments of the same names."""

    comp: Compressor
    ring: torch.Tensor
    rows: torch.Tensor
    ring_src: torch.Tensor
    call_src: torch.Tensor
    entries: torch.Tensor
    store: PagedStore | None = None
    slots: torch.Tensor | None = None
    skip_slot: int | None = None


class _EntryLaunch(NamedTuple):
    """One compressor's part of a launch: the entries tensor it writes, the kernel's runtime
    arguments (up to ``skip_slot``) and its constants."""

    out: torch.Tensor
    args: tuple[object, ...]
    skip_slot: int
    consts: dict[str, object]
    warps: int


def _entry_launch(job: EntryCompress, rotary: RotaryEmbedding, out_dtype: torch.dtype,
                  simulate_quant: bool, index_numerics: str | None) -> _EntryLaunch:
    """Check :func:`compress_entries`' arguments (ValueError naming the first problem) and
    gather what its launch passes."""
    comp, ring, rows, ring_src, call_src, entries, store, slots, skip_slot = job
    why = kernel_unsupported(comp, rows, out_dtype, simulate_quant, index_numerics)
    if why is not None:
        raise ValueError(f"compress_entries kernel: {why}")
    if skip_slot is not None:
        if store is None:
            raise ValueError("compress_entries kernel: skip_slot skips a job's store; pass the "
                             "store too")
        if isinstance(skip_slot, bool) or not isinstance(skip_slot, int):
            raise ValueError(f"compress_entries kernel: skip_slot must be an int slot, got "
                             f"{skip_slot!r}")
    target = None
    if store is not None:
        target = store_row_target(store, out_dtype, rows.device)
        if isinstance(target, str):
            raise ValueError(f"compress_entries kernel, {store.name} store: {target}")
        if store.fmt.dim != comp.dim:
            raise ValueError(f"compress_entries kernel: the {store.name} store holds rows of "
                             f"{store.fmt.dim} values, the compressor's entries have {comp.dim}")
        if (not isinstance(slots, torch.Tensor) or slots.shape != entries.shape
                or slots.device != rows.device or slots.dtype not in (torch.int64, torch.int32)):
            raise ValueError(f"compress_entries kernel: slots must be int64 [E={entries.shape[0]}]"
                             f" on {rows.device} beside a store")
    d, width, n = comp.dim, comp.raw_width, comp.coff * comp.ratio
    if ring.dtype != torch.float32 or ring.shape[-1] != width or not ring.is_contiguous():
        raise ValueError(f"ring must be contiguous float32 [..., {width}], got {ring.dtype} "
                         f"{tuple(ring.shape)}")
    if rows.dim() != 2 or rows.shape[1] != width:
        raise ValueError(f"rows must be [T, {width}], got {tuple(rows.shape)}")
    e = entries.shape[0]
    if ring_src.shape != (e, n) or call_src.shape != (e, n) or ring_src.stride() != \
            call_src.stride() or ring_src.stride(1) != 1:
        raise ValueError(f"ring_src / call_src must be [E={e}, {n}] with the same strides and "
                         f"contiguous rows, got {tuple(ring_src.shape)}, {tuple(call_src.shape)}")
    # the interpreter's fp32 -> bf16 cast truncates (Triton 3.6): there the kernel writes fp32
    # and torch rounds (to nearest even, as the GPU's cast does)
    out = torch.empty(e, d, dtype=torch.float32 if _INTERPRET else out_dtype, device=rows.device)
    rows, entries = rows.contiguous(), entries.contiguous()  # no copies for a step's tensors
    inv_freq: torch.Tensor = rotary.inv_freq  # type: ignore[assignment]
    consts: dict[str, object] = dict(launch_constants(comp, simulate_quant, index_numerics,
                                                      libdevice=not _INTERPRET))
    warps = int(consts.pop("num_warps"))  # type: ignore[call-overload]
    if target is None:
        stored: tuple[object, ...] = (out, out, out, out, 0, 0, 0, 0, 0)  # unused
    else:
        assert slots is not None and not isinstance(target, str)
        (st, table, st_tab, n_seqs, max_logical, b, blk), store_consts = target
        consts.update(store_constants(store_consts, out.dtype))
        stored = (out.view(torch.int16) if consts["IN_BF16"] else out, slots.contiguous(), st,
                  table, st_tab, n_seqs, max_logical, b, blk)
        if skip_slot is not None:
            consts["SKIP"] = True
    args = (ring, rows, ring_src, call_src, ring_src.stride(0), entries, comp.norm.weight,
            inv_freq.to(torch.float32), out, out.stride(0), float(comp.norm.eps), *stored)
    return _EntryLaunch(out, args, -1 if skip_slot is None else skip_slot, consts, warps)


def compress_entries(comp: Compressor, ring: torch.Tensor, rows: torch.Tensor,
                     ring_src: torch.Tensor, call_src: torch.Tensor, entries: torch.Tensor,
                     rotary: RotaryEmbedding, out_dtype: torch.dtype, simulate_quant: bool,
                     index_numerics: str | None, store: PagedStore | None = None,
                     slots: torch.Tensor | None = None, skip_slot: int | None = None
                     ) -> torch.Tensor:
    """:meth:`Compressor.compress_jobs` (same arguments) in one launch; entries [E, comp.dim] in
    ``out_dtype`` (bf16). Raises ValueError where :func:`kernel_unsupported` gives a reason.

    With ``store`` (and ``slots`` [E]): the same launch also writes entry ``e`` into the paged
    store as row ``entries[e]`` of the sequence in ``slots[e]``, byte for byte what
    :func:`dsv4.kernels.store_rows.store_rows` of the returned entries writes (one launch for
    both; ValueError where :func:`~dsv4.kernels.store_rows.store_row_target` gives a reason).
    ``skip_slot`` (with ``store``): jobs of that slot do nothing - a padded step's unused jobs,
    in the pool's padding slot, which no sequence reads; their rows of the result are left
    unwritten (a padded step stores its entries in the launch and discards the result).
    Without it such a job computes its entry in full: in a decode runner's graph each unused job
    cost about 11 us (a C128 job pools 128 candidate rows), 98 of a Flash 8-layer step's 816
    (H100, 2026-12-06)."""
    job = _entry_launch(EntryCompress(comp, ring, rows, ring_src, call_src, entries, store,
                                      slots, skip_slot),
                        rotary, out_dtype, simulate_quant, index_numerics)
    e = entries.shape[0]
    if e:
        launch(_compress_entries_kernel, (e,), *job.args, **job.consts,
               skip_slot=job.skip_slot, num_warps=job.warps, **pdl_args(ring.device))
    return job.out.to(out_dtype)


_SINGLE_DEFAULTS = ({name: p.default for name, p in
                     inspect.signature(_compress_entries_kernel.fn).parameters.items()
                     if p.default is not p.empty and name not in ("skip_slot", "PDL")}
                    if triton_available() else {})
"""The single launch's optional constants (a store's, SKIP) at their defaults: the pair
kernel takes every constant of both parts explicitly."""


def compress_entries_pair(first: EntryCompress, second: EntryCompress,
                          rotary: RotaryEmbedding, out_dtype: torch.dtype,
                          simulate_quant: bool, index_numerics: str | None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`compress_entries` of two compressors - a C4 layer's main and indexer compressor
    - in one launch (programs (e, 0) the first's entries, (e, 1) the second's): the same
    entries and store writes as two calls, each checked as :func:`compress_entries` checks its
    own (ValueError before anything is launched). A step that completes entries, and every
    padded step of a decode runner, then takes one launch a C4 layer instead of two. Both parts
    run at the warps of the larger (a compressor of d = 128 at 8 warps where its own launch
    takes 4), so their sums may round in another order than the single launch's."""
    jobs = [_entry_launch(j, rotary, out_dtype, simulate_quant, index_numerics)
            for j in (first, second)]
    if first.rows.device != second.rows.device:
        raise ValueError(f"compress_entries_pair: the rows are on {first.rows.device} and "
                         f"{second.rows.device}; one device")
    e1, e2 = first.entries.shape[0], second.entries.shape[0]
    if max(e1, e2):
        c1, c2 = dict(jobs[0].consts), dict(jobs[1].consts)
        libdevice = c1.pop("LIBDEVICE")
        c2.pop("LIBDEVICE")
        c1, c2 = {**_SINGLE_DEFAULTS, **c1}, {**_SINGLE_DEFAULTS, **c2}
        launch(_compress_entries_pair_kernel, (max(e1, e2), 2),
               *jobs[0].args, jobs[0].skip_slot, e1, *jobs[1].args, jobs[1].skip_slot, e2,
               **c1, **{f"{k}2": v for k, v in c2.items()}, LIBDEVICE=libdevice,
               num_warps=max(jobs[0].warps, jobs[1].warps), **pdl_args(first.ring.device))
    return jobs[0].out.to(out_dtype), jobs[1].out.to(out_dtype)


def store_constants(store_consts: dict[str, object], out_dtype: torch.dtype
                    ) -> dict[str, object]:
    """The kernel's constants for storing its entries: ``store_row``'s (those of
    :func:`~dsv4.kernels.store_rows.store_row_target`) under the kernel's names (the store's
    ``ROPE`` as ``S_ROPE``; ``D`` is the kernel's own), for entries written as ``out_dtype``
    (bf16, or the interpreter's float32: then rounded to bf16 first)."""
    consts = {k: v for k, v in store_consts.items() if k not in ("D", "ROPE", "num_warps")}
    return {**consts, "S_ROPE": store_consts["ROPE"], "IN_BF16": out_dtype == torch.bfloat16,
            "STORE": True, "OUT_F32": out_dtype == torch.float32}


def launch_constants(comp: Compressor, simulate_quant: bool, index_numerics: str | None,
                     libdevice: bool = True) -> dict[str, int | float | bool]:
    """The kernel's compile-time constants and warps for ``comp`` (one program an entry:
    candidates in tiles of at most 16, d channels)."""
    d, n = comp.dim, comp.coff * comp.ratio
    return {"R": comp.ratio, "COFF": comp.coff, "D": d, "ROPE": comp.rope_dim, "BC": min(n, 16),
            "SIM": sim_mode(comp, simulate_quant, index_numerics), "LOG2D": d.bit_length() - 1,
            "HSCALE": d ** -0.5, "LIBDEVICE": libdevice, "num_warps": 4 if d <= 128 else 8}
