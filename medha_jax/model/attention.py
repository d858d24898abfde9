"""The model's attention: write this step's K/V into the paged cache, then attend, per device.

Everything runs inside one `shard_map` over the model's mesh whose specs all come from the
model's logical-axis rules (`MeshLayout.rules`): query heads and K/V heads over their axis
(tp), the cache's pages over theirs (kvp). A Pallas kernel is opaque to GSPMD, and the cache
must stay where it is, so each device writes and reads only its own part:

- One KV shard (kvp = 1): each device writes its heads' K/V at the step's slots and runs
  causal ragged paged attention over the cache (the new tokens included).
- Several KV shards (KV-cache parallelism, seed 000 section 3.3, appendix B.2): a sequence's
  cache is spread along its positions over the shards (the allocator places it). The query
  is replicated over the shards, each new token's K/V is written only on its owner shard,
  and attention is split in two exact parts merged by log-sum-exp:
    (a) the cached prefix, per shard over its local pages only (non-causal: every query of
        a chunk sees all its sequence's earlier tokens), merged across shards with one pmax
        and one psum of [tokens, heads] outputs and weights -- the only cross-shard traffic;
    (b) the step's own tokens, causal inside each chunk, computed once from this step's K/V
        (not from the cache), so a chunk that crosses a shard boundary needs nothing special.

- Several context-parallel ranks (cp, seed 002): the step's tokens are split over the ranks
  (`medha_jax.model.cp_layout`), each rank writes the K/V of its own tokens into its own
  pages, and `medha_jax.model.ring_attention` attends over all ranks by ring pass-KV or
  pass-Q.
- Both (kvp groups of cp rings; the cache's pages over kvp x cp): a sequence's context is
  split into segments over the kvp groups as with kvp alone, and within a group placed
  over its cp ranks by position as with cp alone. The step's tokens are split over the cp
  ranks and replicated over the groups. Each group runs the ring over its own ranks'
  cached K/V, so every query gets that group's part of (a) (exact, with its lse); the
  first group's ring also counts (b), the new tokens, which every group holds alike; one
  pmax and one psum over kvp merge the groups as kvp alone merges its shards. A token's
  K/V is written by the rank that computed it in the group that owns its position. A
  sliding window maps into a group's keys from its segment's first position (kv_starts),
  then into each rank's keys as with cp alone.

Step metadata carries a leading KV-shard dimension ([shards, ...], sharded like the cache's
pages: kvp shards, cp ranks, or kvp groups x cp ranks) so that every case reads the same
arrays. With both, the new tokens' attention runs in every group and counts in one: the
other groups' work on it ((kvp - 1) / kvp of it) is spent for one code path.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from medha_jax.model.params import KV_CACHE_AXES, MeshLayout
from medha_jax.model.ring_attention import ring_attention
from pallas_kernels import merge_attention, ragged_paged_attention
from pallas_kernels.query_blocks import cdiv, max_query_blocks, segment_of


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Where each token of a ragged step lives. N KV shards, T tokens, S sequences, W pages.

    slot_mapping: int32 [N, T / cp] slot (page * page_size + offset, page local to the shard)
                                   each token's K/V is written to on each shard; one past the
                                   shard's last slot where the shard does not own the token
                                   (with cp: each rank's own tokens only)
    page_table:   int32 [N, S, W]  each sequence's local page ids on each shard, in token order
    cu_q_lens:    int32 [S + 1]    token range of each sequence in the flat run
    kv_lens:      int32 [N, S]     keys of each sequence the cache attention reads on each
                                   shard: with one shard, the whole context after this step
                                   (causal over the cache); with several, the tokens cached on
                                   that shard before this step (this step's own tokens are
                                   attended from their fresh K/V)
                                   (with cp: tokens cached on each rank before the step)
    num_seqs:     int32 [1]        sequences in use (the rest are padding)
    rank_cu_q_lens: int32 [cp, S + 1] cp only: each rank's run of new tokens by sequence
                                   (cu_q_lens is then unused)
    cp_pass_q:    int32 [1]        cp only: 1 = ring pass-Q, 0 = ring pass-KV
    cp_kv_pages:  int32 [N, C]     cp only: each shard's pages holding its cached tokens of
                                   the step's sequences, each once (what pass-KV sends);
                                   N = cp, or kvp groups x cp (shard g * cp + r)
    cp_kv_index:  int32 [N, S, W]  cp only: where each page-table entry sits in cp_kv_pages
                                   (`cp_layout.pack_cached_pages`)
    kv_starts:    int32 [N, S]     kvp only (shards, or groups of cp ranks): the position of
                                   each sequence's first key on each shard (its segment's
                                   first token): a sliding window is mapped through it into
                                   the shard's keys
    num_decodes:  int32 [1]        the leading sequences that have one query token each
                                   (the engine orders decodes first): the Pallas kernels
                                   serve them with the decode kernel, the rest with query
                                   blocks sized for prefill chunks (None: all by the latter)
    """

    slot_mapping: jax.Array
    page_table: jax.Array
    cu_q_lens: jax.Array
    kv_lens: jax.Array
    num_seqs: jax.Array
    rank_cu_q_lens: jax.Array | None = None
    cp_pass_q: jax.Array | None = None
    num_decodes: jax.Array | None = None
    cp_kv_pages: jax.Array | None = None
    cp_kv_index: jax.Array | None = None
    kv_starts: jax.Array | None = None

    @classmethod
    def of(cls, fields) -> AttentionMetadata:
        """The metadata among named step arrays (e.g. `unpack_int32`'s dict)."""
        return cls(**{f.name: fields[f.name] for f in dataclasses.fields(cls)
                      if f.name in fields})


