"""Pure functions of one decoder layer: RMSNorm, RoPE, the gated MLP (SwiGLU, GeGLU).

Shapes: T tokens (a flat ragged run from many sequences), D hidden, H query heads,
K kv heads, hd head dim, F intermediate. Everything here is jittable and free of mesh
axes; sharding comes from the parameters' and caches' NamedShardings.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from medha_jax.config import LinearScaling, ModelConfig, YarnScaling
from pallas_kernels import cpu_native


def rms_norm(x, weight, eps: float, offset: float = 0.0):
    """x: [..., D], weight: [D] (D: hidden, or head_dim for q/k norms). Computed in float32
    as transformers does. offset: Gemma's (1 + w), whose product is taken in float32 before
    the cast (Llama casts first, then scales)."""
    x32 = x.astype(jnp.float32)
    variance = jnp.mean(x32 * x32, axis=-1, keepdims=True)
    normed = x32 * jax.lax.rsqrt(variance + eps)
    if offset:
        return (normed * (offset + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * normed.astype(x.dtype)


def embed_tokens(embed, token_ids, config: ModelConfig):
    """embed: [V, D], token_ids: int32 [T] -> [T, D]; Gemma scales by sqrt(D) rounded to the
    embedding's dtype, as transformers does."""
    x = jnp.take(embed, token_ids, axis=0)
    if config.family_spec.scale_embedding:
        x = x * jnp.asarray(config.hidden_size ** 0.5, dtype=embed.dtype)
    return x


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Inverse frequencies [hd / 2] of every layer; with layers of two kinds (Gemma-3's
    sliding layers on their own base), [2, hd / 2]: the full layers' then the sliding ones'."""
    full = _inv_freq(config.rope_theta, config.rope_scaling, config.head_dim)
    if config.local_rope_theta is None:
        return full
    local = _inv_freq(config.local_rope_theta, None, config.head_dim)
    if not config.mixed_layers:
        return local if all(config.sliding_layers()) else full
    return np.stack([full, local])


def _inv_freq(theta: float, scaling, dim: int) -> np.ndarray:
    """Inverse frequencies [dim / 2] of base `theta`, with Llama-3, YaRN or linear scaling."""
    inv_freq = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    if scaling is None:
        return inv_freq.astype(np.float32)
    if isinstance(scaling, YarnScaling):
        return _yarn_inv_freq(inv_freq, scaling, theta, dim)
    if isinstance(scaling, LinearScaling):
        return (inv_freq / scaling.factor).astype(np.float32)
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
    """The factor YaRN multiplies cos and sin by (1 otherwise) in the full layers (the sliding
    layers of `local_rope_theta` are unscaled)."""
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


def gated_mlp(x, w_gate, w_up, w_down, activation: str = "silu"):
    """x: [T, D]; w_gate, w_up: [D, F]; w_down: [F, D] (each an array or a `LayerOfStack`).
    activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, transformers' gelu_pytorch_tanh)."""
    gate = dense("td,df->tf", x, w_gate)
    up = dense("td,df->tf", x, w_up)
    act = jax.nn.silu(gate) if activation == "silu" else jax.nn.gelu(gate, approximate=True)
    return dense("tf,fd->td", act * up, w_down)


@dataclasses.dataclass(frozen=True)
class LayerOfStack:
    """One layer's matrix left inside the weights stacked over layers, for `dense` to read
    in place with the native CPU kernel (`cpu_native.layer_matmul`) instead of a slice.

    stacked: [layers, *matrix]; layer: int32 [] (the scan's layer index)."""

    stacked: jax.Array
    layer: jax.Array


def dense(spec: str, x, w):
    """A projection `jnp.einsum(spec, x, w)` whose spec contracts x's trailing axes with w's
    leading ones, x [T, *c] and w [*c, *out] -> [T, *out] ("td,dhk->thk", "thk,hkd->td").
    w: an array, or a `LayerOfStack`: then x and w are flattened to [T, C] and [layers, C,
    OUT] (free reshapes) and one native call reads the layer's matrix where it lies."""
    if not isinstance(w, LayerOfStack):
        return jnp.einsum(spec, x, w)
    inputs, out = spec.split("->")
    x_axes, w_axes = inputs.split(",")
    contracted = len(x_axes) - 1
    if x_axes[1:] != w_axes[:contracted] or out != x_axes[0] + w_axes[contracted:]:
        raise ValueError(f"dense: {spec!r} is not a projection of x's trailing axes")
    stacked = w.stacked
    size = math.prod(stacked.shape[1:1 + contracted])
    y = cpu_native.layer_matmul(x.reshape(x.shape[0], size),
                                stacked.reshape(stacked.shape[0], size, -1), w.layer)
    return y.reshape(x.shape[0], *stacked.shape[1 + contracted:]).astype(x.dtype)
