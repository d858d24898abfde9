"""The engine step over SPP stages: one compiled program per stage and bucket, handed on
with `jax.device_put`, never waited on.

`PipelinedStep.dispatch(inputs)` runs one batch of packed step inputs through the stages:

    stage 0 (embed + its layers) -> device_put -> stage 1 -> ... -> last (its layers,
    final norm, LM head, sampler, logprobs) -> StepOutputs (tokens int32 [S], ...), device
    arrays on the last stage

and returns without blocking. JAX's asynchronous dispatch lets the caller dispatch the
next batch's stage 0 while this one is still in stage 1 (research/parallel-axes.md
section 1, the MPMD recommendation): several batches are in flight, each stage may run a
different bucket shape on the same tick, and n batches through s stages of equal cost
take about n + s - 1 stage times instead of n * s. Each stage's KV cache is donated to
its own program, so batch i + 1 on a stage runs after batch i there, with no host sync.

Over several processes (a multi-host replica, serving.multihost) each process holds and
runs only the stages its devices are in (`local_stages`, a contiguous run): `run` takes
the activations of the stage before as a host array where that stage ran on another
process, and a stage whose mesh spans processes returns its outputs replicated, so that
any of its processes can read them and hand them on. `jax.device_put` between processes
is not used: on the CPU (jaxlib 0.10.2) it was not dependable (serving/multihost.py).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Sequence

import jax
import numpy as np

from medha_jax.engine.logprobs import StepOutputs, sample_with_logprobs
from medha_jax.engine.step_inputs import StepInputs, unpack_int32
from medha_jax.model.attention import AttentionMetadata
from medha_jax.model.llama import KVCache, numpy_dtype
from medha_jax.model.stages import Stage, StageSpec, stage_forward, stage_logits
from meshes import put_replicated, replicated

# A test hook, None in serving: (stage index, hidden [T, D]) -> hidden, traced into every
# stage program -- on the activations a stage hands on, and on those the last stage takes
# in -- so that a test can give each stage a known cost.
StageHook = Callable[[int, jax.Array], jax.Array]


@functools.partial(jax.jit, static_argnames=("spec", "shape", "num_kv_shards", "hook",
                                             "replicate_outputs"),
                   donate_argnames=("kv_cache",))
def stage_step(spec: StageSpec, params, kv_cache: KVCache, hidden, ints, floats, rng_keys, *,
               shape: tuple[int, int, int], num_kv_shards: int = 1,
               hook: StageHook | None = None, replicate_outputs: bool = False):
    """One stage of one engine step. Pure.

    hidden: float [T, D] from the stage before (None on the first stage); ints: the packed
    int32 inputs of bucket `shape` = (T, S, W) (StepInputs.pack); floats: float32 [2, S]
    temperature and top_p, rng_keys: uint32 [S, 2] (both None except on the last stage).
    Returns (hidden [T, D], cache), or on the last stage (StepOutputs, cache): the same
    tail as the one-program step (`sample_with_logprobs`).
    replicate_outputs: the outputs whole on every device of the stage (a stage over
    several processes, whose outputs one of them reads and hands on). The activations
    and tokens come out replicated over tp and kvp already (cp, which splits tokens, does
    not combine with spp), so this pins a layout XLA could otherwise choose differently.
    """
    x = unpack_int32(ints, shape, num_kv_shards)
    meta = AttentionMetadata.of(x)
    stage_input = x["token_ids"] if spec.is_first else hidden
    if hook is not None and spec.is_last and not spec.is_first:
        stage_input = hook(spec.index, stage_input)
    out, kv_cache = stage_forward(spec, params, kv_cache, stage_input, x["positions"], meta)
    if not spec.is_last:
        out = out if hook is None else hook(spec.index, out)
    else:
        head = functools.partial(stage_logits, spec, params)
        out = sample_with_logprobs(head, out, x, floats, rng_keys,
                                   vocab_size=spec.config.vocab_size)
    if replicate_outputs:
        out = jax.tree.map(
            lambda a: jax.lax.with_sharding_constraint(a, jax.sharding.PartitionSpec()), out)
    return out, kv_cache


class PipelinedStep:
    """Runs packed step inputs through SPP stages without blocking.

    Owns each stage's KV cache (`kv_caches[s]`, [layers of stage s, pages, page_size,
    kv_heads * head_dim] on its sub-mesh; None for a stage on other processes only).
    `compile`/`warmup` build every local stage's program per bucket shape ahead of time,
    as `Engine._compile` does; a shape that was not warmed compiles through jit on first
    use.
    """

    def __init__(self, stages: Sequence[Stage], *, num_pages: int, page_size: int,
                 num_kv_shards: int = 1, hook: StageHook | None = None):
        """num_pages: pages of each stage's cache over all its KV shards (kvp inside the
        stage); a shard's slots are the first num_pages / num_kv_shards pages' worth."""
        if not stages:
            raise ValueError("a pipeline needs at least one stage")
        indices = [stage.spec.index for stage in stages]
        if indices != list(range(len(stages))) or not stages[-1].spec.is_last:
            raise ValueError(f"stages must be given in order 0..n-1, got indices {indices}")
        self.stages = list(stages)
        if num_pages % num_kv_shards:
            raise ValueError(f"{num_pages=} must be a multiple of {num_kv_shards=}")
        self.page_size = page_size
        self.num_kv_shards = num_kv_shards
        self.pad_slot = num_pages // num_kv_shards * page_size     # one past a shard's slots
        self.local_stages = local_stage_range(stages)
        self.hop = process_hop(stages)
        self.kv_caches = [stage.new_kv_cache(num_pages, page_size)
                          if s in self.local_stages else None
                          for s, stage in enumerate(self.stages)]
        self.hook = hook
        self._replicated = [replicated(stage.mesh) for stage in self.stages]
        # A stage over several processes replicates what it hands on (stage_step).
        self._spans_processes = [not r.is_fully_addressable for r in self._replicated]
        # (stage index, bucket shape) -> that stage's compiled program.
        self.executables: dict[tuple[int, tuple[int, int, int]], jax.stages.Compiled] = {}

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def reset_kv_caches(self) -> None:
        """Fresh zeroed caches for every stage (after a failed step lost them)."""
        self.kv_caches = [None if cache is None else stage.new_kv_cache(*cache.k.shape[1:3])
                          for stage, cache in zip(self.stages, self.kv_caches)]

    # -- compilation ---------------------------------------------------------------

    def _stage_args(self, s: int, hidden, packed) -> tuple:
        """Positional arguments of `stage_step` after `spec`, the inputs on stage s."""
        stage = self.stages[s]
        ints, floats, rng_keys = packed
        put = functools.partial(put_replicated, sharding=self._replicated[s])
        last = stage.spec.is_last
        return (stage.params, self.kv_caches[s], hidden, put(ints),
                put(floats) if last else None, put(rng_keys) if last else None)

    def compile(self, shape: tuple[int, int, int]) -> tuple[jax.stages.Compiled | None, ...]:
        """Lowers and compiles every local stage's program for bucket `shape` = (T, S, W);
        returns them in stage order (None for a stage on other processes)."""
        packed = StepInputs.padding(shape, self.pad_slot, self.num_kv_shards).pack()
        for s in self.local_stages:
            stage = self.stages[s]
            hidden = None
            if not stage.spec.is_first:
                spec = stage.spec
                hidden = jax.ShapeDtypeStruct(
                    (shape[0], spec.config.hidden_size), np.dtype(numpy_dtype(spec.config.dtype)),
                    sharding=spec.hidden_sharding(shape[0]))
            with jax.set_mesh(stage.mesh):
                lowered = stage_step.lower(stage.spec, *self._stage_args(s, hidden, packed),
                                           shape=shape, num_kv_shards=self.num_kv_shards,
                                           hook=self.hook,
                                           replicate_outputs=self._spans_processes[s])
            self.executables[(s, shape)] = lowered.compile()
        return tuple(self.executables.get((s, shape)) for s in range(self.num_stages))

    def warmup(self, shapes: Iterable[tuple[int, int, int]]) -> None:
        for shape in shapes:
            if (self.local_stages[0], shape) not in self.executables:
                self.compile(shape)

    # -- execution -----------------------------------------------------------------

    def dispatch(self, inputs: StepInputs) -> StepOutputs:
        """Dispatches one batch through every stage; returns its outputs (sampled ids int32
        [S], logprobs) as device arrays on the last stage, without waiting for any of it."""
        return self.run(inputs.padded_shape, inputs.pack())

    def run(self, shape: tuple[int, int, int], packed: tuple[np.ndarray, ...],
            hidden: np.ndarray | None = None) -> StepOutputs | jax.Array:
        """Dispatches packed step inputs (`StepInputs.pack()`) of bucket `shape` through
        this process's stages, without waiting. hidden: float [T, D] on the host, the
        activations of the stage before the first local one (which ran on another
        process); None when the first local stage is the first. Returns the last local
        stage's outputs: StepOutputs on the last stage, else its activations [T, D]."""
        first = self.local_stages[0]
        if hidden is None and first > 0:
            raise ValueError(f"this process's first stage is {first}: it starts from the "
                             f"activations of stage {first - 1}, which ran on another process")
        if hidden is not None and first == 0:
            raise ValueError("this process runs stage 0, which starts from the token ids: "
                             "hidden must be None")
        if hidden is not None:
            sharding = self.stages[first].spec.hidden_sharding(shape[0])
            hidden = jax.make_array_from_callback(hidden.shape, sharding,
                                                  lambda index: hidden[index])
        for s in self.local_stages:
            stage = self.stages[s]
            if s > first:
                hidden = jax.device_put(hidden, stage.spec.hidden_sharding(shape[0]))
            args = self._stage_args(s, hidden, packed)
            executable = self.executables.get((s, shape))
            if executable is not None:
                hidden, self.kv_caches[s] = executable(*args)
            else:
                with jax.set_mesh(stage.mesh):
                    hidden, self.kv_caches[s] = stage_step(
                        stage.spec, *args, shape=shape, num_kv_shards=self.num_kv_shards,
                        hook=self.hook, replicate_outputs=self._spans_processes[s])
        return hidden

    def weight_bytes_per_device(self) -> dict[jax.Device, int]:
        """Parameter bytes on each device over all stages, from the arrays' shards."""
        out: dict[jax.Device, int] = {}
        for stage in self.stages:
            for device, nbytes in stage.weight_bytes_per_device().items():
                out[device] = out.get(device, 0) + nbytes
        return out


