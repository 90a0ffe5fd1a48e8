"""The garbage collector's runs during a timed loop: how many, of which generation, how long.

A process that holds a model holds a few hundred thousand Python objects (PyTorch's own, the
layers', the caches'); a full (generation 2) collection scans all of them, tens of milliseconds
of host time on the dev CPU (one every ~200 steps of a decode loop: 60 ms at 16 sequences x 8
layers, 2026-12-06), which a timed loop of a few milliseconds a step cannot hide. Serving loops
freeze what they hold after loading (``gc.freeze()``: the objects alive then are never scanned
again); the benches do the same (:func:`frozen`) and record the collections that still ran
(:class:`GcPauses`), so a slow timing that holds one says so.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class GcPauses:
    """``with GcPauses() as pauses:`` counts the collections that run inside, by generation,
    and their wall time (:meth:`summary`)."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.longest = 0.0
        self._t0 = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        dt = time.perf_counter() - self._t0
        g = int(info["generation"])
        self.count[g] += 1
        self.seconds[g] += dt
        self.longest = max(self.longest, dt)

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict[str, Any]:
        """{"collections": [gen 0, 1, 2], "ms": their total wall time, "longest_ms"}."""
        return {"collections": list(self.count), "ms": round(sum(self.seconds) * 1e3, 3),
                "longest_ms": round(self.longest * 1e3, 3)}


@contextmanager
def frozen() -> Iterator[None]:
    """Collect, then freeze every object alive now (``gc.freeze()``) for the block: what the
    block allocates is still collected, what was there before is never scanned. Unfrozen at
    the end, unless the caller had frozen objects before (``gc.unfreeze`` cannot tell theirs
    from the block's: all stay frozen then)."""
    caller_froze = gc.get_freeze_count() > 0
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        if not caller_froze:
            gc.unfreeze()
