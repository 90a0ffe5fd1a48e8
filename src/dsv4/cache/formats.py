"""Stored row formats of the paged KV cache: how one row (a position's kv row, a compressed entry
or an indexer key) is laid out in a block of ``rows_per_block`` rows, and how it is quantised.

A row is addressed by a flat index ``block * rows_per_block + offset``; -1 means "no row" (reads
as zeros). Every format exposes the :class:`RowFormat` interface; build one with
:func:`kv_format` (main kv rows: ``auto``, ``bf16``, ``fp8_ds_mla``) or :func:`index_format`
(indexer keys: ``auto``, ``bf16``, ``fp8``, ``fp4``).

Storage. Dense formats store ``[num_blocks, rows_per_block, dim]`` in their element dtype. The
packed formats store bytes: a uint8 tensor ``[num_blocks, rows_per_block, row_bytes]`` whose block
stride is :meth:`RowFormat.block_bytes` (the padding lies between blocks, as in FlashMLA's own
test helper). Dims 1 and 2 are a byte reshaping of the block, **not** one row's bytes: within a
block all rows' data come first (row order), then all rows' scale bytes (row order).

``fp8_ds_mla`` (kv rows; FlashMLA's ``MODEL1_FP8Sparse``). At head_dim d = 512, rope 64, nope
n = 448, per row: 448 E4M3 bytes (7 tiles of 64 nope dims), then the 64 rope dims as bf16
(128 bytes, little-endian): 576 data bytes; its scales are 8 bytes: 7 UE8M0 bytes (exponent +
127, tile order) and a pad byte (written 0). A block is ``R * 576`` data bytes, then ``R * 8``
scale bytes, padded up to a multiple of 576 bytes: 37440 bytes for R = 64 (37376 unpadded).
Scale rule per tile (computed in float32, float64 for float64 inputs):
``sigma = 2^ceil(log2(max(amax, 1e-4) * (1/448)))``, ``q = e4m3_rne(clamp(v / sigma, +-448))``,
the official FP8 simulation's rule (:func:`dsv4.layers.quant_sim.fp8_block_sim`), so the format
loses nothing beyond that simulation. Generalised to other dims: ``n = d - rope`` must be a
positive multiple of 64, ``tiles = n / 64``, scale bytes per row ``8 * ceil(tiles / 8)``, block
padded to a multiple of the data bytes per row ``n + 2 * rope``.

Verified against (repository, path @ commit):

* deepseek-ai/FlashMLA ``tests/quant.py`` @520fec6a7fd98028705ccad373b7f0e3e2ae75fb
  (``quantize_k_cache`` / ``dequantize_k_cache``, ``MODEL1_FP8Sparse``): meta (512, 448, 64,
  tile 64, 7 tiles); 584 bytes per token (448 + 2*64 + 7 + 1); block = all tokens' 576 nope+rope
  bytes, then all tokens' 8 scale bytes of which the first 7 are the tiles' e8m0 scales (the pad
  is the last byte); block padded to ``ceil(R * 584 / 576) * 576``; rope stored in the input's
  dtype (bf16) after the nope bytes; dequantisation ``fp8 * scale``.
  **Differs** in its scale rule: that test helper floors ``amax / 448`` (not amax) at 1e-4 and
  uses ``torch.log2``; the engines' writers below floor amax at 1e-4 like the official
  simulation, and we follow them. (FlashMLA's floor gives a scale of at least 2^-13, which would
  re-round the small elements of simulated tiles whose amax is below 448 * 2^-14 ~ 0.027.)
* vllm-project/vllm ``vllm/models/deepseek_v4/common/ops/fused_compress_quant_cache.py``
  @045d7575500e01e0f4a7ff84e039a9f7f7dc3bd0 (the cache writers): fp8_ds_mla token data at
  ``block + pos * 576``, scales at ``block + R * 576 + pos * 8``, 7 scale bytes
  ``ceil(log2(max(amax, 1e-4) * (1/448))) + 127`` then a 0 pad byte, nope E4M3 of
  ``clamp(x * 2^-e, +-448)``, rope bf16 after the 448 nope bytes; fp8 indexer keys: 128 E4M3
  bytes at ``block + pos * 128``, one float32 scale ``2^ceil(log2(max(amax, 1e-4) * (1/448)))`` at
  ``block + R * 128 + pos * 4``; MXFP4 indexer keys: 64 packed bytes at ``block + pos * 64``, 4
  UE8M0 bytes at ``block + R * 64 + pos * 4``, scale exponent
  ``clamp(ceil(log2(max(amax, 6 * 2^-126) * (1/6))), -127, 127)``, values E2M1 round-to-nearest
  -even with saturation (``cvt.rn.satfinite.e2m1x2.f32``), the even element in the low nibble
  and the odd element in the high nibble (``_fp32x2_to_fp4x2(even, odd)``; its definition in
  ``fused_indexer_q.py`` passes ``(hi, lo)`` to the PTX instruction, whose first source operand
  fills the high nibble).
* vllm-project/vllm ``vllm/models/deepseek_v4/hw_agnostic/attention/kernels/cache_utils.py``
  @54cedc2fa48304e72794af12ceca35fa98a387e3 (``quantize_and_insert_k_kernel`` and its gather):
  the same fp8_ds_mla layout, amax floor 1e-4, pad scale byte (index 7) written 0, block stride
  taken from the cache tensor (the padded block), dequantisation ``fp8 * 2^(byte - 127)``.
* vllm-project/vllm ``vllm/models/deepseek_v4/attention.py``
  @0484480bc73081c4a5133b3cb53018323fce632d: 584 bytes per kv token (448 + 128 + 8) with 576-byte
  alignment; indexer key bytes per token 132 (fp8: 128 + 4) or 68 (MXFP4: 64 + 4). vLLM gives
  its indexer cache spec the same 576-byte alignment (with fp8_ds_mla; 512 otherwise), an
  allocator choice (it packs the layers' pages together); our index formats are not padded.

Indexer key formats (dim 128 in every config; any multiple of the block is accepted):

* ``fp8``: per row ``dim`` E4M3 bytes, then one float32 scale per 128 values (little-endian);
  scale rule as ``fp8_ds_mla`` at block 128, i.e. :func:`dsv4.layers.quant_sim.index_fp8_sim`.
  132 bytes per row, 8448 per 64-row block.
* ``fp4`` (MXFP4): per row ``dim / 2`` bytes of E2M1 codes (sign << 3 | magnitude index in
  {0, 0.5, 1, 1.5, 2, 3, 4, 6}; element 2j in the low nibble, 2j+1 in the high nibble), then one
  UE8M0 byte per 32 values. The engines' scale rule is the official FP4 simulation's rule
  (:func:`dsv4.layers.quant_sim.fp4_block_sim`: amax floor 6 * 2^-126,
  ``2^ceil(log2(amax * (1/6)))``, E2M1 round-to-nearest-even after clamping to +-6), so
  ``read(write(v)) == fp4_block_sim(v)`` and the format is lossless on already-simulated keys.
  68 bytes per row, 4352 per 64-row block.

Exponents are taken from the float's bits (:func:`dsv4.layers.fp8.ceil_log2`), never from a
floating ``log2``. The engines use a floating ``log2`` (on GPUs possibly an approximate
instruction) and ``ceil``: for an amax a few ulps above ``448 * 2^k`` (or ``6 * 2^k``) they may pick
the smaller exponent k, and the largest element then saturates; elsewhere they agree. Scale
exponents are clamped to the E8M0 range [-127, 127] (only float64 inputs beyond the float32 range
reach it; their values then saturate). Non-finite inputs are not
supported (their rows read back unspecified values).
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod

import torch
from torch import Tensor

from dsv4.layers.fp8 import (
    E8M0_BIAS,
    FP8_AMAX_FLOOR,
    FP8_E4M3_MAX,
    ceil_log2,
    compute_dtype,
    pow2,
    round_e4m3,
    round_minifloat,
)
from dsv4.layers.quant_sim import (
    FP4_AMAX_FLOOR,
    FP4_E2M1_MAX,
    INDEX_FP8_BLOCK,
    round_e2m1,
)

KV_FORMATS = ("auto", "bf16", "fp8_ds_mla")
"""Valid names for :func:`kv_format`."""
INDEX_FORMATS = ("auto", "bf16", "fp8", "fp4")
"""Valid names for :func:`index_format`."""

FP8_DS_MLA_TILE = 64
"""Nope dims per UE8M0 scale in ``fp8_ds_mla``."""
FP8_DS_MLA_SCALE_GROUP = 8
"""``fp8_ds_mla`` scale bytes per row are a multiple of this (7 scales + 1 pad at d = 512)."""
MXFP4_BLOCK = 32
"""Values per UE8M0 scale in the ``fp4`` index format."""
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""E2M1 magnitude of each 3-bit code (the nibble's low bits; bit 3 is the sign)."""
E8M0_MIN_EXP, E8M0_MAX_EXP = -127, 127

