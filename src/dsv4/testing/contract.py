"""The override contract between ``DeepseekV4Attention`` and platform subclasses.

Two kinds of checks, both cheap enough for any machine:

* **Structure** (:func:`structural_violations`): every name in ``OVERRIDE_POINTS`` exists on the
  base; a platform subclass redefines only override points (stages and fine points,
  :mod:`dsv4.stages`) and construction hooks, each marked ``@override``
  (``typing_extensions.override``, PEP 698); a method marked ``@override`` that the base does not
  define is reported by name - upstream #51430 deleted ``_fused_wqa_wkv_gemm`` from the base,
  leaving ROCm's override dead and its ``super()`` fallback broken (docs/upstream.md A). And a
  fine point a class overrides must be called by that class's stage: where a stage is replaced
  above it (by a parent platform), the override would never run.
* **Path** (:func:`path_violations`): a real forward, with spies on every override point, must
  pass through each stage and each fine point that the layer type needs and that is not
  replaced by a stage override of the platform (a fine point the platform overrides itself
  must be reached), and ``_fused_wqa_wkv_gemm`` - whoever overrides the input stage, unless
  the packed one-launch path runs - must run inside ``_run_parallel_input_projections`` (a
  spy, not a text search).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from dsv4.attention import DeepseekV4Attention
from dsv4.stages import STAGE_OF, STAGES
from dsv4.testing.probes import eager_steps, spy_methods

PLATFORM_HOOKS = ("__init__", "_after_weights_changed", "shared_build_kwargs")
"""Methods a platform may redefine besides the override points (construction and weight
hooks)."""


ALWAYS_CALLED = ("_fused_wqa_wkv_gemm",)
"""Fine points every unpacked input stage must call, whoever overrides the stage: the one place
where ``fused_wqa_wkv`` is multiplied, so that a platform's private weight layout never meets a
plain GEMM (docs/upstream.md A)."""


def _marked_override(value: Any) -> bool:
    return bool(getattr(value, "__override__", False)
                or getattr(getattr(value, "__func__", None), "__override__", False))


def _methods(klass: type[Any]) -> dict[str, Any]:
    return {name: value for name, value in vars(klass).items()
            if inspect.isfunction(value) or isinstance(value, (staticmethod, classmethod))}


def structural_violations(cls: type[Any], base: type[Any] = DeepseekV4Attention) -> list[str]:
    """What is wrong with platform class ``cls`` (a subclass of ``base``) as a structure; []
    when nothing is."""
    problems = []
    points = getattr(base, "OVERRIDE_POINTS", ())
    for name in points:
        if not callable(getattr(base, name, None)):
            problems.append(f"{base.__name__}.OVERRIDE_POINTS lists {name!r}, which "
                            f"{base.__name__} does not define")
    if cls is base:
        return problems
    for klass in cls.__mro__:
        if klass is base or not issubclass(klass, base):
            break
        for name, value in _methods(klass).items():
            on_base = hasattr(base, name)
            if on_base and name not in points and name not in PLATFORM_HOOKS:
                problems.append(f"{klass.__name__}.{name} redefines a base method that is not "
                                "an override point (declare it in OVERRIDE_POINTS or keep it)")
            elif on_base and name != "__init__" and not _marked_override(value):
                problems.append(f"{klass.__name__}.{name} overrides {base.__name__}.{name} "
                                "without @override (typing_extensions.override): mark it, so "
                                "that a later removal from the base is reported")
            elif not on_base and _marked_override(value):
                problems.append(f"{klass.__name__}.{name} is marked @override but "
                                f"{base.__name__} does not define it: it overrides a removed "
                                "base method, so it is dead code and its super() fallback "
                                "fails")
            if name in STAGE_OF and name in points:
                stage = STAGE_OF[name]
                owner = next(k for k in cls.__mro__ if stage in vars(k))
                if owner is not base and not issubclass(owner, klass):
                    problems.append(
                        f"{klass.__name__}.{name} is never called: {owner.__name__}.{stage} "
                        f"replaces the stage that calls it; override {stage} in "
                        f"{klass.__name__} too (or a fine point {owner.__name__} calls)")
    return problems


def _stage_overridden(layer: DeepseekV4Attention, stage: str) -> bool:
    return (getattr(type(layer), stage) is not getattr(DeepseekV4Attention, stage)
            or stage in layer.__dict__)


def _point_overridden(layer: DeepseekV4Attention, point: str) -> bool:
    return getattr(type(layer), point) is not getattr(DeepseekV4Attention, point)


def base_path_points(layer: DeepseekV4Attention, packed_path: bool | None = None,
                     tokens: int = 0) -> set[str]:
    """The override points the base implementation of every stage calls in a prefill of
    ``tokens`` tokens from position 0 of this layer. A layer with packed input weights may take
    the one-launch path (``packed_path``) or, for calls its platform plans otherwise, the
    separate GEMMs; default: packed iff the layer is packed. The prefill completes compressed
    entries, hence passes through ``_compress_entries``, once it reaches the layer's ratio, and
    runs the C4 indexer once its last query sees more than ``index_topk`` entries."""
    packed = layer._input_pack is not None if packed_path is None else packed_path
    pts = set(STAGES)
    pts |= {"_latent_norms", "_query_heads", "_kv_rows", "_wq_b_gemm", "_store_rows",
            "_window_rows", "forward_mqa", "_o_proj"}
    if layer.compress_ratio:
        pts |= {"_raw_rows", "_entry_rows", "_keep_ring_rows"}
    if layer.indexer is not None and layer.indexer.has_choice(tokens // 4):
        # (the indexer runs where a query sees more than index_topk entries: _indexer_decides)
        pts |= {"_indexer_wq_b_gemm", "_indexer_query", "_indexer_select"}
    elif layer.compress_ratio:  # ratio 128, or an indexer that would take every entry
        pts.add("_visible_entries")
    if layer.compress_ratio and tokens >= layer.compress_ratio:
        pts.add("_compress_entries")
    if packed:  # one launch replaces the four GEMMs
        return pts | {"_fused_input_projections_gemm"}
    pts.add("_fused_wqa_wkv_gemm")
    fused = isinstance(layer._fused_compressor_weight, torch.Tensor)
    if layer.compressor is not None:
        pts.add("_fused_compressor_score_gemm" if fused else "_compressor_kv_score_gemm")
    if layer.indexer is not None:
        pts.add("_indexer_weights_gemm")
        if not fused:
            pts.add("_indexer_kv_score_gemm")
    return pts


def replaced_stages(layer: DeepseekV4Attention) -> set[str]:
    """The stages the layer's platform (its class, or an instance attribute) replaces."""
    return {s for s in STAGES if _stage_overridden(layer, s)}


