"""Run a Hugging Face transformers DeepSeek-V4 model with dsv4's attention layer.

``use_dsv4_attention(model, platform="reference")`` puts a :class:`dsv4.DeepseekV4Attention`
(built on ``platform``) in place of every ``self_attn`` module of a ``DeepseekV4ForCausalLM``
(or ``DeepseekV4Model``) and returns a :class:`DSV4AttentionHandle`; ``handle.restore()`` puts
the original modules back with their weights.

Which seam, and why
-------------------
* **The module, not the attention-function registry.** transformers' ``self_attn`` module is
  exactly what dsv4's layer computes: it receives the block input after ``attn_hc`` (the
  hyper-connection pre-mix) and ``input_layernorm``, and returns the output before the
  hyper-connection post-mix. Its q / kv projections, compressors, indexer and cache updates all
  run inside the module; ``ALL_ATTENTION_FUNCTIONS`` only replaces the final softmax(QK)V over
  tensors transformers has already built, so it cannot host dsv4's compressed caches or its
  sparse selection. The module is therefore swapped.
* **The cache**: :class:`DSV4Cache` is a ``transformers.Cache`` holding, per layer, one dsv4
  cache per batch row (``layer.new_caches(batch, max_seq_len)``, created when the layer first
  runs). ``generate()`` gets one through the model's ``_prepare_cache_for_generation`` (wrapped
  on the instance, sized to the generation's ``max_cache_length``); a plain forward with
  ``use_cache`` gets one from a forward pre-hook on the inner ``DeepseekV4Model``.
* **Padding**: the same pre-hook reads the 2-D ``attention_mask`` (the 4-D mask the attention
  modules receive is built for transformers' own kv layout). Each adapter keeps only the real
  tokens of each row, calls the dsv4 layer once with ``seq_lens`` and scatters the outputs back
  (zeros at pads), so pad tokens never enter a dsv4 cache and every row's positions count its
  real tokens only (as if it had been run alone). A left-padded row therefore equals the same
  row run alone (to ~2e-7 in float32), while unmodified transformers' own attention does not:
  its padded row differs from its own unpadded run (up to 0.56 in logits of magnitude ~0.6 on
  the README's tiny example). When comparing the two on a padded batch, expect that
  difference: dsv4 is the one that matches an unpadded run.

Weights are moved, not duplicated: after a dsv4 layer is loaded, each original parameter that
dsv4 can give back bit-exactly (every one, for float32 models) is emptied; ``restore()``
refills it from dsv4's canonical export.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import Cache

from dsv4.attention import DeepseekV4Attention
from dsv4.cache.plan import StepPlan
from dsv4.config import DSV4Config
from dsv4.dialects.transformers_names import (
    official_to_transformers_rel,
    transformers_to_official_rel,
)
from dsv4.layers.weight_layout import canonical
from dsv4.platforms import build_attention
from dsv4.runner import MODES as RUNNER_MODES
from dsv4.runner import DecodeRunner, shared_mempool
from dsv4.weights import official_weight_specs

__all__ = ["DSV4AttentionAdapter", "DSV4AttentionHandle", "DSV4Cache", "dsv4_config_of",
           "use_dsv4_attention"]


class BridgeError(ValueError):
    """The model, its weights or a call cannot be served by the dsv4 bridge."""


# --------------------------------------------------------------------------------- the cache
class DSV4Cache(Cache):
    """transformers' view of dsv4's caches: per layer, one dsv4 cache per batch row.

    ``get_seq_length()`` is the number of (padded) token columns seen, as transformers expects;
    each row's dsv4 caches hold only that row's real tokens (``real_lengths``).
    """

    def __init__(self, max_seq_len: int) -> None:
        super().__init__(layers=[])
        if max_seq_len <= 0:
            raise BridgeError(f"max_seq_len={max_seq_len} must be positive")
        self.max_seq_len = int(max_seq_len)
        self.seen = 0
        self.real_lengths: list[int] | None = None
        self.layer_caches: dict[int, list[Any]] = {}

    def caches_for(self, layer_idx: int, layer: DeepseekV4Attention, batch: int) -> list[Any]:
        caches = self.layer_caches.get(layer_idx)
        if caches is None:
            if self.seen:
                raise BridgeError(f"layer {layer_idx} has no dsv4 cache although the cache has "
                                  f"seen {self.seen} tokens (was it filled by another model?)")
            caches = layer.new_caches(batch, self.max_seq_len)
            self.layer_caches[layer_idx] = caches
        if len(caches) != batch:
            raise BridgeError(f"the cache holds {len(caches)} sequences but the call has a batch "
                              f"of {batch}")
        return caches

    # transformers' Cache interface ---------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        # transformers builds a 4-D mask from this; the dsv4 adapters do not read it.
        return self.seen + int(query_length), 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.max_seq_len

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def batch_size(self) -> int:
        return -1 if self.real_lengths is None else len(self.real_lengths)

    def reset(self) -> None:
        self.seen = 0
        self.real_lengths = None
        self.layer_caches.clear()

    def _unsupported(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("DSV4Cache does not support beam search, cropping or batch "
                                  "re-indexing (dsv4 caches cannot be reordered or rolled back)")

    reorder_cache = crop = batch_repeat_interleave = batch_select_indices = _unsupported  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (f"DSV4Cache(seen={self.seen}, max_seq_len={self.max_seq_len}, "
                f"layers={sorted(self.layer_caches)})")


@dataclass
class _CallContext:
    real: torch.Tensor | None = None
    """[B, q] bool, True at real tokens of this forward call (None: all real)."""
    counts: list[int] | None = None
    """Real tokens per row of this forward call, read from ``real`` once per call (None: all
    real): the adapters need them on the host, and a read of a CUDA mask waits for the GPU."""
    decode_mode: str = "auto"
    """How the adapters run decode calls: a :class:`~dsv4.runner.DecodeRunner` mode."""


# --------------------------------------------------------------------------------- the adapter
class DSV4AttentionAdapter(nn.Module):
    """Stands where transformers' ``self_attn`` stood; runs the dsv4 layer on real tokens."""

    def __init__(self, layer: DeepseekV4Attention, layer_idx: int, context: _CallContext) -> None:
        super().__init__()
        self.dsv4 = layer
        self.layer_idx = layer_idx
        self._context = context
        self.runner = DecodeRunner(
            self._decode_step, mode=context.decode_mode,
            mempool=shared_mempool(layer.device) if layer.device.type == "cuda" else None)
        """Decode calls (one token per row): the layer's step as a CUDA graph per batch bucket
        on a GPU (transformers calls each attention module on its own, so each layer's decode
        call is its own graph, with static buffers; the layers' graphs share one memory
        pool)."""

    def _decode_step(self, plan: StepPlan, x: torch.Tensor) -> torch.Tensor:
        return self.dsv4(x, plan=plan)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: Any = None,
                position_ids: Any = None, attention_mask: Any = None, cache: Any = None,
                **kwargs: Any) -> tuple[torch.Tensor, None]:
        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        x = hidden_states
        if x.dim() != 3:
            raise BridgeError(f"hidden_states has shape {tuple(x.shape)}; expected [B, S, hidden]")
        batch, seq, hidden = x.shape
        real, counts = self._context.real, self._context.counts
        if real is not None and tuple(real.shape) != (batch, seq):
            raise BridgeError(f"the padding mask of this call is {tuple(real.shape)} but the "
                              f"attention input is [{batch}, {seq}, ...]")
        if real is None or counts is None:  # a call outside the model's forward hooks
            counts = [seq] * batch if real is None else real.sum(dim=1).tolist()
        if all(n == seq for n in counts):  # every token real: no mask indexing (a host sync)
            real = None
        if isinstance(cache, DSV4Cache):
            caches = cache.caches_for(self.layer_idx, self.dsv4, batch)
            expect = cache.real_lengths or [0] * batch
            for b, (c, n) in enumerate(zip(caches, expect, strict=True)):
                if c.length != n:
                    raise BridgeError(
                        f"layer {self.layer_idx}, row {b}: the dsv4 cache holds {c.length} tokens "
                        f"but {n} were committed (an earlier forward failed part-way?); start a "
                        "new cache")
        elif cache is None:
            caches = self.dsv4.new_caches(batch, max(seq, 1))
        else:
            raise BridgeError(f"the dsv4 attention cannot use a {type(cache).__name__}; pass a "
                              "DSV4Cache or no cache")
        rows = [b for b in range(batch) if counts[b] > 0]
        if not rows:
            return x.new_zeros(batch, seq, hidden), None
        xs = (x.reshape(batch * seq, hidden).contiguous() if real is None else x[real]).to(
            self.dsv4.dtype)
        if seq == 1 and isinstance(cache, DSV4Cache):  # a decode call: through the runner
            y = self.runner([[caches[b]] for b in rows], xs)
        else:
            positions = torch.cat([torch.arange(caches[b].length, caches[b].length + counts[b])
                                   for b in rows])
            y = self.dsv4(xs, positions, [caches[b] for b in rows],
                          seq_lens=[counts[b] for b in rows])
        if real is None:
            return y.to(x.dtype).view(batch, seq, hidden), None
        out = x.new_zeros(batch, seq, hidden)
        out[real] = y.to(out.dtype)
        return out, None

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}"


