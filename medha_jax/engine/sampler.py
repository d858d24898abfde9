"""Token sampling on the device: greedy, temperature, top-k, top-p, one PRNG key per row.

`sample` is pure and jittable with static shapes; it runs inside the jitted step, so
sampled ids leave the device as one small int32 [S] array and the host never sees logits.

Sampling draws Gumbel noise g [S, V] from each row's own key and returns
argmax(logits / T + g) over the tokens the filters keep (the Gumbel-max trick: the
result is distributed as softmax(logits / T) restricted to those tokens). The noise is
drawn in vocabulary order whatever the batch needs, so a row's token is a function of
its own logits, parameters and key only: it does not change when other rows of the batch
use top-k / top-p (which switches on the sorted path) or when rows are permuted.

Filters follow vLLM and Hugging Face: temperature first, then top-k, then top-p on the
probabilities renormalised over the top k. Exactly k tokens survive top-k (ties broken by
lower token id); top-p keeps the smallest prefix of the sorted tokens whose mass reaches
top_p, and always the most likely token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
           rng_keys: jax.Array) -> jax.Array:
    """Samples one token per row.

    logits:      float [S, V]
    temperature: float32 [S]; 0 = greedy (argmax of the raw logits)
    top_k:       int32 [S]; 0 = off
    top_p:       float32 [S] in (0, 1]; 1 = off
    rng_keys:    uint32 [S, 2]; raw threefry key data, one key per row
    returns:     int32 [S] token ids
    """
    logits = logits.astype(jnp.float32)
    greedy_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    is_random = temperature > 0

    def random_tokens():
        sampled = _sample_random(logits, temperature, top_k, top_p, rng_keys)
        return jnp.where(is_random, sampled, greedy_tokens)

    # An all-greedy batch (the common case in evaluation) skips the noise and the sort.
    return jax.lax.cond(jnp.any(is_random), random_tokens, lambda: greedy_tokens)


def _sample_random(logits, temperature, top_k, top_p, rng_keys):
    """Gumbel-max sampling of every row; greedy rows are overwritten by the caller."""
    vocab_size = logits.shape[-1]
    safe_temperature = jnp.where(temperature > 0, temperature, 1.0)
    scaled = logits / safe_temperature[:, None]                    # [S, V]
    keys = jax.random.wrap_key_data(rng_keys.astype(jnp.uint32), impl="threefry2x32")
    gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (vocab_size,), jnp.float32))(keys)
    needs_filter = jnp.any(((top_k > 0) & (top_k < vocab_size)) | (top_p < 1))
    return jax.lax.cond(
        needs_filter,
        lambda: _filtered_gumbel_argmax(scaled, gumbel, top_k, top_p),
        lambda: jnp.argmax(scaled + gumbel, axis=-1).astype(jnp.int32))


def _filtered_gumbel_argmax(scaled, gumbel, top_k, top_p):
    """argmax of scaled + gumbel over the tokens kept by top-k then top-p. All [S, V] -> [S]."""
    vocab_size = scaled.shape[-1]
    order = jnp.argsort(-scaled, axis=-1)                          # [S, V], stable: ties by id
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(vocab_size)[None, :]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab_size), vocab_size)
    in_top_k = rank < k[:, None]
    probs = jax.nn.softmax(jnp.where(in_top_k, sorted_logits, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # top_p == 1 must keep everything even where rounding makes mass_before reach 1.
    in_top_p = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1)
    noisy = jnp.where(in_top_k & in_top_p,
                      sorted_logits + jnp.take_along_axis(gumbel, order, axis=-1), -jnp.inf)
    best_rank = jnp.argmax(noisy, axis=-1)
    return jnp.take_along_axis(order, best_rank[:, None], axis=-1)[:, 0].astype(jnp.int32)
