"""Bad input gets a clear error naming the culprit, and leaves layer and cache exactly as they
were."""

from __future__ import annotations

import json

import pytest
import torch

from dsv4 import (
    AttentionInputError,
    CheckpointError,
    ConfigError,
    DSV4Config,
    WeightLoadError,
    load_checkpoint,
    save_checkpoint,
)
from dsv4.platforms import build_attention
from dsv4.testing.random_weights import random_layer_weights

from conftest import random_x


def snapshot_state(layer):
    return {k: v.detach().clone() for k, v in layer.state_dict(keep_vars=True).items()}


def assert_same_state(layer, snap):
    now = layer.state_dict()
    assert now.keys() == snap.keys()
    for k, v in snap.items():
        a, b = now[k], v
        if a.element_size() == 1:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(a, b), k


def snapshot_cache(cache):
    pool = cache.pool
    snap = {"length": cache.length, "blocks": pool.blocks_in_use()}
    for name, store in pool.stores.items():
        snap[f"{name}.data"] = store.data.clone()
        snap[f"{name}.table"] = store.table.clone()
    for name, (_, ring) in pool.rings.items():
        snap[f"{name}.ring"] = ring.clone()
    return snap


def assert_same_cache(cache, snap):
    """Bitwise: rows never written hold uninitialised memory (possibly NaN)."""
    for k, v in snapshot_cache(cache).items():
        now = snap[k]
        if isinstance(v, torch.Tensor):
            assert torch.equal(now.view(torch.uint8), v.view(torch.uint8)), k
        else:
            assert now == v, k


@pytest.fixture
def c4(tiny, make_layer):
    layer = make_layer(tiny, 4)
    cache = layer.new_cache(64)
    layer(random_x(10, tiny.hidden_size).bfloat16(), torch.arange(10), cache)
    return layer, cache


@pytest.mark.parametrize("case,match", [
    ("shape", r"x has shape \(5, 128\)"),
    ("dtype", r"x has dtype torch.float32"),
    ("ndim", r"x has shape \(5,\)"),
    ("empty", r"T >= 1"),
    ("positions_gap", r"must continue it as \[10, 11, 12, 13, 14\]"),
    ("positions_restart", r"cache holds 10 tokens"),
    ("positions_len", r"positions has 4 entries for T=5"),
    ("positions_float", r"positions has dtype torch.float32"),
    ("too_long", r"exceed the cache's max_seq_len=64"),
    ("foreign_cache", r"cache 0 belongs to layer 2"),
    ("seq_lens", r"seq_lens=\[2, 2\]"),
    ("cache_none", r"cache has type NoneType: give an AttentionCache"),
    ("cache_str", r"cache has type str: give an AttentionCache"),
    ("cache_in_list", r"cache 0 is a NoneType, not an AttentionCache"),
    ("foreign_in_batch", r"cache 1 belongs to layer 2"),
    ("freed_in_batch", r"cache 1 was freed"),
    ("too_long_in_batch", r"sequence 1: 0 cached \+ 9 new tokens exceed the cache's max_seq_len=8"),
    # a decode batch (one token a sequence) and a mixed one: the sequence at fault is named
    ("positions_decode_batch", r"positions of sequence 2 are \[4\] but its cache holds 3 "
                               r"tokens: they must continue it as \[3\]"),
    ("positions_mixed_batch", r"positions of sequence 1 are \[0, 2\] but its cache holds 0 "
                              r"tokens: they must continue it as \[0, 1\]"),
])
def test_forward_rejects_bad_input(c4, tiny, make_layer, case, match):
    layer, cache = c4
    h = tiny.hidden_size
    x = random_x(5, h).bfloat16()
    pos = torch.arange(10, 15)
    cache_arg = cache
    kwargs = {}
    if case == "shape":
        x = torch.zeros(5, 128, dtype=torch.bfloat16)
    elif case == "dtype":
        x = x.float()
    elif case == "ndim":
        x = x[:, 0]
    elif case == "empty":
        x, pos = x[:0], pos[:0]
    elif case == "positions_gap":
        pos = torch.arange(11, 16)
    elif case == "positions_restart":
        pos = torch.arange(0, 5)
    elif case == "positions_len":
        pos = pos[:4]
    elif case == "positions_float":
        pos = pos.float()
    elif case == "too_long":
        x, pos = random_x(60, h).bfloat16(), torch.arange(10, 70)
    elif case == "foreign_cache":
        cache_arg = make_layer(tiny, 128).new_cache(64)
    elif case == "seq_lens":
        cache_arg, kwargs = [cache, layer.new_cache(8)], {"seq_lens": [2, 2]}
    elif case == "cache_none":
        cache_arg = None
    elif case == "cache_str":
        cache_arg = "cache"  # was taken for 5 caches, one per character
    elif case == "cache_in_list":
        cache_arg, kwargs = [None], {"seq_lens": [5]}
    elif case == "foreign_in_batch":  # a second pool, of another layer
        x, pos = x[:2], torch.tensor([10, 0])
        cache_arg = [cache, make_layer(tiny, 128).new_cache(64)]
    elif case == "freed_in_batch":
        other = layer.new_cache(8)
        other.free()
        x, pos, cache_arg = x[:2], torch.tensor([10, 0]), [cache, other]
    elif case == "too_long_in_batch":
        x = random_x(10, h).bfloat16()
        pos = torch.cat([torch.tensor([10]), torch.arange(9)])
        cache_arg, kwargs = [cache, layer.new_cache(8)], {"seq_lens": [1, 9]}
    elif case in ("positions_decode_batch", "positions_mixed_batch"):
        others = layer.new_caches(2, 16)
        layer(random_x(3, h).bfloat16(), torch.arange(3), others[1])
        if case == "positions_decode_batch":  # lengths 10, 0, 3; the third is one ahead
            x, pos, cache_arg = x[:3], torch.tensor([10, 0, 4]), [cache, *others]
        else:
            x, pos = x[:3], torch.tensor([10, 0, 2])
            cache_arg, kwargs = [cache, others[0]], {"seq_lens": [1, 2]}
    state, csnap = snapshot_state(layer), snapshot_cache(cache)
    with pytest.raises(AttentionInputError, match=match):
        layer(x, pos, cache_arg, **kwargs)
    assert_same_state(layer, state)
    assert_same_cache(cache, csnap)
    # and the cache still works: the next correct call continues it
    layer(random_x(1, h).bfloat16(), torch.tensor([10]), cache)
    assert cache.length == 11


