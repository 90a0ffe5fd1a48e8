"""The output projection, ``wo_a`` (grouped) then ``wo_b``, in one persistent launch.

The first persistent piece of the step (docs/design.md, "Where the shape goes next"). Two
launches leave a gap between them: ``wo_b`` starts streaming its weight only after the last
``wo_a`` program and the launch boundary. Here one launch of a few programs per SM takes its
work from one queue: first every ``wo_a`` tile (group, row tile, K split), then every ``wo_b``
tile (row tile, K split). A program that has finished its ``wo_a`` share goes on to a ``wo_b``
tile while other programs finish ``wo_a``.

* **Readiness per group.** The program that stores a tile of z (``wo_a``'s output, the last of
  the tile's K splits to arrive) counts it on its group's counter. A ``wo_b`` tile over K
  blocks of groups g .. g' waits until those groups' counters hold every row tile, then reads z
  past L1 (``.cg``, as the split-K sums read their partials).
* **No deadlock.** A ``wo_b`` item is taken only after every ``wo_a`` item has been taken by a
  running program, and ``wo_a`` items wait for nothing: whatever the grid and the occupancy,
  every wait ends. Triton's CPU interpreter runs programs one after another: the first takes
  every item in order, so the same code runs there (and is tested there).
* **Replayable.** The last program to leave resets the queue, the readiness and the exit
  counters (the split-K counters reset themselves), so a CUDA graph can replay the launch.

Each tile runs :mod:`dsv4.kernels.fp8_linear`'s own tile code (``_gemm_tile``) with the tiles
and splits :func:`~dsv4.kernels.fp8_linear.choose_fp8_config` gives each GEMM, so z and y are
bit for bit the two launches' (``fp8_grouped_linear`` then ``fp8_linear``). Decode sizes only:
at most ``MAX_TOKENS`` tokens (one token tile). The ``cuda`` layer takes it for calls up to its
plan's ``output_projection_max_tokens``: 0 as shipped, since it is not yet timed.
"""

from __future__ import annotations

import torch

from dsv4.kernels.bound_launch import launch
from dsv4.kernels.fp8_linear import (
    _WORKSPACES,
    BLOCK,
    _check_weight,
    _kernel_runs_on,
    choose_fp8_config,
    fp8_grouped_linear,
    fp8_linear,
    sm_count,
)
from dsv4.kernels.fused_input_proj import SplitKWorkspace
from dsv4.kernels.launch import _INTERPRET, pdl_args, triton_available

__all__ = ["MAX_TOKENS", "PROGRAMS_PER_SM", "fp8_output_projection"]

MAX_TOKENS = 16
"""Tokens a call may bring (one 16-token tile: the readiness counters count one token tile)."""
PROGRAMS_PER_SM = 3
"""Persistent programs per SM (the separate launches' K splits aim at about 3 an SM)."""

