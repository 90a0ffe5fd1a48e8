"""Forward refuses a layer whose weights were never loaded, and NaN / Inf inputs, before
anything is written to a cache."""

from __future__ import annotations

import pytest
import torch

from dsv4 import AttentionInputError, DSV4Config
from dsv4.platforms import build_attention
from dsv4.testing.random_weights import random_layer_weights
from test_bad_input import assert_same_cache, snapshot_cache

from conftest import random_x


def test_forward_on_unloaded_layer_names_what_is_missing(tiny):
    layer = build_attention(tiny, 1)
    cache = layer.new_cache(16)
    x = random_x(3, tiny.hidden_size).bfloat16()
    with pytest.raises(AttentionInputError, match=r"layer 1 .*never loaded \(wq_a.weight"):
        layer(x, torch.arange(3), cache)
    assert cache.length == 0
    layer.load_weights(random_layer_weights(tiny, 1).items())
    assert torch.isfinite(layer(x, torch.arange(3), cache)).all()


def test_load_state_dict_counts_as_loaded(tiny, make_layer):
    src = make_layer(tiny, 128)
    layer = build_attention(tiny, src.layer_id)
    layer.load_state_dict(src.state_dict())
    x = random_x(4, tiny.hidden_size).bfloat16()
    assert torch.equal(layer(x, torch.arange(4), layer.new_cache(8)),
                       src(x, torch.arange(4), src.new_cache(8)))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_is_rejected_before_the_cache_changes(tiny, make_layer, bad):
    layer = make_layer(tiny, 4)
    cache = layer.new_cache(64)
    layer(random_x(10, tiny.hidden_size).bfloat16(), torch.arange(10), cache)
    snap = snapshot_cache(cache)
    x = random_x(6, tiny.hidden_size).bfloat16()
    x[2, 5] = bad
    x[4, 0] = bad
    with pytest.raises(AttentionInputError, match=r"NaN or Inf in token row\(s\) \[2, 4\]"):
        layer(x, torch.arange(10, 16), cache)
    assert cache.length == 10
    assert_same_cache(cache, snap)


def test_non_finite_in_a_decode_batch_names_the_row(tiny, make_layer):
    layer = make_layer(tiny, 0)
    caches = layer.new_caches(3, 8)
    x = random_x(3, tiny.hidden_size).bfloat16()
    x[1] = float("nan")
    with pytest.raises(AttentionInputError, match=r"token row\(s\) \[1\]"):
        layer(x, torch.zeros(3, dtype=torch.long), caches)
    assert [c.length for c in caches] == [0, 0, 0]


def test_check_finite_inputs_is_a_runtime_option():
    cfg = DSV4Config.preset("tiny")
    assert cfg.check_finite_inputs is False
    on = cfg.replace(check_finite_inputs=True)
    assert "check_finite_inputs" not in on.to_dict()
    assert DSV4Config.from_dict(on.to_dict()).check_finite_inputs is False
    assert DSV4Config.from_dict({**cfg.to_dict(), "check_finite_inputs": True}).check_finite_inputs


@pytest.mark.cuda
@pytest.mark.parametrize("switch", [False, True])
def test_cuda_checks_only_with_the_switch(tiny, switch):
    cfg = tiny.replace(check_finite_inputs=switch)
    layer = build_attention(cfg, 0, device="cuda")
    layer.load_weights(random_layer_weights(cfg, 0).items())
    x = random_x(2, cfg.hidden_size).bfloat16().cuda()
    x[1, 0] = float("nan")
    cache = layer.new_cache(8)
    if switch:
        with pytest.raises(AttentionInputError, match=r"token row\(s\) \[1\]"):
            layer(x, torch.arange(2), cache)
        assert cache.length == 0
    else:
        layer(x, torch.arange(2), cache)  # not checked: no device sync in the forward
        assert cache.length == 2
