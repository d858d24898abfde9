"""Several replicas of one model in this process, on disjoint device groups, behind a router.

On one host every replica lives in this process (a TPU host's chips belong to one
process, and a GPU host needs no more): replica i is an engine on device group i (its
own mesh with the axes `parallel` gives), with its own KV pool, controller, runtime
predictor and loop thread (`LocalReplica`). With several, `ReplicaSet` places each
request through the router (`medha_jax.cluster.router`), which reads every replica's queue
and queued predicted work (each loop publishes them after every iteration) and the exact
prefix index the replicas' allocators feed with their cache events.

    engines = [Engine(m, config) for m in replica_models("smollm2-135m", 2)]
    replicas = [LocalReplica(i, e, scheduler_config, ...) for i, e in enumerate(engines)]
    placement = ReplicaSet(replicas, RoutingConfig("predicted-time"))
    index, decision_seconds = placement.place(prompt_ids, session_id, max_new_tokens, ttft_s)

Faults: a replica whose steps keep failing or whose loop thread dies goes down (see
serving.loop): the router stops placing there and forgets its cache and sessions, and
each request it held is re-run on a healthy replica from its prompt + the tokens it had
streamed, kept as its output so far (`resumed_request`: recomputed as after a
preemption), by the same stream: the caller sees one uninterrupted stream. Sampling
resumes exactly: the key of a request's n-th output token depends only on (seed, n), and an
unseeded request's drawn seed goes with it. When no healthy replica can take it (or it
already moved `max_failovers` times) it ends with an error marked `unavailable`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Sequence

from medha_jax.cluster.offload import OffloadConfig, OffloadReplica, OffloadRequest, choose_decode
from medha_jax.cluster.router import (NoHealthyReplica, ReplicaStatus, RouteRequest, Router,
                                      RoutingConfig)
from medha_jax.kv_cache.allocator import prefix_page_hashes
from medha_jax.request import FinishReason, Request
from medha_jax.scheduler.predictor import decode_step_seconds, decode_token_seconds
from serving.loop import ServingLoop
from serving.outputs import RequestStream

logger = logging.getLogger(__name__)

# How far back a replica's share of time on prefill steps looks (the offload decision's rho).
PREFILL_SHARE_WINDOW_S = 10.0


def device_groups(num_devices_per_replica: int | Sequence[int], num_replicas: int,
                  devices: Sequence | None = None) -> list[list]:
    """Disjoint, contiguous groups of devices, one per replica (contiguous: on GPUs and TPUs
    neighbouring ids share the fastest links, which a replica's tp wants), in device order.
    num_devices_per_replica: one size for every replica, or each replica's own."""
    import jax

    devices = list(jax.devices() if devices is None else devices)
    if not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"replicas must be an int >= 1, got {num_replicas!r}")
    sizes = ([num_devices_per_replica] * num_replicas if isinstance(num_devices_per_replica, int)
             else list(num_devices_per_replica))
    if len(sizes) != num_replicas:
        raise ValueError(f"{len(sizes)} device group sizes for {num_replicas} replicas")
    needed = sum(sizes)
    if needed > len(devices):
        each = (f"{sizes[0]} devices each" if len(set(sizes)) == 1
                else f"{'+'.join(map(str, sizes))} devices")
        raise ValueError(f"{num_replicas} replicas of {each} need {needed} devices, but "
                         f"{len(devices)} are visible")
    starts = [sum(sizes[:i]) for i in range(num_replicas)]
    return [devices[start:start + size] for start, size in zip(starts, sizes)]


