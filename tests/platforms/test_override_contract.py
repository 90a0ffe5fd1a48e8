"""The override contract: structure and a spied forward path, for every platform; and the
regressions it exists to catch, built on purpose."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from torch import nn
from typing_extensions import override

from dsv4 import DeepseekV4Attention, platforms, process_weights_after_loading
from dsv4.platforms.preshuffle import PreshuffleAttention
from dsv4.stages import InputProjections, QueryAndRows
from dsv4.testing.contract import expected_points, path_violations, structural_violations
from dsv4.testing.verify import build_pair, conformance

from conftest import RATIOS, random_x

CPU_PLATFORMS = [p for p in platforms.available("cpu")]


def test_override_points_exist_and_are_documented():
    for name in DeepseekV4Attention.OVERRIDE_POINTS:
        method = getattr(DeepseekV4Attention, name)
        assert callable(method)
        doc = " ".join((method.__doc__ or "").split())
        assert "May change:" in doc and "Must keep:" in doc, f"{name} lacks its contract"


@pytest.mark.parametrize("platform", platforms.platform_names())
def test_platform_classes_override_only_base_names(platform):
    cls = platforms.registry.platform_spec(platform).attention_cls
    assert structural_violations(cls) == []


@pytest.mark.parametrize("platform", CPU_PLATFORMS)
@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("fusion", [False, True])
def test_forward_passes_through_every_override_point(tiny, platform, ratio, fusion):
    _, layer, _ = build_pair(tiny, ratio, platform, fusion, "cpu", torch.bfloat16, 0)
    pts = expected_points(layer, tokens=40)
    assert {"_run_parallel_input_projections", "_fused_wqa_wkv_gemm", "forward_mqa",
            "_o_proj", "_latent_norms", "_query_heads", "_kv_rows"} <= pts
    assert ({"_indexer_query", "_indexer_select"} <= pts) == (ratio == 4)
    assert ("_compress_entries" in pts) == (ratio == 4)  # 40 tokens: C4 entries, no C128 one
    assert path_violations(layer, random_x(40, tiny.hidden_size).bfloat16()) == []


class InlinedInputGemm(DeepseekV4Attention):
    """The upstream #51430 refactor: the module call inlined into the input projections."""

    def _run_parallel_input_projections(self, x):
        qr_kv = self.fused_wqa_wkv(x)
        rest = super()._run_parallel_input_projections(x)[1:]
        return InputProjections(qr_kv, *rest)


def test_inlining_the_input_gemm_is_caught_by_the_path_spy(tiny, make_layer):
    layer = InlinedInputGemm(tiny, 1)
    layer.load_state_dict(make_layer(tiny, 4).state_dict())
    problems = path_violations(layer, random_x(20, tiny.hidden_size).bfloat16())
    # its super() call still reaches _fused_wqa_wkv_gemm, so also prove the spy sees a real
    # bypass: a subclass that never calls it
    assert problems == []

    class NeverCalls(DeepseekV4Attention):
        def _run_parallel_input_projections(self, x):
            return InputProjections(self.fused_wqa_wkv(x), self._compressor_kv_score_gemm(x),
                                    self._indexer_kv_score_gemm(x), self._indexer_weights_gemm(x))

    bad = NeverCalls(tiny, 1)
    bad.load_state_dict(layer.state_dict())
    problems = path_violations(bad, random_x(20, tiny.hidden_size).bfloat16())
    assert problems == ["forward never called _fused_wqa_wkv_gemm"]


def test_removed_base_method_with_a_subclass_override_is_reported():
    class Base(nn.Module):
        OVERRIDE_POINTS: ClassVar[tuple[str, ...]] = ("_o_proj",)

        def _o_proj(self, o):
            return o

    class Platform(Base):
        @override
        def _fused_wqa_wkv_gemm(self, x):  # the base lost it (upstream #51430)
            return super()._fused_wqa_wkv_gemm(x)

        def _helper(self, x):  # a helper of its own: not an override, nothing to report
            return x

    problems = structural_violations(Platform, base=Base)
    assert len(problems) == 1 and "Platform._fused_wqa_wkv_gemm is marked @override but Base " \
        "does not define it" in problems[0]
    with pytest.raises(AttributeError):
        Platform()._fused_wqa_wkv_gemm(None)  # the latent second bug: its fallback is broken

    class StaleList(nn.Module):
        OVERRIDE_POINTS: ClassVar[tuple[str, ...]] = ("_fused_wqa_wkv_gemm",)

    assert structural_violations(StaleList, base=StaleList) == [
        "StaleList.OVERRIDE_POINTS lists '_fused_wqa_wkv_gemm', which StaleList does not define"]


