"""Prefill of one DSV4 attention layer on one GPU: long single calls, chunked prefill, attention.

    dsv4 bench prefill --out DIR [--models flash,pro] [--layers C4,C128,SWA]
                       [--tokens 4096,16384,65536,131072] [--attention-backend torch,auto]
                       [--step-kernels on,off] [--act-quant on,off] [--caches bf16,fp8]

Layer table: one layer of the ``cuda`` platform (Flash or Pro dims, fp8 weights with block
scales, random; bf16; its default post-load passes), C4 / C128 / SWA. ``single`` rows prefill T
tokens in one call on an empty cache; ``chunked`` rows append one chunk (``--chunk``, 8K) to a
cache already holding ``--context`` (64K) tokens (a fork of it per call, so every call sees the
same cache). ``--attention-backend`` goes to the config (``cfg.replace(attention_backend=...)``);
the row records what was asked. ``--step-kernels off`` rows run the cuda platform's PyTorch
path for the indexer, compressor and cache writes (labelled "(step kernels off)"). The fp8
linears' activations are quantised as the official code does (``act_quant``, docs/spec.md §6.3:
the serving numerics, as in ``dsv4 bench decode-step``); ``--act-quant off`` rows keep them
bf16 (labelled "(bf16 activations)"; every row before 2026-12-08 ran so). The caches are bf16
(``--caches bf16``, the default: the presets' exact stores, as every row before 2026-12-08
ran) or the serving caches of ``dsv4 bench decode-step`` (``--caches fp8``: ``fp8_ds_mla`` kv
rows, ``fp8`` index keys; labelled "(fp8 caches)"; FlashMLA then runs its decode kernel, which
reads that store in place). Before timing, each row's output on the first ``--check-tokens``
tokens is compared with the ``torch`` backend's with the step kernels off and the same
``act_quant`` and caches (rel. error <= 2e-2).

Per row: time (CUDA events, one warm-up call, median of ``--reps``; the layer rows keep each
call's time too, ``reps_ms``, and how long the host took to issue it, ``host_ms`` and
``reps_host_ms``: near ``ms``, the host held the device back), tokens/s, the layer's FLOPs
(:func:`layer_flops`: GEMMs 2*M*N*K; the indexer's scores, 2 * index_heads * index_head_dim per
(query, visible entry) plus 2 * index_heads for the relu-weighted sum; attention QK and PV,
4 * heads * head_dim per (query, attended row), attended rows = the window rows that exist +
the selected entries (C4: min(top-k, visible), C128: every visible entry); norms, RoPE, the
compressor's pooling and the top-k are not counted), the fraction of the compute floor
(FLOPs / the bf16 matrix rate of a large ``torch.mm`` measured in the same run), and the peak
extra memory (``torch.cuda.max_memory_allocated`` during the call minus the allocation after
weights, cache pool and inputs).

Attention table: ``dsv4.kernels.sparse_mqa.sparse_mqa`` vs FlashMLA's sparse prefill
(``flashmla_sparse_mqa(mode="prefill")``, workspace prebuilt) on the same bf16 stores and
indices: 64 / 128 heads, head_dim 512, 4K / 16K queries at the end of a 64K context, 640 or
1152 rows each (the 128-row window + 512 or 1024 compressed entries); each checked against
``sparse_mqa_reference`` on 64 queries first; our kernel also at a few other tiles
(``ATTN_PROBES``: the best of them is a column). Writes prefill.json, prefill.md and prefill.png;
``--profile`` also prefill_profile.md (the profiler's kernel table of one call per timed
single-call row, the device timeline of one more call profiled for its device operations only -
its idle gaps are where the device waited for the host -, and Python's profile of the host's
work in one more call).
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dsv4.bench.args import (
    LAYER_RATIO,
    SERVING_CACHES,
    add_out_options,
    check_out,
    check_report_source,
    choice_list,
    int_list,
    pyplot,
    require_cuda,
)
from dsv4.bench.attention_kernels import rel
from dsv4.config import ATTENTION_BACKENDS, DSV4Config
from dsv4.usage import OneLineArgumentParser, check_positive

ATTN_CASES = [(h, t, k) for h in (64, 128) for t in (4096, 16384) for k in (640, 1152)]
"""(heads, queries, rows each) of the attention table."""
ATTN_CONTEXT = 65536
ATTN_PROBES = {"h64_n16_s3": (64, 16, 3, 0), "h32_n64_s2": (32, 64, 2, 0),
               "h64_n16_dv256_s3": (64, 16, 3, 256), "h64_n32_dv256_s3": (64, 32, 3, 256),
               "h128_n16_dv256_s3": (128, 16, 3, 256), "h64_n32_s2": (64, 32, 2, 0),
               "h64_n64_s2": (64, 64, 2, 0)}
"""Tiles of our kernel timed beside its default in the attention table (heads per program, rows
per tile, pipeline stages, output columns per program (0: all); 8 warps). sm_90 compile
(benchmarks/aot_sm90_regs.py style, no GPU): the 64- and 128-head tiles use Hopper's wgmma,
the 32-head ones mma.sync (the default from 256 queries, 32 x 64: 196 registers). Up to 16
rows the 64-head tiles keep no stack (182-246 registers); the whole 512-column accumulators
of 64 heads at 32 / 64 rows spill 104 / 248 bytes (255 registers, 131 / 198 KB of shared
memory; 2026-12-08) - probed anyway: their QK MMAs are 2-4x wider than at 16 rows, one
program per query and 64 heads gathers each row once (the 32-head default twice)."""

CHECK_TOL = 2e-2


# ---------------------------------------------------------------------------------- counting


def layer_flops(cfg: DSV4Config, ratio: int, tokens: int, context: int = 0) -> dict[str, float]:
    """FLOPs of one layer call over ``tokens`` new tokens after ``context`` cached ones, by part
    (``gemm``, ``indexer``, ``attention``) and ``total``; see the module docstring."""
    h, d, H = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads
    m = tokens
    shapes = [(cfg.q_lora_rank + d, h),  # wq_a | wkv
              (H * d, cfg.q_lora_rank),  # wq_b
              (cfg.o_groups * cfg.o_lora_rank, cfg.heads_per_group * d),  # wo_a, per group
              (h, cfg.o_groups * cfg.o_lora_rank)]  # wo_b
    if ratio:
        coff = 2 if ratio == 4 else 1
        shapes.append((2 * coff * d, h))  # compressor wkv | wgate
    if ratio == 4:
        hi, di = cfg.index_n_heads, cfg.index_head_dim
        shapes += [(hi * di, cfg.q_lora_rank), (hi, h), (2 * 2 * di, h)]
    gemm = sum(2.0 * m * n * k for n, k in shapes)
    pos = torch.arange(context, context + tokens, dtype=torch.float64)
    rows = torch.clamp(pos + 1, max=cfg.sliding_window)  # window rows that exist
    indexer = 0.0
    if ratio == 4:
        visible = torch.div(pos + 1, 4, rounding_mode="floor")
        indexer = float(visible.sum()) * 2.0 * cfg.index_n_heads * (cfg.index_head_dim + 1)
        rows = rows + torch.clamp(visible, max=cfg.index_topk)
    elif ratio == 128:
        rows = rows + torch.div(pos + 1, 128, rounding_mode="floor")
    attention = float(rows.sum()) * 4.0 * H * d
    return {"gemm": gemm, "indexer": indexer, "attention": attention,
            "total": gemm + indexer + attention}


def attention_flops(heads: int, queries: int, rows: int, d: int = 512) -> float:
    """QK and PV of sparse MQA: 4 * heads * d per (query, row)."""
    return 4.0 * heads * d * queries * rows


# ---------------------------------------------------------------------------------- timing


def measure_matmul_rate(dev: torch.device, n: int = 8192, reps: int = 10) -> float:
    """bf16 FLOP/s of an n x n x n ``torch.mm`` (the compute floor's rate)."""
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        torch.mm(a, b)
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        for _ in range(reps):
            torch.mm(a, b)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3 / reps)
    del a, b
    torch.cuda.empty_cache()
    return 2.0 * n**3 / min(times)


