"""Greedy batched decoding through the attention caches.

Prompts are prefilled several at a time (one forward over their concatenated tokens, one cache
list per sequence, ``seq_lens``), then all unfinished sequences decode together, one token each
per step, through the model's decode runner (:meth:`TinyLM.decode_runner`: CUDA graphs per batch
bucket on a GPU, eager steps elsewhere), until ``<eos>`` or ``max_new_tokens``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dsv4.runner import DecodeRunner
from dsv4.tinylm.lm import TinyLM
from dsv4.tinylm.tokenizer import CharTokenizer


class PromptError(ValueError):
    """A prompt is empty, too long for the model, or holds characters it cannot encode."""


def prompt_name(index: int, count: int) -> str:
    """How messages name ``prompts[index]``: "prompt 1 of 2" (counted from 1)."""
    return f"prompt {index + 1} of {count}"


def encode_prompts(model: TinyLM, prompts: Sequence[str], max_new_tokens: int
                   ) -> list[list[int]]:
    """Token ids of each prompt (``<bos>`` first), checked; errors count prompts from 1 ("prompt
    2 of 3"), as a user counts the prompts they gave."""
    tok: CharTokenizer = model.cfg.tokenizer
    limit = model.cfg.max_seq_len
    out = []
    for i, p in enumerate(prompts):
        name = prompt_name(i, len(prompts))
        if not isinstance(p, str) or not p:
            raise PromptError(f"{name} is empty: give at least one character")
        try:
            ids = tok.encode(p, bos=True)
        except ValueError as e:
            raise PromptError(f"{name}: {e}") from e
        if len(ids) + max_new_tokens > limit:
            raise PromptError(f"{name} has {len(ids)} tokens (with <bos>); with "
                              f"max_new_tokens={max_new_tokens} that exceeds the model's "
                              f"max_position_embeddings={limit}")
        out.append(ids)
    return out


@dataclass
class DecodeStats:
    """What the decode steps of a generation did (prefill excluded)."""

    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    runner: dict[str, int] = field(default_factory=dict)
    """The runner's steps by kind (replays, captures, padded, eager)."""

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@torch.no_grad()
def generate_ids(model: TinyLM, prompts: Sequence[list[int]], max_new_tokens: int,
                 prefill_tokens: int = 4096, decode_batch: int | None = None,
                 runner: DecodeRunner | None = None, stats: DecodeStats | None = None
                 ) -> list[list[int]]:
    """Greedy continuations (without the prompt, ``<eos>`` included when produced).

    ``decode_batch``: at most this many sequences per decode step (``None``: all unfinished
    sequences in one step). Small batches are what a decode server runs. ``runner``: the decode
    steps' runner (default: ``model.decode_runner()``); ``stats``: filled with the decode
    steps' count, tokens and time."""
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be positive")
    if decode_batch is not None and decode_batch <= 0:
        raise ValueError(f"decode_batch={decode_batch} must be positive (or None: all at once)")
    dev = model.device
    eos = model.cfg.tokenizer.eos_id
    # one pool per layer: the decode steps then write, select and attend for all sequences at
    # once (sized for the longest prompt)
    caches = model.new_pooled_caches(len(prompts), max(map(len, prompts)) + max_new_tokens)
    outs: list[list[int]] = [[] for _ in prompts]
    nxt: list[int] = [0] * len(prompts)
    # prefill in groups of about ``prefill_tokens`` tokens
    start = 0
    while start < len(prompts):
        end, total = start, 0
        while end < len(prompts) and (end == start or total + len(prompts[end]) <= prefill_tokens):
            total += len(prompts[end])
            end += 1
        group = range(start, end)
        tokens = torch.tensor([t for i in group for t in prompts[i]], device=dev)
        pos = torch.cat([torch.arange(len(prompts[i])) for i in group]).to(dev)
        lens = [len(prompts[i]) for i in group]
        last = torch.tensor(lens).cumsum(0) - 1
        logits = model(tokens, pos, [caches[i] for i in group], lens, last.to(dev))
        for i, t in zip(group, logits.argmax(-1).tolist(), strict=True):
            nxt[i] = t
        start = end
    runner = runner or model.decode_runner()
    before = dict(runner.stats)
    t0 = time.perf_counter()
    decoded = steps = 0
    active = list(range(len(prompts)))
    for step in range(max_new_tokens):
        for i in active:
            outs[i].append(nxt[i])
        active = [i for i in active if nxt[i] != eos]
        if not active or step == max_new_tokens - 1:
            break
        size = decode_batch or len(active)
        for s in range(0, len(active), size):
            rows = active[s:s + size]
            tokens = torch.tensor([nxt[i] for i in rows], device=dev)
            logits = runner([caches[i] for i in rows], tokens)
            for i, t in zip(rows, logits.argmax(-1).tolist(), strict=True):
                nxt[i] = t
            decoded += len(rows)
            steps += 1
    if stats is not None:
        stats.steps += steps
        stats.tokens += decoded
        stats.seconds += time.perf_counter() - t0  # each step read its tokens back: all done
        stats.runner = {k: v - before.get(k, 0) for k, v in runner.stats.items()}
    return outs


def generate(model: TinyLM, prompts: Sequence[str], max_new_tokens: int = 8,
             stats: DecodeStats | None = None) -> list[str]:
    """Greedy text continuations of ``prompts`` (up to ``<eos>``); ``stats``: filled with the
    decode steps' count, tokens and time."""
    ids = encode_prompts(model, prompts, max_new_tokens)
    tok = model.cfg.tokenizer
    return [tok.decode(o) for o in generate_ids(model, ids, max_new_tokens, stats=stats)]
