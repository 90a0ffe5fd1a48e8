"""Triton's Python launch path without a GPU: a stand-in driver (a CUDA sm_90 device 0 on
stream 7) and a stand-in compiler whose kernels record their launches instead of running.

What runs against them is Triton's own ``JITFunction.run`` - argument binding and
specialisation, the cache key, the launch bookkeeping - and :mod:`dsv4.kernels.bound_launch`;
what is replaced is the compiler, the C launcher and the driver. Used by the bound-launch test
(``tests/kernels/test_bound_launch.py``) and the launch-cost benchmark
(``benchmarks/triton_launch_cost.py``). Needs Triton installed (any build)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

STREAM = 7
"""The stand-in driver's current stream."""


class StandInDriver:
    """Triton's active driver as a CUDA sm_90 device 0 (nothing reaches a GPU)."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return STREAM

    def get_current_target(self) -> Any:
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


class RecordingKernel:
    """A compiled kernel, named by Triton's cache key, whose launch records its arguments (the
    launcher's: grid, stream, function, metadata, launch metadata, hooks, then the kernel's)."""

    function = "fn"
    packed_metadata = "meta"

    def __init__(self, key: str) -> None:
        self.key = key
        self.launches = 0
        self.last: tuple[Any, ...] = ()

    def launch_metadata(self, *args: Any) -> None:
        return None

    def run(self, *args: Any) -> None:
        self.launches += 1
        self.last = args


@contextmanager
def stand_in_triton() -> Iterator[dict[str, RecordingKernel]]:
    """Triton's driver and compiler replaced by the stand-ins while the context is open;
    yields the kernels "compiled" so far, by cache key. Both are put back on exit."""
    from triton.runtime import driver
    from triton.runtime import jit as triton_jit

    kernels: dict[str, RecordingKernel] = {}
    real_compile = triton_jit.JITFunction._do_compile

    def compile_stand_in(self: Any, key: str, signature: Any, device: int, *rest: Any
                         ) -> RecordingKernel:
        kernel = kernels.setdefault(key, RecordingKernel(key))
        self.device_caches[device][0][key] = kernel
        return kernel

    saved = driver._active
    triton_jit.JITFunction._do_compile = compile_stand_in  # type: ignore[method-assign]
    driver.set_active(StandInDriver())
    try:
        yield kernels
    finally:
        driver._active = saved
        triton_jit.JITFunction._do_compile = real_compile  # type: ignore[method-assign]
