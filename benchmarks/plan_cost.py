"""Host time of ``CacheStep.plan`` for one decode token per sequence (the per-layer, per-step
planning a serving loop pays on the CPU), per layer type and M; best of 7 batches of 60 calls:
as a model's first layer of a step plans it (its metadata built, uploaded and split) and as
each further layer does (that metadata shared: ``dsv4.cache.step._last_uploaded``); then
``CacheStep.commit`` by context.

    PYTHONPATH=src python benchmarks/plan_cost.py

The tiny preset's pools (the plan's work depends on M, the ratio and the block size, not on the
model's dims); 600 positions of synthetic history per sequence.
"""

from __future__ import annotations

import time

import torch

from dsv4.bench.synthetic_cache import fill_history
from dsv4.cache.step import CacheStep, forget_uploaded_metadata
from dsv4.config import DSV4Config
from dsv4.platforms import build_attention


def main() -> None:
    cfg = DSV4Config.preset("tiny")
    for ratio in (4, 128, 0):
        layer = build_attention(cfg, cfg.layer_of_ratio(ratio), dtype=torch.bfloat16)
        for m in (1, 16, 64):
            pool = layer.new_cache_pool(m, 2048)
            caches = [pool.add_sequence() for _ in range(m)]
            fill_history(caches, 600)
            first = further = float("inf")
            for _ in range(7):
                t0 = time.perf_counter()
                for _ in range(60):
                    forget_uploaded_metadata()
                    CacheStep.plan(pool, caches, [1] * m)
                first = min(first, (time.perf_counter() - t0) / 60)
                t0 = time.perf_counter()
                for _ in range(60):
                    CacheStep.plan(pool, caches, [1] * m)
                further = min(further, (time.perf_counter() - t0) / 60)
            print(f"ratio {ratio:3d} M={m:2d}: plan {first * 1e6:6.0f} us (first layer), "
                  f"{further * 1e6:6.0f} us (each further layer)", flush=True)
    commit_cost()


def commit_cost() -> None:
    """Host time of ``CacheStep.commit`` (lengths advanced, window blocks released) of a
    one-token-per-sequence step, 16 sequences, by context: the same at any context since the
    per-slot release watermark (769fe49: a release scans the blocks above the slot's watermark
    only)."""
    cfg = DSV4Config.preset("tiny").replace(max_position_embeddings=65536)
    layer = build_attention(cfg, cfg.layer_of_ratio(0), dtype=torch.bfloat16)
    m = 16
    for context in (600, 8192, 32768):
        pool = layer.new_cache_pool(m, context + 512)
        caches = [pool.add_sequence() for _ in range(m)]
        fill_history(caches, context)
        best = float("inf")
        for _ in range(5):
            spent = 0.0
            for _ in range(60):
                step = CacheStep.plan(pool, caches, [1] * m)
                t0 = time.perf_counter()
                step.commit()
                spent += time.perf_counter() - t0
            best = min(best, spent / 60)
        print(f"context {context:5d} M={m}: commit {best * 1e6:6.1f} us", flush=True)


if __name__ == "__main__":
    main()
