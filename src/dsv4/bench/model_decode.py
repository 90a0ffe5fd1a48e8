"""A model's attention stack decoding: eager calls against the decode runner's CUDA graphs.

The layers of a preset (``flash``, ``pro``) in its real schedule (all of them, or the first
``--layers N``), each on the ``cuda`` platform as it ships with the serving configuration
(``fp8_ds_mla`` / ``fp8`` caches, ``act_quant``, ``attention_backend=auto``), random weights
(one set per layer type, shared), M sequences of synthetic history of ``context`` tokens in one
pool per layer. A decode step is the stack with residuals, ``x = x + layer(x)``, one token per
sequence. Four ways of running it, each timed over ``--steps`` consecutive steps (wall time,
the host's work included, as a serving loop pays it; the first step's host work, with nothing
queued on the GPU to hide it, is charged once per timing, hence 40 steps by default), with the
objects alive before the timings frozen as a serving loop freezes them after loading (each
row's ``gc``: the collector's runs inside the timings, :mod:`dsv4.bench.gc_pauses`; per timing
its time a step, the host's time a step and its longest call, ``reps_us_per_step``,
``reps_host_us_per_step`` and ``reps_longest_call_us``: whether the host or the GPU bound a
timing, and whether one call stalled; the runner's also ``reps_captures``, the buckets it
captured inside each timing):

* ``eager_layers``: each layer called as the README's first example does,
  ``layer(x, positions, caches)`` (each plans its own step), every stage eager;
* ``layer_graphs``: the same calls with the ``cuda`` platform's plain-call step graphs on
  (``step_graph_max_seqs``: each layer's decode step one CUDA-graph replay of its own runner);
* ``eager_plan``: one :class:`~dsv4.cache.plan.StepPlan` per step for all layers
  (``DecodeRunner(mode="eager")``);
* ``runner``: the decode runner, the whole step one CUDA-graph replay
  (:class:`~dsv4.runner.DecodeRunner`; ``--dry-run``: its padded steps, eagerly).

Beside them, in the same run, the single-layer graph row of each layer type (one layer's step
captured by hand, as ``dsv4 bench decode-step`` does) and their sum over the schedule: the
runner's goal is at most 1.10x that sum. The rows replay one layer back to back, so part of
its weights stays in the L2 from one replay to the next, which no layer of a stack finds; the
same rows timed with the L2 flushed before each replay (``--cold-l2`` of ``decode-step``) are
summed beside them. The runner's last graph is also replayed alone, back to back
(``runner replay``): the step's GPU time without its host work, so ``runner / replay`` says how
much of the runner's step the host adds and ``replay / cold-L2 sum`` how much the stacked graph
costs beyond its layers; of that, the stack's own code between its layers (the residual adds,
captured alone: ``residual adds``) is no layer's. Before timing, the runner's step is checked
against the eager plan's on the same caches (one step, taken back with ``truncate``).

    dsv4 bench model-decode --out DIR [--models flash,pro] [--layers N] [--ms 1,16,64]
        [--contexts 512,16384,65536]

``--dry-run`` runs the tiny preset on the CPU (eager and padded runner steps; the times mean
nothing) to check the plumbing without a GPU. ``--profile`` also writes the kernel tables of one
replay of the runner's graph and of each layer type's single-layer graph
(``model_decode_profile.md``): where the graph's time beyond its layers goes.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from dsv4.bench.args import (
    SERVING_CACHES,
    add_out_options,
    check_out,
    choice_list,
    int_list,
    plan_changes,
    pyplot,
    require_cuda,
)
from dsv4.bench.decode_step import l2_scrub_buffer, replay_table, replay_times
from dsv4.bench.gc_pauses import GcPauses, frozen
from dsv4.bench.synthetic_cache import fill_history
from dsv4.cache.plan import StepPlan
from dsv4.config import PRESET_NAMES, DSV4Config
from dsv4.passes import process_weights_after_loading
from dsv4.platforms import build_attention
from dsv4.platforms.cuda import CudaAttention
from dsv4.runner import DEFAULT_BUCKETS, DecodeRunner, capture_graph, captured_step
from dsv4.testing.random_weights import random_layer_weights
from dsv4.usage import OneLineArgumentParser, UsageError, check_at_least

MODES = ("eager_layers", "layer_graphs", "eager_plan", "runner")
RESULTS = ("model_decode.json", "model_decode.md", "model_decode.png",
           "model_decode_profile.md")
TYPE_NAMES = {0: "SWA", 4: "C4", 128: "C128"}


def serving_config(cfg: DSV4Config) -> DSV4Config:
    """The configuration the rows run: the serving caches and activation quantisation."""
    return cfg.replace(**SERVING_CACHES, act_quant=True, attention_backend="auto")


def build_stack(cfg: DSV4Config, n_layers: int, device: torch.device, platform: str,
                changes: dict[str, int] | None = None) -> list[Any]:
    """The first ``n_layers`` attention layers of ``cfg``'s schedule with random weights (one
    set per layer type), post-load passes applied; ``changes``: the ``cuda`` plan's fields
    instead of ``cuda_plan.json``'s (``--plan``)."""
    weights: dict[int, dict[str, torch.Tensor]] = {}
    layers = []
    kw: dict[str, Any] = {}
    if changes:
        from dsv4.platforms.cuda import CudaPlan

        kw["plan"] = CudaPlan.load(cfg.hidden_size).overridden(changes)
    for i in range(n_layers):
        r = cfg.compress_ratio(i)
        if r not in weights:
            weights[r] = random_layer_weights(cfg, i, seed=r)
        layer = build_attention(cfg, i, platform=platform, device=device, dtype=torch.bfloat16,
                                **kw)
        layer.load_weights(weights[r].items())
        process_weights_after_loading(layer)
        layers.append(layer)
    return layers