def test_forward_rejects_wrong_device(c4, tiny):
    layer, cache = c4
    x = random_x(1, tiny.hidden_size).bfloat16().to("meta")
    with pytest.raises(AttentionInputError, match="x is on meta"):
        layer(x, torch.tensor([10]), cache)
    assert cache.length == 10


def _weights(tiny, ratio=4):
    layer_id = tiny.layer_of_ratio(ratio)
    return layer_id, random_layer_weights(tiny, layer_id, seed=1)


@pytest.mark.parametrize("case,match", [
    ("missing", r"missing tensor\(s\) \['indexer.compressor.ape'\]"),
    ("unexpected", r"unexpected tensor 'indexer.k_norm.weight' \(V4 has no indexer.k_norm\)"),
    ("shape", r"'wq_b.weight' has shape \(512, 64\), expected \(512, 128\)"),
    ("dtype", r"'wo_b.weight' has dtype torch.bfloat16, expected one of \[torch.float8_e4m3fn\]"),
    ("scale_dtype", r"'wq_a.scale' has dtype torch.float32"),
    ("nan", r"'compressor.wgate.weight' contains NaN or Inf"),
    ("inf", r"'attn_sink' contains NaN or Inf"),
    ("nan_scale", r"'wkv.scale' contains NaN or Inf"),
    ("twice", r"tensor 'q_norm.weight' was given twice"),
    ("not_tensor", r"'kv_norm.weight' is a list"),
])
def test_load_weights_validates_before_assigning(tiny, make_layer, case, match):
    layer = make_layer(tiny, 4)  # loaded with seed 0
    layer_id, w = _weights(tiny)
    pairs = list(w.items())
    if case == "missing":
        pairs = [(k, v) for k, v in pairs if k != "indexer.compressor.ape"]
    elif case == "unexpected":
        pairs.append(("indexer.k_norm.weight", torch.ones(128)))
    elif case == "shape":
        w["wq_b.weight"] = w["wq_b.weight"][:, :64]
    elif case == "dtype":
        w["wo_b.weight"] = w["wo_b.weight"].to(torch.bfloat16)
    elif case == "scale_dtype":
        w["wq_a.scale"] = w["wq_a.scale"].float()
    elif case == "nan":
        w["compressor.wgate.weight"][3, 5] = float("nan")
    elif case == "inf":
        w["attn_sink"][1] = float("inf")
    elif case == "nan_scale":
        w["wkv.scale"].view(torch.uint8)[0, 0] = 255
    elif case == "twice":
        pairs.append(("q_norm.weight", w["q_norm.weight"]))
    elif case == "not_tensor":
        w["kv_norm.weight"] = [1.0] * 128
    if case not in ("missing", "unexpected", "twice"):
        pairs = list(w.items())
    snap = snapshot_state(layer)
    with pytest.raises(WeightLoadError, match=match):
        layer.load_weights(pairs)
    assert_same_state(layer, snap)


