"""The cuda platform's fp8 linears and attention backends.

On CPU: the backend choice (reasons included), the kernels' view of the paged stores (the triton
backend's operands through the kernel's torch reference, which reads the same bytes), and the fp8
linears' plan and results (the kernel's reference path). On a GPU (``cuda`` marker): the
platform end to end per backend and cache format against the reference layer, the fp8 kernels
provably running, and a whole decode step captured as one CUDA graph."""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch

from dsv4 import DeepseekV4Attention, process_weights_after_loading
from dsv4.cache.step import CacheStep
from dsv4.kernels.fused_input_proj import triton_available
from dsv4.kernels.launch import _INTERPRET
from dsv4.platforms import build_attention
from dsv4.platforms.cuda_attention import (
    AttentionBackendError,
    choose_backend,
    flashmla_shaped,
    kernel_store,
    triton_forward_mqa,
)
from dsv4.platforms.cuda_linears import (
    FP8_GEMM_MAX_TOKENS,
    LINEARS,
    WO_A_MAX_TOKENS,
    fp8_gemm,
    fp8_wo_a_wo_b,
    plan_fp8_linears,
)
from dsv4.testing.probes import record_selection, replay_selection
from dsv4.testing.random_weights import random_layer_weights

from conftest import HAS_CUDA, assert_decode_graph_equals_eager, random_x, rel_err

BF16 = torch.bfloat16


def _choice(layer, requested, kv_cache_dtype="bf16", kernels=True, triton_max_tokens=0):
    pool = layer.new_cache_pool(1, 64, kv_cache_dtype=kv_cache_dtype)
    return choose_backend(requested, dtype=layer.dtype, heads=layer.n_heads,
                          head_dim=layer.head_dim, stores=pool.stores, device=layer.device,
                          kernels_available=kernels, triton_max_tokens=triton_max_tokens)


def test_backend_choice_and_reasons(tiny, make_layer):
    layer = make_layer(tiny, 4)
    assert _choice(layer, "torch").backend == "torch"
    c = _choice(layer, "triton")
    assert (c.backend, c.fmt) == ("triton", "bf16")
    c = _choice(layer, "triton", "fp8_ds_mla")
    assert (c.backend, c.fmt) == ("triton", "fp8_ds_mla")
    c = _choice(layer, "auto", "fp8_ds_mla")  # FlashMLA needs CUDA, 64/128 heads, d=512
    assert c.backend == "triton" and "FlashMLA" in c.reason
    c = _choice(layer, "auto")
    assert c.backend == "triton" and "fp8_ds_mla" in c.reason
    c = _choice(layer, "triton", kernels=False)
    assert c.backend == "torch" and ("Triton" in c.reason or "CUDA" in c.reason)
    with pytest.raises(AttentionBackendError, match="flashmla.*(CUDA|heads)"):
        _choice(layer, "flashmla")
    with pytest.raises(ValueError, match="attention_backend"):
        _choice(layer, "cudnn")


def test_auto_takes_our_kernel_for_the_plans_short_steps(tiny, make_layer):
    layer = make_layer(tiny, 4)
    with mock.patch("dsv4.kernels.flashmla_backend.flashmla_supports",
                    return_value=(True, "")):  # as on an SM90 GPU with the wheel
        c = _choice(layer, "auto", "fp8_ds_mla", triton_max_tokens=2)
        assert (c.backend, c.triton_max_tokens) == ("flashmla", 2)
        assert "<= 2 tokens" in c.reason
        assert [c.backend_for(t) for t in (1, 2, 3, 64)] == ["triton"] * 2 + ["flashmla"] * 2
        assert _choice(layer, "auto", "fp8_ds_mla").backend_for(1) == "flashmla"
        # an explicit request is not second-guessed, and no switch without the triton kernel
        assert _choice(layer, "flashmla", "fp8_ds_mla", triton_max_tokens=2).backend_for(1) \
            == "flashmla"
        c = _choice(layer, "auto", "fp8_ds_mla", kernels=False, triton_max_tokens=2)
        assert (c.backend_for(1), c.triton_max_tokens) == ("flashmla", 0)
        # a bf16 cache: triton for every step, whatever the plan says
        c = _choice(layer, "auto", "bf16", triton_max_tokens=2)
        assert [c.backend_for(t) for t in (1, 64)] == ["triton", "triton"]


