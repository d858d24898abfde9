"""DP <-> TP switching inside a host (seed 004): tiny model, the CPU's virtual devices."""

import dataclasses
import re

import jax
import numpy as np
import pytest

from medha_jax import ParallelConfig
from medha_jax.engine import Engine, EngineConfig
from medha_jax.engine.tp_group import TPGroupEngine, TPShape, member_weights
from medha_jax.hlo import replica_groups
from medha_jax.request import Request, VirtualClock
from medha_jax.sampling_params import SamplingParams
from medha_jax.scheduler.predictor import AnalyticalPredictor
from serving.replicas import replica_models
from serving.switching import SwitchingConfig, SwitchingCoordinator, aligned_groups
from tests.test_engine import backend_compiles, drive

# One replica holds 512 tokens (32 pages of 16); a TP group's pages hold 32 (tiny has 2 K/V
# heads: each rank keeps one, Eq. 3 with K < m), so a group holds 1024.
# Its ladder starts at 16 tokens (not the default 1): 2 token rungs, not 6, for every group's
# warm-up (the suite's slowest tests compile them).
CFG = EngineConfig(page_size=16, max_kv_tokens=512, max_model_len=1024, max_tokens_per_step=32,
                   max_seqs=8, enable_prefix_caching=False, min_token_bucket=16)
WHOLE = lambda request: 32      # noqa: E731  (drive's chunks: the ladder's largest bucket)


def base_replicas(config: EngineConfig = CFG) -> list[Engine]:
    return [Engine(m, config) for m in replica_models("tiny", 4)]


def tp_groups(engines: list[Engine]) -> dict[tuple[int, int], TPGroupEngine]:
    """The aligned TP-2 and TP-4 groups over the base replicas."""
    return {key: TPGroupEngine(engines[key[0]:key[0] + key[1]])
            for key in aligned_groups(len(engines), (2, 4))}


@pytest.fixture(scope="module")
def engines():
    return base_replicas()


@pytest.fixture(scope="module")
def groups(engines):
    return tp_groups(engines)


def request(rid, prompt, max_new, priority=0):
    return Request(rid, len(prompt), max_new, 0.0, priority=priority,
                   prompt_token_ids=list(prompt),
                   sampling=SamplingParams(temperature=0.0, max_tokens=max_new))


def prompt(seed, n):
    return [int(t) for t in np.random.default_rng(seed).integers(1, 256, size=n)]


def reference(engine, p, max_new):
    """One replica's greedy tokens: `engine` alone (idle), outside any coordinator."""
    return drive(engine, [(0, request("ref", p, max_new))], rng=None, max_chunk=0,
                 chunk_of=WHOLE)["ref"]


@pytest.fixture(scope="module")
def big_replica(engines):
    """One replica with room for 1024 tokens, on device 7: the long request's oracle."""
    from meshes import make_mesh
    model = engines[0].model.on_mesh(make_mesh(ParallelConfig(), [jax.devices()[7]]))
    return Engine(model, dataclasses.replace(CFG, max_kv_tokens=1024))


def references(engine, specs):
    """{rid: one replica's greedy tokens} of (rid, prompt, max_new) specs."""
    return {rid: reference(engine, p, n) for rid, p, n in specs}


def submit_all(c, specs):
    for rid, p, n in specs:
        c.submit(request(rid, p, n))


def pointers(engines):
    out = []
    for e in engines:
        leaves = jax.tree.leaves(member_weights(e)) + [e.kv_cache.k, e.kv_cache.v]
        out.append([shard.data.unsafe_buffer_pointer() for leaf in leaves
                    for shard in leaf.addressable_shards])
    return out


def coordinator(engines, groups, *, group_sizes=(2, 4), **config):
    predictor = AnalyticalPredictor(engines[0].model.config, ParallelConfig(), "h100",
                                    token_buckets=engines[0].ladder.token_buckets)
    return SwitchingCoordinator(engines, SwitchingConfig(group_sizes=group_sizes, **config),
                                predictor=predictor, clock=VirtualClock(), groups=groups)


def assert_no_pages_held(engines):
    for e in engines:
        assert e.allocator.num_free_pages == e.allocator.num_pages


