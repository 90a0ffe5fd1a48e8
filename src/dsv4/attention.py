"""``DeepseekV4Attention``: the platform-neutral DeepSeek-V4 attention layer.

A step is six stages in order (:mod:`dsv4.stages`, docs/spec.md §8.3): input projections, query
heads and kv rows, cache writes and compression, selection, attention and the output path, the
rings. Each stage's default calls fine override points; a platform overrides points or whole
stages (:attr:`DeepseekV4Attention.OVERRIDE_POINTS`), and each one's docstring says what it may
change and what it must keep. Shared code never asks which platform it runs on.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from dsv4.cache.plan import StepPlan
from dsv4.cache.pool import AttentionCache, CachePool
from dsv4.cache.step import CacheStep, CallTransaction
from dsv4.config import DSV4Config
from dsv4.derived_state import restore_derived_state
from dsv4.host_copy import upload_once
from dsv4.layers.compressor import Compressor
from dsv4.layers.indexer import Indexer
from dsv4.layers.linear import FP8_BLOCK, Linear, MergedLinear, grouped_linear
from dsv4.layers.mqa import sparse_mqa_paged
from dsv4.layers.norm import RMSNorm, rms_normalize
from dsv4.layers.quant_sim import fp8_block_sim
from dsv4.layers.rotary import RotaryEmbedding
from dsv4.layers.weight_layout import WeightLayout, set_layout
from dsv4.offload import BaseOffloader, resolve_offloader
from dsv4.parallel import execute_in_parallel
from dsv4.stages import OVERRIDE_POINTS, InputProjections, QueryAndRows, Selection
from dsv4.tensor_parallel import TPInfo, local_sizes, resolve_tp
from dsv4.weights import load_layer_weights, official_weight_specs

SUPPORTED_DTYPES = (torch.bfloat16, torch.float32, torch.float64)


class AttentionInputError(ValueError):
    """A forward call's inputs are invalid; nothing was computed and no cache was touched."""


