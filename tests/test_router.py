"""Routing decisions on stated snapshots, and the Router's state between decisions."""

import random

import pytest

from medha_jax.cluster.router import (LEAST_LOAD, PREDICTED_TIME, ROUND_ROBIN, SGLANG_CACHE_AWARE,
                                      NoHealthyReplica, ReplicaStatus, RouteRequest, Router,
                                      RouterSnapshot, RoutingConfig, decide, lars_ttft_s)
from medha_jax.kv_cache.allocator import prefix_page_hashes
from medha_jax.request import VirtualClock
from medha_jax.scheduler.policies import QueuedPrefill


def linear_prefill(seconds_per_token=1e-3, fixed=0.01):
    """A predictor's prefill time: a fixed cost plus a cost per new token."""
    return lambda num_tokens, cached: fixed + seconds_per_token * (num_tokens - cached)


def status(**kw):
    kw.setdefault("prefill_s", linear_prefill())
    kw.setdefault("page_size", 16)
    return ReplicaStatus(**kw)


def late(*seconds):
    """Queued prefills with these seconds left and no slack: LARS runs them before any new
    one that is not due before they end (each is its own whole prefill, 100 tokens)."""
    return tuple(QueuedPrefill(w, 0.0, w, 100) for w in seconds)


def snapshot(statuses, cached, recent=None, session=None, rr=0):
    return RouterSnapshot(tuple(statuses), tuple(cached),
                          tuple(recent or [0.0] * len(statuses)), session, rr)


def test_round_robin_takes_turns_and_skips_unhealthy_replicas():
    snap = snapshot([status(), status(healthy=False), status()], [0, 0, 0], rr=1)
    assert decide(RouteRequest(100), snap, RoutingConfig(ROUND_ROBIN)).replica == 2


def test_least_load_is_vllms_four_waiting_plus_running():
    snap = snapshot([status(num_waiting=1, num_running=0), status(num_waiting=0, num_running=3)],
                    [0, 0])
    assert decide(RouteRequest(100), snap, RoutingConfig(LEAST_LOAD)).replica == 1


def test_sglang_cache_aware_follows_the_cache_above_its_threshold_unless_imbalanced():
    config = RoutingConfig(SGLANG_CACHE_AWARE)
    balanced = [status(num_running=5), status(num_running=1)]
    # 40% of the prompt cached on replica 0 (> 0.3): the cache wins over load.
    assert decide(RouteRequest(1000), snapshot(balanced, [400, 0]), config).replica == 0
    # 20% cached: below the threshold, the least loaded.
    assert decide(RouteRequest(1000), snapshot(balanced, [200, 0]), config).replica == 1
    # Imbalanced (100 - 10 > 64 and 100 > 1.5 x 10): the least loaded whatever is cached.
    hot = [status(num_running=100), status(num_running=10)]
    assert decide(RouteRequest(1000), snapshot(hot, [900, 0]), config).replica == 1


def test_predicted_time_prices_new_tokens_not_prompt_length():
    """Replica 0 has more queued prefill but caches 90% of the prompt: fewer seconds there."""
    statuses = [status(queued_prefills=late(2.0)), status(queued_prefills=late(0.5))]
    request = RouteRequest(8000, ttft_s=20.0)
    decision = decide(request, snapshot(statuses, [7200, 0]))
    assert decision.replica == 0 and decision.policy == PREDICTED_TIME
    assert decision.cached_tokens == 7200
    # Charged 0.81 + 0.81 (its 0.81 s prefill and the 2 s one sharing steps), but
    # predicted to wait for the late 2 s one, which lars-mp runs first.
    assert decision.predicted_ttft_s == pytest.approx(2.0 + 0.01 + 0.8)
    # Without that cache the queue decides: 8.01 + 2 there, 8.01 + 0.5 here.
    assert decide(request, snapshot(statuses, [0, 0])).replica == 1


def test_a_new_prefill_passes_a_queued_one_whose_slack_covers_it():
    """lars-mp lets a short prefill ride ahead of a more urgent one that can afford it
    (AdaptivePacker.riders): the 0.11 s prefill passes the 10 s one with 20 s of slack,
    but not the 0.5 s ones that are late."""
    roomy = (QueuedPrefill(10.0, 20.0, 10.0, 100),)      # key 2 < the new one's 89.9
    statuses = [status(queued_prefills=roomy), status(queued_prefills=late(0.5, 0.5, 0.5))]
    short = decide(RouteRequest(100), snapshot(statuses, [0, 0]))
    assert short.replica == 0 and short.predicted_ttft_s == pytest.approx(0.11)