def test_tp_shape_keeps_block_bytes_constant():
    from medha_jax.config import model_preset
    llama = model_preset("tiny")                           # K = 2
    assert TPShape.of(llama, 2, 16).page_tokens == 32       # 1 head of 2 per rank: 2 x
    assert TPShape.of(llama, 4, 16).page_tokens == 32       # K < m: heads repeated, K x
    tied = model_preset("tiny-tied")                        # K = 4
    assert [TPShape.of(tied, m, 16).page_tokens for m in (2, 4)] == [32, 64]   # B = m B_base
    with pytest.raises(ValueError, match="num_kv_heads"):
        TPShape.of(dataclasses.replace(tied, num_heads=6, num_kv_heads=3), 2, 16)
    # Members of TP-2 hold K/2 heads per device; the group splits those m ways.
    assert TPShape.of(llama, 2, 16, base_tp=2).page_tokens == 16     # K_b = 1 < m: kept
    assert TPShape.of(tied, 2, 16, base_tp=2).page_tokens == 32       # K_b = 2: B = m B_base
    assert TPShape.of(tied, 2, 16, base_tp=2).heads == tied.num_heads // 4
    with pytest.raises(ValueError, match="num_kv_heads"):
        TPShape.of(llama, 2, 16, base_tp=4)                            # K = 2 < b


@pytest.mark.slow
def test_weights_and_pages_stay_put_over_100_random_switches(engines, groups):
    """Every step runs on a random unit (a DP replica or an aligned TP group) with a request
    of its own; a TP group's tokens equal one replica's, and no weight or cache buffer of
    any replica moves (the TP programs read and write them in place)."""
    before = pointers(engines)
    units = list(engines) + list(groups.values())
    rng = np.random.default_rng(0)
    prompts = [prompt(i, 24) for i in range(5)]
    expected = [reference(engines[0], p, 2) for p in prompts]
    for i in range(100):
        unit = units[rng.integers(len(units))]
        out = drive(unit, [(0, request(f"s{i}", prompts[i % 5], 2))], rng=rng, max_chunk=0,
                    chunk_of=WHOLE)
        assert out[f"s{i}"] == expected[i % 5], (i, type(unit).__name__)
        assert pointers(engines) == before, f"a buffer moved at switch {i}"
    assert_no_pages_held(engines)


def test_tp_program_has_two_all_reduces_per_layer_and_no_weight_all_gather(groups):
    group = groups[(0, 4)]
    shape = group.ladder.all_shapes()[0]
    hlo = group.executable(shape).as_text()
    assert "all-gather" not in hlo
    # Each rank's per-layer weight slices are 1/4 of a layer (e.g. wq [64, 2, 16] of
    # [64, 8, 16]); a transient slice of the whole layer would show its full shape.
    assert "f32[1,64,2,16]" in hlo and "f32[1,64,8,16]" not in hlo
    # One layer body under the scan (a while loop): wo's and w_down's all-reduce.
    assert hlo.count(" all-reduce(") + hlo.count(" all-reduce-start(") == 2, hlo.count("all-reduce")


@pytest.fixture(scope="module")
def engines_tp2():
    """Two base replicas of TP-2 (devices 0-1 and 2-3)."""
    return [Engine(m, CFG) for m in replica_models("tiny", 2, parallel=ParallelConfig(tp=2))]


