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
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence

import jax
import numpy as np

from medha_jax.engine.logprobs import StepOutputs, sample_with_logprobs
from medha_jax.engine.step_inputs import StepInputs, unpack_int32
from medha_jax.model.attention import AttentionMetadata
from medha_jax.model.llama import KVCache, numpy_dtype
from medha_jax.model.stages import Stage, StageSpec, stage_forward, stage_logits
from meshes import replicated

# A test hook, None in serving: (stage index, hidden [T, D]) -> hidden, traced into every
# stage program -- on the activations a stage hands on, and on those the last stage takes
# in -- so that a test can give each stage a known cost.
StageHook = Callable[[int, jax.Array], jax.Array]


@functools.partial(jax.jit, static_argnames=("spec", "shape", "num_kv_shards", "hook"),
                   donate_argnames=("kv_cache",))
def stage_step(spec: StageSpec, params, kv_cache: KVCache, hidden, ints, floats, rng_keys, *,
               shape: tuple[int, int, int], num_kv_shards: int = 1,
               hook: StageHook | None = None):
    """One stage of one engine step. Pure.

    hidden: float [T, D] from the stage before (None on the first stage); ints: the packed
    int32 inputs of bucket `shape` = (T, S, W) (StepInputs.pack); floats: float32 [2, S]
    temperature and top_p, rng_keys: uint32 [S, 2] (both None except on the last stage).
    Returns (hidden [T, D], cache), or on the last stage (StepOutputs, cache): the same
    tail as the one-program step (`sample_with_logprobs`).
    """
    x = unpack_int32(ints, shape, num_kv_shards)
    meta = AttentionMetadata.of(x)
    stage_input = x["token_ids"] if spec.is_first else hidden
    if not spec.is_last:
        out, kv_cache = stage_forward(spec, params, kv_cache, stage_input, x["positions"], meta)
        return (out if hook is None else hook(spec.index, out)), kv_cache
    if hook is not None and not spec.is_first:
        stage_input = hook(spec.index, stage_input)
    hidden, kv_cache = stage_forward(spec, params, kv_cache, stage_input, x["positions"], meta)
    head = functools.partial(stage_logits, spec, params)
    return sample_with_logprobs(head, hidden, x, floats, rng_keys,
                                vocab_size=spec.config.vocab_size), kv_cache


class PipelinedStep:
    """Runs packed step inputs through SPP stages without blocking.

    Owns each stage's KV cache (`kv_caches[s]`, [layers of stage s, pages, page_size,
    kv_heads * head_dim] on its sub-mesh). `compile`/`warmup` build every stage's program
    per bucket shape ahead of time, as `Engine._compile` does; a shape that was not
    warmed compiles through jit on first use.
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
        self.kv_caches = [stage.new_kv_cache(num_pages, page_size) for stage in self.stages]
        self.hook = hook
        self._replicated = [replicated(stage.mesh) for stage in self.stages]
        # (stage index, bucket shape) -> that stage's compiled program.
        self.executables: dict[tuple[int, tuple[int, int, int]], jax.stages.Compiled] = {}

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def reset_kv_caches(self) -> None:
        """Fresh zeroed caches for every stage (after a failed step lost them)."""
        self.kv_caches = [stage.new_kv_cache(*cache.k.shape[1:3])
                          for stage, cache in zip(self.stages, self.kv_caches)]

    # -- compilation ---------------------------------------------------------------

    def _stage_args(self, s: int, hidden, packed) -> tuple:
        """Positional arguments of `stage_step` after `spec`, the inputs on stage s."""
        stage = self.stages[s]
        ints, floats, rng_keys = packed
        put = functools.partial(jax.device_put, device=self._replicated[s])
        last = stage.spec.is_last
        return (stage.params, self.kv_caches[s], hidden, put(ints),
                put(floats) if last else None, put(rng_keys) if last else None)

    def compile(self, shape: tuple[int, int, int]) -> tuple[jax.stages.Compiled, ...]:
        """Lowers and compiles every stage's program for bucket `shape` = (T, S, W);
        returns them in stage order."""
        packed = StepInputs.padding(shape, self.pad_slot, self.num_kv_shards).pack()
        for s, stage in enumerate(self.stages):
            hidden = None
            if not stage.spec.is_first:
                spec = stage.spec
                hidden = jax.ShapeDtypeStruct(
                    (shape[0], spec.config.hidden_size), np.dtype(numpy_dtype(spec.config.dtype)),
                    sharding=spec.hidden_sharding(shape[0]))
            with jax.set_mesh(stage.mesh):
                lowered = stage_step.lower(stage.spec, *self._stage_args(s, hidden, packed),
                                           shape=shape, num_kv_shards=self.num_kv_shards,
                                           hook=self.hook)
            self.executables[(s, shape)] = lowered.compile()
        return tuple(self.executables[(s, shape)] for s in range(self.num_stages))

    def warmup(self, shapes: Iterable[tuple[int, int, int]]) -> None:
        for shape in shapes:
            if (0, shape) not in self.executables:
                self.compile(shape)

    # -- execution -----------------------------------------------------------------

    def dispatch(self, inputs: StepInputs) -> StepOutputs:
        """Dispatches one batch through every stage; returns its outputs (sampled ids int32
        [S], logprobs) as device arrays on the last stage, without waiting for any of it."""
        shape = inputs.padded_shape
        packed = inputs.pack()
        hidden = None
        for s, stage in enumerate(self.stages):
            if hidden is not None:
                hidden = jax.device_put(hidden, stage.spec.hidden_sharding(shape[0]))
            args = self._stage_args(s, hidden, packed)
            executable = self.executables.get((s, shape))
            if executable is not None:
                hidden, self.kv_caches[s] = executable(*args)
            else:
                with jax.set_mesh(stage.mesh):
                    hidden, self.kv_caches[s] = stage_step(
                        stage.spec, *args, shape=shape, num_kv_shards=self.num_kv_shards,
                        hook=self.hook)
        return hidden

    def weight_bytes_per_device(self) -> dict[jax.Device, int]:
        """Parameter bytes on each device over all stages, from the arrays' shards."""
        out: dict[jax.Device, int] = {}
        for stage in self.stages:
            for device, nbytes in stage.weight_bytes_per_device().items():
                out[device] = out.get(device, 0) + nbytes
        return out

