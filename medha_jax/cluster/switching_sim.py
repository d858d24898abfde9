"""DP <-> TP switching on simulated devices (seed 004, Flying Serving, section 6).

The live coordinator (`serving.switching.SwitchingCoordinator`: Algorithm 1, its policies,
soft and hard preemption) steps objects with an engine's interface; this module gives it
simulated ones, so the simulator runs the same policy code as the server:

- `SimulatedEngine`: a base replica (tp devices) or a bound TP group, priced by the
  analytical predictor of its own tp degree (a group of m base replicas of tp b runs the
  program of a static TP-(m * b) replica: each device computes with 1/(m * b) of the
  weights, Eq. 1) on `SimulatedExecutor`.
- KV: each base replica has a real `BlockAllocator` sized by `kv_capacity_tokens`; a group
  books its pages in the members' pools through the live path's `GroupAllocator` (a
  logical page of m x page_size tokens is one physical page of every member, Eqs. 2-4), so
  paused DP pages and TP pages share the pools exactly as on the devices.
- Time: one virtual clock. Each unit's step ends at its own time (its executor books it
  from its dispatch); the coordinator applies the first to end (`done_at`) and the clock
  moves there, so units step independently, as on the devices. A request is placed at
  its arrival (an idle unit starts it then). A coordinator with one unit is therefore
  exactly `medha_jax.simulator.simulate` with one replica, and N replicas under "off"
  exactly N independent ones (tests/test_switching_sim.py).

`switching_units` builds the replicas and every aligned group; `drive` feeds a coordinator
the requests at their arrival times and returns a `SwitchingRun`. Nothing here imports
`serving`: the caller makes the coordinator (dependencies point serving -> medha_jax).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from medha_jax.config import ModelConfig, ParallelConfig
from medha_jax.engine.tp_group import GroupAllocator
from medha_jax.kv_cache.allocator import BlockAllocator
from medha_jax.request import Batch, Request, StepResult, VirtualClock
from medha_jax.scheduler.in_flight import InFlightRunner
from medha_jax.scheduler.hardware import HardwareSpec, hardware_preset
from medha_jax.scheduler.predictor import AnalyticalPredictor, RuntimePredictor
from medha_jax.simulator import SimulatedExecutor, SimulatedStep, _fresh_copy, kv_capacity_tokens


@dataclasses.dataclass(frozen=True)
class _Model:
    config: ModelConfig


@dataclasses.dataclass(frozen=True)
class _Ladder:
    token_buckets: tuple[int, ...]


class SimulatedEngine:
    """What the coordinator steps: model.config, ladder, max_seqs, allocator,
    max_model_len, dispatch(batch), done_at(step) and collect(step)."""

    def __init__(self, name: str, model: ModelConfig, predictor: RuntimePredictor,
                 allocator: BlockAllocator, max_model_len: int, token_buckets: Sequence[int],
                 max_seqs: int, clock: VirtualClock, tp: int,
                 published: list[tuple[float, int]]):
        """published: where each collected step appends (its end, tokens it sampled)."""
        self.name, self.tp = name, tp
        self.model = _Model(model)
        self.ladder = _Ladder(tuple(token_buckets))
        self.max_seqs, self.allocator, self.max_model_len = max_seqs, allocator, max_model_len
        self.executor = SimulatedExecutor(predictor, clock)
        self.published = published

    @property
    def busy_s(self) -> float:
        return self.executor.busy_s

    def dispatch(self, batch: Batch) -> SimulatedStep:
        return self.executor.dispatch(batch)

    def done_at(self, step: SimulatedStep) -> float:
        return step.done_time

    def collect(self, step: SimulatedStep) -> StepResult:
        result = self.executor.collect(step)          # the clock moves to its end
        self.published.append((step.done_time, len(result.sampled_token_ids)))
        return result


@dataclasses.dataclass(frozen=True)
class SwitchingUnits:
    """The base replicas (in device order) and every aligned group, by (start, size) in
    base replicas, as `SwitchingCoordinator(replicas, ..., groups=groups)` takes them."""

    replicas: list[SimulatedEngine]
    groups: dict[tuple[int, int], SimulatedEngine]
    clock: VirtualClock
    published: list[tuple[float, int]]     # (end, tokens sampled) of every collected step
    base_tp: int
    replica_kv_tokens: int          # kv_capacity_tokens of one base replica

    def group_kv_tokens(self, size: int) -> int:
        """Tokens a group of `size` base replicas holds (pages of size x page_size tokens)."""
        allocator = self.groups[(0, size)].allocator
        return allocator.pages_per_shard * allocator.page_size


def switching_units(model: ModelConfig, *, hardware: HardwareSpec | str, num_replicas: int,
                    base_tp: int, group_sizes: Sequence[int] = (), token_buckets: Sequence[int],
                    max_seqs: int = 256, page_size: int = 16, memory_utilization: float = 0.9,
                    max_model_len: int | None = None, start_time: float = 0.0) -> SwitchingUnits:
    """num_replicas base replicas of base_tp devices each and every aligned group of
    group_sizes (in base replicas) over them, on one virtual clock.

    A unit's max_model_len is the live path's: the model's positions (or max_model_len),
    capped by what its pool holds for one request.
    """
    hardware = hardware_preset(hardware) if isinstance(hardware, str) else hardware
    if model.num_kv_heads % base_tp:
        raise ValueError(f"base_tp={base_tp} must divide num_kv_heads={model.num_kv_heads}")
    clock = VirtualClock(start_time)
    published: list[tuple[float, int]] = []
    capacity = kv_capacity_tokens(model, ParallelConfig(tp=base_tp), hardware, memory_utilization)
    positions = max_model_len or model.max_position_embeddings

    def engine(name, tp, allocator):
        predictor = AnalyticalPredictor(model, ParallelConfig(tp=tp), hardware,
                                        token_buckets=token_buckets)
        return SimulatedEngine(name, model, predictor, allocator,
                               min(positions, allocator.max_tokens_per_request), token_buckets,
                               max_seqs, clock, tp, published)

    replicas = [engine(f"dp{i}", base_tp, BlockAllocator(capacity // page_size, page_size,
                                                         enable_prefix_caching=False))
                for i in range(num_replicas)]
    groups = {}
    for m in sorted(group_sizes):
        if m < 2 or m & (m - 1):
            raise ValueError(f"group sizes must be powers of two >= 2, got {m}")
        if model.num_kv_heads % (base_tp * m):
            # Eq. 3 scales a page by m only while every device keeps whole K/V heads.
            raise ValueError(f"a group of {m} TP-{base_tp} replicas needs num_kv_heads "
                             f"({model.num_kv_heads}) divisible by {base_tp * m}")
        for start in range(0, num_replicas - m + 1, m):
            members = [r.allocator for r in replicas[start:start + m]]
            allocator = GroupAllocator(members, page_size * m, f"tp{m}@{start}")
            groups[(start, m)] = engine(f"tp{m}@{start}", base_tp * m, allocator)
    return SwitchingUnits(replicas, groups, clock, published, base_tp, capacity)


@dataclasses.dataclass
class SwitchingRun:
    """A finished run. Times are on the virtual clock, in seconds."""

    requests: list[Request]                  # copies of the inputs, in input order
    makespan_s: float                        # first arrival to last finish
    steps: int                               # unit steps collected
    tokens: list[tuple[float, int]]          # (published at, tokens sampled) per unit step

    @property
    def output_tokens(self) -> int:
        return sum(len(r.output_token_ids) for r in self.requests)

    def throughput_tok_s(self) -> float:
        """Output tokens over the makespan."""
        return self.output_tokens / self.makespan_s if self.makespan_s > 0 else 0.0

    def peak_throughput_tok_s(self, window_s: float = 10.0) -> float:
        """The most output tokens published in any window of window_s seconds, per second
        (the paper's peak generation throughput)."""
        if not self.tokens:
            return 0.0
        times = np.array([t for t, _ in self.tokens])
        counts = np.cumsum([0] + [n for _, n in self.tokens])
        ends = np.searchsorted(times, times + window_s, side="right")
        return float(max(counts[e] - counts[i] for i, e in enumerate(ends)) / window_s)

    def stats(self, requests: Sequence[Request] | None = None) -> dict[str, float]:
        """TTFT, TPOT and queue time (admission to first schedule) of `requests` (default:
        all): means and p50 / p90 / p99."""
        rs = list(self.requests if requests is None else requests)
        ttft = [r.first_token_time - r.arrival_time for r in rs]
        queue = [r.first_scheduled_time - r.arrival_time for r in rs]
        tpot = [(r.finish_time - r.first_token_time) / (len(r.output_token_ids) - 1)
                for r in rs if len(r.output_token_ids) > 1]
        out = {"n": len(rs)}
        for name, values in (("ttft_s", ttft), ("tpot_s", tpot), ("queue_s", queue)):
            values = np.asarray(values) if values else np.asarray([math.nan])
            out[f"{name}_mean"] = float(values.mean())
            for q in (50, 90, 99):
                out[f"{name}_p{q}"] = float(np.percentile(values, q))
        return out


def drive(coordinator, units: SwitchingUnits, requests: Sequence[Request],
          max_steps: int = 10_000_000) -> SwitchingRun:
    """Serves `requests` (copied: lengths, arrivals, priorities; every request emits
    exactly max_new_tokens tokens) through `coordinator` (a SwitchingCoordinator over
    `units`, on units.clock), as its server loop would: each request is submitted at its
    arrival and idle units start at once; otherwise the clock moves to the first unit step
    to end, which is applied and that unit given its next step."""
    if not requests:
        raise ValueError("drive needs at least one request")
    copies = [_fresh_copy(r, keep_token_ids=False) for r in requests]
    arrivals = sorted(copies, key=lambda r: r.arrival_time)
    clock = units.clock
    runner = InFlightRunner(coordinator, coordinator)
    first_collected = len(units.published)
    clock.advance_to(arrivals[0].arrival_time)
    n = steps = 0
    while n < len(arrivals) or coordinator.has_unfinished():
        while n < len(arrivals) and arrivals[n].arrival_time <= clock.now():
            coordinator.submit(arrivals[n])
            n += 1
        while runner.dispatch_next() is not None:
            pass
        next_arrival = arrivals[n].arrival_time if n < len(arrivals) else math.inf
        if not runner.num_in_flight:
            if next_arrival == math.inf:
                raise RuntimeError(f"no unit can run the requests left at t={clock.now():.3f}")
            clock.advance_to(next_arrival)
            continue
        next_end = min(unit.engine.done_at(step) for unit, step in runner.handles)
        if next_arrival < next_end:
            clock.advance_to(next_arrival)
            continue
        runner.collect_next()
        steps += 1
        if steps >= max_steps:
            raise RuntimeError(f"requests left after {max_steps} steps")
    missing = [r.request_id for r in copies if r.request_id not in coordinator.finished]
    if missing:
        raise RuntimeError(f"{len(missing)} requests never finished, e.g. {missing[:3]}")
    # The coordinator finishes the object it was given, except a soft-preempted request,
    # which finishes as the copy that was recomputed under TP.
    done = [coordinator.finished[r.request_id] for r in copies]
    makespan = max(r.finish_time for r in done) - arrivals[0].arrival_time
    return SwitchingRun(done, makespan, steps, sorted(units.published[first_collected:]))
