"""What the ``dsv4 bench`` suites' command lines share: the layer-type names, and comma-separated
list types checked by argparse, so that a bad value is a usage error (exit code 2), never a
traceback."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from dsv4.usage import UsageError, check_output_dir

LAYER_RATIO = {"C4": 4, "C128": 128, "SWA": 0}
"""Layer types by name: their compress ratio."""
SERVING_CACHES = {"kv_cache_dtype": "fp8_ds_mla", "index_cache_dtype": "fp8"}
"""The store formats a serving engine runs (the benches' serving configuration): FlashMLA's fp8
kv rows and fp8 index keys."""


def int_list(text: str, minimum: int = 1) -> list[int]:
    """``"1,16,64"`` -> [1, 16, 64]; integers of at least ``minimum`` (default: positive)."""
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        values = []
    if not values or any(v < minimum for v in values):
        what = "positive integers" if minimum == 1 else f"integers >= {minimum}"
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated {what}")
    return values


def choice_list(valid: Iterable[str], what: str) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated subset of ``valid`` (order kept), else an error
    naming the unknown ``what``."""
    valid = tuple(valid)

    def parse(text: str) -> list[str]:
        values = [v for v in text.split(",") if v]
        bad = [v for v in values if v not in valid]
        if not values or bad:
            raise argparse.ArgumentTypeError(f"{what} {bad or text!r}: valid are "
                                             f"{', '.join(valid)}")
        return values
    return parse


def plan_changes(fixed: Iterable[str] = (), why: str = "") -> Callable[[str], dict[str, int]]:
    """An argparse type for ``--plan``: ``"fp8_gemm_max_tokens=256,fused_max_tokens=32"`` ->
    {field: value}, fields of the ``cuda`` platform's plan
    (:class:`~dsv4.platforms.cuda.CudaPlan`, integers >= 0) that a bench's layers take
    instead of ``cuda_plan.json``'s; a field in ``fixed`` (one the bench sets itself, ``why``),
    an unknown field or a bad value is an error naming it."""
    fixed = tuple(fixed)

    def parse(text: str) -> dict[str, int]:
        from dsv4.platforms.cuda import CudaPlan

        changes: dict[str, int] = {}
        for item in (t for t in text.split(",") if t):
            name, eq, value = item.partition("=")
            if not eq or not value.strip().isdigit():
                raise argparse.ArgumentTypeError(f"{item!r}: expected FIELD=N with N an "
                                                 "integer >= 0")
            if name in fixed:
                raise argparse.ArgumentTypeError(f"{name}: {why}")
            changes[name] = int(value)
        if not changes:
            raise argparse.ArgumentTypeError(f"{text!r}: expected FIELD=N[,FIELD=N]")
        try:  # names and values checked against the plan's fields (no table read)
            CudaPlan(0, 0).overridden(changes)
        except ValueError as ex:
            raise argparse.ArgumentTypeError(str(ex)) from None
        return changes
    return parse


def require_cuda(suite: str) -> None:
    """Exit (code 2, one line on stderr) when this machine has no CUDA GPU. Each GPU suite calls
    it after parsing and checking its arguments and after the modes that need none
    (``--report-only``, the CPU dry run of ``decode-step --tp``), so those run, and bad
    arguments are named, anywhere."""
    import torch

    if not torch.cuda.is_available():
        print(f"dsv4 bench {suite}: error: needs a CUDA GPU (the results of the latest GPU "
              "runs are in benchmarks/results/, by date and card)", file=sys.stderr)
        raise SystemExit(2)


def add_out_options(ap: argparse.ArgumentParser, what: str) -> None:
    """``--out`` (the results folder, ``what`` it receives) and ``--overwrite``: every suite
    takes both, and checks them with :func:`check_out` before any work."""
    ap.add_argument("--out", required=True, type=Path,
                    help=f"folder for {what} (created if needed; one that holds results of an "
                    "earlier run is refused unless --overwrite)")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace the results of an earlier run in --out (default: refuse)")


def check_out(out: Path, results: Iterable[str], overwrite: bool) -> None:
    """Before any work: ``--out`` can be created or written in, and holds none of the files
    ``results`` (what this run would write) unless ``overwrite``: earlier results are never
    replaced silently. A :class:`UsageError` naming them otherwise."""
    check_output_dir("--out", out)
    earlier = sorted(name for name in results if (out / name).exists())
    if earlier and not overwrite:
        raise UsageError(f"--out {out}: holds the results of an earlier run "
                         f"({', '.join(earlier)}); give another folder, or --overwrite to "
                         "replace them")


def check_report_source(out: Path, results: str) -> None:
    """``--report-only``: the results file the report is remade from exists, and the folder
    can be written in (the report replaces the earlier one: that is what was asked for)."""
    if not (Path(out) / results).is_file():
        raise UsageError(f"--out {out}: holds no {results} to remake the report from (run the "
                         "suite without --report-only first)")
    check_output_dir("--out", out)


def pyplot(suite: str, png: str | Path) -> Any:
    """matplotlib's pyplot on the Agg backend, or None after one line on stderr saying that the
    PNG ``png`` is not written (matplotlib, the ``bench`` extra, is optional); an earlier run's
    PNG there is removed then, as it would not show the new results."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        Path(png).unlink(missing_ok=True)
        print(f"dsv4 bench {suite}: warning: matplotlib is not installed (pip install "
              f"matplotlib), so {Path(png).name} was not written", file=sys.stderr, flush=True)
        return None
    return plt
