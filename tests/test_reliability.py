"""A step that fails ON THE DEVICE in the middle of a run, and out of memory at start-up.

The engine's step is swapped for one that runs the real step plus a host callback inside
the same compiled program; the callback raises when armed, so XLA's execution fails
with the KV cache already donated to it. On an spp = 2 mesh (alone and with kvp = 2) the
callback is a stage hook, run on every device of every stage, with two batches in flight,
and the failing step may wait behind other work, as on an accelerator. That batch's
requests get the error; every other request completes with exactly the tokens it gets
alone; every page returns; the rebuilt caches keep their shapes and shardings; the prefix
cache forgets pages whose contents went with the old cache.
"""

import contextlib
import dataclasses
import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from medha_jax import SamplingParams, load_model
from medha_jax.engine import Engine, EngineConfig
from medha_jax.engine import engine as engine_module
from medha_jax.engine.step_inputs import unpack_int32
from medha_jax.scheduler.predictor import AnalyticalPredictor
from meshes import ParallelConfig
from serving.server import Server, TokensPrompt
from tests.test_pipeline import callback_hook, occupy
from tests.test_server import GREEDY, TINY_ENGINE, byte_level_tokenizer, wait_until_idle
from tests.test_stages import new_tiny_model

FAULT = "injected device fault"
PROMPTS = [tuple(range(1 + i, 20 + 3 * i)) for i in range(4)]
LONG = tuple(range(100, 220))
SEEDED = SamplingParams(temperature=1.0, top_k=20, max_tokens=12, seed=7)


class DeviceFault:
    """A callback run inside the compiled step: raises (on the device's host thread, in
    the middle of XLA's execution) in the next `calls` calls after arm(calls): one per
    device of the program that fails, which calls it on each (tests.test_pipeline.
    callback_hook), so that no device waits for another that failed."""

    def __init__(self):
        self._lock = threading.Lock()
        self._calls_to_fail = 0
        self.fired = 0                  # steps failed

    def arm(self, calls: int = 1) -> None:
        with self._lock:
            self._calls_to_fail = calls

    def __call__(self, token_sum):
        with self._lock:
            if self._calls_to_fail:
                self._calls_to_fail -= 1
                self.fired += self._calls_to_fail == 0
                raise RuntimeError(FAULT)
        return np.int32(0)


def faulty_step(fault: DeviceFault):
    """engine.step with the fault's callback inside the same executable; its result feeds
    the sampled tokens (adding 0), so XLA cannot drop it."""
    real_step = engine_module.step

    @functools.partial(jax.jit, static_argnames=("graphdef", "shape", "num_kv_shards",
                                                 "cp_ranks", "replicate_outputs"),
                       donate_argnames=("kv_cache",))
    def step(graphdef, state, kv_cache, ints, floats, rng_keys, *, shape, num_kv_shards=1,
             cp_ranks=1, replicate_outputs=False):
        outputs, kv_cache = real_step(graphdef, state, kv_cache, ints, floats, rng_keys,
                                      shape=shape, num_kv_shards=num_kv_shards,
                                      cp_ranks=cp_ranks, replicate_outputs=replicate_outputs)
        token_sum = jnp.sum(unpack_int32(ints, shape, num_kv_shards, cp_ranks)["token_ids"])
        zero = jax.pure_callback(fault, jax.ShapeDtypeStruct((), jnp.int32), token_sum)
        return dataclasses.replace(outputs, tokens=outputs.tokens + zero), kv_cache

    return step


@pytest.fixture(scope="module")
def faulty_server():
    fault = DeviceFault()
    patch = pytest.MonkeyPatch()
    patch.setattr(engine_module, "step", faulty_step(fault))
    try:
        model = load_model("tiny")
        model.tokenizer = byte_level_tokenizer()
        server = Server(model, engine_config=TINY_ENGINE)
    finally:
        patch.undo()
    with server:
        yield server, fault


