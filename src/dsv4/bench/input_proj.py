"""DSV4 decode input projections on one GPU: upstream strategies against the fused dsv4 kernel.

    dsv4 bench input-proj --out DIR [--quick] [--tune]     (or python -m dsv4.bench.input_proj)

For Flash (K=4096) and Pro (K=7168), layer types C4 / C128 / SWA and M in 1..256 it checks every
strategy against a float64 reference on fresh random inputs (a wrong strategy is not timed), then
times it eager and under CUDA-graph replay, with the weights rotated over enough copies to stream
from HBM rather than the 60 MB L2. floor = bytes that must move (weights + x + outputs in their
own dtypes) / device-to-device copy bandwidth measured in the same run. Writes results.json,
summary.md and fraction_of_floor.png (the plot is remade on any machine by
``python -m dsv4.bench.plot_input_proj``).

Strategies: serial4 (the layer's GEMMs one after another on one stream), multistream (wqa_wkv on
the current stream, the others on 3 aux streams with events: the upstream CUDA plan), rocm_style
(wqa_wkv + one fp32 GEMM over the concatenated compressors + weights_proj), fused4_cublas (one fp32
cuBLAS GEMM over all weights, split into fp32 views: no bf16 casts, which favours it),
fused4_dsv4 (dsv4.kernels.fused_input_proj), fused4_dsv4_pdl (the same, launched with programmatic
dependent launch; it only pays when the previous kernel in the stream lets it start early).
weights_dtype "fp8-wqa": fused_wqa_wkv kept fp8 e4m3 with 128x128 scales, dequantised in-kernel.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time

import torch

from dsv4.bench.args import (
    add_out_options,
    check_out,
    choice_list,
    int_list,
    require_cuda,
)
from dsv4.kernels.fused_input_proj import (
    KernelConfig,
    choose_config,
    fused_input_projections,
    pack_input_weights,
    segment_views,
)
from dsv4.runner import capture_graph
from dsv4.usage import OneLineArgumentParser

MODELS = {"flash": (4096, 1536), "pro": (7168, 2048)}  # K, fused_wqa_wkv rows
ROTATE_BYTES = 320e6
"""Bytes of rotated copies a probe cycles through (> 5x the 60 MB L2), so each call reads its
weights or keys from HBM (here and :mod:`dsv4.bench.attention_kernels`)."""
LAYERS = ("C4", "C128", "SWA")
MS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
BF16_STRATEGIES = ("serial4", "multistream", "rocm_style", "fused4_cublas", "fused4_dsv4")
FP8_STRATEGIES = ("fused4_dsv4",)
# fused4_dsv4_pdl (programmatic dependent launch + L2 weight prefetch) is a strategy of its own
# but left out of the default run: the sweep found it 1 us slower (docs/performance.md, "Tried
# and lost"); --pdl adds it
TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-4}
PDL_PREFETCH = 512  # bytes of each weight row prefetched to L2 before griddepcontrol.wait


def layer_segments(layer: str, n_wqa: int) -> list[tuple[str, int, torch.dtype]]:
    segs = [("wqa_wkv", n_wqa, torch.bfloat16)]
    if layer == "C4":
        segs += [("compressor", 2048, torch.float32), ("idx_compressor", 512, torch.float32),
                 ("idx_weights", 64, torch.bfloat16)]
    elif layer == "C128":
        segs += [("compressor", 1024, torch.float32)]
    return segs


def measure_copy_bw(dev) -> float:
    a = torch.empty(2 << 30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(10):
        b.copy_(a)
    e.record()
    torch.cuda.synchronize()
    bw = 2 * a.numel() * 10 / (s.elapsed_time(e) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return bw


def make_copy(K, segs, fp8: bool, dev, gen):
    """One random weight set; returns (packed, {name: [rows, K] bf16-or-dequant view})."""
    items: list[tuple] = []
    for i, (name, rows, dt) in enumerate(segs):
        if fp8 and i == 0:
            q = (torch.randn(rows, K, device=dev, generator=gen) * 2).to(torch.float8_e4m3fn)
            e = torch.randint(-9, -5, (rows // 128, K // 128), device=dev, generator=gen)
            items.append((name, (q, torch.pow(2.0, e.float())), dt))
        else:
            w = torch.randn(rows, K, device=dev, generator=gen, dtype=torch.bfloat16) * 0.02
            items.append((name, w, dt))
    return pack_input_weights(items)


def mm32(x, w):
    return torch.mm(x, w.t(), out_dtype=torch.float32)


class Case:
    """All weight copies and callables of one (model, layer, weights_dtype, M)."""

    def __init__(self, model, layer, fp8, copies_cache, dev, streams):
        self.model, self.layer, self.fp8 = model, layer, fp8
        self.K, n_wqa = MODELS[model]
        self.segs = layer_segments(layer, n_wqa)
        self.packs = copies_cache
        self.dev, self.streams = dev, streams

    def views(self, i):
        return segment_views(self.packs[i])

    def strategy_fn(self, name, i, x, cfg=None):
        p = self.packs[i]
        v = self.views(i)
        names = [s[0] for s in self.segs]
        if name.startswith("fused4_dsv4"):
            outs = [torch.empty(x.shape[0], r, device=self.dev, dtype=dt) for _, r, dt in self.segs]
            c = cfg or choose_config(x.shape[0], p)
            if name.endswith("_pdl"):
                c = KernelConfig(**{**c.__dict__, "pdl": True, "prefetch": PDL_PREFETCH})

            def run():
                return fused_input_projections(x, p, outs, config=c)
            run.outs = outs  # type: ignore[attr-defined]
            return run
        if name == "fused4_cublas":
            sizes = [s[1] for s in self.segs]
            return lambda: mm32(x, p.weight).split(sizes, dim=1)

        def gemm(n):
            dt = dict((s[0], s[2]) for s in self.segs)[n]
            return mm32(x, v[n]) if dt == torch.float32 else torch.mm(x, v[n].t())

        if name == "serial4":
            order = [n for n in ("wqa_wkv", "compressor", "idx_weights", "idx_compressor")
                     if n in names]
            return lambda: [gemm(n) for n in order]
        if name == "rocm_style":
            if self.layer != "C4":
                return lambda: [gemm(n) for n in names]
            wc2 = p.weight[v["wqa_wkv"].shape[0]: v["wqa_wkv"].shape[0] + 2560]

            def f():
                q = gemm("wqa_wkv")
                c = mm32(x, wc2).split([2048, 512], dim=1)
                return q, c[0], c[1], gemm("idx_weights")
            return f
        if name == "multistream":
            aux = [n for n in ("compressor", "idx_weights", "idx_compressor") if n in names]
            streams = self.streams

            def f():
                cur = torch.cuda.current_stream()
                for s_ in streams[: len(aux)]:
                    s_.wait_stream(cur)
                outs = []
                for s_, n in zip(streams, aux, strict=False):
                    with torch.cuda.stream(s_):
                        outs.append(gemm(n))
                o0 = gemm("wqa_wkv")
                for s_ in streams[: len(aux)]:
                    cur.wait_stream(s_)
                return o0, outs
            return f
        raise KeyError(name)

    def outputs_of(self, name, res):
        """Normalise a strategy's result to the segment order."""
        names = [s[0] for s in self.segs]
        if name.startswith("fused4_dsv4") or name == "fused4_cublas":
            return list(res)
        if name == "serial4":
            order = [n for n in ("wqa_wkv", "compressor", "idx_weights", "idx_compressor")
                     if n in names]
            d = dict(zip(order, res, strict=True))
            return [d[n] for n in names]
        if name == "rocm_style":
            if self.layer != "C4":
                return list(res)
            q, c, ic, iw = res
            return [q, c, ic, iw]
        if name == "multistream":
            o0, outs = res
            aux = [n for n in ("compressor", "idx_weights", "idx_compressor") if n in names]
            d = dict(zip(aux, outs, strict=True))
            d["wqa_wkv"] = o0
            return [d[n] for n in names]
        raise KeyError(name)

    def check(self, name, M, cfg=None):
        """Max over segments of relative Frobenius error / tolerance against float64, on fresh
        random x; > 1 (or inf for NaN, e.g. an unwritten poisoned element) means wrong."""
        x = torch.randn(M, self.K, device=self.dev, dtype=torch.bfloat16)
        fn = self.strategy_fn(name, 0, x, cfg)
        if hasattr(fn, "outs"):  # poison: every element must be written
            for o in fn.outs:
                o.fill_(float("nan"))
        res = self.outputs_of(name, fn())
        torch.cuda.synchronize()
        p = self.packs[0]
        v = segment_views(p)
        worst = 0.0
        xd = x.double()
        for j, (n, _rows, _dt) in enumerate(self.segs):
            if self.fp8 and j == 0:
                s = p.fp8_scale.double().repeat_interleave(128, 0).repeat_interleave(128, 1)
                w = p.fp8_weight.double() * s
            else:
                w = v[n].double()
            ref = xd @ w.t()
            got = res[j].double()
            if got.shape != ref.shape or not torch.isfinite(got).all():
                return float("inf")
            err = ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()
            worst = max(worst, err / TOL[res[j].dtype])
        return worst


