"""Soak: thousands of decode steps on one pool while sequences join, fork and leave at random.

Every token a sequence has seen is kept, so at random points a sequence's outputs are compared
with a from-scratch run of its whole history in a fresh cache (bitwise-close in float64), and at
the end every block of every store is back on its free list."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import RATIOS

STEPS = 1500
MAX_SEQS = 6
MAX_LEN = 300


class Seq:
    """A live sequence: its cache, every input row it has seen and every output it got."""

    def __init__(self, cache, xs=None, ys=None):
        self.cache = cache
        self.xs: list[torch.Tensor] = list(xs or [])
        self.ys: list[torch.Tensor] = list(ys or [])


def _check_from_scratch(layer, seq: Seq) -> None:
    fresh = layer.new_cache(MAX_LEN)
    x = torch.stack(seq.xs)
    want = layer(x, torch.arange(x.shape[0]), fresh)
    fresh.free()
    got = torch.stack(seq.ys)
    assert got.shape == want.shape
    err = (got - want).abs().max().item()
    assert err <= 1e-12, f"sequence of {len(seq.xs)} tokens differs from scratch by {err}"


@pytest.fixture
def one_thread():
    """Many small ops: one intra-op thread is faster, and much faster on a busy machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("ratio", RATIOS)
def test_soak_join_fork_leave(tiny_exact, make_layer, one_thread, ratio):
    cfg = tiny_exact.replace(fp8_weights=False)  # plain weights: no dequantisation per call
    layer = make_layer(cfg, ratio, torch.float64)
    hidden = cfg.hidden_size
    rng = random.Random(1000 + ratio)
    gen = torch.Generator().manual_seed(ratio)
    pool = layer.new_cache_pool(MAX_SEQS, MAX_LEN)
    live: list[Seq] = []
    checks = forks = leaves = joins = tokens = 0

    def rows(n: int) -> torch.Tensor:
        return torch.randn(n, hidden, generator=gen, dtype=torch.float64)

    for _ in range(STEPS):
        event = rng.random()
        if (event < 0.08 or not live) and pool.num_free_slots:
            # join with a prompt (a prefill call of its own)
            seq = Seq(pool.add_sequence())
            n = rng.randint(1, 40)
            x = rows(n)
            seq.xs += list(x)
            seq.ys += list(layer(x, torch.arange(n), seq.cache))
            live.append(seq)
            joins += 1
        elif event < 0.13 and pool.num_free_slots and live:
            parent = rng.choice(live)
            live.append(Seq(parent.cache.fork(), parent.xs, parent.ys))
            forks += 1
        elif event < 0.18 and len(live) > 1:
            seq = live.pop(rng.randrange(len(live)))
            seq.cache.free()
            leaves += 1
        # sequences at their length limit leave
        for seq in [s for s in live if s.cache.length + 3 > MAX_LEN]:
            live.remove(seq)
            seq.cache.free()
            leaves += 1
        if not live:
            continue
        # one call for every live sequence: a decode token each, some a short chunk
        counts = [1 if rng.random() < 0.85 else rng.randint(2, 3) for _ in live]
        x = rows(sum(counts))
        pos = torch.cat([torch.arange(s.cache.length, s.cache.length + n)
                         for s, n in zip(live, counts, strict=True)])
        y = layer(x, pos, [s.cache for s in live], seq_lens=counts)
        tokens += len(counts)
        begin = 0
        for seq, n in zip(live, counts, strict=True):
            seq.xs += list(x[begin:begin + n])
            seq.ys += list(y[begin:begin + n])
            begin += n
        if rng.random() < 0.01:
            _check_from_scratch(layer, rng.choice(live))
            checks += 1
    for seq in live:
        _check_from_scratch(layer, seq)
        seq.cache.free()
    assert tokens > 3000 and joins > 50 and forks > 20 and leaves > 50 and checks > 5, (
        tokens, joins, forks, leaves, checks)
    assert all(n == 0 for n in pool.blocks_in_use().values()), pool.blocks_in_use()
    assert pool.num_free_slots == MAX_SEQS
    for store in pool.stores.values():
        assert store.alloc.num_free == store.alloc.num_blocks
        assert all(store.alloc.refcount(b) == 0 for b in range(store.alloc.num_blocks))
