"""``dsv4 demo``: every layer type of the tiny preset, prefill / chunked prefill / decode, checked
against the naive float64 evaluation, with decode-vs-prefill agreement and timings."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from dsv4.attention import DeepseekV4Attention
from dsv4.config import DSV4Config
from dsv4.platforms import build_attention
from dsv4.testing.naive_reference import naive_attention_forward
from dsv4.testing.probes import record_selection, stack_selections
from dsv4.testing.random_weights import random_layer_weights


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.detach().to(torch.float64), b.detach().to(torch.float64)
    return float((a64 - b64).norm() / b64.norm())


@dataclass
class ModeResult:
    y: torch.Tensor
    seconds: float
    selection: torch.Tensor | None
    """The compressed entries each query attended to (ratio > 0)."""


def run_modes(layer: DeepseekV4Attention, x: torch.Tensor, chunk: int) -> dict[str, ModeResult]:
    """A full prefill, a chunked prefill and token-by-token decode of ``x``."""
    t = x.shape[0]
    pos = torch.arange(t)
    out: dict[str, ModeResult] = {}
    for mode, size in (("prefill", t), (f"chunked/{chunk}", chunk), ("decode", 1)):
        cache = layer.new_cache(t)
        with record_selection(layer) as seen:
            t0 = time.perf_counter()
            ys = [layer(x[s:s + size], pos[s:s + size], cache) for s in range(0, t, size)]
            seconds = time.perf_counter() - t0
        out[mode] = ModeResult(torch.cat(ys), seconds, stack_selections(seen))
    return out


def topk_agreement(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    """Fraction of a's selected entries that b selected too (1.0 without an indexer)."""
    if a is None or b is None:
        return 1.0
    shared = sum(len(set(x[x >= 0].tolist()) & set(y[y >= 0].tolist()))
                 for x, y in zip(a, b, strict=True))
    return shared / max(1, int((a >= 0).sum()))


@dataclass
class DemoRow:
    layer_id: int
    ratio: int
    mode: str
    err_f64: float
    err_bf16: float
    topk_agree: float
    agree_sim: float
    ms_per_token: float


def run_demo(tokens: int = 300, chunk: int = 37, seed: int = 0,
             checkpoint: Path | None = None,
             log: Callable[[str], None] | None = None) -> list[DemoRow]:
    """Rows per layer type x mode; ``log`` gets one line per row as it completes (progress)."""
    if checkpoint is not None:
        from dsv4.checkpoint import read_layer_tensors

        cfg = DSV4Config.from_pretrained(checkpoint)
    else:
        cfg = DSV4Config.preset("tiny")
    rows: list[DemoRow] = []
    gen = torch.Generator().manual_seed(seed)
    for ratio in (0, 4, 128):
        layer_id = cfg.layer_of_ratio(ratio)
        if checkpoint is not None:
            weights = read_layer_tensors(checkpoint, cfg, [layer_id])[layer_id]
        else:
            weights = random_layer_weights(cfg, layer_id, seed)
        x = torch.randn(tokens, cfg.hidden_size, generator=gen, dtype=torch.float64)
        x = x.to(torch.bfloat16).to(torch.float64)  # exactly representable in every dtype
        exact = cfg.replace(simulate_quant=False)
        ref = naive_attention_forward(exact, layer_id, weights, x)
        results = {}
        for name, c, dtype in (("f64", exact, torch.float64), ("bf16", exact, torch.bfloat16),
                               ("sim", cfg, torch.bfloat16)):
            layer = build_attention(c, layer_id, dtype=dtype)
            layer.load_weights(weights.items())
            results[name] = run_modes(layer, x.to(dtype), chunk)
        sim_prefill = results["sim"]["prefill"].y
        for mode, r64 in results["f64"].items():
            bf = results["bf16"][mode]
            # bf16 may pick other top-k entries at near ties; its error is measured against a
            # float64 evaluation of its own selection, the agreement of the picks is reported.
            ref_bf = ref if ratio != 4 else naive_attention_forward(
                exact, layer_id, weights, x, forced_selection=bf.selection)
            rows.append(DemoRow(
                layer_id, ratio, mode,
                err_f64=rel_err(r64.y, ref),
                err_bf16=rel_err(bf.y, ref_bf),
                topk_agree=topk_agreement(bf.selection, r64.selection),
                agree_sim=rel_err(results["sim"][mode].y, sim_prefill),
                ms_per_token=1e3 * results["sim"][mode].seconds / tokens,
            ))
            if log is not None:
                r = rows[-1]
                log(f"[demo {len(rows)}/9] layer {layer_id} ratio {ratio} {mode}: err float64 "
                    f"{r.err_f64:.2e}, bf16 {r.err_bf16:.2e}")
    return rows


def format_demo(rows: list[DemoRow], tokens: int) -> str:
    head = (f"DSV4 attention, {tokens} tokens, random inputs. err = ||out - ref|| / ||ref|| "
            "against the naive float64 evaluation (simulations off; for bf16 ratio-4 rows, of "
            "the bf16 run's own top-k picks); 'top-k agree' = share of bf16 picks that float64 "
            "made too; 'sim vs prefill' = the default bf16 numerics (simulations on) against "
            "its own full prefill; ms/token of that run on this CPU.")
    cols = ["layer", "ratio", "mode", "err float64", "err bf16", "top-k agree", "sim vs prefill",
            "ms/token"]
    lines = [head, "", " | ".join(f"{c:>14}" for c in cols)]
    for r in rows:
        lines.append(" | ".join(f"{v:>14}" for v in (
            r.layer_id, r.ratio, r.mode, f"{r.err_f64:.2e}", f"{r.err_bf16:.2e}",
            f"{r.topk_agree:.3f}", f"{r.agree_sim:.2e}", f"{r.ms_per_token:.3f}")))
    return "\n".join(lines)
