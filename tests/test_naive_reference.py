"""Sanity tests of the naive float64 oracle: causality, window extent, hand-computed small cases,
FP8 dequantisation and input validation."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4.config import DSV4Config
from dsv4.testing.naive_reference import naive_attention_forward

F64 = torch.float64
FP8 = ("wq_a", "wkv", "wq_b", "wo_a", "wo_b", "indexer.wq_b")


def _tiny(fp8: bool = True) -> DSV4Config:
    cfg = DSV4Config.preset("tiny")
    return cfg if fp8 else cfg.replace(fp8_weights=False)


def _layer(cfg: DSV4Config, ratio: int) -> int:
    return cfg.layer_of_ratio(ratio)


def _fp8_quantise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 weight, e8m0 scale [ceil(N/128), ceil(K/128)], exact float64 dequantised weight)."""
    n, k = w.shape
    gn, gk = math.ceil(n / 128), math.ceil(k / 128)
    exps = torch.empty(gn, gk, dtype=torch.int64)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for i in range(gn):
        for j in range(gk):
            blk = w[128 * i:128 * i + 128, 128 * j:128 * j + 128]
            amax = max(float(blk.abs().max()), 1e-30)
            e = math.ceil(math.log2(amax / 448))
            exps[i, j] = e
            q[128 * i:128 * i + 128, 128 * j:128 * j + 128] = (blk / 2.0**e).to(torch.float8_e4m3fn)
    scale = (exps + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
    s_full = (2.0 ** exps.to(F64)).repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return q, scale, q.to(F64) * s_full


def random_weights(cfg: DSV4Config, layer_id: int, seed: int = 0
                   ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Random layer weights in checkpoint form, plus their exact float64 values (no suffixes)."""
    g = torch.Generator().manual_seed(seed)
    ratio = cfg.compress_ratio(layer_id)
    H, d, n_h = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads
    q_r, G, r_o = cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank
    n_i, d_i = cfg.index_n_heads, cfg.index_head_dim

    def lin(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, generator=g, dtype=F64) / math.sqrt(k)

    def norm(n: int) -> torch.Tensor:
        return (1 + 0.1 * torch.randn(n, generator=g, dtype=F64)).to(torch.bfloat16)

    dense: dict[str, torch.Tensor] = {
        "wq_a": lin(q_r, H), "wkv": lin(d, H), "wq_b": lin(n_h * d, q_r),
        "wo_a": lin(G * r_o, cfg.heads_per_group * d), "wo_b": lin(H, G * r_o),
        "q_norm": norm(q_r), "kv_norm": norm(d),
        "attn_sink": torch.randn(n_h, generator=g, dtype=F64).float(),
    }
    if ratio > 0:
        coff = 2 if ratio == 4 else 1
        dense.update({
            "compressor.wkv": lin(coff * d, H).to(torch.bfloat16),
            "compressor.wgate": lin(coff * d, H).to(torch.bfloat16),
            "compressor.ape": (0.5 * torch.randn(ratio, coff * d, generator=g, dtype=F64)).float(),
            "compressor.norm": norm(d),
        })
    if ratio == 4:
        dense.update({
            "indexer.wq_b": lin(n_i * d_i, q_r),
            "indexer.weights_proj": lin(n_i, H).to(torch.bfloat16),
            "indexer.compressor.wkv": lin(2 * d_i, H).to(torch.bfloat16),
            "indexer.compressor.wgate": lin(2 * d_i, H).to(torch.bfloat16),
            "indexer.compressor.ape": (0.5 * torch.randn(4, 2 * d_i, generator=g,
                                                         dtype=F64)).float(),
            "indexer.compressor.norm": norm(d_i),
        })
    ckpt: dict[str, torch.Tensor] = {}
    exact: dict[str, torch.Tensor] = {}
    for name, w in dense.items():
        key = name if name.endswith(("ape", "attn_sink")) else f"{name}.weight"
        if name in FP8 and cfg.fp8_weights:
            ckpt[key], ckpt[f"{name}.scale"], exact[name] = _fp8_quantise(w)
        else:
            ckpt[key] = w
            exact[name] = w.to(F64)
    return ckpt, exact


def _x(cfg: DSV4Config, T: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(seed), dtype=F64)


# --------------------------------------------------------------------------- causality / extent


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_causality(ratio: int) -> None:
    """Perturbing tokens after p leaves rows <= p bit-for-bit unchanged, and changes later rows."""
    cfg = _tiny()
    layer = _layer(cfg, ratio)
    ckpt, _ = random_weights(cfg, layer)
    T, p = 272, 259  # two ratio-128 entries visible at p; entry 1 completes at position 255
    x = _x(cfg, T)
    y = naive_attention_forward(cfg, layer, ckpt, x)
    x2 = x.clone()
    x2[p + 1:] += torch.randn(T - p - 1, cfg.hidden_size, dtype=F64)
    y2 = naive_attention_forward(cfg, layer, ckpt, x2)
    torch.testing.assert_close(y2[:p + 1], y[:p + 1], rtol=0, atol=1e-13)
    assert (y2[p + 1:] - y[p + 1:]).abs().amax(dim=-1).min() > 1e-6
    # a prefix evaluated alone gives the same rows (prefill from 0 is prefix-consistent)
    y_prefix = naive_attention_forward(cfg, layer, ckpt, x[:p + 1])
    torch.testing.assert_close(y_prefix, y[:p + 1], rtol=0, atol=1e-12)


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_information_outside_the_window(ratio: int) -> None:
    """Row p sees x[p - win + 1] through the window; x[p - win] only through compressed entries."""
    cfg = _tiny()
    layer = _layer(cfg, ratio)
    ckpt, _ = random_weights(cfg, layer)
    win, T = cfg.sliding_window, 140
    p = T - 1  # 35 ratio-4 entries (> top-k 8), one ratio-128 entry
    x = _x(cfg, T)
    y = naive_attention_forward(cfg, layer, ckpt, x)

    def row_after_bump(pos: int) -> torch.Tensor:
        x2 = x.clone()
        x2[pos] += 1.0
        return naive_attention_forward(cfg, layer, ckpt, x2)[p]

    assert (row_after_bump(p - win + 1) - y[p]).abs().max() > 1e-6
    outside = (row_after_bump(p - win) - y[p]).abs().max()
    if ratio == 0:
        assert outside == 0
    elif ratio == 128:
        assert outside > 1e-6  # entry 0 covers positions 0..127 and is always visible
    # ratio 4: x[p - win] feeds entries 30 and 31, which may or may not be in the top-k


# --------------------------------------------------------------------------- hand-computed cases


def _rms(v: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def _q_kv_by_hand(cfg: DSV4Config, W: dict[str, torch.Tensor], x: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    eps = cfg.rms_norm_eps
    qr = _rms(x @ W["wq_a"].T, W["q_norm"], eps)
    kv = _rms(x @ W["wkv"].T, W["kv_norm"], eps)
    q = _rms((qr @ W["wq_b"].T).view(x.shape[0], cfg.num_attention_heads, cfg.head_dim), None,
             eps)
    return q, kv


def _out_proj_by_hand(cfg: DSV4Config, W: dict[str, torch.Tensor], o: torch.Tensor
                      ) -> torch.Tensor:
    """o [T, n_h, d] (already inverse-rotated) -> y [T, H]; group g = heads g*hpg .. g*hpg+hpg-1."""
    hpg, d, r_o = cfg.heads_per_group, cfg.head_dim, cfg.o_lora_rank
    z = [o[:, g * hpg:(g + 1) * hpg].reshape(o.shape[0], hpg * d)
         @ W["wo_a"][g * r_o:(g + 1) * r_o].T for g in range(cfg.o_groups)]
    return torch.cat(z, dim=-1) @ W["wo_b"].T


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_single_token_formula(ratio: int) -> None:
    """T = 1: one window key, RoPE at 0 is the identity, o_h = k * e^l / (e^l + e^sink_h)."""
    cfg = _tiny()
    layer = _layer(cfg, ratio)
    ckpt, W = random_weights(cfg, layer, seed=3)
    x = _x(cfg, 1, seed=4)
    q, kv = _q_kv_by_hand(cfg, W, x)
    logit = (q[0] @ kv[0]) / math.sqrt(cfg.head_dim)  # [n_h]
    prob = torch.exp(logit) / (torch.exp(logit) + torch.exp(W["attn_sink"]))
    o = prob[None, :, None] * kv[:, None, :]
    torch.testing.assert_close(naive_attention_forward(cfg, layer, ckpt, x),
                               _out_proj_by_hand(cfg, W, o), rtol=1e-12, atol=1e-12)


def _rotate(v: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """GPT-J pairs of the last 2*len(angle) dims as complex numbers, times e^{i angle}."""
    n = 2 * angle.numel()
    c = torch.view_as_complex(v[..., -n:].reshape(*v.shape[:-1], n // 2, 2).contiguous())
    rot = torch.view_as_real(c * torch.polar(torch.ones_like(angle, dtype=F64), angle.to(F64)))
    return torch.cat([v[..., :-n], rot.flatten(-2)], dim=-1)


def test_two_tokens_rope_by_hand() -> None:
    """T = 2 on a ratio-0 layer: query 1 attends keys 0 and 1 rotated at their positions."""
    cfg = _tiny()
    layer = _layer(cfg, 0)
    ckpt, W = random_weights(cfg, layer, seed=5)
    x = _x(cfg, 2, seed=6)
    d_r = cfg.qk_rope_head_dim
    f = 1.0 / cfg.rope_theta ** (torch.arange(0, d_r, 2, dtype=torch.float32) / d_r)  # float32
    q, kv = _q_kv_by_hand(cfg, W, x)
    q1, k0, k1 = _rotate(q[1], f), kv[0], _rotate(kv[1], f)
    keys = torch.stack([k0, k1])
    logits = q1 @ keys.T / math.sqrt(cfg.head_dim)  # [n_h, 2]
    e = torch.exp(logits)
    o1 = (e @ keys) / (e.sum(-1) + torch.exp(W["attn_sink"]))[:, None]
    o1 = _rotate(o1, -f)
    y = naive_attention_forward(cfg, layer, ckpt, x)
    torch.testing.assert_close(y[1], _out_proj_by_hand(cfg, W, o1[None])[0], rtol=1e-12,
                               atol=1e-12)


def _yarn_freqs(cfg: DSV4Config) -> torch.Tensor:
    """docs/spec.md §4 for the compressed layers: with base 160000 pairs 0..15 keep f_i, 25..
    use f_i/16."""
    d_r, base = cfg.qk_rope_head_dim, cfg.compress_rope_theta
    f = 1.0 / base ** (torch.arange(0, d_r, 2, dtype=torch.float32) / d_r)  # float32 throughout
    low, high = 15, 25  # from the worked example in §4 (Flash/tiny YaRN settings)
    smooth = 1 - ((torch.arange(d_r // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return f / 16 * (1 - smooth) + f * smooth


def test_first_c4a_entry_by_hand() -> None:
    """T = 4 on a ratio-4 layer: query 3 sees the window and entry 0 (softmax of 4 tokens over the
    channel half [d, 2d), ape on the scores, RoPE at 0), chosen by the indexer as the only one."""
    cfg = _tiny()
    layer = _layer(cfg, 4)
    ckpt, W = random_weights(cfg, layer, seed=7)
    x = _x(cfg, 4, seed=8)
    d, eps = cfg.head_dim, cfg.rms_norm_eps
    f = _yarn_freqs(cfg)
    q, kv = _q_kv_by_hand(cfg, W, x)
    a = (x @ W["compressor.wkv"].T)[:, d:]
    b = (x @ W["compressor.wgate"].T + W["compressor.ape"])[:, d:]
    u = (torch.softmax(b, dim=0) * a).sum(0)
    entry0 = _rms(u, W["compressor.norm"], eps)  # rotation at position 0 is the identity
    keys = torch.cat([torch.stack([_rotate(kv[t], t * f) for t in range(4)]), entry0[None]])
    q3 = _rotate(q[3], 3 * f)
    logits = q3 @ keys.T / math.sqrt(d)
    m = logits.max(-1, keepdim=True).values
    e = torch.exp(logits - m)
    o3 = (e @ keys) / (e.sum(-1) + torch.exp(W["attn_sink"] - m[:, 0]))[:, None]
    o3 = _rotate(o3, -3 * f)
    y = naive_attention_forward(cfg, layer, ckpt, x)
    torch.testing.assert_close(y[3], _out_proj_by_hand(cfg, W, o3[None])[0], rtol=1e-11,
                               atol=1e-12)


def test_yarn_example_bounds_match_config_helper() -> None:
    from dsv4.config import yarn_ramp_bounds

    cfg = _tiny()
    assert cfg.rope_scaling is not None
    low, high = yarn_ramp_bounds(cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.rope_scaling)
    assert (low, high) == (15, 25)


# --------------------------------------------------------------------------- weights and inputs


def test_dense_weights_equal_dequantised_fp8() -> None:
    """fp8_weights=False with the exact dequantised weights gives the same output; so does a
    float32 power-of-two scale instead of e8m0."""
    cfg8, cfg = _tiny(), _tiny(fp8=False)
    layer = _layer(cfg, 4)
    ckpt, W = random_weights(cfg8, layer, seed=9)
    x = _x(cfg, 40, seed=10)
    y = naive_attention_forward(cfg8, layer, ckpt, x)
    dense = {k: v for k, v in ckpt.items() if not k.endswith(".scale")}
    for name in FP8:
        dense[f"{name}.weight"] = W[name]
    torch.testing.assert_close(naive_attention_forward(cfg, layer, dense, x), y, rtol=0,
                               atol=1e-13)
    f32 = dict(ckpt)
    f32["wo_b.scale"] = ckpt["wo_b.scale"].to(torch.float32)
    torch.testing.assert_close(naive_attention_forward(cfg8, layer, f32, x), y, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["wkv.weight", "wq_b.scale", "attn_sink", "compressor.ape",
                                  "indexer.compressor.norm.weight"])
def test_missing_weight_raises(name: str) -> None:
    cfg = _tiny()
    layer = _layer(cfg, 4)
    ckpt, _ = random_weights(cfg, layer)
    del ckpt[name]
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        naive_attention_forward(cfg, layer, ckpt, _x(cfg, 3))


def test_bad_inputs_raise() -> None:
    cfg = _tiny()
    layer = _layer(cfg, 0)
    ckpt, _ = random_weights(cfg, layer)
    with pytest.raises(ValueError, match="float64"):
        naive_attention_forward(cfg, layer, ckpt, _x(cfg, 3).float())
    with pytest.raises(ValueError, match="shape"):
        naive_attention_forward(cfg, layer, ckpt, _x(cfg, 3)[:, :-1])
    with pytest.raises(ValueError, match="shape"):
        naive_attention_forward(cfg, layer, ckpt, _x(cfg, 3)[0])
    bad = dict(ckpt)
    bad["wq_a.scale"] = ckpt["wq_a.scale"][:, :1]
    with pytest.raises(ValueError, match=r"wq_a\.scale"):
        naive_attention_forward(cfg, layer, bad, _x(cfg, 3))
