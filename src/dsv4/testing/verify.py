"""``dsv4 verify``: the conformance matrix and the override contract.

For every platform x compressor fusion off/on (then its declared variants, and ``act_quant``:
the official fp8 activations in both layers) x layer type x prefill / decode / pooled decode
(several sequences in one cache pool, decoded as batches), the platform's layer
(after its post-load passes) and a ``reference`` layer with the same weights run the same random
inputs; the reference replays the platform's top-k picks (indexers may break near ties
differently), and the relative error must be within the platform's declared tolerance. The
override contract (structure and spied path) is checked for every platform and layer type.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dsv4.attention import DeepseekV4Attention
from dsv4.config import DSV4Config
from dsv4.passes import process_weights_after_loading
from dsv4.platforms import available, build_attention, default_passes, get_platform
from dsv4.testing.contract import path_violations, structural_violations
from dsv4.testing.probes import record_selection, replay_selection
from dsv4.testing.random_weights import random_layer_weights

ACT_QUANT_TOLERANCE = 3e-2
"""The tolerance of every ``[act_quant]`` row (both layers quantise the fp8 linears' inputs,
docs/spec.md §6.3): the e4m3 rounding turns two paths' different bf16 roundings of its inputs
into whole e4m3 steps now and then (the H200's cuda layer against reference in bf16: 1.5e-2 on
the tiny model, 3.5e-3 without the option; preshuffle: at most 8e-4). A platform that skipped the
quantisation of all inputs would be ~6e-2 away, of ``wq_b`` and the indexer's only 3.3-3.7e-2
(preshuffle, 64 tokens): a smoke check; ``tests/test_act_quant.py`` checks each path exactly."""


@dataclass
class ConformanceRow:
    platform: str
    fusion: bool
    ratio: int
    mode: str
    rel_err: float
    tolerance: float
    passes: str
    """The post-load passes that changed the layer."""
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.rel_err <= self.tolerance


@dataclass
class ContractRow:
    platform: str
    fusion: bool
    ratio: int
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems


def passes_for(layer: DeepseekV4Attention, fusion: bool) -> list[str]:
    """The platform's passes with the compressor fusion switched on or off."""
    names = [p for p in default_passes(layer) if p != "compressor_fusion"]
    return ["compressor_fusion", *names] if fusion else names


def _run(layer: DeepseekV4Attention, x: torch.Tensor, mode: str) -> torch.Tensor:
    t = x.shape[0]
    if mode == "pooled":
        return _run_pooled(layer, x)
    pos = torch.arange(t, device=x.device)
    cache = layer.new_cache(t)
    if mode == "prefill":
        return layer(x, pos, cache)
    split = t // 2  # a prefill of half, then token-by-token decode
    ys = [layer(x[:split], pos[:split], cache)]
    ys += [layer(x[i:i + 1], pos[i:i + 1], cache) for i in range(split, t)]
    return torch.cat(ys)


