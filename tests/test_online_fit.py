"""The predictor a server starts from without a calibration sweep, and its online refit."""

import numpy as np
import pytest

from medha_jax import load_model
from medha_jax.engine import Engine, EngineConfig
from medha_jax.engine.online_fit import (REFIT_AT, OnlineRefit, prior_records,
                                         starting_predictor)
from medha_jax.scheduler.packer import EngineLimits
from medha_jax.scheduler.predictor import BatchFeatures, ProfiledPredictor
from medha_jax.scheduler.prefill_time_cache import PrefillTimeCache

SMALL = EngineConfig(max_kv_tokens=4096, max_tokens_per_step=128, min_token_bucket=16, max_seqs=8,
                     max_model_len=512)


@pytest.fixture(scope="module")
def engine():
    return Engine(load_model("tiny"), SMALL)


def test_starting_predictor_prices_more_work_higher_without_running_a_step(engine):
    analytical, how = starting_predictor(engine)
    assert "CPU peaks measured" in how
    assert len(engine.step_records) == 0 and engine.num_executables == 0
    buckets = engine.ladder.token_buckets
    one = analytical.predict_features(BatchFeatures().plus_chunk(1, 10, True, buckets))
    big = analytical.predict_features(BatchFeatures().plus_chunk(128, 300, True, buckets))
    assert np.isfinite(one) and big > one > 0
    refit = OnlineRefit.fitted_to_prior(engine, analytical.predict_features)
    rungs = {f.padded_tokens for f, _ in refit.prior}
    assert rungs == set(buckets)                      # every token bucket is priced
    assert refit.predictor.token_buckets == buckets


def test_refit_moves_the_predictor_to_the_measured_times(engine):
    """A prior 3x too fast; steps measured at the 'true' times: after the refits the
    predictor prices the measured shapes within 10%, in place (the same object)."""
    buckets = engine.ladder.token_buckets
    truth = ProfiledPredictor([4e-3, 2e-4, 1e-8, 1e-7, 1e-3, 1e-7, 2e-7, 1e-6],
                              token_buckets=buckets)
    refit = OnlineRefit.fitted_to_prior(engine, lambda f: truth.predict_features(f) / 3)
    predictor = refit.predictor
    rng = np.random.default_rng(0)
    shapes = [f for f, _ in prior_records(engine, truth.predict_features, seed=1)]
    before = [predictor.predict_features(f) / truth.predict_features(f) for f in shapes]
    assert np.median(before) < 0.5
    refitted = [refit.observe(shapes[i], truth.predict_features(shapes[i]))
                for i in rng.integers(0, len(shapes), REFIT_AT[-1])]
    assert sum(refitted) == len(REFIT_AT) and refit.predictor is predictor
    after = [predictor.predict_features(f) / truth.predict_features(f) for f in shapes]
    assert np.median(np.abs(np.subtract(after, 1))) < 0.1
    assert not refit.observe(shapes[0], float("nan"))          # a bad time is ignored


def test_prefill_time_cache_refresh_equals_a_new_cache():
    limits = EngineLimits(token_buckets=(16, 32, 64, 128), max_seqs_per_batch=8)
    predictor = ProfiledPredictor([4e-3, 2e-4, 1e-8, 1e-7, 1e-3, 1e-7, 2e-7, 1e-6],
                                  token_buckets=limits.token_buckets)
    cache = PrefillTimeCache(predictor, limits, max_len=4000, t_target=0.05, step=256)
    predictor.coefficients = tuple(3 * c for c in predictor.coefficients)
    cache.refresh(0.1)
    fresh = PrefillTimeCache(predictor, limits, max_len=4000, t_target=0.1, step=256)
    assert cache.table() == fresh.table() and cache.chunk_sizes() == fresh.chunk_sizes()
    assert cache(100) == fresh(100) and cache.t_target == 0.1


def test_a_server_refines_its_predictor_from_served_steps_and_saves_it(tmp_path):
    import json

    from medha_jax import SamplingParams
    from medha_jax.engine import cache_dirs
    from serving.server import Server
    from tests.test_server import TINY_ENGINE

    with Server("tiny", engine_config=TINY_ENGINE, cache_dir=tmp_path) as server:
        assert server.startup.predictor.startswith("derived from the roofline")
        predictor = server.controller.packer.predictor
        before = predictor.coefficients
        server.generate([[5, 6, 7, 8]] * 3, SamplingParams(temperature=0.0, max_tokens=24))
        assert server.replicas[0].refit.num_refits >= 1 and predictor.coefficients != before
        saved = json.loads(cache_dirs.predictor_path(tmp_path, server.engine).read_text())
        assert saved["refined_from_steps"] >= REFIT_AT[0]
        assert saved["predictor"]["coefficients"] == list(predictor.coefficients)
