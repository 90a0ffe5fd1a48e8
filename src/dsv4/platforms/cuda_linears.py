"""The ``cuda`` platform's fp8 linears: ``wq_b``, the grouped ``wo_a``, ``wo_b`` and the indexer's
``wq_b`` through the weight-streaming GEMMs of :mod:`dsv4.kernels.fp8_linear`.

The base layer multiplies these weights by dequantising them into the activation dtype on every
call (two elementwise passes over the weight, then a bf16 GEMM). Here the kernels read the e4m3
weight and its ue8m0 128x128 block scales as stored and apply the scales in the kernel; the
grouped ``wo_a`` is one launch over all of the rank's groups. No copy of any weight is made, so
weights are never held twice.

Numerics (declared): per 128-wide K block the e4m3 tile widens to bf16 exactly, the block product
accumulates in fp32 and is scaled by the block's power of two (exact), the sum over blocks is
fp32, the output is rounded once to bf16. That is the base path's bf16 GEMM on the dequantised
weight (fp32 accumulation, bf16 output) up to the order of the fp32 additions. Under the
config's ``act_quant`` (docs/spec.md §6.3) the streaming kernel quantises each 128-wide block of
x to e4m3 itself and runs fp8 x fp8 MMAs (Hopper keeps about 14 bits of a block's running sum: ~1e-4
relative, the official kernels' numerics too); long calls run cuBLAS's block-scaled fp8 GEMM on
x quantised per 128 where PyTorch offers it (:func:`block_scaled_gemm`: sm_90, CUDA 12.9+; the
same fp8 MMAs), else take ``fp8_block_sim``'s values of x (one launch,
:func:`~dsv4.kernels.fp8_linear.simulate_activations`) into a bf16 cuBLAS GEMM.

Which layers take it is decided on the host, without device syncs (CUDA-graph capturable), by
:func:`plan_fp8_linears` after every weight change, and per call by the offloader (an offloader
that moves weights rebinds them around the forward: the base path then runs, as for CUDA
graphs). The token count picks the kernel: calls of at most the plan's ``fp8_gemm_max_tokens``
(default :data:`FP8_GEMM_MAX_TOKENS`; ``wo_a``: ``wo_a_max_tokens``, default
:data:`WO_A_MAX_TOKENS`) tokens stream the fp8 weight; longer calls (prefill) run the
block-scaled GEMM under ``act_quant`` where it applies, or amortise one dequantised bf16 copy
over their tokens and run cuBLAS on it, the base path's GEMM, with the copy made in one pass
(:func:`dsv4.kernels.fp8_linear.fp8_dequantize`; the base path's two PyTorch passes took ~140
us per weight and call at Flash sizes on the H200, ~1.4 ms of a 16K-token Flash prefill).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from dsv4.kernels.fp8_linear import (
    block_scale_values,
    choose_fp8_config,
    fp8_dequantize,
    fp8_grouped_linear,
    fp8_linear,
    quantize_activations,
    simulate_activations,
    sm_count,
)
from dsv4.layers.linear import Linear, grouped_linear
from dsv4.layers.weight_layout import get_layout

if TYPE_CHECKING:
    from dsv4.attention import DeepseekV4Attention
    from dsv4.kernels.fused_input_proj import SplitKWorkspace

FP8_GEMM_MAX_TOKENS = 512
"""Calls of at most this many tokens use the weight-streaming kernels (4-17x faster than
dequantise + GEMM at M = 1, 16, 64, benchmarks/results/2026-12-03-h200/gemm-probes/; the whole
layer faster with them up to 512 tokens, H100, benchmarks/results/2026-12-07-h100/
decode-step-verify/routes/); longer calls (prefill) dequantise in one pass and run a bf16
cuBLAS GEMM. The ``cuda`` platform's default for its plan's ``fp8_gemm_max_tokens``
(``cuda_plan.json``)."""

WO_A_MAX_TOKENS = 256
"""``wo_a``'s own streaming limit (the plan's ``wo_a_max_tokens``): its activations stay bf16
(docs/spec.md §6.3), and its grouped kernel's bf16 MMAs fall behind the dequantised copy
sooner than the other GEMMs' fp8 MMAs do. H100, 2026-12-07, the GEMM probe, us per call,
streaming / copy + cuBLAS: Flash 43.9 / 68.3 at 128 tokens, 75.8 / 73.6 at 256, 145.2 / 85.2
at 512; Pro 76.8 / 134.6, 146.3 / 142.7, 283.5 / 169.3 (the act8 GEMMs at 512: Flash ``wq_b``
62.3 / 90.5, Pro ``wo_b`` 201.2 / 299.0; ``benchmarks/results/2026-12-07-h100/gemm-probes/
rows/``). 256 streams where the two tie, without the copy's bf16 buffer."""

