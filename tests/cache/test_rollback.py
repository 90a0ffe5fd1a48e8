"""Exact rollback (speculative decoding): a verify step of 1 + k tokens per sequence, then
``truncate`` to the accepted prefix, leaves every cache as if the rejected tokens had never been
written - across window blocks and compression boundaries (ratios 4 and 128), with sequences
joining, forking and leaving."""

from __future__ import annotations

import random

import pytest
import torch

from dsv4.cache.blocks import CacheCapacityError
from dsv4.cache.plan import StepPlan

from conftest import Twins, layer_stack, tanh_residual

K = 7
RATIOS = [0, 4, 128]


def stack(cfg, ratios=RATIOS):
    return layer_stack(cfg, ratios)


step_fn = tanh_residual


def held_state(seq):
    """What a sequence's caches hold that any later step can read: window rows of the window,
    every entry and key, the ring rows of the positions the next entries pool."""
    out = []
    for c in seq:
        pool, n = c.pool, c.length
        out.append(c.rows("kv", max(0, n - pool.window + 1)))
        for name in ("compressed", "idx_keys"):
            if name in pool.stores:
                out.append(c.rows(name))
        for spec, ring in pool.rings.values():
            first = max(0, (n // spec.ratio - spec.coff + 1) * spec.ratio)
            out.append(ring[c.slot, [q % spec.rows for q in range(first, n)]])
    return out


def test_verify_and_accept_cycles_are_exact(tiny_exact):
    """~600 draft / verify / accept cycles. Side ``a`` and side ``a2`` run the same cycles with
    different values for the rejected drafts: every accepted output and every cache state is bit
    for bit the same (nothing of a rejected token survives). Side ``b`` decodes only the accepted
    tokens: the same outputs to float64 rounding, the same lengths, blocks and free blocks."""
    layers = stack(tiny_exact)
    fn = step_fn(layers)
    rng = random.Random(11)
    gen = torch.Generator().manual_seed(11)
    h = tiny_exact.hidden_size
    sides = ("a", "a2", "b")
    twins = Twins(layers, sides, 8, 1400, max_rollback=K)
    pools, live = twins.pools, twins.live
    for n in (5, 70, 131):
        twins.join(torch.randn(n, h, dtype=torch.float64, generator=gen))
    worst, cycles = 0.0, 0
    while cycles < 600:
        event = rng.random()
        if event < 0.03 and len(twins) < 7:
            twins.join(torch.randn(rng.choice([1, 9, 64]), h, dtype=torch.float64,
                                   generator=gen))
        elif event < 0.05 and len(twins) > 1:
            twins.leave(rng.randrange(len(twins)))
        elif event < 0.08 and len(twins) < 7:
            twins.fork(rng.randrange(len(twins)))
        if any(seq[0].length + K + 1 > 1400 for seq in live["a"]):
            twins.leave(max(range(len(twins)), key=lambda j: live["a"][j][0].length))
            if not len(twins):
                twins.join(torch.randn(3, h, dtype=torch.float64, generator=gen))
            continue
        ks = [rng.randint(0, K) for _ in live["a"]]
        accepted = [rng.randint(0, k) for k in ks]
        x = torch.randn(sum(ks) + len(ks), h, dtype=torch.float64, generator=gen)
        x2 = x.clone()
        keep, b = [], 0
        for k, a in zip(ks, accepted, strict=True):
            keep += range(b, b + a + 1)
            x2[b + a + 1:b + k + 1] = torch.randn(k - a, h, dtype=torch.float64, generator=gen)
            b += k + 1
        outs = {}
        for s, xs in (("a", x), ("a2", x2)):
            with StepPlan(live[s], [k + 1 for k in ks]) as plan:
                outs[s] = fn(plan, xs)[keep]
            for seq, k, a in zip(live[s], ks, accepted, strict=True):
                for c in seq:
                    c.truncate(c.length - (k - a))
        with StepPlan(live["b"], [a + 1 for a in accepted]) as plan:
            outs["b"] = fn(plan, x[keep])
        assert torch.equal(outs["a"], outs["a2"]), cycles
        worst = max(worst, float((outs["a"] - outs["b"]).abs().max()))
        assert worst < 1e-11, cycles
        cycles += 1
    for sa, sa2, sb in zip(live["a"], live["a2"], live["b"], strict=True):
        assert [c.length for c in sa] == [c.length for c in sb]
        for u, v in zip(held_state(sa), held_state(sa2), strict=True):
            assert torch.equal(u, v)
        for u, v in zip(held_state(sa), held_state(sb), strict=True):
            assert torch.allclose(u, v, rtol=0, atol=1e-11)
    for k in range(len(layers)):
        used = {s: pools[s][k].blocks_in_use() for s in sides}
        assert used["a"] == used["a2"] == used["b"], used


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_every_accept_at_every_length_holds_what_plain_decoding_holds(tiny_exact, ratio):
    """At every length of a 600-token sequence (window blocks, entry and ring boundaries), a
    verify step of 4 tokens truncated to its first accepted ones leaves the blocks, free blocks
    and held rows of a twin whose step had only those; a truncation further back than the pool
    keeps is refused naming the fix, with nothing changed."""
    (layer,) = stack(tiny_exact, [ratio])
    h = tiny_exact.hidden_size
    pools = [layer.new_cache_pool(2, 700, max_rollback=3) for _ in range(2)]
    spec, plain = (p.add_sequence() for p in pools)
    gen = torch.Generator().manual_seed(ratio)
    x = torch.randn(40, h, dtype=torch.float64, generator=gen)
    for c in (spec, plain):
        layer(x, torch.arange(40), c)
    n = 40
    while n < 600:
        a = n % 4  # accepted drafts: 0 .. 3
        x = torch.randn(4, h, dtype=torch.float64, generator=gen)
        y = layer(x, torch.arange(n, n + 4), spec)
        spec.truncate(n + a + 1)
        yp = layer(x[:a + 1], torch.arange(n, n + a + 1), plain)
        assert torch.allclose(y[:a + 1], yp, rtol=0, atol=1e-12), n
        n += a + 1
        assert pools[0].blocks_in_use() == pools[1].blocks_in_use(), n
        for u, v in zip(held_state([spec]), held_state([plain]), strict=True):
            assert torch.allclose(u, v, rtol=0, atol=1e-12), n
    if ratio:  # the rings keep max_rollback - 1 positions of history: no more than that back
        before = pools[0].blocks_in_use()
        with pytest.raises(ValueError, match="max_rollback"):
            spec.truncate(n - 3 - 2 * ratio)
        assert spec.length == n and pools[0].blocks_in_use() == before


def test_truncating_a_fork_into_a_shared_block_copies_it(tiny_exact):
    """A fork at 258 tokens shares the parent's full blocks (kv rows 192 .. 255, entries 0 ..
    63); truncated to 254, the child's next writes land in those blocks: it copies them first
    and the parent's rows stay as they were. Without a free block for the copy the truncation is
    refused with nothing changed."""
    (layer,) = stack(tiny_exact, [4])
    h = tiny_exact.hidden_size
    pool = layer.new_cache_pool(3, 600, max_rollback=6)
    parent = pool.add_sequence()
    layer(torch.randn(258, h, dtype=torch.float64), torch.arange(258), parent)
    child = parent.fork()
    kept = {n: parent.rows(n) for n in ("compressed", "idx_keys")}
    window = parent.rows("kv", 243)
    used = pool.blocks_in_use()
    child.truncate(254)
    assert {k: v - used[k] for k, v in pool.blocks_in_use().items()} == {
        "kv": 0, "compressed": 1, "idx_keys": 1}  # kv: block 4 back, block 3 copied
    layer(torch.randn(9, h, dtype=torch.float64), torch.arange(254, 263), child)
    assert all(torch.equal(parent.rows(n), k) for n, k in kept.items())
    assert torch.equal(parent.rows("kv", 243), window)
    # no free block for the copy: refused before anything changes
    other = parent.fork()
    store = pool.stores["compressed"]
    taken = store.alloc.allocate(store.alloc.num_free)
    before = pool.blocks_in_use()
    with pytest.raises(CacheCapacityError, match="compressed store's blocks at the new lengths "
                                                 "are shared with a fork"):
        other.truncate(254)
    assert other.length == 258 and pool.blocks_in_use() == before
    for b in taken:
        store.alloc.release(b)


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_a_call_failing_inside_a_graph_capture_rolls_back_the_host(tiny_exact, monkeypatch,
                                                                    ratio):
    """A plain call captured by hand whose step opens a block fails inside the capture (its
    block-table copy cannot be captured); the call's rollback then undoes every host change -
    block tables, lengths, free blocks - without a device copy (the capture ran none of the
    step's device work), and the tables' changes reach the device with the next sync."""
    import dsv4.cache.step as step_module
    from dsv4.cache.store import PagedStore

    (layer,) = stack(tiny_exact, [ratio])
    caches = layer.new_caches(3, 256)
    h = tiny_exact.hidden_size
    for c, n in zip(caches, (64, 60, 61), strict=True):  # the first opens a block next step
        layer(torch.randn(n, h, dtype=torch.float64), torch.arange(n), c)
    pool = caches[0].pool
    for store in pool.stores.values():  # a device mirror of its own, as on a GPU
        store.table_dev = store.table.clone()
    lengths = [c.length for c in caches]
    tables = {n: (s.table.clone(), s.alloc.num_free) for n, s in pool.stores.items()}
    real_sync = PagedStore.sync

    def sync_in_capture(self):
        if self._dirty:
            raise RuntimeError("upload_into: a host-to-device copy ... cannot be captured")
        real_sync(self)

    monkeypatch.setattr(PagedStore, "sync", sync_in_capture)
    monkeypatch.setattr(step_module, "_capturing", lambda device: True)
    x = torch.randn(3, h, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="cannot be captured") as raised:
        layer(x, torch.tensor(lengths), caches)
    assert raised.value.__context__ is None  # the rollback itself raised nothing
    assert [c.length for c in caches] == lengths
    for n, s in pool.stores.items():
        assert torch.equal(s.table, tables[n][0]) and s.alloc.num_free == tables[n][1], n
    monkeypatch.undo()
    for s in pool.stores.values():
        s.sync()
        assert torch.equal(s.table_dev, s.table)
    y = layer(x, torch.tensor(lengths), caches)  # and the step runs outside the capture
    assert [c.length for c in caches] == [n + 1 for n in lengths] and torch.isfinite(y).all()
