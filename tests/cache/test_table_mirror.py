"""The device mirror of every block table is current whenever a step runs.

Every store keeps its table on the host and a mirror where its data lives (on the CPU a tensor of
its own, so the CPU runs the copies a GPU needs). Here, in every step of a stack - a runner's
padded steps and plain calls - each layer's step starts by checking its pool's mirrors against
their tables, as sequences join, fork, leave and are truncated. A fork's new table rows once waited
for the next step that took a block in that pool; until then the child's rows were read and written
through whatever the mirror's row held (-1, or a freed sequence's blocks): on a GPU another
sequence's rows or memory outside the store (the GPU runner test,
``tests/platforms/test_runner_cuda.py``; on the CPU, where table and mirror were then one tensor,
nothing showed)."""

from __future__ import annotations

import random

import torch

from dsv4.cache.plan import StepPlan
from dsv4.runner import DecodeRunner

from conftest import random_x


def _run(make_layer, tiny_exact):
    """A stack of SWA, C4 and C128 layers over 80 steps of a runner's padded steps and plain
    calls, the mirrors of a layer's pool checked against their tables as the layer's step starts:
    (step, store, slots) of each stale mirror, and how many stores there are."""
    cfg = tiny_exact.replace(compress_ratios=(0, 4, 128), num_hidden_layers=3)
    layers = [make_layer(cfg, r, dtype=torch.float64, seed=i) for i, r in enumerate((0, 4, 128))]
    stale: list[tuple[int, str, list[int]]] = []
    step_no = [0]

    def checked(layer_step):
        """The layer's step (after its plan, before it reads a table), its pool's mirrors
        checked first."""
        def run(x, step):
            for s in step.pool.stores.values():
                assert s.table_dev is not s.table
                if not torch.equal(s.table_dev, s.table):
                    rows = (s.table_dev != s.table).any(1).nonzero().flatten().tolist()
                    stale.append((step_no[0], s.name, rows))
            return layer_step(x, step)
        return run

    for lay in layers:
        lay._step = checked(lay._step)

    def step_fn(plan, x):
        for lay in layers:
            x = x + lay(torch.tanh(x), plan=plan)
        return x

    runner = DecodeRunner(step_fn, mode="padded", buckets=(1, 2, 4, 8))
    pools = [lay.new_cache_pool(8, 500, max_rollback=2) for lay in layers]
    live: list[list] = []
    rng = random.Random(11)
    for n in (70, 3, 130):
        live.append([p.add_sequence() for p in pools])
        with StepPlan([live[-1]], [n]) as plan:
            step_fn(plan, random_x(n, cfg.hidden_size, seed=n))
    for step in range(80):
        step_no[0] = step
        event = rng.random()
        if event < 0.15 and len(live) < 8:
            live.append([c.fork() for c in live[rng.randrange(len(live))]])
        elif event < 0.22 and len(live) > 1:
            for c in live.pop(rng.randrange(len(live))):
                c.free()
        elif event < 0.27:  # one sequence forgets its last token
            for c in live[rng.randrange(len(live))]:
                c.truncate(c.length - 1)
        x = random_x(len(live), cfg.hidden_size, seed=1000 + step)
        if step % 3:
            runner(live, x)
        else:  # plain calls, one pool per layer
            pos = torch.tensor([q[0].length for q in live])
            for k, lay in enumerate(layers):
                x = x + lay(torch.tanh(x), pos, [q[k] for q in live])
    return stale, sum(len(p.stores) for p in pools)


def test_every_step_finds_every_table_mirrored(make_layer, tiny_exact):
    stale, n_stores = _run(make_layer, tiny_exact)
    assert n_stores == 6 and not stale, stale[:5]  # SWA kv; C4 kv, entries, keys; C128 two