def test_a_short_prefill_waits_for_a_late_long_one_that_ends_before_its_deadline():
    """The case processor sharing mispriced (benchmarks/disagg.py (g): 0.11x): a late
    prefill with 3 s left runs first to its end, and a 0.11 s one due in 5 s waits for
    it; due in 2 s (before the late one could end) it rides beside it at once."""
    queue = (QueuedPrefill(3.0, -1.0, 4.0, 2000),)
    busy = status(queued_prefills=queue)
    assert lars_ttft_s(busy, 0.11, RouteRequest(100, ttft_s=5.0)) == pytest.approx(3.11)
    assert lars_ttft_s(busy, 0.11, RouteRequest(100, ttft_s=2.0)) == pytest.approx(0.11)


def test_the_riders_ranked_ahead_share_the_slack_first():
    """A running prefill with 4 s left and 1 s of slack: two short turns ranked ahead of a
    new 0.4 s one ride in it first (0.8 s), and the 0.2 s left does not cover the new one,
    which waits for the running one to end: 0.8 + 4 + 0.4 s. With one of them queued, it
    rides too: 0.4 + 0.4 s."""
    head = QueuedPrefill(4.0, 1.0, 6.0, 2000)
    rider = QueuedPrefill(0.4, 9.5, 0.4, 100)              # key 23.75 < the new one's 24
    request = RouteRequest(400, ttft_s=10.0)
    exact = linear_prefill(1e-3, 0.0)
    both = status(prefill_s=exact, queued_prefills=(head, rider, rider))
    assert lars_ttft_s(both, 0.4, request) == pytest.approx(0.8 + 4.0 + 0.4)
    one = status(prefill_s=exact, queued_prefills=(head, rider))
    assert lars_ttft_s(one, 0.4, request) == pytest.approx(0.4 + 0.4)


def test_a_new_prefill_with_more_work_left_than_the_head_goes_right_after_it():
    """A queued prefill with 0.3 s left and 5 s of slack: a new 0.2 s one rides ahead of
    it (0.2 s); a new 0.4 s one, which its slack covers as well, goes right after it (0.3
    + 0.4 s), still before a long queued prefill ranked between them (1.0 s, no slack to
    spare). A queued 0.5 s prefill ranked below a new 0.4 s one goes right after it, a
    0.3 s one ahead of it."""
    head = QueuedPrefill(0.3, 5.0, 1.0, 200)               # key 5
    between = QueuedPrefill(1.0, 0.1, 0.01, 5000)          # key 10, long
    here = status(prefill_s=linear_prefill(1e-3, 0.0), queued_prefills=(head, between),
                  long_prefill_tokens=1000)
    assert lars_ttft_s(here, 0.2, RouteRequest(200, ttft_s=100.0)) == pytest.approx(0.2)
    assert lars_ttft_s(here, 0.4, RouteRequest(400, ttft_s=100.0)) == pytest.approx(0.7)
    new = RouteRequest(400, ttft_s=2.0)
    for work, ttft in ((0.5, 0.4), (0.3, 0.7)):
        below = (QueuedPrefill(work, 10.0 - work, work, 100),)     # key ~19 or ~32 > 4
        assert lars_ttft_s(status(prefill_s=linear_prefill(1e-3, 0.0), queued_prefills=below),
                           0.4, new) == pytest.approx(ttft)


def test_a_long_prefill_never_rides():
    """IsLong (Algorithm 2): a prompt over long_prefill_tokens waits for the queued prefill
    whose slack would cover a short one of the same seconds."""
    queue = (QueuedPrefill(1.0, 5.0, 1.0, 100),)          # key 5
    here = status(queued_prefills=queue, long_prefill_tokens=1000)
    short, long = RouteRequest(900, ttft_s=50.0), RouteRequest(2000, ttft_s=50.0)
    assert lars_ttft_s(here, 0.5, short) == pytest.approx(0.5)
    assert lars_ttft_s(here, 0.5, long) == pytest.approx(1.5)
    # Beside a long queued prefill a due short one gets rho_max of each step: the long one
    # runs (1 - 0.4) / 0.4 x 0.5 s meanwhile.
    long_queue = (QueuedPrefill(4.0, -1.0, 4.0, 5000),)
    due = RouteRequest(900, ttft_s=2.0)
    assert lars_ttft_s(status(queued_prefills=long_queue, long_prefill_tokens=1000), 0.5,
                       due) == pytest.approx(0.5 + 0.75)


