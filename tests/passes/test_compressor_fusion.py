"""The C4 compressor GEMM fusion: upstream's invariants (vllm#53838 tests) and ours."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import dsv4.passes.compressor_fusion as cf
from dsv4 import process_weights_after_loading
from dsv4.offload import BaseOffloader
from dsv4.passes import prepare_compressor_gemm_fusion
from dsv4.platforms import build_attention

from conftest import random_x, rel_err


def ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.fixture
def c4(tiny, make_layer):
    return make_layer(tiny, 4)


def originals(layer):
    main, idx = layer.fused_compressor_params()
    return main.detach().clone(), idx.detach().clone()


def test_fusion_aliases_the_original_weights(c4):
    main0, idx0 = originals(c4)
    assert prepare_compressor_gemm_fusion(c4) is True
    main, idx = c4.fused_compressor_params()
    fused = c4._fused_compressor_weight
    assert c4._fused_compressor_split_sizes == (main0.shape[0], idx0.shape[0]) == (512, 512)
    assert torch.equal(fused[:512], main0) and torch.equal(fused[512:], idx0)
    assert ptr(main) == ptr(fused) == ptr(idx)
    assert main.storage_offset() == 0 and idx.storage_offset() == main.numel()
    sd = c4.state_dict()
    assert not any("_fused_compressor_weight" in k for k in sd)
    assert torch.equal(sd["compressor.fused_wkv_wgate.weight"], main0)
    assert torch.equal(sd["indexer.compressor.fused_wkv_wgate.weight"], idx0)
    before = fused.data_ptr()
    assert prepare_compressor_gemm_fusion(c4) is False  # idempotent
    assert c4._fused_compressor_weight.data_ptr() == before


class RebindingOffloader(BaseOffloader):
    """Stands for upstream's UVA / prefetch offloaders: rebinds parameters, knows no fusion."""

    name = "rebinding"


def test_fusion_is_skipped_under_a_rebinding_offloader(c4, caplog, monkeypatch):
    monkeypatch.setattr(cf, "_warned_offload", False)
    c4.offloader = RebindingOffloader()
    with caplog.at_level(logging.WARNING):
        assert prepare_compressor_gemm_fusion(c4) is False
        assert prepare_compressor_gemm_fusion(c4) is False
    assert c4._fused_compressor_weight is None
    main, idx = c4.fused_compressor_params()
    assert ptr(main) != ptr(idx)
    warnings = [r for r in caplog.records if "incompatible" in r.getMessage()]
    assert len(warnings) == 1  # warn once


def test_fused_projection_is_one_fp32_gemm_with_the_same_tuple(c4, tiny, monkeypatch):
    x = random_x(7, tiny.hidden_size).bfloat16()
    unfused = c4._run_parallel_input_projections(x)
    assert prepare_compressor_gemm_fusion(c4)
    sentinel = torch.full((7, 256), 17.0, dtype=torch.bfloat16)
    monkeypatch.setattr(c4, "_fused_wqa_wkv_gemm", lambda inp: sentinel)
    calls = []
    real_linear = F.linear

    def counting_linear(inp, weight, *a, **k):
        out = real_linear(inp, weight, *a, **k)
        calls.append((inp, tuple(weight.shape), out.dtype))
        return out

    monkeypatch.setattr(torch.nn.functional, "linear", counting_linear)
    qr_kv, kv_score, idx_kv_score, idx_w = c4._run_parallel_input_projections(x)
    assert qr_kv is sentinel
    score_gemms = [c for c in calls if c[1][0] == 1024]
    assert len(score_gemms) == 1 and score_gemms[0][2] == torch.float32
    assert torch.equal(score_gemms[0][0], x.float())
    assert len(calls) == 2  # the fused score GEMM and weights_proj; nothing else
    assert kv_score.shape == (7, 512) and idx_kv_score.shape == (7, 512)
    assert kv_score.stride() == (1024, 1)  # views of one [7, 1024] output
    main, idx = c4.fused_compressor_params()
    assert torch.equal(kv_score, x.float() @ main.float().t())
    assert torch.equal(idx_kv_score, x.float() @ idx.float().t())
    assert torch.equal(idx_w, c4.indexer.weights_proj(x))
    for fused_t, plain_t in zip((kv_score, idx_kv_score, idx_w), unfused[1:], strict=True):
        assert rel_err(fused_t, plain_t) <= 1e-4


def test_fused_layer_output_matches_unfused(c4, tiny, make_layer):
    x = random_x(200, tiny.hidden_size).bfloat16()
    plain = make_layer(tiny, 4)
    prepare_compressor_gemm_fusion(c4)
    y0 = plain(x, torch.arange(200), plain.new_cache(200))
    y1 = c4(x, torch.arange(200), c4.new_cache(200))
    assert rel_err(y1, y0) <= 1e-4


