"""Prefill on one replica, decode on another (serving.kv_transfer): exact tokens, pages
streamed per chunk and registered on the decode side, every pool returned after completed,
cancelled and failed hand-offs (tiny model, CPU devices)."""

import threading
import time

import jax
import numpy as np
import pytest

from medha_jax.engine import Engine
from medha_jax.kv_cache.allocator import prefix_page_hashes
from serving.kv_copy import PageCopier
from serving.kv_transfer import parse_roles
from serving.server import Server, TokensPrompt
from tests.test_replicas import GREEDY, tiny_model
from tests.test_server import TINY_ENGINE

# 70..88 tokens: 4-5 full pages, 5-6 chunks of TINY_ENGINE's 16-token steps.
PROMPTS = [TokensPrompt(list(np.random.default_rng(i).integers(1, 256, size=70 + 9 * i)))
           for i in range(3)]
LONG = TokensPrompt(list(np.random.default_rng(7).integers(1, 256, size=200)))


@pytest.fixture(scope="module")
def colocated_tokens():
    with Server(tiny_model(), engine_config=TINY_ENGINE, warmup=False) as server:
        return [out.token_ids for out in server.generate(PROMPTS + [LONG], GREEDY)]


def pools_full(server, replicas=None, timeout=30.0) -> bool:
    """Every (listed) replica's pool back to all free (cached pages count as free)."""
    allocators = [r.engine.allocator for i, r in enumerate(server.replicas)
                  if replicas is None or i in replicas]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(a.num_free_pages == a.num_pages for a in allocators) and \
                server._replica_set.transfers.in_flight == 0:
            return True
        time.sleep(0.02)
    return False


def on_loop(server, replica, fn):
    """Runs fn on the replica's loop thread and returns its result."""
    done, out = threading.Event(), []

    def run():
        try:
            out.append(fn())
        finally:
            done.set()
    assert server.replicas[replica].loop.call(run)
    assert done.wait(30)
    return out[0] if out else None


def test_roles_parse_and_bad_ones_are_named():
    assert parse_roles("prefill:1,decode:2", 3) == ("prefill", "decode", "decode")
    assert parse_roles(None, 2) == ("mixed", "mixed")
    assert parse_roles(["mixed", "decode"], 2) == ("mixed", "decode")
    with pytest.raises(ValueError, match="unknown role 'x'"):
        parse_roles("x:1,decode:1", 2)
    with pytest.raises(ValueError, match="roles name 3 replicas but replicas=2"):
        parse_roles("prefill:1,decode:2", 2)
    with pytest.raises(ValueError, match="at least one must prefill"):
        parse_roles("decode:2", 2)
    with pytest.raises(ValueError, match="roles and offload need replicas >= 2"):
        Server(tiny_model(), engine_config=TINY_ENGINE, warmup=False, roles="mixed:1")


def test_disaggregated_tokens_equal_colocated_pages_streamed_and_registered(colocated_tokens):
    """prefill:1,decode:1: every prompt prefills on replica 0 and decodes on replica 1 with
    replica 0's greedy tokens; its pages moved in several sends, before the prefill's end,
    the prompt's partial last page too, so replica 1 computes none of the prompt again
    (every prompt token counts as cached there); the full pages are in replica 1's prefix
    cache under the prompt's hashes (seed 003 H6) and in replica 0's (kept after the ack);
    every page of both pools comes back."""
    with Server(tiny_model(), engine_config=TINY_ENGINE, warmup=False, replicas=2,
                roles="prefill:1,decode:1") as server:
        outputs = server.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outputs] == colocated_tokens[:3]
        assert [o.metrics.replica for o in outputs] == [1, 1, 1]
        assert [o.metrics.num_cached_tokens for o in outputs] == \
            [len(p.prompt_token_ids) for p in PROMPTS]
        transfers = server._replica_set.transfers
        assert pools_full(server)
        records = transfers.records
        assert len(records) == 3
        for record in records:
            assert (record.prefill, record.decode) == (0, 1)
            # Streamed: the first pages left before the prefill ended.
            assert record.first_send < record.last_send <= record.prefilled
        hashes = prefix_page_hashes(PROMPTS[2].prompt_token_ids, TINY_ENGINE.page_size)
        held = server.router.index.cached_pages(tuple(hashes))
        assert held == [len(hashes), len(hashes)], held
        assert transfers.stale_writes == 0