def test_a_cached_prompt_ranks_by_its_whole_prompt():
    """LARS keys a request by its whole prompt's prefill seconds (w_total; w(t) too, until
    its cached prefix is found as it first runs): a long turn with 8,900 of 9,000 tokens
    cached and 20 s to go ranks (20 - 9.01) / 9.01 = 1.22, above a queued long prefill
    keyed 2, and does not wait for it (by its 0.11 s left it would rank 180, below)."""
    queue = (QueuedPrefill(1.0, 2.0, 1.0, 9000),)
    here = status(queued_prefills=queue)
    x = here.prefill_s(9000, 8900)
    assert lars_ttft_s(here, x, RouteRequest(9000, ttft_s=20.0)) == pytest.approx(0.11)


def _lars_wait_by_plain_scan(queued, x, total, d, rides, long_tokens, rho_max):
    """`router._lars_wait_s`'s rule as its docstring states it, with the riders of each
    head found by a scan of every later prefill (quadratic; the router bounds the scan)."""
    key = (d - total) / total
    ranked = sorted(queued, key=lambda q: q.slack_s / q.total_s)
    ahead = [q for q in ranked if q.slack_s / q.total_s < key]
    below = [q for q in ranked if q.slack_s / q.total_s >= key and q.prompt_len <= long_tokens]
    due_share = (1 - rho_max) / rho_max
    served, wait = [False] * len(ahead), 0.0
    for i, q in enumerate(ahead):
        if served[i]:
            continue
        slack = q.slack_s - wait
        spare, riders, riders_after = max(0.0, slack), 0.0, 0.0
        for j in range(i + 1, len(ahead)):
            r = ahead[j]
            if not served[j] and r.prompt_len <= long_tokens and r.work_s <= spare:
                spare, served[j] = spare - r.work_s, True
                if r.work_s < q.work_s:
                    riders += r.work_s
                else:
                    riders_after += r.work_s
        if rides and x <= spare:
            after_q = x >= q.work_s and d - wait > q.work_s      # not due before q ends
            return wait + riders + (q.work_s + riders_after if after_q else 0.0)
        if rides and d - wait <= q.work_s:
            return wait + riders + (min(q.work_s, x * due_share)
                                    if q.prompt_len > long_tokens else 0)
        wait += riders + riders_after
        new_key = key - wait / total
        if (slack - riders) / q.total_s < new_key:
            wait += min(q.work_s, total * (new_key - (slack - riders) / q.total_s))
    spare = d - x - wait
    for q in below:
        if q.work_s <= spare:
            spare = spare - q.work_s
            wait += q.work_s if q.work_s < x or q.slack_s + q.work_s <= wait + x else 0
        elif q.slack_s + q.work_s <= wait + x:
            wait += q.work_s
    return wait


def test_the_wait_is_that_of_a_plain_scan_for_riders():
    """On random queues (zero-work prefills, long ones, slack of either sign, new prefills
    that ride and that do not), lars_ttft_s's wait equals that of a scan of every later
    prefill from every head for its riders."""
    rng = random.Random(7)
    for _ in range(500):
        long_tokens = rng.choice([64, 512, 4096])
        queue = []
        for _ in range(rng.randrange(60)):
            prompt = rng.randrange(16, 8192)
            work = 0.0 if rng.random() < 0.2 else rng.uniform(0.0, 1.0)
            queue.append(QueuedPrefill(work, rng.uniform(-2.0, 15.0), max(work, 1.0), prompt))
        rho_max = rng.choice([0.5, 0.9])
        here = status(prefill_s=linear_prefill(0.0, 1.0), queued_prefills=tuple(queue),
                      long_prefill_tokens=long_tokens, rho_max=rho_max)
        x, d = rng.uniform(0.01, 1.0), rng.uniform(0.5, 60.0)
        request = RouteRequest(rng.choice([long_tokens, long_tokens + 1]), ttft_s=d)
        total = max(1.0, x)           # the whole prompt's seconds: the fixed 1 s
        wait = _lars_wait_by_plain_scan(queue, x, total, d, request.prompt_len <= long_tokens,
                                        long_tokens, rho_max)
        assert lars_ttft_s(here, x, request) == pytest.approx(wait + x)


