"""``process_weights_after_loading``: run each layer's platform passes in order (placeholder
until the pass objects land: no pass is registered yet, so the report is empty)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from torch import nn

log = logging.getLogger(__name__)


@dataclass
class PassReport:
    """Per pass: the layers it changed and the layers it skipped, with the reason."""

    changed: dict[str, list[int]] = field(default_factory=dict)
    skipped: dict[str, list[tuple[int, str]]] = field(default_factory=dict)


def process_weights_after_loading(module: nn.Module) -> PassReport:
    return PassReport()
