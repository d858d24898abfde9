"""Every parameter of the Llama decoder, declared once, and how it is laid out on a mesh.

`param_specs(config)` is the one table (jax-llm-examples' `ArrayInfo`): for each canonical
name its shape from the config, its logical axes, its initializer and its names in Hugging
Face and GGUF checkpoints with the layout they store it in. Shapes, shardings, abstract
arrays, random init and the checkpoint loaders' name maps all derive from it; adding a
weight means adding one row here.

`MeshLayout` is how a config is placed on a mesh, and travels with the model as static
data: the mesh, the logical-axis rules every sharding and shard_map spec comes from, the
attention implementation, and two changes of shape that sharding needs:

- The vocabulary is padded up to a multiple of its mesh axis (vLLM and MaxText do the same):
  a checkpoint's vocabulary (32001, 50257, fine-tunes with added tokens) rarely divides tp.
  The padded rows of the embedding and columns of the LM head are zeros; their logits are
  cut off before sampling and before `Model.logits` returns.
- K/V heads are repeated so that every device holds whole K/V heads for its own query
  heads (Megatron/vLLM GQA serving at tp > kv_heads): with H query heads, K K/V heads and
  heads over d devices, each K/V head is stored r = lcm(K, d) / K times, consecutively.
  Stored head j holds original head j // r, so query head h still reads original head
  h // (H / K), and the paged kernel runs per device with its plain GQA layout.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from medha_jax.config import FAMILIES, ModelConfig
from meshes import LogicalRules

# How a checkpoint stores a tensor, relative to the canonical layout:
#   "as_is":      same layout (norm vectors; the embedding [V, D]).
#   "linear":     nn.Linear [out, in] -> canonical [in, out].
#   "qk_heads":   [heads * hd, in] -> [in, heads, hd]; GGUF interleaves the rotary pairs.
#   "v_heads":    [heads * hd, in] -> [in, heads, hd].
#   "o_heads":    [out, heads * hd] -> [heads, hd, out].
#   "qk_bias":    [heads * hd] -> [heads, hd]; GGUF interleaves the rotary pairs (as qk_heads).
#   "v_bias":     [heads * hd] -> [heads, hd].
STORED_LAYOUTS = ("as_is", "linear", "qk_heads", "v_heads", "o_heads", "qk_bias", "v_bias")


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One parameter. Per-layer weights (first logical axis "layers") are stacked over layers
    and named per layer in checkpoints, with "{layer}" in their names."""

    shape: tuple[int, ...]                  # canonical shape, from the config
    logical_axes: tuple[str | None, ...]
    init: str                               # "normal" (std 0.02), "ones" or "zeros"
    hf_name: str                            # name in a *ForCausalLM state dict
    gguf_name: str                          # llama.cpp's name
    stored_layout: str                      # one of STORED_LAYOUTS

    def __post_init__(self):
        if len(self.shape) != len(self.logical_axes):
            raise ValueError(f"{self.shape=} and {self.logical_axes=} differ in rank")
        if self.init not in ("normal", "ones", "zeros"):
            raise ValueError(f"{self.init=} must be 'normal', 'ones' or 'zeros'")
        if self.stored_layout not in STORED_LAYOUTS:
            raise ValueError(f"{self.stored_layout=} must be one of {STORED_LAYOUTS}")

    @property
    def per_layer(self) -> bool:
        return self.logical_axes[0] == "layers"

    def checkpoint_name(self, checkpoint_format: str) -> str:
        return {"hf": self.hf_name, "gguf": self.gguf_name}[checkpoint_format]