def test_tp2_base_replicas_bind_a_tp4_group_in_place(engines_tp2):
    """Two TP-2 replicas bind one TP-4 group: device (r, j) computes the r-th half of what
    it holds of replica r's shard j. Greedy tokens equal one TP-2 replica's; no weight or
    cache buffer moves; per layer one all-reduce after wo and one after w_down over the 4
    devices; the embedding and the logits are vocabulary-parallel over each member's 2
    devices (an all-reduce of the looked-up rows, an all-gather of the logits), and
    nothing else is gathered."""
    group = TPGroupEngine(engines_tp2)
    assert (group.tp.base_tp, group.tp.heads, group.tp.mlp) == (2, 2, 32)
    before = pointers(engines_tp2)
    for i in range(3):
        p = prompt(150 + i, 20 + 9 * i)
        assert reference(group, p, 4) == reference(engines_tp2[0], p, 4), i
        assert pointers(engines_tp2) == before
    assert_no_pages_held(engines_tp2)
    hlo = group.executable(group.ladder.all_shapes()[0]).as_text()
    body = [line for line in hlo.splitlines() if "while/body" in line]
    reduces = [line for line in body if " all-reduce(" in line or " all-reduce-start(" in line]
    assert len(reduces) == 2 and all(
        replica_groups(line) == [(0, 1, 2, 3)] for line in reduces), reduces
    gathers = [line for line in hlo.splitlines() if " all-gather(" in line]
    assert gathers and all(re.search(r"= f32\[\d+,256\]", line)
                           and replica_groups(line) == [(0, 1), (2, 3)]
                           for line in gathers), gathers
    # Per layer, each device slices a quarter of wq's heads: [64, 2, 16] of [64, 8, 16].
    assert "f32[1,64,2,16]" in hlo and "f32[1,64,4,16]" not in hlo


def assert_soft_preempt_keeps_one_replicas_tokens(c, engine, *, seed, busy_new, vip_new):
    """Replicas 0 and 1 decode; a priority request binds its group softly: it runs in DP on
    idle replica 2 meanwhile, moves to the group when 0 and 1 drain and is recomputed there.
    Every request's greedy tokens are one replica's."""
    busy = [(f"b{i}", prompt(seed + i, 30), busy_new) for i in range(2)]
    vip_prompt = prompt(seed + 10, 25)
    expected = references(engine, busy + [("vip", vip_prompt, vip_new)])
    submit_all(c, busy)
    c.step()
    c.submit(request("vip", vip_prompt, vip_new, priority=-1))
    c.step()
    assert c.replicas[2].controller.get("vip") is not None          # speculative DP run
    done = c.run()
    assert done["vip"].num_preemptions == 1                          # recomputed under TP
    assert c.mode_changes == {"bind": 1, "release": 1}
    for rid in expected:
        assert done[rid].output_token_ids == expected[rid], rid


def test_soft_preempt_request_starts_in_dp_and_finishes_in_tp(engines, groups):
    c = coordinator(engines, groups, policy="priority", priority_threshold=-1,
                    priority_preemption="soft", tp_group_size=4)
    # The units step independently, as their steps end: the priority request's idle
    # replica must not finish all of it before the busy two drain (under load it ran 16
    # tokens while they ran 12), so it asks for 4x their tokens.
    assert_soft_preempt_keeps_one_replicas_tokens(c, engines[0], seed=10, busy_new=6,
                                                  vip_new=24)
    assert c.groups[(0, 4)].controller.num_steps > 0
    assert_no_pages_held(engines)


def test_hard_preempt_pauses_dp_requests_with_their_pages_and_resumes_them(engines, groups):
    c = coordinator(engines, groups, policy="priority", priority_threshold=-1,
                    tp_group_size=4)
    busy = [(f"h{i}", prompt(30 + i, 20), 10) for i in range(3)]
    vip_prompt = prompt(40, 30)
    expected = references(engines[0], busy + [("vip", vip_prompt, 6)])
    submit_all(c, busy)

    def progress():
        return {rid: len(c.replicas[i].controller.get(rid).output_token_ids)
                for i, (rid, _, _) in enumerate(busy)}

    c.step()                                    # placed: h{i} on replica i
    while not all(progress().values()):
        c.step()
    c.submit(request("vip", vip_prompt, 6, priority=-5))
    # The units step independently: the members' steps in flight land first (each
    # step() applies one), and they take no new one, so the group binds after those.
    for _ in range(len(busy) + 1):
        c.step()
        if c.bindings[(0, 4)].active:
            break
    assert c.bindings[(0, 4)].active
    paused = progress()
    assert all(0 < n < 10 for n in paused.values()), paused
    while "vip" not in c.finished:
        for i, (rid, _, _) in enumerate(busy):                     # paused, pages kept
            assert len(c.replicas[i].controller.get(rid).output_token_ids) == paused[rid]
            assert engines[i].allocator.has(rid)
        c.step()
    done = c.run()
    for rid in expected:
        assert done[rid].output_token_ids == expected[rid], rid
    for rid, _, _ in busy:
        assert done[rid].num_preemptions == 0                       # resumed, not recomputed
    assert_no_pages_held(engines)


