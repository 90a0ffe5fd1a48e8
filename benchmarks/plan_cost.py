"""Host time of planning a decode step (one token per sequence): what a serving loop pays on
the CPU per step. Per layer type and M, best of 7 batches of 60 steps: a layer planning its own
step (``CacheStep.plan``, what ``layer(x, positions, caches)`` does) and a model's
``StepPlan`` over 8 layers of the type (one metadata build and upload for all of them; blocks
and tables per layer), per layer; then a layer planning its own step over sequences of
staggered lengths (600 + i: a quarter of them complete a C4 entry each step) with the decode
metadata as shipped and in plain Python only (``DECODE_NUMPY_WORK``), alternating in one run;
the decode metadata alone in plain Python and in NumPy by M and completing sequences (the
calibration of ``DECODE_NUMPY_WORK``), and padded to the decode runner's buckets; the runner's
host work per step over 8 layers; then ``CacheStep.commit`` by context, a rollback of rejected
drafts, and a whole 43-layer model's plan and commit; the host work of one plain decode
call through its layer's step graph, the replay left out; last, a prefill step's metadata and
plan (one sequence of 2048 / 8192 tokens, 16 of 512).

    PYTHONPATH=src python benchmarks/plan_cost.py          # every section
    PYTHONPATH=src python benchmarks/plan_cost.py plain    # the plain call's host work only
    PYTHONPATH=src python benchmarks/plan_cost.py runner   # the runner's per step only
    PYTHONPATH=src python benchmarks/plan_cost.py prefill  # a prefill step's only

The tiny preset's pools (the plan's work depends on M, the ratio and the block size, not on the
model's dims); 600 positions of synthetic history per sequence.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch

from dsv4 import runner as runner_module
from dsv4.bench.synthetic_cache import fill_history
from dsv4.cache import plan as plan_module
from dsv4.cache import step as step_module
from dsv4.cache.plan import StepPlan
from dsv4.cache.step import CacheStep, build_metadata, completing, decode_work, ring_specs
from dsv4.config import DSV4Config
from dsv4.platforms import build_attention
from dsv4.runner import DecodeRunner

LAYERS = 8


def main() -> None:
    cfg = DSV4Config.preset("tiny")
    for ratio in (4, 128, 0):
        c = cfg.replace(compress_ratios=(ratio,) * LAYERS, num_hidden_layers=LAYERS)
        layers = [build_attention(c, i, dtype=torch.bfloat16) for i in range(LAYERS)]
        for m in (1, 16, 64):
            pools = [lay.new_cache_pool(m, 2048) for lay in layers]
            seqs = [[p.add_sequence() for p in pools] for _ in range(m)]
            for k in range(LAYERS):
                fill_history([s[k] for s in seqs], 600)
            own = planned = float("inf")
            first = [s[0] for s in seqs]
            for _ in range(7):
                t0 = time.perf_counter()
                for _ in range(60):
                    CacheStep.plan(pools[0], first, [1] * m)
                own = min(own, (time.perf_counter() - t0) / 60)
                spent = 0.0
                for _ in range(60):
                    t0 = time.perf_counter()
                    plan = StepPlan(seqs)
                    spent += time.perf_counter() - t0
                    plan.rollback()
                planned = min(planned, spent / 60 / LAYERS)
            print(f"ratio {ratio:3d} M={m:2d}: {own * 1e6:6.0f} us a layer planning its own, "
                  f"{planned * 1e6:6.0f} us per layer of a {LAYERS}-layer StepPlan", flush=True)
    staggered_cost()
    metadata_cost()
    padded_metadata_cost()
    runner_step_cost()
    commit_cost()


def staggered_cost() -> None:
    """A C4 layer planning its own decode step over sequences of lengths 600 + i: the decode
    metadata as shipped (NumPy where the step's work makes it cheaper) against plain Python
    only, alternating batches, best of 7 each."""
    cfg = DSV4Config.preset("tiny")
    layer = build_attention(cfg, cfg.layer_of_ratio(4), dtype=torch.bfloat16)
    shipped = step_module.DECODE_NUMPY_WORK
    for m in (16, 32, 64, 128):
        pool = layer.new_cache_pool(m, 2048)
        caches = [pool.add_sequence() for _ in range(m)]
        for i, c in enumerate(caches):
            fill_history([c], 600 + i, seed=i)
        best = _alternating(partial(CacheStep.plan, pool, caches, [1] * m),
                            {"shipped": shipped, "python": PYTHON_ONLY}, 7, 60)
        print(f"ratio   4 M={m:3d}, staggered lengths: {best['shipped'] * 1e6:6.0f} us a layer "
              f"planning its own (plain Python only: {best['python'] * 1e6:6.0f} us)", flush=True)


def _alternating(build: Any, thresholds: dict[str, int], batches: int, calls: int
                 ) -> dict[str, float]:
    """Seconds of one ``build()`` under each ``DECODE_NUMPY_WORK`` of ``thresholds`` (name ->
    value; 0 forces NumPy, a huge value plain Python), the values taking turns, best of
    ``batches`` batches of ``calls`` each; the shipped value restored after."""
    shipped = step_module.DECODE_NUMPY_WORK
    best = dict.fromkeys(thresholds, float("inf"))
    try:
        for _ in range(batches):
            for name, threshold in thresholds.items():
                step_module.DECODE_NUMPY_WORK = threshold
                t0 = time.perf_counter()
                for _ in range(calls):
                    build()
                best[name] = min(best[name], (time.perf_counter() - t0) / calls)
    finally:
        step_module.DECODE_NUMPY_WORK = shipped
    return best


PYTHON_ONLY = 1 << 60
BOTH_PATHS = {"python": PYTHON_ONLY, "numpy": 0}


def metadata_cost() -> None:
    """The calibration of ``DECODE_NUMPY_WORK``: a C4 pool's decode metadata (``build_metadata``)
    in plain Python and in NumPy, both forced, alternating, best of 10 batches each, by M and by
    how many sequences complete an entry (none, a quarter, all) - with the step's work (tokens +
    completed entries' sources)."""
    cfg = DSV4Config.preset("tiny")
    layer = build_attention(cfg, cfg.layer_of_ratio(4), dtype=torch.bfloat16)
    specs = ring_specs(layer.new_cache_pool(128, 2048))
    for m in (16, 32, 64, 128):
        for done, starts in (("none", [600] * m), ("a quarter", [600 + i for i in range(m)]),
                             ("all", [603] * m)):
            work = decode_work(completing(starts, specs), specs, m, None)
            best = _alternating(partial(build_metadata, starts, list(range(m)), [1] * m, specs),
                                BOTH_PATHS, 10, 60)
            print(f"decode metadata M={m:3d}, {done:9s} completing (work {work:4d}): plain "
                  f"Python {best['python'] * 1e6:5.0f} us, NumPy {best['numpy'] * 1e6:5.0f} us",
                  flush=True)


def padded_metadata_cost() -> None:
    """The decode runner's padded steps (``pad_to``: a bucket of sequences and as many job rows per
    compressor, most of them padding): a C4 and a C128 pool's decode metadata in plain Python and
    in NumPy, both forced, alternating, best of 10 batches each, by M and its bucket (lengths 600 +
    3i), with the step's work as ``DECODE_NUMPY_WORK`` counts it and the path it picks."""
    cfg = DSV4Config.preset("tiny")
    for ratio in (4, 128):
        layer = build_attention(cfg, cfg.layer_of_ratio(ratio), dtype=torch.bfloat16)
        pool = layer.new_cache_pool(64, 2048)
        specs = ring_specs(pool)
        shipped = step_module.DECODE_NUMPY_WORK
        for m, bucket in ((1, 1), (2, 2), (3, 4), (16, 16), (32, 32), (64, 64)):
            starts = [600 + 3 * i for i in range(m)]
            work = decode_work(completing(starts, specs), specs, bucket, bucket)
            best = _alternating(partial(build_metadata, starts, list(range(m)), [1] * m, specs,
                                        (bucket, 1), pool.pad_slot), BOTH_PATHS, 10, 60)
            picks = "NumPy" if work >= shipped else "plain Python"
            print(f"padded decode metadata ratio {ratio:3d} M={m:2d} (bucket {bucket:2d}, work "
                  f"{work:5d}, picks {picks}): plain Python {best['python'] * 1e6:5.0f} us, "
                  f"NumPy {best['numpy'] * 1e6:5.0f} us", flush=True)


def runner_step_cost() -> None:
    """The decode runner's host work per step - its padded plan into the bucket's buffer and
    the commit, no layers (``step_fn`` returns its input) - over 8 layers in Flash's schedule
    (SWA, SWA, then C4 / C128), by M: the metadata built on the host (as before 2026-12-08)
    against its seed (the expanding launch left out, as inside a replayed graph), taking turns,
    best of 10 batches of 30 steps each."""
    ratios = [0, 0, 4, 128, 4, 128, 4, 128]
    cfg = DSV4Config.preset("tiny")
    cfg = cfg.replace(compress_ratios=tuple(ratios), num_hidden_layers=len(ratios))
    layers = [build_attention(cfg, i, dtype=torch.bfloat16) for i in range(len(ratios))]
    for m in (1, 16, 64):
        pools = [layer.new_cache_pool(m, 2048) for layer in layers]
        seqs = [[p.add_sequence() for p in pools] for _ in range(m)]
        for k in range(len(layers)):
            fill_history([s[k] for s in seqs], 600)
        x = torch.zeros(m, 8)
        best = _taking_turns(
            {"host": (partial(DecodeRunner(lambda plan, x: x, mode="padded"), seqs, x),
                      _host_built_metadata),
             "seed": (partial(DecodeRunner(lambda plan, x: x, mode="padded"), seqs, x),
                      _expansion_on_the_device)}, 10, 30)
        print(f"runner step, 8 layers M={m:2d}: {best['host'] * 1e6:5.0f} us with the metadata "
              f"built on the host, {best['seed'] * 1e6:5.0f} us with its seed", flush=True)


def _taking_turns(arms: dict[str, tuple[Any, Any]], batches: int, calls: int
                  ) -> dict[str, float]:
    """Seconds of one call of each arm (name -> (call, the context it runs in)), the arms
    taking turns, best of ``batches`` batches of ``calls`` after one untimed batch each."""
    best = dict.fromkeys(arms, float("inf"))
    for batch in range(batches + 1):
        for name, (call, context) in arms.items():
            with context():
                t0 = time.perf_counter()
                for _ in range(calls):
                    call()
                if batch:
                    best[name] = min(best[name], (time.perf_counter() - t0) / calls)
    return best


def _plain_call(layer: Any, caches: list[Any], runner: DecodeRunner, x: torch.Tensor) -> None:
    """What ``CudaAttention._run_pool``'s step-graph path does on the host, the replay left
    out: the call's checks, then the layer's runner over its sequences."""
    layer._plan_call(x, torch.tensor([c.length for c in caches]), caches, None)
    runner([[c] for c in caches], x)


def plain_call_cost() -> None:
    """The host work of one plain decode call ``layer(x, positions, caches)`` that replays its
    layer's step graph (the ``cuda`` platform's ``_run_pool``), the replay and the GPU's copies
    left out: the call's checks (``_plan_call``) and the layer's own runner over its sequences
    with a step that returns its input (the padded plan into the bucket's buffer, the commit),
    one token per sequence, by layer type and M; best of 7 batches of 60 calls, the two ways of
    making the metadata taking turns: built on the host (``host``) and the seed the device
    expands (``seed``, the runner's way since 2026-12-08: the expanding launch is inside the
    replayed graph, so it is left out here as the replay is). Each call advances the sequences
    by one token, as decoding does. On a GPU a call adds its replay and a few copies'
    launches."""
    cfg = DSV4Config.preset("tiny")
    for ratio in (4, 128, 0):
        c = cfg.replace(compress_ratios=(ratio,), num_hidden_layers=1)
        layer = build_attention(c, 0, dtype=torch.bfloat16)
        for m in (1, 16, 64):
            pool = layer.new_cache_pool(m, 2048)
            caches = [pool.add_sequence() for _ in range(m)]
            fill_history(caches, 600)
            x = torch.zeros(m, c.hidden_size, dtype=torch.bfloat16)
            best = _taking_turns(
                {"host": (partial(_plain_call, layer, caches,
                                  DecodeRunner(lambda plan, x: x, mode="padded"), x),
                          _host_built_metadata),
                 "seed": (partial(_plain_call, layer, caches,
                                  DecodeRunner(lambda plan, x: x, mode="padded"), x),
                          _expansion_on_the_device)}, 7, 60)
            print(f"plain call, ratio {ratio:3d} M={m:2d}: {best['host'] * 1e6:5.0f} us of host "
                  f"work with the metadata built on the host, {best['seed'] * 1e6:5.0f} with "
                  "its seed", flush=True)


@contextmanager
def _host_built_metadata() -> Iterator[None]:
    """The runner's plans build their metadata on the host (as before 2026-12-08)."""
    real = runner_module.StepPlan

    def host_built(*args: Any, **kwargs: Any) -> StepPlan:
        return real(*args, **{**kwargs, "metadata_on_device": False})

    runner_module.StepPlan = host_built  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        runner_module.StepPlan = real  # type: ignore[misc]


@contextmanager
def _expansion_on_the_device() -> Iterator[None]:
    """The seed's expansion left to the device: inside a replayed graph it costs the host
    nothing (here it would run PyTorch operations on the CPU)."""
    real = plan_module.expand_decode_metadata
    plan_module.expand_decode_metadata = lambda *args: None
    try:
        yield
    finally:
        plan_module.expand_decode_metadata = real


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


def rollback_cost() -> None:
    """Host time of rolling back rejected drafts in one C4 layer after a verify step of 4
    tokens (``max_rollback=7``): ``truncate`` of one sequence by 3 positions, and
    ``truncate_many`` of 16 sequences (per sequence), by context - constant in the context (the
    block tables shrink by at most one block per store)."""
    cfg = DSV4Config.preset("tiny").replace(max_position_embeddings=65536)
    layer = build_attention(cfg, cfg.layer_of_ratio(4), dtype=torch.bfloat16)
    for context in (600, 8192, 32768):
        pool = layer.new_cache_pool(16, context + 512, max_rollback=7)
        caches = [pool.add_sequence() for _ in range(16)]
        fill_history(caches, context)
        one = many = float("inf")
        for _ in range(5):
            spent_one = spent_many = 0.0
            for _ in range(30):
                CacheStep.plan(pool, caches, [4] * 16).commit()
                t0 = time.perf_counter()
                caches[0].truncate(caches[0].length - 3)
                spent_one += time.perf_counter() - t0
                t0 = time.perf_counter()
                pool.truncate_many(caches[1:], [c.length - 3 for c in caches[1:]])
                spent_many += (time.perf_counter() - t0) / 15
            one = min(one, spent_one / 30)
            many = min(many, spent_many / 30)
        print(f"context {context:5d}: rollback by 3 in one C4 layer: {one * 1e6:5.1f} us "
              f"(truncate, one sequence), {many * 1e6:5.1f} us per sequence (truncate_many "
              "of 15)", flush=True)


def model_step_cost() -> None:
    """Host time of a whole model's step: ``StepPlan`` and its commit over 43 layers in
    Flash's schedule (SWA, SWA, then C4 / C128 alternating), the tiny preset's pools, by M -
    what the decode runner pays per step on the host (the commit while the GPU replays)."""
    ratios = [0, 0] + [4, 128] * 20 + [4]
    cfg = DSV4Config.preset("tiny")
    cfg = cfg.replace(compress_ratios=tuple(ratios), num_hidden_layers=len(ratios))
    layers = [build_attention(cfg, i, dtype=torch.bfloat16) for i in range(len(ratios))]
    for m in (1, 16, 64):
        pools = [layer.new_cache_pool(m, 2048) for layer in layers]
        seqs = [[p.add_sequence() for p in pools] for _ in range(m)]
        for k in range(len(layers)):
            fill_history([s[k] for s in seqs], 600)
        plan_best = commit_best = float("inf")
        for _ in range(5):
            spent_plan = spent_commit = 0.0
            for _ in range(20):
                t0 = time.perf_counter()
                plan = StepPlan(seqs)
                t1 = time.perf_counter()
                plan.commit()
                spent_plan += t1 - t0
                spent_commit += time.perf_counter() - t1
            plan_best = min(plan_best, spent_plan / 20)
            commit_best = min(commit_best, spent_commit / 20)
        print(f"{len(layers)} layers M={m:2d}: StepPlan {plan_best * 1e3:5.2f} ms, commit "
              f"{commit_best * 1e3:5.2f} ms", flush=True)


def prefill_step_cost() -> None:
    """Host time of a prefill step of a C4 layer (its two compressors' rings): the metadata
    alone (``build_metadata``) and the layer's own plan of the step (``CacheStep.plan``: blocks,
    metadata, upload - on the CPU a copy) with its commit, for one sequence of 2048 and 8192
    tokens from position 0 and for 16 sequences of 512; best of 7 batches of 20."""
    cfg = DSV4Config.preset("tiny").replace(max_position_embeddings=65536)
    layer = build_attention(cfg, cfg.layer_of_ratio(4), dtype=torch.bfloat16)
    for m, n in ((1, 2048), (1, 8192), (16, 512)):
        pool = layer.new_cache_pool(m, n + 64, step_tokens=m * n)
        specs = ring_specs(pool)
        meta = plan = float("inf")
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(20):
                build_metadata([0] * m, list(range(m)), [n] * m, specs)
            meta = min(meta, (time.perf_counter() - t0) / 20)
            spent = 0.0
            for _ in range(20):
                caches = [pool.add_sequence() for _ in range(m)]
                t0 = time.perf_counter()
                CacheStep.plan(pool, caches, [n] * m).commit()
                spent += time.perf_counter() - t0
                for c in caches:
                    c.free()
            plan = min(plan, spent / 20)
        print(f"prefill step, C4, {m} x {n} tokens: metadata {meta * 1e6:6.0f} us, plan and "
              f"commit {plan * 1e6:6.0f} us", flush=True)


if __name__ == "__main__":
    sections = {"plain": plain_call_cost, "runner": runner_step_cost,
                "prefill": prefill_step_cost}
    if len(sys.argv) == 2 and sys.argv[1] in sections:
        sections[sys.argv[1]]()
    elif sys.argv[1:]:
        sys.exit(f"usage: {sys.argv[0]} [{' | '.join(sections)}]")
    else:
        main()
        rollback_cost()
        model_step_cost()
        plain_call_cost()
        prefill_step_cost()
