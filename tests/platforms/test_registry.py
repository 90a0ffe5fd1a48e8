"""The platform registry: names, availability, clear errors."""

from __future__ import annotations

import pytest
import torch

from dsv4 import DeepseekV4Attention, platforms
from dsv4.platforms import (
    PlatformUnavailableError,
    UnknownPlatformError,
    build_attention,
    get_platform,
)


def test_names_and_availability():
    assert platforms.platform_names()[:3] == ["reference", "preshuffle", "cuda"]
    avail = platforms.available()
    assert {"reference", "preshuffle"} <= set(avail)
    assert ("cuda" in avail) == torch.cuda.is_available()
    assert "cuda" not in platforms.available("cpu")


def test_unknown_platform_lists_the_valid_ones():
    with pytest.raises(UnknownPlatformError) as e:
        get_platform("rocm")
    msg = str(e.value)
    assert "unknown platform 'rocm'" in msg
    for name in ("reference", "preshuffle", "cuda"):
        assert name in msg
    if not torch.cuda.is_available():
        assert "cuda (unavailable: CUDA is not available on this machine)" in msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_unavailable_says_why(tiny):
    with pytest.raises(PlatformUnavailableError, match="CUDA is not available on this machine"):
        build_attention(tiny, 0, platform="cuda")


def test_cuda_on_a_cpu_device_says_why():
    with pytest.raises((PlatformUnavailableError, UnknownPlatformError),
                       match="cuda"):
        get_platform("cuda", device="cpu")


def test_platforms_declare_class_and_ordered_passes():
    from dsv4.passes import ORDER, PASSES

    for name in platforms.platform_names():
        spec = platforms.registry.platform_spec(name)
        assert issubclass(spec.attention_cls, DeepseekV4Attention)
        assert spec.attention_cls.platform_name == name
        assert all(p in PASSES for p in spec.pass_names)
        assert list(spec.pass_names) == sorted(spec.pass_names, key=ORDER.index)
    assert platforms.registry.platform_spec("preshuffle").pass_names == (
        "compressor_fusion", "preshuffle")


def test_register_and_unregister_a_plugin():
    spec = platforms.Platform("plugin", "test", "dsv4.attention:DeepseekV4Attention")
    platforms.register_platform(spec)
    try:
        with pytest.raises(ValueError, match="already registered"):
            platforms.register_platform(spec)
        assert "plugin" in platforms.available()
    finally:
        platforms.unregister_platform("plugin")
    assert "plugin" not in platforms.platform_names()
