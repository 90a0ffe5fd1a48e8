"""The paged cache and the one batched forward path: pooled batches compute what sequences run
alone compute, one ``forward_mqa`` call a step, window blocks freed, forks, capacity errors
before any write, multi-step calls all or nothing."""

from __future__ import annotations

import pytest
import torch

from dsv4 import CacheCapacityError
from dsv4.testing.probes import spy_methods

from conftest import RATIOS, random_x

PROMPTS = (3, 15, 16, 33, 130)
STEPS = 9


@pytest.mark.parametrize("ratio", RATIOS)
def test_pooled_batches_equal_sequences_alone_float64(tiny_exact, make_layer, ratio):
    layer = make_layer(tiny_exact, ratio, torch.float64)
    xs = [random_x(n + STEPS, tiny_exact.hidden_size, seed=i) for i, n in enumerate(PROMPTS)]
    max_len = max(PROMPTS) + STEPS
    pooled = layer.new_caches(len(PROMPTS), max_len)
    alone = [layer.new_cache(max_len) for _ in PROMPTS]
    # prompts of all sequences in one mixed call to the pool, one call each alone
    lens = list(PROMPTS)
    got = [layer(torch.cat([x[:n] for x, n in zip(xs, lens, strict=True)]),
                 torch.cat([torch.arange(n) for n in lens]), pooled, seq_lens=lens)]
    want = [torch.cat([layer(x[:n], torch.arange(n), c)
                       for x, n, c in zip(xs, lens, alone, strict=True)])]
    with spy_methods(layer, ["forward_mqa"]) as calls:
        for s in range(STEPS):
            x = torch.stack([x[n + s] for x, n in zip(xs, lens, strict=True)])
            pos = torch.tensor([n + s for n in lens])
            got.append(layer(x, pos, pooled))
    n_attn = len(calls["forward_mqa"])
    assert "forward_mqa" not in layer.__dict__  # the spy is gone: nothing more is recorded
    for s in range(STEPS):
        x = torch.stack([x[n + s] for x, n in zip(xs, lens, strict=True)])
        want.append(torch.cat([layer(x[i:i + 1], torch.tensor([n + s]), c)
                               for i, (n, c) in enumerate(zip(lens, alone, strict=True))]))
    assert n_attn == STEPS  # one batched attention call a step
    assert (torch.cat(got) - torch.cat(want)).abs().max() <= 1e-12


@pytest.mark.parametrize("ratio", RATIOS)
def test_window_blocks_are_freed_and_memory_is_flat(tiny, make_layer, ratio):
    layer = make_layer(tiny, ratio)
    cache = layer.new_cache(4096)
    x = random_x(700, tiny.hidden_size, seed=1).bfloat16()
    layer(x[:600], torch.arange(600), cache)
    kv = cache.pool.stores["kv"]
    # window 16, blocks of 64 rows: at most one or two blocks held after 600 positions
    assert kv.held_blocks(cache.slot) <= 2
    before = cache.held_bytes()
    for p in range(600, 700):
        layer(x[p:p + 1], torch.tensor([p]), cache)
    assert kv.held_blocks(cache.slot) <= 2
    if ratio == 0:
        assert cache.held_bytes() == before  # SWA-only: independent of the context


@pytest.mark.parametrize("ratio", RATIOS)
def test_forks_decode_like_runs_from_scratch(tiny_exact, make_layer, ratio):
    layer = make_layer(tiny_exact, ratio, torch.float64)
    h = tiny_exact.hidden_size
    prefix = random_x(70, h, seed=2)
    tails = [random_x(20, h, seed=3), random_x(20, h, seed=4)]
    pool = layer.new_cache_pool(4, 128)
    parent = pool.add_sequence()
    layer(prefix, torch.arange(70), parent)
    child = parent.fork()
    outs = []
    for c, tail in zip((parent, child), tails, strict=True):
        outs.append(torch.cat([layer(tail[i:i + 1], torch.tensor([70 + i]), c)
                               for i in range(20)]))
    for out, tail in zip(outs, tails, strict=True):
        fresh = layer.new_cache(128)
        layer(prefix, torch.arange(70), fresh)
        want = torch.cat([layer(tail[i:i + 1], torch.tensor([70 + i]), fresh)
                          for i in range(20)])
        assert torch.equal(out, want)
    parent.free()
    child.free()
    assert all(v == 0 for v in pool.blocks_in_use().values())


def test_running_out_of_blocks_is_an_error_before_any_write(tiny, make_layer):
    layer = make_layer(tiny, 4)
    pool = layer.new_cache_pool(2, 1024, capacity_tokens=256)
    a, b = pool.add_sequence(), pool.add_sequence()
    x = random_x(600, tiny.hidden_size, seed=5).bfloat16()
    layer(x[:300], torch.arange(300), a)
    used = pool.blocks_in_use()
    with pytest.raises(CacheCapacityError, match="compressed store"):
        layer(x[:300], torch.arange(300), b)
    assert b.length == 0 and pool.blocks_in_use() == used
    b.free()
    with pytest.raises(CacheCapacityError, match="sequence slots"):
        pool.add_sequence(), pool.add_sequence()


