"""Requests, batches and the Executor interface: plain Python, no JAX.

These types are the contract between the scheduler (which decides), the executors
(the JAX engine and the simulator, which run a batch) and the serving layer.

A request's tokens are its prompt followed by what it has generated. The KV cache
holds the first `num_computed_tokens` of them. Every scheduled chunk processes the
next `num_tokens` uncomputed tokens; when a chunk reaches the last token the step
samples one new token. A decode is therefore the chunk of size 1 at the end of a
request that has output, and a preempted request is recomputed as a prefill of
prompt + output so far (recompute preemption, never drop).
"""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import NamedTuple, Protocol

from medha_jax.sampling_params import SamplingParams


class RequestState(enum.Enum):
    WAITING = "waiting"      # queued, holds no KV pages (new or preempted)
    RUNNING = "running"      # holds KV pages, prefilling or decoding
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    LENGTH = "length"        # reached max_new_tokens
    STOP = "stop"            # stop token id, end of sequence, or stop string
    CANCELLED = "cancelled"  # the caller went away or asked to cancel
    ERROR = "error"          # failed inside the system; the message says why


@dataclasses.dataclass(frozen=True)
class SLO:
    """Service-level objectives of one request, in seconds."""

    ttft_s: float = 10.0     # deadline for the first token, relative to arrival
    tpot_s: float = 0.5      # target time between output tokens

    def __post_init__(self):
        if not self.ttft_s > 0:
            raise ValueError(f"SLO.ttft_s must be > 0, got {self.ttft_s!r}")
        if not self.tpot_s > 0:
            raise ValueError(f"SLO.tpot_s must be > 0, got {self.tpot_s!r}")


@dataclasses.dataclass(eq=False)
class Request:
    """One generation request and its progress. Identity-compared; mutated by the controller."""

    request_id: str
    prompt_len: int
    max_new_tokens: int
    arrival_time: float
    slo: SLO = dataclasses.field(default_factory=SLO)
    priority: int = 0                          # lower value = more important class
    prompt_token_ids: list[int] | None = None  # None in the simulator (lengths only)
    sampling: SamplingParams = dataclasses.field(
        default_factory=lambda: SamplingParams(temperature=0.0))
    session_id: str | None = None

    # Progress, maintained by the controller.
    state: RequestState = RequestState.WAITING
    num_computed_tokens: int = 0               # tokens whose K/V are in the cache
    # In batches still in flight (a pipelined executor runs several at once: a prefill's
    # next chunk may be scheduled before the previous one is done); maintained by the
    # controller.
    num_in_flight_tokens: int = 0
    num_cached_tokens: int = 0                 # of those, reused from the prefix cache
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_preemptions: int = 0

    # Predicted prefill work in seconds for the whole prompt (w_total of LARS).
    w_total: float = 0.0

    # Timestamps on the controller's clock.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None

    def __post_init__(self):
        if self.prompt_len < 1:
            raise ValueError(f"request {self.request_id}: prompt must have at least one token")
        if self.max_new_tokens < 1:
            raise ValueError(f"request {self.request_id}: max_new_tokens must be >= 1")
        if self.prompt_token_ids is not None and len(self.prompt_token_ids) != self.prompt_len:
            raise ValueError(
                f"request {self.request_id}: prompt_len={self.prompt_len} but "
                f"{len(self.prompt_token_ids)} prompt token ids")

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return self.prompt_len + len(self.output_token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Computed or in flight: where the request's next chunk starts."""
        return self.num_computed_tokens + self.num_in_flight_tokens

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose K/V still have to be computed before the next sample."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.state is RequestState.FINISHED

    @property
    def is_decode(self) -> bool:
        """Has output and exactly one token (the last sampled) left to compute."""
        return bool(self.output_token_ids) and self.num_pending_tokens == 1

    @property
    def is_prefill(self) -> bool:
        return not self.is_finished and not self.is_decode

    @property
    def deadline(self) -> float:
        """Absolute TTFT deadline: a + d."""
        return self.arrival_time + self.slo.ttft_s

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Token ids [start, stop) of prompt + output (needs prompt_token_ids)."""
        if self.prompt_token_ids is None:
            raise ValueError(f"request {self.request_id} carries lengths only, no token ids")
        n = self.prompt_len
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        return (self.prompt_token_ids[start:n] if start < n else []) + \
            self.output_token_ids[max(start - n, 0):stop - n]


class ScheduledChunk(NamedTuple):
    """Compute K/V of tokens [start, start + num_tokens) of `request` in one step.

    A NamedTuple, not a frozen dataclass: the scheduler makes one per decode per step, and
    this constructs in half the time."""

    request: Request
    start: int
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the request's last token, so a token is sampled."""
        return self.end == self.request.num_tokens

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == 1 and self.start >= self.request.prompt_len


@dataclasses.dataclass
class Batch:
    """What one iteration runs: decodes and prefill chunks, at most one chunk per request."""

    chunks: list[ScheduledChunk] = dataclasses.field(default_factory=list)
    predicted_time_s: float = 0.0

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def num_seqs(self) -> int:
        return len(self.chunks)

    def __len__(self) -> int:
        return len(self.chunks)

    def __bool__(self) -> bool:
        return bool(self.chunks)


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """One token's log-probability under the model, and the most likely alternatives.

    top: (token id, logprob) pairs, most likely first, as many as the request asked for
    (it may include token_id itself)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass
class StepResult:
    """What an executor returns for one batch.

    logprobs and prompt_logprobs hold only what requests asked for (SamplingParams.logprobs,
    .prompt_logprobs); executors that compute none (the simulator, test doubles) leave them
    empty."""

    sampled_token_ids: dict[str, int]   # request_id -> new token, for chunks that sample
    duration_s: float                   # measured (engine) or predicted (simulator) time
    # request_id -> the sampled token's logprobs.
    logprobs: dict[str, TokenLogprobs] = dataclasses.field(default_factory=dict)
    # request_id -> {prompt position p (>= 1) -> logprobs of prompt token p given tokens
    # before it}, for the positions this batch's chunk computed.
    prompt_logprobs: dict[str, dict[int, TokenLogprobs]] = dataclasses.field(
        default_factory=dict)


class Executor(Protocol):
    """Runs a batch: the JAX engine, the simulator, or a test double."""

    def execute(self, batch: Batch) -> StepResult: ...


class PipelinedExecutor(Executor, Protocol):
    """An executor that runs up to `max_in_flight` batches at once (SPP stages, or the host
    building step n + 1 while the device runs step n). `dispatch` starts a batch and
    returns without waiting; `collect` waits for one dispatched batch, oldest first.
    `execute(batch)` is `collect(dispatch(batch))`."""

    max_in_flight: int

    def dispatch(self, batch: Batch) -> object: ...

    def collect(self, pending: object) -> StepResult: ...


class Clock(Protocol):
    def now(self) -> float: ...


class WallClock:
    """Monotonic seconds; what the server runs on."""

    def now(self) -> float:
        return time.monotonic()


class VirtualClock:
    """A clock the simulator (or a test) moves by hand."""

    def __init__(self, start: float = 0.0):
        self._now = float(start)

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"cannot move a clock backwards by {seconds}")
        self._now += seconds

    def advance_to(self, t: float) -> None:
        self._now = max(self._now, float(t))


@dataclasses.dataclass(frozen=True)
class RequestUpdate:
    """What happened to one request in one controller iteration."""

    request: Request
    new_token_ids: tuple[int, ...]   # tokens produced this iteration (0 or 1)
    finished: bool
