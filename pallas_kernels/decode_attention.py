"""Decode attention: one query token per sequence over its paged context (flash-decoding).

A decode batch has too few queries to fill a device, so the parallelism comes from the
keys: each sequence's context is split into `num_kv_splits` contiguous ranges of K/V tiles,
processed by separate programs (a grid axis), and the partial results are merged exactly by
log-sum-exp. The program is the ragged kernel's (`paged_attention_blocks`) with a query
block of one token, whose rows are the q_per_kv query heads of one KV head, so every K/V
tile is read once per GQA group.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.block_sizes import BlockSizes, resolve
from pallas_kernels.ragged_paged_attention import (check_paged_inputs, kernel_rows,
                                                   paged_attention_blocks)
from pallas_kernels.reference import decode_attention_reference


def _decode_attention_kernel(q, k_pages, v_pages, page_table, kv_lens, *, sm_scale,
                             block_sizes, interpret):
    seqs, q_heads, head_dim = q.shape
    kv_heads = k_pages.shape[2]
    q_per_kv = q_heads // kv_heads
    rows = kernel_rows(1, q_per_kv)
    q_blocks = jnp.pad(q.reshape(seqs, kv_heads, q_per_kv, head_dim),
                       ((0, 0), (0, 0), (0, rows - q_per_kv), (0, 0)))
    kv_lens = kv_lens.astype(jnp.int32)
    out, lse = paged_attention_blocks(
        q_blocks, k_pages, v_pages, page_table,
        block_seq=jnp.arange(seqs, dtype=jnp.int32),
        block_first_pos=kv_lens - 1,
        block_num_tokens=(kv_lens > 0).astype(jnp.int32),
        sm_scale=sm_scale, q_per_kv=q_per_kv, block_sizes=block_sizes, interpret=interpret)
    out = out[:, :, :q_per_kv].reshape(seqs, q_heads, head_dim)
    lse = lse[:, :, :q_per_kv].reshape(seqs, q_heads)
    return out.astype(q.dtype), lse


@functools.partial(jax.jit, static_argnames=("sm_scale", "num_kv_splits", "impl", "block_sizes"))
def decode_attention(
    q: jax.Array,           # [seqs, q_heads, head_dim]: one query per sequence
    k_pages: jax.Array,     # [num_pages, page_size, kv_heads, head_dim]
    v_pages: jax.Array,     # [num_pages, page_size, kv_heads, head_dim]
    page_table: jax.Array,  # int32 [seqs, pages_per_seq]
    kv_lens: jax.Array,     # int32 [seqs]: the query attends keys 0..kv_len-1 (0: none)
    *,
    sm_scale: float,
    num_kv_splits: int | None = None,
    impl: str = "auto",
    block_sizes: BlockSizes | None = None,
) -> tuple[jax.Array, jax.Array]:  # out [seqs, q_heads, head_dim] (q.dtype), lse [seqs, q_heads]
    """Attention of each sequence's single query over its whole cached context.

    num_kv_splits overrides block_sizes.num_kv_splits (the kernels' split-K factor; the
    reference ignores it). A sequence with kv_len 0 gets out 0, lse -inf.
    """
    check_paged_inputs(q, k_pages, v_pages, page_table)
    seqs = q.shape[0]
    if page_table.shape[0] != seqs or kv_lens.shape != (seqs,):
        raise ValueError(f"want page_table [{seqs}, pages_per_seq] and kv_lens [{seqs}] for "
                         f"{q.shape=}; got {page_table.shape=} {kv_lens.shape=}")
    impl, block_sizes = resolve(impl, block_sizes, head_dim=q.shape[2],
                                page_size=k_pages.shape[1])
    if num_kv_splits is not None:
        block_sizes = dataclasses.replace(block_sizes, num_kv_splits=num_kv_splits)
    if impl == "reference":
        return decode_attention_reference(q, k_pages, v_pages, page_table, kv_lens,
                                          sm_scale=sm_scale, block_sizes=block_sizes)
    return _decode_attention_kernel(q, k_pages, v_pages, page_table, kv_lens,
                                    sm_scale=sm_scale, block_sizes=block_sizes,
                                    interpret=impl == "interpret")
