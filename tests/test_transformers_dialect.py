"""transformers' DeepseekV4 config keys and checkpoint names: read, write, round trips, and
errors for contradictory or unmodelled keys and for mixed spellings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dsv4 import ConfigError, DSV4Config, load_checkpoint, save_checkpoint
from dsv4.checkpoint import AttentionStack, CheckpointError
from dsv4.dialects import transformers_names as names
from dsv4.platforms import build_attention
from dsv4.testing.random_weights import random_layer_weights


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Any:
    """Tiny matrices: one intra-op thread is ~20x faster than two on a busy 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("preset", ["flash", "pro", "tiny"])
def test_config_round_trips_through_the_transformers_dialect(preset: str) -> None:
    cfg = DSV4Config.preset(preset)
    d = cfg.to_dict(dialect="transformers")
    assert "compress_ratios" not in d and "rope_scaling" not in d
    assert d["layer_types"][: 3] == [
        {0: "sliding_attention", 4: "compressed_sparse_attention",
         128: "heavily_compressed_attention"}[r] for r in cfg.compress_ratios[:3]]
    assert d["rope_parameters"]["compress"]["rope_type"] == "yarn"
    assert DSV4Config.from_dict(json.loads(json.dumps(d))) == cfg
    assert cfg.to_dict() == cfg.to_dict(dialect="official")
    assert "layer_types" not in cfg.to_dict()


def test_config_without_yarn_round_trips() -> None:
    cfg = DSV4Config.preset("tiny").replace(rope_scaling=None)
    d = cfg.to_dict(dialect="transformers")
    assert d["rope_parameters"]["compress"]["rope_type"] == "default"
    assert DSV4Config.from_dict(d) == cfg


def _tf(**changes: Any) -> dict[str, Any]:
    d = DSV4Config.preset("tiny").to_dict(dialect="transformers")
    d.update(changes)
    return d


def _rope(label: str, **changes: Any) -> dict[str, Any]:
    d = _tf()
    d["rope_parameters"][label].update(changes)
    return d


@pytest.mark.parametrize("d, culprit", [
    (_tf(rope_theta=5000.0), "rope_theta"),
    (_tf(compress_rope_theta=1.0), "compress_rope_theta"),
    (_tf(partial_rotary_factor=0.25), "partial_rotary_factor"),
    (_tf(qk_rope_head_dim=32), "qk_rope_head_dim"),
    (_tf(compress_ratios=[0, 128, 4, 0]), "compress_ratios"),
    (_tf(compress_rates={"compressed_sparse_attention": 8}), "compress_rates"),
    (_tf(layer_types=["sliding_attention"] * 2), "layer_types"),
    (_tf(layer_types=["full_attention"] * 3), "layer_types"),
    (_tf(layer_types=None), "layer_types"),
    (_tf(attention_bias=True), "attention_bias"),
    (_tf(model_type="deepseek_v3"), "model_type"),
    (_rope("compress", attention_factor=1.277), "attention_factor"),
    (_rope("compress", mscale=1.0), "mscale"),
    (_rope("compress", truncate=False), "truncate"),
    (_rope("compress", factor=None), "factor"),
    (_rope("compress", rope_type="longrope"), "rope_type"),
    (_rope("main", rope_type="yarn"), "rope_parameters.main.rope_type"),
    (_rope("main", rope_theta=1.0), "rope_parameters.main.rope_theta"),
    (_rope("compress", partial_rotary_factor=0.25), "partial_rotary_factor"),
])
def test_contradictory_or_unmodelled_keys_are_errors(d: dict[str, Any], culprit: str) -> None:
    with pytest.raises(ConfigError, match=culprit):
        DSV4Config.from_dict(d)


def test_a_config_written_by_transformers_reads_back(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = DSV4Config.preset("tiny")
    kw = {k: v for k, v in cfg.to_dict(dialect="transformers").items()
          if k not in ("simulate_quant", "multi_stream_token_threshold", "model_type")}
    transformers.DeepseekV4Config(**kw).save_pretrained(tmp_path)
    on_disk = json.loads((tmp_path / "config.json").read_text())
    assert "layer_types" in on_disk and "compress_ratios" not in on_disk
    assert DSV4Config.from_pretrained(tmp_path) == cfg.replace(simulate_quant=True)
    # and transformers reads the official dialect to the same model
    official = {k: v for k, v in cfg.to_dict().items()
                if k not in ("simulate_quant", "multi_stream_token_threshold")}
    assert DSV4Config.from_dict(transformers.DeepseekV4Config(**official).to_dict()) == cfg


# ------------------------------------------------------------------------------ checkpoints
def _stack(cfg: DSV4Config) -> AttentionStack:
    layers = {}
    for i in range(cfg.num_layers_with_mtp):
        layer = build_attention(cfg, i, dtype=torch.bfloat16)
        layer.load_weights(random_layer_weights(cfg, i, seed=3).items())
        layers[i] = layer
    return AttentionStack(cfg, layers)


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    return out


def test_official_to_transformers_to_official_is_bit_exact(tmp_path: Path) -> None:
    cfg = DSV4Config.preset("tiny")  # fp8 weights with block scales, every layer type + MTP
    save_checkpoint(_stack(cfg), tmp_path / "official")
    first = load_checkpoint(tmp_path / "official")
    save_checkpoint(first, tmp_path / "tf", dialect="transformers")
    tf = _tensors(tmp_path / "tf")
    assert "model.layers.1.self_attn.q_a_proj.weight_scale_inv" in tf
    assert "model.layers.1.self_attn.compressor.indexer.scorer.weights_proj.weight" in tf
    assert "mtp.0.self_attn.sinks" in tf
    assert not any(".attn." in k for k in tf)
    assert "layer_types" in json.loads((tmp_path / "tf" / "config.json").read_text())
    second = load_checkpoint(tmp_path / "tf")
    save_checkpoint(second, tmp_path / "back")
    a, b = _tensors(tmp_path / "official"), _tensors(tmp_path / "back")
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k
    assert (tmp_path / "official" / "config.json").read_text() == (
        tmp_path / "back" / "config.json").read_text()


def test_transformers_names_match_the_transformers_model() -> None:
    pytest.importorskip("transformers")
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "integrations"))
    from tiny_hf import tiny_model

    model = tiny_model()
    hf = {k for k in model.state_dict() if ".self_attn." in k}
    official = {}
    for i in range(3):
        layer = build_attention(
            DSV4Config.from_dict(model.config.to_dict()).replace(fp8_weights=False), i)
        official.update({f"layers.{i}.attn.{n}": None for n in layer.official_weight_names()})
    assert set(names.from_official(official, "transformers")) == hf