def test_redefining_a_non_override_method_is_reported():
    class Sneaky(DeepseekV4Attention):
        @override
        def _wo_a_grouped(self, o):
            return o

    assert any("Sneaky._wo_a_grouped redefines a base method" in p
               for p in structural_violations(Sneaky))


def test_an_override_without_the_marker_is_reported():
    class Unmarked(DeepseekV4Attention):
        def _o_proj(self, o, positions):
            return super()._o_proj(o, positions)

    assert structural_violations(Unmarked) == [
        "Unmarked._o_proj overrides DeepseekV4Attention._o_proj without @override "
        "(typing_extensions.override): mark it, so that a later removal from the base is "
        "reported"]


def test_a_fine_point_under_a_stage_replaced_above_it_is_reported(tiny, make_layer):
    """A platform subclass that overrides a fine point whose stage its parent platform
    replaced would never be called: structure reports it before any forward, the path spy
    when it runs."""

    class Fused(DeepseekV4Attention):
        @override
        def _query_and_kv_rows(self, qr_kv, step):  # (an SWA layer: no indexer query)
            qr, kv = self._latent_norms(qr_kv)
            return QueryAndRows(self._query_heads(qr, step.pos),
                                DeepseekV4Attention._kv_rows(self, kv, step.pos))

    class Sub(Fused):
        @override
        def _kv_rows(self, kv, pos):
            return super()._kv_rows(kv, pos)

    assert structural_violations(Fused) == []
    assert structural_violations(Sub) == [
        "Sub._kv_rows is never called: Fused._query_and_kv_rows replaces the stage that calls "
        "it; override _query_and_kv_rows in Sub too (or a fine point Fused calls)"]
    layer = Sub(tiny, 0)
    layer.load_state_dict(make_layer(tiny, 0).state_dict())
    assert path_violations(layer, random_x(8, tiny.hidden_size).bfloat16()) == [
        "forward never called _kv_rows"]


def test_a_base_stage_that_stops_calling_the_input_gemm_point_is_caught(tiny, make_layer,
                                                                         monkeypatch):
    """Upstream #51430 itself: the base's input stage inlines the module call, so the ROCm-like
    platform's ``_fused_wqa_wkv_gemm`` is never called (with its preshuffled weights its layer
    computes garbage). The spy reports it on that platform and on the reference one."""

    def inlined(self, x):
        c, i = self.compressor, self.indexer
        return InputProjections(
            self.fused_wqa_wkv(x),
            None if c is None else self._compressor_kv_score_gemm(x),
            None if i is None else self._indexer_kv_score_gemm(x),
            None if i is None else self._indexer_weights_gemm(x))

    x = random_x(20, tiny.hidden_size).bfloat16()
    layers = [make_layer(tiny, 4), make_layer(tiny, 4, platform="preshuffle")]
    assert [path_violations(layer, x) for layer in layers] == [[], []]
    monkeypatch.setattr(DeepseekV4Attention, "_run_parallel_input_projections", inlined)
    assert [path_violations(layer, x) for layer in layers] == [
        ["forward never called _fused_wqa_wkv_gemm"]] * 2


class PlainGemmPreshuffle(PreshuffleAttention):
    """The upstream bug, built on purpose: preshuffled weights multiplied by a plain GEMM that
    also sidesteps our layout tag (reads the raw storage)."""

    def _fused_wqa_wkv_gemm(self, x):
        from dsv4.layers.fp8 import dequantize_fp8_block

        w = dequantize_fp8_block(self.fused_wqa_wkv.weight.detach(), self.fused_wqa_wkv.scale,
                                 x.dtype)
        return torch.nn.functional.linear(x, w)


