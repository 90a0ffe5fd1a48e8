"""``dsv4 bench decode-step --tp N``: the decode step of a tensor-parallel layer, per rank.

N processes (one GPU each, NCCL; spawned here, or the ones ``torchrun`` started) build the same C4 /
C128 / SWA layer of the ``cuda`` platform as it ships (``cuda_plan``: compressor fusion and packed
input projections), each rank holding its heads and output groups. Per (model, layer, M) and
rank the whole decode step is captured as a CUDA graph twice, with its all-reduce and without it
(the same step with the reduce replaced by the identity, for timing only), and the all-reduce of
the step's [M, hidden] output is captured alone. Replays are timed; ``allreduce_us`` = step minus
step without the reduce. Before timing, each rank's eager output is compared with the TP=1 layer
of rank 0 (same weights and inputs) and each graph's replay with its eager answer (bitwise).

``--dry-run`` runs the same code on the CPU over gloo with the ``reference`` platform, the tiny
preset and eager calls instead of graph replay: it checks the plumbing; its times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dsv4.attention import DeepseekV4Attention
from dsv4.bench.args import LAYER_RATIO
from dsv4.config import DSV4Config
from dsv4.passes import process_weights_after_loading
from dsv4.platforms import build_attention
from dsv4.tensor_parallel import TPInfo, comm_device
from dsv4.testing.random_weights import random_layer_weights
from dsv4.tp_launch import run_here, spawn, under_torchrun
from dsv4.usage import UsageError

TIMEOUT_S = 600.0
"""Collective timeout of the benchmark's group (building full-size random weights on the host
takes a while, and rank 0 also builds the TP=1 layer)."""
MAX_REL_ERR = 2e-2


def _build(cfg: DSV4Config, layer_id: int, weights: dict[str, torch.Tensor], dev: torch.device,
           tp: TPInfo | None, dry: bool) -> DeepseekV4Attention:
    if dry:
        layer = build_attention(cfg, layer_id, platform="reference", device=dev,
                                          dtype=torch.bfloat16, tp_group=tp)
        passes = ["compressor_fusion"]
    else:
        from dsv4.platforms.cuda import CudaAttention, CudaPlan

        plan = CudaPlan(fused_max_tokens=CudaPlan.load(cfg.hidden_size).fused_max_tokens,
                        graph_max_tokens=0)  # the whole step is one graph
        layer = CudaAttention(cfg, layer_id, device=dev, dtype=torch.bfloat16, plan=plan,
                              tp_group=tp)
        passes = ["compressor_fusion", "fuse_input_projections"]
    layer.load_weights(weights.items())  # whole official tensors: a TP layer keeps its part
    process_weights_after_loading(layer, passes=passes)
    return layer


def _runner(fn: Callable[[], torch.Tensor], dev: torch.device, dry: bool
            ) -> tuple[Callable[[], Any], torch.Tensor]:
    """(replay, output): a captured CUDA graph of ``fn``, or ``fn`` itself in a dry run."""
    if dry:
        return fn, fn()
    from dsv4.runner import capture_graph

    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with capture_graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize(dev)
    return graph.replay, out


def _time_us(run: Callable[[], Any], group: Any, reps: int, inner: int, dry: bool) -> float:
    times = []
    for _ in range(reps):
        dist.barrier(group=group)
        if dry:
            t0 = time.perf_counter()
            for _ in range(inner):
                run()
            times.append((time.perf_counter() - t0) * 1e6 / inner)
            continue
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(inner):
            run()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / inner)
    return statistics.median(times)


def tp_case(group: Any, cfg: DSV4Config, model: str, layer_type: str, m: int, context: int,
            reps: int, weights: dict[str, torch.Tensor], dry: bool = False,
            pooled: bool = False) -> dict[str, Any]:
    """One (model, layer, M) on this rank: times and the error against TP=1 (a collective)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    dev = torch.device("cpu") if dry else comm_device(group)
    tp = TPInfo.create(cfg, group)
    layer_id = cfg.layer_of_ratio(LAYER_RATIO[layer_type])
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randn(m, context, cfg.hidden_size, generator=gen).to(dev, torch.bfloat16)
    x = torch.randn(m, cfg.hidden_size, generator=gen).to(dev, torch.bfloat16)
    pos = torch.full((m,), context, dtype=torch.long)  # CPU positions: no sync, capturable

    def prepared(layer: DeepseekV4Attention) -> Callable[[], torch.Tensor]:
        caches = (layer.new_caches(m, context + 8) if pooled else
                  [layer.new_cache(context + 8) for _ in range(m)])
        for i, c in enumerate(caches):
            layer(prompts[i], torch.arange(context), c)

        def step() -> torch.Tensor:
            y = layer(x, pos, caches)
            for c in caches:  # the step always decodes position `context`
                c.truncate(context)
            return y

        return step

    layer = _build(cfg, layer_id, weights, dev, tp, dry)
    step = prepared(layer)
    eager = step()
    ref = torch.empty_like(eager)
    if rank == 0:
        ref = prepared(_build(cfg, layer_id, weights, dev, None, dry))()
    dist.broadcast(ref, src=dist.get_global_rank(group, 0), group=group)
    err = float((eager.double() - ref.double()).norm() / ref.double().norm())
    if err > MAX_REL_ERR:
        raise RuntimeError(f"{model} {layer_type} M={m} rank {rank}: rel err {err:.2e} against "
                           "the TP=1 layer")
    with_reduce, out = _runner(step, dev, dry)
    graph_err = float((out.double() - eager.double()).norm() / eager.double().norm())
    if graph_err > 1e-2:  # NCCL may pick another reduction order inside a graph: not bitwise
        raise RuntimeError(f"{model} {layer_type} M={m} rank {rank}: graph replay differs from "
                           f"the eager step by {graph_err:.2e}")
    layer._tp_all_reduce = lambda y: y  # type: ignore[method-assign]  # timing only
    try:
        without_reduce, _ = _runner(step, dev, dry)
    finally:
        del layer._tp_all_reduce
    buf = torch.zeros_like(eager)
    reduce_alone, _ = _runner(lambda: tp.all_reduce(buf), dev, dry)
    inner = 2 if dry else 20
    us = _time_us(with_reduce, group, reps, inner, dry)
    us_local = _time_us(without_reduce, group, reps, inner, dry)
    us_reduce = _time_us(reduce_alone, group, reps, inner, dry)
    row = {"model": model, "layer_type": layer_type, "M": m, "rank": rank, "tp": size,
           "context": context, "caches": "pooled" if pooled else "per-sequence",
           "mode": "eager (dry run)" if dry else "graph", "us": us, "us_no_reduce": us_local,
           "allreduce_us": us - us_local, "allreduce_alone_us": us_reduce,
           "rel_err_vs_tp1": err, "graph_vs_eager": graph_err}
    print(f"rank {rank}/{size} {model:>5} {layer_type:>4} M={m:>3}: step {us:8.1f} us, without "
          f"all-reduce {us_local:8.1f} us, all-reduce alone {us_reduce:6.1f} us, err {err:.1e}",
          flush=True)
    return row


