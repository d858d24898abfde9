"""Chunkwise dynamic sequence parallelism (CDSP): the prefill pool's scheduler (seed 001, Tetris).

All prefill instances form one sequence-parallel ring. A prompt is prefilled as chunks
c_1..c_n, in order, on nested instance groups G_1 ⊆ G_2 ⊆ ... (so SP sizes only grow and no
cache ever leaves an instance): early chunks fill instances idle now, later ones grow to
the groups that free up later. Plain Python (no JAX), so the simulator
(`medha_jax.cluster.prefill_pool_sim`) and a serving loop run the same code.

The seed lost its formulas; section A of research/seeds-001-003-004.md rebuilds them from
the prose ([R] there). Implemented as written there:

  Eq. 1  T_sp(h, l) = α_sp + β_sp·l + γ_sp·h·l + δ_sp·l²            (`LatencyModel`)
         h history tokens, l chunk tokens; one coefficient set per SP size, fitted by
         least squares from measured steps (`fit_latency_models`).
  Eq. 2  q_i ← max_{j∈G_c} q_j + T_c  for i ∈ G_c, unchanged elsewhere  (`book_chunk`)
         q_i: seconds until instance i is free. A ring chunk starts when its slowest member
         is free and holds all members until it ends.
  Alg. 1 recursive chunk search (`CdspScheduler.plan` / `_search`); Alg. 2 single-chunk
         scheduling with the improvement rate (`_single_chunk`); Alg. 3 the chunk that fills
         the gap until the next group is free (in `_search`); `Extend` (`_Pool.extend`).

Choices the paper leaves open (A.4), each made here and named where it is made:
  - Gain in Alg. 2 is relative to the best plan so far: (ttft_best - ttft_s) / ttft_best > r.
  - The improvement rate gates only Alg. 2 (the single-chunk plan, which also caps the SP
    of the chunked plans: sp_max, line 4); chunked plans are compared by TTFT alone (l. 20).
  - Valid pairs: |G_prev| <= s_cur < s_next <= sp_max; the recursion gets the sizes >= s_next.
  - "Too short to pay off" (l. 11-12): the chunk has fewer than `min_chunk_tokens`, or leaves
    fewer than that for the chunks after it (then the single chunk at s_cur is the plan).
  - Chunk lengths are floored to a multiple of `chunk_multiple` tokens (Newton's real-valued
    root against a token bucket); Eq. 1's root is closed form (a quadratic).
  - Extend ranks nodes for a multi-node group by the node's longest queue (when the whole
    node is free); ties go to the lower index everywhere.
  - A plan is made once, at arrival (FCFS), and not revised; q_i come from the plan's own
    predictions (a caller that measures a chunk ending late books the real end instead).
  - `aligned=True` restricts every group to an aligned power-of-two block (a buddy
    allocator: a pool of P has P/s blocks of size s), so the engine compiles one program per
    (block, bucket) instead of one per subset. Extend then takes the aligned block of size s
    containing G_prev, or for a first chunk the block whose longest queue is shortest.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple, Protocol

import numpy as np

from medha_jax.scheduler.predictor import _nonnegative_least_squares


class ChunkLatency(Protocol):
    """Seconds one chunk takes at one SP size (Eq. 1, or a table)."""

    def seconds(self, history: float, tokens: float) -> float: ...

    def tokens_within(self, history: float, budget_s: float) -> float:
        """The largest chunk (real-valued tokens) that ends within budget_s; 0 if none."""
        ...


@dataclasses.dataclass(frozen=True)
class LatencyModel:
    """Eq. 1 [R] at one SP size: T(h, l) = alpha + beta·l + gamma·h·l + delta·l² seconds.

    alpha: constant overhead; beta: fully connected layers (per token); gamma: attention to
    the h history tokens (per (query, key) pair); delta: attention within the chunk. The
    normalisations (l²/2 for causal, 1/sp) are absorbed by the fitted coefficients.
    """

    sp: int
    alpha: float
    beta: float
    gamma: float
    delta: float

    def __post_init__(self):
        for name in ("alpha", "beta", "gamma", "delta"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"LatencyModel.{name} must be finite and >= 0 (sp={self.sp}), "
                                 f"got {value!r}")

    def seconds(self, history: float, tokens: float) -> float:
        return self.alpha + tokens * (self.beta + self.gamma * history + self.delta * tokens)

    def tokens_within(self, history: float, budget_s: float) -> float:
        """Alg. 3's root of T(h, l) = budget: delta·l² + (beta + gamma·h)·l - (budget - alpha)
        = 0, closed form (Newton's method would only be needed for more terms)."""
        c = budget_s - self.alpha
        if c <= 0:
            return 0.0
        b = self.beta + self.gamma * history
        if self.delta == 0:
            return math.inf if b == 0 else c / b
        # 2c / (b + sqrt(b² + 4·delta·c)): the stable form of the positive root.
        return 2 * c / (b + math.sqrt(b * b + 4 * self.delta * c))


def fit_latency_models(samples: Iterable[tuple[int, int, int, float]]
                       ) -> dict[int, LatencyModel]:
    """Eq. 1 per SP size by least squares from measured chunks.

    samples: (tokens, history, sp, seconds) of measured prefill steps, e.g. the engine's.
    One fit per SP size (each needs >= 4 samples). Rows are divided by the measured time, so
    the fit minimises relative error (chunks span milliseconds to tens of seconds), and
    coefficients are kept >= 0 so the time never falls as tokens are added (Alg. 3's root
    needs T increasing in l) -- the same solve as `ProfiledPredictor.fit`.
    """
    by_sp: dict[int, list[tuple[float, float, float]]] = {}
    for tokens, history, sp, seconds in samples:
        if tokens < 1 or history < 0 or sp < 1:
            raise ValueError(f"sample needs tokens >= 1, history >= 0, sp >= 1; got "
                             f"{(tokens, history, sp, seconds)}")
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"sample seconds must be finite and > 0, got {seconds!r}")
        by_sp.setdefault(int(sp), []).append((float(tokens), float(history), float(seconds)))
    models = {}
    for sp, rows in sorted(by_sp.items()):
        if len(rows) < 4:
            raise ValueError(f"sp={sp}: need >= 4 samples to fit Eq. 1's 4 coefficients, "
                             f"got {len(rows)}")
        l, h, y = (np.array(col) for col in zip(*rows))
        a = np.stack([np.ones_like(l), l, h * l, l * l], axis=1)
        scale = np.maximum(np.abs(a).max(axis=0), 1e-30)   # columns reach 1e10: condition
        x = _nonnegative_least_squares(a / scale / y[:, None], np.ones_like(y)) / scale
        models[sp] = LatencyModel(sp, *(float(v) for v in x))
    return models