def test_a_save_pretrained_folder_loads(tmp_path: Path) -> None:
    """save_pretrained undoes transformers' load renames: model.layers.{i}.attn.<official>, with
    the attention's kv_norm written as attn.norm. transformers keeps no MTP layer while its
    config declares one: by default the layers the folder holds load, and a warning names the
    MTP layer left out; asking for that layer by id is an error saying how to load the rest."""
    pytest.importorskip("transformers")
    import sys
    import warnings

    from dsv4.checkpoint import MissingMTPLayersWarning

    sys.path.insert(0, str(Path(__file__).parent / "integrations"))
    from tiny_hf import tiny_model

    model = tiny_model()
    model.save_pretrained(tmp_path)
    stored = _tensors(tmp_path)
    assert "model.layers.0.attn.norm.weight" in stored
    assert DSV4Config.from_pretrained(tmp_path).num_nextn_predict_layers == 1
    with pytest.warns(MissingMTPLayersWarning, match=r"without MTP layer\(s\) \[3\]"):
        default = load_checkpoint(tmp_path, dtype=torch.float32)
    assert default.layer_ids == [0, 1, 2]
    with pytest.raises(CheckpointError, match=r"no tensor for layer 3 .*it is an MTP layer.*"
                       r"layers=None"):
        load_checkpoint(tmp_path, layers=[0, 3], dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the layers asked for by id: nothing to say
        stack = load_checkpoint(tmp_path, layers=[0, 1, 2], dtype=torch.float32)
    state = model.state_dict()
    for i in range(3):
        assert torch.equal(stack[i].kv_norm.weight,
                           state[f"model.layers.{i}.self_attn.kv_norm.weight"])
        assert torch.equal(stack[i].wq_b.weight,
                           state[f"model.layers.{i}.self_attn.q_b_proj.weight"])


def test_mixed_spellings_are_an_error(tmp_path: Path) -> None:
    cfg = DSV4Config.preset("tiny")
    save_checkpoint(_stack(cfg), tmp_path)
    tensors = _tensors(tmp_path)
    renamed = names.from_official({k: v for k, v in tensors.items() if k.startswith("layers.1.")},
                                  "transformers")
    mixed = {**{k: v for k, v in tensors.items() if not k.startswith("layers.1.")}, **renamed}
    (tmp_path / "model.safetensors").unlink()
    save_file(mixed, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="mixes attention tensor spellings"):
        load_checkpoint(tmp_path)


def test_name_translation_errors_name_the_tensor() -> None:
    with pytest.raises(names.NameDialectError, match="q_c_proj"):
        names.to_official("model.layers.0.self_attn.q_c_proj.weight")
    with pytest.raises(names.NameDialectError, match="dialect='vllm'"):
        names.from_official({}, "vllm")
    with pytest.raises(ValueError, match="dialect"):
        save_checkpoint(torch.nn.Module(), "/nonexistent", dialect="vllm")
    with pytest.raises(ConfigError, match="dialect"):
        DSV4Config.preset("tiny").to_dict(dialect="vllm")


def test_a_bf16_save_pretrained_folder_with_float32_norms_loads_in_bf16(tmp_path: Path) -> None:
    """transformers keeps norm weights in float32 in a bf16 model; they load into a bf16 layer
    when their values are exactly bf16 (and are refused, naming the tensor, when not)."""
    pytest.importorskip("transformers")
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "integrations"))
    from tiny_hf import tiny_model

    model = tiny_model(dtype=torch.bfloat16)  # sinks / position_bias stay bf16: widened
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):  # as transformers keeps them
            p.data = p.data.float()
    model.save_pretrained(tmp_path)
    assert _tensors(tmp_path)["model.layers.1.attn.q_norm.weight"].dtype == torch.float32
    stack = load_checkpoint(tmp_path, layers=[0, 1, 2], dtype=torch.bfloat16)
    expect = model.model.layers[1].self_attn.q_a_norm.weight
    assert torch.equal(stack[1].q_norm.weight.float(), expect)
    with torch.no_grad():
        model.model.layers[1].self_attn.q_a_norm.weight.add_(1e-4)  # no longer bf16-exact
    model.save_pretrained(tmp_path / "inexact")
    with pytest.raises(CheckpointError, match="q_norm.weight"):
        load_checkpoint(tmp_path / "inexact", layers=[1], dtype=torch.bfloat16)
