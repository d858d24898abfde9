import pytest

from medha_jax.sampling_params import SamplingParams


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.1), "temperature must be >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-1), "top_k must be an int >= 0"),
    (dict(max_tokens=0), "max_tokens must be an int >= 1"),
    (dict(seed=1.5), "seed must be an int"),
    (dict(stop=[""]), "stop must be non-empty strings"),
    (dict(n=0), r"n must be an int in \[1, 64\]"),
    (dict(n=True), "n must be an int"),
    (dict(logprobs=21), r"logprobs must be None or an int in \[0, 20\]"),
    (dict(logprobs=-1), "logprobs must be None or an int"),
    (dict(prompt_logprobs=1.0), "prompt_logprobs must be None or an int"),
])
def test_bad_sampling_values_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_lists_become_tuples_and_greedy_is_temperature_zero():
    params = SamplingParams(temperature=0, stop=["\n"], stop_token_ids=[2, 3])
    assert params.stop == ("\n",) and params.stop_token_ids == (2, 3)
    assert params.greedy and hash(params)
