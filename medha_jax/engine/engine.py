"""The JAX engine: turns a scheduler Batch into one jitted step on the mesh.

The step is one pure function (model forward over the ragged paged layout, logits of
each sequence's last token, sampling on device) compiled ahead of time for every bucket
shape in the ladder, with the KV cache donated so XLA updates it in place. After
`warmup()` no batch can reach the compiler: a shape outside the ladder is an error.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time

import jax
import numpy as np
from flax import nnx

from medha_jax.buckets import BucketLadder
from medha_jax.engine.sampler import sample
from medha_jax.engine.step_inputs import StepInputs, build_step_inputs, unpack_int32
from medha_jax.kv_cache.allocator import BlockAllocator
from medha_jax.model import AttentionMetadata, KVCache
from medha_jax.model.attention import num_cp_ranks, num_kv_shards
from medha_jax.model.loading import Model
from medha_jax.request import Batch, StepResult
from medha_jax.scheduler.cp_cost import RingCost
from medha_jax.scheduler.predictor import BatchFeatures, batch_features
from meshes import replicated


STEP_RECORDS_KEPT = 10_000


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Capacity and shape ladder of one engine.

    The cache holds `num_pages` pages of `page_size` tokens (by default enough for
    `max_kv_tokens`) on every KV shard (kvp of the model's mesh); a request's context fills
    a shard up to `max_tokens_per_kvp_group` tokens (default: the shard's whole pool), then
    the next (Medha's progressive KVP scaling). A step holds at most `max_tokens_per_step` tokens from at most
    `max_seqs` sequences; both are padded up to power-of-two buckets starting at
    `min_token_bucket`.
    """

    page_size: int = 16
    num_pages: int | None = None
    max_kv_tokens: int = 32_768
    max_model_len: int | None = None
    max_tokens_per_step: int = 512
    min_token_bucket: int = 16
    max_seqs: int = 32
    enable_prefix_caching: bool = True
    max_tokens_per_kvp_group: int | None = None

    def __post_init__(self):
        for field in ("page_size", "max_kv_tokens", "max_tokens_per_step", "min_token_bucket",
                      "max_seqs"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig.{field} must be an int >= 1, got {value!r}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"EngineConfig.num_pages must be >= 1, got {self.num_pages}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"EngineConfig.max_model_len must be >= 1, got {self.max_model_len}")

    @property
    def total_pages(self) -> int:
        return self.num_pages or -(-self.max_kv_tokens // self.page_size)


@functools.partial(jax.jit, static_argnames=("graphdef", "shape", "num_kv_shards", "cp_ranks"),
                   donate_argnames=("kv_cache",))
def step(graphdef, state, kv_cache: KVCache, ints, floats, rng_keys, *,
         shape: tuple[int, int, int], num_kv_shards: int = 1, cp_ranks: int = 1):
    """One engine step: forward, last-token logits per sequence, sampling. Pure.

    ints: the packed int32 inputs of bucket `shape` = (T, S, W) (see StepInputs.pack);
    floats: float32 [2, S] temperature and top_p; rng_keys: uint32 [S, 2].
    Returns (sampled token ids int32 [S], the updated cache). The cache is donated, so
    XLA writes the new K/V in place. Engines over the same model share jit's cache.
    """
    x = unpack_int32(ints, shape, num_kv_shards, cp_ranks)
    meta = AttentionMetadata.of(x)
    module = nnx.merge(graphdef, state)
    hidden, kv_cache = module(x["token_ids"], x["positions"], kv_cache, meta)
    logits = module.logits(hidden[x["logits_indices"]])      # [S, vocab] float32
    temperature, top_p = floats[0], floats[1]
    return sample(logits, temperature, x["top_k"], top_p, rng_keys), kv_cache


class Engine:
    """Implements medha_jax.request.Executor on a loaded Model."""

    def __init__(self, model: Model, config: EngineConfig | None = None):
        config = config or EngineConfig()
        self.model = model
        self.config = config
        self.num_kv_shards = num_kv_shards(model.layout)
        # cp: one pool of pages of cp * page_size tokens, one page on every rank (cp_layout).
        self.cp_ranks = num_cp_ranks(model.layout)
        self.ring_cost = RingCost.create(model.config, num_ranks=self.cp_ranks) \
            if self.cp_ranks > 1 else None
        self.allocator = BlockAllocator(config.total_pages, config.page_size * self.cp_ranks,
                                        num_shards=self.num_kv_shards // self.cp_ranks,
                                        max_tokens_per_shard=config.max_tokens_per_kvp_group,
                                        enable_prefix_caching=config.enable_prefix_caching)
        self.max_model_len = min(config.max_model_len or model.config.max_position_embeddings,
                                 model.config.max_position_embeddings,
                                 self.allocator.max_tokens_per_request)
        # A page table holds one shard's pages of a sequence: at most a segment's.
        tokens_per_table = min(self.max_model_len, self.allocator.max_tokens_per_shard)
        self.ladder = BucketLadder.from_limits(
            max_tokens=config.max_tokens_per_step, min_tokens=config.min_token_bucket,
            max_seqs=config.max_seqs,
            max_pages_per_seq=-(-tokens_per_table // config.page_size))
        self.max_seqs = config.max_seqs
        self.pad_slot = config.total_pages * config.page_size          # one past a shard's slots
        self.kv_cache = model.new_kv_cache(self.num_kv_shards * config.total_pages,
                                           config.page_size)
        self._replicated = replicated(model.mesh)
        # (tokens, seqs, width) bucket -> its ahead-of-time compiled step.
        self.executables: dict[tuple[int, int, int], jax.stages.Compiled] = {}
        # (features, measured seconds) of recent steps: what the profiled runtime
        # predictor is refitted to. Bounded, so a long-running server does not grow.
        self.step_records: collections.deque[tuple[BatchFeatures, float]] = collections.deque(
            maxlen=STEP_RECORDS_KEPT)
        self.warmup_seconds: float | None = None
        # Set by warmup(): from then on a shape missing from `executables` is an error.
        self.warmed_up = False
        self.last_host_seconds: float | None = None

    # -- compilation -------------------------------------------------------------

    def step_args(self, inputs: StepInputs) -> tuple:
        """Positional arguments of `step` (graphdef first) with the inputs on the device."""
        packed = jax.device_put(inputs.pack(), self._replicated)
        return (self.model.graphdef, self.model.state, self.kv_cache, *packed)

    def _compile(self, shape: tuple[int, int, int]) -> jax.stages.Compiled:
        """The one way a step shape is compiled: ahead of time, into `executables`."""
        inputs = StepInputs.padding(shape, self.pad_slot, self.num_kv_shards, self.cp_ranks)
        with jax.set_mesh(self.model.mesh):
            executable = step.lower(*self.step_args(inputs), shape=shape,
                                    num_kv_shards=self.num_kv_shards,
                                    cp_ranks=self.cp_ranks).compile()
        self.executables[shape] = executable
        return executable

    def warmup(self, progress: bool = True, shapes=None) -> None:
        """Compiles every bucket shape (or just `shapes`) ahead of time. From then on a
        step of any other shape is an error: no request compiles later. Further calls
        may add shapes."""
        from tqdm.auto import tqdm

        shapes = [s for s in (shapes or self.ladder.all_shapes()) if s not in self.executables]
        start = time.perf_counter()
        for shape in tqdm(shapes, desc="compiling step buckets", unit="exe", disable=not progress):
            self._compile(shape)
        self.warmup_seconds = time.perf_counter() - start
        self.warmed_up = True
        if progress:
            print(f"warm-up: {len(self.executables)} executables compiled in "
                  f"{self.warmup_seconds:.1f} s")

    def executable(self, shape: tuple[int, int, int]) -> jax.stages.Compiled:
        """The compiled step of bucket `shape` = (T, S, W).

        Before `warmup()` (tests, notebooks) a missing shape is compiled now, the same way
        warm-up would; after it, a missing shape is an error rather than a compile stall
        in the middle of serving.
        """
        executable = self.executables.get(shape)
        if executable is not None:
            return executable
        if self.warmed_up:
            ladder = self.ladder
            raise RuntimeError(
                f"step shape (tokens, seqs, width)={shape} was not compiled at warm-up, and "
                f"nothing compiles after it; {len(self.executables)} shapes are compiled. "
                f"Warm up with shapes=None (every shape of the ladder: tokens "
                f"{ladder.token_buckets}, seqs {ladder.seq_buckets}, width "
                f"{ladder.width_buckets}) or include {shape}")
        return self._compile(shape)

    @property
    def num_executables(self) -> int:
        return len(self.executables)

    # -- execution ---------------------------------------------------------------

    def execute(self, batch: Batch) -> StepResult:
        start = time.perf_counter()
        inputs = build_step_inputs(batch, self.allocator, self.ladder, pad_slot=self.pad_slot,
                                   cp_ranks=self.cp_ranks, ring_cost=self.ring_cost)
        shape = inputs.padded_shape
        executable = self.executable(shape)
        args = self.step_args(inputs)
        tokens, self.kv_cache = executable(*args[1:])
        dispatched = time.perf_counter()
        # While the device runs, do this step's bookkeeping (asynchronous dispatch).
        features = batch_features(batch, self.ladder.token_buckets)
        tokens = np.asarray(tokens)                       # waits for the device
        returned = time.perf_counter()
        sampled = {chunk.request.request_id: int(tokens[i])
                   for i, chunk in enumerate(batch.chunks) if chunk.samples}
        end = time.perf_counter()
        seconds = end - start
        # Host time on the critical path: building and dispatching the step, and reading
        # back its tokens. The bookkeeping above overlaps the device and is not counted.
        self.last_host_seconds = (dispatched - start) + (end - returned)
        self.step_records.append((features, seconds))
        return StepResult(sampled_token_ids=sampled, duration_s=seconds)
