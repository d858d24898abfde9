"""Priority policies, the priority index, and the scenarios of seed 000 section 4.1."""

import pickle
import random
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from medha_jax.config import ParallelConfig, model_preset
from medha_jax.kv_cache.allocator import BlockAllocator
from medha_jax.request import SLO, Request, RequestState, VirtualClock
from medha_jax.scheduler import (ReplicaController, SchedulerConfig, make_controller,
                                 run_one_step)
from medha_jax.scheduler import controller as controller_module
from medha_jax.scheduler.packer import reserve_each_decode
from medha_jax.scheduler.policies import (EDF, FCFS, LARS, LRS, SRPT, PriorityIndex,
                                         QueuedPrefill, QueuedPrefills)
from medha_jax.scheduler.in_flight import InFlightRunner
from medha_jax.scheduler.predictor import AnalyticalPredictor, batch_features
from medha_jax.simulator import SimulatedExecutor, simulate


def _request(rid, prompt_len=100, arrival=0.0, ttft=10.0, priority=0, computed=0, w_total=1.0):
    r = Request(rid, prompt_len, 4, arrival, slo=SLO(ttft_s=ttft), priority=priority)
    r.num_computed_tokens = computed
    r.w_total = w_total
    return r


def _work_per_token(seconds_per_token):
    """w(t) of a device that prefills at a fixed rate."""
    return lambda r: (r.num_tokens - r.num_computed_tokens) * seconds_per_token


def test_policy_keys_match_their_definitions():
    r = _request("a", prompt_len=1000, arrival=2.0, ttft=10.0, computed=400, w_total=5.0)
    w = _work_per_token(0.005)        # w(t) = 600 tokens x 5 ms = 3 s
    t = 4.0
    assert FCFS().priority_key(r, t) == 2.0
    assert EDF().priority_key(r, t) == 12.0
    assert LRS(w).priority_key(r, t) == pytest.approx(12.0 - 4.0 - 3.0)
    assert LARS(w).priority_key(r, t) == pytest.approx((12.0 - 4.0 - 3.0) / 5.0)
    assert SRPT(w).priority_key(r, t) == pytest.approx(3.0)


def test_lars_ranks_the_long_request_first_at_equal_slack():
    # Two requests with 2 s of slack: the one with more work has less relative slack.
    w = _work_per_token(0.001)
    short = _request("short", prompt_len=1000, ttft=3.0, w_total=1.0)       # slack 2, rho 2
    long = _request("long", prompt_len=100_000, ttft=102.0, w_total=100.0)  # slack 2, rho 0.02
    lars, lrs = LARS(w), LRS(w)
    assert lrs.priority_key(short, 0.0) == pytest.approx(lrs.priority_key(long, 0.0))
    assert lars.priority_key(long, 0.0) < lars.priority_key(short, 0.0)


