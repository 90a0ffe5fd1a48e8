"""The one-launch compressed entries kernel against ``Compressor.compress_jobs``, and with its
store against ``store_rows``: under Triton's CPU interpreter (TRITON_INTERPRET=1) on the tiny
preset, on a GPU with Flash / Pro shapes; the cuda platform's cache-write stage and CUDA-graph
capture on a GPU only."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from dsv4 import DSV4Config
from dsv4.cache.store import PagedStore
from dsv4.kernels.compress_entries import (
    SIM_INDEX_FP4,
    SIM_INDEX_FP8,
    SIM_KV_FP8,
    SIM_NONE,
    compress_entries,
    kernel_unsupported,
    launch_constants,
    sim_mode,
)
from dsv4.kernels.fused_input_proj import _INTERPRET, triton_available
from dsv4.layers.compressor import Compressor
from dsv4.layers.rotary import RotaryEmbedding
from dsv4.platforms import build_attention

from conftest import KERNEL_DEV, kernel_runs, needs_gpu, random_x, rel_err

BF16 = torch.bfloat16
DEV = KERNEL_DEV

# (ratio, for_indexer, simulate_quant, index_numerics): every numerics path of both compressors
CASES = [
    (4, False, False, None), (4, False, True, None),
    (128, False, False, None), (128, False, True, None),
    (4, True, False, None), (4, True, True, "fp8"), (4, True, True, "hadamard_fp4"),
]


def simulated(case: tuple) -> bool:
    ratio, idx, sim, numerics = case
    return sim and (numerics is not None or not idx)


def case_id(case: tuple) -> str:
    ratio, idx, sim, numerics = case
    who = "index" if idx else "main"
    return f"r{ratio}-{who}-" + (numerics or "sim") if sim else f"r{ratio}-{who}-exact"


def make_compressor(cfg: DSV4Config, ratio: int, for_indexer: bool, device: str, seed: int = 0
                    ) -> tuple[Compressor, RotaryEmbedding]:
    dim = cfg.index_head_dim if for_indexer else cfg.head_dim
    comp = Compressor(cfg, dim=dim, ratio=ratio, for_indexer=for_indexer, dtype=BF16,
                      f32_dtype=torch.float32, device=device)
    g = torch.Generator().manual_seed(seed)
    comp.norm.weight.data.copy_(1 + 0.3 * torch.randn(dim, generator=g))
    return comp, RotaryEmbedding.for_layer(cfg, ratio, device)


@dataclass
class Jobs:
    ring: torch.Tensor
    rows: torch.Tensor
    ring_src: torch.Tensor
    call_src: torch.Tensor
    entries: torch.Tensor


def random_jobs(comp: Compressor, seqs: int, tokens: int, per_kind: int, seed: int,
                device: str) -> Jobs:
    """Rings of ``seqs`` sequences, ``tokens`` step rows, and entries of every source kind:
    ring-only, call-only, mixed (a random split point, as a step boundary makes), and at ratio 4
    entry 0 (previous block missing) from the ring and from the call."""
    g = torch.Generator().manual_seed(seed)
    cr, width, r = comp.ring_rows, comp.raw_width, comp.ratio
    ring = torch.randn(seqs, cr, width, generator=g) * 2
    rows = torch.randn(tokens, width, generator=g) * 2
    ring_src, call_src, entries = [], [], []
    kinds = ["ring", "call", "mixed"] + (["first-ring", "first-call"] if comp.coff == 2 else [])
    for kind in kinds:
        for _ in range(per_kind):
            slot = int(torch.randint(seqs, (1,), generator=g))
            rs = slot * cr + torch.randperm(cr, generator=g)
            cs = torch.randint(tokens, (cr,), generator=g)
            split = {"ring": cr, "call": 0}.get(kind, int(torch.randint(1, cr, (1,), generator=g)))
            if kind.startswith("first"):
                split = cr if kind == "first-ring" else r
            keep_ring = torch.arange(cr) < split
            rs, cs = torch.where(keep_ring, rs, -1), torch.where(keep_ring, -1, cs)
            j = int(torch.randint(1, 5000, (1,), generator=g))
            if kind.startswith("first"):
                rs[:r], cs[:r], j = -1, -1, 0
            ring_src.append(rs)
            call_src.append(cs)
            entries.append(j)
    return Jobs(ring.to(device), rows.to(device), torch.stack(ring_src).to(device),
                torch.stack(call_src).to(device), torch.tensor(entries, device=device))


def compare(got: torch.Tensor, want: torch.Tensor, simulated: bool) -> float:
    """Assert the kernel matches compress_jobs; returns the max abs error.

    Without a simulation the fp32 values agree to a few ulps, so the bf16 entries to one bf16
    ulp. With one, a value at a tie of the fp8 / fp4 grid may round the other way: one grid step
    on a few values, so the check bounds how many differ and the relative error of the whole."""
    assert got.shape == want.shape and got.dtype == want.dtype == BF16
    g, w = got.double().cpu(), want.double().cpu()
    assert torch.isfinite(g).all()
    far = ~torch.isclose(g, w, rtol=2**-7, atol=1e-5)  # entries are O(1) after RMSNorm
    if simulated:
        assert far.double().mean() <= 0.01, f"{int(far.sum())} of {far.numel()} values differ"
        assert float((g - w).norm() / w.norm()) < 2e-2
    else:
        assert not far.any(), f"max error {float((g - w).abs().max())}"
    return float((g - w).abs().max())


def run_both(comp: Compressor, rotary: RotaryEmbedding, jobs: Jobs, sim: bool,
             numerics: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    args = (jobs.ring, jobs.rows, jobs.ring_src, jobs.call_src, jobs.entries, rotary, BF16, sim,
            numerics)
    return compress_entries(comp, *args), comp.compress_jobs(*args)


# ---------------------------------------------------------------------------------- CPU


def test_sim_mode_follows_the_compressor_and_config(tiny):
    main, _ = make_compressor(tiny, 4, False, "cpu")
    index, _ = make_compressor(tiny, 4, True, "cpu")
    assert sim_mode(main, False, "hadamard_fp4") == SIM_NONE
    assert sim_mode(main, True, "hadamard_fp4") == SIM_KV_FP8
    assert sim_mode(index, True, None) == SIM_NONE
    assert sim_mode(index, True, "fp8") == SIM_INDEX_FP8
    assert sim_mode(index, True, "hadamard_fp4") == SIM_INDEX_FP4
    with pytest.raises(ValueError, match="unknown indexer numerics"):
        sim_mode(index, True, "fp2")


def test_unsupported_calls_say_why(tiny):
    comp, _ = make_compressor(tiny, 4, False, "cpu")
    rows = torch.zeros(3, comp.raw_width)
    if not triton_available():
        assert kernel_unsupported(comp, rows, BF16, True, None) == "Triton is not installed"
    elif not _INTERPRET:
        assert "CUDA" in (kernel_unsupported(comp, rows, BF16, True, None) or "")
    else:
        assert kernel_unsupported(comp, rows, BF16, True, None) is None
        assert "bf16" in (kernel_unsupported(comp, rows, torch.float32, True, None) or "")
        assert "float32" in (kernel_unsupported(comp, rows.double(), BF16, True, None) or "")
    if kernel_unsupported(comp, rows, BF16, True, None) is not None:
        jobs = random_jobs(comp, 1, 3, 1, 0, "cpu")
        with pytest.raises(ValueError, match="compress_entries kernel"):
            run_both(comp, RotaryEmbedding.for_layer(tiny, 4), jobs, True, None)


# ---------------------------------------------------------------------------------- kernel


@kernel_runs
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_kernel_matches_compress_jobs_on_random_jobs(tiny, case):
    ratio, idx, sim, numerics = case
    comp, rotary = make_compressor(tiny, ratio, idx, DEV)
    jobs = random_jobs(comp, seqs=3, tokens=40, per_kind=2, seed=ratio + idx, device=DEV)
    got, want = run_both(comp, rotary, jobs, sim, numerics)
    compare(got, want, simulated(case))


@kernel_runs
def test_no_entries(tiny):
    comp, rotary = make_compressor(tiny, 4, False, DEV)
    jobs = random_jobs(comp, 1, 4, 1, 0, DEV)
    none = Jobs(jobs.ring, jobs.rows, jobs.ring_src[:0], jobs.call_src[:0], jobs.entries[:0])
    got, _ = run_both(comp, rotary, none, True, None)
    assert got.shape == (0, comp.dim) and got.dtype == BF16


@kernel_runs
@pytest.mark.parametrize("preset", ["flash"] if _INTERPRET else ["flash", "pro"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_kernel_matches_compress_jobs_at_model_shapes(preset, case):
    """d = 512 (main compressor: C4 raw rows 2048 wide, C128 128 candidates) and d = 128
    (indexer); the interpreter runs a few entries, a GPU a prefill's worth."""
    ratio, idx, sim, numerics = case
    cfg = DSV4Config.preset(preset)
    comp, rotary = make_compressor(cfg, ratio, idx, DEV, seed=1)
    per_kind = 1 if _INTERPRET else 64
    jobs = random_jobs(comp, seqs=5, tokens=300, per_kind=per_kind, seed=7, device=DEV)
    got, want = run_both(comp, rotary, jobs, sim, numerics)
    compare(got, want, simulated(case))


