"""How a request's tokens are sampled and when its generation stops. Plain data."""

from __future__ import annotations

import dataclasses

# Alternatives per token that `logprobs` and `prompt_logprobs` may ask for: what OpenAI's
# API allows (top_logprobs <= 20), and the static width of the step's top-k (one compiled
# shape whatever a request asks; the host keeps the first k).
MAX_LOGPROBS = 20
# Samples per prompt (`n`): they share the prompt's pages, but each is a sequence of its
# own in every step, so one request must not fill a batch by itself.
MAX_N = 64


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Per-request sampling and stopping.

    temperature == 0 means greedy. top_k == 0 and top_p == 1 disable those filters.
    A fixed `seed` makes the request's tokens reproducible whatever batch it runs in.

    n: samples of the prompt (1..MAX_N); they share its prefilled KV pages through the
    prefix cache (see serving.server.Server.submit). With a seed, sample i uses seed + i.
    logprobs: for each generated token, its log-probability and those of the `logprobs`
    most likely tokens (0..MAX_LOGPROBS; 0 = the sampled token's own only; None = off).
    prompt_logprobs: the same for every prompt token after the first (given the tokens
    before it). Both are of the model's raw distribution (float32 log-softmax of its
    logits, before temperature, top-k and top-p), as OpenAI and vLLM report them.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 64
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self):
        # Accept lists from callers; store tuples so the params stay hashable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an int in [1, {MAX_N}], got {self.n!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an int in [0, {MAX_LOGPROBS}], "
                                 f"got {value!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
