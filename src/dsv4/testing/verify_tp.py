"""``dsv4 verify --tp N``: every rank of a tensor-parallel layer against the TP=1 layer.

For every platform x compressor fusion off/on x dtype x layer type, each rank builds the layer of
its group from the same random official weights (loaded whole, each rank keeping its slices),
runs the post-load passes and then prefill, chunked prefill, decode, a mixed batch (several
caches, ``seq_lens``) and a pooled decode batch. Rank 0 runs the same calls through the TP=1 layer
of the same platform and passes (replaying the TP layer's top-k picks) and broadcasts its output;
every rank reports its own relative error. float64 must agree to :data:`TOL_FLOAT64` (except
where a platform accumulates in fp32 by definition, :data:`FLOAT64_TOLERANCE`), bf16 to
:data:`TOL_BF16` (the reduction adds bf16 partial sums). The processes are spawned here (gloo on
the CPU, NCCL on CUDA, one GPU a rank) or are the ones ``torchrun`` started.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dsv4.attention import DeepseekV4Attention
from dsv4.config import DSV4Config
from dsv4.passes import process_weights_after_loading
from dsv4.platforms import available, build_attention, get_platform
from dsv4.tensor_parallel import TPInfo, comm_device, exchange_strings
from dsv4.testing.probes import record_selection, replay_selection
from dsv4.testing.random_weights import random_layer_weights
from dsv4.testing.verify import _run_pooled, passes_for
from dsv4.tp_launch import backend_for, run_here, spawn, under_torchrun

TOL_FLOAT64 = 1e-12
TOL_BF16 = 1e-2
FLOAT64_TOLERANCE = {"preshuffle": 1e-6}
"""Platforms whose float64 layer still accumulates a GEMM in fp32 by definition: ``preshuffle``'s
blockscale GEMM (AITER's kernel, emulated in fp32), where splitting ``wo_b``'s K over the ranks
changes the fp32 rounding (measured 2.7e-8 .. 4.6e-8 at TP=2, 2.3e-7 at TP=4)."""
MODES = ("prefill", "chunked", "decode", "mixed", "pooled")
DTYPES = {"float64": torch.float64, "bf16": torch.bfloat16}


@dataclass
class TPRow:
    rank: int
    platform: str
    fusion: bool
    dtype: str
    ratio: int
    mode: str
    rel_err: float
    tolerance: float
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.rel_err <= self.tolerance


def tp_preset(size: int) -> DSV4Config:
    """The tiny preset, widened where ``size`` ranks need more heads / output groups (each rank
    keeps whole fp8 blocks: head_dim and o_lora_rank are 128)."""
    cfg = DSV4Config.preset("tiny")
    groups = max(cfg.o_groups, size)
    heads = max(cfg.num_attention_heads, groups * cfg.heads_per_group)
    return cfg if groups == cfg.o_groups else cfg.replace(num_attention_heads=heads,
                                                          o_groups=groups)


def run_mode(layer: DeepseekV4Attention, x: torch.Tensor, mode: str) -> torch.Tensor:
    """The outputs of ``x`` through fresh caches in one of :data:`MODES`, in call order."""
    t, dev = x.shape[0], x.device
    if mode == "pooled":
        return _run_pooled(layer, x)
    if mode == "mixed":  # three caches: a mixed prefill, then a mixed chunk/decode call
        lens1 = [t // 2, t // 4, t // 8]
        rest = t - sum(lens1)
        lens2 = [1, rest - 2, 1]
        if min(lens2) < 1:
            raise ValueError(f"mixed mode needs at least 16 tokens, got {t}")
        caches = [layer.new_cache(t) for _ in lens1]
        pos1 = torch.cat([torch.arange(n) for n in lens1])
        pos2 = torch.cat([torch.arange(a, a + b) for a, b in zip(lens1, lens2, strict=True)])
        n1 = sum(lens1)
        return torch.cat([layer(x[:n1], pos1.to(dev), caches, seq_lens=lens1),
                          layer(x[n1:], pos2.to(dev), caches, seq_lens=lens2)])
    cache = layer.new_cache(t)
    pos = torch.arange(t, device=dev)
    if mode == "prefill":
        return layer(x, pos, cache)
    if mode == "chunked":
        step = -(-t // 4)
        return torch.cat([layer(x[i:i + step], pos[i:i + step], cache)
                          for i in range(0, t, step)])
    if mode == "decode":
        split = t - min(8, t // 4)
        ys = [layer(x[:split], pos[:split], cache)]
        ys += [layer(x[i:i + 1], pos[i:i + 1], cache) for i in range(split, t)]
        return torch.cat(ys)
    raise ValueError(f"unknown mode {mode!r}; modes: {MODES}")


def build_layer(cfg: DSV4Config, ratio: int, platform: str, fusion: bool, device: Any,
                dtype: torch.dtype, seed: int, tp_group: Any) -> DeepseekV4Attention:
    """A processed layer on random official weights (whole tensors: a TP layer keeps its part)."""
    layer_id = cfg.layer_of_ratio(ratio)
    layer = build_attention(cfg, layer_id, platform=platform, device=device,
                                      dtype=dtype, tp_group=tp_group)
    layer.load_weights(random_layer_weights(cfg, layer_id, seed).items())
    process_weights_after_loading(layer, passes=passes_for(layer, fusion))
    return layer


def rank_rows(group: Any, cfg: DSV4Config | None = None, platforms: Sequence[str] | None = None,
              device: str | None = None, tokens: int = 160, seed: int = 0,
              dtypes: Sequence[str] = ("float64", "bf16"), modes: Sequence[str] = MODES,
              ratios: Sequence[int] = (0, 4, 128), fusions: Sequence[bool] = (False, True),
              ) -> list[TPRow]:
    """This rank's rows (a collective: every rank of ``group`` calls it with the same
    arguments)."""
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(dev).type == "cuda":
        dev = str(comm_device(group))
    rank = dist.get_rank(group)
    cfg = cfg or tp_preset(dist.get_world_size(group))
    tp = TPInfo.create(cfg, group)
    root = dist.get_global_rank(group, 0)
    names = list(platforms) if platforms else available(dev)
    rows: list[TPRow] = []
    gen = torch.Generator().manual_seed(seed)
    for platform in names:
        get_platform(platform, dev)
        for fusion in fusions:
            for dname in dtypes:
                dtype = DTYPES[dname]
                tol = (FLOAT64_TOLERANCE.get(platform, TOL_FLOAT64) if dtype == torch.float64
                       else TOL_BF16)
                for ratio in ratios:
                    layer = build_layer(cfg, ratio, platform, fusion, dev, dtype, seed, tp)
                    ref = (build_layer(cfg, ratio, platform, fusion, dev, dtype, seed, None)
                           if rank == 0 else None)
                    for mode in modes:
                        x = torch.randn(tokens, cfg.hidden_size, generator=gen)
                        x = x.to(torch.bfloat16).to(device=dev, dtype=dtype)
                        rows.append(_compare(group, root, layer, ref, x, mode, TPRow(
                            rank, platform, fusion, dname, ratio, mode, float("nan"), tol)))
    return rows


def _compare(group: Any, root: int, layer: DeepseekV4Attention,
             ref: DeepseekV4Attention | None, x: torch.Tensor, mode: str, row: TPRow) -> TPRow:
    error = ""
    y = None
    try:
        with record_selection(layer) as seen:
            y = run_mode(layer, x, mode)
        if ref is not None:
            with replay_selection(ref, seen):
                y_ref = run_mode(ref, x, mode)
    except Exception as e:  # a failing case is a row, not a crash
        error = f"{type(e).__name__}: {e}"
    statuses = exchange_strings(group, error or "ok")
    if any(s != "ok" for s in statuses):
        row.error = error or "failed on rank(s) " + str(
            [r for r, s in enumerate(statuses) if s != "ok"])
        return row
    assert y is not None
    if ref is None:
        y_ref = torch.empty_like(y)
    buf = y_ref.to(comm_device(group))
    dist.broadcast(buf, src=root, group=group)
    y_ref = buf.to(y.device)
    row.rel_err = float((y.double() - y_ref.double()).norm() / y_ref.double().norm())
    return row


def format_report(rows: list[TPRow], size: int) -> str:
    lines = [f"tensor parallelism over {size} ranks: each rank's output against the TP=1 layer "
             "(same platform, passes, weights and inputs; rel. Frobenius error)", "",
             f"{'platform':>11} | {'fusion':>6} | {'dtype':>7} | {'ratio':>5} | {'mode':>7} | "
             f"{'worst rank':>10} | {'rel err':>9} | {'tolerance':>9} | result"]
    keys: dict[tuple[Any, ...], list[TPRow]] = {}
    for r in rows:
        keys.setdefault((r.platform, r.fusion, r.dtype, r.ratio, r.mode), []).append(r)
    for (plat, fusion, dname, ratio, mode), group in keys.items():
        bad = [r for r in group if not r.ok]
        worst = bad[0] if bad else max(group, key=lambda r: r.rel_err)
        res = "ok" if not bad else ("FAIL " + worst.error if worst.error else "FAIL")
        lines.append(f"{plat:>11} | {'on' if fusion else 'off':>6} | {dname:>7} | {ratio:>5} | "
                     f"{mode:>7} | {worst.rank:>10} | {worst.rel_err:>9.2e} | "
                     f"{worst.tolerance:>9.1e} | {res}")
    return "\n".join(lines)


def _worker(group: Any, kwargs: dict[str, Any]) -> list[TPRow]:
    rows = rank_rows(group, **kwargs)
    if under_torchrun():  # every rank's rows to every rank (rank 0 prints)
        everyone: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, rows, group=group)
        rows = [r for rank_rows_ in everyone for r in rank_rows_]
    return rows


def run_verify_tp(tp: int, platforms: Sequence[str] | None = None, device: str | None = None,
                  tokens: int = 160, seed: int = 0, **kwargs: Any) -> tuple[bool, str]:
    """Spawn ``tp`` ranks (or join ``torchrun``'s), verify, and return (ok, report)."""
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    for n in platforms or ():
        get_platform(n, dev)  # unknown / unavailable: a clear error before any process starts
    args = {"platforms": platforms, "device": dev, "tokens": tokens, "seed": seed, **kwargs}
    backend = backend_for(dev)
    if under_torchrun():
        size = int(os.environ["WORLD_SIZE"])
        if tp not in (1, size):
            raise ValueError(f"--tp {tp} but torchrun started {size} processes (WORLD_SIZE)")
        rows = run_here(_worker, (args,), backend=backend)
    else:
        rows = [r for per_rank in spawn(_worker, tp, (args,), backend=backend)
                for r in per_rank]
        size = tp
    ok = bool(rows) and all(r.ok for r in rows)
    report = format_report(rows, size)
    return ok, report + f"\n\n{'PASS' if ok else 'FAIL'}: tensor parallelism over {size} ranks " \
        f"on {dev}"
