"""The step plan (:class:`dsv4.cache.plan.StepPlan`): one step's metadata for every layer of a
model, built and uploaded once; the layers' outputs and caches exactly as when each layer plans
its own step; all-or-nothing across layers; errors that name the culprit."""

from __future__ import annotations

import pytest
import torch

from dsv4.cache.blocks import CacheCapacityError
from dsv4.cache.plan import StepPlan, StepPlanError
from dsv4.cache.step import CacheStep

from conftest import layer_stack


def _stack(cfg, ratios):
    return layer_stack(cfg, ratios)


def _caches(layers, n, max_seq_len=600):
    pools = [lay.new_cache_pool(n + 2, max_seq_len) for lay in layers]
    return [[p.add_sequence() for p in pools] for _ in range(n)]


def _steps_equal(a: CacheStep, b: CacheStep) -> None:
    assert torch.equal(a.pos, b.pos) and torch.equal(a.tok_slot, b.tok_slot)
    assert a.jobs.keys() == b.jobs.keys()
    for name, job in a.jobs.items():
        other = b.jobs[name]
        assert job.count == other.count
        for f in ("slots", "entries", "ring_src", "call_src", "keep_dst", "keep_src"):
            assert torch.equal(getattr(job, f), getattr(other, f)), (name, f)


def test_layers_of_a_type_read_one_copy_equal_to_their_own_plans(tiny_exact):
    layers = _stack(tiny_exact, [4, 128, 4, 128, 0, 0])
    caches = _caches(layers, 3)
    lens = [5, 9, 3]
    x = torch.randn(sum(lens), tiny_exact.hidden_size, dtype=torch.float64)
    with StepPlan(caches, lens) as plan:
        for lay in layers:
            lay(x, plan=plan)
    plan = StepPlan(caches, [1, 1, 1])
    steps = [plan.step_for(lay) for lay in layers]
    assert steps[2].meta is steps[0].meta and steps[3].meta is steps[1].meta
    assert steps[5].meta is steps[4].meta and steps[1].meta is not steps[0].meta
    assert steps[0].jobs.keys() == {"compressed", "idx_keys"} and not steps[4].jobs
    plan.rollback()
    for k in range(len(layers)):
        col = [c[k] for c in caches]
        own = CacheStep.plan(col[0].pool, col, [1, 1, 1])
        _steps_equal(own, steps[k])
        own.pool.stores["kv"].sync()
    # a pool of the same type holding the sequences in other slots reads its own copy
    twin = _stack(tiny_exact, [4, 4])[1]
    shifted = twin.new_cache_pool(6, 600)
    shifted.add_sequence()
    fresh = [[layers[0].new_cache_pool(3, 600).add_sequence()] for _ in range(1)]
    pool0 = fresh[0][0].pool
    seqs = [fresh[0] + [shifted.add_sequence()], [pool0.add_sequence(), shifted.add_sequence()]]
    plan = StepPlan(seqs)
    a, b = plan.step_for(layers[0]), plan.step_for(twin)
    assert a.meta is not b.meta and a.tok_slot.tolist() == [0, 1]
    assert b.tok_slot.tolist() == [1, 2] and torch.equal(a.pos, b.pos)
    plan.rollback()


@pytest.mark.parametrize("counts", [[1, 1, 1], [3, 1, 7]])
def test_a_planned_model_step_equals_each_layer_planning_its_own(tiny_exact, counts):
    """Four layers (SWA, SWA, C4, C128) over 300 steps that cross window-block and
    compression boundaries: with one plan per step, outputs and caches are bit for bit those
    of the layers called on their own."""
    layers = _stack(tiny_exact, [0, 0, 4, 128])
    a, b = _caches(layers, 3, 2600), _caches(layers, 3, 2600)
    gen = torch.Generator().manual_seed(1)
    for step in range(300 if counts[0] == 1 else 60):
        lens = counts if step else [40, 7, 133]
        x = torch.randn(sum(lens), tiny_exact.hidden_size, dtype=torch.float64, generator=gen)
        ya = x
        with StepPlan(a, lens) as plan:
            for lay in layers:
                ya = ya + lay(ya, plan=plan)
        yb = x
        pos = torch.cat([torch.arange(s[0].length, s[0].length + n)
                         for s, n in zip(b, lens, strict=True)])
        for k, lay in enumerate(layers):
            yb = yb + lay(yb, pos, [s[k] for s in b], lens)
        assert torch.equal(ya, yb), step
    for sa, sb in zip(a, b, strict=True):
        for ca, cb in zip(sa, sb, strict=True):
            assert ca.length == cb.length
            for name in ca.pool.stores:
                n = ca.length if name == "kv" else None
                first = max(0, ca.length - tiny_exact.sliding_window + 1) if name == "kv" else 0
                assert torch.equal(ca.rows(name, first, n), cb.rows(name, first, n))


