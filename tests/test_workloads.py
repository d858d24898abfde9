"""Workload generators, trace files, public trace loaders and trace -> Requests."""

import os

import numpy as np
import pytest

from medha_jax.workloads import (MEDHA_SWE_OUTPUT, MEDHA_SWE_PROMPT, SHAREGPT4_OUTPUT,
                                 SHAREGPT4_PROMPT, LengthDistribution, SLOPolicy,
                                 TraceRequest, WorkloadSpec, fit_lengths, generate_workload,
                                 load_azure_trace, load_mooncake_trace, load_trace,
                                 request_id, save_trace, scale_lengths, to_requests)

TRACES = "/work/shared/traces"
needs_traces = pytest.mark.skipif(not os.path.isdir(TRACES), reason="public traces not present")


def _lengths(trace, field, long):
    return np.array([getattr(r, field) for r in trace if r.is_long == long])


def test_lognormal_through_percentiles_hits_them():
    dist = LengthDistribution.from_percentiles(1000, 3000)
    samples = dist.sample(np.random.default_rng(0), 40_000)
    p50, p90 = np.percentile(samples, [50, 90])
    assert p50 == pytest.approx(1000, rel=0.03)
    assert p90 == pytest.approx(3000, rel=0.03)


def test_clipping_keeps_bounds_and_percentiles_inside_them():
    samples = MEDHA_SWE_PROMPT.sample(np.random.default_rng(1), 40_000)
    assert samples.min() == 128_000 and samples.max() == 1_000_000
    p50, p90 = np.percentile(samples, [50, 90])
    assert p50 == pytest.approx(393_000, rel=0.03)
    assert p90 == pytest.approx(839_000, rel=0.03)


def test_fit_recovers_lognormal_parameters():
    rng = np.random.default_rng(2)
    samples = np.rint(rng.lognormal(np.log(700.0), 0.8, size=50_000)) + 1
    fitted = LengthDistribution.fit(samples)
    assert fitted.median == pytest.approx(700, rel=0.03)
    assert fitted.sigma == pytest.approx(0.8, rel=0.03)
    assert (fitted.min_tokens, fitted.max_tokens) == (samples.min(), samples.max())


def test_medha_mix_has_sharegpt_and_swe_shapes():
    trace = generate_workload(WorkloadSpec(num_requests=20_000, qps=1.0, long_fraction=0.5,
                                           seed=3))
    short_p, long_p = _lengths(trace, "prompt_tokens", False), _lengths(trace, "prompt_tokens", True)
    short_o, long_o = _lengths(trace, "output_tokens", False), _lengths(trace, "output_tokens", True)
    assert short_p.max() <= 8192 and long_p.min() >= 128_000 and long_p.max() <= 1_000_000
    assert np.median(short_p) == pytest.approx(1730, rel=0.05)
    assert np.median(short_o) == pytest.approx(415, rel=0.05)
    assert np.median(long_p) == pytest.approx(393_000, rel=0.05)
    assert np.percentile(long_o, 90) == pytest.approx(808, rel=0.05)
    assert (SHAREGPT4_PROMPT, SHAREGPT4_OUTPUT, MEDHA_SWE_OUTPUT) == (
        WorkloadSpec(num_requests=1, qps=1).short_prompt,
        WorkloadSpec(num_requests=1, qps=1).short_output,
        WorkloadSpec(num_requests=1, qps=1).long_output)


def test_same_seed_same_trace_and_exact_long_count():
    spec = WorkloadSpec(num_requests=401, qps=2.0, long_fraction=0.05, seed=7)
    a, b = generate_workload(spec), generate_workload(spec)
    assert a == b
    assert a != generate_workload(WorkloadSpec(num_requests=401, qps=2.0, seed=8))
    assert sum(r.is_long for r in a) == 20
    assert a[0].arrival_s == 0.0
    assert all(x.arrival_s <= y.arrival_s for x, y in zip(a, a[1:]))


@pytest.mark.parametrize("arrival, cv_range", [("poisson", (0.95, 1.05)), ("bursty", (2.5, 3.5))])
def test_arrival_rate_and_burstiness(arrival, cv_range):
    trace = generate_workload(WorkloadSpec(num_requests=20_000, qps=4.0, arrival=arrival,
                                           burst_cv=3.0, seed=4))
    gaps = np.diff([r.arrival_s for r in trace])
    assert 1 / gaps.mean() == pytest.approx(4.0, rel=0.06)
    assert cv_range[0] < gaps.std() / gaps.mean() < cv_range[1]


