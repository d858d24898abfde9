"""Every policy's batches, pinned: a faster batch formation must form the same batches.

The workload of benchmarks/scheduler_overhead.py, smaller (Llama-3 8B on the simulated
H100 TP-8, ShareGPT-like prompts with a few of 128K-1M tokens, decodes throughout), run
twice per policy: synchronously with room for everything, and with a KV cache a tenth
of the size and two batches in flight (preemptions, requests in flight skipped). The
digest covers each batch's chunks (request id, start, tokens), its predicted time to the
last bit, and the preemption count.
"""

import functools
import hashlib
import random
from unittest import mock

import pytest

from benchmarks.scheduler_overhead import (MAX_MODEL_LEN, MODEL, PARALLEL, TOKEN_BUCKETS,
                                           _decoding_request, _queued_request)
from medha_jax.config import model_preset
from medha_jax.request import SLO, Request, VirtualClock
from medha_jax.scheduler import POLICY_NAMES, SchedulerConfig, make_controller, run_one_step
from medha_jax.scheduler.hardware import hardware_preset
from medha_jax.scheduler.in_flight import InFlightRunner
from medha_jax.scheduler.packer import AdaptivePacker
from medha_jax.scheduler.predictor import AnalyticalPredictor
from medha_jax.simulator import CountingAllocator, SimulatedExecutor, kv_capacity_tokens

_MODEL = model_preset(MODEL)
_PREDICTOR = AnalyticalPredictor(_MODEL, PARALLEL, hardware_preset("h100"),
                                 token_buckets=TOKEN_BUCKETS)


