"""benchmarks/peers.py: its pure parts (trace prompts, ratios, the stream summary, the SSE
parser) and the offline medha-jax path on the tiny model (batched == one at a time)."""

import math
import os

import numpy as np
import pytest

from benchmarks import peers
from medha_jax.engine import EngineConfig

needs_trace = pytest.mark.skipif(not os.path.isfile(peers.TRACE),
                                 reason="shared/traces not present")


@needs_trace
def test_trace_prompt_lengths_are_capped_and_ids_deterministic():
    lengths = peers.trace_lengths(peers.TRACE, 16, 512)
    # The run: the first 16 Azure 2023 conversation prompts, capped, 5,812 tokens.
    assert lengths[:4] == [374, 396, 512, 91] and max(lengths) == 512
    assert sum(lengths) == 5812
    assert peers.trace_lengths(peers.TRACE, 4, 100) == [100, 100, 100, 91]

    vocabulary = np.arange(17, 300)
    prompts = peers.random_prompts(lengths, vocabulary, seed=0)
    assert [len(p) for p in prompts] == lengths
    assert all(17 <= t < 300 and isinstance(t, int) for p in prompts for t in p)
    assert prompts == peers.random_prompts(lengths, vocabulary, seed=0)
    assert prompts[:2] != peers.random_prompts(lengths[:2], vocabulary, seed=1)


def test_ordinary_token_ids_leave_out_special_tokens():
    class Backend:
        def get_added_tokens_decoder(self):
            return {0: "<|endoftext|>", 1: "<|im_start|>", 5: "<|im_end|>"}

    class Tok:
        vocab_size, backend = 8, Backend()

    assert peers.ordinary_token_ids(Tok()).tolist() == [2, 3, 4, 6, 7]


def test_poisson_arrivals():
    arrivals = peers.poisson_arrivals(2000, 4.0, seed=0)
    assert arrivals[0] == 0 and arrivals == sorted(arrivals)
    assert arrivals == peers.poisson_arrivals(2000, 4.0, seed=0)
    assert abs(np.mean(np.diff(arrivals)) - 0.25) < 0.02


def test_same_tokens_and_ratios():
    assert peers.same_tokens([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 0, 6]]) == (5, 1)
    rows = [{"engine": "llama.cpp", "wall_s": 3.0, "tok_per_s": 10.0},
            {"engine": peers.MEDHA, "wall_s": 1.5, "tok_per_s": 20.0},
            {"engine": "vllm", "wall_s": None, "tok_per_s": None}]
    out = peers.with_ratios(rows, ["wall_s", "tok_per_s"])
    assert out[0]["wall_s_vs_medha"] == 2.0 and out[0]["tok_per_s_vs_medha"] == 0.5
    assert out[1]["wall_s_vs_medha"] == 1.0
    assert out[2]["wall_s_vs_medha"] is None and out[2]["tok_per_s_vs_medha"] is None
    assert list(out[2]) == list(out[0])          # one table: the same columns in every row


def test_summarize_stream_percentiles_and_tpot():
    # TPOT = (latency - ttft) / (tokens - 1); tokens from usage, else the expected count.
    records = [{"ttft_s": 0.1 * i, "latency_s": 0.1 * i + 0.9, "output_tokens": 10}
               for i in range(1, 11)]
    records += [{"ttft_s": 1.0, "latency_s": 4.0, "output_tokens": None},   # 4 expected
                {"error": "HTTP 500"}]
    s = peers.summarize_stream(records, expected_tokens=4)
    assert s["requests"] == 12 and s["errors"] == 1
    ttft = [0.1 * i for i in range(1, 11)] + [1.0]
    assert math.isclose(s["ttft_p50_s"], float(np.percentile(ttft, 50)))
    assert math.isclose(s["ttft_p99_s"], float(np.percentile(ttft, 99)))
    assert math.isclose(s["tpot_p50_s"], 0.1)
    assert math.isclose(s["tpot_p99_s"], float(np.percentile([0.1] * 10 + [1.0], 99)))
    assert s["output_tokens"] == 104 and s["prompt_tokens"] is None     # no usage sent
    assert peers.summarize_stream([{"ttft_s": 1, "latency_s": 2, "prompt_tokens": 7}],
                                  expected_tokens=2)["prompt_tokens"] == 7
    empty = peers.summarize_stream([{"error": "refused"}], expected_tokens=4)
    assert empty["errors"] == 1 and empty["ttft_p50_s"] is None


