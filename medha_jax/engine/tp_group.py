"""A tensor-parallel group bound from data-parallel base replicas, without moving a weight
or a KV page (seed 004, Flying Serving, Eqs. 1-4).

m DP engines of b devices each (an aligned, contiguous run of the host's base replicas,
each one device or a TP-b replica) bind into one TP-(m * b) engine over their m * b
devices, a [member, local] mesh: device (r, j) is device j of member r's TP-b mesh. Nothing
is copied at the bind:

- Weights (Eq. 1, W_active^(r) = View(W_full, dim, r, m)). Each member keeps the weights it
  loaded: with b = 1 the full weights, with b > 1 its TP-b shards (device j: heads, mlp
  columns and vocabulary rows j * n / b ...). The group's program takes them as one global
  array per weight, [m * n0, ...] over the group's mesh, whose shard on device (r, j) IS
  member r's buffer on its device j (`jax.make_array_from_single_device_arrays`: no
  transfer, no new storage), and a shard_map body in which device (r, j) uses the r-th of
  m slices of what it holds: its columns (wq/wk/wv/w_gate/w_up: heads and mlp columns)
  and rows (wo, w_down), sliced per layer inside the layer scan, with one psum over the
  whole group after wo and one after w_down (Megatron: one all-reduce per pair). So rank
  j * m + r of TP-(m * b) computes heads (j * m + r) * H / (m * b) ...: the heads a static
  TP-(m * b) replica would give it. In the optimized HLO (CPU, jax 0.10.2) each rank's
  slice of a layer is one dynamic-slice of the stacked weight (layer and rank at once),
  materialised as a transient loop fusion of 1/m of that layer's local matrix per scan
  iteration; no whole-layer copy, nothing persistent. The embedding, norms and LM head are
  used as each member holds them: whole on every device with b = 1 (computed
  redundantly); with b > 1 vocabulary-parallel over the member's b devices, as the member
  itself runs them (the lookup masked and summed, the logits all-gathered for sampling).
- KV pages (Eqs. 2-4). Block bytes are constant: a member's device holds
  [L, P, page_size, K_b * hd] of its K_b = K / b K/V heads; device (r, j) of the TP-(m * b)
  program reads the same buffer as [L, P, page_size * K_b / k_r, k_r * hd] with
  k_r = max(1, K_b / m) of its own K/V heads (a bitcast of each page: B(p) = p * B_base
  when K_b >= m). With K_b < m (GQA with few K/V heads) each device keeps the one K/V head
  of its query heads, so a page holds page_size * K_b tokens and the group pools K_b x one
  replica's tokens, not m x.
  The group's allocator (`GroupAllocator`) hands out logical pages of that size; each
  logical page is one physical page of every member, booked in the member's own pool
  under a holder id of its own, so DP pages and TP pages coexist in one pool and each
  side's free count is exact. Members' page ids need not agree: the program gets each
  rank's own slot mapping and page table (the int32 step inputs, [m, n] over the ranks).
- The cache arrays go in assembled the same way and donated, and come back split into the
  members' own buffers (in place: the same device pointers).

Every (bucket) program is compiled ahead of time by `warmup()` like any Engine's; after
warm-up no switch compiles anything (the engine's guard applies unchanged).

Base replicas must be engines of one model and engine config whose mesh is tp only
(kvp = cp = spp = 1), with tp dividing the K/V heads.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from medha_jax.buckets import BucketLadder
from medha_jax.engine import step_cache
from medha_jax.engine.engine import Engine, EngineConfig
from medha_jax.engine.logprobs import StepOutputs, sample_with_logprobs
from medha_jax.engine.step_inputs import StepInputs, unpack_int32
from medha_jax.kv_cache.allocator import BlockAllocator, free_if_held
from medha_jax.model import AttentionMetadata, KVCache
from medha_jax.model import layers
from medha_jax.model.attention import _attend_on_device
from medha_jax.model.llama import lm_logits

# The group mesh's axes: the member, and the device within the member's own TP mesh. Only
# this module's shard_map wrapper names them.
MEMBER_AXIS, LOCAL_AXIS = "member", "local"
GROUP_AXES = (MEMBER_AXIS, LOCAL_AXIS)


@dataclasses.dataclass(frozen=True)
class TPShape:
    """How a config splits over m members of TP-b: per-device query heads, K/V heads, mlp
    columns, and how many tokens one physical page holds under the TP layout (Eq. 3)."""

    group_size: int          # m, members
    heads: int
    kv_heads: int
    mlp: int
    page_tokens: int
    base_tp: int = 1         # b, each member's devices

    @classmethod
    def of(cls, config, group_size: int, page_size: int, base_tp: int = 1) -> TPShape:
        m, b = group_size, base_tp
        H, F = config.num_heads // b, config.intermediate_size // b     # one member's device
        K = config.num_kv_heads // b
        if config.num_kv_heads % b or config.num_heads % b or config.intermediate_size % b:
            raise ValueError(f"TP-{b} base replicas need num_kv_heads "
                             f"({config.num_kv_heads}), num_heads and intermediate_size "
                             f"divisible by {b}")
        family = config.family_spec
        if config.mixed_layers or family.post_norms or family.mlp_activation != "silu" \
                or family.scale_embedding or family.norm_offset:
            # The group's layer (_tp_layer) is the Llama/Qwen/Mistral block; Gemma-3's
            # interleaved layers, extra norms and GeGLU are not written there yet.
            raise ValueError(f"TP groups serve the Llama-style families, not {config.family!r}")
        if H % m or F % m:
            raise ValueError(f"a group of {m} TP-{b} replicas needs num_heads "
                             f"({config.num_heads}) and intermediate_size "
                             f"({config.intermediate_size}) divisible by {m * b}")
        if K % m and m % K:
            raise ValueError(f"a group of {m} TP-{b} replicas needs num_kv_heads / {b} "
                             f"({K}: num_kv_heads={config.num_kv_heads}) to divide or be a "
                             f"multiple of {m}")
        kv = max(1, K // m)
        return cls(m, H // m, kv, F // m, page_size * K // kv, b)


class GroupAllocator(BlockAllocator):
    """The TP group's pages: logical pages of `page_tokens` tokens, each backed by one
    physical page of every member's own pool (booked there under `holder_id(request)`).

    No prefix caching (a TP page's bytes are not a DP page's). `physical(rank)` maps the
    group's logical page ids to rank's physical ones."""

    def __init__(self, members: Sequence[BlockAllocator], page_tokens: int, tag: str):
        pages = members[0].pages_per_shard
        if any(a.num_shards != 1 or a.pages_per_shard != pages for a in members):
            raise ValueError("a TP group's members need single-shard pools of equal size")
        super().__init__(pages, page_tokens, enable_prefix_caching=False)
        self.members = list(members)
        self.tag = tag
        self._physical = np.zeros((len(members), pages), np.int32)    # [rank, logical page]

    def holder_id(self, request_id: str) -> str:
        """The id a member's pool books this group's request's pages under."""
        return f"{self.tag}:{request_id}"

    @property
    def num_free_pages(self) -> int:
        return min(super().num_free_pages, *(a.num_free_pages for a in self.members))

    def num_free_pages_on(self, shard: int) -> int:
        return min(super().num_free_pages_on(shard), *(a.num_free_pages for a in self.members))

    def reserve(self, request_id: str, num_tokens: int) -> bool:
        had = self._get(request_id).num_pages
        if not super().reserve(request_id, num_tokens):
            return False
        table = self.page_table_array(request_id)
        if len(table) == had:
            return True
        holder = self.holder_id(request_id)
        for rank, member in enumerate(self.members):
            if not member.has(holder):
                member.allocate(holder)
            # Cannot fail: num_free_pages_on bounded the super().reserve by every member.
            assert member.reserve(holder, len(table) * member.page_size)
            self._physical[rank, table[had:]] = member.page_table_array(holder)[had:]
        return True

    def free(self, request_id: str) -> None:
        super().free(request_id)
        holder = self.holder_id(request_id)
        for member in self.members:
            free_if_held(member, holder)

    def physical(self, rank: int) -> np.ndarray:
        """int32 [pages]: rank's physical page id of each logical page (held ones)."""
        return self._physical[rank]


