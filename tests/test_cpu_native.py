"""The native CPU kernels (pallas_kernels.cpu_native): built where a C++ compiler is; the
decode and the chunk attention equal to the XLA path and the dense oracle on fresh random
batches, in the compiled step of the XLA path on the CPU, and a clear error (no stray read)
for a page outside the cache; the matmuls equal to NumPy and the model's einsums."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import cpu_native, xla_attention
from pallas_kernels.dense_reference import dense_attention_oracle
from pallas_kernels.dispatch import block_sizes_for
from pallas_kernels.query_blocks import key_starts
from tests.attention_checks import (assert_attention_close, assert_matches_oracle, make_batch,
                                    ragged_batches, Shapes)

if cpu_native._compiler() is None:
    pytest.skip("no C++ compiler: the native CPU kernels cannot build here",
                allow_module_level=True)

# SmolLM2's heads (9 query heads on 3 K/V heads), GQA 4:1, and one head per K/V head.
SHAPES = [Shapes(q_heads=9, kv_heads=3, head_dim=64, page_size=16, max_seqs=6,
                 pages_per_seq=12),
          Shapes(q_heads=8, kv_heads=2, head_dim=32, page_size=4, max_seqs=5,
                 pages_per_seq=20),
          Shapes(q_heads=4, kv_heads=4, head_dim=16, page_size=8, max_seqs=4,
                 pages_per_seq=6)]


@pytest.fixture(autouse=True, scope="module")
def _kernels_registered():
    """The calls below need the kernels registered with XLA, which `available()` does the
    first time: so that any test also runs alone."""
    cpu_native.available()


def test_the_kernels_build_where_a_compiler_is():
    assert cpu_native.available(), cpu_native.status()


def _decode_args(batch):
    """decode_attention_xla's arguments from a make_batch batch of one query per sequence."""
    seqs = batch["page_table"].shape[0]
    return dict(q=jnp.asarray(batch["q"][:seqs]), k_pages=jnp.asarray(batch["k_pages"]),
                v_pages=jnp.asarray(batch["v_pages"]), page_table=jnp.asarray(batch["page_table"]),
                kv_lens=jnp.asarray(batch["kv_lens"]))


def _both_paths(attention, args, **kw):
    """(native, xla) results of `attention` (an xla_attention function) on the same
    arguments: traced with the native kernels, and again with them unavailable."""
    tiling = block_sizes_for("xla", "cpu", args["q"].shape[2], args["k_pages"].shape[1])
    args = {name: jnp.asarray(x) for name, x in args.items()}

    def run():
        return jax.jit(lambda a: attention(**a, block_sizes=tiling, **kw))(args)
    native = run()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_native, "available", lambda: False)
        xla = run()
    return native, xla


@settings(max_examples=10, deadline=None)
@given(shapes=st.sampled_from(SHAPES), seed=st.integers(0, 2**31 - 1), data=st.data(),
       window=st.sampled_from([None, 1, 5, 40]))
def test_native_equals_the_xla_path_and_the_oracle(shapes, seed, data, window):
    """Decodes with empty caches, one key, page-crossing and full page tables, padding
    rows, a sliding window: the kernel's out and lse equal the XLA path's and the dense
    oracle's (fresh random K/V, queries and page tables each example)."""
    num_seqs = data.draw(st.integers(1, shapes.max_seqs))
    contexts = data.draw(st.lists(st.one_of(st.integers(0, shapes.max_context - 1),
                                            st.sampled_from([0, shapes.max_context - 1])),
                                  min_size=num_seqs, max_size=num_seqs))
    batch = make_batch(seed, shapes, [1] * num_seqs, contexts)
    args = _decode_args(batch)
    sm_scale = shapes.head_dim ** -0.5
    (out, lse), (want_out, want_lse) = _both_paths(
        xla_attention.decode_attention_xla, args, sm_scale=sm_scale, sliding_window=window)
    assert_attention_close(out, lse, want_out, want_lse, atol=1e-5)
    seqs = shapes.max_seqs
    oracle_out, oracle_lse = dense_attention_oracle(
        batch["q"][:seqs], batch["k_pages"], batch["v_pages"], batch["page_table"],
        cu_q_lens=np.arange(seqs + 1), kv_lens=batch["kv_lens"], num_seqs=[seqs],
        sm_scale=sm_scale, sliding_window=window)
    assert_attention_close(out, lse, oracle_out, oracle_lse)