def param_specs(config: ModelConfig) -> dict[str, ParamSpec]:
    """The table: canonical name -> ParamSpec (lm_head only when not tied)."""
    L, D, H, K = config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads
    hd, F, V = config.head_dim, config.intermediate_size, config.vocab_size
    hf_layer, gguf_layer = "model.layers.{layer}.", "blk.{layer}."
    specs = {
        "embed": ParamSpec((V, D), ("vocab", "embed"), "normal",
                           "model.embed_tokens.weight", "token_embd.weight", "as_is"),
        "final_norm": ParamSpec((D,), ("embed",), "ones",
                                "model.norm.weight", "output_norm.weight", "as_is"),
        "lm_head": ParamSpec((D, V), ("embed", "vocab"), "normal",
                             "lm_head.weight", "output.weight", "linear"),
        "layers.attn_norm": ParamSpec((L, D), ("layers", "embed"), "ones",
                                      hf_layer + "input_layernorm.weight",
                                      gguf_layer + "attn_norm.weight", "as_is"),
        "layers.mlp_norm": ParamSpec((L, D), ("layers", "embed"), "ones",
                                     hf_layer + "post_attention_layernorm.weight",
                                     gguf_layer + "ffn_norm.weight", "as_is"),
        "layers.wq": ParamSpec((L, D, H, hd), ("layers", "embed", "heads", "head_dim"), "normal",
                               hf_layer + "self_attn.q_proj.weight",
                               gguf_layer + "attn_q.weight", "qk_heads"),
        "layers.wk": ParamSpec((L, D, K, hd), ("layers", "embed", "kv_heads", "head_dim"),
                               "normal", hf_layer + "self_attn.k_proj.weight",
                               gguf_layer + "attn_k.weight", "qk_heads"),
        "layers.wv": ParamSpec((L, D, K, hd), ("layers", "embed", "kv_heads", "head_dim"),
                               "normal", hf_layer + "self_attn.v_proj.weight",
                               gguf_layer + "attn_v.weight", "v_heads"),
        "layers.wo": ParamSpec((L, H, hd, D), ("layers", "heads", "head_dim", "embed"), "normal",
                               hf_layer + "self_attn.o_proj.weight",
                               gguf_layer + "attn_output.weight", "o_heads"),
        "layers.w_gate": ParamSpec((L, D, F), ("layers", "embed", "mlp"), "normal",
                                   hf_layer + "mlp.gate_proj.weight",
                                   gguf_layer + "ffn_gate.weight", "linear"),
        "layers.w_up": ParamSpec((L, D, F), ("layers", "embed", "mlp"), "normal",
                                 hf_layer + "mlp.up_proj.weight",
                                 gguf_layer + "ffn_up.weight", "linear"),
        "layers.w_down": ParamSpec((L, F, D), ("layers", "mlp", "embed"), "normal",
                                   hf_layer + "mlp.down_proj.weight",
                                   gguf_layer + "ffn_down.weight", "linear"),
    }
    # The families' differences from the Llama block (config.FAMILIES).
    family = config.family_spec
    if family.qkv_bias:
        for key, heads, axis, layout in (("q", H, "heads", "qk_bias"),
                                         ("k", K, "kv_heads", "qk_bias"),
                                         ("v", K, "kv_heads", "v_bias")):
            specs[f"layers.b{key}"] = ParamSpec(
                (L, heads, hd), ("layers", axis, "head_dim"), "normal",
                hf_layer + f"self_attn.{key}_proj.bias", gguf_layer + f"attn_{key}.bias", layout)
    if family.qk_norm:
        for key in ("q", "k"):
            specs[f"layers.{key}_norm"] = ParamSpec(
                (L, hd), ("layers", "head_dim"), "ones", hf_layer + f"self_attn.{key}_norm.weight",
                gguf_layer + f"attn_{key}_norm.weight", "as_is")
    if family.post_norms:
        # Gemma-3: its post_attention_layernorm norms the attention's output, and the norm
        # before the MLP (Llama's mlp_norm) is its pre_feedforward_layernorm.
        specs["layers.mlp_norm"] = dataclasses.replace(
            specs["layers.mlp_norm"], hf_name=hf_layer + "pre_feedforward_layernorm.weight")
        for key, hf, gguf in (("post_attn_norm", "post_attention_layernorm", "post_attention_norm"),
                              ("post_mlp_norm", "post_feedforward_layernorm", "post_ffw_norm")):
            specs[f"layers.{key}"] = ParamSpec((L, D), ("layers", "embed"), "ones",
                                               hf_layer + f"{hf}.weight",
                                               gguf_layer + f"{gguf}.weight", "as_is")
    if family.norm_offset:
        # (offset + w) norms: the identity scale is w = 0.
        specs = {name: dataclasses.replace(spec, init="zeros") if spec.init == "ones" else spec
                 for name, spec in specs.items()}
    if config.tie_word_embeddings:
        del specs["lm_head"]
    return specs


