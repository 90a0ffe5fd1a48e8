"""FlashMLA backend: argument conversion on CPU; FlashMLA itself against the reference on a GPU
(skips unless ``flash_mla`` from the sgl-flash-mla wheel imports and the GPU is SM90)."""

from __future__ import annotations

import pytest
import torch
from test_sparse_mqa import build_case, rel

from dsv4.kernels.flashmla_backend import (
    _pad_idx,
    _paged_view,
    flashmla_prefill_workspace,
    flashmla_sparse_mqa,
    flashmla_supports,
)
from dsv4.kernels.sparse_mqa import gather_rows, sparse_mqa, sparse_mqa_reference


def test_supports_says_why_not():
    ok, why = flashmla_supports(64, 512, "fp8_ds_mla", "cpu")
    assert not ok and "CUDA" in why


def test_pad_idx_and_paged_view():
    idx = torch.arange(130, dtype=torch.int32).view(1, 130)
    p = _pad_idx(idx)
    assert p.shape == (1, 256) and torch.equal(p[:, :130], idx) and (p[:, 130:] == -1).all()
    wide = torch.arange(-1, 255).view(2, 128)  # int64 flat rows, a width FlashMLA takes as is
    p = _pad_idx(wide)
    assert p.dtype == torch.int32 and p.is_contiguous() and torch.equal(p, wide.int())
    p = _pad_idx(wide[:, :100])  # a strided slice: cast, then padded
    assert p.shape == (2, 128) and torch.equal(p[:, :100], wide[:, :100].int())
    assert (p[:, 100:] == -1).all() and p.dtype == torch.int32
    case = build_case(2, 4, 512, 4, 4, "fp8_ds_mla", B=64, n_rows=130)
    store = case[1]
    v = _paged_view(store)
    assert v.shape == (store.shape[0], 64, 1, 584) and v.dtype == torch.float8_e4m3fn
    assert v.stride() == (store.stride(0), 584, 584, 1) and v.data_ptr() == store.data_ptr()
    # the view's token t of block b starts at the row's data bytes: 576 data + 8 scale bytes
    # per token are not interleaved, FlashMLA's V4 reader uses the 576-byte data stride itself
    assert v.view(torch.uint8)[1, 0, 0, :576].tolist() == store[1, :576].tolist()


def test_prefill_workspace_rows_and_offset():
    case = build_case(2, 4, 512, 4, 4, "fp8_ds_mla", B=64, n_rows=70)
    kv, off = flashmla_prefill_workspace(case[1], case[3], "fp8_ds_mla", 64)
    assert off == case[1].shape[0] * 64 and kv.shape == (off + case[3].shape[0] * 64, 1, 512)
    r = torch.tensor([3, 65], dtype=torch.int32)
    assert torch.equal(kv[off + r.long(), 0].float(),
                       gather_rows(case[3], r, "fp8_ds_mla", 512, 64))


cuda = pytest.mark.cuda


@cuda
@pytest.mark.parametrize("fmt,mode", [("fp8_ds_mla", "decode"), ("fp8_ds_mla", "prefill"),
                                      ("bf16", "prefill")])
@pytest.mark.parametrize("H,K", [(64, 512), (128, 1024), (64, 0)])
@pytest.mark.parametrize("T", [1, 16, 64])
def test_flashmla_matches_reference(fmt, mode, H, K, T):
    ok, why = flashmla_supports(H, 512, fmt, "cuda" if torch.cuda.is_available() else "cpu")
    if not ok:
        pytest.skip(why)
    case = build_case(T, H, 512, 128, K, fmt, seed=T + H, B=64, n_rows=4096, device="cuda")
    o = flashmla_sparse_mqa(*case, mode=mode)
    assert o.shape == (T, H, 512) and o.dtype == torch.bfloat16
    ref = sparse_mqa_reference(*case)
    assert rel(o, ref) < 1e-2
    assert rel(o, sparse_mqa(*case)) < 1e-2  # ours agrees with FlashMLA


def test_a_scheduling_object_filled_inside_a_capture_is_not_kept(monkeypatch):
    """FlashMLA fills a decode shape's scheduling object on its first call; inside a CUDA-graph
    capture that call only records the filling kernel, so the object is the graph's alone and
    a later call of the same shape gets (and keeps) a fresh one; outside a capture it is kept -
    up to the decode runner's largest step; a longer step's (a prefill's) never is."""
    from dsv4.kernels import flashmla_backend as fb

    class FakeFlashMLA:
        made = 0

        def get_mla_metadata(self):
            FakeFlashMLA.made += 1
            return object(), None

    fm = FakeFlashMLA()
    monkeypatch.setattr(fb, "_SCHED", {})
    key = (torch.device("cuda", 0), 4, 64, 128, 10, 0, 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    in_capture = fb._sched_meta(fm, key)
    assert not fb._SCHED and fb._sched_meta(fm, key) is not in_capture
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    kept = fb._sched_meta(fm, key)
    assert len(fb._SCHED) == 1 and fb._SCHED.get(key) is kept and fb._sched_meta(fm, key) is kept
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert fb._sched_meta(fm, key) is kept  # filled eagerly: graphs read it as it is
    assert FakeFlashMLA.made == 3
    # prefill steps (more queries than any decode step; their lengths vary): nothing kept
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    most = fb.SCHED_CACHE_MAX_TOKENS
    for t in (most + 1, most + 2, 8192, 8192):
        fb._sched_meta(fm, (key[0], t, *key[2:]))
    assert len(fb._SCHED) == 1 and FakeFlashMLA.made == 7
    assert fb._sched_meta(fm, (key[0], most, *key[2:])) is fb._SCHED[(key[0], most, *key[2:])]
    assert most >= 128 * 8  # the decode runner's largest step keeps its object


@cuda
def test_a_decode_shape_first_seen_in_a_capture_runs_right_eagerly_and_replayed():
    """A decode shape whose first call is captured (no eager call before it): an eager call of
    that shape before any replay, and the replay, both equal the reference."""
    ok, why = flashmla_supports(64, 512, "fp8_ds_mla", "cuda" if torch.cuda.is_available()
                                else "cpu")
    if not ok:
        pytest.skip(why)
    warm = build_case(3, 64, 512, 128, 512, "fp8_ds_mla", seed=1, B=64, n_rows=4096,
                      device="cuda")
    flashmla_sparse_mqa(*warm, mode="decode")  # the library's kernels loaded, another shape
    case = build_case(5, 64, 512, 128, 512, "fp8_ds_mla", seed=2, B=64, n_rows=4096,
                      device="cuda")
    ref = sparse_mqa_reference(*case)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = flashmla_sparse_mqa(*case, mode="decode")
    eager = flashmla_sparse_mqa(*case, mode="decode")
    assert rel(eager, ref) < 1e-2
    graph.replay()
    torch.cuda.synchronize()
    assert rel(captured, ref) < 1e-2
