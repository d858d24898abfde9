"""Shape buckets: the padded sizes of an engine step, shared by the engine and the scheduler.

XLA compiles once per input shape. A step's inputs have three sizes that change with
every batch: tokens T (all chunks concatenated), sequences S, and the page-table width
W (pages of the longest context). Each is padded up to the next rung of a short ladder,
all (T, S, W) combinations that a real batch can reach are compiled at start-up, and no
request triggers a compile afterwards. The scheduler's predictor and packer price a batch
at its padded size, so they pad with the same `bucket_for`. Pure Python: the scheduler
must not import JAX.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from collections.abc import Sequence


def geometric_buckets(smallest: int, largest: int, factor: int = 2) -> tuple[int, ...]:
    """smallest, smallest * factor, ... while below largest, then largest itself."""
    if not 1 <= smallest <= largest:
        raise ValueError(f"need 1 <= {smallest=} <= {largest=}")
    if factor < 2:
        raise ValueError(f"{factor=} must be >= 2")
    buckets = []
    size = smallest
    while size < largest:
        buckets.append(size)
        size *= factor
    buckets.append(largest)
    return tuple(buckets)


def bucket_for(n: int, buckets: Sequence[int], what: str = "size") -> int:
    """The smallest bucket >= n (buckets sorted ascending)."""
    if n < 0:
        raise ValueError(f"{what} {n=} must be >= 0")
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(
            f"{what} {n=} exceeds the largest bucket {buckets[-1]} of {tuple(buckets)}")
    return buckets[i]


def padded_size(n: int, buckets: Sequence[int] | None, what: str = "size") -> int:
    """n padded up to its bucket, as a step runs it; n itself without buckets (the
    simulator), and 0 stays 0 (an empty batch runs no step)."""
    if buckets is None or n == 0:
        return n
    return bucket_for(n, buckets, what)


def shape_size(shape: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    """Sort key of step shapes, smallest first: T x S x W (what a compile and a step grow
    with), then the shape itself so that the order is total."""
    return math.prod(shape[:3]), shape


@dataclasses.dataclass(frozen=True)
class BucketLadder:
    """Padded sizes for tokens per step, sequences per step and page-table width.

    token_buckets: allowed padded token counts T (the packer prices a batch at its bucket).
    seq_buckets:   allowed padded sequence counts S.
    width_buckets: allowed page-table widths W, in pages.
    cp_page_buckets: context parallelism only (else empty): allowed counts C of the cached
                   pages one rank sends in a pass-KV ring step (`cp_layout.pack_cached_pages`),
                   a fourth dimension of the step's shape (T, S, W, C).
    Each is a strictly increasing tuple of positive ints; the last is the hard limit.
    """

    token_buckets: tuple[int, ...]
    seq_buckets: tuple[int, ...]
    width_buckets: tuple[int, ...]
    cp_page_buckets: tuple[int, ...] = ()

    def __post_init__(self):
        names = ("token_buckets", "seq_buckets", "width_buckets")
        for name in names + (("cp_page_buckets",) if self.cp_page_buckets else ()):
            buckets = tuple(getattr(self, name))
            object.__setattr__(self, name, buckets)
            if not buckets:
                raise ValueError(f"BucketLadder.{name} must not be empty")
            if any(not isinstance(b, int) or b < 1 for b in buckets):
                raise ValueError(f"BucketLadder.{name} must be positive ints, got {buckets}")
            if any(a >= b for a, b in zip(buckets, buckets[1:])):
                raise ValueError(f"BucketLadder.{name} must be strictly increasing, got {buckets}")
        if self.max_seqs > self.max_tokens:
            raise ValueError(
                f"max_seqs={self.max_seqs} cannot exceed max_tokens={self.max_tokens}: "
                f"every sequence in a step has at least one token")

    @classmethod
    def from_limits(cls, *, max_tokens: int, max_seqs: int, max_pages_per_seq: int,
                    min_tokens: int = 16, min_seqs: int = 8, min_pages_per_seq: int = 16,
                    seq_factor: int = 4, width_factor: int = 4,
                    cp_pages: int | None = None) -> BucketLadder:
        """Geometric ladders up to the engine's limits.

        Tokens double: the padded token count is what a step costs, so padding wastes at
        most half a step. Sequences and widths start higher and grow 4x because padding
        them is cheap (a padded sequence is skipped by the attention kernel and adds one
        row of logits; a wider page table adds masked columns) while every rung multiplies
        the number of executables. For max_tokens=2048, max_seqs=256, max_pages_per_seq=512
        that is 8 x 4 x 4 rungs and 104 reachable shapes; for a CPU-sized engine
        (256, 16, 128) it is 5 x 2 x 3 rungs and 30 shapes.

        cp_pages: with context parallelism, the pages of one rank's pool. A rank's pass-KV
        message holds its cached pages of the step's sequences, each page once, so it never
        holds more than the pool: that is the static bound, the top rung. The rungs grow 4x
        from min_pages_per_seq like widths: a message at most 4x its real pages (what
        `cp_cost.RingCost` prices with the same rungs), against one more executable per
        rung and (S, W) whose S x W pages can reach it.
        """
        return cls(
            token_buckets=geometric_buckets(min(min_tokens, max_tokens), max_tokens),
            seq_buckets=geometric_buckets(min(min_seqs, max_seqs), max_seqs, seq_factor),
            width_buckets=geometric_buckets(min(min_pages_per_seq, max_pages_per_seq),
                                            max_pages_per_seq, width_factor),
            cp_page_buckets=() if cp_pages is None else geometric_buckets(
                min(min_pages_per_seq, cp_pages), cp_pages, width_factor))

    @property
    def max_tokens(self) -> int:
        return self.token_buckets[-1]

    @property
    def max_seqs(self) -> int:
        return self.seq_buckets[-1]

    @property
    def max_pages_per_seq(self) -> int:
        return self.width_buckets[-1]

    def token_bucket(self, num_tokens: int) -> int:
        return bucket_for(num_tokens, self.token_buckets, "tokens")

    def seq_bucket(self, num_seqs: int, padded_tokens: int | None = None) -> int:
        """The padded sequence count of a step of `num_seqs` sequences: its rung, capped at
        the step's token bucket `padded_tokens` when given. A step of T tokens has at most T
        sequences, so a rung above T would only pad: a decode of 1, 2 or 4 sequences runs
        at (T, S) = (1, 1), (2, 2), (4, 4), not at the smallest rung's S rows of logits."""
        bucket = bucket_for(num_seqs, self.seq_buckets, "seqs")
        return bucket if padded_tokens is None else min(bucket, padded_tokens)

    def width_bucket(self, num_pages: int) -> int:
        return bucket_for(num_pages, self.width_buckets, "page-table width")

    def cp_page_bucket(self, num_pages: int) -> int:
        if not self.cp_page_buckets:
            raise ValueError("this BucketLadder has no cp_page_buckets: a cp step needs them "
                             "(BucketLadder.from_limits(..., cp_pages=pages of a rank's pool))")
        return bucket_for(max(num_pages, 1), self.cp_page_buckets, "cp pages a rank sends")

    def startup_shapes(self, prompt_tokens: int = 16) -> list[tuple[int, ...]]:
        """The shapes a server compiles before it is ready, the rest of `all_shapes` after
        (Engine.warmup(first=...)): the smallest, a lone decode's (T = S = 1 with the
        default ladder), and the smallest of at least `prompt_tokens` tokens, a short
        prompt's first step, so a first short request waits for no compile."""
        shapes = self.all_shapes()
        tokens = min(prompt_tokens, self.max_tokens)
        return sorted({min(shapes, key=shape_size),
                       min((s for s in shapes if s[0] >= tokens), key=shape_size)})

    def all_shapes(self) -> list[tuple[int, ...]]:
        """Every (tokens, seqs, width) a real batch can be padded to, the executables to compile
        (with cp_page_buckets, every (tokens, seqs, width, cp pages)).

        A seq bucket S is reachable with token bucket T only if some batch with more
        sequences than the rung below S still has at most T tokens: each sequence brings at
        least one token; with T below S it is padded to T (`seq_bucket`). Width is
        independent of both (one decode can have a long context).
        A cp page bucket C is reachable with (S, W) only if S sequences of W pages each can
        hold more distinct pages than the rung below C.
        """
        shapes = []
        for t, (j, s) in itertools.product(self.token_buckets, enumerate(self.seq_buckets)):
            fewest_seqs = self.seq_buckets[j - 1] + 1 if j else 1
            if fewest_seqs > t:
                continue
            s = min(s, t)                              # as seq_bucket pads it
            for w in self.width_buckets:
                if not self.cp_page_buckets:
                    shapes.append((t, s, w))
                    continue
                shapes.extend((t, s, w, c) for i, c in enumerate(self.cp_page_buckets)
                              if (self.cp_page_buckets[i - 1] + 1 if i else 1) <= s * w)
        return shapes