_BF16_MANTISSA_BITS, _BF16_MIN_NORMAL_EXP = 7, -126


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _e2m1_grid(dtype: torch.dtype, device: torch.device) -> Tensor:
    """The E2M1 magnitudes on ``device``, made once per (dtype, device): a fresh small tensor
    per call would be a pageable host-to-device copy, a stream synchronisation, on CUDA."""
    return torch.tensor(E2M1_MAGNITUDES, dtype=dtype, device=device)


def _pow2_exponent(blocks: Tensor, floor: float, qmax: float) -> Tensor:
    """Per block (last dim) ``ceil(log2(max(amax, floor) * (1/qmax)))`` as int32, clamped to E8M0.

    The same arithmetic as the official simulations (amax times the reciprocal, in the blocks'
    dtype), so the scales agree with them bit for bit.
    """
    amax = blocks.abs().amax(dim=-1).clamp_min(floor)
    return ceil_log2(amax * (1.0 / qmax)).clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)


def _to_bf16(x: Tensor) -> Tensor:
    """Round to bf16 once (a float64 -> bf16 cast may round twice, through float32)."""
    if x.dtype == torch.float64:
        x = round_minifloat(x, _BF16_MANTISSA_BITS, _BF16_MIN_NORMAL_EXP)
    return x.to(torch.bfloat16)


