"""Batch packers: Algorithms 1 and 2, engine limits, and the baselines."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from medha_jax.config import ParallelConfig, model_preset
from medha_jax.request import SLO, Batch, Request, RequestState, ScheduledChunk
from medha_jax.scheduler.packer import (AdaptivePacker, EngineLimits, OpenGate, TokenBudgetPacker,
                                       lone_prefill_chunk, whole_query_block)
from medha_jax.scheduler.predictor import AnalyticalPredictor, ProfiledPredictor, batch_features

PREDICTOR = AnalyticalPredictor(model_preset("llama3-8b"), ParallelConfig(tp=8), "h100")


def _prefill(rid, prompt_len, computed=0, arrival=0.0, ttft=10.0, w_total=1.0):
    r = Request(rid, prompt_len, 16, arrival, slo=SLO(ttft_s=ttft))
    r.num_computed_tokens = computed
    r.w_total = w_total
    return r


def _decode(rid, context, tpot=0.5):
    r = Request(rid, context, 64, 0.0, slo=SLO(tpot_s=tpot))
    r.output_token_ids.append(1)
    r.num_computed_tokens = r.num_tokens - 1
    r.state = RequestState.RUNNING
    r.last_token_time = 0.0
    return r


def _adaptive(limits=EngineLimits(), *, multi=False, remaining_work=lambda r: 1.0, **kw):
    return AdaptivePacker(PREDICTOR, limits, remaining_work=remaining_work, multi_prefill=multi,
                          space_sharing=multi, **kw)


def _predict(chunks, buckets):
    return PREDICTOR.predict_features(batch_features(Batch(list(chunks)), buckets))


def test_decodes_first_then_one_prefill_up_to_t_target():
    decodes = [_decode(f"d{i}", 1000 * (i + 1)) for i in range(8)]
    prefills = [_prefill("p0", 50_000), _prefill("p1", 300)]
    packer = _adaptive(target_batch_time_s=0.05)
    batch = packer.pack(decodes, prefills, now=0.0)
    assert [c.request.request_id for c in batch.chunks] == [f"d{i}" for i in range(8)] + ["p0"]
    assert all(c.is_decode for c in batch.chunks[:8])
    assert batch.predicted_time_s <= 0.05
    # The chunk is the largest that fits, to the search's 1/128 tolerance.
    n = batch.chunks[-1].num_tokens
    longer = ScheduledChunk(prefills[0], 0, n + n // 128 + 1)
    assert _predict(batch.chunks[:8] + [longer], None) > 0.05


def test_budget_comes_from_the_strictest_tpot_slo():
    packer = _adaptive(target_batch_time_s=0.05)
    relaxed = packer.pack([_decode("d", 1000, tpot=1.0)], [_prefill("p", 100_000)], now=0.0)
    strict = packer.pack([_decode("d", 1000, tpot=0.02)], [_prefill("p", 100_000)], now=0.0)
    assert 0.02 < relaxed.predicted_time_s <= 0.05
    assert strict.predicted_time_s <= 0.02
    assert strict.chunks[1].num_tokens < relaxed.chunks[1].num_tokens


def test_last_chunk_grows_to_fill_its_bucket():
    # Cost depends on the padded size only: filling the bucket is free, so the packer does.
    flat = ProfiledPredictor([1e-3, 1e-5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    limits = EngineLimits(token_buckets=(64, 128, 256, 512))
    packer = AdaptivePacker(flat, limits, remaining_work=lambda r: 1.0,
                            target_batch_time_s=1e-3 + 300e-5)
    batch = packer.pack([_decode("d0", 10), _decode("d1", 10)], [_prefill("p", 10_000)], now=0.0)
    assert batch.num_tokens == 256          # 2 decodes + a 254-token chunk: no padding


def test_space_sharing_yields_to_a_short_prefill():
    long = _prefill("long", 200_000, computed=100_000, w_total=20.0, ttft=100.0)
    short = _prefill("short", 2_000, w_total=0.1, ttft=5.0)
    work = {"long": 10.0, "short": 0.1}
    packer = _adaptive(multi=True, remaining_work=lambda r: work[r.request_id], rho_max=0.4)
    # The long one has 90 s of slack, which covers the short one: the short one goes first
    # with the whole budget (its whole prompt, one step), the long chunk takes the rest.
    shared = packer.pack([], [long, short], now=0.0)
    alone = packer.pack([], [long], now=0.0)
    assert [c.request.request_id for c in shared.chunks] == ["short", "long"]
    assert shared.chunks[0].samples
    assert shared.chunks[1].num_tokens < alone.chunks[0].num_tokens
    assert alone.predicted_time_s > 0.9 * 0.05       # alone it yields to nobody
    assert 0.9 * 0.05 < shared.predicted_time_s <= 0.05


def _riders(long_deadline, long_work, short_ttft, now=0.0, short=2_000):
    """(request id, chunk tokens) of a batch packed from a long prefill and a short one
    (`short` prompt tokens, 0.1 s of work) ranked below it."""
    long = _prefill("long", 200_000, computed=100_000, w_total=20.0, ttft=long_deadline)
    short = _prefill("short", short, w_total=0.1, ttft=short_ttft)
    work = {"long": long_work, "short": 0.1}
    packer = _adaptive(multi=True, remaining_work=lambda r: work[r.request_id])
    return [(c.request.request_id, c.num_tokens)
            for c in packer.pack([], [long, short], now=now).chunks]


def test_a_short_prefill_rides_only_when_it_costs_the_long_one_no_deadline():
    # Due before the long one can finish: it must run before then anyway, so it rides,
    # even beside a long prefill already late (rho < 0, which yields nothing in Alg. 2),
    # within rho_max = 40% of the budget; the long chunk takes the rest.
    due = _riders(long_deadline=5.0, long_work=10.0, short_ttft=2.0, now=10.0, short=8_000)
    assert [rid for rid, _ in due] == ["short", "long"]
    short_chunk = ScheduledChunk(_prefill("x", 8_000), 0, due[0][1])
    assert _predict([short_chunk], None) <= 0.4 * 0.05
    # Covered by the long one's slack: it goes first, with the whole budget.
    covered = _riders(long_deadline=1.5, long_work=1.0, short_ttft=5.0, short=8_000)
    assert [rid for rid, _ in covered] == ["short", "long"] and covered[0][1] > 2 * due[0][1]
    # Due after the long one finishes, and the long one has no slack: no share is
    # yielded; it at most fills the sliver the long chunk's search leaves (Algorithm 1).
    waits = dict(_riders(long_deadline=1.0, long_work=1.0, short_ttft=5.0, short=8_000))
    assert waits["short"] < due[0][1] // 4 and waits["long"] > due[1][1]


def test_a_rider_with_more_work_left_than_the_head_goes_right_after_it():
    # The head's slack covers the short one either way; it goes before the head only with
    # less work left than the head (shortest remaining first). A head in its last chunk
    # (0.05 s, 200 tokens left) runs first: a 0.1 s rider ahead of it would delay it by
    # 0.1 s to save itself 0.05 s. The rider still takes the rest of the step, before a
    # long prefill ranked between them (which rides beside nobody).
    def packed(head_work):
        head = _prefill("head", 2_000, computed=1_800, w_total=1.0, ttft=100.0)
        other = _prefill("other", 200_000, computed=100_000, w_total=20.0, ttft=100.0)
        short = _prefill("short", 1_000, w_total=0.1, ttft=100.0)
        work = {"head": head_work, "other": 10.0, "short": 0.1}
        packer = _adaptive(multi=True, remaining_work=lambda r: work[r.request_id],
                           target_batch_time_s=0.2)
        return [c.request.request_id for c in packer.pack([], [head, other, short],
                                                          now=0.0).chunks]

    assert packed(head_work=1.0)[:2] == ["short", "head"]
    assert packed(head_work=0.05)[:2] == ["head", "short"]
    # Due before the head could finish, it still rides ahead, whatever the head's work.
    due = _riders(long_deadline=5.0, long_work=0.05, short_ttft=0.01, now=0.0, short=8_000)
    assert [rid for rid, _ in due] == ["short", "long"]


def test_a_long_prefill_yields_nothing_to_other_long_ones():
    longs = [_prefill(f"long{i}", 200_000, computed=100_000, w_total=20.0, ttft=100.0)
             for i in range(2)]
    packer = _adaptive(multi=True, remaining_work=lambda r: 10.0)
    (alone,) = packer.pack([], longs[:1], now=0.0).chunks
    (chunk,) = packer.pack([], longs, now=0.0).chunks
    assert chunk.request is longs[0] and chunk.num_tokens == alone.num_tokens


def test_at_most_one_long_prefill_per_batch_and_one_prefill_without_multi():
    longs = [_prefill(f"long{i}", 100_000, computed=90_000) for i in range(3)]
    shorts = [_prefill(f"short{i}", 100) for i in range(3)]
    multi = _adaptive(multi=True, target_batch_time_s=0.2).pack([], longs + shorts, now=0.0)
    ids = [c.request.request_id for c in multi.chunks]
    assert "long0" in ids and sum(i.startswith("long") for i in ids) == 1
    assert {"short0", "short1", "short2"} <= set(ids)
    single = _adaptive(target_batch_time_s=0.2).pack([], longs + shorts, now=0.0)
    assert [c.request.request_id for c in single.chunks] == ["long0"]


def test_progress_guarantee_when_decodes_fill_the_budget():
    decodes = [_decode(f"d{i}", 500_000) for i in range(4)]
    packer = _adaptive(target_batch_time_s=0.005, min_chunk_tokens=16)
    decode_only = packer.pack(decodes, [], now=0.0).predicted_time_s
    assert decode_only > 0.005
    batch = packer.pack(decodes, [_prefill("p", 1000)], now=0.0)
    assert [c.num_tokens for c in batch.chunks] == [1, 1, 1, 1, 16]


def test_a_chunk_is_at_least_one_query_block_of_the_engines_attention():
    # A long context leaves room for a few tokens only; the attention pays a whole block
    # for them, so the chunk takes the block (the batch is over budget by the dense
    # layers of the block's other tokens only).
    request = _prefill("long", 600_000, computed=500_000)
    few = _predict([ScheduledChunk(request, 500_000, 4)], None)
    packer = _adaptive(target_batch_time_s=few * 1.0001)
    (unblocked,) = packer.pack([], [request], now=0.0).chunks
    assert 2 <= unblocked.num_tokens < 64
    blocks = _adaptive(EngineLimits(query_block_tokens=64), target_batch_time_s=few * 1.0001)
    (chunk,) = blocks.pack([], [request], now=0.0).chunks
    assert chunk.num_tokens == 64
    # Algorithm 3's lone-prefill chunk makes the same choices.
    for limits, want in ((EngineLimits(), unblocked.num_tokens),
                         (EngineLimits(query_block_tokens=64), 64)):
        assert lone_prefill_chunk(PREDICTOR, limits, context_len=500_000, remaining=100_000,
                                  t_target=few * 1.0001, min_chunk_tokens=16) == want
    # The progress guarantee gives a block, not min_chunk_tokens, and never past the prompt.
    decodes = [_decode(f"d{i}", 500_000) for i in range(4)]
    blocks = _adaptive(EngineLimits(query_block_tokens=64), target_batch_time_s=0.005,
                       min_chunk_tokens=16)
    batch = blocks.pack(decodes, [_prefill("p", 1000), _prefill("q", 40)], now=0.0)
    assert [c.num_tokens for c in batch.chunks] == [1, 1, 1, 1, 64]
    batch = blocks.pack(decodes, [_prefill("q", 40)], now=0.0)
    assert [c.num_tokens for c in batch.chunks] == [1, 1, 1, 1, 40]


def test_one_token_of_a_longer_prompt_is_no_fit_the_progress_guarantee_takes_over():
    # Where the budget holds one token but no more, the search settles on a one-token
    # chunk: the decode path, one token a step (a 1K-token prompt took 170 s so on the
    # CPU). It counts as no fit: the prefill gets the guarantee's block instead.
    request = _prefill("long", 600_000, computed=500_000)
    one = _predict([ScheduledChunk(request, 500_000, 1)], None)
    assert _predict([ScheduledChunk(request, 500_000, 2)], None) > one * (1 + 1e-9)
    limits = EngineLimits(query_block_tokens=64)
    packer = _adaptive(limits, target_batch_time_s=one * (1 + 1e-9), min_chunk_tokens=16)
    (chunk,) = packer.pack([], [request], now=0.0).chunks
    assert chunk.num_tokens == 64
    assert lone_prefill_chunk(PREDICTOR, limits, context_len=500_000, remaining=100_000,
                              t_target=one * (1 + 1e-9), min_chunk_tokens=16) == 64
    # The last token of a prompt is its whole rest: it stays a one-token chunk.
    last = _prefill("last", 500_001, computed=500_000)
    (chunk,) = packer.pack([], [last], now=0.0).chunks
    assert chunk.num_tokens == 1


def test_whole_query_block_widens_only_prefill_chunks_within_the_cap():
    limits = EngineLimits(query_block_tokens=64)
    assert whole_query_block(0, 100, limits) == 0        # nothing fit: stays nothing
    assert whole_query_block(1, 100, limits) == 1        # one token: the decode path
    assert whole_query_block(2, 100, limits) == 64
    assert whole_query_block(5, 30, limits) == 30        # the request or the step ends first
    assert whole_query_block(100, 200, limits) == 100    # past a block: the search's own
    assert whole_query_block(5, 100, EngineLimits()) == 5
    with pytest.raises(ValueError, match="query_block_tokens"):
        EngineLimits(query_block_tokens=0)


def test_adaptive_chunking_shrinks_chunks_as_the_context_grows():
    packer = _adaptive(EngineLimits(token_buckets=tuple(256 * 2**i for i in range(6))),
                       target_batch_time_s=0.05)
    request = _prefill("long", 300_000)
    decodes = [_decode(f"d{i}", 2000) for i in range(16)]
    sizes = []
    while request.num_pending_tokens > 0:
        (chunk,) = [c for c in packer.pack(decodes, [request], now=0.0).chunks if not c.is_decode]
        sizes.append(chunk.num_tokens)
        request.num_computed_tokens = chunk.end
    assert sizes[0] > 4 * sizes[-2]                 # (the last chunk is what is left)
    # Non-increasing, up to where a chunk snaps to a bucket edge.
    assert all(b <= a * 1.05 or b <= 256 for a, b in zip(sizes, sizes[1:-1]))


def test_engine_limits_split_decodes_over_iterations():
    decodes = [_decode(f"d{i}", 100) for i in range(10)]
    packer = _adaptive(EngineLimits(max_seqs_per_batch=4))
    batch = packer.pack(decodes, [_prefill("p", 100)], now=0.0)
    assert [c.request.request_id for c in batch.chunks] == ["d0", "d1", "d2", "d3"]
    with pytest.raises(ValueError, match="exceeds the largest token bucket"):
        EngineLimits(token_buckets=(16, 32), max_tokens_per_batch=64)


class _Refuse(OpenGate):
    def __init__(self, refused):
        self.refused = refused

    def reserve(self, chunk):
        return chunk.request.request_id not in self.refused


def test_sarathi_and_non_preemptive_baselines():
    decodes = [_decode(f"d{i}", 100) for i in range(10)]
    prefills = [_prefill("a", 3000, arrival=0.0), _prefill("b", 3000, arrival=1.0)]
    sarathi = TokenBudgetPacker(PREDICTOR, EngineLimits(), token_budget=512)
    batch = sarathi.pack(decodes, prefills, now=0.0)
    assert batch.num_tokens == 512 and batch.chunks[-1].request.request_id == "a"
    sarathi = TokenBudgetPacker(PREDICTOR, EngineLimits(), token_budget=4096)
    assert [c.num_tokens for c in sarathi.pack([], prefills, now=0.0).chunks] == [3000, 1096]
    # Non-preemptive: the whole prompt when the engine allows, else the largest step.
    whole = TokenBudgetPacker(PREDICTOR, EngineLimits(), token_budget=None,
                              head_of_line_blocking=True)
    batch = whole.pack(decodes, [_prefill("x", 1_000_000)], now=0.0)
    assert [c.num_tokens for c in batch.chunks[10:]] == [1_000_000]
    capped = TokenBudgetPacker(PREDICTOR, EngineLimits(token_buckets=(1024, 2048)),
                               token_budget=None, head_of_line_blocking=True)
    assert capped.pack([], prefills, now=0.0).chunks[0].num_tokens == 2048
    # A head that cannot get KV space blocks everyone behind it.
    assert not capped.pack([], prefills, now=0.0, gate=_Refuse({"a"})).chunks
    first = sarathi.pack([], prefills, now=0.0, gate=_Refuse({"a"})).chunks[0]
    assert first.request.request_id == "b"


# ------------------------------------------------------------------------ properties

_requests = st.lists(st.tuples(st.integers(1, 300_000), st.floats(0.0, 1.0)), max_size=6)
_buckets = st.sampled_from([None, (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192), (512, 4096)])


@settings(max_examples=150, deadline=None)
@given(decode_contexts=st.lists(st.integers(1, 400_000), max_size=40),
       prefills=_requests,
       buckets=_buckets,
       max_seqs=st.integers(1, 64),
       t_target=st.floats(0.002, 0.2),
       multi=st.booleans(),
       min_chunk=st.integers(1, 64))
def test_packer_properties(decode_contexts, prefills, buckets, max_seqs, t_target, multi,
                           min_chunk):
    limits = EngineLimits(token_buckets=buckets, max_seqs_per_batch=max_seqs)
    decodes = [_decode(f"d{i}", c) for i, c in enumerate(decode_contexts)]
    queue = [_prefill(f"p{i}", n, computed=int(frac * (n - 1)), w_total=1.0)
             for i, (n, frac) in enumerate(prefills)]
    packer = _adaptive(limits, multi=multi, target_batch_time_s=t_target,
                       min_chunk_tokens=min_chunk, long_prefill_tokens=8192,
                       remaining_work=lambda r: 0.5)
    batch = packer.pack(decodes, queue, now=0.0)

    batch_decodes = [c for c in batch.chunks if c.is_decode]
    batch_prefills = [c for c in batch.chunks if not c.is_decode]
    # Decodes are never left out, unless the step cannot hold them all.
    assert len(batch_decodes) == min(len(decodes), max_seqs)
    assert batch.num_seqs <= max_seqs and batch.num_tokens <= limits.token_limit
    assert len({c.request.request_id for c in batch.chunks}) == batch.num_seqs
    for c in batch_prefills:
        assert c.start == c.request.num_computed_tokens
        assert 1 <= c.num_tokens <= c.request.num_pending_tokens
    assert len(batch_prefills) <= (max_seqs if multi else 1)
    # At most one long prefill (IsLong: a prompt strictly longer than 8192 tokens; one of
    # exactly 8192 is short, `AdaptivePacker.is_long`).
    assert sum(packer.is_long(c.request) for c in batch_prefills) <= 1
    # Never over t_target by more than one minimum chunk: a batch over budget is either
    # decodes alone, or decodes plus the single minimum chunk of the progress guarantee.
    predicted = _predict(batch.chunks, buckets)
    assert predicted == pytest.approx(batch.predicted_time_s)
    if predicted > t_target * (1 + 1e-9) and batch_prefills:
        assert len(batch_prefills) == 1 and batch_prefills[0].num_tokens <= min_chunk
    # Work is never left idle when it fits: with room left, some prefill got a chunk.
    if queue and not batch_prefills:
        assert batch.num_seqs == max_seqs or batch.num_tokens == limits.token_limit


def test_with_no_paced_request_the_step_fills_the_engine_limits():
    # Nothing the replica holds has a per-token objective (Server.generate's requests):
    # no time bound, so chunks grow to the engine's tokens per step, not to t_target.
    limits = EngineLimits(max_tokens_per_batch=16_384, max_seqs_per_batch=8)
    decodes = [_decode(f"d{i}", 1000 * (i + 1), tpot=float("inf")) for i in range(4)]
    packer = _adaptive(limits, multi=True, target_batch_time_s=0.02)
    assert packer.t_target([ScheduledChunk(decodes[0], 1000, 1)], paced=False) == float("inf")
    paced = packer.pack(decodes, [_prefill("p0", 100_000)], now=0.0)
    unpaced = packer.pack(decodes, [_prefill("p0", 100_000)], now=0.0, paced=False)
    assert paced.predicted_time_s <= 0.02 and paced.num_tokens < 16_384
    assert unpaced.num_tokens == 16_384 and unpaced.predicted_time_s > 0.02
    # Several prefills share the step up to the same limits.
    shorts = [_prefill(f"s{i}", 300) for i in range(3)]
    unpaced = packer.pack([], shorts + [_prefill("p0", 100_000)], now=0.0, paced=False)
    assert unpaced.num_tokens == 16_384 and unpaced.num_seqs == 4


def test_a_decodes_tpot_is_spread_over_the_pipeline_stages():
    # Each batch is one stage's work; a decode's next token comes after all of them.
    decodes = [ScheduledChunk(_decode("d", 1000, tpot=0.12), 1000, 1)]
    assert _adaptive(target_batch_time_s=1.0).t_target(decodes) == pytest.approx(0.12)
    assert _adaptive(target_batch_time_s=1.0, pipeline_stages=4).t_target(decodes) == \
        pytest.approx(0.03)
    assert _adaptive(target_batch_time_s=0.02, pipeline_stages=4).t_target(decodes) == \
        pytest.approx(0.02)


@pytest.mark.parametrize("multi", [False, True])
def test_a_held_prefill_stays_out_of_decode_steps_until_its_hold_expires(multi):
    """prefill_hold_s: beside decodes, a prefill that arrived less than the hold ago and has
    not started gets no chunk (neither as the head, nor as a rider, nor by the progress
    guarantee) while an older one does; with no decode running it starts at once; at the
    hold it joins."""
    decodes = [_decode("d0", 500), _decode("d1", 800)]
    old, new = _prefill("old", 300, arrival=0.0), _prefill("new", 200, arrival=9.5)
    packer = _adaptive(multi=multi, target_batch_time_s=0.05, prefill_hold_s=1.0,
                       remaining_work=lambda r: 0.01)

    def prefill_ids(batch):
        return [c.request.request_id for c in batch.chunks if not c.is_decode]

    assert prefill_ids(packer.pack(decodes, [new], now=10.0)) == []
    assert prefill_ids(packer.pack(decodes, [new, old], now=10.0)) == ["old"]
    assert prefill_ids(packer.pack([], [new], now=10.0)) == ["new"]
    assert prefill_ids(packer.pack(decodes, [new], now=10.5)) == ["new"]
    # A prompt whose prefill started (a chunk of it ran) is not held: it finishes.
    started = _prefill("started", 400, computed=128, arrival=9.9)
    started.first_scheduled_time = 9.9
    assert prefill_ids(packer.pack(decodes, [started], now=10.0)) == ["started"]
    # A decode-only step is the decodes' own: no hold at all co-schedules the newcomer.
    unheld = _adaptive(multi=multi, target_batch_time_s=0.05, remaining_work=lambda r: 0.01)
    assert prefill_ids(unheld.pack(decodes, [new], now=10.0)) == ["new"]


def test_a_negative_prefill_hold_is_refused():
    with pytest.raises(ValueError, match="prefill_hold_s"):
        _adaptive(prefill_hold_s=-1.0)
