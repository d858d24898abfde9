"""Whether a request's decode leaves the replica that prefills it, and for which one.
Pure Python, no JAX: the server and the simulator call the same functions.

The router has chosen the prefill replica P (where the session's prefix is cached, seed
003: the size that matters is the new tokens to compute). Two plans:

  (a) co-located: P prefills and decodes;
  (b) offloaded:  P prefills, decode replica D decodes; P's pages move to D.

The first token is sampled on P in both, so TTFT is the same: W_P + prefill_P(new tokens).
They differ in the decode. A decode token on replica r costs one of r's decode steps,
`decode_step_s(r)`: the predictor's seconds for r's batch of the decodes it already runs
(and those handed to it, not yet landed) plus this one, so a replica that already decodes
many sequences prices each token dearer and offloads spread instead of piling onto one
replica (0 when unknown: `decode_token_s`). While r has prefill work queued, its steps
carry a prefill chunk too (`chunk_step_s`), so the request's first
k = min(n, ceil(Q_r / chunk_step_s)) tokens pay chunk_step_s (n: the tokens to decode;
Q_r: the prefill seconds still queued there when the decode starts). Q_r is what is left
then of the prefill queued there now: the decode starts at TTFT_P, the router's
prediction (`medha_jax.cluster.router.lars_ttft_s`, lars-mp's order), by when P ran
TTFT_P - x of its queued prefill w_P beside the request's own x seconds, so
Q_P = max(0, sum(w_P) - (TTFT_P - x)); D has worked through its queue meanwhile:
Q_D = max(0, sum(w_D) - TTFT_P). (The whole queue as it is now put the first tokens on P
behind prefill that shared the steps with the request's own prefill, and overpriced
staying; processor sharing, Q_P = sum(max(0, w - x)), left a late long prefill that
lars-mp runs to its end before a short one on P after the short one's first token, and
overpriced staying too.) Prefill keeps arriving meanwhile: rho_r, the share
of r's recent time its steps carried prefill chunks, is the share of the decode's time
they carry one too. Every step, either kind, gives the request a token, so a second gives
it (1 - rho_r) / decode_step_s(r) + rho_r / chunk_step_s(r) of them:

    decode_s(r) = k * chunk_step_s(r)
                  + (n - k) / ((1 - rho_r) / decode_step_s(r) + rho_r / chunk_step_s(r))

(rho_r is a share of time, not of steps: weighting the two step times by it, as this
did first, counted a long prefill step as often as the short decode steps between them,
and priced the decodes that stayed in benchmarks/disagg.py (g) at 1.2-1.6x what they
measured.) rho_r is r's history: a long prefill the router sends to D after the decode
moved there (its queue is the shortest) is not in the price (benchmarks/disagg.py (g),
HEAVY turns later in the session: moved decodes ran at 2-3x their price when it came).
The plans:

    (a) = decode_s(P)
    (b) = decode_s(D) + exposed transfer + one decode step on D (the first token's: the
          prompt's pages all move, its partial last one too, so D computes none of it)
    exposed = handshake_s + max(0, bytes / link_bytes_per_s - hidden),
    hidden  = max(0, prefill_P - chunk_step_s(P))

Pages move after the step that filled them, so everything but the last chunk's pages
travels while later chunks compute (`hidden`); bytes are the prompt's pages D does not
already hold.

The decode also slows the decodes already on the replica that takes it: one more
sequence in r's batch adds delta_r = decode_step_s(r) - decode_base_step_s(r) (the step
without it) to each of r's steps, and each of r's m_r decodes pays that for up to n of
them (their own remaining tokens are not known here: n bounds it, on both sides alike):

    others(r) = m_r * n * delta_r;   (a) += others(P),   (b) += others(D)

Offload when (b) < (a) * (1 - margin). A cold turn on an idle P has
(a) = n * decode_token_s, which (b) cannot beat: it stays.

Batch slots. A step holds at most max_seqs sequences, and the packer fills them with
decodes first (`medha_jax.scheduler.packer`: decodes are never left out): on a replica
whose decodes fill the batch, no prefill chunk runs until one of them ends, and with more
decodes than slots they take turns. So a replica is a destination only while it keeps a
slot for prefill once the request is there (m_r + 1 < max_seqs), and a decode that stays
where m_r + 1 decodes share max_seqs slots gets a step every (m_r + 1) / max_seqs of them
(its decode_s grows by that factor). In one run of benchmarks/disagg.py (g) without this,
hand-offs and moves piled 8-10 decodes onto one replica of max_seqs 8: a short turn
routed there waited 8.5 s for a slot (its TTFT 9.0 s, predicted 0.37 s).

Worked numbers (test_offload.py): n = 100, a request of 1.0 s of prefill on P with a
3 s prefill queued there (TTFT_P = 2 s: 1 s of it run first, Q_P = 2 s left) at 0.1 s a chunk step
and 0.02 s a decode token, rho 0: k = 20, (a) = 20 * 0.1 + 80 * 0.02 = 3.6 s (with
rho = 0.5 and nothing queued: 100 / (0.5 / 0.02 + 0.5 / 0.1) = 100 / 30 = 3.33 s). An idle
D at 0.02 s a token, 1 GB to move at 10 GB/s behind a 1.0 s prefill (hidden 0.9 s),
handshake 5 ms: exposed = 0.005 + 0.1 - 0.9 -> 0.005 s; (b) = 2.0 + 0.005 + 0.02 =
2.025 s: offload. The same D already decoding a batch it steps in 0.05 s:
(b) = 100 * 0.05 + 0.005 + 0.05 = 5.055 s > 3.6 s: it stays (or goes to an idler D).
Others: P decodes 8 sequences, each one more adding 2 ms to its step (0.036 -> 0.038 s),
nothing queued; D is a slower replica, idle, whose step alone takes 0.036 s. Own seconds
alone: (a) = 3.8 s, (b) = 3.6 + 0.005 + 0.036 = 3.641 s > 3.8 * 0.9: it would stay; with
P's 8 decodes each paying 2 ms for 100 steps, (a) = 3.8 + 1.6 = 5.4 s: offload.

Fixed gates, the baselines (each offloads to the D with the smallest (b)):
  never; always-heavy (new tokens >= heavy_new_tokens); cached-fraction (P's cached
  share of the prompt >= 0.3, seed 003 H4); dynamo (stays local only when the uncached
  tokens are < 2048 and < 70% of the prompt).
A prefill-role P always offloads when some replica can decode.

Moving a running decode (Llumnix's live migration; `OffloadConfig.move_decodes`, on Ray
replicas). The decision above is made once, before the prefill: a long prefill routed
later to the replica a decode stays on (or moved to) is not in its price, and that is
where the decodes the time gate placed lost most (benchmarks/disagg.py (g)). So while a
request decodes, each time its replica has prefill queued the same comparison runs again
for the rest of it (`choose_move`): (a) the n tokens it has left there, behind that
queue; (b) on D, its whole context's pages moved (nothing hides them: the decode pauses
while they move) and two of D's step boundaries waited for. The pages go stop-and-copy:
at its next token the source stops the request and offers every page of what it has
computed, D pulls them and books, writes and registers them in one turn of its loop, and
the request takes them as its own (serving.ray_handoff); its first step there is a
decode step. A request moves at most once (no ping-pong between
two replicas that take turns prefilling).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

NEVER, ALWAYS_HEAVY, CACHED_FRACTION, DYNAMO, TIME = (
    "never", "always-heavy", "cached-fraction", "dynamo", "time")
OFFLOAD_GATES = (NEVER, ALWAYS_HEAVY, CACHED_FRACTION, DYNAMO, TIME)


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    """gate: one of OFFLOAD_GATES. link_bytes_per_s: measured bandwidth between two
    replicas' devices; handshake_s: a reservation's round trip. move_decodes: a running
    decode whose replica has prefill queued may move to another (`choose_move`, priced as
    the time gate prices, whatever the gate)."""

    gate: str = TIME
    margin: float = 0.1
    heavy_new_tokens: int = 2048
    cached_fraction: float = 0.3
    dynamo_max_local_tokens: int = 2048
    dynamo_max_local_fraction: float = 0.7
    link_bytes_per_s: float = 10e9
    handshake_s: float = 0.001
    move_decodes: bool = False      # also move running decodes (`choose_move`; Ray only)

    @classmethod
    def parse(cls, text: str) -> OffloadConfig:
        """A gate name, "+move" after it for move_decodes ("time+move")."""
        gate, plus, rest = text.partition("+")
        if plus and rest != "move":
            raise ValueError(f"offload {text!r}: write a gate, or a gate then +move "
                             f"(e.g. time+move)")
        return cls(gate, move_decodes=bool(plus))

    def __post_init__(self):
        if self.gate not in OFFLOAD_GATES:
            raise ValueError(f"OffloadConfig.gate: unknown gate {self.gate!r}; choose one of "
                             f"{', '.join(OFFLOAD_GATES)}")
        if not self.link_bytes_per_s > 0:
            raise ValueError(f"OffloadConfig.link_bytes_per_s must be > 0, got "
                             f"{self.link_bytes_per_s!r}")
        for name in ("margin", "cached_fraction", "handshake_s", "dynamo_max_local_fraction"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"OffloadConfig.{name} must be >= 0, got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True)
class OffloadReplica:
    """One replica as the offload decision sees it. can_decode: healthy and not a
    prefill-only replica; cached_pages: the request's full prompt pages held there."""

    can_decode: bool
    prefill_only: bool = False
    queued_prefill_s: float = 0.0   # the predicted seconds of the prefills queued there
    chunk_step_s: float = 0.0
    decode_token_s: float = 0.0
    cached_pages: int = 0
    prefill_share: float = 0.0      # rho: share of its recent time spent on prefill steps
    # Its decode step's predicted seconds with its decodes (running and inbound) plus this
    # request's; 0: not known, one decode_token_s.
    decode_step_s: float = 0.0
    # Those decodes (running and inbound, not this request) and their step's seconds
    # without this request: what one more slows each of them by (0 decodes: nothing).
    decodes: int = 0
    decode_base_step_s: float = 0.0
    max_seqs: int = 0               # sequences one of its steps holds (0: not known)

    @property
    def step_s(self) -> float:
        """Seconds of one of its decode steps carrying this request."""
        return self.decode_step_s if self.decode_step_s > 0 else self.decode_token_s

    @property
    def turns(self) -> float:
        """Steps per token of a decode there beside its `decodes`: above 1 when they and
        this one are more than a step holds (they take turns)."""
        return max(1.0, (self.decodes + 1) / self.max_seqs) if self.max_seqs > 0 else 1.0

    @property
    def has_room(self) -> bool:
        """Whether one more decode there still leaves its batch a slot for prefill."""
        return self.max_seqs <= 0 or self.decodes + 1 < self.max_seqs


