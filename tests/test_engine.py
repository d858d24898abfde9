"""The engine: nothing compiles after warm-up; outputs don't depend on batching or chunking."""

import contextlib
import dataclasses
import threading

import jax
import numpy as np
import pytest

from medha_jax import ParallelConfig, load_model
from medha_jax.engine import Engine, EngineConfig
from medha_jax.request import Batch, Request, ScheduledChunk
from medha_jax.sampling_params import SamplingParams
from tests.hf_oracle import greedy_with_logits

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@pytest.fixture(scope="module")
def model():
    return load_model("tiny")


# Its ladder starts at 16 tokens, not the default 1: the warm-up tests count its 8 shapes.
SMALL = EngineConfig(max_kv_tokens=4096, max_tokens_per_step=128, max_seqs=8, max_model_len=512,
                     enable_prefix_caching=False, min_token_bucket=16)


def make_request(request_id, prompt, max_new_tokens, **sampling):
    params = SamplingParams(max_tokens=max_new_tokens, **{"temperature": 0.0, **sampling})
    return Request(request_id, len(prompt), max_new_tokens, 0.0, prompt_token_ids=list(prompt),
                   sampling=params)


def assert_same_logprobs(got: dict, want: dict, *, atol: float = 1e-4, what: str = ""):
    """Two `drive(logprobs=...)` dicts agree: the same requests, sampled tokens and prompt
    positions, the same top ids, every logprob within atol."""
    assert sorted(got) == sorted(want)
    for rid, (sampled, prompt) in want.items():
        got_sampled, got_prompt = got[rid]
        assert sorted(got_prompt) == sorted(prompt), (rid, what)
        entries = [*sampled, *(prompt[p] for p in sorted(prompt))]
        got_entries = [*got_sampled, *(got_prompt[p] for p in sorted(prompt))]
        assert [(e.token_id, [i for i, _ in e.top]) for e in got_entries] == \
            [(e.token_id, [i for i, _ in e.top]) for e in entries], (rid, what)
        np.testing.assert_allclose([[e.logprob, *(lp for _, lp in e.top)] for e in got_entries],
                                   [[e.logprob, *(lp for _, lp in e.top)] for e in entries],
                                   atol=atol, rtol=0, err_msg=f"{rid} {what}")


def drive(engine, arrivals, *, rng, max_chunk, chunk_of=None, logprobs=None):
    """Runs requests to completion with random chunk sizes, decodes batched with prefills.

    arrivals: list of (step, Request). A tiny stand-in for the controller, so that this
    test exercises the engine alone with arbitrary chunkings. logprobs: a dict to fill
    with request id -> (its sampled tokens' TokenLogprobs, its prompt's by position).
    """
    arrivals = sorted(arrivals, key=lambda a: a[0])
    running, done, step = [], {}, 0
    while arrivals or running:
        while arrivals and arrivals[0][0] <= step:
            request = arrivals.pop(0)[1]
            request.num_computed_tokens = engine.allocator.allocate(
                request.request_id, request.prompt_token_ids)
            running.append(request)
        chunks, budget = [], engine.ladder.max_tokens
        for request in running:
            if len(chunks) == engine.ladder.max_seqs or budget == 0:
                break
            pending = request.num_pending_tokens
            want = chunk_of(request) if chunk_of else int(rng.integers(1, max_chunk + 1))
            n = min(pending, want, budget)
            assert engine.allocator.reserve(request.request_id, request.num_computed_tokens + n)
            chunks.append(ScheduledChunk(request, request.num_computed_tokens, n))
            budget -= n
        step += 1
        if not chunks:
            continue
        result = engine.execute(Batch(chunks))
        for chunk in chunks:
            request = chunk.request
            if logprobs is not None:
                sampled, prompt = logprobs.setdefault(request.request_id, ([], {}))
                if request.request_id in result.logprobs:
                    sampled.append(result.logprobs[request.request_id])
                prompt.update(result.prompt_logprobs.get(request.request_id, {}))
            request.num_computed_tokens = chunk.end
            engine.allocator.commit(request.request_id, request.token_ids(0, chunk.end), chunk.end)
            if chunk.samples:
                request.output_token_ids.append(result.sampled_token_ids[request.request_id])
                if len(request.output_token_ids) == request.max_new_tokens:
                    engine.allocator.free(request.request_id)
                    running.remove(request)
                    done[request.request_id] = list(request.output_token_ids)
    return done


def count_compiles(engine):
    """Records every shape the engine compiles from now on (the one way it compiles)."""
    shapes, compile_shape = [], engine._compile

    def counted(shape):
        shapes.append(shape)
        return compile_shape(shape)

    engine._compile = counted
    return shapes


