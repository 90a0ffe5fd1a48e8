"""dsv4: the DeepSeek-V4 attention layer, platform-pluggable, testable on any machine.

The names below are imported on first use (``dsv4.DSV4Config``, ``from dsv4 import X``), so that
``import dsv4`` alone, and the ``dsv4`` command's ``--help``, do not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dsv4 import platforms
    from dsv4.attention import AttentionInputError, DeepseekV4Attention
    from dsv4.cache.blocks import CacheCapacityError
    from dsv4.cache.plan import StepPlan, StepPlanError
    from dsv4.cache.pool import AttentionCache, CachePool
    from dsv4.checkpoint import (
        AttentionStack,
        CheckpointError,
        load_checkpoint,
        save_checkpoint,
    )
    from dsv4.config import ConfigError, DSV4Config
    from dsv4.passes import PassReport, process_weights_after_loading
    from dsv4.platforms import build_attention
    from dsv4.runner import DecodeRunner
    from dsv4.testing.random_weights import random_layer_weights
    from dsv4.weights import WeightLoadError

_WHERE = {
    "AttentionCache": "dsv4.cache.pool",
    "CacheCapacityError": "dsv4.cache.blocks",
    "CachePool": "dsv4.cache.pool",
    "AttentionInputError": "dsv4.attention",
    "AttentionStack": "dsv4.checkpoint",
    "CheckpointError": "dsv4.checkpoint",
    "ConfigError": "dsv4.config",
    "DSV4Config": "dsv4.config",
    "DecodeRunner": "dsv4.runner",
    "DeepseekV4Attention": "dsv4.attention",
    "PassReport": "dsv4.passes",
    "StepPlan": "dsv4.cache.plan",
    "StepPlanError": "dsv4.cache.plan",
    "WeightLoadError": "dsv4.weights",
    "build_attention": "dsv4.platforms",
    "load_checkpoint": "dsv4.checkpoint",
    "process_weights_after_loading": "dsv4.passes",
    "random_layer_weights": "dsv4.testing.random_weights",
    "save_checkpoint": "dsv4.checkpoint",
}

__all__ = [
    "AttentionCache",
    "AttentionInputError",
    "AttentionStack",
    "CacheCapacityError",
    "CachePool",
    "CheckpointError",
    "ConfigError",
    "DSV4Config",
    "DecodeRunner",
    "DeepseekV4Attention",
    "PassReport",
    "StepPlan",
    "StepPlanError",
    "WeightLoadError",
    "build_attention",
    "load_checkpoint",
    "platforms",
    "process_weights_after_loading",
    "random_layer_weights",
    "save_checkpoint",
]
__version__ = "0.1.0"
"""The package version (pyproject.toml reads it from here; ``dsv4 --version`` prints it)."""


def __getattr__(name: str) -> Any:
    if name == "platforms":
        return importlib.import_module("dsv4.platforms")
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value  # later look-ups skip this function
        return value
    raise AttributeError(f"module 'dsv4' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
