"""The tiny LM's checkpoint folder: official names, the attention through ``save_checkpoint`` /
``load_checkpoint``, the rest beside it.

Layout (what ``save_tiny_lm`` writes)::

    config.json                          DSV4 HF keys + intermediate_size + tokenizer
    model-00001-of-00002.safetensors     layers.{i}.attn.*  (written by save_checkpoint: fp8 e4m3
                                         + ue8m0 scales where the official checkpoint is fp8)
    model-00002-of-00002.safetensors     embed.weight, layers.{i}.{attn_norm,ffn_norm}.weight,
                                         layers.{i}.ffn.{w1,w2,w3}.weight, norm.weight,
                                         head.weight (bf16)
    model.safetensors.index.json         name -> shard
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from dsv4.checkpoint import (
    INDEX_FILE,
    AttentionStack,
    CheckpointError,
    layer_prefix,
    load_checkpoint,
    save_checkpoint,
)
from dsv4.config import ConfigError
from dsv4.folder_swap import FolderOwnershipError, replace_folder
from dsv4.platforms import build_attention
from dsv4.tinylm.config import TinyLMConfig
from dsv4.tinylm.lm import TinyLM
from dsv4.tinylm.paths import default_model_dir

ATTN_SHARD = "model-00001-of-00002.safetensors"
LM_SHARD = "model-00002-of-00002.safetensors"
__all__ = ["default_model_dir", "load_tiny_lm", "save_tiny_lm"]


def lm_tensor_shapes(cfg: TinyLMConfig) -> dict[str, tuple[int, ...]]:
    """Official names and shapes of every non-attention tensor."""
    h, v, inter = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (v, h)}
    for i in range(cfg.num_layers):
        shapes[f"layers.{i}.attn_norm.weight"] = (h,)
        shapes[f"layers.{i}.ffn_norm.weight"] = (h,)
        shapes[f"layers.{i}.ffn.w1.weight"] = (inter, h)
        shapes[f"layers.{i}.ffn.w2.weight"] = (h, inter)
        shapes[f"layers.{i}.ffn.w3.weight"] = (inter, h)
    shapes["norm.weight"] = (h,)
    shapes["head.weight"] = (v, h)
    return shapes


TINY_LM_FILES = (ATTN_SHARD, LM_SHARD, INDEX_FILE, "config.json", "train_report.json",
                 "loss_curve.png")
"""The files of a tiny-LM folder that :func:`save_tiny_lm` (and ``dsv4 train-tiny``) write and
may replace; a folder holding anything else is refused."""


def is_tiny_lm_file(name: str) -> bool:
    return name in TINY_LM_FILES


def save_tiny_lm(tensors: dict[str, torch.Tensor], cfg: TinyLMConfig, folder: str | Path,
                 extra: Callable[[Path], list[Path]] | None = None) -> list[Path]:
    """Write a complete model folder from official-name tensors (checkpoint dtypes); ``extra``,
    when given, writes more files into the folder being made and returns them (the trainer's
    ``train_report.json`` and ``loss_curve.png``).

    The attention tensors are loaded into reference layers and written by ``save_checkpoint``,
    so the folder holds exactly what that function produces for them. As ``save_checkpoint``
    does, the files are written into a temporary sibling that then replaces ``folder``: it holds
    exactly this model afterwards (or, on a failure, what it held before), every file with the
    mode the user's umask gives. A folder holding other files than :data:`TINY_LM_FILES` is
    refused (:class:`CheckpointError` naming them) before anything is written. Returns the
    files written."""
    layers = {}
    for i in range(cfg.num_layers):
        prefix = layer_prefix(cfg.attn, i)
        layer = build_attention(cfg.attn, i, dtype=torch.bfloat16)
        layer.load_weights((k[len(prefix):], t) for k, t in tensors.items()
                           if k.startswith(prefix))
        layers[i] = layer
    shapes = lm_tensor_shapes(cfg)
    lm = {name: tensors[name].to(torch.bfloat16).contiguous() for name in shapes}

    def write(tmp: Path) -> list[Path]:
        # config.json first: an ordinary file, so its mode is what the user's umask gives; every
        # other file gets the same (the safetensors writer may create private files)
        (tmp / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
        # save_checkpoint owns the folder it writes: write the attention there, move its shard
        save_checkpoint(AttentionStack(cfg.attn, layers), tmp / "attention")
        (tmp / "attention" / "model.safetensors").replace(tmp / ATTN_SHARD)
        shutil.rmtree(tmp / "attention")
        save_file(lm, str(tmp / LM_SHARD), metadata={"format": "pt"})
        with safe_open(str(tmp / ATTN_SHARD), framework="pt") as f:
            attn_names = list(f.keys())
        weight_map = {**{n: ATTN_SHARD for n in attn_names}, **{n: LM_SHARD for n in lm}}
        (tmp / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map},
                                                 indent=1))
        written = [tmp / ATTN_SHARD, tmp / LM_SHARD, tmp / INDEX_FILE, tmp / "config.json"]
        if extra is not None:
            written += extra(tmp)
        mode = (tmp / "config.json").stat().st_mode & 0o7777
        for path in written:
            os.chmod(path, mode)
        return written

    try:
        return replace_folder(folder, write, is_tiny_lm_file, what="tiny-LM files")
    except FolderOwnershipError as e:
        raise CheckpointError(f"save_tiny_lm: {e}") from e


def read_lm_tensors(folder: Path, cfg: TinyLMConfig) -> dict[str, torch.Tensor]:
    """The non-attention tensors, validated (present, no extras, shapes, float dtype, finite)."""
    index = folder / INDEX_FILE
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{folder}: cannot read the shard index {index.name}: {e}") from e
    shapes = lm_tensor_shapes(cfg)
    attn_prefixes = tuple(layer_prefix(cfg.attn, i) for i in range(cfg.attn.num_layers_with_mtp))
    extra = sorted(n for n in weight_map if n not in shapes and not n.startswith(attn_prefixes))
    missing = [n for n in shapes if n not in weight_map]
    if missing or extra:
        raise CheckpointError(f"{folder}: non-attention tensors do not match the config: missing "
                              f"{missing}, unexpected {extra}")
    out: dict[str, torch.Tensor] = {}
    for shard in sorted({weight_map[n] for n in shapes}):
        path = folder / shard
        if not path.is_file():
            raise CheckpointError(f"{folder}: shard {shard} does not exist")
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for n in shapes:
                    if weight_map[n] == shard:
                        out[n] = f.get_tensor(n)
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"cannot read {path} (truncated or corrupt?): {e}") from e
    for n, shape in shapes.items():
        t = out[n]
        if tuple(t.shape) != shape:
            raise CheckpointError(f"{folder}: {n!r} has shape {tuple(t.shape)}, but the config "
                                  f"needs {shape}")
        if t.dtype not in (torch.bfloat16, torch.float32, torch.float64):
            raise CheckpointError(f"{folder}: {n!r} has dtype {t.dtype}, expected bfloat16")
        if not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"{folder}: {n!r} contains NaN or Inf")
    return out


def check_model_folder(folder: Path) -> None:
    """A :class:`CheckpointError` unless ``folder`` is an existing folder (a file given for the
    folder is named as such, not as missing)."""
    if folder.is_file():
        raise CheckpointError(f"{folder} is a file, not a model folder (give the folder that "
                              "holds config.json and the *.safetensors shards)")
    if not folder.is_dir():
        raise CheckpointError(f"model folder {folder} does not exist")


def load_tiny_lm(folder: str | Path, platform: str = "reference",
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16,
                 passes: Sequence[str] | None = None, **attn_overrides: Any) -> TinyLM:
    """Load a tiny-LM folder: the attention layers through ``load_checkpoint`` (platform layer
    classes and post-load ``passes``, default: the platform's own), the rest from its shard.
    ``attn_overrides``: runtime options of the attention config, e.g. ``simulate_quant=False``."""
    folder = Path(folder)
    check_model_folder(folder)
    try:
        cfg = TinyLMConfig.from_pretrained(folder, **attn_overrides)
    except ConfigError as e:
        raise CheckpointError(f"{folder}: {e}") from e
    stack = load_checkpoint(folder, layers=list(range(cfg.num_layers)), platform=platform,
                            device=device, dtype=dtype, cfg=cfg.attn, passes=passes)
    model = TinyLM(cfg, [stack[i] for i in range(cfg.num_layers)])
    model.load_lm_tensors(read_lm_tensors(folder, cfg))
    return model
