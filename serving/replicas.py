"""Several replicas of one model in this process, on disjoint device groups, behind a router.

On one host every replica lives in this process (a TPU host's chips belong to one
process, and a GPU host needs no more): replica i is an engine on device group i (its
own mesh with the axes `parallel` gives, so dp is the number of groups), with its own KV
pool, controller and loop thread. The router (`medha_jax.cluster.router`) places each
request; it reads every replica's queue and queued predicted work, which each loop
publishes after every iteration, and the prefix index its allocator's cache events feed.

    groups = device_groups(devices_per_replica, num_replicas)   # [[replica 0's], ...]
    models = [base] + [base.on_mesh(make_mesh(parallel, g)) for g in groups[1:]]
    ...                                                           # an engine and loop each
    replicas = ReplicaSet(loops, routing, page_size=..., prefill_s=..., decode_token_s=...)
    index, decision = replicas.place(prompt_ids, session_id, max_new_tokens)
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from medha_jax.cluster.router import (Decision, ReplicaStatus, RouteRequest, Router,
                                      RoutingConfig)
from medha_jax.kv_cache.allocator import prefix_page_hashes


def device_groups(num_devices_per_replica: int, num_replicas: int,
                  devices: Sequence | None = None) -> list[list]:
    """Disjoint, contiguous groups of devices, one per replica (contiguous: on GPUs and TPUs
    neighbouring ids share the fastest links, which a replica's tp wants)."""
    import jax

    devices = list(jax.devices() if devices is None else devices)
    if num_replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {num_replicas}")
    needed = num_devices_per_replica * num_replicas
    if needed > len(devices):
        raise ValueError(f"{num_replicas} replicas of {num_devices_per_replica} devices each need "
                         f"{needed} devices, but {len(devices)} are visible")
    k = num_devices_per_replica
    return [devices[i * k:(i + 1) * k] for i in range(num_replicas)]


class ReplicaSet:
    """The replicas' loops behind one router. Thread-safe: callers place requests from any
    thread while the loop threads feed the prefix index."""

    def __init__(self, loops: Sequence, routing: RoutingConfig, *, page_size: int,
                 prefill_s: Sequence, decode_token_s: float):
        """loops: each replica's ServingLoop (engine, controller; it publishes `load`);
        prefill_s[i](num_tokens, cached_tokens): replica i's predicted prefill seconds."""
        self.loops = list(loops)
        self.page_size = page_size
        self._prefill_s = list(prefill_s)
        self._decode_token_s = decode_token_s
        self._lock = threading.Lock()
        self.router = Router(len(self.loops), self._statuses, routing)
        for i, loop in enumerate(self.loops):
            loop.engine.allocator.on_cache_change = self._listener(i)

    def __len__(self) -> int:
        return len(self.loops)

    def place(self, prompt_ids: Sequence[int], session_id: str | None,
              max_new_tokens: int) -> tuple[int, Decision]:
        """Chooses the replica of a request: (its index, the router's decision)."""
        hashes = tuple(prefix_page_hashes(prompt_ids, self.page_size))
        with self._lock:
            decision = self.router.route(RouteRequest(len(prompt_ids), hashes, session_id,
                                                      max_new_tokens))
        return decision.replica, decision

    def _statuses(self) -> list[ReplicaStatus]:
        statuses = []
        for i, loop in enumerate(self.loops):
            waiting, running, queued_work_s = loop.load
            statuses.append(ReplicaStatus(
                prefill_s=self._prefill_s[i], page_size=self.page_size, num_waiting=waiting,
                num_running=running, queued_work_s=queued_work_s,
                decode_token_s=self._decode_token_s, healthy=not loop.closing))
        return statuses

    def _listener(self, replica: int):
        apply = self.router.index.listener(replica)

        def on_cache_change(stored, removed, cleared=False):
            with self._lock:
                apply(stored, removed, cleared)
        return on_cache_change

    def decision_seconds(self) -> list[float]:
        with self._lock:
            return list(self.router.decision_seconds)