@pytest.mark.parametrize("prefill, decode", [(dict(tp=2), dict(tp=1)),
                                             (dict(tp=1), dict(kvp=2))])
def test_replicas_of_different_shapes_hand_off_with_colocated_tokens(colocated_tokens,
                                                                      prefill, decode):
    """parallel= one ParallelConfig per replica: a prefill replica and a decode replica of
    different tp / kvp (the tiny model's 2 K/V heads keep the folded head axis's layout)
    give one replica's greedy tokens over 5-6-chunk prompts, the pages streamed between
    the two meshes, and every page of both pools comes back."""
    from meshes import ParallelConfig

    parallel = [ParallelConfig(**prefill), ParallelConfig(**decode)]
    with Server(tiny_model(), engine_config=TINY_ENGINE, warmup=False, replicas=2,
                parallel=parallel, roles="prefill:1,decode:1") as server:
        assert [r.engine.model.parallel for r in server.replicas] == parallel
        outputs = server.generate(PROMPTS[:2], GREEDY)
        assert [o.token_ids for o in outputs] == colocated_tokens[:2]
        assert [o.metrics.replica for o in outputs] == [1, 1]
        assert [o.metrics.num_cached_tokens for o in outputs] == \
            [len(p.prompt_token_ids) for p in PROMPTS[:2]]       # the partial page moved
        records = server._replica_set.transfers.records
        assert [(r.prefill, r.decode) for r in records] == [(0, 1), (0, 1)]
        assert all(r.first_send < r.last_send for r in records)
        assert pools_full(server)


def test_next_turn_on_the_decode_replica_hits_the_moved_pages(colocated_tokens):
    """Offload between mixed replicas (gate always-heavy at 1 token): turn 1 prefills on
    one and decodes on the other; turn 2 sent to the decode replica finds turn 1's prompt
    pages there (they were moved, not computed there)."""
    from medha_jax.cluster.offload import OffloadConfig

    with Server(tiny_model(), engine_config=TINY_ENGINE, warmup=False, replicas=2,
                router="round-robin",
                offload=OffloadConfig("always-heavy", heavy_new_tokens=1)) as server:
        first = server.generate(PROMPTS[1], GREEDY)
        assert first.token_ids == colocated_tokens[1]
        decoded_on = first.metrics.replica
        assert server._replica_set.transfers.records[0].decode == decoded_on
        assert pools_full(server)
        server._replica_set.offload = OffloadConfig("never")
        server._replica_set.router._round_robin_next = decoded_on
        turn2 = list(PROMPTS[1].prompt_token_ids) + list(first.token_ids) + [5, 6, 7]
        second = server.generate(TokensPrompt(turn2), GREEDY)
        assert second.metrics.replica == decoded_on
        full = len(PROMPTS[1].prompt_token_ids) // TINY_ENGINE.page_size * TINY_ENGINE.page_size
        assert second.metrics.num_cached_tokens >= full


def test_cancel_mid_transfer_returns_every_page_and_stale_writes_are_dropped(
        colocated_tokens):
    with Server(tiny_model(), engine_config=TINY_ENGINE, warmup=False, replicas=2,
                roles="prefill:1,decode:1") as server:
        transfers = server._replica_set.transfers
        handle = server.submit(LONG, GREEDY)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            t = transfers._by_id.get(handle.id)
            if t is not None and t.sent > 0:
                break
            time.sleep(0.005)
        assert t is not None and 0 < t.sent < t.num_pages, "cancel came too late"
        assert handle.cancel()
        assert handle.result(timeout=60).finish_reason == "cancelled"
        assert pools_full(server)
        # A write of the cancelled transfer's id, arriving now, writes nothing.
        decode = server.replicas[1].engine
        before = np.asarray(decode.kv_cache.k)
        copier = transfers._copier(0, 1)
        chunk = on_loop(server, 0, lambda: copier.read(np.arange(2)))
        stale = transfers.stale_writes
        on_loop(server, 1, lambda: transfers._land(1, copier, f"kv-in:{handle.id}:{t.tid}",
                                                   0, 2, chunk))
        assert transfers.stale_writes == stale + 1
        np.testing.assert_array_equal(np.asarray(decode.kv_cache.k), before)
        # And the pool still serves.
        assert server.generate(PROMPTS[0], GREEDY).token_ids == colocated_tokens[0]


