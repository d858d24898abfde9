"""The Llama-3 decoder, with its families' differences (config.FAMILIES), as a Flax NNX
module over the ragged paged layout.

One forward serves one-shot prefill, chunked prefill and decode alike: a flat run of
tokens [T] from many sequences with their positions, the paged KV cache, and the
attention metadata that says which tokens belong to which sequence (DESIGN.md, "Step
layout"). Layers run under `lax.scan` over weights stacked on a leading `layers` axis,
so one layer body is compiled whatever the depth.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from medha_jax.config import ModelConfig
from medha_jax.model import layers
from medha_jax.model.attention import AttentionMetadata, attention
from medha_jax.model.params import MeshLayout, ParamSpec, param_specs
from pallas_kernels import cpu_native


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Paged K and V for all layers: [layers, num_pages, page_size, kv_heads * head_dim]
    (num_pages over all KV shards; kv_heads as placed, see MeshLayout, folded with head_dim:
    see params.KV_CACHE_AXES)."""

    k: jax.Array
    v: jax.Array

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def page_size(self) -> int:
        return self.k.shape[2]


class Llama(nnx.Module):
    """Llama-3 decoder: embeddings, scanned decoder layers, final norm, LM head.

    Parameters are nnx.Params holding sharded arrays in their placed shapes (`MeshLayout`:
    vocabulary padded, K/V heads repeated), each carrying its logical axes as
    `logical_axes` metadata. The layout is a static attribute, so the graph definition
    carries the rules and the attention implementation into every jitted function.
    """

    def __init__(self, config: ModelConfig, params: dict[str, jax.Array], layout: MeshLayout):
        specs = param_specs(config)
        missing = sorted(set(specs) - set(params))
        unexpected = sorted(set(params) - set(specs))
        if missing or unexpected:
            raise ValueError(f"Llama params: missing {missing}, unexpected {unexpected}")
        for name, spec in specs.items():
            want = layout.placed_shape(spec)
            if tuple(params[name].shape) != want:
                raise ValueError(f"parameter {name!r} has shape {tuple(params[name].shape)}, "
                                 f"expected {want} for {config.name} on this mesh")
        self.config = config
        self.layout = layout
        param = lambda name: nnx.Param(params[name], logical_axes=specs[name].logical_axes)  # noqa: E731
        self.embed = param("embed")
        self.final_norm = param("final_norm")
        self.lm_head = None if config.tie_word_embeddings else param("lm_head")
        self.layers = nnx.Dict({name.split(".", 1)[1]: param(name)
                                for name, spec in specs.items() if spec.per_layer})
        self.inv_freq = nnx.Variable(jnp.asarray(layers.rope_inv_freq(config)))

    def placed_params(self) -> dict[str, jax.Array]:
        """Canonical name -> the array as placed on the mesh (vocabulary padded, K/V heads
        repeated): the module's own buffers."""
        placed = {"embed": self.embed[...], "final_norm": self.final_norm[...]}
        if self.lm_head is not None:
            placed["lm_head"] = self.lm_head[...]
        placed.update({f"layers.{k}": v[...] for k, v in self.layers.items()})
        return placed

    def params(self) -> dict[str, jax.Array]:
        """Canonical name -> array in the checkpoint's shape (padding and repeats removed)."""
        specs = param_specs(self.config)
        return {name: self.layout.canonical(specs[name], array)
                for name, array in self.placed_params().items()}

    def __call__(self, token_ids, positions, kv_cache: KVCache, meta: AttentionMetadata,
                 move_layer=None):
        """token_ids, positions: int32 [T] -> (hidden [T, D], updated KVCache).
        move_layer: see `decoder_layers`."""
        config = self.config
        x = layers.embed_tokens(self.embed[...], token_ids, config)
        stacked = {name: p[...] for name, p in self.layers.items()}
        x, kv_cache = decoder_layers(x, stacked, kv_cache, positions, meta, config=config,
                                     layout=self.layout, inv_freq=self.inv_freq[...],
                                     move_layer=move_layer)
        x = layers.rms_norm(x, self.final_norm[...], config.rms_norm_eps,
                            config.family_spec.norm_offset)
        return x, kv_cache

    def logits(self, hidden):
        """hidden: [S, D] (already final-normed) -> float32 logits [S, vocab_size]."""
        return lm_logits(hidden, self.embed[...] if self.lm_head is None else None,
                         None if self.lm_head is None else self.lm_head[...],
                         self.config.vocab_size, self.config.final_logit_softcapping,
                         one_device=self.layout.mesh.size == 1)