def _slice(w, start, size: int, axis: int):
    return jax.lax.dynamic_slice_in_dim(w, start, size, axis)


def _tp_layer(carry, layer, *, config, tp: TPShape, positions, meta, inv_freq, impl: str):
    """One decoder layer on device (r, j) of the group: the r-th of m slices of what the
    device holds, its heads' columns of wq/wk/wv, its rows of wo, its mlp columns/rows; one
    psum over the group after wo and one after w_down."""
    x, k_cache, v_cache = carry
    p, layer_id = layer
    r = jax.lax.axis_index(MEMBER_AXIS)
    local_kv_heads = config.num_kv_heads // tp.base_tp
    q0, k0, f0 = r * tp.heads, r * local_kv_heads // tp.group_size, r * tp.mlp
    h = layers.rms_norm(x, p["attn_norm"], config.rms_norm_eps)
    q = jnp.einsum("td,dhk->thk", h, _slice(p["wq"], q0, tp.heads, 1))
    k = jnp.einsum("td,dhk->thk", h, _slice(p["wk"], k0, tp.kv_heads, 1))
    v = jnp.einsum("td,dhk->thk", h, _slice(p["wv"], k0, tp.kv_heads, 1))
    if config.family_spec.qkv_bias:
        q = q + _slice(p["bq"], q0, tp.heads, 0)
        k = k + _slice(p["bk"], k0, tp.kv_heads, 0)
        v = v + _slice(p["bv"], k0, tp.kv_heads, 0)
    if config.family_spec.qk_norm:
        q = layers.rms_norm(q, p["q_norm"], config.rms_norm_eps)
        k = layers.rms_norm(k, p["k_norm"], config.rms_norm_eps)
    rope_scale = layers.rope_attention_factor(config)
    q = layers.apply_rope(q, positions, inv_freq, rope_scale)
    k = layers.apply_rope(k, positions, inv_freq, rope_scale)
    # windowed=True: one kind of layer (the window, if the model has one, applies to all);
    # models with interleaved sliding and full layers are refused in TPShape.of.
    attn, k_cache, v_cache = _attend_on_device(
        q, k, v, positions, k_cache, v_cache, layer_id, jnp.asarray(True), meta,
        sm_scale=config.head_dim ** -0.5,
        impl=impl, kv_shard_axis=None, num_shards=1, cp=1, cp_axis=None,
        sliding_window=config.sliding_window)
    out = jnp.einsum("thk,hkd->td", attn.astype(x.dtype), _slice(p["wo"], q0, tp.heads, 0))
    x = x + jax.lax.psum(out, GROUP_AXES)
    h = layers.rms_norm(x, p["mlp_norm"], config.rms_norm_eps)
    mlp = layers.gated_mlp(h, _slice(p["w_gate"], f0, tp.mlp, 1),
                           _slice(p["w_up"], f0, tp.mlp, 1), _slice(p["w_down"], f0, tp.mlp, 0))
    x = x + jax.lax.psum(mlp, GROUP_AXES)
    return (x, k_cache, v_cache), None