def _run_pooled(layer: DeepseekV4Attention, x: torch.Tensor, sequences: int = 4
                ) -> torch.Tensor:
    """Prompts of 1 : 2 : 3 : 4 parts of x into one cache pool, then decode steps of one token
    per sequence (the batched path); outputs in the order computed."""
    t = x.shape[0]
    steps = max(1, t // (3 * sequences))
    rest = t - sequences * steps
    parts = sequences * (sequences + 1) // 2
    lens = [max(1, rest * (k + 1) // parts) for k in range(sequences - 1)]
    lens.append(rest - sum(lens))
    if min(lens) < 1:
        raise ValueError(f"pooled mode needs at least {4 * sequences} tokens, got {t}")
    caches = layer.new_caches(sequences, max(lens) + steps)
    ys, begin = [], 0
    for n, c in zip(lens, caches, strict=True):
        ys.append(layer(x[begin:begin + n], torch.arange(n, device=x.device), c))
        begin += n
    for s in range(steps):
        pos = torch.tensor([n + s for n in lens])  # CPU positions: no device read-back
        ys.append(layer(x[begin:begin + sequences], pos, caches))
        begin += sequences
    return torch.cat(ys)


def build_pair(cfg: DSV4Config, ratio: int, platform: str, fusion: bool,
               device: torch.device | str, dtype: torch.dtype, seed: int,
               ) -> tuple[DeepseekV4Attention, DeepseekV4Attention, str]:
    """(reference layer, processed platform layer, passes that changed it) on shared weights."""
    layer_id = cfg.layer_of_ratio(ratio)
    weights = random_layer_weights(cfg, layer_id, seed)
    ref = build_attention(cfg, layer_id, platform="reference", device=device,
                                    dtype=dtype)
    ref.load_weights(weights.items())
    layer = build_attention(cfg, layer_id, platform=platform, device=device,
                                      dtype=dtype)
    layer.load_weights(weights.items())
    report = process_weights_after_loading(layer, passes=passes_for(layer, fusion))
    return ref, layer, "+".join(report.changed) or "-"


def conformance(platforms: Sequence[str], device: torch.device | str = "cpu",
                tokens: int = 300, seed: int = 0, cfg: DSV4Config | None = None,
                log: Callable[[str], None] | None = None) -> list[ConformanceRow]:
    """``log`` gets one line per row as it completes (progress). Each platform runs with the
    default config (fusion off and on), then its declared variants (``Platform.variants``: e.g.
    the cuda platform's attention backends and cache formats; fusion on), rows labelled
    ``platform[variant]``."""
    cfg = cfg or DSV4Config.preset("tiny")
    plan: list[tuple[str, str, DSV4Config, bool]] = []
    for platform in platforms:
        plan += [(platform, platform, cfg, fusion) for fusion in (False, True)]
        plan += [(platform, f"{platform}[{label}]", vcfg, True)
                 for label, vcfg in get_platform(platform, device).variants(cfg, device)]
        plan.append((platform, f"{platform}[act_quant]", cfg.replace(act_quant=True), True))
    total = len(plan) * 3 * 3
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for platform, label, pcfg, fusion in plan:
        tol = get_platform(platform, device).conformance_tolerance
        if pcfg.act_quant:  # both layers quantise: the platform's own numerics no longer
            # differ from reference's by its activations (preshuffle: 8e-2 -> at most 8e-4)
            tol = ACT_QUANT_TOLERANCE
        for ratio in (0, 4, 128):
            ref, layer, changed = build_pair(pcfg, ratio, platform, fusion, device,
                                             torch.bfloat16, seed)
            for mode in ("prefill", "decode", "pooled"):
                x = torch.randn(tokens, pcfg.hidden_size, generator=gen)
                x = x.to(device=device, dtype=torch.bfloat16)
                try:
                    with record_selection(layer) as seen:
                        y = _run(layer, x, mode)
                    with replay_selection(ref, seen):
                        y_ref = _run(ref, x, mode)
                    err = float((y.double() - y_ref.double()).norm() / y_ref.double().norm())
                    rows.append(ConformanceRow(label, fusion, ratio, mode, err, tol, changed))
                except Exception as e:  # a failing platform is a row, not a crash
                    rows.append(ConformanceRow(label, fusion, ratio, mode, float("nan"), tol,
                                               changed, f"{type(e).__name__}: {e}"))
                if log is not None:
                    r = rows[-1]
                    log(f"[verify conformance {len(rows)}/{total}] {label} fusion "
                        f"{'on' if fusion else 'off'} ratio {ratio} {mode}: rel err "
                        f"{r.rel_err:.2e} {'ok' if r.ok else 'FAIL ' + r.error}")
    return rows


def contract(platforms: Sequence[str], device: torch.device | str = "cpu",
             cfg: DSV4Config | None = None,
             log: Callable[[str], None] | None = None) -> list[ContractRow]:
    """``log`` gets one line per row as it completes (progress)."""
    cfg = cfg or DSV4Config.preset("tiny")
    total = len(platforms) * 3 * 2
    rows = []
    for platform in platforms:
        cls = get_platform(platform, device).attention_cls
        structure = structural_violations(cls)
        for ratio in (0, 4, 128):
            for fusion in (False, True):
                _, layer, _ = build_pair(cfg, ratio, platform, fusion, device, torch.bfloat16, 0)
                x = torch.randn(40, cfg.hidden_size).to(device=device, dtype=torch.bfloat16)
                try:
                    path = path_violations(layer, x)
                except Exception as e:
                    path = [f"forward failed: {type(e).__name__}: {e}"]
                rows.append(ContractRow(platform, fusion, ratio, structure + path))
                if log is not None:
                    log(f"[verify contract {len(rows)}/{total}] {platform} fusion "
                        f"{'on' if fusion else 'off'} ratio {ratio}: "
                        f"{'ok' if rows[-1].ok else 'FAIL'}")
    return rows


def format_report(conf: list[ConformanceRow], cont: list[ContractRow]) -> str:
    lines = ["conformance against `reference` (rel. Frobenius error, bf16, same weights and "
             "inputs, reference replays the platform's top-k picks)", "",
             f"{'platform':>34} | {'fusion':>6} | {'ratio':>5} | {'mode':>7} | {'rel err':>9} | "
             f"{'tolerance':>9} | {'passes applied':>30} | result"]
    for r in conf:
        res = "ok" if r.ok else ("FAIL " + r.error if r.error else "FAIL")
        lines.append(f"{r.platform:>34} | {'on' if r.fusion else 'off':>6} | {r.ratio:>5} | "
                     f"{r.mode:>7} | {r.rel_err:>9.2e} | {r.tolerance:>9.1e} | "
                     f"{r.passes:>30} | {res}")
    lines += ["", "override contract (structure + spied forward path)"]
    for c in cont:
        lines.append(f"{c.platform:>11} | fusion {'on' if c.fusion else 'off':>3} | "
                     f"ratio {c.ratio:>3} | "
                     + ("ok" if c.ok else "FAIL: " + "; ".join(c.problems)))
    return "\n".join(lines)


def run_verify(platforms: Sequence[str] | None = None, device: str | None = None,
               tokens: int = 300, seed: int = 0,
               log: Callable[[str], None] | None = None) -> tuple[bool, str]:
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    names = list(platforms) if platforms else available(dev)
    for n in names:
        get_platform(n, dev)  # unknown / unavailable: a clear error before any work
    conf = conformance(names, dev, tokens, seed, log=log)
    cont = contract(names, dev, log=log)
    ok = all(r.ok for r in conf) and all(c.ok for c in cont)
    report = format_report(conf, cont)
    return ok, report + f"\n\n{'PASS' if ok else 'FAIL'}: platforms {names} on {dev}"
