"""The ``preshuffle`` platform: upstream's ROCm/AITER attention path, runnable anywhere.

After load, the ``preshuffle`` pass stores fp8 ``fused_wqa_wkv`` and ``wo_b`` in AITER's (16, 16)
layout with fp32 block scales kept beside them. The overrides quantise activations to fp8 per
token in groups of 128 (fp32 scales amax / 448, column-major; under ``cfg.act_quant`` the official
power-of-two scales instead) and multiply with a blockscale GEMM that reads the shuffled weight.
The GEMM is an exact PyTorch emulation, so CPU CI runs this platform's numerics end to end; a
real kernel would replace ``blockscale_gemm_preshuffled``.
"""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override

from dsv4.attention import DeepseekV4Attention
from dsv4.layers.fp8 import e8m0_to_float
from dsv4.layers.weight_layout import get_layout
from dsv4.platforms.preshuffle_ops import blockscale_gemm_preshuffled, per_token_group_quant_fp8


def preshuffled_gemm(weight: torch.Tensor, w_scale: torch.Tensor, x: torch.Tensor,
                     official: bool = False) -> torch.Tensor:
    """x @ W^T for a preshuffled fp8 W: per-token group-128 fp8 activations (AITER's fp32
    scales, or with ``official`` the power-of-two ones of docs/spec.md §6.3: ``cfg.act_quant``),
    blockscale GEMM. Any leading dims of x are flattened (never sent to a plain GEMM)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    x_q, x_s = per_token_group_quant_fp8(x2, transpose_scale=True, official=official)
    y = blockscale_gemm_preshuffled(x_q, weight, x_s, w_scale, out_dtype=x.dtype)
    return y.reshape(*lead, weight.shape[0])


class PreshuffleAttention(DeepseekV4Attention):
    platform_name = "preshuffle"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # fp32 block scales of the preshuffled weights; None = that weight is canonical
        self.register_buffer("_wqa_wkv_scale", None, persistent=False)
        self.register_buffer("_wo_b_scale", None, persistent=False)

    @override
    def _fused_wqa_wkv_gemm(self, x: torch.Tensor) -> torch.Tensor:
        scale = self._wqa_wkv_scale
        if not isinstance(scale, torch.Tensor):
            return super()._fused_wqa_wkv_gemm(x)
        return preshuffled_gemm(self.fused_wqa_wkv.weight, scale, x, self.cfg.act_quant)

    @override
    def _o_proj(self, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        scale = self._wo_b_scale
        if not isinstance(scale, torch.Tensor):
            return super()._o_proj(o, positions)
        o = self.rotary.rotate(o, positions, self.acc_dtype, inverse=True)
        return preshuffled_gemm(self.wo_b.weight, scale, self._wo_a_grouped(o),
                                self.cfg.act_quant)

    @override
    @torch.no_grad()
    def _after_weights_changed(self) -> None:
        super()._after_weights_changed()
        for attr, buf in (("fused_wqa_wkv", "_wqa_wkv_scale"), ("wo_b", "_wo_b_scale")):
            lin = getattr(self, attr)
            if get_layout(lin.weight) is not None and lin.scale is not None:
                setattr(self, buf, e8m0_to_float(lin.scale.data).contiguous())