class Recorder:
    """Wraps a layer's ``_compress_entries``: keeps a copy of each call's inputs (the ring
    changes when the step commits) and the base path's result."""

    def __init__(self, layer) -> None:
        self.layer = layer
        self.base = layer._compress_entries
        self.calls: list[tuple[Compressor, Jobs, torch.Tensor]] = []

    def __call__(self, comp, step, name, rows):
        out = self.base(comp, step, name, rows)
        job = step.jobs[name]
        jobs = Jobs(step.ring(name).clone(), rows.clone(), job.ring_src.clone(),
                    job.call_src.clone(), job.entries.clone())
        self.calls.append((comp, jobs, out))
        return out


def layer_jobs(cfg: DSV4Config, ratio: int, prompts: tuple[int, ...], steps: int,
               make_layer, monkeypatch) -> list[tuple[Compressor, Jobs, torch.Tensor]]:
    """Every compress of a pooled prefill of ``prompts`` (one mixed call) then ``steps`` decode
    steps of a reference layer: call-only and, at a decode step, mixed sources; entry 0 without
    its previous block; several sequences per launch."""
    layer = make_layer(cfg, ratio, device=DEV)
    rec = Recorder(layer)
    monkeypatch.setattr(layer, "_compress_entries", rec)
    caches = layer.new_caches(len(prompts), max(prompts) + steps)
    xs = [random_x(n + steps, cfg.hidden_size, seed=i).to(DEV, BF16)
          for i, n in enumerate(prompts)]
    layer(torch.cat([x[:n] for x, n in zip(xs, prompts, strict=True)]),
          torch.cat([torch.arange(n) for n in prompts]), caches, seq_lens=list(prompts))
    for s in range(steps):
        x = torch.stack([x[n + s] for x, n in zip(xs, prompts, strict=True)])
        layer(x, torch.tensor([n + s for n in prompts]), caches)
    return rec.calls


