"""The layer against the naive float64 evaluation (dsv4.testing.naive_reference, separate code).

Every layer type (ratio 0, 4, 128), prefill, chunked prefill (chunk sizes that straddle the window
of 16 and the ratio-4 / ratio-128 block boundaries) and token-by-token decode, on fresh random
inputs. float64 layer: relative Frobenius error <= 1e-10; bf16 layer: <= 1e-2.
"""

from __future__ import annotations

import pytest
import torch

from dsv4.testing.naive_reference import naive_attention_forward
from dsv4.testing.probes import record_selection, stack_selections
from dsv4.testing.random_weights import random_layer_weights

from conftest import RATIOS, random_x, rel_err

T = 300  # > 2 * 128: two ratio-128 entries, 75 ratio-4 entries for a top-8, window 16


def run_chunks(layer, x, chunks):
    cache = layer.new_cache(x.shape[0])
    outs, s = [], 0
    for n in chunks:
        outs.append(layer(x[s:s + n], torch.arange(s, s + n), cache))
        s += n
    assert cache.length == x.shape[0]
    return torch.cat(outs)


def chunk_plan(mode: str, t: int) -> list[int]:
    if mode == "prefill":
        return [t]
    if mode == "decode":
        return [1] * t
    if mode == "chunked":  # 15, 17, 3, 129, ... : boundaries land inside windows and blocks
        sizes, cycle, i = [], [15, 17, 3, 129, 1, 64], 0
        while sum(sizes) < t:
            sizes.append(min(cycle[i % len(cycle)], t - sum(sizes)))
            i += 1
        return sizes
    if mode == "prefill+decode":
        return [131] + [1] * (t - 131)
    raise AssertionError(mode)


MODES = ("prefill", "chunked", "decode", "prefill+decode")


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("dtype,bound", [(torch.float64, 1e-10), (torch.bfloat16, 1e-2)])
def test_layer_matches_naive_float64(tiny_exact, make_layer, ratio, dtype, bound):
    """For bf16 ratio-4 layers the reference uses the layer's own top-k selection (which may
    differ from float64's at near ties: test_bf16_ratio4_topk_differs_only_at_near_ties)."""
    layer = make_layer(tiny_exact, ratio, dtype)
    x = random_x(T, tiny_exact.hidden_size)
    weights = random_layer_weights(tiny_exact, layer.layer_id, 0)
    ref = naive_attention_forward(tiny_exact, layer.layer_id, weights, x)
    for mode in MODES:
        if ratio == 4 and dtype != torch.float64:
            y, sel = _run_recording(layer, x.to(dtype), chunk_plan(mode, T))
            ref = naive_attention_forward(tiny_exact, layer.layer_id, weights, x,
                                          forced_selection=sel)
        else:
            y = run_chunks(layer, x.to(dtype), chunk_plan(mode, T))
        assert y.dtype == dtype and y.shape == ref.shape
        err = rel_err(y, ref)
        assert err <= bound, f"ratio {ratio} {dtype} {mode}: rel err {err:.3e} > {bound}"


def _run_recording(layer, x, chunks):
    """run_chunks, also returning the compressed selection each query received."""
    with record_selection(layer) as seen:
        y = run_chunks(layer, x, chunks)
    return y, stack_selections(seen)


@pytest.mark.parametrize("ratio", RATIOS)
def test_simulated_numerics_close_to_exact(tiny, tiny_exact, make_layer, ratio):
    """The official FP8 (kv) simulation perturbs the output a little; the FP4 indexer simulation
    changes some top-k picks but keeps most of them."""
    x = random_x(T, tiny.hidden_size)
    sim_layer = make_layer(tiny, ratio, torch.float64)
    sim, sel = _selections(sim_layer, x)
    weights = random_layer_weights(tiny, sim_layer.layer_id, 0)
    forced = sel if ratio == 4 else None
    exact = naive_attention_forward(tiny_exact, sim_layer.layer_id, weights, x,
                                    forced_selection=forced)
    err = rel_err(sim, exact)
    assert 1e-4 < err < 5e-2, f"the kv FP8 simulation changed the output by {err:.3e}"
    if ratio == 4:
        _, sel_exact = _selections(make_layer(tiny_exact, 4, torch.float64), x)
        picked = (sel >= 0).sum().item()
        same = sum(len(set(a[a >= 0].tolist()) & set(b[b >= 0].tolist()))
                   for a, b in zip(sel, sel_exact, strict=True))
        assert 0.5 < same / picked < 1.0, f"FP4 indexer kept {same}/{picked} picks"