def test_a_failed_step_in_any_layer_leaves_every_cache_as_it_was(tiny_exact):
    layers = _stack(tiny_exact, [0, 4, 128])
    caches = _caches(layers, 2, 1200)
    x = torch.randn(300, tiny_exact.hidden_size, dtype=torch.float64)
    with StepPlan(caches, [250, 50]) as plan:
        for lay in layers:
            lay(x, plan=plan)
    pools = [c.pool for c in caches[0]]
    before = [(p.blocks_in_use(), [r.clone() for _, r in p.rings.values()],
               [p.stores[n].table.clone() for n in p.stores]) for p in pools]
    x2 = torch.randn(70, tiny_exact.hidden_size, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="boom"), StepPlan(caches, [64, 6]) as plan:
        layers[0](x2, plan=plan)
        layers[1](x2, plan=plan)  # writes rows, entries and rings
        raise RuntimeError("boom")
    for p, (blocks, rings, tables) in zip(pools, before, strict=True):
        assert p.blocks_in_use() == blocks
        assert all(torch.equal(r, s) for (_, r), s in zip(p.rings.values(), rings, strict=True))
        assert all(torch.equal(p.stores[n].table, t) for n, t in zip(p.stores, tables, strict=True))
    assert [c.length for s in caches for c in s] == [250] * 3 + [50] * 3
    with pytest.raises(StepPlanError, match="already committed or rolled back"):
        plan.commit()


def test_a_pool_without_blocks_fails_the_plan_with_nothing_taken(tiny_exact):
    layers = _stack(tiny_exact, [0, 4])
    small = layers[1].new_cache_pool(2, 4096, capacity_tokens=256)
    big = layers[0].new_cache_pool(2, 4096)
    caches = [[big.add_sequence(), small.add_sequence()]]
    with pytest.raises(CacheCapacityError, match="layer 1 cache pool, compressed store"):
        StepPlan(caches, [2000])
    assert big.blocks_in_use() == {"kv": 0} and caches[0][0].length == 0


def test_bad_plans_and_bad_uses_are_errors_naming_the_culprit(tiny_exact):
    layers = _stack(tiny_exact, [0, 4])
    caches = _caches(layers, 2)
    x = torch.randn(2, tiny_exact.hidden_size, dtype=torch.float64)
    with pytest.raises(StepPlanError, match="one list per sequence"):
        StepPlan(caches[0][0])
    with pytest.raises(StepPlanError, match=r"caches\[1\] has 1 caches"):
        StepPlan([caches[0], caches[1][:1]])
    with pytest.raises(StepPlanError, match="positive token count"):
        StepPlan(caches, [1, 0])
    with pytest.raises(StepPlanError, match="same layer id"):
        StepPlan([[caches[0][0], layers[0].new_cache()]])
    with pytest.raises(StepPlanError, match="appears twice"):
        StepPlan([caches[0], caches[0]])
    with StepPlan(caches[:1], [3]) as plan:
        for lay in layers:
            lay(torch.randn(3, tiny_exact.hidden_size, dtype=torch.float64), plan=plan)
    with pytest.raises(StepPlanError, match="holds 3 tokens in its first layer's cache but 0"):
        StepPlan([[caches[0][0], caches[1][1]]])
    with pytest.raises(StepPlanError, match="exceed layer 0's max_seq_len=600"):
        StepPlan(caches, [598, 1])
    plan = StepPlan(caches)
    from dsv4.attention import AttentionInputError

    with pytest.raises(AttentionInputError, match="give x only: the plan holds the step's cache"):
        layers[0](x, cache=caches[0][0], plan=plan)
    with pytest.raises(AttentionInputError, match=r"expects \[2, "):
        layers[0](x[:1], plan=plan)
    stranger = _stack(tiny_exact, [0, 0, 128])[2]
    with pytest.raises(StepPlanError, match="holds no caches of layer 2"):
        stranger(x, plan=plan)
    plan.commit()
    with pytest.raises(StepPlanError, match="step is over"):
        layers[0](x, plan=plan)
    assert [c.length for c in caches[0]] == [4, 4] and [c.length for c in caches[1]] == [1, 1]


def test_a_plan_that_cannot_be_made_takes_no_blocks(tiny_exact):
    layers = _stack(tiny_exact, [0, 4])
    caches = _caches(layers, 2)
    pools = [c.pool for c in caches[0]]
    before = [p.blocks_in_use() for p in pools]
    half = StepPlan.__new__(StepPlan)  # as a traceback's locals hold it
    with pytest.raises(StepPlanError, match="into: an int64"):
        half.__init__(caches, [100, 70], into=torch.zeros(3, dtype=torch.int64))
    assert repr(half) == "StepPlan(not made)"
    assert [p.blocks_in_use() for p in pools] == before
    assert [c.length for s in caches for c in s] == [0, 0, 0, 0]
    with pytest.raises(StepPlanError, match="pad_to"):
        half.__init__(caches, [1, 1], pad_to=(1, 1))
    assert repr(half) == "StepPlan(not made)"


