"""The indexer's top-k kernel at decode widths: its variants against the default.

Variants: programs per row (``split``), scores per iteration and warps, the merge's width, the
radix digit's bits (``digit_bits``), the final sort by score left out (``sort=False``).

    PYTHONPATH=src python3 benchmarks/topk_probe.py --out DIR   # a CUDA GPU
    ... --baseline OLD.py   # also time OLD.py's topk_entries (its defaults) as ``baseline``

``--baseline`` takes a copy of ``src/dsv4/kernels/indexer_topk.py`` from another commit
(``git show COMMIT:src/dsv4/kernels/indexer_topk.py > .baseline/indexer_topk_COMMIT.py``, an
ignored folder the device tool can carry), so a kernel change is timed against the kernel it
replaces in the same run.

For k = 512 and 1024 (Flash's and Pro's), rows of 4K, 16K and 64K entries (contexts 16K, 64K,
256K: every entry visible), 1, 16 and 64 queries, random scores and scores with many exact
ties, each variant's selection must equal the one-program kernel's bit for bit (a variant that
differs is reported and not timed); then each is timed as 10 calls captured in a CUDA graph,
replayed (median of 7). A split variant's calls each zero its arrival counts first (in the
layer the score launch does): the ``zero`` column times that fill alone, to subtract. Writes
``topk_probe.json`` and ``topk_probe.md`` under DIR, again after every row (a run cut by a
time limit keeps the rows it timed).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from dsv4.kernels.indexer_topk import choose_scan, choose_split, topk_entries
from dsv4.kernels.sparse_mqa import _n_sm

VARIANTS = {
    "1p 1024x8": dict(split=1, block=1024, num_warps=8),
    "1p 4096x8": dict(split=1, block=4096, num_warps=8),
    "auto": {},  # choose_split / choose_scan / choose_merge_block
    "2p": dict(split=2), "4p": dict(split=4), "8p": dict(split=8), "16p": dict(split=16),
    "8p m1024": dict(split=8, merge_block=1024), "8p m4096": dict(split=8, merge_block=4096),
    "4p 1024x8": dict(split=4, block=1024, num_warps=8),
    "1p 4096x8 nosort": dict(split=1, block=4096, num_warps=8, sort=False),
    "auto nosort": dict(sort=False),
    "auto b4": dict(digit_bits=4), "auto b2": dict(digit_bits=2),
    "1p 4096x8 b4": dict(split=1, block=4096, num_warps=8, digit_bits=4),
    "auto b4 nosort": dict(digit_bits=4, sort=False),
    # a chunk that fits its block is held in registers (loaded once for every pass): 16K
    # entries as 8 chunks of 2048 or 4 of 4096, 64K as 8 of 8192
    "8p 2048x8": dict(split=8, block=2048, num_warps=8),
    "8p 2048x8 b4": dict(split=8, block=2048, num_warps=8, digit_bits=4),
    "4p 4096x8 b4": dict(split=4, block=4096, num_warps=8, digit_bits=4),
    "8p 8192x16 b4": dict(split=8, block=8192, num_warps=16, digit_bits=4),
    # a verify step's 64 rows of 16K entries (4 chunks of 4096 at k = 512): the merge's
    # 2048 candidates held in one 2048-wide block instead of streamed in two of 1024; the
    # layer's calls leave out the sort
    "auto nosort b4": dict(digit_bits=4, sort=False),
    "4p m2048 nosort": dict(split=4, merge_block=2048, sort=False),
    "4p b4 m2048 nosort": dict(split=4, merge_block=2048, digit_bits=4, sort=False),
    "8p nosort": dict(split=8, sort=False),
}
"""Name -> topk_entries keywords. H200 probes of 2026-12-04: with one program per row, 4096 x 8
beat 1024 x 8, 2048 x 8, 4096 x 16, 8192 x 32 (8192 x 16 ties at 64K); a two-level method (a
1024-bin coarse histogram) lost everywhere, 2-3x, and was removed (dbc8d43)."""
TOPKS = (512, 1024)
"""Flash's and Pro's ``index_topk``."""


IMPLS: dict[str, Callable[..., torch.Tensor]] = {}
"""Variant name -> the ``topk_entries`` it calls where not the package's (``baseline``)."""


def keep_variants(variants: dict, names: str) -> None:
    """``--variants``: drop every variant not named in ``names`` (comma-separated; "": keep
    all); an unknown name is an error that lists the known ones."""
    if not names:
        return
    unknown = sorted(set(names.split(",")) - set(variants))
    if unknown:
        raise SystemExit(f"unknown --variants {unknown}; known: {sorted(variants)}")
    for name in set(variants) - set(names.split(",")):
        del variants[name]


