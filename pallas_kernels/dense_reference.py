"""Obviously-correct attention for tests and benchmarks; never used to serve.

`dense_attention_oracle` is numpy in float64, per sequence, per head, one softmax over an
explicitly gathered context: the opposite of the kernel and the XLA path, which tests
check against it. `random_page_table` lays out test and benchmark caches. Nothing else in
pallas_kernels imports this module.
"""

from __future__ import annotations

import math

import numpy as np


def dense_attention_oracle(q, k_pages, v_pages, page_table, cu_q_lens, kv_lens, num_seqs, *,
                           sm_scale: float, causal: bool = True,
                           sliding_window: int | None = None,
                           window_starts=None) -> tuple[np.ndarray, np.ndarray]:
    """Ragged paged attention in float64 numpy.

    Same arguments and result as `ragged_paged_attention` (out [tokens, q_heads, head_dim],
    lse [tokens, q_heads]); a decode batch is the case q_len = 1 for every sequence.
    causal: query i of n sees keys 0..kv_len - n + i; otherwise every query sees keys
    0..kv_len-1. sliding_window: only the last that many of the keys a query sees;
    window_starts [tokens] (non-causal): query t sees keys window_starts[t]..kv_len-1.
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
            seen = kv_len - (end - start) + i + 1 if causal else kv_len
            if seen <= 0:  # a query with no key (an empty cache)
                continue
            first = 0 if sliding_window is None else max(0, seen - sliding_window)
            if window_starts is not None:
                first = int(window_starts[t])
            if first >= seen:
                continue
            for h in range(q_heads):
                kv_head = h // (q_heads // kv_heads)
                scores = keys[first:seen, kv_head] @ q[t, h] * sm_scale
                top = scores.max()
                weights = np.exp(scores - top)
                out[t, h] = weights @ values[first:seen, kv_head] / weights.sum()
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
