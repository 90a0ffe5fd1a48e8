"""Every ```python block of README.md and docs/usage.md runs as written (fresh namespace, from
the repository root, temporary files under pytest's tmp folder)."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/usage.md")
BLOCKS = [(doc, block) for doc in DOCS
          for block in re.findall(r"^```python\n(.*?)^```", (ROOT / doc).read_text(),
                                  flags=re.S | re.M)]


def test_readme_has_python_blocks():
    assert {doc for doc, _ in BLOCKS} == set(DOCS)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index, tmp_path, monkeypatch):
    doc, block = BLOCKS[index]
    if "from transformers import" in block:
        pytest.importorskip("transformers")  # an optional extra (CI installs it)
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    code = compile(block, f"{doc} python block {index}", "exec")
    exec(code, {"__name__": f"readme_block_{index}"})  # noqa: S102 - the README is ours
