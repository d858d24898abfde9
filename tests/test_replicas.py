"""Several replicas in one process behind the router (tiny model, CPU devices)."""

import collections
import time
import types

import numpy as np
import pytest

from medha_jax import SamplingParams, load_model
from medha_jax.cluster.router import RoutingConfig
from serving.replicas import PREFILL_SHARE_WINDOW_S, LocalReplica, device_groups, replica_models
from serving.server import Server, TokensPrompt
from tests.test_server import TINY_ENGINE, byte_level_tokenizer, wait_until_idle

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
PROMPTS = [TokensPrompt(list(np.random.default_rng(i).integers(1, 256, size=20 + 7 * i)))
           for i in range(6)]


def tiny_model():
    model = load_model("tiny", verbose=False)
    model.tokenizer = byte_level_tokenizer()
    return model


@pytest.fixture(scope="module")
def one_replica_tokens():
    with Server(tiny_model(), engine_config=TINY_ENGINE, warmup=False) as server:
        return [out.token_ids for out in server.generate(PROMPTS, GREEDY)]


def test_prefill_share_forgets_old_steps_while_the_replica_is_idle():
    # The loop prunes its record of prefill steps only when it steps: an idle replica's
    # share must still count only the window (a replica busy with prefills a round ago
    # is idle now, and the offload decision would price decodes there as interfered).
    now = time.monotonic()
    steps = collections.deque([(now - PREFILL_SHARE_WINDOW_S - 5.0, 4.0), (now - 1.0, 2.0)])
    replica = types.SimpleNamespace(_prefill_steps=steps)
    assert LocalReplica.prefill_share.fget(replica) == pytest.approx(2.0 / PREFILL_SHARE_WINDOW_S)
    steps.pop()
    assert LocalReplica.prefill_share.fget(replica) == 0.0


def test_chunk_step_is_the_prefill_steps_measured_in_the_window():
    # A decode beside prefill work pays the steps the packer really forms (chunks sized to
    # its budget), not a full chunk's: the mean of the window's prefill steps; with none,
    # the packer's budget; without one, a full chunk's predicted seconds.
    now = time.monotonic()
    steps = collections.deque([(now - PREFILL_SHARE_WINDOW_S - 5.0, 4.0), (now - 2.0, 0.2),
                               (now - 1.0, 0.4)])
    replica = types.SimpleNamespace(
        _prefill_steps=steps, controller=types.SimpleNamespace(
            packer=types.SimpleNamespace(target_batch_time_s=0.25)),
        engine=types.SimpleNamespace(config=types.SimpleNamespace(max_tokens_per_step=256)),
        prefill_s=lambda n, cached: n / 100)
    chunk_step_s = LocalReplica.chunk_step_s.fget
    assert chunk_step_s(replica) == pytest.approx(0.3)
    steps.clear()
    assert chunk_step_s(replica) == 0.25
    replica.controller.packer = types.SimpleNamespace()        # a packer without a budget
    assert chunk_step_s(replica) == pytest.approx(2.56)


def test_device_groups_are_disjoint_and_contiguous():
    groups = device_groups(2, 3, devices=list(range(8)))
    assert groups == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="need 10 devices, but 8"):
        device_groups(2, 5, devices=list(range(8)))
    # One size per replica: replicas of different shapes.
    assert device_groups([1, 2, 4], 3, devices=list(range(8))) == [[0], [1, 2], [3, 4, 5, 6]]
    with pytest.raises(ValueError, match=r"3 replicas of 4\+2\+4 devices need 10"):
        device_groups([4, 2, 4], 3, devices=list(range(8)))
    with pytest.raises(ValueError, match="2 device group sizes for 3 replicas"):
        device_groups([1, 2], 3, devices=list(range(8)))


def test_replica_models_hold_the_same_weights_on_their_own_devices():
    models = replica_models("tiny", 3)
    ids = list(range(1, 30))
    for i, model in enumerate(models):
        devices = {d.id for leaf in model.module.params().values() for d in leaf.devices()}
        assert devices == {i}
        np.testing.assert_array_equal(model.logits(ids), models[0].logits(ids))


@pytest.mark.parametrize("router", ["round-robin", "predicted-time"])
def test_two_replicas_give_one_replicas_greedy_tokens_and_return_every_page(
        router, one_replica_tokens):
    with Server(tiny_model(), engine_config=TINY_ENGINE, warmup=False, replicas=2,
                router=router, metrics_port=None) as server:
        assert server.num_total_pages == 2 * TINY_ENGINE.total_pages
        outputs = server.generate(PROMPTS, GREEDY)
        assert [out.token_ids for out in outputs] == one_replica_tokens
        served = [out.metrics.replica for out in outputs]
        assert set(served) == {0, 1}, served
        assert wait_until_idle(server)
        text = server.metrics_text()
        for replica in (0, 1):
            assert f'medha_replica_requests_total{{replica="{replica}"}}' in text
        assert "medha_router_decision_seconds_count 6.0" in text


