"""Prefill/decode disaggregation on this machine (seeds 003, 001): two replicas in one
process, one Server, the offload gate switched between runs.

    python -m benchmarks.disagg --quick              # a few minutes on a 2-core CPU
    python -m benchmarks.disagg --json results/disagg.json

Six tables:

(a) transfer bandwidth: `PageCopier` (gather on replica 0's devices, `jax.device_put` to
    replica 1's, scatter there) of N pages, waited for; median of --repeats copies. And
    between processes (serving.kv_wire): a replica in a child process offers N pages
    (gathered ahead), replica 1 pulls them over `jax.experimental.transfer` and scatters.
(b) the hand-off's gap: one long prompt at a time, prefilled on replica 0 and decoded on
    replica 1, streamed (pages move after each chunk's step) vs shipped at the end (every
    page after the prefill), against co-located; gap = arrival of token 2 - arrival of
    token 1 at the client (the decode's start on the other replica: the transfer's exposed
    part + the handshake's ack + the first decode step), next to one prefill chunk's time
    (prefill seconds / chunks).
(c) seed 003's H8 experiment at this scale: --sessions concurrent multi-turn sessions
    (closed loop: a session's next turn right after its last), every --heavy-every-th HEAVY (a
    cold first turn of --heavy-tokens new tokens), the rest WARM (--warm-tokens); every
    later turn adds --turn-tokens. With --heavy-turn spread the HEAVY tokens come in a
    later turn of a session that began WARM, HEAVY sessions at different turns: the
    HEAVY prefills land one replica at a time, so the other has room for a decode the
    prefilling one would slow (the case where offloading can pay). Per gate (co-located
    = never, always-offload, cached-fraction >= 0.3, time comparison; the time gate
    priced at the in-process link speed measured as in (a), also when (a) is skipped):
    TTFT p50, decode TPOT p90 (over requests, each request's mean seconds per output
    token after the first), requests the gate decided to offload and those that moved (a
    mixed prefill replica whose first token came before the decode side's grant decodes
    the request itself), the router's predicted TTFT over the measured one (p10, p50),
    and each gate's TTFT p50 and TPOT p90 less co-located's with a 90% bootstrap interval
    (resampling a session's turns in a round).
    After one unmeasured round (the predictor is refined online from served steps),
    --h8-rounds rounds of all gates, the order rotated each round.
(d) H6: the next turn's cached share of its prompt after a disaggregated turn vs after a
    co-located one (turns of (c)).
(f) the hand-off between replicas that are Ray actors (serving.ray_handoff; needs the
    [cluster] extra, else skipped): one long prompt at a time on a prefill:1,decode:1 pair
    of actors (pages pulled over serving.kv_wire by the decode actor while the prefill
    runs) vs on one actor alone; TTFT p50, gap token 1 -> 2 p50, page chunks moved.
(g) (c) again over two replicas that are Ray actors, each bound to its own CPUs
    (`cpu_binding="auto"`; needs the [cluster] extra, else skipped). In one process each
    replica's steps spread over every core (no XLA flag keeps them to one:
    benchmarks.cpu_concurrency), so in (c) a decode moved off a prefilling replica still
    shares the cores with that replica's prefill steps: there is no second machine for
    it to go to. Here each replica computes on its own core. The time gate is priced at
    the between-process link of (a) (kv_wire's pull), measured again when (a) is
    skipped. Also per gate: the decode seconds (tokens after the first) of the plan each
    request took, as the gate predicted them and as measured. --decode-delay-weight sets
    the router's RoutingConfig.decode_delay_weight for every gate.
(e) the same experiment simulated at --sim-replicas replicas (llama3-8b, one H100 each,
    the analytical predictor, real prefix caches; `simulate(offload=...)` models the
    handshake and the transfer): sessions whose first turn is HEAVY (20K cold tokens, half
    of them) or WARM (2K), later turns +500 tokens 1-2 s apart, 200-token answers, sessions
    starting over 10 s; per gate and link (NVLink 450 GB/s a direction, 200 Gb/s = 25 GB/s): TTFT
    p50/p90, TPOT p90, offloaded, the prefill side's prefix hit rate.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import random
import statistics
import threading
import time
from collections.abc import Sequence

from benchmarks.report import environment, table


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.disagg", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model, fewer sessions")
    p.add_argument("--json", default=None, help="write every figure and the context here")
    p.add_argument("--model", default=None, help="model preset (default smollm2-135m; "
                                                 "--quick tiny)")
    p.add_argument("--sessions", type=int, default=None, help="(c) sessions (default 12; "
                                                               "--quick 6)")
    p.add_argument("--turns", type=int, default=None, help="(c) turns per session (4; 3)")
    p.add_argument("--heavy-tokens", type=int, default=None, help="(c) HEAVY first turn")
    p.add_argument("--warm-tokens", type=int, default=64, help="(c) WARM first turn")
    p.add_argument("--heavy-every", type=int, default=3,
                   help="(c) sessions 0, K, 2K, ... are HEAVY (default 3: a third)")
    p.add_argument("--turn-tokens", type=int, default=32, help="(c) new tokens a later turn")
    p.add_argument("--heavy-turn", choices=("first", "spread"), default="first",
                   help="(c), (g) the turn a HEAVY session's cold tokens arrive in: first "
                        "(seed 003's H8: every HEAVY prefill at the start, on both replicas "
                        "at once) or spread (HEAVY session j's turn 1 + j mod (turns - 1), "
                        "its first turn WARM: a document pasted into a running chat, so "
                        "the HEAVY prefills come one replica at a time)")
    p.add_argument("--output-tokens", type=int, default=None, help="(c) tokens per answer")
    p.add_argument("--prompt-tokens", type=int, default=None,
                   help="(b), (f) the long prompt (default 1540; --quick 1030)")
    p.add_argument("--repeats", type=int, default=None, help="(a), (b) repetitions")
    p.add_argument("--gates", default="never,always,cached-fraction,time",
                   help="(c) gates, comma-separated")
    p.add_argument("--decode-delay-weight", type=float, default=None,
                   help="(e), (g) the router's RoutingConfig.decode_delay_weight (default: "
                        "its own)")
    p.add_argument("--ttft-floor", action="store_true",
                   help="(e), (g) the router's RoutingConfig.ttft_floor")
    p.add_argument("--h8-rounds", type=int, default=2,
                   help="(c) rounds of every gate after an unmeasured warm-up round, the "
                        "order rotated each round")
    p.add_argument("--sim-replicas", type=int, default=16, help="(e) simulated replicas")
    p.add_argument("--sim-sessions", type=int, default=None,
                   help="(e) sessions (default 96; --quick 48)")
    p.add_argument("--skip", default="", help="parts to skip, e.g. a,b")
    return p.parse_args(argv)


def percentile(values, q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def engine_config(quick: bool):
    from medha_jax.engine import EngineConfig

    return EngineConfig(page_size=16, max_kv_tokens=16_384, max_model_len=2048,
                        max_tokens_per_step=128 if quick else 256, max_seqs=16 if quick else 8)


def scheduler_config(args):
    """lars-mp at a 0.2 s batch budget, its IsLong (Algorithm 2) at half the HEAVY turn.

    Seed 000's 8192 tokens is past this engine's max_model_len (2048): no prompt here would
    be long, so lars-mp's riders would never run, and a short turn queued beside a HEAVY
    prefill (5 s of prefill on one core, ~15 chunk steps) waited in LARS order until its
    relative slack fell below the HEAVY one's, near its 10 s TTFT SLO (in one run of (g)
    10 short turns waited 9.5-10.3 s). Half the HEAVY turn puts it long and every prompt of
    a session without one (at most warm + (turns - 1) x (turn + output) tokens, 256 by
    default) short."""
    from medha_jax.scheduler.config import SchedulerConfig

    return SchedulerConfig("lars-mp", target_batch_time_s=0.2,
                           long_prefill_tokens=args.heavy_tokens // 2)


def make_server(args):
    from medha_jax.cluster.offload import OffloadConfig
    from medha_jax.model import load_model
    from serving.server import Server

    model = load_model(args.model, verbose=False)
    # Transfers on from the start (a gate other than never); each run sets its own gate.
    return Server(model, engine_config=engine_config(args.quick), replicas=2, warmup=True,
                  scheduler=scheduler_config(args),
                  offload=OffloadConfig("always-heavy", heavy_new_tokens=1),
                  metrics_port=None)


def gate_config(name: str, server):
    from medha_jax.cluster.offload import OffloadConfig

    # "<gate>+move": running decodes move too (OffloadConfig.move_decodes; Ray only).
    name, plus, _ = name.partition("+move")
    if name == "always":
        return OffloadConfig("always-heavy", heavy_new_tokens=1, move_decodes=bool(plus))
    return OffloadConfig(name, link_bytes_per_s=server._measured_link_bytes_per_s,
                         move_decodes=bool(plus))


def bandwidth(args, server, between_processes: bool = True) -> list[dict]:
    """Part (a); it also sets the link speed the time gate of (c) is priced at (the
    in-process copy's, the link (c)'s hand-offs use)."""
    import jax
    import numpy as np

    copier = server._replica_set.transfers._copier(0, 1)
    source, destination = server.replicas[0].engine, server.replicas[1].engine
    k = source.kv_cache.k
    page_bytes = 2 * k.shape[0] * k.shape[2] * k.shape[3] * k.dtype.itemsize
    rows = []

    def row(path, pages, seconds):
        s = statistics.median(seconds[1:])
        rows.append({"path": path, "pages": pages, "MB": pages * page_bytes / 1e6,
                     "copy_ms": 1e3 * s, "GB_per_s": pages * page_bytes / s / 1e9})

    # Between requests nothing else touches the caches; the loops are idle.
    for pages in PAGE_COUNTS:
        ids = np.arange(pages)
        seconds = []
        for _ in range(args.repeats + 1):
            start = time.perf_counter()
            copier.write(ids + 300, copier.read(ids))
            jax.block_until_ready(destination.kv_cache.k)
            seconds.append(time.perf_counter() - start)
        row("in process", pages, seconds)
    server._measured_link_bytes_per_s = rows[-1]["GB_per_s"] * 1e9
    if between_processes:
        for pages, seconds in wire_pulls(args, destination):
            row("between processes", pages, seconds)
    return rows


def wire_pulls(args, destination) -> list[tuple[int, list[float]]]:
    """A replica in a child process offers PAGE_COUNTS pages, `destination` (an Engine)
    pulls them over serving.kv_wire and scatters them: [(pages, seconds of each pull)]."""
    import jax
    import numpy as np

    from serving.kv_wire import PageReceiver

    receiver = PageReceiver(destination)
    pulls = []
    with page_sender_process(args) as wires:
        for pages in PAGE_COUNTS:
            seconds = []
            for wire in wires[str(pages)]:
                start = time.perf_counter()
                receiver.receive(wire, np.arange(pages) + 300)
                jax.block_until_ready(destination.kv_cache.k)
                seconds.append(time.perf_counter() - start)
            pulls.append((pages, seconds))
    return pulls


PAGE_COUNTS = (8, 64, 256)

# A replica in a child process that offers PAGE_COUNTS pages (repeats + 1 times each) over
# serving.kv_wire, prints the WireChunks, and keeps them offered until stdin closes.
_SENDER = """
import dataclasses, json, sys
import numpy as np
from benchmarks.disagg import PAGE_COUNTS, engine_config
from medha_jax.engine import Engine
from medha_jax.model import load_model
from serving.kv_wire import PageSender
model, quick, repeats = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
sender = PageSender(Engine(load_model(model, verbose=False), engine_config(quick)))
wires = {n: [dataclasses.asdict(sender.send(np.arange(n))) for _ in range(repeats + 1)]
         for n in PAGE_COUNTS}
