"""Prometheus metrics of one Server: latencies, batch sizes, KV pages, preemptions, outcomes.

What a load-balancing gateway reads to pick a replica (as it reads vLLM's
gpu_cache_usage_perc, num_requests_running and num_requests_waiting):
    medha_kv_cache_usage_ratio   KV-cache pages held by requests / all pages, in [0, 1]
    medha_requests_running       requests holding KV pages
    medha_requests_waiting       requests queued without pages (new or preempted)
They are updated after every step, admission and finish, so they are at most one
iteration old.

Every Server owns its own CollectorRegistry (no process-global state), so two servers in
one process, or the tests, never mix their numbers. The same registry is served over HTTP
(optional `metrics_port`) and returned as text by the gRPC Metrics RPC. The one process-wide
family is medha_gc_pause_seconds{generation}: Python's garbage-collector pauses (every
thread stops for them), counted from when the server was made.
"""

from __future__ import annotations

import bisect
import gc
import threading
import time

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import HistogramMetricFamily

from serving.outputs import RequestMetrics

# Seconds: from a fast CPU decode step (ms) to a convoy stuck behind a long prefill (minutes).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 25.0, 60.0, 120.0, 300.0)
# Tokens per step: powers of two, the shape of the engine's bucket ladder.
BATCH_TOKEN_BUCKETS = tuple(float(2 ** i) for i in range(17))
# Seconds: a young generation's collection (~0.2 ms) to a full one of an unfrozen heap (0.5 s).
GC_PAUSE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                    0.25, 0.5, 1.0, 2.5)