@pytest.mark.parametrize("policy_name", ["fcfs", "edf", "lrs", "lars"])
def test_priority_index_top_equals_a_full_sort(policy_name):
    rng = random.Random(policy_name)
    w = _work_per_token(0.002)
    policy = {"fcfs": FCFS(), "edf": EDF(), "lrs": LRS(w), "lars": LARS(w)}[policy_name]
    # Grows past its initial capacity; keeps the controller's second order beside the first.
    srpt = SRPT(w)
    index = PriorityIndex(policy, capacity=4, secondary=srpt)
    live = {}
    for step in range(300):
        action = rng.random()
        if action < 0.6 or not live:
            n = rng.randint(10, 5000)
            r = _request(f"r{step}", prompt_len=n, arrival=rng.uniform(0, 50),
                         ttft=rng.uniform(1, 100), priority=rng.choice([0, 0, 0, 1]),
                         computed=rng.randint(0, n - 1), w_total=n * 0.002)
            index.add(r)
            live[r.request_id] = r
        elif action < 0.8:
            r = live.pop(rng.choice(sorted(live)))
            index.remove(r)
        else:
            r = live[rng.choice(sorted(live))]
            r.num_computed_tokens = rng.randint(0, r.prompt_len - 1)
            index.update(r)
        now = rng.uniform(0, 100)
        k = rng.randint(1, 20)
        for order, secondary in ((policy, False), (srpt, True)):
            if order.constant_keys:     # the index then reads offsets as keys
                assert all(order.linear_key(r)[1] == 0.0 for r in live.values())
            expected = sorted(live.values(), key=lambda r: order.sort_key(r, now))[:k]
            got = index.top(now, k, secondary=secondary)
            assert [r.priority for r in got] == [r.priority for r in expected]
            assert [order.priority_key(r, now) for r in got] == pytest.approx(
                [order.priority_key(r, now) for r in expected])
        for r in got:       # the stored key, as the controller sorts its riders by it
            assert index.sort_key(r, now) == pytest.approx(policy.sort_key(r, now))
        # The controller's candidates: the top, then riders of the secondary order beyond it
        # in the policy's order, skipping what `runnable` rejects (batches in flight).
        riders, spare = rng.randint(0, 6), rng.choice([0, 0, 3])
        blocked = set(rng.sample(sorted(live), min(spare, len(live))))
        runnable = (lambda r: r.request_id not in blocked) if spare else None
        top = [r for r in index.top(now, k + spare) if runnable is None or runnable(r)][:k]
        expected = top
        if riders and len(live) > k + spare:
            chosen = {r.request_id for r in top}
            more = [r for r in index.top(now, k + riders + spare, secondary=True)
                    if r.request_id not in chosen and (runnable is None or runnable(r))]
            expected = top + index.in_policy_order(more[:riders], now)
        got = index.candidates(now, k, riders, spare=spare, runnable=runnable)
        # Read as the packer reads: by position (ordering a part at a time), then whole.
        assert [got[j].request_id for j in range(min(2, len(expected)))] == \
            [r.request_id for r in expected[:2]]
        assert [r.request_id for r in got] == [r.request_id for r in expected]
        assert len(got) == len(expected)
        assert len(index) == len(live)


@pytest.mark.parametrize("policy_name", ["lars", "edf"])
def test_candidates_read_later_keep_the_order_they_were_made_in(policy_name):
    """The packer reads candidates while the gate moves keys (a cached prefix found at
    prepare, a preempted decode requeued): the parts ordered later must still follow the
    order of the moment the candidates were made, with no request twice or skipped."""
    rng = random.Random(7)
    w = _work_per_token(0.002)
    policy = LARS(w) if policy_name == "lars" else EDF()
    index = PriorityIndex(policy, capacity=4, secondary=SRPT(w))
    queued = []
    for i in range(200):
        n = rng.randint(10, 5000)
        r = _request(f"r{i}", prompt_len=n, arrival=rng.uniform(0, 50), ttft=rng.uniform(1, 100),
                     computed=rng.randint(0, n - 1), w_total=n * 0.002)
        index.add(r)
        queued.append(r)
    expected = [r.request_id for r in index.candidates(30.0, 16, 6)]
    assert len(expected) == 16 + 6
    got = index.candidates(30.0, 16, 6)
    assert [got[j].request_id for j in range(2)] == expected[:2]      # the first part only
    for r in rng.sample(queued, 120):       # progress moves keys, in both orders
        r.num_computed_tokens = rng.randint(0, r.prompt_len - 1)
        index.update(r)
    for i in range(20):                     # and requests join (preempted decodes)
        index.add(_request(f"late{i}", prompt_len=20, ttft=0.01, w_total=0.04))
    assert [r.request_id for r in got] == expected


def test_candidates_are_freed_when_dropped_not_left_to_the_garbage_collector():
    """Every step makes candidates and drops them: a reference cycle (the candidates and
    the generator of their parts) would keep each step's keys arrays until the collector's
    next pass, whose pauses then land inside steps."""
    import gc
    import weakref

    w = _work_per_token(0.002)
    index = PriorityIndex(LARS(w), secondary=SRPT(w))
    for i in range(200):
        index.add(_request(f"r{i}", prompt_len=10 + i, arrival=0.1 * i, w_total=0.002 * (10 + i)))
    gc.disable()
    try:
        for read in (0, 1, 40):             # not read, one part read, every part read
            candidates = index.candidates(30.0, 16, 6)
            for _ in zip(range(read), candidates):
                pass
            ref = weakref.ref(candidates)
            del candidates
            assert ref() is None, read
    finally:
        gc.enable()


