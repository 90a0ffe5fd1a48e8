"""Decode kernels of a DSV4 attention layer on one GPU: sparse MQA and the fp8 GEMMs.

    dsv4 bench attention-kernels --out DIR [--quick]   (or python -m dsv4.bench.attention_kernels)

Attention: ``dsv4.kernels.sparse_mqa`` vs FlashMLA (``dsv4.kernels.flashmla_backend``, when
``flash_mla`` imports; fp8 stores use its sparse decode, bf16 stores its sparse prefill kernel on
a prebuilt workspace) vs the torch reference, on the same stores and indices: Flash (H 64,
K 512) and Pro (H 128, K 1024), d 512, W 128, fp8_ds_mla and bf16 stores (64-row blocks),
T = 1/16/64 sequences with one query each, contexts 512 / 8K / 64K (the context only changes
how far the indices reach: sequence t owns window rows t*ctx .. t*ctx+ctx-1 and compressed rows
t*ctx/4 .. ; its window is the last 128 of them, its K compressed rows a random subset).

GEMMs: ``dsv4.kernels.fp8_linear`` vs the base path (dequantise to bf16 + matmul) for wq_b,
wo_a (grouped), wo_b and the indexer's wq_b, Flash and Pro shapes, M 1/16/64, with bf16
activations and with the layer's act_quant tiles (``act8``: fp8 activations quantised in the
kernel, docs/spec.md §6.3). ``long_call``: the ``cuda`` platform's route for calls above
``FP8_GEMM_MAX_TOKENS`` tokens (on sm_90 cuBLAS's block-scaled fp8 GEMM on x quantised per 128,
``cuda_linears.block_scaled_gemm``, with the route it replaced beside it as
``long_call_dequant``; elsewhere, and for ``wo_a``, whose x stays bf16, a one-pass dequantised
copy and cuBLAS): ``--gemm-ms 128,256,512,1024`` puts it beside the kernels where the route
changes, ``--gemm-ms 16384`` at a prefill's size. Unless ``--no-variants``, tile probes around
each choice.

Every implementation is checked against the reference first (a wrong one is not timed). Times are
CUDA-graph replay (CUDA events, median of trials; ``input_proj.time_graph``), with inputs rotated
over enough copies that the bytes read exceed the 60 MB L2. floor = bytes that must move / copy
bandwidth measured in the same run (``torch.Tensor.copy_`` of 2 GiB). Writes results.json,
summary.md and (with matplotlib) fraction_of_floor.png.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable

import torch

from dsv4.bench.args import (
    add_out_options,
    check_out,
    check_report_source,
    int_list,
    pyplot,
    require_cuda,
)
from dsv4.bench.input_proj import ROTATE_BYTES
from dsv4.usage import OneLineArgumentParser

ATTN_MODELS = {"flash": (64, 512), "pro": (128, 1024)}  # heads, compressed rows per query
W = 128
D = 512
BLOCK = 64
TS = (1, 16, 64)
CTXS = (512, 8192, 65536)
# (name, N, K, groups) per model; grouped: N = G * R rows, K = Kg
GEMMS = {
    "flash": [("wq_b", 64 * 512, 1024, 1), ("wo_a", 8 * 1024, 4096, 8),
              ("wo_b", 4096, 8 * 1024, 1), ("idx_wq_b", 64 * 128, 1024, 1)],
    "pro": [("wq_b", 128 * 512, 1536, 1), ("wo_a", 16 * 1024, 4096, 16),
            ("wo_b", 7168, 16 * 1024, 1), ("idx_wq_b", 64 * 128, 1536, 1)],
}
GEMM_MS = (1, 16, 64)
MAX_STORE_BYTES = 16e9


def _attn_variants() -> dict:
    from dsv4.kernels.sparse_mqa import SparseMqaConfig

    return {f"dsv4_h{h}_n{n}_s{st}": SparseMqaConfig(block_h=h, block_n=n, num_warps=8,
                                                   num_stages=st)
            for h, n, st in ((16, 32, 1), (32, 32, 2), (32, 16, 1), (64, 16, 1), (64, 16, 3))}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------------------------- attention


def _template_rows(fmt: str, n_rows: int, dev, gen) -> torch.Tensor:
    """n_rows (a multiple of 64) valid random rows encoded as whole blocks of ``fmt``."""
    from dsv4.kernels.sparse_mqa import fp8_ds_mla_layout
    from dsv4.layers.fp8 import ceil_log2

    rows = torch.randn(n_rows, D, device=dev, generator=gen)
    nb = n_rows // BLOCK
    if fmt == "bf16":
        return rows.to(torch.bfloat16).view(nb, BLOCK, D)
    dr, sr, bb = fp8_ds_mla_layout(D, BLOCK)
    n = D - 64
    tiles = rows[:, :n].reshape(n_rows, n // 64, 64)
    e = ceil_log2(tiles.abs().amax(-1).clamp_min(1e-4) / 448)
    qv = (tiles / torch.exp2(e.float())[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    store = torch.zeros(nb, bb, dtype=torch.uint8, device=dev)
    data = torch.cat((qv.view(torch.uint8).reshape(n_rows, n),
                      rows[:, n:].to(torch.bfloat16).view(torch.uint8)), dim=1)
    store[:, : BLOCK * dr] = data.reshape(nb, BLOCK * dr)
    sc = torch.zeros(n_rows, sr, dtype=torch.uint8, device=dev)
    sc[:, : n // 64] = (e + 127).to(torch.uint8)
    store[:, BLOCK * dr: BLOCK * (dr + sr)] = sc.reshape(nb, BLOCK * sr)
    return store


def make_store(fmt: str, n_rows: int, template: torch.Tensor) -> torch.Tensor:
    nb = -(-n_rows // BLOCK)
    reps = -(-nb // template.shape[0])
    shape = (reps, *template.shape)
    return template.unsqueeze(0).expand(shape).reshape(-1, *template.shape[1:])[:nb].clone()


def attention_case(T: int, ctx: int, K: int, rot: int, dev, gen):
    """Per rotation r: (win_idx [T, W], cmp_idx [T, K]) for sequences r*T .. r*T+T-1."""
    n_cmp = max(ctx // 4, 1)
    sets = []
    for r in range(rot):
        seq = torch.arange(r * T, (r + 1) * T, device=dev)
        win = seq[:, None] * ctx + (ctx - W) + torch.arange(W, device=dev)[None, :]
        pick = torch.rand(T, n_cmp, device=dev, generator=gen).argsort(dim=1)[:, :K]
        cmp = seq[:, None] * n_cmp + pick
        if n_cmp < K:  # fewer entries than K: pad with -1
            cmp = torch.cat((cmp, torch.full((T, K - n_cmp), -1, device=dev)), dim=1)
        sets.append((win.int().contiguous(), cmp.int().contiguous()))
    return sets, rot * T * ctx, rot * T * n_cmp


def attention_rows(dev, copy_bw: float, quick: bool, out_rows: list, time_graph,
                   variants: bool = True, after_case: Callable[[], None] | None = None) -> None:
    gen = torch.Generator(device=dev).manual_seed(0)
    templates = {f: _template_rows(f, 64 * BLOCK, dev, gen) for f in ("fp8_ds_mla", "bf16")}
    ctxs = (512, 65536) if quick else CTXS
    for model, (H, K) in ATTN_MODELS.items():
        sink = torch.randn(H, device=dev, generator=gen)
        for fmt in ("fp8_ds_mla", "bf16"):
            for T in TS:
                for ctx in ctxs:
                    _attention_case_rows(model, H, K, fmt, T, ctx, sink, templates[fmt], dev,
                                         gen, copy_bw, out_rows, time_graph, variants)
                    torch.cuda.empty_cache()
                    if after_case is not None:
                        after_case()


def _attention_case_rows(model, H, K, fmt, T, ctx, sink, template, dev, gen, copy_bw,
                         out_rows, time_graph, variants: bool = False) -> None:
    from dsv4.kernels.flashmla_backend import (
        flashmla_prefill_workspace,
        flashmla_sparse_mqa,
        flashmla_supports,
    )
    from dsv4.kernels.sparse_mqa import sparse_mqa, sparse_mqa_reference

    row_bytes = 584 if fmt == "fp8_ds_mla" else 2 * D
    ws = T * (W + K) * row_bytes
    rot = max(1, min(8, math.ceil(ROTATE_BYTES / ws),
                     int(MAX_STORE_BYTES // (T * ctx * row_bytes * 1.25))))
    sets, n_win, n_cmp = attention_case(T, ctx, K, rot, dev, gen)
    win_store = make_store(fmt, n_win, template)
    cmp_store = make_store(fmt, n_cmp, template)
    qs = [torch.randn(T, H, D, device=dev, generator=gen).to(torch.bfloat16)
          for _ in range(rot)]
    base = {"section": "attention", "model": model, "H": H, "K": K, "fmt": fmt, "T": T,
            "ctx": ctx, "rotations": rot}
    floor_b = ws + 2 * T * H * D * 2
    args = [(qs[i], win_store, sets[i][0], cmp_store, sets[i][1], sink, D ** -0.5, fmt, BLOCK)
            for i in range(rot)]
    impls: dict[str, Callable] = {
        "dsv4": lambda i: sparse_mqa(*args[i]),
        "torch_ref": lambda i: sparse_mqa_reference(*args[i]),
    }
    if variants:  # tile probes of our kernel (a config that does not compile is reported)
        for vname, vcfg in _attn_variants().items():
            impls[vname] = lambda i, c=vcfg: sparse_mqa(*args[i], config=c)
    ok, why = flashmla_supports(H, D, fmt, dev)
    if ok:
        wsp = None if fmt == "fp8_ds_mla" else flashmla_prefill_workspace(
            win_store, cmp_store, fmt, BLOCK)
        impls["flashmla"] = lambda i: flashmla_sparse_mqa(*args[i], workspace=wsp)
    else:
        out_rows.append({**base, "impl": "flashmla", "skipped": why})
    ref = impls["torch_ref"](0)
    for name, fn in impls.items():
        out_rows.append(_time_impl(base, name, fn, rot, ref, floor_b, copy_bw, time_graph))
        print(out_rows[-1], flush=True)


def _time_impl(base, name, fn, rot, ref, floor_b, copy_bw, time_graph, tol=2e-2) -> dict:
    row = {**base, "impl": name, "floor_us": floor_b / copy_bw * 1e6}
    try:
        err = rel(fn(0), ref)
        row["rel_err"] = err
        if not err < tol:
            row["error"] = f"wrong: rel err {err:.3e}"
            return row
        try:
            row["us"] = time_graph([lambda i=i: fn(i) for i in range(rot)])
            row["mode"] = "graph"
        except Exception as ex:  # not capturable: time eagerly
            from dsv4.bench.input_proj import time_eager

            row["graph_error"] = repr(ex)[:200]
            row["us"] = time_eager([lambda i=i: fn(i) for i in range(rot)])
            row["mode"] = "eager"
        row["fraction"] = row["floor_us"] / row["us"]
    except Exception as ex:
        row["error"] = repr(ex)[:300]
    return row


# ---------------------------------------------------------------------------------- GEMMs


def gemm_rows(dev, copy_bw: float, quick: bool, out_rows: list, time_graph,
              variants: bool = True, ms: tuple[int, ...] = ()) -> None:
    """``variants``: the tile probes around each choice too; ``ms``: these M only (default
    ``GEMM_MS``, or its first with ``quick``)."""
    gen = torch.Generator(device=dev).manual_seed(1)
    for model, shapes in GEMMS.items():
        for name, N, K, G in shapes:
            _gemm_shape_rows(model, name, N, K, G, dev, gen, copy_bw, quick, out_rows,
                             time_graph, variants, ms)
            torch.cuda.empty_cache()


def weight_copies(nbytes: float) -> int:
    """How many copies of a weight of ``nbytes`` the GEMM probes rotate through so that each
    call finds its copy beyond the L2 (:data:`ROTATE_BYTES` in all, 1 to 16 copies)."""
    return max(1, min(16, math.ceil(ROTATE_BYTES / nbytes)))


def random_fp8_weights(N: int, K: int, count: int, dev, gen) -> list[tuple[torch.Tensor,
                                                                          torch.Tensor]]:
    """``count`` random fp8 weights [N, K] with ue8m0 block scales near 2^-7 (the GEMM
    probes' rotation, each copy beyond the others in L2)."""
    ws = []
    for _ in range(count):
        w = (torch.randn(N, K, device=dev, generator=gen) * 2).to(torch.float8_e4m3fn)
        e = torch.randint(115, 125, (N // 128, K // 128), device=dev, generator=gen)
        ws.append((w, e.to(torch.uint8).view(torch.float8_e8m0fnu)))
    return ws


def _gemm_shape_rows(model, name, N, K, G, dev, gen, copy_bw, quick, out_rows,
                     time_graph, variants: bool = False, ms: tuple[int, ...] = ()) -> None:
    from dsv4.kernels.fp8_linear import (
        Fp8GemmConfig,
        choose_fp8_config,
        fp8_grouped_linear,
        fp8_grouped_linear_reference,
        fp8_linear,
        fp8_linear_reference,
        quantize_activations,
    )
    from dsv4.layers.fp8 import dequantize_fp8_block
    from dsv4.layers.quant_sim import fp8_block_sim
    from dsv4.platforms.cuda_linears import (
        block_scaled_gemm_applies,
        dequantised_gemm,
        dequantised_grouped_gemm,
        long_gemm,
    )

    wbytes = N * K + (N // 128) * (K // 128)
    rot = weight_copies(wbytes)
    ws = random_fp8_weights(N, K, rot, dev, gen)
    for M in ms or (GEMM_MS[:1] if quick else GEMM_MS):
        xshape = (M, G, K) if G > 1 else (M, K)
        xs = [torch.randn(*xshape, device=dev, generator=gen).to(torch.bfloat16)
              for _ in range(rot)]

        def ours(i: int, xs=xs, cfg: Fp8GemmConfig | None = None) -> torch.Tensor:
            w, s = ws[i]
            if G > 1:
                return fp8_grouped_linear(xs[i], w, s, config=cfg)
            return fp8_linear(xs[i], w, s, config=cfg)

        def prequant(i: int, cfg: Fp8GemmConfig, xs=xs) -> torch.Tensor:
            w, s = ws[i]
            q, sx = quantize_activations(xs[i])
            return fp8_linear(q, w, s, config=cfg, x_scales=sx)

        def long_call(i: int, xs=xs, m=M) -> torch.Tensor:
            # the cuda platform's route above FP8_GEMM_MAX_TOKENS tokens: cuBLAS's block-scaled
            # fp8 GEMM on x quantised per 128 (act_quant) where it runs (sm_90), else - and for
            # wo_a's groups, whose x stays bf16 - a one-pass dequantised copy and cuBLAS
            w, s = ws[i]
            if G > 1:
                return dequantised_grouped_gemm(xs[i], w, s).view(m, G, -1)
            return long_gemm(xs[i], w, s, act_quant=True)

        def long_call_dequant(i: int, xs=xs) -> torch.Tensor:
            w, s = ws[i]
            return dequantised_gemm(xs[i], w, s, act_quant=True)

        def current(i: int, xs=xs) -> torch.Tensor:  # what Linear.forward does
            w, s = ws[i]
            wd = dequantize_fp8_block(w, s, torch.bfloat16)
            if G > 1:
                return torch.einsum("mgk,grk->mgr", xs[i], wd.view(G, -1, K))
            return torch.nn.functional.linear(xs[i], wd)

        w0, s0 = ws[0]
        ref = (fp8_grouped_linear_reference(xs[0], w0, s0, torch.float32) if G > 1
               else fp8_linear_reference(xs[0], w0, s0, torch.float32))
        floor_b = wbytes + M * G * K * 2 + M * N * 2
        base = {"section": "gemm", "model": model, "gemm": name, "N": N, "K": K, "G": G,
                "M": M, "rotations": rot}
        # (name, call, reference): the act8 rows - fp8 x fp8 MMAs on activations quantised per
        # 128 (the official numerics, docs/spec.md §6.3) - against the product of the
        # quantised x
        xq0 = fp8_block_sim(xs[0], 128)
        ref_q = (fp8_grouped_linear_reference(xq0, w0, s0, torch.float32) if G > 1
                 else fp8_linear_reference(xq0, w0, s0, torch.float32))
        act8 = choose_fp8_config(M, N, K, act_fp8=True)
        impls: list[tuple[str, Callable, torch.Tensor]] = [
            ("dsv4_fp8", ours, ref), ("dequant_bf16", current, ref),
            ("dsv4_fp8_act8", lambda i, c=act8: ours(i, cfg=c), ref_q),
            ("long_call", long_call, ref if G > 1 else ref_q)]
        if G == 1 and block_scaled_gemm_applies(dev):  # the route block scaling replaced
            impls.append(("long_call_dequant", long_call_dequant, ref_q))
        if variants:  # probes around the table's choice: half / double the row tile and split,
            # deeper pipelines (more weight bytes in flight per program), twice the split
            c = choose_fp8_config(M, N, K)
            for tag, change in (
                    ("bn32", dict(block_n=32, split_k=c.split_k * 2)),
                    ("bn128", dict(block_n=128, split_k=max(1, c.split_k // 2))),
                    ("split1", dict(split_k=1)), ("split2x", dict(split_k=c.split_k * 2)),
                    ("st4", dict(num_stages=4)), ("st6", dict(num_stages=6))):
                vc = Fp8GemmConfig(**{**c.__dict__, **change})
                impls.append((f"dsv4_fp8_{tag}", lambda i, vc=vc: ours(i, cfg=vc), ref))
            if M > 16:  # the M > 128 table's non-swapped 64 x 128 tile of 8 warps
                vc = choose_fp8_config(129, N, K)
                impls.append(("dsv4_fp8_mlarge", lambda i, vc=vc: ours(i, cfg=vc), ref))
            # act8 tiles around the bf16 table's choice c; act8_mlarge (M > 16): the M > 128
            # table's non-swapped tile
            act_probes = [(tag, Fp8GemmConfig(**{**c.__dict__, "act_fp8": True, **change}))
                           for tag, change in (
                               ("act8_bn64", {}), ("act8_split2x", dict(split_k=c.split_k * 2)),
                               ("act8_bn128", dict(block_n=128,
                                                   split_k=max(1, c.split_k // 2))))]
            if M > 16:
                act_probes.append(("act8_mlarge", choose_fp8_config(129, N, K, act_fp8=True)))
            for tag, vc in act_probes:
                impls.append((f"dsv4_fp8_{tag}", lambda i, vc=vc: ours(i, cfg=vc), ref_q))
            if G == 1:  # x quantised once by its own launch (timed with the GEMM), then the
                # act8 GEMM on e4m3 x: the act8 table's tiles, the bf16 table's, the M > 128 tile
                pre = [("act8_prequant", act8), ("act8_prequant_bf16tiles", c)]
                if M > 16:
                    pre.append(("act8_prequant_mlarge", choose_fp8_config(129, N, K)))
                    # the one-token table's tile (16 tokens; its 128-row form holds 76
                    # registers in the sm_90 compile, the 64-token one 234) and 32 tokens:
                    # M / 16 or M / 32 programs share each weight tile, adjacent in the grid,
                    # so the weights cross HBM once and the L2 serves the others
                    small = choose_fp8_config(16, N, K, act_fp8=True)
                    pre += [("act8_prequant_bm16", small),
                            ("act8_prequant_bm32",
                             Fp8GemmConfig(**{**small.__dict__, "block_m": 32}))]
                for tag, vc in pre:
                    impls.append((f"dsv4_fp8_{tag}", lambda i, vc=vc: prequant(i, vc), ref_q))
        for impl, fn, want in impls:
            out_rows.append(_time_impl(base, impl, fn, rot, want, floor_b, copy_bw, time_graph))
            print(out_rows[-1], flush=True)


# ---------------------------------------------------------------------------------- report


def _cell(r: dict | None) -> str:
    if r is None:
        return "-"
    if r.get("us"):
        return f"{r['us']:.1f} ({r['fraction']:.2f})"
    return "skip" if r.get("skipped") else "ERR"


def markdown_tables(res: dict) -> list[str]:
    rows = res["rows"]
    lines = [f"# DSV4 attention kernels, {res.get('gpu', '?')}, torch {res.get('torch', '?')}",
             "", f"Copy bandwidth {res.get('copy_bw_TBps', 0):.3f} TB/s (measured in the run). "
             "Cells: us (fraction of floor); floor = bytes that must move / copy bandwidth. "
             "CUDA-graph replay unless the row says eager.", "", "## Sparse MQA", ""]
    att = [r for r in rows if r["section"] == "attention"]
    impls = [i for i in ("dsv4", "flashmla", "torch_ref") if any(r["impl"] == i for r in att)]
    impls += sorted({r["impl"] for r in att} - set(impls))
    lines += ["| model | fmt | T | ctx | floor us | " + " | ".join(impls) + " |",
              "|---" * (5 + len(impls)) + "|"]
    keys = sorted({(r["model"], r["fmt"], r["T"], r["ctx"]) for r in att},
                  key=lambda k: (k[0], k[1], k[2], k[3]))
    for k in keys:
        cells = {r["impl"]: r for r in att if (r["model"], r["fmt"], r["T"], r["ctx"]) == k}
        fl = next((r["floor_us"] for r in cells.values() if "floor_us" in r), 0.0)
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {fl:.1f} | "
                     + " | ".join(_cell(cells.get(i)) for i in impls) + " |")
    gem = [r for r in rows if r["section"] == "gemm"]
    extra = sorted({r["impl"] for r in gem} - {"dsv4_fp8", "dequant_bf16"})
    lines += ["", "## fp8 GEMMs", "", "| model | gemm | N x K (G) | M | floor us | dsv4_fp8 | "
              "dequant_bf16 | speedup | " + "".join(f"{e} | " for e in extra),
              "|---" * (8 + len(extra)) + "|"]
    keys2 = sorted({(r["model"], r["gemm"], r["M"]) for r in gem}, key=lambda k: k)
    for g in keys2:
        cells = {r["impl"]: r for r in gem if (r["model"], r["gemm"], r["M"]) == g}
        any_r = next(iter(cells.values()))
        a, b = cells.get("dsv4_fp8"), cells.get("dequant_bf16")
        sp = f"{b['us'] / a['us']:.2f}x" if a and b and a.get("us") and b.get("us") else "-"
        lines.append(f"| {g[0]} | {g[1]} | {any_r['N']} x {any_r['K']} ({any_r['G']}) | {g[2]} "
                     f"| {any_r.get('floor_us', 0):.1f} | {_cell(a)} | {_cell(b)} | {sp} |"
                     + "".join(f" {_cell(cells.get(e))} |" for e in extra))
    errs = [r for r in rows if r.get("error")]
    if errs:
        lines += ["", "## Errors", ""] + [f"- {r.get('model')} {r.get('impl')} "
                                          f"{r.get('gemm', r.get('fmt'))}: {r['error']}"
                                          for r in errs]
    return lines


RESULTS = ("results.json", "summary.md", "fraction_of_floor.png")
"""The files a run writes into ``--out``."""


def plot(res: dict, out_dir: str) -> None:
    plt = pyplot("attention-kernels", os.path.join(out_dir, "fraction_of_floor.png"))
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    att = [r for r in res["rows"] if r["section"] == "attention" and r.get("us")]
    for impl in sorted({r["impl"] for r in att}):
        pts = [r for r in att if r["impl"] == impl]
        axes[0].plot(range(len(pts)), [r["fraction"] for r in pts], "o-", ms=3, label=impl)
    axes[0].set_title("sparse MQA: fraction of floor (cases in table order)")
    gem = [r for r in res["rows"] if r["section"] == "gemm" and r.get("us")]
    for impl in sorted({r["impl"] for r in gem}):
        pts = [r for r in gem if r["impl"] == impl]
        axes[1].plot(range(len(pts)), [r["fraction"] for r in pts], "o-", ms=3, label=impl)
    axes[1].set_title("fp8 GEMMs: fraction of floor")
    for ax in axes:
        ax.legend()
        ax.set_ylim(0, 1.05)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "fraction_of_floor.png"), dpi=110)


def parser(prog: str | None = None) -> OneLineArgumentParser:
    ap = OneLineArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    add_out_options(ap, "results.json, summary.md and fraction_of_floor.png")
    ap.add_argument("--quick", action="store_true", help="fewer contexts and M")
    ap.add_argument("--only", choices=["attention", "gemm"], default=None,
                    help="run one section only (default: both)")
    ap.add_argument("--no-variants", action="store_true", help="skip the tile-config probes")
    ap.add_argument("--gemm-ms", type=int_list, default=(),
                    help="the GEMMs' M values (default 1,16,64; --quick: 1)")
    ap.add_argument("--report-only", action="store_true",
                    help="remake summary.md (+ PNG) from OUT/results.json; no GPU needed")
    return ap


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = parser(prog)
    args = ap.parse_args(argv)
    with ap.usage_errors():
        if args.report_only:
            check_report_source(args.out, "results.json")
        else:
            check_out(args.out, RESULTS, args.overwrite)
    args.out = str(args.out)
    if args.report_only:
        with open(os.path.join(args.out, "results.json")) as f:
            _report(json.load(f), args.out)
        return 0
    require_cuda("attention-kernels")
    from dsv4.bench.input_proj import measure_copy_bw, time_graph

    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cuda")
    copy_bw = measure_copy_bw(dev)
    res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "copy_bw_TBps": copy_bw / 1e12, "rows": []}
    t0 = time.time()
    def save() -> None:  # partial results survive a timeout
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(res, f, indent=1)

    variants = not args.no_variants
    if args.only in (None, "gemm"):
        gemm_rows(dev, copy_bw, args.quick, res["rows"], time_graph, variants,
                  tuple(args.gemm_ms))
        save()
    if args.only in (None, "attention"):
        attention_rows(dev, copy_bw, args.quick, res["rows"], time_graph, variants,
                       after_case=save)
    res["seconds"] = time.time() - t0
    save()
    _report(res, args.out)
    return 0


def _report(res: dict, out_dir: str) -> None:
    text = "\n".join(markdown_tables(res)) + "\n"
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(text)
    try:
        plot(res, out_dir)
    except Exception as ex:  # noqa: BLE001 - the table is the result; say why no PNG
        print(f"dsv4 bench attention-kernels: warning: fraction_of_floor.png was not written "
              f"({ex!r})", file=sys.stderr)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