def test_a_failing_unit_step_fails_only_its_requests(engines, groups, monkeypatch):
    """Served by a ServingLoop, as a Server serves it: a step that raises on one replica
    fails only that replica's batch (the units step on their own); the other replicas'
    streams carry one replica's tokens, the loop goes on serving, every page comes back."""
    from serving.loop import ServingLoop
    from serving.metrics import ServerMetrics
    from serving.outputs import IncrementalDetokenizer, RequestHandle, RequestStream
    for engine in engines:
        def dispatch(batch, _dispatch=engine.dispatch):
            if any(c.request.request_id == "bad" for c in batch.chunks):
                raise RuntimeError("injected step failure")
            return _dispatch(batch)
        monkeypatch.setattr(engine, "dispatch", dispatch)
    c = coordinator(engines, groups, policy="priority", priority_threshold=-1,
                    tp_group_size=2)
    loop = ServingLoop(c, c, ServerMetrics())

    def submit(rid, p, n, priority=0):
        r = request(rid, p, n, priority=priority)
        handle = RequestHandle(rid, r.prompt_token_ids, loop.cancel)
        loop.add(RequestStream(r, handle, IncrementalDetokenizer(None)))
        return handle

    specs = [(f"g{i}", prompt(130 + i, 20), 8) for i in range(3)]
    expected = references(engines[0], specs + [("vip", prompt(140, 20), 5)])
    try:
        handles = {rid: submit(rid, p, n) for rid, p, n in specs}
        bad = submit("bad", prompt(139, 20), 8).result(timeout=300)
        assert bad.finish_reason == "error" and "injected step failure" in bad.error
        for rid, handle in handles.items():
            assert list(handle.result(timeout=300).token_ids) == expected[rid], rid
        vip = submit("vip", prompt(140, 20), 5, priority=-1).result(timeout=300)
        assert list(vip.token_ids) == expected["vip"]              # a TP-2 group still binds
        assert loop.thread.is_alive()
    finally:
        loop.close(timeout=60)
        loop.metrics.close()
    assert c.mode_changes == {"bind": 1, "release": 1}
    assert_no_pages_held(engines)


@pytest.mark.slow
def test_a_request_no_replica_holds_runs_on_the_smallest_group_that_does(engines, groups,
                                                                          big_replica):
    c = coordinator(engines, groups, policy="memory")
    long_prompt = prompt(50, 600)                 # > 512 tokens of one replica
    expected = reference(big_replica, long_prompt, 8)
    c.submit(request("long", long_prompt, 8))
    c.submit(request("short", prompt(51, 20), 8))
    done = c.run()
    assert c.requests_per_mode == {"tp2": 1, "dp": 1}
    with pytest.raises(ValueError, match="1030 tokens exceed the 1024"):
        c.submit(request("too-long", prompt(52, 1000), 30))
    assert not c.pool
    assert done["long"].output_token_ids == expected
    assert_no_pages_held(engines)


@pytest.mark.slow
def test_no_compile_after_warmup_over_a_random_workload_with_switches():
    # Replicas of their own whose context (256) is as long as this workload needs: warm-up
    # compiles every bucket of every replica and group, and half of the module's buckets
    # are for contexts over 256 tokens.
    engines = base_replicas(dataclasses.replace(CFG, max_model_len=256))
    c = coordinator(engines, tp_groups(engines), policy="priority", priority_threshold=0, tp_group_size=2)
    c.warmup()
    before = pointers(engines)
    with backend_compiles() as compiles:
        rng = np.random.default_rng(1)
        for i in range(16):
            c.submit(request(f"w{i}", prompt(60 + i, int(rng.integers(5, 70))),
                             int(rng.integers(1, 6)), priority=int(rng.integers(0, 3))))
            c.step()
            if i % 4 == 3:                  # drained: the next group binds afresh
                c.run()
        c.run()
    assert c.mode_changes["bind"] >= 2
    assert compiles == []
    assert pointers(engines) == before
    assert_no_pages_held(engines)


