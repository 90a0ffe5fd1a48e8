"""Host-to-device copies that never wait for the GPU.

A copy from ordinary (pageable) host memory to a CUDA tensor makes PyTorch synchronise the
stream: the host waits until every kernel queued before it has run, and the GPU then idles
while the host launches what follows. A prefill call queues milliseconds of GEMMs ahead of its
cache-table updates, so each such copy costs the GPU about that much idle time (the 2026-12-03
16K prefill profile: 9 stream synchronisations, 6.4 ms of a 45 ms Pro call). These helpers copy
through a fresh pinned buffer instead, asynchronously on the current stream: PyTorch's caching
host allocator keeps the buffer until the copy has run, and the host may change its own tensor
right after (the copy reads the snapshot).

The snapshots come from a pinned ring (:class:`PinnedRing`, 16 MiB per device, allocated on
first use): a fresh pinned buffer per copy cost about 0.27 ms of host time each (the 2026-12-03
16K prefill profile: 13 of them, 3.5 ms of a host-bound 20.5 ms call), a slice of the ring a
memcpy. Each slice is guarded by an event recorded after the copy that reads it; the ring
waits for that event only when it comes round to the slice again (the GPU is then 16 MiB of
copies behind). Larger copies take a fresh pinned buffer.

Under CUDA-graph capture :func:`upload` is captured like any copy: the graph keeps the pinned
snapshot's address, so a caller that replays it keeps the snapshot (``upload`` returns a
fresh one then, never a ring slice, which later copies overwrite; a step's metadata keeps it).
:func:`upload_once` and :func:`upload_into` keep no snapshot and refuse capture, loudly. Other
devices get plain copies (on the CPU a copy too, so a host tensor changed after its upload
differs from its device side there as on a GPU).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

import torch

RING_BYTES = 16 << 20
"""Pinned bytes of each device's ring; a copy larger than a quarter of it takes its own buffer."""

_ALIGN = 256


class PinnedRing:
    """A pinned host buffer handed out in slices, round-robin: :meth:`stage` copies a host tensor
    into the next free slice; :meth:`guard` records, after the device copy that reads the slice,
    the event that must complete before the ring writes there again."""

    def __init__(self, buffer: torch.Tensor, make_event: Callable[[], Any]) -> None:
        self.buf = buffer  # uint8, pinned (any uint8 tensor in the unit tests)
        self.make_event = make_event
        self.head = 0
        self.pending: collections.deque[tuple[int, int, Any]] = collections.deque()
        self.lock = threading.Lock()

    @property
    def capacity(self) -> int:
        return int(self.buf.numel())

    def stage(self, host: torch.Tensor) -> tuple[torch.Tensor, int, int] | None:
        """A slice holding a copy of ``host`` (contiguous, its shape and dtype) and the slice's
        byte range; None when ``host`` is larger than a quarter of the ring."""
        n = host.numel() * host.element_size()
        if n > self.capacity // 4:
            return None
        n = max(_ALIGN, -(-n // _ALIGN) * _ALIGN)
        with self.lock:
            if self.head + n > self.capacity:  # wrap: the tail from head on is skipped
                # this lap: slices of the last lap that lie there (and are the oldest) must be
                # done before the queue's order can stand for the address order again
                while self.pending and self.pending[0][0] >= self.head:
                    self.pending.popleft()[2].synchronize()
                self.head = 0
            lo, hi = self.head, self.head + n
            while len(self.pending) > 64 and self.pending[0][2].query():
                self.pending.popleft()  # finished long ago: keep the queue short
            # the oldest slices come next in address order: wait for those the new one covers
            while self.pending and self.pending[0][0] < hi and lo < self.pending[0][1]:
                self.pending.popleft()[2].synchronize()
            self.head = hi
        view = self.buf[lo:lo + host.numel() * host.element_size()]
        out = view.view(host.dtype).view(host.shape)
        out.copy_(host)
        return out, lo, hi

    def guard(self, lo: int, hi: int) -> None:
        """The copy reading bytes lo .. hi has been queued on the current stream."""
        ev = self.make_event()
        ev.record()
        with self.lock:
            self.pending.append((lo, hi, ev))


_rings: dict[torch.device, PinnedRing] = {}


def _ring(device: torch.device) -> PinnedRing:
    key = torch.device("cuda", device.index if device.index is not None
                       else torch.cuda.current_device())
    ring = _rings.get(key)
    if ring is None:
        buf = torch.empty(RING_BYTES, dtype=torch.uint8, pin_memory=True)
        ring = _rings.setdefault(key, PinnedRing(buf, torch.cuda.Event))
    return ring


def upload(host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``host`` on ``device`` without a host sync: (the device tensor, the pinned snapshot it was
    copied from when that is not a ring slice - during CUDA-graph capture, whose graph replays
    the copy, or a copy too large for the ring - else None). Keep the snapshot as long as the
    graph."""
    if device.type != "cuda":  # a copy on the CPU too: the device side is a snapshot there as
        return host.to(device, copy=True), None  # on a GPU, never the caller's own tensor
    dev = torch.empty(host.shape, dtype=host.dtype, device=device)
    if not torch.cuda.is_current_stream_capturing() and _copy_through_ring(dev, host):
        return dev, None
    pinned = host.pin_memory()
    dev.copy_(pinned, non_blocking=True)
    return dev, pinned


def _copy_through_ring(dst: torch.Tensor, host: torch.Tensor) -> bool:
    """``dst.copy_(host)`` asynchronously through a slice of ``dst``'s device ring; False (and
    nothing copied) when ``host`` is too large for the ring."""
    ring = _ring(dst.device)
    staged = ring.stage(host)
    if staged is None:
        return False
    view, lo, hi = staged
    dst.copy_(view, non_blocking=True)
    ring.guard(lo, hi)
    return True


def upload_once(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device`` without a host sync, for a copy no graph replays (raises during
    CUDA-graph capture)."""
    if device.type == "cuda":
        _refuse_capture("upload_once")
    return upload(host, device)[0]


def _refuse_capture(what: str) -> None:
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{what}: a host-to-device copy through a one-off pinned buffer "
                           "cannot be captured in a CUDA graph; do it before the capture")


def upload_into(dst: torch.Tensor, host: torch.Tensor) -> None:
    """``dst.copy_(host)`` for a device ``dst`` and a host ``host`` without a host sync; not
    during CUDA-graph capture (raises)."""
    if dst.device.type != "cuda":
        dst.copy_(host)
        return
    _refuse_capture("upload_into")
    if not _copy_through_ring(dst, host):
        dst.copy_(host.pin_memory(), non_blocking=True)