def lm_logits(hidden, embed, lm_head, vocab_size: int, softcap: float | None = None, *,
              one_device: bool = False):
    """hidden [S, D] -> float32 logits [S, vocab_size] through lm_head [D, V_padded], or the
    tied embedding [V_padded, D] when lm_head is None. The padded vocabulary columns are cut
    here, so they never reach sampling or a user. softcap: c * tanh(logits / c) (Gemma).
    one_device: the weights are on one device, so a small step on a CPU may read the tied
    embedding with the native kernel (`cpu_native.matmul_t`): XLA's dot over its transpose
    reads it at a third of the memory's speed at 2-8 rows."""
    if (lm_head is None and one_device and hidden.shape[0] <= MATMUL_T_MAX_ROWS
            and cpu_native.runs_on(embed)):
        logits = cpu_native.matmul_t(hidden, embed)
    else:
        head = embed.T if lm_head is None else lm_head
        logits = jnp.einsum("sd,dv->sv", hidden, head, preferred_element_type=jnp.float32)
    logits = logits[:, :vocab_size]
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    return logits


def decoder_layers(x, stacked: dict[str, jax.Array], kv_cache: KVCache, positions,
                   meta: AttentionMetadata, *, config: ModelConfig, layout: MeshLayout, inv_freq,
                   first_layer: int = 0, move_layer=None):
    """Runs the decoder layers whose weights are stacked in `stacked` ([layers, ...] each)
    over x [T, D], under a scan; kv_cache holds exactly those layers, the model's layers
    first_layer, first_layer + 1, ... -> (x, kv_cache).

    Any contiguous range of layers works the same way (a pipeline stage runs its own).
    inv_freq: [hd / 2], or [2, hd / 2] with layers of two kinds (`layers.rope_inv_freq`).
    move_layer: (k_cache, v_cache, layer_id) -> (k_cache, v_cache), run in each layer
    before its attention: K/V the step moves between devices (the CDSP pool's balancing,
    medha_jax.engine.cdsp_pool), one layer at a time so the transfer can overlap the
    layer's projections."""
    in_place = {}
    if move_layer is None and _matrices_in_place(x, stacked, layout):
        in_place = {name: w for name, w in stacked.items() if name in MATRICES}
        stacked = {name: w for name, w in stacked.items() if name not in MATRICES}
    layer_body = functools.partial(_decoder_layer, config=config, layout=layout,
                                   positions=positions, meta=meta, inv_freq=inv_freq,
                                   move_layer=move_layer, in_place=in_place)
    num_layers = kv_cache.k.shape[0]
    layer_ids = jnp.arange(num_layers, dtype=jnp.int32)
    # Sliding or full, per layer: scanned data, so one layer body serves both kinds.
    sliding = jnp.asarray(config.sliding_layers()[first_layer:first_layer + num_layers])
    (x, k, v), _ = jax.lax.scan(layer_body, (x, kv_cache.k, kv_cache.v),
                                (stacked, layer_ids, sliding))
    return x, KVCache(k=k, v=v)


