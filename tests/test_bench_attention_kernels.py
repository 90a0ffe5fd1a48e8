"""The attention-kernels benchmark's tables and helpers on CPU (fake numbers; timing: GPU)."""

from __future__ import annotations

import torch

from dsv4.bench.attention_kernels import (
    _template_rows,
    attention_case,
    make_store,
    markdown_tables,
)
from dsv4.kernels.sparse_mqa import gather_rows


def _res():
    rows = []
    for impl, us in (("dsv4", 20.0), ("flashmla", 12.0), ("torch_ref", 300.0)):
        rows.append({"section": "attention", "model": "flash", "fmt": "fp8_ds_mla", "T": 1,
                     "ctx": 512, "impl": impl, "floor_us": 10.0, "us": us,
                     "fraction": 10.0 / us})
    rows.append({"section": "attention", "model": "pro", "fmt": "bf16", "T": 16, "ctx": 8192,
                 "impl": "flashmla", "skipped": "not installed"})
    rows.append({"section": "attention", "model": "pro", "fmt": "bf16", "T": 16, "ctx": 8192,
                 "impl": "dsv4", "floor_us": 5.0, "error": "wrong: rel err 1"})
    for impl, us in (("dsv4_fp8", 10.0), ("dequant_bf16", 40.0)):
        rows.append({"section": "gemm", "model": "flash", "gemm": "wq_b", "N": 32768,
                     "K": 1024, "G": 1, "M": 1, "impl": impl, "floor_us": 8.0, "us": us,
                     "fraction": 8.0 / us})
    return {"gpu": "fake", "torch": "x", "copy_bw_TBps": 4.2, "rows": rows}


def test_markdown_tables_on_fake_numbers():
    lines = markdown_tables(_res())
    text = "\n".join(lines)
    assert "| dsv4 | flashmla | torch_ref |" in text
    assert "| flash | fp8_ds_mla | 1 | 512 | 10.0 | 20.0 (0.50) | 12.0 (0.83) | 300.0 (0.03) |" \
        in text
    assert "| pro | bf16 | 16 | 8192 | 5.0 | ERR | skip | - |" in text
    assert "| flash | wq_b | 32768 x 1024 (1) | 1 | 8.0 | 10.0 (0.80) | 40.0 (0.20) | 4.00x |" \
        in text
    assert "## Errors" in text


def test_bench_stores_and_indices_are_valid():
    gen = torch.Generator().manual_seed(0)
    for fmt in ("fp8_ds_mla", "bf16"):
        tpl = _template_rows(fmt, 128, "cpu", gen)
        store = make_store(fmt, 300, tpl)
        assert store.shape[0] == 5
        sets, n_win, n_cmp = attention_case(2, 512, 200, 2, "cpu", gen)
        assert n_win == 2 * 2 * 512 and n_cmp == 2 * 2 * 128
        win, cmp = sets[1]
        assert win.shape == (2, 128) and cmp.shape == (2, 200)
        assert (cmp[:, 128:] == -1).all() and int(win.max()) < n_win
        rows = gather_rows(make_store(fmt, n_win, tpl), win, fmt, 512, 64)
        assert torch.isfinite(rows).all()


def test_case_runners_on_cpu_with_a_fake_timer():
    from dsv4.bench.attention_kernels import _attention_case_rows, _gemm_shape_rows

    gen = torch.Generator().manual_seed(0)
    rows: list = []
    tpl = _template_rows("fp8_ds_mla", 128, "cpu", gen)
    _attention_case_rows("tiny", 4, 16, "fp8_ds_mla", 1, 512, torch.zeros(4), tpl, "cpu", gen,
                         4e12, rows, lambda fns: 7.0, True)
    _gemm_shape_rows("tiny", "wo_a", 256, 256, 2, "cpu", gen, 4e12, True, rows,
                     lambda fns: 3.0, True)
    by = {(r["section"], r["impl"]): r for r in rows}
    assert by[("attention", "dsv4")]["us"] == 7.0 and by[("attention", "dsv4")]["rel_err"] < 1e-2
    assert "skipped" in by[("attention", "flashmla")]
    assert by[("gemm", "dsv4_fp8")]["us"] == 3.0 and by[("gemm", "dequant_bf16")]["rel_err"] < 1e-2
    # the fp8-activation probes are checked against the quantised-activation product
    assert by[("gemm", "dsv4_fp8_act8")]["us"] == 3.0
    assert by[("gemm", "dsv4_fp8_act8")]["rel_err"] < 1e-2  # bf16 output
    # the platform's route for long calls (grouped wo_a: no activation quantisation)
    assert by[("gemm", "long_call")]["us"] == 3.0 and by[("gemm", "long_call")]["rel_err"] < 1e-2
    assert len(markdown_tables({"rows": rows})) > 8
    # the tile probes around each choice: bf16 and fp8 activations, each checked
    probes = [r for r in rows if r["section"] == "gemm" and r["impl"].startswith("dsv4_fp8_")]
    assert {"dsv4_fp8_bn32", "dsv4_fp8_act8_bn128"} <= {r["impl"] for r in probes}
    assert all(r["us"] == 3.0 and r["rel_err"] < 1e-2 for r in probes), probes
    # x quantised once (M > 16): the M > 64 tile, checked like the others
    pre: list = []
    _gemm_shape_rows("tiny", "wo_b", 256, 256, 1, "cpu", gen, 4e12, True, pre,
                     lambda fns: 3.0, True, (64,))
    got = {r["impl"]: r for r in pre}
    for tile in ("mlarge", "bm16", "bm32"):  # the 64-token tile's alternatives, each checked
        assert got[f"dsv4_fp8_act8_prequant_{tile}"]["us"] == 3.0
        assert got[f"dsv4_fp8_act8_prequant_{tile}"]["rel_err"] < 1e-2
    plain: list = []
    _gemm_shape_rows("tiny", "wo_b", 128, 256, 1, "cpu", gen, 4e12, True, plain,
                     lambda fns: 3.0, False)
    assert sorted(r["impl"] for r in plain) == ["dequant_bf16", "dsv4_fp8", "dsv4_fp8_act8",
                                                "long_call"]
    # wo_b's long calls quantise x first: checked against the quantised-activation product
    assert {r["impl"]: r for r in plain}["long_call"]["rel_err"] < 1e-2


def test_cli_knows_the_suite():
    from dsv4.cli import build_parser

    args, extra = build_parser().parse_known_args(["bench", "attention-kernels", "--out", "x",
                                                   "--quick"])
    assert args.suite == "attention-kernels" and extra == ["--out", "x", "--quick"]


def test_report_only_from_json(tmp_path):
    import json

    from dsv4.bench.attention_kernels import main

    (tmp_path / "results.json").write_text(json.dumps(_res()))
    assert main(["--out", str(tmp_path), "--report-only"]) == 0
    assert "## fp8 GEMMs" in (tmp_path / "summary.md").read_text()
