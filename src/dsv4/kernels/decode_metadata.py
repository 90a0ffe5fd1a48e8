"""A padded decode step's metadata written on the device from its seed, in one launch.

A padded one-token step (``pad_to`` = (B, 1): the decode runner's buckets, and through the
layer's own runner every plain decode call on the ``cuda`` platform) has metadata of fixed shapes
whose values are functions of two things per sequence: its length (the token's position) and
its slot (:mod:`dsv4.cache.step`, :func:`~dsv4.cache.step.build_metadata`). Built on the host
it is Python work that grows with B and the compressors' sources (a C128 job row holds 128 of
them) on every step; here the host uploads a *seed* - the B positions, each metadata group's B
slots, and a table of what to write where - and :func:`expand_decode_metadata` writes every
part from it, so that a step graph that starts with this launch replays on a seed alone.

The seed, int64, at ``seed_at`` of the buffer the metadata lives in (:func:`decode_seed` builds
it):

* ``[B]`` positions, the padded sequences' 0;
* per group ``[B]`` slots, the padded sequences' the group's padding slot;
* per section a row of :data:`SECTION_FIELDS`: kind 0 writes a group's ``pos`` and ``tok_slot``
  at ``out``; kind 1 writes one compressor's job parts at ``out`` (``slots``, ``entries``,
  ``ring_src``, ``call_src`` of B job rows, then ``keep_dst``, ``keep_src`` of B tokens).

What each part holds is :func:`~dsv4.cache.step.build_metadata`'s contract: the same values,
bit for bit (the tests compare the two), the completing sequences' job rows first in sequence
order (a prefix sum inside the program), the unused rows and the padded tokens written with the
padding values of :func:`dsv4.cache.step._job_padding`. A real sequence never sits in the
padding slot, which is how the program tells it from a padded one.

A program per section and slice of its sources; nothing is read back and every shape comes
from the host's arguments, so the launch can be captured. Triton is imported guarded: this
module imports without it.
"""

from __future__ import annotations

from array import array

import torch

from dsv4.kernels.bound_launch import launch
from dsv4.kernels.launch import _INTERPRET, pdl_args, triton_available

__all__ = ["SECTION_FIELDS", "decode_metadata_usable", "decode_seed", "expand_decode_metadata",
           "seed_usable"]

SECTION_FIELDS = ("kind", "out", "slots_at", "rows", "sources", "ratio", "coff", "pad_slot")
"""One row of the seed's section table (int64 each): what a program writes (0: positions and
slots, 1: a compressor's jobs), where (``out``: offset in the buffer), whose slots it reads
(``slots_at``), the compressor's ring rows, sources, ratio and overlap (kind 1), and the
group's padding slot."""

POS, JOBS = 0, 1


def decode_metadata_usable(device: torch.device) -> bool:
    """Whether the kernel runs on ``device``: a CUDA device with Triton, or any device under
    Triton's CPU interpreter (elsewhere :func:`expand_decode_metadata` reads the seed back and
    writes the host's values)."""
    return triton_available() and (device.type == "cuda" or _INTERPRET)


def seed_usable(device: torch.device) -> bool:
    """Whether a step on ``device`` may leave its metadata to :func:`expand_decode_metadata`:
    where the kernel runs, or off CUDA (no graph captures the read-back there). A CUDA device
    without Triton builds its metadata on the host: its graphs could not capture a read-back."""
    return decode_metadata_usable(device) or device.type != "cuda"


def decode_seed(starts: list[int], b: int, groups: list[tuple[list[int], int]],
                sections: list[tuple[int, ...]]) -> torch.Tensor:
    """The seed (module docstring) of a padded step of ``b`` sequences: ``starts`` the real
    sequences' lengths, ``groups`` each metadata group's (slots, padding slot), ``sections``
    the table's rows (:data:`SECTION_FIELDS`). A host int64 tensor."""
    pads = b - len(starts)
    flat = list(starts) + [0] * pads
    for slots, pad_slot in groups:
        flat += slots
        flat += [pad_slot] * pads
    for row in sections:
        flat += row
    # through an int64 array: torch.tensor of a Python list costs ~4x as much host time
    return torch.frombuffer(array("q", flat), dtype=torch.int64)