print(json.dumps(wires), flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def page_sender_process(args):
    """The child's offers: {str(pages): [WireChunk, ...]}; the child ends on exit."""
    from benchmarks.report import json_line_child
    from serving.kv_wire import WireChunk

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    argv = [args.model, "1" if args.quick else "0", str(args.repeats)]
    with json_line_child(_SENDER, argv, env) as offered:
        yield {n: [WireChunk.from_dict(w) for w in ws] for n, ws in offered.items()}


def stream_times(server, prompt, max_tokens: int):
    """(submit time, arrival time of each output token) of one streamed request."""
    from medha_jax import SamplingParams
    from serving.server import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    start = time.perf_counter()
    arrivals = []
    for delta in server.generate_stream(TokensPrompt(prompt), params):
        arrivals += [time.perf_counter()] * len(delta.token_ids)
    return start, arrivals


def handoff_gap(args, server) -> list[dict]:
    """Part (b): the modes interleaved, repeat by repeat, so that a change in the machine's
    load (2 cores shared) hits them alike."""
    from serving.kv_transfer import DisaggConfig

    replica_set = server._replica_set
    rng = random.Random(1)
    step_tokens = server.engine.config.max_tokens_per_step
    modes = ("co-located", "streamed", "ship-at-end")
    seen = {m: {"gap": [], "chunk": [], "ttft": [], "records": []} for m in modes}
    for _ in range(args.repeats):
        for mode in modes:
            replica_set.offload = gate_config("never" if mode == "co-located" else "always",
                                              server)
            replica_set.transfers.config = DisaggConfig(stream_chunks=mode == "streamed")
            prompt = [rng.randrange(1, server.config.vocab_size)
                      for _ in range(args.prompt_tokens)]
            before = len(replica_set.transfers.records)
            start, arrivals = stream_times(server, prompt, 4)
            got = seen[mode]
            got["ttft"].append(arrivals[0] - start)
            got["gap"].append(arrivals[1] - arrivals[0])
            got["chunk"].append((arrivals[0] - start) / -(-args.prompt_tokens // step_tokens))
            got["records"] += replica_set.transfers.records[before:]
            time.sleep(0.2)
    rows = []
    for mode in modes:
        got = seen[mode]
        records = got["records"]
        gap, chunk = statistics.median(got["gap"]), statistics.median(got["chunk"])
        rows.append({"mode": mode, "prompt_tokens": args.prompt_tokens,
                     "ttft_p50_s": statistics.median(got["ttft"]), "chunk_s": chunk,
                     "gap_token1_to_2_p50_s": gap, "gap_over_chunk": gap / chunk,
                     "MB_moved": statistics.mean([r.bytes_moved for r in records]) / 1e6
                     if records else 0.0,
                     "sending_during_prefill_s": statistics.median(
                         [r.last_send - r.first_send for r in records]) if records else 0.0})
    return rows


def ray_handoff(args) -> list[dict]:
    """Part (f): the pair's server, then the lone actor's (a RayServer names its actors
    from 0, so two at once would replace each other's), on the same prompts; no CPU is
    booked per actor, so they start on a 2-core Ray."""
    try:
        import ray
    except ImportError:
        print("(f) skipped: Ray is not installed (pip install -e '.[cluster]')")
        return []
    from serving.server import Server

    options = dict(engine_config=engine_config(args.quick), warmup=True, cluster="ray",
                   actor_options={"num_cpus": 0}, metrics_port=None)
    rng = random.Random(2)
    rows = []
    try:
        with Server(args.model, replicas=2, roles="prefill:1,decode:1", **options) as pair:
            seen = {"handed off between actors": [], "one actor": []}
            for _ in range(args.repeats):
                prompt = [rng.randrange(1, pair.config.vocab_size)
                          for _ in range(args.prompt_tokens)]
                chunks = pair.chunks_moved
                start, arrivals = stream_times(pair, prompt, 4)
                seen["handed off between actors"].append(
                    (arrivals[0] - start, arrivals[1] - arrivals[0], pair.chunks_moved - chunks))
                time.sleep(0.2)
        with Server(args.model, replicas=1, **options) as alone:
            rng = random.Random(2)
            for _ in range(args.repeats):
                prompt = [rng.randrange(1, alone.config.vocab_size)
                          for _ in range(args.prompt_tokens)]
                start, arrivals = stream_times(alone, prompt, 4)
                seen["one actor"].append((arrivals[0] - start, arrivals[1] - arrivals[0], 0))
                time.sleep(0.2)
    finally:
        ray.shutdown()
    for mode, got in seen.items():
        rows.append({"mode": mode, "prompt_tokens": args.prompt_tokens,
                     "ttft_p50_s": statistics.median(g[0] for g in got),
                     "gap_token1_to_2_p50_s": statistics.median(g[1] for g in got),
                     "chunks_moved": statistics.median(g[2] for g in got)})
    return rows


def ray_part(args, skip) -> list[dict]:
    rows = [] if "f" in skip else ray_handoff(args)
    if rows:
        table(f"(f) hand-off between Ray actors: a {args.prompt_tokens}-token prompt "
              f"(median of {args.repeats})", rows)
    return rows


def routing_config(args):
    """The router's config of (e) and (g): its defaults, or what the flags set."""
    from medha_jax.cluster.router import RoutingConfig

    routing = RoutingConfig(ttft_floor=args.ttft_floor)
    if args.decode_delay_weight is not None:
        routing = dataclasses.replace(routing, decode_delay_weight=args.decode_delay_weight)
    return routing


def ray_h8(args, link_bytes_per_s: float | None) -> tuple[list[dict], list[dict]]:
    """Part (g): (c)'s rounds over two Ray replica actors bound to disjoint CPUs; the
    rows of (c) and every measured request. link_bytes_per_s: kv_wire's pull as (a)
    measured it (None: measured here)."""
    try:
        import ray
    except ImportError:
        print("(g) skipped: Ray is not installed (pip install -e '.[cluster]')")
        return [], []
    from medha_jax.cluster.offload import OffloadConfig
    from serving.server import Server

    routing = routing_config(args)
    if link_bytes_per_s is None:
        from medha_jax.engine import Engine
        from medha_jax.model import load_model
        from serving.kv_transfer import page_bytes

        engine = Engine(load_model(args.model, verbose=False), engine_config(args.quick))
        pages, seconds = wire_pulls(args, engine)[-1]
        link_bytes_per_s = pages * page_bytes(engine) / statistics.median(seconds[1:])
        del engine
    try:
        # Transfers on from the start, as make_server's; each round sets its own gate.
        with Server(args.model, engine_config=engine_config(args.quick), replicas=2,
                    warmup=True, scheduler=scheduler_config(args),
                    offload=OffloadConfig("always-heavy", heavy_new_tokens=1),
                    metrics_port=None, cluster="ray", actor_options={"num_cpus": 0},
                    cpu_binding="auto", router=routing) as server:
            server._measured_link_bytes_per_s = link_bytes_per_s
            runs, _, requests = h8(args, server)
    finally:
        ray.shutdown()
    return runs, requests


def h8(args, server) -> tuple[list[dict], list[dict], list[dict]]:
    """Parts (c) and (d). An unmeasured round under the `never` gate first: the server's
    predictor is refined online from served steps, so without it the first gate measured
    would meet a colder predictor than the others (a first run put TTFT p90 at 26 s for
    whichever gate ran first). Then --h8-rounds rounds of every gate, the order rotated
    each round; a gate's figures are over all its rounds' requests. Returns the table
    rows of (c) and (d) and every measured request (for the JSON: where a tail comes from)."""
    gates = args.gates.split(",")
    longest = max(sum(session_plan(args, i)[0]) for i in range(args.sessions)) \
        + args.turns * args.output_tokens
    if longest > server.max_model_len:
        raise SystemExit(f"(c): a HEAVY session's last turn reaches {longest} tokens, past "
                         f"the engine's max_model_len {server.max_model_len}: lower "
                         f"--heavy-tokens, --turns, --turn-tokens or --output-tokens")
    run_gate(args, server, "never", seed=0)                  # warm-up, not measured
    results = {gate: [] for gate in gates}
    pauses = {gate: [] for gate in gates}       # of the running decodes moved (Ray)
    outcomes = {gate: [] for gate in gates}
    for r in range(args.h8_rounds):
        for k in range(len(gates)):
            gate = gates[(k + r) % len(gates)]
            results[gate] += [dict(done, gate=gate, round=r) for done in run_gate(
                args, server, gate, seed=1 + r * len(gates) + k)]
            pauses[gate] += getattr(server, "move_pauses", ())
            outcomes[gate] += getattr(server, "move_outcomes", ())
    rows, cache_rows = [], []
    for gate in gates:
        done = results[gate]
        ttft = [r["ttft"] for r in done]
        tpot = [r["tpot"] for r in done if r["outputs"] > 1]
        warm_tpot = [r["tpot"] for r in done if r["outputs"] > 1 and not r["heavy"]]
        # The router's TTFT against the measured one (its model: prefills share steps).
        ttft_ratio = [r["ttft_predicted"] / r["ttft"] for r in done
                      if r["ttft_predicted"] is not None and r["ttft"] > 0]
        rows.append({"gate": gate, "requests": len(done),
                     "offload_decided": sum(r["offload_decided"] for r in done),
                     "offloaded": sum(r["offloaded"] for r in done),
                     "moved": sum(r.get("moved_to") is not None for r in done),
                     "move_pause_p50_s": percentile(pauses[gate], 50) if pauses[gate] else "-",
                     # A move's price of a token of the rest of the decode over what one
                     # measured.
                     "move_priced_over_measured_p50": percentile(
                         [d.offloaded_s / priced / (s / n) for _, d, s, n, priced
                          in outcomes[gate] if n], 50) if outcomes[gate] else "-",
                     "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90),
                     "ttft_predicted_over_measured_p10": percentile(ttft_ratio, 10),
                     "ttft_predicted_over_measured_p50": percentile(ttft_ratio, 50),
                     "tpot_p90_s": percentile(tpot, 90),
                     "warm_tpot_p90_s": percentile(warm_tpot, 90)})
        # How well the gate's predictor priced the plan each request took: its decode
        # seconds (tokens after the first) as predicted at the decision and as measured.
        decided = [r for r in done if r["colocated_s"] is not None and r["outputs"] > 1]
        rows[-1].update(
            decode_s_predicted_p50=percentile([r["offloaded_s"] if r["offloaded"] else
                                               r["colocated_s"] for r in decided], 50),
            decode_s_measured_p50=percentile([r["tpot"] * (r["outputs"] - 1)
                                              for r in decided], 50))
        rows[-1].update(versus(done, results[gates[0]]) if gate != gates[0] else
                        dict.fromkeys(("ttft_p50_diff_s", "ttft_p50_diff_90pct",
                                       "tpot_p90_diff_s", "tpot_p90_diff_90pct"), "-"))
        for after in (True, False):
            turns = [r for r in done if r["after_offloaded"] is after]
            if turns:
                cache_rows.append({
                    "gate": gate, "previous_turn": "disaggregated" if after else "co-located",
                    "turns": len(turns),
                    "cached_share_of_prompt": sum(r["cached"] for r in turns)
                    / sum(r["prompt"] for r in turns)})
    return rows, cache_rows, [done for gate in gates for done in results[gate]]


def versus(done: list[dict], baseline: list[dict], resamples: int = 2000) -> dict:
    """TTFT p50 and TPOT p90 of `done` less the baseline gate's, each with a 90% interval
    from a cluster bootstrap: the units resampled are a session's turns in one round (the
    turns of a session are not independent), each side on its own. On this 2-core machine
    a gate's TTFT p50 moves by 10% from round to round; the interval says whether a
    difference is more than that."""
    def units(requests):
        by_unit = {}
        for r in requests:
            by_unit.setdefault((r["round"], r["session"]), []).append(r)
        return list(by_unit.values())

    def figures(requests):
        return (percentile([r["ttft"] for r in requests], 50),
                percentile([r["tpot"] for r in requests if r["outputs"] > 1], 90))

    rng = random.Random(0)
    mine, theirs = units(done), units(baseline)
    diffs = []
    for _ in range(resamples):
        a = figures([r for u in rng.choices(mine, k=len(mine)) for r in u])
        b = figures([r for u in rng.choices(theirs, k=len(theirs)) for r in u])
        diffs.append((a[0] - b[0], a[1] - b[1]))
    point = [x - y for x, y in zip(figures(done), figures(baseline))]
    out = {}
    for k, name in enumerate(("ttft_p50", "tpot_p90")):
        values = [d[k] for d in diffs]
        out[f"{name}_diff_s"] = point[k]
        out[f"{name}_diff_90pct"] = (f"[{percentile(values, 5):+.3g}, "
                                     f"{percentile(values, 95):+.3g}]")
    return out


def session_plan(args, i: int) -> tuple[list[int], int | None]:
    """The new tokens of session i's turns and its HEAVY turn (None for a WARM session): a
    WARM session --warm-tokens then --turn-tokens a turn; a HEAVY one (every
    --heavy-every-th) --heavy-tokens in its HEAVY turn (--heavy-turn) in place of that
    turn's."""
    plan = [args.warm_tokens] + [args.turn_tokens] * (args.turns - 1)
    if i % args.heavy_every:
        return plan, None
    heavy = 0 if args.heavy_turn == "first" else 1 + (i // args.heavy_every) % (args.turns - 1)
    plan[heavy] = args.heavy_tokens
    return plan, heavy


def run_gate(args, server, gate: str, seed: int) -> list[dict]:
    """One round of (c) under `gate`: --sessions closed-loop sessions of --turns turns, their
    prompts drawn from `seed` (fresh tokens each round, so no round hits another's cache)."""
    from medha_jax import SamplingParams
    from serving.kv_transfer import DisaggConfig
    from serving.server import TokensPrompt

    # In process the replica set holds the gate and the decisions; on Ray the front does.
    owner = getattr(server, "_replica_set", server)
    transfers = getattr(owner, "transfers", None)     # in process only
    vocab = server.config.vocab_size
    owner.offload = gate_config(gate, server)
    for kept in ("move_pauses", "move_outcomes"):
        if hasattr(owner, kept):
            getattr(owner, kept).clear()
    if owner.offload.move_decodes and transfers is not None:
        raise SystemExit(f"gate {gate!r}: running decodes move between Ray actors only: "
                         f"run it in (g) (--skip c,d)")
    if transfers is not None:
        transfers.config = DisaggConfig()
    results, lock = [], threading.Lock()
    started = time.perf_counter()

    def session(i: int) -> None:
        rng = random.Random(1000 * seed + i)
        plan, heavy_turn = session_plan(args, i)
        heavy = heavy_turn is not None
        history: list[int] = []
        previous_offloaded = None
        time.sleep(0.3 * i)                     # staggered starts
        for turn, new in enumerate(plan):
            prompt = history + [rng.randrange(1, vocab) for _ in range(new)]
            handle_submitted = time.perf_counter()
            handle = server.submit(TokensPrompt(prompt), SamplingParams(
                temperature=0.0, max_tokens=args.output_tokens),
                session_id=f"{gate}-{seed}-{i}")
            out = handle.result(timeout=600)
            decision = next((d for rid, d in itertools.islice(
                reversed(owner.offload_decisions), 200) if rid == handle.id), None)
            routed = next((d for rid, d in itertools.islice(
                reversed(owner.routing_decisions), 200) if rid == handle.id), None)
            decode = None if decision is None else decision.decode
            moved = next((to for rid, _, to, _ in itertools.islice(
                reversed(getattr(owner, "move_decisions", ())), 200) if rid == handle.id),
                None)
            m = out.metrics
            # Decided and done: a mixed prefill replica whose first token came before the
            # decode side's grant decodes the request itself.
            offloaded = decode is not None and m.replica == decode
            cached = m.num_cached_tokens
            if offloaded and transfers is not None:
                # The decode side counts the moved pages as cached.
                cached = next((r.prefill_cached_tokens for r in reversed(transfers.records)
                               if r.request_id == handle.id), cached)
            with lock:
                results.append({"session": i, "heavy": heavy, "turn": turn,
                                "heavy_turn": turn == heavy_turn,
                                "submitted_s": handle_submitted - started, "ttft": m.ttft,
                                # The router's, where it sent the prefill.
                                "ttft_predicted": routed and routed.predicted_ttft_s,
                                "tpot": m.tpot, "outputs": m.num_output_tokens,
                                "cached": cached, "prompt": len(prompt),
                                "offloaded": offloaded, "offload_decided": decode is not None,
                                "replica": m.replica,
                                "decode_replica": decode, "moved_to": moved,
                                "queue_s": m.queue_time,
                                "preemptions": m.num_preemptions,
                                # The gate's predicted seconds of the request's own
                                # decode, staying and moving (less what it adds to the
                                # other decodes: not measurable per request).
                                "colocated_s": decision and (decision.colocated_s
                                                             - decision.colocated_others_s),
                                "offloaded_s": decision and (decision.offloaded_s
                                                             - decision.offloaded_others_s),
                                "after_offloaded": previous_offloaded})
            previous_offloaded = offloaded
            history = prompt + list(out.token_ids)

    failures = []

    def run_session(i: int) -> None:
        try:
            session(i)
        except BaseException as e:          # a lost session would bias every figure
            failures.append(e)
            raise

    threads = [threading.Thread(target=run_session, args=(i,)) for i in range(args.sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise RuntimeError(f"{len(failures)} of {args.sessions} sessions failed under gate "
                           f"{gate!r}; the first: {failures[0]!r}") from failures[0]
    return results


def simulated(args) -> list[dict]:
    """Part (e)."""
    from medha_jax.cluster.offload import OffloadConfig
    from medha_jax.config import ParallelConfig, model_preset
    from medha_jax.simulator import simulate
    from medha_jax.workloads import TraceRequest, to_requests

    rng = random.Random(0)
    trace = []
    for s in range(args.sim_sessions):
        heavy = s % 2 == 0
        t, length = rng.uniform(0, 10), (20_000 if heavy else 2_000)
        for _ in range(4):
            trace.append(TraceRequest(t, length, 200, f"s{s}"))
            t += 1.0 + rng.expovariate(1.0)
            length += 500
    requests = to_requests(sorted(trace, key=lambda r: r.arrival_s), vocab_size=32_000)
    model = model_preset("llama3-8b")
    rows = []
    runs = [("never", None)] + [(g, link) for link in ("nvlink", "200Gb/s")
                                for g in ("always", "cached-fraction", "time")]
    for gate, link in runs:
        bandwidth = {"nvlink": 450e9, "200Gb/s": 25e9, None: 450e9}[link]
        offload = (OffloadConfig("always-heavy", heavy_new_tokens=1, link_bytes_per_s=bandwidth)
                   if gate == "always" else
                   OffloadConfig(gate, link_bytes_per_s=bandwidth, handshake_s=0.0005))
        result = simulate(requests, scheduler="lars-mp", model=model,
                          parallel=ParallelConfig(), hardware="h100",
                          num_replicas=args.sim_replicas, prefix_caching=True, offload=offload,
                          routing=routing_config(args))
        done = [r for r in result.requests if r.finish_time is not None]
        ttft = [r.first_token_time - r.arrival_time for r in done]
        tpot = [(r.finish_time - r.first_token_time) / (len(r.output_token_ids) - 1)
                for r in done if len(r.output_token_ids) > 1]
        rows.append({"gate": gate, "link": link or "-", "requests": len(done),
                     "offloaded": len(result.decoded_on),
                     "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90),
                     "tpot_p90_s": percentile(tpot, 90),
                     "prefill_hit_rate": sum(result.prefill_cached_tokens.get(
                         r.request_id, r.num_cached_tokens) for r in done)
                     / sum(r.prompt_len for r in done)})
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_force_host_platform_device_count=2").strip()
    args.model = args.model or ("tiny" if args.quick else "smollm2-135m")
    args.sessions = args.sessions or (6 if args.quick else 12)
    args.turns = args.turns or (3 if args.quick else 4)
    args.heavy_tokens = args.heavy_tokens or (768 if args.quick else 1024)
    args.output_tokens = args.output_tokens or (16 if args.quick else 32)
    # Not a whole number of pages: a prompt's partial last page is part of the hand-off.
    args.prompt_tokens = args.prompt_tokens or (1030 if args.quick else 1540)
    args.repeats = args.repeats or (3 if args.quick else 5)
    args.sim_sessions = args.sim_sessions or (192 if args.quick else 384)
    if args.heavy_turn == "spread" and args.turns < 2:
        raise SystemExit("--heavy-turn spread needs --turns >= 2 (the HEAVY turn is a later one)")
    skip = set(args.skip.split(",")) - {""}
    band = gaps = runs = cached = sim = h8_requests = []
    if "e" not in skip:
        sim = simulated(args)
        table(f"(e) simulated: {args.sim_replicas} replicas of llama3-8b (one H100 each), "
              f"{args.sim_sessions} sessions x 4 turns, half HEAVY (20K cold tokens)", sim)
    if not {"a", "b", "c"} - skip:
        ray_rows = ray_part(args, skip)
        ray_runs, ray_requests = ray_h8_part(args, skip, band)
        return _write(args, band, gaps, runs, cached, sim, ray_rows, h8_requests, ray_runs,
                      ray_requests)
    with make_server(args) as server:
        if "a" in skip:             # the gates of (b) and (c) are priced at the link's speed
            bandwidth(args, server, between_processes=False)
        else:
            band = bandwidth(args, server)
            table(f"(a) KV page copy to replica 1 ({args.model}, waited for): from replica "
                  "0 in process (gather + device_put + scatter), from a replica in another "
                  "process (pull + scatter)", band)
        if "b" not in skip:
            gaps = handoff_gap(args, server)
            table(f"(b) hand-off gap: a {args.prompt_tokens}-token prompt on replica 0, "
                  "decoded on replica 1 (median of "
                  f"{args.repeats})", gaps)
        if "c" not in skip:
            runs, cached, h8_requests = h8(args, server)
            table(f"(c) H8 at this scale: {args.sessions} sessions x {args.turns} turns x "
                  f"{args.h8_rounds} rounds, every {args.heavy_every}th session "
                  f"HEAVY ({heavy_phrase(args)}), 2 mixed replicas, "
                  "predicted-time router, per offload gate", runs)
            table("(d) H6: the next turn's cached share of its prompt", cached)
    ray_rows = ray_part(args, skip)         # after the in-process replicas are gone
    ray_runs, ray_requests = ray_h8_part(args, skip, band)
    if sim:
        table(f"(e) simulated: {args.sim_replicas} replicas of llama3-8b (one H100 each), "
              f"{args.sim_sessions} sessions x 4 turns, half HEAVY (20K cold tokens)", sim)
    _write(args, band, gaps, runs, cached, sim, ray_rows, h8_requests, ray_runs,
           ray_requests)


def heavy_phrase(args) -> str:
    return (f"{args.heavy_tokens} cold tokens in its "
            + ("first turn" if args.heavy_turn == "first" else "turn 1 + j mod "
               f"{args.turns - 1}, j its number among the HEAVY"))


def ray_h8_part(args, skip, band) -> tuple[list[dict], list[dict]]:
    if "g" in skip:
        return [], []
    pulled = [r for r in band if r["path"] == "between processes"]
    runs, requests = ray_h8(args, pulled[-1]["GB_per_s"] * 1e9 if pulled else None)
    if runs:
        table(f"(g) H8 over two Ray replica actors, one CPU set each: {args.sessions} "
              f"sessions x {args.turns} turns x {args.h8_rounds} rounds, every "
              f"{args.heavy_every}th session HEAVY ({heavy_phrase(args)}), per "
              "offload gate", runs)
    return runs, requests


def _write(args, band, gaps, runs, cached, sim, ray_rows=(), h8_requests=(), ray_h8_runs=(),
           ray_h8_requests=()) -> None:
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"context": {**environment(), **vars(args)}, "bandwidth": band,
                       "gap": gaps, "h8": runs, "next_turn_cache": cached,
                       "h8_requests": list(h8_requests), "simulated": sim,
                       "ray_handoff": list(ray_rows), "h8_ray": list(ray_h8_runs),
                       "h8_ray_requests": list(ray_h8_requests)}, f, indent=2)


if __name__ == "__main__":
    main()
