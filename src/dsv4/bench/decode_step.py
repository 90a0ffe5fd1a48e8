"""Full-layer decode step per strategy, CUDA-graph replay.

One DSV4 attention layer (Flash or Pro dims, C4 / C128 / SWA, fp8 weights with block scales,
random), M sequences each holding ``context`` tokens, one decode token per sequence per step. The
whole step (input projections, norms, q / kv paths, cache writes, compressor, indexer top-k,
sparse MQA, output projection) is captured once as a CUDA graph and replayed. The strategies
(:data:`STRATEGIES`, each a :class:`Strategy` whose defaults are the ``default`` row):

* ``default``          the ``cuda`` platform as it ships, in the serving configuration (the
                       one a FlashMLA-backed engine runs): the plan's input stage, fp8
                       weight-streaming GEMMs, the step kernels, ``attention_backend=auto``
                       (FlashMLA where installed, our kernel for the plan's short steps), an
                       ``fp8_ds_mla`` cache, fp8 indexer keys, ``act_quant`` (the official
                       fp8 activations, docs/spec.md §6.3), programmatic dependent launch
                       (:mod:`dsv4.kernels.launch`)
* ``triton``           the same with dsv4's sparse-MQA kernel at every step
* ``flashmla``         the same with FlashMLA's sparse fp8 decode kernel at every step (rows
                       skipped, with the reason, where FlashMLA is not installed or the shape is
                       not one it runs)
* ``no_step_kernels``  the same with the step kernels off (the base path's PyTorch ops for the
                       norms, RoPE, cache writes, flat rows, compressor and indexer)
* ``upstream``         upstream CUDA's plan on the base path: the input GEMMs on aux streams, no
                       fusion, fp8 linears dequantised per call, the torch attention, a bf16
                       kv cache (fp8 indexer keys, as every strategy)
* ``rocm_style``       upstream ROCm with the compressor fusion PR: the input GEMMs one after
                       another, the two compressor GEMMs fused, otherwise as ``upstream``

``--cold-l2`` times each replay alone after reading a buffer of twice the L2 size (so the
step finds none of the last replay's lines in L2, as a model's next layer would not find this
layer's weights; the default replays 20 times back to back, where a weight line read late in
one replay can still be in L2 for the next).

Before timing, each strategy's replayed output is checked against its own eager step (bitwise)
and against the first strategy's (rel. error <= 2e-2; the caches hold the same rows in every
format, see :mod:`dsv4.bench.synthetic_cache`). ``floor_us`` = bytes of all the layer's weights
plus the cache bytes the step reads (window rows and selected entries in the strategy's kv
format, and every visible indexer key), over the copy bandwidth measured in the same run; at
contexts where the indexer would take every visible entry (the step skips it) without the
indexer's ``wq_b`` and keys. ``launches`` = GPU operations (kernels, copies, memsets) of one eager
step of the same code, counted with the profiler (a graph replays the same operations).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dsv4.bench.args import (
    LAYER_RATIO,
    add_out_options,
    check_out,
    choice_list,
    int_list,
    plan_changes,
    pyplot,
    require_cuda,
)
from dsv4.bench.decode_step_tp import check_tp_args, main_tp
from dsv4.bench.input_proj import measure_copy_bw
from dsv4.bench.synthetic_cache import fill_history
from dsv4.bench.timeline import device_spans, timeline_markdown, trace_of
from dsv4.config import PRESET_NAMES, ConfigError, DSV4Config
from dsv4.kernels.launch import (
    programmatic_launch,
    programmatic_launch_enabled,
    set_programmatic_launch,
)
from dsv4.passes import process_weights_after_loading
from dsv4.platforms.cuda import CudaAttention, CudaPlan
from dsv4.runner import captured_step
from dsv4.testing.random_weights import random_layer_weights
from dsv4.usage import OneLineArgumentParser, UsageError, check_at_least

_BOTH_PASSES = ("compressor_fusion", "fuse_input_projections")


@dataclass(frozen=True)
class Strategy:
    """How one strategy runs the step; the defaults are the ``cuda`` platform as it ships, with
    the serving configuration's ``fp8_ds_mla`` cache, fp8 indexer keys and ``act_quant``."""

    attention_backend: str = "auto"
    kv_cache_dtype: str = "fp8_ds_mla"
    index_cache_dtype: str = "fp8"
    """The indexer keys' store (every strategy: the serving configuration's, as
    :func:`dsv4.bench.model_decode.serving_config`; the selection, and so the output, is then
    the same in every strategy)."""
    act_quant: bool = True
    fp8_gemms: bool = True
    """The fp8 weight-streaming GEMMs (off: the base path dequantises each fp8 weight)."""
    step_kernels: bool = True
    """The step kernels (off: the base path's PyTorch ops), ``CudaAttention.use_step_kernels``."""
    input_stage: str = "plan"
    """``plan``: the one-launch input projections up to the plan's token count, the stream plan
    above; ``streams``: upstream CUDA's four GEMMs, three of them on aux streams; ``serial``:
    the four GEMMs one after another."""
    passes: tuple[str, ...] = _BOTH_PASSES
    pdl: bool = True
    """Programmatic dependent launch for our kernels (the library's default)."""