def test_scales_shrink_short_and_long_separately_then_cap():
    spec = dict(num_requests=200, qps=1.0, long_fraction=0.1, seed=5)
    full = generate_workload(WorkloadSpec(**spec))
    small = generate_workload(WorkloadSpec(**spec, short_scale=0.1, long_scale=0.01,
                                           output_scale=0.05, max_prompt_tokens=5000))
    for f, s in zip(full, small):
        scale = 0.01 if f.is_long else 0.1
        assert s.prompt_tokens == min(5000, max(1, round(f.prompt_tokens * scale)))
        assert s.output_tokens == max(1, round(f.output_tokens * 0.05))
        assert (s.arrival_s, s.is_long) == (f.arrival_s, f.is_long)
    assert scale_lengths(full) == full


@pytest.mark.parametrize("bad, field", [
    (dict(qps=0), "qps"), (dict(long_fraction=1.5), "long_fraction"),
    (dict(arrival="uniform"), "arrival"), (dict(arrival="bursty", burst_cv=0.5), "burst_cv"),
    (dict(long_scale=0), "long_scale"), (dict(num_requests=0), "num_requests")])
def test_spec_validation_names_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        WorkloadSpec(**{"num_requests": 10, "qps": 1.0, **bad})


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_trace_file_round_trip(tmp_path, suffix):
    trace = generate_workload(WorkloadSpec(num_requests=50, qps=3.0, long_fraction=0.1, seed=6))
    trace[3] = TraceRequest(trace[3].arrival_s, 12, 3, session_id="chat-1")
    trace[4] = TraceRequest(trace[4].arrival_s, 12, 3, prefix_blocks=(0, 7), block_tokens=8)
    path = tmp_path / f"trace{suffix}"
    save_trace(trace, path)
    assert load_trace(path) == trace
    with pytest.raises(ValueError, match="csv or .jsonl"):
        save_trace(trace, tmp_path / "trace.txt")


@needs_traces
def test_azure_conversation_trace_loads():
    trace = load_azure_trace(f"{TRACES}/azure2023_splitwise_conv.csv")
    assert len(trace) == 19_366
    assert trace[0].arrival_s == 0.0
    assert all(x.arrival_s <= y.arrival_s for x, y in zip(trace, trace[1:]))
    assert np.median([r.prompt_tokens for r in trace]) == pytest.approx(1020, rel=0.01)
    assert len(load_azure_trace(f"{TRACES}/azure2023_splitwise_conv.csv", limit=10)) == 10
    # Lognormals fitted to it: geometric means ~760 prompt and ~151 output tokens.
    prompt, output = fit_lengths(trace)
    assert prompt.median == pytest.approx(760, rel=0.01)
    assert output.median == pytest.approx(151, rel=0.01)
    assert (prompt.min_tokens, prompt.max_tokens) == (2, 14_050)


@needs_traces
def test_mooncake_sessions_come_from_shared_prefix_blocks():
    trace = load_mooncake_trace(f"{TRACES}/mooncake_conversation_trace.jsonl")
    assert len(trace) == 12_031
    assert trace[-1].arrival_s == pytest.approx(3537.0, abs=1.0)
    sessions = [r.session_id for r in trace]
    # Block 0 is shared by every request (a system prompt), so it does not name a session;
    # the second block does: thousands of sessions, some with many turns.
    assert "mc0" not in sessions
    counts = np.unique([s for s in sessions if s is not None], return_counts=True)[1]
    assert len(counts) > 1000 and counts.max() > 10
    # The blocks themselves are kept: every prompt fits in its 512-token blocks.
    assert all(r.block_tokens == 512 and r.prefix_blocks[0] == 0 for r in trace)
    assert all(r.prompt_tokens <= 512 * len(r.prefix_blocks) for r in trace)


