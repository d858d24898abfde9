"""Sliding-window attention (Mistral) on the XLA path and the GPU kernel (interpret mode)
against the dense oracle, over one device and over KV shards and cp ranks; the TPU
kernel's checks against the oracle are in tpu_kernel_checks.py, its model-level ones here."""

import dataclasses
import functools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import BlockSizes, ragged_paged_attention
from pallas_kernels.dense_reference import dense_attention_oracle
from tests.attention_checks import (Shapes, assert_matches_oracle, assert_per_layer_window,
                                    decodes_first, make_batch, poison_skipped_pages,
                                    shard_window_batch,
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


# ------------------------------------------- a window over KV shards (kvp) and cp ranks

@pytest.mark.parametrize("impl, split, seed", [("xla", False, 0), ("xla", False, 1),
                                               ("interpret", False, 0),
                                               ("interpret", True, 1)])
def test_window_starts_equal_the_oracle(impl, split, seed):
    """Non-causal attention over a shard's keys with each query's own first key: decodes
    and chunks, windows starting before, inside and past the keys (a query that sees no
    key here gets out 0, lse -inf, which the merge ignores); the GPU kernel on the whole
    batch and on the decode/prefill split."""
    q_lens, contexts, num_decodes = [1, 13, 1, 9], [40, 37, 3, 0], None
    if split:
        q_lens, contexts, num_decodes = decodes_first(q_lens, contexts)
    batch, starts = shard_window_batch(seed, SHAPES, q_lens, contexts)
    first_chunk = int(np.argmax(np.array(q_lens) > 1))
    past = int(batch["cu_q_lens"][first_chunk])             # a chunk query past all its keys
    starts[past] = contexts[first_chunk] + 1
    out, lse = ragged_paged_attention(**batch, sm_scale=0.2, impl=impl, block_sizes=TILES,
                                      causal=False, window_starts=starts,
                                      num_decodes=num_decodes)
    assert_matches_oracle(out, lse, batch, 0.2, causal=False, window_starts=starts)
    assert np.isneginf(np.asarray(lse)[past]).all()
    full, _ = ragged_paged_attention(**batch, sm_scale=0.2, impl="xla", block_sizes=TILES,
                                     causal=False)
    live = slice(0, sum(q_lens))
    assert not np.allclose(np.asarray(out)[live], np.asarray(full)[live])


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
def test_gpu_kernel_skips_tiles_before_every_window(split):
    """Tiles wholly before every query's window_starts are not read: their pages hold NaN
    here (0 x NaN would reach the output if they were read and masked). A sequence wholly
    before its queries' windows (a KV shard with nothing inside them) reads no tile.
    One KV split: the LSE merge of splits would drop a NaN partial."""
    q_lens, contexts, num_decodes = [1, 13, 1, 9], [70, 37, 3, 20], None
    if split:
        q_lens, contexts, num_decodes = decodes_first(q_lens, contexts)
    batch, starts = shard_window_batch(4, SHAPES, q_lens, contexts,
                                       starts_past=q_lens.index(13))
    block_kv = TILES.kv_pages_per_block * SHAPES.page_size
    poisoned = poison_skipped_pages(batch, starts, block_kv)
    assert np.isnan(poisoned["v_pages"]).any()
    out, lse = ragged_paged_attention(**poisoned, sm_scale=0.2, impl="interpret",
                                      block_sizes=dataclasses.replace(TILES, num_kv_splits=1),
                                      causal=False, window_starts=starts,
                                      num_decodes=num_decodes)
    assert_matches_oracle(out, lse, batch, 0.2, causal=False, window_starts=starts)


def test_keys_before_is_cached_on_rank_for_a_traced_rank():
    from medha_jax.model import cp_layout
    from medha_jax.model.ring_attention import keys_before

    positions = np.arange(300)
    for ranks, page_size in [(2, 16), (4, 8), (3, 4)]:
        want = np.stack([cp_layout.cached_on_rank(int(p), ranks, page_size) for p in positions])
        got = np.stack([np.asarray(keys_before(positions, r, ranks, page_size))
                        for r in range(ranks)], axis=1)
        np.testing.assert_array_equal(got, want)


# A prompt over several 16-token pages and both shards (48 tokens a kvp shard), chunked
# prefill (chunks crossing pages) then decodes past the window (tiny-mistral's 20,
# tiny-gemma3's 24). Chunks of at most 16 tokens pad to one size: one program to compile
# per mesh, which is most of the interpreters' time.
WINDOW_PROMPT = 90
WINDOW_CHUNKS = [16, 13, 16, 10, 1, 1, 1, 1, 16, 15]


@functools.cache
def _one_device_logits(preset):
    from medha_jax import load_model

    ids = np.random.default_rng(3).integers(0, 256, size=WINDOW_PROMPT).tolist()
    return ids, load_model(preset, verbose=False).logits(ids)


@pytest.mark.parametrize("preset, parallel", [
    ("tiny-gemma3", "kvp=2"),
    pytest.param("tiny-mistral", "kvp=2", marks=pytest.mark.slow),
    pytest.param("tiny-mistral", "cp=2", marks=pytest.mark.slow),
    pytest.param("tiny-gemma3", "cp=2", marks=pytest.mark.slow)])
def test_a_window_over_kv_shards_gives_one_device_logits(preset, parallel):
    """Mistral's window on every layer, Gemma-3's on its sliding layers only: each shard
    attends the window's part of its own keys (none, for queries past its pages), and the
    merge equals one device; cp by both ring variants."""
    from medha_jax import ParallelConfig, load_model

    ids, want = _one_device_logits(preset)
    axis, degree = parallel.split("=")
    model = load_model(preset, parallel=ParallelConfig(**{axis: int(degree)}), verbose=False)
    runs = ({"cp_variant": v} for v in ("kv", "q")) if axis == "cp" else [
        {"kv_tokens_per_shard": 48}]
    for kw in runs:
        got = model.logits(ids, chunk_sizes=WINDOW_CHUNKS, **kw)
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0, err_msg=str(kw))
        assert (got.argmax(-1) == want.argmax(-1)).all(), kw