def test_plan_reads_the_short_step_rule(tmp_path):
    from dsv4.platforms.cuda import CudaPlan

    path = tmp_path / "plan.json"
    path.write_text('{"default": {"fused_max_tokens": 16, "graph_max_tokens": 64}, '
                    '"4096": {"fused_max_tokens": 8, "graph_max_tokens": 32, '
                    '"triton_attention_max_tokens": 1}}')
    assert CudaPlan.load(4096, path) == CudaPlan(8, 32, 1)
    assert CudaPlan.load(7168, path) == CudaPlan(16, 64, 0)
    # a field left out takes its default: the fp8 GEMMs stream up to FP8_GEMM_MAX_TOKENS
    assert CudaPlan.load(4096, path).fp8_gemm_max_tokens == FP8_GEMM_MAX_TOKENS
    assert CudaPlan.load(4096, path).wo_a_max_tokens == WO_A_MAX_TOKENS
    path.write_text('{"default": {"fused_max_tokens": 16, "graph_max_tokens": 64, '
                    '"fp8_gemm_max_tokens": 256}}')
    assert CudaPlan.load(4096, path) == CudaPlan(16, 64, fp8_gemm_max_tokens=256)
    # the shipped table: every entry loads
    for hidden in (4096, 7168, 1):
        assert CudaPlan.load(hidden).fused_max_tokens > 0


def test_plan_takes_a_candidate_entry_and_names_a_bad_one():
    from dsv4.platforms.cuda import CudaPlan

    plan = CudaPlan(16, 64)
    assert plan.overridden({"fp8_gemm_max_tokens": 512}) == CudaPlan(16, 64,
                                                                    fp8_gemm_max_tokens=512)
    assert plan.overridden({}) == plan
    with pytest.raises(ValueError, match="no field 'fp8_max'.*fp8_gemm_max_tokens"):
        plan.overridden({"fp8_max": 1})
    with pytest.raises(ValueError, match="fused_max_tokens must be an integer >= 0, got -1"):
        plan.overridden({"fused_max_tokens": -1})


@pytest.mark.skipif(HAS_CUDA, reason="the cuda layer built on the CPU; the GPU runs the bench")
def test_the_plan_sets_where_fp8_gemms_stop_streaming(tiny, monkeypatch):
    """The plan's fp8_gemm_max_tokens and wo_a_max_tokens move the layer's fp8 GEMMs between
    the streaming route and the dequantised copy: a call of 6 tokens with limits of 4 makes the
    copies (wq_b, the grouped wo_a, wo_b and the input stage's wqa_wkv), with 8 none, with 8
    and wo_a's 4 only wo_a's; the same output within the two routes' rounding. The cuda layer
    on the CPU (its kernels under the interpreter where it runs, else their PyTorch
    fallbacks), a fresh layer for each limit."""
    from dsv4.platforms import cuda_linears
    from dsv4.testing.cpu_cuda_layer import build_cpu_cuda_layer, cpu_stand_ins

    for obj, name, value in cpu_stand_ins():
        monkeypatch.setattr(obj, name, value)
    cfg = tiny.replace(act_quant=True)
    t = 6
    x = random_x(t, tiny.hidden_size).to(BF16)
    counts, outs = [], []
    for limit, wo_a_limit in ((4, 4), (8, 8), (8, 4)):
        layer = build_cpu_cuda_layer(cfg, 4, kernels=_INTERPRET)
        layer.plan = layer.plan.overridden({"fp8_gemm_max_tokens": limit,  # graphs stay off
                                            "wo_a_max_tokens": wo_a_limit})
        layer.fp8_plan = plan_fp8_linears(layer, True)  # the routes, whatever runs them here
        assert {"wq_b", "wo_a", "wo_b"} <= layer.fp8_plan.eligible
        with mock.patch.object(cuda_linears, "fp8_dequantize",
                               wraps=cuda_linears.fp8_dequantize) as spy:
            outs.append(layer(x, torch.arange(t), layer.new_cache(t)))
        counts.append(spy.call_count)
        if (limit, wo_a_limit) == (8, 4):
            assert spy.call_args.args[0] is layer.wo_a.weight
    assert counts[0] >= 3 and counts[1] == 0 and counts[2] == 1, counts
    assert rel_err(outs[0], outs[1]) < 2e-2 and rel_err(outs[2], outs[1]) < 2e-2