_UPSTREAM = Strategy(attention_backend="torch", kv_cache_dtype="bf16", fp8_gemms=False,
                     step_kernels=False, input_stage="streams", passes=(), pdl=False)
STRATEGY_SPECS: dict[str, Strategy] = {
    "default": Strategy(),
    "triton": Strategy(attention_backend="triton"),
    "flashmla": Strategy(attention_backend="flashmla"),
    "no_step_kernels": Strategy(step_kernels=False),
    "upstream": _UPSTREAM,
    "rocm_style": dataclasses.replace(_UPSTREAM, input_stage="serial",
                                      passes=("compressor_fusion",)),
}
STRATEGIES = tuple(STRATEGY_SPECS)
"""Every strategy, the default set; the first is the reference the others are checked
against."""
UPSTREAM = ("upstream", "rocm_style")
OURS = tuple(s for s in STRATEGIES if s not in UPSTREAM)


def build(cfg: DSV4Config, layer_id: int, strategy: str, weights: dict[str, torch.Tensor],
          dev: torch.device, changes: dict[str, int] | None = None) -> CudaAttention:
    """The strategy's layer; ``changes``: plan fields instead of ``cuda_plan.json``'s
    (``--plan``, :func:`dsv4.bench.args.plan_changes`)."""
    spec = STRATEGY_SPECS[strategy]
    c = cfg.replace(multi_stream_token_threshold=0 if spec.input_stage == "serial" else 1024,
                    attention_backend=spec.attention_backend,
                    kv_cache_dtype=spec.kv_cache_dtype,
                    index_cache_dtype=spec.index_cache_dtype, act_quant=spec.act_quant)
    recorded = CudaPlan.load(cfg.hidden_size)
    # the whole step is one graph (captured by hand, and counted eagerly: no graphs of the
    # layer's own); "auto" attention takes the plan's per-step choice
    plan = dataclasses.replace(recorded.overridden(changes or {}), graph_max_tokens=0,
                               step_graph_max_seqs=0)
    if spec.input_stage != "plan":
        plan = dataclasses.replace(plan, fused_max_tokens=0)
    layer = CudaAttention(c, layer_id, device=dev, dtype=torch.bfloat16, plan=plan)
    layer.use_fp8_gemms(spec.fp8_gemms)
    layer.use_step_kernels(spec.step_kernels)
    layer.load_weights(weights.items())
    process_weights_after_loading(layer, passes=list(spec.passes))
    return layer


