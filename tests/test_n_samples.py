"""n samples per prompt (SamplingParams.n) through the Server: one prefill shared through the
prefix cache (counted), identical greedy samples, different random ones, seeded ones
reproducible, streams naming their sample, and a cancelled group returning every page."""

import dataclasses

import pytest

from medha_jax import SamplingParams
from serving.server import TokensPrompt
from tests.test_logprobs import quick_tiny_server
from tests.test_server import wait_until_idle

PAGE = 16           # TINY_ENGINE's page_size


@pytest.fixture(scope="module")
def server():
    with quick_tiny_server() as s:
        yield s


def test_greedy_samples_are_identical_and_random_ones_differ(server):
    prompt = TokensPrompt(list(range(10, 30)))
    greedy = server.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6, n=3))
    assert [o.index for o in greedy.outputs] == [0, 1, 2]
    assert len({o.token_ids for o in greedy.outputs}) == 1
    assert greedy.token_ids == greedy.outputs[0].token_ids and greedy.text == greedy.outputs[0].text
    random = server.generate(prompt, SamplingParams(temperature=1.0, max_tokens=8, n=4))
    assert len({o.token_ids for o in random.outputs}) == 4
    assert all(o.finish_reason == "length" and len(o.token_ids) == 8 for o in random.outputs)


def test_seeded_samples_are_reproducible_and_each_has_its_own_stream(server):
    params = SamplingParams(temperature=1.0, max_tokens=8, n=3, seed=11)
    prompt = TokensPrompt(list(range(40, 60)))
    first, second = (server.generate(prompt, params) for _ in range(2))
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in second.outputs]
    assert len({o.token_ids for o in first.outputs}) == 3
    # Sample i is the request seeded seed + i.
    alone = server.generate(prompt, SamplingParams(temperature=1.0, max_tokens=8, seed=13))
    assert alone.token_ids == first.outputs[2].token_ids


def test_the_prompt_is_prefilled_once(server):
    """Counted in the steps: the prompt tokens each sample's chunks computed. Sample 0
    computes the whole prompt; the others take its full pages from the prefix cache and
    compute only the tail (the allocator always computes at least the last token)."""
    prompt = list(range(100, 140))                       # 40 tokens: 2 full pages + 8
    n = 4
    computed: dict[str, int] = {}
    engine = server.engine
    dispatch = engine.dispatch

    def counting(batch):
        for chunk in batch.chunks:
            prompt_part = min(chunk.end, chunk.request.prompt_len) - chunk.start
            if prompt_part > 0:
                rid = chunk.request.request_id
                computed[rid] = computed.get(rid, 0) + prompt_part
        return dispatch(batch)

    engine.dispatch = counting
    try:
        out = server.generate(TokensPrompt(prompt), SamplingParams(temperature=1.0,
                                                                   max_tokens=4, n=n))
    finally:
        del engine.dispatch
    cached = [o.metrics.num_cached_tokens for o in out.outputs]
    full_pages = (len(prompt) // PAGE) * PAGE
    assert cached == [0] + [full_pages] * (n - 1)
    assert len(computed) == n
    assert sum(computed.values()) == len(prompt) + (n - 1) * (len(prompt) - full_pages) == 64
    assert all(o.metrics.num_preemptions == 0 for o in out.outputs)


def test_stream_deltas_name_their_sample_and_concatenate_to_each_output(server):
    params = SamplingParams(temperature=1.0, max_tokens=6, n=3, logprobs=1)
    handle = server.submit(TokensPrompt([5, 6, 7, 8]), params)
    tokens, logprobs, finished = {}, {}, []
    for delta in handle:
        tokens.setdefault(delta.index, []).extend(delta.token_ids)
        logprobs.setdefault(delta.index, []).extend(delta.logprobs)
        if delta.finished:
            finished.append(delta.index)
    out = handle.result()
    assert sorted(finished) == [0, 1, 2]
    for o in out.outputs:
        assert tuple(tokens[o.index]) == o.token_ids
        assert [e.token_id for e in logprobs[o.index]] == list(o.token_ids)
        assert tuple(logprobs[o.index]) == o.logprobs


@pytest.mark.parametrize("by", ["handle", "server id"])
@pytest.mark.parametrize("when", ["before the first token", "while decoding"])
def test_cancelling_a_group_cancels_every_sample_and_returns_every_page(server, when, by):
    start = server.num_free_pages
    handle = server.submit(TokensPrompt(list(range(1, 70))),
                           SamplingParams(temperature=1.0, max_tokens=150, n=4))
    if when == "while decoding":
        seen = set()
        for delta in handle:                      # until the held samples are running
            seen.add(delta.index)
            if len(seen) == 4:
                break
    assert handle.cancel() if by == "handle" else server.cancel(handle.id)
    out = handle.result(timeout=60)
    assert [o.finish_reason for o in out.outputs] == ["cancelled"] * 4
    assert wait_until_idle(server) and server.num_free_pages == start == server.num_total_pages


def test_a_sample_that_stops_early_leaves_the_others_running(server):
    """Each sample finishes on its own (its own stop); the request ends with the last."""
    prompt = TokensPrompt([9, 8, 7])
    probe = server.generate(prompt, SamplingParams(temperature=1.0, max_tokens=12, n=2,
                                                   seed=3))
    stop_token = probe.outputs[1].token_ids[2]
    out = server.generate(prompt, SamplingParams(temperature=1.0, max_tokens=12, n=2, seed=3,
                                                 stop_token_ids=[stop_token]))
    assert out.outputs[1].finish_reason == "stop" and len(out.outputs[1].token_ids) <= 3
    n0 = len(out.outputs[0].token_ids)
    assert out.outputs[0].token_ids == probe.outputs[0].token_ids[:n0]
    assert wait_until_idle(server)


def test_the_group_id_cancels_the_samples_still_running_after_sample_0_finished(server):
    prompt = TokensPrompt([5, 6, 7])
    params = SamplingParams(temperature=1.0, max_tokens=240, n=2, seed=5, ignore_eos=True)
    probe = server.generate(prompt, params)
    # Sample 0 stops at the first of its tokens that sample 1 never draws.
    stop_token = next(t for t in probe.outputs[0].token_ids
                      if t not in probe.outputs[1].token_ids)
    handle = server.submit(prompt, dataclasses.replace(params, stop_token_ids=[stop_token]))
    for delta in handle:
        if delta.index == 0 and delta.finished:
            break
    assert server.cancel(handle.id)
    out = handle.result(timeout=60)
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[1].finish_reason == "cancelled"
    assert not server.cancel(handle.id)                  # nothing of it is left in flight
    assert wait_until_idle(server) and server.num_free_pages == server.num_total_pages
