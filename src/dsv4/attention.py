"""``DeepseekV4Attention``: the platform-neutral DeepSeek-V4 attention layer.

The forward is a short sequence of named steps (dsv4-attention.md §8.3). The steps a platform may
replace are listed in :attr:`DeepseekV4Attention.OVERRIDE_POINTS`; each one's docstring says what a
platform may change and what it must keep. Shared code never asks which platform it runs on.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from dsv4.config import DSV4Config
from dsv4.layers.cache import AttentionCache, CachePool
from dsv4.layers.compressor import Compressor
from dsv4.layers.fp8 import e8m0_to_float
from dsv4.layers.indexer import Indexer
from dsv4.layers.linear import Linear, MergedLinear
from dsv4.layers.mqa import sparse_mqa_batched, sparse_mqa_with_sink
from dsv4.layers.norm import RMSNorm, rms_normalize
from dsv4.layers.quant_sim import fp8_block_sim
from dsv4.layers.rotary import RotaryEmbedding
from dsv4.layers.weight_layout import WeightLayout, set_layout
from dsv4.offload import BaseOffloader, resolve_offloader
from dsv4.parallel import execute_in_parallel
from dsv4.tensor_parallel import TPInfo, local_sizes, resolve_tp
from dsv4.weights import load_layer_weights, official_weight_specs

SUPPORTED_DTYPES = (torch.bfloat16, torch.float32, torch.float64)


class AttentionInputError(ValueError):
    """A forward call's inputs are invalid; nothing was computed and no cache was touched."""


@dataclass
class _Segment:
    """The tokens of one sequence inside a call: x[begin:end] continues ``cache`` at its length."""

    cache: AttentionCache
    begin: int
    end: int

    @property
    def start_pos(self) -> int:
        return self.cache.length

    @property
    def end_pos(self) -> int:
        return self.cache.length + self.end - self.begin


