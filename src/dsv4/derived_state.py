"""Weight-derived state that post-load passes leave on a layer, and how it is restored.

A pass may leave state derived from the layer's parameters: a fused buffer that several
parameters view (the compressor GEMM fusion), a packed weight with its own scale copy (the
input-projection packing). Whenever the parameters are rebound (a device move, ``load_weights``,
``load_state_dict``, an offloader) that state must be rebuilt. The pass that creates the state
registers a restorer here; the layer calls :func:`restore_derived_state` and knows no pass by
name. (This module imports neither the layer nor any pass: no import circle.)

A restorer takes the layer and returns True when the layer held its state and it was restored;
restorers run in ascending ``order`` and the first that returns True ends the chain (a packed
layer's pack already contains the fused compressor buffer, so the pack's restorer runs first).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Restorer = Callable[[Any], bool]

_RESTORERS: dict[str, tuple[int, Restorer]] = {}


def register_restorer(name: str, restorer: Restorer, order: int) -> None:
    """Register (or replace) the restorer of the state a pass called ``name`` creates."""
    _RESTORERS[name] = (order, restorer)


def restorers() -> list[str]:
    """Registered restorers, in the order they run."""
    return [name for name, _ in sorted(_RESTORERS.items(), key=lambda kv: kv[1][0])]


def restore_derived_state(layer: Any) -> None:
    """Rebuild whatever state a pass derived from ``layer``'s weights (no-op when none)."""
    for name in restorers():
        if _RESTORERS[name][1](layer):
            return
