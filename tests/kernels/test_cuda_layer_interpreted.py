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
from dsv4.testing.cpu_cuda_layer import build_cpu_cuda_layer, cpu_stand_ins

from conftest import HAS_CUDA, kernel_runs

pytestmark = [kernel_runs, pytest.mark.skipif(HAS_CUDA, reason="the GPU runs the real thing")]


@pytest.fixture
def cpu_cuda_layer(monkeypatch):
    for obj, name, value in cpu_stand_ins():
        monkeypatch.setattr(obj, name, value)
    return build_cpu_cuda_layer


def _record_calls(monkeypatch, module, *names: str) -> list[str]:
    """Wrap ``module``'s functions ``names`` (for the test): each call appends its name to the
    returned list, then runs the function."""
    calls: list[str] = []
    for name in names:
        real = getattr(module, name)

        def spy(*args, _real=real, _name=name, **kw):
            calls.append(_name + ("+store" if kw.get("store") is not None else ""))
            return _real(*args, **kw)

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


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
def test_flat_rows_reach_the_attention_kernel_as_int32(cpu_cuda_layer, monkeypatch, fmt):
    """With a kernel attention backend the window and entry rows are written as int32, what the
    kernels read (no cast launch): the attention kernel gets int32 in every call, the outputs
    and stores are bit-equal to the same layer handing int64 rows."""
    import dsv4.kernels.sparse_mqa as smq
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
    del layer._flat_row_dtype  # the instance's stand-in: the class's method again
    step = SimpleNamespace(pool=layer.new_caches(1, 64)[0].pool)
    assert layer._flat_row_dtype(step) == torch.int32


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_each_stage_is_its_launches(cpu_cuda_layer, monkeypatch, ratio):
    """The launches the platform's stage overrides make per step (the step kernels that fuse
    several override points): the latent norms, then the query heads with the kv rows; both
    compressors' raw rows in one launch; the entries a step completes, both compressors' in
    one, which also stores the window rows (their own launch in an SWA layer); the flat rows
    in one (the window's with the selected or the visible entries'); both rings in one. The
    outputs and stores equal the base path's (``test_step_kernels_on_equal_off``)."""
    import dsv4.platforms.cuda as cuda

    cfg = DSV4Config.preset("tiny")
    calls = _record_calls(monkeypatch, cuda, "fused_latent_norms",
                          "fused_query_heads_and_kv_rows", "raw_rows_pair", "raw_rows",
                          "keep_ring_rows_pair", "keep_ring_rows", "visible_entry_rows",
                          "entry_and_window_rows", "window_flat_rows", "compress_entries",
                          "compress_entries_pair", "store_rows")
    _run(cpu_cuda_layer(cfg, ratio, True), cfg.hidden_size)
    steps = 8
    entries = [c for c in calls if c.startswith("compress_entries")]
    calls = [c for c in calls if not c.startswith("compress_entries")]
    # one launch a step that completes entries, stored in it: C4 both prefills and the decode
    # steps at positions 131 / 23 / 135 (p = 3 mod 4); C128 the 130-token prefill's one
    assert entries == {0: [], 4: ["compress_entries_pair"] * 5,
                       128: ["compress_entries+store"]}[ratio]
    assert calls.count("fused_latent_norms") == steps
    assert calls.count("fused_query_heads_and_kv_rows") == steps
    if ratio == 0:
        assert calls.count("window_flat_rows") == steps
        assert calls.count("store_rows") == steps and len(calls) == 4 * steps
        return
    assert "store_rows" not in calls  # the window rows: in the raw rows' launch
    # C128: every step selects every visible entry; C4: the 20-token prefill (5 entries,
    # index_topk 8), the indexer's top-k in the others
    visible = steps if ratio == 128 else 1
    assert calls.count("visible_entry_rows") == visible
    assert calls.count("entry_and_window_rows") == steps - visible
    assert "window_flat_rows" not in calls
    pair = ratio == 4
    assert calls.count("raw_rows_pair" if pair else "raw_rows") == steps
    assert calls.count("keep_ring_rows_pair" if pair else "keep_ring_rows") == steps
    assert len(calls) == 5 * steps


def test_raw_rows_the_kernels_do_not_take_run_the_base_point(cpu_cuda_layer, monkeypatch):
    """Where a kernel refuses a compressor's raw rows, the cache-write stage takes them from the
    base's ``_raw_rows`` and makes and stores the entries in the same launches as before:
    the same outputs and stores."""
    import dsv4.platforms.cuda as cuda

    cfg = DSV4Config.preset("tiny")
    y1, st1 = _run(cpu_cuda_layer(cfg, 4, True), cfg.hidden_size)
    monkeypatch.setattr(cuda, "raw_rows_problem", lambda comp, score, pos: "refused (test)")
    calls = _record_calls(monkeypatch, cuda, "raw_rows_pair", "raw_rows", "compress_entries",
                          "compress_entries_pair")
    y2, st2 = _run(cpu_cuda_layer(cfg, 4, True), cfg.hidden_size)
    assert "raw_rows_pair" not in calls and "raw_rows" not in calls
    assert calls.count("compress_entries_pair") > 0
    assert not {"compress_entries", "compress_entries+store"} & set(calls)
    assert torch.equal(y1, y2)
    for name in st2:
        assert torch.equal(st1[name], st2[name]), name


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
def test_inverse_rope_in_the_attention_launch(cpu_cuda_layer, monkeypatch, fmt):
    """With our attention kernel, the launch that writes o applies the output path's inverse
    RoPE: no launch of its own. Outputs and stores are bit-equal to the layer rotating o in
    its own launch."""
    import dsv4.kernels.sparse_mqa as smq
    import dsv4.platforms.cuda as cuda
    from dsv4.platforms.cuda_attention import BackendChoice, kernel_format

    cfg = DSV4Config.preset("tiny").replace(kv_cache_dtype=fmt)
    calls = _record_calls(monkeypatch, cuda, "fused_inverse_rope")
    real, rotating = smq.sparse_mqa, []

    def spy(*args, **kw):
        rotating.append(kw.get("inverse_rope") is not None)
        return real(*args, **kw)

    monkeypatch.setattr(smq, "sparse_mqa", spy)

    def build(fold: bool):
        layer = cpu_cuda_layer(cfg, 4, True)
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


