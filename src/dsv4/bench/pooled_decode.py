"""Decode step with per-sequence caches vs one cache pool (any device; CPU by default).

One attention layer of a preset (``tiny`` by default, random fp8 weights), M sequences with
prompts of different lengths, then decode steps of one token per sequence: once with a cache of
its own per sequence (the forward loops over sequences), once with ``layer.new_caches(M)`` (the
batched path: one indexed write per cache tensor, one batched top-k, one batched attention,
one batched compress per compressor). Outputs of the two are checked against each other before
timing. Writes ``pooled_decode.json`` and ``pooled_decode.md`` (and ``pooled_decode.png`` when
matplotlib is installed) into ``--out``.

    python -m dsv4.bench.pooled_decode --out DIR [--device cuda] [--preset flash]
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from dsv4.attention import DeepseekV4Attention
from dsv4.bench.args import add_out_options, check_out, int_list, pyplot
from dsv4.cache.pool import AttentionCache
from dsv4.config import PRESET_NAMES, DSV4Config
from dsv4.testing.random_weights import random_layer_weights
from dsv4.usage import OneLineArgumentParser, check_at_least, resolve_device


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(layer: DeepseekV4Attention, m: int, context: int, steps: int, reps: int,
            pooled: bool, seed: int = 0) -> tuple[float, torch.Tensor]:
    """(median ms per decode step, outputs of the first rep) for one cache layout."""
    dev, hid = layer.device, layer.cfg.hidden_size
    gen = torch.Generator().manual_seed(seed)
    lens = [context - (i * 7) % max(1, context // 2) for i in range(m)]
    xs = torch.randn(steps, m, hid, generator=gen).to(dev, layer.dtype)
    prompts = [torch.randn(n, hid, generator=gen).to(dev, layer.dtype) for n in lens]
    times, first = [], None
    for _ in range(reps):
        caches: list[AttentionCache] = (layer.new_caches(m, context + steps) if pooled else
                                        [layer.new_cache(context + steps) for _ in range(m)])
        for p, c in zip(prompts, caches, strict=True):
            layer(p, torch.arange(p.shape[0]), c)
        outs = []
        _sync(dev)
        t0 = time.perf_counter()
        for s in range(steps):
            pos = torch.tensor([n + s for n in lens])
            outs.append(layer(xs[s], pos, caches))
        _sync(dev)
        times.append((time.perf_counter() - t0) / steps * 1e3)
        if first is None:
            first = torch.stack(outs)
    assert first is not None
    return statistics.median(times), first


RESULTS = ("pooled_decode.json", "pooled_decode.md", "pooled_decode.png")
"""The files a run writes into ``--out``."""


def parser(prog: str | None = None) -> OneLineArgumentParser:
    ap = OneLineArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    add_out_options(ap, "pooled_decode.json, .md and .png")
    ap.add_argument("--preset", default="tiny", choices=PRESET_NAMES,
                    help="model preset (default tiny)")
    ap.add_argument("--device", default="cpu", help="device to time on (default cpu)")
    ap.add_argument("--ms", default=[1, 4, 16, 64, 128], type=int_list,
                    help="comma-separated sequences per decode step (default 1,4,16,64,128)")
    ap.add_argument("--context", type=int, default=200,
                    help="prompt tokens per sequence before decoding (default 200)")
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed per run (default 8)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions, median taken (default 3)")
    return ap


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = parser(prog)
    args = ap.parse_args(argv)
    with ap.usage_errors():
        for option in ("context", "steps", "reps"):
            check_at_least(f"--{option}", getattr(args, option), 1)
        dev = torch.device(resolve_device(args.device))
        check_out(args.out, RESULTS, args.overwrite)
    cfg = DSV4Config.preset(args.preset)
    rows: list[dict[str, Any]] = []
    for ratio in sorted(set(cfg.compress_ratios)):
        layer_id = cfg.layer_of_ratio(ratio)
        layer = DeepseekV4Attention(cfg, layer_id, device=dev, dtype=torch.bfloat16)
        layer.load_weights(random_layer_weights(cfg, layer_id).items())
        measure(layer, 2, args.context, 2, 1, True)  # warm-up (first calls, allocator)
        measure(layer, 2, args.context, 2, 1, False)
        for m in args.ms:
            single, y_single = measure(layer, m, args.context, args.steps, args.reps, False)
            pooled, y_pooled = measure(layer, m, args.context, args.steps, args.reps, True)
            err = float((y_pooled.double() - y_single.double()).norm()
                        / y_single.double().norm())
            if err > 1e-2:
                raise RuntimeError(f"ratio {ratio} M={m}: pooled differs from per-sequence "
                                   f"(rel. error {err:.2e})")
            rows.append({"preset": args.preset, "ratio": ratio, "M": m,
                         "context": args.context, "per_sequence_ms": single,
                         "pooled_ms": pooled, "speedup": single / pooled, "rel_err": err})
            print(f"ratio {ratio:3d} M={m:3d}: per-sequence {single:8.2f} ms, pooled "
                  f"{pooled:8.2f} ms per decode step ({single / pooled:.1f}x), err {err:.1e}",
                  flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    device_name = (torch.cuda.get_device_name(dev) if dev.type == "cuda"
                   else f"cpu ({torch.get_num_threads()} threads)")
    (args.out / "pooled_decode.json").write_text(json.dumps(
        {"device": device_name, "torch": torch.__version__, "rows": rows}, indent=1))
    lines = [f"Decode step of one {args.preset} layer (bf16, context {args.context}), ms, "
             f"{device_name}", "", "| ratio | M | per-sequence caches | one cache pool | speedup |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['ratio']} | {r['M']} | {r['per_sequence_ms']:.2f} | {r['pooled_ms']:.2f} | "
              f"{r['speedup']:.1f}x |" for r in rows]
    (args.out / "pooled_decode.md").write_text("\n".join(lines) + "\n")
    written = [args.out / "pooled_decode.json", args.out / "pooled_decode.md"]
    png = args.out / "pooled_decode.png"
    if _plot(rows, png):
        written.append(png)
    print("wrote " + ", ".join(str(p) for p in written), flush=True)
    return 0


def _plot(rows: list[dict[str, Any]], path: Path) -> bool:
    """Write the plot; False (said on stderr) when matplotlib is missing."""
    plt = pyplot("pooled-decode", path)
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for ratio in sorted({r["ratio"] for r in rows}):
        sel = [r for r in rows if r["ratio"] == ratio]
        ms = [r["M"] for r in sel]
        ax.plot(ms, [r["per_sequence_ms"] for r in sel], "--o", label=f"ratio {ratio}, per-seq")
        ax.plot(ms, [r["pooled_ms"] for r in sel], "-o", label=f"ratio {ratio}, pooled")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequences per decode step (M)")
    ax.set_ylabel("ms per decode step")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


if __name__ == "__main__":
    raise SystemExit(main())