def expected_points(layer: DeepseekV4Attention, packed_path: bool | None = None,
                    tokens: int = 0, replaced: set[str] | None = None) -> set[str]:
    """The override points a forward of this layer must pass through: every stage, and each
    point of :func:`base_path_points` unless the layer's platform replaces the stage that calls
    it (``replaced``, default :func:`replaced_stages`) without overriding the point itself (a
    point it overrides must run); :data:`ALWAYS_CALLED` points always."""
    if replaced is None:
        replaced = replaced_stages(layer)
    return {p for p in base_path_points(layer, packed_path, tokens)
            if p in STAGES or p in ALWAYS_CALLED or STAGE_OF[p] not in replaced
            or _point_overridden(layer, p)}


def path_violations(layer: DeepseekV4Attention, x: torch.Tensor) -> list[str]:
    """Run one prefill of ``x`` with spies on every override point and check the path; then a
    mixed batch of two sequences must reach the attention stage once."""
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

    replaced = replaced_stages(layer)  # before the spies, which are instance attributes
    for n in points:
        setattr(layer, n, tracer(n))
    try:
        with eager_steps(layer):  # the traced path is the eager one (no replayed graph)
            layer(x, torch.arange(x.shape[0], device=x.device), layer.new_cache(x.shape[0]))
    finally:
        for n in points:
            layer.__dict__.pop(n, None)
    called = {n for kind, n in order if kind == "enter"}
    packed_path = layer._input_pack is not None and "_fused_input_projections_gemm" in called
    expected = expected_points(layer, packed_path, x.shape[0], replaced)
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
    must reach the attention stage once for all of them: one batched path, no loop per
    sequence."""
    n = max(2, x.shape[0] // 2)
    caches = layer.new_caches(2, n + 2)
    layer(x[:n], torch.arange(n, device=x.device), caches[0])
    with spy_methods(layer, ["_attend_and_project"]) as calls:
        layer(x[:3], torch.tensor([n, 0, 1]), caches, seq_lens=[1, 2])
    if len(calls["_attend_and_project"]) != 1:
        return [f"a mixed batch of two sequences called the attention stage "
                f"{len(calls['_attend_and_project'])} times (expected once)"]
    return []


__all__ = ["base_path_points", "expected_points", "path_violations", "pooled_decode_violations",
           "replaced_stages", "spy_methods", "structural_violations"]
