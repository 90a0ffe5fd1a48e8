"""Full-layer decode step per input-projection strategy, CUDA-graph replay (one H200).

One DSV4 attention layer (Flash or Pro dims, C4 / C128 / SWA, fp8 weights with block scales,
random), M sequences each holding ``context`` tokens, one decode token per sequence per step. The
whole step (input projections, norms, q / kv paths, cache writes, compressor, indexer top-k,
sparse MQA, output projection) is captured once as a CUDA graph and replayed. Strategies differ
only in the input stage:

* ``serial4``      the four input GEMMs one after another (no aux streams, no fusion)
* ``multistream``  upstream CUDA: fused_wqa_wkv on the current stream, the others on 3 aux streams
* ``rocm_style``   upstream ROCm + fusion PR: sequential, the two compressor GEMMs fused
* ``fused4_dsv4``  ours: one launch over the packed weights (fuse_input_projections), at any M
* ``cuda_plan``    ours as the ``cuda`` platform runs it: the one launch up to the plan's token
                   count (``cuda_plan.json``), the upstream stream plan above

Each strategy's replayed output is checked against its own eager step (bitwise) and against the
``serial4`` output (rel. error), before it is timed. ``floor_us`` = bytes of all the layer's
weights plus the KV rows the step reads, over the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from dsv4.bench.input_proj import measure_copy_bw
from dsv4.config import DSV4Config
from dsv4.passes import process_weights_after_loading
from dsv4.platforms.cuda import CudaAttention, CudaPlan, capture_graph
from dsv4.random_weights import random_layer_weights

STRATEGIES = ("serial4", "multistream", "rocm_style", "fused4_dsv4", "cuda_plan")
OURS = ("fused4_dsv4", "cuda_plan")
LAYER_RATIO = {"C4": 4, "C128": 128, "SWA": 0}


def build(cfg: DSV4Config, layer_id: int, strategy: str, weights: dict[str, torch.Tensor],
          dev: torch.device) -> CudaAttention:
    threshold = 0 if strategy in ("serial4", "rocm_style") else 1024
    c = cfg.replace(multi_stream_token_threshold=threshold)
    fused = {"fused4_dsv4": 1 << 20,
             "cuda_plan": CudaPlan.load(cfg.hidden_size).fused_max_tokens}.get(strategy, 0)
    plan = CudaPlan(fused_max_tokens=fused, graph_max_tokens=0)  # the whole step is one graph
    layer = CudaAttention(c, layer_id, device=dev, dtype=torch.bfloat16, plan=plan)
    layer.load_weights(weights.items())
    passes = {"serial4": [], "multistream": [], "rocm_style": ["compressor_fusion"],
              "fused4_dsv4": ["compressor_fusion", "fuse_input_projections"],
              "cuda_plan": ["compressor_fusion", "fuse_input_projections"]}[strategy]
    process_weights_after_loading(layer, passes=passes)
    return layer


def step_bytes(layer: CudaAttention, m: int, context: int) -> int:
    w = sum(p.numel() * p.element_size() for p in layer.parameters())
    cfg = layer.cfg
    keys = min(context + 1, cfg.sliding_window)
    r = layer.compress_ratio
    if r == 4:
        keys += min(cfg.index_topk, (context + 1) // 4)
        keys_idx = (context + 1) // 4  # indexer scores every visible key
        w += m * keys_idx * cfg.index_head_dim * 2
    elif r == 128:
        keys += (context + 1) // 128
    return w + m * keys * cfg.head_dim * 2


def profile_step(layer: CudaAttention, x: torch.Tensor, pos: torch.Tensor, caches: list[Any],
                 context: int, title: str) -> str:
    """Kernel table of one eager decode step (same kernels as the graph): where the time goes."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        layer(x, pos, caches)
        torch.cuda.synchronize()
    for c in caches:
        c.length = context
    events = prof.key_averages()
    times = [(e.count, getattr(e, "device_time_total", 0.0)) for e in events]
    kernels = sum(n for n, t in times if t > 0)
    total = sum(t for _, t in times)
    table = events.table(sort_by="device_time_total", row_limit=30, max_name_column_width=70)
    return (f"## {title}: {kernels} kernel launches, {total:.0f} us of kernel time in one "
            f"eager step\n\n{table}\n")


def run_case(cfg: DSV4Config, model: str, layer_type: str, m: int, context: int,
             dev: torch.device, bw: float, reps: int, weights: dict[str, torch.Tensor],
             profiles: list[str] | None = None, pooled: bool = False,
             ) -> list[dict[str, Any]]:
    layer_id = cfg.layer_of_ratio(LAYER_RATIO[layer_type])
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randn(m, context, cfg.hidden_size, generator=gen).to(dev, torch.bfloat16)
    x = torch.randn(m, cfg.hidden_size, generator=gen).to(dev, torch.bfloat16)
    pos = torch.full((m,), context, dtype=torch.long)  # CPU positions: no sync, capturable
    rows, base = [], None
    for strategy in STRATEGIES:
        layer = build(cfg, layer_id, strategy, weights, dev)
        caches = (layer.new_caches(m, context + 8) if pooled else
                  [layer.new_cache(context + 8) for _ in range(m)])
        for i, c in enumerate(caches):
            layer(prompts[i], torch.arange(context), c)
        eager = layer(x, pos, caches)  # warm-up and the eager answer
        for c in caches:
            c.truncate(context)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            layer(x, pos, caches)
            for c in caches:
                c.truncate(context)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with capture_graph(graph):
            out = layer(x, pos, caches)
        for c in caches:
            c.truncate(context)
        graph.replay()
        torch.cuda.synchronize()
        if not torch.equal(out, eager):
            raise RuntimeError(f"{model} {layer_type} M={m} {strategy}: graph replay differs "
                               "from eager")
        base = out.clone() if base is None else base
        err = float((out.double() - base.double()).norm() / base.double().norm())
        if err > 2e-2:
            raise RuntimeError(f"{model} {layer_type} M={m} {strategy}: rel err {err:.2e} "
                               "against serial4")
        times = []
        for _ in range(reps):
            s, e = torch.cuda.Event(True), torch.cuda.Event(True)
            s.record()
            for _ in range(20):
                graph.replay()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e) * 1e3 / 20)
        us = statistics.median(times)
        floor = step_bytes(layer, m, context) / bw * 1e6
        rows.append({"model": model, "layer_type": layer_type, "M": m, "strategy": strategy,
                     "weights_dtype": "fp8-block", "mode": "graph", "scope": "decode_step",
                     "context": context, "caches": "pooled" if pooled else "per-sequence",
                     "us": us, "floor_us": floor, "fraction": floor / us,
                     "rel_err_vs_serial4": err})
        print(f"{model:>5} {layer_type:>4} M={m:>3} {strategy:>12}: {us:8.1f} us "
              f"(floor {floor:6.1f} us, {floor / us:.2f}), err {err:.1e}", flush=True)
        if profiles is not None and strategy == "fused4_dsv4":
            profiles.append(profile_step(layer, x, pos, caches, context,
                                         f"{model} {layer_type} M={m} {strategy}"))
        del layer, caches, graph
        torch.cuda.empty_cache()
    add_speedups(rows)
    return rows