def _embed(embed, token_ids, base_tp: int):
    """[tokens, D] rows of the embedding. With b > 1 the device holds rows j * V / b ...
    (the member's vocabulary shard): the lookup is masked to them and summed over the
    member's devices, as a vocabulary-parallel embedding."""
    if base_tp == 1:
        return jnp.take(embed, token_ids, axis=0)
    rows = embed.shape[0]
    local = token_ids - jax.lax.axis_index(LOCAL_AXIS) * rows
    mine = (local >= 0) & (local < rows)
    found = jnp.take(embed, jnp.where(mine, local, 0), axis=0)
    return jax.lax.psum(jnp.where(mine[:, None], found, 0), LOCAL_AXIS)


def _logits(hidden, *, embed, lm_head, vocab_size: int, base_tp: int):
    """float32 [S, vocab_size] logits. With b > 1 each device computes its vocabulary
    shard's and the member's devices gather them (what sampling needs whole)."""
    if base_tp == 1:
        return lm_logits(hidden, embed, lm_head, vocab_size)
    head = embed.T if lm_head is None else lm_head
    local = jnp.einsum("sd,dv->sv", hidden, head, preferred_element_type=jnp.float32)
    return jax.lax.all_gather(local, LOCAL_AXIS, axis=1, tiled=True)[:, :vocab_size]


