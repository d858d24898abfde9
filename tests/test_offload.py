"""The offload decision (medha_jax.cluster.offload): worked numbers, the fixed gates."""

import dataclasses
import math

import pytest

from medha_jax.cluster.offload import (OffloadConfig, OffloadReplica, OffloadRequest,
                                       choose_decode, choose_move, colocated_seconds,
                                       decode_seconds,
                                       exposed_transfer_s, first_token_s, offloaded_seconds,
                                       others_delay_s)

# A 3 s prefill queued: the 1.0 s one of REQ ends after 2 s, with 2 s of it left.
BUSY_P = OffloadReplica(True, queued_prefill_s=3.0, chunk_step_s=0.1, decode_token_s=0.02)
IDLE = OffloadReplica(True, chunk_step_s=0.1, decode_token_s=0.02)
# 1 GB of pages (1000 pages of 1 MB) behind a 1.0 s prefill.
REQ = OffloadRequest(prompt_len=16_000, cached_tokens=0, max_new_tokens=100, prefill_s=1.0,
                     ttft_s=2.0, prompt_pages=1000, page_bytes=1_000_000)
CFG = OffloadConfig(link_bytes_per_s=10e9, handshake_s=0.005)


def test_the_docstrings_worked_numbers():
    assert first_token_s(REQ, BUSY_P) == (pytest.approx(2.0), pytest.approx(2.0))
    # 2 s of prefill left at 0.1 s a step: the first 20 tokens pay a chunk step.
    assert decode_seconds(BUSY_P, 100, 2.0) == pytest.approx(20 * 0.1 + 80 * 0.02)  # 3.6
    assert colocated_seconds(REQ, BUSY_P) == pytest.approx(3.6)
    assert decode_seconds(IDLE, 100) == pytest.approx(2.0)
    # 0.1 s of transfer, 0.9 s of prefill to hide it behind: only the handshake shows.
    assert exposed_transfer_s(REQ, BUSY_P, IDLE, CFG) == pytest.approx(0.005)
    d = choose_decode(REQ, 0, [BUSY_P, IDLE], CFG)
    assert d.decode == 1
    assert (d.colocated_s, d.offloaded_s) == (pytest.approx(3.6), pytest.approx(2.025))


def test_prefill_arriving_during_the_decode_counts_through_its_recent_share():
    busy = OffloadReplica(True, chunk_step_s=0.1, decode_token_s=0.02, prefill_share=0.5)
    # Half its time in 0.1 s prefill steps, half in 0.02 s decode steps: 5 + 25 tokens a
    # second.
    assert decode_seconds(busy, 100) == pytest.approx(100 / (0.5 / 0.02 + 0.5 / 0.1))
    assert choose_decode(REQ, 0, [busy, IDLE], CFG).decode == 1
    assert choose_decode(REQ, 1, [busy, IDLE], CFG).decode is None


def test_prefill_run_before_the_first_token_does_not_slow_the_decode():
    """A short prefill behind a late 3 s one that lars-mp runs to its end first (the
    router's TTFT_P = 3.1 s): nothing is left queued on P when its decode starts, so it
    stays (processor sharing left 2.9 s there and moved the decode: 4.32 s against 2.1)."""
    short = dataclasses.replace(REQ, prefill_s=0.1, ttft_s=3.1)
    assert first_token_s(short, BUSY_P) == pytest.approx((3.1, 0.0))
    d = choose_decode(short, 0, [BUSY_P, IDLE], CFG)
    assert d.decode is None and d.colocated_s == pytest.approx(100 * 0.02)


def test_a_cold_turn_on_an_idle_replica_stays():
    d = choose_decode(REQ, 0, [IDLE, IDLE], CFG)
    assert d.decode is None and d.offloaded_s > d.colocated_s


