"""The fused elementwise stages (kernels/rope_norm.py through platforms/cuda_elementwise.py)
against the base layer's torch path: under Triton's CPU interpreter (TRITON_INTERPRET=1) on small
shapes, or on a GPU; Flash / Pro shapes and the cuda layer on a GPU only."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

from dsv4 import DeepseekV4Attention, DSV4Config
from dsv4.kernels.fused_input_proj import _INTERPRET, triton_available
from dsv4.kernels.rope_norm import kernels_usable, rope_hadamard_fp4, rope_heads
from dsv4.layers.indexer import Indexer
from dsv4.layers.norm import RMSNorm
from dsv4.layers.rotary import RotaryEmbedding
from dsv4.platforms import build_attention
from dsv4.platforms import cuda_elementwise as ew

from conftest import KERNEL_DEV, kernel_runs, needs_gpu, random_x, rel_err

BF16 = torch.bfloat16
DEV = KERNEL_DEV
BIG_POSITIONS = [0, 1, 7, 1000, 65_535, 65_537, 262_143, 999_999, 1_000_000]


def stage_layer(cfg: DSV4Config, ratio: int = 4, device: str = DEV, seed: int = 0
                ) -> SimpleNamespace:
    """What the base stage methods and the cuda_elementwise functions read from a layer (the
    norms with random weights, the layer's rotary, the indexer's sizes), without building the
    layer's GEMM weights: any shape, cheap."""
    g = torch.Generator().manual_seed(seed)
    q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dtype=BF16)
    kv_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=BF16)
    for norm in (q_norm, kv_norm):
        norm.weight.data = (1 + 0.5 * torch.randn(norm.weight.shape, generator=g)).to(BF16)
    q_norm, kv_norm = q_norm.to(device), kv_norm.to(device)
    lay = SimpleNamespace(
        cfg=cfg, dtype=BF16, acc_dtype=torch.float32, device=q_norm.weight.device,
        n_heads=cfg.num_attention_heads, head_dim=cfg.head_dim, rope_dim=cfg.qk_rope_head_dim,
        q_norm=q_norm, kv_norm=kv_norm,
        rotary=RotaryEmbedding.for_layer(cfg, ratio, device))
    lay.indexer = SimpleNamespace(n_heads=cfg.index_n_heads, head_dim=cfg.index_head_dim)
    lay.indexer.rotate_query = functools.partial(Indexer.rotate_query, lay.indexer)
    return lay


def small_cfg(**kw: object) -> DSV4Config:
    return DSV4Config.preset("tiny").replace(fp8_weights=False, **kw)  # any dims