def test_plans_into_one_buffer_reuse_its_views_and_read_each_steps_metadata(tiny_exact):
    """Plans written into one kept buffer (the decode runner's, per bucket) split it into the
    same view objects every step, and those views hold each step's own metadata: equal to a
    plan of the same step with a fresh upload."""
    layers = _stack(tiny_exact, [0, 4, 128])
    caches = _caches(layers, 3)
    for k, lay in enumerate(layers):  # some history, so that entries and windows move
        pos = torch.cat([torch.arange(20 + 3 * i) for i in range(3)])
        x = torch.randn(pos.numel(), tiny_exact.hidden_size, dtype=torch.float64)
        lay(x, pos, [s[k] for s in caches], seq_lens=[20 + 3 * i for i in range(3)])
    buffer: list[torch.Tensor] = []

    def into(size, layout):
        if not buffer:
            buffer.append(torch.zeros(size, dtype=torch.int64))
        return buffer[0]

    first = None
    for _ in range(9):  # across a compression boundary of ratio 4
        fresh = StepPlan(caches, pad_to=(4, 1), visible_caps={4: 16, 128: 1})
        fresh.rollback()
        kept = StepPlan(caches, pad_to=(4, 1), visible_caps={4: 16, 128: 1}, into=into)
        pos = kept.steps[id(caches[0][1].pool)].pos
        if first is None:
            first = pos
        assert pos is first  # the same view, not a new one per step
        for k in range(len(layers)):
            _steps_equal(kept.steps[id(caches[0][k].pool)], fresh.steps[id(caches[0][k].pool)])
        kept.commit()


@pytest.mark.parametrize("b", [3, 4, 5])
def test_a_seeded_decode_plan_writes_the_metadata_the_host_builds(tiny_exact, b):
    """``metadata_on_device``: the host uploads the seed (positions, each group's slots, the
    section table) and ``write_metadata`` writes every part from it - the Triton launch where it
    runs (a GPU, the interpreter), PyTorch operations elsewhere - equal to the host-built
    metadata of the same padded step, step after step across entry boundaries of both ratios,
    with layers of one type in two slot orders (two groups), any bucket width (5: not a power of
    two)."""
    layers = _stack(tiny_exact, [0, 4, 4, 128])
    pools = [lay.new_cache_pool(6, 600) for lay in layers]
    pools[2].add_sequence()  # layer 2's sequences sit one slot later: a group of its own
    caches = [[p.add_sequence() for p in pools] for _ in range(3)]
    lens = [125, 2, 7]
    for k, lay in enumerate(layers):
        pos = torch.cat([torch.arange(n) for n in lens])
        x = torch.randn(pos.numel(), tiny_exact.hidden_size, dtype=torch.float64)
        lay(x, pos, [s[k] for s in caches], seq_lens=lens)
    buffers: dict[int, torch.Tensor] = {}

    def into(size, layout):
        return buffers.setdefault(size, torch.full((size,), -7, dtype=torch.int64))

    for _ in range(6):  # 125 -> 131 crosses entry 31 of ratio 4 and entry 0 of ratio 128
        host = StepPlan(caches, pad_to=(b, 1), visible_caps={4: 64, 128: 2})
        host.rollback()
        seeded = StepPlan(caches, pad_to=(b, 1), visible_caps={4: 64, 128: 2}, into=into,
                          metadata_on_device=True)
        assert len({id(s.meta) for s in seeded.steps.values()}) == 4  # SWA, 4, 4 shifted, 128
        with pytest.raises(StepPlanError, match="write_metadata"):
            seeded.step_for(layers[1])
        seeded.write_metadata()
        for k in range(len(layers)):
            pool = id(caches[0][k].pool)
            _steps_equal(seeded.steps[pool], host.steps[pool])
            assert torch.equal(seeded.steps[pool].pos_host, host.steps[pool].pos_host)
            assert torch.equal(seeded.steps[pool].tok_seq_host, host.steps[pool].tok_seq_host)
        assert seeded.step_for(layers[3]) is seeded.steps[id(caches[0][3].pool)]
        seeded.commit()


def test_metadata_on_device_is_for_padded_decode_plans_into_a_buffer(tiny_exact):
    """Any other plan (not padded, a verify step, no ``into``) builds its metadata on the host
    and ``write_metadata`` has nothing to do."""
    layers = _stack(tiny_exact, [4])
    caches = _caches(layers, 2)
    for kw in ({}, {"pad_to": (2, 1)}, {"pad_to": (2, 2), "seq_lens": [2, 1]}):
        plan = StepPlan(caches, metadata_on_device=True, **kw)
        assert plan.steps[id(caches[0][0].pool)].pos.numel() == plan.num_tokens
        plan.write_metadata()
        plan.rollback()


def test_a_cuda_device_without_the_kernel_builds_its_metadata_on_the_host():
    """The seed's fallback reads it back, which a CUDA graph cannot capture: a CUDA device
    seeds only where the kernel runs; the CPU (no graphs) always may."""
    from dsv4.kernels.decode_metadata import decode_metadata_usable, seed_usable

    assert seed_usable(torch.device("cpu"))
    cuda = torch.device("cuda")
    assert seed_usable(cuda) == decode_metadata_usable(cuda)
