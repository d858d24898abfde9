"""Request traces: seeded synthetic workloads, public trace loaders, and trace -> Requests.

A trace is a list of `TraceRequest`s (arrival time and lengths, nothing else). Three ways
to get one:

- `generate_workload(WorkloadSpec(...))`: the Medha convoy mix (seed 000, section 6.1):
  ShareGPT4-like short requests plus a fraction of Medha-SWE-like long ones, Poisson or
  bursty (Gamma) arrivals at a given QPS.
- `load_azure_trace` / `load_mooncake_trace`: the real public traces in shared/traces.
- `load_trace`: a trace saved earlier by `save_trace` (CSV or JSONL).

`to_requests` turns a trace into `medha_jax.request.Request`s with SLOs (and, for the
real engine, synthetic prompt token ids), ready for the simulator or the controller.

Plain Python + numpy: no JAX here.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import zlib
from typing import Callable, Iterable, Sequence

import numpy as np

from medha_jax.request import SLO, Request
from medha_jax.sampling_params import SamplingParams

# z such that Phi(z) = 0.9: a lognormal's p90 is exp(mu + Z90 * sigma).
_Z90 = 1.2815515655446004
# z such that Phi(z) = 0.995: a range taken as a lognormal's central 99% spans 2 x Z995 sigma.
_Z995 = 2.5758293035489004


def _normal_cdf(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


def _clipped_lognormal_mean(mu: float, sigma: float, a: float, b: float) -> float:
    """E[clip(X, a, b)] for ln X ~ N(mu, sigma²): the mass below a at a, above b at b, and
    the partial expectation in between."""
    za, zb = (math.log(a) - mu) / sigma, (math.log(b) - mu) / sigma
    inside = math.exp(mu + sigma * sigma / 2) * (_normal_cdf(zb - sigma) - _normal_cdf(za - sigma))
    return a * _normal_cdf(za) + b * (1 - _normal_cdf(zb)) + inside


# ---------------------------------------------------------------------------------------
# Length distributions
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class LengthDistribution:
    """A lognormal over token counts, clipped to [min_tokens, max_tokens].

    Clipping (rather than truncating by resampling) keeps every percentile that lies
    inside the bounds exactly where the parameters put it, at the cost of point masses at
    the bounds. A truncated lognormal cannot match the Medha-SWE percentiles at all: even
    its log-uniform limit over 128K-1M has p90 814K < 839K.
    """

    median: float          # exp(mu) of the unclipped lognormal, in tokens
    sigma: float           # std of log(tokens)
    min_tokens: int = 1
    max_tokens: int = 1 << 31

    def __post_init__(self):
        if not self.median > 0:
            raise ValueError(f"LengthDistribution.median must be > 0, got {self.median!r}")
        if not self.sigma >= 0:
            raise ValueError(f"LengthDistribution.sigma must be >= 0, got {self.sigma!r}")
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"need 1 <= min_tokens <= max_tokens, got {self.min_tokens=} {self.max_tokens=}")

    @classmethod
    def from_percentiles(cls, p50: float, p90: float, *, min_tokens: int = 1,
                         max_tokens: int = 1 << 31) -> "LengthDistribution":
        """The lognormal whose median and 90th percentile are p50 and p90."""
        if not 0 < p50 < p90:
            raise ValueError(f"need 0 < p50 < p90, got {p50=} {p90=}")
        return cls(median=float(p50), sigma=math.log(p90 / p50) / _Z90,
                   min_tokens=min_tokens, max_tokens=max_tokens)

    @classmethod
    def fit(cls, samples: Sequence[int], *, min_tokens: int | None = None,
            max_tokens: int | None = None) -> "LengthDistribution":
        """Maximum-likelihood lognormal (mean and std of log) of observed token counts.

        Bounds default to the observed min and max.
        """
        values = np.asarray(samples, dtype=np.float64)
        if values.size < 2 or np.any(values < 1):
            raise ValueError(f"fit needs >= 2 token counts, all >= 1; got {values.size} values "
                             f"with min {values.min() if values.size else None}")
        logs = np.log(values)
        return cls(median=float(np.exp(logs.mean())), sigma=float(logs.std()),
                   min_tokens=int(min_tokens if min_tokens is not None else values.min()),
                   max_tokens=int(max_tokens if max_tokens is not None else values.max()))

    @classmethod
    def from_range_and_mean(cls, min_tokens: int, max_tokens: int,
                            mean: float) -> "LengthDistribution":
        """A lognormal clipped to [min_tokens, max_tokens] whose clipped mean is `mean`: the
        range is taken as its central 99% (sigma = ln(max/min) / (2 x 2.576)) and the median
        solved (bisection on the exact clipped mean) for the mean. For traces known only by
        their range and average (Tetris's, seed 001 section 7.1)."""
        if not 1 <= min_tokens < mean < max_tokens:
            raise ValueError(f"need 1 <= min_tokens < mean < max_tokens, got {min_tokens=} "
                             f"{mean=} {max_tokens=}")
        sigma = math.log(max_tokens / min_tokens) / (2 * _Z995)
        lo, hi = math.log(min_tokens), math.log(max_tokens)
        for _ in range(100):
            mu = (lo + hi) / 2
            if _clipped_lognormal_mean(mu, sigma, min_tokens, max_tokens) < mean:
                lo = mu
            else:
                hi = mu
        return cls(median=math.exp((lo + hi) / 2), sigma=sigma, min_tokens=min_tokens,
                   max_tokens=max_tokens)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """n token counts: int64 [n], each in [min_tokens, max_tokens]."""
        draw = rng.lognormal(math.log(self.median), self.sigma, size=n)
        return np.clip(np.rint(draw), self.min_tokens, self.max_tokens).astype(np.int64)


# ShareGPT4 (openchat_sharegpt4, conversations capped at 8K tokens), the short half of the
# Medha mix. Source: Sarathi-Serve (Agrawal et al., OSDI'24) Table 2, which lists prompt
# tokens p50 1730 / p90 5696 and output tokens p50 415 / p90 834 for this dataset; Medha
# (seed 000, section 6.1) quotes the same median output (415). A lognormal through those
# two percentiles each; prompts clipped to the 8K cap (4.7% of them sit at 8192).
SHAREGPT4_PROMPT = LengthDistribution.from_percentiles(1730, 5696, min_tokens=16,
                                                       max_tokens=8192)
SHAREGPT4_OUTPUT = LengthDistribution.from_percentiles(415, 834, min_tokens=4,
                                                       max_tokens=4096)

# Medha-SWE (seed 000, section 6.1): prefill p50 393K, p90 839K; decode p50 518, p90 808.
# No public file has it, so lognormals through those percentiles; prefills clipped to the
# paper's 128K-1M range of long requests (section 6.2): 2.9% sit at 128K, 5.7% at 1M.
MEDHA_SWE_PROMPT = LengthDistribution.from_percentiles(393_000, 839_000, min_tokens=128_000,
                                                       max_tokens=1_000_000)
MEDHA_SWE_OUTPUT = LengthDistribution.from_percentiles(518, 808, min_tokens=16,
                                                       max_tokens=4096)

# Tetris (seed 001, section 7.1): private production traces known by range and average only.
TETRIS_SHORT_PROMPT = LengthDistribution.from_range_and_mean(4_000, 95_000, 23_600)
TETRIS_MEDIUM_PROMPT = LengthDistribution.from_range_and_mean(8_000, 142_000, 32_800)
TETRIS_LONG_PROMPT = LengthDistribution.from_range_and_mean(16_000, 190_000, 50_100)



# ---------------------------------------------------------------------------------------
# Traces
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: when it arrives and how long it is."""

    arrival_s: float                 # seconds from the start of the trace
    prompt_tokens: int
    output_tokens: int
    session_id: str | None = None    # requests of one session share a prompt prefix
    is_long: bool = False            # the long-context class of the convoy experiment
    # The prompt as blocks of `block_tokens` tokens (Mooncake's hash_ids): equal ids are
    # equal tokens, so requests share exactly the prefixes the trace says they share.
    prefix_blocks: tuple[int, ...] = ()
    block_tokens: int = 0

    def __post_init__(self):
        if not self.arrival_s >= 0:
            raise ValueError(f"TraceRequest.arrival_s must be >= 0, got {self.arrival_s!r}")
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError(f"TraceRequest needs prompt_tokens >= 1 and output_tokens >= 1, "
                             f"got {self.prompt_tokens=} {self.output_tokens=}")
        if self.prefix_blocks and self.block_tokens < 1:
            raise ValueError(f"TraceRequest with prefix_blocks needs block_tokens >= 1, "
                             f"got {self.block_tokens!r}")


ARRIVAL_PROCESSES = ("poisson", "bursty")


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkloadSpec:
    """A seeded synthetic trace: short requests plus a fraction of long ones.

    Scales shrink lengths for small machines (a CPU cannot prefill 400K tokens): the
    sampled lengths are multiplied by them (bounds included, so the shape is kept), then
    capped by max_prompt_tokens / max_output_tokens (the served model's limits).
    """

    num_requests: int
    qps: float
    long_fraction: float = 0.05
    seed: int = 0
    arrival: str = "poisson"          # "poisson" or "bursty" (Gamma gaps with CV burst_cv)
    burst_cv: float = 3.0             # coefficient of variation of bursty gaps (> 1)
    short_prompt: LengthDistribution = SHAREGPT4_PROMPT
    short_output: LengthDistribution = SHAREGPT4_OUTPUT
    long_prompt: LengthDistribution = MEDHA_SWE_PROMPT
    long_output: LengthDistribution = MEDHA_SWE_OUTPUT
    short_scale: float = 1.0          # multiplies short prompt lengths
    long_scale: float = 1.0           # multiplies long prompt lengths
    output_scale: float = 1.0         # multiplies every output length
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None

    def __post_init__(self):
        if not isinstance(self.num_requests, int) or self.num_requests < 1:
            raise ValueError(f"WorkloadSpec.num_requests must be an int >= 1, "
                             f"got {self.num_requests!r}")
        if not self.qps > 0:
            raise ValueError(f"WorkloadSpec.qps must be > 0, got {self.qps!r}")
        if not 0 <= self.long_fraction <= 1:
            raise ValueError(f"WorkloadSpec.long_fraction must be in [0, 1], "
                             f"got {self.long_fraction!r}")
        if self.arrival not in ARRIVAL_PROCESSES:
            raise ValueError(f"WorkloadSpec.arrival must be one of {ARRIVAL_PROCESSES}, "
                             f"got {self.arrival!r}")
        if self.arrival == "bursty" and not self.burst_cv > 1:
            raise ValueError(f"bursty arrivals need burst_cv > 1 (1 is Poisson), "
                             f"got {self.burst_cv!r}")
        for field in ("short_scale", "long_scale", "output_scale"):
            if not getattr(self, field) > 0:
                raise ValueError(f"WorkloadSpec.{field} must be > 0, got {getattr(self, field)!r}")
        for field in ("max_prompt_tokens", "max_output_tokens"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"WorkloadSpec.{field} must be None or an int >= 1, got {value!r}")


def arrival_times(num_requests: int, qps: float, rng: np.random.Generator, *,
                  process: str = "poisson", burst_cv: float = 3.0) -> np.ndarray:
    """Arrival times [num_requests] in seconds, the first at 0, mean rate qps.

    Poisson: exponential gaps. Bursty: Gamma gaps with shape 1/cv^2, so the mean rate is
    the same but gaps have coefficient of variation cv (clusters of near-simultaneous
    arrivals separated by long quiet spells).
    """
    if process == "poisson":
        gaps = rng.exponential(1.0 / qps, size=num_requests - 1)
    elif process == "bursty":
        shape = 1.0 / burst_cv ** 2
        gaps = rng.gamma(shape, 1.0 / (qps * shape), size=num_requests - 1)
    else:
        raise ValueError(f"unknown arrival process {process!r}; known: {ARRIVAL_PROCESSES}")
    return np.concatenate([[0.0], np.cumsum(gaps)])


def generate_workload(spec: WorkloadSpec) -> list[TraceRequest]:
    """The trace `spec` describes; the same spec always gives the same trace.

    Exactly round(long_fraction * num_requests) requests are long, at random positions,
    so even a small trace has the stated mix.
    """
    rng = np.random.default_rng(spec.seed)
    n = spec.num_requests
    arrivals = arrival_times(n, spec.qps, rng, process=spec.arrival, burst_cv=spec.burst_cv)
    num_long = int(round(spec.long_fraction * n))
    is_long = np.zeros(n, dtype=bool)
    is_long[rng.choice(n, size=num_long, replace=False)] = True

    prompts = np.empty(n, dtype=np.int64)
    outputs = np.empty(n, dtype=np.int64)
    prompts[~is_long] = spec.short_prompt.sample(rng, n - num_long)
    outputs[~is_long] = spec.short_output.sample(rng, n - num_long)
    prompts[is_long] = spec.long_prompt.sample(rng, num_long)
    outputs[is_long] = spec.long_output.sample(rng, num_long)

    trace = [TraceRequest(float(a), int(p), int(o), None, bool(lg))
             for a, p, o, lg in zip(arrivals, prompts, outputs, is_long)]
    return scale_lengths(trace, short_prompt_scale=spec.short_scale,
                         long_prompt_scale=spec.long_scale, output_scale=spec.output_scale,
                         max_prompt_tokens=spec.max_prompt_tokens,
                         max_output_tokens=spec.max_output_tokens)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AlternatingLoadSpec:
    """Seed 004's synthetic workload (Flying Serving, sec. 6.1.3): prompts uniform in
    [128, 4000] tokens, outputs uniform in [64, 512], the arrival rate alternating between
    low load (2-5 req/s) and bursts (10-30 req/s), 4000 requests.

    The paper gives neither the phases' durations nor the rate within a phase: each phase
    here draws its rate uniformly from its range, lasts low_s or burst_s seconds, and its
    arrivals are Poisson at that rate. high_priority_fraction of the requests (at random
    positions) get `high_priority` (lower is more important), the rest priority 0.
    """

    num_requests: int = 4000
    seed: int = 0
    prompt_tokens: tuple[int, int] = (128, 4000)
    output_tokens: tuple[int, int] = (64, 512)
    low_qps: tuple[float, float] = (2.0, 5.0)
    burst_qps: tuple[float, float] = (10.0, 30.0)
    low_s: float = 30.0
    burst_s: float = 10.0
    high_priority_fraction: float = 0.0
    high_priority: int = -1

    def __post_init__(self):
        if not isinstance(self.num_requests, int) or self.num_requests < 1:
            raise ValueError(f"AlternatingLoadSpec.num_requests must be an int >= 1, "
                             f"got {self.num_requests!r}")
        for field in ("prompt_tokens", "output_tokens", "low_qps", "burst_qps"):
            lo, hi = getattr(self, field)
            if not 0 < lo <= hi:
                raise ValueError(f"AlternatingLoadSpec.{field} must be (lo, hi) with "
                                 f"0 < lo <= hi, got {getattr(self, field)!r}")
        for field in ("low_s", "burst_s"):
            if not getattr(self, field) > 0:
                raise ValueError(f"AlternatingLoadSpec.{field} must be > 0, "
                                 f"got {getattr(self, field)!r}")
        if not 0 <= self.high_priority_fraction <= 1:
            raise ValueError(f"AlternatingLoadSpec.high_priority_fraction must be in [0, 1], "
                             f"got {self.high_priority_fraction!r}")


def alternating_load_workload(spec: AlternatingLoadSpec) -> tuple[list[TraceRequest], list[int]]:
    """The trace `spec` describes and each request's priority; the same spec always gives
    the same trace. Phases start at 0 s, low load first: low phases span
    [k (low_s + burst_s), k (low_s + burst_s) + low_s)."""
    rng = np.random.default_rng(spec.seed)
    n = spec.num_requests
    arrivals: list[float] = []
    start, burst = 0.0, False
    while len(arrivals) < n:
        qps = rng.uniform(*(spec.burst_qps if burst else spec.low_qps))
        end = start + (spec.burst_s if burst else spec.low_s)
        t = start + rng.exponential(1.0 / qps)
        while t < end and len(arrivals) < n:
            arrivals.append(t)
            t += rng.exponential(1.0 / qps)
        start, burst = end, not burst
    prompts = rng.integers(spec.prompt_tokens[0], spec.prompt_tokens[1] + 1, size=n)
    outputs = rng.integers(spec.output_tokens[0], spec.output_tokens[1] + 1, size=n)
    priorities = [0] * n
    for i in rng.choice(n, size=int(round(spec.high_priority_fraction * n)), replace=False):
        priorities[int(i)] = spec.high_priority
    trace = [TraceRequest(float(a), int(p), int(o)) for a, p, o in zip(arrivals, prompts, outputs)]
    return trace, priorities


def scale_lengths(trace: Sequence[TraceRequest], *, short_prompt_scale: float = 1.0,
                  long_prompt_scale: float = 1.0, output_scale: float = 1.0,
                  max_prompt_tokens: int | None = None,
                  max_output_tokens: int | None = None) -> list[TraceRequest]:
    """The trace with lengths multiplied (rounded, at least 1 token) and then capped.

    Short and long prompts scale separately: a small machine keeps long requests long
    relative to short ones (the convoy needs that) while shrinking both.
    """
    def scaled(tokens: int, scale: float, cap: int | None) -> int:
        value = max(1, int(round(tokens * scale)))
        return min(value, cap) if cap is not None else value

    def prompt_scale(r: TraceRequest) -> float:
        return long_prompt_scale if r.is_long else short_prompt_scale

    return [dataclasses.replace(
        r,
        prompt_tokens=scaled(r.prompt_tokens, prompt_scale(r), max_prompt_tokens),
        output_tokens=scaled(r.output_tokens, output_scale, max_output_tokens),
        block_tokens=scaled(r.block_tokens, prompt_scale(r), None) if r.prefix_blocks else 0)
        for r in trace]


# ---------------------------------------------------------------------------------------
# Saving and loading
# ---------------------------------------------------------------------------------------

TRACE_FIELDS = ("arrival_s", "prompt_tokens", "output_tokens", "session_id", "is_long",
                "prefix_blocks", "block_tokens")


def save_trace(trace: Iterable[TraceRequest], path: str | os.PathLike) -> None:
    """Writes a trace as CSV (path ends .csv) or JSONL (.jsonl), one request per row."""
    path = os.fspath(path)
    rows = [dataclasses.asdict(r) for r in trace]
    if path.endswith(".csv"):
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=TRACE_FIELDS)
            writer.writeheader()
            for row in rows:
                # repr keeps every bit of the float, so a round trip is exact.
                writer.writerow({**row, "arrival_s": repr(row["arrival_s"]),
                                 "session_id": row["session_id"] or "",
                                 "is_long": int(row["is_long"]),
                                 "prefix_blocks": " ".join(map(str, row["prefix_blocks"]))})
    elif path.endswith(".jsonl"):
        with open(path, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    else:
        raise ValueError(f"trace path {path!r} must end in .csv or .jsonl")


def load_trace(path: str | os.PathLike) -> list[TraceRequest]:
    """Reads a trace written by `save_trace`, sorted by arrival."""
    path = os.fspath(path)
    if path.endswith(".csv"):
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        required = TRACE_FIELDS[:5]           # the block columns are optional
        missing = set(required) - set(rows[0] if rows else required)
        if missing:
            raise ValueError(f"{path}: missing columns {sorted(missing)}; expected {TRACE_FIELDS}")
        trace = [TraceRequest(float(r["arrival_s"]), int(r["prompt_tokens"]),
                              int(r["output_tokens"]), r["session_id"] or None,
                              r["is_long"].strip().lower() in ("1", "true"),
                              tuple(map(int, (r.get("prefix_blocks") or "").split())),
                              int(r.get("block_tokens") or 0))
                 for r in rows]
    elif path.endswith(".jsonl"):
        with open(path) as f:
            trace = [TraceRequest(float(r["arrival_s"]), int(r["prompt_tokens"]),
                                  int(r["output_tokens"]), r.get("session_id"),
                                  bool(r.get("is_long", False)),
                                  tuple(r.get("prefix_blocks", ())), int(r.get("block_tokens", 0)))
                     for r in map(json.loads, filter(str.strip, f))]
    else:
        raise ValueError(f"trace path {path!r} must end in .csv or .jsonl")
    return sorted(trace, key=lambda r: r.arrival_s)


def fit_lengths(trace: Sequence[TraceRequest]
                ) -> tuple[LengthDistribution, LengthDistribution]:
    """Lognormals (prompt, output) fitted to a real trace's lengths, e.g. to draw short
    requests shaped like the Azure conversation trace instead of ShareGPT4:

        prompt, output = fit_lengths(load_azure_trace(".../azure2023_splitwise_conv.csv"))
        WorkloadSpec(..., short_prompt=prompt, short_output=output)
    """
    return (LengthDistribution.fit([r.prompt_tokens for r in trace]),
            LengthDistribution.fit([r.output_tokens for r in trace]))


def load_azure_trace(path: str | os.PathLike, *, limit: int | None = None
                     ) -> list[TraceRequest]:
    """The Azure LLM inference trace 2023 in Vidur's CSV form.

    Columns arrived_at (s), num_prefill_tokens, num_decode_tokens. Arrivals are shifted so
    the first request arrives at 0. No sessions, no long class.
    """
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))[:limit]
    if not rows:
        return []
    start = float(rows[0]["arrived_at"])
    return sorted((TraceRequest(float(r["arrived_at"]) - start, int(r["num_prefill_tokens"]),
                                int(r["num_decode_tokens"])) for r in rows),
                  key=lambda r: r.arrival_s)


MOONCAKE_BLOCK_TOKENS = 512


def load_mooncake_trace(path: str | os.PathLike, *, limit: int | None = None
                        ) -> list[TraceRequest]:
    """A Mooncake (FAST'25) trace: JSONL of timestamp (ms), input_length, output_length,
    hash_ids (ids of 512-token prefix blocks, kept as `prefix_blocks`).

    Session: blocks shared by every request (a global system prompt) say nothing about
    who is talking, so they are skipped; the first block after them names the session.
    Requests with equal session ids therefore share at least that prefix block.
    """
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()][:limit]
    if not rows:
        return []
    common = list(rows[0]["hash_ids"])
    for r in rows[1:]:
        ids = r["hash_ids"]
        n = 0
        while n < min(len(common), len(ids)) and common[n] == ids[n]:
            n += 1
        del common[n:]
    start = rows[0]["timestamp"]
    trace = []
    for r in rows:
        ids = r["hash_ids"]
        session = f"mc{ids[len(common)]}" if len(ids) > len(common) else None
        trace.append(TraceRequest((r["timestamp"] - start) / 1000.0, int(r["input_length"]),
                                  int(r["output_length"]), session,
                                  prefix_blocks=tuple(ids), block_tokens=MOONCAKE_BLOCK_TOKENS))
    return sorted(trace, key=lambda r: r.arrival_s)


# ---------------------------------------------------------------------------------------
# Trace -> Requests
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class SLOPolicy:
    """How a request's TTFT deadline d (LARS needs it) and TPOT target are chosen.

    Short requests get a fixed interactive deadline `short_ttft_s`. A long request cannot
    have its first token sooner than its own prefill takes, so its deadline is
    `long_ttft_factor` times its predicted prefill time alone on the machine (never less
    than the short deadline): the factor is the slack it is granted, the same relative
    slack for every long request whatever its length (LARS's rho starts at factor - 1).
    """

    short_ttft_s: float = 2.0
    long_ttft_factor: float = 2.0
    tpot_s: float = 0.5

    def __post_init__(self):
        if not self.short_ttft_s > 0:
            raise ValueError(f"SLOPolicy.short_ttft_s must be > 0, got {self.short_ttft_s!r}")
        if not self.long_ttft_factor >= 1:
            raise ValueError(f"SLOPolicy.long_ttft_factor must be >= 1 (a deadline before the "
                             f"prefill can finish), got {self.long_ttft_factor!r}")
        if not self.tpot_s > 0:
            raise ValueError(f"SLOPolicy.tpot_s must be > 0, got {self.tpot_s!r}")

    def slo_for(self, request: TraceRequest,
                prefill_time_s: Callable[[int], float] | None) -> SLO:
        if not request.is_long:
            return SLO(ttft_s=self.short_ttft_s, tpot_s=self.tpot_s)
        if prefill_time_s is None:
            raise ValueError("to_requests: the trace has long requests, whose deadlines "
                             "follow their predicted prefill time; pass prefill_time_s")
        ttft = max(self.short_ttft_s, self.long_ttft_factor * prefill_time_s(request.prompt_tokens))
        return SLO(ttft_s=ttft, tpot_s=self.tpot_s)


def request_id(index: int) -> str:
    """The id `to_requests` gives the index-th request of a trace."""
    return f"r{index:06d}"


def synthetic_prompt_ids(trace: Sequence[TraceRequest], *, vocab_size: int, seed: int = 0,
                         first_token_id: int = 0) -> list[list[int]]:
    """Seeded random prompt token ids in [first_token_id, vocab_size), one list per request.

    Requests of one session read the same token stream from its start, so a later turn's
    prompt extends an earlier one's (a multi-turn chat) and the prefix cache can reuse it.
    Requests without a session get their own stream. A request with `prefix_blocks` is
    built block by block instead (each block id always the same tokens; past its blocks,
    its session's stream), so it shares exactly the prefixes its trace names.
    """
    if not 0 <= first_token_id < vocab_size:
        raise ValueError(f"need 0 <= {first_token_id=} < {vocab_size=}")
    streams: dict[str, np.ndarray] = {}
    longest: dict[str, int] = {}
    for i, r in enumerate(trace):
        key = r.session_id if r.session_id is not None else f"\0{i}"
        longest[key] = max(longest.get(key, 0), r.prompt_tokens)
    for key, length in longest.items():
        # crc32 is stable across processes (unlike hash()), so ids are reproducible.
        rng = np.random.default_rng([seed, zlib.crc32(key.encode())])
        streams[key] = rng.integers(first_token_id, vocab_size, size=length)
    blocks: dict[tuple[int, int], list[int]] = {}

    def block(block_id: int, size: int) -> list[int]:
        if (block_id, size) not in blocks:
            rng = np.random.default_rng([seed, 0xB10C, block_id])
            blocks[block_id, size] = rng.integers(first_token_id, vocab_size, size=size).tolist()
        return blocks[block_id, size]

    out = []
    for i, r in enumerate(trace):
        key = r.session_id if r.session_id is not None else f"\0{i}"
        ids = [t for b in r.prefix_blocks for t in block(b, r.block_tokens)][:r.prompt_tokens]
        out.append(ids + streams[key][len(ids):r.prompt_tokens].tolist())
    return out


def to_requests(trace: Sequence[TraceRequest], *, slo_policy: SLOPolicy = SLOPolicy(),
                prefill_time_s: Callable[[int], float] | None = None,
                vocab_size: int | None = None, seed: int = 0,
                first_token_id: int = 0) -> list[Request]:
    """Requests for the simulator or the controller, one per trace entry, in trace order.

    prefill_time_s(prompt_tokens) -> seconds: the predicted time to prefill a prompt alone
    (e.g. the scheduler's PrefillTimeCache); needed only when the trace has long requests.
    With vocab_size, requests carry synthetic prompt token ids (for the real engine);
    without, lengths only (the simulator). Outputs run to exactly output_tokens tokens
    (greedy, eos ignored), so runs are comparable across policies.
    Request ids are `request_id(i)`.
    """
    ids = (synthetic_prompt_ids(trace, vocab_size=vocab_size, seed=seed,
                                first_token_id=first_token_id)
           if vocab_size is not None else [None] * len(trace))
    return [Request(
        request_id=request_id(i), prompt_len=r.prompt_tokens, max_new_tokens=r.output_tokens,
        arrival_time=r.arrival_s, slo=slo_policy.slo_for(r, prefill_time_s),
        prompt_token_ids=prompt_ids, session_id=r.session_id,
        sampling=SamplingParams(temperature=0.0, max_tokens=r.output_tokens, ignore_eos=True))
        for i, (r, prompt_ids) in enumerate(zip(trace, ids))]
