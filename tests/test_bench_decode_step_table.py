"""The decode-step benchmark's speedups and table (CPU: synthetic rows; the timing needs a GPU)."""

from __future__ import annotations

import pytest
import torch

from dsv4.bench.decode_step import (
    OURS,
    STRATEGIES,
    STRATEGY_SPECS,
    Strategy,
    add_speedups,
    main,
    markdown_table,
    step_bytes,
)
from dsv4.platforms import build_attention
from dsv4.platforms.registry import _needs_cuda


def test_speedups_are_against_the_best_upstream_strategy_and_every_strategy_is_listed():
    times = {"default": 4.0, "triton": 5.0, "no_step_kernels": 8.0, "upstream": 20.0,
             "rocm_style": 25.0}
    rows = [{"model": "flash", "layer_type": "C4", "M": m, "context": 512, "strategy": s,
             "us": t * m, "fraction": 0.5, "launches": 30}
            for m in (1, 4) for s, t in times.items()]
    rows += [{"model": "flash", "layer_type": "C4", "M": m, "context": 512,
              "strategy": "flashmla", "skipped": "not installed"} for m in (1, 4)]
    add_speedups(rows)
    by = {(r["M"], r["strategy"]): r.get("speedup_vs_best_upstream") for r in rows}
    assert by[(1, "default")] == 20.0 / 4.0 and by[(4, "no_step_kernels")] == 2.5
    assert by[(1, "upstream")] == 1.0 and by[(1, "rocm_style")] == 0.8
    assert by[(1, "flashmla")] is None
    lines = markdown_table(rows)
    assert len(lines) == 4 and all(s in lines[0] for s in STRATEGIES)
    # launch columns for our strategies, not for the upstream ones
    assert all(f"{s} launches" in lines[0] for s in OURS)
    assert not any(f"{s} launches" in lines[0] for s in ("upstream", "rocm_style"))
    assert lines[2].startswith("| flash | C4 | 512 | 1 | 4.0 (0.50) | 5.0 (0.50) | skipped |")
    assert lines[2].endswith("| 5.00x | 4.00x | 2.50x |")
    # verify steps (1 + k tokens per sequence) are their own cases
    verify = [{**r, "draft_tokens": 3} for r in rows if r["M"] == 4]
    lines = markdown_table(rows + verify)
    assert len(lines) == 5 and lines[4].startswith("| flash | C4 | 512 | 4 x (1 + 3) |")


def test_strategies_are_few_and_led_by_the_library_default():
    """At most six, built by keyword; the first is the platform's default path (every field
    at its default: what ``Strategy()`` is), and no two are the same."""
    assert 1 < len(STRATEGIES) <= 6 and STRATEGIES[0] == "default"
    assert STRATEGY_SPECS["default"] == Strategy()
    assert len(set(STRATEGY_SPECS.values())) == len(STRATEGY_SPECS)


def test_floor_counts_the_cache_format_bytes(tiny):
    from dsv4.testing.random_weights import random_layer_weights

    sizes = {}
    for fmt in ("bf16", "fp8_ds_mla"):
        c = tiny.replace(kv_cache_dtype=fmt)
        layer = build_attention(c, c.layer_of_ratio(4))
        layer.load_weights(random_layer_weights(c, layer.layer_id).items())
        sizes[fmt] = step_bytes(layer, 2, 1000)  # type: ignore[arg-type]
    keys = 2 * (tiny.sliding_window + tiny.index_topk)  # rows read by 2 sequences
    row_bf16, row_fp8 = tiny.head_dim * 2, (tiny.head_dim - 64) + 128 + 8
    assert sizes["bf16"] - sizes["fp8_ds_mla"] == keys * (row_bf16 - row_fp8)
    # at a context where the indexer would take every visible entry the step skips it: its
    # keys and its wq_b weight are not read
    idx_w = sum(p.numel() * p.element_size() for p in layer.indexer.wq_b.parameters())
    key_row = layer.new_cache_pool(1, 64).index_format.row_bytes()
    k = tiny.index_topk
    # 4k - 1 and 4k + 3: k and k + 1 entries visible (the same window and selected rows)
    grow = step_bytes(layer, 2, 4 * k + 3) - step_bytes(layer, 2, 4 * k - 1)  # type: ignore[arg-type]
    assert grow == idx_w + 2 * (k + 1) * key_row


def test_bad_strategy_and_layer_names_are_refused(tmp_path):
    if _needs_cuda(None) is None:
        pytest.skip("argument errors are checked before the GPU work only where it is absent")
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--strategies", "default,warp_speed"])
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--layers", "C8"])
    assert torch.cuda.is_available() is False


def test_launch_origins_names_the_operators_and_undoes_the_step(tiny):
    """The profile's third table (CPU here: the operators of one step by Python stack); the
    step's rows are rolled back."""
    from dsv4.bench.decode_step import launch_origins
    from dsv4.testing.random_weights import random_layer_weights

    layer = build_attention(tiny, tiny.layer_of_ratio(4))
    layer.load_weights(random_layer_weights(tiny, layer.layer_id).items())
    caches = layer.new_caches(2, 64)
    x = torch.randn(40, tiny.hidden_size).bfloat16()
    layer(x[:20], torch.arange(20), caches[0])
    layer(x[20:40], torch.arange(20), caches[1])
    text = launch_origins(layer, x[:2], torch.tensor([20, 20]), caches, "tiny C4")
    assert text.startswith("## tiny C4: where") and "aten::" in text
    assert [c.length for c in caches] == [20, 20]


def test_every_strategy_runs_the_serving_index_keys():
    """The decode-step rows and the model-decode stacks store the indexer keys as the serving
    configuration does (fp8: the store the page-copied scores read; the bench once ran bf16
    keys, where they never applied), in every strategy, so the selections agree."""
    from dsv4 import DSV4Config
    from dsv4.bench.model_decode import serving_config

    serving = serving_config(DSV4Config.preset("tiny"))
    assert serving.index_cache_dtype == "fp8"
    assert {s.index_cache_dtype for s in STRATEGY_SPECS.values()} == {serving.index_cache_dtype}
    assert STRATEGY_SPECS["default"].kv_cache_dtype == serving.kv_cache_dtype
