"""Logprobs computed inside the step: the pure functions, the engine on one device and on
cp and spp meshes, and through Server.generate against transformers' float32 log-softmax.

Logprobs are of the raw model distribution (before temperature, top-k, top-p), so a
sampled request's logprobs are checked against the same oracle as a greedy one's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from medha_jax import SamplingParams, load_model
from medha_jax.engine import Engine, EngineConfig
from medha_jax.engine.logprobs import blocked_token_logprobs, token_logprobs
from medha_jax.request import Batch, ScheduledChunk
from meshes import ParallelConfig
from serving.server import TokensPrompt
from tests.test_engine import drive, make_request
from tests.test_stages import new_tiny_model, tiny_model

TOL = 1e-4


def log_softmax(logits) -> np.ndarray:
    return np.asarray(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1))


def check_entry(entry, expected_row: np.ndarray, k: int):
    """A TokenLogprobs against one row of the oracle's log-softmax."""
    assert abs(entry.logprob - expected_row[entry.token_id]) < TOL
    assert len(entry.top) == k
    top_ids = [t for t, _ in entry.top]
    np.testing.assert_allclose([lp for _, lp in entry.top], np.sort(expected_row)[::-1][:k],
                               atol=TOL, rtol=0)
    np.testing.assert_allclose(expected_row[top_ids], [lp for _, lp in entry.top],
                               atol=TOL, rtol=0)


# --- The pure functions ----------------------------------------------------------------------

def test_token_logprobs_and_blocks_equal_a_whole_log_softmax():
    rng = np.random.default_rng(0)
    hidden = rng.normal(size=(37, 8)).astype(np.float32)
    head_w = rng.normal(size=(8, 50)).astype(np.float32)
    head = lambda h: h @ head_w                                         # noqa: E731
    ids = rng.integers(-1, 50, 37).astype(np.int32)
    expected = log_softmax(hidden @ head_w)
    whole = token_logprobs(head(hidden), ids, 5)
    blocked = jax.jit(lambda h, i: blocked_token_logprobs(head, h, i, 5, rows_per_block=8))(
        hidden, ids)                                                    # 37 rows: a ragged tail
    for out in (whole, blocked):
        real = ids >= 0
        np.testing.assert_allclose(np.asarray(out.logprob)[real],
                                   expected[real, ids[real]], atol=1e-6)
        np.testing.assert_array_equal(np.asarray(out.top_ids), np.argsort(-expected)[:, :5])
        np.testing.assert_allclose(np.asarray(out.top_logprobs), -np.sort(-expected)[:, :5],
                                   atol=1e-6)


# --- The engine on meshes --------------------------------------------------------------------

PROMPTS = {"a": list(range(3, 43)), "b": list(range(100, 117)), "c": list(range(200, 230))}


# One compiled shape: 16-token steps of up to 4 sequences, contexts up to 64 tokens.
ENGINE = EngineConfig(page_size=16, max_kv_tokens=1024, max_model_len=64,
                      max_tokens_per_step=16, min_token_bucket=16, max_seqs=4)


def engine_logprobs(engine: Engine):
    """(tokens, sampled logprobs, prompt logprobs) of PROMPTS through `drive` (random
    chunks, decodes batched with prefills); "b" asks for nothing."""
    results = []
    execute = engine.execute
    engine.execute = lambda batch: results.append(execute(batch)) or results[-1]
    requests = [make_request("a", PROMPTS["a"], 4, logprobs=3, prompt_logprobs=2),
                make_request("b", PROMPTS["b"], 4),
                make_request("c", PROMPTS["c"], 4, temperature=1.0, seed=5, logprobs=0,
                             prompt_logprobs=0)]
    done = drive(engine, [(0, r) for r in requests], rng=np.random.default_rng(1), max_chunk=24)
    sampled = {rid: [r.logprobs[rid] for r in results if rid in r.logprobs] for rid in done}
    prompt = {rid: {p: e for r in results for p, e in r.prompt_logprobs.get(rid, {}).items()}
              for rid in done}
    assert sampled["b"] == [] and prompt["b"] == {}
    assert all(len(sampled[rid]) == 4 for rid in ("a", "c"))
    assert all(sorted(prompt[rid]) == list(range(1, len(PROMPTS[rid]))) for rid in ("a", "c"))
    engine.execute = execute
    return done, sampled, prompt


def assert_same_logprobs(got, want):
    assert got[0] == want[0]                                       # the tokens
    for rid in want[1]:
        for g, w in zip(got[1][rid], want[1][rid], strict=True):
            assert g.token_id == w.token_id and abs(g.logprob - w.logprob) < TOL
            assert [t for t, _ in g.top] == [t for t, _ in w.top]
            np.testing.assert_allclose([lp for _, lp in g.top], [lp for _, lp in w.top],
                                       atol=TOL)
        for p, w in want[2][rid].items():
            g = got[2][rid][p]
            assert g.token_id == w.token_id and abs(g.logprob - w.logprob) < TOL


@pytest.fixture(scope="module")
def one_device_engine():
    # tiny_model: the same weights on every mesh, placed without compiling an initializer.
    return Engine(tiny_model(2, ParallelConfig()), ENGINE)