def test_priority_class_comes_before_the_key():
    index = PriorityIndex(EDF())
    urgent_low_class = _request("late-class", ttft=0.1, priority=1)
    relaxed_high_class = _request("first-class", ttft=1000.0, priority=0)
    index.add(urgent_low_class)
    index.add(relaxed_high_class)
    assert [r.request_id for r in index.top(0.0, 2)] == ["first-class", "late-class"]
    with pytest.raises(ValueError, match="no secondary"):
        index.top(0.0, 2, secondary=True)


# ----------------------------------------------------------------- the example of sec. 4.1


class SideBySidePredictor:
    """A fake device for the paper's example, in its units: a lone prefill runs at
    1 ms per token (r_L: 10,000 tokens = 10 s of work; r_S: 500 tokens = 0.5 s), and
    chunks of one batch run side by side, so a batch costs its mean chunk length. This
    idealises sec. 4.2's arithmetic-intensity slack: co-batched prefills are nearly free.
    With additive costs the two short requests alone would need the device for the
    whole second before their deadline, and no online policy that waits could meet it."""

    token_buckets = None

    def predict_features(self, f):
        return 0.0 if f.seqs == 0 else 1e-3 * f.tokens / f.seqs

    def predict(self, batch):
        return self.predict_features(batch_features(batch))


def _scenario(short_stream: bool):
    requests = [Request("long", 10_000, 1, 0.0, slo=SLO(ttft_s=16.0)),
                Request("short-1", 500, 1, 5.0, slo=SLO(ttft_s=1.0)),
                Request("short-2", 500, 1, 5.0, slo=SLO(ttft_s=1.0))]
    if short_stream:    # "continuous arrivals of short requests"
        requests += [Request(f"stream-{i}", 500, 1, 5.5 + 0.5 * i, slo=SLO(ttft_s=1.0))
                     for i in range(40)]
    return requests


def _met_deadline(policy, requests):
    config = SchedulerConfig(policy, target_batch_time_s=0.1, long_prefill_tokens=5000,
                             prefill_cache_step=100)
    result = simulate(requests, scheduler=config, model=model_preset("tiny"),
                      parallel=ParallelConfig(), hardware="h100", predictor=SideBySidePredictor())
    assert all(r.state is RequestState.FINISHED for r in result.requests)
    return {r.request_id: r.first_token_time - r.arrival_time <= r.slo.ttft_s
            for r in result.requests}


def test_lars_meets_all_three_deadlines():
    met = _met_deadline("lars-mp", _scenario(short_stream=False))
    assert met == {"long": True, "short-1": True, "short-2": True}


def test_fcfs_misses_the_short_deadlines():
    met = _met_deadline("fcfs-np", _scenario(short_stream=False))
    assert met == {"long": True, "short-1": False, "short-2": False}


def test_edf_under_a_stream_of_short_requests_misses_the_long_one():
    met = _met_deadline("edf", _scenario(short_stream=True))
    assert not met["long"]
    # ... and LARS, under the same stream, does not.
    assert _met_deadline("lars-mp", _scenario(short_stream=True))["long"]


# ------------------------------------------------------------------------ no starvation


@settings(max_examples=8, deadline=None)
@given(policy=st.sampled_from(["lars", "lars-mp"]), seed=st.integers(0, 2**32 - 1),
       long_fraction=st.floats(0.0, 0.3), burst_rate=st.floats(200.0, 5000.0))
