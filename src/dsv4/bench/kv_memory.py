"""Bytes one sequence holds in the paged cache, per model and stored format (CPU, no GPU needed).

For Flash and Pro, every layer type (ratio 0, 4, 128) gets a real :class:`~dsv4.cache.pool.
CachePool` on the CPU (storage allocated with ``torch.empty``: nothing is committed for rows never
touched); one sequence is grown to N positions exactly as forward steps grow it (blocks taken,
window blocks released once behind the window) and its held bytes are read from the pool
(blocks held x block bytes, plus its compressor rings). Scaled by how many layers of each type the
model has (``compress_ratios``, MTP layer included), beside the format's arithmetic minimum (the
rows attention can still read x the format's bytes per row, plus the rings) and vLLM's published
9.62 GiB per 1M-token sequence (bf16).

    python -m dsv4.bench.kv_memory --out benchmarks/results/cpu
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from dsv4.bench.args import add_out_options, check_out, choice_list, int_list, pyplot
from dsv4.cache.pool import CachePool
from dsv4.config import PRESET_NAMES, DSV4Config
from dsv4.usage import OneLineArgumentParser

FORMATS = (("bf16", "bf16"), ("fp8_ds_mla", "fp8"), ("fp8_ds_mla", "fp4"))
CONTEXTS = (4096, 65536, 1 << 20)
MODELS = ("flash", "pro")
VLLM_BF16_1M_GIB = 9.62
GIB = 1 << 30


def grow_to(pool: CachePool, n: int) -> int:
    """A new sequence grown to ``n`` positions as forward steps leave it; its held bytes."""
    seq = pool.add_sequence()
    for name, store in pool.stores.items():
        if name != "kv":
            store.grow(seq.slot, n // pool.compress_ratio)
    kv, b = pool.stores["kv"], pool.block_size
    for end in range(b, n + b, b):  # decode-sized steps: window blocks released behind
        e = min(end, n)
        kv.grow(seq.slot, e)
        first = max(0, e - pool.window + 1)
        kv.release_before(seq.slot, first, max(0, first // b - 2))
    pool._lengths[seq.slot] = n
    held = seq.held_bytes()
    seq.free()
    return held


def minimum_bytes(pool: CachePool, n: int) -> int:
    """Rows attention can still read after n positions x bytes per row, plus the rings."""
    total = min(n, pool.window - 1) * pool.stores["kv"].fmt.row_bytes()
    for name, store in pool.stores.items():
        if name != "kv":
            total += (n // pool.compress_ratio) * store.fmt.row_bytes()
    for spec, ring in pool.rings.values():
        total += spec.rows * spec.width * ring.element_size()
    return total


def measure(model: str, kv: str, index: str, n: int) -> dict[str, Any]:
    cfg = DSV4Config.preset(model)
    counts = Counter(cfg.compress_ratios[:cfg.num_layers_with_mtp])
    held = minimum = 0
    per_type = {}
    for ratio, layers in sorted(counts.items()):
        layer_id = cfg.compress_ratios.index(ratio)  # Pro's only SWA-only layer is its MTP
        pool = CachePool(cfg, layer_id, max_seqs=1, max_seq_len=n,
                         dtype=torch.bfloat16, acc_dtype=torch.float32, device="cpu",
                         step_tokens=1, kv_format_name=kv, index_format_name=index)
        h, m = grow_to(pool, n), minimum_bytes(pool, n)
        per_type[str(ratio)] = {"layers": layers, "held_bytes_per_layer": h,
                                "minimum_bytes_per_layer": m}
        held += layers * h
        minimum += layers * m
        del pool
    return {"model": model, "kv_format": kv, "index_format": index, "tokens": n,
            "held_bytes": held, "minimum_bytes": minimum, "held_gib": held / GIB,
            "minimum_gib": minimum / GIB, "over_minimum": held / minimum - 1,
            "per_layer_type": per_type}


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | kv | index keys | tokens | held GiB | minimum GiB | over minimum |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['kv_format']} | {r['index_format']} | "
                     f"{r['tokens']:,} | {r['held_gib']:.3f} | {r['minimum_gib']:.3f} | "
                     f"{100 * r['over_minimum']:.2f} % |")
    return "\n".join(lines)


RESULTS = ("kv_memory.json", "kv_memory.md", "kv_memory.png")
"""The files a run writes into ``--out``."""


def plot(rows: list[dict[str, Any]], path: Path) -> bool:
    """Write the PNG; False (said on stderr) when matplotlib is missing."""
    plt = pyplot("kv-memory", path)
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, model in zip(axes, MODELS, strict=True):
        for kv, index in FORMATS:
            pts = [r for r in rows if r["model"] == model and r["kv_format"] == kv
                   and r["index_format"] == index]
            ax.plot([r["tokens"] for r in pts], [r["held_gib"] for r in pts], marker="o",
                    label=f"kv {kv}, index {index}")
        if model == "flash":
            ax.axhline(VLLM_BF16_1M_GIB, color="grey", ls="--", label="vLLM bf16, 1M (9.62)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{model}: one sequence, all layers")
        ax.set_xlabel("tokens")
    axes[0].set_ylabel("GiB held")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def parser(prog: str | None = None) -> OneLineArgumentParser:
    ap = OneLineArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    add_out_options(ap, "kv_memory.json, .md and .png")
    ap.add_argument("--contexts", default=list(CONTEXTS), type=int_list,
                    help="comma-separated token counts (default 4096,65536,1048576)")
    ap.add_argument("--models", default=list(MODELS),
                    type=choice_list(PRESET_NAMES, "model preset"),
                    help="comma-separated presets (default flash,pro)")
    return ap


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = parser(prog)
    args = ap.parse_args(argv)
    with ap.usage_errors():
        check_out(args.out, RESULTS, args.overwrite)
    rows = [measure(m, kv, index, n) for m in args.models for kv, index in FORMATS
            for n in args.contexts]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv_memory.json").write_text(json.dumps(rows, indent=1))
    md = ("# Bytes one sequence holds in the paged cache (all layers, MTP included)\n\n"
          "`python -m dsv4.bench.kv_memory --out DIR` (pools allocated for real on the CPU, "
          "held bytes read from the pool). vLLM's DeepSeek-V4 figure for one 1M-token Flash "
          f"sequence in bf16: {VLLM_BF16_1M_GIB} GiB.\n\n" + table(rows) + "\n")
    (args.out / "kv_memory.md").write_text(md)
    wrote = ["kv_memory.json", "kv_memory.md"]
    if plot(rows, args.out / "kv_memory.png"):
        wrote.append("kv_memory.png")
    print(table(rows))
    print(f"wrote {', '.join(str(args.out / w) for w in wrote)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
