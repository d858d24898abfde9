"""Paged attention in plain jnp: the serving path wherever the Pallas kernel does not run.

The engine runs these inside its jitted step on CPUs (and TPUs, for now), with static
shapes (up to 2048 tokens, 256 sequences, hundreds of pages per sequence), so they are
written to be exact, jittable and frugal with memory:

- No [tokens, context] score matrix is ever built. Queries are cut into blocks that belong
  to one sequence (`plan_query_blocks`, shared with the kernel), and each block streams
  over its own sequence's pages with an online softmax, stopping at the last key its last
  query sees: the work is proportional to the real tokens x context, whatever the padding
  of the page table.
- Decodes (sequences with one query token) would waste all but one row of a query block,
  so `ragged_paged_attention_xla` sends them to `decode_attention_xla`, which streams over
  a few decoding sequences at once, one K/V tile of each per step (`decode_group_size`).
- GQA: the q_per_kv query heads of a KV head are folded into the rows of one matmul with
  that head's keys; K/V are never repeated per query head.

Plain jnp throughout, so GSPMD can shard heads across devices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_native
from pallas_kernels.block_sizes import BlockSizes
from pallas_kernels.merge import (attention_scores, online_softmax_finish, online_softmax_init,
                                  online_softmax_update)
from pallas_kernels.query_blocks import (QueryBlockPlan, cdiv, key_starts, plan_query_blocks,
                                         row_key_ends, segment_of)

# The decode path gathers one K/V tile of every sequence per loop step. Past a few MB the
# gathered tile no longer stays in the CPU's cache and the step turns into two extra trips
# through memory: at 64 sequences x 2K context (smollm2 heads, f32) the step time falls
# from 113 ms with 16-page tiles to 58 ms with 2-4 pages (benchmarks/kernels.py).
DECODE_TILE_BYTES = 4 * 2**20


def decode_pages_per_tile(block_sizes: BlockSizes, *, seqs: int, page_size: int,
                          kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Pages per step of `decode_attention_xla`: block_sizes.kv_pages_per_block, fewer when
    the K tile of all `seqs` sequences together would pass DECODE_TILE_BYTES."""
    page_bytes = seqs * page_size * kv_heads * head_dim * itemsize
    return max(1, min(block_sizes.kv_pages_per_block, DECODE_TILE_BYTES // page_bytes))


def _pad_page_table(page_table: jax.Array, kv_pages_per_block: int) -> jax.Array:
    """Pads the width to whole K/V tiles with page 0 (a valid id; masked by position)."""
    pad = -page_table.shape[1] % kv_pages_per_block
    return jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, pad)))


def _fold_heads(pages: jax.Array) -> jax.Array:
    """[num_pages, page_size, kv_heads, head_dim] -> [num_pages, page_size, kv_heads *
    head_dim], before the loops that read the pages. With one K/V head (per device, after
    tp) the heads axis has size 1, and XLA is free to lay a size-1 axis out anywhere: a
    loop that carries the pages with it then copies all of them (the whole KV cache) on
    the way in. Folded, the pages have no size-1 axis and stay where they are."""
    num_pages, page_size, kv_heads, head_dim = pages.shape
    return pages.reshape(num_pages, page_size, kv_heads * head_dim)


