"""ragged_paged_attention: the Pallas kernel (interpret mode) and the XLA path == dense oracle.

Buffers have a few fixed shapes (one compile per shape, tiling and mode); hypothesis draws
what varies at run time in the engine: how many sequences, their chunk lengths (decodes and
1-token chunks included), their contexts (empty ones included), where their pages live,
and the data.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import (BlockSizes, merge_attention, order_decodes_first,
                            ragged_paged_attention)
from pallas_kernels.dense_reference import dense_attention_oracle
from pallas_kernels.paged_kernel import kernel_rows, paged_attention_blocks
from pallas_kernels.query_blocks import plan_query_blocks
from tests.attention_checks import (Shapes, as_bfloat16, assert_matches_oracle, decodes_first,
                                    make_batch, mark_kernels, ragged_batches)

SHAPES = [
    Shapes(q_heads=4, kv_heads=4, head_dim=64, page_size=4),    # multi-head
    Shapes(q_heads=8, kv_heads=2, head_dim=64, page_size=8),    # GQA 4
    Shapes(q_heads=6, kv_heads=2, head_dim=128, page_size=4),   # GQA 3: padded kernel rows
    Shapes(q_heads=8, kv_heads=1, head_dim=128, page_size=16),  # multi-query
]
# Small tiles so a few dozen tokens span several query blocks, K/V tiles and KV splits.
TILINGS = [
    BlockSizes(block_q=4, kv_pages_per_block=2, num_kv_splits=3),
    BlockSizes(block_q=8, kv_pages_per_block=1, num_kv_splits=1),
]
IMPLS = ("xla", "interpret")


def check_against_oracle(batch_spec, *, causal):
    shapes, seed, q_lens, contexts = batch_spec
    # One tiling per buffer shape keeps it to one compile per shape, implementation and mode.
    tiling = TILINGS[SHAPES.index(shapes) % len(TILINGS)]
    batch = make_batch(seed, shapes, q_lens, contexts, causal=causal)
    sm_scale = shapes.head_dim ** -0.5
    for impl in IMPLS:
        out, lse = ragged_paged_attention(**batch, sm_scale=sm_scale, impl=impl,
                                          block_sizes=tiling, causal=causal)
        assert out.shape == batch["q"].shape and out.dtype == jnp.float32
        assert lse.shape == batch["q"].shape[:2] and lse.dtype == jnp.float32
        assert_matches_oracle(out, lse, batch, sm_scale, causal=causal)


@settings(max_examples=14, deadline=None)
@given(batch_spec=ragged_batches(tuple(SHAPES)))
def test_causal_equals_dense_oracle(batch_spec):
    check_against_oracle(batch_spec, causal=True)


@settings(max_examples=14, deadline=None)
@given(batch_spec=ragged_batches(tuple(SHAPES), causal=False))
def test_prefix_equals_dense_oracle(batch_spec):
    """causal=False: every query sees the whole cached prefix, none if it is empty."""
    check_against_oracle(batch_spec, causal=False)


@pytest.mark.parametrize("impl", IMPLS)
def test_prefix_with_empty_and_full_contexts(impl):
    """kv_len 0 rows (chunk and decode) give 0 / -inf; the non-causal result differs from
    the causal one on the same buffers (the mask is really off)."""
    shapes = SHAPES[1]
    batch = make_batch(8, shapes, [5, 1, 7, 1], [0, 0, 80, 13], causal=False)
    out, lse = ragged_paged_attention(**batch, sm_scale=0.125, impl=impl,
                                      block_sizes=TILINGS[0], causal=False)
    assert_matches_oracle(out, lse, batch, 0.125, causal=False)
    assert (np.asarray(out)[:6] == 0).all() and np.isneginf(np.asarray(lse)[:6]).all()
    causal_lse = ragged_paged_attention(**batch, sm_scale=0.125, impl=impl,
                                        block_sizes=TILINGS[0])[1]
    chunk = slice(6, 12)      # the 7-token chunk over 80 keys: causal sees 74..80 of them
    assert not np.allclose(np.asarray(lse)[chunk], np.asarray(causal_lse)[chunk])


@pytest.mark.parametrize("impl", IMPLS)
def test_prefix_and_own_chunk_merge_into_causal(impl):
    """The KV-parallel identity: a chunk's causal attention over context + itself is the
    LSE merge of its non-causal attention over the context and its causal attention over
    its own keys alone (contexts whole pages, so its own keys start a page)."""
    shapes = SHAPES[1]
    q_lens, contexts = [6, 1, 11], [16, 40, 0]
    batch = make_batch(3, shapes, q_lens, contexts)
    run = lambda **kw: ragged_paged_attention(**{**batch, **kw}, sm_scale=0.125, impl=impl,
                                              block_sizes=TILINGS[0])
    whole = run()
    context_lens = np.zeros_like(batch["kv_lens"])
    context_lens[:3] = contexts
    prefix = run(kv_lens=context_lens, causal=False)
    own_table = np.zeros_like(batch["page_table"])
    own_lens = np.zeros_like(batch["kv_lens"])
    for s, (n, c) in enumerate(zip(q_lens, contexts)):
        own_pages = batch["page_table"][s, c // shapes.page_size:]
        own_table[s, : own_pages.size] = own_pages
        own_lens[s] = n
    own = run(page_table=own_table, kv_lens=own_lens)
    out, lse = merge_attention(jnp.stack([prefix[0], own[0]]),
                               jnp.stack([prefix[1], own[1]]))
    np.testing.assert_allclose(np.asarray(out), np.asarray(whole[0]), atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(whole[1]), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_padding_tail_after_a_full_batch_ending_in_a_decode(impl):
    """Every sequence slot in use and the last one a decode: the padding tokens after it
    must not be mistaken for that sequence's queries."""
    shapes = SHAPES[1]
    batch = make_batch(4, shapes, [6, 1, 9, 2, 1], [10, 33, 0, 5, 70])
    out, lse = ragged_paged_attention(**batch, sm_scale=0.125, impl=impl,
                                      block_sizes=TILINGS[0])
    assert_matches_oracle(out, lse, batch, 0.125)


