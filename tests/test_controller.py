"""ReplicaController: admission, finishing, cancellation, KV pages and preemption."""

import random

import pytest

from medha_jax.config import ParallelConfig, model_preset
from medha_jax.kv_cache.allocator import BlockAllocator
from medha_jax.request import SLO, FinishReason, Request, RequestState, StepResult, VirtualClock
from medha_jax.sampling_params import SamplingParams
from medha_jax.scheduler import (POLICY_NAMES, CapacityError, SchedulerConfig, make_controller,
                                  run_one_step)
from medha_jax.scheduler.predictor import AnalyticalPredictor

MODEL = model_preset("tiny")
PREDICTOR = AnalyticalPredictor(MODEL, ParallelConfig(), "a100")


def token_at(position: int) -> int:
    """The token a request samples after `position` tokens: depends on nothing else, so
    a recomputed (preempted) request must produce exactly the same output."""
    return 10 + position % 50


EOS = token_at(42)


class FakeEngine:
    """Samples token_at(num_tokens), advances the clock by the predictor's time, and checks
    that every chunk continues where the request's KV cache ends."""

    def __init__(self, clock, allocator):
        self.clock, self.allocator = clock, allocator
        self.batches = []

    def execute(self, batch):
        for c in batch.chunks:
            assert c.start == c.request.num_computed_tokens
            pages = sum(len(s.table) for s in self.allocator.segments(c.request.request_id))
            assert pages * self.allocator.page_size >= c.end
        self.batches.append(batch)
        seconds = PREDICTOR.predict(batch)
        self.clock.advance(seconds)
        sampled = {c.request.request_id: token_at(c.end) for c in batch.chunks if c.samples}
        return StepResult(sampled, seconds)


def _setup(policy="lars-mp", num_pages=256, page_size=16, eos=(), **knobs):
    clock = VirtualClock()
    allocator = BlockAllocator(num_pages, page_size)
    engine = FakeEngine(clock, allocator)
    knobs = {"max_seqs_per_batch": 8, "token_buckets": (16, 32, 64, 128, 256),
             "target_batch_time_s": 0.002, **knobs}
    controller = make_controller(SchedulerConfig(policy, **knobs), allocator=allocator,
                                 clock=clock, predictor=PREDICTOR, model_config=MODEL,
                                 eos_token_ids=eos, max_model_len=2048)
    return controller, allocator, engine


def _request(rid, prompt_len=40, max_new=5, arrival=0.0, ids=True, **sampling):
    prompt = [random.Random(rid).randrange(3, 200) for _ in range(prompt_len)] if ids else None
    return Request(rid, prompt_len, max_new, arrival, prompt_token_ids=prompt,
                   sampling=SamplingParams(temperature=0.0, **sampling))


def _run(controller, engine, limit=10_000):
    updates = []
    for _ in range(limit):
        if not controller.has_unfinished():
            return updates
        updates += run_one_step(controller, engine)
    raise AssertionError("requests did not finish")


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_policy_serves_requests_to_completion(policy):
    controller, allocator, engine = _setup(policy)
    requests = [_request(f"r{i}", prompt_len=20 + 37 * i, max_new=3 + i) for i in range(6)]
    for r in requests:
        controller.add_request(r)
    assert controller.num_waiting == 6 and controller.num_running == 0
    updates = _run(controller, engine)
    for r in requests:
        assert r.finish_reason is FinishReason.LENGTH
        assert len(r.output_token_ids) == r.max_new_tokens
        assert r.output_token_ids == [token_at(r.prompt_len + k) for k in range(r.max_new_tokens)]
        assert r.arrival_time <= r.first_scheduled_time <= r.first_token_time <= r.last_token_time \
            == r.finish_time
        assert r.w_total > 0
        assert controller.get(r.request_id) is r
    # One update per sampled token, the last one marked finished.
    assert sum(len(u.new_token_ids) for u in updates) == sum(r.max_new_tokens for r in requests)
    assert sum(u.finished for u in updates) == len(requests)
    assert allocator.num_free_pages == allocator.num_pages and not controller.has_unfinished()


