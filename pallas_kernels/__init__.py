"""Attention kernels (Pallas) and the XLA path beside them.

    out, lse = ragged_paged_attention(q, k_pages, v_pages, page_table, cu_q_lens, kv_lens,
                                      num_seqs, sm_scale=head_dim ** -0.5, causal=True)
    out, lse = decode_attention(q, k_pages, v_pages, page_table, kv_lens, sm_scale=...)
    out, lse = merge_attention(outs, lses)      # exact LSE merge of partial attention
    order, n = order_decodes_first(q_lens)      # decodes first, then pass num_decodes=[n]

One module per role:
    attention       the public entry points above
    dispatch        impl "auto" | "xla" | "pallas" | "interpret" | "pallas-tpu" |
                    "interpret-tpu" -> a concrete one, and its tiles
    block_sizes     BlockSizes, the tile table per device kind, the Triton and Mosaic tile
                    constraints
    paged_kernel    the GPU (Triton) kernel and its ragged and decode wrappers
    tpu_paged_kernel the Mosaic-TPU kernel (scalar prefetch, DMA) and its wrappers
    xla_attention   the same attention in plain jnp (CPUs, TPUs)
    query_blocks    cutting a ragged batch into per-sequence query blocks (kernel and XLA)
    merge           LSE merge and the online-softmax step (kernel and XLA)
    dense_reference the float64 numpy oracle and random page tables: tests and benchmarks
                    only; nothing here imports it
"""

from pallas_kernels.attention import (decode_attention, order_decodes_first,
                                     ragged_paged_attention)
from pallas_kernels.block_sizes import BlockSizes
from pallas_kernels.merge import merge_attention

__all__ = [
    "BlockSizes",
    "decode_attention",
    "merge_attention",
    "order_decodes_first",
    "ragged_paged_attention",
]