# A layer's projection matrices, what `_matrices_in_place` leaves stacked, and how many of
# each one's leading axes its projection contracts (`layers.dense`).
MATRICES = {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "w_gate": 1, "w_up": 1, "w_down": 1}
# Up to this many tokens a step reads each matrix in place (`cpu_native.layer_matmul`:
# streamed up to 8 rows, else a packed GEMM); past it the slice's copy is a small
# share of the multiplies and XLA's own matmul is as fast. 30 layers of SmolLM2's
# projections alone on 2 cores, a scan over slices vs in place, ms: 8 tokens 50 vs 31,
# 32: 94 vs 72, 128: 215 vs 187, 256: 404 vs 334, 512: 698 vs 714, 1024: 1361 vs 1431.
IN_PLACE_MAX_TOKENS = 256
# Up to this many rows the tied LM head is the native row-by-row product (`matmul_t`).
MATMUL_T_MAX_ROWS = 8


def _matrices_in_place(x, stacked: dict[str, jax.Array], layout: MeshLayout) -> bool:
    """Whether the layer scan leaves the projection matrices stacked, each read in place by
    the native CPU kernel (`layers.LayerOfStack`), rather than slicing them out layer by
    layer: f32 steps of up to IN_PLACE_MAX_TOKENS tokens on one CPU device. XLA:CPU copies
    each layer's slice of the stack before its matmul (or, at one token, folds the
    matrix-vector product into a slice loop on one thread): a lone SmolLM2 decode spent ~45
    of ~50 ms there, a 256-token chunk ~70 of ~500 ms (issue 26).
    On a mesh the matmuls are partitioned by XLA, which a custom call is not."""
    if layout.mesh.size != 1 or not all(
            name in stacked and math.prod(stacked[name].shape[1 + contracted:]) % 32 == 0
            for name, contracted in MATRICES.items()):
        return False      # (the kernel's columns come in blocks of 32)
    return x.shape[0] <= IN_PLACE_MAX_TOKENS and cpu_native.runs_on(
        *(stacked[name] for name in MATRICES))


def _decoder_layer(carry, layer, *, config: ModelConfig, layout: MeshLayout, positions,
                   meta: AttentionMetadata, inv_freq, move_layer=None, in_place=None):
    """One decoder layer inside the scan. The whole cache rides in the carry so the K/V
    write is an in-place scatter at [layer, slot] rather than a copy of a layer's pages.
    in_place: name -> stacked [layers, ...] matrices not scanned, read in place for this
    layer (`_matrices_in_place`)."""
    x, k_cache, v_cache = carry
    p, layer_id, sliding = layer
    if in_place:
        p = {**p, **{name: layers.LayerOfStack(w, layer_id) for name, w in in_place.items()}}
    if move_layer is not None:
        # Needs only the carried cache, and nothing below needs it before the attention.
        k_cache, v_cache = move_layer(k_cache, v_cache, layer_id)
    family = config.family_spec
    norm = functools.partial(layers.rms_norm, eps=config.rms_norm_eps,
                             offset=family.norm_offset)
    h = norm(x, p["attn_norm"])
    q = layers.dense("td,dhk->thk", h, p["wq"])
    k = layers.dense("td,dhk->thk", h, p["wk"])
    v = layers.dense("td,dhk->thk", h, p["wv"])
    if family.qkv_bias:                                      # Qwen2
        q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
    if family.qk_norm:                                       # Qwen3, Gemma-3: before RoPE
        q, k = norm(q, p["q_norm"]), norm(k, p["k_norm"])
    rope_scale = layers.rope_attention_factor(config)
    if config.mixed_layers:
        # Gemma-3: the sliding layers' RoPE has its own base and no scaling.
        if inv_freq.ndim == 2:
            inv_freq = inv_freq[sliding.astype(jnp.int32)]
        rope_scale = jnp.where(sliding, 1.0 if config.local_rope_theta else rope_scale,
                               rope_scale)
    q = layers.apply_rope(q, positions, inv_freq, rope_scale)
    k = layers.apply_rope(k, positions, inv_freq, rope_scale)
    attn, k_cache, v_cache = attention(
        q, k, v, k_cache, v_cache, layer_id, meta, layout=layout,
        sm_scale=config.attention_scale, positions=positions,
        sliding_window=config.sliding_window if config.mixed_layers else config.uniform_window,
        windowed=sliding if config.mixed_layers else None)
    out = layers.dense("thk,hkd->td", attn.astype(x.dtype), p["wo"])
    if family.post_norms:
        out = norm(out, p["post_attn_norm"])
    x = x + out
    out = layers.gated_mlp(norm(x, p["mlp_norm"]), p["w_gate"], p["w_up"], p["w_down"],
                           family.mlp_activation)
    if family.post_norms:
        out = norm(out, p["post_mlp_norm"])
    return (x + out, k_cache, v_cache), None


