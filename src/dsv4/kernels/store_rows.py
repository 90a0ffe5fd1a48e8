"""One-launch cache write: a step's new rows into one paged store, in its stored format.

``store_rows(store, slots, rows, values)`` writes ``values[i]`` as row ``rows[i]`` of sequence slot
``slots[i]`` of a :class:`dsv4.cache.store.PagedStore`, byte for byte what
``store.write(store.flat_rows(slots, rows), values)`` writes for the held rows (~45 small PyTorch
ops: the format's encode, the flat-row arithmetic, the scatters). One program per row:

1. block-table lookup: ``logical = min(max(row, 0) // B, max_logical - 1)``,
   ``phys = table_dev[slot, logical]``; a pair whose row is < 0, whose slot is outside the table
   or whose block is not held (-1) writes nothing (the torch path would scatter such a ``-1``
   flat row into the last block's last row; callers only pass held rows there);
2. the row's encode into the block ``phys`` at offset ``row % B``
   (:mod:`dsv4.cache.formats` specifies the layouts):

   * dense ``bf16`` (or a float32 ``auto`` store): the values cast, round to nearest even;
   * ``fp8_ds_mla``: per tile of 64 nope dims an UE8M0 scale byte and 64 E4M3 bytes, the rope
     dims as bf16 after them, the pad scale bytes 0;
   * index ``fp8``: 128 E4M3 bytes and one little-endian float32 scale per 128 values;
   * index ``fp4`` (MXFP4): E2M1 nibbles (element 2j low, 2j + 1 high), an UE8M0 byte per 32.

Numerics are integer bit manipulation wherever a rounding happens, so the GPU's compiled code
and Triton's CPU interpreter (whose float -> bf16 cast truncates) write the same bytes as the
torch path: scale exponents ``ceil(log2(max(amax, floor) * (1 / qmax)))`` from the float32
product's exponent and mantissa bits (:func:`dsv4.layers.fp8.ceil_log2`), the scaled values
``v * 2^-k`` (a power-of-two multiply: the correctly rounded ``v / 2^k`` of the torch path),
clamped, then E4M3 / E2M1 round to nearest even (subnormals included) on the float32 bits, and
float32 -> bf16 as ``(bits + 0x7FFF + lsb) >> 16``. The only float arithmetic is the amax (max
of abs), the product ``amax * (1 / qmax)`` and the power-of-two scaling; they assume float32
denormals are kept (Triton's NVIDIA backend makes only libdevice flush them; the torch path keeps
them): a flush would change only ``fp4`` tiles holding float32-subnormal values (below
2^-126), whose scale 2^-126 makes them representable; ``fp8`` rounds such values to +-0 either
way. Values may be bf16 (the layer dtype), float16
or float32 (all exact in float32, the torch path's compute dtype); float64 values (computed in
float64 there) are refused by :func:`store_rows_problem`.

Nothing is read back and every shape comes from the host's arguments: a launch can be captured
in a CUDA graph. Triton is imported guarded: this module imports on a machine without it.
"""

from __future__ import annotations

import torch

from dsv4.cache.formats import (
    FP8_DS_MLA_TILE,
    MXFP4_BLOCK,
    DenseFormat,
    Fp8DsMlaFormat,
    IndexFp4Format,
    IndexFp8Format,
    PackedFormat,
)
from dsv4.cache.store import PagedStore
from dsv4.kernels.bound_launch import launch
from dsv4.kernels.launch import _INTERPRET, pdl_args, triton_available
from dsv4.layers.quant_sim import INDEX_FP8_BLOCK

__all__ = ["store_row_problem", "store_row_target", "store_rows", "store_rows_problem"]