def time_eager(fns, iters=120):
    for f in fns * 2:
        f()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for it in range(iters):
        fns[it % len(fns)]()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / iters * 1e3


def time_graph(fns, reps=10, trials=5):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with capture_graph(g):
        for f in fns:
            f()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(trials):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        for _ in range(reps):
            g.replay()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) / (reps * len(fns)) * 1e3)
    del g
    return statistics.median(ts)


def floor_bytes(case: Case, M: int) -> int:
    p = case.packs[0]
    out_b = sum(M * r * (4 if dt == torch.float32 else 2) for _, r, dt in case.segs)
    return p.weight_bytes() + M * case.K * 2 + out_b


def build_packs(model, layer, fp8, dev, seed=0):
    K, n_wqa = MODELS[model]
    segs = layer_segments(layer, n_wqa)
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    p0 = make_copy(K, segs, fp8, dev, gen)
    n = max(4, math.ceil(ROTATE_BYTES / p0.weight_bytes()))
    return [p0] + [make_copy(K, segs, fp8, dev, gen) for _ in range(n - 1)]


def run_case_rows(case, M, strategies, wdt, copy_bw, rows, modes=("eager", "graph")):
    fb = floor_bytes(case, M)
    floor_us = fb / copy_bw * 1e6
    flops = 2 * M * case.K * sum(r for _, r, _ in case.segs)
    for name in strategies:
        if name.endswith("_pdl") and choose_config(M, case.packs[0]).cublas:
            continue  # the cuBLAS path has no PDL variant
        base = dict(model=case.model, layer_type=case.layer, M=M, strategy=name,
                    weights_dtype=wdt, floor_us=floor_us, bytes=fb, flops=flops,
                    copies=len(case.packs))
        try:
            err = case.check(name, M)
        except Exception as ex:  # record it and go on
            err, base["error"] = float("inf"), repr(ex)[:300]
        base["check_err_over_tol"] = err
        if not err <= 1.0:
            rows.append({**base, "mode": "check", "us": None,
                         "error": base.get("error", "failed check")})
            print(f"{case.model:5s} {case.layer:4s} {wdt:7s} M={M:4d} {name:16s} CHECK FAILED "
                  f"{err}", flush=True)
            continue
        x = torch.randn(M, case.K, device=case.dev, dtype=torch.bfloat16)
        fns = [case.strategy_fn(name, i, x) for i in range(len(case.packs))]
        for mode in modes:
            us = time_eager(fns) if mode == "eager" else time_graph(fns)
            rows.append({**base, "mode": mode, "us": us, "fraction": floor_us / us,
                         "gbps": fb / us / 1e3})
            print(f"{case.model:5s} {case.layer:4s} {wdt:7s} M={M:4d} {name:16s} {mode:5s} "
                  f"{us:8.2f} us  floor {floor_us:6.2f}  frac {floor_us / us:5.2f}", flush=True)