def tp_rows(group: Any, opts: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's rows, on every rank (a collective)."""
    size = dist.get_world_size(group)
    rows: list[dict[str, Any]] = []
    for model in opts["models"]:
        if opts["dry"]:
            from dsv4.testing.verify_tp import tp_preset

            cfg = tp_preset(size)
        else:
            cfg = DSV4Config.preset(model)
        for layer_type in opts["layers"]:
            weights = random_layer_weights(cfg, cfg.layer_of_ratio(LAYER_RATIO[layer_type]))
            for m in opts["ms"]:
                rows.append(tp_case(group, cfg, model, layer_type, m, opts["context"],
                                    opts["reps"], weights, opts["dry"], opts["pooled"]))
    everyone: list[Any] = [None] * size
    dist.all_gather_object(everyone, rows, group=group)
    return [r for per_rank in everyone for r in per_rank]


def markdown_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| model | layer | M | rank | step, us | step without all-reduce, us | "
             "all-reduce in the step, us | all-reduce alone, us | rel err vs TP=1 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["model"], r["layer_type"], r["M"], r["rank"])):
        lines.append(f"| {r['model']} | {r['layer_type']} | {r['M']} | {r['rank']} | "
                     f"{r['us']:.1f} | {r['us_no_reduce']:.1f} | {r['allreduce_us']:.1f} | "
                     f"{r['allreduce_alone_us']:.1f} | {r['rel_err_vs_tp1']:.1e} |")
    return lines


def options(args: argparse.Namespace) -> dict[str, Any]:
    return {"models": ["tiny"] if args.dry_run else list(args.models),
            "layers": list(args.layers),
            "ms": list(args.ms), "context": args.context,
            "reps": args.reps, "pooled": args.pooled, "dry": args.dry_run}


def check_tp_args(args: argparse.Namespace) -> None:
    """The rank count against what runs it (torchrun's processes, or this machine's GPUs):
    a :class:`~dsv4.usage.UsageError` before any work."""
    if under_torchrun():
        size = int(os.environ["WORLD_SIZE"])
        if args.tp not in (1, size):
            raise UsageError(f"--tp {args.tp} but torchrun started {size} processes")
        return
    if args.tp < 2:
        raise UsageError(f"--tp {args.tp}: tensor parallelism needs at least 2 ranks")
    if not args.dry_run and torch.cuda.device_count() < args.tp:
        raise UsageError(f"--tp {args.tp} needs {args.tp} CUDA GPUs; this machine has "
                         f"{torch.cuda.device_count()} (--dry-run runs the ranks on the CPU)")


def main_tp(args: argparse.Namespace) -> int:
    """``decode_step.main`` with ``--tp N`` (or under torchrun), after :func:`check_tp_args`."""
    opts = options(args)
    backend = "gloo" if args.dry_run else "nccl"
    if under_torchrun():
        size = int(os.environ["WORLD_SIZE"])
        rows = run_here(tp_rows, (opts,), backend=backend, timeout_s=TIMEOUT_S)
        if int(os.environ["RANK"]) != 0:
            return 0
    else:
        size = args.tp
        rows = spawn(tp_rows, size, (opts,), backend=backend, timeout_s=TIMEOUT_S)[0]
    write_results(args.out, rows, size, args.context, args.pooled, args.dry_run)
    print("\n".join(markdown_table(rows)))
    return 0


def write_results(out: Path, rows: list[dict[str, Any]], size: int, context: int,
                  pooled: bool, dry: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    gpu = "cpu (dry run)" if dry else torch.cuda.get_device_name(0)
    (out / "decode_step_tp.json").write_text(json.dumps(
        {"gpu": gpu, "tp": size, "torch": torch.__version__, "rows": rows}, indent=1))
    (out / "decode_step_tp.md").write_text(
        f"Decode step with tensor parallelism over {size} ranks ({gpu}), "
        f"{'eager, dry run' if dry else 'CUDA-graph replay'}, us (context {context} tokens per "
        f"sequence, {'one cache pool' if pooled else 'a cache per sequence'})\n\n"
        + "\n".join(markdown_table(rows)) + "\n")
