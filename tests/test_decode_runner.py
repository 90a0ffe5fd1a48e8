"""The decode runner (:mod:`dsv4.runner`): buckets, fixed widths, padded steps equal to eager
ones over hundreds of steps with sequences joining, leaving and forking, every layer type; on a
GPU the same with CUDA graphs (``tests/platforms/test_runner_cuda.py``)."""

from __future__ import annotations

import random
import weakref

import pytest
import torch

from dsv4.bench.synthetic_cache import fill_history
from dsv4.cache.plan import StepPlan, StepPlanError
from dsv4.runner import DecodeRunner, visible_caps
from dsv4.testing.random_weights import random_layer_weights

from conftest import Twins, layer_stack, tanh_residual

RATIOS = [0, 4, 128, 0, 4]


def stack(cfg, ratios=RATIOS):
    return layer_stack(cfg, ratios)


step_fn = tanh_residual


def test_buckets_and_widths():
    r = DecodeRunner(lambda plan, x: x, buckets=(1, 4, 16))
    assert [r.bucket_for(m) for m in (1, 2, 4, 5, 16, 17)] == [1, 4, 4, 16, 16, None]
    for bad in ((), (4, 2), (0, 1), (1, 1), (1.5,)):
        with pytest.raises(ValueError, match="ascending positive integers"):
            DecodeRunner(lambda plan, x: x, buckets=bad)
    with pytest.raises(ValueError, match="mode='fast'"):
        DecodeRunner(lambda plan, x: x, mode="fast")
    with pytest.raises(TypeError, match="callable"):
        DecodeRunner(3)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        DecodeRunner(lambda plan, x: x, mode="graphs").mode_on(torch.device("cpu"))
    # a bare pool handle names a pool that dies with its last graph (dsv4.runner.new_mempool)
    with pytest.raises(TypeError, match="mempool must be a torch.cuda.MemPool"):
        DecodeRunner(lambda plan, x: x, mempool=(0, 1))


def test_visible_widths_are_powers_of_two_at_or_above_the_widest(tiny_exact):
    layers = stack(tiny_exact, [4, 128])
    pools = [lay.new_cache_pool(2, 4096) for lay in layers]
    seqs = [[p.add_sequence() for p in pools] for _ in range(2)]
    for length, want in ((0, {4: 1, 128: 1}), (3, {4: 1, 128: 1}), (4, {4: 1, 128: 1}),
                         (11, {4: 4, 128: 1}), (127, {4: 32, 128: 1}),
                         (300, {4: 128, 128: 2}), (4094, {4: 1024, 128: 32})):
        for p in pools:
            p._lengths[seqs[0][0].slot] = length
        assert visible_caps(pools, seqs) == want, length


def test_buckets_beyond_max_graphs_are_dropped_least_recently_used_first(tiny_exact):
    """A runner keeps at most ``max_graphs`` buckets and drops the least recently used (a step
    of a dropped one makes it again); the buckets of one (B, Q) at every width share their
    static inputs, so a new width costs a metadata buffer (and a graph), not another copy of
    the inputs."""
    layer = stack(tiny_exact, [4])[0]
    pool = layer.new_cache_pool(3, 4096)
    seqs = {n: [pool.add_sequence()] for n in (3, 40, 300)}
    for n, seq in seqs.items():
        fill_history(seq, n)
    widths = {n: visible_caps([pool], [seq])[4] for n, seq in seqs.items()}
    assert widths == {3: 1, 40: 16, 300: 128}
    r = DecodeRunner(lambda plan, x: x, mode="padded", max_graphs=2)
    x = torch.zeros(1, 8, dtype=torch.float64)

    def held():
        return [dict(key[2])[4] for key in r._buckets]

    for n in (3, 40):
        r([seqs[n]], x)
    first, second = r._buckets.values()
    assert first.inputs[0] is second.inputs[0] and first.metadata is not second.metadata
    r([seqs[3]], x)  # now the most recently used
    r([seqs[300]], x)  # drops width 16's
    assert held() == [1, 128] and r.stats["dropped"] == 1
    r([seqs[40]], x)  # made again, dropping width 1's
    assert held() == [128, 16] and r.stats["dropped"] == 2
    assert [seq[0].length for seq in seqs.values()] == [5, 42, 301]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_graphs"):
            DecodeRunner(lambda plan, x: x, max_graphs=bad)