def test_sse_parser_on_a_stream_cut_anywhere():
    stream = (b": ping - 2025-01-01\r\n\r\n"
              b'data: {"choices": [{"text": "H\xc3\xa9"}]}\r\n\r\n'
              b"event: message\n"
              b'data: {"choices": [{"text": "llo"}],\n'
              b'data: "usage": null}\n\n'
              b'data:{"choices": [], "usage": {"completion_tokens": 2}}\n\n'
              b"data: [DONE]\n\n")
    expected = ['{"choices": [{"text": "H\u00e9"}]}',
                '{"choices": [{"text": "llo"}],\n"usage": null}',
                '{"choices": [], "usage": {"completion_tokens": 2}}', "[DONE]"]
    assert peers.SseParser().feed(stream) == expected
    for size in (1, 2, 3, 7, 64):                # every cut, a UTF-8 character's included
        parser = peers.SseParser()
        events = [e for i in range(0, len(stream), size) for e in parser.feed(stream[i:i + size])]
        assert events == expected
    parser = peers.SseParser()
    assert parser.feed(b"data: half") == [] and parser.feed(b"\n\n") == ["half"]


def test_request_bodies_ask_for_exactly_max_tokens_greedily():
    class Tok:
        def decode(self, ids):
            return "".join(chr(97 + i) for i in ids)

    medha = peers.Endpoint(peers.MEDHA, [])
    body = peers.request_body(medha, [1, 2], 8, Tok())
    assert body["prompt"] == [1, 2] and body["ignore_eos"] is True
    assert body["temperature"] == 0 and body["max_tokens"] == 8 and body["stream"] is True
    llama = peers.PEERS["llama.cpp"].endpoint
    body = peers.request_body(llama, [1, 2], 8, Tok())
    assert body["prompt"] == "bc" and body["min_tokens"] == 8 and "ignore_eos" not in body


def test_llama_server_is_an_online_endpoint_when_its_binary_is_given():
    args = peers.parse_args(["--llama-server", "/opt/llama-server", "--max-model-len", "512",
                             "--cache-dir", "/tmp/c"])
    found = peers.endpoints(args, {"gguf": "m.gguf", "hf": None}, {})
    assert [e.name for e in found] == [peers.MEDHA, "llama-server"]
    server = found[1]
    assert server.command[:3] == ["/opt/llama-server", "--model", "m.gguf"]
    flags = dict(zip(server.command[3::2], server.command[4::2]))
    assert flags["--ctx-size"] == str(peers.LLAMA_SERVER_SLOTS * 512)
    assert flags["--parallel"] == str(peers.LLAMA_SERVER_SLOTS) and flags["--port"] == "{port}"
    body = peers.request_body(server, [1, 2], 8, None)       # token ids, ignore_eos
    assert body["prompt"] == [1, 2] and body["ignore_eos"] is True
    args = peers.parse_args(["--cache-dir", "/tmp/c"])
    assert [e.name for e in peers.endpoints(args, {"gguf": "m.gguf"}, {})] == [peers.MEDHA]


def test_medha_offline_batched_equals_one_at_a_time():
    rng = np.random.default_rng(0)
    prompts = peers.random_prompts([37, 90], np.arange(256), seed=0)
    warmup = [rng.integers(0, 256, 20).tolist()]
    engine = EngineConfig(page_size=16, max_kv_tokens=2048, max_model_len=256,
                          max_tokens_per_step=16, min_token_bucket=16, max_seqs=8,
                          enable_prefix_caching=False)
    result = peers.run_medha_offline("tiny", prompts, warmup, 4, engine_config=engine,
                                     cache_dir=False)
    assert [len(t) for t in result["tokens"]] == [4, 4]
    assert result["tokens"] == result["one_at_a_time_tokens"]
    assert result["equals_one_at_a_time"] is True
    assert result["startup_s"] <= result["all_compiled_s"] and result["wall_s"] > 0
