"""Stream pipeline parallelism (SPP, seed 000 section 3.3, figure 5): one long prefill.

    python -m benchmarks.spp --quick                 # about a minute on a 2-core CPU
    python -m benchmarks.spp --json results/spp.json

Three parts, a markdown table each (benchmarks.report.table), the simulated one last:

(a) simulated: the prefill time of one request of 128K to 1M tokens for spp = 1 .. 16 at
    tp = 8 (Llama-3.1 8B and 70B, the H100 preset), from `AnalyticalPredictor`. The prompt
    runs as chunks of --chunk tokens through the simulator's pipelined executor
    (medha_jax.simulator.SimulatedExecutor): the predictor prices a chunk's time in one
    stage (layers / spp and the hand-off), chunk i + 1 enters stage 0 while chunk i is in
    stage 1, and the prompt is done when its last chunk leaves the last stage. Scaling
    efficiency is T(spp = 1) / (spp x T(spp)). Next to it, ring context parallelism on the same device
    count (cp = spp, tp = 8) from the same predictor: in the same chunks, and one-shot (the
    whole prompt in one step, how ring CP is usually run). Positions past the models'
    128K window are priced as if the window were longer: a cost model, not a served run.
(b) measured on this machine (virtual CPU devices, or the accelerator): a long prefill of
    the tiny model through medha_jax.engine.pipeline at spp = 1 and 2, every chunk
    dispatched before any is waited on, side by side; the ratio is spp = 1 time over spp = 2
    time. Two CPU cores bound what two virtual devices can run at once.
(c) measured on this machine: host time on the critical path per step (the engine's
    `last_host_seconds`: host work while none of the engine's steps was queued on the
    device, plus reading tokens back) for a long prefill beside short chats, served by the
    real controller through `InFlightRunner`: spp = 1 with one batch in flight (no
    overlap), spp = 1 with two (the host forms and builds step n + 1 while step n runs),
    and spp = 2 with two; side by side, median over steps. On a GPU this is the issue's
    part (c).

spp = 2 needs two devices: on one (a single GPU) its rows are left out, with a note, and
the spp = 1 rows still run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Sequence

from benchmarks.report import environment, table

K = 1024
MEASURED_SPP = (1, 2)


def measurable_spp(device_count: int) -> tuple[tuple[int, ...], list[str]]:
    """The measured spp degrees this machine can run, and a note for each left out."""
    run = tuple(spp for spp in MEASURED_SPP if spp <= device_count)
    notes = [f"spp={spp} skipped: needs >= {spp} devices, this machine has {device_count}"
             for spp in MEASURED_SPP if spp > device_count]
    return run, notes


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.spp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer sizes; about a minute on a CPU")
    p.add_argument("--json", default=None, help="write every figure and the context here")
    p.add_argument("--hardware", default="h100", help="hardware preset of the simulation")
    p.add_argument("--tp", type=int, default=8, help="tensor parallelism of the simulation")
    p.add_argument("--chunk", type=int, default=4096, help="prefill chunk of the simulation")
    p.add_argument("--measured-tokens", type=int, default=None,
                   help="prompt of the measured prefill (default 16384, 4096 with --quick)")
    p.add_argument("--measured-chunk", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    return p.parse_args(argv)


# ------------------------------------------------------------------------------ simulated

def simulated_prefill_s(predictor, prompt_tokens: int, chunk: int, stages: int = 1) -> float:
    """When one prompt, in chunks dispatched back to back, leaves the last of `stages`
    pipeline stages (the simulator's executor); the last chunk samples."""
    from medha_jax.request import Batch, Request, ScheduledChunk, VirtualClock
    from medha_jax.simulator import SimulatedExecutor

    executor = SimulatedExecutor(predictor, VirtualClock(), stages)
    request = Request("prompt", prompt_tokens, 1, 0.0)
    done = 0.0
    for start in range(0, prompt_tokens, chunk):
        n = min(chunk, prompt_tokens - start)
        done = executor.dispatch(Batch([ScheduledChunk(request, start, n)])).done_time
    return done


def run_simulated(args) -> list[dict]:
    from medha_jax.config import ParallelConfig, model_preset
    from medha_jax.scheduler.predictor import AnalyticalPredictor

    models = ("llama3.1-8b",) if args.quick else ("llama3.1-8b", "llama3.1-70b")
    prompts = (128 * K, 1024 * K) if args.quick else (128 * K, 256 * K, 512 * K, 1024 * K)
    degrees = (1, 2, 4, 8, 16)
    rows = []
    for name in models:
        model = model_preset(name)
        for prompt in prompts:
            def prefill(chunk: int, **axes) -> float:
                predictor = AnalyticalPredictor(model, ParallelConfig(tp=args.tp, **axes),
                                                args.hardware)
                return simulated_prefill_s(predictor, prompt, chunk, axes.get("spp", 1))

            base, one_shot_base = prefill(chunk=args.chunk), prefill(chunk=prompt)
            for degree in degrees:
                if model.num_layers % degree:
                    continue
                spp_s = prefill(chunk=args.chunk, spp=degree)
                cp_s = prefill(chunk=args.chunk, cp=degree)
                cp_one_shot_s = prefill(chunk=prompt, cp=degree)
                rows.append({
                    "part": "simulated", "model": name, "prompt_tokens": prompt,
                    "devices": degree * args.tp, "spp": degree, "tp": args.tp,
                    "spp_prefill_s": spp_s, "spp_efficiency": base / (degree * spp_s),
                    "cp_prefill_s": cp_s, "cp_efficiency": base / (degree * cp_s),
                    "cp_one_shot_s": cp_one_shot_s,
                    "cp_one_shot_efficiency": one_shot_base / (degree * cp_one_shot_s),
                    "spp_over_cp": spp_s / cp_s})
    return rows


# ------------------------------------------------------------------------------- measured

def prefill_inputs(prompt_tokens: int, chunk: int, page_size: int = 16):
    """StepInputs of each chunk of one random prompt, pages reserved in a fresh allocator."""
    import numpy as np

    from medha_jax.buckets import BucketLadder
    from medha_jax.engine.step_inputs import build_step_inputs
    from medha_jax.kv_cache.allocator import BlockAllocator
    from medha_jax.request import Batch, Request, ScheduledChunk

    num_pages = -(-prompt_tokens // page_size)
    allocator = BlockAllocator(num_pages, page_size, enable_prefix_caching=False)
    ladder = BucketLadder.from_limits(max_tokens=chunk, min_tokens=chunk, max_seqs=1,
                                      min_seqs=1, max_pages_per_seq=num_pages,
                                      min_pages_per_seq=num_pages)
    ids = np.random.default_rng(0).integers(0, 256, prompt_tokens).tolist()
    request = Request("prompt", prompt_tokens, 1, 0.0, prompt_token_ids=ids)
    allocator.allocate(request.request_id)
    assert allocator.reserve(request.request_id, prompt_tokens)
    steps = []
    for start in range(0, prompt_tokens, chunk):
        n = min(chunk, prompt_tokens - start)
        steps.append(build_step_inputs(Batch([ScheduledChunk(request, start, n)]), allocator,
                                       ladder, pad_slot=num_pages * page_size))
    return steps, num_pages, page_size


def run_measured(args, degrees: Sequence[int]) -> list[dict]:
    import jax

    from medha_jax.engine.pipeline import PipelinedStep
    from medha_jax.model.loading import load_model
    from medha_jax.model.stages import split_stages
    from meshes import ParallelConfig

    prompt = args.measured_tokens or (4096 if args.quick else 16384)
    steps, num_pages, page_size = prefill_inputs(prompt, args.measured_chunk)
    pipelines = {}
    for spp in degrees:
        model = load_model("tiny", parallel=ParallelConfig(spp=spp), verbose=False)
        pipeline = PipelinedStep(split_stages(model), num_pages=num_pages, page_size=page_size)
        pipeline.warmup({inputs.padded_shape for inputs in steps})
        pipelines[spp] = pipeline

    def prefill_seconds(pipeline) -> float:
        start = time.perf_counter()
        tokens = [pipeline.dispatch(inputs) for inputs in steps]    # all chunks in flight
        jax.block_until_ready(tokens)
        return time.perf_counter() - start

    times = {spp: [] for spp in pipelines}
    for spp, pipeline in pipelines.items():
        prefill_seconds(pipeline)                                   # warm-up run
    for _ in range(args.repeats):                                   # side by side, interleaved
        for spp, pipeline in pipelines.items():
            times[spp].append(prefill_seconds(pipeline))
    rows = []
    for spp, measured in times.items():
        median = statistics.median(measured)
        rows.append({
            "part": "measured", "model": "tiny", "prompt_tokens": prompt,
            "devices": spp, "spp": spp, "tp": 1, "chunk": args.measured_chunk,
            "prefill_s": median, "prefill_min_s": min(measured), "prefill_max_s": max(measured),
            "tok_per_s": prompt / median,
            "speedup_vs_spp1": statistics.median(times[1]) / median})
    return rows


def run_host_overlap(args, degrees: Sequence[int]) -> list[dict]:
    """Host time on the critical path per step, with and without batches in flight."""
    from medha_jax.config import model_preset
    from medha_jax.engine import Engine, EngineConfig
    from medha_jax.model.loading import load_model
    from medha_jax.request import Request, WallClock
    from medha_jax.sampling_params import SamplingParams
    from medha_jax.scheduler import SchedulerConfig, make_controller
    from medha_jax.scheduler.in_flight import InFlightRunner
    from medha_jax.scheduler.predictor import AnalyticalPredictor
    from meshes import ParallelConfig
    import numpy as np

    long_tokens = 1024 if args.quick else 4096
    variants = [("spp=1, 1 in flight", 1, 1), ("spp=1, 2 in flight", 1, 2),
                ("spp=2, 2 in flight", 2, None)]
    variants = [v for v in variants if v[1] in degrees]
    engines = {}
    for name, spp, in_flight in variants:
        engine = Engine(load_model("tiny", parallel=ParallelConfig(spp=spp), verbose=False),
                        EngineConfig(max_kv_tokens=8192, max_tokens_per_step=128,
                                     min_token_bucket=64, max_seqs=8, max_model_len=4352,
                                     max_batches_in_flight=in_flight,
                                     enable_prefix_caching=False))
        engine.warmup(progress=False)
        engines[name] = engine

    def serve(engine) -> tuple[list[float], float, int]:
        config = model_preset("tiny")
        buckets = engine.ladder.token_buckets
        controller = make_controller(
            SchedulerConfig("lars-mp", token_buckets=buckets, max_seqs_per_batch=engine.max_seqs),
            allocator=engine.allocator, clock=WallClock(),
            predictor=AnalyticalPredictor(config, ParallelConfig(), "h100", token_buckets=buckets),
            model_config=config, max_model_len=engine.max_model_len)
        rng = np.random.default_rng(0)
        prompts = [long_tokens] + [32] * 6
        for i, n in enumerate(prompts):
            controller.add_request(Request(
                f"r{i}", n, 16, 0.0, prompt_token_ids=rng.integers(0, 256, n).tolist(),
                sampling=SamplingParams(temperature=0.0, max_tokens=16)))
        runner, host, steps = InFlightRunner(controller, engine), [], 0
        start = time.perf_counter()
        while controller.has_unfinished():
            runner.step()
            host.append(engine.last_host_seconds)
            steps += 1
        return host, time.perf_counter() - start, steps

    for engine in engines.values():
        serve(engine)                                               # warm-up run
    results = {name: [] for name in engines}
    for _ in range(args.repeats):                                   # side by side, interleaved
        for name, engine in engines.items():
            results[name].append(serve(engine))
    rows = []
    for name, runs in results.items():
        host = [h for run in runs for h in run[0]]
        walls = [run[1] for run in runs]
        rows.append({"part": "host_overlap", "variant": name, "model": "tiny",
                     "long_prompt_tokens": long_tokens, "steps": runs[0][2],
                     "host_critical_ms_per_step": 1e3 * statistics.median(host),
                     "host_critical_p90_ms": 1e3 * float(np.percentile(host, 90)),
                     "wall_s": statistics.median(walls)})
    base = rows[0]["host_critical_ms_per_step"]
    for row in rows:
        row["host_critical_vs_no_overlap"] = row["host_critical_ms_per_step"] / base
    return rows


# --------------------------------------------------------------------------------- report

def print_tables(simulated: list[dict], measured: list[dict], overlap: list[dict],
                 notes: list[str], args) -> None:
    """The measured parts, then the simulated one last."""
    import jax

    backend, skipped = jax.default_backend(), "".join(f"; {note}" for note in notes)
    table(f"(b) measured: one {measured[0]['prompt_tokens']}-token prefill in chunks of "
          f"{args.measured_chunk}, tiny model, float32, {backend}, median of {args.repeats}"
          f"{skipped}",
          [{k: row[k] for k in ("spp", "devices", "prefill_s", "prefill_min_s", "prefill_max_s",
                                "tok_per_s", "speedup_vs_spp1")} for row in measured])
    table(f"(c) measured: host time on the critical path per step, a "
          f"{overlap[0]['long_prompt_tokens']}-token prefill beside 6 chats, real controller, "
          f"tiny model, {backend}, median over the steps of {args.repeats} runs{skipped}",
          [{k: row[k] for k in ("variant", "steps", "host_critical_ms_per_step",
                                "host_critical_p90_ms", "host_critical_vs_no_overlap", "wall_s")}
           for row in overlap])
    table(f"(a) simulated: one prefill, AnalyticalPredictor, hardware preset {args.hardware}, "
          f"tp={args.tp}, chunks of {args.chunk} tokens",
          [{k: row[k] for k in ("model", "prompt_tokens", "devices", "spp_prefill_s",
                                "spp_efficiency", "cp_prefill_s", "cp_efficiency",
                                "cp_one_shot_s", "cp_one_shot_efficiency")} for row in simulated])


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    # Virtual CPU devices for the measured part; JAX reads this when it starts its back-end.
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_force_host_platform_device_count=2").strip()
    import jax

    degrees, notes = measurable_spp(jax.device_count())
    measured = run_measured(args, degrees)
    overlap = run_host_overlap(args, degrees)
    simulated = run_simulated(args)
    report = {"context": {**environment(), "dtype": "float32 (measured); bfloat16 (simulated)",
                          "mesh": "spp x tp; replica = spp slices of tp devices",
                          "predictor": f"AnalyticalPredictor ({args.hardware}), simulated",
                          "args": vars(args)},
              "measured": measured, "host_overlap": overlap, "simulated": simulated,
              "skipped": notes}
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    print_tables(simulated, measured, overlap, notes, args)
    return report


if __name__ == "__main__":
    main()
