"""The fp8 GEMMs' tile sweep: every fp8 GEMM of a Flash / Pro C4 layer as the layer calls it
(``wq_b``, ``wo_b``, the indexer's ``wq_b``: act8, x quantised once from 33 tokens; ``wo_a``
grouped, bf16 x) at the token counts given, over candidate tiles (swapped 16 / 32 / 64 x 64 /
128, non-swapped 64 x 64 / 128 of 4 or 8 warps, splits of ``SPLITS``, 3 or 4 stages); CUDA-graph
replay, weights rotated beyond L2. Each row: the tile, us per call, and its output's largest
difference from the table's choice (tag ``current``). The evidence of
:func:`dsv4.kernels.fp8_linear.choose_fp8_config` (``benchmarks/results/2026-12-07-h100/
gemm-tiles/``). On a CUDA machine, from the repository root, dsv4 importable (installed, or
``PYTHONPATH=src``); ``bash benchmarks/gpu_check.sh tiles`` runs both steps:

    for i in $(seq 0 13); do python3 benchmarks/gemm_tiles.py compile 14 $i 16 64 & done; wait
    python3 benchmarks/gemm_tiles.py time OUT.json 16 64

``compile N I M...``: worker I of N compiles its share of the tiles (Triton's cache), so the
timing run compiles nothing; ``time OUT.json M...``: times them all, one shape after another,
rewriting OUT.json after each; ``pair OUT.json M...``: the query heads' and the indexer's
``wq_b`` on two side streams at once, as the layer's stage 2 runs them, over the indexer's
tiles (:func:`pair_rows`).
"""
import json
import sys
import time

import torch

from dsv4.bench.attention_kernels import GEMMS, random_fp8_weights, weight_copies
from dsv4.kernels.fp8_linear import (
    SPLITS,
    Fp8GemmConfig,
    choose_fp8_config,
    fp8_grouped_linear,
    fp8_linear,
    quantize_activations,
)


def candidates(M, N, K, G):
    nkb = K // 128
    R = N // G
    act = G == 1
    cur = choose_fp8_config(M, N, K, 132, act_fp8=act)
    out = [("current", cur)]
    seen = {cur}
    bms = [16] if M <= 16 else [16, 32, 64] if M <= 64 else [64]
    for split in SPLITS:
        if split > nkb:
            continue
        for st in (3, 4):
            for bn in (64, 128):
                if R % bn:
                    continue
                for bm in bms:
                    c = Fp8GemmConfig(block_m=bm, block_n=bn, split_k=split, swap=True,
                                      num_warps=4, num_stages=st, act_fp8=act)
                    if c not in seen:
                        seen.add(c)
                        out.append((f"s{bm}x{bn}k{split}st{st}", c))
                if M > 16:
                    for w in (4, 8):
                        c = Fp8GemmConfig(block_m=64, block_n=bn, split_k=split, swap=False,
                                          num_warps=w, num_stages=st, act_fp8=act)
                        if c not in seen:
                            seen.add(c)
                            out.append((f"n64x{bn}k{split}st{st}w{w}", c))
    return out


def current_and_best(rows, key, **cell):
    """The rows of one cell (``cell``'s fields) that were timed: the table's tile's and the
    fastest."""
    timed = [r for r in rows if key in r and all(r.get(f) == v for f, v in cell.items())]
    return next(r for r in timed if r["tag"] == "current"), min(timed, key=lambda r: r[key])


def cell_done(out, rows, t0, line):
    """A cell timed: its line, every row so far into ``out``, the cell's tensors freed."""
    print(f"{line}  ({time.time() - t0:.0f} s)", flush=True)
    with open(out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=0)
    torch.cuda.empty_cache()


def shapes():
    for model, rows in GEMMS.items():
        for name, N, K, G in rows:
            yield model, name, N, K, G


def caller(M, N, K, G, w, s, x, workspace=None):
    if G > 1:
        return lambda cfg: fp8_grouped_linear(x, w, s, config=cfg, workspace=workspace)
    if M >= 33:
        q, sx = quantize_activations(x)
        return lambda cfg: fp8_linear(q, w, s, config=cfg, x_scales=sx, workspace=workspace)
    return lambda cfg: fp8_linear(x, w, s, config=cfg, workspace=workspace)


def make(M, N, K, G, gen, rot):
    ws = random_fp8_weights(N, K, rot, "cuda", gen)
    xshape = (M, G, K) if G > 1 else (M, K)  # weight [N = G * R, K = Kg]
    xs = [torch.randn(*xshape, device="cuda", generator=gen).to(torch.bfloat16)
          for _ in range(rot)]
    return ws, xs


USAGE = ("usage: python3 benchmarks/gemm_tiles.py compile N I M... | time OUT.json M... | "
         "pair OUT.json M...")


def check_args(args):
    """A one-line usage error (exit 2) unless ``args`` is one of the three forms."""
    mode = args[0] if args else ""
    numbers = args[1:] if mode == "compile" else args[2:]
    least = {"compile": 3, "time": 1, "pair": 1}.get(mode)
    if least is None or len(numbers) < least or not all(a.isdigit() for a in numbers):
        print(USAGE, file=sys.stderr)
        sys.exit(2)


