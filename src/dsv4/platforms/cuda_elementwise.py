"""The ``cuda`` platform's fused elementwise work of a step (:mod:`dsv4.kernels.rope_norm`).

The base layer runs the latent norms, the query heads' RMS + RoPE, the kv rows' RoPE (+ fp8
simulation), the indexer queries' RoPE + numerics and the output path's inverse RoPE as ~100
small PyTorch kernels per decode step; here each is one Triton launch with the same math (fp32
statistics and rotation, the layer dtype out), the query heads and the kv rows one launch
together (:func:`fused_query_heads_and_kv_rows`). Each function takes the layer and its input;
:func:`elementwise_usable` is the host-side test (no device sync) that the layer and tensor
qualify.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dsv4.kernels.rope_norm import (
    kernels_usable,
    latent_norms,
    rope_hadamard_fp4,
    rope_heads,
    rope_heads_and_row,
)
from dsv4.layers.quant_sim import INDEX_FP8_BLOCK, index_numerics_sim

if TYPE_CHECKING:
    from dsv4.attention import DeepseekV4Attention

KV_FP8_BLOCK = 64
"""Values per scale of the kv rows' nope-dim simulation (``fp8_block_sim``'s block)."""


def elementwise_usable(layer: DeepseekV4Attention, x: torch.Tensor) -> bool:
    """The kernels take this layer's stage input ``x``: a bf16 layer, x on its CUDA device
    (or the CPU interpreter), Triton present."""
    return layer.dtype == torch.bfloat16 and x.device == layer.device and kernels_usable(x)


def fused_latent_norms(layer: DeepseekV4Attention, qr_kv: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``q_norm`` and ``kv_norm`` of the two halves of ``qr_kv``, one launch."""
    return latent_norms(qr_kv, layer.q_norm.weight, layer.kv_norm.weight, layer.q_norm.eps,
                        layer.kv_norm.eps)


def fused_query_heads_and_kv_rows(layer: DeepseekV4Attention, q: torch.Tensor,
                                  kv: torch.Tensor, pos: torch.Tensor
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The query heads [T, heads, head_dim] - per-head RMS normalisation + RoPE of the ``wq_b``
    output q [T, heads * head_dim] - and the kv rows [T, head_dim] - RoPE, and under
    ``simulate_quant`` the fp8 block-64 simulation of the nope dims - in one launch (a column
    of programs for the rows)."""
    heads = q.unflatten(-1, (layer.n_heads, layer.head_dim))
    dims, block = _kv_row_sim(layer)
    return rope_heads_and_row(heads, kv, pos, _inv_freq(layer), norm_eps=layer.cfg.rms_norm_eps,
                              fp8_dims=dims, fp8_block=block)


def fused_query_heads(layer: DeepseekV4Attention, q: torch.Tensor, pos: torch.Tensor
                      ) -> torch.Tensor:
    """The query heads alone (the heads' part of :func:`fused_query_heads_and_kv_rows`), one
    launch: for a stage that computes them on a side stream, apart from the kv rows."""
    heads = q.unflatten(-1, (layer.n_heads, layer.head_dim))
    return rope_heads(heads, pos, _inv_freq(layer), norm_eps=layer.cfg.rms_norm_eps)


def fused_kv_rows(layer: DeepseekV4Attention, kv: torch.Tensor, pos: torch.Tensor
                  ) -> torch.Tensor:
    """The kv rows alone (the rows' part of :func:`fused_query_heads_and_kv_rows`), one
    launch."""
    dims, block = _kv_row_sim(layer)
    return rope_heads(kv, pos, _inv_freq(layer), fp8_dims=dims, fp8_block=block)


def _kv_row_sim(layer: DeepseekV4Attention) -> tuple[int, int]:
    """The kv rows' fp8 simulation as ``rope_heads`` takes it, (fp8_dims, fp8_block): the nope
    dims, in blocks of ``KV_FP8_BLOCK`` under ``simulate_quant`` (block 0: none)."""
    return layer.head_dim - layer.rope_dim, KV_FP8_BLOCK if layer.cfg.simulate_quant else 0


def fused_indexer_query(layer: DeepseekV4Attention, q: torch.Tensor, pos: torch.Tensor
                        ) -> torch.Tensor:
    """RoPE + the indexer numerics (``cfg.index_numerics`` under ``simulate_quant``: none,
    ``fp8`` or ``hadamard_fp4``) of the indexer's ``wq_b`` output, [T, heads, head_dim]."""
    assert layer.indexer is not None
    numerics = layer.cfg.index_numerics if layer.cfg.simulate_quant else None
    heads = q.unflatten(-1, (layer.indexer.n_heads, layer.indexer.head_dim))
    if numerics == "hadamard_fp4":
        return rope_hadamard_fp4(heads, pos, _inv_freq(layer))
    if numerics == "fp8":
        d = layer.indexer.head_dim
        return rope_heads(heads, pos, _inv_freq(layer), fp8_dims=d, fp8_block=INDEX_FP8_BLOCK)
    # None; any other name is refused with the torch path's message
    return index_numerics_sim(rope_heads(heads, pos, _inv_freq(layer)), numerics)


def fused_inverse_rope(layer: DeepseekV4Attention, o: torch.Tensor, pos: torch.Tensor
                       ) -> torch.Tensor:
    """The output path's inverse RoPE of o [T, heads, head_dim], in place (o is the step's
    attention output, consumed by the output projections): only the rope dims are read and
    written (1/8 of o's bytes at head_dim 512; the nope dims do not change). A copy first
    when o's last dim is strided. Returns the rotated o."""
    if o.stride(-1) != 1:
        o = o.contiguous()
    tail = o[..., layer.head_dim - layer.rope_dim:]
    rope_heads(tail, pos, _inv_freq(layer), inverse=True, out=tail)
    return o


def _inv_freq(layer: DeepseekV4Attention) -> torch.Tensor:
    inv_freq = layer.rotary.inv_freq
    assert isinstance(inv_freq, torch.Tensor)
    return inv_freq
