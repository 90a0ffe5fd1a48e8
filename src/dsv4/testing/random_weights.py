"""Seeded random weights with official names, dtypes and shapes (tests, demo, benchmarks).

Scales are chosen so that activations stay O(1) through the layer and every softmax (attention,
compressor gates) is neither flat nor one-hot, so numerical comparisons are meaningful.
"""

from __future__ import annotations

import torch

from dsv4.config import DSV4Config
from dsv4.layers.fp8 import quantize_fp8_block

_FP8_NAMES = ("wq_a", "wkv", "wq_b", "wo_a", "wo_b", "indexer.wq_b")


def official_layer_shapes(cfg: DSV4Config, layer_id: int) -> dict[str, tuple[int, ...]]:
    """Shapes of the layer's weights (without ``.scale`` tensors), docs/spec.md §3.1."""
    r = cfg.compress_ratio(layer_id)
    h, d, dr = cfg.hidden_size, cfg.head_dim, cfg.index_head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "wq_a.weight": (cfg.q_lora_rank, h),
        "wkv.weight": (d, h),
        "q_norm.weight": (cfg.q_lora_rank,),
        "kv_norm.weight": (d,),
        "wq_b.weight": (cfg.num_attention_heads * d, cfg.q_lora_rank),
        "wo_a.weight": (cfg.o_groups * cfg.o_lora_rank, cfg.heads_per_group * d),
        "wo_b.weight": (h, cfg.o_groups * cfg.o_lora_rank),
        "attn_sink": (cfg.num_attention_heads,),
    }
    if r:
        coff = 2 if r == 4 else 1
        shapes.update({
            "compressor.wkv.weight": (coff * d, h),
            "compressor.wgate.weight": (coff * d, h),
            "compressor.ape": (r, coff * d),
            "compressor.norm.weight": (d,),
        })
    if r == 4:
        shapes.update({
            "indexer.wq_b.weight": (cfg.index_n_heads * dr, cfg.q_lora_rank),
            "indexer.weights_proj.weight": (cfg.index_n_heads, h),
            "indexer.compressor.wkv.weight": (2 * dr, h),
            "indexer.compressor.wgate.weight": (2 * dr, h),
            "indexer.compressor.ape": (4, 2 * dr),
            "indexer.compressor.norm.weight": (dr,),
        })
    return shapes


def random_layer_weights(cfg: DSV4Config, layer_id: int, seed: int = 0,
                         ) -> dict[str, torch.Tensor]:
    """Official-name tensors for one layer: fp8 e4m3 + ue8m0 block scales where the official
    checkpoint is fp8 (when ``cfg.fp8_weights``), bf16 and fp32 elsewhere; on the CPU."""
    g = torch.Generator().manual_seed(seed * 1000 + layer_id)
    out: dict[str, torch.Tensor] = {}
    for name, shape in official_layer_shapes(cfg, layer_id).items():
        base = name.rsplit(".", 1)[0]
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g, dtype=torch.float64)
            out[name] = t.to(torch.bfloat16)
        elif name == "attn_sink":
            out[name] = torch.randn(shape, generator=g, dtype=torch.float64).float()
        elif name.endswith(".ape"):
            out[name] = (0.5 * torch.randn(shape, generator=g, dtype=torch.float64)).float()
        else:
            fan_in = shape[1]
            gain = 2.0 if "wgate" in name else 1.0  # gates with some spread
            w = gain * torch.randn(shape, generator=g, dtype=torch.float64) / fan_in**0.5
            if base in _FP8_NAMES and cfg.fp8_weights:
                q, s = quantize_fp8_block(w.float())
                out[name], out[f"{base}.scale"] = q, s
            else:
                out[name] = w.to(torch.bfloat16)
    return out