def test_the_shared_pool_lives_while_a_holder_does(monkeypatch):
    """``shared_mempool`` gives every caller the same pool while someone holds it, and a new
    one once nobody does (the old one's memory goes with it); a stand-in for the CUDA pool."""
    import gc

    import dsv4.runner as runner_module

    class Pool:
        pass

    made = []

    def new_pool(device):
        made.append(Pool())
        return made[-1]

    monkeypatch.setattr(runner_module, "new_mempool", new_pool)
    monkeypatch.setattr(runner_module, "_SHARED_MEMPOOLS", weakref.WeakValueDictionary())
    dev = torch.device("cuda", 0)
    held = runner_module.shared_mempool(dev)
    assert runner_module.shared_mempool(dev) is held and len(made) == 1
    assert runner_module.shared_mempool(torch.device("cuda", 1)) is not held
    first = weakref.ref(held)
    del held
    made.clear()
    gc.collect()
    assert first() is None
    assert runner_module.shared_mempool(dev) is made[0]


def test_bad_inputs_are_errors(tiny_exact):
    layers = stack(tiny_exact, [0])
    caches = [[layers[0].new_caches(1, 64)[0]]]
    r = DecodeRunner(step_fn(layers), mode="padded")
    with pytest.raises(ValueError, match=r"input 0 has shape \(2, 256\); expected \[1, ...\]"):
        r(caches, torch.zeros(2, 256, dtype=torch.float64))
    with pytest.raises(StepPlanError, match="no sequences"):
        r([])
    assert caches[0][0].length == 0
    r(caches, torch.zeros(1, 256, dtype=torch.float64))  # a padded step: no graph to replay
    assert caches[0][0].length == 1 and r.last_graph is None


def _eager_step(layers, seqs, x):
    """The reference: each layer called on its own (it plans its own step)."""
    pos = torch.tensor([s[0].length for s in seqs])
    for k, lay in enumerate(layers):
        x = x + lay(torch.tanh(x), pos, [s[k] for s in seqs])
    return x


@pytest.mark.parametrize("mode", ["padded", "eager"])
def test_runner_steps_equal_eager_steps_as_sequences_join_leave_and_fork(tiny_exact, mode):
    """500 decode steps of a stack with every layer type; between steps sequences join
    (prefilled), leave and fork, so batches move between buckets and contexts cross window
    blocks, compression boundaries and width buckets. The runner's outputs equal the eager
    layers' (float64: to rounding, padded GEMMs and wider selections only reorder sums) and
    so do the caches it leaves."""
    layers = stack(tiny_exact)
    runner = DecodeRunner(step_fn(layers), mode=mode, buckets=(1, 2, 4, 8))
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(5)
    h = tiny_exact.hidden_size
    twins = Twins(layers, "ab", 8, 1200)
    live = twins.live
    for n in (30, 129, 5):
        twins.join(torch.randn(n, h, dtype=torch.float64, generator=gen))
    worst = 0.0
    steps = 0
    while steps < 500:
        event = rng.random()
        if event < 0.03 and len(twins) < 7:
            twins.join(torch.randn(rng.choice([1, 17, 64, 200]), h, dtype=torch.float64,
                                   generator=gen))
        elif event < 0.06 and len(twins) > 1:
            twins.leave(rng.randrange(len(twins)))
        elif event < 0.09 and len(twins) < 7:
            twins.fork(rng.randrange(len(twins)))
        if any(s[0].length + 1 >= 1200 for s in live["a"]):
            twins.leave(max(range(len(twins)), key=lambda j: live["a"][j][0].length))
            if not len(twins):
                twins.join(torch.randn(3, h, dtype=torch.float64, generator=gen))
            continue
        x = torch.randn(len(twins), h, dtype=torch.float64, generator=gen)
        ya = runner(live["a"], x)
        yb = _eager_step(layers, live["b"], x)
        worst = max(worst, float((ya - yb).abs().max()))
        assert torch.allclose(ya, yb, rtol=0, atol=1e-10), steps
        steps += 1
    assert worst < 1e-10
    for sa, sb in zip(live["a"], live["b"], strict=True):
        for ca, cb in zip(sa, sb, strict=True):
            assert ca.length == cb.length and ca.slot == cb.slot
            first = max(0, ca.length - tiny_exact.sliding_window + 1)
            assert torch.allclose(ca.rows("kv", first), cb.rows("kv", first), atol=1e-10)
            for name in ("compressed", "idx_keys"):
                if name in ca.pool.stores:
                    assert torch.allclose(ca.rows(name), cb.rows(name), atol=1e-10)
    assert [p.blocks_in_use() for p in twins.pools["b"]] == [p.blocks_in_use()
                                                             for p in twins.pools["a"]]
    if mode == "padded":
        assert runner.stats["padded"] == 500 and runner.stats["eager"] == 0
        assert len(runner._buckets) > 4  # several batch buckets and widths were used
    else:
        assert runner.stats["eager"] == 500


