"""The multi-token-prediction (MTP) layer as a drafter: DeepSeek-V4's own way to draft tokens.

The MTP layer at index j takes the main model's last hidden state h_j (before its final norm)
and the embedding of token j + 1, and predicts token j + 2:
``x = eh_proj([enorm(embed(t_{j+1})) ; hnorm(h_j)])``, a decoder block (its attention is the
SWA-only layer ``layer_id = num_hidden_layers``, docs/spec.md §2, with its own caches), then the
main model's final norm and head. k drafts take k steps of it, each on the hidden state it
produced the step before.

Its caches run beside the main model's: index j of an MTP cache holds the pair (h_j, t_{j+1}).
Entries written while drafting used the MTP's own hidden states; after a verify step they are
rolled back (:meth:`~dsv4.cache.pool.AttentionCache.truncate`) and rewritten from the main
model's hidden states of the accepted tokens, as the serving engines do.

The shipped tiny model was trained without an MTP head: :meth:`MTPLayer.random` gives one with
random weights (its drafts are mostly rejected; the output is greedy decoding all the same).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv4.cache.plan import StepPlan, truncate_sequences
from dsv4.cache.pool import AttentionCache, CachePool
from dsv4.layers.norm import RMSNorm
from dsv4.platforms import build_attention
from dsv4.runner import DecodeRunner
from dsv4.testing.random_weights import random_layer_weights
from dsv4.tinylm.lm import Block, TinyLM, _Weight


class MTPLayer(nn.Module):
    """One MTP layer over a :class:`TinyLM` (whose embedding, final norm and head it shares)."""

    def __init__(self, model: TinyLM, block: Block) -> None:
        super().__init__()
        h, eps = model.cfg.hidden_size, model.cfg.attn.rms_norm_eps
        dtype, device = model.dtype, model.device
        self.enorm = RMSNorm(h, eps, dtype=dtype, device=device)
        self.hnorm = RMSNorm(h, eps, dtype=dtype, device=device)
        self.eh_proj = _Weight(h, 2 * h, dtype=dtype, device=device)
        self.block = block
        self._model = [model]  # not a submodule: its weights are the model's

    @property
    def model(self) -> TinyLM:
        return self._model[0]

    @classmethod
    @torch.no_grad()
    def random(cls, model: TinyLM, seed: int = 0, platform: str = "reference") -> MTPLayer:
        """An MTP layer with random weights for ``model`` (attention on ``platform``)."""
        acfg = model.cfg.attn
        layer_id = acfg.num_hidden_layers
        mcfg = acfg.replace(num_nextn_predict_layers=1,
                            compress_ratios=(*acfg.compress_ratios[:layer_id], 0))
        attn = build_attention(mcfg, layer_id, platform=platform, device=model.device,
                               dtype=model.dtype)
        attn.load_weights(random_layer_weights(mcfg, layer_id, seed=seed).items())
        from dsv4.passes import process_weights_after_loading

        process_weights_after_loading(attn)
        mtp = cls(model, Block(model.cfg, attn))
        g = torch.Generator().manual_seed(seed)
        for name, p in mtp.named_parameters():
            if ".attn." in name:
                continue
            if name.endswith("norm.weight"):
                p.copy_(torch.ones(p.shape))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        return mtp

    @torch.no_grad()
    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor, plan: StepPlan
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [T, vocab], the layer's hidden states [T, hidden]) for pairs (``hidden``
        [T, hidden], ``tokens`` [T]) of the plan's step."""
        m = self.model
        acc = torch.float64 if m.dtype == torch.float64 else torch.float32
        e = self.enorm(F.embedding(tokens, m.embed.weight), acc)
        x = F.linear(torch.cat((e, self.hnorm(hidden.to(m.dtype), acc)), dim=-1),
                     self.eh_proj.weight)
        x = self.block(x, plan=plan)
        return m._logits(x, None), x