@dataclasses.dataclass(frozen=True)
class OffloadRequest:
    """prompt_len, cached_tokens on P, tokens to decode, P's predicted prefill seconds
    of the new tokens and predicted TTFT there (the router's Decision), and its prompt's
    pages (the partial last one too: all of them move) with their bytes."""

    prompt_len: int
    cached_tokens: int
    max_new_tokens: int
    prefill_s: float
    ttft_s: float
    prompt_pages: int
    page_bytes: int


@dataclasses.dataclass(frozen=True)
class OffloadDecision:
    """decode: the replica that decodes, None to stay on P. colocated_s / offloaded_s:
    predicted seconds of plans (a) and (b) (b with the best D): the request's decode and
    what it adds to the other decodes where it runs."""

    decode: int | None
    colocated_s: float
    offloaded_s: float
    gate: str
    # Of which what it adds to the other decodes there (on P, on the best D).
    colocated_others_s: float = 0.0
    offloaded_others_s: float = 0.0


def decode_seconds(replica: OffloadReplica, num_tokens: int,
                   queued_prefill_s: float = 0.0) -> float:
    """Seconds to decode num_tokens there beside queued_prefill_s of prefill work still
    queued there when the decode starts."""
    if num_tokens <= 0:
        return 0.0
    decode = replica.step_s
    step = max(replica.chunk_step_s, decode)
    k = (min(num_tokens, math.ceil(queued_prefill_s / step - 1e-9))
         if step > 0 and queued_prefill_s > 0 else 0)
    rho = min(max(replica.prefill_share, 0.0), 1.0)
    if decode <= 0:
        return replica.turns * (k * step + (num_tokens - k) * rho * step)
    return replica.turns * (k * step + (num_tokens - k) / ((1 - rho) / decode + rho / step))


