"""Combining attention computed over disjoint sets of keys.

Two forms of the same identity (seed 002, appendix B, Eq. 4): attention over keys A u B is
the LSE-weighted mean of attention over A and attention over B.

- `merge_attention`: finished parts (out, lse) -> one (out, lse). Used to merge KV splits of
  the kernels, KV-parallel shards and context-parallel ring steps.
- `online_softmax_update` / `online_softmax_finish`: the streaming form inside a key loop
  (flash attention's running max m, running sum l and unnormalised accumulator). The same
  functions run inside the Pallas kernel and inside the XLA path, with `attention_scores`
  making the scores they consume.

Both are NaN-safe for rows that saw no key at all: out 0, lse -inf. The convention is the
natural log (lse = m + log l).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# (acc [..., rows, head_dim] f32 unnormalised output, m [..., rows] f32 running max,
#  l [..., rows] f32 running sum of exp(score - m)). m is -inf until a row sees a key.
SoftmaxState = tuple[jax.Array, jax.Array, jax.Array]


@jax.jit
def merge_attention(
    outs: jax.Array,  # [parts, tokens, heads, head_dim]
    lses: jax.Array,  # [parts, tokens, heads] float32; -inf for a part that saw no keys
) -> tuple[jax.Array, jax.Array]:  # out [tokens, heads, head_dim], lse [tokens, heads] f32
    """Exact merge of partial attention results by log-sum-exp.

    out = sum_p out_p exp(lse_p - M) / sum_p exp(lse_p - M), M = max_p lse_p, and
    lse = M + log sum_p exp(lse_p - M). A part with lse -inf gets weight 0 even if its out
    holds garbage (NaN included); if every part is -inf the result is out 0, lse -inf.
    """
    if outs.ndim != 4 or lses.shape != outs.shape[:-1]:
        raise ValueError(
            f"merge_attention wants outs [parts, tokens, heads, head_dim] and lses "
            f"[parts, tokens, heads]; got {outs.shape=} {lses.shape=}")
    lses = lses.astype(jnp.float32)
    lse_max = jnp.max(lses, axis=0)                               # [tokens, heads]
    lse_max = jnp.where(jnp.isfinite(lse_max), lse_max, 0.0)
    weights = jnp.exp(lses - lse_max)                             # [parts, tokens, heads]
    seen = weights > 0
    weighted = jnp.where(seen[..., None], weights[..., None] * outs.astype(jnp.float32), 0.0)
    total = jnp.sum(weights, axis=0)                              # [tokens, heads]
    any_seen = total > 0
    safe_total = jnp.where(any_seen, total, 1.0)
    out = jnp.sum(weighted, axis=0) / safe_total[..., None]
    lse = jnp.where(any_seen, lse_max + jnp.log(safe_total), -jnp.inf)
    return out.astype(outs.dtype), lse


def attention_scores(q_rows: jax.Array, k_tile: jax.Array, sm_scale: float) -> jax.Array:
    """q_rows [..., rows, d] x k_tile [..., keys, d] -> [..., rows, keys] f32, scaled."""
    s = jnp.einsum("...rd,...kd->...rk", q_rows, k_tile, preferred_element_type=jnp.float32)
    return s * sm_scale


def online_softmax_init(rows_shape: tuple[int, ...], head_dim: int, *,
                        keepdims: bool = False) -> SoftmaxState:
    """The state of rows that have seen no key yet. rows_shape: [..., rows]. keepdims: m
    and l as [..., rows, 1] (the TPU kernel: Mosaic wants 2-D vectors), else [..., rows];
    `online_softmax_update` and `online_softmax_finish` accept either."""
    stat_shape = (*rows_shape, 1) if keepdims else rows_shape
    return (jnp.zeros((*rows_shape, head_dim), jnp.float32),
            jnp.full(stat_shape, -jnp.inf, jnp.float32),
            jnp.zeros(stat_shape, jnp.float32))


def _per_row(stat: jax.Array, acc: jax.Array) -> jax.Array:
    """A row statistic ([..., rows] or kept [..., rows, 1]) broadcastable against acc."""
    return stat if stat.ndim == acc.ndim else stat[..., None]


def online_softmax_update(
    state: SoftmaxState,
    scores: jax.Array,  # [..., rows, keys] f32, already scaled; -inf where masked
    values: jax.Array,  # [..., keys, head_dim] (or as pv_spec lays them out)
    *,
    pv_spec: str | None = None,
) -> SoftmaxState:
    """Folds one tile of keys into the running state (flash attention's inner step).

    The running max is rebased to 0 while a row has seen no key (m = -inf), so masked
    tiles add exactly nothing and no -inf - -inf = NaN appears.
    pv_spec: the einsum of probabilities [..., rows, keys] with values laid out otherwise,
    e.g. "skgj,sjkd->skgd" for values as gathered from pages, [seqs, keys, kv_heads, d]
    (the XLA decode path: no transposed copy of the tile); None: a matmul.
    """
    acc, m_prev, l_prev = state
    keepdims = m_prev.ndim == acc.ndim
    m_next = jnp.maximum(m_prev, jnp.max(scores, axis=-1, keepdims=keepdims))
    m_base = jnp.where(m_next == -jnp.inf, 0.0, m_next)
    correction = jnp.exp(m_prev - m_base)                   # 0 when m_prev is -inf
    probs = jnp.exp(scores - _per_row(m_base, acc))         # 0 where masked
    l_next = correction * l_prev + jnp.sum(probs, axis=-1, keepdims=keepdims)
    # Probabilities go to the value dtype for the MXU/tensor cores; accumulate in f32.
    probs = probs.astype(values.dtype)
    pv = (jnp.matmul(probs, values, preferred_element_type=jnp.float32) if pv_spec is None
          else jnp.einsum(pv_spec, probs, values, preferred_element_type=jnp.float32))
    acc = _per_row(correction, acc) * acc + pv
    return acc, m_next, l_next


def online_softmax_finish(state: SoftmaxState) -> tuple[jax.Array, jax.Array]:
    """(out [..., rows, head_dim] f32, lse [..., rows] f32, or [..., rows, 1] for a kept-dims
    state): normalised; 0 / -inf if no key."""
    acc, m, l = state
    seen = l > 0
    safe_l = jnp.where(seen, l, 1.0)
    out = jnp.where(_per_row(seen, acc), acc / _per_row(safe_l, acc), 0.0)
    lse = jnp.where(seen, m + jnp.log(safe_l), -jnp.inf)
    return out, lse