PREQUANT_MIN_TOKENS = 33
"""Under ``act_quant``, calls of at least this many tokens (and at most
:data:`FP8_GEMM_MAX_TOKENS`) quantise x once in its own launch
(:func:`dsv4.kernels.fp8_linear.quantize_activations`; the same output bit for bit) instead
of in every program of the GEMM, which re-quantises each token's blocks once per weight-row
tile. H100, 2026-12-06 (``benchmarks/results/2026-12-06-h100/gemm-prequant/``, quantising
launch included), us at M = 64 against M = 16's in-kernel quantisation: Flash ``wo_b`` 29.0
-> 25.5, Pro ``wo_b`` 65.8 -> 61.3, Pro ``wq_b`` 46.9 -> 44.9, Flash ``wq_b`` 17.7 -> 17.4;
the indexer's ``wq_b`` 11.1 -> 12.1 (Flash), 13.1 -> 13.6 (Pro); at M = 16 it lost on every
shape (Flash ``wq_b`` 14.3 -> 15.9). In the layer (``decode-step-verify/512-prequant/``), a
verify step of 16 sequences x (1 + 3) tokens at context 512: Pro 263.4 -> 250.4 us, Flash
169.7 -> 169.3 (three more launches); decode steps of 16 sequences unchanged. 17 .. 32 tokens
not measured."""

BLOCK = 128
LINEARS = ("fused_wqa_wkv", "wq_b", "wo_a", "wo_b", "indexer.wq_b")
"""The layer's fp8 linears this module can take over (module names relative to the layer).
``fused_wqa_wkv`` through ``_fused_wqa_wkv_gemm``: the calls above the fused input-projection
launch's tokens (the stream plan; below it the one-launch kernel reads the fp8 weight itself)."""


@dataclass(frozen=True)
class Fp8LinearPlan:
    """Which of :data:`LINEARS` run through the fp8 kernels, and why the others do not."""

    eligible: frozenset[str] = frozenset()
    skipped: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        parts = [f"{n}: fp8 kernel" for n in LINEARS if n in self.eligible]
        parts += [f"{n}: base path ({why})" for n, why in self.skipped.items()]
        return "; ".join(parts)


def linear_problem(lin: Linear, dtype: torch.dtype) -> str | None:
    """Why ``lin`` cannot run through the fp8 kernels in a layer of ``dtype`` (None: it can)."""
    if dtype != torch.bfloat16:
        return f"the layer runs in {dtype}; the kernels take bf16 activations"
    if not lin.is_fp8 or lin.scale is None:
        return "not an fp8 weight"
    layout = get_layout(lin.weight)
    if layout is not None:
        return f"weight stored in the platform layout {layout.name!r}"
    n, k = lin.weight.shape
    if n % BLOCK or k % BLOCK:
        return f"weight {n} x {k} is not a multiple of {BLOCK} in both dims"
    if not lin.weight.is_contiguous():
        return "weight is not contiguous"
    return None


