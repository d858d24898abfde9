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
      a dense masked [T_rank, T_rank] block per ring step in jnp (`masked_attention`), the
      work of one block pair of flash attention without its skipping of fully masked
      tiles; a paged-kernel mode taking per-token positions would take it over (the
      kernels are another module's).

Both parts of rank j's keys are visited by every rank's queries around a ring of N steps:

- pass-KV (Algorithm 2): the K/V travel. Rank j's message is its new K/V with their
  sequence ids and positions, and its cached pages of the step's sequences gathered into a
  [seqs, width] block (its size is the static page-table width: messages are equal-sized
  by construction, section 3.5.2) with their key counts. Partial results stay on the rank
  of the query and merge as they arrive.
- pass-Q (Algorithm 3): the queries travel (with their positions and source rank); each
  rank attends a visiting block over its own pages and new K/V, keeps the partial result
  in the slot of the query's source, and one All2All returns all partials to their owners,
  which merge N of them by LSE. Decode steps (Algorithm 4) are this same ring with the
  decode tokens spread over the ranks (round-robin in `cp_layout.place_new_tokens`, by
  position in the engine: see `cp_layout`).

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


def ring_attention(q, k, v, positions, k_all, v_all, layer_pages, kv_lens, rank_cu_q_lens,
                   num_seqs, pass_q, *, axis: str, num_ranks: int, sm_scale: float, impl: str):
    """Attention of this rank's queries over all ranks' cached and new K/V.

    q: [T, H, hd]; k, v: [T, K, hd] (this rank's new tokens, T = step tokens / N);
    positions: int32 [T]; k_all, v_all: [pages, page_size, K, hd] (this rank's cache, all
    layers); layer_pages: int32 [S, W] (this layer's page ids of each sequence on this rank);
    kv_lens: int32 [S] (tokens of each sequence cached on this rank before the step);
    rank_cu_q_lens: int32 [N, S + 1] (each rank's run of new tokens by sequence); num_seqs:
    int32 [1]; pass_q: int32 [1] (nonzero: pass-Q). Returns out [T, H, hd].
    """
    rank = jax.lax.axis_index(axis)
    # The cond's operands are laid out by XLA apart from its branches: the pages cross it
    # with their heads folded (no size-1 axis at one K/V head per device, which XLA would
    # otherwise re-lay out, copying the whole cache every layer; params.KV_CACHE_AXES).
    fold = lambda pages: pages.reshape(*pages.shape[:2], -1)  # noqa: E731
    local = _Local(q=q, k=k, v=v, positions=positions, k_all=fold(k_all), v_all=fold(v_all),
                   layer_pages=layer_pages, kv_lens=kv_lens, cu=rank_cu_q_lens,
                   num_seqs=num_seqs, rank=rank)
    kw = dict(axis=axis, num_ranks=num_ranks, sm_scale=sm_scale, impl=impl)
    out = jax.lax.cond(pass_q[0] != 0, functools.partial(_pass_q, **kw),
                       functools.partial(_pass_kv, **kw), local)
    return out.astype(q.dtype)


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

    def pages(self) -> tuple[jax.Array, jax.Array]:
        """k_all, v_all as [pages, page_size, K, hd]."""
        head_dim = self.k.shape[-1]
        return tuple(p.reshape(*p.shape[:2], -1, head_dim) for p in (self.k_all, self.v_all))


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


def _pass_kv(x: _Local, *, axis: str, num_ranks: int, sm_scale: float, impl: str):
    """Algorithm 2: this rank's queries stay; every rank's K/V visit them."""
    num_seqs_pad, width = x.layer_pages.shape
    k_all, v_all = x.pages()
    page_size = k_all.shape[1]
    # This rank's cached K/V of the step's sequences as one equal-sized block:
    # [S * W, page_size, K, hd], sequence s in pages s * W ... (s + 1) * W - 1.
    block_table = jnp.arange(num_seqs_pad * width, dtype=jnp.int32).reshape(num_seqs_pad, width)
    seq_ids = _token_seqs(x.cu[x.rank], x.num_seqs, x.q.shape[0])
    message = dict(k=x.k, v=x.v, seq=seq_ids, pos=x.positions,
                   k_cached=k_all[x.layer_pages].reshape(-1, page_size, *k_all.shape[2:]),
                   v_cached=v_all[x.layer_pages].reshape(-1, page_size, *v_all.shape[2:]),
                   kv_lens=x.kv_lens)
    q_seq = seq_ids
    outs, lses = [], []
    for step in range(num_ranks):
        # Start the next transfer before this block's attention so the two overlap.
        following = _send_next(message, step, axis=axis, num_ranks=num_ranks)
        with jax.named_scope(f"{RING_ATTEND}{step}"):
            cached = ragged_paged_attention(
                x.q, message["k_cached"], message["v_cached"], block_table, x.cu[x.rank],
                message["kv_lens"], x.num_seqs, sm_scale=sm_scale, impl=impl, causal=False)
            fresh = masked_attention(x.q, q_seq, x.positions, message["k"], message["v"],
                                     message["seq"], message["pos"], sm_scale=sm_scale)
        outs += [cached[0], fresh[0]]
        lses += [cached[1], fresh[1]]
        message = following
    out, _ = merge_attention(jnp.stack([o.astype(jnp.float32) for o in outs]), jnp.stack(lses))
    return out


def _pass_q(x: _Local, *, axis: str, num_ranks: int, sm_scale: float, impl: str):
    """Algorithm 3 (and 4 for decodes): the queries travel; partial outputs return by All2All."""
    num_tokens, num_heads, head_dim = x.q.shape
    local_seq = _token_seqs(x.cu[x.rank], x.num_seqs, num_tokens)
    k_all, v_all = x.pages()
    message = dict(q=x.q, pos=x.positions, src=x.rank)
    partial_out = jnp.zeros((num_ranks, num_tokens, num_heads, head_dim), jnp.float32)
    partial_lse = jnp.full((num_ranks, num_tokens, num_heads), -jnp.inf, jnp.float32)
    for step in range(num_ranks):
        following = _send_next(message, step, axis=axis, num_ranks=num_ranks)
        src = message["src"]
        cu_src = x.cu[src]
        with jax.named_scope(f"{RING_ATTEND}{step}"):
            cached = ragged_paged_attention(
                message["q"], k_all, v_all, x.layer_pages, cu_src, x.kv_lens, x.num_seqs,
                sm_scale=sm_scale, impl=impl, causal=False)
            fresh = masked_attention(message["q"], _token_seqs(cu_src, x.num_seqs, num_tokens),
                                     message["pos"], x.k, x.v, local_seq, x.positions,
                                     sm_scale=sm_scale)
        out, lse = merge_attention(jnp.stack([cached[0].astype(jnp.float32),
                                              fresh[0].astype(jnp.float32)]),
                                   jnp.stack([cached[1], fresh[1]]))
        partial_out = jax.lax.dynamic_update_index_in_dim(partial_out, out, src, 0)
        partial_lse = jax.lax.dynamic_update_index_in_dim(partial_lse, lse, src, 0)
        message = following
    # Slot j holds the partial result of rank j's queries: send it home. Afterwards slot j
    # holds this rank's queries attended over rank j's keys.
    partial_out = jax.lax.all_to_all(partial_out, axis, 0, 0, tiled=True)
    partial_lse = jax.lax.all_to_all(partial_lse, axis, 0, 0, tiled=True)
    out, _ = merge_attention(partial_out, partial_lse)
    return out


def masked_attention(q, q_seq, q_pos, k, v, k_seq, k_pos, *, sm_scale: float):
    """Attention of new tokens over new tokens by sequence id and position.

    q: [Tq, H, hd]; q_seq, q_pos: int32 [Tq]; k, v: [Tk, K, hd]; k_seq, k_pos: int32 [Tk].
    Query t sees key u iff q_seq[t] == k_seq[u] >= 0 and k_pos[u] <= q_pos[t]; padding
    carries seq -1. Returns (out [Tq, H, hd] f32, lse [Tq, H] f32; 0 and -inf for a query
    that sees no key).
    """
    num_q, num_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    group = num_heads // kv_heads
    qg = q.reshape(num_q, kv_heads, group, head_dim)
    scores = jnp.einsum("tkgd,ukd->kgtu", qg, k, preferred_element_type=jnp.float32) * sm_scale
    visible = ((q_seq[:, None] == k_seq[None, :]) & (q_seq[:, None] >= 0)
               & (k_pos[None, :] <= q_pos[:, None]))                      # [Tq, Tk]
    scores = jnp.where(visible, scores, -jnp.inf)
    top = jnp.max(scores, axis=-1)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    weights = jnp.where(visible, jnp.exp(scores - top[..., None]), 0.0)
    total = jnp.sum(weights, axis=-1)                                     # [K, g, Tq]
    out = jnp.einsum("kgtu,ukd->tkgd", weights, v.astype(jnp.float32))
    safe = jnp.where(total > 0, total, 1.0)
    out = out / jnp.moveaxis(safe, -1, 0)[..., None]
    lse = jnp.where(total > 0, top + jnp.log(safe), -jnp.inf)
    return (out.reshape(num_q, num_heads, head_dim),
            jnp.moveaxis(lse, -1, 0).reshape(num_q, num_heads))


def _token_seqs(cu_q_lens, num_seqs, num_tokens: int):
    """int32 [T]: the sequence of each token of a ragged run, -1 for padding."""
    tokens = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_q_lens[1:], tokens, side="right").astype(jnp.int32)
    return jnp.where(tokens < cu_q_lens[num_seqs[0]], seq, -1)