def test_stop_tokens_and_eos():
    controller, _, engine = _setup(eos=(EOS,))
    # From a 40-token prompt, tokens token_at(40), token_at(41), ... are sampled; EOS is the third.
    eos = _request("eos", prompt_len=40, max_new=50)
    stop = _request("stop", prompt_len=40, max_new=50, ignore_eos=True,
                    stop_token_ids=[token_at(43)])
    ignore = _request("ignore", prompt_len=40, max_new=3, ignore_eos=True)
    for r in (eos, stop, ignore):
        controller.add_request(r)
    _run(controller, engine)
    assert eos.finish_reason is FinishReason.STOP and eos.output_token_ids[-1] == EOS
    assert len(eos.output_token_ids) == 3
    assert stop.finish_reason is FinishReason.STOP and len(stop.output_token_ids) == 4
    assert ignore.finish_reason is FinishReason.LENGTH and ignore.output_token_ids[-1] == EOS


def test_admission_errors_name_the_problem():
    controller, allocator, engine = _setup(num_pages=8, page_size=16)      # 128 tokens of KV
    with pytest.raises(ValueError, match=r"prompt_len=2000 \+ max_tokens=100 = 2100 "
                                         r"exceeds max_model_len=2048"):
        controller.add_request(_request("long", prompt_len=2000, max_new=100))
    with pytest.raises(CapacityError, match="RESOURCE.*needs 10 KV pages of 16 tokens.*has 8"):
        controller.add_request(_request("big", prompt_len=150, max_new=2))
    assert issubclass(CapacityError, ValueError)
    controller.add_request(_request("ok", prompt_len=100, max_new=29))    # 128 cached tokens: fits
    with pytest.raises(ValueError, match="request_id 'ok' is already in use"):
        controller.add_request(_request("ok"))
    with pytest.raises(ValueError, match="unknown policy 'sjf'"):
        _setup("sjf")


def test_cancel_and_finish_free_pages():
    controller, allocator, engine = _setup()
    a, b, c = (_request(x, prompt_len=100, max_new=20) for x in "abc")
    for r in (a, b, c):
        controller.add_request(r)
    for _ in range(3):
        run_one_step(controller, engine)
    assert allocator.num_free_pages < allocator.num_pages
    assert controller.cancel("a") is True and controller.cancel("a") is False
    assert a.finish_reason is FinishReason.CANCELLED and a.state is RequestState.FINISHED
    assert controller.finish("b", FinishReason.STOP) is True
    assert b.finish_reason is FinishReason.STOP and not allocator.has("b")
    assert controller.cancel("nobody") is False
    _run(controller, engine)
    assert c.finish_reason is FinishReason.LENGTH
    assert allocator.num_free_pages == allocator.num_pages


@pytest.mark.parametrize("policy", ["fcfs-np", "sarathi-512", "lars", "lars-mp"])
def test_preemption_under_kv_pressure_never_drops_a_request(policy):
    # 24 pages x 16 tokens = 384 tokens of KV for 12 requests of up to ~200 tokens each.
    controller, allocator, engine = _setup(policy, num_pages=24, page_size=16,
                                           max_seqs_per_batch=16)
    rng = random.Random(policy)
    requests = [_request(f"r{i}", prompt_len=rng.randint(30, 150), max_new=rng.randint(20, 60),
                         arrival=0.0) for i in range(12)]
    for r in requests:
        controller.add_request(r)
    _run(controller, engine)
    assert controller.num_preemptions > 0
    assert sum(r.num_preemptions for r in requests) == controller.num_preemptions
    for r in requests:
        assert r.finish_reason is FinishReason.LENGTH
        assert r.output_token_ids == [token_at(r.prompt_len + k) for k in range(r.max_new_tokens)]
    assert allocator.num_free_pages == allocator.num_pages


def test_prefix_cache_hits_skip_computed_pages():
    controller, allocator, engine = _setup()
    first = _request("first", prompt_len=100, max_new=2)
    controller.add_request(first)
    _run(controller, engine)
    second = Request("second", 120, 2, 0.0, prompt_token_ids=first.prompt_token_ids + [7] * 20,
                     sampling=SamplingParams(temperature=0.0))
    controller.add_request(second)
    _run(controller, engine)
    assert second.num_cached_tokens == 96                # six full pages of the shared prefix
    first_chunk = next(c for b in engine.batches for c in b.chunks if c.request is second)
    assert first_chunk.start == 96


