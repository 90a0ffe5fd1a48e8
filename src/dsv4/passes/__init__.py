"""Post-load weight passes and the pipeline that runs them."""

from dsv4.passes.base import Mutation, Skip, WeightPass
from dsv4.passes.pipeline import (
    ORDER,
    PASSES,
    PassReport,
    prepare_compressor_gemm_fusion,
    process_weights_after_loading,
    register_pass,
    unregister_pass,
)

__all__ = ["ORDER", "PASSES", "Mutation", "PassReport", "Skip", "WeightPass",
           "prepare_compressor_gemm_fusion", "process_weights_after_loading", "register_pass",
           "unregister_pass"]
