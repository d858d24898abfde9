"""`medha-jax demo` (what `make demo` runs): the convoy effect and its cure, live on the CPU.

1. Loads the embedded SmolLM2-135M-Instruct, compiles the engine's step shapes and fits
   the runtime predictor to this machine (once; both policies below reuse them).
2. Answers one question, so you see the model works.
3. Replays one heterogeneous request stream twice through a live Server: mostly short
   chats, a few long documents, Poisson arrivals (medha_jax.workloads, serving.replay),
   once with FCFS and whole, non-preemptive prefills (the convoy: every short request
   that arrives behind a long prompt waits for all of it) and once with the full Medha
   scheduler, lars-mp (slack-aware order, chunked preemptible prefills, and space
   sharing: short requests run beside the long one at once).
4. Prints TTFT and TPOT percentiles of short and long requests under each policy.

Lengths are scaled down from the paper's (seed 000, section 6.1) to what a 2-core CPU
prefills in seconds, keeping long prompts ~20x the short ones.
"""

from __future__ import annotations

import argparse
import sys
import time

DEMO_POLICIES = ("fcfs-np", "lars-mp")
QUESTION = "What is the capital of France? Answer in one sentence."
# A CPU step costs a few hundred ms, far above the 50 ms batch-time target meant for an
# accelerator; LARS's chunks are sized to this target, so it is set for the CPU here.
CPU_TARGET_BATCH_TIME_S = 0.5
# Short requests' deadline: a few CPU steps. Long requests get twice their predicted
# prefill time (SLOPolicy's default factor).
SHORT_TTFT_SLO_S = 1.0


def demo_engine_config():
    from medha_jax.engine import EngineConfig

    # Prefix caching off: both policies replay the same prompts, and the second must not
    # find the first one's pages in the cache.
    return EngineConfig(max_kv_tokens=8192, max_model_len=2048, max_tokens_per_step=256,
                        max_seqs=8, enable_prefix_caching=False)


def demo_workload(num_requests: int, seed: int = 5):
    """Seed 5 sends a 1900-token prompt at 9 s with eight short requests arriving in the
    10 s after it (the convoy's victims), and another at 31 s."""
    from medha_jax.workloads import WorkloadSpec, generate_workload

    return generate_workload(WorkloadSpec(
        num_requests=num_requests, qps=0.5, long_fraction=0.1, seed=seed,
        short_scale=0.05,          # ShareGPT4 prompts (median 1730 tokens) -> median ~90
        long_scale=0.004,          # Medha-SWE prompts (median 393K tokens) -> median ~1600
        output_scale=0.03,         # outputs (median ~415 tokens) -> median ~12
        max_prompt_tokens=1900, max_output_tokens=32))


def class_summary(summary: dict, request_class: str) -> dict:
    """TTFT/TPOT percentiles of one class ("short" or "long") from latency_report.summarize."""
    return {"ttft_p50": summary[f"{request_class}_ttft_p50"],
            "ttft_p99": summary[f"{request_class}_ttft_p99"],
            "tpot_p50": summary[f"{request_class}_tpot_p50"],
            "tpot_p99": summary[f"{request_class}_tpot_p99"],
            "completed": summary[f"{request_class}_completed"],
            "requests": summary[f"{request_class}_total"]}


TABLE_COLUMNS = (("ttft_p50", "ttft_p50_s"), ("ttft_p99", "ttft_p99_s"),
                 ("tpot_p50", "tpot_p50_s"), ("tpot_p99", "tpot_p99_s"),
                 ("completed", "completed"), ("requests", "requests"))


