"""A differentiable, full-sequence training implementation of one DSV4 attention layer.

The inference layer (:class:`dsv4.attention.DeepseekV4Attention`) holds frozen (fp8) weights and
walks sequences through caches; training needs float parameters, gradients and whole batches. This
module computes the same math for a batch of sequences that all start at position 0 (a prefill),
with masks instead of caches: the window (keys p - window < s <= p), compressed visibility
(entry j visible to p iff j < (p + 1) // r) and the indexer's top-k picks. In float64 with the
simulations off it equals the inference layer (tests/train/test_train_attention.py).

Its parameters carry the official checkpoint names (``state_dict()`` keys are ``wq_a.weight``,
``compressor.ape``, ``indexer.compressor.wgate.weight``, ...), so exporting is a rename-free copy
plus fp8 quantisation of the tensors the official checkpoint stores in fp8.

Options that only training has:

* ``sparse=False``: ratio-4 layers attend to every visible compressed entry (the dense warm-up,
  before the indexer is any good); ``True`` uses the indexer's top-k like inference.
* the indexer is trained by distillation (DeepSeek's lightning-indexer recipe): its softmax over
  visible entries is pulled (KL) towards the main attention's probability mass on those entries,
  summed over heads. Its inputs are detached, so this loss trains the indexer alone, and the LM
  loss never reaches the indexer (top-k is not differentiable).
* :class:`QuantOptions`: quant-dequant in the forward with straight-through gradients, for
  fine-tuning against fp8 weights, the official simulations and fp8 activations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dsv4.config import DSV4Config
from dsv4.layers.fp8 import dequantize_fp8_block, quantize_fp8_block
from dsv4.layers.norm import rms_normalize
from dsv4.layers.quant_sim import fp8_block_sim, indexer_quant_sim
from dsv4.layers.rotary import RotaryEmbedding, rotate_pairs
from dsv4.platforms.preshuffle_ops import per_token_group_quant_fp8

FP8_WEIGHTS = ("wq_a", "wkv", "wq_b", "wo_a", "wo_b", "indexer.wq_b")
"""Linears the official checkpoint stores as fp8 e4m3 with ue8m0 128x128 block scales."""


@dataclass(frozen=True)
class QuantOptions:
    """Quant-dequant in the training forward (straight-through gradients)."""

    checkpoint_weights: bool = False
    """Use every weight as the checkpoint will store it: the fp8 block round trip for
    :data:`FP8_WEIGHTS`, bf16 rounding for the bf16 tensors (what inference will load)."""
    simulate: bool = False
    """The official FP8 (kv nope) and Hadamard + FP4 (indexer) simulations."""
    act_fp8_prob: float = 0.0
    """Probability, per call, of fp8 per-token group-128 activations into ``wq_a|wkv`` and
    ``wo_b`` (the preshuffle platform's numerics), so the model tolerates them."""


NO_QUANT = QuantOptions()


def ste(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Forward ``q``, backward identity (straight-through)."""
    return x + (q - x).detach()


def checkpoint_view(w: torch.Tensor, name: str, quant: QuantOptions) -> torch.Tensor:
    """``w`` (official name ``name``, without ``.weight``) rounded to its checkpoint dtype when
    ``quant.checkpoint_weights``, straight-through."""
    if not quant.checkpoint_weights:
        return w
    if name in FP8_WEIGHTS:
        return ste(w, fp8_round_trip(w))
    if official_dtype(name) == torch.bfloat16:
        return ste(w, w.detach().to(torch.bfloat16).to(w.dtype))
    return w


def fp8_round_trip(w: torch.Tensor) -> torch.Tensor:
    """The weight inference will see after fp8 block quantisation (no gradient)."""
    with torch.no_grad():
        q, s = quantize_fp8_block(w.detach().float())
        return dequantize_fp8_block(q, s, w.dtype)


def act_fp8(x: torch.Tensor) -> torch.Tensor:
    """Per-token group-128 fp8 quant-dequant (fp32 scales amax / 448), straight-through."""
    with torch.no_grad():
        flat = x.detach().float().reshape(-1, x.shape[-1])
        q, s = per_token_group_quant_fp8(flat, transpose_scale=False)
        deq = (q.float().view(flat.shape[0], -1, 128) * s.view(flat.shape[0], -1, 1))
        deq = deq.reshape(x.shape).to(x.dtype)
    return ste(x, deq)


class _Norm(nn.Module):
    """RMSNorm parameters under the official ``*.weight`` name."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class _Linear(nn.Module):
    """A bias-free weight [out, in] under the official ``*.weight`` name."""

    def __init__(self, n_in: int, n_out: int, gain: float = 1.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in) * (gain / math.sqrt(n_in)))


class TrainCompressor(nn.Module):
    def __init__(self, cfg: DSV4Config, dim: int, ratio: int) -> None:
        super().__init__()
        self.ratio, self.dim = ratio, dim
        self.coff = 2 if ratio == 4 else 1
        width = self.coff * dim
        self.wkv = _Linear(cfg.hidden_size, width)
        self.wgate = _Linear(cfg.hidden_size, width)
        self.ape = nn.Parameter(torch.zeros(ratio, width))
        self.norm = _Norm(dim)

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding, adt: torch.dtype,
                quant: QuantOptions, for_indexer: bool, eps: float, rope_dim: int
                ) -> torch.Tensor:
        """Entries [B, T // r, dim] (acc dtype) of sequences x [B, T, hidden] from position 0."""
        b_, t, _ = x.shape
        r, d, width = self.ratio, self.dim, self.coff * self.dim
        n = t // r
        ckpt = quant.checkpoint_weights
        w = torch.cat((self.wkv.weight, self.wgate.weight))
        w = (ste(w, w.detach().to(torch.bfloat16).to(w.dtype)) if ckpt else w).to(adt)
        nw: torch.Tensor = self.norm.weight
        norm_w = ste(nw, nw.detach().to(torch.bfloat16).to(nw.dtype)) if ckpt else nw
        sim = quant.simulate
        kv_score = F.linear(x[:, :n * r].to(adt), w)  # [B, n*r, 2*width]
        a, s = kv_score[..., :width], kv_score[..., width:]
        pos = torch.arange(n * r, device=x.device)
        s = s + self.ape.to(adt)[pos % r]
        a, s = a.view(b_, n, r, width), s.view(b_, n, r, width)
        if self.coff == 2:
            pad_a = a.new_zeros(b_, 1, r, d)
            pad_s = s.new_full((b_, 1, r, d), float("-inf"))
            prev_a = torch.cat((pad_a, a[:, :-1, :, :d]), dim=1)
            prev_s = torch.cat((pad_s, s[:, :-1, :, :d]), dim=1)
            a = torch.cat((prev_a, a[..., d:]), dim=2)
            s = torch.cat((prev_s, s[..., d:]), dim=2)
        pooled = (torch.softmax(s, dim=2) * a).sum(dim=2)  # [B, n, d]
        u = rms_normalize(pooled, eps, adt) * norm_w.to(adt)
        u = rotate(u, torch.arange(n, device=x.device) * r, rotary, rope_dim, adt)
        if sim:
            if for_indexer:
                u = ste(u, indexer_quant_sim(u))
            else:
                nope = d - rope_dim
                u = torch.cat((ste(u[..., :nope], fp8_block_sim(u[..., :nope])), u[..., nope:]),
                              dim=-1)
        return u


