"""Live DP <-> TP switching on one host: Flying Serving's Algorithm 1, in this process.

The host's devices serve as single-device DP base replicas (an Engine and a controller
each). Aligned, contiguous runs of 2, 4, 8 of them bind into one TP group
(medha_jax.engine.tp_group: the members' weights and KV pages are used where they lie) and
release again. `SwitchingCoordinator.step()` is one iteration of Algorithm 1:

1. the global task pool's new requests get a mode from the policy (❷❸: one thread owns
   the pool, so every engine sees the same queue);
2. at this safe point (every dispatched step has been collected) groups bind and release
   (❺), and a TP group's requests have one order for every member by construction: the
   group has one controller and runs one program over its members;
3. every unbound replica and every bound group runs one step (❻), all dispatched before
   any is collected, so the devices run them concurrently.

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
from medha_jax.request import FinishReason, Request, VirtualClock, WallClock
from medha_jax.scheduler import SchedulerConfig
from medha_jax.scheduler.factory import make_controller
from serving.replicas import resumed_request

POLICIES = ("off", "load", "priority", "memory")


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
    """

    policy: str = "load"
    group_sizes: tuple[int, ...] = (2, 4, 8)
    load_max_queued: int = 1
    tp_group_size: int | None = None
    priority_threshold: int = -1
    priority_preemption: str = "hard"

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
        if self.tp_group_size is not None and self.tp_group_size not in self.group_sizes:
            raise ValueError(f"SwitchingConfig.tp_group_size={self.tp_group_size} is not one of "
                             f"group_sizes={self.group_sizes}")


def aligned_groups(num_replicas: int, sizes: Sequence[int]) -> list[tuple[int, int]]:
    """(start, size) of every aligned contiguous group: N=4, sizes (2, 4) -> (0,2), (2,2),
    (0,4); never (1,2) (the paper's communicator pool: the number grows linearly)."""
    return [(start, m) for m in sorted(sizes) if m <= num_replicas
            for start in range(0, num_replicas - m + 1, m)]


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


class SwitchingCoordinator:
    """Algorithm 1 over `engines` (single-device DP base replicas of one model and config).

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
        self.groups = {}
        if config.policy != "off":
            for start, m in aligned_groups(len(engines), config.group_sizes):
                group = (groups or {}).get((start, m)) or TPGroupEngine(
                    list(engines[start:start + m]))
                self.groups[(start, m)] = unit(group, f"tp{m}@{start}")
        self.pool: collections.deque[Request] = collections.deque()
        self.bindings: dict[tuple[int, int], _Binding] = {}
        self.mode_changes = collections.Counter()          # "bind" / "release"
        self.requests_per_mode = collections.Counter()     # "dp" / "tp2" / ...
        self.switch_latencies_s: list[float] = []
        self.finished: dict[str, Request] = {}
        self._moved: set[str] = set()                      # speculative DP runs taken over
        self._deferred: list[Request] = []                 # placed at a later boundary

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
        need = request.prompt_len + request.max_new_tokens
        sizes = [m for m in self.config.group_sizes if (0, m) in self.groups]
        limit = (max(self._group_tokens(m) for m in sizes)
                 if self.config.policy == "memory" and sizes else self.replica_tokens)
        if need > limit:
            raise ValueError(f"request {request.request_id!r}: prompt_len + max_new_tokens = "
                             f"{need} tokens exceed the {limit} one request may hold here")
        self.pool.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.pool) or any(u.controller.has_unfinished() for u in self._units()) \
            or any(b.waiting for b in self.bindings.values())

    @property
    def replica_tokens(self) -> int:
        """Tokens one base replica can hold for one request."""
        return self.replicas[0].engine.max_model_len

    # -- Algorithm 1 --------------------------------------------------------------

    def step(self) -> list[Request]:
        """One iteration: place the pool, switch at the safe point, run one step on every
        busy unit. Returns the requests that finished."""
        self._place()
        self._switch()
        return self._execute()

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
            binding = self.bindings.setdefault(key, _Binding(key, hard))
            binding.hard = binding.hard or hard
            self.requests_per_mode[f"tp{m}"] += 1
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
        for key in self.bindings:
            if key[1] == m:
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
        go on from the pages they kept)."""
        for key, binding in list(self.bindings.items()):
            if binding.active and not self.groups[key].controller.has_unfinished():
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
            ready = binding.hard or all(
                {r.request_id for r in self.replicas[i].controller.unfinished()} <= speculative
                for i in range(start, start + m))
            if not ready:
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
            self.mode_changes["bind"] += 1

    def _units(self) -> list[_Unit]:
        active = [self.groups[k] for k, b in self.bindings.items() if b.active]
        return [u for i, u in enumerate(self.replicas) if not self._active_over(i)] + active

    def _active_over(self, i: int) -> bool:
        return any(b.active and b.key[0] <= i < b.key[0] + b.key[1]
                   for b in self.bindings.values())

    def _execute(self) -> list[Request]:
        started = self.clock.now()
        pending = []
        for unit in self._units():
            if not unit.controller.has_unfinished():
                continue
            batch = unit.controller.schedule()
            if not batch:
                continue
            pending.append((unit, batch, unit.engine.dispatch(batch)))
            if isinstance(unit.engine, TPGroupEngine):
                for binding in self.bindings.values():
                    if self.groups[binding.key] is unit and binding.decided_at is not None:
                        self.switch_latencies_s.append(time.perf_counter() - binding.decided_at)
                        binding.decided_at = None
        done = []
        for unit, batch, step in pending:
            unit.controller.update(batch, unit.engine.collect(step))
        for unit in self.replicas + list(self.groups.values()):
            for request in unit.controller.pop_finished():
                if request.request_id in self._moved and \
                        request.finish_reason is FinishReason.CANCELLED:
                    self._moved.discard(request.request_id)
                    continue
                self.finished[request.request_id] = request
                done.append(request)
        self._release()
        # A virtual clock no executor moved (real engines) still ticks; simulated engines
        # (medha_jax.cluster.switching_sim) have moved it by the iteration's time.
        if isinstance(self.clock, VirtualClock) and self.clock.now() == started:
            self.clock.advance(1e-3)
        return done

    def metrics(self) -> dict[str, float]:
        """Counters for /metrics: mode changes and requests per mode."""
        out = {f"medha_switching_mode_changes_total{{kind=\"{k}\"}}": v
               for k, v in self.mode_changes.items()}
        out.update({f"medha_switching_requests_total{{mode=\"{k}\"}}": v
                    for k, v in self.requests_per_mode.items()})
        return out
