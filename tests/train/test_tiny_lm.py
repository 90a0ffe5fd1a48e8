"""The shipped tiny LM: loads through load_checkpoint, answers, and collapses on the upstream
bug; bad model folders and prompts fail clearly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import dsv4.tinylm.checkpoint as model_ckpt
from dsv4 import CheckpointError, DeepseekV4Attention, platforms
from dsv4.checkpoint import read_layer_tensors
from dsv4.platforms.preshuffle import PreshuffleAttention
from dsv4.tinylm.checkpoint import ATTN_SHARD, default_model_dir, load_tiny_lm, save_tiny_lm
from dsv4.tinylm.commands import eval_verdict
from dsv4.tinylm.config import TinyLMConfig
from dsv4.tinylm.evaluate import answer_problems, evaluate, token_agreement
from dsv4.tinylm.generate import PromptError, generate, generate_ids
from dsv4.tinylm.task import heldout_problems
from dsv4_train.attention import QuantOptions, load_attention_tensors
from dsv4_train.lm import TrainLM
from dsv4_train.train import greedy_answers

from conftest import rel_err

MODEL = default_model_dir()
SUBSET = 50
# The goals (>= 0.95 on all 400, every platform within one problem, >= 99.9 % token
# agreement); the shipped model answers all 400 on every CPU platform with identical tokens.
MIN_SUBSET_ACCURACY = 0.95
MIN_TOKEN_AGREEMENT = 0.999


@pytest.fixture(scope="module")
def reference_lm():
    return load_tiny_lm(MODEL)


def test_shipped_model_is_official_names_and_dtypes_and_small():
    size = sum(f.stat().st_size for f in MODEL.iterdir())
    assert size <= 20 * 2**20
    cfg = TinyLMConfig.from_pretrained(MODEL)
    assert sorted(set(cfg.attn.compress_ratios[:cfg.num_layers])) == [0, 4, 128]
    assert cfg.attn.fp8_weights
    with safe_open(str(MODEL / ATTN_SHARD), framework="pt") as f:
        dtypes = {n: f.get_slice(n).get_dtype() for n in f.keys()}  # noqa: SIM118
    assert dtypes["layers.1.attn.wq_a.weight"] == "F8_E4M3"
    assert dtypes["layers.1.attn.wq_a.scale"] == "F8_E8M0"
    assert dtypes["layers.1.attn.indexer.wq_b.weight"] == "F8_E4M3"
    assert dtypes["layers.1.attn.compressor.wkv.weight"] == "BF16"
    assert dtypes["layers.2.attn.compressor.ape"] == "F32"


def test_attention_layers_come_through_load_checkpoint(monkeypatch):
    seen = []
    real = model_ckpt.load_checkpoint

    def spy(*args, **kwargs):
        stack = real(*args, **kwargs)
        seen.append(stack)
        return stack

    monkeypatch.setattr(model_ckpt, "load_checkpoint", spy)
    lm = load_tiny_lm(MODEL, platform="preshuffle")
    assert len(seen) == 1
    layers = [b.attn for b in lm.layers]
    assert all(isinstance(a, PreshuffleAttention) for a in layers)
    assert [a is seen[0][i] for i, a in enumerate(layers)] == [True] * len(layers)


def test_accuracy_on_a_subset(reference_lm):
    problems = heldout_problems(SUBSET)
    answers = generate(reference_lm, [p.prompt for p in problems], max_new_tokens=4)
    acc = sum(a == p.answer for a, p in zip(answers, problems, strict=True)) / SUBSET
    assert acc >= MIN_SUBSET_ACCURACY, list(zip(answers, [p.answer for p in problems],
                                                strict=True))


def test_every_cpu_platform_and_fusion_agrees_with_reference():
    runs = evaluate(MODEL, platforms.available("cpu"), "cpu", n=SUBSET)
    assert len(runs) == 2 * len(platforms.available("cpu"))
    for r in runs:
        assert not r.error and abs(r.correct - runs[0].correct) <= 1, r
        assert r.token_agreement >= MIN_TOKEN_AGREEMENT, r


def test_decode_batch_does_not_change_the_answers(reference_lm):
    """Decoding 3 sequences per forward (a server's micro-batches) answers exactly as decoding
    all of them together; a non-positive batch is refused."""
    tok = reference_lm.cfg.tokenizer
    prompts = [tok.encode(p.prompt, bos=True) for p in heldout_problems(10)]
    together = generate_ids(reference_lm, prompts, 4)
    assert generate_ids(reference_lm, prompts, 4, decode_batch=3) == together
    with pytest.raises(ValueError, match="decode_batch=0"):
        generate_ids(reference_lm, prompts, 4, decode_batch=0)


class GraphSwitchRecorder(DeepseekV4Attention):
    """A CPU stand-in for a platform with CUDA graphs: records what the eval switches."""

    switched: list[bool] = []

    def use_cuda_graphs(self, enabled: bool) -> None:
        GraphSwitchRecorder.switched.append(enabled)


def test_eval_runs_graph_platforms_with_graphs_on_and_off():
    platforms.register_platform(platforms.Platform(
        "graph_recorder", "records use_cuda_graphs", f"{__name__}:GraphSwitchRecorder"))
    GraphSwitchRecorder.switched.clear()
    try:
        runs = evaluate(MODEL, ["graph_recorder"], "cpu", n=4, fusions=(False,))
    finally:
        platforms.unregister_platform("graph_recorder")
    assert [(r.platform, r.mode) for r in runs] == [
        ("reference", "eager"), ("graph_recorder", "graph"), ("graph_recorder", "eager")]
    layers = TinyLMConfig.from_pretrained(MODEL).num_layers
    assert GraphSwitchRecorder.switched == [True] * layers + [False] * layers
    assert all(r.token_agreement == 1.0 for r in runs)


@pytest.mark.cuda
def test_cuda_platform_graph_and_eager_answer_like_reference():
    """On the GPU, in decode micro-batches of 16 (the cuda platform's one-launch input stage),
    with its CUDA graphs on and off: every run within one problem of reference."""
    runs = evaluate(MODEL, ["cuda"], "cuda", n=SUBSET)
    assert [(r.platform, r.fusion, r.mode) for r in runs] == [
        ("reference", False, "eager"), ("cuda", False, "graph"), ("cuda", False, "eager"),
        ("cuda", True, "graph"), ("cuda", True, "eager")]
    assert runs[0].accuracy >= MIN_SUBSET_ACCURACY
    for r in runs:
        assert not r.error and abs(r.correct - runs[0].correct) <= 1, r
        assert r.token_agreement >= MIN_TOKEN_AGREEMENT, r


class PlainGemmPreshuffle(PreshuffleAttention):
    """The upstream bug: the preshuffled fp8 weight sent through a plain GEMM."""

    def _fused_wqa_wkv_gemm(self, x):
        from dsv4.layers.fp8 import dequantize_fp8_block

        w = dequantize_fp8_block(self.fused_wqa_wkv.weight.detach(), self.fused_wqa_wkv.scale,
                                 x.dtype)
        return torch.nn.functional.linear(x, w)


def test_the_upstream_bug_collapses_accuracy():
    platforms.register_platform(platforms.Platform(
        "plain_gemm_bug", "preshuffled weights through a plain GEMM",
        f"{__name__}:PlainGemmPreshuffle", pass_names=("compressor_fusion", "preshuffle")))
    try:
        bad = answer_problems(MODEL, heldout_problems(SUBSET), "plain_gemm_bug", fusion=True)
    finally:
        platforms.unregister_platform("plain_gemm_bug")
    good = answer_problems(MODEL, heldout_problems(SUBSET), "preshuffle", fusion=True)
    assert good.accuracy >= MIN_SUBSET_ACCURACY
    assert bad.accuracy < 0.05
    assert token_agreement(bad.tokens, good.tokens) < 0.5
    ref = answer_problems(MODEL, heldout_problems(SUBSET), "reference", fusion=False)
    for run in (good, bad):
        run.token_agreement = token_agreement(run.tokens, ref.tokens)
    assert eval_verdict([ref, good])[0]  # what `dsv4 eval` / `dsv4 demo` exit with
    ok, verdict = eval_verdict([ref, bad])
    assert not ok and "check FAILED: plain_gemm_bug fusion on" in verdict


def test_training_model_equals_inference_model_in_float64(tmp_path):
    """Export -> save_tiny_lm -> load_tiny_lm: the inference LM (float64, fp8 weights) computes
    the training LM with checkpoint weights. Simulations off: the FP4 indexer simulation makes
    exact score ties common, and a 1-ulp difference in summation order may then pick another
    entry (the attention-level test covers the simulations)."""
    cfg = TinyLMConfig.preset()
    train = TrainLM(cfg).double()
    save_tiny_lm(train.export_tensors(fp8=True), cfg, tmp_path)
    lm = load_tiny_lm(tmp_path, dtype=torch.float64, simulate_quant=False)
    tokens = torch.randint(3, cfg.vocab_size, (1, 150))
    with torch.no_grad():
        ref, _ = train(tokens, quant=QuantOptions(checkpoint_weights=True), dtype=torch.float64)
    caches = [lm.new_caches(150)]
    got = lm(tokens[0], torch.arange(150), caches, [150])
    assert rel_err(got, ref[0]) < 1e-10


def test_shipped_model_decodes_like_its_training_implementation():
    """float64 on both sides: the training implementation (full re-forward per token) and the
    inference layers (prefill + batched decode through the caches) give the same answers."""
    problems = heldout_problems(12)
    cfg = TinyLMConfig.from_pretrained(MODEL)
    train = TrainLM(cfg).double()
    with torch.no_grad():
        for name, t in model_ckpt.read_lm_tensors(MODEL, cfg).items():
            train.get_parameter(name).copy_(t.double())
    for i, t in read_layer_tensors(MODEL, cfg.attn, range(cfg.num_layers)).items():
        load_attention_tensors(train.layers[i].attn, t)  # type: ignore[arg-type]
    want = greedy_answers(train, problems, cfg.tokenizer, dtype=torch.float64)
    lm = load_tiny_lm(MODEL, dtype=torch.float64)
    assert generate(lm, [p.prompt for p in problems], 4) == want


# ---------------------------------------------------------------------------------- bad input
@pytest.fixture
def model_copy(tmp_path):
    dest = tmp_path / "m"
    shutil.copytree(MODEL, dest)
    return dest


def test_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_tiny_lm(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="config.json"):
        load_tiny_lm(tmp_path / "empty")


def test_corrupt_shard_is_a_clear_error(model_copy):
    shard = model_copy / ATTN_SHARD
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="corrupt"):
        load_tiny_lm(model_copy)


def test_missing_shard_is_a_clear_error(model_copy):
    (model_copy / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="does not exist"):
        load_tiny_lm(model_copy)


@pytest.mark.parametrize(("key", "value", "match"), [
    ("hidden_size", 128, "shape"),
    ("intermediate_size", 256, "ffn.w1.weight"),
    ("num_hidden_layers", 5, "layer 4"),
    ("index_n_heads", 8, "indexer"),
])
def test_config_that_does_not_match_the_tensors(model_copy, key, value, match):
    path = model_copy / "config.json"
    d = json.loads(path.read_text())
    d[key] = value
    if key == "num_hidden_layers":
        d["compress_ratios"] = [*d["compress_ratios"], 0]
    path.write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match=match):
        load_tiny_lm(model_copy)


def test_invalid_config_json_is_a_clear_error(model_copy):
    (model_copy / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_tiny_lm(model_copy)


def test_bad_prompts(reference_lm):
    with pytest.raises(PromptError, match="empty"):
        generate(reference_lm, [""])
    limit = reference_lm.cfg.max_seq_len
    with pytest.raises(PromptError, match="max_position_embeddings"):
        generate(reference_lm, ["c" * limit])
    with pytest.raises(PromptError, match=r"\['#'\]"):
        generate(reference_lm, ["a=1;#"])
    assert isinstance(reference_lm.layers[0].attn, DeepseekV4Attention)


def test_cli_reports_bad_input_in_one_line(capsys, tmp_path):
    from dsv4.cli import main

    assert main(["generate", "--prompt", ""]) == 2
    assert "dsv4 generate: error: prompt 1 of 1 is empty" in capsys.readouterr().err
    assert main(["eval", "--model", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["eval", "--decode-batch", "-3"]) == 2
    assert "--decode-batch -3" in capsys.readouterr().err
    assert main(["generate", "--prompt", "a=1;b=2;a+b=", "--only-answer"]) == 0
    assert capsys.readouterr().out.strip().isdigit()


def test_shipped_report_is_committed():
    report = json.loads((MODEL / "train_report.json").read_text())
    assert report["steps"] > 0 and report["command"]
    assert (MODEL / "loss_curve.png").stat().st_size > 1000
    assert Path(MODEL / "config.json").is_file()