class TrainIndexer(nn.Module):
    def __init__(self, cfg: DSV4Config) -> None:
        super().__init__()
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.topk = cfg.index_topk
        self.weight_scale = cfg.index_weight_scale
        self.wq_b = _Linear(cfg.q_lora_rank, self.n_heads * self.head_dim)
        self.weights_proj = _Linear(cfg.hidden_size, self.n_heads)
        self.compressor = TrainCompressor(cfg, self.head_dim, 4)


def rotate(x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, rope_dim: int,
           adt: torch.dtype, inverse: bool = False) -> torch.Tensor:
    """GPT-J RoPE on the last ``rope_dim`` dims of x [B, T, (heads,) d] at positions [T] (or
    [B, T]): the
    inference layer's angles (:meth:`RotaryEmbedding.cos_sin`) and arithmetic, batch-first."""
    cos, sin = rotary.cos_sin(positions, adt)  # [(B,) T, rope_dim / 2]
    if positions.dim() == 1:
        while cos.dim() < x.dim() - 1:  # align T with x's dim 1, broadcast over heads
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    else:  # per-row positions [B or 1, T]: broadcast over heads
        while cos.dim() < x.dim():
            cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    assert 2 * cos.shape[-1] == rope_dim
    return rotate_pairs(x, cos, sin, adt, inverse)


