"""The Python serving API: a Server is a thin, thread-safe front over one model replica.

    with Server("smollm2-135m") as server:
        out = server.generate("Hello", SamplingParams(temperature=0, max_tokens=16))
        for delta in server.generate_stream("Tell me a story"):
            print(delta.text, end="")

Three parts, as vLLM v1's AsyncLLM splits input processing, the engine core and output
processing:
    serving.validation  argument checks and tokenization, on the caller's thread
    serving.loop        the loop thread: inbox, schedule -> engine.dispatch/collect -> update,
                        failure containment
    serving.outputs     detokenization, stream deltas, final outputs, request handles
The Server builds the engine, calibrates the runtime predictor, makes the controller, and
connects callers to the loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import itertools
import math
import secrets
import threading
import time
from typing import AsyncIterator, Iterator, Sequence

from medha_jax.request import SLO, Request, WallClock
from medha_jax.sampling_params import SamplingParams
from medha_jax.scheduler.config import SchedulerConfig
from serving import validation
from medha_jax.cluster.router import PREDICTED_TIME, RoutingConfig
from serving.gc_freeze import HeapFreeze
from serving.replicas import LocalReplica, ReplicaSet, replica_models
from serving.metrics import ServerMetrics
from serving.outputs import (IncrementalDetokenizer, RequestHandle, RequestOutput,
                             RequestStream, StreamDelta)
from serving.validation import Prompt, TokensPrompt

__all__ = ["Prompt", "Server", "StartupReport", "TokensPrompt"]


@dataclasses.dataclass(frozen=True)
class StartupReport:
    """What a Server's start took and what it found in its caches (see Server cache_dir).

    executables_loaded / executables_compiled_and_saved: steps read from the cache (the
    engine's step_cache, which skips tracing, and JAX's persistent-cache hits) and JAX's
    misses while warming up (compiles JAX judged too quick to be worth caching are in
    neither); ready_seconds: the constructor's time, loading the model included when it
    was given by name."""

    compilation_cache_dir: str | None
    executables_loaded: int
    executables_compiled_and_saved: int
    compile_seconds_saved: float
    predictor: str
    ready_seconds: float

    def summary(self) -> str:
        cache = ("compilation cache off" if self.compilation_cache_dir is None else
                 f"compilation cache {self.compilation_cache_dir}: "
                 f"{self.executables_loaded} executables loaded "
                 f"(~{self.compile_seconds_saved:.1f} s of compiling saved), "
                 f"{self.executables_compiled_and_saved} compiled and saved")
        return (f"ready in {self.ready_seconds:.1f} s; {cache}; "
                f"runtime predictor {self.predictor}")


class Server:
    """One model replica behind a thread-safe generate / stream / submit / cancel API."""

    prefill_pool = None      # the CDSP prefill pool (serving.prefill_pool), where one is set
    _heap_freeze = None      # this server's hold on the frozen heap (serving.gc_freeze)

    def __new__(cls, *args, cluster: str | None = None, **kwargs):
        # cluster= puts the replicas in Ray actors: the same API, served by RayServer.
        if cluster is not None and cls is Server:
            from serving.ray_cluster import RayServer
            return super().__new__(RayServer)
        return super().__new__(cls)

    def __init__(self, model="smollm2-135m", *, parallel=None,
                 scheduler: str | SchedulerConfig = "lars-mp", engine_config=None,
                 default_slo: SLO | None = None, dtype: str | None = None,
                 metrics_port: int | None = None, warmup: bool | str = "background",
                 predictor=None, cache_dir=None,
                 limits: validation.RequestLimits | None = None, replicas: int = 1,
                 router: str | RoutingConfig = PREDICTED_TIME, cluster: None = None,
                 roles=None, offload=None, disagg=None, switching=None,
                 prefill_pool=None, freeze_gc: bool = True):
        """model: a preset name, a Hugging Face directory, a .gguf file, a loaded Model, or
        an Engine to reuse (already compiled; then parallel, dtype and engine_config must
        be None). One engine serves one Server at a time.

        scheduler: a policy name (SchedulerConfig with that policy) or a SchedulerConfig,
          e.g. SchedulerConfig("lars", target_batch_time_s=0.5) on a CPU, where one step
          takes longer than the default target of 50 ms. Its token buckets and sequences
          per step come from the engine (the shapes it compiled).
        default_slo: the SLO of requests that name none (also settable in the config).
        limits: the SLOs and priorities a request may ask for (validation.RequestLimits;
          default: ttft_s in [0.1, 3600] s, tpot_s in [0.02, 60] s, priority in [-100, 100]).
          A request outside them is refused with ValueError. This Python API is the
          operator's own code, so it may use any priority in range; the network front ends
          let a client raise its priority above the default only with a priority token.
        warmup: "background" (default): the server is ready once a short request's step
          shapes are compiled (`BucketLadder.startup_shapes`); the others compile on a
          background thread, smallest first, and a step that needs one before then
          compiles it (Engine.warmup(first=...)). True:
          every shape before the constructor returns, so no request ever waits for a
          compile. False: none (an Engine given already warmed up).
        predictor: a fitted RuntimePredictor to use as is; by default the one saved for
          this (model, dtype, mesh, engine config, device) under cache_dir, else one derived
          from the analytical roofline at this device's peaks (medha_jax.engine.online_fit;
          no calibration sweep), and either is refined online from the steps served and
          saved there.
        cache_dir: where compiled executables (JAX's persistent compilation cache) and fitted
          predictors are kept between runs, so a second start is fast: a path, False for
          none, or None for $MEDHA_CACHE_DIR (MEDHA_CACHE_DIR=off: none), else
          ~/.cache/medha-jax. `startup` says what was loaded from it.
        replicas: how many replicas of the model this process serves, each an engine with
          its own KV pool, controller and loop thread on its own group of devices (groups of
          `parallel`'s size, in device order); the API is the same for any number.
          `parallel` may also be one ParallelConfig per replica, so replicas differ in shape
          (with roles, e.g. a prefill replica at tp=1 and a decode replica at tp=2 or kvp=2:
          serving.kv_copy says which pairs a hand-off takes).
        router: with several replicas, how a request picks one: a policy name
          (medha_jax.cluster.router.ROUTING_POLICIES; default "predicted-time") or a
          RoutingConfig. `output.metrics.replica` says which served a request.
        cluster: "ray" or a Ray address: each replica in a Ray actor of its own, on any
          host of that cluster (serving.ray_cluster.RayServer; its docstring says more).
        roles: with several replicas, what each does: "prefill:1,decode:1" (counts in
          replica order) or one of mixed / prefill / decode per replica (default: all
          mixed). offload: when a request's decode moves off the replica that prefilled
          it, a gate name or an OffloadConfig (medha_jax.cluster.offload; default "never"
          for mixed replicas). disagg: the hand-off's timeouts (serving.kv_transfer).
        switching: DP <-> TP switching inside this host (seed 004, serving.switching): a
          policy name ("load", "priority", "memory", "off") or a SwitchingConfig, with
          parallel=ParallelConfig(dp=N) (or dp=N, tp=b): N base replicas of one device (or
          of TP-b; engine_config describes one) that bind into TP groups of 2, 4, 8 of them
          and release, moving no weight and no KV page. Every group's shapes compile before the constructor returns
          (warmup="background" waits for them too), so no switch compiles. /metrics counts
          mode changes, requests per mode and switch latency.
        prefill_pool: a serving.prefill_pool.PrefillPoolConfig: a CDSP prefill pool (seed
          001, Tetris) on the devices after the replicas': prompts with a full KV page are
          prefilled there, on chunks over nested device groups, and decoded on the
          replicas, which take its pages (serving.prefill_pool says which requests and
          how). Its programs compile before the constructor returns with warmup=True, on a
          background thread with "background" (a plan that needs one first compiles it).
        freeze_gc: once ready, freeze the process's heap out of Python's cyclic garbage
          collector (`gc.freeze()`, again when background compiles end; the last Server of
          the process to close unfreezes): a full collection of the start-up heap stops
          every thread for 0.3-0.5 s on the CPU, and it would fall between steps
          (serving.gc_freeze). False: leave the collector as it is.
        """
        # Heavy imports here, so `import serving.server` (and medha_jax) stays cheap.
        from medha_jax.engine import Engine, EngineConfig
        from medha_jax.engine import cache_dirs
        from medha_jax.model import load_model

        started = time.perf_counter()
        config = SchedulerConfig.of(scheduler)       # a bad name fails before any loading
        self.cache_dir = cache_dirs.cache_root(cache_dir)
        xla_dir = cache_dirs.enable_compilation_cache(self.cache_dir)
        hits, misses, saved = cache_dirs.CACHE_EVENTS.snapshot()
        if default_slo is not None and not isinstance(default_slo, SLO):
            raise TypeError(f"default_slo must be an SLO, got {type(default_slo).__name__}")
        self.limits = validation.DEFAULT_LIMITS if limits is None else limits
        if not isinstance(self.limits, validation.RequestLimits):
            raise TypeError(f"limits must be a RequestLimits, got {type(limits).__name__}")
        for slo in (default_slo, config.default_slo):     # before any loading
            _check_default_slo(self.limits, slo)
        routing = RoutingConfig(router) if isinstance(router, str) else router
        if not isinstance(routing, RoutingConfig):
            raise TypeError(f"router must be a policy name or a RoutingConfig, got "
                            f"{type(router).__name__}")
        if prefill_pool is not None:                  # before any loading
            _check_prefill_pool(prefill_pool, switching=switching is not None,
                                roles=roles is not None, offload=offload is not None)
        if switching is not None:
            switching = _switching_config(switching, parallel, model, replicas, cluster,
                                          roles, offload, disagg)
            engines = [Engine(m, engine_config or EngineConfig(),
                              step_cache_dir=cache_dirs.steps_dir(self.cache_dir))
                       for m in replica_models(model, parallel.dp,
                                               parallel=dataclasses.replace(parallel, dp=1),
                                               dtype=dtype)]
        elif isinstance(model, Engine):
            given = {k: v for k, v in [("parallel", parallel), ("dtype", dtype),
                                       ("engine_config", engine_config)] if v is not None}
            if given:
                raise ValueError(f"{', '.join(given)} must be None when model is an Engine "
                                 "(it was built with its own)")
            if replicas != 1:
                raise ValueError(f"replicas={replicas} needs a model to load, not an Engine "
                                 "(one engine serves one replica)")
            engines = [model]
        else:
            engines = [Engine(m, engine_config or EngineConfig(),
                              step_cache_dir=cache_dirs.steps_dir(self.cache_dir))
                       for m in replica_models(model, replicas, parallel=parallel, dtype=dtype)]
        self.engine = engines[0]
        self.model = self.engine.model
        self.config = self.model.config
        self.tokenizer = self.model.tokenizer
        self.scheduler_config = scheduler_config_for_engine(config, self.engine, default_slo)
        self.policy = self.scheduler_config.policy
        self.default_slo = self.scheduler_config.default_slo
        _check_default_slo(self.limits, self.default_slo)
        if warmup not in ("background", True, False):
            raise ValueError(f"warmup must be 'background', True or False, got {warmup!r}")
        for engine in engines if switching is None else ():    # the coordinator's, below
            if warmup == "background":
                engine.warmup(first=engine.ladder.startup_shapes())
            elif warmup is True:
                engine.warmup()
        hits2, misses2, saved2 = cache_dirs.CACHE_EVENTS.snapshot()
        hits2 += sum(e.steps_loaded for e in engines)       # the step cache's
        saved2 += sum(e.step_seconds_saved for e in engines)
        self._clock = WallClock()
        self.metrics = ServerMetrics()
        eos = tuple(self.tokenizer.eos_token_ids) if self.tokenizer is not None else ()
        self._engines = engines
        if switching is not None:
            self.replicas = [_switching_replica(
                engines, switching, self.scheduler_config, predictor=predictor,
                cache_dir=self.cache_dir, clock=self._clock, metrics=self.metrics,
                eos_token_ids=eos, warmup=bool(warmup))]
        else:
            self.replicas = [
                LocalReplica(i, engine, self.scheduler_config, predictor=predictor,
                             cache_dir=self.cache_dir, clock=self._clock, metrics=self.metrics,
                             eos_token_ids=eos, routed=len(engines) > 1)
                for i, engine in enumerate(engines)]
        # The DP <-> TP switching coordinator (None unless switching=).
        self.switching = self.replicas[0].coordinator if switching is not None else None
        predictor_how = self.replicas[0].predictor_how
        self.startup = StartupReport(
            compilation_cache_dir=str(xla_dir) if xla_dir else None,
            executables_loaded=hits2 - hits, executables_compiled_and_saved=misses2 - misses,
            compile_seconds_saved=saved2 - saved, predictor=predictor_how,
            ready_seconds=time.perf_counter() - started)
        if warmup:
            print(self.startup.summary(), flush=True)
        self.controller = self.replicas[0].controller
        self._ids = itertools.count()
        self._groups: dict[str, RequestHandle] = {}    # handle.id -> handle, n > 1 in flight
        self._groups_lock = threading.Lock()
        # Random per server, so no caller can name another's request by guessing.
        self._id_prefix = f"req-{secrets.token_hex(4)}"
        self._loops = [replica.loop for replica in self.replicas]
        if isinstance(offload, str):
            from medha_jax.cluster.offload import OffloadConfig
            offload = OffloadConfig.parse(offload)
        if (roles is not None or offload is not None) and len(self.replicas) < 2:
            raise ValueError("roles and offload need replicas >= 2 (a hand-off goes from "
                             "one replica to another)")
        self._replica_set = (ReplicaSet(self.replicas, routing, metrics=self.metrics,
                                        roles=roles, offload=offload, disagg=disagg)
                             if len(self.replicas) > 1 else None)
        if warmup and self._replica_set is not None and self._replica_set.transfers is not None:
            self._replica_set.transfers.warmup()     # before any request: the loops are idle
        if prefill_pool is not None:
            try:
                self.prefill_pool = _prefill_pool(prefill_pool, engines, self.replicas,
                                                  metrics=self.metrics, warmup=warmup)
            except BaseException:
                for loop in self._loops:         # no server: its loop threads stop too
                    loop.close()
                raise
        self.metrics_port = (self.metrics.serve_http(metrics_port)
                             if metrics_port is not None else None)
        self._heap_freeze = HeapFreeze() if freeze_gc else None
        if self._heap_freeze is not None and any(e.warming_up for e in engines):
            threading.Thread(target=self._refreeze_after_warmup, name="medha-gc-refreeze",
                             daemon=True).start()

    def _refreeze_after_warmup(self) -> None:
        """The background compiles' programs join the frozen heap once the last is done."""
        for engine in self._engines:
            engine.wait_for_warmup()
        if not self.closed:
            self._heap_freeze.refreeze()

    # ------------------------------------------------------------------ public API

    @property
    def max_model_len(self) -> int:
        """Tokens one request may hold (prompt + output)."""
        if self.switching is not None:
            return self.switching.max_model_len
        return self.engine.max_model_len

    @property
    def num_total_pages(self) -> int:
        """KV pages over every replica."""
        return sum(e.allocator.num_pages for e in self._engines)

    @property
    def num_free_pages(self) -> int:
        return sum(e.allocator.num_free_pages for e in self._engines)

    @property
    def closed(self) -> bool:
        return self._loops[0].closing

    @property
    def unavailable(self) -> str | None:
        """Why this server cannot serve at all (None: it can): a multi-host replica that
        lost a process (serving.multihost). Such a server refuses new requests with
        RuntimeError (gRPC UNAVAILABLE, HTTP 503) and /health says so."""
        for engine in getattr(self, "_engines", ()):           # RayServer has none
            mirror = getattr(engine, "mirror", None)
            if mirror is not None and mirror.poll() is not None:
                return mirror.broken
        return None

    @property
    def router(self):
        """The router placing requests (None with one replica)."""
        return None if self._replica_set is None else self._replica_set.router

    def submit(self, prompt: Prompt, sampling_params: SamplingParams | None = None, *,
               slo: SLO | None = None, priority: int = 0, request_id: str | None = None,
               session_id: str | None = None,
               _loop: asyncio.AbstractEventLoop | None = None,
               _paced: bool = True,
               _kv_from: tuple[str, int] | None = None,
               _prefill_s: float | None = None) -> RequestHandle:
        """Queues one prompt (a str, token ids, a TokensPrompt or a 1-D numpy array) and
        returns at once. Raises ValueError or TypeError naming a bad field.
        request_id: the caller's label for the request, echoed in its deltas and output;
        labels may repeat. The server names the request itself (`RequestHandle.id`).
        session_id: the conversation it belongs to (OpenAI's `user`, `X-Session-Id`): with
        several replicas the router keeps a session where its prefix is cached unless
        another replica is predicted faster by a margin.

        With SamplingParams.n > 1 the prompt is sampled n times: n requests of the same
        arrival, SLO and priority, each with its own id and random stream (seed + i when
        the params are seeded). Sample 0 runs first; the others start once it has its first
        token and take its prompt's full KV pages from the prefix cache, so the prompt is
        prefilled once (only the tail after its last full page, at least its last token, is
        computed again per sample). With prefix caching off (EngineConfig) each sample
        prefills the whole prompt. Prompt logprobs come from sample 0.

        _paced=False (`generate`): with no slo given, the request has no per-token
        objective (the default SLO's TTFT, tpot_s = inf), since its caller reads only the
        whole output.

        _kv_from (a one-replica server: a Ray replica actor taking a KV hand-off,
        serving.ray_handoff): pages of its engine that hold the prompt's first tokens
        (`ReplicaController.add_request`). _prefill_s (a one-replica server: a Ray replica
        actor): the front's predicted prefill seconds of it, counted in the loop's queued
        prefills until its loop takes it in (ServingLoop.add)."""
        params = SamplingParams() if sampling_params is None else sampling_params
        try:
            if request_id is not None:
                validation.check_request_id(request_id)
            prompt_ids = validation.validate_request(
                prompt, params, slo, priority, tokenizer=self.tokenizer,
                vocab_size=self.config.vocab_size, model_name=self.config.name,
                check_fits=self.controller.check_fits, limits=self.limits)
            detokenizers = [IncrementalDetokenizer(self.tokenizer, params.stop)
                            for _ in range(params.n)]
        except (ValueError, TypeError):
            self.metrics.requests_rejected.inc()
            raise
        unavailable = self.unavailable
        if unavailable is not None:
            raise RuntimeError(unavailable)
        # The server names every request (unique, never reused); the caller's request_id
        # is only a label, so a reused label can never reach another request.
        server_ids = [f"{self._id_prefix}-{next(self._ids)}" for _ in range(params.n)]
        if request_id is None:
            request_id = server_ids[0]
        if session_id is not None and not isinstance(session_id, str):
            raise TypeError(f"session_id must be a str, got {type(session_id).__name__}")
        # With several replicas a request may move to another when its replica fails, so
        # its handle cancels it wherever it is.
        cancel = self._loops[0].cancel if self._replica_set is None and \
            self.prefill_pool is None else self._cancel_sample
        handle = RequestHandle(request_id, prompt_ids, cancel, loop=_loop,
                               id=server_ids[0], ids=server_ids)
        arrival = self._clock.now()
        if slo is None:
            slo = self.default_slo if _paced else dataclasses.replace(self.default_slo,
                                                                      tpot_s=math.inf)

        def streams_on(replica: int) -> tuple[RequestStream, list[RequestStream]]:
            streams = []
            for index, (server_id, detokenizer) in enumerate(zip(server_ids, detokenizers)):
                request = Request(request_id=server_id, prompt_len=len(prompt_ids),
                                  max_new_tokens=params.max_tokens, arrival_time=arrival,
                                  slo=slo, priority=priority,
                                  prompt_token_ids=prompt_ids,
                                  sampling=sample_params(params, index),
                                  session_id=session_id)
                streams.append(RequestStream(request, handle, detokenizer, index=index,
                                             replica=replica))
            return streams[0], streams[1:]

        if params.n > 1:
            # So that cancel(handle.id) reaches every sample, also after sample 0 finished.
            # Only groups in flight are kept: finished ones are dropped here.
            with self._groups_lock:
                for group_id in [g for g, h in self._groups.items() if h.finished]:
                    del self._groups[group_id]
                self._groups[handle.id] = handle
        if self.prefill_pool is not None and _kv_from is None and \
                self.prefill_pool.accepts(len(prompt_ids), params) and \
                self.prefill_pool.add(streams_on(0)[0]):
            pass                            # the pool hands it to a replica's loop
        elif self._replica_set is None:
            stream, held = streams_on(0)
            self._loops[0].add(stream, held=held, kv_from=_kv_from, prefill_s=_prefill_s)
        elif _kv_from is not None:
            raise ValueError("_kv_from is for a one-replica server")
        else:
            try:
                self._replica_set.submit(streams_on, prompt_ids, session_id, params.max_tokens,
                                         slo.ttft_s)
            except BaseException:
                with self._groups_lock:
                    self._groups.pop(handle.id, None)
                raise
        return handle

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 slo: SLO | None = None, priority: int = 0
                 ) -> RequestOutput | list[RequestOutput]:
        """Blocks until done. The return type follows the argument's type:
        a str, a TokensPrompt or a numpy array of token ids is one prompt -> one output;
        a list or tuple is a batch of prompts (each a str, a list of token ids, a
        TokensPrompt or an array) -> a list of outputs in order, all submitted before any
        waits, so they are batched. So `generate([1, 2, 3])` is a batch of three (and
        fails); one token-id prompt is `generate(TokensPrompt([1, 2, 3]))` or, as a batch
        of one, `generate([[1, 2, 3]])`.
        sampling_params: one for all, or (for a batch) a list with one per prompt.
        slo: None gives the requests the default SLO's TTFT and no TPOT objective: their
        tokens are not seen before the end, so while no other request on the replica has
        one the scheduler runs steps as large as the engine allows (throughput), not the
        TPOT-bounded steps a streamed request gets."""
        single = validation.is_single_prompt(prompts)
        batch = [prompts] if single else list(prompts)
        if not batch:
            raise ValueError("prompts is empty: pass a prompt (a str or a TokensPrompt) "
                             "or a non-empty list of prompts")
        if not single:
            for i, prompt in enumerate(batch):
                validation.check_batch_prompt(i, prompt)
        if isinstance(sampling_params, (list, tuple)):
            if single or len(sampling_params) != len(batch):
                raise ValueError(f"got {len(sampling_params)} sampling_params for "
                                 f"{len(batch)} prompts; pass one, or one per prompt")
            params = list(sampling_params)
        else:
            params = [sampling_params] * len(batch)
        handles = []
        try:
            for prompt, p in zip(batch, params):
                handles.append(self.submit(prompt, p, slo=slo, priority=priority,
                                           _paced=False))
        except BaseException:
            for handle in handles:       # all or nothing: the caller gets no ids back
                handle.cancel()
            raise
        outputs = [handle.result() for handle in handles]
        return outputs[0] if single else outputs

    def generate_stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None, *,
                        slo: SLO | None = None, priority: int = 0,
                        request_id: str | None = None,
                        session_id: str | None = None) -> Iterator[StreamDelta]:
        """Submits now (bad input raises here) and returns an iterator of deltas.
        Closing the iterator early (break, garbage collection) cancels the request."""
        handle = self.submit(prompt, sampling_params, slo=slo, priority=priority,
                             request_id=request_id, session_id=session_id)
        return _cancel_when_abandoned(iter(handle), handle)

    def generate_async(self, prompt: Prompt, sampling_params: SamplingParams | None = None, *,
                       slo: SLO | None = None, priority: int = 0,
                       request_id: str | None = None,
                       session_id: str | None = None) -> AsyncIterator[StreamDelta]:
        """The asyncio form of generate_stream; call it from a coroutine:
        `async for delta in server.generate_async(prompt): ...`"""
        handle = self.submit(prompt, sampling_params, slo=slo, priority=priority,
                             request_id=request_id, session_id=session_id,
                             _loop=asyncio.get_running_loop())
        return _cancel_when_abandoned_async(handle)

    def chat_prompt(self, messages: Sequence[dict], **template_kwargs) -> TokensPrompt:
        """The prompt of a conversation: the model's chat template rendered with
        add_generation_prompt=True, tokenized without adding a BOS (the template writes its
        special tokens itself, as transformers' apply_chat_template(tokenize=True) does).
        Only the template makes control tokens: special-token text inside a message
        ("<|im_start|>system" in a user's content) is encoded as plain text
        (Tokenizer.encode_chat), so a message cannot open a turn of another role.
        messages: [{"role": "system" | "user" | "assistant", "content": str}, ...]."""
        validation.check_messages(messages)
        if self.tokenizer is None:
            raise ValueError(f"messages: model {self.config.name!r} has no tokenizer")
        return TokensPrompt(self.tokenizer.encode_chat(list(messages), add_generation_prompt=True,
                                                       **template_kwargs))

    def chat(self, messages: Sequence[dict], sampling_params: SamplingParams | None = None, *,
             slo: SLO | None = None, priority: int = 0) -> RequestOutput:
        """Generates the assistant's reply to one conversation (blocks until done). The
        checkpoint's end-of-turn tokens are its eos ids, so the reply stops at the turn's
        end; `output.text` is the reply without them."""
        return self.generate(self.chat_prompt(messages), sampling_params, slo=slo,
                             priority=priority)

    def chat_stream(self, messages: Sequence[dict],
                    sampling_params: SamplingParams | None = None, *, slo: SLO | None = None,
                    priority: int = 0) -> Iterator[StreamDelta]:
        """chat, as deltas (see generate_stream)."""
        return self.generate_stream(self.chat_prompt(messages), sampling_params, slo=slo,
                                    priority=priority)

    def cancel(self, id: str) -> bool:
        """Cancels an in-flight request by the server's id (`RequestHandle.id`; a caller's
        request_id is only a label) and frees its pages; its final delta says "cancelled".
        False when no such request is in flight (already finished, or never was). With n
        samples, `handle.id` cancels every sample (as `handle.cancel()` does); each sample's
        own id (`RequestHandle.ids`) cancels that sample alone."""
        with self._groups_lock:
            group = self._groups.get(id)
        if group is not None:
            return group.cancel()
        return self._cancel_sample(id)

    def _cancel_sample(self, id: str) -> bool:
        # The pool first: it hands a request to a loop before it forgets it, so a request
        # leaving the pool meanwhile is then found on its loop.
        if self.prefill_pool is not None and self.prefill_pool.cancel(id):
            return True
        transfers = self._replica_set.transfers if self._replica_set is not None else None
        found = [loop.cancel(id) for loop in self._loops]     # a list: ask every one
        return any(found) or (transfers is not None and transfers.cancel(id))

    def metrics_text(self) -> str:
        return self.metrics.text()

    def close(self, *, drain: bool = False, timeout: float | None = None) -> None:
        """Stops the server: cancels in-flight requests (or, with drain=True, lets them
        finish), joins the loop thread and frees every KV page. Idempotent."""
        if self.prefill_pool is not None:         # first: its requests go on to the loops
            self.prefill_pool.close(drain=drain, timeout=timeout)
        for loop in self._loops:
            loop.close(drain=drain, timeout=timeout)
        if self._replica_set is not None and self._replica_set.transfers is not None:
            self._replica_set.transfers.close()
        self.metrics.close()
        for engine in self._engines:
            engine.stop_warmup()
        if self._heap_freeze is not None:
            self._heap_freeze.release()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# Server(...) may build a RayServer (`__new__`), but what it takes is __init__'s arguments:
