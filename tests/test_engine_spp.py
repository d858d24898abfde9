"""The engine on an spp mesh: one program per stage, batches in flight through the controller.

Tokens equal one device (greedy and seeded sampling) for spp = 2 and 4, alone and with tp and
kvp, on a workload of staggered arrivals, chunked prefills streaming into the pipe beside
decodes, and preemption; nothing compiles after warm-up; every page returns; each device
holds only its stage's weights.
"""

import jax
import numpy as np
import pytest

from medha_jax.engine import Engine, EngineConfig
from medha_jax.model.params import param_specs
from medha_jax.request import Request, VirtualClock
from medha_jax.sampling_params import SamplingParams
from medha_jax.scheduler import SchedulerConfig, make_controller, run_one_step
from medha_jax.scheduler.in_flight import InFlightRunner
from medha_jax.scheduler.predictor import AnalyticalPredictor
from meshes import ParallelConfig
from tests.test_stages import tiny_model

NUM_LAYERS = 4          # spp = 4 needs a multiple of 4
# 8 pages of 16 tokens hold 128 tokens: the workload below needs 178, so one is preempted.
CONFIG = EngineConfig(page_size=16, num_pages=8, max_tokens_per_step=32, min_token_bucket=16,
                      max_seqs=4, max_model_len=128)
KVP_CONFIG = EngineConfig(page_size=16, num_pages=6, max_tokens_per_step=32,
                          min_token_bucket=16, max_seqs=4, max_tokens_per_kvp_group=64)


def workload() -> list[tuple[int, Request]]:
    """(step it arrives at, request): a long prompt first, shorter ones while it streams,
    and an urgent one late that preempts. Two sample at temperature 0.8 with seeds."""
    rng = np.random.default_rng(7)
    specs = [(0, "long", 70, 6, 1, None), (1, "chat", 9, 6, 1, 1), (2, "doc", 45, 6, 1, None),
             (6, "urgent", 30, 6, 0, 2)]
    out = []
    for step, rid, prompt_len, max_new, priority, seed in specs:
        sampling = (SamplingParams(temperature=0.0, max_tokens=max_new) if seed is None else
                    SamplingParams(temperature=0.8, seed=seed, max_tokens=max_new))
        out.append((step, Request(rid, prompt_len, max_new, 0.0, priority=priority,
                                  prompt_token_ids=rng.integers(0, 256, prompt_len).tolist(),
                                  sampling=sampling)))
    return out


def serve(engine: Engine, *, in_flight: bool):
    """Runs the workload through the real controller; returns outputs and preemptions."""
    predictor = AnalyticalPredictor(engine.model.config, ParallelConfig(), "h100",
                                    token_buckets=engine.ladder.token_buckets)
    # A budget of a few tokens' work: prefills are chunked, so chunks stream into the pipe.
    scheduler = SchedulerConfig("lars-mp", token_buckets=engine.ladder.token_buckets,
                                max_seqs_per_batch=engine.max_seqs, target_batch_time_s=1.05e-3)
    controller = make_controller(scheduler, allocator=engine.allocator, clock=VirtualClock(),
                                 predictor=predictor, model_config=engine.model.config,
                                 max_model_len=engine.max_model_len)
    runner = InFlightRunner(controller, engine)
    arrivals, requests, step = workload(), [], 0
    while arrivals or controller.has_unfinished():
        while arrivals and arrivals[0][0] <= step:
            requests.append(arrivals.pop(0)[1])
            controller.add_request(requests[-1])
        step += 1
        if in_flight:
            runner.step()
        else:
            run_one_step(controller, engine)
    assert engine.allocator.num_free_pages == engine.allocator.num_pages
    return {r.request_id: r.output_token_ids for r in requests}, controller.num_preemptions


@pytest.fixture(scope="module")
def expected():
    engine = Engine(tiny_model(NUM_LAYERS, ParallelConfig()), CONFIG)
    outputs, preemptions = serve(engine, in_flight=False)
    assert preemptions > 0
    return outputs


def warmed_engine(parallel, config):
    engine = Engine(tiny_model(NUM_LAYERS, parallel), config)
    engine.warmup(progress=False)
    compiled = []
    compile_shape = engine._compile
    engine._compile = lambda shape: compiled.append(shape) or compile_shape(shape)
    return engine, compiled


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [ParallelConfig(spp=2), ParallelConfig(spp=4)], ids=str)
def test_spp_engine_gives_the_one_device_tokens(expected, parallel):
    engine, compiled = warmed_engine(parallel, CONFIG)
    assert engine.max_in_flight == parallel.spp and engine.kv_cache is None
    assert len(engine.pipeline.executables) == parallel.spp * len(engine.ladder.all_shapes())
    outputs, _ = serve(engine, in_flight=True)
    assert outputs == expected
    assert compiled == []


@pytest.mark.slow
def test_spp_with_kvp_and_tp_gives_the_one_device_tokens():
    # The reference on one device holds as many tokens as the kvp shards together.
    reference = Engine(tiny_model(NUM_LAYERS, ParallelConfig()),
                       EngineConfig(**{**KVP_CONFIG.__dict__, "num_pages": 12,
                                       "max_tokens_per_kvp_group": None, "max_model_len": 128}))
    want, _ = serve(reference, in_flight=False)
    engine, compiled = warmed_engine(ParallelConfig(spp=2, kvp=2, tp=2), KVP_CONFIG)
    assert engine.num_kv_shards == 2 and engine.max_model_len == 128
    outputs, _ = serve(engine, in_flight=True)
    assert outputs == want
    assert compiled == []


def test_each_device_holds_only_its_stages_weights():
    engine = Engine(tiny_model(NUM_LAYERS, ParallelConfig(spp=4, tp=2)), CONFIG)
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


@pytest.mark.slow
def test_server_on_an_spp_mesh_serves_the_one_device_tokens():
    from medha_jax import SamplingParams as Params, TokensPrompt
    from serving.server import Server

    def generate(parallel):
        engine = Engine(tiny_model(NUM_LAYERS, parallel),
                        EngineConfig(page_size=16, num_pages=32, max_tokens_per_step=32,
                                     min_token_bucket=16, max_seqs=4, max_model_len=256))
        predictor = AnalyticalPredictor(engine.model.config, ParallelConfig(), "h100",
                                        token_buckets=engine.ladder.token_buckets)
        with Server(engine, scheduler="lars-mp", predictor=predictor) as server:
            assert server._loop.runner.executor is engine and engine.max_in_flight == parallel.spp
            prompts = [TokensPrompt(list(range(3, 3 + n))) for n in (90, 7, 33)]
            outputs = server.generate(prompts, Params(temperature=0.0, max_tokens=5))
            assert server.num_free_pages == server.num_total_pages
        return [out.token_ids for out in outputs]

    assert generate(ParallelConfig(spp=2)) == generate(ParallelConfig())
