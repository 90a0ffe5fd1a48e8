"""The pooled-decode benchmark runs on the CPU and writes its results (a smoke test: timings are
reported, never asserted)."""

from __future__ import annotations

import json

from dsv4.cli import main


def test_pooled_decode_bench_writes_json_and_markdown(tmp_path):
    assert main(["bench", "pooled-decode", "--out", str(tmp_path), "--ms", "3", "--context",
                 "40", "--steps", "5", "--reps", "1"]) == 0
    rows = json.loads((tmp_path / "pooled_decode.json").read_text())["rows"]
    assert sorted(r["ratio"] for r in rows) == [0, 4, 128]
    assert all(r["rel_err"] < 1e-2 and r["pooled_ms"] > 0 for r in rows)
    assert "| ratio | M |" in (tmp_path / "pooled_decode.md").read_text()
