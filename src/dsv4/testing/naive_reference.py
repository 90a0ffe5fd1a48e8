"""Naive float64 evaluation of one DSV4 attention layer over a full sequence (the test oracle).

Written straight from ``docs/spec.md`` (§4-§5, §9 "against a float64 evaluation"), on
purpose without caches, chunking or any code shared with the real implementation: key sets are
rebuilt per query from their definitions, and compressed entries per block from the per-channel
softmax. Everything runs in float64 with the quantisation simulations OFF (no FP8 block-64 kv
simulation, no Hadamard, no FP4, no activation quantisation), whatever ``cfg.simulate_quant`` says.

The only shared convention is the rotary table (so that the oracle and the real layer rotate by
bit-identical angles): inverse frequencies computed in float32 as the model defines them, angle =
float32(position) * float32(frequency) in float32, cos/sin in float64 of that float32 angle.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from dsv4.config import DSV4Config

F64 = torch.float64

FP8_WEIGHT_NAMES: tuple[str, ...] = ("wq_a", "wkv", "wq_b", "wo_a", "wo_b", "indexer.wq_b")
"""Linears stored as FP8 E4M3 with 128x128 block scales when ``cfg.fp8_weights`` (§3.1)."""

_FP8_DTYPES = tuple(
    getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
                                "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, n)
)


# --------------------------------------------------------------------------- weights


def expected_weight_shapes(cfg: DSV4Config, layer_id: int) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> shape for one layer (§3.1), without the ``.scale`` tensors."""
    ratio = cfg.compress_ratio(layer_id)
    H, d, n_h = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads
    q_r, G, r_o = cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank
    shapes: dict[str, tuple[int, ...]] = {
        "wq_a.weight": (q_r, H),
        "wkv.weight": (d, H),
        "q_norm.weight": (q_r,),
        "kv_norm.weight": (d,),
        "wq_b.weight": (n_h * d, q_r),
        "wo_a.weight": (G * r_o, cfg.heads_per_group * d),
        "wo_b.weight": (H, G * r_o),
        "attn_sink": (n_h,),
    }
    if ratio > 0:
        coff = 2 if ratio == 4 else 1
        shapes.update({
            "compressor.wkv.weight": (coff * d, H),
            "compressor.wgate.weight": (coff * d, H),
            "compressor.ape": (ratio, coff * d),
            "compressor.norm.weight": (d,),
        })
    if ratio == 4:
        n_i, d_i = cfg.index_n_heads, cfg.index_head_dim
        shapes.update({
            "indexer.wq_b.weight": (n_i * d_i, q_r),
            "indexer.weights_proj.weight": (n_i, H),
            "indexer.compressor.wkv.weight": (2 * d_i, H),
            "indexer.compressor.wgate.weight": (2 * d_i, H),
            "indexer.compressor.ape": (4, 2 * d_i),
            "indexer.compressor.norm.weight": (d_i,),
        })
    return shapes


def _dequant_fp8(name: str, w: torch.Tensor, scale: torch.Tensor,
                 block: tuple[int, int]) -> torch.Tensor:
    """W = fp8 value * scale, one scale per (bn x bk) block; the scale multiplies (§3.2)."""
    if w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}.weight: expected torch.float8_e4m3fn (cfg.fp8_weights is True), "
                         f"got {w.dtype}")
    bn, bk = block
    n, k = w.shape
    grid = (math.ceil(n / bn), math.ceil(k / bk))
    if tuple(scale.shape) != grid:
        raise ValueError(f"{name}.scale: expected shape {list(grid)} for weight {list(w.shape)}, "
                         f"got {list(scale.shape)}")
    if scale.dtype == torch.float8_e8m0fnu:
        s = scale.to(F64)
    elif scale.dtype == torch.float32:
        s = scale.to(F64)
        mantissa, _ = torch.frexp(s)
        if not bool(((mantissa == 0.5) & torch.isfinite(s)).all()):
            raise ValueError(f"{name}.scale: float32 scales must be finite positive powers of two")
    else:
        raise ValueError(f"{name}.scale: expected torch.float8_e8m0fnu or torch.float32, "
                         f"got {scale.dtype}")
    if not bool(torch.isfinite(s).all()):
        raise ValueError(f"{name}.scale: holds a non-finite (NaN) scale")
    s_full = s.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return w.to(F64) * s_full