def replica_models(model, num_replicas: int, *, parallel=None, dtype: str | None = None):
    """The model loaded on the first device group and copied to the others (each device
    takes its own slices). `model`: what `load_model` takes, or a loaded Model.
    parallel: every replica's mesh (a ParallelConfig; a loaded Model keeps its own mesh's
    axes, so then it must be None), or one ParallelConfig per replica (replicas of different
    shapes, e.g. a prefill replica at tp=1 beside a decode replica at tp=2: each is
    placed from the same weights on its own mesh)."""
    from medha_jax.model import Model, load_model
    from meshes import ParallelConfig, make_mesh

    per_replica = isinstance(parallel, Sequence)
    if per_replica:
        if len(parallel) != num_replicas:
            raise ValueError(f"parallel names {len(parallel)} replica meshes but "
                             f"replicas={num_replicas}")
        for p in parallel:
            if not isinstance(p, ParallelConfig):
                raise TypeError(f"parallel's entries must be ParallelConfig, got "
                                f"{type(p).__name__}")
        parallels = list(parallel)
    elif isinstance(model, Model):
        if parallel is not None:
            raise ValueError("parallel must be None when model is a loaded Model (it was "
                             "loaded with its own), or one ParallelConfig per replica")
        parallels = [model.parallel] * num_replicas
    else:
        parallels = [parallel or ParallelConfig()] * num_replicas
    if isinstance(model, Model) and dtype is not None:
        raise ValueError("dtype must be None when model is a loaded Model (it was loaded "
                         "with its own)")
    for p in parallels:
        if p.dp != 1:
            raise ValueError(f"ParallelConfig(dp={p.dp}) describes one replica's mesh here; "
                             "give the number of replicas as replicas=, or with switching= the "
                             "base replicas DP <-> TP switching forms groups of")
    groups = device_groups([p.num_devices for p in parallels], num_replicas)
    meshes = [make_mesh(p, group) for p, group in zip(parallels, groups)]
    if isinstance(model, Model):
        base = model if (model.parallel == parallels[0] and
                         list(model.mesh.devices.flat) == groups[0]) else model.on_mesh(meshes[0])
    else:
        base = load_model(model, dtype=dtype, mesh=meshes[0])
    return [base] + [base.on_mesh(mesh) for mesh in meshes[1:]]


