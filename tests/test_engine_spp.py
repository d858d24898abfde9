"""The engine on an spp mesh: one program per stage, batches in flight through the controller.

Tokens equal one device (greedy and seeded sampling) for spp = 2 and 4, alone and with tp and
kvp, on a workload of staggered arrivals, chunked prefills streaming into the pipe beside
decodes, and preemption; nothing compiles after warm-up, on that workload and on a random
one; every page returns; every live array on a device is its stage's weights or KV cache
(the engine takes the model's weights). One program with two batches in flight (the host
builds step n + 1 while the device runs step n) gives the same tokens as one at a time.
"""

import collections
import dataclasses
import gc
import math

import jax
import numpy as np
import pytest

from medha_jax.engine import Engine, EngineConfig
from medha_jax.model.params import param_specs
from medha_jax.request import Request, VirtualClock
from medha_jax.sampling_params import SamplingParams
from medha_jax.scheduler import SchedulerConfig, make_controller
from medha_jax.scheduler.in_flight import InFlightRunner
from medha_jax.scheduler.predictor import AnalyticalPredictor
from meshes import ParallelConfig
from tests.test_engine import backend_compiles, count_compiles
from tests.test_stages import _canonical_params, new_tiny_model, tiny_model

NUM_LAYERS = 4          # spp = 4 needs a multiple of 4
# 8 pages of 16 tokens hold 128 tokens: the workload below needs 178, so one is preempted.
CONFIG = EngineConfig(page_size=16, num_pages=8, max_tokens_per_step=32, min_token_bucket=16,
                      max_seqs=4, max_model_len=128)
# 5 pages on each of 2 KV shards: 160 tokens, a request's first 64 on one shard.
KVP_CONFIG = dataclasses.replace(CONFIG, num_pages=5, max_tokens_per_kvp_group=64)
MAX_STEPS = 2_000        # a run not over by then never ends (requests evicting each other)


def workload() -> list[tuple[int, Request]]:
    """(step it arrives at, request): a long prompt first, shorter ones while it streams,
    and an urgent one late that preempts. Two sample at temperature 0.8 with seeds."""
    rng = np.random.default_rng(7)
    specs = [(0, "long", 70, 6, 1, None), (1, "chat", 9, 6, 1, 1), (2, "doc", 45, 6, 1, None),
             (6, "urgent", 30, 6, 0, 2)]
    return [(step, _request(rid, rng.integers(0, 256, prompt_len).tolist(), max_new, priority,
                            seed))
            for step, rid, prompt_len, max_new, priority, seed in specs]


