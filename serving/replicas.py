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
    index, decision_seconds = placement.place(prompt_ids, session_id, max_new_tokens)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from medha_jax.cluster.router import ReplicaStatus, RouteRequest, Router, RoutingConfig
from medha_jax.kv_cache.allocator import prefix_page_hashes
from medha_jax.scheduler.predictor import decode_token_seconds
from serving.loop import ServingLoop


def device_groups(num_devices_per_replica: int, num_replicas: int,
                  devices: Sequence | None = None) -> list[list]:
    """Disjoint, contiguous groups of devices, one per replica (contiguous: on GPUs and TPUs
    neighbouring ids share the fastest links, which a replica's tp wants)."""
    import jax

    devices = list(jax.devices() if devices is None else devices)
    if not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"replicas must be an int >= 1, got {num_replicas!r}")
    needed = num_devices_per_replica * num_replicas
    if needed > len(devices):
        raise ValueError(f"{num_replicas} replicas of {num_devices_per_replica} devices each need "
                         f"{needed} devices, but {len(devices)} are visible")
    k = num_devices_per_replica
    return [devices[i * k:(i + 1) * k] for i in range(num_replicas)]


def replica_models(model, num_replicas: int, *, parallel=None, dtype: str | None = None):
    """The model loaded on the first device group and copied to the others (each device
    takes its own slices). `model`: what `load_model` takes; a loaded Model keeps its own
    mesh's axes (then `parallel` must be None)."""
    from medha_jax.model import Model, load_model
    from meshes import ParallelConfig, make_mesh

    if isinstance(model, Model):
        if parallel is not None or dtype is not None:
            raise ValueError("parallel and dtype must be None when model is a loaded Model "
                             "(it was loaded with its own)")
        parallel = model.parallel
    parallel = parallel or ParallelConfig()
    if parallel.dp != 1:
        raise ValueError(f"ParallelConfig(dp={parallel.dp}) describes one replica's mesh here; "
                         "give the number of replicas as replicas=")
    groups = device_groups(parallel.num_devices, num_replicas)
    if isinstance(model, Model):
        base = model if list(model.mesh.devices.flat) == groups[0] else model.on_mesh(
            make_mesh(parallel, groups[0]))
    else:
        base = load_model(model, dtype=dtype, mesh=make_mesh(parallel, groups[0]))
    return [base] + [base.on_mesh(make_mesh(parallel, group)) for group in groups[1:]]


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
            self.refit, self.predictor_how = _starting_refit(engine, cache_dir)
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
        self.loop = ServingLoop(self.controller, engine, metrics,
                                name=f"medha-server-loop-{index}",
                                on_step=self._refine_predictor if self.refit else None,
                                replica=index,
                                decode_token_s=self.decode_token_s if routed else None)

    def prefill_s(self, num_tokens: int, cached_tokens: int) -> float:
        """Predicted seconds to prefill num_tokens with the first cached_tokens cached
        (Medha Algorithm 3's table; read from the router's thread)."""
        prefill_time = self.controller.prefill_time_cache.prefill_time
        return prefill_time(num_tokens) - prefill_time(cached_tokens)

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


def _starting_refit(engine, cache_dir):
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
    return refit, how + ", refined online from served steps"


class ReplicaSet:
    """The replicas behind one router. Thread-safe: callers place requests from any thread
    while the loop threads feed the prefix index."""

    def __init__(self, replicas: Sequence[LocalReplica], routing: RoutingConfig):
        self.replicas = list(replicas)
        self.page_size = self.replicas[0].engine.allocator.page_size
        self._lock = threading.Lock()
        self.router = Router(len(self.replicas), self._statuses, routing)
        for replica in self.replicas:
            replica.engine.allocator.on_cache_change = self._listener(replica.index)

    def place(self, prompt_ids: Sequence[int], session_id: str | None,
              max_new_tokens: int) -> tuple[int, float]:
        """Chooses the replica of a request: (its index, seconds the decision took)."""
        hashes = tuple(prefix_page_hashes(prompt_ids, self.page_size))
        with self._lock:
            decision = self.router.route(RouteRequest(len(prompt_ids), hashes, session_id,
                                                      max_new_tokens))
            return decision.replica, self.router.decision_seconds[-1]

    def _statuses(self) -> list[ReplicaStatus]:
        statuses = []
        for replica in self.replicas:
            waiting, running, queued_work_s = replica.loop.load
            statuses.append(ReplicaStatus(
                prefill_s=replica.prefill_s, page_size=self.page_size, num_waiting=waiting,
                num_running=running, queued_work_s=queued_work_s,
                decode_token_s=replica.decode_token_s,
                healthy=replica.loop.thread.is_alive() and not replica.loop.closing))
        return statuses

    def _listener(self, replica: int):
        apply = self.router.index.listener(replica)

        def on_cache_change(stored, removed, cleared=False):
            with self._lock:
                apply(stored, removed, cleared)
        return on_cache_change
