"""Fused decode input projections: packing and reference on CPU; the Triton kernel on a GPU (and
small cases under Triton's CPU interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from dsv4.kernels.fused_input_proj import (
    KernelConfig,
    PackedInputWeights,
    SplitKWorkspace,
    choose_config,
    fused_input_projections,
    fused_input_projections_as_modules,
    fused_input_projections_reference,
    pack_input_weights,
    segment_views,
    triton_available,
)
from dsv4.runner import capture_graph

from conftest import KERNEL_DEV, kernel_runs

BF16, F32 = torch.bfloat16, torch.float32


def _segments(layer: str, n_wqa: int, K: int, *, fp8: bool = False, device="cpu", seed=0,
              pow2: bool = True):
    g = torch.Generator(device=device).manual_seed(seed)

    def w(rows):
        return (torch.randn(rows, K, generator=g, device=device) * 0.02).to(BF16)

    if fp8:
        q = (torch.randn(n_wqa, K, generator=g, device=device) * 2).to(torch.float8_e4m3fn)
        e = torch.randint(-9, -5, (n_wqa // 128, K // 128), generator=g, device=device)
        scale = torch.pow(2.0, e.float())
        if not pow2:  # general fp32 scales: the kernel scales each block product instead
            scale = scale * (0.5 + torch.rand(scale.shape, generator=g, device=device))
        first = ("wqa_wkv", (q, scale), BF16)
    else:
        first = ("wqa_wkv", w(n_wqa), BF16)
    segs = [first]
    if layer == "C4":
        segs += [("compressor", w(2048), F32), ("idx_compressor", w(512), F32),
                 ("idx_weights", w(64), BF16)]
    elif layer == "C128":
        segs += [("compressor", w(1024), F32)]
    return segs


def _float64_eval(x: torch.Tensor, packed: PackedInputWeights) -> list[torch.Tensor]:
    xd = x.double()
    views = segment_views(packed)
    outs = []
    for i, seg in enumerate(packed.segments):
        if i == 0 and packed.fp8_weight is not None:
            s = packed.fp8_scale.double()
            s = s.repeat_interleave(128, 0).repeat_interleave(128, 1)
            w = packed.fp8_weight.double() * s
        else:
            w = views[seg.name].double()
        outs.append(xd @ w.t())
    return outs


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


TOL = {BF16: 1e-2, F32: 1e-5}


# ---------------------------------------------------------------------------------- CPU


def test_pack_views_share_storage_and_offsets():
    segs = _segments("C4", 256, 128)
    p = pack_input_weights(segs)
    assert p.weight.shape == (256 + 2048 + 512 + 64, 128) and p.weight.is_contiguous()
    assert [s.name for s in p.segments] == ["wqa_wkv", "compressor", "idx_compressor",
                                           "idx_weights"]
    assert [s.out_dtype for s in p.segments] == [BF16, F32, F32, BF16]
    views = segment_views(p)
    row = 0
    for name, w, _ in segs:
        v = views[name]
        assert v.untyped_storage().data_ptr() == p.weight.untyped_storage().data_ptr()
        assert v.storage_offset() == row * 128
        assert torch.equal(v, w)
        row += w.shape[0]
    # a write through the packed buffer shows in the view: they alias
    p.weight[256, 0] = 7.0
    assert views["compressor"][0, 0].item() == 7.0


def test_views_support_param_set_():
    segs = _segments("C128", 128, 64)
    p = pack_input_weights(segs)
    params = {n: torch.nn.Parameter(w.clone(), requires_grad=False) for n, w, _ in segs}
    with torch.no_grad():
        for n, v in segment_views(p).items():
            params[n].set_(v)
    for n, w, _ in segs:
        assert torch.equal(params[n], w)
        assert params[n].untyped_storage().data_ptr() == p.weight.untyped_storage().data_ptr()


def test_fp8_pack_keeps_leading_segment_fp8():
    segs = _segments("C4", 256, 256, fp8=True)
    p = pack_input_weights(segs)
    assert p.fp8_weight.dtype == torch.float8_e4m3fn and p.fp8_scale.dtype == F32
    assert p.n_fp8 == 256 and p.n_bf16 == 2048 + 512 + 64
    assert "wqa_wkv" not in segment_views(p)
    assert segment_views(p)["compressor"].storage_offset() == 0
    assert p.fp8_scale_pow2
    assert not pack_input_weights(_segments("SWA", 256, 256, fp8=True, pow2=False)).fp8_scale_pow2


@pytest.mark.parametrize("layer", ["C4", "C128", "SWA"])
@pytest.mark.parametrize("fp8", [False, True])
def test_reference_matches_float64(layer, fp8):
    p = pack_input_weights(_segments(layer, 256, 256, fp8=fp8))
    x = torch.randn(5, 256).to(BF16)
    got = fused_input_projections_reference(x, p)
    want = _float64_eval(x, p)
    assert len(got) == len(p.segments)
    for g, w, seg in zip(got, want, p.segments, strict=True):
        assert g.dtype == seg.out_dtype and g.shape == (5, seg.rows)
        assert _rel(g, w) < TOL[seg.out_dtype]


@pytest.mark.parametrize("fp8", [False, True])
def test_cpu_call_computes_as_the_modules_and_fills_out(fp8):
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("interpreter mode runs the kernel on CPU")
    p = pack_input_weights(_segments("C4", 128, 128, fp8=fp8))
    x = torch.randn(3, 128).to(BF16)
    out = [torch.full((3, s.rows), float("nan"), dtype=s.out_dtype) for s in p.segments]
    res = fused_input_projections(x, p, out)
    assert all(r is o for r, o in zip(res, out, strict=True))
    for o, m, r, seg in zip(out, fused_input_projections_as_modules(x, p),
                            fused_input_projections_reference(x, p), p.segments, strict=True):
        assert torch.equal(o, m)
        assert _rel(o, r) < TOL[seg.out_dtype]
    assert [o.shape[0] for o in fused_input_projections(x[:0], p)] == [0] * 4


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="K="):
        pack_input_weights([("a", torch.zeros(4, 8), BF16), ("b", torch.zeros(4, 16), F32)])
    with pytest.raises(ValueError, match="only the first"):
        q = torch.zeros(128, 128, dtype=torch.float8_e4m3fn)
        pack_input_weights([("a", torch.zeros(4, 128), BF16), ("b", (q, torch.ones(1, 1)), BF16)])
    with pytest.raises(ValueError, match="out_dtype"):
        pack_input_weights([("a", torch.zeros(4, 8), torch.float16)])
    p = pack_input_weights([("a", torch.zeros(4, 8), BF16)])
    with pytest.raises(ValueError, match="x must be"):
        fused_input_projections(torch.zeros(2, 9, dtype=BF16), p)
    with pytest.raises(ValueError, match="expected"):
        fused_input_projections(torch.zeros(2, 8, dtype=BF16), p, [torch.zeros(2, 4)])


def test_choose_config_fills_the_machine():
    p = pack_input_weights(_segments("C4", 1536, 4096))
    for M in (1, 4, 16, 32, 64, 128, 256):
        c = choose_config(M, p, n_sm=132)
        assert c.block_m >= min(M, 16) and 4096 % c.block_k == 0


# ---------------------------------------------------------------------------------- GPU

cuda = pytest.mark.cuda
needs_kernel = pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()),
                                  reason="needs a CUDA GPU and Triton")

SHAPES = {"flash": (4096, 1536), "pro": (7168, 2048)}


def _check(x, p, out):
    for o, w, seg in zip(out, _float64_eval(x, p), p.segments, strict=True):
        assert o.dtype == seg.out_dtype and o.shape == (x.shape[0], seg.rows)
        assert torch.isfinite(o).all(), f"{seg.name}: unwritten or non-finite elements"
        err = _rel(o, w)
        assert err < TOL[seg.out_dtype], f"{seg.name}: rel err {err:.2e}"


@cuda
@needs_kernel
@pytest.mark.parametrize("model", ["flash", "pro"])
@pytest.mark.parametrize("layer", ["C4", "C128", "SWA"])
@pytest.mark.parametrize("fp8", [False, True])
def test_kernel_matches_float64(model, layer, fp8):
    K, n_wqa = SHAPES[model]
    p = pack_input_weights(_segments(layer, n_wqa, K, fp8=fp8, device="cuda"))
    for M in (1, 3, 7, 13, 16, 33, 64, 100, 300):
        x = torch.randn(M, K, device="cuda").to(BF16)
        out = [torch.full((M, s.rows), float("nan"), device="cuda", dtype=s.out_dtype)
               for s in p.segments]
        fused_input_projections(x, p, out)
        _check(x, p, out)


@cuda
@needs_kernel
@pytest.mark.parametrize("cfg", [
    KernelConfig(block_m=16, block_n=16, split_k=1),
    KernelConfig(block_m=16, block_n=64, split_k=4),
    KernelConfig(block_m=16, block_n=64, split_k=7, num_stages=2, swap=False),
    KernelConfig(block_m=16, block_n=64, split_k=3, groups=70),  # ragged groups and splits
    KernelConfig(block_m=16, block_n=128, split_k=8),  # ragged: 33 groups of 126-127 rows
    KernelConfig(block_m=16, block_n=32, block_n8=32, split_k=4),
    KernelConfig(block_m=64, block_n=64, split_k=2, swap=False),
    KernelConfig(block_m=128, block_n=64, split_k=1, num_warps=8, num_stages=3, swap=False),
])
@pytest.mark.parametrize("fp8", [False, True, "general-scales"])
def test_kernel_configs(cfg, fp8):
    K, n_wqa = SHAPES["flash"]
    p = pack_input_weights(_segments("C4", n_wqa, K, fp8=bool(fp8), device="cuda", seed=3,
                                     pow2=fp8 is True))
    for M in (1, 5, 70):
        x = torch.randn(M, K, device="cuda").to(BF16)
        _check(x, p, fused_input_projections(x, p, config=cfg))


@cuda
@needs_kernel
def test_cublas_path_bf16_only():
    K, n_wqa = SHAPES["flash"]
    p = pack_input_weights(_segments("C4", n_wqa, K, device="cuda"))
    for M in (1, 77):
        x = torch.randn(M, K, device="cuda").to(BF16)
        _check(x, p, fused_input_projections(x, p, config=KernelConfig(cublas=True)))
    p8 = pack_input_weights(_segments("C4", n_wqa, K, fp8=True, device="cuda"))
    with pytest.raises(ValueError, match="cuBLAS"):
        fused_input_projections(x, p8, config=KernelConfig(cublas=True))


@cuda
@needs_kernel
def test_strided_x_and_out_views():
    K, n_wqa = SHAPES["flash"]
    p = pack_input_weights(_segments("C4", n_wqa, K, device="cuda"))
    big = torch.randn(9, 2 * K, device="cuda").to(BF16)
    x = big[:, :K]
    buf = torch.full((9, 4096), float("nan"), device="cuda")
    out = [torch.empty(9, n_wqa, device="cuda", dtype=BF16), buf[:, :2048], buf[:, 2048:2560],
           torch.empty(9, 64, device="cuda", dtype=BF16)]
    fused_input_projections(x, p, out)
    _check(x, p, out)
    assert torch.isnan(buf[:, 2560:]).all()  # nothing written outside the views


@cuda
@needs_kernel
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("M", [1, 4, 16, 64, 256])
def test_graph_replay_equals_eager_bitwise(fp8, M):
    K, n_wqa = SHAPES["pro"]
    p = pack_input_weights(_segments("C4", n_wqa, K, fp8=fp8, device="cuda", seed=5))
    x = torch.randn(M, K, device="cuda").to(BF16)
    ws = SplitKWorkspace()
    eager = [o.clone() for o in fused_input_projections(x, p, workspace=ws)]
    again = fused_input_projections(x, p, workspace=ws)
    assert all(torch.equal(a, b) for a, b in zip(eager, again, strict=True))  # deterministic
    out = [torch.empty_like(o) for o in eager]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fused_input_projections(x, p, out, workspace=ws)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with capture_graph(g):
        fused_input_projections(x, p, out, workspace=ws)
    for o in out:
        o.fill_(float("nan"))
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(eager, out, strict=True))
    # replay sees new inputs written into the captured buffer
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    _check(x, p, out)


@cuda
@needs_kernel
def test_pdl_launch_matches():
    K, n_wqa = SHAPES["flash"]
    p = pack_input_weights(_segments("C4", n_wqa, K, fp8=True, device="cuda"))
    x = torch.randn(4, K, device="cuda").to(BF16)
    base = choose_config(4, p)
    a = fused_input_projections(x, p, config=base)
    for pf in (0, 512):
        cfg = KernelConfig(**{**base.__dict__, "pdl": True, "prefetch": pf})
        b = fused_input_projections(x, p, config=cfg)
        assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))


# ---------------------------------------------------------------------------------- interpreter

_INTERP_SCRIPT = textwrap.dedent("""
    import os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"
    import triton, triton.language as tl

    @triton.jit
    def _probe(a, b, o):
        r = tl.arange(0, 16)
        acc = tl.dot(tl.load(a + r[:, None] * 16 + r[None, :]),
                     tl.load(b + r[:, None] * 16 + r[None, :]))
        tl.store(o + r[:, None] * 16 + r[None, :], acc)

    a, b, o = torch.randn(16, 16).bfloat16(), torch.randn(16, 16).bfloat16(), torch.zeros(16, 16)
    try:
        _probe[(1,)](a, b, o)
    except Exception as ex:
        print("SKIP interpreter cannot run a probe kernel:", repr(ex)[:200]); sys.exit(0)
    if not torch.allclose(o, a.float() @ b.float(), atol=1e-3):
        print("SKIP interpreter mis-computes a bf16 dot on this install"); sys.exit(0)
    from dsv4.kernels.fused_input_proj import *
    from dsv4.kernels.fused_input_proj import _interpreting
    assert _interpreting()
    K = 256
    g = torch.Generator().manual_seed(0)
    segs = [("a", (torch.randn(128, K, generator=g) * 0.1).bfloat16(), torch.bfloat16),
            ("b", (torch.randn(96, K, generator=g) * 0.1).bfloat16(), torch.float32),
            ("c", (torch.randn(16, K, generator=g) * 0.1).bfloat16(), torch.bfloat16)]
    q = (torch.randn(128, K, generator=g) * 2).to(torch.float8_e4m3fn)
    p8 = pack_input_weights([("a", (q, torch.tensor([[0.01, 0.02]])), torch.bfloat16)] + segs[1:])
    for p in (pack_input_weights(segs), p8):
        for M, cfg in ((3, KernelConfig(block_m=16, block_n=32, split_k=1)),
                       (5, KernelConfig(block_m=16, block_n=32, split_k=2, groups=7)),
                       (20, KernelConfig(block_m=16, block_n=64, split_k=2, swap=False))):
            x = torch.randn(M, K, generator=g).bfloat16()
            out = fused_input_projections(x, p, config=cfg)
            for o, r in zip(out, fused_input_projections_reference(x, p)):
                err = ((o.double() - r.double()).norm() / r.double().norm()).item()
                assert err < 1e-2, (M, cfg, err)
    print("OK")
