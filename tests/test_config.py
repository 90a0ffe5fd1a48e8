"""Runtime options of DSV4Config."""

import pytest

from dsv4.config import ConfigError, DSV4Config


def test_attention_backend_is_a_checked_runtime_option():
    cfg = DSV4Config.preset("tiny")
    assert cfg.attention_backend == "auto"
    on = cfg.replace(attention_backend="triton")
    assert "attention_backend" not in on.to_dict()
    with pytest.raises(ConfigError, match="attention_backend"):
        cfg.replace(attention_backend="cudnn")
