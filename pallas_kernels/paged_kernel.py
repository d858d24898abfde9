"""The Pallas paged-attention kernel, and its ragged and decode wrappers.

Every step of the engine is a flat run of query tokens from many sequences, read against
each sequence's KV cache through its page table. The kernel parallelises over queries AND
keys (seed 000, section 3.1: this is what makes small chunks over a long context cheap):

    grid = (query block, kv head, kv split)

- A query block is <= block_q tokens of one sequence (`plan_query_blocks`); the q_per_kv
  query heads sharing a KV head are folded into the block's rows, so each K/V tile is read
  once for the whole GQA group and K/V are never repeated per query head.
- The keys a block needs (0 .. key_end-1, `QueryBlockPlan.key_end`) are cut into
  `num_kv_splits` contiguous ranges of tiles, one program each, merged afterwards by
  log-sum-exp (`merge_attention`). The ranges are sized per block at run time, so short and
  long contexts in one batch both spread over all splits.
- Inside a program, a loop over K/V tiles gathers kv_pages_per_block pages by page id and
  folds them into an online softmax (`online_softmax_update`, shared with the XLA path).
- causal (static): query i of a block of n sees keys < key_end - n + 1 + i (causal inside
  a chunk whose K/V are already in the cache); otherwise every query sees keys < key_end
  (a cached prefix wholly before the queries, as for KV-parallel shards).
- A window (sliding_window from the queries' positions, or window_starts: each row's first
  key, mapped by the caller into a KV shard's or cp rank's keys) masks keys before it, and
  the splits share only the tiles from the earliest row's first one: tiles wholly before
  every window of a block are never read (none at all where the windows start past the
  block's keys).
- A decode is a query block with one live token. `decode_attention_pallas` packs only the
  GQA group into the rows, for decode-only batches.

Written for the Triton lowering (GPU): whole-array refs with pointer-style indexing, page
gathers with a vector of page ids, power-of-2 tiles, dot sides >= 16. With interpret=True
it runs on the CPU (the tests).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.block_sizes import BlockSizes
from pallas_kernels.merge import (attention_scores, merge_attention, online_softmax_finish,
                                  online_softmax_init, online_softmax_update)
from pallas_kernels.query_blocks import key_starts, plan_query_blocks, row_key_ends

# Enough programs to keep a GPU busy (~8 per SM of a 132-SM H100); see the ragged wrapper.
MIN_GRID_PROGRAMS = 1024


def kernel_rows(tokens: int, q_per_kv: int) -> int:
    """Rows of a kernel query tile: tokens x the GQA group, padded to a power of 2 (Triton
    tensors) and to >= 16 (the smallest tl.dot M). Interpret mode uses the same layout."""
    return max(16, 1 << (tokens * q_per_kv - 1).bit_length())


def _paged_attention_kernel(
    block_seq_ref,         # int32 [blocks]: sequence of each query block
    block_key_end_ref,     # int32 [blocks]: keys 0..key_end-1 are seen by the block's last query
    block_num_tokens_ref,  # int32 [blocks]: queries in the block (0 = empty block)
    page_table_ref,        # int32 [max_seqs, pages_per_seq]: width a multiple of the tile
    q_ref,                 # [rows, head_dim]: row r = token r // q_per_kv, head r % q_per_kv
    starts_ref,            # int32 [rows]: each row's first key (window_starts), or None
    k_pages_ref,           # [num_pages, page_size, head_dim]: this program's KV head
    v_pages_ref,           # [num_pages, page_size, head_dim]
    out_ref,               # [rows, head_dim] f32: this split's partial output (normalised)
    lse_ref,               # [rows] f32: its log-sum-exp; -inf where it saw no key
    *,
    sm_scale: float,
    q_per_kv: int,
    kv_pages_per_block: int,
    num_kv_splits: int,
    causal: bool,
    sliding_window: int | None,
):
    block, split = pl.program_id(0), pl.program_id(2)
    rows, head_dim = q_ref.shape
    page_size = k_pages_ref.shape[1]
    block_kv = kv_pages_per_block * page_size

    seq = block_seq_ref[block]
    num_tokens = block_num_tokens_ref[block]
    keys_needed = jnp.where(num_tokens > 0, block_key_end_ref[block], 0)
    row_token = jnp.arange(rows, dtype=jnp.int32) // q_per_kv
    row_live = row_token < num_tokens          # also False for the power-of-2 padding rows
    row_end = row_key_ends(keys_needed, num_tokens, row_token, causal=causal)
    if starts_ref is None:
        row_start = key_starts(row_end, sliding_window)
    else:
        row_start = starts_ref[...]

    # The block's keys as tiles; this split takes its contiguous share. Never past the page
    # table, even if a caller's kv_len overstates it (no wild reads). Tiles wholly before
    # the first query's window are skipped (all of them where every window starts past the
    # block's keys: a KV shard wholly before the queries' windows).
    num_tiles = jnp.minimum((keys_needed + block_kv - 1) // block_kv,
                            page_table_ref.shape[1] // kv_pages_per_block)
    if sliding_window is None and starts_ref is None:
        window_tile = 0
    else:   # a reduction, not row_start[0]: Triton has no lowering for a slice
        first_key = jnp.min(jnp.where(row_live, row_start, keys_needed))
        window_tile = jnp.minimum(first_key // block_kv, num_tiles)
    tiles_per_split = (num_tiles - window_tile + num_kv_splits - 1) // num_kv_splits
    first_tile = window_tile + split * tiles_per_split
    end_tile = jnp.minimum(first_tile + tiles_per_split, num_tiles)

    q = q_ref[...]
    key_offsets = jnp.arange(block_kv, dtype=jnp.int32)

    def tile_step(tile, state):
        page_ids = page_table_ref[seq, pl.ds(tile * kv_pages_per_block, kv_pages_per_block)]
        k = k_pages_ref[page_ids].reshape(block_kv, head_dim)
        v = v_pages_ref[page_ids].reshape(block_kv, head_dim)
        scores = attention_scores(q, k, sm_scale)                        # [rows, keys]
        key_pos = tile * block_kv + key_offsets
        visible = row_live[:, None] & (key_pos[None, :] < row_end[:, None]) & (
            key_pos[None, :] >= row_start[:, None])
        scores = jnp.where(visible, scores, -jnp.inf)
        return online_softmax_update(state, scores, v)

    state = online_softmax_init((rows,), head_dim)
    state = jax.lax.fori_loop(first_tile, end_tile, tile_step, state)
    out, lse = online_softmax_finish(state)
    out_ref[...] = out
    lse_ref[...] = lse


def paged_attention_blocks(
    q_blocks: jax.Array,          # [blocks, kv_heads, rows, head_dim] (see kernel_rows)
    k_pages: jax.Array,           # [num_pages, page_size, kv_heads, head_dim]
    v_pages: jax.Array,           # [num_pages, page_size, kv_heads, head_dim]
    page_table: jax.Array,        # int32 [max_seqs, pages_per_seq]
    block_seq: jax.Array,         # int32 [blocks]
    block_key_end: jax.Array,     # int32 [blocks] (QueryBlockPlan.key_end)
    block_num_tokens: jax.Array,  # int32 [blocks]
    *,
    sm_scale: float,
    q_per_kv: int,
    block_sizes: BlockSizes,
    interpret: bool,
    causal: bool = True,
    sliding_window: int | None = None,
    block_starts: jax.Array | None = None,  # int32 [blocks, rows]: each row's first key
) -> tuple[jax.Array, jax.Array]:  # out [blocks, kv_heads, rows, head_dim] f32, lse [.., rows]
    """Runs the kernel over (block, kv head, kv split) and merges the splits by LSE.
    block_starts (causal=False): a window mapped by the caller into these pages' keys, in
    place of sliding_window (`attention.ragged_paged_attention`'s window_starts)."""
    num_blocks, kv_heads, rows, head_dim = q_blocks.shape
    num_pages, page_size, _, _ = k_pages.shape
    pages_per_tile = block_sizes.kv_pages_per_block
    splits = block_sizes.num_kv_splits
    if rows < q_per_kv:
        raise ValueError(f"{rows=} must hold at least one GQA group of {q_per_kv=}")
    # Whole tiles of page ids; the padding is page 0, a valid id that positions mask out.
    page_table = jnp.pad(page_table.astype(jnp.int32),
                         ((0, 0), (0, -page_table.shape[1] % pages_per_tile)))

    kernel = functools.partial(_paged_attention_kernel, sm_scale=sm_scale, q_per_kv=q_per_kv,
                               kv_pages_per_block=pages_per_tile, num_kv_splits=splits,
                               causal=causal, sliding_window=sliding_window)
    whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
    kv_head_of_cache = pl.BlockSpec((num_pages, page_size, pl.squeezed, head_dim),
                                    lambda b, h, s: (0, 0, h, 0))
    starts_specs, starts_args = [], []
    if block_starts is None:
        call_kernel = lambda *refs: kernel(*refs[:5], None, *refs[5:])  # noqa: E731
    else:
        call_kernel = kernel
        starts_specs = [pl.BlockSpec((pl.squeezed, rows), lambda b, h, s: (b, 0))]
        starts_args = [block_starts.astype(jnp.int32)]
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as pl_triton
        # 8 warps for the 128-row prefill blocks (FlashAttention-2's choice on Hopper: a
        # 128 x head_dim f32 accumulator needs the registers of 256 threads).
        compiler_params = pl_triton.CompilerParams(num_warps=8 if rows >= 128 else 4,
                                                   num_stages=2)

    out_parts, lse_parts = pl.pallas_call(
        call_kernel,
        grid=(num_blocks, kv_heads, splits),
        in_specs=[
            whole((num_blocks,)),
            whole((num_blocks,)),
            whole((num_blocks,)),
            whole(page_table.shape),
            pl.BlockSpec((pl.squeezed, pl.squeezed, rows, head_dim), lambda b, h, s: (b, h, 0, 0)),
            *starts_specs,
            kv_head_of_cache,
            kv_head_of_cache,
        ],
        out_specs=[
            pl.BlockSpec((pl.squeezed, pl.squeezed, pl.squeezed, rows, head_dim),
                         lambda b, h, s: (s, b, h, 0, 0)),
            pl.BlockSpec((pl.squeezed, pl.squeezed, pl.squeezed, rows),
                         lambda b, h, s: (s, b, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((splits, num_blocks, kv_heads, rows, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((splits, num_blocks, kv_heads, rows), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=compiler_params,
        name="ragged_paged_attention",
    )(block_seq, block_key_end, block_num_tokens, page_table, q_blocks, *starts_args, k_pages,
      v_pages)

    if splits == 1:
        return out_parts[0], lse_parts[0]
    flat = num_blocks * kv_heads * rows
    out, lse = merge_attention(out_parts.reshape(splits, flat, 1, head_dim),
                               lse_parts.reshape(splits, flat, 1))
    return (out.reshape(num_blocks, kv_heads, rows, head_dim),
            lse.reshape(num_blocks, kv_heads, rows))


def ragged_paged_attention_pallas(q, k_pages, v_pages, page_table, cu_q_lens, kv_lens,
                                  num_seqs, *, sm_scale: float, block_sizes: BlockSizes,
                                  interpret: bool, causal: bool = True, first_seq=None,
                                  sliding_window: int | None = None, window_starts=None):
    """The kernel over a ragged batch; arguments and result as
    `attention.ragged_paged_attention`. first_seq (int32 [], traced): sequences before it
    are left out (out 0, lse -inf): the decode path serves them."""
    num_tokens, q_heads, head_dim = q.shape
    kv_heads = k_pages.shape[2]
    q_per_kv = q_heads // kv_heads
    block_q = block_sizes.block_q
    rows = kernel_rows(block_q, q_per_kv)
    plan = plan_query_blocks(cu_q_lens, kv_lens, num_seqs, num_tokens=num_tokens,
                             block_q=block_q, first_seq=first_seq)
    num_blocks = plan.seq.shape[0]
    # KV splits pay only while query blocks x KV heads leave the device idle, and each one
    # costs a [blocks, kv_heads, rows, head_dim] f32 partial in memory, so a large token
    # bucket gets fewer (the bucket, hence num_blocks, is static).
    splits = min(block_sizes.num_kv_splits,
                 max(1, -(-MIN_GRID_PROGRAMS // (num_blocks * kv_heads))))
    block_sizes = dataclasses.replace(block_sizes, num_kv_splits=splits)

    # Query blocks: [blocks, block_q, q_heads, d] -> rows (token, head of the group) per KV head.
    token = jnp.minimum(plan.first_token[:, None] + jnp.arange(block_q), num_tokens - 1)
    q_blocks = (q[token].reshape(num_blocks, block_q, kv_heads, q_per_kv, head_dim)
                .transpose(0, 2, 1, 3, 4)
                .reshape(num_blocks, kv_heads, block_q * q_per_kv, head_dim))
    q_blocks = jnp.pad(q_blocks, ((0, 0), (0, 0), (0, rows - block_q * q_per_kv), (0, 0)))
    block_starts = None
    if window_starts is not None:   # row r is token r // q_per_kv; padding rows are not live
        block_starts = jnp.pad(jnp.repeat(window_starts.astype(jnp.int32)[token], q_per_kv,
                                          axis=1), ((0, 0), (0, rows - block_q * q_per_kv)))

    out_blocks, lse_blocks = paged_attention_blocks(
        q_blocks, k_pages, v_pages, page_table, plan.seq, plan.key_end(causal),
        plan.num_tokens, sm_scale=sm_scale, q_per_kv=q_per_kv, block_sizes=block_sizes,
        interpret=interpret, causal=causal, sliding_window=sliding_window,
        block_starts=block_starts)

    # Back to token order: [blocks, kv, rows, d] -> [blocks, block_q, q_heads, d] -> [tokens, ...].
    out_blocks = (out_blocks[:, :, : block_q * q_per_kv]
                  .reshape(num_blocks, kv_heads, block_q, q_per_kv, head_dim)
                  .transpose(0, 2, 1, 3, 4).reshape(num_blocks, block_q, q_heads, head_dim))
    lse_blocks = (lse_blocks[:, :, : block_q * q_per_kv]
                  .reshape(num_blocks, kv_heads, block_q, q_per_kv)
                  .transpose(0, 2, 1, 3).reshape(num_blocks, block_q, q_heads))
    valid = plan.token_valid
    out = jnp.where(valid[:, None, None], out_blocks[plan.token_block, plan.token_row], 0.0)
    lse = jnp.where(valid[:, None], lse_blocks[plan.token_block, plan.token_row], -jnp.inf)
    return out.astype(q.dtype), lse


def decode_attention_pallas(q, k_pages, v_pages, page_table, kv_lens, *, sm_scale: float,
                            block_sizes: BlockSizes, interpret: bool,
                            sliding_window: int | None = None, window_starts=None):
    """The kernel over a decode batch (one query per sequence, seeing keys 0..kv_len-1);
    arguments and result as `attention.decode_attention`. Each program's rows are only the
    GQA group of its KV head; the keys are split num_kv_splits ways (flash-decoding).
    window_starts: int32 [seqs] or None, each query's first key (in place of the window)."""
    seqs, q_heads, head_dim = q.shape
    kv_heads = k_pages.shape[2]
    q_per_kv = q_heads // kv_heads
    rows = kernel_rows(1, q_per_kv)
    q_blocks = jnp.pad(q.reshape(seqs, kv_heads, q_per_kv, head_dim),
                       ((0, 0), (0, 0), (0, rows - q_per_kv), (0, 0)))
    kv_lens = kv_lens.astype(jnp.int32)
    block_starts = None
    if window_starts is not None:
        block_starts = jnp.pad(jnp.repeat(window_starts.astype(jnp.int32)[:, None], q_per_kv,
                                          axis=1), ((0, 0), (0, rows - q_per_kv)))
    out, lse = paged_attention_blocks(
        q_blocks, k_pages, v_pages, page_table,
        block_seq=jnp.arange(seqs, dtype=jnp.int32), block_key_end=kv_lens,
        block_num_tokens=(kv_lens > 0).astype(jnp.int32),
        sm_scale=sm_scale, q_per_kv=q_per_kv, block_sizes=block_sizes, interpret=interpret,
        sliding_window=sliding_window, block_starts=block_starts)
    out = out[:, :, :q_per_kv].reshape(seqs, q_heads, head_dim)
    lse = lse[:, :, :q_per_kv].reshape(seqs, q_heads)
    return out.astype(q.dtype), lse
