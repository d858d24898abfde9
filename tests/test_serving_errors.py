"""Bad input is refused at submit time with the field named, and a failing step fails only
the requests it touched: in every case the server keeps serving everyone else correctly."""

import pytest

from medha_jax import SLO, SamplingParams
from medha_jax.request import FinishReason
from serving.server import Server, TokensPrompt
from tests.test_server import GREEDY, make_tiny_server, wait_until_idle


@pytest.fixture(scope="module")
def server():
    with make_tiny_server() as s:
        yield s


@pytest.fixture(scope="module")
def reference(server):
    """Greedy outputs of the bystander prompts, computed on an idle server."""
    return {p: server.generate(TokensPrompt(p), GREEDY).token_ids
            for p in [(1, 2, 3), (9, 8, 7, 6)]}


def expect_bystanders_unharmed(server, reference, submit_bad):
    """Runs submit_bad while bystander requests are in flight; they must finish correctly."""
    handles = {p: server.submit(list(p), GREEDY) for p in reference}
    submit_bad()
    for prompt, handle in handles.items():
        out = handle.result(timeout=60)
        assert (out.finish_reason, out.token_ids) == ("length", reference[prompt])


@pytest.mark.parametrize("prompt, params, error, field", [
    ("", GREEDY, ValueError, "prompt is empty"),
    ([], GREEDY, ValueError, "prompt is empty"),
    ([1, 256], GREEDY, ValueError, r"prompt\[1\] = 256 is outside the vocabulary"),
    ([1, -1], GREEDY, ValueError, r"prompt\[1\] = -1"),
    ([1, "x"], GREEDY, ValueError, r"prompt\[1\] must be an int"),
    (b"bytes", GREEDY, TypeError, "prompt must be a str or a list of token ids"),
    ({1, 2}, GREEDY, TypeError, "prompt must be a str or a list of token ids, got set"),
    (list(range(250)), GREEDY, ValueError, "max_model_len=256"),           # 250 + 12 > 256
    ([1] * 300, GREEDY, ValueError, "max_model_len=256"),
    ([1, 2], SamplingParams(max_tokens=300), ValueError, "max_tokens=300"),
    ([1, 2], {"temperature": 0}, TypeError, "sampling_params must be a SamplingParams"),
    # Admitted by SamplingParams, but would fail the step (int32 inputs) for everyone in it.
    ([1, 2], SamplingParams(top_k=2**31), ValueError, "top_k must be <= 2147483647"),
    ([1, 2], SamplingParams(temperature=float("inf")), ValueError, "temperature must be finite"),
    ([1, 2], SamplingParams(stop=("x",) * 65), ValueError, "at most 64"),
])
def test_bad_input_raises_naming_the_field(server, reference, prompt, params, error, field):
    def submit_bad():
        with pytest.raises(error, match=field):
            server.submit(prompt, params)

    rejected = lambda: server.metrics.registry.get_sample_value("medha_requests_rejected_total")
    before = rejected()
    expect_bystanders_unharmed(server, reference, submit_bad)
    assert rejected() == before + 1
    assert wait_until_idle(server)


