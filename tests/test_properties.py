"""Property tests (hypothesis) of the cached layer: causality, compressor dependence, RoPE
inverse, top-k visibility."""

from __future__ import annotations

import functools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4 import DeepseekV4Attention, DSV4Config
from dsv4.layers.indexer import Indexer
from dsv4.layers.rotary import RotaryEmbedding
from dsv4.platforms import build_attention
from dsv4.testing.random_weights import random_layer_weights

from conftest import RATIOS

CFG = DSV4Config.preset("tiny")
SETTINGS = settings(max_examples=12, deadline=None)


@functools.cache
def layer(ratio: int, simulate: bool = True) -> DeepseekV4Attention:
    cfg = CFG.replace(simulate_quant=simulate)
    lid = cfg.layer_of_ratio(ratio)
    m = build_attention(cfg, lid, dtype=torch.float64)
    m.load_weights(random_layer_weights(cfg, lid, seed=3).items())
    return m


def x_of(seed: int, t: int) -> torch.Tensor:
    return torch.randn(t, CFG.hidden_size, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


def prefill(m: DeepseekV4Attention, x: torch.Tensor):
    cache = m.new_cache(x.shape[0])
    return m(x, torch.arange(x.shape[0]), cache), cache


@SETTINGS
@given(ratio=st.sampled_from(RATIOS), t=st.integers(2, 300), data=st.data())
def test_causality(ratio, t, data):
    """Perturbing tokens after p never changes the output at p (simulations on)."""
    p = data.draw(st.integers(0, t - 2))
    seed = data.draw(st.integers(0, 2**16))
    m = layer(ratio)
    x = x_of(seed, t)
    y, _ = prefill(m, x)
    x2 = x.clone()
    x2[p + 1:] += 3.0 * torch.randn_like(x2[p + 1:])
    y2, _ = prefill(m, x2)
    assert torch.allclose(y[:p + 1], y2[:p + 1], rtol=0, atol=1e-12)
    assert not torch.allclose(y[p + 1:], y2[p + 1:])


@SETTINGS
@given(ratio=st.sampled_from((4, 128)), data=st.data())
def test_compressed_entry_depends_only_on_its_block(ratio, data):
    """Entry j depends on positions <= j*r + r - 1 only, and does depend on the last of them."""
    t = 300 if ratio == 128 else data.draw(st.integers(8, 120))
    n = t // ratio
    j = data.draw(st.integers(0, n - 1))
    last = j * ratio + ratio - 1
    m = layer(ratio)
    x = x_of(data.draw(st.integers(0, 2**16)), t)
    _, c = prefill(m, x)
    after = x.clone()
    after[last + 1:] += 1.0
    _, c_after = prefill(m, after)
    assert torch.equal(c.rows("compressed", 0, j + 1), c_after.rows("compressed", 0, j + 1))
    if ratio == 4:
        assert torch.equal(c.rows("idx_keys", 0, j + 1), c_after.rows("idx_keys", 0, j + 1))
    at_last = x.clone()
    at_last[last] += 1.0
    _, c_last = prefill(m, at_last)
    assert not torch.equal(c.rows("compressed", j, j + 1), c_last.rows("compressed", j, j + 1))


@SETTINGS
@given(ratio=st.sampled_from(RATIOS), t=st.integers(1, 40),
       start=st.integers(0, 1_000_000), extra=st.integers(0, 2),
       dtype=st.sampled_from((torch.float32, torch.float64)))
def test_rope_then_inverse_is_identity(ratio, t, start, extra, dtype):
    rot = RotaryEmbedding.for_layer(CFG, ratio)
    x = torch.randn(t, *([3] * extra), CFG.head_dim, dtype=dtype)
    pos = torch.arange(start, start + t)
    back = rot.rotate(rot.rotate(x, pos, dtype), pos, dtype, inverse=True)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert torch.allclose(back, x, rtol=0, atol=tol * 10)
    nope = CFG.head_dim - CFG.qk_rope_head_dim
    assert torch.equal(rot.rotate(x, pos, dtype)[..., :nope], x[..., :nope])


@SETTINGS
@given(n=st.integers(0, 60), t=st.integers(1, 30), start=st.integers(0, 200),
       seed=st.integers(0, 2**16))
def test_topk_respects_visibility(n, t, start, seed):
    g = torch.Generator().manual_seed(seed)
    idx = Indexer(CFG, dtype=torch.float64, f32_dtype=torch.float64)
    q = torch.randn(t, CFG.index_n_heads, CFG.index_head_dim, generator=g, dtype=torch.float64)
    w = torch.randn(t, CFG.index_n_heads, generator=g, dtype=torch.float64)
    keys = torch.randn(n, CFG.index_head_dim, generator=g, dtype=torch.float64)
    pos = torch.arange(start, start + t)
    sel = idx.select(q, w, keys, pos, torch.float64)
    assert sel.shape == (t, CFG.index_topk)
    for row, p in zip(sel, pos.tolist(), strict=True):
        picked = row[row >= 0].tolist()
        visible = min(n, (p + 1) // 4)
        assert len(picked) == min(CFG.index_topk, visible)
        assert len(set(picked)) == len(picked)
        assert all(0 <= j < visible for j in picked)
        assert (row[len(picked):] == -1).all()