def time_calls(fn: Callable[[], Any], reps: int, dev: torch.device,
               before: Callable[[], Any] | None = None
               ) -> tuple[float, int, list[float], list[float]]:
    """(median ms of ``reps`` calls after one warm-up, peak extra bytes of a call, each call's
    ms in order - an outlier the median hides shows there -, and each call's host ms: from its
    start to its return, before the device finished): ``before`` runs untimed ahead of every
    call (e.g. a fresh cache). A call whose host ms come near its ms kept the device waiting
    for the host (or synchronised with it)."""
    if before is not None:
        before()
    fn()  # warm-up: compiles kernels, fills allocator pools
    torch.cuda.synchronize()
    times: list[float] = []
    host: list[float] = []
    peak = 0
    for _ in range(reps):
        if before is not None:
            before()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        t0 = time.perf_counter()
        out = fn()
        host.append((time.perf_counter() - t0) * 1e3)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
        peak = max(peak, torch.cuda.max_memory_allocated(dev) - base)
        del out
    return statistics.median(times), peak, times, host


# ---------------------------------------------------------------------------------- layer


def build_layer(cfg: DSV4Config, layer_id: int, weights: dict[str, torch.Tensor],
                dev: torch.device, step_kernels: bool = True) -> Any:
    from dsv4.passes import process_weights_after_loading
    from dsv4.platforms.cuda import CudaAttention

    layer = CudaAttention(cfg, layer_id, device=dev, dtype=torch.bfloat16)
    layer.load_weights(weights.items())
    process_weights_after_loading(layer)
    layer.use_step_kernels(step_kernels)
    return layer


