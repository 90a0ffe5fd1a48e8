"""Greedy speculative decoding: draft k tokens, verify them in one step, keep the accepted ones.

Each step, every unfinished sequence brings its next token (decided by the step before) and up
to k drafted tokens after it; one forward over those 1 + k tokens per sequence (a verify step,
through the model's :class:`~dsv4.runner.DecodeRunner`: query buckets beside the batch buckets)
gives the model's own greedy choice after each of them. The drafts are accepted up to the first
that differs from the model's choice; the model's choice there is the bonus token. The caches
are truncated to the accepted tokens (:func:`~dsv4.cache.plan.truncate_sequences`: pools made
with ``max_rollback = k``), so the output is exactly plain greedy decoding whatever the drafts -
better drafts only make it take fewer steps.

A drafter (:class:`Drafter`) is told each sequence's prompt and, after each verify step, the
tokens it kept, with the main model's hidden states when it asks for them (``needs_hidden``),
and proposes drafts. DeepSeek-V4's own drafter is its MTP layer (:mod:`dsv4.tinylm.mtp`: its
attention SWA-only, with its own caches beside the main layers'). The tiny model was trained
without one, so the tests also draft from a greedy run of the model corrupted at random
(:class:`CorruptedOracle`), which sets the acceptance.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from dsv4.cache.plan import truncate_sequences
from dsv4.runner import DecodeRunner
from dsv4.tinylm.lm import TinyLM


class Drafter(Protocol):
    """What the loop asks of a drafter (sequences by index into the prompts)."""

    needs_hidden: bool
    """Whether :meth:`prefill` and :meth:`accepted` need the main model's hidden states."""

    def begin(self, n: int, max_seq_len: int, k: int) -> None:
        """Room for ``n`` sequences of ``max_seq_len`` positions and drafts of up to ``k``."""

    def prefill(self, i: int, tokens: list[int], hidden: torch.Tensor | None) -> None:
        """Sequence i's prompt ``tokens`` (and the main model's hidden states of them)."""

    def propose(self, seqs: list[int], nxt: dict[int, int], k: int) -> dict[int, list[int]]:
        """``k`` drafts for each sequence of ``seqs`` after its decided next token ``nxt[i]``
        (the loop keeps as many as it has room for)."""

    def accepted(self, i: int, tokens: list[int], hidden: torch.Tensor | None) -> None:
        """After a verify step: the ``tokens`` sequence i kept (its fed next token, then the
        accepted drafts) and the main model's hidden states of them."""

    def finish(self, i: int) -> None:
        """Sequence i is done."""


@dataclass
class SpeculativeStats:
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    tokens: int = 0

    @property
    def acceptance(self) -> float:
        """Share of drafted tokens accepted."""
        return self.accepted / self.drafted if self.drafted else 0.0


class CorruptedOracle:
    """Drafts from known continuations (a greedy run of the model), each drafted token replaced
    by a random one with probability ``error`` (seeded): a stand-in for a real drafter whose
    acceptance the test controls."""

    needs_hidden = False

    def __init__(self, prompts: Sequence[list[int]], continuations: Sequence[list[int]],
                 vocab: int, error: float, seed: int = 0) -> None:
        self.prompts = [list(p) for p in prompts]
        self.continuations = [list(c) for c in continuations]
        self.vocab = vocab
        self.error = error
        self.rng = random.Random(seed)
        self.done = [0] * len(self.prompts)
        """Per sequence: tokens of its continuation the model has fed so far."""

    def begin(self, n: int, max_seq_len: int, k: int) -> None:
        pass

    def prefill(self, i: int, tokens: list[int], hidden: torch.Tensor | None) -> None:
        self.done[i] = 0

    def propose(self, seqs: list[int], nxt: dict[int, int], k: int) -> dict[int, list[int]]:
        out = {}
        for i in seqs:  # the continuation after nxt[i] (its token number done[i])
            truth = self.continuations[i][self.done[i] + 1:self.done[i] + 1 + k]
            out[i] = [self.rng.randrange(self.vocab) if self.rng.random() < self.error else t
                      for t in truth]
        return out

    def accepted(self, i: int, tokens: list[int], hidden: torch.Tensor | None) -> None:
        self.done[i] += len(tokens)

    def finish(self, i: int) -> None:
        pass


