"""Runtime options of DSV4Config."""

import pytest

from dsv4.config import ConfigError, DSV4Config
from dsv4.platforms import build_attention


def test_attention_backend_is_a_checked_runtime_option():
    cfg = DSV4Config.preset("tiny")
    assert cfg.attention_backend == "auto"
    on = cfg.replace(attention_backend="triton")
    assert "attention_backend" not in on.to_dict()
    with pytest.raises(ConfigError, match="attention_backend"):
        cfg.replace(attention_backend="cudnn")


def test_layer_of_ratio_finds_an_mtp_layer_when_no_hidden_layer_has_the_ratio(tiny):
    import torch

    from dsv4.testing.random_weights import random_layer_weights

    # Pro's hidden layers are all compressed; its one SWA-only attention is the MTP layer's
    assert DSV4Config.preset("pro").layer_of_ratio(0) == DSV4Config.preset("pro").num_hidden_layers
    c = tiny.replace(compress_ratios=(4, 4, 128, 0))
    assert c.layer_of_ratio(4) == 0 and c.layer_of_ratio(128) == 2
    lid = c.layer_of_ratio(0)
    assert lid == c.num_hidden_layers and c.compress_ratio(lid) == 0
    layer = build_attention(c, lid)
    layer.load_weights(random_layer_weights(c, lid).items())
    x = torch.randn(5, c.hidden_size, dtype=torch.bfloat16)
    assert torch.isfinite(layer(x, torch.arange(5), layer.new_cache(16)).float()).all()
    with pytest.raises(ConfigError, match="no layer has compress ratio 4"):
        tiny.replace(compress_ratios=(0, 128, 128, 0)).layer_of_ratio(4)


@pytest.mark.parametrize("typo,meant", [("kv_cache_dtyp", "kv_cache_dtype"),
                                        ("index_topK", "index_topk"),
                                        ("sliding_windw", "sliding_window")])
def test_a_near_miss_of_a_key_warns_naming_the_intended_one(typo, meant):
    from dsv4.config import _TINY, UnknownConfigKeyWarning

    value = DSV4Config.preset("tiny").to_dict()[meant] if meant != "kv_cache_dtype" else "bf16"
    with pytest.warns(UnknownConfigKeyWarning, match=rf"'{typo}' \(did you mean '{meant}'\?\)"):
        cfg = DSV4Config.from_dict({**_TINY, typo: value})
    assert cfg == DSV4Config.preset("tiny")  # ignored, as the warning says


def test_an_unknown_key_warns_even_without_a_near_miss():
    from dsv4.config import _TINY, UnknownConfigKeyWarning

    with pytest.warns(UnknownConfigKeyWarning, match=r"'attention_flavour' unknown to dsv4"):
        DSV4Config.from_dict({**_TINY, "attention_flavour": "spicy"})


def test_the_keys_of_both_dialects_load_in_silence(tmp_path):
    """transformers' own DeepseekV4Config (MoE, hyper-connection and generic keys the layer does
    not use), a save_pretrained config.json, the official-dialect presets and the shipped tiny
    model's config.json: no warning."""
    import json
    import warnings

    from dsv4.tinylm.paths import default_model_dir

    dicts = [DSV4Config.preset(name).to_dict(dialect) for name in ("tiny", "flash", "pro")
             for dialect in ("official", "transformers")]
    dicts.append(json.loads((default_model_dir() / "config.json").read_text()))
    transformers = pytest.importorskip("transformers")
    dicts.append(transformers.DeepseekV4Config().to_dict())
    transformers.DeepseekV4Config(num_hidden_layers=2, layer_types=[
        "sliding_attention", "compressed_sparse_attention"]).save_pretrained(tmp_path)
    dicts.append(json.loads((tmp_path / "config.json").read_text()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for d in dicts:
            DSV4Config.from_dict(d)


def test_layer_id_must_be_an_int_in_range(tiny):

    with pytest.raises(ConfigError, match=r"layer_id='1' is a str: give an int, 0 \.\. 3"):
        build_attention(tiny, "1")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="layer_id=True"):
        tiny.compress_ratio(True)
    with pytest.raises(ConfigError, match="layer_id 4 is out of range"):
        build_attention(tiny, 4)
