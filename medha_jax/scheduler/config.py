"""SchedulerConfig: every knob of a replica's scheduler in one frozen, self-checking value.

    SchedulerConfig("lars-mp", target_batch_time_s=0.02, token_buckets=(64, 128, 256))

Policies:
    "fcfs-np"       FCFS, non-preemptive whole prefills (the convoy baseline)
    "sarathi-512"   FCFS, Sarathi-Serve static chunks: 512-token budget per batch
    "sarathi-2048"  FCFS, Sarathi-Serve static chunks: 2048-token budget per batch
    "fcfs"          FCFS order, adaptive chunking, one prefill per batch
    "edf"           EDF order, adaptive chunking, one prefill per batch
    "lrs"           LRS order, adaptive chunking, one prefill per batch
    "lars"          LARS order, adaptive chunking, one prefill per batch
    "lars-mp"       LARS + space sharing (Algorithm 2) + multi-prefill batching: the full
                    Medha scheduler, and the default

The FCFS / EDF / LRS / LARS variants keep every other Medha mechanism (adaptive chunking
under the time budget), as the policy ablation of seed 000 (section 6.4, figure 13) does.
"""

from __future__ import annotations

import dataclasses

from medha_jax.request import SLO
from medha_jax.scheduler.packer import EngineLimits

POLICY_NAMES = ("fcfs-np", "sarathi-512", "sarathi-2048", "fcfs", "edf", "lrs", "lars",
                "lars-mp")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """How one replica schedules. Only `policy` may be given by position.

    policy:                 one of POLICY_NAMES.
    target_batch_time_s:    t_target when no SLO asks for less. None: 50 ms (Medha's example
                            is 20 ms for tight TPOTs; 50 ms trades a little decode latency
                            for larger prefill chunks), or budget_over_fixed_cost times
                            the predicted one-token step where that is longer (a CPU).
    budget_over_fixed_cost: that multiple. None: 8. (A server's engine on a CPU gets the
                            default SLO's TPOT as its budget when neither is given,
                            `scheduler_config_for_engine`; factory.py says why.)
    rho_max:                space sharing: the most of the budget a long prefill yields.
    min_chunk_tokens:       progress guarantee: the chunk the most urgent prefill gets when
                            nothing fits the budget.
    long_prefill_tokens:    IsLong of Algorithm 2 (seed 000, sec. 6.5: 8192).
    max_prefill_candidates: how many of the most urgent prefills the packer looks at per
                            iteration: a batch never holds more than a few, and ordering only
                            the top keeps a step cheap at 10,000 queued requests.
    max_rider_candidates:   lars-mp only: how many more prefills, those of least remaining
                            work beyond the max_prefill_candidates, the packer may also run
                            beside a long prefill (space sharing). In a burst a newly arrived
                            short request has a high relative slack and ranks below the
                            candidates; without these it would wait for its deadline.
    prefill_cache_step:     Algorithm 3's table resolution, in tokens.
    token_buckets:          the engine's padded token counts (None: no padding).
    max_tokens_per_batch:   tokens per step (None: the largest bucket, or no limit).
    max_seqs_per_batch:     sequences per step.
    query_block_tokens:     the engine's attention query block (`EngineLimits`); 1 = none.
    default_slo:            the SLO of requests that name none; its TPOT also caps the batch
                            time budget while no decode is running, so a request that starts
                            decoding next iteration is not held up by a longer batch.
    prefill_hold_s:         the adaptive policies: how long a newly arrived request's prefill
                            stays out of steps that carry decodes (`AdaptivePacker.held_back`);
                            0: never.
    """

    policy: str = "lars-mp"
    _: dataclasses.KW_ONLY
    target_batch_time_s: float | None = None
    budget_over_fixed_cost: float | None = None
    rho_max: float = 0.4
    min_chunk_tokens: int = 16
    long_prefill_tokens: int = 8192
    max_prefill_candidates: int = 64
    max_rider_candidates: int = 16
    prefill_cache_step: int = 1024
    token_buckets: tuple[int, ...] | None = None
    max_tokens_per_batch: int | None = None
    max_seqs_per_batch: int = 256
    query_block_tokens: int = 1
    default_slo: SLO | None = None
    prefill_hold_s: float = 0.0

    def __post_init__(self):
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"unknown policy {self.policy!r}; known: {', '.join(POLICY_NAMES)}")
        if self.budget_over_fixed_cost is not None and not self.budget_over_fixed_cost > 0:
            raise ValueError(f"budget_over_fixed_cost must be > 0 or None, "
                             f"got {self.budget_over_fixed_cost!r}")
        if self.target_batch_time_s is not None and not self.target_batch_time_s > 0:
            raise ValueError(f"target_batch_time_s must be > 0 or None, "
                             f"got {self.target_batch_time_s!r}")
        if not (isinstance(self.prefill_hold_s, (int, float)) and 0 <= self.prefill_hold_s
                < float("inf")):
            raise ValueError(f"prefill_hold_s must be a finite number >= 0, "
                             f"got {self.prefill_hold_s!r}")
        if not 0 <= self.rho_max < 1:
            raise ValueError(f"rho_max must be in [0, 1), got {self.rho_max!r}")
        for name, least in (("min_chunk_tokens", 1), ("long_prefill_tokens", 1),
                            ("max_prefill_candidates", 1), ("max_rider_candidates", 0),
                            ("prefill_cache_step", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
        if self.default_slo is not None and not isinstance(self.default_slo, SLO):
            raise TypeError(f"default_slo must be an SLO or None, "
                            f"got {type(self.default_slo).__name__}")
        if self.token_buckets is not None:
            object.__setattr__(self, "token_buckets", tuple(self.token_buckets))
        self.limits  # EngineLimits checks the buckets and the per-step limits

    @property
    def limits(self) -> EngineLimits:
        """What one engine step holds, as the packers see it."""
        return EngineLimits(token_buckets=self.token_buckets,
                            max_tokens_per_batch=self.max_tokens_per_batch,
                            max_seqs_per_batch=self.max_seqs_per_batch,
                            query_block_tokens=self.query_block_tokens)

    @classmethod
    def of(cls, scheduler: str | SchedulerConfig) -> SchedulerConfig:
        """A config from a policy name (every other field at its default) or a config."""
        if isinstance(scheduler, SchedulerConfig):
            return scheduler
        if isinstance(scheduler, str):
            return cls(scheduler)
        raise TypeError(f"scheduler must be a policy name or a SchedulerConfig, "
                        f"got {type(scheduler).__name__}")
