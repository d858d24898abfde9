"""A multi-host replica started by Ray (`medha-jax serve --hosts N --ray`): one actor per
host, each starting its host's process of the replica's JAX job (serving.multihost).

    driver (this process)                  host i (a Ray node)
    placement group: N bundles,            HostActor i
      one per node (STRICT_SPREAD)           start(argv, env) -> python -m serving.cli serve
    HostActor 0: node IP, two free ports       --hosts N ... with MEDHA_COORDINATOR,
    every actor: start the process             MEDHA_STEP_CHANNEL (host 0's IP and ports),
    run_replica: wait for process 0,           MEDHA_NUM_PROCESSES, MEDHA_PROCESS_ID=i
      restart the job when it lost a host    read(): its output lines, relayed here

As Ray Train's JaxTrainer does it (its JAX backend: worker 0's node address and a free
port there become the coordinator, and every worker calls `jax.distributed.initialize`
with it, its rank and the worker count): Ray only places one actor per host (a placement
group over the hosts' accelerators) and hands each the job's coordinates; the hosts then
form the JAX job themselves and Ray carries no step traffic. Unlike the trainer's workers,
the actor runs the host's process as a child rather than joining the job in its own
worker process: a JAX job cannot be left and joined again in one process, and a replica
that lost a host is restarted as a new job (new processes). A child dies with its actor
(PR_SET_PDEATHSIG on Linux), so a host whose actor Ray lost leaves no process behind.

On one node (this machine) the N bundles are packed on it: `--hosts 2 --ray` runs the two
processes here, 4 virtual CPU devices each, as without Ray. On a cluster with fewer alive
nodes than hosts the start fails with the count, rather than stacking hosts on a node.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from serving.multihost import free_port, job_environment, run_replica

POLL_S = 0.2                 # how often the driver reads the processes' state and output
READY_TIMEOUT_S = 120.0      # for the placement group and the actors to come up
CALL_TIMEOUT_S = 30.0        # for an actor's answer (poll, read, signal): else it is lost
STOP_TIMEOUT_S = 10.0        # for the actors and placement group to go, at the end
DEFAULT_HOST_RESOURCES = {"CPU": 1}


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the actor that started it dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except OSError:
        pass


class HostActor:
    """Runs one host's process of a replica (a Ray actor, placed on its host)."""

    def __init__(self):
        self._proc: subprocess.Popen | None = None
        self._lines: list[tuple[str, str]] = []      # (stream, line), not yet read
        self._first = 0                               # the index of _lines[0]
        self._lock = threading.Lock()

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def free_ports(self, count: int) -> list[int]:
        """Ports free on this host now, for the job's coordinator and step channel."""
        ip = self.node_ip()
        return [free_port(ip) for _ in range(count)]

    def start(self, argv: Sequence[str], env: dict[str, str]) -> int:
        """Starts `python argv` with `env` over this actor's environment; its pid."""
        if self._proc is not None and self._proc.poll() is None:
            raise RuntimeError(f"this host's process {self._proc.pid} is still running")
        self._proc = subprocess.Popen(
            [sys.executable, *argv], env={**os.environ, **env}, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, bufsize=1,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        for name, stream in (("stdout", self._proc.stdout), ("stderr", self._proc.stderr)):
            threading.Thread(target=self._collect, args=(name, stream), daemon=True).start()
        return self._proc.pid

    def _collect(self, name: str, stream) -> None:
        for line in stream:
            with self._lock:
                self._lines.append((name, line))

    def read(self, since: int) -> list[tuple[str, str]]:
        """The output lines from the `since`-th on (stdout and stderr interleaved); those
        before it are dropped (one reader, the driver, has them: a server that runs for
        weeks keeps no log here)."""
        with self._lock:
            del self._lines[:max(0, since - self._first)]
            self._first = max(self._first, since)
            return self._lines[max(0, since - self._first):]

    def poll(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def send_signal(self, signum: int) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signum)


class HostProcess:
    """A host actor's process as the driver sees it: what `run_replica` reads of a
    subprocess.Popen (pid, wait, send_signal, terminate, kill, returncode). An actor Ray
    lost (its node died) reads as a process killed by SIGKILL."""

    def __init__(self, actor, pid: int, host: str):
        self.actor, self.pid, self.host = actor, pid, host
        self._code: int | None = None

    @property
    def returncode(self) -> int | None:
        if self._code is None:
            import ray

            try:
                self._code = ray.get(self.actor.poll.remote(), timeout=CALL_TIMEOUT_S)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                self._code = -signal.SIGKILL
        return self._code

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"host {self.host} pid {self.pid}", timeout)
            time.sleep(POLL_S)
        return self._code

    def send_signal(self, signum: int) -> None:
        import ray

        try:
            ray.get(self.actor.send_signal.remote(int(signum)), timeout=CALL_TIMEOUT_S)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass                                   # gone with its host: nothing to stop

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _OutputRelay:
    """Prints the host processes' output lines here as they come (a driver thread)."""

    def __init__(self, actors):
        self._actors, self._read = actors, [0] * len(actors)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self.drain()

    def drain(self) -> None:
        import ray

        for i, actor in enumerate(self._actors):
            try:
                lines = ray.get(actor.read.remote(self._read[i]), timeout=CALL_TIMEOUT_S)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                continue
            self._read[i] += len(lines)
            for stream, line in lines:
                out = sys.stdout if stream == "stdout" else sys.stderr
                out.write(line)
                out.flush()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.drain()