def fail_steps_after(server, replica, request_steps):
    """From the replica's request_steps-th step on, every step fails (the device is
    gone): it goes down after 3."""
    engine = server.replicas[replica].engine
    dispatch, count = engine.dispatch, []

    def failing(batch):
        count.append(1)
        if len(count) > request_steps:
            raise RuntimeError("device lost")
        return dispatch(batch)
    engine.dispatch = failing
    return count


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_prefill_side_dies_mid_transfer_decode_side_keeps_what_arrived(colocated_tokens):
    """The prefill replica fails after 6 of the long prompt's 13 chunks: the request is
    re-run on the decode replica, which holds the pages that arrived as prefix cache and
    computes only the rest; greedy tokens unchanged; both pools full afterwards."""
    with Server(tiny_model(), engine_config=TINY_ENGINE, warmup=False, replicas=2,
                roles="prefill:1,decode:1") as server:
        fail_steps_after(server, 0, 6)
        out = server.submit(LONG, GREEDY).result(timeout=120)
        assert out.token_ids == colocated_tokens[3]
        assert out.metrics.replica == 1
        assert out.metrics.num_cached_tokens >= 4 * TINY_ENGINE.page_size
        assert pools_full(server)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_decode_side_dies_before_ack_pages_go_to_another_decode_replica(colocated_tokens):
    """prefill:1,decode:2; decode replica 1 dies as the hand-off reaches it: the prefill
    side still holds the pages and gives them to replica 2, without prefilling again;
    tokens unchanged; the live pools and the dead one's are full afterwards."""
    with Server(tiny_model(), engine_config=TINY_ENGINE, warmup=False, replicas=3,
                roles="prefill:1,decode:2") as server:
        transfers = server._replica_set.transfers
        hand, killed = transfers._hand, []

        def die():
            raise SystemExit("the decode replica's loop thread is gone")

        def hand_and_kill(t, tid):
            if not killed and t.decode == 1:
                killed.append(t.request_id)
                server.replicas[1].loop.call(die)
            return hand(t, tid)
        transfers._hand = hand_and_kill
        prefilled = []
        dispatch = server.replicas[0].engine.dispatch

        def counting(batch):
            prefilled.extend(c.num_tokens for c in batch.chunks)
            return dispatch(batch)
        server.replicas[0].engine.dispatch = counting
        out = server.submit(PROMPTS[2], GREEDY).result(timeout=120)
        assert killed and out.token_ids == colocated_tokens[2]
        assert out.metrics.replica == 2
        assert sum(prefilled) == len(PROMPTS[2].prompt_token_ids)      # prefilled once
        assert not server.replicas[1].loop.healthy
        assert pools_full(server)


@pytest.mark.parametrize("source, destination", [
    (dict(tp=1), dict(tp=2)), (dict(tp=2), dict(tp=1)), (dict(tp=1), dict(kvp=2)),
    (dict(kvp=2), dict(tp=2))])
def test_page_copier_moves_pages_between_meshes(source, destination):
    """Pages copied between replicas of different tp / kvp land bit-equal (the tiny
    model has 2 K/V heads, so tp in {1, 2} keeps the folded head axis's layout)."""
    from medha_jax.model import KVCache
    from meshes import ParallelConfig, make_mesh

    devices = jax.devices()
    src_par, dst_par = ParallelConfig(**source), ParallelConfig(**destination)
    base = tiny_model()
    src = Engine(base.on_mesh(make_mesh(src_par, devices[:src_par.num_devices])),
                 TINY_ENGINE)
    dst = Engine(base.on_mesh(make_mesh(dst_par, devices[4:4 + dst_par.num_devices])),
                 TINY_ENGINE)
    rng = np.random.default_rng(0)
    values = rng.standard_normal(src.kv_cache.k.shape).astype(np.float32)
    src.kv_cache = KVCache(*(jax.device_put(v.astype(src.kv_cache.k.dtype),
                                            src.kv_cache.k.sharding)
                             for v in (values, -values)))
    copier = PageCopier(src, dst)
    src_ids = np.array([3, 17, 4, 60, 61])
    dst_ids = np.array([100, 0, 5, 6, 127])
    copier.write(dst_ids, copier.read(src_ids))
    k, v = np.asarray(dst.kv_cache.k), np.asarray(dst.kv_cache.v)
    np.testing.assert_array_equal(k[:, dst_ids], values[:, src_ids])
    np.testing.assert_array_equal(v[:, dst_ids], -values[:, src_ids])
    untouched = np.setdiff1d(np.arange(k.shape[1]), dst_ids)
    assert not k[:, untouched].any()
    assert dst.kv_cache.k.sharding == dst._kv_cache_spec.k.sharding


