"""The ``cuda`` platform's whole layer under Triton's CPU interpreter: every step kernel (fused
elementwise stages, raw rows, compressed entries, indexer top-k, cache writes, flat rows) on
against off, prefill then a batched decode of two sequences, per layer type and cache format.

A GPU runs the same comparison in tests/platforms and tests/kernels with the compiled kernels;
this one catches wiring mistakes on a machine without one. The layer is built on the CPU with
stand-ins for what the CPU build of PyTorch lacks (CUDA events, an fp32-output mm, SM count)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dsv4 import DSV4Config
from dsv4.passes import process_weights_after_loading
from dsv4.random_weights import random_layer_weights

from conftest import HAS_CUDA, kernel_runs

pytestmark = [kernel_runs, pytest.mark.skipif(HAS_CUDA, reason="the GPU runs the real thing")]


class _NoEvent:
    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def record(self, *args: object) -> None:
        pass


@pytest.fixture
def cpu_cuda_layer(monkeypatch):
    import dsv4.kernels.fused_input_proj as fip
    import dsv4.kernels.indexer_topk as itk
    import dsv4.kernels.sparse_mqa as smq
    import dsv4.platforms.cuda as cuda

    monkeypatch.setattr(torch.cuda, "Event", _NoEvent)
    monkeypatch.setattr(cuda, "mm_fp32_out", lambda x, w: x.float() @ w.float().t())
    for mod in (fip, itk, smq):
        monkeypatch.setattr(mod, "_n_sm", lambda *_: 132)

    def build(cfg: DSV4Config, ratio: int, kernels: bool) -> cuda.CudaAttention:
        lid = cfg.layer_of_ratio(ratio)
        layer = cuda.CudaAttention(cfg, lid, device="cpu", dtype=torch.bfloat16, aux_streams=[])
        layer.load_weights(random_layer_weights(cfg, lid).items())
        process_weights_after_loading(layer)
        layer.use_cuda_graphs(False)
        layer.aux_streams = None  # one stream: the CPU has none
        layer.use_step_kernels(kernels)
        return layer

    return build


def _record_calls(monkeypatch, module, *names: str) -> list[str]:
    """Wrap ``module``'s functions ``names`` (for the test): each call appends its name to the
    returned list, then runs the function."""
    calls: list[str] = []
    for name in names:
        real = getattr(module, name)

        def spy(*args, _real=real, _name=name):
            calls.append(_name)
            return _real(*args)

        monkeypatch.setattr(module, name, spy)
    return calls


def _run(layer, hidden: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    caches = layer.new_caches(2, 256)
    for store in caches[0].pool.stores.values():
        store.data.zero_()  # rows never written compare equal
    for _, ring in caches[0].pool.rings.values():
        ring.zero_()
    x = torch.randn(180, hidden, generator=torch.Generator().manual_seed(0)).bfloat16()
    ys = [layer(x[:130], torch.arange(130), caches[0]),  # prefill: entries, ring, keys
          layer(x[130:150], torch.arange(20), caches[1])]
    for i in range(6):  # batched decode; sequence 0 completes entry 32
        ys.append(layer(x[150 + 2 * i:152 + 2 * i], torch.tensor([130 + i, 20 + i]), caches,
                        seq_lens=[1, 1]))
    stored = {}
    for name, store in caches[0].pool.stores.items():  # every row of the storage, decoded
        stored[name] = store.read(torch.arange(store.data.shape[0] * store.block_size),
                                  torch.float32)
    for name, (_, ring) in caches[0].pool.rings.items():  # the compressors' ring rows
        stored[f"ring {name}"] = ring.clone()
    return torch.cat(ys).float(), stored


@pytest.mark.parametrize("ratio,formats", [(0, ("bf16", "bf16")), (4, ("bf16", "bf16")),
                                           (4, ("fp8_ds_mla", "fp4")),
                                           (128, ("fp8_ds_mla", "fp8"))])
def test_step_kernels_on_equal_off(cpu_cuda_layer, ratio, formats):
    cfg = DSV4Config.preset("tiny").replace(kv_cache_dtype=formats[0],
                                            index_cache_dtype=formats[1])
    y_on, st_on = _run(cpu_cuda_layer(cfg, ratio, True), cfg.hidden_size)
    y_off, st_off = _run(cpu_cuda_layer(cfg, ratio, False), cfg.hidden_size)
    assert ((y_on - y_off).norm() / y_off.norm()).item() < 1e-3  # inverse RoPE: 1 bf16 ulp
    for name in st_off:  # the stores hold the same rows (a zero's sign may differ)
        assert torch.equal(st_on[name], st_off[name]), name


def test_prequantised_query_latent_is_bit_equal(cpu_cuda_layer, monkeypatch):
    """``use_prequantised_query_latent``: under act_quant the latent-norms launch writes qr in
    e4m3 and both query GEMMs read it instead of quantising in their loops - the same outputs
    and stores bit for bit, and the GEMMs really took it (every step of at most 128 tokens:
    the 20-token prefill, whose 5 entries the indexer would all take, so only wq_b runs, and
    the 6 decode steps, twice each)."""
    import dsv4.platforms.cuda_linears as cl

    cfg = DSV4Config.preset("tiny").replace(act_quant=True)
    real, took = cl.fp8_linear, []

    def spy(x, *args, **kw):
        took.append(kw.get("x_scale") is not None)
        return real(x, *args, **kw)

    monkeypatch.setattr(cl, "fp8_linear", spy)
    runs = []
    for on in (False, True):
        layer = cpu_cuda_layer(cfg, 4, True)
        layer.fp8_plan = cl.plan_fp8_linears(layer, True)  # the streaming GEMMs, interpreted
        assert {"wq_b", "indexer.wq_b"} <= layer.fp8_plan.eligible
        layer.use_prequantised_query_latent(on)
        took.clear()
        runs.append((*_run(layer, cfg.hidden_size), sum(took)))
    (y_off, st_off, n_off), (y_on, st_on, n_on) = runs
    assert n_off == 0 and n_on == 1 + 2 * 6
    assert torch.equal(y_on, y_off)
    for name in st_off:
        assert torch.equal(st_on[name], st_off[name]), name


@pytest.mark.parametrize("qr_fp8", [False, True])
def test_query_gemm_pair_matches_two_launches(cpu_cuda_layer, monkeypatch, qr_fp8):
    """``use_query_gemm_pair``: ``_indexer_wq_b_gemm`` runs both query GEMMs in one launch and
    ``_wq_b_gemm`` (still called, the contract's point) returns the first product. Every step
    of at most 128 tokens that runs the indexer takes it; the stores are bit-equal (they do not
    depend on the queries), the outputs equal up to the fp32 summation order of the tiles."""
    import dsv4.platforms.cuda_linears as cl
    from dsv4.platforms.cuda import CudaAttention

    cfg = DSV4Config.preset("tiny").replace(act_quant=True)
    real, pairs = cl.fp8_linear_pair, []

    def spy(x, *args, **kw):
        pairs.append(kw.get("x_scale") is not None)
        return real(x, *args, **kw)

    orig, calls = CudaAttention._wq_b_gemm, []

    def wq_b_gemm(self, qr):  # the override point, counted
        calls.append(1)
        return orig(self, qr)

    monkeypatch.setattr(cl, "fp8_linear_pair", spy)
    monkeypatch.setattr(CudaAttention, "_wq_b_gemm", wq_b_gemm)
    runs = []
    for on in (False, True):
        layer = cpu_cuda_layer(cfg, 4, True)
        layer.fp8_plan = cl.plan_fp8_linears(layer, True)  # the streaming GEMMs, interpreted
        layer.use_query_gemm_pair(on)
        layer.use_prequantised_query_latent(qr_fp8)
        pairs.clear()
        calls.clear()
        runs.append((*_run(layer, cfg.hidden_size), list(pairs), len(calls)))
    (y_off, st_off, p_off, c_off), (y_on, st_on, p_on, c_on) = runs
    # 8 steps; the 130-token prefill is above the streaming GEMMs' tokens and the 20-token
    # one runs no indexer (5 entries visible, index_topk 8): 6 decode steps take the pair
    assert p_off == [] and p_on == [qr_fp8] * 6 and c_off == c_on == 8
    # a platform that redefines the wq_b GEMM keeps it: no pair launch runs around it
    qr = torch.zeros(3, cfg.q_lora_rank, dtype=torch.bfloat16)
    assert layer._query_pair_ready(qr)

    class OwnQueryGemm(CudaAttention):
        def _wq_b_gemm(self, qr):
            return super()._wq_b_gemm(qr)

    layer.__class__ = OwnQueryGemm
    assert not layer._query_pair_ready(qr)
    assert ((y_on - y_off).norm() / y_off.norm()).item() < 1e-2
    for name in st_off:
        assert torch.equal(st_on[name], st_off[name]), name


def _selections(cpu_cuda_layer, monkeypatch, switch: str, keyword: str, default: bool):
    """For ``switch`` (a ``CudaAttention.use_*`` method) on then off: the layer's outputs and
    stores after ``_run`` and each decode-step ``indexer_topk`` call's (``keyword`` value,
    selection)."""
    import dsv4.platforms.cuda as cuda

    cfg = DSV4Config.preset("tiny")
    real, picked = cuda.indexer_topk, []

    def spy(*args, **kw):
        out = real(*args, **kw)
        picked.append((kw.get(keyword, default), out.clone()))
        return out

    monkeypatch.setattr(cuda, "indexer_topk", spy)
    runs = []
    for on in (True, False):
        layer = cpu_cuda_layer(cfg, 4, True)
        getattr(layer, switch)(on)
        picked.clear()
        runs.append((*_run(layer, cfg.hidden_size), list(picked)))
    return runs


def test_unsorted_selection_takes_the_same_entries(cpu_cuda_layer, monkeypatch):
    """``use_sorted_selection(False)``: the decode top-k hands each query's entries by
    ascending index instead of by score - the same sets in every decode step, the stores
    bit-equal, the outputs equal up to the attention's fp32 summation order."""
    # the default since session 34 (the sort is time spent for the same sets)
    assert cpu_cuda_layer(DSV4Config.preset("tiny"), 4, True)._sorted_selection is False
    (y_on, st_on, p_on), (y_off, st_off, p_off) = _selections(
        cpu_cuda_layer, monkeypatch, "use_sorted_selection", "sort", True)
    # the 6 batched decode steps (the 130-token prefill takes the prefill kernels, the
    # 20-token one sees 5 entries, index_topk 8: no indexer)
    assert [s for s, _ in p_on] == [True] * 6 and [s for s, _ in p_off] == [False] * 6
    reordered = False
    for (_, a), (_, b) in zip(p_on, p_off, strict=True):
        assert torch.equal(a.sort(dim=1).values, b.sort(dim=1).values)
        kept = torch.where(b >= 0, b, torch.iinfo(torch.long).max)
        assert torch.equal(kept, kept.sort(dim=1).values)  # ascending, -1 pads last
        reordered |= not torch.equal(a, b)
    assert reordered  # the scores' order is not the index order somewhere
    assert ((y_on - y_off).norm() / y_off.norm()).item() < 1e-2
    for name in st_off:
        assert torch.equal(st_on[name], st_off[name]), name