def step_bytes(layer: CudaAttention, m: int, context: int) -> int:
    """Weights plus the cache bytes one decode step of M sequences at ``context`` reads, in the
    layer's cache formats (kv rows: window + selected entries; every visible indexer key where
    the indexer runs - where it would take every visible entry the step skips it, so neither
    the keys nor the indexer's ``wq_b`` count: ``_indexer_decides``)."""
    w = sum(p.numel() * p.element_size() for p in layer.parameters())
    cfg = layer.cfg
    pool = layer.new_cache_pool(1, 64)
    kv_row = pool.kv_format.row_bytes()
    keys = min(context + 1, cfg.sliding_window)
    r = layer.compress_ratio
    if r == 4:
        visible = (context + 1) // 4
        keys += min(cfg.index_topk, visible)
        assert pool.index_format is not None and layer.indexer is not None
        if layer.indexer.has_choice(visible):
            w += m * visible * pool.index_format.row_bytes()
        else:
            w -= sum(p.numel() * p.element_size() for p in layer.indexer.wq_b.parameters())
    elif r == 128:
        keys += (context + 1) // 128
    return w + m * keys * kv_row


def _profile_one_step(layer: Any, x: torch.Tensor, pos: torch.Tensor, caches: list[Any],
                      lens: list[int] | None, activities: list[Any],
                      with_stack: bool = False) -> Any:
    """The profiler of one eager step of ``layer`` (``activities``, ``with_stack`` as
    ``torch.profiler.profile`` takes them); the step's writes are undone: each cache is
    truncated back to its length before it."""
    from torch.profiler import profile

    before = [c.length for c in caches]
    with profile(activities=activities, with_stack=with_stack) as prof:
        layer(x, pos, caches, lens)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    for c, n in zip(caches, before, strict=True):
        c.truncate(n)
    return prof


def count_launches(layer: CudaAttention, x: torch.Tensor, pos: torch.Tensor,
                   caches: list[Any], title: str = "",
                   lens: list[int] | None = None) -> tuple[int, str]:
    """(GPU operations of one eager decode step, the profiler's kernel table of it). The step's
    writes are undone (each cache truncated back to its length before it). Counted as a layer
    called on its own: with its own step metadata upload (a model's step plan uploads it once
    for all layers)."""
    from torch.profiler import ProfilerActivity

    events = _profile_one_step(layer, x, pos, caches, lens, [ProfilerActivity.CUDA]
                               ).key_averages()
    times = [(e.count, getattr(e, "device_time_total", 0.0)) for e in events]
    launches = sum(n for n, t in times if t > 0)
    total = sum(t for _, t in times)
    table = events.table(sort_by="device_time_total", row_limit=30, max_name_column_width=70)
    return launches, (f"## {title}: {launches} GPU operations, {total:.0f} us of kernel time in "
                      f"one eager step\n\n{table}\n")


def launch_origins(layer: Any, x: torch.Tensor, pos: torch.Tensor, caches: list[Any],
                   title: str = "", lens: list[int] | None = None) -> str:
    """Where one eager step's GPU work is launched from: the profiler's operators (PyTorch's
    own kernels, copies and fills among them) with their device time, grouped by the Python
    stack that called them (5 frames) - what names the small copies a kernel table only calls
    ``direct_copy``. The step's writes are undone."""
    from torch.profiler import ProfilerActivity

    acts = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(ProfilerActivity.CUDA)
    events = _profile_one_step(layer, x, pos, caches, lens, acts, with_stack=True
                               ).key_averages(group_by_stack_n=5)
    sort = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    table = events.table(sort_by=sort, row_limit=25, max_name_column_width=40,
                         max_src_column_width=110)
    return f"## {title}: where the GPU operations come from (5 frames)\n\n{table}\n"


