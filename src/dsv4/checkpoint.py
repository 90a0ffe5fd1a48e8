"""Whole-checkpoint I/O: safetensors shards with official DSV4 names.

``load_checkpoint`` opens only the tensors of the requested layers' attention
(``layers.{i}.attn.*``; the MTP layer is ``mtp.0.attn.*``), using the shard index file when present.
``save_checkpoint`` writes official names and canonical layouts (never a platform-private layout)
plus ``config.json``, so a saved model loads on any platform.
"""

from __future__ import annotations

import functools
import json
import logging
import numbers
import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from dsv4.attention import DeepseekV4Attention, attention_layers
from dsv4.config import ConfigError, DSV4Config, read_config_json
from dsv4.dialects import transformers_names
from dsv4.folder_swap import FolderOwnershipError, replace_folder
from dsv4.platforms import build_attention
from dsv4.tensor_parallel import SHARDED, TPConfigError, TPInfo, agreement
from dsv4.weights import WeightLoadError, export_official_weights

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint folder, index or shard is missing, corrupt or inconsistent."""


class MissingMTPLayersWarning(UserWarning):
    """``load_checkpoint(folder)`` without ``layers`` loaded every layer but the MTP layers,
    which the folder does not hold (transformers' ``save_pretrained`` writes none)."""


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
                       tp: TPInfo | None = None, optional: Iterable[int] = ()
                       ) -> dict[int, dict[str, torch.Tensor]]:
    """Official-name tensors (relative to each layer) of the requested layers' attention; with
    ``tp``, only this rank's part of each split tensor is read from the file. A layer of
    ``optional`` that the folder has no tensor for is left out of the result; any other such
    layer is a :class:`CheckpointError`."""
    folder = Path(folder)
    mapping = _shard_map(folder)
    try:  # official name -> stored name (official or one of transformers' spellings)
        stored = transformers_names.official_view(mapping)
    except transformers_names.NameDialectError as e:
        raise CheckpointError(f"{folder}: {e}") from e
    wanted = {i: layer_prefix(cfg, i) for i in layer_ids}
    by_shard: dict[Path, list[tuple[int, str, str]]] = {}
    for name, full in stored.items():
        for i, prefix in wanted.items():
            if name.startswith(prefix):
                by_shard.setdefault(mapping[full], []).append((i, full, name[len(prefix):]))
    out: dict[int, dict[str, torch.Tensor]] = {i: {} for i in wanted}
    for shard, entries in by_shard.items():
        with _open(shard) as f:
            for i, full, rel in entries:
                try:
                    out[i][rel] = _read(f, full, rel, tp)
                    if transformers_names.classify(full) != "official":
                        out[i][rel] = transformers_names.as_checkpoint_dtype(rel, out[i][rel])
                except (SafetensorError, OSError, ValueError) as e:
                    raise CheckpointError(f"cannot read tensor {full!r} from {shard}: {e}") from e
    optional = set(optional)
    for i, tensors in list(out.items()):
        if tensors:
            continue
        if i in optional:
            del out[i]
            continue
        hint = ""
        if i >= cfg.num_hidden_layers:
            hint = (": it is an MTP layer, and the checkpoint holds none (transformers' "
                    "DeepseekV4ForCausalLM keeps no MTP layers, while its config declares "
                    f"num_nextn_predict_layers={cfg.num_nextn_predict_layers}); load the "
                    "others with layers=None (the layers it holds) or a list without "
                    f"{sorted(j for j in wanted if j >= cfg.num_hidden_layers)}")
        raise CheckpointError(f"{folder} has no tensor for layer {i} (prefix {wanted[i]!r})"
                              + hint)
    return out


def _requested_layers(folder: Path, cfg: DSV4Config, layers: Sequence[int] | None
                     ) -> tuple[list[int], list[int]]:
    """The layer ids to load: ``layers``, else the ones the folder records (a folder written by
    ``save_checkpoint`` from a partial stack), else every layer of the model; and of those, the
    ones the folder may lack (the MTP layers, in that last case: transformers' checkpoints hold
    none)."""
    if layers is None:
        saved = None
        if (folder / "config.json").is_file():
            saved = read_config_json(folder).get(SAVED_LAYERS_KEY)
        if saved is None:
            return (list(range(cfg.num_layers_with_mtp)),
                    list(range(cfg.num_hidden_layers, cfg.num_layers_with_mtp)))
        if not isinstance(saved, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in saved):
            raise CheckpointError(f"{folder}/config.json: {SAVED_LAYERS_KEY} must be a list of "
                                  f"layer ids, got {saved!r}")
        layers = saved
    try:
        if isinstance(layers, (str, bytes)):
            raise TypeError
        ids = list(layers)
    except TypeError:
        raise CheckpointError(f"layers={layers!r}: give a list of layer ids") from None
    if not ids:
        raise CheckpointError("layers=[]: give at least one layer id (or None for all layers)")
    bad = [i for i in ids if not isinstance(i, numbers.Integral) or isinstance(i, bool)]
    if bad:
        raise CheckpointError(f"layers={ids!r}: layer ids must be integers, got {bad!r}")
    dups = sorted({i for i in ids if ids.count(i) > 1})
    if dups:
        raise CheckpointError(f"layers={ids!r}: duplicate layer id(s) {dups}")
    for i in ids:
        cfg.compress_ratio(i)  # range check with a clear message
    return [int(i) for i in ids], []


