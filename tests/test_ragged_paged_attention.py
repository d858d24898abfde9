"""Ragged paged attention: Pallas kernel (interpret mode) == jnp reference == dense oracle.

Buffers have a few fixed shapes (one compile per shape and tiling); hypothesis draws what
varies at run time in the engine: how many sequences, their chunk lengths (decodes and
1-token chunks included), their contexts, where their pages live, and the data.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import (BlockSizes, dense_attention_oracle, ragged_paged_attention,
                            ragged_paged_attention_reference)
from pallas_kernels.block_sizes import default_block_sizes, resolve
from pallas_kernels.ragged_paged_attention import kernel_rows, paged_attention_blocks
from pallas_kernels.reference import plan_query_blocks, random_page_table
from tests.attention_checks import assert_attention_close


@dataclasses.dataclass(frozen=True)
class Shapes:
    """Static buffer shapes of one batch family."""
    q_heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    num_tokens: int = 40
    max_seqs: int = 5
    pages_per_seq: int = 10

    @property
    def num_pages(self):
        return self.max_seqs * self.pages_per_seq + 3


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


def make_batch(seed: int, shapes: Shapes, q_lens, contexts, dtype=np.float32):
    """Numpy arrays for `ragged_paged_attention`; sequence s has q_lens[s] new tokens after
    contexts[s] cached ones."""
    rng = np.random.default_rng(seed)
    num_seqs = len(q_lens)
    kv_lens = [c + n for c, n in zip(contexts, q_lens)]
    cu_q_lens = np.full(shapes.max_seqs + 1, sum(q_lens), np.int32)
    cu_q_lens[: num_seqs + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    kv_lens_arr = np.zeros(shapes.max_seqs, np.int32)
    kv_lens_arr[:num_seqs] = kv_lens
    cache_shape = (shapes.num_pages, shapes.page_size, shapes.kv_heads, shapes.head_dim)
    return dict(
        q=rng.standard_normal((shapes.num_tokens, shapes.q_heads, shapes.head_dim)).astype(dtype),
        k_pages=rng.standard_normal(cache_shape).astype(dtype),
        v_pages=rng.standard_normal(cache_shape).astype(dtype),
        page_table=random_page_table(rng, kv_lens, max_seqs=shapes.max_seqs,
                                     pages_per_seq=shapes.pages_per_seq,
                                     page_size=shapes.page_size, num_pages=shapes.num_pages),
        cu_q_lens=cu_q_lens, kv_lens=kv_lens_arr, num_seqs=np.array([num_seqs], np.int32))


@st.composite
def ragged_batches(draw, shapes_choices=tuple(SHAPES), max_chunk=24):
    """(shapes, seed, q_lens, contexts): a mix of decodes, 1-token and longer chunks."""
    shapes = draw(st.sampled_from(shapes_choices))
    max_context = shapes.pages_per_seq * shapes.page_size
    num_seqs = draw(st.integers(1, shapes.max_seqs))
    q_lens, contexts, tokens_left = [], [], shapes.num_tokens
    for _ in range(num_seqs):
        if tokens_left == 0:
            break
        kind = draw(st.sampled_from(["decode", "chunk", "chunk", "first_chunk"]))
        q_len = 1 if kind == "decode" else draw(st.integers(1, min(tokens_left, max_chunk)))
        context = 0 if kind == "first_chunk" else draw(st.integers(0, max_context - q_len))
        q_lens.append(q_len)
        contexts.append(context)
        tokens_left -= q_len
    return shapes, draw(st.integers(0, 2**31 - 1)), q_lens, contexts


def assert_matches_oracle(out, lse, batch, sm_scale, *, atol=2e-5):
    want_out, want_lse = dense_attention_oracle(**batch, sm_scale=sm_scale)
    assert_attention_close(out, lse, want_out, want_lse, atol=atol)
    out, lse = np.asarray(out), np.asarray(lse)
    padding = np.arange(out.shape[0]) >= batch["cu_q_lens"][batch["num_seqs"][0]]
    assert (out[padding] == 0).all() and np.isneginf(lse[padding]).all()


@settings(max_examples=16, deadline=None)
@given(batch_spec=ragged_batches())
def test_kernel_and_reference_equal_dense_oracle(batch_spec):
    shapes, seed, q_lens, contexts = batch_spec
    # One tiling per buffer shape keeps it to one compile per shape and implementation.
    tiling = TILINGS[SHAPES.index(shapes) % len(TILINGS)]
    batch = make_batch(seed, shapes, q_lens, contexts)
    sm_scale = shapes.head_dim ** -0.5
    for impl in ("reference", "interpret"):
        out, lse = ragged_paged_attention(**batch, sm_scale=sm_scale, impl=impl,
                                          block_sizes=tiling)
        assert out.shape == batch["q"].shape and out.dtype == jnp.float32
        assert lse.shape == batch["q"].shape[:2] and lse.dtype == jnp.float32
        assert_matches_oracle(out, lse, batch, sm_scale)


@settings(max_examples=6, deadline=None)
@given(batch_spec=ragged_batches(shapes_choices=(
    Shapes(q_heads=9, kv_heads=3, head_dim=64, page_size=16, num_tokens=160, max_seqs=6,
           pages_per_seq=24),), max_chunk=96))
def test_reference_with_cpu_serving_tiles(batch_spec):
    """The tiling the CPU engine actually runs (auto -> reference, default block sizes)."""
    shapes, seed, q_lens, contexts = batch_spec
    batch = make_batch(seed, shapes, q_lens, contexts)
    out, lse = ragged_paged_attention(**batch, sm_scale=0.125)   # impl="auto" on the CPU
    assert_matches_oracle(out, lse, batch, 0.125)


@pytest.mark.parametrize("impl", ["reference", "interpret"])
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
    bf16 = {k: (v.astype(jnp.bfloat16) if v.dtype == np.float32 else v) for k, v in batch.items()}
    for impl in ("reference", "interpret"):
        out, lse = ragged_paged_attention(**bf16, sm_scale=0.125, impl=impl,
                                          block_sizes=TILINGS[0])
        assert out.dtype == jnp.bfloat16
        # Compare against the oracle on the bf16-rounded inputs.
        rounded = {k: np.asarray(v, np.float32) if k in ("q", "k_pages", "v_pages") else v
                   for k, v in bf16.items()}
        assert_matches_oracle(np.asarray(out, np.float32), lse, rounded, 0.125, atol=2e-2)


def test_kernel_writes_every_output_element():
    """Interpret mode starts kernel outputs as NaN, so an unwritten element (an empty query
    block, an idle KV split, padding rows) would survive as NaN."""
    shapes = SHAPES[2]
    batch = make_batch(5, shapes, [1, 3], [0, 2])           # mostly empty blocks and splits
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
        plan.first_pos, plan.num_tokens, sm_scale=0.1, q_per_kv=q_per_kv,
        block_sizes=tiling, interpret=True)
    assert not np.isnan(np.asarray(out)).any() and not np.isnan(np.asarray(lse)).any()
    empty = np.asarray(plan.num_tokens) == 0
    assert empty.any() and np.isneginf(np.asarray(lse)[empty]).all()


def test_query_block_plan_covers_every_token_once():
    q_lens, contexts = [5, 1, 9, 2], [3, 7, 0, 11]
    batch = make_batch(0, SHAPES[0], q_lens, contexts)
    plan = jax.tree.map(np.asarray, plan_query_blocks(
        batch["cu_q_lens"], batch["kv_lens"], batch["num_seqs"], num_tokens=40, block_q=4))
    assert plan.count == sum(-(-n // 4) for n in q_lens)
    covered = np.zeros(40, int)
    for b in range(plan.count):
        covered[plan.first_token[b]: plan.first_token[b] + plan.num_tokens[b]] += 1
        s = plan.seq[b]
        assert plan.first_token[b] + plan.num_tokens[b] <= batch["cu_q_lens"][s + 1]
    assert (covered[: sum(q_lens)] == 1).all() and (covered[sum(q_lens):] == 0).all()
    assert (plan.num_tokens[plan.count:] == 0).all()
    t = np.arange(sum(q_lens))
    assert (plan.first_token[plan.token_block[t]] + plan.token_row[t] == t).all()


def test_reference_under_gspmd_head_sharding():
    """Plain jnp: jit with heads sharded across devices gives the unsharded result."""
    shapes = Shapes(q_heads=8, kv_heads=4, head_dim=64, page_size=8)
    batch = make_batch(11, shapes, [1, 12, 1, 7], [20, 9, 0, 30])
    mesh = jax.make_mesh((4,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
    spec = jax.sharding.PartitionSpec
    shard = lambda *axes: jax.sharding.NamedSharding(mesh, spec(*axes))
    in_shardings = (shard(None, "tp", None), shard(None, None, "tp", None),
                    shard(None, None, "tp", None), shard(), shard(), shard(), shard())
    tiling = default_block_sizes("cpu", shapes.head_dim, shapes.page_size)
    fn = jax.jit(lambda *a: ragged_paged_attention_reference(*a, sm_scale=0.125,
                                                             block_sizes=tiling),
                 in_shardings=in_shardings)
    args = tuple(batch[k] for k in ("q", "k_pages", "v_pages", "page_table", "cu_q_lens",
                                    "kv_lens", "num_seqs"))
    out, lse = fn(*args)
    assert len(out.sharding.device_set) == 4
    assert_matches_oracle(out, lse, batch, 0.125)


def test_auto_is_the_reference_on_cpu_and_block_sizes_validate():
    assert resolve("auto", None, head_dim=64, page_size=16) == (
        "reference", default_block_sizes("cpu", 64, 16))
    assert resolve("interpret", None, head_dim=128, page_size=16)[1].block_q == 16
    with pytest.raises(ValueError, match="impl='cuda'"):
        resolve("cuda", None, head_dim=64, page_size=16)
    with pytest.raises(ValueError, match="block_q"):
        BlockSizes(block_q=0, kv_pages_per_block=1)
    with pytest.raises(ValueError, match="block_kv=8"):
        resolve("pallas", BlockSizes(block_q=16, kv_pages_per_block=2), head_dim=64,
                page_size=4)


def test_shape_errors_name_the_values():
    batch = make_batch(0, SHAPES[1], [3], [4])
    with pytest.raises(ValueError, match="q_heads=8 must be a multiple of kv_heads=3"):
        three_heads = np.concatenate([batch["k_pages"], batch["k_pages"][:, :, :1]], axis=2)
        ragged_paged_attention(**{**batch, "k_pages": three_heads, "v_pages": three_heads},
                               sm_scale=1.0)
    with pytest.raises(ValueError, match="kv_lens.shape=\\(4,\\)"):
        ragged_paged_attention(**{**batch, "kv_lens": batch["kv_lens"][:4]}, sm_scale=1.0)


def test_kernel_lowers_to_triton_for_gpu():
    """Cross-platform lowering runs the Pallas -> Triton IR lowering without a GPU: every
    op of the kernel must have a Triton lowering and every loaded tile a power-of-2 size.
    (Compiling that IR to PTX and running it still needs a GPU.)"""
    sds = jax.ShapeDtypeStruct
    args = (sds((64, 32, 128), jnp.bfloat16), sds((256, 16, 8, 128), jnp.bfloat16),
            sds((256, 16, 8, 128), jnp.bfloat16), sds((8, 40), jnp.int32),
            sds((9,), jnp.int32), sds((8,), jnp.int32), sds((1,), jnp.int32))
    fn = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=0.1, impl="pallas"))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
