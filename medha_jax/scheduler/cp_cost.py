"""What a context-parallel ring costs, and the pass-KV / pass-Q choice (seed 002 §3.4, App. C).

Plain Python over ModelConfig x HardwareSpec, no JAX. Everything is per device: a cp rank may
itself be tp devices (seed 002 runs TP8 inside each CP node), each holding heads / tp of the
query and K/V heads, with its own link of `interconnect_bandwidth` to its peer in the ring.

Roofline terms of one layer for T new and P cached tokens over N ranks (Table 3), with
C = peak FLOP/s x attention efficiency and BW = link bytes/s x interconnect efficiency:

  attention per rank     4 D T (P + T / 2) / N FLOPs (D = heads x head_dim; causal new part)
  pass-KV ring step      K and V of (T + P) / N tokens: 2 (T + P) / N x N_KV hd e bytes
  pass-Q  ring step      Q of T / N tokens: T / N x N_H hd e bytes
  pass-Q  All2All        N - 1 partial outputs and LSEs of T / N tokens: (N - 1) T / N x
                         N_H (hd + 1) x 4 bytes (float32, what `ring_attention` sends)

Those are the paper's terms. `step_bytes` prices what `ring_attention` really sends, which
they approach: the new tokens of a rank padded to the step's token bucket (with their
int32 sequence ids and positions: 8 bytes a token for pass-KV, positions only for pass-Q),
and for pass-KV the rank's cached tokens in whole pages of page_size (each sequence's last
page half full on average) padded to the step's cp page bucket (`cp_layout.
pack_cached_pages`). Without page_size and buckets (the simulator) it is the terms above
plus the int32 indexes.

A ring of N steps overlaps each step's transfer with the attention of the block in hand, so
a variant exposes (N - 1) x max(0, transfer - attention / N), plus the All2All for pass-Q.

The heuristic is the paper's, thresholds computed once from the model and the hardware:

  Algorithm 1: pass-KV if T >= N C N_KV e / (2 N_H BW)            (Eq. 2)
               or T / (T + P) >= 2 N_KV / N_H                     (Eq. 1)
               else pass-Q
  Algorithm 5: the same with the miss-rate threshold lowered by the All2All pass-Q pays,
               2 N_KV / N_H - 4 T BW / (N C e)                    (Eq. 5)

Full prefill (P = 0) is the case T / (T + P) = 1 (pass-KV for GQA with N_H > 2 N_KV); a decode
(T = 1 a sequence) is pass-Q (Algorithm 4).
"""

from __future__ import annotations

import dataclasses
import math

from medha_jax.config import ModelConfig
from medha_jax.scheduler.hardware import HardwareSpec, hardware_preset

PASS_KV, PASS_Q = "pass-kv", "pass-q"


