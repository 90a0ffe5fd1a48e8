"""The ``cuda`` platform.

* ``fuse_input_projections`` packs the four input GEMMs; decode-sized calls run them as one Triton
  launch (``dsv4.kernels.fused_input_proj``). Which token counts take the fused launch is planned
  once, at construction, from a recorded benchmark table (``cuda_plan.json``), never re-timed.
* Larger calls, and layers that are not packed, use upstream's stream plan: fused_wqa_wkv on the
  current stream, the three lighter GEMMs on 3 aux streams shared by all layers of a model
  (created once, :meth:`CudaAttention.shared_build_kwargs`), for T <= multi_stream_token_threshold.
* Compressor score GEMMs multiply bf16 by bf16 with an fp32 output (``torch.mm(out_dtype=...)``).
* The input-projection stage of decode-sized calls runs as a CUDA graph, captured once per
  power-of-two token bucket (attention stays eager, as in upstream's piecewise graphs). Graphs
  are dropped whenever weights are rebound, and not used under an offloader that moves weights.
"""

from __future__ import annotations

import contextlib
import gc
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from dsv4.attention import DeepseekV4Attention
from dsv4.layers.linear import Linear

InputProjections = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                         torch.Tensor | None]


def mm_fp32_out(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T with an fp32 output from bf16 operands (products exact in fp32)."""
    return torch.mm(x, weight.t(), out_dtype=torch.float32)


@contextlib.contextmanager
def capture_graph(graph: torch.cuda.CUDAGraph) -> Iterator[None]:
    """``torch.cuda.graph(graph)`` with Python's garbage collector paused during the capture.

    A collection that runs mid-capture can free tensors of earlier work that other streams
    used; the allocator's event calls then invalidate the capture (seen on the H200 as
    ``cudaErrorStreamCaptureInvalidated`` in a long test session). ``torch.cuda.graph`` collects
    once before it starts, so nothing is left waiting."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph):
            yield
    finally:
        if enabled:
            gc.enable()


@dataclass(frozen=True)
class CudaPlan:
    """Per-layer strategy, fixed at construction."""

    fused_max_tokens: int
    """Calls of at most this many tokens use the one-launch fused input projections."""
    graph_max_tokens: int
    """Calls of at most this many tokens replay a captured CUDA graph of the input stage."""

    @classmethod
    def load(cls, hidden_size: int, path: Path | None = None) -> CudaPlan:
        table = json.loads((path or Path(__file__).with_name("cuda_plan.json")).read_text())
        entry = table.get(str(hidden_size), table["default"])
        return cls(int(entry["fused_max_tokens"]), int(entry["graph_max_tokens"]))


class CudaAttention(DeepseekV4Attention):
    platform_name = "cuda"
    HELPERS = ("_score_gemm", "_graphed", "use_cuda_graphs")

    def __init__(self, *args: Any, aux_streams: Any = None, plan: CudaPlan | None = None,
                 **kwargs: Any) -> None:
        device = torch.device(kwargs.get("device", "cuda"))
        if aux_streams is None:
            aux_streams = [torch.cuda.Stream(device) for _ in range(3)]
        super().__init__(*args, aux_streams=aux_streams, **kwargs)
        self._fp32_out = self.dtype == torch.bfloat16
        self.plan = plan or CudaPlan.load(self.cfg.hidden_size)
        self._graphs: dict[tuple[int, bool], tuple[Any, torch.Tensor, InputProjections]] = {}

    def use_cuda_graphs(self, enabled: bool) -> None:
        """Turn the input stage's CUDA graphs on (the plan's ``graph_max_tokens``) or off (every
        call eager, same kernels): graph-vs-eager comparisons and debugging."""
        default = CudaPlan.load(self.cfg.hidden_size).graph_max_tokens
        self.plan = replace(self.plan, graph_max_tokens=default if enabled else 0)
        self._graphs = {}

    @staticmethod
    def shared_build_kwargs(device: torch.device | str) -> dict[str, Any]:
        """Resources shared by every layer of one model: the 3 aux streams."""
        return {"aux_streams": [torch.cuda.Stream(torch.device(device)) for _ in range(3)]}

    # ---- input stage ------------------------------------------------------------------
    def _run_parallel_input_projections(self, x: torch.Tensor) -> InputProjections:
        fused = self._input_pack is not None and x.shape[0] <= self.plan.fused_max_tokens
        stage = self._fused_input_projections_gemm if fused else self._stream_input_projections
        if (x.shape[0] <= self.plan.graph_max_tokens and self.offloader.is_noop
                and not torch.cuda.is_current_stream_capturing()):
            return self._graphed(x, stage, fused)
        return stage(x)

    def _graphed(self, x: torch.Tensor, stage: Callable[[torch.Tensor], InputProjections],
                 fused: bool) -> InputProjections:
        """Replay the input stage from a graph captured for the next power-of-two bucket."""
        m = x.shape[0]
        bucket = 1 << (m - 1).bit_length()
        key = (bucket, fused)
        if key not in self._graphs:
            static_x = torch.zeros(bucket, x.shape[1], dtype=x.dtype, device=x.device)
            side = torch.cuda.Stream(x.device)
            side.wait_stream(torch.cuda.current_stream(x.device))
            with torch.cuda.stream(side):  # warm up (compiles kernels, sizes workspaces)
                stage(static_x)
            torch.cuda.current_stream(x.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with capture_graph(graph):
                outs = stage(static_x)
            self._graphs[key] = (graph, static_x, outs)
        graph, static_x, outs = self._graphs[key]
        static_x[:m].copy_(x)
        graph.replay()
        return tuple(None if o is None else o[:m] for o in outs)  # type: ignore[return-value]

    def _after_weights_changed(self) -> None:
        super()._after_weights_changed()
        self._graphs = {}  # captured pointers may be stale

    # ---- fp32-output GEMMs ------------------------------------------------------------
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
