"""The Mosaic-TPU kernel in the TPU interpreter == dense oracle, and == JAX's reference.

Not collected by the normal run: the TPU interpreter hangs with the 8 virtual devices the
suite's conftest sets up, so `test_tpu_paged_kernel.py` runs this module in a child
pytest with one device (`--noconftest`, XLA_FLAGS device count 1). Run it by hand with:

    XLA_FLAGS=--xla_force_host_platform_device_count=1 JAX_PLATFORMS=cpu \\
        python -m pytest -q --noconftest tests/tpu_kernel_checks.py

The interpreter runs every DMA, semaphore and grid step in Python callbacks (seconds per
call), so the buffers are small and the hypothesis examples few; what varies is what
varies at run time: sequences, chunk lengths (decodes, 1-token and long chunks), contexts
(empty and full), page placement, data.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import BlockSizes, decode_attention, ragged_paged_attention
from tests.attention_checks import Shapes, assert_matches_oracle, make_batch, ragged_batches

# Page sizes 16..64, GQA 1..8, head dims 64 and 128; 40 tokens, 5 sequences.
SHAPES = (
    Shapes(q_heads=4, kv_heads=4, head_dim=64, page_size=16, pages_per_seq=4),    # GQA 1
    Shapes(q_heads=8, kv_heads=1, head_dim=128, page_size=32, pages_per_seq=3),   # GQA 8
    Shapes(q_heads=6, kv_heads=2, head_dim=64, page_size=64, pages_per_seq=2),    # GQA 3
    Shapes(q_heads=8, kv_heads=2, head_dim=128, page_size=16, pages_per_seq=5),   # GQA 4
)
# Per shape: 8-token blocks with multi-page tiles, or 16-token blocks with one-page tiles.
TILINGS = (BlockSizes(block_q=8, kv_pages_per_block=2), BlockSizes(block_q=16, kv_pages_per_block=1))
IMPL = "interpret-tpu"


def tiling_of(shapes):
    return TILINGS[SHAPES.index(shapes) % len(TILINGS)]


def check(batch_spec, *, causal, split):
    shapes, seed, q_lens, contexts = batch_spec
    if split:   # the decode/prefill split wants decodes first
        q_lens, contexts = zip(*sorted(zip(q_lens, contexts), key=lambda qc: qc[0] != 1))
    batch = make_batch(seed, shapes, q_lens, contexts, causal=causal)
    sm_scale = shapes.head_dim ** -0.5
    num_decodes = np.array([sum(n == 1 for n in q_lens)], np.int32) if split else None
    out, lse = ragged_paged_attention(**batch, sm_scale=sm_scale, impl=IMPL,
                                      block_sizes=tiling_of(shapes), causal=causal,
                                      num_decodes=num_decodes)
    assert out.shape == batch["q"].shape and out.dtype == jnp.float32
    assert lse.shape == batch["q"].shape[:2] and lse.dtype == jnp.float32
    assert_matches_oracle(out, lse, batch, sm_scale, causal=causal)


@settings(max_examples=4, deadline=None)
@given(batch_spec=ragged_batches(SHAPES), split=st.booleans())
def test_causal_equals_dense_oracle(batch_spec, split):
    check(batch_spec, causal=True, split=split)


@settings(max_examples=3, deadline=None)
@given(batch_spec=ragged_batches(SHAPES, causal=False))
def test_prefix_equals_dense_oracle(batch_spec):
    """causal=False (the KV-parallel prefix mode): every query sees the whole prefix."""
    check(batch_spec, causal=False, split=False)


def test_long_chunk_full_context_and_empty_rows():
    """A 32-token chunk over a full page table beside decodes and an empty prefix: several
    query blocks, every tile of the table, and 0 / -inf for the queries with no key."""
    shapes = SHAPES[3]
    batch = make_batch(11, shapes, [1, 32, 1, 6], [79, 48, 0, 0], causal=False)
    out, lse = ragged_paged_attention(**batch, sm_scale=0.1, impl=IMPL,
                                      block_sizes=tiling_of(shapes), causal=False)
    assert_matches_oracle(out, lse, batch, 0.1, causal=False)
    assert (np.asarray(out)[33:40] == 0).all() and np.isneginf(np.asarray(lse)[33:40]).all()


def test_bfloat16():
    shapes = SHAPES[1]
    batch = make_batch(3, shapes, [1, 17, 9], [60, 0, 40])
    bf16 = {k: (v.astype(jnp.bfloat16) if v.dtype == np.float32 else v) for k, v in batch.items()}
    rounded = {k: np.asarray(v, np.float32) if k in ("q", "k_pages", "v_pages") else v
               for k, v in bf16.items()}
    out, lse = ragged_paged_attention(**bf16, sm_scale=0.125, impl=IMPL,
                                      block_sizes=BlockSizes(block_q=16, kv_pages_per_block=2))
    assert out.dtype == jnp.bfloat16
    assert_matches_oracle(np.asarray(out, np.float32), lse, rounded, 0.125, atol=2e-2)


def test_decode_attention_equals_oracle():
    shapes = SHAPES[0]
    kv_lens = [0, 1, 64, 17, 33]
    batch = make_batch(5, shapes, [1] * 5, [n - 1 if n else 0 for n in kv_lens], causal=False)
    batch["kv_lens"] = np.asarray(kv_lens, np.int32)
    batch["q"] = batch["q"][:5]
    out, lse = decode_attention(batch["q"], batch["k_pages"], batch["v_pages"],
                                batch["page_table"], batch["kv_lens"], sm_scale=0.125,
                                impl=IMPL, block_sizes=TILINGS[0])
    batch["cu_q_lens"] = np.arange(6, dtype=np.int32)
    assert_matches_oracle(out, lse, batch, 0.125, causal=False)


def jax_reference(batch, sm_scale):
    """JAX's own ragged paged attention semantics (the jnp reference shipped beside its
    TPU kernel), on its combined [pages, page_size, 2 * kv_heads, head_dim] cache (K even
    heads, V odd). The kernel itself does not run in jax 0.10.2's interpreters (the TPU
    interpreter has no reshaped-ref reads, the generic one fails on its SMEM indexing)."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import (
        ref_ragged_paged_attention)
    num_pages, page_size, kv_heads, head_dim = batch["k_pages"].shape
    kv = np.stack([batch["k_pages"], batch["v_pages"]], axis=3).reshape(
        num_pages, page_size, 2 * kv_heads, head_dim)
    out = ref_ragged_paged_attention(
        jnp.asarray(batch["q"]), jnp.asarray(kv), jnp.asarray(batch["kv_lens"]),
        jnp.asarray(batch["page_table"]), jnp.asarray(batch["cu_q_lens"]),
        jnp.asarray(batch["num_seqs"]), sm_scale=sm_scale)
    return np.asarray(out)


