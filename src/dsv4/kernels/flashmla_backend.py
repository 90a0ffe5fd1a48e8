"""FlashMLA's sparse kernels behind :func:`dsv4.kernels.sparse_mqa.sparse_mqa`'s contract.

Wheel: ``sgl-flash-mla`` 1.0.0 (cp310-abi3, import name ``flash_mla``; two extensions loaded with
``torch.ops.load_library``: ``torch.ops.flash_mla`` = current kernels (V4.1 formats, SM100) and
``torch.ops.flash_mla_legacy`` = SM90 and the V3.2 / V4 formats; ``flash_mla.has_legacy()``).
On an H200 only the legacy kernels run (``use_legacy=True``).

Decode (``fmt="fp8_ds_mla"``): ``flash_mla.flash_mla_with_kvcache(q [b, s_q, h_q, 512] bf16,
k_cache [blocks, 64, 1, 584] fp8 view, None, None, 512, sched_meta, softmax_scale=scale,
indices=[b, s_q, topk] int32, attn_sink=[h_q] fp32, extra_k_cache=..., extra_indices_in_kvcache=
[b, s_q, extra_topk], use_legacy=True, kv_format="V4")`` -> (out [b, s_q, h_q, 512] bf16, lse).
The two index lists are two caches: the window rows go to ``k_cache`` / ``indices`` and the
compressed rows to ``extra_k_cache`` / ``extra_indices_in_kvcache``; the sink is ``attn_sink``
(denominator only, like ours). Indices are flat rows ``block * 64 + offset`` (our convention),
-1 = invalid (no upper-bound check: anything else must be in range). Constraints read from the
wheel: page block 64 rows, h_q 64 or 128, d 512, topk and extra_topk multiples of the kernel's
B_TOPK (we pad with -1 to a multiple of 128), indices rows 32-byte aligned, "each page block
contiguous", block stride a multiple of 576 bytes (its TMA row stride; the writer rounds
block_bytes up to a multiple of 576, as vLLM does), 16-byte aligned base. The "V4" byte layout is
exactly our ``fp8_ds_mla`` (576 data bytes per row, then the block's 8-byte scale groups), so
the store is passed as a strided [blocks, 64, 1, 584] view with no copy.
``sched_meta`` (``flash_mla.get_mla_metadata()[0]``) is filled on first use and cached here per
shape (:func:`_sched_meta`: not when that first use is inside a CUDA-graph capture, nor for
steps of more than :data:`SCHED_CACHE_MAX_TOKENS` queries).

Prefill (or a bf16 store): ``flash_mla.flash_mla_sparse_fwd(q [s_q, h_q, 512], kv [s_kv, 1, 512]
bf16, indices [s_q, 1, topk], sm_scale, 512, attn_sink=sink, use_legacy=True,
return_log2_lse=False)`` -> (out [s_q, h_q, 512], None, None): ONE kv tensor, so the two stores
become one bf16 workspace (window rows first, compressed rows offset by the window store's row
count; fp8 stores dequantised). A bf16 store that serves both lists (or SWA) needs no copy.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from dsv4.kernels.sparse_mqa import fp8_ds_mla_layout, gather_rows

__all__ = ["flashmla_module", "flashmla_prefill_workspace", "flashmla_sparse_mqa",
           "flashmla_supports"]

PAGE = 64
TOPK_MULTIPLE = 128
_SCHED: dict[tuple, Any] = {}
SCHED_CACHE_MAX_TOKENS = 1024
"""The most queries a step may have for its decode shape's scheduling object to be kept: the
decode runner's largest step (128 sequences x 8 tokens) fits. Longer steps - prefill on the
fp8 cache, whose lengths vary from call to call - get a fresh object per call, filled by that
call (one small launch in a step of milliseconds): kept, every prompt length would hold its
own for the process's life (up to ~36 KB of device memory each)."""


@functools.lru_cache(maxsize=1)
def _import() -> tuple[Any, str]:
    try:
        import flash_mla  # type: ignore[import-not-found]
    except Exception as ex:  # not installed, or its CUDA extension does not load here
        return None, f"flash_mla not importable: {type(ex).__name__}: {str(ex)[:200]}"
    if not flash_mla.has_legacy():
        return None, "flash_mla has no legacy (SM90 / V4-format) kernels"
    return flash_mla, ""


