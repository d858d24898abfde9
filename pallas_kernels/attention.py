"""The public attention entry points: check shapes, choose the implementation and tiles
(`dispatch.choose_attention`), and call a Pallas kernel (GPU or TPU) or the XLA path.

Decode and prefill paths: a caller that orders each step's sequences decodes first
(`order_decodes_first`) passes num_decodes to `ragged_paged_attention`; then, all in one
compiled program (num_decodes is traced):

- prefill chunks go to the ragged kernel in query blocks of `BlockSizes.prefill_block_q`
  tokens (about prefill_rows kernel rows), so a long chunk reads each K/V tile once per
  block of many rows;
- decodes go to the decode path. GPU: the split-K decode kernel (`decode_attention_pallas`),
  one program per (sequence, KV head, KV split), its rows the GQA group, the splits merged
  by LSE. TPU: no second kernel: `decode_attention_tpu` runs the same Mosaic kernel again
  with one-token query blocks of block_q tokens (never the prefill-sized ones), one
  program per (KV head, sequence), no KV splits (the grid is a sequential loop there).

One decode per program, not several as the issue's text has it: sequences share no K/V,
so the rows of a second sequence in a program would reuse no tile the first loads (the
matmul would compute cross-sequence scores only to mask them), and a decode is bound by
the HBM bytes of its K/V, which packing does not reduce. Looping over several sequences
inside a program instead makes fewer, longer programs: fewer loads in flight to hide HBM
latency, and worse balance when contexts differ. Packing would only save each program's
fixed cost: small on a GPU (the whole grid is one launch); on a TPU a fixed cost per grid
step times sequences x KV heads (DMA latency is not part of it: the kernel prefetches the
next program's first tile), whether that pays is for benchmarks/kernels.py on a TPU.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp

from pallas_kernels.block_sizes import BlockSizes
from pallas_kernels.dispatch import choose_attention
from pallas_kernels.paged_kernel import (MIN_GRID_PROGRAMS, decode_attention_pallas,
                                         ragged_paged_attention_pallas)
from pallas_kernels.tpu_paged_kernel import decode_attention_tpu, ragged_paged_attention_tpu
from pallas_kernels.xla_attention import decode_attention_xla, ragged_paged_attention_xla


def _interpret_of(impl: str):
    """The interpret argument of the kernel `impl` runs: False (native), True (Pallas
    interpret mode), or the TPU interpreter's parameters."""
    if impl == "interpret-tpu":
        from jax.experimental.pallas import tpu as pltpu
        return pltpu.InterpretParams()
    return impl == "interpret"


def _ragged_kernel(impl: str):
    return ragged_paged_attention_tpu if impl in ("pallas-tpu", "interpret-tpu") else \
        ragged_paged_attention_pallas


def _decode_kernel(impl: str):
    return decode_attention_tpu if impl in ("pallas-tpu", "interpret-tpu") else \
        decode_attention_pallas


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