def others_delay_s(replica: OffloadReplica, num_tokens: int) -> float:
    """Seconds the decodes already there wait in all, over num_tokens steps, for one more
    sequence in their batch (0 when the replica's step is not known)."""
    if replica.decodes <= 0 or replica.decode_step_s <= 0 or num_tokens <= 0:
        return 0.0
    return replica.decodes * num_tokens * max(0.0, replica.decode_step_s
                                              - replica.decode_base_step_s)


def first_token_s(request: OffloadRequest, prefill: OffloadReplica) -> tuple[float, float]:
    """(TTFT_P, Q_P): when the request's prefill on P ends (the router's prediction), and
    the prefill seconds left queued on P then."""
    ran = max(0.0, request.ttft_s - request.prefill_s)
    return request.ttft_s, max(0.0, prefill.queued_prefill_s - ran)


def colocated_seconds(request: OffloadRequest, prefill: OffloadReplica) -> float:
    """Plan (a)'s seconds: the decode on P, and what it adds to P's other decodes."""
    _, left = first_token_s(request, prefill)
    return (decode_seconds(prefill, request.max_new_tokens, left)
            + others_delay_s(prefill, request.max_new_tokens))


def exposed_transfer_s(request: OffloadRequest, prefill: OffloadReplica,
                       decode: OffloadReplica, config: OffloadConfig) -> float:
    """The hand-off's seconds the decode waits for: what the prefill does not hide."""
    pages = max(0, request.prompt_pages - decode.cached_pages)
    transfer = pages * request.page_bytes / config.link_bytes_per_s
    hidden = max(0.0, request.prefill_s - prefill.chunk_step_s)
    return config.handshake_s + max(0.0, transfer - hidden)


