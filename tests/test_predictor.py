"""Runtime predictors, hardware presets and the prefill time cache (Algorithm 3)."""

import random

import numpy as np
import pytest

from medha_jax.config import ParallelConfig, model_preset
from medha_jax.request import Batch, Request, ScheduledChunk
from medha_jax.scheduler.hardware import (CPU_STAND_IN, HARDWARE_PRESETS, HardwareSpec,
                                          hardware_for_device_kind, hardware_preset)
from medha_jax.scheduler.packer import EngineLimits
from medha_jax.scheduler.prefill_time_cache import PrefillTimeCache
from medha_jax.scheduler.predictor import (AnalyticalPredictor, BatchFeatures, ProfiledPredictor,
                                           batch_features, padded_size)

LLAMA_8B = model_preset("llama3-8b")


def _chunk(num_tokens, start, prompt_len=None, output=0):
    r = Request("r", prompt_len or start + num_tokens, 8, 0.0)
    r.output_token_ids.extend([1] * output)
    return ScheduledChunk(r, start, num_tokens)


def _prefill(num_tokens, context=0, samples=False):
    return BatchFeatures().plus_chunk(num_tokens, context, samples)


def test_hardware_presets_and_errors():
    assert set(HARDWARE_PRESETS) == {"a100", "h100", "h200", "tpu-v5e", "tpu-v5p"}
    h100 = hardware_preset("h100")
    assert h100.peak_flops == 989e12 and h100.hbm_bandwidth == 3.35e12
    assert hardware_preset("h200").hbm_bandwidth > h100.hbm_bandwidth
    with pytest.raises(ValueError, match="unknown hardware preset 'b200'.*a100"):
        hardware_preset("b200")
    with pytest.raises(ValueError, match="peak_flops"):
        HardwareSpec(name="x", peak_flops=0, hbm_bandwidth=1, interconnect_bandwidth=1,
                     memory_bytes=1)


def test_every_device_kind_key_has_a_preset():
    from pallas_kernels.block_sizes import FALLBACK_KIND, GPU_KINDS, TPU_KINDS, device_kind_of

    for kind in GPU_KINDS + TPU_KINDS + tuple(FALLBACK_KIND.values()):
        assert hardware_for_device_kind(kind).name == kind
    assert device_kind_of() == "cpu"                                # the suite's devices
    assert hardware_for_device_kind("cpu") == hardware_preset(CPU_STAND_IN)


def test_batch_features_by_hand():
    decode = _chunk(1, 300, prompt_len=299, output=2)       # context 300 -> 301
    first = _chunk(64, 0, prompt_len=200)                  # [0, 64), does not sample
    last = _chunk(36, 164, prompt_len=200)                 # [164, 200), samples
    f = batch_features(Batch([decode, first, last]), token_buckets=(64, 128, 256))
    assert f == BatchFeatures(tokens=101, padded_tokens=128, seqs=3,
                              sum_chunk_x_context=301 + 64 * 64 + 36 * 200,
                              sum_chunk_sq=1 + 64 * 64 + 36 * 36, sum_context=301 + 64 + 200,
                              sampling_tokens=1 + 36, prefill_chunks=2,
                              sum_prefill_context=64 + 200, max_decode_context=301,
                              max_context=301)
    assert padded_size(129, (64, 128, 256)) == 256 and padded_size(7, None) == 7
    with pytest.raises(ValueError, match="exceeds the largest bucket 256"):
        padded_size(257, (64, 128, 256))


