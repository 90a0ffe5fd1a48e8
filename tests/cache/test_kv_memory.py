"""`dsv4 bench kv-memory`: held bytes from real pools, close to the formats' minimum, SWA-only
layers independent of the context."""

from __future__ import annotations

import json

import pytest

from dsv4.bench.kv_memory import measure
from dsv4.cli import main


def test_held_bytes_are_near_the_minimum_and_swa_is_flat():
    small, large = (measure("flash", "fp8_ds_mla", "fp8", n) for n in (4096, 65536))
    for r in (small, large):
        assert r["minimum_bytes"] <= r["held_bytes"] <= 1.02 * r["minimum_bytes"]
    swa = [r["per_layer_type"]["0"]["held_bytes_per_layer"] for r in (small, large)]
    assert swa[0] == swa[1]
    c4 = [r["per_layer_type"]["4"]["held_bytes_per_layer"] for r in (small, large)]
    assert c4[1] > 10 * c4[0]


def test_cli_writes_the_results(tmp_path):
    assert main(["bench", "kv-memory", "--out", str(tmp_path), "--contexts", "4096",
                 "--models", "flash"]) == 0
    rows = json.loads((tmp_path / "kv_memory.json").read_text())
    assert {(r["kv_format"], r["index_format"]) for r in rows} == {
        ("bf16", "bf16"), ("fp8_ds_mla", "fp8"), ("fp8_ds_mla", "fp4")}


@pytest.mark.parametrize("bad", [["--contexts", "4k"], ["--contexts", "0"], ["--models", "mega"]])
def test_bad_arguments_are_usage_errors(tmp_path, capsys, bad):
    with pytest.raises(SystemExit) as e:
        main(["bench", "kv-memory", "--out", str(tmp_path), *bad])
    assert e.value.code == 2
    assert bad[1] in capsys.readouterr().err
