"""Programmatic dependent launch (PDL) for the step's Triton kernels: opt-in, off by default.

A decode step is ~24 short kernels, each waiting for the one before: the GPU idles between a
kernel's last program and the next kernel's first (the H200 Flash C4 step at M = 1 spends ~17
of its ~130 us of graph replay outside kernels, session 22's profile). With PDL (sm_90 and
later) a kernel is launched while the one before still runs; its programs park in
``griddepcontrol.wait`` until that kernel has finished and its writes are visible, then signal
that the next kernel may launch in turn. Every kernel that takes part waits before it reads or
writes anything, so the order of memory accesses is the same as without PDL; only the launch
latency overlaps. Kernels of other libraries (cuBLAS, FlashMLA, PyTorch) launch as usual and
are waited for as usual.

Switched per process: ``DSV4_PDL=1`` in the environment or :func:`set_programmatic_launch` /
:func:`programmatic_launch`. Under PDL the fp8 GEMMs may also start their weights on their way
into L2 before they wait (the weights do not depend on the kernel before): the first
``DSV4_PDL_PREFETCH`` bytes (or :func:`set_weight_prefetch`) of each program's slice of each
weight row; 0 (the default) asks for none. Both are read at each launch, so a CUDA graph keeps
what was on while it was captured. Under Triton's CPU interpreter and on GPUs before sm_90 PDL
is always off.

Kernel side: a ``PDL: tl.constexpr`` parameter and :func:`wait_for_prior_kernel` before the
kernel reads or writes anything (only index arithmetic and :func:`prefetch_l2` may come first);
launch side: ``**pdl_args(device)`` (``PDL`` and Triton's
``launch_pdl`` option). Off, the kernels compile to exactly what they were without it.

This module is also where the kernels learn whether Triton is installed and whether it runs as
its CPU interpreter (``TRITON_INTERPRET=1``, read at import).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import torch

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
try:  # guarded: every kernel module imports (reference paths, packing) without Triton
    import triton as _triton  # noqa: F401

    _HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the machine
    _HAVE_TRITON = False
_HAVE_GDC = False  # Triton's grid dependency control (set below where it imports)

_ON = os.environ.get("DSV4_PDL", "0") not in ("", "0")


def _check_prefetch(nbytes: object, where: str) -> int:
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0 or nbytes % 16:
        raise ValueError(f"{where}: the weight prefetch must be a non-negative multiple of 16 "
                         f"bytes, got {nbytes!r}")
    return nbytes


_PREFETCH = _check_prefetch(int(os.environ.get("DSV4_PDL_PREFETCH", "0") or 0),
                            "DSV4_PDL_PREFETCH")


def triton_available() -> bool:
    """Whether Triton imports here (its compiler, or its interpreter under TRITON_INTERPRET)."""
    return _HAVE_TRITON


def programmatic_launch_enabled() -> bool:
    """Whether the kernels are launched with PDL where the device supports it."""
    return _ON


def set_programmatic_launch(on: bool) -> bool:
    """Turn PDL on or off for the kernels launched from now on; returns the previous value."""
    global _ON
    if not isinstance(on, bool):
        raise TypeError(f"set_programmatic_launch: on must be a bool, got {on!r}")
    prev, _ON = _ON, on
    return prev


def weight_prefetch_bytes() -> int:
    """Under PDL, how many bytes of each weight row's K range an fp8 GEMM program asks L2 to
    fetch before it waits for the kernel before (0: none)."""
    return _PREFETCH


def set_weight_prefetch(nbytes: int) -> int:
    """Set :func:`weight_prefetch_bytes` (a multiple of 16; ValueError otherwise, nothing
    changed); returns the previous value. Acts only where PDL is on."""
    global _PREFETCH
    prev, _PREFETCH = _PREFETCH, _check_prefetch(nbytes, "set_weight_prefetch")
    return prev


@contextmanager
def programmatic_launch(on: bool = True, prefetch: int | None = None) -> Iterator[None]:
    """PDL on (or off) inside the block, and the weight prefetch where ``prefetch`` is given;
    both restored after it (also on an exception)."""
    if prefetch is not None:
        _check_prefetch(prefetch, "programmatic_launch")  # before anything changes
    prev = set_programmatic_launch(on)
    prev_pf = set_weight_prefetch(prefetch) if prefetch is not None else None
    try:
        yield
    finally:
        set_programmatic_launch(prev)
        if prev_pf is not None:
            set_weight_prefetch(prev_pf)


@cache
def _supports_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def pdl_args(device: torch.device) -> dict[str, bool]:
    """Launch keywords for a kernel with a ``PDL`` constexpr: ``PDL`` and ``launch_pdl`` True
    where PDL is on, ``device`` is a CUDA device of sm_90 or later and Triton compiles (not the
    interpreter); otherwise ``PDL=False`` alone."""
    on = (_ON and _HAVE_GDC and not _INTERPRET and device.type == "cuda"
          and _supports_pdl(device.index if device.index is not None
                            else torch.cuda.current_device()))
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


if _HAVE_TRITON:
    import triton
    import triton.language as tl

    try:  # Triton 3.4+
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

        _HAVE_GDC = True
    except ImportError:  # pragma: no cover - depends on the Triton version
        _HAVE_GDC = False

    if _HAVE_GDC:
        @triton.jit
        def wait_for_prior_kernel(PDL: tl.constexpr):
            """Before a kernel launched with :func:`pdl_args` reads or writes anything: under
            PDL, wait until the kernel before has finished (its writes visible). Without PDL
            nothing is emitted."""
            if PDL:
                gdc_wait()

        @triton.jit
        def let_next_kernel_launch(PDL: tl.constexpr):
            """Last statement of such a kernel: under PDL, the next kernel may launch once
            every program has got here (or exited). At the end, not the start: a next kernel
            launched early parks its programs beside this one's for the whole of its run,
            which made the 16-program top-k kernel 3x slower at 64K (H200, session 26)."""
            if PDL:
                gdc_launch_dependents()

        @triton.jit
        def prefetch_l2(addr, nbytes):
            """Ask L2 to fetch ``nbytes`` (a multiple of 16, int32 scalar or like ``addr``)
            from each byte address of the int64 tensor ``addr`` (16-byte aligned; 0: skip),
            without waiting: one ``cp.async.bulk.prefetch.L2`` per element. Reads nothing
            into the program, so it may run before :func:`wait_for_prior_kernel`."""
            n = tl.zeros(addr.shape, tl.int32) + nbytes
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.u64 p, $1, 0; "
                "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
                "=r,l,r", [addr, n], dtype=tl.int32, is_pure=False, pack=1)
    else:  # pragma: no cover
        @triton.jit
        def wait_for_prior_kernel(PDL: tl.constexpr):
            """Triton without grid dependency control: nothing to emit (PDL stays off)."""
            pass

        @triton.jit
        def let_next_kernel_launch(PDL: tl.constexpr):
            """Triton without grid dependency control: nothing to emit (PDL stays off)."""
            pass

        @triton.jit
        def prefetch_l2(addr, nbytes):
            """Never reached: PDL stays off, so no prefetch is asked for."""
            pass