def add_ratios(rows):
    """ratio_to_best_other: best other strategy's time / this time (same case, mode, any dtype)."""
    key = lambda r: (r["model"], r["layer_type"], r["M"], r["mode"])  # noqa: E731
    best: dict = {}
    for r in rows:
        if r.get("us") and not r["strategy"].startswith("fused4_dsv4"):
            k = key(r)
            best[k] = min(best.get(k, float("inf")), r["us"])
    for r in rows:
        if r.get("us") and key(r) in best:
            r["best_other_us"] = best[key(r)]
            r["ratio_to_best_other"] = best[key(r)] / r["us"]


def microbench_c2(dev, copy_bw, rows):
    """The fusion PR's micro-benchmark: Pro, M=4, compressor GEMMs 2048 + 512, fp32 out."""
    K, M = 7168, 4
    segs = [("compressor", 2048, torch.float32), ("idx_compressor", 512, torch.float32)]
    gen = torch.Generator(device=dev)
    gen.manual_seed(1)
    n = math.ceil(ROTATE_BYTES / (2560 * K * 2))
    packs = [make_copy(K, segs, False, dev, gen) for _ in range(n)]
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    fb = 2560 * K * 2 + M * K * 2 + M * 2560 * 4
    floor_us = fb / copy_bw * 1e6

    def sep(p):
        v = segment_views(p)
        return lambda: (mm32(x, v["compressor"]), mm32(x, v["idx_compressor"]))

    def fused(p):
        return lambda: mm32(x, p.weight).split([2048, 512], dim=1)

    def dsv4(p):
        outs = [torch.empty(M, 2048, device=dev), torch.empty(M, 512, device=dev)]
        c = choose_config(M, p)
        return lambda: fused_input_projections(x, p, outs, config=c)

    for name, mk in (("c2_separate", sep), ("c2_fused", fused), ("c2_dsv4", dsv4)):
        fns = [mk(p) for p in packs]
        for mode in ("eager", "graph"):
            us = time_eager(fns) if mode == "eager" else time_graph(fns)
            rows.append(dict(model="pro", layer_type="C4-compressors", M=M, strategy=name,
                             weights_dtype="bf16", mode=mode, us=us, floor_us=floor_us,
                             fraction=floor_us / us, bytes=fb))
            print(f"micro pro M=4 {name:12s} {mode:5s} {us:8.2f} us floor {floor_us:6.2f}",
                  flush=True)


