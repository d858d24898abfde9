"""The public attention entry points: check shapes, choose the implementation and tiles
(`dispatch.choose_attention`), and call the Pallas kernel or the XLA path."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.block_sizes import BlockSizes
from pallas_kernels.dispatch import choose_attention
from pallas_kernels.paged_kernel import decode_attention_pallas, ragged_paged_attention_pallas
from pallas_kernels.xla_attention import decode_attention_xla, ragged_paged_attention_xla


def check_paged_inputs(q, k_pages, v_pages, page_table) -> None:
    """Shape checks common to the ragged and decode entry points; errors name the values."""
    if q.ndim != 3:
        raise ValueError(f"q must be [tokens, q_heads, head_dim], got {q.shape=}")
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(
            "k_pages and v_pages must both be [num_pages, page_size, kv_heads, head_dim], got "
            f"{k_pages.shape=} {v_pages.shape=}")
    q_heads, head_dim = q.shape[1:]
    kv_heads, kv_head_dim = k_pages.shape[2:]
    if kv_head_dim != head_dim:
        raise ValueError(f"q head_dim={head_dim} != k_pages head_dim={kv_head_dim}")
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads=} must be a multiple of {kv_heads=} (grouped-query attention)")
    if page_table.ndim != 2 or not jnp.issubdtype(page_table.dtype, jnp.integer):
        raise ValueError(f"page_table must be int [max_seqs, pages_per_seq], got "
                         f"{page_table.shape=} {page_table.dtype=}")


@functools.partial(jax.jit, static_argnames=("sm_scale", "impl", "block_sizes", "causal"))
def ragged_paged_attention(
    q: jax.Array,           # [tokens, q_heads, head_dim]
    k_pages: jax.Array,     # [num_pages, page_size, kv_heads, head_dim] (one layer's cache)
    v_pages: jax.Array,     # [num_pages, page_size, kv_heads, head_dim]
    page_table: jax.Array,  # int32 [max_seqs, pages_per_seq]: page ids of each sequence, in order
    cu_q_lens: jax.Array,   # int32 [max_seqs + 1]: seq s owns q[cu_q_lens[s]:cu_q_lens[s+1]]
    kv_lens: jax.Array,     # int32 [max_seqs]: keys of seq s in its pages (see causal)
    num_seqs: jax.Array,    # int32 [1]: sequences in use; later ones are padding
    *,
    sm_scale: float,
    impl: str = "auto",
    block_sizes: BlockSizes | None = None,
    causal: bool = True,
) -> tuple[jax.Array, jax.Array]:  # out [tokens, q_heads, head_dim], lse [tokens, q_heads]
    """Attention of a ragged batch of prefill chunks and decodes over a paged KV cache.

    causal=True: the queries' own K/V are already in the cache (kv_lens counts them); query
    i of sequence s sits at position kv_lens[s] - q_len_s + i and attends keys 0..position.
    causal=False: the pages hold a prefix that lies wholly before the queries (not their
    own K/V); every query of s attends keys 0..kv_lens[s]-1, none if kv_lens[s] is 0.

    Query head h reads KV head h // (q_heads // kv_heads). Queries that see no key, and
    rows past cu_q_lens[num_seqs] (padding), get out 0, lse -inf. lse is the natural-log
    log-sum-exp of the scaled scores, so partial results merge with `merge_attention`.

    impl: "xla" (jnp), "pallas" (native kernel), "interpret" (the kernel in interpret
    mode), "auto" (`dispatch.resolve_impl`: native on GPUs, xla elsewhere). block_sizes:
    None takes the device's defaults (`dispatch.block_sizes_for`).
    """
    check_paged_inputs(q, k_pages, v_pages, page_table)
    max_seqs = page_table.shape[0]
    if cu_q_lens.shape != (max_seqs + 1,) or kv_lens.shape != (max_seqs,) or num_seqs.shape != (1,):
        raise ValueError(
            f"want cu_q_lens [max_seqs + 1], kv_lens [max_seqs], num_seqs [1] with "
            f"max_seqs={max_seqs} (page_table rows); got {cu_q_lens.shape=} {kv_lens.shape=} "
            f"{num_seqs.shape=}")
    impl, block_sizes = choose_attention(impl, block_sizes, head_dim=q.shape[2],
                                         page_size=k_pages.shape[1])
    if impl == "xla":
        return ragged_paged_attention_xla(
            q, k_pages, v_pages, page_table, cu_q_lens, kv_lens, num_seqs,
            sm_scale=sm_scale, block_sizes=block_sizes, causal=causal)
    return ragged_paged_attention_pallas(
        q, k_pages, v_pages, page_table, cu_q_lens, kv_lens, num_seqs,
        sm_scale=sm_scale, block_sizes=block_sizes, interpret=impl == "interpret",
        causal=causal)


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

    num_kv_splits overrides block_sizes.num_kv_splits (the kernel's split-K factor; the
    XLA path ignores it). A sequence with kv_len 0 gets out 0, lse -inf.
    """
    check_paged_inputs(q, k_pages, v_pages, page_table)
    seqs = q.shape[0]
    if page_table.shape[0] != seqs or kv_lens.shape != (seqs,):
        raise ValueError(f"want page_table [{seqs}, pages_per_seq] and kv_lens [{seqs}] for "
                         f"{q.shape=}; got {page_table.shape=} {kv_lens.shape=}")
    impl, block_sizes = choose_attention(impl, block_sizes, head_dim=q.shape[2],
                                         page_size=k_pages.shape[1])
    if num_kv_splits is not None:
        block_sizes = dataclasses.replace(block_sizes, num_kv_splits=num_kv_splits)
    if impl == "xla":
        return decode_attention_xla(q, k_pages, v_pages, page_table, kv_lens,
                                    sm_scale=sm_scale, block_sizes=block_sizes)
    return decode_attention_pallas(q, k_pages, v_pages, page_table, kv_lens,
                                   sm_scale=sm_scale, block_sizes=block_sizes,
                                   interpret=impl == "interpret")
