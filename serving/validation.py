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


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """The SLOs and priority classes a server admits (Server(limits=...), the CLI's
    --min-ttft / --max-ttft / --min-tpot / --max-tpot / --min-priority / --max-priority).

    An SLO is a promise the scheduler spends the batch on: a decode's tpot_s bounds the time
    of every batch it rides in, so one request asking tpot_s=1e-9 would shrink every prefill
    beside it to the minimum chunk. The floors are about one step of a GPU (10-30 ms); the
    ceilings keep an "infinite" SLO from meaning "never schedule" under EDF-like keys.
    Priority: lower is more important (Request.priority); clients of the network front ends
    may ask only for DEFAULT_PRIORITY or less important classes unless the operator grants
    them more (a priority token), as vLLM and SGLang gate priority scheduling."""

    min_ttft_s: float = 0.1
    max_ttft_s: float = 3600.0
    min_tpot_s: float = 0.02
    max_tpot_s: float = 60.0
    min_priority: int = -100
    max_priority: int = 100

    def __post_init__(self):
        for low, high in [("min_ttft_s", "max_ttft_s"), ("min_tpot_s", "max_tpot_s")]:
            lo, hi = getattr(self, low), getattr(self, high)
            if not (math.isfinite(lo) and math.isfinite(hi) and 0 < lo <= hi):
                raise ValueError(f"RequestLimits needs 0 < {low} <= {high}, finite; got "
                                 f"{low}={lo!r}, {high}={hi!r}")
        if not -INT32_MAX - 1 <= self.min_priority <= DEFAULT_PRIORITY <= self.max_priority \
                <= INT32_MAX:
            raise ValueError(f"RequestLimits needs min_priority <= {DEFAULT_PRIORITY} <= "
                             f"max_priority within int32; got min_priority={self.min_priority}, "
                             f"max_priority={self.max_priority}")

    def check_slo(self, slo: SLO) -> None:
        for name, lo, hi in [("ttft_s", self.min_ttft_s, self.max_ttft_s),
                             ("tpot_s", self.min_tpot_s, self.max_tpot_s)]:
            value = getattr(slo, name)
            if not lo <= value <= hi:
                raise ValueError(f"slo.{name}={value:.3g} is outside this server's range "
                                 f"[{lo}, {hi}] s")

    def check_priority(self, priority: int, *, may_raise: bool = True) -> None:
        """may_raise: the caller may ask for a class more important than the default."""
        if not self.min_priority <= priority <= self.max_priority:
            raise ValueError(f"priority={priority} is outside this server's range "
                             f"[{self.min_priority}, {self.max_priority}]")
        if priority < DEFAULT_PRIORITY and not may_raise:
            raise PriorityNotAllowed(
                f"priority={priority} is more important than the default "
                f"({DEFAULT_PRIORITY}; lower is more important): this client may not raise "
                f"its priority (the operator grants it with a priority token)")


DEFAULT_PRIORITY = 0
DEFAULT_LIMITS = RequestLimits()


class PriorityNotAllowed(ValueError):
    """A client asked for a priority class the operator has not granted it."""


def check_request_args(params, slo, priority, limits: RequestLimits = DEFAULT_LIMITS) -> None:
    """The non-prompt arguments of one request."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
    if slo is not None and not isinstance(slo, SLO):
        raise TypeError(f"slo must be an SLO, got {type(slo).__name__}")
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise TypeError(f"priority must be an int, got {priority!r}")
    limits.check_priority(priority)
    if slo is not None:
        limits.check_slo(slo)
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
                     model_name: str, check_fits: Callable[[int, int], None],
                     limits: RequestLimits = DEFAULT_LIMITS) -> list[int]:
    """The prompt's token ids, once every argument is known to be servable.

    check_fits(prompt_len, max_tokens): the controller's size check (max_model_len, KV
    capacity); it reads only fixed sizes, so it is safe on the caller's thread."""
    check_request_args(params, slo, priority, limits)
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
