"""Host-side inputs of one engine step: a Batch flattened into padded numpy arrays.

A step runs a ragged batch: chunks of many sequences (decodes of 1 token, prefill chunks
of many) concatenated into one run of T tokens. The arrays below are what the jitted
step and the ragged paged attention kernel read; every size is padded to a bucket of
the BucketLadder so that the step never recompiles:

    T = ladder.token_bucket(real tokens), S = ladder.seq_bucket(real seqs, T),
    W = ladder.width_bucket(pages of the longest context in the batch),
    and with cp ranks C = ladder.cp_page_bucket(cached pages the busiest rank sends).

Attention-kernel contract (pallas_kernels.ragged_paged_attention): the queries of
sequence s are tokens cu_q_lens[s]:cu_q_lens[s + 1]; query i of sequence s sits at
position kv_lens[s] - q_len_s + i; sequences s >= num_seqs are padding, with cu_q_lens
repeating its last value and kv_lens 0. Padding tokens belong to no sequence and write
their K/V to `pad_slot`, one past the last real slot, which a scatter with mode="drop"
discards, so padding never touches a real page.

Sampling keys: the key of a request's n-th output token is a function of (seed, n) only,
so a request samples the same tokens whatever batch it lands in. A request's seed is
SamplingParams.seed when given; otherwise a fresh random one drawn the first time the
request is stepped and kept for its life (`request_seed`), so its tokens do not change
with batching or preemption, and no two unseeded requests share a stream (a reused
request id does not replay one).

The target is well under 1 ms for a few hundred sequences: the per-sequence Python work
is a handful of list appends, everything per token or per page is vectorised numpy, and
page tables are copied from the allocator's int32 buffers, never as Python ints. Arrays
are fresh every step rather than reused buffers: on the CPU backend a device array may
alias the numpy buffer it was made from, so refilling a buffer could change a step that
is still in flight.

On the way to the device the int32 arrays travel as one packed vector and the float32
ones as one matrix (`StepInputs.pack`): three host-to-device transfers per step instead
of eleven, each costing tens of microseconds of host time. The bucket shape (T, S, W)
fixes every offset statically, so the step unpacks with plain slices (`unpack_int32`).
"""

from __future__ import annotations

import dataclasses
import functools
import secrets
import weakref

import numpy as np

from medha_jax.buckets import BucketLadder
from medha_jax.kv_cache.allocator import BlockAllocator
from medha_jax.request import Batch

_UINT64_MASK = (1 << 64) - 1
# The drawn seeds of unseeded requests, for as long as each Request object lives.
_DRAWN_SEEDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def request_seed(request) -> int:
    """The request's sampling seed: SamplingParams.seed, else one drawn for it at random."""
    if request.sampling.seed is not None:
        return request.sampling.seed
    seed = _DRAWN_SEEDS.get(request)
    if seed is None:
        seed = _DRAWN_SEEDS[request] = secrets.randbits(64)
    return seed

# The packed fields, in packing order.
_PACKED_INT32 = ("token_ids", "positions", "slot_mapping", "cu_q_lens", "kv_lens", "page_table",
                 "num_seqs", "num_decodes", "logits_indices", "top_k", "next_token_ids",
                 "logprobs_flags")
_PACKED_CP_INT32 = ("rank_cu_q_lens", "cp_pass_q", "cp_kv_pages", "cp_kv_index")
_PACKED_KVP_INT32 = ("kv_starts",)
_PACKED_FLOAT32 = ("temperature", "top_p")


def _int32_shapes(shape: tuple[int, ...], num_kv_shards: int, cp_ranks: int = 1
                  ) -> dict[str, tuple[int, ...]]:
    """The shape of every packed int32 field in bucket (T, S, W) with N KV shards, in order.
    With cp ranks the bucket is (T, S, W, C), T is the tokens of one rank and the token
    arrays hold cp * T."""
    num_tokens, num_seqs, width = shape[:3]
    n = num_kv_shards
    shapes = {"token_ids": (cp_ranks * num_tokens,), "positions": (cp_ranks * num_tokens,),
              "slot_mapping": (n, num_tokens), "cu_q_lens": (num_seqs + 1,),
              "kv_lens": (n, num_seqs), "page_table": (n, num_seqs, width), "num_seqs": (1,),
              "num_decodes": (1,), "logits_indices": (num_seqs,), "top_k": (num_seqs,),
              "next_token_ids": (cp_ranks * num_tokens,), "logprobs_flags": (2,)}
    if cp_ranks > 1:
        shapes.update(rank_cu_q_lens=(cp_ranks, num_seqs + 1), cp_pass_q=(1,),
                      cp_kv_pages=(n, shape[3]), cp_kv_index=(n, num_seqs, width))
    if n > cp_ranks:                     # kvp shards (or groups of cp ranks)
        shapes.update(kv_starts=(n, num_seqs))
    return shapes


