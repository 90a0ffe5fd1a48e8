"""Tensor parallelism of the attention layer over ``torch.distributed``, split as vLLM splits it.

With a process group of size ``tp``, rank ``r`` holds

* ``wq_b`` column-parallel over heads: heads ``r * H/tp .. (r + 1) * H/tp - 1``, i.e. those weight
  rows (``H/tp * head_dim`` of them) and the matching fp8 scale rows;
* ``wo_a`` column-parallel over its output groups: groups ``r * G/tp ..``, rows
  ``g * o_lora_rank ..`` of each (and scale rows);
* ``wo_b`` row-parallel: the input columns of the rank's groups (and scale columns); the layer
  output is the all-reduce (sum) of the ranks' partial ``wo_b`` products;
* ``attn_sink`` sliced with the heads.

``fused_wqa_wkv``, the compressors, the indexer and the norms are replicated, and the kv cache is
MQA, so every rank keeps the whole cache. :class:`TPInfo` is the one object a layer holds
(``layer.tp``); without a group the layer holds ``None`` and nothing changes.

Every collective here is bounded by the process group's timeout (``init_process_group(...,
timeout=...)``; torch's default is 10 minutes, the tests and ``dsv4 verify --tp`` use 60 s). A rank
that fails while loading tells the others through :func:`agreement`, so every rank raises instead
of one waiting on a collective that never comes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dsv4.config import DSV4Config

FP8_BLOCK = 128
STATUS_BYTES = 1024
"""Bytes of an error message that a failing rank sends to the others (longer ones are cut)."""

SHARDED: dict[str, int] = {
    "wq_b.weight": 0, "wq_b.scale": 0,
    "wo_a.weight": 0, "wo_a.scale": 0,
    "wo_b.weight": 1, "wo_b.scale": 1,
    "attn_sink": 0,
}
"""Official tensor names (relative to the layer) that are split, and the dimension they split on.
Every other tensor of the layer is replicated."""


class TPConfigError(ValueError):
    """The model cannot be split over this group, or the ranks were given different configs."""


class TPRankError(RuntimeError):
    """Another rank of the tensor-parallel group failed; this rank raises too (nothing hangs)."""


def split_problems(num_heads: int, head_dim: int, o_groups: int, o_lora_rank: int, fp8: bool,
                   size: int) -> list[str]:
    """Why the attention weights cannot be split over ``size`` ranks ([] when they can)."""
    problems = []
    if num_heads % size:
        problems.append(f"num_attention_heads={num_heads} is not divisible by the tensor-parallel "
                        f"size {size} (wq_b and attn_sink are split by heads)")
    if o_groups % size:
        problems.append(f"o_groups={o_groups} is not divisible by the tensor-parallel size {size} "
                        "(wo_a and wo_b are split by output groups)")
    if problems or not fp8:
        return problems
    q_rows = num_heads // size * head_dim
    if q_rows % FP8_BLOCK:
        problems.append(f"wq_b: a rank's rows are {num_heads // size} heads x head_dim "
                        f"{head_dim} = {q_rows}, not a multiple of the fp8 block {FP8_BLOCK}: "
                        "the split would cut a 128x128 scale block between ranks")
    o_rows = o_groups // size * o_lora_rank
    if o_rows % FP8_BLOCK:
        problems.append(f"wo_a rows / wo_b columns: a rank's share is {o_groups // size} groups x "
                        f"o_lora_rank {o_lora_rank} = {o_rows}, not a multiple of the fp8 block "
                        f"{FP8_BLOCK}: the split would cut a 128x128 scale block between ranks")
    return problems


def config_key(cfg: DSV4Config) -> str:
    """A hash of everything in the config (model keys and runtime options)."""
    text = json.dumps(cfg.to_dict(), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def comm_device(group: Any) -> torch.device:
    """Where this group's collectives take tensors: the current CUDA device for NCCL-only groups,
    else the CPU."""
    backend = str(dist.get_backend(group))
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def exchange_strings(group: Any, text: str, width: int = STATUS_BYTES) -> list[str]:
    """all_gather of one short string per rank (UTF-8, cut to ``width`` bytes)."""
    size = dist.get_world_size(group)
    raw = text.encode()[:width]
    buf = torch.zeros(width + 4, dtype=torch.uint8)
    buf[:4] = torch.tensor(list(len(raw).to_bytes(4, "little")), dtype=torch.uint8)
    if raw:
        buf[4:4 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    dev = comm_device(group)
    buf = buf.to(dev)
    out = [torch.empty_like(buf) for _ in range(size)]
    dist.all_gather(out, buf, group=group)
    texts = []
    for o in out:
        b = bytes(o.cpu().tolist())
        n = int.from_bytes(b[:4], "little")
        texts.append(b[4:4 + n].decode(errors="replace"))
    return texts


@dataclass(frozen=True)
class TPInfo:
    """This rank's place in the tensor-parallel group and the slices it holds."""

    rank: int
    size: int
    group: Any
    """The ``torch.distributed`` process group."""
    n_heads: int
    """Local heads: ``num_attention_heads / size``."""
    o_groups: int
    """Local output groups: ``o_groups / size``."""
    head_dim: int
    o_lora_rank: int
    fp8: bool
    cfg_key: str
    """:func:`config_key` of the config every rank agreed on."""

    @classmethod
    def create(cls, cfg: DSV4Config, group: Any) -> TPInfo:
        """Check that every rank of ``group`` holds the same config (a collective: every rank
        must call it), then that the weights split over the group; raises
        :class:`TPConfigError` naming the differing ranks or the tensor that cannot be split."""
        if not dist.is_available() or not dist.is_initialized():
            raise TPConfigError("tp_group given but torch.distributed is not initialised (call "
                                "torch.distributed.init_process_group first)")
        if not isinstance(group, dist.ProcessGroup):
            raise TPConfigError(f"tp_group must be a torch.distributed ProcessGroup (or a "
                                f"TPInfo), got {type(group).__name__}")
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        key = config_key(cfg)
        keys = exchange_strings(group, key, width=32)
        if len(set(keys)) > 1:
            by_key: dict[str, list[int]] = {}
            for r, k in enumerate(keys):
                by_key.setdefault(k, []).append(r)
            parts = "; ".join(f"ranks {rs} have config {k}" for k, rs in by_key.items())
            raise TPConfigError(f"the ranks of the tensor-parallel group were built from "
                                f"different configs ({parts}); this is rank {rank}")
        problems = split_problems(cfg.num_attention_heads, cfg.head_dim, cfg.o_groups,
                                  cfg.o_lora_rank, cfg.fp8_weights, size)
        if problems:
            raise TPConfigError(f"cannot split the attention over {size} ranks: "
                                + "; ".join(problems))
        return cls(rank, size, group, cfg.num_attention_heads // size, cfg.o_groups // size,
                   cfg.head_dim, cfg.o_lora_rank, cfg.fp8_weights, key)

    # ---- slices -----------------------------------------------------------------------
    def slice_of(self, name: str) -> tuple[int, slice] | None:
        """(dimension, index range) of this rank's part of an official tensor, or None when the
        tensor is replicated."""
        if name not in SHARDED:
            return None
        if name.startswith("wq_b") or name == "attn_sink":
            per = self.n_heads * (self.head_dim if name.startswith("wq_b") else 1)
        else:
            per = self.o_groups * self.o_lora_rank
        if name.endswith(".scale"):
            per //= FP8_BLOCK
        return SHARDED[name], slice(self.rank * per, (self.rank + 1) * per)

    def full_shape(self, name: str, local: tuple[int, ...]) -> tuple[int, ...]:
        """The official (unsplit) shape of a tensor whose local shape is ``local``."""
        if name not in SHARDED:
            return local
        dim = SHARDED[name]
        return tuple(n * self.size if i == dim else n for i, n in enumerate(local))

    def take(self, name: str, t: Any) -> Any:
        """This rank's part of an official tensor (a view), or a safetensors slice object."""
        where = self.slice_of(name)
        if where is None:
            return t
        dim, sl = where
        if isinstance(t, torch.Tensor):
            return t.narrow(dim, sl.start, sl.stop - sl.start)
        return t[sl] if dim == 0 else t[:, sl]  # safetensors slice: reads only these bytes

    # ---- communication ----------------------------------------------------------------
    def all_reduce(self, y: torch.Tensor) -> torch.Tensor:
        """Sum of ``y`` over the group, in place, on the current stream (CUDA-graph capturable
        on NCCL)."""
        if self.size == 1:
            return y
        y = y.contiguous()
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=self.group)
        return y

    def gather(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """The official tensor from every rank's part (byte-exact, any dtype)."""
        where = self.slice_of(name)
        if where is None or self.size == 1:
            return t
        dim = where[0]
        t = t.contiguous()
        dev = comm_device(self.group)
        flat = t.reshape(-1).view(torch.uint8).to(dev)
        parts = [torch.empty_like(flat) for _ in range(self.size)]
        dist.all_gather(parts, flat, group=self.group)
        pieces = [p.cpu().view(t.dtype).view(t.shape) for p in parts]
        return torch.cat(pieces, dim=dim)


def resolve_tp(cfg: DSV4Config, tp_group: Any) -> TPInfo | None:
    """A layer's :class:`TPInfo`: None without a group; an existing TPInfo (checked against this
    config) is shared; a process group is checked with :meth:`TPInfo.create` (a collective)."""
    if tp_group is None:
        return None
    if isinstance(tp_group, TPInfo):
        if tp_group.cfg_key != config_key(cfg):
            raise TPConfigError("the TPInfo passed as tp_group was made for another config")
        return tp_group
    return TPInfo.create(cfg, tp_group)


def local_sizes(cfg: DSV4Config, tp: TPInfo | None) -> tuple[int, int]:
    """(heads, output groups) a rank holds."""
    if tp is None:
        return cfg.num_attention_heads, cfg.o_groups
    return tp.n_heads, tp.o_groups


@contextmanager
def agreement(group: Any, what: str) -> Iterator[None]:
    """Run a block on every rank of ``group``, then compare outcomes (one collective): a rank
    whose block raised re-raises its own error, every other rank raises :class:`TPRankError`
    naming the failed ranks and their errors. Without a group this is a plain block. The block
    must not run collectives of its own (a failing rank would skip them)."""
    if isinstance(group, TPInfo):
        group = group.group
    if group is None:
        yield
        return
    try:
        yield
    except BaseException as e:
        exchange_strings(group, f"FAIL {type(e).__name__}: {e}")
        raise
    statuses = exchange_strings(group, "ok")
    failed = {r: s[5:] for r, s in enumerate(statuses) if s != "ok"}
    if failed:
        rank = dist.get_rank(group)
        detail = "; ".join(f"rank {r}: {m}" for r, m in failed.items())
        raise TPRankError(f"{what} failed on rank(s) {sorted(failed)} of the tensor-parallel "
                          f"group, so rank {rank} stops too ({detail})")
