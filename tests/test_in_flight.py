"""Batches in flight: InFlightRunner over the real controller, and the simulator's pipeline.

No JAX: a fake pipelined executor checks every chunk against what the cache will hold by
the time the chunk runs (the chunks dispatched before it), as a stage's donated cache orders
them on a device.
"""

import pytest

from medha_jax.config import ParallelConfig, model_preset
from medha_jax.kv_cache.allocator import BlockAllocator
from medha_jax.request import (SLO, Batch, FinishReason, Request, ScheduledChunk,
                               StepResult, VirtualClock)
from medha_jax.sampling_params import SamplingParams
from medha_jax.scheduler import SchedulerConfig, make_controller
from medha_jax.scheduler.in_flight import BatchFailed, InFlightRunner
from medha_jax.simulator import SimulatedExecutor, simulate
from tests.test_controller import PREDICTOR, token_at

MODEL = model_preset("tiny")


class FakePipeline:
    """Up to `stages` batches in flight; tokens as tests.test_controller's FakeEngine."""

    def __init__(self, allocator, stages):
        self.allocator, self.max_in_flight = allocator, stages
        self.dispatched_to: dict[str, int] = {}   # request -> end of its last dispatched chunk
        self.batches = []
        self.fail_when = None

    def dispatch(self, batch):
        if self.fail_when is not None and self.fail_when(batch):
            raise RuntimeError("injected dispatch failure")
        for c in batch.chunks:
            rid = c.request.request_id
            # The chunk continues where the chunks before it (computed or in flight) end.
            assert c.start == self.dispatched_to.get(rid, c.request.num_computed_tokens)
            assert len(self.allocator.page_table(rid)) * self.allocator.page_size >= c.end
            self.dispatched_to[rid] = c.end
        self.batches.append(batch)
        return batch

    def collect(self, batch):
        for c in batch.chunks:
            rid = c.request.request_id
            if self.dispatched_to.get(rid) == c.end:   # none of its chunks is left in flight
                del self.dispatched_to[rid]
        return StepResult({c.request.request_id: token_at(c.end) for c in batch.chunks
                           if c.samples}, PREDICTOR.predict(batch))


def _setup(stages, num_pages=256, **knobs):
    allocator = BlockAllocator(num_pages, 16)
    knobs = {"max_seqs_per_batch": 8, "token_buckets": (16, 32, 64), "target_batch_time_s": 1e-4,
             **knobs}
    controller = make_controller(SchedulerConfig("lars-mp", **knobs), allocator=allocator,
                                 clock=VirtualClock(), predictor=PREDICTOR, model_config=MODEL,
                                 max_model_len=2048)
    executor = FakePipeline(allocator, stages)
    return controller, allocator, executor, InFlightRunner(controller, executor)


def _request(rid, prompt_len, max_new=4):
    return Request(rid, prompt_len, max_new, 0.0, prompt_token_ids=list(range(prompt_len)),
                   sampling=SamplingParams(temperature=0.0, max_tokens=max_new))


def _run(runner):
    while runner.controller.has_unfinished():
        assert runner.step() is not None


def test_a_long_prefill_streams_its_chunks_into_the_pipe():
    controller, allocator, executor, runner = _setup(stages=4)
    long = _request("long", 400)
    controller.add_request(long)
    # The pipe fills with consecutive chunks of the one prefill before any is done.
    while runner.dispatch_next() is not None:
        pass
    assert runner.num_in_flight == 4 and long.num_computed_tokens == 0
    starts = [b.chunks[0].start for b in executor.batches]
    ends = [b.chunks[0].end for b in executor.batches]
    assert starts[0] == 0 and starts[1:] == ends[:-1]
    assert long.num_scheduled_tokens == ends[-1] < long.prompt_len
    _run(runner)
    assert long.output_token_ids == [token_at(long.prompt_len + k) for k in range(4)]
    assert allocator.num_free_pages == allocator.num_pages


def test_a_decode_waits_for_its_token_and_nothing_samples_twice():
    controller, allocator, executor, runner = _setup(stages=3)
    short = [_request(f"s{i}", 20, max_new=6) for i in range(3)]
    for r in short:
        controller.add_request(r)
    _run(runner)
    for batch in executor.batches:
        rids = [c.request.request_id for c in batch.chunks]
        assert len(rids) == len(set(rids))
    # Each request's sampling chunks were dispatched one at a time, after the previous
    # token was back: no batch holds a chunk of a request with a sample in flight.
    for r in short:
        assert r.output_token_ids == [token_at(r.prompt_len + k) for k in range(6)]
        assert r.finish_reason is FinishReason.LENGTH
    assert allocator.num_free_pages == allocator.num_pages


def test_in_flight_tokens_equal_one_at_a_time_with_preemption():
    def run(stages):
        # 6 pages of 16 tokens cannot hold all three: the urgent request that comes later
        # preempts a running one (one not in flight), which is recomputed.
        controller, allocator, executor, runner = _setup(stages, num_pages=6)
        low = [_request("a", 40, 30), _request("b", 40, 30)]
        for r in low:
            r.priority = 1
            controller.add_request(r)
        for _ in range(8):
            runner.step()
        urgent = _request("urgent", 60, 8)
        controller.add_request(urgent)
        _run(runner)
        assert allocator.num_free_pages == allocator.num_pages
        outputs = {r.request_id: r.output_token_ids for r in low + [urgent]}
        return outputs, controller.num_preemptions

    one, _ = run(1)
    assert one["urgent"] == [token_at(60 + k) for k in range(8)]
    for stages in (2, 4):
        outputs, preemptions = run(stages)
        assert outputs == one
        assert preemptions > 0