@kernel_runs
@pytest.mark.parametrize("ratio", [4, 128])
@pytest.mark.parametrize("sim", [False, True])
def test_kernel_matches_a_layers_jobs(make_layer, monkeypatch, ratio, sim):
    cfg = DSV4Config.preset("tiny").replace(simulate_quant=sim)
    # ratio 4: entries complete in the prefill and at each decode step; ratio 128: entry 0 of
    # the first sequence at its first decode step (127 ring rows + 1 step row), entry 1 of
    # the last in the prefill
    prompts, steps = ((3, 6, 13), 3) if ratio == 4 else ((127, 200, 256), 2)
    calls = layer_jobs(cfg, ratio, prompts, steps, make_layer, monkeypatch)
    kinds = set()
    for comp, jobs, want in calls:
        got = compress_entries(comp, jobs.ring, jobs.rows, jobs.ring_src, jobs.call_src,
                               jobs.entries, RotaryEmbedding.for_layer(cfg, ratio, DEV), BF16,
                               sim, cfg.index_numerics)
        compare(got, want, sim)
        in_ring = (jobs.ring_src >= 0).any(1)
        kinds |= {("idx" if comp.for_indexer else "main", bool(r)) for r in in_ring.tolist()}
    # both compressors (ratio 4), entries with ring sources and entries from the call alone
    assert {("main", True), ("main", False)} <= kinds
    assert (("idx", True) in kinds) == (ratio == 4)


# ---------------------------------------------------------------------------------- GPU only