def test_bfloat16_inputs():
    shapes = SHAPES[1]
    batch = make_batch(3, shapes, [1, 9, 17], [30, 0, 40])
    bf16, rounded = as_bfloat16(batch)    # the oracle sees the bf16-rounded inputs
    for impl in IMPLS:
        out, lse = ragged_paged_attention(**bf16, sm_scale=0.125, impl=impl,
                                          block_sizes=TILINGS[0])
        assert out.dtype == jnp.bfloat16
        assert_matches_oracle(np.asarray(out, np.float32), lse, rounded, 0.125, atol=2e-2)


@pytest.mark.parametrize("causal", [True, False])
def test_kernel_writes_every_output_element(causal):
    """Interpret mode starts kernel outputs as NaN, so an unwritten element (an empty query
    block, an idle KV split, padding rows) would survive as NaN."""
    shapes = SHAPES[2]
    batch = make_batch(5, shapes, [1, 3], [0, 2], causal=causal)  # mostly empty blocks, splits
    tiling = TILINGS[0]
    q_per_kv = shapes.q_heads // shapes.kv_heads
    plan = plan_query_blocks(jnp.asarray(batch["cu_q_lens"]), jnp.asarray(batch["kv_lens"]),
                             jnp.asarray(batch["num_seqs"]), num_tokens=shapes.num_tokens,
                             block_q=tiling.block_q)
    num_blocks = plan.seq.shape[0]
    rows = kernel_rows(tiling.block_q, q_per_kv)
    q_blocks = jnp.ones((num_blocks, shapes.kv_heads, rows, shapes.head_dim))
    out, lse = paged_attention_blocks(
        q_blocks, batch["k_pages"], batch["v_pages"], batch["page_table"], plan.seq,
        plan.key_end(causal), plan.num_tokens, sm_scale=0.1, q_per_kv=q_per_kv,
        block_sizes=tiling, interpret=True, causal=causal)
    assert not np.isnan(np.asarray(out)).any() and not np.isnan(np.asarray(lse)).any()
    empty = np.asarray(plan.num_tokens) == 0
    assert empty.any() and np.isneginf(np.asarray(lse)[empty]).all()