def test_a_failing_step_leaves_every_cache_as_it_was(tiny_exact):
    layers = stack(tiny_exact, [0, 4])
    pools = [lay.new_cache_pool(2, 300) for lay in layers]
    seqs = [[p.add_sequence() for p in pools] for _ in range(2)]
    with StepPlan(seqs, [70, 9]) as plan:
        step_fn(layers)(plan, torch.randn(79, 256, dtype=torch.float64))
    calls = []

    def failing(plan, x):
        calls.append(1)
        layers[0](x, plan=plan)
        raise RuntimeError("user code failed")

    before = [p.blocks_in_use() for p in pools]
    with pytest.raises(RuntimeError, match="user code failed"):
        DecodeRunner(failing, mode="padded")(seqs, torch.randn(2, 256, dtype=torch.float64))
    assert calls and [p.blocks_in_use() for p in pools] == before
    assert [c.length for s in seqs for c in s] == [70, 70, 9, 9]


@pytest.mark.parametrize("mode", ["padded", "eager"])
def test_verify_steps_and_accepts_through_the_runner_equal_eager(tiny_exact, mode):
    """Speculative steps through the runner: each sequence brings 1 + k tokens (k in 0 .. 7,
    its own per sequence; query buckets 1, 2, 4, 8 beside the batch buckets), then keeps
    1 + a of them (``truncate``); against the same steps of each layer called on its own, over
    200 steps with joins and forks, every layer type."""
    layers = stack(tiny_exact)
    runner = DecodeRunner(step_fn(layers), mode=mode, buckets=(1, 2, 4, 8))
    rng = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    h = tiny_exact.hidden_size
    twins = Twins(layers, "ab", 8, 1500, max_rollback=7)
    live = twins.live
    for n in (9, 140):
        twins.join(torch.randn(n, h, dtype=torch.float64, generator=gen))
    for step in range(200):
        if step % 40 == 20 and len(twins) < 6:
            twins.join(torch.randn(rng.choice([1, 33]), h, dtype=torch.float64, generator=gen))
        if step % 50 == 30 and len(twins) < 6:
            twins.fork(0)
        ks = [rng.randint(0, 7) for _ in live["a"]]
        lens = [k + 1 for k in ks]
        x = torch.randn(sum(lens), h, dtype=torch.float64, generator=gen)
        ya = runner(live["a"], x, seq_lens=lens)
        pos = torch.cat([torch.arange(s[0].length, s[0].length + n)
                         for s, n in zip(live["b"], lens, strict=True)])
        yb = x
        for k, lay in enumerate(layers):
            yb = yb + lay(torch.tanh(yb), pos, [s[k] for s in live["b"]], lens)
        assert torch.allclose(ya, yb, rtol=0, atol=1e-10), step
        for side in "ab":
            for seq, k in zip(live[side], ks, strict=True):
                a = (step * 7 + k) % (k + 1)  # accepted drafts, the same on both sides
                for c in seq:
                    c.truncate(c.length - (k - a))
    assert [s[0].length for s in live["a"]] == [s[0].length for s in live["b"]]
    if mode == "padded":
        assert runner.stats["padded"] == 200
        assert {k[1] for k in runner._buckets} >= {2, 4, 8}  # query buckets used


class _NoEvent:  # the CPU build of PyTorch has no CUDA events (the cuda platform records some)
    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def record(self, *args: object) -> None:
        pass


@pytest.fixture
def cpu_cuda_layer(monkeypatch):
    """A factory of the cuda platform's layer on the CPU (its base-path stages, float64, no
    input-stage graphs), its plain decode calls routed through its runner's padded steps up to
    ``step_graphs`` sequences: ``make(cfg, layer_id, step_graphs)``."""
    from dsv4.platforms.cuda import CudaAttention

    monkeypatch.setattr(torch.cuda, "Event", _NoEvent)
    monkeypatch.setattr(CudaAttention, "STEP_GRAPH_DEVICE", "cpu")
    monkeypatch.setattr(CudaAttention, "STEP_GRAPH_MODE", "padded")

    def make(cfg, layer_id, step_graphs):
        lay = CudaAttention(cfg, layer_id, device="cpu", dtype=torch.float64, aux_streams=[])
        lay.load_weights(random_layer_weights(cfg, layer_id, seed=layer_id))
        lay.aux_streams = None
        lay.use_cuda_graphs(False)  # no input-stage graphs on the CPU
        lay.use_step_graphs(step_graphs)
        return lay

    return make


