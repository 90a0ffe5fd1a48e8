"""Platform registry.

A platform names its attention subclass and its ordered list of post-load weight passes, and
says whether it can run on this machine. Shared code never branches on the platform: it asks the
registry for the class and runs the passes in order.
"""

from dsv4.platforms.registry import (
    Platform,
    PlatformUnavailableError,
    UnknownPlatformError,
    available,
    build_attention,
    default_passes,
    get_platform,
    platform_names,
    register_platform,
    unregister_platform,
)

__all__ = [
    "Platform",
    "PlatformUnavailableError",
    "UnknownPlatformError",
    "available",
    "build_attention",
    "default_passes",
    "get_platform",
    "platform_names",
    "register_platform",
    "unregister_platform",
]
