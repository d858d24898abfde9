"""Multi-host start-up: one JAX process per host, joined before any mesh is built."""

from __future__ import annotations

import os

import jax


def initialize_distributed(coordinator_address: str | None = None,
                           num_processes: int | None = None,
                           process_id: int | None = None, *,
                           heartbeat_timeout_s: int | None = None,
                           init_timeout_s: int = 300) -> bool:
    """Joins this process to a multi-host JAX job; returns whether it did.

    On TPU pods and SLURM/GPU clusters `jax.distributed.initialize()` finds its peers from
    the environment, so every argument may be None there. Elsewhere the coordinator is
    taken from the arguments or MEDHA_COORDINATOR / MEDHA_NUM_PROCESSES / MEDHA_PROCESS_ID.
    A single process with nothing configured stays single-host and returns False.

    On the CPU, collectives across processes go over gloo (without it XLA:CPU has none).
    Recoverability is on: without it the coordination service aborts every process once
    one stops sending heartbeats (for `heartbeat_timeout_s`), where a serving replica's
    process 0 should stay up and report the replica unavailable (serving.multihost).
    """
    coordinator_address = coordinator_address or os.environ.get("MEDHA_COORDINATOR")
    if num_processes is None and "MEDHA_NUM_PROCESSES" in os.environ:
        num_processes = int(os.environ["MEDHA_NUM_PROCESSES"])
    if process_id is None and "MEDHA_PROCESS_ID" in os.environ:
        process_id = int(os.environ["MEDHA_PROCESS_ID"])
    if coordinator_address is None and not cluster_detected():
        return False
    if coordinator_address is not None and (num_processes is None or process_id is None):
        raise ValueError(
            f"coordinator {coordinator_address!r} given but {num_processes=} {process_id=}: "
            "a multi-host job needs the process count and this process's id")
    if os.environ.get("JAX_PLATFORMS", "").split(",")[0] in ("", "cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_enable_recoverability", True)
    timeouts = {} if heartbeat_timeout_s is None else {
        "heartbeat_timeout_seconds": heartbeat_timeout_s}
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id,
                               initialization_timeout=init_timeout_s, **timeouts)
    return True


def cluster_detected() -> bool:
    """Whether the environment names a multi-host job: MEDHA_COORDINATOR, or a TPU pod,
    SLURM or Open MPI, from which `jax.distributed.initialize` finds its peers."""
    return any(k in os.environ for k in ("MEDHA_COORDINATOR", "TPU_WORKER_HOSTNAMES",
                                         "SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE"))