def test_analytical_roofline_regimes():
    p = AnalyticalPredictor(LLAMA_8B, ParallelConfig(), "h100")
    h100 = hardware_preset("h100")
    eff = p.efficiency
    # One decode at a short context is bound by reading the weights once (all but the
    # embedding table, of which a step reads only its tokens' rows).
    embedding = LLAMA_8B.vocab_size * LLAMA_8B.hidden_size
    weights_s = 2 * (LLAMA_8B.num_params() - embedding) / (h100.hbm_bandwidth * eff.hbm)
    decode = _prefill(1, 100, samples=True)
    assert p.predict_features(decode) == pytest.approx(eff.step_overhead_s + weights_s, rel=0.05)
    # A large chunk at context 0 is bound by the linear layers' FLOPs.
    n = 8192
    t = p.predict_features(_prefill(n))
    linear_flops = 2 * (LLAMA_8B.num_params() - 2 * LLAMA_8B.vocab_size * LLAMA_8B.hidden_size) * n
    linear_s = linear_flops / (h100.peak_flops * eff.matmul)
    assert linear_s < t < 1.5 * linear_s
    # Work grows with chunk size and with context.
    assert p.predict_features(_prefill(512, 0)) < p.predict_features(_prefill(1024, 0))
    assert p.predict_features(_prefill(512, 0)) < p.predict_features(_prefill(512, 100_000))


def test_parallelism_in_the_analytical_model():
    def t(parallel, features):
        return AnalyticalPredictor(LLAMA_8B, parallel, "h100").predict_features(features)

    big = _prefill(8192)
    assert t(ParallelConfig(tp=8), big) < t(ParallelConfig(tp=1), big) / 4     # TP divides the work
    assert t(ParallelConfig(tp=8), big) > t(ParallelConfig(tp=1), big) / 8     # + all-reduces
    # SPP: a step is priced as one stage (about layers / spp), whatever it samples; the
    # pipeline's depth is the executor's (tests/test_simulator.py, tests/test_in_flight.py).
    sampling = _prefill(8192, samples=True)
    decodes = BatchFeatures(64, 64, 64, 64 * 5000, 64, 64 * 5000, 64,
                            max_decode_context=5000)
    for features in (big, sampling, decodes, big.plus_chunk(1, 5000, True)):
        one_stage = t(ParallelConfig(spp=4), features)
        assert t(ParallelConfig(), features) / 4.5 < one_stage < t(ParallelConfig(), features) / 3
    # KVP splits attention over a long context: a small chunk at 1M tokens nearly halves.
    late = _prefill(256, 1_000_000)
    assert t(ParallelConfig(kvp=2), late) < 0.6 * t(ParallelConfig(), late)


def _random_features(rng, buckets):
    """A few prefill chunks and decodes (half of the chunks are single tokens)."""
    f = BatchFeatures()
    for _ in range(rng.randint(1, 6)):
        n = 1 if rng.random() < 0.5 else rng.randint(2, 512)
        f = f.plus_chunk(n, rng.randint(0, 50_000), n == 1)
    return f._replace(padded_tokens=padded_size(f.tokens, buckets))


def test_features_split_prefill_chunks_from_decodes():
    f = (BatchFeatures().plus_chunk(1, 99, True).plus_chunk(30, 10, False)
         .plus_chunk(1, 499, True).plus_chunk(2, 0, True))
    assert (f.prefill_chunks, f.sum_prefill_context, f.max_decode_context) == (2, 40 + 2, 500)
    batch = Batch([_chunk(1, 99), _chunk(30, 10), _chunk(1, 499), _chunk(2, 0)])
    assert batch_features(batch) == f._replace(sampling_tokens=batch_features(batch).sampling_tokens)


@pytest.mark.parametrize("noise", [0.0, 0.02])
def test_profiled_fit_recovers_known_coefficients(noise):
    rng = random.Random(0)
    buckets = (128, 256, 512, 1024, 2048, 4096)
    true = (2e-3, 3e-6, 4e-10, 5e-9, 1e-3, 2e-8, 6e-9, 3e-8)
    records = []
    for _ in range(400):
        f = _random_features(rng, buckets)
        exact = (true[0] + true[1] * f.padded_tokens + true[2] * f.sum_chunk_x_context
                 + true[3] * f.sum_chunk_sq + true[4] * f.prefill_chunks
                 + true[5] * f.sum_prefill_context
                 + true[6] * (f.sum_context - f.sum_prefill_context)
                 + true[7] * f.max_decode_context)
        records.append((f, exact * (1 + rng.gauss(0, noise))))
    fitted = ProfiledPredictor.fit(records, token_buckets=buckets)
    assert np.allclose(fitted.coefficients, true, rtol=1e-6 if noise == 0 else 0.25)
    assert fitted.median_rel_error <= noise + 1e-9
    assert fitted.p90_rel_error <= 2 * noise + 1e-9
    assert fitted.num_records == 400
    f, seconds = records[0]
    assert fitted.predict_features(f) == pytest.approx(seconds, rel=1e-6 if noise == 0 else 0.1)