def test_conformance_fails_loudly_on_the_upstream_bug(tiny):
    platforms.register_platform(platforms.Platform(
        "buggy", "plain GEMM over preshuffled weights", f"{__name__}:PlainGemmPreshuffle",
        pass_names=("preshuffle",), conformance_tolerance=8e-2))
    try:
        rows = conformance(["buggy"], tokens=64)
    finally:
        platforms.unregister_platform("buggy")
    assert rows and not any(r.ok for r in rows)
    assert min(r.rel_err for r in rows) > 0.5  # garbage, not a rounding difference


def test_the_layout_tag_stops_the_bug_even_without_conformance(tiny, make_layer):
    class ModuleCall(PreshuffleAttention):
        def _fused_wqa_wkv_gemm(self, x):
            return self.fused_wqa_wkv(x)

    layer = ModuleCall(tiny, 0)
    layer.load_state_dict(make_layer(tiny, 0).state_dict())
    process_weights_after_loading(layer, passes=["preshuffle"])
    with pytest.raises(RuntimeError, match="platform-private layout"):
        layer(random_x(4, tiny.hidden_size).bfloat16(), torch.arange(4), layer.new_cache(4))


def test_a_mixed_batch_reaches_forward_mqa_once(tiny, make_layer):
    layer = make_layer(tiny, 4)
    x = random_x(20, tiny.hidden_size).bfloat16()
    assert path_violations(layer, x) == []


def test_the_step_waits_for_each_branch_before_its_reader(tiny, make_layer, monkeypatch):
    """The step's branch point: where stage 2 returns events, the step makes its stream wait
    for ``index_query_ready`` after stage 3 and before stage 4 (the indexer's query's reader),
    for ``heads_ready`` after stage 4 and before stage 5 (the heads' reader). On the CPU, with a
    stand-in stream that records the waits among the stages' calls."""
    order: list[str] = []
    events = {"heads": object(), "index query": object()}

    class FakeStream:
        def wait_event(self, e):
            order.append("wait " + next(k for k, v in events.items() if v is e))

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())

    class Branched(DeepseekV4Attention):
        @override
        def _query_and_kv_rows(self, qr_kv, step):
            qk = super()._query_and_kv_rows(qr_kv, step)
            return qk._replace(heads_ready=events["heads"],
                               index_query_ready=events["index query"])

    layer = Branched(tiny, tiny.layer_of_ratio(4))
    layer.load_state_dict(make_layer(tiny, 4).state_dict())
    reference = make_layer(tiny, 4)
    x = random_x(12, tiny.hidden_size).bfloat16()
    stages = ["_write_cache", "_select", "_attend_and_project", "_keep_rings"]
    for name in stages:
        real = getattr(layer, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            order.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(layer, name, spy)
    y = layer(x, torch.arange(12), layer.new_cache(12))
    assert order == ["_write_cache", "wait index query", "_select", "wait heads",
                     "_attend_and_project", "_keep_rings"]
    assert torch.equal(y, reference(x, torch.arange(12), reference.new_cache(12)))


def test_a_stage_2_that_leaves_out_the_index_query_fails_loudly(tiny, make_layer):
    """Where the C4 indexer decides (a prefill past 4 * index_topk tokens), stage 4 reads stage
    2's index query: a platform whose stage 2 leaves it out gets an error naming the stage, and
    the cache keeps what it held."""

    class Forgetful(DeepseekV4Attention):
        @override
        def _query_and_kv_rows(self, qr_kv, step):
            return super()._query_and_kv_rows(qr_kv, step)._replace(index_query=None)

    layer = Forgetful(tiny, tiny.layer_of_ratio(4))
    layer.load_state_dict(make_layer(tiny, 4).state_dict())
    n = 4 * tiny.index_topk + 8
    cache = layer.new_cache(n)
    with pytest.raises(RuntimeError, match="stage 2 gave no index query"):
        layer(random_x(n, tiny.hidden_size).bfloat16(), torch.arange(n), cache)
    assert cache.length == 0
