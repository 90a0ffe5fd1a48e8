"""The cuda platform on a GPU: fused input projections, graphs replay bit-identically to eager."""

from __future__ import annotations

import pytest
import torch

from dsv4 import process_weights_after_loading
from dsv4.platforms import build_attention
from dsv4.platforms.cuda import CudaAttention
from dsv4.testing.random_weights import random_layer_weights

from conftest import assert_decode_graph_equals_eager, random_x, rel_err

pytestmark = pytest.mark.cuda


def cuda_layer(cfg, ratio, plan=None, passes=None):
    lid = cfg.layer_of_ratio(ratio)
    layer = CudaAttention(cfg, lid, device="cuda", dtype=torch.bfloat16, plan=plan)
    layer.load_weights(random_layer_weights(cfg, lid, seed=1).items())
    process_weights_after_loading(layer, passes=passes)
    return layer


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_graph_replay_of_the_input_stage_is_bit_identical(tiny, ratio):
    layer = cuda_layer(tiny, ratio)
    assert layer._input_pack is not None
    for m in (1, 3, 16, 33):
        x = random_x(m, tiny.hidden_size).to("cuda", torch.bfloat16)
        graphed = layer._run_parallel_input_projections(x)
        again = layer._run_parallel_input_projections(x)
        # the graph runs the bucket's launch (a power of two >= m, tiles chosen for it): eager
        # on the same padded input must give the same bits
        bucket = 1 << (m - 1).bit_length()
        padded = torch.zeros(bucket, x.shape[1], dtype=x.dtype, device=x.device)
        padded[:m] = x
        fused = m <= layer.plan.fused_max_tokens
        stage = (layer._fused_input_projections_gemm if fused
                 else layer._stream_input_projections)
        eager = [None if e is None else e[:m] for e in stage(padded)]
        for g, a, e in zip(graphed, again, eager, strict=True):
            if e is None:
                assert g is None
                continue
            assert torch.equal(g, e) and torch.equal(a, e)


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_decode_with_graphs_equals_eager_and_reference(tiny, ratio):
    # the same plan with graphs off: every call runs the same strategy (the fused kernel and
    # the stream plan accumulate in different orders, so a 100-token call through each differs
    # in a few last bits on some inputs - a plan with a different fused_max_tokens is no "eager")
    graphed = cuda_layer(tiny, ratio)
    # the input stage's graphs against none; the whole-step graphs of plain decode calls
    # (padded steps: tests/platforms/test_runner_cuda.py) stay off on both sides
    graphed.use_step_graphs(0)
    eager = cuda_layer(tiny, ratio)
    eager.use_cuda_graphs(False)
    ref = build_attention(tiny, tiny.layer_of_ratio(ratio), device="cuda")
    ref.load_weights(random_layer_weights(tiny, ref.layer_id, seed=1).items())
    x = random_x(150, tiny.hidden_size).to("cuda", torch.bfloat16)
    outs = []
    for layer in (graphed, eager, ref):
        c = layer.new_cache(150)
        ys = [layer(x[:100], torch.arange(100, device="cuda"), c)]
        ys += [layer(x[i:i + 1], torch.tensor([i], device="cuda"), c) for i in range(100, 150)]
        outs.append(torch.cat(ys))
    assert torch.equal(outs[0], outs[1])
    assert rel_err(outs[0], outs[2]) < 1e-2


def test_unpacked_layers_use_the_stream_plan(tiny):
    layer = cuda_layer(tiny, 4, passes=["compressor_fusion"])
    assert layer._input_pack is None
    x = random_x(8, tiny.hidden_size).to("cuda", torch.bfloat16)
    a = layer._run_parallel_input_projections(x)
    b = layer._stream_input_projections(x)
    for u, v in zip(a, b, strict=True):
        assert torch.equal(u, v)


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_whole_decode_step_graph_replays_bit_identically(tiny, ratio):
    """A full-layer decode step of 3 sequences captured as one CUDA graph (CPU positions: no
    host syncs) replays exactly what eager execution computes."""
    layer = cuda_layer(tiny, ratio)
    caches = layer.new_caches(3, 64)
    for i, c in enumerate(caches):
        n = 20 + 9 * i
        layer(random_x(n, tiny.hidden_size).to("cuda", torch.bfloat16), torch.arange(n), c)
    x = random_x(3, tiny.hidden_size).to("cuda", torch.bfloat16)
    assert_decode_graph_equals_eager(layer, caches, x)
