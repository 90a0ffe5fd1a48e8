"""Host-to-device copies without a stream synchronisation (dsv4.host_copy), and the layer's
calls free of syncs on a GPU (a pageable copy there lets the GPU idle behind the host)."""

from __future__ import annotations

import pytest
import torch

from dsv4 import process_weights_after_loading
from dsv4.host_copy import upload, upload_into, upload_once
from dsv4.testing.random_weights import random_layer_weights

from conftest import HAS_CUDA, random_x


def test_cpu_upload_is_a_plain_copy():
    host = torch.arange(6)
    dev, pinned = upload(host, torch.device("cpu"))
    assert torch.equal(dev, host) and pinned is None
    dst = torch.zeros(6, dtype=torch.int64)
    upload_into(dst, host)
    assert torch.equal(dst, host)


class _FakeEvent:
    """Records what the ring asks of an event; done when the test says so."""

    log: list[str] = []
    made = 0

    def __init__(self):
        self.done = False
        self.id = _FakeEvent.made  # events numbered in creation order
        _FakeEvent.made += 1
        _FakeEvent.log.append(f"new {self.id}")

    def record(self):
        pass

    def query(self):
        return self.done

    def synchronize(self):
        _FakeEvent.log.append(f"wait {self.id}")
        self.done = True


def test_pinned_ring_hands_out_fresh_slices_and_waits_only_on_reuse():
    from dsv4.host_copy import PinnedRing

    _FakeEvent.log, _FakeEvent.made = [], 0
    ring = PinnedRing(torch.zeros(4096, dtype=torch.uint8), _FakeEvent)
    host = torch.arange(100, dtype=torch.int32)  # 400 bytes -> 512-byte slices
    views = []
    for i in range(8):  # fills the 4096 bytes exactly: no wait
        view, lo, hi = ring.stage(host + i)
        assert (lo, hi) == (512 * i, 512 * i + 512) and view.dtype == torch.int32
        ring.guard(lo, hi)
        views.append(view)
    host.zero_()  # the slices are snapshots
    assert all(torch.equal(v, torch.arange(100, dtype=torch.int32) + i)
               for i, v in enumerate(views))
    assert not any(e.startswith("wait") for e in _FakeEvent.log)
    # the ninth wraps to byte 0: it waits for the first copy only, then overwrites its slice
    view, lo, hi = ring.stage(torch.full((200,), 7, dtype=torch.int32))  # 800 -> 1024 bytes
    assert (lo, hi) == (0, 1024) and _FakeEvent.log[-2:] == ["wait 0", "wait 1"]
    assert torch.equal(views[0], torch.full((100,), 7, dtype=torch.int32))
    assert torch.equal(views[2], torch.arange(100, dtype=torch.int32) + 2)  # untouched
    ring.guard(lo, hi)
    # larger than a quarter of the ring: not staged (the caller takes a fresh buffer)
    assert ring.stage(torch.zeros(1025, dtype=torch.uint8)) is None


def test_pinned_ring_waits_for_the_tail_a_lap_skipped():
    """A lap that wraps early skips the ring's tail; a slice of the lap before that lies there
    is the oldest in the queue and must not hide the next lap's slices behind it."""
    from dsv4.host_copy import PinnedRing

    _FakeEvent.log, _FakeEvent.made = [], 0
    ring = PinnedRing(torch.zeros(8192, dtype=torch.uint8), _FakeEvent)

    def put(nbytes):
        view, lo, hi = ring.stage(torch.zeros(nbytes, dtype=torch.uint8))
        ring.guard(lo, hi)
        return lo, hi

    # lap 1: events 0..4, the last at [7680, 8192)
    assert [put(n) for n in (2048, 2048, 2048, 1536, 512)][-1] == (7680, 8192)
    # lap 2: four 1792-byte slices (events 5..8), then the next would pass the end: it wraps
    # before reaching event 4's slice
    assert [put(1792) for _ in range(4)][-1] == (5376, 7168)
    del _FakeEvent.log[:]
    assert put(1792) == (0, 1792)  # lap 3: waits for event 4 (the tail), then event 5
    assert [e for e in _FakeEvent.log if e.startswith("wait")] == ["wait 4", "wait 5"]


class _OnCuda:
    device = torch.device("cuda")


def test_one_off_uploads_refuse_capture(monkeypatch):
    """upload_once / upload_into keep no snapshot: under capture they raise before copying."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="upload_into: .*CUDA graph"):
        upload_into(_OnCuda(), torch.arange(4))  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="upload_once: .*CUDA graph"):
        upload_once(torch.arange(4), torch.device("cuda"))


cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@cuda_only
@pytest.mark.cuda
def test_upload_reads_a_snapshot_the_host_may_change_at_once():
    dev = torch.device("cuda")
    big = torch.randn(4096, 4096, device=dev)
    for _ in range(8):  # queue work so that the copy runs well after the host moves on
        big = big @ big / 64
    host = torch.arange(1000)
    out, _ = upload(host, dev)
    dst = torch.zeros(1000, dtype=torch.int64, device=dev)
    upload_into(dst, host)
    host.zero_()
    assert torch.equal(out.cpu(), torch.arange(1000))
    assert torch.equal(dst.cpu(), torch.arange(1000))


@cuda_only
@pytest.mark.cuda
def test_ring_wraps_behind_a_busy_gpu():
    """40 MiB through the 16 MiB ring while the GPU is still busy: the ring comes round to
    slices whose copies have not run and must wait for them; every copy arrives intact."""
    dev = torch.device("cuda")
    big = torch.randn(4096, 4096, device=dev)
    for _ in range(8):
        big = big @ big / 64
    host = torch.empty(1 << 18, dtype=torch.int32)  # 1 MiB
    outs = []
    for i in range(40):
        host.fill_(i)
        outs.append(upload(host, dev)[0])
    assert all(bool((o == i).all()) for i, o in enumerate(outs))


@cuda_only
@pytest.mark.cuda
@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_prefill_and_decode_calls_do_not_synchronise(tiny, ratio):
    """With CPU positions, a prefill (which grows every store's block table) and decode steps
    queue their work without waiting for the GPU: torch's sync debug mode turns any stream
    synchronisation (a pageable copy, a read-back) into an error."""
    from dsv4.platforms.cuda import CudaAttention

    lid = tiny.layer_of_ratio(ratio)
    layer = CudaAttention(tiny, lid, device="cuda", dtype=torch.bfloat16)
    layer.load_weights(random_layer_weights(tiny, lid, seed=1).items())
    process_weights_after_loading(layer)
    x = random_x(300, tiny.hidden_size).to("cuda", torch.bfloat16)
    warm = layer.new_cache(300)  # compiles and graph captures happen here, not below
    layer(x[:200], torch.arange(200), warm)
    for i in range(200, 204):
        layer(x[i:i + 1], torch.tensor([i]), warm)
    cache = layer.new_cache(300)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer(x[:200], torch.arange(200), cache)
        for i in range(200, 204):
            layer(x[i:i + 1], torch.tensor([i]), cache)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
