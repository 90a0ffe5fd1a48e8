"""The ``cuda`` platform.

* ``fuse_input_projections`` packs the four input GEMMs; decode-sized calls run them as one Triton
  launch (``dsv4.kernels.fused_input_proj``). Which token counts take the fused launch is planned
  once, at construction, from a recorded benchmark table (``cuda_plan.json``), never re-timed.
* Larger calls, and layers that are not packed, use upstream's stream plan: fused_wqa_wkv on the
  current stream, the three lighter GEMMs on 3 aux streams shared by all layers of a model
  (created once, :meth:`CudaAttention.shared_build_kwargs`), for T <= multi_stream_token_threshold.
* Compressor score GEMMs multiply bf16 by bf16 with an fp32 output (``torch.mm(out_dtype=...)``).
* The input-projection stage of decode-sized calls runs as a CUDA graph, captured once per
  power-of-two token bucket (attention stays eager, as in upstream's piecewise graphs). Graphs
  are dropped whenever weights are rebound, and not used under an offloader that moves weights.
* fp8 ``wq_b``, ``wo_a`` (grouped, one launch), ``wo_b`` and the indexer's ``wq_b`` run through
  weight-streaming GEMMs that read e4m3 + ue8m0 scales in place for decode-sized calls
  (:mod:`dsv4.platforms.cuda_linears`: plan, numerics, fallbacks).
* The small elementwise stages (latent norms, query heads' RMS + RoPE, kv rows' RoPE + fp8
  simulation, indexer queries' RoPE + numerics, the output's inverse RoPE) run as one Triton
  launch each on bf16 layers (:mod:`dsv4.platforms.cuda_elementwise`); the query heads and the
  kv rows share one: ``_query_heads`` rotates the rows ``_latent_norms`` returned beside the
  heads and hands them to ``_kv_rows`` of the same rows and positions (identity-matched).

* ``_compress_entries`` builds a step's compressed entries (main and indexer compressor) in one
  Triton launch (:mod:`dsv4.kernels.compress_entries`) for bf16 layers; other dtypes take the
  base path. ``_raw_rows`` (the score GEMM's rows plus ape: a C4 layer's two compressors in one
  launch, the indexer's handed to its own call by identity) and ``_keep_ring_rows`` (the rows
  the rings keep, at the end of a step: both rings in one launch at the main ring's call, which
  the step makes just before the indexer ring's; that call then does nothing).
* ``forward_mqa`` runs the backend that ``cfg.attention_backend`` names (torch, triton, flashmla,
  auto; :mod:`dsv4.platforms.cuda_attention`).
* ``_store_rows`` (a step's window rows, compressed entries and indexer keys into their paged
  stores) is one Triton launch per store: block-table lookup and the format's encode in the
  kernel, the same bytes (:mod:`dsv4.kernels.store_rows`). ``_window_rows`` and
  ``_entry_rows`` (the flat store rows the attention reads) are one launch each
  (:mod:`dsv4.kernels.paged_rows`), int32 where the platform's own attention kernels read them
  (no cast launch per index tensor). Where the selection is every visible entry
  (``_visible_entries``: C128 layers, C4 steps that skip the indexer) the selection and its
  flat rows are one launch, handed to ``_entry_rows`` of that selection (identity-matched);
  the launch that makes the entry rows also makes the window rows, handed to ``_window_rows``
  of the step (so a compressed layer's flat rows are one launch).
* The C4 indexer's selection (bf16 queries, an index key format the kernels read) runs in
  Triton over the paged ``idx_keys`` store: decode-sized steps (at most ``KERNEL_MAX_TOKENS``
  queries) in two launches (:mod:`dsv4.kernels.indexer_topk`), larger steps with query tiles of
  one sequence sharing the keys, in chunks bounded by ``attention_workspace_bytes``
  (:mod:`dsv4.kernels.indexer_prefill`); float32 / float64 layers take the torch path.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from dsv4.attention import DeepseekV4Attention
from dsv4.cache.pool import CachePool
from dsv4.cache.step import CacheStep
from dsv4.cache.store import PagedStore
from dsv4.kernels.compress_entries import (
    compress_entries,
    keep_ring_rows,
    keep_ring_rows_pair,
    keep_ring_rows_problem,
    kernel_unsupported,
    raw_rows,
    raw_rows_pair,
    raw_rows_problem,
)
from dsv4.kernels.fused_input_proj import _INTERPRET, triton_available
from dsv4.kernels.indexer_prefill import select_prefill
from dsv4.kernels.indexer_topk import KERNEL_MAX_TOKENS, index_kernel_format, indexer_topk
from dsv4.kernels.paged_rows import (
    entry_and_window_rows,
    entry_flat_rows,
    paged_rows_usable,
    visible_entries,
    visible_entry_rows,
    window_flat_rows,
)
from dsv4.kernels.store_rows import store_rows, store_rows_problem
from dsv4.layers.compressor import Compressor
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
    fused_latent_norms_q_fp8,
    fused_query_heads,
    fused_query_heads_and_kv_rows,
)
from dsv4.platforms.cuda_linears import (
    FP8_GEMM_MAX_TOKENS,
    Fp8LinearPlan,
    fp8_gemm,
    fp8_query_pair,
    fp8_wo_a_wo_b,
    plan_fp8_linears,
)
from dsv4.platforms.handoff import StepHandoffs

logger = logging.getLogger(__name__)

InputProjections = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                         torch.Tensor | None]


def mm_fp32_out(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T with an fp32 output from bf16 operands (products exact in fp32)."""
    return torch.mm(x, weight.t(), out_dtype=torch.float32)