def main():
    check_args(sys.argv[1:])
    mode = sys.argv[1]
    gen = torch.Generator(device="cuda").manual_seed(0)
    if mode == "compile":
        n, i = int(sys.argv[2]), int(sys.argv[3])
        ms = [int(a) for a in sys.argv[4:]]
        jobs = [(M, sh, c) for M in ms for sh in shapes()
                for c in candidates(M, sh[2], sh[3], sh[4])]
        made = {}
        for j, (M, (model, name, N, K, G), (_tag, cfg)) in enumerate(jobs):
            if j % n != i:
                continue
            if (M, name, model) not in made:
                made.clear()
                ws, xs = make(M, N, K, G, gen, 1)
                made[(M, name, model)] = caller(M, N, K, G, ws[0][0], ws[0][1], xs[0])
            made[(M, name, model)](cfg)
        torch.cuda.synchronize()
        return
    from dsv4.bench.input_proj import time_graph
    out = sys.argv[2]
    ms = [int(a) for a in sys.argv[3:]]
    if mode == "pair":
        pair_rows(ms, out, gen, time_graph)
        return
    rows = []
    t0 = time.time()
    for M in ms:
        for model, name, N, K, G in shapes():
            rot = weight_copies(N * K)
            ws, xs = make(M, N, K, G, gen, rot)
            calls = [caller(M, N, K, G, w, s, x) for (w, s), x in zip(ws, xs, strict=True)]
            ref = calls[0](choose_fp8_config(M, N, K, 132, act_fp8=G == 1)).float()
            for tag, cfg in candidates(M, N, K, G):
                try:
                    y = calls[0](cfg).float()
                    err = ((y - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
                    us = time_graph([lambda c=c, cfg=cfg: c(cfg) for c in calls])
                except Exception as ex:  # noqa: BLE001
                    rows.append(dict(model=model, gemm=name, M=M, tag=tag, error=repr(ex)[:200]))
                    continue
                rows.append(dict(model=model, gemm=name, N=N, K=K, G=G, M=M, tag=tag, us=us,
                                 err=err, cfg=dict(cfg.__dict__)))
            cur, best = current_and_best(rows, "us", model=model, gemm=name, M=M)
            del ws, xs, calls
            cell_done(out, rows, t0, f"{model:5s} {name:8s} M={M:3d} current {cur['us']:6.1f} "
                      f"us  best {best['us']:6.1f} {best['tag']} err {best['err']:.1e}")


def pair_rows(ms, out, gen, time_graph):
    """Stage 2 of a C4 step as the cuda platform runs it: the query heads' ``wq_b`` on one side
    stream beside the indexer's ``wq_b`` on another (both on the same x, each with its own
    split-K workspace), forked from and joined to the step's stream in one graph. Per model
    and M, the pair's time with the heads' GEMM at the table's tile and the indexer's at each
    of its candidates: which tile wins where the two share the SMs (alone, the indexer's GEMM
    wins unsplit; in the layer at 64K that lost)."""
    from dsv4.kernels.fp8_linear import side_stream_workspace

    rows = []
    sa, sb = torch.cuda.Stream(), torch.cuda.Stream()
    wa, wb = side_stream_workspace(sa), side_stream_workspace(sb)
    t0 = time.time()
    for M in ms:
        for model, specs in GEMMS.items():
            (hn, k), (n_idx, _) = [(N, K) for name, N, K, _ in specs
                                   if name in ("wq_b", "idx_wq_b")]
            rot = weight_copies((hn + n_idx) * k)
            hw, _ = make(M, hn, k, 1, gen, rot)
            iw, xs = make(M, n_idx, k, 1, gen, rot)
            heads = [caller(M, hn, k, 1, w, s, x, wa) for (w, s), x in zip(hw, xs, strict=True)]
            index = [caller(M, n_idx, k, 1, w, s, x, wb) for (w, s), x in zip(iw, xs, strict=True)]
            head_cfg = choose_fp8_config(M, hn, k, 132, act_fp8=True)

            def step(i, icfg, head_cfg=head_cfg, heads=heads, index=index):
                cur = torch.cuda.current_stream()
                sa.wait_stream(cur)
                sb.wait_stream(cur)
                with torch.cuda.stream(sa):
                    heads[i](head_cfg)
                with torch.cuda.stream(sb):
                    index[i](icfg)
                cur.wait_stream(sa)
                cur.wait_stream(sb)

            alone = time_graph([lambda i=i, h=heads, c=head_cfg: h[i](c) for i in range(rot)])
            for tag, cfg in candidates(M, n_idx, k, 1):
                try:
                    us = time_graph([lambda i=i, cfg=cfg: step(i, cfg) for i in range(rot)])
                except Exception as ex:  # noqa: BLE001
                    rows.append(dict(model=model, M=M, tag=tag, error=repr(ex)[:200]))
                    continue
                rows.append(dict(model=model, M=M, tag=tag, us_pair=us, heads_alone_us=alone,
                                 heads_cfg=dict(head_cfg.__dict__),
                                 index_cfg=dict(cfg.__dict__)))
            cur, best = current_and_best(rows, "us_pair", model=model, M=M)
            del hw, iw, xs
            cell_done(out, rows, t0, f"{model:5s} pair M={M:3d} heads alone {alone:6.1f} us, "
                      f"pair with the table's indexer tile {cur['us_pair']:6.1f}, best "
                      f"{best['us_pair']:6.1f} {best['tag']}")


if __name__ == "__main__":
    main()