def replay_table(graph: Any, title: str, timeline: bool = False) -> str:
    """The profiler's kernel table of one replay of ``graph`` (kernels inside a graph are
    timed as they ran there: PDL's overlap shows, unlike in an eager step under the
    profiler); ``timeline``: then the same replay's timeline (:mod:`dsv4.bench.timeline`:
    its span, idle gaps and time beside another stream, operation by operation)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    events = prof.key_averages()
    total = sum(getattr(e, "device_time_total", 0.0) for e in events)
    table = events.table(sort_by="device_time_total", row_limit=30, max_name_column_width=70)
    text = f"## {title}: {total:.0f} us of kernel time in one graph replay\n\n{table}\n"
    if timeline:
        text += "\n" + timeline_markdown(device_spans(trace_of(prof)), title)
    return text


def run_case(cfg: DSV4Config, model: str, layer_type: str, m: int, context: int,
             dev: torch.device, bw: float, reps: int, weights: dict[str, torch.Tensor],
             profiles: list[str] | None = None, pooled: bool = True,
             strategies: tuple[str, ...] = STRATEGIES, fill: str = "synthetic",
             cold_l2: bool = False, draft_tokens: int = 0, stagger: bool = False,
             changes: dict[str, int] | None = None) -> list[dict[str, Any]]:
    with programmatic_launch(programmatic_launch_enabled()):  # restored after the rows
        return _run_case(cfg, model, layer_type, m, context, dev, bw, reps, weights, profiles,
                         pooled, strategies, fill, cold_l2, draft_tokens, stagger, changes)


def l2_scrub_buffer(dev: torch.device) -> torch.Tensor:
    """A buffer of twice the device's L2 size (int32), for :func:`replay_times`."""
    size = 2 * torch.cuda.get_device_properties(dev).L2_cache_size
    return torch.ones(max(size // 4, 1 << 20), dtype=torch.int32, device=dev)


def replay_times(graph: Any, reps: int, scrub: torch.Tensor | None) -> list[float]:
    """us per replay of ``graph``: ``reps`` medians-to-be of 20 replays back to back, or with
    ``scrub`` (:func:`l2_scrub_buffer`) 20 x ``reps`` replays timed one by one, each after a
    read of the whole buffer (the L2 then holds none of the graph's lines)."""
    times = []
    for _ in range(reps):
        if scrub is None:
            s, e = torch.cuda.Event(True), torch.cuda.Event(True)
            s.record()
            for _ in range(20):
                graph.replay()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e) * 1e3 / 20)
            continue
        events = []
        for _ in range(20):
            scrub.sum()
            s, e = torch.cuda.Event(True), torch.cuda.Event(True)
            s.record()
            graph.replay()
            e.record()
            events.append((s, e))
        torch.cuda.synchronize()
        times += [s.elapsed_time(e) * 1e3 for s, e in events]
    return times


