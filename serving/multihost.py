"""One replica over several processes (multi-controller JAX): process 0 schedules, every
process runs the same compiled step on its own devices of the global mesh.

    process 0 (leader)                         process i > 0 (follower)
    Server, controller, scheduler, KV allocator
    Engine.dispatch: build + pack step inputs
      StepMirror.send(shape, packed) ----TCP---> follow(): receive
      run_packed(shape, packed)                  engine.run_packed(shape, packed)
          <============ collectives of the step over gloo / ICI / NCCL ============>
    Engine.collect: StepMirror.wait  <---TCP---- ack(step, crc32 of its tokens)
      (bounded by step_timeout_s)                (spp: the last stage's process
                                                  returns the outputs; see below)

What works on jaxlib 0.10.2 (CPU, two processes of 4 virtual devices each on 127.0.0.1,
`jax_cpu_collectives_implementation="gloo"`), found by running it:
- `jax.distributed.initialize` joins in well under a second; `jax.devices()` lists all 8
  devices (ids 0-3 on process 0, 2048-2051 on process 1), and a mesh over them is one
  global mesh: a jitted sharded matmul, `psum` and `ppermute` under `shard_map` across the
  process boundary give the right values on both processes (gloo opens its pairs at the
  first run of each program).
- A fully replicated output (the sampled tokens) reads with `np.asarray` on every process.
- `multihost_utils.broadcast_one_to_all` and `process_allgather` work.
- Ahead-of-time `lower().compile()` needs no peer: each process compiles the same step.
What does not, and what this module does instead:
- `jax.device_put(host array, sharding over both processes)` first runs
  `multihost_utils.assert_equal`, a collective with no timeout, on every call: 6-11 ms a
  call here against 0.15-0.65 ms without it, and one compile per new shape (measured by a
  probe). The engine places its step inputs with `meshes.put_replicated`
  (`make_array_from_process_local_data`: each process its own copy, no check).
- An output sharded over the mesh (cp's prompt logprobs are split by token over the
  ranks) cannot be read on process 0 ("spans non-addressable devices"): on a mesh over
  several processes the step returns every output replicated (`replicate_outputs`).
- `jax.device_put` from a sub-mesh on process 0 to one on process 1 (what the spp stages'
  hand-off is) raises "does not support cross-host device transfers" on the CPU unless
  every process sets `jax_cross_host_transfer_socket_address`. With it, a stage program
  called on every process runs where its devices are (a no-op elsewhere), but the
  transfer is not dependable: in 2 of 11 two-process probes (stages of 4 devices, jit or
  shard_map stages, replicated or tp-sharded arrays, "HOST:0" or fixed ports) the moved
  array could be read; in the other 9 the read never returned on either process. To
  the whole mesh it is refused ("input and target sharding should have the same set of
  devices"). So spp stages hand their activations on between processes through the host
  instead (below).
- When process 0 (the coordinator) dies, the coordination service terminates the others
  (fatal log): a follower never outlives its leader. A process that never joins makes
  `jax.distributed.initialize` abort the others after `initialization_timeout` (fatal log,
  DEADLINE_EXCEEDED), not raise: the start fails loudly, it does not hang.
- A process that dies: by default the coordination service notices its missing
  heartbeats after `heartbeat_timeout` and *terminates the survivors* (a fatal log and
  abort, not an exception). With `jax_enable_recoverability` process 0 lives on, but a
  collective whose peer died never returns (gloo: no error, no timeout), and nothing can
  cancel a running executable. So `join` turns recoverability on, and process 0 never
  waits for a step without a bound: the follower's acknowledgement over the channel (its
  socket closing says at once that it died) and the tokens, each within
  `step_timeout_s`. Past it the replica is unavailable for good (its device threads sit
  in the dead collective): every later step fails at once with an error starting
  `UNAVAILABLE:`, and the replica is restarted as a new set of processes.

Why a socket channel and not `broadcast_one_to_all` (the issue left the choice open):
broadcast is a device collective, so (1) it has no timeout and a dead follower hangs
process 0 inside it, (2) like `assert_equal` above it runs a jitted program per input
shape (one compile per bucket), and (3) it costs a device program per step on top of the
step (~5 ms a call here for 4 KB, the first compile included). The channel sends the packed
int32/float32/uint32 arrays (a few KB) and the bucket with one `sendall` per follower,
and its acknowledgements carry a checksum of each follower's tokens, so a replica whose
processes diverged fails loudly rather than serving one process's tokens. It is as
trusted as the JAX coordinator it sits beside (cluster-internal, unauthenticated): bind it
on the hosts' private network only.

Measured (`python -m benchmarks.multihost --quick`, tiny at tp=8, this 2-core CPU): the
channel's send is 0.1-1 ms a step and process 0's host overhead per step 1.2-1.9x one
process's (4 ms -> 5-8 ms); the step itself is 6-10x slower over two processes, which is
gloo's all-reduces over TCP on shared cores, not the channel.

Not tried here (no GPU or TPU in this session): on GPUs, JAX's fault-tolerance guide
also sets `--xla_gpu_nccl_terminate_on_error=false` so that NCCL does not abort process 0
when a peer dies; on TPU pods the same timeouts apply.

spp across processes (a stage per process, or per set of processes): process 0 sends the
step to the processes of its own stages as above, runs its stages, and a thread of
StepMirror reads the last one's activations [T, D] back once computed and sends them with
the step to the processes of the later stages (they start from them,
`PipelinedStep.run`); the first process of the last stage returns the step's outputs (the
tokens and the logprobs asked for) in its acknowledgement, and every process of that
stage acknowledges with its tokens' checksum. Process 0 does not wait for its stages
before dispatching the next batch, so up to spp batches stay in flight as on one process.
The activations go through process 0 once a step, so the pipeline may cross processes
once: process 0's stages, then the rest (`medha_jax.engine.pipeline.process_hop`).

Scope (this slice): warm-up of every shape before serving on every process (no background
warm-up: a follower must hold every shape the leader may send), one replica per set of
processes, no restart in place: a lost replica's process 0 exits REPLICA_LOST_EXIT_CODE and
the replica is started again as new processes (by `launch_local` on one machine,
`serving.ray_hosts.launch_ray` with `--ray`, the cluster's restart policy elsewhere).
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import select
import socket
import struct
import threading
import time
import zlib
from collections.abc import Callable, Sequence

import numpy as np

# A step may take long on a CPU (a big prefill chunk on 2 shared cores): the bound is on a
# hung or dead peer, not on a slow step.
DEFAULT_STEP_TIMEOUT_S = 60.0
DEFAULT_CONNECT_TIMEOUT_S = 120.0
_HEADER = struct.Struct("!II")           # JSON bytes, payload bytes
_STEP, _STOP = "step", "stop"
# Process 0's exit code when its replica lost a process (EX_TEMPFAIL: try again): whoever
# started the replica starts it again as new processes (`launch_local`, or the cluster's
# own restart policy).
REPLICA_LOST_EXIT_CODE = 75


class ReplicaUnavailable(RuntimeError):
    """A process of a multi-host replica died, hung or diverged: the replica cannot step."""


# ---------------------------------------------------------------- framing


def _dtype_name(dtype: np.dtype) -> str:
    """A dtype's name that `_dtype` reads back: numpy's code, or ml_dtypes' name for the
    types numpy has no code for (bfloat16's `.str` is a bare '<V2')."""
    return dtype.name if dtype.kind == "V" else dtype.str


def _dtype(name: str) -> np.dtype:
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)


