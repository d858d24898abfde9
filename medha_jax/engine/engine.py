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
import jax.numpy as jnp
import numpy as np
from flax import nnx

from medha_jax.engine.buckets import BucketLadder
from medha_jax.engine.sampler import sample
from medha_jax.engine.step_inputs import StepInputs, build_step_inputs
from medha_jax.kv_cache.allocator import BlockAllocator
from medha_jax.model import AttentionMetadata, KVCache
from medha_jax.model.loading import Model
from medha_jax.request import Batch, Request, ScheduledChunk, StepResult
from medha_jax.scheduler.predictor import BatchFeatures, ProfiledPredictor, batch_features
from meshes import replicated


STEP_RECORDS_KEPT = 10_000


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Capacity and shape ladder of one engine.

    The cache holds `num_pages` pages of `page_size` tokens (by default enough for
    `max_kv_tokens`). A step holds at most `max_tokens_per_step` tokens from at most
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


# The step's int32 inputs travel as one packed vector and its float32 ones as one matrix:
# three host-to-device transfers per step instead of eleven (each costs tens of
# microseconds of host time). The bucket shape (T, S, W) fixes every offset statically.
_PACKED_INT32 = ("token_ids", "positions", "slot_mapping", "cu_q_lens", "kv_lens", "page_table",
                 "num_seqs", "logits_indices", "top_k")
_PACKED_FLOAT32 = ("temperature", "top_p")


def _int32_shapes(shape: tuple[int, int, int]) -> dict[str, tuple[int, ...]]:
    num_tokens, num_seqs, width = shape
    return {"token_ids": (num_tokens,), "positions": (num_tokens,),
            "slot_mapping": (num_tokens,), "cu_q_lens": (num_seqs + 1,), "kv_lens": (num_seqs,),
            "page_table": (num_seqs, width), "num_seqs": (1,), "logits_indices": (num_seqs,),
            "top_k": (num_seqs,)}


