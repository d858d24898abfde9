"""ServingLoop on the real controller with a scripted engine (no model): the loop's steps,
its failure containment, duplicate ids and a clean close."""

import threading
import time

import pytest

from medha_jax.config import ParallelConfig, model_preset
from medha_jax.kv_cache.allocator import BlockAllocator
from medha_jax.request import SLO, Request, StepResult, WallClock
from medha_jax.sampling_params import SamplingParams
from medha_jax.scheduler import AnalyticalPredictor, SchedulerConfig, make_controller
from serving.loop import ServingLoop
from serving.metrics import ServerMetrics
from serving.outputs import IncrementalDetokenizer, RequestHandle, RequestStream

MODEL = model_preset("tiny")
TOKEN = 7


class ScriptedEngine:
    """Samples TOKEN for every sampling chunk; raises for batches holding a poisoned
    request; can hold a step until released."""

    def __init__(self, allocator, poison=()):
        self.allocator, self.poison = allocator, set(poison)
        self.hold = None                      # an Event the next step waits for
        self.entered = threading.Event()

    def execute(self, batch):
        self.entered.set()
        if self.hold is not None:
            self.hold.wait(30)
        if any(c.request.request_id in self.poison for c in batch.chunks):
            raise RuntimeError("injected device failure")
        return StepResult({c.request.request_id: TOKEN for c in batch.chunks if c.samples}, 1e-3)


def scripted_loop(poison=(), **loop_options) -> ServingLoop:
    allocator = BlockAllocator(num_pages=64, page_size=16)
    controller = make_controller(
        SchedulerConfig("lars", token_buckets=(16, 32, 64), max_seqs_per_batch=4,
                        target_batch_time_s=0.002),
        allocator=allocator, clock=WallClock(), model_config=MODEL, max_model_len=256,
        predictor=AnalyticalPredictor(MODEL, ParallelConfig(), "a100"))
    return ServingLoop(controller, ScriptedEngine(allocator, poison), ServerMetrics(),
                       **loop_options)


@pytest.fixture
def loop():
    loop = scripted_loop(poison={"bad"})
    yield loop
    loop.close(timeout=30)
    loop.metrics.close()


def submit(loop, request_id, prompt_len=5, max_tokens=3):
    request = Request(request_id, prompt_len, max_tokens, time.monotonic(),
                      prompt_token_ids=list(range(1, prompt_len + 1)),
                      sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens))
    handle = RequestHandle(request_id, request.prompt_token_ids, loop.cancel)
    loop.add(RequestStream(request, handle, IncrementalDetokenizer(None)))
    return handle


def test_requests_finish_and_a_failing_step_fails_only_its_batch(loop):
    out = submit(loop, "good", max_tokens=3).result(timeout=30)
    assert (out.finish_reason, out.token_ids) == ("length", (TOKEN,) * 3)
    bad = submit(loop, "bad").result(timeout=30)
    assert bad.finish_reason == "error" and "step failed: RuntimeError: injected" in bad.error
    assert loop.thread.is_alive()
    again = submit(loop, "good", max_tokens=2).result(timeout=30)     # the id is free again
    assert again.token_ids == (TOKEN,) * 2
    allocator = loop.engine.allocator
    assert allocator.num_free_pages == allocator.num_pages


def test_a_scheduler_failure_fails_every_request_in_flight(loop, monkeypatch):
    calls = []

    def schedule():
        calls.append(1)
        raise RuntimeError("scheduler bug")

    monkeypatch.setattr(loop.controller, "schedule", schedule)
    out = submit(loop, "a").result(timeout=30)
    assert out.finish_reason == "error" and "scheduling failed: RuntimeError" in out.error
    assert calls and not loop.controller.has_unfinished()


def test_duplicate_ids_cancel_and_close(loop):
    engine = loop.engine
    engine.hold = threading.Event()
    handle = submit(loop, "long", max_tokens=200)
    with pytest.raises(ValueError, match="request_id 'long' is already in flight"):
        submit(loop, "long")
    assert not loop.cancel("nobody")
    assert engine.entered.wait(30)            # its first step is running
    closer = threading.Thread(target=loop.close, kwargs={"timeout": 30})
    closer.start()
    while not loop.closing:
        time.sleep(0.001)
    engine.hold.set()
    closer.join()
    out = handle.result(timeout=0)
    assert out.finish_reason == "cancelled" and len(out.token_ids) < 200
    assert not loop.thread.is_alive()
    assert engine.allocator.num_free_pages == engine.allocator.num_pages
    with pytest.raises(RuntimeError, match="the server is closed"):
        submit(loop, "late")


def submit_group(loop, leader, n, max_tokens=3, leader_max_tokens=None):
    """n samples of one prompt: `leader` runs first, `leader-i` are held until its first
    token (Server.submit's layout)."""
    ids = [leader] + [f"{leader}-{i}" for i in range(1, n)]
    handle = RequestHandle(leader, list(range(1, 6)), loop.cancel, ids=ids)
    lengths = [leader_max_tokens or max_tokens] + [max_tokens] * (n - 1)
    streams = [RequestStream(Request(rid, 5, m, time.monotonic(),
                                     prompt_token_ids=list(range(1, 6)),
                                     sampling=SamplingParams(temperature=0.0, max_tokens=m)),
                             handle, IncrementalDetokenizer(None), index=i)
               for i, (rid, m) in enumerate(zip(ids, lengths))]
    loop.add(streams[0], held=streams[1:])
    return handle