class LocalReplica:
    """One replica served from this process: its engine, controller, runtime predictor
    (refined online from its own steps) and loop thread."""

    def __init__(self, index: int, engine, scheduler_config, *, predictor, cache_dir,
                 clock, metrics, eos_token_ids: Sequence[int], routed: bool):
        """predictor: a RuntimePredictor to use as is, or None for this engine's saved one
        (else one derived from the roofline), refined online from the steps served.
        routed: several replicas share a router, so the loop publishes its queued work."""
        from medha_jax.scheduler.factory import make_controller

        self.index, self.engine, self.cache_dir = index, engine, cache_dir
        self.scheduler_config = scheduler_config
        self.refit = None
        if predictor is None:
            self.refit, how = starting_refit(engine, cache_dir)
            self.predictor_how = how + ", refined online from served steps"
            predictor = self.refit.predictor
        else:
            self.predictor_how = "given"
        self.predictor = predictor
        self.controller = make_controller(
            scheduler_config, allocator=engine.allocator, clock=clock, predictor=predictor,
            model_config=engine.model.config, eos_token_ids=tuple(eos_token_ids),
            max_model_len=engine.max_model_len, pipeline_stages=engine.num_stages)
        self.decode_token_s = decode_token_seconds(predictor, engine.max_seqs)
        self._waits_seen = 0
        self.role = "mixed"                 # set by ReplicaSet (serving.kv_transfer.ROLES)
        # Called on the loop thread after each step (the KV hand-off's, when one is set).
        self.step_hooks: list = []
        self._prefill_steps: collections.deque = collections.deque()  # (end time, seconds)
        self.loop = ServingLoop(self.controller, engine, metrics,
                                name=f"medha-server-loop-{index}",
                                on_step=self._on_step,
                                replica=index,
                                decode_token_s=self.decode_token_s if routed else None)

    def prefill_s(self, num_tokens: int, cached_tokens: int) -> float:
        """Predicted seconds to prefill num_tokens with the first cached_tokens cached
        (Medha Algorithm 3's table; read from the router's thread)."""
        prefill_time = self.controller.prefill_time_cache.prefill_time
        return prefill_time(num_tokens) - prefill_time(cached_tokens)

    @property
    def max_seqs(self) -> int:
        """Sequences one step holds (the packer's limit: decodes fill it first)."""
        return self.controller.packer.limits.max_seqs_per_batch

    @property
    def chunk_step_s(self) -> float:
        """Seconds of a step that carries a prefill chunk, as a decode beside prefill work
        pays them (read from the router's thread: a snapshot): the mean of this replica's
        such steps in the last PREFILL_SHARE_WINDOW_S, as measured. Without any, the
        packer's batch budget where it has one (what the simulator prices), else a step of
        a full chunk (max_tokens_per_step), predicted.

        Measured, because the packer sizes chunks to its budget beside decodes: on one CPU
        core a full 256-token chunk of SmolLM2 is ~1.2 s, the steps decodes rode in were
        ~0.3 s, and pricing them at the full chunk put the offload decision's decode
        seconds at twice the measured ones on both of its plans (benchmarks.disagg (g))."""
        since = time.monotonic() - PREFILL_SHARE_WINDOW_S
        recent = [d for end, d in list(self._prefill_steps) if end >= since]
        if recent:
            return sum(recent) / len(recent)
        target = getattr(self.controller.packer, "target_batch_time_s", None)
        return target if target is not None else \
            self.prefill_s(self.engine.config.max_tokens_per_step, 0)

    def _on_step(self, collected) -> None:
        if self.refit is not None:
            self._refine_predictor(collected)
        now = time.monotonic()
        if any(not c.is_decode for c in collected.batch.chunks):
            self._prefill_steps.append((now, collected.result.duration_s))
        while self._prefill_steps and self._prefill_steps[0][0] < now - PREFILL_SHARE_WINDOW_S:
            self._prefill_steps.popleft()
        for hook in self.step_hooks:
            hook()

    @property
    def prefill_share(self) -> float:
        """Share of the last PREFILL_SHARE_WINDOW_S seconds this replica's steps spent
        carrying prefill chunks (read from the router's thread: a snapshot). Steps that
        ended before the window count for nothing also while the replica is idle (the
        loop prunes the deque only when it steps)."""
        since = time.monotonic() - PREFILL_SHARE_WINDOW_S
        steps = list(self._prefill_steps)
        return min(1.0, sum(d for end, d in steps if end >= since) / PREFILL_SHARE_WINDOW_S)

    def _refine_predictor(self, collected) -> None:
        """On the loop thread after each step: feeds its measured time to the online refit
        and, when that refitted, refreshes what the scheduler precomputed from the
        predictor (its prefill-time table, the default batch budget) and saves it. Steps
        timed while shapes still compile in the background (the CPU is shared with the
        compiler), or that waited for a compile, would teach it compile times: skipped."""
        from medha_jax.engine import cache_dirs
        from medha_jax.scheduler.factory import target_batch_time

        engine = self.engine
        waited, self._waits_seen = self._waits_seen, engine.compiles_waited_for
        if engine.warming_up or waited != engine.compiles_waited_for:
            return
        if not self.refit.observe(*engine.step_records[-1]):
            return
        t_target = target_batch_time(self.scheduler_config, self.refit.predictor)
        self.controller.prefill_time_cache.refresh(t_target)
        if hasattr(self.controller.packer, "target_batch_time_s"):
            self.controller.packer.target_batch_time_s = t_target
        if self.cache_dir is not None:
            cache_dirs.save_predictor(engine, self.cache_dir, self.refit.predictor,
                                      refined_from_steps=self.refit.num_observed)


def starting_refit(engine, cache_dir):
    """(OnlineRefit, how) of the predictor a replica starts from: the one saved for this
    engine under cache_dir, else the analytical roofline's (no calibration sweep)."""
    from medha_jax.engine import cache_dirs
    from medha_jax.engine.online_fit import OnlineRefit, prior_records, starting_predictor

    loaded, how = cache_dirs.load_predictor(engine, cache_dir)
    if loaded is not None:
        return OnlineRefit(loaded, prior_records(engine, loaded.predict_features)), how
    start = time.perf_counter()
    analytical, peaks = starting_predictor(engine)
    refit = OnlineRefit.fitted_to_prior(engine, analytical.predict_features)
    how = f"derived from the roofline ({peaks}; {time.perf_counter() - start:.1f} s)"
    if cache_dir is not None:          # the next start loads it (refined, once steps ran)
        path = cache_dirs.save_predictor(engine, cache_dir, refit.predictor, derived=how)
        how += f", saved to {path}"
    return refit, how