class DeepseekV4Attention(nn.Module):
    """One DSV4 attention layer (SWA-only, C4A with indexer, or C128A), any device and dtype."""

    OVERRIDE_POINTS: ClassVar[tuple[str, ...]] = (
        "_run_parallel_input_projections",
        "_fused_wqa_wkv_gemm",
        "_compressor_kv_score_gemm",
        "_indexer_kv_score_gemm",
        "_indexer_weights_gemm",
        "_fused_compressor_score_gemm",
        "_fused_input_projections_gemm",
        "forward_mqa",
        "forward_mqa_batched",
        "_o_proj",
    )
    platform_name: ClassVar[str] = "reference"

    # ------------------------------------------------------------------ construction
    def __init__(self, cfg: DSV4Config, layer_id: int, *, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.bfloat16, offloader: Any = None,
                 aux_streams: Sequence[Any] | None = None, tp_group: Any = None) -> None:
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

        # Post-load compressor GEMM fusion state (seed-features.md B.2): a non-persistent buffer,
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

    @classmethod
    def build(cls, cfg: DSV4Config, layer_id: int, platform: str = "reference",
              device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16,
              **kwargs: Any) -> DeepseekV4Attention:
        """Build the layer of ``layer_id`` for ``platform`` (see ``dsv4.platforms.available()``)."""
        from dsv4.platforms import get_platform

        plat = get_platform(platform, device=device)
        return plat.build_attention(cfg, layer_id, device=device, dtype=dtype, **kwargs)

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

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load official checkpoint tensors (names relative to the layer, e.g. ``wq_a.weight``).

        Everything is validated first (unknown, duplicate, missing, mis-shaped, mis-typed and
        non-finite tensors are errors naming the tensor); nothing is assigned unless all pass.
        """
        load_layer_weights(self, weights)
        self._after_weights_changed()

    def new_cache(self, max_seq_len: int = 4096) -> AttentionCache:
        if not 0 < max_seq_len <= self.cfg.max_position_embeddings:
            raise ValueError(f"max_seq_len={max_seq_len} must be in 1 .. max_position_embeddings"
                             f"={self.cfg.max_position_embeddings}")
        return AttentionCache.allocate(
            layer_id=self.layer_id, compress_ratio=self.compress_ratio, max_seq_len=max_seq_len,
            head_dim=self.head_dim, index_head_dim=self.cfg.index_head_dim, dtype=self.dtype,
            acc_dtype=self.acc_dtype, device=self.device)

    def new_caches(self, n: int, max_seq_len: int = 4096) -> list[AttentionCache]:
        """``n`` caches in one :class:`~dsv4.layers.cache.CachePool`: a decode batch of them runs
        every sequence's cache reads and writes and the attention as single batched operations
        (:meth:`forward_mqa_batched`) instead of a loop over sequences."""
        if not 0 < max_seq_len <= self.cfg.max_position_embeddings:
            raise ValueError(f"max_seq_len={max_seq_len} must be in 1 .. max_position_embeddings"
                             f"={self.cfg.max_position_embeddings}")
        return CachePool.allocate(
            n, layer_id=self.layer_id, compress_ratio=self.compress_ratio,
            max_seq_len=max_seq_len, head_dim=self.head_dim,
            index_head_dim=self.cfg.index_head_dim, dtype=self.dtype, acc_dtype=self.acc_dtype,
            device=self.device).caches

    # ------------------------------------------------------------------ post-load state
    def default_passes(self) -> tuple[str, ...]:
        """This platform's post-load passes, in order."""
        from dsv4.platforms.registry import platform_spec

        return platform_spec(self.platform_name).pass_names

    def prepare_compressor_gemm_fusion(self) -> bool:
        """Upstream's entry point: run the compressor fusion pass on this layer; True if fused."""
        from dsv4.passes.compressor_fusion import CompressorFusionPass

        plan = CompressorFusionPass().plan(self)
        if callable(plan):
            plan()
            return True
        return False

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
        packed = self._packed_input_weight
        if isinstance(packed, torch.Tensor):
            from dsv4.passes.input_fusion import input_segments, pack_layer_inputs

            ptr = packed.untyped_storage().data_ptr()
            if any(p.untyped_storage().data_ptr() != ptr
                   for _, p, _ in input_segments(self)[1:]):
                pack_layer_inputs(self)
            elif self.fused_wqa_wkv.scale is not None:  # new block scales: re-derive fp32 copy
                self._packed_fp8_scale = e8m0_to_float(self.fused_wqa_wkv.scale.data).to(
                    self.device)
            return
        fused = self._fused_compressor_weight
        if isinstance(fused, torch.Tensor):
            main, idx = self.fused_compressor_params()
            aliased = (main.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
                       == idx.untyped_storage().data_ptr())
            if not aliased:
                from dsv4.passes.compressor_fusion import fuse_compressor_weights

                fuse_compressor_weights(self)

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
    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                cache: AttentionCache | Sequence[AttentionCache],
                seq_lens: Sequence[int] | None = None) -> torch.Tensor:
        """Prefill, a prefill chunk, or decode of one or several sequences.

        x: [T, hidden] in the layer dtype; positions: [T] ascending from each cache's length
        (a CPU tensor is checked without a device sync; the call is CUDA-graph capturable).
        ``cache`` is one cache, or one cache per sequence with ``seq_lens`` giving how many
        consecutive tokens of x belong to each (default: one token each, a decode batch).
        """
        segments = self._plan_call(x, positions, cache, seq_lens)
        # positions are validated to be arange(length, length + n) per sequence: rebuild them on
        # the device from those ints (no host-to-device copy, nothing read back)
        pos = torch.cat([torch.arange(s.start_pos, s.end_pos, device=x.device)
                         for s in segments]) if len(segments) > 1 else torch.arange(
            segments[0].start_pos, segments[0].end_pos, device=x.device)
        qr_kv, kv_score, idx_kv_score, idx_weights = self._run_parallel_input_projections(x)
        qr, kv = self._latent_norms(qr_kv)
        q = self._query_heads(qr, pos)
        kv = self._kv_rows(kv, pos)
        idx_q = None
        if self.indexer is not None:
            idx_q = self.indexer.query(qr, pos, self.rotary, self.acc_dtype,
                                       self.cfg.simulate_quant)
        rings: list[tuple[Compressor, torch.Tensor, torch.Tensor, int]] = []
        pool = self._decode_pool(segments)
        if pool is not None:  # one token per sequence, all caches in one pool: batched
            slots = pool.slots_of([seg.cache for seg in segments])
            self._write_pooled(pool, slots, segments, pos, kv, kv_score, idx_kv_score)
            selection = self._select_pooled(pool, slots, segments, pos, idx_q, idx_weights)
            o = self.forward_mqa_batched(q, pos, pool, slots, selection)
        else:
            o = torch.empty_like(q)
            for seg in segments:
                sl = slice(seg.begin, seg.end)
                rings += self._write_cache(seg, pos[sl], kv[sl], _rows(kv_score, sl),
                                           _rows(idx_kv_score, sl))
                selection = self._select_compressed(seg, pos[sl], _rows(idx_q, sl),
                                                    _rows(idx_weights, sl))
                o[sl] = self.forward_mqa(q[sl], pos[sl], seg.cache, selection)
        # commit last: a failure above leaves every cache as it was
        for comp, ring, rows, start in rings:
            comp.store_ring_rows(ring, rows, start)
        for seg in segments:
            seg.cache.length = seg.end_pos
        return self._tp_all_reduce(self._o_proj(o, pos))

    # ---- override points ---------------------------------------------------------------
    def _run_parallel_input_projections(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """The four input GEMMs that read x: returns (qr_kv, kv_score, indexer_kv_score,
        indexer_weights), absent ones as None.

        May change: where and how the GEMMs run (streams, fusion, kernels).
        Must keep: qr_kv comes from :meth:`_fused_wqa_wkv_gemm` (never the module directly: a
        platform's weights may be in a private layout), scores are fp32 (acc dtype), the tuple
        order, and the upstream stream plan: fused_wqa_wkv on the current stream, aux 0..2 =
        compressor score, indexer weights, indexer compressor score, overlap only for
        T <= multi_stream_token_threshold.
        """
        if self._input_pack is not None:
            return self._fused_input_projections_gemm(x)
        return self._stream_input_projections(x)

    # ---- the stream plan (a fixed step that platform overrides call) -----------------
    def _stream_input_projections(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """The upstream stream plan (not an override point: platforms call it)."""
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
        return qr_kv, score, idx_kv_score, idx_weights

    def _fused_wqa_wkv_gemm(self, x: torch.Tensor) -> torch.Tensor:
        """qr_kv = x @ [wq_a | wkv]^T, [T, q_lora_rank + head_dim] in the layer dtype.

        The single place where ``fused_wqa_wkv`` is multiplied (upstream #51821).
        May change: the kernel and the weight layout (e.g. preshuffled fp8 with activation
        quantisation).
        Must keep: shape, dtype and the [qr | kv] column order; fall back to this method via
        super() for inputs the fast path does not take.
        """
        return self.fused_wqa_wkv(x)

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
        [T, N_main + N_idx] (seed-features.md B.4).

        May change: the kernel.
        Must keep: one GEMM, fp32 output, the column order main then indexer."""
        w = self._fused_compressor_weight
        assert isinstance(w, torch.Tensor)
        return torch.nn.functional.linear(x.to(self.acc_dtype), w.to(self.acc_dtype))

    def _fused_input_projections_gemm(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """All input projections in one launch over the packed weights (after the
        ``fuse_input_projections`` pass); same tuple as :meth:`_run_parallel_input_projections`.

        May change: the kernel and its tiling.
        Must keep: qr_kv in bf16, scores in fp32, indexer weights in bf16, the tuple order.
        """
        from dsv4.kernels.fused_input_proj import fused_input_projections
        from dsv4.passes.input_fusion import current_pack

        pack = current_pack(self)
        outs = dict(zip((s.name for s in pack.segments), fused_input_projections(x, pack),
                        strict=True))
        return (outs["qr_kv"], outs.get("kv_score"), outs.get("idx_kv_score"),
                outs.get("idx_weights"))

    def forward_mqa(self, q: torch.Tensor, positions: torch.Tensor, cache: AttentionCache,
                    selection: torch.Tensor | None) -> torch.Tensor:
        """Sparse MQA with the attention sink for one sequence's queries; o [T, heads, d].

        ``cache`` already holds this call's window rows and compressed entries (not yet
        committed: rows up to positions[-1] are valid). ``selection`` [T, k] indexes
        ``cache.compressed`` (-1 pads) or is None for SWA-only layers.

        May change: the kernel and the cache format.
        Must keep: V = K, the window rule, the sink in the denominator only, fp32 softmax and
        accumulation."""
        return sparse_mqa_with_sink(q, positions, cache.length, cache.kv, self.window,
                                    cache.compressed, selection, self.attn_sink,
                                    self.cfg.softmax_scale, self.acc_dtype)

    def forward_mqa_batched(self, q: torch.Tensor, positions: torch.Tensor, pool: CachePool,
                            slots: torch.Tensor, selection: torch.Tensor | None) -> torch.Tensor:
        """:meth:`forward_mqa` for a decode batch of pooled caches: query b [heads, d] at
        ``positions[b]`` attends to slot ``slots[b]`` of ``pool``; o [B, heads, d].

        ``selection`` [B, k] indexes each query's slot of ``pool.compressed`` (-1 pads) or is
        None for SWA-only layers. The forward takes this path only when the platform's
        ``forward_mqa`` is the base one or it overrides this method too, so a platform's own
        attention kernel is never bypassed.

        May change: the kernel and the cache format.
        Must keep: what :meth:`forward_mqa` computes for each row."""
        return sparse_mqa_batched(q, positions, pool.kv, slots, self.window, pool.compressed,
                                  selection, self.attn_sink, self.cfg.softmax_scale,
                                  self.acc_dtype)

    def _o_proj(self, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Output path: inverse RoPE at the query position, grouped ``wo_a``, then ``wo_b``.

        May change: kernels and weight layouts (e.g. preshuffled fp8 ``wo_b``).
        Must keep: the g-major grouping (group g = heads g*hpg .. g*hpg + hpg - 1) and the
        [T, hidden] output; under tensor parallelism the local groups (``self.o_groups``, via
        :meth:`_wo_a_grouped`), whose partial sum the forward all-reduces."""
        o = self.rotary.rotate(o, positions, self.acc_dtype, inverse=True)
        return self.wo_b(self._wo_a_grouped(o))

    # ---- fixed steps --------------------------------------------------------------------
    def _tp_all_reduce(self, y: torch.Tensor) -> torch.Tensor:
        """Tensor parallelism: the sum over the group of the ranks' partial ``wo_b`` outputs,
        on the current stream (identity without a group). A fixed step, not an override point,
        so a platform that replaces :meth:`_o_proj` cannot drop it."""
        return y if self.tp is None else self.tp.all_reduce(y)

    def _wo_a_grouped(self, o: torch.Tensor) -> torch.Tensor:
        g, r_o = self.o_groups, self.cfg.o_lora_rank
        w = self.wo_a.dequantized_weight(o.dtype).view(g, r_o, -1)
        z = torch.einsum("tgc,grc->tgr", o.reshape(o.shape[0], g, -1), w)
        return z.flatten(1)

    def _latent_norms(self, qr_kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q_r = self.cfg.q_lora_rank
        qr = self.q_norm(qr_kv[:, :q_r], acc_dtype=self.acc_dtype)
        kv = self.kv_norm(qr_kv[:, q_r:], acc_dtype=self.acc_dtype)
        return qr, kv

    def _query_heads(self, qr: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        q = rms_normalize(q, self.cfg.rms_norm_eps, self.acc_dtype)  # per head, no weight
        return self.rotary.rotate(q, pos, self.acc_dtype).to(self.dtype)

    def _kv_rows(self, kv: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        kv = self.rotary.rotate(kv, pos, self.acc_dtype)
        if self.cfg.simulate_quant:
            nope = self.head_dim - self.rope_dim
            kv = torch.cat((fp8_block_sim(kv[:, :nope]), kv[:, nope:]), dim=-1)
        return kv

    def _compressor_stores(self, store: AttentionCache | CachePool,
                           kv_score: torch.Tensor | None, idx_kv_score: torch.Tensor | None,
                           ) -> list[tuple[Compressor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(compressor, its raw-row ring, its entry store, this call's score rows) for the main
        and the indexer compressor of this layer type, in a cache or a pool."""
        jobs = []
        if self.compressor is not None:
            assert kv_score is not None and store.raw is not None
            assert store.compressed is not None
            jobs.append((self.compressor, store.raw, store.compressed, kv_score))
        if self.indexer is not None:
            assert idx_kv_score is not None and store.idx_raw is not None
            assert store.idx_keys is not None
            jobs.append((self.indexer.compressor, store.idx_raw, store.idx_keys, idx_kv_score))
        return jobs

    def _write_cache(self, seg: _Segment, pos: torch.Tensor, kv: torch.Tensor,
                     kv_score: torch.Tensor | None, idx_kv_score: torch.Tensor | None,
                     ) -> list[tuple[Compressor, torch.Tensor, torch.Tensor, int]]:
        """Window rows and every entry completed by this segment. Returns the raw rows for the
        compressors' rings, stored when the call commits (a ring row replaced now could be one
        that a retry of a failed call still needs)."""
        c = seg.cache
        c.kv[seg.start_pos:seg.end_pos] = kv
        pending = []
        for comp, ring, out, score in self._compressor_stores(c, kv_score, idx_kv_score):
            rows = comp.raw_rows(score, pos, ring.dtype)
            j0, j1 = seg.start_pos // comp.ratio, seg.end_pos // comp.ratio
            if j1 > j0:
                first = comp.first_row_needed(j0)
                src = torch.cat((comp.ring_rows_between(ring, first, seg.start_pos), rows))
                out[j0:j1] = comp.compress(src, first, j0, j1, self.rotary, self.dtype,
                                           self.cfg.simulate_quant)
            pending.append((comp, ring, rows, seg.start_pos))
        return pending

    def _write_pooled(self, pool: CachePool, slots: torch.Tensor, segments: list[_Segment],
                      pos: torch.Tensor, kv: torch.Tensor, kv_score: torch.Tensor | None,
                      idx_kv_score: torch.Tensor | None) -> None:
        """A pooled decode batch (one token per slot): one indexed write per row store, then the
        entries it completes (the sequences whose token ends a block), one batched compress per
        compressor."""
        pool.kv[slots, pos] = kv
        for comp, ring, out, score in self._compressor_stores(pool, kv_score, idx_kv_score):
            comp.write_raw_rows_at(score, slots, pos, ring)
            done = [i for i, seg in enumerate(segments) if seg.end_pos % comp.ratio == 0]
            if not done:
                continue
            done_slots = pool.slots_of([segments[i].cache for i in done])
            entries = torch.cat([pos[i:i + 1] for i in done]) // comp.ratio  # (p + 1) / r - 1
            out[done_slots, entries] = comp.compress_at(ring, done_slots, entries, self.rotary,
                                                        self.dtype, self.cfg.simulate_quant)

    def _select_compressed(self, seg: _Segment, pos: torch.Tensor, idx_q: torch.Tensor | None,
                           idx_weights: torch.Tensor | None) -> torch.Tensor | None:
        """Compressed entries each query attends to: the indexer's top-k (ratio 4) or every
        visible entry (ratio 128), -1 padded; None for SWA-only layers."""
        r = self.compress_ratio
        if r == 0:
            return None
        n = seg.end_pos // r
        if self.indexer is not None:
            assert idx_q is not None and idx_weights is not None
            assert seg.cache.idx_keys is not None
            return self.indexer.select(idx_q, idx_weights, seg.cache.idx_keys[:n], pos,
                                       self.acc_dtype)
        return _every_visible_entry(pos, n, r)

    def _select_pooled(self, pool: CachePool, slots: torch.Tensor, segments: list[_Segment],
                       pos: torch.Tensor, idx_q: torch.Tensor | None,
                       idx_weights: torch.Tensor | None) -> torch.Tensor | None:
        """:meth:`_select_compressed` for a pooled decode batch: entries of each query's own
        slot, as wide as the longest sequence needs (-1 where a query sees fewer)."""
        r = self.compress_ratio
        if r == 0:
            return None
        n = max(seg.end_pos for seg in segments) // r
        if self.indexer is not None:
            assert idx_q is not None and idx_weights is not None and pool.idx_keys is not None
            keys = pool.idx_keys[slots, :n]  # [B, n, index_head_dim]
            return self.indexer.select(idx_q, idx_weights, keys, pos, self.acc_dtype)
        return _every_visible_entry(pos, n, r)

    def _decode_pool(self, segments: list[_Segment]) -> CachePool | None:
        """The pool of a decode batch that can run batched: one token per sequence, every cache
        from the same pool, and a platform that keeps the base ``forward_mqa`` or overrides
        ``forward_mqa_batched`` as well. None: run sequence by sequence."""
        pool = segments[0].cache.pool
        if pool is None:
            return None
        if any(seg.end - seg.begin != 1 or seg.cache.pool is not pool for seg in segments):
            return None
        return pool if self.batches_pooled_decode() else None

    @classmethod
    def batches_pooled_decode(cls) -> bool:
        """Whether a decode batch of pooled caches runs :meth:`forward_mqa_batched`: only when
        the platform keeps the base :meth:`forward_mqa` or overrides both (a platform's own
        attention kernel is never bypassed)."""
        return (cls.forward_mqa is DeepseekV4Attention.forward_mqa
                or cls.forward_mqa_batched is not DeepseekV4Attention.forward_mqa_batched)

    # ---- validation ---------------------------------------------------------------------
    def _plan_call(self, x: Any, positions: Any, cache: Any,
                   seq_lens: Sequence[int] | None) -> list[_Segment]:
        """Validate a forward call completely before anything is computed or written."""
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
        caches = [cache] if isinstance(cache, AttentionCache) else list(cache)
        if isinstance(cache, AttentionCache):
            lens = [t] if seq_lens is None else list(seq_lens)
        else:
            lens = [1] * len(caches) if seq_lens is None else list(seq_lens)
        if len(lens) != len(caches) or any(n <= 0 for n in lens) or sum(lens) != t:
            raise AttentionInputError(f"seq_lens={lens} must give a positive token count for each "
                                      f"of the {len(caches)} cache(s) and sum to T={t}")
        if len({id(c) for c in caches}) != len(caches):
            raise AttentionInputError("the same cache appears twice in one call")
        # CPU positions cost nothing to check; device positions are read back (a sync), except
        # under CUDA-graph capture, where reading is impossible and they are trusted.
        check = positions.device.type == "cpu" or not (
            positions.is_cuda and torch.cuda.is_current_stream_capturing())
        pos_host = positions.detach().to("cpu", torch.long) if check else None
        segments = []
        begin = 0
        for i, (c, n) in enumerate(zip(caches, lens, strict=True)):
            self._check_cache(c, i)
            expect = torch.arange(c.length, c.length + n)
            got = expect if pos_host is None else pos_host[begin:begin + n]
            if not torch.equal(got, expect):
                raise AttentionInputError(
                    f"positions of sequence {i} are {_short(got)} but its cache holds {c.length} "
                    f"tokens: they must continue it as {_short(expect)}")
            if c.length + n > c.max_seq_len:
                raise AttentionInputError(
                    f"sequence {i}: {c.length} cached + {n} new tokens exceed the cache's "
                    f"max_seq_len={c.max_seq_len}")
            segments.append(_Segment(c, begin, begin + n))
            begin += n
        return segments

    def _check_cache(self, c: Any, i: int) -> None:
        if not isinstance(c, AttentionCache):
            raise AttentionInputError(f"cache {i} is a {type(c).__name__}, not an AttentionCache "
                                      "(use layer.new_cache())")
        if c.layer_id != self.layer_id or c.compress_ratio != self.compress_ratio:
            raise AttentionInputError(f"cache {i} belongs to layer {c.layer_id} (ratio "
                                      f"{c.compress_ratio}), not to layer {self.layer_id}")
        if c.dtype != self.dtype or c.device != self.device:
            raise AttentionInputError(f"cache {i} is {c.dtype} on {c.device}; the layer is "
                                      f"{self.dtype} on {self.device}")

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
    module._after_weights_changed()


def _every_visible_entry(pos: torch.Tensor, n: int, r: int) -> torch.Tensor:
    """Selection [T, n] of every entry j < (p + 1) // r for each query position p, -1 padded
    (ratio-128 layers attend to all visible entries)."""
    j = torch.arange(n, device=pos.device)
    visible = j[None, :] < ((pos + 1) // r)[:, None]
    return torch.where(visible, j[None, :], -1)


def _rows(t: torch.Tensor | None, sl: slice) -> Any:
    return None if t is None else t[sl]


def _short(t: torch.Tensor) -> str:
    v = t.tolist()
    return str(v) if len(v) <= 6 else f"[{v[0]}, {v[1]}, ..., {v[-1]}] ({len(v)} tokens)"