def load_checkpoint(folder: str | Path, layers: Sequence[int] | None = None,
                    platform: str = "reference", device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.bfloat16, process: bool = True,
                    cfg: DSV4Config | None = None, passes: Sequence[str] | None = None,
                    tp_group: Any = None, **build_kwargs: Any) -> AttentionStack:
    """Build and load the attention layers ``layers`` of a checkpoint folder (default: the layers
    a ``save_checkpoint`` folder records, else all; then MTP layers the folder does not hold, as
    in a transformers ``save_pretrained`` folder, are left out with a
    :class:`MissingMTPLayersWarning` naming them; a layer asked for by id must be there).

    Each layer is built, loaded and (with ``process``) run through the platform's post-load
    passes (or ``passes``) and its offloader before the next is read. Any error (config,
    missing or corrupt shard, bad tensor) is raised before a layer is returned.

    ``tp_group``: a ``torch.distributed`` process group; every rank of it calls this, checks that
    all ranks hold the same config, and reads only its part of the split tensors
    (``dsv4.tensor_parallel``). A rank that fails makes every rank raise.
    """
    folder = Path(folder)
    with agreement(tp_group, f"reading the config of {folder}"):
        if folder.is_file():
            raise CheckpointError(f"{folder} is a file, not a checkpoint folder (give the folder "
                                  "that holds config.json and the *.safetensors shards)")
        if not folder.is_dir():
            raise CheckpointError(f"checkpoint folder {folder} does not exist")
        try:
            cfg = cfg or DSV4Config.from_pretrained(folder)
            ids, optional = _requested_layers(folder, cfg, layers)
        except ConfigError as e:
            raise CheckpointError(f"{folder}: {e}") from e
    tp = None if tp_group is None else TPInfo.create(cfg, tp_group)  # same config everywhere
    built: dict[int, DeepseekV4Attention] = {}
    with agreement(tp, f"loading {folder}"):  # no collective inside: a failing rank skips none
        tensors = read_layer_tensors(folder, cfg, ids, tp, optional=optional)
        absent = [i for i in ids if i not in tensors]
        if absent:  # only MTP layers may be absent, and only when no list was given
            warnings.warn(MissingMTPLayersWarning(
                f"{folder} holds no MTP layer: loaded layers {[i for i in ids if i in tensors]}"
                f" without MTP layer(s) {absent} (config num_nextn_predict_layers="
                f"{cfg.num_nextn_predict_layers}; transformers' DeepseekV4ForCausalLM keeps "
                "none)"), stacklevel=2)
            ids = [i for i in ids if i in tensors]
        from dsv4.passes import process_weights_after_loading
        from dsv4.platforms import get_platform

        shared = get_platform(platform, device).attention_cls.shared_build_kwargs(device)
        if tp is not None:
            build_kwargs = {**build_kwargs, "tp_group": tp}
        for i in ids:  # one layer at a time: load, post-load passes, offload, next
            layer = build_attention(cfg, i, platform=platform, device=device,
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


SAVED_LAYERS_KEY = "dsv4_saved_layers"
"""config.json key (ignored by other readers) listing the layer ids a ``save_checkpoint`` folder
holds, so that ``load_checkpoint(folder)`` loads exactly those by default."""


def is_checkpoint_file(name: str) -> bool:
    """Files ``save_checkpoint`` writes (and may replace): config.json, model*.safetensors and
    the shard index."""
    return name in ("config.json", INDEX_FILE) or (
        name.startswith("model") and name.endswith(".safetensors"))


# ---- tensor parallelism: every rank calls save_checkpoint, rank 0 writes -----------------
def group_of(layers: list[DeepseekV4Attention]) -> TPInfo | None:
    """The tensor-parallel group all ``layers`` share, or None; mixing groups is an error."""
    tps = [layer.tp for layer in layers if layer.tp is not None]
    if not tps:
        return None
    if len(tps) != len(layers) or any((t.group, t.rank, t.size) != (tps[0].group, tps[0].rank,
                                                                   tps[0].size) for t in tps):
        raise TPConfigError("the module mixes layers of different tensor-parallel groups (or "
                            "with and without one): save them separately")
    return tps[0]


def gather_checkpoint_tensors(layers: list[DeepseekV4Attention],
                              tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``save_checkpoint``'s tensors (full names) with every split tensor gathered from the group
    into its official shape; unchanged without a group. A collective: every rank calls it."""
    if group_of(layers) is None:
        return tensors
    out = dict(tensors)
    for layer in layers:
        assert layer.tp is not None
        prefix = layer_prefix(layer.cfg, layer.layer_id)
        for name in SHARDED:
            if prefix + name in out:
                out[prefix + name] = layer.tp.gather(name, out[prefix + name])
    return out


def writes_checkpoint(layers: list[DeepseekV4Attention]) -> bool:
    """Whether this process writes the files: always without a group, else rank 0 only."""
    tp = group_of(layers)
    return tp is None or tp.rank == 0


F = TypeVar("F", bound=Callable[..., Any])


def rank0_writes(save: F) -> F:
    """Decorator of ``save_checkpoint``: under tensor parallelism every rank calls it (the
    gather is collective), rank 0 writes, and every rank returns only once rank 0 has finished;
    a failure on any rank raises on every rank."""

    @functools.wraps(save)
    def wrapper(module: Any, *args: Any, **kwargs: Any) -> Any:
        tp = group_of(attention_layers(module))
        if tp is None or tp.size == 1:
            return save(module, *args, **kwargs)
        result: Any = []
        with agreement(tp.group, "save_checkpoint"):
            result = save(module, *args, **kwargs)
        return result

    return wrapper  # type: ignore[return-value]


@rank0_writes
def save_checkpoint(module: nn.Module, folder: str | Path,
                    max_shard_bytes: int = 4 << 30, dialect: str = "official") -> list[Path]:
    """Write every attention layer in ``module`` with official names and canonical layouts
    (``dialect="transformers"``: transformers' DeepseekV4 tensor names and config keys).

    Shards are ``model-0000k-of-0000n.safetensors`` with an index when more than one is needed,
    else ``model.safetensors``; ``config.json`` records which layers the folder holds. The files
    are written into a temporary sibling folder that then replaces ``folder``: afterwards it
    holds exactly this checkpoint (no file of an earlier save survives) or, if anything failed,
    exactly what it held before. A folder holding other files than checkpoint files is refused
    (:class:`CheckpointError` naming them). Returns the files written.

    Under tensor parallelism every rank calls it: the split tensors are gathered into their
    official shapes, rank 0 writes (the other ranks return [] once it has finished).
    """
    if dialect not in transformers_names.DIALECTS:
        raise ValueError(f"save_checkpoint: dialect={dialect!r}, expected one of "
                         f"{list(transformers_names.DIALECTS)}")
    layers = attention_layers(module)
    if not layers:
        raise ValueError("save_checkpoint: the module holds no DeepseekV4Attention layer")
    cfg = layers[0].cfg
    tensors: dict[str, torch.Tensor] = {}
    for layer in layers:
        prefix = layer_prefix(cfg, layer.layer_id)
        for name, t in export_official_weights(layer).items():
            tensors[prefix + name] = t
    tensors = gather_checkpoint_tensors(layers, tensors)  # TP: the unsplit official tensors
    if not writes_checkpoint(layers):
        return []
    try:
        tensors = transformers_names.from_official(tensors, dialect)
    except transformers_names.NameDialectError as e:
        raise ValueError(f"save_checkpoint: {e}") from e
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    config = {**cfg.to_dict(dialect=dialect),
              SAVED_LAYERS_KEY: sorted(layer.layer_id for layer in layers)}

    def write(tmp: Path) -> list[Path]:
        # config.json first: an ordinary file, so its mode is what the user's umask gives; the
        # shards get the same mode (the safetensors writer may create private temp files)
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        mode = (tmp / "config.json").stat().st_mode & 0o7777
        written = []
        if len(shards) == 1:
            save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
            written.append(tmp / "model.safetensors")
        else:
            weight_map = {}
            for k, shard in enumerate(shards, 1):
                fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / fname), metadata={"format": "pt"})
                weight_map.update({n: fname for n in shard})
                written.append(tmp / fname)
            (tmp / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map},
                                                     indent=1))
            written.append(tmp / INDEX_FILE)
        for path in written:
            os.chmod(path, mode)
        return [*written, tmp / "config.json"]

    try:
        return replace_folder(folder, write, is_checkpoint_file, what="checkpoint files")
    except FolderOwnershipError as e:
        raise CheckpointError(f"save_checkpoint: {e}") from e
