"""The ``cuda`` platform's layer built on the CPU, for running its step kernels under Triton's
interpreter (``TRITON_INTERPRET=1``): stand-ins for what the CPU build of PyTorch lacks (CUDA
events, an fp32-output mm, the SM count) and the layer with one stream. Used by the interpreted
layer test (``tests/kernels/test_cuda_layer_interpreted.py``) and the launch count
(``benchmarks/step_launches.py``)."""

from __future__ import annotations

from typing import Any

import torch

from dsv4.config import DSV4Config
from dsv4.passes import process_weights_after_loading
from dsv4.testing.random_weights import random_layer_weights


class NoEvent:
    """``torch.cuda.Event`` on the CPU build (the layer records events it never waits on)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def record(self, *args: object) -> None:
        pass


def cpu_stand_ins() -> list[tuple[Any, str, Any]]:
    """(object, attribute, value) for each stand-in: set them (``monkeypatch.setattr`` in a
    test) before building a layer with :func:`build_cpu_cuda_layer`."""
    import dsv4.kernels.fused_input_proj as fip
    import dsv4.kernels.indexer_topk as itk
    import dsv4.kernels.sparse_mqa as smq
    import dsv4.platforms.cuda as cuda

    patches: list[tuple[Any, str, Any]] = [
        (torch.cuda, "Event", NoEvent),
        (cuda, "mm_fp32_out", lambda x, w: x.float() @ w.float().t())]
    patches += [(mod, "_n_sm", lambda *_: 132) for mod in (fip, itk, smq)]
    return patches


def build_cpu_cuda_layer(cfg: DSV4Config, ratio: int, kernels: bool = True) -> Any:
    """A ``CudaAttention`` of ``cfg``'s first layer of compression ``ratio`` on the CPU, random
    weights, no CUDA graphs, one stream, its step kernels on or off."""
    from dsv4.platforms.cuda import CudaAttention

    lid = cfg.layer_of_ratio(ratio)
    layer = CudaAttention(cfg, lid, device="cpu", dtype=torch.bfloat16, aux_streams=[])
    layer.load_weights(random_layer_weights(cfg, lid).items())
    process_weights_after_loading(layer)
    layer.use_cuda_graphs(False)
    layer.aux_streams = None  # one stream: the CPU has none
    layer.use_step_kernels(kernels)
    return layer