def test_to_requests_assigns_slos_lengths_and_ids():
    trace = [TraceRequest(0.0, 100, 5), TraceRequest(1.5, 200_000, 7, is_long=True)]
    policy = SLOPolicy(short_ttft_s=1.5, long_ttft_factor=3.0, tpot_s=0.2)
    requests = to_requests(trace, slo_policy=policy, prefill_time_s=lambda n: n * 1e-4)
    short, long = requests
    assert (short.request_id, long.request_id) == (request_id(0), request_id(1))
    assert (short.prompt_len, short.max_new_tokens, short.arrival_time) == (100, 5, 0.0)
    assert short.slo.ttft_s == 1.5 and short.slo.tpot_s == 0.2
    assert long.slo.ttft_s == pytest.approx(3.0 * 20.0)
    assert long.prompt_token_ids is None
    assert long.sampling.ignore_eos and long.sampling.max_tokens == 7
    # A long request whose prefill is quick still gets at least the short deadline.
    quick = to_requests(trace, slo_policy=policy, prefill_time_s=lambda n: 0.0)[1]
    assert quick.slo.ttft_s == 1.5
    with pytest.raises(ValueError, match="prefill_time_s"):
        to_requests(trace, slo_policy=policy)


def test_synthetic_prompt_ids_are_seeded_and_share_session_prefixes():
    trace = [TraceRequest(0.0, 40, 2, "a"), TraceRequest(1.0, 60, 2, "a"),
             TraceRequest(2.0, 50, 2), TraceRequest(3.0, 50, 2)]
    reqs = to_requests(trace, vocab_size=97, seed=1, first_token_id=3)
    ids = [r.prompt_token_ids for r in reqs]
    assert [len(x) for x in ids] == [40, 60, 50, 50]
    assert all(3 <= t < 97 for x in ids for t in x)
    assert ids[1][:40] == ids[0]                       # the next turn extends the first
    assert ids[2] != ids[3]                            # no session: independent prompts
    again = [r.prompt_token_ids for r in to_requests(trace, vocab_size=97, seed=1,
                                                     first_token_id=3)]
    assert again == ids
    other = [r.prompt_token_ids for r in to_requests(trace, vocab_size=97, seed=2,
                                                     first_token_id=3)]
    assert other != ids


def test_prompt_ids_from_blocks_share_exactly_the_blocks_the_trace_shares():
    """Mooncake-style block ids: equal leading blocks give equal tokens, and the prompts part
    where the block ids part; scaling shrinks the blocks with the prompts."""
    trace = [TraceRequest(0.0, 20, 2, "s", prefix_blocks=(0, 1, 2), block_tokens=8),
             TraceRequest(1.0, 24, 2, "s", prefix_blocks=(0, 1, 3), block_tokens=8),
             TraceRequest(2.0, 12, 2, "t", prefix_blocks=(0, 4), block_tokens=8)]
    ids = [r.prompt_token_ids for r in to_requests(trace, vocab_size=1000, seed=3)]
    assert [len(x) for x in ids] == [20, 24, 12]
    assert ids[0][:16] == ids[1][:16] and ids[0][16:20] != ids[1][16:20]
    assert ids[2][:8] == ids[0][:8] and ids[2][8:12] != ids[0][8:12]
    half = scale_lengths(trace, short_prompt_scale=0.5)
    assert [r.block_tokens for r in half] == [4, 4, 4]
    small = [r.prompt_token_ids for r in to_requests(half, vocab_size=1000, seed=3)]
    assert small[0][:8] == small[1][:8] and small[0][8:10] != small[1][8:10]
    with pytest.raises(ValueError, match="block_tokens"):
        TraceRequest(0.0, 5, 1, prefix_blocks=(1,))


def test_tetris_lengths_have_the_papers_range_and_mean():
    from medha_jax.workloads import (TETRIS_LONG_PROMPT, TETRIS_MEDIUM_PROMPT,
                                     TETRIS_SHORT_PROMPT, LengthDistribution)
    rng = np.random.default_rng(0)
    for dist, lo, hi, mean in ((TETRIS_SHORT_PROMPT, 4_000, 95_000, 23_600),
                               (TETRIS_MEDIUM_PROMPT, 8_000, 142_000, 32_800),
                               (TETRIS_LONG_PROMPT, 16_000, 190_000, 50_100)):
        x = dist.sample(rng, 100_000)
        assert x.min() == lo and x.max() == hi
        assert x.mean() == pytest.approx(mean, rel=0.01)
    with pytest.raises(ValueError, match="min_tokens < mean < max_tokens"):
        LengthDistribution.from_range_and_mean(10, 100, 200)