# --------------------------------------------------------------------------------- the swap
def dsv4_config_of(hf_config: Any) -> DSV4Config:
    """The dsv4 config of a transformers ``DeepseekV4Config``: unquantised weights and no
    quantisation simulation (transformers' attention runs neither)."""
    d = hf_config.to_dict()
    d.pop("quantization_config", None)
    return DSV4Config.from_dict(d).replace(fp8_weights=False, simulate_quant=False)


def _decoder_layers(model: nn.Module) -> tuple[nn.Module, list[nn.Module]]:
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(inner, "config"):
        raise BridgeError(f"{type(model).__name__} is not a transformers DeepSeek-V4 model (no "
                          ".model.layers)")
    if getattr(inner.config, "model_type", None) != "deepseek_v4":
        raise BridgeError(f"model_type={getattr(inner.config, 'model_type', None)!r}: expected "
                          "'deepseek_v4'")
    return inner, list(layers)


@dataclass
class _Swapped:
    decoder: nn.Module
    original: nn.Module
    adapter: DSV4AttentionAdapter
    freed: dict[str, tuple[str, torch.dtype]] = field(default_factory=dict)
    """transformers parameter name -> (official name, dtype) of emptied original parameters."""


def _official_weights(orig: nn.Module, layer_idx: int) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in orig.named_parameters():
        try:
            official = transformers_to_official_rel(name)
        except ValueError as e:
            raise BridgeError(f"layer {layer_idx}: {e}") from e
        if p.dtype.is_floating_point and p.element_size() == 1:
            raise BridgeError(f"layer {layer_idx}: {name} is {p.dtype}; the bridge takes "
                              "unquantised (bf16 / float32) transformers models")
        out[official] = p.detach()
    return out


