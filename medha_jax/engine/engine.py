"""The JAX engine: turns a scheduler Batch into one jitted step on the mesh.

The step is one pure function (model forward over the ragged paged layout, logits of
each sequence's last token, sampling on device, the logprobs requests asked for:
medha_jax.engine.logprobs) compiled ahead of time for every bucket
shape in the ladder, with the KV cache donated so XLA updates it in place. After
`warmup()` no batch can reach the compiler: a shape outside the ladder is an error.

On a mesh with spp > 1 the step runs as one program per stage (`PipelinedStep`): each
stage holds only its layers' weights and KV cache, activations hand on with device_put
(between processes of a multi-host replica, through process 0's step channel:
serving.multihost), and up to spp batches are in flight. `dispatch(batch)` starts a step
without waiting and `collect(pending)` waits for it (the PipelinedExecutor interface that
medha_jax.scheduler.in_flight drives); `execute` is the two back to back.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import threading
import time

import jax
import numpy as np
from flax import nnx

from medha_jax.buckets import BucketLadder, shape_size
from medha_jax.engine.logprobs import StepOutputs, sample_with_logprobs
from medha_jax.engine import step_cache
from medha_jax.engine.pipeline import PipelinedStep, StageHook
from medha_jax.engine.step_inputs import StepInputs, build_step_inputs, unpack_int32
from medha_jax.kv_cache.allocator import BlockAllocator
from medha_jax.model import AttentionMetadata, KVCache
from medha_jax.model.attention import num_cp_ranks, num_kv_shards
from medha_jax.model.llama import numpy_dtype
from medha_jax.model.loading import Model
from medha_jax.model.stages import num_stages, split_stages
from medha_jax.request import Batch, StepResult, TokenLogprobs
from medha_jax.scheduler.cp_cost import PASS_KV, PASS_Q, RingCost
from medha_jax.scheduler.hardware import hardware_for_device_kind
from medha_jax.scheduler.predictor import BatchFeatures, batch_features
from meshes import put_replicated, replicated
from pallas_kernels import order_decodes_first
from pallas_kernels.block_sizes import device_kind_of
from pallas_kernels.dispatch import choose_attention, prefill_query_block


STEP_RECORDS_KEPT = 10_000


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Capacity and shape ladder of one engine.

    The cache holds `num_pages` pages of `page_size` tokens (by default enough for
    `max_kv_tokens`) on every KV shard (kvp of the model's mesh); a request's context fills
    a shard up to `max_tokens_per_kvp_group` tokens, then the next (Medha's progressive KVP
    scaling: see `tokens_per_kvp_group` for the default). A step holds at most
    `max_tokens_per_step` tokens from at most `max_seqs` sequences. Tokens are padded up to
    power-of-two buckets starting at `min_token_bucket`; sequences up to 4x rungs from 8,
    never above the step's token bucket (`BucketLadder.seq_bucket`).

    min_token_bucket is 1: a decode of 1, 2 or 4 sequences runs a step of 1, 2 or 4 tokens.
    Measured on a 2-core CPU with SmolLM2-135M (`benchmarks/engine.py`, the rows "decode xN,
    min_token_bucket B"), a step of 1 token costs ~0.6x one of 16 tokens and 8 sequences;
    on a GPU the small rungs are the batch sizes vLLM captures CUDA graphs for (1, 2, 4,
    8). They add 4 token rungs x the width rungs to the executables, compiled in the
    background with the rest.
    """

    page_size: int = 16
    num_pages: int | None = None
    max_kv_tokens: int = 32_768
    max_model_len: int | None = None
    max_tokens_per_step: int = 512
    min_token_bucket: int = 1
    max_seqs: int = 32
    enable_prefix_caching: bool = True
    max_tokens_per_kvp_group: int | None = None
    # Batches dispatched and not yet collected. None: the number of SPP stages. One program
    # (spp = 1) may take 2, so that the host forms and builds step n + 1 while the device
    # runs step n; a decode still waits for its previous token, so this helps batches with
    # prefill chunks, not decode-only ones. Not the default at spp = 1: a batch formed while
    # the decodes' tokens are in flight holds only prefill chunks, so whenever one is queued
    # ahead of them the decodes run a step later.
    max_batches_in_flight: int | None = None

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
        if self.max_batches_in_flight is not None and self.max_batches_in_flight < 1:
            raise ValueError(f"EngineConfig.max_batches_in_flight must be >= 1, got "
                             f"{self.max_batches_in_flight}")
        if self.max_tokens_per_kvp_group is not None and self.max_tokens_per_kvp_group < 1:
            raise ValueError(f"EngineConfig.max_tokens_per_kvp_group must be >= 1 or None, got "
                             f"{self.max_tokens_per_kvp_group}")

    @property
    def total_pages(self) -> int:
        return self.num_pages or -(-self.max_kv_tokens // self.page_size)

    def tokens_per_kvp_group(self, max_model_len: int, kvp: int, cp: int = 1) -> int:
        """The tokens of one request a KV shard holds before the request spreads to the
        next: `max_tokens_per_kvp_group`, or by default the longest request spread evenly,
        ceil(L / kvp) rounded up to a page, where L is `max_model_len` (the model's and
        this config's) capped by the whole cache (kvp pools of `total_pages` pages).

        Why this default (seed 000 section 3.3 adds KVP groups "as the context grows";
        Figure 6 runs a 2M-token request at kvp = 4 from one group up to all four, 512K
        tokens each, i.e. L / kvp): kvp segments of it hold L, so no length the cache can
        serve is refused; it bounds the context one shard reads for one request at L / kvp,
        the bound on decode time progressive scaling exists for; and a request shorter than
        that stays on one shard, so the shards share short requests by load rather than
        each holding a sliver of every one. The whole pool (the default before) spread a
        request only after it filled one shard, so at kvp = 2 a request up to a shard's
        pool read all of it on one device while the other idled. When the cache, not the
        model, bounds L this is again one shard's pool: set max_model_len (or this field)
        lower to spread sooner. cp: an allocator page is cp pages of page_size tokens.
        """
        if self.max_tokens_per_kvp_group is not None:
            return self.max_tokens_per_kvp_group
        page = self.page_size * cp
        pool = self.total_pages * page
        if kvp == 1:       # nothing to spread over: one request may fill the pool, as before
            return pool
        longest = min(max_model_len, kvp * pool)
        return min(pool, -(-longest // (kvp * page)) * page)


@functools.partial(jax.jit, static_argnames=("graphdef", "shape", "num_kv_shards", "cp_ranks",
                                             "replicate_outputs"),
                   donate_argnames=("kv_cache",))
def step(graphdef, state, kv_cache: KVCache, ints, floats, rng_keys, *,
         shape: tuple[int, ...], num_kv_shards: int = 1, cp_ranks: int = 1,
         replicate_outputs: bool = False):
    """One engine step: forward, last-token logits per sequence, sampling, logprobs. Pure.

    ints: the packed int32 inputs of bucket `shape` = (T, S, W) (see StepInputs.pack);
    floats: float32 [2, S] temperature and top_p; rng_keys: uint32 [S, 2].
    Returns (StepOutputs: sampled token ids int32 [S] and the logprobs asked for, the
    updated cache). The cache is donated, so XLA writes the new K/V in place. Engines over
    the same model share jit's cache.
    replicate_outputs: every output whole on every device (a mesh over several processes,
    where process 0 can read only what its own devices hold: cp's prompt logprobs are
    split by token over the ranks otherwise).
    """
    x = unpack_int32(ints, shape, num_kv_shards, cp_ranks)
    meta = AttentionMetadata.of(x)
    module = nnx.merge(graphdef, state)
    hidden, kv_cache = module(x["token_ids"], x["positions"], kv_cache, meta)
    outputs = sample_with_logprobs(module.logits, hidden, x, floats, rng_keys,
                                   vocab_size=module.config.vocab_size)
    if replicate_outputs:
        outputs = jax.tree.map(
            lambda a: jax.lax.with_sharding_constraint(a, jax.sharding.PartitionSpec()), outputs)
    return outputs, kv_cache


@dataclasses.dataclass(frozen=True)
class PendingStep:
    """A dispatched step: its batch (in step order) and inputs, its outputs (device arrays,
    maybe not ready yet), when its host work started and how long building and dispatching
    it took."""

    batch: Batch
    inputs: StepInputs
    outputs: StepOutputs
    start: float
    dispatch_seconds: float


class Engine:
    """Implements medha_jax.request.PipelinedExecutor on a loaded Model.

    On an spp > 1 mesh the engine takes the model's weights: its stages hold each device's
    share and `model` keeps only config, layout and tokenizer (Model.release_weights), so
    no device holds more than its stage's weights and KV cache, even while the caller
    keeps the model.
    stage_hook: a test hook for spp > 1 (see medha_jax.engine.pipeline.StageHook).
    cp_variant: with cp ranks, cp_cost.PASS_KV or PASS_Q forces that ring variant on every
    step (tests, benchmarks); None lets the heuristic choose per step (Algorithm 5).
    """

    def __init__(self, model: Model, config: EngineConfig | None = None, *,
                 stage_hook: StageHook | None = None, cp_variant: str | None = None,
                 step_cache_dir=None):
        """step_cache_dir: where compiled steps are kept between runs, keyed without
        tracing them (medha_jax.engine.step_cache; a Server passes its cache's); None:
        every step is traced and compiled (JAX's own cache may still hold it)."""
        config = config or EngineConfig()
        self.step_cache_dir = step_cache_dir
        model.require_weights()
        if cp_variant not in (None, PASS_KV, PASS_Q):
            raise ValueError(f"{cp_variant=} must be None, {PASS_KV!r} or {PASS_Q!r}")
        self.model = model
        self.config = config
        self.num_kv_shards = num_kv_shards(model.layout)
        # cp: one pool of pages of cp * page_size tokens, one page on every rank (cp_layout).
        self.cp_ranks = num_cp_ranks(model.layout)
        # RingCost is per device: the peaks of the device the engine runs on, the heads
        # one device holds after tp.
        self.ring_cost = RingCost.create(
            model.config, hardware_for_device_kind(device_kind_of(model.mesh.devices.flat[0])),
            num_ranks=self.cp_ranks, tp=model.parallel.tp) if self.cp_ranks > 1 else None
        self.cp_variant = cp_variant
        # Steps run with each ring variant (cp only), counted at dispatch.
        self.cp_variant_counts: collections.Counter[str] = collections.Counter()
        kv_groups = self.num_kv_shards // self.cp_ranks
        model_len = min(config.max_model_len or model.config.max_position_embeddings,
                        model.config.max_position_embeddings)
        self.allocator = BlockAllocator(
            config.total_pages, config.page_size * self.cp_ranks, num_shards=kv_groups,
            max_tokens_per_shard=config.tokens_per_kvp_group(model_len, kv_groups, self.cp_ranks),
            enable_prefix_caching=config.enable_prefix_caching)
        self.max_model_len = min(config.max_model_len or model.config.max_position_embeddings,
                                 model.config.max_position_embeddings,
                                 self.allocator.max_tokens_per_request)
        # A page table holds one shard's pages of a sequence: at most a segment's, in the
        # allocator's pages (cp * page_size tokens with cp ranks).
        tokens_per_table = min(self.max_model_len, self.allocator.max_tokens_per_shard)
        self.ladder = BucketLadder.from_limits(
            max_tokens=config.max_tokens_per_step, min_tokens=config.min_token_bucket,
            max_seqs=config.max_seqs,
            max_pages_per_seq=self.allocator.pages_needed(tokens_per_table),
            cp_pages=config.total_pages if self.cp_ranks > 1 else None)
        self.max_seqs = config.max_seqs
        self.pad_slot = config.total_pages * config.page_size          # one past a shard's slots
        self.num_stages = num_stages(model.mesh)
        if self.num_stages > 1 and self.cp_ranks > 1:
            # The stage programs take the pipeline's step inputs, which do not carry cp's
            # per-rank token layout yet.
            raise ValueError(f"spp={self.num_stages} with cp={self.cp_ranks} is not supported "
                             f"yet: use spp or cp (each combines with tp and kvp)")
        self.max_in_flight = config.max_batches_in_flight or self.num_stages
        if self.num_stages == 1:
            self.pipeline = None
            self.kv_cache = self._new_kv_cache()
            # Its shapes and shardings, what compiles lower from (recovery keeps them).
            self._kv_cache_spec = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                self.kv_cache)
        else:
            # Each stage owns its layers' weights and cache; the engine holds no whole cache,
            # and the model lets go of its whole-mesh arrays (the embedding and head on
            # every stage): the stages share the buffers they need.
            stages = split_stages(model)
            model.release_weights(f"the pipeline stages of an spp={self.num_stages} Engine")
            self.pipeline = PipelinedStep(stages,
                                          num_pages=self.num_kv_shards * config.total_pages,
                                          page_size=config.page_size,
                                          num_kv_shards=self.num_kv_shards, hook=stage_hook)
            self.kv_cache = None
        self._replicated = replicated(model.mesh)
        # A multi-host replica's process 0 (serving.multihost.StepMirror): sends every
        # step's packed inputs to the other processes before running it, and bounds the
        # wait for its tokens. None: this process holds the whole mesh.
        self.mirror = None
        # (tokens, seqs, width) bucket -> its ahead-of-time compiled step (with spp > 1, the
        # stages' programs in stage order).
        self.executables: dict[tuple[int, int, int], jax.stages.Compiled | tuple] = {}
        # (features, measured seconds) of recent steps: what the profiled runtime
        # predictor is refitted to. Bounded, so a long-running server does not grow.
        self.step_records: collections.deque[tuple[BatchFeatures, float]] = collections.deque(
            maxlen=STEP_RECORDS_KEPT)
        self.warmup_seconds: float | None = None
        # Set by warmup(): from then on a shape missing from `executables` is an error
        # (unless a background warm-up has it still to compile: see `warmup`).
        self.warmed_up = False
        # Background warm-up (spp = 1): shapes still to compile, shapes being compiled
        # (-> set when done), the thread, and steps that waited for a compile of theirs.
        self._compile_lock = threading.Lock()
        self._backlog: list[tuple[int, int, int]] = []
        self._compiling: dict[tuple[int, int, int], threading.Event] = {}
        self._warmup_thread: threading.Thread | None = None
        self._stop_warmup = threading.Event()
        self.compiles_waited_for = 0
        # Executables read from step_cache, and what compiling them had taken.
        self.steps_loaded, self.step_seconds_saved = 0, 0.0
        # Host seconds on the critical path of the last collected step: while no step of
        # this engine was queued on the device (see dispatch and collect).
        self.last_host_seconds: float | None = None
        self._num_dispatched = 0                  # dispatched and not yet collected
        self._device_idle_since: float | None = time.perf_counter()
        self._idle_host_seconds = 0.0             # host time with the device idle, for the next step
        self._last_collect_end = 0.0

    # -- compilation -------------------------------------------------------------

    def step_args(self, inputs: StepInputs | tuple[np.ndarray, ...],
                  kv_cache: KVCache | None = None) -> tuple:
        """Positional arguments of `step` (graphdef first) with the inputs on the device.
        inputs: StepInputs, or what its `pack()` gave."""
        packed = inputs.pack() if isinstance(inputs, StepInputs) else inputs
        packed = put_replicated(packed, self._replicated)
        kv_cache = self.kv_cache if kv_cache is None else kv_cache
        return (self.model.graphdef, self.model.state, kv_cache, *packed)

    def _start(self, inputs: StepInputs) -> StepOutputs | None:
        """Starts the step on `inputs` (on a multi-host replica, the other processes'
        first); does not wait. Returns its outputs as device arrays, or None where the
        last SPP stage runs on other processes (collect receives them from there)."""
        shape, packed = inputs.padded_shape, inputs.pack()
        hop = None if self.pipeline is None else self.pipeline.hop
        if hop is None:
            if self.mirror is not None:       # the other processes start the same step
                self.mirror.send(shape, packed)
            return self.run_packed(shape, packed)
        # spp across processes: process 0's stages run here, and their activations go on
        # with the step to the processes of the later stages (serving.multihost).
        if self.mirror is None:
            raise RuntimeError(f"the stages after stage {hop.stage - 1} run on processes "
                               f"{list(hop.processes)}: process 0 needs the replica's step "
                               f"channel (Engine.mirror, serving.multihost.StepMirror)")
        hidden = self.run_packed(shape, packed)
        self.mirror.send(shape, packed, hidden=hidden, hop=hop, logprobs=inputs.logprobs_flags)
        return None

    def run_packed(self, shape: tuple[int, ...], packed: tuple[np.ndarray, ...],
                   hidden: np.ndarray | None = None) -> StepOutputs | jax.Array:
        """Starts the step of bucket `shape` on packed host inputs (`StepInputs.pack()`)
        and rebinds the KV cache to its output; does not wait. What `dispatch` runs, and
        what a follower process of a multi-host replica runs on the inputs process 0 sent
        it (serving.multihost). With spp, this process's stages (PipelinedStep.run: from
        `hidden`, the activations of the stage before, where that ran on another process;
        the last stage's outputs, or this process's last stage's activations)."""
        executable = self.executable(shape)
        if self.pipeline is not None:
            return self.pipeline.run(shape, packed, hidden)
        outputs, self.kv_cache = executable(*self.step_args(packed)[1:])
        return outputs

    def _compile(self, shape: tuple[int, int, int]) -> jax.stages.Compiled | tuple:
        """The one way a step shape is compiled: ahead of time, into `executables`.

        Lowered from abstract arguments (shapes and shardings), never the live KV cache,
        so a background warm-up may compile while steps donate and rebind that cache."""
        if self.pipeline is not None:
            executable = self.executables[shape] = self.pipeline.compile(shape)
            return executable
        inputs = StepInputs.padding(shape, self.pad_slot, self.num_kv_shards, self.cp_ranks)
        args = self.step_args(inputs, kv_cache=self._kv_cache_spec)
        replicate = not self._replicated.is_fully_addressable
        static = (args[0], shape, self.num_kv_shards, self.cp_ranks, replicate)
        devices = list(self.model.mesh.devices.flat)

        def compile_():
            with jax.set_mesh(self.model.mesh):
                return step.lower(*args, shape=shape, num_kv_shards=self.num_kv_shards,
                                  cp_ranks=self.cp_ranks, replicate_outputs=replicate).compile()

        executable, saved = step_cache.load_or_compile(
            step_cache.step_key(f"engine.step:{step_cache.code_digest(step)}", static,
                                args[1:], devices), compile_, devices,
            self.step_cache_dir)
        if saved is not None:
            self.steps_loaded += 1
            self.step_seconds_saved += saved
        self.executables[shape] = executable
        return executable

    def warmup(self, progress: bool = True, shapes=None, *, first=None) -> None:
        """Compiles every bucket shape (or just `shapes`) ahead of time. From then on a
        step of any other shape is an error: no request compiles later. Further calls
        may add shapes.

        first: a background warm-up (one program, spp = 1). Only these shapes are compiled
        before this returns; the rest compile on a background thread, smallest first. A
        step that needs one of those before the thread got to it compiles it then (or
        waits for the thread's compile of it): it is late, never wrong. Shapes outside
        the warm-up stay an error. `wait_for_warmup()` blocks until all are compiled;
        `warmup_seconds` is then the whole warm-up's time."""
        from tqdm.auto import tqdm

        shapes = [s for s in (shapes or self.ladder.all_shapes()) if s not in self.executables]
        if first is not None and self.pipeline is None:
            first = [s for s in first if s in shapes]
            self._backlog = sorted((s for s in shapes if s not in first), key=shape_size)
            shapes = first
        start = time.perf_counter()
        for shape in tqdm(shapes, desc="compiling step buckets", unit="exe", disable=not progress):
            self._compile(shape)
        self.warmed_up = True
        if self._backlog:
            self._stop_warmup.clear()
            self._warmup_thread = threading.Thread(
                target=self._compile_backlog, args=(start, progress),
                name="medha-warmup", daemon=True)
            self._warmup_thread.start()
            return
        self.warmup_seconds = time.perf_counter() - start
        if progress:
            print(f"warm-up: {len(self.executables)} executables compiled in "
                  f"{self.warmup_seconds:.1f} s")

    def _compile_backlog(self, start: float, progress: bool) -> None:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(self._backlog), desc="compiling step buckets (background)",
                   unit="exe", disable=not progress)
        while not self._stop_warmup.is_set():
            with self._compile_lock:
                if not self._backlog:
                    break
                shape = self._backlog.pop(0)
                done = self._compiling[shape] = threading.Event()
            try:
                self._compile(shape)
            finally:
                with self._compile_lock:
                    del self._compiling[shape]
                done.set()
            bar.update()
        bar.close()
        self.warmup_seconds = time.perf_counter() - start

    @property
    def warming_up(self) -> bool:
        """True while a background warm-up has shapes left to compile."""
        thread = self._warmup_thread
        return thread is not None and thread.is_alive()

    def wait_for_warmup(self, timeout: float | None = None) -> bool:
        """Blocks until a background warm-up is done; True when it is."""
        if self._warmup_thread is not None:
            self._warmup_thread.join(timeout)
        return not self.warming_up

    def stop_warmup(self) -> None:
        """Stops a background warm-up after its current compile (the engine is going away).
        Shapes it had not compiled are then compiled when a step first needs them."""
        self._stop_warmup.set()
        self.wait_for_warmup()

    def executable(self, shape: tuple[int, int, int]) -> jax.stages.Compiled:
        """The compiled step of bucket `shape` = (T, S, W).

        Before `warmup()` (tests, notebooks) a missing shape is compiled now, the same way
        warm-up would; after it, a missing shape is an error rather than a compile stall
        in the middle of serving, except one a background warm-up has yet to compile.
        """
        executable = self.executables.get(shape)
        if executable is not None:
            return executable
        with self._compile_lock:
            executable = self.executables.get(shape)
            compiling = self._compiling.get(shape)
            queued = shape in self._backlog
            if queued:                        # take it from the thread: compiled below
                self._backlog.remove(shape)
                compiling = None
                done = self._compiling[shape] = threading.Event()
        if executable is not None:
            return executable
        if compiling is not None:             # the background thread is compiling it
            self.compiles_waited_for += 1
            compiling.wait()
            return self.executables[shape]
        if queued:
            self.compiles_waited_for += 1
            try:
                return self._compile(shape)
            finally:
                with self._compile_lock:
                    del self._compiling[shape]
                done.set()
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

    @property
    def query_block_tokens(self) -> int:
        """Query tokens per block of the attention's prefill path (`prefill_query_block`:
        the kernels' prefill-sized blocks, not block_q, which is the decode path's): a
        prefill chunk's attention costs whole blocks, each one pass over the chunk's
        context, however few of the block's tokens are real. A chunk widened to it sits in
        a step of at least as many tokens, whose blocks are that size."""
        config = self.model.config
        impl, tiles = choose_attention(self.model.layout.attention_impl, None,
                                       head_dim=config.head_dim, page_size=self.config.page_size)
        tp = self.model.parallel.tp
        q_per_kv = max(1, config.num_heads // tp) // max(1, config.num_kv_heads // tp)
        return prefill_query_block(impl, tiles, q_per_kv=q_per_kv,
                                   num_tokens=self.ladder.token_buckets[-1])

    # -- execution ---------------------------------------------------------------

    def execute(self, batch: Batch) -> StepResult:
        return self.collect(self.dispatch(batch))

    def dispatch(self, batch: Batch) -> PendingStep:
        """Builds the step's inputs and starts it on the device (through every stage when
        spp > 1) without waiting for it. Steps run in dispatch order: each donates the
        cache the one before wrote."""
        start = time.perf_counter()
        # Decodes first: the attention kernels' decode path serves the leading one-token
        # sequences (StepInputs.num_decodes); tokens come back in this order.
        order, _ = order_decodes_first([chunk.num_tokens for chunk in batch.chunks])
        batch = Batch([batch.chunks[i] for i in order], batch.predicted_time_s)
        inputs = build_step_inputs(batch, self.allocator, self.ladder, pad_slot=self.pad_slot,
                                   cp_ranks=self.cp_ranks, ring_cost=self.ring_cost,
                                   cp_variant=self.cp_variant)
        if inputs.cp_pass_q is not None:
            self.cp_variant_counts[PASS_Q if inputs.cp_pass_q[0] else PASS_KV] += 1
        outputs = self._start(inputs)
        dispatched = time.perf_counter()
        if self._device_idle_since is not None:
            # Nothing of ours was queued on the device while the host built this step.
            self._idle_host_seconds += dispatched - max(self._device_idle_since, start)
            self._device_idle_since = None
        self._num_dispatched += 1
        return PendingStep(batch, inputs, outputs, start, dispatched - start)

    def is_ready(self, pending: PendingStep) -> bool:
        """Whether a dispatched step's tokens are computed (collect would not wait)."""
        if pending.outputs is None:                # computed on other processes
            return self.mirror.replied()
        return pending.outputs.tokens.is_ready()

    def collect(self, pending: PendingStep) -> StepResult:
        """Waits for a dispatched step (oldest first) and returns its sampled tokens.

        duration_s is the step's share of device time as the scheduler sees it: from its
        dispatch, or from the previous collect if that came later (then the step was
        queued behind it), to its tokens on the host. In a full pipeline that is one stage
        time; a lone step pays the whole pipeline.
        """
        batch = pending.batch
        # While the device runs, do this step's bookkeeping (asynchronous dispatch).
        features = batch_features(batch, self.ladder.token_buckets)
        if self.mirror is not None:           # waits, with a timeout, for every process
            returned = self.mirror.wait(None if pending.outputs is None
                                        else pending.outputs.tokens)
            if pending.outputs is None:       # the last stage's process sent them
                pending = dataclasses.replace(pending, outputs=returned)
        tokens = np.asarray(pending.outputs.tokens)       # waits for the device
        returned = time.perf_counter()
        sampled = {chunk.request.request_id: int(tokens[i])
                   for i, chunk in enumerate(batch.chunks) if chunk.samples}
        logprobs, prompt_logprobs = _read_logprobs(pending, tokens)
        end = time.perf_counter()
        self._num_dispatched -= 1
        seconds = end - max(pending.start, self._last_collect_end)
        self._last_collect_end = end
        # Host time on the critical path: what the host did while the device had none of
        # our steps queued (building and dispatching a step into an empty pipe), and
        # reading back the tokens. With a step already queued behind this one, the device
        # is busy while the host applies this result and forms the next.
        self.last_host_seconds = self._idle_host_seconds + (end - returned)
        self._idle_host_seconds = 0.0
        if self._num_dispatched == 0:
            self._device_idle_since = end
        self.step_records.append((features, seconds))
        return StepResult(sampled_token_ids=sampled, duration_s=seconds, logprobs=logprobs,
                          prompt_logprobs=prompt_logprobs)

    # -- recovery after a failed step ------------------------------------------------

    def recover_kv_cache(self) -> bool:
        """Called after a step raised: rebuilds the KV cache when that step lost it.

        The cache is donated to the step, so once a step was dispatched its input buffers
        are gone, and an error raised on the device (it surfaces only when the tokens are
        read back, after `kv_cache` was rebound to the step's outputs) leaves outputs that
        carry the error: every later step would fail on them. A failure on the host before
        the dispatch leaves the cache intact. Returns True when the cache was rebuilt
        (fresh zeroed buffers, same shapes and shardings): its contents are lost, so the
        caller must recompute every request from its tokens and drop the prefix cache
        (`ReplicaController.preempt_all`).
        """
        if self.mirror is not None and self.mirror.broken is not None:
            # A multi-host replica that lost a process: its cache is the output of a step
            # stuck in a collective (waiting on it would hang), and no step runs any more.
            return False
        caches = [self.kv_cache] if self.pipeline is None else self.pipeline.kv_caches
        leaves = jax.tree.leaves(caches)          # a stage on other processes has None
        try:
            if any(leaf.is_deleted() for leaf in leaves):
                raise RuntimeError("the KV cache was donated to a step that failed")
            jax.block_until_ready(leaves)          # raises when a step's error poisoned it
            return False
        except Exception:
            for leaf in leaves:                    # free the old buffers before the new ones
                if not leaf.is_deleted():
                    leaf.delete()
            if self.pipeline is None:
                self.kv_cache = self._new_kv_cache()
            else:
                self.pipeline.reset_kv_caches()
            # Steps still in flight read the lost cache: the caller drops them unapplied.
            self._num_dispatched = 0
            self._device_idle_since = time.perf_counter()
            self._idle_host_seconds = 0.0
            return True

    def _new_kv_cache(self) -> KVCache:
        """A zeroed cache of every KV shard's pages; out of memory says what was asked
        for and what fits."""
        pages, page_size = self.num_kv_shards * self.config.total_pages, self.config.page_size
        try:
            return self.model.new_kv_cache(pages, page_size)
        except Exception as e:
            if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
                raise
            raise MemoryError(kv_cache_oom_message(self.model, pages, page_size)) from e


def _read_logprobs(pending: PendingStep, tokens: np.ndarray
                   ) -> tuple[dict[str, TokenLogprobs], dict[str, dict[int, TokenLogprobs]]]:
    """The logprobs a step's requests asked for, read back from the device only when one
    did (StepInputs.logprobs_flags): a step without them moves nothing more than its tokens.
    Keyed by request id (the step's sequence order is the engine's, decodes first)."""
    want_sampled, want_prompt = pending.inputs.logprobs_flags.tolist()
    sampled, prompt = {}, {}
    if want_sampled:
        out = jax.tree.map(np.asarray, pending.outputs.sampled)
        for i, chunk in enumerate(pending.batch.chunks):
            k = chunk.request.sampling.logprobs
            if chunk.samples and k is not None:
                sampled[chunk.request.request_id] = _token_logprobs(out, i, int(tokens[i]), k)
    if want_prompt:
        out = jax.tree.map(np.asarray, pending.outputs.prompt)
        next_ids = pending.inputs.next_token_ids
        for i, chunk in enumerate(pending.batch.chunks):
            k = chunk.request.sampling.prompt_logprobs
            if k is None:
                continue
            rows = pending.inputs.rows_of(i)
            # Row j holds the token at position start + j, which scores position start + j + 1.
            scored = {chunk.start + j + 1: _token_logprobs(out, row, int(next_ids[row]), k)
                      for j, row in enumerate(rows.tolist()) if next_ids[row] >= 0}
            if scored:
                prompt[chunk.request.request_id] = scored
    return sampled, prompt


def _token_logprobs(out, row: int, token_id: int, k: int) -> TokenLogprobs:
    """Row `row` of read-back TopLogprobs arrays, its first k alternatives."""
    top = tuple(zip(out.top_ids[row, :k].tolist(), out.top_logprobs[row, :k].tolist()))
    return TokenLogprobs(token_id, float(out.logprob[row]), top)


def kv_cache_oom_message(model: Model, num_pages: int, page_size: int,
                         memory_stats: dict | None = None) -> str:
    """What a KV cache of `num_pages` pages asks of each device and how many pages fit
    (from `memory_stats`, by default the first device's; the CPU reports none)."""
    shape, sharding = model.kv_cache_sharding(num_pages, page_size)
    shard_shape = sharding.shard_shape(shape)
    itemsize = np.dtype(numpy_dtype(model.config.dtype)).itemsize
    per_device = 2 * itemsize * math.prod(shard_shape)             # K and V
    per_page = per_device / shard_shape[1]                         # [1]: pages on a device
    stats = memory_stats or model.mesh.devices.flat[0].memory_stats() or {}
    limit, in_use = stats.get("bytes_limit"), stats.get("bytes_in_use", 0)
    fits = ""
    if limit is not None:
        free = max(limit - in_use, 0)
        fits = (f"; the device has {free / 2**30:.2f} GiB free of {limit / 2**30:.2f} GiB, "
                f"room for about {int(free // per_page)} pages per device")
    return (f"out of memory allocating the KV cache: {num_pages} pages of {page_size} tokens "
            f"(shape {shape}, {model.config.dtype}) need {per_device / 2**30:.3f} GiB on each "
            f"device, {per_page / 2**20:.3f} MiB per page{fits}; lower "
            f"EngineConfig.max_kv_tokens or num_pages")
