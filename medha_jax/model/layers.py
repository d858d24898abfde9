"""Pure functions of one Llama-3 decoder layer: RMSNorm, RoPE, attention, SwiGLU.

Shapes: T tokens (a flat ragged run from many sequences), D hidden, H query heads,
K kv heads, hd head dim, F intermediate. Everything here is jittable and free of mesh
axes; sharding comes from the parameters' and caches' NamedShardings.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from medha_jax.config import ModelConfig, YarnScaling


def rms_norm(x, weight, eps: float):
    """x: [..., D], weight: [D] (D: hidden, or head_dim for q/k norms). Computed in float32
    as transformers does."""
    x32 = x.astype(jnp.float32)
    variance = jnp.mean(x32 * x32, axis=-1, keepdims=True)
    return weight * (x32 * jax.lax.rsqrt(variance + eps)).astype(x.dtype)


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Inverse frequencies [hd / 2], with Llama-3 or YaRN scaling if configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq.astype(np.float32)
    if isinstance(scaling, YarnScaling):
        return _yarn_inv_freq(inv_freq, scaling, config.rope_theta, dim)
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are stretched by `factor`; short ones kept.
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    # The band in between is interpolated smoothly.
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def _yarn_inv_freq(inv_freq: np.ndarray, scaling: YarnScaling, theta: float,
                   dim: int) -> np.ndarray:
    """transformers' `_compute_yarn_parameters`: a linear ramp over the frequency index
    between the dims that make beta_fast and beta_slow rotations in the original context,
    from the original frequency (extrapolation) to it divided by `factor` (interpolation)."""
    def correction_dim(rotations: float) -> float:
        return (dim * math.log(scaling.original_max_position_embeddings
                               / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001   # as transformers: no division by zero
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (inv_freq / scaling.factor * ramp + inv_freq * extrapolation).astype(np.float32)


def rope_attention_factor(config: ModelConfig) -> float:
    """The factor YaRN multiplies cos and sin by (1 otherwise)."""
    scaling = config.rope_scaling
    return scaling.attention_factor if isinstance(scaling, YarnScaling) else 1.0


def apply_rope(x, positions, inv_freq, scale: float = 1.0):
    """x: [T, heads, hd]; positions: int32 [T]; inv_freq: [hd / 2]; scale multiplies cos and
    sin (YaRN's attention factor).

    Hugging Face layout (rotate_half): dimension i pairs with i + hd/2.
    """
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]   # [T, hd/2]
    cos = scale * jnp.cos(angles)[:, None, :]
    sin = scale * jnp.sin(angles)[:, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def swiglu_mlp(x, w_gate, w_up, w_down):
    """x: [T, D]; w_gate, w_up: [D, F]; w_down: [F, D]."""
    gate = jnp.einsum("td,df->tf", x, w_gate)
    up = jnp.einsum("td,df->tf", x, w_up)
    return jnp.einsum("tf,fd->td", jax.nn.silu(gate) * up, w_down)