class TrainAttention(nn.Module):
    """One DSV4 attention layer for training (see the module docstring)."""

    rotary: RotaryEmbedding

    def __init__(self, cfg: DSV4Config, layer_id: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_id = layer_id
        self.ratio = cfg.compress_ratio(layer_id)
        h, d, q_r = cfg.hidden_size, cfg.head_dim, cfg.q_lora_rank
        self.n_heads, self.head_dim = cfg.num_attention_heads, d
        self.rope_dim = cfg.qk_rope_head_dim
        self.wq_a = _Linear(h, q_r)
        self.wkv = _Linear(h, d)
        self.q_norm = _Norm(q_r)
        self.kv_norm = _Norm(d)
        self.wq_b = _Linear(q_r, self.n_heads * d)
        self.wo_a = _Linear(cfg.heads_per_group * d, cfg.o_groups * cfg.o_lora_rank)
        self.wo_b = _Linear(cfg.o_groups * cfg.o_lora_rank, h)
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads))
        self.compressor = TrainCompressor(cfg, d, self.ratio) if self.ratio else None
        self.indexer = TrainIndexer(cfg) if self.ratio == 4 else None
        # not a submodule: .double() / .half() must not retype its fp32 frequencies (the
        # inference layer computes angles in fp32 whatever its dtype)
        object.__setattr__(self, "rotary", RotaryEmbedding.for_layer(cfg, self.ratio))

    # ---------------------------------------------------------------------------- helpers
    def _w(self, name: str, quant: QuantOptions) -> torch.Tensor:
        """Parameter ``name``.weight as the forward uses it (see :class:`QuantOptions`)."""
        return checkpoint_view(self.get_parameter(f"{name}.weight"), name, quant)

    def _rope(self, x: torch.Tensor, pos: torch.Tensor, adt: torch.dtype,
              inverse: bool = False) -> torch.Tensor:
        return rotate(x, pos, self.rotary, self.rope_dim, adt, inverse)

    # ---------------------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor, *, sparse: bool = True, quant: QuantOptions = NO_QUANT,
                indexer_loss: bool = False, valid_len: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """y [B, T, hidden] for sequences x [B, T, hidden] starting at position 0, and the
        indexer distillation loss (ratio-4 layers, when ``indexer_loss``; else None).

        ``valid_len`` [B]: tokens of each row that are real (right padding is never attended to
        by real tokens anyway; it only keeps padded queries out of the indexer loss)."""
        cfg = self.cfg
        b_, t, hid = x.shape
        dt = x.dtype
        acc = torch.float64 if dt == torch.float64 else torch.float32
        eps = cfg.rms_norm_eps
        pos = torch.arange(t, device=x.device)
        qpos = pos[None]  # query positions [1, T]
        sim = quant.simulate
        x_in = x
        if quant.act_fp8_prob > 0 and torch.rand(()) < quant.act_fp8_prob:
            x_in = act_fp8(x)
        xq, xq_in = x, x_in
        qr = F.linear(xq_in, self._w("wq_a", quant))
        kv = F.linear(x_in, self._w("wkv", quant))
        qr = (rms_normalize(qr, eps, acc) * self._w("q_norm", quant).to(acc)).to(dt)
        kv = (rms_normalize(kv, eps, acc) * self._w("kv_norm", quant).to(acc)).to(dt)
        d, nh = self.head_dim, self.n_heads
        q = F.linear(qr, self._w("wq_b", quant)).unflatten(-1, (nh, d))
        q = self._rope(rms_normalize(q, eps, acc), qpos, acc).to(dt)  # [B, R, nh, d]
        kv = self._rope(kv, pos, acc)
        if sim:
            nope = d - self.rope_dim
            kv = torch.cat((ste(kv[..., :nope], fp8_block_sim(kv[..., :nope])), kv[..., nope:]),
                           dim=-1)

        # logits over the window rows: keys s with p - window < s <= p
        qf, kvf = q.to(acc), kv.to(acc)
        scale = cfg.softmax_scale
        logits_w = torch.einsum("bthd,bsd->bhts", qf, kvf) * scale
        rel = qpos[..., None] - pos  # [1 or B, R, T]
        win_ok = (rel >= 0) & (rel < cfg.sliding_window)
        logits_w = logits_w.masked_fill(~win_ok[:, None], float("-inf"))
        n_q = q.shape[1]

        cmp = None
        visible = None
        selected = None
        loss = None
        if self.compressor is not None:
            r = self.ratio
            cmp = self.compressor(x, self.rotary, acc, quant, False, eps,
                                  self.rope_dim).to(dt).to(acc)  # [B, n, d]
            n = cmp.shape[1]
            visible = torch.arange(n, device=x.device) < ((qpos + 1) // r)[..., None]
            selected = visible.expand(b_, n_q, n)
            if self.indexer is not None:
                scores = self._index_scores(x, xq, qr, qpos, quant, visible)  # [B, R, n]
                if sparse:
                    selected = topk_mask(scores.detach(), self.indexer.topk)
        if cmp is not None and cmp.shape[1] > 0:
            assert selected is not None and visible is not None
            logits_c = torch.einsum("bthd,bnd->bhtn", qf, cmp) * scale
            logits = torch.cat((logits_w, logits_c.masked_fill(~selected[:, None], float("-inf"))),
                               dim=-1)
        else:
            logits_c = None
            logits = logits_w
        probs = _softmax_with_sink(logits, self.attn_sink.to(acc))
        o = torch.einsum("bhts,bsd->bthd", probs[..., :t], kvf)
        if cmp is not None and logits_c is not None:
            o = o + torch.einsum("bhtn,bnd->bthd", probs[..., t:], cmp)
            if self.indexer is not None and indexer_loss:
                assert visible is not None
                dense = _softmax_with_sink(
                    torch.cat((logits_w, logits_c.masked_fill(~visible[:, None], float("-inf"))),
                              -1), self.attn_sink.to(acc))
                loss = _indexer_kl(dense[..., t:].detach(), scores, visible, qpos, valid_len)
        o = o.to(dt)

        o = self._rope(o, qpos, acc, inverse=True)
        g, r_o = cfg.o_groups, cfg.o_lora_rank
        wo_a = self._w("wo_a", quant).view(g, r_o, -1)
        z = torch.einsum("btgc,grc->btgr", o.reshape(b_, n_q, g, -1), wo_a).flatten(-2)
        if quant.act_fp8_prob > 0 and torch.rand(()) < quant.act_fp8_prob:
            z = act_fp8(z)
        return F.linear(z, self._w("wo_b", quant)), loss

    def _index_scores(self, x: torch.Tensor, xq: torch.Tensor, qr: torch.Tensor,
                      qpos: torch.Tensor, quant: QuantOptions, visible: torch.Tensor
                      ) -> torch.Tensor:
        """score[b, t, j] = sum_h w[b, t, h] relu(<q_I[b, t, h], K_I[b, j]>), -inf where entry j
        is not visible to query t (keys from every row of x, queries from xq / qr at qpos).
        Inputs are detached: only the distillation loss trains these."""
        idx = self.indexer
        assert idx is not None
        dt = x.dtype
        acc = torch.float64 if dt == torch.float64 else torch.float32
        x, xq, qr = x.detach(), xq.detach(), qr.detach()
        q = F.linear(qr, self._w("indexer.wq_b", quant)).unflatten(-1, (idx.n_heads, -1))
        q = self._rope(q, qpos, acc)
        keys = idx.compressor(x, self.rotary, acc, quant, True,
                              self.cfg.rms_norm_eps, self.rope_dim).to(dt)
        if quant.simulate:
            q = ste(q, indexer_quant_sim(q))
        w = F.linear(xq, self._w("indexer.weights_proj", quant)).to(acc) * idx.weight_scale
        logits = torch.einsum("bthd,bnd->bthn", q.to(acc), keys.to(acc)).relu()
        scores = torch.einsum("bthn,bth->btn", logits, w)
        return scores.masked_fill(~visible, float("-inf"))


def topk_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The inference indexer's pick as a mask: the min(k, visible) best entries, exact ties to
    the lower index (a stable descending sort), never an invisible (-inf) entry."""
    n = scores.shape[-1]
    k = min(k, n)
    values, idx = scores.sort(dim=-1, descending=True, stable=True)
    keep = torch.zeros_like(scores, dtype=torch.bool)
    keep.scatter_(-1, idx[..., :k], values[..., :k] != float("-inf"))
    return keep


def _softmax_with_sink(logits: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """exp(l - m) / (sum exp(l - m) + exp(sink_h - m)), m = max(max l, sink_h), per [b, h, t]."""
    s = sink[None, :, None]
    m = torch.maximum(logits.amax(dim=-1), s).detach()
    e = torch.exp(logits - m[..., None])
    return e / (e.sum(dim=-1) + torch.exp(s - m))[..., None]


def _indexer_kl(attn_cmp: torch.Tensor, scores: torch.Tensor, visible: torch.Tensor,
                qpos: torch.Tensor, valid_len: torch.Tensor | None) -> torch.Tensor:
    """KL(target || softmax(scores)) over visible entries, averaged over the queries that see at
    least one entry. target = the main attention's mass on each entry, summed over heads and
    renormalised."""
    target = attn_cmp.sum(dim=1)  # [B, T, n]
    target = target / target.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    has = visible.any(dim=-1).expand(scores.shape[0], -1)  # [B, T]
    if valid_len is not None:
        has = has & (qpos < valid_len[:, None])
    logq = torch.log_softmax(scores.masked_fill(~visible, -1e30), dim=-1)
    kl = (target * (torch.log(target.clamp_min(1e-30)) - logq)).masked_fill(~visible, 0.0)
    per_query = kl.sum(dim=-1)
    return (per_query * has).sum() / has.sum().clamp_min(1)


# ------------------------------------------------------------------------------ official tensors
def official_dtype(name: str) -> torch.dtype:
    """The official checkpoint dtype of a non-fp8 tensor: fp32 for sink and APE, else bf16."""
    return torch.float32 if name == "attn_sink" or name.endswith(".ape") else torch.bfloat16


@torch.no_grad()
def export_attention_tensors(module: TrainAttention, fp8: bool) -> dict[str, torch.Tensor]:
    """Official-name CPU tensors of the layer: fp8 e4m3 + ue8m0 block scales for
    :data:`FP8_WEIGHTS` when ``fp8``, bf16 / fp32 elsewhere (as the official checkpoint)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters():
        base = name.removesuffix(".weight")
        w = p.detach().to("cpu", torch.float32)
        if fp8 and base in FP8_WEIGHTS:
            out[name], out[f"{base}.scale"] = quantize_fp8_block(w)
        else:
            out[name] = w.to(official_dtype(name))
    return out


@torch.no_grad()
def load_attention_tensors(module: TrainAttention, tensors: dict[str, torch.Tensor]) -> None:
    """Copy official-name tensors into the layer (fp8 ones dequantised); every name must match."""
    names = dict(module.named_parameters())
    expected = set(names) | {f"{n.removesuffix('.weight')}.scale" for n in names
                             if n.removesuffix(".weight") in FP8_WEIGHTS}
    unknown = sorted(set(tensors) - expected)
    missing = sorted(set(names) - set(tensors))
    if unknown or missing:
        raise ValueError(f"layer {module.layer_id}: unexpected tensors {unknown}, missing "
                         f"{missing}")
    for name, p in names.items():
        t = tensors[name]
        scale = tensors.get(f"{name.removesuffix('.weight')}.scale")
        if scale is not None:
            t = dequantize_fp8_block(t, scale, torch.float32)
        p.copy_(t.to(p.dtype))