def _check_dtype(dtype: object, what: str) -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{what} must be a floating-point torch.dtype, got {dtype!r}")
    if dtype.itemsize == 1:
        raise TypeError(f"{what} must be a 16-, 32- or 64-bit float dtype, got {dtype}")
    return dtype


class RowFormat(ABC):
    """One stored row format: quantise-and-scatter rows into blocks, gather-and-dequantise them."""

    name: str
    """The upstream name: ``auto``, ``bf16``, ``fp8_ds_mla``, ``fp8`` or ``fp4``."""
    dim: int
    """Values per row."""
    exact: bool
    """True when ``read(write(v)) == v`` bitwise for every ``v`` of the layer dtype."""
    layer_dtype: torch.dtype
    """The dtype of the layer whose rows this stores."""

    @abstractmethod
    def row_bytes(self) -> int:
        """Bytes per row without block padding (the arithmetic minimum)."""

    @abstractmethod
    def block_bytes(self, rows_per_block: int) -> int:
        """Bytes one block of ``rows_per_block`` rows occupies, padding included."""

    @abstractmethod
    def allocate(
        self, num_blocks: int, rows_per_block: int, device: torch.device | str | None = None
    ) -> Tensor:
        """Uninitialised storage for ``num_blocks`` blocks (``torch.empty``)."""

    @abstractmethod
    def write(self, store: Tensor, rows: Tensor, values: Tensor, validate: bool = True) -> None:
        """Quantise ``values`` [N, dim] into flat rows ``rows`` [N] (all >= 0, distinct; checked
        unless ``validate`` is False, for rows a caller built from its own block tables)."""

    @abstractmethod
    def read(self, store: Tensor, rows: Tensor, dtype: torch.dtype, validate: bool = True
             ) -> Tensor:
        """Rows of any shape [*S] -> [*S, dim] in ``dtype``; rows < 0 read as zeros."""

    @abstractmethod
    def copy_rows(self, store: Tensor, src_rows: Tensor, dst_rows: Tensor) -> None:
        """Copy the stored bytes of ``src_rows`` onto ``dst_rows`` (scales included)."""

    def __repr__(self) -> str:
        cls = type(self).__name__
        return f"{cls}(name={self.name!r}, dim={self.dim}, dtype={self.layer_dtype})"

    # ------------------------------------------------------------------ shared checks

    def _check_alloc(self, num_blocks: int, rows_per_block: int) -> None:
        if int(num_blocks) < 0 or int(rows_per_block) <= 0:
            raise ValueError(
                f"{self.name}: need num_blocks >= 0 and rows_per_block > 0, "
                f"got {num_blocks} and {rows_per_block}"
            )

    def _check_values(self, values: Tensor, n_rows: int) -> None:
        if not isinstance(values, Tensor):
            raise TypeError(f"{self.name}: values must be a tensor, got {type(values).__name__}")
        if not values.is_floating_point():
            raise TypeError(f"{self.name}: values must be floating point, got {values.dtype}")
        if values.dim() != 2 or values.shape[1] != self.dim:
            raise ValueError(
                f"{self.name}: values must have shape [N, {self.dim}] (width {self.dim}), "
                f"got {tuple(values.shape)}"
            )
        if values.shape[0] != n_rows:
            raise ValueError(
                f"{self.name}: {values.shape[0]} value rows for {n_rows} row indices"
            )