def offloaded_seconds(request: OffloadRequest, prefill: OffloadReplica,
                      decode: OffloadReplica, config: OffloadConfig) -> float:
    """Plan (b)'s seconds with this decode replica: the decode there, the exposed
    transfer, and what it adds to that replica's other decodes."""
    ttft, _ = first_token_s(request, prefill)
    left = max(0.0, decode.queued_prefill_s - ttft)
    return (decode_seconds(decode, request.max_new_tokens, left)
            + exposed_transfer_s(request, prefill, decode, config) + decode.step_s
            + others_delay_s(decode, request.max_new_tokens))


def choose_decode(request: OffloadRequest, prefill_index: int,
                  replicas: Sequence[OffloadReplica],
                  config: OffloadConfig = OffloadConfig()) -> OffloadDecision:
    """The offload decision (see the module's docstring)."""
    prefill = replicas[prefill_index]
    n = request.max_new_tokens
    colocated = colocated_seconds(request, prefill)
    # A prefill-only P cannot keep the decode: any replica that decodes takes it.
    candidates = [i for i, r in enumerate(replicas)
                  if r.can_decode and not r.prefill_only and i != prefill_index
                  and (r.has_room or prefill.prefill_only)]
    if not candidates or n <= 1:
        return OffloadDecision(None, colocated, math.inf, config.gate,
                               others_delay_s(prefill, n))
    offloaded = {i: offloaded_seconds(request, prefill, replicas[i], config) for i in candidates}
    best = min(candidates, key=lambda i: (offloaded[i], i))
    others = (others_delay_s(prefill, n), others_delay_s(replicas[best], n))
    if prefill.prefill_only:
        return OffloadDecision(best, colocated, offloaded[best], config.gate, *others)
    new_tokens = request.prompt_len - request.cached_tokens
    gate = config.gate
    if gate == NEVER:
        go = False
    elif gate == ALWAYS_HEAVY:
        go = new_tokens >= config.heavy_new_tokens
    elif gate == CACHED_FRACTION:
        go = request.cached_tokens >= config.cached_fraction * request.prompt_len
    elif gate == DYNAMO:
        go = not (new_tokens < config.dynamo_max_local_tokens
                  and new_tokens < config.dynamo_max_local_fraction * request.prompt_len)
    else:
        go = offloaded[best] < colocated * (1 - config.margin)
    return OffloadDecision(best if go else None, colocated, offloaded[best], gate, *others)


def choose_move(context_tokens: int, remaining_tokens: int, page_size: int, page_bytes: int,
                source_index: int, replicas: Sequence[OffloadReplica],
                config: OffloadConfig = OffloadConfig()) -> OffloadDecision:
    """Whether a request decoding on `source_index`, context_tokens computed and
    remaining_tokens left to decode, moves now, and where: the time gate's rule for the
    rest of its decode, whatever config.gate says. Nothing is left to prefill, so each
    replica's whole queued prefill is ahead of it:

        (a) = decode_s(source, n, Q_source) + others(source)
        (b) = bytes / link + 2 * boundary(D) + decode_s(D, n, Q_D) + others(D)

    Nothing hides the pages (the decode waits while they move: every page of its context,
    less those D holds, `cached_pages`); D takes them at a step boundary, then runs the
    request's first step there, so the decode waits two of D's steps, a chunk step each
    while D has prefill queued (`boundary`). The source's view counts the request among
    its decodes already (`decodes` the others, `decode_step_s` the step with it)."""
    source = replicas[source_index]
    n = remaining_tokens
    stay = (decode_seconds(source, n, source.queued_prefill_s)
            + others_delay_s(source, n))
    pages = -(-context_tokens // page_size)

    def moved(d: OffloadReplica) -> float:
        boundary = max(d.step_s, d.chunk_step_s) if d.queued_prefill_s > 0 else d.step_s
        transfer = max(0, pages - d.cached_pages) * page_bytes / config.link_bytes_per_s
        return (transfer + 2 * boundary + decode_seconds(d, n, d.queued_prefill_s)
                + others_delay_s(d, n))

    candidates = [i for i, r in enumerate(replicas)
                  if r.can_decode and not r.prefill_only and r.has_room and i != source_index]
    if not candidates or n <= 1:
        return OffloadDecision(None, stay, math.inf, TIME, others_delay_s(source, n))
    plans = {i: moved(replicas[i]) for i in candidates}
    best = min(candidates, key=lambda i: (plans[i], i))
    go = plans[best] < stay * (1 - config.margin)
    return OffloadDecision(best if go else None, stay, plans[best], TIME,
                           others_delay_s(source, n), others_delay_s(replicas[best], n))