@pytest.mark.parametrize("text, match", [
    ("{not json", "not valid JSON"),
    ('{"4096": {"fused_max_tokens": 8, "graph_max_tokens": 32}}', "no entry for hidden size 7168"),
    ('{"default": {"fused_max_tokens": 8}}', "lacks 'graph_max_tokens'"),
    ('{"7168": [16, 64]}', "entry '7168' must be an object"),
    ('{"default": {"fused_max_tokens": 8, "graph_max_tokens": -1}}', "graph_max_tokens must be"),
    ('{"default": {"fused_max_tokens": "8", "graph_max_tokens": 1}}', "fused_max_tokens must be"),
    ('{"default": {"fused_max_tokens": 8, "graph_max_tokens": 1, '
     '"triton_attention_max_tokens": 1.5}}', "triton_attention_max_tokens must be"),
    ('{"default": {"fused_max_tokens": 8, "graph_max_tokens": 1, '
     '"fp8_gemm_max_tokens": true}}', "fp8_gemm_max_tokens must be"),
    ('{"default": {"fused_max_tokens": 8, "graph_max_tokens": 1, '
     '"wo_a_max_tokens": -1}}', "wo_a_max_tokens must be"),
])
def test_plan_refuses_a_malformed_table_naming_the_file(tmp_path, text, match):
    from dsv4.platforms.cuda import CudaPlan

    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as err:
        CudaPlan.load(7168, path)
    assert str(path) in str(err.value)


def test_float32_layers_fall_back_to_torch_with_the_reason(tiny, make_layer):
    layer = make_layer(tiny, 128, dtype=torch.float32)
    for requested in ("auto", "triton"):
        c = _choice(layer, requested, "auto")
        assert c.backend == "torch" and "float32" in c.reason
    c = _choice(layer, "triton", "bf16")  # bf16 store, float32 queries
    assert c.backend == "torch" and "float32" in c.reason


def test_kernel_store_is_a_view_of_the_cache_bytes(tiny, make_layer):
    layer = make_layer(tiny, 4)
    pool = layer.new_cache_pool(2, 64, kv_cache_dtype="fp8_ds_mla")
    store = pool.stores["compressed"]
    view = kernel_store(store, "fp8_ds_mla")
    assert view.shape == (store.data.shape[0], store.block_bytes)
    assert view.data_ptr() == store.data.data_ptr() and view.stride() == (store.block_bytes, 1)
    bf = layer.new_cache_pool(2, 64, kv_cache_dtype="bf16").stores["kv"]
    assert kernel_store(bf, "bf16") is bf.data


class _BothBackends(DeepseekV4Attention):
    """Test double: runs the base forward_mqa and the triton backend's operands on every step
    (off CUDA the kernel entry point runs its torch reference over the same store bytes)."""

    fmt = "bf16"

    def forward_mqa(self, q, step, selection):
        ref = super().forward_mqa(q, step, selection)
        got = triton_forward_mqa(self, q, step, selection, self.fmt)
        self.errs.append(rel_err(got, ref))
        rows = selection.entry_rows
        self.shapes.append(None if rows is None else tuple(rows.shape))
        return ref


@pytest.mark.parametrize("ratio", [0, 4, 128])
@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
def test_triton_backend_operands_match_the_base_attention(tiny, ratio, fmt):
    cfg = tiny.replace(kv_cache_dtype=fmt)
    lid = cfg.layer_of_ratio(ratio)
    layer = _BothBackends(cfg, lid, dtype=BF16)
    layer.load_weights(random_layer_weights(cfg, lid, 3).items())
    layer.fmt, layer.errs, layer.shapes = fmt, [], []
    caches = layer.new_caches(3, 300)
    x = random_x(300, cfg.hidden_size).to(BF16)
    begin = 0
    for n, c in zip((140, 70, 20), caches, strict=True):  # prefills (ratio 128: entries exist)
        layer(x[begin:begin + n], torch.arange(n), c)
        begin += n
    for s in range(4):  # pooled decode steps
        layer(x[begin:begin + 3], torch.tensor([140 + s, 70 + s, 20 + s]), caches)
        begin += 3
    assert len(layer.errs) == 7 and max(layer.errs) < 1e-2, layer.errs
    if ratio:
        assert any(s is not None and s[1] > 0 for s in layer.shapes)  # entries were read