def _gather_kv_tile(
    pages: jax.Array,     # [num_pages, page_size, kv_heads * head_dim] (`_fold_heads`)
    page_ids: jax.Array,  # int32 [..., pages_per_tile]
    head_dim: int,
) -> jax.Array:           # [..., kv_heads, pages_per_tile * page_size, head_dim]
    tile = pages[page_ids]                                     # [..., P, page_size, kv * d]
    *batch, n_pages, page_size, features = tile.shape
    tile = tile.reshape(*batch, n_pages * page_size, features // head_dim, head_dim)
    return jnp.swapaxes(tile, -3, -2)


# ----------------------------------------------------------------------------------------
# Decode: one query per sequence
# ----------------------------------------------------------------------------------------


def decode_group_size(seqs: int) -> int:
    """Sequences `decode_attention_xla` streams together: 2, or more past 64 sequences so
    a batch is at most 32 groups.

    A group reads every member's K/V tile per step up to the group's longest context, so
    small groups waste little on ragged contexts, while each group costs a sequential
    loop of its own. At 16 sequences, one of 4000 keys among 15 of 300 (smollm2 heads,
    f32, 2 cores): 17 ms per layer with all 16 in one group, 4.0 ms in groups of 2, 5.3 ms
    of 4, 8.2 ms of 8; all 16 at 300 keys: 1.9 ms in one group, 2.2 ms in groups of 2.
    At 256 sequences the same long-among-short batch takes 320 ms in one group, 39 ms in
    groups of 8 (all at 300 keys: 25 ms against 33 ms).
    """
    return max(2, cdiv(seqs, 32))


def decode_attention_xla(
    q: jax.Array,           # [seqs, q_heads, head_dim]
    k_pages: jax.Array,     # [num_pages, page_size, kv_heads, head_dim]
    v_pages: jax.Array,     # [num_pages, page_size, kv_heads, head_dim]
    page_table: jax.Array,  # int32 [seqs, pages_per_seq]
    kv_lens: jax.Array,     # int32 [seqs]: the query attends keys 0..kv_len-1; 0 = no keys
    *,
    sm_scale: float,
    block_sizes: BlockSizes,
    sliding_window: int | None = None,   # the query sees only the last this many keys
    window_starts: jax.Array | None = None,  # int32 [seqs]: else, the first key each sees
) -> tuple[jax.Array, jax.Array]:  # out [seqs, q_heads, head_dim] (q.dtype), lse [seqs, q_heads]
    """Sorts the sequences by context, longest first, and streams them in groups of
    `decode_group_size`, each group up to its own longest context: the work is about the
    sum of the contexts plus a group's worth of the longest, not every sequence slot
    (padding included) times the longest, which one long request decoding among chats
    would otherwise cost every step. On a CPU with the native kernels built, one custom
    call does the same instead (`cpu_native.runs_on`, `cpu_native.decode_attention`)."""
    seqs, q_heads, head_dim = q.shape
    kv_lens = kv_lens.astype(jnp.int32)
    if window_starts is None:
        window_starts = key_starts(kv_lens, sliding_window)
    kv_heads = k_pages.shape[2]
    k_pages, v_pages = _fold_heads(k_pages), _fold_heads(v_pages)
    if cpu_native.runs_on(k_pages, v_pages):
        out, lse = cpu_native.decode_attention(q, k_pages, v_pages, page_table, kv_lens,
                                               window_starts, sm_scale=sm_scale)
        return out.astype(q.dtype), lse
    group = min(seqs, decode_group_size(seqs))
    num_groups = cdiv(seqs, group)
    order = jnp.argsort(-kv_lens, stable=True)

    def grouped(x):                                            # [seqs, ...] -> [groups, group, ...]
        x = jnp.pad(x[order], [(0, num_groups * group - seqs)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape(num_groups, group, *x.shape[1:])

    def attend_group(args):
        return _decode_group(*args, k_pages, v_pages, kv_heads=kv_heads, sm_scale=sm_scale,
                             block_sizes=block_sizes)

    out, lse = jax.lax.map(attend_group, (grouped(q), grouped(page_table), grouped(kv_lens),
                                          grouped(window_starts.astype(jnp.int32))))
    unsort = jnp.argsort(order)
    return (out.reshape(num_groups * group, q_heads, head_dim)[unsort],
            lse.reshape(num_groups * group, q_heads)[unsort])


def _decode_group(q, page_table, kv_lens, starts, k_pages, v_pages, *, kv_heads: int,
                  sm_scale: float, block_sizes: BlockSizes):
    """`decode_attention_xla` for one group: one K/V tile of every member per step, up to
    the longest context (tiles shrink with the group to stay in cache:
    `decode_pages_per_tile`), from the first tile any member's window reaches.
    starts: int32 [group], each member's first key (0 without a window);
    k_pages, v_pages: [num_pages, page_size, kv_heads * head_dim]."""
    seqs, q_heads, head_dim = q.shape
    page_size = k_pages.shape[1]
    q_per_kv = q_heads // kv_heads
    pages_per_tile = decode_pages_per_tile(
        block_sizes, seqs=seqs, page_size=page_size, kv_heads=kv_heads, head_dim=head_dim,
        itemsize=k_pages.dtype.itemsize)
    block_kv = pages_per_tile * page_size
    page_table = _pad_page_table(page_table, pages_per_tile)

    q_rows = q.reshape(seqs, kv_heads, q_per_kv, head_dim)    # GQA group = rows
    key_offsets = jnp.arange(block_kv, dtype=jnp.int32)

    def tile_step(tile, state):
        page_ids = jax.lax.dynamic_slice_in_dim(page_table, tile * pages_per_tile,
                                                pages_per_tile, axis=1)
        # The tile as gathered, [seqs, keys, kv, d]: swapping it to [seqs, kv, keys, d]
        # for a batched matmul (as the query-block path does) copied every tile, 30% of
        # the decode attention's time on the CPU (16 sequences at 500 keys, SmolLM2
        # heads: 7.2 -> 4.9 ms a layer); the einsums read it where it lies.
        k = k_pages[page_ids].reshape(seqs, block_kv, kv_heads, head_dim)
        v = v_pages[page_ids].reshape(seqs, block_kv, kv_heads, head_dim)
        scores = jnp.einsum("skgd,sjkd->skgj", q_rows, k,
                            preferred_element_type=jnp.float32) * sm_scale
        key_pos = (tile * block_kv + key_offsets)[None, :]
        visible = (key_pos < kv_lens[:, None]) & (key_pos >= starts[:, None])
        scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
        return online_softmax_update(state, scores, v, pv_spec="skgj,sjkd->skgd")

    num_tiles = cdiv(jnp.max(kv_lens), block_kv)
    # Tiles wholly before every live member's window are skipped (members without keys
    # do not hold the start back).
    first_tile = jnp.min(jnp.where(kv_lens > 0, starts, jnp.iinfo(jnp.int32).max)) // block_kv
    state = online_softmax_init((seqs, kv_heads, q_per_kv), head_dim)
    state = jax.lax.fori_loop(jnp.minimum(first_tile, num_tiles), num_tiles, tile_step, state)
    out, lse = online_softmax_finish(state)
    return (out.reshape(seqs, q_heads, head_dim).astype(q.dtype),
            lse.reshape(seqs, q_heads))


# ----------------------------------------------------------------------------------------
# Ragged: prefill chunks and decodes mixed
# ----------------------------------------------------------------------------------------


def _query_blocks_xla(q, k_pages, v_pages, page_table, plan: QueryBlockPlan, *,
                      sm_scale: float, block_sizes: BlockSizes, causal: bool,
                      sliding_window: int | None, window_starts: jax.Array | None):
    """Query blocks of `plan`, one at a time, each streaming over its sequence's pages.
    window_starts: int32 [tokens] or None (see `ragged_paged_attention_xla`).

    Returns out [tokens, q_heads, head_dim] f32 and lse [tokens, q_heads]; rows not
    covered by the plan are 0 / -inf.
    """
    num_tokens, q_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    k_pages, v_pages = _fold_heads(k_pages), _fold_heads(v_pages)
    q_per_kv = q_heads // kv_heads
    block_q = block_sizes.block_q
    pages_per_tile = block_sizes.kv_pages_per_block
    block_kv = pages_per_tile * page_size
    page_table = _pad_page_table(page_table, pages_per_tile)
    key_end = plan.key_end(causal)                             # [blocks]

    # A block may start within block_q of the end; the padding keeps its slices in bounds
    # (dynamic_slice would otherwise clamp the start and misalign the rows).
    q_padded = jnp.pad(q, ((0, block_q), (0, 0), (0, 0)))
    if window_starts is not None:
        starts_padded = jnp.pad(window_starts.astype(jnp.int32), (0, block_q))
    out = jnp.zeros((num_tokens + block_q, q_heads, head_dim), jnp.float32)
    lse = jnp.full((num_tokens + block_q, q_heads), -jnp.inf, jnp.float32)
    # Row r of a block's matmul is token r // q_per_kv, query head r % q_per_kv of the group.
    row_token = jnp.arange(block_q * q_per_kv, dtype=jnp.int32) // q_per_kv
    key_offsets = jnp.arange(block_kv, dtype=jnp.int32)

    def block_step(b, carry):
        out, lse = carry
        seq, first_token, n_tokens = plan.seq[b], plan.first_token[b], plan.num_tokens[b]
        q_block = jax.lax.dynamic_slice_in_dim(q_padded, first_token, block_q, axis=0)
        q_rows = (q_block.reshape(block_q, kv_heads, q_per_kv, head_dim)
                  .transpose(1, 0, 2, 3).reshape(kv_heads, block_q * q_per_kv, head_dim))
        row_end = row_key_ends(key_end[b], n_tokens, row_token, causal=causal)   # [rows]
        row_live = row_token < n_tokens
        if window_starts is None:
            row_start = key_starts(row_end, sliding_window)                    # [rows]
        else:
            row_start = jax.lax.dynamic_slice_in_dim(starts_padded, first_token,
                                                     block_q)[row_token]

        seq_pages = page_table[seq]                            # [pages_per_seq (padded)]

        def tile_step(tile, state):
            page_ids = jax.lax.dynamic_slice_in_dim(seq_pages, tile * pages_per_tile,
                                                    pages_per_tile)
            k = _gather_kv_tile(k_pages, page_ids, head_dim)   # [kv, keys, d]
            v = _gather_kv_tile(v_pages, page_ids, head_dim)
            scores = attention_scores(q_rows, k, sm_scale)    # [kv, rows, keys]
            key_pos = tile * block_kv + key_offsets
            visible = row_live[:, None] & (key_pos[None, :] < row_end[:, None]) & (
                key_pos[None, :] >= row_start[:, None])
            scores = jnp.where(visible[None], scores, -jnp.inf)
            return online_softmax_update(state, scores, v)

        state = online_softmax_init((kv_heads, block_q * q_per_kv), head_dim)
        # Tiles before the block's earliest window are skipped.
        first_tile = jnp.min(jnp.where(row_live, row_start, jnp.iinfo(jnp.int32).max)
                             ) // block_kv
        num_tiles = cdiv(key_end[b], block_kv)
        state = jax.lax.fori_loop(jnp.minimum(first_tile, num_tiles), num_tiles, tile_step,
                                  state)
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


def _chunks_native(q, k_pages, v_pages, page_table, cu_q_lens, kv_lens, num_seqs, *,
                   sm_scale: float, causal: bool, sliding_window: int | None,
                   window_starts: jax.Array | None):
    """`_query_blocks_xla` as the native CPU kernel (`cpu_native.chunk_attention`): on a
    CPU, XLA runs the block and tile loops above at ~20-50 GFLOP/s (SmolLM2, a 256-token
    chunk: ~100 ms of a ~500 ms step). The keys each query sees are worked out here, per
    token, as `row_key_ends` and `key_starts` give them to the loops."""
    token = jnp.arange(q.shape[0], dtype=jnp.int32)
    seq = segment_of(token, cu_q_lens[1:])
    # Each chunk as one block: its last query sees all kv_len keys.
    ends = row_key_ends(kv_lens[seq], cu_q_lens[seq + 1] - cu_q_lens[seq],
                        token - cu_q_lens[seq], causal=causal)
    starts = key_starts(ends, sliding_window) if window_starts is None else window_starts
    return cpu_native.chunk_attention(q, _fold_heads(k_pages), _fold_heads(v_pages),
                                      page_table, cu_q_lens, num_seqs, starts, ends,
                                      sm_scale=sm_scale)


def ragged_paged_attention_xla(
    q: jax.Array,           # [tokens, q_heads, head_dim]
    k_pages: jax.Array,     # [num_pages, page_size, kv_heads, head_dim]
    v_pages: jax.Array,     # [num_pages, page_size, kv_heads, head_dim]
    page_table: jax.Array,  # int32 [max_seqs, pages_per_seq]
    cu_q_lens: jax.Array,   # int32 [max_seqs + 1]
    kv_lens: jax.Array,     # int32 [max_seqs]: cache length (after this step, when causal)
    num_seqs: jax.Array,    # int32 [1]
    *,
    sm_scale: float,
    block_sizes: BlockSizes,
    causal: bool = True,
    sliding_window: int | None = None,
    window_starts: jax.Array | None = None,  # int32 [tokens]: the first key each query sees
) -> tuple[jax.Array, jax.Array]:  # out [tokens, q_heads, head_dim], lse [tokens, q_heads]
    """Paged attention for a ragged batch of prefill chunks and decodes (see
    `pallas_kernels.attention.ragged_paged_attention` for the contract; window_starts, in
    place of sliding_window, for a window the caller maps into these pages' keys)."""
    num_tokens = q.shape[0]
    max_seqs = kv_lens.shape[0]
    cu_q_lens = cu_q_lens.astype(jnp.int32)
    kv_lens = kv_lens.astype(jnp.int32)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    in_use = jnp.arange(max_seqs) < num_seqs[0]
    is_decode = in_use & (q_lens == 1)

    # Chunks (q_len >= 2): query blocks streaming over their own context.
    if cpu_native.runs_on(q, k_pages, v_pages) and q.shape[2] % 8 == 0:
        out, lse = _chunks_native(q, k_pages, v_pages, page_table, cu_q_lens, kv_lens,
                                  num_seqs, sm_scale=sm_scale, causal=causal,
                                  sliding_window=sliding_window, window_starts=window_starts)
    else:
        plan = plan_query_blocks(cu_q_lens, kv_lens, num_seqs, num_tokens=num_tokens,
                                 block_q=block_sizes.block_q, min_q_len=2)
        out, lse = _query_blocks_xla(q, k_pages, v_pages, page_table, plan,
                                     sm_scale=sm_scale, block_sizes=block_sizes,
                                     causal=causal, sliding_window=sliding_window,
                                     window_starts=window_starts)

    # Decodes: every decoding sequence's single query at once. A lone query sees keys
    # 0..kv_len-1 whether causal (it is the last key) or not (the prefix), so one path.
    decode_token = jnp.minimum(cu_q_lens[:-1], num_tokens - 1)
    decode_q = q[decode_token]                                  # [max_seqs, q_heads, d]
    decode_out, decode_lse = decode_attention_xla(
        decode_q, k_pages, v_pages, page_table, jnp.where(is_decode, kv_lens, 0),
        sm_scale=sm_scale, block_sizes=block_sizes, sliding_window=sliding_window,
        window_starts=None if window_starts is None else window_starts[decode_token])

    token = jnp.arange(num_tokens)
    token_seq = segment_of(token, cu_q_lens[1:])
    token_is_decode = (token < cu_q_lens[num_seqs[0]]) & is_decode[token_seq]
    out = jnp.where(token_is_decode[:, None, None], decode_out[token_seq], out)
    lse = jnp.where(token_is_decode[:, None], decode_lse[token_seq], lse)
    return out.astype(q.dtype), lse