def _send(sock: socket.socket, meta: dict, arrays: Sequence[np.ndarray] = ()) -> None:
    arrays = [np.ascontiguousarray(a) for a in arrays]
    meta = dict(meta, arrays=[[_dtype_name(a.dtype), list(a.shape)] for a in arrays])
    head = json.dumps(meta).encode()
    payload = b"".join(a.tobytes() for a in arrays)
    sock.sendall(_HEADER.pack(len(head), len(payload)) + head + payload)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError("the peer closed the step channel")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket) -> tuple[dict, list[np.ndarray]]:
    head_len, payload_len = _HEADER.unpack(_recv_exactly(sock, _HEADER.size))
    meta = json.loads(_recv_exactly(sock, head_len))
    payload = _recv_exactly(sock, payload_len)
    arrays, offset = [], 0
    for dtype, shape in meta.pop("arrays"):
        dtype = _dtype(dtype)
        size = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
        arrays.append(np.frombuffer(payload, dtype, offset=offset,
                                    count=size // dtype.itemsize).reshape(shape))
        offset += size
    return meta, arrays


def tokens_digest(tokens: np.ndarray) -> int:
    """What a follower acknowledges a step with: a checksum of its sampled tokens."""
    return zlib.crc32(np.ascontiguousarray(tokens, np.int32).tobytes())


def _output_arrays(outputs, logprobs: Sequence[int]) -> list[np.ndarray]:
    """A step's outputs (StepOutputs) as the host arrays the last stage's process returns
    to process 0: the tokens, then each logprobs part that was asked for."""
    arrays = [np.asarray(outputs.tokens)]
    for want, part in zip(logprobs, (outputs.sampled, outputs.prompt)):
        if want:
            arrays += [np.asarray(getattr(part, f.name)) for f in dataclasses.fields(part)]
    return arrays


def _outputs_of(arrays: Sequence[np.ndarray], logprobs: Sequence[int]):
    """StepOutputs of host arrays from `_output_arrays` (a part not asked for: None)."""
    from medha_jax.engine.logprobs import StepOutputs, TopLogprobs

    rest = iter(arrays[1:])
    width = len(dataclasses.fields(TopLogprobs))
    parts = [TopLogprobs(*(next(rest) for _ in range(width))) if want else None
             for want in logprobs]
    return StepOutputs(arrays[0], *parts)


# ---------------------------------------------------------------- process 0


class StepMirror:
    """Process 0's side: accepts every follower, then sends each step's packed inputs and
    waits, bounded, for the followers' acknowledgements (Engine.mirror)."""

    def __init__(self, listener: socket.socket, num_followers: int, *,
                 step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
                 connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S):
        """listener: a bound, listening TCP socket (`listen_socket`); blocks until
        `num_followers` processes connected, each saying its process id."""
        self.step_timeout_s = step_timeout_s
        self.broken: str | None = None           # why the replica cannot step any more
        self.steps_sent = 0
        self._acked = 0
        # Per step sent and not yet waited for: the process returning its outputs (spp
        # across processes), else None (process 0 samples them itself).
        self._reporters: list[int | None] = []
        # Steps whose activations are still to be read and handed on (spp across
        # processes), by one thread in step order; sends to a socket hold the lock.
        self._hand_ons: queue.Queue = queue.Queue()
        self._hand_on_thread: threading.Thread | None = None
        self._send_lock = threading.Lock()
        self.followers: dict[int, socket.socket] = {}
        deadline = time.monotonic() + connect_timeout_s
        while len(self.followers) < num_followers:
            listener.settimeout(max(deadline - time.monotonic(), 1e-3))
            try:
                sock, _ = listener.accept()
            except socket.timeout:
                missing = num_followers - len(self.followers)
                raise ReplicaUnavailable(
                    f"UNAVAILABLE: {missing} of {num_followers} follower process(es) did not "
                    f"connect to the step channel within {connect_timeout_s:g} s "
                    f"(connected: {sorted(self.followers)})") from None
            sock.settimeout(connect_timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            meta, _ = _recv(sock)
            self.followers[int(meta["process_id"])] = sock
        listener.close()

    def poll(self) -> str | None:
        """Why the replica cannot step (None: it can), checking without blocking whether a
        follower's end of the channel closed while idle (a dead process's socket is closed
        by its OS at once). Safe from any thread: it only peeks."""
        if self.broken is None:
            for pid, sock in list(self.followers.items()):
                try:
                    if select.select([sock], [], [], 0)[0] and not sock.recv(1, socket.MSG_PEEK):
                        self._fail(f"process {pid} closed the step channel (it died?)")
                except (OSError, ValueError) as e:
                    self._fail(f"process {pid}'s step channel failed: {type(e).__name__}: {e}")
        return self.broken

    def _fail(self, reason: str) -> ReplicaUnavailable:
        self.broken = self.broken or f"UNAVAILABLE: multi-host replica: {reason}"
        return ReplicaUnavailable(self.broken)

    def send(self, shape: tuple[int, ...], packed: Sequence[np.ndarray], *,
             hidden=None, hop=None, logprobs: Sequence[int] = (0, 0)) -> None:
        """Sends one step's bucket and packed inputs to every follower (before process 0
        runs it, so all start together).

        spp across processes (hop: medha_jax.engine.pipeline.ProcessHop): the processes
        of the later stages get the step only with `hidden`, the activations [T, D] of
        process 0's last stage (a jax.Array), which a thread reads back once computed and
        sends on (this call does not wait for them); the step's outputs, with the
        `logprobs` parts asked for (StepInputs.logprobs_flags), come back from
        `hop.reporter` (`wait`)."""
        if self.broken is not None:
            raise ReplicaUnavailable(self.broken)
        meta = {"kind": _STEP, "step": self.steps_sent, "shape": list(shape)}
        later = () if hop is None else hop.processes
        for pid, sock in self.followers.items():
            if pid not in later:
                self._send_to(pid, sock, meta, packed)
        if hop is not None:
            if self._hand_on_thread is None:
                self._hand_on_thread = threading.Thread(target=self._hand_on_loop,
                                                        name="step-hand-on", daemon=True)
                self._hand_on_thread.start()
            self._hand_ons.put((meta, packed, hidden, hop, [int(x) for x in logprobs]))
        self._reporters.append(None if hop is None else hop.reporter)
        self.steps_sent += 1

    def _send_to(self, pid: int, sock: socket.socket, meta: dict,
                 arrays: Sequence[np.ndarray]) -> None:
        try:
            with self._send_lock:
                sock.settimeout(self.step_timeout_s)
                _send(sock, meta, arrays)
        except OSError as e:
            raise self._fail(f"process {pid}: sending it step {meta['step']} failed (it "
                             f"died?): {type(e).__name__}: {e}") from e

    def _hand_on_loop(self) -> None:
        """Reads each step's activations back from process 0's devices when computed and
        sends the step with them to the later stages' processes. A failure marks the
        replica broken; `wait` then raises (and bounds the wait for a read that hangs)."""
        while (item := self._hand_ons.get()) is not None:
            meta, packed, hidden, hop, logprobs = item
            try:
                if self.broken is None:
                    hidden = np.asarray(hidden)
                    for pid in hop.processes:
                        reply = {"reply": logprobs} if pid == hop.reporter else {}
                        self._send_to(pid, self.followers[pid], dict(meta, hidden=True, **reply),
                                      [*packed, hidden])
            except Exception as e:            # noqa: BLE001 -- reported through `broken`
                self._fail(f"process 0: reading step {meta['step']}'s activations to hand "
                           f"on failed: {type(e).__name__}: {e}")

    def replied(self) -> bool:
        """Whether every follower's reply to the oldest step is there to read, so that
        `wait` would not block on the channel (Engine.is_ready)."""
        socks = list(self.followers.values())
        return len(select.select(socks, [], [], 0)[0]) == len(socks)

    def wait(self, tokens):
        """Waits for the oldest step sent: every follower's acknowledgement, then process
        0's own tokens (a jax.Array), each within step_timeout_s; raises
        ReplicaUnavailable when a follower died (its socket closed), hung, or sampled
        other tokens than process 0. With spp across processes (tokens None: process 0
        samples nothing) returns the step's outputs (StepOutputs of host arrays) as its
        reporter sent them, which the other processes of the last stage must match."""
        if self.broken is not None:
            raise ReplicaUnavailable(self.broken)
        step = self._acked
        reporter = self._reporters[0]
        if (tokens is None) != (reporter is not None):
            raise ValueError(f"step {step}: tokens {'missing' if tokens is None else 'given'}"
                             f" but the outputs come from process {reporter}")
        deadline = time.monotonic() + self.step_timeout_s
        digests, returned = {}, None
        pending = dict(self.followers)
        while pending:
            left = deadline - time.monotonic()
            ready = select.select(list(pending.values()), [], [], left)[0] if left > 0 else []
            if not ready:
                raise self._fail(f"process(es) {sorted(pending)} did not finish step {step} "
                                 f"within {self.step_timeout_s:.1f} s")
            for pid in [p for p, s in pending.items() if s in ready]:
                try:
                    meta, arrays = _recv(pending.pop(pid))
                except (OSError, EOFError, ValueError) as e:
                    raise self._fail(f"process {pid} closed the step channel during step "
                                     f"{step} (it died?): {type(e).__name__}: {e}") from e
                if meta.get("step") != step:
                    raise self._fail(f"process {pid} acknowledged step {meta.get('step')}, "
                                     f"expected {step}")
                if "error" in meta:
                    raise self._fail(f"process {pid} failed step {step}: {meta['error']}")
                if meta.get("digest") is not None:     # None: it holds no last stage
                    digests[pid] = meta["digest"]
                if pid == reporter:
                    returned = _outputs_of(arrays, meta["reply"])
        if returned is None:
            while not tokens.is_ready():
                if time.monotonic() > deadline:
                    raise self._fail(f"process 0's own step {step} did not finish within "
                                     f"{self.step_timeout_s:.1f} s")
                time.sleep(1e-4)
        mine = tokens_digest(np.asarray(tokens if returned is None else returned.tokens))
        if any(d != mine for d in digests.values()):
            whose = "process 0's" if returned is None else f"process {reporter}'s returned"
            raise self._fail(f"step {step}: the processes sampled different tokens "
                             f"(digests {digests}, {whose} {mine})")
        self._acked += 1
        self._reporters.pop(0)
        return returned

    def close(self, timeout_s: float = 10.0) -> None:
        """Tells the followers to stop, then waits (bounded) for each to close its end:
        a follower leaves the JAX job first (`leave`), so process 0's coordination service,
        which goes with process 0, is still there for it."""
        if self._hand_on_thread is not None:          # steps still to hand on go first
            self._hand_ons.put(None)
            self._hand_on_thread.join(timeout_s)
        for sock in self.followers.values():
            try:
                with self._send_lock:
                    sock.settimeout(1.0)
                    _send(sock, {"kind": _STOP})
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        for sock in self.followers.values():
            try:
                sock.settimeout(max(deadline - time.monotonic(), 1e-3))
                while sock.recv(4096):
                    pass
            except OSError:
                pass
            sock.close()
        self.followers.clear()
        if self.broken is None:
            self.broken = "UNAVAILABLE: multi-host replica: its step channel is closed"


def listen_socket(address: str) -> socket.socket:
    """The step channel's listening socket on process 0 at "host:port" (the followers
    retry until their timeout, so it may open after they start). A loopback host binds
    loopback only; any other binds every interface (the hosts' private network)."""
    host, port = address.rsplit(":", 1)
    host = host if host in ("127.0.0.1", "localhost") else "0.0.0.0"
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, int(port)))
    sock.listen()
    return sock


# ---------------------------------------------------------------- processes i > 0


BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@dataclasses.dataclass
class FollowerReport:
    """What a follower did: steps run, and programs XLA compiled while it served (any
    program, not only steps: the guard against compiles after warm-up on every process)."""

    steps: int = 0
    compiles: int = 0


def connect(address: str, process_id: int, *,
            timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S) -> socket.socket:
    """A follower's connection to process 0's step channel at "host:port", retried until
    `timeout_s` (process 0 may still be loading its model)."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock = socket.create_connection((host, int(port)), timeout=5.0)
            break
        except OSError as e:
            if time.monotonic() > deadline:
                raise ReplicaUnavailable(
                    f"UNAVAILABLE: process {process_id} could not reach process 0's step "
                    f"channel at {address} within {timeout_s:g} s: {e}") from e
            time.sleep(0.2)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(None)              # idle between requests for as long as it likes
    _send(sock, {"process_id": process_id})
    return sock


def follow(engine, sock: socket.socket) -> FollowerReport:
    """A follower's loop: runs every step process 0 sends, on this process's devices of the
    replica's mesh, and acknowledges it with its tokens' checksum, until process 0 says stop
    (returns) or its channel closes (raises ReplicaUnavailable). The engine must be warmed
    up with the leader's shapes: a shape it lacks is an error, never a compile."""
    import jax

    report = FollowerReport()

    def count_compile(event: str, duration: float, **kwargs) -> None:
        if event == BACKEND_COMPILE_EVENT:
            report.compiles += 1

    jax.monitoring.register_event_duration_secs_listener(count_compile)
    try:
        _follow(engine, sock, report)
    finally:
        jax.monitoring.unregister_event_duration_listener(count_compile)
    return report


def leave(sock: socket.socket) -> None:
    """A follower's exit after process 0 stopped it: leaves the JAX job, then closes the
    channel, which tells process 0 it may go (its coordination service goes with it: a
    follower still in the job then would be aborted)."""
    import jax

    jax.distributed.shutdown()
    sock.close()


def _follow(engine, sock: socket.socket, report: FollowerReport) -> None:
    import jax

    while True:
        try:
            meta, packed = _recv(sock)
        except (OSError, EOFError) as e:
            raise ReplicaUnavailable(f"UNAVAILABLE: process 0 closed the step channel: {e}") from e
        if meta["kind"] == _STOP:
            break
        reply, arrays = {"step": meta["step"]}, []
        try:
            # spp across processes: the later stages start from process 0's activations.
            hidden = packed.pop() if meta.get("hidden") else None
            outputs = engine.run_packed(tuple(meta["shape"]), tuple(packed), hidden=hidden)
            if hasattr(outputs, "tokens"):                   # it ran the last stage
                reply["digest"] = tokens_digest(np.asarray(outputs.tokens))
                if "reply" in meta:                          # and returns the outputs
                    reply["reply"] = meta["reply"]
                    arrays = _output_arrays(outputs, meta["reply"])
            else:                                            # its stages come first
                jax.block_until_ready(outputs)
        except Exception as e:          # say so at once, rather than let process 0 time out
            reply["error"] = f"{type(e).__name__}: {e}"
        _send(sock, reply, arrays)
        report.steps += 1
        if "error" in reply:
            raise ReplicaUnavailable(f"UNAVAILABLE: step {meta['step']} failed here: "
                                     f"{reply['error']}")


# ---------------------------------------------------------------- start-up


def join(process_id: int, num_processes: int, coordinator: str, *,
         heartbeat_timeout_s: int = 10, init_timeout_s: int = 120) -> None:
    """Joins this process to the replica's JAX job, before any JAX array exists
    (meshes.initialize_distributed: gloo collectives on the CPU, recoverability on)."""
    from meshes import initialize_distributed

    initialize_distributed(coordinator, num_processes, process_id,
                           heartbeat_timeout_s=heartbeat_timeout_s, init_timeout_s=init_timeout_s)


def build_engine(model: str, parallel, engine_config=None, *, dtype: str | None = None,
                 shapes=None):
    """This process's engine of the replica: the model on the mesh over every process's
    devices (each process places only its own devices' slices), warmed up with `shapes`
    (default: the whole ladder) before any step, the same on every process."""
    import jax

    from medha_jax.engine import Engine, EngineConfig
    from medha_jax.model import load_model
    from meshes import make_mesh

    if parallel.num_devices != jax.device_count():
        raise ValueError(f"ParallelConfig({parallel}) has {parallel.num_devices} devices but "
                         f"the {jax.process_count()} processes hold {jax.device_count()}: a "
                         "multi-host replica spans every device of its processes")
    mesh = make_mesh(parallel, jax.devices())
    loaded = load_model(model, mesh=mesh, dtype=dtype, verbose=jax.process_index() == 0)
    engine = Engine(loaded, engine_config or EngineConfig())
    engine.warmup(progress=False, shapes=shapes)
    return engine


def _parse_args(argv=None):
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m serving.multihost",
        description="A follower process of a multi-host replica: joins the JAX job, loads "
                    "its slices of the model, warms up, and runs the steps process 0 sends.")
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--coordinator", required=True, help="HOST:PORT of jax.distributed")
    parser.add_argument("--channel", required=True, help="HOST:PORT of process 0's step channel")
    parser.add_argument("--model", required=True)
    parser.add_argument("--parallel", required=True, action="append",
                        help="e.g. tp=8 or tp=2,kvp=2,cp=2; repeated: one replica after the "
                             "other, as process 0 serves them")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--engine-config", action="append",
                        help="EngineConfig fields as JSON (the same on every process); once "
                             "for every replica, or once per --parallel")
    parser.add_argument("--shapes", default=None,
                        help="JSON list of step shapes to warm up (default: the whole ladder)")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    from medha_jax.engine import EngineConfig
    from meshes import ParallelConfig

    args = _parse_args(argv)
    configs = args.engine_config or ["{}"]
    if len(configs) not in (1, len(args.parallel)):
        raise ValueError(f"{len(configs)} --engine-config for {len(args.parallel)} "
                         f"--parallel: give one for all, or one per --parallel")
    configs = configs * len(args.parallel) if len(configs) == 1 else configs
    join(args.process_id, args.num_processes, args.coordinator)
    shapes = None if args.shapes is None else [tuple(s) for s in json.loads(args.shapes)]
    for parallel, config in zip(args.parallel, configs, strict=True):
        engine = build_engine(args.model, ParallelConfig.parse(parallel),
                              EngineConfig(**json.loads(config)), dtype=args.dtype,
                              shapes=shapes)
        sock = connect(args.channel, args.process_id)
        report = follow(engine, sock)
        print(json.dumps({"process_id": args.process_id, "parallel": parallel,
                          "steps": report.steps,
                          "compiles_after_warmup": report.compiles}),
              flush=True)
        del engine
        if parallel == args.parallel[-1]:
            leave(sock)
        else:
            sock.close()



