"""Post-load weight passes and the pipeline that runs them (see ``pipeline.py``)."""

from dsv4.passes.pipeline import PassReport, process_weights_after_loading

__all__ = ["PassReport", "process_weights_after_loading"]
