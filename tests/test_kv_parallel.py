"""KV-cache parallelism (seed 000 section 3.3): each KV shard attends its own pages, merged
exactly by log-sum-exp; the compiled step moves no KV cache between devices."""

import numpy as np
import pytest

from medha_jax import ParallelConfig, load_model
from tests.hf_oracle import greedy_with_logits

# Every kvp degree on 8 devices (2 and 4 with tp, 8 alone): contexts over one, two and all shards.
KVP_MESHES = [ParallelConfig(kvp=8), ParallelConfig(kvp=2, tp=2), ParallelConfig(kvp=4, tp=2)]


@pytest.fixture(scope="module")
def prompt_and_logits():
    ids = np.random.default_rng(5).integers(0, 256, size=120).tolist()
    return ids, load_model("tiny", verbose=False).logits(ids)


@pytest.mark.parametrize("parallel", KVP_MESHES, ids=str)
def test_logits_equal_one_device_for_contexts_over_one_two_and_all_shards(prompt_and_logits,
                                                                           parallel):
    ids, expected = prompt_and_logits
    model = load_model("tiny", parallel=parallel, verbose=False)
    kvp = parallel.kvp
    # Chunks cross shard boundaries (every 16 tokens at the smallest), then three decodes.
    chunks = [20, 30, 1, 17, 29, 20, 1, 1, 1]
    for per_shard, what in [(128, "one shard"), (64, "two shards"),
                            (-(-120 // (16 * kvp)) * 16, "all shards")]:
        if per_shard * kvp < 120:
            continue
        got = model.logits(ids, chunk_sizes=chunks, kv_tokens_per_shard=per_shard)
        np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0, err_msg=what)
        assert (got.argmax(-1) == expected.argmax(-1)).all(), what


_TPU_KERNEL_KVP = """
import functools
import numpy as np
from medha_jax import ParallelConfig, load_model
from medha_jax.model.attention import AttentionMetadata, _attend_own_tokens
from pallas_kernels import ragged_paged_attention
from pallas_kernels.dense_reference import dense_attention_oracle
from tests.attention_checks import assert_attention_close

ids = np.random.default_rng(5).integers(0, 256, size=32).tolist()
want = load_model("tiny", verbose=False).logits(ids)
model = load_model("tiny", parallel=ParallelConfig(kvp=2), attention_impl="interpret-tpu",
                   verbose=False)
# 16 tokens a shard: the second chunk crosses into shard 1, the third chunk and the decode
# read a prefix on both; every chunk pads to 16 tokens (one compile).
got = model.logits(ids, chunk_sizes=[12, 12, 7, 1], kv_tokens_per_shard=16)
np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
assert (got.argmax(-1) == want.argmax(-1)).all()

# The own tokens of several sequences on the kernel: a chunk over three 8-token pages, a
# decode, a chunk starting mid-page in the step; padding tokens and sequence slots after.
rng = np.random.default_rng(7)
num_tokens, max_seqs, q_lens = 40, 6, [19, 1, 9]
cu = np.full(max_seqs + 1, sum(q_lens), np.int32)
cu[1:len(q_lens) + 1] = np.cumsum(q_lens)
num_seqs = np.array([len(q_lens)], np.int32)
q = rng.standard_normal((num_tokens, 4, 8)).astype(np.float32)
k, v = (rng.standard_normal((num_tokens, 2, 8)).astype(np.float32) for _ in "kv")
meta = AttentionMetadata(slot_mapping=None, page_table=None, cu_q_lens=cu, kv_lens=None,
                         num_seqs=num_seqs)
attend = functools.partial(ragged_paged_attention, sm_scale=0.3, impl="interpret-tpu")
out, lse = _attend_own_tokens(q, k, v, meta, attend, 8)
# The definition: every token a one-token page, sequence s's pages its own tokens.
own = np.minimum(cu[:-1, None] + np.arange(num_tokens), num_tokens - 1)
assert_attention_close(out, lse, *dense_attention_oracle(
    q, k[:, None], v[:, None], own, cu, np.diff(cu), num_seqs, sm_scale=0.3))
print("ok")
"""


@pytest.mark.slow
def test_kvp_runs_on_the_tpu_kernel_with_the_one_device_tokens():
    """The Mosaic-TPU kernel needs pages of whole 8-row tiles, so the step's own tokens go
    to it in pages of the cache's size, not one token each (model/attention.py). In the
    TPU interpreter, on 2 devices (tests.attention_checks.run_on_devices)."""
    from tests.attention_checks import run_on_devices

    assert run_on_devices(_TPU_KERNEL_KVP, 2).split()[-1] == "ok"


# ------------------------------------------------------------------------ through the engine

def kvp_engine(parallel, *, pages_per_shard=16, tokens_per_shard=48, prefix_caching=True):
    from medha_jax.engine import Engine, EngineConfig

    model = load_model("tiny", parallel=parallel, verbose=False)
    # One token rung (64): chunks of any size and decodes share a step shape, so a test
    # compiles one or two shapes, not three token rungs of each.
    return Engine(model, EngineConfig(page_size=16, num_pages=pages_per_shard,
                                      max_tokens_per_step=64, min_token_bucket=64, max_seqs=8,
                                      max_tokens_per_kvp_group=tokens_per_shard,
                                      enable_prefix_caching=prefix_caching))


def prompts_and_reference(rng):
    """Prompts that span one, two and three 48-token shards, with a shared 32-token prefix
    between the last two (prefix reuse across shards), and their one-device greedy tokens."""
    shared = rng.integers(0, 256, 32).tolist()
    prompts = {"short": rng.integers(0, 256, 20).tolist(),
               "two": rng.integers(0, 256, 70).tolist(),
               "three": shared + rng.integers(0, 256, 90).tolist(),
               "three-again": shared + rng.integers(0, 256, 85).tolist()}
    one_device = load_model("tiny", verbose=False)
    reference = {rid: greedy_with_logits(one_device, p, 5) for rid, p in prompts.items()}
    return prompts, reference


# kvp = 4 alone is covered by the logits tests and test_compiled_step_moves_no_kv_cache...
@pytest.mark.parametrize("parallel", [ParallelConfig(kvp=4, tp=2)], ids=str)
def test_engine_tokens_equal_one_device_with_chunks_across_shards(parallel):
    from tests.test_engine import drive, make_request

    engine = kvp_engine(parallel)
    rng = np.random.default_rng(6)
    prompts, reference = prompts_and_reference(rng)
    arrivals = [(0, make_request("short", prompts["short"], 5)),
                (0, make_request("two", prompts["two"], 5)),
                (0, make_request("three", prompts["three"], 5)),
                (30, make_request("three-again", prompts["three-again"], 5))]
    done = drive(engine, arrivals, rng=rng, max_chunk=40)
    assert done == reference
    assert engine.allocator.num_free_pages == engine.allocator.num_pages   # every pool refilled
    for shard in range(4):
        assert engine.allocator.num_free_pages_on(shard) == 16


def controller_over(engine):
    from medha_jax.request import WallClock
    from medha_jax.scheduler import AnalyticalPredictor, SchedulerConfig, make_controller

    return make_controller(
        SchedulerConfig("lars", token_buckets=engine.ladder.token_buckets,
                        max_seqs_per_batch=engine.max_seqs),
        allocator=engine.allocator, clock=WallClock(),
        predictor=AnalyticalPredictor(engine.model.config, hardware="h100",
                                      token_buckets=engine.ladder.token_buckets),
        model_config=engine.model.config, max_model_len=engine.max_model_len)


def test_a_request_longer_than_one_shard_is_served_at_kvp4_and_refused_at_kvp1():
    from medha_jax.scheduler.controller import run_one_step
    from tests.test_engine import make_request

    prompt = np.random.default_rng(7).integers(0, 256, 150).tolist()    # > one 128-token pool
    want = greedy_with_logits(load_model("tiny", verbose=False), prompt, 4)
    for kvp in (1, 4):
        engine = kvp_engine(ParallelConfig(kvp=kvp), pages_per_shard=8, tokens_per_shard=None)
        controller = controller_over(engine)
        if kvp == 1:
            with pytest.raises(ValueError, match="max_model_len=128"):
                controller.check_fits(len(prompt), 4)
            continue
        request = make_request("long", prompt, 4)
        controller.add_request(request)
        while controller.has_unfinished():
            run_one_step(controller, engine)
        assert request.output_token_ids == want
        assert engine.allocator.num_free_pages == engine.allocator.num_pages


def test_preemption_mid_prefill_reuses_its_prefix_across_shards():
    from medha_jax.request import Batch, ScheduledChunk
    from tests.test_engine import make_request

    prompt = np.random.default_rng(8).integers(0, 256, 150).tolist()
    want = greedy_with_logits(load_model("tiny", verbose=False), prompt, 4)
    engine = kvp_engine(ParallelConfig(kvp=4), pages_per_shard=8, tokens_per_shard=48)
    allocator = engine.allocator
    request = make_request("r", prompt, 4)

    def run(start, n):
        assert allocator.reserve("r", start + n)
        result = engine.execute(Batch([ScheduledChunk(request, start, n)]))
        request.num_computed_tokens = start + n
        allocator.commit("r", request.token_ids(0, start + n), start + n)
        return result

    assert allocator.allocate("r", prompt) == 0
    run(0, 60)
    run(60, 40)                                   # 100 tokens over 3 shards (48 each)
    allocator.free("r")                           # recompute preemption
    assert allocator.num_free_pages == allocator.num_pages
    reused = allocator.allocate("r", prompt)      # its full pages are still cached
    assert reused == 96 and len({s.shard for s in allocator.segments("r")}) == 2
    result = run(reused, 150 - reused)
    while len(request.output_token_ids) < 4:
        request.output_token_ids.append(result.sampled_token_ids["r"])
        if len(request.output_token_ids) < 4:
            result = run(request.num_tokens - 1, 1)
    assert request.output_token_ids == want
    allocator.free("r")
    assert [allocator.num_free_pages_on(s) for s in range(4)] == [8, 8, 8, 8]


def collectives_of_decode_step(parallel, pages_per_shard):
    from medha_jax import hlo

    engine = kvp_engine(parallel, pages_per_shard=pages_per_shard,
                        tokens_per_shard=pages_per_shard * 16)
    compiled = engine.executable((16, 8, engine.ladder.width_buckets[0]))
    return sorted((c.op, c.shape, c.count) for c in hlo.collectives(compiled.as_text()))


@pytest.mark.parametrize("parallel", [ParallelConfig(kvp=2, tp=2), ParallelConfig(kvp=4)],
                         ids=str)
def test_compiled_step_moves_no_kv_cache_between_devices(parallel):
    small = collectives_of_decode_step(parallel, pages_per_shard=16)
    large = collectives_of_decode_step(parallel, pages_per_shard=64)
    # The same collectives of the same sizes whatever the cache holds: only [tokens, heads]
    # partial outputs and LSE weights (and tp's activations) cross devices, never pages.
    assert small == large
    # Inside the layer scan (2 layers: count 2) only all-reduces run: the KV-shard merge of
    # [tokens, heads] LSE weights and [tokens, heads, head_dim] outputs, and tp's activations.
    # The rest run once per step on [seqs, vocab] logits (sampling over the tp-sharded vocab).
    per_layer = [(op, shape) for op, shape, count in small if count == 2]
    assert per_layer and all(op == "all-reduce" for op, _ in per_layer), per_layer
    assert any("[16,4,16]" in shape or "[16,8,16]" in shape for _, shape in per_layer)


def test_default_segment_is_the_longest_request_spread_over_the_shards():
    """EngineConfig's progressive-scaling default: ceil(max_model_len / kvp) rounded up to a
    page, max_model_len capped by the whole cache; the field, when set, wins."""
    from medha_jax.engine import EngineConfig

    config = EngineConfig(page_size=16, num_pages=64)           # a 1024-token pool a shard
    assert config.tokens_per_kvp_group(2048, kvp=1) == 1024     # one shard: its pool,
    assert config.tokens_per_kvp_group(256, kvp=1) == 1024      # whatever the model's length
    assert config.tokens_per_kvp_group(256, kvp=2) == 128
    assert config.tokens_per_kvp_group(250, kvp=4) == 64        # 62.5 -> a whole page
    assert config.tokens_per_kvp_group(1000, kvp=3) == 336
    assert config.tokens_per_kvp_group(8192, kvp=2) == 1024     # cache-bound: the pool
    assert config.tokens_per_kvp_group(2048, kvp=2, cp=2) == 1024   # 32-token pages, 2048 a pool
    assert EngineConfig(page_size=16, num_pages=64, max_tokens_per_kvp_group=48) \
        .tokens_per_kvp_group(256, kvp=2) == 48
    with pytest.raises(ValueError, match="EngineConfig.max_tokens_per_kvp_group must be >= 1"):
        EngineConfig(max_tokens_per_kvp_group=0)


def test_default_config_spreads_a_long_request_over_both_shards_at_kvp2():
    """With max_tokens_per_kvp_group left at its default, a kvp = 2 engine keeps a short
    request on one shard and spreads a long one over both (before, a request filled a
    shard's whole 512-token pool first, so both stayed on one shard), with the tokens of one
    device; the widest page table of the bucket ladder is one segment's."""
    from medha_jax.engine import Engine, EngineConfig
    from medha_jax.scheduler.controller import run_one_step
    from tests.test_engine import make_request

    engine = Engine(load_model("tiny", parallel=ParallelConfig(kvp=2), verbose=False),
                    EngineConfig(page_size=16, num_pages=32, max_model_len=256,
                                 max_tokens_per_step=64, min_token_bucket=64, max_seqs=4))
    allocator = engine.allocator
    assert allocator.max_tokens_per_shard == 128 and engine.max_model_len == 256
    assert engine.ladder.max_pages_per_seq == 128 // 16
    rng = np.random.default_rng(9)
    prompts = {"long": rng.integers(0, 256, 200).tolist(),
               "short": rng.integers(0, 256, 40).tolist()}
    one_device = load_model("tiny", verbose=False)
    want = {rid: greedy_with_logits(one_device, p, 2) for rid, p in prompts.items()}
    controller = controller_over(engine)
    requests = {rid: make_request(rid, p, 2) for rid, p in prompts.items()}
    for request in requests.values():
        controller.add_request(request)
    shards = {rid: set() for rid in prompts}
    while controller.has_unfinished():
        run_one_step(controller, engine)
        for rid in prompts:
            if allocator.has(rid):
                shards[rid].update(allocator.shards_of(rid))
    assert shards["long"] == {0, 1} and len(shards["short"]) == 1
    assert {rid: r.output_token_ids for rid, r in requests.items()} == want
    assert [allocator.num_free_pages_on(s) for s in (0, 1)] == [32, 32]