@pytest.fixture(scope="module")
def one_device(one_device_engine):
    model = one_device_engine.model
    out = engine_logprobs(one_device_engine)
    # The oracle: our own one-shot forward, log-softmaxed.
    for rid in ("a", "c"):
        ids = PROMPTS[rid] + out[0][rid]
        expected = log_softmax(model.logits(ids))
        k = 3 if rid == "a" else 0
        for i, entry in enumerate(out[1][rid]):
            check_entry(entry, expected[len(PROMPTS[rid]) - 1 + i], k)
        for p, entry in out[2][rid].items():
            assert entry.token_id == ids[p]
            check_entry(entry, expected[p - 1], 2 if rid == "a" else 0)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [ParallelConfig(cp=2), ParallelConfig(spp=2)],
                         ids=["cp2", "spp2"])
def test_mesh_gives_the_one_device_logprobs(one_device, parallel):
    engine = Engine(new_tiny_model(2, parallel), ENGINE)    # spp takes its model's weights
    assert_same_logprobs(engine_logprobs(engine), one_device)


def test_a_step_without_logprobs_reads_none_back(one_device_engine):
    """Nothing asked: the step's flags stay 0, so collect reads only the tokens."""
    engine = one_device_engine
    request = make_request("x", list(range(12)), 1)
    engine.allocator.allocate("x")
    assert engine.allocator.reserve("x", 12)
    pending = engine.dispatch(Batch([ScheduledChunk(request, 0, 12)]))
    assert pending.inputs.logprobs_flags.tolist() == [0, 0]
    result = engine.collect(pending)
    engine.allocator.free("x")
    assert result.logprobs == {} and result.prompt_logprobs == {}


# --- Through Server.generate, against transformers --------------------------------------------

@pytest.mark.hf
def test_server_logprobs_equal_transformers_log_softmax(tmp_path):
    from medha_jax.scheduler import AnalyticalPredictor
    from serving.server import Server
    from tests.hf_oracle import hf_logits, save_tiny_llama
    from tests.test_server import TINY_ENGINE

    hf_model = save_tiny_llama(tmp_path / "ckpt", "gqa4-llama3-rope", seed=2)
    model = load_model(str(tmp_path / "ckpt"), verbose=False)
    predictor = AnalyticalPredictor(model.config, ParallelConfig(), "h100")
    prompts = [TokensPrompt(list(range(5, 45))), TokensPrompt([7, 3, 9, 11, 200]),
               TokensPrompt(list(range(60, 90)))]
    params = [SamplingParams(temperature=0.0, max_tokens=6, logprobs=5, prompt_logprobs=4),
              SamplingParams(temperature=0.0, max_tokens=6),              # asks for nothing
              SamplingParams(temperature=1.0, top_k=3, seed=3, max_tokens=6, logprobs=20)]
    with Server(model, engine_config=TINY_ENGINE, predictor=predictor, warmup=False) as server:
        outs = server.generate(prompts, params)
        assert server.num_free_pages == server.num_total_pages
    with_lp, without, sampled = outs
    assert without.logprobs is None and without.prompt_logprobs is None
    assert with_lp.outputs[0].logprobs == with_lp.logprobs
    for out, p, k, k_prompt in [(with_lp, prompts[0], 5, 4), (sampled, prompts[2], 20, None)]:
        ids = list(p.prompt_token_ids) + list(out.token_ids)
        expected = log_softmax(hf_logits(hf_model, ids))
        assert [e.token_id for e in out.logprobs] == list(out.token_ids)
        for i, entry in enumerate(out.logprobs):
            check_entry(entry, expected[len(p.prompt_token_ids) - 1 + i], k)
        if k_prompt is None:
            assert out.prompt_logprobs is None
            continue
        assert len(out.prompt_logprobs) == len(p.prompt_token_ids)
        assert out.prompt_logprobs[0] is None
        for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
            assert entry.token_id == ids[pos]
            check_entry(entry, expected[pos - 1], k_prompt)


def quick_tiny_server():
    """The tiny server, compiling shapes as they come and with an analytical predictor
    instead of a calibration sweep: quick to start."""
    from medha_jax.config import model_preset
    from medha_jax.scheduler import AnalyticalPredictor
    from tests.test_server import make_tiny_server

    return make_tiny_server(warmup=False, predictor=AnalyticalPredictor(
        model_preset("tiny"), ParallelConfig(), "h100"))


def test_prompt_logprobs_are_computed_even_when_the_prefix_is_cached():
    """A request asking for prompt logprobs takes nothing from the prefix cache (a reused
    position would never be computed), and still leaves its pages there for others."""
    prompt = TokensPrompt(list(range(1, 50)))
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    with quick_tiny_server() as server:
        server.generate(prompt, greedy)                           # fills the prefix cache
        asked = server.generate(prompt, SamplingParams(temperature=0.0, max_tokens=2,
                                                       prompt_logprobs=1))
        again = server.generate(prompt, greedy)
    assert asked.metrics.num_cached_tokens == 0
    assert all(e is not None for e in asked.prompt_logprobs[1:])
    assert again.metrics.num_cached_tokens == 48                  # 3 full pages of 16