class TabulatedLatency:
    """A measured prefill-time table as a chunk model: F(n) = the time to prefill an
    n-token prompt, piecewise linear through (0, 0) and the table's points (extrapolated with
    the last segment's slope); a chunk costs F(h + l) - F(h).

    The worked examples of the paper's section 2.4 are stated on Table 1's numbers, so tests
    use this to get them exactly; Eq. 1 fitted to the same table is `table1_latency_models`.
    """

    def __init__(self, points: Sequence[tuple[int, float]]):
        pts = sorted((int(n), float(s)) for n, s in points)
        if len(pts) < 1 or pts[0][0] <= 0 or any(b[1] < a[1] or b[0] == a[0]
                                                   for a, b in zip(pts, pts[1:])):
            raise ValueError(f"points must be (tokens > 0, seconds) rising in both: {points}")
        self._n = [0] + [n for n, _ in pts]
        self._s = [0.0] + [s for _, s in pts]

    def _f(self, n: float) -> float:
        i = min(max(bisect.bisect_right(self._n, n) - 1, 0), len(self._n) - 2)
        n0, n1, s0, s1 = self._n[i], self._n[i + 1], self._s[i], self._s[i + 1]
        return s0 + (s1 - s0) * (n - n0) / (n1 - n0)

    def _f_inverse(self, s: float) -> float:
        i = min(max(bisect.bisect_right(self._s, s) - 1, 0), len(self._s) - 2)
        n0, n1, s0, s1 = self._n[i], self._n[i + 1], self._s[i], self._s[i + 1]
        return n0 + (n1 - n0) * (s - s0) / (s1 - s0) if s1 > s0 else n1

    def seconds(self, history: float, tokens: float) -> float:
        return self._f(history + tokens) - self._f(history)

    def tokens_within(self, history: float, budget_s: float) -> float:
        if budget_s <= 0:
            return 0.0
        return max(0.0, self._f_inverse(self._f(history) + budget_s) - history)