def channel_address() -> str:
    """Process 0's step channel, "host:port": $MEDHA_STEP_CHANNEL, else the JAX
    coordinator's host at its port + 1."""
    if "MEDHA_STEP_CHANNEL" in os.environ:
        return os.environ["MEDHA_STEP_CHANNEL"]
    import jax

    coordinator = jax.distributed.global_state.coordinator_address
    if coordinator is None:
        raise ValueError("no step channel: set MEDHA_STEP_CHANNEL=host:port (process 0's "
                         "address, reachable from every host)")
    host, port = coordinator.rsplit(":", 1)
    return f"{host}:{int(port) + 1}"



def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (bound and released: another process may take it
    before the caller binds it, which on one machine's loopback is rare)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]

def launch_local(num_processes: int, argv: Sequence[str], *, devices_per_process: int = 4,
                 max_restarts: int = 0) -> int:
    """Starts the `num_processes` processes of a replica on this machine, each running
    `python argv` with the job in its environment (a free coordinator port on
    127.0.0.1, this process count, its id) and `devices_per_process` virtual CPU
    devices; waits for them (`run_replica`: restarts and signals). Process 0's output is
    this command's. Returns process 0's last exit code."""
    return run_replica(lambda: _start_processes(num_processes, argv, devices_per_process),
                       max_restarts=max_restarts)


def run_replica(start_processes: Callable[[], list], *, max_restarts: int = 0,
                describe: Callable[[list], str] | None = None) -> int:
    """Runs a replica's processes until process 0 exits, starting them again as new
    processes (a new JAX job) when it exits REPLICA_LOST_EXIT_CODE, up to `max_restarts`
    times. SIGINT / SIGTERM go to process 0, which stops the others through the step
    channel. A follower that exits early leaves process 0 serving, reporting the replica
    unavailable (as on real hosts), until process 0 gives up. Once process 0 exits,
    followers still running after 30 s are stopped.

    start_processes() -> the processes, process 0 first: subprocess.Popen, or anything
    with its pid, wait(timeout), send_signal, terminate, kill and returncode (a Ray host
    actor's process: serving.ray_hosts). describe(processes): where they run, printed
    after their pids. Returns process 0's last exit code."""
    import signal

    stopping = []            # a signal came: whatever process 0 exits with is final
    current: list = []

    def forward(signum, frame):
        stopping.append(signum)
        if current:
            current[0].send_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    for attempt in range(max_restarts + 1):
        current[:] = start_processes()
        print(f"replica processes (start {attempt + 1}): pids "
              f"{' '.join(str(p.pid) for p in current)}"
              + (f" {describe(current)}" if describe else ""), flush=True)
        code = _wait_for_leader(current)
        if code != REPLICA_LOST_EXIT_CODE or stopping:
            return code
        if attempt < max_restarts:
            print(f"replica lost a process: starting it again "
                  f"({attempt + 1} of {max_restarts} restarts)", flush=True)
    return code


def _start_processes(num_processes: int, argv: Sequence[str], devices_per_process: int):
    """The replica's processes, one new JAX job (fresh ports on 127.0.0.1)."""
    import subprocess
    import sys

    ports = [free_port(), free_port()]
    env = job_environment(f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}", num_processes,
                          devices_per_process)
    base = dict(os.environ, **env)
    base.setdefault("JAX_PLATFORMS", "cpu")
    return [subprocess.Popen([sys.executable, *argv], env=dict(base, MEDHA_PROCESS_ID=str(i)))
            for i in range(num_processes)]


def job_environment(coordinator: str, channel: str, num_processes: int,
                    devices_per_process: int) -> dict[str, str]:
    """The environment every process of one replica's JAX job shares (each adds its
    MEDHA_PROCESS_ID): the coordinator, process 0's step channel, the process count, and
    `devices_per_process` virtual CPU devices (XLA_FLAGS: it sizes the host platform only,
    so a GPU or TPU host keeps its own devices)."""
    flags = os.environ.get("XLA_FLAGS", "")
    flags = " ".join(f for f in flags.split() if "xla_force_host_platform_device_count" not in f)
    return {"MEDHA_COORDINATOR": coordinator, "MEDHA_STEP_CHANNEL": channel,
            "MEDHA_NUM_PROCESSES": str(num_processes),
            "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={devices_per_process}"
                         .strip()}


def _wait_for_leader(procs) -> int:
    """Waits for process 0, then (bounded) for the followers; process 0's exit code."""
    import subprocess

    try:
        procs[0].wait()
    finally:
        # A SIGTERM to process 0 while it shuts down (its handlers already gone) would
        # kill it: only followers are stopped, and only when they outstay it.
        deadline = time.monotonic() + 30
        for p in procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    return procs[0].returncode


if __name__ == "__main__":
    main()
