"""Exact ring attention over the cp mesh axis (seed 002, Algorithms 2-4), per device.

A step's tokens are split over N context-parallel ranks (the load-balanced layout of
`medha_jax.model.cp_layout`): rank i holds its own queries, computed its own new K/V, and
keeps in its pages the K/V of every token it computed in earlier steps. Attention of a
query is split into two exact parts and merged by log-sum-exp (appendix B):

  (a) the cached prefix: every cached token of a sequence lies before all of the step's new
      tokens, so each rank's pages are attended NON-causally by the paged kernel, whatever
      order the tokens sit in on that rank;
  (b) the step's new tokens: a position-aware causal mask (same sequence, key position <=
      query position), because a rank's new tokens are two chunks of a sequence (head and
      tail), not one contiguous run the kernel's causal mode could describe. This part is
      a flash-style loop in jnp (`masked_attention`): query blocks streaming over key
      tiles with an online softmax, memory O(block^2 x heads) whatever T_rank, visiting
      only the tiles a block can see.

Both parts of rank j's keys are visited by every rank's queries around a ring of N steps:

- pass-KV (Algorithm 2): the K/V travel. Rank j's message is its new K/V with their
  sequence ids and positions, and its real cached K/V of the step's sequences: the C
  distinct pages holding them (`cp_layout.pack_cached_pages`), with the index from each
  sequence's page-table row into them and the key counts. C is a static bucket of the
  busiest rank's pages, so messages are equal-sized (section 3.5.2) and about the rank's
  share of the batch's context, (T + P) / N, not S x the widest page table. Partial
  results stay on the rank of the query and merge as they arrive.
- pass-Q (Algorithm 3): the queries travel (with their positions and source rank); each
  rank attends a visiting block over its own pages and new K/V, keeps the partial result
  in the slot of the query's source, and one All2All returns all partials to their owners,
  which merge N of them by LSE. Decode steps (Algorithm 4) are this same ring with the
  decode tokens spread over the ranks (round-robin in `cp_layout.place_new_tokens`, by
  position in the engine: see `cp_layout`).

A sliding window (Mistral, Gemma-3's sliding layers) holds in absolute positions on every
rank: the new tokens' mask compares positions, and the cached part starts each query at the
first of the holding rank's keys inside its window (`keys_before`); a rank with none of
them gives an empty part (lse -inf), which the merges ignore.

Every step starts the permute of the next block before attending the current one (MaxText's
ring), so XLA overlaps the transfer with the attention. The choice of variant is data
(`AttentionMetadata.cp_pass_q`): both are compiled into the one step program, and the
scheduler's heuristic (`medha_jax.scheduler.cp_cost`) picks per step without a recompile.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import merge_attention, ragged_paged_attention
from pallas_kernels.merge import (attention_scores, online_softmax_finish, online_softmax_init,
                                   online_softmax_update)


def ring_attention(q, k, v, positions, k_all, v_all, layer_pages, kv_lens, rank_cu_q_lens,
                   num_seqs, pass_q, kv_pages, kv_index, *, axis: str, num_ranks: int,
                   sm_scale: float, impl: str, sliding_window: int | None = None,
                   windowed=True, with_new_tokens=True, kv_starts=None):
    """Attention of this rank's queries over all ranks' cached and new K/V.

    q: [T, H, hd]; k, v: [T, K, hd] (this rank's new tokens, T = step tokens / N);
    positions: int32 [T]; k_all, v_all: [pages, page_size, K, hd] (this rank's cache, all
    layers); layer_pages: int32 [S, W] (this layer's page ids of each sequence on this rank);
    kv_lens: int32 [S] (tokens of each sequence cached on this rank before the step);
    rank_cu_q_lens: int32 [N, S + 1] (each rank's run of new tokens by sequence); num_seqs:
    int32 [1]; pass_q: int32 [1] (nonzero: pass-Q); kv_pages: int32 [C] (this layer's ids
    of this rank's packed cached pages); kv_index: int32 [S, W] (each page-table entry's
    place among them). sliding_window: a query at position p sees keys p - sliding_window + 1
    .. p, where windowed (bool [], traced: a per-layer scan's flag) says so; each rank's
    cached keys are the positions `cp_layout.rank_of_position` gives it (the engine's and
    `Model.logits`' placement), so the window maps into them by `keys_before`.
    with_new_tokens: bool [] (traced) whether part (b), the new tokens, counts here. A kvp
    group of cp rings (attention.py) runs one ring per group over the group's cached K/V,
    and the new tokens, the same in every group, count in the first group's only.
    kv_starts: int32 [S] or None: with kvp groups, the position of each sequence's first
    key in this rank's group (its segment's first token): a window maps into the group's
    keys from there (None: 0).
    Returns (out [T, H, hd] in q's dtype, lse [T, H] f32: -inf where no key was seen).
    """
    rank = jax.lax.axis_index(axis)
    first = jnp.zeros_like(positions)
    if sliding_window is not None:
        first = jnp.where(windowed, jnp.maximum(positions - sliding_window + 1, 0), 0)
    # The cond's operands are laid out by XLA apart from its branches: the pages cross it
    # with their heads folded (no size-1 axis at one K/V head per device, which XLA would
    # otherwise re-lay out, copying the whole cache every layer; params.KV_CACHE_AXES).
    fold = lambda pages: pages.reshape(*pages.shape[:2], -1)  # noqa: E731
    segment_start = jnp.zeros_like(positions)
    if kv_starts is not None:
        seq = _token_seqs(rank_cu_q_lens[rank], num_seqs, q.shape[0])
        segment_start = kv_starts[jnp.maximum(seq, 0)]
    local = _Local(q=q, k=k, v=v, positions=positions, k_all=fold(k_all), v_all=fold(v_all),
                   layer_pages=layer_pages, kv_lens=kv_lens, cu=rank_cu_q_lens,
                   num_seqs=num_seqs, rank=rank, kv_pages=kv_pages, kv_index=kv_index,
                   first=first, segment_start=segment_start)
    kw = dict(axis=axis, num_ranks=num_ranks, sm_scale=sm_scale, impl=impl,
              windowed=sliding_window is not None)
    out, lse = jax.lax.cond(pass_q[0] != 0, functools.partial(_pass_q, **kw),
                            functools.partial(_pass_kv, **kw), local,
                            jnp.asarray(with_new_tokens))
    return out.astype(q.dtype), lse


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Local:
    """What one rank holds for one layer (see `ring_attention`'s arguments; k_all, v_all
    with heads folded, [pages, page_size, K * hd]: `pages` unfolds them)."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    positions: jax.Array
    k_all: jax.Array
    v_all: jax.Array
    layer_pages: jax.Array
    kv_lens: jax.Array
    cu: jax.Array
    num_seqs: jax.Array
    rank: jax.Array
    kv_pages: jax.Array
    kv_index: jax.Array
    first: jax.Array   # int32 [T]: the first position each query sees (0: no window)
    segment_start: jax.Array  # int32 [T]: its sequence's first position in this kvp group

    def pages(self) -> tuple[jax.Array, jax.Array]:
        """k_all, v_all as [pages, page_size, K, hd]."""
        head_dim = self.k.shape[-1]
        return tuple(p.reshape(*p.shape[:2], -1, head_dim) for p in (self.k_all, self.v_all))

    def window_starts(self, first, segment_start, holder, num_ranks: int, windowed: bool):
        """int32 [T] or None: queries' first visible positions `first` as indices among
        rank `holder`'s cached keys of their sequence, whose part in this group starts at
        position `segment_start` (None: no window)."""
        if not windowed:
            return None
        return keys_before(jnp.maximum(first - segment_start, 0), holder, num_ranks,
                           self.k_all.shape[1])


def keys_before(positions, rank, num_ranks: int, page_size: int):
    """int32 like positions: of the tokens before each position, how many `rank` holds
    (`cp_layout.cached_on_rank` in jnp, for a traced rank): they are the first keys of its
    pages of the sequence, in page-table order, so a window starting at that position
    starts at that key on the rank. Tokens by `cp_layout.rank_of_position`."""
    logical_page, within = positions // (num_ranks * page_size), positions % (num_ranks * page_size)
    stripe = jnp.where(logical_page % 2 == 0, rank, num_ranks - 1 - rank)
    return (logical_page * page_size
            + jnp.clip(within - stripe * page_size, 0, page_size)).astype(jnp.int32)


# Name scopes of a ring step's transfer and attention, so that a test can find them in the
# optimized HLO (medha_jax.hlo.scheduled_ops) and check their order.
RING_SEND, RING_ATTEND = "cp_ring_send_", "cp_ring_attend_"


def _send_next(message, step: int, *, axis: str, num_ranks: int):
    """Starts sending the block in hand to the next rank (None after the last step)."""
    if step == num_ranks - 1:
        return None
    with jax.named_scope(f"{RING_SEND}{step + 1}"):
        return jax.lax.ppermute(message, axis, _ring_perm(num_ranks))


def _ring_perm(num_ranks: int):
    """Rank i sends to i + 1: after j steps rank i holds rank (i - j)'s block."""
    return [(i, (i + 1) % num_ranks) for i in range(num_ranks)]


def _new_token_lse(lse, with_new_tokens):
    """Part (b)'s lse where it counts on this device, -inf (weight 0 in every merge) where
    another kvp group counts it (`ring_attention`'s with_new_tokens)."""
    return jnp.where(with_new_tokens, lse, -jnp.inf)


def _pass_kv(x: _Local, with_new_tokens, *, axis: str, num_ranks: int, sm_scale: float,
             impl: str, windowed: bool):
    """Algorithm 2: this rank's queries stay; every rank's K/V visit them."""
    # This rank's real cached K/V of the step's sequences, [C, page_size, K, hd], and where
    # each sequence's pages sit in it: what travels, not [S x W] padded page tables.
    k_all, v_all = x.pages()
    seq_ids = _token_seqs(x.cu[x.rank], x.num_seqs, x.q.shape[0])
    message = dict(k=x.k, v=x.v, seq=seq_ids, pos=x.positions, k_cached=k_all[x.kv_pages],
                   v_cached=v_all[x.kv_pages], kv_index=x.kv_index, kv_lens=x.kv_lens)
    q_seq = seq_ids
    outs, lses = [], []
    for step in range(num_ranks):
        # Start the next transfer before this block's attention so the two overlap.
        following = _send_next(message, step, axis=axis, num_ranks=num_ranks)
        with jax.named_scope(f"{RING_ATTEND}{step}"):
            holder = (x.rank - step) % num_ranks          # whose K/V are in hand
            cached = ragged_paged_attention(
                x.q, message["k_cached"], message["v_cached"], message["kv_index"], x.cu[x.rank],
                message["kv_lens"], x.num_seqs, sm_scale=sm_scale, impl=impl, causal=False,
                window_starts=x.window_starts(x.first, x.segment_start, holder, num_ranks,
                                              windowed))
            fresh = masked_attention(x.q, q_seq, x.positions, message["k"], message["v"],
                                     message["seq"], message["pos"], sm_scale=sm_scale,
                                     q_first=x.first if windowed else None)
        outs += [cached[0], fresh[0]]
        lses += [cached[1], _new_token_lse(fresh[1], with_new_tokens)]
        message = following
    return merge_attention(jnp.stack([o.astype(jnp.float32) for o in outs]), jnp.stack(lses))


def _pass_q(x: _Local, with_new_tokens, *, axis: str, num_ranks: int, sm_scale: float,
            impl: str, windowed: bool):
    """Algorithm 3 (and 4 for decodes): the queries travel; partial outputs return by All2All."""
    num_tokens, num_heads, head_dim = x.q.shape
    local_seq = _token_seqs(x.cu[x.rank], x.num_seqs, num_tokens)
    k_all, v_all = x.pages()
    message = dict(q=x.q, pos=x.positions, src=x.rank)
    if windowed:
        message["first"], message["segment_start"] = x.first, x.segment_start
    partial_out = jnp.zeros((num_ranks, num_tokens, num_heads, head_dim), jnp.float32)
    partial_lse = jnp.full((num_ranks, num_tokens, num_heads), -jnp.inf, jnp.float32)
    for step in range(num_ranks):
        following = _send_next(message, step, axis=axis, num_ranks=num_ranks)
        src = message["src"]
        cu_src = x.cu[src]
        with jax.named_scope(f"{RING_ATTEND}{step}"):
            cached = ragged_paged_attention(
                message["q"], k_all, v_all, x.layer_pages, cu_src, x.kv_lens, x.num_seqs,
                sm_scale=sm_scale, impl=impl, causal=False,
                window_starts=x.window_starts(message.get("first"),
                                              message.get("segment_start"), x.rank, num_ranks,
                                              windowed))
            fresh = masked_attention(message["q"], _token_seqs(cu_src, x.num_seqs, num_tokens),
                                     message["pos"], x.k, x.v, local_seq, x.positions,
                                     sm_scale=sm_scale,
                                     q_first=message.get("first"))
        out, lse = merge_attention(jnp.stack([cached[0].astype(jnp.float32),
                                              fresh[0].astype(jnp.float32)]),
                                   jnp.stack([cached[1],
                                              _new_token_lse(fresh[1], with_new_tokens)]))
        partial_out = jax.lax.dynamic_update_index_in_dim(partial_out, out, src, 0)
        partial_lse = jax.lax.dynamic_update_index_in_dim(partial_lse, lse, src, 0)
        message = following
    # Slot j holds the partial result of rank j's queries: send it home. Afterwards slot j
    # holds this rank's queries attended over rank j's keys.
    partial_out = jax.lax.all_to_all(partial_out, axis, 0, 0, tiled=True)
    partial_lse = jax.lax.all_to_all(partial_lse, axis, 0, 0, tiled=True)
    return merge_attention(partial_out, partial_lse)


# Query and key tokens per tile of `masked_attention`: a tile's scores are
# [heads, NEW_TOKEN_BLOCK, NEW_TOKEN_BLOCK] f32 (32 heads: 8 MiB), whatever T_rank.
NEW_TOKEN_BLOCK = 256


def masked_attention(q, q_seq, q_pos, k, v, k_seq, k_pos, *, sm_scale: float,
                     block: int = NEW_TOKEN_BLOCK, q_first=None):
    """Attention of new tokens over new tokens by sequence id and position, tiled.

    q: [Tq, H, hd]; q_seq, q_pos: int32 [Tq]; k, v: [Tk, K, hd]; k_seq, k_pos: int32 [Tk];
    q_first: int32 [Tq] or None, the first position each query sees (a sliding window).
    Query t sees key u iff q_seq[t] == k_seq[u] >= 0 and q_first[t] <= k_pos[u] <= q_pos[t];
    padding carries seq -1. Returns (out [Tq, H, hd] f32, lse [Tq, H] f32; 0 and -inf for a query
    that sees no key).

    Flash-style: query blocks of up to `block` tokens, each streaming over key tiles of
    `block` with an online softmax, so memory is O(block^2 x heads), not [H, Tq, Tk]. A
    rank's run (queries and keys alike) is ordered by sequence, then position, padding
    last (`cp_layout`), so the keys a query block can see are one contiguous range: from
    the first key of its first sequence to the last key of its last sequence at or before
    its latest position there. Only the tiles of that range are visited (causal skipping:
    about half the tiles of one long chunk).
    """
    num_q, num_heads, head_dim = q.shape
    num_k, kv_heads, _ = k.shape
    group = num_heads // kv_heads
    bq = min(block, _pow2_at_least(num_q))
    bk = min(block, _pow2_at_least(num_k))
    q_blocks, k_tiles = -(-num_q // bq), -(-num_k // bk)
    pad_q, pad_k = q_blocks * bq - num_q, k_tiles * bk - num_k
    q = jnp.pad(q, ((0, pad_q), (0, 0), (0, 0)))
    q_seq = jnp.pad(q_seq, (0, pad_q), constant_values=-1)
    q_pos = jnp.pad(q_pos, (0, pad_q))
    q_first = jnp.pad(jnp.zeros_like(q_pos[:num_q]) if q_first is None else q_first,
                      (0, pad_q))
    k = jnp.pad(k, ((0, pad_k), (0, 0), (0, 0)))
    v = jnp.pad(v, ((0, pad_k), (0, 0), (0, 0)))
    k_seq = jnp.pad(k_seq, (0, pad_k), constant_values=-1)
    k_pos = jnp.pad(k_pos, (0, pad_k))
    # Padding keys sort last: seq -1 counted as past every real sequence.
    key_order = jnp.where(k_seq >= 0, k_seq, jnp.iinfo(jnp.int32).max)
    row_token = jnp.arange(bq * group, dtype=jnp.int32) // group   # row r: token r // group

    def block_step(b, carry):
        out, lse = carry
        first = b * bq
        qb = jax.lax.dynamic_slice_in_dim(q, first, bq)
        qs = jax.lax.dynamic_slice_in_dim(q_seq, first, bq)
        qp = jax.lax.dynamic_slice_in_dim(q_pos, first, bq)
        qf = jax.lax.dynamic_slice_in_dim(q_first, first, bq)
        real = qs >= 0
        lo_seq = jnp.min(jnp.where(real, qs, jnp.iinfo(jnp.int32).max))
        hi_seq = jnp.max(qs)
        hi_pos = jnp.max(jnp.where(qs == hi_seq, qp, -1))
        lo = jnp.sum(key_order < lo_seq, dtype=jnp.int32)
        hi = jnp.sum((key_order < hi_seq) | ((key_order == hi_seq) & (k_pos <= hi_pos)),
                     dtype=jnp.int32)
        hi = jnp.where(jnp.any(real), hi, lo)
        q_rows = (qb.reshape(bq, kv_heads, group, head_dim).transpose(1, 0, 2, 3)
                  .reshape(kv_heads, bq * group, head_dim))
        row_seq, row_pos, row_first = qs[row_token], qp[row_token], qf[row_token]

        def tile_step(tile, state):
            start = tile * bk
            kt = jax.lax.dynamic_slice_in_dim(k, start, bk).transpose(1, 0, 2)   # [K, bk, hd]
            vt = jax.lax.dynamic_slice_in_dim(v, start, bk).transpose(1, 0, 2)
            ks = jax.lax.dynamic_slice_in_dim(k_seq, start, bk)
            kp = jax.lax.dynamic_slice_in_dim(k_pos, start, bk)
            visible = ((row_seq[:, None] == ks[None, :]) & (row_seq[:, None] >= 0)
                       & (kp[None, :] <= row_pos[:, None])
                       & (kp[None, :] >= row_first[:, None]))                # [rows, bk]
            scores = attention_scores(q_rows, kt, sm_scale)                  # [K, rows, bk]
            scores = jnp.where(visible[None], scores, -jnp.inf)
            return online_softmax_update(state, scores, vt)

        state = online_softmax_init((kv_heads, bq * group), head_dim)
        state = jax.lax.fori_loop(lo // bk, -(-hi // bk), tile_step, state)
        o, l = online_softmax_finish(state)
        o = (o.reshape(kv_heads, bq, group, head_dim).transpose(1, 0, 2, 3)
             .reshape(bq, num_heads, head_dim))
        l = l.reshape(kv_heads, bq, group).transpose(1, 0, 2).reshape(bq, num_heads)
        return (jax.lax.dynamic_update_slice_in_dim(out, o, first, 0),
                jax.lax.dynamic_update_slice_in_dim(lse, l, first, 0))

    out = jnp.zeros((q_blocks * bq, num_heads, head_dim), jnp.float32)
    lse = jnp.full((q_blocks * bq, num_heads), -jnp.inf, jnp.float32)
    out, lse = jax.lax.fori_loop(0, q_blocks, block_step, (out, lse))
    return out[:num_q], lse[:num_q]


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _token_seqs(cu_q_lens, num_seqs, num_tokens: int):
    """int32 [T]: the sequence of each token of a ragged run, -1 for padding."""
    tokens = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_q_lens[1:], tokens, side="right").astype(jnp.int32)
    return jnp.where(tokens < cu_q_lens[num_seqs[0]], seq, -1)