# say so to inspect.signature (help(), IDEs, tests), which would otherwise read __new__'s.
Server.__signature__ = inspect.signature(Server.__init__).replace(
    parameters=list(inspect.signature(Server.__init__).parameters.values())[1:])


def sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """The params of sample `index` of a request: its own seed (seed + index; unseeded
    samples each draw a random one), and no prompt logprobs past sample 0, so that the
    other samples may take the prompt's pages from the prefix cache."""
    if index == 0:
        return params
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, seed=seed, prompt_logprobs=None)


def scheduler_config_for_engine(config: SchedulerConfig, engine,
                                default_slo: SLO | None) -> SchedulerConfig:
    """The config with what the engine fixes: its token buckets (the compiled shapes), at
    most its sequences per step, its attention's query block, the default SLO (SLO()
    when none is given), and on a CPU a budget of the default SLO's TPOT unless the config
    names a budget or a multiple of the one-token step (`scheduler/factory.py` says why)."""
    buckets = tuple(engine.ladder.token_buckets)
    if config.token_buckets is not None and config.token_buckets != buckets:
        raise ValueError(f"SchedulerConfig.token_buckets={config.token_buckets} differ from the "
                         f"engine's compiled token buckets {buckets}; leave them None")
    if default_slo is not None and config.default_slo is not None and \
            default_slo != config.default_slo:
        raise ValueError(f"default_slo={default_slo} and SchedulerConfig.default_slo="
                         f"{config.default_slo} disagree; give one")
    on_cpu = engine.model.mesh.devices.flat[0].platform == "cpu"
    slo = config.default_slo or default_slo or SLO()
    budget = config.target_batch_time_s
    if budget is None and config.budget_over_fixed_cost is None and on_cpu:
        budget = slo.tpot_s
    return dataclasses.replace(
        config, token_buckets=buckets,
        max_seqs_per_batch=min(config.max_seqs_per_batch, engine.max_seqs),
        query_block_tokens=engine.query_block_tokens, default_slo=slo,
        target_batch_time_s=budget)


