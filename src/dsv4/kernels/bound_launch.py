"""Triton kernels launched without re-binding their arguments on every call.

``kernel[grid](*args, **kwargs)`` runs Triton's ``JITFunction.run`` each time: it binds the
arguments to the signature, computes every argument's specialisation (dtype, 16-byte alignment
of pointers, integers equal to 1 or divisible by 16), builds the cache key of the compiled
kernel, checks the options and assembles the launch metadata - about 22-28 us of Python per
launch with Triton 3.6 (``benchmarks/triton_launch_cost.py``), a dozen times in an eager decode
call. :func:`launch` does the same launch through that path once per *specialisation* and then
keeps the compiled kernel: later calls with arguments that specialise alike go straight to the
compiled kernel's launcher with the argument list in signature order.

What makes two calls "alike" is a key at least as fine as Triton's own specialisation: for
every tensor its dtype and its data pointer modulo 16 (Triton asks: aligned?); for every integer
whether it equals 1, whether it is divisible by 16 and which of int32 / int64 / uint64 holds
it; for a tensor descriptor (the TMA's: ``triton.tools.tensor_descriptor``) its base's dtype,
block shape and padding (its base is 16-byte aligned by construction); for booleans, floats
and None their type (booleans their value); every constexpr, every
launch option (``num_warps``, ``num_stages``, ``launch_pdl``, ...) and the current device by
value. So a call that Triton would compile differently never reuses another call's kernel;
a key finer than Triton's only costs an extra (cached) trip through Triton.

The full path runs instead whenever something outside the arguments could change the launch:
Triton's CPU interpreter, a launch hook (profilers install them), the kernel's pre-run hooks,
``TRITON_DEBUG``, an instrumentation mode, or a callable grid. The compiled kernel Triton
returns is the one its own cache holds, so both paths launch the same code.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable
from typing import Any

import torch

from dsv4.kernels.launch import _INTERPRET, triton_available

if triton_available():
    from triton import knobs
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction
    from triton.tools.tensor_descriptor import TensorDescriptor

_MISSING = inspect.Parameter.empty
_I32, _I64 = 2**31, 2**63
"""Integer arguments: Triton's specialisation depends on whether one equals 1, is divisible by
16, and which of int32 / int64 / uint64 holds it. The key keeps integers of magnitude < 16 by
value, codes the other int32 values 16 (not divisible by 16) or 17 (divisible), and the rest
(divisible by 16, within int64)."""
_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})


def _picker(indices: list[int]) -> Callable[[list[Any]], tuple[Any, ...]]:
    """A function picking ``indices`` out of a list, as a tuple (C-level itemgetter)."""
    if not indices:
        return lambda full: ()
    if len(indices) == 1:
        i = indices[0]
        return lambda full: (full[i],)
    return operator.itemgetter(*indices)


class _CallShape:
    """How one call shape (the number of positional arguments, the keyword names in order) of
    a kernel maps to its signature: where each parameter comes from, which are constexpr."""

    def __init__(self, fn: Any, n_args: int, kw_names: tuple[str, ...]) -> None:
        names = list(fn.arg_names)
        params = list(fn.params)
        self.ok = n_args <= len(names)
        self.source: list[tuple[str, Any]] = []
        """Per parameter past the positional ones: ("kw", name) or ("default", value)."""
        for i in range(n_args, len(names)):
            if names[i] in kw_names:
                self.source.append(("kw", names[i]))
            elif params[i].default is not _MISSING:
                self.source.append(("default", params[i].default))
            else:
                self.ok = False  # Triton's own path names the missing argument
        self.options = tuple(k for k in kw_names if k not in names)
        self.constexpr = _picker([i for i, p in enumerate(params) if p.is_constexpr])
        self.runtime = _picker([i for i, p in enumerate(params) if not p.is_constexpr])
        self.layouts: dict[tuple[type, ...], _Layout] = {}


class _Binding:
    """One kernel's call shapes and the compiled kernels seen per specialisation key."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.shapes: dict[tuple[Any, ...], _CallShape] = {}
        self.compiled: dict[tuple[Any, ...], Any] = {}

    def key_and_args(self, args: tuple[Any, ...], kwargs: dict[str, Any]
                     ) -> tuple[tuple[Any, ...], list[Any]] | None:
        """The specialisation key and the signature-ordered argument list of one call, or None
        where the call must take Triton's own path."""
        shape_key = (len(args), *kwargs)
        shape = self.shapes.get(shape_key)
        if shape is None:
            shape = self.shapes[shape_key] = _CallShape(self.fn, len(args), tuple(kwargs))
        if not shape.ok:
            return None
        full = list(args)
        if shape.source:
            full += [kwargs[v] if how == "kw" else v for how, v in shape.source]
        kinds = tuple(map(type, shape.runtime(full)))
        layout = shape.layouts.get(kinds)
        if layout is None:
            layout = shape.layouts[kinds] = _Layout(shape.runtime(list(range(len(full)))),
                                                    kinds)
        tensors = layout.tensors(full)
        descs = tuple([(d.base.dtype, tuple(d.block_shape), d.padding)
                       for d in layout.descs(full)])
        key = (driver.active.get_current_device(), shape_key, kinds, descs,
               tuple([t.dtype for t in tensors]), tuple([t.data_ptr() & 15 for t in tensors]),
               tuple([v if -16 < v < 16 else (16 if v & 15 else 17) if -_I32 <= v < _I32
                      else (v & 15 == 0, -_I64 <= v < _I64) for v in layout.ints(full)]),
               layout.by_value(full), shape.constexpr(full),
               tuple([kwargs[k] for k in shape.options]))
        return key, full