@contextlib.contextmanager
def faulty_staged_server(parallel: ParallelConfig):
    """A server on an spp > 1 mesh (batches in flight) whose every stage runs the fault."""
    fault = DeviceFault()
    engine = Engine(new_tiny_model(2, parallel), TINY_ENGINE, stage_hook=callback_hook(fault))
    predictor = AnalyticalPredictor(engine.model.config, ParallelConfig(), "h100",
                                    token_buckets=engine.ladder.token_buckets)
    with Server(engine, predictor=predictor) as server:
        assert engine.max_in_flight == parallel.spp
        yield server, fault


@pytest.fixture(scope="module")
def faulty_spp_server():
    with faulty_staged_server(ParallelConfig(spp=2)) as served:
        yield served


@pytest.fixture(scope="module")
def faulty_spp_kvp_server():
    with faulty_staged_server(ParallelConfig(spp=2, kvp=2)) as served:
        yield served


SERVERS = ["faulty_server", "faulty_spp_server", "faulty_spp_kvp_server"]


def kv_caches(engine) -> list:
    """The KV caches the engine holds: its one, or one per stage."""
    return [engine.kv_cache] if engine.pipeline is None else list(engine.pipeline.kv_caches)


def kv_cache_layout(engine) -> list[tuple]:
    """(shape, sharding) of every KV cache array the engine holds."""
    return [(leaf.shape, leaf.sharding) for leaf in jax.tree.leaves(kv_caches(engine))]


def alone(server, prompt, params=GREEDY):
    out = server.generate(TokensPrompt(prompt), params)
    assert out.finish_reason == "length"
    return out.token_ids


@pytest.mark.slow
@pytest.mark.parametrize("served,queued", [("faulty_server", False),
                                           ("faulty_spp_server", False),
                                           ("faulty_spp_server", True),
                                           ("faulty_spp_kvp_server", True)])
def test_a_step_failing_on_the_device_fails_only_its_batch(served, queued, request):
    """queued: the failing step waits behind other work on its device (tests.test_pipeline.
    occupy), so its error surfaces when its tokens are read, and the batch behind it in
    flight reads the poisoned cache, as on an accelerator; else XLA:CPU runs its
    single-device programs inline and the error surfaces in dispatch, with the cache
    donated. (A program over several devices, kvp here, is never run inline.)"""
    server, fault = request.getfixturevalue(served)
    reference = {p: alone(server, p) for p in PROMPTS + [LONG]}
    seeded_reference = alone(server, PROMPTS[0], SEEDED)
    assert wait_until_idle(server)
    server.engine.allocator.drop_prefix_cache()   # the loop is idle: LONG must be computed
    for prompt in PROMPTS[:2]:                   # ... and these two are cached before the fault
        alone(server, prompt)
    assert server.engine.allocator.num_cached_pages > 0

    engine, controller = server.engine, server.controller
    layout, fired = kv_cache_layout(engine), fault.fired      # the server may have served before
    first_stage_devices = (1 if engine.pipeline is None
                           else engine.pipeline.stages[0].mesh.devices.size)
    real_dispatch = engine.dispatch
    long_started, seen, dispatched = threading.Event(), {}, []

    def dispatch(batch):
        # Arms the fault for the first step that leaves out a request holding pages (the
        # long prompt, half prefilled, overtaken by more urgent ones); the fault itself
        # fires on the device. The steps still in flight finish first, so the first
        # callback after arming is this step's (at spp = 2, its first stage's).
        in_batch = {c.request.request_id for c in batch.chunks}
        holding = {r.request_id for r in controller.unfinished()
                   if controller.kv.has(r.request_id)}
        arm = not seen and holding - in_batch
        if arm:
            jax.block_until_ready([pending.outputs.tokens for pending in dispatched])
            fault.arm(calls=first_stage_devices)
            seen.update(batch=in_batch, holding=holding, raised_in_dispatch=True)
            if queued:
                occupy(engine.model.mesh.devices.flat[0])
        dispatched.append(real_dispatch(batch))
        if arm:
            seen["raised_in_dispatch"] = False
        long_started.set()
        return dispatched[-1]

    engine.dispatch = dispatch
    try:
        # The long prompt starts alone, in the lowest priority class: the others, more
        # urgent, overtake it once its first chunk ran.
        handles = {LONG: server.submit(list(LONG), GREEDY, priority=1)}
        assert long_started.wait(60)
        handles.update((p, server.submit(list(p), GREEDY)) for p in PROMPTS)
        seeded = server.submit(list(PROMPTS[0]), SEEDED)
        outputs = {p: h.result(timeout=120) for p, h in handles.items()}
        seeded_out = seeded.result(timeout=120)
    finally:
        del engine.dispatch
    assert fault.fired == fired + 1
    assert seen["raised_in_dispatch"] is not queued
    failing = seen["batch"]
    survivors_holding_pages = seen["holding"] - failing
    assert survivors_holding_pages
    everyone = {h.id: (p, outputs[p]) for p, h in handles.items()}
    everyone[seeded.id] = (None, seeded_out)
    assert failing <= everyone.keys()
    for rid, (prompt, out) in everyone.items():
        if rid in failing:
            assert out.finish_reason == "error" and FAULT in out.error, out
        else:
            expected = seeded_reference if prompt is None else reference[prompt]
            assert (out.finish_reason, out.token_ids) == ("length", expected), rid
    assert all(everyone[rid][1].metrics.num_preemptions == 1 for rid in survivors_holding_pages)
    assert wait_until_idle(server)
    assert kv_cache_layout(engine) == layout
    # The old cache's prefixes are gone: a prompt computed before the fault is computed
    # again (reusing its zeroed pages would change its tokens), and the server serves on.
    for prompt in PROMPTS[:2]:
        assert alone(server, prompt) == reference[prompt]
    assert wait_until_idle(server)


