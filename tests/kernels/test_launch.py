"""Programmatic dependent launch (dsv4.kernels.launch): the switch, the launch keywords, and
that every kernel takes part - it waits for the kernel before as its first statement, lets the
next one launch as its last, and every launch passes the keywords (a kernel that skipped the
wait would race its predecessor's writes once PDL is on; one launched without them would
silently not take part)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from dsv4.kernels import launch
from dsv4.kernels.launch import (
    pdl_args,
    programmatic_launch,
    programmatic_launch_enabled,
    set_programmatic_launch,
)

KERNELS = Path(launch.__file__).parent


def test_switch_and_context_restore():
    prev = programmatic_launch_enabled()
    try:
        set_programmatic_launch(False)
        with programmatic_launch():
            assert programmatic_launch_enabled()
            with programmatic_launch(False):
                assert not programmatic_launch_enabled()
            assert programmatic_launch_enabled()
        assert not programmatic_launch_enabled()
        with pytest.raises(KeyError), programmatic_launch():
            raise KeyError("inside")
        assert not programmatic_launch_enabled()  # restored on the exception too
        with pytest.raises(TypeError, match="must be a bool"):
            set_programmatic_launch(1)  # type: ignore[arg-type]
        assert not programmatic_launch_enabled()  # unchanged by the refused call
    finally:
        set_programmatic_launch(prev)


def test_the_environment_switch_takes_0_or_1_only(monkeypatch):
    from dsv4.usage import env_switch  # DSV4_PDL's reader (and DSV4_SHARE_STEP_METADATA's)

    for default in (False, True):
        assert env_switch("DSV4_PDL", "1", default=default)
        assert not env_switch("DSV4_PDL", "0", default=default)
        assert env_switch("DSV4_PDL", "", default=default) is default
        for bad in ("yes", "true", "2", " 1"):
            with pytest.raises(ValueError, match="DSV4_PDL must be 0 or 1"):
                env_switch("DSV4_PDL", bad, default=default)
    # without a value it reads the variable itself
    monkeypatch.delenv("DSV4_PDL", raising=False)
    assert env_switch("DSV4_PDL", default=True) and not env_switch("DSV4_PDL", default=False)
    monkeypatch.setenv("DSV4_PDL", "0")
    assert not env_switch("DSV4_PDL", default=True)
    monkeypatch.setenv("DSV4_PDL", "on")
    with pytest.raises(ValueError, match="DSV4_PDL must be 0 or 1"):
        env_switch("DSV4_PDL", default=True)


def test_on_by_default(monkeypatch):
    """A fresh process without DSV4_PDL launches with PDL; DSV4_PDL=0 turns it off."""
    import subprocess
    import sys

    code = "from dsv4.kernels.launch import programmatic_launch_enabled as e; print(e())"
    for env, want in ((None, "True"), ("0", "False"), ("1", "True")):
        if env is None:
            monkeypatch.delenv("DSV4_PDL", raising=False)
        else:
            monkeypatch.setenv("DSV4_PDL", env)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True).stdout.strip()
        assert out == want, (env, out)


def test_off_where_it_cannot_apply():
    with programmatic_launch():
        assert pdl_args(torch.device("cpu")) == {"PDL": False}
    with programmatic_launch(False):
        assert pdl_args(torch.device("cpu")) == {"PDL": False}


@pytest.mark.skipif(not torch.cuda.is_available() or launch._INTERPRET,
                    reason="needs a CUDA device and Triton's compiler")
def test_on_for_a_hopper_device():
    dev = torch.device("cuda")
    want = torch.cuda.get_device_capability() >= (9, 0) and launch._HAVE_GDC
    with programmatic_launch():
        assert pdl_args(dev) == ({"PDL": True, "launch_pdl": True} if want else {"PDL": False})
    with programmatic_launch(False):
        assert pdl_args(dev) == {"PDL": False}


def _jit_functions(tree: ast.Module) -> list[ast.FunctionDef]:
    def jitted(f: ast.FunctionDef) -> bool:
        for d in f.decorator_list:
            target = d.func if isinstance(d, ast.Call) else d
            if ast.unparse(target) == "triton.jit":
                return True
        return False

    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and jitted(n)]


def _launches(tree: ast.Module) -> list[ast.Call]:
    """Calls of the form ``launch(kernel, grid, ...)`` (:mod:`dsv4.kernels.bound_launch`)."""
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Name) and n.func.id == "launch"
            and n.args and isinstance(n.args[0], ast.Name)]


def _unbound_launches(tree: ast.Module) -> list[str]:
    """Calls of the form ``kernel[grid](...)``: Triton's own launch path on every call."""
    return [ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Subscript) and isinstance(n.func.value, ast.Name)]


WAIT = "wait_for_prior_kernel(PDL)"
LAST = "let_next_kernel_launch"


def _body(f: ast.FunctionDef) -> list[ast.stmt]:
    body = f.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return body