def add_speedups(rows: list[dict[str, Any]]) -> None:
    """``speedup_vs_best_upstream`` of every row: the fastest upstream strategy's time at the
    same (model, layer, M) over this row's."""
    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        return r["model"], r["layer_type"], r["M"]

    best: dict[tuple[Any, ...], float] = {}
    for r in rows:
        if r["strategy"] not in OURS:
            best[key(r)] = min(best.get(key(r), float("inf")), r["us"])
    for r in rows:
        r["speedup_vs_best_upstream"] = best[key(r)] / r["us"]


def markdown_table(rows: list[dict[str, Any]]) -> list[str]:
    """One line per (model, layer, M): us per strategy and our two variants' speedups."""
    lines = ["| model | layer | M | " + " | ".join(STRATEGIES)
             + " | fused4_dsv4 vs best upstream | cuda_plan vs best upstream |",
             "|---|---|---|" + "---|" * (len(STRATEGIES) + 2)]
    keys = sorted({(r["model"], r["layer_type"], r["M"]) for r in rows},
                  key=lambda k: (k[0], k[1], k[2]))
    for k in keys:
        cells = {r["strategy"]: r for r in rows if (r["model"], r["layer_type"], r["M"]) == k}
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | " + " | ".join(
            f"{cells[s]['us']:.1f}" for s in STRATEGIES) + " | " + " | ".join(
            f"{cells[s]['speedup_vs_best_upstream']:.2f}x" for s in OURS) + " |")
    return lines


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path,
                    help="folder for the JSON and markdown results")
    ap.add_argument("--models", default="flash,pro",
                    help="comma-separated model presets (default flash,pro)")
    ap.add_argument("--layers", default="C4", help="comma-separated layer types (default C4)")
    ap.add_argument("--ms", default="1,4,16,64",
                    help="comma-separated sequences per decode step (default 1,4,16,64)")
    ap.add_argument("--context", type=int, default=1024,
                    help="cached tokens per sequence (default 1024)")
    ap.add_argument("--reps", type=int, default=7, help="timed repetitions (median)")
    ap.add_argument("--pooled", action="store_true",
                    help="the M sequences' caches in one pool (the batched decode path)")
    ap.add_argument("--profile", action="store_true",
                    help="also write decode_step_profile.md: the kernel table of one step")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor parallelism over N GPUs (NCCL, one process a GPU, spawned here "
                    "or started by torchrun): the cuda_plan step per rank, with and without "
                    "its all-reduce (dsv4.bench.decode_step_tp)")
    ap.add_argument("--dry-run", action="store_true",
                    help="with --tp: run the TP step on the CPU over gloo, eager, tiny preset "
                    "(checks the plumbing; the times mean nothing)")
    args = ap.parse_args(argv)
    if args.tp != 1 or args.dry_run or "WORLD_SIZE" in os.environ:
        from dsv4.bench.decode_step_tp import main_tp

        return main_tp(args)
    dev = torch.device("cuda")
    args.out.mkdir(parents=True, exist_ok=True)
    bw = measure_copy_bw(dev)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    t0 = time.time()
    rows: list[dict[str, Any]] = []
    profiles: list[str] | None = [] if args.profile else None
    for model in args.models.split(","):
        cfg = DSV4Config.preset(model)
        for layer_type in args.layers.split(","):
            weights = random_layer_weights(cfg, cfg.layer_of_ratio(LAYER_RATIO[layer_type]))
            for m in (int(v) for v in args.ms.split(",")):
                rows += run_case(cfg, model, layer_type, m, args.context, dev, bw, args.reps,
                                 weights, profiles, args.pooled)
                partial = {"rows": rows, "copy_bw": bw}
                (args.out / "decode_step.partial.json").write_text(json.dumps(partial))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_step.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
         "copy_bw": bw, "seconds": time.time() - t0, "rows": rows}, indent=1))
    lines = markdown_table(rows)
    (args.out / "decode_step.md").write_text(
        "Full-layer decode step, CUDA-graph replay, us (context "
        f"{args.context} tokens per sequence, "
        f"{'one cache pool' if args.pooled else 'a cache per sequence'})\n\n"
        + "\n".join(lines) + "\n")
    print("\n".join(lines))
    if profiles:
        (args.out / "decode_step_profile.md").write_text("\n".join(profiles))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
