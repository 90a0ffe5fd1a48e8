"""``dsv4 bench model-decode``: the CPU dry run writes its rows (eager, planned and padded
runner steps of the tiny stack, checked against each other), and bad arguments are usage
errors before any work."""

from __future__ import annotations

import json

import pytest

from dsv4.bench.model_decode import main


def test_dry_run_writes_rows_for_every_mode(tmp_path):
    out = tmp_path / "r"
    assert main(["--dry-run", "--out", str(out), "--steps", "2", "--reps", "1", "--ms", "1,3",
                 "--contexts", "30"]) == 0
    data = json.loads((out / "model_decode.json").read_text())
    assert data["dry_run"] and len(data["rows"]) == 2
    for row in data["rows"]:
        assert row["runner_mode"] == "padded" and row["rel_err_runner_vs_eager"] < 1e-2
        for mode in ("eager_layers", "eager_plan", "runner"):
            assert row[mode]["us_per_step"] > 0 and len(row[mode]["reps_us_per_step"]) == 1
            longest = row[mode]["reps_longest_call_us"][0]
            host = row[mode]["reps_host_us_per_step"][0]
            assert 0 < longest <= 2 * host <= 2 * row[mode]["us_per_step"]  # 2 steps a timing
            assert len(row[mode]["gc"]["collections"]) == 3
        assert row["runner"]["reps_captures"] == [0]  # padded steps capture nothing
        assert row["runner_stats"]["padded"] >= 3
    assert "runner / sum" in (out / "model_decode.md").read_text()


@pytest.mark.parametrize("argv,msg", [
    (["--steps", "0"], "--steps"),
    (["--dry-run", "--contexts", "5000"], "--contexts 5000: with --dry-run"),
    (["--models", "huge"], "model preset ['huge']"),
    (["--dry-run", "--profile"], "--profile times kernels in CUDA graphs"),
])
def test_bad_arguments_are_usage_errors(tmp_path, capsys, argv, msg):
    with pytest.raises(SystemExit) as e:
        main([*argv, "--out", str(tmp_path / "r")])
    assert e.value.code == 2 and msg in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_the_table_splits_the_runner_step():
    """A GPU row's columns: the runner against its graph alone, the graph against the cold-L2
    sum, and the residual adds taken out of it."""
    from dsv4.bench.model_decode import markdown

    step = {"us_per_step": 880.0, "us_per_layer": 110.0, "tokens_per_s": 1136.0}
    row = {"model": "flash", "layers": 8, "context": 512, "M": 1, "runner": step,
           "sum_of_single_layer_graphs_cold_l2_us": 709.0,
           "runner_vs_sum_of_cold_l2_single_layers": 880 / 709,
           "runner_replay": {"us_per_step": 816.0, "us_per_layer": 102.0},
           "runner_vs_replay": 880 / 816, "replay_vs_sum_of_cold_l2_single_layers": 816 / 709,
           "residual_adds_us": 21.5,
           "replay_less_adds_vs_sum_of_cold_l2_single_layers": (816 - 21.5) / 709}
    head, _, line = markdown([row])
    assert head.endswith("| residual adds us | (replay - adds) / cold-L2 sum |")
    assert line.endswith("| 816 (102) | 1.08x | 1.15x | 21.5 | 1.12x |")
    # a dry-run row (no graphs): dashes there
    dry = {k: v for k, v in row.items() if "replay" not in k and "adds" not in k}
    assert markdown([dry])[2].endswith("| - | - | - | - | - |")


def test_gc_pauses_counts_collections_and_frozen_restores():
    """GcPauses sees a collection by generation; frozen() freezes what is alive and unfreezes
    after, also when the block raises - unless the process had frozen objects before (a GPU
    run of the suite did: 375 of them)."""
    import gc

    from dsv4.bench.gc_pauses import GcPauses, frozen

    with GcPauses() as pauses:
        gc.collect(1)
        gc.collect()
    s = pauses.summary()
    assert s["collections"][1] >= 1 and s["collections"][2] >= 1
    assert s["ms"] >= s["longest_ms"] >= 0
    assert pauses._callback not in gc.callbacks
    before = gc.get_freeze_count()  # > 0 where something in the process froze objects
    with pytest.raises(KeyError), frozen():
        assert gc.get_freeze_count() > before
        raise KeyError("inside")
    if before:  # the caller's frozen objects stay frozen (unfreeze cannot pick the block's)
        assert gc.get_freeze_count() >= before
    else:
        assert gc.get_freeze_count() == 0