# Seed 001, Table 1: Llama-3 8B prefill seconds, batch 1, TP=1, A100-SXM4-80GB, by SP size;
# prompt lengths 4k..256k (SP=1 at 256k ran out of memory).
TABLE1_LLAMA3_8B_A100: dict[int, tuple[tuple[int, float], ...]] = {
    sp: tuple((k * 1024, s) for k, s in zip((4, 8, 16, 32, 64, 128, 256), row) if s is not None)
    for sp, row in {1: (0.28, 0.57, 1.29, 3.22, 9.05, 29.20, None),
                    2: (0.16, 0.31, 0.69, 1.67, 4.61, 14.30, 50.07),
                    4: (0.13, 0.20, 0.39, 0.92, 2.43, 7.32, 24.77),
                    8: (0.21, 0.24, 0.31, 0.58, 1.37, 3.96, 12.81),
                    16: (0.39, 0.43, 0.46, 0.53, 0.96, 2.31, 7.02)}.items()}


def table1_tabulated() -> dict[int, TabulatedLatency]:
    return {sp: TabulatedLatency(points) for sp, points in TABLE1_LLAMA3_8B_A100.items()}


def table1_latency_models() -> dict[int, LatencyModel]:
    """Eq. 1 fitted to Table 1 (Llama-3 8B, A100, TP=1), SP 1..16.

    Table 1 has no history column, so gamma is not identifiable from it: we set gamma =
    2·delta, since a chunk's l² term counts causal (query, key) pairs, half of l², while its
    h·l history pairs are all attended.
    """
    samples = [(n, 0, sp, s) for sp, pts in TABLE1_LLAMA3_8B_A100.items() for n, s in pts]
    return {sp: dataclasses.replace(m, gamma=2 * m.delta)
            for sp, m in fit_latency_models(samples).items()}


# ---------------------------------------------------------------------------------------
# Plans and Eq. 2
# ---------------------------------------------------------------------------------------

class Chunk(NamedTuple):
    """One chunk of a plan: `tokens` prompt tokens after `history`, on instances `group`,
    from start_s to end_s (seconds from the moment the plan was made). A named tuple, not
    a frozen dataclass: building a plan's chunks was 4% of `CdspScheduler.plan`."""

    tokens: int
    history: int
    group: tuple[int, ...]
    start_s: float
    end_s: float

    @property
    def sp(self) -> int:
        return len(self.group)


@dataclasses.dataclass(frozen=True)
class Plan:
    chunks: tuple[Chunk, ...]

    @property
    def ttft_s(self) -> float:
        """Predicted seconds from now until the last chunk ends (the first token)."""
        return self.chunks[-1].end_s

    @property
    def sp_sizes(self) -> tuple[int, ...]:
        return tuple(c.sp for c in self.chunks)


def book_chunk(queues: list[float], group: Sequence[int], seconds: float) -> tuple[float, float]:
    """Eq. 2 [R] in place: the chunk starts when its slowest member is free and every member
    is busy until it ends. Returns (start, end)."""
    start = max(queues[i] for i in group)
    end = start + seconds
    for i in group:
        queues[i] = end
    return start, end


