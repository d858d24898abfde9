"""Scheduler overhead: host time to form one batch with 100, 1,000 and 10,000 queued requests.

    python -m benchmarks.scheduler_overhead [--quick] [--json FILE] [--policies lars-mp,lars]
        [--instructions] [--baseline DIR]

Times batch formation (priority ordering of the queue, the decode phase, the adaptive
chunk searches on the predictor, KV reservations) inside real `ReplicaController.schedule()`
calls, as the controller itself measures it (`last_schedule_seconds`). The mix: N queued
requests waiting for their prefill (95% ShareGPT-like prompts, 5% of 128K-1M tokens,
arrivals spread over the last minute so slacks differ; each leaves at its first token and
is replaced by a new arrival, so the queue stays at N) beside --decodes requests that
decode throughout (default 64) in an engine of --max-seqs seats (default 256). Warm-up
steps run first and are not timed. Batches run on the simulator's executor (Llama-3 8B,
TP-8 on H100, analytical predictor), so the queue evolves as in service. Reports the
p50 and p99 over the timed steps, of the wall time and of the thread's CPU time
(`time.thread_time`: on a shared machine the wall time also counts the other processes'
turns). state_us: the host time of what the serving loop of a routed replica reads of
the controller after every step for the router (`ServingLoop._observe_state`: the queued
prefills and the work queued; under lars-mp one copy of the index's SRPT keys, w(t), and
of its list of requests, the QueuedPrefill tuples built by the reader; a pass over the
queue otherwise; and the requests that decode, which a replica set that moves KV reads). --instructions counts the instructions of one schedule() under
callgrind (the mean over the timed steps; valgrind must be installed): deterministic,
what to compare on a noisy machine. --baseline DIR measures the same rows with DIR's medha_jax (e.g. a checkout of
main) in child processes, alternating with this checkout's, and prints the ratios.
Cost is O(decodes in the batch) + O(N) numpy work to rank the queue + a few chunk searches.
Target: p50 <= 100 us at 1,000 queued (issue 25; Tetris schedules in 23-87 us) and < 1 ms at
10,000.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import itertools
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time

from medha_jax.config import ParallelConfig, model_preset
from medha_jax.request import SLO, Request, VirtualClock
from medha_jax.scheduler import POLICY_NAMES, SchedulerConfig, make_controller, run_one_step
from medha_jax.scheduler.hardware import hardware_preset
from medha_jax.scheduler.predictor import AnalyticalPredictor, decode_token_seconds
from medha_jax.simulator import CountingAllocator, SimulatedExecutor, kv_capacity_tokens

MODEL = "llama3-8b"
HARDWARE = "h100"
PARALLEL = ParallelConfig(tp=8)
TOKEN_BUCKETS = tuple(16 * 2**i for i in range(10))          # 16 .. 8192
MAX_MODEL_LEN = 1_100_000


def _queued_request(i: int, rng: random.Random, now: float, prefill_time) -> Request:
    """A request waiting for its prefill: 95% ShareGPT-like, 5% 128K-1M tokens.

    It leaves at its first token (max_new_tokens=1) and is replaced, so the queue stays at
    N and the decode population stays the one of `_decoding_request`."""
    if rng.random() < 0.05:
        prompt = rng.randint(128_000, 1_000_000)
        ttft = 2.0 * prefill_time(prompt)
    else:
        prompt = min(8192, max(16, int(rng.lognormvariate(6.5, 1.0))))     # median ~660
        ttft = 2.0
    return Request(f"q{i}", prompt, 1, now - rng.uniform(0, 60.0), slo=SLO(ttft_s=ttft, tpot_s=0.2))


def _decoding_request(i: int, rng: random.Random, now: float) -> Request:
    """A chat that decodes for the whole benchmark (admitted first, urgent so it starts)."""
    return Request(f"d{i}", rng.randint(200, 8000), 100_000, now - 60.0,
                   slo=SLO(ttft_s=1.0, tpot_s=rng.choice([0.05, 0.1, 0.2])))


class _RecordingExecutor(SimulatedExecutor):
    """The simulator's executor, keeping the last batch for the batch-size columns."""

    last_batch = None

    def execute(self, batch):
        self.last_batch = batch
        return super().execute(batch)