def main(quick: bool = False) -> int:
    from medha_jax.engine import Engine
    from medha_jax.engine.calibration import fit_predictor
    from medha_jax.latency_report import format_table, summarize
    from medha_jax.model import DEFAULT_MODEL, load_model
    from medha_jax.request import SLO
    from medha_jax.sampling_params import SamplingParams
    from medha_jax.scheduler import SchedulerConfig
    from medha_jax.workloads import SLOPolicy
    from serving.replay import replay_trace
    from serving.server import Server

    started = time.monotonic()
    print(f"== medha-jax demo: {DEFAULT_MODEL} on the CPU ==", flush=True)
    model = load_model(DEFAULT_MODEL)
    engine = Engine(model, demo_engine_config())
    engine.warmup(progress=True)
    print("fitting the runtime predictor to this machine ...", flush=True)
    predictor = fit_predictor(engine, repeats=1)
    print(f"  {predictor}", flush=True)
    # Deadlines this CPU can meet: one step alone takes a few hundred milliseconds.
    slo = SLO(ttft_s=SHORT_TTFT_SLO_S, tpot_s=CPU_TARGET_BATCH_TIME_S)
    slo_policy = SLOPolicy(short_ttft_s=SHORT_TTFT_SLO_S, long_ttft_factor=2.0, tpot_s=slo.tpot_s)
    server_args = dict(predictor=predictor, default_slo=slo, warmup=False)

    def scheduler(policy):
        return SchedulerConfig(policy, target_batch_time_s=CPU_TARGET_BATCH_TIME_S)

    print(f"\n-- one answer --\nQ: {QUESTION}\nA: ", end="", flush=True)
    with Server(engine, scheduler=scheduler("lars-mp"), **server_args) as server:
        prompt = model.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}])
        final = None
        for delta in server.generate_stream(prompt, SamplingParams(temperature=0.0,
                                                                   max_tokens=40)):
            print(delta.text, end="", flush=True)
            final = delta
        print(f"\n   ({final.metrics.num_output_tokens} tokens, TTFT "
              f"{final.metrics.ttft:.2f} s, TPOT {final.metrics.tpot * 1e3:.0f} ms)", flush=True)

    trace = demo_workload(10 if quick else 20)
    longs = [r for r in trace if r.is_long]
    print(f"\n-- the workload: {len(trace)} requests over {trace[-1].arrival_s:.0f} s "
          f"(Poisson); {len(longs)} long prompts of "
          f"{', '.join(str(r.prompt_tokens) for r in longs)} tokens, short prompts of "
          f"{min(r.prompt_tokens for r in trace if not r.is_long)}-"
          f"{max(r.prompt_tokens for r in trace if not r.is_long)} tokens --", flush=True)

    rows = {}
    for policy in DEMO_POLICIES:
        print(f"\nreplaying under {policy} ...", flush=True)
        with Server(engine, scheduler=scheduler(policy), **server_args) as server:
            records = replay_trace(server, trace, vocab_size=model.config.vocab_size,
                                   progress=True, slo_policy=slo_policy,
                                   prefill_time_s=server.controller.prefill_time_cache.prefill_time)
        failed = [r for r in records if not r.completed]
        if failed:
            print(f"  {len(failed)} requests failed, e.g. {failed[0].error}", flush=True)
        summary = summarize(records)
        rows[f"{policy} short"] = class_summary(summary, "short")
        rows[f"{policy} long"] = class_summary(summary, "long")

    fcfs, medha = rows["fcfs-np short"]["ttft_p99"], rows["lars-mp short"]["ttft_p99"]
    print(f"\nShort requests' p99 TTFT: {fcfs:.2f} s stuck behind whole long prefills "
          f"(fcfs-np, the convoy), {medha:.2f} s with the Medha scheduler ({fcfs / medha:.1f}x "
          f"lower; their deadline was {SHORT_TTFT_SLO_S:.1f} s).\nIt spends the long "
          f"requests' slack on the short ones, which run beside a long prefill at once."
          f"\nTotal {time.monotonic() - started:.0f} s.\n")
    print(format_table(rows, label="policy / class", columns=TABLE_COLUMNS))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smaller workload")
    sys.exit(main(quick=parser.parse_args().quick))
