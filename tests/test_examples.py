"""docs/porting.md's worked example keeps working."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from dsv4 import passes, platforms
from dsv4.testing.contract import structural_violations
from dsv4.testing.verify import conformance

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_int8_example_platform_conforms():
    sys.path.insert(0, str(EXAMPLES))
    try:
        import int8_platform

        int8_platform.register()
        try:
            assert structural_violations(int8_platform.Int8Attention) == []
            rows = conformance(["int8"], tokens=48)
            assert all(r.ok for r in rows), [r for r in rows if not r.ok]
            assert all("int8_wo_b" in r.passes for r in rows)
            assert min(r.rel_err for r in rows) > 1e-4  # the int8 path really ran
            assert torch.tensor([r.rel_err for r in rows]).max() < 3e-2
        finally:
            platforms.unregister_platform("int8")
            passes.unregister_pass("int8_wo_b")
    finally:
        sys.path.remove(str(EXAMPLES))
    assert "int8_wo_b" not in passes.ORDER