def _switching_config(switching, parallel, model, replicas, cluster, roles, offload, disagg):
    """The SwitchingConfig of Server(switching=...), after checking what it combines with."""
    from medha_jax.engine import Engine
    from serving.switching import SwitchingConfig

    config = SwitchingConfig(switching) if isinstance(switching, str) else switching
    if not isinstance(config, SwitchingConfig):
        raise TypeError(f"switching must be a policy name or a SwitchingConfig, got "
                        f"{type(switching).__name__}")
    if parallel is None or parallel.dp < 2:
        raise ValueError("switching needs parallel=ParallelConfig(dp=N) with N >= 2 base "
                         "replicas to switch between")
    if parallel.num_devices != parallel.dp * parallel.tp:
        raise ValueError(f"switching's base replicas are one device or a TP group (spp = kvp "
                         f"= cp = 1: the TP groups it binds take their weights and pages as "
                         f"they lie); got {parallel}")
    others = {"replicas": replicas != 1, "cluster": cluster is not None,
              "roles": roles is not None, "offload": offload is not None,
              "disagg": disagg is not None, "an Engine as model": isinstance(model, Engine)}
    clash = [name for name, given in others.items() if given]
    if clash:
        raise ValueError(f"switching does not combine with {', '.join(clash)} (one host's "
                         f"dp base replicas switch among themselves)")
    return config


