"""capture_graph pauses the garbage collector for exactly the capture (CPU: torch.cuda.graph
replaced by a recording stand-in)."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

from dsv4 import runner


@pytest.fixture
def recorded(monkeypatch):
    seen: list[tuple[str, object, bool]] = []

    @contextlib.contextmanager
    def fake_graph(graph, pool=None):
        seen.append(("enter", graph, gc.isenabled()))
        yield
        seen.append(("exit", graph, gc.isenabled()))

    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    return seen


def test_gc_is_paused_during_capture_and_restored(recorded):
    assert gc.isenabled()
    with runner.capture_graph("g"):  # type: ignore[arg-type]
        assert not gc.isenabled()
    assert gc.isenabled()
    assert recorded == [("enter", "g", False), ("exit", "g", False)]


def test_gc_restored_after_a_failed_capture_and_left_off_if_it_was(recorded):
    with pytest.raises(RuntimeError, match="boom"), runner.capture_graph("g"):  # type: ignore[arg-type]
        raise RuntimeError("boom")
    assert gc.isenabled()
    gc.disable()
    try:
        with runner.capture_graph("h"):  # type: ignore[arg-type]
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