def book_plan(queues: list[float], plan: Plan) -> None:
    """Eq. 2 for each chunk of a plan, in order (relative queues, the plan's time base)."""
    for c in plan.chunks:
        book_chunk(queues, c.group, c.end_s - c.start_s)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CdspConfig:
    """node_size: instances per node (Extend keeps groups inside few nodes).
    sp_sizes: the candidate SP sizes S (powers of two in the paper, "to reduce resource
      fragmentation"); sizes above the pool are dropped.
    improvement_rate: r of Alg. 2: a larger SP is taken only if it cuts TTFT by more than r
      (relative); the pool's `AdaptiveImprovementRate` overrides it per arrival rate.
    chunking: False skips Alg. 1's lines 5-21 (the paper's single-chunk ablation).
    aligned: groups are aligned power-of-two blocks (see the module docstring).
    min_chunk_tokens, chunk_multiple: see the module docstring (lines 11-12, token buckets).
    """

    node_size: int = 8
    sp_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    improvement_rate: float = 0.1
    chunking: bool = True
    aligned: bool = False
    min_chunk_tokens: int = 1024
    chunk_multiple: int = 256

    def __post_init__(self):
        if self.node_size < 1:
            raise ValueError(f"CdspConfig.node_size must be >= 1, got {self.node_size}")
        if not self.sp_sizes or any(s < 1 for s in self.sp_sizes) or \
                list(self.sp_sizes) != sorted(set(self.sp_sizes)):
            raise ValueError(f"CdspConfig.sp_sizes must be distinct, ascending, >= 1: "
                             f"{self.sp_sizes}")
        if self.aligned and any(s & (s - 1) for s in self.sp_sizes):
            raise ValueError(f"CdspConfig.aligned needs power-of-two sp_sizes: {self.sp_sizes}")
        if not 0 <= self.improvement_rate < 1:
            raise ValueError(f"CdspConfig.improvement_rate must be in [0, 1), got "
                             f"{self.improvement_rate}")
        if self.min_chunk_tokens < 1 or self.chunk_multiple < 1:
            raise ValueError(f"CdspConfig.min_chunk_tokens ({self.min_chunk_tokens}) and "
                             f"chunk_multiple ({self.chunk_multiple}) must be >= 1")


_MISSING = object()