def launch_ray(num_processes: int, argv: Sequence[str], *, cluster: str = "ray",
               devices_per_process: int = 4, max_restarts: int = 0,
               host_resources: dict[str, float] | None = None) -> int:
    """Starts a replica's `num_processes` processes through Ray, one per host, each
    running `python argv` with the job in its environment; waits for them as
    `run_replica` does (restarts on REPLICA_LOST_EXIT_CODE, signals to process 0), their
    output relayed to this process's. Returns process 0's last exit code.

    cluster: "ray" (RAY_ADDRESS, else a new local Ray) or an address (serving.ray_cluster
    .connect). host_resources: what each host's bundle reserves (default one CPU; on a TPU
    pod e.g. {"TPU": 4}, on GPU nodes {"GPU": 8}), so no other actor takes the devices
    the host's process uses. Each start is a new placement group and new actors: a host
    Ray lost is replaced by another node where the cluster has one."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from serving.ray_cluster import connect

    connect(cluster)
    resources = dict(host_resources or DEFAULT_HOST_RESOURCES)
    nodes = sum(1 for n in ray.nodes() if n["Alive"])
    if 1 < nodes < num_processes:
        raise ValueError(f"--hosts {num_processes} needs {num_processes} Ray nodes, one per "
                         f"host; the cluster has {nodes} alive")
    strategy = "PACK" if nodes == 1 else "STRICT_SPREAD"
    # The actors import this checkout's packages, as the replica actors do.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    pythonpath = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    passed = {k: os.environ[k] for k in ("JAX_PLATFORMS", "MEDHA_CACHE_DIR") if k in os.environ}
    actor_class = ray.remote(HostActor)
    started: list = []                    # (placement group, actors, relay) of the last start

    def stop_last() -> None:
        """Ends the last start's actors (their processes die with them) and placement
        group, waiting at most STOP_TIMEOUT_S: a Ray that lost its raylet (a Ctrl-C to
        the terminal's process group reaches a local Ray's too) never answers, and the
        job's end frees both anyway."""
        if not started:
            return
        group, actors, relay = started.pop()
        relay.close()

        def remove() -> None:
            for actor in actors:
                ray.kill(actor, no_restart=True)
            remove_placement_group(group)

        remover = threading.Thread(target=remove, daemon=True)
        remover.start()
        remover.join(STOP_TIMEOUT_S)

    def start_processes() -> list[HostProcess]:
        stop_last()
        group = placement_group([resources] * num_processes, strategy=strategy)
        try:
            ray.get(group.ready(), timeout=READY_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(group)
            raise RuntimeError(f"Ray placed no {num_processes} bundles of {resources} "
                               f"({strategy}) within {READY_TIMEOUT_S:.0f} s") from None
        actors = [actor_class.options(
            num_cpus=0, max_restarts=0, runtime_env={"env_vars": {"PYTHONPATH": pythonpath}},
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=i)).remote()
            for i in range(num_processes)]
        hosts = ray.get([a.node_ip.remote() for a in actors], timeout=READY_TIMEOUT_S)
        coordinator_port, channel_port = ray.get(actors[0].free_ports.remote(2),
                                                 timeout=READY_TIMEOUT_S)
        env = {**passed, "PYTHONPATH": pythonpath,
               **job_environment(f"{hosts[0]}:{coordinator_port}",
                                 f"{hosts[0]}:{channel_port}", num_processes,
                                 devices_per_process)}
        pids = ray.get([a.start.remote(list(argv), dict(env, MEDHA_PROCESS_ID=str(i)))
                        for i, a in enumerate(actors)], timeout=READY_TIMEOUT_S)
        started.append((group, actors, _OutputRelay(actors)))
        return [HostProcess(a, pid, host) for a, pid, host in zip(actors, pids, hosts)]

    try:
        return run_replica(start_processes, max_restarts=max_restarts,
                           describe=lambda procs: "on hosts " + " ".join(p.host for p in procs))
    finally:
        stop_last()


def without_ray_flag(argv: Sequence[str]) -> list[str]:
    """argv without `--ray [ADDRESS]` / `--ray=ADDRESS`: what each host's process runs (it
    joins the job from its environment, not Ray)."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--ray":
            i += 2 if i + 1 < len(argv) and not argv[i + 1].startswith("-") else 1
            continue
        if not arg.startswith("--ray="):
            out.append(arg)
        i += 1
    return out
