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

from medha_jax.config import ModelConfig


def rms_norm(x, weight, eps: float):
    """x: [T, D], weight: [D]. Computed in float32 as transformers does."""
    x32 = x.astype(jnp.float32)
    variance = jnp.mean(x32 * x32, axis=-1, keepdims=True)
    return weight * (x32 * jax.lax.rsqrt(variance + eps)).astype(x.dtype)


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Inverse frequencies [hd / 2], with Llama-3 frequency-dependent scaling if configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq.astype(np.float32)
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


def apply_rope(x, positions, inv_freq):
    """x: [T, heads, hd]; positions: int32 [T]; inv_freq: [hd / 2].

    Hugging Face layout (rotate_half): dimension i pairs with i + hd/2.
    """
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]   # [T, hd/2]
    cos = jnp.cos(angles)[:, None, :]
    sin = jnp.sin(angles)[:, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def swiglu_mlp(x, w_gate, w_up, w_down):
    """x: [T, D]; w_gate, w_up: [D, F]; w_down: [F, D]."""
    gate = jnp.einsum("td,df->tf", x, w_gate)
    up = jnp.einsum("td,df->tf", x, w_up)
    return jnp.einsum("tf,fd->td", jax.nn.silu(gate) * up, w_down)