STEP_KERNELS_OFF = " (step kernels off)"
"""Suffix of a row's backend label when the cuda platform's step kernels were off (the torch
indexer, compressor and cache writes: the earlier path)."""
BF16_ACTIVATIONS = " (bf16 activations)"
"""... and when the fp8 linears' activations stayed bf16 (``act_quant`` off)."""
CACHES: dict[str, dict[str, str]] = {"bf16": {}, "fp8": SERVING_CACHES}
"""``--caches``: the config's store formats (bf16: the presets' own, exact; fp8: the serving
ones)."""
FP8_CACHES = " (fp8 caches)"
"""... and when the caches were the serving ones (``--caches fp8``)."""


def layer_rows(model: str, layer_type: str, backends: list[str], tokens: list[int],
               chunk: int, context: int, reps: int, check_tokens: int, rate: float,
               dev: torch.device, max_case_s: float, log: Callable[[dict], None],
               rows: list[dict[str, Any]], step_kernels: tuple[bool, ...] = (True,),
               profiles: list[str] | None = None, act_quant: bool = True,
               caches: str = "bf16") -> list[dict[str, Any]]:
    """Every (backend, step kernels, T) row of one model's layer type, and the chunked row per
    backend, appended to ``rows`` (``log`` is called after each); checked against the torch
    backend with the step kernels off (the plain PyTorch path). With ``profiles``, the kernel
    table of one call of each timed single-call row is appended to it. ``act_quant``: the
    config's (the official activation quantisation of the fp8 linears; off: bf16);
    ``caches``: a key of :data:`CACHES`."""
    from dsv4.testing.random_weights import random_layer_weights

    base_cfg = DSV4Config.preset(model).replace(act_quant=act_quant, **CACHES[caches])
    ratio = LAYER_RATIO[layer_type]
    layer_id = base_cfg.layer_of_ratio(ratio)  # Pro's SWA layer: its MTP layer
    weights = random_layer_weights(base_cfg, layer_id)
    gen = torch.Generator().manual_seed(0)
    longest = max([*tokens, context + chunk if chunk else 0])
    x = torch.randn(longest, base_cfg.hidden_size, generator=gen).to(dev, torch.bfloat16)
    check_x = x[:check_tokens]
    ref_out = _check_output(build_layer(base_cfg.replace(attention_backend="torch"), layer_id,
                                        weights, dev, step_kernels=False), check_x)
    for backend, kernels in [(b, k) for b in backends for k in step_kernels]:
        layer = build_layer(base_cfg.replace(attention_backend=backend), layer_id, weights, dev,
                            step_kernels=kernels)
        err = rel(_check_output(layer, check_x), ref_out)
        label = ((backend if kernels else backend + STEP_KERNELS_OFF)
                 + ("" if act_quant else BF16_ACTIVATIONS)
                 + ("" if caches == "bf16" else FP8_CACHES))
        common = {"model": model, "layer_type": layer_type, "backend": label,
                  "step_kernels": kernels, "act_quant": act_quant, "caches": caches,
                  "rel_err_vs_torch": err}
        if not err <= CHECK_TOL:
            rows.append({**common, "error": f"wrong: rel err {err:.3e} vs the torch backend"})
            log(rows[-1])
            continue
        cases = [("single", t, 0) for t in tokens] + ([("chunked", chunk, context)] if chunk
                                                     else [])
        last: tuple[int, float] | None = None  # (tokens, seconds) of the last single call
        for mode, t, ctx in cases:
            row: dict[str, Any] = {**common, "mode": mode, "tokens": t, "context": ctx}
            est = predicted_case_s(last, t, reps) if mode == "single" else 0.0
            if est > max_case_s:
                row["skipped"] = f"predicted {est:.0f} s > --max-case-seconds {max_case_s:.0f}"
                rows.append(row)
                log(row)
                continue
            t0 = time.time()
            try:
                row.update(_time_prefill(layer, x, t, ctx, reps, dev))
            except torch.cuda.OutOfMemoryError as ex:
                row["error"] = "out of memory: " + str(ex).split("\n")[0][:160]
            except Exception as ex:  # one failing case does not end the table
                row["error"] = repr(ex)[:300]
            finally:
                torch.cuda.empty_cache()
            if "ms" in row:
                fl = layer_flops(base_cfg, ratio, t, ctx)
                row["flops"] = fl
                row["tokens_per_s"] = t / (row["ms"] / 1e3)
                row["tflops"] = fl["total"] / (row["ms"] / 1e3) / 1e12
                row["fraction_of_floor"] = fl["total"] / rate / (row["ms"] / 1e3)
                if mode == "single":
                    last = (t, row["ms"] / 1e3)
                    if profiles is not None:
                        profiles.append(profile_call(
                            layer, x[:t], f"{model} {layer_type} {label} {t} tokens"))
            row["case_s"] = time.time() - t0
            rows.append(row)
            log(row)
        del layer
        torch.cuda.empty_cache()
    return rows


