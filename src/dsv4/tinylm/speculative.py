"""Greedy speculative decoding: draft k tokens, verify them in one step, keep the accepted ones.

Each step, every unfinished sequence brings its next token (decided by the step before) and up
to k drafted tokens after it; one forward over those 1 + k tokens per sequence (a verify step,
through the model's :class:`~dsv4.runner.DecodeRunner`: query buckets beside the batch buckets)
gives the model's own greedy choice after each of them. The drafts are accepted up to the first
that differs from the model's choice; the model's choice there is the bonus token. The caches
are truncated to the accepted tokens (:meth:`~dsv4.cache.pool.AttentionCache.truncate`: pools
made with ``max_rollback = k``), so the output is exactly plain greedy decoding whatever the
drafts - better drafts only make it take fewer steps.

A drafter is any callable ``drafter(i, tokens, k) -> list[int]``: up to k guesses of the tokens
after ``tokens`` (sequence i's prompt and output so far). DeepSeek-V4's own drafter is its MTP
layer (attention SWA-only, its own caches); the tiny model has none, so the tests draft from a
greedy run of the model corrupted at random positions (:class:`CorruptedOracle`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dsv4.cache.plan import truncate_sequences
from dsv4.runner import DecodeRunner
from dsv4.tinylm.lm import TinyLM

Drafter = Callable[[int, list[int], int], list[int]]


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

    def __init__(self, prompts: Sequence[list[int]], continuations: Sequence[list[int]],
                 vocab: int, error: float, seed: int = 0) -> None:
        self.prompts = [list(p) for p in prompts]
        self.continuations = [list(c) for c in continuations]
        self.vocab = vocab
        self.error = error
        self.rng = random.Random(seed)

    def __call__(self, i: int, tokens: list[int], k: int) -> list[int]:
        done = len(tokens) - len(self.prompts[i])
        truth = self.continuations[i][done:done + k]
        return [self.rng.randrange(self.vocab) if self.rng.random() < self.error else t
                for t in truth]


@torch.no_grad()
def speculative_generate_ids(model: TinyLM, prompts: Sequence[list[int]], max_new_tokens: int,
                             drafter: Drafter, k: int, runner: DecodeRunner | None = None,
                             stats: SpeculativeStats | None = None) -> list[list[int]]:
    """Greedy continuations of ``prompts`` (token ids, ``<bos>`` first) as
    :func:`dsv4.tinylm.generate.generate_ids` gives them, decoded speculatively with up to
    ``k`` drafted tokens per sequence and step (k in 0 .. 7)."""
    if not 0 <= k <= 7:
        raise ValueError(f"k={k}: drafts per step must be in 0 .. 7")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be positive")
    dev = model.device
    eos = model.cfg.tokenizer.eos_id
    caches = model.new_pooled_caches(len(prompts), max(map(len, prompts)) + max_new_tokens + k,
                                     max_rollback=max(1, k))
    runner = runner or model.decode_runner()
    stats = stats if stats is not None else SpeculativeStats()
    outs: list[list[int]] = [[] for _ in prompts]
    nxt = [0] * len(prompts)
    for i, p in enumerate(prompts):  # prefill, one sequence at a time
        tokens = torch.tensor(p, device=dev)
        logits = model(tokens, torch.arange(len(p)), [caches[i]], [len(p)],
                       torch.tensor([len(p) - 1], device=dev))
        nxt[i] = int(logits.argmax(-1))
    active = list(range(len(prompts)))
    while active:
        for i in active:  # the decided token joins the output (none after an accepted <eos>)
            if not outs[i] or outs[i][-1] != eos:
                outs[i].append(nxt[i])
        active = [i for i in active if outs[i][-1] != eos and len(outs[i]) < max_new_tokens]
        if not active:
            break
        drafts = {}
        for i in active:
            room = max_new_tokens - len(outs[i])  # no draft beyond the last token asked for
            limit = min(k, room - 1)
            drafts[i] = list(drafter(i, list(prompts[i]) + outs[i], limit))[:limit]
        lens = [1 + len(drafts[i]) for i in active]
        tokens = torch.tensor([t for i in active for t in [nxt[i], *drafts[i]]], device=dev)
        choice = runner([caches[i] for i in active], tokens, seq_lens=lens).argmax(-1).tolist()
        keep = []
        b = 0
        for i, n in zip(active, lens, strict=True):
            mine, d = choice[b:b + n], drafts[i]
            a = 0
            while a < len(d) and d[a] == mine[a]:
                a += 1
                if d[a - 1] == eos:  # the sequence ends with an accepted draft
                    break
            outs[i] += d[:a]  # the accepted drafts ...
            nxt[i] = mine[a]  # ... and the model's own choice after them
            keep.append(caches[i][0].length - (len(d) - a))
            stats.drafted += len(d)
            stats.accepted += a
            b += n
        truncate_sequences([caches[i] for i in active], keep)  # the rejected drafts go
        stats.steps += 1
    for o in outs:
        del o[max_new_tokens:]
    stats.tokens += sum(map(len, outs))
    return outs
