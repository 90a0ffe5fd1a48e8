"""Observe a layer's forward without changing it: spies on override points.

Used by the demo, ``dsv4 verify`` and the tests (a forward provably passes through every override
point; the compressed selection each query received can be replayed in a float64 evaluation).
Spies are instance attributes that call the bound method they shadow, removed on exit; while
one is on, the layer's steps run eagerly (:func:`eager_steps`).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dsv4.attention import DeepseekV4Attention
from dsv4.cache.step import CacheStep
from dsv4.stages import Selection


@contextmanager
def eager_steps(layer: DeepseekV4Attention) -> Iterator[None]:
    """The layer's steps run as Python calls while the context is open: a platform that
    replays whole steps as graphs (the ``cuda`` platform's plain decode calls,
    ``use_step_graphs``) runs them eagerly, since a replay calls no Python a spy could see (and
    a graph's first step is run and then captured: two calls). Restored on exit."""
    use = getattr(layer, "use_step_graphs", None)
    if use is None:
        yield
        return
    previous = use(0)
    try:
        yield
    finally:
        use(previous)


@contextmanager
def spy_methods(layer: DeepseekV4Attention, names: tuple[str, ...] | list[str]
                ) -> Iterator[dict[str, list[tuple[tuple[Any, ...], Any]]]]:
    """Record (args, result) of every call to the named methods of ``layer`` while the context
    is open; the layer's own methods are back afterwards."""
    calls: dict[str, list[tuple[tuple[Any, ...], Any]]] = {n: [] for n in names}
    missing = object()
    saved = {n: layer.__dict__.get(n, missing) for n in names}  # an instance attribute, if any
    for name in names:
        bound = getattr(layer, name)

        def spy(*args: Any, _bound: Any = bound, _name: str = name, **kw: Any) -> Any:
            result = _bound(*args, **kw)
            calls[_name].append((args, result))
            return result

        setattr(layer, name, spy)
    try:
        with eager_steps(layer):
            yield calls
    finally:
        for name, value in saved.items():
            if value is missing:
                layer.__dict__.pop(name, None)
            else:
                layer.__dict__[name] = value


@contextmanager
def record_selection(layer: DeepseekV4Attention) -> Iterator[list[torch.Tensor | None]]:
    """Collect the compressed entries each query of each forward step attends to (the entry
    indices of the selection stage's :class:`~dsv4.stages.Selection`, [T, k], -1 padded;
    None for SWA-only layers), step by step."""
    seen: list[torch.Tensor | None] = []
    bound = layer._select

    def spy(*args: Any, **kw: Any) -> Selection:
        result = bound(*args, **kw)
        seen.append(result.entries)
        return result

    layer._select = spy  # type: ignore[method-assign]
    try:
        with eager_steps(layer):
            yield seen
    finally:
        layer.__dict__.pop("_select", None)


def stack_selections(seen: list[torch.Tensor | None]) -> torch.Tensor | None:
    """One [T, k] tensor (-1 padded to the widest call) from per-call selections."""
    if not seen or seen[0] is None:
        return None
    parts = [s for s in seen if s is not None]
    width = max(s.shape[1] for s in parts)
    return torch.cat([F.pad(s, (0, width - s.shape[1]), value=-1) for s in parts])


@contextmanager
def replay_selection(layer: DeepseekV4Attention, recorded: list[torch.Tensor | None]
                     ) -> Iterator[None]:
    """Make ``layer`` attend to previously recorded compressed selections, step by step, instead
    of its own indexer's (the indexer still runs, so caches fill as usual). Used to compare two
    platforms whose indexers may break near ties differently."""
    queue = list(recorded)
    original = layer._select

    def replay(step: CacheStep, *args: Any, **kw: Any) -> Selection:
        own = original(step, *args, **kw)
        if not queue:
            raise RuntimeError("replay_selection: more steps than recorded selections")
        entries = queue.pop(0)
        if entries is None or own.entry_rows is None:
            return own
        rows = step.entry_rows("compressed", entries).to(own.entry_rows.dtype)
        return Selection(own.window_rows, entries, rows)

    layer._select = replay  # type: ignore[method-assign]
    try:
        with eager_steps(layer):
            yield
    finally:
        layer.__dict__.pop("_select", None)


class AllocationTracker(TorchDispatchMode):
    """Peak bytes of the tensors that operators create while the mode is active (any device).

    torch's CPU allocator keeps no peak statistic, so this tracks it at the operator level: each
    operator output whose storage was not seen before counts as a new allocation, held until
    the last Python tensor seen on that storage (views included) is collected. ``peak`` is the
    most bytes held at once, ``largest`` the biggest single allocation as (bytes, operator,
    shape). Scratch memory an operator frees before it returns is not seen; storages that
    existed before (weights, the cache's stores, written in place) are never counted.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.largest: tuple[int, str, tuple[int, ...]] = (0, "", ())
        self._refs: dict[int, int] = {}
        self._bytes: dict[int, int] = {}
        self._before: set[int] = set()

    def __enter__(self) -> AllocationTracker:
        gc.collect()
        return super().__enter__()  # type: ignore[no-any-return]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        for t in tree_flatten((args, kwargs))[0]:  # storages made before the mode: never new
            if isinstance(t, torch.Tensor) and _storage_key(t) not in self._refs:
                self._before.add(_storage_key(t))
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._hold(t, str(func))
        return out

    def _hold(self, t: torch.Tensor, op: str) -> None:
        key = _storage_key(t)
        if key in self._before or key == 0:
            return
        if key not in self._refs:
            nbytes = t.untyped_storage().nbytes()
            self._refs[key] = 0
            self._bytes[key] = nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            if nbytes > self.largest[0]:
                self.largest = (nbytes, op, tuple(t.shape))
        self._refs[key] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        self._refs[key] -= 1
        if not self._refs[key]:
            del self._refs[key]
            self.live -= self._bytes.pop(key)


def _storage_key(t: torch.Tensor) -> int:
    if t.device.type == "meta":
        return 0
    return int(t.untyped_storage().data_ptr())