def num_kv_shards(layout: MeshLayout) -> int:
    """KV shards of the cache's pages: kvp shards or cp ranks."""
    return layout.rules.degree(layout.mesh, "pages")


def num_cp_ranks(layout: MeshLayout) -> int:
    """Context-parallel ranks: how many ways a step's tokens are split."""
    return layout.rules.degree(layout.mesh, "tokens")


def attention(q, k, v, k_cache, v_cache, layer_id, meta: AttentionMetadata, *,
              layout: MeshLayout, sm_scale: float, positions=None,
              sliding_window: int | None = None, windowed=None):
    """Writes K/V of one layer and attends.

    q: [T, H, hd]; k, v: [T, K, hd]; k_cache, v_cache: [L, P, page_size, K * hd] (all layers;
    P pages over all KV shards; K/V heads folded into the last axis, params.KV_CACHE_AXES);
    layer_id: int32 []; positions: int32 [T] (read with cp, and with kvp and a window).
    sliding_window: keys older than this many positions are masked (Mistral). Over KV shards
      (kvp, cp) each shard maps the window from absolute positions into its own keys, so a
      shard whose keys all lie before a query's window gives it an empty part (lse -inf),
      which the merge ignores (every attention path takes the mapped window_starts).
    windowed: bool [] (traced: the layer scan's per-layer flag) whether sliding_window applies
      to this layer (Gemma-3's sliding and full layers); None: it applies to every layer.
      The kernels take the window statically, so a per-layer one runs as a `lax.cond`
      between the windowed and the full variant of the same kernel.
    Returns (out [T, H, hd], k_cache, v_cache).
    """
    cp = num_cp_ranks(layout)
    sharded_window = sliding_window is not None and num_kv_shards(layout) > 1
    if sharded_window and cp == 1 and (meta.kv_starts is None or positions is None):
        raise ValueError(f"sliding_window={sliding_window} over {num_kv_shards(layout)} kvp "
                         "shards needs the step's kv_starts and positions (the engine's "
                         "build_step_inputs and llama.one_sequence_metadata make them)")
    if cp > 1 and num_kv_shards(layout) > cp and sliding_window is not None \
            and meta.kv_starts is None:
        raise ValueError(f"sliding_window={sliding_window} over kvp groups of cp={cp} rings "
                         "needs the step's kv_starts (the engine's build_step_inputs makes "
                         "them)")
    if cp > 1 and (meta.rank_cu_q_lens is None or meta.cp_pass_q is None or positions is None
                   or meta.cp_kv_pages is None or meta.cp_kv_index is None):
        raise ValueError(f"cp={cp} needs the step's rank_cu_q_lens, cp_pass_q, cp_kv_pages, "
                         "cp_kv_index and positions: "
                         "the engine's build_step_inputs(..., cp_ranks=cp) and "
                         "medha_jax.model.cp_layout.build_cp_step make them")
    body = functools.partial(_attend_on_device, sm_scale=sm_scale, impl=layout.attention_impl,
                             sliding_window=sliding_window,
                             per_layer_window=windowed is not None,
                             kv_shard_axis=layout.rules.mesh_axis("pages"),
                             num_shards=num_kv_shards(layout), cp=cp,
                             cp_axis=layout.rules.mesh_axis("tokens"),
                             kv_group_axis=_kv_group_axis(layout))
    if positions is None or not (cp > 1 or sharded_window):
        positions = jnp.zeros(q.shape[:1], jnp.int32)   # unread
    windowed = jnp.asarray(True if windowed is None else windowed)
    args = (q, k, v, positions, k_cache, v_cache, layer_id, windowed, meta)
    if layout.mesh.size == 1:
        return body(*args)
    spec = layout.rules.spec
    q_spec = spec(("tokens", "heads", "head_dim"))
    kv_spec = spec(("tokens", "kv_heads", "head_dim"))
    # The layers axis stays whole inside the shard_map: a program's cache holds exactly the
    # layers it runs (all of them; with spp > 1, its pipeline stage's, model/stages.py), and
    # the layer scan indexes them by position in that cache.
    cache_spec = spec((None,) + KV_CACHE_AXES[1:])
    cp_only = lambda field, s: None if field is None else s  # noqa: E731
    meta_spec = AttentionMetadata(
        slot_mapping=spec(("pages", None)), page_table=spec(("pages", "seqs", None)),
        cu_q_lens=spec((None,)), kv_lens=spec(("pages", "seqs")), num_seqs=spec((None,)),
        rank_cu_q_lens=cp_only(meta.rank_cu_q_lens, spec((None, None))),
        cp_pass_q=cp_only(meta.cp_pass_q, spec((None,))),
        cp_kv_pages=cp_only(meta.cp_kv_pages, spec(("pages", None))),
        cp_kv_index=cp_only(meta.cp_kv_index, spec(("pages", "seqs", None))),
        kv_starts=None if meta.kv_starts is None else spec(("pages", "seqs")),
        num_decodes=None if meta.num_decodes is None else spec((None,)))
    sharded = jax.shard_map(
        body, mesh=layout.mesh, in_specs=(q_spec, kv_spec, kv_spec, spec(("tokens",)),
                                          cache_spec, cache_spec, spec(()), spec(()), meta_spec),
        out_specs=(q_spec, cache_spec, cache_spec), check_vma=False)
    return sharded(*args)


