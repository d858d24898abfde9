"""The discrete-event simulator: real controllers on a virtual clock."""

import random

import numpy as np
import pytest

from medha_jax.config import ParallelConfig, model_preset
from medha_jax.request import SLO, FinishReason, Request, RequestState
from medha_jax.sampling_params import SamplingParams
from medha_jax.scheduler.hardware import hardware_preset
from medha_jax.simulator import CountingAllocator, kv_capacity_tokens, simulate
from medha_jax.workloads import TraceRequest, to_requests

LLAMA_8B = model_preset("llama3-8b")
TP8 = ParallelConfig(tp=8)


def _workload(n, *, qps, long_fraction, long_range=(64_000, 256_000), seed=0, sessions=0):
    """Short chat-like requests with a few long documents, Poisson arrivals."""
    rng = random.Random(seed)
    requests, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(qps)
        long = rng.random() < long_fraction
        prompt = rng.randint(*long_range) if long else rng.randint(20, 2000)
        requests.append(Request(
            f"{'long' if long else 'short'}-{i}", prompt, rng.randint(1, 200), t,
            slo=SLO(ttft_s=60.0 if long else 1.0, tpot_s=0.1),
            session_id=f"s{rng.randrange(sessions)}" if sessions else None,
            sampling=SamplingParams(temperature=0.0, stop_token_ids=[0])))   # sim tokens are 0
    return requests


def _short_ttft_p99(result):
    return float(np.percentile([r.first_token_time - r.arrival_time for r in result.requests
                                if r.request_id.startswith("short")], 99))


def test_a_mixed_run_finishes_every_request():
    requests = _workload(300, qps=4.0, long_fraction=0.05)
    result = simulate(requests, scheduler="lars-mp", model=LLAMA_8B, parallel=TP8, hardware="h100")
    assert len(result.requests) == 300 and result.num_rejected == 0
    for original, r in zip(requests, result.requests):
        assert r.request_id == original.request_id and r is not original
        assert r.state is RequestState.FINISHED and r.finish_reason is FinishReason.LENGTH
        assert len(r.output_token_ids) == r.max_new_tokens     # eos and stop ids are off
        assert r.arrival_time <= r.first_scheduled_time <= r.first_token_time <= r.finish_time
    # The inputs are left as they were, so one list serves every policy.
    assert all(r.state is RequestState.WAITING and not r.output_token_ids for r in requests)
    last_finish = max(r.finish_time for r in result.requests)
    assert result.makespan_s == pytest.approx(last_finish - min(r.arrival_time for r in requests))
    assert result.num_iterations > 300 and result.hardware == "h100"
    assert result.predictor == "AnalyticalPredictor"


def test_lars_beats_fcfs_np_on_short_ttft_in_a_convoy():
    # Long prompts every ~10 s, each taking seconds to prefill: a convoy for FCFS.
    requests = _workload(400, qps=8.0, long_fraction=0.03)
    lars = simulate(requests, scheduler="lars-mp", model=LLAMA_8B, parallel=TP8, hardware="h100")
    fcfs = simulate(requests, scheduler="fcfs-np", model=LLAMA_8B, parallel=TP8, hardware="h100")
    assert all(r.state is RequestState.FINISHED for r in lars.requests + fcfs.requests)
    assert _short_ttft_p99(lars) < _short_ttft_p99(fcfs) / 5


def test_replicas_share_the_load_and_keep_sessions_together():
    requests = _workload(200, qps=20.0, long_fraction=0.0, sessions=12)
    result = simulate(requests, scheduler="lars", model=LLAMA_8B, parallel=TP8, hardware="h100",
                      num_replicas=3)
    assert result.num_replicas == 3
    replicas_of_session = {}
    for r in requests:
        replicas_of_session.setdefault(r.session_id, set()).add(result.replica_of[r.request_id])
    assert all(len(replicas) == 1 for replicas in replicas_of_session.values())
    assert len(set(result.replica_of.values())) == 3
    # Without sessions the least-loaded replica takes each request: all three stay busy.
    plain = [Request(r.request_id, r.prompt_len, r.max_new_tokens, r.arrival_time)
             for r in requests]
    counts = np.bincount(list(simulate(plain, scheduler="lars", model=LLAMA_8B, parallel=TP8,
                                       hardware="h100", num_replicas=3).replica_of.values()))
    assert counts.min() > 200 / 3 / 2


