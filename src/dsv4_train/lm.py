"""The tiny decoder LM for training: float weights, :class:`TrainAttention`, whole batches.

Same architecture as the inference model (:mod:`dsv4.tinylm.lm`): token embedding, blocks of
(RMSNorm -> DSV4 attention -> residual -> RMSNorm -> SwiGLU MLP -> residual), final RMSNorm,
``lm_head``. No MoE, no hyper-connections, no MTP. Parameter names are the official DeepSeek
checkpoint names (``embed.weight``, ``layers.{i}.attn_norm.weight``,
``layers.{i}.attn.wq_a.weight``, ``layers.{i}.ffn.w1.weight``, ``norm.weight``, ``head.weight``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dsv4.layers.norm import rms_normalize
from dsv4.tinylm.config import TinyLMConfig
from dsv4_train.attention import (
    NO_QUANT,
    QuantOptions,
    TrainAttention,
    _Linear,
    _Norm,
    export_attention_tensors,
    ste,
)


def _bf16_view(w: torch.Tensor, quant: QuantOptions) -> torch.Tensor:
    """Non-attention tensors are bf16 in the checkpoint."""
    return ste(w, w.detach().to(torch.bfloat16).to(w.dtype)) if quant.checkpoint_weights else w


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float, quant: QuantOptions) -> torch.Tensor:
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (rms_normalize(x, eps, acc) * _bf16_view(w, quant).to(acc)).to(x.dtype)


class TrainFFN(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, hidden: int, inter: int, out_gain: float) -> None:
        super().__init__()
        self.w1 = _Linear(hidden, inter)
        self.w2 = _Linear(inter, hidden, gain=out_gain)
        self.w3 = _Linear(hidden, inter)

    def forward(self, x: torch.Tensor, quant: QuantOptions) -> torch.Tensor:
        w1, w2, w3 = (_bf16_view(m.weight, quant) for m in (self.w1, self.w2, self.w3))
        return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


class TrainBlock(nn.Module):
    def __init__(self, cfg: TinyLMConfig, layer_id: int) -> None:
        super().__init__()
        h = cfg.hidden_size
        out_gain = 1.0 / math.sqrt(2 * cfg.num_layers)
        self.attn_norm = _Norm(h)
        self.attn = TrainAttention(cfg.attn, layer_id)
        with torch.no_grad():
            self.attn.wo_b.weight.mul_(out_gain)
        self.ffn_norm = _Norm(h)
        self.ffn = TrainFFN(h, cfg.intermediate_size, out_gain)
        self.eps = cfg.attn.rms_norm_eps

    def forward(self, x: torch.Tensor, sparse: bool, quant: QuantOptions, indexer_loss: bool,
                valid_len: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[B, T, hidden] -> [B, T, hidden] (and the indexer loss of a ratio-4 layer)."""
        a, kl = self.attn(_norm(x, self.attn_norm.weight, self.eps, quant), sparse=sparse,
                          quant=quant, indexer_loss=indexer_loss, valid_len=valid_len)
        x = x + a
        return x + self.ffn(_norm(x, self.ffn_norm.weight, self.eps, quant), quant), kl


class TrainLM(nn.Module):
    def __init__(self, cfg: TinyLMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.embed = nn.Embedding(cfg.vocab_size, h)
        nn.init.normal_(self.embed.weight, std=1.0)
        self.layers = nn.ModuleList(TrainBlock(cfg, i) for i in range(cfg.num_layers))
        self.norm = _Norm(h)
        self.head = _Linear(h, cfg.vocab_size)

    def forward(self, tokens: torch.Tensor, *, sparse: bool = True,
                quant: QuantOptions = NO_QUANT, indexer_loss: bool = False,
                valid_len: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [B, T, vocab] (fp32; fp64 in float64) of token rows [B, T] starting at position
        0, and the sum of the ratio-4 layers' indexer distillation losses (0 if not asked for)."""
        x = F.embedding(tokens, _bf16_view(self.embed.weight, quant)).to(dtype)
        kl_total = x.new_zeros((), dtype=torch.float32)
        for block in self.layers:
            x, kl = block(x, sparse, quant, indexer_loss, valid_len)
            if kl is not None:
                kl_total = kl_total + kl.float()
        x = _norm(x, self.norm.weight, self.cfg.attn.rms_norm_eps, quant)
        logits = F.linear(x, _bf16_view(self.head.weight, quant).to(x.dtype))
        return logits.to(torch.float64 if dtype == torch.float64 else torch.float32), kl_total

    @torch.no_grad()
    def export_tensors(self, fp8: bool = True) -> dict[str, torch.Tensor]:
        """Every tensor under its official name, in the checkpoint dtypes (CPU)."""
        out: dict[str, torch.Tensor] = {}
        for name, p in self.named_parameters():
            if ".attn." not in name:
                out[name] = p.detach().to("cpu", torch.bfloat16).contiguous()
        for i, block in enumerate(self.layers):
            assert isinstance(block, TrainBlock)
            for name, t in export_attention_tensors(block.attn, fp8).items():
                out[f"layers.{i}.attn.{name}"] = t
        return out
