"""Post-load weight passes and the pipeline that runs them."""

from dsv4.passes.base import Skip, WeightPass
from dsv4.passes.pipeline import (
    ORDER,
    PASSES,
    PassReport,
    process_weights_after_loading,
    register_pass,
)

__all__ = ["ORDER", "PASSES", "PassReport", "Skip", "WeightPass",
           "process_weights_after_loading", "register_pass"]