def test_held_topk_rows_change_nothing_but_speed(cpu_cuda_layer, monkeypatch):
    """``use_held_topk_rows(True)``: the decode top-k programs hold their rows in registers -
    the same selections (order included) in every decode step, the same outputs and stores,
    bit for bit."""
    (y_on, st_on, p_on), (y_off, st_off, p_off) = _selections(
        cpu_cuda_layer, monkeypatch, "use_held_topk_rows", "hold", False)
    assert [h for h, _ in p_off] == [False] * 6 and [h for h, _ in p_on] == [True] * 6
    for (_, a), (_, b) in zip(p_off, p_on, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(y_on, y_off)
    for name in st_off:
        assert torch.equal(st_on[name], st_off[name]), name


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
def test_flat_rows_reach_the_attention_kernel_as_int32(cpu_cuda_layer, monkeypatch, fmt):
    """With a kernel attention backend the window and entry rows are written as int32, what the
    kernels read (no cast launch): the attention kernel gets int32 in every call, the outputs
    and stores are bit-equal to the same layer handing int64 rows; a subclass with its own
    ``forward_mqa`` keeps the contract's int64."""
    import dsv4.kernels.sparse_mqa as smq
    from dsv4.platforms.cuda import CudaAttention
    from dsv4.platforms.cuda_attention import BackendChoice, kernel_format

    cfg = DSV4Config.preset("tiny").replace(kv_cache_dtype=fmt)
    real, seen = smq.sparse_mqa, []

    def spy(q, win, win_idx, cmp, cmp_idx, *args, **kw):
        seen.append((win_idx.dtype, None if cmp_idx is None else cmp_idx.dtype))
        return real(q, win, win_idx, cmp, cmp_idx, *args, **kw)

    monkeypatch.setattr(smq, "sparse_mqa", spy)
    runs = []
    for int32 in (True, False):
        layer = cpu_cuda_layer(cfg, 4, True)
        layer.attention_choice = lambda pool: BackendChoice(  # the GPU's choice, interpreted
            "triton", "triton", kernel_format(pool.stores["kv"])[0])
        if not int32:
            layer._flat_row_dtype = lambda step: torch.int64
        seen.clear()
        runs.append((*_run(layer, cfg.hidden_size), list(seen)))
    (y32, st32, seen32), (y64, st64, seen64) = runs
    assert seen32 == [(torch.int32, torch.int32)] * 8
    assert seen64 == [(torch.int64, torch.int64)] * 8
    assert torch.equal(y32, y64)
    for name in st64:
        assert torch.equal(st32[name], st64[name]), name

    class OwnAttention(CudaAttention):
        def forward_mqa(self, q, step, selection):
            return super().forward_mqa(q, step, selection)

    layer.__class__ = OwnAttention
    del layer._flat_row_dtype  # the instance's stand-in: the class's method again
    step = SimpleNamespace(pool=layer.new_caches(1, 64)[0].pool)
    assert layer._flat_row_dtype(step) == torch.int64
    layer.__class__ = CudaAttention
    assert layer._flat_row_dtype(step) == torch.int32


def test_query_heads_and_kv_rows_share_a_launch(cpu_cuda_layer, monkeypatch):
    """Every step's kv rows are rotated in the query heads' launch and ``_kv_rows`` (still
    called: the contract's point) hands them back; no launch of their own. The outputs and
    stores are bit-equal to the layer rotating them in their own launch; a subclass that
    redefines ``_kv_rows`` gets its own call."""
    import dsv4.platforms.cuda as cuda
    from dsv4.platforms.cuda import CudaAttention

    cfg = DSV4Config.preset("tiny").replace(simulate_quant=True)
    calls = _record_calls(monkeypatch, cuda, "fused_query_heads_and_kv_rows", "fused_query_heads",
                          "fused_kv_rows")
    orig, asked = CudaAttention._kv_rows, []

    def kv_rows(self, kv, pos):  # the override point, counted
        asked.append(1)
        return orig(self, kv, pos)

    runs = []
    for fused in (True, False):
        layer = cpu_cuda_layer(cfg, 4, True)
        if not fused:
            layer._kv_rows_fusable = lambda kv, q: False
        calls.clear()
        runs.append((*_run(layer, cfg.hidden_size), list(calls)))
    (y1, st1, c1), (y2, st2, c2) = runs
    assert c1 == ["fused_query_heads_and_kv_rows"] * 8
    assert c2 == ["fused_query_heads", "fused_kv_rows"] * 8
    assert torch.equal(y1, y2)
    for name in st2:
        assert torch.equal(st1[name], st2[name]), name
    # a subclass's own _kv_rows is called for the rows, and the launch does not rotate them
    monkeypatch.setattr(CudaAttention, "_kv_rows", kv_rows)

    class OwnRows(CudaAttention):
        def _kv_rows(self, kv, pos):
            return super()._kv_rows(kv, pos)

    layer = cpu_cuda_layer(cfg, 4, True)
    layer.__class__ = OwnRows
    calls.clear()
    y3, st3 = _run(layer, cfg.hidden_size)
    assert calls == ["fused_query_heads", "fused_kv_rows"] * 8 and len(asked) == 8
    assert torch.equal(y3, y2)


@pytest.mark.parametrize("ratio", [4, 128])
def test_visible_entries_and_their_rows_share_a_launch(cpu_cuda_layer, monkeypatch, ratio):
    """Where the selection is every visible entry (C128; C4 steps that skip the indexer) the
    selection and its flat rows are one launch, and ``_entry_rows`` of that selection (still
    called) hands the rows back; a subclass that redefines ``_entry_rows`` gets the two
    launches. The launch making the entry rows makes the window rows too (``_window_rows``,
    still called, hands them back) unless a subclass redefines ``_window_rows``. Outputs and
    stores bit-equal in every variant."""
    import dsv4.platforms.cuda as cuda
    from dsv4.platforms.cuda import CudaAttention

    cfg = DSV4Config.preset("tiny")
    calls = _record_calls(monkeypatch, cuda, "visible_entry_rows", "visible_entries",
                          "entry_flat_rows", "entry_and_window_rows", "window_flat_rows")

    class OwnEntryRows(CudaAttention):
        def _entry_rows(self, step, entries):
            return super()._entry_rows(step, entries)

    class OwnWindowRows(CudaAttention):
        def _window_rows(self, step):
            return super()._window_rows(step)

    runs = []
    for cls in (CudaAttention, OwnEntryRows, OwnWindowRows):
        layer = cpu_cuda_layer(cfg, ratio, True)
        layer.__class__ = cls
        calls.clear()
        runs.append((*_run(layer, cfg.hidden_size), list(calls)))
    (y1, st1, c1), (y2, st2, c2), (y3, st3, c3) = runs
    # C128: every step; C4: the 20-token prefill (5 entries, index_topk 8), then the indexer
    visible = 1 if ratio == 4 else 8
    assert c1.count("visible_entry_rows") == visible and "visible_entries" not in c1
    assert c1.count("entry_and_window_rows") == 8 - visible
    assert "entry_flat_rows" not in c1 and "window_flat_rows" not in c1
    # a subclass's own _entry_rows: the selection alone, its rows with the window's
    assert c2.count("visible_entries") == visible and "visible_entry_rows" not in c2
    assert c2.count("entry_and_window_rows") == 8 and "window_flat_rows" not in c2
    # a subclass's own _window_rows: a launch of its own
    assert c3.count("visible_entry_rows") == visible and c3.count("window_flat_rows") == 8
    assert c3.count("entry_flat_rows") == 8 - visible
    for y, st in ((y2, st2), (y3, st3)):
        assert torch.equal(y1, y)
        for name in st:
            assert torch.equal(st1[name], st[name]), name


def test_both_compressors_raw_rows_share_a_launch(cpu_cuda_layer, monkeypatch):
    """A C4 step's main and indexer compressor raw rows are one launch; ``_raw_rows`` of the
    indexer's (still called) hands its rows back; at the step's end both rings keep their rows
    in one launch too. Outputs, stores and rings bit-equal to one launch each."""
    import dsv4.platforms.cuda as cuda
    from dsv4.platforms.cuda import CudaAttention

    cfg = DSV4Config.preset("tiny")
    calls = _record_calls(monkeypatch, cuda, "raw_rows_pair", "raw_rows", "keep_ring_rows_pair",
                          "keep_ring_rows")
    asked = []
    orig = CudaAttention._raw_rows

    def counted(self, comp, kv_score, pos):
        asked.append(comp is self.compressor)
        return orig(self, comp, kv_score, pos)

    monkeypatch.setattr(CudaAttention, "_raw_rows", counted)

    class Unpaired(CudaAttention):  # the input stage hands no indexer scores to pair
        def _run_parallel_input_projections(self, x):
            out = super()._run_parallel_input_projections(x)
            self._handoffs.take("idx_score", ())
            return out

    runs = []
    for paired in (True, False):
        layer = cpu_cuda_layer(cfg, 4, True)
        if not paired:
            layer.__class__ = Unpaired
        calls.clear()
        asked.clear()
        runs.append((*_run(layer, cfg.hidden_size), list(calls), list(asked)))
    (y1, st1, c1, a1), (y2, st2, c2, a2) = runs
    assert c1 == ["raw_rows_pair", "keep_ring_rows_pair"] * 8
    assert c2 == ["raw_rows", "raw_rows", "keep_ring_rows", "keep_ring_rows"] * 8
    assert a1 == a2 == [True, False] * 8  # both override calls in every step
    assert any("ring" in name for name in st1)  # the rings themselves compared below
    assert torch.equal(y1, y2)
    for name in st2:
        assert torch.equal(st1[name], st2[name]), name
    # an instance attribute standing in for _keep_ring_rows (a spy, a patch) sees both calls
    # do their own work: the rings' rows are not kept ahead of the indexer ring's call
    layer = cpu_cuda_layer(cfg, 4, True)
    layer._keep_ring_rows = lambda step, name, rows: counted_keep(layer, step, name, rows)
    kept: list[str] = []

    def counted_keep(layer, step, name, rows):
        kept.append(name)
        return CudaAttention._keep_ring_rows(layer, step, name, rows)

    calls.clear()
    y3, st3 = _run(layer, cfg.hidden_size)
    assert kept == ["compressed", "idx_keys"] * 8
    assert calls.count("keep_ring_rows") == 16 and "keep_ring_rows_pair" not in calls
    assert torch.equal(y3, y2) and all(torch.equal(st3[n], st2[n]) for n in st2)


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
def test_inverse_rope_in_the_attention_launch(cpu_cuda_layer, monkeypatch, fmt):
    """With our attention kernel, the launch that writes o applies the output path's inverse
    RoPE and ``_inverse_rope`` (still called) hands that o back: no launch of its own. Outputs
    and stores are bit-equal to the layer rotating o in its own launch; a subclass that
    redefines ``_inverse_rope`` gets the unrotated o and its own call."""
    import dsv4.kernels.sparse_mqa as smq
    import dsv4.platforms.cuda as cuda
    from dsv4.platforms.cuda import CudaAttention
    from dsv4.platforms.cuda_attention import BackendChoice, kernel_format

    cfg = DSV4Config.preset("tiny").replace(kv_cache_dtype=fmt)
    calls = _record_calls(monkeypatch, cuda, "fused_inverse_rope")
    real, rotating = smq.sparse_mqa, []

    def spy(*args, **kw):
        rotating.append(kw.get("inverse_rope") is not None)
        return real(*args, **kw)

    monkeypatch.setattr(smq, "sparse_mqa", spy)

    def build(fold: bool, cls=CudaAttention):
        layer = cpu_cuda_layer(cfg, 4, True)
        layer.__class__ = cls
        layer.attention_choice = lambda pool: BackendChoice(  # the GPU's choice, interpreted
            "triton", "triton", kernel_format(pool.stores["kv"])[0])
        if not fold:
            layer._rope_in_attention = lambda q: False
        calls.clear()
        rotating.clear()
        return layer

    y1, st1 = _run(build(True), cfg.hidden_size)
    assert (calls, rotating) == ([], [True] * 8)
    y2, st2 = _run(build(False), cfg.hidden_size)
    assert (calls, rotating) == (["fused_inverse_rope"] * 8, [False] * 8)
    assert torch.equal(y1, y2)
    for name in st2:
        assert torch.equal(st1[name], st2[name]), name

    asked = []

    class OwnRope(CudaAttention):
        def _inverse_rope(self, o, pos):
            asked.append(1)
            return super()._inverse_rope(o, pos)

    y3, _ = _run(build(True, OwnRope), cfg.hidden_size)
    assert (calls, rotating, len(asked)) == (["fused_inverse_rope"] * 8, [False] * 8, 8)
    assert torch.equal(y3, y2)