def local_stage_range(stages: Sequence[Stage]) -> range:
    """The stages with devices on this process, a contiguous run (on one process: all of
    them). A process holds a contiguous block of the mesh and spp is outer to every axis
    but dp, so a process holds whole stages, or a part of one."""
    here = jax.process_index()
    local = [s for s, stage in enumerate(stages)
             if any(d.process_index == here for d in stage.mesh.devices.flat)]
    if not local or local != list(range(local[0], local[-1] + 1)):
        raise ValueError(f"process {here} holds devices of stages {local}: a process must "
                         f"hold a contiguous run of at least one stage")
    return range(local[0], local[-1] + 1)


@dataclasses.dataclass(frozen=True)
class ProcessHop:
    """Where a step's activations leave process 0's stages (spp across processes)."""

    stage: int                   # the first stage process 0 holds no device of
    processes: tuple[int, ...]   # the processes of stages [stage, n): they start from them
    reporter: int                # the first process of the last stage: returns the outputs


def process_hop(stages: Sequence[Stage]) -> ProcessHop | None:
    """The one hop of activations between processes, None when process 0 holds a device
    of every stage. Process 0 schedules and sends every step (serving.multihost), so the
    activations leaving its stages go through it once; a second hop, between two sets of
    other processes, would go through it again and is refused."""
    holders = [{d.process_index for d in stage.mesh.devices.flat} for stage in stages]
    first_later = next((s for s, held in enumerate(holders) if 0 not in held), None)
    if first_later is None:
        return None
    later = set().union(*holders[first_later:])
    for p in sorted(later):
        first = next(s for s, held in enumerate(holders) if p in held)
        if first != first_later:
            raise ValueError(
                f"spp={len(stages)} over these processes hands activations between "
                f"processes more than once (process {p}'s first stage is {first}, after "
                f"process 0's stages end at {first_later - 1}): put at most two sets of "
                f"processes on the pipeline, process 0's stages and the rest")
    return ProcessHop(first_later, tuple(sorted(later)), min(holders[-1]))