def test_overload_bursts_never_deadlock(policy, seed, long_fraction, burst_rate):
    """Overload bursts, tight deadlines and a small KV cache: every request still finishes,
    with all its tokens, and every page comes back (preemption never deadlocks)."""
    rng = random.Random(seed)
    model = model_preset("tiny")
    predictor = AnalyticalPredictor(model, ParallelConfig(), "a100")
    clock = VirtualClock()
    allocator = BlockAllocator(num_pages=160, page_size=16)      # 2,560 tokens
    config = SchedulerConfig(policy, token_buckets=(64, 128, 256, 512), max_seqs_per_batch=16,
                             target_batch_time_s=0.002, long_prefill_tokens=1000)
    controller = make_controller(config, allocator=allocator, clock=clock, predictor=predictor,
                                 model_config=model, max_model_len=2048)
    executor = SimulatedExecutor(predictor, clock)
    arrivals, t = [], 0.0
    for i in range(250):
        t += rng.expovariate(burst_rate if (i // 50) % 2 else 200.0)     # bursts and lulls
        long = rng.random() < long_fraction
        prompt = rng.randint(1000, 1900) if long else rng.randint(5, 200)
        arrivals.append(Request(
            f"r{i}", prompt, rng.randint(1, 40), t,
            slo=SLO(ttft_s=rng.uniform(0.005, 0.05), tpot_s=rng.choice([0.001, 0.01]))))
    _serve(controller, executor, arrivals)
    assert all(r.state is RequestState.FINISHED for r in arrivals)
    assert all(len(r.output_token_ids) == r.max_new_tokens for r in arrivals)
    assert allocator.num_free_pages == allocator.num_pages


def _serve(controller, executor, arrivals, max_steps=100_000):
    clock, pending = controller.clock, sorted(arrivals, key=lambda r: r.arrival_time)
    for _ in range(max_steps):
        while pending and pending[0].arrival_time <= clock.now():
            controller.add_request(pending.pop(0))
        if not controller.has_unfinished():
            if not pending:
                return
            clock.advance_to(pending[0].arrival_time)
            continue
        run_one_step(controller, executor)
    raise AssertionError(f"not done after {max_steps} steps")


class _ShortestFirst(LRS):
    """Shortest remaining work first: starves a long request while short ones keep coming."""

    name = "srpt"

    def linear_key(self, request):
        return self.remaining_work(request), 0.0


def _stream_with_a_long_request(policy, seed):
    """A long request (100K tokens, deadline 3x its lone prefill time w) arrives with a
    stream of short ones that keeps the device 80% busy for 4 w. Returns the requests."""
    from medha_jax.simulator import CountingAllocator

    model = model_preset("llama3-8b")
    predictor = AnalyticalPredictor(model, ParallelConfig(tp=8), "a100")
    clock = VirtualClock()
    kwargs = dict(allocator=CountingAllocator(20_000, 16), clock=clock, predictor=predictor,
                  model_config=model, max_model_len=100_016)
    controller = make_controller(SchedulerConfig("lars" if policy == "srpt" else policy),
                                 **kwargs)
    if policy == "srpt":        # vanilla LARS's packer (one prefill per batch), a starving order
        controller = ReplicaController(
            policy=_ShortestFirst(controller.prefill_time_cache.remaining_work),
            packer=controller.packer, prefill_time_cache=controller.prefill_time_cache,
            allocator=kwargs["allocator"], clock=clock, max_model_len=100_016)
    cache = controller.prefill_time_cache
    w_long, w_short = cache(100_000), cache(400)
    rng = random.Random(seed)
    requests, t = [Request("long", 100_000, 4, 0.0, slo=SLO(ttft_s=3 * w_long))], 0.0
    while t < 4 * w_long:
        t += rng.expovariate(0.8 / w_short)
        requests.append(Request(f"s{len(requests)}", 400, 4, t,
                                slo=SLO(ttft_s=2.5 * w_long)))
    _serve(controller, SimulatedExecutor(predictor, clock), requests)
    return requests


def _missed(requests):
    return {r.request_id for r in requests
            if r.first_token_time - r.arrival_time > r.slo.ttft_s}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("policy", ["lars", "lars-mp"])
def test_no_request_starves_under_lars(policy, seed):
    # A stream of short requests that never lets up while the long one runs: LARS gives
    # the long one enough of the device to meet its deadline, and every short one meets
    # its own. The stream outlasts the deadline, so a policy that runs the long request
    # only when no short one waits misses it (below).
    assert not _missed(_stream_with_a_long_request(policy, seed))


def test_the_starvation_test_fails_for_a_starving_policy():
    assert "long" in _missed(_stream_with_a_long_request("srpt", 0))


# ------------------------------------------- the controller's fast queue vs a plain sort

_MODEL = model_preset("tiny")
_PREDICTOR = AnalyticalPredictor(_MODEL, ParallelConfig(), "a100")


class _SortedQueue:
    """The prefill queue done the straightforward way, as a reference for PriorityIndex:
    every top() sorts every queued request by (class, the policy's key computed afresh
    from the request's state, insertion). It stores no keys, so it also checks that the
    controller tells the index of every change of a request's remaining work."""

    def __init__(self, policy, secondary):
        self.policy, self.secondary = policy, secondary
        self._queued = {}                    # request_id -> (insertion number, request)
        self._next = 0

    def __len__(self):
        return len(self._queued)

    def __contains__(self, request):
        return request.request_id in self._queued

    def add(self, request):
        assert request.request_id not in self._queued
        self._queued[request.request_id] = (self._next, request)
        self._next += 1

    def remove(self, request):
        del self._queued[request.request_id]

    def update(self, request):
        assert request.request_id in self._queued

    def sort_key(self, request, now):
        return self.policy.sort_key(request, now)

    @property
    def secondary_offsets(self):
        # Live, as the index's own dict is: the packer binds it once per batch, and a rider
        # prepared during packing may reuse a cached prefix (its w(t) falls mid-batch).
        return _FreshOffsets(self.secondary, self._queued)

    def in_policy_order(self, requests, now):
        return sorted(requests, key=lambda r: self.policy.sort_key(r, now))

    def top(self, now, k, *, secondary=False):
        policy = self.secondary if secondary else self.policy
        ranked = sorted(self._queued.values(), key=lambda e: (*policy.sort_key(e[1], now), e[0]))
        return [r for _, r in ranked[:k]]

    def candidates(self, now, k, riders, *, spare=0, runnable=None):
        top = [r for r in self.top(now, k + spare) if runnable is None or runnable(r)][:k]
        if not riders or len(self) <= k + spare:
            return top
        chosen = {r.request_id for r in top}
        more = [r for r in self.top(now, k + riders + spare, secondary=True)
                if r.request_id not in chosen and (runnable is None or runnable(r))]
        return top + self.in_policy_order(more[:riders], now)


class _FreshOffsets:
    """request_id -> the secondary policy's offset, computed afresh at every lookup."""

    def __init__(self, policy, queued):
        self.policy, self.queued = policy, queued

    def __getitem__(self, request_id):
        return self.policy.linear_key(self.queued[request_id][1])[0]


def _random_requests(rng, n, prefix_groups):
    requests = []
    for i in range(n):
        prompt = rng.choice([rng.randint(1, 60), rng.randint(60, 400), rng.randint(400, 1500)])
        ids = None
        if prefix_groups:           # shared prefixes: the prefix cache moves w(t) at prepare
            group = rng.randrange(prefix_groups)
            ids = [(group * 7 + j) % 97 if j < prompt // 2 else rng.randrange(1000)
                   for j in range(prompt)]
        requests.append(dict(
            request_id=f"r{i}", prompt_len=prompt, max_new_tokens=rng.randint(1, 6),
            arrival_time=rng.choice([0.0, rng.uniform(0, 0.05)]),
            slo=SLO(ttft_s=rng.choice([0.01, 0.05, 1.0]), tpot_s=rng.choice([0.002, 0.5])),
            priority=rng.choice([0, 0, 0, 1]), prompt_token_ids=ids))
    return requests


def _run(policy, requests, *, reference, stages, num_pages, candidates, riders):
    clock = VirtualClock()
    allocator = BlockAllocator(num_pages, 16)
    config = SchedulerConfig(policy, max_seqs_per_batch=8, token_buckets=(16, 32, 64, 128, 256),
                             target_batch_time_s=0.002, max_prefill_candidates=candidates,
                             max_rider_candidates=riders)
    controller = make_controller(config, allocator=allocator, clock=clock, predictor=_PREDICTOR,
                                 model_config=_MODEL, max_model_len=2048, pipeline_stages=stages)
    if reference:
        index = controller._prefills
        controller._prefills = _SortedQueue(index.policy, index.secondary)
    runner = InFlightRunner(controller, SimulatedExecutor(_PREDICTOR, clock, num_stages=stages))
    pending = sorted(requests, key=lambda r: r["arrival_time"])
    batches = []
    while (pending or controller.has_unfinished()) and len(batches) < 400:
        while pending and pending[0]["arrival_time"] <= clock.now():
            controller.add_request(Request(**pending.pop(0)))
        collected = runner.step()
        if collected is None:
            if not pending:
                # Stuck (on main too): with few candidates, the top prefill may not evict
                # the requests holding the cache. Both runs must get stuck alike.
                batches.append("stuck")
                break
            clock.advance_to(pending[0]["arrival_time"])
            continue
        batch = collected.batch
        batches.append(([(c.request.request_id, c.start, c.num_tokens) for c in batch.chunks],
                        batch.predicted_time_s))
    return batches, controller.num_preemptions


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1),
       policy=st.sampled_from(["fcfs", "edf", "lrs", "lars", "lars-mp"]),
       n=st.integers(1, 40), stages=st.sampled_from([1, 2]),
       num_pages=st.sampled_from([100, 160, 400]), candidates=st.integers(1, 6),
       riders=st.integers(0, 4), prefix_groups=st.sampled_from([0, 3]))
