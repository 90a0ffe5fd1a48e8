"""The prefill benchmark's pure parts on CPU: FLOP count, index sets, tables, arguments (timing
needs a GPU)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from dsv4.bench.prefill import (
    attention_flops,
    layer_flops,
    main,
    markdown,
    parse_args,
    predicted_case_s,
    prefill_indices,
)
from dsv4.config import DSV4Config
from dsv4.platforms import build_attention


def _brute_force_flops(cfg: DSV4Config, ratio: int, tokens: int, context: int) -> float:
    """The same count, one query at a time (independent of layer_flops' vectorised sums)."""
    h, d, heads = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads
    per_token = 2 * (h * (cfg.q_lora_rank + d) + cfg.q_lora_rank * heads * d
                     + heads * d * cfg.o_lora_rank + cfg.o_groups * cfg.o_lora_rank * h)
    if ratio == 4:
        per_token += 2 * h * 2 * 2 * d  # compressor, coff 2
        di, hi = cfg.index_head_dim, cfg.index_n_heads
        per_token += 2 * (cfg.q_lora_rank * hi * di + h * hi + h * 4 * di)
    elif ratio == 128:
        per_token += 2 * h * 2 * d
    total = 0.0
    for p in range(context, context + tokens):
        rows = min(p + 1, cfg.sliding_window)
        if ratio == 4:
            visible = (p + 1) // 4
            total += visible * 2 * cfg.index_n_heads * (cfg.index_head_dim + 1)
            rows += min(visible, cfg.index_topk)
        elif ratio == 128:
            rows += (p + 1) // 128
        total += per_token + 4 * heads * d * rows
    return total


@pytest.mark.parametrize("ratio", (0, 4, 128))
@pytest.mark.parametrize("tokens,context", [(1, 0), (300, 0), (77, 1000), (2500, 0)])
def test_layer_flops_match_a_per_query_count(ratio, tokens, context):
    cfg = DSV4Config.preset("flash")
    fl = layer_flops(cfg, ratio, tokens, context)
    assert fl["total"] == pytest.approx(_brute_force_flops(cfg, ratio, tokens, context),
                                        rel=1e-12)
    assert fl["total"] == pytest.approx(fl["gemm"] + fl["indexer"] + fl["attention"])
    assert (fl["indexer"] > 0) == (ratio == 4 and tokens + context >= 4)


def test_flash_c4_flops_by_hand():
    """One query at position 4095 of a Flash C4 layer: its attention covers 128 window rows +
    512 of 1024 visible entries; its indexer scores the 1024 entries with 64 heads x 128."""
    cfg = DSV4Config.preset("flash")
    fl = layer_flops(cfg, 4, 1, 4095)
    assert fl["attention"] == 4 * 64 * 512 * (128 + 512)
    assert fl["indexer"] == 1024 * 2 * 64 * 129
    # wq_a|wkv 4096x1536, wq_b 1024x32768, wo_a 8 x (4096 -> 1024), wo_b 8192x4096,
    # compressor 4096x2048, indexer wq_b 1024x8192, weights_proj 4096x64, idx compressor 4096x512
    macs = (4096 * 1536 + 1024 * 32768 + 8 * 4096 * 1024 + 8192 * 4096 + 4096 * 2048
            + 1024 * 8192 + 4096 * 64 + 4096 * 512)
    assert fl["gemm"] == 2 * macs
    assert attention_flops(64, 16384, 640) == 4 * 64 * 512 * 16384 * 640


def test_prefill_indices_are_visible_distinct_and_padded():
    gen = torch.Generator().manual_seed(0)
    win, cmp = prefill_indices(40, 16, 8, 48, "cpu", gen)
    assert win.dtype == cmp.dtype == torch.int32 and win.shape == (40, 8)
    pos = torch.arange(8, 48)
    assert torch.equal(win[:, -1].long(), pos) and (win[0] == torch.arange(1, 9)).all()
    for i, p in enumerate(pos.tolist()):
        visible = (p + 1) // 4
        got = cmp[i][cmp[i] >= 0].tolist()
        assert len(got) == min(16, visible) == len(set(got)) and all(j < visible for j in got)
    win, _ = prefill_indices(4, 2, 8, 4, "cpu", gen)  # positions 0..3: window before 0 is -1
    assert win[0].tolist() == [-1] * 7 + [0]


def test_every_model_has_a_layer_of_each_type():
    from dsv4.bench.prefill import LAYER_RATIO

    for model in ("flash", "pro"):
        cfg = DSV4Config.preset(model)
        for ratio in LAYER_RATIO.values():
            assert cfg.compress_ratio(cfg.layer_of_ratio(ratio)) == ratio
    assert DSV4Config.preset("pro").layer_of_ratio(0) == 61  # the MTP layer


def test_case_prediction_skips_only_after_a_measured_row():
    assert predicted_case_s(None, 1 << 17, 3) == 0.0
    assert predicted_case_s((4096, 0.1), 16384, 3) == pytest.approx(0.1 * 4 * 1.5 * 4)


def _res():
    fl = {"gemm": 1.0, "indexer": 0.0, "attention": 1.0, "total": 2e12}
    rows = [{"model": "flash", "layer_type": "C4", "backend": "torch", "mode": "single",
             "tokens": 4096, "context": 0, "ms": 100.0, "tokens_per_s": 40960.0,
             "tflops": 20.0, "fraction_of_floor": 0.025, "peak_extra_bytes": 3 << 29,
             "flops": fl},
            {"model": "flash", "layer_type": "C4", "backend": "torch", "mode": "single",
             "tokens": 131072, "context": 0, "skipped": "predicted 99 s > 60"},
            {"model": "pro", "layer_type": "SWA", "backend": "auto",
             "error": "wrong: rel err 1"}]
    att = [{"heads": 64, "queries": 4096, "rows_each": 640, "impl": "dsv4", "ms": 1.5,
            "tflops": 400.0},
           {"heads": 64, "queries": 4096, "rows_each": 640, "impl": "flashmla", "ms": 1.0,
            "tflops": 600.0},
           {"heads": 64, "queries": 4096, "rows_each": 640, "impl": "dsv4_h64_n16_s3",
            "ms": 1.25, "tflops": 480.0},
           {"heads": 64, "queries": 4096, "rows_each": 640, "impl": "dsv4_h32_n64_s2",
            "ms": 2.0, "tflops": 300.0},
           {"heads": 128, "queries": 4096, "rows_each": 640, "impl": "flashmla",
            "skipped": "not installed"}]
    return {"gpu": "fake", "torch": "x", "matmul_flops": 8e14, "layer_rows": rows,
            "attention_rows": att}


def test_markdown_on_fake_rows():
    text = "\n".join(markdown(_res()))
    assert "rate (torch.mm 8192^3, this run): 800 TFLOP/s" in text
    assert "| flash | C4 | torch | single | 0 | 4096 | 100.0 | 41 K | 20.0 | 0.025 | 1.50 |" \
        in text
    assert "| flash | C4 | torch | single | 0 | 131072 | predicted 99 s > 60 |" in text
    assert "| 64 | 4096 | 640 | 1.50 | 1.00 | 1.50x | 400 | 600 | h64_n16_s3 1.25 |" in text
    assert "| 128 | 4096 | 640 | - | skip | - | - | - | - |" in text
    assert "## Errors" in text and "wrong: rel err 1" in text


def test_report_only_from_json(tmp_path):
    (tmp_path / "prefill.json").write_text(json.dumps(_res()))
    assert main(["--out", str(tmp_path), "--report-only"]) == 0
    assert "## Sparse prefill attention" in (tmp_path / "prefill.md").read_text()


def test_arguments_parse_and_bad_ones_name_the_culprit(capsys):
    a = parse_args(["--out", "x", "--models", "pro", "--layers", "C4,SWA", "--tokens", "4096",
                    "--attention-backend", "torch,flashmla,auto", "--chunk", "0"])
    assert a.models == ["pro"] and a.layers == ["C4", "SWA"] and a.tokens == [4096]
    assert a.attention_backend == ["torch", "flashmla", "auto"] and a.chunk == 0
    d = parse_args(["--out", "x"])
    assert d.tokens == [4096, 16384, 65536, 131072] and d.attention_backend == ["torch"]
    assert (d.chunk, d.context, d.caches) == (8192, 65536, ["bf16"])
    for bad, culprit in ((["--layers", "C8"], "C8"), (["--attention-backend", "cudnn"], "cudnn"),
                         (["--tokens", "4k"], "4k"), (["--tokens", "0"], "0"),
                         (["--models", "ultra"], "ultra"), (["--reps", "0"], "--reps"),
                         (["--caches", "int8"], "int8")):
        with pytest.raises(SystemExit):
            parse_args(["--out", "x", *bad])
        assert culprit in capsys.readouterr().err


def test_cli_knows_the_suite():
    from dsv4.cli import BENCH_SUITES, CPU_SUITES, build_parser

    args, extra = build_parser().parse_known_args(["bench", "prefill", "--out", "x"])
    assert args.suite == "prefill" and extra == ["--out", "x"]
    assert BENCH_SUITES["prefill"] == "dsv4.bench.prefill" and "prefill" not in CPU_SUITES
    assert isinstance(parse_args, type(main)) and argparse  # the suite's main is importable


def _fake_time_calls(fn, reps, dev, before=None):
    """time_calls without CUDA: runs the calls (resets included) and reports 2 ms a call,
    1 KiB, 1.5 ms of host time."""
    for _ in range(reps + 1):
        if before is not None:
            before()
        fn()
    return 2.0, 1024, [2.0] * reps, [1.5] * reps


def test_layer_and_attention_rows_run_on_cpu_with_a_fake_timer(monkeypatch):
    """The row builders end to end on the tiny preset (reference layer, CPU): every backend's
    output is checked, single and chunked calls run repeatedly on a fresh / forked cache."""
    from dsv4.bench import prefill

    built = []

    def build(cfg, layer_id, weights, dev, step_kernels=True):
        layer = build_attention(cfg, layer_id, dtype=torch.bfloat16)
        layer.load_weights(weights.items())
        built.append(step_kernels)
        return layer

    monkeypatch.setattr(prefill, "time_calls", _fake_time_calls)
    monkeypatch.setattr(prefill, "build_layer", build)
    monkeypatch.setattr(prefill.DSV4Config, "preset",
                        classmethod(lambda cls, name: _TINY.replace(max_step_tokens=64)))
    rows: list = []
    profiles: list = []
    prefill.layer_rows("tiny", "C4", ["torch", "auto"], [40, 200], 24, 150, 2, 32, 1e12,
                       torch.device("cpu"), 60.0, lambda r: None, rows, (True, False), profiles)
    assert [p.split(":")[0] for p in profiles][:2] == ["## tiny C4 torch 40 tokens",
                                                       "## tiny C4 torch 200 tokens"]
    assert len(profiles) == 8 and all("CPU operator time" in p for p in profiles)
    # the host profile: the layer's own functions by name, file and line, with their callers
    assert all("Host profile (cProfile" in p and "attention.py:" in p for p in profiles)
    off = "auto" + prefill.STEP_KERNELS_OFF
    assert [(r["backend"], r["mode"], r["tokens"], r["context"]) for r in rows][3:] == [
        ("torch" + prefill.STEP_KERNELS_OFF, "single", 40, 0),
        ("torch" + prefill.STEP_KERNELS_OFF, "single", 200, 0),
        ("torch" + prefill.STEP_KERNELS_OFF, "chunked", 24, 150),
        ("auto", "single", 40, 0), ("auto", "single", 200, 0), ("auto", "chunked", 24, 150),
        (off, "single", 40, 0), (off, "single", 200, 0), (off, "chunked", 24, 150)]
    assert built == [False, True, False, True, False]  # the reference: the plain PyTorch path
    assert [r["step_kernels"] for r in rows] == [True] * 3 + [False] * 3 + [True] * 3 + [False] * 3
    assert all(r["ms"] == 2.0 and r["rel_err_vs_torch"] == 0.0 and r["peak_extra_bytes"] == 1024
               and r["reps_ms"] == [2.0, 2.0] and r["host_ms"] == 1.5
               and r["reps_host_ms"] == [1.5, 1.5] for r in rows)  # each timed call, in order
    assert rows[2]["flops"] == layer_flops(_TINY, 4, 24, 150)  # 40 + 200 tokens: several steps
    assert all(r["act_quant"] for r in rows)  # the serving numerics by default
    bf16: list = []  # --act-quant off: bf16 activations, checked against a bf16 reference
    prefill.layer_rows("tiny", "C4", ["auto"], [40], 0, 0, 2, 32, 1e12, torch.device("cpu"),
                       60.0, lambda r: None, bf16, act_quant=False)
    assert [(r["backend"], r["act_quant"]) for r in bf16] == [
        ("auto" + prefill.BF16_ACTIVATIONS, False)]
    assert bf16[0]["rel_err_vs_torch"] == 0.0 and bf16[0]["ms"] == 2.0
    assert all(r["caches"] == "bf16" for r in rows + bf16)  # the presets' stores by default
    fp8: list = []  # --caches fp8: the serving stores, the reference on the same stores
    prefill.layer_rows("tiny", "C4", ["auto"], [40], 0, 0, 2, 32, 1e12, torch.device("cpu"),
                       60.0, lambda r: None, fp8, caches="fp8")
    assert [(r["backend"], r["caches"]) for r in fp8] == [("auto" + prefill.FP8_CACHES, "fp8")]
    assert fp8[0]["rel_err_vs_torch"] == 0.0 and fp8[0]["ms"] == 2.0
    att: list = []
    prefill.attention_rows(torch.device("cpu"), 1e12, 1, lambda r: None, att,
                           cases=[(4, 96, 160)], context=1024)
    by = {r["impl"]: r for r in att}
    assert by["dsv4"]["ms"] == 2.0 and by["dsv4"]["rel_err"] < 1e-2
    assert all(by["dsv4_" + name]["ms"] == 2.0 for name in prefill.ATTN_PROBES)
    assert "skipped" in by["flashmla"]


_TINY = DSV4Config.preset("tiny")


def test_profile_tables_gpu_layout_from_a_cpu_profile():
    """The GPU report's three tables (kernels, operators with shapes, host events) build from
    any finished profile; on a CPU profile the kernel and operator tables are empty."""
    from torch.profiler import ProfilerActivity, profile

    from dsv4.bench.prefill import profile_tables

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        a = torch.randn(64, 64)
        (a @ a).relu().sum()
    md = profile_tables(prof, "t", 0.0125, gpu=True)
    assert "## t: 0.0 ms of kernel time" in md and "12.5 ms on the host clock" in md
    assert "| operator | input shapes |" in md
    host = md.split("Host side:")[1]
    assert "`aten::mm`" in host or "`aten::matmul`" in host


def test_profile_tables_name_the_dsv4_lines_behind_host_events():
    """With stacks recorded, each host event row names the dsv4 lines that issued it."""
    from torch.profiler import ProfilerActivity, profile

    from dsv4.bench.prefill import profile_tables
    from dsv4.testing.random_weights import random_layer_weights

    layer = build_attention(_TINY, _TINY.layer_of_ratio(4))
    layer.load_weights(random_layer_weights(_TINY, layer.layer_id, seed=0).items())
    x = torch.randn(16, _TINY.hidden_size, dtype=layer.dtype)
    cache = layer.new_cache(16)
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        layer(x, torch.arange(16), cache)
    if not any(".py(" in e.name for e in prof.events()):
        pytest.skip("this torch / Python build's profiler records no Python frames")
    host = profile_tables(prof, "t", 0.01, gpu=True).split("Host side:")[1]
    assert "| from (calls) |" in host
    assert ".py(" in host  # e.g. `attention.py(160)` (n)
    assert "bench/" not in host


def test_dsv4_callers_walks_up_to_the_nearest_dsv4_frame():
    """The caller of an event is the nearest dsv4 Python-function event above it, skipping
    frames outside dsv4 and dsv4.bench's own."""
    from types import SimpleNamespace as Ev

    from dsv4.bench.prefill import _dsv4_callers

    bench = Ev(name="src/dsv4/bench/prefill.py(300): profile_call", cpu_parent=None)
    step = Ev(name="src/dsv4/cache/step.py(69): plan", cpu_parent=bench)
    torch_fn = Ev(name="torch/_tensor.py(10): __getitem__", cpu_parent=step)
    events = [Ev(name="aten::select", cpu_parent=torch_fn),
              Ev(name="aten::select", cpu_parent=step),
              Ev(name="aten::mm", cpu_parent=bench),
              Ev(name="aten::copy_", cpu_parent=None)]
    got = _dsv4_callers(events)
    assert got["aten::select"] == {"cache/step.py(69): plan": 2}
    assert "aten::mm" not in got and "aten::copy_" not in got
