"""The preshuffle pass (upstream ROCm ``prepare_attn_preshuffle``, docs/upstream.md A.3).

Rewrites the fp8 ``fused_wqa_wkv`` and ``wo_b`` weights in place into AITER's (16, 16) tile layout
and keeps their 128x128 block scales separately in fp32 (``_wqa_wkv_scale``, ``_wo_b_scale``).
The shuffled parameter is tagged with :class:`PreshuffleLayout`: plain GEMMs refuse it,
``state_dict()`` / ``save_checkpoint`` unshuffle it, ``load_weights`` shuffles incoming tensors.
Unlike upstream, a second run is a no-op (the tag says the weight is already shuffled).

Eligibility (else skip, the weight stays canonical): fp8 with a block scale, 2-D, K % 128 == 0,
N % 16 == 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dsv4.layers.fp8 import e8m0_to_float
from dsv4.layers.linear import Linear
from dsv4.layers.weight_layout import get_layout
from dsv4.passes.base import Mutation, Skip
from dsv4.platforms.preshuffle_ops import shuffle_weight, unshuffle_weight

if TYPE_CHECKING:
    from dsv4.attention import DeepseekV4Attention

# module attribute -> the layer buffer that holds its fp32 block scale
PRESHUFFLED = {"fused_wqa_wkv": "_wqa_wkv_scale", "wo_b": "_wo_b_scale"}


class PreshuffleLayout:
    """AITER (16, 16): 16-row x 16-byte tiles in row-major tile order (same shape and dtype)."""

    name = "aiter_preshuffle_16x16"

    def to_canonical(self, stored: torch.Tensor) -> torch.Tensor:
        return unshuffle_weight(stored)

    def from_canonical(self, canonical: torch.Tensor) -> torch.Tensor:
        return shuffle_weight(canonical)


PRESHUFFLE_LAYOUT = PreshuffleLayout()


def _ineligible(lin: Linear) -> str | None:
    w = lin.weight
    if not lin.is_fp8 or lin.scale is None:
        return "not an fp8 block-scaled weight"
    if w.dim() != 2:
        return f"weight is {w.dim()}-D"
    n, k = w.shape
    if k % 128:
        return f"K={k} is not a multiple of 128"
    if n % 16:
        return f"N={n} is not a multiple of 16"
    return None


class PreshufflePass:
    name = "preshuffle"

    def plan(self, layer: DeepseekV4Attention) -> Mutation | Skip:
        if not hasattr(layer, "_wqa_wkv_scale"):
            return Skip(f"platform {layer.platform_name!r} has no preshuffled GEMM")
        todo = []
        reasons = []
        for attr in PRESHUFFLED:
            lin: Linear = getattr(layer, attr)
            if get_layout(lin.weight) is not None:
                reasons.append(f"{attr} already preshuffled")
                continue
            why = _ineligible(lin)
            if why is not None:
                reasons.append(f"{attr}: {why}")
                continue
            todo.append(attr)
        if not todo:
            return Skip("; ".join(reasons))
        return lambda: _preshuffle(layer, todo)


@torch.no_grad()
def _preshuffle(layer: DeepseekV4Attention, attrs: list[str]) -> None:
    for attr in attrs:
        lin: Linear = getattr(layer, attr)
        assert lin.scale is not None
        shuffled = shuffle_weight(lin.weight.data)
        lin.weight.data.copy_(shuffled)  # in place: views, offload copies and storage stay valid
        layer._set_weight_layout(f"{attr}.weight", PRESHUFFLE_LAYOUT)
        setattr(layer, PRESHUFFLED[attr], e8m0_to_float(lin.scale.data).contiguous())
