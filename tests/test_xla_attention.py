"""The XLA path with the tiles the CPU engine runs, under GSPMD, and its decode tile cap."""

import jax
import numpy as np
from hypothesis import given, settings

from pallas_kernels import BlockSizes, ragged_paged_attention
from pallas_kernels.dispatch import block_sizes_for
from pallas_kernels.xla_attention import (DECODE_TILE_BYTES, decode_group_size,
                                          decode_pages_per_tile, ragged_paged_attention_xla)
from tests.attention_checks import Shapes, assert_matches_oracle, make_batch, ragged_batches

SERVING_SHAPES = Shapes(q_heads=9, kv_heads=3, head_dim=64, page_size=16, num_tokens=160,
                        max_seqs=6, pages_per_seq=24)


@settings(max_examples=6, deadline=None)
@given(batch_spec=ragged_batches((SERVING_SHAPES,), max_chunk=96))
def test_auto_on_cpu_with_serving_tiles(batch_spec):
    """The tiling the CPU engine actually runs (auto -> xla, the "cpu" table entry):
    query blocks and K/V tiles larger than most chunks and contexts drawn."""
    shapes, seed, q_lens, contexts = batch_spec
    batch = make_batch(seed, shapes, q_lens, contexts)
    out, lse = ragged_paged_attention(**batch, sm_scale=0.125)
    assert_matches_oracle(out, lse, batch, 0.125)


@settings(max_examples=4, deadline=None)
@given(batch_spec=ragged_batches((SERVING_SHAPES,), max_chunk=96, causal=False))
def test_prefix_with_serving_tiles(batch_spec):
    shapes, seed, q_lens, contexts = batch_spec
    batch = make_batch(seed, shapes, q_lens, contexts, causal=False)
    out, lse = ragged_paged_attention(**batch, sm_scale=0.125, impl="xla", causal=False)
    assert_matches_oracle(out, lse, batch, 0.125, causal=False)


def test_under_gspmd_head_sharding():
    """Plain jnp: jit with heads sharded across devices gives the unsharded result."""
    shapes = Shapes(q_heads=8, kv_heads=4, head_dim=64, page_size=8)
    batch = make_batch(11, shapes, [1, 12, 1, 7], [20, 9, 0, 30])
    mesh = jax.make_mesh((4,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
    spec = jax.sharding.PartitionSpec
    shard = lambda *axes: jax.sharding.NamedSharding(mesh, spec(*axes))
    in_shardings = (shard(None, "tp", None), shard(None, None, "tp", None),
                    shard(None, None, "tp", None), shard(), shard(), shard(), shard())
    tiling = block_sizes_for("xla", "cpu", shapes.head_dim, shapes.page_size)
    fn = jax.jit(lambda *a: ragged_paged_attention_xla(*a, sm_scale=0.125, block_sizes=tiling),
                 in_shardings=in_shardings)
    args = tuple(batch[k] for k in ("q", "k_pages", "v_pages", "page_table", "cu_q_lens",
                                    "kv_lens", "num_seqs"))
    out, lse = fn(*args)
    assert len(out.sharding.device_set) == 4
    assert_matches_oracle(out, lse, batch, 0.125)


def test_decode_tiles_shrink_to_stay_in_cache():
    tiles = BlockSizes(block_q=64, kv_pages_per_block=16)
    small = dict(page_size=16, kv_heads=3, head_dim=64, itemsize=4)
    assert decode_pages_per_tile(tiles, seqs=2, **small) == 16
    # 64 seqs x 16 keys x 3 heads x 64 x 4 B = 768 KB a page: 5 pages fit in 4 MB.
    page_bytes = 64 * 16 * 3 * 64 * 4
    assert decode_pages_per_tile(tiles, seqs=64, **small) == DECODE_TILE_BYTES // page_bytes == 5
    assert decode_pages_per_tile(tiles, seqs=4096, **small) == 1


def test_decodes_in_groups_sorted_by_context():
    """Many decodes (several groups of `decode_group_size`), one long context among short
    ones, zeros and unused padding slots, mixed with chunks: every row is the oracle's,
    in its own place after the sort by context and back."""
    shapes = Shapes(q_heads=9, kv_heads=3, head_dim=64, page_size=16, num_tokens=96,
                    max_seqs=72, pages_per_seq=12)
    rng = np.random.default_rng(7)
    contexts = [int(c) for c in rng.integers(0, 60, 66)]
    contexts[rng.integers(66)] = 180                       # one long decode among chats
    q_lens = [1] * 66
    q_lens[3], q_lens[40] = 9, 14                          # two chunks between the decodes
    assert decode_group_size(shapes.max_seqs) == 3
    batch = make_batch(5, shapes, q_lens, contexts)
    out, lse = ragged_paged_attention(**batch, sm_scale=0.125, impl="xla")
    assert_matches_oracle(out, lse, batch, 0.125)


def test_decode_groups():
    assert [decode_group_size(s) for s in (1, 16, 64, 65, 256, 1024)] == [2, 2, 2, 3, 8, 32]