def random_workload(seed: int, num_requests: int = 12) -> list[tuple[int, Request]]:
    """Arrivals over the first 20 steps: prompts of 1 to 100 tokens, 1 to 12 new tokens,
    two priority classes, greedy or seeded sampling; in arrival order."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num_requests):
        prompt = rng.integers(0, 256, int(rng.integers(1, 101))).tolist()
        seed_or_greedy = int(rng.integers(0, 100)) if rng.random() < 0.5 else None
        out.append((int(rng.integers(0, 20)), _request(f"r{i}", prompt, int(rng.integers(1, 13)),
                                                       int(rng.integers(0, 2)), seed_or_greedy)))
    return sorted(out, key=lambda arrival: arrival[0])


def _request(rid, prompt, max_new, priority, seed) -> Request:
    sampling = (SamplingParams(temperature=0.0, max_tokens=max_new) if seed is None else
                SamplingParams(temperature=0.8, seed=seed, max_tokens=max_new))
    return Request(rid, len(prompt), max_new, 0.0, priority=priority, prompt_token_ids=prompt,
                   sampling=sampling)


@dataclasses.dataclass(frozen=True)
class Served:
    """What a run of `serve` produced and how it ran."""

    outputs: dict[str, list[int]]
    preemptions: int
    mixed_batches: int            # batches that held decodes and prefill chunks together
    peak_in_flight: int           # the most batches dispatched and not yet collected


def serve(engine: Engine, arrivals: list[tuple[int, Request]] | None = None) -> Served:
    """Runs `arrivals` (default: workload()) through the real controller and InFlightRunner,
    up to engine.max_in_flight batches in flight (one: exactly run_one_step)."""
    predictor = AnalyticalPredictor(engine.model.config, ParallelConfig(), "h100",
                                    token_buckets=engine.ladder.token_buckets)
    # A budget of a few tokens' work: prefills are chunked, so chunks stream into the pipe.
    scheduler = SchedulerConfig("lars-mp", token_buckets=engine.ladder.token_buckets,
                                max_seqs_per_batch=engine.max_seqs, target_batch_time_s=1.05e-3)
    controller = make_controller(scheduler, allocator=engine.allocator, clock=VirtualClock(),
                                 predictor=predictor, model_config=engine.model.config,
                                 max_model_len=engine.max_model_len)
    runner = InFlightRunner(controller, engine)
    arrivals = list(workload() if arrivals is None else arrivals)
    requests, step, mixed, peak = [], 0, 0, 0
    while arrivals or controller.has_unfinished():
        assert step < MAX_STEPS, f"no end in {step} steps, {controller.num_preemptions} preemptions"
        while arrivals and arrivals[0][0] <= step:
            requests.append(arrivals.pop(0)[1])
            controller.add_request(requests[-1])
        step += 1
        collected = runner.step()
        if collected is not None:
            peak = max(peak, runner.num_in_flight + 1)          # + the one just collected
            mixed += {c.is_decode for c in collected.batch.chunks} == {True, False}
    assert engine.allocator.num_free_pages == engine.allocator.num_pages
    return Served({r.request_id: r.output_token_ids for r in requests},
                  controller.num_preemptions, mixed, peak)


@pytest.fixture(scope="module")
def expected():
    served = serve(Engine(tiny_model(NUM_LAYERS, ParallelConfig()), CONFIG))
    assert served.preemptions > 0 and served.mixed_batches > 0
    return served.outputs


def warmed_engine(parallel, config, num_layers=NUM_LAYERS):
    """An engine with every bucket compiled, and the shapes it compiles from now on."""
    engine = Engine(new_tiny_model(num_layers, parallel), config)
    engine.warmup(progress=False)
    return engine, count_compiles(engine)


def check_served(served: Served, expected, max_in_flight: int) -> None:
    """The one-device tokens, with preemption, mixed batches and batches in flight."""
    assert served.outputs == expected
    assert served.preemptions > 0 and served.mixed_batches > 0
    assert 2 <= served.peak_in_flight <= max_in_flight


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [ParallelConfig(spp=2), ParallelConfig(spp=4)], ids=str)
def test_spp_engine_gives_the_one_device_tokens(expected, parallel):
    engine, compiled = warmed_engine(parallel, CONFIG)
    assert engine.max_in_flight == parallel.spp and engine.kv_cache is None
    assert len(engine.pipeline.executables) == parallel.spp * len(engine.ladder.all_shapes())
    check_served(serve(engine), expected, parallel.spp)
    assert compiled == []


@pytest.mark.slow
def test_spp_with_kvp_and_tp_gives_the_one_device_tokens(expected):
    engine, compiled = warmed_engine(ParallelConfig(spp=2, kvp=2, tp=2), KVP_CONFIG)
    assert engine.num_kv_shards == 2 and engine.max_model_len == 128
    check_served(serve(engine), expected, 2)
    assert compiled == []


def test_two_batches_in_flight_on_one_program_give_the_same_tokens(expected):
    # spp = 1: the host forms and builds step n + 1 while the device runs step n.
    engine = Engine(tiny_model(NUM_LAYERS, ParallelConfig()),
                    dataclasses.replace(CONFIG, max_batches_in_flight=2))
    assert engine.pipeline is None and engine.max_in_flight == 2
    check_served(serve(engine), expected, 2)


def test_random_workload_at_spp2_never_compiles_after_warmup():
    # In 8 pages (128 tokens for prompts of up to 100 + 12), so requests preempt each other
    # with batches in flight; eviction ranks requests as if restarted, so all of them end
    # (tests/test_in_flight.py, fitting one at a time).
    engine, compiled = warmed_engine(ParallelConfig(spp=2), CONFIG, num_layers=2)
    arrivals = random_workload(seed=0)
    with backend_compiles() as compiles:
        served = serve(engine, arrivals)
    assert compiles == [] and compiled == []
    assert served.peak_in_flight == 2 and served.preemptions > 0
    assert {rid: len(out) for rid, out in served.outputs.items()} == {
        r.request_id: r.max_new_tokens for _, r in arrivals}


def test_each_device_holds_only_its_stages_weights():
    engine = Engine(new_tiny_model(NUM_LAYERS, ParallelConfig(spp=4, tp=2)), CONFIG)
    config = engine.model.config
    specs = param_specs(config)
    itemsize = 4                                                      # float32
    per_layer = sum(np.prod(s.shape[1:]) for s in specs.values() if s.per_layer) * itemsize
    embed = np.prod(specs["embed"].shape) * itemsize
    head = (np.prod(specs["lm_head"].shape) + np.prod(specs["final_norm"].shape)) * itemsize
    held = engine.pipeline.weight_bytes_per_device()
    for stage in engine.pipeline.stages:
        expected = per_layer * NUM_LAYERS // 4
        expected += embed if stage.spec.is_first else 0
        expected += head if stage.spec.is_last else 0
        for device in stage.mesh.devices.flat:
            # tp = 2 halves every weight but the norms (replicated): between half and all.
            assert expected / 2 <= held[device] < 0.6 * expected, (stage.spec.index, device)
    whole = per_layer * NUM_LAYERS + embed + head
    assert max(held.values()) < whole / 4
    assert set(held) == set(jax.devices()[:8])


def device_buffers(arrays) -> dict[tuple[jax.Device, int], int]:
    """(device, buffer address) -> bytes of every shard of `arrays`, each buffer once: a
    stage's array and the single-device pieces it was assembled from share buffers."""
    return {(shard.device, shard.data.unsafe_buffer_pointer()): shard.data.nbytes
            for array in arrays for shard in array.addressable_shards}