def plan_fp8_linears(layer: DeepseekV4Attention, kernels_available: bool,
                     why_unavailable: str = "") -> Fp8LinearPlan:
    """The plan for ``layer``'s current weights (host work only; run after weight changes)."""
    eligible, skipped = set(), {}
    for name in LINEARS:
        lin = layer.get_submodule(name) if _has(layer, name) else None
        if lin is None:
            continue
        assert isinstance(lin, Linear)
        why = why_unavailable if not kernels_available else linear_problem(lin, layer.dtype)
        if name == "wo_a" and why is None:
            g = layer.o_groups
            if lin.weight.shape[0] % g or (lin.weight.shape[0] // g) % BLOCK:
                why = f"rows per output group {lin.weight.shape[0] // g} not a multiple of {BLOCK}"
        if why is None:
            eligible.add(name)
        else:
            skipped[name] = why
    return Fp8LinearPlan(frozenset(eligible), skipped)


def _has(layer: DeepseekV4Attention, name: str) -> bool:
    return not name.startswith("indexer.") or layer.indexer is not None


def fp8_gemm(lin: Linear, x: torch.Tensor, act_quant: bool = False,
             stream_max_tokens: int | None = None,
             workspace: SplitKWorkspace | None = None) -> torch.Tensor:
    """x [T, K] bf16 @ (weight * scale)^T -> [T, N] bf16: the scales applied in the streaming
    kernel (at most ``stream_max_tokens`` tokens, default :data:`FP8_GEMM_MAX_TOKENS`; the
    platform passes its plan's), or for longer calls by cuBLAS (:func:`long_gemm`).
    ``act_quant``: x quantised as §6.3 says first - inside the streaming kernel (fp8 MMAs), or
    as the long route takes it. ``workspace``: the
    streaming kernel's split-K workspace (default: the device's; a side stream's launches pass
    :func:`~dsv4.kernels.fp8_linear.side_stream_workspace`)."""
    assert lin.scale is not None
    n, k = lin.weight.shape
    m = x.shape[0]
    if m <= (FP8_GEMM_MAX_TOKENS if stream_max_tokens is None else stream_max_tokens):
        if not act_quant:
            return fp8_linear(x, lin.weight, lin.scale, workspace=workspace)
        cfg = choose_fp8_config(m, n, k, sm_count(x.device), act_fp8=True)
        if m < PREQUANT_MIN_TOKENS:
            return fp8_linear(x, lin.weight, lin.scale, config=cfg, workspace=workspace)
        xq, sx = quantize_activations(x)
        return fp8_linear(xq, lin.weight, lin.scale, config=cfg, workspace=workspace,
                          x_scales=sx)
    return long_gemm(x, lin.weight, lin.scale, act_quant)


def long_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
              act_quant: bool = False) -> torch.Tensor:
    """The route of calls above the streaming limit: under ``act_quant`` cuBLAS's block-scaled
    fp8 GEMM where it runs (:func:`block_scaled_gemm`), else a one-pass dequantised copy of the
    weight and a bf16 cuBLAS GEMM (:func:`dequantised_gemm`)."""
    if act_quant and block_scaled_gemm_applies(x.device):
        return block_scaled_gemm(x, weight, scale)
    return dequantised_gemm(x, weight, scale, act_quant)


@functools.cache
def _block_scaling_on(index: int) -> bool:
    cuda = torch.version.cuda
    if cuda is None or not (hasattr(F, "scaled_mm") and hasattr(F, "ScalingType")):
        return False
    version = tuple(int(p) for p in cuda.split(".")[:2])
    return torch.cuda.get_device_capability(index) == (9, 0) and version >= (12, 9)


def block_scaled_gemm_applies(device: torch.device | str) -> bool:
    """cuBLAS runs the official block-scaled fp8 GEMM (docs/spec.md §6.3: 1 x 128 activation
    scales, 128 x 128 weight scales) on ``device``: PyTorch's ``F.scaled_mm`` offers that
    recipe on sm_90 with CUDA 12.9 or later (cuBLAS's block scaling)."""
    device = torch.device(device)
    return device.type == "cuda" and _block_scaling_on(
        device.index if device.index is not None else torch.cuda.current_device())