def test_fp8_linear_plan_and_results_match_the_base_path(tiny, make_layer):
    layer = make_layer(tiny, 4)
    plan = plan_fp8_linears(layer, True)
    assert plan.eligible == set(LINEARS) and not plan.skipped
    qr = random_x(5, tiny.q_lora_rank).to(BF16)
    assert rel_err(fp8_gemm(layer.wq_b, qr), layer.wq_b(qr)) < 1e-2
    x = random_x(40, tiny.hidden_size).to(BF16)
    assert rel_err(fp8_gemm(layer.fused_wqa_wkv, x), layer.fused_wqa_wkv(x)) < 1e-2
    assert rel_err(fp8_gemm(layer.indexer.wq_b, qr), layer.indexer.wq_b(qr)) < 1e-2
    o = random_x(5 * layer.n_heads, layer.head_dim).to(BF16).view(5, layer.n_heads, -1)
    base = layer.wo_b(layer._wo_a_grouped(o))
    assert rel_err(fp8_wo_a_wo_b(layer, o, wo_b=True), base) < 1e-2
    assert rel_err(fp8_wo_a_wo_b(layer, o, wo_b=False), base) < 1e-2
    off = plan_fp8_linears(layer, False, "no Triton here")
    assert not off.eligible and off.skipped["wq_b"] == "no Triton here"
    assert "indexer.wq_b" not in plan_fp8_linears(make_layer(tiny, 0), True).eligible


@pytest.mark.parametrize("tokens", [5, 40])
def test_act_quant_gemms_quantise_long_calls_once(tiny, make_layer, tokens):
    """Under act_quant, calls of PREQUANT_MIN_TOKENS or more quantise x in a launch of their
    own: the same output as the GEMM that quantises x itself, bit for bit (kernel or
    fallback); shorter calls quantise in the GEMM."""
    from dsv4.platforms import cuda_linears

    layer = make_layer(tiny, 4)
    x = random_x(tokens, tiny.hidden_size).to(BF16).to(layer.wq_b.weight.device)
    with mock.patch.object(cuda_linears, "quantize_activations",
                           wraps=cuda_linears.quantize_activations) as spy:
        got = fp8_gemm(layer.fused_wqa_wkv, x, act_quant=True)
    assert spy.call_count == (tokens >= cuda_linears.PREQUANT_MIN_TOKENS)
    with mock.patch.object(cuda_linears, "PREQUANT_MIN_TOKENS", 10**6):
        assert torch.equal(got, fp8_gemm(layer.fused_wqa_wkv, x, act_quant=True))
    assert rel_err(got, layer.fused_wqa_wkv(x)) < 5e-2  # quantised x against bf16 x


def test_act_quant_long_calls_take_the_simulated_activations(tiny, make_layer):
    """Above FP8_GEMM_MAX_TOKENS, where cuBLAS's block scaling does not run, an act_quant GEMM
    runs cuBLAS on fp8_block_sim's values of x, made by simulate_activations (one launch where
    the kernels run): the base module's product on the quantised x, bit for bit."""
    from dsv4.layers.quant_sim import fp8_block_sim
    from dsv4.platforms import cuda_linears

    layer = make_layer(tiny, 4)
    x = random_x(7, tiny.hidden_size).to(BF16).to(layer.wq_b.weight.device)
    with mock.patch.object(cuda_linears, "FP8_GEMM_MAX_TOKENS", 4), \
            mock.patch.object(cuda_linears, "block_scaled_gemm_applies", lambda device: False), \
            mock.patch.object(cuda_linears, "simulate_activations",
                              wraps=cuda_linears.simulate_activations) as spy:
        got = fp8_gemm(layer.fused_wqa_wkv, x, act_quant=True)
    assert spy.call_count == 1
    assert torch.equal(got, layer.fused_wqa_wkv(fp8_block_sim(x, 128)))


def test_block_scaling_applies_only_to_cuda_devices_that_have_it():
    from dsv4.platforms.cuda_linears import block_scaled_gemm_applies

    assert not block_scaled_gemm_applies(torch.device("cpu"))
    assert not block_scaled_gemm_applies("cpu")


def test_fp8_linear_plan_skips_float32_and_platform_layouts(tiny, make_layer):
    f32 = plan_fp8_linears(make_layer(tiny, 0, dtype=torch.float32), True)
    assert not f32.eligible and all("float32" in why for why in f32.skipped.values())
    pre = make_layer(tiny, 0, platform="preshuffle")
    process_weights_after_loading(pre)
    plan = plan_fp8_linears(pre, True)
    assert "wo_b" in plan.skipped and "layout" in plan.skipped["wo_b"]
    assert {"wq_b", "wo_a"} <= plan.eligible


# ---------------------------------------------------------------------------------- GPU
cuda = pytest.mark.cuda


