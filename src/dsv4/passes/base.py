"""What a post-load weight pass is.

A pass looks at one layer and either says why it skips (already done, not applicable, an
offloader that would break it) or returns the mutation to run. Looking never mutates and raises
``ValueError`` for invalid weights, so the pipeline can plan a pass over every layer of a model
before it changes any of them: a failure leaves every parameter, buffer and ``state_dict()``
exactly as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from dsv4.attention import DeepseekV4Attention


@dataclass(frozen=True)
class Skip:
    reason: str


Mutation = Callable[[], None]


class WeightPass(Protocol):
    name: str

    def plan(self, layer: DeepseekV4Attention) -> Mutation | Skip:
        """Validate ``layer`` and return the mutation, or why the pass skips it."""
        ...
