"""The decode-step benchmark's speedups and table (CPU: synthetic rows; the timing needs a GPU)."""

from __future__ import annotations

from dsv4.bench.decode_step import STRATEGIES, add_speedups, markdown_table


def test_speedups_are_against_the_best_upstream_strategy_and_both_of_ours_are_listed():
    times = {"serial4": 30.0, "multistream": 20.0, "rocm_style": 25.0, "fused4_dsv4": 16.0,
             "cuda_plan": 10.0}
    rows = [{"model": "flash", "layer_type": "C4", "M": m, "strategy": s, "us": t * m}
            for m in (1, 4) for s, t in times.items()]
    add_speedups(rows)
    by = {(r["M"], r["strategy"]): r["speedup_vs_best_upstream"] for r in rows}
    assert by[(1, "fused4_dsv4")] == 20.0 / 16.0 and by[(4, "cuda_plan")] == 2.0
    assert by[(1, "multistream")] == 1.0
    lines = markdown_table(rows)
    assert len(lines) == 4 and all(s in lines[0] for s in STRATEGIES)
    assert lines[2].endswith("| 1.25x | 2.00x |")