def measure(policy: str, queued: int, *, decodes: int, max_seqs: int, warmup_steps: int,
            timed_steps: int, seed: int = 0, callgrind: bool = False) -> dict:
    """One row. callgrind: the timed schedule() calls go through itertools.starmap, where
    `instructions_per_schedule` has callgrind collect."""
    model = model_preset(MODEL)
    hardware = hardware_preset(HARDWARE)
    predictor = AnalyticalPredictor(model, PARALLEL, hardware, token_buckets=TOKEN_BUCKETS)
    clock = VirtualClock(60.0)
    capacity = kv_capacity_tokens(model, PARALLEL, hardware)
    executor = _RecordingExecutor(predictor, clock)
    controller = make_controller(
        SchedulerConfig(policy, token_buckets=TOKEN_BUCKETS, max_seqs_per_batch=max_seqs),
        allocator=CountingAllocator(capacity // 16, 16), clock=clock, predictor=predictor,
        model_config=model, max_model_len=MAX_MODEL_LEN)
    prefill_time = controller.prefill_time_cache.prefill_time
    rng = random.Random(seed)
    for i in range(decodes):
        controller.add_request(_decoding_request(i, rng, clock.now()))
    while len([r for r in controller.unfinished() if r.output_token_ids]) < decodes:
        run_one_step(controller, executor)
    added = 0
    schedule_s, cpu_s, batch_decodes, batch_prefills, batch_tokens = [], [], [], [], []
    state_s = []
    decode_token_s = decode_token_seconds(predictor, max_seqs)
    for step in range(warmup_steps + timed_steps):
        while controller.num_waiting + controller.num_running < queued + decodes:
            controller.add_request(_queued_request(added, rng, clock.now(), prefill_time))
            added += 1
        timed = step >= warmup_steps
        cpu_start = time.thread_time()
        if timed and callgrind:
            # Callgrind collects only inside starmap_next (--toggle-collect): schedule() alone.
            batch = next(itertools.starmap(type(controller).schedule, ((controller,),)))
        else:
            batch = controller.schedule()
        cpu = time.thread_time() - cpu_start
        if batch:
            controller.update(batch, executor.execute(batch))     # run_one_step's other half
        if timed and not callgrind:
            state_start = time.perf_counter()
            prefills = controller.queued_prefills()
            prefills.work_s + controller.decode_tokens_left * decode_token_s
            controller.decoding_requests()          # where the replica set moves KV
            state_s.append(time.perf_counter() - state_start)
        if timed:
            # The controller times its own batch formation (wall); execution is simulated.
            schedule_s.append(controller.last_schedule_seconds)
            cpu_s.append(cpu)
            batch_decodes.append(sum(c.is_decode for c in batch.chunks))
            batch_prefills.append(sum(not c.is_decode for c in batch.chunks))
            batch_tokens.append(batch.num_tokens)
    us, cpu_us = sorted(s * 1e6 for s in schedule_s), sorted(s * 1e6 for s in cpu_s)
    return {"policy": policy, "queued": queued, "median_us": statistics.median(us),
            "p99_us": _percentile(us, 0.99), "min_us": us[0], "max_us": us[-1],
            "cpu_p50_us": statistics.median(cpu_us), "cpu_p99_us": _percentile(cpu_us, 0.99),
            "cpu_min_us": cpu_us[0],
            "state_us": statistics.median(state_s) * 1e6 if state_s else None,
            "decodes_per_batch": statistics.median(batch_decodes),
            "prefills_per_batch": statistics.median(batch_prefills),
            "tokens_per_batch": statistics.median(batch_tokens), "steps": len(us)}


def _percentile(ordered: list[float], q: float) -> float:
    return ordered[round(q * (len(ordered) - 1))]


def _child_command(args, policy: str, queued: int, extra: list[str]) -> list[str]:
    """This file run for one row, printing it as JSON (the checkout on PYTHONPATH decides
    whose medha_jax it measures)."""
    return [sys.executable, os.path.abspath(__file__), "--policies", policy, "--sizes",
            str(queued), "--decodes", str(args.decodes), "--max-seqs", str(args.max_seqs),
            "--warmup-steps", str(args.warmup_steps), "--timed-steps", str(args.timed_steps),
            "--row-json", *extra]


def _run_child(command: list[str], checkout: str, prefix: list[str] = ()) -> tuple[dict, str]:
    env = dict(os.environ, PYTHONPATH=checkout, PYTHONHASHSEED="0")
    done = subprocess.run([*prefix, *command], cwd=checkout, env=env, capture_output=True,
                          text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} in {checkout} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def instructions_per_schedule(args, policy: str, queued: int, checkout: str) -> float:
    """Instructions of one schedule() (mean over the timed steps), counted by callgrind."""
    with tempfile.TemporaryDirectory() as tmp:
        prefix = ["valgrind", "--tool=callgrind", "--collect-atstart=no",
                  "--toggle-collect=starmap_next", f"--callgrind-out-file={tmp}/callgrind.out"]
        row, log = _run_child(_child_command(args, policy, queued, ["--callgrind-child"]),
                              checkout, prefix)
    collected = re.search(r"Collected\s*:\s*(\d+)", log)
    if collected is None:
        raise RuntimeError(f"no instruction count in callgrind's output:\n{log[-2000:]}")
    return int(collected.group(1)) / row["steps"]


def _context(args) -> dict:
    def version(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {"what": "host time of batch formation (ReplicaController.last_schedule_seconds); "
                    "no device work",
            "backend": "host python (the scheduler imports no JAX)",
            "python": platform.python_version(), "platform": platform.platform(),
            "cpu_count": os.cpu_count(), "load_average_1m": os.getloadavg()[0], "jax": version("jax"), "jaxlib": version("jaxlib"),
            "numpy": version("numpy"), "model": MODEL, "dtype": model_preset(MODEL).dtype,
            "parallel": str(PARALLEL), "hardware_preset": HARDWARE,
            "predictor": "AnalyticalPredictor (simulated execution)",
            "token_buckets": list(TOKEN_BUCKETS), "max_seqs_per_batch": args.max_seqs,
            "running_decodes": args.decodes,
            "warmup_steps": args.warmup_steps, "timed_steps": args.timed_steps,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="fewer steps (about a minute on 2 cores)")
    parser.add_argument("--json", metavar="FILE", help="write every figure and the context as JSON")
    parser.add_argument("--policies", default="lars-mp,lars",
                        help=f"comma list from {', '.join(POLICY_NAMES)}; "
                             f"the first one fills median_us")
    parser.add_argument("--sizes", default="100,1000,10000", help="queued requests, comma list")
    parser.add_argument("--decodes", type=int, default=64, help="requests decoding throughout")
    parser.add_argument("--max-seqs", type=int, default=256, help="sequences per step")
    parser.add_argument("--warmup-steps", type=int, default=None)
    parser.add_argument("--timed-steps", type=int, default=None)
    parser.add_argument("--instructions", action="store_true",
                        help="also count instructions per schedule() under callgrind (slow: "
                             "minutes per row)")
    parser.add_argument("--baseline", metavar="DIR",
                        help="a checkout (e.g. of main) measured side by side: each row runs "
                             "in child processes, alternating with this checkout's")
    parser.add_argument("--rounds", type=int, default=3,
                        help="with --baseline: alternations per row (the median is kept)")
    parser.add_argument("--row-json", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--callgrind-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for p in policies:
        if p not in POLICY_NAMES:
            parser.error(f"unknown policy {p!r}; known: {', '.join(POLICY_NAMES)}")
    sizes = [int(s) for s in args.sizes.split(",")]
    args.warmup_steps = args.warmup_steps or (150 if args.quick else 400)
    args.timed_steps = args.timed_steps or (200 if args.quick else 1000)
    if args.callgrind_child:          # under valgrind: fewer steps, the count is exact anyway
        args.timed_steps = min(args.timed_steps, 50)

    def one(policy, n):
        return measure(policy, n, decodes=args.decodes, max_seqs=args.max_seqs,
                       warmup_steps=args.warmup_steps, timed_steps=args.timed_steps,
                       callgrind=args.callgrind_child)

    if args.row_json:
        print(json.dumps(one(policies[0], sizes[0])))
        return
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rows = []
    for policy in policies:
        for n in sizes:
            if args.baseline:
                runs = {"": [], "base_": []}
                for _ in range(args.rounds):
                    for prefix, checkout in (("", here), ("base_", args.baseline)):
                        runs[prefix].append(_run_child(_child_command(args, policy, n, []),
                                                       checkout)[0])
                row = {k: statistics.median(r[k] for r in runs[""]) if isinstance(v, float)
                       else v for k, v in runs[""][0].items()}
                for k in ("median_us", "p99_us", "cpu_p50_us", "cpu_p99_us", "cpu_min_us"):
                    row["base_" + k] = statistics.median(r[k] for r in runs["base_"])
                row["speedup_cpu_p50"] = row["base_cpu_p50_us"] / row["cpu_p50_us"]
            else:
                row = one(policy, n)
            if args.instructions:
                row["instructions"] = instructions_per_schedule(args, policy, n, here)
                if args.baseline:
                    row["base_instructions"] = instructions_per_schedule(args, policy, n,
                                                                         args.baseline)
                    row["speedup_instructions"] = row["base_instructions"] / row["instructions"]
            rows.append(row)
    if args.json:
        primary = [r for r in rows if r["policy"] == policies[0]]
        with open(args.json, "w") as f:
            json.dump({"median_us": {str(r["queued"]): r["median_us"] for r in primary},
                       "policy": policies[0], "rows": rows, "context": _context(args)}, f, indent=2)

    columns = ["policy", "queued", "median_us", "p99_us", "cpu_p50_us", "cpu_p99_us", "cpu_min_us",
               "state_us"]
    if args.instructions:
        columns.append("instructions")
    if args.baseline:
        columns += ["base_median_us", "base_cpu_p50_us", "speedup_cpu_p50"]
        if args.instructions:
            columns += ["base_instructions", "speedup_instructions"]
    columns += ["decodes_per_batch", "prefills_per_batch", "tokens_per_batch"]
    print(f"scheduler overhead: host time per batch formation ({MODEL}, {PARALLEL}, {HARDWARE} "
          f"preset, analytical predictor, {args.decodes} decoding + N queued requests, "
          f"{args.timed_steps} timed steps; median_us = wall p50, cpu_* = thread CPU time"
          + (f"; base_* = {args.baseline}, median of {args.rounds} alternations"
             if args.baseline else "") + ")")
    print(" ".join(f"{c:>15}" for c in columns))
    for r in rows:
        print(" ".join(f"{r[c]:>15.2f}" if c.startswith("speedup") else
                       f"{r[c]:>15.1f}" if isinstance(r[c], float) else f"{r[c]:>15}"
                       for c in columns))


if __name__ == "__main__":
    main()