@pytest.fixture(scope="module")
def engines8():
    return [Engine(m, CFG) for m in replica_models("tiny", 8)]


@pytest.fixture(scope="module")
def group8(engines8):
    """The TP-8 group over all eight (tiny's 2 K/V heads are kept 4 times each: its pages
    hold 32 tokens, so it holds 1024, twice one replica)."""
    return {(0, 8): TPGroupEngine(engines8)}


@pytest.mark.slow
def test_dp8_hard_preempt_on_a_tp8_group(engines8, group8):
    """Eight base replicas; a priority request binds all eight while every replica's DP
    request pauses; all tokens are one replica's."""
    c = coordinator(engines8, group8, policy="priority", priority_threshold=-1,
                    group_sizes=(8,))
    busy = [(f"e{i}", prompt(70 + i, 12), 5) for i in range(8)]
    vip_prompt = prompt(80, 40)
    expected = references(engines8[0], busy + [("vip", vip_prompt, 6)])
    submit_all(c, busy)
    c.step()
    c.submit(request("vip", vip_prompt, 6, priority=-1))
    done = c.run()
    assert c.mode_changes == {"bind": 1, "release": 1}
    assert c.requests_per_mode == {"dp": 8, "tp8": 1}
    for rid in expected:
        assert done[rid].output_token_ids == expected[rid], rid
    assert_no_pages_held(engines8)


@pytest.mark.slow
def test_dp8_soft_preempt_and_a_long_request_on_a_tp8_group(engines8, group8, big_replica):
    """At dp=8 as at dp=4: a priority request bound softly starts in DP on an idle member
    and finishes under TP-8; a request no replica holds is served by the TP-8 group. Every
    token is one replica's (the long one's: one replica with room for it)."""
    c = coordinator(engines8, group8, policy="priority", priority_threshold=-1,
                    priority_preemption="soft", group_sizes=(8,))
    # vip_new 4x busy_new, as at dp=4: replicas step as their steps finish (`first_done`
    # polls the device), so with 14 against 10 a loaded machine once let the idle member
    # finish vip before 0 and 1 drained, and the bind never moved it.
    assert_soft_preempt_keeps_one_replicas_tokens(c, engines8[0], seed=110, busy_new=10,
                                                  vip_new=40)

    c = coordinator(engines8, group8, policy="memory", group_sizes=(8,))
    long_prompt = prompt(121, 600)                # > 512 tokens of one replica
    c.submit(request("long", long_prompt, 8))
    c.submit(request("short", prompt(122, 20), 8))
    done = c.run()
    assert c.requests_per_mode == {"tp8": 1, "dp": 1}
    assert done["long"].output_token_ids == reference(big_replica, long_prompt, 8)
    assert_no_pages_held(engines8)


def test_load_policy_serves_a_lone_request_in_tp_and_a_burst_in_dp(engines, groups):
    c = coordinator(engines, groups, policy="load", load_max_queued=0, tp_group_size=4)
    lone = prompt(90, 20)
    expected = reference(engines[0], lone, 3)
    c.submit(request("lone", lone, 3))
    assert c.run()["lone"].output_token_ids == expected
    for i in range(4):
        c.submit(request(f"burst{i}", prompt(91 + i, 20), 3))
    c.run()
    assert c.requests_per_mode == {"tp4": 1, "dp": 4}
    assert c.mode_changes == {"bind": 1, "release": 1}
    assert_no_pages_held(engines)


# ---------------------------------------------------------------- through the Server


def test_switching_arguments_are_checked_before_loading():
    from serving.server import Server
    with pytest.raises(ValueError, match="dp=N"):
        Server("tiny", switching="load")
    with pytest.raises(ValueError, match="one device or a TP group"):
        Server("tiny", parallel=ParallelConfig(dp=2, kvp=2), switching="load")
    with pytest.raises(ValueError, match="replicas"):
        Server("tiny", parallel=ParallelConfig(dp=2), switching="load", replicas=2)
    with pytest.raises(ValueError, match="policy must be one of"):
        Server("tiny", parallel=ParallelConfig(dp=2), switching="fastest")
    with pytest.raises(TypeError, match="SwitchingConfig"):
        Server("tiny", parallel=ParallelConfig(dp=2), switching=2)


