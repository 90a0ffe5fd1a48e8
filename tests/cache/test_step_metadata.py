"""A step's metadata: the decode fast paths (every count 1: plain Python for small steps, a
vectorised one from ``DECODE_NUMPY_WORK`` units of work) build exactly the buffer of the general
NumPy path, for every layer type's rings and any positions, padded or not."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4.cache import step as step_module
from dsv4.cache.pool import RingSpec
from dsv4.cache.step import _decode_metadata, _padded, _step_metadata

SPECS = {  # the rings of each layer type (main compressor, indexer compressor)
    0: [],
    4: [("compressed", RingSpec(4, 2, 1024)), ("idx_keys", RingSpec(4, 2, 256))],
    128: [("compressed", RingSpec(128, 1, 1024))],
}


@settings(max_examples=150, deadline=None)
@given(ratio=st.sampled_from([0, 4, 128]),
       starts=st.lists(st.integers(0, 3000), min_size=1, max_size=9))
def test_decode_metadata_equals_the_general_path(ratio, starts):
    # positions just below, at and after entry boundaries are the interesting ones
    starts = [a if a % 2 else a - a % 128 + 127 for a in starts]
    slots = list(range(len(starts)))[::-1]
    counts = [1] * len(starts)
    fast = _decode_metadata(starts, slots, counts, SPECS[ratio])
    general = _step_metadata(starts, slots, counts, SPECS[ratio])
    assert torch.equal(fast[0], general[0])
    assert fast[1:3] == general[1:3]
    assert torch.equal(fast[3], general[3])


@pytest.mark.parametrize("ratio", [4, 128])
def test_a_completing_decode_token_reads_its_sources_from_the_ring_and_itself(ratio):
    coff = 2 if ratio == 4 else 1
    a = 5 * ratio - 1  # completes entry 4
    host, shapes, meta, _ = _decode_metadata([a, 2], [2, 0], [1, 1], SPECS[ratio][:1])
    parts = torch.split(host, [int(torch.tensor(s).prod()) for s in shapes])
    slots_e, entries, ring_src, call_src = parts[2], parts[3], parts[4], parts[5]
    cr = coff * ratio
    assert meta == [("compressed", 1, 2)] and slots_e.tolist() == [2] and entries.tolist() == [4]
    assert call_src.tolist() == [-1] * (cr - 1) + [0]  # the last source: this step's row 0
    first = (4 - coff + 1) * ratio
    assert ring_src.tolist() == [2 * cr + q % cr for q in range(first, a)] + [-1]


def test_a_padded_decode_step_keeps_the_real_parts_and_pads_in_the_padding_slot():
    """A padded step (CUDA-graph buckets): the real tokens' and jobs' metadata as unpadded,
    then padded tokens at position 0 of the padding slot and unused jobs there, reading the
    step's first raw row; every part at its fixed size."""
    starts, slots, pad, t = [7, 11, 2], [2, 0, 1], 9, 5
    for ratio in (4, 128):
        cr = SPECS[ratio][0][1].rows
        full, shapes, meta, seq = _decode_metadata(starts, slots, [1] * 3, SPECS[ratio], t, pad)
        real, rshapes, rmeta, _ = _decode_metadata(starts, slots, [1] * 3, SPECS[ratio])
        sizes = [int(torch.tensor(s).prod()) for s in shapes]
        parts = torch.split(full, sizes)
        rparts = torch.split(real, [int(torch.tensor(s).prod()) for s in rshapes])
        assert parts[0].tolist() == starts + [0, 0] and parts[1].tolist() == slots + [pad] * 2
        assert seq.tolist() == [0, 1, 2, -1, -1]
        for k, (_name, e, kk) in enumerate(meta):
            (_, e_real, _) = rmeta[k]
            base = 2 + 6 * k
            assert (e, kk) == (t, t) and shapes[base + 2] == (t, cr)
            j_slots, entries, ring_src, call_src, keep_dst, keep_src = parts[base:base + 6]
            r = rparts[base:base + 6]
            assert j_slots[:e_real].tolist() == r[0].tolist()
            assert j_slots[e_real:].tolist() == [pad] * (t - e_real)
            assert entries[:e_real].tolist() == r[1].tolist()
            assert ring_src[e_real * cr:].tolist() == [-1] * (cr * (t - e_real))
            assert call_src[e_real * cr:].tolist() == [0] * (cr * (t - e_real))
            assert keep_dst.tolist() == r[4].tolist() + [pad * cr] * 2
            assert keep_src.tolist() == [0, 1, 2, 0, 0]
        # one padding rule: the decode fast path's buffer is the general path's, padded
        general, gshapes, gmeta, gseq = _padded(
            _step_metadata(starts, slots, [1] * 3, SPECS[ratio]), SPECS[ratio], t, 1, pad)
        assert torch.equal(full, general) and shapes == gshapes and meta == gmeta
        assert torch.equal(seq, gseq)


