"""Policy names -> configured ReplicaControllers.

    "fcfs-np"       FCFS, non-preemptive whole prefills (the convoy baseline)
    "sarathi-512"   FCFS, Sarathi-Serve static chunks: 512-token budget per batch
    "sarathi-2048"  FCFS, Sarathi-Serve static chunks: 2048-token budget per batch
    "edf"           EDF order, adaptive chunking, one prefill per batch
    "lrs"           LRS order, adaptive chunking, one prefill per batch
    "lars"          LARS order, adaptive chunking, one prefill per batch
    "lars-mp"       LARS + space sharing (Algorithm 2) + multi-prefill batching (Medha)

The EDF / LRS / LARS variants keep every other Medha mechanism, as the policy ablation
of seed 000 (section 6.4) does.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from medha_jax.config import ModelConfig
from medha_jax.request import SLO, Clock, Executor
from medha_jax.scheduler.controller import CapacityError, KVAllocator, ReplicaController
from medha_jax.scheduler.packer import AdaptivePacker, BatchPacker, EngineLimits, TokenBudgetPacker
from medha_jax.scheduler.policies import EDF, FCFS, LARS, LRS, Policy
from medha_jax.scheduler.prefill_time_cache import PrefillTimeCache
from medha_jax.scheduler.predictor import BatchFeatures, RuntimePredictor

__all__ = ["POLICY_NAMES", "CapacityError", "make_controller", "make_prefill_time_cache"]

POLICY_NAMES = ("fcfs-np", "sarathi-512", "sarathi-2048", "edf", "lrs", "lars", "lars-mp")

DEFAULT_TARGET_BATCH_TIME_S = 0.05
# The default budget is at least this many times the cost of the smallest step, so that a
# slow machine (a CPU) still spends most of each step on prefill work, not on fixed costs.
MIN_BUDGET_OVER_FIXED_COST = 4.0


def default_target_batch_time(predictor: RuntimePredictor, limits: EngineLimits) -> float:
    """50 ms, or 4x the predicted time of a one-token step where that is longer."""
    one_token = BatchFeatures().plus_chunk(1, 0, True, limits.token_buckets)
    return max(DEFAULT_TARGET_BATCH_TIME_S,
               MIN_BUDGET_OVER_FIXED_COST * predictor.predict_features(one_token))


def make_prefill_time_cache(predictor: RuntimePredictor, *, max_model_len: int,
                            limits: EngineLimits = EngineLimits(),
                            target_batch_time_s: float | None = None,
                            min_chunk_tokens: int = 16, prefill_cache_step: int = 1024
                            ) -> PrefillTimeCache:
    """Algorithm 3's table for this predictor and these limits (shareable across replicas)."""
    if target_batch_time_s is None:
        target_batch_time_s = default_target_batch_time(predictor, limits)
    return PrefillTimeCache(predictor, limits, max_len=max_model_len, t_target=target_batch_time_s,
                            min_chunk_tokens=min_chunk_tokens, step=prefill_cache_step)


def make_controller(policy: str, *, executor: Executor, allocator: KVAllocator, clock: Clock,
                    predictor: RuntimePredictor, model_config: ModelConfig,
                    eos_token_ids: Iterable[int] = (), max_model_len: int,
                    token_buckets: Sequence[int] | None = None,
                    max_tokens_per_batch: int | None = None,
                    max_seqs_per_batch: int = 256, default_slo: SLO | None = None,
                    target_batch_time_s: float | None = None,
                    min_chunk_tokens: int = 16, long_prefill_tokens: int = 8192,
                    rho_max: float = 0.4, max_prefill_candidates: int = 64,
                    prefill_cache_step: int = 1024,
                    prefill_time_cache: PrefillTimeCache | None = None) -> ReplicaController:
    """A controller running `policy` (one of POLICY_NAMES).

    default_slo: the SLO requests get when they name none; its TPOT caps the batch time
      budget even while no decode is running, so a request that starts decoding next
      iteration is not held up by a longer batch.
    target_batch_time_s: t_target when no SLO asks for less. Default: 50 ms (Medha's
      example is 20 ms for tight TPOTs; 50 ms trades a little decode latency for larger
      prefill chunks), or 4x the predicted one-token step where that is longer.
    prefill_time_cache: reuse one built by make_prefill_time_cache (same predictor and
      limits), e.g. across the replicas of a simulation.
    """
    if policy not in POLICY_NAMES:
        raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICY_NAMES)}")
    eos_token_ids = tuple(eos_token_ids)
    bad = [t for t in eos_token_ids if not 0 <= t < model_config.vocab_size]
    if bad:
        raise ValueError(f"eos_token_ids {bad} outside the vocabulary of {model_config.name} "
                         f"(vocab_size={model_config.vocab_size})")
    limits = EngineLimits(token_buckets=tuple(token_buckets) if token_buckets is not None else None,
                          max_tokens_per_batch=max_tokens_per_batch,
                          max_seqs_per_batch=max_seqs_per_batch)
    if target_batch_time_s is None:
        target_batch_time_s = default_target_batch_time(predictor, limits)
    if default_slo is not None:
        target_batch_time_s = min(target_batch_time_s, default_slo.tpot_s)
    if prefill_time_cache is None:
        prefill_time_cache = make_prefill_time_cache(
            predictor, max_model_len=max_model_len, limits=limits,
            target_batch_time_s=target_batch_time_s, min_chunk_tokens=min_chunk_tokens,
            prefill_cache_step=prefill_cache_step)
    remaining_work = prefill_time_cache.remaining_work

    order: Policy
    packer: BatchPacker
    if policy == "fcfs-np":
        order = FCFS()
        packer = TokenBudgetPacker(predictor, limits, token_budget=None, head_of_line_blocking=True)
    elif policy.startswith("sarathi-"):
        order = FCFS()
        packer = TokenBudgetPacker(predictor, limits, token_budget=int(policy.split("-")[1]))
    else:
        order = EDF() if policy == "edf" else \
            LRS(remaining_work) if policy == "lrs" else LARS(remaining_work)
        multi = policy == "lars-mp"
        packer = AdaptivePacker(predictor, limits, remaining_work=remaining_work,
                                target_batch_time_s=target_batch_time_s, multi_prefill=multi,
                                space_sharing=multi, rho_max=rho_max,
                                long_prefill_tokens=long_prefill_tokens,
                                min_chunk_tokens=min_chunk_tokens,
                                chunk_hint=prefill_time_cache.lone_chunk)
    controller = ReplicaController(
        policy=order, packer=packer, executor=executor, allocator=allocator, clock=clock,
        prefill_time_cache=prefill_time_cache, max_model_len=max_model_len,
        eos_token_ids=eos_token_ids, max_prefill_candidates=max_prefill_candidates, name=policy)
    return controller