def _cuda_pair(cfg, ratio, backend, seed=1):
    from dsv4.platforms.cuda import CudaAttention

    c = cfg.replace(attention_backend=backend)
    lid = c.layer_of_ratio(ratio)
    w = random_layer_weights(c, lid, seed)
    layer = CudaAttention(c, lid, device="cuda", dtype=BF16)
    layer.load_weights(w.items())
    process_weights_after_loading(layer)
    ref = build_attention(c, lid, device="cuda", dtype=BF16)
    ref.load_weights(w.items())
    return layer, ref


def _prefill_and_decode(layer, x, split):
    cache = layer.new_cache(x.shape[0])
    pos = torch.arange(x.shape[0])
    ys = [layer(x[:split], pos[:split], cache)]
    ys += [layer(x[i:i + 1], pos[i:i + 1], cache) for i in range(split, x.shape[0])]
    return torch.cat(ys), cache


def _backend_cases():
    from dsv4.kernels.flashmla_backend import flashmla_supports

    cases = [("torch", "bf16", "torch"), ("triton", "bf16", "triton"),
             ("triton", "fp8_ds_mla", "triton"), ("auto", "bf16", "triton")]
    if torch.cuda.is_available() and flashmla_supports(64, 512, "fp8_ds_mla", "cuda")[0]:
        cases += [("flashmla", "fp8_ds_mla", "flashmla"), ("auto", "fp8_ds_mla", "flashmla"),
                  ("flashmla", "bf16", "flashmla")]
    return cases


@cuda
@pytest.mark.skipif(not triton_available(), reason="needs Triton")
@pytest.mark.parametrize("ratio", [0, 4, 128])
@pytest.mark.parametrize("backend,fmt,expect", _backend_cases() if torch.cuda.is_available()
                         else [("torch", "bf16", "torch")])
def test_cuda_backends_against_the_reference(tiny, ratio, backend, fmt, expect):
    cfg = tiny.replace(kv_cache_dtype=fmt)
    if expect == "flashmla":
        cfg = flashmla_shaped(cfg)
    layer, ref = _cuda_pair(cfg, ratio, backend)
    assert layer.fp8_plan.eligible == ({*LINEARS} if ratio == 4 else
                                       {*LINEARS} - {"indexer.wq_b"}), layer.fp8_plan.describe()
    x = random_x(200, cfg.hidden_size).to("cuda", BF16)
    with mock.patch("dsv4.platforms.cuda.fp8_gemm", wraps=fp8_gemm) as spy, \
            record_selection(layer) as seen:
        y, cache = _prefill_and_decode(layer, x, 150)
    assert spy.call_count > 0  # decode steps took the fp8 kernels
    assert layer.attention_choice(cache.pool).backend == expect
    with replay_selection(ref, seen):
        y_ref, _ = _prefill_and_decode(ref, x, 150)
    assert rel_err(y, y_ref) < 1e-2


@cuda
@pytest.mark.skipif(not triton_available(), reason="needs Triton")
def test_auto_switches_backend_per_step_on_one_cache(tiny):
    """``auto`` with the plan's short-step rule: 1-token steps run our kernel, 2-token steps
    FlashMLA's, on the same fp8 cache; both against the reference."""
    from dsv4.kernels.flashmla_backend import flashmla_supports
    from dsv4.platforms import cuda as cuda_platform

    if not flashmla_supports(64, 512, "fp8_ds_mla", "cuda")[0]:
        pytest.skip("FlashMLA is not installed or does not run here")
    cfg = flashmla_shaped(tiny.replace(kv_cache_dtype="fp8_ds_mla"))
    layer, ref = _cuda_pair(cfg, 4, "auto")
    layer.plan = dataclasses.replace(layer.plan, triton_attention_max_tokens=1)
    x = random_x(40, cfg.hidden_size).to("cuda", BF16)
    pos = torch.arange(40)
    # a 30-token prefill, four 1-token steps, three 2-token steps
    spans = [(0, 30)] + [(i, i + 1) for i in range(30, 34)] + [(i, i + 2) for i in range(34, 40, 2)]

    def run(model):
        cache = model.new_cache(40)
        return torch.cat([model(x[a:b], pos[a:b], cache) for a, b in spans])

    calls = []
    real = {n: getattr(cuda_platform, n) for n in ("triton_forward_mqa", "flashmla_forward_mqa")}

    def spy(name):
        def wrapped(lay, q, *a, **kw):
            calls.append((name, q.shape[0]))
            return real[name](lay, q, *a, **kw)
        return wrapped

    with mock.patch.object(cuda_platform, "triton_forward_mqa", spy("triton_forward_mqa")), \
            mock.patch.object(cuda_platform, "flashmla_forward_mqa",
                              spy("flashmla_forward_mqa")), record_selection(layer) as seen:
        ys = run(layer)
    assert ("triton_forward_mqa", 1) in calls and ("flashmla_forward_mqa", 2) in calls
    assert not {c for c in calls if c[1] == 1} - {("triton_forward_mqa", 1)}
    assert not {c for c in calls if c[1] == 2} - {("flashmla_forward_mqa", 2)}
    with replay_selection(ref, seen):
        y_ref = run(ref)
    assert rel_err(ys, y_ref) < 1e-2


