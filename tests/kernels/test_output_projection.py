"""``wo_a`` then ``wo_b`` in one persistent launch (dsv4.kernels.output_projection): the two
launches' output bit for bit, launch after launch (the queue and counters reset themselves),
under Triton's interpreter on the CPU and on a GPU."""

from __future__ import annotations

import pytest
import torch

from dsv4.kernels.fp8_linear import choose_fp8_config, fp8_grouped_linear, fp8_linear
from dsv4.kernels.output_projection import MAX_TOKENS, fp8_output_projection

from conftest import KERNEL_DEV, kernel_runs

DEV = KERNEL_DEV
BF16 = torch.bfloat16


def _weight(n, k, seed, f32_scale=False):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 4).clamp(-448, 448).to(torch.float8_e4m3fn)
    e = torch.randint(110, 135, (n // 128, k // 128), generator=g).to(torch.uint8)
    s = (torch.pow(2.0, e.float() - 127) * (0.5 + torch.rand(e.shape, generator=g)) if f32_scale
         else e.view(torch.float8_e8m0fnu))
    return w.to(DEV), s.to(DEV)


def _two_launches(o, wa, sa, wb, sb, act, n_sm):
    """What the layer runs today: fp8_grouped_linear, then fp8_linear on its output."""
    M, G, Ka = o.shape
    z = fp8_grouped_linear(o, wa, sa, config=choose_fp8_config(M, wa.shape[0], Ka, n_sm))
    return fp8_linear(z.flatten(1), wb, sb,
                      config=choose_fp8_config(M, wb.shape[0], wb.shape[1], n_sm, act_fp8=act))


@kernel_runs
@pytest.mark.parametrize("M", [1, 5, MAX_TOKENS])
@pytest.mark.parametrize("act", [False, True])
@pytest.mark.parametrize("n_sm", [132, 3])  # K split in 4 and 7 / 1 and 2 pieces
def test_one_launch_equals_the_two(M, act, n_sm):
    G, R, Ka, N = 2, 256, 512, 384
    wa, sa = _weight(G * R, Ka, seed=1)
    wb, sb = _weight(N, G * R, seed=2, f32_scale=act)
    g = torch.Generator().manual_seed(M)
    for _ in range(2):  # the second launch finds the queue and counters reset
        o = torch.randn(M, G, Ka, generator=g).to(BF16).to(DEV)
        want = _two_launches(o, wa, sa, wb, sb, act, n_sm)
        got = fp8_output_projection(o, wa, sa, wb, sb, act_quant=act, n_sm=n_sm)
        assert got.dtype == BF16 and got.shape == (M, N)
        assert torch.equal(got, want)
        # without the L2 prefetch of wo_b's rows (a GPU's; the interpreter has none)
        assert torch.equal(fp8_output_projection(o, wa, sa, wb, sb, act_quant=act,
                                                 prefetch=False, n_sm=n_sm), want)


@kernel_runs
def test_counters_are_zero_after_a_launch():
    """Queue, exits, readiness and split-K counters back at zero: the state a CUDA graph
    replay, or the next layer's GEMMs sharing the workspace, expects."""
    from dsv4.kernels.fused_input_proj import SplitKWorkspace

    ws = SplitKWorkspace()
    wa, sa = _weight(4 * 128, 256, seed=3)
    wb, sb = _weight(256, 4 * 128, seed=4)
    o = torch.randn(3, 4, 256).to(BF16).to(DEV)
    fp8_output_projection(o, wa, sa, wb, sb, act_quant=True, n_sm=2, workspace=ws)
    assert ws.counters is not None and int(ws.counters.abs().sum()) == 0


def test_calls_it_cannot_take_run_the_two_launches():
    """Above MAX_TOKENS tokens (or where no kernel runs) the same product, by the two launches;
    bad shapes name what is wrong."""
    wa, sa = _weight(2 * 128, 256, seed=5)
    wb, sb = _weight(128, 2 * 128, seed=6)
    o = torch.randn(MAX_TOKENS + 3, 2, 256).to(BF16).to(DEV)
    got = fp8_output_projection(o, wa, sa, wb, sb, act_quant=True, n_sm=8)
    assert torch.equal(got, _two_launches(o, wa, sa, wb, sb, True, 8))
    with pytest.raises(ValueError, match="o must be bf16"):
        fp8_output_projection(o.float(), wa, sa, wb, sb)
    with pytest.raises(ValueError, match="wo_b must be"):
        fp8_output_projection(o, wa, sa, wb[:, :128].contiguous(), sb[:, :1].contiguous())
    with pytest.raises(ValueError, match="wo_a must be"):
        fp8_output_projection(o[:, :, :128].contiguous(), wa, sa, wb, sb)