def tune(dev, copy_bw, out_dir, quick):
    """Time candidate tile configs per shape (graph mode); write tune.json."""
    res = []
    for model in MODELS:
        for fp8 in (False, True):
            packs = build_packs(model, "C4", fp8, dev)
            case = Case(model, "C4", fp8, packs, dev, None)
            p = packs[0]
            for M in ((1, 16, 64, 128, 256) if quick else (1, 4, 16, 32, 64, 128, 256)):
                fb = floor_bytes(case, M)
                floor_us = fb / copy_bw * 1e6
                for cfg in candidate_configs(M, p):
                    try:
                        err = case.check("fused4_dsv4", M, cfg)
                        if not err <= 1.0:
                            raise RuntimeError(f"check failed: {err}")
                        x = torch.randn(M, case.K, device=dev, dtype=torch.bfloat16)
                        fns = [case.strategy_fn("fused4_dsv4", i, x, cfg)
                               for i in range(len(packs))]
                        us = time_graph(fns)
                    except Exception as ex:  # record and go on: a config may not fit
                        us, err = None, repr(ex)[:200]
                    res.append(dict(model=model, fp8=fp8, M=M, cfg=cfg.__dict__, us=us,
                                    floor_us=floor_us, err=err))
                    frac = f"{floor_us / us:5.2f}" if us else "  -  "
                    print(f"tune {model} fp8={fp8:d} M={M:3d} {cfg} -> {us} frac {frac}",
                          flush=True)
            del packs, case
            torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "tune.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    print("best per shape:")
    for key in sorted({(r["model"], r["fp8"], r["M"]) for r in res}):
        ok = sorted((r for r in res if (r["model"], r["fp8"], r["M"]) == key and r["us"]),
                    key=lambda r: r["us"])
        for r in ok[:3]:
            c = r["cfg"]
            print(f"  {key[0]:5s} fp8={key[1]:d} M={key[2]:3d} {r['us']:6.2f} us "
                  f"frac {r['floor_us'] / r['us']:.3f} bm{c['block_m']} bn{c['block_n']} "
                  f"s{c['split_k']} st{c['num_stages']} w{c['num_warps']} swap{c['swap']:d} "
                  f"pdl{c['pdl']:d} pf{c['prefetch']} cublas{c['cublas']:d}")