def _tp_rank_step(weights, kv_cache: KVCache, ints, floats, rng_keys, *, shape, config,
                  tp: TPShape, impl: str):
    """The per-device body. weights: what device (r, j) of the group holds of member r's
    weights; kv_cache: its own [L, P, page_size, K_b * hd] buffers, read as
    [L, P, tp.page_tokens, kv_heads * hd]; ints: int32 [1, n] member r's packed inputs
    (its page ids)."""
    x = unpack_int32(ints[0], shape)
    meta = AttentionMetadata.of(x)
    num_layers, num_pages, page_size, features = kv_cache.k.shape
    view = (num_layers, num_pages, tp.page_tokens, tp.kv_heads * config.head_dim)
    k_cache, v_cache = kv_cache.k.reshape(view), kv_cache.v.reshape(view)
    hidden = _embed(weights["embed"], x["token_ids"], tp.base_tp)
    body = functools.partial(_tp_layer, config=config, tp=tp, positions=x["positions"],
                             meta=meta, inv_freq=jnp.asarray(layers.rope_inv_freq(config)),
                             impl=impl)
    layer_ids = jnp.arange(num_layers, dtype=jnp.int32)
    (hidden, k_cache, v_cache), _ = jax.lax.scan(body, (hidden, k_cache, v_cache),
                                                 (weights["layers"], layer_ids))
    hidden = layers.rms_norm(hidden, weights["final_norm"], config.rms_norm_eps)
    head = functools.partial(_logits, embed=weights.get("embed") if "lm_head" not in weights
                             else None, lm_head=weights.get("lm_head"),
                             vocab_size=config.vocab_size, base_tp=tp.base_tp)
    outputs = sample_with_logprobs(head, hidden, x, floats, rng_keys,
                                   vocab_size=config.vocab_size)
    shape4 = (num_layers, num_pages, page_size, features)
    return outputs, KVCache(k=k_cache.reshape(shape4), v=v_cache.reshape(shape4))


def tp_step_fn(mesh: Mesh, config, tp: TPShape, impl: str, weight_specs, kv_specs):
    """The jitted group step: (weights, kv_cache, ints [m, n], floats, rng_keys) ->
    (StepOutputs, kv_cache), the cache donated. `shape` is static. weight_specs, kv_specs:
    the group arrays' PartitionSpecs (`group_spec`)."""
    whole = PartitionSpec()

    def step(weights, kv_cache, ints, floats, rng_keys, *, shape):
        body = functools.partial(_tp_rank_step, shape=shape, config=config, tp=tp, impl=impl)
        # Every device computes the same outputs (psum'd hidden, whole logits): replicated.
        return jax.shard_map(body, mesh=mesh,
                             in_specs=(weight_specs, kv_specs, PartitionSpec(MEMBER_AXIS),
                                       whole, whole),
                             out_specs=(whole, kv_specs), check_vma=False)(
            weights, kv_cache, ints, floats, rng_keys)

    return jax.jit(step, static_argnames=("shape",), donate_argnames=("kv_cache",))


def member_weights(engine: Engine) -> dict:
    """The arrays of a base replica's weights the TP program reads (its own buffers). The
    RoPE frequencies are not among them: the program derives them from the config (the
    module keeps them wherever jnp put them, not necessarily on the replica's device)."""
    placed = engine.model.module.placed_params()
    weights = {name: a for name, a in placed.items() if not name.startswith("layers.")}
    weights["layers"] = {name.split(".", 1)[1]: a for name, a in placed.items()
                         if name.startswith("layers.")}
    return weights


def group_spec(member_array: jax.Array) -> PartitionSpec:
    """The PartitionSpec over the group's [member, local] mesh of a member array stacked
    along its first axis: the member axis outermost there, and "local" wherever the
    member's own TP mesh shards it (its other axes have size 1)."""
    mesh = member_array.sharding.mesh
    spec = tuple(member_array.sharding.spec) + (None,) * (
        member_array.ndim - len(member_array.sharding.spec))

    def local(axes):
        axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
        return LOCAL_AXIS if any(mesh.shape[a] > 1 for a in axes) else None

    first = local(spec[0])
    return PartitionSpec(MEMBER_AXIS if first is None else (MEMBER_AXIS, LOCAL_AXIS),
                         *(local(a) for a in spec[1:]))


