"""The Mosaic-TPU kernel in the TPU interpreter == dense oracle, and == JAX's reference.

Not collected by the normal run: the TPU interpreter hangs with the 8 virtual devices the
suite's conftest sets up, so `test_tpu_paged_kernel.py` runs this module in a child
pytest with one device (`--noconftest`, XLA_FLAGS device count 1). Run it by hand with:

    XLA_FLAGS=--xla_force_host_platform_device_count=1 JAX_PLATFORMS=cpu \\
        python -m pytest -q --noconftest tests/tpu_kernel_checks.py

The interpreter runs every DMA, semaphore and grid step in Python callbacks, and each
(shape, tiling, path) is a compile of several seconds, so the buffers are small, the
shapes few and each compile serves a few hypothesis draws. Every run covers every shape
of SHAPES: causal on the whole-batch path and on the decode/prefill split (the model's
path: decodes on the decode path, chunks in prefill-sized query blocks), the prefix mode
(causal=False) on the split (the KV-parallel path); each case on fresh draws of what
varies at run time: sequences, chunk lengths (decodes, 1-token and long chunks),
contexts (empty and full), page placement, data. A hypothesis run starts with its
simplest batch (one decode over one key), then draws at random.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import BlockSizes, decode_attention, ragged_paged_attention
from pallas_kernels.dense_reference import dense_attention_oracle
from tests.attention_checks import (Shapes, as_bfloat16, assert_matches_oracle,
                                    assert_per_layer_window, decodes_first,
                                    make_batch, mark_kernels, poison_skipped_pages,
                                    ragged_batches, shard_window_batch)

# Page sizes 16..64, GQA 1..8, head dims 64 and 128; 40 tokens, 5 sequences.
SHAPES = (
    Shapes(q_heads=4, kv_heads=4, head_dim=64, page_size=16, pages_per_seq=4),    # GQA 1
    Shapes(q_heads=8, kv_heads=1, head_dim=128, page_size=32, pages_per_seq=3),   # GQA 8
    Shapes(q_heads=6, kv_heads=2, head_dim=64, page_size=64, pages_per_seq=2),    # GQA 3
    Shapes(q_heads=8, kv_heads=2, head_dim=128, page_size=16, pages_per_seq=5),   # GQA 4
)
# Per shape: 8-token blocks with multi-page tiles, or 16-token blocks with one-page tiles.
# prefill_rows grows the split path's prefill blocks past block_q (`prefill_block_q`):
# to 32 tokens at GQA 1, 16 at GQA 3, 32 at GQA 4 (at GQA 8, 128 rows are block_q's 16).
TILINGS = (BlockSizes(block_q=8, kv_pages_per_block=2, prefill_rows=32),
           BlockSizes(block_q=16, kv_pages_per_block=1, prefill_rows=128))
IMPL = "interpret-tpu"
PATHS = {"whole": False, "split": True}


def tiling_of(shapes):
    return TILINGS[SHAPES.index(shapes) % len(TILINGS)]


def shape_id(shapes):
    return (f"gqa{shapes.q_heads // shapes.kv_heads}-d{shapes.head_dim}"
            f"-page{shapes.page_size}")


def run(batch, shapes, *, causal=True, num_decodes=None):
    """Our kernel on `batch` with the shape's tiling and scale (one compile per shape,
    tiling, path and dtype, shared by every test of this process)."""
    return ragged_paged_attention(**batch, sm_scale=shapes.head_dim ** -0.5, impl=IMPL,
                                  block_sizes=tiling_of(shapes), causal=causal,
                                  num_decodes=num_decodes)


def check(batch_spec, *, causal, split):
    shapes, seed, q_lens, contexts = batch_spec
    num_decodes = None
    if split:
        q_lens, contexts, num_decodes = decodes_first(q_lens, contexts)
    batch = make_batch(seed, shapes, q_lens, contexts, causal=causal)
    out, lse = run(batch, shapes, causal=causal, num_decodes=num_decodes)
    assert out.shape == batch["q"].shape and out.dtype == jnp.float32
    assert lse.shape == batch["q"].shape[:2] and lse.dtype == jnp.float32
    assert_matches_oracle(out, lse, batch, shapes.head_dim ** -0.5, causal=causal)


def test_split_path_runs_larger_prefill_blocks():
    """The tilings give three of the four shapes prefill blocks larger than block_q, so
    the split-path tests below run them."""
    grown = [s for s in SHAPES
             if tiling_of(s).prefill_block_q(s.q_heads // s.kv_heads, s.num_tokens)
             > tiling_of(s).block_q]
    assert grown == [SHAPES[0], SHAPES[2], SHAPES[3]]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shapes", SHAPES, ids=shape_id)
@settings(max_examples=3, deadline=None)
@given(data=st.data())
def test_causal_equals_dense_oracle(shapes, path, data):
    check(data.draw(ragged_batches((shapes,))), causal=True, split=PATHS[path])


@pytest.mark.parametrize("shapes", SHAPES, ids=shape_id)
@settings(max_examples=3, deadline=None)
@given(data=st.data())
def test_prefix_equals_dense_oracle(shapes, data):
    """causal=False through the split (the KV-parallel path): every query sees the whole
    prefix. (The whole-batch prefix path: test_long_chunk_..., decode_attention.)"""
    check(data.draw(ragged_batches((shapes,), causal=False)), causal=False, split=True)


def test_long_chunk_full_context_and_empty_rows():
    """A 32-token chunk over a full page table beside decodes and an empty prefix: several
    query blocks, every tile of the table, and 0 / -inf for the queries with no key."""
    shapes = SHAPES[3]
    batch = make_batch(11, shapes, [1, 32, 1, 6], [79, 48, 0, 0], causal=False)
    out, lse = run(batch, shapes, causal=False)
    assert_matches_oracle(out, lse, batch, shapes.head_dim ** -0.5, causal=False)
    assert (np.asarray(out)[33:40] == 0).all() and np.isneginf(np.asarray(lse)[33:40]).all()


# bf16 batches: (shape, q_lens, contexts, num_decodes or None). The split one has two
# decodes and two chunks in GQA 1's 32-token prefill blocks.
BF16_CASES = {"whole": (SHAPES[1], [1, 17, 9], [60, 0, 40], None),
              "split": (SHAPES[0], [1, 1, 17, 9], [40, 0, 30, 20], 2)}


@pytest.mark.parametrize("case", BF16_CASES)
def test_bfloat16(case):
    """bf16 q and cache: out in bf16, within 2e-2 of the oracle on the rounded inputs."""
    shapes, q_lens, contexts, num_decodes = BF16_CASES[case]
    bf16, rounded = as_bfloat16(make_batch(3, shapes, q_lens, contexts))
    out, lse = run(bf16, shapes, num_decodes=None if num_decodes is None
                   else np.array([num_decodes], np.int32))
    assert out.dtype == jnp.bfloat16
    assert_matches_oracle(np.asarray(out, np.float32), lse, rounded, shapes.head_dim ** -0.5,
                          atol=2e-2)


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


def test_decodes_take_the_decode_path_in_one_token_blocks(monkeypatch):
    """The TPU side of test_ragged_paged_attention.py::test_decode_sequences_run_the_decode_
    kernel. On a TPU the decode path is the same Mosaic kernel called a second time
    (`decode_attention_tpu`) with one-token query blocks of block_q, the chunks get
    prefill_block_q-token ones. Marks: each path adds its own offset to its output, so
    decode tokens carry the decode path's and chunk tokens the ragged path's. Plans: each
    kernel call records its block_q and, at run time, its query blocks."""
    from pallas_kernels import attention, tpu_paged_kernel
    mark_kernels(monkeypatch, attention, {"decode_attention_tpu": 100.0,
                                          "ragged_paged_attention_tpu": 1000.0})
    calls = []
    kernel = tpu_paged_kernel.tpu_paged_attention_blocks

    def recording(q_blocks, k_pages, v_pages, page_table, *plan, **kw):
        call = {"block_q": kw["block_q"], "causal": kw["causal"]}
        calls.append(call)
        jax.debug.callback(lambda *values: call.update(zip(
            ("seq", "key_end", "num_tokens"), map(np.asarray, values))), *plan)
        return kernel(q_blocks, k_pages, v_pages, page_table, *plan, **kw)

    monkeypatch.setattr(tpu_paged_kernel, "tpu_paged_attention_blocks", recording)
    jax.clear_caches()   # the jitted entry point must trace the wrappers
    try:
        shapes = SHAPES[0]                      # GQA 1: 8-token blocks, 32-token prefill ones
        tiling = tiling_of(shapes)
        q_lens, contexts, num_decodes = decodes_first([7, 1, 12, 1, 1], [20, 33, 0, 5, 50])
        batch = make_batch(6, shapes, q_lens, contexts)
        want, _ = dense_attention_oracle(**batch, sm_scale=0.125)
        out, _ = run(batch, shapes, num_decodes=num_decodes)
        np.testing.assert_allclose(np.asarray(out)[:3], want[:3] + 100.0, atol=2e-4)
        np.testing.assert_allclose(np.asarray(out)[3:22], want[3:22] + 1000.0, atol=2e-4)
        (decode,), (prefill,) = ([c for c in calls if c["causal"] == causal]
                                 for causal in (False, True))
        assert decode["block_q"] == tiling.block_q == 8
        assert prefill["block_q"] == tiling.prefill_block_q(1, shapes.num_tokens) == 32
        # Decode path: one one-token block per decode slot (min(max_seqs, tokens) = 5),
        # reading keys for the 3 decodes only; prefill path: one block per chunk.
        np.testing.assert_array_equal(decode["seq"], range(5))
        np.testing.assert_array_equal(decode["num_tokens"], [1] * 5)
        np.testing.assert_array_equal(decode["key_end"], list(batch["kv_lens"][:3]) + [0, 0])
        live = prefill["num_tokens"] > 0
        np.testing.assert_array_equal(prefill["seq"][live], [3, 4])
        np.testing.assert_array_equal(prefill["num_tokens"][live], [7, 12])

        # A decode-only step: the same program; the prefill path has no live block.
        decodes = make_batch(7, shapes, [1] * 5, [9, 0, 40, 3, 60])
        want, _ = dense_attention_oracle(**decodes, sm_scale=0.125)
        out, _ = run(decodes, shapes, num_decodes=np.array([5], np.int32))
        np.testing.assert_allclose(np.asarray(out)[:5], want[:5] + 100.0, atol=2e-4)
        assert len(calls) == 2 and not prefill["num_tokens"].any()
        np.testing.assert_array_equal(decode["key_end"], decodes["kv_lens"])
    finally:
        monkeypatch.undo()
        jax.clear_caches()


# ----------------------------------------------------------------------------------------
# JAX's own TPU kernel (jax.experimental.pallas.ops.tpu.ragged_paged_attention)
# ----------------------------------------------------------------------------------------

# What jax 0.10.2's TPU interpreter raises on JAX's kernel: the kernel reads its DMA
# buffer through a reshaped ref (`async_copy_kv.wait().reshape(...)`), and the
# interpreter's `get` (jax/_src/pallas/mosaic/interpret/utils.py, to_range) only handles
# indexers. (The generic interpreter, interpret=True, fails too: AttributeError:
# 'TypedInt' object has no attribute 'shape'.)
JAX_KERNEL_ERROR = "AttributeError: 'ReshapeTransform' object has no attribute 'indices'"


def jax_oracle_batch():
    """Decodes and two chunks on GQA 4, head_dim 128, decodes first (for the split)."""
    shapes = SHAPES[3]
    rng = np.random.default_rng(3)
    q_lens = [1, 1, 20, 7]
    contexts = [int(rng.integers(1, shapes.max_context - 20)) for _ in q_lens]
    return shapes, make_batch(3, shapes, q_lens, contexts), np.array([2], np.int32)


def jax_arguments(batch):
    """Our batch as JAX's TPU kernel and its reference take it: q, the combined cache,
    kv_lens, page table, cu_q_lens, num_seqs."""
    from benchmarks.kernels import jax_tpu_kv_cache
    return (jnp.asarray(batch["q"]),
            jax_tpu_kv_cache(jnp.asarray(batch["k_pages"]), jnp.asarray(batch["v_pages"])),
            *(jnp.asarray(batch[k]) for k in ("kv_lens", "page_table", "cu_q_lens",
                                              "num_seqs")))


def assert_live_rows_equal(out, want, batch):
    live = int(batch["cu_q_lens"][batch["num_seqs"][0]])
    np.testing.assert_allclose(np.asarray(out)[:live], np.asarray(want)[:live], atol=2e-5,
                               rtol=1e-4)


@pytest.mark.slow
def test_equals_jax_reference():
    """Second oracle: JAX's definition of ragged paged attention (the jnp reference
    shipped beside its TPU kernel; causal, out only), through the decode/prefill split.
    JAX's kernel itself: test_equals_jax_tpu_kernel."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import (
        ref_ragged_paged_attention)
    shapes, batch, num_decodes = jax_oracle_batch()
    out, _ = run(batch, shapes, num_decodes=num_decodes)
    want = ref_ragged_paged_attention(*jax_arguments(batch), sm_scale=shapes.head_dim ** -0.5)
    assert_live_rows_equal(out, want, batch)


