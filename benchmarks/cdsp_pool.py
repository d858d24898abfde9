"""The CDSP prefill pool on this machine's devices (seed 001, Tetris; medha_jax.engine.cdsp_pool).

    python -m benchmarks.cdsp_pool --quick          # a few minutes on a 2-core CPU
    python -m benchmarks.cdsp_pool --json results/cdsp_pool.json

A pool of N devices (--devices; on a CPU, N virtual devices) prefills prompts of each length
(--lengths) of --model (random weights) three ways:
  - one chunk on all N devices (fixed SP N: seed 002's ring);
  - CDSP-style growth: a quarter of the prompt on N/4 devices, a quarter on N/2, the rest on
    N, the history balanced inside each grown chunk's step (what a plan whose groups free up
    one after another runs);
  - one device, the reference: the largest logit difference of the others against it.
Each way runs once to compile, then --repeats times; a chunk's time is its step's (inputs
placed, program run, logits back), the least over the repeats. Then Eq. 1 is fitted per SP
size from every step measured (`fit_latency_models`: what the CDSP scheduler plans with),
with its largest relative error on those steps.

(c) served (--skip c to leave out): --requests prompts of the largest length arriving at
once beside as many short chats, through a Server whose replica (tp = N/2, one device on a
CPU) serves them alone, then through one with a prefill pool on the other N/2 devices
(serving.prefill_pool): TTFT p50/p99 of each class, the wall time, and whether every
request's greedy tokens are equal. Each server's replica compiles every step shape first,
then it serves the same lengths, untimed, until a pass compiles nothing (at most 6
passes: the pool's programs are those its plans use), so the timed pass waits for no
compile.

On a CPU the virtual devices share its cores, so SP cannot speed a chunk up here: the table
shows what each way costs in programs, balancing pages and time on one host, and that the
growth path is exact. On a machine with N accelerators the same script measures SP.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence

from benchmarks.report import environment, table


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cdsp_pool", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="shorter prompts, fewer repeats")
    p.add_argument("--json", default=None, help="write every figure and the context here")
    p.add_argument("--model", default="tiny", help="model preset (random weights)")
    p.add_argument("--devices", type=int, default=8, help="pool size N (a power of two >= 4)")
    p.add_argument("--lengths", default=None, help="prompt lengths (default 512,2048; "
                                                    "--quick 256,512)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=None, help="timed runs (default 5; "
                                                              "--quick 2)")
    p.add_argument("--requests", type=int, default=None,
                   help="(c): long prompts, and as many chats (default 8; --quick 4)")
    p.add_argument("--skip", default="", help="sections to leave out, e.g. c")
    return p.parse_args(argv)


def ways(length: int, n: int) -> dict[str, list[tuple[int, tuple[int, int]]]]:
    quarter = length // 4
    return {f"ring SP {n}": [(length, (0, n))],
            f"growth SP {n // 4}-{n // 2}-{n}": [(quarter, (0, n // 4)), (quarter, (0, n // 2)),
                                                 (length - 2 * quarter, (0, n))]}


def run(args) -> dict:
    import numpy as np

    from medha_jax.engine.cdsp_pool import CdspPool, PoolConfig
    from medha_jax.model import load_model
    from medha_jax.scheduler.cdsp import fit_latency_models
    from meshes import ParallelConfig

    lengths = [int(x) for x in (args.lengths or ("256,512" if args.quick else "512,2048"))
               .split(",")]
    repeats = args.repeats or (2 if args.quick else 5)
    n, ps = args.devices, args.page_size
    one = load_model(args.model, verbose=False)
    most = max(lengths)
    buckets = tuple(1 << i for i in range(4, (most // 2).bit_length() + 1))
    pool = CdspPool(load_model(args.model, parallel=ParallelConfig(cp=n), verbose=False),
                    PoolConfig(page_size=ps, pages_per_device=2 * -(-most // (4 * ps)),
                               rank_token_buckets=buckets))
    rows, runs = [], 0
    for length in lengths:
        ids = [int(t) for t in np.random.default_rng(length).integers(
            1, one.config.vocab_size, length)]
        want = one.logits(ids)
        for way, chunks in ways(length, n).items():
            best, moved, error = None, 0, 0.0
            for attempt in range(repeats + 1):          # the first compiles
                sequence, before, steps = f"{length}-{runs}", pool.moved_pages, len(pool.steps)
                runs += 1
                pool.add(sequence, ids)
                logits = np.concatenate([pool.prefill_chunk(sequence, tokens, group)
                                         for tokens, group in chunks])
                pool.release(sequence)
                seconds = [s[3] for s in pool.steps[steps:]]
                if attempt == 0:
                    del pool.steps[steps:]               # compile time: not a step's
                    error = float(np.abs(logits - want).max())
                    continue
                best = seconds if best is None else [min(a, b) for a, b in zip(best, seconds)]
                moved = pool.moved_pages - before
            rows.append({"prompt": length, "way": way,
                         "chunks (tokens@SP)": " ".join(f"{t}@{g[1]}" for t, g in chunks),
                         "chunk s": " ".join(f"{s:.3f}" for s in best), "total s": sum(best),
                         "pages balanced": moved, "max |logit err|": error})
    table(f"(a) prefill on a pool of {n} devices ({args.model}, page {ps}; least of {repeats})",
          rows)
    fits = fit_latency_models(pool.steps)
    fit_rows = []
    for sp, m in sorted(fits.items()):
        mine = [s for s in pool.steps if s[2] == sp]
        worst = max(abs(m.seconds(h, t) - s) / s for t, h, _, s in mine)
        fit_rows.append({"SP": sp, "steps": len(mine), "alpha s": m.alpha, "beta s/token": m.beta,
                         "gamma s/(token*history)": m.gamma, "delta s/token^2": m.delta,
                         "max rel err": worst})
    if fit_rows:
        table("(b) Eq. 1 fitted per SP size from the measured steps", fit_rows)
    served = [] if "c" in args.skip else serve(args, one, most)
    return {"prefill": rows, "eq1_fit": fit_rows, "steps": pool.steps, "served": served}


def serve(args, one, length: int) -> list[dict]:
    """(c): the same requests through a replica alone and through a replica with a pool."""
    import time

    import numpy as np

    from medha_jax.engine import EngineConfig
    from medha_jax.sampling_params import SamplingParams
    from meshes import ParallelConfig, make_mesh
    from serving.prefill_pool import PrefillPoolConfig
    from serving.server import Server, TokensPrompt

    n, ps = args.devices, args.page_size
    count = args.requests or (4 if args.quick else 8)
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    engine = EngineConfig(page_size=ps, max_kv_tokens=2 * count * (length + 64),
                          max_model_len=length + 64, max_seqs=2 * count)
    replica = one.on_mesh(make_mesh(ParallelConfig(tp=n // 2)))
    pool = PrefillPoolConfig(devices=n // 2, pages_per_device=2 * -(-length // (n // 2 * ps)),
                             rank_token_buckets=(64, 256))

    def requests(seed: int) -> list[tuple[str, TokensPrompt]]:
        rng = np.random.default_rng(seed)
        out = []
        for i in range(count):
            out.append(("long", TokensPrompt(rng.integers(1, one.config.vocab_size,
                                                          length).tolist())))
            out.append(("chat", TokensPrompt(rng.integers(1, one.config.vocab_size,
                                                          int(rng.integers(8, ps))).tolist())))
        return out

    def programs(server) -> int:
        pool_programs = server.prefill_pool.pool.executables if server.prefill_pool else ()
        return len(server.engine.executables) + len(pool_programs)

    rows, tokens = [], {}
    for name, extra in (("replica alone", {}), (f"replica + pool of {n // 2}",
                                                 {"prefill_pool": pool})):
        with Server(replica, engine_config=engine, warmup=False, cache_dir=False,
                    **extra) as server:
            server.engine.warmup()            # every step shape of the replica
            for seed in range(100, 106):      # until a pass compiles nothing (at most 6)
                compiled = programs(server)
                server.generate([p for _, p in requests(seed)], greedy)
                if programs(server) == compiled:
                    break
            work = requests(1)
            started = time.perf_counter()
            outs = server.generate([p for _, p in work], greedy)
            wall = time.perf_counter() - started
        tokens[name] = [o.token_ids for o in outs]
        for kind in ("long", "chat"):
            ttft = [o.metrics.ttft for (k, _), o in zip(work, outs) if k == kind]
            rows.append({"server": name, "requests": kind, "count": len(ttft),
                         "TTFT p50 s": float(np.percentile(ttft, 50)),
                         "TTFT p99 s": float(np.percentile(ttft, 99)), "wall s": wall})
    same = len({repr(t) for t in tokens.values()}) == 1
    for row in rows:
        row["tokens equal"] = same
    table(f"(c) served: {count} prompts of {length} tokens and {count} chats at once, "
          f"greedy 8 tokens each ({args.model}, page {ps})", rows)
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.devices < 4 or args.devices & (args.devices - 1):
        raise SystemExit(f"--devices must be a power of two >= 4, got {args.devices}")
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        # Before JAX starts: on a CPU the pool's devices are virtual ones.
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_"
                                   f"platform_device_count={args.devices}").strip()
    results = run(args)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"context": {**environment(), "args": vars(args)}, **results}, f, indent=1)


if __name__ == "__main__":
    main()