def _batches_digest(policy: str, *, queued: int, decodes: int, steps: int, pages_divisor: int,
                    stages: int, target_batch_time_s: float | None = None,
                    crowd_tpots: tuple[float, ...] = (0.2,)) -> str:
    clock = VirtualClock(60.0)
    capacity = kv_capacity_tokens(_MODEL, PARALLEL, hardware_preset("h100"))
    controller = make_controller(
        SchedulerConfig(policy, token_buckets=TOKEN_BUCKETS, max_seqs_per_batch=96,
                        target_batch_time_s=target_batch_time_s),
        allocator=CountingAllocator(capacity // 16 // pages_divisor, 16), clock=clock,
        predictor=_PREDICTOR, model_config=_MODEL, max_model_len=MAX_MODEL_LEN,
        pipeline_stages=stages)
    executor = SimulatedExecutor(_PREDICTOR, clock, num_stages=stages)
    prefill_time = controller.prefill_time_cache.prefill_time
    rng = random.Random(7)
    for i in range(decodes):
        controller.add_request(_decoding_request(i, rng, clock.now()))
    digest = hashlib.sha256()
    runner = InFlightRunner(controller, executor) if stages > 1 else None
    added = 0
    new_request = _queued_request if pages_divisor == 1 else functools.partial(
        _crowding_request, tpots=crowd_tpots)
    for _ in range(steps):
        while controller.num_waiting + controller.num_running < queued + decodes:
            controller.add_request(new_request(added, rng, clock.now(), prefill_time))
            added += 1
        if runner is None:
            batch = controller.schedule()
            if batch:
                controller.update(batch, executor.execute(batch))
        else:
            collected = runner.step()
            batch = collected.batch if collected is not None else None
        chunks = [(c.request.request_id, c.start, c.num_tokens) for c in batch.chunks] \
            if batch else []
        digest.update(repr((chunks, batch.predicted_time_s if batch else None)).encode())
    digest.update(repr(controller.num_preemptions).encode())
    return digest.hexdigest()


def _crowding_request(i: int, rng: random.Random, now: float, prefill_time,
                      tpots: tuple[float, ...] = (0.2,)) -> Request:
    """One in five of 40K-200K tokens, beside short ones: a small cache fills and preempts."""
    if rng.random() < 0.2:
        prompt = rng.randint(40_000, 200_000)
        ttft = rng.choice([1.5, 3.0]) * prefill_time(prompt)
    else:
        prompt = rng.randint(16, 4000)
        ttft = rng.choice([0.5, 2.0])
    tpot = rng.choice(tpots) if len(tpots) > 1 else tpots[0]
    return Request(f"q{i}", prompt, rng.choice([1, 1, 20]), now - rng.uniform(0, 5.0),
                   slo=SLO(ttft_s=ttft, tpot_s=tpot), priority=rng.choice([0, 0, 0, 0, 1]))


# Recorded on main at 1d83ed0 (before the issue 25 item 8 rework of batch formation).
_PINNED = {
    ('fcfs-np', 'roomy'): "4f907bdac1d8efcf917bdd07a5b090424f312889a3509ac227f42384d18589b4",
    ('sarathi-512', 'roomy'): "3daaaf098164b7b5c5dde886769b152ffc9cf3fb484240b35b8109f1fadfb339",
    ('sarathi-2048', 'roomy'): "4e0f4c34b6e5ff310e4df5f3497a16071836b886e229b670ce32657240144b2c",
    ('fcfs', 'roomy'): "df0e75ddbd8aa07b4cf7ea8888905b3e12a2e152db6415e9d7e4b83648d0428b",
    ('edf', 'roomy'): "df88ebddbe222058c47f4c83add107ac573a4a5e311ed2e273dfc5d9935a9178",
    ('lrs', 'roomy'): "8acee467db8057ef0883a735b5fbe2a00f7f7cc5b72c91390836991d099781af",
    ('lars', 'roomy'): "9d0dc45fe3cd9eb8e00393ea55f1fd677e3afcb394a86c9bdd986d9d2295439e",
    ('lars-mp', 'roomy'): "b6a200ac10cb819a3c2b95bd40029c16f817732cde77cd753f214512ff42330e",
    ('fcfs-np', 'tight-in-flight'):
        "79d1e7de0f45525c808673e28bdfcb190cca2eda49382744bcf22fe25539cdba",
    ('sarathi-512', 'tight-in-flight'):
        "782effd5bfd62e7978a9bd3e724585d546e4148aad389a429b9372359eeb66ee",
    ('sarathi-2048', 'tight-in-flight'):
        "2e931d073a3bf66b0a367ef1905eb9bfc79c1ea5b0a26f399b24232fd2e66e36",
    ('fcfs', 'tight-in-flight'): "9adb784dddc8326b769efa57450dd698ab7c22ce70eb49b09bc80f7f4cf77371",
    ('edf', 'tight-in-flight'): "f490dd4395fdb575942d3d47907ba4cb653e85ac9b2cba921639ab3b49cfceba",
    ('lrs', 'tight-in-flight'): "26366203eea423693fabc3e54028350e3b90db714c11a1f53a8d4d0a69806b3b",
    ('lars', 'tight-in-flight'): "5447485af8d4d47f7612a3b230d4526c662a1c74ddc014233a97386a859772c4",
    ('lars-mp', 'tight-in-flight'):
        "249500a0d1918987c8e34eb35ab7d371d32ff90f0e782b2b0b52992a11ca05b7",
}


@pytest.mark.parametrize("policy", POLICY_NAMES)
@pytest.mark.parametrize("scenario", ["roomy", "tight-in-flight"])
def test_batches_are_pinned_across_scheduler_optimisations(policy, scenario):
    kw = (dict(queued=300, decodes=48, steps=300, pages_divisor=1, stages=1)
          if scenario == "roomy" else
          dict(queued=120, decodes=48, steps=400, pages_divisor=16, stages=2))
    assert _batches_digest(policy, **kw) == _PINNED[policy, scenario]


@pytest.mark.parametrize("policy, stages", [("lars", 1), ("lars-mp", 1), ("lars-mp", 2)])
def test_the_kept_tightest_tpot_budgets_as_a_pass_over_the_decodes(policy, stages):
    """With a default budget that the TPOTs of short-lived decodes (20 tokens, 10-200 ms,
    over one or two stages) undercut, the budget from the controller's kept tightest TPOT
    (decodes coming, finishing, preempted, in flight) forms the batches a pass over each
    step's granted decodes forms."""
    pack = AdaptivePacker.pack

    def pack_without_the_kept_tpot(self, *args, tightest_tpot=None, **kw):
        return pack(self, *args, **kw)

    kw = dict(queued=120, decodes=0, steps=300, pages_divisor=16, stages=stages,
              target_batch_time_s=0.3, crowd_tpots=(0.01, 0.05, 0.1, 0.2))
    kept = _batches_digest(policy, **kw)
    with mock.patch.object(AdaptivePacker, "pack", pack_without_the_kept_tpot):
        assert _batches_digest(policy, **kw) == kept