def test_requests_that_cannot_fit_are_rejected_and_the_rest_served():
    capacity = kv_capacity_tokens(LLAMA_8B, ParallelConfig(), hardware_preset("a100"))
    # (80 GiB x 0.9 - 16 GB of bf16 weights) / 128 KiB of K and V per token.
    assert capacity == int((80 * 2**30 * 0.9 - 2 * LLAMA_8B.num_params()) // (32 * 8 * 128 * 2 * 2))
    requests = [Request("too-big", capacity + 100, 4, 0.0), Request("fine", 1000, 4, 0.5)]
    result = simulate(requests, scheduler="lars", model=LLAMA_8B, parallel=ParallelConfig(),
                      hardware="a100")
    too_big, fine = result.requests
    assert too_big.finish_reason is FinishReason.ERROR and "RESOURCE" in too_big.error
    assert fine.finish_reason is FinishReason.LENGTH and result.num_rejected == 1
    with pytest.raises(ValueError, match="no KV memory"):
        simulate(requests, scheduler="lars", model=model_preset("llama3-70b"),
                 parallel=ParallelConfig(), hardware="a100")


def test_time_limit_stops_the_clock():
    requests = _workload(100, qps=2.0, long_fraction=0.0)
    result = simulate(requests, scheduler="lars", model=LLAMA_8B, parallel=TP8, hardware="h100",
                      time_limit_s=10.0)
    start = requests[0].arrival_time
    done = [r for r in result.requests if r.finish_time is not None]
    assert 0 < len(done) < 100
    assert all(r.finish_time <= start + 10.0 + 1.0 for r in done)
    assert all(r.arrival_time > start + 5.0 for r in result.requests if r.first_token_time is None)


def test_counting_allocator_keeps_the_block_allocator_contract():
    a = CountingAllocator(num_pages=10, page_size=16)
    assert a.allocate("x") == 0 and a.has("x")
    assert a.reserve("x", 100) and a.num_free_pages == 10 - 7
    assert a.reserve("x", 50) and a.num_free_pages == 3          # never shrinks
    a.allocate("y")
    assert not a.reserve("y", 64) and a.num_free_pages == 3       # shortage changes nothing
    a.free("x")
    assert a.num_free_pages == 10 and not a.has("x")
    assert a.can_ever_fit(160) and not a.can_ever_fit(161)


class _Scaled:
    """A predictor `factor` times another's (a device slower than the scheduler thinks)."""

    def __init__(self, predictor, factor):
        self.predictor, self.factor = predictor, factor
        self.token_buckets = predictor.token_buckets

    def predict_features(self, features):
        return self.factor * self.predictor.predict_features(features)

    def predict(self, batch):
        return self.factor * self.predictor.predict(batch)


def test_device_predictor_moves_the_clock_and_predictor_plans():
    from medha_jax.scheduler import AnalyticalPredictor

    requests = _workload(60, qps=0.5, long_fraction=0.0, seed=3)   # an idle-ish server
    planner = AnalyticalPredictor(LLAMA_8B, TP8, hardware_preset("h100"))
    common = dict(scheduler="lars", model=LLAMA_8B, parallel=TP8, hardware="h100", predictor=planner)
    same = simulate(requests, **common)
    slow = simulate(requests, **common, device_predictor=_Scaled(planner, 2.0))
    # Requests run alone, so each one's decode time doubles with the device's step time.
    for fast_r, slow_r in zip(same.requests, slow.requests):
        assert slow_r.finish_time - slow_r.first_token_time == pytest.approx(
            2 * (fast_r.finish_time - fast_r.first_token_time), rel=0.2)
    assert same.num_rejected == slow.num_rejected == 0


def _multi_turn_trace(num_sessions=24, turns=4, gap_s=2.0, seed=0):
    """Chat sessions whose every turn extends the one before (the prefix cache's case)."""
    rng = random.Random(seed)
    trace = []
    for s in range(num_sessions):
        t, length = rng.uniform(0, 10), rng.randint(1000, 3000)
        for _ in range(turns):
            trace.append(TraceRequest(t, length, rng.randint(20, 100), f"s{s}"))
            t += gap_s + rng.expovariate(1.0)
            length += rng.randint(200, 1500)
    return sorted(trace, key=lambda r: r.arrival_s)


def test_predicted_time_routing_earns_the_cache_hits_round_robin_loses():
    """4 replicas with real prefix caches: the router that prices new tokens sends each
    turn where its session's prefix is cached; round-robin scatters the turns."""
    requests = to_requests(_multi_turn_trace(), vocab_size=32_000)
    results = {policy: simulate(requests, scheduler="lars-mp", model=LLAMA_8B,
                                parallel=ParallelConfig(), hardware="h100", num_replicas=4,
                                routing=policy, prefix_caching=True)
               for policy in ("predicted-time", "round-robin")}

    def hit_rate(result):
        return (sum(r.num_cached_tokens for r in result.requests)
                / sum(r.prompt_len for r in result.requests))

    fast, rr = results["predicted-time"], results["round-robin"]
    assert all(r.state is RequestState.FINISHED for r in fast.requests + rr.requests)
    assert hit_rate(fast) > hit_rate(rr) + 0.2
    assert fast.routing == "predicted-time" and len(fast.busy_s) == 4 and min(fast.busy_s) > 0
    with pytest.raises(ValueError, match="prompt token ids"):
        simulate(to_requests(_multi_turn_trace(2, 1)), scheduler="lars", model=LLAMA_8B,
                 parallel=ParallelConfig(), hardware="h100", prefix_caching=True)


def test_simulated_handoff_decodes_elsewhere_and_prices_the_transfer():
    """offload always (always-heavy at 1 token): every request prefills on its routed
    replica and decodes on the other; its output is whole; the decode side starts from
    the moved pages (cached, not recomputed). A 1 GB/s link delays each decode's start
    by its pages' transfer less what the prefill hid; shipped at the end, by all of it."""
    from medha_jax.cluster.offload import OffloadConfig

    requests = to_requests(_multi_turn_trace(4, 2), vocab_size=32_000)

    def run(link, stream_chunks=True, gate="always-heavy"):
        return simulate(requests, scheduler="lars-mp", model=LLAMA_8B,
                        parallel=ParallelConfig(), hardware="h100", num_replicas=2,
                        prefix_caching=True, stream_chunks=stream_chunks,
                        offload=OffloadConfig(gate, heavy_new_tokens=1, link_bytes_per_s=link,
                                              handshake_s=0.0))
    fast, slow, at_end = run(1e15), run(1e9), run(1e9, stream_chunks=False)
    for result in (fast, slow, at_end):
        assert all(r.state is RequestState.FINISHED for r in result.requests)
        assert all(len(r.output_token_ids) == r.max_new_tokens for r in result.requests)
        assert set(result.decoded_on) == {r.request_id for r in result.requests}
        assert all(result.decoded_on[r] != result.replica_of[r] for r in result.decoded_on)
    gap = lambda result: sum(r.finish_time - r.first_token_time for r in result.requests)  # noqa: E731
    assert gap(fast) < gap(slow) < gap(at_end)
    page_bytes = LLAMA_8B.kv_bytes_per_token(2) * 16
    moved = sum(r.prompt_len // 16 for r in requests) * page_bytes / 1e9
    # At most every prompt page at 1 GB/s (a turn 2 finds turn 1's pages there already).
    assert 0.3 * moved < gap(at_end) - gap(fast) <= 1.05 * moved
    never = run(1e9, gate="never")
    assert not never.decoded_on
    with pytest.raises(ValueError, match="offload needs prefix_caching"):
        simulate(requests, scheduler="lars", model=LLAMA_8B, parallel=ParallelConfig(),
                 hardware="h100", num_replicas=2, offload=OffloadConfig())
