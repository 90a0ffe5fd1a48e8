"""``process_weights_after_loading``: run each layer's platform passes in their declared order.

Order: compressor fusion -> full input-projection fusion -> preshuffle (fusions touch bf16
compressor weights, preshuffle the fp8 ``fused_wqa_wkv`` / ``wo_b``; fusion runs first as
upstream's hook does). Each pass is planned over every layer before any layer is changed, so a
pass that fails leaves the whole module as it was. After the passes, each layer's offloader takes
its final weights (``post_init``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn

from dsv4.attention import DeepseekV4Attention, attention_layers
from dsv4.passes.base import Skip, WeightPass
from dsv4.passes.compressor_fusion import CompressorFusionPass
from dsv4.passes.input_fusion import InputFusionPass
from dsv4.passes.preshuffle import PreshufflePass
from dsv4.platforms.registry import default_passes

log = logging.getLogger(__name__)

PASSES: dict[str, WeightPass] = {
    "compressor_fusion": CompressorFusionPass(),
    "fuse_input_projections": InputFusionPass(),
    "preshuffle": PreshufflePass(),
}
ORDER: list[str] = ["compressor_fusion", "fuse_input_projections", "preshuffle"]


def register_pass(p: WeightPass, after: str | None = None) -> None:
    """Add a pass (out-of-tree platforms). It runs right after ``after`` (default: last)."""
    if p.name in PASSES:
        raise ValueError(f"pass {p.name!r} is already registered")
    if p.name not in ORDER:
        if after is not None and after not in ORDER:
            raise ValueError(f"cannot place {p.name!r} after unknown pass {after!r}; order: "
                             f"{ORDER}")
        ORDER.insert(len(ORDER) if after is None else ORDER.index(after) + 1, p.name)
    PASSES[p.name] = p


def unregister_pass(name: str) -> None:
    PASSES.pop(name, None)
    if name not in ("compressor_fusion", "fuse_input_projections", "preshuffle"):
        ORDER.remove(name)


@dataclass
class PassReport:
    """Per pass: the layers it changed and the layers it skipped, with the reason."""

    changed: dict[str, list[int]] = field(default_factory=dict)
    skipped: dict[str, list[tuple[int, str]]] = field(default_factory=dict)

    def summary(self) -> str:
        lines = []
        for name in ORDER:
            if name in self.changed or name in self.skipped:
                lines.append(f"{name}: changed layers {self.changed.get(name, [])}, skipped "
                             f"{len(self.skipped.get(name, []))}")
        return "; ".join(lines) if lines else "no pass ran"


def process_weights_after_loading(module: nn.Module,
                                  passes: Sequence[str] | None = None) -> PassReport:
    """Run the post-load passes on every attention layer in ``module``.

    ``passes``: pass names to run instead of each layer's platform default (order is always
    :data:`ORDER`); e.g. ``["compressor_fusion"]`` turns the fusion on for ``reference``.
    """
    layers = attention_layers(module)
    if not layers:
        raise ValueError("process_weights_after_loading: no DeepseekV4Attention in the module")
    if passes is not None:
        unknown = [p for p in passes if p not in PASSES]
        if unknown:
            raise ValueError(f"unknown pass(es) {unknown}; available passes: {list(PASSES)}")
    report = PassReport()
    for name in ORDER:
        if name not in PASSES:
            continue
        planned = []
        for layer in layers:
            wanted = default_passes(layer) if passes is None else tuple(passes)
            if name in wanted:
                planned.append((layer, PASSES[name].plan(layer)))  # validation; may raise
        if not planned:
            continue
        for layer, plan in planned:
            if isinstance(plan, Skip):
                report.skipped.setdefault(name, []).append((layer.layer_id, plan.reason))
            else:
                plan()
                report.changed.setdefault(name, []).append(layer.layer_id)
        log.info("post-load pass %s: changed %d layer(s) %s, skipped %d", name,
                 len(report.changed.get(name, [])), report.changed.get(name, []),
                 len(report.skipped.get(name, [])))
    for layer in layers:
        layer._finish_post_load()
    return report


def prepare_compressor_gemm_fusion(layer: DeepseekV4Attention) -> bool:
    """Upstream's entry point (docs/upstream.md B.3): run the compressor fusion pass (looked up
    by name in :data:`PASSES`) on one layer; True if it fused, False if it skipped."""
    plan = PASSES["compressor_fusion"].plan(layer)
    if callable(plan):
        plan()
        return True
    return False