def test_a_one_page_copy_never_rewrites_the_destination_cache():
    """One page is copied as two (padded_count), so the write stays a scatter in place: a
    one-row scatter became a select over a dynamic-update-slice of the whole cache."""
    import math

    from medha_jax import hlo
    from medha_jax.engine import EngineConfig
    from serving.kv_copy import gather_pages, padded_count, padded_ids, page_scatter

    assert [padded_count(n) for n in (1, 2, 3, 5)] == [2, 2, 4, 8]
    engine = Engine(tiny_model(), EngineConfig(page_size=16, num_pages=1024,
                                               max_tokens_per_step=16, max_seqs=8,
                                               max_model_len=256))
    cache = engine.kv_cache
    ids = padded_ids(np.array([7]), cache.num_pages)
    compiled = page_scatter(engine).lower(cache, ids, gather_pages(cache, ids)).compile()
    layer_bytes = math.prod(cache.k.shape[1:]) * cache.k.dtype.itemsize
    assert not hlo.copies(compiled.as_text(), min_bytes=layer_bytes)


class _InlineLoop:
    """A replica loop that runs posted calls at once and records added streams."""

    healthy, closing, down_reason = True, False, None

    def __init__(self):
        self.added = []
        self.thread = threading.current_thread()

    def call(self, fn):
        fn()
        return True

    def add(self, stream, held=(), *, kv_from=None, prefill_s=None):
        self.added.append(stream.request_id)


class _Set:
    """The ReplicaSet surface KVTransfers uses: two replicas' allocators and loops."""

    page_size = 16

    def __init__(self, pages):
        from types import SimpleNamespace

        from medha_jax.kv_cache.allocator import BlockAllocator
        self.replicas = [SimpleNamespace(engine=SimpleNamespace(
            allocator=BlockAllocator(n, 16)), loop=_InlineLoop()) for n in pages]
        self.reruns = []

    def rerun(self, stream, reason, colocated=None):
        self.reruns.append((stream.request_id, colocated))


def _stream(rid, prompt_len):
    from types import SimpleNamespace

    from medha_jax.request import Request
    request = Request(request_id=rid, prompt_len=prompt_len, max_new_tokens=4,
                      arrival_time=0.0, prompt_token_ids=list(range(1, prompt_len + 1)))
    return SimpleNamespace(request=request, request_id=rid)


def _handshakes_on_a_decode_side_with_4_free_pages():
    """(replica set, the decode side's allocator, KVTransfers): replica 1 has 10 pages, 6
    of them taken by "blocker"; handshakes time out after 5 s; no sweeping thread."""
    from serving.kv_transfer import DisaggConfig, KVTransfers

    replica_set = _Set([64, 10])
    decode = replica_set.replicas[1].engine.allocator
    decode.allocate("blocker")
    assert decode.reserve("blocker", 6 * 16)
    transfers = KVTransfers(replica_set, DisaggConfig(handshake_timeout_s=5.0,
                                                      sweep_interval_s=None))
    return replica_set, decode, transfers


def test_handshakes_are_granted_in_arrival_order_and_time_out_to_colocated():
    """The decode side has 10 pages, 6 taken: A (8 pages) waits, and B (2 pages), which
    would fit, waits behind it; when the pages come back both are granted, A first, and
    only then reach the prefill replica. A handshake past its timeout goes co-located and
    its reservation is never taken. (A prompt's partial last page is reserved too.)"""
    replica_set, decode, transfers = _handshakes_on_a_decode_side_with_4_free_pages()
    transfers.begin(_stream("A", 7 * 16 + 3), 0, 1)
    transfers.begin(_stream("B", 16 + 3), 0, 1)
    assert replica_set.replicas[0].loop.added == []
    assert decode.num_free_pages == 4                    # B did not pass A
    decode.free("blocker")
    transfers._settle(1)
    assert replica_set.replicas[0].loop.added == ["A", "B"]
    assert decode.num_free_pages == 0
    # C waits for pages no one gives back: past its timeout it runs co-located.
    transfers.begin(_stream("C", 16 + 3), 0, 1)
    transfers.sweep(time.monotonic() + 6.0)
    assert replica_set.reruns == [("C", 0)]
    assert transfers.in_flight == 2                     # A and B stream on
    for rid in ("A", "B"):
        transfers._abort(transfers._by_id[rid])
    assert decode.num_free_pages == 10 and transfers.in_flight == 0


