"""safetensors checkpoints with official names: round trip, shard index, selective reads."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

import dsv4.checkpoint as ckpt
from dsv4 import AttentionStack, load_checkpoint, save_checkpoint
from dsv4.platforms import build_attention
from dsv4.testing.random_weights import random_layer_weights

from conftest import random_x


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.fixture
def stack(tiny):
    layers = {}
    for i in range(tiny.num_layers_with_mtp):
        m = build_attention(tiny, i)
        m.load_weights(random_layer_weights(tiny, i, seed=7).items())
        layers[i] = m
    return AttentionStack(tiny, layers)


@pytest.mark.parametrize("max_shard_bytes", [4 << 30, 200_000])
def test_round_trip_is_bit_exact(tmp_path, stack, max_shard_bytes):
    files = save_checkpoint(stack, tmp_path, max_shard_bytes=max_shard_bytes)
    sharded = (tmp_path / ckpt.INDEX_FILE).exists()
    assert sharded == (max_shard_bytes < 1 << 20)
    assert len(files) > 2 if sharded else len(files) == 2
    loaded = load_checkpoint(tmp_path)
    assert loaded.layer_ids == stack.layer_ids
    for i in stack.layer_ids:
        a, b = stack[i].state_dict(), loaded[i].state_dict()
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(bits(a[k]), bits(b[k])), (i, k)
    x = random_x(20, stack.cfg.hidden_size).bfloat16()
    for i in stack.layer_ids:
        y0 = stack[i](x, torch.arange(20), stack[i].new_cache(20))
        y1 = loaded[i](x, torch.arange(20), loaded[i].new_cache(20))
        assert torch.equal(y0, y1)


def test_official_names_and_dtypes(tmp_path, stack):
    save_checkpoint(stack, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("layers.1.attn.wq_a.weight").dtype == torch.float8_e4m3fn
        assert f.get_tensor("layers.1.attn.wq_a.scale").dtype == torch.float8_e8m0fnu
        assert f.get_tensor("layers.1.attn.compressor.wgate.weight").dtype == torch.bfloat16
        assert f.get_tensor("layers.1.attn.compressor.ape").dtype == torch.float32
    assert "mtp.0.attn.wkv.weight" in names  # layer 3 of tiny is the MTP layer
    assert not any("fused" in n for n in names)
    assert {n for n in names if n.startswith("layers.1.attn.")} == {
        "layers.1.attn." + n for n in stack[1].official_weight_names()}
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["compress_ratios"] == list(stack.cfg.compress_ratios)


def test_load_reads_only_requested_layers(tmp_path, stack, monkeypatch):
    save_checkpoint(stack, tmp_path, max_shard_bytes=200_000)
    read: list[str] = []
    real_open = ckpt.safe_open

    class Spy:
        def __init__(self, *a, **k):
            self.f = real_open(*a, **k)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.f.get_tensor(name)

    monkeypatch.setattr(ckpt, "safe_open", Spy)
    loaded = load_checkpoint(tmp_path, layers=[2])
    assert loaded.layer_ids == [2]
    assert read and all(n.startswith("layers.2.attn.") for n in read)
    assert len(read) == len(stack[2].official_weight_names())
