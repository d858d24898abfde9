"""Discrete-event simulation of serving: the real controllers and policies on a virtual clock.

Each replica is a `ReplicaController` (made by the scheduler factory, exactly as the
server makes it) driven by the server loop's `InFlightRunner` on a `SimulatedExecutor`:
it prices each batch with the runtime predictor (by default the analytical roofline for
the model, parallel layout and hardware) as the time of one pipeline stage, runs it
through the spp stages in order (a stage takes the next batch as soon as it is free, so
up to spp batches are in flight) and moves that replica's virtual clock to when the
batch leaves the last stage. Requests enter at their arrival times; an idle replica's
clock jumps to its next arrival. The server's router (`medha_jax.cluster.router`, any
policy; by default predicted-time) places each request, reading each replica's queued
predicted work and its PrefillTimeCache.

KV capacity per replica: device memory x utilisation minus the weights (replicated over
kvp and cp), divided by the KV bytes of one token (KV heads replicated when tp exceeds
them). Sampled tokens are dummies and end-of-sequence is off, so every request emits
exactly max_new_tokens tokens. With `prefix_caching=True` (requests carrying prompt token
ids, e.g. `workloads.to_requests(..., vocab_size=...)`), each replica runs the real
`BlockAllocator`, whose cache events feed the router's exact prefix index, so routing
policies are compared on the cache hits they earn; otherwise pages are only counted.

    result = simulate(requests, scheduler="lars-mp", model=model_preset("llama3-8b"),
                      parallel=ParallelConfig(tp=8, spp=2), hardware="a100")
    result.requests   # copies of the inputs with their timestamps, in input order

A disaggregated prefill pool under chunkwise dynamic sequence parallelism (seed 001, Tetris:
one SP ring over the pool, each chunk of a prompt on its own nested group) is simulated by
`simulate_prefill_pool` (medha_jax/cluster/prefill_pool_sim.py), re-exported here.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math
import time
from collections.abc import Sequence

from medha_jax.cluster.prefill_pool_sim import PoolResult, simulate_prefill_pool  # noqa: F401
from medha_jax.cluster.router import Decision, ReplicaStatus, RouteRequest, Router, RoutingConfig
from medha_jax.config import ModelConfig, ParallelConfig
from medha_jax.kv_cache.allocator import BlockAllocator, prefix_page_hashes
from medha_jax.request import (Batch, FinishReason, Request, RequestState, StepResult,
                               VirtualClock)
from medha_jax.scheduler.config import SchedulerConfig
from medha_jax.scheduler.controller import ReplicaController
from medha_jax.scheduler.factory import make_controller
from medha_jax.scheduler.in_flight import InFlightRunner
from medha_jax.scheduler.prefill_time_cache import PrefillTimeCache
from medha_jax.scheduler.hardware import HardwareSpec, hardware_preset
from medha_jax.scheduler.predictor import (AnalyticalPredictor, RuntimePredictor,
                                           decode_step_seconds, decode_token_seconds)

DUMMY_TOKEN_ID = 0


class CountingAllocator:
    """The BlockAllocator interface with page counts only (no page ids, no prefix cache).

    The simulator needs capacity, not addresses; counting keeps a million-token request
    O(1) per reservation instead of a page-id list of 60,000 entries.
    """

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"{num_pages=} and {page_size=} must be >= 1")
        self.num_pages, self.page_size = num_pages, page_size
        self._pages: dict[str, int] = {}
        self._used = 0

    @property
    def num_free_pages(self) -> int:
        return self.num_pages - self._used

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.pages_needed(num_tokens) <= self.num_pages

    def allocate(self, request_id: str, token_ids: Sequence[int] | None = None) -> int:
        if request_id in self._pages:
            raise ValueError(f"request {request_id!r} is already allocated; free it first")
        self._pages[request_id] = 0
        return 0

    def reserve(self, request_id: str, num_tokens: int) -> bool:
        extra = -(-num_tokens // self.page_size) - self._pages[request_id]   # pages_needed
        if extra <= 0:
            return True
        if extra > self.num_pages - self._used:
            return False
        self._pages[request_id] += extra
        self._used += extra
        return True

    def shards_short(self, request_id: str, num_tokens: int) -> frozenset[int]:
        """One pool, shard 0: short when the reservation would fail."""
        extra = self.pages_needed(num_tokens) - self._pages[request_id]
        return frozenset((0,)) if extra > self.num_pages - self._used else frozenset()

    def shards_of(self, request_id: str) -> tuple[int, ...]:
        return (0,) if self._pages[request_id] else ()

    def commit(self, request_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        pass   # no prefix cache to register pages in

    def rename(self, request_id: str, new_id: str) -> int:
        if new_id in self._pages:
            raise ValueError(f"request {new_id!r} is already allocated; free it first")
        self._pages[new_id] = self._pages.pop(request_id)
        return self._pages[new_id]

    def free(self, request_id: str) -> None:
        self._used -= self._pages.pop(request_id)

    def has(self, request_id: str) -> bool:
        return request_id in self._pages


@dataclasses.dataclass(frozen=True)
class SimulatedStep:
    """A batch in the simulated pipeline: it leaves the last stage at `done_time`."""

    batch: Batch
    stage_s: float
    done_time: float


class SimulatedExecutor:
    """Runs batches through `num_stages` pipeline stages in zero host time.

    A batch takes the predicted time in every stage (the predictor prices one stage: the
    layers / spp of the slowest stage plus the hand-off) and enters a stage when it has
    left the stage before and that stage is free. `dispatch` books the stages; `collect`
    moves the clock to when the batch leaves the last one.
    """

    def __init__(self, predictor: RuntimePredictor, clock: VirtualClock, num_stages: int = 1):
        if num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {num_stages}")
        self.predictor, self.clock = predictor, clock
        self.max_in_flight = num_stages
        self._stage_free = [clock.now()] * num_stages
        self.busy_s = 0.0                 # stage seconds of every batch dispatched


    @property
    def next_dispatch_time(self) -> float:
        """When the first stage can take another batch."""
        return self._stage_free[0]

    def dispatch(self, batch: Batch) -> SimulatedStep:
        stage_s = self.predictor.predict(batch)
        self.busy_s += stage_s
        t = self.clock.now()
        for s, free in enumerate(self._stage_free):
            t = (t if t > free else free) + stage_s
            self._stage_free[s] = t
        return SimulatedStep(batch, stage_s, t)

    def collect(self, pending: SimulatedStep) -> StepResult:
        self.clock.advance_to(pending.done_time)
        sampled = {c.request.request_id: DUMMY_TOKEN_ID for c in pending.batch.chunks
                   if c.samples}
        return StepResult(sampled, pending.stage_s)

    def execute(self, batch: Batch) -> StepResult:
        return self.collect(self.dispatch(batch))


def kv_capacity_tokens(model: ModelConfig, parallel: ParallelConfig, hardware: HardwareSpec,
                       memory_utilization: float = 0.9) -> int:
    """Tokens of KV cache one replica (spp x kvp x cp x tp devices) holds."""
    devices = parallel.spp * parallel.kvp * parallel.cp * parallel.tp
    bytes_per_value = 4 if model.dtype == "float32" else 2
    weights = model.num_params() * bytes_per_value * parallel.kvp * parallel.cp
    free = devices * hardware.memory_bytes * memory_utilization - weights
    kv_replication = max(1, parallel.tp // model.num_kv_heads)
    per_token = model.kv_bytes_per_token(bytes_per_value) * kv_replication
    if free < per_token:
        raise ValueError(
            f"{model.name} weights ({weights / 2**30:.1f} GiB over kvp x cp) leave no KV memory on "
            f"{devices} x {hardware.name} ({hardware.memory_bytes / 2**30:.0f} GiB each) at "
            f"{memory_utilization=}; use more devices (tp or spp)")
    return int(free // per_token)


@dataclasses.dataclass
class SimulationResult:
    """A finished simulation. Times are on the virtual clock, in seconds."""

    requests: list[Request]         # copies of the inputs, in input order, with timestamps
    makespan_s: float               # first arrival to last finish
    num_iterations: int             # steps over all replicas
    num_preemptions: int
    num_rejected: int               # could never fit (FinishReason.ERROR, .error says why)
    policy: str
    hardware: str
    predictor: str
    num_replicas: int
    kv_capacity_tokens: int         # per replica
    wall_s: float                   # host seconds the simulation took
    replica_of: dict[str, int]      # request_id -> the replica the router chose
    busy_s: list[float] = dataclasses.field(default_factory=list)  # per replica: stage seconds
    routing: str = ""               # the router's policy
    decision_s: list[float] = dataclasses.field(default_factory=list)  # router wall seconds
    # request_id -> the TTFT the router predicted for it where it sent it (Decision)
    predicted_ttft_s: dict[str, float] = dataclasses.field(default_factory=dict)
    # With offload: request_id -> the replica that decoded it (prefilled at replica_of),
    # and the prompt tokens its prefill found cached there (the request's own
    # num_cached_tokens counts the moved pages the decode side reused).
    decoded_on: dict[str, int] = dataclasses.field(default_factory=dict)
    prefill_cached_tokens: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def finished(self) -> list[Request]:
        return [r for r in self.requests if r.state is RequestState.FINISHED]


def _fresh_copy(r: Request, keep_token_ids: bool) -> Request:
    """The request as it arrives: no progress, eos off; lengths only unless the prompt's
    token ids are kept (prefix caching)."""
    if keep_token_ids and r.prompt_token_ids is None:
        raise ValueError(f"prefix_caching needs prompt token ids; request {r.request_id!r} "
                         "has lengths only (workloads.to_requests(..., vocab_size=...))")
    return Request(
        request_id=r.request_id, prompt_len=r.prompt_len, max_new_tokens=r.max_new_tokens,
        arrival_time=r.arrival_time, slo=r.slo, priority=r.priority, session_id=r.session_id,
        prompt_token_ids=list(r.prompt_token_ids) if keep_token_ids else None,
        sampling=dataclasses.replace(r.sampling, stop_token_ids=(), ignore_eos=True))


def _replica_status(controller: ReplicaController, config: SchedulerConfig, page_size: int,
                    decode_token_s: float, inbound_decodes: int = 0) -> ReplicaStatus:
    """What the router reads of a simulated replica: its queue, its queued prefills as
    LARS sees them, its Algorithm-3 prefill times, its prefill steps' seconds and the
    sequences it decodes (with inbound_decodes, those handed to it and not yet landed)."""
    prefill_time = controller.prefill_time_cache.prefill_time
    waiting, running = controller.num_waiting, controller.num_running
    queued = controller.queued_prefills()
    return ReplicaStatus(
        prefill_s=lambda n, cached: prefill_time(n) - prefill_time(cached), page_size=page_size,
        num_waiting=waiting, num_running=running, queued_prefills=queued,
        decode_token_s=decode_token_s,
        decodes=waiting + running - len(queued) + inbound_decodes,
        chunk_step_s=_chunk_step_s(controller), **ReplicaStatus.scheduler_fields(config))


def _chunk_step_s(controller: ReplicaController) -> float:
    """Seconds of a simulated step that carries prefill chunks: the packer's budget, or a
    512-token chunk's where it has none."""
    target = getattr(controller.packer, "target_batch_time_s", None)
    return target if target is not None else controller.prefill_time_cache.prefill_time(512)


