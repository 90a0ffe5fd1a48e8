"""Flat store rows of a decode step in one Triton launch (the block-table lookup of
:meth:`dsv4.cache.store.PagedStore.flat_rows`).

A paged store keeps row i of a sequence in logical block ``i // B`` at offset ``i % B``; the
sequence slot's block table maps the logical block to a physical one (-1: not held), and the
flat row is ``physical * B + i % B``, or -1 where ``i < 0`` or the block is not held. In PyTorch
that is ~6 small ops for a given [T, k] row tensor, and ~20 for a step's window (the rows
``pos - window + 1 .. pos`` built first). Here one program per query writes its k flat rows:

* :func:`window_flat_rows`: the window rows ``pos - window + 1 .. pos`` of each query, oldest
  first, computed in the kernel (what :meth:`dsv4.cache.step.CacheStep.window_rows` returns);
* :func:`entry_flat_rows`: given row indices [T, k] (e.g. the indexer's selected entries, -1
  pads), their flat rows (:meth:`~dsv4.cache.step.CacheStep.entry_rows`);
* :func:`visible_entry_rows`: the selection of every compressed entry each query sees, ``j <
  (pos + 1) // ratio`` ascending, -1 padded to the step's widest (ratio-128 layers, and C4
  steps whose indexer would take them all; ~5 small PyTorch ops), and its flat rows, in one
  launch;
* it, and :func:`entry_and_window_rows` (the entry rows of given indices), can also write the
  kv store's window rows in the same launch (a second column of programs).

Both are exact (integer arithmetic), write int64 - or int32 (``dtype=torch.int32``), what the
attention kernels (ours and FlashMLA's) read, which saves their cast launch per index tensor
(stores of at most 2^31 - 1 rows) - never sync with the host, and allocate only their output,
so a step that calls them can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from dsv4.cache.store import PagedStore
from dsv4.kernels.bound_launch import launch
from dsv4.kernels.launch import _INTERPRET, pdl_args, triton_available

__all__ = ["entry_and_window_rows", "entry_flat_rows", "paged_rows_usable",
           "visible_entry_rows", "window_flat_rows"]

ROWS_PER_ITER = 256
"""Rows a program handles per loop iteration."""


def paged_rows_usable(device: torch.device) -> bool:
    """Whether the kernels run on ``device`` (Triton on a CUDA device, or its CPU interpreter)."""
    return triton_available() and (device.type == "cuda" or _INTERPRET)


if triton_available():
    import triton
    import triton.language as tl

    from dsv4.kernels.launch import let_next_kernel_launch, wait_for_prior_kernel

    if _INTERPRET:
        from dsv4.kernels._interpreter import patch_interpreter_index

        patch_interpreter_index()

    @triton.jit
    def _flat_rows_kernel(pos_ptr, slot_ptr, rows_ptr, rows_stride, table_ptr, table_stride,
                          out_ptr, out_stride, K, B, MAX_LOGICAL,
                          WINDOW: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
                          RATIO: tl.constexpr = 0, table2_ptr=None, table2_stride=0,
                          out2_ptr=None, out2_stride=0, K2=0, B2=0, MAX_LOGICAL2=0,
                          WIN2: tl.constexpr = False, BLOCK2: tl.constexpr = 0):
        """Row t's K flat rows: of the window (WINDOW), of every visible entry (RATIO > 0: j
        where j < (pos + 1) // RATIO, else -1, also written to ``rows``) or of the given rows.
        With WIN2, programs (t, 1) write row t's K2-row window of a second store (table2, B2)
        to ``out2`` instead: the kv store's window beside the compressed store's entries."""
        wait_for_prior_kernel(PDL)
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if WIN2:
            if tl.program_id(1) == 1:
                _flat_rows_of(pos_ptr, t, slot, rows_ptr, rows_stride, table2_ptr,
                              table2_stride, out2_ptr, out2_stride, K2, B2, MAX_LOGICAL2, True,
                              BLOCK2, 0)
            else:
                _flat_rows_of(pos_ptr, t, slot, rows_ptr, rows_stride, table_ptr, table_stride,
                              out_ptr, out_stride, K, B, MAX_LOGICAL, WINDOW, BLOCK, RATIO)
        else:
            _flat_rows_of(pos_ptr, t, slot, rows_ptr, rows_stride, table_ptr, table_stride,
                          out_ptr, out_stride, K, B, MAX_LOGICAL, WINDOW, BLOCK, RATIO)
        let_next_kernel_launch(PDL)

    @triton.jit
    def _flat_rows_of(pos_ptr, t, slot, rows_ptr, rows_stride, table_ptr, table_stride,
                      out_ptr, out_stride, K, B, MAX_LOGICAL, WINDOW: tl.constexpr,
                      BLOCK: tl.constexpr, RATIO: tl.constexpr):
        # the window's oldest position; given rows read no position
        first = tl.load(pos_ptr + t) - K + 1 if WINDOW else 0
        if RATIO > 0:
            seen = (tl.load(pos_ptr + t).to(tl.int64) + 1) // RATIO
        lanes = tl.arange(0, BLOCK)
        for c in range(0, K, BLOCK):
            offs = c + lanes
            m = offs < K
            if WINDOW:
                row = first + offs
            elif RATIO > 0:
                row = tl.where(offs < seen, offs.to(tl.int64), -1)
                tl.store(rows_ptr + t.to(tl.int64) * rows_stride + offs, row, mask=m)
            else:
                row = tl.load(rows_ptr + t.to(tl.int64) * rows_stride + offs, mask=m,
                              other=-1).to(tl.int64)
            logical = tl.minimum(tl.maximum(row, 0) // B, MAX_LOGICAL - 1)
            phys = tl.load(table_ptr + slot * table_stride + logical, mask=m, other=-1)
            phys = phys.to(tl.int64)
            flat = tl.where((row >= 0) & (phys >= 0), phys * B + row % B, -1)
            tl.store(out_ptr + t.to(tl.int64) * out_stride + offs,
                     flat.to(out_ptr.dtype.element_ty), mask=m)


FLAT_ROW_DTYPES = (torch.int64, torch.int32)


def _table(store: PagedStore, dtype: torch.dtype) -> torch.Tensor:
    """The store's device block table, checked for the kernel; and that its rows fit dtype."""
    capacity = store.alloc.num_blocks * store.block_size
    if dtype == torch.int32 and capacity > torch.iinfo(torch.int32).max:
        raise ValueError(f"{store.name} store: {capacity} rows do not fit int32 flat rows")
    table = store.table_dev
    if table.dtype != torch.int32 or table.stride(1) != 1:
        raise ValueError(f"{store.name} store: the device block table must be int32 with "
                         f"contiguous rows, got {table.dtype} strides {tuple(table.stride())}")
    return table


