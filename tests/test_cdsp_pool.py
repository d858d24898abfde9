"""The CDSP prefill pool on devices (seed 001, Tetris; medha_jax.engine.cdsp_pool): chunks on
nested groups of 2, 4 and 8 devices with the history balanced between them give one
device's logits, the balancing moves exactly the pages the HLO sends, and the prompt's K/V
handed to a tp=2 decode replica (serving.pool_handoff) continue it with one device's greedy
tokens.
"""

import threading

import numpy as np
import pytest

from medha_jax import hlo
from medha_jax.engine import EngineConfig
from medha_jax.engine.cdsp_pool import (MOVE_SCOPE, CdspPool, PoolConfig, aligned_groups, balance_rounds,
                                        chunk_counts, group_of, zigzag_offsets)
from medha_jax.model import load_model
from medha_jax.sampling_params import SamplingParams
from medha_jax.scheduler.cdsp import CdspConfig, CdspScheduler, LatencyModel
from meshes import ParallelConfig, make_mesh
from serving.pool_handoff import hand_off
from serving.server import Server, TokensPrompt
from tests.test_replicas import tiny_model

PAGE = 8
CONFIG = PoolConfig(page_size=PAGE, pages_per_device=8, rank_token_buckets=(16,))


def balanced(total: int, ranks: int, rng) -> np.ndarray:
    """floor or ceil of total / ranks each, the ceil ones anywhere."""
    counts = np.full(ranks, total // ranks)
    counts[rng.permutation(ranks)[:total % ranks]] += 1
    return counts


def is_balanced(counts) -> bool:
    counts = np.asarray(counts)
    total, k = counts.sum(), len(counts)
    return set(counts.tolist()) <= {total // k, -(-total // k)}


def test_chunk_placement_and_balancing_keep_every_rank_at_floor_or_ceil():
    """Random histories, chunks and aligned growths of pools of 1..16: a chunk's counts
    leave the group balanced and its zigzag offsets cover the chunk once; balancing's rounds
    are permutations (one message per rank each way), fixed by the two groups, and leave
    the new group balanced with the same tokens."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        pool = int(rng.choice([1, 2, 4, 8, 16]))
        groups = aligned_groups(pool)
        old = groups[rng.integers(len(groups))]
        cached = balanced(int(rng.integers(0, 300)), old[1], rng)
        tokens = int(rng.integers(1, 200))
        counts = chunk_counts(cached, tokens)
        assert counts.min() >= 0 and counts.sum() == tokens and is_balanced(cached + counts)
        offsets = zigzag_offsets(counts)
        assert [len(o) for o in offsets] == counts.tolist()
        assert np.array_equal(np.sort(np.concatenate(offsets)), np.arange(tokens))
        history = cached + counts
        bigger = [g for g in groups if g[0] <= old[0] and old[0] + old[1] <= g[0] + g[1]]
        new = bigger[rng.integers(len(bigger))]
        rounds = balance_rounds(history, old, new)
        held = np.zeros(new[1], np.int64)
        held[old[0] - new[0]:old[0] - new[0] + old[1]] = history
        for moves in rounds:
            sources, destinations = [m[0] for m in moves], [m[1] for m in moves]
            assert len(set(sources)) == len(sources) and len(set(destinations)) == len(moves)
            for source, destination, count in moves:
                held[source] -= count
                held[destination] += count
        assert held.sum() == history.sum() and held.min() >= 0 and is_balanced(held)
        pattern = [[(s, d) for s, d, _ in m] for m in rounds]
        other = balance_rounds(balanced(int(history.sum()) + 7, old[1], rng), old, new)
        assert pattern == [[(s, d) for s, d, _ in m] for m in other]


def test_groups_that_shrink_or_are_not_aligned_blocks_are_refused():
    with pytest.raises(ValueError, match="does not contain"):
        balance_rounds(np.array([4, 4, 4, 4]), (0, 4), (0, 2))
    with pytest.raises(ValueError, match="not one aligned block"):
        group_of((0, 2), 8)
    with pytest.raises(ValueError, match="aligned power-of-two block"):
        group_of((1, 2), 8)
    with pytest.raises(ValueError, match="aligned power-of-two block"):
        group_of((4, 5, 6), 8)
    with pytest.raises(ValueError, match="not balanced"):
        chunk_counts(np.array([0, 9]), 1)


def moves_overlap_the_projections(hlo_text: str) -> None:
    """In the layer scan's body, every balancing permute and the layer's Q/K/V projections
    need nothing of each other: a device may run them at once (on the CPU collectives are
    synchronous, so this order is what can be checked here)."""
    body = [instrs for instrs in hlo.scheduled_instructions(hlo_text).values()
            if any(MOVE_SCOPE in i.scope and i.op == "collective-permute" for i in instrs)]
    assert body, "no balancing permute in the step"
    for instrs in body:
        permutes = [i for i in instrs if i.op == "collective-permute" and MOVE_SCOPE in i.scope]
        projections = [i for i in instrs if "td,dhk->thk" in i.scope]     # llama's einsum
        assert projections, "no Q/K/V projection beside the permutes"
        for p in permutes:
            assert not hlo.depends_on(instrs, p.name, lambda i: i in projections)
        for q in projections:
            assert not hlo.depends_on(instrs, q.name, lambda i: i in permutes)


def greedy(model, ids: list[int], n: int) -> list[int]:
    """One device's greedy tokens by whole forwards (the oracle)."""
    out = list(ids)
    for _ in range(n):
        out.append(int(model.logits(out)[-1].argmax()))
    return out[len(ids):]


def on_loop(server, fn):
    done, out = threading.Event(), []

    def run():
        try:
            out.append(fn())
        except Exception as e:       # noqa: BLE001 - raised on the test's thread below
            out.append(e)
        finally:
            done.set()
    assert server.replicas[0].loop.call(run)
    assert done.wait(120)
    if isinstance(out[0], Exception):
        raise out[0]
    return out[0]


@pytest.fixture(scope="module")
def one_device():
    return load_model("tiny", verbose=False)


@pytest.fixture(scope="module")
def pool():
    return CdspPool(load_model("tiny", parallel=ParallelConfig(cp=8), verbose=False), CONFIG)


@pytest.mark.slow
def test_chunks_on_2_4_8_devices_give_one_device_then_decode_on_tp2(one_device, pool):
    """The issue's case: chunk 1 on 2 devices, chunk 2 on 4, chunk 3 on 8, balanced before
    each growth. Logits of every prompt token within 1e-4 of one device; after each
    balancing every device holds floor or ceil of the history; the balancing programs'
    collective-permutes carry exactly the moved pages; nothing compiles after warm-up; then
    the K/V move to a tp=2 decode replica, which serves the one-device greedy tokens taking
    every full prompt page from the pool; both pools end full."""
    ids = [int(t) for t in np.random.default_rng(3).integers(1, 256, 131)]
    want_logits = one_device.logits(ids)
    want_tokens = greedy(one_device, ids, 8)
    free = pool.num_free_pages
    plan = [(32, (0, 2)), (32, (0, 4)), (67, (0, 8))]
    keys = pool.keys_for(len(ids), plan) + [("gather", (0, 8), 4)]     # 17 tokens a rank
    pool.warmup(keys)
    compiled = len(pool.executables)
    pool.add("x", ids[:40])          # a program not warmed up: refused, nothing booked
    with pytest.raises(RuntimeError, match="not compiled at warm-up"):
        pool.prefill_chunk("x", 40, (0, 4))
    assert pool.held_tokens("x") == {} and pool.num_free_pages == free
    pool.release("x")

    pool.add("p", ids)
    got, start, seen = [], 0, []
    for tokens, group in plan:
        devices = range(group[0], group[0] + group[1])
        moved = pool.moved_pages
        got.append(pool.prefill_chunk("p", tokens, group))
        held = [pool.held_tokens("p").get(d, 0) for d in devices]
        assert is_balanced(held) and sum(held) == start + tokens
        if start:     # the step balanced first: its moves sent the moved pages, no more
            text = pool.executables[keys[len(seen)]].as_text()
            sent = sum(c.bytes * c.pairs * c.count for c in hlo.collectives(text)
                       if c.op == "collective-permute" and MOVE_SCOPE in c.scope)
            assert sent == (pool.moved_pages - moved) * pool.page_bytes > 0
            moves_overlap_the_projections(text)
        seen.append(group)
        start += tokens
    assert pool.moved_pages == 2 + 4       # 16 tokens from 2 ranks, 32 from 4: whole pages
    logits = np.concatenate(got)
    np.testing.assert_allclose(logits, want_logits, atol=1e-4, rtol=0)
    first = int(logits[-1].argmax())
    assert first == want_tokens[0]
    assert len(pool.executables) == compiled

    decode_model = tiny_model().on_mesh(make_mesh(ParallelConfig(tp=2)))
    decode_model.tokenizer = tiny_model().tokenizer
    engine = EngineConfig(page_size=PAGE, max_kv_tokens=512, max_model_len=256,
                          max_tokens_per_step=32, min_token_bucket=16, max_seqs=4)
    with Server(decode_model, engine_config=engine, warmup=False, cache_dir=False) as decode:
        allocator = decode.replicas[0].engine.allocator
        reservation, pages = on_loop(decode, lambda: hand_off(
            pool, "p", decode.replicas[0].engine, "p"))
        assert pages == len(ids) // PAGE
        out = decode.generate([TokensPrompt(ids + [first])],
                              SamplingParams(temperature=0.0, max_tokens=7))[0]
        on_loop(decode, lambda: allocator.free(reservation))
        assert [first, *out.token_ids] == want_tokens
        assert out.metrics.num_cached_tokens == pages * PAGE
        assert allocator.num_free_pages == allocator.num_pages
    pool.release("p")
    assert pool.num_free_pages == free


@pytest.mark.slow
def test_a_scheduler_plan_from_one_device_up_runs_exactly(one_device, pool):
    """A CdspScheduler plan over the pool (aligned groups; Eq. 1 models at this tiny scale:
    time linear in tokens over SP) for a pool whose devices free up at three times runs as
    planned, 2 then 4 then 8 devices; and a hand-made plan starting on one device (the
    causal one-shard path, then balanced to 2) with odd chunk sizes gives one device's
    logits."""
    models = {s: LatencyModel(s, 0.001, 0.01 / s, 0.0, 0.0) for s in (1, 2, 4, 8)}
    scheduler = CdspScheduler(8, models, CdspConfig(aligned=True, min_chunk_tokens=16,
                                                    chunk_multiple=8, sp_sizes=(1, 2, 4, 8)))
    plan = scheduler.plan(100, [0.0, 0.0, 0.1, 0.1, 0.15, 0.15, 0.15, 0.15])
    assert plan.sp_sizes == (2, 4, 8)
    ids = [int(t) for t in np.random.default_rng(4).integers(1, 256, 100)]
    pool.warmed_up = False            # compile as it goes: this test is about exactness
    pool.add("q", ids)
    last = pool.prefill("q", [(c.tokens, c.group) for c in plan.chunks])
    np.testing.assert_allclose(last, one_device.logits(ids)[-1], atol=1e-4, rtol=0)
    pool.release("q")

    ids = [int(t) for t in np.random.default_rng(5).integers(1, 256, 47)]
    pool.add("r", ids)
    got = [pool.prefill_chunk("r", n, g) for n, g in [(1, (2, 1)), (15, (2, 1)),
                                                       (17, (2, 2)), (14, (0, 4))]]
    np.testing.assert_allclose(np.concatenate(got), one_device.logits(ids), atol=1e-4, rtol=0)
    assert is_balanced(list(pool.held_tokens("r").values()))
    pool.release("r")
    assert pool.num_free_pages == 8 * CONFIG.pages_per_device


@pytest.mark.slow
def test_after_warming_up_every_program_no_plan_compiles(one_device):
    """`warmup(program_keys())` on a pool of 2 devices compiles every program a plan can
    need (chunks on each block, balancing from each block inside a larger one, gathers, at
    every bucket; a non-strict warm-up first, as a background one, leaves the pool
    compiling what it lacks): then random plans - a first chunk on either device or on both, growing
    to both or not, chunks of any length - run with no compile, give one device's logits,
    gather their K/V for a hand-off, and give back every page."""
    small = PoolConfig(page_size=PAGE, pages_per_device=2, rank_token_buckets=(16,))
    pool = CdspPool(load_model("tiny", parallel=ParallelConfig(cp=2), verbose=False), small)
    keys = pool.program_keys()
    assert len(keys) == len(set(keys)) == 3 * 2 + 2 * 3 + 3 * 2    # chunks, balancing, gathers
    assert pool.warmup(keys[:3], strict=False) == 3 and not pool.warmed_up  # (in background)
    assert pool.warmup(keys) == len(keys) - 3 and pool.warmed_up
    rng = np.random.default_rng(6)

    def split(tokens: int, most: int) -> list[int]:
        """tokens as 1..most chunks of random lengths."""
        cuts = rng.choice(np.arange(1, tokens), size=min(int(rng.integers(0, most)),
                                                         tokens - 1), replace=False)
        return np.diff([0, *sorted(cuts), tokens]).tolist()

    grew = set()
    for i in range(10):
        length = int(rng.integers(2, 21))
        first = [(0, 1), (1, 1), (0, 2)][i % 3]
        # At most a page on one device: balancing a second page away would need a third.
        alone = int(rng.integers(1, min(PAGE, length) + 1)) if first[1] == 1 else 0
        on_first = split(alone, 2) if alone else []
        on_both = split(length - alone, 2) if length > alone else []
        sizes, groups = on_first + on_both, [first] * len(on_first) + [(0, 2)] * len(on_both)
        grew.add(bool(on_first and on_both))
        ids = [int(t) for t in rng.integers(1, 256, length)]
        pool.add(f"s{i}", ids)
        got = [pool.prefill_chunk(f"s{i}", n, g) for n, g in zip(sizes, groups)]
        np.testing.assert_allclose(np.concatenate(got), one_device.logits(ids), atol=1e-4,
                                   rtol=0)
        pool.prompt_kv(f"s{i}", 0, length // PAGE * PAGE)
        pool.release(f"s{i}")
    assert grew == {True, False}
    assert len(pool.executables) == len(keys)
    assert pool.num_free_pages == 2 * small.pages_per_device