def by_queued_work(replicas: Sequence, candidates: Sequence[int]) -> list[int]:
    """The healthy replicas among `candidates` (indices into `replicas`, each with a
    `loop`), the least predicted seconds of queued work first (ties: the lower index)."""
    return sorted((i for i in candidates if replicas[i].loop.healthy),
                  key=lambda i: (replicas[i].loop.load[2], i))


def by_freeness(replicas: Sequence, candidates: Sequence[int]) -> list[int]:
    """Tetris's decode routing (seed 001, section 5.2): the healthy replicas among
    `candidates`, the freest first: free KV pages per running request, an idle replica
    first (ties: the lower index). Pages reserved for requests still on their way count as
    used (Llumnix's virtual usage): the allocator holds them for the reservation."""
    def freeness(i: int) -> float:
        running = replicas[i].loop.load[1]
        return math.inf if running == 0 else replicas[i].loop.free_pages / running
    return sorted((i for i in candidates if replicas[i].loop.healthy),
                  key=lambda i: (-freeness(i), i))


def handed_off_request(request: Request, generated: Sequence[int]) -> Request:
    """`request` to decode on another replica after its prefill (serving.kv_transfer):
    as `resumed_request`, but no preemption: its prompt's pages come with it."""
    handed = resumed_request(request, generated)
    handed.num_preemptions = request.num_preemptions
    return handed


def resumed_request(request: Request, generated: Sequence[int]) -> Request:
    """`request` to be re-run on another replica, with the tokens its caller has received
    (`generated`) as its output so far: that replica recomputes prompt + output as after a
    preemption and samples on from output token len(generated). An unseeded request takes
    the seed it drew, so it samples what it would have sampled."""
    from medha_jax.engine.step_inputs import request_seed

    sampling = request.sampling
    if sampling.seed is None and sampling.temperature > 0:
        sampling = dataclasses.replace(sampling, seed=request_seed(request))
    resumed = Request(request_id=request.request_id, prompt_len=request.prompt_len,
                      max_new_tokens=request.max_new_tokens,
                      arrival_time=request.arrival_time, slo=request.slo,
                      priority=request.priority,
                      prompt_token_ids=(None if request.prompt_token_ids is None
                                        else list(request.prompt_token_ids)),
                      sampling=sampling,
                      session_id=request.session_id)
    resumed.output_token_ids = list(generated)
    resumed.num_preemptions = request.num_preemptions + 1     # recomputed from its tokens
    resumed.first_scheduled_time = request.first_scheduled_time
    if generated:
        resumed.first_token_time = request.first_token_time
        resumed.last_token_time = request.last_token_time
    return resumed


