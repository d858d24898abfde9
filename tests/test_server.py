"""The Python serving API end to end on the real engine and scheduler (tiny model, CPU).

Streaming order, batching invariance, concurrent and asyncio callers, stop strings with
UTF-8 split across tokens, cancellation returning pages, clean close, metrics; and greedy
outputs equal to transformers' generate on a checkpoint directory (marked hf).
"""

import asyncio
import gc
import threading
import time
import urllib.request

import numpy as np
import pytest

from medha_jax import SamplingParams, load_model
from medha_jax.engine import EngineConfig
from serving.outputs import IncrementalDetokenizer
from serving.server import Server, TokensPrompt

# One compiled shape: 16-token steps of up to 8 sequences, contexts up to 256 tokens.
TINY_ENGINE = EngineConfig(page_size=16, max_kv_tokens=2048, max_model_len=256,
                           max_tokens_per_step=16, min_token_bucket=16, max_seqs=8)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def byte_level_tokenizer():
    """The project's Tokenizer over a byte-level BPE with no merges: token id = byte value.

    Its 256 ids are exactly the tiny model's vocabulary, so a random model's output is
    arbitrary bytes, multi-byte UTF-8 characters split across tokens included.
    """
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    from medha_jax.checkpoint import Tokenizer

    alphabet = ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda c: _byte_of_char(c))
    backend = Backend(models.BPE(vocab={c: i for i, c in enumerate(byte_chars)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return Tokenizer(backend, bos_token_id=None, eos_token_ids=(), add_bos_by_default=False)


def _byte_of_char(c: str) -> int:
    """GPT-2's bytes_to_unicode, inverted: printable bytes map to themselves."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    others = [b for b in range(256) if b not in printable]
    return ord(c) if ord(c) in printable else others[ord(c) - 256]


def make_tiny_server(**kwargs) -> Server:
    model = load_model("tiny")
    model.tokenizer = byte_level_tokenizer()
    return Server(model, engine_config=TINY_ENGINE, **kwargs)


@pytest.fixture(scope="module")
def server():
    with make_tiny_server(metrics_port=0) as s:
        yield s


def wait_until_idle(server, timeout=30.0):
    deadline = time.monotonic() + timeout
    while server.num_free_pages != server.num_total_pages and time.monotonic() < deadline:
        time.sleep(0.01)
    return server.num_free_pages == server.num_total_pages


# --- The detokenizer on its own --------------------------------------------------------------

def test_byte_level_tokenizer_round_trips_utf8():
    tok = byte_level_tokenizer()
    text = "naïve 日本 🙂!"
    assert tok.encode(text) == list(text.encode())
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("stop, expected", [
    ((), "Grüße 日本 🙂 END tail"),
    (("END",), "Grüße 日本 🙂 "),
    (("🙂",), "Grüße 日本 "),           # a stop string made of a 4-byte character
    (("本 🙂 E", "tail"), "Grüße 日"),   # spans many tokens; the earliest match wins
])
def test_detokenizer_deltas_never_split_a_character_and_stop_at_the_stop_string(stop, expected):
    tok = byte_level_tokenizer()
    detok = IncrementalDetokenizer(tok, stop)
    deltas = []
    for token in tok.encode("Grüße 日本 🙂 END tail"):       # one byte per token
        detok.add([token])
        deltas.append(detok.take_delta(final=detok.stopped))
        if detok.stopped:
            break
    deltas.append(detok.take_delta(final=True))
    assert "".join(deltas) == expected == detok.text
    assert detok.stopped == bool(stop)
    assert not any("\ufffd" in d for d in deltas)


def test_detokenizer_holds_back_a_possible_stop_prefix():
    tok = byte_level_tokenizer()
    detok = IncrementalDetokenizer(tok, ("STOP",))
    detok.add(tok.encode("abc ST"))
    assert detok.take_delta(final=False) == "abc "       # "ST" may begin "STOP"
    detok.add(tok.encode("AY"))
    assert detok.take_delta(final=False) == "STAY"       # it did not
    assert not detok.stopped


# --- The server --------------------------------------------------------------------------------

def test_batched_outputs_equal_one_at_a_time(server):
    prompts = [[1, 2, 3], list(range(40, 90)), [7] * 20, list(range(200, 217))]
    alone = [server.generate(TokensPrompt(p), GREEDY) for p in prompts]
    together = server.generate(prompts, GREEDY)
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert server.generate(np.array(prompts[1]), GREEDY).token_ids == alone[1].token_ids
    assert [o.token_ids for o in server.generate(tuple(prompts[:2]), GREEDY)] == \
        [o.token_ids for o in alone[:2]]
    for prompt, out in zip(prompts, together):
        assert out.prompt_token_ids == tuple(prompt)
        assert len(out.token_ids) == 12 and out.finish_reason == "length"
        m = out.metrics
        assert (m.num_prompt_tokens, m.num_output_tokens) == (len(prompt), 12)
        assert m.arrival_time <= m.first_token_time <= m.finish_time
        assert m.ttft == pytest.approx(m.first_token_time - m.arrival_time)
        assert m.tpot == pytest.approx((m.finish_time - m.first_token_time) / 11)
        assert 0 <= m.queue_time <= m.ttft


def test_generate_asks_for_no_tpot_and_streams_keep_the_default(server, monkeypatch):
    # generate() returns whole outputs, so its requests carry no per-token objective (the
    # scheduler then fills steps: see the packer's and controller's tests); a stream, or an
    # SLO the caller gives, keeps its TPOT.
    from medha_jax.request import SLO
    loop = server._loops[0]
    seen = {}
    add = loop.add

    def record(stream, **kwargs):
        seen[stream.request.request_id] = stream.request.slo
        return add(stream, **kwargs)
    monkeypatch.setattr(loop, "add", record)
    batch = server.generate([[1, 2, 3], [4, 5, 6]], GREEDY)
    given = server.generate(TokensPrompt([7, 8]), GREEDY, slo=SLO(ttft_s=5.0, tpot_s=0.25))
    streamed = "".join(d.text for d in server.generate_stream(TokensPrompt([9, 10]), GREEDY))
    assert streamed == server.generate(TokensPrompt([9, 10]), GREEDY).text
    default = server.default_slo
    for out in batch:
        assert seen[out.request_id] == SLO(ttft_s=default.ttft_s, tpot_s=float("inf"))
    assert seen[given.request_id] == SLO(ttft_s=5.0, tpot_s=0.25)
    streamed_slo = [slo for rid, slo in seen.items()
                    if rid not in {o.request_id for o in batch} | {given.request_id}]
    assert default in streamed_slo
    assert wait_until_idle(server)


def test_stream_deltas_concatenate_to_the_final_output(server):
    prompt = "Hello, wörld"
    final = server.generate(prompt, GREEDY)
    deltas = list(server.generate_stream(prompt, GREEDY))
    assert all(not d.finished for d in deltas[:-1]) and deltas[-1].finished
    assert all(d.metrics is None for d in deltas[:-1]) and deltas[-1].metrics is not None
    assert sum((d.token_ids for d in deltas), ()) == final.token_ids
    assert "".join(d.text for d in deltas) == final.text
    assert final.text == byte_level_tokenizer().decode(final.token_ids)
    assert len({d.request_id for d in deltas}) == 1


def test_stop_string_trims_the_text_and_finishes_with_stop(server):
    prompt = list(range(60, 80))
    full = server.generate(TokensPrompt(prompt), SamplingParams(temperature=0.0, max_tokens=24))
    text = full.text
    start = max(len(text) // 2, 1)
    stop = text[start:start + 2]
    assert stop.strip("\ufffd"), f"pick another prompt: the output text is {text!r}"
    cut = text.index(stop)
    params = SamplingParams(temperature=0.0, max_tokens=24, stop=[stop])
    deltas = list(server.generate_stream(prompt, params))
    out = deltas[-1]
    assert out.finish_reason == "stop"
    assert "".join(d.text for d in deltas) == text[:cut]
    emitted = sum((d.token_ids for d in deltas), ())
    assert emitted == full.token_ids[:len(emitted)] and len(emitted) < 24
    assert wait_until_idle(server)


def test_concurrent_threads_get_their_own_correct_outputs(server):
    prompts = [[i, i + 1, (3 * i) % 256] for i in range(0, 120, 15)]
    expected = {tuple(p): server.generate(TokensPrompt(p), GREEDY).token_ids for p in prompts}
    results, errors = {}, []

    def call(prompt):
        try:
            results[tuple(prompt)] = server.generate(TokensPrompt(prompt), GREEDY).token_ids
        except Exception as e:       # surfaced below: a thread's exception is otherwise lost
            errors.append(e)

    threads = [threading.Thread(target=call, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert results == expected


def test_asyncio_streams(server):
    prompts = [[5, 6, 7], [9] * 30, [100, 101]]
    expected = [o.token_ids for o in server.generate(prompts, GREEDY)]

    async def stream(prompt):
        return [d async for d in server.generate_async(prompt, GREEDY)]

    async def main():
        return await asyncio.gather(*(stream(p) for p in prompts))

    for deltas, want in zip(asyncio.run(main()), expected):
        assert deltas[-1].finished and deltas[-1].finish_reason == "length"
        assert sum((d.token_ids for d in deltas), ()) == want


def test_cancel_frees_the_pages_and_others_finish(server):
    long = server.submit(list(range(1, 100)), SamplingParams(temperature=0.0, max_tokens=150))
    short = server.submit([3, 4, 5], GREEDY)
    first = next(iter(long))                    # it is running and holds pages
    assert first.token_ids and server.num_free_pages < server.num_total_pages
    assert long.cancel()
    out = long.result(timeout=30)
    assert out.finish_reason == "cancelled" and len(out.token_ids) < 150
    assert short.result(timeout=30).token_ids == \
        server.generate([[3, 4, 5]], GREEDY)[0].token_ids
    assert not server.cancel(long.request_id)   # already gone
    assert wait_until_idle(server)


def test_abandoned_stream_is_cancelled(server):
    stream = server.generate_stream(list(range(30)), SamplingParams(temperature=0, max_tokens=150))
    next(stream)
    stream.close()                               # the caller walked away
    assert wait_until_idle(server)


def test_the_scheduler_chunks_in_the_engines_query_blocks(server):
    # The XLA path on the CPU: its tile table's query block, which the packer rounds a
    # prefill chunk up to (packer.whole_query_block).
    from pallas_kernels.block_sizes import TILE_TABLE
    assert server.engine.query_block_tokens == TILE_TABLE["cpu"].block_q
    assert server.scheduler_config.query_block_tokens == server.engine.query_block_tokens
    assert server.scheduler_config.limits.query_block_tokens == TILE_TABLE["cpu"].block_q


def test_a_cpu_servers_budget_is_the_default_slos_tpot(server):
    """On a CPU the default batch budget is the default SLO's TPOT (0.5 s), not a multiple of
    the one-token step (which shrinks as the kernels get faster), and the packer runs on it
    (`scheduler/factory.py` has the measurements); a budget or a multiple given wins."""
    from medha_jax.scheduler import SchedulerConfig
    from serving.server import scheduler_config_for_engine

    config = server.scheduler_config
    assert config.target_batch_time_s == config.default_slo.tpot_s == 0.5
    assert server.replicas[0].controller.packer.target_batch_time_s == pytest.approx(0.5)
    engine = server.engine
    given = scheduler_config_for_engine(SchedulerConfig(target_batch_time_s=0.3), engine, None)
    assert given.target_batch_time_s == 0.3
    multiple = scheduler_config_for_engine(SchedulerConfig(budget_over_fixed_cost=8.0), engine,
                                           None)
    assert multiple.target_batch_time_s is None and multiple.budget_over_fixed_cost == 8.0


def test_metrics_count_requests_and_are_served_over_http(server):
    server.generate(TokensPrompt([1, 2]), SamplingParams(temperature=0.0, max_tokens=3))
    text = server.metrics_text()
    for name in ("medha_ttft_seconds_count", "medha_tpot_seconds_count",
                 "medha_queue_time_seconds_count", "medha_batch_tokens_count",
                 "medha_kv_pages_in_use", "medha_preemptions_total",
                 'medha_requests_finished_total{finish_reason="length"}'):
        assert name in text
    finished = [line for line in text.splitlines()
                if line.startswith('medha_requests_finished_total{finish_reason="length"}')]
    assert float(finished[0].split()[-1]) >= 1
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics") as r:
        assert b"medha_ttft_seconds_count" in r.read()


def test_gateway_metrics_follow_the_load(server):
    """KV-cache usage as a fraction and running / waiting counts, while a request holds
    pages and after it is gone."""
    value = lambda name: server.metrics.registry.get_sample_value(name)
    assert wait_until_idle(server)
    handle = server.submit(list(range(60)), SamplingParams(temperature=0.0, max_tokens=150))
    deltas = iter(handle)
    next(deltas)                              # its first token: it holds 4 pages or more
    usage = value("medha_kv_cache_usage_ratio")
    in_use = value("medha_kv_pages_in_use")
    assert 0 < usage <= 1 and in_use >= 4
    assert usage == pytest.approx(in_use / server.num_total_pages)
    assert value("medha_requests_running") == 1 and value("medha_requests_waiting") == 0
    handle.cancel()
    assert handle.result(timeout=30).finish_reason == "cancelled"
    deadline = time.monotonic() + 10      # the loop updates the gauges just after finishing
    while value("medha_kv_cache_usage_ratio") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert value("medha_kv_cache_usage_ratio") == 0.0
    assert value("medha_requests_running") == value("medha_requests_waiting") == 0


def test_close_cancels_in_flight_requests_and_frees_every_page():
    server = make_tiny_server()
    handle = server.submit(list(range(50)), SamplingParams(temperature=0.0, max_tokens=200))
    next(iter(handle))
    server.close()
    assert handle.result(timeout=0).finish_reason == "cancelled"
    assert server.num_free_pages == server.num_total_pages
    assert not server.replicas[0].loop.thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        server.submit([1], GREEDY)
    server.close()                               # idempotent


# --- Against transformers ------------------------------------------------------------------

@pytest.mark.hf
def test_greedy_outputs_equal_transformers_generate(tmp_path):
    from tests.hf_oracle import hf_greedy, hf_logits, save_tiny_llama

    hf_model = save_tiny_llama(tmp_path / "ckpt", "gqa4-llama3-rope", seed=1)
    prompts = [[1, 2, 3, 4, 5], list(range(30, 70)), [17] * 3]
    with Server(str(tmp_path / "ckpt"), engine_config=TINY_ENGINE) as server:
        outs = server.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10))
    for prompt, out in zip(prompts, outs):
        ours, theirs = list(out.token_ids), hf_greedy(hf_model, prompt, 10)
        if ours != theirs:
            # Batching and chunking change float rounding (the HF model runs one sequence
            # at once); only an exact tie in transformers' own logits may flip a token.
            i = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
            logits = hf_logits(hf_model, prompt + theirs[:i])[-1]
            assert abs(logits[ours[i]] - logits[theirs[i]]) < 1e-4, (prompt, ours, theirs)


# --- The start-up heap kept out of the garbage collector's walks ------------------------------

def test_a_server_freezes_the_heap_while_open_and_gives_it_back_when_closed(server):
    from serving.gc_freeze import frozen_holders

    held = frozen_holders()             # the module's server holds one
    assert held >= 1 and gc.get_freeze_count() > 0
    with make_tiny_server() as other:
        assert frozen_holders() == held + 1
        assert other.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].token_ids
    assert frozen_holders() == held
    with make_tiny_server(freeze_gc=False):
        assert frozen_holders() == held