def load_baseline(path: Path, name: str) -> ModuleType:
    """The kernel module at ``path`` (a copy of one of ``dsv4.kernels``' files from another
    commit), imported as ``name``: its kernels are its own, its imports the package's."""
    if not path.is_file():
        raise SystemExit(f"--baseline {path}: no such file")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _scores(kind: str, t: int, width: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        s = torch.randn(t, width, generator=g)
    else:  # many exact ties, a quarter exact zeros (as ReLU sums of zero queries give)
        s = torch.randint(-3, 4, (t, width), generator=g).float() * 0.25
        s[:, ::4] = 0.0
    return s.cuda()


def _time(fn, reps: int = 7, calls: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times)


def write_results(out: Path, stem: str, payload: object, title: str,
                  keys: list[tuple[str, str]], names: list[str], echo: bool = True) -> None:
    """``out/stem.json`` (``payload``) and ``out/stem.md``: ``title``, then a table of the rows
    (``payload["rows"]`` or ``payload`` itself) with the ``keys`` columns (header, row key)
    then one column per variant name (a row without one shows "-"); ``echo``: the table is
    printed too."""
    (out / f"{stem}.json").write_text(json.dumps(payload, indent=1))
    rows = payload["rows"] if isinstance(payload, dict) else payload
    heads = [h for h, _ in keys] + names
    lines = [title, "", "| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    lines += ["| " + " | ".join(str(r.get(k, "-")) for k in [k for _, k in keys] + names)
              + " |" for r in rows]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    if echo:
        print("\n".join(lines))


def _choice(width: int, k: int, t: int, n_sm: int) -> list[int]:
    """The default's (split, scan block, warps) for a row of ``width`` entries."""
    split = choose_split(width, k, t, n_sm)
    return [split, *choose_scan(-(-width // split))]


def _probe_row(k: int, width: int, t: int, kind: str, n_sm: int) -> dict:
    s = _scores(kind, t, width, seed=width + t)
    pos = torch.full((t,), 4 * width - 1, dtype=torch.long, device=s.device)
    ref = topk_entries(s, pos, k, split=1)
    arr = torch.zeros(t, dtype=torch.int32, device=s.device)
    row = {"k": k, "width": width, "T": t, "scores": kind,
           "choice": _choice(width, k, t, n_sm), "zero": round(_time(arr.zero_), 2)}
    for name, kw in VARIANTS.items():
        fn = IMPLS.get(name, topk_entries)
        got = fn(s, pos, k, **kw)
        # sort=False leaves each row's entries by ascending index: compare the sets
        same = (torch.equal(got, ref) if kw.get("sort", True)
                else torch.equal(got.sort(dim=1).values, ref.sort(dim=1).values))
        if not same:
            row[name] = "differs"
            continue

        def call(o=got, kw=kw, fn=fn):
            arr.zero_()
            fn(s, pos, k, out=o, arrivals=arr, **kw)
        row[name] = round(_time(call), 2)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the JSON and table")
    ap.add_argument("--topks", default="512,1024", help="comma-separated k (default: both)")
    ap.add_argument("--widths", default="4096,16384,65536",
                    help="comma-separated row widths in entries")
    ap.add_argument("--variants", default="",
                    help="comma-separated variant names to time (default: every one)")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="another commit's indexer_topk.py: its topk_entries as `baseline`")
    args = ap.parse_args(argv)
    if args.baseline is not None:
        VARIANTS["baseline"] = {}
        IMPLS["baseline"] = load_baseline(args.baseline, "baseline_indexer_topk").topk_entries
    keep_variants(VARIANTS, args.variants)
    if not torch.cuda.is_available():
        raise SystemExit("topk_probe needs a CUDA GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    n_sm = _n_sm(torch.cuda.current_device())
    rows: list[dict] = []

    def write(echo: bool) -> None:
        write_results(args.out, "topk_probe", rows,
                      "Top-k kernel, us per call (CUDA graph of 10 calls; every entry visible; "
                      "each call includes a zero fill of the arrival counts, timed alone in "
                      "`zero`; `auto`'s choice: split, block, warps)",
                      [("k", "k"), ("width", "width"), ("T", "T"), ("scores", "scores"),
                       ("auto's choice", "choice")], ["zero", *VARIANTS], echo)

    for k in (int(v) for v in args.topks.split(",")):
        for width in (int(v) for v in args.widths.split(",")):
            for t in (1, 16, 64):
                for kind in ("random", "ties"):
                    rows.append(_probe_row(k, width, t, kind, n_sm))
                    print(rows[-1], flush=True)
                    write(echo=False)  # a run cut by a time limit keeps its rows' table
    write(echo=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
