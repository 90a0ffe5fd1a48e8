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


def test_layer_of_ratio_finds_an_mtp_layer_when_no_hidden_layer_has_the_ratio(tiny):
    import torch

    from dsv4 import DeepseekV4Attention
    from dsv4.random_weights import random_layer_weights

    # Pro's hidden layers are all compressed; its one SWA-only attention is the MTP layer's
    assert DSV4Config.preset("pro").layer_of_ratio(0) == DSV4Config.preset("pro").num_hidden_layers
    c = tiny.replace(compress_ratios=(4, 4, 128, 0))
    assert c.layer_of_ratio(4) == 0 and c.layer_of_ratio(128) == 2
    lid = c.layer_of_ratio(0)
    assert lid == c.num_hidden_layers and c.compress_ratio(lid) == 0
    layer = DeepseekV4Attention.build(c, lid)
    layer.load_weights(random_layer_weights(c, lid).items())
    x = torch.randn(5, c.hidden_size, dtype=torch.bfloat16)
    assert torch.isfinite(layer(x, torch.arange(5), layer.new_cache(16)).float()).all()
    with pytest.raises(ConfigError, match="no layer has compress ratio 4"):
        tiny.replace(compress_ratios=(0, 128, 128, 0)).layer_of_ratio(4)
