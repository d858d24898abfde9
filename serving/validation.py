"""Argument checks and tokenization, on the caller's thread, before a request is queued.

Everything here raises ValueError or TypeError naming the bad field, so a caller learns
what is wrong at submit time and the loop thread only ever sees servable requests.

Prompts. One prompt is a str (tokenized with the model's tokenizer), a `TokensPrompt`, a
1-D numpy array of token ids, or (where only one prompt can be meant: `submit`,
`generate_stream`) a list or tuple of token ids. Which of these `generate` got is decided
by the argument's type alone, never by looking at its elements: see `is_single_prompt`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Iterable, Sequence
from typing import Union

import numpy as np

from medha_jax.request import SLO
from medha_jax.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class TokensPrompt:
    """One prompt given as token ids (vLLM's TokensPrompt): unambiguous where a list would
    be read as a batch of prompts, e.g. `server.generate(TokensPrompt([1, 2, 3]))`."""

    prompt_token_ids: tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))


Prompt = Union[str, TokensPrompt, np.ndarray, Sequence[int]]


def is_single_prompt(prompts) -> bool:
    """Whether `generate(prompts)` got one prompt (-> one output) or a batch (-> a list).

    By type only: a str, a TokensPrompt or a numpy array is one prompt; a list or a tuple
    is a batch, each element a str, a list/tuple of token ids, a TokensPrompt or a 1-D
    array. So `generate([1, 2, 3])` is a batch of three prompts (and fails: an int is not
    a prompt); one token-id prompt is `TokensPrompt([1, 2, 3])`, `np.array([1, 2, 3])`,
    or a batch of one, `[[1, 2, 3]]`.
    """
    if isinstance(prompts, (str, TokensPrompt, np.ndarray)):
        return True
    if isinstance(prompts, (list, tuple)):
        return False
    raise TypeError(f"prompts must be a str, a TokensPrompt, a numpy array of token ids, or "
                    f"a list of prompts, got {type(prompts).__name__}")


def check_batch_prompt(index: int, prompt) -> None:
    """A batch element must itself be a prompt: catches generate([1, 2, 3]) by type."""
    if not isinstance(prompt, (str, TokensPrompt, np.ndarray, list, tuple)):
        raise TypeError(
            f"prompts[{index}] must be a prompt (a str, a list of token ids, a TokensPrompt or "
            f"a numpy array), got {type(prompt).__name__}; for one prompt of token ids pass "
            f"TokensPrompt(ids) or [ids]")


# Bounds on what one request may ask of the loop thread and the step's int32 inputs; a
# hostile value past them would slow or fail every request beside it, not only its own.
INT32_MAX = 2**31 - 1
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 4096


def check_request_args(params, slo, priority) -> None:
    """The non-prompt arguments of one request."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
    if slo is not None and not isinstance(slo, SLO):
        raise TypeError(f"slo must be an SLO, got {type(slo).__name__}")
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise TypeError(f"priority must be an int, got {priority!r}")
    if not -INT32_MAX - 1 <= priority <= INT32_MAX:
        raise ValueError(f"priority must fit in int32, got {priority}")
    if slo is not None and not (math.isfinite(slo.ttft_s) and math.isfinite(slo.tpot_s)):
        raise ValueError(f"slo must be finite, got {slo}")
    check_sampling_limits(params)


def check_sampling_limits(params: SamplingParams) -> None:
    """What SamplingParams itself admits but a step cannot hold (values packed as int32 and
    float32) or the loop thread should not pay for (huge stop lists)."""
    if not math.isfinite(params.temperature):
        raise ValueError(f"temperature must be finite, got {params.temperature!r}")
    if params.top_k > INT32_MAX:
        raise ValueError(f"top_k must be <= {INT32_MAX}, got {params.top_k}")
    if len(params.stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop has {len(params.stop)} strings; at most {MAX_STOP_STRINGS}")
    longest = max((len(s) for s in params.stop), default=0)
    if longest > MAX_STOP_STRING_CHARS:
        raise ValueError(f"a stop string has {longest} characters; at most "
                         f"{MAX_STOP_STRING_CHARS}")
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"stop_token_ids has {len(params.stop_token_ids)} ids; at most "
                         f"{MAX_STOP_TOKEN_IDS}")


def prompt_token_ids(prompt: Prompt, *, tokenizer, vocab_size: int, model_name: str
                     ) -> list[int]:
    """The prompt's token ids: text tokenized, ids checked against the vocabulary."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"prompt: model {model_name!r} has no tokenizer; "
                             "pass token ids instead of text")
        ids = list(tokenizer.encode(prompt))
    else:
        if isinstance(prompt, TokensPrompt):
            prompt = prompt.prompt_token_ids
        elif isinstance(prompt, np.ndarray) and prompt.ndim != 1:
            raise ValueError(f"prompt: a numpy prompt must be 1-D token ids, got shape "
                             f"{prompt.shape}")
        # Sets and mappings iterate, but in no order a prompt could mean.
        if not isinstance(prompt, Iterable) or isinstance(
                prompt, (bytes, bytearray, set, frozenset, dict)):
            raise TypeError(f"prompt must be a str or a list of token ids, "
                            f"got {type(prompt).__name__}")
        ids = []
        for i, t in enumerate(prompt):
            if not is_token_id(t):
                raise ValueError(f"prompt[{i}] must be an int token id, got {t!r}")
            if not 0 <= t < vocab_size:
                raise ValueError(f"prompt[{i}] = {t} is outside the vocabulary [0, {vocab_size})")
            ids.append(int(t))
    if not ids:
        raise ValueError("prompt is empty: it needs at least one token")
    return ids


def validate_request(prompt: Prompt, params, slo, priority, *, tokenizer, vocab_size: int,
                     model_name: str, check_fits: Callable[[int, int], None]) -> list[int]:
    """The prompt's token ids, once every argument is known to be servable.

    check_fits(prompt_len, max_tokens): the controller's size check (max_model_len, KV
    capacity); it reads only fixed sizes, so it is safe on the caller's thread."""
    check_request_args(params, slo, priority)
    ids = prompt_token_ids(prompt, tokenizer=tokenizer, vocab_size=vocab_size,
                           model_name=model_name)
    check_fits(len(ids), params.max_tokens)
    return ids


MAX_REQUEST_ID_CHARS = 512


def check_request_id(request_id) -> None:
    """A caller's label: a non-empty string, short enough to echo in every delta."""
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id must be a non-empty string, got {request_id!r:.80}")
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise ValueError(f"request_id has {len(request_id)} characters; at most "
                         f"{MAX_REQUEST_ID_CHARS}")


def is_token_id(value) -> bool:
    # numbers.Integral admits numpy integers; bool is an int but never a token.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


MAX_MESSAGES = 4096


def check_messages(messages) -> None:
    """A conversation: a non-empty list of {"role": str, "content": str | None} mappings
    (other keys, e.g. tool calls, are passed to the chat template as they are)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TypeError(f"messages must be a non-empty list of {{role, content}} dicts, got "
                        f"{type(messages).__name__ if messages else messages!r}")
    if len(messages) > MAX_MESSAGES:
        raise ValueError(f"messages has {len(messages)} entries; at most {MAX_MESSAGES}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise TypeError(f"messages[{i}] must be a dict with a str 'role', got "
                            f"{message!r:.80}")
        content = message.get("content")
        if content is not None and not isinstance(content, str):
            raise TypeError(f"messages[{i}]['content'] must be a str, got "
                            f"{type(content).__name__}")