@contextlib.contextmanager
def backend_compiles():
    """Collects every compile JAX's back-end runs while open (any program, not only the
    engine's steps: a stray jnp op on the host path compiles too)."""
    compiles = []

    def listener(event, duration, **kwargs):
        if event == COMPILE_EVENT:
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def one_chunk_batch(engine, request_id, num_tokens):
    request = make_request(request_id, list(range(num_tokens)), 1)
    engine.allocator.allocate(request_id, request.prompt_token_ids)
    assert engine.allocator.reserve(request_id, num_tokens)
    return Batch([ScheduledChunk(request, 0, num_tokens)])


@pytest.mark.slow
def test_mixed_workload_never_compiles_after_warmup(model):
    # Chunks up to 256 tokens; a short ladder (3 token rungs x 1 seq rung x 3 widths) keeps
    # warm-up quick on two cores. The 1500-token prompts still fill the widest page tables.
    engine = Engine(model, EngineConfig(max_kv_tokens=16_384, max_tokens_per_step=256,
                                        min_token_bucket=64, max_seqs=8, max_model_len=2048))
    engine.warmup(progress=False)
    assert engine.num_executables == len(engine.ladder.all_shapes())
    engine_compiles = count_compiles(engine)

    with backend_compiles() as compiles:
        rng = np.random.default_rng(0)
        arrivals = []
        for i in range(48):
            prompt_len = int(rng.choice([1, 5, 40, 300, 1500]))
            prompt = rng.integers(0, model.config.vocab_size, prompt_len)
            arrivals.append((int(rng.integers(0, 300)),
                             make_request(f"r{i}", prompt, int(rng.integers(1, 24)),
                                          temperature=float(rng.choice([0.0, 0.9])), seed=i)))
        done = drive(engine, arrivals, rng=rng, max_chunk=256)
    assert len(done) == 48
    assert len(engine.step_records) >= 150
    assert compiles == [] and engine_compiles == []
    assert engine.num_executables == len(engine.ladder.all_shapes())
    assert engine.allocator.num_free_pages == engine.allocator.num_pages


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.8, top_p=0.9, seed=7)],
                         ids=["greedy", "seeded"])
def test_outputs_do_not_depend_on_batching_or_chunking(model, sampling):
    config = SMALL
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 256, 90).tolist()
    others = [rng.integers(0, 256, int(n)).tolist() for n in (3, 50, 120)]

    alone = drive(Engine(model, config), [(0, make_request("x", prompt, 8, **sampling))],
                  rng=rng, max_chunk=0, chunk_of=lambda r: r.num_pending_tokens)["x"]
    batched = drive(
        Engine(model, config),
        [(0, make_request(f"o{i}", p, 6, temperature=0.7)) for i, p in enumerate(others)]
        + [(2, make_request("x", prompt, 8, **sampling))],
        rng=np.random.default_rng(2), max_chunk=17)["x"]
    assert batched == alone
    if not sampling.get("temperature"):
        assert alone == greedy_with_logits(model, prompt, 8)


def test_one_token_steps_give_the_model_greedy_tokens(model):
    """With the token ladder from 1, a request fed one token a step runs every step at
    T = 1, whose cache write carries a second, dropped row (the one-row scatter XLA would
    turn into a whole-cache copy): the tokens are the model's greedy ones."""
    engine = Engine(model, dataclasses.replace(SMALL, min_token_bucket=1))
    assert engine.ladder.token_buckets[0] == 1
    prompt = np.random.default_rng(3).integers(0, 256, 20).tolist()
    shapes = count_compiles(engine)
    done = drive(engine, [(0, make_request("x", prompt, 6))], rng=np.random.default_rng(0),
                 max_chunk=0, chunk_of=lambda r: 1)
    assert {shape[0] for shape in shapes} == {1}
    assert done["x"] == greedy_with_logits(model, prompt, 6)


def test_small_decodes_run_at_as_many_rows_as_sequences_and_give_greedy_tokens(model):
    """With the default ladder (tokens from 1, sequence rungs capped at the step's token
    bucket), 3 requests decoding together run at (T, S) = (4, 4) and one alone at (1, 1),
    not at the smallest sequence rung of 8: the tokens are each request's greedy ones."""
    engine = Engine(model, dataclasses.replace(SMALL, min_token_bucket=EngineConfig().min_token_bucket))
    rng = np.random.default_rng(5)
    prompts = {f"r{i}": rng.integers(0, 256, n).tolist() for i, n in enumerate((9, 21, 14))}
    new_tokens = {"r0": 3, "r1": 6, "r2": 4}
    shapes = count_compiles(engine)
    done = drive(engine, [(0, make_request(rid, p, new_tokens[rid])) for rid, p in prompts.items()],
                 rng=np.random.default_rng(0), max_chunk=64)
    assert {(4, 4), (1, 1)} <= {shape[:2] for shape in shapes}
    assert all(s <= t for t, s, _ in shapes)
    for rid, prompt in prompts.items():
        assert done[rid] == greedy_with_logits(model, prompt, new_tokens[rid])
    assert engine.allocator.num_free_pages == engine.allocator.num_pages


