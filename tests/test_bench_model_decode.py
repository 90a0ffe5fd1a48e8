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
            assert row[mode]["us_per_step"] > 0
        assert row["runner_stats"]["padded"] >= 3
    assert "runner / sum" in (out / "model_decode.md").read_text()


@pytest.mark.parametrize("argv,msg", [
    (["--steps", "0"], "--steps"),
    (["--dry-run", "--contexts", "5000"], "--contexts 5000: with --dry-run"),
    (["--models", "huge"], "model preset ['huge']"),
])
def test_bad_arguments_are_usage_errors(tmp_path, capsys, argv, msg):
    with pytest.raises(SystemExit) as e:
        main([*argv, "--out", str(tmp_path / "r")])
    assert e.value.code == 2 and msg in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