def _run_case(cfg: DSV4Config, model: str, layer_type: str, m: int, context: int,
              dev: torch.device, bw: float, reps: int, weights: dict[str, torch.Tensor],
              profiles: list[str] | None, pooled: bool, strategies: tuple[str, ...], fill: str,
              cold_l2: bool = False, draft_tokens: int = 0, stagger: bool = False,
              changes: dict[str, int] | None = None) -> list[dict[str, Any]]:
    scrub = l2_scrub_buffer(dev) if cold_l2 else None
    layer_id = cfg.layer_of_ratio(LAYER_RATIO[layer_type])
    gen = torch.Generator().manual_seed(1)
    n = 1 + draft_tokens  # tokens per sequence: a decode step, or a verify step of k drafts
    x = torch.randn(m * n, cfg.hidden_size, generator=gen).to(dev, torch.bfloat16)
    # sequence i's history: context tokens, or context + i with stagger
    starts = [context + (i if stagger else 0) for i in range(m)]
    prompts = (torch.randn(m, max(starts), cfg.hidden_size, generator=gen).to(
        dev, torch.bfloat16) if fill == "prefill" else None)
    # CPU positions: no sync, capturable
    pos = torch.cat([torch.arange(s, s + n) for s in starts])
    lens = [n] * m
    rows: list[dict[str, Any]] = []
    base: tuple[torch.Tensor, str] | None = None  # the first strategy's output checks the rest
    for strategy in strategies:
        key = {"model": model, "layer_type": layer_type, "M": m, "context": context,
               "draft_tokens": draft_tokens, "strategy": strategy,
               "positions": "staggered" if stagger else "aligned"}
        # PDL as the strategy says for its eager steps, its capture (the graph keeps it) and
        # its launch count
        set_programmatic_launch(STRATEGY_SPECS[strategy].pdl)
        layer = build(cfg, layer_id, strategy, weights, dev, changes)
        # each replay's tokens are taken back (truncate): the pools keep n positions of rollback
        room = max(starts) + 8
        caches = (layer.new_caches(m, room, max_rollback=n) if pooled else
                  [layer.new_cache(room, max_rollback=n) for _ in range(m)])
        if prompts is not None:
            for i, c in enumerate(caches):
                layer(prompts[i, :starts[i]], torch.arange(starts[i]), c)
        else:
            fill_history(caches, starts, seed=7)
        try:
            choice = layer.attention_choice(caches[0].pool).describe()
            eager = layer(x, pos, caches, lens)  # warm-up and the eager answer
        except RuntimeError as ex:
            if STRATEGY_SPECS[strategy].attention_backend != "flashmla":
                raise
            rows.append({**key, "skipped": f"{type(ex).__name__}: {ex}"})
            print(f"{model:>5} {layer_type:>4} ctx={context:>6} M={m:>3} {strategy:>15}: "
                  f"skipped ({ex})", flush=True)
            del layer, caches
            continue
        for c, start in zip(caches, starts, strict=True):
            c.truncate(start)
        # captured over a plan made before the capture (dsv4.runner.captured_step), open over
        # the replays, rolled back after them
        with captured_step(layer, caches, x, lens) as (graph, out):
            graph.replay()
            torch.cuda.synchronize()
            if not torch.equal(out, eager):
                raise RuntimeError(f"{model} {layer_type} M={m} {strategy}: graph replay "
                                   "differs from eager")
            if base is None:
                base = (out.clone(), strategy)
            err = float((out.double() - base[0].double()).norm() / base[0].double().norm())
            if err > 2e-2:
                raise RuntimeError(f"{model} {layer_type} ctx={context} M={m} {strategy}: rel "
                                   f"err {err:.2e} against {base[1]}")
            times = replay_times(graph, reps, scrub)
            case = f"{model} {layer_type} ctx={context} M={m}" + (
                f" k={draft_tokens}" if draft_tokens else "")
            replayed = (replay_table(graph, f"{case} {strategy}", timeline=True)
                        if profiles is not None and strategy in OURS else "")
        us = statistics.median(times)
        nbytes = step_bytes(layer, m, context)
        floor = nbytes / bw * 1e6
        launches, table = count_launches(layer, x, pos, caches, f"{case} {strategy}", lens)
        if profiles is not None and strategy in OURS:
            title = f"{case} {strategy}"
            profiles.append(table)
            profiles.append(replayed)
            profiles.append(launch_origins(layer, x, pos, caches, title, lens))
        rows.append({**key, "weights_dtype": "fp8-block", "mode": "graph",
                     "scope": "decode_step", "kv_cache": layer.cfg.kv_cache_dtype,
                     "index_cache": layer.cfg.index_cache_dtype,
                     "attention": choice, "fp8_gemms": layer.fp8_plan.describe()
                     if layer._fp8_enabled else "off",
                     "caches": "pooled" if pooled else "per-sequence", "fill": fill,
                     "l2": "cold" if cold_l2 else "replays back to back",
                     "plan_changes": dict(changes or {}),
                     "us": us, "bytes": nbytes, "floor_us": floor, "fraction": floor / us,
                     "launches": launches, "rel_err_vs": base[1], "rel_err": err})
        print(f"{model:>5} {layer_type:>4} ctx={context:>6} M={m:>3} k={draft_tokens} "
              f"{strategy:>15}: {us:8.1f} us (floor {floor:6.1f} us, {floor / us:.3f}), "
              f"{launches} launches, err {err:.1e}", flush=True)
        del layer, caches, graph
        torch.cuda.empty_cache()
    add_speedups(rows)
    return rows