@cuda
@pytest.mark.skipif(not triton_available(), reason="needs Triton")
@pytest.mark.parametrize("ratio", [0, 4])
def test_act_quant_prefill_on_the_long_route_against_the_reference(tiny, ratio):
    """A prefill above the plan's streaming limit under act_quant: its fp8 linears take the
    long calls' route (cuBLAS's block-scaled GEMM where it runs, else the dequantised copy),
    the decode steps the streaming kernels; the layer against the reference layer with the
    same act_quant, selections replayed."""
    from dsv4.platforms import cuda_linears

    cfg = tiny.replace(act_quant=True)
    layer, ref = _cuda_pair(cfg, ratio, "torch")
    layer.plan = layer.plan.overridden({"fp8_gemm_max_tokens": 8, "wo_a_max_tokens": 8})
    x = random_x(60, cfg.hidden_size).to("cuda", BF16)
    with mock.patch.object(cuda_linears, "block_scaled_gemm",
                           wraps=cuda_linears.block_scaled_gemm) as spy, \
            record_selection(layer) as seen:
        y, _ = _prefill_and_decode(layer, x, 50)
    applies = cuda_linears.block_scaled_gemm_applies(x.device)
    assert (spy.call_count >= 3) == applies  # wq_a | wkv, wq_b, wo_b (+ indexer.wq_b)
    with replay_selection(ref, seen):
        y_ref, _ = _prefill_and_decode(ref, x, 50)
    assert rel_err(y, y_ref) < 1e-2


@cuda
def test_fp8_gemms_off_gives_the_base_path(tiny):
    layer, ref = _cuda_pair(tiny, 4, "torch")
    layer.use_fp8_gemms(False)
    x = random_x(40, tiny.hidden_size).to("cuda", BF16)
    with mock.patch("dsv4.platforms.cuda.fp8_gemm", wraps=fp8_gemm) as spy:
        y, _ = _prefill_and_decode(layer, x, 30)
    assert spy.call_count == 0
    y_ref, _ = _prefill_and_decode(ref, x, 30)
    assert rel_err(y, y_ref) < 1e-2


@cuda
@pytest.mark.skipif(not triton_available(), reason="needs Triton")
@pytest.mark.parametrize("ratio", [0, 4, 128])
@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
def test_whole_decode_step_graph_with_fp8_gemms_and_triton_attention(tiny, ratio, fmt):
    layer, _ = _cuda_pair(tiny.replace(kv_cache_dtype=fmt), ratio, "triton")
    caches = layer.new_caches(3, 300)
    for i, c in enumerate(caches):
        n = 130 + 9 * i
        layer(random_x(n, tiny.hidden_size).to("cuda", BF16), torch.arange(n), c)
    assert layer.attention_choice(caches[0].pool).backend == "triton"
    x = random_x(3, tiny.hidden_size).to("cuda", BF16)
    assert_decode_graph_equals_eager(layer, caches, x)


