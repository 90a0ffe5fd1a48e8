"""Host-to-device copies without a stream synchronisation (dsv4.host_copy), and the layer's
calls free of syncs on a GPU (a pageable copy there lets the GPU idle behind the host)."""

from __future__ import annotations

import pytest
import torch

from dsv4 import process_weights_after_loading
from dsv4.host_copy import upload, upload_into, upload_once
from dsv4.random_weights import random_layer_weights

from conftest import HAS_CUDA, random_x


def test_cpu_upload_is_a_plain_copy():
    host = torch.arange(6)
    dev, pinned = upload(host, torch.device("cpu"))
    assert torch.equal(dev, host) and pinned is None
    dst = torch.zeros(6, dtype=torch.int64)
    upload_into(dst, host)
    assert torch.equal(dst, host)


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