def test_a_sessions_next_turn_goes_where_its_prefix_is_cached():
    """Turn 2 extends turn 1's prompt: the router sends it to turn 1's replica, whose prefix
    cache serves the shared pages; another session's turn 1 meanwhile goes to the other.
    Both replicas price prefills with one fixed predictor, the CPU roofline a server starts
    from: refined online, replica 0's learns from steps timed on this (shared, busy) CPU
    and replica 1's does not, and the two then disagree by more than the cached prefix
    saves (seen in a loaded suite run)."""
    from medha_jax.engine.online_fit import CPU_EFFICIENCY, measure_cpu_peaks
    from medha_jax.scheduler.predictor import AnalyticalPredictor

    model = tiny_model()
    predictor = AnalyticalPredictor(model.config, hardware=measure_cpu_peaks(model.config),
                                    efficiency=CPU_EFFICIENCY)
    with Server(model, engine_config=TINY_ENGINE, warmup=False, replicas=2,
                router=RoutingConfig("predicted-time"), predictor=predictor) as server:
        turn1 = list(np.random.default_rng(0).integers(1, 256, size=70))
        first = server.generate(TokensPrompt(turn1), GREEDY)
        turn2 = turn1 + list(first.token_ids) + [5, 6, 7]
        second = server.submit(TokensPrompt(turn2), GREEDY, session_id="chat").result(timeout=120)
        third = server.submit(TokensPrompt(turn2 + [9]), GREEDY,
                              session_id="chat").result(timeout=120)
        assert second.metrics.replica == first.metrics.replica == third.metrics.replica
        assert second.metrics.num_cached_tokens >= 64        # turn 1's full pages
        assert third.metrics.num_cached_tokens >= 64
        assert wait_until_idle(server)
        # Both allocators name their orphans to the index, so its lookups bisect.
        assert server._replica_set.router.index._orphans_known == 0b11
        with pytest.raises(TypeError, match="session_id"):
            server.submit(TokensPrompt([1, 2]), GREEDY, session_id=3)


def test_bad_replica_arguments_are_named():
    with pytest.raises(ValueError, match="unknown routing policy"):
        Server(tiny_model(), engine_config=TINY_ENGINE, warmup=False, replicas=2, router="x")
    with pytest.raises(ValueError, match="replicas must be an int >= 1"):
        Server(tiny_model(), engine_config=TINY_ENGINE, warmup=False, replicas=0)
    with pytest.raises(ValueError, match="need 16 devices"):
        Server(tiny_model(), engine_config=TINY_ENGINE, warmup=False, replicas=16)


def break_replica(server, replica: int, how: str):
    """From its next step that decodes (so mid-stream), replica's engine fails every step
    ("steps fail": an error a KV-cache rebuild cannot fix) or its loop thread dies ("loop
    dies"). Returns a list that records the failures."""
    engine = server.replicas[replica].engine
    dispatch = engine.dispatch
    failures = []

    def failing_dispatch(batch):
        if failures or any(c.request.output_token_ids for c in batch.chunks):
            failures.append(len(batch.chunks))
            if how == "loop dies":
                raise SystemExit("the loop thread is gone")
            raise RuntimeError("device lost")
        return dispatch(batch)
    engine.dispatch = failing_dispatch
    return failures


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("how", ["steps fail", "loop dies"])
def test_a_failed_replicas_streams_go_on_elsewhere_or_end_unavailable(how, one_replica_tokens):
    """Replica 1 fails mid-stream: its requests are re-run on replica 0 from prompt + the
    tokens they streamed, and every caller gets one replica's greedy tokens; replica 1 is
    marked unhealthy and gets nothing more. Then replica 0 fails too: its requests end as
    unavailable (none hangs) and new ones are refused."""
    from medha_jax.cluster.router import NoHealthyReplica

    with Server(tiny_model(), engine_config=TINY_ENGINE, warmup=False, replicas=2,
                router="round-robin") as server:
        failures = break_replica(server, 1, how)
        handles = [server.submit(p, GREEDY) for p in PROMPTS]
        outputs = [h.result(timeout=120) for h in handles]
        assert failures, "replica 1 never failed"
        assert [o.token_ids for o in outputs] == one_replica_tokens
        assert {o.finish_reason for o in outputs} == {"length"}
        moved = [o for o in outputs if o.metrics.num_preemptions]
        assert moved and all(o.metrics.replica == 0 for o in outputs)
        assert all(o.metrics.num_prompt_tokens == len(o.prompt_token_ids) for o in outputs)
        for _ in range(6):        # each request placed there fails a step, until it is down
            if not server.replicas[1].loop.healthy:
                break
            out = server.submit(PROMPTS[0], GREEDY).result(timeout=60)
            assert out.token_ids == one_replica_tokens[0] and out.metrics.replica == 0
        assert not server.replicas[1].loop.healthy
        text = server.metrics_text()
        assert 'medha_replica_healthy{replica="1"} 0.0' in text
        assert 'medha_replica_healthy{replica="0"} 1.0' in text
        assert server.submit(PROMPTS[0], GREEDY).result(timeout=60).metrics.replica == 0
        allocator = server.replicas[0].engine.allocator
        assert wait_until_idle(server) and allocator.num_free_pages == allocator.num_pages

        break_replica(server, 0, how)
        outputs = [h.result(timeout=120) for h in
                   [server.submit(p, GREEDY) for p in PROMPTS[:2]]]
        for _ in range(4):
            if not server.replicas[0].loop.healthy:
                break
            outputs.append(server.submit(PROMPTS[0], GREEDY).result(timeout=60))
        assert all(o.finish_reason == "error" and o.outputs[0].unavailable for o in outputs)
        assert all("unavailable" in o.error for o in outputs)
        assert not server.replicas[0].loop.healthy
        with pytest.raises(NoHealthyReplica):
            server.submit(PROMPTS[0], GREEDY)
