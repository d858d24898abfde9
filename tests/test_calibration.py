"""Calibration: the sweep fits the profiled predictor and leaves the engine as it was."""

import numpy as np
import pytest

from medha_jax import load_model
from medha_jax.engine import Engine, EngineConfig
from medha_jax.engine.calibration import (borrow_batch, fit_predictor, release_batch,
                                          sweep_chunks)
from medha_jax.scheduler.predictor import BatchFeatures

SMALL = EngineConfig(max_kv_tokens=4096, max_tokens_per_step=128, min_token_bucket=16, max_seqs=8,
                     max_model_len=512, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def model():
    return load_model("tiny")


def test_fit_predictor_times_a_sweep_and_returns_every_page(model):
    engine = Engine(model, SMALL)
    predictor = fit_predictor(engine, repeats=1)
    assert engine.allocator.num_free_pages == engine.allocator.num_pages
    assert len(engine.step_records) == 0      # calibration steps are not traffic
    assert predictor.num_records == len(sweep_chunks(engine, np.random.default_rng(0))) >= 10
    assert predictor.token_buckets == engine.ladder.token_buckets
    assert np.isfinite(predictor.median_rel_error)
    # More work never predicts less time (the packer's binary search relies on it).
    buckets = engine.ladder.token_buckets
    small = predictor.predict_features(BatchFeatures().plus_chunk(16, 0, True, buckets))
    large = predictor.predict_features(BatchFeatures().plus_chunk(128, 384, True, buckets))
    assert large >= small > 0
    decodes = BatchFeatures().plus_chunk(1, 50, True, buckets)
    assert predictor.predict_features(decodes.plus_chunk(1, 900, True, buckets)) >= \
        predictor.predict_features(decodes) > 0
    with pytest.raises(ValueError, match="repeats=0 must be >= 1"):
        fit_predictor(engine, repeats=0)


def test_sweep_fits_the_cache_and_the_ladder(model):
    engine = Engine(model, EngineConfig(max_kv_tokens=1024, max_tokens_per_step=64, max_seqs=8,
                                        max_model_len=512))
    sweep = sweep_chunks(engine, np.random.default_rng(0))
    page_size = engine.allocator.page_size
    token_rungs = set()
    for chunks in sweep:
        tokens = sum(n for _, n in chunks)
        assert 1 <= len(chunks) <= engine.ladder.max_seqs and tokens <= engine.ladder.max_tokens
        assert sum(-(-(start + n) // page_size) for start, n in chunks) <= \
            engine.allocator.num_free_pages
        assert all(start + n <= engine.max_model_len for start, n in chunks)
        token_rungs.add(engine.ladder.token_bucket(tokens))
    assert token_rungs == set(engine.ladder.token_buckets)     # every token bucket is timed


def test_borrow_batch_reserves_and_release_returns_pages(model):
    engine = Engine(model, SMALL)
    free = engine.allocator.num_free_pages
    rng = np.random.default_rng(0)
    batch = borrow_batch(engine, [(40, 8), (0, 1), (20, 1)], rng)
    assert [(c.start, c.num_tokens) for c in batch.chunks] == [(40, 8), (0, 1), (20, 1)]
    assert all(c.request.num_computed_tokens == c.start for c in batch.chunks)
    assert engine.allocator.num_free_pages == free - (3 + 1 + 2)
    release_batch(engine, batch)
    assert engine.allocator.num_free_pages == free


def test_borrow_batch_that_does_not_fit_gives_back_what_it_took(model):
    engine = Engine(model, SMALL)                              # 4096 tokens of cache
    rng = np.random.default_rng(0)
    with pytest.raises(RuntimeError, match=r"chunk 1 \(start=200, num_tokens=1\) needs 201 "
                                           r"tokens of KV cache; 5 pages of 16 are free"):
        borrow_batch(engine, [(4000, 8), (200, 1)], rng)
    assert engine.allocator.num_free_pages == engine.allocator.num_pages
    release_batch(engine, borrow_batch(engine, [(4000, 8)], rng))   # the ids are free again
    assert engine.allocator.num_free_pages == engine.allocator.num_pages


@pytest.mark.parametrize("num_shards", [1, 4])
def test_borrow_batch_gives_back_every_page_whatever_fails_part_way(num_shards):
    """Each allocator call of a borrow fails in turn (raises or finds no room): every page
    taken so far returns, and a batch borrowed before is left alone."""
    from types import SimpleNamespace

    from medha_jax.kv_cache.allocator import BlockAllocator

    allocator = BlockAllocator(32, 16, num_shards=num_shards,
                               max_tokens_per_shard=128 if num_shards > 1 else None)
    engine = SimpleNamespace(allocator=allocator,
                             model=SimpleNamespace(config=SimpleNamespace(vocab_size=100)))
    rng = np.random.default_rng(0)
    chunks = [(40, 8), (100, 20), (0, 1), (200, 1)]
    held = borrow_batch(engine, [(30, 2)], rng)              # borrowed before, kept
    free = allocator.num_free_pages
    real = {name: getattr(allocator, name) for name in ("allocate", "reserve")}
    for name in real:
        for fail_at in range(len(chunks)):
            for failure in ("raise", "no room"):
                calls = []

                def failing(*args, name=name, fail_at=fail_at, failure=failure):
                    calls.append(1)
                    if len(calls) - 1 == fail_at:
                        if failure == "raise" or name == "allocate":
                            raise RuntimeError("injected")
                        return False
                    return real[name](*args)

                setattr(allocator, name, failing)
                try:
                    with pytest.raises(RuntimeError):
                        borrow_batch(engine, chunks, rng)
                finally:
                    setattr(allocator, name, real[name])
                assert allocator.num_free_pages == free, (name, fail_at, failure)
    # Two batches out at once do not collide, and each gives back its own pages.
    other = borrow_batch(engine, chunks, rng)
    release_batch(engine, other)
    assert allocator.num_free_pages == free
    release_batch(engine, held)
    assert allocator.num_free_pages == allocator.num_pages
