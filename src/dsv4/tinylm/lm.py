"""The tiny DeepSeek-V4-architecture decoder LM for inference, around our attention layers.

token embedding -> blocks of (RMSNorm -> :class:`DeepseekV4Attention` -> residual -> RMSNorm ->
SwiGLU MLP -> residual) -> final RMSNorm -> ``lm_head``. The attention layers are the package's
inference layers, for any platform, with their caches. What the real model has and this one does
not: MoE (the MLP is one dense SwiGLU), hyper-connections (plain residuals), MTP layers.

A forward call takes any mix of sequences like the attention layer does: one cache list per
sequence, ``seq_lens`` tokens each (a prefill of several prompts, or a decode batch).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dsv4.attention import AttentionInputError, DeepseekV4Attention
from dsv4.cache.plan import StepPlan
from dsv4.cache.pool import AttentionCache
from dsv4.layers.norm import RMSNorm
from dsv4.runner import DecodeRunner
from dsv4.tinylm.config import TinyLMConfig


class _Weight(nn.Module):
    """A frozen tensor under the official ``*.weight`` name."""

    weight: nn.Parameter

    def __init__(self, *shape: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape, dtype=dtype, device=device),
                                   requires_grad=False)


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x): the dense stand-in for DeepSeek's MoE."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.w1 = _Weight(inter, hidden, dtype=dtype, device=device)
        self.w2 = _Weight(hidden, inter, dtype=dtype, device=device)
        self.w3 = _Weight(inter, hidden, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = self.w1.weight, self.w2.weight, self.w3.weight
        return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


class Block(nn.Module):
    def __init__(self, cfg: TinyLMConfig, attn: DeepseekV4Attention) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.attn.rms_norm_eps
        dtype, device = attn.dtype, attn.device
        self.attn_norm = RMSNorm(h, eps, dtype=dtype, device=device)
        self.attn = attn
        self.ffn_norm = RMSNorm(h, eps, dtype=dtype, device=device)
        self.ffn = SwiGLU(h, cfg.intermediate_size, dtype, device)
        self.acc = torch.float64 if dtype == torch.float64 else torch.float32

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                caches: list[AttentionCache] | None = None, seq_lens: Sequence[int] | None = None,
                *, plan: StepPlan | None = None) -> torch.Tensor:
        """The block on x; the attention takes its step from ``plan`` (a model's step) or plans
        its own from positions, caches and seq_lens."""
        h = self.attn_norm(x, self.acc)
        a = self.attn(h, plan=plan) if plan is not None else self.attn(h, positions, caches,
                                                                      seq_lens)
        x = x + a
        return x + self.ffn(self.ffn_norm(x, self.acc))


class TinyLM(nn.Module):
    """Built from already-loaded attention layers (see :func:`dsv4.tinylm.checkpoint.load_tiny_lm`);
    the other weights are filled by :meth:`load_lm_tensors`."""

    def __init__(self, cfg: TinyLMConfig, attention: Sequence[DeepseekV4Attention]) -> None:
        super().__init__()
        if len(attention) != cfg.num_layers:
            raise ValueError(f"{len(attention)} attention layers for {cfg.num_layers} blocks")
        self.cfg = cfg
        first = attention[0]
        self.dtype, h = first.dtype, cfg.hidden_size
        self.embed = _Weight(cfg.vocab_size, h, dtype=self.dtype, device=first.device)
        self.layers = nn.ModuleList(Block(cfg, a) for a in attention)
        self.norm = RMSNorm(h, cfg.attn.rms_norm_eps, dtype=self.dtype, device=first.device)
        self.head = _Weight(cfg.vocab_size, h, dtype=self.dtype, device=first.device)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def lm_tensor_names(self) -> list[str]:
        """Official names of the non-attention tensors."""
        return [n for n, _ in self.named_parameters() if ".attn." not in n]

    @torch.no_grad()
    def load_lm_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        params = {n: p for n, p in self.named_parameters() if ".attn." not in n}
        for name, p in params.items():
            p.copy_(tensors[name].to(device=p.device, dtype=p.dtype))

    def new_caches(self, max_seq_len: int) -> list[AttentionCache]:
        """One sequence's caches, one per layer."""
        return [block.attn.new_cache(max_seq_len) for block in self.blocks]

    def new_pooled_caches(self, n: int, max_seq_len: int, max_rollback: int = 1
                          ) -> list[list[AttentionCache]]:
        """``n`` sequences' caches (one list per sequence, one cache per layer), each layer's in
        one pool, so that decode batches of them run batched (``layer.new_caches``);
        ``max_rollback``: positions a sequence can be truncated back by (speculative decoding
        with k drafts: k)."""
        per_layer = [block.attn.new_caches(n, max_seq_len, max_rollback=max_rollback)
                     for block in self.blocks]
        return [[caches[s] for caches in per_layer] for s in range(n)]

    @property
    def blocks(self) -> list[Block]:
        return [b for b in self.layers if isinstance(b, Block)]

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor,
                caches: Sequence[list[AttentionCache]], seq_lens: Sequence[int],
                logit_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [R, vocab] (fp32; fp64 for a float64 model) of the rows ``logit_rows`` (default:
        all) of tokens [T]; ``caches[s]`` holds sequence s's per-layer caches, ``seq_lens[s]``
        its token count, ``positions`` [T] continue each sequence.

        A call that fits one step of every layer runs as one :class:`StepPlan` (its metadata
        built once for all layers; all layers or none advance); a longer one layer by layer,
        each splitting it into steps."""
        return self._logits(self.forward_hidden(tokens, positions, caches, seq_lens), logit_rows)

    @torch.no_grad()
    def forward_hidden(self, tokens: torch.Tensor, positions: torch.Tensor,
                       caches: Sequence[list[AttentionCache]], seq_lens: Sequence[int]
                       ) -> torch.Tensor:
        """The last block's output [T, hidden] of a :meth:`forward` call (before the final
        norm: what an MTP layer takes), run the way :meth:`forward` says."""
        if not caches or sum(seq_lens) > min(c.pool.step_tokens for c in caches[0]):
            x = F.embedding(tokens, self.embed.weight)
            for i, block in enumerate(self.blocks):
                x = block(x, positions, [c[i] for c in caches], seq_lens)
            return x
        plan = StepPlan(caches, seq_lens)
        try:
            _check_positions(positions, plan)
            x = self.hidden_states(tokens, plan)
        except BaseException:
            plan.rollback()
            raise
        plan.commit()
        return x

    @torch.no_grad()
    def hidden_states(self, tokens: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        """The last block's output [T, hidden] (before the final norm: what an MTP layer
        takes) for the step of ``plan`` (tokens [T], one per plan token): every block takes its
        attention step from the plan; the caller commits it."""
        x = F.embedding(tokens, self.embed.weight)
        for block in self.blocks:
            x = block(x, plan=plan)
        return x

    @torch.no_grad()
    def run_step(self, tokens: torch.Tensor, plan: StepPlan,
                 logit_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the step of ``plan`` (:meth:`hidden_states`): what :meth:`decode_runner`
        captures."""
        return self._logits(self.hidden_states(tokens, plan), logit_rows)

    def run_step_with_hidden(self, tokens: torch.Tensor, plan: StepPlan
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, hidden states) of the step of ``plan``."""
        x = self.hidden_states(tokens, plan)
        return self._logits(x, None), x

    def decode_runner(self, hidden: bool = False, **kwargs: Any) -> DecodeRunner:
        """A :class:`~dsv4.runner.DecodeRunner` of this model's decode step:
        ``runner(caches, tokens)`` -> logits [M, vocab] (with ``hidden``: (logits, hidden
        states)); CUDA graphs per batch bucket on a GPU; ``kwargs``: ``mode``, ``buckets``,
        ``query_buckets``."""
        if hidden:
            return DecodeRunner(lambda plan, tokens: self.run_step_with_hidden(tokens, plan),
                                **kwargs)
        return DecodeRunner(lambda plan, tokens: self.run_step(tokens, plan), **kwargs)

    def _logits(self, x: torch.Tensor, logit_rows: torch.Tensor | None) -> torch.Tensor:
        if logit_rows is not None:
            x = x[logit_rows]
        acc = torch.float64 if self.dtype == torch.float64 else torch.float32
        logits = F.linear(self.norm(x, acc), self.head.weight)
        return logits.to(torch.float64 if self.dtype == torch.float64 else torch.float32)


def _check_positions(positions: torch.Tensor, plan: StepPlan) -> None:
    """``positions`` continue each sequence of the plan (read once on the host, not per layer)."""
    got = positions.detach().to("cpu", torch.long)
    if got.shape != (sum(plan.seq_lens),):
        raise AttentionInputError(f"positions has shape {tuple(got.shape)}; expected "
                                  f"[{sum(plan.seq_lens)}] (one per token)")
    b = 0
    for i, (a, n) in enumerate(zip(plan.starts, plan.seq_lens, strict=True)):
        want = torch.arange(a, a + n)
        if not torch.equal(got[b:b + n], want):
            raise AttentionInputError(
                f"positions of sequence {i} are {got[b:b + n].tolist()[:6]} but its caches hold "
                f"{a} tokens: they must continue them as {want.tolist()[:6]}")
        b += n