@pytest.mark.parametrize("served", SERVERS)
def test_recovery_is_a_no_op_when_the_cache_is_intact(served, request):
    engine = request.getfixturevalue(served)[0].engine
    caches = kv_caches(engine)
    assert engine.recover_kv_cache() is False
    assert all(now is before for now, before in zip(kv_caches(engine), caches))


@pytest.fixture(scope="module")
def tiny(faulty_server):
    """The served model (loading another costs seconds); tests patch only their own use."""
    return faulty_server[0].model


def test_out_of_memory_at_start_up_says_what_was_asked_and_what_fits(tiny, monkeypatch):
    model = tiny

    def exhausted(num_pages, page_size):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to "
                                         "allocate 1234 bytes")

    monkeypatch.setattr(model, "new_kv_cache", exhausted)
    with pytest.raises(MemoryError, match=r"out of memory allocating the KV cache: 128 pages of "
                                          r"16 tokens \(shape \(2, 128, 16, \d+\), float32\) "
                                          r"need [\d.]+ GiB on each device, [\d.]+ MiB per page"
                                          r".*lower EngineConfig.max_kv_tokens"):
        Engine(model, EngineConfig(page_size=16, max_kv_tokens=2048))


def test_dropping_the_prefix_cache_frees_cached_pages_and_forgets_their_prefixes():
    from medha_jax.kv_cache.allocator import BlockAllocator

    for shards in (1, 2):
        allocator = BlockAllocator(8, 4, num_shards=shards, max_tokens_per_shard=16)
        tokens = list(range(13))
        allocator.allocate("a", tokens)
        assert allocator.reserve("a", 13)
        allocator.commit("a", tokens, 13)
        with pytest.raises(ValueError, match="1 requests still hold pages"):
            allocator.drop_prefix_cache()
        allocator.free("a")
        assert allocator.num_cached_pages == 3
        allocator.drop_prefix_cache()
        assert allocator.num_cached_pages == 0
        assert allocator.num_free_pages == allocator.num_pages
        assert allocator.allocate("b", tokens) == 0          # nothing is reused
        assert allocator.reserve("b", 16)                     # the freed pages serve again
        allocator.free("b")
        assert allocator.num_free_pages == allocator.num_pages


def test_the_out_of_memory_message_says_how_many_pages_fit(tiny):
    from medha_jax.engine.engine import kv_cache_oom_message

    model = tiny
    shape, _ = model.kv_cache_sharding(128, 16)
    per_page = 2 * 4 * shape[0] * shape[2] * shape[3]       # float32 K and V
    message = kv_cache_oom_message(model, 128, 16, memory_stats={
        "bytes_limit": 100 * per_page + 2**20, "bytes_in_use": 2**20 + per_page // 2})
    assert "room for about 99 pages per device" in message
