"""Host-to-device copies that never wait for the GPU.

A copy from ordinary (pageable) host memory to a CUDA tensor makes PyTorch synchronise the
stream: the host waits until every kernel queued before it has run, and the GPU then idles
while the host launches what follows. A prefill call queues milliseconds of GEMMs ahead of its
cache-table updates, so each such copy costs the GPU about that much idle time (session 23's
16K prefill profile: 9 stream synchronisations, 6.4 ms of a 45 ms Pro call). These helpers copy
through a fresh pinned buffer instead, asynchronously on the current stream: PyTorch's caching
host allocator keeps the buffer until the copy has run, and the host may change its own tensor
right after (the copy reads the snapshot).

Not for use during CUDA-graph capture (the graph would keep the address of a one-off buffer):
they raise there. Other devices get plain copies.
"""

from __future__ import annotations

import torch


def _pinned(host: torch.Tensor) -> torch.Tensor:
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("a host-to-device copy through a one-off pinned buffer cannot be "
                           "captured in a CUDA graph; do it before the capture")
    return host.pin_memory()


def upload(host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``host`` on ``device`` without a host sync: (the device tensor, the pinned snapshot it was
    copied from, or None off CUDA). Keep the snapshot where a later graph replays the copy."""
    if device.type != "cuda":
        return host.to(device), None
    pinned = _pinned(host)
    return pinned.to(device, non_blocking=True), pinned


def upload_into(dst: torch.Tensor, host: torch.Tensor) -> None:
    """``dst.copy_(host)`` for a device ``dst`` and a host ``host`` without a host sync."""
    if dst.device.type != "cuda":
        dst.copy_(host)
        return
    dst.copy_(_pinned(host), non_blocking=True)
