"""The router: which replica serves a request. Pure Python, no JAX.

A decision is a pure function of a `RouterSnapshot` (each replica's queue and predictor,
the prefix of this prompt each one has cached, the session's replica, the load placed on
each replica lately) to a `Decision` with its predicted seconds, so the simulator, the
server and a test that states a snapshot all call the same function. `Router` keeps the
state between decisions (the prefix index, sessions, recent load, the round-robin turn)
and builds the snapshot.

Policies (`ROUTING_POLICIES`):

- `round-robin`: the next healthy replica in turn.
- `least-load`: vLLM's data-parallel rule, the lowest 4 x waiting + running.
- `sglang-cache-aware`: SGLang's published rule with the defaults its CLI gives users
  (cache_threshold 0.3, balance_abs_threshold 64, balance_rel_threshold 1.5): when the
  in-flight requests are imbalanced (max - min > 64 and max > 1.5 x min) the least loaded
  replica; otherwise the replica with the longest cached prefix if it covers more than 30%
  of the prompt, else the least loaded. SGLang matches an approximate tree of where it sent
  text; here it reads the same exact index as `predicted-time`, so the comparison is of
  the rules, not of the indexes.
- `predicted-time` (default; seed 003: the size that matters is the new tokens to
  compute): each replica is charged the prefill x of the prompt minus the prefix it has
  cached there, from that replica's own runtime predictor (its PrefillTimeCache, Medha
  Algorithm 3), + min(w, x) for each prefill queued there with w seconds left
  (`mutual_delay_s`): what the new prefill and those queued there would delay one
  another by if they shared the steps evenly - its own wait and the wait it adds to the
  others at once. Queued decodes add nothing the predictor can tell apart (seed 001's
  mixed batches); pricing their remaining tokens as a serial queue made the router move
  a session away from its cache whenever its replica had many long decodes left, and hit
  half of what the cache could give.
  The charge is not the request's predicted TTFT. That is `Decision.predicted_ttft_s`
  (`lars_ttft_s`), in the order lars-mp serves its queue: a short prefill rides ahead of a
  more urgent one whose slack covers it or that cannot finish before the short one is
  due (`AdaptivePacker.riders`), and waits for a late one to its end. It is within 2x of
  the simulated TTFT for 92% of the requests of the 16-replica Mooncake run
  (`benchmarks/cluster.py`, H200 and H100 presets; processor sharing: 72% and 69%), and
  it is what the offload decision reads (`medha_jax.cluster.offload`). Charged by it instead, the router
  chases each request's own TTFT: there TTFT p90 fell from 1.31 to 1.10 s, but in
  benchmarks/disagg.py (e), where half the sessions carry 20K-token prompts, a cached
  turn whose replica had long prefills queued ahead of it moved to a replica that had
  to recompute it, whose queue then grew for the next turns: prefix hit rate 73% -> 53%,
  TTFT p90 1.73 -> 5.8 s. The even-sharing charge counts the delay a cold prefill adds
  to the queue it joins as well as the one it suffers.
  Each replica is then charged `recompute_weight` x the prefill seconds it would spend
  on prompt tokens another replica has cached: repeated work takes steps from every
  request queued behind it there (seed 003 H2: a cold prefill cannot beat the cached
  one), and leaves the prefix cached twice. The lowest charge wins. The weight 2 is
  measured, not derived: in the simulated 16-replica Mooncake run it held 0.1-0.3 points
  more of the prefix cache than 1, at the same TTFT p90; 0 held 1-2 points less.
  Optionally (`decode_delay_weight`, default 0) each replica is also charged that weight
  x the decodes running there (and those handed to it, not yet landed) x the prompt's
  prefill seconds there: the prefill's chunks ride in those decodes' steps, each step
  grows by what its chunk computes, so every one of them waits about the prefill's
  seconds in all (a bound: a decode that ends first waits less). A TTFT alone does not
  see them: under decode offloading (`medha_jax.cluster.offload`) the replica the decodes
  had just moved to had the shortest prefill queue, so the next long prefill went there
  and slowed exactly the decodes that had moved to escape one (one run of
  benchmarks/disagg.py (g): 24 of the 35 long prefills routed within 5 s of a move).
  It is off by default because it did not pay: in the simulated 16-replica Mooncake run
  (`benchmarks/cluster.py`, H200 preset) a weight of 1 raised TTFT p90 from 1.31 to
  2.29 s and TPOT p90 from 26.3 to 28.9 ms (0.25: 1.79 s and 22.7 ms); in (g) it made
  the time gate's TPOT p90 better than co-located in one run of three, and in another
  sent every prefill to one replica and every decode to the other, where short prefills
  waited up to 10 s behind long ones (the charge assumes they share steps; lars-mp lets
  a short prefill ride beside a more urgent long one only when the long one's slack
  covers it or the short one is due first, so it waits for a late long one that ends
  before its deadline, as `lars_ttft_s` predicts).
  Optionally (`ttft_floor`) a replica's even-sharing term is at least the TTFT
  `lars_ttft_s` predicts there, so the wait of a short prefill behind late long ones is
  priced where the even-sharing charge prices it at about twice its own prefill.
  The session's previous replica is kept unless another's charge is lower by more than
  `affinity_margin` (relative) + `affinity_margin_s`; a session's first turn goes, among
  the replicas within that margin of the lowest, to the one with the least load placed on
  it lately (seed 003 H7: imbalance is decided at turn-1 placement, and a snapshot of the
  queues does not see the turns that sessions placed there will bring).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

from medha_jax.cluster.prefix_index import PrefixIndex
from medha_jax.request import SLO
from medha_jax.scheduler.config import SchedulerConfig
from medha_jax.scheduler.policies import QueuedPrefill, QueuedPrefills

ROUND_ROBIN = "round-robin"
LEAST_LOAD = "least-load"
SGLANG_CACHE_AWARE = "sglang-cache-aware"
PREDICTED_TIME = "predicted-time"
ROUTING_POLICIES = (PREDICTED_TIME, ROUND_ROBIN, LEAST_LOAD, SGLANG_CACHE_AWARE)


@dataclasses.dataclass(frozen=True)
class RouteRequest:
    """What the router reads of a request: its prompt's length and page hashes
    (`medha_jax.kv_cache.allocator.prefix_page_hashes`, at the replicas' page size), its
    session (OpenAI `user`, `X-Session-Id`), its output budget and its TTFT SLO (where
    LARS places it in a replica's queue)."""

    prompt_len: int
    page_hashes: tuple[bytes, ...] = ()
    session_id: str | None = None
    max_new_tokens: int = 0
    ttft_s: float = SLO.ttft_s


@dataclasses.dataclass(frozen=True)
class ReplicaStatus:
    """One replica as the router sees it at decision time.

    prefill_s(num_tokens, cached_tokens): predicted seconds to prefill a prompt of
      num_tokens whose first cached_tokens are cached there (its own predictor).
    queued_prefills: each request there with prefill work left, its predicted seconds of
      it, slack and whole prefill's seconds (`ReplicaController.queued_prefills`), in
      any order (a tuple of QueuedPrefill given here becomes a QueuedPrefills).
    decode_token_s: predicted seconds one decode token adds to its work (the load placed
      on it lately counts its decodes at this price).
    chunk_step_s: seconds of a step that carries prefill chunks there (0: not known).
    long_prefill_tokens, rho_max: its lars-mp packer's IsLong and long share
      (`SchedulerConfig`); long_prefill_tokens None: its scheduler lets no prefill pass
      another (not lars-mp).
    decodes: sequences decoding there, with those handed to it and not yet landed (a
      prefill's chunks slow each of them).
    """

    prefill_s: Callable[[int, int], float]
    page_size: int
    num_waiting: int = 0
    num_running: int = 0
    queued_prefills: QueuedPrefills = dataclasses.field(default_factory=QueuedPrefills)
    decode_token_s: float = 0.0
    decodes: int = 0
    healthy: bool = True
    chunk_step_s: float = 0.0
    long_prefill_tokens: int | None = SchedulerConfig.long_prefill_tokens
    rho_max: float = SchedulerConfig.rho_max

    def __post_init__(self):
        if not isinstance(self.queued_prefills, QueuedPrefills):    # tuples given
            object.__setattr__(self, "queued_prefills", QueuedPrefills.of(self.queued_prefills))

    @classmethod
    def scheduler_fields(cls, config: SchedulerConfig) -> dict:
        """The fields of a replica scheduled by `config` that say how its queue passes a
        new prefill."""
        return dict(long_prefill_tokens=config.long_prefill_tokens if config.policy == "lars-mp"
                    else None, rho_max=config.rho_max)


@dataclasses.dataclass(frozen=True)
class RouterSnapshot:
    """Everything a decision reads: per replica, its status, the prompt's cached tokens
    there and the load recently placed on it; the session's replica, if it has one; the
    round-robin turn."""

    replicas: tuple[ReplicaStatus, ...]
    cached_tokens: tuple[int, ...]
    recent_load_s: tuple[float, ...]
    session_replica: int | None = None
    round_robin_next: int = 0


@dataclasses.dataclass(frozen=True)
class Decision:
    """The replica chosen, the prompt's tokens cached there, and the predicted TTFT there
    (`lars_ttft_s`, by that replica's predictor; not what the router charged)."""

    replica: int
    cached_tokens: int
    predicted_ttft_s: float
    policy: str


@dataclasses.dataclass(frozen=True)
class RoutingConfig:
    """Knobs of the policies (SGLang's are its CLI defaults; ours are argued above)."""

    policy: str = PREDICTED_TIME
    affinity_margin: float = 0.2
    affinity_margin_s: float = 0.05
    recompute_weight: float = 2.0
    decode_delay_weight: float = 0.0
    ttft_floor: bool = False
    recent_load_halflife_s: float = 60.0
    sglang_cache_threshold: float = 0.3
    sglang_balance_abs: int = 64
    sglang_balance_rel: float = 1.5
    speculative_ttl_s: float = 2.0

    def __post_init__(self):
        if self.policy not in ROUTING_POLICIES:
            raise ValueError(f"unknown routing policy {self.policy!r}; choose one of "
                             f"{', '.join(ROUTING_POLICIES)}")
        for name in ("affinity_margin", "affinity_margin_s", "recompute_weight",
                     "decode_delay_weight", "sglang_cache_threshold", "speculative_ttl_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"RoutingConfig.{name} must be >= 0, got {getattr(self, name)!r}")
        if not self.recent_load_halflife_s > 0:
            raise ValueError(f"RoutingConfig.recent_load_halflife_s must be > 0, got "
                             f"{self.recent_load_halflife_s!r}")


class NoHealthyReplica(RuntimeError):
    """Every replica is down: the request cannot be placed (gRPC UNAVAILABLE, HTTP 503)."""


# ----------------------------------------------------------------------------- decisions


def decide(request: RouteRequest, snapshot: RouterSnapshot,
           config: RoutingConfig = RoutingConfig()) -> Decision:
    """The routing decision: a pure function of the request and the snapshot."""
    healthy = [i for i, r in enumerate(snapshot.replicas) if r.healthy]
    if not healthy:
        raise NoHealthyReplica(f"none of the {len(snapshot.replicas)} replicas is healthy")
    policy = config.policy
    if policy == ROUND_ROBIN:
        n = len(snapshot.replicas)
        choice = min(healthy, key=lambda i: (i - snapshot.round_robin_next) % n)
    elif policy == LEAST_LOAD:
        choice = min(healthy, key=lambda i: (_vllm_load(snapshot.replicas[i]), i))
    elif policy == SGLANG_CACHE_AWARE:
        choice = _sglang_cache_aware(request, snapshot, healthy, config)
    else:
        choice = _predicted_time(request, snapshot, healthy, config)
    return Decision(choice, snapshot.cached_tokens[choice],
                    predicted_ttft_s(request, snapshot, choice), policy)


def predicted_ttft_s(request: RouteRequest, snapshot: RouterSnapshot, replica: int) -> float:
    """The request's predicted TTFT on that replica (`lars_ttft_s`)."""
    status = snapshot.replicas[replica]
    return lars_ttft_s(status, status.prefill_s(request.prompt_len,
                                                snapshot.cached_tokens[replica]), request)


def lars_ttft_s(status: ReplicaStatus, prefill_s: float, request: RouteRequest) -> float:
    """Predicted TTFT of a new prefill of prefill_s seconds (x) with TTFT SLO d on a
    replica whose lars-mp queue is `status.queued_prefills`: the queued work lars-mp runs
    before it, + x, in steps of status.chunk_step_s (T).

    Order (`AdaptivePacker.pack` and `riders`). LARS divides a slack by w_total, the whole
    prompt's prefill seconds, cached prefix included (`ReplicaController.add_request`), and
    its w(t) is w_total too until the request first runs and finds its cached prefix: the
    new one's key is (d - w_total) / w_total. The queued prefills q, by LARS key now:
      ranked above it: each takes the head in turn, once the wait before it has passed
        (its slack less that wait: a queued prefill's slack falls as time passes). The
        short ones ranked between it and the new one ride beside it first, in key order,
        as far as its slack covers them (those with more work left than q right after
        it). The new one then passes it when the new one may ride (it is not long,
        IsLong) and what is left of q's slack covers x (where x is not less than q's
        work left, right after q and those riders), or the new
        one is due before q could finish (beside a long q a due rider gets rho_max of
        each step, so q runs (1 - rho_max) / rho_max x meanwhile); else q runs first
        until the new one's key, falling at 1 / w_total a second while q's holds (a
        running prefill's slack does not change), reaches q's: min(w_q, w_total (key -
        key_q));
      ranked below it, once it is the head: they ride ahead of it (in key order) if short
        and the new one's slack covers them (one with x or more left right after it
        instead), or if due before the new one would finish.
    Steps: the first token comes at the end of a step; a busy replica is T/2 into its
    current one, on average; and the step of the new one's last chunk is filled to T by
    the queued work, where there is that much (a rider shares the step of the prefill it
    rides beside).
    An approximation of the order, not of every step: each q ranked above is taken as the
    batch's head in turn, and prefills that arrive later are not foreseen (under load they
    ride in the new one's slack: its TTFT then nears d)."""
    x = max(prefill_s, 1e-9)
    d = request.ttft_s
    long_tokens = status.long_prefill_tokens
    if long_tokens is None:               # no riders: the processor-sharing bound
        wait = mutual_delay_s(status, x) - x
    else:
        total = max(status.prefill_s(request.prompt_len, 0), x)
        wait = _lars_wait_s(status.queued_prefills, x, total, d,
                            request.prompt_len <= long_tokens, long_tokens, status.rho_max)
    step = status.chunk_step_s
    if step <= 0:
        return wait + x
    busy = status.num_waiting + status.num_running > 0
    queued = status.queued_prefills.work_s
    return (step / 2 if busy else 0.0) + max(wait + x, min(step, x + queued))


def mutual_delay_s(status: ReplicaStatus, prefill_s: float) -> float:
    """prefill_s + min(w, prefill_s) for each prefill queued there with w seconds left:
    what a prefill of prefill_s seconds and those queued there would delay one another by
    if they shared the steps evenly (the router's charge; see the module's docstring)."""
    return prefill_s + status.queued_prefills.capped_work_s(prefill_s)


def _lars_wait_s(queued: Sequence[QueuedPrefill], x: float, total: float, d: float,
                 rides: bool, long_tokens: int, rho_max: float) -> float:
    """The queued prefill seconds lars-mp runs before a new one of x seconds (its whole
    prompt's: total; see lars_ttft_s). The prefills ranked above it take the head in key
    order, `wait` seconds from now; the short ones ranked between a head and the new one
    ride beside that head first, in its slack."""
    key = (d - total) / total
    ahead, below = [], []
    for q in queued:
        q_key = q.slack_s / q.total_s if q.total_s > 0 else q.slack_s
        (ahead if q_key < key else below).append((q_key, q))
    ahead.sort(key=lambda kq: kq[0])
    due_share = (1 - rho_max) / rho_max if rho_max > 0 else math.inf
    # The riders of a head are the first short ones after it that fit in its spare slack,
    # in key order. Two bounds keep finding them near linear in the queue, where a plain
    # scan from every head was quadratic (65 ms at 1,000 queued, per replica per route):
    # least[j] is the least work of a short prefill at j or later, served ones included,
    # so a scan stops where its spare falls below it; and after[j] leads past the served
    # and the long ones to an open short one at or after j (path-halving pointers).
    n = len(ahead)
    least = [math.inf] * (n + 1)
    after = list(range(n + 1))
    for j in range(n - 1, -1, -1):
        r = ahead[j][1]
        if r.prompt_len <= long_tokens:
            least[j] = min(least[j + 1], r.work_s)
        else:
            least[j], after[j] = least[j + 1], j + 1

    def open_short(j: int) -> int:
        while after[j] != j:
            after[j] = after[after[j]]
            j = after[j]
        return j

    served = [False] * n
    wait = 0.0
    for i, (_, q) in enumerate(ahead):
        if served[i]:
            continue
        slack = q.slack_s - wait           # it waited too (a running prefill's would hold)
        # Riders with less work left than q go before it, the others right after it.
        spare, riders, riders_after = max(0.0, slack), 0.0, 0.0
        j = open_short(i + 1)
        while j < n and spare >= least[j]:
            r = ahead[j][1]
            if r.work_s <= spare:
                spare -= r.work_s
                if r.work_s < q.work_s:
                    riders += r.work_s
                else:
                    riders_after += r.work_s
                served[j] = True
                after[j] = j + 1
            j = open_short(j + 1)
        if rides and x <= spare:
            after_q = x >= q.work_s and d - wait > q.work_s      # not due before q ends
            return wait + riders + (q.work_s + riders_after if after_q else 0.0)
        if rides and d - wait <= q.work_s:
            return wait + riders + (min(q.work_s, x * due_share)
                                    if q.prompt_len > long_tokens else 0.0)
        wait += riders + riders_after
        q_key = (slack - riders) / q.total_s if q.total_s > 0 else slack - riders
        new_key = key - wait / total
        if q_key < new_key:                # q runs until the new one's key reaches q's
            wait += min(q.work_s, total * (new_key - q_key))
    below = [kq for kq in below if kq[1].prompt_len <= long_tokens]
    below.sort(key=lambda kq: kq[0])
    spare = d - x - wait
    for _, q in below:
        if q.work_s <= spare:
            spare -= q.work_s
            # One with x or more left goes right after the new one, unless due before.
            wait += q.work_s if q.work_s < x or q.slack_s + q.work_s <= wait + x else 0.0
        elif q.slack_s + q.work_s <= wait + x:
            wait += q.work_s
    return wait


def _vllm_load(status: ReplicaStatus) -> int:
    return 4 * status.num_waiting + status.num_running


def _sglang_cache_aware(request: RouteRequest, snapshot: RouterSnapshot, healthy: list[int],
                        config: RoutingConfig) -> int:
    load = {i: snapshot.replicas[i].num_waiting + snapshot.replicas[i].num_running
            for i in healthy}
    least_loaded = min(healthy, key=lambda i: (load[i], i))
    most, fewest = max(load.values()), min(load.values())
    if most - fewest > config.sglang_balance_abs and most > config.sglang_balance_rel * fewest:
        return least_loaded
    best = max(healthy, key=lambda i: (snapshot.cached_tokens[i], -load[i], -i))
    match_rate = snapshot.cached_tokens[best] / max(request.prompt_len, 1)
    return best if match_rate > config.sglang_cache_threshold else least_loaded


def _predicted_time(request: RouteRequest, snapshot: RouterSnapshot, healthy: list[int],
                    config: RoutingConfig) -> int:
    most_cached = max(snapshot.cached_tokens[i] for i in healthy)
    charge = {}
    for i in healthy:
        status = snapshot.replicas[i]
        prefill = status.prefill_s(request.prompt_len, snapshot.cached_tokens[i])
        recompute = prefill - status.prefill_s(request.prompt_len, most_cached)
        shared = mutual_delay_s(status, prefill)
        if config.ttft_floor:
            shared = max(shared, lars_ttft_s(status, prefill, request))
        charge[i] = (shared
                     + config.recompute_weight * recompute
                     + config.decode_delay_weight * status.decodes * prefill)
    lowest = min(charge.values())
    within = lowest * (1 + config.affinity_margin) + config.affinity_margin_s
    session = snapshot.session_replica
    if session is not None and session in charge and charge[session] <= within:
        return session
    if session is None:
        # A session's first turn: among the near-lowest, the one with the least load placed
        # lately. Not the one with most of the prompt cached first: the charge prices what
        # the cache saves, and a replica that has served nothing yet lacks even the prefix
        # every prompt shares (a system prompt), so it would never be picked while load is
        # light.
        near = [i for i in healthy if charge[i] <= within]
        return min(near, key=lambda i: (snapshot.recent_load_s[i], charge[i], i))
    return min(healthy, key=lambda i: (charge[i], i))


# ----------------------------------------------------------------------------- router state


class Router:
    """Routes requests over `num_replicas` replicas: keeps the prefix index, the sessions'
    replicas, the load placed on each replica lately and the round-robin turn; builds
    each decision's snapshot from the replicas' statuses and calls `decide`.

    statuses(): the replicas' current `ReplicaStatus`es (the server reads its controllers;
    the simulator its simulated ones).
    """

    def __init__(self, num_replicas: int, statuses: Callable[[], Sequence[ReplicaStatus]],
                 config: RoutingConfig = RoutingConfig(), *,
                 clock: Callable[[], float] = time.monotonic):
        self.num_replicas = num_replicas
        self.config = config
        self.index = PrefixIndex(num_replicas, speculative_ttl_s=config.speculative_ttl_s,
                                 clock=clock)
        self._statuses = statuses
        self._clock = clock
        self._session_replica: dict[str, int] = {}
        self._recent_load = [0.0] * num_replicas
        self._recent_load_at = clock()
        self._round_robin_next = 0
        self.decision_seconds: list[float] = []        # wall time of each decision (bounded)

    def snapshot(self, request: RouteRequest) -> RouterSnapshot:
        statuses = tuple(self._statuses())
        if len(statuses) != self.num_replicas:
            raise ValueError(f"{len(statuses)} statuses for {self.num_replicas} replicas")
        pages = self.index.cached_pages(request.page_hashes)
        # The last prompt token is always computed (its logits sample the first token).
        cached = tuple(min(p * s.page_size, max(request.prompt_len - 1, 0))
                       for p, s in zip(pages, statuses))
        return RouterSnapshot(statuses, cached, tuple(self._decayed_load()),
                              self._session_replica.get(request.session_id)
                              if request.session_id is not None else None,
                              self._round_robin_next)

    def route(self, request: RouteRequest) -> Decision:
        """Decides and records the decision (session, speculative prefix, recent load)."""
        start = time.perf_counter()
        snapshot = self.snapshot(request)
        decision = decide(request, snapshot, self.config)
        r = decision.replica
        self._round_robin_next = (r + 1) % self.num_replicas
        if request.session_id is not None:
            self._session_replica[request.session_id] = r
        page_size = snapshot.replicas[r].page_size
        # Pages already held there need no mark: only the prompt's new tail does.
        self.index.mark_routed(r, request.page_hashes[decision.cached_tokens // page_size:])
        status = snapshot.replicas[r]
        self._recent_load[r] += (status.prefill_s(request.prompt_len, decision.cached_tokens)
                                 + request.max_new_tokens * status.decode_token_s)
        if len(self.decision_seconds) >= 100_000:
            del self.decision_seconds[:50_000]
        self.decision_seconds.append(time.perf_counter() - start)
        return decision

    def forget_session(self, session_id: str) -> None:
        self._session_replica.pop(session_id, None)

    def replica_down(self, replica: int) -> None:
        """A replica died: its cache is gone and its sessions must be placed anew."""
        self.index.forget_replica(replica)
        for sid in [s for s, r in self._session_replica.items() if r == replica]:
            del self._session_replica[sid]

    def _decayed_load(self) -> list[float]:
        now = self._clock()
        elapsed = now - self._recent_load_at
        if elapsed > 0:
            factor = math.pow(0.5, elapsed / self.config.recent_load_halflife_s)
            self._recent_load = [x * factor for x in self._recent_load]
            self._recent_load_at = now
        return self._recent_load
