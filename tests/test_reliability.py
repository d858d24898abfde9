"""A step that fails ON THE DEVICE in the middle of a run, and out of memory at start-up.

The engine's step is swapped for one that runs the real step plus a host callback inside
the same compiled program; the callback raises when armed, so XLA's execution fails
after dispatch, with the KV cache already donated to it. That batch's requests get the
error; every other request completes with exactly the tokens it gets alone; every page
returns; the prefix cache forgets pages whose contents went with the old cache.
"""

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
from serving.server import Server, TokensPrompt
from tests.test_server import GREEDY, TINY_ENGINE, byte_level_tokenizer, wait_until_idle

FAULT = "injected device fault"
PROMPTS = [tuple(range(1 + i, 20 + 3 * i)) for i in range(4)]
LONG = tuple(range(100, 220))
SEEDED = SamplingParams(temperature=1.0, top_k=20, max_tokens=12, seed=7)


class DeviceFault:
    """A callback run inside the compiled step: raises (on the device's host thread, in
    the middle of XLA's execution) when armed, once."""

    def __init__(self):
        self.armed = threading.Event()
        self.fired = 0

    def __call__(self, token_sum):
        if self.armed.is_set():
            self.armed.clear()
            self.fired += 1
            raise RuntimeError(FAULT)
        return np.int32(0)


def faulty_step(fault: DeviceFault):
    """engine.step with the fault's callback inside the same executable; its result feeds
    the sampled tokens (adding 0), so XLA cannot drop it."""
    real_step = engine_module.step

    @functools.partial(jax.jit, static_argnames=("graphdef", "shape", "num_kv_shards",
                                                 "cp_ranks"),
                       donate_argnames=("kv_cache",))
    def step(graphdef, state, kv_cache, ints, floats, rng_keys, *, shape, num_kv_shards=1,
             cp_ranks=1):
        outputs, kv_cache = real_step(graphdef, state, kv_cache, ints, floats, rng_keys,
                                      shape=shape, num_kv_shards=num_kv_shards,
                                      cp_ranks=cp_ranks)
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


def alone(server, prompt, params=GREEDY):
    out = server.generate(TokensPrompt(prompt), params)
    assert out.finish_reason == "length"
    return out.token_ids


@pytest.mark.slow
def test_a_step_failing_on_the_device_fails_only_its_batch(faulty_server):
    server, fault = faulty_server
    reference = {p: alone(server, p) for p in PROMPTS + [LONG]}
    seeded_reference = alone(server, PROMPTS[0], SEEDED)
    assert wait_until_idle(server)
    server.engine.allocator.drop_prefix_cache()   # the loop is idle: LONG must be computed
    for prompt in PROMPTS[:2]:                   # ... and these two are cached before the fault
        alone(server, prompt)
    assert server.engine.allocator.num_cached_pages > 0

    engine, controller = server.engine, server.controller
    real_dispatch = engine.dispatch
    long_started, seen = threading.Event(), {}

    def dispatch(batch):
        # Arms the fault for the first step that leaves out a request holding pages (the
        # long prompt, half prefilled, overtaken by more urgent ones); the fault itself
        # fires on the device.
        in_batch = {c.request.request_id for c in batch.chunks}
        holding = {r.request_id for r in controller.unfinished()
                   if controller.kv.has(r.request_id)}
        if not seen and holding - in_batch:
            fault.armed.set()
            seen.update(batch=in_batch, holding=holding)
        pending = real_dispatch(batch)
        long_started.set()
        return pending

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
    assert fault.fired == 1
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
    # The old cache's prefixes are gone: a prompt computed before the fault is computed
    # again (reusing its zeroed pages would change its tokens), and the server serves on.
    for prompt in PROMPTS[:2]:
        assert alone(server, prompt) == reference[prompt]
    assert wait_until_idle(server)


def test_recovery_is_a_no_op_when_the_cache_is_intact(faulty_server):
    server, _ = faulty_server
    cache = server.engine.kv_cache
    assert server.engine.recover_kv_cache() is False
    assert server.engine.kv_cache is cache


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
                                          r"16 tokens \(shape \(2, 128, 16, \d+, \d+\), float32\) "
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
    per_page = 2 * 4 * shape[0] * shape[2] * shape[3] * shape[4]       # float32 K and V
    message = kv_cache_oom_message(model, 128, 16, memory_stats={
        "bytes_limit": 100 * per_page + 2**20, "bytes_in_use": 2**20 + per_page // 2})
    assert "room for about 99 pages per device" in message