@needs_gpu
@pytest.mark.parametrize("ratio", [4, 128])
def test_graph_replay_equals_eager(ratio):
    from dsv4.runner import capture_graph

    cfg = DSV4Config.preset("flash")
    comp, rotary = make_compressor(cfg, ratio, False, "cuda")
    jobs = random_jobs(comp, seqs=4, tokens=64, per_kind=8, seed=3, device="cuda")
    args = (jobs.ring, jobs.rows, jobs.ring_src, jobs.call_src, jobs.entries, rotary, BF16, True,
            None)
    eager = compress_entries(comp, *args)
    graph = torch.cuda.CUDAGraph()
    with capture_graph(graph):
        out = compress_entries(comp, *args)
    jobs.rows.mul_(-1)  # replay reads the buffers as they are now
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, compress_entries(comp, *args))
    assert not torch.equal(out, eager)


@needs_gpu
@pytest.mark.parametrize("ratio", [4, 128])
def test_cuda_platform_takes_the_kernel(monkeypatch, ratio):
    """The cuda layer makes and stores its entries in one launch a step (the kernel with its
    store; a C4 layer's two compressors in one), and its forward agrees with the reference
    layer's."""
    import dsv4.platforms.cuda as cuda_platform
    from dsv4.platforms.cuda import CudaAttention
    from dsv4.testing.random_weights import random_layer_weights

    cfg = DSV4Config.preset("tiny")
    lid = cfg.layer_of_ratio(ratio)
    weights = random_layer_weights(cfg, lid, seed=2)
    layer = CudaAttention(cfg, lid, device="cuda", dtype=BF16)
    layer.load_weights(weights.items())
    ref = build_attention(cfg, lid, device="cuda")
    ref.load_weights(weights.items())
    launches = []

    def counted(name, kernel):
        def call(*args, **kw):
            launches.append((name, name == "pair" or kw.get("store") is not None))
            return kernel(*args, **kw)
        return call

    monkeypatch.setattr(cuda_platform, "compress_entries",
                        counted("single", cuda_platform.compress_entries))
    monkeypatch.setattr(cuda_platform, "compress_entries_pair",
                        counted("pair", cuda_platform.compress_entries_pair))
    x = random_x(300, cfg.hidden_size, seed=5).to("cuda", BF16)
    outs = []
    for m in (layer, ref):
        c = m.new_cache(300)
        ys = [m(x[:260], torch.arange(260), c)]
        ys += [m(x[i:i + 1], torch.tensor([i]), c) for i in range(260, 300)]
        outs.append(torch.cat(ys))
    assert launches and all(stored for _, stored in launches)
    assert {name for name, _ in launches} == {"pair" if ratio == 4 else "single"}
    assert rel_err(outs[0], outs[1]) < 1e-2


