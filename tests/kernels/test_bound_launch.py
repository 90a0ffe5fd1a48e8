"""Bound Triton launches (dsv4.kernels.bound_launch): a launch that skips Triton's per-call
binding reaches exactly the compiled kernel Triton itself picks for the same arguments, with the
same argument list, across every change that makes Triton specialise differently (alignment,
dtype, integers equal to 1 / divisible by 16 / past int32 or int64, booleans, None, constexprs,
launch options); and it takes Triton's own path where hooks or a callable grid ask for it.

No GPU: Triton's driver and compiler are replaced by stand-ins (each compile returns a recorder
named by Triton's cache key), so this runs wherever Triton imports."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from triton.runtime import jit as triton_jit  # noqa: E402

from dsv4.kernels import bound_launch  # noqa: E402
from dsv4.kernels.bound_launch import launch  # noqa: E402
from dsv4.testing.triton_stand_ins import STREAM, stand_in_triton  # noqa: E402


def _probe(x_ptr, y_ptr, n, stride, scale, flag, M: tl.constexpr,  # type: ignore[no-untyped-def]
           DT: tl.constexpr = tl.float32, PDL: tl.constexpr = False):
    pass


@pytest.fixture
def stand_in(monkeypatch):
    """A fresh JIT function of ``_probe`` under the stand-in driver and compiler; yields it
    and the recording kernels by key."""
    monkeypatch.setattr(bound_launch, "_INTERPRET", False)
    with stand_in_triton() as kernels:
        yield triton_jit.JITFunction(_probe), kernels


def test_a_bound_launch_reaches_the_kernel_triton_picks(stand_in):
    fn, recorders = stand_in
    rng = random.Random(0)
    base = torch.zeros(64, dtype=torch.float32)
    tensors = [base, base[1:], base.to(torch.bfloat16), base[4:], torch.zeros(3, dtype=torch.int32)]
    ints = [0, 1, 2, 15, 16, 17, 48, -16, -17, 2**31 - 16, 2**31, 2**40, 2**63 - 16, 2**63 + 16]
    seen_keys: set[str] = set()
    for _ in range(600):
        x = rng.choice(tensors)
        y = rng.choice([None, *tensors])
        args = (x, y, rng.choice(ints), rng.choice(ints), rng.choice([0.5, 2.0]),
                rng.choice([True, False]))
        kw: dict[str, Any] = {"M": rng.choice([16, 32])}
        if rng.random() < 0.5:
            kw["DT"] = rng.choice([tl.float32, tl.bfloat16])
        kw["num_warps"] = rng.choice([4, 8])
        kw["PDL"] = rng.random() < 0.5
        grid = (rng.randint(1, 9), rng.randint(1, 3))
        # Triton's own path: which compiled kernel, with which arguments
        want = fn[grid](*args, **kw)
        want_call = want.last
        for attempt in range(2):  # the second launch of the same arguments is bound
            before = {k: r.launches for k, r in recorders.items()}
            launch(fn, grid, *args, **kw)
            moved = [k for k, r in recorders.items() if r.launches != before.get(k, 0)]
            assert moved == [want.key], (args, kw)
            got_call = want.last
            assert got_call[:4] == (grid[0], grid[1], 1, STREAM)
            assert got_call[4:6] == ("fn", "meta")
            assert got_call[9:] == want_call[9:]  # every argument, in signature order
            assert got_call[7] is None or attempt == 0  # the bound path passes no hooks
        seen_keys.add(want.key)
    assert len(seen_keys) > 50  # the draws made Triton specialise in many ways


def test_tensor_descriptors_launch_bound_by_dtype_block_and_padding(stand_in):
    """A TMA tensor descriptor argument: Triton specialises on its base's dtype, its block
    shape and padding; a bound launch reaches the kernel Triton picks, with the descriptor
    itself passed on (the launcher builds its tensor map), new shapes and bases alike."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    fn, recorders = stand_in
    rng = random.Random(1)
    bases = [torch.zeros(64, 64), torch.zeros(32, 128, dtype=torch.bfloat16),
             torch.zeros(128, 32)]
    seen_keys: set[str] = set()
    for _ in range(200):
        b = rng.choice(bases)
        block = [rng.choice([8, 16]), rng.choice([16, 32])]
        desc = TensorDescriptor(b, list(b.shape), list(b.stride()), block,
                                padding=rng.choice(["zero", "nan"]))
        args = (bases[0], desc, 16, 17, 0.5, True)
        want = fn[(2,)](*args, M=16)
        want_call = want.last
        for attempt in range(2):  # the second launch of the same specialisation is bound
            launch(fn, (2,), *args, M=16)
            assert want.last[7] is None or attempt == 0
            assert want.last[9:] == want_call[9:] and want.last[10] is desc
        seen_keys.add(want.key)
    assert len(seen_keys) >= 8


def test_other_values_of_one_specialisation_launch_bound(stand_in):
    """New tensors, integers, floats and grids that Triton specialises alike: the first launch
    with them is already bound, to the same compiled kernel, with the new values."""
    fn, recorders = stand_in
    a, b = torch.zeros(64), torch.ones(64)
    launch(fn, (2,), a, b, 32, 17, 0.5, True, M=16, num_warps=4)
    (rec,) = recorders.values()
    for x, y, n, stride, scale, grid in ((b, a, 48, 33, 2.0, (5, 2)),
                                         (a[4:], b[8:], 2**20, 2**20 + 1, -1.0, (1, 1, 3))):
        launch(fn, grid, x, y, n, stride, scale, True, M=16, num_warps=4)
        assert len(recorders) == 1
        call = rec.last
        assert call[7] is None  # bound
        assert call[:3] == (grid + (1, 1))[:3]
        assert call[9:] == (x, y, n, stride, scale, True, 16, tl.float32, False)


def test_hooks_and_callable_grids_take_tritons_path(stand_in):
    fn, recorders = stand_in
    x = torch.zeros(16)
    args = (x, x, 32, 16, 1.0, False)
    launch(fn, (2,), *args, M=16)
    launch(fn, (2,), *args, M=16)
    (rec,) = recorders.values()
    assert rec.last[7] is None  # bound
    calls: list[Any] = []
    hook = calls.append
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        launch(fn, (2,), *args, M=16)
        assert rec.last[7] is not None  # Triton's path passes its hooks on
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    launch(fn, lambda meta: (3,), *args, M=16)
    assert rec.last[7] is not None and rec.last[0] == 3
    launch(fn, (2,), *args, M=16)
    assert rec.last[7] is None


def test_a_missing_argument_is_named_by_triton(stand_in):
    fn, _ = stand_in
    x = torch.zeros(16)
    with pytest.raises(TypeError, match="flag"):
        launch(fn, (1,), x, x, 1, 1, 1.0, M=16)
