"""CPU speed of the paged cache's one batched path against the tree before it (issue 10's goal).

Runs the same measurement in two source trees, alternating them cell by cell so that both see
the same machine load, and keeps the fastest of ``--rounds`` runs per cell:

* decode: one tiny layer (bf16, random fp8 weights), M sequences with prompts of ~200 tokens in
  one cache pool (``layer.new_caches(M, ...)``; before the paged cache: the pooled decode batch),
  ms per decode step of one token per sequence (median of ``--steps`` steps);
* prefill: one call of 300 tokens into a fresh cache, ms (median of 5).

    git worktree add --detach /tmp/before 244a6bf     # the last commit before the paged cache
    python benchmarks/compare_paged_cpu.py --before /tmp/before/src --after src \\
        --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CELL = r"""
import json, statistics, sys, time, torch
import dsv4
from dsv4.testing.random_weights import random_layer_weights
kind, ratio, m, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
cfg = dsv4.DSV4Config.preset("tiny")
lid = cfg.layer_of_ratio(ratio)
layer = dsv4.build_attention(cfg, lid, platform="reference", dtype=torch.bfloat16)
layer.load_weights(random_layer_weights(cfg, lid, 0).items())
g = torch.Generator().manual_seed(0)
h = cfg.hidden_size
times = []
with torch.no_grad():
    if kind == "prefill":
        x = torch.randn(300, h, generator=g).bfloat16()
        for _ in range(6):
            c = layer.new_cache(400)
            t0 = time.perf_counter(); layer(x, torch.arange(300), c)
            times.append(time.perf_counter() - t0)
        times = times[1:]
    else:
        lens = [200 - (i * 7) % 100 for i in range(m)]
        caches = layer.new_caches(m, 200 + steps + 4)
        for n, c in zip(lens, caches):
            layer(torch.randn(n, h, generator=g).bfloat16(), torch.arange(n), c)
        xs = torch.randn(steps + 2, m, h, generator=g).bfloat16()
        for s in range(steps + 2):
            pos = torch.tensor([n + s for n in lens])
            t0 = time.perf_counter(); layer(xs[s], pos, caches)
            if s >= 2:
                times.append(time.perf_counter() - t0)
print(json.dumps(statistics.median(times) * 1e3))
"""


def run_cell(src: str, kind: str, ratio: int, m: int, steps: int) -> float:
    env = dict(os.environ, PYTHONPATH=src)
    out = subprocess.run([sys.executable, "-c", CELL, kind, str(ratio), str(m), str(steps)],
                         env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", required=True, help="src folder of the tree before")
    ap.add_argument("--after", required=True, help="src folder of the tree after")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ms", default="1,4,16,64,128")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    cells = [("prefill", r, 1) for r in (0, 4, 128)]
    cells += [("decode", r, int(m)) for r in (0, 4, 128) for m in args.ms.split(",")]
    rows = []
    for kind, r, m in cells:
        best = {"before": float("inf"), "after": float("inf")}
        for _ in range(args.rounds):
            for name, src in (("before", args.before), ("after", args.after)):
                best[name] = min(best[name], run_cell(src, kind, r, m, args.steps))
        row = {"kind": kind, "ratio": r, "m": m, "before_ms": best["before"],
               "after_ms": best["after"], "speedup": best["before"] / best["after"]}
        rows.append(row)
        print(f"{kind:7s} ratio {r:3d} M={m:3d}: before {best['before']:7.2f} ms, after "
              f"{best['after']:7.2f} ms ({row['speedup']:.2f}x)", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "paged_vs_before.json").write_text(json.dumps(
        {"rows": rows, "command": " ".join(sys.argv), "cpus": os.cpu_count()}, indent=1))
    lines = ["CPU time of the paged cache's one batched path (after) vs the tree before it "
             "(before: per-sequence loop for prefill, the pooled decode batch for decode); tiny "
             "preset, bf16, best of rounds, ms", "",
             "| call | ratio | M | before | after | before / after |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['kind']} | {r['ratio']} | {r['m'] if r['kind'] == 'decode' else '300 tokens'}"
              f" | {r['before_ms']:.2f} | {r['after_ms']:.2f} | {r['speedup']:.2f}x |"
              for r in rows]
    (args.out / "paged_vs_before.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
