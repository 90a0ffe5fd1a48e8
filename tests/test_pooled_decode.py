"""Pooled caches (``layer.new_caches``): a decode batch of them runs batched and computes what
the sequence-by-sequence path computes, for every layer type; a platform's own ``forward_mqa``
is never bypassed."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4 import DeepseekV4Attention
from dsv4.probes import spy_methods

from conftest import RATIOS, random_x, rel_err

# prompt lengths: shorter than the window (16), straddling ratio-4 blocks, past one 128 block
PROMPTS = (3, 15, 16, 33, 130)
STEPS = 9  # crosses ratio-4 entry boundaries for every sequence


def decode_both_ways(layer, cfg, steps=STEPS, prompts=PROMPTS):
    """(outputs of pooled decode, of per-sequence decode) over ``steps`` decode steps."""
    xs = [random_x(n + steps, cfg.hidden_size, seed=i).to(layer.dtype)
          for i, n in enumerate(prompts)]
    max_len = max(prompts) + steps
    pooled = layer.new_caches(len(prompts), max_len)
    single = [layer.new_cache(max_len) for _ in prompts]
    for caches in (pooled, single):
        for x, n, c in zip(xs, prompts, caches, strict=True):
            layer(x[:n], torch.arange(n), c)
    got, want = [], []
    for s in range(steps):
        x = torch.stack([x[n + s] for x, n in zip(xs, prompts, strict=True)])
        pos = torch.tensor([n + s for n in prompts])
        got.append(layer(x, pos, pooled))
        want.append(layer(x, pos, single))
    return torch.stack(got), torch.stack(want), pooled, single


@pytest.mark.parametrize("ratio", RATIOS)
def test_pooled_decode_equals_per_sequence_decode_float64(tiny_exact, make_layer, ratio):
    layer = make_layer(tiny_exact, ratio, torch.float64)
    with spy_methods(layer, ["forward_mqa", "forward_mqa_batched"]) as calls:
        got, want, pooled, single = decode_both_ways(layer, tiny_exact)
    assert rel_err(got, want) < 1e-12
    assert len(calls["forward_mqa_batched"]) == STEPS  # every pooled step ran batched
    assert len(calls["forward_mqa"]) == len(PROMPTS) * (STEPS + 2)  # prefills + per-seq steps
    for p, c in zip(pooled, single, strict=True):  # the caches hold bitwise the same state
        assert p.length == c.length
        assert torch.equal(p.kv[:p.length], c.kv[:c.length])
        for name in ("raw", "idx_raw"):  # rings: the rows of the last positions
            a, b = getattr(p, name), getattr(c, name)
            assert (a is None) == (b is None)
            if a is not None:
                held = torch.arange(max(0, p.length - a.shape[0]), p.length) % a.shape[0]
                assert torch.equal(a[held], b[held])
        for name in ("compressed", "idx_keys"):
            a, b = getattr(p, name), getattr(c, name)
            assert a is None or torch.equal(a, b)


@pytest.mark.parametrize("ratio", RATIOS)
def test_pooled_decode_bf16_with_simulations(tiny, make_layer, ratio):
    layer = make_layer(tiny, ratio, torch.bfloat16)
    got, want, _, _ = decode_both_ways(layer, tiny)
    assert rel_err(got, want) < 1e-2


def test_pooled_cache_views_share_one_pool(tiny, make_layer):
    layer = make_layer(tiny, 4)
    caches = layer.new_caches(3, 40)
    pool = caches[0].pool
    assert pool is not None and all(c.pool is pool for c in caches)
    assert [c.slot for c in caches] == [0, 1, 2]
    assert caches[1].kv.data_ptr() == pool.kv[1].data_ptr()
    assert pool.slots_of([caches[2], caches[0]]).tolist() == [2, 0]
    with pytest.raises(ValueError, match="max_seq_len"):
        layer.new_caches(2, 0)
    with pytest.raises(ValueError, match="at least one slot"):
        layer.new_caches(0, 8)


def test_mixed_batches_and_prefill_chunks_fall_back_to_per_sequence(tiny_exact, make_layer):
    """A pooled cache in a batch with a cache of its own, or a call of several tokens per
    sequence, runs sequence by sequence (and still agrees)."""
    layer = make_layer(tiny_exact, 4, torch.float64)
    pooled = layer.new_caches(2, 64)
    own = layer.new_cache(64)
    x = random_x(6, tiny_exact.hidden_size).to(torch.float64)
    with spy_methods(layer, ["forward_mqa_batched"]) as calls:
        layer(x[:3], torch.tensor([0, 0, 0]), [pooled[0], pooled[1], own])
        layer(x[3:5], torch.tensor([1, 2]), [pooled[0]], seq_lens=[2])
    assert calls["forward_mqa_batched"] == []


class OwnMqa(DeepseekV4Attention):
    """A platform with its own per-sequence attention kernel and no batched one."""

    def forward_mqa(self, q, positions, cache, selection):
        return super().forward_mqa(q, positions, cache, selection)


def test_a_platforms_forward_mqa_is_never_bypassed(tiny_exact):
    layer = OwnMqa(tiny_exact, tiny_exact.layer_of_ratio(4), dtype=torch.float64)
    from dsv4.random_weights import random_layer_weights

    layer.load_weights(random_layer_weights(tiny_exact, layer.layer_id, 0).items())
    with spy_methods(layer, ["forward_mqa", "forward_mqa_batched"]) as calls:
        got, want, _, _ = decode_both_ways(layer, tiny_exact, steps=2)
    assert calls["forward_mqa_batched"] == []
    assert len(calls["forward_mqa"]) == len(PROMPTS) * (2 * 2 + 2)
    assert rel_err(got, want) == 0


def test_record_selection_sees_pooled_calls(tiny_exact, make_layer):
    from dsv4.probes import record_selection

    layer = make_layer(tiny_exact, 4, torch.float64)
    caches = layer.new_caches(2, 64)
    x = random_x(42, tiny_exact.hidden_size).to(torch.float64)
    with record_selection(layer) as seen:
        for c in caches:
            layer(x[:20], torch.arange(20), c)
        layer(x[20:22], torch.tensor([20, 20]), caches)
    assert [None if s is None else tuple(s.shape) for s in seen] == [
        (20, tiny_exact.index_topk), (20, tiny_exact.index_topk), (2, tiny_exact.index_topk)]
    with record_selection(layer) as seen:
        layer(x[22:24], torch.tensor([21, 21]), caches)
    assert len(seen) == 1 and seen[0] is not None and seen[0].shape == (2, tiny_exact.index_topk)


@settings(max_examples=10, deadline=None)
@given(prompts=st.lists(st.integers(1, 40), min_size=1, max_size=5),
       steps=st.integers(1, 6), ratio=st.sampled_from(RATIOS))
def test_pooled_decode_property(prompts, steps, ratio):
    """Any prompt lengths and step counts: pooled decode equals per-sequence decode (float64)."""
    from dsv4 import DSV4Config
    from dsv4.random_weights import random_layer_weights

    cfg = DSV4Config.preset("tiny").replace(simulate_quant=False)
    layer = DeepseekV4Attention(cfg, cfg.layer_of_ratio(ratio), dtype=torch.float64)
    layer.load_weights(random_layer_weights(cfg, layer.layer_id, 0).items())
    got, want, _, _ = decode_both_ways(layer, cfg, steps=steps, prompts=tuple(prompts))
    assert rel_err(got, want) < 1e-12


@pytest.mark.parametrize("ratio", RATIOS)
def test_unwritten_rows_are_never_read(tiny, make_layer, monkeypatch, ratio):
    """The per-position row stores are allocated uninitialised: filled with NaN instead of
    zeros, prefill, chunked prefill, decode and pooled decode give bitwise the same outputs."""
    import dsv4.layers.cache as cache_mod

    def run(fill):
        monkeypatch.setattr(cache_mod, "new_row_store",
                            lambda shape, dtype, device: torch.full(shape, fill, dtype=dtype,
                                                                    device=device))
        layer = make_layer(tiny, ratio, torch.bfloat16)
        x = random_x(140, tiny.hidden_size, seed=5).bfloat16()
        outs = [layer(x, torch.arange(140), layer.new_cache(150))]
        c = layer.new_cache(150)
        outs += [layer(x[s:s + n], torch.arange(s, s + n), c)
                 for s, n in ((0, 7), (7, 30), (37, 1), (38, 102))]
        got, _, _, _ = decode_both_ways(layer, tiny, steps=5)
        return [*outs, got]

    for a, b in zip(run(float("nan")), run(0.0), strict=True):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b)


@pytest.mark.parametrize("ratio", [4, 128])
def test_a_call_that_fails_late_leaves_the_raw_rings_usable(tiny_exact, make_layer, ratio):
    """The rings keep only the last positions' raw rows; a call that fails after its cache
    writes (here: in the attention) must not have replaced rows a retry still needs."""
    layer = make_layer(tiny_exact, ratio, torch.float64)
    x = random_x(300, tiny_exact.hidden_size, seed=9).to(torch.float64)
    chunks = [(0, 7), (7, 6), (13, 130), (143, 1), (144, 100)]

    def run(fail_at: int | None):
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


def test_raw_rows_are_rings_whatever_the_context(tiny, make_layer):
    c4, c128 = make_layer(tiny, 4), make_layer(tiny, 128)
    a, b = c4.new_cache(500), c128.new_cache(500)
    assert a.raw.shape[0] == 8 and a.idx_raw.shape[0] == 8 and b.raw.shape[0] == 128
    pooled = c4.new_caches(3, 500)
    assert pooled[0].pool.raw.shape[:2] == (3, 8)
