"""Pack all of a layer's input projections for one kernel launch (``fuse_input_projections``).

The four GEMMs that read x (``fused_wqa_wkv``; the main compressor, indexer compressor and
indexer ``weights_proj`` projections) become segments of one packed weight (see
``dsv4.kernels.fused_input_proj``): the bf16 segments are concatenated into a non-persistent
buffer and their parameters re-pointed (``set_``) to zero-copy row views, so every
``state_dict()`` key and value stays as it was; ``fused_wqa_wkv`` stays an fp8 segment in its own
parameter (the kernel dequantises its 128x128 block scales). The compressor segments sit side by
side, so the compressor GEMM fusion's buffer remains a view of the pack.

Skips: already packed; a layer dtype other than bf16 (the kernel writes bf16 / fp32 segments);
a ``fused_wqa_wkv`` in a platform layout (e.g. preshuffled: only its own GEMM can read it); an
offloader that is not fusion-aware.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from dsv4.derived_state import register_restorer
from dsv4.kernels.fused_input_proj import pack_input_weights, segment_views
from dsv4.layers.fp8 import e8m0_to_float
from dsv4.layers.weight_layout import get_layout
from dsv4.passes.base import Mutation, Skip

if TYPE_CHECKING:
    from dsv4.attention import DeepseekV4Attention

QR_KV, KV_SCORE, IDX_KV_SCORE, IDX_WEIGHTS = "qr_kv", "kv_score", "idx_kv_score", "idx_weights"


def input_segments(layer: DeepseekV4Attention) -> list[tuple[str, torch.nn.Parameter, Any]]:
    """(segment name, parameter, output dtype) in pack order."""
    segs: list[tuple[str, torch.nn.Parameter, Any]] = [
        (QR_KV, layer.fused_wqa_wkv.weight, torch.bfloat16)]
    if layer.compressor is not None:
        segs.append((KV_SCORE, layer.compressor.fused_wkv_wgate.weight, torch.float32))
    if layer.indexer is not None:
        segs.append((IDX_KV_SCORE, layer.indexer.compressor.fused_wkv_wgate.weight,
                     torch.float32))
        segs.append((IDX_WEIGHTS, layer.indexer.weights_proj.weight, torch.bfloat16))
    return segs


class InputFusionPass:
    name = "fuse_input_projections"

    def plan(self, layer: DeepseekV4Attention) -> Mutation | Skip:
        if layer._input_pack is not None:
            return Skip("already packed")
        if layer.dtype != torch.bfloat16:
            return Skip(f"layer dtype {layer.dtype} (the fused kernel writes bf16/fp32)")
        if get_layout(layer.fused_wqa_wkv.weight) is not None:
            return Skip("fused_wqa_wkv is in a platform layout")
        off = layer.offloader
        if not off.is_noop and not off.fusion_aware:
            return Skip(f"offloader {off.describe()} rebinds parameters")
        k = layer.cfg.hidden_size
        for name, p, _ in input_segments(layer):
            if p.dim() != 2 or p.shape[1] != k:
                raise ValueError(f"layer {layer.layer_id}: input fusion: {name} weight has "
                                 f"shape {tuple(p.shape)}, expected [rows, {k}]")
            if p.device != layer.device:
                raise ValueError(f"layer {layer.layer_id}: input fusion: {name} is on "
                                 f"{p.device}, the layer on {layer.device}")
        return lambda: pack_layer_inputs(layer)


@torch.no_grad()
def pack_layer_inputs(layer: DeepseekV4Attention) -> None:
    segs = input_segments(layer)
    items: list[tuple[str, Any, Any]] = []
    for i, (name, p, out_dtype) in enumerate(segs):
        if i == 0 and layer.fused_wqa_wkv.is_fp8:
            assert layer.fused_wqa_wkv.scale is not None
            items.append((name, (p.detach(), e8m0_to_float(layer.fused_wqa_wkv.scale)),
                          out_dtype))
        else:
            items.append((name, p.detach(), out_dtype))
    pack = pack_input_weights(items, device=layer.device)
    views = segment_views(pack)
    storage = pack.weight.untyped_storage()
    for name, p, _ in segs:
        if name in views:
            v = views[name]
            p.set_(storage, v.storage_offset(), v.shape, v.stride())
    if KV_SCORE in views and IDX_KV_SCORE in views:
        main = views[KV_SCORE]
        n = main.shape[0] + views[IDX_KV_SCORE].shape[0]
        layer._fused_compressor_weight = pack.weight[main.storage_offset() // main.shape[1]:][:n]
        layer._fused_compressor_split_sizes = (main.shape[0], views[IDX_KV_SCORE].shape[0])
    layer._packed_input_weight = pack.weight
    if pack.fp8_scale is not None:
        layer._packed_fp8_scale = pack.fp8_scale
    layer._input_pack = pack


@torch.no_grad()
def restore_input_pack(layer: DeepseekV4Attention) -> bool:
    """After the parameters were rebound: re-pack if a segment no longer views the packed
    buffer, else re-derive the fp32 copy of new fp8 block scales. False when not packed."""
    packed = layer._packed_input_weight
    if not isinstance(packed, torch.Tensor):
        return False
    ptr = packed.untyped_storage().data_ptr()
    if any(p.untyped_storage().data_ptr() != ptr for _, p, _ in input_segments(layer)[1:]):
        pack_layer_inputs(layer)
    elif layer.fused_wqa_wkv.scale is not None:
        layer._packed_fp8_scale = e8m0_to_float(layer.fused_wqa_wkv.scale.data).to(layer.device)
    return True


register_restorer(InputFusionPass.name, restore_input_pack, order=10)
