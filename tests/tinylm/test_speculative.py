"""Speculative decoding of the shipped tiny model: drafts from its own greedy run, corrupted at
random, verified k + 1 tokens a step through the decode runner and rolled back exactly - the
accepted tokens equal plain greedy decoding for every k and error rate."""

from __future__ import annotations

import pytest
import torch

from dsv4.tinylm.checkpoint import load_tiny_lm
from dsv4.tinylm.generate import generate_ids
from dsv4.tinylm.paths import default_model_dir
from dsv4.tinylm.speculative import (
    CorruptedOracle,
    SpeculativeStats,
    speculative_generate_ids,
)
from dsv4.tinylm.task import heldout_problems


@pytest.fixture(scope="module")
def model_and_greedy():
    model = load_tiny_lm(default_model_dir(), platform="reference", device="cpu",
                         dtype=torch.float32)
    tok = model.cfg.tokenizer
    prompts = [tok.encode(p.prompt, bos=True) for p in heldout_problems(12, model.cfg.task)]
    n = model.cfg.task.max_answer_tokens + 2
    return model, prompts, n, generate_ids(model, prompts, n)


@pytest.mark.parametrize("k,error", [(1, 0.0), (3, 0.3), (7, 0.2), (7, 1.0), (0, 0.0)])
def test_speculative_tokens_equal_greedy(model_and_greedy, k, error):
    model, prompts, n, greedy = model_and_greedy
    oracle = CorruptedOracle(prompts, greedy, model.cfg.vocab_size, error, seed=k)
    stats = SpeculativeStats()
    outs = speculative_generate_ids(model, prompts, n, oracle, k, stats=stats)
    assert outs == greedy
    if k and error == 0.0:
        assert stats.acceptance > 0.9 and stats.steps < n  # the drafts saved steps
    if error == 1.0:
        assert stats.accepted <= stats.drafted * 0.2


def test_through_the_runners_padded_steps(model_and_greedy):
    """The same through the runner's fixed-shape verify steps (what its CUDA graphs replay)."""
    model, prompts, n, greedy = model_and_greedy
    oracle = CorruptedOracle(prompts, greedy, model.cfg.vocab_size, 0.25, seed=5)
    runner = model.decode_runner(mode="padded")
    assert speculative_generate_ids(model, prompts, n, oracle, 4, runner=runner) == greedy
    assert runner.stats["padded"] > 0 and {key[1] for key in runner._buckets} & {2, 4, 8}


def test_bad_k_is_refused(model_and_greedy):
    model, prompts, n, greedy = model_and_greedy
    oracle = CorruptedOracle(prompts, greedy, model.cfg.vocab_size, 0.0)
    with pytest.raises(ValueError, match="k=8"):
        speculative_generate_ids(model, prompts, n, oracle, 8)


def test_the_mtp_layer_drafts_from_exact_caches():
    """The MTP drafter (random weights: the tiny model has no MTP head): its attention runs
    beside the main layers with its own caches, rolled back after each verify step and rebuilt
    from the main model's hidden states of the kept tokens. Every first draft's logits equal
    those of a fresh MTP layer fed all the true pairs (h_j, t_j+1) of the sequence so far
    (float64, to rounding), and the output is greedy decoding."""
    from dsv4.cache.plan import StepPlan
    from dsv4.tinylm.mtp import MTPDrafter, MTPLayer

    model = load_tiny_lm(default_model_dir(), platform="reference", device="cpu",
                         dtype=torch.float64)
    tok = model.cfg.tokenizer
    prompts = [tok.encode(p.prompt, bos=True) for p in heldout_problems(5, model.cfg.task)]
    n = model.cfg.task.max_answer_tokens + 2
    greedy = generate_ids(model, prompts, n)
    mtp = MTPLayer.random(model, seed=1)

    class Checked(MTPDrafter):
        """Records, for every proposal, the sequence so far and the first draft's logits."""

        history: dict[int, list[int]] = {}
        seen: list[tuple[list[int], torch.Tensor]] = []

        def prefill(self, i, tokens, hidden):
            self.history[i] = list(tokens)
            super().prefill(i, tokens, hidden)

        def accepted(self, i, tokens, hidden):
            self.history[i] += tokens
            super().accepted(i, tokens, hidden)

        def _step(self, plan, hidden, tokens):
            logits, h = super()._step(plan, hidden, tokens)
            self.steps.append(logits)
            return logits, h

        def propose(self, seqs, nxt, k):
            self.steps = []
            out = super().propose(seqs, nxt, k)
            self.seen += [(self.history[i] + [nxt[i]], self.steps[0][j])
                          for j, i in enumerate(seqs)]
            return out

    drafter = Checked(mtp)
    assert speculative_generate_ids(model, prompts, n, drafter, 3) == greedy
    assert len(drafter.seen) >= len(prompts)
    for tokens, logits in drafter.seen:
        # a fresh start: the main model's hidden states of t_0 .. t_L-1, then a fresh MTP cache
        # fed every pair (h_j, t_j+1); its last row is what the first draft saw
        main = model.new_pooled_caches(1, len(tokens) + 2)
        with StepPlan(main, [len(tokens) - 1]) as plan:
            h = model.hidden_states(torch.tensor(tokens[:-1]), plan)
        cache = [[mtp.block.attn.new_cache_pool(1, len(tokens) + 2).add_sequence()]]
        with StepPlan(cache, [len(tokens) - 1]) as plan:
            ref, _ = mtp(h, torch.tensor(tokens[1:]), plan)
        assert torch.allclose(logits, ref[-1], rtol=0, atol=1e-9)


def test_prompts_longer_than_one_step():
    """A prompt longer than the pools' step (``max_step_tokens``) prefills in several steps,
    as ``generate_ids`` does, in the main model and in the MTP drafter's caches; the loop gives
    the greedy tokens."""
    model = load_tiny_lm(default_model_dir(), platform="reference", device="cpu",
                         dtype=torch.float32, max_step_tokens=16)
    tok = model.cfg.tokenizer
    prompts = [tok.encode(p.prompt, bos=True) for p in heldout_problems(3, model.cfg.task)]
    assert min(map(len, prompts)) > 16
    n = model.cfg.task.max_answer_tokens
    greedy = generate_ids(model, prompts, n)
    oracle = CorruptedOracle(prompts, greedy, model.cfg.vocab_size, 0.3, seed=2)
    assert speculative_generate_ids(model, prompts, n, oracle, 3) == greedy
    from dsv4.tinylm.mtp import MTPDrafter, MTPLayer  # its prompt pairs in steps too

    drafter = MTPDrafter(MTPLayer.random(model, seed=1))
    assert speculative_generate_ids(model, prompts, n, drafter, 3) == greedy
