"""Passes register how to restore what they derive from the weights; the layer imports none."""

from __future__ import annotations

import subprocess
import sys

import torch

from dsv4 import derived_state
from dsv4.passes import process_weights_after_loading


def test_the_layer_module_imports_no_pass():
    code = ("import sys, dsv4.attention; "
            "print(sorted(m for m in sys.modules if m.startswith('dsv4.passes')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"


def test_passes_register_their_restorers_in_order():
    assert derived_state.restorers()[:2] == ["fuse_input_projections", "compressor_fusion"]


def test_a_reload_restores_the_fused_buffer_through_the_registered_restorer(tiny, make_layer,
                                                                           monkeypatch):
    layer = make_layer(tiny, 4)
    process_weights_after_loading(layer, passes=["compressor_fusion"])
    calls = []
    order, fn = derived_state._RESTORERS["compressor_fusion"]

    def spy(lay):
        calls.append(lay)
        return fn(lay)

    monkeypatch.setitem(derived_state._RESTORERS, "compressor_fusion", (order, spy))
    layer.load_state_dict(layer.state_dict())  # rebinding: the fusion must be rebuilt
    assert calls and calls[-1] is layer
    main, idx = layer.fused_compressor_params()
    ptr = layer._fused_compressor_weight.untyped_storage().data_ptr()
    assert main.untyped_storage().data_ptr() == ptr == idx.untyped_storage().data_ptr()
    assert torch.equal(layer._fused_compressor_weight[: main.shape[0]], main)
