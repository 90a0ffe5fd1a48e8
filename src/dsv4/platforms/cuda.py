"""The ``cuda`` platform: each stage of a step (:mod:`dsv4.stages`) in as few launches as its
kernels allow, every launch graph-capturable (decisions on the host, no device syncs).

* Stage 1, the input projections: ``fuse_input_projections`` packs the four input GEMMs;
  decode-sized calls run them as one Triton launch (:mod:`dsv4.kernels.fused_input_proj`).
  Which token counts take the fused launch is planned once, at construction, from a recorded
  benchmark table (``cuda_plan.json``), never re-timed. Larger calls, and layers that are not
  packed, use upstream's stream plan: fused_wqa_wkv on the current stream, the three lighter
  GEMMs on 3 aux streams shared by all layers of a model (created once,
  :meth:`CudaAttention.shared_build_kwargs`), for T <= multi_stream_token_threshold; the
  compressor score GEMMs multiply bf16 by bf16 with an fp32 output. Decode-sized calls replay
  the stage as a CUDA graph captured once per power-of-two token bucket (graphs are dropped
  whenever weights are rebound, and not used under an offloader that moves weights).
* fp8 ``fused_wqa_wkv`` (stream plan), ``wq_b``, the indexer's ``wq_b``, ``wo_a`` (grouped, one
  launch) and ``wo_b`` run through weight-streaming GEMMs that read e4m3 + ue8m0 scales in place
  (:mod:`dsv4.platforms.cuda_linears`: plan, numerics, fallbacks).
* Stage 2: the latent norms are one launch, the query heads' RMS + RoPE and the kv rows' RoPE
  (+ fp8 simulation) one more (:mod:`dsv4.platforms.cuda_elementwise`); where the C4 indexer
  decides, its query is one launch after its GEMM. Where the input stage's aux streams run
  (T <= multi_stream_token_threshold), the ``wq_b`` GEMM and the heads' launch run on aux
  stream 0 instead, the indexer's GEMM and query on aux stream 1, beside the kv rows and the
  cache writes on the step's stream (the step's branch point,
  :class:`~dsv4.stages.QueryAndRows`): the GEMMs' weights stream while those small launches
  run (the heads' branch: a C4 step 2-13 us faster on an H100,
  benchmarks/results/2026-12-07-h100/decode-step-verify/heads-branch/).
* Stage 3: the cache writes are one launch per store (block-table lookup and the format's
  encode in the kernel, the same bytes: :mod:`dsv4.kernels.store_rows`); a C4 layer's two
  compressors' raw rows are one launch, and each compressor's entries one, which also stores
  them (:mod:`dsv4.kernels.compress_entries`).
* Stage 4: the indexer's selection (bf16 queries, an index key format the kernels read) runs
  in Triton over the paged ``idx_keys`` store -
  decode-sized steps (at most ``KERNEL_MAX_TOKENS`` queries, or at most ``VERIFY_MAX_TOKENS`` per
  sequence: decode and verify steps of any batch) in two launches
  (:mod:`dsv4.kernels.indexer_topk`), larger steps with query tiles of one sequence sharing the
  keys, in chunks bounded by ``attention_workspace_bytes`` (:mod:`dsv4.kernels.indexer_prefill`).
  The flat store rows are one launch: the window rows with the selected entries' rows, or with
  every visible entry and its rows (C128 layers, C4 steps that skip the indexer)
  (:mod:`dsv4.kernels.paged_rows`), int32 where the attention kernels read them.
* Stage 5: the backend that ``cfg.attention_backend`` names (torch, triton, flashmla, auto;
  :mod:`dsv4.platforms.cuda_attention`); our kernel applies the output path's inverse RoPE as
  it writes o, otherwise it is one launch of its own; then the fp8 output GEMMs.
* Stage 6: both rings of a C4 layer keep their rows in one launch.

A plain decode call - ``layer(x, positions, caches)`` of at most ``step_graph_max_seqs``
sequences (``cuda_plan.json``) bringing at most 8 tokens each, in one pool and one step, not
under an outer capture, tensor parallelism or an offloader - replays the whole step as a CUDA
graph: the layer's own :class:`~dsv4.runner.DecodeRunner` over that one layer, buckets and
padding as the runner's (its module docstring), the padded step's values (the eager step's to
the rounding of a padded batch). The layers' step graphs on one device share one graph memory
pool (:func:`~dsv4.runner.shared_mempool`), so their scratch memory is one layer's, not one per
layer (calls on one stream at a time, as the runner's ``mempool`` asks). Every other call
(prefill, mixed steps, ``layer(x, plan=plan)``) runs its stages eagerly.
:meth:`CudaAttention.use_step_graphs` sets the limit per layer (the shipped table's: 128; the
whole GPU suite passes with it, H100, 2026-12-06).

float32 / float64 layers, and inputs a kernel does not take, run the base path's PyTorch ops
for that stage or point.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from typing_extensions import override

from dsv4.attention import DeepseekV4Attention
from dsv4.cache.plan import StepPlan
from dsv4.cache.pool import AttentionCache, CachePool
from dsv4.cache.step import CacheStep
from dsv4.cache.store import PagedStore
from dsv4.kernels.compress_entries import (
    EntryCompress,
    RowStore,
    compress_entries,
    compress_entries_pair,
    keep_ring_rows,
    keep_ring_rows_pair,
    keep_ring_rows_problem,
    kernel_unsupported,
    raw_rows,
    raw_rows_pair,
    raw_rows_problem,
)
from dsv4.kernels.fp8_linear import side_stream_workspace
from dsv4.kernels.fused_input_proj import _INTERPRET, SplitKWorkspace, triton_available
from dsv4.kernels.indexer_prefill import select_prefill
from dsv4.kernels.indexer_topk import (
    KERNEL_MAX_TOKENS,
    VERIFY_MAX_TOKENS,
    choose_score_group,
    index_kernel_format,
    indexer_topk,
)
from dsv4.kernels.paged_rows import (
    entry_and_window_rows,
    paged_rows_usable,
    visible_entry_rows,
    window_flat_rows,
)
from dsv4.kernels.store_rows import store_row_problem, store_rows, store_rows_problem
from dsv4.layers.linear import Linear
from dsv4.platforms.cuda_attention import (
    BackendChoice,
    choose_backend,
    flashmla_forward_mqa,
    format_key,
    triton_forward_mqa,
)
from dsv4.platforms.cuda_elementwise import (
    elementwise_usable,
    fused_indexer_query,
    fused_inverse_rope,
    fused_kv_rows,
    fused_latent_norms,
    fused_query_heads,
    fused_query_heads_and_kv_rows,
)
from dsv4.platforms.cuda_linears import (
    FP8_GEMM_MAX_TOKENS,
    WO_A_MAX_TOKENS,
    Fp8LinearPlan,
    fp8_gemm,
    fp8_wo_a_wo_b,
    plan_fp8_linears,
)
from dsv4.runner import (
    DEFAULT_BUCKETS,
    DEFAULT_QUERY_BUCKETS,
    DecodeRunner,
    capture_graph,
    shared_mempool,
)
from dsv4.stages import InputProjections, QueryAndRows, Selection

logger = logging.getLogger(__name__)

def mm_fp32_out(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T with an fp32 output from bf16 operands (products exact in fp32)."""
    return torch.mm(x, weight.t(), out_dtype=torch.float32)


