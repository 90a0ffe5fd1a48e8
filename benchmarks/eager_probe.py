"""The layer as the README calls it: eager ``attn(x, positions, caches)`` against the same call
captured as one CUDA graph, per decode step.

Flash layers on the ``cuda`` platform with an ``fp8_ds_mla`` / ``fp8`` cache, ``act_quant`` and
``attention_backend="auto"`` (the platform's default plan); one C4 layer and a four-layer stack
(SWA, SWA, C4, C128), M = 1 / 16 / 64 sequences, contexts 512 and 16K (synthetic history). The
gap between the two columns is host time: Python, the host plan and Triton's launcher.

    PYTHONPATH=src:/tmp/fm python3 benchmarks/eager_probe.py    # a CUDA GPU; /tmp/fm: FlashMLA

Prints one line per (layers, M, context).
"""

from __future__ import annotations

import time

import torch

import dsv4
from dsv4.bench.synthetic_cache import fill_history

DEV = torch.device("cuda")


def make(cfg: dsv4.DSV4Config, layer_id: int) -> dsv4.DeepseekV4Attention:
    a = dsv4.build_attention(cfg, layer_id=layer_id, platform="cuda", device=DEV,
                                       dtype=torch.bfloat16)
    a.load_weights(dsv4.random_layer_weights(cfg, layer_id=layer_id, seed=0).items())
    dsv4.process_weights_after_loading(a)
    return a


def run(model: str, layer_ids: list[int], m: int, ctx: int, steps: int = 30) -> None:
    cfg = dsv4.DSV4Config.preset(model).replace(kv_cache_dtype="fp8_ds_mla",
                                                index_cache_dtype="fp8", act_quant=True,
                                                attention_backend="auto")
    layers = [make(cfg, i) for i in layer_ids]
    caches = [a.new_caches(m, ctx + steps + 64) for a in layers]
    for c in caches:
        fill_history(c, ctx)
    x = torch.randn(m, cfg.hidden_size, device=DEV, dtype=torch.bfloat16)

    def step(p: int) -> torch.Tensor:
        pos = torch.full((m,), p, device=DEV, dtype=torch.long)
        y = x
        for a, c in zip(layers, caches, strict=True):
            y = a(y, pos, c)
        return y

    for i in range(3):
        step(ctx + i)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(steps):
        step(ctx + 3 + i)
    torch.cuda.synchronize()
    eager = (time.perf_counter() - t) / steps * 1e6
    ctx = ctx + 3 + steps  # where the caches stand now
    # the same call captured as one graph (positions fixed: timing only)
    graph_us = float("nan")
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step(ctx)
        torch.cuda.current_stream().wait_stream(s)
        for c in caches:
            for q in c:
                q.truncate(ctx)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step(ctx)
        for c in caches:
            for q in c:
                q.truncate(ctx)
        g.replay()
        torch.cuda.synchronize()
        a_, b_ = torch.cuda.Event(True), torch.cuda.Event(True)
        a_.record()
        for _ in range(steps):
            g.replay()
        b_.record()
        torch.cuda.synchronize()
        graph_us = a_.elapsed_time(b_) * 1e3 / steps
    except Exception as e:  # report and go on with the next row
        print("  graph capture failed:", type(e).__name__, str(e)[:200], flush=True)
    n = len(layer_ids)
    print(f"{model} layers {layer_ids} M={m} ctx={ctx}: eager {eager:8.1f} us/step "
          f"({eager / n:7.1f} per layer), whole-call graph {graph_us:8.1f} us "
          f"({graph_us / n:7.1f} per layer)", flush=True)
    torch.cuda.empty_cache()


def main() -> None:
    print(torch.cuda.get_device_name(), flush=True)
    ratios = list(dsv4.DSV4Config.preset("flash").compress_ratios)
    c4, c128 = ratios.index(4), ratios.index(128)
    swa2 = [i for i, v in enumerate(ratios) if v == 0][:2]
    for m in (1, 16, 64):
        for ctx in (512, 16384):
            try:
                run("flash", [c4], m, ctx)
                run("flash", swa2 + [c4, c128], m, ctx)
            except Exception as e:  # one failed row must not stop the others
                print("flash", m, ctx, "FAILED", type(e).__name__, str(e)[:300], flush=True)


if __name__ == "__main__":
    main()
