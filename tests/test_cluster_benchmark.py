"""The cluster benchmark's ceiling: the hit rate one never-evicting cache gives a trace."""

import pytest

from benchmarks.cluster import trace_reuse
from medha_jax.workloads import TraceRequest


def test_trace_reuse_counts_the_leading_blocks_seen_before():
    trace = [TraceRequest(0.0, 40, 1, prefix_blocks=(0, 1, 2), block_tokens=16),
             # blocks 0 and 1 seen, then a new one: 32 of 40 tokens; block 2 after a new
             # block is not a prefix and does not count.
             TraceRequest(1.0, 40, 1, prefix_blocks=(0, 1, 9, 2), block_tokens=16),
             # every block seen, but the prompt is shorter than they span: 20 of 20.
             TraceRequest(2.0, 20, 1, prefix_blocks=(0, 1), block_tokens=16)]
    assert trace_reuse(trace) == pytest.approx((0 + 32 + 20) / (40 + 40 + 20))
    assert trace_reuse([]) == 0.0


def test_multi_turn_slice_keeps_whole_sessions_of_enough_turns():
    from benchmarks.cluster import multi_turn_slice

    def turn(t, session):
        return TraceRequest(float(t), 10, 1, session_id=session)
    trace = [turn(5, "a"), turn(6, "b"), turn(7, "a"), turn(8, "c"), turn(9, "b"),
             turn(10, "b"), turn(11, "c")]
    two = multi_turn_slice(trace, num_requests=10)
    assert [r.session_id for r in two] == ["a", "b", "a", "c", "b", "b", "c"]
    assert two[0].arrival_s == 0.0
    three = multi_turn_slice(trace, num_requests=10, min_turns=3)
    assert [r.session_id for r in three] == ["b", "b", "b"]
    # Sessions are taken whole: "b" (3 turns) does not fit in 4 after "a" (2).
    assert [r.session_id for r in multi_turn_slice(trace, num_requests=4)] == \
        ["a", "a", "c", "c"]


def test_decision_time_routes_every_policy_on_a_few_sessions():
    """Part (b) end to end, small: every policy and both index lookups give a row."""
    from benchmarks.cluster import decision_time, parse_args
    from medha_jax.cluster.router import ROUTING_POLICIES

    rows = decision_time(parse_args(["--quick", "--sessions", "40"]), num_replicas=4)
    assert [(r["policy"], r["lookup"]) for r in rows][:len(ROUTING_POLICIES)] == \
        [(p, "bisect") for p in ROUTING_POLICIES]
    assert len(rows) == len(ROUTING_POLICIES) + 1 and rows[-1]["lookup"] == "walk"
    assert all(r["route_p50_us"] > 0 and r["sessions"] == 40 for r in rows)
