"""Caller-thread validation: the single-or-batch rule by type, prompts, request arguments."""

import numpy as np
import pytest

from medha_jax import SLO, SamplingParams
from serving.validation import (TokensPrompt, check_batch_prompt, is_single_prompt,
                                prompt_token_ids, validate_request)


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