def load_float64_weights(cfg: DSV4Config, layer_id: int,
                         weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Check names, shapes and dtypes, dequantise FP8 linears and upcast everything to float64.

    Keys of the result drop the ``.weight`` suffix (``"wq_a"``, ``"compressor.ape"``, ...).
    """
    out: dict[str, torch.Tensor] = {}
    for name, shape in expected_weight_shapes(cfg, layer_id).items():
        if name not in weights:
            raise ValueError(f"missing weight {name!r} for layer {layer_id} "
                             f"(compress_ratio {cfg.compress_ratio(layer_id)})")
        w = weights[name]
        if not isinstance(w, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(w).__name__}")
        if tuple(w.shape) != shape:
            raise ValueError(f"{name}: expected shape {list(shape)}, got {list(w.shape)}")
        base = name.removesuffix(".weight")
        scale_name = f"{base}.scale"
        if base in FP8_WEIGHT_NAMES and cfg.fp8_weights:
            if scale_name not in weights:
                raise ValueError(f"missing weight {scale_name!r} (cfg.fp8_weights is True)")
            out[base] = _dequant_fp8(base, w, weights[scale_name], cfg.weight_block_size)
            continue
        if base in FP8_WEIGHT_NAMES and scale_name in weights:
            raise ValueError(f"unexpected {scale_name!r}: cfg.fp8_weights is False, so {name} "
                             "must be a plain floating tensor without a block scale")
        if not w.is_floating_point() or w.dtype in _FP8_DTYPES:
            raise ValueError(f"{name}: expected a bf16/fp16/fp32/fp64 tensor, got {w.dtype}")
        out[base] = w.to(F64)
    return out


# --------------------------------------------------------------------------- elementwise pieces


def rms_norm(v: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: w * v / sqrt(mean(v^2) + eps); weight None for per-head q."""
    y = v / torch.sqrt((v * v).mean(dim=-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def rope_inverse_frequencies(cfg: DSV4Config, ratio: int) -> torch.Tensor:
    """Per-pair f_i (float32): base^(-2i/d_r), blended by YaRN on compressed layers only (§4).

    The model defines this table in float32 arithmetic (DeepSeek's reference), so it is the one
    place this oracle does not run in float64: every step below is a float32 tensor operation.
    """
    d_r = cfg.qk_rope_head_dim
    base = cfg.rope_theta if ratio == 0 else cfg.compress_rope_theta
    two_i = torch.arange(0, d_r, 2, dtype=torch.float32)
    f = 1.0 / (base ** (two_i / d_r))
    yarn = cfg.rope_scaling if ratio > 0 else None
    if yarn is not None:

        def corr(rot: float) -> float:
            return d_r * math.log(yarn.original_max_position_embeddings / (2 * math.pi * rot)) / (
                2 * math.log(base))

        low = max(0, math.floor(corr(yarn.beta_fast)))
        high = min(d_r - 1, math.ceil(corr(yarn.beta_slow)))
        span = (high + 0.001 - low) if low == high else (high - low)
        i = torch.arange(d_r // 2, dtype=torch.float32)
        ramp = torch.clamp((i - low) / span, 0, 1)
        keep = 1 - ramp
        f = f / yarn.factor * (1 - keep) + f * keep
    return f


def rope(v: torch.Tensor, position: int, inv_freq: torch.Tensor, inverse: bool = False
         ) -> torch.Tensor:
    """GPT-J interleaved rotation of the last 2*len(inv_freq) dims of v [..., d] at one position.

    Pair i is (v[o+2i], v[o+2i+1]), o = d - d_r; (a, b) -> (a cos - b sin, a sin + b cos).
    """
    d_r = 2 * inv_freq.numel()
    angle = torch.tensor(float(position), dtype=torch.float32) * inv_freq  # float32 product
    cos, sin = torch.cos(angle.to(F64)), torch.sin(angle.to(F64))
    if inverse:
        sin = -sin
    out = v.clone()
    o = v.shape[-1] - d_r
    a = v[..., o::2]
    b = v[..., o + 1::2]
    out[..., o::2] = a * cos - b * sin
    out[..., o + 1::2] = a * sin + b * cos
    return out


# --------------------------------------------------------------------------- compressor


def compressed_entries(x: torch.Tensor, wkv: torch.Tensor, wgate: torch.Tensor, ape: torch.Tensor,
                       norm_weight: torch.Tensor, ratio: int, inv_freq: torch.Tensor,
                       eps: float) -> torch.Tensor:
    """All complete compressed entries [T // ratio, d] of one compressor (§5.6), from definitions.

    Entry j exists iff j*ratio + ratio - 1 <= T - 1. Each entry is a per-channel softmax over its
    candidate tokens of the gate b (+ ape[p mod ratio]) weighting the kv part a, then RMSNorm and
    RoPE at position j*ratio.
    """
    T = x.shape[0]
    d = norm_weight.numel()
    a = x @ wkv.T  # [T, coff*d]
    b = x @ wgate.T + ape[torch.arange(T) % ratio]  # APE on the scores, once per token
    entries = []
    for j in range(T // ratio):
        if ratio == 4:
            # current block uses channel half [d, 2d); previous block (if any) half [0, d)
            cand_a = [a[4 * j:4 * j + 4, d:]]
            cand_b = [b[4 * j:4 * j + 4, d:]]
            if j > 0:
                cand_a.insert(0, a[4 * j - 4:4 * j, :d])
                cand_b.insert(0, b[4 * j - 4:4 * j, :d])
            ca, cb = torch.cat(cand_a), torch.cat(cand_b)
        else:
            ca = a[ratio * j:ratio * j + ratio]
            cb = b[ratio * j:ratio * j + ratio]
        weight = torch.softmax(cb, dim=0)  # over tokens, per channel
        u = (weight * ca).sum(dim=0)
        u = rms_norm(u, norm_weight, eps)
        entries.append(rope(u, j * ratio, inv_freq))
    if not entries:
        return x.new_zeros((0, d))
    return torch.stack(entries)


# --------------------------------------------------------------------------- the layer


def naive_attention_forward(cfg: DSV4Config, layer_id: int, weights: Mapping[str, torch.Tensor],
                            x: torch.Tensor, forced_selection: torch.Tensor | None = None,
                            index_scores_out: dict[int, torch.Tensor] | None = None,
                            ) -> torch.Tensor:
    """One DSV4 attention layer on x [T, hidden_size] float64 at positions 0..T-1 -> [T, hidden].

    ``weights`` uses the official checkpoint names relative to the layer (§3.1).

    Ratio-4 layers only: ``forced_selection`` [T, k] (-1 pads) replaces the indexer's top-k, so a
    lower-precision run that picked differently at a near tie can still be evaluated exactly;
    ``index_scores_out`` receives, per query position, the float64 scores of its visible
    entries. Top-k
    ties go to the lower entry index.
    """
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype != F64:
        raise ValueError(f"x: expected dtype torch.float64, got {x.dtype}")
    if x.dim() != 2 or x.shape[0] < 1 or x.shape[1] != cfg.hidden_size:
        raise ValueError(f"x: expected shape [T >= 1, hidden_size={cfg.hidden_size}], "
                         f"got {list(x.shape)}")
    ratio = cfg.compress_ratio(layer_id)
    W = {k: v.to(x.device) for k, v in load_float64_weights(cfg, layer_id, weights).items()}
    T = x.shape[0]
    n_h, d, eps = cfg.num_attention_heads, cfg.head_dim, cfg.rms_norm_eps
    inv_freq = rope_inverse_frequencies(cfg, ratio).to(x.device)

    # §5.1-5.2: latent projections and norms
    qr = rms_norm(x @ W["wq_a"].T, W["q_norm"], eps)
    kv = rms_norm(x @ W["wkv"].T, W["kv_norm"], eps)

    # §5.3: queries; §5.4: window kv rows
    q = rms_norm((qr @ W["wq_b"].T).view(T, n_h, d), None, eps)
    q = torch.stack([rope(q[p], p, inv_freq) for p in range(T)])
    kv = torch.stack([rope(kv[p], p, inv_freq) for p in range(T)])

    # §5.6: main compressed entries
    comp = x.new_zeros((0, d))
    if ratio > 0:
        comp = compressed_entries(x, W["compressor.wkv"], W["compressor.wgate"],
                                  W["compressor.ape"], W["compressor.norm"], ratio, inv_freq, eps)

    # §5.7: indexer inputs (ratio 4)
    if ratio == 4:
        n_i, d_i = cfg.index_n_heads, cfg.index_head_dim
        q_idx = (qr @ W["indexer.wq_b"].T).view(T, n_i, d_i)
        q_idx = torch.stack([rope(q_idx[p], p, inv_freq) for p in range(T)])
        head_w = (x @ W["indexer.weights_proj"].T) * cfg.index_weight_scale
        k_idx = compressed_entries(x, W["indexer.compressor.wkv"], W["indexer.compressor.wgate"],
                                   W["indexer.compressor.ape"], W["indexer.compressor.norm"], 4,
                                   inv_freq, eps)

    # §5.5, 5.7, 5.8: key set per query, sparse MQA with the sink in the denominator only
    sink = W["attn_sink"]
    o = x.new_empty((T, n_h, d))
    for p in range(T):
        keys = [kv[max(0, p - cfg.sliding_window + 1):p + 1]]
        visible = (p + 1) // ratio if ratio > 0 else 0
        if ratio == 128 and visible > 0:
            keys.append(comp[:visible])
        elif ratio == 4 and visible > 0:
            dots = torch.relu(q_idx[p] @ k_idx[:visible].T)  # [n_i, visible]
            score = (head_w[p][:, None] * dots).sum(dim=0)
            if index_scores_out is not None:
                index_scores_out[p] = score
            if forced_selection is not None:
                chosen = forced_selection[p][forced_selection[p] >= 0].to(torch.long)
                if bool((chosen >= visible).any()):
                    raise ValueError(f"forced_selection[{p}] names an entry that is not visible")
            else:
                order = torch.sort(score, descending=True, stable=True).indices
                chosen = order[:min(cfg.index_topk, visible)]
            keys.append(comp[chosen])
        k = torch.cat(keys)  # [S, d], V = K
        logits = cfg.softmax_scale * (q[p] @ k.T)  # [n_h, S]
        m = logits.max(dim=-1, keepdim=True).values
        e = torch.exp(logits - m)
        denom = e.sum(dim=-1) + torch.exp(sink - m[:, 0])
        o[p] = (e @ k) / denom[:, None]

    # §5.9: inverse RoPE at the query position, grouped wo_a, then wo_b
    o = torch.stack([rope(o[p], p, inv_freq, inverse=True) for p in range(T)])
    G, r_o = cfg.o_groups, cfg.o_lora_rank
    o_g = o.reshape(T, G, cfg.heads_per_group * d)
    wo_a = W["wo_a"].view(G, r_o, cfg.heads_per_group * d)
    z = torch.einsum("tgk,grk->tgr", o_g, wo_a).reshape(T, G * r_o)
    return z @ W["wo_b"].T