def test_a_request_handed_its_kv_takes_those_pages_and_computes_only_the_rest():
    """kv_from (a KV hand-off's reservation, serving.kv_transfer): the request takes the
    pages under that id, the partial last one too, and its first chunk is its last token
    alone; a refused request frees them; an id the allocator no longer holds is ignored;
    every page comes back."""
    controller, allocator, engine = _setup()
    handed = _request("handed", prompt_len=70, max_new=4)
    handed.output_token_ids = [token_at(70)]                # sampled where it prefilled
    allocator.allocate("kv-in:handed:1")
    assert allocator.reserve("kv-in:handed:1", 70)          # 5 pages, the last one partial
    controller.add_request(handed, resume=True, kv_from=("kv-in:handed:1", 70))
    assert not allocator.has("kv-in:handed:1") and allocator.num_free_pages == 256 - 5
    assert handed.num_computed_tokens == handed.num_cached_tokens == 70
    _run(controller, engine)
    chunks = [c for b in engine.batches for c in b.chunks if c.request is handed]
    assert (chunks[0].start, chunks[0].num_tokens) == (70, 1)
    assert handed.output_token_ids == [token_at(n) for n in range(70, 74)]
    # Refused (its id is in use): the pages go back; a gone owner is ignored.
    allocator.allocate("kv-in:again:1")
    assert allocator.reserve("kv-in:again:1", 70)
    again = _request("handed", prompt_len=70, max_new=4)
    again.output_token_ids = [token_at(70)]
    with pytest.raises(ValueError, match="already in use"):
        controller.add_request(again, resume=True, kv_from=("kv-in:again:1", 70))
    assert not allocator.has("kv-in:again:1")
    late = _request("late", prompt_len=70, max_new=2)
    late.output_token_ids = [token_at(70)]
    controller.add_request(late, resume=True, kv_from=("kv-in:gone:1", 70))
    _run(controller, engine)
    assert late.num_cached_tokens == 0 and late.output_token_ids == [token_at(70), token_at(71)]
    assert allocator.num_free_pages == 256


def test_a_full_step_makes_new_requests_wait_for_a_seat():
    controller, _, engine = _setup(max_seqs_per_batch=4)
    requests = [_request(f"r{i}", prompt_len=10, max_new=30) for i in range(6)]
    for r in requests:
        controller.add_request(r)
    _run(controller, engine)
    assert max(len(b.chunks) for b in engine.batches) == 4
    # The first four take the seats and decode to the end; the others start as seats free.
    first_free_seat = min(q.finish_time for q in requests[:4])
    assert all(r.first_scheduled_time >= first_free_seat for r in requests[4:])
    assert all(r.finish_reason is FinishReason.LENGTH for r in requests)


# --- Batches in flight: schedule() may run ahead of update() ----------------------------------

def test_batches_in_flight_update_in_any_order_and_are_not_rescheduled():
    controller, allocator, engine = _setup()
    a, b = _request("a", prompt_len=20, max_new=4), _request("b", prompt_len=30, max_new=4)
    controller.add_request(a)
    first = controller.schedule()
    controller.add_request(b)
    second = controller.schedule()
    assert [c.request for c in first.chunks] == [a]
    assert [c.request for c in second.chunks] == [b]      # a is in flight: skipped
    assert not controller.schedule() and controller.num_in_flight == 2
    second_result, first_result = engine.execute(second), engine.execute(first)
    controller.update(second, second_result)               # the later batch lands first
    controller.update(first, first_result)
    assert controller.num_in_flight == 0 and controller.num_steps == 2
    with pytest.raises(ValueError, match="update each batch from schedule.. exactly once"):
        controller.update(first, first_result)
    _run(controller, engine)
    for r in (a, b):
        assert r.output_token_ids == [token_at(r.prompt_len + k) for k in range(r.max_new_tokens)]
    assert allocator.num_free_pages == allocator.num_pages


def test_a_request_cancelled_while_in_flight_drops_its_result():
    controller, allocator, engine = _setup()
    a, b = _request("a", prompt_len=20, max_new=4), _request("b", prompt_len=20, max_new=4)
    controller.add_request(a)
    controller.add_request(b)
    batch = controller.schedule()
    assert {c.request.request_id for c in batch.chunks} == {"a", "b"}
    result = engine.execute(batch)
    assert controller.cancel("a")
    updates = controller.update(batch, result)
    assert all(u.request is b for u in updates) and a.output_token_ids == []
    assert not allocator.has("a") and controller.num_in_flight == 0
    _run(controller, engine)
    assert b.finish_reason is FinishReason.LENGTH
    assert allocator.num_free_pages == allocator.num_pages


