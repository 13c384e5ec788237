"""Rotary position embeddings, including the scaling variants HF configs carry.

``inverse_frequencies(head_dim, rope)`` returns the D/2 rotation frequencies plus an attention factor
that multiplies cos and sin (1.0 except for YaRN). Supported ``rope_type`` values: default, linear,
llama3, yarn. Anything else is refused with a CheckpointError rather than silently approximated.

Example: head_dim 4, theta 10000 gives frequencies [1.0, 0.01]; ``linear`` with factor 2 halves them.
"""

from __future__ import annotations

import math

import torch

from verispec.errors import CheckpointError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def inverse_frequencies(head_dim: int, rope: dict, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Frequencies (D/2,) float64 and the attention scaling factor for a rope parameter dict."""
    theta = float(rope.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    base = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if rope_type == "default":
        return base, 1.0
    if rope_type == "linear":
        return base / float(rope["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3(base, rope), 1.0
    if rope_type == "yarn":
        return _yarn(base, head_dim, theta, rope, max_position_embeddings)
    raise CheckpointError(
        f"rope_type {rope_type!r} is not supported by the native model (supported: "
        f"{', '.join(SUPPORTED_ROPE_TYPES)}); use the transformers adapter for this checkpoint")


def _llama3(base: torch.Tensor, rope: dict) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    factor = float(rope["factor"])
    low = float(rope.get("low_freq_factor", 1.0))
    high = float(rope.get("high_freq_factor", 4.0))
    original = float(rope["original_max_position_embeddings"])
    wavelength = 2 * math.pi / base
    smooth = ((original / wavelength) - low) / (high - low)
    blended = (1 - smooth) * base / factor + smooth * base
    slowed = torch.where(wavelength > original / low, base / factor, base)
    in_band = (wavelength <= original / low) & (wavelength >= original / high)
    return torch.where(in_band, blended, slowed)


def _yarn(base: torch.Tensor, head_dim: int, theta: float, rope: dict,
          max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    factor = float(rope["factor"])
    original = float(rope.get("original_max_position_embeddings") or max_position_embeddings)
    beta_fast = float(rope.get("beta_fast") or 32.0)
    beta_slow = float(rope.get("beta_slow") or 1.0)
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        mscale = rope.get("mscale")
        mscale_all_dim = rope.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor, 1.0)

    def correction_dim(rotations: float) -> float:
        # The dimension whose wavelength completes `rotations` turns over the original context.
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep_original = 1 - ramp  # 1 for high-frequency dims (extrapolate), 0 for low (interpolate)
    frequencies = base / factor * (1 - keep_original) + base * keep_original
    return frequencies, float(attention_factor)


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rotary_tables(frequencies: torch.Tensor, attention_factor: float, num_positions: int,
                  dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables (num_positions, D) in the rotate-half layout."""
    angles = torch.outer(torch.arange(num_positions, dtype=torch.float64), frequencies.cpu().double())  # on the CPU: the same tables on every device
    angles = torch.cat([angles, angles], dim=-1)
    cos = (angles.cos() * attention_factor).to(dtype=dtype, device=device)
    sin = (angles.sin() * attention_factor).to(dtype=dtype, device=device)
    return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (..., D) by cos/sin broadcast to it, e.g. x (B, H, T, D) with cos (B, 1, T, D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