class _Layout:
    """Which runtime parameters of one call shape hold tensors, integers, or values Triton
    specialises by value (booleans; floats and None by type alone), for one tuple of their
    types."""

    def __init__(self, runtime: tuple[int, ...], kinds: tuple[type, ...]) -> None:
        pairs = list(zip(runtime, kinds, strict=True))
        self.tensors = _picker([i for i, k in pairs if k in _TENSORS])
        self.descs = _picker([i for i, k in pairs if k is TensorDescriptor])
        self.ints = _picker([i for i, k in pairs if k is int])
        self.by_value = _picker([i for i, k in pairs if k is bool])
        for k in kinds:
            if not (k in _TENSORS or k in (int, bool, float, type(None), TensorDescriptor)):
                raise TypeError(f"no key for a runtime argument of type {k.__name__}")


_BINDINGS: dict[int, _Binding] = {}


def _plain_path_only(fn: Any, grid: Any) -> bool:
    """Whether this launch must take Triton's own path (module docstring)."""
    runtime = knobs.runtime
    return (_INTERPRET or not isinstance(fn, JITFunction) or callable(grid)
            or bool(fn.pre_run_hooks) or bool(runtime.launch_enter_hook.calls)
            or bool(runtime.launch_exit_hook.calls) or runtime.debug
            or bool(knobs.compilation.instrumentation_mode))


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """``kernel[grid](*args, **kwargs)``, bound once per specialisation (module docstring).
    ``grid``: a tuple of 1-3 program counts."""
    if _plain_path_only(kernel, grid):
        kernel[grid](*args, **kwargs)
        return
    binding = _BINDINGS.get(id(kernel))
    if binding is None or binding.fn is not kernel:
        binding = _BINDINGS[id(kernel)] = _Binding(kernel)
    try:
        bound = binding.key_and_args(args, kwargs)
        compiled = None if bound is None else binding.compiled.get(bound[0])
    except TypeError:  # an argument the key cannot take (unhashable, of an unknown type)
        bound = compiled = None
    if bound is None or compiled is None:
        compiled = kernel[grid](*args, **kwargs)
        if bound is not None and compiled is not None:
            binding.compiled[bound[0]] = compiled
        return
    key, full = bound
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    compiled.run(grid[0], g1, g2, driver.active.get_current_stream(key[0]), compiled.function,
                 compiled.packed_metadata, None, None, None, *full)