@pytest.mark.slow
def test_a_switching_server_streams_one_replicas_tokens_through_a_soft_preempt(engines):
    """Server(parallel=ParallelConfig(dp=2), switching=...): a request decodes on replica 0;
    a priority request binds the pair softly (it runs in DP on replica 1 meanwhile, moves to
    TP-2 when replica 0 drains and is recomputed there). Every stream carries one replica's
    greedy tokens, nothing compiles after warm-up, /metrics counts the switch, every page
    comes back; cancelling a request frees its pages too."""
    from serving.server import Server
    busy_prompt, vip_prompt = prompt(100, 30), prompt(101, 25)
    expected = {"busy": reference(engines[0], busy_prompt, 8),
                "vip": reference(engines[0], vip_prompt, 30)}
    greedy = lambda n: SamplingParams(temperature=0.0, max_tokens=n)    # noqa: E731
    config = SwitchingConfig("priority", group_sizes=(2,), priority_threshold=-1,
                             priority_preemption="soft")
    with Server("tiny", parallel=ParallelConfig(dp=2), switching=config, engine_config=CFG,
                scheduler="fcfs") as server:
        assert server.max_model_len == 512
        with backend_compiles() as compiles:
            busy = server.submit(busy_prompt, greedy(8))
            first = next(iter(busy))                           # decoding on replica 0
            # Longer than what is left of busy: it is still running at the switch.
            vip = server.submit(vip_prompt, greedy(30), priority=-1)
            outputs = {"busy": busy.result(timeout=300), "vip": vip.result(timeout=300)}
            doomed = server.submit(prompt(102, 40), greedy(200))
            next(iter(doomed))
            assert server.cancel(doomed.id)
            assert doomed.result(timeout=300).finish_reason == "cancelled"
        assert first.token_ids
        for rid, output in outputs.items():
            assert list(output.token_ids) == expected[rid], rid
        assert outputs["vip"].metrics.num_preemptions == 1      # recomputed under TP
        assert compiles == []
        assert server.switching.mode_changes == {"bind": 1, "release": 1}
        text = server.metrics_text()
        assert 'medha_switching_mode_changes_total{kind="bind"} 1.0' in text
        assert 'medha_switching_requests_total{mode="tp2"} 1.0' in text
        assert 'medha_switching_latency_seconds_count 1.0' in text
        assert server.num_free_pages == server.num_total_pages


@pytest.mark.slow
def test_a_switching_server_over_tp2_base_replicas(engines_tp2):
    """Server(parallel=ParallelConfig(dp=2, tp=2), switching="priority"): base replicas of
    TP-2; a priority request binds the TP-4 group at once (hard: the DP request decoding on
    replica 0 pauses and resumes). Every stream carries one TP-2 replica's greedy tokens.
    Without warm-up: its steps compile as they come (the warm-up of every group's shapes,
    and that nothing compiles after it, is the soft-preempt test's above; it took 110 of
    this test's 120 s on 2 cores)."""
    from serving.server import Server
    busy_prompt, vip_prompt = prompt(160, 30), prompt(161, 25)
    expected = {"busy": reference(engines_tp2[0], busy_prompt, 12),
                "vip": reference(engines_tp2[0], vip_prompt, 6)}
    greedy = lambda n: SamplingParams(temperature=0.0, max_tokens=n)    # noqa: E731
    with Server("tiny", parallel=ParallelConfig(dp=2, tp=2), switching="priority",
                engine_config=CFG, scheduler="fcfs", warmup=False) as server:
        busy = server.submit(busy_prompt, greedy(12))
        next(iter(busy))                                       # decoding on replica 0
        vip = server.submit(vip_prompt, greedy(6), priority=-1)
        outputs = {"busy": busy.result(timeout=300), "vip": vip.result(timeout=300)}
        for rid, output in outputs.items():
            assert list(output.token_ids) == expected[rid], rid
        assert server.switching.mode_changes == {"bind": 1, "release": 1}
        assert server.switching.requests_per_mode == {"dp": 1, "tp4": 1}
        assert server.num_free_pages == server.num_total_pages
