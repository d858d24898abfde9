"""SchedulerConfig -> a configured ReplicaController (the policies are listed in config.py)."""

from __future__ import annotations

from collections.abc import Iterable

from medha_jax.config import ModelConfig
from medha_jax.request import Clock
from medha_jax.scheduler.config import POLICY_NAMES, SchedulerConfig
from medha_jax.scheduler.controller import CapacityError, ReplicaController
from medha_jax.scheduler.kv_reservations import KVAllocator
from medha_jax.scheduler.packer import AdaptivePacker, BatchPacker, EngineLimits, TokenBudgetPacker
from medha_jax.scheduler.policies import EDF, FCFS, LARS, LRS, Policy
from medha_jax.scheduler.prefill_time_cache import PrefillTimeCache
from medha_jax.scheduler.predictor import BatchFeatures, RuntimePredictor

__all__ = ["POLICY_NAMES", "CapacityError", "SchedulerConfig", "make_controller",
           "make_prefill_time_cache"]

DEFAULT_TARGET_BATCH_TIME_S = 0.05
# The default budget is at least this many times the cost of a one-token step, so that a
# slow machine (a CPU) still spends most of each step on prefill work, not on fixed costs.
# 8, not 4: on a CPU a step's cost per token keeps falling well past 8x its fixed cost
# (SmolLM2 on 2 cores: 1 token ~55 ms, a 64-token chunk ~160 ms, 512 tokens ~510 ms), and
# 4 was set while the smallest step held 16 tokens (its time ~1.7x a one-token step's).
# With one-token steps, 4 halved the prefill chunks (128 -> 64 tokens): in the online
# workload of benchmarks/peers.py (an in-process replay, alternating) 8 against 4 gave
# TTFT p99 1.80 / 2.08 s against 2.82 / 2.81 s, and TPOT p99 99 / 107 ms against 115 / 122.
MIN_BUDGET_OVER_FIXED_COST = 8.0
# On a CPU the server's default budget is the default SLO's TPOT itself (0.5 s), the bound
# Algorithm 1 derives t_target from, not a multiple of the one-token step
# (`scheduler_config_for_engine`). Each step's fixed cost there (reading every weight
# once) is paid per step, so fewer, larger steps cost the decodes beside them less in all,
# and a multiple drifts with the kernels: 16x a ~30 ms one-token step was ~0.5 s when it
# was set (against 8x, ~240 ms, alternating pairs of `benchmarks.peers --skip offline`:
# TTFT p50 / p99 0.84 / 1.99 and 0.84 / 1.79 s against 1.06 / 2.57 and 1.09 / 2.97 s,
# TPOT p50 / p99 30.7 / 83 and 29.5 / 81 ms against 31.6 / 97 and 32.7 / 95 ms); once
# the native CPU kernels brought that step to ~13 ms, 16x was ~0.21 s and every prefill
# ran in 128-token chunks: TTFT p99 1.593 and 1.608 s against 1.511 s at 0.5 s, TPOT p50
# 27.9 and 28.7 against 28.5 ms (2026-12-04, README). Not elsewhere: unmeasured on an
# accelerator, where it would also make short prompts one chunk and so leave a streamed KV
# hand-off nothing to hide behind (tests/test_simulator).


def default_target_batch_time(predictor: RuntimePredictor, limits: EngineLimits,
                              over_fixed_cost: float = MIN_BUDGET_OVER_FIXED_COST) -> float:
    """50 ms, or `over_fixed_cost` times the predicted time of a one-token step where that
    is longer."""
    one_token = BatchFeatures().plus_chunk(1, 0, True, limits.token_buckets)
    return max(DEFAULT_TARGET_BATCH_TIME_S,
               over_fixed_cost * predictor.predict_features(one_token))


def target_batch_time(config: SchedulerConfig, predictor: RuntimePredictor) -> float:
    """t_target: the config's (or the default for this predictor), capped by the default
    SLO's TPOT."""
    t_target = config.target_batch_time_s
    if t_target is None:
        t_target = default_target_batch_time(
            predictor, config.limits,
            config.budget_over_fixed_cost or MIN_BUDGET_OVER_FIXED_COST)
    if config.default_slo is not None:
        t_target = min(t_target, config.default_slo.tpot_s)
    return t_target


def make_prefill_time_cache(predictor: RuntimePredictor,
                            config: SchedulerConfig = SchedulerConfig(), *,
                            max_model_len: int) -> PrefillTimeCache:
    """Algorithm 3's table for this predictor and config (shareable across replicas and
    across configs that differ only in policy)."""
    return PrefillTimeCache(predictor, config.limits, max_len=max_model_len,
                            t_target=target_batch_time(config, predictor),
                            min_chunk_tokens=config.min_chunk_tokens,
                            step=config.prefill_cache_step)


def make_controller(config: SchedulerConfig, *, allocator: KVAllocator, clock: Clock,
                    predictor: RuntimePredictor, model_config: ModelConfig,
                    eos_token_ids: Iterable[int] = (), max_model_len: int,
                    prefill_time_cache: PrefillTimeCache | None = None,
                    pipeline_stages: int = 1) -> ReplicaController:
    """A controller scheduling as `config` says.

    prefill_time_cache: reuse one built by make_prefill_time_cache (same predictor and
      limits), e.g. across the replicas of a simulation.
    pipeline_stages: the executor's spp (a decode's TPOT spans that many batches).
    """
    if not isinstance(config, SchedulerConfig):
        raise TypeError(f"config must be a SchedulerConfig, got {type(config).__name__} "
                        f"(SchedulerConfig({config!r}) makes one from a policy name)")
    eos_token_ids = tuple(eos_token_ids)
    bad = [t for t in eos_token_ids if not 0 <= t < model_config.vocab_size]
    if bad:
        raise ValueError(f"eos_token_ids {bad} outside the vocabulary of {model_config.name} "
                         f"(vocab_size={model_config.vocab_size})")
    limits = config.limits
    t_target = target_batch_time(config, predictor)
    if prefill_time_cache is None:
        prefill_time_cache = make_prefill_time_cache(predictor, config, max_model_len=max_model_len)
    remaining_work = prefill_time_cache.remaining_work

    policy = config.policy
    order: Policy
    packer: BatchPacker
    if policy == "fcfs-np":
        order = FCFS()
        packer = TokenBudgetPacker(predictor, limits, token_budget=None, head_of_line_blocking=True)
    elif policy.startswith("sarathi-"):
        order = FCFS()
        packer = TokenBudgetPacker(predictor, limits, token_budget=int(policy.split("-")[1]))
    else:
        order = (FCFS() if policy == "fcfs" else EDF() if policy == "edf" else
                 LRS(remaining_work) if policy == "lrs" else
                 LARS(remaining_work))
        multi = policy == "lars-mp"
        packer = AdaptivePacker(predictor, limits, remaining_work=remaining_work,
                                target_batch_time_s=t_target, multi_prefill=multi,
                                space_sharing=multi, rho_max=config.rho_max,
                                long_prefill_tokens=config.long_prefill_tokens,
                                min_chunk_tokens=config.min_chunk_tokens,
                                chunk_hint=prefill_time_cache.lone_chunk,
                                pipeline_stages=pipeline_stages,
                                prefill_hold_s=config.prefill_hold_s)
    return ReplicaController(
        policy=order, packer=packer, allocator=allocator, clock=clock,
        prefill_time_cache=prefill_time_cache, max_model_len=max_model_len,
        eos_token_ids=eos_token_ids, max_prefill_candidates=config.max_prefill_candidates,
        max_rider_candidates=config.max_rider_candidates if policy == "lars-mp" else 0,
        name=policy)
