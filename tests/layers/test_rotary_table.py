"""The RoPE inverse-frequency table as the model defines it: float32 arithmetic throughout, as
DeepSeek's reference ``precompute_freqs_cis`` computes it (not float64 rounded to float32)."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4 import DSV4Config
from dsv4.layers.rotary import RotaryEmbedding
from dsv4.testing.naive_reference import rope_inverse_frequencies


def float32_table(d: int, base: float, yarn=None) -> torch.Tensor:
    """A few lines written from the reference's definition, independent of the package."""
    f = 1.0 / torch.pow(torch.tensor(base, dtype=torch.float32),
                        torch.arange(0, d, 2).to(torch.float32) / d)
    if yarn is None:
        return f

    def dim_of(rotations: float) -> float:
        return d * math.log(yarn.original_max_position_embeddings
                            / (rotations * 2 * math.pi)) / (2 * math.log(base))

    lo = max(math.floor(dim_of(yarn.beta_fast)), 0)
    hi = min(math.ceil(dim_of(yarn.beta_slow)), d - 1)
    hi = hi + 0.001 if lo == hi else hi
    smooth = 1 - torch.clamp((torch.arange(d // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1)
    return f / yarn.factor * (1 - smooth) + f * smooth


@pytest.mark.parametrize("ratio", [0, 4])
def test_table_is_the_float32_definition(ratio):
    cfg = DSV4Config.preset("flash")
    base = cfg.rope_theta if ratio == 0 else cfg.compress_rope_theta
    want = float32_table(cfg.qk_rope_head_dim, base, cfg.rope_scaling if ratio else None)
    got = RotaryEmbedding.for_layer(cfg, ratio).inv_freq
    assert got.dtype == torch.float32
    assert torch.equal(got, want)
    assert torch.equal(rope_inverse_frequencies(cfg, ratio), want)  # the oracle agrees


@pytest.mark.parametrize("ratio,pinned", [
    (0, {1: "0x1.7ff222p-1", 5: "0x1.e5a846p-3", 17: "0x1.eb736p-8"}),
    (4, {1: "0x1.601474p-1", 6: "0x1.b11968p-4", 17: "0x1.6e29cp-10", 31: "0x1.30f89ap-21"}),
])
def test_pinned_entries(ratio, pinned):
    """Entries 5 (SWA) and 6, 31 (YaRN) are among those one float32 unit off when the table is
    computed in float64 and rounded."""
    table = RotaryEmbedding.for_layer(DSV4Config.preset("flash"), ratio).inv_freq
    for i, value in pinned.items():
        assert float(table[i]) == float.fromhex(value), i


def test_module_repr_names_its_table():
    """The module prints what picks its table (rope_dim, base, YaRN or not) - a refactor had
    once left extra_repr behind a return in a module-level function (fixed in 9f86ec3)."""
    cfg = DSV4Config.preset("tiny")
    assert repr(RotaryEmbedding.for_layer(cfg, 4)) == (
        f"RotaryEmbedding(rope_dim={cfg.qk_rope_head_dim}, base={cfg.compress_rope_theta}, "
        "yarn=True)")
    assert repr(RotaryEmbedding.for_layer(cfg, 0)).endswith(
        f"base={cfg.rope_theta}, yarn=False)")
