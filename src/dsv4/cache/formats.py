"""Stored row formats of the paged cache (placeholder: dense rows only; replaced on merge)."""

from __future__ import annotations

import torch


class RowFormat:
    name: str = ""
    dim: int = 0
    exact: bool = True

    def block_bytes(self, rows_per_block: int) -> int:
        raise NotImplementedError

    def row_bytes(self) -> int:
        raise NotImplementedError

    def allocate(self, num_blocks: int, rows_per_block: int, device: torch.device | str
                 ) -> torch.Tensor:
        raise NotImplementedError

    def write(self, store: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
        raise NotImplementedError

    def read(self, store: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def copy_rows(self, store: torch.Tensor, src_rows: torch.Tensor, dst_rows: torch.Tensor
                  ) -> None:
        raise NotImplementedError


class DenseFormat(RowFormat):
    def __init__(self, name: str, dim: int, dtype: torch.dtype, exact: bool = True) -> None:
        self.name, self.dim, self.dtype, self.exact = name, dim, dtype, exact

    def row_bytes(self) -> int:
        return self.dim * self.dtype.itemsize

    def block_bytes(self, rows_per_block: int) -> int:
        return rows_per_block * self.row_bytes()

    def allocate(self, num_blocks: int, rows_per_block: int, device: torch.device | str
                 ) -> torch.Tensor:
        return torch.empty(num_blocks, rows_per_block, self.dim, dtype=self.dtype, device=device)

    def write(self, store: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
        store.view(-1, self.dim)[rows] = values.to(self.dtype)

    def read(self, store: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        flat = store.view(-1, self.dim)
        out = flat[rows.clamp(min=0)].to(dtype)
        return out.masked_fill((rows < 0)[..., None], 0)

    def copy_rows(self, store: torch.Tensor, src_rows: torch.Tensor, dst_rows: torch.Tensor
                  ) -> None:
        flat = store.view(-1, self.dim)
        flat[dst_rows] = flat[src_rows]


def kv_format(name: str, dim: int, rope_dim: int, dtype: torch.dtype) -> RowFormat:
    if name == "auto":
        return DenseFormat("auto", dim, dtype)
    if name == "bf16":
        return DenseFormat("bf16", dim, torch.bfloat16, exact=dtype == torch.bfloat16)
    raise ValueError(f"unknown kv cache format {name!r}; valid: ['auto', 'bf16']")


def index_format(name: str, dim: int, dtype: torch.dtype) -> RowFormat:
    return kv_format(name, dim, 0, dtype)
