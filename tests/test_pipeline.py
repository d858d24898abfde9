"""The SPP pipeline: one program per stage, handed on with device_put, never waited on.

Tokens through the stages equal the one-device engine step's; the stage programs gather no
weights (the engine's one-program step on the same spp mesh does); and batches in flight
overlap: n batches through s stages take about n + s - 1 stage times, not n * s.
"""

import time
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from medha_jax import hlo
from medha_jax.buckets import BucketLadder
from medha_jax.engine.engine import step
from medha_jax.engine.step_inputs import StepInputs
from medha_jax.engine.pipeline import PipelinedStep, ProcessHop, process_hop
from medha_jax.engine.step_inputs import build_step_inputs
from medha_jax.kv_cache.allocator import BlockAllocator
from medha_jax.model.stages import split_stages
from medha_jax.request import Batch, Request, ScheduledChunk
from medha_jax.sampling_params import SamplingParams
from meshes import ParallelConfig, replicated
from tests.test_stages import tiny_model

PAGE_SIZE, NUM_PAGES = 16, 16
LADDER = BucketLadder.from_limits(max_tokens=32, max_seqs=4, max_pages_per_seq=NUM_PAGES)


def run_schedule(execute) -> dict[str, list[int]]:
    """Two requests through a fixed schedule: a chunked prefill of "a" (its second chunk
    crosses a page) beside the whole prompt of "b", then decodes of both. "b" samples at
    temperature 0.8 with a seed, so the sampler's inputs reach the last stage too.

    execute(StepInputs) -> sampled ids (host or device array). Returns each request's output.
    """
    rng = np.random.default_rng(3)
    requests = [
        Request("a", 24, 4, 0.0, prompt_token_ids=rng.integers(0, 256, 24).tolist(),
                sampling=SamplingParams(max_tokens=4, temperature=0.0)),
        Request("b", 8, 4, 0.0, prompt_token_ids=rng.integers(0, 256, 8).tolist(),
                sampling=SamplingParams(max_tokens=4, temperature=0.8, seed=11))]
    allocator = BlockAllocator(NUM_PAGES, PAGE_SIZE, enable_prefix_caching=False)
    for request in requests:
        allocator.allocate(request.request_id)
    a, b = requests
    schedule = [[(a, 16)], [(a, 8), (b, 8)]] + [[(a, 1), (b, 1)]] * 3
    for planned in schedule:
        chunks = []
        for request, n in planned:
            assert allocator.reserve(request.request_id, request.num_computed_tokens + n)
            chunks.append(ScheduledChunk(request, request.num_computed_tokens, n))
        inputs = build_step_inputs(Batch(chunks), allocator, LADDER,
                                   pad_slot=NUM_PAGES * PAGE_SIZE)
        tokens = np.asarray(execute(inputs).tokens)
        for i, chunk in enumerate(chunks):
            chunk.request.num_computed_tokens = chunk.end
            if chunk.samples:
                chunk.request.output_token_ids.append(int(tokens[i]))
    return {request.request_id: request.output_token_ids for request in requests}


def engine_step_executor(model):
    """The engine's one-program step over `model`, with its own cache."""
    state = {"cache": model.new_kv_cache(NUM_PAGES, PAGE_SIZE)}

    def execute(inputs):
        packed = jax.device_put(inputs.pack(), replicated(model.mesh))
        with jax.set_mesh(model.mesh):
            outputs, state["cache"] = step(model.graphdef, model.state, state["cache"], *packed,
                                           shape=inputs.padded_shape)
        return outputs

    return execute


SHAPES = [(16, 4, 16)]       # the one bucket run_schedule's steps fall in: one compile each