def _block(k: int) -> int:
    return min(ROWS_PER_ITER, max(16, 1 << (max(k, 1) - 1).bit_length()))


def _launch(store: PagedStore, pos: torch.Tensor, slots: torch.Tensor,
            rows: torch.Tensor | None, k: int, dtype: torch.dtype, ratio: int = 0,
            window: tuple[PagedStore, int] | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(flat rows, and with ``window`` = (store, W) the W-row window rows of that store)."""
    if not paged_rows_usable(pos.device):
        raise RuntimeError("the paged-rows kernel needs Triton and a CUDA device (or "
                           "TRITON_INTERPRET=1); use PagedStore.flat_rows elsewhere")
    if dtype not in FLAT_ROW_DTYPES:
        raise ValueError(f"dtype={dtype}: flat rows are int64 or int32")
    t = slots.shape[0]
    out = torch.empty(t, k, dtype=dtype, device=slots.device)
    out2 = None
    if window is not None:
        if window[1] < 1:
            raise ValueError(f"window must be >= 1, got {window[1]}")
        out2 = torch.empty(t, window[1], dtype=dtype, device=slots.device)
    if t == 0 or (k == 0 and window is None):
        return out, out2
    extra: dict = {}
    if window is not None:
        assert out2 is not None
        wstore, w = window
        table2 = _table(wstore, dtype)
        extra = dict(table2_ptr=table2, table2_stride=table2.stride(0), out2_ptr=out2,
                     out2_stride=out2.stride(0), K2=w, B2=wstore.block_size,
                     MAX_LOGICAL2=wstore.max_logical, WIN2=True, BLOCK2=_block(w))
    table = _table(store, dtype)
    rows_arg = rows if rows is not None else out  # not read when WINDOW; written with RATIO
    launch(_flat_rows_kernel, (t, 2 if window is not None else 1),
        pos, slots, rows_arg, rows_arg.stride(0), table, table.stride(0), out, out.stride(0),
        k, store.block_size, store.max_logical, WINDOW=rows is None, BLOCK=_block(k),
        num_warps=4, RATIO=ratio, **extra, **pdl_args(pos.device))
    return out, out2


def window_flat_rows(store: PagedStore, pos: torch.Tensor, slots: torch.Tensor, window: int,
                     dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """[T, window] flat rows (int64, or ``dtype`` int32) of positions ``pos - window + 1 ..
    pos`` (oldest first) of each query's sequence (slot ``slots`` [T], position ``pos`` [T],
    int64, on the store's device); -1 before position 0 or where the block is not held."""
    if pos.shape != slots.shape or pos.dim() != 1:
        raise ValueError(f"pos {tuple(pos.shape)} and slots {tuple(slots.shape)} must be the "
                         "same [T]")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    return _launch(store, pos, slots, None, window, dtype)[0]


def visible_entry_rows(store: PagedStore, pos: torch.Tensor, slots: torch.Tensor, n: int,
                       ratio: int, dtype: torch.dtype = torch.int64,
                       window: tuple[PagedStore, int] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(entries, flat rows, window rows) in one launch: the entries ``j < (pos + 1) // ratio``
    ascending, -1 after, [T, n] int64 (``n`` the step's most visible entries; the values of
    ``dsv4.attention._every_visible_entry``), their :func:`entry_flat_rows` in ``store``
    (int64, or ``dtype`` int32) for the queries' sequences (slots ``slots`` [T]) and, with
    ``window`` = (kv store, W), :func:`window_flat_rows` of that store (else None) - the
    values of the separate launches."""
    if pos.shape != slots.shape or pos.dim() != 1:
        raise ValueError(f"pos {tuple(pos.shape)} and slots {tuple(slots.shape)} must be the "
                         "same [T]")
    if n < 0 or ratio < 1:
        raise ValueError(f"n >= 0 and ratio >= 1, got n={n}, ratio={ratio}")
    entries = torch.empty(pos.shape[0], n, dtype=torch.long, device=pos.device)
    rows, win = _launch(store, pos, slots, entries, n, dtype, ratio, window)
    return entries, rows, win


def entry_flat_rows(store: PagedStore, rows: torch.Tensor, slots: torch.Tensor,
                    dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """[T, k] flat rows (int64, or ``dtype`` int32) of row indices ``rows`` [T, k] (any int
    dtype, -1 pads kept) of each query's sequence (slot ``slots`` [T])."""
    if rows.dim() != 2 or slots.dim() != 1 or rows.shape[0] != slots.shape[0]:
        raise ValueError(f"rows {tuple(rows.shape)} must be [T, k] for slots "
                         f"{tuple(slots.shape)} [T]")
    if rows.shape[1] and rows.stride(1) != 1:
        rows = rows.contiguous()
    # no positions read: slots stand in
    return _launch(store, slots, slots, rows, rows.shape[1], dtype)[0]


def entry_and_window_rows(store: PagedStore, rows: torch.Tensor, pos: torch.Tensor,
                          slots: torch.Tensor, window: tuple[PagedStore, int],
                          dtype: torch.dtype = torch.int64) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`entry_flat_rows` ``(store, rows, slots)`` and :func:`window_flat_rows` of
    ``window`` = (kv store, W) at positions ``pos`` in one launch: the same values."""
    if rows.dim() != 2 or pos.shape != slots.shape or slots.dim() != 1 \
            or rows.shape[0] != slots.shape[0]:
        raise ValueError(f"rows {tuple(rows.shape)} must be [T, k] for pos {tuple(pos.shape)} "
                         f"and slots {tuple(slots.shape)} [T]")
    if rows.shape[1] and rows.stride(1) != 1:
        rows = rows.contiguous()
    flat, win = _launch(store, pos, slots, rows, rows.shape[1], dtype, 0, window)
    assert win is not None
    return flat, win
