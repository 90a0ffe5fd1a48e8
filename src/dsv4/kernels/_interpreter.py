"""Triton CPU-interpreter compatibility (TRITON_INTERPRET=1 only; nothing changes on a GPU).

Triton 3.6's interpreter holds every scalar as a 1-element array and converts it to a Python int
with ``int(array)`` when a kernel runs ``range(lo, hi)`` over run-time bounds. NumPy >= 2.4
refuses ``int()`` of an array with ndim > 0, so such loops fail under the interpreter with
"only 0-dimensional arrays can be converted to Python scalars". ``patch_interpreter_index``
re-installs the tensor's ``__index__`` with an element read that works on any NumPy.
"""

from __future__ import annotations

_DONE = False


def patch_interpreter_index() -> None:
    global _DONE
    if _DONE:
        return
    _DONE = True
    try:
        from triton.runtime import interpreter as _itp
    except Exception:  # pragma: no cover - no triton
        return
    original = getattr(_itp, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_dsv4_wrapped", False):
        return

    def _patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__",
                       lambda self: int(self.handle.data.reshape(-1)[0]))

    _patched._dsv4_wrapped = True  # type: ignore[attr-defined]
    _itp._patch_lang_tensor = _patched
