"""Stream pipeline parallelism (SPP, seed 000 section 3.3): a loaded model split into stages.

The replica mesh's spp slices are sub-meshes. Stage s owns a contiguous range of the
decoder layers: only those layers' weights and KV cache live on its sub-mesh (tp and kvp
work inside the stage as on the whole mesh), the first stage also holds the embedding and
the last the final norm and LM head. Each stage runs as its own program (MPMD, one jit per
stage; the engine's pipeline hands activations on with `jax.device_put`), so no stage ever
gathers another stage's weights, and stages may run different batches at once.

    split_stages(model) -> [Stage, ...]          one per spp slice, in layer order
    stage_forward(spec, params, kv_cache, x, positions, meta, logits_indices)
        first stage:  x = token ids int32 [T]  -> hidden [T, D]
        middle stage: x = hidden [T, D]        -> hidden [T, D]
        last stage:   x = hidden [T, D]        -> float32 logits [S, vocab] of rows logits_indices,
                                                  or without them final-normed hidden [T, D]
    stage_logits(spec, params, hidden)            the last stage's LM head: [R, D] -> [R, vocab]
    (a lone stage, spp = 1, is first and last: token ids -> logits)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding

from medha_jax.config import ModelConfig
from medha_jax.model import layers
from medha_jax.model.attention import AttentionMetadata
from medha_jax.model.llama import KVCache, decoder_layers, lm_logits, numpy_dtype
from medha_jax.model.loading import Model
from medha_jax.model.params import KV_CACHE_AXES, MeshLayout, kv_cache_shape, param_specs


@dataclasses.dataclass(frozen=True)
class StageSpec:
    """The static part of a stage: hashable, so it is a static argument of the stage's jit.

    layout: the stage's MeshLayout (its sub-mesh, the model's rules and attention impl).
    Layers [layer_start, layer_stop) of the model run here.
    """

    config: ModelConfig
    layout: MeshLayout
    index: int
    num_stages: int
    layer_start: int
    layer_stop: int

    def __post_init__(self):
        if not 0 <= self.index < self.num_stages:
            raise ValueError(f"stage {self.index=} must lie in [0, {self.num_stages=})")
        if not 0 <= self.layer_start < self.layer_stop <= self.config.num_layers:
            raise ValueError(f"layers [{self.layer_start=}, {self.layer_stop=}) must be a "
                             f"non-empty range inside [0, {self.config.num_layers})")

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def num_layers(self) -> int:
        return self.layer_stop - self.layer_start

    @property
    def mesh(self) -> Mesh:
        return self.layout.mesh

    def param_names(self) -> list[str]:
        """Canonical names of the parameters this stage holds."""
        names = [name for name, spec in param_specs(self.config).items() if spec.per_layer]
        if self.is_first or (self.is_last and self.config.tie_word_embeddings):
            names.append("embed")       # a tied LM head is the embedding
        if self.is_last:
            names.append("final_norm")
            if not self.config.tie_word_embeddings:
                names.append("lm_head")
        return names

    def hidden_sharding(self, num_tokens: int) -> NamedSharding:
        """Where this stage wants its input activations hidden [T, D]."""
        return self.layout.sharding((num_tokens, self.config.hidden_size), ("tokens", "embed"))

    def kv_cache_sharding(self, num_pages: int, page_size: int):
        """Shape [layers of this stage, pages, page_size, kv_heads * head_dim] and sharding."""
        shape = kv_cache_shape(self.config, self.layout, self.num_layers, num_pages, page_size)
        return shape, self.layout.sharding(shape, KV_CACHE_AXES)


@dataclasses.dataclass(frozen=True)
class Stage:
    """One pipeline stage: its static spec and its parameters on its sub-mesh.

    params: canonical name -> placed array; per-layer ones hold only this stage's layers
    ([num_layers of the stage, ...]).
    """

    spec: StageSpec
    params: dict[str, jax.Array]

    @property
    def mesh(self) -> Mesh:
        return self.spec.mesh

    def new_kv_cache(self, num_pages: int, page_size: int) -> KVCache:
        """Zeroed paged cache of this stage's layers, created directly in its sharding."""
        shape, sharding = self.spec.kv_cache_sharding(num_pages, page_size)
        dtype = numpy_dtype(self.spec.config.dtype)
        zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
        return KVCache(k=zeros(), v=zeros())

    def weight_bytes_per_device(self) -> dict[jax.Device, int]:
        """Bytes of this stage's parameters on each device, from the arrays' own shards."""
        out: dict[jax.Device, int] = {}
        for array in self.params.values():
            for shard in array.addressable_shards:
                out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
        return out


def num_stages(mesh: Mesh) -> int:
    """Pipeline stages of a replica mesh: its spp degree."""
    return mesh.shape["spp"]


def stage_submeshes(mesh: Mesh) -> list[Mesh]:
    """The replica mesh's spp slices, each a mesh with the same axis names and spp = 1."""
    spp_dim = mesh.axis_names.index("spp")
    axis_types = getattr(mesh, "axis_types", None) or (AxisType.Auto,) * len(mesh.axis_names)
    return [Mesh(np.take(mesh.devices, [s], axis=spp_dim), mesh.axis_names,
                 axis_types=tuple(axis_types))
            for s in range(mesh.shape["spp"])]