class DeepseekV4Attention(nn.Module):
    """One DeepSeek-V4 attention layer (SWA-only, C4A with indexer, or C128A, as the config's
    ``compress_ratios`` give for ``layer_id``), on any device and in bf16, fp32 or fp64.

    Construction: :func:`dsv4.build_attention` makes the layer of a platform (``"reference"``,
    ``"preshuffle"``, ``"cuda"``; ``dsv4.platforms.available()``); whole checkpoints load with
    :func:`dsv4.load_checkpoint`, which also runs the platform's post-load passes. A layer built
    by hand holds placeholder weights until :meth:`load_weights` (official tensor names relative
    to the layer, e.g. ``wq_a.weight``) or ``load_state_dict``; then
    :func:`dsv4.process_weights_after_loading` applies the platform's passes.

    Caches: :meth:`new_cache` (one sequence), :meth:`new_caches` / :meth:`new_cache_pool` (many
    sequences in one paged pool, run as one batch). The layer keeps no state between calls; the
    caches do.

    Forward: ``layer(x, positions, cache, seq_lens=None)`` with ``x`` [T, hidden_size] in the
    layer dtype and ``positions`` [T] continuing each cache's length. Every input is checked
    before anything runs (:class:`AttentionInputError` naming the culprit, caches untouched).

    Example::

        cfg = DSV4Config.preset("tiny")
        layer = dsv4.build_attention(cfg, layer_id=1)                  # a C4A layer
        layer.load_weights(dsv4.random_layer_weights(cfg, 1))          # or a checkpoint's
        cache = layer.new_cache(max_seq_len=512)
        y = layer(x, torch.arange(x.shape[0]), cache)                  # prefill
        y1 = layer(x1, torch.tensor([x.shape[0]]), cache)              # one decode step

    Platforms subclass it and override only the stages and points in :attr:`OVERRIDE_POINTS`.
    """

    OVERRIDE_POINTS: ClassVar[tuple[str, ...]] = OVERRIDE_POINTS
    """What a platform may override: the six stages of a step and the fine points they call
    (:mod:`dsv4.stages`)."""
    platform_name: ClassVar[str] = "reference"

    # ------------------------------------------------------------------ construction
    def __init__(self, cfg: DSV4Config, layer_id: int, *, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.bfloat16, offloader: Any = None,
                 aux_streams: Sequence[Any] | None = None, tp_group: Any = None) -> None:
        """The layer ``layer_id`` of ``cfg`` with placeholder weights, on ``device`` in
        ``dtype``. Prefer :func:`dsv4.build_attention`, which picks the platform's subclass and
        its shared resources. ``offloader``: where weights live between calls (``dsv4.offload``);
        ``aux_streams``: CUDA streams for the input GEMMs' overlap; ``tp_group``: a
        ``torch.distributed`` group for tensor parallelism (this rank's heads only)."""
        super().__init__()
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype={dtype}: supported dtypes are {list(SUPPORTED_DTYPES)}")
        # tensor parallelism (dsv4.tensor_parallel): wq_b, wo_a, wo_b and attn_sink hold this
        # rank's heads / output groups only; None: no group, the whole layer
        self.tp: TPInfo | None = resolve_tp(cfg, tp_group)
        self.cfg = cfg
        self.layer_id = layer_id
        self.compress_ratio = cfg.compress_ratio(layer_id)
        self.dtype = dtype
        self.acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        f32 = self.acc_dtype
        dev = torch.device(device)
        self.n_heads, self.o_groups = local_sizes(cfg, self.tp)
        self.head_dim = cfg.head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.window = cfg.sliding_window
        self.offloader: BaseOffloader = resolve_offloader(offloader)
        self._offload_done = False
        self._weight_layouts: dict[str, WeightLayout] = {}
        self._weights_loaded = False
        """Set by ``load_weights`` / ``load_state_dict``; forward refuses to run before."""

        fp8 = cfg.fp8_weights
        h = cfg.hidden_size
        self.fused_wqa_wkv = MergedLinear(h, [cfg.q_lora_rank, cfg.head_dim], fp8=fp8,
                                          dtype=dtype, device=dev)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dtype=dtype, device=dev)
        self.kv_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=dtype, device=dev)
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, fp8=fp8, dtype=dtype,
                           device=dev)
        group_in = cfg.heads_per_group * self.head_dim
        self.wo_a = Linear(group_in, self.o_groups * cfg.o_lora_rank, fp8=fp8, dtype=dtype,
                           device=dev)
        self.wo_b = Linear(self.o_groups * cfg.o_lora_rank, h, fp8=fp8, dtype=dtype, device=dev)
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads, dtype=f32, device=dev),
                                      requires_grad=False)
        self.compressor: Compressor | None = None
        self.indexer: Indexer | None = None
        if self.compress_ratio:
            self.compressor = Compressor(cfg, dim=self.head_dim, ratio=self.compress_ratio,
                                         for_indexer=False, dtype=dtype, f32_dtype=f32,
                                         device=dev)
        if self.compress_ratio == 4:
            self.indexer = Indexer(cfg, dtype=dtype, f32_dtype=f32, device=dev)
        self.rotary = RotaryEmbedding.for_layer(cfg, self.compress_ratio, dev)

        # Post-load compressor GEMM fusion state (docs/upstream.md B.2): a non-persistent buffer,
        # so it never reaches state_dict(), and the split sizes.
        self.register_buffer("_fused_compressor_weight", None, persistent=False)
        self._fused_compressor_split_sizes: tuple[int, int] | None = None
        # Post-load full input-projection packing (passes/input_fusion.py).
        self.register_buffer("_packed_input_weight", None, persistent=False)
        self.register_buffer("_packed_fp8_scale", None, persistent=False)
        self._input_pack: Any = None

        # Streams are shared by all layers of a model; events belong to the layer (created once,
        # never per call, so CUDA-graph capture sees stable fork/join edges).
        self.aux_streams = list(aux_streams) if aux_streams is not None else None
        self._events: list[Any] = []
        if self.aux_streams is not None:
            self._events = [torch.cuda.Event() for _ in range(4)]
        for name, module in self.named_modules():
            if isinstance(module, Linear):
                module.dsv4_name = f"layers.{layer_id}.attn.{name}.weight"
        self._register_state_dict_hook(_canonical_state_dict_hook)
        self._register_load_state_dict_pre_hook(self._stored_layout_pre_hook)
        self.register_load_state_dict_post_hook(_after_load_state_dict)

    @staticmethod
    def shared_build_kwargs(device: torch.device | str) -> dict[str, Any]:
        """Resources one model's layers share (platforms override: e.g. CUDA aux streams)."""
        return {}

    @property
    def device(self) -> torch.device:
        return self.attn_sink.device

    # ------------------------------------------------------------------ weights
    def official_weight_names(self) -> list[str]:
        """Checkpoint names (relative to the layer) this layer loads."""
        return [s.name for s in official_weight_specs(self)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
                     ) -> None:
        """Load official checkpoint tensors (names relative to the layer, e.g. ``wq_a.weight``):
        a mapping of name -> tensor, or an iterable of (name, tensor) pairs.

        Everything is validated first (unknown, duplicate, missing, mis-shaped, mis-typed and
        non-finite tensors are errors naming the tensor); nothing is assigned unless all pass.
        """
        load_layer_weights(self, weights)
        self._weights_loaded = True
        self._after_weights_changed()

    def new_cache_pool(self, max_seqs: int, max_seq_len: int = 4096, *,
                       capacity_tokens: int | None = None, step_tokens: int | None = None,
                       kv_cache_dtype: str | None = None, index_cache_dtype: str | None = None,
                       max_rollback: int = 1) -> CachePool:
        """An empty paged cache pool of this layer for up to ``max_seqs`` sequences of at most
        ``max_seq_len`` positions (:class:`~dsv4.cache.pool.CachePool`): ``pool.add_sequence()``,
        ``cache.fork()``, ``cache.free()``, ``cache.truncate(n)``. ``capacity_tokens`` (default
        ``max_seqs * max_seq_len``) sizes the compressed-entry stores; the formats default to
        the config's ``kv_cache_dtype`` / ``index_cache_dtype``; ``max_rollback``: positions a
        sequence can always be truncated back by (speculative decoding of k drafted tokens a
        step: k)."""
        return CachePool(self.cfg, self.layer_id, max_seqs=max_seqs, max_seq_len=max_seq_len,
                         dtype=self.dtype, acc_dtype=self.acc_dtype, device=self.device,
                         capacity_tokens=capacity_tokens, step_tokens=step_tokens,
                         kv_format_name=kv_cache_dtype, index_format_name=index_cache_dtype,
                         max_rollback=max_rollback)

    def new_cache(self, max_seq_len: int = 4096, **pool_kwargs: Any) -> AttentionCache:
        """One sequence's cache (a pool of one; see :meth:`new_cache_pool`)."""
        return self.new_cache_pool(1, max_seq_len, **pool_kwargs).add_sequence()

    def new_caches(self, n: int, max_seq_len: int = 4096, **pool_kwargs: Any
                   ) -> list[AttentionCache]:
        """``n`` sequences' caches in one pool, so that a call over them runs every cache read
        and write and the attention as single batched operations."""
        pool = self.new_cache_pool(n, max_seq_len, **pool_kwargs)
        return [pool.add_sequence() for _ in range(n)]

    # ------------------------------------------------------------------ post-load state
    def fused_compressor_params(self) -> list[nn.Parameter]:
        """The two parameters that view the fused compressor buffer (C4 layers)."""
        assert self.compressor is not None and self.indexer is not None
        return [self.compressor.fused_wkv_wgate.weight,
                self.indexer.compressor.fused_wkv_wgate.weight]

    def _set_weight_layout(self, param_name: str, layout: WeightLayout) -> None:
        """Record that a parameter is stored in a platform layout (kept across re-wrapping)."""
        self._weight_layouts[param_name] = layout
        set_layout(self.get_parameter(param_name), layout)

    def _finish_post_load(self) -> None:
        """Hand the final weights to the offloader, once."""
        if not self._offload_done and not self.offloader.is_noop:
            self.offloader.post_init(self)
        self._offload_done = True

    @torch.no_grad()
    def _after_weights_changed(self) -> None:
        """Restore every invariant that a rebinding of parameters may have broken: layout tags
        on the current Parameter objects, the fused compressor buffer aliasing both parameters,
        and state derived from weights (platforms extend this)."""
        for name, layout in self._weight_layouts.items():
            set_layout(self.get_parameter(name), layout)
        restore_derived_state(self)  # what the post-load passes derived from the weights

    def _current_input_pack(self) -> Any:
        """The input pack with its tensors refreshed from this layer's buffers (device moves,
        offload rebind them; the pack object keeps the segment plan)."""
        pack = self._input_pack
        assert pack is not None
        pack.weight = self._packed_input_weight
        if pack.fp8_weight is not None:
            pack.fp8_weight = self.fused_wqa_wkv.weight.data
            pack.fp8_scale = self._packed_fp8_scale
        return pack

    def _apply(self, fn: Any, recurse: bool = True) -> DeepseekV4Attention:
        # A device move converts parameters and the fused buffer separately: re-alias after.
        super()._apply(fn, recurse)
        self._after_weights_changed()
        return self

    def _stored_layout_pre_hook(self, state_dict: dict[str, Any], prefix: str, *args: Any
                                ) -> None:
        """load_state_dict takes canonical values: convert them into the stored layouts."""
        for name, layout in self._weight_layouts.items():
            key = prefix + name
            if key in state_dict:
                state_dict[key] = layout.from_canonical(state_dict[key])

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                cache: AttentionCache | Sequence[AttentionCache] | None = None,
                seq_lens: Sequence[int] | None = None, *, plan: StepPlan | None = None
                ) -> torch.Tensor:
        """Prefill, a prefill chunk, decode, or any mix of them for one or several sequences.

        x: [T, hidden] in the layer dtype; positions: [T] ascending from each cache's length
        (a CPU tensor is checked without a device sync). ``cache`` is one cache, or one cache per
        sequence with ``seq_lens`` giving how many consecutive tokens of x belong to each
        (default: one token each, a decode batch). Every call runs one batched path: the caches
        of one pool are written, selected from and attended to for all sequences at once (caches
        of several pools: once per pool). A call longer than the pool's ``step_tokens`` runs as
        several steps, all or nothing: if one fails, every cache is left as it was.

        ``plan``: a model's :class:`~dsv4.cache.plan.StepPlan` of this step for all its layers
        (``layer(x, plan=plan)``, no positions, caches or seq_lens): the layer takes its cache
        step from it, built and uploaded once for all layers, and leaves the step's end (lengths,
        window releases) to ``plan.commit()``.
        """
        self._check_weights_loaded()
        if plan is not None:
            return self._forward_planned(x, positions, cache, seq_lens, plan)
        self._check_finite_input(x)
        groups = self._plan_call(x, positions, cache, seq_lens)
        if len(groups) == 1 and groups[0][1] is None:
            pool, _, caches, counts = groups[0]
            return self._run_pool(x, pool, caches, counts)
        out = torch.empty(x.shape[0], self.cfg.hidden_size, dtype=x.dtype, device=x.device)
        for pool, rows, caches, counts in groups:  # one pass per pool, not per sequence
            assert rows is not None
            out[rows] = self._run_pool(x[rows], pool, caches, counts)
        return out

    def _forward_planned(self, x: Any, positions: Any, cache: Any, seq_lens: Any,
                         plan: StepPlan) -> torch.Tensor:
        """A step of a model's plan: checked (host work, no device reads), run, not committed."""
        if not isinstance(plan, StepPlan):
            raise AttentionInputError(f"plan must be a StepPlan, got {type(plan).__name__}")
        given = [n for n, v in (("positions", positions), ("cache", cache),
                                ("seq_lens", seq_lens)) if v is not None]
        if given:
            raise AttentionInputError(f"with a plan, give x only: the plan holds the step's "
                                      f"{', '.join(given)}")
        step = plan.step_for(self)
        if not isinstance(x, torch.Tensor) or x.dim() != 2 \
                or x.shape != (plan.num_tokens, self.cfg.hidden_size):
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise AttentionInputError(f"x has shape {shape}; the plan's step expects "
                                      f"[{plan.num_tokens}, {self.cfg.hidden_size}]")
        if x.dtype != self.dtype or x.device != self.device:
            raise AttentionInputError(f"x is {x.dtype} on {x.device}; this layer runs in "
                                      f"{self.dtype} on {self.device}")
        self._check_finite_input(x)
        return self._step(x, step)

    def _run_pool(self, x: torch.Tensor, pool: CachePool, caches: list[AttentionCache],
                  counts: list[int]) -> torch.Tensor:
        """The tokens of one pool's sequences of a plain call (checked), in steps of at most
        ``pool.step_tokens``, all or nothing.

        May change: how the steps run (e.g. replayed as CUDA graphs of padded steps).
        Must keep: each step's values (to the rounding of a padded batch), every cache as the
        eager steps leave it, and as it was if any step fails; a step is :meth:`_step` (here
        stage 1, then the step's plan, then :meth:`_step_after_projections`)."""
        pieces = _split_steps(counts, pool.step_tokens)
        txn = CallTransaction(pool, caches, snapshot_rings=len(pieces) > 1)
        out: torch.Tensor | None = None
        try:
            for begin, end, part in pieces:
                # stage 1 reads x alone: its GEMMs are queued before the step's host planning
                # (blocks, metadata, upload), which then runs while the device computes them
                # (a failed plan leaves nothing written: the projections are fresh tensors)
                proj = self._run_parallel_input_projections(x[begin:end])
                idx = [i for i, n in enumerate(part) if n]
                step = CacheStep.plan(pool, [caches[i] for i in idx], [part[i] for i in idx])
                release = None if len(pieces) == 1 else [txn.window_release_from()[i] for i in idx]
                y = self._step_after_projections(proj, step)
                del proj
                step.commit(release)
                if len(pieces) == 1:
                    out = y
                else:  # each step's rows go straight to the output (no list + cat: one copy)
                    if out is None:
                        out = y.new_empty(x.shape[0], y.shape[1])
                    out[begin:end] = y
                del y
        except BaseException:
            txn.rollback()
            raise
        if len(pieces) > 1:
            txn.finish()
        assert out is not None
        return out

    def _step(self, x: torch.Tensor, step: CacheStep) -> torch.Tensor:
        """One step (docs/spec.md §8.3) for every sequence of ``step`` at once: the six stages
        of :mod:`dsv4.stages`, in order - device work only, so that a CUDA graph can capture
        it (the step's end, :meth:`CacheStep.commit`, is the caller's)."""
        return self._step_after_projections(self._run_parallel_input_projections(x), step)

    def _step_after_projections(self, proj: InputProjections, step: CacheStep) -> torch.Tensor:
        """Stages 2-6 of :meth:`_step` on stage 1's output (a plain call plans each step
        between the two: :meth:`_run_pool`)."""
        qk = self._query_and_kv_rows(proj.qr_kv, step)
        raw = self._write_cache(step, qk.rows, proj.kv_score, proj.idx_kv_score)
        # the branch point's side streams join before their readers: stage 4, stage 5
        _join(qk.index_query_ready, proj.qr_kv.device)
        selection = self._select(step, qk.index_query, proj.idx_weights)
        _join(qk.heads_ready, proj.qr_kv.device)
        y = self._tp_all_reduce(self._attend_and_project(qk.heads, step, selection))
        self._keep_rings(step, raw)  # last: a failure above leaves every cache as it was
        return y

    # ---- stage 1: input projections -----------------------------------------------------
    def _run_parallel_input_projections(self, x: torch.Tensor) -> InputProjections:
        """Stage 1: the four input GEMMs that read x (:class:`~dsv4.stages.InputProjections`).

        May change: where and how the GEMMs run (streams, fusion, kernels).
        Must keep: qr_kv comes from :meth:`_fused_wqa_wkv_gemm` (never the module directly: a
        platform's weights may be in a private layout) or, packed, from
        :meth:`_fused_input_projections_gemm`; scores are fp32 (acc dtype); and the upstream
        stream plan (docs/upstream.md D): fused_wqa_wkv on the current stream, aux 0..2 =
        compressor score, indexer weights, indexer compressor score, overlap only for
        T <= multi_stream_token_threshold.
        """
        if self._input_pack_usable():
            return self._fused_input_projections_gemm(x)
        return self._stream_input_projections(x)

    def _input_pack_usable(self) -> bool:
        """The one-launch input pack exists and can give this config's numerics: under
        ``act_quant`` its qr_kv segment must be fp8 (the kernel quantises that segment's x and
        no other; with a bf16 ``fused_wqa_wkv`` the stream plan runs). Host-side, no sync."""
        pack = self._input_pack
        return pack is not None and (not self.cfg.act_quant or pack.fp8_weight is not None)

    def _stream_input_projections(self, x: torch.Tensor) -> InputProjections:
        """The upstream stream plan over the fine GEMM points (a fixed step that platform
        overrides of stage 1 call)."""
        fused = isinstance(self._fused_compressor_weight, torch.Tensor)
        aux: list[Any] = [None, None, None]
        if fused:
            aux[0] = lambda: self._fused_compressor_score_gemm(x)
        elif self.compressor is not None:
            aux[0] = lambda: self._compressor_kv_score_gemm(x)
        if self.indexer is not None:
            aux[1] = lambda: self._indexer_weights_gemm(x)
            if not fused:
                aux[2] = lambda: self._indexer_kv_score_gemm(x)
        threshold = self.cfg.multi_stream_token_threshold
        enable = self.aux_streams is not None and 0 < x.shape[0] <= threshold
        qr_kv, (score, idx_weights, idx_kv_score) = execute_in_parallel(
            lambda: self._fused_wqa_wkv_gemm(x), aux,
            self._events[0] if self._events else None, self._events[1:4], self.aux_streams,
            enable)
        if fused:
            if self.indexer is None:
                raise RuntimeError(f"layer {self.layer_id}: a fused compressor weight requires a "
                                   "C4 indexer")
            assert self._fused_compressor_split_sizes is not None
            n_main, n_idx = self._fused_compressor_split_sizes
            score, idx_kv_score = score[:, :n_main], score[:, n_main:n_main + n_idx]
        return InputProjections(qr_kv, score, idx_kv_score, idx_weights)

    def _fused_wqa_wkv_gemm(self, x: torch.Tensor) -> torch.Tensor:
        """qr_kv = x @ [wq_a | wkv]^T, [T, q_lora_rank + head_dim] in the layer dtype.

        The single place where ``fused_wqa_wkv`` is multiplied (upstream #51821,
        docs/upstream.md A).
        May change: the kernel and the weight layout (e.g. preshuffled fp8 with activation
        quantisation).
        Must keep: shape, dtype and the [qr | kv] column order, the §6.3 activation
        quantisation under ``cfg.act_quant`` (:meth:`_fp8_linear_input`); fall back to this
        method via super() for inputs the fast path does not take.
        """
        return self.fused_wqa_wkv(self._fp8_linear_input(x))

    def _compressor_kv_score_gemm(self, x: torch.Tensor) -> torch.Tensor:
        """Main compressor projection [T, 2 * coff * head_dim] with fp32 (acc dtype) output.

        May change: the kernel (e.g. bf16 x bf16 with fp32 out).
        Must keep: fp32 output, the [kv | score] column order (``wkv`` rows, then ``wgate``)."""
        assert self.compressor is not None
        return self.compressor.fused_wkv_wgate.forward_fp32(x, self.acc_dtype)

    def _indexer_kv_score_gemm(self, x: torch.Tensor) -> torch.Tensor:
        """Indexer compressor projection [T, 4 * index_head_dim], fp32 (acc dtype) output.

        May change: the kernel.
        Must keep: fp32 output, the [kv | score] column order."""
        assert self.indexer is not None
        return self.indexer.compressor.fused_wkv_wgate.forward_fp32(x, self.acc_dtype)

    def _indexer_weights_gemm(self, x: torch.Tensor) -> torch.Tensor:
        """Indexer head weights x @ weights_proj^T, [T, index_n_heads] in the layer dtype.

        May change: the kernel.
        Must keep: no scaling here (index_head_dim^-1/2 * index_n_heads^-1/2 is applied when
        scoring), the layer dtype."""
        assert self.indexer is not None
        return self.indexer.weights_proj(x)

    def _fused_compressor_score_gemm(self, x: torch.Tensor) -> torch.Tensor:
        """One GEMM over the fused [main | indexer] compressor weight, fp32 (acc dtype) output,
        [T, N_main + N_idx] (docs/upstream.md B.4).

        May change: the kernel.
        Must keep: one GEMM, fp32 output, the column order main then indexer."""
        w = self._fused_compressor_weight
        assert isinstance(w, torch.Tensor)
        return torch.nn.functional.linear(x.to(self.acc_dtype), w.to(self.acc_dtype))

    def _fused_input_projections_gemm(self, x: torch.Tensor) -> InputProjections:
        """All input projections in one launch over the packed weights (after the
        ``fuse_input_projections`` pass); the same tuple as stage 1.

        May change: the kernel and its tiling.
        Must keep: qr_kv in bf16, scores in fp32, indexer weights in bf16, and under
        ``cfg.act_quant`` qr_kv from the quantised x (§6.3), the others from x.
        """
        from dsv4.kernels.fused_input_proj import fused_input_projections

        pack = self._current_input_pack()
        outs = dict(zip((s.name for s in pack.segments),
                        fused_input_projections(x, pack, act_quant=self.cfg.act_quant),
                        strict=True))
        return InputProjections(outs["qr_kv"], outs.get("kv_score"), outs.get("idx_kv_score"),
                                outs.get("idx_weights"))

    # ---- stage 2: query heads and kv rows -----------------------------------------------
    def _query_and_kv_rows(self, qr_kv: torch.Tensor, step: CacheStep) -> QueryAndRows:
        """Stage 2 (docs/spec.md §5.2-§5.4, §5.7): from the normalised q latent, the query
        heads [T, heads, head_dim] and, where the C4 indexer decides this step
        (:meth:`_indexer_decides`), the indexer's query; from the normalised kv, the window
        rows [T, head_dim] this step stores (:class:`~dsv4.stages.QueryAndRows`).

        May change: the kernels, how many launches (e.g. the heads' and the rows' RoPE in
        one), and where the heads and the indexer's query run: on side streams that waited
        for the latent, beside stages 3-4, each with the event recorded after it
        (``heads_ready``, ``index_query_ready``: the step's branch point).
        Must keep: the values of :meth:`_latent_norms`, :meth:`_query_heads`, :meth:`_kv_rows`
        and :meth:`_indexer_query`; the GEMMs through :meth:`_wq_b_gemm` and
        :meth:`_indexer_wq_b_gemm`; no indexer query where the indexer does not decide."""
        qr, kv = self._latent_norms(qr_kv)
        index_query = self._indexer_query(qr, step.pos) if self._indexer_decides(step) else None
        return QueryAndRows(self._query_heads(qr, step.pos), self._kv_rows(kv, step.pos),
                            index_query)

    def _latent_norms(self, qr_kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(qr, kv): ``q_norm`` of the q latent and ``kv_norm`` of the kv row, from ``qr_kv``
        [T, q_lora_rank + head_dim] (weighted RMSNorm in the acc dtype, layer dtype out).

        May change: the kernel (e.g. both norms in one launch).
        Must keep: shapes, the layer dtype out, fp32 (acc dtype) statistics."""
        q_r = self.cfg.q_lora_rank
        qr = self.q_norm(qr_kv[:, :q_r], acc_dtype=self.acc_dtype)
        kv = self.kv_norm(qr_kv[:, q_r:], acc_dtype=self.acc_dtype)
        return qr, kv

    def _wq_b_gemm(self, qr: torch.Tensor) -> torch.Tensor:
        """Query up-projection ``qr @ wq_b^T``: [T, heads * head_dim] in the layer dtype, from
        the normalised q latent ``qr`` [T, q_lora_rank].

        May change: the kernel (e.g. an fp8 weight-streaming GEMM that applies the block scales
        in the kernel instead of dequantising the weight per call).
        Must keep: the layer dtype out, the head-major column order (head h = columns
        h * head_dim ..), this rank's heads only under tensor parallelism (``wq_b`` is sliced),
        the §6.3 activation quantisation under ``cfg.act_quant``, and the canonical weight (fall
        back to ``super()`` where the fast path does not apply)."""
        return self.wq_b(self._fp8_linear_input(qr))

    def _query_heads(self, qr: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Query heads [T, heads, head_dim] in the layer dtype: :meth:`_wq_b_gemm` of ``qr``,
        an RMS normalisation per head (no weight), RoPE at ``pos`` on the last rope dims.

        May change: the kernels after the GEMM (e.g. norm and RoPE in one launch).
        Must keep: the GEMM through :meth:`_wq_b_gemm`, fp32 (acc dtype) math, the layer dtype
        out."""
        q = self._wq_b_gemm(qr).unflatten(-1, (self.n_heads, self.head_dim))
        q = rms_normalize(q, self.cfg.rms_norm_eps, self.acc_dtype)  # per head, no weight
        return self.rotary.rotate(q, pos, self.acc_dtype).to(self.dtype)

    def _kv_rows(self, kv: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The window rows [T, head_dim] this step stores: RoPE of the normalised kv at ``pos``
        (and, under ``simulate_quant``, the official fp8 simulation of the non-RoPE dims,
        docs/spec.md §6.1).

        May change: the kernel.
        Must keep: fp32 (acc dtype) math; the rows go to the cache in stage 3."""
        kv = self.rotary.rotate(kv, pos, self.acc_dtype)
        if self.cfg.simulate_quant:
            nope = self.head_dim - self.rope_dim
            kv = torch.cat((fp8_block_sim(kv[:, :nope]), kv[:, nope:]), dim=-1)
        return kv

    def _indexer_decides(self, step: CacheStep) -> bool:
        """Whether the C4 indexer has a choice in this step: some query sees more than
        ``index_topk`` entries. Where none does (contexts up to 4 * index_topk tokens: 2K for
        Flash, 4K for Pro), every query takes all its visible entries whatever the scores (the
        indexer's contract), so the indexer's query, scores and top-k are skipped and the
        selection is every visible entry, ascending: the same set (attention does not depend on
        the order but for fp32 rounding). Host arithmetic, no sync."""
        return self.indexer is not None and self.indexer.has_choice(step.max_visible(4))

    def _indexer_wq_b_gemm(self, qr: torch.Tensor) -> torch.Tensor:
        """Indexer query up-projection ``qr @ indexer.wq_b^T``: [T, index_n_heads *
        index_head_dim] in the layer dtype (ratio-4 layers only).

        May change: the kernel (as :meth:`_wq_b_gemm`).
        Must keep: the layer dtype out, the head-major column order, the §6.3 activation
        quantisation under ``cfg.act_quant``, and no RoPE or other numerics simulation here
        (the indexer applies them)."""
        assert self.indexer is not None
        return self.indexer.wq_b(self._fp8_linear_input(qr))

    def _indexer_query(self, qr: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The indexer's queries q_I [T, index_n_heads, index_head_dim]: :meth:`_indexer_wq_b_gemm`
        of the normalised latent ``qr``, RoPE at ``pos``, then the indexer numerics' simulation
        (``cfg.index_numerics`` under ``simulate_quant``, docs/spec.md §6.2).

        May change: the kernels after the GEMM.
        Must keep: the GEMM through :meth:`_indexer_wq_b_gemm`, the numerics the config names."""
        assert self.indexer is not None
        numerics = self.cfg.index_numerics if self.cfg.simulate_quant else None
        return self.indexer.rotate_query(self._indexer_wq_b_gemm(qr), pos, self.rotary,
                                         self.acc_dtype, numerics)

    # ---- stage 3: cache writes and compression ------------------------------------------
    def _write_cache(self, step: CacheStep, kv: torch.Tensor, kv_score: torch.Tensor | None,
                     idx_kv_score: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """Stage 3 (docs/spec.md §5.4, §5.6): this step's window rows ``kv`` into the ``kv``
        store, and every entry the step completes - one batched compress per compressor - into
        the ``compressed`` / ``idx_keys`` stores. Returns, by store name, the compressors' raw
        rows (:meth:`_raw_rows`) that stage 6 keeps in the rings (a ring row replaced now could
        be one that a retry of a failed call still needs).

        May change: the kernels, and how many launches (e.g. both compressors' raw rows in
        one).
        Must keep: the stored bytes (:meth:`_store_rows`), the entries'
        values (:meth:`_compress_entries`), the raw rows' values (:meth:`_raw_rows`)."""
        self._store_rows(step, "kv", step.tok_slot, step.pos, kv)
        raw = self._all_raw_rows(step, kv_score, idx_kv_score)
        self._store_entries(step, raw)
        return raw

    def _all_raw_rows(self, step: CacheStep, kv_score: torch.Tensor | None,
                      idx_kv_score: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """Each compressor's raw rows (:meth:`_raw_rows`) by the store its entries go to."""
        return {name: self._raw_rows(comp, score, step.pos)
                for comp, name, score in self._compressor_jobs(kv_score, idx_kv_score)}

    def _store_entries(self, step: CacheStep, raw: dict[str, torch.Tensor]) -> None:
        """Every entry the step completes, from each compressor's raw rows ``raw`` (by store
        name): one batched :meth:`_compress_entries` per compressor, stored through
        :meth:`_store_rows` (a fixed step of stage 3, which platform overrides call)."""
        comps = self._compressors()
        for name, rows in raw.items():
            job = step.jobs[name]
            if job.count:
                self._store_rows(step, name, job.slots, job.entries,
                                 self._compress_entries(comps[name], step, name, rows))

    def _compressors(self) -> dict[str, Compressor]:
        """This layer type's compressors by the store their entries go to: the main one's
        ``compressed``, the indexer's ``idx_keys``."""
        comps = {}
        if self.compressor is not None:
            comps["compressed"] = self.compressor
        if self.indexer is not None:
            comps["idx_keys"] = self.indexer.compressor
        return comps

    def _compressor_jobs(self, kv_score: torch.Tensor | None, idx_kv_score: torch.Tensor | None
                         ) -> list[tuple[Compressor, str, torch.Tensor]]:
        """(compressor, the store its entries go to, this step's score rows) for each of
        :meth:`_compressors`."""
        scores = {"compressed": kv_score, "idx_keys": idx_kv_score}
        jobs = []
        for name, comp in self._compressors().items():
            score = scores[name]
            assert score is not None, f"layer {self.layer_id}: no score rows for {name}"
            jobs.append((comp, name, score))
        return jobs

    def _store_rows(self, step: CacheStep, name: str, slots: torch.Tensor, rows: torch.Tensor,
                    values: torch.Tensor) -> None:
        """Write ``values`` [N, dim] into store ``name`` of the step's pool (``kv``,
        ``compressed`` or ``idx_keys``) as row ``rows[i]`` (a position for ``kv``, an entry
        index otherwise) of the sequence in slot ``slots[i]``; the step planned every such
        row's block.

        May change: how (e.g. one kernel that looks the block table up and encodes in place).
        Must keep: the stored bytes of the store's ``RowFormat.write`` (every reader, backend
        and saved cache decodes them), nothing else written."""
        store = step.pool.stores[name]
        store.write(store.flat_rows(slots, rows), values)

    def _raw_rows(self, comp: Compressor, kv_score: torch.Tensor, pos: torch.Tensor
                  ) -> torch.Tensor:
        """The raw rows [T, raw_width] of compressor ``comp`` for this step's tokens:
        ``[a_p | s_p + ape[p mod ratio]]`` from its score GEMM's output, in the acc dtype (what
        :meth:`_compress_entries` pools and the ring keeps).

        May change: the kernel. Must keep: the values (one fp32 addition per score channel)."""
        return comp.raw_rows(kv_score, pos, self.acc_dtype)

    def _compress_entries(self, comp: Compressor, step: CacheStep, name: str,
                          rows: torch.Tensor) -> torch.Tensor:
        """The entries [E, comp.dim] (layer dtype) that ``step`` completes for the store
        ``name`` ("compressed" or "idx_keys"), from the ring's raw rows and this step's ``rows``
        (``comp.raw_rows``) as ``step.jobs[name]`` maps them; called only when E > 0.

        May change: the kernel (gather, gated softmax pooling, RMSNorm, RoPE at j * ratio, the
        numerics simulation, in one launch).
        Must keep: the compressor's math (:meth:`Compressor.compress_jobs`, docs/spec.md §5.6),
        fp32 (acc dtype) pooling, the layer dtype out; the entries are stored by the stage,
        not here."""
        job = step.jobs[name]
        return comp.compress_jobs(step.ring(name), rows, job.ring_src, job.call_src, job.entries,
                                  self.rotary, self.dtype, self.cfg.simulate_quant,
                                  self.cfg.index_numerics)

    # ---- stage 4: selection -------------------------------------------------------------
    def _select(self, step: CacheStep, index_query: torch.Tensor | None,
                idx_weights: torch.Tensor | None) -> Selection:
        """Stage 4 (docs/spec.md §5.5, §5.7): what each query attends to - its window rows and
        its compressed entries (C4: the indexer's top-k, where it has a choice; C128 and C4
        steps where it has none: every visible entry), as flat store rows
        (:class:`~dsv4.stages.Selection`).

        May change: the kernels, and how many launches (e.g. the entries' and the window's
        flat rows in one).
        Must keep: the values of :meth:`_window_rows`, of the entries (the indexer's contract,
        :meth:`_indexer_select`, which reads stage 2's ``index_query``;
        :meth:`_visible_entries`) and of :meth:`_entry_rows`; int64 or int32 rows."""
        window = self._window_rows(step)
        r = self.compress_ratio
        if r == 0:
            return Selection(window, None, None)
        if self._indexer_decides(step):
            entries = self._indexer_select(step, *self._indexer_inputs(index_query, idx_weights))
        else:
            entries = self._visible_entries(step, r)
        return Selection(window, entries, self._entry_rows(step, entries))

    def _indexer_inputs(self, index_query: torch.Tensor | None, idx_weights: torch.Tensor | None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage 4's indexer inputs in a step where the indexer decides: stage 2's query and
        stage 1's head weights; RuntimeError where a stage left one out."""
        if index_query is None or idx_weights is None:
            raise RuntimeError(f"layer {self.layer_id}: the indexer decides this step but "
                               "stage 2 gave no index query or stage 1 no index weights")
        return index_query, idx_weights

    def _window_rows(self, step: CacheStep) -> torch.Tensor:
        """[T, window] int64 flat rows of the ``kv`` store each query sees: positions
        ``pos - window + 1 .. pos`` of its sequence, oldest first; -1 before position 0 (and
        where a block is no longer held).

        May change: how they are computed; int32 where the platform's attention reads them.
        Must keep: the values and their order."""
        return step.window_rows(self.window)

    def _indexer_select(self, step: CacheStep, idx_q: torch.Tensor, idx_weights: torch.Tensor
                        ) -> torch.Tensor:
        """The indexer's top-k entries [T, index_topk] per query of ``step`` (-1 pads), scored
        over the keys in the step's paged ``idx_keys`` store (docs/spec.md §5.7).

        May change: the kernels (scoring and top-k), their chunking and workspace.
        Must keep: the visibility rule (entry j is visible to position p iff j < (p + 1) // 4),
        min(index_topk, visible) entries per query, the tie rule (of equal scores the lower entry
        index is taken: prefill, chunks and decode pick the same set), -1 pads; bounded memory
        (never a full queries x entries matrix beyond ``attention_workspace_bytes``)."""
        assert self.indexer is not None
        return self.indexer.select_paged(step, idx_q, idx_weights, self.acc_dtype,
                                         self.cfg.attention_workspace_bytes)

    def _visible_entries(self, step: CacheStep, ratio: int) -> torch.Tensor:
        """Every compressed entry each query of ``step`` sees: [T, step.max_visible(ratio)]
        int64, entry j where j < (pos + 1) // ratio, ascending, -1 after (ratio-128 layers, and
        ratio-4 steps whose indexer would take every visible entry).

        May change: the kernel (e.g. one launch instead of ~5 small ops).
        Must keep: the shape, the order, the -1 pads, int64, no host sync."""
        return _every_visible_entry(step.pos, step.max_visible(ratio), ratio)

    def _entry_rows(self, step: CacheStep, entries: torch.Tensor) -> torch.Tensor:
        """Flat rows [T, k] (int64) of the ``compressed`` store for each query's entry indices
        ``entries`` [T, k] (-1 pads stay -1).

        May change: how they are computed; int32 where the platform's attention reads them.
        Must keep: the values."""
        return step.entry_rows("compressed", entries)

    # ---- stage 5: attention and the output path -----------------------------------------
    def _attend_and_project(self, q: torch.Tensor, step: CacheStep, selection: Selection
                            ) -> torch.Tensor:
        """Stage 5 (docs/spec.md §5.8, §5.9): sparse MQA with the sink over the selected rows,
        then the output path; [T, hidden] (under tensor parallelism this rank's partial sum,
        which the step all-reduces).

        May change: the kernels, and how many launches (e.g. the output path's inverse RoPE
        in the launch that writes the attention output).
        Must keep: the values of :meth:`forward_mqa` and :meth:`_o_proj`."""
        return self._o_proj(self.forward_mqa(q, step, selection), step.pos)

    def forward_mqa(self, q: torch.Tensor, step: CacheStep, selection: Selection
                    ) -> torch.Tensor:
        """Sparse MQA with the attention sink for every query of a step; o [T, heads, d].

        ``step`` gives the paged cache (``step.pool.stores``: ``kv`` window rows, ``compressed``
        entries, their formats and block tables) and the queries' positions and sequence slots;
        the stores already hold this step's window rows and entries (rows up to each query's
        position are valid). ``selection`` gives each query's window rows and compressed
        entries as flat store rows (-1 pads; no entries for SWA-only layers).

        May change: the kernel (a paged kernel can take the stores and flat rows as they are).
        Must keep: V = K, the window rule, the sink in the denominator only, fp32 softmax and
        accumulation, rows read through the store's format."""
        stores = step.pool.stores
        return sparse_mqa_paged(q, stores["kv"], selection.window_rows, stores.get("compressed"),
                                selection.entry_rows, self.attn_sink, self.cfg.softmax_scale,
                                self.acc_dtype, self.cfg.attention_workspace_bytes)

    def _o_proj(self, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Output path: inverse RoPE at the query position, grouped ``wo_a``, then ``wo_b``.

        May change: kernels and weight layouts (e.g. preshuffled fp8 ``wo_b``).
        Must keep: the g-major grouping (group g = heads g*hpg .. g*hpg + hpg - 1) and the
        [T, hidden] output; under tensor parallelism the local groups (``self.o_groups``, via
        :meth:`_wo_a_grouped`), whose partial sum the step all-reduces; under
        ``cfg.act_quant`` ``wo_b``'s input quantised (§6.3), ``wo_a``'s not."""
        o = self.rotary.rotate(o, positions, self.acc_dtype, inverse=True)
        return self._wo_b_product(self._wo_a_grouped(o))

    # ---- stage 6: the rings -------------------------------------------------------------
    def _keep_rings(self, step: CacheStep, raw: dict[str, torch.Tensor]) -> None:
        """Stage 6, the step's last: each compressor's rings keep this step's raw rows ``raw``
        (by store name, from stage 3) as ``step.jobs[name]`` maps them.

        May change: the kernels, and how many launches (e.g. both rings in one).
        Must keep: the values (:meth:`_keep_ring_rows`), after everything else of the step."""
        for name, rows in raw.items():
            self._keep_ring_rows(step, name, rows)

    def _keep_ring_rows(self, step: CacheStep, name: str, rows: torch.Tensor) -> None:
        """The raw rows ``rows`` [T, raw_width] (:meth:`_raw_rows`) that compressor store
        ``name``'s rings keep go into the rings (``step.jobs[name]``: ``keep_src`` rows to
        ``keep_dst`` ring rows).

        May change: the kernel. Must keep: a plain copy."""
        step.keep_ring_rows(name, rows)

    # ---- fixed steps --------------------------------------------------------------------
    def _fp8_linear_input(self, x: torch.Tensor) -> torch.Tensor:
        """The input of an fp8 linear as the official code multiplies it: under
        ``cfg.act_quant`` quantised per token to e4m3 in blocks of 128 with a power-of-two scale
        and dequantised (docs/spec.md §6.3; exact in bf16, so any GEMM of the result has
        the official numerics up to its summation order), else ``x``. A fixed step: overrides
        of the GEMMs call it, or quantise the same way inside their kernel."""
        return fp8_block_sim(x, FP8_BLOCK) if self.cfg.act_quant else x

    def _wo_b_product(self, z: torch.Tensor) -> torch.Tensor:
        """``wo_b`` of the grouped ``wo_a`` output z through the module, its input quantised
        under ``cfg.act_quant`` (the base path's tail of :meth:`_o_proj`, which platform
        overrides reuse where their own kernel does not take the call)."""
        return self.wo_b(self._fp8_linear_input(z))

    def _tp_all_reduce(self, y: torch.Tensor) -> torch.Tensor:
        """Tensor parallelism: the sum over the group of the ranks' partial ``wo_b`` outputs,
        on the current stream (identity without a group). A fixed step, not an override point,
        so a platform that replaces the output path cannot drop it."""
        return y if self.tp is None else self.tp.all_reduce(y)

    def _wo_a_grouped(self, o: torch.Tensor) -> torch.Tensor:
        g, r_o = self.o_groups, self.cfg.o_lora_rank
        w = self.wo_a.dequantized_weight(o.dtype).view(g, r_o, -1)
        return grouped_linear(o.reshape(o.shape[0], g, -1), w)

    # ---- validation ---------------------------------------------------------------------
    def _check_weights_loaded(self) -> None:
        """A layer built but never loaded holds placeholder weights (its outputs would be NaN):
        refuse to run it. One bool test per call."""
        if self._weights_loaded:
            return
        names = self.official_weight_names()
        shown = ", ".join(names[:4]) + (f", ... ({len(names)} tensors)" if len(names) > 4 else "")
        raise AttentionInputError(
            f"layer {self.layer_id} (ratio {self.compress_ratio}) was built but its weights were "
            f"never loaded ({shown}): call load_weights(...) or load_state_dict(...) first, or "
            "use dsv4.load_checkpoint")

    def _check_finite_input(self, x: Any) -> None:
        """Reject NaN / Inf in x before anything is written. Free of device syncs: CPU inputs
        are always checked; on another device only with ``cfg.check_finite_inputs`` (the check
        reads a flag back, so it is off by default and skipped during CUDA-graph capture)."""
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.numel() == 0:
            return  # _plan_call names the problem
        if x.device.type == "meta":
            return
        if x.device.type != "cpu":
            if not self.cfg.check_finite_inputs:
                return
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                return
        finite = torch.isfinite(x)
        if bool(finite.all()):
            return
        flat = finite.reshape(x.shape[0], -1) if x.dim() >= 1 else finite.reshape(1, -1)
        rows = (~flat.all(dim=1)).nonzero().flatten().tolist()
        raise AttentionInputError(
            f"x holds NaN or Inf in token row(s) {_short(torch.tensor(rows))}; nothing was "
            "written to the cache")

    def _plan_call(self, x: Any, positions: Any, cache: Any, seq_lens: Sequence[int] | None
                   ) -> list[tuple[CachePool, torch.Tensor | None, list[AttentionCache],
                                   list[int]]]:
        """Validate a forward call completely before anything is computed or written; group
        the sequences by pool: (pool, the rows of x for it or None when it is all of x, caches,
        token counts)."""
        if not isinstance(x, torch.Tensor):
            raise AttentionInputError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 2 or x.shape[1] != self.cfg.hidden_size or x.shape[0] == 0:
            raise AttentionInputError(
                f"x has shape {tuple(x.shape)}; expected [T, hidden_size={self.cfg.hidden_size}] "
                "with T >= 1")
        if x.dtype != self.dtype:
            raise AttentionInputError(f"x has dtype {x.dtype}; this layer runs in {self.dtype}")
        if x.device != self.device:
            raise AttentionInputError(f"x is on {x.device}; this layer is on {self.device}")
        if not isinstance(positions, torch.Tensor) or positions.dim() != 1:
            raise AttentionInputError("positions must be a 1-D integer tensor [T]")
        if positions.dtype not in (torch.int64, torch.int32):
            raise AttentionInputError(f"positions has dtype {positions.dtype}; expected int64")
        t = x.shape[0]
        if positions.shape[0] != t:
            raise AttentionInputError(f"positions has {positions.shape[0]} entries for T={t} "
                                      "tokens")
        if not isinstance(cache, (AttentionCache, Sequence)) or isinstance(cache, (str, bytes)):
            raise AttentionInputError(
                f"cache has type {type(cache).__name__}: give an AttentionCache, or a list "
                "with one per sequence (use layer.new_cache() / layer.new_caches(n))")
        caches = [cache] if isinstance(cache, AttentionCache) else list(cache)
        if isinstance(cache, AttentionCache):
            lens = [t] if seq_lens is None else list(seq_lens)
        else:
            lens = [1] * len(caches) if seq_lens is None else list(seq_lens)
        if (len(lens) != len(caches) or sum(lens) != t or seq_lens is not None and any(
                isinstance(n, bool) or not isinstance(n, int) or n <= 0 for n in lens)):
            raise AttentionInputError(f"seq_lens={lens} must give a positive token count for each "
                                      f"of the {len(caches)} cache(s) and sum to T={t}")
        if len({id(c) for c in caches}) != len(caches):
            raise AttentionInputError("the same cache appears twice in one call")
        # CPU positions cost nothing to check; device positions are read back (a sync), except
        # under CUDA-graph capture, where reading is impossible and they are trusted.
        check = positions.device.type == "cpu" or not (
            positions.is_cuda and torch.cuda.is_current_stream_capturing())
        if not check:
            pos_host = None
        elif positions.device.type == "cpu" and positions.dtype == torch.int64:
            pos_host = positions.detach().numpy()
        else:
            pos_host = positions.detach().to("cpu", torch.long).numpy()
        checked: set[int] = set()  # pools whose layer, dtype and device are checked
        held: list[int] = []
        for i, c in enumerate(caches):  # one pass: each cache checked, its length read
            if not isinstance(c, AttentionCache) or not c._live or id(c.pool) not in checked:
                self._check_cache(c, i, checked)
            held.append(c.pool._lengths[c.slot])
        lengths = np.array(held, dtype=np.int64)
        decode = t == len(caches)  # one token a sequence (the counts are positive, sum to t)
        counts = 1 if decode else np.asarray(lens, dtype=np.int64)
        if pos_host is not None:  # every sequence's positions continue its cache (vectorised)
            expect: np.ndarray = lengths
            if not decode:
                begins = np.cumsum(counts) - counts
                expect = np.repeat(lengths - begins, counts) + np.arange(t)
            wrong = np.flatnonzero(pos_host != expect)
            if wrong.size:  # the sequence whose tokens hold the first wrong one
                i = int(np.searchsorted(np.cumsum(lens), wrong[0], side="right"))
                n, c = lens[i], caches[i]
                b = sum(lens[:i])
                raise AttentionInputError(
                    f"positions of sequence {i} are {_short(torch.from_numpy(pos_host[b:b + n]))} "
                    f"but its cache holds {c.length} tokens: they must continue it as "
                    f"{_short(torch.arange(c.length, c.length + n))}")
        limits: Any = caches[0].max_seq_len  # one pool: one limit
        if len(checked) > 1:
            limits = np.fromiter((c.max_seq_len for c in caches), dtype=np.int64,
                                 count=len(caches))
        over = np.flatnonzero(lengths + counts > limits)
        if over.size:
            i = int(over[0])
            raise AttentionInputError(
                f"sequence {i}: {caches[i].length} cached + {lens[i]} new tokens exceed the "
                f"cache's max_seq_len={caches[i].max_seq_len}")
        if len(checked) == 1:  # one pool: the whole call is one group (no row lists)
            return [(caches[0].pool, None, caches, lens)]
        by_pool: dict[int, tuple[CachePool, list[int], list[AttentionCache], list[int]]] = {}
        begin = 0
        for c, n in zip(caches, lens, strict=True):
            group = by_pool.setdefault(id(c.pool), (c.pool, [], [], []))
            group[1].extend(range(begin, begin + n))
            group[2].append(c)
            group[3].append(n)
            begin += n
        return [(pool, upload_once(torch.tensor(rows), x.device), cs, ns)
                for pool, rows, cs, ns in by_pool.values()]

    def _check_cache(self, c: Any, i: int, checked: set[int]) -> None:
        """Cache ``i`` of a call is a live cache of this layer's kind; what its pool decides
        (layer, ratio, dtype, device) is checked once per pool (``checked``: ids of the pools
        done)."""
        if not isinstance(c, AttentionCache):
            raise AttentionInputError(f"cache {i} is a {type(c).__name__}, not an AttentionCache "
                                      "(use layer.new_cache())")
        if not c.alive:
            raise AttentionInputError(f"cache {i} was freed")
        if id(c.pool) in checked:
            return
        if c.layer_id != self.layer_id or c.compress_ratio != self.compress_ratio:
            raise AttentionInputError(f"cache {i} belongs to layer {c.layer_id} (ratio "
                                      f"{c.compress_ratio}), not to layer {self.layer_id}")
        if c.dtype != self.dtype or c.device != self.device:
            raise AttentionInputError(f"cache {i} is {c.dtype} on {c.device}; the layer is "
                                      f"{self.dtype} on {self.device}")
        checked.add(id(c.pool))

    def extra_repr(self) -> str:
        return (f"layer_id={self.layer_id}, compress_ratio={self.compress_ratio}, "
                f"platform={self.platform_name!r}, dtype={self.dtype}")


def _canonical_state_dict_hook(module: DeepseekV4Attention, state_dict: dict[str, Any],
                               prefix: str, local_metadata: Any) -> None:
    """state_dict() never leaks a platform layout: tagged weights are returned canonical."""
    for name, layout in module._weight_layouts.items():
        key = prefix + name
        if key in state_dict:
            state_dict[key] = layout.to_canonical(state_dict[key].detach())


def _after_load_state_dict(module: nn.Module, incompatible: Any) -> None:
    assert isinstance(module, DeepseekV4Attention)
    if not incompatible.missing_keys:
        module._weights_loaded = True
    module._after_weights_changed()


def _join(event: torch.cuda.Event | None, device: torch.device) -> None:
    """Make ``device``'s current stream wait for a side stream's ``event`` (None: nothing to
    wait for, the work ran in stream order)."""
    if event is not None:
        torch.cuda.current_stream(device).wait_event(event)


def _every_visible_entry(pos: torch.Tensor, n: int, r: int) -> torch.Tensor:
    """Selection [T, n] of every entry j < (p + 1) // r for each query position p, -1 padded
    (ratio-128 layers attend to all visible entries)."""
    j = torch.arange(n, device=pos.device)
    visible = j[None, :] < ((pos + 1) // r)[:, None]
    return torch.where(visible, j[None, :], -1)


def _split_steps(counts: list[int], step_tokens: int) -> list[tuple[int, int, list[int]]]:
    """Cut a call's tokens (sequence 0's, then 1's, ...) into steps of at most ``step_tokens``:
    (first token, end token, tokens of each sequence in the step)."""
    if sum(counts) <= step_tokens:
        return [(0, sum(counts), list(counts))]
    pieces = []
    left = list(counts)
    begin = 0
    while any(left):
        room = step_tokens
        part = [0] * len(counts)
        for i, n in enumerate(left):
            take = min(n, room)
            part[i] = take
            left[i] -= take
            room -= take
            if not room:
                break
        pieces.append((begin, begin + sum(part), part))
        begin += sum(part)
    return pieces


def _short(t: torch.Tensor) -> str:
    v = t.tolist()
    return str(v) if len(v) <= 6 else f"[{v[0]}, {v[1]}, ..., {v[-1]}] ({len(v)} tokens)"


def attention_layers(module: nn.Module) -> list[DeepseekV4Attention]:
    """The attention layers of ``module`` (itself, if it is one), in module order."""
    if isinstance(module, DeepseekV4Attention):
        return [module]
    return [m for m in module.modules() if isinstance(m, DeepseekV4Attention)]
