"""The preshuffle pass: in-place (16, 16) layout, fp32 scales, idempotency, canonical weights."""

from __future__ import annotations

import pytest
import torch

from dsv4 import DeepseekV4Attention, load_checkpoint, process_weights_after_loading
from dsv4 import save_checkpoint as save
from dsv4.layers.weight_layout import PlatformLayoutError, get_layout
from dsv4.platforms import build_attention
from dsv4.platforms.preshuffle_ops import shuffle_weight
from dsv4.testing.random_weights import random_layer_weights

from conftest import random_x, rel_err


def bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.fixture
def pre(tiny, make_layer):
    return make_layer(tiny, 4, platform="preshuffle")


def test_preshuffle_rewrites_in_place_and_keeps_fp32_scales(pre):
    w0 = pre.fused_wqa_wkv.weight.detach().clone()
    ptr0 = pre.fused_wqa_wkv.weight.data_ptr()
    report = process_weights_after_loading(pre, passes=["preshuffle"])
    assert report.changed["preshuffle"] == [pre.layer_id]
    w = pre.fused_wqa_wkv.weight
    assert w.data_ptr() == ptr0 and w.shape == w0.shape and w.dtype == w0.dtype
    assert torch.equal(bits(w.detach()), bits(shuffle_weight(w0)))
    assert not torch.equal(bits(w.detach()), bits(w0))
    assert get_layout(w) is not None and get_layout(pre.wo_b.weight) is not None
    assert pre._wqa_wkv_scale.dtype == torch.float32
    assert torch.equal(pre._wqa_wkv_scale, pre.fused_wqa_wkv.scale.float())


def test_preshuffle_twice_is_impossible(pre):
    process_weights_after_loading(pre, passes=["preshuffle"])
    w1 = pre.fused_wqa_wkv.weight.detach().clone()
    report = process_weights_after_loading(pre, passes=["preshuffle"])
    assert "preshuffle" not in report.changed
    assert "already preshuffled" in report.skipped["preshuffle"][0][1]
    assert torch.equal(bits(pre.fused_wqa_wkv.weight.detach()), bits(w1))


def test_ineligible_weights_stay_canonical(tiny, make_layer):
    cfg = tiny.replace(fp8_weights=False)
    layer = build_attention(cfg, 0, platform="preshuffle")
    layer.load_weights(random_layer_weights(cfg, 0).items())
    report = process_weights_after_loading(layer)
    assert "not an fp8 block-scaled weight" in report.skipped["preshuffle"][0][1]
    assert layer._wqa_wkv_scale is None
    ref = make_layer(tiny, 4)
    skip = process_weights_after_loading(ref, passes=["preshuffle"]).skipped["preshuffle"]
    assert "has no preshuffled GEMM" in skip[0][1]


def test_plain_gemm_refuses_a_preshuffled_weight(pre, tiny):
    """The upstream #51821 failure cannot happen silently: a plain GEMM over the shuffled
    weight raises, naming it."""
    process_weights_after_loading(pre)
    x = random_x(3, tiny.hidden_size).bfloat16()
    with pytest.raises(PlatformLayoutError, match=r"layers.1.attn.fused_wqa_wkv.weight .*"
                                                  r"aiter_preshuffle_16x16"):
        pre.fused_wqa_wkv(x)
    with pytest.raises(PlatformLayoutError, match="wo_b"):
        DeepseekV4Attention._o_proj(pre, torch.zeros(3, 4, 128, dtype=torch.bfloat16),
                                    torch.arange(3))


def test_preshuffled_gemm_flattens_3d_inputs(pre, tiny):
    process_weights_after_loading(pre)
    x = random_x(6, tiny.hidden_size).bfloat16()
    flat = pre._fused_wqa_wkv_gemm(x)
    assert torch.equal(pre._fused_wqa_wkv_gemm(x.view(2, 3, -1)).view(6, -1), flat)


def test_state_dict_and_checkpoint_are_canonical(pre, tiny, tmp_path, make_layer):
    before = {k: bits(v).clone() for k, v in pre.state_dict().items()}
    process_weights_after_loading(pre)
    after = pre.state_dict()
    assert after.keys() == before.keys()
    for k in before:
        assert torch.equal(bits(after[k]), before[k]), k
    save(pre, tmp_path)
    ref = load_checkpoint(tmp_path, layers=[pre.layer_id], platform="reference")[pre.layer_id]
    for k, v in ref.state_dict().items():
        assert torch.equal(bits(v), before[k]), k


def test_round_trip_preshuffle_to_reference_is_bit_exact(tiny, tmp_path, make_layer):
    src = {}
    for i in range(tiny.num_layers_with_mtp):
        m = build_attention(tiny, i)
        m.load_weights(random_layer_weights(tiny, i, seed=4).items())
        src[i] = m
    from dsv4 import AttentionStack

    save(AttentionStack(tiny, src), tmp_path / "a")
    pre = load_checkpoint(tmp_path / "a", platform="preshuffle")  # load + fuse + preshuffle
    assert get_layout(pre[0].wo_b.weight) is not None
    save(pre, tmp_path / "b")
    back = load_checkpoint(tmp_path / "b", platform="reference")
    for i, m in src.items():
        for k, v in m.state_dict().items():
            assert torch.equal(bits(back[i].state_dict()[k]), bits(v)), (i, k)
    a = (tmp_path / "a" / "model.safetensors").read_bytes()
    b = (tmp_path / "b" / "model.safetensors").read_bytes()
    assert a == b


def test_load_weights_and_load_state_dict_after_preshuffle(pre, tiny, make_layer):
    process_weights_after_loading(pre)
    new = random_layer_weights(tiny, pre.layer_id, seed=11)
    pre.load_weights(new.items())
    fresh = make_layer(tiny, 4, platform="preshuffle", seed=11)
    process_weights_after_loading(fresh)
    for k, v in fresh.state_dict().items():
        assert torch.equal(bits(pre.state_dict()[k]), bits(v)), k
    assert torch.equal(pre._wqa_wkv_scale, fresh._wqa_wkv_scale)
    x = random_x(40, tiny.hidden_size).bfloat16()
    y = fresh(x, torch.arange(40), fresh.new_cache(40))
    assert torch.equal(pre(x, torch.arange(40), pre.new_cache(40)), y)
    # load_state_dict takes canonical tensors (what state_dict returns), assign or copy
    other = make_layer(tiny, 4, seed=11)
    for assign in (False, True):
        pre.load_state_dict(other.state_dict(), assign=assign)
        assert get_layout(pre.fused_wqa_wkv.weight) is not None
        assert torch.equal(pre(x, torch.arange(40), pre.new_cache(40)), y)


def test_preshuffle_platform_close_to_reference(pre, tiny, make_layer):
    """fp8 activations make it visibly different, nowhere near garbage (the reference replays
    the platform's top-k picks: near ties may break differently)."""
    from dsv4.testing.probes import record_selection, replay_selection

    ref = make_layer(tiny, 4)
    process_weights_after_loading(pre)
    x = random_x(50, tiny.hidden_size).bfloat16()
    with record_selection(pre) as seen:
        y = pre(x, torch.arange(50), pre.new_cache(50))
    with replay_selection(ref, seen):
        y_ref = ref(x, torch.arange(50), ref.new_cache(50))
    assert 1e-3 < rel_err(y, y_ref) < 8e-2
