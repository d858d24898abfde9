"""Runtime predictors: how long will one iteration (one Batch) take?

The batch packer asks this many times per iteration (a binary search per prefill), so
every predictor works on `BatchFeatures`, a handful of sums the packer updates in O(1)
as it adds a chunk. Two implementations:

- `AnalyticalPredictor`: a roofline over ModelConfig x ParallelConfig x HardwareSpec,
  per operator class (linear layers, attention over the earlier context, attention
  within the chunk), each the slower of its compute and its memory traffic, with
  efficiency factors; plus the collectives of tensor and KV-cache parallelism and the
  stage time of stream pipeline parallelism. What the simulator runs on.
- `ProfiledPredictor`: the latency model of Tetris (seed 001, Eq. 1), constant + linear
  in tokens + tokens x context + tokens^2, fitted by least squares to step times the
  engine measured on this machine. What the server runs on.

A chunk of c tokens that ends at context length e (= chunk.start + c) attends to
c * e - c * (c - 1) / 2 (query, key) pairs: c * (e - c) over the earlier context and
c * (c + 1) / 2 within the chunk (causal).
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple, Protocol

import numpy as np

from medha_jax.buckets import padded_size
from medha_jax.config import ModelConfig, ParallelConfig
from medha_jax.request import Batch
from medha_jax.scheduler.cp_cost import PASS_Q, RingCost
from medha_jax.scheduler.hardware import HardwareSpec, hardware_preset

_tuple_new = tuple.__new__


class BatchFeatures(NamedTuple):
    """What a predictor needs to know about a batch; sums over its chunks.

    tokens:              real tokens (decodes count 1 each).
    padded_tokens:       tokens after padding to the engine's next token bucket (what
                         the step costs); equal to `tokens` without buckets.
    seqs:                sequences (chunks) in the batch.
    sum_chunk_x_context: sum of chunk tokens x context length after the chunk (chunk.end),
                         the same convention as the engine's step records.
    sum_chunk_sq:        sum of chunk tokens squared.
    sum_context:         sum of context lengths after the chunk: KV tokens attention reads.
    sampling_tokens:     tokens of the chunks that sample (decodes, last prefill chunks).
    prefill_chunks:      chunks of two or more tokens. Attention kernels take single-token
                         chunks (decodes) and longer ones down different paths: a longer
                         chunk pays per query block (a fixed cost, and one pass over its
                         context per block), whatever its length below the block size.
    sum_prefill_context: sum of context lengths after the chunk over those chunks.
    max_context:         the longest context after its chunk (KVP prices the busiest shard).
    max_decode_context:  the longest context of a single-token chunk. A batched decode
                         that cannot skip ragged ends (the XLA attention path) streams
                         a group of sequences up to it.
    """

    tokens: int = 0
    padded_tokens: int = 0
    seqs: int = 0
    sum_chunk_x_context: int = 0
    sum_chunk_sq: int = 0
    sum_context: int = 0
    sampling_tokens: int = 0
    prefill_chunks: int = 0
    sum_prefill_context: int = 0
    max_decode_context: int = 0
    max_context: int = 0

    @property
    def sum_decode_context(self) -> int:
        """Sum of context lengths after the chunk over single-token chunks (decodes)."""
        return self.sum_context - self.sum_prefill_context

    def plus_chunk(self, num_tokens: int, start: int, samples: bool,
                   token_buckets: Sequence[int] | None = None) -> BatchFeatures:
        """These features with one more chunk of num_tokens tokens starting at `start`."""
        (base_tokens, _, seqs, sum_cx, sum_sq, sum_context, sampling, prefills, sum_prefill_ctx,
         max_decode_ctx, max_ctx) = self     # one unpacking, not eleven field reads
        tokens = base_tokens + num_tokens
        end = start + num_tokens
        prefill = num_tokens > 1
        padded = tokens
        if token_buckets is not None and tokens:    # padded_size, inlined: called per probe
            i = bisect.bisect_left(token_buckets, tokens)
            padded = token_buckets[i] if i < len(token_buckets) else \
                padded_size(tokens, token_buckets)    # raises: past the largest bucket
        # tuple.__new__: the NamedTuple's own __new__ is a Python function (a call more).
        return _tuple_new(BatchFeatures, (
            tokens, padded, seqs + 1, sum_cx + num_tokens * end,
            sum_sq + num_tokens * num_tokens, sum_context + end,
            sampling + num_tokens if samples else sampling,
            prefills + prefill,
            sum_prefill_ctx + end if prefill else sum_prefill_ctx,
            max_decode_ctx if prefill else (max_decode_ctx if max_decode_ctx > end else end),
            max_ctx if max_ctx > end else end))


def batch_features(batch: Batch, token_buckets: Sequence[int] | None = None) -> BatchFeatures:
    """Features of a whole batch (the engine records these beside each measured step)."""
    tokens = sum_cx = sum_sq = sum_ctx = sampling = prefills = sum_prefill_ctx = max_decode = 0
    max_ctx = 0
    for chunk in batch.chunks:
        n, end = chunk.num_tokens, chunk.end
        tokens += n
        sum_cx += n * end
        sum_sq += n * n
        sum_ctx += end
        max_ctx = max(max_ctx, end)
        if chunk.samples:
            sampling += n
        if n > 1:
            prefills += 1
            sum_prefill_ctx += end
        else:
            max_decode = max(max_decode, end)
    return BatchFeatures(tokens, padded_size(tokens, token_buckets), len(batch.chunks),
                         sum_cx, sum_sq, sum_ctx, sampling, prefills, sum_prefill_ctx, max_decode,
                         max_ctx)


def decode_token_seconds(predictor, seats: int) -> float:
    """What one decode token adds to a replica's work: a full decode batch of `seats`
    sequences at a short context, per sequence (what routers price queued decodes at)."""
    full_decode = BatchFeatures(seats, seats, seats, seats, seats, seats, seats,
                                max_decode_context=1)
    return predictor.predict_features(full_decode) / seats


def decode_step_seconds(predictor, contexts: Sequence[int]) -> float:
    """Predicted seconds of one step decoding a token for each sequence at these context
    lengths (tokens before the step): what each of their tokens waits for."""
    features = BatchFeatures()
    for context in contexts:
        features = features.plus_chunk(1, context, True)
    return predictor.predict_features(features) if contexts else 0.0


def chunk_time(predictor, base: BatchFeatures, n: int, start: int, remaining: int,
               token_buckets: Sequence[int] | None) -> float:
    """Predicted seconds of `base` plus a chunk of n tokens from `start` of a request with
    `remaining` tokens left (it samples at n == remaining): exactly
    predict_features(base.plus_chunk(n, start, n == remaining, token_buckets)).

    The packer prices every chunk it considers this way; a predictor may offer a
    `chunk_time` of its own that computes the same float without building the features."""
    own = getattr(predictor, "chunk_time", None)
    if own is not None:
        return own(base, n, start, remaining, token_buckets)
    return predictor.predict_features(base.plus_chunk(n, start, n == remaining, token_buckets))


def plus_chunk_time(predictor, base: BatchFeatures, n: int, start: int, remaining: int,
                    token_buckets: Sequence[int] | None) -> tuple[BatchFeatures, float]:
    """`chunk_time`'s chunk added: base.plus_chunk(n, start, n == remaining, token_buckets)
    and its predict_features, exactly.

    The packer prices a rider's whole rest this way (most riders are granted it, and then
    it needs both); a predictor may offer a `plus_chunk_time` of its own that does it in
    one call."""
    own = getattr(predictor, "plus_chunk_time", None)
    if own is not None:
        return own(base, n, start, remaining, token_buckets)
    features = base.plus_chunk(n, start, n == remaining, token_buckets)
    return features, predictor.predict_features(features)


class RuntimePredictor(Protocol):
    """Predicted seconds of one iteration."""

    token_buckets: tuple[int, ...] | None

    def predict_features(self, features: BatchFeatures) -> float: ...

    def predict(self, batch: Batch) -> float: ...


# ----------------------------------------------------------------------------- analytical


@dataclasses.dataclass(frozen=True, kw_only=True)
class Efficiency:
    """Fractions of the hardware peaks real kernels reach, and fixed costs.

    The defaults are typical published figures for bf16 on H100-class parts: large GEMMs
    reach ~70% of peak, flash attention forward ~50%, streaming kernels ~85% of HBM
    bandwidth, NCCL/ICI collectives ~75% of link bandwidth. step_overhead_s covers host
    dispatch and sampling of one step; collective_latency_s is the fixed cost of one
    collective or point-to-point transfer.
    """

    matmul: float = 0.7
    attention: float = 0.6
    hbm: float = 0.85
    interconnect: float = 0.75
    step_overhead_s: float = 1e-3
    collective_latency_s: float = 10e-6

    def __post_init__(self):
        for field in ("matmul", "attention", "hbm", "interconnect"):
            value = getattr(self, field)
            if not 0 < value <= 1:
                raise ValueError(f"Efficiency.{field} must be in (0, 1], got {value!r}")
        for field in ("step_overhead_s", "collective_latency_s"):
            if getattr(self, field) < 0:
                raise ValueError(f"Efficiency.{field} must be >= 0, got {getattr(self, field)!r}")


def _bytes_per_value(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


class AnalyticalPredictor:
    """Roofline time of one iteration of one replica.

    Per operator class, time = max(FLOPs / (peak * eff), bytes / (HBM bandwidth * eff)):
      linear layers:     2 x params x padded tokens FLOPs (the LM head only for the
                         sequences' last tokens); reads every weight once per step.
      earlier context:   4 x heads x head_dim FLOPs per (query, key) pair; reads the KV
                         cache of every sequence's context.
      within the chunk:  causal pairs c (c + 1) / 2; reads/writes the chunk's Q, K, V, O.
    Parallelism (one replica = spp x kvp x cp x tp devices; dp replicas are separate):
      tp  divides heads and weights; each layer adds two ring all-reduces of the
          activations. KV heads are replicated when tp > num_kv_heads.
      kvp divides attention over the earlier context by shard: a sequence's cache fills a
          shard up to kv_tokens_per_shard tokens, then the next (Medha's progressive
          scaling), so the busiest shard reads max(earlier KV / kvp, the longest context
          capped at kv_tokens_per_shard); None spreads every context over all shards. Each
          layer then merges the shards' partial outputs with one pmax of the LSEs and one
          psum of the float32 [tokens, heads, head_dim + 1] weighted outputs and weights
          (a ring all-reduce each). Queries are replicated: linear layers and the
          attention within the chunk do not shrink with kvp.
      cp  divides tokens (balanced 2N-chunk sharding): linear work and attention FLOPs
          shrink by cp; the ring's transfers not hidden under attention (and pass-Q's
          All2All) are added, for the variant Algorithm 5 picks (`cp_cost.RingCost`).
      spp the prediction is one stage's time: the layers / spp of the slowest stage and
          the hand-off of the activations to the next stage. The executors keep up to
          spp batches in flight (medha_jax.scheduler.in_flight): a prefill's chunk i+1
          enters stage 0 while chunk i is in stage 1 (seed 000 sec. 3.3), so the prefill
          stream costs one stage per iteration, while a sampled token leaves only after
          spp stages and its sequence's next decode waits for it. That depth is the
          executor's (the simulator runs batches through the stages), not the price. The
          LM head (last stage only) and the host's per-step overhead (paid once per
          batch, at dispatch) are spread evenly over the stages, so that a batch's trip
          through all of them costs what it does on the devices.
    """

    def __init__(self, model: ModelConfig, parallel: ParallelConfig = ParallelConfig(),
                 hardware: HardwareSpec | str = "h100", *, efficiency: Efficiency = Efficiency(),
                 token_buckets: Sequence[int] | None = None,
                 kv_tokens_per_shard: int | None = None, cp_variant: str | None = None):
        if isinstance(hardware, str):
            hardware = hardware_preset(hardware)
        self.model, self.parallel, self.hardware = model, parallel, hardware
        self.efficiency = efficiency
        self.token_buckets = tuple(token_buckets) if token_buckets is not None else None
        m, p, hw, eff = model, parallel, hardware, efficiency
        b = _bytes_per_value(m.dtype)
        d, hd = m.hidden_size, m.head_dim
        layers = math.ceil(m.num_layers / p.spp)                # layers of the slowest stage
        tp_kv = min(p.tp, m.num_kv_heads)                       # KV heads split at most this far
        flops_s = hw.peak_flops
        hbm_s = hw.hbm_bandwidth * eff.hbm
        link_s = hw.interconnect_bandwidth * eff.interconnect
        layer_params = d * hd * (2 * m.num_heads + 2 * m.num_kv_heads) + 3 * d * m.intermediate_size
        head_params = m.vocab_size * d

        # Linear layers: seconds per padded token / per sequence (LM head row), and the
        # weight read that bounds small batches.
        self._linear_s_per_token = \
            2 * layer_params * layers / (p.tp * p.cp) / (flops_s * eff.matmul)
        self._head_s_per_seq = 2 * head_params / p.tp / p.spp / (flops_s * eff.matmul)
        self._weights_read_s = b * (layer_params * layers + head_params / p.spp) / p.tp / hbm_s
        # Activations in and out of each matmul (x, qkv, attn out, gate/up, down).
        act_values = 3 * d + hd * (m.num_heads + 2 * m.num_kv_heads) + 3 * m.intermediate_size
        self._act_read_s_per_token = b * act_values * layers / (p.tp * p.cp) / hbm_s

        attn_flops_per_pair = 4 * m.num_heads * hd * layers / (p.tp * p.cp)
        self._attn_s_per_pair = attn_flops_per_pair / (flops_s * eff.attention)
        kv_bytes_per_token = 2 * m.num_kv_heads * hd * b * layers / tp_kv   # K and V, this device
        self._kv_read_s_per_token = kv_bytes_per_token / hbm_s
        self._kvp, self._cp = p.kvp, p.cp
        # Within-chunk traffic: Q and O read/written, K and V written, per token.
        self._chunk_io_s_per_token = \
            b * hd * (2 * m.num_heads / p.tp + 2 * m.num_kv_heads / tp_kv) * layers / p.cp / hbm_s
        # ---- cp hook: the ring's cost and the pass-KV/pass-Q choice live in cp_cost ----
        # cp_variant None lets Algorithm 5 choose per batch; cp_cost.PASS_KV / PASS_Q force.
        self._cp_ring = RingCost.create(
            m, hw, num_ranks=p.cp, tp=p.tp, spp=p.spp, attention_efficiency=eff.attention,
            interconnect_efficiency=eff.interconnect,
            latency_s=eff.collective_latency_s) if p.cp > 1 else None
        self._cp_variant = cp_variant

        lat = eff.collective_latency_s
        # TP: two ring all-reduces of [tokens, d] per layer.
        self._tp_s_per_token = \
            (2 * layers * 2 * (p.tp - 1) / p.tp * b * d / p.cp / link_s) if p.tp > 1 else 0.0
        self._tp_fixed_s = 2 * layers * lat if p.tp > 1 else 0.0
        # KVP: per layer, a ring all-reduce (pmax) of float32 LSEs [tokens, heads] and one
        # (psum) of the weighted outputs and weights [tokens, heads, head_dim + 1].
        merge_bytes_per_token = 4 * m.num_heads / p.tp * (hd + 2)
        self._kvp_s_per_token = \
            (layers * 2 * (p.kvp - 1) / p.kvp * merge_bytes_per_token / link_s) \
            if p.kvp > 1 else 0.0
        self._kvp_fixed_s = 2 * layers * lat if p.kvp > 1 else 0.0
        self._kv_tokens_per_shard = kv_tokens_per_shard
        # SPP: activations [tokens, d] to the next stage.
        self._p2p_s_per_token = (b * d / p.tp / link_s) if p.spp > 1 else 0.0
        self._p2p_fixed_s = lat if p.spp > 1 else 0.0
        self._fixed_collectives_s = self._tp_fixed_s + self._kvp_fixed_s + self._p2p_fixed_s
        self._overhead_s = eff.step_overhead_s / p.spp
        # Without cp every term grows (or stays) with a chunk's tokens, and so does their
        # float sum (the packer then skips a one-token test where the whole chunk fits);
        # cp's exposed ring time shrinks as more attention hides it.
        self.chunk_time_grows_with_n = p.cp == 1
        self._folds_chunks = p.kvp == 1 and p.cp == 1      # chunk_time's shortcut applies
        self._fold_constants = (
            self._linear_s_per_token, self._head_s_per_seq, self._weights_read_s,
            self._act_read_s_per_token, self._attn_s_per_pair, self._kv_read_s_per_token,
            self._chunk_io_s_per_token, self._overhead_s, self._fixed_collectives_s,
            self._tp_s_per_token, self._p2p_s_per_token)

    def predict_features(self, f: BatchFeatures) -> float:
        # Called thousands of times per iteration by the packer's searches: plain
        # conditional expressions instead of max() keep it at about a microsecond.
        if f.seqs == 0:
            return 0.0
        padded, tokens = f.padded_tokens, f.tokens
        compute = self._linear_s_per_token * padded + self._head_s_per_seq * f.seqs
        memory = self._weights_read_s + self._act_read_s_per_token * padded
        linear = compute if compute > memory else memory
        earlier = f.sum_context - tokens
        busiest_shard = self._busiest_kv_shard(earlier, f.max_context)
        shard_share = busiest_shard / earlier if earlier > 0 else 0.0
        earlier_kv_s = self._kv_read_s_per_token * busiest_shard / self._cp
        context = self._attn_s_per_pair * (f.sum_chunk_x_context - f.sum_chunk_sq) * shard_share
        if earlier_kv_s > context:
            context = earlier_kv_s
        if self._cp_ring is not None:                    # cp hook (see __init__)
            variant = self._cp_variant or (
                PASS_Q if tokens == f.seqs else self._cp_ring.choose(tokens, earlier))
            context += self._cp_ring.exposed_s(variant, tokens, earlier)
        within = self._attn_s_per_pair * (f.sum_chunk_sq + tokens) / 2
        chunk_io = self._chunk_io_s_per_token * tokens
        if chunk_io > within:
            within = chunk_io
        collectives = (self._fixed_collectives_s + self._tp_s_per_token * padded
                       + self._kvp_s_per_token * tokens + self._p2p_s_per_token * padded)
        return self._overhead_s + linear + context + within + collectives

    def chunk_time(self, base: BatchFeatures, n: int, start: int, remaining: int,
                   token_buckets: Sequence[int] | None) -> float:
        """`predictor.chunk_time`: predict_features of base plus one chunk, the same
        floating-point operations in the same order, without the features (without kvp
        and cp, where the busiest shard's KV read is the whole earlier context)."""
        if not self._folds_chunks or token_buckets is None:
            return self.predict_features(base.plus_chunk(n, start, n == remaining,
                                                         token_buckets))
        # One unpacking each of the batch and of the constants instead of a dozen attribute
        # reads: the packer prices every chunk it considers here.
        base_tokens, _, seqs, sum_cx, sum_sq, sum_context, _, _, _, _, _ = base
        (linear_s, head_s, weights_s, act_s, pair_s, kv_s, io_s, overhead_s, fixed_s, tp_s,
         p2p_s) = self._fold_constants
        tokens = base_tokens + n
        padded = token_buckets[bisect.bisect_left(token_buckets, tokens)] \
            if tokens <= token_buckets[-1] else padded_size(tokens, token_buckets)
        compute = linear_s * padded + head_s * (seqs + 1)
        memory = weights_s + act_s * padded
        earlier = sum_context + start - base_tokens                # sum_context - tokens
        context = pair_s * (sum_cx - sum_sq + n * start) * (1.0 if earlier > 0 else 0.0)
        earlier_kv_s = kv_s * earlier                               # (/ cp = 1)
        if earlier_kv_s > context:
            context = earlier_kv_s
        within = pair_s * (sum_sq + n * n + tokens) / 2
        chunk_io = io_s * tokens
        if chunk_io > within:
            within = chunk_io
        # (+ kvp_s * tokens is + 0.0 here, which changes no float.)
        return (overhead_s + (compute if compute > memory else memory) + context + within
                + (fixed_s + tp_s * padded + p2p_s * padded))

    def plus_chunk_time(self, base: BatchFeatures, n: int, start: int, remaining: int,
                        token_buckets: Sequence[int] | None) -> tuple[BatchFeatures, float]:
        """`predictor.plus_chunk_time`: the features and chunk_time's float in one call,
        the features' sums computed once (plus_chunk's), the seconds by chunk_time's
        operations on them."""
        if not self._folds_chunks or token_buckets is None:
            features = base.plus_chunk(n, start, n == remaining, token_buckets)
            return features, self.predict_features(features)
        (base_tokens, _, seqs, sum_cx, sum_sq, sum_context, sampling, prefills,
         sum_prefill_ctx, max_decode_ctx, max_ctx) = base
        (linear_s, head_s, weights_s, act_s, pair_s, kv_s, io_s, overhead_s, fixed_s, tp_s,
         p2p_s) = self._fold_constants
        tokens = base_tokens + n
        padded = token_buckets[bisect.bisect_left(token_buckets, tokens)] \
            if tokens <= token_buckets[-1] else padded_size(tokens, token_buckets)
        end = start + n
        seqs, sum_cx, sum_sq, sum_context = seqs + 1, sum_cx + n * end, sum_sq + n * n, \
            sum_context + end
        prefill = n > 1
        features = _tuple_new(BatchFeatures, (
            tokens, padded, seqs, sum_cx, sum_sq, sum_context,
            sampling + n if n == remaining else sampling, prefills + prefill,
            sum_prefill_ctx + end if prefill else sum_prefill_ctx,
            max_decode_ctx if prefill else (max_decode_ctx if max_decode_ctx > end else end),
            max_ctx if max_ctx > end else end))
        compute = linear_s * padded + head_s * seqs
        memory = weights_s + act_s * padded
        earlier = sum_context - tokens
        context = pair_s * (sum_cx - sum_sq) * (1.0 if earlier > 0 else 0.0)
        earlier_kv_s = kv_s * earlier
        if earlier_kv_s > context:
            context = earlier_kv_s
        within = pair_s * (sum_sq + tokens) / 2
        chunk_io = io_s * tokens
        if chunk_io > within:
            within = chunk_io
        return features, (overhead_s + (compute if compute > memory else memory) + context
                          + within + (fixed_s + tp_s * padded + p2p_s * padded))

    def _busiest_kv_shard(self, earlier_tokens: int, max_context: int) -> float:
        """Earlier-context KV tokens the busiest KV shard reads (all of them at kvp = 1)."""
        if self._kvp == 1:
            return earlier_tokens
        spread = earlier_tokens / self._kvp
        per_shard = self._kv_tokens_per_shard
        longest = min(max_context, per_shard) if per_shard else max_context / self._kvp
        return min(earlier_tokens, spread if spread > longest else longest)

    def predict(self, batch: Batch) -> float:
        return self.predict_features(batch_features(batch, self.token_buckets))


# ------------------------------------------------------------------------------ profiled

PROFILED_FEATURES = ("1", "padded_tokens", "sum_chunk_x_context", "sum_chunk_sq",
                     "prefill_chunks", "sum_prefill_context", "sum_decode_context",
                     "max_decode_context")


def _feature_row(f: BatchFeatures) -> tuple[float, ...]:
    return (1.0, f.padded_tokens, f.sum_chunk_x_context, f.sum_chunk_sq, f.prefill_chunks,
            f.sum_prefill_context, f.sum_decode_context, f.max_decode_context)


def _nonnegative_least_squares(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin ||a x - y|| subject to x >= 0, exactly, for a handful of columns.

    Tries every subset of free columns (2^8 = 256 small solves) and keeps the best
    feasible one: with few features this is exact and simpler than an active-set loop.
    """
    n = a.shape[1]
    best, best_residual = np.zeros(n), float(np.sum(y * y))
    for mask in range(1, 2 ** n):
        cols = [j for j in range(n) if mask >> j & 1]
        sol, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
        if np.any(sol < 0):
            continue
        x = np.zeros(n)
        x[cols] = sol
        residual = float(np.sum((a @ x - y) ** 2))
        if residual < best_residual:
            best, best_residual = x, residual
    return best


class ProfiledPredictor:
    """A linear latency model fitted to step times measured on this machine:

        t = c0 + c1 * padded_tokens + c2 * sum(chunk x context) + c3 * sum(chunk^2)
               + c4 * prefill_chunks + c5 * sum(prefill chunk context)
               + c6 * sum(decode context) + c7 * max_decode_context

    The first four terms are Tetris Eq. 1 (seed 001: constant, fully connected layers,
    attention with the history, attention within the chunk). We add four, because
    Eq. 1 assumes attention work proportional to (query, key) pairs and the kernels we
    run are not: a prefill chunk pays per query block, so a 20-token chunk costs nearly
    what a full block does (c4), and reads its context at least once (c5); a decode
    reads its context at a per-key cost of its own (c6), and the XLA path's decode
    streams groups of sequences sorted by context, each up to its longest, which costs
    at most the sum of the contexts plus a group's worth of the longest (c7; a ragged
    GPU kernel has c7 = 0). Without terms past Eq. 1 the fit over-predicted decode-only steps by
    ~20% and under-predicted steps holding a small chunk by as much
    (benchmarks/convoy.py --validate-simulator). Coefficients
    are non-negative; a term that does not apply to a back-end fits to 0.

    token_buckets: the engine's padded token counts.
    """

    def __init__(self, coefficients: Sequence[float], *, token_buckets: Sequence[int] | None = None,
                 median_rel_error: float | None = None, p90_rel_error: float | None = None,
                 num_records: int = 0):
        coefficients = tuple(float(c) for c in coefficients)
        if len(coefficients) != len(PROFILED_FEATURES):
            raise ValueError(f"need {len(PROFILED_FEATURES)} coefficients for {PROFILED_FEATURES}, "
                             f"got {coefficients}")
        if any(not math.isfinite(c) or c < 0 for c in coefficients):
            raise ValueError(f"coefficients must be finite and >= 0 (so time grows with work), "
                             f"got {coefficients}")
        self.coefficients = coefficients
        self.token_buckets = tuple(token_buckets) if token_buckets is not None else None
        self.median_rel_error = median_rel_error
        self.p90_rel_error = p90_rel_error
        self.num_records = num_records

    @classmethod
    def fit(cls, records: Iterable[tuple[BatchFeatures, float]], *,
            token_buckets: Sequence[int] | None = None,
            weights: Sequence[float] | None = None) -> ProfiledPredictor:
        """Least squares on (features, measured seconds) pairs, each of weight 1 unless
        `weights` (one >= 0 per record) says otherwise.

        Rows are divided by the measured time, so the fit minimises relative error:
        step times span milliseconds (decodes) to seconds (long chunks) and plain least
        squares would fit only the long ones. Coefficients are kept >= 0 so predicted
        time never falls when work is added (the packer's binary search relies on it).
        """
        records = list(records)
        if len(records) < len(PROFILED_FEATURES):
            raise ValueError(f"need at least {len(PROFILED_FEATURES)} records to fit "
                             f"{PROFILED_FEATURES}, got {len(records)}")
        seconds = np.array([s for _, s in records], dtype=np.float64)
        if np.any(~np.isfinite(seconds)) or np.any(seconds <= 0):
            raise ValueError("measured seconds must be finite and > 0")
        a = np.array([_feature_row(f) for f, _ in records], dtype=np.float64)
        w = np.ones_like(seconds) if weights is None else np.asarray(weights, np.float64)
        if w.shape != seconds.shape or np.any(~np.isfinite(w)) or np.any(w < 0):
            raise ValueError(f"weights must be {len(records)} finite values >= 0")
        # Scale columns to unit size so the solve is well conditioned (features reach 1e12).
        scale = np.maximum(np.abs(a).max(axis=0), 1e-30)
        root_w = np.sqrt(w)
        x = _nonnegative_least_squares(a / scale / seconds[:, None] * root_w[:, None],
                                       root_w) / scale
        rel = np.abs(a @ x - seconds) / seconds
        return cls(x, token_buckets=token_buckets,
                   median_rel_error=float(np.median(rel)),
                   p90_rel_error=float(np.percentile(rel, 90)), num_records=len(records))

    def predict_features(self, f: BatchFeatures) -> float:
        if f.seqs == 0:
            return 0.0
        # Plain arithmetic: the packer calls this hundreds of times per iteration.
        c0, c1, c2, c3, c4, c5, c6, c7 = self.coefficients
        return (c0 + c1 * f.padded_tokens + c2 * f.sum_chunk_x_context + c3 * f.sum_chunk_sq
                + c4 * f.prefill_chunks + c5 * f.sum_prefill_context
                + c6 * (f.sum_context - f.sum_prefill_context) + c7 * f.max_decode_context)

    def predict(self, batch: Batch) -> float:
        return self.predict_features(batch_features(batch, self.token_buckets))

    def chunk_time(self, base: BatchFeatures, n: int, start: int, remaining: int,
                   token_buckets: Sequence[int] | None) -> float:
        """`predictor.chunk_time`: predict_features of base plus one chunk, the same
        floating-point operations in the same order, without the features."""
        c0, c1, c2, c3, c4, c5, c6, c7 = self.coefficients
        (base_tokens, _, _, sum_cx, sum_sq, sum_context, _, prefills, sum_prefill_ctx,
         max_decode, _) = base                  # one unpacking, not a read per field
        tokens = base_tokens + n
        padded = tokens
        if token_buckets is not None and tokens:
            padded = token_buckets[bisect.bisect_left(token_buckets, tokens)] \
                if tokens <= token_buckets[-1] else padded_size(tokens, token_buckets)
        end = start + n
        head = c0 + c1 * padded + c2 * (sum_cx + n * end) + c3 * (sum_sq + n * n)
        if n > 1:                                   # a prefill chunk
            prefill_ctx = sum_prefill_ctx + end
            return (head + c4 * (prefills + 1) + c5 * prefill_ctx
                    + c6 * (sum_context + end - prefill_ctx) + c7 * max_decode)
        return (head + c4 * prefills + c5 * sum_prefill_ctx
                + c6 * (sum_context + end - sum_prefill_ctx)
                + c7 * (max_decode if max_decode > end else end))

    def to_json(self) -> str:
        return json.dumps({
            "kind": "profiled", "features": list(PROFILED_FEATURES),
            "coefficients": list(self.coefficients),
            "token_buckets": list(self.token_buckets) if self.token_buckets is not None else None,
            "median_rel_error": self.median_rel_error, "p90_rel_error": self.p90_rel_error,
            "num_records": self.num_records}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> ProfiledPredictor:
        data = json.loads(text)
        if data.get("kind") != "profiled" or tuple(data.get("features", ())) != PROFILED_FEATURES:
            raise ValueError(f"not a profiled predictor with features {PROFILED_FEATURES}: "
                             f"kind={data.get('kind')!r} features={data.get('features')!r}")
        return cls(data["coefficients"], token_buckets=data["token_buckets"],
                   median_rel_error=data["median_rel_error"], p90_rel_error=data["p90_rel_error"],
                   num_records=data["num_records"])

    def save(self, path) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path) -> ProfiledPredictor:
        with open(path) as f:
            return cls.from_json(f.read())

    def __repr__(self) -> str:
        c = ", ".join(f"{name}={value:.3e}"
                      for name, value in zip(PROFILED_FEATURES, self.coefficients))
        return f"ProfiledPredictor({c}, median_rel_error={self.median_rel_error})"