@pytest.mark.parametrize("ratio", RATIOS)
def test_decode_batch_equals_separate_sequences(tiny, make_layer, ratio):
    """Several sequences in one call (decode batch and mixed chunk lengths) == one call each."""
    layer = make_layer(tiny, ratio, torch.float64)
    lens = [40, 133, 7]
    xs = [random_x(n + 3, tiny.hidden_size) for n in lens]
    solo_caches = [layer.new_cache(200) for _ in lens]
    batch_caches = [layer.new_cache(200) for _ in lens]
    for x, n, c, b in zip(xs, lens, solo_caches, batch_caches, strict=True):
        layer(x[:n], torch.arange(n), c)
        layer(x[:n], torch.arange(n), b)
    # one decode step for every sequence, then a mixed step (2, 1, 0-free) in one call each
    solo = [layer(x[n:n + 1], torch.tensor([n]), c)
            for x, n, c in zip(xs, lens, solo_caches, strict=True)]
    batch = layer(torch.cat([x[n:n + 1] for x, n in zip(xs, lens, strict=True)]),
                  torch.tensor(lens), batch_caches)
    assert rel_err(batch, torch.cat(solo)) < 1e-12  # GEMM row count changes rounding only
    solo2 = [layer(x[n + 1:n + 3], torch.tensor([n + 1, n + 2]), c)
             for x, n, c in zip(xs, lens, solo_caches, strict=True)]
    batch2 = layer(torch.cat([x[n + 1:n + 3] for x, n in zip(xs, lens, strict=True)]),
                   torch.cat([torch.tensor([n + 1, n + 2]) for n in lens]), batch_caches,
                   seq_lens=[2, 2, 2])
    assert rel_err(batch2, torch.cat(solo2)) < 1e-12


def _selections(layer, x):
    """A prefill, and the compressed selection each query received."""
    return _run_recording(layer, x, [x.shape[0]])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bf16_ratio4_topk_differs_only_at_near_ties(tiny_exact, make_layer, seed):
    """A bf16 indexer may pick differently from float64 only where scores nearly tie; with its
    own selection forced into the float64 evaluation, the bf16 output is within 1e-2."""
    layer = make_layer(tiny_exact, 4, torch.bfloat16, seed=seed)
    x = random_x(T, tiny_exact.hidden_size)
    weights = random_layer_weights(tiny_exact, layer.layer_id, seed)
    scores: dict[int, torch.Tensor] = {}
    ref = naive_attention_forward(tiny_exact, layer.layer_id, weights, x, index_scores_out=scores)
    y, sel = _selections(layer, x.bfloat16())
    for p, s in scores.items():
        k = min(tiny_exact.index_topk, s.numel())
        ours = set(sel[p][sel[p] >= 0].tolist())
        assert len(ours) == k
        kth = torch.sort(s, descending=True, stable=True).values[k - 1]
        theirs = set(torch.sort(s, descending=True, stable=True).indices[:k].tolist())
        for j in ours ^ theirs:  # every disagreement sits next to the top-k boundary
            gap = abs(float(s[j] - kth))
            assert gap <= 0.02 * float(s.abs().max()), f"p={p} entry {j}: gap {gap:.3e}"
    forced = naive_attention_forward(tiny_exact, layer.layer_id, weights, x,
                                     forced_selection=sel)
    assert rel_err(y, forced) <= 1e-2
    # the forced evaluation with float64's own selection is the plain one
    _, sel64 = _selections(make_layer(tiny_exact, 4, torch.float64, seed=seed), x)
    assert rel_err(naive_attention_forward(tiny_exact, layer.layer_id, weights, x,
                                           forced_selection=sel64), ref) < 1e-14