def test_blocks_needed_each_is_blocks_needed_per_pair(tiny, make_layer):
    """The plan's batched block count (one call per store) against the per-pair one, on slots
    holding none, some and released blocks."""
    layer = make_layer(tiny, 4)
    pool = layer.new_cache_pool(3, 1024)
    caches = [pool.add_sequence() for _ in range(3)]
    x = random_x(300, tiny.hidden_size, seed=6).bfloat16()
    layer(x[:300], torch.arange(300), caches[0])  # the kv window's early blocks released
    layer(x[:20], torch.arange(20), caches[1])
    slots = [c.slot for c in caches] * 4
    rows = [0, 1, 63, 64, 65, 300, 301, 640, 1000, 20, 21, 129]
    for store in pool.stores.values():
        assert store.blocks_needed_each(slots, rows) == [
            store.blocks_needed(s, n) for s, n in zip(slots, rows, strict=True)]
        assert sum(store.blocks_needed_each(slots, rows)) > 0
    with pytest.raises(ValueError):
        pool.stores["kv"].blocks_needed_each(slots, rows[:-1])


@pytest.mark.parametrize("ratio", RATIOS)
def test_a_long_call_runs_in_steps_all_or_nothing(tiny_exact, make_layer, ratio):
    cfg = tiny_exact.replace(max_step_tokens=40)
    layer = make_layer(cfg, ratio, torch.float64)
    whole = make_layer(tiny_exact, ratio, torch.float64)
    x = random_x(300, cfg.hidden_size, seed=6)
    cache = layer.new_cache(300)
    assert cache.pool.step_tokens == 40
    want = whole(x, torch.arange(300), whole.new_cache(300))
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("kernel failed")
        return type(layer).forward_mqa(layer, *args, **kwargs)

    layer.forward_mqa = failing
    with pytest.raises(RuntimeError, match="kernel failed"):
        layer(x, torch.arange(300), cache)
    del layer.forward_mqa
    assert cache.length == 0
    got = layer(x, torch.arange(300), cache)
    assert (got - want).abs().max() <= 1e-12


def test_each_step_queues_its_input_projections_before_its_plan(tiny, make_layer, monkeypatch):
    """A plain call runs stage 1 of each step before the step's host planning (blocks, metadata,
    upload), so that on a GPU the planning runs while the input GEMMs compute; a plan that then
    fails (no blocks left) has written nothing."""
    from dsv4.cache import step as step_module

    cfg = tiny.replace(max_step_tokens=40)
    layer = make_layer(cfg, 4)
    events: list[str] = []
    stage1 = layer._run_parallel_input_projections
    planner = step_module.CacheStep.plan

    def projections(x):
        events.append(f"stage 1 of {x.shape[0]}")
        return stage1(x)

    def plan(pool, caches, counts):
        events.append(f"plan of {sum(counts)}")
        return planner(pool, caches, counts)

    monkeypatch.setattr(layer, "_run_parallel_input_projections", projections)
    monkeypatch.setattr(step_module.CacheStep, "plan", staticmethod(plan))
    cache = layer.new_cache(300)
    x = random_x(100, cfg.hidden_size, seed=4).bfloat16()
    layer(x, torch.arange(100), cache)
    assert events == ["stage 1 of 40", "plan of 40", "stage 1 of 40", "plan of 40",
                      "stage 1 of 20", "plan of 20"]

    pool = layer.new_cache_pool(2, 1024, capacity_tokens=256)
    a, b = pool.add_sequence(), pool.add_sequence()
    layer(x[:40], torch.arange(40), a)
    used, events[:] = pool.blocks_in_use(), []
    with pytest.raises(CacheCapacityError):
        layer(random_x(1000, cfg.hidden_size, seed=5).bfloat16(), torch.arange(1000), b)
    assert events[-2:] == ["stage 1 of 40", "plan of 40"]  # the failing plan came after stage 1
    assert b.length == 0 and pool.blocks_in_use() == used and a.length == 40


@pytest.mark.parametrize("ratio", RATIOS)
def test_a_call_that_fails_late_leaves_the_cache_usable(tiny_exact, make_layer, ratio):
    layer = make_layer(tiny_exact, ratio, torch.float64)
    x = random_x(300, tiny_exact.hidden_size, seed=9)
    chunks = [(0, 7), (7, 6), (13, 130), (143, 1), (144, 100)]

    def run(fail_at):
        cache, outs = layer.new_cache(300), []
        for i, (s, n) in enumerate(chunks):
            if i == fail_at:
                def boom(*args, **kwargs):
                    raise RuntimeError("kernel failed")
                layer.forward_mqa = boom
                with pytest.raises(RuntimeError, match="kernel failed"):
                    layer(x[s:s + n], torch.arange(s, s + n), cache)
                del layer.forward_mqa
                assert cache.length == s
            outs.append(layer(x[s:s + n], torch.arange(s, s + n), cache))
        return torch.cat(outs)

    want = run(None)
    for fail_at in range(1, len(chunks)):
        assert torch.equal(run(fail_at), want)


def test_cache_repr_is_short_and_bad_sizes_are_clear(tiny, make_layer):
    layer = make_layer(tiny, 4)
    cache = layer.new_cache(64)
    assert len(repr(cache)) < 120 and "length=0" in repr(cache)
    assert "CachePool" in repr(cache.pool) and len(repr(cache.pool)) < 300
    for bad in (2.5, 0, -1, True):
        with pytest.raises(ValueError, match="max_seq_len"):
            layer.new_cache(bad)


def test_truncate_rolls_back_one_decode_step(tiny, make_layer):
    layer = make_layer(tiny, 128)
    cache = layer.new_cache(300)
    x = random_x(201, tiny.hidden_size, seed=7).bfloat16()
    layer(x[:200], torch.arange(200), cache)
    y1 = layer(x[200:], torch.tensor([200]), cache)
    cache.truncate(200)
    assert torch.equal(layer(x[200:], torch.tensor([200]), cache), y1)
    with pytest.raises(ValueError, match="truncate"):
        cache.truncate(10)