def one_sequence_metadata(start: int, end: int, padded_tokens: int, *, page_size: int,
                          num_kv_shards: int, tokens_per_shard: int) -> AttentionMetadata:
    """Metadata of one sequence computing its tokens [start, end) in one step (host numpy).

    Its cache is laid out contiguously: tokens [k * tokens_per_shard, (k + 1) *
    tokens_per_shard) on KV shard k, in that shard's pages 0, 1, 2, ... (tokens_per_shard is
    a multiple of page_size). Tokens past `end` up to padded_tokens are padding.
    """
    pages = tokens_per_shard // page_size
    positions = np.arange(start, end)
    owner, local = np.divmod(positions, tokens_per_shard)
    shards = np.arange(num_kv_shards)[:, None]
    slot_mapping = np.full((num_kv_shards, padded_tokens), pages * page_size, np.int32)
    slot_mapping[:, :end - start] = np.where(owner[None, :] == shards, local[None, :],
                                             pages * page_size)
    if num_kv_shards == 1:
        kv_lens = np.array([[end]])          # causal over the cache, new tokens included
    else:                                    # tokens each shard cached before this step
        kv_lens = np.clip(start - shards * tokens_per_shard, 0, tokens_per_shard)
    return AttentionMetadata(
        slot_mapping=slot_mapping,
        page_table=np.broadcast_to(np.arange(pages, dtype=np.int32), (num_kv_shards, 1, pages)),
        cu_q_lens=np.array([0, end - start], np.int32),
        kv_lens=kv_lens.astype(np.int32),
        num_seqs=np.array([1], np.int32),
        kv_starts=None if num_kv_shards == 1 else (shards * tokens_per_shard).astype(np.int32))


def init_random_params(config: ModelConfig, layout: MeshLayout, key) -> dict[str, jax.Array]:
    """Random weights (std 0.02, norms 1), each created directly in its sharding.

    Drawn in the canonical shape and then placed (padded, heads repeated), so the same seed
    gives the same model on every mesh. One program draws them all, kept per (specs, layout,
    dtype): a load compiles it once, a later load of the same config on the same mesh not
    at all (a program per parameter, jitted afresh, was 12 compiles and ~3 CPU-s for every
    load of tiny)."""
    specs = tuple(sorted(param_specs(config).items()))
    return _random_params(specs, layout, numpy_dtype(config.dtype))(key)


@functools.cache
def _random_params(specs: tuple[tuple[str, ParamSpec], ...], layout: MeshLayout, dtype):
    """The jitted draw of every parameter in `specs`, one per (specs, layout, dtype): jit's
    own cache is per function object, and out_shardings (each parameter's exact sharding)
    depend on the layout."""
    def draw(key):
        return {name: _random_param(spec, layout, dtype, jax.random.fold_in(key, i))
                for i, (name, spec) in enumerate(specs)}

    return jax.jit(draw, out_shardings={name: layout.param_sharding(spec) for name, spec in specs})


def _random_param(spec: ParamSpec, layout: MeshLayout, dtype, key):
    if spec.init in ("ones", "zeros"):
        canonical = (jnp.ones if spec.init == "ones" else jnp.zeros)(spec.shape, dtype)
    else:
        canonical = (0.02 * jax.random.normal(key, spec.shape)).astype(dtype)
    return layout.expand(spec, canonical)


def numpy_dtype(name: str):
    return {"float32": np.float32, "bfloat16": jnp.bfloat16, "float16": np.float16}[name]
