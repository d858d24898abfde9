"""Replicas across hosts on Ray: one Ray actor per replica, the router in the front process.

    server = Server("smollm2-135m", replicas=2, cluster="ray")   # or "ray://head:10001"
    medha-jax serve --replicas 2 --ray [ADDRESS]                  # prints "ray address: ..."

Placement: one actor per replica, not per host. An actor (`ReplicaActor`, named
`medha-replica-{i}` in the namespace `medha`) runs a one-replica `Server` in its own
process: it loads the model by name or path, builds its engine (ParallelConfig,
EngineConfig, scheduler config), controller, predictor and loop there, and streams each
request's token deltas back as a Ray streaming generator. Per replica because a replica is
the unit Ray restarts: killing one replica's process must not take down its neighbours,
and on a CPU or GPU host a replica's devices can be given to its own process (Ray sets
CUDA_VISIBLE_DEVICES for `num_gpus`). A TPU host is different: its chips belong to one
process, so there the unit is the host. vLLM's tpu-inference places one actor per TPU host
with `resources={"TPU": chips_per_host}` in a PACK placement group of one bundle per host
(ray.util.tpu's slice placement groups reserve the same); to do that here give
`actor_options={"resources": {"TPU": 4}, "num_cpus": 0}` with a `parallel` that spans the
host's chips (one replica per host; several replicas inside one host stay in one process:
`Server(replicas=N)` without Ray).

The front process (this module's `RayServer`, what `Server(cluster=...)` returns) keeps the
router and the exact prefix index. Every actor publishes, polled every `POLL_S`, its load
(waiting, running, queued predicted seconds), its predictor's prefill-time table, and its
allocator's cache events (`CacheEvent`, numbered per actor incarnation): the front applies
them to the router's `PrefixIndex`, where a gap in the numbers (a restarted actor starts
again at 0) drops the replica's entries until its events rebuild them. Text is decoded in
the front, so that a request re-run elsewhere reads as one stream (stop strings included).

Faults: Ray restarts a killed actor (`max_restarts`); its constructor loads and warms up
again, and the replica rejoins the router once it answers a poll. The front sees a death
at once on the requests streaming from it (the generator raises) and within `POLL_S` on
its poll: the replica leaves the router (its cache and sessions forgotten), and its
in-flight requests re-run on another healthy replica from prompt + the tokens already
streamed, so the caller sees one uninterrupted stream. Not possible, so they fail with an
error starting "UNAVAILABLE:" (gRPC UNAVAILABLE, HTTP 503): a seeded sampled request (its
random stream would restart), or no healthy replica left.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import inspect
import itertools
import logging
import os
import secrets
import threading
import time
from collections.abc import Sequence

from medha_jax.cluster.prefix_index import CacheEvent
from medha_jax.cluster.router import (PREDICTED_TIME, NoHealthyReplica, ReplicaStatus,
                                      RouteRequest, Router, RoutingConfig)
from medha_jax.request import SLO
from medha_jax.scheduler.policies import QueuedPrefill, QueuedPrefills
from medha_jax.scheduler.predictor import decode_step_seconds
from medha_jax.sampling_params import SamplingParams
from serving import validation
from serving.kv_transfer import DisaggConfig, page_bytes, parse_roles, reservation_id
from serving.kv_wire import WireChunk
from serving.metrics import ServerMetrics
from serving.outputs import (IncrementalDetokenizer, RequestHandle, RequestMetrics,
                             StreamDelta)
from serving.ray_handoff import HandedOff, Moved, PagesOffered, ReplicaHandoffs
from serving.server import Server

NAMESPACE = "medha"
ACTOR_NAME = "medha-replica-{}"
logger = logging.getLogger(__name__)
POLL_S = 0.05                 # how often the front reads each replica's load and events
MAX_BUFFERED_EVENTS = 10_000  # past this an actor folds its events into one resync event
UNAVAILABLE = "UNAVAILABLE"
LANDS_AFTER_DEATH_S = 5.0     # how long pulls started before a prefill actor died may end


def connect(cluster: str) -> str:
    """Joins (or starts) the Ray cluster `cluster` names and returns its address HOST:PORT.

    "ray": the cluster RAY_ADDRESS names, else a new local one (Ray's own rule); any other
    string is an address ("ray://head:10001" or "head:6379"). A Ray already initialised in
    this process (a test's fixture, the caller's own ray.init) is used as it is."""
    ray = _import_ray()
    if not isinstance(cluster, str) or not cluster:
        raise ValueError(f"cluster must be 'ray' or a Ray address, got {cluster!r}")
    if not ray.is_initialized():
        ray.init(address=None if cluster == "ray" else cluster, namespace=NAMESPACE,
                 include_dashboard=False, log_to_driver=False)
    return ray.get_runtime_context().gcs_address


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ImportError("cluster= needs Ray: pip install 'medha-jax[cluster]'") from None
    return ray


@dataclasses.dataclass(frozen=True)
class ReplicaSpec:
    """What an actor needs to build its replica (pickled to it): Server's own arguments."""

    model: str
    parallel: object = None
    scheduler: object = "lars-mp"
    engine_config: object = None
    default_slo: SLO | None = None
    dtype: str | None = None
    warmup: bool | str = "background"
    predictor: object = None
    cache_dir: object = None
    limits: validation.RequestLimits | None = None
    disagg: DisaggConfig | None = None        # set: the replica takes part in KV hand-offs
    # Actor i runs on the CPUs cpu_binding[i] only (`bind_cpus`); None: wherever the OS puts it.
    cpu_binding: tuple[tuple[int, ...], ...] | None = None


@dataclasses.dataclass(frozen=True)
class ReplicaState:
    """One poll's answer: the actor's incarnation (new after each restart), its load, its
    prefill-time table ([(tokens, seconds)], for the router's prefill_s) and the cache
    events from the sequence number the front asked for."""

    incarnation: str
    num_waiting: int
    num_running: int
    queued_prefills: QueuedPrefills
    decode_token_s: float
    prefill_table: tuple[tuple[int, float], ...]
    events: tuple[CacheEvent, ...]
    pages_in_use: int = 0
    pages_total: int = 0
    num_preemptions: int = 0
    num_decoding: int = 0          # requests whose prefill is done (ServingLoop.num_decoding)
    chunk_step_s: float = 0.0      # seconds of a step that carries prefill chunks
    # With hand-offs, what the front's offload decision reads (serving.replicas'
    # offload_decision reads the same of its replicas): the share of recent time spent on
    # prefill steps, [(context, seconds)] of a decode step of its decodes plus one request
    # of that context and the seconds of a step of its decodes alone (what one more adds:
    # the table's less this), how many decodes it runs; hand-offs still kept here.
    prefill_share: float = 0.0
    decode_step_table: tuple[tuple[int, float], ...] = ()
    decode_base_s: float = 0.0
    decodes: int = 0
    handoffs_in_flight: int = 0


class ReplicaActor:
    """One replica in its own process (a Ray actor; asyncio, so one event loop streams
    every request while the replica's own loop thread runs the engine)."""

    def __init__(self, index: int, spec: ReplicaSpec):
        self.index = index
        self.incarnation = secrets.token_hex(8)
        if spec.cpu_binding is not None:
            bind_cpus(spec.cpu_binding[index])
        self.server = Server(spec.model, parallel=spec.parallel, scheduler=spec.scheduler,
                             engine_config=spec.engine_config, default_slo=spec.default_slo,
                             dtype=spec.dtype, warmup=spec.warmup, predictor=spec.predictor,
                             cache_dir=spec.cache_dir, limits=spec.limits)
        replica = self.server.replicas[0]
        self.replica = replica
        # A one-replica Server does not publish its queued predicted work (no router reads
        # it); here the front's router does, so the loop computes it.
        replica.loop._decode_token_s = replica.decode_token_s
        self._handles: dict[str, RequestHandle] = {}
        self._events_lock = threading.Lock()
        self._events: list[CacheEvent] = []
        self._next_seq = 0
        self._table: tuple[tuple[int, float], ...] = ()
        self._table_at = 0.0
        replica.engine.allocator.on_cache_change = self._on_cache_change
        # Event 0, before any request reaches the loop: the cache restated with its orphans
        # (followed from here on), so the front's index bisects this replica's pages.
        replica.engine.allocator.restate_cache()
        self.handoffs = None
        if spec.disagg is not None:
            self.handoffs = ReplicaHandoffs(replica, spec.disagg)
            if spec.warmup:           # the page copies' shapes, before any request
                done = threading.Event()

                def warm_up():
                    try:
                        self.handoffs.warm_up()
                    finally:
                        done.set()
                replica.loop.call(warm_up)
                done.wait()

    def describe(self) -> dict:
        server = self.server
        return {"config": server.config, "tokenizer": server.tokenizer,
                "max_model_len": server.max_model_len, "page_size":
                    self.replica.engine.allocator.page_size,
                "num_pages": server.num_total_pages, "default_slo": server.default_slo,
                "max_seqs": self.replica.max_seqs,
                "policy": server.policy, "startup": server.startup,
                "scheduler_fields": ReplicaStatus.scheduler_fields(server.scheduler_config),
                "incarnation": self.incarnation, "pid": os.getpid(),
                "cpus": tuple(sorted(os.sched_getaffinity(0))),
                "page_bytes": page_bytes(self.replica.engine)}

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       slo: SLO | None, priority: int, paced: bool = True,
                       reservation: str | None = None, prefill_s: float | None = None,
                       moved: tuple[int, int, WireChunk] | None = None):
        """Streams the request's StreamDeltas (the last one finished). paced: as
        Server.submit's _paced (False: the front's generate(), no TPOT). reservation: a
        hand-off's, registered here: the request takes its pages when every prompt page
        landed (serving.ray_handoff). prefill_s: the front's predicted prefill seconds
        (counted in the queued prefills until the loop takes the request in). moved:
        (tid, computed, wire) of a running decode that moved here: the pages of its first
        `computed` tokens, pulled and taken in the loop turn that adds it (without them,
        as when they cannot be booked, it computes what is not cached here)."""
        kv_from = (self.handoffs.whole_prompt(reservation)
                   if reservation is not None and self.handoffs is not None else None)
        if moved is not None and self.handoffs is not None:
            tid, computed, wire = moved
            try:
                chunk = await asyncio.to_thread(self.handoffs.pull, wire)
            except Exception:                # the source died: nothing to pull
                logger.warning("replica %d: the pages of moved request %s could not be "
                               "pulled; it computes them", self.index, request_id,
                               exc_info=True)
            else:
                tokens = prompt_ids[:computed]
                # Before the add, in the same turn of the loop (its inbox keeps the order).
                self.replica.loop.call(lambda: self.handoffs.take_moved(
                    request_id, tid, tokens, chunk))
                kv_from = (reservation_id(request_id, tid), computed)
        handle = self.server.submit(validation.TokensPrompt(prompt_ids), params, slo=slo,
                                    priority=priority, request_id=request_id,
                                    _loop=asyncio.get_running_loop(), _paced=paced,
                                    _kv_from=kv_from, _prefill_s=prefill_s)
        self._handles[request_id] = handle
        if self.handoffs is not None:         # a hand-off's pages may be waiting for it here
            self.replica.loop.call(lambda: self.handoffs.bind(request_id, handle.id))
        moved_on = False
        try:
            async for delta in handle:
                moved_on = isinstance(delta, Moved)   # its decode goes on elsewhere
                yield delta
        finally:
            self._handles.pop(request_id, None)
            if not handle.finished and not moved_on:  # the front went away: free its pages
                handle.cancel()
            if self.handoffs is not None:     # a reservation or hold it took its pages from
                self.replica.loop.call(lambda: self.handoffs.request_ended(request_id))

    async def cancel(self, request_id: str) -> bool:
        handle = self._handles.get(request_id)
        return handle is not None and handle.cancel()

    async def move_out(self, request_id: str) -> bool:
        """The request's decode moves to another replica: its generate stream ends with
        Moved at its next token (serving.ray_handoff). False: it is not decoding here."""
        handle = self._handles.get(request_id)
        if handle is None or self.handoffs is None:
            return False
        return await self._on_loop(
            lambda: self.handoffs.move_out(request_id, handle.id, handle._push_item))

    # ------------------------------------------------------------------ KV hand-offs
    # The actor side of serving.ray_handoff; the front (RayServer._hand_off) calls these.

    async def prefill(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                      slo: SLO | None, priority: int, start_page: int | None,
                      paced: bool = True, prefill_s: float | None = None):
        """generate(), with the decode handed off: the first token's delta, PagesOffered
        items as the prompt's pages fill (from start_page; None: from the page `grant`
        gives, nothing before it), then HandedOff; a final delta instead when the request
        ends here (at its first token, cancelled, failed, or decoded here when the grant
        came after its first token)."""
        handle = self.server.submit(validation.TokensPrompt(prompt_ids), params, slo=slo,
                                    priority=priority, request_id=request_id,
                                    _loop=asyncio.get_running_loop(), _paced=paced,
                                    _prefill_s=prefill_s)
        self._handles[request_id] = handle
        # After the add (the loop takes its inbox in order): a first token sampled before
        # this call reached the loop just stays here (the front then releases D's pages).
        handoffs = self.handoffs
        num_pages = len(prompt_ids) // self.replica.engine.allocator.page_size
        self.replica.loop.call(lambda: handoffs.expect(request_id, handle.id, prompt_ids,
                                                       start_page, num_pages,
                                                       handle._push_item))
        handed = False
        try:
            async for item in handle:
                handed = isinstance(item, HandedOff)
                yield item
        finally:
            self._handles.pop(request_id, None)
            if not handle.finished and not handed:
                handle.cancel()

    async def grant(self, request_id: str, start_page: int) -> None:
        """A prefill started before the decode side's grant may offer its pages now."""
        self.handoffs.grant(request_id, start_page)

    async def reserve(self, request_id: str, tid: int, prompt_ids: list[int]) -> int | None:
        """The handshake: returns once every full prompt page is booked here (the pages
        already cached here), or None when the front withdrew it first."""
        aloop = asyncio.get_running_loop()
        granted = aloop.create_future()
        self.replica.loop.call(lambda: self.handoffs.reserve(
            request_id, tid, prompt_ids,
            lambda start: aloop.call_soon_threadsafe(_resolve, granted, start)))
        return await granted

    async def land(self, res_id: str, wire: WireChunk, lo: int, hi: int) -> bool:
        """Pulls offered pages (off the loop thread) and writes them into the reservation."""
        chunk = await asyncio.to_thread(self.handoffs.pull, wire)
        return await self._on_loop(lambda: self.handoffs.land(res_id, chunk, lo, hi))

    async def register(self, res_id: str) -> bool:
        return await self._on_loop(lambda: self.handoffs.register(res_id))

    async def release_reservation(self, res_id: str, register_landed: bool = False) -> None:
        await self._on_loop(lambda: self.handoffs.release_reservation(res_id, register_landed))

    async def release_hold(self, request_id: str) -> None:
        await self._on_loop(lambda: self.handoffs.release_hold(request_id))

    async def handoffs_state(self) -> dict:
        """For tests: hand-offs kept, leading pages landed, stale writes dropped,
        reservations their request took whole."""
        return await self._on_loop(lambda: {"in_flight": self.handoffs.in_flight,
                                            "leading_pages_landed":
                                                self.handoffs.leading_pages_landed,
                                            "stale_writes": self.handoffs.stale_writes,
                                            "taken_whole": self.handoffs.taken_whole})

    def _on_loop(self, fn) -> asyncio.Future:
        """fn() run on the replica's loop thread, as a future of this event loop."""
        aloop = asyncio.get_running_loop()
        future = aloop.create_future()

        def run():
            try:
                result = fn()
            except BaseException as e:        # noqa: BLE001 - handed to the caller
                aloop.call_soon_threadsafe(_fail, future, e)
            else:
                aloop.call_soon_threadsafe(_resolve, future, result)
        if not self.replica.loop.call(run):
            future.set_exception(RuntimeError(f"replica {self.index}'s loop has stopped"))
        return future

    async def state(self, incarnation: str, after_seq: int) -> ReplicaState:
        """Load, prefill table and the events numbered from after_seq (those before it the
        front has applied, so they are dropped; a front that knows another incarnation
        gets them all)."""
        with self._events_lock:
            if incarnation == self.incarnation:
                self._events = [e for e in self._events if e.seq >= after_seq]
            events = tuple(self._events)
        waiting, running, _ = self.replica.loop.load
        prefills = self.replica.loop.queued_prefills
        now = time.monotonic()
        if now - self._table_at > 1.0:        # refits change it rarely; computing is cheap
            self._table, self._table_at = self._prefill_table(), now
        allocator = self.replica.engine.allocator
        handoffs = {}
        if self.handoffs is not None:
            self.replica.loop.call(lambda: self.handoffs.sweep(time.monotonic()))
            replica = self.replica
            contexts = replica.loop.decode_contexts
            handoffs = dict(
                prefill_share=replica.prefill_share,
                decode_step_table=tuple(
                    (n, decode_step_seconds(replica.predictor, contexts + (n,)))
                    for n, _ in self._table[::8] + self._table[-1:]),
                decode_base_s=decode_step_seconds(replica.predictor, contexts),
                decodes=len(contexts),
                handoffs_in_flight=self.handoffs.in_flight)
        return ReplicaState(self.incarnation, waiting, running, prefills,
                            self.replica.decode_token_s, self._table, events,
                            allocator.num_pages - allocator.num_free_pages, allocator.num_pages,
                            self.replica.controller.num_preemptions,
                            self.replica.loop.num_decoding,
                            chunk_step_s=self.replica.chunk_step_s, **handoffs)

    def _prefill_table(self) -> tuple[tuple[int, float], ...]:
        max_len = self.server.max_model_len
        lengths = sorted({0, *range(0, max_len + 1, max(max_len // 64, 1)), max_len})
        return tuple((n, self.replica.prefill_s(n, 0)) for n in lengths)

    def _on_cache_change(self, stored, removed, cleared=False, orphaned=None,
                         adopted=()) -> None:
        """On the replica's loop thread (the only one touching its allocator)."""
        with self._events_lock:
            if len(self._events) >= MAX_BUFFERED_EVENTS:
                # Nobody polled for long: one event that restates the whole cache.
                allocator = self.replica.engine.allocator
                self._events = [CacheEvent(self.index, self._next_seq,
                                           tuple(allocator._page_of_hash), (), True,
                                           allocator.orphan_hashes)]
            else:
                self._events.append(CacheEvent(
                    self.index, self._next_seq, tuple(stored), tuple(removed), cleared,
                    None if orphaned is None else tuple(orphaned), tuple(adopted)))
            self._next_seq += 1


def parse_cpu_binding(binding, replicas: int) -> tuple[tuple[int, ...], ...] | None:
    """The CPUs of each replica actor: None (unbound); "auto" (this host's CPUs split into
    `replicas` contiguous blocks, for a local Ray); or one set per replica, as vLLM's CPU
    backend binds its ranks ("0-3|4-7", or a list of CPU lists)."""
    if binding is None:
        return None
    if binding == "auto":
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < replicas:
            raise ValueError(f"cpu_binding='auto': {replicas} replicas need at least as many "
                             f"CPUs, this process may use {len(cpus)}")
        per = len(cpus) // replicas
        return tuple(tuple(cpus[i * per:(i + 1) * per]) for i in range(replicas))
    given = binding
    if isinstance(binding, str):
        binding = [_cpu_list(part) for part in binding.split("|")]
    sets = tuple(tuple(sorted({int(c) for c in cpus})) for cpus in binding)
    if len(sets) != replicas or not all(sets) or any(c < 0 for s in sets for c in s):
        raise ValueError(f"cpu_binding needs one non-empty set of CPU numbers per replica "
                         f"({replicas}), got {given!r}")
    return sets


def _cpu_list(text: str) -> list[int]:
    """"0-3,6" -> [0, 1, 2, 3, 6]; "" -> []."""
    cpus = []
    for item in filter(str.strip, text.split(",")):
        lo, _, hi = item.strip().partition("-")
        try:
            cpus += range(int(lo), int(hi or lo) + 1)
        except ValueError:
            raise ValueError(f"cpu_binding: {text!r} is not a CPU list like 0-3,6") from None
    return cpus


def bind_cpus(cpus: Sequence[int]) -> None:
    """Runs this process on `cpus` only, before its XLA backend starts: XLA's CPU client
    sizes its thread pools by the CPUs the process may use, and one program spreads over
    all of them, so replica actors bound to disjoint CPUs compute side by side. Unbound,
    each actor's pools span the whole host, and two actors' steps contend for every
    core (`benchmarks.cpu_concurrency`); a bound actor alone is slower (its CPUs, not
    the host's)."""
    from jax._src import xla_bridge

    started = getattr(xla_bridge, "backends_are_initialized", lambda: False)
    if started():
        raise RuntimeError("bind_cpus must run before JAX starts its backends (the thread "
                           "pools are sized then)")
    os.sched_setaffinity(0, cpus)


def _resolve(future: asyncio.Future, result) -> None:
    if not future.done():
        future.set_result(result)


def _fail(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


def _interpolated(table: Sequence[tuple[int, float]]):
    """seconds(n) by linear interpolation in a [(n, seconds)] table, sorted by n (0 for an
    empty table)."""
    import bisect

    lengths = [n for n, _ in table]
    seconds = [s for _, s in table]

    def at(n: int) -> float:
        if len(lengths) < 2:
            return seconds[0] if seconds else 0.0
        k = min(max(bisect.bisect_left(lengths, n), 1), len(lengths) - 1)
        n0, n1 = lengths[k - 1], lengths[k]
        s0, s1 = seconds[k - 1], seconds[k]
        return s0 + (s1 - s0) * (n - n0) / (n1 - n0) if n1 > n0 else s1
    return at


def _prefill_s(table: Sequence[tuple[int, float]]):
    """prefill_s(num_tokens, cached_tokens) by linear interpolation in an actor's table."""
    at = _interpolated(table)

    def prefill_s(num_tokens: int, cached_tokens: int) -> float:
        return max(at(num_tokens) - at(cached_tokens), 0.0)
    return prefill_s


@dataclasses.dataclass
class _InFlight:
    """One request in the front: what it streamed so far (to re-run it elsewhere)."""

    handle: RequestHandle
    prompt_ids: list[int]
    params: SamplingParams
    slo: SLO | None
    priority: int
    session_id: str | None
    replica: int
    detokenizer: IncrementalDetokenizer
    tokens: list[int] = dataclasses.field(default_factory=list)
    cancelled: bool = False
    stopped: bool = False                 # a stop string ended it; the replica is told
    sent_prompt_logprobs: bool = False
    reruns: int = 0
    hashes: tuple = ()                    # the prompt's page hashes
    cached_tokens: int = 0                # on the replica it was routed to
    prefill_metrics: RequestMetrics | None = None   # its prefill side's, once handed off
    reservation: str | None = None        # the decode side's, registered, for its generate()
    submitted: float = dataclasses.field(default_factory=time.monotonic)
    first_token_at: float | None = None   # when its first token reached this process
    paced: bool = True                    # Server.submit's _paced (generate(): False)
    prefill_s: float | None = None        # predicted where it was routed (its first run's)
    predicted_ttft_s: float = 0.0         # there, the router's Decision
    streaming_from: int | None = None     # the replica whose generate stream it reads now
    moving_to: int | None = None          # its decode moves there at its next token
    moves: int = 0                        # times its running decode moved
    move_decision: object = None          # the OffloadDecision of its move (None: asked)
    moved_at: float | None = None         # when its last move's Moved came, until its next token
    moved_pages: tuple | None = None      # (tid, computed, wire) for its generate() there
    move_decided: tuple[float, int] | None = None   # (when, tokens streamed then)


class RayServer(Server):
    """The Server API over replicas that are Ray actors (see the module's docstring).
    Made by `Server(..., cluster=...)`; n > 1 samples per request are not supported here."""

    def __init__(self, model="smollm2-135m", *, parallel=None,
                 scheduler="lars-mp", engine_config=None, default_slo: SLO | None = None,
                 dtype: str | None = None, metrics_port: int | None = None,
                 warmup: bool | str = "background", predictor=None, cache_dir=None,
                 limits: validation.RequestLimits | None = None, replicas: int = 1,
                 router: str | RoutingConfig = PREDICTED_TIME, cluster: str = "ray",
                 roles=None, offload=None, disagg: DisaggConfig | None = None,
                 actor_options: dict | None = None, max_restarts: int = 3,
                 ready_timeout_s: float = 600.0, cpu_binding=None):
        """The Server's arguments (model: a preset name, checkpoint directory or .gguf
        path, which every host must be able to load; roles, offload and disagg: prefill
        on one replica and decode on another, the KV moved between the actors by
        serving.ray_handoff), plus:
        cluster: "ray" or a Ray address (see `connect`).
        actor_options: Ray's resources per replica actor (default {"num_cpus": 1}; e.g.
          {"num_gpus": 1}, or {"resources": {"TPU": 4}} for one actor per TPU host).
        max_restarts: how many times Ray restarts a replica that died (-1: forever).
        cpu_binding: the CPUs each replica actor runs on (`parse_cpu_binding`: "auto",
          "0-3|4-7" or one CPU list per replica); on a CPU host, replicas that share it
          then compute side by side instead of contending for every core."""
        from medha_jax.cluster.offload import OffloadConfig
        from serving.kv_transfer import DECODE, MIXED, PREFILL

        ray = _import_ray()
        if not isinstance(model, str):
            raise TypeError(f"model must be a name or path that every Ray host can load, "
                            f"got {type(model).__name__} (cluster={cluster!r})")
        if not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"replicas must be an int >= 1, got {replicas!r}")
        routing = RoutingConfig(router) if isinstance(router, str) else router
        if not isinstance(routing, RoutingConfig):
            raise TypeError(f"router must be a policy name or a RoutingConfig, got "
                            f"{type(router).__name__}")
        if isinstance(offload, str):
            offload = OffloadConfig.parse(offload)
        if (roles is not None or offload is not None) and replicas < 2:
            raise ValueError("roles and offload need replicas >= 2 (a hand-off goes from "
                             "one replica to another)")
        self.roles = parse_roles(roles, replicas)
        self.offload = offload or OffloadConfig("never")
        self.disagg = disagg or DisaggConfig()
        handoffs = (self.roles != (MIXED,) * replicas or self.offload.gate != "never"
                    or self.offload.move_decodes)
        self._handoffs_on = handoffs
        self._decode_only = frozenset(i for i, r in enumerate(self.roles) if r == DECODE)
        self._prefill_only = frozenset(i for i, r in enumerate(self.roles) if r == PREFILL)
        started = time.perf_counter()
        self.ray_address = connect(cluster)
        self.limits = validation.DEFAULT_LIMITS if limits is None else limits
        self.cpu_binding = parse_cpu_binding(cpu_binding, replicas)
        spec = ReplicaSpec(model, parallel, scheduler, engine_config, default_slo, dtype,
                           warmup, predictor, cache_dir, limits,
                           self.disagg if handoffs else None, self.cpu_binding)
        options = {"num_cpus": 1, **(actor_options or {})}
        env = {k: os.environ[k] for k in ("JAX_PLATFORMS", "XLA_FLAGS", "MEDHA_CACHE_DIR")
               if k in os.environ}
        # The actors import this checkout's packages, as the front does.
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (root, os.environ.get("PYTHONPATH")) if p)
        actor_class = ray.remote(ReplicaActor)
        self._actors = []
        for i in range(replicas):
            name = ACTOR_NAME.format(i)
            self._kill_leftover(ray, name)
            self._actors.append(actor_class.options(
                name=name, namespace=NAMESPACE, max_restarts=max_restarts,
                max_task_retries=0, max_concurrency=1000,
                runtime_env={"env_vars": env}, **options).remote(i, spec))
        try:
            infos = ray.get([a.describe.remote() for a in self._actors],
                            timeout=ready_timeout_s)
        except BaseException:
            for actor in self._actors:
                ray.kill(actor, no_restart=True)
            raise
        first = infos[0]
        self.config, self.tokenizer = first["config"], first["tokenizer"]
        self.model = None
        self.engine = None
        self._max_model_len = first["max_model_len"]
        self._num_pages = [info["num_pages"] for info in infos]
        # Sequences a step of each holds (decodes fill it first): an offload's or a move's
        # destination keeps a slot for prefill (medha_jax.cluster.offload).
        self._max_seqs = [info["max_seqs"] for info in infos]
        self.page_size = first["page_size"]
        self._page_bytes = first["page_bytes"]
        self.default_slo, self.policy = first["default_slo"], first["policy"]
        self._scheduler_fields = first["scheduler_fields"]
        self.startup = first["startup"]
        self.replica_pids = [info["pid"] for info in infos]
        self.replica_cpus = [info["cpus"] for info in infos]   # as each actor reports them
        self.metrics = ServerMetrics()
        self._ids = itertools.count()
        self._id_prefix = f"req-{secrets.token_hex(4)}"
        self._lock = threading.Lock()               # the router, statuses, in-flight map
        self._in_flight: dict[str, _InFlight] = {}
        self._statuses = [ReplicaStatus(prefill_s=lambda n, c: 0.0, page_size=self.page_size,
                                        healthy=False) for _ in range(replicas)]
        self._incarnation: list[str | None] = [None] * replicas
        self._next_seq = [0] * replicas
        self._pages = [(0, n) for n in self._num_pages]     # (in use, total), last poll
        self.restarts_seen = [0] * replicas
        self._preemptions_by_replica = [(0, 0)] * replicas   # (earlier lives, this life)
        self.reruns = 0                    # requests re-run after their replica died
        self._states: list[ReplicaState | None] = [None] * replicas   # last poll's
        self.handoffs = 0                  # requests whose decode moved to another replica
        self.moves = 0                     # running decodes moved (OffloadConfig.move_decodes)
        self.chunks_moved = 0              # page chunks they moved (several per long prompt)
        # The latest requests' (front id, router Decision) and (front id, OffloadDecision):
        # what was predicted for each, beside what it measured.
        self.routing_decisions: collections.deque = collections.deque(maxlen=10_000)
        self.offload_decisions: collections.deque = collections.deque(maxlen=10_000)
        # (front id, replica it left, replica it went to, OffloadDecision or None when
        # asked by move_decode) of each running decode moved.
        self.move_decisions: collections.deque = collections.deque(maxlen=10_000)
        # Seconds from each move's Moved to the request's next token (what it paused).
        self.move_pauses: collections.deque = collections.deque(maxlen=10_000)
        # Per moved request that ended: (front id, OffloadDecision, seconds from the
        # decision to its end, tokens it decoded in them, tokens the decision priced): the
        # move's price against what it measured.
        self.move_outcomes: collections.deque = collections.deque(maxlen=10_000)
        self._tids = itertools.count(1)
        self._grant_tasks: set[asyncio.Task] = set()   # handshakes of prefills running
        # Per replica, the decodes offloaded to it that its polled state may not show yet
        # (front id -> context): without them, offloads decided within a poll (or during
        # one long prefill) all see the same idle replica and pile onto it.
        self._pending_decodes: list[dict[str, int]] = [{} for _ in range(replicas)]
        # Likewise the prefills routed to it (front id -> (predicted seconds, when routed,
        # TTFT SLO, prompt tokens)), until a poll sent a poll interval after the routing answers: the
        # actor counts a request in its queued prefills from its add (ServingLoop.add), and
        # a decision before then saw none of it (a decode moved to the replica a long
        # prefill had just been routed to).
        self._pending_prefills: list[dict[str, tuple[float, float, float, int]]] = [
            {} for _ in range(replicas)]
        self._router = Router(replicas, self._routable, routing)
        self._closing = False
        self._aloop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._aloop.run_forever,
                                        name="medha-ray-front", daemon=True)
        self._thread.start()
        self._watchers = [asyncio.run_coroutine_threadsafe(self._watch(i), self._aloop)
                          for i in range(replicas)]
        deadline = time.monotonic() + 30
        while not all(s.healthy for s in self._statuses) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        self.ready_seconds = time.perf_counter() - started
        self.metrics_port = (self.metrics.serve_http(metrics_port)
                             if metrics_port is not None else None)

    def _routable(self) -> list[ReplicaStatus]:
        """The statuses the router places new requests by (with what was sent to each
        since its last poll): decode-only replicas prefill only when no other replica is
        healthy."""
        statuses = [dataclasses.replace(s, decodes=s.decodes + len(self._pending_decodes[i]))
                    if self._pending_decodes[i] else s
                    for i, s in enumerate(self._with_pending_prefills(self._statuses))]
        if self._decode_only and any(s.healthy for i, s in enumerate(statuses)
                                     if i not in self._decode_only):
            statuses = [dataclasses.replace(s, healthy=False) if i in self._decode_only else s
                        for i, s in enumerate(statuses)]
        return statuses

    def _with_pending_prefills(self, statuses: Sequence[ReplicaStatus],
                               exclude: str | None = None) -> list[ReplicaStatus]:
        """The statuses with the prefills routed to each replica since its last poll (not
        `exclude`'s: a request's own)."""
        out = []
        now = time.monotonic()
        for status, pending in zip(statuses, self._pending_prefills):
            sent = tuple(QueuedPrefill(x, ttft_s - (now - at) - x,
                                       max(x, status.prefill_s(n, 0)), n)
                         for rid, (x, at, ttft_s, n) in tuple(pending.items()) if rid != exclude)
            out.append(dataclasses.replace(
                status, queued_prefills=status.queued_prefills.plus(sent))
                if sent else status)
        return out

    @staticmethod
    def _kill_leftover(ray, name: str) -> None:
        """A replica of a server that ended without close() (same name) is replaced."""
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
        except ValueError:
            return
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                return
            time.sleep(0.1)

    # ------------------------------------------------------------------ Server API

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def num_total_pages(self) -> int:
        return sum(self._num_pages)

    @property
    def num_free_pages(self) -> int:
        """KV pages free over the replicas, as of their last poll."""
        return sum(total - used for used, total in self._pages)

    @property
    def closed(self) -> bool:
        return self._closing

    @property
    def router(self) -> Router:
        return self._router

    @property
    def healthy(self) -> list[bool]:
        """Per replica: in the router now (answering, warmed up)."""
        return [s.healthy for s in self._statuses]

    def submit(self, prompt, sampling_params: SamplingParams | None = None, *,
               slo: SLO | None = None, priority: int = 0, request_id: str | None = None,
               session_id: str | None = None, _loop=None, _paced: bool = True) -> RequestHandle:
        """As Server.submit. Raises NoHealthyReplica (UNAVAILABLE) when no replica is up."""
        from medha_jax.kv_cache.allocator import prefix_page_hashes

        params = SamplingParams() if sampling_params is None else sampling_params
        if self._closing:
            raise RuntimeError("the server is closed")
        try:
            if request_id is not None:
                validation.check_request_id(request_id)
            if params.n != 1:
                raise ValueError(f"n={params.n}: a Ray cluster serves one sample per request")
            prompt_ids = validation.validate_request(
                prompt, params, slo, priority, tokenizer=self.tokenizer,
                vocab_size=self.config.vocab_size, model_name=self.config.name,
                check_fits=self._check_fits, limits=self.limits)
            detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop)
        except (ValueError, TypeError):
            self.metrics.requests_rejected.inc()
            raise
        if session_id is not None and not isinstance(session_id, str):
            raise TypeError(f"session_id must be a str, got {type(session_id).__name__}")
        server_id = f"{self._id_prefix}-{next(self._ids)}"
        hashes = tuple(prefix_page_hashes(prompt_ids, self.page_size))
        ttft_s = (slo or self.default_slo).ttft_s       # the actor's default where None
        route = RouteRequest(len(prompt_ids), hashes, session_id, params.max_tokens, ttft_s)
        with self._lock:
            decision = self._router.route(route)
            decision_s = self._router.decision_seconds[-1]
            replica = decision.replica
            prefill_s = self._statuses[replica].prefill_s(len(prompt_ids),
                                                          decision.cached_tokens)
            self._pending_prefills[replica][server_id] = (prefill_s, time.monotonic(), ttft_s,
                                                          len(prompt_ids))
            self.routing_decisions.append((server_id, decision))
        self.metrics.observe_routed(replica, decision_s)
        handle = RequestHandle(request_id or server_id, prompt_ids, self.cancel, loop=_loop,
                               id=server_id)
        request = _InFlight(handle, list(prompt_ids), params, slo, priority, session_id,
                            replica, detokenizer, hashes=hashes,
                            cached_tokens=decision.cached_tokens, paced=_paced,
                            prefill_s=prefill_s, predicted_ttft_s=decision.predicted_ttft_s)
        with self._lock:
            self._in_flight[server_id] = request
        asyncio.run_coroutine_threadsafe(self._serve(server_id, request), self._aloop)
        return handle

    def cancel(self, id: str) -> bool:
        with self._lock:
            request = self._in_flight.get(id)
            if request is None or request.cancelled:
                return False
            request.cancelled = True
            actor = self._actors[request.replica]
        actor.cancel.remote(id)            # its final delta ("cancelled") follows
        return True

    def metrics_text(self) -> str:
        return self.metrics.text()

    def close(self, *, drain: bool = False, timeout: float | None = None) -> None:
        """Stops the front and kills the replica actors (no restart). With drain=True,
        waits up to `timeout` for the requests in flight first."""
        if self._closing:
            return
        ray = _import_ray()
        if drain:
            deadline = None if timeout is None else time.monotonic() + timeout
            while self._in_flight and (deadline is None or time.monotonic() < deadline):
                time.sleep(POLL_S)
        self._closing = True
        for request_id in list(self._in_flight):
            self.cancel(request_id)
        deadline = time.monotonic() + 5      # their "cancelled" finals come from the actors
        while self._in_flight and time.monotonic() < deadline:
            time.sleep(POLL_S)
        for actor in self._actors:
            ray.kill(actor, no_restart=True)
        for request_id, request in list(self._in_flight.items()):
            self._finish(request_id, request, "cancelled", None, None)
        try:
            asyncio.run_coroutine_threadsafe(self._stop_tasks(), self._aloop).result(10)
        finally:
            self._aloop.call_soon_threadsafe(self._aloop.stop)
        self._thread.join(10)
        self.metrics.close()

    async def _stop_tasks(self) -> None:
        """Cancels the watchers and streams still running on the front's event loop."""
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _check_fits(self, prompt_len: int, max_new_tokens: int, *, request_id: str = "") -> None:
        total = prompt_len + max_new_tokens
        if total > self._max_model_len:
            raise ValueError(f"prompt_len={prompt_len} + max_tokens={max_new_tokens} = {total} "
                             f"exceeds max_model_len={self._max_model_len}")

    # ------------------------------------------------------------------ the front's loop

    async def _watch(self, i: int) -> None:
        """Polls replica i forever: its load and events when it answers; out of the router
        (cache and sessions forgotten) while it does not."""
        from ray.exceptions import GetTimeoutError, RayActorError

        actor = self._actors[i]
        while not self._closing:
            sent = time.monotonic()
            try:
                state = await asyncio.wait_for(
                    actor.state.remote(self._incarnation[i], self._next_seq[i]), 10.0)
            except (RayActorError, GetTimeoutError, asyncio.TimeoutError):
                self._replica_down(i)
                await asyncio.sleep(0.25)
                continue
            with self._lock:
                if state.incarnation != self._incarnation[i]:
                    if self._incarnation[i] is not None:
                        self.restarts_seen[i] += 1
                    self._incarnation[i] = state.incarnation
                    self._router.replica_down(i)   # a new process: nothing cached there
                for event in state.events:
                    self._router.index.apply(event)
                if state.events:
                    self._next_seq[i] = state.events[-1].seq + 1
                self._statuses = [*self._statuses[:i], ReplicaStatus(
                    prefill_s=_prefill_s(state.prefill_table), page_size=self.page_size,
                    num_waiting=state.num_waiting, num_running=state.num_running,
                    queued_prefills=state.queued_prefills,
                    decode_token_s=state.decode_token_s, decodes=state.num_decoding,
                    healthy=True, chunk_step_s=state.chunk_step_s, **self._scheduler_fields),
                    *self._statuses[i + 1:]]
                self._pages[i] = (state.pages_in_use, state.pages_total)
                self._states[i] = state
                pending = self._pending_prefills[i]
                for rid in [rid for rid, (_, at, *_) in pending.items() if at <= sent - POLL_S]:
                    del pending[rid]
                if self.offload.move_decodes:
                    self._consider_moves(i)
            self.metrics.observe_state(
                pages_in_use=state.pages_in_use, pages_total=state.pages_total,
                waiting=state.num_waiting, running=state.num_running,
                preemptions_total=self._preemptions(i, state.num_preemptions), replica=i)
            await asyncio.sleep(POLL_S)

    def _preemptions(self, i: int, total: int) -> int:
        """Replica i's preemptions over its lives (a restarted actor counts from 0 again)."""
        earlier, last = self._preemptions_by_replica[i]
        if total < last:
            earlier += last
        self._preemptions_by_replica[i] = (earlier, total)
        return earlier + total

    def _replica_down(self, i: int) -> None:
        with self._lock:
            if self._statuses[i].healthy:
                self._router.replica_down(i)
            self._statuses = [*self._statuses[:i],
                              dataclasses.replace(self._statuses[i], healthy=False),
                              *self._statuses[i + 1:]]

    async def _serve(self, server_id: str, request: _InFlight) -> None:
        """Streams the request from its replica; when that replica dies, re-runs it on
        another from prompt + tokens streamed; ends it with UNAVAILABLE when it cannot."""
        from ray.exceptions import RayActorError, RayTaskError

        try:
            decode = self._offload_target(server_id, request)
            if decode is not None:
                try:
                    if await self._hand_off(server_id, request, decode):
                        return
                finally:                    # once the decode side's polls show it
                    asyncio.get_running_loop().call_later(
                        2 * POLL_S, self._pending_decodes[decode].pop, server_id, None)
            while True:
                params = request.params
                remaining = params.max_tokens - len(request.tokens)
                if remaining <= 0:        # everything streamed; only the final was lost
                    self._finish(server_id, request, "length", None, None)
                    return
                run_params = dataclasses.replace(
                    params, max_tokens=remaining, stop=(),
                    prompt_logprobs=None if request.sent_prompt_logprobs
                    else params.prompt_logprobs)
                replica = request.replica
                stream = self._actors[replica].generate.remote(
                    server_id, request.prompt_ids + request.tokens, run_params, request.slo,
                    request.priority, request.paced, request.reservation, request.prefill_s,
                    request.moved_pages)
                request.reservation = request.moved_pages = None   # a re-run elsewhere finds none
                request.prefill_s = None          # nor is it priced by the first routing
                request.streaming_from, moved = replica, None
                try:
                    async for ref in stream:
                        item = await ref
                        if isinstance(item, Moved):
                            moved = item
                            break
                        if self._deliver(server_id, request, item):
                            return
                    else:
                        error = f"replica {replica} ended the stream without a final delta"
                except RayActorError as e:
                    self._replica_down(replica)
                    error = f"replica {replica} died ({type(e).__name__})"
                except RayTaskError as e:
                    self._finish(server_id, request, "error", None,
                                 f"replica {replica}: {e.cause!r}")
                    return
                finally:
                    request.streaming_from = None
                if moved is not None:
                    if await self._move_in(server_id, request, moved):
                        return
                    continue
                if request.cancelled or request.stopped or self._closing:
                    self._finish(server_id, request,
                                 "stop" if request.stopped else "cancelled", None, None)
                    return
                if params.seed is not None and not params.greedy:
                    self._finish(server_id, request, "error", None,
                                 f"{UNAVAILABLE}: {error}; a seeded sample cannot resume "
                                 "elsewhere (its random stream would restart)",
                                 unavailable=True)
                    return
                try:
                    request.replica = self._reroute(request)
                except NoHealthyReplica as e:
                    self._finish(server_id, request, "error", None,
                                 f"{UNAVAILABLE}: {error}; {e}", unavailable=True)
                    return
                request.reruns += 1
                self.reruns += 1
        except Exception as e:            # never leave a caller waiting
            self._finish(server_id, request, "error", None,
                         f"front failed: {type(e).__name__}: {e}")

    def _reroute(self, request: _InFlight) -> int:
        """Another replica for a request whose replica went away (raises NoHealthyReplica);
        by its prompt's pages, so one that has them (a decode side they landed on) wins."""
        with self._lock:
            return self._router.route(RouteRequest(
                len(request.prompt_ids) + len(request.tokens), request.hashes,
                request.session_id, request.params.max_tokens - len(request.tokens),
                (request.slo or self.default_slo).ttft_s)).replica

    # ------------------------------------------------------------------ KV hand-offs

    def _offload_target(self, server_id: str, request: _InFlight) -> int | None:
        """The replica to decode a new request on, when not where it prefills
        (medha_jax.cluster.offload.choose_decode on the replicas as last polled). A seeded
        sampled request stays: its random stream could not go on elsewhere."""
        from medha_jax.cluster.offload import OffloadRequest, choose_decode

        params = request.params
        if (not self._handoffs_on or params.max_tokens <= 1
                or (params.seed is not None and not params.greedy)):
            return None
        prefill, prompt_len = request.replica, len(request.prompt_ids)
        with self._lock:
            statuses = self._with_pending_prefills(self._statuses, exclude=server_id)
            states = list(self._states)
            cached_pages = self._router.index.cached_pages(request.hashes)
        offload_request = OffloadRequest(
            prompt_len, request.cached_tokens, params.max_tokens,
            statuses[prefill].prefill_s(prompt_len, request.cached_tokens),
            request.predicted_ttft_s, -(-prompt_len // self.page_size), self._page_bytes)
        views = self._offload_views(statuses, states, cached_pages, prompt_len)
        decision = choose_decode(offload_request, prefill, views, self.offload)
        if decision.decode is not None:
            self._pending_decodes[decision.decode][server_id] = prompt_len
        self.offload_decisions.append((server_id, decision))
        return decision.decode

    def _offload_views(self, statuses, states, cached_pages, context: int,
                       running_on: int | None = None) -> list:
        """The replicas as the offload decision sees them, for a request of `context`
        tokens (already decoding on `running_on`, counted in its polled decodes)."""
        from medha_jax.cluster.offload import OffloadReplica

        return [OffloadReplica(
            can_decode=status.healthy and state is not None,
            prefill_only=i in self._prefill_only,
            queued_prefill_s=status.queued_prefills.work_s,
            chunk_step_s=state.chunk_step_s if state else 0.0,
            decode_token_s=status.decode_token_s, cached_pages=cached_pages[i],
            prefill_share=state.prefill_share if state else 0.0,
            max_seqs=self._max_seqs[i],
            **self._decode_steps(i, state, context, running=i == running_on))
            for i, (status, state) in enumerate(zip(statuses, states))]

    def _decode_steps(self, replica: int, state, context: int, running: bool = False) -> dict:
        """OffloadReplica's decode fields for `replica`: its decode step's predicted
        seconds with one more decode of this context and without it, and the decodes it
        runs: its polled ones plus those offloaded to it and not yet polled there (each
        adds its own share: the predictor's decode features add up per sequence).
        running: the request decodes there already (its polled step has it)."""
        if state is None:
            return {}
        step = _interpolated(state.decode_step_table)
        pending = self._pending_decodes[replica].values()
        base = state.decode_base_s + sum(step(c) - state.decode_base_s for c in pending)
        own = step(context) - state.decode_base_s
        if running:
            return dict(decode_step_s=base, decode_base_step_s=base - own,
                        decodes=max(0, state.decodes - 1) + len(pending))
        return dict(decode_step_s=base + own, decode_base_step_s=base,
                    decodes=state.decodes + len(pending))

    # ------------------------------------------------------------------ moving decodes

    def _consider_moves(self, i: int) -> None:
        """Under self._lock, after replica i's poll: while i has prefill queued, the one
        of its running decodes that `choose_move` gains most by moving starts to move (one
        a poll: the next poll prices the destination with it among its decodes)."""
        from medha_jax.cluster.offload import choose_move

        statuses = self._with_pending_prefills(self._statuses)
        states = list(self._states)
        if states[i] is None or statuses[i].queued_prefills.work_s <= 0:
            return
        best = None
        for server_id, request in self._in_flight.items():
            params = request.params
            left = params.max_tokens - len(request.tokens)
            if (request.streaming_from != i or not request.tokens or request.moves
                    or request.moving_to is not None or request.cancelled or request.stopped
                    or left <= 1 or (params.seed is not None and not params.greedy)):
                continue
            context = len(request.prompt_ids) + len(request.tokens)
            views = self._offload_views(statuses, states,
                                        self._router.index.cached_pages(request.hashes),
                                        context, running_on=i)
            decision = choose_move(context, left, self.page_size, self._page_bytes, i, views,
                                   self.offload)
            gain = decision.colocated_s - decision.offloaded_s
            if decision.decode is not None and (best is None or gain > best[0]):
                best = (gain, server_id, request, context, decision)
        if best is not None:
            _, server_id, request, context, decision = best
            self._start_move(server_id, request, i, decision.decode, decision)

    def move_decode(self, request_id: str, to: int) -> bool:
        """Moves the request's running decode to replica `to` at its next token, as
        OffloadConfig.move_decodes does by itself (needs hand-offs on: roles, an offload
        gate or move_decodes). False when it is not decoding on another replica now, or
        is moving already."""
        with self._lock:
            request = self._in_flight.get(request_id)
            if (not self._handoffs_on or request is None or not request.tokens
                    or request.streaming_from in (None, to) or request.moving_to is not None
                    or not 0 <= to < len(self._actors)):
                return False
            self._start_move(request_id, request, request.streaming_from, to, None)
            return True

    def _start_move(self, server_id: str, request: _InFlight, source: int, decode: int,
                    decision) -> None:
        """Under self._lock, any thread."""
        request.moving_to, request.move_decision = decode, decision
        request.move_decided = (time.monotonic(), len(request.tokens))
        self._pending_decodes[decode][server_id] = len(request.prompt_ids) + len(request.tokens)

        def spawn():
            task = asyncio.ensure_future(self._move_out(server_id, request, source))
            self._grant_tasks.add(task)            # (the loop keeps only weak references)
            task.add_done_callback(self._grant_tasks.discard)
        self._aloop.call_soon_threadsafe(spawn)

    async def _move_out(self, server_id: str, request: _InFlight, source: int) -> None:
        """Asks `source` to end the request's stream with Moved at its next token; when it
        cannot (the request ended or is not decoding there), the move is dropped."""
        from ray.exceptions import RayActorError

        try:
            started = await self._actors[source].move_out.remote(server_id)
        except RayActorError:
            started = False
        if not started:
            self._moved(server_id, request)

    def _moved(self, server_id: str, request: _InFlight) -> None:
        """The move ended (done or dropped): the destination's polls count it from here."""
        if request.moving_to is not None:
            asyncio.get_running_loop().call_later(
                2 * POLL_S, self._pending_decodes[request.moving_to].pop, server_id, None)
            request.moving_to = None

    async def _move_in(self, server_id: str, request: _InFlight, moved: Moved) -> bool:
        """The request's decode left request.replica, every page it computed offered as
        moved.wire: `_serve` runs the rest on the destination, whose generate takes those
        pages (a decode step first). When the destination is down it goes on where it
        was, from the full pages cached there. True when it ended here."""
        decode = request.moving_to
        self._moved(server_id, request)
        if decode is None:
            return False
        request.moved_at = time.monotonic()
        if request.prefill_metrics is None:          # TTFT and TPOT on this process's clock
            request.prefill_metrics = moved.metrics
        if request.cancelled or request.stopped or self._closing:
            self._finish(server_id, request, "stop" if request.stopped else "cancelled",
                         None, None)
            return True
        if not self._statuses[decode].healthy:
            return False
        self.move_decisions.append((server_id, request.replica, decode, request.move_decision))
        request.replica = decode
        request.moved_pages = (next(self._tids), moved.computed, moved.wire)
        request.moves += 1
        self.moves += 1
        return False

    async def _hand_off(self, server_id: str, request: _InFlight, decode: int) -> bool:
        """Prefills on request.replica while the KV streams to `decode`, then moves the
        request there (serving.ray_handoff). True when the request finished meanwhile;
        False: `_serve` runs the rest on request.replica (the decode side, or the prefill
        side when the hand-off could not happen; a replica's death re-routes it)."""
        from ray.exceptions import RayActorError, RayTaskError

        prefill = request.replica
        source, destination = self._actors[prefill], self._actors[decode]
        tid = next(self._tids)
        res_id = reservation_id(server_id, tid)

        async def granted() -> int | None:
            """The pages D has cached once it booked the rest; None: not in time."""
            try:
                return await asyncio.wait_for(
                    destination.reserve.remote(server_id, tid, request.prompt_ids),
                    self.disagg.handshake_timeout_s)
            except (asyncio.TimeoutError, RayActorError):
                return None

        start, stays = None, False          # stays: it ended or decodes on P
        if prefill in self._prefill_only:
            # It cannot decode, so it may prefill only once the pages are booked.
            start = await granted()
            if start is None:               # no pages there in time: served co-located
                destination.release_reservation.remote(res_id)
                return False
            if request.cancelled or self._closing:     # while it waited for the pages
                destination.release_reservation.remote(res_id)
                self._finish(server_id, request, "cancelled", None, None)
                return True
        else:
            # A mixed P starts at once (the handshake's wait is not in the TTFT) and offers
            # pages once told the grant; a first token before it decodes there.
            async def pass_on_the_grant() -> None:
                pages = await granted()
                if pages is None or stays:      # (a release sent before the booking
                    destination.release_reservation.remote(res_id)      # found nothing)
                else:
                    source.grant.remote(server_id, pages)

            task = asyncio.ensure_future(pass_on_the_grant())
            self._grant_tasks.add(task)            # (the loop keeps only weak references)
            task.add_done_callback(self._grant_tasks.discard)
        params = dataclasses.replace(request.params, stop=())
        lands, handed, deltas = [], None, 0
        try:
            stream = source.prefill.remote(server_id, request.prompt_ids, params, request.slo,
                                           request.priority, start, request.paced,
                                           request.prefill_s)
            request.prefill_s = None
            async for ref in stream:
                item = await ref
                if isinstance(item, PagesOffered):
                    self.chunks_moved += 1
                    lands.append(destination.land.remote(res_id, item.wire, item.lo, item.hi))
                elif isinstance(item, HandedOff):
                    handed = item
                elif self._deliver(server_id, request, item):     # it ended on P
                    stays = True
                    destination.release_reservation.remote(res_id)
                    return True
                else:
                    deltas += 1
                    if deltas == 2:         # a delta after the first token's: it decodes
                        stays = True                                        # on P
                        destination.release_reservation.remote(res_id)
        except RayActorError:                # P died: D keeps what landed as prefix cache
            self._replica_down(prefill)
            # Pulls of what P offered before it died end first (those of chunks still in
            # P's transfer server fail; bounded, in case one hangs on the dead peer).
            try:
                await asyncio.wait_for(asyncio.gather(*lands, return_exceptions=True),
                                       LANDS_AFTER_DEATH_S)
            except asyncio.TimeoutError:
                pass
            # Waited for: an async actor runs calls in no set order, and the re-run must
            # find those pages in the prefix cache.
            try:
                await destination.release_reservation.remote(res_id, True)
            except RayActorError:
                self._replica_down(decode)
            try:
                request.replica = self._reroute(request)
            except NoHealthyReplica as e:
                self._finish(server_id, request, "error", None,
                             f"{UNAVAILABLE}: replica {prefill} died; {e}", unavailable=True)
                return True
            request.reruns += 1
            self.reruns += 1
            return False
        except RayTaskError as e:
            destination.release_reservation.remote(res_id)
            self._finish(server_id, request, "error", None, f"replica {prefill}: {e.cause!r}")
            return True
        if handed is None:
            destination.release_reservation.remote(res_id)
            raise RuntimeError(f"replica {prefill} ended a prefill stream without its end")
        if request.cancelled or request.stopped or self._closing:
            destination.release_reservation.remote(res_id)
            source.release_hold.remote(server_id)
            self._finish(server_id, request, "stop" if request.stopped else "cancelled",
                         None, None)
            return True
        try:
            await asyncio.gather(*lands)
            registered = await destination.register.remote(res_id)
        except (RayActorError, RayTaskError) as e:
            if isinstance(e, RayActorError):
                self._replica_down(decode)
            registered = False
        if not registered:
            # The decode side is gone: decode where the pages are held (taken by prefix
            # reuse; the hold goes once the re-run has them, or at ack_timeout_s).
            destination.release_reservation.remote(res_id)
            return False
        request.replica, request.prefill_metrics = decode, handed.metrics
        request.reservation = res_id
        self.handoffs += 1
        source.release_hold.remote(server_id)
        if request.cancelled or self._closing:     # while the pages moved
            destination.release_reservation.remote(res_id)
            self._finish(server_id, request, "cancelled", None, None)
            return True
        return False

    def _deliver(self, server_id: str, request: _InFlight, delta: StreamDelta) -> bool:
        """Passes one replica delta to the caller (text decoded here). True when final."""
        tokens = () if request.stopped else delta.token_ids
        if tokens and request.first_token_at is None:
            request.first_token_at = time.monotonic()
        if tokens and request.moved_at is not None:
            self.move_pauses.append(time.monotonic() - request.moved_at)
            request.moved_at = None
        request.tokens.extend(tokens)
        if delta.prompt_logprobs is not None:
            request.sent_prompt_logprobs = True
        request.detokenizer.add(tokens)
        if request.detokenizer.stopped and not request.stopped:
            request.stopped = True
            self._actors[request.replica].cancel.remote(server_id)
        if delta.finished:
            reason = "stop" if request.stopped else delta.finish_reason
            self._finish(server_id, request, reason, delta, delta.error, tokens)
            return True
        text = request.detokenizer.take_delta(final=False)
        if tokens or text or delta.prompt_logprobs is not None:
            request.handle._push(StreamDelta(
                request.handle.request_id, tuple(tokens), text, finished=False,
                logprobs=delta.logprobs if not request.stopped else None,
                prompt_logprobs=delta.prompt_logprobs))
        return False

    def _finish(self, server_id: str, request: _InFlight, reason: str,
                delta: StreamDelta | None, error: str | None, tokens=(), *,
                unavailable: bool = False) -> None:
        with self._lock:
            if self._in_flight.pop(server_id, None) is None:
                return
            if request.moving_to is not None:      # it ended before its move started
                self._pending_decodes[request.moving_to].pop(server_id, None)
            if request.moves and request.move_decision is not None:
                at, streamed = request.move_decided
                self.move_outcomes.append((server_id, request.move_decision,
                                           time.monotonic() - at,
                                           len(request.tokens) - streamed,
                                           request.params.max_tokens - streamed))
        metrics = delta.metrics if delta is not None and delta.metrics is not None else \
            RequestMetrics(0.0, None, None, 0.0, 0.0, 0.0, 0, 0, 0)
        # The replica counted the re-run's prompt (prompt + tokens streamed) as its prompt.
        metrics = dataclasses.replace(metrics, replica=request.replica,
                                      num_prompt_tokens=len(request.prompt_ids),
                                      num_output_tokens=len(request.tokens))
        prefilled = request.prefill_metrics
        if prefilled is not None:
            # Handed off: two replicas on two clocks (hosts), so the times are this
            # process's (TTFT counts the handshake; TPOT the hand-off's gap between the
            # first token, sampled on the prefill side, and the second: the decode side's
            # own TPOT starts after it), the queue time and the prompt's cached tokens the
            # prefill side's.
            finished = time.monotonic()
            metrics = dataclasses.replace(
                metrics, arrival_time=request.submitted,
                first_token_time=request.first_token_at, finish_time=finished,
                ttft=request.first_token_at - request.submitted,
                tpot=(finished - request.first_token_at) / max(len(request.tokens) - 1, 1),
                queue_time=prefilled.queue_time,
                num_cached_tokens=prefilled.num_cached_tokens)
        request.handle._push(StreamDelta(
            request.handle.request_id, tuple(tokens), request.detokenizer.take_delta(final=True),
            finished=True, finish_reason=reason, metrics=metrics, error=error,
            unavailable=unavailable, logprobs=delta.logprobs if delta is not None else None,
            prompt_logprobs=delta.prompt_logprobs if delta is not None else None))
        self.metrics.observe_finished(metrics, reason)


# Server sets __signature__ for its __new__; this class takes its own arguments.
RayServer.__signature__ = inspect.signature(RayServer.__init__).replace(
    parameters=list(inspect.signature(RayServer.__init__).parameters.values())[1:])
