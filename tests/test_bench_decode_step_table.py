"""The decode-step benchmark's speedups and table (CPU: synthetic rows; the timing needs a GPU)."""

from __future__ import annotations

import pytest
import torch

from dsv4.bench.decode_step import (
    NEW_PATH,
    PDL,
    STRATEGIES,
    add_speedups,
    main,
    markdown_table,
    step_bytes,
)
from dsv4.platforms.registry import _needs_cuda


def test_speedups_are_against_the_best_upstream_strategy_and_every_strategy_is_listed():
    times = {"serial4": 30.0, "multistream": 20.0, "rocm_style": 25.0, "fused4_dsv4": 16.0,
             "cuda_plan": 10.0, "ours_unfused": 8.0, "ours_triton": 5.0, "ours_triton_fp8": 4.0,
             "ours_act8": 2.5}
    rows = [{"model": "flash", "layer_type": "C4", "M": m, "context": 512, "strategy": s,
             "us": t * m, "fraction": 0.5, "launches": 30}
            for m in (1, 4) for s, t in times.items()]
    rows += [{"model": "flash", "layer_type": "C4", "M": m, "context": 512,
              "strategy": s, "skipped": "not installed"}
             for m in (1, 4) for s in ("ours_flashmla", "ours_flashmla_act8")]
    add_speedups(rows)
    by = {(r["M"], r["strategy"]): r.get("speedup_vs_best_upstream") for r in rows}
    assert by[(1, "fused4_dsv4")] == 20.0 / 16.0 and by[(4, "cuda_plan")] == 2.0
    assert by[(1, "multistream")] == 1.0 and by[(1, "ours_triton_fp8")] == 5.0
    assert by[(1, "ours_flashmla")] is None
    lines = markdown_table(rows)
    assert len(lines) == 4 and all(s in lines[0] for s in STRATEGIES)
    # launch columns for the new-path strategies that ran; the opt-in PDL ones did not
    assert all(f"{s} launches" in lines[0] for s in NEW_PATH if s in STRATEGIES)
    assert not any(f"{s} launches" in lines[0] for s in PDL)
    assert lines[2].startswith("| flash | C4 | 512 | 1 | 30.0 (0.50) |")
    assert ("| 4.0 (0.50) | skipped | 2.5 (0.50) | skipped | 30 | 30 | 30 | skipped | 30 | "
            "skipped |") in lines[2]
    assert lines[2].endswith("| 1.25x | 2.00x | 2.50x | 4.00x | 5.00x | 8.00x |")


def test_floor_counts_the_cache_format_bytes(tiny):
    from dsv4 import DeepseekV4Attention
    from dsv4.random_weights import random_layer_weights

    sizes = {}
    for fmt in ("bf16", "fp8_ds_mla"):
        c = tiny.replace(kv_cache_dtype=fmt)
        layer = DeepseekV4Attention.build(c, c.layer_of_ratio(4))
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
        main(["--out", str(tmp_path), "--strategies", "serial4,warp_speed"])
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--layers", "C8"])
    assert torch.cuda.is_available() is False


def test_launch_origins_names_the_operators_and_undoes_the_step(tiny):
    """The profile's third table (CPU here: the operators of one step by Python stack); the
    step's rows are rolled back."""
    from dsv4 import DeepseekV4Attention
    from dsv4.bench.decode_step import launch_origins
    from dsv4.random_weights import random_layer_weights

    layer = DeepseekV4Attention.build(tiny, tiny.layer_of_ratio(4))
    layer.load_weights(random_layer_weights(tiny, layer.layer_id).items())
    caches = layer.new_caches(2, 64)
    x = torch.randn(40, tiny.hidden_size).bfloat16()
    layer(x[:20], torch.arange(20), caches[0])
    layer(x[20:40], torch.arange(20), caches[1])
    text = launch_origins(layer, x[:2], torch.tensor([20, 20]), caches, 20, "tiny C4")
    assert text.startswith("## tiny C4: where") and "aten::" in text
    assert [c.length for c in caches] == [20, 20]