def stack_step(layers: list[Any]) -> Any:
    def run(plan: StepPlan, x: torch.Tensor) -> torch.Tensor:
        for layer in layers:
            x = x + layer(x, plan=plan)
        return x
    return run


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step: Any, steps: int, device: torch.device) -> tuple[float, float, float]:
    """Over ``steps`` consecutive calls of ``step()``, in us: the wall time a call (synchronised
    at both ends), the host's time a call (up to the last call's return, before the final
    sync: near the wall time, the host bounds the loop; well below it, the GPU does), and the
    longest call (a call that blocked, or a stall)."""
    _sync(device)
    t0 = last = time.perf_counter()
    longest = 0.0
    for _ in range(steps):
        step()
        now = time.perf_counter()
        longest = max(longest, now - last)
        last = now
    _sync(device)
    return ((time.perf_counter() - t0) * 1e6 / steps, (last - t0) * 1e6 / steps,
            longest * 1e6)


def single_layer_graph_us(layer: Any, caches: list[Any], x: torch.Tensor, reps: int,
                          scrub: torch.Tensor, profile_title: str | None = None
                          ) -> tuple[float, float, str | None]:
    """us per replay of one layer's decode step captured by hand (the decode-step bench's row),
    one capture timed twice: replays back to back, and each alone after ``scrub`` flushed the
    L2 (as ``--cold-l2`` times them); the caches are left as they were. With
    ``profile_title``, also the profiler's kernel table of one replay (else None)."""
    with captured_step(layer, caches, x) as (graph, _):
        warm = replay_times(graph, reps, None)
        cold = replay_times(graph, reps, scrub)
        table = None if profile_title is None else replay_table(graph, profile_title)
    return statistics.median(warm), statistics.median(cold), table


