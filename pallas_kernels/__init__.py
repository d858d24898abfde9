"""Attention kernels (Pallas) and their pure-jnp references.

    out, lse = ragged_paged_attention(q, k_pages, v_pages, page_table, cu_q_lens, kv_lens,
                                      num_seqs, sm_scale=head_dim ** -0.5)
    out, lse = decode_attention(q, k_pages, v_pages, page_table, kv_lens, sm_scale=...)
    out, lse = merge_attention(outs, lses)      # exact LSE merge of partial attention

`impl="auto"` runs the native Pallas kernel on GPUs and the jnp reference elsewhere; the
choice of implementation and tile sizes lives in `block_sizes.resolve`.
"""

from pallas_kernels.block_sizes import BlockSizes, default_block_sizes
from pallas_kernels.decode_attention import decode_attention
from pallas_kernels.merge import merge_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.reference import (decode_attention_reference, dense_attention_oracle,
                                      ragged_paged_attention_reference)

__all__ = [
    "BlockSizes",
    "decode_attention",
    "decode_attention_reference",
    "default_block_sizes",
    "dense_attention_oracle",
    "merge_attention",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
]
