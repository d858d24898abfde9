"""The decode / prefill split of a step: the engine orders a batch's one-token sequences
first and says how many (StepInputs.num_decodes), the model hands that to the attention
kernels, which serve those sequences with the decode kernel (tests/test_ragged_paged_attention
.py::test_decode_sequences_run_the_decode_kernel shows which kernel served which token)."""

import jax
import numpy as np
import pytest

from medha_jax import load_model
from medha_jax.engine import Engine
from medha_jax.engine.step_inputs import unpack_int32
from medha_jax.model import attention as model_attention
from medha_jax.request import Batch, ScheduledChunk
from tests.test_engine import SMALL, drive, make_request


def test_the_engine_orders_decodes_first_and_counts_them(monkeypatch):
    engine = Engine(load_model("tiny", verbose=False), SMALL)
    seen = []
    real = model_attention.ragged_paged_attention

    def spy(*args, **kwargs):
        seen.append(kwargs.get("num_decodes"))
        return real(*args, **kwargs)

    monkeypatch.setattr(model_attention, "ragged_paged_attention", spy)
    jax.clear_caches()              # the step must be traced again, through the spy
    requests = [make_request(f"r{i}", list(range(3, 3 + n)), 4) for i, n in enumerate((9, 5, 12))]
    for r in requests:
        engine.allocator.allocate(r.request_id)
        assert engine.allocator.reserve(r.request_id, r.prompt_len + 1)
    # r1 and r2 are decodes (their prompts computed, one token sampled); r0 is a chunk.
    for r in requests[1:]:
        r.num_computed_tokens = r.prompt_len
        r.output_token_ids.append(7)
    batch = Batch([ScheduledChunk(requests[0], 0, 9), ScheduledChunk(requests[1], 5, 1),
                   ScheduledChunk(requests[2], 12, 1)])
    pending = engine.dispatch(batch)
    assert [c.request.request_id for c in pending.batch.chunks] == ["r1", "r2", "r0"]
    result = engine.collect(pending)
    assert set(result.sampled_token_ids) == {"r0", "r1", "r2"}
    assert seen and all(n is not None for n in seen)     # the model passed the split
    # The packed inputs of that order carry num_decodes = 2.
    from medha_jax.engine.step_inputs import build_step_inputs
    inputs = build_step_inputs(pending.batch, engine.allocator, engine.ladder,
                               pad_slot=engine.pad_slot)
    fields = unpack_int32(inputs.pack()[0], inputs.padded_shape)
    assert int(fields["num_decodes"][0]) == 2 and int(fields["num_seqs"][0]) == 3


@pytest.mark.slow
def test_tokens_are_unchanged_with_the_split_in_the_pallas_kernels():
    """The interpret-mode Pallas kernels (decode kernel for the decodes, ragged kernel for
    the chunks) give the XLA path's tokens on a workload of chunks beside decodes."""
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in (21, 6, 40)]

    def run(impl):
        engine = Engine(load_model("tiny", attention_impl=impl, verbose=False), SMALL)
        arrivals = [(i, make_request(f"p{i}", p, 5)) for i, p in enumerate(prompts)]
        return drive(engine, arrivals, rng=np.random.default_rng(3), max_chunk=16)

    assert run("interpret") == run("xla")