def test_transfer_not_hidden_behind_a_short_prefill_keeps_the_decode_home():
    """A 10 GB/s link moves 100 GB in 10 s; a 0.2 s prefill hides 0.1 s of it: 9.9 s
    exposed beats 2.24 s of interference saved (2.8 s of prefill left on P) -> stays."""
    big = OffloadRequest(16_000, 15_000, 100, 0.2, 0.4, 100_000, 1_000_000)
    d = choose_decode(big, 0, [BUSY_P, IDLE], CFG)
    assert d.decode is None
    assert exposed_transfer_s(big, BUSY_P, IDLE, CFG) == pytest.approx(0.005 + 10.0 - 0.1)
    # Pages the decode replica already holds do not move.
    warm = OffloadReplica(True, chunk_step_s=0.1, decode_token_s=0.02, cached_pages=99_990)
    assert exposed_transfer_s(big, BUSY_P, warm, CFG) == pytest.approx(0.005)
    assert choose_decode(big, 0, [BUSY_P, warm], CFG).decode == 1


def test_the_decode_replica_with_the_least_predicted_time_wins():
    # 3 s queued on D, 2 s of it served by the time P's first token comes: 10 chunk steps.
    loaded = OffloadReplica(True, queued_prefill_s=3.0, chunk_step_s=0.1,
                            decode_token_s=0.02)
    assert offloaded_seconds(REQ, BUSY_P, loaded, CFG) == pytest.approx(
        10 * 0.1 + 90 * 0.02 + 0.005 + 0.02)
    d = choose_decode(REQ, 0, [BUSY_P, loaded, IDLE], CFG)
    assert d.decode == 2
    # A queue D works through before P's first token does not count.
    cleared = dataclasses.replace(loaded, queued_prefill_s=1.5)
    assert offloaded_seconds(REQ, BUSY_P, cleared, CFG) == pytest.approx(2.025)
    down = OffloadReplica(False, chunk_step_s=0.1, decode_token_s=0.02)
    assert choose_decode(REQ, 0, [BUSY_P, loaded, down], CFG).decode == 1


def test_a_prefill_only_replica_always_hands_off_when_someone_can_decode():
    p = OffloadReplica(True, prefill_only=True, decode_token_s=0.02)
    assert choose_decode(REQ, 0, [p, IDLE], OffloadConfig("never")).decode == 1
    d = choose_decode(REQ, 0, [p, OffloadReplica(False)], CFG)
    assert d.decode is None and d.offloaded_s == math.inf


