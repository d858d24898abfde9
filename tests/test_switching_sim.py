"""The live switching coordinator over simulated engines (seed 004, section 6)."""

import dataclasses

import pytest

from medha_jax.cluster.switching_sim import drive, switching_units
from medha_jax.config import ParallelConfig, model_preset
from medha_jax.request import Request
from medha_jax.scheduler import SchedulerConfig
from medha_jax.scheduler.hardware import hardware_preset
from medha_jax.scheduler.predictor import AnalyticalPredictor
from medha_jax.simulator import kv_capacity_tokens, simulate
from medha_jax.workloads import AlternatingLoadSpec, alternating_load_workload, to_requests
from serving.switching import SwitchingConfig, SwitchingCoordinator

MODEL = model_preset("llama3-70b")
BUCKETS = (16, 32, 64, 128, 256, 512)
SCHED = SchedulerConfig("sarathi-512", token_buckets=BUCKETS, max_seqs_per_batch=64)


def setup(policy, replicas, base_tp, *, group_sizes=(2, 4), max_model_len=None, **config):
    units = switching_units(MODEL, hardware="h200", num_replicas=replicas, base_tp=base_tp,
                            group_sizes=group_sizes if policy != "off" else (),
                            token_buckets=BUCKETS, max_seqs=SCHED.max_seqs_per_batch,
                            max_model_len=max_model_len)
    predictor = AnalyticalPredictor(MODEL, ParallelConfig(tp=base_tp), "h200",
                                    token_buckets=BUCKETS)
    coordinator = SwitchingCoordinator(
        units.replicas, SwitchingConfig(policy, group_sizes=group_sizes, **config),
        predictor=predictor, scheduler_config=SCHED, clock=units.clock, groups=units.groups)
    return units, coordinator


def workload(n=60, seed=0, **spec):
    spec = {"prompt_tokens": (64, 1500), "output_tokens": (8, 64), **spec}
    trace, priorities = alternating_load_workload(AlternatingLoadSpec(
        num_requests=n, seed=seed, low_s=2.0, burst_s=1.0, **spec))
    requests = to_requests(trace)
    for r, p in zip(requests, priorities):
        r.priority = p
    return requests


def assert_served(run, requests, units):
    """Every request finished once with exactly its tokens; no page left booked."""
    assert [r.request_id for r in run.requests] == [r.request_id for r in requests]
    for got, want in zip(run.requests, requests):
        assert len(got.output_token_ids) == want.max_new_tokens
        assert got.first_token_time >= want.arrival_time
    for engine in units.replicas:
        assert engine.allocator.num_free_pages == engine.allocator.num_pages


