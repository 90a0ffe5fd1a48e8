"""transformers-decode's bookkeeping without transformers: which phase ran out of memory, how a
cell is recorded and shown, the memory cap in the table's header."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from dsv4.bench.transformers_decode import (
    PhaseOutOfMemory,
    measured,
    time_decode,
    to_markdown,
)


class _Model:
    """Stands in for a causal LM: logits of zeros, running out of device memory at call
    number ``fail_at`` (0-based)."""

    def __init__(self, fail_at: int) -> None:
        self.config = SimpleNamespace(vocab_size=11)
        self.calls = 0
        self.fail_at = fail_at

    def __call__(self, input_ids: torch.Tensor, **_: Any) -> Any:
        self.calls += 1
        if self.calls - 1 == self.fail_at:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return SimpleNamespace(logits=torch.zeros(input_ids.shape[0], input_ids.shape[1], 11))


@pytest.mark.parametrize(("fail_at", "phase"), [(0, "prefill"), (1, "prefill"),
                                                (2, "decode"), (4, "decode")])
def test_the_phase_that_ran_out_of_memory(fail_at: int, phase: str) -> None:
    """A context of 8 in chunks of 4: calls 0-1 prefill, then decode steps."""
    model = _Model(fail_at)
    with pytest.raises(PhaseOutOfMemory) as e:
        time_decode(model, 2, 8, steps=3, warmup=1, cache=None, chunk=4, device="cpu", seed=0)
    assert e.value.phase == phase
    assert measured(lambda: time_decode(_Model(fail_at), 2, 8, 3, 1, None, 4, "cpu", 0),
                    "cpu") == (None, None, phase)


def test_a_cell_that_fits_is_timed() -> None:
    t, peak, phase = measured(lambda: time_decode(_Model(-1), 2, 8, 3, 1, None, 4, "cpu", 0),
                              "cpu")
    assert t is not None and t > 0 and peak is None and phase is None


def test_the_table_names_the_phase_and_the_cap() -> None:
    row = {"batch": 16, "context": 65536, "transformers_tok_s": None, "dsv4_tok_s": 900.0,
           "transformers_ms_step": None, "dsv4_ms_step": 17.8, "speedup": None,
           "transformers_peak_gib": 19.9, "dsv4_peak_gib": 6.1, "transformers_oom": True,
           "dsv4_oom": False, "transformers_oom_phase": "prefill", "dsv4_oom_phase": None}
    result = {"platform": "cuda", "model": "flash-cut-4-layers", "layer_types": ["sliding"],
              "routed_experts": 8, "dtype": "bf16", "device": "H100", "steps": 32, "warmup": 4,
              "check": {"agree": 8, "steps": 8}, "rows": [row], "memory_limit_gib": 20.0}
    md = to_markdown(result)
    assert "device memory capped at 20 GiB (`--memory-limit-gib`)." in md
    assert ("| 16 | 65536 | out of memory (prefill) | 900.0 | out of memory (prefill) | 17.80 "
            "| - | 19.90 | 6.10 |") in md
    assert "capped" not in to_markdown({**result, "memory_limit_gib": None})


@pytest.mark.parametrize(("device", "index"), [("cuda", 3), ("cuda:1", 1)])
def test_the_memory_cap_names_a_device_index(monkeypatch: pytest.MonkeyPatch, device: str,
                                             index: int) -> None:
    """``--memory-limit-gib`` on ``--device cuda`` (no index) caps the current device: PyTorch's
    cap refuses a device without an index (a GPU run once ended there)."""
    from dsv4.bench import transformers_decode as td

    calls = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: type("P", (), {"total_memory": 80 << 30})())
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda f, d: calls.append((f, d)))
    td.cap_device_memory(device, 20)
    assert calls == [(0.25, torch.device("cuda", index))]