def unpack_int32(ints, shape: tuple[int, ...], num_kv_shards: int = 1,
                 cp_ranks: int = 1) -> dict:
    """The int32 fields of bucket `shape` = (T, S, W) out of `StepInputs.pack`'s vector.

    ints: int32 [N], a numpy or a traced JAX array (only slices and reshapes, all static).
    Returns field name -> array of its shape in `StepInputs`.
    """
    field_shapes = _int32_shapes(shape, num_kv_shards, cp_ranks)
    expected = sum(int(np.prod(s)) for s in field_shapes.values())
    if ints.shape != (expected,):
        raise ValueError(f"packed int32 inputs of shape {tuple(ints.shape)} do not match bucket "
                         f"{shape=}, which packs {expected} values")
    arrays, offset = {}, 0
    for name, field_shape in field_shapes.items():
        size = int(np.prod(field_shape))
        arrays[name] = ints[offset:offset + size].reshape(field_shape)
        offset += size
    return arrays


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """Padded inputs of one step. T tokens, S sequences, W page-table columns, N KV shards
    (see medha_jax.model.attention.AttentionMetadata for the per-shard fields)."""

    token_ids: np.ndarray       # int32 [T]; padding 0
    positions: np.ndarray       # int32 [T]: position of each token in its sequence; padding 0
    slot_mapping: np.ndarray    # int32 [N, T]: local page * page_size + offset of each token's
                                #   K/V on each shard; pad_slot on shards that do not own it
    cu_q_lens: np.ndarray       # int32 [S + 1]: query starts; padding repeats the last value
    kv_lens: np.ndarray         # int32 [N, S]: one shard: context length after this step;
                                #   several: tokens cached on each shard before this step
    page_table: np.ndarray      # int32 [N, S, W]: local pages of each sequence on each shard
    num_seqs: np.ndarray        # int32 [1]: real sequences
    num_decodes: np.ndarray     # int32 [1]: the leading sequences of one token each (decodes
                                #   first, as the engine orders a batch: the attention kernels'
                                #   decode path serves them)
    logits_indices: np.ndarray  # int32 [S]: token index of each sequence's last token; padding 0
    sample_mask: np.ndarray     # bool [S]: the chunk reaches its request's last token and samples
    temperature: np.ndarray     # float32 [S]: 0 = greedy; padding 0
    top_k: np.ndarray           # int32 [S]: 0 = off
    top_p: np.ndarray           # float32 [S]: 1 = off
    rng_keys: np.ndarray        # uint32 [S, 2]: threefry key data for the token each seq samples
    next_token_ids: np.ndarray  # int32 [T]: the prompt token after each token, whose logprob
                                #   the step computes (prompt logprobs); -1: none asked, the
                                #   last prompt token or later, padding
    logprobs_flags: np.ndarray  # int32 [2]: 1 when some sequence wants its sampled token's
                                #   logprobs, 1 when some token has a next_token_ids entry
    num_tokens: int             # real tokens, before padding to T
    request_ids: tuple[str, ...]  # request of each real sequence, in batch order
    # Context parallelism only (cp ranks R; T is then the tokens of one rank and the token
    # arrays are [R * T], rank r's run at r * T, see medha_jax.model.cp_layout):
    rank_cu_q_lens: np.ndarray | None = None  # int32 [R, S + 1]: each rank's run by sequence
    cp_pass_q: np.ndarray | None = None       # int32 [1]: 1 = ring pass-Q, 0 = pass-KV
    cp_kv_pages: np.ndarray | None = None     # int32 [N, C]: each shard's packed cached pages
    cp_kv_index: np.ndarray | None = None     # int32 [N, S, W]: page-table entries among them
                                              #   (cp_layout.pack_cached_pages); N = R, or
                                              #   kvp groups x R (shard g * R + r)
    # KV-cache parallelism only (N > 1 shards, or kvp groups of cp ranks):
    kv_starts: np.ndarray | None = None       # int32 [N, S]: position of each sequence's
                                              #   first key on each shard (its segment's)
    # Host only: the row of each real token (batch order) in the token arrays [R * T]; None
    # without cp, where token i is row i. Maps prompt logprobs back to their tokens.
    token_rows: np.ndarray | None = None

    @property
    def cp_ranks(self) -> int:
        return 1 if self.rank_cu_q_lens is None else self.rank_cu_q_lens.shape[0]

    @property
    def padded_shape(self) -> tuple[int, ...]:
        """(T, S, W), with cp (T, S, W, C): the bucket, i.e. which compiled executable runs
        this step."""
        _, num_padded_seqs, width = self.page_table.shape
        shape = (self.token_ids.shape[0] // self.cp_ranks, num_padded_seqs, width)
        return shape if self.cp_kv_pages is None else shape + (self.cp_kv_pages.shape[1],)

    @property
    def num_kv_shards(self) -> int:
        return self.page_table.shape[0]

    def arrays(self) -> dict[str, np.ndarray]:
        """The array fields by name (what goes to the device)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), np.ndarray) and f.name != "token_rows"}

    def rows_of(self, seq: int) -> np.ndarray:
        """Rows of sequence `seq`'s tokens in the token arrays, in position order."""
        tokens = np.arange(self.cu_q_lens[seq], self.cu_q_lens[seq + 1])
        return tokens if self.token_rows is None else self.token_rows[tokens]

    def pack(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(int32 [N], float32 [2, S], uint32 [S, 2]) for the device: the int32 fields
        concatenated (see `unpack_int32`), temperature and top_p stacked, the rng keys."""
        names = (_PACKED_INT32 + (_PACKED_CP_INT32 if self.cp_ranks > 1 else ())
                 + (_PACKED_KVP_INT32 if self.num_kv_shards > self.cp_ranks else ()))
        ints = np.concatenate([getattr(self, name).ravel() for name in names])
        floats = np.stack([getattr(self, name) for name in _PACKED_FLOAT32])
        return ints, floats, self.rng_keys

    @classmethod
    def padding(cls, shape: tuple[int, ...], pad_slot: int,
                num_kv_shards: int = 1, cp_ranks: int = 1) -> StepInputs:
        """All-padding inputs of bucket `shape` = (T, S, W) (with cp: (T, S, W, C)), what
        warm-up compiles with: no real sequence, every token writes to `pad_slot`, so a step
        on them writes nothing."""
        num_tokens, num_seqs, width = shape[:3]
        zeros = functools.partial(np.zeros, dtype=np.int32)
        cp = cp_ranks > 1
        return cls(
            rank_cu_q_lens=zeros((cp_ranks, num_seqs + 1)) if cp else None,
            cp_pass_q=zeros(1) if cp else None,
            cp_kv_pages=zeros((num_kv_shards, shape[3])) if cp else None,
            cp_kv_index=zeros((num_kv_shards, num_seqs, width)) if cp else None,
            kv_starts=zeros((num_kv_shards, num_seqs)) if num_kv_shards > cp_ranks else None,
            token_ids=zeros(cp_ranks * num_tokens), positions=zeros(cp_ranks * num_tokens),
            slot_mapping=np.full((num_kv_shards, num_tokens), pad_slot, np.int32),
            cu_q_lens=zeros(num_seqs + 1), kv_lens=zeros((num_kv_shards, num_seqs)),
            page_table=zeros((num_kv_shards, num_seqs, width)), num_seqs=zeros(1),
            num_decodes=zeros(1),
            logits_indices=zeros(num_seqs), sample_mask=np.zeros(num_seqs, bool),
            temperature=np.zeros(num_seqs, np.float32), top_k=zeros(num_seqs),
            top_p=np.ones(num_seqs, np.float32), rng_keys=np.zeros((num_seqs, 2), np.uint32),
            next_token_ids=np.full(cp_ranks * num_tokens, -1, np.int32),
            logprobs_flags=zeros(2), num_tokens=0, request_ids=())


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: a bijection of uint64 (mod 2**64) that scatters nearby inputs."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def sampling_key_data(seeds: np.ndarray, output_index: np.ndarray) -> np.ndarray:
    """Key data uint32 [S, 2] for output token `output_index` of requests with `seeds` (uint64 [S]).

    For a fixed seed, n -> key is injective (mix64 is a bijection), and different
    (seed, n) pairs collide with probability 2**-64. The pair is used as a raw threefry
    key by the sampler.
    """
    key = _mix64(_mix64(seeds.astype(np.uint64)) ^ output_index.astype(np.uint64))
    return np.stack([key >> np.uint64(32), key & np.uint64(0xFFFFFFFF)], axis=1).astype(np.uint32)


def build_step_inputs(batch: Batch, allocator: BlockAllocator, ladder: BucketLadder, *,
                      pad_slot: int, cp_ranks: int = 1, ring_cost=None,
                      cp_variant: str | None = None) -> StepInputs:
    """Flattens a batch into padded step arrays. Every chunk's pages must already be reserved.

    pad_slot: the slot padding tokens write to; at least pages_per_shard * page_size (one
    past a shard's last real slot) and below 2**31.

    With cp ranks (context parallelism) the allocator's pages are cp * page_size tokens, one
    page_size page on every rank with the same local id; each token goes to the rank its
    position names (`cp_layout.rank_of_position`), the token arrays are the ranks' runs one
    after the other, T is the bucket of the busiest rank's tokens, and `ring_cost`
    (`medha_jax.scheduler.cp_cost.RingCost`) picks pass-KV or pass-Q (Algorithm 5;
    decode-only steps pass Q) unless `cp_variant` (cp_cost.PASS_KV or PASS_Q) forces one.

    With several KV shards (KV-cache parallelism) each sequence's context is split into the
    allocator's segments, one shard each: the per-shard arrays get each segment's local pages,
    the tokens it cached before this chunk, and the chunk tokens' slots on their owner shard.
    """
    chunks = batch.chunks
    num_seqs = len(chunks)
    if num_seqs == 0:
        raise ValueError("cannot build step inputs for an empty batch")
    if cp_ranks > 1:
        return _cp_step_inputs(batch, allocator, ladder, pad_slot=pad_slot, cp_ranks=cp_ranks,
                               ring_cost=ring_cost, cp_variant=cp_variant)
    page_size = allocator.page_size
    num_shards = allocator.num_shards
    num_slots = allocator.pages_per_shard * page_size
    if not num_slots <= pad_slot < 2**31:
        raise ValueError(
            f"{pad_slot=} must be in [pages_per_shard * page_size = {num_slots}, 2**31) so that "
            f"padding tokens never write a real page")

    # Per-sequence Python work: collect plain lists (and page-table views), convert once.
    starts, q_lens, samples, out_index = [], [], [], []
    temperature, top_k, top_p, seeds, request_ids = [], [], [], [], []
    flat_tokens: list[int] = []
    # Prompt logprobs: (first token's index in the flat run, the prompt tokens they score).
    next_runs: list[tuple[int, list[int]]] = []
    wants_logprobs = False
    tables, pages_per_seq = [], []
    for chunk in chunks:
        request = chunk.request
        request_id = request.request_id
        start, num_chunk_tokens = chunk.start, chunk.num_tokens
        end = start + num_chunk_tokens
        if num_chunk_tokens < 1:
            raise ValueError(f"request {request_id!r}: chunk of {num_chunk_tokens} tokens")
        if num_shards == 1:
            table = allocator.page_table_array(request_id)
            num_pages = -(-end // page_size)
            if num_pages > len(table):
                raise ValueError(
                    f"request {request_id!r}: chunk ends at token {end}, which needs "
                    f"{num_pages} pages, but only {len(table)} are reserved; reserve first")
            tables.append(table if len(table) == num_pages else table[:num_pages])
            pages_per_seq.append(num_pages)
        else:
            tables.append(_segments_to(allocator, request_id, end))
        prompt_len = request.prompt_len
        outputs = request.output_token_ids
        params = request.sampling
        if params.prompt_logprobs is not None and start + 1 < prompt_len:
            # Token p scores prompt token p + 1; the last prompt token's next is sampled.
            next_runs.append((len(flat_tokens),
                              request.prompt_token_ids[start + 1:min(end + 1, prompt_len)]))
        if num_chunk_tokens == 1 and start >= prompt_len:  # decodes: one output token, no list
            flat_tokens.append(outputs[start - prompt_len])
        else:
            flat_tokens.extend(request.token_ids(start, end))
        starts.append(start)
        q_lens.append(num_chunk_tokens)
        samples.append(end == prompt_len + len(outputs))
        wants_logprobs |= samples[-1] and params.logprobs is not None
        out_index.append(len(outputs))
        temperature.append(params.temperature)
        top_k.append(params.top_k)
        top_p.append(params.top_p)
        seed = request_seed(request) if params.seed is None else params.seed
        seeds.append(seed & _UINT64_MASK)
        request_ids.append(request_id)

    num_tokens = len(flat_tokens)
    q_lens_np = np.array(q_lens, np.int32)
    starts_np = np.array(starts, np.int32)
    padded_tokens = ladder.token_bucket(num_tokens)
    padded_seqs = ladder.seq_bucket(num_seqs, padded_tokens)

    cu_q_lens = np.empty(padded_seqs + 1, np.int32)
    cu_q_lens[0] = 0
    np.cumsum(q_lens_np, out=cu_q_lens[1:num_seqs + 1])
    cu_q_lens[num_seqs + 1:] = num_tokens

    # Token t of sequence s sits at start_s + (t - cu_q_lens[s]).
    seq_of_token = np.repeat(np.arange(num_seqs), q_lens_np)
    real_positions = (np.arange(num_tokens, dtype=np.int32)
                      + np.repeat(starts_np - cu_q_lens[:num_seqs], q_lens_np))
    positions = np.zeros(padded_tokens, np.int32)
    positions[:num_tokens] = real_positions
    slot_mapping = np.full((num_shards, padded_tokens), pad_slot, np.int32)
    kv_lens = np.zeros((num_shards, padded_seqs), np.int32)
    if num_shards == 1:
        pages_np = np.array(pages_per_seq, np.int32)
        width = ladder.width_bucket(int(pages_np.max()))
        kv_lens[0, :num_seqs] = starts_np + q_lens_np
        # A boolean mask fills in row-major order, i.e. in the order the tables were joined.
        page_table = np.zeros((1, padded_seqs, width), np.int32)
        page_table[0, :num_seqs][np.arange(width) < pages_np[:, None]] = np.concatenate(tables)
        slot_mapping[0, :num_tokens] = (
            page_table[0, seq_of_token, real_positions // page_size] * page_size
            + real_positions % page_size)
    else:
        page_table = _sharded_tables(tables, starts_np, num_shards, padded_seqs, ladder,
                                     allocator.max_tokens_per_shard, kv_lens)
        segment_size = allocator.max_tokens_per_shard
        segment = real_positions // segment_size
        shard_of_segment = np.full((num_seqs, num_shards), -1, np.int32)
        kv_starts = np.zeros((num_shards, padded_seqs), np.int32)
        for s, segments in enumerate(tables):
            for k, (shard, _) in enumerate(segments):
                shard_of_segment[s, k] = shard
                kv_starts[shard, s] = k * segment_size
        owner = shard_of_segment[seq_of_token, segment]
        local = real_positions - segment * segment_size
        slot_mapping[owner, np.arange(num_tokens)] = (
            page_table[owner, seq_of_token, local // page_size] * page_size + local % page_size)
    token_ids = np.zeros(padded_tokens, np.int32)
    token_ids[:num_tokens] = flat_tokens
    next_token_ids = np.full(padded_tokens, -1, np.int32)
    for offset, ids in next_runs:
        next_token_ids[offset:offset + len(ids)] = ids

    logits_indices = np.zeros(padded_seqs, np.int32)
    logits_indices[:num_seqs] = cu_q_lens[1:num_seqs + 1] - 1
    sample_mask = np.zeros(padded_seqs, bool)
    sample_mask[:num_seqs] = samples
    temperature_np = np.zeros(padded_seqs, np.float32)
    temperature_np[:num_seqs] = temperature
    top_k_np = np.zeros(padded_seqs, np.int32)
    top_k_np[:num_seqs] = top_k
    top_p_np = np.ones(padded_seqs, np.float32)
    top_p_np[:num_seqs] = top_p
    rng_keys = np.zeros((padded_seqs, 2), np.uint32)
    rng_keys[:num_seqs] = sampling_key_data(np.array(seeds, np.uint64),
                                            np.array(out_index, np.uint64))

    return StepInputs(
        token_ids=token_ids, positions=positions, slot_mapping=slot_mapping,
        cu_q_lens=cu_q_lens, kv_lens=kv_lens, page_table=page_table,
        num_seqs=np.array([num_seqs], np.int32),
        num_decodes=np.array([_leading_ones(q_lens)], np.int32), logits_indices=logits_indices,
        sample_mask=sample_mask, temperature=temperature_np, top_k=top_k_np, top_p=top_p_np,
        rng_keys=rng_keys, next_token_ids=next_token_ids,
        logprobs_flags=np.array([wants_logprobs, bool(next_runs)], np.int32),
        num_tokens=num_tokens, request_ids=tuple(request_ids),
        kv_starts=kv_starts if num_shards > 1 else None)


def _leading_ones(q_lens: list[int]) -> int:
    """How many sequences at the front have one query token."""
    for i, n in enumerate(q_lens):
        if n != 1:
            return i
    return len(q_lens)


def _segments_to(allocator: BlockAllocator, request_id: str, end: int
                 ) -> list[tuple[int, np.ndarray]]:
    """(shard, local page ids) of each segment of the request up to token `end`, in order."""
    size, page_size = allocator.max_tokens_per_shard, allocator.page_size
    out = []
    for segment in allocator.segments(request_id):
        if segment.first_token >= end:
            break
        needed = -(-(min(end, segment.first_token + size) - segment.first_token) // page_size)
        if needed > len(segment.table):
            raise ValueError(f"request {request_id!r}: chunk ends at token {end}, past the "
                             f"pages reserved on shard {segment.shard}; reserve first")
        out.append((segment.shard, segment.table[:needed]))
    if sum(len(t) for _, t in out) * page_size < end:
        raise ValueError(f"request {request_id!r}: chunk ends at token {end}, past its "
                         "reserved pages; reserve first")
    return out


def _sharded_tables(segments_of_seq, starts: np.ndarray, num_shards: int, padded_seqs: int,
                    ladder: BucketLadder, segment_size: int, kv_lens: np.ndarray) -> np.ndarray:
    """page_table [N, S, W] from each sequence's segments; fills kv_lens [N, S] with the tokens
    each shard cached before the chunk (segment k holds tokens [k * size, (k + 1) * size))."""
    width = ladder.width_bucket(max(len(t) for segments in segments_of_seq for _, t in segments))
    page_table = np.zeros((num_shards, padded_seqs, width), np.int32)
    for s, segments in enumerate(segments_of_seq):
        for k, (shard, table) in enumerate(segments):
            page_table[shard, s, :len(table)] = table
            kv_lens[shard, s] = min(max(int(starts[s]) - k * segment_size, 0), segment_size)
    return page_table


def _cp_step_inputs(batch: Batch, allocator: BlockAllocator, ladder: BucketLadder, *,
                    pad_slot: int, cp_ranks: int, ring_cost, cp_variant: str | None
                    ) -> StepInputs:
    """`build_step_inputs` over cp ranks: the one-rank inputs, then each token moved to its
    rank's run (see there).

    With kvp groups too (the allocator's shards; KV shard g * cp + r is rank r of group g),
    a sequence's segments are placed as kvp places them, and within a segment its tokens
    go to ranks by their position in the segment: every group is a cp ring of its own over
    the positions it holds (`medha_jax.model.attention`)."""
    from medha_jax.model import cp_layout
    from medha_jax.scheduler.cp_cost import PASS_Q

    if allocator.page_size % cp_ranks:
        raise ValueError(f"cp={cp_ranks} wants allocator pages of cp * page_size tokens, got "
                         f"{allocator.page_size}")
    page_size = allocator.page_size // cp_ranks
    groups = allocator.num_shards
    # The one-rank layout of the batch (sequence-major, positions ascending), with slots
    # against pages of cp * page_size tokens, which are remapped below.
    flat_pad = allocator.page_size * allocator.pages_per_shard
    flat = build_step_inputs(batch, allocator, ladder, pad_slot=flat_pad)
    num_tokens, num_seqs = flat.num_tokens, len(batch.chunks)
    _, padded_seqs, width = flat.padded_shape
    positions = flat.positions[:num_tokens]
    seq = np.repeat(np.arange(num_seqs), np.diff(flat.cu_q_lens[:num_seqs + 1]))
    starts = np.array([chunk.start for chunk in batch.chunks])
    if groups == 1:
        group = np.zeros(num_tokens, np.int64)
        local = positions                                      # position in the segment
        cached = starts[:, None]                               # [S, groups]: before the chunk
    else:
        group = np.argmax(flat.slot_mapping[:, :num_tokens] != flat_pad, axis=0)
        local = positions - flat.kv_starts[group, seq]
        cached = flat.kv_lens[:, :num_seqs].T
    rank = cp_layout.rank_of_position(local, cp_ranks, page_size)
    order = np.argsort(rank, kind="stable")        # by rank; sequence and position kept
    counts = np.bincount(rank, minlength=cp_ranks)
    rank_tokens = ladder.token_bucket(int(counts.max()))
    within_rank = np.arange(num_tokens) - np.repeat(np.cumsum(counts) - counts, counts)
    target = np.empty(num_tokens, np.int64)
    target[order] = rank[order] * rank_tokens + within_rank    # each token's index in [R * T]

    token_ids = np.zeros(cp_ranks * rank_tokens, np.int32)
    token_ids[target] = flat.token_ids[:num_tokens]
    next_token_ids = np.full(cp_ranks * rank_tokens, -1, np.int32)
    next_token_ids[target] = flat.next_token_ids[:num_tokens]
    all_positions = np.zeros(cp_ranks * rank_tokens, np.int32)
    all_positions[target] = positions
    tables = flat.page_table                                   # [groups, S, W]
    logical_page = local // (cp_ranks * page_size)
    shards = groups * cp_ranks
    slot_mapping = np.full((shards, rank_tokens), pad_slot, np.int32)
    slot_mapping[group * cp_ranks + rank, target - rank * rank_tokens] = (
        tables[group, seq, logical_page] * page_size + local % page_size)
    rank_cu_q_lens = np.zeros((cp_ranks, padded_seqs + 1), np.int32)
    np.add.at(rank_cu_q_lens, (rank, seq + 1), 1)
    rank_cu_q_lens = np.cumsum(rank_cu_q_lens, axis=1, dtype=np.int32)
    kv_lens = np.zeros((groups, cp_ranks, padded_seqs), np.int32)
    kv_lens[:, :, :num_seqs] = cp_layout.cached_on_rank(cached, cp_ranks, page_size).transpose(
        1, 2, 0)                                               # [S, groups, R] -> [groups, R, S]
    kv_lens = kv_lens.reshape(shards, padded_seqs)
    logits_indices = np.zeros(padded_seqs, np.int32)
    logits_indices[:num_seqs] = target[flat.cu_q_lens[1:num_seqs + 1] - 1]
    page_table = np.repeat(tables, cp_ranks, axis=0)           # shard g * cp + r: group g's
    kv_pages, kv_index = cp_layout.pack_cached_pages(page_table, kv_lens, page_size,
                                                     capacity=ladder.cp_page_bucket)
    new, cached_tokens = num_tokens, int(starts.sum())
    if cp_variant is not None:
        pass_q = cp_variant == PASS_Q
    else:
        decodes_only = all(chunk.num_tokens == 1 for chunk in batch.chunks)
        pass_q = decodes_only or (ring_cost is not None
                                  and ring_cost.choose(new, cached_tokens) == PASS_Q)
    return dataclasses.replace(
        flat, token_ids=token_ids, positions=all_positions, slot_mapping=slot_mapping,
        kv_lens=kv_lens, page_table=page_table, cp_kv_pages=kv_pages, cp_kv_index=kv_index,
        logits_indices=logits_indices, rank_cu_q_lens=rank_cu_q_lens,
        cp_pass_q=np.array([int(pass_q)], np.int32), next_token_ids=next_token_ids,
        token_rows=target,
        kv_starts=None if groups == 1 else np.repeat(flat.kv_starts, cp_ranks, axis=0))
