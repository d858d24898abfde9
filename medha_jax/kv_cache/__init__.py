"""Paged KV cache bookkeeping: which pages each request holds, and the prefix cache."""

from medha_jax.kv_cache.allocator import BlockAllocator, Segment, num_pages_for_memory

__all__ = ["BlockAllocator", "Segment", "num_pages_for_memory"]
