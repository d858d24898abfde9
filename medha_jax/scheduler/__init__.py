"""The scheduler: priority policies, batch packing, runtime prediction, the replica controller.

Plain Python over plain data (no JAX), so the same code drives the JAX engine, the
simulator and the tests. Start from `make_controller(SchedulerConfig(policy_name, ...), ...)`;
whoever executes batches calls the controller's `schedule()` and `update()`
(or `run_one_step`).
"""

from medha_jax.scheduler.config import POLICY_NAMES, SchedulerConfig
from medha_jax.scheduler.controller import CapacityError, ReplicaController, run_one_step
from medha_jax.scheduler.factory import make_controller, make_prefill_time_cache
from medha_jax.scheduler.hardware import HARDWARE_PRESETS, HardwareSpec, hardware_preset
from medha_jax.scheduler.kv_reservations import KVReservations
from medha_jax.scheduler.packer import (AdaptivePacker, BatchPacker, EngineLimits, OpenGate,
                                        TokenBudgetPacker)
from medha_jax.scheduler.policies import EDF, FCFS, LARS, LRS, Policy, PriorityIndex
from medha_jax.scheduler.predictor import (AnalyticalPredictor, BatchFeatures, Efficiency,
                                           ProfiledPredictor, RuntimePredictor, batch_features)
from medha_jax.scheduler.prefill_time_cache import PrefillTimeCache

__all__ = [
    "AdaptivePacker", "AnalyticalPredictor", "BatchFeatures", "BatchPacker", "CapacityError",
    "EDF", "Efficiency", "EngineLimits", "FCFS", "HARDWARE_PRESETS", "HardwareSpec",
    "KVReservations", "LARS", "LRS", "OpenGate", "POLICY_NAMES", "Policy", "PrefillTimeCache",
    "PriorityIndex", "ProfiledPredictor", "ReplicaController", "RuntimePredictor",
    "SchedulerConfig", "TokenBudgetPacker", "batch_features", "hardware_preset", "make_controller",
    "make_prefill_time_cache", "run_one_step",
]