@pytest.mark.parametrize("spp", [2, 4])
def test_every_live_array_on_a_device_is_its_stages_weights_or_cache(spp):
    _canonical_params("tiny", NUM_LAYERS)            # the weights' host copy, drawn for the session
    gc.collect()
    # Held to the end, so that no buffer alive before is freed and its address reused.
    before = jax.live_arrays()
    old = device_buffers(before)
    model = new_tiny_model(NUM_LAYERS, ParallelConfig(spp=spp))
    engine = Engine(model, CONFIG)                   # the caller keeps `model`
    gc.collect()
    held = collections.Counter()
    for (device, address), nbytes in device_buffers(jax.live_arrays()).items():
        if (device, address) not in old:
            held[device] += nbytes
    # What a stage must hold, from the config alone (float32, one device per stage).
    c, itemsize, layers = model.config, 4, NUM_LAYERS // spp
    specs = param_specs(c)
    weights = layers * sum(math.prod(s.shape[1:]) for s in specs.values() if s.per_layer)
    cache = 2 * layers * CONFIG.total_pages * CONFIG.page_size * c.num_kv_heads * c.head_dim
    embed = math.prod(specs["embed"].shape)
    head = math.prod(specs["final_norm"].shape) + math.prod(specs["lm_head"].shape)
    expected = {}
    for s, stage in enumerate(engine.pipeline.stages):
        (device,) = stage.mesh.devices.flat
        expected[device] = itemsize * (weights + cache + (embed if s == 0 else 0)
                                       + (head if s == spp - 1 else 0))
    assert dict(held) == expected
    with pytest.raises(RuntimeError, match="weights were handed to the pipeline stages"):
        model.logits([1, 2, 3])
    del before


@pytest.mark.slow
def test_server_on_an_spp_mesh_serves_the_one_device_tokens():
    from medha_jax import SamplingParams as Params, TokensPrompt
    from serving.server import Server

    def generate(parallel):
        engine = Engine(new_tiny_model(NUM_LAYERS, parallel),
                        EngineConfig(page_size=16, num_pages=32, max_tokens_per_step=32,
                                     min_token_bucket=16, max_seqs=4, max_model_len=256))
        predictor = AnalyticalPredictor(engine.model.config, ParallelConfig(), "h100",
                                        token_buckets=engine.ladder.token_buckets)
        with Server(engine, scheduler="lars-mp", predictor=predictor) as server:
            assert server.replicas[0].loop.runner.executor is engine and engine.max_in_flight == parallel.spp
            prompts = [TokensPrompt(list(range(3, 3 + n))) for n in (90, 7, 33)]
            outputs = server.generate(prompts, Params(temperature=0.0, max_tokens=5))
            assert server.num_free_pages == server.num_total_pages
        return [out.token_ids for out in outputs]

    assert generate(ParallelConfig(spp=2)) == generate(ParallelConfig())