def profile_call(layer: Any, x: torch.Tensor, title: str) -> str:
    """The profiler's kernel table of one prefill call of ``x`` on a fresh cache, and (on a
    GPU) the PyTorch operators by the device time of their kernels, with their input shapes:
    which call of the layer's torch code a costly elementwise / copy kernel comes from. On a
    CPU: the operator table, by CPU time. On a GPU also the device timeline of one more call
    profiled for its device operations only (:func:`device_timeline`), then the host's
    profile (:func:`host_profile`)."""
    from torch.profiler import ProfilerActivity, profile

    gpu = x.is_cuda
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    cache = layer.new_cache(x.shape[0])
    try:
        with profile(activities=acts, record_shapes=gpu, with_stack=gpu) as prof:
            t0 = time.perf_counter()
            layer(x, torch.arange(x.shape[0]), cache)
            if gpu:
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
    finally:
        cache.free()
    timeline = device_timeline(layer, x, title) if gpu else ""
    return profile_tables(prof, title, wall, gpu) + timeline + host_profile(layer, x)


def device_timeline(layer: Any, x: torch.Tensor, title: str) -> str:
    """Markdown of one prefill call's device timeline, profiled for its device operations
    only (no host events, shapes or stacks, whose recording slows the host and so opens gaps
    of its own): the span from the first operation to the last against the time something
    runs, the largest idle gaps with the operation that ends each, and the operations in
    order (:func:`dsv4.bench.timeline.timeline_markdown`). Gaps where nothing runs are where
    the device waited for the host."""
    from torch.profiler import ProfilerActivity, profile

    from dsv4.bench.timeline import device_spans, timeline_markdown, trace_of

    cache = layer.new_cache(x.shape[0])
    try:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            layer(x, torch.arange(x.shape[0]), cache)
            torch.cuda.synchronize()
    finally:
        cache.free()
    return "\n" + timeline_markdown(device_spans(trace_of(prof)), title, rows=200,
                                    largest_gaps=10, what="one call")


def host_profile(layer: Any, x: torch.Tensor, rows: int = 18) -> str:
    """Markdown of where the host's time goes in one more prefill call of ``x`` (fresh cache),
    by Python's own profiler: the functions with the most time of their own, each with the
    callers it was reached from most often, then the final device wait. Python-level names
    where the torch profiler's stacks are missing (the device's build) - a call whose wall time
    exceeds its kernel time with little final wait is bound by this host work."""
    import cProfile
    import pstats

    cache = layer.new_cache(x.shape[0])
    pos = torch.arange(x.shape[0])
    prof = cProfile.Profile()
    try:
        t0 = time.perf_counter()
        prof.enable()
        layer(x, pos, cache)
        prof.disable()
        issued = time.perf_counter() - t0
        if x.is_cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    finally:
        prof.disable()
        cache.free()
    table = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    lines = ["", f"Host profile (cProfile, one more call): the host issued the call in "
             f"{issued * 1e3:.1f} ms; the device finished {(wall - issued) * 1e3:.1f} ms "
             "later. Functions by their own time:", "",
             "| function | calls | own ms | cumulative ms | called most from |",
             "|---|---|---|---|---|"]
    ranked = sorted(table.items(), key=lambda kv: -kv[1][2])
    for key, (_cc, calls, own, cum, callers) in ranked[:rows]:
        top = sorted(callers.items(), key=lambda kv: -kv[1][1])[:2]
        where = ", ".join(f"`{_where(k)}` ({v[1]})" for k, v in top)
        lines.append(f"| `{_where(key)}` | {calls} | {own * 1e3:.3f} | {cum * 1e3:.3f} | "
                     f"{where} |")
    return "\n".join(lines) + "\n"


def _where(key: tuple[str, int, str]) -> str:
    """A cProfile function key as ``path-after-dsv4/:line(name)`` (built-ins: their name)."""
    path, line, name = key
    if path == "~":
        return name[:70].replace("|", "/")
    short = path.replace("\\", "/").split("dsv4/")[-1].split("site-packages/")[-1]
    return f"{short}:{line}({name})"


