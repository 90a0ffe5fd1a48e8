"""What the ``dsv4 bench`` suites' command lines share: the layer-type names, and comma-separated
list types checked by argparse, so that a bad value is a usage error (exit code 2), never a
traceback."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable

LAYER_RATIO = {"C4": 4, "C128": 128, "SWA": 0}
"""Layer types by name: their compress ratio."""


def int_list(text: str) -> list[int]:
    """``"1,16,64"`` -> [1, 16, 64]; positive integers only."""
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated positive integers")
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


def require_cuda(suite: str) -> None:
    """Exit (code 2, one line on stderr) when this machine has no CUDA GPU. Each GPU suite calls
    it after parsing its arguments and after the modes that need none (``--report-only``, the
    CPU dry run of ``decode-step --tp``), so those run, and bad arguments are named, anywhere."""
    import sys

    import torch

    if not torch.cuda.is_available():
        print(f"dsv4 bench {suite} needs a CUDA GPU (the results of the last H200 run are in "
              "benchmarks/results/h200/)", file=sys.stderr)
        raise SystemExit(2)
