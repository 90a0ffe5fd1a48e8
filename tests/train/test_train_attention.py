"""The differentiable training attention computes what the inference layer computes."""

from __future__ import annotations

import pytest
import torch

from dsv4 import DeepseekV4Attention, DSV4Config
from dsv4.platforms import build_attention
from dsv4.testing.random_weights import random_layer_weights
from dsv4.tinylm.config import TinyLMConfig
from dsv4_train.attention import (
    QuantOptions,
    TrainAttention,
    export_attention_tensors,
    load_attention_tensors,
    topk_mask,
)

from conftest import RATIOS, rel_err

T = 300  # > 128: ratio-128 entries exist, and ratio-4 queries see more entries than top-k


def _inference_rows(layer: DeepseekV4Attention, x: torch.Tensor) -> torch.Tensor:
    return torch.stack([layer(xb, torch.arange(x.shape[1]), layer.new_cache(x.shape[1]))
                        for xb in x])


@pytest.mark.parametrize("ratio", RATIOS)
def test_float64_equals_inference_layer_simulations_off(ratio):
    cfg = DSV4Config.preset("tiny").replace(fp8_weights=False, simulate_quant=False)
    layer_id = cfg.layer_of_ratio(ratio)
    weights = random_layer_weights(cfg, layer_id, seed=5)
    ref = build_attention(cfg, layer_id, dtype=torch.float64)
    ref.load_weights(weights.items())
    train = TrainAttention(cfg, layer_id).double()
    load_attention_tensors(train, weights)
    x = torch.randn(2, T, cfg.hidden_size, dtype=torch.float64)
    y, _ = train(x, sparse=True)
    assert rel_err(y, _inference_rows(ref, x)) < 1e-10


@pytest.mark.parametrize("ratio", RATIOS)
def test_checkpoint_numerics_equal_the_fp8_layer_with_simulations(ratio):
    """With every weight rounded to its checkpoint dtype and the official simulations on, the
    training forward is the shipped fp8 layer's default numerics (float64). Seeded: with the FP4
    indexer simulation exact score ties are common, where a 1-ulp difference in summation order
    could pick another entry."""
    torch.manual_seed(1)
    cfg = DSV4Config.preset("tiny")
    layer_id = cfg.layer_of_ratio(ratio)
    train = TrainAttention(cfg, layer_id).double()
    ref = build_attention(cfg, layer_id, dtype=torch.float64)
    ref.load_weights(export_attention_tensors(train, fp8=True).items())
    x = torch.randn(2, T, cfg.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        y, _ = train(x, quant=QuantOptions(checkpoint_weights=True, simulate=True))
    assert rel_err(y, _inference_rows(ref, x)) < 1e-10


def test_dense_mode_differs_and_the_indexer_is_trained_by_distillation_only():
    cfg = TinyLMConfig.preset().attn
    train = TrainAttention(cfg, cfg.layer_of_ratio(4))
    x = torch.randn(2, 160, cfg.hidden_size)
    y_sparse, kl = train(x, sparse=True, indexer_loss=True)
    y_dense, _ = train(x, sparse=False)
    assert rel_err(y_sparse, y_dense) > 1e-4  # 40 entries, top-8: selection matters
    assert kl is not None and float(kl.detach()) > 0
    kl.backward()
    idx_grads = {n: p.grad for n, p in train.named_parameters() if n.startswith("indexer.")}
    assert idx_grads and all(g is not None and g.abs().sum() > 0 for g in idx_grads.values())
    others = [n for n, p in train.named_parameters()
              if not n.startswith("indexer.") and p.grad is not None and p.grad.abs().sum() > 0]
    assert others == []  # the KL never reaches the main attention
    train.zero_grad()
    y_sparse.square().mean().backward()
    assert all(p.grad is None or p.grad.abs().sum() == 0
               for n, p in train.named_parameters() if n.startswith("indexer."))


def test_topk_mask_matches_the_inference_tie_break():
    scores = torch.tensor([[0.0, 2.0, 0.0, 0.0, float("-inf")],
                           [1.0, float("-inf"), float("-inf"), float("-inf"), float("-inf")]])
    m = topk_mask(scores, 3)
    assert m.tolist() == [[True, True, True, False, False], [True, False, False, False, False]]