@pytest.mark.parametrize("stages", [1, 4])
def test_requests_that_fit_one_at_a_time_do_not_evict_each_other_forever(stages):
    # Three prompts of 80 tokens (the same predicted prefill work), 4 new tokens each: 83
    # tokens of KV, all 6 pages. Ranked by their current keys, a fresh request outranked one
    # part-way through its prefill, evicted it, and was evicted back once it had progressed
    # (no end); eviction ranks requests as if restarted (ReplicaController._rank).
    controller, allocator, executor, runner = _setup(
        stages, num_pages=6, token_buckets=(16, 32), target_batch_time_s=1.05e-3,
        max_seqs_per_batch=4)
    for i in range(3):
        request = _request(f"r{i}", 80)
        request.prompt_token_ids = [(100 * i + t) % 256 for t in range(80)]
        controller.add_request(request)
    for _ in range(100):
        if not controller.has_unfinished():
            break
        runner.step()
    assert not controller.has_unfinished(), f"{controller.num_preemptions} preemptions"
    assert allocator.num_free_pages == allocator.num_pages


def test_a_failed_dispatch_names_its_batch_and_the_rest_completes():
    controller, allocator, executor, runner = _setup(stages=2, max_seqs_per_batch=1)
    bad, good = _request("bad", 30), _request("good", 30)
    controller.add_request(good)
    controller.add_request(bad)
    executor.fail_when = lambda batch: any(c.request is bad for c in batch.chunks)
    with pytest.raises(BatchFailed) as e:
        for _ in range(20):
            runner.step()
    assert [c.request for c in e.value.batch.chunks] == [bad]
    assert "injected dispatch failure" in str(e.value)
    controller.finish("bad", FinishReason.ERROR)          # what the server loop does
    _run(runner)
    assert good.finish_reason is FinishReason.LENGTH
    assert good.output_token_ids == [token_at(30 + k) for k in range(4)]
    assert allocator.num_free_pages == allocator.num_pages


def test_simulated_pipeline_takes_n_plus_s_minus_1_stage_times():
    class OneSecondStages:
        def predict(self, batch):
            return 1.0

    for stages in (1, 2, 4):
        executor = SimulatedExecutor(OneSecondStages(), VirtualClock(), stages)
        pending = [executor.dispatch(object()) for _ in range(6)]
        # Batch i leaves the last stage at (i + 1) + (s - 1): n batches take n + s - 1.
        assert [p.done_time for p in pending] == [stages + i for i in range(6)]


def test_simulated_spp_prefill_streams_and_decodes_pay_the_depth():
    """A lone long prefill at spp = 4 takes about a quarter of spp = 1's time (chunks
    stream); a short request's decodes each wait for the whole pipeline."""
    model = model_preset("llama3-8b")
    long = Request("long", 200_000, 1, 0.0, slo=SLO(ttft_s=600.0))
    chat = Request("chat", 100, 64, 0.0, slo=SLO(ttft_s=600.0, tpot_s=10.0))
    results = {}
    for spp in (1, 4):
        results[spp] = simulate([long], scheduler="lars", model=model,
                                parallel=ParallelConfig(tp=8, spp=spp), hardware="h100")
        results[spp, "chat"] = simulate([chat], scheduler="lars", model=model,
                                        parallel=ParallelConfig(tp=8, spp=spp), hardware="h100")
    ttft = {spp: results[spp].requests[0].first_token_time for spp in (1, 4)}
    assert ttft[1] / 5 < ttft[4] < ttft[1] / 3
    tpot = {spp: (r.finish_time - r.first_token_time) / 63
            for spp in (1, 4) for r in results[spp, "chat"].requests}
    # Per decode: one stage of a quarter of the layers, four times over.
    assert tpot[4] == pytest.approx(tpot[1], rel=0.35)


class _Recorder:
    """A controller that hands out numbered batches and records the order of updates."""

    def __init__(self):
        self.formed, self.updated = 0, []

    def schedule(self):
        self.formed += 1
        return Batch([ScheduledChunk(Request(f"r{self.formed}", 4, 1, 0.0), 0, 4)], 0.0)

    def update(self, batch, result):
        self.updated.append(batch.chunks[0].request.request_id)
        return []


class _Units:
    """Three batches in flight on independent units; `first_done` names which ended."""

    max_in_flight = 3

    def __init__(self, done_order):
        self.done_order = list(done_order)

    def dispatch(self, batch):
        return batch.chunks[0].request.request_id

    def first_done(self, handles):
        return handles.index(next(h for h in self.done_order if h in handles))

    def collect(self, handle):
        self.done_order.remove(handle)
        return StepResult({}, 0.0)


def test_an_executor_with_first_done_applies_batches_as_they_end():
    """Independent units' batches are applied in the order they end, not formed; the rest
    stay in flight in their order (without first_done: oldest first)."""
    controller = _Recorder()
    runner = InFlightRunner(controller, _Units(["r2", "r3", "r1"]))
    runner.step()
    assert controller.updated == ["r2"] and runner.handles == ["r1", "r3"]
    runner.step()                                   # r4 fills the seat r2 left
    assert controller.updated == ["r2", "r3"] and runner.handles == ["r1", "r4"]
    runner.executor.done_order += ["r4"]
    runner.drain()
    assert controller.updated == ["r2", "r3", "r1", "r4"]
