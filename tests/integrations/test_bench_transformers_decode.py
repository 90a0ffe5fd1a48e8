"""The transformers-decode benchmark end to end on the CPU with a tiny model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from dsv4.cli import main  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Any:
    """Tiny matrices: one intra-op thread is ~20x faster than two on a busy 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_transformers_decode_bench_runs_on_the_cpu(tmp_path: Path) -> None:
    rc = main(["bench", "transformers-decode", "--out", str(tmp_path), "--tiny", "--device",
               "cpu", "--platform", "reference", "--dtype", "float32", "--batches", "1,2",
               "--contexts", "20,40", "--steps", "2", "--warmup", "1", "--check-steps", "4",
               "--check-prompt", "30"])
    assert rc == 0
    result = json.loads((tmp_path / "transformers_decode.json").read_text())
    assert result["check"]["agree"] == 4
    assert [(r["batch"], r["context"]) for r in result["rows"]] == [(1, 20), (1, 40), (2, 20),
                                                                    (2, 40)]
    assert all(r["dsv4_tok_s"] > 0 and r["transformers_tok_s"] > 0 for r in result["rows"])
    md = (tmp_path / "transformers_decode.md").read_text()
    assert "| 2 | 40 |" in md


def test_a_check_prompt_longer_than_the_contexts_is_cut_to_fit(tmp_path: Path) -> None:
    """The default check prompt (300 tokens) with 20-token contexts: the prompt is cut so that
    it and the checked tokens fit the caches (it once overflowed dsv4's, after transformers'
    cells had run)."""
    rc = main(["bench", "transformers-decode", "--out", str(tmp_path), "--tiny", "--device",
               "cpu", "--platform", "reference", "--dtype", "float32", "--batches", "1",
               "--contexts", "20", "--steps", "2", "--warmup", "1", "--check-steps", "4"])
    assert rc == 0
    result = json.loads((tmp_path / "transformers_decode.json").read_text())
    assert result["check"]["agree"] == 4
