"""Where the host time of one eager decode call goes: ``layer(x, positions, caches)`` of one
layer (the serving config of ``dsv4 bench model-decode``: fp8 weights, ``act_quant``,
``fp8_ds_mla`` / ``fp8`` caches, ``attention_backend="auto"``), on a CUDA GPU.

For each (model, layer type, M) it writes to ``--out``:
- the wall time per call over ``--steps`` consecutive calls (synchronised at both ends), beside
  the host time of the same calls with the GPU never waited for (how long Python takes to issue
  them) - both in ``eager_profile.json``;
- ``<case>.txt``: the Python functions by own time (cProfile over the same calls) and PyTorch's
  operators by host time (``torch.profiler``, CPU activity only).

  python3 benchmarks/eager_profile.py --out DIR [--models flash] [--types C4] [--ms 1,16]

The numbers guide the lean eager path (docs/performance.md); they are not a benchmark row.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path

import torch

from dsv4 import DSV4Config
from dsv4.bench.model_decode import build_stack, serving_config
from dsv4.bench.synthetic_cache import fill_history


def profile_case(cfg: DSV4Config, layer_type: str, m: int, context: int, steps: int
                 ) -> tuple[dict[str, float], str]:
    ratio = {"SWA": 0, "C4": 4, "C128": 128}[layer_type]
    lid = cfg.layer_of_ratio(ratio)
    layer = build_stack(cfg, lid + 1, torch.device("cuda"), "cuda")[lid]
    layer.use_step_graphs(0)  # the eager path itself, not the plain calls' step graphs
    caches = layer.new_caches(m, context + 4 * steps + 64, max_rollback=steps)
    fill_history(caches, context)
    x = torch.randn(m, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    at = [context]

    def call() -> None:
        pos = torch.full((m,), at[0], dtype=torch.long)  # host positions: checked without a sync
        layer(x, pos, caches)
        at[0] += 1

    def back() -> None:  # every pass runs the same positions
        torch.cuda.synchronize()
        for c in caches:
            c.truncate(context)
        at[0] = context

    # the warm-up runs the timed positions themselves: every kernel specialisation those steps
    # need (a length reaching a multiple of 16 is a new one for Triton, a compile of a second
    # or more) is compiled before the clock starts
    for _ in range(steps):
        call()
    back()
    t0 = time.perf_counter()
    for _ in range(steps):
        call()
    issued = time.perf_counter() - t0
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    back()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        call()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
    back()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
        for _ in range(steps):
            call()
    torch.cuda.synchronize()
    text.write(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
    row = {"wall_us": wall * 1e6 / steps, "host_issue_us": issued * 1e6 / steps}
    return row, text.getvalue()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", default="flash")
    ap.add_argument("--types", default="C4")
    ap.add_argument("--ms", default="1,16")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for model in args.models.split(","):
        cfg = serving_config(DSV4Config.preset(model))
        for layer_type in args.types.split(","):
            for m in (int(v) for v in args.ms.split(",")):
                row, text = profile_case(cfg, layer_type, m, args.context, args.steps)
                row.update(model=model, layer=layer_type, m=m, context=args.context)
                rows.append(row)
                print(row, flush=True)
                (args.out / f"{model}-{layer_type}-m{m}.txt").write_text(text)
    (args.out / "eager_profile.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
