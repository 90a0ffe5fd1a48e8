"""The indexer's decode score launch at decode widths: its variants against the default.

Variants (``indexer_scores`` overrides): entries per tile (``block``), the visible tiles' own
software-pipelined loop (``stages``; a group's plain loop: ``stages=0``, its default fetches
the next tile's keys ahead), programs per SM (``programs_per_sm``), and queries a
program (``group``: a verify step's tokens of one sequence sharing its key tiles) with their
warps (``num_warps``), the page copies (``tma``: each tile, one 64-row page, copied into
shared memory by the TMA; ``stages`` then its pipeline's stages) and their fp8 MMA (``f8``:
the page's e4m3 bytes against e4m3 query heads).

    PYTHONPATH=src python3 benchmarks/score_probe.py --out DIR   # a CUDA GPU
    PYTHONPATH=src python3 benchmarks/score_probe.py --out DIR --tokens-per-seq 1,4 \
        --widths 4096,16384 --seqs 1,16 --variants "default,group 4,group 4 plain"

For rows of 4K, 16K and 64K entries (contexts 16K, 64K, 256K: every entry visible) of an fp8
index key store (Flash's indexer: 64 heads x 128, 64 rows a block, blocks in shuffled order),
1, 16 and 64 sequences of 1 query each (``--tokens-per-seq``: Q consecutive positions each,
the last seeing every entry), queries of the official FP4 simulation (as the layer's), every
variant's scores must match the default's (the same -inf pattern; values to 1e-5, a wider
tile may sum in another order, the fp8 MMA's to 1e-3 of the largest score: its
accumulation; a variant that does not is reported and not timed); then each is timed as 10
calls captured in a CUDA graph, replayed (median of 7), beside the floor of the key bytes read
once per sequence (at the copy bandwidth the probe measures). Writes ``score_probe.json`` and
``score_probe.md`` under DIR.

The keys come from memory as in a layer's step: the 10 captured calls cycle through copies of
the key store until they span at least ``ROTATE_BYTES`` (``--rotate`` overrides; 1: the same
store each call). Without that, the replays found the keys in the L2 (16 sequences of 16K
entries: 34 MB of the H100's 50), and variants that save load latency (``group``) lost there
while they won in the layer (H100, 2026-12-06, ``score-groups/``;
``dsv4.kernels.indexer_topk.choose_score_group``).
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch
from topk_probe import (  # benchmarks/ is the script's folder: sys.path[0]
    _time,
    keep_variants,
    load_baseline,
    write_results,
)

from dsv4.kernels.indexer_topk import indexer_scores
from dsv4.layers.quant_sim import indexer_quant_sim

VARIANTS = {
    "default": {},
    "stages 2": dict(stages=2), "stages 3": dict(stages=3),
    "block 32": dict(block=32),
    "2 / SM": dict(programs_per_sm=2), "8 / SM": dict(programs_per_sm=8),
    "stages 2, 2 / SM": dict(stages=2, programs_per_sm=2),
    "stages 2, 8 / SM": dict(stages=2, programs_per_sm=8),
    "group 4": dict(group=4), "group 4 plain": dict(group=4, stages=0),
    "group 4 (block 32)": dict(group=4, block=32),
    "8 warps": dict(num_warps=8),
    "tma": dict(tma=True), "tma stages 7": dict(tma=True, stages=7),
    "tma 8 / SM": dict(tma=True, programs_per_sm=8), "tma 8 warps": dict(tma=True, num_warps=8),
    "tma group 4": dict(tma=True, group=4),
    "tma group 4 stages 3": dict(tma=True, group=4, stages=3),
    "tma group 4 1 / SM": dict(tma=True, group=4, programs_per_sm=1),
    "tma f8": dict(tma=True, fp8_mma=True),
    "tma f8 8 warps": dict(tma=True, fp8_mma=True, num_warps=8),
    "tma f8 2 / SM": dict(tma=True, fp8_mma=True, programs_per_sm=2),
    "tma f8 8 / SM": dict(tma=True, fp8_mma=True, programs_per_sm=8),
    "tma f8 stages 3": dict(tma=True, fp8_mma=True, stages=3),
    "tma f8 stages 8": dict(tma=True, fp8_mma=True, stages=8),
}
"""Name -> indexer_scores keywords. Left out for their spills (sm_90 compile, ``aot_sm90_regs.py
steps``): 128-entry tiles at 4 warps, and since the keys sit on the MMA's M side (d61917b)
128-entry tiles at 8 warps, 32-entry tiles pipelined over 2 stages and groups of 4 at 16
warps."""
HEADS, DIM, ROWS = 64, 128, 64
ROTATE_BYTES = 128 << 20
"""Key bytes the timed calls cycle through (above the L2 of an H100 or H200), at most 10
copies."""
ROW_BYTES = DIM + 4 * (DIM // 128)  # e4m3 values, then one float32 scale per 128


def _store(t: int, width: int, seed: int, device: str = "cuda"):
    """(keys [blocks, ROWS * ROW_BYTES] uint8, block table [t, blocks a row] int32): every
    query's sequence holds ``width`` entries of random e4m3 keys, scale 1."""
    g = torch.Generator().manual_seed(seed)
    per = -(-width // ROWS)
    blocks = t * per
    vals = torch.randn(blocks, ROWS * DIM, generator=g).to(torch.float8_e4m3fn)
    scales = torch.ones(blocks, ROWS, dtype=torch.float32).view(torch.uint8)
    keys = torch.cat([vals.view(torch.uint8), scales], dim=1).to(device)
    table = torch.randperm(blocks, generator=g).view(t, per).to(device, torch.int32)
    return keys, table


def _copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write)."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    us = _time(lambda: b.copy_(a), calls=3)
    return 2 * a.numel() / (us * 1e-6)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the JSON and table")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="another commit's indexer_topk.py: its indexer_scores as `baseline` "
                         "(topk_probe.py's docstring)")
    ap.add_argument("--variants", default="",
                    help="comma-separated variant names to time (default: every one)")
    ap.add_argument("--widths", default="4096,16384,65536",
                    help="comma-separated entries a sequence holds")
    ap.add_argument("--seqs", default="1,16,64", help="comma-separated sequence counts")
    ap.add_argument("--tokens-per-seq", default="1",
                    help="comma-separated queries per sequence (verify steps: 1 + k)")
    ap.add_argument("--rotate", type=int, default=0,
                    help="copies of the key store the timed calls cycle through (default 0: "
                         "enough to span ROTATE_BYTES; 1: warm in the L2)")
    args = ap.parse_args(argv)
    try:
        widths, seq_counts, per_seq = ([int(v) for v in a.split(",")] for a in (
            args.widths, args.seqs, args.tokens_per_seq))
    except ValueError as ex:
        raise SystemExit(f"score_probe: --widths, --seqs and --tokens-per-seq take "
                         f"comma-separated integers ({ex})") from None
    if min(widths + seq_counts + per_seq) < 1:
        raise SystemExit("score_probe: --widths, --seqs and --tokens-per-seq must be >= 1")
    if args.rotate < 0:
        raise SystemExit("score_probe: --rotate must be >= 0")
    impls = {}
    if args.baseline is not None:
        VARIANTS["baseline"] = {}
        impls["baseline"] = load_baseline(args.baseline, "baseline_indexer_topk").indexer_scores
    keep_variants(VARIANTS, args.variants)
    if not torch.cuda.is_available():
        raise SystemExit("score_probe needs a CUDA GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    bw = _copy_bandwidth()
    scale = (HEADS * DIM) ** -0.5
    rows = []
    for width, n_seq, qn in itertools.product(widths, seq_counts, per_seq):
        t = n_seq * qn
        store_bytes = n_seq * width * ROW_BYTES
        rotate = args.rotate or max(1, min(10, -(-ROTATE_BYTES // store_bytes)))
        stores = [_store(n_seq, width, seed=width + n_seq + 1000 * i) for i in range(rotate)]
        keys, table = stores[0]
        g = torch.Generator().manual_seed(t)
        q = indexer_quant_sim(torch.randn(t, HEADS, DIM, generator=g).to("cuda", torch.bfloat16))
        w = torch.randn(t, HEADS, generator=g).to("cuda", torch.bfloat16)
        slot = torch.arange(n_seq, device="cuda").repeat_interleave(qn)
        pos = (4 * width - qn + torch.arange(qn)).repeat(n_seq).to("cuda")
        call_args = (q, w, keys, "fp8", ROWS, table, slot, pos, width, scale)
        ref = indexer_scores(*call_args)
        vis = torch.isfinite(ref)
        floor_us = store_bytes / bw * 1e6
        row = {"width": width, "T": t, "seqs": n_seq, "per_seq": qn, "rotate": rotate,
               "floor_us": round(floor_us, 2)}
        rotations = [(q, w, k, "fp8", ROWS, tab, slot, pos, width, scale) for k, tab in stores]
        for name, kw in VARIANTS.items():
            fn = impls.get(name, indexer_scores)
            got = fn(*call_args, **kw)
            rtol, atol = ((1e-3, 1e-3 * float(ref[vis].abs().max())) if kw.get("fp8_mma")
                          else (1e-5, 1e-6))
            if not (torch.equal(torch.isfinite(got), vis)
                    and torch.allclose(got[vis], ref[vis], rtol=rtol, atol=atol)):
                row[name] = "differs"
                continue
            calls = itertools.cycle(rotations)
            row[name] = round(_time(lambda o=got, kw=kw, fn=fn, calls=calls: fn(
                *next(calls), out=o, **kw)), 2)
        rows.append(row)
        print(row, flush=True)
        del keys, table, stores, rotations
    write_results(args.out, "score_probe",
                  {"copy_bandwidth_TBps": round(bw / 1e12, 3), "rows": rows},
                  f"Indexer score launch, us per call (CUDA graph of 10 calls; fp8 keys, 64 heads "
                  f"x 128; floor: the key bytes at {bw / 1e12:.2f} TB/s)",
                  [("entries", "width"), ("sequences", "seqs"), ("queries each", "per_seq"),
                   ("stores cycled", "rotate"), ("floor", "floor_us")], list(VARIANTS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
