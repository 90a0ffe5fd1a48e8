"""The typed platform registry with lazy creation (see ``dsv4.platforms``)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from dsv4.attention import DeepseekV4Attention
    from dsv4.config import DSV4Config


class UnknownPlatformError(ValueError):
    """No platform of that name is registered."""


class PlatformUnavailableError(RuntimeError):
    """The platform exists but cannot run here (the message says why)."""


@dataclass
class Platform:
    name: str
    description: str
    attention_path: str
    """``module:Class`` of the attention subclass, imported on first use."""
    pass_names: tuple[str, ...] = ()
    """Post-load weight passes, in the order they run (see ``dsv4.passes``)."""
    requirement: Callable[[torch.device | None], str | None] = field(
        default=lambda device: None)
    """Returns None when the platform can run (on ``device``, if given), else the reason."""
    conformance_tolerance: float = 1e-2
    """Largest relative error against ``reference`` (bf16, same weights) that ``dsv4 verify``
    accepts; platforms with different declared numerics say how much and why."""
    verify_variants: str = ""
    """``module:function`` returning extra configurations ``dsv4 verify`` checks on this
    platform, ``f(cfg, device) -> [(label, cfg)]`` (e.g. each available attention backend);
    imported on use. Empty: the platform is verified with the default config only."""

    def unavailable_reason(self, device: torch.device | str | None = None) -> str | None:
        return self.requirement(None if device is None else torch.device(device))

    @property
    def attention_cls(self) -> type[DeepseekV4Attention]:
        module, cls = self.attention_path.split(":")
        return getattr(importlib.import_module(module), cls)  # type: ignore[no-any-return]

    def build_attention(self, cfg: Any, layer_id: int, **kwargs: Any) -> DeepseekV4Attention:
        return self.attention_cls(cfg, layer_id, **kwargs)

    def variants(self, cfg: Any, device: torch.device | str) -> list[tuple[str, Any]]:
        """(label, config) pairs that ``dsv4 verify`` checks besides the default config."""
        if not self.verify_variants:
            return []
        module, fn = self.verify_variants.split(":")
        return list(getattr(importlib.import_module(module), fn)(cfg, torch.device(device)))


_REGISTRY: dict[str, Platform] = {}


def register_platform(platform: Platform) -> Platform:
    if platform.name in _REGISTRY:
        raise ValueError(f"platform {platform.name!r} is already registered")
    _REGISTRY[platform.name] = platform
    return platform


def unregister_platform(name: str) -> Platform:
    """Remove a platform (out-of-tree plugins and tests)."""
    if name not in _REGISTRY:
        raise UnknownPlatformError(f"platform {name!r} is not registered")
    return _REGISTRY.pop(name)


def platform_names() -> list[str]:
    return list(_REGISTRY)


def available(device: torch.device | str | None = None) -> list[str]:
    """Names of the platforms that can run on this machine (or on ``device``)."""
    return [n for n, p in _REGISTRY.items() if p.unavailable_reason(device) is None]


def get_platform(name: str, device: torch.device | str | None = None) -> Platform:
    """The platform ``name``; errors list the valid names, or say why it cannot run here."""
    if not isinstance(name, str) or name not in _REGISTRY:
        lines = []
        for n, p in _REGISTRY.items():
            why = p.unavailable_reason(device)
            lines.append(f"{n}" + ("" if why is None else f" (unavailable: {why})"))
        raise UnknownPlatformError(f"unknown platform {name!r}; valid platforms: "
                                   + ", ".join(lines))
    plat = _REGISTRY[name]
    why = plat.unavailable_reason(device)
    if why is not None:
        raise PlatformUnavailableError(f"platform {name!r} is unavailable: {why}; available here: "
                                       f"{available(device)}")
    return plat


def platform_spec(name: str) -> Platform:
    """The registered platform ``name`` without checking that it can run here."""
    if name not in _REGISTRY:
        get_platform(name)  # raises the listing error
    return _REGISTRY[name]


def build_attention(cfg: DSV4Config, layer_id: int, platform: str = "reference",
                    device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16,
                    **kwargs: Any) -> DeepseekV4Attention:
    """The attention layer of ``layer_id`` for ``platform`` (see :func:`available`) on
    ``device``, which must exist here (checked before any tensor is made). ``kwargs`` go to the
    platform's constructor (``offloader``, ``aux_streams``, ``tp_group``, ...)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device={device!r} is not a device ({e})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: CUDA is not available on this machine "
                         "(build on 'cpu')")
    n_cuda = torch.cuda.device_count() if dev.type == "cuda" else 0
    if dev.type == "cuda" and dev.index is not None and dev.index >= n_cuda:
        raise ValueError(f"device={device!r}: this machine has {n_cuda} CUDA device(s)")
    plat = get_platform(platform, device=device)
    return plat.build_attention(cfg, layer_id, device=device, dtype=dtype, **kwargs)


def default_passes(layer: DeepseekV4Attention) -> tuple[str, ...]:
    """The post-load passes of ``layer``'s platform, in order."""
    return platform_spec(layer.platform_name).pass_names


def _needs_cuda(device: torch.device | None) -> str | None:
    if not torch.cuda.is_available():
        return "CUDA is not available on this machine"
    if device is not None and device.type != "cuda":
        return f"it runs on CUDA devices, not {device}"
    return None


register_platform(Platform(
    name="reference",
    description="pure PyTorch on any device; the numerical oracle",
    attention_path="dsv4.attention:DeepseekV4Attention",
))
register_platform(Platform(
    name="preshuffle",
    description="AITER-style (16, 16) preshuffled fp8 fused_wqa_wkv / wo_b with a blockscale "
                "GEMM over per-token fp8 activations (exact PyTorch emulation, any device)",
    attention_path="dsv4.platforms.preshuffle:PreshuffleAttention",
    pass_names=("compressor_fusion", "preshuffle"),
    # fp8 (e4m3, 3 mantissa bits) activations in two GEMMs per layer: ~5 % measured on tiny
    conformance_tolerance=8e-2,
))
register_platform(Platform(
    name="cuda",
    description="CUDA: all input projections in one Triton launch (fuse_input_projections), "
                "else aux-stream overlap of the input GEMMs; fp32-output GEMMs; fp8 "
                "weight-streaming GEMMs; sparse attention by cfg.attention_backend",
    attention_path="dsv4.platforms.cuda:CudaAttention",
    pass_names=("compressor_fusion", "fuse_input_projections"),
    requirement=_needs_cuda,
    verify_variants="dsv4.platforms.cuda_attention:verify_variants",
))
