"""merge_attention: partial attention over disjoint key sets merges into attention over all."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import decode_attention, merge_attention
from pallas_kernels.dense_reference import dense_attention_oracle, random_page_table


def numpy_attention(q, k, v, scale):
    """q [tokens, heads, d], k/v [keys, heads, d] -> out [tokens, heads, d], lse [tokens, heads];
    no keys -> 0 / -inf."""
    if k.shape[0] == 0:
        return np.zeros_like(q), np.full(q.shape[:2], -np.inf)
    scores = np.einsum("thd,khd->thk", q, k) * scale
    top = scores.max(-1, keepdims=True)
    weights = np.exp(scores - top)
    total = weights.sum(-1)
    return np.einsum("thk,khd->thd", weights, v) / total[..., None], top[..., 0] + np.log(total)


MAX_PARTS = 6


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), num_keys=st.integers(1, 64),
       parts=st.integers(1, MAX_PARTS), head_dim=st.sampled_from([64, 128]),
       logit_scale=st.sampled_from([0.1, 1.0, 30.0]))
def test_merge_of_random_key_split_equals_whole(seed, num_keys, parts, head_dim, logit_scale):
    """Keys are dealt at random to `parts` parts (not contiguous; some may get none); the
    buffer always holds MAX_PARTS parts (one compile), the unused ones empty."""
    rng = np.random.default_rng(seed)
    tokens, heads = 3, 2
    q = rng.standard_normal((tokens, heads, head_dim))
    k = rng.standard_normal((num_keys, heads, head_dim))
    v = rng.standard_normal((num_keys, heads, head_dim))
    owner = rng.integers(0, parts, size=num_keys)
    scale = logit_scale / head_dim ** 0.5
    partial = [numpy_attention(q, k[owner == p], v[owner == p], scale) for p in range(MAX_PARTS)]
    outs = jnp.asarray(np.stack([o for o, _ in partial]), jnp.float32)
    lses = jnp.asarray(np.stack([l for _, l in partial]), jnp.float32)
    out, lse = merge_attention(outs, lses)
    want_out, want_lse = numpy_attention(q, k, v, scale)
    np.testing.assert_allclose(np.asarray(out), want_out, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=2e-5, rtol=1e-5)


def test_merge_of_kv_shards_of_a_paged_cache():
    """KV-cache parallelism: each shard holds some of a sequence's pages and runs the decode
    kernel on them; merging the shards equals decoding over the whole cache."""
    rng = np.random.default_rng(1)
    seqs, q_heads, kv_heads, head_dim, page_size, pages_per_seq = 3, 8, 2, 64, 4, 12
    kv_lens = np.array([45, 9, 30], np.int32)
    num_pages = seqs * pages_per_seq
    page_table = random_page_table(rng, kv_lens, max_seqs=seqs, pages_per_seq=pages_per_seq,
                                   page_size=page_size, num_pages=num_pages)
    q = rng.standard_normal((seqs, q_heads, head_dim)).astype(np.float32)
    k_pages, v_pages = rng.standard_normal((2, num_pages, page_size, kv_heads, head_dim)
                                           ).astype(np.float32)
    # Three shards; a sequence's pages are dealt round-robin, its last (partial) page stays
    # last in its shard so that shard's kv_len counts the partial page correctly.
    shards = 3
    shard_tables = np.zeros((shards, seqs, pages_per_seq), np.int32)
    shard_lens = np.zeros((shards, seqs), np.int32)
    for s in range(seqs):
        n_pages = -(-kv_lens[s] // page_size)
        for p in range(n_pages):
            shard = p % shards
            slot = p // shards
            shard_tables[shard, s, slot] = page_table[s, p]
            shard_lens[shard, s] += min(page_size, kv_lens[s] - p * page_size)
    outs, lses = [], []
    for shard in range(shards):
        o, l = decode_attention(q, k_pages, v_pages, shard_tables[shard], shard_lens[shard],
                                sm_scale=0.125, impl="interpret", num_kv_splits=2)
        outs.append(o)
        lses.append(l)
    out, lse = merge_attention(jnp.stack(outs), jnp.stack(lses))
    want_out, want_lse = dense_attention_oracle(q, k_pages, v_pages, page_table,
                                                np.arange(seqs + 1), kv_lens, [seqs],
                                                sm_scale=0.125)
    np.testing.assert_allclose(np.asarray(out), want_out, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=2e-5, rtol=1e-5)


def test_all_parts_empty_gives_zero_and_neg_inf_without_nan():
    outs = jnp.full((3, 2, 4, 64), jnp.nan)        # garbage where no key was seen
    lses = jnp.full((3, 2, 4), -jnp.inf)
    out, lse = merge_attention(outs, lses)
    assert (np.asarray(out) == 0).all() and np.isneginf(np.asarray(lse)).all()


def test_empty_part_with_garbage_output_is_ignored():
    rng = np.random.default_rng(0)
    out_a = rng.standard_normal((2, 3, 64)).astype(np.float32)
    lse_a = rng.standard_normal((2, 3)).astype(np.float32)
    outs = jnp.stack([jnp.asarray(out_a), jnp.full((2, 3, 64), jnp.nan)])
    lses = jnp.stack([jnp.asarray(lse_a), jnp.full((2, 3), -jnp.inf)])
    out, lse = merge_attention(outs, lses)
    np.testing.assert_allclose(np.asarray(out), out_a, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), lse_a, rtol=1e-6)


def test_keeps_dtype_and_rejects_bad_shapes():
    outs = jnp.zeros((2, 3, 4, 64), jnp.bfloat16)
    out, lse = merge_attention(outs, jnp.zeros((2, 3, 4)))
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(lse), np.log(2.0), rtol=1e-6)
    with pytest.raises(ValueError, match=r"lses.shape=\(2, 3\)"):
        merge_attention(outs, jnp.zeros((2, 3)))
