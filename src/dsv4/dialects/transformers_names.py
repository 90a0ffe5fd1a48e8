"""Attention tensor names in Hugging Face transformers' DeepSeek-V4 checkpoints.

Three spellings of the same tensors exist (checked against transformers 5.25
``modeling_deepseek_v4.py`` and ``conversion_mapping.py``):

* ``official``: ``layers.{i}.attn.wq_a.weight``, ``.scale`` block scales, ``mtp.{j}.attn.*``;
* ``transformers``: the module names of ``DeepseekV4ForCausalLM``,
  ``model.layers.{i}.self_attn.q_a_proj.weight``, fp8 block scales as ``weight_scale_inv``
  (MTP layers, which transformers does not build, as ``mtp.{j}.self_attn.*``);
* ``transformers_saved``: what ``save_pretrained`` writes after undoing its load-time renames:
  ``model.layers.{i}.attn.`` + the official name, except that the attention's own ``kv_norm``
  comes out as ``attn.norm`` (the reverse of its ``.norm.`` -> ``.kv_norm.`` rename).

A folder must use one spelling; a mix is an error naming an example of each.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import TypeVar

import torch

T = TypeVar("T")

DIALECTS = ("official", "transformers")

# official module path (relative to the layer) -> transformers module path (relative to self_attn)
_MODULES = {
    "wq_a": "q_a_proj", "wkv": "kv_proj", "q_norm": "q_a_norm", "kv_norm": "kv_norm",
    "wq_b": "q_b_proj", "wo_a": "o_a_proj", "wo_b": "o_b_proj",
    "compressor.wkv": "compressor.kv_proj", "compressor.wgate": "compressor.gate_proj",
    "compressor.norm": "compressor.kv_norm",
    "indexer.compressor.wkv": "compressor.indexer.kv_proj",
    "indexer.compressor.wgate": "compressor.indexer.gate_proj",
    "indexer.compressor.norm": "compressor.indexer.kv_norm",
    "indexer.wq_b": "compressor.indexer.q_b_proj",
    "indexer.weights_proj": "compressor.indexer.scorer.weights_proj",
}
# official parameter (relative to the layer) -> transformers parameter
_LEAVES = {"attn_sink": "sinks", "compressor.ape": "compressor.position_bias",
           "indexer.compressor.ape": "compressor.indexer.position_bias"}
_SUFFIX = {"weight": "weight", "scale": "weight_scale_inv"}

_OFFICIAL = re.compile(r"^(layers\.\d+|mtp\.\d+)\.attn\.(.+)$")
_TRANSFORMERS = re.compile(r"^(model\.layers\.\d+|mtp\.\d+)\.self_attn\.(.+)$")
_SAVED = re.compile(r"^model\.(layers\.\d+)\.attn\.(.+)$")


class NameDialectError(ValueError):
    """A tensor name cannot be translated, or a folder mixes spellings."""


def official_to_transformers_rel(rel: str) -> str:
    """``wq_a.weight`` -> ``q_a_proj.weight`` (names relative to the attention layer)."""
    if rel in _LEAVES:
        return _LEAVES[rel]
    module, _, leaf = rel.rpartition(".")
    if module not in _MODULES or leaf not in _SUFFIX:
        raise NameDialectError(f"no transformers name for the attention tensor {rel!r}")
    return f"{_MODULES[module]}.{_SUFFIX[leaf]}"


_REV_MODULES = {v: k for k, v in _MODULES.items()}
_REV_LEAVES = {v: k for k, v in _LEAVES.items()}
_REV_SUFFIX = {v: k for k, v in _SUFFIX.items()}


def transformers_to_official_rel(rel: str) -> str:
    """``q_a_proj.weight`` -> ``wq_a.weight`` (inverse of :func:`official_to_transformers_rel`)."""
    if rel in _REV_LEAVES:
        return _REV_LEAVES[rel]
    for suffix, official in _REV_SUFFIX.items():
        module = rel[: -len(suffix) - 1] if rel.endswith("." + suffix) else None
        if module in _REV_MODULES:
            return f"{_REV_MODULES[module]}.{official}"
    raise NameDialectError(f"unknown transformers attention tensor {rel!r} (known modules: "
                           f"{sorted(_REV_MODULES)}, parameters: {sorted(_REV_LEAVES)})")


def _saved_to_official_rel(rel: str) -> str:
    return "kv_norm.weight" if rel == "norm.weight" else rel


def classify(name: str) -> str | None:
    """The spelling of one full tensor name, or None if it is not an attention tensor."""
    if _OFFICIAL.match(name):
        return "official"
    if _TRANSFORMERS.match(name):
        return "transformers"
    if _SAVED.match(name):
        return "transformers_saved"
    return None


def detect(names: Iterable[str]) -> str | None:
    """The one spelling of the attention tensors among ``names`` (None if there are none)."""
    seen: dict[str, str] = {}
    for name in names:
        kind = classify(name)
        if kind is not None:
            seen.setdefault(kind, name)
    if len(seen) > 1:
        examples = ", ".join(f"{k} ({v!r})" for k, v in sorted(seen.items()))
        raise NameDialectError(f"the checkpoint mixes attention tensor spellings: {examples}")
    return next(iter(seen), None)


def to_official(name: str) -> str:
    """The official full name of an attention tensor in any spelling."""
    if m := _OFFICIAL.match(name):
        return name
    if m := _TRANSFORMERS.match(name):
        prefix = m.group(1).removeprefix("model.")
        return f"{prefix}.attn.{transformers_to_official_rel(m.group(2))}"
    if m := _SAVED.match(name):
        return f"{m.group(1)}.attn.{_saved_to_official_rel(m.group(2))}"
    raise NameDialectError(f"{name!r} is not an attention tensor name")


def official_view(names: Iterable[str]) -> dict[str, str]:
    """official full name -> stored name, for every attention tensor among ``names`` (which must
    use one spelling; other tensors, e.g. MoE weights, are left out)."""
    names = list(names)
    detect(names)
    view: dict[str, str] = {}
    for name in names:
        if classify(name) is None:
            continue
        official = to_official(name)
        if official in view:
            raise NameDialectError(f"{name!r} and {view[official]!r} are the same tensor "
                                   f"{official!r}")
        view[official] = name
    return view


def from_official(tensors: Mapping[str, T], dialect: str) -> dict[str, T]:
    """Rename official full names (``layers.{i}.attn.*``, ``mtp.{j}.attn.*``) into ``dialect``."""
    if dialect not in DIALECTS:
        raise NameDialectError(f"dialect={dialect!r}: expected one of {list(DIALECTS)}")
    if dialect == "official":
        return dict(tensors)
    out: dict[str, T] = {}
    for name, t in tensors.items():
        m = _OFFICIAL.match(name)
        if m is None:
            raise NameDialectError(f"{name!r} is not an official attention tensor name")
        prefix = m.group(1)
        prefix = "model." + prefix if prefix.startswith("layers.") else prefix
        out[f"{prefix}.self_attn.{official_to_transformers_rel(m.group(2))}"] = t
    return out


def as_checkpoint_dtype(rel: str, t: torch.Tensor) -> torch.Tensor:
    """A transformers-saved tensor in the official checkpoint dtype where that is exact.

    transformers keeps RMSNorm weights in float32 (``_keep_in_fp32_modules_strict``) where the
    official checkpoint stores bf16: a float32 norm weight whose values are exactly bf16 is
    returned as bf16. A model cast wholesale with ``.to(bfloat16)`` stores ``sinks`` and
    ``position_bias`` (official float32) in bf16: they are widened, exactly. Anything else is
    returned unchanged (and the loader names it if its dtype does not fit)."""
    if rel.endswith("norm.weight") and t.dtype == torch.float32:
        b = t.to(torch.bfloat16)
        if torch.equal(b.to(torch.float32), t):
            return b
    if (rel == "attn_sink" or rel.endswith(".ape")) and t.dtype == torch.bfloat16:
        return t.to(torch.float32)
    return t
