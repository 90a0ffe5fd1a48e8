"""Where one replayed step's device time goes: its operations' intervals, read from the torch
profiler's Chrome trace, laid out in time.

A kernel table sums each kernel's time; with side streams and programmatic dependent launch
that sum is not the step. The timeline adds what it leaves out: the span from the first
operation's start to the last one's end, the time some operation runs (the union of their
intervals), the kernel time spent beside another operation (on another stream, or a PDL
overlap), and the gaps where nothing runs (launch latency, a stream waiting on an event).

Under the profiler a replay whose side streams wait on events can show gaps the timed replay
does not have: on an H200 (2026-12-07) a Flash verify step of 16 x (1 + 3) tokens timed at
137.1 us spanned 220.9 us profiled, 69 us of it one gap before the first kernel of a stream
that waited on two others, while its operations ran for 138.6. Read such a timeline for its
order, streams, overlaps and kernel times; take the step's time from the timed replays.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from typing import Any

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
"""The Chrome trace categories of device operations (the profiler's CUPTI records)."""


@dataclass(frozen=True)
class Span:
    """One device operation: its name, its stream and its interval in us."""

    name: str
    stream: int
    start: float
    end: float

    @property
    def us(self) -> float:
        return self.end - self.start


def device_spans(trace: dict[str, Any]) -> list[Span]:
    """The device operations of a Chrome trace (``traceEvents`` of complete events whose
    category is one of :data:`DEVICE_CATEGORIES`), in start order."""
    spans = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or e.get("cat") not in DEVICE_CATEGORIES:
            continue
        start = float(e["ts"])
        spans.append(Span(str(e.get("name", "?")), _stream_of(e), start,
                          start + float(e["dur"])))
    return sorted(spans, key=lambda s: (s.start, s.end))


def _stream_of(event: dict[str, Any]) -> int:
    """A device operation's stream: its ``args.stream``, else the number in its ``tid`` (the
    trace's lane: an integer, or a string such as "stream 7"), else 0."""
    stream = event.get("args", {}).get("stream")
    if stream is None:
        digits = "".join(ch for ch in str(event.get("tid", "")) if ch.isdigit())
        return int(digits) if digits else 0
    return int(stream)


def busy_intervals(spans: list[Span]) -> list[tuple[float, float]]:
    """The union of the spans' intervals as disjoint (start, end) pairs in order."""
    merged: list[tuple[float, float]] = []
    for s in sorted(spans, key=lambda s: s.start):
        if merged and s.start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], s.end))
        else:
            merged.append((s.start, s.end))
    return merged


@dataclass(frozen=True)
class TimelineSummary:
    """us: first start to last end; the union of the intervals; the sum of the operations'
    times; the idle gaps between busy intervals (start, end, the name of the operation that
    ends each gap); and each stream's busy time, streams in order of first appearance."""

    span: float
    busy: float
    total: float
    gaps: list[tuple[float, float, str]]
    per_stream: dict[int, float]

    @property
    def idle(self) -> float:
        return self.span - self.busy

    @property
    def beside(self) -> float:
        """Operation time spent while another operation ran too."""
        return self.total - self.busy


def summarise(spans: list[Span]) -> TimelineSummary:
    """The :class:`TimelineSummary` of ``spans`` (none: all zeros)."""
    if not spans:
        return TimelineSummary(0.0, 0.0, 0.0, [], {})
    merged = busy_intervals(spans)
    gaps = []
    for (_, end), (nxt, _) in zip(merged, merged[1:], strict=False):
        starter = min((s for s in spans if s.start >= nxt), key=lambda s: s.start)
        gaps.append((end, nxt, starter.name))
    streams = dict.fromkeys(s.stream for s in sorted(spans, key=lambda s: s.start))
    per_stream = {st: _busy_time([s for s in spans if s.stream == st]) for st in streams}
    return TimelineSummary(merged[-1][1] - merged[0][0], _busy_time(spans),
                           sum(s.us for s in spans), gaps, per_stream)


def _busy_time(spans: list[Span]) -> float:
    """The length of the union of the spans' intervals."""
    return sum(b - a for a, b in busy_intervals(spans))


def short_name(name: str, width: int = 60) -> str:
    """A kernel's name without its return type, template arguments or parameter list."""
    n = name.removeprefix("void ")
    for mark in ("<", "("):
        if mark in n and not n.startswith(mark):
            n = n.split(mark, 1)[0]
    return n if len(n) <= width else n[:width - 3] + "..."


def timeline_markdown(spans: list[Span], title: str, rows: int = 60, largest_gaps: int = 3,
                      what: str = "one graph replay") -> str:
    """Markdown of a step's timeline (``what`` it is: one graph replay, one call): the
    summary with the ``largest_gaps`` longest idle gaps, then each operation (the first
    ``rows``) with its start and end relative to the first one's start, its time and its
    stream (s0 = the stream of the first operation, the others in order of first
    appearance)."""
    sm = summarise(spans)
    if not spans:
        return f"## {title}: no device operations in the trace\n"
    t0 = spans[0].start
    lanes = {st: i for i, st in enumerate(sm.per_stream)}
    gaps = sorted(sm.gaps, key=lambda g: g[0] - g[1])[:largest_gaps]
    lines = [f"## {title}: timeline of {what}", "",
             f"{len(spans)} device operations over {sm.span:.1f} us: something runs for "
             f"{sm.busy:.1f} us, nothing for {sm.idle:.1f} ({len(sm.gaps)} gaps); "
             f"{sm.total:.1f} us of operation time, {sm.beside:.1f} of it beside another "
             "operation (another stream, or a PDL overlap). Busy time per stream: "
             + ", ".join(f"s{lanes[st]} {t:.1f}" for st, t in sm.per_stream.items()) + "."]
    if gaps:
        lines.append("Largest gaps: " + "; ".join(
            f"{b - a:.1f} us at {a - t0:.1f} before `{short_name(n, 40)}`" for a, b, n in gaps)
            + ".")
    lines += ["", "| start | end | us | stream | operation |", "|---|---|---|---|---|"]
    lines += [f"| {s.start - t0:.1f} | {s.end - t0:.1f} | {s.us:.1f} | s{lanes[s.stream]} | "
              f"`{short_name(s.name)}` |" for s in spans[:rows]]
    if len(spans) > rows:
        lines.append(f"| | | | | ({len(spans) - rows} more) |")
    return "\n".join(lines) + "\n"


def trace_of(prof: Any) -> dict[str, Any]:
    """The Chrome trace of a finished ``torch.profiler.profile`` (through a temporary file:
    the profiler writes it only to a path)."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)
    finally:
        os.unlink(path)
