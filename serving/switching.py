"""Live DP <-> TP switching on one host: Flying Serving's Algorithm 1, in this process.

The host's devices serve as DP base replicas of one device or a small TP group each (an
Engine and a controller each). Aligned, contiguous runs of 2, 4, 8 of them bind into one
TP group (medha_jax.engine.tp_group: the members' weights and KV pages are used where they
lie) and release again. `SwitchingCoordinator.step()` is one iteration of Algorithm 1:

1. the global task pool's new requests get a mode from the policy (❷❸: one thread owns
   the pool, so every engine sees the same queue);
2. groups bind and release at their safe point (❺): when none of their devices has a step
   in flight. A TP group's requests have one order for every member by construction: the
   group has one controller and runs one program over its members;
3. every idle unbound replica and every idle bound group gets its next step (❻).

The units step independently, not in lockstep: each has at most one step in flight, and
whichever finishes first is applied and given its next step at once (`first_done`), so a
replica decoding a few requests never waits for one running a long prefill. The serving
loop's InFlightRunner drives this (the coordinator is its controller and its executor, up
to one batch in flight per base replica); `step()` is one such turn. Only a binding waits:
its members take no new step (hard) or no new request (soft) until it is active.

Policies (`SwitchingConfig`; the paper leaves every threshold open):
- "load": a request goes TP when the host is nearly idle (at most `load_max_queued`
  requests queued or running over all replicas and bound groups: latency is worth more
  than the replicas' throughput then), DP otherwise (a burst drains faster over N
  replicas).
- "priority": a request whose priority value is <= `priority_threshold` (lower is more
  important, as everywhere in the project) binds a TP group at once: hard preemption
  pauses the members' DP requests (they keep their KV pages, nothing is scheduled for
  them) and they resume when the group releases.
- "memory": a request whose prompt + max_new_tokens exceed what one replica holds binds
  the smallest group that holds it.
- "off": DP only.

Soft preemption ("load", "memory" when the request fits one replica): while the chosen
group's members still run DP requests, the TP request runs in DP on an idle member; when
the last member drains it moves to the group and its prompt + output so far are
recomputed under TP (the replica failover path, `resumed_request`). Its DP pages are freed
first, so the recompute fits.
A group releases when it has no request left (a TP-layout KV cannot go back to DP without
a recompute: the simplest reading of the paper's release).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Sequence

from medha_jax.engine.step_inputs import StepInputs
from medha_jax.engine.tp_group import TPGroupEngine
from medha_jax.request import (Batch, FinishReason, Request, RequestUpdate, StepResult,
                               VirtualClock, WallClock)
from medha_jax.scheduler import SchedulerConfig
from medha_jax.scheduler.factory import make_controller
from medha_jax.scheduler.in_flight import InFlightRunner
from serving.replicas import resumed_request

POLICIES = ("off", "load", "priority", "memory")
_POLL_S = 100e-6           # how often first_done looks at the units' steps on a device


@dataclasses.dataclass(frozen=True)
class SwitchingConfig:
    """The mode policy and its thresholds.

    group_sizes: the TP degrees groups may take (powers of two; aligned groups only).
    load_max_queued: "load": TP while at most this many requests are queued or running on
        the replicas and bound groups (1: only a lone request gets a group, so a burst's
        second request already keeps DP's throughput).
    tp_group_size: the degree "load" and "priority" bind (None: the largest of group_sizes).
    priority_threshold: "priority": requests with priority <= this bind a group at once.
    priority_preemption: "hard" (the paper's, for latency: the members' DP requests pause)
        or "soft" (they finish first while the request runs in DP on an idle member).
    max_pause_s: how long a hard binding may pause its members' DP requests: after that it
        takes no new request (they wait for its release), drains and releases, and for as
        long again its members serve in DP, priority requests too (a hard binding over
        them waits), so the paused requests get at least half the devices' time. None: no
        bound (a steady stream of priority requests keeps them paused), the default: the
        paper's, and what its Table 1 measures. The bound trades the priority requests'
        latency for the others' (benchmarks/switching.py --sim: Table 1 with 1 s).
    """

    policy: str = "load"
    group_sizes: tuple[int, ...] = (2, 4, 8)
    load_max_queued: int = 1
    tp_group_size: int | None = None
    priority_threshold: int = -1
    priority_preemption: str = "hard"
    max_pause_s: float | None = None

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"SwitchingConfig.policy must be one of {POLICIES}, got "
                             f"{self.policy!r}")
        if not self.group_sizes or any(m < 2 or m & (m - 1) for m in self.group_sizes):
            raise ValueError(f"SwitchingConfig.group_sizes must be powers of two >= 2, got "
                             f"{self.group_sizes!r}")
        if self.load_max_queued < 0:
            raise ValueError(f"SwitchingConfig.load_max_queued must be >= 0, got "
                             f"{self.load_max_queued!r}")
        if self.priority_preemption not in ("hard", "soft"):
            raise ValueError(f"SwitchingConfig.priority_preemption must be 'hard' or 'soft', "
                             f"got {self.priority_preemption!r}")
        if self.max_pause_s is not None and not self.max_pause_s >= 0:
            raise ValueError(f"SwitchingConfig.max_pause_s must be >= 0 or None, got "
                             f"{self.max_pause_s!r}")
        if self.tp_group_size is not None and self.tp_group_size not in self.group_sizes:
            raise ValueError(f"SwitchingConfig.tp_group_size={self.tp_group_size} is not one of "
                             f"group_sizes={self.group_sizes}")


def aligned_groups(num_replicas: int, sizes: Sequence[int]) -> list[tuple[int, int]]:
    """(start, size) of every aligned contiguous group: N=4, sizes (2, 4) -> (0,2), (2,2),
    (0,4); never (1,2) (the paper's communicator pool: the number grows linearly)."""
    return [(start, m) for m in sorted(sizes) if m <= num_replicas
            for start in range(0, num_replicas - m + 1, m)]


@dataclasses.dataclass
class UnitBatches(Batch):
    """One iteration's batches, one per busy unit; `chunks` lists them all (what the
    serving loop reads to name a batch's requests)."""

    parts: list = dataclasses.field(default_factory=list)     # (unit, its Batch)


@dataclasses.dataclass(frozen=True)
class PoolTotals:
    """Several KV pools counted as one (what the serving loop reports as the server's)."""

    pools: Sequence

    @property
    def num_pages(self) -> int:
        return sum(a.num_pages for a in self.pools)

    @property
    def num_free_pages(self) -> int:
        return sum(a.num_free_pages for a in self.pools)


@dataclasses.dataclass
class _Unit:
    """One executor the coordinator steps: a base replica or a TP group."""

    engine: object
    controller: object
    name: str


@dataclasses.dataclass
class _Binding:
    """A TP group bound (or binding) for its requests."""

    key: tuple[int, int]
    hard: bool
    active: bool = False                 # members switched to the group
    waiting: list = dataclasses.field(default_factory=list)      # TP requests not yet moved
    speculative: dict = dataclasses.field(default_factory=dict)  # rid -> member running it
    decided_at: float | None = None      # perf_counter of the switch (for its latency)
    active_since: float | None = None    # clock time it became active
    closing: bool = False                # takes no new request: drains, then releases


class SwitchingCoordinator:
    """Algorithm 1 over `engines` (DP base replicas of one model and config, one device or
    one TP-b mesh each).

    Every aligned group's TP engine is built here and compiled by `warmup()` (every bucket
    of every group, each run once: on a GPU that first run builds the group's
    communicators), so no switch compiles anything.
    """

    def __init__(self, engines: Sequence, config: SwitchingConfig, *, predictor,
                 scheduler_config: SchedulerConfig | None = None, clock=None,
                 eos_token_ids: Sequence[int] = (), groups: dict | None = None):
        """groups: TP group engines by (start, size) to reuse (already warmed up), e.g.
        from another coordinator over the same engines; the missing ones are built."""
        self.config = config
        self.clock = clock or WallClock()
        scheduler_config = scheduler_config or SchedulerConfig("fcfs")

        def unit(engine, name):
            sched = dataclasses.replace(scheduler_config,
                                        token_buckets=tuple(engine.ladder.token_buckets),
                                        max_seqs_per_batch=engine.max_seqs)
            return _Unit(engine, make_controller(
                sched, allocator=engine.allocator, clock=self.clock, predictor=predictor,
                model_config=engine.model.config, eos_token_ids=eos_token_ids,
                max_model_len=engine.max_model_len), name)

        self.replicas = [unit(e, f"dp{i}") for i, e in enumerate(engines)]
        # Devices of one base replica: a group of m runs TP-(m * base_tp).
        mesh = getattr(engines[0].model, "mesh", None)
        self.base_tp = mesh.size if mesh is not None else engines[0].tp
        self.groups = {}
        if config.policy != "off":
            for start, m in aligned_groups(len(engines), config.group_sizes):
                group = (groups or {}).get((start, m)) or TPGroupEngine(
                    list(engines[start:start + m]))
                self.groups[(start, m)] = unit(group, f"tp{m}@{start}")
        self.pool: collections.deque[Request] = collections.deque()
        self.bindings: dict[tuple[int, int], _Binding] = {}
        self.mode_changes = collections.Counter()          # "bind" / "release"
        self.requests_per_mode = collections.Counter()     # "dp" / "tp2" / ... (TP degree)
        # The last switches' latencies (bounded: a server runs for weeks).
        self.switch_latencies_s: collections.deque[float] = collections.deque(maxlen=10_000)
        self.finished: dict[str, Request] = {}
        self.last_finished: list[Request] = []             # by the last update()
        self._moved: set[str] = set()                      # speculative DP runs taken over
        self._deferred: list[Request] = []                 # placed at a later boundary
        self._stepping: set[str] = set()                   # names of units with a step in flight
        # Replica index -> clock time until which no hard binding may pause it (its DP
        # requests' turn after a binding closed on max_pause_s).
        self._dp_turn_until: dict[int, float] = {}
        self._last_update = self.clock.now()
        self._runner = InFlightRunner(self, self)          # step() / run() without a server

    # -- setup --------------------------------------------------------------------

    def warmup(self, progress: bool = False) -> None:
        """Compiles every replica's and every group's buckets and runs each group's once."""
        for unit in self.replicas:
            unit.engine.warmup(progress=progress)
        for unit in self.groups.values():
            unit.engine.warmup(progress=progress)
            for shape, executable in unit.engine.executables.items():
                inputs = StepInputs.padding(shape, unit.engine.pad_slot)
                outputs, unit.engine.kv_cache = executable(*unit.engine.step_args(inputs)[1:])
                outputs.tokens.block_until_ready()

    # -- requests -----------------------------------------------------------------

    def submit(self, request: Request) -> None:
        """Into the global task pool; placed at the next iteration boundary. Raises
        ValueError for a request no unit it may go to can hold (the "memory" policy's
        widest group, else one replica), before it is queued."""
        self.check_fits(request.prompt_len, request.max_new_tokens,
                        request_id=request.request_id)
        self.pool.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.pool) or any(u.controller.has_unfinished() for u in self._all_units()) \
            or any(b.waiting for b in self.bindings.values())

    @property
    def replica_tokens(self) -> int:
        """Tokens one base replica can hold for one request."""
        return self.replicas[0].engine.max_model_len

    # -- Algorithm 1 --------------------------------------------------------------

    def run(self, max_steps: int = 100_000) -> dict[str, Request]:
        for _ in range(max_steps):
            if not self.has_unfinished():
                return self.finished
            self.step()
        raise RuntimeError(f"requests left after {max_steps} steps")

    def _mode(self, request: Request) -> tuple[int, bool]:
        """(TP degree or 1 for DP, hard preemption) the policy gives a new request."""
        policy, sizes = self.config.policy, sorted(self.config.group_sizes)
        usable = [m for m in sizes if m <= len(self.replicas)]
        widest = self.config.tp_group_size or (usable[-1] if usable else 1)
        if policy == "off" or not usable:
            return 1, False
        if policy == "memory":
            need = request.prompt_len + request.max_new_tokens
            if need <= self.replica_tokens:
                return 1, False
            # submit() refused what no group holds.
            return next(m for m in usable if need <= self._group_tokens(m)), False
        if policy == "priority":
            if request.priority > self.config.priority_threshold:
                return 1, False
            return widest, self.config.priority_preemption == "hard"
        # Every unit's queue counts, a bound group's too: counting only the DP replicas'
        # would read a host whose work all sits in one group as idle, and keep sending it
        # every new request while the free replicas idle.
        queued = (sum(self._load(u) for u in self._units()) + len(self.pool) + len(self._deferred)
                  + sum(len(b.waiting) for b in self.bindings.values()))
        return (widest, False) if queued <= self.config.load_max_queued else (1, False)

    def _group_tokens(self, m: int) -> int:
        """Tokens one request may hold on a TP group of m."""
        return self.groups[(0, m)].engine.max_model_len

    def _bound_members(self) -> set[int]:
        return {i for (s, m) in self.bindings for i in range(s, s + m)}

    def _place(self) -> None:
        # A request that cannot be placed yet (every replica bound, or every group of its
        # size overlapping a bound one) stays in the pool, in order; those behind it are
        # still placed, so a high-priority request does not queue behind DP requests that
        # wait for a release.
        while self.pool:
            request = self.pool.popleft()
            m, hard = self._mode(request)
            if m == 1:
                free = [i for i in range(len(self.replicas)) if i not in self._bound_members()]
                if not free:           # every replica bound: the request waits for a release
                    self._deferred.append(request)
                    continue
                target = min(free, key=lambda i: self._load(self.replicas[i]))
                self.replicas[target].controller.add_request(request)
                self.requests_per_mode["dp"] += 1
                continue
            key = self._group_for(m)
            if key is None:                              # every group of m overlaps another
                self._deferred.append(request)
                continue
            if hard and key not in self.bindings and any(
                    self._dp_turn_until.get(i, -1.0) > self.clock.now()
                    for i in range(key[0], key[0] + key[1])):
                # Its members' DP requests have their turn: it runs in DP meanwhile.
                target = min(range(key[0], key[0] + key[1]),
                             key=lambda i: self._load(self.replicas[i]))
                self.replicas[target].controller.add_request(request)
                self.requests_per_mode["dp"] += 1
                continue
            binding = self.bindings.setdefault(key, _Binding(key, hard))
            binding.hard = binding.hard or hard
            self.requests_per_mode[f"tp{m * self.base_tp}"] += 1
            if binding.active:
                self.groups[key].controller.add_request(request)
                continue
            binding.waiting.append(request)
            start, _ = key
            idle = [i for i in range(start, start + m) if not self._busy(i)
                    and i not in binding.speculative.values()]
            if not binding.hard and idle and \
                    request.prompt_len + request.max_new_tokens <= self.replica_tokens:
                # Soft preemption: run it in DP on an idle member meanwhile.
                self.replicas[idle[0]].controller.add_request(request)
                binding.speculative[request.request_id] = idle[0]
        self.pool.extend(self._deferred)
        self._deferred.clear()

    def _group_for(self, m: int) -> tuple[int, int] | None:
        """The aligned group of m to bind: one already bound to m, else the least loaded one
        that overlaps no bound group."""
        for key, binding in self.bindings.items():
            if key[1] == m and not binding.closing:
                return key
        bound = self._bound_members()
        free = [(s, k) for (s, k) in self.groups if k == m
                and not bound & set(range(s, s + k))]
        if not free:
            return None
        return min(free, key=lambda g: sum(self._load(self.replicas[i])
                                           for i in range(g[0], g[0] + g[1])))

    def _busy(self, i: int) -> bool:
        return self.replicas[i].controller.has_unfinished()

    @staticmethod
    def _load(unit: _Unit) -> int:
        return unit.controller.num_waiting + unit.controller.num_running

    def _release(self) -> None:
        """A group with no request left releases its members to DP (their paused requests
        go on from the pages they kept). A hard binding that has paused DP requests for
        max_pause_s closes: it takes no new request, so it drains and releases."""
        max_pause = self.config.max_pause_s
        for key, binding in list(self.bindings.items()):
            if binding.hard and binding.active and not binding.closing and \
                    max_pause is not None and \
                    self.clock.now() - binding.active_since >= max_pause and \
                    any(self._busy(i) for i in range(key[0], key[0] + key[1])):
                binding.closing = True
            group = self.groups[key]
            if binding.active and not group.controller.has_unfinished() and \
                    group.name not in self._stepping:
                if binding.closing:
                    for i in range(key[0], key[0] + key[1]):
                        self._dp_turn_until[i] = self.clock.now() + max_pause
                del self.bindings[key]
                self.mode_changes["release"] += 1

    def _switch(self) -> None:
        """The safe point: release finished groups, bind those whose members are ready."""
        self._release()
        for key, binding in list(self.bindings.items()):
            start, m = key
            group = self.groups[key]
            if binding.active:
                continue
            speculative = set(binding.speculative)
            for rid in list(speculative):               # finished in DP before the switch
                member = self.replicas[binding.speculative[rid]].controller
                if member.get(rid) is None or rid in member.finished:
                    speculative.discard(rid)
            members = range(start, start + m)
            ready = binding.hard or all(
                {r.request_id for r in self.replicas[i].controller.unfinished()} <= speculative
                for i in members)
            # The safe point: no member has a step in flight (the group's program takes
            # their weights and pages).
            if not ready or any(self.replicas[i].name in self._stepping for i in members):
                continue
            binding.decided_at = time.perf_counter()
            for request in binding.waiting:
                rid = request.request_id
                if rid in binding.speculative:
                    member = self.replicas[binding.speculative[rid]].controller
                    if rid not in speculative:           # done in DP already
                        continue
                    # Soft preemption's switch: drop the DP run (its pages freed), recompute
                    # prompt + output under TP.
                    member.cancel(rid)
                    self._moved.add(rid)
                    request = resumed_request(request, list(request.output_token_ids))
                    group.controller.add_request(request, resume=True)
                else:
                    group.controller.add_request(request)
            binding.waiting.clear()
            binding.active = True
            binding.active_since = self.clock.now()
            self.mode_changes["bind"] += 1

    def _units(self) -> list[_Unit]:
        active = [self.groups[k] for k, b in self.bindings.items() if b.active]
        return [u for i, u in enumerate(self.replicas) if not self._active_over(i)] + active

    def _paused(self, i: int) -> bool:
        """Replica i is a member of a hard binding not yet active: it takes no new step, so
        that its step in flight is its last before the group's."""
        return any(b.hard and not b.active and b.key[0] <= i < b.key[0] + b.key[1]
                   for b in self.bindings.values())

    def _all_units(self) -> list[_Unit]:
        """Every replica and group, bound or not (a paused member still holds requests)."""
        return self.replicas + list(self.groups.values())

    def _active_over(self, i: int) -> bool:
        return any(b.active and b.key[0] <= i < b.key[0] + b.key[1]
                   for b in self.bindings.values())

    # -- the units' steps as a controller's schedule() / update() around an executor ------
    # The server's ServingLoop drives the coordinator as it drives one replica: it is the
    # controller (schedule, update, add_request, finish, ...) and the executor (dispatch,
    # first_done, collect) at once, with up to one batch in flight per unit.

    @property
    def max_in_flight(self) -> int:
        """One step in flight per base replica at most (a bound group's occupies all of
        its members)."""
        return len(self.replicas)

    def schedule(self) -> UnitBatches:
        """At this boundary: places the pool, switches the groups at their safe point and
        forms the next batch of one idle unit (the first in device order with a step to
        run); empty when no idle unit has one."""
        self._place()
        self._switch()
        paused = {self.replicas[i].name for i in range(len(self.replicas)) if self._paused(i)}
        for unit in self._units():
            if unit.name in self._stepping or unit.name in paused or \
                    not unit.controller.has_unfinished():
                continue
            batch = unit.controller.schedule()
            if batch:
                return UnitBatches(batch.chunks, batch.predicted_time_s, parts=[(unit, batch)])
        return UnitBatches([], 0.0)

    def dispatch(self, batch: UnitBatches) -> tuple:
        """Starts the unit's step on its devices without waiting for it."""
        (unit, part), = batch.parts
        handle = unit.engine.dispatch(part)
        self._stepping.add(unit.name)
        if isinstance(unit.engine, TPGroupEngine):
            for binding in self.bindings.values():
                if self.groups[binding.key] is unit and binding.decided_at is not None:
                    self.switch_latencies_s.append(time.perf_counter() - binding.decided_at)
                    binding.decided_at = None
        return unit, handle

    def first_done(self, handles: Sequence[tuple]) -> int:
        """The position in `handles` of a step that has finished, waiting for one.

        Simulated engines say when each step ends (`done_at`): the earliest. Device engines
        are polled (`is_ready`): the device runs the units' programs concurrently and
        offers no wait-for-any."""
        if all(hasattr(unit.engine, "done_at") for unit, _ in handles):
            ends = [unit.engine.done_at(handle) for unit, handle in handles]
            return ends.index(min(ends))
        while True:
            for i, (unit, handle) in enumerate(handles):
                if unit.engine.is_ready(handle):
                    return i
            time.sleep(_POLL_S)

    def collect(self, pending: tuple) -> StepResult:
        unit, handle = pending
        try:
            return unit.engine.collect(handle)
        finally:
            self._stepping.discard(unit.name)

    def update(self, batch: UnitBatches, result: StepResult) -> list[RequestUpdate]:
        (unit, part), = batch.parts
        updates = unit.controller.update(part, result)
        self.last_finished = self._harvest()
        self._release()
        self._tick()
        return updates

    def _tick(self) -> None:
        # A virtual clock no executor moved (real engines) still ticks; simulated engines
        # (medha_jax.cluster.switching_sim) have moved it to the step's end.
        if isinstance(self.clock, VirtualClock) and self.clock.now() == self._last_update:
            self.clock.advance(1e-3)
        self._last_update = self.clock.now()

    def _harvest(self) -> list[Request]:
        """Moves the units' finished requests to `finished` (a speculative DP run dropped
        at its switch is not finished: it goes on under TP)."""
        done = []
        for unit in self._all_units():
            for request in unit.controller.pop_finished():
                if request.request_id in self._moved and \
                        request.finish_reason is FinishReason.CANCELLED:
                    self._moved.discard(request.request_id)
                    continue
                self.finished[request.request_id] = request
                done.append(request)
        return done

    def step(self) -> list[Request]:
        """One turn without a server: every idle unit gets its next step, then the first
        step to finish is applied. Returns the requests that finished."""
        if self._runner.step() is None:
            self.last_finished = self._harvest()
            self._release()
            self._tick()
        return self.last_finished

    # -- what the serving loop asks of a controller --------------------------------

    def add_request(self, request: Request, *, resume: bool = False,
                    kv_from: tuple[str, int] | None = None) -> None:
        """Into the global task pool (see `submit`). resume: ignored (a re-run from the
        tokens it brings is placed like any request). kv_from: no KV hand-off reaches a
        switching server (it runs no disaggregation), so none is taken."""
        if kv_from is not None:
            raise ValueError("a switching server takes no KV hand-off (kv_from)")
        self.submit(request)

    def check_fits(self, prompt_len: int, max_new_tokens: int, *, request_id: str = "") -> None:
        """Raises ValueError when no unit a request may go to holds it."""
        need = prompt_len + max_new_tokens
        if need > self.max_model_len:
            raise ValueError(f"request {request_id!r}: prompt_len + max_new_tokens = {need} "
                             f"tokens exceed the {self.max_model_len} one request may hold "
                             f"here")

    @property
    def max_model_len(self) -> int:
        """Tokens one request may hold: the "memory" policy's widest group, else one
        replica's."""
        sizes = [m for m in self.config.group_sizes if (0, m) in self.groups]
        if self.config.policy == "memory" and sizes:
            return max(self._group_tokens(m) for m in sizes)
        return self.replica_tokens

    def finish(self, request_id: str, reason: FinishReason) -> bool:
        """Ends a request wherever it is (pool, a binding's waiting list, a unit); its
        pages are freed. False when it is not here."""
        found = False
        for request in [r for r in self.pool if r.request_id == request_id]:
            self.pool.remove(request)
            request.finish_reason = reason
            found = True
        for binding in self.bindings.values():
            for request in [r for r in binding.waiting if r.request_id == request_id]:
                binding.waiting.remove(request)
                request.finish_reason = reason
                found = True
            member = binding.speculative.pop(request_id, None)
            if member is not None:
                found = self.replicas[member].controller.finish(request_id, reason) or found
        for unit in self._all_units():     # paused members' requests too
            found = unit.controller.finish(request_id, reason) or found
        return found

    def pop_finished(self) -> list[Request]:
        self._harvest()
        done = list(self.finished.values())
        self.finished.clear()
        self._release()
        return done

    @property
    def num_waiting(self) -> int:
        return len(self.pool) + sum(len(b.waiting) - len(b.speculative)
                                    for b in self.bindings.values()) \
            + sum(u.controller.num_waiting for u in self._all_units())

    @property
    def num_running(self) -> int:
        return sum(u.controller.num_running for u in self._all_units())

    @property
    def num_preemptions(self) -> int:
        return sum(u.controller.num_preemptions for u in self._all_units())

    @property
    def allocator(self) -> PoolTotals:
        """The base replicas' pools together (a group's pages are booked in them)."""
        return PoolTotals([u.engine.allocator for u in self.replicas])



class SwitchingReplica:
    """A Server's one replica when it switches (`Server(parallel=ParallelConfig(dp=N),
    switching=...)`): the coordinator over the host's base replicas, driven by one
    ServingLoop as the controller and executor of a single replica would be.

    The predictor is the base replica's (saved, else derived from the roofline), used for
    every unit: a TP group's steps are faster than it predicts, so its chunks are sized
    conservatively. It is not refined online here (a step mixes units of several sizes)."""

    role = "mixed"

    def __init__(self, engines: Sequence, config: SwitchingConfig, *, scheduler_config,
                 predictor, predictor_how: str, clock, metrics, eos_token_ids: Sequence[int],
                 warmup: bool):
        from serving.loop import ServingLoop

        self.index = 0
        self.engine = engines[0]
        self.engines = list(engines)
        self.predictor, self.predictor_how = predictor, predictor_how
        self.coordinator = SwitchingCoordinator(
            engines, config, predictor=predictor, scheduler_config=scheduler_config,
            clock=clock, eos_token_ids=eos_token_ids)
        if warmup:
            self.coordinator.warmup()
        self.controller = self.coordinator
        self._metrics = metrics
        self.loop = ServingLoop(self.coordinator, self.coordinator, metrics,
                                name="medha-server-loop-switching", on_step=self._on_step)

    def _on_step(self, collected) -> None:
        coordinator = self.coordinator
        latencies = []
        while coordinator.switch_latencies_s:     # the server's histogram takes them
            latencies.append(coordinator.switch_latencies_s.popleft())
        self._metrics.observe_switching(coordinator.mode_changes,
                                        coordinator.requests_per_mode, latencies)