def _kv_group_axis(layout: MeshLayout):
    """The mesh axes of the pages that are not cp's: kvp's (None without kvp)."""
    cp_axes = layout.rules.mesh_axis("tokens")
    cp_axes = (cp_axes,) if isinstance(cp_axes, str) else tuple(cp_axes or ())
    pages = layout.rules.mesh_axis("pages")
    pages = (pages,) if isinstance(pages, str) else tuple(pages or ())
    rest = tuple(a for a in pages if a not in cp_axes and layout.mesh.shape[a] > 1)
    return rest or None


def _attend_on_device(q, k, v, positions, k_cache, v_cache, layer_id, windowed,
                      meta: AttentionMetadata, *, sm_scale: float, impl: str, kv_shard_axis,
                      num_shards: int, cp: int, cp_axis, kv_group_axis=None,
                      sliding_window: int | None = None, per_layer_window: bool = False):
    """The per-device body: this device's heads and tokens, its KV shard's pages ([1, ...]
    of the metadata's shard dimension). k_cache, v_cache: [L, P, page_size, K * hd] here,
    this device's pages and heads; the kernels read them unfolded, [..., K, hd]."""
    slot_mapping, page_table, kv_lens = meta.slot_mapping[0], meta.page_table[0], meta.kv_lens[0]
    k_cache = _write(k_cache, layer_id, k, slot_mapping)
    v_cache = _write(v_cache, layer_id, v, slot_mapping)
    # Attend through a [layers * pages, ...] view of the whole cache with this layer's page
    # ids offset by layer * pages: slicing out k_cache[layer_id] would copy a whole layer
    # of the cache every layer of every step.
    num_pages = k_cache.shape[1]
    layer_pages = page_table + layer_id * num_pages
    attend = functools.partial(ragged_paged_attention, sm_scale=sm_scale, impl=impl)
    head_dim = k.shape[-1]
    k_all, v_all = _all_layer_pages(k_cache, head_dim), _all_layer_pages(v_cache, head_dim)
    if cp > 1:
        # With kvp groups, each group's ring covers its own cached K/V; the new tokens
        # count in group 0 only (the module docstring).
        first_group = (True if kv_group_axis is None
                       else jax.lax.axis_index(kv_group_axis) == 0)
        out, lse = ring_attention(q, k, v, positions, k_all, v_all, layer_pages, kv_lens,
                                  meta.rank_cu_q_lens, meta.num_seqs, meta.cp_pass_q,
                                  meta.cp_kv_pages[0] + layer_id * num_pages,
                                  meta.cp_kv_index[0], axis=cp_axis, num_ranks=cp,
                                  sm_scale=sm_scale, impl=impl, sliding_window=sliding_window,
                                  windowed=windowed, with_new_tokens=first_group,
                                  kv_starts=None if meta.kv_starts is None
                                  else meta.kv_starts[0])
        if kv_group_axis is not None:
            out, _ = _merge_over_shards(out, lse, kv_group_axis)
        return out.astype(q.dtype), k_cache, v_cache
    if num_shards == 1:
        def attend_cache(window, k_folded, v_folded):
            return attend(q, _all_layer_pages(k_folded, head_dim),
                          _all_layer_pages(v_folded, head_dim), layer_pages, meta.cu_q_lens,
                          kv_lens, meta.num_seqs, num_decodes=meta.num_decodes,
                          sliding_window=window)[0]
        if per_layer_window:
            # The cond takes the cache folded and each branch unfolds its view: an unfolded
            # operand with one K/V head per device (a size-1 axis) is copied whole by XLA.
            out = jax.lax.cond(windowed, functools.partial(attend_cache, sliding_window),
                               functools.partial(attend_cache, None), k_cache, v_cache)
        else:
            out = attend_cache(sliding_window, k_cache, v_cache)
        return out, k_cache, v_cache

    prefix_starts = None
    if sliding_window is not None:
        # The window in this shard's keys: its key j sits at position kv_starts + j. Zeros
        # (no window) on a per-layer scan's full layers.
        seq = segment_of(jnp.arange(q.shape[0], dtype=jnp.int32), meta.cu_q_lens[1:])
        first = positions - sliding_window + 1 - meta.kv_starts[0][seq]
        prefix_starts = jnp.where(windowed, jnp.maximum(first, 0), 0)
    prefix_out, prefix_lse = attend(q, k_all, v_all, layer_pages, meta.cu_q_lens, kv_lens,
                                    meta.num_seqs, causal=False, num_decodes=meta.num_decodes,
                                    window_starts=prefix_starts)
    prefix_out, prefix_lse = _merge_over_shards(prefix_out, prefix_lse, kv_shard_axis)

    def attend_own(window):
        return _attend_own_tokens(q, k, v, meta, functools.partial(attend, sliding_window=window),
                                  k_cache.shape[2])
    if sliding_window is not None and per_layer_window:
        own_out, own_lse = jax.lax.cond(windowed, lambda: attend_own(sliding_window),
                                        lambda: attend_own(None))
    else:
        own_out, own_lse = attend_own(sliding_window)
    out, _ = merge_attention(jnp.stack([prefix_out.astype(jnp.float32),
                                        own_out.astype(jnp.float32)]),
                             jnp.stack([prefix_lse, own_lse]))
    return out.astype(q.dtype), k_cache, v_cache