@pytest.mark.slow
def test_double_buffering_has_no_dma_race():
    """The interpreter's happens-before race detector over a multi-tile batch: the next
    tile's DMAs must never write the buffer slot the current tile is reading; with a
    sliding window too (blocks start past their skipped tiles, so the slots alternate
    over the tiles copied)."""
    from jax.experimental.pallas import tpu as pltpu
    from pallas_kernels.tpu_paged_kernel import ragged_paged_attention_tpu
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    shapes = SHAPES[3]
    batch = make_batch(2, shapes, [1, 12, 1], [70, 30, 50])
    params = pltpu.InterpretParams(detect_races=True)
    for window in (None, 20):
        out, lse = jax.jit(lambda *a: ragged_paged_attention_tpu(
            *a, sm_scale=0.1, block_sizes=TILINGS[1], interpret=params,
            sliding_window=window))(
            *(batch[k] for k in ("q", "k_pages", "v_pages", "page_table", "cu_q_lens",
                                 "kv_lens", "num_seqs")))
        assert_matches_oracle(out, lse, batch, 0.1, sliding_window=window)
        assert ipc.races is not None and not ipc.races.races_found, window


# Last in the module: a kernel that fails in the interpreter leaves its state to reset.
@pytest.mark.slow
@pytest.mark.xfail(strict=True, raises=jax.errors.JaxRuntimeError, reason=(
    "jax 0.10.2: JAX's TPU ragged_paged_attention kernel does not run in the TPU "
    "interpreter (force_tpu_interpret_mode(InterpretParams())): JaxRuntimeError: INTERNAL: "
    "CpuCallback error calling callback: ... " + JAX_KERNEL_ERROR + " (it reads a reshaped "
    "VMEM ref, which the interpreter cannot index). Strict: a JAX release that runs it "
    "makes this XPASS and fail; then drop the mark."))
