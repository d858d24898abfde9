"""Caller-thread validation: the single-or-batch rule by type, prompts, request arguments."""

import numpy as np
import pytest

from medha_jax import SLO, SamplingParams
from serving.auth import Access
from serving.validation import (PriorityNotAllowed, RequestLimits, TokensPrompt,
                                check_batch_prompt, is_single_prompt, prompt_token_ids,
                                validate_request)


class _Chars:
    """A tokenizer whose ids are character codes."""

    def encode(self, text):
        return [ord(c) for c in text]


def _ids(prompt, tokenizer=None):
    return prompt_token_ids(prompt, tokenizer=tokenizer, vocab_size=256, model_name="tiny")


def test_single_or_batch_is_decided_by_the_argument_type_alone():
    assert is_single_prompt("hello")
    assert is_single_prompt(TokensPrompt([1, 2, 3]))
    assert is_single_prompt(np.array([1, 2, 3]))
    assert not is_single_prompt([1, 2, 3])                 # a batch, even of ints
    assert not is_single_prompt(["a", "b"]) and not is_single_prompt(([1], [2]))
    assert not is_single_prompt([])
    with pytest.raises(TypeError, match="prompts must be a str, a TokensPrompt"):
        is_single_prompt(iter([1, 2]))
    check_batch_prompt(0, [1, 2])
    check_batch_prompt(1, "text")
    with pytest.raises(TypeError, match=r"prompts\[2\] must be a prompt .*got int"):
        check_batch_prompt(2, 7)


def test_prompts_become_checked_token_ids():
    assert _ids("hi", _Chars()) == [104, 105]
    assert _ids(TokensPrompt((5, 6))) == [5, 6] == _ids(np.array([5, 6], dtype=np.int32))
    assert _ids((5, 6)) == [5, 6] and all(type(t) is int for t in _ids(np.array([5, 6])))
    with pytest.raises(ValueError, match="model 'tiny' has no tokenizer"):
        _ids("hi")
    with pytest.raises(ValueError, match=r"must be 1-D token ids, got shape \(1, 2\)"):
        _ids(np.array([[1, 2]]))
    with pytest.raises(ValueError, match=r"prompt\[1\] = 300 is outside the vocabulary \[0, 256\)"):
        _ids([1, 300])
    with pytest.raises(ValueError, match=r"prompt\[0\] must be an int token id, got True"):
        _ids([True])
    with pytest.raises(ValueError, match="prompt is empty"):
        _ids(TokensPrompt([]))
    with pytest.raises(TypeError, match="prompt must be a str or a list of token ids"):
        _ids(b"abc")


def test_request_arguments_and_the_size_check():
    seen = []

    def check_fits(prompt_len, max_tokens):
        seen.append((prompt_len, max_tokens))
        if prompt_len + max_tokens > 10:
            raise ValueError(f"{prompt_len=} + {max_tokens=} exceeds max_model_len=10")

    def validate(prompt, params=SamplingParams(max_tokens=4), slo=None, priority=0):
        return validate_request(prompt, params, slo, priority, tokenizer=None, vocab_size=256,
                                model_name="tiny", check_fits=check_fits)

    assert validate([1, 2, 3]) == [1, 2, 3] and seen == [(3, 4)]
    with pytest.raises(ValueError, match="exceeds max_model_len=10"):
        validate(list(range(8)))
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams, got dict"):
        validate([1], params={"max_tokens": 4})
    with pytest.raises(TypeError, match="slo must be an SLO, got float"):
        validate([1], slo=1.0)
    with pytest.raises(TypeError, match="priority must be an int, got True"):
        validate([1], priority=True)
    assert validate([1], slo=SLO(ttft_s=1.0), priority=2) == [1]


def test_slo_and_priority_are_bounded_to_the_servers_range():
    def validate(slo=None, priority=0, limits=RequestLimits()):
        return validate_request([1], SamplingParams(max_tokens=1), slo, priority,
                                tokenizer=None, vocab_size=256, model_name="tiny",
                                check_fits=lambda *_: None, limits=limits)

    # One decode asking tpot_s=1e-9 would budget every batch it rides in at ~0 s.
    with pytest.raises(ValueError, match=r"slo.tpot_s=1e-09 is outside this server's range "
                                         r"\[0.02, 60.0\] s"):
        validate(SLO(tpot_s=1e-9))
    with pytest.raises(ValueError, match=r"slo.ttft_s=1e\+30 is outside"):
        validate(SLO(ttft_s=1e30))
    with pytest.raises(ValueError, match=r"priority=-2147483648 is outside this server's range "
                                         r"\[-100, 100\]"):
        validate(priority=-2**31)
    # The Python API is the operator's own code: any priority in range, raised ones included.
    assert validate(SLO(ttft_s=0.1, tpot_s=0.02), priority=-100) == [1]
    wide = RequestLimits(min_tpot_s=1e-3, min_priority=-2**31)
    assert validate(SLO(tpot_s=1e-3), priority=-2**31, limits=wide) == [1]
    # Network clients ask with may_raise=False unless the operator granted them more.
    RequestLimits().check_priority(5, may_raise=False)
    with pytest.raises(PriorityNotAllowed, match="priority=-1 is more important than the "
                                                 "default"):
        RequestLimits().check_priority(-1, may_raise=False)
    with pytest.raises(ValueError, match="0 < min_tpot_s <= max_tpot_s"):
        RequestLimits(min_tpot_s=0.0)
    with pytest.raises(ValueError, match="min_priority <= 0 <= max_priority"):
        RequestLimits(min_priority=1)


def test_access_roles():
    open_server, closed = Access(), Access.of("s3cret", ["vip"])
    assert open_server.admits("") and not open_server.may_raise_priority("Bearer x")
    assert closed.admits("Bearer s3cret") and closed.admits("Bearer vip")
    assert not closed.admits("Bearer nope") and not closed.admits("s3cret")
    assert closed.may_raise_priority("Bearer vip") and not closed.may_raise_priority(
        "Bearer s3cret")
    with pytest.raises(ValueError, match=r"priority_tokens\[0\] must be a non-empty string"):
        Access.of(None, [""])
