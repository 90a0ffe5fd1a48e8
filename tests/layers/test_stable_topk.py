"""The indexer's top-k equals the first k of a stable descending sort (values, indices, order),
ties, -inf (invisible entries) and all-tied rows included."""

from __future__ import annotations

import pytest
import torch

from dsv4.layers.indexer import stable_topk


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64))
def test_stable_topk_matches_a_stable_sort(dtype):
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        t = int(torch.randint(1, 9, (1,), generator=g))
        n = int(torch.randint(1, 300, (1,), generator=g))
        k = int(torch.randint(0, n + 1, (1,), generator=g))
        if trial % 3 == 0:  # few distinct values: many exact ties
            s = torch.randint(-3, 4, (t, n), generator=g).to(dtype)
        elif trial % 3 == 1:  # relu'd scores: a block of exact zeros
            s = torch.randn(t, n, generator=g, dtype=dtype).relu()
        else:
            s = torch.zeros(t, n, dtype=dtype)  # every entry tied
        s = s.masked_fill(torch.rand(t, n, generator=g) < 0.3, float("-inf"))
        v, i = s.sort(dim=-1, descending=True, stable=True)
        for sort_below in (0, n + 1):  # the selection, and the plain sort
            v2, i2 = stable_topk(s, k, sort_below=sort_below)
            assert torch.equal(v[:, :k], v2) and torch.equal(i[:, :k], i2), (trial, t, n, k)
