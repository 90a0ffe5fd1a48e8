"""Sparse MQA with the sink over paged stores: reference and layout on CPU; the Triton kernel under
the CPU interpreter (TRITON_INTERPRET=1) on small shapes or on a GPU; Flash / Pro shapes on a GPU.

The fp8_ds_mla bytes are built by a small encoder written here, independently of the cache
writer: per 64-dim tile scale 2^ceil(log2(max(amax, 1e-4) / 448)), e4m3 round-to-nearest-even.
"""

from __future__ import annotations

import pytest
import torch

from dsv4.kernels.fused_input_proj import _INTERPRET
from dsv4.kernels.sparse_mqa import (
    SparseMqaConfig,
    choose_sparse_config,
    fp8_ds_mla_layout,
    gather_rows,
    sparse_mqa,
    sparse_mqa_reference,
)
from dsv4.layers.fp8 import ceil_log2

from conftest import KERNEL_DEV, kernel_runs, needs_gpu

F64 = torch.float64
DEV = KERNEL_DEV


def encode_fp8_ds_mla(rows: torch.Tensor, B: int, gen: torch.Generator):
    """rows [N, d] float -> (store uint8 [ceil(N/B), block_bytes], dequantised rows [N, d])."""
    N, d = rows.shape
    n = d - 64
    dr, sr, block_bytes = fp8_ds_mla_layout(d, B)
    tiles = rows[:, :n].float().reshape(N, n // 64, 64)
    amax = tiles.abs().amax(dim=-1).clamp_min(1e-4)
    e = ceil_log2(amax / 448.0)
    sc = torch.exp2(e.float())[..., None]
    qv = (tiles / sc).clamp(-448, 448).to(torch.float8_e4m3fn)
    rope = rows[:, n:].to(torch.bfloat16)
    deq = torch.cat((qv.float().mul(sc).reshape(N, n), rope.float()), dim=1)
    nb = -(-N // B)
    # garbage everywhere first: padding bytes, unused tails and unwritten rows must not be read
    store = torch.randint(0, 256, (nb, block_bytes), generator=gen, dtype=torch.uint8)
    data = torch.zeros(nb * B, dr, dtype=torch.uint8)
    data[:N, :n] = qv.view(torch.uint8).reshape(N, n)
    data[:N, n:] = rope.contiguous().view(torch.uint8)
    scales = torch.full((nb * B, sr), 255, dtype=torch.uint8)  # pad byte: NaN if ever read
    scales[:N, : n // 64] = (e + 127).to(torch.uint8)
    store[:, : B * dr] = data.view(nb, B * dr)
    store[:, B * dr: B * (dr + sr)] = scales.view(nb, B * sr)
    return store, deq


def make_store(N, d, fmt, B, gen, amp=1.0):
    rows = torch.randn(N, d, generator=gen) * amp
    rows[:, :-64] *= torch.exp2(torch.randint(-6, 6, (N, 1), generator=gen).float())  # wide scales
    if fmt == "bf16":
        nb = -(-N // B)
        store = torch.randn(nb * B, d, generator=gen).to(torch.bfloat16)
        store[:N] = rows.to(torch.bfloat16)
        return store.view(nb, B, d), store[:N].float()
    return encode_fp8_ds_mla(rows, B, gen)


def make_idx(T, n, n_rows, gen, p_masked=0.25):
    idx = torch.stack([torch.randperm(n_rows, generator=gen)[:n] for _ in range(T)]).int()
    mask = torch.rand(T, n, generator=gen) < p_masked
    return idx.masked_fill(mask, -1)


def build_case(T, H, d, W, K, fmt, seed=0, B=16, n_rows=None, device="cpu"):
    """(q, win_store, win_idx, cmp_store, cmp_idx, sink, scale, fmt, B): the kernel's arguments."""
    g = torch.Generator().manual_seed(seed)
    n_rows = n_rows or max(W, K, 1) * 2 + 5  # ragged last block
    win_store, _ = make_store(n_rows, d, fmt, B, g)
    win_idx = make_idx(T, W, n_rows, g)
    win_idx[:, 0] = torch.randint(0, n_rows, (T,), generator=g).int()  # >= 1 valid window row
    cmp_store = cmp_idx = None
    if K > 0:
        cmp_store, _ = make_store(n_rows + 3, d, fmt, B, g)
        cmp_idx = make_idx(T, K, n_rows + 3, g, p_masked=0.4)
        cmp_idx[0] = -1  # query 0 sees window rows only
    q = torch.randn(T, H, d, generator=g).to(torch.bfloat16)
    sink = torch.randn(H, generator=g) * 2
    mv = (lambda x: None if x is None else x.to(device))
    return (q.to(device), win_store.to(device), win_idx.to(device), mv(cmp_store), mv(cmp_idx),
            sink.to(device), d ** -0.5, fmt, B)


def rel(a, b):
    return ((a.cpu().double() - b.cpu().double()).norm() / b.cpu().double().norm()).item()


# ---------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("d", [128, 512])
def test_layout_and_gather_roundtrip(d):
    g = torch.Generator().manual_seed(0)
    dr, sr, bb = fp8_ds_mla_layout(d, 64)
    assert (dr, sr) == ((576, 8) if d == 512 else (192, 8))
    if d == 512:
        assert bb == 65 * 576 and bb >= 64 * 584  # FlashMLA V4: 584 bytes a token, 576-aligned
    for fmt in ("bf16", "fp8_ds_mla"):
        store, rows = make_store(37, d, fmt, 16, g)
        idx = torch.tensor([[5, -1, 36], [0, 17, 16]], dtype=torch.int32)
        got = gather_rows(store, idx, fmt, d, 16, F64)
        want = rows.double()[idx.long().clamp(min=0)]
        want[idx < 0] = 0
        assert torch.equal(got, want)


def test_encoder_matches_official_quant_rule():
    # one tile with amax 448 * 2^-3 exactly: scale 2^-3, values exact
    rows = torch.zeros(1, 128)
    rows[0, 0] = 56.0
    rows[0, 1] = 1.0
    store, deq = encode_fp8_ds_mla(rows, 1, torch.Generator().manual_seed(0))
    assert store[0, 192].item() == 127 - 3  # the scale byte follows the one row of 192 data bytes
    assert deq[0, 0] == 56.0 and deq[0, 1] == 1.0


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
def test_reference_matches_dense_float64(fmt):
    q, ws, wi, cs, ci, sink, scale, _, B = build_case(3, 4, 128, 6, 5, fmt, seed=2)
    got = sparse_mqa_reference(q, ws, wi, cs, ci, sink, scale, fmt, B, F64, F64)
    for t in range(3):
        keys = [gather_rows(ws, wi[t], fmt, 128, B, F64)[wi[t] >= 0],
                gather_rows(cs, ci[t], fmt, 128, B, F64)[ci[t] >= 0]]
        k = torch.cat(keys)
        lg = q[t].double() @ k.t() * scale
        e = torch.exp(lg)
        o = (e @ k) / (e.sum(-1) + torch.exp(sink.double()))[:, None]
        assert torch.allclose(got[t], o, rtol=1e-10, atol=1e-12)


def test_cpu_fallback_and_bad_inputs():
    case = build_case(2, 4, 128, 4, 0, "bf16")
    if not _INTERPRET:
        assert torch.equal(sparse_mqa(*case), sparse_mqa_reference(*case))
    with pytest.raises(ValueError, match="fmt"):
        sparse_mqa(*case[:7], "fp8", case[8])
    with pytest.raises(ValueError, match="win_idx"):
        sparse_mqa(case[0], case[1], case[2][:1], *case[3:])


def test_choose_config():
    assert choose_sparse_config(1, 64, 512, 640).split > 1
    assert choose_sparse_config(4096, 128, 512, 1152).split == 1
    assert choose_sparse_config(3, 4, 128, 40).block_h == 16
    def tiles(t, h, fmt):
        c = choose_sparse_config(t, h, 512, 640, fmt=fmt)
        return c.block_h, c.block_n, c.num_stages

    assert [tiles(t, 64, "fp8_ds_mla") for t in (1, 8, 64)] == [
        (16, 32, 1), (32, 16, 1), (64, 16, 1)]
    assert tiles(1, 128, "fp8_ds_mla") == (32, 16, 1)
    assert [tiles(t, 64, "bf16") for t in (1, 8, 64, 4096)] == [
        (16, 32, 1), (32, 32, 2), (64, 16, 3), (32, 64, 2)]
    # about one program per SM: 16 queries x 1 head block -> 9 chunks; many queries: none
    assert choose_sparse_config(16, 64, 512, 640, fmt="fp8_ds_mla").split == 9
    assert choose_sparse_config(4096, 64, 512, 640).split == 1


# ---------------------------------------------------------------------------------- kernel

SMALL = [(4, 128, 16, 24, 3), (4, 128, 20, 0, 2), (16, 512, 8, 8, 2)]  # H, d, W, K, T


@kernel_runs
@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("shape", SMALL)
def test_kernel_matches_reference_and_float64(fmt, shape):
    H, d, W, K, T = shape
    case = build_case(T, H, d, W, K, fmt, seed=H + W, device=DEV)
    ref64 = sparse_mqa_reference(*case, acc_dtype=F64, out_dtype=F64)
    ref = sparse_mqa_reference(*case)
    cfgs = [None, SparseMqaConfig(block_h=16, block_n=16, split=1, num_warps=4),
            SparseMqaConfig(block_h=16, block_n=16, split=3, num_warps=4),
            SparseMqaConfig(block_h=16, block_n=16, split=1, num_warps=4, block_dv=64),
            SparseMqaConfig(block_h=16, block_n=16, split=2, num_warps=4, block_dv=64)]
    outs = []
    for cfg in cfgs:
        o = sparse_mqa(*case, config=cfg)
        assert o.dtype == torch.bfloat16 and o.shape == (T, H, d)
        assert torch.isfinite(o).all()
        assert rel(o, ref64) < 1e-2 and rel(o, ref) < 1e-2
        outs.append(o)
    # split-KV on vs off: equal up to rounding (fp32 addition order; on a GPU also where the
    # probabilities are rounded to bf16 for the P.V MMA, relative to a different running max)
    assert rel(outs[2], outs[1]) < 5e-3
    # output columns in blocks of 64 (scores from whole rows): the same sums as all columns
    assert rel(outs[3], outs[1]) < 5e-3 and rel(outs[4], outs[2]) < 5e-3
    with pytest.raises(ValueError, match="block_dv"):
        sparse_mqa(*case, config=SparseMqaConfig(block_dv=96))


@kernel_runs
@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("shape", [(4, 128, 16, 24, 3), (16, 512, 8, 8, 2)])
def test_inverse_rope_in_the_output_launch(fmt, shape):
    """``inverse_rope``: the launch that writes o (the main kernel, or the combine kernel of a
    split) rotates its rope dims back as the output path's own launch would - the same values
    (bit for bit under the interpreter) - in every configuration that writes o differently."""
    from dsv4.kernels.rope_norm import rope_heads

    H, d, W, K, T = shape
    case = build_case(T, H, d, W, K, fmt, seed=3 + H, device=DEV)
    g = torch.Generator().manual_seed(9)
    pos = torch.tensor([0, 17, 999_983][:T] + [5] * max(0, T - 3)).to(DEV)
    inv_freq = (1.0 / 10000 ** (torch.arange(0, 64, 2).float() / 64)).to(DEV)
    inv_freq = inv_freq * (1 + 0.01 * torch.rand(32, generator=g)).to(DEV)
    for cfg in (None, SparseMqaConfig(block_h=16, block_n=16, split=1, num_warps=4),
                SparseMqaConfig(block_h=16, block_n=16, split=3, num_warps=4),
                SparseMqaConfig(block_h=16, block_n=16, split=1, num_warps=4, block_dv=64),
                SparseMqaConfig(block_h=16, block_n=16, split=2, num_warps=4, block_dv=64)):
        plain = sparse_mqa(*case, config=cfg)
        tail = plain[..., d - 64:]
        want = plain.clone()
        want[..., d - 64:] = rope_heads(tail, pos, inv_freq, inverse=True)
        got = sparse_mqa(*case, config=cfg, inverse_rope=(pos, inv_freq))
        assert torch.equal(got[..., :d - 64], plain[..., :d - 64]), cfg  # nope dims untouched
        if _INTERPRET:
            assert torch.equal(got, want), cfg
        else:  # fp32 cos / sin and contractions may differ by an ulp between the kernels
            assert rel(got, want) < 1e-3, cfg
    with pytest.raises(ValueError, match="positions"):
        sparse_mqa(*case, inverse_rope=(pos[:1].float(), inv_freq))
    with pytest.raises(ValueError, match="inv_freq"):
        sparse_mqa(*case, inverse_rope=(pos, inv_freq.double()))


def test_inverse_rope_off_the_kernels_matches_the_rotary():
    """``sparse_mqa(..., inverse_rope=)`` where no kernel runs (the CPU fallback; the kernels
    where Triton's interpreter or a GPU runs them): the same rotation as the torch layers'
    rotary applies to the plain output, the nope dims untouched."""
    from dsv4.layers.rotary import RotaryEmbedding

    case = build_case(3, 4, 128, 8, 6, "bf16", seed=2)
    rot = RotaryEmbedding(64, 10000.0, None)
    pos = torch.tensor([0, 7, 70_000])
    plain = sparse_mqa(*case)
    want = rot.rotate(plain, pos, torch.float32, inverse=True)
    got = sparse_mqa(*case, inverse_rope=(pos, rot.inv_freq))
    assert rel(got, want) < 1e-3 and torch.equal(got[..., :64], plain[..., :64])
    assert not torch.equal(got, plain)  # the rope dims did turn


@kernel_runs
@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
def test_many_chunks_some_empty(fmt):
    """A split far above the chunk count (clamped to one chunk per tile of rows: 15 chunks, a
    padded combine tile of 16), query 0's compressed chunks all masked: the combine kernel's
    one-reduction merge against float64."""
    case = build_case(2, 4, 128, 40, 200, fmt, seed=11, device=DEV)
    o = sparse_mqa(*case, config=SparseMqaConfig(block_h=16, block_n=16, split=1000,
                                                 num_warps=4))
    assert torch.isfinite(o).all()
    assert rel(o, sparse_mqa_reference(*case, acc_dtype=F64, out_dtype=F64)) < 1e-2
    one = sparse_mqa(*case, config=SparseMqaConfig(block_h=16, block_n=16, split=1,
                                                   num_warps=4))
    assert rel(o, one) < 5e-3


@kernel_runs
def test_kernel_window_only_query_and_masked_rows():
    # query 0 has no compressed rows; masked rows hold huge garbage that must not leak in
    case = list(build_case(2, 4, 128, 8, 8, "bf16", seed=5))
    ws = case[1].clone()
    wi = case[2]
    used = set(wi[wi >= 0].tolist())
    flat = ws.view(-1, 128)
    for r in range(flat.shape[0]):
        if r not in used:
            flat[r] = 3e38
    case[1] = ws
    case = [c.to(DEV) if isinstance(c, torch.Tensor) else c for c in case]
    o = sparse_mqa(*case, config=SparseMqaConfig(16, 16, 2, 4))
    assert torch.isfinite(o).all()
    assert rel(o, sparse_mqa_reference(*case, acc_dtype=F64, out_dtype=F64)) < 1e-2


@kernel_runs
@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
def test_kernel_strided_store_views(fmt):
    # stores that are views into larger buffers: the kernel follows the block stride
    case = list(build_case(3, 4, 128, 8, 8, fmt, seed=11, device=DEV))
    ref = sparse_mqa_reference(*case, acc_dtype=F64, out_dtype=F64)
    for i in (1, 3):
        st = case[i]
        if fmt == "bf16":
            big = torch.zeros(st.shape[0] * 2, *st.shape[1:], dtype=st.dtype, device=DEV)
            big[::2] = st
            case[i] = big[::2]
        else:
            big = torch.zeros(st.shape[0], st.shape[1] + 192, dtype=st.dtype, device=DEV)
            big[:, : st.shape[1]] = st
            case[i] = big[:, : st.shape[1]]
        assert not case[i].is_contiguous()
    assert rel(sparse_mqa_reference(*case, acc_dtype=F64, out_dtype=F64), ref) < 1e-12
    assert rel(sparse_mqa(*case, config=SparseMqaConfig(16, 16, 2, 4)), ref) < 1e-2


# ---------------------------------------------------------------------------------- GPU

cuda = pytest.mark.cuda


def chunked_reference(case, step=128):
    q = case[0]
    outs = []
    for s in range(0, q.shape[0], step):
        sl = slice(s, s + step)
        outs.append(sparse_mqa_reference(q[sl], case[1], case[2][sl], case[3],
                                         None if case[4] is None else case[4][sl], *case[5:]))
    return torch.cat(outs)


@cuda
@needs_gpu
@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("H,K", [(64, 512), (128, 1024), (64, 0)])
@pytest.mark.parametrize("T", [1, 16, 64, 4096])
def test_gpu_model_shapes(fmt, H, K, T):
    case = build_case(T, H, 512, 128, K, fmt, seed=T, B=64, n_rows=8192, device="cuda")
    o = sparse_mqa(*case)
    assert torch.isfinite(o).all()
    assert rel(o, chunked_reference(case)) < 1e-2
    if T <= 16:
        assert rel(o, sparse_mqa_reference(*case, acc_dtype=F64, out_dtype=F64)) < 1e-2
    for split in (1, 4):
        o2 = sparse_mqa(*case, config=SparseMqaConfig(split=split))
        assert rel(o2, o) < 5e-3
    assert torch.equal(sparse_mqa(*case), o)  # deterministic


@cuda
@needs_gpu
@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
def test_gpu_graph_replay_equals_eager(fmt):
    from dsv4.runner import capture_graph

    case = build_case(4, 64, 512, 128, 512, fmt, seed=9, B=64, n_rows=4096, device="cuda")
    eager = sparse_mqa(*case)
    out = torch.empty_like(eager)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        sparse_mqa(*case, out=out)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with capture_graph(g):
        sparse_mqa(*case, out=out)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