def pack_inputs(inputs: StepInputs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """StepInputs -> (int32 [N], float32 [2, S], uint32 [S, 2]) for the device."""
    ints = np.concatenate([getattr(inputs, name).ravel() for name in _PACKED_INT32])
    floats = np.stack([getattr(inputs, name) for name in _PACKED_FLOAT32])
    return ints, floats, inputs.rng_keys


def _unpack_int32(ints, shape: tuple[int, int, int]) -> dict:
    arrays, offset = {}, 0
    for name, field_shape in _int32_shapes(shape).items():
        size = int(np.prod(field_shape))
        arrays[name] = ints[offset:offset + size].reshape(field_shape)
        offset += size
    return arrays


@functools.partial(jax.jit, static_argnames=("graphdef", "shape"),
                   donate_argnames=("kv_cache",))
def step(graphdef, state, kv_cache: KVCache, ints, floats, rng_keys, *,
         shape: tuple[int, int, int]):
    """One engine step: forward, last-token logits per sequence, sampling. Pure.

    ints: the packed int32 inputs of bucket `shape` = (T, S, W) (see pack_inputs);
    floats: float32 [2, S] temperature and top_p; rng_keys: uint32 [S, 2].
    Returns (sampled token ids int32 [S], the updated cache). The cache is donated, so
    XLA writes the new K/V in place. Engines over the same model share jit's cache.
    """
    x = _unpack_int32(ints, shape)
    # One KV shard: the metadata's leading shard dimension is 1.
    meta = AttentionMetadata(slot_mapping=x["slot_mapping"][None], page_table=x["page_table"][None],
                             cu_q_lens=x["cu_q_lens"], kv_lens=x["kv_lens"][None],
                             num_seqs=x["num_seqs"])
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
        self.max_model_len = min(config.max_model_len or model.config.max_position_embeddings,
                                 model.config.max_position_embeddings,
                                 config.total_pages * config.page_size)
        self.allocator = BlockAllocator(config.total_pages, config.page_size,
                                        enable_prefix_caching=config.enable_prefix_caching)
        self.ladder = BucketLadder.from_limits(
            max_tokens=config.max_tokens_per_step, min_tokens=config.min_token_bucket,
            max_seqs=config.max_seqs,
            max_pages_per_seq=-(-self.max_model_len // config.page_size))
        self.max_seqs = config.max_seqs
        self.pad_slot = config.total_pages * config.page_size
        self.kv_cache = model.new_kv_cache(config.total_pages, config.page_size)
        self._replicated = replicated(model.mesh)
        # (tokens, seqs, width) bucket -> its ahead-of-time compiled step.
        self.executables: dict[tuple[int, int, int], jax.stages.Compiled] = {}
        # (features, measured seconds) of recent steps: what the profiled runtime
        # predictor is refitted to. Bounded, so a long-running server does not grow.
        self.step_records: collections.deque[tuple[BatchFeatures, float]] = collections.deque(
            maxlen=STEP_RECORDS_KEPT)
        self.warmup_seconds: float | None = None
        self.last_host_seconds: float | None = None

    # -- compilation -------------------------------------------------------------

    def step_args(self, inputs: StepInputs) -> tuple:
        """Positional arguments of `step` (graphdef first) with the inputs on the device."""
        packed = jax.device_put(pack_inputs(inputs), self._replicated)
        return (self.model.graphdef, self.model.state, self.kv_cache, *packed)

    def _compile(self, shape: tuple[int, int, int]) -> jax.stages.Compiled:
        inputs = _padding_inputs(shape, self.pad_slot)
        with jax.set_mesh(self.model.mesh):
            return step.lower(*self.step_args(inputs), shape=shape).compile()

    def warmup(self, progress: bool = True, shapes=None) -> None:
        """Compiles every bucket shape (or just `shapes`) ahead of time, so no request
        compiles later."""
        from tqdm.auto import tqdm

        shapes = [s for s in (shapes or self.ladder.all_shapes()) if s not in self.executables]
        start = time.perf_counter()
        for shape in tqdm(shapes, desc="compiling step buckets", unit="exe", disable=not progress):
            self.executables[shape] = self._compile(shape)
        self.warmup_seconds = time.perf_counter() - start
        if progress:
            print(f"warm-up: {len(self.executables)} executables compiled in "
                  f"{self.warmup_seconds:.1f} s")

    @property
    def num_executables(self) -> int:
        return len(self.executables)

    # -- execution ---------------------------------------------------------------

    def execute(self, batch: Batch) -> StepResult:
        start = time.perf_counter()
        inputs = build_step_inputs(batch, self.allocator, self.ladder, pad_slot=self.pad_slot)
        shape = inputs.padded_shape
        args = self.step_args(inputs)
        executable = self.executables.get(shape)
        if executable is not None:
            tokens, self.kv_cache = executable(*args[1:])
        else:
            # Only without warm-up (tests, notebooks): jit compiles on first use and shares
            # its cache with every engine over the same model.
            with jax.set_mesh(self.model.mesh):
                tokens, self.kv_cache = step(*args, shape=shape)
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


    # -- calibration ---------------------------------------------------------------

    def fit_predictor(self, *, repeats: int = 2, seed: int = 0) -> ProfiledPredictor:
        """Times a sweep of synthetic batches and fits the profiled RuntimePredictor.

        The sweep covers the shapes the packer chooses between: lone prefill chunks of
        every token bucket at several context depths; decode batches of every sequence
        bucket whose longest context runs from short to the longest that fits, the rest
        short (a long request decoding among chats, as in serving); and decodes beside a
        chunk, both a large one at the start and a small one deep in its context. Pages
        are borrowed from the allocator and returned; nothing enters the prefix cache.
        """
        rng = np.random.default_rng(seed)
        page_budget = self.allocator.num_free_pages * self.allocator.page_size
        max_context = min(self.max_model_len, page_budget // 2)
        buckets = self.ladder.token_buckets
        depths = (0.0, 0.25, 0.5, 0.9)
        batches = []
        for chunk in buckets:
            for depth in depths:
                start = int(depth * (max_context - chunk))
                if start >= 0 and start + chunk <= max_context:
                    batches.append([(start, chunk)])
        small_chunk, large_chunk = buckets[0], buckets[len(buckets) // 2]
        for num_decodes in sorted({1, *self.ladder.seq_buckets}):
            for depth in (0.02, *depths[1:]):           # chats alone, then beside a long one
                longest = max(2, int(depth * max_context))
                # One context of `longest`, the others up to max_context / num_decodes in
                # all, so the batch always fits in 2 x max_context.
                bound = min(longest, max_context // num_decodes)
                others = rng.integers(1, max(2, bound), num_decodes - 1)
                decodes = [(longest - 1, 1)] + [(int(c), 1) for c in others]
                batches.append(decodes)
                if num_decodes >= self.max_seqs:
                    continue
                if depth == 0.25 and num_decodes + large_chunk <= self.ladder.max_tokens:
                    batches.append(decodes + [(0, large_chunk)])
                if num_decodes + small_chunk <= self.ladder.max_tokens:
                    start = min(longest, max_context - small_chunk)
                    batches.append(decodes + [(start, small_chunk)])
        page_size = self.allocator.page_size
        # A small cache cannot hold some of these shapes: they cannot occur, skip them.
        batches = [chunks for chunks in batches
                   if sum(-(-(start + n) // page_size) for start, n in chunks) * page_size
                   <= page_budget]
        # Each pass runs every batch once, in a new order and on newly borrowed pages, as
        # serving does: no step finds its own K/V in the CPU's caches from a run just
        # before, and a shared machine's slow drifts spread over every shape instead of
        # biasing some. The first pass is not recorded (first touches of the buffers).
        records = []
        for run in range(repeats + 1):
            for i in rng.permutation(len(batches)):
                batch = self.borrow_batch(batches[i], rng)
                try:
                    self.execute(batch)
                finally:
                    self.release_batch(batch)
                record = self.step_records.pop()       # calibration is not traffic
                if run:
                    records.append(record)
        return ProfiledPredictor.fit(records, token_buckets=self.ladder.token_buckets,
                                     seq_buckets=self.ladder.seq_buckets)

    def borrow_batch(self, chunks: list[tuple[int, int]], rng) -> Batch:
        """A synthetic batch for calibration and benchmarks: chunk i covers tokens
        [start, start + n) of a fresh random request, whose pages are reserved here and
        must be given back with `release_batch`. K/V before `start` is whatever the
        borrowed pages hold: right for timing, meaningless for outputs."""
        scheduled = []
        for i, (start, num_tokens) in enumerate(chunks):
            length = start + num_tokens
            request_id = f"__calibration_{i}"
            request = Request(request_id, length, 1, 0.0,
                              prompt_token_ids=rng.integers(0, self.model.config.vocab_size,
                                                            length).tolist())
            self.allocator.allocate(request_id)
            if not self.allocator.reserve(request_id, length):
                raise RuntimeError(f"calibration needs {length} tokens of free KV cache")
            request.num_computed_tokens = start
            scheduled.append(ScheduledChunk(request, start, num_tokens))
        return Batch(scheduled)

    def release_batch(self, batch: Batch) -> None:
        for chunk in batch.chunks:
            self.allocator.free(chunk.request.request_id)


def _padding_inputs(shape: tuple[int, int, int], pad_slot: int) -> StepInputs:
    """All-padding inputs of one bucket shape: what warm-up compiles with. Writes nothing."""
    num_tokens, num_seqs, width = shape
    zeros = functools.partial(np.zeros, dtype=np.int32)
    return StepInputs(
        token_ids=zeros(num_tokens), positions=zeros(num_tokens),
        slot_mapping=np.full(num_tokens, pad_slot, np.int32), cu_q_lens=zeros(num_seqs + 1),
        kv_lens=zeros(num_seqs), page_table=zeros((num_seqs, width)), num_seqs=zeros(1),
        logits_indices=zeros(num_seqs), sample_mask=np.zeros(num_seqs, bool),
        temperature=np.zeros(num_seqs, np.float32), top_k=zeros(num_seqs),
        top_p=np.ones(num_seqs, np.float32), rng_keys=np.zeros((num_seqs, 2), np.uint32),
        num_tokens=0, request_ids=())