def _plan_value_ok(v: object) -> bool:
    """Whether ``v`` may be a plan field's value: an integer >= 0 (not a bool)."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


@dataclass(frozen=True)
class CudaPlan:
    """Per-layer strategy, fixed at construction."""

    fused_max_tokens: int
    """Calls of at most this many tokens use the one-launch fused input projections."""
    graph_max_tokens: int
    """Calls of at most this many tokens replay a captured CUDA graph of the input stage."""
    triton_attention_max_tokens: int = 0
    """``attention_backend=auto`` with FlashMLA chosen: steps of at most this many query tokens
    run our sparse attention kernel instead (where it measured faster; 0: never)."""
    step_graph_max_seqs: int = 0
    """Plain decode calls of at most this many sequences replay a CUDA graph of the whole step
    (module docstring; 0: never)."""
    fp8_gemm_max_tokens: int = FP8_GEMM_MAX_TOKENS
    """fp8 GEMM calls of at most this many tokens stream the fp8 weight; longer ones run cuBLAS
    on a dequantised copy (:mod:`dsv4.platforms.cuda_linears`)."""
    wo_a_max_tokens: int = WO_A_MAX_TOKENS
    """The same for ``wo_a`` (bf16 activations: its own limit)."""

    def overridden(self, changes: dict[str, int]) -> CudaPlan:
        """This plan with ``changes`` (field -> integer >= 0; a bench's candidate entry).
        Raises ValueError naming an unknown field or a bad value."""
        known = [f.name for f in dataclasses.fields(self)]
        for name, v in changes.items():
            if name not in known:
                raise ValueError(f"cuda plan: no field {name!r} (fields: {', '.join(known)})")
            if not _plan_value_ok(v):
                raise ValueError(f"cuda plan: {name} must be an integer >= 0, got {v!r}")
        return dataclasses.replace(self, **changes)

    @classmethod
    def load(cls, hidden_size: int, path: Path | None = None) -> CudaPlan:
        """The entry of ``hidden_size`` (else ``"default"``) of the plan table at ``path``
        (default: the shipped ``cuda_plan.json``). Raises ValueError naming the file and the
        entry where the table lacks it or a field is not an integer >= 0."""
        path = path or Path(__file__).with_name("cuda_plan.json")
        try:
            table = json.loads(path.read_text())
        except json.JSONDecodeError as ex:
            raise ValueError(f"cuda plan {path}: not valid JSON ({ex})") from None
        key = str(hidden_size) if str(hidden_size) in table else "default"
        entry = table.get(key)
        if entry is None:
            raise ValueError(f"cuda plan {path}: no entry for hidden size {hidden_size} and no "
                             f"'default' entry")
        if not isinstance(entry, dict):
            raise ValueError(f"cuda plan {path}: entry {key!r} must be an object, got "
                             f"{type(entry).__name__}")
        values = {}
        for f in dataclasses.fields(cls):  # the first two are required, the others default
            if f.name not in entry:
                if f.default is dataclasses.MISSING:
                    raise ValueError(f"cuda plan {path}: entry {key!r} lacks {f.name!r}")
                continue
            v = entry[f.name]
            if not _plan_value_ok(v):
                raise ValueError(f"cuda plan {path}: entry {key!r}: {f.name} must be an integer "
                                 f">= 0, got {v!r}")
            values[f.name] = v
        return cls(**values)


class CudaAttention(DeepseekV4Attention):
    platform_name = "cuda"

    def __init__(self, *args: Any, aux_streams: Any = None, plan: CudaPlan | None = None,
                 **kwargs: Any) -> None:
        device = torch.device(kwargs.get("device", "cuda"))
        if aux_streams is None:
            aux_streams = [torch.cuda.Stream(device) for _ in range(3)]
        super().__init__(*args, aux_streams=aux_streams, **kwargs)
        self._fp32_out = self.dtype == torch.bfloat16
        self.plan = plan or CudaPlan.load(self.cfg.hidden_size)
        self._graphs: dict[tuple[int, bool], tuple[Any, torch.Tensor, InputProjections]] = {}
        self._fp8_enabled = True
        self.fp8_plan = Fp8LinearPlan()
        """Which fp8 linears run through the weight-streaming kernels (set after each load)."""
        self._attention_choices: dict[tuple[object, ...], BackendChoice] = {}
        self._step_kernels_enabled = True
        self._step_runner: DecodeRunner | None = None
        """Plain decode calls' graphs (made on first use, dropped when weights change)."""
        self._heads_ready = torch.cuda.Event()
        """Recorded on aux stream 0 after the query heads (stage 2's branch): the layer's own,
        reused every step, as the input stage's events are (stable fork / join edges for graph
        capture, no event made per call)."""
        self._index_query_ready = torch.cuda.Event()
        """As ``_heads_ready``, on aux stream 1 after the indexer's query."""

    def use_fp8_gemms(self, enabled: bool) -> None:
        """Turn the fp8 weight-streaming GEMMs on (the default) or off (the base path:
        dequantise + GEMM per call): comparisons and benchmarks of the earlier path."""
        self._fp8_enabled = enabled

    def use_step_kernels(self, enabled: bool) -> None:
        """Turn the step kernels on (the default) or off (the base path's PyTorch ops): the
        one-launch elementwise stages, the indexer's selection (decode and prefill), the
        compressors' raw rows, entries and ring rows, the cache writes and the flat store rows.
        Comparisons and benchmarks of the earlier path."""
        self._step_kernels_enabled = enabled

    def use_cuda_graphs(self, enabled: bool) -> None:
        """Turn the CUDA graphs of plain calls on (the input stage's, the plan's
        ``graph_max_tokens``; decode steps', its ``step_graph_max_seqs``) or off (every call
        eager, same kernels): graph-vs-eager comparisons and debugging."""
        default = CudaPlan.load(self.cfg.hidden_size)
        self.plan = replace(self.plan,
                            graph_max_tokens=default.graph_max_tokens if enabled else 0,
                            step_graph_max_seqs=default.step_graph_max_seqs if enabled else 0)
        self._graphs = {}
        self._step_runner = None

    def use_step_graphs(self, max_seqs: int) -> int:
        """Plain decode calls of at most ``max_seqs`` sequences replay a CUDA graph of the whole
        step (module docstring); 0: none do. Returns the previous limit. The shipped value:
        ``cuda_plan.json``'s ``step_graph_max_seqs``."""
        if isinstance(max_seqs, bool) or not isinstance(max_seqs, int) or max_seqs < 0:
            raise ValueError(f"use_step_graphs: max_seqs must be an integer >= 0, got "
                             f"{max_seqs!r}")
        previous = self.plan.step_graph_max_seqs
        if max_seqs != previous:
            self.plan = replace(self.plan, step_graph_max_seqs=max_seqs)
            self._step_runner = None
        return previous

    def attention_choice(self, pool: CachePool) -> BackendChoice:
        """The sparse-attention backend for this layer on ``pool``'s stores (host work, cached
        per store format; logged once)."""
        key = format_key(pool.stores)
        choice = self._attention_choices.get(key)
        if choice is None:
            choice = choose_backend(
                self.cfg.attention_backend, dtype=self.dtype, heads=self.n_heads,
                head_dim=self.head_dim, stores=pool.stores, device=self.device,
                kernels_available=triton_available() and self.device.type == "cuda",
                triton_max_tokens=self.plan.triton_attention_max_tokens)
            self._attention_choices[key] = choice
            logger.info("layer %d: %s", self.layer_id, choice.describe())
        return choice

    @override
    @staticmethod
    def shared_build_kwargs(device: torch.device | str) -> dict[str, Any]:
        """Resources shared by every layer of one model: the 3 aux streams."""
        return {"aux_streams": [torch.cuda.Stream(torch.device(device)) for _ in range(3)]}

    @override
    def _after_weights_changed(self) -> None:
        super()._after_weights_changed()
        self._graphs = {}  # captured pointers may be stale
        self._step_runner = None
        on_gpu = triton_available() and self.device.type == "cuda"
        self.fp8_plan = plan_fp8_linears(
            self, on_gpu, "" if on_gpu else "the fp8 kernels need Triton and a CUDA device")

    # ---- host-side tests (no device syncs) --------------------------------------------
    def _fp8_ready(self, name: str, x: torch.Tensor) -> bool:
        """The fp8 kernels take this call of linear ``name`` (the weight-streaming GEMM, or for
        long calls a one-pass dequantised copy + cuBLAS)."""
        return (self._fp8_enabled and name in self.fp8_plan.eligible
                and self.offloader.is_noop)

    def _elementwise_ready(self, x: torch.Tensor) -> bool:
        """The one-launch elementwise kernels take this stage's input."""
        return self._step_kernels_enabled and elementwise_usable(self, x)

    def _paged_kernels_ready(self, t: torch.Tensor) -> bool:
        """The step's data-movement kernels (cache writes, flat rows, raw and ring rows) are on
        and run where ``t`` lives."""
        return self._step_kernels_enabled and paged_rows_usable(t.device)

    # ---- plain decode calls: the whole step as a CUDA graph -----------------------------
    @override
    def _run_pool(self, x: torch.Tensor, pool: CachePool, caches: list[AttentionCache],
                  counts: list[int]) -> torch.Tensor:
        if self._step_graph_usable(x, pool, counts):
            most = self.plan.step_graph_max_seqs
            if self._step_runner is None or self._step_runner.buckets[-1] != most:
                self._step_runner = DecodeRunner(
                    self._planned_step, mode=self.STEP_GRAPH_MODE,
                    buckets=[b for b in DEFAULT_BUCKETS if b < most] + [most],
                    mempool=shared_mempool(x.device) if x.is_cuda else None)
            return self._step_runner([[c] for c in caches], x, seq_lens=counts)
        return super()._run_pool(x, pool, caches, counts)

    STEP_GRAPH_DEVICE = "cuda"
    STEP_GRAPH_MODE = "graphs"
    """Where plain decode calls take the runner, and its mode (the CPU tests: ``"cpu"`` and
    ``"padded"``, the runner's steps without a graph)."""

    def _step_graph_usable(self, x: torch.Tensor, pool: CachePool, counts: list[int]) -> bool:
        """A decode (or verify) step the layer's runner replays (host-side test)."""
        return (0 < len(counts) <= self.plan.step_graph_max_seqs
                and max(counts) <= DEFAULT_QUERY_BUCKETS[-1]
                and x.shape[0] <= pool.step_tokens and x.device.type == self.STEP_GRAPH_DEVICE
                and self.tp is None and self.offloader.is_noop
                and not (x.is_cuda and torch.cuda.is_current_stream_capturing()))

    def _planned_step(self, plan: StepPlan, x: torch.Tensor) -> torch.Tensor:
        return self(x, plan=plan)

    # ---- stage 1: input projections ---------------------------------------------------
    @override
    def _run_parallel_input_projections(self, x: torch.Tensor) -> InputProjections:
        fused = self._input_pack_usable() and x.shape[0] <= self.plan.fused_max_tokens
        stage = self._fused_input_projections_gemm if fused else self._stream_input_projections
        if (x.shape[0] <= self.plan.graph_max_tokens and self.offloader.is_noop
                and not torch.cuda.is_current_stream_capturing()):
            return self._graphed(x, stage, fused)
        return stage(x)

    def _graphed(self, x: torch.Tensor, stage: Callable[[torch.Tensor], InputProjections],
                 fused: bool) -> InputProjections:
        """Replay the input stage from a graph captured for the next power-of-two bucket."""
        m = x.shape[0]
        bucket = 1 << (m - 1).bit_length()
        key = (bucket, fused)
        if key not in self._graphs:
            static_x = torch.zeros(bucket, x.shape[1], dtype=x.dtype, device=x.device)
            side = torch.cuda.Stream(x.device)
            side.wait_stream(torch.cuda.current_stream(x.device))
            with torch.cuda.stream(side):  # warm up (compiles kernels, sizes workspaces)
                stage(static_x)
            torch.cuda.current_stream(x.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with capture_graph(graph):
                outs = stage(static_x)
            self._graphs[key] = (graph, static_x, outs)
        graph, static_x, outs = self._graphs[key]
        static_x[:m].copy_(x)
        graph.replay()
        qr_kv, *rest = outs
        return InputProjections(qr_kv[:m], *(None if o is None else o[:m] for o in rest))

    @override
    def _fused_wqa_wkv_gemm(self, x: torch.Tensor) -> torch.Tensor:
        # the stream plan's main GEMM (calls above plan.fused_max_tokens): the weight-streaming
        # kernel instead of dequantising the fp8 weight per call (two elementwise passes over
        # it, ~40 us of a 64-token Flash step on the H200)
        if self._fp8_ready("fused_wqa_wkv", x):
            return fp8_gemm(self.fused_wqa_wkv, x, self.cfg.act_quant,
                            self.plan.fp8_gemm_max_tokens)
        return super()._fused_wqa_wkv_gemm(x)

    def _score_gemm(self, lin: Linear, x: torch.Tensor) -> torch.Tensor:
        if self._fp32_out:
            return mm_fp32_out(x, lin.weight)
        return lin.forward_fp32(x, self.acc_dtype)

    @override
    def _compressor_kv_score_gemm(self, x: torch.Tensor) -> torch.Tensor:
        assert self.compressor is not None
        return self._score_gemm(self.compressor.fused_wkv_wgate, x)

    @override
    def _indexer_kv_score_gemm(self, x: torch.Tensor) -> torch.Tensor:
        assert self.indexer is not None
        return self._score_gemm(self.indexer.compressor.fused_wkv_wgate, x)

    @override
    def _fused_compressor_score_gemm(self, x: torch.Tensor) -> torch.Tensor:
        w = self._fused_compressor_weight
        assert isinstance(w, torch.Tensor)
        if self._fp32_out:
            return mm_fp32_out(x, w)
        return super()._fused_compressor_score_gemm(x)

    # ---- stage 2: query heads and kv rows ---------------------------------------------
    @override
    def _query_and_kv_rows(self, qr_kv: torch.Tensor, step: CacheStep) -> QueryAndRows:
        # the latent norms in one launch; then, on the step's stream, the wq_b GEMM and one
        # launch of the heads' RMS + RoPE with the kv rows' RoPE (+ fp8 simulation), and the
        # indexer's query where it decides - or, within the token threshold, the heads (GEMM
        # and launch) on aux stream 0, the indexer's query on aux stream 1 and the rows' launch
        # here
        if not self._elementwise_ready(qr_kv):
            return super()._query_and_kv_rows(qr_kv, step)
        pos = step.pos
        qr, kv = fused_latent_norms(self, qr_kv)
        decides = self._indexer_decides(step)
        if not self._branches(qr):
            heads, rows = fused_query_heads_and_kv_rows(self, self._wq_b_gemm(qr), kv, pos)
            index_query = self._indexer_query(qr, pos) if decides else None
            return QueryAndRows(heads, rows, index_query)
        assert self.aux_streams is not None
        heads = self._branch(self.aux_streams[0], self._heads_ready, (qr, pos),
                             lambda: fused_query_heads(self, self._wq_b_gemm(qr), pos))
        index_query = (self._branch(self.aux_streams[1], self._index_query_ready, (qr, pos),
                                    lambda: self._indexer_query(qr, pos)) if decides else None)
        return QueryAndRows(heads, fused_kv_rows(self, kv, pos), index_query, self._heads_ready,
                            self._index_query_ready if decides else None)

    @staticmethod
    def _branch(side: torch.cuda.Stream, done: torch.cuda.Event,
                reads: tuple[torch.Tensor, ...], work: Callable[[], torch.Tensor]
                ) -> torch.Tensor:
        """Run ``work`` on ``side`` once the step's stream has made ``reads``; record ``done``
        after it (the step waits for it before the result's reader). Each tensor that one
        stream allocated and the other uses is recorded on its user, so that the allocator
        does not hand its memory out before that use."""
        main = torch.cuda.current_stream(reads[0].device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            out = work()
        for t in reads:
            t.record_stream(side)
        out.record_stream(main)
        done.record(side)
        return out

    def _branches(self, qr: torch.Tensor) -> bool:
        """Whether stage 2 branches this step: aux streams (the input stage's, free again after
        it) and at most ``multi_stream_token_threshold`` tokens (calls long enough to fill the
        GPU on their own run on one stream). Host-side, no sync."""
        t = qr.shape[0]
        return (self.aux_streams is not None and qr.is_cuda
                and 0 < t <= self.cfg.multi_stream_token_threshold)

    def _gemm_workspace(self, x: torch.Tensor) -> SplitKWorkspace | None:
        """The split-K workspace of a GEMM launched now: a side stream's own while the launch
        is on one of the aux streams (a branch: the step's stream may run a split-K GEMM at the
        same time), else the shared one (None). Host-side, no sync."""
        if self.aux_streams is None or not x.is_cuda:
            return None
        cur = torch.cuda.current_stream(x.device)
        return side_stream_workspace(cur) if any(cur == a for a in self.aux_streams) else None

    @override
    def _wq_b_gemm(self, qr: torch.Tensor) -> torch.Tensor:
        if self._fp8_ready("wq_b", qr):
            return fp8_gemm(self.wq_b, qr, self.cfg.act_quant, self.plan.fp8_gemm_max_tokens,
                            self._gemm_workspace(qr))
        return super()._wq_b_gemm(qr)

    # ---- stage 3: cache writes and compression ----------------------------------------
    @override
    def _write_cache(self, step: CacheStep, kv: torch.Tensor, kv_score: torch.Tensor | None,
                     idx_kv_score: torch.Tensor | None) -> dict[str, torch.Tensor]:
        if not self._step_kernels_enabled:
            return super()._write_cache(step, kv, kv_score, idx_kv_score)
        # the window rows stored by the raw rows' launch where the store kernel takes them
        store = step.pool.stores["kv"]
        window = (RowStore(store, step.tok_slot, step.pos, kv)
                  if self._store_kernel_takes(store, kv) else None)
        raw = self._raw_rows_in_kernels(step, kv_score, idx_kv_score, window)
        if raw is None or window is None:  # not stored by that launch
            self._store_rows_in_kernel(step, "kv", step.tok_slot, step.pos, kv)
        if raw is None:  # a kernel refused a compressor's raw rows: the base's point for them
            raw = self._all_raw_rows(step, kv_score, idx_kv_score)
        self._entries_in_kernels(step, raw)
        return raw

    def _entries_in_kernels(self, step: CacheStep, raw: dict[str, torch.Tensor]) -> None:
        """Every entry the step completes (the base's ``_store_entries``), made and stored in
        one launch (:func:`compress_entries` with its store; a C4 layer's two compressors in
        one, :func:`compress_entries_pair`) where the kernels take both; made by the kernel
        and stored by :meth:`_store_rows_in_kernel` where only the compress kernel does; else
        the base's points. A padded step's entry jobs run every step, so this is one launch a layer
        a step instead of two a compressor, and the unused ones (in the pool's padding slot)
        return at once."""
        comps = self._compressors()
        sim, numerics = self.cfg.simulate_quant, self.cfg.index_numerics
        stored: list[EntryCompress] = []  # made and stored by the kernel: launched below
        for name, rows in raw.items():
            job = step.jobs[name]
            if not job.count:
                continue
            comp = comps[name]
            if kernel_unsupported(comp, rows, self.dtype, sim, numerics) is not None:
                values = self._compress_entries(comp, step, name, rows)
            else:
                store = step.pool.stores[name]
                if not store_row_problem(store, self.dtype, rows.device):
                    stored.append(EntryCompress(comp, step.ring(name), rows, job.ring_src,
                                                job.call_src, job.entries, store, job.slots,
                                                step.pool.pad_slot))
                    continue
                values = compress_entries(comp, step.ring(name), rows, job.ring_src,
                                          job.call_src, job.entries, self.rotary, self.dtype,
                                          sim, numerics)
            self._store_rows_in_kernel(step, name, job.slots, job.entries, values)
        if len(stored) == 2:  # a C4 layer's two compressors
            compress_entries_pair(stored[0], stored[1], self.rotary, self.dtype, sim, numerics)
        elif stored:
            (e,) = stored
            compress_entries(e.comp, e.ring, e.rows, e.ring_src, e.call_src, e.entries,
                             self.rotary, self.dtype, sim, numerics, store=e.store,
                             slots=e.slots, skip_slot=e.skip_slot)

    def _raw_rows_in_kernels(self, step: CacheStep, kv_score: torch.Tensor | None,
                             idx_kv_score: torch.Tensor | None, window: RowStore | None
                             ) -> dict[str, torch.Tensor] | None:
        """Every compressor's raw rows (``_raw_rows``' values) in one launch - a C4 layer's two
        in one - that also stores the ``window`` rows where given, or None where a kernel does
        not take them (nothing launched: the base path then runs)."""
        jobs = self._compressor_jobs(kv_score, idx_kv_score)
        if (not jobs or not self._paged_kernels_ready(step.pos)
                or self.acc_dtype != torch.float32
                or any(raw_rows_problem(comp, score, step.pos) for comp, _, score in jobs)):
            return None
        if len(jobs) == 1:
            comp, name, score = jobs[0]
            return {name: raw_rows(comp, score, step.pos, window)}
        (comp_a, name_a, score_a), (comp_b, name_b, score_b) = jobs
        if comp_a.ratio != comp_b.ratio:
            return None
        rows_a, rows_b = raw_rows_pair((comp_a, score_a), (comp_b, score_b), step.pos, window)
        return {name_a: rows_a, name_b: rows_b}

    def _store_rows_in_kernel(self, step: CacheStep, name: str, slots: torch.Tensor,
                              rows: torch.Tensor, values: torch.Tensor) -> None:
        """The base's :meth:`_store_rows` in one launch (``store_rows``) where the store kernel
        takes the values. Not an override of that point: this stage stores the window rows in
        the raw rows' launch where it can, so the point would not run on every path, and a
        point a platform overrides must (dsv4.testing.contract)."""
        store = step.pool.stores[name]
        if self._store_kernel_takes(store, values):
            store_rows(store, slots, rows, values)
        else:
            self._store_rows(step, name, slots, rows, values)

    def _store_kernel_takes(self, store: PagedStore, values: torch.Tensor) -> bool:
        """Whether the store kernel (``store_rows``, or ``store_row`` inside another launch)
        writes ``values`` into ``store`` on this layer. Host-side, no sync."""
        return self._paged_kernels_ready(values) and not store_rows_problem(store, values)

    # ---- stage 4: selection -----------------------------------------------------------
    @override
    def _select(self, step: CacheStep, index_query: torch.Tensor | None,
                idx_weights: torch.Tensor | None) -> Selection:
        # the flat rows in one launch: the window's alone (SWA), with the selected entries'
        # (the indexer's top-k), or with every visible entry and its rows
        if not self._paged_kernels_ready(step.pos):
            return super()._select(step, index_query, idx_weights)
        dtype = self._flat_row_dtype(step)
        window = (step.pool.stores["kv"], self.window)
        r = self.compress_ratio
        if r == 0:
            rows = window_flat_rows(window[0], step.pos, step.tok_slot, self.window, dtype)
            return Selection(rows, None, None)
        store = step.pool.stores["compressed"]
        if self._indexer_decides(step):
            entries = self._indexer_select(step, *self._indexer_inputs(index_query, idx_weights))
            entry_rows, win = entry_and_window_rows(store, entries, step.pos, step.tok_slot,
                                                    window, dtype)
            return Selection(win, entries, entry_rows)
        visible, rows, with_window = visible_entry_rows(store, step.pos, step.tok_slot,
                                                        step.max_visible(r), r, dtype, window)
        assert with_window is not None
        return Selection(with_window, visible, rows)

    def _flat_row_dtype(self, step: CacheStep) -> torch.dtype:
        """int32 where this platform's attention hands the flat rows to a kernel backend (ours
        and FlashMLA's read int32 indices: the rows then need no cast launch, one per index
        tensor) and every store's rows fit; int64 otherwise. Host work only."""
        if self.attention_choice(step.pool).backend not in ("triton", "flashmla"):
            return torch.int64
        fits = all(s.alloc.num_blocks * s.block_size <= torch.iinfo(torch.int32).max
                   for s in step.pool.stores.values())
        return torch.int32 if fits else torch.int64

    @override
    def _indexer_wq_b_gemm(self, qr: torch.Tensor) -> torch.Tensor:
        if self.indexer is not None and self._fp8_ready("indexer.wq_b", qr):
            return fp8_gemm(self.indexer.wq_b, qr, self.cfg.act_quant,
                            self.plan.fp8_gemm_max_tokens, self._gemm_workspace(qr))
        return super()._indexer_wq_b_gemm(qr)

    @override
    def _indexer_query(self, qr: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        if self._elementwise_ready(qr):
            return fused_indexer_query(self, self._indexer_wq_b_gemm(qr), pos)
        return super()._indexer_query(qr, pos)

    def _indexer_kernel_format(self, step: CacheStep, idx_q: torch.Tensor) -> str:
        """The index key format name the kernels read this step's selection in, or "" for the
        torch path (non-bf16 queries, no Triton or CUDA device, a key store the kernels cannot
        read). Host-side, no sync."""
        if (not self._step_kernels_enabled or self.indexer is None or not triton_available()
                or idx_q.dtype != torch.bfloat16
                or not (idx_q.device.type == "cuda" or _INTERPRET)):
            return ""
        return index_kernel_format(step.pool.stores["idx_keys"].fmt)

    @override
    def _indexer_select(self, step: CacheStep, idx_q: torch.Tensor, idx_weights: torch.Tensor
                        ) -> torch.Tensor:
        fmt = self._indexer_kernel_format(step, idx_q)
        if not fmt:
            return super()._indexer_select(step, idx_q, idx_weights)
        assert self.indexer is not None
        if step.num_tokens > KERNEL_MAX_TOKENS and max(step.counts) > VERIFY_MAX_TOKENS:
            # prefill: query tiles of one sequence share the keys
            return select_prefill(step, idx_q, idx_weights, self.indexer,
                                  self.cfg.attention_workspace_bytes)
        # decode and verify steps (any batch; a verify step's few queries of a sequence share
        # its key tiles in one scoring program - grouped by the padded layout's tokens per
        # sequence where there is one, so that every step of a captured bucket scores as its
        # graph does; an fp8 store's pages are copied by the TMA instead, one query a program,
        # indexer_topk's page_copies_apply, scored by the fp8 MMA where the queries carry the
        # numerics' simulation, whose values e4m3 holds exactly): the entries by ascending
        # index (no sort: the attention reads any order)
        store = step.pool.stores["idx_keys"]
        per_seq = step.meta.query_bucket or max(step.counts)
        return indexer_topk(idx_q, idx_weights, store.data, fmt, store.block_size,
                            store.table_dev, step.tok_slot, step.pos, step.max_visible(4),
                            self.indexer.topk, self.indexer.weight_scale,
                            workspace_bytes=self.cfg.attention_workspace_bytes, sort=False,
                            group=choose_score_group(per_seq),
                            fp8_queries=self.cfg.simulate_quant)

    # ---- stage 5: attention and the output path ---------------------------------------
    @override
    def _attend_and_project(self, q: torch.Tensor, step: CacheStep, selection: Selection
                            ) -> torch.Tensor:
        choice = self.attention_choice(step.pool)
        backend = choice.backend_for(q.shape[0])
        pos = step.pos
        if backend == "triton" and self._rope_in_attention(q):
            # the inverse RoPE in the launch that writes o
            return self._output_gemms(triton_forward_mqa(self, q, step, selection, choice.fmt,
                                                         inverse_rope=(pos, self._inv_freq())))
        if backend == "triton":
            o = triton_forward_mqa(self, q, step, selection, choice.fmt)
        elif backend == "flashmla":
            o = flashmla_forward_mqa(self, q, step, selection, choice.fmt)
        else:
            o = self.forward_mqa(q, step, selection)
        return self._output_gemms(self._inverse_rope(o, pos))

    def _inv_freq(self) -> torch.Tensor:
        inv_freq = self.rotary.inv_freq
        assert isinstance(inv_freq, torch.Tensor)
        return inv_freq

    def _rope_in_attention(self, q: torch.Tensor) -> bool:
        """Our attention kernel can apply the output path's inverse RoPE as it writes o (its
        float32 frequencies, a bf16 layer). Host work only."""
        return self._inv_freq().dtype == torch.float32 and self._elementwise_ready(q)

    def _inverse_rope(self, o: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        # the kernel for every call it takes, long ones too (the torch rotation's slice + cat
        # of o took ~1 ms per 8K-token step on the H200), in place on o's rope dims
        if self._elementwise_ready(o):
            return fused_inverse_rope(self, o, pos)
        return self.rotary.rotate(o, pos, self.acc_dtype, inverse=True)

    def _output_gemms(self, o: torch.Tensor) -> torch.Tensor:
        """``wo_a`` (grouped) and ``wo_b`` of the rotated-back o: the fp8 kernels, or the base
        path's for calls they do not take."""
        if self._fp8_ready("wo_a", o):
            return fp8_wo_a_wo_b(self, o, wo_b=self._fp8_ready("wo_b", o),
                                 stream_max_tokens=self.plan.fp8_gemm_max_tokens,
                                 wo_a_max_tokens=self.plan.wo_a_max_tokens)
        return self._wo_b_product(self._wo_a_grouped(o))

    # ---- stage 6: the rings -----------------------------------------------------------
    @override
    def _keep_rings(self, step: CacheStep, raw: dict[str, torch.Tensor]) -> None:
        copies = [(step.ring(name), rows, step.jobs[name].keep_dst, step.jobs[name].keep_src)
                  for name, rows in raw.items()]
        if not copies:
            return
        if (not self._paged_kernels_ready(copies[0][1])
                or any(keep_ring_rows_problem(*c) is not None for c in copies)):
            super()._keep_rings(step, raw)
        elif len(copies) == 2:
            keep_ring_rows_pair(copies[0], copies[1])
        else:
            keep_ring_rows(*copies[0])
