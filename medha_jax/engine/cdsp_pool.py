"""A prefill pool run by chunkwise dynamic sequence parallelism on devices (seed 001, Tetris).

N devices form one sequence-parallel ring. A prompt is prefilled as chunks c_1, c_2, ... on
nested groups G_1 ⊆ G_2 ⊆ ... of them (the plan of `medha_jax.scheduler.cdsp`); each chunk
is one step of seed 002's ring (`medha_jax.model.ring_attention`) on its group's own mesh:
its new tokens split over the group, its history attended where it lies. Then the prompt's
K/V go to a decode replica (`serving.pool_handoff`).

Groups are aligned power-of-two blocks of the pool's devices (devices [b*s, (b+1)*s)), the
scheduler's `CdspConfig(aligned=True)`: a program is compiled per (group, bucket) and runs
only on its group's devices, so free subsets would be a program per subset (C(8, 4) = 70
for one size of an 8-device pool) against 2N - 1 blocks. `warmup` compiles what it is given
and nothing compiles after it (a missing program is an error, as in `Engine`).

Weights. The model is loaded once on the pool's cp = N mesh, where every device holds all
of it (cp replicates weights); a group's model takes its devices' buffers as its own
arrays (`jax.make_array_from_single_device_arrays`): no copy, no new storage.

KV. Each device has its own pool of P pages [layers, P, page_size, kv_heads * head_dim]; a
group's program takes its devices' pools assembled into one cache whose page axis is split
over the group's cp ranks (zero-copy, donated, split back after). A sequence holds, on each
device, some pages and the positions of the tokens in them, in fill order: the ring's
attention to cached tokens is non-causal, so a rank's tokens may sit in any order.

Placement of a chunk's tokens (a departure from `cp_layout.balanced_offsets`, why: the
balancing below stays one fixed pattern of transfers per pair of groups). The chunk's
tokens are counted out so that after it every rank of the group holds floor(t/k) or
ceil(t/k) of the sequence's t tokens (the ranks holding more get fewer), and rank i's
count is laid out as seed 002's zigzag: pieces i and 2k-1-i of the chunk split in 2k
(`zigzag_offsets`), so each rank gets a head piece that sees little and a tail piece that
sees much of the causal work, as in section 3.5.1.

Cache balancing (Tetris: before a chunk whose group grew, the history is spread evenly by
count over the new group). From G_old (k ranks) to the aligned block G_new of R*k ranks,
old rank i keeps one R-th of its tokens and sends the other R - 1 R-ths, one to each of its
R - 1 designated newcomers (`balance_rounds`): R - 1 rounds, each one collective-permute of
the old ranks' messages. Because every old rank held floor or ceil of the history over k,
every rank of G_new then holds floor or ceil of it over R*k (proof in `balance_rounds`). A
message is the sender's last tokens (in its fill order) gathered across its pages, padded
to whole pages, a power of two of them (`page_bucket`); the receiver writes them into new
pages from slot 0. The moves run inside the chunk's own step, one layer at a time before
that layer's attention (`_layer_mover`, `llama.decoder_layers(move_layer=)`): the permute
needs only the cache, so it can overlap the layer's norm and Q/K/V projections. Where this
departs from the paper, which overlaps a layer's moves with the previous layer's MLP: the
layers are one scanned body, and the previous layer is the previous iteration, whose K/V
write the moves' gather follows in the carried cache; moving layer l + 1 from inside
layer l would need a last iteration that moves nothing (a peeled layer: a second layer
body to compile) or XLA's cross-iteration collective pipelining.

The hand-off to a decode replica (`serving.pool_handoff`, the handshake of
`serving.kv_transfer` on the decode side): the pool gathers each rank's tokens of the
prompt's full pages (`prompt_kv`) and the replica places them by position into its own
pages, K/V heads over its tp.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from medha_jax.model import KV_CACHE_AXES, AttentionMetadata, KVCache, Llama, Model
from medha_jax.model import cp_layout
from medha_jax.model.params import MeshLayout
from meshes import ParallelConfig, make_mesh

Group = tuple[int, int]          # an aligned block of the pool's devices: (first, size)
STEPS_KEPT = 4096                # chunk steps a pool keeps for Eq. 1's fit (a sliding window)


# ------------------------------------------------------------------ host-side planning

def aligned_groups(num_devices: int) -> list[Group]:
    """Every aligned power-of-two block of a pool of `num_devices` (a power of two)."""
    return [(first, size) for size in _powers_of_two(num_devices)
            for first in range(0, num_devices, size)]


def _powers_of_two(n: int) -> list[int]:
    return [1 << i for i in range(n.bit_length()) if (1 << i) <= n]


def check_group(group: Group, num_devices: int) -> None:
    first, size = group
    if size < 1 or size & (size - 1) or first % size or first + size > num_devices:
        raise ValueError(f"group {group} is not an aligned power-of-two block of the pool's "
                         f"{num_devices} devices (first a multiple of size)")


def group_of(devices: Sequence[int], num_devices: int) -> Group:
    """The (first, size) block of a plan chunk's instance ids."""
    group = (min(devices), len(devices))
    check_group(group, num_devices)
    if sorted(devices) != list(range(group[0], group[0] + group[1])):
        raise ValueError(f"instances {tuple(devices)} are not one aligned block: the pool "
                         "runs CdspConfig(aligned=True) plans")
    return group


