"""Results one override point makes ahead of time for a later one of the same step.

A platform can save launches by computing, in one override point's launch, what a later
override point of the same step will be asked for (the kv rows rotated beside the query heads,
the visible entries' flat rows beside the selection, ...). The later point must still be
called - that is the contract - and must return the early result only for exactly the inputs
it was made from: a subclass or a probe may pass other tensors. :class:`StepHandoffs` holds
such results keyed by their inputs' identity (``is``, never values: no device sync, and a
tensor that merely compares equal is not the same input), each taken at most once.

Usage, in a platform::

    self._handoffs.put("kv_rows", (kv, pos), rows)        # the early point
    rows = self._handoffs.take("kv_rows", (kv, pos))     # the later one: rows or None

``take`` removes the entry whether or not the inputs match, so nothing outlives the call it
was meant for; ``peek`` leaves it (a result two later points read). ``clear`` at the start of
each step drops whatever a step left (one that raised, or a subclass that skipped a point).
A stale entry can only waste work, never be returned for other inputs.
"""

from __future__ import annotations

from typing import Any


class StepHandoffs:
    """Named one-shot results, each keyed by the identity of the inputs it was made from."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[tuple[Any, ...], Any]] = {}

    def put(self, name: str, inputs: tuple[Any, ...], value: Any) -> None:
        """Hold ``value`` for a later :meth:`take` / :meth:`peek` of ``name`` with the very
        objects ``inputs`` (replacing what ``name`` held)."""
        self._entries[name] = (inputs, value)

    def take(self, name: str, inputs: tuple[Any, ...]) -> Any:
        """The value put for ``name`` if it was made from exactly these objects (each ``is``
        its counterpart), else None; removes the entry either way."""
        entry = self._entries.pop(name, None)
        return None if entry is None or not _same(entry[0], inputs) else entry[1]

    def peek(self, name: str, inputs: tuple[Any, ...]) -> Any:
        """:meth:`take` without removing the entry."""
        entry = self._entries.get(name)
        return None if entry is None or not _same(entry[0], inputs) else entry[1]

    def clear(self) -> None:
        """Drop every entry (a new step)."""
        self._entries.clear()

    def __contains__(self, name: str) -> bool:
        return name in self._entries


def _same(made_from: tuple[Any, ...], inputs: tuple[Any, ...]) -> bool:
    return len(made_from) == len(inputs) and all(a is b for a, b in zip(made_from, inputs,
                                                                         strict=True))