def test_equals_jax_tpu_kernel():
    """The issue's "equals JAX's own TPU kernel": ours through the split against JAX's
    kernel, both in the TPU interpreter, on JAX's cache layout (K and V heads
    interleaved) and our tiles."""
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
        ragged_paged_attention as jax_kernel)
    shapes, batch, num_decodes = jax_oracle_batch()
    out, _ = run(batch, shapes, num_decodes=num_decodes)
    tiling = tiling_of(shapes)
    try:
        with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
            want = jax.block_until_ready(jax_kernel(
                *jax_arguments(batch), sm_scale=shapes.head_dim ** -0.5,
                num_kv_pages_per_block=tiling.kv_pages_per_block,
                num_queries_per_block=tiling.block_q))
    except jax.errors.JaxRuntimeError as e:
        pltpu.reset_tpu_interpret_mode_state()
        if JAX_KERNEL_ERROR not in str(e):   # a new failure is no longer the expected one
            raise AssertionError(f"JAX's TPU kernel failed differently: {e}") from e
        raise
    assert_live_rows_equal(out, want, batch)


@pytest.mark.parametrize("path", PATHS)
def test_sliding_window_equals_dense_oracle(path):
    """Mistral's window (20 keys, shorter than most contexts here): masked on both paths."""
    shapes = SHAPES[3]
    q_lens, contexts = [1, 13, 1, 9], [50, 37, 3, 0]
    num_decodes = None
    if PATHS[path]:
        q_lens, contexts, num_decodes = decodes_first(q_lens, contexts)
    batch = make_batch(7, shapes, q_lens, contexts)
    out, lse = ragged_paged_attention(**batch, sm_scale=0.125, impl=IMPL,
                                      block_sizes=tiling_of(shapes), num_decodes=num_decodes,
                                      sliding_window=20)
    assert_matches_oracle(out, lse, batch, 0.125, sliding_window=20)