def block_scaled_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The long ``act_quant`` calls' route where :func:`block_scaled_gemm_applies`: x [T, K] bf16
    quantised per token and 128-wide K block (:func:`~dsv4.kernels.fp8_linear.
    quantize_activations`, one launch) and multiplied as e4m3 by the e4m3 weight [N, K] with
    both scales applied per block by cuBLAS -> [T, N] bf16: §6.3's GEMM as the official code
    runs it, where :func:`dequantised_gemm` reaches the same values through a bf16 copy of the
    weight and a bf16 GEMM (here the fp8 MMA's accumulation within a block, about 14 bits, as
    in the streaming kernels). T is padded to a multiple of 4 (cuBLAS's alignment of the
    activation scales), and the weight scales' K blocks to a multiple of 4 as cuBLAS reads
    them."""
    t = x.shape[0]
    if t % 4:
        x = F.pad(x, (0, 0, 0, -t % 4))
    xq, sx = quantize_activations(x)
    n, k = weight.shape
    kb = k // BLOCK
    sw = block_scale_values(scale)
    if kb % 4:
        sw = F.pad(sw, (0, -kb % 4), value=1.0)
    y = F.scaled_mm(xq, weight.t(), sx.t().contiguous().t(), F.ScalingType.BlockWise1x128,
                    sw.contiguous().t(), F.ScalingType.BlockWise128x128,
                    output_dtype=torch.bfloat16)
    return y[:t]


def dequantised_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                     act_quant: bool = False) -> torch.Tensor:
    """The long calls' route where block scaling does not run (:func:`long_gemm`): x [T, K]
    (quantised per 128 and scaled back under ``act_quant``: ``fp8_block_sim``'s values in one
    launch, :func:`~dsv4.kernels.fp8_linear.simulate_activations`) times a one-pass
    dequantised bf16 copy of the weight [N, K], by cuBLAS."""
    if act_quant:
        x = simulate_activations(x)
    return F.linear(x, fp8_dequantize(weight, scale))


def dequantised_grouped_gemm(og: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor
                             ) -> torch.Tensor:
    """The long calls' grouped route: og [T, G, K] times each group's rows of a one-pass
    dequantised bf16 copy of the weight [G * R, K] -> [T, G * R] (the base path's grouped
    product; an einsum's copy to flatten was 0.33 ms at 16K tokens)."""
    w = fp8_dequantize(weight, scale).view(og.shape[1], -1, og.shape[2])
    return grouped_linear(og, w)


def fp8_wo_a_wo_b(layer: DeepseekV4Attention, o: torch.Tensor, wo_b: bool,
                  stream_max_tokens: int | None = None,
                  wo_a_max_tokens: int | None = None) -> torch.Tensor:
    """The output projection after inverse RoPE: ``wo_a`` grouped in one launch over this rank's
    output groups (g-major: group g = heads g*hpg .. g*hpg + hpg - 1), then ``wo_b`` (through
    the fp8 kernel when ``wo_b``, else the base module; streaming up to ``stream_max_tokens``
    tokens as :func:`fp8_gemm`). o [T, heads, d] bf16 -> [T, hidden]. Calls of more than
    ``wo_a_max_tokens`` (default :data:`WO_A_MAX_TOKENS`) tokens: the base path's grouped
    product on a one-pass dequantised ``wo_a``."""
    lin = layer.wo_a
    assert lin.scale is not None
    og = o.reshape(o.shape[0], layer.o_groups, -1)
    if o.shape[0] <= (WO_A_MAX_TOKENS if wo_a_max_tokens is None else wo_a_max_tokens):
        z = fp8_grouped_linear(og, lin.weight, lin.scale).flatten(1)
    else:
        z = dequantised_grouped_gemm(og, lin.weight, lin.scale)
    if wo_b:
        return fp8_gemm(layer.wo_b, z, layer.cfg.act_quant, stream_max_tokens)
    return layer._wo_b_product(z)
