"""Layout tags for parameters whose storage is not the canonical (checkpoint) layout.

A platform pass that rewrites a weight in place (for example the (16, 16) preshuffle) tags the
parameter with a :class:`WeightLayout`. The tag is a Python attribute on the ``Parameter`` object,
so it survives ``.data`` reassignment and module device moves. Three consumers read it:

* plain GEMM paths refuse a tagged weight (the upstream #51821 failure becomes an error);
* ``state_dict()`` and ``save_checkpoint`` return the canonical values;
* ``load_weights`` converts incoming canonical tensors into the stored layout.
"""

from __future__ import annotations

from typing import Protocol

import torch

_ATTR = "_dsv4_layout"


class WeightLayout(Protocol):
    """A reversible, shape- and dtype-preserving re-arrangement of a weight's storage."""

    name: str

    def to_canonical(self, stored: torch.Tensor) -> torch.Tensor: ...

    def from_canonical(self, canonical: torch.Tensor) -> torch.Tensor: ...


class PlatformLayoutError(RuntimeError):
    """A weight in a platform-private layout reached code that expects the canonical layout."""


def get_layout(t: torch.Tensor) -> WeightLayout | None:
    return getattr(t, _ATTR, None)


def set_layout(t: torch.Tensor, layout: WeightLayout | None) -> None:
    setattr(t, _ATTR, layout)


def canonical(t: torch.Tensor) -> torch.Tensor:
    """The canonical value of ``t`` (``t`` itself when it carries no layout tag). Pass the
    Parameter itself: ``detach()`` returns a new tensor without the tag."""
    layout = get_layout(t)
    return t if layout is None else layout.to_canonical(t.detach())


def require_canonical(t: torch.Tensor, name: str) -> None:
    layout = get_layout(t)
    if layout is not None:
        raise PlatformLayoutError(
            f"{name} is stored in the platform-private layout {layout.name!r} and was sent to a "
            "plain GEMM; it must go through the platform's override point (the upstream #51821 "
            "failure: a preshuffled weight multiplied as if it were canonical)"
        )