def case_key(r: dict[str, Any]) -> tuple[Any, ...]:
    """A row's case: (model, layer type, context, M, drafted tokens per sequence)."""
    return r["model"], r["layer_type"], r.get("context", 0), r["M"], r.get("draft_tokens", 0)


def add_speedups(rows: list[dict[str, Any]]) -> None:
    """``speedup_vs_best_upstream`` of every timed row: the fastest upstream strategy's time at
    the same (model, layer, context, M) over this row's (absent when no upstream row ran)."""
    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        return case_key(r)

    best: dict[tuple[Any, ...], float] = {}
    for r in rows:
        if r["strategy"] in UPSTREAM and "us" in r:
            best[key(r)] = min(best.get(key(r), float("inf")), r["us"])
    for r in rows:
        if "us" in r and key(r) in best:
            r["speedup_vs_best_upstream"] = best[key(r)] / r["us"]


def markdown_table(rows: list[dict[str, Any]]) -> list[str]:
    """One line per (model, layer, context, M): per strategy "us (fraction of floor)", the
    launches of the new path, and the speedups over the best upstream strategy."""
    present = [s for s in STRATEGIES if any(r["strategy"] == s for r in rows)]
    ours = [s for s in OURS if s in present and any(s == r["strategy"] and
                                                     "speedup_vs_best_upstream" in r
                                                     for r in rows)]
    new = [s for s in OURS if s in present]
    head = (["model", "layer", "ctx", "M"] + present + [f"{s} launches" for s in new]
            + [f"{s} vs best upstream" for s in ours])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    keys = sorted({case_key(r) for r in rows})
    for k in keys:
        cells = {r["strategy"]: r for r in rows
                 if case_key(r) == k}

        def cell(s: str, what: str, cells: dict[str, dict[str, Any]] = cells) -> str:
            r = cells.get(s)
            if r is None:
                return "-"
            if "us" not in r:
                return "skipped"
            if what == "us":
                frac = f" ({r['fraction']:.2f})" if "fraction" in r else ""
                return f"{r['us']:.1f}{frac}"
            if what == "launches":
                return str(r.get("launches", "-"))
            v = r.get("speedup_vs_best_upstream")
            return "-" if v is None else f"{v:.2f}x"

        ctx = f"{k[2] // 1024}K" if k[2] >= 1024 else str(k[2])
        m_cell = f"{k[3]}" if not k[4] else f"{k[3]} x (1 + {k[4]})"
        lines.append(f"| {k[0]} | {k[1]} | {ctx} | {m_cell} | "
                     + " | ".join([cell(s, "us") for s in present]
                                  + [cell(s, "launches") for s in new]
                                  + [cell(s, "speedup") for s in ours]) + " |")
    return lines


RESULTS = ("decode_step.json", "decode_step.md", "decode_step.partial.json",
           "decode_step_profile.md", "fraction_of_floor.png")
TP_RESULTS = ("decode_step_tp.json", "decode_step_tp.md")
"""The files a run (with ``--tp``: a TP run) writes into ``--out``."""


def plot(rows: list[dict[str, Any]], path: Path) -> bool:
    """Fraction of floor per case and strategy (PNG); False (said on stderr) when matplotlib is
    missing."""
    plt = pyplot("decode-step", path)
    if plt is None:
        return False
    timed = [r for r in rows if "fraction" in r]
    cases = sorted({case_key(r) for r in timed})
    present = [s for s in STRATEGIES if any(r["strategy"] == s for r in timed)]
    fig, ax = plt.subplots(figsize=(max(8, 0.6 * len(cases) * len(present) / 3), 4.5))
    width = 0.8 / max(1, len(present))
    for j, s in enumerate(present):
        vals = [next((r["fraction"] for r in timed if r["strategy"] == s and
                      case_key(r) == c), 0.0)
                for c in cases]
        ax.bar([i + j * width for i in range(len(cases))], vals, width, label=s)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))])
    ax.set_xticklabels([f"{m} {lt}\nctx {c} M={mm}" + (f" k={k}" if k else "")
                        for m, lt, c, mm, k in cases], fontsize=7)
    ax.set_ylabel("fraction of floor (weights + cache bytes / copy bw)")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.set_title("DSV4 attention layer decode step, CUDA-graph replay")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


