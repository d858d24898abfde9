"""Discrete-event simulation of a disaggregated prefill pool (seed 001, Tetris).

Every prefill instance is a queue of work (Eq. 2's q_i, kept as the absolute time it is free).
At each arrival (FCFS, in arrival order) the pool's scheduler makes the request's plan from
the queues now, and its chunks are booked in order: a chunk starts when the slowest instance
of its group is free and holds the whole group until it ends. A request's TTFT is when its
last chunk ends, minus its arrival (the KV hand-off to decode is not modelled here).

Schedulers (anything with `plan(tokens, queues, improvement_rate) -> Plan`):
  - `CdspScheduler` (CDSP; `chunking=False` with r = 0 is request-level elastic SP, the
    LoongServe-style baseline: one SP size per request, chosen at arrival for its own TTFT);
  - `FixedSpScheduler` (independent groups of a fixed SP size).

device_models: what a chunk takes on the simulated device (default: the scheduler's own
models, so a plan runs exactly as predicted). Different ones model a scheduler whose Eq. 1
is off; the booking then uses the device's times (the plan's groups and lengths are kept).

    result = simulate_prefill_pool(prompt_lens, arrivals, CdspScheduler(16, models),
                                   improvement_rate=AdaptiveImprovementRate(table))
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from medha_jax.scheduler.cdsp import (AdaptiveImprovementRate, ChunkLatency,
                                      ImprovementRateTable, Plan)


@dataclasses.dataclass
class PoolResult:
    """A finished pool simulation; times in seconds on the virtual clock."""

    ttft_s: list[float]              # per request, in input order
    plans: list[Plan]                # per request, in input order
    improvement_rates: list[float]   # the r each request was planned with
    decision_s: list[float]          # host seconds of each plan() call (wall)
    busy_instance_s: float           # sum over chunks of sp x seconds
    makespan_s: float                # first arrival to last first token

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.ttft_s, q))


def simulate_prefill_pool(prompt_lens: Sequence[int], arrivals: Sequence[float], scheduler, *,
                          improvement_rate: float | AdaptiveImprovementRate | None = None,
                          device_models: Mapping[int, ChunkLatency] | None = None
                          ) -> PoolResult:
    """Serves requests (prompt lengths, arrival seconds) on the scheduler's pool.

    improvement_rate: a fixed r, an `AdaptiveImprovementRate` (fed every arrival), or None
    (the scheduler's config).
    """
    if len(prompt_lens) != len(arrivals) or len(prompt_lens) == 0:
        raise ValueError(f"need one arrival per prompt and at least one: {len(prompt_lens)} "
                         f"prompts, {len(arrivals)} arrivals")
    n = scheduler.num_instances
    order = sorted(range(len(arrivals)), key=lambda k: arrivals[k])
    free_at = [float(arrivals[order[0]])] * n
    ttft = [math.nan] * len(arrivals)
    plans: list[Plan | None] = [None] * len(arrivals)
    rates = [math.nan] * len(arrivals)
    decision_s = []
    busy = 0.0
    last = -math.inf
    for k in order:
        now = float(arrivals[k])
        if isinstance(improvement_rate, AdaptiveImprovementRate):
            r = improvement_rate.observe(now)
        else:
            r = improvement_rate
        queues = [f - now if f > now else 0.0 for f in free_at]
        t0 = time.perf_counter()
        plan = scheduler.plan(int(prompt_lens[k]), queues, r)
        decision_s.append(time.perf_counter() - t0)
        end = now
        for c in plan.chunks:   # Eq. 2 on the absolute queues
            seconds = (c.end_s - c.start_s if device_models is None
                       else device_models[c.sp].seconds(c.history, c.tokens))
            start = max(free_at[i] for i in c.group)
            end = max(start, now) + seconds
            for i in c.group:
                free_at[i] = end
            busy += c.sp * seconds
        ttft[k], plans[k], rates[k] = end - now, plan, (math.nan if r is None else r)
        last = max(last, end)
    return PoolResult(ttft, plans, rates, decision_s, busy, last - float(arrivals[order[0]]))


def poisson_arrivals(num_requests: int, rate: float, seed: int) -> np.ndarray:
    """Arrival seconds [num_requests] at `rate` requests/s (the first at 0)."""
    from medha_jax.workloads import arrival_times
    return arrival_times(num_requests, rate, np.random.default_rng(seed))


def profile_improvement_rates(sample_lengths: Callable[[int, int], Sequence[int]],
                              arrival_rates: Sequence[float], candidates: Sequence[float],
                              make_scheduler: Callable[[], object], *, num_requests: int,
                              seed: int = 0, statistic: str = "mean",
                              samples: int = 1) -> ImprovementRateTable:
    """The offline search of section 5.1: at each arrival rate, Poisson arrivals and lengths
    sampled from the distribution (`sample_lengths(n, seed)`), simulated once per candidate
    improvement rate with Eq. 1; keeps the rate with the least TTFT `statistic` ("mean" --
    the paper says only "minimizes TTFT" -- or "p50" / "p99"; ties: the smaller rate).

    samples: independent traces per arrival rate, the statistic taken over all their
    requests (one trace near the pool's knee picks a rate by chance); trace 0 has the
    seeds of a one-sample profile."""
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    pick = {"mean": np.mean, "p50": lambda x: np.percentile(x, 50),
            "p99": lambda x: np.percentile(x, 99)}[statistic]
    best = []
    for i, rate in enumerate(sorted(arrival_rates)):
        seeds = [seed + 1000 * i + PROFILE_SAMPLE_SEED_STRIDE * j for j in range(samples)]
        traces = [(sample_lengths(num_requests, s), poisson_arrivals(num_requests, rate, s))
                  for s in seeds]
        scores = [pick([t for lengths, arrivals in traces
                        for t in simulate_prefill_pool(lengths, arrivals, make_scheduler(),
                                                       improvement_rate=r).ttft_s])
                  for r in candidates]
        best.append(candidates[int(np.argmin(scores))])
    return ImprovementRateTable(tuple(sorted(arrival_rates)), tuple(best))


# Seeds of a profile's extra traces per rate: far from the per-rate stride (1000).
PROFILE_SAMPLE_SEED_STRIDE = 1_000_003