if triton_available():
    import triton
    import triton.language as tl

    from dsv4.kernels.fp8_linear import _gemm_tile
    from dsv4.kernels.fused_input_proj import _fence_gpu, _prefetch_l2
    from dsv4.kernels.launch import let_next_kernel_launch, wait_for_prior_kernel

    @triton.jit(do_not_specialize=["M"])
    def _output_projection_kernel(
        o_ptr, so_m, so_g, wa_ptr, sa_ptr, stride_sa, z_ptr, sz_m, wb_ptr, sb_ptr, stride_sb,
        y_ptr, sy_m, ws_a, ws_b, cnt_a, cnt_b, ready, queue, exits,
        M, R, Ka, N, G, n_tiles_a, n_tiles_b, n_a_items, n_items, n_programs,
        BM: tl.constexpr, BN_A: tl.constexpr, SPLIT_A: tl.constexpr, BN_B: tl.constexpr,
        SPLIT_B: tl.constexpr, SCALE_F32_A: tl.constexpr, SCALE_F32_B: tl.constexpr,
        FENCE: tl.constexpr, DOT_DT: tl.constexpr, DOT_PREC: tl.constexpr,
        ACT_B: tl.constexpr, INTERP: tl.constexpr, PREFETCH_B: tl.constexpr = False,
        PDL: tl.constexpr = False,
    ):
        wait_for_prior_kernel(PDL)
        K_b = G * R
        item = tl.atomic_add(queue, 1, sem="relaxed", scope="gpu")
        while item < n_items:
            if item < n_a_items:  # wo_a: group g's rows n0 .. n0 + BN_A, one K split
                tile = item // SPLIT_A
                stored = _gemm_tile(
                    o_ptr, so_m, so_g, wa_ptr, sa_ptr, stride_sa, z_ptr, sz_m, R, ws_a, cnt_a,
                    M, R, Ka, BM, n_tiles_a, G, o_ptr, 0, 0, tile, item % SPLIT_A, BM, BN_A,
                    SPLIT_A, True, SCALE_F32_A, FENCE, DOT_DT, DOT_PREC, False, False, INTERP)
                if stored != 0:  # this tile of z is in memory: count it for its group
                    if FENCE:  # every thread's stores before the count (as split-K's sums)
                        _fence_gpu()
                    tl.debug_barrier()
                    tl.atomic_add(ready + tile // n_tiles_a, 1, sem="release", scope="gpu")
            else:  # wo_b: rows n0 .. n0 + BN_B over one K split of z
                b = item - n_a_items
                split = b % SPLIT_B
                nkb = K_b // 128
                kb0 = split * nkb // SPLIT_B
                kb1 = (split + 1) * nkb // SPLIT_B
                g_lo = kb0 * 128 // R
                g_hi = (kb1 * 128 - 1) // R
                if PREFETCH_B and not INTERP:  # its weight rows do not wait for z: into L2
                    rows = (b // SPLIT_B) * BN_B + tl.arange(0, BN_B)
                    addr = (wb_ptr + rows.to(tl.int64) * K_b + kb0 * 128).to(tl.int64,
                                                                               bitcast=True)
                    _prefetch_l2(addr, (kb1 - kb0) * 128)
                for g in range(g_lo, g_hi + 1):  # wait for those groups of z
                    r = tl.atomic_add(ready + g, 0, sem="acquire", scope="gpu")
                    while r < n_tiles_a:
                        r = tl.atomic_add(ready + g, 0, sem="acquire", scope="gpu")
                if FENCE:
                    _fence_gpu()
                _gemm_tile(
                    z_ptr, sz_m, 0, wb_ptr, sb_ptr, stride_sb, y_ptr, sy_m, 0, ws_b, cnt_b, M,
                    N, K_b, BM, n_tiles_b, 1, z_ptr, 0, 0, b // SPLIT_B, split, BM, BN_B,
                    SPLIT_B, True, SCALE_F32_B, FENCE, DOT_DT, DOT_PREC, ACT_B, False, INTERP,
                    X_CG=True)
            item = tl.atomic_add(queue, 1, sem="relaxed", scope="gpu")
        # the last program out: every item is done and no program takes another - reset
        out = tl.atomic_add(exits, 1, sem="acq_rel", scope="gpu")
        if out == n_programs - 1:
            for g in range(0, G):
                tl.atomic_xchg(ready + g, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(queue, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(exits, 0, sem="relaxed", scope="gpu")
        let_next_kernel_launch(PDL)


def fp8_output_projection(o: torch.Tensor, wa: torch.Tensor, sa: torch.Tensor,
                          wb: torch.Tensor, sb: torch.Tensor, *, act_quant: bool = False,
                          prefetch: bool = True, n_sm: int | None = None,
                          workspace: SplitKWorkspace | None = None) -> torch.Tensor:
    """y [M, N] bf16 = wo_b(wo_a(o)): ``o`` [M, G, Ka] bf16 (each token's G output groups),
    ``wa`` [G * R, Ka] e4m3 with block scales ``sa`` (group g's rows g*R .. g*R + R - 1),
    ``wb`` [N, G * R] e4m3 with block scales ``sb``; ``act_quant``: z quantised per 128 for
    ``wo_b`` as the act8 GEMM does (docs/spec.md §6.3). One persistent launch (module
    docstring) where the kernels run; elsewhere, and above ``MAX_TOKENS`` tokens, the two
    launches it equals bit for bit. ``prefetch``: a ``wo_b`` tile asks for its weight rows into
    L2 before it waits for z (on a GPU; the same output either way). ``n_sm``: the SM count the
    tiles are chosen for (default: the device's); ``workspace`` as
    :func:`~dsv4.kernels.fp8_linear.fp8_linear`'s."""
    if o.dim() != 3 or o.dtype != torch.bfloat16:
        raise ValueError(f"o must be bf16 [M, G, Ka], got {o.dtype} {tuple(o.shape)}")
    M, G, Ka = o.shape
    _check_weight(wa, sa)
    _check_weight(wb, sb)
    if wa.shape[1] != Ka or wa.shape[0] % G or (wa.shape[0] // G) % BLOCK:
        raise ValueError(f"wo_a must be [G * R, {Ka}] with G = {G} and R a multiple of "
                         f"{BLOCK}, got {tuple(wa.shape)}")
    R = wa.shape[0] // G
    if wb.shape[1] != G * R:
        raise ValueError(f"wo_b must be [N, {G * R}] (wo_a's outputs), got {tuple(wb.shape)}")
    N = wb.shape[0]
    n_sm = n_sm or sm_count(o.device)
    cfg_a = choose_fp8_config(M, G * R, Ka, n_sm)
    cfg_b = choose_fp8_config(M, N, G * R, n_sm, act_fp8=act_quant)
    if M == 0 or M > MAX_TOKENS or not _kernel_runs_on(o.device):
        z = fp8_grouped_linear(o, wa, sa, config=cfg_a, workspace=workspace).flatten(1)
        return fp8_linear(z, wb, sb, config=cfg_b, workspace=workspace)
    assert cfg_a.swap and cfg_b.swap and cfg_a.block_m == cfg_b.block_m == MAX_TOKENS
    o = o if o.stride(2) == 1 else o.contiguous()
    wa, sa, wb, sb = wa.contiguous(), sa.contiguous(), wb.contiguous(), sb.contiguous()
    bm = cfg_a.block_m
    split_a = max(1, min(cfg_a.split_k, Ka // BLOCK))
    split_b = max(1, min(cfg_b.split_k, G * R // BLOCK))
    n_tiles_a, n_tiles_b = R // cfg_a.block_n, N // cfg_b.block_n
    n_a_items = G * n_tiles_a * split_a
    n_items = n_a_items + n_tiles_b * split_b
    n_part_a, n_part_b = split_a * G * bm * R, split_b * bm * N
    n_cnt_a = G * n_tiles_a
    if workspace is None:
        workspace = _WORKSPACES.setdefault(str(o.device), SplitKWorkspace())
    ws, cnt = workspace.get(o.device, n_part_a + n_part_b, n_cnt_a + n_tiles_b + G + 2)
    cnt_b = cnt[n_cnt_a:]
    ready = cnt_b[n_tiles_b:]
    queue, exits = ready[G:G + 1], ready[G + 1:G + 2]
    z = torch.empty(M, G * R, device=o.device, dtype=torch.bfloat16)
    y = torch.empty(M, N, device=o.device, dtype=torch.bfloat16)
    programs = min(n_items, PROGRAMS_PER_SM * n_sm)
    sa_f32, sb_f32 = sa.dtype == torch.float32, sb.dtype == torch.float32
    sa_v = sa if sa_f32 else sa.view(torch.uint8)
    sb_v = sb if sb_f32 else sb.view(torch.uint8)
    launch(_output_projection_kernel, (programs,),
        o, o.stride(0), o.stride(1), wa, sa_v, sa_v.stride(0), z, z.stride(0), wb, sb_v,
        sb_v.stride(0), y, y.stride(0), ws, ws[n_part_a:], cnt, cnt_b, ready, queue, exits,
        M, R, Ka, N, G, n_tiles_a, n_tiles_b, n_a_items, n_items, programs,
        BM=bm, BN_A=cfg_a.block_n, SPLIT_A=split_a, BN_B=cfg_b.block_n, SPLIT_B=split_b,
        SCALE_F32_A=sa_f32, SCALE_F32_B=sb_f32, FENCE=not _INTERPRET,
        DOT_DT=tl.float32 if _INTERPRET else tl.bfloat16,
        DOT_PREC="ieee" if _INTERPRET else "tf32", ACT_B=act_quant, INTERP=_INTERPRET,
        PREFETCH_B=prefetch,
        num_warps=cfg_a.num_warps, num_stages=cfg_a.num_stages, **pdl_args(o.device))
    return y