def test_plain_decode_calls_of_the_cuda_platform_take_the_layers_runner(tiny_exact,
                                                                        cpu_cuda_layer):
    """The cuda platform's plain calls of at most ``step_graph_max_seqs`` sequences of up to 8
    tokens (one step) run through the layer's own runner - on a GPU its graphs, here its padded
    steps - with the eager call's values, as sequences join, leave and verify; prefill, more
    sequences and longer calls run eagerly. New weights drop the runner."""
    cfg = tiny_exact.replace(compress_ratios=(0, 4), num_hidden_layers=2)
    layers = {side: cpu_cuda_layer(cfg, 1, 4 if side == "a" else 0) for side in "ab"}
    pools = {side: layers[side].new_cache_pool(6, 400, max_rollback=3) for side in "ab"}
    live: dict[str, list] = {"a": [], "b": []}
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(5)
    h = tiny_exact.hidden_size

    def call(lens):
        x = torch.randn(sum(lens), h, generator=gen, dtype=torch.float64)
        ys = []
        for side in "ab":
            pos = torch.cat([torch.arange(c.length, c.length + n)
                             for c, n in zip(live[side], lens, strict=True)])
            ys.append(layers[side](x, pos, live[side], lens))
        assert torch.allclose(ys[0], ys[1], rtol=0, atol=1e-10)

    routed = eager = 0
    for step in range(80):
        if len(live["a"]) < 6 and (not live["a"] or rng.random() < 0.1 or 30 <= step < 36):
            n = rng.randint(1, 40)
            x = torch.randn(n, h, generator=gen, dtype=torch.float64)
            for side in "ab":  # a prefill (of at most 8 tokens: a step the runner takes)
                live[side].append(pools[side].add_sequence())
                layers[side](x, torch.arange(n), live[side][-1])
            routed += n <= 8
        if len(live["a"]) > 1 and rng.random() < 0.12:
            i = rng.randrange(len(live["a"]))
            for side in "ab":
                live[side].pop(i).free()
        lens = [rng.randint(1, 4) if step % 5 == 4 else 1 for _ in live["a"]]
        call(lens)
        routed += len(lens) <= 4
        eager += len(lens) > 4
        for side in "ab":  # a verify step: keep its first token
            for c, n in zip(live[side], lens, strict=True):
                c.truncate(c.length - (n - 1))
    runner = layers["a"]._step_runner
    assert runner is not None and layers["b"]._step_runner is None
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match=f"max_seqs must be an integer >= 0, got {bad!r}"):
            layers["a"].use_step_graphs(bad)
    assert layers["a"]._step_runner is runner  # a refused setting changes nothing
    assert routed > 20 and eager > 0
    assert runner.stats["padded"] == routed and runner.stats["eager"] == 0
    assert [c.length for c in live["a"]] == [c.length for c in live["b"]]
    layers["a"].load_state_dict(layers["a"].state_dict())  # new weights: graphs are stale
    assert layers["a"]._step_runner is None


