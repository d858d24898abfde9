"""Multi-host replica benchmark: process 0's host overhead per step with the replica's mesh in
one process vs over two (serving.multihost), on this CPU.

    python -m benchmarks.multihost [--model tiny] [--parallel tp=8] [--quick] [--json FILE]

The same mesh (tp=8 by default) and the same batches, once in one process of 8 virtual CPU
devices and once over two processes of 4 each, where process 0 also sends every step's
bucket and packed inputs to process 1 over the step channel and waits for its
acknowledgement (with `--parallel spp=2,tp=4`: a stage per process, process 0 runs stage 0
and hands its activations on, process 1 runs stage 1 and returns the tokens). Per
batch: the whole step (`Engine.execute`), the host time on its critical path as the engine
measures it (`Engine.last_host_seconds`: building, sending, placing and dispatching the
inputs, reading back the tokens), and the channel's send alone. Medians over repeated runs
of the same batch; the first run of each is excluded. Each configuration runs in child
processes of its own (a JAX job is set up once per process).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ENGINE_CONFIG = dict(page_size=16, max_kv_tokens=4096, max_tokens_per_step=32,
                     min_token_bucket=32, max_seqs=8, max_model_len=128)


def scenarios(quick: bool) -> dict[str, list[tuple[int, int]]]:
    """name -> chunks as (context before the chunk, chunk tokens): one step shape, so
    warm-up is one compile per process."""
    return {"decode x8": [(40 + 9 * i, 1) for i in range(8)],
            "prefill 32": [(0, 32)],
            "mixed 4 decodes + 28 chunk": [(50 + 7 * i, 1) for i in range(4)] + [(16, 28)]}


def _measure(engine, quick: bool, repeats: int) -> list[dict]:
    import numpy as np

    from medha_jax.engine.calibration import borrow_batch, release_batch

    sends = []
    if engine.mirror is not None:
        send = engine.mirror.send

        def timed_send(shape, packed, **hand_on):
            start = time.perf_counter()
            send(shape, packed, **hand_on)
            sends.append(time.perf_counter() - start)
        engine.mirror.send = timed_send
    rng = np.random.default_rng(1)
    rows = []
    for name, chunks in scenarios(quick).items():
        batch = borrow_batch(engine, chunks, rng)
        try:
            engine.execute(batch)                           # first run excluded
            steps, hosts = [], []
            sends.clear()
            for _ in range(repeats):
                start = time.perf_counter()
                engine.execute(batch)
                steps.append(time.perf_counter() - start)
                hosts.append(engine.last_host_seconds)
        finally:
            release_batch(engine, batch)
        rows.append({"scenario": name, "tokens": batch.num_tokens,
                     "step_ms": statistics.median(steps) * 1e3,
                     "host_overhead_ms": statistics.median(hosts) * 1e3,
                     "channel_send_ms": statistics.median(sends) * 1e3 if sends else 0.0})
    return rows


def _worker(args) -> None:
    """One configuration's process 0: prints its rows as one JSON line."""
    from medha_jax.engine import EngineConfig
    from meshes import ParallelConfig
    from serving import multihost

    if args.processes > 1:
        listener = multihost.listen_socket(args.channel)
        multihost.join(0, args.processes, args.coordinator)
    engine = multihost.build_engine(args.model, ParallelConfig.parse(args.parallel),
                                    EngineConfig(**ENGINE_CONFIG))
    if args.processes > 1:
        engine.mirror = multihost.StepMirror(listener, args.processes - 1)
    rows = _measure(engine, args.quick, args.repeats)
    if engine.mirror is not None:
        engine.mirror.close()
    from benchmarks.report import environment

    print("ROWS " + json.dumps({"rows": rows, "context": {
        **environment(), "dtype": engine.model.config.dtype,
        "mesh": dict(engine.model.mesh.shape)}}), flush=True)


def run_config(processes: int, model: str, parallel: str, quick: bool, repeats: int) -> dict:
    """Runs one configuration's processes and returns process 0's rows and context."""
    from serving.multihost import free_port

    devices = 8 // processes
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    coordinator, channel = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    worker = [sys.executable, "-m", "benchmarks.multihost", "--worker", "--model", model,
              "--processes", str(processes), "--coordinator", coordinator, "--channel",
              channel, "--repeats", str(repeats), "--parallel", parallel] + (
                  ["--quick"] if quick else [])
    followers = [subprocess.Popen(
        [sys.executable, "-m", "serving.multihost", "--process-id", str(i), "--num-processes",
         str(processes), "--coordinator", coordinator, "--channel", channel, "--model", model,
         "--parallel", parallel, "--engine-config", json.dumps(ENGINE_CONFIG)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for i in range(1, processes)]
    try:
        out = subprocess.run(worker, env=env, capture_output=True, text=True, timeout=900)
    finally:
        for p in followers:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    lines = [line for line in out.stdout.splitlines() if line.startswith("ROWS ")]
    if not lines:
        raise RuntimeError(f"{processes}-process run failed:\n{out.stdout[-3000:]}\n"
                           f"{out.stderr[-3000:]}")
    result = json.loads(lines[-1][len("ROWS "):])
    for row in result["rows"]:
        row["processes"] = processes
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--parallel", default="tp=8",
                        help="the replica's mesh over 8 devices (spp=2,tp=4: a stage per "
                             "process)")
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--processes", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", help=argparse.SUPPRESS)
    parser.add_argument("--channel", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (20 if args.quick else 100)
    if args.worker:
        _worker(args)
        return
    one, two = (run_config(n, args.model, args.parallel, args.quick, args.repeats)
                for n in (1, 2))
    rows = []
    for a, b in zip(one["rows"], two["rows"], strict=True):
        rows += [a, b]
        b["host_overhead_vs_1_process"] = b["host_overhead_ms"] / a["host_overhead_ms"]
        b["step_vs_1_process"] = b["step_ms"] / a["step_ms"]
        a["host_overhead_vs_1_process"] = a["step_vs_1_process"] = 1.0
    from benchmarks.report import table

    context = {**two["context"], "model": args.model, "parallel": args.parallel,
               "engine_config": ENGINE_CONFIG, "repeats": args.repeats,
               "note": "CPU, virtual devices; 2 processes = 2 x 4 devices over gloo on "
                       "127.0.0.1, 1 process = 8 devices"}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"context": context, "rows": rows}, f, indent=2)
    table(f"multi-host replica, {args.model} {args.parallel}, process 0's host overhead per step "
          f"(median of {args.repeats}; backend {context['backend']}, "
          f"{context['device_count']} devices)",
          [{k: r[k] for k in ("scenario", "processes", "tokens", "step_ms", "host_overhead_ms",
                              "channel_send_ms", "host_overhead_vs_1_process",
                              "step_vs_1_process")} for r in rows])


if __name__ == "__main__":
    main()
