"""Multi-stream helpers with the upstream semantics (docs/upstream.md Part D).

* :func:`maybe_execute_in_parallel` runs two functions: fn0 on the current stream, fn1 on an aux
  stream that waits for everything enqueued before fn0; ``enable`` defaults to True.
* :func:`execute_in_parallel` runs a default function on the current stream and N aux functions on
  N aux streams; the aux work is enqueued *before* the default work; ``enable`` defaults to False.

Both fall back to running everything on the current stream, default first then aux in slot order,
when no streams are given or ``enable`` is false. Streams only change where work runs, never what
it computes, so both paths are bitwise identical.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

T0 = TypeVar("T0")
T1 = TypeVar("T1")


def maybe_execute_in_parallel(fn0: Callable[[], T0], fn1: Callable[[], T1], event0: Any,
                              event1: Any, aux_stream: Any = None,
                              enable: bool = True) -> tuple[T0, T1]:
    if aux_stream is None or not enable:
        return fn0(), fn1()
    event0.record()
    r0 = fn0()
    with torch.cuda.stream(aux_stream):
        aux_stream.wait_event(event0)
        r1 = fn1()
        event1.record()
    current = torch.cuda.current_stream()
    current.wait_event(event1)
    _record_stream(r1, current)
    return r0, r1


def execute_in_parallel(default_fn: Callable[[], T0],
                        aux_fns: Sequence[Callable[[], Any] | None], start_event: Any,
                        done_events: Sequence[Any], aux_streams: Sequence[Any] | None = None,
                        enable: bool = False) -> tuple[T0, list[Any]]:
    if aux_streams is None or not enable:
        result = default_fn()
        return result, [None if fn is None else fn() for fn in aux_fns]
    if not (len(aux_fns) == len(aux_streams) == len(done_events)):
        raise ValueError(f"execute_in_parallel needs as many aux streams ({len(aux_streams)}) "
                         f"and done events ({len(done_events)}) as aux functions ({len(aux_fns)})")
    start_event.record()
    aux_results: list[Any] = []
    recorded = []
    for fn, stream, done in zip(aux_fns, aux_streams, done_events, strict=True):
        if fn is None:
            aux_results.append(None)
            continue
        with torch.cuda.stream(stream):
            stream.wait_event(start_event)
            aux_results.append(fn())
            done.record()
        recorded.append(done)
    result = default_fn()
    current = torch.cuda.current_stream()
    for done in recorded:
        current.wait_event(done)
    for r in aux_results:
        _record_stream(r, current)
    return result, aux_results


def _record_stream(result: Any, stream: Any) -> None:
    """Tell the caching allocator that an aux-stream tensor is now used on ``stream`` too, so
    its memory is not handed back to the aux stream while the current stream still reads it."""
    if isinstance(result, torch.Tensor):
        result.record_stream(stream)
    elif isinstance(result, (tuple, list)):
        for r in result:
            _record_stream(r, stream)
