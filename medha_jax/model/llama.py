"""The Llama-3 family decoder as a Flax NNX module over the ragged paged layout.

One forward serves one-shot prefill, chunked prefill and decode alike: a flat run of
tokens [T] from many sequences with their positions, the paged KV cache, and the
attention metadata that says which tokens belong to which sequence (DESIGN.md, "Step
layout"). Layers run under `lax.scan` over weights stacked on a leading `layers` axis,
so one layer body is compiled whatever the depth.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from medha_jax.config import ModelConfig
from medha_jax.model import layers
from medha_jax.model.attention import paged_attention

# Logical axes of every parameter, by canonical name (the checkpoint loaders' names).
PARAM_AXES: dict[str, tuple[str | None, ...]] = {
    "embed": ("vocab", "embed"),
    "final_norm": ("embed",),
    "lm_head": ("embed", "vocab"),
    "layers.attn_norm": ("layers", "embed"),
    "layers.mlp_norm": ("layers", "embed"),
    "layers.wq": ("layers", "embed", "heads", "head_dim"),
    "layers.wk": ("layers", "embed", "kv_heads", "head_dim"),
    "layers.wv": ("layers", "embed", "kv_heads", "head_dim"),
    "layers.wo": ("layers", "heads", "head_dim", "embed"),
    "layers.w_gate": ("layers", "embed", "mlp"),
    "layers.w_up": ("layers", "embed", "mlp"),
    "layers.w_down": ("layers", "mlp", "embed"),
}

LAYER_PARAMS = tuple(name.split(".", 1)[1] for name in PARAM_AXES if name.startswith("layers."))


def param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every parameter the config needs (lm_head only when not tied)."""
    L, D, H, K = config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads
    hd, F, V = config.head_dim, config.intermediate_size, config.vocab_size
    shapes = {
        "embed": (V, D),
        "final_norm": (D,),
        "lm_head": (D, V),
        "layers.attn_norm": (L, D),
        "layers.mlp_norm": (L, D),
        "layers.wq": (L, D, H, hd),
        "layers.wk": (L, D, K, hd),
        "layers.wv": (L, D, K, hd),
        "layers.wo": (L, H, hd, D),
        "layers.w_gate": (L, D, F),
        "layers.w_up": (L, D, F),
        "layers.w_down": (L, F, D),
    }
    if config.tie_word_embeddings:
        del shapes["lm_head"]
    return shapes


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Paged K and V for all layers: [layers, num_pages, page_size, kv_heads, head_dim]."""

    k: jax.Array
    v: jax.Array

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def page_size(self) -> int:
        return self.k.shape[2]


KV_CACHE_AXES = ("layers", "pages", "page_slot", "kv_heads", "head_dim")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Where each token of a ragged step lives (see pallas_kernels.ragged_paged_attention).

    slot_mapping: int32 [T]      cache slot each token's K/V is written to (pad: one past the end)
    page_table:   int32 [S, W]   page ids of each sequence
    cu_q_lens:    int32 [S + 1]  token range of each sequence in the flat run
    kv_lens:      int32 [S]      context length of each sequence after this step
    num_seqs:     int32 [1]      sequences in use (the rest are padding)
    """

    slot_mapping: jax.Array
    page_table: jax.Array
    cu_q_lens: jax.Array
    kv_lens: jax.Array
    num_seqs: jax.Array


class Llama(nnx.Module):
    """Llama-3 decoder: embeddings, scanned decoder layers, final norm, LM head.

    Parameters are nnx.Params holding (possibly sharded) arrays; each carries its
    logical axes as `logical_axes` metadata, which meshes.LogicalRules maps to the mesh.
    """

    def __init__(self, config: ModelConfig, params: dict[str, jax.Array]):
        expected = param_shapes(config)
        missing = sorted(set(expected) - set(params))
        unexpected = sorted(set(params) - set(expected))
        if missing or unexpected:
            raise ValueError(f"Llama params: missing {missing}, unexpected {unexpected}")
        for name, shape in expected.items():
            if tuple(params[name].shape) != shape:
                raise ValueError(f"parameter {name!r} has shape {tuple(params[name].shape)}, "
                                 f"expected {shape} for {config.name}")
        self.config = config
        self.embed = nnx.Param(params["embed"], logical_axes=PARAM_AXES["embed"])
        self.final_norm = nnx.Param(params["final_norm"], logical_axes=PARAM_AXES["final_norm"])
        self.lm_head = (None if config.tie_word_embeddings else
                        nnx.Param(params["lm_head"], logical_axes=PARAM_AXES["lm_head"]))
        self.layers = nnx.Dict({
            name: nnx.Param(params[f"layers.{name}"], logical_axes=PARAM_AXES[f"layers.{name}"])
            for name in LAYER_PARAMS})
        self.inv_freq = nnx.Variable(jnp.asarray(layers.rope_inv_freq(config)))

    def params(self) -> dict[str, jax.Array]:
        """Canonical name -> array (for checkpoint saving and inspection)."""
        out = {"embed": self.embed[...], "final_norm": self.final_norm[...]}
        if self.lm_head is not None:
            out["lm_head"] = self.lm_head[...]
        out.update({f"layers.{k}": v[...] for k, v in self.layers.items()})
        return out

    def __call__(self, token_ids, positions, kv_cache: KVCache, meta: AttentionMetadata,
                 *, attention_impl: str = "auto"):
        """token_ids, positions: int32 [T] -> (hidden [T, D], updated KVCache)."""
        config = self.config
        x = jnp.take(self.embed[...], token_ids, axis=0)
        stacked = {name: p[...] for name, p in self.layers.items()}
        layer_body = functools.partial(
            _decoder_layer, config=config, positions=positions, meta=meta,
            inv_freq=self.inv_freq[...], attention_impl=attention_impl)
        layer_ids = jnp.arange(config.num_layers, dtype=jnp.int32)
        (x, k, v), _ = jax.lax.scan(layer_body, (x, kv_cache.k, kv_cache.v), (stacked, layer_ids))
        x = layers.rms_norm(x, self.final_norm[...], config.rms_norm_eps)
        return x, KVCache(k=k, v=v)

    def logits(self, hidden):
        """hidden: [S, D] (already final-normed) -> float32 logits [S, V]."""
        head = self.embed[...].T if self.lm_head is None else self.lm_head[...]
        return jnp.einsum("sd,dv->sv", hidden, head, preferred_element_type=jnp.float32)


