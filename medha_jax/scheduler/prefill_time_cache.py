"""Remaining prefill work w(t) for LARS: seed 000, Algorithm 3.

Offline, simulate one prefill alone under adaptive chunking (the packer's chunk choice
at t_target, priced by the runtime predictor) and tabulate C[l] = seconds to prefill l
tokens, every `step` tokens up to max_len. At run time
    w_total = C[prompt length]            w(t) = C[total tokens] - C[computed tokens]
with linear interpolation between table entries.

Deviation, for speed: Algorithm 3 runs SIMULATEPREFILL(l) afresh for every l, which is
quadratic in max_len (a 1M-token table would take hours in Python). The chunk chosen
at a given KV size does not depend on l, so every run is a prefix of the run for
max_len: we simulate once, keep the chunk boundaries, and C[l] is the time up to the
last boundary below l plus the predicted time of the partial chunk that ends at l
(where Algorithm 3 adds the whole chunk even past l, we cap it at l).

Below the first step the table is not interpolated from C[0] = 0: even a one-token
prefill pays a whole step's fixed cost, so short prompts are priced exactly instead.
"""

from __future__ import annotations

import bisect

from medha_jax.request import Request
from medha_jax.scheduler.packer import EngineLimits, lone_prefill_chunk
from medha_jax.scheduler.predictor import BatchFeatures, RuntimePredictor


class PrefillTimeCache:
    """C[l]: predicted seconds to prefill l tokens alone with adaptive chunking."""

    def __init__(self, predictor: RuntimePredictor, limits: EngineLimits, *, max_len: int,
                 t_target: float, min_chunk_tokens: int = 16, step: int = 1024):
        if max_len < 1 or step < 1:
            raise ValueError(f"{max_len=} and {step=} must be >= 1")
        self.predictor, self.limits = predictor, limits
        self.max_len, self.step, self.min_chunk_tokens = max_len, step, min_chunk_tokens
        self.refresh(t_target)

    def refresh(self, t_target: float) -> None:
        """Recomputes the table from the predictor as it is now (an online refit changed
        it) at this t_target."""
        if not t_target > 0:
            raise ValueError(f"t_target must be > 0, got {t_target!r}")
        predictor, limits, max_len, step = self.predictor, self.limits, self.max_len, self.step
        self.t_target = t_target

        # One lone prefill of max_len tokens: chunk starts and the time before each.
        starts, elapsed = [0], [0.0]
        done = 0
        n = None
        while done < max_len:
            n = lone_prefill_chunk(predictor, limits, context_len=done, remaining=max_len - done,
                                   t_target=t_target, min_chunk_tokens=self.min_chunk_tokens,
                                   guess=n)
            elapsed.append(elapsed[-1] + self._chunk_time(done, n, samples=done + n == max_len))
            done += n
            starts.append(done)
        self._starts, self._elapsed = starts, elapsed
        self.num_chunks = len(starts) - 1

        # The table of Algorithm 3: C[k * step] for k = 0 .. max_len // step, plus max_len.
        lengths = list(range(0, max_len + 1, step))
        if lengths[-1] != max_len:
            lengths.append(max_len)
        self._table_lengths = lengths
        self._table = [self._simulated(l) for l in lengths]
        # C[l] below the first step, filled as asked: each costs a prediction, and the
        # scheduler asks for short prompts' w(t) many times per iteration.
        self._below_step: dict[int, float] = {}

    def _chunk_time(self, start: int, n: int, samples: bool) -> float:
        features = BatchFeatures().plus_chunk(n, start, samples, self.limits.token_buckets)
        return self.predictor.predict_features(features)

    def _simulated(self, length: int) -> float:
        """SIMULATEPREFILL(length), read off the single max_len run."""
        if length == 0:
            return 0.0
        k = bisect.bisect_left(self._starts, length) - 1     # last boundary below length
        start = self._starts[k]
        return self._elapsed[k] + self._chunk_time(start, length - start, samples=True)

    def prefill_time(self, num_tokens: int) -> float:
        """C[num_tokens], interpolated between table entries."""
        if not 0 <= num_tokens <= self.max_len:
            raise ValueError(
                f"{num_tokens=} is outside the cache's range [0, max_len={self.max_len}]")
        if num_tokens == 0:
            return 0.0
        if num_tokens < self.step:
            seconds = self._below_step.get(num_tokens)
            if seconds is None:
                seconds = self._below_step[num_tokens] = self._simulated(num_tokens)
            return seconds
        k = num_tokens // self.step
        lo = self._table_lengths[k]
        if lo == num_tokens or k + 1 == len(self._table):
            return self._table[k]
        hi = self._table_lengths[k + 1]
        frac = (num_tokens - lo) / (hi - lo)
        return self._table[k] + frac * (self._table[k + 1] - self._table[k])

    __call__ = prefill_time

    def remaining_work(self, request: Request) -> float:
        """w(t) = C[total tokens] - C[computed tokens] (GET_REMAINING_TIME)."""
        # The scheduler asks this of every rider it reads and at every index update: a
        # short prompt's C[l] is read straight from the entries prefill_time filled.
        num_tokens = request.prompt_len + len(request.output_token_ids)
        total = self._below_step.get(num_tokens)
        if total is None:
            total = self.prefill_time(num_tokens)
        computed = request.num_computed_tokens
        return total - self.prefill_time(computed) if computed else total     # C[0] = 0

    def lone_chunk(self, context_len: int) -> int:
        """The chunk the lone prefill got around this context: the packer's search hint."""
        k = bisect.bisect_right(self._starts, context_len) - 1
        return self._starts[min(k + 1, self.num_chunks)] - self._starts[min(k, self.num_chunks - 1)]

    def chunk_sizes(self) -> list[int]:
        """The lone prefill's chunk sizes, in order (adaptive chunking made visible)."""
        s = self._starts
        return [b - a for a, b in zip(s, s[1:])]

    def table(self) -> list[tuple[int, float]]:
        """(length, seconds) entries of the precomputed table."""
        return list(zip(self._table_lengths, self._table))