@settings(max_examples=60, deadline=None)
@given(ratio=st.sampled_from([0, 4, 128]), data=st.data())
def test_a_padded_verify_step_keeps_the_real_parts_at_fixed_sizes(ratio, data):
    """B sequences of up to Q tokens: every part of the unpadded step's metadata first, then
    padding, each part at B * Q tokens, B * ceil(Q / ratio) jobs, B * min(Q, ring rows) kept
    rows (the most a step of that shape can need)."""
    from dsv4.cache.step import build_metadata

    b, q = data.draw(st.sampled_from([(2, 2), (4, 4), (3, 8)]))
    m = data.draw(st.integers(1, b))
    counts = data.draw(st.lists(st.integers(1, q), min_size=m, max_size=m))
    starts = data.draw(st.lists(st.integers(0, 700), min_size=m, max_size=m))
    slots = list(range(m))
    specs = tuple(SPECS[ratio])
    real = build_metadata(starts, slots, counts, specs)
    padded = build_metadata(starts, slots, counts, specs, pad_to=(b, q), pad_slot=9)
    assert padded.tokens == b * q and padded.seq_ids[sum(counts):].eq(-1).all()
    assert (padded.query_bucket, real.query_bucket) == (q, None)  # the layout's, not counts'
    rp = torch.split(real.buffer, [int(torch.tensor(s).prod()) for s in real.shapes])
    pp = torch.split(padded.buffer, [int(torch.tensor(s).prod()) for s in padded.shapes])
    for k, (name, spec) in enumerate(specs):
        assert padded.jobs[k] == (name, b * -(-q // spec.ratio), b * min(q, spec.rows))
    for i, (r, p) in enumerate(zip(rp, pp, strict=True)):
        assert torch.equal(p[:r.numel()], r), i
    assert pp[1][sum(counts):].eq(9).all()  # padded tokens in the padding slot


@settings(max_examples=120, deadline=None)
@given(ratio=st.sampled_from([0, 4, 128]),
       starts=st.lists(st.integers(0, 3000), min_size=1, max_size=80),
       extra=st.integers(0, 50))
def test_both_decode_paths_build_the_general_paths_buffer(ratio, starts, extra):
    """Plain Python and the vectorised decode path, unpadded and padded by ``extra`` tokens,
    equal the general path's buffer (padded by its one rule)."""
    starts = [a if a % 3 else a - a % 128 + 127 for a in starts]
    m = len(starts)
    slots = list(range(m))[::-1]
    pad_slot = m + 5
    for pad_to in (None, m + extra):
        built = []
        for threshold in (10**9, 0):  # plain Python, then NumPy
            step_module.DECODE_NUMPY_WORK, saved = threshold, step_module.DECODE_NUMPY_WORK
            try:
                built.append(_decode_metadata(starts, slots, [1] * m, SPECS[ratio], pad_to,
                                              pad_slot))
            finally:
                step_module.DECODE_NUMPY_WORK = saved
        general = _step_metadata(starts, slots, [1] * m, SPECS[ratio])
        if pad_to is not None:
            general = _padded(general, SPECS[ratio], pad_to, 1, pad_slot)
        for got in built:
            assert torch.equal(got[0], general[0])
            assert got[1:3] == general[1:3]
            assert torch.equal(got[3], general[3])


def _metadata_by_definition(starts, slots, counts, specs):
    """The step's metadata position by position, from the module docstring's definitions (plain
    Python loops): what the vectorised builders must equal."""
    pos, tok_slot, seq_ids, begins = [], [], [], []
    for i, (a, s, n) in enumerate(zip(starts, slots, counts, strict=True)):
        begins.append(len(pos))
        pos += range(a, a + n)
        tok_slot += [s] * n
        seq_ids += [i] * n
    flat, shapes, jobs = pos + tok_slot, [(len(pos),), (len(pos),)], []
    for name, spec in specs:
        r, cr, src = spec.ratio, spec.rows, spec.sources
        j_slot, j_entry, ring, call, keep_dst, keep_src = [], [], [], [], [], []
        for a, s, n, b in zip(starts, slots, counts, begins, strict=True):
            for j in range(a // r, (a + n) // r):  # the entries this step completes
                j_slot.append(s)
                j_entry.append(j)
                for q in range((j - spec.coff + 1) * r, (j - spec.coff + 1) * r + src):
                    ring.append(s * cr + q % cr if 0 <= q < a else -1)  # before the step
                    call.append(b + q - a if q >= a else -1)  # this step's row
            for q in range(max(a, a + n - cr), a + n):  # the ring keeps the last cr positions
                keep_dst.append(s * cr + q % cr)
                keep_src.append(b + q - a)
        e = len(j_entry)
        flat += j_slot + j_entry + ring + call + keep_dst + keep_src
        shapes += [(e,), (e,), (e, src), (e, src), (len(keep_dst),), (len(keep_dst),)]
        jobs.append((name, e, len(keep_dst)))
    return flat, shapes, jobs, seq_ids


@settings(max_examples=300, deadline=None)
@given(layer=st.sampled_from(["C4", "C128", "SWA", "rollback"]),
       steps=st.lists(st.tuples(st.integers(0, 1100), st.integers(0, 300)), min_size=1,
                      max_size=6),
       at_block=st.booleans())
def test_the_general_path_is_the_definition(layer, steps, at_block):
    """Any step - one sequence (a prefill step's scalar path) or several, tokens from 0 to 300
    each, starts just before entry boundaries or anywhere, rings holding rollback history
    (rows not a power of two) - builds exactly the metadata of the definition."""
    specs = {"C4": SPECS[4], "C128": SPECS[128], "SWA": SPECS[0],
             "rollback": [("compressed", RingSpec(4, 2, 1024, 3)),
                          ("idx_keys", RingSpec(4, 2, 256, 5)),
                          ("c128", RingSpec(128, 1, 1024, 7))]}[layer]
    starts = [a - a % 128 + 127 if at_block else a for a, _ in steps]
    counts = [n for _, n in steps]
    slots = [(7 * i + 3) % 11 for i in range(len(steps))]
    host, shapes, jobs, seq_ids = _step_metadata(starts, slots, counts, specs)
    flat, want_shapes, want_jobs, want_ids = _metadata_by_definition(starts, slots, counts, specs)
    assert host.tolist() == flat
    assert (shapes, jobs, seq_ids.tolist()) == (want_shapes, want_jobs, want_ids)