def _decoder_layer(carry, layer, *, config: ModelConfig, positions, meta: AttentionMetadata,
                   inv_freq, attention_impl: str):
    """One decoder layer inside the scan. The whole cache rides in the carry so the K/V
    write is an in-place scatter at [layer, slot] rather than a copy of a layer's pages."""
    x, k_cache, v_cache = carry
    p, layer_id = layer
    h = layers.rms_norm(x, p["attn_norm"], config.rms_norm_eps)
    q = jnp.einsum("td,dhk->thk", h, p["wq"])
    k = jnp.einsum("td,dhk->thk", h, p["wk"])
    v = jnp.einsum("td,dhk->thk", h, p["wv"])
    q = layers.apply_rope(q, positions, inv_freq)
    k = layers.apply_rope(k, positions, inv_freq)

    k_cache = layers.write_kv(k_cache, layer_id, k, meta.slot_mapping)
    v_cache = layers.write_kv(v_cache, layer_id, v, meta.slot_mapping)

    # Attend through a [layers * pages, ...] view of the whole cache with this layer's page
    # ids offset by layer * pages: slicing out k_cache[layer_id] would copy a whole layer
    # of the cache every layer of every step.
    num_pages = k_cache.shape[1]
    layer_meta = dataclasses.replace(meta, page_table=meta.page_table + layer_id * num_pages)
    attn, _ = paged_attention(q, _all_layer_pages(k_cache), _all_layer_pages(v_cache), layer_meta,
                              sm_scale=config.head_dim ** -0.5, impl=attention_impl)
    x = x + jnp.einsum("thk,hkd->td", attn.astype(x.dtype), p["wo"])
    h = layers.rms_norm(x, p["mlp_norm"], config.rms_norm_eps)
    x = x + layers.swiglu_mlp(h, p["w_gate"], p["w_up"], p["w_down"])
    return (x, k_cache, v_cache), None


def _all_layer_pages(cache):
    """[L, P, page_size, K, hd] -> [L * P, page_size, K, hd]: a free, contiguous view."""
    return cache.reshape(-1, *cache.shape[2:])


def one_sequence_metadata(num_tokens: int, page_size: int) -> AttentionMetadata:
    """Metadata of a single sequence prefilled from position 0 into pages 0, 1, 2, ..."""
    num_pages = -(-num_tokens // page_size)
    return AttentionMetadata(
        slot_mapping=jnp.arange(num_tokens, dtype=jnp.int32),
        page_table=jnp.arange(num_pages, dtype=jnp.int32)[None, :],
        cu_q_lens=jnp.array([0, num_tokens], dtype=jnp.int32),
        kv_lens=jnp.array([num_tokens], dtype=jnp.int32),
        num_seqs=jnp.array([1], dtype=jnp.int32))


def init_random_params(config: ModelConfig, key, shardings: dict, dtype) -> dict[str, jax.Array]:
    """Random weights (std 0.02, norms 1), each created directly in its sharding."""
    shapes = param_shapes(config)
    params = {}
    for i, (name, shape) in enumerate(sorted(shapes.items())):
        if name.endswith("norm"):
            make = functools.partial(jnp.ones, shape, dtype)
        else:
            make = functools.partial(lambda k, s: (0.02 * jax.random.normal(k, s)).astype(dtype),
                                     jax.random.fold_in(key, i), shape)
        params[name] = jax.jit(make, out_shardings=shardings[name])()
    return params


def numpy_dtype(name: str):
    return {"float32": np.float32, "bfloat16": jnp.bfloat16, "float16": np.float16}[name]