def window_tile_keys(shapes) -> int:
    """Keys of one K/V tile of the kernel at the shape's tiling."""
    return min(tiling_of(shapes).kv_pages_per_block, shapes.pages_per_seq) * shapes.page_size


@pytest.mark.parametrize("path", PATHS)
def test_sliding_window_skips_tiles_before_the_window(path):
    """Tiles wholly before a block's window are neither copied nor computed: their pages
    hold NaN here (read and masked, 0 x NaN would reach the output)."""
    shapes = SHAPES[3]
    q_lens, contexts = [1, 13, 1, 9], [70, 37, 3, 40]
    num_decodes = None
    if PATHS[path]:
        q_lens, contexts, num_decodes = decodes_first(q_lens, contexts)
    batch = make_batch(8, shapes, q_lens, contexts)
    # The first key each query's window reaches: position context + i, minus 19.
    starts = np.zeros(shapes.num_tokens, np.int32)
    starts[:sum(q_lens)] = np.concatenate([np.maximum(c + np.arange(n) - 19, 0)
                                           for n, c in zip(q_lens, contexts)])
    poisoned = poison_skipped_pages(batch, starts, window_tile_keys(shapes))
    assert np.isnan(poisoned["v_pages"]).any()
    out, lse = ragged_paged_attention(**poisoned, sm_scale=0.125, impl=IMPL,
                                      block_sizes=tiling_of(shapes), num_decodes=num_decodes,
                                      sliding_window=20)
    assert_matches_oracle(out, lse, batch, 0.125, sliding_window=20)


