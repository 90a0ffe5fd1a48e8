"""The indexer's top-k kernel at decode widths: its variants against the default.

Variants: the method (``radix`` or ``two_level``), scores per iteration and warps.

    PYTHONPATH=src python3 benchmarks/topk_probe.py --out DIR   # a CUDA GPU

For rows of 4K, 16K and 64K entries (contexts 16K, 64K, 256K: every entry visible), 1 and 16
queries, random scores and scores with many exact ties, each (method, block, warps) variant's
selection must equal the default's bit for bit (a variant that differs is reported and not
timed); then each is timed as 10 calls captured in a CUDA graph, replayed (median of 7).
Writes ``topk_probe.json`` and ``topk_probe.md`` under DIR.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from dsv4.kernels.indexer_topk import choose_scan, topk_entries

VARIANTS = [("radix", 1024, 8, 0), ("radix", 4096, 8, 0), ("radix", 8192, 16, 0),
            ("two_level", 1024, 16, 10), ("two_level", 1024, 16, 11),
            ("two_level", 1024, 16, 12), ("two_level", 1024, 8, 10),
            ("two_level", 4096, 16, 10)]
"""(method, block, warps, coarse bits of the two-level method) tried; none spills on sm_90.
Session 26's first run also had radix 2048 x 8, 4096 x 16 and 8192 x 32 (slower)."""
TOPK = 512


def _scores(kind: str, t: int, width: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        s = torch.randn(t, width, generator=g)
    else:  # many exact ties, a quarter exact zeros (as ReLU sums of zero queries give)
        s = torch.randint(-3, 4, (t, width), generator=g).float() * 0.25
        s[:, ::4] = 0.0
    return s.cuda()


def _time(fn, reps: int = 7, calls: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times)


def _name(method: str, block: int, warps: int, coarse: int) -> str:
    return f"{method}{f'/{coarse}' if coarse else ''} {block}x{warps}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the JSON and table")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("topk_probe needs a CUDA GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for width in (4096, 16384, 65536):
        for t in (1, 16):
            for kind in ("random", "ties"):
                s = _scores(kind, t, width, seed=width + t)
                pos = torch.full((t,), 4 * width - 1, dtype=torch.long, device="cuda")
                ref = topk_entries(s, pos, TOPK)
                row = {"width": width, "T": t, "scores": kind, "default": list(choose_scan(width))}
                for method, block, warps, coarse in VARIANTS:
                    name = _name(method, block, warps, coarse)
                    kw = dict(block=block, num_warps=warps, method=method)
                    if coarse:
                        kw["coarse_bits"] = coarse
                    got = topk_entries(s, pos, TOPK, **kw)
                    if not torch.equal(got, ref):
                        row[name] = "differs"
                        continue
                    row[name] = round(_time(lambda s=s, p=pos, o=got, kw=kw: topk_entries(
                        s, p, TOPK, out=o, **kw)), 2)
                rows.append(row)
                print(row, flush=True)
    (args.out / "topk_probe.json").write_text(json.dumps(rows, indent=1))
    names = [_name(*v) for v in VARIANTS]
    lines = ["Top-k kernel, us per call (CUDA graph of 10 calls; k = 512, every entry visible)",
             "", "| width | T | scores | " + " | ".join(names) + " |",
             "|---|---|---|" + "---|" * len(names)]
    lines += [f"| {r['width']} | {r['T']} | {r['scores']} | "
              + " | ".join(str(r[n]) for n in names) + " |" for r in rows]
    (args.out / "topk_probe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