""")


def test_triton_interpreter_tiny_shapes():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(src), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", _INTERP_SCRIPT], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    if r.stdout.strip().startswith("SKIP"):
        pytest.skip(r.stdout.strip()[5:])
    assert r.stdout.strip().endswith("OK")


# ------------------------------------------------- act_quant (docs/spec.md §6.3): any device
@kernel_runs
@pytest.mark.parametrize("cfg", [KernelConfig(block_m=16, block_n=32, split_k=2),
                                 KernelConfig(block_m=16, block_n=64, split_k=1, swap=False),
                                 KernelConfig(block_m=16, block_n=64, block_n8=64, split_k=1)])
@pytest.mark.parametrize("pow2", [True, False])
def test_act_quant_quantises_the_fp8_segment_only(cfg, pow2):
    """The fp8 segment multiplies fp8_block_sim(x, 128) (official activation quantisation),
    the bf16 segments x itself: each against its float64 product (fp32 outputs), and the fp8
    segment far from the unquantised product. Scales folded into x (powers of two) or not."""
    from dsv4.layers.quant_sim import fp8_block_sim

    g = torch.Generator().manual_seed(5)
    K = 256
    q = (torch.randn(256, K, generator=g) * 2).to(torch.float8_e4m3fn)
    scale = torch.pow(2.0, torch.randint(-9, -5, (2, 2), generator=g).float())
    if not pow2:
        scale = scale * (0.5 + torch.rand(scale.shape, generator=g))
    segs = [("wqa_wkv", (q, scale), F32),
            ("compressor", (torch.randn(128, K, generator=g) * 0.02).to(BF16), F32),
            ("idx_weights", (torch.randn(64, K, generator=g) * 0.02).to(BF16), F32)]
    p = pack_input_weights(segs, device=KERNEL_DEV)
    # rows of very different magnitudes per 128-block, so each block has its own scale
    x = (torch.randn(5, K, generator=g) * torch.pow(2.0, torch.randint(
        -6, 6, (5, 2, 1), generator=g).float()).repeat_interleave(128, 1).view(5, K)).to(BF16)
    x = x.to(KERNEL_DEV)  # the packed weights live there; every check runs beside them
    out = fused_input_projections(x, p, config=cfg, act_quant=True)
    want = _float64_eval(fp8_block_sim(x, 128), p)[0]
    plain = _float64_eval(x, p)
    assert _rel(out[0], want) < 1e-5 < 1e-3 < _rel(out[0], plain[0])
    for o, w in zip(out[1:], plain[1:], strict=True):
        assert _rel(o, w) < 1e-5
    ref = fused_input_projections_reference(x, p, act_quant=True)
    assert all(_rel(r, o) < 1e-5 for r, o in zip(ref, out, strict=True))


def test_act_quant_needs_an_fp8_segment():
    p = pack_input_weights([("wqa_wkv", torch.randn(128, 128).to(BF16), BF16)])
    with pytest.raises(ValueError, match="act_quant.*has none"):
        fused_input_projections(torch.randn(2, 128).to(BF16), p, act_quant=True)