def profile_tables(prof: Any, title: str, wall: float, gpu: bool) -> str:
    """Markdown of a finished profile of one call (see :func:`profile_call`)."""
    if not gpu:
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events)
        table = events.table(sort_by="self_cpu_time_total", row_limit=25,
                             max_name_column_width=70)
        return f"## {title}: {total / 1e3:.1f} ms of CPU operator time in one call\n\n{table}\n"
    kernels = [e for e in prof.key_averages()
               if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in kernels)
    lines = [f"## {title}: {total / 1e3:.1f} ms of kernel time in one call", "",
             f"The call took {wall * 1e3:.1f} ms on the host clock under the profiler (launch "
             "to the end of its last kernel); kernel time below.", "",
             "| kernel | calls | ms | us / call | share |", "|---|---|---|---|---|"]
    for e in kernels[:25]:
        t = e.self_device_time_total
        lines.append(f"| `{e.key[:90]}` | {e.count} | {t / 1e3:.3f} | {t / e.count:.1f} | "
                     f"{t / max(total, 1e-9):.1%} |")
    ops = [e for e in prof.key_averages(group_by_input_shape=True)
           if e.key.startswith("aten::") and e.device_time_total > 0]
    ops.sort(key=lambda e: -e.device_time_total)
    lines += ["", "PyTorch operators by their kernels' time (nested operators count in each "
              "level), with input shapes:", "",
              "| operator | input shapes | calls | kernel ms | CPU ms |", "|---|---|---|---|---|"]
    for e in ops[:20]:
        shapes = str(e.input_shapes)[:110].replace("|", "/")
        lines.append(f"| `{e.key}` | {shapes} | {e.count} | {e.device_time_total / 1e3:.3f} | "
                     f"{e.cpu_time_total / 1e3:.3f} |")
    # where the host's time goes (a GPU idle between kernels waits on these): every event by
    # its own CPU time, CUDA runtime calls (launches, copies, syncs) included
    cpu = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    cpu.sort(key=lambda e: -e.self_cpu_time_total)
    cpu_total = sum(e.self_cpu_time_total for e in cpu)
    callers = _dsv4_callers(prof.events())
    lines += ["", f"Host side: {cpu_total / 1e3:.1f} ms of self CPU time in profiled events "
              "(with stacks recorded: Python functions' own time included); the largest, "
              "with the dsv4 functions that issued most of them:", "",
              "| event | calls | self CPU ms | us / call | from (calls) |", "|---|---|---|---|---|"]
    for e in cpu[:15]:
        where = ", ".join(f"`{f}` ({n})" for f, n in callers[e.key].most_common(3))
        lines.append(f"| `{e.key[:80]}` | {e.count} | {e.self_cpu_time_total / 1e3:.3f} | "
                     f"{e.self_cpu_time_total / e.count:.1f} | {where} |")
    return "\n".join(lines) + "\n"


def _dsv4_callers(events: Any) -> dict[str, collections.Counter[str]]:
    """Per event name: how often each function of dsv4's own code (outside dsv4.bench) was the
    nearest dsv4 Python frame above the event (the profiler's Python-function events, which a
    profile records with ``with_stack=True``; empty without them)."""
    out: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for e in events:
        up = e.cpu_parent
        while up is not None:
            at = up.name.replace("\\", "/").split("dsv4/")
            if len(at) > 1 and not at[-1].startswith("bench/"):
                out[e.name][at[-1]] += 1
                break
            up = up.cpu_parent
    return out


def predicted_case_s(last: tuple[int, float] | None, tokens: int, reps: int) -> float:
    """Seconds a single-call row of ``tokens`` should take (warm-up + reps + the untimed resets),
    from the last row's (tokens, seconds per call), with 1.5x headroom for growth faster than
    linear; 0 without a last row."""
    if last is None:
        return 0.0
    t0, s0 = last
    return s0 * tokens / t0 * 1.5 * (reps + 1)


def _check_output(layer: Any, x: torch.Tensor) -> torch.Tensor:
    cache = layer.new_cache(x.shape[0])
    y = layer(x, torch.arange(x.shape[0]), cache)
    cache.free()
    return y


def _time_prefill(layer: Any, x: torch.Tensor, t: int, ctx: int, reps: int,
                  dev: torch.device) -> dict[str, Any]:
    pool = layer.new_cache_pool(2, ctx + t)
    pos = torch.arange(ctx, ctx + t)
    state: dict[str, Any] = {}
    if ctx:
        prefix = pool.add_sequence()
        layer(x[:ctx], torch.arange(ctx), prefix)

        def before() -> None:
            if "c" in state:
                state["c"].free()
            state["c"] = prefix.fork()
    else:
        state["c"] = pool.add_sequence()

        def before() -> None:
            state["c"].reset()
    xs = x[ctx:ctx + t]
    ms, peak, times, host = time_calls(lambda: layer(xs, pos, state["c"]), reps, dev, before)
    return {"ms": ms, "peak_extra_bytes": peak, "reps_ms": [round(ms_i, 4) for ms_i in times],
            "host_ms": statistics.median(host), "reps_host_ms": [round(h, 4) for h in host]}


# ---------------------------------------------------------------------------------- attention


