"""The cp ring's cost model and the pass-KV / pass-Q heuristic (seed 002, Alg. 1 and 5)."""

import dataclasses

import pytest

from medha_jax.config import ModelConfig, ParallelConfig, model_preset
from medha_jax.scheduler.cp_cost import PASS_KV, PASS_Q, RingCost, choose_pass_q
from medha_jax.scheduler.hardware import hardware_preset
from medha_jax.scheduler.predictor import AnalyticalPredictor, BatchFeatures

# Seed 002 table 9: 128 query heads, 8 K/V heads; CP4 nodes of TP8 over a 50 GB/s link.
LLAMA3_405B = ModelConfig(name="llama3-405b", vocab_size=128_256, hidden_size=16_384,
                          num_layers=126, num_heads=128, num_kv_heads=8, head_dim=128,
                          intermediate_size=53_248, dtype="bfloat16")
RDMA_H100 = dataclasses.replace(hardware_preset("h100"), interconnect_bandwidth=50e9)


def ring(**kw):
    return RingCost.create(LLAMA3_405B, RDMA_H100, num_ranks=4, tp=8, **kw)


def test_thresholds_are_the_papers_formulas():
    cost = ring()
    c, bw = 989e12 * 0.6, 50e9 * 0.75
    # Eq. 2: N C N_KV e / (2 N_H BW), per device: 1 K/V head and 16 query heads.
    assert cost.min_new_tokens_for_pass_kv() == pytest.approx(4 * c * 1 * 2 / (2 * 16 * bw))
    # Eq. 1: 2 N_KV / N_H = 12.5% for Llama 3 405B (seed 002 section 4.2.4).
    assert cost.miss_rate_threshold(1000, all2all=False) == pytest.approx(0.125)
    # Eq. 5 lowers it by 4 T BW / (N C e).
    assert cost.miss_rate_threshold(1000) == pytest.approx(0.125 - 4 * 1000 * bw / (4 * c * 2))


def test_full_prefill_passes_kv_decode_and_high_hit_partial_prefill_pass_q():
    cost = ring()
    assert cost.choose(128_000, 0) == PASS_KV                   # P = 0
    assert cost.choose(1, 127_999) == PASS_Q                    # a decode
    assert cost.choose(1280, 126_720) == PASS_Q                 # 1% misses
    assert cost.choose(25_600, 102_400) == PASS_KV              # 20% > 12.5%
    # Algorithm 5 switches to pass-KV earlier than Algorithm 1 (the All2All pass-Q pays).
    misses = [t for t in range(100, 20_000, 100)]
    alg1 = next(t for t in misses if cost.choose(t, 128_000 - t, all2all=False) == PASS_KV)
    alg5 = next(t for t in misses if cost.choose(t, 128_000 - t) == PASS_KV)
    assert alg5 <= alg1


def test_messages_are_the_blocks_each_variant_sends():
    cost = ring()
    # Per device, bf16: pass-KV sends K and V of (T + P) / N tokens of 1 head of 128, and
    # the new tokens' int32 sequence ids and positions.
    assert cost.step_bytes(PASS_KV, 1000, 3000) == 2 * 1000 * 128 * 2 + 250 * 8
    # pass-Q sends Q of T / N tokens of 16 heads with their positions and its rank, and
    # All2All's (N - 1) f32 partials + LSE.
    assert cost.step_bytes(PASS_Q, 1000, 3000) == 250 * (16 * 128 * 2 + 4) + 4
    assert cost.all2all_bytes(PASS_Q, 1000) == 3 * 250 * 16 * 129 * 4
    assert cost.all2all_bytes(PASS_KV, 1000) == 0
    # A long enough block hides its transfer: nothing exposed.
    assert cost.exposed_s(PASS_KV, 64_000, 64_000) == 0.0
    assert cost.exposed_s(PASS_Q, 1280, 126_720) > 0.0          # the All2All at least


def test_the_predictor_prices_a_cp_prefill_by_the_heuristics_variant():
    features = BatchFeatures().plus_chunk(1280, 126_720, True)   # 1% misses: pass-Q
    auto, kv, q = (AnalyticalPredictor(LLAMA3_405B, ParallelConfig(cp=4, tp=8), RDMA_H100,
                                       cp_variant=v).predict_features(features)
                   for v in (None, PASS_KV, PASS_Q))
    assert q < kv and auto == q
    full = BatchFeatures().plus_chunk(64_000, 0, True)
    one, four = (AnalyticalPredictor(LLAMA3_405B, ParallelConfig(cp=cp, tp=8),
                                     RDMA_H100).predict_features(full) for cp in (1, 4))
    assert one / 4 < four < one / 3                            # near-linear in ranks


def test_choose_pass_q_for_a_model_preset():
    tiny = model_preset("tiny")
    assert choose_pass_q(tiny, new_tokens=1, cached_tokens=100, num_ranks=2)
    assert not choose_pass_q(tiny, new_tokens=100, cached_tokens=0, num_ranks=2)
    with pytest.raises(ValueError, match="new_tokens"):
        RingCost.create(tiny, num_ranks=2).choose(0, 10)


def test_messages_are_priced_as_the_padded_buffers_the_ring_sends():
    buckets = dict(page_size=16, token_buckets=(16, 32, 64, 128), page_buckets=(16, 64, 256))
    cost = ring(**buckets)
    kv = 2 * 1 * 128 * 2                                        # K and V bytes of a token
    # 263 new tokens over 4 ranks: 66 a rank, padded to 128; 2936 cached over 4 ranks in
    # 16-token pages, 8 sequences' last pages half full: ceil(45.9 + 3.5) = 50 -> 64 pages.
    assert cost.step_bytes(PASS_KV, 263, 2936, seqs=8) == (128 + 64 * 16) * kv + 128 * 8
    assert cost.step_bytes(PASS_Q, 263, 2936, seqs=8) == 128 * (16 * 128 * 2 + 4) + 4
    # A full prefill has no cached page but sends the smallest page rung (a static shape).
    assert cost.step_bytes(PASS_KV, 512, 0) == (128 + 16 * 16) * kv + 128 * 8
    unpadded = ring()
    assert unpadded.step_bytes(PASS_KV, 263, 2936, seqs=8) == pytest.approx(
        (66 + 2936 / 4) * kv + 66 * 8)