def _split_decode_prefill(impl, q, k_pages, v_pages, page_table, cu_q_lens, kv_lens,
                          num_seqs, num_decodes, *, sm_scale, block_sizes, causal,
                          sliding_window, window_starts):
    """Sequences 0..num_decodes-1 (one token each, tokens 0..num_decodes-1) through the
    decode path (GPU: the decode kernel; TPU: the ragged kernel in one-token blocks; see
    the module docstring), the others through the ragged kernel with prefill-sized query
    blocks.

    Static shapes: the decode batch is the first min(max_seqs, tokens) sequences, those
    past num_decodes given kv_len 0 (no key: no tile read, out 0); the ragged kernel's
    plan skips sequences before num_decodes, so their query blocks are empty.
    """
    num_tokens, q_heads, _ = q.shape
    max_seqs = page_table.shape[0]
    q_per_kv = q_heads // k_pages.shape[2]
    interpret = _interpret_of(impl)
    first_prefill = jnp.minimum(num_decodes[0], num_seqs[0]).astype(jnp.int32)

    prefill_tiles = dataclasses.replace(
        block_sizes, block_q=block_sizes.prefill_block_q(q_per_kv, num_tokens))
    out, lse = _ragged_kernel(impl)(
        q, k_pages, v_pages, page_table, cu_q_lens, kv_lens, num_seqs, sm_scale=sm_scale,
        block_sizes=prefill_tiles, interpret=interpret, causal=causal,
        first_seq=first_prefill, sliding_window=sliding_window, window_starts=window_starts)

    # A decode's single query sees keys 0..kv_len-1, whether causal (it is the last key)
    # or not (the prefix), so the decode kernel serves both modes.
    max_decodes = min(max_seqs, num_tokens)
    is_decode = jnp.arange(max_decodes) < first_prefill
    # KV splits only while sequences x KV heads leave the GPU idle (as the ragged kernel
    # caps them): 256 decodes x 8 heads fill an H100 without any, and every split costs
    # an f32 partial of the whole batch and its share of the merge.
    decode_tiles = dataclasses.replace(block_sizes, num_kv_splits=min(
        block_sizes.num_kv_splits,
        max(1, -(-MIN_GRID_PROGRAMS // (max_decodes * k_pages.shape[2])))))
    decode_out, decode_lse = _decode_kernel(impl)(
        q[:max_decodes], k_pages, v_pages, page_table[:max_decodes],
        jnp.where(is_decode, kv_lens[:max_decodes], 0), sm_scale=sm_scale,
        block_sizes=decode_tiles, interpret=interpret, sliding_window=sliding_window,
        window_starts=None if window_starts is None else window_starts[:max_decodes])
    out = out.at[:max_decodes].set(
        jnp.where(is_decode[:, None, None], decode_out, out[:max_decodes]))
    lse = lse.at[:max_decodes].set(jnp.where(is_decode[:, None], decode_lse, lse[:max_decodes]))
    return out, lse


def order_decodes_first(q_lens: Sequence[int]) -> tuple[list[int], int]:
    """The sequence order `ragged_paged_attention`'s num_decodes expects: (order,
    num_decodes), order listing the indices of the sequences with one query token first,
    then the others, each group in its given order (as tpu-inference's `distribution`).
    A host-side helper for whoever builds step inputs: lay q, cu_q_lens, kv_lens and the
    page table rows out in this order and pass num_decodes = [num_decodes]."""
    decodes = [i for i, n in enumerate(q_lens) if n == 1]
    return decodes + [i for i, n in enumerate(q_lens) if n != 1], len(decodes)


@functools.partial(jax.jit, static_argnames=("sm_scale", "impl", "block_sizes", "causal",
                                             "sliding_window"))
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
    num_decodes: jax.Array | None = None,  # int32 [1]: see below
    sliding_window: int | None = None,
    window_starts: jax.Array | None = None,  # int32 [tokens]: see below
) -> tuple[jax.Array, jax.Array]:  # out [tokens, q_heads, head_dim], lse [tokens, q_heads]
    """Attention of a ragged batch of prefill chunks and decodes over a paged KV cache.

    causal=True: the queries' own K/V are already in the cache (kv_lens counts them); query
    i of sequence s sits at position kv_lens[s] - q_len_s + i and attends keys 0..position.
    causal=False: the pages hold a prefix that lies wholly before the queries (not their
    own K/V); every query of s attends keys 0..kv_lens[s]-1, none if kv_lens[s] is 0.
    sliding_window (causal only; Mistral): a query at position p attends only keys
    p - sliding_window + 1 .. p; every path skips K/V tiles wholly before a query block's
    window (no copy, no compute).
    window_starts (causal=False only): the first of its sequence's keys each query attends,
    for a window the caller maps from absolute positions into pages that hold only part of
    a sequence (a KV shard's, a cp rank's); a query whose start is kv_len or more sees
    nothing here (out 0, lse -inf), and a block all of whose queries start past its keys
    reads no tile; zeros: no window.

    Query head h reads KV head h // (q_heads // kv_heads). Queries that see no key, and
    rows past cu_q_lens[num_seqs] (padding), get out 0, lse -inf. lse is the natural-log
    log-sum-exp of the scaled scores, so partial results merge with `merge_attention`.

    num_decodes: None, or the number of leading sequences that are decodes: sequences
    0..num_decodes-1 have exactly one query each (so they own tokens 0..num_decodes-1),
    and later ones are prefill chunks of any length (`order_decodes_first`). The kernels
    then serve the decodes on the decode path and the chunks with query blocks of
    block_sizes.prefill_rows rows (module docstring); traced, so one compiled program
    serves every split.
    The XLA path finds its decodes itself (q_len 1) and ignores it. Results are the same
    with or without it.

    impl: "xla" (jnp), "pallas" (the GPU kernel), "interpret" (it in interpret mode),
    "pallas-tpu" (the Mosaic-TPU kernel), "interpret-tpu" (it in the TPU interpreter),
    "auto" (`dispatch.resolve_impl`: the device's kernel on GPUs and TPUs, xla on CPUs).
    block_sizes: None takes the device's defaults (`dispatch.block_sizes_for`).
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
    if num_decodes is not None and num_decodes.shape != (1,):
        raise ValueError(f"num_decodes must be int32 [1], got {num_decodes.shape=}")
    if sliding_window is not None and (not causal or sliding_window <= 0):
        raise ValueError(f"{sliding_window=} needs causal=True and a positive window: a "
                         "prefix's keys do not say the queries' positions")
    if window_starts is not None:
        if causal or window_starts.shape != q.shape[:1]:
            raise ValueError(f"window_starts needs causal=False and the shape [tokens] "
                             f"{q.shape[:1]}, got {causal=} {window_starts.shape=}")
    if impl == "xla":
        return ragged_paged_attention_xla(
            q, k_pages, v_pages, page_table, cu_q_lens, kv_lens, num_seqs,
            sm_scale=sm_scale, block_sizes=block_sizes, causal=causal,
            sliding_window=sliding_window, window_starts=window_starts)
    if num_decodes is not None:
        return _split_decode_prefill(
            impl, q, k_pages, v_pages, page_table, cu_q_lens, kv_lens, num_seqs, num_decodes,
            sm_scale=sm_scale, block_sizes=block_sizes, causal=causal,
            sliding_window=sliding_window, window_starts=window_starts)
    return _ragged_kernel(impl)(
        q, k_pages, v_pages, page_table, cu_q_lens, kv_lens, num_seqs,
        sm_scale=sm_scale, block_sizes=block_sizes, interpret=_interpret_of(impl),
        causal=causal, sliding_window=sliding_window, window_starts=window_starts)


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

    num_kv_splits overrides block_sizes.num_kv_splits (the GPU kernel's split-K factor;
    the XLA path and the TPU kernel ignore it). A sequence with kv_len 0 gets out 0, lse -inf.
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
    return _decode_kernel(impl)(q, k_pages, v_pages, page_table, kv_lens,
                                sm_scale=sm_scale, block_sizes=block_sizes,
                                interpret=_interpret_of(impl))