def residual_adds_us(x: torch.Tensor, n_layers: int, reps: int) -> float:
    """us per replay of the stack step's own code between its layers (:func:`stack_step`'s
    ``x + layer(...)``, ``n_layers`` adds of x's shape) captured alone as a graph: the part of
    the runner's replay that no single-layer row holds."""
    y = x.clone()

    def adds() -> torch.Tensor:
        z = x
        for _ in range(n_layers):
            z = z + y
        return z

    side = torch.cuda.Stream(x.device)
    side.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(side):
        adds()
    torch.cuda.current_stream(x.device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with capture_graph(graph):
        adds()
    return statistics.median(replay_times(graph, reps, None))


def run_case(model: str, cfg: DSV4Config, layers: list[Any], m: int, context: int,
             steps: int, reps: int, device: torch.device, graphs: bool,
             profiles: list[str] | None = None) -> dict[str, Any]:
    """One (model, M, context) row; ``profiles`` (a GPU run): appends the kernel tables of one
    replay of the runner's graph and of each layer type's single-layer graph."""
    pools = [layer.new_cache_pool(m, context + 5 * steps * reps + 64) for layer in layers]
    seqs = [[p.add_sequence() for p in pools] for _ in range(m)]
    for k in range(len(layers)):
        fill_history([s[k] for s in seqs], context, seed=k)
    gen = torch.Generator().manual_seed(0)
    x = (0.1 * torch.randn(m, cfg.hidden_size, generator=gen)).to(device, torch.bfloat16)
    fn = stack_step(layers)
    runner = DecodeRunner(fn, mode="graphs" if graphs else "padded")
    eager = DecodeRunner(fn, mode="eager")

    def back() -> None:  # one step back (what truncate always allows)
        for seq in seqs:
            for c in seq:
                c.truncate(context)

    # the bucket's graph captured (its first step runs eagerly), then a replay against the
    # eager plan's step on the same caches
    runner(seqs, x)
    back()
    y_runner = runner(seqs, x)
    back()
    y_eager = eager(seqs, x)
    err = float((y_runner.double() - y_eager.double()).norm() / y_eager.double().norm())
    if err > 2e-2:
        raise RuntimeError(f"{model} M={m} ctx={context}: runner vs eager rel err {err:.2e}")

    def plain_calls() -> None:
        pos = torch.tensor([s[0].length for s in seqs])
        y = x
        for k, layer in enumerate(layers):
            y = y + layer(y, pos, [s[k] for s in seqs])

    def step_graphs(most: int) -> None:
        """Plain calls' step graphs on (each layer's runner, up to ``most`` sequences) or off
        (0); the cuda platform's layers only."""
        for layer in layers:
            if isinstance(layer, CudaAttention):
                layer.use_step_graphs(most)

    row: dict[str, Any] = {"model": model, "layers": len(layers), "M": m, "context": context,
                           "runner_mode": runner.mode, "rel_err_runner_vs_eager": err}
    timed = [("eager_layers", plain_calls), ("eager_plan", lambda: eager(seqs, x)),
             ("runner", lambda: runner(seqs, x))]
    if graphs:
        timed.insert(1, ("layer_graphs", plain_calls))
    for mode, step in timed:
        step_graphs(max(DEFAULT_BUCKETS) if mode == "layer_graphs" else 0)
        # one step first, taken back: it captures the graphs of the buckets the timed steps
        # use (the runner's at the caches' present widths, which the other modes' steps have
        # moved on; each layer's own), a capture a serving loop pays once per bucket
        before = [[c.length for c in seq] for seq in seqs]
        step()
        for seq, lengths in zip(seqs, before, strict=True):
            for c, n in zip(seq, lengths, strict=True):
                c.truncate(n)
        timed_reps, captures = [], []
        with frozen(), GcPauses() as pauses:  # as a serving loop runs (gc_pauses.py)
            for _ in range(reps):
                before_captures = runner.stats["captures"]
                timed_reps.append(time_steps(step, steps, device))
                captures.append(runner.stats["captures"] - before_captures)
        times = [t for t, _, _ in timed_reps]
        us = statistics.median(times)
        row[mode] = {"us_per_step": us, "us_per_layer": us / len(layers),
                     "tokens_per_s": m / us * 1e6, "reps_us_per_step": times,
                     "reps_host_us_per_step": [h for _, h, _ in timed_reps],
                     "reps_longest_call_us": [c for _, _, c in timed_reps],
                     "gc": pauses.summary()}
        if mode == "runner":  # a bucket captured inside a timing (a new width or batch size)
            row[mode]["reps_captures"] = captures
    row["runner_stats"] = dict(runner.stats)
    if runner.last_graph is not None:  # the last step's GPU work again, without the host's
        us = statistics.median(replay_times(runner.last_graph, reps, None))
        row["runner_replay"] = {"us_per_step": us, "us_per_layer": us / len(layers),
                                "tokens_per_s": m / us * 1e6}
        row["runner_vs_replay"] = row["runner"]["us_per_step"] / us
        if profiles is not None:
            profiles.append(replay_table(
                runner.last_graph, f"{model}, {len(layers)} layers, ctx={context}, M={m}: the "
                "runner's graph"))
    for layer in layers:  # the shipped plan again; the layers' own graphs dropped
        if isinstance(layer, CudaAttention):
            layer.use_cuda_graphs(True)
    if graphs:  # the single-layer graph rows of each type, at the caches' present length
        singles: dict[str, float] = {}
        cold: dict[str, float] = {}
        counts: dict[str, int] = {}
        scrub = l2_scrub_buffer(device)
        for k, layer in enumerate(layers):
            name = TYPE_NAMES[layer.compress_ratio]
            counts[name] = counts.get(name, 0) + 1
            if name not in singles:
                title = (None if profiles is None else
                         f"{model} {name}, ctx={context}, M={m}: its single-layer graph")
                singles[name], cold[name], table = single_layer_graph_us(
                    layer, [s[k] for s in seqs], x, reps, scrub, title)
                if table is not None and profiles is not None:
                    profiles.append(table)
        del scrub
        total = sum(singles[n] * c for n, c in counts.items())
        total_cold = sum(cold[n] * c for n, c in counts.items())
        row["single_layer_graph_us"] = singles
        row["single_layer_graph_cold_l2_us"] = cold
        row["layer_counts"] = counts
        row["sum_of_single_layer_graphs_us"] = total
        row["sum_of_single_layer_graphs_cold_l2_us"] = total_cold
        for mode in ("runner", "layer_graphs", "eager_layers"):
            row[f"{mode}_vs_sum_of_single_layers"] = row[mode]["us_per_step"] / total
        row["runner_vs_sum_of_cold_l2_single_layers"] = row["runner"]["us_per_step"] / total_cold
        if "runner_replay" in row:
            row["replay_vs_sum_of_cold_l2_single_layers"] = (
                row["runner_replay"]["us_per_step"] / total_cold)
            adds = residual_adds_us(x, len(layers), reps)
            row["residual_adds_us"] = adds
            row["replay_less_adds_vs_sum_of_cold_l2_single_layers"] = (
                (row["runner_replay"]["us_per_step"] - adds) / total_cold)
        row["eager_plan_vs_runner"] = (row["eager_plan"]["us_per_step"]
                                        / row["runner"]["us_per_step"])
    for seq in seqs:
        for c in seq:
            c.free()
    return row


def markdown(rows: list[dict[str, Any]]) -> list[str]:
    head = ["model", "layers", "ctx", "M"] + [f"{m} us/step (us/layer)" for m in MODES] + [
        "runner tokens/s", "sum of 1-layer graphs us", "runner / sum", "layer_graphs / sum",
        "eager_layers / sum", "eager_plan / runner", "sum of cold-L2 1-layer graphs us",
        "runner / cold-L2 sum", "runner replay us/step (us/layer)", "runner / replay",
        "replay / cold-L2 sum", "residual adds us", "(replay - adds) / cold-L2 sum"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ctx = f"{r['context'] // 1024}K" if r["context"] >= 1024 else str(r["context"])
        cells = [r["model"], str(r["layers"]), ctx, str(r["M"])]
        cells += [f"{r[m]['us_per_step']:.0f} ({r[m]['us_per_layer']:.0f})" if m in r else "-"
                  for m in MODES]
        cells.append(f"{r['runner']['tokens_per_s']:.0f}")
        s = r.get("sum_of_single_layer_graphs_us")
        cells.append("-" if s is None else f"{s:.0f}")
        for mode in ("runner", "layer_graphs", "eager_layers"):
            v = r.get(f"{mode}_vs_sum_of_single_layers")
            cells.append("-" if v is None else f"{v:.2f}x")
        v = r.get("eager_plan_vs_runner")
        cells.append("-" if v is None else f"{v:.1f}x")
        s = r.get("sum_of_single_layer_graphs_cold_l2_us")
        cells.append("-" if s is None else f"{s:.0f}")
        v = r.get("runner_vs_sum_of_cold_l2_single_layers")
        cells.append("-" if v is None else f"{v:.2f}x")
        rep = r.get("runner_replay")
        cells.append("-" if rep is None else
                     f"{rep['us_per_step']:.0f} ({rep['us_per_layer']:.0f})")
        for key in ("runner_vs_replay", "replay_vs_sum_of_cold_l2_single_layers"):
            v = r.get(key)
            cells.append("-" if v is None else f"{v:.2f}x")
        v = r.get("residual_adds_us")
        cells.append("-" if v is None else f"{v:.1f}")
        v = r.get("replay_less_adds_vs_sum_of_cold_l2_single_layers")
        cells.append("-" if v is None else f"{v:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot("model-decode", path)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(max(7, 0.9 * len(rows)), 4.5))
    width = 0.8 / (len(MODES) + 1)
    for j, mode in enumerate(MODES):
        ax.bar([i + j * width for i in range(len(rows))],
               [r[mode]["us_per_layer"] if mode in r else 0 for r in rows], width,
               label=f"runner ({rows[0]['runner_mode']})" if mode == "runner" else mode)
    ax.bar([i + len(MODES) * width for i in range(len(rows))],
           [r.get("sum_of_single_layer_graphs_us", 0) / r["layers"] for r in rows], width,
           label="single-layer graphs (sum / layers)")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))])
    ax.set_xticklabels([f"{r['model']} x{r['layers']}\nctx {r['context']} M={r['M']}"
                        for r in rows], fontsize=7)
    ax.set_ylabel("us per layer and decode step")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.set_title("DSV4 attention stack decode step: eager vs the decode runner")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parser(prog: str | None = None) -> OneLineArgumentParser:
    ap = OneLineArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    add_out_options(ap, "model_decode.json, .md and .png")
    ap.add_argument("--models", default=["flash", "pro"],
                    type=choice_list(PRESET_NAMES, "model preset"),
                    help="comma-separated model presets (default flash,pro)")
    ap.add_argument("--layers", type=int, default=None,
                    help="the first N layers of each model's schedule (default: all)")
    ap.add_argument("--ms", default=[1, 16, 64], type=int_list,
                    help="comma-separated sequences per decode step (default 1,16,64)")
    ap.add_argument("--contexts", default=None, type=int_list,
                    help="comma-separated cached tokens per sequence (default 512,16384,65536; "
                    "with --dry-run 40,300)")
    ap.add_argument("--steps", type=int, default=40,
                    help="consecutive steps per timing (default 40)")
    ap.add_argument("--reps", type=int, default=5,
                    help="timings per mode, median taken (default 5)")
    ap.add_argument("--profile", action="store_true",
                    help="also write model_decode_profile.md: the kernel tables of one replay "
                    "of the runner's graph and of each layer type's single-layer graph (GPU)")
    ap.add_argument("--plan", type=plan_changes(), default={},
                    help="FIELD=N[,FIELD=N]: the cuda platform's plan entries every layer takes "
                    "instead of cuda_plan.json's (e.g. fp8_gemm_max_tokens=256; "
                    "default: none, the shipped table; not with --dry-run)")
    ap.add_argument("--dry-run", action="store_true",
                    help="the tiny preset on the CPU, eager and padded runner steps (checks the "
                    "plumbing; the times mean nothing)")
    return ap


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = parser(prog)
    args = ap.parse_args(argv)
    with ap.usage_errors():
        for name in ("--steps", "--reps"):
            check_at_least(name, getattr(args, name.lstrip("-")), 1)
        if args.layers is not None:
            check_at_least("--layers", args.layers, 1)
        if args.profile and args.dry_run:
            raise UsageError("--profile times kernels in CUDA graphs: a GPU run, not --dry-run")
        if args.plan and args.dry_run:
            raise UsageError("--plan sets the cuda platform's plan: a GPU run, not --dry-run")
        check_out(args.out, RESULTS, args.overwrite)
    contexts = args.contexts or ([40, 300] if args.dry_run else [512, 16384, 65536])
    if args.dry_run:
        device, platform, models = torch.device("cpu"), "reference", ["tiny"]
        limit = DSV4Config.preset("tiny").max_position_embeddings
        with ap.usage_errors():
            if max(contexts) + 4 * args.steps * args.reps + 64 > limit:
                raise UsageError(f"--contexts {max(contexts)}: with --dry-run (the tiny "
                                 f"preset) at most {limit - 4 * args.steps * args.reps - 64}")
    else:
        require_cuda("model-decode")
        device, platform, models = torch.device("cuda"), "cuda", args.models
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    rows: list[dict[str, Any]] = []
    profiles: list[str] | None = [] if args.profile else None
    for model in models:
        cfg = serving_config(DSV4Config.preset(model))
        if args.dry_run:
            cfg = cfg.replace(kv_cache_dtype="auto", index_cache_dtype="auto", act_quant=False)
        n = cfg.num_hidden_layers if args.layers is None else min(args.layers,
                                                                  cfg.num_hidden_layers)
        layers = build_stack(cfg, n, device, platform, args.plan)
        for context in contexts:
            for m in args.ms:
                row = run_case(model, cfg, layers, m, context, args.steps, args.reps, device,
                               graphs=not args.dry_run, profiles=profiles)
                rows.append(row)
                if profiles:  # kept as it grows: a run cut short keeps what it measured
                    (args.out / "model_decode_profile.md").write_text("\n".join(profiles))
                print(markdown([row])[-1], flush=True)
        del layers
        if device.type == "cuda":
            torch.cuda.empty_cache()
    info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "seconds": time.time() - t0, "argv": argv,
            "dry_run": args.dry_run, "plan_changes": args.plan}
    (args.out / "model_decode.json").write_text(json.dumps({**info, "rows": rows}, indent=1))
    lines = markdown(rows)
    (args.out / "model_decode.md").write_text(
        f"Attention-stack decode step on {info['device']}: us per step (us per layer), wall "
        f"time of {args.steps} consecutive steps, median of {args.reps}"
        + "".join(f"; plan {k} = {v} (--plan)" for k, v in args.plan.items()) + "\n\n"
        + "\n".join(lines) + "\n")
    plot(rows, args.out / "model_decode.png")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
