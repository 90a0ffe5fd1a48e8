"""Host-to-device copies that never wait for the GPU.

A copy from ordinary (pageable) host memory to a CUDA tensor makes PyTorch synchronise the
stream: the host waits until every kernel queued before it has run, and the GPU then idles
while the host launches what follows. A prefill call queues milliseconds of GEMMs ahead of its
cache-table updates, so each such copy costs the GPU about that much idle time (session 23's
16K prefill profile: 9 stream synchronisations, 6.4 ms of a 45 ms Pro call). These helpers copy
through a fresh pinned buffer instead, asynchronously on the current stream: PyTorch's caching
host allocator keeps the buffer until the copy has run, and the host may change its own tensor
right after (the copy reads the snapshot).

Under CUDA-graph capture :func:`upload` is captured like any copy: the graph keeps the pinned
snapshot's address, so a caller that replays it keeps the snapshot (``upload`` returns it; a
step's metadata does so). :func:`upload_once` and :func:`upload_into` keep no snapshot and
refuse capture, loudly. Other devices get plain copies.
"""

from __future__ import annotations

import torch


def upload(host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``host`` on ``device`` without a host sync: (the device tensor, the pinned snapshot it was
    copied from, or None off CUDA). Keep the snapshot where a graph replays the copy."""
    if device.type != "cuda":
        return host.to(device), None
    pinned = host.pin_memory()
    return pinned.to(device, non_blocking=True), pinned


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
    dst.copy_(host.pin_memory(), non_blocking=True)
