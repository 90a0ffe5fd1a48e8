"""GPT-J (interleaved) rotary embedding on the last ``rope_dim`` dims, with the DSV4 per-layer rule.

* ratio-0 layers: base ``rope_theta``, no YaRN;
* compressed layers: base ``compress_rope_theta`` with the YaRN frequency blend, unconditionally.

Angles are built as upstream does: frequencies computed in float32 (DeepSeek's reference
``precompute_freqs_cis``, which vLLM follows), angle = float32(position) * float32(frequency) in
float32. cos/sin are evaluated in the compute dtype
(fp32, or fp64 of the same fp32 angle when the layer runs in float64), so a float64 evaluation and
the bf16 path rotate by the same angles.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dsv4.config import DSV4Config, YarnScaling, yarn_ramp_bounds


def rope_inv_freq(rope_dim: int, base: float, yarn: YarnScaling | None) -> torch.Tensor:
    """Per-pair inverse frequencies (float32), with the YaRN blend when ``yarn`` is given.

    Computed in float32 exactly as DeepSeek's reference ``precompute_freqs_cis`` does:
    ``1 / base ** (arange(0, d, 2) / d)``, then ``f / factor * (1 - smooth) + f * smooth`` with
    ``smooth = 1 - clamp((arange(d / 2) - low) / (high - low), 0, 1)``, all float32 tensors.
    """
    exponent = torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim
    freq = 1.0 / (base ** exponent)
    if yarn is not None:
        low, high = yarn_ramp_bounds(rope_dim, base, yarn)
        ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low))
        smooth = 1 - ramp.clamp(0, 1)
        freq = freq / yarn.factor * (1 - smooth) + freq * smooth
    return freq


class RotaryEmbedding(nn.Module):
    def __init__(self, rope_dim: int, base: float, yarn: YarnScaling | None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if rope_dim % 2:
            raise ValueError(f"rope_dim={rope_dim} must be even")
        self.rope_dim = rope_dim
        self.base = base
        self.yarn = yarn
        self.register_buffer("inv_freq", rope_inv_freq(rope_dim, base, yarn).to(device),
                             persistent=False)

    @classmethod
    def for_layer(cls, cfg: DSV4Config, compress_ratio: int,
                  device: torch.device | str | None = None) -> RotaryEmbedding:
        if compress_ratio == 0:
            return cls(cfg.qk_rope_head_dim, cfg.rope_theta, None, device)
        return cls(cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.rope_scaling, device)

    def cos_sin(self, positions: torch.Tensor,
                acc_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [*positions.shape, rope_dim // 2] in ``acc_dtype``."""
        inv_freq: torch.Tensor = self.inv_freq  # type: ignore[assignment]
        return rope_cos_sin(positions, inv_freq, acc_dtype)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, acc_dtype: torch.dtype,
               inverse: bool = False) -> torch.Tensor:
        """Rotate the last ``rope_dim`` dims of ``x`` [T, ..., d] at ``positions`` [T].

        Returns a new tensor of x's dtype; the rotation itself runs in ``acc_dtype``.
        """
        inv_freq: torch.Tensor = self.inv_freq  # type: ignore[assignment]
        return rotate_rope_dims(x, positions, inv_freq, acc_dtype, inverse)

    def extra_repr(self) -> str:
        return f"rope_dim={self.rope_dim}, base={self.base}, yarn={self.yarn is not None}"


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
                 acc_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [*positions.shape, len(inv_freq)] in ``acc_dtype`` of the fp32 angles
    fp32(position) * inv_freq."""
    angle = positions.to(torch.float32).unsqueeze(-1) * inv_freq.to(positions.device)
    angle = angle.to(acc_dtype)
    return torch.cos(angle), torch.sin(angle)


def rotate_rope_dims(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                     acc_dtype: torch.dtype, inverse: bool = False) -> torch.Tensor:
    """:meth:`RotaryEmbedding.rotate` for the frequencies ``inv_freq`` (the last
    2 * len(inv_freq) dims of ``x`` [T, ..., d], pairs (2i, 2i + 1)): a new tensor of x's dtype,
    the rotation in ``acc_dtype``."""
    cos, sin = rope_cos_sin(positions, inv_freq, acc_dtype)
    for _ in range(x.dim() - 2):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return rotate_pairs(x, cos, sin, acc_dtype, inverse)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 acc_dtype: torch.dtype, inverse: bool = False) -> torch.Tensor:
    """The rotation itself: the last 2 * cos.shape[-1] dims of ``x`` as pairs (2i, 2i + 1)
    turned by the angles whose ``cos`` / ``sin`` (in ``acc_dtype``, already broadcastable
    against those pairs) are given; a new tensor of x's dtype, the nope dims unchanged. The
    inference layers and the training model (:mod:`dsv4_train.attention`) share it."""
    if inverse:
        sin = -sin
    rope_dim = 2 * cos.shape[-1]
    d = x.shape[-1]
    rope = x[..., d - rope_dim:].to(acc_dtype).unflatten(-1, (rope_dim // 2, 2))
    a, b = rope[..., 0], rope[..., 1]
    rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat((x[..., : d - rope_dim], rotated.to(x.dtype)), dim=-1)


def attention_softmax_scale(head_dim: int) -> float:
    """d^-1/2 with no YaRN mscale correction (differs from DeepSeek-V3)."""
    return 1.0 / math.sqrt(head_dim)
