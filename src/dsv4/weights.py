"""Official checkpoint names of one attention layer and strict, atomic loading into it.

Official names (docs/spec.md §3.1; §3.3 for vLLM's fused names) map onto the module's fused
parameters: ``wq_a`` and ``wkv`` are the two row shards of ``fused_wqa_wkv``; ``compressor.wkv``
and ``compressor.wgate`` the two shards of ``compressor.fused_wkv_wgate`` (likewise for the
indexer's compressor).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from dsv4.layers.compressor import Compressor
from dsv4.layers.linear import Linear, MergedLinear
from dsv4.layers.weight_layout import get_layout

if TYPE_CHECKING:
    from dsv4.attention import DeepseekV4Attention


class WeightLoadError(ValueError):
    """A checkpoint tensor is missing, unexpected, mis-shaped, mis-typed or not finite."""


@dataclass(frozen=True)
class WeightSpec:
    name: str
    """Official name relative to the layer, e.g. ``wq_a.weight``."""
    param: nn.Parameter
    param_name: str
    """state_dict key of the parameter this tensor lands in."""
    rows: slice | None
    """Row range inside ``param`` (shards of merged linears), or None for the whole tensor."""
    shape: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]
    """Accepted dtypes: the checkpoint's, plus the parameter's own (float64 layers)."""


def _linear_specs(prefix: str, official: list[str], lin: Linear, state_prefix: str
                  ) -> list[WeightSpec]:
    specs = []
    for i, name in enumerate(official):
        if isinstance(lin, MergedLinear):
            rows, srows = lin.shard_rows(i), lin.shard_scale_rows(i)
        else:
            rows = slice(0, lin.out_features)
            srows = slice(0, 0 if lin.scale is None else lin.scale.shape[0])
        shape = (rows.stop - rows.start, lin.in_features)
        whole = None if not isinstance(lin, MergedLinear) else rows
        if lin.is_fp8:
            assert lin.scale is not None
            specs.append(WeightSpec(f"{prefix}{name}.weight", lin.weight, f"{state_prefix}weight",
                                    whole, shape, (torch.float8_e4m3fn,)))
            sshape = (srows.stop - srows.start, lin.scale.shape[1])
            specs.append(WeightSpec(f"{prefix}{name}.scale", lin.scale, f"{state_prefix}scale",
                                    None if whole is None else srows, sshape,
                                    (torch.float8_e8m0fnu,)))
        else:
            specs.append(WeightSpec(f"{prefix}{name}.weight", lin.weight, f"{state_prefix}weight",
                                    whole, shape, _float_dtypes(torch.bfloat16, lin.weight)))
    return specs


def _float_dtypes(ckpt: torch.dtype, p: torch.Tensor) -> tuple[torch.dtype, ...]:
    return (ckpt,) if p.dtype == ckpt else (ckpt, p.dtype)


def _whole(name: str, p: nn.Parameter, key: str, ckpt: torch.dtype) -> WeightSpec:
    return WeightSpec(name, p, key, None, tuple(p.shape), _float_dtypes(ckpt, p))


def official_weight_specs(layer: DeepseekV4Attention) -> list[WeightSpec]:
    """Every tensor the layer loads, in checkpoint order."""
    bf16, f32 = torch.bfloat16, torch.float32
    specs = _linear_specs("", ["wq_a", "wkv"], layer.fused_wqa_wkv, "fused_wqa_wkv.")
    specs += [_whole("q_norm.weight", layer.q_norm.weight, "q_norm.weight", bf16),
              _whole("kv_norm.weight", layer.kv_norm.weight, "kv_norm.weight", bf16)]
    specs += _linear_specs("", ["wq_b"], layer.wq_b, "wq_b.")
    specs += _linear_specs("", ["wo_a"], layer.wo_a, "wo_a.")
    specs += _linear_specs("", ["wo_b"], layer.wo_b, "wo_b.")
    specs.append(_whole("attn_sink", layer.attn_sink, "attn_sink", f32))
    compressors: list[tuple[str, Compressor]] = []
    if layer.compressor is not None:
        compressors.append(("compressor.", layer.compressor))
    if layer.indexer is not None:
        compressors.append(("indexer.compressor.", layer.indexer.compressor))
    for prefix, comp in compressors:
        specs += _linear_specs(prefix, ["wkv", "wgate"], comp.fused_wkv_wgate,
                               f"{prefix}fused_wkv_wgate.")
        specs += [_whole(f"{prefix}ape", comp.ape, f"{prefix}ape", f32),
                  _whole(f"{prefix}norm.weight", comp.norm.weight, f"{prefix}norm.weight", bf16)]
    if layer.indexer is not None:
        specs += _linear_specs("indexer.", ["wq_b"], layer.indexer.wq_b, "indexer.wq_b.")
        specs += _linear_specs("indexer.", ["weights_proj"], layer.indexer.weights_proj,
                               "indexer.weights_proj.")
    return specs


def _nonfinite(t: torch.Tensor) -> bool:
    if t.dtype == torch.float8_e8m0fnu:
        return bool((t.view(torch.uint8) == 255).any())
    return not bool(torch.isfinite(t.to(torch.float32) if t.element_size() < 2 else t).all())


def validate_layer_weights(layer: DeepseekV4Attention,
                           weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
                           ) -> list[tuple[WeightSpec, torch.Tensor]]:
    """Check every tensor against the layer's specs; returns (spec, tensor) pairs to assign."""
    specs = {s.name: s for s in official_weight_specs(layer)}
    where = f"layer {layer.layer_id} (compress_ratio {layer.compress_ratio})"
    expected = ("a mapping of name -> tensor (e.g. a state dict) or an iterable of (name, tensor) "
                "pairs")
    if isinstance(weights, Mapping):
        weights = weights.items()
    elif isinstance(weights, (str, bytes, torch.Tensor)) or not isinstance(weights, Iterable):
        raise WeightLoadError(f"{where}: weights must be {expected}, got "
                              f"{type(weights).__name__}")
    given: dict[str, torch.Tensor] = {}
    for item in weights:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)):
            shown = type(item).__name__ if not isinstance(item, str) else f"the string {item!r}"
            raise WeightLoadError(f"{where}: weights must be {expected}; got an element that is "
                                  f"{shown}, not a (name, tensor) pair")
        name, tensor = item
        if name in given:
            raise WeightLoadError(f"{where}: tensor {name!r} was given twice")
        if name not in specs:
            hint = " (V4 has no indexer.k_norm)" if "k_norm" in name else ""
            raise WeightLoadError(f"{where}: unexpected tensor {name!r}{hint}; expected names: "
                                  f"{sorted(specs)}")
        if not isinstance(tensor, torch.Tensor):
            raise WeightLoadError(f"{where}: {name!r} is a {type(tensor).__name__}, not a tensor")
        given[name] = tensor
    missing = [n for n in specs if n not in given]
    if missing:
        raise WeightLoadError(f"{where}: missing tensor(s) {missing}")
    out = []
    tp = layer.tp
    for name, spec in specs.items():
        t = given[name]
        full = spec.shape if tp is None else tp.full_shape(name, spec.shape)
        if tp is not None and full != spec.shape and tuple(t.shape) == full:
            t = tp.take(name, t)  # the official (unsplit) tensor: this rank's part
        if tuple(t.shape) != spec.shape:
            also = "" if full == spec.shape else f" (this rank's part; or the whole {full})"
            raise WeightLoadError(f"{where}: {name!r} has shape {tuple(t.shape)}, expected "
                                  f"{spec.shape}{also}")
        if t.dtype not in spec.dtypes:
            raise WeightLoadError(f"{where}: {name!r} has dtype {t.dtype}, expected one of "
                                  f"{list(spec.dtypes)}")
        if _nonfinite(t):
            raise WeightLoadError(f"{where}: {name!r} contains NaN or Inf")
        out.append((spec, t))
    return out