def test_a_mixed_prefill_replica_starts_at_once_and_decodes_itself_if_the_grant_is_late():
    """start_now (a mixed prefill replica): the request reaches the prefill loop before the
    decode side grants its pages, so the handshake's wait is not in its TTFT. Prefilled
    before the grant, it decodes where it prefilled, and the late grant takes no page;
    past the handshake's timeout it is not re-run (it is served already). Granted in
    time, it streams as before and is added to the prefill loop once."""
    replica_set, decode, transfers = _handshakes_on_a_decode_side_with_4_free_pages()
    a = _stream("A", 8 * 16 + 3)
    transfers.begin(a, 0, 1, start_now=True)
    assert replica_set.replicas[0].loop.added == ["A"]         # before any grant
    assert decode.num_free_pages == 4
    assert transfers.on_prefilled(0, a) is False               # decode on the prefill side
    assert transfers.in_flight == 0
    decode.free("blocker")
    transfers._settle(1)
    assert decode.num_free_pages == 10                          # the late grant took nothing
    # Waiting past the timeout: dropped, not re-run.
    decode.allocate("blocker")
    assert decode.reserve("blocker", 9 * 16)
    transfers.begin(_stream("B", 2 * 16 + 3), 0, 1, start_now=True)
    transfers.sweep(time.monotonic() + 6.0)
    assert replica_set.reruns == [] and transfers.in_flight == 0
    decode.free("blocker")
    transfers._settle(1)
    # Granted at once: streams, added to the prefill loop only by begin.
    transfers.begin(_stream("C", 2 * 16), 0, 1, start_now=True)
    assert transfers._by_id["C"].state == "streaming"
    assert replica_set.replicas[0].loop.added == ["A", "B", "C"]
    assert decode.num_free_pages == 8
    # A client cancel while it waits for its grant leaves the stream to the prefill loop.
    decode.allocate("blocker")
    assert decode.reserve("blocker", 8 * 16)
    transfers.begin(_stream("D", 2 * 16 + 3), 0, 1, start_now=True)
    assert transfers.cancel("D") is False and transfers.in_flight == 1
    transfers._abort(transfers._by_id["C"])
    decode.free("blocker")
    transfers._settle(1)
    assert decode.num_free_pages == 10 and transfers.in_flight == 0


def test_warm_up_compiles_every_copy_shape_and_changes_no_page():
    from medha_jax.model import KVCache
    from serving.kv_copy import gather_pages, page_scatter, warm_up

    base = tiny_model()
    engines = [Engine(base.on_mesh(jax.sharding.Mesh(np.array([d]).reshape(
        base.mesh.devices.shape), base.mesh.axis_names)), TINY_ENGINE)
        for d in jax.devices()[2:4]]
    values = np.random.default_rng(1).standard_normal(
        engines[0].kv_cache.k.shape).astype(np.float32)
    for engine in engines:
        engine.kv_cache = KVCache(*(jax.device_put(v, engine.kv_cache.k.sharding)
                                    for v in (values, values)))
    scatters = [page_scatter(e) for e in engines]
    assert [warm_up(e, s, 16) for e, s in zip(engines, scatters)] == [4, 4]   # 2 .. 16
    for engine in engines:
        np.testing.assert_array_equal(np.asarray(engine.kv_cache.k), values)
    compiled = (gather_pages._cache_size(), scatters[1]._cache_size())
    copier = PageCopier(engines[0], engines[1], scatters[1])
    copier.write(np.arange(9), copier.read(np.arange(20, 29)))      # 9 -> 16 pages
    assert (gather_pages._cache_size(), scatters[1]._cache_size()) == compiled
    np.testing.assert_array_equal(np.asarray(engines[1].kv_cache.k)[:, :9], values[:, 20:29])