def test_queued_prefills_ranked_below_ride_ahead_in_the_new_ones_slack():
    """A new 1 s prefill due in 2 s ranks above 0.6 s ones due in 10 s: the first rides
    ahead in its 1 s of slack, the second does not fit the 0.4 s left of it."""
    below = (QueuedPrefill(0.6, 9.4, 0.6, 100), QueuedPrefill(0.6, 9.5, 0.6, 100))
    request = RouteRequest(100, ttft_s=2.0)
    assert lars_ttft_s(status(queued_prefills=below), 1.0, request) == pytest.approx(1.6)
    # In key order: a partly done one (key 1.175) takes 0.6 s of the slack; then one due
    # at 1.1 s, before the new one would end, rides although the 0.4 s left do not cover
    # its 0.5 s; the last one waits.
    mixed = (QueuedPrefill(0.6, 9.4, 8.0, 100), QueuedPrefill(0.5, 0.6, 0.5, 100), below[1])
    assert lars_ttft_s(status(queued_prefills=mixed), 1.0, request) == pytest.approx(2.1)


def test_the_first_token_comes_at_the_end_of_a_step():
    """With steps of T = 0.2 s: a busy replica is T/2 into its current step on average, and
    the new prefill's last step is filled to T by the queued work (it rides beside it)."""
    roomy = (QueuedPrefill(5.0, 20.0, 5.0, 100),)
    busy = status(queued_prefills=roomy, chunk_step_s=0.2, num_running=1)
    assert lars_ttft_s(busy, 0.05, RouteRequest(100)) == pytest.approx(0.1 + 0.2)
    idle = status(chunk_step_s=0.2)
    assert lars_ttft_s(idle, 0.05, RouteRequest(100)) == pytest.approx(0.05)
    # No riders (a scheduler other than lars-mp): the processor-sharing bound.
    shared = status(queued_prefills=roomy, long_prefill_tokens=None)
    assert lars_ttft_s(shared, 0.5, RouteRequest(100)) == pytest.approx(1.0)


def test_prefill_repeating_work_cached_elsewhere_is_charged():
    """Replica 1 would give this request its first token 10 ms sooner by recomputing half
    of the prompt that replica 0 has cached; the recomputed seconds are charged to it."""
    statuses = [status(queued_prefills=late(0.51)), status()]    # 0.51 + 0.51 vs 1.01
    no_margin = dict(affinity_margin=0.0, affinity_margin_s=0.0)
    snap = snapshot(statuses, [500, 0])
    assert decide(RouteRequest(1000), snap, RoutingConfig(**no_margin)).replica == 0
    assert decide(RouteRequest(1000), snap,
                  RoutingConfig(recompute_weight=0.0, **no_margin)).replica == 1


def test_each_replica_is_priced_by_its_own_predictor():
    slow, fast = linear_prefill(4e-3), linear_prefill(1e-3)
    statuses = [status(prefill_s=slow), status(prefill_s=fast, queued_prefills=late(0.1) * 10)]
    assert decide(RouteRequest(1000), snapshot(statuses, [0, 0])).replica == 1   # 2.01 < 4.01
    assert decide(RouteRequest(100), snapshot(statuses, [0, 0])).replica == 0    # 0.41 < 1.11


def test_session_affinity_holds_within_the_margin_and_yields_beyond_it():
    config = RoutingConfig(affinity_margin=0.2, affinity_margin_s=0.0)
    request = RouteRequest(1000, session_id="s")
    near = [status(queued_prefills=late(0.1)), status()]                # 1.11 vs 1.01
    assert decide(request, snapshot(near, [0, 0], session=0), config).replica == 0
    far = [status(queued_prefills=late(1.0)), status()]                 # 2.01 vs 1.01
    assert decide(request, snapshot(far, [0, 0], session=0), config).replica == 1


def test_a_sessions_first_turn_goes_where_the_least_load_was_placed_lately():
    """Equal queues now, but replica 0 was handed more work lately (turns to come)."""
    statuses = [status(), status()]
    request = RouteRequest(500, session_id="new")
    decision = decide(request, snapshot(statuses, [0, 0], recent=[30.0, 5.0]))
    assert decision.replica == 1


def test_a_replica_that_has_served_nothing_gets_first_turns_under_light_load():
    """Replicas 0 and 1 hold the system prompt every prompt starts with; replica 2 has
    served nothing. Its charge (recomputing those 64 tokens) is within the margin, and no
    load was placed on it lately: a new session goes there."""
    statuses = [status(), status(), status()]
    decision = decide(RouteRequest(1000, session_id="new"),
                      snapshot(statuses, [64, 64, 0], recent=[3.0, 2.0, 0.0]))
    assert decision.replica == 2


def test_no_healthy_replica_is_a_clear_error():
    with pytest.raises(NoHealthyReplica, match="none of the 2"):
        decide(RouteRequest(10), snapshot([status(healthy=False)] * 2, [0, 0]))


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown routing policy 'nope'"):
        RoutingConfig("nope")


