"""DeepSeek-V4 attention configuration: HF ``config.json`` parsing, validation and presets.

Only the keys the attention layer needs are modelled. Every invalid value raises
:class:`ConfigError` with a message that names the field and the rule it breaks.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsv4.config_error import ConfigError

KV_CACHE_DTYPES = ("auto", "bf16", "fp8_ds_mla")
INDEX_CACHE_DTYPES = ("auto", "bf16", "fp8", "fp4")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flashmla")
RUNTIME_OPTIONS = ("simulate_quant", "act_quant", "multi_stream_token_threshold",
                   "kv_cache_dtype", "index_cache_dtype", "index_numerics", "max_step_tokens",
                   "attention_workspace_bytes", "check_finite_inputs", "attention_backend")
"""Options of this package (not model keys) that a config dict may carry."""


MODEL_KEYS = ("compress_ratios", "rope_scaling", "quantization_config")
"""Official config keys that are not dataclass fields of their own name."""
OTHER_KNOWN_KEYS = frozenset({
    # the rest of the official Hugging Face config of the DeepSeek-V3 / V4 family (the model
    # around the attention: MoE, hyper-connections, generation defaults), ignored here
    "model_type", "architectures", "auto_map", "torch_dtype", "dtype", "transformers_version",
    "bos_token_id", "eos_token_id", "pad_token_id", "hidden_act", "initializer_range",
    "use_cache", "tie_word_embeddings", "attention_bias", "attention_dropout",
    "intermediate_size", "moe_intermediate_size", "n_routed_experts", "n_shared_experts",
    "num_experts_per_tok", "routed_scaling_factor", "scoring_func", "topk_method",
    "norm_topk_prob", "n_group", "topk_group", "first_k_dense_replace", "moe_layer_freq",
    "ep_size", "aux_loss_alpha", "seq_aux", "pretraining_tp", "kv_lora_rank",
    "qk_nope_head_dim", "v_head_dim", "hc_mult", "hc_sinkhorn_iters", "hc_eps",
    "n_hash_layers", "swiglu_limit", "expert_dtype", "scale_fmt",
    # written by this package: save_checkpoint's layer list, the tiny LM's own keys
    "dsv4_saved_layers", "tokenizer", "task",
})
"""Keys a config may carry that the attention does not use: never reported as unknown."""


class UnknownConfigKeyWarning(UserWarning):
    """A config key that neither dialect knows (a typo, most likely): it was ignored, so its
    setting did not take effect. The message names the key and the key it is closest to."""


def warn_unknown_keys(d: Mapping[str, Any], stacklevel: int = 3) -> list[str]:
    """Warn (:class:`UnknownConfigKeyWarning`) about every key of ``d`` that no dialect knows,
    naming the key dsv4 reads that it is closest to (``kv_cache_dtyp`` -> ``kv_cache_dtype``);
    returns those keys. transformers' and the official model keys that the attention does not
    use are known, and pass in silence."""
    import difflib

    from dsv4.dialects.transformers_config import TRANSFORMERS_KEYS

    ours = [f.name for f in dataclasses.fields(DSV4Config)] + list(MODEL_KEYS)
    known = {*ours, *OTHER_KNOWN_KEYS, *TRANSFORMERS_KEYS}
    unknown = [k for k in d if k not in known]
    if unknown:
        parts = []
        for k in unknown:  # the closest key dsv4 reads (case aside), else any known key
            close = (difflib.get_close_matches(str(k), ours, n=1, cutoff=0.75)
                     or difflib.get_close_matches(str(k).lower(), ours, n=1, cutoff=0.75)
                     or difflib.get_close_matches(str(k), sorted(known), n=1, cutoff=0.75))
            parts.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        warnings.warn(UnknownConfigKeyWarning(
            f"config key(s) {', '.join(parts)} unknown to dsv4 and ignored (their settings did "
            "not take effect)"), stacklevel=stacklevel)
    return unknown


@dataclass(frozen=True)
class YarnScaling:
    """YaRN frequency blend (applies to compressed layers only, see docs/spec.md §4)."""

    factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class DSV4Config:
    """Everything one DSV4 attention layer needs to know about the model.

    Field names follow the HF ``config.json`` keys. ``simulate_quant``,
    ``multi_stream_token_threshold`` and ``check_finite_inputs`` are runtime options of this
    package, not model keys.
    """

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    sliding_window: int
    compress_ratios: tuple[int, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    num_nextn_predict_layers: int = 1
    num_key_value_heads: int = 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: YarnScaling | None = field(default_factory=YarnScaling)
    max_position_embeddings: int = 1048576
    vocab_size: int = 129280
    fp8_weights: bool = True
    """True when the checkpoint stores wq_a, wkv, wq_b, wo_a, wo_b, indexer.wq_b as fp8 e4m3
    with ue8m0 128x128 block scales (``quantization_config`` present)."""
    weight_block_size: tuple[int, int] = (128, 128)
    simulate_quant: bool = True
    """Run the official FP8 (kv nope) and Hadamard+FP4 (indexer) quantisation simulations."""
    act_quant: bool = False
    """The official activation quantisation of the fp8 linears (docs/spec.md §6.3): the
    inputs of ``wq_a | wkv``, ``wq_b``, ``indexer.wq_b`` and ``wo_b`` (not ``wo_a``) quantised
    per token to e4m3 in blocks of 128 with power-of-two scales (``fp8_block_sim`` at 128), in
    every platform's GEMMs. Off: bf16 activations (the §9 "small error" against the official
    numerics). A runtime option: never written to ``config.json``."""
    multi_stream_token_threshold: int = 1024
    """Streams overlap only in steps of at most this many tokens: the input GEMMs on the aux
    streams (upstream's plan), and a platform's stage-2 branches (the ``cuda`` platform's query
    heads and C4 indexer query on side streams, :class:`dsv4.stages.QueryAndRows`); 0: one
    stream."""
    kv_cache_dtype: str = "auto"
    """Stored format of window rows and compressed entries: ``auto`` (the layer dtype, exact),
    ``bf16``, or ``fp8_ds_mla`` (FlashMLA's 584-byte DeepSeek-V4 layout)."""
    index_cache_dtype: str = "auto"
    """Stored format of the indexer keys: ``auto`` (the layer dtype), ``bf16``, ``fp8`` (132 B a
    key) or ``fp4`` (MXFP4, 68 B a key)."""
    index_numerics: str = "hadamard_fp4"
    """The indexer's simulated numerics when ``simulate_quant`` is on: ``hadamard_fp4`` (the
    official Hadamard rotation + FP4) or ``fp8`` (the engines': fp8 with a power-of-two scale
    per 128-vector, no Hadamard)."""
    max_step_tokens: int = 8192
    """A forward call with more tokens runs as steps of at most this many (all or nothing). It
    bounds a long prefill's activations: peak extra memory is about one step's activations
    (linear in this, e.g. fp32 query heads of every token of the step) plus the call's output,
    never quadratic in the call's tokens (measured: a 128K-token Flash C4 call, 3.6 GiB)."""
    attention_workspace_bytes: int = 256 << 20
    """Budget for the reference path's per-chunk workspace: the indexer's logits (queries x index
    heads x visible entries) and the gathered attention rows are computed for chunks of queries
    sized to fit it, so nothing scales with tokens x entries beyond a chunk."""
    check_finite_inputs: bool = False
    """Reject NaN / Inf in ``x`` on a GPU too (CPU inputs are always checked). Off by default:
    the check reads a flag back from the device (a sync), which decode steps and CUDA-graph
    capture avoid. A runtime option: never written to ``config.json``."""
    attention_backend: str = "auto"
    """Which kernel runs the sparse attention (``forward_mqa``) on the ``cuda`` platform:
    ``torch`` (the reference gather + softmax), ``triton`` (dsv4's paged sparse-MQA kernel),
    ``flashmla`` (FlashMLA's kernels from the optional ``sgl-flash-mla`` wheel; an error where
    it is not installed or the shape is not one it supports) or ``auto`` (FlashMLA where it is
    installed and supports the shape, else ``triton``). Other platforms run ``torch``. A
    runtime option: never written to ``config.json``."""

    # ------------------------------------------------------------------ derived
    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.o_groups

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5

    @property
    def index_weight_scale(self) -> float:
        return self.index_head_dim**-0.5 * self.index_n_heads**-0.5

    @property
    def num_layers_with_mtp(self) -> int:
        return self.num_hidden_layers + self.num_nextn_predict_layers

    def compress_ratio(self, layer_id: int) -> int:
        """The compress ratio of a layer: 0 (SWA-only), 4 or 128. MTP layers are SWA-only.
        ``layer_id`` must be an integer in range (the layer's constructor checks it here)."""
        if isinstance(layer_id, bool) or not hasattr(layer_id, "__index__"):  # an int, np.int64
            raise ConfigError(f"layer_id={layer_id!r} is a {type(layer_id).__name__}: give an "
                              f"int, 0 .. {self.num_layers_with_mtp - 1}")
        if not 0 <= layer_id < self.num_layers_with_mtp:
            raise ConfigError(
                f"layer_id {layer_id} is out of range: the model has {self.num_hidden_layers} "
                f"layers plus {self.num_nextn_predict_layers} MTP layer(s)"
            )
        if layer_id >= self.num_hidden_layers:
            return 0
        return self.compress_ratios[layer_id]

    def layer_of_ratio(self, ratio: int) -> int:
        """The first layer id with the given compress ratio (used by benchmarks, demos and
        tests). The MTP layers (SWA-only) count after the hidden layers: Pro's only ratio-0
        attention is its MTP layer's."""
        for i in range(self.num_layers_with_mtp):
            if self.compress_ratio(i) == ratio:
                return i
        raise ConfigError(f"no layer has compress ratio {ratio} (compress_ratios, MTP layers "
                          "included)")

    # ------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:  # noqa: C901 - a flat list of rules reads best
        """Check every field and their combinations; a :class:`ConfigError` names the first
        field that breaks a rule, and the rule. Runs on construction (and on :meth:`replace`),
        so a config that exists is valid."""

        def need(cond: bool, name: str, rule: str) -> None:
            if not cond:
                raise ConfigError(f"{name}={getattr(self, name)!r}: {rule}")

        for name in (
            "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
            "qk_rope_head_dim", "q_lora_rank", "o_lora_rank", "o_groups", "sliding_window",
            "index_n_heads", "index_head_dim", "index_topk", "max_position_embeddings",
        ):
            value = getattr(self, name)
            need(isinstance(value, int) and not isinstance(value, bool) and value > 0,
                 name, "must be a positive integer")
        need(self.num_nextn_predict_layers >= 0, "num_nextn_predict_layers", "must be >= 0")
        need(self.num_key_value_heads == 1, "num_key_value_heads",
             "DeepSeek-V4 attention is MQA: must be 1")
        need(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", "must be even (RoPE pairs)")
        need(self.qk_rope_head_dim < self.head_dim, "qk_rope_head_dim",
             f"must be smaller than head_dim={self.head_dim}")
        need(self.qk_rope_head_dim <= self.index_head_dim, "qk_rope_head_dim",
             f"must be <= index_head_dim={self.index_head_dim} (the indexer q/k carry RoPE)")
        need(self.nope_head_dim % 64 == 0, "head_dim",
             f"head_dim - qk_rope_head_dim = {self.nope_head_dim} must be a multiple of 64 "
             "(FP8 block-64 simulation of the nope dims)")
        pow2 = (self.index_head_dim & (self.index_head_dim - 1)) == 0
        need(self.index_head_dim % 32 == 0 and pow2, "index_head_dim",
             "must be a power of two and a multiple of 32 (Hadamard rotation, FP4 block-32 "
             "simulation)")
        need(self.num_attention_heads % self.o_groups == 0, "o_groups",
             f"must divide num_attention_heads={self.num_attention_heads}")
        need(self.rms_norm_eps > 0, "rms_norm_eps", "must be > 0")
        need(self.rope_theta > 0, "rope_theta", "must be > 0")
        need(self.compress_rope_theta > 0, "compress_rope_theta", "must be > 0")
        need(self.multi_stream_token_threshold >= 0, "multi_stream_token_threshold", "must be >= 0")
        need(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
             f"must be one of {list(KV_CACHE_DTYPES)}")
        need(self.index_cache_dtype in INDEX_CACHE_DTYPES, "index_cache_dtype",
             f"must be one of {list(INDEX_CACHE_DTYPES)}")
        need(self.index_numerics in ("hadamard_fp4", "fp8"), "index_numerics",
             "must be 'hadamard_fp4' or 'fp8'")
        need(self.attention_backend in ATTENTION_BACKENDS, "attention_backend",
             f"must be one of {list(ATTENTION_BACKENDS)}")
        for name in ("max_step_tokens", "attention_workspace_bytes"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0, name,
                 "must be a positive integer")
        need(len(self.compress_ratios) >= self.num_hidden_layers, "compress_ratios",
             f"needs at least num_hidden_layers={self.num_hidden_layers} entries "
             f"(one per layer, plus one per MTP layer), got {len(self.compress_ratios)}")
        bad = [r for r in self.compress_ratios if r not in (0, 4, 128)]
        need(not bad, "compress_ratios", f"entries must be 0, 4 or 128, got {sorted(set(bad))}")
        if self.rope_scaling is not None:
            y = self.rope_scaling
            if not (y.factor >= 1 and y.original_max_position_embeddings > 0
                    and y.beta_fast > y.beta_slow > 0):
                raise ConfigError(
                    f"rope_scaling={y!r}: needs factor >= 1, original_max_position_embeddings > 0 "
                    "and beta_fast > beta_slow > 0"
                )
        need(isinstance(self.act_quant, bool), "act_quant", "must be True or False")
        if self.act_quant:
            for name in ("hidden_size", "q_lora_rank", "o_lora_rank"):
                need(getattr(self, name) % 128 == 0, name,
                     "must be a multiple of 128 with act_quant (the activations are quantised "
                     "in blocks of 128 along it)")
        if self.fp8_weights:
            bn, bk = self.weight_block_size
            need(self.weight_block_size == (128, 128), "weight_block_size",
                 "only 128x128 fp8 block scales are supported")
            need(self.q_lora_rank % bn == 0, "q_lora_rank",
                 f"must be a multiple of the fp8 block size {bn} so that the fused wq_a|wkv "
                 "block scale is the row-concatenation of the two scales")
            need(self.head_dim % bn == 0, "head_dim",
                 f"must be a multiple of the fp8 block size {bn} (wkv is a shard of "
                 "fused_wqa_wkv)")
            need(self.o_lora_rank % bn == 0, "o_lora_rank",
                 f"must be a multiple of the fp8 block size {bn} (wo_a groups own whole scale "
                 "rows)")

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, d: Mapping[str, Any], **overrides: Any) -> DSV4Config:
        """Build from an HF ``config.json`` dict of DeepSeek-V4, in the official or the
        transformers dialect. Keys of the model around the attention are ignored; a key that
        neither dialect has (a typo such as ``sliding_windw``) is ignored with an
        :class:`UnknownConfigKeyWarning` naming the key it is closest to."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"config must be a mapping, got {type(d).__name__}")
        warn_unknown_keys(d)
        from dsv4.dialects import transformers_config as tf

        if tf.is_transformers_config(d):
            d = tf.official_from_transformers(d)
        required = (
            "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
            "qk_rope_head_dim", "q_lora_rank", "o_lora_rank", "o_groups", "sliding_window",
            "compress_ratios", "index_n_heads", "index_head_dim", "index_topk",
        )
        missing = [k for k in required if k not in d]
        if missing:
            raise ConfigError(f"config is missing required key(s) {missing} (DeepSeek-V4 HF names)")
        kw: dict[str, Any] = {k: d[k] for k in required}
        kw["compress_ratios"] = tuple(int(r) for r in d["compress_ratios"])
        for k in ("num_nextn_predict_layers", "num_key_value_heads", "rms_norm_eps", "rope_theta",
                  "compress_rope_theta", "max_position_embeddings", "vocab_size"):
            if k in d and d[k] is not None:
                kw[k] = d[k]
        kw["rope_scaling"] = _parse_rope_scaling(d.get("rope_scaling"))
        kw.update(_parse_quantization(d.get("quantization_config")))
        for k in RUNTIME_OPTIONS:
            if k in d:
                kw[k] = d[k]
        kw.update(overrides)
        n_needed = int(kw["num_hidden_layers"]) + int(kw.get("num_nextn_predict_layers", 1))
        if len(kw["compress_ratios"]) < n_needed:
            raise ConfigError(
                f"compress_ratios has {len(kw['compress_ratios'])} entries; needs at least "
                f"num_hidden_layers + num_nextn_predict_layers = {n_needed}"
            )
        return cls(**kw)

    @classmethod
    def from_pretrained(cls, path: str | Path, **overrides: Any) -> DSV4Config:
        """Read a ``config.json`` file, or the ``config.json`` inside a checkpoint folder."""
        return cls.from_dict(read_config_json(path), **overrides)

    def to_dict(self, dialect: str = "official") -> dict[str, Any]:
        """HF-style dict in the ``official`` or ``transformers`` dialect;
        ``from_dict(to_dict(dialect))`` round-trips."""
        if dialect not in ("official", "transformers"):
            raise ConfigError(f"dialect={dialect!r}: expected 'official' or 'transformers'")
        d: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name in ("rope_scaling", "fp8_weights", "weight_block_size",
                          "check_finite_inputs", "attention_backend", "act_quant"):
                continue
            v = getattr(self, f.name)
            d[f.name] = list(v) if isinstance(v, tuple) else v
        if self.rope_scaling is not None:
            y = self.rope_scaling
            d["rope_scaling"] = {
                "type": "yarn", "factor": y.factor,
                "original_max_position_embeddings": y.original_max_position_embeddings,
                "beta_fast": y.beta_fast, "beta_slow": y.beta_slow,
            }
        if self.fp8_weights:
            d["quantization_config"] = {
                "quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                "weight_block_size": list(self.weight_block_size), "activation_scheme": "dynamic",
            }
        if dialect == "transformers":
            from dsv4.dialects.transformers_config import transformers_from_official

            return transformers_from_official(d)
        return d

    def replace(self, **changes: Any) -> DSV4Config:
        """A copy with ``changes`` (field names, e.g. ``simulate_quant=False``), validated
        again: the config is frozen, so this is how a variant is made."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def preset(cls, name: str) -> DSV4Config:
        """``flash``, ``pro`` or ``tiny`` (small dims, all three layer types, window 16)."""
        if name not in _PRESETS:
            raise ConfigError(f"unknown preset {name!r}; valid presets: {sorted(_PRESETS)}")
        return cls.from_dict(_PRESETS[name])


def read_config_json(path: str | Path) -> dict[str, Any]:
    """The JSON object in a ``config.json`` file (or a folder holding one), with clear errors."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ConfigError(f"no config.json at {p}")
    try:
        d = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p} is not valid JSON: {e}") from e
    if not isinstance(d, dict):
        raise ConfigError(f"{p} must hold a JSON object")
    return d


def _parse_rope_scaling(rs: Any) -> YarnScaling | None:
    if rs is None:
        return None
    if not isinstance(rs, Mapping):
        raise ConfigError(f"rope_scaling={rs!r}: must be a mapping or null")
    kind = rs.get("type", rs.get("rope_type", "yarn"))
    if kind != "yarn":
        raise ConfigError(f"rope_scaling.type={kind!r}: DeepSeek-V4 uses 'yarn'")
    orig = rs.get("original_max_position_embeddings", rs.get("original_seq_len"))
    if orig is None:
        # The official loader silently disables YaRN without this key; we refuse instead.
        raise ConfigError("rope_scaling.original_max_position_embeddings is missing "
                          "(without it YaRN would be silently disabled)")
    return YarnScaling(
        factor=float(rs.get("factor", 16.0)),
        original_max_position_embeddings=int(orig),
        beta_fast=float(rs.get("beta_fast", 32.0)),
        beta_slow=float(rs.get("beta_slow", 1.0)),
    )


def _parse_quantization(q: Any) -> dict[str, Any]:
    if q is None:
        return {"fp8_weights": False}
    if not isinstance(q, Mapping):
        raise ConfigError(f"quantization_config={q!r}: must be a mapping or null")
    method = q.get("quant_method", "fp8")
    if method != "fp8":
        raise ConfigError(f"quantization_config.quant_method={method!r}: only 'fp8' is supported")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"quantization_config.fmt={fmt!r}: only 'e4m3' is supported")
    scale_fmt = q.get("scale_fmt", "ue8m0")
    if scale_fmt != "ue8m0":
        raise ConfigError(f"quantization_config.scale_fmt={scale_fmt!r}: only 'ue8m0' is supported")
    block = tuple(int(b) for b in q.get("weight_block_size", (128, 128)))
    if len(block) != 2:
        raise ConfigError(f"quantization_config.weight_block_size={block}: needs two entries")
    return {"fp8_weights": True, "weight_block_size": block}


_FLASH: dict[str, Any] = {
    "hidden_size": 4096, "num_hidden_layers": 43, "num_nextn_predict_layers": 1,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
    "q_lora_rank": 1024, "o_lora_rank": 1024, "o_groups": 8, "sliding_window": 128,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1048576, "vocab_size": 129280,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                            "weight_block_size": [128, 128], "activation_scheme": "dynamic"},
}
_PRO: dict[str, Any] = {
    **_FLASH, "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
    "q_lora_rank": 1536, "o_groups": 16, "index_topk": 1024,
    "compress_ratios": [128, 128] + [4, 128] * 29 + [4, 0],
}
# Small enough for a 2-core CPU, but keeps every layer type: a window of 16, top-k 8 out of the
# ratio-4 entries and ratio-128 entries once a sequence passes 128 tokens.
_TINY: dict[str, Any] = {
    **_FLASH, "hidden_size": 256, "num_hidden_layers": 3, "num_attention_heads": 4,
    "head_dim": 128, "q_lora_rank": 128, "o_lora_rank": 128, "o_groups": 2,
    "sliding_window": 16, "compress_ratios": [0, 4, 128, 0], "index_n_heads": 8,
    "index_head_dim": 128, "index_topk": 8, "max_position_embeddings": 4096, "vocab_size": 128,
}
_PRESETS = {"flash": _FLASH, "pro": _PRO, "tiny": _TINY}
PRESET_NAMES = tuple(_PRESETS)
"""The names :meth:`DSV4Config.preset` takes."""


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def yarn_ramp_bounds(dim: int, base: float, y: YarnScaling) -> tuple[float, float]:
    """(low, high) of the YaRN ramp over the rotary pair index (docs/spec.md §4)."""

    def corr(rot: float) -> float:
        return dim * math.log(y.original_max_position_embeddings / (rot * 2 * math.pi)) / (
            2 * math.log(base))

    low = max(0.0, math.floor(corr(y.beta_fast)))
    high = min(dim - 1.0, math.ceil(corr(y.beta_slow)))
    if low == high:
        high += 0.001
    return low, high
