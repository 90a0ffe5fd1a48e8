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
    with pytest.raises(ValueError, match="k=8"):
        speculative_generate_ids(model, prompts, n, lambda i, t, k: [], 8)
