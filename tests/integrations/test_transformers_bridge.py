"""dsv4's attention inside a transformers DeepseekV4ForCausalLM: same logits, same generations,
left padding, undo, failure roll-back."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from dsv4.integrations.transformers import (  # noqa: E402
    BridgeError,
    DSV4AttentionAdapter,
    DSV4Cache,
    use_dsv4_attention,
)
from dsv4.platforms import available  # noqa: E402

from tiny_hf import tiny_model  # noqa: E402

CPU_PLATFORMS = list(available("cpu"))
NEW = 32
# 100 prompt + 32 new tokens: the sequence crosses the window (8), many ratio-4 entries (the
# indexer picks 4 of up to 33) and the first ratio-128 entry during decode.
PROMPT = 100


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Any:
    """Tiny matrices: one intra-op thread is ~20x faster than two on a busy 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(1, 128, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_model()


@pytest.fixture(scope="module")
def reference(model: Any) -> dict[str, torch.Tensor]:
    """Unmodified transformers: logits of a 140-token forward and greedy generations."""
    with torch.no_grad():
        long = _prompt(140, 1)
        out = {"long": long, "logits": model(long, use_cache=False).logits}
    a, b = _prompt(PROMPT, 2), _prompt(PROMPT - 20, 3)
    out["a"], out["b"] = a, b
    out["gen_a"] = model.generate(a, max_new_tokens=NEW, do_sample=False)
    out["gen_b"] = model.generate(b, max_new_tokens=NEW, do_sample=False)
    return out


def _snapshot(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("platform", CPU_PLATFORMS)
def test_logits_and_greedy_generation_match_transformers(model: Any, reference: Any,
                                                         platform: str) -> None:
    handle = use_dsv4_attention(model, platform=platform)
    try:
        assert all(isinstance(d.self_attn, DSV4AttentionAdapter) for d in model.model.layers)
        with torch.no_grad():
            logits = model(reference["long"], use_cache=False).logits
        diff = (logits - reference["logits"]).abs().max().item()
        # float32 and unquantised weights: preshuffle's fp8 GEMMs do not apply (its pass skips
        # non-fp8 weights), so every CPU platform is held to float32 rounding
        assert diff < 1e-4 * reference["logits"].abs().max().item(), diff
        gen = model.generate(reference["a"], max_new_tokens=NEW, do_sample=False)
        assert torch.equal(gen, reference["gen_a"])
    finally:
        handle.restore()


@pytest.mark.parametrize("mode", ["eager", "padded"])
def test_decode_calls_run_through_each_layers_runner(model: Any, reference: Any,
                                                     mode: str) -> None:
    """generate()'s decode calls go through each adapter's DecodeRunner (on a GPU its CUDA
    graphs; ``padded``: their fixed-shape steps, eagerly) and give transformers' tokens."""
    handle = use_dsv4_attention(model, decode_mode=mode)
    try:
        gen = model.generate(reference["a"], max_new_tokens=NEW, do_sample=False)
        stats = [d.self_attn.runner.stats for d in model.model.layers]
    finally:
        handle.restore()
    assert torch.equal(gen, reference["gen_a"])
    assert all(s[mode] == NEW - 1 for s in stats), stats  # the first token came from prefill
    with pytest.raises(BridgeError, match="decode_mode='fast'"):
        use_dsv4_attention(model, decode_mode="fast")


def test_left_padded_batch_equals_each_row_alone(model: Any, reference: Any) -> None:
    a, b = reference["a"], reference["b"]
    pad = a.shape[1] - b.shape[1]
    ids = torch.zeros(2, a.shape[1], dtype=torch.long)
    mask = torch.zeros_like(ids)
    ids[0], mask[0] = a[0], 1
    ids[1, pad:], mask[1, pad:] = b[0], 1
    handle = use_dsv4_attention(model)
    try:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
        # and the prefill logits of the padded row equal the row alone (zeros never leak)
        with torch.no_grad():
            padded = model(ids, attention_mask=mask, use_cache=False).logits[1, pad:]
            alone = model(b, use_cache=False).logits[0]
    finally:
        handle.restore()
    assert torch.equal(out[0, -NEW:], reference["gen_a"][0, -NEW:])
    assert torch.equal(out[1, -NEW:], reference["gen_b"][0, -NEW:])
    assert (padded - alone).abs().max().item() < 1e-5 * alone.abs().max().item()


def test_a_padded_row_matches_its_unpadded_run_with_dsv4_not_with_transformers(
        model: Any, reference: Any) -> None:
    """What the module docstring (and the README beside its example) tells a user comparing
    the two on a left-padded batch: unmodified transformers' padded row differs from its own
    unpadded run, dsv4's equals it. If transformers' row ever matches, the note is stale."""
    import dsv4.integrations.transformers as bridge

    b = reference["b"][:, :40]
    pad = 3
    ids = torch.cat([torch.zeros(1, pad, dtype=torch.long), b], dim=1)
    mask = (torch.arange(ids.shape[1]) >= pad).long()[None]

    def padded_vs_alone() -> float:
        with torch.no_grad():
            padded = model(ids, attention_mask=mask, use_cache=False).logits[0, pad:]
            alone = model(b, use_cache=False).logits[0]
        return (padded - alone).abs().max().item() / alone.abs().max().item()

    assert padded_vs_alone() > 1e-2  # transformers' own attention
    handle = use_dsv4_attention(model)
    try:
        assert padded_vs_alone() < 1e-5
    finally:
        handle.restore()
    assert "dsv4 is the one that matches an unpadded run" in " ".join(
        (bridge.__doc__ or "").split())


def test_sampling_matches_transformers_with_the_same_seed(model: Any, reference: Any) -> None:
    a = reference["a"][:, :40]
    torch.manual_seed(7)
    ref = model.generate(a, max_new_tokens=12, do_sample=True, top_k=20)
    handle = use_dsv4_attention(model)
    try:
        torch.manual_seed(7)
        got = model.generate(a, max_new_tokens=12, do_sample=True, top_k=20)
    finally:
        handle.restore()
    assert torch.equal(got, ref)


def test_cached_forward_continues_like_one_call(model: Any, reference: Any) -> None:
    ids = reference["long"][:, :60]
    handle = use_dsv4_attention(model)
    try:
        cache = handle.new_cache(256)
        with torch.no_grad():
            first = model(ids[:, :45], cache=cache, use_cache=True)
            assert first.cache is cache and cache.get_seq_length() == 45
            second = model(ids[:, 45:], cache=cache, use_cache=True).logits
            whole = model(ids, use_cache=False).logits[:, 45:]
    finally:
        handle.restore()
    assert (second - whole).abs().max().item() < 1e-5 * whole.abs().max().item()


def test_bf16_model_runs_close_to_transformers() -> None:
    m = tiny_model(dtype=torch.bfloat16)
    ids = _prompt(60, 4)
    with torch.no_grad():
        ref = m(ids, use_cache=False).logits.float()
        handle = use_dsv4_attention(m)
        try:
            got = m(ids, use_cache=False).logits.float()
            assert handle.layers[0].dtype == torch.bfloat16
            gen = m.generate(ids, max_new_tokens=4, do_sample=False)
        finally:
            handle.restore()
    # bf16 rounding differs (transformers rounds cos/sin to bf16, dsv4 keeps them fp32)
    assert (got - ref).abs().max().item() < 0.1 * ref.abs().max().item()
    assert gen.shape == (1, 64)


def test_restore_puts_back_the_original_modules_and_weights(model: Any) -> None:
    before = _snapshot(model)
    originals = [d.self_attn for d in model.model.layers]
    handle = use_dsv4_attention(model)
    # the original weights were moved into dsv4, not copied
    assert all(p.numel() == 0 for p in originals[1].parameters())
    handle.restore()
    assert [d.self_attn for d in model.model.layers] == originals
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(BridgeError, match="already restored"):
        handle.restore()
    assert "_prepare_cache_for_generation" not in model.__dict__


def test_a_failing_swap_restores_the_layers_already_swapped(model: Any,
                                                            monkeypatch: Any) -> None:
    before = _snapshot(model)
    originals = [d.self_attn for d in model.model.layers]
    with torch.no_grad():
        originals[2].sinks.data = originals[2].sinks.data.clone()
        originals[2].sinks.data[0] = float("nan")  # layer 2 cannot load
    try:
        with pytest.raises(ValueError, match="attn_sink"):
            use_dsv4_attention(model)
    finally:
        originals[2].sinks.data = before["model.layers.2.self_attn.sinks"].clone()
    assert [d.self_attn for d in model.model.layers] == originals
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_cache_filled_by_transformers_is_refused(model: Any) -> None:
    ids = _prompt(20, 5)
    with torch.no_grad():
        hf_cache = model(ids, use_cache=True).cache
    handle = use_dsv4_attention(model)
    try:
        with pytest.raises(BridgeError, match="cannot be continued"):
            model(ids[:, -1:], cache=hf_cache, use_cache=True)
        with pytest.raises(BridgeError, match="2-D padding"):
            model(ids, attention_mask=torch.ones(1, 1, 20, 20), use_cache=False)
        assert isinstance(model(ids, use_cache=True).cache, DSV4Cache)
    finally:
        handle.restore()


def test_not_a_deepseek_v4_model_is_refused() -> None:
    with pytest.raises(BridgeError, match="not a transformers DeepSeek-V4 model"):
        use_dsv4_attention(torch.nn.Linear(2, 2))
