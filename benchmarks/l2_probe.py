"""Does an L2 prefetch of a weight, issued while the GPU does latency-bound work, speed up the
fp8 GEMM that then reads it? (``dsv4.kernels.l2_prefetch``; ``CudaAttention.use_l2_prefetch``.)

    PYTHONPATH=src python3 benchmarks/l2_probe.py --out DIR   # a CUDA GPU, sm_90

For Flash's and Pro's ``wo_a`` (grouped, one launch) and ``wo_b`` at M = 1 and 16, the
streaming GEMM as the platform runs it under act_quant (``wo_b`` on quantised activations with
``choose_fp8_config(act_fp8=True)``'s tiles, ``wo_a`` on bf16 ones) is timed alone
(CUDA events around it) in these states, each prepared first by reading a buffer of twice the
L2 size (so nothing of the weight is in L2):

* ``cold``: the GEMM right after the scrub;
* ``gap``: a spin kernel of ``--gap-us`` (``torch.cuda._sleep``) between scrub and GEMM, no
  prefetch - the same timeline as the prefetch rows without the prefetch;
* ``MODE fraction``: the prefetch launch (``prefetch_to_l2`` of the weight, up to fraction x the
  L2 size, in MODE), the spin, then the GEMM: what the layer's stretch of small kernels between
  ``wq_b`` and ``wo_a`` would give it;
* ``MODE fraction nogap``: the same without the spin (the fetch competes with the GEMM);
* ``hot``: the GEMM run once more right after itself (what L2 keeps of its own
  ``evict_first`` stream).

Also the prefetch launch's own time and the spin's measured length. Each cell is the median of
``--reps`` (default 30). The output of every GEMM is checked equal to the cold one's (the
prefetch must not change a bit). Writes ``l2_probe.json`` and ``l2_probe.md`` under DIR.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from dsv4.config import DSV4Config
from dsv4.kernels.fp8_linear import choose_fp8_config, fp8_grouped_linear, fp8_linear, sm_count
from dsv4.kernels.l2_prefetch import MODES, l2_bytes, prefetch_to_l2, prefetch_usable

FRACTIONS = (0.5, 1.0)
DEVICE = "cuda"


def weights(model: str) -> dict[str, tuple[int, int, int]]:
    """name -> (groups, rows, K) of the model's output-path weights (rows = all groups')."""
    cfg = DSV4Config.preset(model)
    g = cfg.o_groups
    return {"wo_a": (g, g * cfg.o_lora_rank, cfg.heads_per_group * cfg.head_dim),
            "wo_b": (1, cfg.hidden_size, g * cfg.o_lora_rank)}


def timed(fn: Callable[[], object], before: Callable[[], object], reps: int
          ) -> tuple[float, object]:
    """Median us of ``fn`` over ``reps`` runs, each after ``before`` (untimed); its last
    result."""
    ts, out = [], None
    for _ in range(reps):
        before()
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        out = fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) * 1e3)
    return statistics.median(ts), out


def probe(w: torch.Tensor, sc: torch.Tensor, g: int, x: torch.Tensor, l2: int,
          scrub: torch.Tensor, cycles: int, reps: int) -> dict[str, float]:
    """us of each state (module docstring) for weight ``w`` (``g`` groups) on ``x``."""
    m, dev = x.shape[0], x.device
    # as the platform runs them under act_quant: wo_b's input quantised (the act8 tiles),
    # wo_a's not (the kernel's own tiles)
    cfg = (choose_fp8_config(m, w.shape[0], w.shape[1], sm_count(dev), act_fp8=True)
           if g == 1 else None)

    def gemm() -> torch.Tensor:
        if g == 1:
            return fp8_linear(x, w, sc, config=cfg)
        return fp8_grouped_linear(x.view(m, g, -1), w, sc, config=cfg)

    def spin() -> None:
        torch.cuda._sleep(cycles)

    gemm()  # compile
    cells: dict[str, float] = {}
    cells["cold"], ref = timed(gemm, scrub.sum, reps)
    states: dict[str, Callable[[], object]] = {"gap": lambda: (scrub.sum(), spin())}
    for mode in MODES:
        for frac in FRACTIONS:
            def fetch(budget: int = int(frac * l2), mode: str = mode) -> int:
                return prefetch_to_l2([w], budget, mode=mode)

            states[f"{mode} {frac}"] = lambda fetch=fetch: (scrub.sum(), fetch(), spin())
            states[f"{mode} {frac} nogap"] = lambda fetch=fetch: (scrub.sum(), fetch())
            cells[f"{mode} {frac} launch"], _ = timed(fetch, scrub.sum, reps)
    for state, before in states.items():
        cells[state], out = timed(gemm, before, reps)
        assert torch.equal(out, ref), state  # the prefetch must not change a bit
    cells["hot"], out = timed(gemm, gemm, reps)
    assert torch.equal(out, ref)
    return cells


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", default="flash,pro")
    ap.add_argument("--ms", default="1,16")
    ap.add_argument("--gap-us", type=float, default=30.0)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    dev = torch.device(DEVICE)
    if not prefetch_usable(dev):
        raise SystemExit("l2_probe: the prefetch needs Triton and a CUDA GPU of sm_90 or later")
    l2 = l2_bytes(dev)
    scrub = torch.ones(2 * l2 // 4, dtype=torch.int32, device=dev)
    # the spin's cycles for --gap-us, from the measured clock of a 1M-cycle spin
    mega_us, _ = timed(lambda: torch.cuda._sleep(1_000_000), lambda: None, 5)
    cycles = int(args.gap_us / mega_us * 1_000_000)
    gap_us, _ = timed(lambda: torch.cuda._sleep(cycles), lambda: None, 5)
    print(f"L2 {l2 / 2**20:.0f} MiB; spin of {cycles} cycles = {gap_us:.1f} us", flush=True)
    rows = []
    for model in args.models.split(","):
        for name, (g, n, k) in weights(model).items():
            gen = torch.Generator(device=dev).manual_seed(0)
            w = (torch.randn(n, k, device=dev, generator=gen) * 64).to(torch.float8_e4m3fn)
            sc = torch.full((n // 128, k // 128), 127, dtype=torch.uint8, device=dev)
            for m in (int(v) for v in args.ms.split(",")):
                x = torch.randn(m, g * k, device=dev, generator=gen).bfloat16()
                cells = probe(w, sc, g, x, l2, scrub, cycles, args.reps)
                row = {"model": model, "weight": name, "M": m, "MiB": w.nbytes / 2**20,
                       "us": cells}
                rows.append(row)
                print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "l2_probe.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(dev), "l2_bytes": l2, "gap_us": gap_us,
         "rows": rows}, indent=1))
    names = ["cold", "gap", "hot"] + [c for c in (rows[0]["us"] if rows else {})
                                       if c not in ("cold", "gap", "hot")]
    lines = [f"fp8 GEMM alone after an L2 scrub, us (median of {args.reps}); "
             f"{torch.cuda.get_device_name(dev)}, L2 {l2 / 2**20:.0f} MiB, spin {gap_us:.1f} us",
             "", "| model | weight | MiB | M | " + " | ".join(names) + " |",
             "|---|---|---|---|" + "---|" * len(names)]
    for r in rows:
        lines.append(f"| {r['model']} | {r['weight']} | {r['MiB']:.0f} | {r['M']} | "
                     + " | ".join(f"{r['us'][c]:.1f}" for c in names) + " |")
    (args.out / "l2_probe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