def test_one_unit_is_the_simulator():
    """A coordinator over one simulated TP-8 replica ("off") is simulate() with one
    replica, timestamp for timestamp: the loop adds nothing to the device time."""
    requests = workload()
    units, coordinator = setup("off", 1, 8)
    run = drive(coordinator, units, requests)
    reference = simulate(requests, scheduler=SCHED, model=MODEL,
                         parallel=ParallelConfig(tp=8), hardware="h200",
                         max_model_len=units.replicas[0].max_model_len)
    assert_served(run, requests, units)
    for got, want in zip(run.requests, reference.requests):
        assert (got.first_scheduled_time, got.first_token_time, got.finish_time) == \
            pytest.approx((want.first_scheduled_time, want.first_token_time,
                           want.finish_time), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("policy,config", [
    ("off", {}), ("load", {"load_max_queued": 4}),
    ("load", {"load_max_queued": 2, "tp_group_size": 2}),
    ("priority", {"priority_threshold": -1, "priority_preemption": "hard"}),
    ("priority", {"priority_threshold": -1, "priority_preemption": "soft",
                  "tp_group_size": 2}),
])
def test_every_policy_serves_every_request(policy, config):
    requests = workload(high_priority_fraction=0.2)
    units, coordinator = setup(policy, 4, 2, **config)
    run = drive(coordinator, units, requests)
    assert_served(run, requests, units)
    assert coordinator.mode_changes["bind"] == coordinator.mode_changes["release"]
    if policy != "off":
        assert coordinator.mode_changes["bind"] >= 1


def test_group_capacity_is_its_members():
    """A group of m TP-2 replicas holds m x one replica's tokens (each member keeps its own
    weights); a static TP-8 replica, holding the weights once, holds more."""
    units, _ = setup("load", 4, 2)
    assert units.replica_kv_tokens == kv_capacity_tokens(MODEL, ParallelConfig(tp=2),
                                                         hardware_preset("h200"))
    pages = units.replica_kv_tokens // 16
    assert units.group_kv_tokens(2) == 2 * 16 * pages
    assert units.group_kv_tokens(4) == 4 * 16 * pages
    static_tp8 = kv_capacity_tokens(MODEL, ParallelConfig(tp=8), hardware_preset("h200"))
    assert static_tp8 > units.group_kv_tokens(4)


def test_memory_policy_binds_the_smallest_group_that_holds_it():
    """A request longer than one replica's KV runs on the smallest group that holds it."""
    units, coordinator = setup("memory", 4, 2, max_model_len=800_000)
    need = units.replica_kv_tokens + 1000
    assert need <= units.group_kv_tokens(2)
    long = Request("long", need - 8, 8, 0.0)
    short = Request("short", 100, 8, 0.0)
    run = drive(coordinator, units, [long, short])
    assert_served(run, [long, short], units)
    assert coordinator.requests_per_mode == {"tp4": 1, "dp": 1}      # 2 x TP-2
    units, coordinator = setup("off", 4, 2, max_model_len=800_000)
    with pytest.raises(ValueError, match="long"):
        coordinator.submit(long)


def test_hard_preemption_serves_a_priority_request_at_once():
    """Every replica busy decoding: a high-priority request binds the TP-8 group at the
    next boundary and is served before the paused DP requests go on."""
    dp = [Request(f"dp{i}", 1000, 200, 0.0) for i in range(8)]
    vip = Request("vip", 1000, 20, 1.0, priority=-1)
    results = {}
    for policy in ("off", "priority"):
        units, coordinator = setup(policy, 4, 2, priority_threshold=-1)
        run = drive(coordinator, units, dp + [vip])
        assert_served(run, dp + [vip], units)
        results[policy] = {r.request_id: r for r in run.requests}
    fast, slow = results["priority"]["vip"], results["off"]["vip"]
    assert fast.finish_time < slow.finish_time
    # The DP requests were paused, not recomputed: each finished after the vip did.
    assert all(results["priority"][r.request_id].finish_time > fast.finish_time for r in dp)
    assert all(results["priority"][r.request_id].num_preemptions == 0 for r in dp)


def test_load_counts_a_bound_groups_queue():
    """A TP-4 group bound by a lone request must not take every later request while the
    two free replicas idle: the group's queue counts as load."""
    requests = [Request(f"r{i}", 500, 100, 0.05 * i) for i in range(12)]
    units, coordinator = setup("load", 4, 2, load_max_queued=2, tp_group_size=2)
    run = drive(coordinator, units, requests)
    assert_served(run, requests, units)
    assert coordinator.requests_per_mode["tp4"] >= 1
    assert coordinator.requests_per_mode["dp"] >= 6


def test_priority_request_is_not_queued_behind_waiting_dp_requests():
    """While the TP-8 group is bound, DP requests wait for its release; a high-priority
    request arriving behind them still joins the group at once."""
    first = Request("vip0", 500, 200, 0.0, priority=-1)
    waiting = [Request(f"dp{i}", 500, 10, 0.1) for i in range(3)]
    second = Request("vip1", 500, 10, 0.2, priority=-1)
    units, coordinator = setup("priority", 4, 2, priority_threshold=-1)
    run = drive(coordinator, units, [first, *waiting, second])
    assert_served(run, [first, *waiting, second], units)
    done = {r.request_id: r for r in run.requests}
    assert done["vip1"].finish_time < done["vip0"].finish_time
    assert all(done[r.request_id].first_token_time > done["vip1"].finish_time for r in waiting)


def test_alternating_load_workload():
    spec = AlternatingLoadSpec(num_requests=3000, seed=3, high_priority_fraction=0.1)
    trace, priorities = alternating_load_workload(spec)
    assert (trace, priorities) == alternating_load_workload(spec)
    assert all(128 <= r.prompt_tokens <= 4000 and 64 <= r.output_tokens <= 512 for r in trace)
    assert sum(p == -1 for p in priorities) == 300 and set(priorities) == {0, -1}
    # Low phases ([40k, 40k + 30) s) at 2-5 req/s, bursts ([40k + 30, 40k + 40) s) at 10-30.
    counts = {}
    for r in trace:
        counts.setdefault(int(r.arrival_s // 40), [0, 0])[int(r.arrival_s % 40 >= 30)] += 1
    full = [c for phase, c in counts.items() if phase < max(counts)]
    assert len(full) >= 5
    assert all(c[0] / 30 < 7 and c[1] / 10 > 6 for c in full)
    with pytest.raises(ValueError, match="burst_qps"):
        AlternatingLoadSpec(burst_qps=(30.0, 10.0))
    assert dataclasses.replace(spec, seed=4) != spec


def test_replicas_step_independently():
    """Four DP replicas under "off" are four independent replicas, timestamp for timestamp:
    each request's times equal those of `simulate()` of its replica's requests alone. So no
    replica waits for another's step (the coordinator is not a lockstep loop: with one, a
    replica decoding next to one running a prefill chunk waited for it every step)."""
    requests = workload(n=40)
    units, coordinator = setup("off", 4, 2)
    placed = {}
    for i, unit in enumerate(coordinator.replicas):
        def add(request, *, resume=False, _i=i, _add=unit.controller.add_request):
            placed[request.request_id] = _i
            _add(request, resume=resume)
        unit.controller.add_request = add
    run = drive(coordinator, units, requests)
    assert_served(run, requests, units)
    done = {r.request_id: r for r in run.requests}
    assert sorted(set(placed.values())) == [0, 1, 2, 3]
    for i in range(4):
        mine = [r for r in requests if placed[r.request_id] == i]
        alone = simulate(mine, scheduler=SCHED, model=MODEL, parallel=ParallelConfig(tp=2),
                         hardware="h200", max_model_len=units.replicas[i].max_model_len)
        for want in alone.requests:
            got = done[want.request_id]
            assert (got.first_scheduled_time, got.first_token_time, got.finish_time) == \
                pytest.approx((want.first_scheduled_time, want.first_token_time,
                               want.finish_time), rel=1e-12, abs=1e-12)


def test_max_pause_bounds_how_long_a_hard_binding_pauses_dp_requests():
    """A steady stream of priority requests keeps a hard TP-8 binding busy. Unbounded, the
    DP request it paused waits for the whole stream; with max_pause_s the binding closes
    after that long, drains, releases (the DP request gets steps) and binds afresh for the
    priority requests that waited."""
    dp = Request("dp", 1000, 100, 0.0)
    stream = [Request(f"vip{i}", 100, 40, 0.2 + 0.2 * i, priority=-1) for i in range(40)]
    finish = {}
    for pause in (None, 0.5):
        units, coordinator = setup("priority", 4, 2, priority_threshold=-1, max_pause_s=pause)
        run = drive(coordinator, units, [dp, *stream])
        assert_served(run, [dp, *stream], units)
        done = {r.request_id: r for r in run.requests}
        finish[pause] = done["dp"].finish_time
        binds = coordinator.mode_changes["bind"]
        assert binds == coordinator.mode_changes["release"]
        if pause is None:
            assert finish[None] > max(r.finish_time for r in run.requests if r is not done["dp"])
        else:
            assert binds > 1
    assert finish[0.5] < finish[None] / 2