def chunk_counts(cached: np.ndarray, tokens: int) -> np.ndarray:
    """int [k]: new tokens each rank takes so that afterwards every rank holds floor or ceil
    of the total over k. cached: int [k], each floor or ceil of its sum over k. The ranks
    already holding more get the floor, so no count is negative."""
    k = len(cached)
    total = int(cached.sum()) + tokens
    ceil_ranks = total % k
    order = np.argsort(-cached, kind="stable")         # more cached first: they get the ceil
    target = np.full(k, total // k, np.int64)
    target[order[:ceil_ranks]] += 1
    counts = target - cached
    if counts.min() < 0:
        raise ValueError(f"cached {cached.tolist()} is not balanced (floor or ceil of its "
                         "sum over the ranks)")
    return counts


def zigzag_offsets(counts: np.ndarray) -> list[np.ndarray]:
    """Offsets in the chunk of each rank's tokens: the chunk cut into 2k pieces in order,
    rank i taking pieces i and 2k-1-i (sizes ceil and floor of its count over 2)."""
    k = len(counts)
    sizes = np.zeros(2 * k, np.int64)
    sizes[:k] = (counts + 1) // 2
    sizes[k:] = (counts // 2)[::-1]
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    piece = lambda j: np.arange(bounds[j], bounds[j + 1])  # noqa: E731
    return [np.concatenate([piece(i), piece(2 * k - 1 - i)]) for i in range(k)]


def balance_rounds(cached: np.ndarray, old: Group, new: Group
                   ) -> list[list[tuple[int, int, int]]]:
    """The moves that spread a sequence's history from group `old` over `new` (⊇ old).

    cached: int [k_old] tokens each old rank holds, each floor or ceil of their sum h over
    k_old. Returns R - 1 rounds (R = k_new / k_old) of (source, destination, tokens), ranks
    as positions in `new`. Old rank i splits its c_i into R parts, floor or ceil of c_i / R,
    keeps one and sends one to each of its R - 1 newcomers (the (R-1) i-th .. of the ranks
    not in `old`, in order). Why that balances: with F = floor(h / k_old) = R f + r (r < R),
    c_i in {F, F + 1} gives parts in {f, f + 1}, and f = floor(h / (R k_old)): every rank of
    `new` then holds floor or ceil of h over k_new.
    """
    (old_first, k_old), (new_first, k_new) = old, new
    if not (new_first <= old_first and old_first + k_old <= new_first + k_new):
        raise ValueError(f"group {new} does not contain {old}: groups only grow")
    ratio = k_new // k_old
    offset = old_first - new_first
    newcomers = [r for r in range(k_new) if not offset <= r < offset + k_old]
    rounds: list[list[tuple[int, int, int]]] = [[] for _ in range(ratio - 1)]
    for i, c in enumerate(int(c) for c in cached):
        q, rem = divmod(c, ratio)
        parts = [q + 1] * rem + [q] * (ratio - rem)     # keeps parts[0], the largest
        for j in range(ratio - 1):
            rounds[j].append((offset + i, newcomers[i * (ratio - 1) + j], parts[j + 1]))
    return rounds


def page_bucket(pages: int) -> int:
    """A power of two of pages, at least 1: the static sizes programs are compiled for."""
    return 1 << max(pages - 1, 0).bit_length()


# ------------------------------------------------------------------ the pool

@dataclasses.dataclass(frozen=True)
class PoolConfig:
    """page_size: tokens a page (the decode replica's too, for the hand-off);
    pages_per_device: P, each device's page pool; rank_token_buckets: the per-rank token
    counts a chunk step is compiled for (a chunk's busiest rank pads up to one)."""

    page_size: int = 16
    pages_per_device: int = 64
    rank_token_buckets: tuple[int, ...] = (16, 64, 256)

    def __post_init__(self):
        if self.page_size < 1 or self.pages_per_device < 1 or not self.rank_token_buckets:
            raise ValueError(f"PoolConfig needs page_size and pages_per_device >= 1 and "
                             f"some rank_token_buckets, got {self}")


@dataclasses.dataclass
class _Held:
    """A sequence's K/V on one device: its pages and, in fill order, the positions of the
    tokens in them."""

    pages: list[int] = dataclasses.field(default_factory=list)
    positions: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Sequence:
    token_ids: np.ndarray
    done: int = 0
    group: Group | None = None
    held: dict[int, _Held] = dataclasses.field(default_factory=dict)   # device -> its K/V

    def copy(self) -> _Sequence:
        return dataclasses.replace(self, held={d: _Held(list(h.pages), list(h.positions))
                                               for d, h in self.held.items()})

    def counts(self, group: Group) -> np.ndarray:
        first, size = group
        return np.array([len(self.held.get(d, _Held()).positions)
                         for d in range(first, first + size)], np.int64)


@dataclasses.dataclass(frozen=True)
class _Booked:
    """One chunk booked (`CdspPool._book`): its program's key, the sequence and free lists
    as they are after it, and its step's inputs (`cp_layout.CpStep`'s positions and
    source; send, recv: the balancing's slots, None without)."""

    key: tuple
    sequence: _Sequence
    free: dict[int, list[int]]
    positions: np.ndarray
    source: np.ndarray
    meta: AttentionMetadata
    send: np.ndarray | None
    recv: np.ndarray | None
    moved_pages: int


class CdspPool:
    """N devices running chunks of prompts on nested aligned groups (see the module).

    Not thread-safe: one caller drives it (a serving loop would own it as it owns an engine).
    """

    def __init__(self, model: Model, config: PoolConfig = PoolConfig()):
        parallel = model.parallel
        if parallel != ParallelConfig(cp=parallel.cp):
            raise ValueError(f"the pool's model must be loaded with ParallelConfig(cp=N) "
                             f"(weights whole on every device), got {parallel}")
        n = parallel.cp
        if n & (n - 1):
            raise ValueError(f"the pool's devices must be a power of two, got {n}")
        model.require_weights()
        self.model, self.config, self.num_devices = model, config, n
        self.devices = list(model.mesh.devices.flat)
        self.page_size, self.num_pages = config.page_size, config.pages_per_device
        self.pad_slot = self.num_pages * self.page_size
        self._models = {g: self._group_model(g) for g in aligned_groups(n)}
        shape, _ = model.kv_cache_sharding(n * self.num_pages, self.page_size)
        self._cache_shape = (shape[0], self.num_pages, *shape[2:])
        cache = model.new_kv_cache(n * self.num_pages, self.page_size)
        self._cache_dtype = cache.k.dtype
        self._k = _by_device(cache.k)           # device index -> [L, P, ps, F] on it
        self._v = _by_device(cache.v)
        self._free = {d: list(range(self.num_pages)) for d in range(n)}
        self._sequences: dict[str, _Sequence] = {}
        self.executables: dict[tuple, jax.stages.Compiled] = {}
        self.warmed_up = False
        self.moved_pages = 0                   # balancing: pages of messages sent, in total
        # (tokens, history, sp, seconds) of the last STEPS_KEPT chunk steps, as measured
        # here: what Eq. 1 is fitted from (`medha_jax.scheduler.cdsp.fit_latency_models`).
        self.steps: list[tuple[int, int, int, float]] = []

    # -------------------------------------------------------------- groups

    def _mesh(self, group: Group) -> Mesh:
        first, size = group
        return make_mesh(ParallelConfig(cp=size), self.devices[first:first + size])

    def _group_model(self, group: Group) -> Model:
        """The pool's weights as a model on the group's mesh: its devices' own buffers."""
        mesh = self._mesh(group)
        layout = MeshLayout.create(self.model.config, mesh, self.model.rules,
                                   self.model.layout.attention_impl)
        members = set(mesh.devices.flat)
        params = {}
        for name, array in self.model.module.placed_params().items():
            sharding = NamedSharding(mesh, PartitionSpec())     # cp replicates weights
            on = {s.device: s.data for s in array.addressable_shards if s.device in members}
            params[name] = jax.make_array_from_single_device_arrays(
                array.shape, sharding, [on[d] for d in mesh.devices.flat])
        return Model(Llama(self.model.config, params, layout), tokenizer=self.model.tokenizer)

    def _assemble(self, group: Group) -> KVCache:
        first, size = group
        layout = self._models[group].layout
        shape = (self._cache_shape[0], size * self.num_pages, *self._cache_shape[2:])
        sharding = layout.sharding(shape, KV_CACHE_AXES)
        make = lambda parts: jax.make_array_from_single_device_arrays(  # noqa: E731
            shape, sharding, [parts[d] for d in range(first, first + size)])
        return KVCache(k=make(self._k), v=make(self._v))

    def _split(self, group: Group, cache: KVCache) -> None:
        first = group[0]
        for parts, array in ((self._k, cache.k), (self._v, cache.v)):
            for r, data in enumerate(_shards_in_mesh_order(array)):
                parts[first + r] = data

    # -------------------------------------------------------------- sequences

    @property
    def num_free_pages(self) -> int:
        return sum(len(f) for f in self._free.values())

    def add(self, sequence_id: str, token_ids: Sequence[int]) -> None:
        ids = np.asarray(token_ids, np.int32)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"token_ids must be a non-empty 1-D sequence, got {ids.shape}")
        vocab = self.model.config.vocab_size
        if ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(f"token ids must lie in [0, {vocab})")
        if sequence_id in self._sequences:
            raise ValueError(f"sequence {sequence_id!r} is already in the pool")
        self._sequences[sequence_id] = _Sequence(ids)

    def held_tokens(self, sequence_id: str) -> dict[int, int]:
        """device -> tokens of the sequence it holds."""
        return {d: len(h.positions) for d, h in self._sequences[sequence_id].held.items()}

    def release(self, sequence_id: str) -> None:
        """Frees the sequence's pages on every device."""
        seq = self._sequences.pop(sequence_id)
        for d, held in seq.held.items():
            self._free[d].extend(held.pages)

    def _grow(self, free: dict[int, list[int]], d: int, held: _Held, tokens: int) -> None:
        """Pages from device d's free list (`free`: the pool's, or a booking's copy) until
        `held` has room for `tokens`."""
        need = -(-tokens // self.page_size) - len(held.pages)
        if need > len(free[d]):
            raise MemoryError(f"device {d} of the pool has {len(free[d])} free pages, "
                              f"{need} needed")
        for _ in range(need):
            held.pages.append(free[d].pop())

    # -------------------------------------------------------------- chunks

    def prefill(self, sequence_id: str, chunks: Sequence[tuple[int, Sequence[int]]]
                ) -> np.ndarray:
        """Runs a plan's chunks, (tokens, instance ids) each (`[(c.tokens, c.group) for c
        in plan.chunks]` of an aligned `CdspScheduler` plan over this pool's devices).
        Returns the float32 logits [vocab] of the prompt's last token."""
        logits = None
        for tokens, devices in chunks:
            logits = self.prefill_chunk(sequence_id, tokens,
                                        group_of(devices, self.num_devices))
        if logits is None:
            raise ValueError("a plan has at least one chunk")
        return logits[-1]

    def prefill_chunk(self, sequence_id: str, num_tokens: int, group: Group) -> np.ndarray:
        """Runs the sequence's next `num_tokens` prompt tokens on `group`, which contains the
        group of its previous chunk; when it grew, the step first balances the history over
        it, layer by layer. Returns float32 logits [num_tokens, vocab] of those tokens, in
        position order, and records the step's time (`steps`). Nothing changes when its
        booking raises (the step is booked on copies)."""
        seq = self._sequences[sequence_id]
        logits, real, positions, started = self._run_chunk(sequence_id, num_tokens, group)
        logits = np.asarray(logits)
        self.steps.append((num_tokens, seq.done, group[1], time.perf_counter() - started))
        del self.steps[:-STEPS_KEPT]
        out = np.zeros((num_tokens, self.model.config.vocab_size), np.float32)
        out[positions[real] - seq.done] = logits[real]
        return out

    def dispatch_chunk(self, sequence_id: str, num_tokens: int, group: Group) -> jax.Array:
        """`prefill_chunk` without waiting for the step: it is dispatched (JAX runs it once
        its inputs are ready, so steps on disjoint groups may run at once) and booked.
        Returns its logits as the step lays them out (by rank, padded), not waited for.
        Not timed: `steps` records only the chunks waited for."""
        return self._run_chunk(sequence_id, num_tokens, group)[0]

    def _run_chunk(self, sequence_id: str, num_tokens: int, group: Group):
        """Books and dispatches one chunk: (its logits, not waited for; which of its rows
        are real tokens; their positions; the perf_counter at dispatch)."""
        seq = self._sequences[sequence_id]
        booked = self._book(seq, num_tokens, group, {d: list(f) for d, f in self._free.items()})
        executable = self._executable(booked.key)
        model = self._models[group]
        place = lambda x: jax.device_put(x, model.layout.sharding(x.shape, ("tokens",)))  # noqa: E731
        slots = NamedSharding(model.mesh, PartitionSpec(_cp_axis(self)))
        send, recv = booked.send, booked.recv
        if send is not None:
            send, recv = jax.device_put(send, slots), jax.device_put(recv, slots)
        meta = jax.device_put(booked.meta, NamedSharding(model.mesh, PartitionSpec()))
        real = booked.source >= 0
        positions = booked.positions
        ids = np.where(real, seq.token_ids[np.where(real, positions, 0)], 0).astype(np.int32)
        started = time.perf_counter()
        logits, cache = executable(model.state, self._assemble(group), place(ids),
                                   place(positions), meta, send, recv)
        self._split(group, cache)
        self.moved_pages += booked.moved_pages
        self._sequences[sequence_id], self._free = booked.sequence, booked.free
        return logits, real, positions, started

    def keys_for(self, num_tokens: int, chunks: Sequence[tuple[int, Group]]) -> list[tuple]:
        """The programs a prompt of `num_tokens` run as these (tokens, group) chunks needs
        on an empty pool, for `warmup` (booked as the run would, nothing run)."""
        free = {d: list(range(self.num_pages)) for d in range(self.num_devices)}
        return [booked.key for booked in self._book_all(num_tokens, chunks, free)]

    def can_book(self, num_tokens: int, chunks: Sequence[tuple[int, Group]], *,
                 empty: bool = False) -> bool:
        """Whether a new sequence of `num_tokens` tokens run as these (tokens, group) chunks
        gets every page it needs from the pages free now (empty: from an empty pool)."""
        free = {d: list(range(self.num_pages)) if empty else list(f)
                for d, f in self._free.items()}
        try:
            self._book_all(num_tokens, chunks, free)
        except MemoryError:
            return False
        return True

    def most_chunk_tokens(self, group: Group) -> int:
        """The longest chunk any step on `group` can take (its busiest rank within the
        largest rank-token bucket): a rank takes at most a k-th of the chunk plus 2
        (`chunk_counts`: floor or ceil of its share after, less floor or ceil before)."""
        largest, k = max(self.config.rank_token_buckets), group[1]
        return largest if k == 1 else k * (largest - 2)

    def _book_all(self, num_tokens: int, chunks: Sequence[tuple[int, Group]],
                  free: dict[int, list[int]]) -> list[_Booked]:
        """Every chunk of a new sequence booked in turn on `free` (the caller's copy)."""
        seq, out = _Sequence(np.zeros(num_tokens, np.int32)), []
        for tokens, group in chunks:
            booked = self._book(seq, tokens, group, free)
            out.append(booked)
            seq, free = booked.sequence, booked.free
        return out

    def _book(self, seq: _Sequence, num_tokens: int, group: Group,
              free: dict[int, list[int]]) -> _Booked:
        """One chunk booked on a copy of `seq` and on `free` (the caller's copy of the free
        lists): the balancing's moves, the tokens' placement, the pages, the step's inputs
        and its program's key."""
        check_group(group, self.num_devices)
        if not 1 <= num_tokens <= len(seq.token_ids) - seq.done:
            raise ValueError(f"{num_tokens=} with {len(seq.token_ids) - seq.done} prompt "
                             f"tokens left")
        seq = seq.copy()
        first, size = group
        pattern, bucket, send, recv, moved, emptied = (), 0, None, None, 0, []
        if seq.group is not None and seq.group != group:
            pattern, bucket, send, recv, moved, emptied = self._plan_moves(
                seq, seq.group, group, free)
        seq.group = group
        cached = seq.counts(group)
        offsets = zigzag_offsets(chunk_counts(cached, num_tokens))
        helds = [seq.held.setdefault(first + r, _Held()) for r in range(size)]
        for r, held in enumerate(helds):
            self._grow(free, first + r, held, int(cached[r]) + len(offsets[r]))
        for d, page_ids in emptied:          # read by the step's moves: not the chunk's
            free[d].extend(page_ids)
        pages = page_bucket(max(len(h.pages) for h in helds))
        table = np.zeros((size, pages), np.int32)
        for r, held in enumerate(helds):
            table[r, :len(held.pages)] = held.pages
        rank_tokens = self._rank_bucket(max(len(o) for o in offsets))
        start = seq.done
        if size == 1:
            positions, meta = self._one_rank_step(helds[0], start, num_tokens, rank_tokens,
                                                  table)
            source = np.where(np.arange(rank_tokens) < num_tokens, np.arange(rank_tokens), -1)
        else:
            chunk = cp_layout.CpChunk(start=start, offsets=offsets, cached=cached, pages=table)
            step = cp_layout.build_cp_step(
                [chunk], num_ranks=size, rank_tokens=rank_tokens, padded_seqs=1, width=pages,
                page_size=self.page_size, pad_slot=self.pad_slot, kv_capacity=pages)
            positions, source = step.positions, step.source
            meta = cp_layout.step_metadata(step, 1, pass_q=False)
        for r, held in enumerate(helds):
            held.positions.extend(int(p) for p in start + offsets[r])
        seq.done += num_tokens
        return _Booked(key=("chunk", group, rank_tokens, pages, pattern, bucket), sequence=seq,
                       free=free, positions=positions, source=source, meta=meta, send=send,
                       recv=recv, moved_pages=moved)

    def _rank_bucket(self, tokens: int) -> int:
        for bucket in self.config.rank_token_buckets:
            if tokens <= bucket:
                return bucket
        raise ValueError(f"a rank would take {tokens} tokens, more than the largest bucket "
                         f"{max(self.config.rank_token_buckets)}: use a larger group or chunk")

    def _one_rank_step(self, held: _Held, start: int, n: int, padded: int, table: np.ndarray):
        """A group of one device: the one-shard causal path (its tokens are in position
        order there, every chunk having been on this one device)."""
        ps = self.page_size
        local = start + np.arange(n)
        slots = np.full((1, padded), self.pad_slot, np.int32)
        slots[0, :n] = np.asarray(held.pages)[local // ps] * ps + local % ps
        meta = AttentionMetadata(
            slot_mapping=slots, page_table=table[:, None, :],
            cu_q_lens=np.array([0, n], np.int32), kv_lens=np.array([[start + n]], np.int32),
            num_seqs=np.array([1], np.int32))
        return np.arange(start, start + padded, dtype=np.int32), meta

    # -------------------------------------------------------------- balancing

    def _plan_moves(self, seq: _Sequence, old: Group, new: Group, free):
        """The balancing of the history from `old` over `new` (`balance_rounds`), booked on
        `seq` and `free`: returns (pattern, page bucket, send, recv, pages moved, emptied)
        where send and recv are int32 [k_new, rounds, bucket * page_size], each rank's
        slots to read and to write per round (pads: one past its pool), and emptied lists
        the (device, pages) the givers no longer need once the step has read them."""
        rounds = balance_rounds(seq.counts(old), old, new)
        ps, first, size = self.page_size, new[0], new[1]
        most = max((t for moves in rounds for _, _, t in moves), default=0)
        bucket = page_bucket(-(-most // ps))
        send = np.full((size, len(rounds), bucket * ps), self.pad_slot, np.int32)
        recv = np.full_like(send, self.pad_slot)
        for j, moves in enumerate(rounds):
            for src, dst, tokens in moves:
                giver = seq.held[first + src]
                taker = seq.held.setdefault(first + dst, _Held())
                kept = len(giver.positions) - tokens
                local = kept + np.arange(tokens)             # the giver's last tokens
                send[src, j, :tokens] = np.asarray(giver.pages)[local // ps] * ps + local % ps
                self._grow(free, first + dst, taker, len(taker.positions) + tokens)
                local = len(taker.positions) + np.arange(tokens)
                recv[dst, j, :tokens] = np.asarray(taker.pages)[local // ps] * ps + local % ps
                taker.positions.extend(giver.positions[kept:])
                del giver.positions[kept:]
        emptied = []
        for r in range(old[1]):
            held = seq.held[old[0] + r]
            keep = -(-len(held.positions) // ps)
            emptied.append((old[0] + r, held.pages[keep:]))
            del held.pages[keep:]
        pattern = tuple(tuple((src, dst) for src, dst, _ in moves) for moves in rounds)
        moved = bucket * sum(len(moves) for moves in rounds)
        return pattern, bucket, send, recv, moved, emptied

    # -------------------------------------------------------------- the hand-off

    def prompt_kv(self, sequence_id: str, low: int, high: int) -> tuple[jax.Array, np.ndarray]:
        """A prefilled sequence's K/V at positions [low, high), for the hand-off
        (`serving.pool_handoff`): ([2, layers, k * M, F] each of the group's k ranks' tokens
        side by side, split over the ranks; int32 [k * M] each one's position minus low, -1
        for padding)."""
        seq = self._sequences[sequence_id]
        if seq.done != len(seq.token_ids):
            raise ValueError(f"sequence {sequence_id!r} has {len(seq.token_ids) - seq.done} "
                             "prompt tokens still to prefill")
        return self._gather(seq, low, high)

    def token_ids(self, sequence_id: str) -> np.ndarray:
        return self._sequences[sequence_id].token_ids

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of K and V over every layer (what a balancing message of one
        page carries)."""
        layers, _, page_size, features = self._cache_shape
        return 2 * layers * page_size * features * self._k[0].dtype.itemsize

    @property
    def kv_layout(self) -> tuple:
        """(shape, dtype) of one device's K pages, [layers, P, page_size, F]."""
        return self._k[0].shape, self._k[0].dtype

    def _gather(self, seq: _Sequence, low: int, high: int) -> tuple[jax.Array, np.ndarray]:
        """Every rank's tokens at positions [low, high) gathered on the pool's group:
        ([2, layers, k * M, F] split over the group's ranks, int32 [k * M] each one's
        position minus low, or -1 for padding)."""
        group, ps = seq.group, self.page_size
        first, size = group
        picks = []
        for r in range(size):
            held = seq.held.get(first + r, _Held())
            fill = np.asarray(held.positions, np.int64)
            local = np.flatnonzero((fill >= low) & (fill < high))
            picks.append((local, fill[local]))
        bucket = page_bucket(-(-max(len(p[0]) for p in picks) // ps)) * ps
        slots = np.full((size, bucket), self.pad_slot, np.int32)
        where = np.full((size, bucket), -1, np.int32)
        for r, (local, positions) in enumerate(picks):
            held = seq.held.get(first + r, _Held())
            slots[r, :len(local)] = np.asarray(held.pages)[local // ps] * ps + local % ps
            where[r, :len(local)] = positions - low
        model = self._models[group]
        executable = self._executable(("gather", group, bucket // ps))
        kv = executable(self._assemble(group),
                        jax.device_put(slots, NamedSharding(model.mesh,
                                                            PartitionSpec(_cp_axis(self)))))
        return kv, where.reshape(-1)

    # -------------------------------------------------------------- programs

    def _executable(self, key: tuple) -> jax.stages.Compiled:
        executable = self.executables.get(key)
        if executable is None:
            if self.warmed_up:
                raise RuntimeError(f"pool program {key} was not compiled at warm-up, and "
                                   f"nothing compiles after it; {len(self.executables)} are "
                                   f"compiled")
            executable = self.executables[key] = self._compile(key)
        return executable

    def warmup(self, keys: Sequence[tuple], *, strict: bool = True) -> int:
        """Compiles the programs named by `keys` (`program_keys()`: every one, or `keys_for`
        a plan); from then on (strict) a program not compiled is an error. Returns how many
        were compiled. strict=False may run on another thread while the pool serves, which
        compiles what it needs first itself: compiling reads no cache buffer (only their
        shapes), and each program enters `executables` whole."""
        keys = [k for k in keys if k not in self.executables]
        for key in keys:
            if key not in self.executables:          # (the serving thread may have it now)
                self.executables[key] = self._compile(key)
        self.warmed_up = self.warmed_up or strict
        return len(keys)

    def program_keys(self, groups: Sequence[Group] | None = None) -> list[tuple]:
        """Every program a plan over `groups` (default: every aligned block) can need, so
        that after `warmup(pool.program_keys())` no plan compiles: each group's chunk step
        without balancing and after balancing from each aligned block inside it
        (`balance_keys`), and each group's gather for the hand-off."""
        return self.chunk_keys(groups) + self.balance_keys(groups) + self.gather_keys(groups)

    def chunk_keys(self, groups: Sequence[Group] | None = None) -> list[tuple]:
        """Every (group, rank-token bucket, page bucket) chunk program without balancing."""
        return [("chunk", g, t, p, (), 0) for g in (groups or aligned_groups(self.num_devices))
                for t in self.config.rank_token_buckets for p in self.page_buckets()]

    def balance_keys(self, groups: Sequence[Group] | None = None) -> list[tuple]:
        """Every chunk program that first balances the history onto its group (one of
        `groups`) from an aligned block inside it: per (old block, rank-token bucket, page
        bucket, message bucket). The pattern of a pair of blocks is fixed
        (`balance_rounds` sends from the same ranks to the same ranks whatever the counts).
        A message's bucket is at most the step's page bucket: its receiver holds its pages
        and more, and the step's page table is as wide as the busiest rank's."""
        keys = []
        for new in groups or aligned_groups(self.num_devices):
            for old in aligned_groups(self.num_devices):
                if old[1] >= new[1] or not new[0] <= old[0] < new[0] + new[1]:
                    continue
                rounds = balance_rounds(np.zeros(old[1], np.int64), old, new)
                pattern = tuple(tuple((src, dst) for src, dst, _ in moves) for moves in rounds)
                keys += [("chunk", new, t, p, pattern, b)
                         for t in self.config.rank_token_buckets
                         for p in self.page_buckets() for b in self.page_buckets()
                         if b <= p]
        return keys

    def gather_keys(self, groups: Sequence[Group] | None = None) -> list[tuple]:
        """Every (group, page bucket) gather of the hand-off."""
        return [("gather", g, p) for g in (groups or aligned_groups(self.num_devices))
                for p in self.page_buckets()]

    def page_buckets(self) -> list[int]:
        """The page buckets a rank's page count (1..P) pads to: up to page_bucket(P), which
        exceeds P where P is not a power of two."""
        return _powers_of_two(page_bucket(self.num_pages))

    def _compile(self, key: tuple) -> jax.stages.Compiled:
        kind, group = key[0], key[1]
        model = self._models[group]
        size, axis = group[1], _cp_axis(self)
        shape = (self._cache_shape[0], size * self.num_pages, *self._cache_shape[2:])
        part = jax.ShapeDtypeStruct(shape, self._cache_dtype,
                                    sharding=model.layout.sharding(shape, KV_CACHE_AXES))
        cache = KVCache(k=part, v=part)
        slot_sharding = NamedSharding(model.mesh, PartitionSpec(axis))
        cache_spec = model.layout.rules.spec(KV_CACHE_AXES)
        if kind == "gather":
            slots = jax.ShapeDtypeStruct((size, key[2] * self.page_size), jnp.int32,
                                         sharding=slot_sharding)
            return _gather_program(model.mesh, axis, cache_spec).lower(cache, slots).compile()
        _, _, rank_tokens, pages, pattern, bucket = key
        tokens = jax.ShapeDtypeStruct((size * rank_tokens,), jnp.int32,
                                      sharding=model.layout.sharding((size * rank_tokens,),
                                                                     ("tokens",)))
        meta = self._meta_shapes(size, rank_tokens, pages,
                                 NamedSharding(model.mesh, PartitionSpec()))
        send = mover = None
        if pattern:
            send = jax.ShapeDtypeStruct((size, len(pattern), bucket * self.page_size),
                                        jnp.int32, sharding=slot_sharding)
            mover = _layer_mover(model.mesh, axis, pattern, cache_spec)
        with jax.set_mesh(model.mesh):
            return _pool_step.lower(model.graphdef, model.state, cache, tokens, tokens, meta,
                                    send, send, move=mover).compile()

    def _meta_shapes(self, size: int, rank_tokens: int, pages: int, sharding):
        spec = lambda shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)  # noqa: E731
        if size == 1:
            return AttentionMetadata(
                slot_mapping=spec((1, rank_tokens)), page_table=spec((1, 1, pages)),
                cu_q_lens=spec((2,)), kv_lens=spec((1, 1)), num_seqs=spec((1,)))
        return AttentionMetadata(
            slot_mapping=spec((size, rank_tokens)), page_table=spec((size, 1, pages)),
            cu_q_lens=spec((2,)), kv_lens=spec((size, 1)), num_seqs=spec((1,)),
            rank_cu_q_lens=spec((size, 2)), cp_pass_q=spec((1,)),
            cp_kv_pages=spec((size, pages)), cp_kv_index=spec((size, 1, pages)))


def _cp_axis(pool: CdspPool) -> str:
    return pool.model.rules.mesh_axis("tokens")


def _by_device(array: jax.Array) -> dict[int, jax.Array]:
    """A cache split over the pool's devices in mesh order -> device index -> its part."""
    return dict(enumerate(_shards_in_mesh_order(array)))


def _shards_in_mesh_order(array: jax.Array) -> list[jax.Array]:
    """Each device's shard of `array` as a one-device array, in its mesh's device order."""
    on = {s.device: s.data for s in array.addressable_shards}
    return [on[d] for d in array.sharding.mesh.devices.flat]


MOVE_SCOPE = "cdsp_balance"     # the moves' instructions in the HLO (jax.named_scope)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("move",),
                   donate_argnames=("kv_cache",))
def _pool_step(graphdef, state, kv_cache: KVCache, token_ids, positions, meta, send, recv, *,
               move=None):
    """One chunk on a group: logits [T, vocab] of its tokens and the updated cache. move:
    `_layer_mover`'s function when the step first balances the history (send, recv: its
    slots), else None (send, recv None)."""
    module = nnx.merge(graphdef, state)
    move_layer = None if move is None else functools.partial(move, send=send, recv=recv)
    hidden, kv_cache = module(token_ids, positions, kv_cache, meta, move_layer=move_layer)
    return module.logits(hidden), kv_cache


@functools.cache
def _layer_mover(mesh: Mesh, axis: str, pattern, cache_spec: PartitionSpec):
    """The balancing of one layer, run by the step before that layer's attention: per
    round, every giver gathers its message [2, M, F] (K and V) from its slots of the layer,
    one collective-permute sends them, every taker scatters what it got into its slots
    (pads: one past the pool, read as zeros, dropped on write). One per (group, pattern)."""
    def per_device(k_cache, v_cache, layer_id, send, recv):
        layers, pages, page_size, features = k_cache.shape
        rows, outside = pages * page_size, layers * pages * page_size
        # Flat [layers * slots, F] views: the moves address the layer's rows in place.
        k = k_cache.reshape(outside, features)
        v = v_cache.reshape(outside, features)
        at = lambda slots: jnp.where(slots < rows, layer_id * rows + slots, outside)  # noqa: E731
        take = lambda a, rows_: jnp.take(a, rows_, axis=0, mode="fill", fill_value=0)  # noqa: E731
        for j, pairs in enumerate(pattern):
            source, destination = at(send[0, j]), at(recv[0, j])
            with jax.named_scope(MOVE_SCOPE):
                message = jnp.stack([take(k, source), take(v, source)])
                got = jax.lax.ppermute(message, axis, perm=list(pairs))
            k = k.at[destination].set(got[0], mode="drop")
            v = v.at[destination].set(got[1], mode="drop")
        return k.reshape(k_cache.shape), v.reshape(v_cache.shape)

    slots = PartitionSpec(axis)
    mapped = jax.shard_map(per_device, mesh=mesh,
                           in_specs=(cache_spec, cache_spec, PartitionSpec(), slots, slots),
                           out_specs=(cache_spec, cache_spec), check_vma=False)

    def move(k_cache, v_cache, layer_id, *, send, recv):
        return mapped(k_cache, v_cache, layer_id, send, recv)

    return move


def _gather_program(mesh: Mesh, axis: str, cache_spec: PartitionSpec):
    """The jitted gather of the hand-off: each rank's slots -> [2, layers, M, F] of its
    tokens' K and V (pads: zeros), the ranks' parts side by side on axis 2."""
    def per_device(k_cache, v_cache, slots):
        layers, pages, page_size, features = k_cache.shape
        take = lambda a: jnp.take(a.reshape(layers, pages * page_size, features), slots[0],  # noqa: E731
                                  axis=1, mode="fill", fill_value=0)
        return jnp.stack([take(k_cache), take(v_cache)])

    mapped = jax.shard_map(per_device, mesh=mesh,
                           in_specs=(cache_spec, cache_spec, PartitionSpec(axis)),
                           out_specs=PartitionSpec(None, None, axis), check_vma=False)
    return jax.jit(lambda cache, slots: mapped(cache.k, cache.v, slots))

