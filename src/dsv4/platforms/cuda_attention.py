"""The ``cuda`` platform's sparse attention backends (``forward_mqa``), chosen by
``cfg.attention_backend``:

* ``torch``: the base class's gather + softmax (:func:`dsv4.layers.mqa.sparse_mqa_paged`);
* ``triton``: dsv4's paged kernel (:func:`dsv4.kernels.sparse_mqa.sparse_mqa`) reading the pool's
  stores as they are, with the step's flat window rows and the selection (-1 pads) as indices;
* ``flashmla``: FlashMLA's kernels (:func:`dsv4.kernels.flashmla_backend.flashmla_sparse_mqa`):
  on an ``fp8_ds_mla`` cache its sparse fp8 decode kernel reads the stores in place; on a bf16
  cache its sparse prefill kernel reads one bf16 copy of both stores (built every call: correct,
  not fast). An error naming the reason where FlashMLA is not installed or the shape is not one
  it supports (64 or 128 heads, head_dim 512, SM90);
* ``auto``: FlashMLA on an ``fp8_ds_mla`` cache where it supports the shape (its in-place
  decode kernel), else ``triton``; with FlashMLA, steps of at most the plan's
  ``triton_attention_max_tokens`` query tokens run our kernel instead, where it was measured
  the faster of the two (:attr:`BackendChoice.triton_max_tokens`; both read the same cache and
  indices, so the choice per step costs nothing).

Where the kernels cannot read the cache (a float32 / float64 layer or store, a head dim that is
not a power of two >= 128, rope dims other than 64 in ``fp8_ds_mla``, no Triton) ``triton`` and
``auto`` fall back to ``torch`` and the choice says why (:attr:`BackendChoice.reason`, logged once
per layer and cache format). The choice depends only on the config, the layer's shape, the
stores' formats and the device: it is made on the host and cached, with no device syncs, so a
step that uses it can be captured in a CUDA graph.

Numerics: both kernels compute fp32 logits and an fp32 online softmax with the sink in the
denominator and accumulate in fp32; they round the probabilities to bf16 for the P.V product
(as the official kernels do) and write bf16 (``dsv4.kernels.sparse_mqa``'s docstring).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dsv4.cache.formats import DenseFormat, Fp8DsMlaFormat
from dsv4.cache.store import PagedStore
from dsv4.config import ATTENTION_BACKENDS, DSV4Config

if TYPE_CHECKING:
    from dsv4.attention import DeepseekV4Attention
    from dsv4.cache.step import CacheStep
    from dsv4.stages import Selection

@dataclass(frozen=True)
class BackendChoice:
    """What ``forward_mqa`` runs: ``backend`` in torch / triton / flashmla, on stores read as
    ``fmt`` (the kernels' name: bf16 or fp8_ds_mla; "" for torch); ``reason`` says why, when it
    is not simply what was asked for."""

    requested: str
    backend: str
    fmt: str = ""
    reason: str = ""
    triton_max_tokens: int = 0
    """With ``backend`` flashmla (``auto`` only): steps of at most this many query tokens run
    the triton kernel on the same stores and indices instead (0: none)."""

    def backend_for(self, tokens: int) -> str:
        """The backend a step of ``tokens`` query tokens runs."""
        if self.backend == "flashmla" and tokens <= self.triton_max_tokens:
            return "triton"
        return self.backend

    def describe(self) -> str:
        why = f" ({self.reason})" if self.reason else ""
        return f"attention_backend={self.requested}: {self.backend}{why}"


class AttentionBackendError(RuntimeError):
    """The requested attention backend cannot run this layer on this cache (says why)."""


def kernel_format(store: PagedStore) -> tuple[str, str]:
    """(the kernels' format name for the store, "") or ("", why they cannot read it)."""
    fmt = store.fmt
    if isinstance(fmt, DenseFormat):
        if fmt.storage_dtype == torch.bfloat16:
            return "bf16", ""
        return "", (f"the {store.name} store holds {fmt.storage_dtype} rows; the kernels read "
                    "bf16 or fp8_ds_mla")
    if isinstance(fmt, Fp8DsMlaFormat):
        if fmt.rope_dim != 64:
            return "", f"fp8_ds_mla with {fmt.rope_dim} rope dims; the kernels read 64"
        return "fp8_ds_mla", ""
    return "", f"the {store.name} store's format {fmt.name!r} is not one the kernels read"


def _triton_problem(dtype: torch.dtype, head_dim: int, device: torch.device,
                    kernels_available: bool) -> str:
    if not kernels_available:
        from dsv4.kernels.fused_input_proj import triton_available

        return ("Triton is not installed" if not triton_available()
                else f"the triton kernel runs on CUDA devices, not {device}")
    if dtype != torch.bfloat16:
        return f"the layer runs in {dtype}; the kernels take bf16 queries"
    if head_dim < 128 or head_dim & (head_dim - 1):
        return f"head_dim={head_dim}: the triton kernel needs a power of two >= 128"
    return ""


def choose_backend(requested: str, *, dtype: torch.dtype, heads: int, head_dim: int,
                   stores: dict[str, PagedStore], device: torch.device,
                   kernels_available: bool, triton_max_tokens: int = 0) -> BackendChoice:
    """The backend for a layer of ``heads`` x ``head_dim`` in ``dtype`` over ``stores`` (the
    pool's; ``kv`` and, if present, ``compressed``). Host work only. ``kernels_available``:
    Triton is installed and the device runs it. ``triton_max_tokens``: ``auto``'s short steps
    that run our kernel where FlashMLA is chosen (the plan's). Raises
    :class:`AttentionBackendError` when ``flashmla`` is requested and cannot run."""
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend={requested!r}; valid: {', '.join(ATTENTION_BACKENDS)}")
    if requested == "torch":
        return BackendChoice(requested, "torch")
    fmt, why = kernel_format(stores["kv"])
    # both stores share the pool's kv format; check the compressed one's too
    if not why and "compressed" in stores:
        cfmt, why = kernel_format(stores["compressed"])
        if not why and cfmt != fmt:
            why = f"window store {fmt} and compressed store {cfmt} differ"
    if requested in ("flashmla", "auto"):
        flash_why = why
        if not why:
            from dsv4.kernels.flashmla_backend import flashmla_supports

            block = stores["kv"].block_size
            ok, flash_why = flashmla_supports(heads, head_dim, fmt, device,
                                              block if fmt == "fp8_ds_mla" else 64)
            if ok and dtype != torch.bfloat16:
                flash_why = f"the layer runs in {dtype}; FlashMLA takes bf16 queries"
        if requested == "flashmla":
            if flash_why:
                raise AttentionBackendError(f"attention_backend='flashmla' cannot run here: "
                                            f"{flash_why}")
            return BackendChoice(requested, "flashmla", fmt)
        if not flash_why and fmt == "fp8_ds_mla":
            reason = "FlashMLA's fp8 decode kernel"
            small = 0
            if triton_max_tokens > 0 and not _triton_problem(dtype, head_dim, device,
                                                             kernels_available):
                small = triton_max_tokens
                reason += f"; ours for steps of <= {small} tokens"
            return BackendChoice(requested, "flashmla", fmt, reason, small)
    triton_why = why or _triton_problem(dtype, head_dim, device, kernels_available)
    if triton_why:
        return BackendChoice(requested, "torch", "", triton_why)
    reason = ""
    if requested == "auto":
        reason = ("FlashMLA is used on an fp8_ds_mla cache only" if fmt != "fp8_ds_mla"
                  else f"FlashMLA: {flash_why}")
    return BackendChoice(requested, "triton", fmt, reason)


def kernel_store(store: PagedStore, fmt: str) -> torch.Tensor:
    """The store's tensor as the kernels take it, a view (no copy): bf16 [blocks, B, d]; or
    fp8_ds_mla uint8 [blocks, block_bytes] (the cache keeps a [blocks, B, row_bytes] view of the
    same bytes; the block stride includes the padding)."""
    data = store.data
    if fmt == "bf16":
        return data
    nb, bb = data.shape[0], store.block_bytes
    if nb > 1 and data.stride(0) != bb:
        raise ValueError(f"{store.name} store: block stride {data.stride(0)} != {bb} bytes")
    return torch.as_strided(data, (nb, bb), (bb, 1), data.storage_offset())


def _operands(step: CacheStep, selection: Selection, fmt: str
              ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, int]:
    """(window store, compressed store or None, its selected rows or None, block size) as the
    kernels take them."""
    stores = step.pool.stores
    kv = stores["kv"]
    win = kernel_store(kv, fmt)
    if selection.entry_rows is None or "compressed" not in stores:
        return win, None, None, kv.block_size
    return win, kernel_store(stores["compressed"], fmt), selection.entry_rows, kv.block_size


def triton_forward_mqa(layer: DeepseekV4Attention, q: torch.Tensor, step: CacheStep,
                       selection: Selection, fmt: str,
                       inverse_rope: tuple[torch.Tensor, torch.Tensor] | None = None
                       ) -> torch.Tensor:
    """``forward_mqa`` through :func:`dsv4.kernels.sparse_mqa.sparse_mqa` (its torch reference
    off CUDA without Triton's interpreter); ``inverse_rope`` (positions, inv_freq) as there."""
    from dsv4.kernels.sparse_mqa import sparse_mqa

    win, cmp, cmp_rows, block = _operands(step, selection, fmt)
    return sparse_mqa(q, win, selection.window_rows, cmp, cmp_rows, layer.attn_sink,
                      layer.cfg.softmax_scale, fmt, block, inverse_rope=inverse_rope)


def flashmla_forward_mqa(layer: DeepseekV4Attention, q: torch.Tensor, step: CacheStep,
                         selection: Selection, fmt: str) -> torch.Tensor:
    """``forward_mqa`` through FlashMLA (decode kernel on fp8_ds_mla, prefill kernel on bf16)."""
    from dsv4.kernels.flashmla_backend import flashmla_sparse_mqa

    win, cmp, cmp_rows, block = _operands(step, selection, fmt)
    return flashmla_sparse_mqa(q, win, selection.window_rows, cmp, cmp_rows, layer.attn_sink,
                               layer.cfg.softmax_scale, fmt, block)


def format_key(stores: dict[str, PagedStore]) -> tuple[object, ...]:
    """What the choice depends on besides the layer: each store's format and block size."""
    return tuple((name, repr(s.fmt), getattr(s.fmt, "storage_dtype", None), s.block_size)
                 for name, s in stores.items() if name in ("kv", "compressed"))


def flashmla_shaped(cfg: DSV4Config) -> DSV4Config:
    """``cfg`` at FlashMLA's shape, 64 heads of 512 dims (2 output groups), other dims kept: the
    tiny preset's 4 x 128 heads are not one FlashMLA runs."""
    return cfg.replace(num_attention_heads=64, head_dim=512, o_groups=2)


def verify_variants(cfg: DSV4Config, device: torch.device) -> list[tuple[str, DSV4Config]]:
    """What ``dsv4 verify --platform cuda`` checks besides the default config (``auto``): each
    backend that can run here on a bf16 and an fp8_ds_mla cache, and FlashMLA (with triton
    beside it) on a FlashMLA-shaped config when the wheel is installed and the GPU runs it."""
    from dsv4.kernels.flashmla_backend import flashmla_supports
    from dsv4.kernels.fused_input_proj import triton_available

    out = [("torch", cfg.replace(attention_backend="torch"))]
    if triton_available() and device.type == "cuda":
        out += [("triton", cfg.replace(attention_backend="triton")),
                ("triton fp8_ds_mla", cfg.replace(attention_backend="triton",
                                                  kv_cache_dtype="fp8_ds_mla"))]
    big = flashmla_shaped(cfg)
    if flashmla_supports(big.num_attention_heads, big.head_dim, "fp8_ds_mla", device)[0]:
        for backend in ("flashmla", "triton"):
            out.append((f"{backend} fp8_ds_mla 64x512",
                        big.replace(attention_backend=backend, kv_cache_dtype="fp8_ds_mla")))
    return out