@pytest.mark.parametrize("gate, prompt, cached, expect", [
    ("never", 16_000, 15_000, None),
    ("always-heavy", 16_000, 14_000, None),   # 2000 new tokens < 2048
    ("always-heavy", 16_000, 13_000, 1),      # 3000 new tokens
    ("cached-fraction", 10_000, 3_000, 1),    # 30% cached: offload
    ("cached-fraction", 10_000, 2_999, None),
    ("dynamo", 10_000, 9_000, None),          # 1000 new < 2048 and < 70%: local
    ("dynamo", 10_000, 7_000, 1),             # 3000 new >= 2048: remote
    ("dynamo", 2_000, 500, 1),                # 1500 new < 2048 but 75% of the prompt
])
def test_fixed_gates(gate, prompt, cached, expect):
    req = OffloadRequest(prompt, cached, 100, 1.0, 1.0, prompt // 16, 1000)
    assert choose_decode(req, 0, [IDLE, IDLE], OffloadConfig(gate)).decode == expect


def test_bad_config_is_named():
    with pytest.raises(ValueError, match="unknown gate 'x'"):
        OffloadConfig("x")
    with pytest.raises(ValueError, match="link_bytes_per_s must be > 0"):
        OffloadConfig(link_bytes_per_s=0)


def test_a_target_busy_with_decodes_is_not_chosen():
    """Each token pays the target's own decode step: D1 already decodes a batch it steps
    in 0.05 s -> (b) = 100 * 0.05 + 0.005 + 0.05 = 5.055 s; D2 steps in 0.025 s ->
    100 * 0.025 + 0.005 + 0.025 = 2.53 s < 3.6 * 0.9: D2, though D1 comes first."""
    busy_d = OffloadReplica(True, chunk_step_s=0.1, decode_token_s=0.02, decode_step_s=0.05)
    light_d = OffloadReplica(True, chunk_step_s=0.1, decode_token_s=0.02, decode_step_s=0.025)
    d = choose_decode(REQ, 0, [BUSY_P, busy_d, light_d], CFG)
    assert d.decode == 2
    assert (d.colocated_s, d.offloaded_s) == (pytest.approx(3.6), pytest.approx(2.53))
    assert offloaded_seconds(REQ, BUSY_P, busy_d, CFG) == pytest.approx(5.055)


def test_staying_wins_when_every_target_is_busier():
    """P steps its decodes in 0.02 s behind 2 s of prefill: (a) = 3.6 s. Every D's decode
    batch steps in 0.05 s: (b) >= 5.055 s. The time gate keeps the decode home."""
    busy_d = OffloadReplica(True, chunk_step_s=0.1, decode_token_s=0.02, decode_step_s=0.05)
    d = choose_decode(REQ, 0, [BUSY_P, busy_d, busy_d], CFG)
    assert d.decode is None
    assert (d.colocated_s, d.offloaded_s) == (pytest.approx(3.6), pytest.approx(5.055))
    # The same load on P prices staying too: 20 chunk steps + 80 steps of 0.05 s.
    loaded_p = dataclasses.replace(BUSY_P, decode_step_s=0.05)
    assert colocated_seconds(REQ, loaded_p) == pytest.approx(20 * 0.1 + 80 * 0.05)   # 6.0
    assert choose_decode(REQ, 0, [loaded_p, busy_d, IDLE], CFG).decode == 2


def test_the_decode_step_prices_every_sequence_it_carries():
    from medha_jax.config import model_preset
    from medha_jax.scheduler.hardware import hardware_preset
    from medha_jax.scheduler.predictor import AnalyticalPredictor, decode_step_seconds

    from medha_jax.config import ParallelConfig

    predictor = AnalyticalPredictor(model_preset("llama3-8b"), ParallelConfig(),
                                    hardware_preset("h100"))
    one = decode_step_seconds(predictor, [20_000])
    many = decode_step_seconds(predictor, [20_000] * 32)
    assert decode_step_seconds(predictor, []) == 0.0
    assert 0 < one < many      # 32 sequences read 32 contexts' KV in the same step


def test_the_decodes_a_request_would_slow_are_priced_on_both_sides():
    """The docstring's numbers: P decodes 8 sequences, one more adding 2 ms to its step
    (0.036 -> 0.038 s); D is slower, idle, a step alone 0.036 s. Own seconds alone,
    (a) = 3.8 s and (b) = 3.641 s > 3.8 * 0.9: it would stay. P's 8 decodes each paying
    2 ms for 100 steps add 1.6 s to (a): offload."""
    p = OffloadReplica(True, chunk_step_s=0.1, decode_token_s=0.02, decode_step_s=0.038,
                       decodes=8, decode_base_step_s=0.036)
    slow_d = OffloadReplica(True, chunk_step_s=0.1, decode_token_s=0.02, decode_step_s=0.036)
    assert others_delay_s(p, 100) == pytest.approx(8 * 100 * 0.002)
    assert colocated_seconds(REQ, p) == pytest.approx(3.8 + 1.6)
    d = choose_decode(REQ, 0, [p, slow_d], CFG)
    assert d.decode == 1
    assert (d.colocated_s, d.offloaded_s) == (pytest.approx(5.4), pytest.approx(3.641))
    without_others = dataclasses.replace(p, decodes=0)
    assert choose_decode(REQ, 0, [without_others, slow_d], CFG).decode is None
    # The same decodes on D price it alike: (b) = 3.641 + 1.6 > 5.4 * 0.9 - it stays.
    loaded_d = dataclasses.replace(slow_d, decodes=8, decode_base_step_s=0.034)
    assert offloaded_seconds(REQ, p, loaded_d, CFG) == pytest.approx(3.641 + 1.6)
    assert choose_decode(REQ, 0, [p, loaded_d], CFG).decode is None


def test_a_running_decode_moves_off_a_replica_a_long_prefill_was_queued_on():
    """100 tokens left, a 3 s prefill queued beside it at 0.1 s a chunk step: 30 tokens
    pay a chunk step there, (a) = 30 * 0.1 + 70 * 0.02 = 4.4 s. Moving 1,000 pages of 1 MB
    at 10 GB/s: nothing hides them, (b) = 0.1 + 2 * 0.02 (the step boundary that takes
    them, the first step there) + 100 * 0.02 = 2.14 s. With nothing queued where it is,
    it stays whatever the gate."""
    busy = dataclasses.replace(BUSY_P, decode_step_s=0.02, decodes=0)
    d = choose_move(16_000, 100, 16, 1_000_000, 0, [busy, IDLE],
                    dataclasses.replace(CFG, gate="never"))
    assert d.decode == 1 and d.gate == "time"
    assert (d.colocated_s, d.offloaded_s) == (pytest.approx(4.4), pytest.approx(2.14))
    # A 100 GB context: 10 s to move, more than staying costs.
    assert choose_move(1_600_000, 100, 16, 1_000_000, 0, [busy, IDLE], CFG).decode is None
    assert choose_move(16_000, 100, 16, 1_000_000, 0, [IDLE, IDLE], CFG).decode is None
    # The pages the other replica holds do not move.
    cached = dataclasses.replace(IDLE, cached_pages=1000)
    assert choose_move(16_000, 100, 16, 1_000_000, 0, [busy, cached], CFG).offloaded_s == \
        pytest.approx(2.04)
    # A destination with prefill queued waits a chunk step at each boundary, and its
    # queue slows the decode there too: 3 s queued at both, the move cannot pay.
    assert choose_move(16_000, 100, 16, 1_000_000, 0, [busy, busy], CFG).decode is None
    half = dataclasses.replace(IDLE, queued_prefill_s=0.5)
    assert choose_move(16_000, 100, 16, 1_000_000, 0, [busy, half], CFG).offloaded_s == \
        pytest.approx(0.1 + 2 * 0.1 + 5 * 0.1 + 95 * 0.02)


def test_a_replica_whose_batch_the_decode_would_fill_takes_none():
    """A step holds max_seqs sequences and decodes fill it first, so a destination must
    keep a slot for prefill: with 6 decodes of max_seqs 8 the request makes 7 and goes;
    with 7 it would fill the batch, and neither a hand-off nor a move goes there, whatever
    the gate. A prefill-only P hands off to it all the same: it cannot keep the decode."""
    roomy = dataclasses.replace(IDLE, decodes=6, max_seqs=8)
    full = dataclasses.replace(IDLE, decodes=7, max_seqs=8)
    assert roomy.has_room and not full.has_room
    assert choose_decode(REQ, 0, [BUSY_P, roomy], CFG).decode == 1
    assert choose_decode(REQ, 0, [BUSY_P, full], CFG).decode is None
    assert choose_decode(REQ, 0, [BUSY_P, full, roomy], CFG).decode == 2
    assert choose_decode(REQ, 0, [BUSY_P, full], OffloadConfig("always-heavy")).decode is None
    p = OffloadReplica(True, prefill_only=True, decode_token_s=0.02)
    assert choose_decode(REQ, 0, [p, full], CFG).decode == 1
    busy = dataclasses.replace(BUSY_P, decode_step_s=0.02, decodes=0)
    assert choose_move(16_000, 100, 16, 1_000_000, 0, [busy, roomy], CFG).decode == 1
    assert choose_move(16_000, 100, 16, 1_000_000, 0, [busy, full], CFG).decode is None


def test_decodes_past_the_batch_take_turns_and_price_it():
    """11 decodes and this one on a replica whose step holds 8: each gets a step in 1.5,
    so staying costs 1.5x (a 2 s decode: 3 s), and an idle D wins."""
    crowded = dataclasses.replace(IDLE, decodes=11, max_seqs=8)
    assert crowded.turns == pytest.approx(1.5)
    assert decode_seconds(crowded, 100) == pytest.approx(1.5 * 100 * 0.02)
    assert decode_seconds(dataclasses.replace(crowded, max_seqs=0), 100) == \
        pytest.approx(100 * 0.02)
    assert choose_decode(REQ, 0, [crowded, IDLE], CFG).decode == 1