@pytest.mark.parametrize("ratio,reason", [(0, "compress_ratio 0"), (128, "compress_ratio 128")])
def test_fusion_skips_layers_without_the_pair(tiny, make_layer, ratio, reason):
    layer = make_layer(tiny, ratio)
    assert prepare_compressor_gemm_fusion(layer) is False
    report = process_weights_after_loading(layer, passes=["compressor_fusion"])
    assert report.skipped["compressor_fusion"][0][1].endswith(f"({reason})")


@pytest.mark.parametrize("case,match", [
    ("ndim", "weights must be 2-D"), ("k", r"K differs \(256 vs 128\)"),
    ("dtype", "dtypes differ"), ("device", "devices differ")])
def test_fusion_validation_errors_leave_everything_as_it_was(c4, case, match):
    main, idx = c4.fused_compressor_params()
    if case == "ndim":
        idx.data = idx.data.flatten()
    elif case == "k":
        idx.data = idx.data[:, :128].contiguous()
    elif case == "dtype":
        idx.data = idx.data.float()
    elif case == "device":
        c4.indexer.compressor.fused_wkv_wgate.weight = torch.nn.Parameter(
            torch.empty_like(idx.data, device="meta"), requires_grad=False)
    snap = {k: v.clone() for k, v in c4.state_dict().items() if v.device.type != "meta"}
    with pytest.raises(ValueError, match=match):
        process_weights_after_loading(c4, passes=["compressor_fusion"])
    assert c4._fused_compressor_weight is None and c4._fused_compressor_split_sizes is None
    now = c4.state_dict()
    for k, v in snap.items():
        assert torch.equal(now[k].view(torch.uint8) if v.element_size() == 1 else now[k],
                           v.view(torch.uint8) if v.element_size() == 1 else v), k


def test_fused_weight_without_indexer_is_an_error(c4, tiny):
    prepare_compressor_gemm_fusion(c4)
    c4.indexer = None
    with pytest.raises(RuntimeError, match="requires a C4 indexer"):
        c4._run_parallel_input_projections(random_x(2, tiny.hidden_size).bfloat16())


def assert_aliased(layer):
    main, idx = layer.fused_compressor_params()
    fused = layer._fused_compressor_weight
    assert ptr(main) == ptr(fused) == ptr(idx)
    assert torch.equal(fused, torch.cat((main, idx)))


def test_alias_survives_module_conversion(c4, tiny):
    prepare_compressor_gemm_fusion(c4)
    x = random_x(9, tiny.hidden_size).bfloat16()
    y0 = c4(x, torch.arange(9), c4.new_cache(9))
    c4._apply(lambda t: t.clone())  # what a device move does: new storage for every tensor
    assert_aliased(c4)
    assert torch.equal(c4(x, torch.arange(9), c4.new_cache(9)), y0)


def test_alias_survives_load_state_dict_assign(c4, tiny, make_layer):
    prepare_compressor_gemm_fusion(c4)
    other = make_layer(tiny, 4, seed=5)
    c4.load_state_dict(other.state_dict(), assign=True)
    assert_aliased(c4)
    main, idx = c4.fused_compressor_params()
    assert torch.equal(main, other.compressor.fused_wkv_wgate.weight)
    x = random_x(9, tiny.hidden_size).bfloat16()
    assert torch.equal(c4(x, torch.arange(9), c4.new_cache(9)),
                       other(x, torch.arange(9), other.new_cache(9)))


def test_load_weights_after_fusion_updates_the_fused_buffer(c4, tiny):
    from dsv4.testing.random_weights import random_layer_weights

    prepare_compressor_gemm_fusion(c4)
    new = random_layer_weights(tiny, c4.layer_id, seed=9)
    c4.load_weights(new.items())
    assert_aliased(c4)
    fused = c4._fused_compressor_weight
    assert torch.equal(fused[:256], new["compressor.wkv.weight"])
    assert torch.equal(fused[512:768], new["indexer.compressor.wkv.weight"])


def test_pipeline_order_count_and_log_lines(tiny, caplog):
    from dsv4 import AttentionStack
    from dsv4.testing.random_weights import random_layer_weights

    layers = {}
    for i in range(tiny.num_layers_with_mtp):
        m = build_attention(tiny, i, platform="preshuffle")
        m.load_weights(random_layer_weights(tiny, i).items())
        layers[i] = m
    with caplog.at_level(logging.INFO, logger="dsv4.passes.pipeline"):
        report = process_weights_after_loading(AttentionStack(tiny, layers))
    assert report.changed["compressor_fusion"] == [1]  # the one C4 layer
    assert report.changed["preshuffle"] == [0, 1, 2, 3]
    lines = [r.getMessage() for r in caplog.records if r.name == "dsv4.passes.pipeline"]
    assert len(lines) == 2
    assert lines[0].startswith("post-load pass compressor_fusion: changed 1")
    assert lines[1].startswith("post-load pass preshuffle: changed 4")
    again = process_weights_after_loading(AttentionStack(tiny, layers))
    assert not again.changed
    assert {r for _, r in again.skipped["compressor_fusion"]} >= {"already fused"}