def attention_rows(dev: torch.device, rate: float, reps: int, log: Callable[[dict], None],
                   rows: list[dict[str, Any]], cases: list[tuple[int, int, int]] | None = None,
                   context: int = ATTN_CONTEXT, probes: bool = True) -> list[dict[str, Any]]:
    """Our sparse MQA kernel vs FlashMLA's sparse prefill on the same stores and indices,
    appended to ``rows``; with ``probes`` also our kernel at the :data:`ATTN_PROBES` tiles
    (impl ``dsv4_<name>``)."""
    from dsv4.bench.attention_kernels import _template_rows, make_store
    from dsv4.kernels.flashmla_backend import (
        flashmla_prefill_workspace,
        flashmla_sparse_mqa,
        flashmla_supports,
    )
    from dsv4.kernels.sparse_mqa import SparseMqaConfig, sparse_mqa, sparse_mqa_reference

    d, w, block = 512, 128, 64
    gen = torch.Generator(device=dev).manual_seed(0)
    template = _template_rows("bf16", 64 * block, dev, gen)
    win_store = make_store("bf16", context, template)
    cmp_store = make_store("bf16", context // 4, template)
    wsp = None
    for heads, t, k in cases or ATTN_CASES:
        win_idx, cmp_idx = prefill_indices(t, k - w, w, context, dev, gen)
        q = torch.randn(t, heads, d, device=dev, generator=gen).to(torch.bfloat16)
        sink = torch.randn(heads, device=dev, generator=gen)
        tail = (sink, d ** -0.5, "bf16", block)
        n = min(64, t)
        ref = sparse_mqa_reference(q[:n], win_store, win_idx[:n], cmp_store, cmp_idx[:n], *tail)
        case = (q, win_store, win_idx, cmp_store, cmp_idx, tail)
        impls: dict[str, Callable[[int], torch.Tensor]] = {
            "dsv4": functools.partial(_first_queries, sparse_mqa, case, {})}
        for name, (bh, bn, st, dv) in ATTN_PROBES.items() if probes else ():
            cfg = SparseMqaConfig(block_h=bh, block_n=bn, split=1, num_warps=8, num_stages=st,
                                  block_dv=dv)
            impls[f"dsv4_{name}"] = functools.partial(_first_queries, sparse_mqa, case,
                                                      {"config": cfg})
        ok, why = flashmla_supports(heads, d, "bf16", dev)
        if ok:
            if wsp is None:
                wsp = flashmla_prefill_workspace(win_store, cmp_store, "bf16", block)
            impls["flashmla"] = functools.partial(_first_queries, flashmla_sparse_mqa, case,
                                                  {"mode": "prefill", "workspace": wsp})
        base = {"heads": heads, "queries": t, "rows_each": k, "window": w,
                "flops": attention_flops(heads, t, k, d)}
        if not ok:
            rows.append({**base, "impl": "flashmla", "skipped": why})
            log(rows[-1])
        for name, fn in impls.items():
            row = {**base, "impl": name}
            try:
                err = rel(fn(n), ref)
                row["rel_err"] = err
                if not err < CHECK_TOL:
                    row["error"] = f"wrong: rel err {err:.3e}"
                else:
                    ms, _, _, _ = time_calls(functools.partial(fn, t), reps, dev)
                    row["ms"] = ms
                    row["tflops"] = base["flops"] / (ms / 1e3) / 1e12
                    row["fraction_of_floor"] = base["flops"] / rate / (ms / 1e3)
            except Exception as ex:
                row["error"] = repr(ex)[:300]
            rows.append(row)
            log(row)
        torch.cuda.empty_cache()
    return rows


def _first_queries(kernel: Callable[..., torch.Tensor], case: tuple[Any, ...],
                   kw: dict[str, Any], m: int) -> torch.Tensor:
    """``kernel`` on the first ``m`` queries of ``case`` (q, stores, indices, sink etc.)."""
    q, win_store, win_idx, cmp_store, cmp_idx, tail = case
    return kernel(q[:m], win_store, win_idx[:m], cmp_store, cmp_idx[:m], *tail, **kw)


def prefill_indices(t: int, k_cmp: int, w: int, context: int, dev: torch.device | str,
                    gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries at the last ``t`` positions of a ``context``-token sequence stored from flat row
    0: (win_idx [t, w], the w rows ending at each position; cmp_idx [t, k_cmp], distinct random
    entries visible at the position, -1 where fewer exist), int32."""
    pos = torch.arange(context - t, context, device=dev)
    win = pos[:, None] - (w - 1) + torch.arange(w, device=dev)[None, :]
    win = torch.where(win >= 0, win, -1)
    visible = (pos + 1) // 4
    n = int(visible.max())
    keys = torch.rand(t, n, device=dev, generator=gen)
    keys = keys.masked_fill(torch.arange(n, device=dev)[None, :] >= visible[:, None], 2.0)
    k = min(k_cmp, n)
    pick = keys.topk(k, dim=1, largest=False).indices
    pick = torch.where(pick < visible[:, None], pick, -1)
    if k < k_cmp:
        pick = torch.cat((pick, torch.full((t, k_cmp - k), -1, device=dev)), dim=1)
    return win.int().contiguous(), pick.int().contiguous()


# ---------------------------------------------------------------------------------- report


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f}"


def markdown(res: dict[str, Any]) -> list[str]:
    rate = res.get("matmul_flops", 0.0)
    lines = [f"# DSV4 prefill, {res.get('gpu', '?')}, torch {res.get('torch', '?')}", "",
             f"bf16 matrix rate (torch.mm 8192^3, this run): {rate / 1e12:.0f} TFLOP/s. "
             "fraction = the layer's FLOPs at that rate / the time (see dsv4.bench.prefill for "
             "what is counted). Peak = extra GPU memory during the call (GiB). `chunked`: one "
             "chunk appended to a cache already holding `context` tokens.", "",
             "## Layer", "",
             "| model | layer | backend | mode | context | tokens | ms | tokens/s | TFLOP/s | "
             "fraction | peak GiB |", "|---" * 11 + "|"]
    for r in res.get("layer_rows", []):
        head = (f"| {r['model']} | {r['layer_type']} | {r['backend']} | {r.get('mode', '-')} | "
                f"{r.get('context', '-')} | {r.get('tokens', '-')} | ")
        if "ms" in r:
            lines.append(head + f"{r['ms']:.1f} | {r['tokens_per_s'] / 1e3:.0f} K | "
                         f"{r['tflops']:.1f} | {r['fraction_of_floor']:.3f} | "
                         f"{_gib(r['peak_extra_bytes'])} |")
        else:
            why = r.get("error") or r.get("skipped") or "?"
            lines.append(head + f"{why[:80]} | - | - | - | - |")
    att = res.get("attention_rows", [])
    if att:
        lines += ["", "## Sparse prefill attention (bf16 stores, d 512, window 128 of the rows)",
                  "", "| heads | queries | rows each | dsv4 ms | FlashMLA ms | dsv4 / FlashMLA | "
                  "dsv4 TFLOP/s | FlashMLA TFLOP/s | best tile probe (ms) |", "|---" * 9 + "|"]
        for key, cells in attention_table(att):
            a, b = cells.get("dsv4", {}), cells.get("flashmla", {})
            ratio = f"{a['ms'] / b['ms']:.2f}x" if "ms" in a and "ms" in b else "-"
            timed = [(r["ms"], n[len("dsv4_"):]) for n, r in cells.items()
                     if n.startswith("dsv4_") and "ms" in r]
            best = f"{min(timed)[1]} {min(timed)[0]:.2f}" if timed else "-"
            lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {_ms(a)} | {_ms(b)} | {ratio} | "
                         f"{_tf(a)} | {_tf(b)} | {best} |")
    errs = [r for r in [*res.get("layer_rows", []), *att] if r.get("error")]
    if errs:
        lines += ["", "## Errors", ""] + [
            "- " + json.dumps({k: v for k, v in r.items() if k != "flops"}) for r in errs]
    return lines


def attention_table(rows: list[dict[str, Any]]
                    ) -> list[tuple[tuple[int, int, int], dict[str, dict[str, Any]]]]:
    keys = sorted({(r["heads"], r["queries"], r["rows_each"]) for r in rows})
    return [(k, {r["impl"]: r for r in rows if (r["heads"], r["queries"], r["rows_each"]) == k})
            for k in keys]


def _ms(r: dict[str, Any]) -> str:
    if "ms" in r:
        return f"{r['ms']:.2f}"
    return "skip" if r.get("skipped") else ("ERR" if r.get("error") else "-")


def _tf(r: dict[str, Any]) -> str:
    return f"{r['tflops']:.0f}" if "tflops" in r else "-"


RESULTS = ("prefill.json", "prefill.md", "prefill.png", "prefill_profile.md")
"""The files a run writes into ``--out``."""


def plot(res: dict[str, Any], out: Path) -> None:
    plt = pyplot("prefill", out / "prefill.png")
    if plt is None:
        return

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    single = [r for r in res.get("layer_rows", []) if r.get("mode") == "single" and "ms" in r]
    for key in sorted({(r["model"], r["layer_type"], r["backend"]) for r in single}):
        pts = sorted((r["tokens"], r) for r in single
                     if (r["model"], r["layer_type"], r["backend"]) == key)
        xs = [p[0] for p in pts]
        axes[0].plot(xs, [p[1]["tokens_per_s"] / 1e3 for p in pts], "o-", label=" ".join(key))
        axes[1].plot(xs, [p[1]["peak_extra_bytes"] / 2**30 for p in pts], "o-",
                     label=" ".join(key))
    for ax, title in ((axes[0], "tokens/s (K), one call"), (axes[1], "peak extra GiB")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens")
        ax.set_title(title)
        if single:
            ax.legend(fontsize=7)
    att = attention_table(res.get("attention_rows", []))
    labels, ours, theirs = [], [], []
    for key, cells in att:
        labels.append(f"H{key[0]} T{key[1] // 1024}K k{key[2]}")
        ours.append(cells.get("dsv4", {}).get("ms", math.nan))
        theirs.append(cells.get("flashmla", {}).get("ms", math.nan))
    idx = list(range(len(labels)))
    axes[2].bar([i - 0.2 for i in idx], ours, 0.4, label="dsv4 (Triton)")
    axes[2].bar([i + 0.2 for i in idx], theirs, 0.4, label="FlashMLA")
    axes[2].set_xticks(idx, labels, rotation=45, ha="right", fontsize=7)
    axes[2].set_title("sparse prefill attention, ms")
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "prefill.png", dpi=110)


def write_report(res: dict[str, Any], out: Path) -> str:
    text = "\n".join(markdown(res)) + "\n"
    (out / "prefill.md").write_text(text)
    try:
        plot(res, out)
    except Exception as ex:  # noqa: BLE001 - the table is the result; say why no PNG
        print(f"dsv4 bench prefill: warning: prefill.png was not written ({ex!r})",
              file=sys.stderr)
    return text


# ---------------------------------------------------------------------------------- CLI


def parser(prog: str | None = None) -> OneLineArgumentParser:
    ap = OneLineArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    add_out_options(ap, "prefill.json, .md and .png")
    ap.add_argument("--models", default=["flash", "pro"],
                    type=choice_list(("flash", "pro"), "model"),
                    help="comma-separated presets (default flash,pro)")
    ap.add_argument("--layers", default=["C4", "C128", "SWA"],
                    type=choice_list(tuple(LAYER_RATIO), "layer"),
                    help="comma-separated layer types (default C4,C128,SWA)")
    ap.add_argument("--tokens", default=[4096, 16384, 65536, 131072], type=int_list,
                    help="tokens of the single-call prefills (default 4096,16384,65536,131072)")
    ap.add_argument("--chunk", type=int, default=8192,
                    help="chunked prefill: tokens of the appended chunk (default 8192; 0: no "
                    "chunked row)")
    ap.add_argument("--context", type=int, default=65536,
                    help="chunked prefill: tokens already in the cache (default 65536)")
    ap.add_argument("--attention-backend", default=["torch"],
                    type=choice_list(ATTENTION_BACKENDS, "attention backend"),
                    help=f"comma-separated, of {', '.join(ATTENTION_BACKENDS)} (default torch)")
    ap.add_argument("--step-kernels", default=["on"], type=choice_list(("on", "off"), "value"),
                    help="comma-separated on / off: the cuda platform's step kernels (the Triton "
                    "indexer, compressor, cache writes; off: their PyTorch path) (default on)")
    ap.add_argument("--act-quant", default=["on"], type=choice_list(("on", "off"), "value"),
                    help="comma-separated on / off: the fp8 linears' activations quantised as "
                    "the official code does (the serving numerics; off: bf16) (default on)")
    ap.add_argument("--caches", default=["bf16"], type=choice_list(tuple(CACHES), "value"),
                    help="comma-separated bf16 / fp8: the stores' formats (fp8: fp8_ds_mla kv "
                    "rows and fp8 index keys, the serving caches) (default bf16)")
    ap.add_argument("--reps", type=int, default=3,
                    help="timed calls per row, median taken (default 3)")
    ap.add_argument("--check-tokens", type=int, default=1024,
                    help="tokens of the output check against the torch backend (default 1024)")
    ap.add_argument("--max-case-seconds", type=float, default=60.0,
                    help="skip a larger single call when the last one predicts more than this "
                    "(default 60)")
    ap.add_argument("--only", choices=["layer", "attention"], default=None,
                    help="run one section only (default: both)")
    ap.add_argument("--profile", action="store_true",
                    help="also write prefill_profile.md: the kernel table of one call of each "
                    "timed single-call layer row")
    ap.add_argument("--report-only", action="store_true",
                    help="remake prefill.md / .png from OUT/prefill.json; no GPU needed")
    return ap


def parse_args(argv: list[str] | None = None, prog: str | None = None) -> argparse.Namespace:
    """The arguments, checked (a usage error, exit code 2, before any work)."""
    ap = parser(prog)
    args = ap.parse_args(argv)
    for name in ("chunk", "context"):
        if getattr(args, name) < 0:
            ap.error(f"--{name} must be >= 0")
    if args.chunk and not args.context:
        ap.error("--chunk needs --context > 0 (or --chunk 0)")
    if args.reps < 1 or args.check_tokens < 1:
        ap.error("--reps and --check-tokens must be >= 1")
    with ap.usage_errors():
        check_positive("--max-case-seconds", args.max_case_seconds)
        if args.report_only:
            check_report_source(args.out, "prefill.json")
        else:
            check_out(args.out, RESULTS, args.overwrite)
    return args


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = parse_args(argv, prog)
    out: Path = args.out
    if args.report_only:
        print(write_report(json.loads((out / "prefill.json").read_text()), out))
        return 0
    require_cuda("prefill")
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    rate = measure_matmul_rate(dev)
    print(f"bf16 matrix rate {rate / 1e12:.0f} TFLOP/s", flush=True)
    res: dict[str, Any] = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                           "matmul_flops": rate, "argv": argv, "layer_rows": [],
                           "attention_rows": []}
    t0 = time.time()

    profiles: list[str] | None = [] if args.profile else None

    def save() -> None:  # after every row: partial results survive a timeout
        res["seconds"] = time.time() - t0
        (out / "prefill.json").write_text(json.dumps(res, indent=1))
        if profiles:
            (out / "prefill_profile.md").write_text("\n".join(profiles))

    def log(row: dict[str, Any]) -> None:
        print({k: v for k, v in row.items() if k != "flops"}, flush=True)
        save()

    if args.only in (None, "attention"):
        attention_rows(dev, rate, args.reps, log, res["attention_rows"])
    if args.only in (None, "layer"):
        for model in args.models:
            for layer_type in args.layers:
                for act_quant, caches in [(a, c) for a in args.act_quant for c in args.caches]:
                    layer_rows(model, layer_type, args.attention_backend, args.tokens,
                               args.chunk, args.context, args.reps, args.check_tokens, rate,
                               dev, args.max_case_seconds, log, res["layer_rows"],
                               tuple(v == "on" for v in args.step_kernels), profiles,
                               act_quant=act_quant == "on", caches=caches)
    save()
    print(write_report(res, out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