def test_window_starts_per_sequence():
    """Starts the caller maps (a KV shard's part of a window), some past every key."""
    shapes = SHAPES[0]
    batch = make_batch(3, shapes, [1] * 6, [150, 20, 0, 64, 191, 7])
    args = _decode_args(batch)
    starts = jnp.asarray([17, 25, 1, 65, 100, 3], jnp.int32)     # kv_lens: context + 1
    (out, lse), (want_out, want_lse) = _both_paths(
        xla_attention.decode_attention_xla, args, sm_scale=0.125, window_starts=starts)
    assert_attention_close(out, lse, want_out, want_lse, atol=1e-5)
    assert np.isneginf(np.asarray(lse)[[1, 2, 3]]).all()       # no key at or past its start


def test_the_cpu_step_calls_the_kernels():
    """What the engine compiles on the CPU: the ragged XLA path's decodes and chunks are the
    custom calls."""
    shapes = SHAPES[0]
    batch = make_batch(1, shapes, [1, 1, 5], [30, 2, 9])
    tiling = block_sizes_for("xla", "cpu", shapes.head_dim, shapes.page_size)
    hlo = jax.jit(lambda b: xla_attention.ragged_paged_attention_xla(
        **b, sm_scale=0.125, block_sizes=tiling)).lower(batch).as_text()
    assert cpu_native.DECODE_ATTENTION_TARGET in hlo
    assert cpu_native.CHUNK_ATTENTION_TARGET in hlo


@settings(max_examples=12, deadline=None)
@given(case=ragged_batches(SHAPES), window=st.sampled_from([None, 1, 5, 40]),
       causal=st.booleans())
def test_chunks_equal_the_xla_path_and_the_oracle(case, window, causal):
    """Ragged batches of chunks (with and without context, 1 to 24 queries) and decodes:
    the chunk kernel's out and lse equal the XLA path's query blocks and the dense oracle
    (fresh random K/V, queries and page tables each example), causal or not, windowed."""
    shapes, seed, q_lens, contexts = case
    if not causal:
        window = None          # a window is the causal path's (the oracle's contract)
    batch = make_batch(seed, shapes, q_lens, contexts, causal=causal)
    sm_scale = shapes.head_dim ** -0.5
    (out, lse), (want_out, want_lse) = _both_paths(
        xla_attention.ragged_paged_attention_xla, batch, sm_scale=sm_scale, causal=causal,
        sliding_window=window)
    assert_attention_close(out, lse, want_out, want_lse, atol=1e-5)
    assert_matches_oracle(out, lse, batch, sm_scale, causal=causal, sliding_window=window)


def test_chunks_with_window_starts_per_token():
    """Starts the caller maps per query (a KV shard's part of a window), some past every key."""
    shapes = SHAPES[1]
    batch = make_batch(5, shapes, [7, 1, 12], [30, 9, 0], causal=False)
    starts = np.random.default_rng(5).integers(0, 40, shapes.num_tokens).astype(np.int32)
    (out, lse), (want_out, want_lse) = _both_paths(
        xla_attention.ragged_paged_attention_xla, batch, sm_scale=0.2, causal=False,
        window_starts=jnp.asarray(starts))
    assert_attention_close(out, lse, want_out, want_lse, atol=1e-5)
    assert_matches_oracle(out, lse, batch, 0.2, causal=False, window_starts=starts)