def split_stages(model: Model) -> list[Stage]:
    """Splits a loaded model into one stage per spp slice of its mesh, layers in equal runs.

    Each stage's arrays are built device by device from the shards its devices already
    hold where they can be (a model loaded with layers -> spp holds exactly its stage's
    layers on each slice): nothing moves between devices, no device ever holds the whole
    stack, and a shard that is exactly a stage's part is the same buffer, not a copy. The
    stages therefore share buffers with the model: drop the model's references
    (`Model.release_weights`, as the Engine does) rather than delete its arrays.
    """
    model.require_weights()
    config = model.config
    submeshes = stage_submeshes(model.mesh)
    num_stages = len(submeshes)
    if config.num_layers % num_stages:
        raise ValueError(f"{config.num_layers=} must be a multiple of spp={num_stages}")
    per_stage = config.num_layers // num_stages
    specs = param_specs(config)
    placed = _placed_params(model)
    stages = []
    for s, submesh in enumerate(submeshes):
        layout = MeshLayout.create(config, submesh, model.rules, model.layout.attention_impl)
        spec = StageSpec(config=config, layout=layout, index=s, num_stages=num_stages,
                         layer_start=s * per_stage, layer_stop=(s + 1) * per_stage)
        params = {}
        for name in spec.param_names():
            array, param_spec = placed[name], specs[name]
            index = tuple(slice(None) for _ in array.shape)
            if param_spec.per_layer:
                index = (slice(spec.layer_start, spec.layer_stop),) + index[1:]
            shape = (spec.num_layers,) + array.shape[1:] if param_spec.per_layer else array.shape
            params[name] = _take(array, index, layout.sharding(shape, param_spec.logical_axes))
        stages.append(Stage(spec=spec, params=params))
    return stages


def _placed_params(model: Model) -> dict[str, jax.Array]:
    """Canonical name -> the model's placed array (vocabulary padded, K/V heads repeated)."""
    module = model.module
    placed = {"embed": module.embed[...], "final_norm": module.final_norm[...]}
    if module.lm_head is not None:
        placed["lm_head"] = module.lm_head[...]
    placed.update({f"layers.{name}": p[...] for name, p in module.layers.items()})
    return placed


def _take(array: jax.Array, index: tuple[slice, ...], sharding: NamedSharding) -> jax.Array:
    """array[index] placed with `sharding`, assembled from what each target device already
    holds of `array`; a cross-device copy only where a device does not hold its part."""
    shape = tuple(len(range(*s.indices(n))) for s, n in zip(index, array.shape))
    held = {shard.device: shard for shard in array.addressable_shards}
    pieces = []
    for device, target in sharding.addressable_devices_indices_map(shape).items():
        shard = held.get(device)
        if shard is None:
            return jax.device_put(array[index], sharding)
        local = []
        for outer, inner, have, n, m in zip(index, target, shard.index, array.shape, shape):
            o_start, _, _ = outer.indices(n)
            i_start, i_stop, _ = inner.indices(m)
            h_start, h_stop, _ = have.indices(n)
            start, stop = o_start + i_start, o_start + i_stop      # in array's coordinates
            if start < h_start or stop > h_stop:
                return jax.device_put(array[index], sharding)
            local.append(slice(start - h_start, stop - h_start))
        # An index that takes the whole shard hands back the same buffer: shared with the
        # model, so a device never holds its stage's weights twice, even while splitting.
        pieces.append(shard.data[tuple(local)])
    # No pieces: a stage whose devices are all on other processes (spp across processes):
    # this process holds its shape and sharding only (serving.multihost).
    return jax.make_array_from_single_device_arrays(shape, sharding, pieces, dtype=array.dtype)


def stage_forward(spec: StageSpec, params: dict[str, jax.Array], kv_cache: KVCache, x,
                  positions, meta: AttentionMetadata, logits_indices=None):
    """One stage's part of a forward step. Pure and jittable (spec static).

    x: int32 token ids [T] on the first stage, else hidden [T, D] from the stage before;
    positions: int32 [T]; kv_cache: this stage's layers only; logits_indices: int32 [S],
    the rows whose logits the last stage returns.
    Returns (hidden [T, D], kv_cache); on the last stage (float32 logits [S, vocab_size],
    kv_cache), or without logits_indices (final-normed hidden [T, D], kv_cache), for a step
    that also scores other rows (prompt logprobs) through `stage_logits`.
    """
    config = spec.config
    if spec.is_first:
        x = layers.embed_tokens(params["embed"], x, config)
    stacked = {name.split(".", 1)[1]: array for name, array in params.items()
               if name.startswith("layers.")}
    x, kv_cache = decoder_layers(x, stacked, kv_cache, positions, meta, config=config,
                                 layout=spec.layout,
                                 inv_freq=jnp.asarray(layers.rope_inv_freq(config)),
                                 first_layer=spec.layer_start)
    if not spec.is_last:
        return x, kv_cache
    # The norm is per row, so norming all rows and taking some equals the other order.
    hidden = layers.rms_norm(x, params["final_norm"], config.rms_norm_eps,
                             config.family_spec.norm_offset)
    if logits_indices is None:
        return hidden, kv_cache
    return stage_logits(spec, params, hidden[logits_indices]), kv_cache


def stage_logits(spec: StageSpec, params: dict[str, jax.Array], hidden):
    """The last stage's LM head: final-normed hidden [R, D] -> float32 logits [R, vocab]."""
    if not spec.is_last:
        raise ValueError(f"stage {spec.index} is not the last: it holds no LM head")
    return lm_logits(hidden, params.get("embed"), params.get("lm_head"), spec.config.vocab_size,
                     spec.config.final_logit_softcapping)
