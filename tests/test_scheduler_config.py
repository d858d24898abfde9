"""SchedulerConfig: one frozen value for every scheduler knob, checked when it is made."""

import dataclasses
import inspect

import pytest

from medha_jax.config import ParallelConfig, model_preset
from medha_jax.request import SLO, VirtualClock
from medha_jax.scheduler import (POLICY_NAMES, AnalyticalPredictor, SchedulerConfig,
                                 make_controller)
from medha_jax.simulator import CountingAllocator


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(policy="sjf"), ValueError, "unknown policy 'sjf'; known: fcfs-np"),
    (dict(target_batch_time_s=0.0), ValueError, "target_batch_time_s must be > 0"),
    (dict(budget_over_fixed_cost=-1.0), ValueError, "budget_over_fixed_cost must be > 0"),
    (dict(rho_max=1.0), ValueError, r"rho_max must be in \[0, 1\)"),
    (dict(min_chunk_tokens=0), ValueError, "min_chunk_tokens must be an int >= 1, got 0"),
    (dict(max_prefill_candidates=2.5), ValueError, "max_prefill_candidates must be an int"),
    (dict(max_rider_candidates=-1), ValueError, "max_rider_candidates must be an int >= 0"),
    (dict(token_buckets=(64, 32)), ValueError, "token_buckets must be strictly increasing"),
    (dict(token_buckets=(16, 32), max_tokens_per_batch=64), ValueError,
     "max_tokens_per_batch=64 exceeds the largest token bucket 32"),
    (dict(max_seqs_per_batch=0), ValueError, "max_seqs_per_batch must be an int >= 1"),
    (dict(default_slo=0.1), TypeError, "default_slo must be an SLO"),
    (dict(prefill_hold_s=-0.5), ValueError, "prefill_hold_s must be a finite number >= 0"),
    (dict(prefill_hold_s=float("inf")), ValueError, "prefill_hold_s must be a finite number"),
])
def test_bad_fields_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        SchedulerConfig(**kwargs)


def test_defaults_names_and_limits():
    config = SchedulerConfig("lars-mp", token_buckets=[16, 32, 64])
    assert config.token_buckets == (16, 32, 64)            # a list becomes a tuple: hashable
    assert config.limits.max_tokens_per_batch == 64
    assert SchedulerConfig.of("edf") == SchedulerConfig(policy="edf")
    assert SchedulerConfig.of(config) is config
    with pytest.raises(TypeError, match="scheduler must be a policy name or a SchedulerConfig"):
        SchedulerConfig.of(3)
    with pytest.raises(TypeError):
        SchedulerConfig("lars", 0.05)                     # only the policy is positional
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.policy = "edf"
    assert set(POLICY_NAMES) >= {"lars", "lars-mp", "fcfs-np"}


def test_the_full_medha_scheduler_is_the_default_everywhere():
    # Issue 18: lars-mp for the config, the Server and the CLI; the others are baselines.
    from serving import cli
    from serving.server import Server

    assert SchedulerConfig().policy == "lars-mp"
    assert inspect.signature(Server).parameters["scheduler"].default == "lars-mp"
    for command in ("serve", "generate"):
        args = cli.build_parser().parse_args([command] + (["hi"] if command == "generate" else []))
        assert args.policy == "lars-mp"


def test_make_controller_follows_the_config():
    model = model_preset("tiny")
    predictor = AnalyticalPredictor(model, ParallelConfig(), "a100")
    clock = VirtualClock()

    def make(config):
        return make_controller(config, allocator=CountingAllocator(64, 16), clock=clock,
                               predictor=predictor, model_config=model, max_model_len=512)

    controller = make(SchedulerConfig("lars-mp", target_batch_time_s=0.2, rho_max=0.25,
                                      max_seqs_per_batch=4, default_slo=SLO(tpot_s=0.1)))
    assert controller.name == "lars-mp"
    assert controller.packer.rho_max == 0.25 and controller.packer.multi_prefill
    assert controller.packer.target_batch_time_s == 0.1      # the default SLO's TPOT caps it
    assert controller.packer.limits.max_seqs_per_batch == 4
    assert controller.prefill_time_cache.t_target == 0.1
    assert controller.packer.prefill_hold_s == 0.0
    assert make(SchedulerConfig("lars", prefill_hold_s=0.75)).packer.prefill_hold_s == 0.75
    # Riders beyond the LARS candidates only where there is space sharing.
    assert controller.max_rider_candidates == SchedulerConfig().max_rider_candidates > 0
    assert make(SchedulerConfig("lars")).max_rider_candidates == 0
    with pytest.raises(TypeError, match=r"SchedulerConfig\('lars'\) makes one"):
        make("lars")