def flashmla_module() -> Any:
    """The ``flash_mla`` module, or None."""
    return _import()[0]


def flashmla_supports(H: int, d: int, fmt: str, device: torch.device | str,
                      rows_per_block: int = PAGE) -> tuple[bool, str]:
    """(True, "") when :func:`flashmla_sparse_mqa` can run this case, else (False, why)."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return False, "needs a CUDA device"
    cap = torch.cuda.get_device_capability(dev)
    if cap[0] != 9:
        return False, f"SM{cap[0]}{cap[1]}: only SM90 (the legacy kernels) is wired here"
    if H not in (64, 128):
        return False, f"H={H}: FlashMLA supports 64 or 128 heads"
    if d != 512:
        return False, f"d={d}: FlashMLA needs head dim 512"
    if fmt not in ("bf16", "fp8_ds_mla"):
        return False, f"unknown fmt {fmt!r}"
    if fmt == "fp8_ds_mla" and rows_per_block != PAGE:
        return False, f"fp8 decode needs page blocks of {PAGE} rows, got {rows_per_block}"
    mod, why = _import()
    if mod is None:
        return False, why
    return True, ""


def _pad_idx(idx: torch.Tensor) -> torch.Tensor:
    """int32 indices, -1 padded to a multiple of ``TOPK_MULTIPLE``: one cast where the width
    is one already (the window's 128 rows, the indexer's 512 / 1024), a cast and a pad
    otherwise - instead of a fill, a cast and a copy (the 2026-12-04 profile: 6 small launches
    of a FlashMLA decode step)."""
    n = idx.shape[-1]
    m = -(-n // TOPK_MULTIPLE) * TOPK_MULTIPLE
    out = idx.to(torch.int32).contiguous()
    if m == n:
        return out
    return torch.nn.functional.pad(out, (0, m - n), value=-1)


def _paged_view(store: torch.Tensor) -> torch.Tensor:
    """uint8 [blocks, block_bytes] -> fp8 [blocks, 64, 1, 584] view (no copy)."""
    dr, sr, _ = fp8_ds_mla_layout(512, PAGE)
    bpt = dr + sr
    if store.dtype != torch.uint8 or store.dim() != 2 or store.shape[1] < PAGE * bpt \
            or store.stride(1) != 1:
        raise ValueError(f"fp8_ds_mla store must be uint8 [blocks, >= {PAGE * bpt}]")
    if store.stride(0) % dr or store.data_ptr() % 16:
        raise ValueError(f"FlashMLA's V4 reader needs a block stride that is a multiple of {dr} "
                         f"bytes (got {store.stride(0)}) and a 16-byte aligned base")
    v = store.as_strided((store.shape[0], PAGE, 1, bpt), (store.stride(0), bpt, bpt, 1))
    return v.view(torch.float8_e4m3fn)


def flashmla_prefill_workspace(win_store: torch.Tensor, cmp_store: torch.Tensor | None,
                               fmt: str, rows_per_block: int) -> tuple[torch.Tensor, int]:
    """(kv [rows, 1, 512] bf16, row offset of the compressed store in it). Build once per
    step and pass as ``workspace`` to :func:`flashmla_sparse_mqa` to avoid rebuilding."""
    def rows_of(store: torch.Tensor) -> torch.Tensor:
        if fmt == "bf16":
            return store.reshape(-1, 512)
        n = store.shape[0] * rows_per_block
        out = torch.empty(n, 512, device=store.device, dtype=torch.bfloat16)
        for lo in range(0, n, 1 << 16):  # chunks: the gather's byte indices are int64 per byte
            r = torch.arange(lo, min(n, lo + (1 << 16)), device=store.device, dtype=torch.int32)
            out[lo: lo + r.numel()] = gather_rows(store, r, fmt, 512, rows_per_block,
                                                  torch.bfloat16)
        return out

    w = rows_of(win_store)
    if cmp_store is None or cmp_store is win_store:
        return w.view(-1, 1, 512), 0
    c = rows_of(cmp_store)
    return torch.cat((w, c)).view(-1, 1, 512), w.shape[0]


def _sched_meta(fm: Any, key: tuple) -> Any:
    """The scheduling object of decode calls of ``key``'s shapes: FlashMLA fills it on its
    first call (the split plan, into tensors it allocates), later calls reuse it. Kept per
    shape only when that first call runs outside a CUDA-graph capture: inside one, the
    filling kernel is only recorded, so the tensors would hold nothing until that graph
    replays - a capture with no eager call of its shapes before it gets an object of its own
    (its graph fills it on every replay). ``key[1]``: the step's queries; above
    :data:`SCHED_CACHE_MAX_TOKENS` nothing is kept."""
    meta = _SCHED.get(key)
    if meta is not None:
        return meta
    meta = fm.get_mla_metadata()[0]
    if key[1] <= SCHED_CACHE_MAX_TOKENS and not (
            key[0].type == "cuda" and torch.cuda.is_current_stream_capturing()):
        _SCHED[key] = meta
    return meta


def flashmla_sparse_mqa(q: torch.Tensor, win_store: torch.Tensor, win_idx: torch.Tensor,
                        cmp_store: torch.Tensor | None, cmp_idx: torch.Tensor | None,
                        sink: torch.Tensor, scale: float, fmt: str, rows_per_block: int, *,
                        mode: str = "auto",
                        workspace: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """Same inputs / output as :func:`dsv4.kernels.sparse_mqa.sparse_mqa` (o [T, H, 512] bf16).

    ``mode``: "decode" (fp8_ds_mla only: FlashMLA's sparse fp8 decode, one query per batch
    entry), "prefill" (bf16 workspace + ``flash_mla_sparse_fwd``), "auto" (decode for fp8
    stores, prefill for bf16 ones). Raises when :func:`flashmla_supports` says no.
    """
    T, H, d = q.shape
    ok, why = flashmla_supports(H, d, fmt, q.device,
                                rows_per_block if fmt == "fp8_ds_mla" else PAGE)
    if not ok:
        raise RuntimeError(f"FlashMLA cannot run this case: {why}")
    fm = flashmla_module()
    if mode == "auto":
        mode = "decode" if fmt == "fp8_ds_mla" else "prefill"
    has_cmp = cmp_store is not None and cmp_idx is not None and cmp_idx.shape[1] > 0
    sink_f = sink.to(torch.float32).contiguous()
    if mode == "decode":
        if fmt != "fp8_ds_mla":
            raise ValueError("FlashMLA's sparse decode reads the fp8 (V4) cache only")
        widx = _pad_idx(win_idx).view(T, 1, -1)
        kw: dict[str, Any] = {}
        if has_cmp:
            assert cmp_store is not None and cmp_idx is not None
            kw = {"extra_k_cache": _paged_view(cmp_store),
                  "extra_indices_in_kvcache": _pad_idx(cmp_idx).view(T, 1, -1)}
        kc = _paged_view(win_store)
        key = (q.device, T, H, widx.shape[-1], kc.shape[0],
               kw["extra_k_cache"].shape[0] if has_cmp else 0,
               kw["extra_indices_in_kvcache"].shape[-1] if has_cmp else 0)
        out, _ = fm.flash_mla_with_kvcache(
            q.contiguous().view(T, 1, H, d), kc, None, None, 512, _sched_meta(fm, key),
            softmax_scale=scale, indices=widx, attn_sink=sink_f, use_legacy=True,
            kv_format="V4", **kw)
        return out.view(T, H, d)
    if mode != "prefill":
        raise ValueError(f"mode must be auto, decode or prefill, got {mode!r}")
    if workspace is None:
        workspace = flashmla_prefill_workspace(win_store, cmp_store if has_cmp else None, fmt,
                                               rows_per_block)
    kv, c_off = workspace
    parts = [win_idx.to(torch.int32)]
    if has_cmp:
        assert cmp_idx is not None
        c = cmp_idx.to(torch.int32)
        parts.append(torch.where(c >= 0, c + c_off, c))
    idx = _pad_idx(torch.cat(parts, dim=1)).view(T, 1, -1)
    out, _, _ = fm.flash_mla_sparse_fwd(q.contiguous(), kv, idx, scale, 512, attn_sink=sink_f,
                                        use_legacy=True, return_log2_lse=False)
    return out