@dataclasses.dataclass(frozen=True, kw_only=True)
class RingCost:
    """Per-device roofline of one cp ring for one model on one device kind.

    num_ranks: N; num_heads, num_kv_heads: the heads ONE device holds (after tp);
    head_dim; layers: layers one device runs; bytes_per_value: e; flops_per_s: C (peak x
    attention efficiency); link_bytes_per_s: BW (link x interconnect efficiency);
    latency_s: fixed cost of one transfer; page_size: tokens of a page on one rank (None:
    cached tokens priced one by one); token_buckets: the step's tokens-per-rank rungs;
    page_buckets: its cp page rungs (`BucketLadder.cp_page_buckets`). Empty: no padding.
    """

    num_ranks: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layers: int
    bytes_per_value: int
    flops_per_s: float
    link_bytes_per_s: float
    latency_s: float = 10e-6
    page_size: int | None = None
    token_buckets: tuple[int, ...] = ()
    page_buckets: tuple[int, ...] = ()

    def __post_init__(self):
        if self.num_ranks < 1 or self.num_heads < 1 or self.num_kv_heads < 1:
            raise ValueError(f"RingCost needs positive ranks and heads, got {self}")

    @classmethod
    def create(cls, model: ModelConfig, hardware: HardwareSpec | str = "h100", *,
               num_ranks: int, tp: int = 1, spp: int = 1, attention_efficiency: float = 0.6,
               interconnect_efficiency: float = 0.75, latency_s: float = 10e-6,
               page_size: int | None = None, token_buckets=(), page_buckets=()) -> RingCost:
        if isinstance(hardware, str):
            hardware = hardware_preset(hardware)
        return cls(num_ranks=num_ranks, num_heads=max(1, model.num_heads // tp),
                   num_kv_heads=max(1, model.num_kv_heads // tp), head_dim=model.head_dim,
                   layers=-(-model.num_layers // spp),
                   bytes_per_value=4 if model.dtype == "float32" else 2,
                   flops_per_s=hardware.peak_flops * attention_efficiency,
                   link_bytes_per_s=hardware.interconnect_bandwidth * interconnect_efficiency,
                   latency_s=latency_s, page_size=page_size,
                   token_buckets=tuple(token_buckets), page_buckets=tuple(page_buckets))

    # -------------------------------------------------------------------- the heuristic

    def min_new_tokens_for_pass_kv(self) -> float:
        """Eq. 2: from this many new tokens on, pass-KV's transfer hides under attention
        whatever the cached length (N C N_KV e / (2 N_H BW))."""
        return (self.num_ranks * self.flops_per_s * self.num_kv_heads * self.bytes_per_value
                / (2 * self.num_heads * self.link_bytes_per_s))

    def miss_rate_threshold(self, new_tokens: int, *, all2all: bool = True) -> float:
        """Eq. 1 (2 N_KV / N_H), or Eq. 5 with all2all (lowered by 4 T BW / (N C e))."""
        threshold = 2 * self.num_kv_heads / self.num_heads
        if all2all:
            threshold -= (4 * new_tokens * self.link_bytes_per_s
                          / (self.num_ranks * self.flops_per_s * self.bytes_per_value))
        return threshold

    def choose(self, new_tokens: int, cached_tokens: int, *, all2all: bool = True) -> str:
        """Algorithm 5 (Algorithm 1 without all2all): PASS_KV or PASS_Q for one prefill round."""
        if new_tokens <= 0:
            raise ValueError(f"{new_tokens=} must be positive")
        if new_tokens >= self.min_new_tokens_for_pass_kv():
            return PASS_KV
        miss_rate = new_tokens / (new_tokens + cached_tokens)
        return PASS_KV if miss_rate >= self.miss_rate_threshold(new_tokens, all2all=all2all) \
            else PASS_Q

    # ------------------------------------------------------------------------ the times

    def attention_s(self, new_tokens: float, cached_tokens: float) -> float:
        """All layers' attention of one rank: 4 D T (P + T / 2) / N FLOPs over C."""
        d = self.num_heads * self.head_dim
        return (self.layers * 4 * d * new_tokens * (cached_tokens + new_tokens / 2)
                / self.num_ranks / self.flops_per_s)

    def step_bytes(self, variant: str, new_tokens: float, cached_tokens: float, *,
                   seqs: int = 1) -> float:
        """Bytes one rank sends in one ring step of one layer, for a step of `seqs` sequences
        (see the module docstring: the padded buffers `ring_attention` sends)."""
        n = self.num_ranks
        tokens = _padded(math.ceil(new_tokens / n), self.token_buckets)
        if variant == PASS_KV:
            cached = cached_tokens / n
            if self.page_size is not None:
                pages = math.ceil(cached / self.page_size + (seqs - 1) / 2) if cached else 0
                cached = _padded(pages, self.page_buckets) * self.page_size
            return (2 * (tokens + cached) * self.num_kv_heads * self.head_dim
                    * self.bytes_per_value + 8 * tokens)
        if variant == PASS_Q:
            return tokens * (self.num_heads * self.head_dim * self.bytes_per_value + 4) + 4
        raise ValueError(f"unknown ring variant {variant!r}; want {PASS_KV!r} or {PASS_Q!r}")

    def all2all_bytes(self, variant: str, new_tokens: float) -> float:
        """Bytes one rank sends in pass-Q's All2All of one layer (0 for pass-KV)."""
        if variant == PASS_KV:
            return 0.0
        n = self.num_ranks
        return (n - 1) * new_tokens / n * self.num_heads * (self.head_dim + 1) * 4

    def exposed_s(self, variant: str, new_tokens: float, cached_tokens: float) -> float:
        """All layers' ring transfer time that attention does not hide."""
        n = self.num_ranks
        if n == 1:
            return 0.0
        per_step_attention = self.attention_s(new_tokens, cached_tokens) / self.layers / n
        transfer = (self.step_bytes(variant, new_tokens, cached_tokens) / self.link_bytes_per_s
                    + self.latency_s)
        exposed = (n - 1) * max(0.0, transfer - per_step_attention)
        if variant == PASS_Q:
            exposed += self.all2all_bytes(variant, new_tokens) / self.link_bytes_per_s \
                + self.latency_s
        return self.layers * exposed


def _padded(n: int, buckets: tuple[int, ...]) -> int:
    """n padded up to its rung (the top rung past the ladder; n without rungs)."""
    if not buckets:
        return n
    return next((b for b in buckets if b >= max(n, 1)), buckets[-1])


def choose_pass_q(model: ModelConfig, *, new_tokens: int, cached_tokens: int, num_ranks: int,
                  hardware: HardwareSpec | str = "h100", tp: int = 1) -> bool:
    """Whether Algorithm 5 picks pass-Q for a step of one sequence (decodes always do)."""
    if new_tokens == 1:
        return True
    cost = RingCost.create(model, hardware, num_ranks=num_ranks, tp=tp)
    return cost.choose(new_tokens, cached_tokens) == PASS_Q