def test_a_chunks_page_outside_the_cache_is_an_error():
    shapes = SHAPES[2]
    batch = make_batch(2, shapes, [4, 1], [10, 3])
    table = np.array(batch["page_table"])
    table[0, 1] = -1
    tokens = shapes.num_tokens
    with pytest.raises(Exception, match="page id outside the cache"):
        jax.block_until_ready(cpu_native.chunk_attention(
            jnp.asarray(batch["q"]), xla_attention._fold_heads(jnp.asarray(batch["k_pages"])),
            xla_attention._fold_heads(jnp.asarray(batch["v_pages"])), jnp.asarray(table),
            jnp.asarray(batch["cu_q_lens"]), jnp.asarray(batch["num_seqs"]),
            jnp.zeros(tokens, jnp.int32), jnp.full(tokens, 14, jnp.int32), sm_scale=0.125))


def test_a_page_outside_the_cache_is_an_error():
    shapes = SHAPES[2]
    batch = make_batch(2, shapes, [1, 1], [10, 3])
    args = _decode_args(batch)
    args["page_table"] = args["page_table"].at[0, 1].set(shapes.num_pages)
    k = xla_attention._fold_heads(args["k_pages"])
    v = xla_attention._fold_heads(args["v_pages"])
    with pytest.raises(Exception, match="page id outside the cache"):
        jax.block_until_ready(cpu_native.decode_attention(
            args["q"], k, v, args["page_table"], args["kv_lens"],
            key_starts(args["kv_lens"], None), sm_scale=0.125))