def _swap_one(decoder: nn.Module, layer_idx: int, cfg: DSV4Config, platform: str,
              context: _CallContext, build_kwargs: dict[str, Any]) -> _Swapped:
    from dsv4.passes import process_weights_after_loading

    orig: Any = decoder.self_attn
    if isinstance(orig, DSV4AttentionAdapter):
        raise BridgeError(f"layer {layer_idx} already runs dsv4's attention")
    weights = _official_weights(orig, layer_idx)
    ref = orig.q_a_proj.weight
    layer = build_attention(cfg, layer_idx, platform=platform, device=ref.device,
                                      dtype=ref.dtype, **build_kwargs)
    specs = {s.name: s for s in official_weight_specs(layer)}
    layer.load_weights((n, t.to(specs[n].param.dtype) if n in specs else t)
                       for n, t in weights.items())
    process_weights_after_loading(layer)
    swapped = _Swapped(decoder, orig, DSV4AttentionAdapter(layer, layer_idx, context))
    exported = _canonical_weights(layer)
    params = dict(orig.named_parameters())
    for official, t in weights.items():
        name = official_to_transformers_rel(official)
        back = exported[official].to(device=t.device, dtype=t.dtype)
        if torch.equal(back, t):  # dsv4 can give it back exactly: free the original
            swapped.freed[name] = (official, t.dtype)
    for name in swapped.freed:
        p = params[name]
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    decoder.self_attn = swapped.adapter
    return swapped


