"""Sliding-window attention (Mistral) on the XLA path and the GPU kernel (interpret mode)
against the dense oracle; the TPU kernel's check is in tpu_kernel_checks.py."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import BlockSizes, ragged_paged_attention
from pallas_kernels.dense_reference import dense_attention_oracle
from tests.attention_checks import (Shapes, assert_matches_oracle, assert_per_layer_window,
                                    decodes_first, make_batch,
                                    ragged_batches)

SHAPES = Shapes(q_heads=4, kv_heads=2, head_dim=32, page_size=8, num_tokens=48,
                max_seqs=4, pages_per_seq=12)
# 2-page tiles of 16 keys, so a window of 5..40 keys leaves whole tiles to skip.
TILES = BlockSizes(block_q=8, kv_pages_per_block=2, prefill_rows=16, num_kv_splits=2)


@settings(max_examples=5, deadline=None)
@given(batch_spec=ragged_batches((SHAPES,), max_chunk=30), window=st.integers(1, 40))
def test_xla_path_masks_keys_outside_the_window(batch_spec, window):
    shapes, seed, q_lens, contexts = batch_spec
    batch = make_batch(seed, shapes, q_lens, contexts)
    out, lse = ragged_paged_attention(**batch, sm_scale=0.2, impl="xla", block_sizes=TILES,
                                      sliding_window=window)
    assert_matches_oracle(out, lse, batch, 0.2, sliding_window=window)


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
def test_gpu_kernel_masks_keys_outside_the_window(split):
    """Decodes and chunks whose windows start in the middle of a tile and past whole
    tiles, with KV splits (each split's share starts at the window's first tile)."""
    q_lens, contexts = [1, 13, 1, 9], [70, 37, 3, 0]
    num_decodes = None
    if split:
        q_lens, contexts, num_decodes = decodes_first(q_lens, contexts)
    batch = make_batch(3, SHAPES, q_lens, contexts)
    out, lse = ragged_paged_attention(**batch, sm_scale=0.2, impl="interpret",
                                      block_sizes=TILES, num_decodes=num_decodes,
                                      sliding_window=20)
    assert_matches_oracle(out, lse, batch, 0.2, sliding_window=20)
    # The window changes the result here (the test would pass without masking otherwise).
    full, _ = dense_attention_oracle(**batch, sm_scale=0.2)
    assert np.abs(np.asarray(out) - full).max() > 1e-2


def test_window_needs_causal_attention():
    batch = make_batch(0, SHAPES, [4], [10], causal=False)
    with pytest.raises(ValueError, match="sliding_window=8 needs causal=True"):
        ragged_paged_attention(**batch, sm_scale=0.2, impl="xla", causal=False,
                               sliding_window=8)


@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_per_layer_window_under_the_layer_scan(impl):
    """Gemma-3's sliding and full layers: one scanned layer body, the window chosen per
    layer (a lax.cond between the windowed and full kernel), each layer equal to the dense
    oracle with its own window; decodes and chunks on the decode/prefill split."""
    q_lens, contexts, num_decodes = decodes_first([1, 13, 1, 9], [70, 37, 3, 0])
    assert_per_layer_window(impl, SHAPES, q_lens, contexts, 20, num_decodes=num_decodes)
