"""Batch packers: which chunks of which requests run in the next iteration.

`AdaptivePacker` is Medha's (seed 000, appendix A):
  Algorithm 1: all decodes first, then prefill chunks in priority order while the
               predicted batch time is below t_target.
  Algorithm 2: each prefill gets the largest chunk (binary search on the predictor)
               that keeps the batch within its budget; at most one long prefill per
               batch. Late chunks of a long prefill attend to a long context, so a
               fixed time budget shrinks them: adaptive chunking.
  Space sharing and multi-prefill batching (sections 4.2-4.3): short prefills that
               cost the batch's most urgent prefill no deadline run beside it at once,
               within up to rho_max of the budget (`AdaptivePacker.riders` says which,
               and where this departs from the pseudo-code).
`TokenBudgetPacker` is the baselines': Sarathi-Serve's fixed token budget per batch
(decodes + chunks), and with the whole step as budget and head-of-line blocking, the
non-preemptive convoy baseline.

Engine limits: a batch is padded to the next token bucket, so the predictor prices the
padded size; the binary search then lets the last chunk grow into the padding whenever
that still fits the budget. Decodes are never left out, except when there are more of
them than one step can hold (max_seqs_per_batch or the largest token bucket): then
they take turns, the one that waited longest for a token first.

KV space: packers ask a `ChunkGate` (the controller) before they commit to a chunk.
`prepare(request)` registers a waiting request's pages (its cached prefix sets where
the first chunk starts); `reserve(chunk)` finds KV space for it, preempting lower
priority requests when needed; `prepare_and_reserve` does both for a rider's whole rest
and `reserve_decodes` the latter for every decode of the step, each in one call. A
chunk the gate refuses is left out of this batch.

Host time (benchmarks/scheduler_overhead.py, lars-mp, 64 decodes, 1,000 queued): about
0.82 M instructions per batch, a median of 92-97 microseconds on a 2-core AMD EPYC
host: a sixth ranks the queue (numpy, and only the first half of the candidates unless
the packer reads on), a fifth books the decodes, the rest packs the ~10 prefills. The
only loop over every decode is the gate's `reserve_decodes` (the budget reads the
tightest TPOT the controller keeps); prefills are read from the front of the priority
order only as far as the batch has room (`riders` is lazy, their w(t) read from the
controller's SRPT keys), and a rider whose whole rest fits (most of them) is priced with
the batch it makes (`plus_chunk_time`) and granted in one gate call, unsearched.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import operator
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol

from medha_jax.buckets import padded_size
from medha_jax.request import Batch, Request, ScheduledChunk
from medha_jax.scheduler.predictor import (BatchFeatures, RuntimePredictor, chunk_time,
                                           plus_chunk_time)


# Read per decode per step: C-level getters instead of a Python loop.
_START = operator.itemgetter(1)                        # ScheduledChunk.start
_TPOT = operator.attrgetter("request.slo.tpot_s")      # of a ScheduledChunk
# A rider the head's slack covers that has more work left than the head: it joins the
# batch right after the head's chunk, not before it (`AdaptivePacker.riders`).
AFTER_HEAD = "after the head"
_new_tuple = tuple.__new__      # a NamedTuple's own __new__ is Python: per chunk, this is not


class ChunkGate(Protocol):
    def prepare(self, request: Request) -> bool: ...

    def reserve(self, chunk: ScheduledChunk) -> bool: ...

    def prepare_and_reserve(self, request: Request, start: int, num_tokens: int
                            ) -> ScheduledChunk | bool:
        """`prepare_then_reserve`: one call per rider."""
        ...

    def reserve_decodes(self, decodes: Sequence[Request], seats: int) -> list[ScheduledChunk]:
        """`reserve_each_decode`: the decode chunks granted, in order, at most `seats`."""
        ...


def reserve_each_decode(gate: ChunkGate, decodes: Sequence[Request], seats: int
                        ) -> list[ScheduledChunk]:
    """What `ChunkGate.reserve_decodes` means: each decode's one-token chunk (its last
    sampled token) in order, through gate.reserve, until `seats` were granted."""
    chunks: list[ScheduledChunk] = []
    for request in decodes:
        if len(chunks) >= seats:
            break
        end = request.prompt_len + len(request.output_token_ids)
        chunk = ScheduledChunk(request, end - 1, 1)
        if gate.reserve(chunk):
            chunks.append(chunk)
    return chunks


def prepare_then_reserve(gate: ChunkGate, request: Request, start: int, num_tokens: int
                         ) -> ScheduledChunk | bool:
    """What `ChunkGate.prepare_and_reserve` means: prepare(request), then, if its next chunk
    still starts at `start` (a cached prefix found at prepare moves it), reserve() of the
    chunk [start, start + num_tokens). The chunk where granted; False where prepare or
    reserve refused; True where the start moved (prepared: the caller sizes a chunk from
    the new start)."""
    if not gate.prepare(request):
        return False
    if request.num_scheduled_tokens != start:
        return True
    chunk = _new_tuple(ScheduledChunk, (request, start, num_tokens))
    return chunk if gate.reserve(chunk) else False


class OpenGate:
    """Admits everything: for packing without a KV cache (tests, benchmarks, Algorithm 3)."""

    def prepare(self, request: Request) -> bool:
        return True

    def reserve(self, chunk: ScheduledChunk) -> bool:
        return True

    def prepare_and_reserve(self, request: Request, start: int, num_tokens: int
                            ) -> ScheduledChunk | bool:
        return prepare_then_reserve(self, request, start, num_tokens)

    def reserve_decodes(self, decodes: Sequence[Request], seats: int) -> list[ScheduledChunk]:
        return reserve_each_decode(self, decodes, seats)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineLimits:
    """What one step of the engine can hold.

    token_buckets:        sorted allowed padded token counts; None = no padding.
    max_tokens_per_batch: tokens per step; defaults to the largest bucket (no limit
                          without buckets, e.g. in the simulator).
    max_seqs_per_batch:   sequences per step.
    query_block_tokens:   query tokens per block of the engine's attention: a prefill
                          chunk pays whole blocks (each one pass over its context), so a
                          chunk shorter than a block costs the attention as much as a
                          block (`Engine.query_block_tokens`; 1 = no such granularity).
    """

    token_buckets: tuple[int, ...] | None = None
    max_tokens_per_batch: int | None = None
    max_seqs_per_batch: int = 256
    query_block_tokens: int = 1

    def __post_init__(self):
        buckets = self.token_buckets
        if buckets is not None:
            buckets = tuple(buckets)
            object.__setattr__(self, "token_buckets", buckets)
            if not buckets or any(not isinstance(b, int) or b < 1 for b in buckets) or \
                    any(a >= b for a, b in zip(buckets, buckets[1:])):
                raise ValueError(
                    f"token_buckets must be strictly increasing positive ints, got {buckets}")
            if self.max_tokens_per_batch is None:
                object.__setattr__(self, "max_tokens_per_batch", buckets[-1])
            elif self.max_tokens_per_batch > buckets[-1]:
                raise ValueError(f"max_tokens_per_batch={self.max_tokens_per_batch} exceeds the "
                                 f"largest token bucket {buckets[-1]}")
        if self.max_tokens_per_batch is not None and self.max_tokens_per_batch < 1:
            raise ValueError(f"max_tokens_per_batch must be >= 1, got {self.max_tokens_per_batch}")
        if not isinstance(self.max_seqs_per_batch, int) or self.max_seqs_per_batch < 1:
            raise ValueError(
                f"max_seqs_per_batch must be an int >= 1, got {self.max_seqs_per_batch!r}")
        if not isinstance(self.query_block_tokens, int) or self.query_block_tokens < 1:
            raise ValueError(
                f"query_block_tokens must be an int >= 1, got {self.query_block_tokens!r}")

    @property
    def token_limit(self) -> int | float:
        return self.max_tokens_per_batch if self.max_tokens_per_batch is not None else math.inf


def largest_chunk(predictor: RuntimePredictor, base: BatchFeatures, *, start: int, max_tokens: int,
                  remaining: int, budget_s: float, token_buckets: Sequence[int] | None,
                  guess: int | None = None, tolerance: float = 1 / 128,
                  fitted: dict[int, float] | None = None) -> int:
    """About the largest n in [1, max_tokens] whose batch (base + chunk) is predicted
    <= budget_s; 0 if none. Never over budget; at most `tolerance` (relative) short of
    the exact largest, which saves a third of the predictions at long contexts.

    The chunk covers tokens [start, start + n) of a request with `remaining` tokens left;
    it samples when n == remaining. Predicted time grows with n except possibly at that
    last point (a sampling step may cost more, e.g. the pipeline depth under SPP), so
    max_tokens is tried first and the search runs over the monotone part below it.
    `guess` (e.g. the chunk a lone prefill gets at this context) starts a galloping
    search next to the answer instead of a bisection of the whole range. `fitted`, if
    given, gets the predicted time of each probe that fit, by n (the answer's among them,
    unless it is 0), so that the caller need not price its chunk again.
    """
    if max_tokens < 1:
        return 0

    def price(n: int) -> float:
        return chunk_time(predictor, base, n, start, remaining, token_buckets)

    seconds = price(max_tokens)
    if seconds <= budget_s:
        if fitted is not None:
            fitted[max_tokens] = seconds
        return max_tokens
    return chunk_below(price, base.tokens, max_tokens, budget_s, token_buckets, guess=guess,
                       tolerance=tolerance, fitted=fitted)


def chunk_below(price: Callable[[int], float], base_tokens: int, max_tokens: int,
                budget_s: float, token_buckets: Sequence[int] | None, *,
                guess: int | None = None, tolerance: float = 1 / 128,
                fitted: dict[int, float] | None = None) -> int:
    """`largest_chunk`'s search once max_tokens is known not to fit: about the largest n
    in [1, max_tokens) with price(n) <= budget_s (0 if none), the same probes."""

    def fits(n: int) -> bool:
        seconds = price(n)
        if not seconds <= budget_s:
            return False
        if fitted is not None:
            fitted[n] = seconds
        return True

    lo, hi = 0, max_tokens             # invariant: lo == 0 or fits(lo); not fits(hi)
    if guess is not None and 1 <= guess < max_tokens:
        step = max(1, guess >> 4)
        if fits(guess):
            lo = guess
            while lo + step < hi and fits(lo + step):
                lo += step
                step *= 2
            hi = min(hi, lo + step)
        else:
            hi = guess
            while hi - step > 0 and not fits(hi - step):
                hi -= step
                step *= 2
            lo = max(0, hi - step)
    while hi - lo > max(1, int(lo * tolerance)):
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    if token_buckets is not None and lo:
        # The padding up to the bucket edge is paid for already: fill it if the extra
        # attention still fits.
        fill = padded_size(base_tokens + lo, token_buckets) - base_tokens
        if lo < fill < hi and fits(fill):
            lo = fill
    return lo


def whole_query_block(n: int, max_tokens: int, limits: EngineLimits) -> int:
    """A prefill chunk of n >= 2 tokens widened to one query block of the engine's attention
    where it is shorter and max_tokens allows.

    The attention computes a block's rows whether they are real or not, so the block's
    other tokens cost only their share of the dense layers. Linear predictors do not see
    the step (they spread a block's cost over its tokens), and at long contexts, where
    little of the budget is left past one pass over the context, the search settles on
    chunks of a few tokens that each pay a whole block. On the CPU (64-token blocks,
    SmolLM2, a 0.38 s budget) a lone prefill's chunks fall below a block past about 2.2K
    context and to the 16-token minimum past about 6K, while a step costs 0.3-0.5 s
    either way. Single tokens stay: they take the decode path, which has no query block.
    """
    if n < 2:
        return n
    return max(n, min(limits.query_block_tokens, max_tokens))


def lone_prefill_chunk(predictor: RuntimePredictor, limits: EngineLimits, *, context_len: int,
                       remaining: int, t_target: float, min_chunk_tokens: int,
                       guess: int | None = None) -> int:
    """GetOptimalChunk of Algorithm 3: the chunk a prefill alone in a batch gets at t_target.

    The same choice the AdaptivePacker makes, including its progress guarantee (at least
    min_chunk_tokens even when a single token exceeds the budget).
    """
    cap = int(min(remaining, limits.token_limit))
    n = largest_chunk(predictor, BatchFeatures(), start=context_len, max_tokens=cap,
                      remaining=remaining, budget_s=t_target, token_buckets=limits.token_buckets,
                      guess=guess)
    n = chunk_worth_a_step(n, cap) or min(min_chunk_tokens, cap)
    return whole_query_block(n, cap, limits)


def chunk_worth_a_step(n: int, max_tokens: int) -> int:
    """A chunk search's n, or 0 where it is no progress worth a step: one token of a
    prompt with more left. One token takes the decode path (no query block), so the
    search settles on it exactly where a block of two or more does not fit the budget,
    and the prompt then moves one token a step: in benchmarks/disagg.py (c) on the CPU
    (SmolLM2, 0.2 s budget, 64-token blocks at 0.3-0.5 s), 1,024-token prompts took
    65-175 s to their first token instead of 10-20 s. Counted as no fit, the prompt gets
    the progress guarantee's chunk instead (`min_chunk_tokens`, widened to a block)."""
    return 0 if n == 1 and max_tokens > 1 else n


class BatchPacker:
    """Forms one Batch from the decodes and the prioritised prefills."""

    def __init__(self, predictor: RuntimePredictor, limits: EngineLimits):
        self.predictor = predictor
        self.limits = limits
        self._token_limit = limits.token_limit      # read by every chunk: not a property call
        self._chunk_time = getattr(predictor, "chunk_time", None) or \
            functools.partial(chunk_time, predictor)
        self._plus_chunk_time = getattr(predictor, "plus_chunk_time", None) or \
            functools.partial(plus_chunk_time, predictor)
        # Whether a chunk's predicted time never falls as it grows (from one token on).
        self._monotone = getattr(predictor, "chunk_time_grows_with_n", False)

    def pack(self, decodes: Sequence[Request], prefills: Sequence[Request], now: float,
             gate: ChunkGate = OpenGate(), *, tightest_tpot: float | None = None,
             queued_work: Callable[[str], float] | None = None, paced: bool = True) -> Batch:
        """decodes: in the order they should get the step's seats (longest waiting first).
        prefills: the most urgent prefill requests, most urgent first.
        tightest_tpot: the least slo.tpot_s among `decodes`, where the caller keeps it
        (a packer that budgets by TPOT then needs no pass over them); None: not known.
        queued_work: request id -> `remaining_work` of each of `prefills`, where the caller
        keeps it; None: not known.
        paced: whether any request the caller holds (running or queued) has a per-token
        objective (a finite slo.tpot_s); False: none has, and a packer that budgets time
        may fill the step as far as the engine allows."""
        raise NotImplementedError

    def _add_decodes(self, decodes: Sequence[Request], gate: ChunkGate,
                     chunks: list[ScheduledChunk]) -> BatchFeatures:
        """Phase 1 of Algorithm 1: every decode the step can hold."""
        seats = int(min(self.limits.max_seqs_per_batch, self._token_limit))
        granted = gate.reserve_decodes(decodes, seats)
        chunks.extend(granted)
        if not granted:
            return BatchFeatures()
        starts = list(map(_START, granted))               # each ends at start + 1
        tokens = len(starts)
        sum_ctx, max_ctx = sum(starts) + tokens, max(starts) + 1
        return BatchFeatures(tokens, padded_size(tokens, self.limits.token_buckets), tokens,
                             sum_ctx, tokens, sum_ctx, tokens, max_decode_context=max_ctx,
                             max_context=max_ctx)

    def _room(self, features: BatchFeatures) -> int | float:
        if features.seqs >= self.limits.max_seqs_per_batch:
            return 0
        return self._token_limit - features.tokens


class AdaptivePacker(BatchPacker):
    """Algorithms 1 and 2 of Medha: time-budgeted, adaptively chunked prefills.

    target_batch_time_s: t_target when no running decode asks for less through its TPOT
                         SLO (the budget is min(target, every decode's tpot_s)).
    multi_prefill:       several prefills per batch (at most one long); False = one.
    space_sharing:       a long prefill shares its batch with short prefills that cost it
                         no deadline, up to rho_max of the budget (see `riders`).
    long_prefill_tokens: IsLong of Algorithm 2: sequences at least this long. The
                         default 8192 is the short/long boundary of seed 000, sec. 6.5.
    min_chunk_tokens:    progress guarantee: when no prefill fits the budget (decodes
                         alone fill it, one token of a huge context exceeds it, or only
                         one token fits: `chunk_worth_a_step`), the
                         most urgent prefill still gets this many tokens (a whole query
                         block where that is more: `whole_query_block`). So a batch exceeds
                         max(t_target, decode time) by at most one such chunk, and a chunk
                         the search found by the dense layers of its block's other tokens.
    chunk_hint:          context length -> a likely chunk size (the lone-prefill chunk of
                         the PrefillTimeCache), where each chunk search starts.
    pipeline_stages:     spp of the executor. The predictor prices one stage and a batch is
                         one stage's work, but a decode's next token comes only after its
                         batch crossed every stage: a decode's TPOT buys tpot_s / stages of
                         one batch.
    prefill_hold_s:      a prefill not yet started whose request arrived less than this long
                         ago stays out of steps that carry decodes (they run alone); with no
                         decode running it starts at once. 0: never held (Medha's
                         co-scheduling). See `held_back`.
    """

    def __init__(self, predictor: RuntimePredictor, limits: EngineLimits, *,
                 remaining_work: Callable[[Request], float],
                 target_batch_time_s: float = 0.05, multi_prefill: bool = False,
                 space_sharing: bool = False, rho_max: float = 0.4,
                 long_prefill_tokens: int = 8192, min_chunk_tokens: int = 16,
                 chunk_hint: Callable[[int], int] | None = None, pipeline_stages: int = 1,
                 prefill_hold_s: float = 0.0):
        super().__init__(predictor, limits)
        if not prefill_hold_s >= 0:
            raise ValueError(f"prefill_hold_s must be >= 0, got {prefill_hold_s!r}")
        if pipeline_stages < 1:
            raise ValueError(f"pipeline_stages must be >= 1, got {pipeline_stages!r}")
        if not target_batch_time_s > 0:
            raise ValueError(f"target_batch_time_s must be > 0, got {target_batch_time_s!r}")
        if not 0 <= rho_max < 1:
            raise ValueError(f"rho_max must be in [0, 1), got {rho_max!r}")
        if long_prefill_tokens < 1 or min_chunk_tokens < 1:
            raise ValueError(f"{long_prefill_tokens=} and {min_chunk_tokens=} must be >= 1")
        self.remaining_work = remaining_work
        self.target_batch_time_s = target_batch_time_s
        self.multi_prefill = multi_prefill
        self.space_sharing = space_sharing
        self.rho_max = rho_max
        self.long_prefill_tokens = long_prefill_tokens
        self.min_chunk_tokens = min_chunk_tokens
        self.chunk_hint = chunk_hint
        self.pipeline_stages = pipeline_stages
        self.prefill_hold_s = prefill_hold_s

    def t_target(self, decodes: Sequence[ScheduledChunk], *,
                 tightest_tpot: float | None = None, every_decode: bool = False,
                 paced: bool = True) -> float:
        """The batch's time budget: the strictest TPOT among its decodes (over the pipeline's
        stages), or the default; unbounded (inf) when no request is `paced`.

        tightest_tpot: the least tpot_s of a set of requests holding every one of `decodes`
        (the caller's, kept as they come and go), where known; `every_decode`: `decodes`
        are that whole set. Then no pass over the decodes is needed: the least is
        tightest_tpot itself, or, where that leaves the default, any subset's too.
        paced: False when no request the replica holds, running or queued, has a finite
        tpot_s (a caller that reads only whole outputs, `Server.generate`). Deviation from
        Algorithm 1, whose t_target is a hard bound derived from the decodes' TPOT SLOs:
        with no TPOT to protect, the bound only shrinks steps, and on a device whose
        fixed cost per step is large (a CPU: ~0.25 s of a 0.5 s budget for SmolLM2) half of
        every step is that cost. So the step grows to what the engine allows (tokens and
        sequences per step, KV pages); a request with a finite tpot_s that arrives
        restores the bound from the next batch on."""
        if not paced:
            return math.inf
        budget = self.target_batch_time_s
        if decodes:
            if tightest_tpot is not None and (
                    every_decode or not tightest_tpot / self.pipeline_stages < budget):
                tpot = tightest_tpot / self.pipeline_stages
            else:
                tpot = min(map(_TPOT, decodes)) / self.pipeline_stages
            if tpot < budget:
                budget = tpot
        return budget

    def pack(self, decodes: Sequence[Request], prefills: Sequence[Request], now: float,
             gate: ChunkGate = OpenGate(), *, tightest_tpot: float | None = None,
             queued_work: Callable[[str], float] | None = None, paced: bool = True) -> Batch:
        """queued_work: request id -> remaining_work of each of `prefills`, where the caller
        keeps it (the controller's SRPT keys: a lookup instead of w(t) per rider read)."""
        chunks: list[ScheduledChunk] = []
        features = self._add_decodes(decodes, gate, chunks)
        if chunks and self.prefill_hold_s:
            prefills = self.held_back(prefills, now)
        t_target = self.t_target(chunks, tightest_tpot=tightest_tpot,
                                 every_decode=len(chunks) == len(decodes), paced=paced)
        t_pred = self.predictor.predict_features(features)
        max_prefills = self.limits.max_seqs_per_batch if self.multi_prefill else 1
        num_prefills, has_long = 0, False
        packed: set[str] = set()          # riders packed ahead of their turn
        unserved: list[Request] = []      # prepared, but no chunk fit the budget
        # Read in order, only as far as the batch has room (the controller orders its
        # candidates as far as they are read).
        heads = iter(prefills)
        i = 0
        while t_pred < t_target and num_prefills < max_prefills:
            # Before reading on: once riders filled the step, the heads left to read are
            # mostly those riders, each skipped at the price of a read.
            if self._room(features) < 1:
                break
            request = next(heads, None)
            if request is None:
                break
            i += 1
            if request.request_id in packed:
                continue
            is_long = self.is_long(request)
            if is_long and has_long:        # Algorithm 2, line 3
                continue
            if not gate.prepare(request):
                continue
            # Riders of the batch's most urgent prefill only: it is the one whose slack
            # or remaining work decides what may pass it. IsLong does not gate this:
            # what lets a short request pass is the head's slack and length relative to
            # the short one's, not a token threshold (which a scaled-down CPU workload,
            # long prompts of 2-4K tokens, never reaches).
            # (None of the later ones is packed yet: riders join only the first prefill.)
            riders = (self._iter_riders(request, itertools.islice(prefills, i, None), now,
                                        queued_work)
                      if self.space_sharing and self.multi_prefill and not num_prefills
                      else ())
            # Space sharing (Algorithm 2, lines 7-10) with multi-prefill batching: the
            # riders go first, in order - those the long one's slack covers with the whole
            # budget (they cannot make it miss), the others within rho_max of what the
            # decodes leave - and the long chunk takes the rest, so a share the riders do
            # not use is never idled. Riders first, not after the long chunk: with token
            # buckets the long chunk would grow to its bucket's edge (padding is paid
            # for) and leave the riders only the next bucket, which the share cannot buy.
            share_end = t_pred + self.rho_max * (t_target - t_pred)
            chunk_time_, buckets = self._chunk_time, self.limits.token_buckets
            plus_chunk_time_ = self._plus_chunk_time
            monotone, max_seqs = self._monotone, self.limits.max_seqs_per_batch
            after_head: list[Request] = []
            for rider, covered in riders:
                if covered is AFTER_HEAD:
                    after_head.append(rider)
                    continue
                if num_prefills + 1 >= max_prefills:       # a seat stays the head's
                    break
                room = 0 if features.seqs >= max_seqs else self._token_limit - features.tokens
                if room < 1:                     # no rider fits; stop reading them
                    break
                budget = t_target if covered or not is_long else share_end
                # num_scheduled_tokens and num_tokens, inlined (properties: a call each).
                start = rider.num_computed_tokens + rider.num_in_flight_tokens
                remaining = rider.prompt_len + len(rider.output_token_ids) - start
                # Worth a search if a one-token chunk fits; riders are short, and mostly
                # the whole rest fits, which (where time grows with n) says so at once
                # and is the search's first probe (priced with the batch it would make).
                n = int(min(remaining, room))
                with_whole, whole = plus_chunk_time_(features, n, start, remaining, buckets)
                if monotone and whole <= budget and n >= 1:
                    # The whole rest: no search, unless a cached prefix moves its start
                    # (_add_chunk prepares once: a second prepare changes nothing).
                    chunk = gate.prepare_and_reserve(rider, start, n)
                    if chunk is not True:
                        if chunk:
                            chunks.append(chunk)
                            features, t_pred = with_whole, whole
                            packed.add(rider.request_id)
                            num_prefills += 1
                        continue
                elif not ((monotone and whole <= budget) or
                          chunk_time_(features, 1, start, remaining, buckets) <= budget):
                    continue
                added = self._add_chunk(rider, features, budget, gate, chunks,
                                        start, remaining, whole)
                if added is not None:
                    features, t_pred = added
                    packed.add(rider.request_id)
                    num_prefills += 1
            if num_prefills >= max_prefills:
                break
            start = request.num_scheduled_tokens
            remaining = request.num_tokens - start
            n, seconds = self._chunk_size(features, start, remaining, t_target)
            if n == 0:
                unserved.append(request)        # Algorithm 1, line 17: tries next time
                continue
            chunk = ScheduledChunk(request, start, n)
            if not gate.reserve(chunk):
                continue
            chunks.append(chunk)
            features, t_pred = self._priced(features, start, n, remaining, seconds)
            num_prefills += 1
            has_long = has_long or is_long
            # Riders with more work left than the head: right after it, in what the head
            # left of the budget, before the prefills ranked between them.
            for rider in after_head:
                if t_pred >= t_target or num_prefills >= max_prefills or \
                        self._room(features) < 1:
                    break
                start = rider.num_scheduled_tokens
                added = self._add_chunk(rider, features, t_target, gate, chunks, start,
                                        rider.num_tokens - start, None)
                if added is not None:
                    features, t_pred = added
                    packed.add(rider.request_id)
                    num_prefills += 1
        if num_prefills == 0:
            progress = self._guarantee_progress(
                itertools.chain(unserved, itertools.islice(prefills, i, None)), features, gate,
                chunks)
            if progress is not features:
                features, t_pred = progress, self.predictor.predict_features(progress)
        return Batch(chunks, t_pred)

    def held_back(self, prefills: Sequence[Request], now: float) -> Iterable[Request]:
        """The prefills that may share a step with decodes: those whose request arrived at
        least prefill_hold_s before `now`, and those whose prefill has started (a chunk of
        it ran: holding the rest of a burst's prompt would only delay it and still land
        beside the decodes when the hold expires), in order (read lazily, as often as the
        packer reads them).

        Deviation from Algorithm 1 (off by default), for a device with one pool of compute
        (a CPU): there a prefill chunk delays the decodes beside it by its whole work,
        whatever its size, so a decode that shares a few steps with newcomers' prefills
        streams its tokens at a fraction of its own rate (SmolLM2 on 2 cores: 52-57 ms
        per output token for those requests against ~25 ms alone); smaller budgets only
        add steps. Holding a newcomer until the decodes end or the hold expires bounds
        what it costs its TTFT (at most the hold) and keeps the decodes at their own
        rate meanwhile, as a server that runs one request at a time does (llama.cpp's),
        while a request that waited out its hold co-schedules as before. TGI's
        max_waiting_tokens is the same trade, counted in steps."""
        latest = now - self.prefill_hold_s
        return _NotHeld(prefills, latest)

    def is_long(self, request: Request) -> bool:
        """IsLong of Algorithm 2: a prompt longer than long_prefill_tokens.

        The prompt, not num_tokens: a short request recomputed after preemption (prompt +
        output) stays short. Strictly longer: seed 000 (sec. 6.5) calls "< 8192" short, but
        the ShareGPT4 prompts of its short class are clipped at 8192 tokens (3.5% of them
        sit at the clip, workloads.SHAREGPT4_PROMPT), and those must not count as long -
        a long could not run beside them, nor they beside a long.
        """
        return request.prompt_len > self.long_prefill_tokens

    def riders(self, long: Request, later: Sequence[Request], now: float
               ) -> list[tuple[Request, bool | str]]:
        """The short prefills ranked below `long` that may share its batch now, in order,
        each with whether the long one's slack covers it (True; AFTER_HEAD where it has
        more work left than the long one: it joins the batch right after the long chunk).

        Deviation from Algorithm 2, where the paper is silent on whom a long prefill yields
        to and fixes the share at min(rho, rho_max) of t_target. Under LARS order alone a
        short request (rho ~ d / w_short, tens) runs only once its rho falls below the
        long's (~1 or below), i.e. at its deadline; and a long with rho <= 0 (behind
        schedule under load) yields nothing, so every short waits its whole deadline. Yet
        serving a short request early costs the long nothing in two cases:
          slack: its remaining work fits in the long's slack s = a + d - now - w(t) left
                 after earlier riders - the long still meets its deadline. One with more
                 work left than the long's w(t) and not due (below) goes right after
                 the long chunk, not before it (AFTER_HEAD; shortest remaining first:
                 ahead of a head in its last chunk it would delay the head by more than
                 it gains, and both TTFTs get worse), still ahead of the prefills ranked
                 between them;
          due:   a + d <= now + w_long(t) - the short is due before the long can finish,
                 so any schedule that meets the short's deadline runs it before the long
                 completes; running it now leaves the long's completion time unchanged
                 (exchange argument), whatever the long's slack.
        Riders its slack covers may use the whole budget: they cannot make it miss.
        Riders that are only due share rho_max of the budget of a long prefill (the cap
        of Algorithm 2; as they cost it nothing it yields the most it may, not min(rho,
        rho_max)): the long one keeps 1 - rho_max, so a flood of short requests cannot
        starve it. Beside a head that is not long they too get the whole budget: sharing
        a step between prefills of similar size only delays both. A short
        request that is neither waits for its LARS turn. Without riders the long one
        yields nothing, also not to a queue of other long prefills that could not use
        the share (the pseudo-code's share would idle there).
        """
        return list(self._iter_riders(long, later, now))

    def _iter_riders(self, long: Request, later: Iterable[Request], now: float,
                     queued_work: Callable[[str], float] | None = None
                     ) -> Iterator[tuple[Request, bool | str]]:
        """`riders`, read only as far as the packer needs them (queued_work: see pack)."""
        long_tokens = self.long_prefill_tokens
        by_id = queued_work is not None
        work_of = queued_work if by_id else self.remaining_work
        long_work = work_of(long.request_id if by_id else long)
        finish = now + long_work
        spare = max(0.0, long.deadline - finish)
        for request in later:
            if request.prompt_len > long_tokens:         # is_long
                continue
            work = work_of(request.request_id if by_id else request)
            if work <= spare:
                spare -= work
                # (Its deadline read only where its work does not decide: every rider is
                # read each step.)
                yield request, (True if work < long_work
                                or request.arrival_time + request.slo.ttft_s <= finish
                                else AFTER_HEAD)
            elif request.arrival_time + request.slo.ttft_s <= finish:    # deadline
                yield request, False

    def _add_chunk(self, request: Request, features: BatchFeatures, budget_s: float,
                   gate: ChunkGate, chunks: list[ScheduledChunk], start: int, remaining: int,
                   whole: float) -> tuple[BatchFeatures, float] | None:
        """Appends the largest chunk of `request` that keeps the batch within budget_s, if
        one fits and gets its KV pages; the batch's features with it and their predicted
        time, or None. start, remaining, whole: the request's next chunk as it stood
        before gate.prepare, and the predicted time of the largest one there is room for."""
        if not gate.prepare(request):
            return None
        if request.num_scheduled_tokens != start:       # a cached prefix: chunks start later
            start = request.num_scheduled_tokens
            remaining, whole = request.num_tokens - start, None
        n, seconds = self._chunk_size(features, start, remaining, budget_s, whole)
        if n == 0:
            return None
        chunk = ScheduledChunk(request, start, n)
        if not gate.reserve(chunk):
            return None
        chunks.append(chunk)
        return self._priced(features, start, n, remaining, seconds)

    def _priced(self, features: BatchFeatures, start: int, n: int, remaining: int,
                seconds: float | None) -> tuple[BatchFeatures, float]:
        """The features with the chunk [start, start + n) of a request with `remaining`
        tokens left added, and their predicted time (`seconds` where the search priced it
        already)."""
        features = features.plus_chunk(n, start, n == remaining, self.limits.token_buckets)
        return features, seconds if seconds is not None else \
            self.predictor.predict_features(features)

    def _chunk_size(self, features: BatchFeatures, start: int, remaining: int,
                    budget_s: float, whole: float | None = None) -> tuple[int, float | None]:
        """GETCHUNKSIZE's binary search (`largest_chunk`): the largest chunk from `start` of
        a request with `remaining` tokens left that keeps the batch within budget_s (at
        least a whole query block: `whole_query_block`); 0 when none fits. With it, the
        batch's predicted time with that chunk where the search priced it already (None
        where a whole query block widened it). `whole`: the predicted time of the largest
        chunk there is room for, where the caller asked already."""
        room = 0 if features.seqs >= self.limits.max_seqs_per_batch else \
            self._token_limit - features.tokens
        max_tokens = int(min(remaining, room))
        if max_tokens < 1:
            return 0, None
        chunk_time_, buckets = self._chunk_time, self.limits.token_buckets
        seconds = chunk_time_(features, max_tokens, start, remaining, buckets) \
            if whole is None else whole
        if seconds <= budget_s:         # the whole rest fits (a whole block already, if >= 2)
            return max_tokens, seconds

        def price(n: int) -> float:
            return chunk_time_(features, n, start, remaining, buckets)

        fitted: dict[int, float] = {}
        n = chunk_below(price, features.tokens, max_tokens, budget_s, buckets,
                        guess=self.chunk_hint(start) if self.chunk_hint else None,
                        fitted=fitted)
        n = whole_query_block(chunk_worth_a_step(n, max_tokens), max_tokens, self.limits)
        return n, fitted.get(n)

    def _guarantee_progress(self, candidates: Iterable[Request], features: BatchFeatures,
                            gate: ChunkGate, chunks: list[ScheduledChunk]) -> BatchFeatures:
        """The most urgent prefill that can run gets a minimum chunk (deviation from
        Algorithm 1, which would starve prefills while decodes alone fill t_target)."""
        for request in candidates:
            room = self._room(features)
            if room < 1:
                break
            if not gate.prepare(request):
                continue
            start = request.num_scheduled_tokens
            max_tokens = int(min(request.num_tokens - start, room))
            n = whole_query_block(min(self.min_chunk_tokens, max_tokens), max_tokens,
                                  self.limits)
            chunk = ScheduledChunk(request, start, n)
            if gate.reserve(chunk):
                chunks.append(chunk)
                return features.plus_chunk(n, start, chunk.samples, self.limits.token_buckets)
        return features


class _NotHeld:
    """`AdaptivePacker.held_back`: the requests of `prefills` that arrived by `latest` or
    whose prefill has started, in their order; every iteration reads `prefills` afresh
    (the packer reads it twice)."""

    def __init__(self, prefills: Iterable[Request], latest: float):
        self._prefills, self._latest = prefills, latest

    def __iter__(self) -> Iterator[Request]:
        latest = self._latest
        return (r for r in self._prefills
                if r.arrival_time <= latest or r.first_scheduled_time is not None)


class TokenBudgetPacker(BatchPacker):
    """Decodes, then prefill chunks in priority order up to a fixed token budget.

    token_budget=512 or 2048 with FCFS order: Sarathi-Serve's static chunking (decodes
    count against the budget; several prefills may share a batch).
    token_budget=None with head_of_line_blocking: the non-preemptive baseline. The
    budget is the whole step (max_tokens_per_batch; unlimited without buckets), so the
    head prefill runs to completion in as few steps as the engine allows, and no later
    prefill starts while it cannot (a refused head blocks the queue). Decodes are
    co-batched with it, as in vLLM's default scheduler, so they stall behind it.
    """

    def __init__(self, predictor: RuntimePredictor, limits: EngineLimits, *,
                 token_budget: int | None, head_of_line_blocking: bool = False):
        super().__init__(predictor, limits)
        if token_budget is not None and token_budget < 1:
            raise ValueError(f"token_budget must be >= 1 or None, got {token_budget!r}")
        self.token_budget = token_budget
        self.head_of_line_blocking = head_of_line_blocking

    def pack(self, decodes: Sequence[Request], prefills: Sequence[Request], now: float,
             gate: ChunkGate = OpenGate(), *, tightest_tpot: float | None = None,
             queued_work: Callable[[str], float] | None = None, paced: bool = True) -> Batch:
        chunks: list[ScheduledChunk] = []
        features = self._add_decodes(decodes, gate, chunks)
        budget = min(self.token_budget or math.inf, self.limits.token_limit)
        for request in prefills:
            room = min(self._room(features), budget - features.tokens)
            if room < 1:
                break
            if not gate.prepare(request):
                if self.head_of_line_blocking:
                    break
                continue
            start = request.num_scheduled_tokens
            n = int(min(request.num_tokens - start, room))
            chunk = ScheduledChunk(request, start, n)
            if not gate.reserve(chunk):
                if self.head_of_line_blocking:
                    break
                continue
            chunks.append(chunk)
            features = features.plus_chunk(n, start, chunk.samples, self.limits.token_buckets)
        return Batch(chunks, self.predictor.predict_features(features))