def test_turned_off_by_the_environment():
    env = dict(os.environ, **{cpu_native.ENV_VAR: "off"})
    done = subprocess.run(
        [sys.executable, "-c", "from pallas_kernels import cpu_native; "
                               "print(cpu_native.available(), cpu_native.status())"],
        env=env, capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == f"False off: {cpu_native.ENV_VAR}=off"


@settings(max_examples=8, deadline=None)
@given(rows=st.sampled_from([1, 2, 3, 4, 5, 8, 9, 11, 13, 64, 131]),
       k=st.sampled_from([16, 64, 96, 300, 577]), n=st.sampled_from([32, 96, 192]),
       layers=st.integers(1, 3), seed=st.integers(0, 2**31 - 1))
def test_layer_matmul_equals_numpy(rows, k, n, layers, seed):
    """Every row count (up to 8 the streamed product: groups of four rows and the rest, k
    split into items whose rows of w are not a multiple of the 4 or 8 taken at a time; the
    GEMM's 6-row tiles and the rest past it, over one or two packed depth blocks), each
    layer of the stack in place."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    stacked = rng.standard_normal((layers, k, n)).astype(np.float32)
    run = jax.jit(cpu_native.layer_matmul)
    for layer in range(layers):
        got = np.asarray(run(x, stacked, np.int32(layer)))
        want = x.astype(np.float64) @ stacked[layer].astype(np.float64)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_layer_matmul_sums_in_the_same_order_every_call(rows):
    """The streamed product splits k over the pool's threads and sums the partials in
    item order, so the same inputs give the same bits whichever thread ran which item (a
    greedy token must not flip between two runs of one step)."""
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, 576)).astype(np.float32)
    stacked = rng.standard_normal((2, 576, 1536)).astype(np.float32)
    run = jax.jit(cpu_native.layer_matmul)
    first = np.asarray(run(x, stacked, np.int32(1)))
    for _ in range(5):
        np.testing.assert_array_equal(np.asarray(run(x, stacked, np.int32(1))), first)


def test_a_layer_outside_the_stack_is_an_error():
    with pytest.raises(Exception, match="layer outside the stack"):
        jax.block_until_ready(cpu_native.layer_matmul(
            np.ones((1, 8), np.float32), np.ones((2, 8, 32), np.float32), np.int32(2)))


@pytest.mark.parametrize("spec,x_shape,w_shape", [
    ("td,dhk->thk", (3, 64), (64, 4, 16)),       # q/k/v
    ("thk,hkd->td", (5, 4, 16), (4, 16, 96)),    # the output projection
    ("td,df->tf", (8, 96), (96, 128)),           # gate, up
    ("tf,fd->td", (1, 128), (128, 64)),          # down
])
def test_dense_in_place_equals_the_einsum(spec, x_shape, w_shape):
    from medha_jax.model import layers

    rng = np.random.default_rng(0)
    x = rng.standard_normal(x_shape).astype(np.float32)
    stacked = rng.standard_normal((3, *w_shape)).astype(np.float32)
    got = jax.jit(lambda x, s: layers.dense(spec, x, layers.LayerOfStack(s, jnp.int32(1))))(
        x, stacked)
    np.testing.assert_allclose(got, np.einsum(spec, x, stacked[1]), rtol=1e-5, atol=1e-5)


def test_steps_read_the_matrices_in_place_and_give_the_one_shot_logits():
    """The tiny model on one device, a prompt run in steps of 1 to 24 tokens (decodes and
    chunks): each step's program reads the layer matrices in place (the layer matmul is in
    it) and the logits equal the one-shot forward's (a step past IN_PLACE_MAX_TOKENS slices
    them as before)."""
    from medha_jax import load_model
    from medha_jax.model.llama import IN_PLACE_MAX_TOKENS, one_sequence_metadata

    model = load_model("tiny", verbose=False)
    rng = np.random.default_rng(6)
    ids = rng.integers(0, 256, size=80).astype(np.int32)
    want = model.logits(ids.tolist())
    big = IN_PLACE_MAX_TOKENS + 1
    page_size, per_shard = 16, -(-big // 16) * 16
    cache = model.new_kv_cache(per_shard // page_size, page_size)
    got, start = [], 0
    with jax.set_mesh(model.mesh):
        for n in (1, 8, 3, 4, 2, 8, 6, 5, 1, 2, 9, 24, 7):
            meta = one_sequence_metadata(start, start + n, n, page_size=page_size,
                                         num_kv_shards=1, tokens_per_shard=per_shard)
            positions = np.arange(start, start + n, dtype=np.int32)
            args = (model.state, cache, ids[start:start + n], positions, meta)
            if n in (1, 8, 24):
                hlo = model._chunk_logits.lower(*args).as_text()
                assert cpu_native.LAYER_MATMUL_TARGET in hlo
            logits, cache = model._chunk_logits(*args)
            got.append(np.asarray(logits))
            start += n
        meta = one_sequence_metadata(0, big, big, page_size=page_size, num_kv_shards=1,
                                     tokens_per_shard=per_shard)
        tokens = np.resize(ids, big)
        hlo = model._chunk_logits.lower(model.state, cache, tokens,
                                        np.arange(big, dtype=np.int32), meta).as_text()
        assert cpu_native.LAYER_MATMUL_TARGET not in hlo
    np.testing.assert_allclose(np.concatenate(got), want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("rows, k, vocab", [(1, 96, 1000), (3, 96, 1001), (8, 96, 1003),
                                             (2, 100, 1000)])
def test_matmul_t_equals_numpy(rows, k, vocab):
    """The tied LM head's product: blocks of four vocabulary rows by two x rows and the odd
    x row, a vocabulary that is no multiple of the kernel's blocks (items of 64, blocks of
    4), and a hidden size that is no multiple of the vectors (one dot product at a time)."""
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = rng.standard_normal((vocab, k)).astype(np.float32)
    got = np.asarray(jax.jit(cpu_native.matmul_t)(x, w))
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_a_small_steps_tied_head_is_the_native_call_with_the_einsums_logits():
    from medha_jax.model.llama import lm_logits

    rng = np.random.default_rng(9)
    hidden = rng.standard_normal((4, 64)).astype(np.float32)
    embed = rng.standard_normal((264, 64)).astype(np.float32)       # 256 + padding
    native = jax.jit(lambda h, e: lm_logits(h, e, None, 256, one_device=True))
    assert cpu_native.MATMUL_T_TARGET in native.lower(hidden, embed).as_text()
    xla = jax.jit(lambda h, e: lm_logits(h, e, None, 256))
    assert cpu_native.MATMUL_T_TARGET not in xla.lower(hidden, embed).as_text()
    np.testing.assert_allclose(native(hidden, embed), xla(hidden, embed), rtol=1e-5, atol=1e-5)