def test_held_samples_run_after_the_first_token_and_end_with_a_failed_one(loop):
    out = submit_group(loop, "good", 3).result(timeout=30)
    assert [(o.index, o.finish_reason, o.token_ids) for o in out.outputs] == \
        [(i, "length", (TOKEN,) * 3) for i in range(3)]
    # Sample 0 fails before its first token: the held samples end the same way, unrun.
    bad = submit_group(loop, "bad", 3).result(timeout=30)
    assert [o.finish_reason for o in bad.outputs] == ["error"] * 3
    assert all("injected" in o.error and o.token_ids == () for o in bad.outputs)
    assert not loop.controller.has_unfinished()
    allocator = loop.engine.allocator
    assert allocator.num_free_pages == allocator.num_pages
    loop.engine.hold = threading.Event()
    held = submit_group(loop, "held", 2, max_tokens=50)
    with pytest.raises(ValueError, match="request_id 'held-1' is already in flight"):
        submit(loop, "held-1")
    assert held.cancel()                        # every sample, the held one too
    loop.engine.hold.set()
    assert [o.finish_reason for o in held.result(timeout=30).outputs] == ["cancelled"] * 2


def test_cancelling_the_handle_after_sample_0_finished_cancels_the_others(loop):
    handle = submit_group(loop, "g", 3, max_tokens=240, leader_max_tokens=1)
    for delta in handle:
        if delta.index == 0 and delta.finished:
            break
    loop.engine.hold = threading.Event()        # the others stall at their next step
    assert handle.cancel()
    loop.engine.hold.set()
    out = handle.result(timeout=30)
    assert [o.finish_reason for o in out.outputs] == ["length", "cancelled", "cancelled"]
    allocator = loop.engine.allocator
    deadline = time.monotonic() + 30
    while allocator.num_free_pages != allocator.num_pages and time.monotonic() < deadline:
        time.sleep(0.01)
    assert allocator.num_free_pages == allocator.num_pages


def test_a_request_added_during_a_step_counts_in_the_queued_prefills_at_once():
    """The loop takes its inbox in only between steps; a request routed here while a
    step runs is published with the router's seconds from its add (a decision made
    meanwhile would else see the replica without it), and with the controller's once
    taken in. The requests whose prefill is done count as decoding."""
    loop = scripted_loop(decode_token_s=1e-3)
    engine = loop.engine
    try:
        engine.hold = threading.Event()
        first = submit(loop, "decoding", max_tokens=50)
        assert engine.entered.wait(30)            # its prefill step runs, held
        before = loop.queued_prefills             # its own, in flight
        arrival = time.monotonic()
        request = Request("routed", 40, 3, arrival, prompt_token_ids=list(range(40)),
                          sampling=SamplingParams(temperature=0.0, max_tokens=3),
                          slo=SLO(ttft_s=5.0))
        handle = RequestHandle("routed", request.prompt_token_ids, loop.cancel)
        loop.add(RequestStream(request, handle, IncrementalDetokenizer(None)), prefill_s=0.7)
        published = time.monotonic()
        (routed,) = loop.queued_prefills[len(before):]
        assert loop.queued_prefills[:len(before)] == before
        whole = loop.controller.prefill_time_cache.prefill_time(40)
        assert (routed.work_s, routed.total_s, routed.prompt_len) == (0.7, max(0.7, whole), 40)
        # Its slack as of the add: 5 s from its arrival less its 0.7 s.
        assert 5.0 - 0.7 - (published - arrival) <= routed.slack_s <= 5.0 - 0.7
        engine.entered.clear()
        engine.hold.set()                         # the held step ends; the loop takes it in
        deadline = time.monotonic() + 30
        while 0.7 in [q.work_s for q in loop.queued_prefills] and time.monotonic() < deadline:
            time.sleep(0.001)
        assert 0.7 not in [q.work_s for q in loop.queued_prefills]
        assert list(handle.result(timeout=30).outputs[0].token_ids) == [TOKEN] * 3
        # Both prefilled; "decoding" goes on decoding (or has just finished).
        assert loop.queued_prefills == () and loop.num_decoding in (0, 1)
        first.result(timeout=30)
        assert loop.num_decoding == 0
    finally:
        engine.hold.set()
        loop.close(timeout=30)
        loop.metrics.close()


def _wait_until(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.001)
    return condition()


def test_a_disaggregating_loop_publishes_the_requests_that_decode_and_their_contexts_now():
    """With publishes_decode_contexts, decode_contexts has each request here that decodes
    (max_tokens > 1: not the one-token one), its context as it grows, and none once done."""
    loop = scripted_loop(decode_token_s=1e-3)
    loop.publishes_decode_contexts = True
    engine = loop.engine
    try:
        engine.hold = threading.Event()
        long = submit(loop, "long", prompt_len=5, max_tokens=40)
        one = submit(loop, "one", prompt_len=9, max_tokens=1)
        assert engine.entered.wait(30)
        engine.hold.set()
        assert _wait_until(lambda: len(loop.decode_contexts) == 1)
        first = loop.decode_contexts[0]
        assert first >= 5
        assert _wait_until(lambda: not loop.decode_contexts or loop.decode_contexts[0] > first)
        one.result(timeout=30)
        long.result(timeout=30)
        assert _wait_until(lambda: loop.decode_contexts == ())
    finally:
        engine.hold.set()
        loop.close(timeout=30)
