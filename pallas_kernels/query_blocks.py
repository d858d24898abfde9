"""Cutting a ragged batch of queries into blocks of one sequence each.

Shared by the Pallas kernel and the XLA path: both compute attention per query block (at
most block_q tokens, never two sequences), so a block reads one page table row and stops
at its own last key. The block count is padded to a static bound (`max_query_blocks`) so
the plan has fixed shapes under jit.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


def cdiv(a, b):
    """Ceiling division, for Python ints and int arrays alike."""
    return (a + b - 1) // b


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QueryBlockPlan:
    """Query blocks of at most block_q tokens, each inside one sequence; padded to a static count.

    Per block b (blocks past `count` are empty: num_tokens 0):
      seq [blocks]:         its sequence.
      first_token [blocks]: row of q holding its first query.
      first_pos [blocks]:   cache position of its first query (kv_len - q_len + offset).
      num_tokens [blocks]:  its queries (<= block_q); query i sits at first_pos + i.
      kv_len [blocks]:      its sequence's kv_len (the keys of a non-causal block).
    Per token t of q (so kernel outputs laid out by block can be gathered back):
      token_block [tokens], token_row [tokens]: where t lives; token_valid [tokens]: t is
      a real query of a planned sequence in use (False for the padding tail).
    """

    seq: jax.Array
    first_token: jax.Array
    first_pos: jax.Array
    num_tokens: jax.Array
    kv_len: jax.Array
    count: jax.Array  # int32 []: blocks in use
    token_block: jax.Array
    token_row: jax.Array
    token_valid: jax.Array

    def key_end(self, causal: bool) -> jax.Array:
        """int32 [blocks]: keys 0 .. key_end-1 are what the block's LAST query sees (causal:
        up to its own position; non-causal: the whole cached prefix); 0 for empty blocks."""
        end = self.first_pos + self.num_tokens if causal else self.kv_len
        return jnp.where(self.num_tokens > 0, end, 0)


def segment_of(index: jax.Array, ends: jax.Array) -> jax.Array:
    """For each index [n], the segment s with ends[s-1] <= index < ends[s] (ends [segments],
    non-decreasing, inclusive prefix sums); indices past the last end go to the last segment.
    A compare-all count: segments are few (<= max_seqs), and it compiles and runs faster on
    the CPU than a binary search."""
    count = jnp.sum(ends[None, :] <= index[:, None], axis=1, dtype=jnp.int32)
    return jnp.minimum(count, ends.shape[0] - 1)


def max_query_blocks(num_tokens: int, max_seqs: int, block_q: int) -> int:
    """Static bound on the blocks of any ragged batch: sum_s ceil(q_s / block_q) over
    sum_s q_s <= num_tokens is at most (num_tokens + max_seqs * (block_q - 1)) // block_q,
    and never more than one block per token."""
    return max(1, min(num_tokens, (num_tokens + max_seqs * (block_q - 1)) // block_q))


def plan_query_blocks(
    cu_q_lens: jax.Array,  # int32 [max_seqs + 1]
    kv_lens: jax.Array,    # int32 [max_seqs]
    num_seqs: jax.Array,   # int32 [1]
    *,
    num_tokens: int,
    block_q: int,
    min_q_len: int = 1,
    first_seq: jax.Array | None = None,
) -> QueryBlockPlan:
    """Cuts each sequence in use with q_len >= min_q_len into blocks of block_q queries.
    first_seq (int32 [], traced): plan only sequences first_seq.. (the decodes before
    them are served elsewhere; see `attention.ragged_paged_attention`'s num_decodes)."""
    if block_q <= 0 or min_q_len <= 0:
        raise ValueError(f"{block_q=} and {min_q_len=} must be positive")
    max_seqs = kv_lens.shape[0]
    max_blocks = max_query_blocks(num_tokens, max_seqs, block_q)
    cu_q_lens = cu_q_lens.astype(jnp.int32)
    kv_lens = kv_lens.astype(jnp.int32)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    in_use = jnp.arange(max_seqs) < num_seqs[0]
    planned = in_use & (q_lens >= min_q_len)
    if first_seq is not None:
        planned &= jnp.arange(max_seqs) >= first_seq
    blocks_per_seq = jnp.where(planned, cdiv(q_lens, block_q), 0)
    cu_blocks = jnp.cumsum(blocks_per_seq)                     # inclusive
    first_block_of_seq = cu_blocks - blocks_per_seq
    count = cu_blocks[-1]

    block = jnp.arange(max_blocks, dtype=jnp.int32)
    seq = segment_of(block, cu_blocks)
    offset = (block - first_block_of_seq[seq]) * block_q      # tokens before it in its seq
    num_tokens_in_block = jnp.where(block < count,
                                    jnp.clip(q_lens[seq] - offset, 0, block_q), 0)
    first_token = cu_q_lens[seq] + offset
    first_pos = kv_lens[seq] - q_lens[seq] + offset

    token = jnp.arange(num_tokens, dtype=jnp.int32)
    token_seq = segment_of(token, cu_q_lens[1:])
    token_offset = token - cu_q_lens[token_seq]
    token_valid = (token < cu_q_lens[num_seqs[0]]) & planned[token_seq]
    token_block = jnp.where(token_valid,
                            first_block_of_seq[token_seq] + token_offset // block_q, 0)
    token_row = jnp.where(token_valid, token_offset % block_q, 0)
    return QueryBlockPlan(seq=seq.astype(jnp.int32), first_token=first_token,
                          first_pos=first_pos, num_tokens=num_tokens_in_block,
                          kv_len=kv_lens[seq], count=count.astype(jnp.int32),
                          token_block=token_block, token_row=token_row,
                          token_valid=token_valid)


def row_key_ends(
    key_end: jax.Array,     # int32 []: keys the block's last query sees (QueryBlockPlan.key_end)
    num_tokens: jax.Array,  # int32 []: queries in the block
    row_token: jax.Array,   # int32 [rows]: the block's query on each row
    *,
    causal: bool,
) -> jax.Array:             # int32 [rows]: row r sees keys 0 .. end[r]-1
    """Causal: query i of n sees one key less per later query (its own position + 1);
    non-causal: every query sees the whole prefix."""
    if causal:
        return key_end - num_tokens + 1 + row_token
    return jnp.broadcast_to(key_end, row_token.shape)


def key_starts(key_ends: jax.Array, sliding_window: int | None) -> jax.Array:
    """int32 like key_ends: the first key a query that sees keys .. key_end-1 attends, with a
    sliding window of that many positions (its own included); 0 without one."""
    if sliding_window is None:
        return jnp.zeros_like(key_ends)
    return jnp.maximum(key_ends - sliding_window, 0)
