"""The scheduler: priority policies, batch packing, runtime prediction, the replica controller.

Plain Python over plain data (no JAX), so the same code drives the JAX engine, the
simulator and the tests. Start from `factory.make_controller(policy_name, ...)`.
"""

from medha_jax.scheduler.controller import CapacityError, ReplicaController
from medha_jax.scheduler.factory import POLICY_NAMES, make_controller, make_prefill_time_cache
from medha_jax.scheduler.hardware import HARDWARE_PRESETS, HardwareSpec, hardware_preset
from medha_jax.scheduler.packer import (AdaptivePacker, BatchPacker, EngineLimits, OpenGate,
                                        TokenBudgetPacker)
from medha_jax.scheduler.policies import EDF, FCFS, LARS, LRS, Policy, PriorityIndex
from medha_jax.scheduler.predictor import (AnalyticalPredictor, BatchFeatures, Efficiency,
                                           ProfiledPredictor, RuntimePredictor, batch_features)
from medha_jax.scheduler.prefill_time_cache import PrefillTimeCache

__all__ = [
    "AdaptivePacker", "AnalyticalPredictor", "BatchFeatures", "BatchPacker", "CapacityError",
    "EDF", "Efficiency", "EngineLimits", "FCFS", "HARDWARE_PRESETS", "HardwareSpec", "LARS", "LRS",
    "OpenGate", "POLICY_NAMES", "Policy", "PrefillTimeCache", "PriorityIndex", "ProfiledPredictor",
    "ReplicaController", "RuntimePredictor", "TokenBudgetPacker", "batch_features",
    "hardware_preset", "make_controller", "make_prefill_time_cache",
]
