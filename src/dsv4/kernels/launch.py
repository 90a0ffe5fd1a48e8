"""Programmatic dependent launch (PDL) for the step's Triton kernels: on where it applies.

A decode step is ~24 short kernels, each waiting for the one before: the GPU idles between a
kernel's last program and the next kernel's first (the H200 Flash C4 step at M = 1 spends ~17
of its ~130 us of graph replay outside kernels, a 2026-12-03 profile). With PDL (sm_90 and
later) a kernel lets the next one launch as its programs reach their end; the next kernel's
programs park in ``griddepcontrol.wait`` until the one before has finished and its writes are
visible. Every kernel that takes part waits before it reads or writes anything, so the order
of memory accesses is the same as without PDL (the outputs are bit-equal, tested); only the
launch latency overlaps. Kernels of other libraries (cuBLAS, FlashMLA, PyTorch) launch as
usual and are waited for as usual.

Why at the end (H200, 2026-12-04; results in commit 968a741): with the next
kernel let launch right after the wait, its programs parked beside long-running ones - inside
the graph the 16-program top-k kernel of a 64K-context, M = 16 step ran 87 -> 260 us and the
step lost 32-45 %; with the trigger at the end PDL wins or ties on every measured step (-1 to
-3 %: Flash C4 M = 1 136.1 -> 132.0 us).

On by default since e6e9915 (2026-12-04), once the whole GPU suite and ``dsv4 verify
--platform cuda`` had passed under it (results in commit dbc8d43). Switched per process:
``DSV4_PDL=0`` in the environment turns it off (``1`` or unset: on), or
:func:`set_programmatic_launch` / :func:`programmatic_launch`. Read at each launch, so a CUDA
graph keeps what was on while it was captured. Under Triton's CPU interpreter and on GPUs
before sm_90 PDL is always off.

Kernel side: a ``PDL: tl.constexpr`` parameter, :func:`wait_for_prior_kernel` as the first
statement and :func:`let_next_kernel_launch` as the last; launch side: ``**pdl_args(device)``
(``PDL`` and Triton's ``launch_pdl`` option). Off, the kernels compile to exactly what they
were without it.

This module is also where the kernels learn whether Triton is installed and whether it runs as
its CPU interpreter (``TRITON_INTERPRET=1``, read at import).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import torch

from dsv4.usage import env_switch

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
try:  # guarded: every kernel module imports (reference paths, packing) without Triton
    import triton as _triton  # noqa: F401

    _HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the machine
    _HAVE_TRITON = False
_HAVE_GDC = False  # Triton's grid dependency control (set below where it imports)

_ON = env_switch("DSV4_PDL", default=True)


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


@contextmanager
def programmatic_launch(on: bool = True) -> Iterator[None]:
    """PDL on (or off) inside the block, restored after it (also on an exception)."""
    prev = set_programmatic_launch(on)
    try:
        yield
    finally:
        set_programmatic_launch(prev)


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
            """First statement of a kernel launched with :func:`pdl_args`: under PDL, wait
            until the kernel before has finished (its writes visible). Without PDL nothing is
            emitted."""
            if PDL:
                gdc_wait()

        @triton.jit
        def let_next_kernel_launch(PDL: tl.constexpr):
            """Last statement of such a kernel: under PDL, the next kernel may launch once
            every program has got here (or exited). At the end, not the start: a next kernel
            launched early parks its programs beside this one's for the whole of its run,
            which made the 16-program top-k kernel 3x slower at 64K (H200, 2026-12-04)."""
            if PDL:
                gdc_launch_dependents()
    else:  # pragma: no cover
        @triton.jit
        def wait_for_prior_kernel(PDL: tl.constexpr):
            """Triton without grid dependency control: nothing to emit (PDL stays off)."""
            pass

        @triton.jit
        def let_next_kernel_launch(PDL: tl.constexpr):
            """Triton without grid dependency control: nothing to emit (PDL stays off)."""
            pass