def _window_prompts(rng) -> dict[str, list[int]]:
    """Three prompts for the engine window tests: 12 tokens, and 70 and 45, longer than
    the tiny presets' windows (20 and 24)."""
    return {"short": rng.integers(0, 256, 12).tolist(),
            "long": rng.integers(0, 256, 70).tolist(),
            "mid": rng.integers(0, 256, 45).tolist()}


def assert_engine_serves_one_device_tokens(preset: str, parallel: str,
                                          attention_impl: str = "auto"):
    """Through the Engine: prompts longer than the window over both kvp shards (48 tokens
    a shard) or both cp ranks, random chunks, decodes batched with prefills past the
    window (the decode/prefill split of the kernels): one device's greedy tokens, and
    every page back."""
    from medha_jax import ParallelConfig, load_model
    from medha_jax.engine import Engine, EngineConfig
    from tests.hf_oracle import greedy_with_logits
    from tests.test_engine import drive, make_request

    rng = np.random.default_rng(8)
    prompts = _window_prompts(rng)
    one_device = load_model(preset, verbose=False)
    want = {rid: greedy_with_logits(one_device, p, 6) for rid, p in prompts.items()}
    axis, degree = parallel.split("=")
    model = load_model(preset, parallel=ParallelConfig(**{axis: int(degree)}),
                       attention_impl=attention_impl, verbose=False)
    kvp = {"max_tokens_per_kvp_group": 48} if axis == "kvp" else {}
    # Seats for the three requests and no more: the kernels run every seat of a step,
    # and in the TPU interpreter an empty seat costs as much as a used one.
    engine = Engine(model, EngineConfig(page_size=16, num_pages=16, max_tokens_per_step=32,
                                        min_token_bucket=16, max_seqs=4, **kvp))
    arrivals = [(0, make_request(rid, p, 6)) for rid, p in prompts.items()]
    assert drive(engine, arrivals, rng=rng, max_chunk=30) == want
    assert engine.allocator.num_free_pages == engine.allocator.num_pages


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["kvp=2", "cp=2"])
@pytest.mark.parametrize("preset", ["tiny-mistral", "tiny-gemma3"])
def test_engine_greedy_tokens_with_a_window_over_kv_shards(preset, parallel):
    assert_engine_serves_one_device_tokens(preset, parallel)

