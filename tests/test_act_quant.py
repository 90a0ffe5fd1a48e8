"""cfg.act_quant: the official activation quantisation of the fp8 linears (docs/spec.md
§6.3) on every platform - the inputs of wq_a | wkv, wq_b, indexer.wq_b and wo_b quantised per
token to e4m3 in blocks of 128 with power-of-two scales, wo_a's not."""

from __future__ import annotations

import pytest
import torch

from dsv4 import DSV4Config, process_weights_after_loading
from dsv4.config import ConfigError
from dsv4.layers.quant_sim import fp8_block_sim
from dsv4.passes.input_fusion import InputFusionPass

from conftest import HAS_CUDA, random_x, rel_err

QUANTISED = ("fused_wqa_wkv", "wq_b", "indexer.wq_b", "wo_b")


def run(layer, x, decode_steps=3):
    """A 40-token prefill then ``decode_steps`` single-token steps; all outputs concatenated."""
    cache = layer.new_cache(64)
    t = x.shape[0] - decode_steps
    outs = [layer(x[:t], torch.arange(t), cache)]
    for i in range(t, x.shape[0]):
        outs.append(layer(x[i:i + 1], torch.tensor([i]), cache))
    return torch.cat(outs)


def hooked(layer):
    """``layer`` (act_quant off) with fp8_block_sim(., 128) applied to the inputs of the four
    quantised linears by forward pre-hooks: the rule written out independently of the layer."""
    for name in QUANTISED:
        if name.startswith("indexer.") and layer.indexer is None:
            continue
        layer.get_submodule(name).register_forward_pre_hook(
            lambda _m, args: (fp8_block_sim(args[0], 128),))
    return layer


@pytest.mark.parametrize("ratio", [0, 4, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_reference_layer_quantises_exactly_the_four_inputs(tiny, make_layer, ratio, dtype):
    x = random_x(43, tiny.hidden_size, seed=ratio).to(dtype)
    on = make_layer(tiny.replace(act_quant=True), ratio, dtype)
    want = run(hooked(make_layer(tiny, ratio, dtype)), x)
    got = run(on, x)
    assert torch.equal(got, want)
    # and it matters: without it the outputs differ by about e4m3's rounding
    off = run(make_layer(tiny, ratio, dtype), x)
    assert 1e-3 < rel_err(got, off) < 0.1


@pytest.mark.parametrize("ratio", [0, 4])
def test_post_load_passes_keep_the_quantisation(tiny, make_layer, ratio):
    """With the one-launch input pack (the cuda platform's post-load pass; its fused compressor
    weight too) the layer still quantises wq_a | wkv's input, and only that one: the pack's
    fp8 segment multiplies the quantised x (in the kernel on a GPU; here its reference), the
    compressor segments x itself. Unquantised, the pack's result is 6e-2 away."""
    cfg = tiny.replace(act_quant=True)
    x = random_x(43, tiny.hidden_size, seed=7).to(torch.bfloat16)
    plain = run(make_layer(cfg, ratio), x)
    processed = make_layer(cfg, ratio)
    InputFusionPass().plan(processed)()  # the cuda platform's pass, run on the reference
    assert processed._input_pack is not None
    got = run(processed, x)
    off = run(make_layer(tiny, ratio), x)
    assert rel_err(got, plain) < 0.1 * rel_err(off, plain)


def test_preshuffle_platform_uses_the_official_scales(tiny, make_layer):
    """The preshuffle platform quantises with AITER's fp32 scales; under act_quant with the
    official power-of-two ones: then it agrees with the reference layer's act_quant to its
    emulated GEMM's fp32 arithmetic (1.6e-8 here), far closer than AITER's numerics."""
    cfg = tiny.replace(act_quant=True)
    x = random_x(43, tiny.hidden_size, seed=3).to(torch.float64)
    ref = run(make_layer(cfg, 4, torch.float64), x)
    pre = make_layer(cfg, 4, torch.float64, platform="preshuffle")
    process_weights_after_loading(pre)
    aiter = make_layer(tiny, 4, torch.float64, platform="preshuffle")
    process_weights_after_loading(aiter)
    assert isinstance(pre._wo_b_scale, torch.Tensor)  # the preshuffled path really runs
    got = run(pre, x)
    assert rel_err(got, ref) < 1e-6
    assert rel_err(run(aiter, x), ref) > 1e-3


def test_act_quant_option():
    cfg = DSV4Config.preset("tiny").replace(act_quant=True)
    assert "act_quant" not in cfg.to_dict()  # a runtime option, never in config.json
    assert DSV4Config.from_dict({**cfg.to_dict(), "act_quant": True}).act_quant
    with pytest.raises(ConfigError, match="act_quant"):
        cfg.replace(act_quant="yes")
    with pytest.raises(ConfigError, match="hidden_size=192: must be a multiple of 128"):
        DSV4Config.preset("tiny").replace(fp8_weights=False, hidden_size=192, act_quant=True)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_cuda_layer_matches_the_reference_under_act_quant(tiny, make_layer, ratio):
    """The cuda platform (fp8 kernels quantising in the kernel, graphs, step kernels) is as close
    to the float64 evaluation with the option as the reference layer in bf16 is, and closer to
    it than to the evaluation without. (The quantiser turns bf16's rounding of its inputs into
    whole e4m3 steps now and then, so both bf16 paths sit 3-5e-2 from float64 on the tiny
    model, against 1.5e-2 without the option: measured on the H200, 2026-12-03.)"""
    cfg = tiny.replace(act_quant=True)
    x = random_x(43, tiny.hidden_size, seed=11)
    want = run(make_layer(cfg, ratio, torch.float64), x.double())
    off = run(make_layer(tiny, ratio, torch.float64), x.double())
    bf16 = run(make_layer(cfg, ratio), x.to(torch.bfloat16))
    cuda = make_layer(cfg, ratio, torch.bfloat16, platform="cuda", device="cuda")
    process_weights_after_loading(cuda)
    got = run(cuda, x.to("cuda", torch.bfloat16)).cpu()
    err = rel_err(got, want)
    assert err < 1.25 * rel_err(bf16, want) and err < rel_err(got, off)


def test_verify_fails_a_platform_that_skips_the_quantisation(monkeypatch):
    """dsv4 verify's [act_quant] rows: a preshuffle layer whose wq_b / indexer wq_b inputs go
    unquantised (its own two GEMMs still quantise) fails every one of them."""
    from dsv4.platforms.preshuffle import PreshuffleAttention
    from dsv4.testing.verify import ACT_QUANT_TOLERANCE, conformance

    monkeypatch.setattr(PreshuffleAttention, "_fp8_linear_input", lambda self, x: x)
    rows = [r for r in conformance(["preshuffle"], tokens=64) if "act_quant" in r.platform]
    assert len(rows) == 9 and all(r.tolerance == ACT_QUANT_TOLERANCE for r in rows)
    assert not any(r.ok for r in rows)
