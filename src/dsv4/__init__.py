"""dsv4: the DeepSeek-V4 attention layer, platform-pluggable, testable on any machine."""

from dsv4.config import ConfigError, DSV4Config

__all__ = ["ConfigError", "DSV4Config"]
__version__ = "0.1.0"
