"""dsv4: the DeepSeek-V4 attention layer, platform-pluggable, testable on any machine."""

from dsv4 import platforms
from dsv4.attention import AttentionInputError, DeepseekV4Attention
from dsv4.cache.blocks import CacheCapacityError
from dsv4.cache.pool import AttentionCache, CachePool
from dsv4.checkpoint import AttentionStack, CheckpointError, load_checkpoint, save_checkpoint
from dsv4.config import ConfigError, DSV4Config
from dsv4.passes import PassReport, process_weights_after_loading
from dsv4.weights import WeightLoadError

__all__ = [
    "AttentionCache",
    "AttentionInputError",
    "AttentionStack",
    "CacheCapacityError",
    "CachePool",
    "CheckpointError",
    "ConfigError",
    "DSV4Config",
    "DeepseekV4Attention",
    "PassReport",
    "WeightLoadError",
    "load_checkpoint",
    "platforms",
    "process_weights_after_loading",
    "save_checkpoint",
]
__version__ = "0.1.0"
