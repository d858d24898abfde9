"""Do two replicas on one CPU host compute side by side? The same jitted work (a float32
matmul) run N times by one worker alone, then by two workers at once, three ways:

  in one process:      two CPU devices (--xla_force_host_platform_device_count=2), a
                       thread each, as in-process replicas run (Server(replicas=2)); and
                       the same with --xla_cpu_multi_thread_eigen=false (it does not keep
                       a program to one core: alone it runs as fast);
  two processes:       one device each, unbound, as Ray actors run by default;
  two bound processes: each bound to its own CPUs (serving.ray_cluster.bind_cpus, as
                       cpu_binding="auto" binds Ray actors).

ratio = wall of the two at once / wall of one alone: 1.0 is perfectly side by side, 2.0
one after the other. Unbound, one alone already spreads over every core, so ~2.0 says
only that the two share them (neither is faster together than apart); bound, each keeps
to its own core (alone slower) and the two run side by side.

    python -m benchmarks.cpu_concurrency            # ~1 minute on 2 cores
    python -m benchmarks.cpu_concurrency --json results/cpu_concurrency.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from benchmarks.report import table

# A worker: builds the work, prints "ready", waits for a line on stdin, runs it and prints
# its seconds. argv: size, repeats, devices in the process, CPUs to bind ("" = unbound),
# more XLA flags.
_WORKER = """
import os, sys, threading, time
size, repeats, devices, cpus = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices} {sys.argv[5]}"
if cpus:
    from serving.ray_cluster import bind_cpus
    bind_cpus([int(c) for c in cpus.split(",")])
import jax, jax.numpy as jnp
work = jax.jit(lambda a: (a @ a).sum())
inputs = [jax.device_put(jnp.ones((size, size), jnp.float32), d) for d in jax.devices()]
for a in inputs:
    work(a).block_until_ready()
def run(a):
    for _ in range(repeats):
        work(a).block_until_ready()
print("ready", flush=True)
sys.stdin.readline()
start = time.perf_counter()
threads = [threading.Thread(target=run, args=(a,)) for a in inputs]
for t in threads: t.start()
for t in threads: t.join()
print(time.perf_counter() - start, flush=True)
"""


def workers_wall(specs: list[tuple[int, str, str]], size: int, repeats: int) -> float:
    """Starts one worker per (devices, cpus, XLA flags) spec, lets them all go at once and returns
    the wall time until the last one finished."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=root)
    children = [subprocess.Popen([sys.executable, "-c", _WORKER, str(size), str(repeats),
                                  str(devices), cpus, flags], cwd=root, env=env,
                                  text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
                for devices, cpus, flags in specs]
    for child in children:
        if child.stdout.readline().strip() != "ready":
            raise RuntimeError("a worker failed to start")
    start = time.perf_counter()
    for child in children:
        child.stdin.write("go\n")
        child.stdin.flush()
    for child in children:
        child.communicate()
    return time.perf_counter() - start


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cpu_concurrency", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=1024, help="matmul size")
    p.add_argument("--repeats", type=int, default=20, help="matmuls per worker")
    p.add_argument("--rounds", type=int, default=2, help="runs of every row, alternating")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("needs at least 2 CPUs")
    half = len(cpus) // 2
    first, second = (",".join(map(str, part)) for part in (cpus[:half], cpus[half:2 * half]))
    one_thread = "--xla_cpu_multi_thread_eigen=false"
    ways = {  # name -> (one alone, two at once)
        "in one process (2 devices)": ([(1, "", "")], [(2, "", "")]),
        "in one process, multi_thread_eigen=false": ([(1, "", one_thread)],
                                                  [(2, "", one_thread)]),
        "two processes": ([(1, "", "")], [(1, "", ""), (1, "", "")]),
        "two bound processes": ([(1, first, "")], [(1, first, ""), (1, second, "")]),
    }
    walls = {name: ([], []) for name in ways}
    for _ in range(args.rounds):
        for name, (alone, both) in ways.items():
            walls[name][0].append(workers_wall(alone, args.size, args.repeats))
            walls[name][1].append(workers_wall(both, args.size, args.repeats))
    rows = [{"way": name, "one_alone_s": min(a), "two_at_once_s": min(b),
             "ratio": min(b) / min(a)} for name, (a, b) in walls.items()]
    table(f"two workers of {args.repeats} float32 {args.size}x{args.size} matmuls on "
          f"{len(cpus)} CPUs (best of {args.rounds}; ratio 1 = side by side, 2 = one after "
          "the other)", rows)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"context": {"cpus": len(cpus), **vars(args)}, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
