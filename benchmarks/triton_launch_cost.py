"""The Python cost of one Triton launch, measured without a GPU: ``JITFunction.run`` of the sparse
attention kernel with its decode-step argument list (27 arguments and its constexprs), Triton's
driver and compiled kernel replaced by stand-ins, so that what is timed is Triton's own Python
path - argument binding and specialisation, the cache-key lookup, the launch bookkeeping - and
not the C launcher or the driver, which every launch pays either way.

    python3 benchmarks/triton_launch_cost.py [--launches 5000]

Needs Triton (any build; no CUDA device). Prints us per launch and the profile's top entries.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from typing import Any

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime import jit as triton_jit


class _Driver:
    """Triton's active driver as a CUDA sm_90 device (no calls reach a GPU)."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


class _Compiled:
    """A compiled kernel whose launch does nothing (counts the launches)."""

    function = None
    packed_metadata = None

    def __init__(self) -> None:
        self.launches = 0
        self.last: tuple[Any, ...] = ()

    def launch_metadata(self, *args: Any) -> None:
        return None

    def run(self, *args: Any) -> None:
        self.launches += 1
        self.last = args


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launches", type=int, default=5000)
    args = ap.parse_args()
    driver.set_active(_Driver())
    compiled = _Compiled()

    def no_compile(self: Any, key: Any, signature: Any, device: Any, *rest: Any) -> _Compiled:
        return self.device_caches[device][0].setdefault(key, compiled)

    triton_jit.JITFunction._do_compile = no_compile  # type: ignore[method-assign]
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

    jit_path()
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
    per_round = max(1, args.launches // 9)
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