def test_a_request_in_flight_is_never_preempted():
    # 4 pages x 16 tokens: the running low-priority request and the urgent one cannot both fit.
    controller, allocator, engine = _setup(num_pages=4, page_size=16)
    low = Request("low", 40, 8, 0.0, priority=1, prompt_token_ids=list(range(3, 43)),
                  sampling=SamplingParams(temperature=0.0))
    urgent = Request("urgent", 40, 8, 0.0, prompt_token_ids=list(range(50, 90)),
                     sampling=SamplingParams(temperature=0.0))
    controller.add_request(low)
    first = controller.schedule()
    assert [c.request for c in first.chunks] == [low]
    controller.add_request(urgent)
    # Urgent outranks low, whose pages it needs, but low is in flight: its pages are being
    # written, so urgent makes do with what is free.
    second = controller.schedule()
    assert controller.num_preemptions == 0 and allocator.has("low")
    assert low not in [c.request for c in second.chunks]
    controller.update(first, engine.execute(first))
    controller.update(second, engine.execute(second))
    _run(controller, engine)
    for r in (low, urgent):
        assert r.output_token_ids == [token_at(r.prompt_len + k) for k in range(r.max_new_tokens)]
    assert allocator.num_free_pages == allocator.num_pages


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_more_prefills_than_the_cache_holds_all_finish(policy):
    """20 identical 4096-token prompts, a cache for 4 of them. Under the slack policies a
    request near the end of its prefill is the least urgent (its w(t) is small), so if
    eviction followed the current keys each recomputed victim would evict the next one
    near the end and nothing would finish (it ran 3,000 steps with 20 unfinished and ~3,000
    preemptions). Eviction ranks requests as if restarted, so they finish in about the
    steps their work takes."""
    from medha_jax.simulator import CountingAllocator, SimulatedExecutor

    model = model_preset("llama3-8b")
    predictor = AnalyticalPredictor(model, ParallelConfig(tp=8), "a100")
    clock = VirtualClock()
    tokens, fit = 4096, 4
    controller = make_controller(
        SchedulerConfig(policy), allocator=CountingAllocator(fit * (tokens // 16 + 1), 16),
        clock=clock, predictor=predictor, model_config=model, max_model_len=tokens + 16)
    executor = SimulatedExecutor(predictor, clock)
    requests = [Request(f"r{i}", tokens, 4, 0.0, slo=SLO(ttft_s=20 * controller.prefill_time_cache(tokens)))
                for i in range(20)]
    for request in requests:
        controller.add_request(request)
    for _ in range(500):
        if not controller.has_unfinished():
            break
        run_one_step(controller, executor)
    assert not controller.has_unfinished()
    assert all(len(r.output_token_ids) == 4 for r in requests)
    assert controller.num_preemptions <= len(requests)


# --- KV-parallel shards: a page is needed on one shard ------------------------------------------

def _kvp_setup(policy="lars-mp", pages_per_shard=4, max_tokens_per_shard=None, **knobs):
    clock = VirtualClock()
    allocator = BlockAllocator(pages_per_shard, 16, num_shards=2,
                               max_tokens_per_shard=max_tokens_per_shard)
    knobs = {"max_seqs_per_batch": 8, "token_buckets": (16, 32, 64, 128, 256),
             "target_batch_time_s": 0.002, **knobs}
    controller = make_controller(SchedulerConfig(policy, **knobs), allocator=allocator,
                                 clock=clock, predictor=PREDICTOR, model_config=MODEL,
                                 max_model_len=allocator.max_tokens_per_request)
    return controller, allocator, FakeEngine(clock, allocator)


def _shards(allocator, request):
    return [s.shard for s in allocator.segments(request.request_id)]


def test_kvp_preemption_evicts_only_requests_holding_pages_on_the_full_shard():
    """Three requests on two 4-page shards: `urgent` and `mid` fill shard 0, `low` (the least
    urgent) holds shard 1. When urgent's decode needs a page on shard 0, evicting low frees
    nothing it can use: only mid, the least urgent request on shard 0, is evicted."""
    controller, allocator, engine = _kvp_setup()

    def req(rid, prompt_len, max_new, priority):
        return Request(rid, prompt_len, max_new, 0.0, priority=priority,
                       prompt_token_ids=[random.Random(rid).randrange(3, 200)
                                         for _ in range(prompt_len)],
                       sampling=SamplingParams(temperature=0.0))

    urgent, low, mid = req("urgent", 10, 20, 0), req("low", 40, 8, 2), req("mid", 40, 8, 1)
    controller.add_request(urgent)
    run_one_step(controller, engine)
    controller.add_request(low)                   # shard 1 is the less loaded: low goes there
    run_one_step(controller, engine)
    controller.add_request(mid)                   # 1 page used on shard 0, 3 on shard 1
    run_one_step(controller, engine)
    assert (_shards(allocator, urgent), _shards(allocator, low), _shards(allocator, mid)) == \
        ([0], [1], [0])
    assert [allocator.num_free_pages_on(s) for s in (0, 1)] == [0, 1]
    assert controller.num_preemptions == 0 and urgent.num_tokens < 17
    while urgent.num_tokens < 17:                 # its next decode needs a second page
        run_one_step(controller, engine)
        assert controller.num_preemptions == 0
    batch = controller.schedule()
    assert controller.num_preemptions == 1
    assert mid.num_preemptions == 1 and low.num_preemptions == 0
    assert _shards(allocator, low) == [1] and low in [c.request for c in batch.chunks]
    assert _shards(allocator, urgent) == [0] and len(allocator.segments("urgent")[0].table) == 2
    controller.update(batch, engine.execute(batch))
    _run(controller, engine)
    for r in (urgent, low, mid):
        assert r.output_token_ids == [token_at(r.prompt_len + k) for k in range(r.max_new_tokens)]
    assert [allocator.num_free_pages_on(s) for s in (0, 1)] == [4, 4]


@pytest.mark.parametrize("policy", ["fcfs-np", "lars", "lars-mp"])
def test_kvp_preemption_under_pressure_finishes_every_request(policy):
    """Many requests spread over two small shards (96-token segments): victims are chosen by
    shard, and still every request finishes with its tokens and every page comes back."""
    controller, allocator, engine = _kvp_setup(policy, pages_per_shard=12,
                                               max_tokens_per_shard=96, max_seqs_per_batch=16)
    rng = random.Random(policy)
    requests = [_request(f"r{i}", prompt_len=rng.randint(20, 150), max_new=rng.randint(10, 40))
                for i in range(14)]
    for r in requests:
        controller.add_request(r)
    _run(controller, engine, limit=3000)
    assert 0 < controller.num_preemptions <= 10 * len(requests)
    for r in requests:
        assert r.output_token_ids == [token_at(r.prompt_len + k) for k in range(r.max_new_tokens)]
    assert [allocator.num_free_pages_on(s) for s in (0, 1)] == [12, 12]


def test_a_decode_short_of_a_page_never_evicts_a_decode_of_its_own_batch():
    """Decodes are booked in C-level passes until one needs a page the cache lacks: that
    one goes through reserve(), which must see the decodes granted before it as in the
    batch. Here `low` (less important) decodes first and fits its pages; `high` needs a
    page and the cache is full: it may not evict `low`, whose chunk is already in the
    batch, so it waits a step."""
    controller, allocator, engine = _setup("fcfs", num_pages=2, page_size=4)
    low = Request("low", 2, 6, 0.0, priority=1, prompt_token_ids=[3, 4],
                  sampling=SamplingParams(temperature=0.0))
    high = Request("high", 4, 4, 0.0, prompt_token_ids=[5, 6, 7, 8],
                   sampling=SamplingParams(temperature=0.0))
    controller.add_request(low)
    run_one_step(controller, engine)                  # low's prefill: one page
    controller.add_request(high)
    run_one_step(controller, engine)                  # low decodes, high's prefill: the other
    assert allocator.num_free_pages == 0 and len(high.output_token_ids) == 1
    batch = controller.schedule()                     # low fits (end 4), high needs a 2nd page
    assert [(c.request.request_id, c.start) for c in batch.chunks] == [("low", 3)]
    assert controller.num_preemptions == 0 and low.state is RequestState.RUNNING
    controller.update(batch, engine.execute(batch))
    _run(controller, engine)
    for r in (low, high):
        assert r.output_token_ids == [token_at(r.prompt_len + k) for k in range(r.max_new_tokens)]
    assert allocator.num_free_pages == allocator.num_pages


@pytest.mark.parametrize("policy", ["lars", "lars-mp"])
def test_the_load_a_server_reads_each_step_equals_a_pass_over_the_requests(policy):
    """queued_prefills (w(t) read from the index's SRPT keys under lars-mp),
    decode_tokens_left and decoding_requests (kept as requests come, generate and go)
    equal a fresh pass over the requests, through preemption, prefix reuse, EOS, cancels
    and requests that resume with output."""
    controller, allocator, engine = _setup(policy, num_pages=24, page_size=16,
                                           max_seqs_per_batch=16, eos=(EOS,))
    remaining_work = controller.prefill_time_cache.remaining_work
    rng = random.Random(policy)
    shared = [7] * 48                     # a prefix the cache can reuse
    later = []
    for step in range(300):
        if step % 4 == 0 and step < 200:
            r = _request(f"r{step}", prompt_len=rng.randint(30, 150), max_new=rng.randint(1, 60))
            if rng.random() < 0.3:
                r.prompt_token_ids[:48] = shared
            if rng.random() < 0.2:        # resumed elsewhere with what it had generated
                r.output_token_ids = [token_at(r.prompt_len + k) for k in range(2)]
                controller.add_request(r, resume=True)
            else:
                controller.add_request(r)
        unfinished = controller.unfinished()
        if step % 9 == 0 and unfinished:
            controller.cancel(rng.choice(unfinished).request_id)
        if controller.has_unfinished():
            run_one_step(controller, engine)
        queued = [r for r in controller.unfinished() if r in controller._prefills]
        now = controller.clock.now()
        expected = sorted((remaining_work(r), r.deadline - now - remaining_work(r), r.w_total,
                           r.prompt_len) for r in queued)
        snapshot = controller.queued_prefills()
        assert snapshot.work_s == pytest.approx(sum(e[0] for e in expected), rel=1e-12)
        later.append((snapshot, expected))
        if step % 3:          # a snapshot read a step later holds what it was published with
            for snapshot, expected in later:
                published = sorted(snapshot)
                assert [q.prompt_len for q in published] == [e[3] for e in expected]
                assert [q[:3] for q in published] == [pytest.approx(e[:3], rel=1e-12)
                                                      for e in expected]
            later.clear()
        assert controller.decode_tokens_left == sum(
            r.max_new_tokens - len(r.output_token_ids) for r in controller.unfinished())
        assert sorted(map(id, controller.decoding_requests())) == sorted(
            id(r) for r in controller.unfinished() if r.max_new_tokens > 1)
    assert controller.num_preemptions > 0
    _run(controller, engine)
    assert controller.decode_tokens_left == 0 and controller.queued_prefills() == ()
    assert controller.decoding_requests() == []
    assert allocator.num_free_pages == allocator.num_pages


def test_steps_are_bounded_by_time_only_while_a_request_has_a_tpot():
    # Requests with no per-token objective (tpot_s = inf, Server.generate's) fill each step
    # to the engine's tokens; one request with a finite TPOT brings the time bound back
    # from the next batch, and when it finishes the bound goes again.
    controller, allocator, engine = _setup(max_seqs_per_batch=8, token_buckets=None,
                                           max_tokens_per_batch=256, target_batch_time_s=2e-4)
    free = allocator.num_free_pages
    throughput = SLO(ttft_s=10.0, tpot_s=float("inf"))
    for i in range(2):
        r = _request(f"t{i}", prompt_len=600, max_new=3)
        r.slo = throughput
        controller.add_request(r)
    run_one_step(controller, engine)
    assert engine.batches[-1].num_tokens == 256
    assert engine.batches[-1].predicted_time_s > 2e-4
    paced = _request("paced", prompt_len=600, max_new=3)
    paced.slo = SLO(ttft_s=10.0, tpot_s=1.0)
    controller.add_request(paced)
    run_one_step(controller, engine)
    # Nothing fits 0.2 ms (a step's fixed cost is more): the progress guarantee's chunk.
    assert engine.batches[-1].num_tokens == SchedulerConfig().min_chunk_tokens
    while "paced" not in controller.finished:
        run_one_step(controller, engine)
    more = _request("t2", prompt_len=600, max_new=3)
    more.slo = throughput
    controller.add_request(more)
    run_one_step(controller, engine)
    assert engine.batches[-1].num_tokens == 256
    _run(controller, engine)
    assert allocator.num_free_pages == free