def calibrate(dev, copy_bw, out_dir):
    """What one launch of this size can reach: a graph-replayed device-to-device copy moving the
    same bytes as each layer's weights (half read, half written), rotated like the GEMMs; plus
    a few fp8 tile probes. Writes calibration.json."""
    res = {"copy_bw_TBps": copy_bw / 1e12, "copy": [], "fp8_probe": []}
    for model, (K, n_wqa) in MODELS.items():
        for layer in LAYERS:
            nb = sum(r for _, r, _ in layer_segments(layer, n_wqa)) * K * 2
            n = max(4, math.ceil(ROTATE_BYTES / nb))
            src = [torch.empty(nb // 2, dtype=torch.uint8, device=dev) for _ in range(n)]
            dst = [torch.empty_like(a) for a in src]
            us = time_graph([lambda a=a, b=b: b.copy_(a) for a, b in zip(src, dst, strict=True)])
            res["copy"].append(dict(model=model, layer_type=layer, bytes=nb, us=us,
                                    floor_us=nb / copy_bw * 1e6,
                                    fraction=nb / copy_bw * 1e6 / us))
            print(f"copy {model} {layer} {nb / 1e6:.1f} MB: {us:.2f} us, "
                  f"fraction {nb / copy_bw * 1e6 / us:.3f}", flush=True)
            del src, dst
    for model in MODELS:
        packs = build_packs(model, "C4", True, dev)
        case = Case(model, "C4", True, packs, dev, None)
        for M in (1, 16):
            floor_us = floor_bytes(case, M) / copy_bw * 1e6
            base = choose_config(M, packs[0])
            for cfg in (base, KernelConfig(**{**base.__dict__, "block_n8": 32}),
                        KernelConfig(**{**base.__dict__, "block_n": 64, "block_n8": 32}),
                        KernelConfig(**{**base.__dict__, "block_n": 16, "block_n8": 32}),
                        KernelConfig(**{**base.__dict__, "num_warps": 8})):
                err = case.check("fused4_dsv4", M, cfg)
                us = None
                if err <= 1.0:
                    x = torch.randn(M, case.K, device=dev, dtype=torch.bfloat16)
                    us = time_graph([case.strategy_fn("fused4_dsv4", i, x, cfg)
                                     for i in range(len(packs))])
                res["fp8_probe"].append(dict(model=model, M=M, cfg=cfg.__dict__, us=us,
                                             floor_us=floor_us, err=err))
                print(f"fp8 probe {model} M={M} bn{cfg.block_n} bn8{cfg.block_n8} "
                      f"w{cfg.num_warps} s{cfg.split_k}: {us} us "
                      f"frac {floor_us / us if us else 0:.3f}", flush=True)
        del packs, case
        torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "calibration.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)


def candidate_configs(M, p):
    """A short list around choose_config's pick (the sweeps in
    benchmarks/results/2026-12-02-h200/input-projections/ chose it)."""
    base = choose_config(M, p)
    kc = lambda **kw: KernelConfig(**{**base.__dict__, **kw})  # noqa: E731
    fp8 = p.fp8_weight is not None
    c = [base]
    if M <= 16:
        c += [kc(pdl=True, prefetch=pf) for pf in (0, 512, 1024)]
        if fp8:
            c += [kc(block_n=64, split_k=4), kc(block_n=32, split_k=4)]
        else:
            c += [kc(split_k=8, num_stages=2), kc(block_n=32, split_k=4)]
    elif M <= 64:
        c += [kc(split_k=2, swap=True), kc(split_k=1, swap=False),
              kc(block_n=32, split_k=2, swap=True, num_stages=3), kc(pdl=True, prefetch=512)]
    else:
        c += [KernelConfig(block_m=128, block_n=64, num_warps=8, num_stages=2, swap=False),
              KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=3, swap=False)]
        if not fp8:
            c.append(KernelConfig(cublas=True))
    out = []
    for x in c:
        if x not in out:
            out.append(x)
    return out


def summarize(res, out_dir):
    rows = res["rows"]
    lines = [f"# DSV4 input projections, {res['gpu']}, torch {res['torch']}",
             "",
             f"Copy bandwidth {res['copy_bw_TBps']:.3f} TB/s (read + write, measured in the run). "
             "floor = (weights + x + outputs) bytes / copy bandwidth. CUDA-graph replay, C4 layer, "
             "weights rotated beyond L2. Each cell: us (fraction of floor).",
             ""]
    strat_cols = [("bf16", s) for s in BF16_STRATEGIES] + [("fp8-wqa", s) for s in FP8_STRATEGIES]
    for model in MODELS:
        lines += [f"## {model}", "",
                  "| M | floor bf16 | floor fp8 | " + " | ".join(
                      f"{s}{' fp8' if d != 'bf16' else ''}" for d, s in strat_cols)
                  + " | dsv4 / best other |",
                  "|---" * (len(strat_cols) + 4) + "|"]
        for M in MS:
            cells, fl = [], {}
            for d, s in strat_cols:
                r = [r for r in rows if r["model"] == model and r["layer_type"] == "C4"
                     and r["M"] == M and r["strategy"] == s and r["weights_dtype"] == d
                     and r["mode"] == "graph" and r.get("us")]
                if r:
                    fl[d] = r[0]["floor_us"]
                    cells.append(f"{r[0]['us']:.1f} ({r[0]['fraction']:.2f})")
                else:
                    cells.append("-")
            mine = [r for r in rows if r["model"] == model and r["layer_type"] == "C4"
                    and r["M"] == M and r["strategy"] == "fused4_dsv4"
                    and r["weights_dtype"] == "bf16" and r["mode"] == "graph" and r.get("us")]
            ratio = f"{mine[0]['ratio_to_best_other']:.2f}x" if mine else "-"
            lines.append(f"| {M} | {fl.get('bf16', 0):.1f} | {fl.get('fp8-wqa', 0):.1f} | "
                         + " | ".join(cells) + f" | {ratio} |")
        lines.append("")
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


RESULTS = ("results.json", "summary.md", "fraction_of_floor.png", "fraction_of_floor_eager.png",
           "tune.json", "calibration.json")
"""The files a run (of any mode) writes into ``--out``."""


def parser(prog: str | None = None) -> OneLineArgumentParser:
    ap = OneLineArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    add_out_options(ap, "results.json, summary.md and the PNGs")
    ap.add_argument("--quick", action="store_true", help="fewer M and layer types")
    ap.add_argument("--tune", action="store_true", help="sweep tile configs instead")
    ap.add_argument("--models", default=list(MODELS), type=choice_list(MODELS, "model"),
                    help=f"comma-separated model presets (default {','.join(MODELS)})")
    ap.add_argument("--layers", default=list(LAYERS), type=choice_list(LAYERS, "layer type"),
                    help=f"comma-separated layer types (default {','.join(LAYERS)})")
    ap.add_argument("--ms", default=list(MS), type=int_list,
                    help=f"comma-separated token counts M per call (default "
                    f"{','.join(map(str, MS))})")
    ap.add_argument("--pdl", action="store_true", help="also time fused4_dsv4_pdl")
    ap.add_argument("--calibrate", action="store_true",
                    help="copy-of-same-bytes calibration and fp8 tile probes instead")
    return ap


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = parser(prog)
    args = ap.parse_args(argv)
    with ap.usage_errors():
        check_out(args.out, RESULTS, args.overwrite)
    args.out = str(args.out)
    require_cuda("input-proj")
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    copy_bw = measure_copy_bw(dev)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "copy_bw_TBps": copy_bw / 1e12, "rows": []}
    print(f"{res['gpu']} torch {torch.__version__} copy bw {copy_bw / 1e12:.3f} TB/s", flush=True)
    if args.tune:
        tune(dev, copy_bw, args.out, args.quick)
        return 0
    if args.calibrate:
        calibrate(dev, copy_bw, args.out)
        return 0
    t0 = time.time()
    streams = [torch.cuda.Stream() for _ in range(3)]
    ms, layers = list(args.ms), list(args.layers)
    if args.quick:
        ms, layers = [1, 4, 16, 64, 256], ["C4"]
    for model in args.models:
        for layer in layers:
            for fp8 in (False, True):
                packs = build_packs(model, layer, fp8, dev)
                case = Case(model, layer, fp8, packs, dev, streams)
                for M in ms:
                    strats = FP8_STRATEGIES if fp8 else BF16_STRATEGIES
                    if args.pdl:
                        strats = (*strats, "fused4_dsv4_pdl")
                    run_case_rows(case, M, strats, "fp8-wqa" if fp8 else "bf16", copy_bw,
                                  res["rows"])
                with open(os.path.join(args.out, "results.json"), "w") as f:
                    json.dump(res, f, indent=1)  # partial results survive a timeout
                del packs, case
                torch.cuda.empty_cache()
    microbench_c2(dev, copy_bw, res["rows"])
    add_ratios(res["rows"])
    res["seconds"] = time.time() - t0
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(res, f, indent=1)
    summarize(res, args.out)
    try:
        from dsv4.bench.plot_input_proj import plot

        for mode in ("graph", "eager"):
            plot(res, args.out, mode)
    except Exception as ex:  # noqa: BLE001 - python -m dsv4.bench.plot_input_proj OUT remakes it
        print(f"dsv4 bench input-proj: warning: the plots were not written ({ex!r})",
              file=sys.stderr)
    with open(os.path.join(args.out, "summary.md")) as f:
        print(f.read())
    return 0


if __name__ == "__main__":
    main()
