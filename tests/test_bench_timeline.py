"""The step timeline's arithmetic (dsv4.bench.timeline) on hand-made Chrome traces: the
profiler's export itself needs a GPU (the decode-step bench's --profile runs it there)."""

import json

import pytest

from dsv4.bench.timeline import (
    Span,
    busy_intervals,
    device_spans,
    short_name,
    summarise,
    timeline_markdown,
    trace_of,
)


def _event(name, stream, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": stream,
            "args": {"stream": stream}}


TRACE = {"traceEvents": [
    _event("void gemm<float>(int)", 7, 110.0, 20.0),       # s1, beside rope on s0
    _event("rope_kernel", 3, 100.0, 15.0),                 # s0 (first to start)
    _event("Memcpy HtoD", 3, 140.0, 2.0, "gpu_memcpy"),    # after a 10 us gap
    _event("attention", 3, 145.0, 5.0),                    # after a 3 us gap
    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 500.0},  # host: ignored
    {"ph": "i", "cat": "kernel", "name": "marker", "ts": 1.0},                  # not complete
]}


def test_device_spans_keeps_device_operations_in_start_order():
    spans = device_spans(TRACE)
    assert [s.name for s in spans] == ["rope_kernel", "void gemm<float>(int)", "Memcpy HtoD",
                                       "attention"]
    assert spans[1] == Span("void gemm<float>(int)", 7, 110.0, 130.0)


def test_stream_from_args_else_from_the_lane():
    lane_only = {"ph": "X", "cat": "kernel", "name": "k", "ts": 0.0, "dur": 1.0,
                 "tid": "stream 12"}
    unnamed = {"ph": "X", "cat": "gpu_memset", "name": "m", "ts": 2.0, "dur": 1.0}
    assert [s.stream for s in device_spans({"traceEvents": [lane_only, unnamed]})] == [12, 0]


def test_summary_counts_union_overlap_and_gaps():
    sm = summarise(device_spans(TRACE))
    assert sm.span == pytest.approx(50.0)            # 100 .. 150
    assert sm.busy == pytest.approx(30.0 + 2.0 + 5.0)  # 100..130, 140..142, 145..150
    assert sm.total == pytest.approx(42.0)
    assert sm.beside == pytest.approx(5.0)           # rope and gemm share 110..115
    assert sm.idle == pytest.approx(13.0)
    assert [(a, b, n) for a, b, n in sm.gaps] == [(130.0, 140.0, "Memcpy HtoD"),
                                                  (142.0, 145.0, "attention")]
    assert sm.per_stream == {3: pytest.approx(22.0), 7: pytest.approx(20.0)}


def test_busy_intervals_merge_touching_and_nested_spans():
    spans = [Span("a", 0, 0.0, 10.0), Span("b", 1, 2.0, 4.0), Span("c", 0, 10.0, 12.0),
             Span("d", 0, 20.0, 21.0)]
    assert busy_intervals(spans) == [(0.0, 12.0), (20.0, 21.0)]


def test_markdown_names_lanes_by_first_appearance_and_caps_rows():
    md = timeline_markdown(device_spans(TRACE), "flash C4", rows=3)
    assert "4 device operations over 50.0 us" in md
    assert "s0 22.0, s1 20.0" in md
    assert "| 10.0 | 30.0 | 20.0 | s1 | `gemm` |" in md
    assert "10.0 us at 30.0 before `Memcpy HtoD`" in md
    assert "(1 more)" in md
    assert "no device operations" in timeline_markdown([], "empty")
    one = timeline_markdown(device_spans(TRACE), "flash C4", largest_gaps=1, what="one call")
    assert "flash C4: timeline of one call" in one
    assert "Largest gaps: 10.0 us at 30.0 before `Memcpy HtoD`." in one  # only the longest


@pytest.mark.parametrize("name, short", [
    ("void at::native::elementwise_kernel<128, 2>(int, float)", "at::native::elementwise_kernel"),
    ("_fp8_gemm_kernel", "_fp8_gemm_kernel"),
    ("<unnamed>", "<unnamed>"),
])
def test_short_name(name, short):
    assert short_name(name) == short


def test_trace_of_reads_what_the_profiler_exports():
    class FakeProfile:
        def export_chrome_trace(self, path):
            with open(path, "w") as f:
                json.dump(TRACE, f)

    assert trace_of(FakeProfile()) == TRACE