BENCH_FIXED_PLAN = ("graph_max_tokens", "step_graph_max_seqs")
"""Plan fields the bench sets itself (it captures the whole step as one graph)."""


def parser(prog: str | None = None) -> OneLineArgumentParser:
    ap = OneLineArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    add_out_options(ap, "decode_step.json, .md and fraction_of_floor.png (with --tp: "
                    "decode_step_tp.json and .md)")
    ap.add_argument("--models", default=["flash", "pro"],
                    type=choice_list(PRESET_NAMES, "model preset"),
                    help="comma-separated model presets (default flash,pro)")
    ap.add_argument("--layers", default=["C4"], type=choice_list(LAYER_RATIO, "layer type"),
                    help="comma-separated layer types of C4, C128, SWA (default C4)")
    ap.add_argument("--ms", default=[1, 16, 64], type=int_list,
                    help="comma-separated sequences per decode step (default 1,16,64)")
    ap.add_argument("--contexts", default=[512], type=int_list,
                    help="comma-separated cached tokens per sequence, e.g. 512,8192,65536 "
                    "(default 512)")
    ap.add_argument("--context", type=int, default=None,
                    help="one context (kept for --tp; default 1024 there)")
    ap.add_argument("--strategies", default=list(STRATEGIES),
                    type=choice_list(STRATEGIES, "strategy"),
                    help=f"comma-separated subset of {','.join(STRATEGIES)} (default all; the "
                    "first is the reference the others are checked against)")
    ap.add_argument("--draft-tokens", default=[0], type=lambda t: int_list(t, minimum=0),
                    help="comma-separated drafted tokens per sequence, k: steps of 1 + k tokens "
                    "per sequence, the verify steps of speculative decoding (default 0: decode "
                    "steps; at most 7)")
    ap.add_argument("--stagger", action="store_true",
                    help="sequence i at context + i tokens, not all at context: a one-token "
                    "step then completes a compressed entry for some sequences (a C4 layer: "
                    "every fourth), as a serving batch's does, where sequences at one position "
                    "complete none or all (default: all at context)")
    ap.add_argument("--plan", default={},
                    type=plan_changes(BENCH_FIXED_PLAN, "the bench captures the whole step as "
                                      "one graph and sets it itself"),
                    help="FIELD=N[,FIELD=N]: the cuda platform's plan entries every row's layer "
                    "takes instead of cuda_plan.json's (e.g. fp8_gemm_max_tokens=256: a "
                    "candidate threshold, measured beside a run without it; default: none, "
                    "the shipped table)")
    ap.add_argument("--fill", choices=("synthetic", "prefill"), default="synthetic",
                    help="cache history: synthetic rows (dsv4.bench.synthetic_cache, fast at any "
                    "context) or a real prefill by each strategy's layer (default synthetic)")
    ap.add_argument("--reps", type=int, default=7,
                    help="timed repetitions, median taken (default 7)")
    ap.add_argument("--cold-l2", action="store_true",
                    help="time each replay alone after reading a buffer of twice the L2 size "
                    "(a model's next layer finds none of this layer's weights in L2; default: "
                    "20 replays back to back)")
    ap.add_argument("--per-sequence", action="store_true",
                    help="a cache pool per sequence (default: the M sequences in one pool, the "
                    "batched decode path)")
    ap.add_argument("--pooled", action="store_true",
                    help="with --tp: the M sequences' caches in one pool")
    ap.add_argument("--profile", action="store_true",
                    help="also write decode_step_profile.md: the kernel tables of one eager "
                    "step and one graph replay of each new-path row, that replay's timeline "
                    "(span, idle gaps, time beside another stream), and where the step's "
                    "GPU operations are launched from (operators by Python stack)")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor parallelism over N GPUs (NCCL, one process a GPU, spawned here "
                    "or started by torchrun): the cuda_plan step per rank, with and without "
                    "its all-reduce (dsv4.bench.decode_step_tp; default 1: none)")
    ap.add_argument("--dry-run", action="store_true",
                    help="with --tp: run the TP step on the CPU over gloo, eager, tiny preset "
                    "(checks the plumbing; the times mean nothing)")
    return ap


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = parser(prog)
    args = ap.parse_args(argv)
    tp_run = args.tp != 1 or args.dry_run or "WORLD_SIZE" in os.environ
    with ap.usage_errors():
        check_at_least("--reps", args.reps, 1)
        if max(args.draft_tokens) > 7:
            raise UsageError(f"--draft-tokens {max(args.draft_tokens)}: at most 7 (the query "
                             "buckets of the decode runner)")
        if args.context is not None:
            check_at_least("--context", args.context, 1)
        if tp_run:
            check_tp_args(args)
            if args.plan:
                raise UsageError("--plan: the single-GPU rows only (the TP step builds its own "
                                 "plan)")
        check_out(args.out, TP_RESULTS if tp_run else RESULTS, args.overwrite)
    if tp_run:
        if args.context is None:
            args.context = 1024
        return main_tp(args)
    strategies = tuple(args.strategies)
    layers = args.layers
    contexts = [args.context] if args.context is not None else args.contexts
    for model in args.models:  # a layer type a preset lacks fails here, before the GPU work
        cfg = DSV4Config.preset(model)
        for layer_type in layers:
            try:
                cfg.layer_of_ratio(LAYER_RATIO[layer_type])
            except ConfigError as e:
                ap.error(f"--layers {layer_type} with --models {model}: {e}")
    require_cuda("decode-step")
    dev = torch.device("cuda")
    args.out.mkdir(parents=True, exist_ok=True)
    bw = measure_copy_bw(dev)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    t0 = time.time()
    rows: list[dict[str, Any]] = []
    profiles: list[str] | None = [] if args.profile else None
    for model in args.models:
        cfg = DSV4Config.preset(model)
        for layer_type in layers:
            weights = random_layer_weights(cfg, cfg.layer_of_ratio(LAYER_RATIO[layer_type]))
            for context in contexts:
                for m in args.ms:
                    for k in args.draft_tokens:
                        rows += run_case(cfg, model, layer_type, m, context, dev, bw,
                                         args.reps, weights, profiles, not args.per_sequence,
                                         strategies, args.fill, args.cold_l2, k,
                                         args.stagger, args.plan)
                    partial = {"rows": rows, "copy_bw": bw}
                    (args.out / "decode_step.partial.json").write_text(json.dumps(partial))
                    if profiles:  # kept as it grows: a run cut short keeps what it measured
                        (args.out / "decode_step_profile.md").write_text("\n".join(profiles))
    (args.out / "decode_step.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
         "copy_bw": bw, "seconds": time.time() - t0, "argv": argv, "rows": rows}, indent=1))
    (args.out / "decode_step.partial.json").unlink(missing_ok=True)
    lines = markdown_table(rows)
    (args.out / "decode_step.md").write_text(
        "Full-layer decode step, CUDA-graph replay: us (fraction of floor); copy bandwidth "
        f"{bw / 1e12:.2f} TB/s; "
        f"{'a cache pool per sequence' if args.per_sequence else 'one cache pool'}, "
        f"{args.fill} history"
        f"{'; sequence i at context + i tokens (--stagger)' if args.stagger else ''}"
        f"{'; L2 scrubbed before each replay (--cold-l2)' if args.cold_l2 else ''}"
        + "".join(f"; plan {k} = {v} (--plan)" for k, v in args.plan.items()) + "\n\n"
        + "\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(rows, args.out / "fraction_of_floor.png")
    if profiles:
        (args.out / "decode_step_profile.md").write_text("\n".join(profiles))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