def _serve_with_logprobs(preset: str, parallel, **engine_config):
    """`_window_prompts` in random chunks through an Engine, decodes batched with
    prefills: (greedy tokens, logprobs as test_engine.drive fills them: the sampled
    tokens' and the prompts', top 3 each)."""
    from medha_jax import load_model
    from medha_jax.engine import Engine, EngineConfig
    from tests.test_engine import drive, make_request

    rng = np.random.default_rng(8)
    prompts = _window_prompts(rng)
    model = load_model(preset, parallel=parallel, verbose=False)
    engine = Engine(model, EngineConfig(page_size=16, num_pages=16, max_tokens_per_step=32,
                                        min_token_bucket=16, max_seqs=4, **engine_config))
    arrivals = [(0, make_request(rid, p, 6, logprobs=3, prompt_logprobs=3))
                for rid, p in prompts.items()]
    logprobs = {}
    done = drive(engine, arrivals, rng=rng, max_chunk=30, logprobs=logprobs)
    assert engine.allocator.num_free_pages == engine.allocator.num_pages
    return done, logprobs


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny-mistral", "tiny-gemma3"])
def test_a_window_over_kvp_groups_of_cp_rings_gives_one_device_logprobs(preset):
    """kvp = 2 groups of cp = 2 rings, 64 tokens a group: the 70-token prompt's second
    segment starts at 64, so its window maps into that group's keys from there. Logprobs
    of every prompt token and sampled token within 1e-4 of one device."""
    from medha_jax import ParallelConfig
    from tests.test_engine import assert_same_logprobs

    want_tokens, want = _serve_with_logprobs(preset, ParallelConfig())
    got_tokens, got = _serve_with_logprobs(preset, ParallelConfig(kvp=2, cp=2),
                                           max_tokens_per_kvp_group=64)
    assert got_tokens == want_tokens
    assert_same_logprobs(got, want)


_KERNEL_WINDOW_CHECK = """
import numpy as np
from medha_jax import ParallelConfig, load_model
from tests.test_sliding_window import WINDOW_CHUNKS, WINDOW_PROMPT
impl, preset, parallel = {args!r}
ids = np.random.default_rng(3).integers(0, 256, size=WINDOW_PROMPT).tolist()
want = load_model(preset, verbose=False).logits(ids)           # one device, the XLA path
degrees = {{axis: int(n) for axis, n in (p.split("=") for p in parallel.split(","))}}
model = load_model(preset, parallel=ParallelConfig(**degrees), attention_impl=impl,
                   verbose=False)
assert model.layout.attention_impl == impl
runs = [{{"cp_variant": v}} for v in ("kv", "q")] if "cp" in degrees else [
    {{"kv_tokens_per_shard": 48}}]
for kw in runs:
    got = model.logits(ids, chunk_sizes=WINDOW_CHUNKS, **kw)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0, err_msg=str(kw))
    assert (got.argmax(-1) == want.argmax(-1)).all(), kw
print("ok")
"""


# Slow (a child process each, 50 s to 4 min on 2 cores); the kernels' own checks against
# the dense oracle with window_starts run in the quick tests above and in
# tpu_kernel_checks.py. Between this test and the engine's below, each kernel runs both
# families over both kvp and cp (and cp with tp), in five child processes: the suite's
# 20-minute budget does not hold every combination (each passed when these landed).
@pytest.mark.slow
@pytest.mark.parametrize("impl, preset, parallel", [
    ("interpret", "tiny-gemma3", "kvp=2"),
    ("interpret", "tiny-mistral", "cp=2,tp=2"),
    ("interpret-tpu", "tiny-gemma3", "cp=2")])
def test_a_window_over_kv_shards_on_the_kernels_gives_one_device_logits(impl, preset,
                                                                         parallel):
    """The same as on the XLA path, with the Pallas kernels attending each shard's part
    of the window (window_starts): the GPU kernel in interpret mode, the TPU kernel in the
    TPU interpreter. In a child process with the mesh's devices (the interpreters are slow
    with many, and the TPU one hangs with 8: tests.attention_checks.run_on_devices)."""
    from tests.attention_checks import run_on_devices

    devices = int(np.prod([int(p.split("=")[1]) for p in parallel.split(",")]))
    script = _KERNEL_WINDOW_CHECK.format(args=(impl, preset, parallel))
    assert run_on_devices(script, devices).split()[-1] == "ok"


@pytest.mark.slow
@pytest.mark.parametrize("impl, preset, parallel", [("interpret", "tiny-gemma3", "cp=2"),
                                                    ("interpret-tpu", "tiny-mistral", "kvp=2")])
def test_engine_greedy_tokens_with_a_window_over_kv_shards_on_the_kernels(impl, preset,
                                                                            parallel):
    """`assert_engine_serves_one_device_tokens` on the kernels, in a child process (as
    above): the engine's steps put decodes on the kernels' decode path, window_starts
    included."""
    from tests.attention_checks import run_on_devices

    script = ("from tests.test_sliding_window import assert_engine_serves_one_device_tokens\n"
              f"assert_engine_serves_one_device_tokens({preset!r}, {parallel!r}, {impl!r})\n"
              "print('ok')")
    assert run_on_devices(script, 2).split()[-1] == "ok"