def _flat_rows(rows: Tensor, capacity: int, what: str, allow_missing: bool,
               validate: bool = True) -> Tensor:
    """Validate row indices and return them flattened as int64. ``validate=False``: rows the
    caller built from its own block tables (the paged store), only flattened."""
    if not validate:
        return rows.reshape(-1).to(torch.int64)
    if not isinstance(rows, Tensor) or rows.is_floating_point() or rows.is_complex():
        raise TypeError(f"{what} must be an integer tensor, got {getattr(rows, 'dtype', rows)}")
    if rows.dtype == torch.bool:
        raise TypeError(f"{what} must be an integer tensor, got torch.bool")
    flat = rows.reshape(-1).to(torch.int64)
    if flat.numel() and flat.device.type == "cpu":  # a device check would cost a sync
        hi = int(flat.max())
        if hi >= capacity:
            raise IndexError(f"{what}: row {hi} is out of range for a store of {capacity} rows")
        if not allow_missing and int(flat.min()) < 0:
            raise ValueError(f"{what}: row indices must be >= 0, got {int(flat.min())}")
    return flat


def _zero_missing(out: Tensor, valid: Tensor) -> Tensor:
    """Rows of ``out`` [n, dim] where ``valid`` is False set to 0. On the CPU only the missing
    rows are touched (a broadcast masked_fill over every row costs ms on a large gather); on a
    device one sync-free masked_fill."""
    if out.device.type == "cpu":
        missing = (~valid).nonzero().flatten()
        return out.index_fill_(0, missing, 0) if missing.numel() else out
    return out.masked_fill(~valid[:, None], 0)


def _check_distinct(flat: Tensor, what: str) -> None:
    if flat.device.type != "cpu":  # a device check would cost a sync
        return
    if flat.numel() > 1 and torch.unique(flat).numel() != flat.numel():
        raise ValueError(f"{what}: row indices must be distinct")