def test_prefix_reuse_gives_the_same_tokens(model):
    engine = Engine(model, dataclasses.replace(SMALL, enable_prefix_caching=True))
    prompt = np.random.default_rng(3).integers(0, 256, 70).tolist()
    first = drive(engine, [(0, make_request("a", prompt, 4))], rng=np.random.default_rng(0),
                  max_chunk=64)["a"]
    second_request = make_request("b", prompt + [5], 4)
    second = drive(engine, [(0, second_request)], rng=np.random.default_rng(0), max_chunk=64)["b"]
    assert second_request.num_computed_tokens >= 64  # 4 full pages came from the cache
    assert second == greedy_with_logits(model, prompt + [5], 4)
    assert first == greedy_with_logits(model, prompt, 4)


def test_batch_beyond_the_largest_bucket_is_a_clear_error(model):
    engine = Engine(model, SMALL)
    request = make_request("big", list(range(140)), 1)
    engine.allocator.allocate("big", request.prompt_token_ids)
    engine.allocator.reserve("big", 140)
    with pytest.raises(ValueError, match="tokens n=140 exceeds the largest bucket 128"):
        engine.execute(Batch([ScheduledChunk(request, 0, 140)]))


def test_before_warmup_a_shape_compiles_once_ahead_of_time(model):
    engine = Engine(model, SMALL)
    compiled = count_compiles(engine)
    engine.execute(one_chunk_batch(engine, "a", 10))
    engine.execute(one_chunk_batch(engine, "b", 12))          # same bucket: no second compile
    assert compiled == [(16, 8, 16)] and list(engine.executables) == [(16, 8, 16)]
    assert isinstance(engine.executables[(16, 8, 16)], jax.stages.Compiled)


def test_after_warmup_an_unwarmed_shape_is_an_error_that_names_it(model):
    engine = Engine(model, SMALL)
    engine.warmup(progress=False, shapes=[(16, 8, 16)])
    compiled = count_compiles(engine)
    engine.execute(one_chunk_batch(engine, "in", 16))
    with pytest.raises(RuntimeError, match=r"\(32, 8, 16\) was not compiled at warm-up.*"
                                           r"tokens \(16, 32, 64, 128\), seqs \(8,\), "
                                           r"width \(16, 32\)"):
        engine.execute(one_chunk_batch(engine, "out", 17))
    assert compiled == [] and list(engine.executables) == [(16, 8, 16)]
    engine.warmup(progress=False, shapes=[(32, 8, 16)])        # warming it up is allowed
    engine.execute(one_chunk_batch(engine, "out2", 17))
    assert compiled == [(32, 8, 16)]


def test_background_warmup_compiles_the_rest_and_a_step_never_waits_in_vain(model):
    """warmup(first=...) returns once those shapes are compiled; a background thread
    compiles the rest; a step whose shape the thread has not reached compiles it then,
    each shape is compiled once, the tokens are those of a full warm-up, and a shape
    outside the ladder is still an error."""
    engine = Engine(model, SMALL)        # 4 token x 1 seq x 2 width buckets: 8 shapes
    compiled = count_compiles(engine)
    gate = threading.Event()
    compile_shape = engine._compile

    def held(shape):                     # the background thread waits until the step ran
        if threading.current_thread().name == "medha-warmup":
            gate.wait(600)
        return compile_shape(shape)

    engine._compile = held
    engine.warmup(progress=False, first=[(16, 8, 16)])
    assert engine.warmed_up and engine.warming_up
    assert list(engine.executables) == [(16, 8, 16)]
    # 40 tokens: bucket (64, 8, 16), still queued behind the held thread: compiled now.
    tokens = engine.execute(one_chunk_batch(engine, "a", 40)).sampled_token_ids
    assert (64, 8, 16) in engine.executables and engine.compiles_waited_for == 1
    gate.set()
    assert engine.wait_for_warmup(600)
    assert sorted(compiled) == sorted(engine.ladder.all_shapes())      # each once
    assert engine.warmup_seconds is not None
    with pytest.raises(RuntimeError, match=r"\(256, 8, 16\) was not compiled at warm-up"):
        engine.executable((256, 8, 16))
    full = Engine(model, SMALL)
    full.warmup(progress=False)
    assert full.execute(one_chunk_batch(full, "a", 40)).sampled_token_ids == tokens


@pytest.mark.parametrize("parallel", [ParallelConfig(kvp=2, tp=2), ParallelConfig(spp=2, tp=4)],
                         ids=str)
def test_engine_on_a_mesh_gives_the_one_device_tokens(model, parallel):
    sharded = load_model("tiny", parallel=parallel)
    assert sharded.parallel == parallel
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in (37, 5, 80)]

    def run(m):
        arrivals = [(i, make_request(f"p{i}", p, 6, temperature=0.8, seed=i))
                    for i, p in enumerate(prompts)]
        return drive(Engine(m, SMALL), arrivals, rng=np.random.default_rng(5), max_chunk=24)

    assert run(sharded) == run(model)
