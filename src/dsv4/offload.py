"""Weight offloading, handed to ``build`` / ``load_checkpoint`` as an object (no module global).

* :class:`NoopOffloader` (the default) keeps every weight on the layer's device.
* :class:`CpuOffloader` keeps weights in (pinned, where available) host memory and copies them to
  the device just before the layer runs, on a side stream ahead of use when prefetching. It is
  **fusion-aware**: a fused buffer (the compressor GEMM fusion) moves as one unit and the parameter
  views are re-pointed into it on every move, so the fusion stays on under offload.
* An offloader that rebinds parameters without knowing about fusion (``fusion_aware = False``, like
  upstream's UVA and prefetch offloaders) makes the fusion pass skip with one warning, as upstream.

Lifecycle: build -> load_weights -> post-load passes -> ``offloader.post_init(layer)`` (run by
``process_weights_after_loading``), so passes always see the final device weights first.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from dsv4.attention import DeepseekV4Attention

log = logging.getLogger(__name__)


class BaseOffloader:
    """Interface. ``is_noop``: weights never move. ``fusion_aware``: the offloader keeps fused
    buffers and their parameter views consistent, so post-load fusion may stay on."""

    name = "base"
    is_noop = False
    fusion_aware = False

    def post_init(self, layer: DeepseekV4Attention) -> None:
        """Called once per layer after its post-load passes."""

    def describe(self) -> str:
        return self.name


class NoopOffloader(BaseOffloader):
    name = "noop"
    is_noop = True
    fusion_aware = True


@dataclass
class _Unit:
    """Tensors that move together: one host copy of a storage and everything that views it
    (parameters, and buffers such as a fused weight)."""

    name: str
    host: torch.Tensor
    views: list[tuple[str, int, tuple[int, ...]]]
    """(parameter or buffer name in the layer, element offset into the unit, shape)."""
    device_copy: torch.Tensor | None = None


@dataclass
class _LayerState:
    units: list[_Unit] = field(default_factory=list)
    ready: Any = None
    """CUDA event recorded when the prefetch copy finished (None: not in flight)."""
    on_device: bool = False


class CpuOffloader(BaseOffloader):
    """Offload the selected weights of each layer to host memory (fusion-aware).

    ``param_names``: state_dict names (relative to the layer) to offload; default: all weights of
    GEMMs (``*.weight`` of 2-D parameters). ``prefetch``: after layer i runs, start copying layer
    i+1 to the device on a side stream (CUDA only).
    """

    name = "cpu"
    fusion_aware = True

    def __init__(self, device: torch.device | str, param_names: list[str] | None = None,
                 pin_memory: bool | None = None, prefetch: bool = True) -> None:
        self.device = torch.device(device)
        self.param_names = param_names
        can_pin = torch.cuda.is_available()
        self.pin_memory = can_pin if pin_memory is None else (pin_memory and can_pin)
        self.prefetch = prefetch and self.device.type == "cuda"
        self._stream: Any = torch.cuda.Stream(self.device) if self.prefetch else None
        self._layers: list[DeepseekV4Attention] = []
        self._state: dict[int, _LayerState] = {}

    def describe(self) -> str:
        return f"cpu(pinned={self.pin_memory}, prefetch={self.prefetch})"

    # ---- setup ----------------------------------------------------------------------------
    def _selected(self, layer: DeepseekV4Attention) -> list[tuple[str, nn.Parameter]]:
        out = []
        for name, p in layer.named_parameters():
            if self.param_names is None:
                if p.dim() == 2 and name.endswith("weight"):
                    out.append((name, p))
            elif name in self.param_names:
                out.append((name, p))
        return out

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        h = t.detach().to("cpu", copy=True).contiguous()
        return h.pin_memory() if self.pin_memory else h

    @torch.no_grad()
    def post_init(self, layer: DeepseekV4Attention) -> None:
        if id(layer) in self._state:
            raise RuntimeError(f"layer {layer.layer_id} is already offloaded by this offloader")
        state = _LayerState()
        for unit in self._units(layer):
            state.units.append(unit)
        self._point_params(layer, state, on_device=False)
        self._state[id(layer)] = state
        self._layers.append(layer)
        layer.register_forward_pre_hook(self._before_forward)
        layer.register_forward_hook(self._after_forward)
        moved = sum(u.host.numel() * u.host.element_size() for u in state.units)
        log.debug("layer %d: offloaded %d unit(s), %.1f MB", layer.layer_id, len(state.units),
                  moved / 1e6)

    def _units(self, layer: DeepseekV4Attention) -> list[_Unit]:
        """Group the selected weights by storage: a fused buffer and every parameter or buffer
        that views it become one unit (fusion-aware), any other weight a unit of its own."""
        tensors: dict[str, torch.Tensor] = {n: p for n, p in self._selected(layer)}
        for name, buf in layer.named_buffers():
            if buf is not None and buf.dim() == 2 and not name.endswith("inv_freq"):
                tensors[name] = buf
        groups: dict[int, list[str]] = {}
        for name, t in tensors.items():
            groups.setdefault(t.untyped_storage().data_ptr(), []).append(name)
        units = []
        for names in groups.values():
            shared = len(names) > 1
            if not shared and names[0] not in dict(self._selected(layer)):
                continue  # a lone buffer (e.g. fp32 scales): stays where it is
            root_name = max(names, key=lambda n: tensors[n].numel())
            root = tensors[root_name]
            if not root.is_contiguous():
                raise RuntimeError(f"layer {layer.layer_id}: {root_name} is not contiguous")
            views = []
            for n in names:
                t = tensors[n]
                offset = int(t.storage_offset() - root.storage_offset())
                if offset < 0 or offset + t.numel() > root.numel() or not t.is_contiguous():
                    raise RuntimeError(f"layer {layer.layer_id}: {n} is not a contiguous view "
                                       f"inside {root_name}; cannot offload them together")
                views.append((n, offset, tuple(t.shape)))
            units.append(_Unit(root_name, self._host(root), views))
        return units

    def _point_params(self, layer: DeepseekV4Attention, state: _LayerState,
                      on_device: bool) -> None:
        for unit in state.units:
            src = unit.device_copy if on_device else unit.host
            assert src is not None
            for name, offset, shape in unit.views:
                view = src.view(-1)[offset: offset + _numel(shape)].view(shape)
                module_name, _, attr = name.rpartition(".")
                owner = layer.get_submodule(module_name) if module_name else layer
                if attr in owner._parameters:
                    owner._parameters[attr].data = view  # type: ignore[union-attr]
                else:
                    setattr(owner, attr, view)
        state.on_device = on_device

    # ---- movement -------------------------------------------------------------------------
    def _copy_in(self, state: _LayerState) -> None:
        for unit in state.units:
            unit.device_copy = unit.host.to(self.device, non_blocking=self.pin_memory)

    def _start_prefetch(self, layer: DeepseekV4Attention) -> None:
        state = self._state[id(layer)]
        if state.on_device or state.ready is not None:
            return
        with torch.cuda.stream(self._stream):
            self._copy_in(state)
            state.ready = torch.cuda.Event()
            state.ready.record()

    def _before_forward(self, layer: nn.Module, args: Any) -> None:
        state = self._state[id(layer)]
        if state.ready is not None:  # prefetched on the side stream
            torch.cuda.current_stream(self.device).wait_event(state.ready)
            for unit in state.units:
                assert unit.device_copy is not None
                unit.device_copy.record_stream(torch.cuda.current_stream(self.device))
            state.ready = None
        elif not state.on_device:
            self._copy_in(state)
        self._point_params(layer, state, on_device=True)  # type: ignore[arg-type]

    def _after_forward(self, layer: nn.Module, args: Any, output: Any) -> None:
        state = self._state[id(layer)]
        self._point_params(layer, state, on_device=False)  # type: ignore[arg-type]
        for unit in state.units:
            unit.device_copy = None
        if self.prefetch:
            i = next(k for k, m in enumerate(self._layers) if m is layer)
            nxt = self._layers[(i + 1) % len(self._layers)]
            self._start_prefetch(nxt)

    def device_bytes(self, layer: DeepseekV4Attention) -> int:
        """Bytes of offloaded weights currently held on the device for ``layer``."""
        state = self._state[id(layer)]
        return sum(u.device_copy.numel() * u.device_copy.element_size()
                   for u in state.units if u.device_copy is not None)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def resolve_offloader(offloader: BaseOffloader | None) -> BaseOffloader:
    return NoopOffloader() if offloader is None else offloader
