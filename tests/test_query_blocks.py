"""plan_query_blocks: every query in exactly one block of its own sequence, within the
static bound; the keys each block and row sees."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.query_blocks import (max_query_blocks, plan_query_blocks, row_key_ends,
                                         segment_of)

MAX_SEQS, NUM_TOKENS = 6, 48


def ragged_lens(q_lens, kv_lens):
    """cu_q_lens [MAX_SEQS + 1], kv_lens [MAX_SEQS], num_seqs [1] for the sequences given."""
    n = len(q_lens)
    cu = np.full(MAX_SEQS + 1, sum(q_lens), np.int32)
    cu[: n + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    kv = np.zeros(MAX_SEQS, np.int32)
    kv[:n] = kv_lens
    return cu, kv, np.array([n], np.int32)


@settings(max_examples=30, deadline=None)
@given(q_lens=st.lists(st.integers(0, 20), min_size=1, max_size=MAX_SEQS).filter(
           lambda q: sum(q) <= NUM_TOKENS),
       block_q=st.sampled_from([1, 4, 8]), min_q_len=st.sampled_from([1, 2]),
       extra=st.lists(st.integers(0, 30), min_size=MAX_SEQS, max_size=MAX_SEQS))
def test_plan_covers_every_planned_token_once(q_lens, block_q, min_q_len, extra):
    kv_lens = [n + e for n, e in zip(q_lens, extra)]
    cu, kv, num_seqs = ragged_lens(q_lens, kv_lens)
    plan = jax.tree.map(np.asarray, plan_query_blocks(
        jnp.asarray(cu), jnp.asarray(kv), jnp.asarray(num_seqs), num_tokens=NUM_TOKENS,
        block_q=block_q, min_q_len=min_q_len))
    planned = [n >= min_q_len for n in q_lens]
    assert plan.seq.shape[0] == max_query_blocks(NUM_TOKENS, MAX_SEQS, block_q)
    assert plan.count == sum(-(-n // block_q) for n, p in zip(q_lens, planned) if p)
    covered = np.zeros(NUM_TOKENS, int)
    for b in range(plan.count):
        s = plan.seq[b]
        assert 0 < plan.num_tokens[b] <= block_q and plan.kv_len[b] == kv_lens[s]
        end = plan.first_token[b] + plan.num_tokens[b]
        assert cu[s] <= plan.first_token[b] and end <= cu[s + 1]
        offset = plan.first_token[b] - cu[s]
        assert plan.first_pos[b] == kv_lens[s] - q_lens[s] + offset
        covered[plan.first_token[b]: plan.first_token[b] + plan.num_tokens[b]] += 1
    assert (plan.num_tokens[plan.count:] == 0).all()
    want = np.zeros(NUM_TOKENS, int)
    for s, n in enumerate(q_lens):
        want[cu[s]: cu[s] + n] = planned[s]
    np.testing.assert_array_equal(covered, want)
    np.testing.assert_array_equal(plan.token_valid, want.astype(bool))
    t = np.flatnonzero(want)
    assert (plan.first_token[plan.token_block[t]] + plan.token_row[t] == t).all()


def test_key_end_and_row_key_ends():
    # Sequence 0: 5 queries after 3 cached keys (kv_len 8); sequence 1: a 3-token prefix
    # layout where kv_len counts only the prefix.
    cu, kv, num_seqs = ragged_lens([5, 3], [8, 3])
    plan = plan_query_blocks(jnp.asarray(cu), jnp.asarray(kv), jnp.asarray(num_seqs),
                             num_tokens=NUM_TOKENS, block_q=4)
    np.testing.assert_array_equal(np.asarray(plan.key_end(True))[:4], [7, 8, 3, 0])
    np.testing.assert_array_equal(np.asarray(plan.key_end(False))[:4], [8, 8, 3, 0])
    rows = jnp.arange(4, dtype=jnp.int32)
    # Block 0 holds queries at positions 3..6: causal, they see 4..7 keys.
    np.testing.assert_array_equal(row_key_ends(jnp.int32(7), jnp.int32(4), rows, causal=True),
                                  [4, 5, 6, 7])
    np.testing.assert_array_equal(row_key_ends(jnp.int32(8), jnp.int32(4), rows, causal=False),
                                  [8, 8, 8, 8])


def test_segment_of_and_bound():
    ends = jnp.asarray([2, 2, 5, 9])
    np.testing.assert_array_equal(segment_of(jnp.arange(11), ends),
                                  [0, 0, 2, 2, 2, 3, 3, 3, 3, 3, 3])
    assert max_query_blocks(10, 4, 4) == 5    # e.g. q_lens 1, 1, 1, 7: 1 + 1 + 1 + 2 blocks
    assert max_query_blocks(3, 8, 16) == 3    # never more than one block per token


def test_first_seq_leaves_out_the_leading_sequences():
    """first_seq (the decode/prefill split): sequences before it get no block and their
    tokens are not valid; the others are planned as without it."""
    cu, kv, num_seqs = ragged_lens([1, 1, 9, 4], [5, 7, 20, 4])
    both = plan_query_blocks(cu, kv, num_seqs, num_tokens=NUM_TOKENS, block_q=4)
    plan = plan_query_blocks(cu, kv, num_seqs, num_tokens=NUM_TOKENS, block_q=4,
                             first_seq=jnp.int32(2))
    assert int(plan.count) == int(both.count) - 2 == 4
    assert np.asarray(plan.seq)[:4].tolist() == [2, 2, 2, 3]
    valid = np.asarray(plan.token_valid)
    assert not valid[:2].any() and valid[2:15].all() and not valid[15:].any()
