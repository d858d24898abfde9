"""The prefill-pool simulation (seed 001): Eq. 2 on absolute queues, the baselines, the
offline improvement-rate search."""

import numpy as np
import pytest

from medha_jax.cluster.prefill_pool_sim import (PROFILE_SAMPLE_SEED_STRIDE, poisson_arrivals,
                                                profile_improvement_rates,
                                                simulate_prefill_pool)
from medha_jax.scheduler.cdsp import (AdaptiveImprovementRate, CdspConfig, CdspScheduler,
                                      FixedSpScheduler, LatencyModel, table1_latency_models,
                                      table1_tabulated)
from medha_jax.workloads import TETRIS_SHORT_PROMPT


def test_fixed_sp_groups_queue_requests_by_eq2():
    models = table1_tabulated()
    # Three 32k requests at t = 0, 0, 0.1 on two SP-8 groups: the third waits for the first.
    result = simulate_prefill_pool([32768] * 3, [0.0, 0.0, 0.1],
                                   FixedSpScheduler(16, 8, models[8]))
    assert result.ttft_s == pytest.approx([0.58, 0.58, 2 * 0.58 - 0.1])
    assert [p.chunks[0].group[0] for p in result.plans] == [0, 8, 0]
    assert result.busy_instance_s == pytest.approx(3 * 8 * 0.58)
    assert result.makespan_s == pytest.approx(1.16)


def test_elastic_sp_is_one_chunk_per_request_and_cdsp_chunks_into_the_gap():
    models = table1_tabulated()
    lengths, arrivals = [16384, 131072], [0.0, 0.0]
    elastic = simulate_prefill_pool(lengths, arrivals, CdspScheduler(
        16, models, CdspConfig(chunking=False, improvement_rate=0.0, sp_sizes=(8, 16))))
    assert [p.sp_sizes for p in elastic.plans] == [(8,), (16,)]
    assert elastic.ttft_s == pytest.approx([0.31, 0.31 + 2.31])
    cdsp = simulate_prefill_pool(lengths, arrivals, CdspScheduler(
        16, models, CdspConfig(improvement_rate=0.0, sp_sizes=(8, 16))))
    assert cdsp.plans[1].sp_sizes == (8, 16)
    assert cdsp.ttft_s[1] == pytest.approx(0.31 + 2.31 - 0.46)


def test_device_models_move_the_clock_and_later_requests_see_it():
    plan_models = {8: LatencyModel(8, 0.0, 1e-5, 0.0, 0.0)}
    device = {8: LatencyModel(8, 0.0, 2e-5, 0.0, 0.0)}     # the device is 2x slower
    result = simulate_prefill_pool([10_000, 10_000], [0.0, 0.0],
                                   FixedSpScheduler(8, 8, plan_models[8]),
                                   device_models=device)
    assert result.ttft_s == pytest.approx([0.2, 0.4])


def test_profile_keeps_the_rate_with_the_least_mean_ttft():
    models = table1_latency_models()

    def make():
        return CdspScheduler(16, models, CdspConfig())

    def sample(n, seed):
        return TETRIS_SHORT_PROMPT.sample(np.random.default_rng(seed), n)

    candidates = (0.05, 0.75)
    table = profile_improvement_rates(sample, [1.0, 5.0], candidates, make, num_requests=150,
                                      seed=3)
    for i, rate in enumerate(table.arrival_rates):
        lengths, arrivals = sample(150, 3 + 1000 * i), poisson_arrivals(150, rate, 3 + 1000 * i)
        means = [np.mean(simulate_prefill_pool(lengths, arrivals, make(),
                                               improvement_rate=r).ttft_s) for r in candidates]
        assert table.improvement_rates[i] == candidates[int(np.argmin(means))]
    # Under load the adaptive rate follows the arrivals, from the first ones on.
    adaptive = AdaptiveImprovementRate(table)
    result = simulate_prefill_pool(sample(100, 9), poisson_arrivals(100, 5.0, 9), make(),
                                   improvement_rate=adaptive)
    assert result.improvement_rates[-1] == table.lookup(5.0)


def test_profile_over_several_traces_scores_all_their_requests_together():
    models = table1_latency_models()

    def make():
        return CdspScheduler(16, models, CdspConfig())

    def sample(n, seed):
        return TETRIS_SHORT_PROMPT.sample(np.random.default_rng(seed), n)

    # At seed 8 trace 0 alone would pick 0.75 and the two together pick 0.3.
    candidates, rate = (0.05, 0.3, 0.75), 5.0
    table = profile_improvement_rates(sample, [rate], candidates, make, num_requests=100,
                                      seed=8, statistic="p50", samples=2)
    seeds = (8, 8 + PROFILE_SAMPLE_SEED_STRIDE)   # trace 0 keeps a one-trace profile's seed
    p50s = [np.percentile(np.concatenate([
        simulate_prefill_pool(sample(100, s), poisson_arrivals(100, rate, s), make(),
                              improvement_rate=r).ttft_s for s in seeds]), 50)
            for r in candidates]
    assert table.improvement_rates == (candidates[int(np.argmin(p50s))],)
    with pytest.raises(ValueError, match="samples must be >= 1"):
        profile_improvement_rates(sample, [rate], candidates, make, num_requests=10,
                                  samples=0)


def test_bad_input_names_the_problem():
    with pytest.raises(ValueError, match="one arrival per prompt"):
        simulate_prefill_pool([1, 2], [0.0], FixedSpScheduler(8, 8, table1_tabulated()[8]))