class GcPauses:
    """Python's garbage-collector pauses, per generation, as a Prometheus collector.

    A gc callback times each collection. It only adds to plain numbers and takes no lock: a
    collection can start inside any allocation, also one made while this registry is read
    under its metrics' locks. Collections never overlap (the collector holds the GIL)."""

    def __init__(self):
        self._started: float | None = None
        self._buckets = [[0] * (len(GC_PAUSE_BUCKETS) + 1) for _ in range(3)]
        self._sums = [0.0] * 3
        gc.callbacks.append(self._time)

    def _time(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            seconds = time.perf_counter() - self._started
            self._started = None
            generation = min(info["generation"], 2)    # a later numbering counts as the oldest
            self._buckets[generation][bisect.bisect_left(GC_PAUSE_BUCKETS, seconds)] += 1
            self._sums[generation] += seconds

    def collect(self):
        family = HistogramMetricFamily(
            "medha_gc_pause_seconds", "Python garbage-collector pauses (every thread stops), "
            "by generation; the process's, since this server was made.",
            labels=["generation"])
        for generation in range(3):
            counts = list(self._buckets[generation])        # a snapshot
            cumulative = [sum(counts[:i + 1]) for i in range(len(counts))]
            bounds = [repr(b) for b in GC_PAUSE_BUCKETS] + ["+Inf"]
            family.add_metric([str(generation)], list(zip(bounds, cumulative)),
                              self._sums[generation])
        yield family

    def close(self) -> None:
        if self._time in gc.callbacks:
            gc.callbacks.remove(self._time)


class ServerMetrics:
    """The metric families; the server's loop thread updates them, any thread reads them."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("medha_ttft_seconds", "Time to first token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("medha_tpot_seconds", "Time per output token after the first.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("medha_queue_time_seconds",
                                    "Arrival to first scheduled chunk.",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.step_time = Histogram("medha_step_seconds", "Duration of one engine step.",
                                   buckets=LATENCY_BUCKETS, registry=r)
        self.batch_tokens = Histogram("medha_batch_tokens", "Tokens processed in one step.",
                                      buckets=BATCH_TOKEN_BUCKETS, registry=r)
        self.kv_pages_in_use = Gauge("medha_kv_pages_in_use", "KV-cache pages held by requests.",
                                     registry=r)
        self.kv_cache_usage = Gauge(
            "medha_kv_cache_usage_ratio",
            "Fraction of the KV cache's pages held by requests (0 to 1); cached prefixes "
            "that can be evicted count as free.", registry=r)
        self.kv_pages_total = Gauge("medha_kv_pages_total", "KV-cache pages in the pool.",
                                    registry=r)
        self.requests_waiting = Gauge("medha_requests_waiting", "Requests queued (no KV pages).",
                                      registry=r)
        self.requests_running = Gauge("medha_requests_running",
                                      "Requests holding KV pages (prefilling or decoding).",
                                      registry=r)
        self.preemptions = Counter("medha_preemptions", "Requests preempted (recomputed later).",
                                   registry=r)
        self.requests_finished = Counter("medha_requests_finished", "Finished requests.",
                                         ["finish_reason"], registry=r)
        self.requests_rejected = Counter(
            "medha_requests_rejected", "Requests refused at submit time (bad input, too large).",
            registry=r)
        self.prompt_tokens = Counter("medha_prompt_tokens", "Prompt tokens of finished requests.",
                                     registry=r)
        self.generated_tokens = Counter("medha_generated_tokens", "Output tokens generated.",
                                        registry=r)
        # Per replica (a Server may run several, serving.replicas): the same state by
        # replica, and what the router sent where; the unlabelled gauges above are totals.
        self.replica_requests_running = Gauge(
            "medha_replica_requests_running", "Requests holding KV pages, per replica.",
            ["replica"], registry=r)
        self.replica_requests_waiting = Gauge(
            "medha_replica_requests_waiting", "Requests queued, per replica.", ["replica"],
            registry=r)
        self.replica_kv_cache_usage = Gauge(
            "medha_replica_kv_cache_usage_ratio", "KV-cache usage (0 to 1), per replica.",
            ["replica"], registry=r)
        self.replica_requests = Counter(
            "medha_replica_requests", "Requests the router placed on each replica.",
            ["replica"], registry=r)
        self.replica_cached_tokens = Counter(
            "medha_replica_cached_tokens",
            "Prompt tokens taken from the prefix cache, per replica (finished requests).",
            ["replica"], registry=r)
        self.replica_healthy = Gauge(
            "medha_replica_healthy", "1 while the replica serves, 0 once it is down "
            "(its steps kept failing or its loop died).", ["replica"], registry=r)
        self.replica_failovers = Counter(
            "medha_replica_failovers", "Requests moved off a failed replica, by the replica "
            "they left (re-run elsewhere, or failed as unavailable).", ["replica"], registry=r)
        self.router_decision_time = Histogram(
            "medha_router_decision_seconds", "Time the router took to place one request.",
            buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2),
            registry=r)
        # DP <-> TP switching (serving.switching), when the server switches.
        self.switching_mode_changes = Counter(
            "medha_switching_mode_changes", "TP groups bound (kind=bind) and released "
            "(kind=release) by the switching coordinator.", ["kind"], registry=r)
        self.switching_requests = Counter(
            "medha_switching_requests", "Requests placed per mode (dp, tp2, tp4, ...).",
            ["mode"], registry=r)
        self.switching_latency = Histogram(
            "medha_switching_latency_seconds",
            "From a switch's decision to its TP group's first step dispatched.",
            buckets=LATENCY_BUCKETS, registry=r)
        # The CDSP prefill pool (serving.prefill_pool), when the server has one.
        self.prefill_pool_requests = Counter(
            "medha_prefill_pool_requests", "Requests leaving the prefill pool: prefilled "
            "(to a replica with the pool's pages), replica (prefilled there instead: it did "
            "not fit the pool, or the pool's step failed), cancelled, failed.", ["outcome"],
            registry=r)
        self.prefill_pool_waiting = Gauge(
            "medha_prefill_pool_waiting", "Requests queued for the prefill pool's pages.",
            registry=r)
        self.prefill_pool_refusals = Counter(
            "medha_prefill_pool_refusals", "Handshakes a decode replica refused (no room for "
            "a prefill pool request's pages then, or it went down): the next one is asked.",
            registry=r)
        self.prefill_pool_improvement_rate = Gauge(
            "medha_prefill_pool_improvement_rate", "The improvement rate the prefill pool's "
            "planner takes a larger group at (seed 001's r), looked up for the arrival rate.",
            registry=r)
        self.prefill_pool_time = Histogram(
            "medha_prefill_pool_seconds", "From a request's dispatch in the prefill pool to "
            "its full pages computed.", buckets=LATENCY_BUCKETS, registry=r)
        self.gc_pauses = GcPauses()
        r.register(self.gc_pauses)
        self._switching_seen: dict[tuple[Counter, str], int] = {}
        self._replica_state: dict[int, tuple[int, int, int, int, int]] = {}
        self._state_lock = threading.Lock()
        self._preemptions_seen = 0
        self._http = None
        self._http_thread: threading.Thread | None = None

    # ---- updates, from the server's loop thread ----

    def observe_step(self, num_tokens: int, duration_s: float) -> None:
        self.batch_tokens.observe(num_tokens)
        self.step_time.observe(duration_s)

    def observe_switching(self, mode_changes: dict[str, int],
                          requests_per_mode: dict[str, int],
                          latencies_s: list[float]) -> None:
        """The switching coordinator's counts so far (totals: the counters move by what
        changed since the last call) and the switch latencies measured since then."""
        for counter, totals in ((self.switching_mode_changes, mode_changes),
                                (self.switching_requests, requests_per_mode)):
            for label, total in totals.items():
                seen = self._switching_seen.get((counter, label), 0)
                if total > seen:
                    counter.labels(label).inc(total - seen)
                    self._switching_seen[(counter, label)] = total
        for seconds in latencies_s:
            self.switching_latency.observe(seconds)

    def observe_state(self, *, pages_in_use: int, pages_total: int, waiting: int,
                      running: int, preemptions_total: int, replica: int = 0) -> None:
        """One replica's state (from its loop thread); the unlabelled gauges are the sums
        over the replicas."""
        label = str(replica)
        self.replica_requests_running.labels(label).set(running)
        self.replica_requests_waiting.labels(label).set(waiting)
        self.replica_kv_cache_usage.labels(label).set(
            pages_in_use / pages_total if pages_total else 0.0)
        with self._state_lock:
            self._replica_state[replica] = (pages_in_use, pages_total, waiting, running,
                                            preemptions_total)
            in_use, total, waiting, running, preemptions_total = map(
                sum, zip(*self._replica_state.values()))
            self.kv_pages_in_use.set(in_use)
            self.kv_cache_usage.set(in_use / total if total else 0.0)
            self.kv_pages_total.set(total)
            self.requests_waiting.set(waiting)
            self.requests_running.set(running)
            # The controllers keep running totals; a Counter only goes up by increments.
            if preemptions_total > self._preemptions_seen:
                self.preemptions.inc(preemptions_total - self._preemptions_seen)
                self._preemptions_seen = preemptions_total

    def observe_health(self, replica: int, healthy: bool) -> None:
        self.replica_healthy.labels(str(replica)).set(1.0 if healthy else 0.0)

    def observe_failover(self, replica: int) -> None:
        self.replica_failovers.labels(str(replica)).inc()

    def observe_routed(self, replica: int, decision_s: float) -> None:
        self.replica_requests.labels(str(replica)).inc()
        self.router_decision_time.observe(decision_s)

    def observe_finished(self, metrics: RequestMetrics, finish_reason: str) -> None:
        self.requests_finished.labels(finish_reason=finish_reason).inc()
        self.replica_cached_tokens.labels(str(metrics.replica)).inc(metrics.num_cached_tokens)
        self.prompt_tokens.inc(metrics.num_prompt_tokens)
        self.generated_tokens.inc(metrics.num_output_tokens)
        if metrics.first_token_time is not None:
            self.ttft.observe(metrics.ttft)
            self.queue_time.observe(metrics.queue_time)
            if metrics.num_output_tokens > 1:
                self.tpot.observe(metrics.tpot)

    # ---- reading ----

    def text(self) -> str:
        """The Prometheus text exposition of every metric."""
        return prometheus_client.generate_latest(self.registry).decode()

    def serve_http(self, port: int, host: str = "127.0.0.1") -> int:
        """Serves /metrics on host:port from a daemon thread; returns the bound port (0 picks)."""
        if self._http is not None:
            raise RuntimeError(f"metrics already served on port {self._http.server_port}")
        self._http, self._http_thread = prometheus_client.start_http_server(
            port, addr=host, registry=self.registry)
        return self._http.server_port

    def close(self) -> None:
        self.gc_pauses.close()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http_thread.join()
            self._http = self._http_thread = None
