"""Whole-checkpoint I/O: safetensors shards with official DSV4 names.

``load_checkpoint`` opens only the tensors of the requested layers' attention
(``layers.{i}.attn.*``; the MTP layer is ``mtp.0.attn.*``), using the shard index file when present.
``save_checkpoint`` writes official names and canonical layouts (never a platform-private layout)
plus ``config.json``, so a saved model loads on any platform.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from dsv4.attention import DeepseekV4Attention
from dsv4.config import ConfigError, DSV4Config
from dsv4.tensor_parallel import (
    TPInfo,
    agreement,
    gather_checkpoint_tensors,
    rank0_writes,
    writes_checkpoint,
)
from dsv4.weights import WeightLoadError, export_official_weights

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint folder, index or shard is missing, corrupt or inconsistent."""


class AttentionStack(nn.Module):
    """The attention layers of a checkpoint, keyed by layer id (``stack[i]``)."""

    def __init__(self, cfg: DSV4Config, layers: dict[int, DeepseekV4Attention]) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleDict({str(i): m for i, m in sorted(layers.items())})

    def __getitem__(self, layer_id: int) -> DeepseekV4Attention:
        return self.layers[str(layer_id)]  # type: ignore[return-value]

    def __iter__(self) -> Any:
        return iter(self.layers.values())

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def layer_ids(self) -> list[int]:
        return [int(k) for k in self.layers]


def layer_prefix(cfg: DSV4Config, layer_id: int) -> str:
    if layer_id < cfg.num_hidden_layers:
        return f"layers.{layer_id}.attn."
    return f"mtp.{layer_id - cfg.num_hidden_layers}.attn."


def _shard_map(folder: Path) -> dict[str, Path]:
    """tensor name -> shard file, from the index file or by listing every shard's header."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from e
        return {name: folder / fname for name, fname in weight_map.items()}
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"{folder} holds no *.safetensors file and no {INDEX_FILE}")
    mapping: dict[str, Path] = {}
    for shard in shards:
        with _open(shard) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                mapping[name] = shard
    return mapping


def _open(path: Path) -> Any:
    if not path.is_file():
        raise CheckpointError(f"shard {path} does not exist")
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"cannot read safetensors file {path} (truncated or corrupt?): "
                              f"{e}") from e


def read_layer_tensors(folder: str | Path, cfg: DSV4Config, layer_ids: Iterable[int],
                       tp: TPInfo | None = None) -> dict[int, dict[str, torch.Tensor]]:
    """Official-name tensors (relative to each layer) of the requested layers' attention; with
    ``tp``, only this rank's part of each split tensor is read from the file."""
    folder = Path(folder)
    mapping = _shard_map(folder)
    wanted = {i: layer_prefix(cfg, i) for i in layer_ids}
    by_shard: dict[Path, list[tuple[int, str, str]]] = {}
    for name, shard in mapping.items():
        for i, prefix in wanted.items():
            if name.startswith(prefix):
                by_shard.setdefault(shard, []).append((i, name, name[len(prefix):]))
    out: dict[int, dict[str, torch.Tensor]] = {i: {} for i in wanted}
    for shard, entries in by_shard.items():
        with _open(shard) as f:
            for i, full, rel in entries:
                try:
                    out[i][rel] = _read(f, full, rel, tp)
                except (SafetensorError, OSError, ValueError) as e:
                    raise CheckpointError(f"cannot read tensor {full!r} from {shard}: {e}") from e
    for i, tensors in out.items():
        if not tensors:
            raise CheckpointError(f"{folder} has no tensor for layer {i} (prefix {wanted[i]!r})")
    return out


