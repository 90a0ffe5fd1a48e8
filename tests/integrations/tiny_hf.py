"""A tiny random transformers DeepseekV4ForCausalLM with every layer type (ratios 0, 4, 128),
hyper-connections and MoE (hash and top-k routed), for the bridge tests.

16 indexer heads: with few heads, ReLU zeroes every head for many entries and the index scores
tie exactly; transformers' ``topk`` then breaks ties its own way while dsv4 takes the lower entry
(4 heads: the picks differ from position 56 on and the logits by ~10 %)."""

from __future__ import annotations

from typing import Any

import torch

TINY_KW: dict[str, Any] = dict(
    vocab_size=128, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=1, head_dim=128, q_lora_rank=32,
    num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1, max_position_embeddings=4096,
    layer_types=["sliding_attention", "compressed_sparse_attention",
                 "heavily_compressed_attention"],
    mlp_layer_types=["hash_moe", "moe", "moe"], hc_mult=2, hc_sinkhorn_iters=4, sliding_window=8,
    o_groups=2, o_lora_rank=32, index_n_heads=16, index_head_dim=64, index_topk=4,
    partial_rotary_factor=0.5,
    rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64,
                     "beta_fast": 32.0, "beta_slow": 1.0},
    bos_token_id=None, eos_token_id=None, pad_token_id=0,
)


@torch.no_grad()
def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any) -> Any:
    """The model with weights scaled so that attention is neither flat nor one-hot."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()  # the tiny YaRN length triggers a harmless warning
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**{**TINY_KW, **overrides})).eval()
    g = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        def rand(shape: Any) -> torch.Tensor:
            return torch.randn(shape, generator=g)

        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            p.copy_(rand(p.shape))
        elif ".self_attn." not in name:
            continue
        elif name.endswith("norm.weight"):
            p.copy_(1 + 0.1 * rand(p.shape))
        elif name.endswith("sinks"):
            p.copy_(rand(p.shape))
        elif name.endswith("position_bias"):
            p.copy_(0.5 * rand(p.shape))
        else:
            gain = 2.0 if "gate_proj" in name else 1.0
            p.copy_(gain * rand(p.shape) / p.shape[-1] ** 0.5)
    return model.to(dtype)