FMT_DENSE_BF16, FMT_DENSE_F32, FMT_FP8_DS_MLA, FMT_INDEX_FP8, FMT_INDEX_FP4 = 0, 1, 2, 3, 4
VALUE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _pow2_at_least(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _format_code(store: PagedStore) -> int | str:
    """The kernel's format code of ``store``, or why it has none."""
    fmt = store.fmt
    if isinstance(fmt, DenseFormat):
        if fmt.storage_dtype == torch.bfloat16:
            return FMT_DENSE_BF16
        if fmt.storage_dtype == torch.float32:
            return FMT_DENSE_F32
        return f"dense storage dtype {fmt.storage_dtype} (the kernel writes bf16 or float32)"
    if isinstance(fmt, Fp8DsMlaFormat):
        return FMT_FP8_DS_MLA
    if isinstance(fmt, IndexFp8Format):
        return FMT_INDEX_FP8
    if isinstance(fmt, IndexFp4Format):
        return FMT_INDEX_FP4
    return f"format {type(fmt).__name__} ({fmt.name!r}) has no kernel encode"


def _problem(store: PagedStore, values: object) -> tuple[type[Exception], str]:
    """(exception class, reason) of why the kernel cannot write ``values`` into ``store``;
    reason '' when it can."""
    if not isinstance(store, PagedStore):
        return TypeError, f"store must be a PagedStore, got {type(store).__name__}"
    if not isinstance(values, torch.Tensor):
        return TypeError, f"values must be a tensor, got {type(values).__name__}"
    return _values_problem(store, values.dtype, tuple(values.shape), values.device)


def _values_problem(store: PagedStore, dtype: torch.dtype, shape: tuple[int, ...],
                    device: torch.device) -> tuple[type[Exception], str]:
    """:func:`_problem` for values of this dtype, shape and device."""
    if not triton_available():
        return RuntimeError, "Triton is not installed"
    dev = store.data.device
    if dev.type != "cuda" and not _INTERPRET:
        return ValueError, f"the kernel runs on CUDA (the {store.name} store is on {dev.type})"
    code = _format_code(store)
    if isinstance(code, str):
        return TypeError, code
    if dtype not in VALUE_DTYPES:
        return TypeError, (f"values dtype {dtype} (the kernel takes bf16, float16 or "
                           "float32 values)")
    if device != dev:
        return ValueError, f"values are on {device}, the {store.name} store on {dev}"
    d = store.fmt.dim
    if len(shape) != 2 or shape[1] != d:
        return ValueError, f"values must be [N, {d}], got {shape}"
    data, b = store.data, store.block_size
    tab = store.table_dev
    if tab.dtype != torch.int32 or tab.device != dev or tab.dim() != 2 or tab.stride(1) != 1:
        return ValueError, f"the {store.name} store's device table is not int32 rows on {dev}"
    if isinstance(store.fmt, DenseFormat):
        if not data.is_contiguous():
            return ValueError, f"the {store.name} store's dense data is not contiguous"
    else:
        assert isinstance(store.fmt, PackedFormat)
        rb = store.fmt.row_bytes()
        if (data.dtype != torch.uint8 or data.dim() != 3 or data.shape[1] != b
                or data.shape[2] != rb or data.stride(2) != 1
                or (b > 1 and data.stride(1) != rb)
                or (data.shape[0] > 1 and data.stride(0) != store.block_bytes)):
            return ValueError, (f"the {store.name} store's bytes are not [blocks, {b}, {rb}] "
                                f"uint8 with block stride {store.block_bytes}")
    return ValueError, ""


def store_rows_problem(store: PagedStore, values: torch.Tensor) -> str:
    """'' when :func:`store_rows` can write ``values`` into ``store``, else a short reason
    (format, dtype, dim, device...). Host-side checks only (no device sync)."""
    return _problem(store, values)[1]


def store_row_problem(store: PagedStore, dtype: torch.dtype, device: torch.device) -> str:
    """'' when a kernel can encode rows of ``dtype`` values on ``device`` into ``store`` with
    :func:`store_row` (:func:`store_row_target`), else a short reason. Host-side only."""
    return _values_problem(store, dtype, (0, store.fmt.dim), device)[1]


def store_row_target(store: PagedStore, dtype: torch.dtype, device: torch.device
                     ) -> tuple[tuple[object, ...], dict[str, object]] | str:
    """What a kernel that encodes rows of ``dtype`` values (on ``device``) into ``store``
    passes to :func:`store_row`: (the store's runtime arguments - its data as the kernel
    addresses it, the device block table, its row stride, the slots it holds, the logical
    blocks a row holds, the rows a block holds, the block stride -, the encode's compile-time
    constants without ``num_warps``), or why it cannot (a short reason)."""
    why = store_row_problem(store, dtype, device)
    if why:
        return why
    args, consts = _row_target(store, dtype)
    consts.pop("num_warps")
    return args, consts


def _row_target(store: PagedStore, dtype: torch.dtype
                ) -> tuple[tuple[object, ...], dict[str, object]]:
    """:func:`store_row_target` of a store the checks passed, the constants with the store
    kernel's ``num_warps``."""
    code = _format_code(store)
    assert isinstance(code, int)
    data = store.data
    if code == FMT_DENSE_BF16:
        st, blk = data.view(torch.int16), store.block_size * store.fmt.dim
    elif code == FMT_DENSE_F32:
        st, blk = data, store.block_size * store.fmt.dim
    else:  # the packed bytes as [blocks, block_bytes] (the stride includes the padding)
        nb, bb = data.shape[0], store.block_bytes
        st, blk = torch.as_strided(data, (nb, bb), (bb, 1), data.storage_offset()), bb
    table = store.table_dev
    return ((st, table, table.stride(0), table.shape[0], store.max_logical, store.block_size,
             blk), _launch_constants(store, code, dtype))


# ---------------------------------------------------------------------------------- kernel

if triton_available():
    import triton
    import triton.language as tl

    from dsv4.kernels.launch import let_next_kernel_launch, wait_for_prior_kernel

    if _INTERPRET:
        from dsv4.kernels._interpreter import patch_interpreter_index

        patch_interpreter_index()

    from dsv4.kernels._float_bits import (
        FP4_FLOOR,
        FP4_MAX,
        FP8_FLOOR,
        FP8_MAX,
        e4m3_bytes,
        minifloat_code,
        pow2,
        rounded,
        scale_exponent,
        sign_bit,
    )

    @triton.jit
    def _load_f32(ptr, idx, mask, IN_BF16: tl.constexpr):
        """Values at ``ptr + idx`` as float32 (exact). IN_BF16: ``ptr`` is the int16 view of
        bf16 values, widened from the bits."""
        if IN_BF16:
            b = tl.load(ptr + idx, mask=mask, other=0).to(tl.int32) & 0xFFFF
            return (b << 16).to(tl.float32, bitcast=True)
        else:
            return tl.load(ptr + idx, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _bf16_bits(ptr, idx, mask, IN_BF16: tl.constexpr):
        """The bf16 bits (int32 in [0, 65535]) of the values at ``ptr + idx``: the bits
        themselves for bf16 values, else float32 -> bf16 round to nearest even (finite)."""
        if IN_BF16:
            return tl.load(ptr + idx, mask=mask, other=0).to(tl.int32) & 0xFFFF
        else:
            x = tl.load(ptr + idx, mask=mask, other=0.0).to(tl.float32)
            return (rounded(x, tl.bfloat16).to(tl.int32, bitcast=True) >> 16) & 0xFFFF

    @triton.jit
    def _scale_exp(amax, FLOOR: tl.constexpr, QMAX: tl.constexpr):
        """:func:`scale_exponent` clamped to the E8M0 range (int32)."""
        return tl.minimum(tl.maximum(scale_exponent(amax, FLOOR, QMAX), -127), 127)

    @triton.jit
    def _e2m1_nibbles(x, k):
        """E2M1 nibbles (int32) of x [T, C] scaled by 2^-k [T], clamped to +-6, RNE."""
        y = x * pow2(-k)[:, None]
        y = tl.minimum(tl.maximum(y, -FP4_MAX), FP4_MAX)
        return minifloat_code(y, 1, 0) | (sign_bit(y) << 3)

    @triton.jit
    def _store_rows_kernel(
        st_ptr, v_ptr, sv, slot_ptr, row_ptr, tab_ptr, st_tab, n_seqs, max_logical, B, BLK,
        FMT: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, NOPE: tl.constexpr,
        NT: tl.constexpr, TP: tl.constexpr, ROPE: tl.constexpr, RP: tl.constexpr,
        SB: tl.constexpr, PADP: tl.constexpr, IN_BF16: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        """One program per (slot, row, values) triple: :func:`store_row`."""
        wait_for_prior_kernel(PDL)
        i = tl.program_id(0).to(tl.int64)
        store_row(st_ptr, v_ptr + i * sv, tl.load(slot_ptr + i).to(tl.int64),
                  tl.load(row_ptr + i).to(tl.int64), tab_ptr, st_tab, n_seqs, max_logical, B,
                  BLK, FMT, D, DP, NOPE, NT, TP, ROPE, RP, SB, PADP, IN_BF16)
        let_next_kernel_launch(PDL)

    @triton.jit
    def store_row(st_ptr, vrow, slot, row, tab_ptr, st_tab, n_seqs, max_logical, B, BLK,
                  FMT: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, NOPE: tl.constexpr,
                  NT: tl.constexpr, TP: tl.constexpr, ROPE: tl.constexpr, RP: tl.constexpr,
                  SB: tl.constexpr, PADP: tl.constexpr, IN_BF16: tl.constexpr):
        """Encode the values at ``vrow`` as row ``row`` of the sequence in ``slot`` (int64
        scalars) of the store at ``st_ptr`` (FMT 0 its int16 view, FMT 1 float32, else its
        bytes); ``BLK`` the block stride in those elements. FMT 2 (fp8_ds_mla): NT tiles of 64
        nope values (TP = next power of two), ROPE rope values (RP), SB scale bytes per row (pad
        bytes: SB - NT, PADP a power of two above). FMT 3 / 4 (index fp8 / fp4): NT blocks of
        128 / 32 values (TP). IN_BF16: ``vrow`` points at the bf16 values' int16 view."""
        logical = tl.minimum(tl.maximum(row, 0) // B, max_logical - 1)
        slot_ok = (slot >= 0) & (slot < n_seqs)
        phys = tl.load(tab_ptr + tl.where(slot_ok, slot, 0) * st_tab + logical, mask=slot_ok,
                       other=-1).to(tl.int64)
        valid = (row >= 0) & (phys >= 0)
        off = tl.maximum(row, 0) % B
        blk = st_ptr + tl.maximum(phys, 0) * BLK
        if FMT == 0:  # dense bf16
            c = tl.arange(0, DP)
            cm = c < D
            bits = _bf16_bits(vrow, c, cm, IN_BF16)
            tl.store(blk + off * D + c, bits.to(tl.int16), mask=cm & valid)
        elif FMT == 1:  # dense float32
            c = tl.arange(0, DP)
            cm = c < D
            tl.store(blk + off * D + c, _load_f32(vrow, c, cm, IN_BF16), mask=cm & valid)
        elif FMT == 2:  # fp8_ds_mla
            t = tl.arange(0, TP)
            tm = t < NT
            idx = t[:, None] * 64 + tl.arange(0, 64)[None, :]
            x = _load_f32(vrow, idx, tm[:, None], IN_BF16)
            k = _scale_exp(tl.max(tl.abs(x), 1), FP8_FLOOR, FP8_MAX)
            base = blk + off * (NOPE + 2 * ROPE)
            tl.store(base + idx, e4m3_bytes(x, k).to(tl.uint8), mask=tm[:, None] & valid)
            j = tl.arange(0, 2 * RP)  # rope byte j: byte j % 2 of rope value j // 2
            jm = j < 2 * ROPE
            hb = _bf16_bits(vrow + NOPE, j // 2, jm, IN_BF16)
            tl.store(base + NOPE + j, ((hb >> ((j % 2) * 8)) & 0xFF).to(tl.uint8),
                     mask=jm & valid)
            sbase = blk + B * (NOPE + 2 * ROPE) + off * SB
            tl.store(sbase + t, (k + 127).to(tl.uint8), mask=tm & valid)
            p = tl.arange(0, PADP)
            tl.store(sbase + NT + p, tl.zeros([PADP], tl.uint8), mask=(p < SB - NT) & valid)
        elif FMT == 3:  # index fp8: E4M3, a float32 scale per 128
            t = tl.arange(0, TP)
            tm = t < NT
            idx = t[:, None] * 128 + tl.arange(0, 128)[None, :]
            x = _load_f32(vrow, idx, tm[:, None], IN_BF16)
            k = _scale_exp(tl.max(tl.abs(x), 1), FP8_FLOOR, FP8_MAX)
            tl.store(blk + off * D + idx, e4m3_bytes(x, k).to(tl.uint8),
                     mask=tm[:, None] & valid)
            sbits = (k + 127) << 23  # the float32 2^k, little-endian bytes
            b4 = tl.arange(0, 4)
            sb = (sbits[:, None] >> (b4[None, :] * 8)) & 0xFF
            tl.store(blk + B * D + off * (4 * NT) + t[:, None] * 4 + b4[None, :],
                     sb.to(tl.uint8), mask=tm[:, None] & valid)
        else:  # index fp4 (MXFP4): E2M1 pairs, an UE8M0 byte per 32
            t = tl.arange(0, TP)
            tm = t < NT
            pair = t[:, None] * 32 + 2 * tl.arange(0, 16)[None, :]
            xe = _load_f32(vrow, pair, tm[:, None], IN_BF16)
            xo = _load_f32(vrow, pair + 1, tm[:, None], IN_BF16)
            amax = tl.maximum(tl.max(tl.abs(xe), 1), tl.max(tl.abs(xo), 1))
            k = _scale_exp(amax, FP4_FLOOR, FP4_MAX)
            byte = _e2m1_nibbles(xe, k) | (_e2m1_nibbles(xo, k) << 4)
            tl.store(blk + off * (D // 2) + t[:, None] * 16 + tl.arange(0, 16)[None, :],
                     byte.to(tl.uint8), mask=tm[:, None] & valid)
            tl.store(blk + B * (D // 2) + off * NT + t, (k + 127).to(tl.uint8),
                     mask=tm & valid)


def _check_index(x: object, what: str, n: int, device: torch.device) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"store_rows: {what} must be a tensor, got {type(x).__name__}")
    if x.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"store_rows: {what} must be int64 (or int32), got {x.dtype}")
    if x.shape != (n,):
        raise ValueError(f"store_rows: {what} must be [N={n}] (N from values), "
                         f"got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"store_rows: {what} is on {x.device}, the store on {device}")
    return x


def _launch_constants(store: PagedStore, code: int, dtype: torch.dtype) -> dict[str, object]:
    fmt = store.fmt
    d = fmt.dim
    nope, nt, rope, sb = d, 1, 0, 0
    if isinstance(fmt, Fp8DsMlaFormat):
        nope, nt, rope, sb = fmt.nope_dim, fmt.tiles, fmt.rope_dim, fmt.scale_bytes
        assert fmt.nope_dim == nt * FP8_DS_MLA_TILE
    elif isinstance(fmt, IndexFp8Format):
        nt = fmt.blocks
        assert d == nt * INDEX_FP8_BLOCK
    elif isinstance(fmt, IndexFp4Format):
        nt = fmt.blocks
        assert d == nt * MXFP4_BLOCK
    return {"FMT": code, "D": d, "DP": _pow2_at_least(d), "NOPE": nope, "NT": nt,
            "TP": _pow2_at_least(nt), "ROPE": rope, "RP": _pow2_at_least(rope), "SB": sb,
            "PADP": _pow2_at_least(sb - nt), "IN_BF16": dtype == torch.bfloat16,
            "num_warps": 4 if d > 256 else 2}


def store_rows(store: PagedStore, slots: torch.Tensor, rows: torch.Tensor,
               values: torch.Tensor) -> None:
    """Write values[i] as row rows[i] of sequence slot slots[i] of ``store``, quantised to the
    store's format, byte for byte what ``store.write(store.flat_rows(slots, rows), values)``
    writes. One Triton launch.

    slots, rows: [N] int64 (int32 accepted) on the store's device; values: [N, dim] (bf16,
    float16 or float32). Pairs whose row is < 0, whose slot is outside the table or whose block
    is not held (block table -1) are skipped (written nowhere). N == 0 launches nothing. Two
    pairs naming one row race (the torch path's scatter is undefined there too). Raises
    TypeError / ValueError (host checks only, no device sync) where :func:`store_rows_problem`
    gives a reason or the indices are malformed."""
    exc, why = _problem(store, values)
    if why:
        raise exc(f"store_rows ({getattr(store, 'name', '?')} store): {why}")
    dev = store.data.device
    n = values.shape[0]
    slots = _check_index(slots, "slots", n, dev)
    rows = _check_index(rows, "rows", n, dev)
    if n == 0:
        return
    if values.stride(1) != 1:
        values = values.contiguous()
    v = values.view(torch.int16) if values.dtype == torch.bfloat16 else values
    (st, table, st_tab, n_seqs, max_logical, b, blk), consts = _row_target(store, values.dtype)
    launch(_store_rows_kernel, (n,),
        st, v, v.stride(0), slots, rows, table, st_tab, n_seqs, max_logical, b, blk,
        **consts, **pdl_args(dev),
    )