def test_the_decode_selection_is_by_ascending_entry(cpu_cuda_layer, monkeypatch):
    """The decode top-k hands each query's entries by ascending index (no sort: the attention
    reads any order), -1 pads last; it vouches for the queries' e4m3 values (the fp8 MMA's
    scores where the pages are copied) exactly when the numerics' simulation is on."""
    import dsv4.platforms.cuda as cuda

    cfg = DSV4Config.preset("tiny")
    assert cfg.simulate_quant
    real, picked, vouched = cuda.indexer_topk, [], []

    def spy(*args, **kw):
        out = real(*args, **kw)
        picked.append(out.clone())
        vouched.append(kw["fp8_queries"])
        return out

    monkeypatch.setattr(cuda, "indexer_topk", spy)
    _run(cpu_cuda_layer(cfg, 4, True), cfg.hidden_size)
    assert len(picked) == 6  # the batched decode steps
    assert vouched == [True] * 6
    vouched.clear()
    _run(cpu_cuda_layer(cfg.replace(simulate_quant=False), 4, True), cfg.hidden_size)
    assert vouched == [False] * 6
    for sel in picked:
        kept = torch.where(sel >= 0, sel, torch.iinfo(torch.long).max)
        assert torch.equal(kept, kept.sort(dim=1).values)


@pytest.mark.parametrize("formats", [("bf16", "bf16"), ("fp8_ds_mla", "fp8")])
def test_padded_runner_steps_equal_eager_steps(cpu_cuda_layer, formats):
    """The decode runner's padded steps (what its CUDA graphs replay: padding slot, padded jobs,
    fixed widths, the decode indexer at every width; verify steps of up to 4 tokens per
    sequence, truncated back) through every step kernel, against the same layers called
    eagerly, as sequences fork and join across entry boundaries."""
    from dsv4.cache.plan import StepPlan
    from dsv4.runner import DecodeRunner

    cfg = DSV4Config.preset("tiny").replace(kv_cache_dtype=formats[0],
                                            index_cache_dtype=formats[1])
    layers = [cpu_cuda_layer(cfg, r, True) for r in (0, 4, 128)]

    def stack(plan, x):
        for lay in layers:
            x = x + lay(x, plan=plan)
        return x

    runner = DecodeRunner(stack, mode="padded", buckets=(2, 4), query_buckets=(1, 4))
    gen = torch.Generator().manual_seed(3)
    h = cfg.hidden_size
    pools = {side: [lay.new_cache_pool(4, 300, max_rollback=3) for lay in layers]
             for side in "ab"}
    seqs: dict[str, list] = {"a": [], "b": []}

    def join(n):
        x = torch.randn(n, h, generator=gen).bfloat16()
        for side in "ab":
            seq = [p.add_sequence() for p in pools[side]]
            seqs[side].append(seq)
            with StepPlan([seq], [n]) as plan:
                stack(plan, x)

    join(126)
    join(7)
    worst = 0.0
    for step in range(16):
        if step == 5:
            for side in "ab":
                seqs[side].append([c.fork() for c in seqs[side][0]])
        if step == 9:
            join(2)
        lens = [1 + (step + i) % 4 if step % 3 == 2 else 1 for i in range(len(seqs["a"]))]
        x = torch.randn(sum(lens), h, generator=gen).bfloat16()
        ya = runner(seqs["a"], x, seq_lens=lens).float()  # every third step a verify step
        pos = torch.cat([torch.arange(s[0].length, s[0].length + n)
                         for s, n in zip(seqs["b"], lens, strict=True)])
        yb = x
        for k, lay in enumerate(layers):
            yb = yb + lay(yb, pos, [s[k] for s in seqs["b"]], lens)
        yb = yb.float()
        for side in "ab":  # keep the first token of each verify step
            for seq, n in zip(seqs[side], lens, strict=True):
                for c in seq:
                    c.truncate(c.length - (n - 1))
        err = ((ya - yb).norm() / yb.norm()).item()
        worst = max(worst, err)
        assert err < 1e-2, (step, err)
    assert runner.stats["padded"] == 16
    for sa, sb in zip(seqs["a"], seqs["b"], strict=True):
        for ca, cb in zip(sa, sb, strict=True):
            assert ca.length == cb.length
            if "compressed" in ca.pool.stores:
                assert ((ca.rows("compressed").float() - cb.rows("compressed").float()).norm()
                        <= 1e-2 * cb.rows("compressed").float().norm())
