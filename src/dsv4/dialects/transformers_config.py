"""The Hugging Face transformers dialect of the DeepSeek-V4 ``config.json``.

transformers' ``DeepseekV4Config`` (5.x) writes the attention schedule and RoPE differently from the
official HF config that :meth:`dsv4.DSV4Config.from_dict` reads:

=============================  ==========================================================
official key                   transformers key
=============================  ==========================================================
``compress_ratios`` (ints,     ``layer_types`` (``sliding_attention`` /
one per layer + MTP)           ``compressed_sparse_attention`` / ``heavily_compressed_
                               attention``, backbone layers only) + ``compress_rates``
``qk_rope_head_dim``           ``partial_rotary_factor`` (= qk_rope_head_dim / head_dim)
``rope_theta``,                ``rope_parameters = {"main": {...}, "compress": {...}}``
``compress_rope_theta``,       (``main``: SWA-only layers, no YaRN; ``compress``: the
``rope_scaling`` (YaRN)        compressed layers, YaRN with ``attention_factor`` 1.0)
=============================  ==========================================================

:func:`official_from_transformers` turns a transformers-dialect dict into an official one,
refusing (``ConfigError`` naming the key) anything that would change the math and that dsv4 does
not model, and any two keys that disagree. :func:`transformers_from_official` goes the other way.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from dsv4.config_error import ConfigError

LAYER_TYPE_OF_RATIO = {0: "sliding_attention", 4: "compressed_sparse_attention",
                       128: "heavily_compressed_attention"}
RATIO_OF_LAYER_TYPE = {v: k for k, v in LAYER_TYPE_OF_RATIO.items()}
_DEFAULT_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}

# Keys only the transformers dialect writes; any one of them marks a dict as that dialect.
_MARKERS = ("layer_types", "compress_rates", "rope_parameters", "partial_rotary_factor",
            "compress_rate_csa", "compress_rate_hca")
# Keys of one rope_parameters entry that dsv4 understands; any other changes the angles.
_ROPE_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor", "factor",
              "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor",
              "truncate"}
# Model keys of the official dialect that carry over unchanged.
_PASSTHROUGH = ("hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                "q_lora_rank", "o_lora_rank", "o_groups", "sliding_window", "index_n_heads",
                "index_head_dim", "index_topk", "num_nextn_predict_layers", "num_key_value_heads",
                "rms_norm_eps", "max_position_embeddings", "vocab_size", "quantization_config",
                "simulate_quant", "multi_stream_token_threshold")


TRANSFORMERS_KEYS = frozenset({
    *_MARKERS, *_PASSTHROUGH, "model_type", "architectures", "rope_theta", "compress_rope_theta",
    "qk_rope_head_dim", "rope_scaling", "attention_bias", "attention_dropout",
    # the rest of transformers' DeepseekV4Config (5.x): the model around the attention
    "hc_mult", "hc_sinkhorn_iters", "hc_eps", "mlp_layer_types", "moe_intermediate_size",
    "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "norm_topk_prob",
    "routed_scaling_factor", "scoring_func", "swiglu_limit", "router_aux_loss_coef",
    "router_jitter_noise", "output_router_logits", "mlp_bias", "hidden_act",
    "initializer_range", "use_cache", "tie_word_embeddings", "bos_token_id", "eos_token_id",
    "pad_token_id",
    # PretrainedConfig's own (4.x and 5.x), written by to_dict / save_pretrained
    "_name_or_path", "_attn_implementation", "_commit_hash", "transformers_version", "dtype",
    "torch_dtype", "auto_map", "id2label", "label2id", "num_labels", "problem_type",
    "return_dict", "output_attentions", "output_hidden_states", "chunk_size_feed_forward",
    "is_encoder_decoder", "is_decoder", "add_cross_attention", "cross_attention_hidden_size",
    "tie_encoder_decoder", "finetuning_task", "tokenizer_class", "prefix", "sep_token_id",
    "decoder_start_token_id", "task_specific_params", "pruned_heads", "torchscript",
    "use_bfloat16", "tf_legacy_loss", "output_scores", "return_dict_in_generate",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens", "base_model_tp_plan", "base_model_pp_plan",
})
"""Every top-level key a transformers DeepSeek-V4 ``config.json`` may carry; most describe the
model around the attention and are ignored, none is reported as unknown."""


def is_transformers_config(d: Mapping[str, Any]) -> bool:
    """Whether ``d`` is written in the transformers dialect (it has one of its own keys)."""
    return any(k in d for k in _MARKERS)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=0.0)
    return bool(a == b)


def _agree(name_a: str, a: Any, name_b: str, b: Any) -> None:
    if a is not None and b is not None and not _same(a, b):
        raise ConfigError(f"{name_a}={a!r} contradicts {name_b}={b!r}")


def _rates(d: Mapping[str, Any]) -> dict[str, int]:
    rates = dict(_DEFAULT_RATES)
    given = d.get("compress_rates")
    if given is not None:
        if not isinstance(given, Mapping):
            raise ConfigError(f"compress_rates={given!r}: must be a mapping of layer type to rate")
        unknown = sorted(set(given) - set(rates))
        if unknown:
            raise ConfigError(f"compress_rates has unknown layer type(s) {unknown}; known: "
                              f"{sorted(rates)}")
        rates.update({k: int(v) for k, v in given.items()})
    for legacy, kind in (("compress_rate_csa", "compressed_sparse_attention"),
                         ("compress_rate_hca", "heavily_compressed_attention")):
        if d.get(legacy) is not None:
            _agree(legacy, int(d[legacy]), f"compress_rates[{kind!r}]",
                   None if given is None else given.get(kind))
            rates[kind] = int(d[legacy])
    for kind, want in _DEFAULT_RATES.items():
        if rates[kind] != want:
            raise ConfigError(f"compress_rates[{kind!r}]={rates[kind]}: DeepSeek-V4 attention "
                              f"(and dsv4) uses {want}")
    return rates


def _compress_ratios(d: Mapping[str, Any], n_layers: int, n_mtp: int) -> list[int]:
    types = d.get("layer_types")
    legacy = d.get("compress_ratios")
    if types is None and legacy is None:
        raise ConfigError("config is missing layer_types (transformers) or compress_ratios "
                          "(official); refusing to guess the attention schedule")
    ratios: list[int] | None = None
    if types is not None:
        if not isinstance(types, (list, tuple)) or len(types) != n_layers:
            raise ConfigError(f"layer_types must list one type per layer "
                              f"(num_hidden_layers={n_layers}), got {types!r}")
        bad = sorted({t for t in types if t not in RATIO_OF_LAYER_TYPE})
        if bad:
            raise ConfigError(f"layer_types has unknown type(s) {bad}; known: "
                              f"{sorted(RATIO_OF_LAYER_TYPE)}")
        ratios = [RATIO_OF_LAYER_TYPE[t] for t in types]
    if legacy is not None:
        legacy_list = [int(r) for r in legacy]
        if ratios is not None and legacy_list[:n_layers] != ratios:
            raise ConfigError(f"compress_ratios={legacy_list} contradicts layer_types={types}")
        if ratios is None:
            return legacy_list
        return ratios + legacy_list[n_layers:] if len(legacy_list) > n_layers else (
            ratios + [0] * n_mtp)
    assert ratios is not None
    # transformers does not build MTP layers; their attention is SWA-only (ratio 0).
    return ratios + [0] * n_mtp


def _rope_dim(d: Mapping[str, Any]) -> int:
    head_dim = d.get("head_dim")
    if head_dim is None:
        raise ConfigError("config is missing required key head_dim")
    prf = d.get("partial_rotary_factor")
    explicit = d.get("qk_rope_head_dim")
    dims: list[tuple[str, float]] = []
    if prf is not None:
        dims.append(("partial_rotary_factor", float(prf) * head_dim))
    rp = d.get("rope_parameters")
    if isinstance(rp, Mapping):
        for label in ("main", "compress"):
            sub = rp.get(label)
            if isinstance(sub, Mapping) and sub.get("partial_rotary_factor") is not None:
                dims.append((f"rope_parameters.{label}.partial_rotary_factor",
                             float(sub["partial_rotary_factor"]) * head_dim))
    if explicit is not None:
        dims.append(("qk_rope_head_dim", float(explicit)))
    if not dims:
        raise ConfigError("config is missing partial_rotary_factor (or qk_rope_head_dim): the "
                          "rotary width is not known")
    name0, dim0 = dims[0]
    for name, dim in dims[1:]:
        if not math.isclose(dim, dim0, abs_tol=1e-9):
            raise ConfigError(f"{name} gives a rotary width of {dim:g} dims but {name0} gives "
                              f"{dim0:g}")
    if abs(dim0 - round(dim0)) > 1e-9:
        raise ConfigError(f"{name0} gives a rotary width of {dim0:g} dims (head_dim={head_dim}): "
                          "not a whole number")
    return int(round(dim0))


def _rope_entry(rp: Mapping[str, Any], label: str) -> dict[str, Any] | None:
    sub = rp.get(label)
    if sub is None:
        return None
    if not isinstance(sub, Mapping):
        raise ConfigError(f"rope_parameters.{label}={sub!r}: must be a mapping")
    unknown = sorted(set(sub) - _ROPE_KEYS)
    if unknown:
        raise ConfigError(f"rope_parameters.{label} has key(s) {unknown} that dsv4 does not "
                          "model (they would change the rotary angles)")
    return dict(sub)


def _rope(d: Mapping[str, Any]) -> dict[str, Any]:
    """rope_theta, compress_rope_theta and rope_scaling (official form) of a transformers dict."""
    out: dict[str, Any] = {}
    rp = d.get("rope_parameters")
    main: dict[str, Any] | None = None
    comp: dict[str, Any] | None = None
    if rp is not None:
        if not isinstance(rp, Mapping):
            raise ConfigError(f"rope_parameters={rp!r}: must be a mapping")
        if isinstance(rp.get("main"), Mapping) or isinstance(rp.get("compress"), Mapping):
            extra = sorted(set(rp) - {"main", "compress"})
            if extra:
                raise ConfigError(f"rope_parameters has key(s) {extra} beside main / compress")
            main, comp = _rope_entry(rp, "main"), _rope_entry(rp, "compress")
        else:  # the flat form: it describes the compressed layers' rope (transformers nests it)
            comp = _rope_entry({"compress": rp}, "compress")
    if d.get("rope_scaling") is not None:
        if comp is not None and comp.get("rope_type", comp.get("type")) not in (None, "default"):
            raise ConfigError("both rope_scaling and rope_parameters describe the compressed "
                              "layers' YaRN; give one")
        out["rope_scaling"] = d["rope_scaling"]
    # main: the SWA-only layers, plain RoPE
    if main is not None:
        kind = main.get("rope_type", main.get("type", "default"))
        if kind != "default":
            raise ConfigError(f"rope_parameters.main.rope_type={kind!r}: DeepSeek-V4's SWA-only "
                              "layers use plain RoPE (YaRN applies to compressed layers only)")
        _agree("rope_parameters.main.rope_theta", main.get("rope_theta"), "rope_theta",
               d.get("rope_theta"))
    theta = d.get("rope_theta", None if main is None else main.get("rope_theta"))
    if theta is not None:
        out["rope_theta"] = theta
    # compress: the compressed layers, YaRN (or plain when rope_type is default)
    ctheta = d.get("compress_rope_theta")
    if comp is not None:
        _agree("rope_parameters.compress.rope_theta", comp.get("rope_theta"),
               "compress_rope_theta", ctheta)
        if ctheta is None:
            ctheta = comp.get("rope_theta")
        kind = comp.get("rope_type", comp.get("type", "default"))
        if kind == "yarn":
            af = comp.get("attention_factor", 1.0)
            if af is None or not _same(af, 1.0):
                raise ConfigError(f"rope_parameters.compress.attention_factor={af!r}: "
                                  "DeepSeek-V4 does not scale cos/sin (must be 1.0)")
            if comp.get("truncate", True) is not True:
                raise ConfigError("rope_parameters.compress.truncate=False: dsv4's YaRN ramp "
                                  "rounds its bounds (truncate=True)")
            if comp.get("factor") is None:
                raise ConfigError("rope_parameters.compress.factor is missing (transformers would "
                                  "derive it from max_position_embeddings; give it explicitly)")
            out["rope_scaling"] = {k: comp[k] for k in (
                "factor", "original_max_position_embeddings", "beta_fast", "beta_slow")
                if comp.get(k) is not None}
            out["rope_scaling"]["type"] = "yarn"
        elif kind == "default":
            if "rope_scaling" not in out:
                out["rope_scaling"] = None
        else:
            raise ConfigError(f"rope_parameters.compress.rope_type={kind!r}: DeepSeek-V4 uses "
                              "'yarn' (or 'default' for no scaling)")
    if ctheta is not None:
        out["compress_rope_theta"] = ctheta
    return out


def official_from_transformers(d: Mapping[str, Any]) -> dict[str, Any]:
    """An official-dialect dict with the same math as the transformers-dialect ``d``."""
    if d.get("model_type", "deepseek_v4") != "deepseek_v4":
        raise ConfigError(f"model_type={d['model_type']!r}: expected 'deepseek_v4'")
    if d.get("attention_bias"):
        raise ConfigError("attention_bias=True: DeepSeek-V4 attention has no biases")
    for key in ("hidden_size", "num_hidden_layers", "head_dim"):
        if key not in d:
            raise ConfigError(f"config is missing required key {key!r}")
    n_layers = int(d["num_hidden_layers"])
    n_mtp = int(d.get("num_nextn_predict_layers", 1) or 0)
    _rates(d)
    out: dict[str, Any] = {k: d[k] for k in _PASSTHROUGH if k in d}
    out["compress_ratios"] = _compress_ratios(d, n_layers, n_mtp)
    out["qk_rope_head_dim"] = _rope_dim(d)
    out.update(_rope(d))
    return out


def transformers_from_official(d: Mapping[str, Any]) -> dict[str, Any]:
    """The transformers-dialect dict of an official-dialect dict (as ``DSV4Config.to_dict``
    writes it); ``official_from_transformers`` maps it back to the same config."""
    n_layers = int(d["num_hidden_layers"])
    ratios = [int(r) for r in d["compress_ratios"]]
    if any(r != 0 for r in ratios[n_layers:]):
        raise ConfigError(f"compress_ratios={ratios}: transformers' layer_types cannot describe a "
                          "compressed MTP layer")
    out: dict[str, Any] = {"model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"]}
    out.update({k: d[k] for k in _PASSTHROUGH if k in d})
    out["layer_types"] = [LAYER_TYPE_OF_RATIO[r] for r in ratios[:n_layers]]
    out["compress_rates"] = dict(_DEFAULT_RATES)
    prf = int(d["qk_rope_head_dim"]) / int(d["head_dim"])
    out["partial_rotary_factor"] = prf
    out["rope_theta"] = d["rope_theta"]
    out["compress_rope_theta"] = d["compress_rope_theta"]
    main = {"rope_type": "default", "rope_theta": d["rope_theta"], "partial_rotary_factor": prf}
    comp: dict[str, Any] = {"rope_type": "default", "rope_theta": d["compress_rope_theta"],
                            "partial_rotary_factor": prf}
    rs = d.get("rope_scaling")
    if rs is not None:
        comp.update({k: rs[k] for k in ("factor", "original_max_position_embeddings",
                                        "beta_fast", "beta_slow")})
        comp["rope_type"] = "yarn"
        comp["attention_factor"] = 1.0
    out["rope_parameters"] = {"main": main, "compress": comp}
    return out
