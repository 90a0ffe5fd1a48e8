"""Tensor parallelism on the CPU over gloo (dsv4.tensor_parallel).

Spawning is slow on 2 cores, so each world size is one spawned job (module-scoped fixtures) that
runs every check and returns its results; the tests below read them. TP=2 runs the tiny preset
(4 heads, 2 output groups) and the shipped model; TP=4 a preset with 8 heads and 4 groups.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open

from dsv4 import DeepseekV4Attention, DSV4Config, load_checkpoint, save_checkpoint
from dsv4.offload import CpuOffloader
from dsv4.platforms import available, build_attention
from dsv4.tensor_parallel import TPConfigError, TPInfo, config_key, split_problems
from dsv4.testing.contract import structural_violations
from dsv4.testing.random_weights import random_layer_weights
from dsv4.testing.verify_tp import MODES, TPRow, rank_rows, run_mode, tp_preset
from dsv4.tinylm.checkpoint import ATTN_SHARD, default_model_dir
from dsv4.tp_launch import NO_MULTICAST_ENV, spawn
from dsv4.weights import WeightLoadError

pytestmark = pytest.mark.xdist_group("tensor-parallel")
"""Under pytest-xdist with ``--dist loadgroup`` (``benchmarks/gpu_check.sh``) one worker runs
this module: the spawned jobs are module-scoped fixtures, and spread over workers each
worker ran them again, all at once (on the 16-core GPU machine six copies of the TP=2 job
had not finished after 250 s; alone the module takes 17 s)."""

ARITH = default_model_dir()
ARITH_TOKENS = 48


def _arith_x(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    return torch.randn(ARITH_TOKENS, 256, generator=g).to(torch.bfloat16).to(dtype)


def _caught(fn: Any) -> tuple[str, str, float]:
    t0 = time.perf_counter()
    try:
        fn()
    except Exception as e:
        return type(e).__name__, str(e), time.perf_counter() - t0
    return "no error", "", time.perf_counter() - t0


# ---- the spawned jobs (module level: the children import them) ---------------------------
def _tp2_job(group: Any, out_dir: str, broken: str) -> dict[str, Any]:
    rank = dist.get_rank(group)
    out = Path(out_dir)
    res: dict[str, Any] = {"env": {k: os.environ.get(k) for k in NO_MULTICAST_ENV}}
    clock = [time.perf_counter()]
    times: dict[str, float] = {}
    res["times"] = times

    def lap(name: str) -> None:
        times[name] = time.perf_counter() - clock[0]
        clock[0] = time.perf_counter()

    rows = rank_rows(group, platforms=["reference"], tokens=64, dtypes=("float64",),
                     modes=MODES, ratios=(4,), fusions=(False,))
    rows += rank_rows(group, platforms=["reference"], tokens=136, dtypes=("float64",),
                      modes=("prefill", "decode"), ratios=(128,), fusions=(False, True))
    rows += rank_rows(group, platforms=["reference"], tokens=40, dtypes=("float64", "bf16"),
                      modes=("mixed",), ratios=(0,), fusions=(False,))
    rows += rank_rows(group, platforms=available("cpu"), tokens=40, dtypes=("bf16", "float64"),
                      modes=MODES, ratios=(0, 4), fusions=(False, True))
    # act_quant: each rank quantises its own slice of wo_b's input (whole 128-blocks of its
    # groups), the same blocks as TP=1 (float64 reference: to 1e-12 like the rows above)
    res["act_rows"] = rank_rows(group, tp_preset(2).replace(act_quant=True),
                                platforms=["reference", "preshuffle"], tokens=40,
                                dtypes=("float64", "bf16"), modes=("prefill", "decode"),
                                ratios=(4,), fusions=(False,))
    rows += res["act_rows"]
    res["rows"] = rows
    lap("layer matrix")

    # the shipped model, loaded straight from its checkpoint (float64: compared in the test)
    stack = load_checkpoint(ARITH, platform="reference", dtype=torch.float64, tp_group=group,
                            offloader=CpuOffloader("cpu"))
    x = _arith_x(torch.float64)
    torch.save({i: {m: run_mode(stack[i], x, m) for m in ("decode", "mixed")}
                for i in stack.layer_ids}, out / f"arith_rank{rank}.pt")
    layer = stack[1]
    res["local"] = {"n_heads": layer.n_heads, "o_groups": layer.o_groups,
                    "wq_b": tuple(layer.wq_b.weight.shape), "wo_a": tuple(layer.wo_a.weight.shape),
                    "wo_b": tuple(layer.wo_b.weight.shape), "wo_b.scale": tuple(
                        layer.wo_b.scale.shape), "attn_sink": tuple(layer.attn_sink.shape)}
    # saved from preshuffled TP layers: canonical, gathered, rank 0 writes
    pre = load_checkpoint(ARITH, platform="preshuffle", tp_group=group)
    res["saved"] = [str(p) for p in save_checkpoint(pre, out / "saved")]
    lap("shipped model")

    from dsv4.bench.decode_step_tp import tp_rows

    res["bench"] = tp_rows(group, {"models": ["tiny"], "layers": ["C4"], "ms": [2],
                                   "context": 20, "reps": 1, "pooled": True, "dry": True})
    lap("bench")

    # errors: every rank raises, none hangs
    cfg = DSV4Config.preset("tiny")
    mine = cfg if rank == 0 else cfg.replace(sliding_window=8)
    res["mismatch"] = _caught(lambda: build_attention(mine, 1, tp_group=group))
    res["fail_config"] = _caught(lambda: load_checkpoint(
        ARITH if rank == 0 else out / "missing", tp_group=group))
    res["fail_read"] = _caught(lambda: load_checkpoint(
        ARITH if rank == 0 else Path(broken), tp_group=group))
    lap("errors")
    return res


def _tp4_job(group: Any) -> dict[str, Any]:
    rows = rank_rows(group, platforms=["reference"], tokens=48, dtypes=("float64",),
                     modes=MODES, ratios=(0, 4), fusions=(False,))
    rows += rank_rows(group, platforms=["reference"], tokens=136, dtypes=("float64",),
                      modes=("chunked",), ratios=(128,), fusions=(True,))
    rows += rank_rows(group, platforms=["preshuffle"], tokens=40, dtypes=("bf16", "float64"),
                      modes=("prefill", "pooled"), ratios=(4,), fusions=(True,))
    tiny = DSV4Config.preset("tiny")
    return {"rows": rows,
            "groups": _caught(lambda: build_attention(tiny, 1, tp_group=group)),
            "heads": _caught(lambda: build_attention(
                tiny.replace(num_attention_heads=6, o_groups=3), 1, tp_group=group))}


@pytest.fixture(scope="module")
def tp2(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path, float]:
    out = tmp_path_factory.mktemp("tp2")
    broken = out / "broken"
    shutil.copytree(ARITH, broken)
    data = (broken / ATTN_SHARD).read_bytes()
    (broken / ATTN_SHARD).write_bytes(data[: len(data) // 2])  # truncated attention shard
    t0 = time.perf_counter()
    results = spawn(_tp2_job, 2, (str(out), str(broken)), timeout_s=60)
    return results, out, time.perf_counter() - t0


@pytest.fixture(scope="module")
def tp4() -> tuple[list[dict[str, Any]], float]:
    t0 = time.perf_counter()
    results = spawn(_tp4_job, 4, (), timeout_s=60)
    return results, time.perf_counter() - t0


def _check_rows(rows: list[TPRow], ranks: int) -> None:
    assert rows
    assert {r.rank for r in rows} == set(range(ranks))
    bad = [r for r in rows if not r.ok]
    assert not bad, bad
    for r in rows:
        bound = 1e-12 if (r.dtype, r.platform) == ("float64", "reference") else r.tolerance
        assert r.rel_err <= bound


# ---- TP=2 -------------------------------------------------------------------------------
def test_tp2_every_mode_and_platform_matches_tp1(tp2: Any) -> None:
    results, _, seconds = tp2
    rows = [r for res in results for r in res["rows"]]
    _check_rows(rows, 2)
    assert {r.mode for r in rows} == set(MODES)
    assert {r.ratio for r in rows} == {0, 4, 128}
    assert {r.platform for r in rows} == set(available("cpu"))
    assert {r.dtype for r in rows} == {"float64", "bf16"}
    assert max(r.rel_err for r in rows if r.dtype == "float64"
               and r.platform == "reference") <= 1e-12
    print(f"TP=2 job: {seconds:.1f} s; rank 0: {results[0]['times']}")


def test_tp2_act_quant_matches_tp1(tp2: Any) -> None:
    results, _, _ = tp2
    rows = [r for res in results for r in res["act_rows"]]
    assert len(rows) == 2 * 2 * 2 * 2  # ranks x platforms x dtypes x modes
    _check_rows(rows, 2)


def test_tp2_children_run_without_nvlink_multicast(tp2: Any) -> None:
    for res in tp2[0]:
        assert res["env"] == NO_MULTICAST_ENV


def test_tp2_shipped_model_matches_tp1_and_holds_only_its_slices(tp2: Any) -> None:
    results, out, _ = tp2
    assert results[0]["local"] == {"n_heads": 2, "o_groups": 1, "wq_b": (256, 128),
                                   "wo_a": (128, 256), "wo_b": (256, 128), "wo_b.scale": (2, 1),
                                   "attn_sink": (2,)}
    ref = load_checkpoint(ARITH, platform="reference", dtype=torch.float64)
    x = _arith_x(torch.float64)
    got = [torch.load(out / f"arith_rank{rank}.pt") for rank in range(2)]
    for i in ref.layer_ids:
        for mode in ("decode", "mixed"):
            y_ref = run_mode(ref[i], x, mode)
            for rank in range(2):
                y = got[rank][i][mode]
                err = float((y - y_ref).norm() / y_ref.norm())
                assert err <= 1e-12, (rank, i, mode, err)


def test_tp2_saved_checkpoint_is_the_official_one_bit_for_bit(tp2: Any) -> None:
    results, out, _ = tp2
    assert results[1]["saved"] == []  # rank 0 writes
    saved = out / "saved" / "model.safetensors"
    assert str(saved) in results[0]["saved"]
    with safe_open(str(saved), "pt") as f, safe_open(str(ARITH / ATTN_SHARD), "pt") as g:
        assert set(f.keys()) == set(g.keys())
        for name in g.keys():  # noqa: SIM118
            a, b = f.get_tensor(name), g.get_tensor(name)
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


def test_tp2_bench_decode_step_plumbing(tp2: Any) -> None:
    rows = tp2[0][0]["bench"]
    assert sorted(r["rank"] for r in rows) == [0, 1]
    for r in rows:
        assert r["tp"] == 2 and r["rel_err_vs_tp1"] <= 2e-2 and r["us"] > 0
        assert r["allreduce_us"] == pytest.approx(r["us"] - r["us_no_reduce"])


def test_tp2_mismatched_configs_raise_on_every_rank(tp2: Any) -> None:
    for rank, res in enumerate(tp2[0]):
        kind, msg, _ = res["mismatch"]
        assert kind == "TPConfigError", msg
        assert "ranks [0]" in msg and "ranks [1]" in msg and f"rank {rank}" in msg


def test_tp2_a_rank_failing_to_load_makes_every_rank_raise(tp2: Any) -> None:
    ok_rank, bad_rank = tp2[0]
    for key, culprit in (("fail_config", "does not exist"), ("fail_read", "cannot read")):
        kind, msg, seconds = bad_rank[key]
        assert kind == "CheckpointError" and culprit in msg, msg
        kind, msg, seconds = ok_rank[key]
        assert kind == "TPRankError", msg
        assert "rank(s) [1]" in msg and culprit in msg and seconds < 30


# ---- TP=4 -------------------------------------------------------------------------------
def test_tp4_matches_tp1(tp4: Any) -> None:
    results, seconds = tp4
    rows = [r for res in results for r in res["rows"]]
    _check_rows(rows, 4)
    assert {r.platform for r in rows} == {"reference", "preshuffle"}
    print(f"TP=4 job: {seconds:.1f} s")


def test_tp4_indivisible_heads_or_groups_raise_before_loading(tp4: Any) -> None:
    for res in tp4[0]:
        kind, msg, _ = res["groups"]
        assert kind == "TPConfigError" and "o_groups=2 is not divisible" in msg, msg
        assert "num_attention_heads" not in msg
        kind, msg, _ = res["heads"]
        assert kind == "TPConfigError" and "num_attention_heads=6 is not divisible" in msg, msg


# ---- no processes -----------------------------------------------------------------------
def test_split_problems_name_the_tensor_whose_fp8_block_would_be_cut() -> None:
    assert split_problems(8, 128, 4, 128, True, 4) == []
    (q,) = split_problems(2, 64, 2, 128, True, 2)  # 1 head x 64 rows a rank
    assert "wq_b" in q and "64" in q and "128" in q
    (o,) = split_problems(4, 128, 2, 64, True, 2)  # 1 group x 64 rows a rank
    assert "wo_a" in o and "wo_b" in o
    assert split_problems(2, 64, 2, 64, False, 2) == []  # no blocks without fp8


def _fake_tp(cfg: DSV4Config, rank: int, size: int) -> TPInfo:
    """A TPInfo without a process group: enough to build and load (not to run) a layer."""
    return TPInfo(rank, size, None, cfg.num_attention_heads // size, cfg.o_groups // size,
                  cfg.head_dim, cfg.o_lora_rank, cfg.fp8_weights, config_key(cfg))


def test_a_tp_layer_loads_its_slices_from_whole_or_split_tensors() -> None:
    cfg = tp_preset(4)
    full = random_layer_weights(cfg, 1)
    tp = _fake_tp(cfg, 2, 4)
    a = build_attention(cfg, 1, tp_group=tp)
    a.load_weights(full.items())
    assert a.wq_b.weight.shape == (256, 128) and a.attn_sink.shape == (2,)
    torch.testing.assert_close(a.attn_sink, full["attn_sink"][4:6], rtol=0, atol=0)
    assert torch.equal(a.wo_b.weight.view(torch.uint8),
                       full["wo_b.weight"][:, 256:384].view(torch.uint8))
    assert torch.equal(a.wq_b.scale.view(torch.uint8),
                       full["wq_b.scale"][4:6].view(torch.uint8))
    b = build_attention(cfg, 1, tp_group=tp)
    b.load_weights((n, tp.take(n, t)) for n, t in full.items())
    for (n, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p.view(torch.uint8), q.view(torch.uint8)), n
    bad = dict(full, **{"wo_a.weight": full["wo_a.weight"][:256]})
    with pytest.raises(WeightLoadError, match=r"wo_a.weight.*\(128, 256\).*whole \(512, 256\)"):
        b.load_weights(bad.items())
    assert torch.equal(a.wo_a.weight.view(torch.uint8), b.wo_a.weight.view(torch.uint8))


def test_a_tpinfo_for_another_config_is_refused() -> None:
    cfg = tp_preset(2)
    with pytest.raises(TPConfigError, match="another config"):
        build_attention(cfg.replace(sliding_window=8), 1, tp_group=_fake_tp(cfg, 0, 2))
    with pytest.raises(TPConfigError, match="not initialised|ProcessGroup"):
        build_attention(cfg, 1, tp_group="group")


def test_a_platform_cannot_drop_the_all_reduce() -> None:
    class Sneaky(DeepseekV4Attention):
        def _tp_all_reduce(self, y: torch.Tensor) -> torch.Tensor:
            return y

    (problem,) = structural_violations(Sneaky)
    assert "_tp_all_reduce" in problem


def test_without_a_group_nothing_is_split_or_reduced(tiny: DSV4Config) -> None:
    layer = build_attention(tiny, 1)
    assert layer.tp is None and layer.n_heads == 4 and layer.o_groups == 2
    y = torch.ones(3, 256, dtype=torch.bfloat16)
    assert layer._tp_all_reduce(y) is y


# ---- command lines ----------------------------------------------------------------------
def test_verify_tp_command_line(monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    import dsv4.testing.verify_tp
    from dsv4.cli import main

    seen: list[tuple[Any, ...]] = []

    def fake(tp: int, platforms: Any, device: Any, tokens: int, seed: int) -> tuple[bool, str]:
        seen.append((tp, platforms, device, tokens, seed))
        return False, "the table"

    monkeypatch.setattr(dsv4.testing.verify_tp, "run_verify_tp", fake)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["verify", "--tp", "2", "--platform", "preshuffle", "--tokens", "40"]) == 1
    assert seen == [(2, ["preshuffle"], None, 40, 0)]
    assert "the table" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["verify", "--tp", "0"])


def test_bench_decode_step_tp_command_line(monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    import dsv4.bench.decode_step_tp as tp_bench
    from dsv4.bench.decode_step import main

    calls: list[tuple[Any, ...]] = []
    row = {"model": "tiny", "layer_type": "C4", "M": 2, "rank": 0, "us": 2.0,
           "us_no_reduce": 1.5, "allreduce_us": 0.5, "allreduce_alone_us": 0.4,
           "rel_err_vs_tp1": 1e-3}

    def fake_spawn(fn: Any, world: int, args: tuple[Any, ...], backend: str,
                   timeout_s: float) -> list[Any]:
        calls.append((fn, world, args, backend))
        return [[row, dict(row, rank=1)]] * world

    monkeypatch.setattr(tp_bench, "spawn", fake_spawn)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["--out", str(tmp_path), "--tp", "2", "--dry-run", "--ms", "2"]) == 0
    (fn, world, (opts,), backend), = calls
    assert fn is tp_bench.tp_rows and world == 2 and backend == "gloo"
    assert opts["dry"] and opts["ms"] == [2] and opts["models"] == ["tiny"]
    assert "| tiny | C4 | 2 | 1 |" in (tmp_path / "decode_step_tp.md").read_text()
    if torch.cuda.device_count() < 2:  # a usage error (tests/test_cli.py checks its line)
        with pytest.raises(SystemExit) as e:
            main(["--out", str(tmp_path), "--tp", "2", "--overwrite"])
        assert e.value.code == 2
