"""execute_in_parallel / maybe_execute_in_parallel: upstream semantics (docs/upstream.md Part D)."""

from __future__ import annotations

import inspect

import pytest
import torch

from dsv4.parallel import execute_in_parallel, maybe_execute_in_parallel

from conftest import random_x


def test_defaults_match_upstream():
    assert inspect.signature(execute_in_parallel).parameters["enable"].default is False
    assert inspect.signature(maybe_execute_in_parallel).parameters["enable"].default is True


def test_sequential_fallback_order_and_none_slots():
    order = []

    def f(name, value):
        def run():
            order.append(name)
            return value
        return run

    result, aux = execute_in_parallel(f("default", 0), [f("a", 1), None, f("c", 3)], None,
                                      [None] * 3, aux_streams=None, enable=True)
    assert (result, aux, order) == (0, [1, None, 3], ["default", "a", "c"])
    order.clear()
    # streams given but not enabled: still sequential, same order
    result, aux = execute_in_parallel(f("default", 0), [f("a", 1)], None, [None],
                                      aux_streams=["s"], enable=False)
    assert (result, aux, order) == (0, [1], ["default", "a"])
    order.clear()
    assert maybe_execute_in_parallel(f("x", 1), f("y", 2), None, None) == (1, 2)
    assert order == ["x", "y"]


def test_layer_input_projections_take_the_sequential_path_on_cpu(tiny, make_layer):
    layer = make_layer(tiny, 4)
    assert layer.aux_streams is None
    x = random_x(5, tiny.hidden_size).bfloat16()
    qr_kv, kv_score, idx_kv_score, idx_w = layer._run_parallel_input_projections(x)
    assert qr_kv.shape == (5, 256) and qr_kv.dtype == torch.bfloat16
    assert kv_score.shape == (5, 512) and kv_score.dtype == torch.float32
    assert idx_kv_score.shape == (5, 512) and idx_kv_score.dtype == torch.float32
    assert idx_w.shape == (5, 8) and idx_w.dtype == torch.bfloat16
    swa = make_layer(tiny, 0)
    assert swa._run_parallel_input_projections(x)[1:] == (None, None, None)


@pytest.mark.cuda
def test_parallel_path_is_bitwise_identical_to_sequential():
    dev = torch.device("cuda")
    streams = [torch.cuda.Stream(dev) for _ in range(3)]
    start, done = torch.cuda.Event(), [torch.cuda.Event() for _ in range(3)]
    x = torch.randn(64, 4096, device=dev, dtype=torch.bfloat16)
    ws = [torch.randn(n, 4096, device=dev, dtype=torch.bfloat16) for n in (1536, 2048, 64, 512)]
    fns = [lambda w=w: x @ w.t() for w in ws[1:]]
    seq = execute_in_parallel(lambda: x @ ws[0].t(), fns, start, done, streams, enable=False)
    par = execute_in_parallel(lambda: x @ ws[0].t(), fns, start, done, streams, enable=True)
    torch.cuda.synchronize()
    assert torch.equal(seq[0], par[0])
    for a, b in zip(seq[1], par[1], strict=True):
        assert torch.equal(a, b)
    r0, r1 = maybe_execute_in_parallel(lambda: x @ ws[0].t(), lambda: x @ ws[1].t(), start,
                                       done[0], streams[0])
    torch.cuda.synchronize()
    assert torch.equal(r0, seq[0]) and torch.equal(r1, seq[1][0])