def load_checkpoint(folder: str | Path, layers: Sequence[int] | None = None,
                    platform: str = "reference", device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.bfloat16, process: bool = True,
                    cfg: DSV4Config | None = None, passes: Sequence[str] | None = None,
                    tp_group: Any = None, **build_kwargs: Any) -> AttentionStack:
    """Build and load the attention layers ``layers`` (default: all) of a checkpoint folder.

    Each layer is built, loaded and (with ``process``) run through the platform's post-load
    passes (or ``passes``) and its offloader before the next is read. Any error (config,
    missing or corrupt shard, bad tensor) is raised before a layer is returned.

    ``tp_group``: a ``torch.distributed`` process group; every rank of it calls this, checks that
    all ranks hold the same config, and reads only its part of the split tensors
    (``dsv4.tensor_parallel``). A rank that fails makes every rank raise.
    """
    folder = Path(folder)
    with agreement(tp_group, f"reading the config of {folder}"):
        if not folder.is_dir():
            raise CheckpointError(f"checkpoint folder {folder} does not exist")
        try:
            cfg = cfg or DSV4Config.from_pretrained(folder)
        except ConfigError as e:
            raise CheckpointError(f"{folder}: {e}") from e
        ids = list(range(cfg.num_layers_with_mtp)) if layers is None else list(layers)
        for i in ids:
            cfg.compress_ratio(i)  # range check with a clear message
    tp = None if tp_group is None else TPInfo.create(cfg, tp_group)  # same config everywhere
    built: dict[int, DeepseekV4Attention] = {}
    with agreement(tp, f"loading {folder}"):  # no collective inside: a failing rank skips none
        tensors = read_layer_tensors(folder, cfg, ids, tp)
        from dsv4.passes import process_weights_after_loading
        from dsv4.platforms import get_platform

        shared = get_platform(platform, device).attention_cls.shared_build_kwargs(device)
        if tp is not None:
            build_kwargs = {**build_kwargs, "tp_group": tp}
        for i in ids:  # one layer at a time: load, post-load passes, offload, next
            layer = DeepseekV4Attention.build(cfg, i, platform=platform, device=device,
                                              dtype=dtype, **{**shared, **build_kwargs})
            try:
                layer.load_weights(tensors.pop(i).items())
            except WeightLoadError as e:
                raise CheckpointError(f"{folder}: {e}") from e
            if process:
                process_weights_after_loading(layer, passes=passes)
            built[i] = layer
    stack = AttentionStack(cfg, built)
    log.info("loaded %d attention layer(s) from %s for platform %s", len(built), folder, platform)
    return stack


def _read(f: Any, full: str, rel: str, tp: TPInfo | None) -> torch.Tensor:
    """One tensor; under tensor parallelism only this rank's part of a split one (a tensor
    whose shape is not the official one is read whole, for the loader to report)."""
    if tp is None or tp.slice_of(rel) is None:
        return f.get_tensor(full)  # type: ignore[no-any-return]
    part = f.get_slice(full)
    dim, sl = tp.slice_of(rel)  # type: ignore[misc]
    shape = tuple(part.get_shape())
    if len(shape) <= dim or shape[dim] != (sl.stop - sl.start) * tp.size:
        return f.get_tensor(full)  # type: ignore[no-any-return]
    return tp.take(rel, part)  # type: ignore[no-any-return]


def attention_layers(module: nn.Module) -> list[DeepseekV4Attention]:
    if isinstance(module, DeepseekV4Attention):
        return [module]
    return [m for m in module.modules() if isinstance(m, DeepseekV4Attention)]


@rank0_writes
def save_checkpoint(module: nn.Module, folder: str | Path,
                    max_shard_bytes: int = 4 << 30) -> list[Path]:
    """Write every attention layer in ``module`` with official names and canonical layouts.

    Shards are ``model-0000k-of-0000n.safetensors`` with an index when more than one is needed,
    else ``model.safetensors``. Returns the files written.

    Under tensor parallelism every rank calls it: the split tensors are gathered into their
    official shapes, rank 0 writes (the other ranks return [] once it has finished).
    """
    layers = attention_layers(module)
    if not layers:
        raise ValueError("save_checkpoint: the module holds no DeepseekV4Attention layer")
    cfg = layers[0].cfg
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for layer in layers:
        prefix = layer_prefix(cfg, layer.layer_id)
        for name, t in export_official_weights(layer).items():
            tensors[prefix + name] = t
    tensors = gather_checkpoint_tensors(layers, tensors)  # TP: the unsplit official tensors
    if not writes_checkpoint(layers):
        return []
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    written = []
    if len(shards) == 1:
        path = folder / "model.safetensors"
        save_file(shards[0], str(path), metadata={"format": "pt"})
        written.append(path)
    else:
        weight_map = {}
        for k, shard in enumerate(shards, 1):
            fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(folder / fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in shard})
            written.append(folder / fname)
        (folder / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map},
                                                    indent=1))
        written.append(folder / INDEX_FILE)
    (folder / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    written.append(folder / "config.json")
    return written
