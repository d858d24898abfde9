"""Where a step's tokens go on the cp ranks (host numpy): seed 002 section 3.5.1 and Alg. 4.

Prefill: a sequence's new tokens split into 2N chunks, rank i takes chunks i and 2N-1-i, so
every rank gets an equal share of the causal attention work (a head chunk that sees little
and a tail chunk that sees much). The new tokens are split this way whatever ranks hold the
sequence's cached tokens (partial prefill). Decode: one token a sequence, placed round-robin
(Algorithm 4). That is the placement of `place_new_tokens`; the engine and `Model.logits`
(`plan_sequence`) place tokens by position instead (the last section), and `build_cp_step`
lays out either.

The step's flat token array is the concatenation of the ranks' runs ([N * T_rank], sharded
over cp); within a rank's run the sequences keep their batch order and each sequence's
tokens are in position order. The K/V of a token stay on its rank: rank r's pages of a
sequence fill in the order its tokens arrive there, which is all the non-causal cached
attention needs (`medha_jax.model.ring_attention`).

What a rank sends in a pass-KV ring step is its real cached K/V of the step's sequences,
packed (`pack_cached_pages`): the distinct pages that hold them, C of them, and an index
from each sequence's page-table row into that list. C is a static size of the compiled
step, a bucket of the busiest rank's page count (`BucketLadder.cp_page_buckets`), so the
message follows the batch's total context over N, not sequences x the widest page table.
"""

from __future__ import annotations

import dataclasses

import numpy as np


def balanced_offsets(num_new: int, num_ranks: int) -> list[np.ndarray]:
    """Offsets 0..num_new-1 of each rank's new tokens: chunks i and 2N-1-i of 2N (the first
    chunks one longer when 2N does not divide num_new)."""
    chunks = np.array_split(np.arange(num_new), 2 * num_ranks)
    return [np.concatenate([chunks[i], chunks[2 * num_ranks - 1 - i]]) for i in range(num_ranks)]


def place_new_tokens(num_new: int, num_ranks: int, decode_rank: int) -> list[np.ndarray]:
    """Offsets of each rank's new tokens: balanced for a prefill chunk, the whole token on
    `decode_rank` for a decode (round-robin is the caller's counter)."""
    if num_new == 1:
        return [np.arange(1) if r == decode_rank % num_ranks else np.arange(0)
                for r in range(num_ranks)]
    return balanced_offsets(num_new, num_ranks)


@dataclasses.dataclass(frozen=True)
class CpChunk:
    """One sequence's part of a cp step.

    start: position of its first new token; offsets: per rank, the new tokens' offsets from
    start (`place_new_tokens`); cached: int [N], tokens of the sequence each rank cached
    before the step; pages: int [N, W'] each rank's local pages of the sequence in fill
    order (enough for cached + new).
    """

    start: int
    offsets: list[np.ndarray]
    cached: np.ndarray
    pages: np.ndarray


@dataclasses.dataclass(frozen=True)
class CpStep:
    """The flat arrays of one cp step. N ranks, T_rank tokens a rank, S sequences, W pages.

    source: int32 [N * T_rank]   (sequence, offset) of each flat token as seq * 2**20 +
                                 offset, -1 for padding (callers pick token ids with it)
    positions: int32 [N * T_rank]
    slot_mapping: int32 [N, T_rank] local slot of each of a rank's tokens (pad_slot: none)
    page_table: int32 [N, S, W]; kv_lens: int32 [N, S] (tokens cached before the step)
    rank_cu_q_lens: int32 [N, S + 1] each rank's run by sequence
    last_token: int32 [S] flat index of each sequence's last new token (its logits row)
    kv_pages: int32 [N, C]; kv_index: int32 [N, S, W]  the cached pages packed
                                 (`pack_cached_pages`)
    """

    source: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    page_table: np.ndarray
    kv_lens: np.ndarray
    rank_cu_q_lens: np.ndarray
    last_token: np.ndarray
    kv_pages: np.ndarray
    kv_index: np.ndarray


SOURCE_STRIDE = 1 << 20


