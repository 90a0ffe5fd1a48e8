"""fuse_input_projections: one packed weight for the four input GEMMs, zero-copy views."""

from __future__ import annotations

import pytest
import torch

from dsv4 import process_weights_after_loading
from dsv4.kernels.launch import _INTERPRET
from dsv4.offload import CpuOffloader
from dsv4.passes.input_fusion import input_segments
from dsv4.platforms import build_attention
from dsv4.testing.contract import path_violations

from conftest import RATIOS, random_x


def ptr(t):
    return t.untyped_storage().data_ptr()


def bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


PASSES = ["compressor_fusion", "fuse_input_projections"]

module_math = pytest.mark.skipif(
    _INTERPRET, reason="compares the packed layer bit for bit with the unpacked modules, which "
    "holds where the packed call computes as they do (the CPU); under TRITON_INTERPRET=1 it "
    "runs the kernel")


@module_math
@pytest.mark.parametrize("ratio", RATIOS)
def test_pack_keeps_every_parameter_as_a_view(tiny, make_layer, ratio):
    layer = make_layer(tiny, ratio)
    plain = make_layer(tiny, ratio)
    before = {k: bits(v).clone() for k, v in layer.state_dict().items()}
    report = process_weights_after_loading(layer, passes=PASSES)
    assert report.changed["fuse_input_projections"] == [layer.layer_id]
    pack = layer._packed_input_weight
    segs = input_segments(layer)
    assert layer.fused_wqa_wkv.weight.dtype == torch.float8_e4m3fn  # fp8 segment stays fp8
    for _, p, _ in segs[1:]:
        assert ptr(p) == ptr(pack)
    if ratio == 4:
        fused = layer._fused_compressor_weight
        assert ptr(fused) == ptr(pack)
        main, idx = layer.fused_compressor_params()
        assert torch.equal(fused, torch.cat((main, idx)))
    after = layer.state_dict()
    assert after.keys() == before.keys()
    assert not any("packed" in k for k in after)
    for k, v in before.items():
        assert torch.equal(bits(after[k]), v), k
    x = random_x(21, tiny.hidden_size).bfloat16()
    assert torch.equal(layer(x, torch.arange(21), layer.new_cache(21)),
                       plain(x, torch.arange(21), plain.new_cache(21)))
    assert path_violations(layer, x) == []
    again = process_weights_after_loading(layer, passes=PASSES)
    assert "fuse_input_projections" not in again.changed


def test_pack_skips_what_it_cannot_take(tiny, make_layer):
    f64 = make_layer(tiny, 4, torch.float64)
    skip = process_weights_after_loading(f64, passes=PASSES).skipped["fuse_input_projections"]
    assert "layer dtype torch.float64" in skip[0][1]
    pre = make_layer(tiny, 4, platform="preshuffle")
    process_weights_after_loading(pre, passes=["preshuffle"])
    skip = process_weights_after_loading(pre, passes=PASSES).skipped["fuse_input_projections"]
    assert "platform layout" in skip[0][1]


@module_math
def test_pack_survives_reload_and_module_conversion(tiny, make_layer):
    from dsv4.testing.random_weights import random_layer_weights

    layer = make_layer(tiny, 4)
    process_weights_after_loading(layer, passes=PASSES)
    new = random_layer_weights(tiny, layer.layer_id, seed=3)
    new["wq_a.scale"].view(torch.uint8)[0, 1] += 1  # one block doubles (a uniform change
    layer.load_weights(new.items())  # would vanish in q_norm)
    fresh = make_layer(tiny, 4)
    fresh.load_weights(new.items())
    x = random_x(9, tiny.hidden_size).bfloat16()
    y = fresh(x, torch.arange(9), fresh.new_cache(9))
    assert torch.equal(layer(x, torch.arange(9), layer.new_cache(9)), y)
    layer._apply(lambda t: t.clone())
    for _, p, _ in input_segments(layer)[1:]:
        assert ptr(p) == ptr(layer._packed_input_weight)
    assert torch.equal(layer(x, torch.arange(9), layer.new_cache(9)), y)


@module_math
@pytest.mark.parametrize("act_quant", [False, True])
@pytest.mark.parametrize("ratio", RATIOS)
def test_packed_products_equal_the_unpacked_layers_bit_for_bit(tiny, make_layer, ratio,
                                                                act_quant):
    """Without the kernel (CPU) the packed call computes each segment as its module does: the
    float32 reference cast to bf16 rounds a few of 512 x 264 values differently from a bf16
    GEMM (found: 3 % of 17-token calls changed the layer's output)."""
    cfg = tiny.replace(act_quant=act_quant)
    layer = make_layer(cfg, ratio, seed=5)
    plain = make_layer(cfg, ratio, seed=5)
    process_weights_after_loading(layer, passes=PASSES)
    assert layer._input_pack_usable()
    g = torch.Generator().manual_seed(ratio + 11 * act_quant)
    x = torch.randn(512, cfg.hidden_size, generator=g).bfloat16()
    got = layer._fused_input_projections_gemm(x)
    want = plain._stream_input_projections(x)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert (a is None) == (b is None), i
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), \
                f"output {i}: {int((a != b).sum())} of {a.numel()} values differ"


@module_math
def test_pack_composes_with_offload(tiny, make_layer):
    from dsv4.testing.random_weights import random_layer_weights

    plain = make_layer(tiny, 4, seed=2)
    off = CpuOffloader("cpu")
    layer = build_attention(tiny, 1, offloader=off)
    layer.load_weights(random_layer_weights(tiny, 1, seed=2).items())
    report = process_weights_after_loading(layer, passes=PASSES)
    assert report.changed["fuse_input_projections"] == [1]
    pack = layer._packed_input_weight
    for name, p, _ in input_segments(layer)[1:]:
        assert ptr(p) == ptr(pack), f"{name} left the pack"  # moved as one unit, re-pointed
    assert ptr(layer._fused_compressor_weight) == ptr(pack)
    x = random_x(17, tiny.hidden_size).bfloat16()
    got = layer(x, torch.arange(17), layer.new_cache(17))
    want = plain(x, torch.arange(17), plain.new_cache(17))
    # this failed once (2026-12-05, in the middle of a GPU machine's suite: x then depended on
    # the tests before it) while the packed CPU call rounded its bf16 segments from float32
    # math (the test above); if it ever fails again, say how
    diff = (got.double() - want.double()).abs()
    assert torch.equal(got, want), (
        f"offloaded packed layer differs from the plain one: max |diff| {diff.max().item():.3e} "
        f"at {divmod(int(diff.argmax()), got.shape[-1])}, {int((diff > 0).sum())} of "
        f"{diff.numel()} values, nan {bool(got.isnan().any())}/{bool(want.isnan().any())}, "
        f"offloader {off.describe()}")
