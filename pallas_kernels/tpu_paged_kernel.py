"""The ragged paged attention kernel for Mosaic-TPU (scalar prefetch + DMA).

The GPU kernel (`paged_kernel`) gathers a tile of pages with a vector of page ids, which
Mosaic-TPU does not lower. Here the page ids are scalars in SMEM and each page is brought
from HBM into VMEM by its own DMA:

    grid = (kv head "parallel" (megacore may split it), query block "arbitrary" (in order))

- Scalar prefetch (`PrefetchScalarGridSpec`): per query block its sequence, the keys it
  reads (`QueryBlockPlan.key_end`, clipped), its token count, its first tile and the
  buffer slot of that tile, and the page table flattened to 1-D (a 2-D SMEM array pads
  its minor dimension to 128 words per row).
- A window (sliding_window, or window_starts mapped into a KV shard's keys: one more VMEM
  input, each row's first key) starts a block at the tile of its earliest row's first
  key: the tiles before it are neither copied nor computed, and a block whose windows all
  start past its keys (a shard wholly before them) copies nothing (out 0, lse -inf).
- Q comes in as VMEM blocks [rows, head_dim] laid out head-major: row r is query head
  r // block_q of the KV head's GQA group and token r % block_q of the block, so the
  group fills the MXU rows and each K/V tile is read once for all of them. block_q is a
  power of 2, so the token of a row is a bit-and (Mosaic has no cheap vector division)
  and rows = q_per_kv * block_q is a whole number of sublane tiles.
- K/V stay in HBM (memory_space ANY). A program walks its block's tiles of
  kv_pages_per_block pages; tile t + 1's page DMAs (one per page, only pages holding a
  needed key) are started before tile t is waited for and computed: double buffering in a
  [2, pages, page_size, head_dim] VMEM buffer with one DMA semaphore per slot and tensor.
  A block's last tile starts the next block's first (blocks of a KV head run in order),
  so decodes and short chunks, one tile each, still overlap DMA with compute; only each
  KV head's first tile is exposed.
- Online softmax with the running max/sum/accumulator in VMEM scratch, the same
  `online_softmax_update` as the GPU kernel and the XLA path (kept 2-D here, [rows, 1]).
- Output: out [rows, head_dim] in q's dtype and lse [rows, 1] f32 (natural log), exactly
  the GPU kernel's convention, so `merge_attention` combines KVP shards and CP ring steps.
  causal=False is the GPU kernel's prefix mode (every query sees keys 0..kv_len-1).

Deviation from the GPU kernel: no KV splits. A TPU core runs the grid as a sequential
loop (no SM occupancy to fill), so split-K only adds partials and a merge; KV heads are
parallel across the two cores of a v5p/v4 megacore through the grid semantics.
Pages of a K/V head are copied with a strided DMA (the cache is [pages, page_size,
kv_heads, head_dim]; one head is page_size rows of head_dim contiguous elements).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.block_sizes import BlockSizes, check_tpu_tiles
from pallas_kernels.merge import (attention_scores, online_softmax_finish, online_softmax_init,
                                  online_softmax_update)
from pallas_kernels.query_blocks import key_starts, plan_query_blocks, row_key_ends


def _tpu_paged_attention_kernel(
    # Scalar prefetch (SMEM).
    block_seq_ref,         # int32 [blocks]: sequence of each query block
    block_keys_ref,        # int32 [blocks]: keys 0..n-1 are seen by the block's last query
    block_num_tokens_ref,  # int32 [blocks]: queries in the block (0 = empty block)
    block_first_tile_ref,  # int32 [blocks]: the block's first tile (before it: no key in
                           #   any of its queries' windows)
    block_slot_ref,        # int32 [blocks]: buffer slot of the block's first tile
    page_table_ref,        # int32 [max_seqs * pages_per_seq]: the page table, row-major
    # Inputs.
    q_ref,                 # VMEM [rows, head_dim]: this block and KV head, head-major rows
    starts_ref,            # VMEM int32 [rows, 1]: each row's first key (window_starts), or None
    k_hbm_ref,             # HBM [num_pages, page_size, kv_heads, head_dim]
    v_hbm_ref,             # HBM [num_pages, page_size, kv_heads, head_dim]
    # Outputs.
    out_ref,               # VMEM [rows, head_dim] (q dtype)
    lse_ref,               # VMEM [rows, 1] f32
    # Scratch.
    k_buf,                 # VMEM [2, pages_per_tile, page_size, head_dim]
    v_buf,                 # VMEM [2, pages_per_tile, page_size, head_dim]
    sems,                  # DMA semaphores [2 slots, 2 (K, V)]
    acc_ref,               # VMEM [rows, head_dim] f32
    m_ref,                 # VMEM [rows, 1] f32
    l_ref,                 # VMEM [rows, 1] f32
    *,
    sm_scale: float,
    block_q: int,
    pages_per_seq: int,
    causal: bool,
    sliding_window: int | None,
):
    kv_head, block = pl.program_id(0), pl.program_id(1)
    num_blocks = pl.num_programs(1)
    rows, head_dim = q_ref.shape
    _, pages_per_tile, page_size, _ = k_buf.shape
    block_kv = pages_per_tile * page_size

    # lax.div/rem, not // and %: jnp's floor division lowers through sign(), whose Mosaic
    # rule asks the TPU generation (so lowering from a CPU host fails); values are >= 0.
    def tiles_of(blk):
        return jax.lax.div(block_keys_ref[blk] + block_kv - 1, block_kv)

    def copied_tiles(blk):   # the tiles a block copies and computes: first .. tiles_of - 1
        return tiles_of(blk) - block_first_tile_ref[blk]

    def page_copies(blk, tile, slot):
        """The DMAs of tile `tile` of block `blk` into buffer `slot`: one (K, V) pair per
        page, each with whether it is needed (pages past the block's last key are neither
        started nor waited for)."""
        pages_needed = jax.lax.div(block_keys_ref[blk] + page_size - 1, page_size)
        table_row = block_seq_ref[blk] * pages_per_seq
        copies = []
        for i in range(pages_per_tile):
            page_index = tile * pages_per_tile + i
            page = page_table_ref[table_row + jnp.minimum(page_index, pages_per_seq - 1)]
            copies.append((page_index < pages_needed, (
                pltpu.make_async_copy(k_hbm_ref.at[page, :, kv_head, :], k_buf.at[slot, i],
                                      sems.at[slot, 0]),
                pltpu.make_async_copy(v_hbm_ref.at[page, :, kv_head, :], v_buf.at[slot, i],
                                      sems.at[slot, 1]))))
        return copies

    def start(blk, tile, slot):
        for needed, pair in page_copies(blk, tile, slot):
            @pl.when(needed)
            def _():
                for copy in pair:
                    copy.start()

    def wait(blk, tile, slot):
        for needed, pair in page_copies(blk, tile, slot):
            @pl.when(needed)
            def _():
                for copy in pair:
                    copy.wait()

    num_tokens = block_num_tokens_ref[block]
    keys_needed = block_keys_ref[block]
    num_tiles = tiles_of(block)
    first_tile = block_first_tile_ref[block]
    slot_base = block_slot_ref[block]
    next_block = jnp.minimum(block + 1, num_blocks - 1)
    next_tiles = jnp.where(block + 1 < num_blocks, copied_tiles(next_block), 0)
    # The previous block of this KV head started our first tile during its last one.
    prefetched = (block > 0) & (copied_tiles(jnp.maximum(block - 1, 0)) > 0)

    acc0, m0, l0 = online_softmax_init((rows,), head_dim, keepdims=True)
    acc_ref[...] = acc0
    m_ref[...] = m0
    l_ref[...] = l0

    # Head-major rows: token = row % block_q (block_q is a power of 2).
    row_token = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) & (block_q - 1)
    row_live = row_token < num_tokens
    row_end = jnp.where(row_live, row_key_ends(keys_needed, num_tokens, row_token,
                                               causal=causal), 0)
    # A window masks keys before row_start; tiles wholly before every row's window are
    # neither copied nor computed (first_tile, which the previous program prefetches).
    if starts_ref is None:
        row_start = key_starts(row_end, sliding_window)
    else:
        row_start = starts_ref[...]
    key_lanes = jax.lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)     # keys along lanes
    key_sublanes = jax.lax.broadcasted_iota(jnp.int32, (block_kv, 1), 0)  # and sublanes

    @pl.when((num_tiles > first_tile) & ~prefetched)
    def _():
        start(block, first_tile, slot_base)

    def tile_step(tile, carry):
        slot = jax.lax.rem(slot_base + tile - first_tile, 2)

        @pl.when(tile + 1 < num_tiles)
        def _():
            start(block, tile + 1, 1 - slot)

        # The last tile starts the next block's first (same KV head: the block axis runs
        # in order on one core), so a run of decodes or short chunks streams without a
        # DMA bubble per program.
        @pl.when((tile + 1 == num_tiles) & (next_tiles > 0))
        def _():
            start(next_block, block_first_tile_ref[next_block], 1 - slot)

        wait(block, tile, slot)
        first_key = tile * block_kv
        # Pages not copied hold stale VMEM (NaN in the interpreter): zero V there so
        # masked probabilities (0) times V stay 0; K's garbage is masked in the scores.
        v = jnp.where(first_key + key_sublanes < keys_needed,
                      v_buf[slot].reshape(block_kv, head_dim), 0)
        k = k_buf[slot].reshape(block_kv, head_dim)
        scores = attention_scores(q_ref[...], k, sm_scale)               # [rows, keys] f32
        scores = jnp.where((first_key + key_lanes < row_end) & (first_key + key_lanes >= row_start),
                           scores, -jnp.inf)
        acc, m, l = online_softmax_update((acc_ref[...], m_ref[...], l_ref[...]), scores, v)
        acc_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = l
        return carry

    jax.lax.fori_loop(first_tile, num_tiles, tile_step, 0)
    out, lse = online_softmax_finish((acc_ref[...], m_ref[...], l_ref[...]))
    out_ref[...] = out.astype(out_ref.dtype)
    lse_ref[...] = lse


def tpu_paged_attention_blocks(
    q_blocks: jax.Array,          # [kv_heads, blocks, rows, head_dim]: head-major rows
    k_pages: jax.Array,           # [num_pages, page_size, kv_heads, head_dim]
    v_pages: jax.Array,           # [num_pages, page_size, kv_heads, head_dim]
    page_table: jax.Array,        # int32 [max_seqs, pages_per_seq]
    block_seq: jax.Array,         # int32 [blocks]
    block_key_end: jax.Array,     # int32 [blocks] (QueryBlockPlan.key_end)
    block_num_tokens: jax.Array,  # int32 [blocks]
    *,
    sm_scale: float,
    block_q: int,
    kv_pages_per_block: int,
    interpret,                    # False, or pltpu.InterpretParams (the TPU interpreter)
    causal: bool = True,
    sliding_window: int | None = None,
    block_starts: jax.Array | None = None,  # int32 [blocks, rows]: each row's first key
) -> tuple[jax.Array, jax.Array]:  # out [kv_heads, blocks, rows, head_dim] (q dtype),
    #                                lse [kv_heads, blocks, rows, 1] f32
    """Runs the kernel over (kv head, query block). block_starts (causal=False): a window
    mapped by the caller into these pages' keys, in place of sliding_window
    (`attention.ragged_paged_attention`'s window_starts)."""
    kv_heads, num_blocks, rows, head_dim = q_blocks.shape
    _, page_size, _, _ = k_pages.shape
    max_seqs, pages_per_seq = page_table.shape
    # More pages per tile than a sequence can hold only copies nothing: cap it.
    pages_per_tile = min(kv_pages_per_block, pages_per_seq)
    block_kv = pages_per_tile * page_size
    # Keys each block reads: none for an empty block, never past the page table even if a
    # caller's kv_len overstates it (no wild DMAs).
    block_keys = jnp.where(block_num_tokens > 0,
                           jnp.minimum(block_key_end, pages_per_seq * page_size), 0)
    # Tiles alternate buffer slots across the blocks of a KV head (the next block's first
    # tile is prefetched into the slot after the current block's last).
    tiles = (block_keys + block_kv - 1) // block_kv
    # The first tile of each block: the tile of the earliest key any of its live rows sees.
    if block_starts is None:
        first_row_end = row_key_ends(block_keys, block_num_tokens, jnp.zeros_like(block_keys),
                                     causal=causal)
        first_key = key_starts(first_row_end, sliding_window)
    else:
        live = (jnp.arange(rows) % block_q)[None, :] < block_num_tokens[:, None]  # head-major
        first_key = jnp.min(jnp.where(live, block_starts, jnp.iinfo(jnp.int32).max), axis=1)
    first_tile = jnp.clip(first_key // block_kv, 0, tiles).astype(jnp.int32)
    copied = tiles - first_tile
    block_slot = ((jnp.cumsum(copied) - copied) % 2).astype(jnp.int32)
    kernel = functools.partial(_tpu_paged_attention_kernel, sm_scale=sm_scale, block_q=block_q,
                               pages_per_seq=pages_per_seq, causal=causal,
                               sliding_window=sliding_window)
    block_spec = pl.BlockSpec((None, None, rows, head_dim), lambda h, b, *_: (h, b, 0, 0))
    lse_spec = pl.BlockSpec((None, None, rows, 1), lambda h, b, *_: (h, b, 0, 0))
    starts_specs, starts_args = [], []
    if block_starts is None:
        call_kernel = lambda *refs: kernel(*refs[:7], None, *refs[7:])  # noqa: E731
    else:
        call_kernel = kernel
        starts_specs = [pl.BlockSpec((None, rows, 1), lambda h, b, *_: (b, 0, 0))]
        starts_args = [block_starts.astype(jnp.int32)[..., None]]
    kv_buf = pltpu.VMEM((2, pages_per_tile, page_size, head_dim), k_pages.dtype)
    return pl.pallas_call(
        call_kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(kv_heads, num_blocks),
            in_specs=[block_spec,
                      *starts_specs,
                      pl.BlockSpec(memory_space=pl.ANY),
                      pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=[block_spec, lse_spec],
            scratch_shapes=[kv_buf, kv_buf, pltpu.SemaphoreType.DMA((2, 2)),
                            pltpu.VMEM((rows, head_dim), jnp.float32),
                            pltpu.VMEM((rows, 1), jnp.float32),
                            pltpu.VMEM((rows, 1), jnp.float32)]),
        out_shape=[jax.ShapeDtypeStruct(q_blocks.shape, q_blocks.dtype),
                   jax.ShapeDtypeStruct((kv_heads, num_blocks, rows, 1), jnp.float32)],
        # KV heads may split across a megacore's cores; blocks run in order on one core,
        # which the cross-block prefetch relies on.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="tpu_ragged_paged_attention",
    )(block_seq, block_keys.astype(jnp.int32), block_num_tokens, first_tile, block_slot,
      page_table.astype(jnp.int32).reshape(max_seqs * pages_per_seq),
      q_blocks, *starts_args, k_pages, v_pages)


def ragged_paged_attention_tpu(q, k_pages, v_pages, page_table, cu_q_lens, kv_lens, num_seqs,
                               *, sm_scale: float, block_sizes: BlockSizes, interpret,
                               causal: bool = True, first_seq=None,
                               sliding_window: int | None = None, window_starts=None):
    """The TPU kernel over a ragged batch; arguments and result as
    `attention.ragged_paged_attention`. interpret: False (Mosaic) or pltpu.InterpretParams.
    first_seq (int32 [], traced): sequences before it are left out (out 0, lse -inf): the
    decode path serves them."""
    num_tokens, q_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    check_tpu_tiles(block_sizes, page_size=page_size)
    q_per_kv = q_heads // kv_heads
    block_q = block_sizes.block_q
    plan = plan_query_blocks(cu_q_lens, kv_lens, num_seqs, num_tokens=num_tokens,
                             block_q=block_q, first_seq=first_seq)
    num_blocks = plan.seq.shape[0]
    # [blocks, block_q, q_heads, d] -> [kv_heads, blocks, q_per_kv * block_q, d], head-major.
    token = jnp.minimum(plan.first_token[:, None] + jnp.arange(block_q), num_tokens - 1)
    q_blocks = (q[token].reshape(num_blocks, block_q, kv_heads, q_per_kv, head_dim)
                .transpose(2, 0, 3, 1, 4)
                .reshape(kv_heads, num_blocks, q_per_kv * block_q, head_dim))
    block_starts = None
    if window_starts is not None:   # head-major rows: row r is token r % block_q
        block_starts = jnp.tile(window_starts.astype(jnp.int32)[token], (1, q_per_kv))
    out_blocks, lse_blocks = tpu_paged_attention_blocks(
        q_blocks, k_pages, v_pages, page_table, plan.seq, plan.key_end(causal),
        plan.num_tokens, sm_scale=sm_scale, block_q=block_q,
        kv_pages_per_block=block_sizes.kv_pages_per_block, interpret=interpret,
        causal=causal, sliding_window=sliding_window, block_starts=block_starts)
    # Back to token order: [kv, blocks, q_per_kv, block_q, (d)] -> [blocks, block_q, q_heads, (d)].
    out_blocks = (out_blocks.reshape(kv_heads, num_blocks, q_per_kv, block_q, head_dim)
                  .transpose(1, 3, 0, 2, 4).reshape(num_blocks, block_q, q_heads, head_dim))
    lse_blocks = (lse_blocks.reshape(kv_heads, num_blocks, q_per_kv, block_q)
                  .transpose(1, 3, 0, 2).reshape(num_blocks, block_q, q_heads))
    valid = plan.token_valid
    out = jnp.where(valid[:, None, None], out_blocks[plan.token_block, plan.token_row], 0)
    lse = jnp.where(valid[:, None], lse_blocks[plan.token_block, plan.token_row], -jnp.inf)
    return out.astype(q.dtype), lse


def decode_attention_tpu(q, k_pages, v_pages, page_table, kv_lens, *, sm_scale: float,
                         block_sizes: BlockSizes, interpret, sliding_window: int | None = None,
                         window_starts=None):
    """The TPU kernel over a decode batch (one query per sequence, seeing keys
    0..kv_len-1); arguments and result as `attention.decode_attention`. Each program is
    one sequence and KV head: block_q query rows per head, one live (decode is bound by
    reading K/V, which is read once per sequence and head; the idle MXU rows cost nothing
    that matters)."""
    seqs = q.shape[0]
    return ragged_paged_attention_tpu(
        q, k_pages, v_pages, page_table, cu_q_lens=jnp.arange(seqs + 1, dtype=jnp.int32),
        kv_lens=kv_lens, num_seqs=jnp.full((1,), seqs, jnp.int32), sm_scale=sm_scale,
        block_sizes=block_sizes, interpret=interpret, causal=False,
        sliding_window=sliding_window, window_starts=window_starts)