@pytest.mark.slow
def test_equals_jax_reference():
    """Second oracle: JAX's definition of ragged paged attention (causal; out only), on
    GQA 4, head_dim 128, decodes and two chunks, through the decode/prefill split."""
    shape_index = 3
    shapes = SHAPES[shape_index]
    rng = np.random.default_rng(shape_index)
    q_lens = [1, 1, 20, 7]
    contexts = [int(rng.integers(1, shapes.max_context - 20)) for _ in q_lens]
    batch = make_batch(shape_index, shapes, q_lens, contexts)
    out, _ = ragged_paged_attention(**batch, sm_scale=0.1, impl=IMPL,
                                    block_sizes=tiling_of(shapes),
                                    num_decodes=np.array([2], np.int32))
    want = jax_reference(batch, 0.1)
    live = int(batch["cu_q_lens"][batch["num_seqs"][0]])
    np.testing.assert_allclose(np.asarray(out)[:live], want, atol=2e-5, rtol=1e-4)


@pytest.mark.slow
def test_double_buffering_has_no_dma_race():
    """The interpreter's happens-before race detector over a multi-tile batch: the next
    tile's DMAs must never write the buffer slot the current tile is reading."""
    from jax.experimental.pallas import tpu as pltpu
    from pallas_kernels.tpu_paged_kernel import ragged_paged_attention_tpu
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    shapes = SHAPES[3]
    batch = make_batch(2, shapes, [1, 12], [70, 30])
    params = pltpu.InterpretParams(detect_races=True)
    out, lse = jax.jit(lambda *a: ragged_paged_attention_tpu(
        *a, sm_scale=0.1, block_sizes=TILINGS[1], interpret=params))(
        *(batch[k] for k in ("q", "k_pages", "v_pages", "page_table", "cu_q_lens",
                             "kv_lens", "num_seqs")))
    assert_matches_oracle(out, lse, batch, 0.1)
    assert ipc.races is not None and not ipc.races.races_found
