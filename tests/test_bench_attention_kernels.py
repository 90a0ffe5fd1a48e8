"""The attention-kernels benchmark's tables and helpers on CPU (fake numbers; timing: GPU)."""

from __future__ import annotations

import pytest
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
    assert len(markdown_tables({"rows": rows})) > 8
    # the activations quantised before the GEMM: alone, and with the quantiser's launch
    for impl in ("dsv4_fp8_act8pre", "dsv4_fp8_act8pre_q"):
        assert by[("gemm", impl)]["us"] == 3.0 and by[("gemm", impl)]["rel_err"] < 1e-2


def test_act8_variant_set_runs_only_the_fp8_activation_rows(monkeypatch):
    from dsv4.bench import attention_kernels as ak

    rows: list = []
    # wq_b's rows of the stacked tiny weight (where the pair rows split it)
    monkeypatch.setitem(ak.Q_FUSED_FIRST, "tiny", 256)
    ak._gemm_shape_rows("tiny", "q_fused", 384, 256, 1, "cpu", torch.Generator().manual_seed(1),
                        4e12, True, rows, lambda fns: 2.0, "act8")
    assert sorted(r["impl"] for r in rows) == [
        "dsv4_fp8", "dsv4_fp8_act8", "dsv4_fp8_act8_pair", "dsv4_fp8_act8pre",
        "dsv4_fp8_act8pre_pair", "dsv4_fp8_act8pre_q"]
    assert all(r["us"] == 2.0 and r["rel_err"] < 1e-2 for r in rows), rows
    with pytest.raises(ValueError, match="variants"):
        ak._gemm_shape_rows("tiny", "wo_b", 128, 256, 1, "cpu", torch.Generator(), 4e12, True,
                            [], lambda fns: 2.0, "some")


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


def test_act8_rows_probe_eight_warps_on_the_m64_swapped_tile():
    """Where the act_quant choice is an M = 64 swapped tile of 4 warps (it spills on sm_90), the
    act8 rows add the same tile with 8 warps; each row computes the quantised product."""
    from dsv4.bench.attention_kernels import _act8_rows
    from dsv4.kernels.fp8_linear import (
        Fp8GemmConfig,
        fp8_linear,
        fp8_linear_reference,
        quantize_activations,
    )
    from dsv4.layers.quant_sim import fp8_block_sim

    g = torch.Generator().manual_seed(3)
    w = (torch.randn(256, 256, generator=g) * 2).to(torch.float8_e4m3fn)
    s = torch.randint(118, 124, (2, 2), generator=g).to(torch.uint8).view(torch.float8_e8m0fnu)
    xs = [torch.randn(64, 256, generator=g).bfloat16()]

    def ours(i, xs=xs, cfg=None, x_scale=None):
        return fp8_linear(xs[i], w, s, config=cfg, x_scale=None if x_scale is None else x_scale[i])

    tile = Fp8GemmConfig(block_m=64, block_n=128, split_k=1, swap=True, act_fp8=True)
    ref_q = fp8_linear_reference(fp8_block_sim(xs[0], 128), w, s, torch.float32)
    pre = [quantize_activations(x) for x in xs]
    rows = _act8_rows(64, 256, 256, xs, pre, ours, ref_q, True, lambda *a, **k: tile,
                      quantize_activations)
    names = [r[0] for r in rows]
    assert names == ["dsv4_fp8_act8", "dsv4_fp8_act8pre", "dsv4_fp8_act8pre_q",
                     "dsv4_fp8_act8_w8", "dsv4_fp8_act8pre_w8"]
    for _, fn, want in rows:
        got = fn(0)
        assert ((got.float() - want).norm() / want.norm()).item() < 1e-2
