"""A worked example of an out-of-tree platform (docs/porting.md): ``wo_b`` in int8 with one
scale per output row, converted by a post-load pass and multiplied in ``_o_proj``.

    python examples/int8_platform.py        # registers it and runs the conformance matrix
"""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override

from dsv4 import DeepseekV4Attention
from dsv4.passes import Mutation, Skip, register_pass
from dsv4.platforms import Platform, register_platform


class Int8Attention(DeepseekV4Attention):
    platform_name = "int8"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # derived from the canonical fp8 wo_b (which stays, so state_dict is canonical as is)
        self.register_buffer("_wo_b_int8", None, persistent=False)
        self.register_buffer("_wo_b_row_scale", None, persistent=False)

    @override
    def _o_proj(self, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if not isinstance(self._wo_b_int8, torch.Tensor):  # the pass did not run
            return super()._o_proj(o, positions)
        o = self.rotary.rotate(o, positions, self.acc_dtype, inverse=True)
        z = self._fp8_linear_input(self._wo_a_grouped(o))  # the contract: cfg.act_quant
        w = self._wo_b_int8.to(z.dtype) * self._wo_b_row_scale[:, None].to(z.dtype)
        return torch.nn.functional.linear(z, w)  # stands for the backend's int8 kernel

    @override
    def _after_weights_changed(self) -> None:
        super()._after_weights_changed()
        if isinstance(self._wo_b_int8, torch.Tensor):  # a reload: re-derive
            convert_wo_b(self)


@torch.no_grad()
def convert_wo_b(layer: Int8Attention) -> None:
    w = layer.wo_b.dequantized_weight(torch.float32)
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
    layer._wo_b_int8 = torch.round(w / scale[:, None]).to(torch.int8)
    layer._wo_b_row_scale = scale


class Int8WoBPass:
    name = "int8_wo_b"

    def plan(self, layer: DeepseekV4Attention) -> Mutation | Skip:
        if not isinstance(layer, Int8Attention):
            return Skip(f"platform {layer.platform_name!r} has no int8 wo_b")
        if isinstance(layer._wo_b_int8, torch.Tensor):
            return Skip("already converted")
        if not bool(torch.isfinite(layer.wo_b.dequantized_weight(torch.float32)).all()):
            raise ValueError(f"layer {layer.layer_id}: wo_b is not finite")  # validate only
        return lambda: convert_wo_b(layer)


def register() -> None:
    register_pass(Int8WoBPass(), after="preshuffle")
    register_platform(Platform(
        name="int8", description="int8 wo_b with per-row scales (example)",
        attention_path="int8_platform:Int8Attention",
        pass_names=("compressor_fusion", "int8_wo_b"),
        conformance_tolerance=3e-2))


if __name__ == "__main__":
    import os
    import sys

    from dsv4.testing.verify import run_verify

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import int8_platform  # the registered path names this module, not __main__

    int8_platform.register()
    ok, report = run_verify(["int8"], device="cpu", tokens=160)
    print(report)
    sys.exit(0 if ok else 1)
