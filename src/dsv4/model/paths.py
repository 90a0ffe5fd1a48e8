"""Where the shipped tiny model lives (no torch import: the ``dsv4`` command's help uses it)."""

from __future__ import annotations

from pathlib import Path


def default_model_dir() -> Path:
    """The shipped model: ``models/tiny-arith`` of the repository (or of the installed package's
    source tree)."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        candidate = parent / "models" / "tiny-arith"
        if (candidate / "config.json").is_file():
            return candidate
    return here.parents[3] / "models" / "tiny-arith"
