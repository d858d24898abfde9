"""Scheduler overhead: host time to form one batch with 100, 1,000 and 10,000 queued requests.

    python -m benchmarks.scheduler_overhead [--quick] [--json FILE] [--policies lars-mp,lars]

Times batch formation (priority ordering of the queue, the decode phase, the adaptive
chunk searches on the predictor, KV reservations) inside real `ReplicaController.schedule()`
calls, as the controller itself measures it (`last_schedule_seconds`). The mix: N queued
requests waiting for their prefill (95% ShareGPT-like prompts, 5% of 128K-1M tokens,
arrivals spread over the last minute so slacks differ; each leaves at its first token and
is replaced by a new arrival, so the queue stays at N) beside --decodes requests that
decode throughout (default 64) in an engine of --max-seqs seats (default 256). Warm-up
steps run first and are not timed. Batches run on the simulator's executor (Llama-3 8B,
TP-8 on H100, analytical predictor), so the queue evolves as in service. Reports the
median over the timed steps.
Cost is O(decodes in the batch) + O(N) numpy work to rank the queue + a few chunk searches.
Target: median < 200 us at 1,000 queued and < 1 ms at 10,000.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import random
import statistics

from medha_jax.config import ParallelConfig, model_preset
from medha_jax.request import SLO, Request, VirtualClock
from medha_jax.scheduler import POLICY_NAMES, SchedulerConfig, make_controller, run_one_step
from medha_jax.scheduler.hardware import hardware_preset
from medha_jax.scheduler.predictor import AnalyticalPredictor
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
            timed_steps: int, seed: int = 0) -> dict:
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
    schedule_s, batch_decodes, batch_prefills, batch_tokens = [], [], [], []
    for step in range(warmup_steps + timed_steps):
        while controller.num_waiting + controller.num_running < queued + decodes:
            controller.add_request(_queued_request(added, rng, clock.now(), prefill_time))
            added += 1
        run_one_step(controller, executor)
        batch = executor.last_batch
        if step >= warmup_steps:
            # The controller times its own batch formation; execution is simulated.
            schedule_s.append(controller.last_schedule_seconds)
            batch_decodes.append(sum(c.is_decode for c in batch.chunks))
            batch_prefills.append(sum(not c.is_decode for c in batch.chunks))
            batch_tokens.append(batch.num_tokens)
    us = sorted(s * 1e6 for s in schedule_s)
    return {"policy": policy, "queued": queued, "median_us": statistics.median(us),
            "p90_us": us[int(0.9 * (len(us) - 1))], "min_us": us[0], "max_us": us[-1],
            "decodes_per_batch": statistics.median(batch_decodes),
            "prefills_per_batch": statistics.median(batch_prefills),
            "tokens_per_batch": statistics.median(batch_tokens), "steps": len(us)}


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
    args = parser.parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for p in policies:
        if p not in POLICY_NAMES:
            parser.error(f"unknown policy {p!r}; known: {', '.join(POLICY_NAMES)}")
    sizes = [int(s) for s in args.sizes.split(",")]
    args.warmup_steps = args.warmup_steps or (150 if args.quick else 400)
    args.timed_steps = args.timed_steps or (200 if args.quick else 1000)

    rows = [measure(p, n, decodes=args.decodes, max_seqs=args.max_seqs,
                    warmup_steps=args.warmup_steps, timed_steps=args.timed_steps)
            for p in policies for n in sizes]
    if args.json:
        primary = [r for r in rows if r["policy"] == policies[0]]
        with open(args.json, "w") as f:
            json.dump({"median_us": {str(r["queued"]): r["median_us"] for r in primary},
                       "policy": policies[0], "rows": rows, "context": _context(args)}, f, indent=2)

    columns = ["policy", "queued", "median_us", "p90_us", "min_us", "max_us", "decodes_per_batch",
               "prefills_per_batch", "tokens_per_batch"]
    print(f"scheduler overhead: host time per batch formation ({MODEL}, {PARALLEL}, {HARDWARE} "
          f"preset, analytical predictor, {args.decodes} decoding + N queued requests, "
          f"{args.timed_steps} timed steps)")
    print(" ".join(f"{c:>18}" for c in columns))
    for r in rows:
        print(" ".join(f"{r[c]:>18.1f}" if isinstance(r[c], float) else f"{r[c]:>18}"
                       for c in columns))


if __name__ == "__main__":
    main()
