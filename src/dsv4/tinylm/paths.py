"""Where the shipped tiny model lives (no torch import: the ``dsv4`` command's help uses it).

The model ships inside the package (``dsv4/tinylm/tiny-arith``, declared as package data), so a
regular ``pip install``, a wheel and an editable install all find it from any working directory.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

MODEL_NAME = "tiny-arith"


def default_model_dir() -> Path:
    """The shipped model's folder, ``tiny-arith`` inside the installed ``dsv4.tinylm`` package."""
    return Path(str(resources.files("dsv4.tinylm").joinpath(MODEL_NAME)))