def assemble(mesh: Mesh, arrays: Sequence[jax.Array]) -> jax.Array:
    """One global [m * n0, ...] array over the group's `mesh` whose shard on device (r, j)
    is arrays[r]'s own buffer on its device j (zero-copy). Array r lives on mesh row r."""
    first = arrays[0]
    shape = (len(arrays) * first.shape[0], *first.shape[1:])
    buffers = [shard.data for a in arrays for shard in a.addressable_shards]
    return jax.make_array_from_single_device_arrays(
        shape, NamedSharding(mesh, group_spec(first)), buffers)


def split(array: jax.Array, like: Sequence[jax.Array]) -> list[jax.Array]:
    """The inverse of `assemble`: member r's shards as an array of like[r]'s sharding
    (zero-copy)."""
    on = {shard.device: shard.data for shard in array.addressable_shards}
    # By the sharding's devices: like's own buffers were donated to the step (deleted).
    return [jax.make_array_from_single_device_arrays(
        ref.shape, ref.sharding, [on[d] for d in sorted(ref.sharding.addressable_devices,
                                                         key=lambda d: d.id)])
        for ref in like]


class TPGroupEngine(Engine):
    """m base DP engines of TP-b bound as one TP-(m * b) engine (the PipelinedExecutor
    interface, so a controller drives it as any engine). While it serves, the members' own
    steps must not run (the coordinator's bind): both write the members' cache buffers."""

    def __init__(self, members: Sequence[Engine], config: EngineConfig | None = None):
        m = len(members)
        if m < 2 or m & (m - 1):
            raise ValueError(f"a TP group has a power of two >= 2 members, got {m}")
        base = members[0]
        b = base.model.mesh.size
        for e in members:
            if e.model.mesh.size != e.model.mesh.shape.get("tp", 1) or e.pipeline is not None \
                    or e.num_kv_shards != 1 or e.model.mesh.size != b:
                raise ValueError("TP groups bind base replicas of one tp degree and no other "
                                 "axis (kvp = cp = spp = 1)")
            if e.model.config != base.model.config or e.config != base.config:
                raise ValueError("a TP group's members must serve one model and engine config")
        self.members = list(members)
        self.model = base.model
        self.config = config or base.config
        # Row r: member r's devices in its TP order (its mesh's other axes have size 1).
        self.mesh = Mesh(np.array([list(e.model.mesh.devices.flat) for e in members]),
                         GROUP_AXES)
        self.tp = TPShape.of(base.model.config, m, base.config.page_size, base_tp=b)
        self.num_kv_shards, self.cp_ranks, self.ring_cost, self.cp_variant = 1, 1, None, None
        self.cp_variant_counts = collections.Counter()
        devices = tuple(d.id for d in self.mesh.devices.flat)
        self.allocator = GroupAllocator([e.allocator for e in members], self.tp.page_tokens,
                                        tag=f"tp{m}@{devices[0]}")
        model_len = min(self.config.max_model_len or base.model.config.max_position_embeddings,
                        base.model.config.max_position_embeddings)
        self.max_model_len = min(model_len, self.allocator.max_tokens_per_request)
        self.ladder = BucketLadder.from_limits(
            max_tokens=self.config.max_tokens_per_step, min_tokens=self.config.min_token_bucket,
            max_seqs=self.config.max_seqs,
            max_pages_per_seq=self.allocator.pages_needed(self.max_model_len))
        self.max_seqs = self.config.max_seqs
        self.pad_slot = self.allocator.pages_per_shard * self.tp.page_tokens
        self.num_stages, self.max_in_flight, self.pipeline = 1, 1, None
        # Assembled once: views of the members' buffers, no storage of their own.
        self.weights = jax.tree.map(lambda *a: assemble(self.mesh, a),
                                    *[member_weights(e) for e in members])
        kv_specs = jax.tree.map(group_spec, base.kv_cache)
        self._step = tp_step_fn(self.mesh, base.model.config, self.tp,
                                base.model.layout.attention_impl,
                                jax.tree.map(group_spec, member_weights(base)), kv_specs)
        self._replicated = NamedSharding(self.mesh, PartitionSpec())
        self._ranked = NamedSharding(self.mesh, PartitionSpec(MEMBER_AXIS))
        self._kv_cache_spec = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct((m * a.shape[0], *a.shape[1:]), a.dtype,
                                           sharding=NamedSharding(self.mesh, group_spec(a))),
            base.kv_cache)
        self.executables = {}
        self.step_records = collections.deque(maxlen=10_000)
        self.warmup_seconds, self.warmed_up = None, False
        self._compile_lock = threading.Lock()
        self._backlog, self._compiling = [], {}
        self._warmup_thread, self._stop_warmup = None, threading.Event()
        self.compiles_waited_for = 0
        self.mirror = None                        # a group runs in this process only
        self.last_host_seconds = None
        self._num_dispatched = 0
        self._device_idle_since = time.perf_counter()
        self._idle_host_seconds = 0.0
        self._last_collect_end = 0.0

    @property
    def kv_cache(self) -> KVCache:
        """The members' caches as one group array (zero-copy views of their buffers)."""
        caches = [e.kv_cache for e in self.members]
        return KVCache(k=assemble(self.mesh, [c.k for c in caches]),
                       v=assemble(self.mesh, [c.v for c in caches]))

    @kv_cache.setter
    def kv_cache(self, cache: KVCache) -> None:
        old = [e.kv_cache for e in self.members]
        ks, vs = split(cache.k, [c.k for c in old]), split(cache.v, [c.v for c in old])
        for e, k, v in zip(self.members, ks, vs):
            e.kv_cache = KVCache(k=k, v=v)

    def rank_ints(self, inputs: StepInputs) -> np.ndarray:
        """int32 [m, n]: the packed inputs with each rank's own physical pages."""
        B, pad = self.tp.page_tokens, self.pad_slot
        rows = []
        for rank in range(len(self.members)):
            physical = self.allocator.physical(rank)
            slots = inputs.slot_mapping
            real = slots < pad
            mapped = np.where(real, physical[np.where(real, slots // B, 0)] * B + slots % B,
                              slots)
            rank_inputs = dataclasses.replace(
                inputs, slot_mapping=mapped.astype(np.int32),
                page_table=physical[inputs.page_table].astype(np.int32))
            rows.append(rank_inputs.pack()[0])
        return np.stack(rows)

    def _start(self, inputs: StepInputs) -> StepOutputs:
        """The group's step: each rank reads its own page ids (`rank_ints`), which the
        unranked packed inputs of Engine.run_packed do not carry."""
        outputs, self.kv_cache = self.executable(inputs.padded_shape)(
            *self.step_args(inputs)[1:])
        return outputs

    def step_args(self, inputs: StepInputs, kv_cache: KVCache | None = None) -> tuple:
        _, floats, rng_keys = inputs.pack()
        ints = jax.device_put(self.rank_ints(inputs), self._ranked)
        floats, rng_keys = jax.device_put((floats, rng_keys), self._replicated)
        kv_cache = self.kv_cache if kv_cache is None else kv_cache
        return (None, self.weights, kv_cache, ints, floats, rng_keys)

    def _compile(self, shape):
        inputs = StepInputs.padding(shape, self.pad_slot)
        ints = jax.ShapeDtypeStruct((len(self.members), inputs.pack()[0].size), np.int32,
                                    sharding=self._ranked)
        _, floats, rng_keys = inputs.pack()
        floats, rng_keys = (jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self._replicated)
                            for a in (floats, rng_keys))
        args = (self.weights, self._kv_cache_spec, ints, floats, rng_keys)
        devices = list(self.mesh.devices.flat)
        static = (shape, self.tp, self.model.config, self.model.layout.attention_impl)
        executable, _ = step_cache.load_or_compile(
            step_cache.step_key("tp_group.step", static, args, devices),
            lambda: self._step.lower(*args, shape=shape).compile(), devices,
            self.members[0].step_cache_dir)
        self.executables[shape] = executable
        return executable

    def _new_kv_cache(self) -> KVCache:
        raise RuntimeError("a TP group holds no cache of its own: recover its members'")