@cuda
@pytest.mark.skipif(not triton_available(), reason="needs Triton")
@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_the_query_heads_branch_gives_the_one_stream_step(tiny, ratio):
    """Stage 2's branch point: within ``multi_stream_token_threshold`` the ``wq_b`` GEMM and the
    heads run on aux stream 0 (``heads_ready`` set) and, where the C4 indexer decides, its query
    on aux stream 1 (``index_query_ready`` set), beside stages 3-4, each GEMM on its side
    stream's own split-K workspace; every output equals the one-stream layer's (threshold 0,
    same weights) bit for bit - a prefill, then decode steps (the first eager, the rest the
    plain calls' graph replays) whose attention reads every row the steps stored."""
    cfg = tiny.replace(kv_cache_dtype="fp8_ds_mla")
    layer, _ = _cuda_pair(cfg, ratio, "triton")
    caches = layer.new_caches(3, 400)
    for c, n in zip(caches, [5, 70, 300], strict=True):
        layer(random_x(n, cfg.hidden_size).to("cuda", BF16), torch.arange(n), c)
    step = CacheStep.plan(caches[0].pool, caches, [1, 1, 1])
    assert layer._indexer_decides(step) == (ratio == 4)  # 300 tokens: 75 entries > top-8
    qr_kv = random_x(3, cfg.q_lora_rank + cfg.head_dim).to("cuda", BF16)
    branch = layer._query_and_kv_rows(qr_kv, step)
    assert branch.heads_ready is not None
    assert (branch.index_query_ready is not None) == (branch.index_query is not None) == (
        ratio == 4)
    for event in (branch.heads_ready, branch.index_query_ready):
        if event is not None:
            torch.cuda.current_stream().wait_event(event)
    layer.cfg = layer.cfg.replace(multi_stream_token_threshold=0)
    one = layer._query_and_kv_rows(qr_kv, step)
    assert one.heads_ready is None and one.index_query_ready is None
    for a, b in zip(branch[:3], one[:3], strict=True):
        assert (a is None and b is None) or torch.equal(a, b)

    n, steps = 150, 6
    x = random_x(n + 3 * steps, cfg.hidden_size).to("cuda", BF16)

    def run(threshold):  # a fresh layer (and step graphs) of the same weights
        model, _ = _cuda_pair(cfg.replace(multi_stream_token_threshold=threshold), ratio,
                              "triton")
        caches = model.new_caches(3, n + steps + 1)
        ys = [model(x[i:n + i], torch.arange(n), c) for i, c in enumerate(caches)]
        ys += [model(x[n + 3 * i:n + 3 * i + 3], torch.full((3,), n + i), caches)
               for i in range(steps)]
        torch.cuda.synchronize()
        return torch.cat(ys)

    assert torch.equal(run(1024), run(0))


def _variants_for_test(cfg, device):
    return [("fp8 cache", cfg.replace(kv_cache_dtype="fp8_ds_mla"))]


def test_verify_runs_a_platforms_declared_variants(tiny):
    from dsv4.platforms.cuda_attention import verify_variants
    from dsv4.platforms.registry import Platform, register_platform, unregister_platform
    from dsv4.testing.verify import conformance

    on_cpu = verify_variants(tiny, torch.device("cpu"))  # no Triton / FlashMLA rows off CUDA
    assert [label for label, _ in on_cpu] == ["torch"]
    assert on_cpu[0][1].attention_backend == "torch"
    register_platform(Platform(name="ref-variants", description="test",
                               attention_path="dsv4.attention:DeepseekV4Attention",
                               verify_variants="test_cuda_backends:_variants_for_test"))
    try:
        rows = conformance(["ref-variants"], "cpu", tokens=16, cfg=tiny)
    finally:
        unregister_platform("ref-variants")
    labels = {r.platform for r in rows}
    # the declared variant, then verify's own act_quant one
    assert labels == {"ref-variants", "ref-variants[fp8 cache]", "ref-variants[act_quant]"}
    assert len(rows) == 36 and all(r.ok for r in rows), [r for r in rows if not r.ok]


@cuda
@pytest.mark.skipif(not triton_available(), reason="needs Triton")
@pytest.mark.parametrize("ratio", [0, 4])
def test_stream_plan_calls_take_the_fp8_input_gemm(tiny, ratio):
    """Calls above the fused input-projection launch's tokens run ``fused_wqa_wkv`` through
    the fp8 linears, with the reference's output: within the plan's streaming tokens (set to
    128 here: 40 and 100) the weight-streaming GEMM, above them (150) a one-pass dequantised
    copy + cuBLAS."""
    from dsv4.kernels import fp8_linear as fl

    layer, ref = _cuda_pair(tiny, ratio, "torch")
    assert layer.plan.fused_max_tokens < 40
    layer.plan = layer.plan.overridden({"fp8_gemm_max_tokens": 128})
    x = random_x(290, tiny.hidden_size).to("cuda", BF16)
    cache, ref_cache = layer.new_cache(290), ref.new_cache(290)
    begin = 0
    w = layer.fused_wqa_wkv.weight
    for n, streams in ((40, True), (100, True), (150, False)):
        pos = torch.arange(begin, begin + n)
        with mock.patch("dsv4.platforms.cuda.fp8_gemm", wraps=fp8_gemm) as spy, \
                mock.patch("dsv4.platforms.cuda_linears.fp8_linear",
                           wraps=fl.fp8_linear) as stream, \
                mock.patch("dsv4.platforms.cuda_linears.fp8_dequantize",
                           wraps=fl.fp8_dequantize) as dequant, \
                record_selection(layer) as seen:
            y = layer(x[begin:begin + n], pos, cache)
        assert any(c.args[0] is layer.fused_wqa_wkv for c in spy.call_args_list)
        assert any(c.args[1] is w for c in stream.call_args_list) == streams
        assert any(c.args[0] is w for c in dequant.call_args_list) == (not streams)
        with replay_selection(ref, seen):
            y_ref = ref(x[begin:begin + n], pos, ref_cache)
        assert rel_err(y, y_ref) < 1e-2, (n, rel_err(y, y_ref))
        begin += n