@pytest.mark.parametrize("path", PATHS)
def test_window_starts_equal_the_oracle_and_skip_tiles(path):
    """A window over a KV shard's keys (window_starts, the prefix mode): each query from
    its own first key; a sequence all of whose windows start past its keys reads no tile
    (out 0, lse -inf); tiles wholly before every window of a block are not read (NaN)."""
    shapes = SHAPES[3]
    q_lens, contexts, num_decodes = [1, 13, 1, 9], [70, 37, 3, 40], None
    if PATHS[path]:
        q_lens, contexts, num_decodes = decodes_first(q_lens, contexts)
    batch, starts = shard_window_batch(9, shapes, q_lens, contexts,
                                       starts_past=q_lens.index(13))
    poisoned = poison_skipped_pages(batch, starts, window_tile_keys(shapes))
    assert np.isnan(poisoned["v_pages"]).any()
    out, lse = ragged_paged_attention(**poisoned, sm_scale=0.125, impl=IMPL,
                                      block_sizes=tiling_of(shapes), num_decodes=num_decodes,
                                      causal=False, window_starts=starts)
    assert_matches_oracle(out, lse, batch, 0.125, causal=False, window_starts=starts)
    chunk = q_lens.index(13)
    past = slice(batch["cu_q_lens"][chunk], batch["cu_q_lens"][chunk + 1])
    assert np.isneginf(np.asarray(lse)[past]).all()


def test_per_layer_window_under_the_layer_scan():
    """Gemma-3's sliding and full layers through the model's attention: the window chosen
    per layer by a lax.cond between the kernel's windowed and full variants."""
    shapes = SHAPES[3]
    q_lens, contexts, num_decodes = decodes_first([1, 13, 1, 9], [50, 37, 3, 0])
    assert_per_layer_window(IMPL, shapes, q_lens, contexts, 20, num_decodes=num_decodes,
                            seed=7)