def test_profiled_predictor_json_round_trip(tmp_path):
    rng = random.Random(1)
    records = [(f, 1e-3 + 2e-6 * f.padded_tokens + 1e-9 * f.sum_chunk_sq)
               for f in (_random_features(rng, None) for _ in range(50))]
    fitted = ProfiledPredictor.fit(records, token_buckets=(64, 128))
    path = tmp_path / "predictor.json"
    fitted.save(path)
    loaded = ProfiledPredictor.load(path)
    assert loaded.coefficients == fitted.coefficients
    assert loaded.token_buckets == fitted.token_buckets == (64, 128)
    assert loaded.median_rel_error == fitted.median_rel_error
    batch = Batch([_chunk(100, 50)])
    assert loaded.predict(batch) == fitted.predict(batch) > 0
    with pytest.raises(ValueError, match="at least 8 records"):
        ProfiledPredictor.fit(records[:6])
    with pytest.raises(ValueError, match=">= 0"):
        ProfiledPredictor([1.0, -1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="need 8 coefficients"):
        ProfiledPredictor([1.0, 1.0, 0.0, 0.0])


def test_prefill_time_cache_is_algorithm_3():
    predictor = AnalyticalPredictor(LLAMA_8B, ParallelConfig(tp=8), "h100")
    limits = EngineLimits(token_buckets=(256, 512, 1024, 2048, 4096, 8192))
    cache = PrefillTimeCache(predictor, limits, max_len=200_000, t_target=0.05, step=1024)
    # Adaptive chunking made visible: chunks shrink as the context grows.
    sizes = cache.chunk_sizes()
    assert sizes[0] == 8192                         # the largest bucket fits at context 0
    assert sizes[-2] < sizes[0] / 4
    body = sizes[:-1]                               # the last one is whatever is left
    assert all(b <= a + 256 for a, b in zip(body, body[1:]))   # non-increasing, up to bucket steps
    # The table: C[0] = 0, then every `step` tokens up to max_len.
    table = cache.table()
    assert table[0] == (0, 0.0) and table[-1][0] == 200_000
    assert [l for l, _ in table[:-1]] == list(range(0, 200_000, 1024))
    # Monotone, and interpolation close to the exact lone-prefill simulation.
    assert cache.prefill_time(0) == 0.0
    lengths = [1, 10, 1000, 1024, 5000, 77_777, 200_000]
    times = [cache.prefill_time(l) for l in lengths]
    assert all(a < b for a, b in zip(times, times[1:]))
    for l in (20_000, 77_777, 150_001):
        assert cache.prefill_time(l) == pytest.approx(cache._simulated(l), rel=0.01)
    # Within one padded chunk the exact curve steps at bucket edges; interpolation smooths it.
    assert cache.prefill_time(5000) == pytest.approx(cache._simulated(5000), rel=0.1)
    # A short prompt costs a whole step, not a sliver of the first table interval.
    assert cache.prefill_time(10) > 0.5 * predictor.predict_features(_prefill(10, samples=True))
    # w(t) = C[total] - C[computed]
    r = Request("r", 100_000, 8, 0.0)
    r.num_computed_tokens = 30_000
    expected = cache.prefill_time(100_000) - cache.prefill_time(30_000)
    assert cache.remaining_work(r) == pytest.approx(expected)
    with pytest.raises(ValueError, match="outside the cache's range"):
        cache.prefill_time(200_001)


def test_kvp_prices_the_busiest_shard_and_the_merge():
    from medha_jax.config import ParallelConfig, model_preset

    config = model_preset("llama3-8b")
    decode = BatchFeatures().plus_chunk(1, 1_000_000, True)      # one decode at 1M tokens
    one = AnalyticalPredictor(config, ParallelConfig(tp=8), "h100")
    spread = AnalyticalPredictor(config, ParallelConfig(tp=8, kvp=4), "h100")
    # Progressive placement: 1M tokens fill 2 shards of 512K, the other two hold nothing.
    two_shards = AnalyticalPredictor(config, ParallelConfig(tp=8, kvp=4), "h100",
                                     kv_tokens_per_shard=512 * 1024)
    t1, t4, t2 = (p.predict_features(decode) for p in (one, spread, two_shards))
    assert t4 < t2 < t1
    # The KV read of the busiest shard dominates a long decode: about 1/4 and 1/2 of kvp=1's.
    kv1 = t1 - one.predict_features(BatchFeatures().plus_chunk(1, 0, True))
    assert 0.2 < (t4 - spread.predict_features(BatchFeatures().plus_chunk(1, 0, True))) / kv1 < 0.35
    # The merge costs something per layer even for a short context.
    short = BatchFeatures().plus_chunk(1, 100, True)
    assert spread.predict_features(short) > one.predict_features(short)


def _random_base(rng, buckets):
    """Features of a random batch of decodes and prefill chunks (within the buckets)."""
    base = BatchFeatures()
    for _ in range(rng.randint(0, 12)):
        n = rng.choice([1, 1, 1, rng.randint(2, 300)])
        if base.tokens + n > buckets[-1] // 2:
            break
        base = base.plus_chunk(n, rng.randint(0, 200_000), rng.random() < 0.3, buckets)
    return base


@pytest.mark.parametrize("parallel", [ParallelConfig(), ParallelConfig(tp=8),
                                      ParallelConfig(tp=2, spp=2), ParallelConfig(kvp=2),
                                      ParallelConfig(cp=2)])
@pytest.mark.parametrize("buckets", [(16, 64, 256, 1024, 4096), None])
def test_chunk_time_is_exactly_predict_features_of_plus_chunk(parallel, buckets):
    """The packer prices every chunk it considers through chunk_time: the very same
    float as predict_features(base.plus_chunk(...)) (the same batches as before), for the
    analytical roofline (every axis) and a profiled fit (decode and prefill terms); and
    plus_chunk_time, which prices a rider's whole rest, those features with that float."""
    from medha_jax.scheduler.predictor import chunk_time, plus_chunk_time
    rng = random.Random(hash((str(parallel), buckets)) % 2**32)
    profiled = ProfiledPredictor([rng.uniform(0, 1e-2) * 10 ** -rng.randint(0, 9)
                                  for _ in range(8)], token_buckets=buckets)
    for predictor in (AnalyticalPredictor(LLAMA_8B, parallel, "h100", token_buckets=buckets),
                      profiled):
        for _ in range(40):
            base = _random_base(rng, buckets or (8192,))
            start, remaining = rng.randint(0, 500_000), rng.randint(1, 3000)
            cap = min(remaining, (buckets or (8192,))[-1] - base.tokens)
            for n in {1, 2, 3, cap, max(1, cap // 2), rng.randint(1, cap)}:
                want = predictor.predict_features(base.plus_chunk(n, start, n == remaining,
                                                                  buckets))
                got = chunk_time(predictor, base, n, start, remaining, buckets)
                assert got == want, (predictor, base, start, remaining, n)
                features = base.plus_chunk(n, start, n == remaining, buckets)
                assert plus_chunk_time(predictor, base, n, start, remaining, buckets) == (
                    features, want), (predictor, base, start, remaining, n)
