"""The device mirror of every block table is current whenever a step runs.

On the CPU a store's table and its "device" mirror are one tensor, so a table change that was
never copied over cannot show there. Here each store gets a mirror of its own (the copies plain
``copy_``), as on a GPU: every step must find every mirror equal to its table and compute what the
shared-table run computes, as sequences join, fork, leave and are truncated. A fork's new table
rows once waited for the next step that took a block in that pool; until then the child's rows
were read and written through whatever the mirror's row held (-1, or a freed sequence's blocks),
which on a GPU read another sequence's rows or memory outside the store (the GPU runner test,
``tests/platforms/test_runner_cuda.py``)."""

from __future__ import annotations

import random

import torch

from dsv4.cache import store as store_module
from dsv4.cache.plan import StepPlan
from dsv4.runner import DecodeRunner

from conftest import random_x


def _run(make_layer, tiny_exact, stores=None):
    """A stack of SWA, C4 and C128 layers over 80 steps of a runner's padded steps and plain
    calls; with ``stores``, every mirror checked against its table at each step's start."""
    cfg = tiny_exact.replace(compress_ratios=(0, 4, 128), num_hidden_layers=3)
    layers = [make_layer(cfg, r, dtype=torch.float64, seed=i) for i, r in enumerate((0, 4, 128))]
    stale: list[tuple[int, str, list[int]]] = []
    step_no = [0]

    def step_fn(plan, x):
        for s in stores or ():
            if not torch.equal(s.table_dev, s.table):
                rows = (s.table_dev != s.table).any(1).nonzero().flatten().tolist()
                stale.append((step_no[0], s.name, rows))
        for lay in layers:
            x = x + lay(torch.tanh(x), plan=plan)
        return x

    runner = DecodeRunner(step_fn, mode="padded", buckets=(1, 2, 4, 8))
    pools = [lay.new_cache_pool(8, 500, max_rollback=2) for lay in layers]
    live: list[list] = []
    rng = random.Random(11)
    outs = []
    for n in (70, 3, 130):
        live.append([p.add_sequence() for p in pools])
        with StepPlan([live[-1]], [n]) as plan:
            outs.append(step_fn(plan, random_x(n, cfg.hidden_size, seed=n)))
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
            outs.append(runner(live, x))
        else:  # plain calls, one pool per layer
            pos = torch.tensor([q[0].length for q in live])
            for k, lay in enumerate(layers):
                x = x + lay(torch.tanh(x), pos, [q[k] for q in live])
            outs.append(x)
    return outs, stale


def test_every_step_finds_its_tables_mirrored_and_computes_what_shared_tables_do(
        make_layer, tiny_exact, monkeypatch):
    shared, _ = _run(make_layer, tiny_exact)
    made: list[store_module.PagedStore] = []
    init = store_module.PagedStore.__init__

    def own_mirror(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.table_dev = self.table.clone()
        made.append(self)

    monkeypatch.setattr(store_module.PagedStore, "__init__", own_mirror)
    monkeypatch.setattr(store_module, "upload_into", lambda dst, host: dst.copy_(host))
    mirrored, stale = _run(make_layer, tiny_exact, made)
    assert len(made) == 6 and not stale, stale[:5]  # SWA kv; C4 kv, entries, keys; C128 two
    assert len(shared) == len(mirrored)
    for i, (a, b) in enumerate(zip(shared, mirrored, strict=True)):
        assert torch.equal(a, b), i