@pytest.mark.skipif(not triton_available() or _INTERPRET,
                    reason="needs Triton, not the interpreter")
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_kernel_compiles_for_hopper(case):
    """Ahead-of-time compile for sm_90 (PTX and cubin through ptxas; no GPU needed): every
    constexpr combination the platform launches at model shapes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dsv4.kernels import compress_entries as ce

    ratio, idx, sim, numerics = case
    comp, _ = make_compressor(DSV4Config.preset("flash"), ratio, idx, "cpu")
    consts = launch_constants(comp, sim, numerics)
    warps = consts.pop("num_warps")
    aot = _aot_script()
    consts.update(aot.entry_store_constants(
        "fp8_ds_mla" if not idx else (numerics or "fp8").replace("hadamard_", ""), comp.dim),
        SKIP=True)  # as the layer launches it: unused jobs skipped
    sig = {"ring_ptr": "*fp32", "rows_ptr": "*fp32", "rsrc_ptr": "*i64", "csrc_ptr": "*i64",
           "s_src": "i32", "ent_ptr": "*i64", "w_ptr": "*bf16", "freq_ptr": "*fp32",
           "out_ptr": "*bf16", "s_out": "i32", "eps": "fp32", "v_ptr": "*i16",
           "slot_ptr": "*i64", "st_ptr": "*u8", "tab_ptr": "*i32", "st_tab": "i32",
           "n_seqs": "i32", "max_logical": "i32", "B": "i32", "BLK": "i32", "skip_slot": "i64",
           **dict.fromkeys(consts, "constexpr")}
    src = ASTSource(fn=ce._compress_entries_kernel, signature=sig, constexprs=consts)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    assert compiled.asm["cubin"]


def _aot_script():
    """benchmarks/aot_sm90_regs.py as a module (its store constants for the compress kernel)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "aot_sm90_regs.py"
    spec = importlib.util.spec_from_file_location("aot_sm90_regs", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@kernel_runs
@pytest.mark.parametrize("preset", ["tiny", "flash"])
@pytest.mark.parametrize("ratio,for_indexer", [(4, False), (128, False), (4, True)])
def test_raw_rows_kernel_is_bit_equal(preset, ratio, for_indexer):
    from dsv4.kernels.compress_entries import raw_rows

    cfg = DSV4Config.preset(preset)
    comp, _ = make_compressor(cfg, ratio, for_indexer, DEV)
    g = torch.Generator().manual_seed(ratio)
    comp.ape.data.copy_(torch.randn(comp.ape.shape, generator=g))
    t = 13
    # the fused score GEMM's output: this compressor's columns as a row-strided view
    wide = torch.randn(t, comp.raw_width + 40, generator=g).to(DEV)
    kv_score = wide[:, 40:]
    pos = torch.randint(0, 10_000, (t,), generator=g).to(DEV)
    want = comp.raw_rows(kv_score, pos, torch.float32)
    got = raw_rows(comp, kv_score, pos)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert raw_rows(comp, kv_score[:0], pos[:0]).shape == (0, comp.raw_width)
    with pytest.raises(ValueError, match="positions"):
        raw_rows(comp, kv_score, pos[:3])
    with pytest.raises(ValueError, match="fp32"):
        raw_rows(comp, kv_score.double(), pos)


@kernel_runs
@pytest.mark.parametrize("preset", ["tiny", "flash"])
def test_raw_rows_of_both_compressors_in_one_launch(preset):
    """A C4 layer's main and indexer compressor in one launch: each equal to its own launch's
    rows (strided score views as the fused score GEMM hands them)."""
    from dsv4.kernels.compress_entries import raw_rows, raw_rows_pair

    cfg = DSV4Config.preset(preset)
    comps = [make_compressor(cfg, 4, idx, DEV)[0] for idx in (False, True)]
    g = torch.Generator().manual_seed(3)
    for comp in comps:
        comp.ape.data.copy_(torch.randn(comp.ape.shape, generator=g))
    t = 7
    wide = torch.randn(t, sum(c.raw_width for c in comps), generator=g).to(DEV)
    main, idx = wide[:, :comps[0].raw_width], wide[:, comps[0].raw_width:]
    pos = torch.randint(0, 10_000, (t,), generator=g).to(DEV)
    a, b = raw_rows_pair((comps[0], main), (comps[1], idx), pos)
    assert torch.equal(a, raw_rows(comps[0], main, pos))
    assert torch.equal(b, raw_rows(comps[1], idx, pos))
    e1, e2 = raw_rows_pair((comps[0], main[:0]), (comps[1], idx[:0]), pos[:0])
    assert e1.shape == (0, comps[0].raw_width) and e2.shape == (0, comps[1].raw_width)
    with pytest.raises(ValueError, match="positions"):
        raw_rows_pair((comps[0], main), (comps[1], idx[:3]), pos)
    c128 = make_compressor(cfg, 128, False, DEV)[0]
    with pytest.raises(ValueError, match="ratios"):
        raw_rows_pair((comps[0], main), (c128, torch.zeros(t, c128.raw_width, device=DEV)),
                      pos)


@kernel_runs
@pytest.mark.parametrize("fmt,dim,rope", [("bf16", 128, 64), ("fp8_ds_mla", 128, 64),
                                          ("fp8_ds_mla", 512, 64)])
@pytest.mark.parametrize("pair", [False, True])
def test_raw_rows_store_the_window_rows_in_their_launch(fmt, dim, rope, pair):
    """``raw_rows`` / ``raw_rows_pair`` with ``store``: the same raw rows, and the store's
    bytes those of ``store_rows`` - held rows crossing blocks, skipped pairs (row -1, a released
    block, a slot holding nothing) and adversarial values (zero and boundary tiles)."""
    from test_store_rows import FORMATS, adversarial, assert_same_bytes, pairs, twin_stores

    from dsv4.kernels.compress_entries import RowStore, raw_rows, raw_rows_pair
    from dsv4.kernels.store_rows import store_rows

    make, tile, qmax = FORMATS[fmt]
    a, b = twin_stores(make(dim, rope), 16, DEV, seed=5)
    t = 24
    slots, rows = (x.to(DEV) for x in pairs(16, t, seed=6))
    values = adversarial(t, dim, tile, qmax, torch.bfloat16, seed=7).to(DEV)
    cfg = DSV4Config.preset("tiny")
    comps = [make_compressor(cfg, 4, idx, DEV)[0] for idx in (False, True)]
    g = torch.Generator().manual_seed(8)
    scores = [torch.randn(t, c.raw_width, generator=g).to(DEV) for c in comps]
    pos = torch.randint(0, 10_000, (t,), generator=g).to(DEV)
    store_rows(a, slots, rows, values)
    job = RowStore(b, slots, rows, values)
    if pair:
        got = raw_rows_pair((comps[0], scores[0]), (comps[1], scores[1]), pos, store=job)
        assert torch.equal(got[0], raw_rows(comps[0], scores[0], pos))
        assert torch.equal(got[1], raw_rows(comps[1], scores[1], pos))
    else:
        assert torch.equal(raw_rows(comps[0], scores[0], pos, store=job),
                           raw_rows(comps[0], scores[0], pos))
    assert_same_bytes(a, b)


@kernel_runs
def test_raw_rows_refuse_rows_they_cannot_store():
    """A store job that does not match the call (values of another width or count, float
    slots) or that the store kernel cannot write is refused before anything is launched: the
    store keeps its bytes."""
    from test_store_rows import FORMATS, raw, twin_stores

    from dsv4.kernels.compress_entries import RowStore, raw_rows

    comp = make_compressor(DSV4Config.preset("tiny"), 4, False, DEV)[0]
    t = 5
    score, pos = torch.zeros(t, comp.raw_width, device=DEV), torch.arange(t, device=DEV)
    store = twin_stores(FORMATS["fp8_ds_mla"][0](128, 64), 16, DEV)[0]
    before = raw(store).clone()
    idx = torch.zeros(t, dtype=torch.int64, device=DEV)
    bad = [(RowStore(store, idx, idx, torch.zeros(t, 64, dtype=torch.bfloat16, device=DEV)),
            "values must be \\[T=5, 128\\]"),
           (RowStore(store, idx, idx, torch.zeros(t + 1, 128, dtype=torch.bfloat16,
                                                  device=DEV)), "values must be"),
           (RowStore(store, idx.float(), idx, torch.zeros(t, 128, dtype=torch.bfloat16,
                                                          device=DEV)), "slots must be"),
           (RowStore(store, idx, idx, torch.zeros(t, 128, dtype=torch.float64, device=DEV)),
            "kv store")]
    for job, message in bad:
        with pytest.raises(ValueError, match=message):
            raw_rows(comp, score, pos, store=job)
    assert torch.equal(raw(store), before)


@kernel_runs
@pytest.mark.parametrize("k1,k2", [(6, 3), (2, 5), (0, 4), (3, 0), (0, 0)])
def test_both_rings_kept_rows_in_one_launch(k1, k2):
    """Two rings (a C4 layer's main, 2048 wide, and indexer, 512) in one launch: each as its
    own launch leaves it, whichever keeps more rows."""
    from dsv4.kernels.compress_entries import keep_ring_rows, keep_ring_rows_pair

    g = torch.Generator().manual_seed(k1 * 7 + k2)
    args, wants = [], []
    for width, k in ((2048, k1), (512, k2)):
        ring = torch.randn(3, 8, width, generator=g).to(DEV)
        rows = torch.randn(11, width + 5, generator=g).to(DEV)[:, 5:]
        dst = torch.randperm(24, generator=g)[:k].to(DEV)
        src = torch.randint(0, 11, (k,), generator=g).to(DEV)
        want = ring.clone()
        keep_ring_rows(want, rows, dst, src)
        args.append((ring, rows, dst, src))
        wants.append(want)
    keep_ring_rows_pair(args[0], args[1])
    assert torch.equal(args[0][0], wants[0]) and torch.equal(args[1][0], wants[1])
    ring, rows, dst, src = args[1]
    with pytest.raises(ValueError, match="float32"):
        keep_ring_rows_pair(args[0], (ring.double(), rows, dst, src))


@kernel_runs
@pytest.mark.parametrize("width,k", [(512, 8), (2048, 5), (96, 0)])
def test_keep_ring_rows_kernel_copies_the_kept_rows(width, k):
    from dsv4.kernels.compress_entries import keep_ring_rows

    g = torch.Generator().manual_seed(width + k)
    ring = torch.randn(3, 8, width, generator=g).to(DEV)
    wide = torch.randn(11, width + 7, generator=g).to(DEV)
    rows = wide[:, 7:]  # a row-strided view
    dst = torch.randperm(24, generator=g)[:k].to(DEV)
    src = torch.randint(0, 11, (k,), generator=g).to(DEV)
    want = ring.clone()
    want.view(-1, width)[dst] = rows[src]
    keep_ring_rows(ring, rows, dst, src)
    assert torch.equal(ring, want)
    with pytest.raises(ValueError, match="same"):
        keep_ring_rows(ring, rows, dst, src[:0] if k else src[:, None])
    with pytest.raises(ValueError, match="float32"):
        keep_ring_rows(ring.double(), rows, dst, src)


@kernel_runs
@pytest.mark.parametrize(("ratio", "for_indexer", "fmt"), [
    (4, False, "fp8_ds_mla"), (128, False, "fp8_ds_mla"), (4, False, "bf16"),
    (4, True, "fp8"), (4, True, "fp4")])
def test_a_launch_that_stores_writes_what_store_rows_writes(ratio, for_indexer, fmt):
    """``compress_entries(..., store=, slots=)``: the same entries, and the store's bytes those
    of ``store_rows`` of them (every stored format the two compressors write; rows across
    blocks and slots, one of them the first entry without its previous block)."""
    from dsv4.cache.formats import index_format, kv_format
    from dsv4.kernels.store_rows import store_rows

    cfg = DSV4Config.preset("tiny")
    comp, rotary = make_compressor(cfg, ratio, for_indexer, DEV)
    jobs = random_jobs(comp, seqs=3, tokens=40, per_kind=2, seed=11, device=DEV)
    e = jobs.entries.shape[0]
    row_fmt = (index_format(fmt, comp.dim, BF16) if for_indexer
               else kv_format(fmt, comp.dim, comp.rope_dim, BF16))
    # the same random bytes in all, so that every byte can be compared
    stores = [_filled_store(comp_store_name(for_indexer), row_fmt, 3) for _ in range(4)]
    slots = torch.arange(e, device=DEV) % 3
    entries = torch.arange(e, device=DEV) // 3 + 2 * (torch.arange(e, device=DEV) % 2)
    args = (comp, jobs.ring, jobs.rows, jobs.ring_src, jobs.call_src, entries, rotary, BF16,
            cfg.simulate_quant, cfg.index_numerics)
    want = compress_entries(*args)
    store_rows(stores[0], slots, entries, want)
    got = compress_entries(*args, store=stores[1], slots=slots)
    assert torch.equal(got, want)
    assert torch.equal(stores[1].data, stores[0].data)
    # skip_slot: the jobs of slot 1 (a padded step's unused jobs) write nothing, the others the
    # same bytes and entries
    kept = slots != 1
    store_rows(stores[2], slots[kept], entries[kept], want[kept])
    got = compress_entries(*args, store=stores[3], slots=slots, skip_slot=1)
    assert torch.equal(got[kept], want[kept])
    assert torch.equal(stores[3].data, stores[2].data)
    assert not torch.equal(stores[3].data, stores[0].data)
    with pytest.raises(ValueError, match="pass the store too"):
        compress_entries(*args, skip_slot=1)
    with pytest.raises(ValueError, match="skip_slot must be an int"):
        compress_entries(*args, store=stores[3], slots=slots, skip_slot=True)
    with pytest.raises(ValueError, match="slots must be int64"):
        compress_entries(*args, store=stores[1], slots=slots[:-1])
    other = PagedStore("other", index_format("fp8", 2 * comp.dim, BF16) if for_indexer
                       else kv_format("bf16", 2 * comp.dim, comp.rope_dim, BF16), 4, 16, 3, 8,
                       torch.device(DEV))
    with pytest.raises(ValueError, match=f"holds rows of {2 * comp.dim} values"):
        compress_entries(*args, store=other, slots=slots)


def comp_store_name(for_indexer: bool) -> str:
    return "idx_keys" if for_indexer else "compressed"


def _filled_store(name: str, fmt, seed: int) -> PagedStore:
    """A store of 3 slots x 16 rows, its bytes random (so that every byte can be compared)."""
    store = PagedStore(name, fmt, 4, 16, 3, 8, torch.device(DEV))
    for slot in range(3):
        store.grow(slot, 4 * 4)
    store.sync()
    store.data.copy_(torch.randint(0, 256, store.data.shape, generator=torch.Generator()
                                   .manual_seed(seed)).to(store.data.dtype))
    return store


@kernel_runs
@pytest.mark.parametrize(("e_main", "e_index", "skip"), [
    (10, 10, None), (10, 6, 1), (4, 9, 2), (0, 5, None), (6, 0, 0), (0, 0, None)])
def test_both_compressors_entries_in_one_launch(e_main, e_index, skip):
    """A C4 layer's main (fp8_ds_mla store) and indexer (fp4 store) compressor in one launch,
    with more jobs on either side or none: each part's entries those of its own launch (under
    the interpreter to the bit; on a GPU the indexer part runs at the main part's 8 warps, so
    as close as the kernel is to ``compress_jobs``), its store holding exactly what
    ``store_rows`` writes of the entries returned, a skipped slot's rows untouched."""
    from dsv4.cache.formats import index_format, kv_format
    from dsv4.kernels.compress_entries import EntryCompress, compress_entries_pair
    from dsv4.kernels.store_rows import store_rows

    cfg = DSV4Config.preset("tiny")
    parts, singles, seed = [], [], 20
    for idx, e, fmt in ((False, e_main, "fp8_ds_mla"), (True, e_index, "fp4")):
        comp, rotary = make_compressor(cfg, 4, idx, DEV, seed=seed)
        jobs = random_jobs(comp, seqs=3, tokens=40, per_kind=3, seed=seed, device=DEV)
        row_fmt = (index_format(fmt, comp.dim, BF16) if idx
                   else kv_format(fmt, comp.dim, comp.rope_dim, BF16))
        name = comp_store_name(idx)
        paired, want_store = _filled_store(name, row_fmt, seed), _filled_store(name, row_fmt, seed)
        slots = torch.arange(e, device=DEV) % 3
        entries = torch.arange(e, device=DEV) // 3 + 2 * (torch.arange(e, device=DEV) % 2)
        job = EntryCompress(comp, jobs.ring, jobs.rows, jobs.ring_src[:e], jobs.call_src[:e],
                            entries, paired, slots, skip)
        single = compress_entries(comp, jobs.ring, jobs.rows, jobs.ring_src[:e],
                                  jobs.call_src[:e], entries, rotary, BF16, cfg.simulate_quant,
                                  cfg.index_numerics)
        parts.append((job, want_store))
        singles.append(single)
        seed += 1
    got = compress_entries_pair(parts[0][0], parts[1][0], rotary, BF16, cfg.simulate_quant,
                                cfg.index_numerics)
    for (job, want_store), single, entries in zip(parts, singles, got, strict=True):
        kept = job.slots != skip if skip is not None else torch.ones_like(job.slots, dtype=bool)
        assert entries.shape == single.shape
        if _INTERPRET:
            assert torch.equal(entries[kept], single[kept])
        elif kept.any():
            compare(entries[kept], single[kept], simulated=True)
        store_rows(want_store, job.slots[kept], job.entries[kept], entries[kept])
        assert torch.equal(job.store.data, want_store.data)


@kernel_runs
def test_a_pair_checks_both_parts_before_launching():
    """A bad second part fails the pair before anything runs: the first part's store keeps
    every byte."""
    from dsv4.cache.formats import kv_format
    from dsv4.kernels.compress_entries import EntryCompress, compress_entries_pair

    cfg = DSV4Config.preset("tiny")
    comp, rotary = make_compressor(cfg, 4, False, DEV)
    jobs = random_jobs(comp, seqs=3, tokens=8, per_kind=1, seed=1, device=DEV)
    store = _filled_store("compressed", kv_format("bf16", comp.dim, comp.rope_dim, BF16), 4)
    before = store.data.clone()
    e = jobs.entries.shape[0]
    good = EntryCompress(comp, jobs.ring, jobs.rows, jobs.ring_src, jobs.call_src,
                         torch.arange(e, device=DEV) % 4, store, torch.arange(e, device=DEV) % 3)
    bad = good._replace(store=None, slots=None, ring_src=jobs.ring_src[:, :3])
    with pytest.raises(ValueError, match="ring_src / call_src"):
        compress_entries_pair(good, bad, rotary, BF16, False, None)
    with pytest.raises(ValueError, match="pass the store too"):
        compress_entries_pair(good, bad._replace(ring_src=jobs.ring_src, skip_slot=0), rotary,
                              BF16, False, None)
    assert torch.equal(store.data, before)
    compress_entries_pair(good, good._replace(store=None, slots=None), rotary, BF16, False,
                          None)
    assert not torch.equal(store.data, before)  # the same call with a good part writes
