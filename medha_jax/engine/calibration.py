"""Calibration of the profiled runtime predictor on a live engine.

`fit_predictor(engine)` times a sweep of synthetic batches through `engine.execute` and
fits `ProfiledPredictor` to the measured step times. The synthetic batches borrow pages
from the engine's allocator (`borrow_batch`) and give them back (`release_batch`), so
calibration leaves the cache as it found it; benchmarks use the same two functions.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import numpy as np

from medha_jax.request import Batch, Request, ScheduledChunk
from medha_jax.scheduler.predictor import ProfiledPredictor

if TYPE_CHECKING:
    from medha_jax.engine.engine import Engine

# Numbers the batches borrow_batch hands out, so their request ids never collide.
_BORROWED = itertools.count()
# Context depths, as fractions of the longest context that fits, that the sweep visits.
_DEPTHS = (0.0, 0.25, 0.5, 0.9)


def sweep_chunks(engine: Engine, rng: np.random.Generator) -> list[list[tuple[int, int]]]:
    """The calibration sweep: batches as lists of (start, num_tokens) chunks.

    The sweep covers the shapes the packer chooses between: lone prefill chunks of every
    token bucket at several context depths; decode batches of every sequence bucket whose
    longest context runs from short to the longest that fits, the rest short (a long
    request decoding among chats, as in serving); and decodes beside a chunk, both a large
    one at the start and a small one deep in its context. Batches the free cache cannot
    hold are left out: they cannot occur.
    """
    ladder, allocator = engine.ladder, engine.allocator
    page_size = allocator.page_size
    page_budget = allocator.num_free_pages * page_size
    max_context = min(engine.max_model_len, page_budget // 2)
    buckets = ladder.token_buckets
    batches = []
    for chunk in buckets:
        for depth in _DEPTHS:
            start = int(depth * (max_context - chunk))
            if start >= 0 and start + chunk <= max_context:
                batches.append([(start, chunk)])
    small_chunk, large_chunk = buckets[0], buckets[len(buckets) // 2]
    for num_decodes in sorted({1, *ladder.seq_buckets}):
        for depth in (0.02, *_DEPTHS[1:]):              # chats alone, then beside a long one
            longest = max(2, int(depth * max_context))
            # One context of `longest`, the others up to max_context / num_decodes in all,
            # so the batch always fits in 2 x max_context.
            bound = min(longest, max_context // num_decodes)
            others = rng.integers(1, max(2, bound), num_decodes - 1)
            decodes = [(longest - 1, 1)] + [(int(c), 1) for c in others]
            batches.append(decodes)
            if num_decodes >= ladder.max_seqs:
                continue
            if depth == 0.25 and num_decodes + large_chunk <= ladder.max_tokens:
                batches.append(decodes + [(0, large_chunk)])
            if num_decodes + small_chunk <= ladder.max_tokens:
                start = min(longest, max_context - small_chunk)
                batches.append(decodes + [(start, small_chunk)])
    return [chunks for chunks in batches
            if sum(-(-(start + n) // page_size) for start, n in chunks) * page_size
            <= page_budget]


def fit_predictor(engine: Engine, *, repeats: int = 2, seed: int = 0) -> ProfiledPredictor:
    """Times the sweep (`sweep_chunks`) `repeats` times and fits the profiled predictor.

    Each pass runs every batch once, in a new order and on newly borrowed pages, as
    serving does: no step finds its own K/V in the CPU's caches from a run just before,
    and a shared machine's slow drifts spread over every shape instead of biasing some.
    A first pass runs unrecorded (first touches of the buffers). Calibration steps are
    taken back out of `engine.step_records`: they are not traffic.
    """
    if repeats < 1:
        raise ValueError(f"{repeats=} must be >= 1")
    rng = np.random.default_rng(seed)
    batches = sweep_chunks(engine, rng)
    records = []
    for run in range(repeats + 1):
        for i in rng.permutation(len(batches)):
            batch = borrow_batch(engine, batches[i], rng)
            try:
                engine.execute(batch)
            finally:
                release_batch(engine, batch)
            features, seconds = engine.step_records.pop()
            if run:
                # The predictor prices one pipeline stage (the executors keep spp batches
                # in flight); a lone batch here crossed all of them, in about spp stage times.
                records.append((features, seconds / engine.num_stages))
    return ProfiledPredictor.fit(records, token_buckets=engine.ladder.token_buckets)


def borrow_batch(engine: Engine, chunks: list[tuple[int, int]],
                 rng: np.random.Generator) -> Batch:
    """A synthetic batch: chunk i covers tokens [start, start + n) of a fresh random
    request, whose pages are reserved here and must be given back with `release_batch`.

    K/V before `start` is whatever the borrowed pages hold: right for timing, meaningless
    for outputs. Request ids are new on every call, so several borrowed batches may be out
    at once. On any failure part way (no room, or an allocator call raising) exactly the
    pages this call took are given back.
    """
    allocator = engine.allocator
    batch_id = next(_BORROWED)
    scheduled, taken = [], []
    try:
        for i, (start, num_tokens) in enumerate(chunks):
            length = start + num_tokens
            request_id = f"__calibration_{batch_id}_{i}"
            request = Request(request_id, length, 1, 0.0,
                              prompt_token_ids=rng.integers(
                                  0, engine.model.config.vocab_size, length).tolist())
            allocator.allocate(request_id)
            taken.append(request_id)          # from here on this call owns its pages
            if not allocator.reserve(request_id, length):
                raise RuntimeError(
                    f"calibration chunk {i} ({start=}, {num_tokens=}) needs {length} tokens of "
                    f"KV cache; {allocator.num_free_pages} pages of {allocator.page_size} are free")
            request.num_computed_tokens = start
            scheduled.append(ScheduledChunk(request, start, num_tokens))
    except BaseException:
        for request_id in taken:
            allocator.free(request_id)
        raise
    return Batch(scheduled)


def release_batch(engine: Engine, batch: Batch) -> None:
    """Gives back the pages of a batch from `borrow_batch`."""
    for chunk in batch.chunks:
        engine.allocator.free(chunk.request.request_id)