def _merge_over_shards(out, lse, axis: str):
    """Exact LSE merge of per-shard partial attention; NaN-safe where no shard saw a key.

    out: [T, H, hd], lse: [T, H] (-inf where this shard holds no key of the query's sequence).
    """
    lse_max = jax.lax.pmax(lse, axis)
    lse_max = jnp.where(jnp.isfinite(lse_max), lse_max, 0.0)
    weight = jnp.exp(lse - lse_max)                                   # 0 where lse is -inf
    weighted = jnp.where(weight[..., None] > 0, out.astype(jnp.float32) * weight[..., None], 0.0)
    weighted, total = jax.lax.psum((weighted, weight), axis)
    seen = total > 0
    safe_total = jnp.where(seen, total, 1.0)
    merged = weighted / safe_total[..., None]
    return merged, jnp.where(seen, lse_max + jnp.log(safe_total), -jnp.inf)


def _attend_own_tokens(q, k, v, meta: AttentionMetadata, attend, page_size: int):
    """Causal attention of each chunk over its own fresh K/V (not the cache).

    q: [T, H, hd]; k, v: [T, K, hd]. The step's K/V are laid out as a small paged cache of
    their own, [P, page_size, K, hd], each sequence's tokens from the first row of a fresh
    page (`_own_token_pages`), so the same paged kernel runs it: with kv_len = q_len, query
    i of a chunk sits at position i and the kernel's causal mask is exactly the chunk's
    (a chunk that starts mid-page in the cache still starts a page here).

    Pages of the cache's page_size, not one-token pages: the Mosaic-TPU kernel needs pages
    of whole 8-row tiles (`check_tpu_tiles`), and a page size the cache's attention already
    runs with is one every kernel accepts, with the same default tiles. (Attending through
    the XLA path instead would be exact too, but on a GPU or TPU it is the slow path.)
    Cost: one scatter of the step's K/V into at most T + S * (page_size - 1) rows, small
    beside the cache; the page table is [S, ceil(T / page_size)] instead of [S, T].
    """
    own_pages, page_table, q_lens = _own_token_pages(meta.cu_q_lens, meta.num_seqs,
                                                     q.shape[0], page_size)
    k_own, v_own = own_pages(k), own_pages(v)
    return attend(q, k_own, v_own, page_table, meta.cu_q_lens, q_lens, meta.num_seqs)