@cuda
@pytest.mark.skipif(not triton_available(), reason="needs Triton")
@pytest.mark.parametrize("ratio", [4, 128])
def test_a_decode_step_runs_the_shared_launches(tiny, ratio):
    """The stage overrides' shared launches on the GPU, counted by the profiler in one eager
    decode step of a compressed layer (triton backend): the query heads and kv rows share one
    RoPE launch where the heads stay on the step's stream (``multi_stream_token_threshold``
    0), two where they run on the side stream (the branch point); the output's inverse RoPE is
    in the attention launch that writes o; the window and entry flat rows are one launch (no
    visible-entries launch of its own), both compressors' raw rows one launch, both rings'
    kept rows at most one."""
    from torch.profiler import ProfilerActivity, profile

    layer, _ = _cuda_pair(tiny, ratio, "triton")
    layer.use_cuda_graphs(False)
    x = random_x(62, tiny.hidden_size).to("cuda", BF16)
    cache = layer.new_cache(64)
    layer(x[:60], torch.arange(60), cache)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as branched:
        layer(x[60:61], torch.tensor([60]), cache)
        torch.cuda.synchronize()
    layer.cfg = layer.cfg.replace(multi_stream_token_threshold=0)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        layer(x[61:], torch.tensor([61]), cache)
        torch.cuda.synchronize()
    counts = {e.key: e.count for e in prof.key_averages()
              if getattr(e, "device_time_total", 0.0) > 0}

    def launched(kernel: str, profiled=prof) -> int:
        return sum(e.count for e in profiled.key_averages()
                   if getattr(e, "device_time_total", 0.0) > 0 and kernel in e.key)

    assert launched("_rope_heads_kernel") == 1, counts
    assert launched("_rope_heads_kernel", branched) == 2
    assert launched("_flat_rows_kernel") == 1 and launched("_visible_entries_kernel") == 0, \
        counts
    assert launched("_raw_rows_kernel") == 1 and launched("_keep_rows_kernel") <= 1, counts


@cuda
@pytest.mark.parametrize("tokens", [513, 1030])
def test_long_act_quant_calls_run_the_block_scaled_gemm(tokens):
    """On sm_90 (CUDA 12.9+) a long act_quant call takes cuBLAS's block-scaled fp8 GEMM: §6.3's
    product of the quantised x and the fp8 weight, against float64 within the fp8 MMA's
    accumulation (T not a multiple of 4 included: the route pads it), and the dequantised
    route's answer within the same; a weight of 2 K blocks (padded to 4 for cuBLAS) too."""
    from dsv4.kernels.fp8_linear import fp8_linear_reference
    from dsv4.layers.quant_sim import fp8_block_sim
    from dsv4.platforms.cuda_linears import (
        block_scaled_gemm,
        block_scaled_gemm_applies,
        dequantised_gemm,
    )

    dev = torch.device("cuda")
    if not block_scaled_gemm_applies(dev):
        pytest.skip("cuBLAS block scaling needs sm_90 and CUDA 12.9+ with F.scaled_mm")
    gen = torch.Generator(device=dev).manual_seed(tokens)
    for n, k in ((1536, 1024), (384, 256)):
        w = (torch.randn(n, k, device=dev, generator=gen) * 0.5).to(torch.float8_e4m3fn)
        e = torch.randint(120, 130, (n // 128, k // 128), device=dev, generator=gen)
        s = e.to(torch.uint8).view(torch.float8_e8m0fnu)
        x = torch.randn(tokens, k, device=dev, generator=gen).to(BF16)
        ref = fp8_linear_reference(fp8_block_sim(x, 128), w, s, torch.float64, torch.float64)
        got = block_scaled_gemm(x, w, s)
        assert got.shape == (tokens, n) and got.dtype == BF16
        assert rel_err(got, ref) < 5e-3  # a scale misplaced gives O(1)
        assert rel_err(got, dequantised_gemm(x, w, s, act_quant=True)) < 5e-3