def test_controller_batches_equal_those_of_a_plain_sort_of_the_queue(
        seed, policy, n, stages, num_pages, candidates, riders, prefix_groups):
    """The PriorityIndex's shortcuts (stored keys, the threshold of the last top(), lazy
    riders), the gate's bulk decode reservation and the folded chunk pricers form exactly
    the batches a full sort of the whole queue at every step gives with decodes reserved
    one by one and every chunk priced from its features, with preemption, prefix-cache
    reuse, priority classes and batches in flight."""
    requests = _random_requests(random.Random(seed), n, prefix_groups)
    kw = dict(stages=stages, num_pages=num_pages, candidates=candidates, riders=riders)
    fast = _run(policy, requests, reference=False, **kw)
    # The plain run also books decodes one by one through reserve() (the meaning of the
    # gate's C-level decode passes) and prices every probe from its features.
    with mock.patch.object(controller_module._KVGate, "reserve_decodes", reserve_each_decode), \
            mock.patch.object(AnalyticalPredictor, "chunk_time", _plain_chunk_time), \
            mock.patch.object(AnalyticalPredictor, "plus_chunk_time", _plain_plus_chunk_time), \
            mock.patch.object(_PREDICTOR, "chunk_time_grows_with_n", False):
        plain = _run(policy, requests, reference=True, **kw)
    assert fast == plain


