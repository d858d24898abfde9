"""build_step_inputs: exact values against a slow builder; the kernel contract; packing."""

import math

import numpy as np
import pytest

from medha_jax.buckets import BucketLadder
from medha_jax.engine.step_inputs import (StepInputs, build_step_inputs, request_seed,
                                          sampling_key_data, unpack_int32)
from medha_jax.kv_cache.allocator import BlockAllocator
from medha_jax.request import Batch, Request, ScheduledChunk
from medha_jax.sampling_params import SamplingParams

MASK64 = (1 << 64) - 1


# ------------------------------------------------------------------- the slow builder

def _splitmix_finaliser(x):
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def _key_pair(seed, output_index):
    key = _splitmix_finaliser(_splitmix_finaliser(seed & MASK64) ^ output_index)
    return [key >> 32, key & 0xFFFFFFFF]


def slow_step_inputs(batch, allocator, ladder, pad_slot):
    """One token at a time, straight from the definitions."""
    ps = allocator.page_size
    chunks = batch.chunks
    T = ladder.token_bucket(sum(c.num_tokens for c in chunks))
    S = ladder.seq_bucket(len(chunks))
    W = ladder.width_bucket(max(math.ceil(c.end / ps) for c in chunks))
    out = dict(token_ids=[0] * T, positions=[0] * T, slot_mapping=[pad_slot] * T,
               cu_q_lens=[0] * (S + 1), kv_lens=[0] * S, page_table=[[0] * W for _ in range(S)],
               logits_indices=[0] * S, sample_mask=[False] * S, temperature=[0.0] * S,
               top_k=[0] * S, top_p=[1.0] * S, rng_keys=[[0, 0] for _ in range(S)],
               next_token_ids=[-1] * T, logprobs_flags=[0, 0])
    t = 0
    for s, chunk in enumerate(chunks):
        request = chunk.request
        all_tokens = request.prompt_token_ids + request.output_token_ids
        table = allocator.page_table(request.request_id)
        for i in range(math.ceil(chunk.end / ps)):
            out["page_table"][s][i] = table[i]
        params = request.sampling
        for pos in range(chunk.start, chunk.end):
            if params.prompt_logprobs is not None and pos + 1 < request.prompt_len:
                out["next_token_ids"][t] = all_tokens[pos + 1]     # scores the next prompt token
                out["logprobs_flags"][1] = 1
            out["token_ids"][t] = all_tokens[pos]
            out["positions"][t] = pos
            out["slot_mapping"][t] = table[pos // ps] * ps + pos % ps
            t += 1
        out["kv_lens"][s] = chunk.end
        out["logits_indices"][s] = t - 1
        out["sample_mask"][s] = chunk.end == len(all_tokens)
        if out["sample_mask"][s] and params.logprobs is not None:
            out["logprobs_flags"][0] = 1
        out["temperature"][s], out["top_k"][s], out["top_p"][s] = (
            params.temperature, params.top_k, params.top_p)
        seed = request_seed(request)
        out["rng_keys"][s] = _key_pair(seed, len(request.output_token_ids))
        out["cu_q_lens"][s + 1] = t
    for s in range(len(chunks), S):
        out["cu_q_lens"][s + 1] = t
    # One KV shard: the per-shard fields have a leading dimension of 1.
    for name in ("slot_mapping", "kv_lens", "page_table"):
        out[name] = [out[name]]
    return out, t


def check_kernel_contract(inputs, page_size, pad_slot):
    """The ragged paged attention contract, checked on the arrays alone (one KV shard)."""
    n = int(inputs.num_seqs[0])
    assert inputs.num_kv_shards == 1
    cu, kv = inputs.cu_q_lens, inputs.kv_lens[0]
    page_table, slot_mapping = inputs.page_table[0], inputs.slot_mapping[0]
    assert cu[0] == 0 and cu[n] == inputs.num_tokens and np.all(cu[n:] == cu[n])
    assert np.all(kv[n:] == 0) and np.all(page_table[n:] == 0)
    for s in range(n):
        q_len = cu[s + 1] - cu[s]
        assert 1 <= q_len <= kv[s]
        for i in range(q_len):
            token = cu[s] + i
            pos = inputs.positions[token]
            assert pos == kv[s] - q_len + i
            assert slot_mapping[token] == (page_table[s, pos // page_size] * page_size
                                           + pos % page_size)
        assert inputs.logits_indices[s] == cu[s + 1] - 1
        assert np.all(page_table[s, math.ceil(kv[s] / page_size):] == 0)
    assert np.all(slot_mapping[inputs.num_tokens:] == pad_slot)


# ----------------------------------------------------------------------- random batches

def _sampling(rng):
    # Seeds may be negative or wider than 64 bits.
    seed = None if rng.random() < 0.5 else int(rng.integers(-2**62, 2**62)) * 64
    return SamplingParams(temperature=float(rng.choice([0.0, 0.7, 1.0])),
                          top_k=int(rng.choice([0, 5])), top_p=float(rng.choice([1.0, 0.9])),
                          seed=seed, logprobs=[None, 0, 3][int(rng.integers(3))],
                          prompt_logprobs=[None, None, 2][int(rng.integers(3))])


def random_batch(rng, allocator):
    """Decodes, first / middle / last prefill chunks, prefix-reused prompts and recomputes."""
    ps = allocator.page_size
    shared_prefix = rng.integers(0, 1000, 3 * ps).tolist()
    chunks = []
    for i in range(int(rng.integers(1, 12))):
        kind = rng.choice(["decode", "prefill", "reused", "recompute"])
        prompt_len = int(rng.integers(1, 5 * ps))
        prompt = rng.integers(0, 1000, prompt_len).tolist()
        outputs = []
        if kind in ("decode", "recompute"):
            outputs = rng.integers(0, 1000, int(rng.integers(1, 2 * ps))).tolist()
        if kind == "reused":
            prompt = shared_prefix + prompt
        request = Request(f"req-{i}", len(prompt), 64, 0.0, prompt_token_ids=prompt,
                          sampling=_sampling(rng))
        request.output_token_ids = outputs
        start = allocator.allocate(request.request_id, prompt + outputs)
        num_tokens = request.num_tokens
        if kind == "decode":
            start = num_tokens - 1
        elif kind != "reused":
            start = max(start, int(rng.integers(0, num_tokens)))
        end = int(rng.integers(start + 1, num_tokens + 1))
        reserve_ahead = int(rng.integers(0, 2 * ps))    # columns past the context stay 0
        assert allocator.reserve(request.request_id, min(end + reserve_ahead, num_tokens + ps))
        chunks.append(ScheduledChunk(request, start, end - start))
        if kind == "reused" or rng.random() < 0.3:     # later requests may reuse this prefix
            allocator.commit(request.request_id, prompt + outputs, end)
    return Batch(chunks)


@pytest.mark.parametrize("seed", range(20))
def test_matches_slow_builder_and_kernel_contract(seed):
    rng = np.random.default_rng(seed)
    page_size = int(rng.choice([1, 4, 16]))
    allocator = BlockAllocator(num_pages=2000, page_size=page_size)
    ladder = BucketLadder.from_limits(max_tokens=1024, max_seqs=16, max_pages_per_seq=512,
                                      min_seqs=2, min_pages_per_seq=2)
    pad_slot = allocator.num_pages * page_size
    batch = random_batch(rng, allocator)
    inputs = build_step_inputs(batch, allocator, ladder, pad_slot=pad_slot)
    expected, num_tokens = slow_step_inputs(batch, allocator, ladder, pad_slot)
    assert inputs.num_tokens == num_tokens == batch.num_tokens
    assert inputs.request_ids == tuple(c.request.request_id for c in batch.chunks)
    assert inputs.num_seqs.tolist() == [len(batch.chunks)]
    assert inputs.padded_shape == (len(expected["token_ids"]), len(expected["kv_lens"][0]),
                                   len(expected["page_table"][0][0]))
    dtypes = dict(sample_mask=np.bool_, temperature=np.float32, top_p=np.float32,
                  rng_keys=np.uint32)
    for name, value in expected.items():
        actual = getattr(inputs, name)
        assert actual.dtype == dtypes.get(name, np.int32), name
        np.testing.assert_array_equal(actual, np.array(value, actual.dtype), err_msg=name)
    assert set(inputs.arrays()) == set(expected) | {"num_seqs", "num_decodes"}
    q_lens = [c.num_tokens for c in batch.chunks]
    leading = next((i for i, n in enumerate(q_lens) if n != 1), len(q_lens))
    assert inputs.num_decodes.tolist() == [leading]
    check_kernel_contract(inputs, page_size, pad_slot)


def test_hand_written_example():
    """Two decodes and a prefill chunk, page_size 4, every value written out."""
    allocator = BlockAllocator(num_pages=16, page_size=4)
    ladder = BucketLadder(token_buckets=(8, 16), seq_buckets=(4,), width_buckets=(2, 4))
    a = Request("a", 5, 8, 0.0, prompt_token_ids=[10, 11, 12, 13, 14])
    a.output_token_ids = [15, 16]                       # decode of token 16 at position 6
    b = Request("b", 2, 8, 0.0, prompt_token_ids=[20, 21])
    b.output_token_ids = [22]                           # decode of token 22 at position 2
    c = Request("c", 9, 8, 0.0, prompt_token_ids=list(range(30, 39)))  # chunk of tokens 2..6
    for request, tokens in ((a, 7), (b, 3), (c, 7)):
        allocator.allocate(request.request_id)
        assert allocator.reserve(request.request_id, tokens)
    assert [allocator.page_table(r) for r in "abc"] == [[0, 1], [2], [3, 4]]
    batch = Batch([ScheduledChunk(a, 6, 1), ScheduledChunk(b, 2, 1), ScheduledChunk(c, 2, 5)])
    inputs = build_step_inputs(batch, allocator, ladder, pad_slot=64)
    assert inputs.padded_shape == (8, 4, 2) and inputs.num_tokens == 7
    assert inputs.token_ids.tolist() == [16, 22, 32, 33, 34, 35, 36, 0]
    assert inputs.positions.tolist() == [6, 2, 2, 3, 4, 5, 6, 0]
    assert inputs.slot_mapping[0].tolist() == [1 * 4 + 2, 2 * 4 + 2, 3 * 4 + 2, 3 * 4 + 3,
                                            4 * 4 + 0, 4 * 4 + 1, 4 * 4 + 2, 64]
    assert inputs.cu_q_lens.tolist() == [0, 1, 2, 7, 7]
    assert inputs.kv_lens[0].tolist() == [7, 3, 7, 0]
    assert inputs.page_table[0].tolist() == [[0, 1], [2, 0], [3, 4], [0, 0]]
    assert inputs.num_seqs.tolist() == [3]
    assert inputs.logits_indices.tolist() == [0, 1, 6, 0]
    assert inputs.sample_mask.tolist() == [True, True, False, False]
    assert inputs.temperature.tolist() == [0, 0, 0, 0]  # Request's default is greedy
    assert inputs.top_k.tolist() == [0, 0, 0, 0] and inputs.top_p.tolist() == [1, 1, 1, 1]


def test_prefix_reused_request_writes_only_its_own_pages():
    allocator = BlockAllocator(num_pages=32, page_size=4)
    ladder = BucketLadder.from_limits(max_tokens=64, max_seqs=8, max_pages_per_seq=16)
    prompt = list(range(100, 118))                      # 18 tokens: 4 full pages + 2
    allocator.allocate("first", prompt)
    allocator.reserve("first", 18)
    allocator.commit("first", prompt, 18)
    second = Request("second", 18, 4, 0.0, prompt_token_ids=prompt)
    reused = allocator.allocate("second", prompt)
    assert reused == 16
    allocator.reserve("second", 18)
    batch = Batch([ScheduledChunk(second, reused, 2)])
    inputs = build_step_inputs(batch, allocator, ladder, pad_slot=32 * 4)
    shared = set(allocator.page_table("first")[:4])
    assert inputs.page_table[0, 0, :4].tolist() == allocator.page_table("first")[:4]
    written_pages = set(inputs.slot_mapping[0, :2] // 4)
    assert written_pages.isdisjoint(shared)
    assert inputs.positions[:2].tolist() == [16, 17] and inputs.kv_lens[0, 0] == 18
    assert inputs.sample_mask[0]


def test_sampling_key_depends_only_on_seed_and_output_index():
    allocator = BlockAllocator(num_pages=64, page_size=4)
    ladder = BucketLadder.from_limits(max_tokens=64, max_seqs=8, max_pages_per_seq=16)

    def decode(rid, seed, num_outputs):
        request = Request(rid, 3, 16, 0.0, prompt_token_ids=[1, 2, 3],
                          sampling=SamplingParams(seed=seed))
        request.output_token_ids = [7] * num_outputs
        allocator.allocate(rid)
        allocator.reserve(rid, request.num_tokens)
        return ScheduledChunk(request, request.num_tokens - 1, 1)

    chunks = [decode("x", 42, 3), decode("y", 42, 3), decode("z", 42, 4), decode("u", None, 3)]
    keys = build_step_inputs(Batch(chunks), allocator, ladder, pad_slot=256).rng_keys
    assert keys[0].tolist() == keys[1].tolist()          # same seed, same output index
    assert keys[0].tolist() != keys[2].tolist()          # next output token
    assert keys[3].tolist() == _key_pair(request_seed(chunks[3].request), 3)   # drawn once
    # Unseeded: a fresh stream per request, even under the same id.
    assert request_seed(chunks[3].request) != request_seed(decode("u2", None, 3).request)
    again = Request("u", 3, 16, 0.0, prompt_token_ids=[1, 2, 3], sampling=SamplingParams())
    assert request_seed(again) != request_seed(chunks[3].request)
    alone = build_step_inputs(Batch(chunks[2:][::-1]), allocator, ladder, pad_slot=256).rng_keys
    assert alone[1].tolist() == keys[2].tolist() and alone[0].tolist() == keys[3].tolist()
    # For one seed, consecutive output indices never share a key.
    many = sampling_key_data(np.full(10_000, 42, np.uint64), np.arange(10_000, dtype=np.uint64))
    assert len({tuple(k) for k in many.tolist()}) == 10_000


def test_errors():
    allocator = BlockAllocator(num_pages=8, page_size=4)
    ladder = BucketLadder(token_buckets=(8,), seq_buckets=(2,), width_buckets=(4,))
    request = Request("r", 12, 4, 0.0, prompt_token_ids=list(range(12)))
    allocator.allocate("r")
    allocator.reserve("r", 4)
    with pytest.raises(ValueError, match="empty batch"):
        build_step_inputs(Batch([]), allocator, ladder, pad_slot=32)
    with pytest.raises(ValueError, match="pad_slot=31 must be in"):
        build_step_inputs(Batch([ScheduledChunk(request, 0, 4)]), allocator, ladder, pad_slot=31)
    with pytest.raises(ValueError, match="ends at token 6, which needs 2 pages, but only 1"):
        build_step_inputs(Batch([ScheduledChunk(request, 0, 6)]), allocator, ladder, pad_slot=32)
    allocator.reserve("r", 12)
    with pytest.raises(ValueError, match="tokens n=12 exceeds the largest bucket 8"):
        build_step_inputs(Batch([ScheduledChunk(request, 0, 12)]), allocator, ladder, pad_slot=32)


# ---------------------------------------------------------------------------- packing

@pytest.mark.parametrize("seed", range(3))
def test_pack_then_unpack_gives_every_field_back(seed):
    rng = np.random.default_rng(seed)
    allocator = BlockAllocator(num_pages=500, page_size=4)
    ladder = BucketLadder.from_limits(max_tokens=512, max_seqs=16, max_pages_per_seq=64,
                                      min_seqs=2, min_pages_per_seq=2)
    inputs = build_step_inputs(random_batch(rng, allocator), allocator, ladder, pad_slot=2000)
    ints, floats, rng_keys = inputs.pack()
    assert ints.dtype == np.int32 and floats.dtype == np.float32 and rng_keys.dtype == np.uint32
    unpacked = unpack_int32(ints, inputs.padded_shape)
    int_fields = {name for name, a in inputs.arrays().items() if a.dtype == np.int32}
    assert set(unpacked) == int_fields
    for name, array in unpacked.items():
        np.testing.assert_array_equal(array, getattr(inputs, name), err_msg=name)
    np.testing.assert_array_equal(floats, np.stack([inputs.temperature, inputs.top_p]))
    np.testing.assert_array_equal(rng_keys, inputs.rng_keys)
    T, S, W = inputs.padded_shape
    with pytest.raises(ValueError, match=rf"do not match bucket shape=\({T}, {S + 1}, {W}\)"):
        unpack_int32(ints, (T, S + 1, W))


def test_padding_inputs_hold_no_sequence_and_write_only_the_pad_slot():
    allocator = BlockAllocator(num_pages=8, page_size=4)
    padding = StepInputs.padding((16, 4, 2), pad_slot=32)
    assert padding.padded_shape == (16, 4, 2) and padding.num_tokens == 0
    assert padding.num_seqs.tolist() == [0] and not padding.sample_mask.any()
    assert padding.slot_mapping.tolist() == [[32] * 16]
    check_kernel_contract(padding, allocator.page_size, pad_slot=32)
    # The same fields, dtypes and shapes as real inputs of that bucket: one executable runs both.
    request = Request("r", 3, 1, 0.0, prompt_token_ids=[1, 2, 3])
    allocator.allocate("r")
    allocator.reserve("r", 3)
    ladder = BucketLadder(token_buckets=(16,), seq_buckets=(4,), width_buckets=(2,))
    real = build_step_inputs(Batch([ScheduledChunk(request, 0, 3)]), allocator, ladder, pad_slot=32)
    for name, array in real.arrays().items():
        assert (getattr(padding, name).shape, getattr(padding, name).dtype) == \
            (array.shape, array.dtype), name


def test_kvp_groups_of_cp_ranks_place_each_token_once_in_the_group_of_its_segment():
    """kvp = 2 groups of cp = 2 ranks (shard g * 2 + r), pages of 2 x 4 tokens, 16 tokens a
    group: a 40-token prompt's chunk of positions 10..29 spans its first segment (0..15,
    on one group) and its second (16..31, on the other); each token's K/V goes to exactly
    one shard, the rank its position in the segment names in the group holding it."""
    from medha_jax.model import cp_layout

    cp, page_size, segment = 2, 4, 16
    allocator = BlockAllocator(num_pages=8, page_size=cp * page_size, num_shards=2,
                               max_tokens_per_shard=segment)
    ladder = BucketLadder.from_limits(max_tokens=32, max_seqs=2, max_pages_per_seq=2,
                                      cp_pages=8)
    request = Request("r", 40, 1, 0.0, prompt_token_ids=list(range(1, 41)))
    allocator.allocate("r")
    assert allocator.reserve("r", 30)
    group_of_segment = [s.shard for s in allocator.segments("r")]
    assert sorted(group_of_segment) == [0, 1]
    pad_slot = 8 * page_size
    inputs = build_step_inputs(Batch([ScheduledChunk(request, 10, 20)]), allocator, ladder,
                               pad_slot=pad_slot, cp_ranks=cp)
    assert inputs.num_kv_shards == 4
    # Each shard knows where its group's segment starts (a sliding window maps from there).
    assert inputs.kv_starts[:, 0].reshape(2, cp).tolist() == [
        [segment * group_of_segment.index(g)] * cp for g in range(2)]
    written = inputs.slot_mapping != pad_slot                        # [4, T_rank]
    rank_tokens = inputs.slot_mapping.shape[1]
    for position in range(10, 30):
        row = int(np.flatnonzero(inputs.positions == position)[0])
        rank, index = divmod(row, rank_tokens)
        local = position % segment
        assert rank == cp_layout.rank_of_position(np.array([local]), cp, page_size)[0]
        group = group_of_segment[position // segment]
        shards = [s for s in range(4) if written[s, index] and s % cp == rank]
        assert shards == [group * cp + rank], position
        page = allocator.segments("r")[position // segment].table[local // (cp * page_size)]
        assert inputs.slot_mapping[group * cp + rank, index] == page * page_size + local % 4
    assert written.sum() == 20                                       # no token twice
    # Before the chunk: 10 tokens of the first segment (its ranks 8 and 2 of them, the
    # zigzag of 4-token stripes), none of the second.
    kv_lens = inputs.kv_lens[:, 0].reshape(2, cp)
    assert kv_lens[group_of_segment[0]].tolist() == cp_layout.cached_on_rank(10, cp, 4).tolist()
    assert kv_lens[group_of_segment[1]].tolist() == [0, 0]
    # Each shard's page table is its group's segment.
    for g in range(2):
        table = allocator.segments("r")[group_of_segment.index(g)].table
        for r in range(cp):
            assert inputs.page_table[g * cp + r, 0, :len(table)].tolist() == list(table)
