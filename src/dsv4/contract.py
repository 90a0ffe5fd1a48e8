"""The override contract between ``DeepseekV4Attention`` and platform subclasses.

Two kinds of checks, both cheap enough for any machine:

* **Structure** (:func:`structural_violations`): every name in ``OVERRIDE_POINTS`` exists on the
  base; a platform subclass only redefines names that are override points or declared hooks; any
  other method it adds is listed in its ``HELPERS``. A subclass that still defines an override
  after the base lost it (upstream #51430 deleted ``_fused_wqa_wkv_gemm``, leaving ROCm's override
  dead and its ``super()`` fallback broken) is therefore reported by name.
* **Path** (:func:`path_violations`): a real forward, with spies on every override point, must
  pass through each point the layer type needs, and ``_fused_wqa_wkv_gemm`` must run inside
  ``_run_parallel_input_projections`` (a spy, not a text search).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from dsv4.attention import DeepseekV4Attention
from dsv4.probes import spy_methods

# Methods a platform may redefine besides the override points (construction and weight hooks).
PLATFORM_HOOKS = ("__init__", "_after_weights_changed", "shared_build_kwargs")


def structural_violations(cls: type[Any], base: type[Any] = DeepseekV4Attention) -> list[str]:
    problems = []
    points = getattr(base, "OVERRIDE_POINTS", ())
    for name in points:
        if not callable(getattr(base, name, None)):
            problems.append(f"{base.__name__}.OVERRIDE_POINTS lists {name!r}, which "
                            f"{base.__name__} does not define")
    if cls is base:
        return problems
    helpers = set(getattr(cls, "HELPERS", ()))
    for klass in cls.__mro__:
        if klass is base or not issubclass(klass, base):
            break
        for name, value in vars(klass).items():
            if not (inspect.isfunction(value) or isinstance(value, (staticmethod, classmethod))):
                continue
            on_base = hasattr(base, name)
            if on_base and name not in points and name not in PLATFORM_HOOKS:
                problems.append(f"{klass.__name__}.{name} redefines a base method that is not "
                                "an override point (declare it in OVERRIDE_POINTS or keep it)")
            elif not on_base and name not in helpers:
                problems.append(f"{klass.__name__}.{name} is not defined on {base.__name__}: if "
                                "it overrides a removed base method it is dead code and its "
                                "super() fallback fails; if it is a helper, list it in HELPERS")
    return problems


def expected_points(layer: DeepseekV4Attention, packed_path: bool | None = None,
                    tokens: int = 0) -> set[str]:
    """The override points a forward of this layer must pass through. A layer with packed input
    weights may take the one-launch path (``packed_path``) or, for calls its platform plans
    otherwise, the separate GEMMs; default: packed iff the layer is packed. A prefill of
    ``tokens`` tokens from position 0 completes compressed entries, hence passes through
    ``_compress_entries``, once it reaches the layer's ratio, and runs the C4 indexer once its
    last query sees more than ``index_topk`` entries."""
    packed = layer._input_pack is not None if packed_path is None else packed_path
    common = {"_latent_norms", "_query_heads", "_kv_rows", "_wq_b_gemm", "_store_rows",
              "_window_rows", "forward_mqa", "_o_proj"}
    if layer.compress_ratio:
        common |= {"_raw_rows", "_entry_rows", "_keep_ring_rows"}
    if layer.indexer is not None and layer.indexer.has_choice(tokens // 4):
        # (the indexer runs where a query sees more than index_topk entries: _indexer_decides)
        common |= {"_indexer_wq_b_gemm", "_indexer_query", "_indexer_select"}
    elif layer.compress_ratio:  # ratio 128, or an indexer that would take every entry
        common.add("_visible_entries")
    if layer.compress_ratio and tokens >= layer.compress_ratio:
        common.add("_compress_entries")
    if packed:  # one launch replaces the four GEMMs
        return {"_run_parallel_input_projections", "_fused_input_projections_gemm", *common}
    pts = {"_run_parallel_input_projections", "_fused_wqa_wkv_gemm", *common}
    fused = isinstance(layer._fused_compressor_weight, torch.Tensor)
    if layer.compressor is not None:
        pts.add("_fused_compressor_score_gemm" if fused else "_compressor_kv_score_gemm")
    if layer.indexer is not None:
        pts.add("_indexer_weights_gemm")
        if not fused:
            pts.add("_indexer_kv_score_gemm")
    return pts


def path_violations(layer: DeepseekV4Attention, x: torch.Tensor) -> list[str]:
    """Run one prefill of ``x`` with spies on every override point and check the path; then a
    mixed batch of two sequences must reach ``forward_mqa`` once."""
    order: list[tuple[str, str]] = []
    points = list(type(layer).OVERRIDE_POINTS)
    originals = {n: getattr(layer, n) for n in points}

    def tracer(name: str) -> Any:
        def call(*args: Any, **kw: Any) -> Any:
            order.append(("enter", name))
            try:
                return originals[name](*args, **kw)
            finally:
                order.append(("exit", name))
        return call

    for n in points:
        setattr(layer, n, tracer(n))
    try:
        layer(x, torch.arange(x.shape[0], device=x.device), layer.new_cache(x.shape[0]))
    finally:
        for n in points:
            layer.__dict__.pop(n, None)
    called = {n for kind, n in order if kind == "enter"}
    packed_path = layer._input_pack is not None and "_fused_input_projections_gemm" in called
    expected = expected_points(layer, packed_path, tokens=x.shape[0])
    problems = [f"forward never called {n}" for n in sorted(expected - called)]
    active: list[str] = []
    for kind, n in order:
        if kind == "enter":
            if n == "_fused_wqa_wkv_gemm" and "_run_parallel_input_projections" not in active:
                problems.append("_fused_wqa_wkv_gemm ran outside _run_parallel_input_projections")
            active.append(n)
        else:
            active.pop()
    return problems + pooled_decode_violations(layer, x)


def pooled_decode_violations(layer: DeepseekV4Attention, x: torch.Tensor) -> list[str]:
    """A call over several sequences of one pool (here a decode token and a prefill chunk mixed)
    must reach ``forward_mqa`` once for all of them: one batched path, no loop per sequence."""
    n = max(2, x.shape[0] // 2)
    caches = layer.new_caches(2, n + 2)
    layer(x[:n], torch.arange(n, device=x.device), caches[0])
    with spy_methods(layer, ["forward_mqa"]) as calls:
        layer(x[:3], torch.tensor([n, 0, 1]), caches, seq_lens=[1, 2])
    if len(calls["forward_mqa"]) != 1:
        return [f"a mixed batch of two sequences called forward_mqa "
                f"{len(calls['forward_mqa'])} times (expected once)"]
    return []


__all__ = ["expected_points", "path_violations", "pooled_decode_violations", "spy_methods",
           "structural_violations"]