class MTPDrafter:
    """Drafts with an :class:`MTPLayer` for :func:`dsv4.tinylm.speculative.speculative_generate_ids`
    (``needs_hidden``: the loop hands it the main model's hidden states)."""

    needs_hidden = True

    def __init__(self, mtp: MTPLayer, mode: str = "auto") -> None:
        self.mtp = mtp
        self.runner = DecodeRunner(self._step, mode=mode)
        self.caches: dict[int, list[AttentionCache]] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        """Per sequence: the main model's hidden state of its last fed token."""
        self.drafted: dict[int, int] = {}
        """Per sequence: MTP entries the last drafting wrote (rolled back at the accept)."""
        self.pool: CachePool | None = None

    def _step(self, plan: StepPlan, hidden: torch.Tensor, tokens: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mtp(hidden, tokens, plan)

    def begin(self, n: int, max_seq_len: int, k: int) -> None:
        """Room for ``n`` sequences of ``max_seq_len`` positions, drafts of up to ``k``."""
        self.pool = self.mtp.block.attn.new_cache_pool(n, max_seq_len, max_rollback=k + 1)

    def prefill(self, i: int, tokens: list[int], hidden: torch.Tensor) -> None:
        """Sequence i's prompt ``tokens`` and the main model's hidden states of them [P,
        hidden]: MTP indices 0 .. P - 2, the pairs (h_j, t_{j+1})."""
        assert self.pool is not None
        self.caches[i] = [self.pool.add_sequence()]
        self.drafted[i] = 0
        self._add_pairs(i, hidden[:-1], tokens[1:])
        self.hidden[i] = hidden[-1]

    def accepted(self, i: int, tokens: list[int], hidden: torch.Tensor) -> None:
        """After a verify step: the ``tokens`` it kept (the fed next token, then the accepted
        drafts) and the main model's hidden states of them. The entries drafting wrote (from
        the MTP's own hidden states) go; the pairs of the kept tokens come from the main
        model's: (h of the token before each, the token)."""
        cache = self.caches[i][0]
        truncate_sequences([self.caches[i]], [cache.length - self.drafted[i]])
        self.drafted[i] = 0
        self._add_pairs(i, torch.cat((self.hidden[i][None], hidden[:-1])), tokens)
        self.hidden[i] = hidden[-1]

    def _add_pairs(self, i: int, hidden: torch.Tensor, tokens: list[int]) -> None:
        """MTP indices for the pairs (hidden[j], tokens[j]), appended to sequence i's cache in
        steps of at most the pool's ``step_tokens`` (a long prompt's pairs take several)."""
        assert self.pool is not None
        step = self.pool.step_tokens
        for a in range(0, len(tokens), step):
            t = torch.tensor(tokens[a:a + step], device=hidden.device)
            with StepPlan([self.caches[i]], [t.numel()]) as plan:
                self.mtp(hidden[a:a + step], t, plan)

    def propose(self, seqs: list[int], nxt: dict[int, int], k: int) -> dict[int, list[int]]:
        """``k`` drafts for each sequence of ``seqs``, after its decided token ``nxt``."""
        drafts: dict[int, list[int]] = {i: [] for i in seqs}
        if k <= 0:
            return drafts
        dev = self.mtp.model.device
        hidden = torch.stack([self.hidden[i] for i in seqs])
        tokens = torch.tensor([nxt[i] for i in seqs], device=dev)
        for _ in range(k):
            logits, hidden = self.runner([self.caches[i] for i in seqs], hidden, tokens)
            tokens = logits.argmax(-1)
            for i, t in zip(seqs, tokens.tolist(), strict=True):
                drafts[i].append(t)
        for i in seqs:
            self.drafted[i] = k
        return drafts

    def finish(self, i: int) -> None:
        """Sequence i is done: its MTP cache goes back."""
        for c in self.caches.pop(i, []):
            c.free()
        self.hidden.pop(i, None)
        self.drafted.pop(i, None)