class _Pool:
    """One `plan` call's view of the instances, for Extend.

    Queues outside the group being grown stay fixed through the search (Eq. 2 only touches
    group members, which Extend never adds again), so each node's queues are sorted once per
    call. Both rules of Extend take a node's instances shortest-queue first, so a group is a
    prefix of each node's sorted order: a group is its nodes (a bit mask) and the counts of
    the nodes it takes in part (free mode), or its (start, size) block (aligned mode). The
    search passes groups around as small ints (an index into this call's Extend results,
    or start * (n + 1) + size), so Extend's memo is keyed by ints; 0 is the empty group in
    both modes. Instances are named (sorting a node's indices, ties to the lower index)
    only for the groups of the plan returned.
    """

    EMPTY = 0

    def __init__(self, queues: Sequence[float], node_size: int, aligned: bool):
        self.q = queues
        self.n = n = len(queues)
        self.stride = n + 1
        self.node_size = node_size
        self.aligned = aligned
        # Extend's memo, keyed group * (n + 1) + s; the search reads and fills it inline.
        self.memo: dict[int, tuple[int, float] | None] = {}
        self.extend_unmemoised = self._extend_aligned if aligned else self._extend
        if aligned:
            # The longest queue of each aligned block of size s (powers of two up to n):
            # pairs of halves; a pool of 24 at s = 16 drops the odd half ([0, 16) only).
            level = list(queues)
            self._levels: dict[int, list[float]] = {1: level}
            s = 2
            while s <= n:
                level = self._levels[s] = [b if b > a else a for a, b in
                                           zip(level[0:2 * (n // s):2], level[1::2])]
                s *= 2
            return
        # Sorting values (not indices by value) is a third of the cost; members() names them.
        self.qs: list[list[float]] = [sorted(queues[b:b + node_size])
                                      for b in range(0, n, node_size)]
        # Free-mode groups by id: (size, nodes as bits, {node: count} of nodes taken in part).
        self._groups: list[tuple[int, int, dict[int, int]]] = [(0, 0, {})]
        self._by_kth: dict[int, list[int]] = {}
        self._prefix: tuple[list[int], list[int]] | None = None

    def size(self, group: int) -> int:
        return group % self.stride if self.aligned else self._groups[group][0]

    def members(self, group: int) -> tuple[int, ...]:
        if self.aligned:
            start, size = divmod(group, self.stride)
            return tuple(range(start, start + size))
        _, mask, part = self._groups[group]
        out = []   # node by node, each ascending: the whole group ascending
        node_size, b = self.node_size, 0
        while mask:
            if mask & 1:
                ids = range(b, min(b + node_size, self.n))
                out += (sorted(sorted(ids, key=self.q.__getitem__)[:part[b // node_size]])
                        if part and b // node_size in part else ids)
            mask >>= 1
            b += node_size
        return tuple(out)

    def extend(self, group: int, s: int) -> tuple[int, float] | None:
        """Extend(G_prev, s): a group of s instances containing `group`, and the longest
        queue of the instances it adds (-inf if none); None if the pool cannot make one."""
        k = group * self.stride + s
        try:
            return self.memo[k]
        except KeyError:
            out = self.memo[k] = self.extend_unmemoised(group, s)
            return out

    def _extend_aligned(self, group, s):
        if s > self.n:
            return None
        levels = self._levels
        if not group:   # the aligned block whose longest queue is shortest (ties: lower)
            level = levels[s]
            b = level.index(min(level))
            return b * s * self.stride + s, level[b]
        start, size = divmod(group, self.stride)
        if size == s:
            return group, -math.inf
        new_start = start // s * s
        if new_start + s > self.n:   # a pool of 24 has one block of 16: [0, 16)
            return None
        added, t = -math.inf, size
        while t < s:   # the sibling block at each level up to s
            sibling = levels[t][(start // t) ^ 1]
            added = sibling if sibling > added else added
            start, t = start // (2 * t) * (2 * t), 2 * t
        return new_start * self.stride + s, added

    def _nodes_by_kth(self, k: int) -> list[int]:
        """Nodes with >= k instances, by their k-th shortest queue (ties: lower node, as
        the sort is stable; only the last node can be short)."""
        if k not in self._by_kth:
            qs = self.qs
            kth = [q[k - 1] for q in qs] if len(qs[-1]) >= k else [q[k - 1] for q in qs[:-1]]
            self._by_kth[k] = sorted(range(len(kth)), key=kth.__getitem__)
        return self._by_kth[k]

    def _whole_ranking(self) -> tuple[list[int], list[int]]:
        """Whole nodes by longest queue, and prefix[t]: the bit mask of its first t."""
        if self._prefix is None:
            ranking = self._nodes_by_kth(self.node_size)
            prefix = [0]
            for node in ranking:
                prefix.append(prefix[-1] | 1 << node)
            self._prefix = ranking, prefix
        return self._prefix

    def _extend(self, group, s):
        size, mask, part = self._groups[group]
        need = s - size
        if need < 0 or s > self.n:
            return None
        if need == 0:
            return group, -math.inf
        qs, node_size = self.qs, self.node_size
        added = -math.inf
        if part:
            # Rule (2): first the shortest-queued instances of the nodes the group uses (only
            # those it takes in part have any left).
            if len(part) == 1:   # one node's sorted tail: a prefix of it, no merge
                (node, k), = part.items()
                left = len(qs[node]) - k
                if need < left:
                    self._groups.append((s, mask, {node: k + need}))
                    return len(self._groups) - 1, qs[node][k + need - 1]
                added = qs[node][-1]
                need -= left
                part = {}
            else:
                part = dict(part)
                cand = [(q, node) for node, k in part.items() for q in qs[node][k:]]
                if len(cand) > need:
                    cand.sort()
                    cand = cand[:need]
                for q, node in cand:
                    part[node] += 1
                    added = q if q > added else added
                need -= len(cand)
                part = {node: k for node, k in part.items() if k < len(qs[node])}
        whole = need // node_size
        if whole:   # rule (1) across nodes: whole nodes, longest queue shortest first
            # The first `whole` nodes of the ranking outside the group: the least t with
            # `whole` of the first t outside (the count grows by at most one per node, so
            # stepping by the shortfall never passes it); the last of them has the longest
            # queue added.
            ranking, prefix = self._prefix or self._whole_ranking()
            t = whole
            while t < len(prefix):
                short = whole - t + (mask & prefix[t]).bit_count()
                if not short:
                    break
                t += short
            else:
                return None
            mask |= prefix[t]
            last = qs[ranking[t - 1]][-1]
            added = last if last > added else added
            need %= node_size
        if need and not mask:   # rule (1) from nothing: the first such node, no ranking
            kth = [q[need - 1] for q in (qs if len(qs[-1]) >= need else qs[:-1])]
            if not kth:
                return None
            node = kth.index(min(kth))
            self._groups.append((s, 1 << node, {node: need} if need < len(qs[node]) else {}))
            return len(self._groups) - 1, kth[node]
        if need:    # rule (1) in a node: the node whose need-th shortest queue is shortest
            for node in self._by_kth.get(need) or self._nodes_by_kth(need):
                if not mask >> node & 1:
                    mask |= 1 << node
                    if need < len(qs[node]):
                        part = {**part, node: need}
                    kth = qs[node][need - 1]
                    added = kth if kth > added else added
                    break
            else:
                return None
        self._groups.append((s, mask, part))
        return len(self._groups) - 1, added


class CdspScheduler:
    """Algorithms 1-3 over a pool of `num_instances` prefill instances (node-major: instance
    i is on node i // node_size).

    models: an Eq. 1 model (or any ChunkLatency) per SP size; S is the config's sizes that
    have a model and fit the pool.
    """

    def __init__(self, num_instances: int, models: Mapping[int, ChunkLatency],
                 config: CdspConfig = CdspConfig()):
        if num_instances < 1:
            raise ValueError(f"num_instances must be >= 1, got {num_instances}")
        self.num_instances, self.config, self.models = num_instances, config, dict(models)
        self.sp_sizes = tuple(s for s in config.sp_sizes if s <= num_instances and s in models)
        if not self.sp_sizes:
            raise ValueError(f"no SP size of {config.sp_sizes} has a model "
                             f"({sorted(models)}) and fits {num_instances} instances")
        # Per SP-size index, bound once: the search evaluates them in its inner loop.
        self._seconds = tuple(self.models[s].seconds for s in self.sp_sizes)
        self._tokens_within = tuple(self.models[s].tokens_within for s in self.sp_sizes)

    def plan(self, tokens: int, queues: Sequence[float],
             improvement_rate: float | None = None) -> Plan:
        """The chunk plan of a `tokens`-token prompt given each instance's queue q_i (seconds
        until free, >= 0). Does not book it: `book_plan(queues, plan)` is Eq. 2."""
        if tokens < 1:
            raise ValueError(f"tokens must be >= 1, got {tokens}")
        if len(queues) != self.num_instances:
            raise ValueError(f"queues has {len(queues)} entries, the pool {self.num_instances}")
        r = self.config.improvement_rate if improvement_rate is None else improvement_rate
        pool = _Pool(queues, self.config.node_size, self.config.aligned)
        found = self._search(pool, tokens, _Pool.EMPTY, 0, 0.0, 0, 0, r, math.inf)
        if found is None:
            raise RuntimeError(f"no group of any size in {self.sp_sizes} fits the pool")
        return Plan(tuple(Chunk(t, h, pool.members(g), start, end)
                          for t, h, g, start, end in found[2]))

    def _single_chunk(self, pool: _Pool, tokens: int, group: int, size: int, end_prev: float,
                      history: int, first: int, r: float):
        """Algorithm 2: all remaining tokens as one chunk on the group grown from the last; a
        larger SP is taken only if it cuts TTFT by more than r relative to the best so far.
        (ttft, index of its SP size, (chunk,)) or None.

        A size whose chunk could not pass even starting at end_prev is skipped before its
        group is built: it starts no sooner, and float addition and subtraction are
        monotone, so the test fails on its real end too."""
        best = None
        sizes, seconds, extend = self.sp_sizes, self._seconds, pool.extend_unmemoised
        memo, key = pool.memo, group * pool.stride   # Extend's memo, read inline
        for i in range(first, len(sizes)):
            s = sizes[i]
            if s < size:
                continue
            t = seconds[i](history, tokens)
            if best is not None and (best[1] - (end_prev + t)) <= r * best[1]:
                continue
            ext = memo.get(key + s, _MISSING)
            if ext is _MISSING:
                ext = memo[key + s] = extend(group, s)
            if ext is None:
                continue
            start = end_prev if end_prev > ext[1] else ext[1]
            end = start + t
            if best is None or (best[1] - end) > r * best[1]:
                best = (ext[0], end, start, i)
        if best is None:
            return None
        g, end, start, i = best
        return end, i, ((tokens, history, g, start, end),)

    def _search(self, pool: _Pool, tokens: int, group: int, size: int, end_prev: float,
                history: int, first: int, r: float, bound: float):
        """Algorithm 1 for the last `tokens` tokens after `history`, the previous chunk on
        `group` of `size` instances ending at end_prev, with candidate sizes
        sp_sizes[first:]: (ttft, index of the single-chunk plan's SP size, the chunks) or
        None.

        `bound`: the caller takes the result only if its TTFT is below this, so a chunked
        candidate whose chunk cannot end before min(bound, best so far) is skipped
        unexplored: a chunk's seconds are >= 0 and every later chunk starts after it ends,
        so no plan through it ends sooner. Exact by induction on the recursion: where the
        unpruned search's plan ends before `bound`, this returns that same plan (the first
        plan at the least TTFT; only TTFTs above it are skipped); elsewhere it returns a
        plan ending no sooner than the unpruned one, so not before `bound` either. At the
        top, bound is inf (tests/test_cdsp.py pins the plans). Alg. 2's plan is always
        computed: it sets sp_max."""
        best = self._single_chunk(pool, tokens, group, size, end_prev, history, first,
                                  r)                                   # line 3
        sizes = self.sp_sizes
        if best is None or not self.config.chunking or first == len(sizes) - 1:
            return best                                                # line 5
        top = best[1]                                                  # line 4: sp_max
        lo = first
        while sizes[lo] < size:
            lo += 1
        multiple, min_tokens = self.config.chunk_multiple, self.config.min_chunk_tokens
        extend, seconds, within = pool.extend_unmemoised, self._seconds, self._tokens_within
        memo, stride = pool.memo, pool.stride
        limit = best[0] if best[0] < bound else bound
        for i in range(lo, top + 1):                                   # lines 6-7
            # Algorithm 3 (line 10): the chunk on G_cur that ends when G_next is free.
            cur = memo.get(group * stride + sizes[i], _MISSING)
            if cur is _MISSING:
                cur = memo[group * stride + sizes[i]] = extend(group, sizes[i])
            if cur is None:
                continue
            start = end_prev if end_prev > cur[1] else cur[1]
            if start >= limit:
                continue
            g = cur[0]
            for j in range(i + 1, top + 1):
                nxt = memo.get(g * stride + sizes[j], _MISSING)
                if nxt is _MISSING:
                    nxt = memo[g * stride + sizes[j]] = extend(g, sizes[j])
                if nxt is None or nxt[1] <= start:
                    continue
                l_c = int(min(within[i](history, nxt[1] - start), tokens)
                          // multiple * multiple)
                # Lines 11-12: too short to pay for a chunk, or leaving too little after it.
                if l_c < min_tokens or tokens - l_c < min_tokens:
                    continue
                end = start + seconds[i](history, l_c)
                if end >= limit:
                    continue
                # Lines 14-18: Eq. 2 for the chunk (its group is busy until it ends), then
                # the rest with the sizes >= s_next.
                rest = self._search(pool, tokens - l_c, g, sizes[i], end, history + l_c, j, r,
                                    limit)
                if rest is not None and rest[0] < best[0]:             # lines 20-21
                    best = (rest[0], best[1], ((l_c, history, g, start, end),) + rest[2])
                    limit = best[0] if best[0] < bound else bound
        return best                                                    # line 22


class FixedSpScheduler:
    """The fixed-SP baseline: the pool cut into independent groups of `sp` instances (node by
    node, so a group stays inside a node where it fits), each request, whole, to the group
    where it would finish first by Eq. 1 (its longest queue plus its predicted time)."""

    def __init__(self, num_instances: int, sp: int, model: ChunkLatency):
        if sp < 1 or num_instances % sp:
            raise ValueError(f"fixed SP {sp} must divide the pool's {num_instances} instances")
        self.num_instances, self.sp, self.model = num_instances, sp, model
        self.groups = [tuple(range(b, b + sp)) for b in range(0, num_instances, sp)]

    def plan(self, tokens: int, queues: Sequence[float], improvement_rate: float | None = None
             ) -> Plan:
        t = self.model.seconds(0, tokens)
        group = min(self.groups, key=lambda g: max(queues[i] for i in g))
        start = max(queues[i] for i in group)
        return Plan((Chunk(tokens, 0, group, start, start + t),))


# ---------------------------------------------------------------------------------------
# The improvement rate: profiled per arrival rate, chosen from a sliding window
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ImprovementRateTable:
    """The offline profile: the best improvement rate at each simulated arrival rate."""

    arrival_rates: tuple[float, ...]      # requests/s, ascending
    improvement_rates: tuple[float, ...]

    def __post_init__(self):
        if not self.arrival_rates or len(self.arrival_rates) != len(self.improvement_rates):
            raise ValueError("ImprovementRateTable needs one improvement rate per arrival rate")
        if list(self.arrival_rates) != sorted(set(self.arrival_rates)):
            raise ValueError(f"arrival_rates must be distinct and ascending: {self.arrival_rates}")

    def lookup(self, arrival_rate: float) -> float:
        """The improvement rate of the recorded arrival rate closest to the observed one
        (ties go to the lower rate)."""
        i = min(range(len(self.arrival_rates)),
                key=lambda k: abs(self.arrival_rates[k] - arrival_rate))
        return self.improvement_rates[i]


class AdaptiveImprovementRate:
    """Online: the arrival rate over a sliding window, looked up every `update_every_s`.

    The paper updates "every 30 seconds"; the window's length it does not give: we use 60 s
    (two update periods). Before the first update (a cold start), the rate is looked up at
    every arrival from the arrivals so far ((count - 1) / span), and the first arrival gets
    the table's lowest-load entry (an empty system is at light load).
    """

    def __init__(self, table: ImprovementRateTable, *, window_s: float = 60.0,
                 update_every_s: float = 30.0):
        if window_s <= 0 or update_every_s <= 0:
            raise ValueError(f"{window_s=} and {update_every_s=} must be > 0")
        self.table, self.window_s, self.update_every_s = table, window_s, update_every_s
        self.current = table.improvement_rates[0]
        self._arrivals: list[float] = []
        self._first: float | None = None
        self._next_update: float | None = None
        self._updated = False

    def observe(self, now: float) -> float:
        """Records an arrival at `now` and returns the improvement rate to plan it with."""
        if self._first is None:
            self._first, self._next_update = now, now + self.update_every_s
        self._arrivals.append(now)
        if now < self._next_update:
            if not self._updated and now > self._first:   # cold start: every arrival so far
                self.current = self.table.lookup((len(self._arrivals) - 1) / (now - self._first))
        else:
            cut = bisect.bisect_left(self._arrivals, now - self.window_s)
            del self._arrivals[:cut]
            span = min(self.window_s, now - self._first)
            self.current = self.table.lookup(len(self._arrivals) / span)
            self._updated = True
            while self._next_update <= now:
                self._next_update += self.update_every_s
        return self.current


# ---------------------------------------------------------------------------------------
# Decode routing (section 5.2): freeness with virtual usage
# ---------------------------------------------------------------------------------------

class DecodeRouter:
    """Sends each prefilled request to the decode instance with the highest freeness:
    (slots free, counting the slots of requests still being transferred as used -- Llumnix's
    virtual usage) / active batch size.

    Open choices: an instance with an empty batch has infinite freeness (any free slot beats
    a busy instance); ties go to the lower index; a request's slots are its prompt plus its
    output budget, reserved whole at routing time.
    """

    def __init__(self, slots_per_instance: Sequence[int]):
        if not slots_per_instance or any(s < 1 for s in slots_per_instance):
            raise ValueError(f"slots_per_instance must be >= 1 each: {slots_per_instance}")
        self.slots = list(slots_per_instance)
        self.used = [0] * len(self.slots)
        self.virtual = [0] * len(self.slots)
        self.batch = [0] * len(self.slots)
        self._where: dict[str, tuple[int, int, bool]] = {}   # id -> (instance, slots, landed)

    def freeness(self, i: int) -> float:
        free = self.slots[i] - self.used[i] - self.virtual[i]
        return math.inf if self.batch[i] == 0 else free / self.batch[i]

    def route(self, request_id: str, slots: int) -> int | None:
        """Picks an instance with room for `slots`, counts them as virtual usage; None if no
        instance has room (the caller retries when a request finishes)."""
        if request_id in self._where:
            raise ValueError(f"request {request_id!r} is already routed")
        fits = [i for i in range(len(self.slots))
                if self.slots[i] - self.used[i] - self.virtual[i] >= slots]
        if not fits:
            return None
        i = max(fits, key=lambda k: (self.freeness(k), -k))
        self.virtual[i] += slots
        self._where[request_id] = (i, slots, False)
        return i

    def transfer_done(self, request_id: str) -> None:
        """All chunks of its KV arrived: virtual usage becomes real, it joins the batch."""
        i, slots, landed = self._where[request_id]
        if landed:
            raise ValueError(f"request {request_id!r} already landed")
        self.virtual[i] -= slots
        self.used[i] += slots
        self.batch[i] += 1
        self._where[request_id] = (i, slots, True)

    def finish(self, request_id: str) -> None:
        i, slots, landed = self._where.pop(request_id)
        if landed:
            self.used[i] -= slots
            self.batch[i] -= 1
        else:
            self.virtual[i] -= slots
