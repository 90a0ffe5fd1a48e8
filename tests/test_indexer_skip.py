"""The C4 indexer is skipped in steps where it has no choice (``_indexer_decides``): no query sees
more than ``index_topk`` entries, so every query takes all it sees. Skipping must select the same
entries and give the same output as running the indexer."""

from __future__ import annotations

import pytest
import torch

from dsv4.testing.probes import record_selection, spy_methods

from conftest import random_x, rel_err


def _decode(layer, x, start):
    """Prefill ``start`` tokens, then decode the rest one token a step."""
    cache = layer.new_cache(x.shape[0])
    outs = [layer(x[:start], torch.arange(start), cache)]
    outs += [layer(x[i:i + 1], torch.tensor([i]), cache) for i in range(start, x.shape[0])]
    return torch.cat(outs)


def _entries(selection):
    """Per query, the set of selected entries (the -1 pads dropped)."""
    return [sorted(int(j) for j in row if j >= 0) for row in selection]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-13), (torch.bfloat16, 1e-2)])
def test_skipping_equals_running_the_indexer(tiny_exact, make_layer, monkeypatch, dtype, tol):
    k = tiny_exact.index_topk
    n = 4 * k + 12  # the last query sees k + 3 entries
    x = random_x(n, tiny_exact.hidden_size, seed=5).to(dtype)
    start = 4 * k - 12  # the prefill's queries see at most k - 3 entries: skipped
    layer = make_layer(tiny_exact, 4, dtype)
    with spy_methods(layer, ["_indexer_query", "_indexer_select"]) as calls, \
            record_selection(layer) as seen:
        skipped = _decode(layer, x, start)
    # a step at position p runs the indexer iff (p + 1) // 4 > k, i.e. p >= 4k + 3
    runs = n - (4 * k + 3)
    assert len(calls["_indexer_query"]) == len(calls["_indexer_select"]) == runs
    assert seen[0].shape == (start, k - 3)  # every visible entry, ascending, -1 after
    assert torch.equal(seen[0][-1], torch.arange(k - 3))
    # the same weights with the indexer forced on in every step (it takes all it sees)
    monkeypatch.setattr(type(layer), "_indexer_decides",
                        lambda self, step: self.indexer is not None)
    forced = make_layer(tiny_exact, 4, dtype)
    with record_selection(forced) as seen_forced:
        ran = _decode(forced, x, start)
    assert len(seen) == len(seen_forced)
    for a, b in zip(seen, seen_forced, strict=True):
        assert _entries(a) == _entries(b)
    assert rel_err(skipped, ran) < tol