def test_layers_serving_a_runner_and_routed_plain_calls_stay_exact(tiny_exact, cpu_cuda_layer):
    """The same cuda-platform layers (SWA, C4, C128) serve a stack's runner (plan calls, its
    padded steps) on one set of pools and plain calls routed through each layer's own runner on
    another, beside the same layers called eagerly on a third: every step equal to 1e-10
    (float64) as sequences join, leave and fork over 120 steps; the CPU side of the GPU runner
    test's ``step-graphs`` case (``tests/platforms/test_runner_cuda.py``)."""
    cfg = tiny_exact.replace(compress_ratios=(0, 4, 128), num_hidden_layers=3)
    stacks = {name: [cpu_cuda_layer(cfg, i, limit) for i in range(3)]
              for name, limit in (("shared", 8), ("eager", 0))}
    layers = stacks["shared"]
    sides = ("runner", "routed", "eager")
    stack_of = {"runner": layers, "routed": layers, "eager": stacks["eager"]}
    pools = {s: [lay.new_cache_pool(8, 600) for lay in stack_of[s]] for s in sides}
    live: dict[str, list] = {s: [] for s in sides}
    runner = DecodeRunner(step_fn(layers), mode="padded", buckets=(1, 2, 4, 8))
    rng = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    h = cfg.hidden_size

    def plain(side, x, seqs, lens):
        """The side's stack by plain calls (for ``routed``, calls of at most 8 tokens a
        sequence through the layers' runners, short prefills too)."""
        pos = torch.cat([torch.arange(q[0].length, q[0].length + n)
                         for q, n in zip(seqs, lens, strict=True)])
        for k, lay in enumerate(stack_of[side]):
            x = x + lay(torch.tanh(x), pos, [q[k] for q in seqs], lens)
        return x

    forks = 0
    for step in range(120):
        n_live = len(live["eager"])
        event = rng.random()
        if not n_live or (event < 0.08 and n_live < 8):
            n = rng.choice([1, 3, 37, 130])
            x = torch.randn(n, h, generator=gen, dtype=torch.float64)
            for s in sides:
                live[s].append([p.add_sequence() for p in pools[s]])
                plain(s, x, live[s][-1:], [n])
        elif event < 0.14 and n_live > 1:
            i = rng.randrange(n_live)
            for s in sides:
                for c in live[s].pop(i):
                    c.free()
        elif event < 0.28 and n_live < 8:
            i = rng.randrange(n_live)
            for s in sides:
                live[s].append([c.fork() for c in live[s][i]])
            forks += 1
        m = len(live["eager"])
        x = torch.randn(m, h, generator=gen, dtype=torch.float64)
        ys = {"runner": runner(live["runner"], x),
              "routed": plain("routed", x, live["routed"], [1] * m),
              "eager": plain("eager", x, live["eager"], [1] * m)}
        for s in ("runner", "routed"):
            assert torch.allclose(ys[s], ys["eager"], rtol=0, atol=1e-10), (step, s)
    assert runner.stats["padded"] == 120 and forks >= 8
    assert all(lay._step_runner.stats["padded"] >= 120 for lay in layers)
    assert all(lay._step_runner is None for lay in stacks["eager"])
    for s in ("runner", "routed"):
        assert [[c.length for c in q] for q in live[s]] == \
            [[c.length for c in q] for q in live["eager"]]


def test_spies_see_one_eager_call_per_step_with_step_graphs_on(tiny_exact, cpu_cuda_layer):
    """record_selection / replay_selection and spy_methods (what verify, the demo and the
    contract checker use) hold a layer's step graphs off while they are on - a graph's first
    step is run and then captured (two calls), its replays call no Python - and put them back
    after; the recorded selections replay on the reference step for step."""
    from dsv4.testing.probes import record_selection, replay_selection, spy_methods

    cfg = tiny_exact.replace(compress_ratios=(0, 4), num_hidden_layers=2)
    lay = cpu_cuda_layer(cfg, 1, 4)
    ref = stack(cfg, [0, 4])[1]
    ref.load_weights(random_layer_weights(cfg, 1, seed=1))
    x = torch.randn(40, cfg.hidden_size, dtype=torch.float64, generator=torch.Generator()
                    .manual_seed(3))

    def run(layer):
        cache = layer.new_cache(64)
        ys = [layer(x[:30], torch.arange(30), cache)]
        ys += [layer(x[i:i + 1], torch.tensor([i]), cache) for i in range(30, 40)]
        return torch.cat(ys)

    with record_selection(lay) as seen, spy_methods(lay, ["_attend_and_project"]) as calls:
        y = run(lay)
        assert lay.plan.step_graph_max_seqs == 0 and lay._step_runner is None
    assert len(seen) == 11 and len(calls["_attend_and_project"]) == 11  # one per step
    assert lay.plan.step_graph_max_seqs == 4  # back on after the spies
    with replay_selection(ref, seen):
        y_ref = run(ref)
    assert torch.allclose(y, y_ref, rtol=0, atol=1e-10)
    assert run(lay).shape == y.shape and lay._step_runner is not None  # routed again
    assert lay.use_step_graphs(2) == 4 and lay.use_step_graphs(4) == 2  # the previous limit


def test_a_freed_pools_buckets_are_never_replayed(tiny_exact):
    """A bucket knows its pools by weak reference: after the pools are freed, a new pool (at
    any address, the old one's included) gets a bucket of its own, and the dead one is dropped."""
    import gc

    layers = stack(tiny_exact, [0, 4])
    runner = DecodeRunner(step_fn(layers), mode="padded", buckets=(2,))
    x = torch.zeros(2, tiny_exact.hidden_size, dtype=torch.float64)
    for round_ in range(3):
        pools = [lay.new_cache_pool(2, 64) for lay in layers]
        seqs = [[p.add_sequence() for p in pools] for _ in range(2)]
        runner(seqs, x)
        alive = [b for b in runner._buckets.values() if all(r() is not None for r in b.pools)]
        assert len(alive) == 1 and alive[0].serves(pools), round_
        assert len(runner._buckets) == 1  # the freed pools' bucket was dropped
        del pools, seqs, alive
        gc.collect()
