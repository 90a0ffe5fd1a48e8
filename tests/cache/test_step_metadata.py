"""A step's metadata: the decode fast path (every count 1, plain Python) builds exactly the
buffer of the general NumPy path, for every layer type's rings and any positions."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4.cache.pool import RingSpec
from dsv4.cache.step import CacheStep, _decode_metadata, _step_metadata

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


def _steps_equal(a, b) -> None:
    assert torch.equal(a.pos, b.pos) and torch.equal(a.tok_slot, b.tok_slot)
    assert torch.equal(a.pos_host, b.pos_host) and torch.equal(a.tok_seq_host, b.tok_seq_host)
    assert a.jobs.keys() == b.jobs.keys()
    for name, job in a.jobs.items():
        other = b.jobs[name]
        assert job.count == other.count
        for f in ("slots", "entries", "ring_src", "call_src", "keep_dst", "keep_src"):
            assert torch.equal(getattr(job, f), getattr(other, f)), (name, f)


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_layers_planning_the_same_step_share_its_metadata(tiny, make_layer, ratio):
    """Two layers' pools holding the same sequences at the same lengths (a model's layers) plan
    one step: the second takes the first's device metadata (the same tensors); a pool whose
    slots differ, a step of other lengths and a forgotten one build their own - all equal to a
    plan made from scratch."""
    from dsv4.cache.step import forget_uploaded_metadata

    layers = [make_layer(tiny, ratio) for _ in range(3)]
    pools = [lay.new_cache_pool(4, 512) for lay in layers]
    pools[2].add_sequence()  # pool 2: slot 0 taken first, its sequences in slots 1 .. 3
    seqs = [[p.add_sequence() for _ in range(3)] for p in pools]
    for p, s in zip(pools, seqs, strict=True):
        CacheStep.plan(p, s, [5, 9, 3]).commit()
    forget_uploaded_metadata()
    a = CacheStep.plan(pools[0], seqs[0], [1, 1, 1])
    b = CacheStep.plan(pools[1], seqs[1], [1, 1, 1])
    assert b.pos is a.pos and b.tok_slot is a.tok_slot
    assert all(b.jobs[n].keep_dst is a.jobs[n].keep_dst for n in a.jobs)
    c = CacheStep.plan(pools[2], seqs[2], [1, 1, 1])  # other slots: its own
    assert c.pos is not a.pos and not torch.equal(c.tok_slot, a.tok_slot)
    forget_uploaded_metadata()
    fresh = CacheStep.plan(pools[1], seqs[1], [1, 1, 1])
    assert fresh.pos is not a.pos
    _steps_equal(b, fresh)
    a.commit()
    later = CacheStep.plan(pools[0], seqs[0], [1, 1, 1])  # one position on: not the old metadata
    assert later.pos is not a.pos and torch.equal(later.pos, a.pos + 1)
    forget_uploaded_metadata()
    _steps_equal(later, CacheStep.plan(pools[0], seqs[0], [1, 1, 1]))


def test_interleaved_layer_types_each_share_their_own(tiny, make_layer):
    """A model's layers alternate types (C4, C128, C4, C128, SWA): each layer takes the
    metadata of the last layer of its own type, not evicted by the types between."""
    from dsv4.cache.step import forget_uploaded_metadata

    ratios = [4, 128, 4, 128, 0, 0]
    pools = [make_layer(tiny, r).new_cache_pool(2, 512) for r in ratios]
    seqs = [[p.add_sequence() for _ in range(2)] for p in pools]
    for p, s in zip(pools, seqs, strict=True):
        CacheStep.plan(p, s, [7, 130]).commit()
    forget_uploaded_metadata()
    steps = [CacheStep.plan(p, s, [1, 1]) for p, s in zip(pools, seqs, strict=True)]
    assert steps[2].pos is steps[0].pos and steps[3].pos is steps[1].pos
    assert steps[5].pos is steps[4].pos
    assert steps[1].pos is not steps[0].pos and steps[4].pos is not steps[1].pos
    assert steps[0].jobs.keys() == {"compressed", "idx_keys"}
    assert steps[1].jobs.keys() == {"compressed"} and not steps[4].jobs


def test_sharing_can_be_turned_off(tiny, make_layer, monkeypatch):
    """``set_metadata_sharing(False)`` (or ``DSV4_SHARE_STEP_METADATA=0`` in a fresh process):
    every layer builds its own metadata, equal to the shared one; a bad value is refused."""
    import subprocess
    import sys

    from dsv4.cache import step as step_mod

    pools = [make_layer(tiny, 4).new_cache_pool(2, 256) for _ in range(2)]
    seqs = [[p.add_sequence() for _ in range(2)] for p in pools]
    prev = step_mod.set_metadata_sharing(False)
    try:
        assert prev is True
        a, b = (CacheStep.plan(p, s, [3, 1]) for p, s in zip(pools, seqs, strict=True))
        assert b.pos is not a.pos and not step_mod._last_uploaded
        _steps_equal(a, b)
    finally:
        step_mod.set_metadata_sharing(prev)
    with pytest.raises(TypeError):
        step_mod.set_metadata_sharing(0)
    code = "import dsv4.cache.step as s; print(s._SHARING)"
    for env, want in (("0", "False"), ("1", "True"), ("", "True")):
        monkeypatch.setenv("DSV4_SHARE_STEP_METADATA", env)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert out.stdout.strip() == want, out.stderr
    monkeypatch.setenv("DSV4_SHARE_STEP_METADATA", "yes")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode != 0 and "DSV4_SHARE_STEP_METADATA must be 0 or 1" in out.stderr