def test_router_sends_a_sessions_next_turn_to_its_speculative_prefix():
    """Two turns of one session a moment apart: the second lands with the first although
    no cache event confirmed the first's pages yet."""
    clock = VirtualClock()
    statuses = [status(), status()]
    router = Router(2, lambda: statuses, clock=clock.now)
    turn1 = list(range(64))
    first = router.route(RouteRequest(64, tuple(prefix_page_hashes(turn1, 16)), "s", 8))
    turn2 = turn1 + list(range(100, 148))
    # Another session's first turn, unrelated: the load placed lately sends it elsewhere.
    other = list(range(500, 564))
    second = router.route(RouteRequest(64, tuple(prefix_page_hashes(other, 16)), "t", 8))
    assert second.replica != first.replica
    third = router.route(RouteRequest(112, tuple(prefix_page_hashes(turn2, 16)), "s", 8))
    assert third.replica == first.replica and third.cached_tokens == 64
    clock.advance_to(10.0)                         # marks expired, nothing confirmed
    assert router.snapshot(RouteRequest(112, tuple(prefix_page_hashes(turn2, 16)))
                           ).cached_tokens == (0, 0)


def test_router_forgets_a_dead_replicas_sessions_and_pages():
    statuses = [status(), status()]
    router = Router(2, lambda: statuses)
    hashes = tuple(prefix_page_hashes(list(range(32)), 16))
    first = router.route(RouteRequest(33, hashes, "s"))
    router.replica_down(first.replica)
    statuses[first.replica] = status(healthy=False)
    again = router.route(RouteRequest(33, hashes, "s"))
    assert again.replica != first.replica and again.cached_tokens == 0


def test_the_last_prompt_token_is_never_counted_as_cached():
    statuses = [status()]
    router = Router(1, lambda: statuses)
    hashes = tuple(prefix_page_hashes(list(range(32)), 16))
    router.route(RouteRequest(32, hashes))
    assert router.route(RouteRequest(32, hashes)).cached_tokens == 31


def test_a_prefill_is_charged_for_the_decodes_its_chunks_would_slow():
    """Replica 1 would give the first token sooner (nothing queued there), but 8 decodes
    run there and each waits about the prefill's seconds for its chunks: 1.01 + 8 x 1.01
    against 1.01 + 1.0 on replica 0, whose decodes moved away (the router did send the
    next long prefill to where they went, and undid the move)."""
    queue = (QueuedPrefill(1.0, 0.5, 1.0, 100),)     # a short prefill passes it, this one not
    statuses = [status(queued_prefills=queue), status(decodes=8)]
    request = RouteRequest(1000)
    priced = RoutingConfig(decode_delay_weight=1.0)
    assert decide(request, snapshot(statuses, [0, 0]), priced).replica == 0
    assert decide(request, snapshot(statuses, [0, 0])).replica == 1      # off by default
    # A short prefill slows them little: 0.11 + 8 x 0.11 = 0.99 against 0.11 + 0.11.
    assert decide(RouteRequest(100), snapshot(statuses, [0, 0]), priced).replica == 0
    with pytest.raises(ValueError, match="decode_delay_weight"):
        RoutingConfig(decode_delay_weight=-1.0)


def test_the_ttft_floor_prices_a_short_prefills_wait_behind_late_long_ones():
    """Two late 6 s long prefills on replica 0; 3 decodes on replica 1, charged at the
    router's decode weight 1. Sharing the steps evenly, a short 0.11 s prefill would wait
    0.11 s per queued prefill there: 0.33 s against 0.11 + 3 x 0.11 = 0.44 s, so it goes
    to replica 0. lars-mp runs the first late one to its end first (it is not due before
    then) and the short one rides beside the second: with the floor, that TTFT (over 6 s)
    is replica 0's charge, and it goes to replica 1."""
    longs = tuple(QueuedPrefill(6.0, 0.0, 6.0, 5000) for _ in range(2))
    statuses = [status(queued_prefills=longs, long_prefill_tokens=1000), status(decodes=3)]
    request = RouteRequest(100, ttft_s=10.0)
    weighted = RoutingConfig(decode_delay_weight=1.0)
    assert lars_ttft_s(statuses[0], 0.11, request) > 6.0
    assert decide(request, snapshot(statuses, [0, 0]), weighted).replica == 0
    floored = RoutingConfig(decode_delay_weight=1.0, ttft_floor=True)
    assert decide(request, snapshot(statuses, [0, 0]), floored).replica == 1