def tokens_per_rank(chunks: list[CpChunk]) -> int:
    """The most new tokens any rank gets in this step."""
    return int(max(sum(len(c.offsets[r]) for c in chunks) for r in range(len(chunks[0].offsets))))


def build_cp_step(chunks: list[CpChunk], *, num_ranks: int, rank_tokens: int,
                  padded_seqs: int, width: int, page_size: int, pad_slot: int,
                  kv_capacity: int | None = None) -> CpStep:
    """Lays out one step's chunks over the ranks (see the module docstring). kv_capacity:
    C, the packed cached pages a rank sends (None: the busiest rank's count, at least 1)."""
    if tokens_per_rank(chunks) > rank_tokens:
        raise ValueError(f"a rank gets {tokens_per_rank(chunks)} tokens > {rank_tokens=}")
    n, t = num_ranks, rank_tokens
    source = np.full(n * t, -1, np.int64)
    positions = np.zeros(n * t, np.int32)
    slot_mapping = np.full((n, t), pad_slot, np.int32)
    page_table = np.zeros((n, padded_seqs, width), np.int32)
    kv_lens = np.zeros((n, padded_seqs), np.int32)
    cu = np.zeros((n, padded_seqs + 1), np.int32)
    last_token = np.zeros(padded_seqs, np.int32)
    for r in range(n):
        at = 0
        for s, chunk in enumerate(chunks):
            offsets = chunk.offsets[r]
            index = r * t + at + np.arange(len(offsets))
            source[index] = s * SOURCE_STRIDE + offsets
            positions[index] = chunk.start + offsets
            local = chunk.cached[r] + np.arange(len(offsets))          # fill order on rank r
            slot_mapping[r, at:at + len(offsets)] = (chunk.pages[r][local // page_size]
                                                     * page_size + local % page_size)
            pages = chunk.pages[r][:width]
            page_table[r, s, :len(pages)] = pages
            kv_lens[r, s] = chunk.cached[r]
            total = sum(len(o) for o in chunk.offsets)
            if len(offsets) and offsets[-1] == total - 1:
                last_token[s] = index[-1]
            at += len(offsets)
            cu[r, s + 1] = at
        cu[r, len(chunks) + 1:] = at
    kv_pages, kv_index = pack_cached_pages(
        page_table, kv_lens, page_size,
        capacity=lambda most: max(1, most) if kv_capacity is None else kv_capacity)
    return CpStep(source=source.astype(np.int32), positions=positions,
                  slot_mapping=slot_mapping, page_table=page_table, kv_lens=kv_lens,
                  rank_cu_q_lens=cu, last_token=last_token, kv_pages=kv_pages,
                  kv_index=kv_index)


def pack_cached_pages(page_table: np.ndarray, kv_lens: np.ndarray, page_size: int, *,
                      capacity) -> tuple[np.ndarray, np.ndarray]:
    """What each rank sends of its cache in a pass-KV ring step: its real cached K/V, packed.

    page_table: int [N, S, W] each rank's local pages of each sequence, in token order;
    kv_lens: int [N, S] tokens of each sequence cached on each rank; capacity: the busiest
    rank's page count -> C (the step's bucket; an error if it returns less).
    Returns (pages int32 [N, C]: rank r's distinct pages holding cached tokens, then
    padding page 0, never read; index int32 [N, S, W]: where page j of sequence s sits in
    rank r's list, 0 past its cached pages). A page two sequences share (a cached
    prefix) is sent once, so a rank never sends more than its pool holds.
    """
    num_ranks, num_seqs, width = page_table.shape
    used = np.arange(width) < -(-np.asarray(kv_lens) // page_size)[..., None]   # [N, S, W]
    index = np.zeros(page_table.shape, np.int32)
    distinct = []
    for r in range(num_ranks):
        pages, index[r][used[r]] = np.unique(page_table[r][used[r]], return_inverse=True)
        distinct.append(pages)
    most = max(len(p) for p in distinct)
    size = capacity(most)
    if size < most:
        raise ValueError(f"a rank sends {most} cached pages > the step's capacity {size}")
    packed = np.zeros((num_ranks, size), np.int32)
    for r, pages in enumerate(distinct):
        packed[r, :len(pages)] = pages
    return packed, index


def plan_sequence(chunk_sizes: list[int], num_ranks: int, page_size: int
                  ) -> tuple[list[tuple[int, list[np.ndarray], np.ndarray]], np.ndarray]:
    """One sequence run as successive chunks, its tokens placed by position as the engine
    places them (`rank_of_position`, the last section): (start, offsets per rank, tokens
    each rank cached before) of every chunk, and the tokens each rank holds at the end.
    By position, not per chunk, so that a rank's cached keys are positions a step can
    compute (`cached_on_rank`): what maps a sliding window into them
    (`ring_attention.keys_before`)."""
    plan, start = [], 0
    for n in chunk_sizes:
        rank = rank_of_position(start + np.arange(n), num_ranks, page_size)
        offsets = [np.flatnonzero(rank == r) for r in range(num_ranks)]
        plan.append((start, offsets, cached_on_rank(start, num_ranks, page_size)))
        start += n
    return plan, cached_on_rank(start, num_ranks, page_size)


def step_metadata(step: CpStep, num_seqs: int, pass_q: bool):
    """The step's `AttentionMetadata` (cu_q_lens unused with cp: rank_cu_q_lens says it)."""
    from medha_jax.model.attention import AttentionMetadata

    return AttentionMetadata(
        slot_mapping=step.slot_mapping, page_table=step.page_table,
        cu_q_lens=np.zeros(step.page_table.shape[1] + 1, np.int32), kv_lens=step.kv_lens,
        num_seqs=np.array([num_seqs], np.int32), rank_cu_q_lens=step.rank_cu_q_lens,
        cp_pass_q=np.array([int(pass_q)], np.int32), cp_kv_pages=step.kv_pages,
        cp_kv_index=step.kv_index)


# ------------------------------------------------------------------ the engine's placement
#
# The engine places a token by its POSITION rather than by its chunk: logical page g of a
# sequence (the allocator's page, cp * page_size tokens) is one physical page of page_size
# tokens on each rank, all with the allocator's local id; its j-th page_size stripe lives on
# rank j for even g and rank cp - 1 - j for odd g, so each window of 2 * cp stripes gives
# rank i stripes i and 2 cp - 1 - i: the 2N-chunk zigzag of section 3.5.1, per window. Why
# not per chunk, as the paper and `place_new_tokens` do: with placement by position a full
# allocator page is the same tokens on the same ranks for every request, so the prefix cache
# (hashes of full pages) and the allocator (pages from token counts) work unchanged, and the
# K/V still stay on the rank that computed them. The cost: a chunk shorter than 2 * cp
# stripes, and a decode, land on the ranks their positions name, not round-robin
# (Algorithm 4), so small steps balance less well. Measured
# (test_decodes_spread_over_every_rank_by_position_within_a_bound): 32 decodes of
# different lengths a step on 4 ranks, the busiest rank gets 1.3x to 1.5x round-robin's 8
# on average, at most 15, and over 96 steps each rank 23% to 27% of them.


def rank_of_position(positions: np.ndarray, num_ranks: int, page_size: int) -> np.ndarray:
    """int [T]: the rank that computes and keeps the token at each position."""
    logical_page, within = np.divmod(positions, num_ranks * page_size)
    stripe = within // page_size
    return np.where(logical_page % 2 == 0, stripe, num_ranks - 1 - stripe)


def cached_on_rank(start, num_ranks: int, page_size: int) -> np.ndarray:
    """int [..., R]: tokens before `start` (an int, or an int array [...]) that each rank
    holds; they are the first slots of the rank's pages of the sequence in page-table order
    (pages before start's are full)."""
    logical_page, within = np.divmod(np.asarray(start)[..., None], num_ranks * page_size)
    ranks = np.arange(num_ranks)
    stripe = np.where(logical_page % 2 == 0, ranks, num_ranks - 1 - ranks)
    return logical_page * page_size + np.clip(within - stripe * page_size, 0, page_size)