@torch.no_grad()
def speculative_generate_ids(model: TinyLM, prompts: Sequence[list[int]], max_new_tokens: int,
                             drafter: Drafter, k: int, runner: DecodeRunner | None = None,
                             stats: SpeculativeStats | None = None) -> list[list[int]]:
    """Greedy continuations of ``prompts`` (token ids, ``<bos>`` first) as
    :func:`dsv4.tinylm.generate.generate_ids` gives them, decoded speculatively with up to
    ``k`` drafted tokens per sequence and step (k in 0 .. 7). ``runner``: the verify steps'
    (default ``model.decode_runner(hidden=drafter.needs_hidden)``; with a drafter that needs
    hidden states, one that returns them)."""
    if not 0 <= k <= 7:
        raise ValueError(f"k={k}: drafts per step must be in 0 .. 7")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be positive")
    dev = model.device
    eos = model.cfg.tokenizer.eos_id
    max_len = max(map(len, prompts)) + max_new_tokens + k
    caches = model.new_pooled_caches(len(prompts), max_len, max_rollback=max(1, k))
    runner = runner or model.decode_runner(hidden=drafter.needs_hidden)
    stats = stats if stats is not None else SpeculativeStats()
    drafter.begin(len(prompts), max_len, k)
    outs: list[list[int]] = [[] for _ in prompts]
    nxt = [0] * len(prompts)
    for i, p in enumerate(prompts):  # prefill, one sequence at a time
        prompt_hidden = model.forward_hidden(torch.tensor(p, device=dev), torch.arange(len(p)),
                                             [caches[i]], [len(p)])
        nxt[i] = int(model._logits(prompt_hidden[-1:], None).argmax(-1))
        drafter.prefill(i, list(p), prompt_hidden if drafter.needs_hidden else None)
    active = list(range(len(prompts)))
    while active:
        for i in active:  # the decided token joins the output (none after an accepted <eos>)
            if not outs[i] or outs[i][-1] != eos:
                outs[i].append(nxt[i])
        ended = [i for i in active if outs[i][-1] == eos or len(outs[i]) >= max_new_tokens]
        for i in ended:
            drafter.finish(i)
        active = [i for i in active if i not in ended]
        if not active:
            break
        proposed = drafter.propose(active, {i: nxt[i] for i in active}, k)
        drafts = {}
        for i in active:  # no draft beyond the last token asked for
            drafts[i] = list(proposed.get(i, []))[:min(k, max_new_tokens - len(outs[i]) - 1)]
        lens = [1 + len(drafts[i]) for i in active]
        tokens = torch.tensor([t for i in active for t in [nxt[i], *drafts[i]]], device=dev)
        result = runner([caches[i] for i in active], tokens, seq_lens=lens)
        logits, hidden = (result if drafter.needs_hidden
                          else (result, None))  # type: tuple[torch.Tensor, torch.Tensor | None]
        choice = logits.argmax(-1).tolist()
        keep = []
        b = 0
        for i, n in zip(active, lens, strict=True):
            mine, d = choice[b:b + n], drafts[i]
            a = 0
            while a < len(d) and d[a] == mine[a]:
                a += 1
                if d[a - 1] == eos:  # the sequence ends with an accepted draft
                    break
            kept = [nxt[i], *d[:a]]
            outs[i] += d[:a]  # the accepted drafts ...
            nxt[i] = mine[a]  # ... and the model's own choice after them
            keep.append(caches[i][0].length - (len(d) - a))
            drafter.accepted(i, kept, None if hidden is None else hidden[b:b + a + 1])
            stats.drafted += len(d)
            stats.accepted += a
            b += n
        truncate_sequences([caches[i] for i in active], keep)  # the rejected drafts go
        stats.steps += 1
    for o in outs:
        del o[max_new_tokens:]
    stats.tokens += sum(map(len, outs))
    return outs