def _plain_chunk_time(predictor, base, n, start, remaining, token_buckets):
    return predictor.predict_features(base.plus_chunk(n, start, n == remaining, token_buckets))


def _plain_plus_chunk_time(predictor, base, n, start, remaining, token_buckets):
    features = base.plus_chunk(n, start, n == remaining, token_buckets)
    return features, predictor.predict_features(features)


def test_queued_prefills_snapshot_reads_like_its_tuples():
    """QueuedPrefills: the tuples built on first read, the sums without them, `plus`
    after them, pickled as tuples, equal to a tuple of the same QueuedPrefill."""
    requests = [Request(f"r{i}", 100 * (i + 1), 1, arrival_time=float(i), slo=SLO(ttft_s=3.0))
                for i in range(3)]
    for i, r in enumerate(requests):
        r.w_total = 0.5 * (i + 1)
    snapshot = QueuedPrefills(2.0, np.array([0.5, 0.25, 1.5]), requests)
    expected = tuple(QueuedPrefill(w, r.deadline - 2.0 - w, r.w_total, r.prompt_len)
                     for r, w in zip(requests, (0.5, 0.25, 1.5)))
    inbox = (QueuedPrefill(0.75, 1.0, 0.75, 40),)
    both = snapshot.plus(inbox)
    assert len(snapshot) == 3 and len(both) == 4 and snapshot.plus(()) is snapshot
    assert snapshot.work_s == 2.25 and both.work_s == 3.0
    assert both.capped_work_s(0.6) == 0.5 + 0.25 + 0.6 + 0.6
    assert snapshot == expected and both == expected + inbox and both[-1] == inbox[0]
    assert list(both) == list(expected + inbox)
    assert pickle.loads(pickle.dumps(both)) == expected + inbox
    assert QueuedPrefills.of(inbox) == inbox and QueuedPrefills() == ()
    with pytest.raises(ValueError, match="w\\(t\\)"):
        QueuedPrefills(0.0, np.zeros(2), requests)
