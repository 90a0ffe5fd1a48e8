"""Kernel launches of one decode step of an attention stack (the ``cuda`` platform): a step
planned as the single-layer graph rows capture it (``StepPlan`` without padding) against the
decode runner's padded step, at a position where no compressed entry completes and at one
where a C4 entry does.

The single-layer rows (``dsv4 bench decode-step``, the sums of ``dsv4 bench model-decode``)
are captured at the first kind of position; the runner's padded step launches every
compressor's entry kernels each step whatever the position (their jobs padded to a fixed
count), which the rows do not hold.

    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/step_launches.py   # no GPU: Triton's
    PYTHONPATH=src python3 benchmarks/step_launches.py                     # interpreter; GPU

The tiny preset's SWA, C4 and C128 layers, one sequence with 513 positions of history. Counts
every launch through ``dsv4.kernels.bound_launch.launch`` (the step's Triton kernels; cuBLAS
and PyTorch operations are not counted; under the interpreter the attention takes its PyTorch
path, and the tiny preset has no fp8 GEMMs: those launches are missing there, in both plans
alike). Prints a markdown table.
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Callable
from typing import Any

import torch

import dsv4.kernels.bound_launch as bound_launch
from dsv4 import DSV4Config
from dsv4.bench.synthetic_cache import fill_history
from dsv4.cache.plan import StepPlan
from dsv4.kernels.launch import _INTERPRET, triton_available
from dsv4.passes import process_weights_after_loading
from dsv4.runner import DecodeRunner
from dsv4.testing.cpu_cuda_layer import build_cpu_cuda_layer, cpu_stand_ins
from dsv4.testing.random_weights import random_layer_weights

HISTORY = 513
"""Positions before the step: position 513 completes no entry ((513 + 1) % 4 != 0)."""


def count_launches() -> tuple[collections.Counter[str], Callable[[], None]]:
    """(a counter of launches by kernel name, a function that restores ``launch``)."""
    counts: collections.Counter[str] = collections.Counter()
    real = bound_launch.launch

    def spy(kernel: Any, grid: Any, *args: Any, **kwargs: Any) -> Any:
        fn = getattr(kernel, "fn", kernel)
        counts[getattr(fn, "__name__", str(kernel))] += 1
        return real(kernel, grid, *args, **kwargs)

    patched = [m for name, m in list(sys.modules.items())
               if name.startswith("dsv4.") and getattr(m, "launch", None) is real]
    for m in patched:
        m.launch = spy  # type: ignore[attr-defined]

    def restore() -> None:
        for m in patched:
            m.launch = real  # type: ignore[attr-defined]

    return counts, restore


def build_layers(device: str) -> tuple[DSV4Config, list[Any]]:
    """The tiny preset's SWA, C4 and C128 layers, their step kernels on, no layer graphs."""
    from dsv4.platforms.cuda import CudaAttention

    cfg = DSV4Config.preset("tiny")
    if device == "cpu":
        return cfg, [build_cpu_cuda_layer(cfg, ratio) for ratio in (0, 4, 128)]
    layers = []
    for ratio in (0, 4, 128):
        lid = cfg.layer_of_ratio(ratio)
        layer = CudaAttention(cfg, lid, device=device, dtype=torch.bfloat16)
        layer.load_weights(random_layer_weights(cfg, lid).items())
        process_weights_after_loading(layer)
        layer.use_cuda_graphs(False)
        layers.append(layer)
    return cfg, layers


def main() -> int:
    if not triton_available() or not (torch.cuda.is_available() or _INTERPRET):
        raise SystemExit("step_launches needs Triton and a CUDA GPU, or TRITON_INTERPRET=1")
    device = "cuda" if torch.cuda.is_available() and not _INTERPRET else "cpu"
    if device == "cpu":
        for obj, name, value in cpu_stand_ins():
            setattr(obj, name, value)
    cfg, layers = build_layers(device)
    pools = [layer.new_cache_pool(2, 1024) for layer in layers]
    seqs = [[p.add_sequence() for p in pools]]
    for k in range(len(layers)):
        fill_history([s[k] for s in seqs], HISTORY, seed=k)
    x = torch.randn(1, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    x = x.to(device, torch.bfloat16)

    def stack(plan: StepPlan, x: torch.Tensor) -> torch.Tensor:
        for layer in layers:
            x = x + layer(x, plan=plan)
        return x

    counts, restore = count_launches()
    rows: dict[str, dict[str, int]] = {}
    try:
        for extra in (0, 2):  # position 513: no entry completes; 515: a C4 entry completes
            for s in seqs:
                for c in s:
                    c.truncate(HISTORY)
            if extra:
                with StepPlan(seqs, [extra]) as plan:
                    stack(plan, x.expand(extra, -1).contiguous())
            pos = HISTORY + extra
            for kind in ("unpadded", "padded"):
                counts.clear()
                if kind == "unpadded":
                    with StepPlan(seqs) as plan:
                        stack(plan, x)
                else:
                    DecodeRunner(stack, mode="padded")(seqs, x)
                rows[f"position {pos}, {kind}"] = dict(counts)
                for s in seqs:
                    for c in s:
                        c.truncate(pos)
    finally:
        restore()
    names = sorted({k for r in rows.values() for k in r})
    print("| kernel | " + " | ".join(rows) + " |")
    print("|---|" + "---|" * len(rows))
    for name in names:
        print(f"| `{name}` | " + " | ".join(str(r.get(name, 0)) for r in rows.values()) + " |")
    print("| all | " + " | ".join(str(sum(r.values())) for r in rows.values()) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