@torch.no_grad()
def assign_layer_weights(pairs: list[tuple[WeightSpec, torch.Tensor]]) -> None:
    """Copy validated tensors into their parameters, honouring platform layouts and views."""
    for spec, t in pairs:
        p = spec.param
        layout = get_layout(p)
        if layout is None:
            target = p.data if spec.rows is None else p.data[spec.rows]
            target.copy_(t.to(device=p.device, dtype=p.dtype))
        else:
            canon = layout.to_canonical(p.data).clone()
            region = canon if spec.rows is None else canon[spec.rows]
            region.copy_(t.to(device=p.device, dtype=p.dtype))
            p.data.copy_(layout.from_canonical(canon))


def load_layer_weights(layer: DeepseekV4Attention,
                       weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
                       ) -> None:
    assign_layer_weights(validate_layer_weights(layer, weights))


def export_official_weights(layer: DeepseekV4Attention) -> dict[str, torch.Tensor]:
    """The layer's weights under official names, canonical layout (never a platform layout),
    as fresh CPU tensors in the checkpoint dtypes. Under tensor parallelism: this rank's parts
    (``save_checkpoint`` gathers them, ``dsv4.tensor_parallel.gather_checkpoint_tensors``)."""
    from dsv4.layers.weight_layout import canonical

    out: dict[str, torch.Tensor] = {}
    for spec in official_weight_specs(layer):
        value = canonical(spec.param).detach()
        if spec.rows is not None:
            value = value[spec.rows]
        out[spec.name] = value.to(device="cpu", dtype=spec.dtypes[0]).contiguous().clone()
    return out