def kernel_violations(source: str) -> list[str]:
    """What a kernel module gets wrong about PDL (empty: nothing)."""
    tree = ast.parse(source)
    launched = {c.args[0].id for c in _launches(tree)}  # type: ignore[attr-defined]
    out = [f"{name}(...): not launched through bound_launch.launch"
           for name in _unbound_launches(tree)]
    for f in _jit_functions(tree):
        if f.name not in launched:
            continue  # a helper, inlined into the kernels that call it
        args = [a.arg for a in f.args.args]
        flag = "USE_PDL" if "USE_PDL" in args else "PDL"
        if flag not in args:
            out.append(f"{f.name}: no PDL constexpr")
            continue
        if flag == "PDL" and ast.unparse(_body(f)[0]) != WAIT:
            # (the one-launch input kernel waits inside its segment helper)
            out.append(f"{f.name}: its first statement is not {WAIT}")
        if ast.unparse(f.body[-1]) != f"{LAST}({flag})":
            out.append(f"{f.name}: its last statement is not {LAST}({flag})")
    for c in _launches(tree):
        name = c.args[0].id  # type: ignore[attr-defined]
        kws = {k.arg for k in c.keywords}
        if "USE_PDL" in kws:
            continue
        if not any(k.arg is None and ast.unparse(k.value).startswith("pdl_args(")
                   for k in c.keywords):
            out.append(f"launch({name}, ...): launched without **pdl_args(device)")
    return out


def test_every_kernel_takes_part():
    checked = 0
    for path in sorted(KERNELS.glob("*.py")):
        source = path.read_text()
        if "triton.jit" not in source or path.name in ("launch.py", "bound_launch.py"):
            continue
        assert kernel_violations(source) == [], path.name
        checked += len(_launches(ast.parse(source)))
    assert checked >= 17  # every launch site of the step and prefill kernels


def test_the_check_catches_a_kernel_that_does_not_wait():
    src = (KERNELS / "paged_rows.py").read_text()
    assert kernel_violations(src) == []
    bad = src.replace("        wait_for_prior_kernel(PDL)\n", "", 1)
    assert bad != src and any("first statement" in v for v in kernel_violations(bad))
    bad = src.replace(", PDL: tl.constexpr = False", "", 1)
    assert any("no PDL constexpr" in v for v in kernel_violations(bad))
    bad = src.replace("**pdl_args(pos.device)", "num_stages=1", 1)
    assert bad != src and any("without **pdl_args" in v for v in kernel_violations(bad))
    bad = src.replace("        let_next_kernel_launch(PDL)\n", "", 1)
    assert bad != src and any("last statement" in v for v in kernel_violations(bad))
    bad = src.replace("launch(_flat_rows_kernel, (t, 2 if window is not None else 1),",
                      "_flat_rows_kernel[(t, 2 if window is not None else 1)](", 1)
    assert bad != src and any("not launched through" in v for v in kernel_violations(bad))


def test_the_next_kernel_launches_only_at_the_end():
    """No kernel lets the next one launch before its own end (the one-launch input kernel, with
    its own ``USE_PDL``, included): only ``let_next_kernel_launch`` emits the trigger."""
    for path in sorted(KERNELS.glob("*.py")):
        if path.name != "launch.py":
            assert "gdc_launch_dependents" not in path.read_text(), path.name
    src = (KERNELS / "fused_input_proj.py").read_text()
    assert src.count("tl.extra.cuda.gdc_wait()") == 1
    assert "let_next_kernel_launch(USE_PDL)" in src


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or launch._INTERPRET,
                    reason="needs a CUDA device and Triton's compiler")
@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_a_layer_under_pdl_computes_the_same_bits(tiny, ratio):
    """Prefill, an eager decode step and its CUDA graph (captured under PDL) of the cuda layer
    (fp8 GEMM kernels, step kernels, fp8 cache) equal the same calls without PDL bit for bit."""
    from dsv4 import process_weights_after_loading
    from dsv4.platforms.cuda import CudaAttention
    from dsv4.testing.random_weights import random_layer_weights

    from conftest import assert_decode_graph_equals_eager, random_x

    if torch.cuda.get_device_capability() >= (9, 0) and launch._HAVE_GDC:
        with programmatic_launch():
            assert pdl_args(torch.device("cuda"))["PDL"]  # the path under test is taken
    lid = tiny.layer_of_ratio(ratio)
    cfg = tiny.replace(kv_cache_dtype="fp8_ds_mla")
    layer = CudaAttention(cfg, lid, device="cuda", dtype=torch.bfloat16)
    layer.load_weights(random_layer_weights(cfg, lid, seed=1).items())
    process_weights_after_loading(layer)
    h = cfg.hidden_size
    prompts = [random_x(37 + 5 * i, h, seed=i).to("cuda", torch.bfloat16) for i in range(2)]
    x = random_x(2, h, seed=9).to("cuda", torch.bfloat16)

    def run(on: bool) -> tuple[list[torch.Tensor], torch.Tensor, list]:
        with programmatic_launch(on):
            caches = layer.new_caches(2, 96)
            outs = [layer(p, torch.arange(p.shape[0]), c)
                    for p, c in zip(prompts, caches, strict=True)]
            pos = torch.tensor([c.length for c in caches])
            step = layer(x, pos, caches)
            for c, p in zip(caches, prompts, strict=True):
                c.truncate(p.shape[0])
            return outs, step, caches

    outs0, step0, _ = run(False)
    outs1, step1, caches = run(True)
    assert all(torch.equal(a, b) for a, b in zip(outs0, outs1, strict=True))
    assert torch.equal(step0, step1)
    with programmatic_launch():
        assert_decode_graph_equals_eager(layer, caches, x)
