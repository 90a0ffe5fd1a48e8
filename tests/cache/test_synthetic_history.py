"""Synthetic cache history for long-context benchmarks: the blocks a step reads are held, the
rows read back as written, and bf16 / fp8_ds_mla caches filled alike give the same decode step."""

from __future__ import annotations

import pytest
import torch

from dsv4.bench.synthetic_cache import fill_history

from conftest import random_x, rel_err


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_filled_caches_decode_alike_in_bf16_and_fp8(tiny, make_layer, ratio):
    layer = make_layer(tiny, ratio)
    outs = []
    x = random_x(3, tiny.hidden_size).to(torch.bfloat16)
    for fmt in ("bf16", "fp8_ds_mla"):
        caches = layer.new_caches(3, 300, kv_cache_dtype=fmt)
        fill_history(caches, 260, seed=5)
        assert [c.length for c in caches] == [260] * 3
        kv = caches[0].pool.stores["kv"]
        # only the window's blocks are held
        assert kv.held_blocks(caches[0].slot) <= -(-tiny.sliding_window // kv.block_size) + 1
        if ratio:
            rows = caches[1].rows("compressed")
            assert rows.shape[0] == 260 // ratio and rows.abs().sum() > 0
        outs.append(layer(x, torch.tensor([260, 260, 260]), caches))
    assert torch.isfinite(outs[0]).all()
    assert rel_err(outs[1], outs[0]) < 1e-3


def test_fill_gives_each_sequence_its_own_context(tiny, make_layer):
    """Staggered histories (the decode-step bench's --stagger): cache i holds contexts[i]
    positions, its compressed entries as many as those complete, and a step from there runs."""
    layer = make_layer(tiny, 4)
    caches = layer.new_caches(3, 300)
    fill_history(caches, [257, 258, 259], seed=5)
    assert [c.length for c in caches] == [257, 258, 259]
    assert [c.rows("compressed").shape[0] for c in caches] == [64, 64, 64]
    out = layer(random_x(3, tiny.hidden_size).to(torch.bfloat16), torch.tensor([257, 258, 259]),
                caches)
    assert torch.isfinite(out).all()
    assert [c.rows("compressed").shape[0] for c in caches] == [64, 64, 65]
    with pytest.raises(ValueError, match="2 contexts for 3 caches"):
        fill_history(layer.new_caches(3, 300), [10, 11])


def test_fill_refuses_used_or_too_small_caches(tiny, make_layer):
    layer = make_layer(tiny, 0)
    c = layer.new_cache(64)
    with pytest.raises(ValueError, match="max_seq_len"):
        fill_history([c], 64)
    layer(random_x(2, tiny.hidden_size).to(torch.bfloat16), torch.arange(2), c)
    with pytest.raises(ValueError, match="empty"):
        fill_history([c], 10)
