"""The Python cost of one Triton launch, measured without a GPU: ``JITFunction.run`` of the sparse
attention kernel with its decode-step argument list (27 arguments and its constexprs), Triton's
driver and compiled kernel replaced by stand-ins (:mod:`dsv4.testing.triton_stand_ins`), so
that what is timed is Triton's own Python path - argument binding and specialisation, the
cache-key lookup, the launch bookkeeping - and not the C launcher or the driver, which every
launch pays either way; beside it the bound launch (:mod:`dsv4.kernels.bound_launch`).

    python3 benchmarks/triton_launch_cost.py [--launches 5000]

Needs Triton (any build; no CUDA device). Prints us per launch and the profile's top entries.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch
import triton
import triton.language as tl

from dsv4.testing.triton_stand_ins import stand_in_triton


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launches", type=int, default=5000)
    args = ap.parse_args()
    with stand_in_triton():
        run(args.launches)


def run(launches: int) -> None:
    from dsv4.kernels.bound_launch import launch
    from dsv4.kernels.sparse_mqa import _sparse_mqa_kernel

    t, h, d, w, k, b = 1, 64, 512, 128, 512, 64
    q = torch.empty(t, h, d, dtype=torch.bfloat16)
    o = torch.empty_like(q)
    sink, ws = torch.empty(h), torch.empty(16)
    store = torch.empty(100, 656 * b, dtype=torch.uint8)
    widx = torch.zeros(t, w, dtype=torch.int32)
    cidx = torch.zeros(t, k, dtype=torch.int32)

    grid = (64,)
    kargs = (q, q.stride(0), q.stride(1), o, o.stride(0), o.stride(1), sink, ws, ws,
             store, widx, widx.stride(0), 656 * b, store, cidx, cidx.stride(0), 656 * b,
             t, h, w, k, b, w + k, 1, 0.1)
    kw = dict(D=d, DV=d, BH=64, BN=64, SPLIT=False, FP8=True, NOPE=448, DR=704, SR=8,
              DOT_DT=tl.bfloat16, DOT_PREC="tf32", num_warps=8, num_stages=2, PDL=True,
              launch_pdl=True)

    def jit_path() -> None:
        _sparse_mqa_kernel[grid](*kargs, **kw)

    def bound_path() -> None:
        launch(_sparse_mqa_kernel, grid, *kargs, **kw)

    compiled = _sparse_mqa_kernel[grid](*kargs, **kw)
    seen = compiled.last
    bound_path()
    bound_path()
    if compiled.last[:4] != seen[:4] or compiled.last[9:] != seen[9:]:
        raise SystemExit("the bound launch passed other arguments than Triton's path")
    paths = (("Triton's path, kernel[grid](...)", jit_path),
             ("bound, dsv4.kernels.bound_launch.launch", bound_path))
    for _, fn in paths:
        for _ in range(100):
            fn()
    # the two paths alternate in rounds (this host's speed drifts); the median round of each
    times: dict[str, list[float]] = {name: [] for name, _ in paths}
    per_round = max(1, launches // 9)
    for _ in range(9):
        for name, fn in paths:
            t0 = time.perf_counter()
            for _ in range(per_round):
                fn()
            times[name].append((time.perf_counter() - t0) / per_round * 1e6)
    for name, fn in paths:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(2000):
            fn()
        prof.disable()
        print(name)
        pstats.Stats(prof).sort_stats("tottime").print_stats(8)
    for name, _ in paths:
        print(f"Triton {triton.__version__}, {name}: {statistics.median(times[name]):.1f} us per "
              f"launch in Python (median of 9 rounds of {per_round})")


if __name__ == "__main__":
    main()