def rand(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(BF16).to(DEV)


def positions(t: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    pos = torch.tensor(BIG_POSITIONS)[torch.randint(len(BIG_POSITIONS), (t,), generator=g)]
    pos[: min(t, len(BIG_POSITIONS))] = torch.tensor(BIG_POSITIONS[:t])
    return pos.to(DEV)


def check(got: torch.Tensor, want: torch.Tensor, quant: bool = False,
          max_mismatch: float = 0.02) -> float:
    """Equal up to one bf16 ulp (plus an fp32 cancellation term) per element; simulated
    (quantised) outputs may differ by a quantisation step in a few elements. Returns the max
    abs error."""
    assert got.shape == want.shape and got.dtype == want.dtype == BF16
    g, w = got.double().cpu(), want.double().cpu()
    diff = (g - w).abs()
    mismatch = float((diff > 0).double().mean())
    assert mismatch <= max_mismatch, f"{mismatch:.4f} of the elements differ"
    if quant:
        assert float(diff.norm() / w.norm()) < 2e-2
    else:
        tol = w.abs() * 2**-7 + 1e-5 * float(w.abs().max())
        bad = diff > tol
        assert not bool(bad.any()), f"{int(bad.sum())} elements off by more than one ulp, max " \
                                    f"{float(diff.max())}"
    return float(diff.max())


# ---------------------------------------------------------------------------------- always


def test_kernels_need_triton_and_cuda_or_the_interpreter():
    x = torch.zeros(2, 4)
    assert kernels_usable(x) == (triton_available() and _INTERPRET)
    lay = stage_layer(small_cfg(), device="cpu")
    assert ew.elementwise_usable(lay, x.to(BF16)) == (triton_available() and _INTERPRET)
    lay.dtype = torch.float32
    assert not ew.elementwise_usable(lay, x)


# ---------------------------------------------------------------------------------- kernels

SHAPES = [  # (heads, head_dim, rope_dim, q_lora_rank, index heads, index head_dim)
    dict(num_attention_heads=4, head_dim=128, qk_rope_head_dim=64, q_lora_rank=128,
         index_n_heads=8, index_head_dim=128),
    dict(num_attention_heads=3, head_dim=192, qk_rope_head_dim=64, q_lora_rank=96,
         index_n_heads=5, index_head_dim=256, o_groups=1),
    dict(num_attention_heads=2, head_dim=96, qk_rope_head_dim=32, q_lora_rank=160,
         index_n_heads=17, index_head_dim=64, o_groups=1),
]


@kernel_runs
@pytest.mark.parametrize("shape", range(len(SHAPES)))
@pytest.mark.parametrize("t", [1, 5])
def test_latent_norms(shape, t):
    lay = stage_layer(small_cfg(**SHAPES[shape]))
    wide = rand(t, 7 + lay.cfg.q_lora_rank + lay.head_dim, seed=t, scale=3.0)
    qr_kv = wide[:, 7:]  # strided rows, as a slice of a packed GEMM output
    want = DeepseekV4Attention._latent_norms(lay, qr_kv)
    got = ew.fused_latent_norms(lay, qr_kv)
    for g, w in zip(got, want, strict=True):
        check(g, w)


@kernel_runs
@pytest.mark.parametrize("shape", range(len(SHAPES)))
@pytest.mark.parametrize("t", [1, 9])
def test_query_heads(shape, t):
    lay = stage_layer(small_cfg(**SHAPES[shape]))
    q = rand(t, lay.n_heads * lay.head_dim, seed=shape, scale=2.0)
    lay._wq_b_gemm = lambda qr: q
    pos = positions(t)
    want = DeepseekV4Attention._query_heads(lay, None, pos)
    check(ew.fused_query_heads(lay, q, pos), want)


@kernel_runs
@pytest.mark.parametrize("shape", range(len(SHAPES)))
@pytest.mark.parametrize("simulate", [True, False])
@pytest.mark.parametrize("ratio", [0, 4])
def test_kv_rows(shape, simulate, ratio):
    lay = stage_layer(small_cfg(**SHAPES[shape], simulate_quant=simulate), ratio)
    t = 9
    kv = rand(t, lay.head_dim, seed=shape, scale=2.0)
    pos = positions(t)
    want = DeepseekV4Attention._kv_rows(lay, kv, pos)
    got = ew.fused_kv_rows(lay, kv, pos)
    nope = lay.head_dim - lay.rope_dim
    assert torch.equal(got[:, :nope], want[:, :nope])  # unrotated: the same inputs
    check(got, want)


@kernel_runs
@pytest.mark.parametrize("shape", range(len(SHAPES)))
@pytest.mark.parametrize("simulate", [True, False])
@pytest.mark.parametrize("t", [1, 9])
def test_query_heads_and_kv_rows_in_one_launch(shape, simulate, t):
    """The query heads and the kv rows in one launch (the platform's): each output bit-equal to
    its own launch's (and so to the torch path within the stage tests' bounds)."""
    lay = stage_layer(small_cfg(**SHAPES[shape], simulate_quant=simulate))
    q = rand(t, lay.n_heads * lay.head_dim, seed=shape, scale=2.0)
    kv = rand(t, 2 * lay.head_dim, seed=shape + 1, scale=2.0)[:, ::2]  # strided rows
    pos = positions(t, seed=shape)
    heads, rows = ew.fused_query_heads_and_kv_rows(lay, q, kv, pos)
    assert torch.equal(heads, ew.fused_query_heads(lay, q, pos))
    assert torch.equal(rows, ew.fused_kv_rows(lay, kv, pos))
    with pytest.raises(ValueError, match="row must be"):
        ew.fused_query_heads_and_kv_rows(lay, q, kv[:, :-2], pos)


@kernel_runs
@pytest.mark.parametrize("shape", range(len(SHAPES)))
@pytest.mark.parametrize("numerics", [None, "fp8", "hadamard_fp4"])
def test_indexer_query(shape, numerics):
    if numerics == "fp8" and SHAPES[shape]["index_head_dim"] % 128:
        pytest.skip("fp8 indexer numerics need index_head_dim % 128 == 0")
    cfg = small_cfg(**SHAPES[shape], simulate_quant=numerics is not None,
                    index_numerics=numerics or "fp8")
    lay = stage_layer(cfg)
    t = 5
    iq = rand(t, cfg.index_n_heads * cfg.index_head_dim, seed=shape, scale=3.0)
    lay._indexer_wq_b_gemm = lambda qr: iq
    pos = positions(t)
    want = DeepseekV4Attention._indexer_query(lay, None, pos)
    check(ew.fused_indexer_query(lay, iq, pos), want, quant=numerics is not None)


@kernel_runs
@pytest.mark.parametrize("shape", range(len(SHAPES)))
def test_inverse_rope(shape):
    lay = stage_layer(small_cfg(**SHAPES[shape]))
    t = 9
    o = rand(t, lay.n_heads, lay.head_dim, seed=shape, scale=2.0)
    pos = positions(t)
    want = lay.rotary.rotate(o, pos, torch.float32, inverse=True)
    work = o.clone()
    got = ew.fused_inverse_rope(lay, work, pos)
    check(got, want)
    # in place: the same storage, the nope dims not rewritten
    nope = lay.head_dim - lay.rope_dim
    assert got.data_ptr() == work.data_ptr()
    assert torch.equal(got[..., :nope], o[..., :nope])
    # inverse undoes forward (up to the two bf16 roundings)
    back = rope_heads(got, pos, lay.rotary.inv_freq)
    assert float((back.float() - o.float()).abs().max()) < 0.05
    # a strided last dim is copied first; the caller's tensor is left alone
    wide = torch.stack([o, torch.zeros_like(o)], dim=-1).flatten(-2)[..., ::2]
    before = wide.clone()
    check(ew.fused_inverse_rope(lay, wide, pos), want)
    assert torch.equal(wide, before)


@kernel_runs
@pytest.mark.parametrize("shape", [0, 2])
def test_hadamard_heads_per_program(shape):
    """Every head tile (16 / 32 / 64 heads per program, ragged last tile) gives the same
    result: the tile changes the MMA's M side only (exact products; on a GPU the MMA kinds may
    sum in another order, so one quantisation step may differ in a rare element)."""
    cfg = small_cfg(**SHAPES[shape])
    lay = stage_layer(cfg)
    iq = rand(3, 17, cfg.index_head_dim, seed=shape, scale=3.0)
    pos = positions(3)
    outs = [rope_hadamard_fp4(iq, pos, lay.rotary.inv_freq, block_h=b) for b in (16, 32, 64)]
    for o in outs[1:]:
        if _INTERPRET:
            assert torch.equal(o, outs[0])
        else:
            check(o, outs[0], quant=True)
    with pytest.raises(ValueError, match="block_h"):
        rope_hadamard_fp4(iq, pos, lay.rotary.inv_freq, block_h=8)


@kernel_runs
def test_empty_and_strided_inputs():
    lay = stage_layer(small_cfg())
    inv = lay.rotary.inv_freq
    empty = torch.zeros(0, 4, 128, dtype=BF16, device=DEV)
    pos0 = torch.zeros(0, dtype=torch.long, device=DEV)
    assert rope_heads(empty, pos0, inv).shape == (0, 4, 128)
    assert rope_hadamard_fp4(empty, pos0, inv).shape == (0, 4, 128)
    x = rand(3, 4, 256)[:, :, ::2]  # non-contiguous last dim: copied first
    pos = positions(3).to(torch.int32)
    check(rope_heads(x, pos, inv), lay.rotary.rotate(x, pos, torch.float32))
    # out= : x itself (in place) or a strided view with a contiguous last dim
    y = rand(3, 4, 128, seed=1)
    want = lay.rotary.rotate(y, pos, torch.float32, inverse=True)
    assert rope_heads(y, pos, inv, inverse=True, out=y) is y
    check(y, want)
    dst = torch.zeros(4, 3, 128, dtype=BF16, device=DEV).transpose(0, 1)
    assert rope_heads(y, pos, inv, out=dst) is dst
    check(dst, lay.rotary.rotate(y, pos, torch.float32))


@kernel_runs
def test_bad_shapes_raise():
    lay = stage_layer(small_cfg())
    inv = lay.rotary.inv_freq
    pos = positions(2)
    with pytest.raises(ValueError):
        rope_heads(rand(2, 2, 48), pos, inv)  # fewer dims than RoPE needs
    with pytest.raises(ValueError):
        rope_heads(rand(2, 2, 128), pos, inv, fp8_dims=100, fp8_block=64)
    with pytest.raises(ValueError):
        rope_hadamard_fp4(rand(2, 2, 96), pos, inv)  # not a power of two
    x = rand(2, 2, 128)
    for bad in (rand(2, 3, 128), rand(2, 2, 256)[..., ::2]):  # wrong shape; strided last dim
        with pytest.raises(ValueError, match="out must"):
            rope_heads(x, pos, inv, out=bad)


# ---------------------------------------------------------------------------------- GPU

cuda = pytest.mark.cuda


@cuda
@needs_gpu
@pytest.mark.parametrize("model", ["flash", "pro"])
@pytest.mark.parametrize("t", [1, 3, 64])
@pytest.mark.parametrize("ratio", [0, 4])
def test_gpu_model_shapes(model, t, ratio):
    cfg = DSV4Config.preset(model)
    errs = {}
    for numerics in ("hadamard_fp4", "fp8", None):
        c = cfg.replace(simulate_quant=numerics is not None, index_numerics=numerics or "fp8")
        lay = stage_layer(c, ratio, device="cuda", seed=t)
        pos = positions(t, seed=t)
        iq = rand(t, c.index_n_heads * c.index_head_dim, seed=1, scale=3.0)
        lay._indexer_wq_b_gemm = lambda qr, iq=iq: iq
        want = DeepseekV4Attention._indexer_query(lay, None, pos)
        errs[f"indexer {numerics}"] = check(ew.fused_indexer_query(lay, iq, pos), want,
                                            quant=numerics is not None)
        kv = rand(t, c.head_dim, seed=2, scale=2.0)
        errs[f"kv {numerics}"] = check(ew.fused_kv_rows(lay, kv, pos),
                                       DeepseekV4Attention._kv_rows(lay, kv, pos))
    qr_kv = rand(t, c.q_lora_rank + c.head_dim, seed=3, scale=3.0)
    for g, w in zip(ew.fused_latent_norms(lay, qr_kv),
                    DeepseekV4Attention._latent_norms(lay, qr_kv), strict=True):
        errs["latent"] = check(g, w)
    q = rand(t, c.num_attention_heads * c.head_dim, seed=4, scale=2.0)
    lay._wq_b_gemm = lambda qr: q
    errs["query"] = check(ew.fused_query_heads(lay, q, pos),
                          DeepseekV4Attention._query_heads(lay, None, pos))
    heads, rows = ew.fused_query_heads_and_kv_rows(lay, q, kv, pos)  # one launch, same bits
    assert torch.equal(heads, ew.fused_query_heads(lay, q, pos))
    assert torch.equal(rows, ew.fused_kv_rows(lay, kv, pos))
    o = rand(t, c.num_attention_heads, c.head_dim, seed=5)
    want = lay.rotary.rotate(o, pos, torch.float32, inverse=True)
    errs["inverse"] = check(ew.fused_inverse_rope(lay, o.clone(), pos), want)
    print(model, t, ratio, errs)


@cuda
@needs_gpu
def test_gpu_graph_replay_reads_positions_on_the_device():
    from dsv4.runner import capture_graph

    lay = stage_layer(DSV4Config.preset("flash"), device="cuda")
    x = rand(4, 64, 512)
    pos = torch.tensor([5, 6, 7, 8], device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        rope_heads(x, pos, lay.rotary.inv_freq, norm_eps=1e-6)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with capture_graph(graph):
        out = rope_heads(x, pos, lay.rotary.inv_freq, norm_eps=1e-6)
    pos.copy_(torch.tensor([100, 70_000, 500_000, 1_000_000]))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, rope_heads(x, pos, lay.rotary.inv_freq, norm_eps=1e-6))


def _cuda_layer(cfg: DSV4Config, ratio: int, fused: bool):
    from dsv4 import process_weights_after_loading
    from dsv4.platforms.cuda import CudaAttention
    from dsv4.testing.random_weights import random_layer_weights

    lid = cfg.layer_of_ratio(ratio)
    layer = CudaAttention(cfg, lid, device="cuda", dtype=BF16)
    layer.load_weights(random_layer_weights(cfg, lid, seed=1).items())
    process_weights_after_loading(layer)
    layer.use_step_kernels(fused)
    return layer


def _decode(layer: DeepseekV4Attention, x: torch.Tensor, prefill: int) -> torch.Tensor:
    c = layer.new_cache(x.shape[0])
    ys = [layer(x[:prefill], torch.arange(prefill, device="cuda"), c)]
    ys += [layer(x[i:i + 1], torch.tensor([i], device="cuda"), c)
           for i in range(prefill, x.shape[0])]
    return torch.cat(ys)


@cuda
@needs_gpu
@pytest.mark.parametrize("ratio", [0, 4, 128])
@pytest.mark.parametrize("numerics", ["hadamard_fp4", "fp8"])
def test_gpu_cuda_layer_fused_matches_base_and_reference(ratio, numerics):
    from dsv4.testing.random_weights import random_layer_weights

    cfg = DSV4Config.preset("tiny").replace(index_numerics=numerics)
    if ratio != 4 and numerics == "fp8":
        pytest.skip("indexer numerics only matter on ratio-4 layers")
    fused, base = _cuda_layer(cfg, ratio, True), _cuda_layer(cfg, ratio, False)
    ref = build_attention(cfg, cfg.layer_of_ratio(ratio), device="cuda")
    ref.load_weights(random_layer_weights(cfg, ref.layer_id, seed=1).items())
    x = random_x(160, cfg.hidden_size, seed=2).to("cuda", BF16)
    y_fused, y_base, y_ref = (_decode(m, x, 130) for m in (fused, base, ref))
    assert torch.isfinite(y_fused).all()
    assert rel_err(y_fused, y_base) < 1e-2
    assert rel_err(y_fused, y_ref) < 1e-2


@cuda
@needs_gpu
def test_gpu_fused_stages_cut_the_step_ops():
    """A C4 decode step dispatches far fewer PyTorch ops with the fused stages (each fused
    stage is one Triton launch, invisible to the dispatcher)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    cfg = DSV4Config.preset("tiny")
    counts = {}
    for fused in (True, False):
        layer = _cuda_layer(cfg, 4, fused)
        layer.use_cuda_graphs(False)
        c = layer.new_cache(64)
        x = random_x(41, cfg.hidden_size, seed=3).to("cuda", BF16)
        layer(x[:40], torch.arange(40), c)
        with Count() as mode:
            layer(x[40:], torch.tensor([40]), c)
        counts[fused] = mode.n
    print("dispatched ops per C4 decode step (fused, base):", counts[True], counts[False])
    assert counts[False] - counts[True] >= 80
