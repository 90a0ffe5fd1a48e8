"""The ``cuda`` platform: upstream's CUDA stream plan and fp32-output GEMMs.

* The input GEMMs fan out over 3 aux streams shared by all layers of a model (created once, see
  :meth:`CudaAttention.shared_build_kwargs`), for calls of at most
  ``multi_stream_token_threshold`` tokens.
* Compressor score GEMMs multiply bf16 by bf16 with an fp32 output (``torch.mm(out_dtype=...)``)
  instead of upcasting the weight.
"""

from __future__ import annotations

from typing import Any

import torch

from dsv4.attention import DeepseekV4Attention
from dsv4.layers.linear import Linear


def mm_fp32_out(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T with an fp32 output from bf16 operands (products exact in fp32)."""
    return torch.mm(x, weight.t(), out_dtype=torch.float32)


class CudaAttention(DeepseekV4Attention):
    platform_name = "cuda"
    HELPERS = ("_score_gemm",)

    def __init__(self, *args: Any, aux_streams: Any = None, **kwargs: Any) -> None:
        device = torch.device(kwargs.get("device", "cuda"))
        if aux_streams is None:
            aux_streams = [torch.cuda.Stream(device) for _ in range(3)]
        super().__init__(*args, aux_streams=aux_streams, **kwargs)
        self._fp32_out = self.dtype == torch.bfloat16

    @staticmethod
    def shared_build_kwargs(device: torch.device | str) -> dict[str, Any]:
        """Resources shared by every layer of one model: the 3 aux streams."""
        return {"aux_streams": [torch.cuda.Stream(torch.device(device)) for _ in range(3)]}

    def _score_gemm(self, lin: Linear, x: torch.Tensor) -> torch.Tensor:
        if self._fp32_out:
            return mm_fp32_out(x, lin.weight)
        return lin.forward_fp32(x, self.acc_dtype)

    def _compressor_kv_score_gemm(self, x: torch.Tensor) -> torch.Tensor:
        assert self.compressor is not None
        return self._score_gemm(self.compressor.fused_wkv_wgate, x)

    def _indexer_kv_score_gemm(self, x: torch.Tensor) -> torch.Tensor:
        assert self.indexer is not None
        return self._score_gemm(self.indexer.compressor.fused_wkv_wgate, x)

    def _fused_compressor_score_gemm(self, x: torch.Tensor) -> torch.Tensor:
        w = self._fused_compressor_weight
        assert isinstance(w, torch.Tensor)
        if self._fp32_out:
            return mm_fp32_out(x, w)
        return super()._fused_compressor_score_gemm(x)