def expand_decode_metadata(buffer: torch.Tensor, seed_at: int, table_at: int, sections: int,
                           b: int, sources: int) -> None:
    """Write the metadata of a padded decode step of ``b`` sequences into ``buffer`` (int64,
    1-D) from its seed at ``seed_at`` (positions) and ``table_at`` (``sections`` rows of
    :data:`SECTION_FIELDS`); ``sources``: the most sources of a compressor section (0: none).
    One launch where :func:`decode_metadata_usable`; elsewhere the host's builder on the seed
    read back (:func:`_expand_torch`), which a CUDA graph cannot capture
    (:func:`seed_usable`)."""
    if buffer.dtype != torch.int64 or buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError(f"expand_decode_metadata: buffer must be a contiguous 1-D int64 tensor, "
                         f"got {buffer.dtype} {tuple(buffer.shape)}")
    if not decode_metadata_usable(buffer.device):
        _expand_torch(buffer, seed_at, table_at, sections, b)
        return
    kb = source_block(b, sources)
    launch(_expand_kernel, (sections, _pow2(max(sources, 1)) // kb), buffer, seed_at, table_at,
           B=_pow2(b), REAL_B=b, KB=kb, num_warps=4, **pdl_args(buffer.device))


def source_block(b: int, sources: int) -> int:
    """Sources of every job row one program writes: a [B, KB] tile of at most 512 values (4
    int64 a thread of the 4 warps: no spill in the sm_90 compile), at most the sources (a power
    of two); a C128 section of 128 sequences takes 32 programs."""
    return max(1, min(_pow2(max(sources, 1)), 512 // _pow2(b)))


def _expand_torch(buffer: torch.Tensor, seed_at: int, table_at: int, sections: int,
                  b: int) -> None:
    """The kernel's writes where it does not run (the CPU's padded runner steps): the seed and
    the table read back, each section's parts taken from the host's own builder
    (:func:`~dsv4.cache.step.build_metadata`) of the step the seed describes, copied in."""
    from dsv4.cache.pool import RingSpec
    from dsv4.cache.step import build_metadata

    table = buffer[table_at:table_at + 8 * sections].view(sections, 8).tolist()
    starts = buffer[seed_at:seed_at + b].tolist()
    for kind, out, slots_at, rows, src, ratio, coff, pad_slot in table:
        slots = buffer[slots_at:slots_at + b].tolist()
        m = slots.index(pad_slot) if pad_slot in slots else b  # the real sequences first
        specs = () if kind == POS else (("jobs", RingSpec(ratio, coff, 0, rows - src)),)
        host = build_metadata(starts[:m], slots[:m], [1] * m, specs, (b, 1), pad_slot).buffer
        assert host is not None
        part = host[:2 * b] if kind == POS else host[2 * b:]  # after the positions and slots
        buffer[out:out + part.numel()] = part.to(buffer.device)


def _pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


if triton_available():
    import triton
    import triton.language as tl

    from dsv4.kernels.launch import let_next_kernel_launch, wait_for_prior_kernel

    @triton.jit
    def _expand_kernel(buf, seed_at, table_at, B: tl.constexpr, REAL_B: tl.constexpr,
                       KB: tl.constexpr, PDL: tl.constexpr):
        """Program (section, c): section's row of the table; c: its sources c * KB ..
        (c + 1) * KB - 1 of every job row (c = 0 also writes the parts of B values)."""
        wait_for_prior_kernel(PDL)
        row = buf + table_at + tl.program_id(0) * 8
        kind = tl.load(row)
        out = tl.load(row + 1)
        slots_at = tl.load(row + 2)
        cr = tl.load(row + 3)
        src = tl.load(row + 4)
        ratio = tl.load(row + 5)
        coff = tl.load(row + 6)
        pad_slot = tl.load(row + 7)
        chunk = tl.program_id(1)
        i = tl.arange(0, B)
        held = i < REAL_B
        a = tl.load(buf + seed_at + i, mask=held, other=0)
        s = tl.load(buf + slots_at + i, mask=held, other=0)
        if kind == 0:
            if chunk == 0:
                tl.store(buf + out + i, a, mask=held)
                tl.store(buf + out + REAL_B + i, s, mask=held)
        else:
            real = held & (s != pad_slot)
            done = real & ((a + 1) % ratio == 0)
            flag = done.to(tl.int64)
            job = tl.cumsum(flag, 0) - flag  # the completing sequences' rows, in order
            count = tl.sum(flag, 0)
            unused = held & (i >= count)
            # [slots B][entries B][ring_src B x src][call_src B x src][keep_dst B][keep_src B]
            ring_at = buf + out + 2 * REAL_B
            call_at = ring_at + REAL_B * src
            keep_at = call_at + REAL_B * src
            if chunk == 0:
                tl.store(buf + out + job, s, mask=done)
                tl.store(buf + out + i, pad_slot, mask=unused)
                tl.store(buf + out + REAL_B + job, a // ratio, mask=done)
                tl.store(buf + out + REAL_B + i, 0, mask=unused)
                tl.store(keep_at + i, s * cr + a % cr, mask=held)
                tl.store(keep_at + REAL_B + i, tl.where(real, i, 0), mask=held)
            k = chunk * KB + tl.arange(0, KB)[None, :]
            a2 = a[:, None]
            q = ((a // ratio - coff + 1) * ratio)[:, None] + k
            ring = tl.where((q >= 0) & (q < a2), s[:, None] * cr + q % cr, -1)
            call = tl.where(q >= a2, i[:, None] + q - a2, -1)
            cols = k < src
            at_job = job[:, None] * src + k
            at_row = i[:, None] * src + k
            tl.store(ring_at + at_job, ring, mask=done[:, None] & cols)
            tl.store(ring_at + at_row, -1, mask=unused[:, None] & cols)
            tl.store(call_at + at_job, call, mask=done[:, None] & cols)
            tl.store(call_at + at_row, 0, mask=unused[:, None] & cols)
        let_next_kernel_launch(PDL)
