"""``dsv4 eval --cache-format``: the shipped model with the stored cache formats."""

from __future__ import annotations

import pytest

from dsv4.cli import main
from dsv4.tinylm.checkpoint import default_model_dir, load_tiny_lm
from dsv4.tinylm.evaluate import evaluate, format_table, parse_cache_format

MODEL = default_model_dir()


def test_parse_cache_format():
    assert parse_cache_format("fp8_ds_mla/fp4") == ("fp8_ds_mla", "fp4")
    assert parse_cache_format("auto/auto") == ("auto", "auto")
    for bad in ("fp8_ds_mla", "fp8/fp8", "bf16/fp16", "/"):
        with pytest.raises(ValueError, match="KV/INDEX"):
            parse_cache_format(bad)


def test_cli_rejects_a_bad_cache_format(capsys):
    assert main(["eval", "--problems", "1", "--cache-format", "fp8/fp4"]) == 2
    err = capsys.readouterr().err
    assert "fp8/fp4" in err and len(err.strip().splitlines()) == 1


def test_the_stored_formats_reach_the_caches():
    model = load_tiny_lm(MODEL, kv_cache_dtype="fp8_ds_mla", index_cache_dtype="fp4")
    c4 = next(b.attn for b in model.layers if b.attn.compress_ratio == 4)
    pool = c4.new_cache_pool(1, 64)
    assert pool.kv_format.name == "fp8_ds_mla" and pool.index_format.name == "fp4"


def test_eval_runs_each_format_against_exact_storage():
    runs = evaluate(MODEL, ["reference"], "cpu", n=12, fusions=(False,),
                    cache_formats=[("auto", "auto"), ("fp8_ds_mla", "fp8"), ("bf16", "fp4")])
    assert [r.cache for r in runs] == ["auto/auto", "fp8_ds_mla/fp8", "bf16/fp4"]
    assert all(not r.error for r in runs)
    base = runs[0]
    for r in runs[1:]:  # measured on all 400: every format answers like exact storage
        assert abs(r.correct - base.correct) <= 1 and r.token_agreement >= 0.95
    assert "fp8_ds_mla/fp8" in format_table(runs)
