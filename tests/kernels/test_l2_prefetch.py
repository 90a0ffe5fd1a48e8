"""The L2 prefetch launch (dsv4.kernels.l2_prefetch): bad arguments refused with the culprit
named, nothing issued where the inline PTX cannot run, and on a GPU every mode runs, asks for
the bytes the budget allows and changes no data (whether it speeds anything up is a benchmark
question: benchmarks/l2_probe.py, the decode-step bench's ``..._l2_pdl`` rows)."""

from __future__ import annotations

import pytest
import torch

from dsv4.kernels.l2_prefetch import (
    DEFAULT_CHUNK,
    LINE,
    MAX_REGIONS,
    MODES,
    prefetch_to_l2,
    prefetch_usable,
)

from conftest import needs_gpu


@pytest.mark.parametrize("kwargs,match", [
    (dict(mode="nearest"), "mode='nearest'"),
    (dict(chunk=100), "chunk=100"),
    (dict(chunk=0), "chunk=0"),
    (dict(max_bytes=-1), "max_bytes=-1"),
])
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        prefetch_to_l2([torch.zeros(64)], **kwargs)


def test_bad_regions_are_refused():
    with pytest.raises(ValueError, match="no regions"):
        prefetch_to_l2([])
    with pytest.raises(ValueError, match=f"at most {MAX_REGIONS}"):
        prefetch_to_l2([torch.zeros(64)] * (MAX_REGIONS + 1))
    with pytest.raises(ValueError, match=r"region 1 \(\(8, 8\)\) is not contiguous"):
        prefetch_to_l2([torch.zeros(64), torch.zeros(8, 16)[:, :8]])


def test_nothing_is_issued_off_the_gpu():
    t = torch.zeros(1 << 16)
    assert not prefetch_usable(t.device)
    assert prefetch_to_l2([t]) == 0


@needs_gpu
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_runs_and_changes_no_data(mode):
    if not prefetch_usable(torch.device("cuda")):
        pytest.skip("the prefetch needs sm_90")
    size = LINE if mode == "lines" else DEFAULT_CHUNK
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randint(0, 255, (3 * DEFAULT_CHUNK + 48,), dtype=torch.uint8, device="cuda",
                      generator=g)
    b = torch.randn(DEFAULT_CHUNK, device="cuda", generator=g)  # 4 chunks of floats
    a0, b0 = a.clone(), b.clone()
    whole = (a.nbytes // size + b.nbytes // size) * size
    assert prefetch_to_l2([a, b], mode=mode) == whole  # a's tail under one chunk left out
    assert prefetch_to_l2([a, b], a.nbytes + size + 5, mode=mode) == (a.nbytes // size + 1) * size
    assert prefetch_to_l2([a, b], size - 1, mode=mode) == 0
    assert prefetch_to_l2([b, a], 2 * size, mode=mode, programs=1) == 2 * size
    c = a.float().sum() + b.sum()  # a kernel after the launches reads the same data
    torch.cuda.synchronize()
    assert torch.equal(a, a0) and torch.equal(b, b0)
    assert c.item() == (a0.float().sum() + b0.sum()).item()


@needs_gpu
def test_the_prefetch_is_graph_capturable():
    if not prefetch_usable(torch.device("cuda")):
        pytest.skip("the prefetch needs sm_90")
    w = torch.randn(1 << 20, device="cuda")
    prefetch_to_l2([w])  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        prefetch_to_l2([w])
        y = w * 2
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, w * 2)
