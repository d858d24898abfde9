"""decode_attention (split-K): the Pallas kernel (interpret) and the XLA path == dense oracle."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import BlockSizes, decode_attention
from pallas_kernels.dense_reference import dense_attention_oracle, random_page_table
from pallas_kernels.dispatch import block_sizes_for
from tests.attention_checks import assert_attention_close

# (q_heads, kv_heads, head_dim, page_size): fixed buffer shapes, one compile each.
SHAPES = [(4, 4, 64, 8), (8, 2, 128, 4), (12, 4, 64, 16)]
SEQS, PAGES_PER_SEQ = 6, 12


def make_decode_batch(seed, shapes, kv_lens, dtype=np.float32):
    q_heads, kv_heads, head_dim, page_size = shapes
    rng = np.random.default_rng(seed)
    num_pages = SEQS * PAGES_PER_SEQ + 1
    cache_shape = (num_pages, page_size, kv_heads, head_dim)
    return dict(
        q=rng.standard_normal((SEQS, q_heads, head_dim)).astype(dtype),
        k_pages=rng.standard_normal(cache_shape).astype(dtype),
        v_pages=rng.standard_normal(cache_shape).astype(dtype),
        page_table=random_page_table(rng, kv_lens, max_seqs=SEQS, pages_per_seq=PAGES_PER_SEQ,
                                     page_size=page_size, num_pages=num_pages),
        kv_lens=np.asarray(kv_lens, np.int32))


def oracle(batch, sm_scale):
    """A decode batch is a ragged batch with one query per sequence."""
    seqs = batch["q"].shape[0]
    return dense_attention_oracle(
        batch["q"], batch["k_pages"], batch["v_pages"], batch["page_table"],
        cu_q_lens=np.arange(seqs + 1), kv_lens=batch["kv_lens"], num_seqs=[seqs],
        sm_scale=sm_scale)


@st.composite
def decode_batches(draw):
    shapes = draw(st.sampled_from(SHAPES))
    max_context = PAGES_PER_SEQ * shapes[3]
    # Empty caches (kv_len 0), one key, and full page tables all occur.
    kv_lens = draw(st.lists(st.one_of(st.integers(0, max_context), st.sampled_from(
        [0, 1, max_context])), min_size=SEQS, max_size=SEQS))
    return shapes, draw(st.integers(0, 2**31 - 1)), kv_lens


@settings(max_examples=12, deadline=None)
@given(batch_spec=decode_batches(), num_kv_splits=st.sampled_from([1, 4]))
def test_kernel_and_xla_equal_dense_oracle(batch_spec, num_kv_splits):
    shapes, seed, kv_lens = batch_spec
    batch = make_decode_batch(seed, shapes, kv_lens)
    sm_scale = shapes[2] ** -0.5
    want = oracle(batch, sm_scale)
    tiling = BlockSizes(block_q=1, kv_pages_per_block=2, num_kv_splits=1)
    for impl in ("xla", "interpret"):
        out, lse = decode_attention(**batch, sm_scale=sm_scale, impl=impl, block_sizes=tiling,
                                    num_kv_splits=num_kv_splits)
        assert out.shape == batch["q"].shape and lse.shape == batch["q"].shape[:2]
        assert_attention_close(out, lse, *want)


def test_more_splits_than_tiles_and_default_tiles():
    """Splits with no tile to do write out 0 / lse -inf and drop out of the merge."""
    shapes = SHAPES[1]
    batch = make_decode_batch(7, shapes, [3, 0, 48, 17, 1, 30])
    want = oracle(batch, 0.1)
    out, lse = decode_attention(**batch, sm_scale=0.1, impl="interpret", num_kv_splits=16)
    assert_attention_close(out, lse, *want)
    out, lse = decode_attention(**batch, sm_scale=0.1)   # auto: the XLA path, CPU tiles
    assert_attention_close(out, lse, *want)


def test_bfloat16():
    import jax.numpy as jnp
    shapes = SHAPES[2]
    batch = make_decode_batch(2, shapes, [5, 100, 192, 0, 64, 33])
    bf16 = {k: v.astype(jnp.bfloat16) if v.dtype == np.float32 else v for k, v in batch.items()}
    rounded = {**batch, **{k: np.asarray(bf16[k], np.float32) for k in ("q", "k_pages", "v_pages")}}
    want = oracle(rounded, 0.125)
    for impl in ("xla", "interpret"):
        out, lse = decode_attention(**bf16, sm_scale=0.125, impl=impl,
                                    block_sizes=block_sizes_for("interpret", "cpu", 64, 16))
        assert out.dtype == jnp.bfloat16
        assert_attention_close(np.asarray(out, np.float32), lse, *want, atol=2e-2)


def test_shape_errors_name_the_values():
    batch = make_decode_batch(0, SHAPES[0], [1] * SEQS)
    with pytest.raises(ValueError, match=r"kv_lens.shape=\(5,\)"):
        decode_attention(**{**batch, "kv_lens": batch["kv_lens"][:5]}, sm_scale=1.0)
    with pytest.raises(ValueError, match="num_kv_splits must be a positive int, got 0"):
        decode_attention(**batch, sm_scale=1.0, num_kv_splits=0)
