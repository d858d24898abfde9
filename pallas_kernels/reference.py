"""Pure-jnp paged attention: the CPU serving path and the kernels' reference.

The serving engine runs these inside its jitted step on the CPU, with static shapes (up to
2048 tokens, 256 sequences, hundreds of pages per sequence), so they are written to be
exact, jittable and frugal with memory:

- No [tokens, context] score matrix is ever built. Queries are cut into blocks that belong
  to one sequence (`plan_query_blocks`, shared with the kernels), and each block streams
  over its own sequence's pages with an online softmax, stopping at its last query's
  position (causal): the work is proportional to the real tokens x context, whatever the
  padding of the page table.
- Decodes (sequences with one query token) would waste all but one row of a query block,
  so `ragged_paged_attention_reference` sends them to `decode_attention_reference`, which
  streams over all decoding sequences at once, one K/V tile of every sequence per step.
- GQA: the q_per_kv query heads of a KV head are folded into the rows of one matmul with
  that head's keys; K/V are never repeated per query head.

Plain jnp throughout, so GSPMD can shard heads across devices.

`dense_attention_oracle` at the end is the opposite: numpy, per sequence, per head, one
softmax over an explicitly gathered context. Tests use it to check both the references and
the kernels; nothing else should. `random_page_table` lays out test and benchmark caches.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.block_sizes import BlockSizes, reference_decode_pages_per_tile
from pallas_kernels.merge import online_softmax_finish, online_softmax_init, online_softmax_update


def _cdiv(a, b):
    return (a + b - 1) // b


# ----------------------------------------------------------------------------------------
# The query-block plan (shared with the kernels)
# ----------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QueryBlockPlan:
    """Query blocks of at most block_q tokens, each inside one sequence; padded to a static count.

    Per block b (blocks past `count` are empty: num_tokens 0):
      seq [blocks]:        its sequence.
      first_token [blocks]: row of q holding its first query.
      first_pos [blocks]:   cache position of its first query (kv_len - q_len + offset).
      num_tokens [blocks]:  its queries (<= block_q); query i sits at first_pos + i.
    Per token t of q (so kernel outputs laid out by block can be gathered back):
      token_block [tokens], token_row [tokens]: where t lives; token_valid [tokens]: t is
      a real query of a sequence in use (False for the padding tail).
    """

    seq: jax.Array
    first_token: jax.Array
    first_pos: jax.Array
    num_tokens: jax.Array
    count: jax.Array  # int32 []: blocks in use
    token_block: jax.Array
    token_row: jax.Array
    token_valid: jax.Array


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
) -> QueryBlockPlan:
    """Cuts each sequence in use with q_len >= min_q_len into blocks of block_q queries."""
    max_seqs = kv_lens.shape[0]
    max_blocks = max_query_blocks(num_tokens, max_seqs, block_q)
    cu_q_lens = cu_q_lens.astype(jnp.int32)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    in_use = jnp.arange(max_seqs) < num_seqs[0]
    planned = in_use & (q_lens >= min_q_len)
    blocks_per_seq = jnp.where(planned, _cdiv(q_lens, block_q), 0)
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
                          count=count.astype(jnp.int32), token_block=token_block,
                          token_row=token_row, token_valid=token_valid)


# ----------------------------------------------------------------------------------------
# Shared pieces of the two references
# ----------------------------------------------------------------------------------------


def _pad_page_table(page_table: jax.Array, kv_pages_per_block: int) -> jax.Array:
    """Pads the width to whole K/V tiles with page 0 (a valid id; masked by position)."""
    pad = -page_table.shape[1] % kv_pages_per_block
    return jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, pad)))


def _gather_kv_tile(
    pages: jax.Array,     # [num_pages, page_size, kv_heads, head_dim]
    page_ids: jax.Array,  # int32 [..., pages_per_tile]
) -> jax.Array:           # [..., kv_heads, pages_per_tile * page_size, head_dim]
    tile = pages[page_ids]                                     # [..., P, page_size, kv, d]
    *batch, n_pages, page_size, kv_heads, head_dim = tile.shape
    tile = tile.reshape(*batch, n_pages * page_size, kv_heads, head_dim)
    return jnp.swapaxes(tile, -3, -2)


def attention_scores(q_rows: jax.Array, k_tile: jax.Array, sm_scale: float) -> jax.Array:
    """q_rows [..., rows, d] x k_tile [..., keys, d] -> [..., rows, keys] f32, scaled."""
    s = jnp.einsum("...rd,...kd->...rk", q_rows, k_tile, preferred_element_type=jnp.float32)
    return s * sm_scale


# ----------------------------------------------------------------------------------------
# Decode: one query per sequence
# ----------------------------------------------------------------------------------------


def decode_attention_reference(
    q: jax.Array,           # [seqs, q_heads, head_dim]
    k_pages: jax.Array,     # [num_pages, page_size, kv_heads, head_dim]
    v_pages: jax.Array,     # [num_pages, page_size, kv_heads, head_dim]
    page_table: jax.Array,  # int32 [seqs, pages_per_seq]
    kv_lens: jax.Array,     # int32 [seqs]: the query attends keys 0..kv_len-1; 0 = no keys
    *,
    sm_scale: float,
    block_sizes: BlockSizes,
) -> tuple[jax.Array, jax.Array]:  # out [seqs, q_heads, head_dim] (q.dtype), lse [seqs, q_heads]
    """Streams one K/V tile of every sequence per step, up to the longest context (tiles
    shrink with the batch to stay in cache: `reference_decode_pages_per_tile`)."""
    seqs, q_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    q_per_kv = q_heads // kv_heads
    pages_per_tile = reference_decode_pages_per_tile(
        block_sizes, seqs=seqs, page_size=page_size, kv_heads=kv_heads, head_dim=head_dim,
        itemsize=k_pages.dtype.itemsize)
    block_kv = pages_per_tile * page_size
    page_table = _pad_page_table(page_table, pages_per_tile)
    kv_lens = kv_lens.astype(jnp.int32)

    q_rows = q.reshape(seqs, kv_heads, q_per_kv, head_dim)    # GQA group = rows
    key_offsets = jnp.arange(block_kv, dtype=jnp.int32)

    def tile_step(tile, state):
        page_ids = jax.lax.dynamic_slice_in_dim(page_table, tile * pages_per_tile,
                                                pages_per_tile, axis=1)
        k = _gather_kv_tile(k_pages, page_ids)                 # [seqs, kv, keys, d]
        v = _gather_kv_tile(v_pages, page_ids)
        scores = attention_scores(q_rows, k, sm_scale)        # [seqs, kv, g, keys]
        visible = (tile * block_kv + key_offsets)[None, :] < kv_lens[:, None]
        scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
        return online_softmax_update(state, scores, v)

    num_tiles = _cdiv(jnp.max(kv_lens), block_kv)
    state = online_softmax_init((seqs, kv_heads, q_per_kv), head_dim)
    state = jax.lax.fori_loop(0, num_tiles, tile_step, state)
    out, lse = online_softmax_finish(state)
    return (out.reshape(seqs, q_heads, head_dim).astype(q.dtype),
            lse.reshape(seqs, q_heads))


# ----------------------------------------------------------------------------------------
# Ragged: prefill chunks and decodes mixed
# ----------------------------------------------------------------------------------------


def _chunked_prefill_reference(q, k_pages, v_pages, page_table, plan: QueryBlockPlan, *,
                               sm_scale: float, block_sizes: BlockSizes):
    """Query blocks of `plan`, one at a time, each streaming over its sequence's pages.

    Returns out [tokens, q_heads, head_dim] f32 and lse [tokens, q_heads]; rows not
    covered by the plan are 0 / -inf.
    """
    num_tokens, q_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    q_per_kv = q_heads // kv_heads
    block_q = block_sizes.block_q
    pages_per_tile = block_sizes.kv_pages_per_block
    block_kv = pages_per_tile * page_size
    page_table = _pad_page_table(page_table, pages_per_tile)

    # A block may start within block_q of the end; the padding keeps its slices in bounds
    # (dynamic_slice would otherwise clamp the start and misalign the rows).
    q_padded = jnp.pad(q, ((0, block_q), (0, 0), (0, 0)))
    out = jnp.zeros((num_tokens + block_q, q_heads, head_dim), jnp.float32)
    lse = jnp.full((num_tokens + block_q, q_heads), -jnp.inf, jnp.float32)
    # Row r of a block's matmul is token r // q_per_kv, query head r % q_per_kv of the group.
    row_token = jnp.arange(block_q * q_per_kv, dtype=jnp.int32) // q_per_kv
    key_offsets = jnp.arange(block_kv, dtype=jnp.int32)

    def block_step(b, carry):
        out, lse = carry
        seq, first_token = plan.seq[b], plan.first_token[b]
        first_pos, n_tokens = plan.first_pos[b], plan.num_tokens[b]
        q_block = jax.lax.dynamic_slice_in_dim(q_padded, first_token, block_q, axis=0)
        q_rows = (q_block.reshape(block_q, kv_heads, q_per_kv, head_dim)
                  .transpose(1, 0, 2, 3).reshape(kv_heads, block_q * q_per_kv, head_dim))
        row_pos = first_pos + row_token                        # [rows]
        row_live = row_token < n_tokens
        seq_pages = page_table[seq]                            # [pages_per_seq (padded)]

        def tile_step(tile, state):
            page_ids = jax.lax.dynamic_slice_in_dim(seq_pages, tile * pages_per_tile,
                                                    pages_per_tile)
            k = _gather_kv_tile(k_pages, page_ids)             # [kv, keys, d]
            v = _gather_kv_tile(v_pages, page_ids)
            scores = attention_scores(q_rows, k, sm_scale)    # [kv, rows, keys]
            key_pos = tile * block_kv + key_offsets
            visible = row_live[:, None] & (key_pos[None, :] <= row_pos[:, None])
            scores = jnp.where(visible[None], scores, -jnp.inf)
            return online_softmax_update(state, scores, v)

        # Causal: the block needs keys up to its last query's position only.
        num_tiles = _cdiv(first_pos + n_tokens, block_kv)
        state = online_softmax_init((kv_heads, block_q * q_per_kv), head_dim)
        state = jax.lax.fori_loop(0, num_tiles, tile_step, state)
        o, l = online_softmax_finish(state)
        o = (o.reshape(kv_heads, block_q, q_per_kv, head_dim).transpose(1, 0, 2, 3)
             .reshape(block_q, q_heads, head_dim))
        l = l.reshape(kv_heads, block_q, q_per_kv).transpose(1, 0, 2).reshape(block_q, q_heads)
        # Rows past n_tokens belong to the next sequence (or padding): keep what is there.
        mine = (jnp.arange(block_q) < n_tokens)
        old_o = jax.lax.dynamic_slice_in_dim(out, first_token, block_q, axis=0)
        old_l = jax.lax.dynamic_slice_in_dim(lse, first_token, block_q, axis=0)
        out = jax.lax.dynamic_update_slice_in_dim(
            out, jnp.where(mine[:, None, None], o, old_o), first_token, axis=0)
        lse = jax.lax.dynamic_update_slice_in_dim(
            lse, jnp.where(mine[:, None], l, old_l), first_token, axis=0)
        return out, lse

    out, lse = jax.lax.fori_loop(0, plan.count, block_step, (out, lse))
    return out[:num_tokens], lse[:num_tokens]


def ragged_paged_attention_reference(
    q: jax.Array,           # [tokens, q_heads, head_dim]
    k_pages: jax.Array,     # [num_pages, page_size, kv_heads, head_dim]
    v_pages: jax.Array,     # [num_pages, page_size, kv_heads, head_dim]
    page_table: jax.Array,  # int32 [max_seqs, pages_per_seq]
    cu_q_lens: jax.Array,   # int32 [max_seqs + 1]
    kv_lens: jax.Array,     # int32 [max_seqs]: cache length after this step
    num_seqs: jax.Array,    # int32 [1]
    *,
    sm_scale: float,
    block_sizes: BlockSizes,
) -> tuple[jax.Array, jax.Array]:  # out [tokens, q_heads, head_dim], lse [tokens, q_heads]
    """Causal paged attention for a ragged batch of prefill chunks and decodes (see
    `pallas_kernels.ragged_paged_attention` for the contract)."""
    num_tokens = q.shape[0]
    max_seqs = kv_lens.shape[0]
    cu_q_lens = cu_q_lens.astype(jnp.int32)
    kv_lens = kv_lens.astype(jnp.int32)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    in_use = jnp.arange(max_seqs) < num_seqs[0]
    is_decode = in_use & (q_lens == 1)

    # Prefill chunks (q_len >= 2): query blocks streaming over their own context.
    plan = plan_query_blocks(cu_q_lens, kv_lens, num_seqs, num_tokens=num_tokens,
                             block_q=block_sizes.block_q, min_q_len=2)
    out, lse = _chunked_prefill_reference(q, k_pages, v_pages, page_table, plan,
                                          sm_scale=sm_scale, block_sizes=block_sizes)

    # Decodes: every decoding sequence's single query at once.
    decode_q = q[jnp.minimum(cu_q_lens[:-1], num_tokens - 1)]   # [max_seqs, q_heads, d]
    decode_out, decode_lse = decode_attention_reference(
        decode_q, k_pages, v_pages, page_table, jnp.where(is_decode, kv_lens, 0),
        sm_scale=sm_scale, block_sizes=block_sizes)

    token = jnp.arange(num_tokens)
    token_seq = segment_of(token, cu_q_lens[1:])
    token_is_decode = (token < cu_q_lens[num_seqs[0]]) & is_decode[token_seq]
    out = jnp.where(token_is_decode[:, None, None], decode_out[token_seq], out)
    lse = jnp.where(token_is_decode[:, None], decode_lse[token_seq], lse)
    return out.astype(q.dtype), lse


# ----------------------------------------------------------------------------------------
# Test and benchmark helpers: the dense oracle and random page tables
# ----------------------------------------------------------------------------------------


def dense_attention_oracle(q, k_pages, v_pages, page_table, cu_q_lens, kv_lens, num_seqs, *,
                           sm_scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Obviously-correct ragged paged attention in float64 numpy, for tests.

    Same arguments and result as `ragged_paged_attention` (out [tokens, q_heads, head_dim],
    lse [tokens, q_heads]); a decode batch is the case q_len = 1 for every sequence.
    """
    q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
    page_table, cu_q_lens, kv_lens = (np.asarray(x) for x in (page_table, cu_q_lens, kv_lens))
    num_tokens, q_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    out = np.zeros((num_tokens, q_heads, head_dim))
    lse = np.full((num_tokens, q_heads), -np.inf)
    for s in range(int(np.asarray(num_seqs).reshape(-1)[0])):
        start, end, kv_len = int(cu_q_lens[s]), int(cu_q_lens[s + 1]), int(kv_lens[s])
        n_pages = math.ceil(kv_len / page_size)
        keys = k_pages[page_table[s, :n_pages]].reshape(-1, kv_heads, head_dim)[:kv_len]
        values = v_pages[page_table[s, :n_pages]].reshape(-1, kv_heads, head_dim)[:kv_len]
        for i, t in enumerate(range(start, end)):
            position = kv_len - (end - start) + i
            if position < 0:  # a query with no key (a decode over an empty cache)
                continue
            for h in range(q_heads):
                kv_head = h // (q_heads // kv_heads)
                scores = keys[: position + 1, kv_head] @ q[t, h] * sm_scale
                top = scores.max()
                weights = np.exp(scores - top)
                out[t, h] = weights @ values[: position + 1, kv_head] / weights.sum()
                lse[t, h] = top + np.log(weights.sum())
    return out, lse


def random_page_table(
    rng: np.random.Generator,
    kv_lens,                # [seqs] ints: context of each sequence in use
    *,
    max_seqs: int,
    pages_per_seq: int,
    page_size: int,
    num_pages: int,
) -> np.ndarray:            # int32 [max_seqs, pages_per_seq]
    """A page table for tests and benchmarks: each sequence owns distinct, randomly placed
    pages; entries past its pages (and rows of padding sequences) hold random valid page
    ids, which attention must mask out by kv_lens."""
    needed = [math.ceil(n / page_size) for n in kv_lens]
    if max(needed, default=0) > pages_per_seq or sum(needed) > num_pages:
        raise ValueError(f"{kv_lens=} need {needed} pages of {page_size=}; have "
                         f"{pages_per_seq=} per sequence and {num_pages=} in all")
    table = rng.integers(0, num_pages, size=(max_seqs, pages_per_seq), dtype=np.int32)
    owned = rng.permutation(num_pages).astype(np.int32)
    start = 0
    for s, n in enumerate(needed):
        table[s, :n] = owned[start:start + n]
        start += n
    return table