class DenseFormat(RowFormat):
    """``auto`` (the layer's dtype, exact) or ``bf16``: rows stored as plain values.

    Storage ``[num_blocks, rows_per_block, dim]`` in the element dtype.
    """

    def __init__(self, name: str, dim: int, dtype: torch.dtype) -> None:
        if name not in ("auto", "bf16"):
            raise ValueError(f"DenseFormat is 'auto' or 'bf16', got {name!r}")
        if int(dim) <= 0:
            raise ValueError(f"{name}: dim must be positive, got {dim}")
        self.name = name
        self.dim = int(dim)
        self.layer_dtype = _check_dtype(dtype, "layer dtype")
        self.storage_dtype = dtype if name == "auto" else torch.bfloat16
        self.exact = self.storage_dtype == dtype

    def row_bytes(self) -> int:
        return self.dim * self.storage_dtype.itemsize

    def block_bytes(self, rows_per_block: int) -> int:
        return int(rows_per_block) * self.row_bytes()

    def allocate(
        self, num_blocks: int, rows_per_block: int, device: torch.device | str | None = None
    ) -> Tensor:
        self._check_alloc(num_blocks, rows_per_block)
        return torch.empty(
            int(num_blocks), int(rows_per_block), self.dim, dtype=self.storage_dtype, device=device
        )

    def _check_store(self, store: Tensor) -> None:
        if not isinstance(store, Tensor) or store.dim() != 3 or store.shape[2] != self.dim:
            shape = tuple(store.shape) if isinstance(store, Tensor) else type(store).__name__
            raise ValueError(
                f"{self.name}: store must be [num_blocks, rows_per_block, {self.dim}], got {shape}"
            )
        if store.dtype != self.storage_dtype:
            raise TypeError(f"{self.name}: store must be {self.storage_dtype}, got {store.dtype}")

    def write(self, store: Tensor, rows: Tensor, values: Tensor, validate: bool = True) -> None:
        self._check_store(store)
        r = store.shape[1]
        flat = _flat_rows(rows, store.shape[0] * r, "write rows", allow_missing=False,
                          validate=validate)
        if rows.dim() != 1:
            raise ValueError(f"{self.name}: write rows must be 1-D, got {tuple(rows.shape)}")
        self._check_values(values, flat.numel())
        if validate:
            _check_distinct(flat, "write rows")
        if store.is_contiguous():  # rows are contiguous: one flat index_copy
            store.view(-1, self.dim).index_copy_(0, flat, values.to(self.storage_dtype))
        else:
            store[flat // r, flat % r] = values.to(self.storage_dtype)

    def read(self, store: Tensor, rows: Tensor, dtype: torch.dtype, validate: bool = True
             ) -> Tensor:
        self._check_store(store)
        _check_dtype(dtype, "read dtype")
        r = store.shape[1]
        flat = _flat_rows(rows, store.shape[0] * r, "read rows", allow_missing=True,
                          validate=validate)
        valid = flat >= 0
        if flat.numel() and flat.device.type == "cpu" and not bool(valid.any()):
            return torch.zeros(*rows.shape, self.dim, dtype=dtype, device=store.device)
        idx = flat.clamp_min(0)
        if store.is_contiguous():
            out = store.view(-1, self.dim).index_select(0, idx).to(dtype)
        else:
            out = store[idx // r, idx % r].to(dtype)
        return _zero_missing(out, valid).reshape(*rows.shape, self.dim)

    def copy_rows(self, store: Tensor, src_rows: Tensor, dst_rows: Tensor) -> None:
        self._check_store(store)
        r = store.shape[1]
        src, dst = _copy_indices(src_rows, dst_rows, store.shape[0] * r)
        store[dst // r, dst % r] = store[src // r, src % r]


def _copy_indices(src_rows: Tensor, dst_rows: Tensor, capacity: int) -> tuple[Tensor, Tensor]:
    src = _flat_rows(src_rows, capacity, "copy src_rows", allow_missing=False)
    dst = _flat_rows(dst_rows, capacity, "copy dst_rows", allow_missing=False)
    if src_rows.dim() != 1 or src_rows.shape != dst_rows.shape:
        raise ValueError(
            f"copy_rows needs 1-D src_rows and dst_rows of one length, got "
            f"{tuple(src_rows.shape)} and {tuple(dst_rows.shape)}"
        )
    _check_distinct(dst, "copy dst_rows")
    return src, dst


class PackedFormat(RowFormat):
    """A byte format: per block, all rows' data bytes, then all rows' scale bytes, then padding.

    Storage: uint8 ``[num_blocks, rows_per_block, row_bytes]`` with block stride
    ``block_bytes(rows_per_block)``; dims 1-2 reshape the block's first bytes, they are not rows.
    Subclasses define the per-row byte encoding (:meth:`_encode`, :meth:`_decode`).
    """

    data_bytes: int
    scale_bytes: int
    align: int
    """Block size is padded up to a multiple of this many bytes."""

    def row_bytes(self) -> int:
        return self.data_bytes + self.scale_bytes

    def block_bytes(self, rows_per_block: int) -> int:
        return _ceil_div(int(rows_per_block) * self.row_bytes(), self.align) * self.align

    def allocate(
        self, num_blocks: int, rows_per_block: int, device: torch.device | str | None = None
    ) -> Tensor:
        self._check_alloc(num_blocks, rows_per_block)
        nb, r = int(num_blocks), int(rows_per_block)
        raw = torch.empty(nb, self.block_bytes(r), dtype=torch.uint8, device=device)
        return raw[:, : r * self.row_bytes()].view(nb, r, self.row_bytes())

    def _regions(self, store: Tensor) -> tuple[Tensor, Tensor]:
        """Views [num_blocks, R, data_bytes] and [num_blocks, R, scale_bytes] of a store."""
        if not isinstance(store, Tensor) or store.dim() != 3 or store.shape[2] != self.row_bytes():
            shape = tuple(store.shape) if isinstance(store, Tensor) else type(store).__name__
            raise ValueError(
                f"{self.name}: store must be [num_blocks, rows_per_block, {self.row_bytes()}] "
                f"uint8 (from allocate), got {shape}"
            )
        if store.dtype != torch.uint8:
            raise TypeError(f"{self.name}: store must be uint8, got {store.dtype}")
        nb, r, rb = store.shape
        want = self.block_bytes(r)
        if store.stride(2) != 1 or (r > 1 and store.stride(1) != rb) or (
            nb > 1 and store.stride(0) != want
        ):
            raise ValueError(
                f"{self.name}: store must have strides ({want}, {rb}, 1) (from allocate), "
                f"got {store.stride()}"
            )
        flat = store.reshape(nb, r * rb)  # a view: the inner dims are contiguous
        data = flat[:, : r * self.data_bytes].view(nb, r, self.data_bytes)
        scales = flat[:, r * self.data_bytes :].view(nb, r, self.scale_bytes)
        return data, scales

    @abstractmethod
    def _encode(self, values: Tensor) -> tuple[Tensor, Tensor]:
        """values [N, dim] -> (data [N, data_bytes], scales [N, scale_bytes]) uint8."""

    @abstractmethod
    def _decode(self, data: Tensor, scales: Tensor, cdt: torch.dtype) -> Tensor:
        """(data, scales) uint8 -> values [N, dim] in the compute dtype ``cdt``."""

    def write(self, store: Tensor, rows: Tensor, values: Tensor, validate: bool = True) -> None:
        data, scales = self._regions(store)
        r = store.shape[1]
        flat = _flat_rows(rows, store.shape[0] * r, "write rows", allow_missing=False,
                          validate=validate)
        if rows.dim() != 1:
            raise ValueError(f"{self.name}: write rows must be 1-D, got {tuple(rows.shape)}")
        self._check_values(values, flat.numel())
        if validate:
            _check_distinct(flat, "write rows")
        d, s = self._encode(values)
        blk, off = flat // r, flat % r
        data[blk, off] = d
        scales[blk, off] = s

    def read(self, store: Tensor, rows: Tensor, dtype: torch.dtype, validate: bool = True
             ) -> Tensor:
        data, scales = self._regions(store)
        _check_dtype(dtype, "read dtype")
        r = store.shape[1]
        flat = _flat_rows(rows, store.shape[0] * r, "read rows", allow_missing=True,
                          validate=validate)
        valid = flat >= 0
        if flat.numel() and flat.device.type == "cpu" and not bool(valid.any()):
            return torch.zeros(*rows.shape, self.dim, dtype=dtype, device=store.device)
        idx = flat.clamp_min(0)
        blk, off = idx // r, idx % r
        out = self._decode(data[blk, off], scales[blk, off], compute_dtype(dtype)).to(dtype)
        # zeroing also clears the garbage of never-written rows
        return _zero_missing(out, valid).reshape(*rows.shape, self.dim)

    def copy_rows(self, store: Tensor, src_rows: Tensor, dst_rows: Tensor) -> None:
        data, scales = self._regions(store)
        r = store.shape[1]
        src, dst = _copy_indices(src_rows, dst_rows, store.shape[0] * r)
        data[dst // r, dst % r] = data[src // r, src % r]
        scales[dst // r, dst % r] = scales[src // r, src % r]


class Fp8DsMlaFormat(PackedFormat):
    """``fp8_ds_mla``: nope dims E4M3 with a UE8M0 scale per 64, rope dims bf16 (module doc)."""

    def __init__(self, dim: int, rope_dim: int, dtype: torch.dtype) -> None:
        dim, rope_dim = int(dim), int(rope_dim)
        nope = dim - rope_dim
        if rope_dim < 0 or nope <= 0 or nope % FP8_DS_MLA_TILE:
            raise ValueError(
                f"fp8_ds_mla: nope dims (dim {dim} - rope_dim {rope_dim} = {nope}) must be a "
                f"positive multiple of {FP8_DS_MLA_TILE}, with rope_dim >= 0"
            )
        self.name = "fp8_ds_mla"
        self.dim, self.rope_dim, self.nope_dim = dim, rope_dim, nope
        self.layer_dtype = _check_dtype(dtype, "layer dtype")
        self.exact = False
        self.tiles = nope // FP8_DS_MLA_TILE
        self.data_bytes = nope + 2 * rope_dim
        self.scale_bytes = FP8_DS_MLA_SCALE_GROUP * _ceil_div(self.tiles, FP8_DS_MLA_SCALE_GROUP)
        self.align = self.data_bytes

    def _encode(self, values: Tensor) -> tuple[Tensor, Tensor]:
        n, t = values.shape[0], self.tiles
        cdt = compute_dtype(values.dtype)
        nope = values[:, : self.nope_dim].to(cdt).reshape(n, t, FP8_DS_MLA_TILE)
        exponent = _pow2_exponent(nope, FP8_AMAX_FLOOR, FP8_E4M3_MAX)  # [N, tiles]
        sigma = pow2(exponent, cdt).unsqueeze(-1)
        q = round_e4m3((nope / sigma).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX))
        q_bytes = q.to(torch.float8_e4m3fn).view(torch.uint8).reshape(n, self.nope_dim)
        rope = _to_bf16(values[:, self.nope_dim :]).contiguous().view(torch.uint8)
        data = torch.cat((q_bytes, rope.reshape(n, 2 * self.rope_dim)), dim=1)
        scales = torch.zeros(n, self.scale_bytes, dtype=torch.uint8, device=values.device)
        scales[:, :t] = (exponent + E8M0_BIAS).to(torch.uint8)
        return data, scales

    def _decode(self, data: Tensor, scales: Tensor, cdt: torch.dtype) -> Tensor:
        n, t = data.shape[0], self.tiles
        q = data[:, : self.nope_dim].contiguous().view(torch.float8_e4m3fn).to(cdt)
        sigma = pow2(scales[:, :t].to(torch.int32) - E8M0_BIAS, cdt)
        nope = (q.reshape(n, t, FP8_DS_MLA_TILE) * sigma.unsqueeze(-1)).reshape(n, self.nope_dim)
        rope = data[:, self.nope_dim :].contiguous().view(torch.bfloat16).to(cdt)
        return torch.cat((nope, rope.reshape(n, self.rope_dim)), dim=1)


class IndexFp8Format(PackedFormat):
    """``fp8`` indexer keys: E4M3 values, one power-of-two float32 scale per 128 (module doc)."""

    def __init__(self, dim: int, dtype: torch.dtype) -> None:
        dim = int(dim)
        if dim <= 0 or dim % INDEX_FP8_BLOCK:
            raise ValueError(f"fp8 index format: dim {dim} must be a positive multiple of 128")
        self.name = "fp8"
        self.dim = dim
        self.layer_dtype = _check_dtype(dtype, "layer dtype")
        self.exact = False
        self.blocks = dim // INDEX_FP8_BLOCK
        self.data_bytes = dim
        self.scale_bytes = 4 * self.blocks
        self.align = 1

    def _encode(self, values: Tensor) -> tuple[Tensor, Tensor]:
        n = values.shape[0]
        cdt = compute_dtype(values.dtype)
        v = values.to(cdt).reshape(n, self.blocks, INDEX_FP8_BLOCK)
        exponent = _pow2_exponent(v, FP8_AMAX_FLOOR, FP8_E4M3_MAX)
        sigma = pow2(exponent, cdt).unsqueeze(-1)
        q = round_e4m3((v / sigma).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX))
        data = q.to(torch.float8_e4m3fn).view(torch.uint8).reshape(n, self.dim)
        scales = pow2(exponent, torch.float32).contiguous().view(torch.uint8)
        return data, scales.reshape(n, self.scale_bytes)

    def _decode(self, data: Tensor, scales: Tensor, cdt: torch.dtype) -> Tensor:
        n = data.shape[0]
        q = data.contiguous().view(torch.float8_e4m3fn).to(cdt)
        q = q.reshape(n, self.blocks, INDEX_FP8_BLOCK)
        sigma = scales.contiguous().view(torch.float32).to(cdt).reshape(n, self.blocks, 1)
        return (q * sigma).reshape(n, self.dim)


class IndexFp4Format(PackedFormat):
    """``fp4`` indexer keys: MXFP4, E2M1 nibbles and a UE8M0 scale per 32 values (module doc)."""

    def __init__(self, dim: int, dtype: torch.dtype) -> None:
        dim = int(dim)
        if dim <= 0 or dim % MXFP4_BLOCK:
            raise ValueError(f"fp4 index format: dim {dim} must be a positive multiple of 32")
        self.name = "fp4"
        self.dim = dim
        self.layer_dtype = _check_dtype(dtype, "layer dtype")
        self.exact = False
        self.blocks = dim // MXFP4_BLOCK
        self.data_bytes = dim // 2
        self.scale_bytes = self.blocks
        self.align = 1

    def _encode(self, values: Tensor) -> tuple[Tensor, Tensor]:
        n = values.shape[0]
        cdt = compute_dtype(values.dtype)
        v = values.to(cdt).reshape(n, self.blocks, MXFP4_BLOCK)
        exponent = _pow2_exponent(v, FP4_AMAX_FLOOR, FP4_E2M1_MAX)
        sigma = pow2(exponent, cdt).unsqueeze(-1)
        q = round_e2m1((v / sigma).clamp(-FP4_E2M1_MAX, FP4_E2M1_MAX)).reshape(n, self.dim)
        grid = _e2m1_grid(cdt, values.device)
        code = torch.searchsorted(grid, q.abs().contiguous()).to(torch.uint8)
        nibble = code | (torch.signbit(q).to(torch.uint8) << 3)
        data = nibble[:, 0::2] | (nibble[:, 1::2] << 4)
        return data, (exponent + E8M0_BIAS).to(torch.uint8)

    def _decode(self, data: Tensor, scales: Tensor, cdt: torch.dtype) -> Tensor:
        n = data.shape[0]
        nibble = torch.stack((data & 0xF, data >> 4), dim=-1).reshape(n, self.dim)
        grid = _e2m1_grid(cdt, data.device)
        mag = grid[(nibble & 7).long()]
        q = torch.where((nibble & 8) != 0, -mag, mag).reshape(n, self.blocks, MXFP4_BLOCK)
        sigma = pow2(scales.to(torch.int32) - E8M0_BIAS, cdt).unsqueeze(-1)
        return (q * sigma).reshape(n, self.dim)


def kv_format(name: str, dim: int, rope_dim: int, dtype: torch.dtype) -> RowFormat:
    """The row format for main kv rows (window rows and compressed entries) of a layer.

    ``name``: ``auto`` (the layer's dtype), ``bf16`` or ``fp8_ds_mla``; ``dim`` the head dim,
    ``rope_dim`` its trailing rope dims, ``dtype`` the layer's dtype.
    """
    if name in ("auto", "bf16"):
        return DenseFormat(name, dim, dtype)
    if name == "fp8_ds_mla":
        return Fp8DsMlaFormat(dim, rope_dim, dtype)
    raise ValueError(f"unknown kv cache format {name!r}; valid: {', '.join(KV_FORMATS)}")


def index_format(name: str, dim: int, dtype: torch.dtype) -> RowFormat:
    """The row format for indexer keys (compressed entries of the indexer, dim 128).

    ``name``: ``auto`` (the layer's dtype), ``bf16``, ``fp8`` or ``fp4``.
    """
    if name in ("auto", "bf16"):
        return DenseFormat(name, dim, dtype)
    if name == "fp8":
        return IndexFp8Format(dim, dtype)
    if name == "fp4":
        return IndexFp4Format(dim, dtype)
    raise ValueError(f"unknown index cache format {name!r}; valid: {', '.join(INDEX_FORMATS)}")