@pytest.mark.parametrize("form", ["dict", "pairs", "generator"])
def test_load_weights_takes_a_mapping_or_pairs(tiny, form):
    layer_id, w = _weights(tiny)
    weights = {"dict": w, "pairs": list(w.items()), "generator": (kv for kv in w.items())}[form]
    layer = build_attention(tiny, layer_id)
    layer.load_weights(weights)
    assert torch.equal(layer.attn_sink, w["attn_sink"])


@pytest.mark.parametrize("bad,match", [
    (lambda w: w["attn_sink"], r"weights must be a mapping of name -> tensor .* got Tensor"),
    (lambda w: "wq_a.weight", r"weights must be a mapping .* got str"),
    (lambda w: list(w), r"an element that is the string 'wq_a.weight', not a \(name, tensor\)"),
    (lambda w: [tuple(w.items())[0][1]], r"an element that is Tensor, not a \(name, tensor\)"),
    (lambda w: 7, r"weights must be a mapping .* got int"),
])
def test_load_weights_says_what_it_expects(tiny, make_layer, bad, match):
    layer = make_layer(tiny, 4)
    _, w = _weights(tiny)
    snap = snapshot_state(layer)
    with pytest.raises(WeightLoadError, match=match):
        layer.load_weights(bad(w))
    assert_same_state(layer, snap)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_build_on_a_missing_device_names_it(tiny, device):
    with pytest.raises(ValueError, match=f"device='{device}': CUDA is not available"):
        build_attention(tiny, 0, device=device)


def test_build_on_a_device_that_is_no_device_names_it(tiny):
    with pytest.raises(ValueError, match="device='gpu0' is not a device"):
        build_attention(tiny, 0, device="gpu0")


def test_config_rejects_impossible_combinations():
    base = DSV4Config.preset("tiny").to_dict()
    cases = {
        "o_groups": ({"o_groups": 3}, r"o_groups=3: must divide num_attention_heads=4"),
        "rope": ({"qk_rope_head_dim": 128}, r"qk_rope_head_dim=128: must be smaller than"),
        "ratios": ({"compress_ratios": [0, 4, 8, 0]}, r"entries must be 0, 4 or 128, got \[8\]"),
        "short": ({"compress_ratios": [0, 4]}, r"compress_ratios has 2 entries; needs at least"),
        "kv_heads": ({"num_key_value_heads": 2}, r"num_key_value_heads=2: .* must be 1"),
        "fp8": ({"q_lora_rank": 96}, r"q_lora_rank=96: must be a multiple of the fp8 block"),
        "yarn": ({"rope_scaling": {"type": "yarn", "factor": 16}},
                 r"original_max_position_embeddings is missing"),
        "negative": ({"hidden_size": -1}, r"hidden_size=-1: must be a positive integer"),
    }
    for name, (change, match) in cases.items():
        with pytest.raises(ConfigError, match=match):
            DSV4Config.from_dict({**base, **change})
        assert name
    with pytest.raises(ConfigError, match=r"missing required key\(s\) \['head_dim'\]"):
        DSV4Config.from_dict({k: v for k, v in base.items() if k != "head_dim"})
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        DSV4Config.preset("huge")


def test_build_rejects_unknown_platform_and_dtype(tiny):
    with pytest.raises(ValueError, match=r"unknown platform 'rocm'; valid platforms: reference"):
        build_attention(tiny, 0, platform="rocm")
    with pytest.raises(ValueError, match="dtype=torch.float16"):
        build_attention(tiny, 0, dtype=torch.float16)
    with pytest.raises(ConfigError, match="layer_id 9 is out of range"):
        build_attention(tiny, 9)


@pytest.fixture
def saved(tmp_path, tiny, make_layer):
    layer = make_layer(tiny, 128)
    save_checkpoint(layer, tmp_path)
    return tmp_path, layer


def test_truncated_checkpoint_is_an_error(saved):
    folder, layer = saved
    shard = folder / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model.safetensors .*truncated or corrupt"):
        load_checkpoint(folder, layers=[layer.layer_id])


def test_corrupt_header_is_an_error(saved):
    folder, layer = saved
    shard = folder / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[8:20] = b"not json!!!!"
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_checkpoint(folder, layers=[layer.layer_id])


def test_missing_folder_and_config_mismatch(saved, tmp_path):
    folder, layer = saved
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["head_dim"] = 256
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"'wkv.weight' has shape \(128, 256\), expected"):
        load_checkpoint(folder, layers=[layer.layer_id])


def test_missing_layer_in_checkpoint(saved):
    folder, _ = saved
    with pytest.raises(CheckpointError, match=r"no tensor for layer 1 \(prefix 'layers.1.attn.'\)"):
        load_checkpoint(folder, layers=[1])