def test_h8_spread_puts_each_heavy_sessions_cold_tokens_in_a_later_turn():
    from benchmarks.disagg import parse_args, session_plan

    args = parse_args(["--heavy-turn", "spread", "--turns", "4", "--heavy-tokens", "1024",
                       "--heavy-every", "3"])
    plans = [session_plan(args, i) for i in range(12)]
    assert [heavy for _, heavy in plans] == [1, None, None, 2, None, None, 3, None, None, 1,
                                             None, None]
    for plan, heavy in plans:
        assert plan[0] == args.warm_tokens                  # every session begins WARM
        assert [k for k, n in enumerate(plan) if n == 1024] == ([] if heavy is None
                                                                 else [heavy])
    first = parse_args(["--turns", "4", "--heavy-tokens", "1024"])
    assert session_plan(first, 0) == ([1024, 32, 32, 32], 0)     # seed 003's H8
    assert session_plan(first, 1) == ([64, 32, 32, 32], None)


def test_h8_makes_the_heavy_turns_long_to_lars_mp_and_the_other_sessions_short():
    """IsLong (Algorithm 2) at half the HEAVY turn: seed 000's 8192 is past the engine's
    max_model_len, where no prompt would be long and no short prefill would ride."""
    from benchmarks.disagg import engine_config, parse_args, scheduler_config

    args = parse_args(["--turns", "4", "--heavy-tokens", "1024", "--output-tokens", "32"])
    long_tokens = scheduler_config(args).long_prefill_tokens
    assert long_tokens < engine_config(False).max_model_len
    # A HEAVY turn is long; a session without one reaches 64 + 3 x (32 + 32) tokens.
    assert args.warm_tokens + 3 * (args.turn_tokens + args.output_tokens) < long_tokens < 1024


def test_a_ray_prefill_started_before_its_grant_offers_nothing_and_decodes_here_if_late():
    """serving.ray_handoff on a mixed prefill actor (start_page None): no page offered and
    no hold before the grant; a first token before it keeps the request here (the loop's
    hook says no hand-off); a grant that comes after is dropped at the ack timeout; a
    grant that comes first sets where the offers start."""
    from types import SimpleNamespace

    from serving.kv_transfer import DisaggConfig
    from serving.ray_handoff import ReplicaHandoffs

    engine = Engine(tiny_model(), TINY_ENGINE)
    loop = SimpleNamespace()
    replica = SimpleNamespace(engine=engine, loop=loop, step_hooks=[],
                              controller=SimpleNamespace(get=lambda internal: None))
    handoffs = ReplicaHandoffs(replica, DisaggConfig(ack_timeout_s=5.0))
    pushed = []
    handoffs.expect("A", "a", list(range(1, 41)), None, 2, pushed.append)
    stream = SimpleNamespace(request_id="a", request=None)
    assert loop.on_prefilled(stream) is False              # decodes here
    assert pushed == [] and handoffs.in_flight == 0
    handoffs.grant("A", 0)                                 # late: nobody takes it
    handoffs.sweep(time.monotonic())
    assert "A" in handoffs._grants
    handoffs.sweep(time.monotonic() + 6.0)
    assert handoffs._grants == {}
    handoffs.expect("B", "b", list(range(1, 41)), None, 2, pushed.append)
    handoffs.grant("B", 1)
    out = handoffs._outgoing["B"]
    assert out.sent is None and handoffs._granted("B", out) and out.sent == 1
    assert handoffs._grants == {}


def test_decodes_on_their_way_count_in_the_decode_sides_batch():
    """The offload decision prices a decode replica's step with the decodes already handed
    to it and not running there yet, so offloads decided during one long prefill do not
    all pile onto the same idle replica."""
    replica_set, decode, transfers = _handshakes_on_a_decode_side_with_4_free_pages()
    decode.free("blocker")
    transfers.begin(_stream("A", 2 * 16 + 3), 0, 1)
    transfers.begin(_stream("B", 16 + 3), 0, 1)
    assert transfers.incoming_contexts(1) == (35, 19)
    assert transfers.incoming_contexts(0) == ()
    transfers._abort(transfers._by_id["A"])
    assert transfers.incoming_contexts(1) == (19,)
