"""Log-probabilities inside the jitted step: the tail every step program ends with.

`sample_with_logprobs` is the one place a step turns final hidden states into its outputs
(the one-program step in engine.py and the last SPP stage in pipeline.py both call it):

    logits of each sequence's last token -> sampled ids            always
    logprobs of the sampled tokens, and their top-K                only when asked
    logprobs of every token's NEXT token of the step, and top-K    only when asked
      (prompt logprobs: token t scores next_token_ids[t])

Logprobs are of the model's raw distribution: float32 log_softmax of the logits, before
temperature, top-k and top-p, as OpenAI and vLLM (by default) report them. K is static
(MAX_LOGPROBS, capped by the vocabulary), so asking for k changes no compiled shape; the
host keeps the first k of each row.

Nothing here sends logits to the host: the step returns K ids and K logprobs per row.
Each part sits under `lax.cond` on a packed flag (`StepInputs.logprobs_flags`), so a step
in which nobody asked computes nothing, and the host reads the arrays back only when it
set the flag (Engine.collect). Prompt logprobs put all T tokens of the step through the
LM head, in blocks of PROMPT_ROWS_PER_BLOCK rows under `lax.map`, so the live logits are
[block, vocab] rather than [T, vocab] (128k vocabularies x a 2048-token step would be 1 GiB).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from medha_jax.engine.sampler import sample
from medha_jax.sampling_params import MAX_LOGPROBS

# Rows of hidden states per LM-head block of prompt logprobs: [256, vocab] float32 logits
# are 128 MiB at a 128k vocabulary.
PROMPT_ROWS_PER_BLOCK = 256

# A head maps final-normed hidden states [R, D] to float32 logits [R, vocab].
Head = Callable[[jax.Array], jax.Array]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TopLogprobs:
    """Logprobs of R rows: each row's scored token and its K most likely tokens."""

    logprob: jax.Array       # float32 [R]: logprob of the row's token (garbage where it is -1)
    top_ids: jax.Array       # int32 [R, K]: most likely first
    top_logprobs: jax.Array  # float32 [R, K]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepOutputs:
    """What a step program returns besides its cache. S sequences, T token rows."""

    tokens: jax.Array        # int32 [S]: sampled ids
    sampled: TopLogprobs     # [S]: of the sampled tokens (zeros unless logprobs_flags[0])
    prompt: TopLogprobs      # [T]: of next_token_ids (zeros unless logprobs_flags[1])


def num_top(vocab_size: int) -> int:
    """K: the static top-k width of a vocabulary."""
    return min(MAX_LOGPROBS, vocab_size)


def token_logprobs(logits: jax.Array, token_ids: jax.Array, k: int) -> TopLogprobs:
    """logits: float [R, V]; token_ids: int32 [R], -1 where a row scores nothing -> rows'
    logprobs of token_ids and their top-k. Pure."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, jnp.maximum(token_ids, 0)[:, None], axis=-1)[:, 0]
    top_logprobs, top_ids = jax.lax.top_k(logp, k)
    return TopLogprobs(chosen, top_ids.astype(jnp.int32), top_logprobs)


def _zeros(rows: int, k: int) -> TopLogprobs:
    return TopLogprobs(jnp.zeros((rows,), jnp.float32), jnp.zeros((rows, k), jnp.int32),
                       jnp.zeros((rows, k), jnp.float32))


def blocked_token_logprobs(head: Head, hidden: jax.Array, token_ids: jax.Array, k: int,
                           rows_per_block: int = PROMPT_ROWS_PER_BLOCK) -> TopLogprobs:
    """`token_logprobs(head(hidden), token_ids)` one block of rows at a time. Pure.

    hidden: [R, D] final-normed; token_ids: int32 [R]. R is padded up to whole blocks
    (padding rows score nothing and are cut off)."""
    rows, dim = hidden.shape
    block = min(rows_per_block, rows)
    num_blocks = -(-rows // block)
    pad = num_blocks * block - rows
    hidden = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(num_blocks, block, dim)
    token_ids = jnp.pad(token_ids, (0, pad), constant_values=-1).reshape(num_blocks, block)
    out = jax.lax.map(lambda xs: token_logprobs(head(xs[0]), xs[1], k), (hidden, token_ids))
    return jax.tree.map(lambda a: a.reshape((num_blocks * block,) + a.shape[2:])[:rows], out)


def sample_with_logprobs(head: Head, hidden: jax.Array, x: dict, floats: jax.Array,
                         rng_keys: jax.Array, *, vocab_size: int) -> StepOutputs:
    """The tail of a step: sample each sequence's next token, and the logprobs asked for.

    hidden: [T, D] final-normed states of the step's tokens (cp: the ranks' runs, [R * T]);
    x: the unpacked int32 inputs (`unpack_int32`: logits_indices, top_k, next_token_ids,
    logprobs_flags); floats: float32 [2, S] temperature and top_p; rng_keys: uint32 [S, 2].
    """
    k = num_top(vocab_size)
    logits = head(hidden[x["logits_indices"]])                     # [S, V] float32
    tokens = sample(logits, floats[0], x["top_k"], floats[1], rng_keys)
    flags = x["logprobs_flags"]
    sampled = jax.lax.cond(flags[0] > 0, lambda: token_logprobs(logits, tokens, k),
                           lambda: _zeros(logits.shape[0], k))
    next_ids = x["next_token_ids"]
    prompt = jax.lax.cond(flags[1] > 0,
                          lambda: blocked_token_logprobs(head, hidden, next_ids, k),
                          lambda: _zeros(hidden.shape[0], k))
    return StepOutputs(tokens, sampled, prompt)
