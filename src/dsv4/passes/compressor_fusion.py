"""The C4 compressor GEMM fusion (upstream vllm#53838, docs/upstream.md Part B).

In a ratio-4 layer the main compressor's ``fused_wkv_wgate`` [2048, K] and the indexer
compressor's [512, K] read the same x with the same K and dtype. After load they are concatenated
once into a non-persistent buffer [2560, K]; both parameters are re-pointed (``set_``, no grad)
to zero-copy row slices of it, so ``state_dict()`` keys and values are unchanged and the forward
runs one fp32-output GEMM split into (2048, 512) views.

Guards, in upstream's order: already fused -> skip; an offloader that rebinds parameters without
knowing about the fusion -> warn once, skip (our own offloaders are fusion-aware and keep it on);
no compressor or no indexer -> skip; ndim / K / dtype / device mismatch -> ``ValueError``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from dsv4.derived_state import register_restorer
from dsv4.passes.base import Mutation, Skip

if TYPE_CHECKING:
    from dsv4.attention import DeepseekV4Attention

log = logging.getLogger(__name__)

_warned_offload = False


def _warn_offload_once(name: str) -> None:
    global _warned_offload
    if not _warned_offload:
        log.warning("C4 compressor GEMM fusion is incompatible with the %s weight offloader "
                    "(it rebinds parameters); the fusion stays disabled", name)
        _warned_offload = True


class CompressorFusionPass:
    name = "compressor_fusion"

    def plan(self, layer: DeepseekV4Attention) -> Mutation | Skip:
        if isinstance(layer._fused_compressor_weight, torch.Tensor):
            return Skip("already fused")
        off = layer.offloader
        if off is not None and not off.is_noop and not off.fusion_aware:
            _warn_offload_once(off.describe())
            return Skip(f"offloader {off.describe()} rebinds parameters")
        if layer.compressor is None or layer.indexer is None:
            return Skip(f"no compressor + indexer pair (compress_ratio {layer.compress_ratio})")
        main = layer.compressor.fused_wkv_wgate.weight
        idx = layer.indexer.compressor.fused_wkv_wgate.weight
        where = f"layer {layer.layer_id}: compressor GEMM fusion"
        if main.dim() != 2 or idx.dim() != 2:
            raise ValueError(f"{where}: weights must be 2-D, got {main.dim()}-D and "
                             f"{idx.dim()}-D")
        if main.shape[1] != idx.shape[1]:
            raise ValueError(f"{where}: K differs ({main.shape[1]} vs {idx.shape[1]})")
        if main.dtype != idx.dtype:
            raise ValueError(f"{where}: dtypes differ ({main.dtype} vs {idx.dtype})")
        if main.device != idx.device:
            raise ValueError(f"{where}: devices differ ({main.device} vs {idx.device})")
        return lambda: fuse_compressor_weights(layer)


@torch.no_grad()
def fuse_compressor_weights(layer: DeepseekV4Attention) -> None:
    """Concatenate, re-point both parameters at the fused buffer's rows, record the split."""
    assert layer.compressor is not None and layer.indexer is not None
    main = layer.compressor.fused_wkv_wgate.weight
    idx = layer.indexer.compressor.fused_wkv_wgate.weight
    fused = torch.cat((main.detach(), idx.detach()), dim=0)
    n_main = main.shape[0]
    storage = fused.untyped_storage()
    main.set_(storage, 0, main.shape, main.stride())
    idx.set_(storage, n_main * fused.shape[1], idx.shape, idx.stride())
    layer._fused_compressor_weight = fused
    layer._fused_compressor_split_sizes = (n_main, idx.shape[0])


@torch.no_grad()
def restore_compressor_fusion(layer: DeepseekV4Attention) -> bool:
    """After the parameters were rebound: re-fuse if the two no longer view the fused buffer.
    False when the layer is not fused."""
    fused = layer._fused_compressor_weight
    if not isinstance(fused, torch.Tensor):
        return False
    main, idx = layer.fused_compressor_params()
    ptr = fused.untyped_storage().data_ptr()
    if not (main.untyped_storage().data_ptr() == ptr == idx.untyped_storage().data_ptr()):
        fuse_compressor_weights(layer)
    return True


register_restorer(CompressorFusionPass.name, restore_compressor_fusion, order=20)