def _advance_replica(runner: InFlightRunner, policy: str, index: int) -> float | None:
    """One event of a replica at its clock's now: applies the batches that left the pipe
    by now, then, if the first stage is free and the pipe has room, dispatches a batch.
    Returns the time of its next event (None when it has nothing left to do). Like the
    server loop, a replica that can form no batch waits for its oldest batch in flight."""
    controller, executor = runner.controller, runner.executor
    now = controller.clock.now()
    while runner.num_in_flight and runner.oldest.done_time <= now:
        runner.collect_next()
    can_dispatch = runner.num_in_flight < executor.max_in_flight
    if can_dispatch and executor.next_dispatch_time <= now:
        can_dispatch = runner.dispatch_next() is not None
        if not runner.num_in_flight:
            if controller.has_unfinished():
                raise RuntimeError(
                    f"replica {index} ({policy}) formed an empty batch with "
                    f"{controller.num_waiting} waiting and {controller.num_running} running "
                    f"requests at t={now:.3f}")
            return None
    next_event = runner.oldest.done_time
    if can_dispatch and runner.num_in_flight < executor.max_in_flight:
        next_event = min(next_event, max(executor.next_dispatch_time, now))
    return next_event


def simulate(requests: list[Request], *, scheduler: str | SchedulerConfig, model: ModelConfig,
             parallel: ParallelConfig, hardware: HardwareSpec | str, num_replicas: int = 1,
             predictor: RuntimePredictor | None = None,
             device_predictor: RuntimePredictor | None = None, progress: bool = False,
             time_limit_s: float | None = None, page_size: int = 16,
             memory_utilization: float = 0.9, max_model_len: int | None = None,
             prefill_time_cache: PrefillTimeCache | None = None,
             routing: RoutingConfig | str = RoutingConfig(),
             prefix_caching: bool = False, offload=None,
             stream_chunks: bool = True) -> SimulationResult:
    """Serves `requests` (lengths, arrivals, SLOs) on simulated hardware.

    scheduler: a policy name or a SchedulerConfig (token buckets, batch limits, t_target,
      ...), as a Server takes it.

    num_replicas x parallel.dp replicas, each of spp x kvp x cp x tp devices.
    predictor: what the scheduler plans with: it prices candidate batches for the packer
      (default: the analytical roofline of model x parallel x hardware).
    device_predictor: what a step takes on the simulated device, i.e. how far the clock
      moves (default: `predictor`). A different one models a scheduler whose predictor
      is off, as a live server's is when its calibration drifts from the steps it runs.
    time_limit_s: stop once the virtual clock passes this many seconds; requests not
      finished by then keep their partial timestamps (finish_time None).
    max_model_len: longest prompt + output admitted (default: the longest request).
    prefill_time_cache: Algorithm 3's table to reuse (same predictor and limits); by
      default built once and shared by the replicas.
    routing: the router's policy name or RoutingConfig (medha_jax.cluster.router).
    prefix_caching: each replica caches prefixes in a real BlockAllocator (requests must
      carry prompt token ids); the router reads them through its prefix index.
    offload: an OffloadConfig (medha_jax.cluster.offload; needs prefix_caching): a request
      may prefill on the routed replica and decode on another (`SimulatedHandoffs`: the
      handshake reserves the decode side's pages at arrival; the pages arrive
      handshake_s + the transfer at link_bytes_per_s not hidden behind the prefill after
      its first token, all at the end with stream_chunks=False; the full ones are
      registered in the decode side's prefix cache, and the request takes them all there
      and decodes from its first token).
    """
    config = SchedulerConfig.of(scheduler)
    if isinstance(hardware, str):
        hardware = hardware_preset(hardware)
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if not requests:
        raise ValueError("simulate needs at least one request")
    wall_start = time.perf_counter()
    replica_parallel = dataclasses.replace(parallel, dp=1)
    predictor = predictor or AnalyticalPredictor(
        model, replica_parallel, hardware, token_buckets=config.token_buckets)
    routing = RoutingConfig(routing) if isinstance(routing, str) else routing
    copies = [_fresh_copy(r, prefix_caching) for r in requests]
    arrivals = sorted(copies, key=lambda r: r.arrival_time)
    max_model_len = max_model_len or max(r.prompt_len + r.max_new_tokens for r in copies)

    capacity = kv_capacity_tokens(model, replica_parallel, hardware, memory_utilization)
    controllers: list[ReplicaController] = []
    runners: list[InFlightRunner] = []
    total_replicas = num_replicas * parallel.dp
    # The router is made before the replicas (their allocators feed its prefix index) and
    # reads their statuses (defined below, once the decode price is known) when it routes.
    router_clock = VirtualClock(arrivals[0].arrival_time)
    router = Router(total_replicas, lambda: statuses(), routing, clock=router_clock.now)
    for i in range(total_replicas):
        clock = VirtualClock(arrivals[0].arrival_time)
        allocator = (BlockAllocator(capacity // page_size, page_size,
                                    on_cache_change=router.index.listener(i))
                     if prefix_caching else CountingAllocator(capacity // page_size, page_size))
        controllers.append(make_controller(
            config, allocator=allocator, clock=clock,
            predictor=predictor, model_config=model, max_model_len=max_model_len,
            prefill_time_cache=prefill_time_cache, pipeline_stages=parallel.spp))
        executor = SimulatedExecutor(device_predictor or predictor, clock, parallel.spp)
        runners.append(InFlightRunner(controllers[-1], executor))
        # Algorithm 3's table depends only on the predictor and the config: share it.
        prefill_time_cache = controllers[0].prefill_time_cache
    # The router prices a decode token as a full decode batch's step time per sequence.
    seats = controllers[0].packer.limits.max_seqs_per_batch
    decode_token_s = decode_token_seconds(predictor, seats)

    def statuses() -> list[ReplicaStatus]:
        inbound = handoffs is not None and routing.decode_delay_weight > 0   # priced only then
        return [_replica_status(c, config, page_size, decode_token_s,
                                len(handoffs.inbound_contexts(j)) if inbound else 0)
                for j, c in enumerate(controllers)]

    handoffs = None
    if offload is not None:
        if not prefix_caching:
            raise ValueError("offload needs prefix_caching=True: the decode side takes the "
                             "moved pages from its prefix cache")
        bytes_per_value = 4 if model.dtype == "float32" else 2
        page_bytes = (model.kv_bytes_per_token(bytes_per_value)
                      * max(1, replica_parallel.tp // model.num_kv_heads) * page_size)
        handoffs = SimulatedHandoffs(controllers, router, offload, page_bytes, decode_token_s,
                                     stream_chunks, [runner.executor for runner in runners],
                                     predictor)

    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(copies), desc=f"simulating {config.policy}", unit="req")
    horizon = math.inf if time_limit_s is None else arrivals[0].arrival_time + time_limit_s
    num_rejected = 0
    replica_of: dict[str, int] = {}
    predicted_ttft: dict[str, float] = {}
    next_arrival = 0
    # Busy replicas by the time of their next event: a stage free to take a batch, or the
    # oldest batch in flight leaving the pipe.
    busy: list[tuple[float, int]] = []
    while next_arrival < len(arrivals) or busy or (handoffs and handoffs.pending):
        t_arrival = (arrivals[next_arrival].arrival_time if next_arrival < len(arrivals)
                     else math.inf)
        t_step = busy[0][0] if busy else math.inf
        t_handoff = handoffs.next_time if handoffs is not None else math.inf
        if min(t_arrival, t_step, t_handoff) > horizon:
            break
        if t_handoff <= min(t_arrival, t_step):
            d = handoffs.arrive()
            if d is not None and d not in {j for _, j in busy}:
                heapq.heappush(busy, (controllers[d].clock.now(), d))
            continue
        if t_arrival <= t_step:
            request = arrivals[next_arrival]
            next_arrival += 1
            router_clock.advance_to(request.arrival_time)
            route_request = _route_request(request, page_size)
            decision = (None if total_replicas == 1 else router.route(route_request))
            i = replica_of[request.request_id] = 0 if decision is None else decision.replica
            if decision is not None:
                predicted_ttft[request.request_id] = decision.predicted_ttft_s
            if handoffs is not None and decision is not None:
                request = handoffs.on_route(request, decision, route_request.page_hashes)
            controller = controllers[i]
            was_idle = not controller.has_unfinished()
            controller.clock.advance_to(request.arrival_time)
            try:
                controller.add_request(request)
            except ValueError as e:   # CapacityError included: it can never run here
                request.state, request.finish_reason = RequestState.FINISHED, FinishReason.ERROR
                request.error = str(e)
                num_rejected += 1
                if bar is not None:
                    bar.update(1)
                continue
            if was_idle:
                heapq.heappush(busy, (controller.clock.now(), i))
            continue
        t_event, i = heapq.heappop(busy)
        controller, runner = controllers[i], runners[i]
        controller.clock.advance_to(t_event)
        before = len(controller.finished)
        next_event = _advance_replica(runner, config.policy, i)
        if handoffs is not None:
            handoffs.after_event(i)
        if bar is not None and len(controller.finished) != before:
            bar.update(len(controller.finished) - before)
        if next_event is not None:
            heapq.heappush(busy, (next_event, i))
    if bar is not None:
        bar.close()

    finished = [r for r in copies if r.finish_time is not None]
    makespan = (max(r.finish_time for r in finished) - arrivals[0].arrival_time
                if finished else 0.0)
    return SimulationResult(
        requests=copies, makespan_s=makespan,
        num_iterations=sum(c.num_steps for c in controllers),
        num_preemptions=sum(c.num_preemptions for c in controllers), num_rejected=num_rejected,
        policy=config.policy, hardware=hardware.name, predictor=type(predictor).__name__,
        num_replicas=len(controllers), kv_capacity_tokens=capacity,
        wall_s=time.perf_counter() - wall_start, replica_of=replica_of,
        busy_s=[runner.executor.busy_s for runner in runners], routing=routing.policy,
        decision_s=router.decision_seconds, predicted_ttft_s=predicted_ttft,
        decoded_on=handoffs.decoded_on if handoffs is not None else {},
        prefill_cached_tokens=handoffs.prefill_cached if handoffs is not None else {})


class SimulatedHandoffs:
    """Prefill here, decode there, on simulated replicas (see simulate's `offload`)."""

    # How far back a replica's share of time on prefill steps looks (as the server's).
    PREFILL_SHARE_WINDOW_S = 10.0

    def __init__(self, controllers, router, config, page_bytes: int, decode_token_s: float,
                 stream_chunks: bool, executors, predictor):
        self.controllers, self.router, self.config = controllers, router, config
        self.predictor = predictor
        # Per replica, (leaves the pipe at, stage seconds) of its steps with prefill chunks.
        self._prefill_steps = [collections.deque() for _ in controllers]
        for executor, steps in zip(executors, self._prefill_steps):
            executor.dispatch = self._recording(executor.dispatch, steps)
        self.page_bytes, self.decode_token_s = page_bytes, decode_token_s
        self.stream_chunks = stream_chunks
        self._waiting: dict[str, tuple] = {}      # prefill copy id -> (request, p, d, res)
        self._heap: list[tuple[float, str]] = []
        self._ready: dict[str, tuple] = {}
        self.decoded_on: dict[str, int] = {}
        self.prefill_cached: dict[str, int] = {}

    @staticmethod
    def _recording(dispatch, steps):
        def recorded(batch):
            step = dispatch(batch)
            if any(not c.is_decode for c in batch.chunks):
                steps.append((step.done_time, step.stage_s))
            return step
        return recorded

    def _prefill_share(self, i: int, now: float) -> float:
        steps = self._prefill_steps[i]
        while steps and steps[0][0] < now - self.PREFILL_SHARE_WINDOW_S:
            steps.popleft()
        return min(1.0, sum(s for t, s in steps if t <= now) / self.PREFILL_SHARE_WINDOW_S)

    @property
    def pending(self) -> bool:
        return bool(self._heap)

    @property
    def next_time(self) -> float:
        return self._heap[0][0] if self._heap else math.inf

    def _decode_steps(self, j: int, prompt_len: int) -> dict:
        """OffloadReplica's decode fields for replica j: its decode step with the decodes
        it runs and those handed to it and not yet landed, with one more at prompt_len
        (what each of the new request's tokens costs) and without it, and how many."""
        contexts = [r.prompt_len + len(r.output_token_ids)
                    for r in self.controllers[j].unfinished() if r.max_new_tokens > 1]
        contexts += self.inbound_contexts(j)
        return dict(decode_step_s=decode_step_seconds(self.predictor, contexts + [prompt_len]),
                    decode_base_step_s=decode_step_seconds(self.predictor, contexts),
                    decodes=len(contexts))

    def inbound_contexts(self, j: int) -> list[int]:
        """The prompt lengths of the decodes handed to replica j and not yet landed."""
        return ([entry[0].prompt_len for entry in self._waiting.values() if entry[3] == j]
                + [entry[0].prompt_len for entry in self._ready.values() if entry[2] == j])


    def on_route(self, request: Request, routed: Decision, hashes) -> Request:
        """At arrival, once routed: decides; on offload reserves the decode side's pages
        (the handshake) and returns the prefill-only copy to add where it was routed."""
        from medha_jax.cluster.offload import OffloadReplica, OffloadRequest, choose_decode

        p, cached_tokens = routed.replica, routed.cached_tokens
        page_size = self.controllers[p].allocator.page_size
        full = request.prompt_len // page_size
        pages = -(-request.prompt_len // page_size)       # the partial last one moves too
        cached_pages = self.router.index.cached_pages(tuple(hashes))
        pt = self.controllers[p].prefill_time_cache.prefill_time
        views = [OffloadReplica(True,
                                queued_prefill_s=c.queued_prefills().work_s,
                                chunk_step_s=_chunk_step_s(c),
                                decode_token_s=self.decode_token_s, cached_pages=cached_pages[j],
                                prefill_share=self._prefill_share(j, request.arrival_time),
                                max_seqs=c.packer.limits.max_seqs_per_batch,
                                **self._decode_steps(j, request.prompt_len))
                 for j, c in enumerate(self.controllers)]
        decision = choose_decode(OffloadRequest(
            request.prompt_len, cached_tokens, request.max_new_tokens,
            pt(request.prompt_len) - pt(cached_tokens), routed.predicted_ttft_s, pages,
            self.page_bytes), p, views, self.config)
        d = decision.decode
        if d is None:
            return request
        allocator = self.controllers[d].allocator
        res = f"kv-in:{request.request_id}"
        reused = allocator.allocate(res, request.prompt_token_ids[:full * page_size + 1])
        if not allocator.reserve(res, request.prompt_len):      # the partial page too
            allocator.free(res)                   # no room there now: stays co-located
            return request
        copy = dataclasses.replace(request, max_new_tokens=1, prompt_token_ids=list(
            request.prompt_token_ids), output_token_ids=[])
        self._waiting[request.request_id] = (request, copy, p, d, res,
                                             pages - reused // page_size)
        self.decoded_on[request.request_id] = d
        return copy

    def after_event(self, i: int) -> None:
        controller = self.controllers[i]
        for rid, (request, copy, p, d, res, pages) in list(self._waiting.items()):
            if p != i or copy.finish_time is None:
                continue
            del self._waiting[rid]
            controller.finished.pop(rid, None)
            self.prefill_cached[rid] = copy.num_cached_tokens
            transfer = pages * self.page_bytes / self.config.link_bytes_per_s
            prefill_s = copy.first_token_time - (copy.first_scheduled_time or copy.arrival_time)
            hidden = (max(0.0, prefill_s - _chunk_step_s(controller))
                      if self.stream_chunks else 0.0)
            ready = copy.first_token_time + self.config.handshake_s + max(0.0, transfer - hidden)
            self._ready[rid] = (request, copy, d, res)
            heapq.heappush(self._heap, (ready, rid))

    def arrive(self) -> int | None:
        """The next hand-off lands: its full pages enter the decode side's prefix cache and
        the request takes every prompt page there (the partial one too) and continues from
        its first token, as in the server. Returns the decode replica."""
        ready, rid = heapq.heappop(self._heap)
        request, copy, d, res = self._ready.pop(rid)
        controller = self.controllers[d]
        page_size = controller.allocator.page_size
        controller.clock.advance_to(ready)
        full = request.prompt_len // page_size
        controller.allocator.commit(res, request.prompt_token_ids, full * page_size)
        request.output_token_ids = [DUMMY_TOKEN_ID]
        request.first_scheduled_time = copy.first_scheduled_time
        request.first_token_time = request.last_token_time = copy.first_token_time
        was_idle = not controller.has_unfinished()
        controller.add_request(request, resume=True, kv_from=(res, request.prompt_len))
        return d if was_idle else None


def _route_request(request: Request, page_size: int) -> RouteRequest:
    hashes = (tuple(prefix_page_hashes(request.prompt_token_ids, page_size))
              if request.prompt_token_ids is not None else ())
    return RouteRequest(request.prompt_len, hashes, request.session_id, request.max_new_tokens,
                        request.slo.ttft_s)
