"""Several replicas in one process behind the router (tiny model, CPU devices)."""

import numpy as np
import pytest

from medha_jax import SamplingParams, load_model
from medha_jax.cluster.router import RoutingConfig
from serving.replicas import device_groups, replica_models
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


def test_device_groups_are_disjoint_and_contiguous():
    groups = device_groups(2, 3, devices=list(range(8)))
    assert groups == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="need 10 devices, but 8"):
        device_groups(2, 5, devices=list(range(8)))


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
    cache serves the shared pages; another session's turn 1 meanwhile goes to the other."""
    with Server(tiny_model(), engine_config=TINY_ENGINE, warmup=False, replicas=2,
                router=RoutingConfig("predicted-time")) as server:
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
        with pytest.raises(TypeError, match="session_id"):
            server.submit(TokensPrompt([1, 2]), GREEDY, session_id=3)


def test_bad_replica_arguments_are_named():
    with pytest.raises(ValueError, match="unknown routing policy"):
        Server(tiny_model(), engine_config=TINY_ENGINE, warmup=False, replicas=2, router="x")
    with pytest.raises(ValueError, match="replicas must be an int >= 1"):
        Server(tiny_model(), engine_config=TINY_ENGINE, warmup=False, replicas=0)
    with pytest.raises(ValueError, match="need 16 devices"):
        Server(tiny_model(), engine_config=TINY_ENGINE, warmup=False, replicas=16)
