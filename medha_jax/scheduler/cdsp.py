"""Chunkwise dynamic sequence parallelism (CDSP): the prefill pool's scheduler (seed 001, Tetris).

All prefill instances form one sequence-parallel ring. A prompt is prefilled as chunks
c_1..c_n, in order, on nested instance groups G_1 ⊆ G_2 ⊆ ... (so SP sizes only grow and no
cache ever leaves an instance): early chunks fill instances idle now, later ones grow to
the groups that free up later. Plain Python (no JAX), so the simulator
(`medha_jax.cluster.prefill_pool_sim`) and a serving loop run the same code. The per-arrival
search (Eq. 1, Extend, Algorithms 1-3) is in `cdsp_search`, typed for mypyc, which compiles
it at install when it can (`planner`, `PLANNER_COMPILED`; the same plans either way).

The seed lost its formulas; section A of research/seeds-001-003-004.md rebuilds them from
the prose ([R] there). Implemented as written there:

  Eq. 1  T_sp(h, l) = α_sp + β_sp·l + γ_sp·h·l + δ_sp·l²            (`LatencyModel`)
         h history tokens, l chunk tokens; one coefficient set per SP size, fitted by
         least squares from measured steps (`fit_latency_models`).
  Eq. 2  q_i ← max_{j∈G_c} q_j + T_c  for i ∈ G_c, unchanged elsewhere  (`book_chunk`)
         q_i: seconds until instance i is free. A ring chunk starts when its slowest member
         is free and holds all members until it ends.
  Alg. 1 recursive chunk search (`CdspScheduler.plan` / `ChunkSearch.search`); Alg. 2
         single-chunk scheduling with the improvement rate (`ChunkSearch.single_chunk`);
         Alg. 3 the chunk that fills the gap until the next group is free (in
         `ChunkSearch.search`); `Extend` (`Groups.extend`).

Choices the paper leaves open (A.4), each made here and named where it is made:
  - Gain in Alg. 2 is relative to the best plan so far: (ttft_best - ttft_s) / ttft_best > r.
  - The improvement rate gates only Alg. 2 (the single-chunk plan, which also caps the SP
    of the chunked plans: sp_max, line 4); chunked plans are compared by TTFT alone (l. 20).
  - Valid pairs: |G_prev| <= s_cur < s_next <= sp_max; the recursion gets the sizes >= s_next.
  - "Too short to pay off" (l. 11-12): the chunk has fewer than `min_chunk_tokens`, or leaves
    fewer than that for the chunks after it (then the single chunk at s_cur is the plan).
  - Chunk lengths are floored to a multiple of `chunk_multiple` tokens (Newton's real-valued
    root against a token bucket); Eq. 1's root is closed form (a quadratic).
  - Extend ranks nodes for a multi-node group by the node's longest queue (when the whole
    node is free); ties go to the lower index everywhere.
  - A plan is made once, at arrival (FCFS), and not revised; q_i come from the plan's own
    predictions (a caller that measures a chunk ending late books the real end instead).
  - `aligned=True` restricts every group to an aligned power-of-two block (a buddy
    allocator: a pool of P has P/s blocks of size s), so the engine compiles one program per
    (block, bucket) instead of one per subset. Extend then takes the aligned block of size s
    containing G_prev, or for a first chunk the block whose longest queue is shortest.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import importlib
import math
import pathlib
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import numpy as np

from medha_jax.scheduler import cdsp_search
from medha_jax.scheduler.predictor import _nonnegative_least_squares


def _planner_module():
    """cdsp_search as compiled by mypyc at install (setup.py's compiled_planner) when that
    build is of the source beside it, else the source itself (same plans, 3-4x slower at SP 128)."""
    try:
        compiled = importlib.import_module("medha_jax.scheduler._cdsp_search_compiled")
    except ImportError:
        return cdsp_search
    try:
        digest = hashlib.sha256(pathlib.Path(cdsp_search.__file__).read_bytes()).hexdigest()
    except OSError:   # installed without its sources (bytecode only): nothing to be stale
        return compiled
    if compiled.SOURCE_SHA256 != digest:
        warnings.warn("the compiled CDSP planner was built from an older cdsp_search.py: "
                      "running the source interpreted until the next `make install`",
                      stacklevel=2)
        return cdsp_search
    return compiled


planner = _planner_module()
PLANNER_COMPILED = planner is not cdsp_search
ChunkLatency, ChunkSearch, LatencyModel = planner.ChunkLatency, planner.ChunkSearch, \
    planner.LatencyModel


def fit_latency_models(samples: Iterable[tuple[int, int, int, float]]
                       ) -> dict[int, LatencyModel]:
    """Eq. 1 per SP size by least squares from measured chunks.

    samples: (tokens, history, sp, seconds) of measured prefill steps, e.g. the engine's.
    One fit per SP size (each needs >= 4 samples). Rows are divided by the measured time, so
    the fit minimises relative error (chunks span milliseconds to tens of seconds), and
    coefficients are kept >= 0 so the time never falls as tokens are added (Alg. 3's root
    needs T increasing in l) -- the same solve as `ProfiledPredictor.fit`.
    """
    by_sp: dict[int, list[tuple[float, float, float]]] = {}
    for tokens, history, sp, seconds in samples:
        if tokens < 1 or history < 0 or sp < 1:
            raise ValueError(f"sample needs tokens >= 1, history >= 0, sp >= 1; got "
                             f"{(tokens, history, sp, seconds)}")
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"sample seconds must be finite and > 0, got {seconds!r}")
        by_sp.setdefault(int(sp), []).append((float(tokens), float(history), float(seconds)))
    models = {}
    for sp, rows in sorted(by_sp.items()):
        if len(rows) < 4:
            raise ValueError(f"sp={sp}: need >= 4 samples to fit Eq. 1's 4 coefficients, "
                             f"got {len(rows)}")
        l, h, y = (np.array(col) for col in zip(*rows))
        a = np.stack([np.ones_like(l), l, h * l, l * l], axis=1)
        scale = np.maximum(np.abs(a).max(axis=0), 1e-30)   # columns reach 1e10: condition
        x = _nonnegative_least_squares(a / scale / y[:, None], np.ones_like(y)) / scale
        models[sp] = LatencyModel(sp, *(float(v) for v in x))
    return models


class TabulatedLatency:
    """A measured prefill-time table as a chunk model: F(n) = the time to prefill an
    n-token prompt, piecewise linear through (0, 0) and the table's points (extrapolated with
    the last segment's slope); a chunk costs F(h + l) - F(h).

    The worked examples of the paper's section 2.4 are stated on Table 1's numbers, so tests
    use this to get them exactly; Eq. 1 fitted to the same table is `table1_latency_models`.
    """

    def __init__(self, points: Sequence[tuple[int, float]]):
        pts = sorted((int(n), float(s)) for n, s in points)
        if len(pts) < 1 or pts[0][0] <= 0 or any(b[1] < a[1] or b[0] == a[0]
                                                   for a, b in zip(pts, pts[1:])):
            raise ValueError(f"points must be (tokens > 0, seconds) rising in both: {points}")
        self._n = [0] + [n for n, _ in pts]
        self._s = [0.0] + [s for _, s in pts]

    def _f(self, n: float) -> float:
        i = min(max(bisect.bisect_right(self._n, n) - 1, 0), len(self._n) - 2)
        n0, n1, s0, s1 = self._n[i], self._n[i + 1], self._s[i], self._s[i + 1]
        return s0 + (s1 - s0) * (n - n0) / (n1 - n0)

    def _f_inverse(self, s: float) -> float:
        i = min(max(bisect.bisect_right(self._s, s) - 1, 0), len(self._s) - 2)
        n0, n1, s0, s1 = self._n[i], self._n[i + 1], self._s[i], self._s[i + 1]
        return n0 + (n1 - n0) * (s - s0) / (s1 - s0) if s1 > s0 else n1

    def seconds(self, history: float, tokens: float) -> float:
        return self._f(history + tokens) - self._f(history)

    def tokens_within(self, history: float, budget_s: float) -> float:
        if budget_s <= 0:
            return 0.0
        return max(0.0, self._f_inverse(self._f(history) + budget_s) - history)


# Seed 001, Table 1: Llama-3 8B prefill seconds, batch 1, TP=1, A100-SXM4-80GB, by SP size;
# prompt lengths 4k..256k (SP=1 at 256k ran out of memory).
TABLE1_LLAMA3_8B_A100: dict[int, tuple[tuple[int, float], ...]] = {
    sp: tuple((k * 1024, s) for k, s in zip((4, 8, 16, 32, 64, 128, 256), row) if s is not None)
    for sp, row in {1: (0.28, 0.57, 1.29, 3.22, 9.05, 29.20, None),
                    2: (0.16, 0.31, 0.69, 1.67, 4.61, 14.30, 50.07),
                    4: (0.13, 0.20, 0.39, 0.92, 2.43, 7.32, 24.77),
                    8: (0.21, 0.24, 0.31, 0.58, 1.37, 3.96, 12.81),
                    16: (0.39, 0.43, 0.46, 0.53, 0.96, 2.31, 7.02)}.items()}


def table1_tabulated() -> dict[int, TabulatedLatency]:
    return {sp: TabulatedLatency(points) for sp, points in TABLE1_LLAMA3_8B_A100.items()}


def table1_latency_models() -> dict[int, LatencyModel]:
    """Eq. 1 fitted to Table 1 (Llama-3 8B, A100, TP=1), SP 1..16.

    Table 1 has no history column, so gamma is not identifiable from it: we set gamma =
    2·delta, since a chunk's l² term counts causal (query, key) pairs, half of l², while its
    h·l history pairs are all attended.
    """
    samples = [(n, 0, sp, s) for sp, pts in TABLE1_LLAMA3_8B_A100.items() for n, s in pts]
    return {sp: dataclasses.replace(m, gamma=2 * m.delta)
            for sp, m in fit_latency_models(samples).items()}


# ---------------------------------------------------------------------------------------
# Plans and Eq. 2
# ---------------------------------------------------------------------------------------

class Chunk(NamedTuple):
    """One chunk of a plan: `tokens` prompt tokens after `history`, on instances `group`,
    from start_s to end_s (seconds from the moment the plan was made). A named tuple, not
    a frozen dataclass: building a plan's chunks was 4% of `CdspScheduler.plan`."""

    tokens: int
    history: int
    group: tuple[int, ...]
    start_s: float
    end_s: float

    @property
    def sp(self) -> int:
        return len(self.group)


@dataclasses.dataclass(frozen=True)
class Plan:
    chunks: tuple[Chunk, ...]

    @property
    def ttft_s(self) -> float:
        """Predicted seconds from now until the last chunk ends (the first token)."""
        return self.chunks[-1].end_s

    @property
    def sp_sizes(self) -> tuple[int, ...]:
        return tuple(c.sp for c in self.chunks)


def book_chunk(queues: list[float], group: Sequence[int], seconds: float) -> tuple[float, float]:
    """Eq. 2 [R] in place: the chunk starts when its slowest member is free and every member
    is busy until it ends. Returns (start, end)."""
    start = max(queues[i] for i in group)
    end = start + seconds
    for i in group:
        queues[i] = end
    return start, end


def book_plan(queues: list[float], plan: Plan) -> None:
    """Eq. 2 for each chunk of a plan, in order (relative queues, the plan's time base)."""
    for c in plan.chunks:
        book_chunk(queues, c.group, c.end_s - c.start_s)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CdspConfig:
    """node_size: instances per node (Extend keeps groups inside few nodes).
    sp_sizes: the candidate SP sizes S (powers of two in the paper, "to reduce resource
      fragmentation"); sizes above the pool are dropped.
    improvement_rate: r of Alg. 2: a larger SP is taken only if it cuts TTFT by more than r
      (relative); the pool's `AdaptiveImprovementRate` overrides it per arrival rate.
    chunking: False skips Alg. 1's lines 5-21 (the paper's single-chunk ablation).
    aligned: groups are aligned power-of-two blocks (see the module docstring).
    min_chunk_tokens, chunk_multiple: see the module docstring (lines 11-12, token buckets).
    """

    node_size: int = 8
    sp_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    improvement_rate: float = 0.1
    chunking: bool = True
    aligned: bool = False
    min_chunk_tokens: int = 1024
    chunk_multiple: int = 256

    def __post_init__(self):
        if self.node_size < 1:
            raise ValueError(f"CdspConfig.node_size must be >= 1, got {self.node_size}")
        if not self.sp_sizes or any(s < 1 for s in self.sp_sizes) or \
                list(self.sp_sizes) != sorted(set(self.sp_sizes)):
            raise ValueError(f"CdspConfig.sp_sizes must be distinct, ascending, >= 1: "
                             f"{self.sp_sizes}")
        if self.aligned and any(s & (s - 1) for s in self.sp_sizes):
            raise ValueError(f"CdspConfig.aligned needs power-of-two sp_sizes: {self.sp_sizes}")
        if not 0 <= self.improvement_rate < 1:
            raise ValueError(f"CdspConfig.improvement_rate must be in [0, 1), got "
                             f"{self.improvement_rate}")
        if self.min_chunk_tokens < 1 or self.chunk_multiple < 1:
            raise ValueError(f"CdspConfig.min_chunk_tokens ({self.min_chunk_tokens}) and "
                             f"chunk_multiple ({self.chunk_multiple}) must be >= 1")


class CdspScheduler:
    """Algorithms 1-3 over a pool of `num_instances` prefill instances (node-major: instance
    i is on node i // node_size).

    models: an Eq. 1 model (or any ChunkLatency) per SP size; S is the config's sizes that
    have a model and fit the pool.
    planner: the module whose search plans: `planner` (the compiled build when there is
    one) by default; `cdsp_search` runs the source (tests and benchmarks compare the two).
    """

    def __init__(self, num_instances: int, models: Mapping[int, ChunkLatency],
                 config: CdspConfig = CdspConfig(), *, planner=planner):
        if num_instances < 1:
            raise ValueError(f"num_instances must be >= 1, got {num_instances}")
        self.num_instances, self.config, self.models = num_instances, config, dict(models)
        self.sp_sizes = tuple(s for s in config.sp_sizes if s <= num_instances and s in models)
        if not self.sp_sizes:
            raise ValueError(f"no SP size of {config.sp_sizes} has a model "
                             f"({sorted(models)}) and fits {num_instances} instances")
        # An Eq. 1 model of either build becomes the planner's own, which it calls directly.
        eq1 = (cdsp_search.LatencyModel, LatencyModel)
        search_models = [planner.LatencyModel(m.sp, m.alpha, m.beta, m.gamma, m.delta)
                         if isinstance(m, eq1) else m
                         for m in (self.models[s] for s in self.sp_sizes)]
        self._search = planner.ChunkSearch(list(self.sp_sizes), search_models, config.chunking,
                                           config.chunk_multiple, config.min_chunk_tokens)

    def plan(self, tokens: int, queues: Sequence[float],
             improvement_rate: float | None = None) -> Plan:
        """The chunk plan of a `tokens`-token prompt given each instance's queue q_i (seconds
        until free, >= 0). Does not book it: `book_plan(queues, plan)` is Eq. 2."""
        if tokens < 1:
            raise ValueError(f"tokens must be >= 1, got {tokens}")
        if len(queues) != self.num_instances:
            raise ValueError(f"queues has {len(queues)} entries, the pool {self.num_instances}")
        r = self.config.improvement_rate if improvement_rate is None else improvement_rate
        chunks = self._search.plan(tokens, queues, self.config.node_size, self.config.aligned,
                                   float(r))
        if not chunks:
            raise RuntimeError(f"no group of any size in {self.sp_sizes} fits the pool")
        return Plan(tuple(map(Chunk._make, chunks)))


class FixedSpScheduler:
    """The fixed-SP baseline: the pool cut into independent groups of `sp` instances (node by
    node, so a group stays inside a node where it fits), each request, whole, to the group
    where it would finish first by Eq. 1 (its longest queue plus its predicted time)."""

    def __init__(self, num_instances: int, sp: int, model: ChunkLatency):
        if sp < 1 or num_instances % sp:
            raise ValueError(f"fixed SP {sp} must divide the pool's {num_instances} instances")
        self.num_instances, self.sp, self.model = num_instances, sp, model
        self.groups = [tuple(range(b, b + sp)) for b in range(0, num_instances, sp)]

    def plan(self, tokens: int, queues: Sequence[float], improvement_rate: float | None = None
             ) -> Plan:
        t = self.model.seconds(0, tokens)
        group = min(self.groups, key=lambda g: max(queues[i] for i in g))
        start = max(queues[i] for i in group)
        return Plan((Chunk(tokens, 0, group, start, start + t),))


# ---------------------------------------------------------------------------------------
# The improvement rate: profiled per arrival rate, chosen from a sliding window
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ImprovementRateTable:
    """The offline profile: the best improvement rate at each simulated arrival rate."""

    arrival_rates: tuple[float, ...]      # requests/s, ascending
    improvement_rates: tuple[float, ...]

    def __post_init__(self):
        if not self.arrival_rates or len(self.arrival_rates) != len(self.improvement_rates):
            raise ValueError("ImprovementRateTable needs one improvement rate per arrival rate")
        if list(self.arrival_rates) != sorted(set(self.arrival_rates)):
            raise ValueError(f"arrival_rates must be distinct and ascending: {self.arrival_rates}")

    def lookup(self, arrival_rate: float) -> float:
        """The improvement rate of the recorded arrival rate closest to the observed one
        (ties go to the lower rate)."""
        i = min(range(len(self.arrival_rates)),
                key=lambda k: abs(self.arrival_rates[k] - arrival_rate))
        return self.improvement_rates[i]


class AdaptiveImprovementRate:
    """Online: the arrival rate over a sliding window, looked up every `update_every_s`.

    The paper updates "every 30 seconds"; the window's length it does not give: we use 60 s
    (two update periods). Before the first update (a cold start), the rate is looked up at
    every arrival from the arrivals so far ((count - 1) / span), and the first arrival gets
    the table's lowest-load entry (an empty system is at light load).
    """

    def __init__(self, table: ImprovementRateTable, *, window_s: float = 60.0,
                 update_every_s: float = 30.0):
        if window_s <= 0 or update_every_s <= 0:
            raise ValueError(f"{window_s=} and {update_every_s=} must be > 0")
        self.table, self.window_s, self.update_every_s = table, window_s, update_every_s
        self.current = table.improvement_rates[0]
        self._arrivals: list[float] = []
        self._first: float | None = None
        self._next_update: float | None = None
        self._updated = False

    def observe(self, now: float) -> float:
        """Records an arrival at `now` and returns the improvement rate to plan it with."""
        if self._first is None:
            self._first, self._next_update = now, now + self.update_every_s
        self._arrivals.append(now)
        if now < self._next_update:
            if not self._updated and now > self._first:   # cold start: every arrival so far
                self.current = self.table.lookup((len(self._arrivals) - 1) / (now - self._first))
        else:
            cut = bisect.bisect_left(self._arrivals, now - self.window_s)
            del self._arrivals[:cut]
            span = min(self.window_s, now - self._first)
            self.current = self.table.lookup(len(self._arrivals) / span)
            self._updated = True
            while self._next_update <= now:
                self._next_update += self.update_every_s
        return self.current


# ---------------------------------------------------------------------------------------
# Decode routing (section 5.2): freeness with virtual usage
# ---------------------------------------------------------------------------------------

class DecodeRouter:
    """Sends each prefilled request to the decode instance with the highest freeness:
    (slots free, counting the slots of requests still being transferred as used -- Llumnix's
    virtual usage) / active batch size.

    Open choices: an instance with an empty batch has infinite freeness (any free slot beats
    a busy instance); ties go to the lower index; a request's slots are its prompt plus its
    output budget, reserved whole at routing time.
    """

    def __init__(self, slots_per_instance: Sequence[int]):
        if not slots_per_instance or any(s < 1 for s in slots_per_instance):
            raise ValueError(f"slots_per_instance must be >= 1 each: {slots_per_instance}")
        self.slots = list(slots_per_instance)
        self.used = [0] * len(self.slots)
        self.virtual = [0] * len(self.slots)
        self.batch = [0] * len(self.slots)
        self._where: dict[str, tuple[int, int, bool]] = {}   # id -> (instance, slots, landed)

    def freeness(self, i: int) -> float:
        free = self.slots[i] - self.used[i] - self.virtual[i]
        return math.inf if self.batch[i] == 0 else free / self.batch[i]

    def route(self, request_id: str, slots: int) -> int | None:
        """Picks an instance with room for `slots`, counts them as virtual usage; None if no
        instance has room (the caller retries when a request finishes)."""
        if request_id in self._where:
            raise ValueError(f"request {request_id!r} is already routed")
        fits = [i for i in range(len(self.slots))
                if self.slots[i] - self.used[i] - self.virtual[i] >= slots]
        if not fits:
            return None
        i = max(fits, key=lambda k: (self.freeness(k), -k))
        self.virtual[i] += slots
        self._where[request_id] = (i, slots, False)
        return i

    def transfer_done(self, request_id: str) -> None:
        """All chunks of its KV arrived: virtual usage becomes real, it joins the batch."""
        i, slots, landed = self._where[request_id]
        if landed:
            raise ValueError(f"request {request_id!r} already landed")
        self.virtual[i] -= slots
        self.used[i] += slots
        self.batch[i] += 1
        self._where[request_id] = (i, slots, True)

    def finish(self, request_id: str) -> None:
        i, slots, landed = self._where.pop(request_id)
        if landed:
            self.used[i] -= slots
            self.batch[i] -= 1
        else:
            self.virtual[i] -= slots