class ReplicaSet:
    """The replicas behind one router. Thread-safe: callers place requests from any thread
    while the loop threads feed the prefix index and hand over a failed replica's requests.

    max_failovers: how many times one request may move off a failed replica (default: one
    less than the replicas, so a request that breaks every replica it lands on cannot take
    them all down).

    roles: each replica's role (serving.kv_transfer.parse_roles: mixed, prefill, decode).
    offload: when a request's decode leaves the replica that prefills it
    (medha_jax.cluster.offload; default: never with only mixed replicas); disagg: the
    hand-off's timeouts (serving.kv_transfer.DisaggConfig). With a prefill or decode role
    or an offload gate other than "never", `transfers` moves the KV between replicas."""

    def __init__(self, replicas: Sequence[LocalReplica], routing: RoutingConfig, *,
                 metrics=None, max_failovers: int | None = None, roles=None,
                 offload: OffloadConfig | None = None, disagg=None):
        from serving.kv_transfer import DECODE, MIXED, PREFILL, DisaggConfig, KVTransfers, parse_roles

        self.replicas = list(replicas)
        self.page_size = self.replicas[0].engine.allocator.page_size
        self.metrics = metrics
        self.max_failovers = (len(self.replicas) - 1 if max_failovers is None
                              else max_failovers)
        self._lock = threading.Lock()
        self.router = Router(len(self.replicas), self._statuses, routing)
        self._down: set[int] = set()
        self._exclude: frozenset[int] = frozenset()  # under _lock, for one decision
        self.roles = parse_roles(roles, len(self.replicas))
        self.offload = offload or OffloadConfig("never")
        if self.offload.move_decodes:
            raise ValueError("OffloadConfig.move_decodes moves running decodes between Ray "
                             "replica actors only (Server(..., cluster='ray'))")
        # The latest requests' (request id, router Decision) and (request id,
        # OffloadDecision): what was predicted for each, beside what it measured.
        self.routing_decisions: collections.deque = collections.deque(maxlen=10_000)
        self.offload_decisions: collections.deque = collections.deque(maxlen=10_000)
        self._decode_only = frozenset(i for i, r in enumerate(self.roles) if r == DECODE)
        self._prefill_only = frozenset(i for i, r in enumerate(self.roles) if r == PREFILL)
        self.transfers = None
        if self.roles != (MIXED,) * len(self.replicas) or self.offload.gate != "never":
            self.transfers = KVTransfers(self, disagg or DisaggConfig())
        for replica, role in zip(self.replicas, self.roles):
            replica.role = role
            if self.transfers is not None:
                replica.loop.publishes_decode_contexts = True   # offload_decision reads them
                index = replica.index
                replica.loop.on_prefilled = (
                    lambda stream, i=index: self.transfers.on_prefilled(i, stream))
                replica.step_hooks.append(lambda i=index: self._after_step(i))
        for replica in self.replicas:
            replica.engine.allocator.on_cache_change = self._listener(replica.index)
            # Before any request (the loop has not touched it): its orphans are followed
            # from here on, so the index bisects this replica's pages.
            replica.engine.allocator.restate_cache()
            replica.loop.on_down = self._take_over
            if metrics is not None:
                metrics.observe_health(replica.index, True)

    def place(self, prompt_ids: Sequence[int], session_id: str | None,
              max_new_tokens: int, ttft_s: float, *, exclude: int | None = None
              ) -> tuple[int, float]:
        """Chooses the replica of a request: (its index, seconds the decision took).
        ttft_s: its TTFT SLO; exclude: a replica not to choose (the one a request is
        moving off)."""
        decision, seconds, _ = self._route(prompt_ids, session_id, max_new_tokens, ttft_s,
                                           exclude)
        return decision.replica, seconds

    def _route(self, prompt_ids, session_id, max_new_tokens, ttft_s, exclude=None):
        """(router Decision, its seconds, the prompt's page hashes). Decode-only replicas
        prefill only when no other replica is healthy."""
        hashes = tuple(prefix_page_hashes(prompt_ids, self.page_size))
        excluded = {exclude} if exclude is not None else set()
        if self._decode_only:
            others = [i for i, r in enumerate(self.replicas) if r.loop.healthy
                      and i not in self._decode_only and i not in excluded]
            if others:
                excluded |= self._decode_only
        with self._lock:
            self._exclude = frozenset(excluded)
            try:
                decision = self.router.route(RouteRequest(len(prompt_ids), hashes, session_id,
                                                          max_new_tokens, ttft_s))
            finally:
                self._exclude = frozenset()
            return decision, self.router.decision_seconds[-1], hashes

    def offload_decision(self, prefill: int, prompt_len: int, cached_tokens: int,
                         ttft_s: float, max_new_tokens: int, hashes: Sequence[bytes]):
        """medha_jax.cluster.offload.choose_decode on the replicas as they are now (ttft_s:
        the router's predicted TTFT on `prefill`)."""
        cached_pages = self.router.index.cached_pages(tuple(hashes))
        from serving.kv_transfer import page_bytes

        request = OffloadRequest(prompt_len, cached_tokens, max_new_tokens,
                                 self.replicas[prefill].prefill_s(prompt_len, cached_tokens),
                                 ttft_s,
                                 -(-prompt_len // self.page_size),
                                 page_bytes(self.replicas[prefill].engine))
        views = []
        for i, r in enumerate(self.replicas):
            decodes = r.loop.decode_contexts + self.transfers.incoming_contexts(i)
            views.append(OffloadReplica(
                can_decode=r.loop.healthy, prefill_only=i in self._prefill_only,
                queued_prefill_s=r.loop.queued_prefills.work_s,
                chunk_step_s=r.chunk_step_s,
                decode_token_s=r.decode_token_s, cached_pages=cached_pages[i],
                prefill_share=r.prefill_share,
                decode_step_s=decode_step_seconds(r.predictor, decodes + (prompt_len,)),
                decodes=len(decodes),
                decode_base_step_s=decode_step_seconds(r.predictor, decodes),
                max_seqs=r.max_seqs))
        return choose_decode(request, prefill, views, self.offload)

    def decode_target(self, prefill: int, exclude=frozenset()) -> int | None:
        """Another replica to decode a request prefilled on `prefill` (its pages re-homed
        after a decode replica failed): the healthy decoder with the least queued work."""
        order = by_queued_work(self.replicas, [i for i in range(len(self.replicas))
                                               if i not in self._prefill_only
                                               and i not in exclude])
        return order[0] if order else None

    def _after_step(self, replica: int) -> None:
        transfers = self.transfers
        transfers.after_step(replica)
        transfers.after_decode_step(replica)

    def submit(self, stream_for, prompt_ids: Sequence[int], session_id: str | None,
               max_new_tokens: int, ttft_s: float):
        """Places a new request (its TTFT SLO ttft_s) and adds it to its replica's loop:
        `stream_for(replica)` gives its (stream, held streams). A replica that went down in
        between is skipped; raises NoHealthyReplica when none is left. Returns (replica,
        streams)."""
        for _ in range(len(self.replicas)):
            decision, decision_s, hashes = self._route(prompt_ids, session_id, max_new_tokens,
                                                       ttft_s)
            replica = decision.replica
            if self.metrics is not None:
                self.metrics.observe_routed(replica, decision_s)
            stream, held = stream_for(replica)
            self.routing_decisions.append((stream.request_id, decision))
            prefill_s = self.replicas[replica].prefill_s(len(prompt_ids), decision.cached_tokens)
            decode = None
            if self.transfers is not None and not held:
                offload = self.offload_decision(replica, len(prompt_ids),
                                                decision.cached_tokens,
                                                decision.predicted_ttft_s, max_new_tokens, hashes)
                self.offload_decisions.append((stream.request_id, offload))
                decode = offload.decode
            try:
                if decode is not None:
                    self.transfers.begin(stream, replica, decode,
                                         start_now=replica not in self._prefill_only,
                                         prefill_s=prefill_s)
                    return replica, (stream,)
                self.replicas[replica].loop.add(stream, held=held, prefill_s=prefill_s)
                return replica, (stream, *held)
            except RuntimeError:
                if self.replicas[replica].loop.closing:
                    raise                       # the server is closing
                self._mark_down(replica)
        raise NoHealthyReplica("every replica went down while placing the request")

    def _take_over(self, loop: ServingLoop, streams: list[RequestStream], reason: str) -> None:
        """The loop's on_down: a replica gave up requests (a failed step's, or all of them
        when it went down); each is re-run elsewhere or ends as unavailable."""
        if loop.down_reason is not None:
            self._mark_down(loop.replica)
            if self.transfers is not None:
                self.transfers.replica_down(loop.replica)
        for stream in streams:
            if self.transfers is not None and self.transfers.take_back(stream, loop.replica):
                continue                  # its pages go to another decode replica
            if self.metrics is not None:
                self.metrics.observe_failover(loop.replica)
            self._rerun(stream, reason)

    def rerun(self, stream: RequestStream, reason: str, colocated: int | None = None) -> None:
        """A hand-off given up (serving.kv_transfer): the request is served on `colocated`
        when that replica is healthy (prefill and decode there), else re-run elsewhere."""
        if colocated is not None and self.replicas[colocated].loop.healthy:
            try:
                self.replicas[colocated].loop.add(stream)
                return
            except RuntimeError:
                pass
        self._rerun(stream, reason)

    def end_stream(self, stream: RequestStream, reason: str) -> None:
        """Ends a stream held by no loop (a hand-off between replicas) for its caller."""
        self._end(stream, FinishReason(reason))

    def _rerun(self, stream: RequestStream, reason: str) -> None:
        generated = stream.generated
        request = stream.request
        if len(generated) >= request.max_new_tokens:
            # Its last token had come before the replica failed; only the end was lost.
            self._end(stream, FinishReason.LENGTH)
            return
        if stream.failovers >= self.max_failovers:
            self._end(stream, FinishReason.ERROR, f"unavailable: {reason}; the request "
                      f"already moved off {stream.failovers} failed replica(s)", True)
            return
        stream.failovers += 1
        source = stream.replica
        tokens = list(request.prompt_token_ids) + list(generated)
        resumed = resumed_request(request, generated)
        for _ in range(len(self.replicas)):
            try:
                replica, decision_s = self.place(tokens, request.session_id,
                                                 request.max_new_tokens - len(generated),
                                                 request.slo.ttft_s, exclude=source)
            except NoHealthyReplica as e:
                self._end(stream, FinishReason.ERROR, f"unavailable: {reason}; {e}", True)
                return
            stream.resume(resumed, replica)
            try:
                self.replicas[replica].loop.add(stream)
            except RuntimeError:                # went down or is closing meanwhile
                if self.replicas[replica].loop.closing:
                    break
                self._mark_down(replica)
                continue
            if self.metrics is not None:
                self.metrics.observe_routed(replica, decision_s)
            logger.warning("request %s re-run on replica %d from %d streamed tokens (%s)",
                           stream.request_id, replica, len(generated), reason)
            return
        self._end(stream, FinishReason.ERROR,
                  f"unavailable: {reason}; no replica could take the request over", True)

    def _end(self, stream: RequestStream, reason: FinishReason, error: str | None = None,
             unavailable: bool = False) -> None:
        metrics = stream.finish(reason, error, unavailable=unavailable)
        if self.metrics is not None:
            self.metrics.observe_finished(metrics, reason.value)

    def _mark_down(self, replica: int) -> None:
        with self._lock:
            if replica in self._down or self.replicas[replica].loop.healthy:
                return
            self._down.add(replica)
            self.router.replica_down(replica)
        if self.metrics is not None:
            self.metrics.observe_health(replica, False)

    def _statuses(self) -> list[ReplicaStatus]:
        statuses = []
        for replica in self.replicas:
            waiting, running, _ = replica.loop.load
            decodes = replica.loop.num_decoding
            if self.transfers is not None and self.router.config.decode_delay_weight:
                # (a pass over the hand-offs under their lock: only where it is priced)
                decodes += len(self.transfers.incoming_contexts(replica.index))
            statuses.append(ReplicaStatus(
                prefill_s=replica.prefill_s, page_size=self.page_size, num_waiting=waiting,
                num_running=running, queued_prefills=replica.loop.queued_prefills,
                decode_token_s=replica.decode_token_s, decodes=decodes,
                healthy=replica.loop.healthy and replica.index not in self._exclude,
                chunk_step_s=replica.chunk_step_s,
                **ReplicaStatus.scheduler_fields(replica.scheduler_config)))
        return statuses

    def _listener(self, replica: int):
        apply = self.router.index.listener(replica)

        def on_cache_change(stored, removed, cleared=False, orphaned=None, adopted=()):
            with self._lock:
                apply(stored, removed, cleared, orphaned, adopted)
        return on_cache_change