def _own_token_pages(cu_q_lens, num_seqs, num_tokens: int, page_size: int):
    """The layout of `_attend_own_tokens`: (pages_of, page_table int32 [S, W], q_lens [S]).

    pages_of maps [T, K, hd] to [P, page_size, K, hd]. Sequence s takes ceil(q_len_s /
    page_size) pages, its tokens in order from its first page's first row; the rest of its
    last page, the spare pages and padding tokens stay 0 and are never read (keys past
    kv_len). P bounds the sum of the sequences' pages as `max_query_blocks` bounds query
    blocks of page_size tokens; W = ceil(T / page_size) bounds the pages of one.
    """
    num_pages = max_query_blocks(num_tokens, cu_q_lens.shape[0] - 1, page_size)
    width = cdiv(num_tokens, page_size)
    starts = cu_q_lens[:-1]
    q_lens = cu_q_lens[1:] - starts                                        # [S]
    seq_pages = cdiv(q_lens, page_size)
    first_page = jnp.cumsum(seq_pages) - seq_pages                         # [S]
    page_table = jnp.minimum(first_page[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :],
                             num_pages - 1).astype(jnp.int32)              # [S, W]
    tokens = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = segment_of(tokens, cu_q_lens[1:])                                # [T]
    slot = first_page[seq] * page_size + tokens - starts[seq]
    slot = jnp.where(tokens < cu_q_lens[num_seqs[0]], slot, num_pages * page_size)

    def pages_of(x):
        rows = jnp.zeros((num_pages * page_size, *x.shape[1:]), x.dtype)
        rows = rows.at[slot].set(x, mode="drop")                          # padding: dropped
        return rows.reshape(num_pages, page_size, *x.shape[1:])

    return pages_of, page_table, q_lens


def _write(cache, layer_id, new, slot_mapping):
    """Scatters one layer's new K or V into the stacked cache, in place under donation.

    cache: [L, P, page_size, K * hd]; new: [T, K, hd]; slot_mapping: int32 [T]. Padding and
    tokens another shard owns carry slot P * page_size, one past the end, which mode="drop"
    discards.
    """
    num_layers, num_pages, page_size, features = cache.shape
    flat = cache.reshape(num_layers, num_pages * page_size, features)
    new = new.reshape(new.shape[0], features).astype(flat.dtype)
    if new.shape[0] == 1:
        # XLA rewrites a one-row scatter as a dynamic-update-slice guarded by a select (the
        # drop of an out-of-range slot), which cannot update in place: it copied the whole
        # cache three times per layer. A second row, always dropped, keeps it a scatter.
        new = jnp.concatenate([new, jnp.zeros_like(new)])
        slot_mapping = jnp.concatenate(
            [slot_mapping, jnp.full((1,), num_pages * page_size, slot_mapping.dtype)])
    flat = flat.at[layer_id, slot_mapping].set(new, mode="drop")
    return flat.reshape(cache.shape)


def _all_layer_pages(cache, head_dim: int):
    """[L, P, page_size, K * hd] -> [L * P, page_size, K, hd]: a free, contiguous view."""
    num_layers, num_pages, page_size, features = cache.shape
    return cache.reshape(num_layers * num_pages, page_size, features // head_dim, head_dim)