def test_bad_sampling_values_fail_in_sampling_params():
    for kwargs, field in [({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
                          ({"top_k": -1}, "top_k"), ({"max_tokens": 0}, "max_tokens")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)


def test_other_bad_arguments(server):
    # A request_id is the caller's label: it may repeat; the server names each request.
    first = server.submit([1, 2], SamplingParams(temperature=0, max_tokens=100),
                          request_id="dup")
    second = server.submit([1, 2], GREEDY, request_id="dup")
    assert first.id != second.id and first.request_id == second.request_id == "dup"
    assert not server.cancel("dup")
    assert first.cancel()
    assert second.result(timeout=60).finish_reason == "length"
    assert first.result(timeout=60).finish_reason == "cancelled"
    for bad, message in [("", "non-empty string"), ("x" * 513, "513 characters; at most 512"),
                         (7, "non-empty string")]:
        with pytest.raises(ValueError, match=message):
            server.submit([1], GREEDY, request_id=bad)
    with pytest.raises(TypeError, match="slo must be an SLO"):
        server.submit([1], GREEDY, slo=5.0)
    # Found by the fuzzer: a priority past int64 once left the controller half-updated.
    with pytest.raises(ValueError, match=r"priority=\d+ is outside this server's range"):
        server.submit([1], GREEDY, priority=2**100)
    with pytest.raises(ValueError, match="slo.ttft_s=inf is outside this server's range"):
        server.submit([1], GREEDY, slo=SLO(ttft_s=float("inf")))
    # SLOs and priorities are bounded (Server(limits=...)); a hostile tpot_s would set the
    # budget of every batch the request rides in.
    with pytest.raises(ValueError, match=r"slo.tpot_s=1e-09 is outside .*\[0.02, 60.0\]"):
        server.submit([1], GREEDY, slo=SLO(tpot_s=1e-9))
    with pytest.raises(ValueError, match=r"priority=-2147483648 is outside .*\[-100, 100\]"):
        server.submit([1], GREEDY, priority=-2**31)
    assert server.submit([1], GREEDY, priority=-100).result().finish_reason == "length"
    with pytest.raises(ValueError, match="got 1 sampling_params for 2 prompts"):
        server.generate([[1], [2]], [GREEDY])
    with pytest.raises(ValueError, match="prompts is empty"):
        server.generate([])
    # A list is a batch of prompts, whatever its elements: ints are not prompts.
    with pytest.raises(TypeError, match=r"prompts\[0\] must be a prompt .*got int; for one "
                                        r"prompt of token ids pass TokensPrompt"):
        server.generate([1, 2], GREEDY)
    with pytest.raises(ValueError, match="got 2 sampling_params for 1 prompts"):
        server.generate("hi", [GREEDY, GREEDY])
    assert server.generate(TokensPrompt([1, 2]), GREEDY,
                           slo=SLO(ttft_s=1.0)).finish_reason == "length"


def test_text_and_stop_strings_need_a_tokenizer(server):
    # The tiny preset has no tokenizer of its own; the server under test was given one.
    tokenizer, server.tokenizer = server.tokenizer, None
    try:
        with pytest.raises(ValueError, match="prompt: model 'tiny' has no tokenizer"):
            server.submit("hello", GREEDY)
        with pytest.raises(ValueError, match="stop=.*needs a model with a tokenizer"):
            server.submit([1, 2], SamplingParams(stop=["x"]))
    finally:
        server.tokenizer = tokenizer


def test_unknown_model_and_policy_are_named():
    with pytest.raises(ValueError, match="unknown model 'no-such-model'"):
        Server("no-such-model", warmup=False)
    with pytest.raises(ValueError, match="unknown policy 'fifo'"):
        Server("tiny", scheduler="fifo", warmup=False)
    with pytest.raises(TypeError, match="scheduler must be a policy name or a SchedulerConfig"):
        Server("tiny", scheduler={"policy": "lars"}, warmup=False)
    with pytest.raises(ValueError, match=r"default_slo: slo.tpot_s=0.001 is outside"):
        Server("tiny", default_slo=SLO(tpot_s=1e-3), warmup=False)
    with pytest.raises(TypeError, match="limits must be a RequestLimits, got dict"):
        Server("tiny", limits={"min_tpot_s": 0.1}, warmup=False)


def test_a_failing_step_fails_its_requests_and_the_server_keeps_serving(server, reference,
                                                                        monkeypatch):
    poison = 255
    real_dispatch = server.engine.dispatch

    def dispatch(batch):
        if any(c.request.prompt_token_ids[0] == poison for c in batch.chunks):
            raise RuntimeError("injected device failure")
        return real_dispatch(batch)

    monkeypatch.setattr(server.engine, "dispatch", dispatch)
    failed = server.generate(TokensPrompt([poison, 1, 2]), GREEDY)
    assert failed.finish_reason == FinishReason.ERROR.value
    assert "injected device failure" in failed.error
    assert server.replicas[0].loop.thread.is_alive()
    assert wait_until_idle(server)
    # Healthy requests around it still complete with the right tokens.
    expect_bystanders_unharmed(server, reference, lambda: None)
    assert server.metrics.registry.get_sample_value(
        "medha_requests_finished_total", {"finish_reason": "error"}) == 1