def _switching_replica(engines, config, scheduler_config, *, predictor, cache_dir, clock,
                       metrics, eos_token_ids, warmup: bool):
    from serving.replicas import starting_refit
    from serving.switching import SwitchingReplica

    how = "given"
    if predictor is None:
        refit, how = starting_refit(engines[0], cache_dir)
        predictor = refit.predictor
    return SwitchingReplica(engines, config, scheduler_config=scheduler_config,
                            predictor=predictor, predictor_how=how, clock=clock,
                            metrics=metrics, eos_token_ids=eos_token_ids, warmup=warmup)


def _check_prefill_pool(config, **given) -> None:
    """What Server(prefill_pool=...) takes and what it combines with."""
    from serving.prefill_pool import PrefillPoolConfig

    if not isinstance(config, PrefillPoolConfig):
        raise TypeError(f"prefill_pool must be a PrefillPoolConfig, got {type(config).__name__}")
    clash = [name for name, on in given.items() if on]
    if clash:
        raise ValueError(f"prefill_pool does not combine with {', '.join(clash)} (the pool is "
                         f"the prefill stage and the replicas decode)")


def _prefill_pool(config, engines, replicas, *, metrics, warmup: bool | str):
    """The PrefillPool of Server(prefill_pool=...), on the first devices no replica uses
    (the model's weights copied there)."""
    import jax

    from meshes import ParallelConfig, make_mesh
    from serving.prefill_pool import PrefillPool

    taken = {d for engine in engines for d in engine.model.mesh.devices.flat}
    free = [d for d in jax.devices() if d not in taken]
    if len(free) < config.devices:
        raise ValueError(f"prefill_pool needs {config.devices} devices besides the replicas' "
                         f"{len(taken)}; {len(free)} are left")
    model = engines[0].model.on_mesh(make_mesh(ParallelConfig(cp=config.devices),
                                               free[:config.devices]))
    return PrefillPool(model, config, replicas, metrics=metrics, warmup=warmup)


def _check_default_slo(limits: validation.RequestLimits, slo: SLO | None) -> None:
    if slo is not None:
        try:
            limits.check_slo(slo)
        except ValueError as e:
            raise ValueError(f"default_slo: {e} (Server limits=)") from None


def _cancel_when_abandoned(deltas: Iterator[StreamDelta], handle: RequestHandle
                           ) -> Iterator[StreamDelta]:
    try:
        yield from deltas
    finally:
        if not handle.finished:
            handle.cancel()


async def _cancel_when_abandoned_async(handle: RequestHandle) -> AsyncIterator[StreamDelta]:
    try:
        async for delta in handle:
            yield delta
    finally:
        if not handle.finished:
            handle.cancel()