@pytest.mark.parametrize("num_layers,spp,tp", [(2, 2, 1), (2, 2, 2), (4, 4, 2)])
def test_pipeline_gives_the_one_device_tokens(num_layers, spp, tp):
    expected = run_schedule(engine_step_executor(tiny_model(num_layers, ParallelConfig())))
    pipeline = PipelinedStep(split_stages(tiny_model(num_layers, ParallelConfig(spp=spp, tp=tp))),
                             num_pages=NUM_PAGES, page_size=PAGE_SIZE)
    pipeline.warmup(SHAPES)
    assert len(pipeline.executables) == spp * len(SHAPES)
    assert run_schedule(pipeline.dispatch) == expected
    # Each stage's cache holds its own layers, on its own devices.
    for stage, cache in zip(pipeline.stages, pipeline.kv_caches):
        assert cache.k.shape[0] == num_layers // spp
        assert cache.k.sharding.mesh == stage.mesh


def _weight_gathers(compiled, model, shape=None) -> list[hlo.Collective]:
    """All-gathers whose result has the shape of a weight: a whole stack, a stage's slice
    of one, one layer of one, or any of these with one dimension still split in two.
    (The last stage gathers [S, vocab] logits for the sampler and [T, vocab] ones for prompt
    logprobs: activations, not weights; with the bucket `shape` = (T, S, W) given, those
    are left out where they coincide with a weight's shape.)"""
    shapes = set()
    for array in jax.tree.leaves(nnx.state(model.module, nnx.Param)):
        full = tuple(array.shape)
        for candidate in (full, full[1:], (full[0] // 2,) + full[1:]):
            shapes.add(candidate)
            shapes.update(candidate[:d] + (candidate[d] // 2,) + candidate[d + 1:]
                          for d in range(len(candidate)))
    if shape is not None:
        vocab = model.config.vocab_size
        shapes -= {(shape[0], vocab), (shape[1], vocab)}
    return [c for c in hlo.collectives(compiled.as_text())
            if c.op == "all-gather" and _dims(c.shape) in shapes]


def _dims(shape_text: str) -> tuple[int, ...]:
    """Dimensions of an HLO array shape "f32[4,256]{0,1}"."""
    dims = shape_text.split("[", 1)[1].split("]", 1)[0]
    return tuple(int(d) for d in dims.split(",") if d)


def test_stage_programs_gather_no_weights():
    model = tiny_model(2, ParallelConfig(spp=2, tp=2))
    shape = SHAPES[0]
    # Control: the one-program step on the same mesh all-gathers the spp-sharded stack
    # (issue 13), so this check does see a gather of weights when there is one.
    one_program = step.lower(
        model.graphdef, model.state, model.new_kv_cache(NUM_PAGES, PAGE_SIZE),
        *jax.device_put(StepInputs.padding(shape, NUM_PAGES * PAGE_SIZE).pack(),
                        replicated(model.mesh)), shape=shape)
    with jax.set_mesh(model.mesh):
        assert _weight_gathers(one_program.compile(), model)

    pipeline = PipelinedStep(split_stages(model), num_pages=NUM_PAGES, page_size=PAGE_SIZE)
    pipeline.compile(shape)
    for (s, _), compiled in pipeline.executables.items():
        assert _weight_gathers(compiled, model, shape) == [], s


def callback_hook(callback):
    """A StageHook that calls `callback(x) -> np.int32(0)` on the host in every stage program,
    once per device of the stage (x: a float32 scalar of the activations). Its result is
    added to the activations, so XLA can neither drop the call nor run it before the stage
    has its input.

    Per device, under shard_map: a plain callback in a program over several devices runs
    on one of them and sends its result to the others, so one that raises leaves them
    waiting in that collective, and XLA:CPU aborts the process."""

    def on_device(x):
        return jax.pure_callback(callback, jax.ShapeDtypeStruct((), jnp.int32), x)

    def hook(stage_index, hidden):
        x = hidden[0, 0].astype(jnp.float32)
        zero = jax.shard_map(on_device, in_specs=P(), out_specs=P(), check_vma=False)(x)
        return hidden + zero.astype(hidden.dtype)

    return hook


class SleepingStages:
    """Host callback of a stage hook: each call sleeps `seconds` (a stage of known cost that
    burns no CPU, so two cores do not bound how many stages run at once) and records when."""

    def __init__(self, seconds: float):
        self.seconds, self.calls = seconds, []

    def __call__(self, x):
        start = time.perf_counter()
        time.sleep(self.seconds)
        self.calls.append((start, time.perf_counter()))
        return np.int32(0)

    def span(self) -> float:
        """From the first stage's start to the last stage's end."""
        return max(end for _, end in self.calls) - min(start for start, _ in self.calls)


@jax.jit
def _busy(x):
    """A few tens of milliseconds of device work (no callback)."""
    w = jnp.full((200, 200), 1e-3, jnp.float32)
    return jax.lax.fori_loop(0, 200, lambda i, y: jnp.tanh(y @ w + x), jnp.ones((200, 200)))


def occupy(device) -> jax.Array:
    """Queues a few tens of milliseconds of work on `device`, so that the next program
    there is queued too rather than run inline.

    XLA:CPU runs a program that holds a host callback (a callback_hook) inline, on the
    dispatching thread, when all its inputs are ready: PjRt-IFRT forces synchronous
    execution of such programs on the CPU, against deadlocks with reentrant callbacks. A
    program with an input still pending, or queued behind a pending program on its device,
    goes to the client's worker threads instead, and so does every program that waits on
    it (a stage's donated cache, the activations handed on): dispatch returns at once and
    an error surfaces when the results are read, as on an accelerator, where nothing runs
    inline."""
    return _busy(jax.device_put(np.float32(0), device))


@pytest.mark.parametrize("spp", [2, 4])
def test_batches_in_flight_overlap_across_stages(spp):
    """n batches through s stages of known cost T finish in about (n + s - 1) T, not n s T."""
    num_batches, stage_seconds = 6, 0.1
    sleeping = SleepingStages(stage_seconds)
    pipeline = PipelinedStep(split_stages(tiny_model(spp, ParallelConfig(spp=spp))),
                             num_pages=NUM_PAGES, page_size=PAGE_SIZE,
                             hook=callback_hook(sleeping))
    shape = (16, 1, 1)                        # the smallest bucket: the programs compile fast
    pipeline.compile(shape)
    padding = StepInputs.padding(shape, NUM_PAGES * PAGE_SIZE)
    jax.block_until_ready(pipeline.dispatch(padding))
    first_device = pipeline.stages[0].mesh.devices.flat[0]
    occupy(first_device).block_until_ready()

    ratios = []
    for _ in range(2):                        # the better of two rounds: robust to a busy machine
        sleeping.calls.clear()
        # Without it the sleeps would run inline, one after another, on this thread.
        occupy(first_device)
        jax.block_until_ready([pipeline.dispatch(padding) for _ in range(num_batches)])
        assert len(sleeping.calls) == num_batches * spp
        ratios.append(sleeping.span() / ((num_batches + spp - 1) * stage_seconds))
    # Stage 0 runs the n batches one after another and the last one then crosses s - 1 more
    # stages: (n + s - 1) T is a floor. One batch at a time would take n s T
    # (12 T at s = 2, 24 T at s = 4, against 7 T and 9 T).
    assert 0.99 <= min(ratios) <= 1.25, ratios


def _stages_on(*processes_of_stage):
    """Stand-in stages whose meshes' devices belong to the given processes."""
    return [SimpleNamespace(mesh=SimpleNamespace(devices=np.array(
        [SimpleNamespace(process_index=p) for p in processes], dtype=object)))
        for processes in processes_of_stage]


@pytest.mark.parametrize("processes, hop", [
    (([0], [0]), None),                                     # one process
    (([0, 1], [0, 1]), None),                               # every stage on both
    (([0], [1]), ProcessHop(1, (1,), 1)),                   # a stage per process
    (([0, 1], [2, 3]), ProcessHop(1, (2, 3), 2)),           # a stage per two processes
    (([0], [0], [1], [1]), ProcessHop(2, (1,), 1)),         # two stages per process
])
def test_process_hop_is_where_activations_leave_process_0(processes, hop):
    assert process_hop(_stages_on(*processes)) == hop


def test_a_second_hop_between_processes_is_refused():
    with pytest.raises(ValueError, match=r"more than once \(process 2's first stage is 2"):
        process_hop(_stages_on([0], [1], [2]))
