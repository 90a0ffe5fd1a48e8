"""Every pass plans over the whole module before mutating any layer: a failure anywhere leaves
every layer exactly as it was; a second run changes nothing."""

from __future__ import annotations

import pytest
import torch

from dsv4 import AttentionStack, DSV4Config, process_weights_after_loading
from dsv4.platforms import build_attention
from dsv4.testing.random_weights import random_layer_weights


def bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


def snapshot(stack):
    return [{k: bits(v).clone() for k, v in m.state_dict().items()}
            | {"_storage": [p.untyped_storage().data_ptr() for p in m.parameters()]}
            for m in stack]


@pytest.fixture
def two_c4():
    cfg = DSV4Config.preset("tiny").replace(compress_ratios=(4, 4, 128, 0))
    layers = {}
    for i in range(cfg.num_layers_with_mtp):
        m = build_attention(cfg, i, platform="preshuffle")
        m.load_weights(random_layer_weights(cfg, i).items())
        layers[i] = m
    return AttentionStack(cfg, layers)


def test_a_failing_layer_leaves_every_layer_unchanged(two_c4):
    bad = two_c4[1].indexer.compressor.fused_wkv_wgate.weight
    bad.data = bad.data.float()  # dtype mismatch in layer 1 only
    before = snapshot(two_c4)
    with pytest.raises(ValueError, match="layer 1: compressor GEMM fusion: dtypes differ"):
        process_weights_after_loading(two_c4)
    after = snapshot(two_c4)
    for b, a in zip(before, after, strict=True):
        assert b["_storage"] == a["_storage"]
        for k in b:
            if k != "_storage":
                assert torch.equal(a[k], b[k]), k
    assert two_c4[0]._fused_compressor_weight is None  # layer 0 was valid, still untouched
    assert two_c4[0]._wqa_wkv_scale is None


def test_every_pass_is_idempotent(two_c4):
    first = process_weights_after_loading(two_c4)
    assert first.changed == {"compressor_fusion": [0, 1], "preshuffle": [0, 1, 2, 3]}
    snap = snapshot(two_c4)
    second = process_weights_after_loading(two_c4)
    assert second.changed == {}
    assert snapshot(two_c4)[0]["_storage"] == snap[0]["_storage"]


def test_unknown_pass_name_lists_the_valid_ones(two_c4):
    with pytest.raises(ValueError, match=r"unknown pass\(es\) \['fuse_everything'\]; available"):
        process_weights_after_loading(two_c4, passes=["fuse_everything"])


def test_base_input_gemm_is_bit_identical_to_the_module_call(tiny, make_layer):
    layer = make_layer(tiny, 4)
    x = torch.randn(9, tiny.hidden_size).bfloat16()
    assert torch.equal(layer._fused_wqa_wkv_gemm(x), layer.fused_wqa_wkv(x))


@pytest.mark.cuda
def test_base_input_gemm_is_bit_identical_on_cuda(tiny, make_layer):
    layer = make_layer(tiny, 4).to("cuda")
    x = torch.randn(9, tiny.hidden_size, device="cuda").bfloat16()
    assert torch.equal(layer._fused_wqa_wkv_gemm(x), layer.fused_wqa_wkv(x))