def _canonical_weights(layer: DeepseekV4Attention) -> dict[str, torch.Tensor]:
    """The layer's weights by official name, canonical layout, in the layer's own dtypes and on
    its device (``export_official_weights`` rounds to the checkpoint dtypes, e.g. bf16)."""
    out = {}
    for spec in official_weight_specs(layer):
        value = canonical(spec.param).detach()
        out[spec.name] = value if spec.rows is None else value[spec.rows]
    return out


def _unswap_one(s: _Swapped) -> None:
    if s.freed:
        weights = _canonical_weights(s.adapter.dsv4)
        params = dict(s.original.named_parameters())
        for name, (official, dtype) in s.freed.items():
            params[name].data = weights[official].to(dtype=dtype, copy=True)
    s.decoder.self_attn = s.original


class DSV4AttentionHandle:
    """What :func:`use_dsv4_attention` changed; ``restore()`` undoes it."""

    def __init__(self, model: nn.Module, inner: nn.Module, platform: str, max_seq_len: int,
                 cfg: DSV4Config) -> None:
        self.model = model
        self.inner = inner
        self.platform = platform
        self.max_seq_len = max_seq_len
        self.cfg = cfg
        self.context = _CallContext()
        self.swapped: list[_Swapped] = []
        self._hooks: list[Any] = []
        self._patched_prepare = False
        self._pending: tuple[DSV4Cache, int, int] | None = None
        self.active = False

    @property
    def layers(self) -> list[DeepseekV4Attention]:
        """The dsv4 layers now in the model, in layer order."""
        return [s.adapter.dsv4 for s in self.swapped]

    def new_cache(self, max_seq_len: int | None = None) -> DSV4Cache:
        return DSV4Cache(max_seq_len or self.max_seq_len)

    def restore(self) -> None:
        """Put the original attention modules (with their weights) back and remove the hooks."""
        if not self.active:
            raise BridgeError("this handle was already restored")
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._patched_prepare:
            del self.model.__dict__["_prepare_cache_for_generation"]
            self._patched_prepare = False
        errors = []
        for s in reversed(self.swapped):
            try:
                _unswap_one(s)
            except Exception as e:  # keep restoring the others, then report
                errors.append(f"layer {s.adapter.layer_idx}: {e}")
        self.swapped.clear()
        self.active = False
        if errors:
            raise BridgeError("restore failed for " + "; ".join(errors))

    # hooks -----------------------------------------------------------------------------------
    def _pre_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                     ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        ref = ids if ids is not None else embeds
        if ref is None:
            raise BridgeError("the forward call has neither input_ids nor inputs_embeds")
        batch, q = ref.shape[0], ref.shape[1]
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        if mask is None:
            self.context.real, self.context.counts = None, None
        elif isinstance(mask, torch.Tensor) and mask.dim() == 2:
            if mask.shape[0] != batch or mask.shape[1] < q:
                raise BridgeError(f"attention_mask has shape {tuple(mask.shape)} for a call of "
                                  f"{batch} x {q} tokens")
            real = mask[:, mask.shape[1] - q:].to(torch.bool)
            self.context.real, self.context.counts = real, real.sum(dim=1).tolist()
        else:
            raise BridgeError("the dsv4 attention needs the 2-D padding attention_mask [B, S] "
                              f"(got {type(mask).__name__} "
                              f"{getattr(mask, 'shape', '')}); it builds its own causal masks")
        key = "cache" if "cache" in kwargs or "past_key_values" not in kwargs else \
            "past_key_values"
        cache = kwargs.get(key)
        use_cache = kwargs.get("use_cache")
        if use_cache is None:
            use_cache = getattr(self.inner.config, "use_cache", False)
        if cache is None and use_cache:
            kwargs[key] = cache = DSV4Cache(max(self.max_seq_len, q))
        elif cache is not None and not isinstance(cache, DSV4Cache):
            if isinstance(cache, Cache) and cache.get_seq_length() == 0:
                kwargs[key] = cache = DSV4Cache(max(self.max_seq_len, q))
            else:
                raise BridgeError(f"a {type(cache).__name__} holding tokens cannot be continued "
                                  "by dsv4's attention; pass a DSV4Cache (handle.new_cache())")
        if isinstance(cache, DSV4Cache):
            if cache.real_lengths is not None and len(cache.real_lengths) != batch:
                raise BridgeError(f"the cache holds {len(cache.real_lengths)} sequences but the "
                                  f"call has a batch of {batch}")
            self._pending = (cache, batch, q)
        else:
            self._pending = None
        return args, kwargs

    def _post_forward(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        """Commit the call: every layer ran, so the cache advances by this call's tokens."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        cache, batch, q = pending
        added = self.context.counts if self.context.counts is not None else [q] * batch
        old = cache.real_lengths or [0] * batch
        cache.real_lengths = [a + b for a, b in zip(old, added, strict=True)]
        cache.seen += q

    def _patch_generate(self) -> None:
        original: Any = self.model._prepare_cache_for_generation
        sig = inspect.signature(original)
        handle = self

        def prepare(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            bound = sig.bind(*args, **kwargs).arguments
            model_kwargs = bound["model_kwargs"]
            cache = model_kwargs.get("cache")
            if cache is not None and not isinstance(cache, DSV4Cache) and \
                    not getattr(cache, "_is_user_defined", False):
                size = int(bound.get("max_cache_length") or handle.max_seq_len)
                model_kwargs["cache"] = DSV4Cache(size)
            return result

        self.model.__dict__["_prepare_cache_for_generation"] = prepare
        self._patched_prepare = True


def use_dsv4_attention(model: nn.Module, platform: str = "reference",
                       max_seq_len: int | None = None, decode_mode: str = "auto",
                       **build_kwargs: Any) -> DSV4AttentionHandle:
    """Run every attention module of a transformers DeepSeek-V4 model with dsv4's layer on
    ``platform``; returns the handle whose ``restore()`` undoes it.

    ``max_seq_len`` sizes the dsv4 caches of plain forward calls with ``use_cache`` (default:
    ``min(max_position_embeddings, 4096)``); ``generate()`` sizes its cache itself.
    ``decode_mode``: how decode calls (one token per row) run, a
    :class:`~dsv4.runner.DecodeRunner` mode (``auto``: each layer's decode step a CUDA graph
    per batch bucket on a GPU, eager elsewhere). If a layer fails to swap, the layers already
    swapped are restored and the error is raised.
    """
    if decode_mode not in RUNNER_MODES:
        raise BridgeError(f"decode_mode={decode_mode!r}; valid: {', '.join(RUNNER_MODES)}")
    inner, decoders = _decoder_layers(model)
    cfg = dsv4_config_of(inner.config)
    limit = max_seq_len or min(cfg.max_position_embeddings, 4096)
    handle = DSV4AttentionHandle(model, inner, platform, limit, cfg)
    handle.context.decode_mode = decode_mode
    try:
        for i, decoder in enumerate(decoders):
            handle.swapped.append(_swap_one(decoder, i, cfg, platform, handle.context,
                                            build_kwargs))
    except Exception:
        for s in reversed(handle.swapped):
            _unswap_one(s)
        handle.swapped.clear()
        raise
    handle._hooks.append(inner.register_forward_pre_hook(handle._pre_forward, with_kwargs=True))
    handle._hooks.append(inner.register_forward_hook(handle._post_forward, with_kwargs=True))
    if hasattr(model, "_prepare_cache_for_generation"):
        handle._patch_generate()
    handle.active = True
    return handle