# Logical axes of the paged KV cache: [layers, pages, page_size, kv_heads * head_dim].
# K/V heads are folded into the last axis (heads-major, so a kv_heads shard holds whole
# heads): with one K/V head per device a separate heads axis has size 1 on every device,
# and XLA's layout assignment may move a size-1 axis anywhere, which for the cache is a
# copy of all of it at the step's entry and exit and of a layer inside the layer scan.
# A shard_map body unfolds its own part, [..., kv_heads / tp, head_dim], for the kernels.
KV_CACHE_AXES = ("layers", "pages", "page_slot", "kv_heads")


@dataclasses.dataclass(frozen=True)
class MeshLayout:
    """How a ModelConfig is laid out on a mesh. Static and hashable: part of the model's
    graph definition, so every jitted function and shard_map sees the same rules.

    attention_impl is already resolved ("xla", "pallas", "interpret", "pallas-tpu",
    "interpret-tpu"), never "auto".
    """

    mesh: Mesh
    rules: LogicalRules
    attention_impl: str
    padded_vocab_size: int
    kv_head_replicas: int

    @classmethod
    def create(cls, config: ModelConfig, mesh: Mesh, rules: LogicalRules,
               attention_impl: str) -> MeshLayout:
        heads_axis, kv_heads_axis = rules.mesh_axis("heads"), rules.mesh_axis("kv_heads")
        if kv_heads_axis is not None and kv_heads_axis != heads_axis:
            raise ValueError(
                f"rules map kv_heads -> {kv_heads_axis!r} but heads -> {heads_axis!r}: a device "
                "must hold the K/V heads of its own query heads (map both to the same axis, or "
                "kv_heads to None to replicate them)")
        kv_degree = _degree(mesh, kv_heads_axis)
        replicas = math.lcm(config.num_kv_heads, kv_degree) // config.num_kv_heads
        vocab_degree = _degree(mesh, rules.mesh_axis("vocab"))
        padded_vocab = -(-config.vocab_size // vocab_degree) * vocab_degree
        return cls(mesh=mesh, rules=rules, attention_impl=attention_impl,
                   padded_vocab_size=padded_vocab, kv_head_replicas=replicas)

    def placed_shape(self, spec: ParamSpec) -> tuple[int, ...]:
        """The shape `spec` has on the mesh: vocabulary padded, K/V heads repeated."""
        shape = list(spec.shape)
        for dim, logical in enumerate(spec.logical_axes):
            if logical == "vocab":
                shape[dim] = self.padded_vocab_size
            elif logical == "kv_heads":
                shape[dim] *= self.kv_head_replicas
        return tuple(shape)

    def sharding(self, shape, logical_axes) -> NamedSharding:
        return self.rules.sharding(self.mesh, shape, logical_axes)

    def param_sharding(self, spec: ParamSpec) -> NamedSharding:
        return self.sharding(self.placed_shape(spec), spec.logical_axes)

    def expand(self, spec: ParamSpec, canonical):
        """The placed array from the whole canonical one (jnp; used under jit for random init)."""
        out = canonical
        for dim, logical in enumerate(spec.logical_axes):
            if logical == "vocab":
                pad = [(0, 0)] * out.ndim
                pad[dim] = (0, self.padded_vocab_size - spec.shape[dim])
                out = jnp.pad(out, pad)
            elif logical == "kv_heads" and self.kv_head_replicas > 1:
                out = jnp.repeat(out, self.kv_head_replicas, axis=dim)
        return out

    def placed_reader(self, spec: ParamSpec, read):
        """A reader of slices of the placed tensor, from a reader of the canonical one.

        read(index: tuple[slice, ...]) -> np.ndarray over the canonical shape. The placed
        tensor's padded vocabulary entries read as zeros; a repeated K/V head reads its
        original head.
        """
        axes = spec.logical_axes

        def placed_read(index: tuple[slice, ...]) -> np.ndarray:
            index = tuple(index) + (slice(None),) * (len(axes) - len(index))
            placed = self.placed_shape(spec)
            ranges = [range(*s.indices(n)) for s, n in zip(index, placed)]
            source_index, fix_ups = [], []
            for dim, (logical, span) in enumerate(zip(axes, ranges)):
                start, stop = (span.start, span.stop) if len(span) else (0, 0)
                if logical == "vocab":
                    real_stop = min(stop, spec.shape[dim])
                    source_index.append(slice(start, max(start, real_stop)))
                    fix_ups.append((dim, "pad", stop - start))
                elif logical == "kv_heads" and self.kv_head_replicas > 1:
                    r = self.kv_head_replicas
                    first = start // r
                    last = (stop - 1) // r + 1 if stop > start else first
                    source_index.append(slice(first, last))
                    fix_ups.append((dim, "repeat", (start - first * r, stop - start)))
                else:
                    source_index.append(slice(start, stop))
            out = read(tuple(source_index))
            for dim, kind, arg in fix_ups:
                if kind == "pad":
                    pad = [(0, 0)] * out.ndim
                    pad[dim] = (0, arg - out.shape[dim])
                    out = np.pad(out, pad)
                else:
                    offset, length = arg
                    out = np.repeat(out, self.kv_head_replicas, axis=dim)
                    out = np.take(out, np.arange(offset, offset + length), axis=dim)
            return out

        return placed_read

    def canonical(self, spec: ParamSpec, placed):
        """The canonical (checkpoint) view of a placed array: padding cut, repeats dropped."""
        index = []
        for dim, logical in enumerate(spec.logical_axes):
            if logical == "vocab":
                index.append(slice(0, spec.shape[dim]))
            elif logical == "kv_heads":
                index.append(slice(None, None, self.kv_head_replicas))
            else:
                index.append(slice(None))
        return placed[tuple(index)]


def _degree(mesh: Mesh, mesh_axis: str | None) -> int:
    return 1 if mesh_axis is None else mesh.shape[mesh_axis]


def kv_cache_shape(config: ModelConfig, layout: MeshLayout, num_layers: int, num_pages: int,
                   page_size: int) -> tuple[int, int, int, int]:
    """[num_layers, num_pages, page_size, kv_heads * head_dim] of a cache on `layout`'s mesh
    (num_pages over all KV shards; kv_heads as placed, repeated when tp exceeds them)."""
    kv_heads = config.num_kv_heads * layout.kv_head_replicas
    return (num_layers, num_pages, page_size, kv_heads * config.head_dim)



def checkpoint_names(checkpoint_format: str) -> dict[str, str]:
    """Canonical name -> its name in an "hf" or "gguf" checkpoint ("{layer}" in per-layer ones),
    over every family."""
    # Names do not depend on shapes: untied configs of every family list every parameter.
    # A row a family renames (Gemma's mlp_norm) keeps the Llama table's name here; a loader
    # reads each config's own names from `param_specs`.
    names = {}
    for family in FAMILIES:
        config = ModelConfig(name="names", family=family, vocab_size=1, hidden_size=1,
                             num_layers=1, num_heads=1, num_kv_heads=1, head_dim=2,
                             intermediate_size=1)
        for key, spec in param_specs(config).items():
            names.setdefault(key, spec.checkpoint_name(checkpoint_format))
    return names
