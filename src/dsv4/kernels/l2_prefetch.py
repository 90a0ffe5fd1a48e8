"""Fetch weights into the GPU's L2 cache ahead of the kernel that reads them (one launch).

A decode step at short context alternates bandwidth-bound GEMMs with a stretch of small,
latency-bound kernels (RoPE, cache writes, flat rows, the attention at 512 entries) during
which the memory system idles: on the H200 the Flash C4 step at M = 1 spends ~40 us between
``wq_b``'s GEMM and ``wo_a``'s (session 30's profile) while ``wo_a`` alone needs ~8 us of
copy bandwidth. :func:`prefetch_to_l2` issues L2 prefetches for a list of byte regions (e.g.
``wo_a``'s and ``wo_b``'s fp8 weights) and returns: the fetches proceed in the background while
the next kernels run, and the GEMM then reads what has arrived from L2.

Nothing is written; the outputs of every kernel are unchanged (a prefetch moves no data into
registers). Modes (``mode=``), each one PTX instruction per lane:

* ``"bulk"``: ``cp.async.bulk.prefetch.L2.global`` (sm_90: the TMA unit fetches a whole chunk of
  ``chunk`` bytes per instruction), no cache hint;
* ``"bulk_last"``: the same with an ``evict_last`` L2 policy (``createpolicy.fractional``): the
  lines outlive the streaming kernels' ``evict_first`` reads in between;
* ``"lines"``: ``prefetch.global.L2::evict_last``, one 128-byte line per lane (sm_80+).

Regions: up to :data:`MAX_REGIONS` (start, bytes), fetched in order up to ``max_bytes`` in all;
whole chunks only (a tail shorter than a chunk is left out). The launch waits for the kernel
before it under programmatic dependent launch (:mod:`dsv4.kernels.launch`) - a kernel that did
not would let the one after it start before the one before it had finished - and lets the next
launch when its lanes have issued their instructions. Under Triton's CPU interpreter, and on
GPUs before sm_90, :func:`prefetch_to_l2` launches nothing and returns 0 (inline PTX does not
run there; the data is the same either way).

Whether it pays off is measured, not assumed: ``benchmarks/l2_probe.py`` (one GEMM cold, after
each mode's prefetch, and hot) and the decode-step bench's ``..._l2_pdl`` rows, timed with the
L2 scrubbed before each replay (``--cold-l2``), since a one-layer benchmark replayed in a loop
finds the last replay's lines in L2 where a model's next layer would not.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dsv4.kernels.launch import _INTERPRET, pdl_args, triton_available

__all__ = ["MAX_REGIONS", "MODES", "l2_bytes", "prefetch_to_l2", "prefetch_usable"]

MAX_REGIONS = 4
MODES = ("bulk", "bulk_last", "lines")
LINE = 128
"""Bytes per lane in the ``lines`` mode (an L2 line)."""
DEFAULT_CHUNK = 16384
"""Bytes per lane in the bulk modes."""
LANES = 128
"""Lanes (one instruction each) per program and loop iteration."""


def prefetch_usable(device: torch.device) -> bool:
    """Whether :func:`prefetch_to_l2` issues anything on ``device``: Triton compiling (not its
    interpreter) for a CUDA device of compute capability 9.0 or later."""
    if not triton_available() or _INTERPRET or device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index) >= (9, 0)


def l2_bytes(device: torch.device) -> int:
    """The L2 cache size of a CUDA ``device`` in bytes (0 elsewhere)."""
    if device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    return int(torch.cuda.get_device_properties(index).L2_cache_size)


if triton_available():
    import triton
    import triton.language as tl

    from dsv4.kernels.launch import let_next_kernel_launch, wait_for_prior_kernel

    @triton.jit
    def _issue(addr, size, live, MODE: tl.constexpr):
        """One prefetch instruction per lane where ``live`` (int32, nonzero) holds."""
        if MODE == 0:
            r = tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.s32 p, $3, 0; "
                "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
                "=r,l,r,r", [addr, size, live], dtype=tl.int32, is_pure=False, pack=1)
        elif MODE == 1:
            r = tl.inline_asm_elementwise(
                "{ .reg .pred p; .reg .b64 pol; setp.ne.s32 p, $3, 0; "
                "createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
                "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; "
                "mov.u32 $0, 0; }",
                "=r,l,r,r", [addr, size, live], dtype=tl.int32, is_pure=False, pack=1)
        else:
            r = tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.s32 p, $3, 0; "
                "@p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
                "=r,l,r,r", [addr, size, live], dtype=tl.int32, is_pure=False, pack=1)
        return r

    @triton.jit(do_not_specialize=["a0", "a1", "a2", "a3", "n0", "n1", "n2", "n3", "total"])
    def _l2_prefetch_kernel(sink_ptr, a0, n0, a1, n1, a2, n2, a3, n3, total,
                            CHUNK: tl.constexpr, LANES: tl.constexpr, MODE: tl.constexpr,
                            PDL: tl.constexpr = False):
        """Chunk c of the concatenated regions (region r: ``nr`` chunks from address ``ar``),
        up to ``total`` chunks; program p issues chunks p, p + P, p + 2P, ... (P programs), so
        every program has work once there are P chunks."""
        wait_for_prior_kernel(PDL)
        pid = tl.program_id(0)
        n_prog = tl.num_programs(0)
        lane = tl.arange(0, LANES)
        issued = tl.zeros([LANES], dtype=tl.int32)
        size = tl.full([LANES], CHUNK, tl.int32)
        e1 = n0 + n1
        e2 = e1 + n2
        for base in range(0, total, n_prog * LANES):
            c = (base + lane * n_prog + pid).to(tl.int64)
            addr = tl.where(c < n0, a0 + c * CHUNK,
                            tl.where(c < e1, a1 + (c - n0) * CHUNK,
                                     tl.where(c < e2, a2 + (c - e1) * CHUNK,
                                              a3 + (c - e2) * CHUNK)))
            live = (c < total).to(tl.int32)
            issued += _issue(addr, size, live, MODE)
        # the instructions' dummy results (0) stored where they are nonzero: never; keeps the
        # compiler from dropping the asm
        tl.store(sink_ptr + lane, issued, mask=issued != 0)
        let_next_kernel_launch(PDL)


_SINKS: dict[torch.device, torch.Tensor] = {}


def _sink(device: torch.device) -> torch.Tensor:
    sink = _SINKS.get(device)
    if sink is None:
        sink = _SINKS[device] = torch.zeros(LANES, dtype=torch.int32, device=device)
    return sink


def prefetch_to_l2(regions: Sequence[torch.Tensor], max_bytes: int | None = None, *,
                   mode: str = "bulk", chunk: int = DEFAULT_CHUNK,
                   programs: int | None = None) -> int:
    """Issue L2 prefetches for the bytes of ``regions`` (contiguous CUDA tensors, at most
    :data:`MAX_REGIONS`), in order, up to ``max_bytes`` in all (None: every byte), one launch
    on the current stream. Returns the bytes asked for (0 where nothing is issued: see
    :func:`prefetch_usable`, or ``max_bytes`` below one chunk). ``mode``: one of
    :data:`MODES`; ``chunk``: bytes per instruction in the bulk modes (a multiple of 16; the
    ``lines`` mode fetches 128-byte lines); ``programs``: the launch's programs (default: one
    per SM, fewer where there are fewer chunks)."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: expected one of {MODES}")
    if not regions:
        raise ValueError("prefetch_to_l2: no regions")
    if len(regions) > MAX_REGIONS:
        raise ValueError(f"prefetch_to_l2: {len(regions)} regions, at most {MAX_REGIONS}")
    size = LINE if mode == "lines" else chunk
    if size <= 0 or size % 16:
        raise ValueError(f"chunk={chunk}: must be a positive multiple of 16 bytes")
    if max_bytes is not None and max_bytes < 0:
        raise ValueError(f"max_bytes={max_bytes}: must be >= 0")
    device = regions[0].device
    for i, t in enumerate(regions):
        if t.device != device:
            raise ValueError(f"region {i} is on {t.device}, region 0 on {device}")
        if not t.is_contiguous():
            raise ValueError(f"region {i} ({tuple(t.shape)}) is not contiguous")
    if not prefetch_usable(device):
        return 0
    budget = (max_bytes if max_bytes is not None else sum(t.nbytes for t in regions)) // size
    addrs: list[int] = []
    counts: list[int] = []
    for t in regions:
        n = min(t.nbytes // size, budget - sum(counts))
        addrs.append(t.data_ptr())
        counts.append(n)
    total = sum(counts)
    if total == 0:
        return 0
    while len(addrs) < MAX_REGIONS:
        addrs.append(addrs[0])
        counts.append(0)
    if programs is None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        sms = torch.cuda.get_device_properties(index).multi_processor_count
        programs = min(sms, total)
    if programs < 1:
        raise ValueError(f"programs={programs}: must be >= 1")
    _l2_prefetch_kernel[(programs,)](
        _sink(device), addrs[0], counts[0], addrs[1], counts[1], addrs[2], counts[2], addrs[3],
        counts[3], total, CHUNK=size, LANES=LANES, MODE=MODES.index(mode), num_warps=4,
        **pdl_args(device))
    return total * size
