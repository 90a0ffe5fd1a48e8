"""Prefill memory stays linear in the tokens of a call (issue 14), measured, not assumed.

:class:`dsv4.testing.probes.AllocationTracker` records the peak bytes of the tensors a forward
creates (torch's CPU allocator keeps no peak). One step holds every token here
(``max_step_tokens`` above T), so the bound must come from the layer's own chunking (indexer
scores and attention rows per query chunk, sized by ``attention_workspace_bytes``), not from the
step split. A quadratic
intermediate (e.g. the indexer's scores of every query against every entry for all heads, as
before the paged cache) makes the peak per token grow with T and fails these tests.
"""

from __future__ import annotations

import pytest
import torch

from dsv4.testing.probes import AllocationTracker

from conftest import RATIOS

WORKSPACE = 1 << 20


def _peak(layer, t: int, context: int = 0) -> AllocationTracker:
    cfg = layer.cfg
    cache = layer.new_cache(context + t)
    gen = torch.Generator().manual_seed(t + context)
    if context:
        x0 = torch.randn(context, cfg.hidden_size, generator=gen).to(layer.dtype)
        layer(x0, torch.arange(context), cache)
    x = torch.randn(t, cfg.hidden_size, generator=gen).to(layer.dtype)
    with torch.no_grad(), AllocationTracker() as mem:
        y = layer(x, torch.arange(context, context + t), cache)
    assert mem.live >= y.numel() * y.element_size()  # the output is still held: it was seen
    return mem


@pytest.fixture
def long_cfg(tiny):
    """The tiny preset with 32 index heads, so that an unchunked indexer score matrix (T x heads
    x entries) would dominate the peak at these sizes (with 8 heads it would hide among the
    activations), one step for the whole call, and a 1 MiB workspace."""
    return tiny.replace(max_position_embeddings=1 << 16, max_step_tokens=1 << 14,
                        attention_workspace_bytes=WORKSPACE, index_n_heads=32)


def test_tracker_counts_live_tensors_and_ignores_existing_storage():
    keep = torch.zeros(1000)
    with AllocationTracker() as mem:
        a = torch.ones(1 << 18)  # 1 MiB
        b = a.view(512, 512)
        del a
        c = torch.ones(1 << 17)  # 0.5 MiB, while b holds the first storage
        keep.add_(1)  # in place on a storage from before: not counted
        del b, c
        d = torch.ones(1 << 16)
    assert mem.peak == (1 << 20) + (1 << 19)
    assert mem.live == 1 << 18 and mem.largest[0] == 1 << 20
    assert d.numel() == 1 << 16


def _row_bytes(cfg) -> int:
    """The widest per-token fp32 activation row of a layer (hidden, all query heads, all index
    heads, a ratio-4 compressor's 8 source rows): what one token may hold at once."""
    return 4 * max(cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim,
                   cfg.index_n_heads * cfg.index_head_dim, 8 * 2 * cfg.head_dim)


@pytest.mark.parametrize("ratio", RATIOS)
def test_prefill_memory_is_linear_in_tokens_plus_a_workspace(long_cfg, make_layer, ratio):
    """8x the tokens in one step: at most ~8x the peak, and no single intermediate larger than
    1.5 per-token rows per token plus twice the workspace (a T x entries x heads score matrix
    is larger); a chunk over a cached context: the same bound and nearly the same peak."""
    layer = make_layer(long_cfg, ratio)
    row = _row_bytes(long_cfg)
    small, big = _peak(layer, 128), _peak(layer, 1024)
    growth = big.peak / small.peak
    assert growth < 8 * 1.15, (f"ratio {ratio}: peak {small.peak >> 10} KiB at 128 tokens, "
                               f"{big.peak >> 10} KiB at 1024 ({growth:.1f}x for 8x the tokens; "
                               f"largest: {big.largest})")
    assert big.largest[0] < 1.5 * 1024 * row + 2 * WORKSPACE, big.largest
    if ratio:
        late = _peak(layer, 128, context=1920)
        assert late.largest[0] < 1.5 * 128 * row + 2 * WORKSPACE, late.largest
        assert late.peak < 1.35 * small.peak + 2 * WORKSPACE, (small.peak, late.peak,
                                                               late.largest)
