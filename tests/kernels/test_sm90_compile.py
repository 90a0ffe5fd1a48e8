"""The step kernels compile for sm_90 (Triton's real compiler and ptxas, no GPU needed): the CPU
interpreter accepts code the compiler refuses, and a GPU session is too short to find that out.
Runs wherever Triton is installed and not interpreting (benchmarks/aot_sm90_regs.py ``steps``),
except on a machine with a CUDA GPU: there the kernel tests compile and run every kernel for
the card itself, and these serial compiles (2-3 minutes each alone on 2 cores, cold) held two
of the suite's workers past its whole 560 s call on an H100 (2026-12-06)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from dsv4.kernels.fused_input_proj import _INTERPRET, triton_available

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "aot_sm90_regs.py"
COMPILER = pytest.mark.skipif(
    not triton_available() or _INTERPRET or torch.cuda.is_available(),
    reason="needs Triton's compiler (installed, TRITON_INTERPRET unset) and no CUDA GPU (there "
    "the kernel tests compile every kernel for the card)")


def _script():
    spec = importlib.util.spec_from_file_location("aot_sm90_regs", SCRIPT)
    assert spec is not None and spec.loader is not None
    aot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(aot)
    return aot


@COMPILER
def test_step_kernels_compile_for_sm90_without_spills(capsys):
    aot = _script()
    assert aot.steps(), "a kernel failed to compile (its traceback is printed above)"
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "REG:" in ln]
    assert len(lines) >= 20
    spilled = [ln for ln in lines if "STACK:0 " not in ln and not _split_topk_within(ln)
               and not _rope_frame_within(ln)]
    assert not spilled, spilled


# The split top-k's last program holds its merge's candidates beside the chunk scan: ptxas
# keeps up to 112 bytes of them on the stack at some (P, k, block) and none at others, and no
# register cap removes it (maxnreg 168 / 255 at P = 8, k = 512: 192 / 120 bytes). Those builds
# are the measured faster ones (64K entries, P = 8: 60.5 us against 70.6 with a 1024-wide merge
# that does not spill; H200, 2026-12-04), so a bounded stack is allowed there and only there.
SPLIT_TOPK_STACK_BYTES = 128


def _split_topk_within(line: str) -> bool:
    if "indexer top-k split=" not in line:
        return False
    stack = int(line.split("STACK:")[1].split()[0])
    return stack <= SPLIT_TOPK_STACK_BYTES


# A build that rotates by RoPE angles (the split-KV combine with the output's inverse RoPE)
# calls libdevice's sinf / cosf, whose slow argument reduction keeps a 32-byte local array:
# the frame is reserved but that path never runs (the angle is reduced to [-pi, pi] in fp64
# first: dsv4.kernels.rope_norm.rope_cos_sin). Every RoPE kernel has it; allowed there only.
ROPE_FRAME_BYTES = 32


def _rope_frame_within(line: str) -> bool:
    if "rope_nope2=" not in line or "rope_nope2=-1" in line:
        return False
    return int(line.split("STACK:")[1].split()[0]) <= ROPE_FRAME_BYTES


@COMPILER
def test_quantising_stages_compile_for_sm90():
    assert _script().stages(), "a kernel failed to compile (its traceback is printed above)"


@COMPILER
def test_every_kernel_compiles_with_pdl(capsys):
    """PDL on (dsv4.kernels.launch): each kernel's PTX waits for the one before and lets the
    next launch (aot_sm90_regs checks both, and that PDL-off builds have neither)."""
    aot = _script()
    assert aot.pdl(), "a kernel failed to compile with PDL (its traceback is printed above)"
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "REG:" in ln]
    assert len(lines) >= 60 and all(" pdl " in ln for ln in lines)