@contextlib.contextmanager
def capture_graph(graph: torch.cuda.CUDAGraph) -> Iterator[None]:
    """``torch.cuda.graph(graph)`` with Python's garbage collector paused during the capture.

    A collection that runs mid-capture can free tensors of earlier work that other streams
    used; the allocator's event calls then invalidate the capture (seen on the H200 as
    ``cudaErrorStreamCaptureInvalidated`` in a long test session). ``torch.cuda.graph`` collects
    once before it starts, so nothing is left waiting."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph):
            yield
    finally:
        if enabled:
            gc.enable()


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
        values = []
        for field, required in (("fused_max_tokens", True), ("graph_max_tokens", True),
                                ("triton_attention_max_tokens", False)):
            if field not in entry and required:
                raise ValueError(f"cuda plan {path}: entry {key!r} lacks {field!r}")
            v = entry.get(field, 0)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"cuda plan {path}: entry {key!r}: {field} must be an integer "
                                 f">= 0, got {v!r}")
            values.append(v)
        return cls(*values)


class CudaAttention(DeepseekV4Attention):
    platform_name = "cuda"
    HELPERS = ("_score_gemm", "_graphed", "use_cuda_graphs", "use_fp8_gemms", "_fp8_ready",
               "attention_choice", "use_step_kernels", "_elementwise_ready",
               "_inverse_rope", "_indexer_kernel_format", "_paged_kernels_ready",
               "use_prequantised_query_latent", "_qr_fp8_for", "use_query_gemm_pair",
               "_query_pair_ready", "use_sorted_selection", "use_held_topk_rows",
               "_flat_row_dtype", "_kv_rows_fusable", "_window_with_entries",
               "_rope_in_attention", "_own")

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
        self._qr_fp8_enabled = False
        self._q_pair_enabled = False
        self._sorted_selection = False
        self._held_topk_rows = False
        self._handoffs = StepHandoffs()
        """What one override point made ahead for a later one of the same step, by name
        (:mod:`dsv4.platforms.handoff`; cleared as each step's input stage starts):

        * ``qr_fp8``: (qr) -> qr's fp8 form, from ``_latent_norms`` for both query GEMMs
          (``use_prequantised_query_latent``; peeked, not taken);
        * ``wq_b``: (qr) -> the wq_b product, from ``_indexer_wq_b_gemm``'s pair launch for
          ``_wq_b_gemm`` (``use_query_gemm_pair``);
        * ``kv_norms``: () -> the kv rows ``_latent_norms`` returned, for ``_query_heads``;
        * ``kv_rows``: (kv, pos) -> those rows rotated beside the query heads, for
          ``_kv_rows``;
        * ``idx_score``: () -> the indexer compressor's score rows the input stage returned,
          for ``_raw_rows`` of the main compressor;
        * ``idx_raw_rows``: (score, pos) -> the indexer's raw rows made in that launch, for
          ``_raw_rows`` of the indexer compressor;
        * ``idx_ring_rows``: (main raw rows) -> the indexer's, for ``_keep_ring_rows`` of the
          main ring to keep both rings' rows in one launch;
        * ``idx_ring_kept``: (step, indexer raw rows) -> True: the indexer ring's own call then
          does nothing;
        * ``entry_rows``: (entries) -> their flat rows, made with the selection by
          ``_visible_entries``, for ``_entry_rows``;
        * ``window_rows``: (step) -> the step's window rows, made in the entry rows' launch,
          for ``_window_rows``;
        * ``o_rotated``: (o, pos) -> True: our attention kernel wrote o with the output path's
          inverse RoPE already applied (``forward_mqa``), so ``_inverse_rope`` of this very o
          returns it as is."""

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

    def use_prequantised_query_latent(self, enabled: bool) -> None:
        """Under ``act_quant``: the latent-norms launch also writes qr quantised (e4m3 + a
        power-of-two scale per 128, §6.3) and ``wq_b`` and the indexer's ``wq_b`` read it
        instead of each quantising qr in their loops (the same outputs, bit for bit; no extra
        launch). Off by default until timed on a GPU (the decode-step bench's
        ``ours_flashmla_act8_qpre_pdl``)."""
        self._qr_fp8_enabled = enabled
        self._handoffs.clear()

    def use_query_gemm_pair(self, enabled: bool) -> None:
        """``wq_b`` and the indexer's ``wq_b`` (both multiply qr) in one streaming launch in
        steps that run the indexer (the base step asks for the indexer's query first):
        ``_indexer_wq_b_gemm`` runs both and ``_wq_b_gemm`` returns the first product for the
        same qr. Only where both are fp8 linears the kernels take and the platform subclass
        does not redefine ``_wq_b_gemm`` (its own kernel must see its calls). The products may
        differ from their own launches' in the fp32 summation order (the tiles are chosen for
        both weights' rows). Off by default until timed on a GPU (the decode-step bench's
        ``ours_flashmla_act8_qpair_pdl``)."""
        self._q_pair_enabled = enabled
        self._handoffs.clear()

    def use_sorted_selection(self, enabled: bool) -> None:
        """The indexer's decode top-k kernels hand each query's entries by ascending entry
        index, skipping the kernel's final sort (the default), or, on, ordered by score,
        highest first (torch.topk's order, which the reference path and the prefill kernels
        give). The same entry sets either way; the attention reads them in any order (only
        its fp32 sums' rounding can change). Off by default since session 34: the sort is
        time the step spends for no change in what it computes (Pro, context 64K, 16 tokens,
        one H200: 345.9 -> 323.9 us without it, session 31; the decode-step bench's
        ``ours_flashmla_act8_sort_pdl`` times it on)."""
        self._sorted_selection = enabled

    def use_held_topk_rows(self, enabled: bool) -> None:
        """The indexer's decode top-k programs read their row or chunk once into registers
        for every radix pass (``topk_entries(hold=True)``; the same selection, bit for bit)
        instead of once per pass. Off by default until timed on a GPU (the decode-step
        bench's ``ours_flashmla_act8_hold_pdl``)."""
        self._held_topk_rows = enabled

    def _own(self, *names: str) -> bool:
        """Host-side: none of the override points ``names`` is redefined - by a subclass or by
        an instance attribute (a spy, a patch) - so this platform's own code answers each of
        them: the condition for doing one's work early in another's launch and handing it on."""
        return all(getattr(type(self), n) is getattr(CudaAttention, n)
                   and n not in self.__dict__ for n in names)

    def _query_pair_ready(self, qr: torch.Tensor) -> bool:
        """Host-side: this call of ``_indexer_wq_b_gemm`` may run the pair launch."""
        return (self._q_pair_enabled and self.indexer is not None and self._own("_wq_b_gemm")
                and qr.shape[0] <= FP8_GEMM_MAX_TOKENS
                and self._fp8_ready("wq_b", qr) and self._fp8_ready("indexer.wq_b", qr))

    def _qr_fp8_for(self, name: str, qr: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The fp8 form of ``qr`` for the streaming GEMM of linear ``name``, where the latent
        norms made one for this very tensor (they do so only under ``act_quant`` and for calls
        the kernel streams) and ``name`` runs through the fp8 kernels."""
        if name not in self.fp8_plan.eligible:
            return None
        return self._handoffs.peek("qr_fp8", (qr,))

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

    def use_cuda_graphs(self, enabled: bool) -> None:
        """Turn the input stage's CUDA graphs on (the plan's ``graph_max_tokens``) or off (every
        call eager, same kernels): graph-vs-eager comparisons and debugging."""
        default = CudaPlan.load(self.cfg.hidden_size).graph_max_tokens
        self.plan = replace(self.plan, graph_max_tokens=default if enabled else 0)
        self._graphs = {}

    @staticmethod
    def shared_build_kwargs(device: torch.device | str) -> dict[str, Any]:
        """Resources shared by every layer of one model: the 3 aux streams."""
        return {"aux_streams": [torch.cuda.Stream(torch.device(device)) for _ in range(3)]}

    # ---- input stage ------------------------------------------------------------------
    def _run_parallel_input_projections(self, x: torch.Tensor) -> InputProjections:
        self._handoffs.clear()  # a new step: nothing of the last one
        fused = self._input_pack_usable() and x.shape[0] <= self.plan.fused_max_tokens
        stage = self._fused_input_projections_gemm if fused else self._stream_input_projections
        if (x.shape[0] <= self.plan.graph_max_tokens and self.offloader.is_noop
                and not torch.cuda.is_current_stream_capturing()):
            out = self._graphed(x, stage, fused)
        else:
            out = stage(x)
        if out[2] is not None:
            self._handoffs.put("idx_score", (), out[2])
        return out

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
        return tuple(None if o is None else o[:m] for o in outs)  # type: ignore[return-value]

    def _after_weights_changed(self) -> None:
        super()._after_weights_changed()
        self._graphs = {}  # captured pointers may be stale
        on_gpu = triton_available() and self.device.type == "cuda"
        self.fp8_plan = plan_fp8_linears(
            self, on_gpu, "" if on_gpu else "the fp8 kernels need Triton and a CUDA device")

    # ---- fp8 weight-streaming linears (dsv4.platforms.cuda_linears) -------------------
    def _fp8_ready(self, name: str, x: torch.Tensor) -> bool:
        """Host-side test, no sync: the fp8 kernels take this call of linear ``name`` (the
        weight-streaming GEMM, or for long calls a one-pass dequantised copy + cuBLAS)."""
        return (self._fp8_enabled and name in self.fp8_plan.eligible
                and self.offloader.is_noop)

    def _fused_wqa_wkv_gemm(self, x: torch.Tensor) -> torch.Tensor:
        # the stream plan's main GEMM (calls above plan.fused_max_tokens): the weight-streaming
        # kernel instead of dequantising the fp8 weight per call (two elementwise passes over
        # it, ~40 us of a 64-token Flash step on the H200)
        if self._fp8_ready("fused_wqa_wkv", x):
            return fp8_gemm(self.fused_wqa_wkv, x, self.cfg.act_quant)
        return super()._fused_wqa_wkv_gemm(x)

    def _wq_b_gemm(self, qr: torch.Tensor) -> torch.Tensor:
        made = self._handoffs.take("wq_b", (qr,))
        if made is not None:
            return made
        if self._fp8_ready("wq_b", qr):
            return fp8_gemm(self.wq_b, qr, self.cfg.act_quant, self._qr_fp8_for("wq_b", qr))
        return super()._wq_b_gemm(qr)

    def _indexer_wq_b_gemm(self, qr: torch.Tensor) -> torch.Tensor:
        self._handoffs.take("wq_b", ())  # nothing of an earlier call
        if self._query_pair_ready(qr):
            q, idx_q = fp8_query_pair(self, qr, self._qr_fp8_for("wq_b", qr))
            self._handoffs.put("wq_b", (qr,), q)
            return idx_q
        if self.indexer is not None and self._fp8_ready("indexer.wq_b", qr):
            return fp8_gemm(self.indexer.wq_b, qr, self.cfg.act_quant,
                            self._qr_fp8_for("indexer.wq_b", qr))
        return super()._indexer_wq_b_gemm(qr)

    def _o_proj(self, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # the kernel's inverse RoPE for every call it takes, long ones too (the torch rotation's
        # slice + cat of o took ~1 ms per 8K-token step on the H200), in place on o's rope dims
        # (o is this step's attention output); then the fp8 GEMMs, or the base path's for calls
        # they do not take
        o = self._inverse_rope(o, positions)
        if self._fp8_ready("wo_a", o):
            return fp8_wo_a_wo_b(self, o, wo_b=self._fp8_ready("wo_b", o))
        return self._wo_b_product(self._wo_a_grouped(o))

    # ---- fused elementwise stages (dsv4.platforms.cuda_elementwise) -------------------
    def _elementwise_ready(self, x: torch.Tensor) -> bool:
        """Host-side test, no sync: the one-launch kernels take this stage's input."""
        return self._step_kernels_enabled and elementwise_usable(self, x)

    def _latent_norms(self, qr_kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for name in ("qr_fp8", "wq_b", "kv_norms", "kv_rows"):  # nothing of an earlier call
            self._handoffs.take(name, ())
        if not self._elementwise_ready(qr_kv):
            return super()._latent_norms(qr_kv)
        takers = {"wq_b", "indexer.wq_b"} & self.fp8_plan.eligible
        if (self._qr_fp8_enabled and self.cfg.act_quant and self._fp8_enabled and takers
                and self.cfg.q_lora_rank % 128 == 0 and qr_kv.shape[0] <= FP8_GEMM_MAX_TOKENS):
            qr, kv, q8 = fused_latent_norms_q_fp8(self, qr_kv)
            self._handoffs.put("qr_fp8", (qr,), q8)
        else:
            qr, kv = fused_latent_norms(self, qr_kv)
        self._handoffs.put("kv_norms", (), kv)
        return qr, kv

    def _query_heads(self, qr: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        if not self._elementwise_ready(qr):
            return super()._query_heads(qr, pos)
        q = self._wq_b_gemm(qr)
        kv = self._handoffs.take("kv_norms", ())
        if kv is not None and self._kv_rows_fusable(kv, q):
            heads, rows = fused_query_heads_and_kv_rows(self, q, kv, pos)
            self._handoffs.put("kv_rows", (kv, pos), rows)
            return heads
        return fused_query_heads(self, q, pos)

    def _kv_rows_fusable(self, kv: torch.Tensor, q: torch.Tensor) -> bool:
        """Host-side: ``_query_heads`` may rotate ``kv`` (this step's rows from the latent
        norms) in its own launch - the platform's ``_kv_rows`` will be the one asked for them
        (a subclass that redefines it keeps its own) and the rows go with q's tokens."""
        return (self._own("_kv_rows") and self._elementwise_ready(kv)
                and kv.shape[0] == q.shape[0])

    def _kv_rows(self, kv: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        made = self._handoffs.take("kv_rows", (kv, pos))
        if made is not None:
            return made
        if self._elementwise_ready(kv):
            return fused_kv_rows(self, kv, pos)
        return super()._kv_rows(kv, pos)

    def _indexer_query(self, qr: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        if self._elementwise_ready(qr):
            return fused_indexer_query(self, self._indexer_wq_b_gemm(qr), pos)
        return super()._indexer_query(qr, pos)

    def _inverse_rope(self, o: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        if self._handoffs.take("o_rotated", (o, pos)):
            return o  # rotated by the attention launch that wrote it (forward_mqa)
        if self._elementwise_ready(o):
            return fused_inverse_rope(self, o, pos)
        return self.rotary.rotate(o, pos, self.acc_dtype, inverse=True)

    # ---- compressed entries (dsv4.kernels.compress_entries) ---------------------------
    def _raw_rows(self, comp: Compressor, kv_score: torch.Tensor, pos: torch.Tensor
                  ) -> torch.Tensor:
        made = self._handoffs.take("idx_raw_rows", (kv_score, pos))
        if made is not None:
            return made
        if (self._paged_kernels_ready(kv_score) and self.acc_dtype == torch.float32
                and raw_rows_problem(comp, kv_score, pos) is None):
            idx = self._handoffs.take("idx_score", ())
            if (comp is self.compressor and self.indexer is not None and idx is not None
                    and self.indexer.compressor.ratio == comp.ratio
                    and raw_rows_problem(self.indexer.compressor, idx, pos) is None):
                # the indexer compressor's rows in the same launch, for its call (next)
                rows, idx_rows = raw_rows_pair((comp, kv_score),
                                               (self.indexer.compressor, idx), pos)
                self._handoffs.put("idx_raw_rows", (idx, pos), idx_rows)
                self._handoffs.put("idx_ring_rows", (rows,), idx_rows)
                return rows
            return raw_rows(comp, kv_score, pos)
        return super()._raw_rows(comp, kv_score, pos)

    def _keep_ring_rows(self, step: CacheStep, name: str, rows: torch.Tensor) -> None:
        if self._handoffs.take("idx_ring_kept", (step, rows)):
            return  # kept by the main ring's launch, just before this call
        ring = step.ring(name)
        job = step.jobs[name]
        if (not self._paged_kernels_ready(rows)
                or keep_ring_rows_problem(ring, rows, job.keep_dst, job.keep_src) is not None):
            super()._keep_ring_rows(step, name, rows)
            return
        idx_rows = self._handoffs.take("idx_ring_rows", (rows,))
        if (idx_rows is not None and name == "compressed" and "idx_keys" in step.jobs
                and self._own("_keep_ring_rows")):
            # the indexer ring's rows (the step's next and last call) in the same launch; not
            # where a subclass or an instance attribute stands in for the indexer ring's call
            idx = (step.ring("idx_keys"), idx_rows, step.jobs["idx_keys"].keep_dst,
                   step.jobs["idx_keys"].keep_src)
            if keep_ring_rows_problem(*idx) is None:
                keep_ring_rows_pair((ring, rows, job.keep_dst, job.keep_src), idx)
                self._handoffs.put("idx_ring_kept", (step, idx_rows), True)
                return
        keep_ring_rows(ring, rows, job.keep_dst, job.keep_src)

    def _compress_entries(self, comp: Compressor, step: CacheStep, name: str,
                          rows: torch.Tensor) -> torch.Tensor:
        sim, numerics = self.cfg.simulate_quant, self.cfg.index_numerics
        if (not self._step_kernels_enabled
                or kernel_unsupported(comp, rows, self.dtype, sim, numerics) is not None):
            return super()._compress_entries(comp, step, name, rows)
        job = step.jobs[name]
        return compress_entries(comp, step.ring(name), rows, job.ring_src, job.call_src,
                                job.entries, self.rotary, self.dtype, sim, numerics)

    # ---- the step's cache writes and flat store rows (kernels.store_rows, paged_rows) --
    def _paged_kernels_ready(self, t: torch.Tensor) -> bool:
        """Host-side test, no sync: the step's data-movement kernels (cache writes, flat rows,
        raw and ring rows) are on and run where ``t`` lives."""
        return self._step_kernels_enabled and paged_rows_usable(t.device)

    def _store_rows(self, step: CacheStep, name: str, slots: torch.Tensor, rows: torch.Tensor,
                    values: torch.Tensor) -> None:
        store = step.pool.stores[name]
        if self._paged_kernels_ready(values) and not store_rows_problem(store, values):
            store_rows(store, slots, rows, values)
        else:
            super()._store_rows(step, name, slots, rows, values)

    def _flat_row_dtype(self, step: CacheStep) -> torch.dtype:
        """int32 where this platform's own ``forward_mqa`` hands the flat rows to a kernel
        backend (ours and FlashMLA's read int32 indices: the rows then need no cast launch, one
        per index tensor) and every store's rows fit; the contract's int64 otherwise (a
        subclass with its own ``forward_mqa`` gets int64). Host work only."""
        if (not self._own("forward_mqa")
                or self.attention_choice(step.pool).backend not in ("triton", "flashmla")):
            return torch.int64
        fits = all(s.alloc.num_blocks * s.block_size <= torch.iinfo(torch.int32).max
                   for s in step.pool.stores.values())
        return torch.int32 if fits else torch.int64

    def _rope_in_attention(self, q: torch.Tensor) -> bool:
        """Our attention kernel may apply the output path's inverse RoPE as it writes o: where
        the step hands o straight to this platform's own ``_o_proj`` and ``_inverse_rope``
        (which would run the same rotation as its own launch) and nothing stands between
        (no subclass or instance attribute redefines any of the three). Host work only."""
        return (self._own("forward_mqa", "_o_proj", "_inverse_rope")
                and self.rotary.inv_freq.dtype == torch.float32
                and self._elementwise_ready(q))

    def _window_with_entries(self, step: CacheStep) -> tuple[PagedStore, int] | None:
        """(kv store, window) for the entry rows' launch to write this step's window rows too
        (handed to ``_window_rows`` of the step), or None where the platform's own
        ``_window_rows`` is not the one the step will ask."""
        if not self._own("_window_rows"):
            return None
        return step.pool.stores["kv"], self.window

    def _window_rows(self, step: CacheStep) -> torch.Tensor:
        made = self._handoffs.take("window_rows", (step,))
        if made is not None:
            return made
        if self._paged_kernels_ready(step.pos):
            return window_flat_rows(step.pool.stores["kv"], step.pos, step.tok_slot,
                                    self.window, self._flat_row_dtype(step))
        return super()._window_rows(step)

    def _visible_entries(self, step: CacheStep, ratio: int) -> torch.Tensor:
        if not self._paged_kernels_ready(step.pos):
            return super()._visible_entries(step, ratio)
        n = step.max_visible(ratio)
        store = step.pool.stores.get("compressed")
        if store is not None and self._own("_entry_rows"):
            # the selection and its flat rows in one launch; _entry_rows of this very
            # selection hands the rows back
            window = self._window_with_entries(step)
            entries, rows, win = visible_entry_rows(store, step.pos, step.tok_slot, n, ratio,
                                                    self._flat_row_dtype(step), window)
            self._handoffs.put("entry_rows", (entries,), rows)
            if win is not None:
                self._handoffs.put("window_rows", (step,), win)
            return entries
        return visible_entries(step.pos, n, ratio)

    def _entry_rows(self, step: CacheStep, entries: torch.Tensor) -> torch.Tensor:
        made = self._handoffs.take("entry_rows", (entries,))
        if made is not None:
            return made
        if self._paged_kernels_ready(entries):
            store, dtype = step.pool.stores["compressed"], self._flat_row_dtype(step)
            window = self._window_with_entries(step)
            if window is None:
                return entry_flat_rows(store, entries, step.tok_slot, dtype)
            # the window rows in the same launch, for _window_rows of this step
            rows, win = entry_and_window_rows(store, entries, step.pos, step.tok_slot, window,
                                              dtype)
            self._handoffs.put("window_rows", (step,), win)
            return rows
        return super()._entry_rows(step, entries)

    # ---- sparse attention backends (dsv4.platforms.cuda_attention) --------------------
    def forward_mqa(self, q: torch.Tensor, step: CacheStep, selection: torch.Tensor | None
                    ) -> torch.Tensor:
        choice = self.attention_choice(step.pool)
        backend = choice.backend_for(q.shape[0])
        if backend == "triton":
            if not self._rope_in_attention(q):
                return triton_forward_mqa(self, q, step, selection, choice.fmt)
            # the output path's inverse RoPE in the launch that writes o (one launch fewer);
            # _inverse_rope of this very o then returns it
            inv_freq = self.rotary.inv_freq
            assert isinstance(inv_freq, torch.Tensor)
            o = triton_forward_mqa(self, q, step, selection, choice.fmt,
                                   inverse_rope=(step.pos, inv_freq))
            self._handoffs.put("o_rotated", (o, step.pos), True)
            return o
        if backend == "flashmla":
            return flashmla_forward_mqa(self, q, step, selection, choice.fmt)
        return super().forward_mqa(q, step, selection)

    # ---- the indexer's top-k (dsv4.kernels.indexer_topk) ------------------------------
    def _indexer_kernel_format(self, step: CacheStep, idx_q: torch.Tensor) -> str:
        """Host-side test, no sync: the index key format name the kernels read this step's
        selection in, or "" for the torch path (non-bf16 queries, no Triton or CUDA device, a
        key store the kernels cannot read)."""
        if (not self._step_kernels_enabled or self.indexer is None or not triton_available()
                or idx_q.dtype != torch.bfloat16
                or not (idx_q.device.type == "cuda" or _INTERPRET)):
            return ""
        return index_kernel_format(step.pool.stores["idx_keys"].fmt)

    def _indexer_select(self, step: CacheStep, idx_q: torch.Tensor, idx_weights: torch.Tensor
                        ) -> torch.Tensor:
        fmt = self._indexer_kernel_format(step, idx_q)
        if not fmt:
            return super()._indexer_select(step, idx_q, idx_weights)
        assert self.indexer is not None
        if step.num_tokens > KERNEL_MAX_TOKENS:  # prefill: query tiles share the keys
            return select_prefill(step, idx_q, idx_weights, self.indexer,
                                  self.cfg.attention_workspace_bytes)
        store = step.pool.stores["idx_keys"]
        return indexer_topk(idx_q, idx_weights, store.data, fmt, store.block_size,
                            store.table_dev, step.tok_slot, step.pos, step.max_visible(4),
                            self.indexer.topk, self.indexer.weight_scale,
                            workspace_bytes=self.cfg.attention_workspace_bytes,
                            sort=self._sorted_selection, hold=self._held_topk_rows)

    # ---- fp32-output GEMMs ------------------------------------------------------------
    def _score_gemm(self, lin: Linear, x: torch.Tensor) -> torch.Tensor:
        if self._fp32_out:
            return mm_fp32_out(x, lin.weight)
        return lin.forward_fp32(x, self.acc_dtype)

    def _compressor_kv_score_gemm(self, x: torch.Tensor) -> torch.Tensor:
        assert self.compressor is not None
        return self._score_gemm(self.compressor.fused_wkv_wgate, x)

    def _indexer_kv_score_gemm(self, x: torch.Tensor) -> torch.Tensor:
        assert self.indexer is not None
        return self._score_gemm(self.indexer.compressor.fused_wkv_wgate, x)

    def _fused_compressor_score_gemm(self, x: torch.Tensor) -> torch.Tensor:
        w = self._fused_compressor_weight
        assert isinstance(w, torch.Tensor)
        if self._fp32_out:
            return mm_fp32_out(x, w)
        return super()._fused_compressor_score_gemm(x)