def test_shape_and_impl_errors_name_the_values():
    batch = make_batch(0, SHAPES[1], [3], [4])
    with pytest.raises(ValueError, match="q_heads=8 must be a multiple of kv_heads=3"):
        three_heads = np.concatenate([batch["k_pages"], batch["k_pages"][:, :, :1]], axis=2)
        ragged_paged_attention(**{**batch, "k_pages": three_heads, "v_pages": three_heads},
                               sm_scale=1.0)
    with pytest.raises(ValueError, match="kv_lens.shape=\\(4,\\)"):
        ragged_paged_attention(**{**batch, "kv_lens": batch["kv_lens"][:4]}, sm_scale=1.0)
    with pytest.raises(ValueError, match="impl='reference' must be one of"):
        ragged_paged_attention(**batch, sm_scale=1.0, impl="reference")


# The decode/prefill split (num_decodes): decodes first, then chunks; prefill blocks of
# prefill_rows rows (here 32: 8 tokens at GQA 4, twice block_q).
SPLIT_TILING = BlockSizes(block_q=4, kv_pages_per_block=2, num_kv_splits=3, prefill_rows=32)


@settings(max_examples=5, deadline=None)
@given(batch_spec=ragged_batches(tuple(SHAPES[1:3])), causal=st.booleans())
def test_decode_prefill_split_equals_dense_oracle(batch_spec, causal):
    """num_decodes routes the leading decodes to the decode kernel and the chunks to the
    ragged kernel's prefill-sized blocks; the result is the oracle's, on either mode.
    (The XLA path finds its decodes itself and ignores num_decodes.)"""
    shapes, seed, q_lens, contexts = batch_spec
    q_lens, contexts, num_decodes = decodes_first(q_lens, contexts)
    batch = make_batch(seed, shapes, q_lens, contexts, causal=causal)
    sm_scale = shapes.head_dim ** -0.5
    out, lse = ragged_paged_attention(**batch, sm_scale=sm_scale, impl="interpret",
                                      block_sizes=SPLIT_TILING, causal=causal,
                                      num_decodes=num_decodes)
    assert_matches_oracle(out, lse, batch, sm_scale, causal=causal)


def test_order_decodes_first():
    assert order_decodes_first([5, 1, 3, 1, 1, 2]) == ([1, 3, 4, 0, 2, 5], 3)
    assert order_decodes_first([]) == ([], 0)


def test_decode_sequences_run_the_decode_kernel(monkeypatch):
    """Which kernel served which token: each kernel is wrapped to add its own offset to
    its output. With num_decodes every decode token (and no other) carries the decode
    kernel's mark, every chunk token the ragged kernel's; without it, all tokens go
    through the ragged kernel. A decode-only batch never sees the ragged kernel's mark."""
    from pallas_kernels import attention
    mark_kernels(monkeypatch, attention, {"decode_attention_pallas": 100.0,
                                          "ragged_paged_attention_pallas": 1000.0})
    jax.clear_caches()   # the jitted entry point must trace the wrapped kernels
    try:
        shapes = SHAPES[1]
        q_lens, contexts, num_decodes = decodes_first([7, 1, 12, 1, 1], [20, 33, 0, 5, 70])
        batch = make_batch(6, shapes, q_lens, contexts)
        want, _ = dense_attention_oracle(**batch, sm_scale=0.125)
        out, _ = ragged_paged_attention(**batch, sm_scale=0.125, impl="interpret",
                                        block_sizes=SPLIT_TILING, num_decodes=num_decodes)
        out = np.asarray(out)
        np.testing.assert_allclose(out[:3], want[:3] + 100.0, atol=2e-4)      # 3 decodes
        np.testing.assert_allclose(out[3:22], want[3:22] + 1000.0, atol=2e-4)  # 2 chunks
        out, _ = ragged_paged_attention(**batch, sm_scale=0.125, impl="interpret",
                                        block_sizes=SPLIT_TILING)
        np.testing.assert_allclose(np.asarray(out)[:22], want[:22] + 1000.0, atol=2e-4)

        decodes = make_batch(7, shapes, [1] * 5, [9, 0, 40, 3, 77])
        want, _ = dense_attention_oracle(**decodes, sm_scale=0.125)
        out, _ = ragged_paged_attention(**decodes, sm_scale=0.125, impl="interpret",
                                        block_sizes=SPLIT_TILING,
                                        num_decodes=np.array([5], np.int32))
        np.testing.assert_allclose(np.asarray(out)[:5], want[:5] + 100.0, atol=2e-4)
    finally:
        monkeypatch.undo()
        jax.clear_caches()
