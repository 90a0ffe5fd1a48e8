"""StepHandoffs (dsv4.platforms.handoff): a result made ahead by one override point is returned
to a later one only for the very input objects it was made from, at most once."""

from __future__ import annotations

import torch

from dsv4.platforms.handoff import StepHandoffs


def test_taken_once_for_the_same_objects_only():
    h = StepHandoffs()
    kv, pos = torch.zeros(3), torch.arange(3)
    h.put("kv_rows", (kv, pos), "rows")
    assert "kv_rows" in h
    assert h.take("kv_rows", (kv, pos)) == "rows"
    assert h.take("kv_rows", (kv, pos)) is None  # once
    h.put("kv_rows", (kv, pos), "rows")
    # equal values but another object: refused, and the entry is gone all the same
    assert h.take("kv_rows", (kv.clone(), pos)) is None
    assert "kv_rows" not in h
    h.put("kv_rows", (kv, pos), "rows")
    assert h.take("kv_rows", (kv,)) is None  # a shorter key is not the same inputs


def test_peek_keeps_and_clear_drops():
    h = StepHandoffs()
    qr = torch.ones(2)
    h.put("qr_fp8", (qr,), "q8")
    assert h.peek("qr_fp8", (qr,)) == "q8" and h.peek("qr_fp8", (qr,)) == "q8"
    assert h.peek("qr_fp8", (torch.ones(2),)) is None and "qr_fp8" in h
    h.put("idx_score", (), "score")
    assert h.peek("idx_score", ()) == "score"
    h.clear()
    assert "qr_fp8" not in h and h.take("idx_score", ()) is None
    h.put("a", (qr,), 1)
    h.put("a", (qr,), 2)  # replaced
    assert h.take("a", (qr,)) == 2


def test_own_override_points_step_aside_for_subclasses_and_instance_attributes(tiny,
                                                                              monkeypatch):
    """``CudaAttention._own``: the gate every shared launch checks - true only where neither a
    subclass nor an instance attribute redefines any of the named override points."""
    from dsv4.platforms.cuda import CudaAttention

    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: None)  # the CPU build has none
    layer = CudaAttention(tiny, tiny.layer_of_ratio(4), device="cpu", dtype=torch.bfloat16,
                          aux_streams=[])
    assert layer._own("_kv_rows", "_window_rows", "forward_mqa")
    layer._kv_rows = lambda kv, pos: kv  # a spy or a patch on the instance
    assert not layer._own("_kv_rows") and layer._own("_window_rows")
    del layer._kv_rows

    class OwnRows(CudaAttention):
        def _window_rows(self, step):
            return super()._window_rows(step)

    layer.__class__ = OwnRows
    assert not layer._own("_kv_rows", "_window_rows") and layer._own("_kv_rows")
