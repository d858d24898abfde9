"""The CDSP planner's inner loop: Eq. 1, Extend and the search of Algorithms 1-3.

`medha_jax.scheduler.cdsp` is the scheduler (its docstring states the algorithms and the
choices made where the paper leaves them open); this module is the part of it that runs per
arrival, on the prompt's TTFT path, typed so that mypyc can compile it: `setup.py` does
at install when it can (the paper's planner is C++, 22.8-30.6 us a plan; at SP 128 on a
2-core VM this one plans in 34-45 us p50 compiled and 116-195 us interpreted,
`benchmarks.cdsp` section c). Without a compiler it runs as plain Python, with the same
plans: `tests/test_cdsp.py` compares the two.

Kept to what mypyc compiles to native code: classes with typed attributes, int and float
locals, lists and int-keyed dicts, no closures, no numpy.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Final, Protocol

NONE: Final = -1   # the group id of "no such group" (Extend's None)


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

    def __post_init__(self) -> None:
        for name, value in (("alpha", self.alpha), ("beta", self.beta),
                            ("gamma", self.gamma), ("delta", self.delta)):
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"LatencyModel.{name} must be finite and >= 0 (sp={self.sp}), "
                                 f"got {value!r}")

    def __reduce__(self) -> tuple[type[LatencyModel], tuple[int, float, float, float, float]]:
        # Pickled by its constructor: compiled by mypyc, a frozen dataclass's default
        # pickling (setting attributes on a blank object) is refused.
        return LatencyModel, (self.sp, self.alpha, self.beta, self.gamma, self.delta)

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


class Groups:
    """One plan's view of the instances, for Extend.

    Queues outside the group being grown stay fixed through the search (Eq. 2 only touches
    group members, which Extend never adds again), so each node's queues are sorted once per
    plan. Both rules of Extend take a node's instances shortest-queue first, so a group is a
    prefix of each node's sorted order: a group is its nodes (a bit mask) and the counts of
    the nodes it takes in part (free mode), or one aligned block (aligned mode). The search
    passes groups around as small ints, 0 the empty group: in free mode an index into this
    plan's groups, in aligned mode 1 + the blocks of the smaller sizes + the block's index
    among those of its size. So Extend's memo is a list indexed by group and size (no
    hashing, no boxed keys). Instances are named (in free mode sorting a node's queues,
    ties to the lower index) only for the groups of the plan returned.
    """

    def __init__(self, queues: Sequence[float], node_size: int, aligned: bool,
                 sp_sizes: list[int]) -> None:
        self.q = q = list(queues)
        self.sp_sizes = sp_sizes
        self.n = n = len(q)
        self.node_size = node_size
        self.aligned = aligned
        # Extend's memo: memo[group * len(sp_sizes) + i] is an index into extended_group /
        # extended_added, or -1 before the first call.
        self.unset = [-1] * len(sp_sizes)
        self.memo: list[int] = []
        self.extended_group: list[int] = []
        self.extended_added: list[float] = []
        # Aligned: levels[k][b] is the instance with the longest queue in block b of size
        # 2**k (an index, not its queue: no float is boxed), and block b of size 2**k has
        # group id first_id[k] + b. A pool of 24 at size 16 drops the odd half ([0, 16)).
        self.levels: list[list[int]] = []
        self.first_id: list[int] = []
        # Free: each node's queues sorted (sorting values, not indices by value: a third
        # of the cost; members() names them), and the groups by id: size, nodes as bits,
        # {node: count} of the nodes taken in part.
        self.qs: list[list[float]] = []
        self.sizes: list[int] = [0]
        self.masks: list[int] = [0]
        self.parts: list[dict[int, int]] = [{}]
        self.whole_nodes: list[int] = []
        if aligned:
            level = list(range(n))
            groups = 1
            while level:
                self.levels.append(level)
                self.first_id.append(groups)
                groups += len(level)
                halves, level = level, []
                for b in range(len(halves) // 2):   # by index: mypyc compiles it to a C loop
                    left, right = halves[2 * b], halves[2 * b + 1]
                    level.append(right if q[right] > q[left] else left)
            self.memo = self.unset * groups
        else:
            self.qs = [sorted(q[b:b + node_size]) for b in range(0, n, node_size)]
            self.memo = list(self.unset)

    def _block_of(self, group: int) -> tuple[int, int]:
        """Aligned mode: (k, b) of the group that is block b of size 2**k."""
        k = len(self.first_id) - 1
        while self.first_id[k] > group:
            k -= 1
        return k, group - self.first_id[k]

    def members(self, group: int) -> tuple[int, ...]:
        if not group:
            return ()
        if self.aligned:
            k, b = self._block_of(group)
            return tuple(range(b << k, (b + 1) << k))
        mask, part = self.masks[group], self.parts[group]
        out: list[int] = []   # node by node, each ascending: the whole group ascending
        node_size, q, node = self.node_size, self.q, 0
        while mask:
            if mask & 1:
                b = node * node_size
                end = min(b + node_size, self.n)
                if node in part:
                    # Its `count` shortest queues, ties to the lower index: those below the
                    # count-th shortest, then those equal to it, in index order.
                    count = part[node]
                    kth = self.qs[node][count - 1]
                    ties = count
                    for i in range(b, end):
                        if q[i] < kth:
                            ties -= 1
                    for i in range(b, end):
                        if q[i] < kth:
                            out.append(i)
                        elif q[i] == kth and ties > 0:
                            out.append(i)
                            ties -= 1
                else:
                    out.extend(range(b, end))
            mask >>= 1
            node += 1
        return tuple(out)

    def extend(self, group: int, i: int) -> tuple[int, float]:
        """Extend(G_prev, s) for s = sp_sizes[i]: a group of s instances containing `group`,
        and the longest queue of the instances it adds (-inf if none); (NONE, 0.0) if the
        pool cannot make one."""
        s = self.sp_sizes[i]
        if s > self.n:
            return NONE, 0.0
        key = group * len(self.unset) + i
        at = self.memo[key]
        if at < 0:
            g, added = self._extend_aligned(group, s) if self.aligned else \
                self._extend(group, s)
            self.memo[key] = len(self.extended_group)
            self.extended_group.append(g)
            self.extended_added.append(added)
            return g, added
        return self.extended_group[at], self.extended_added[at]

    def _extend_aligned(self, group: int, s: int) -> tuple[int, float]:
        levels, q = self.levels, self.q
        k_s = s.bit_length() - 1
        if not group:   # the aligned block whose longest queue is shortest (ties: lower)
            level = levels[k_s]
            best, best_queue = 0, q[level[0]]
            for b in range(1, len(level)):
                queue = q[level[b]]
                if queue < best_queue:
                    best, best_queue = b, queue
            return self.first_id[k_s] + best, best_queue
        k, b = self._block_of(group)
        if k == k_s:
            return group, -math.inf
        start = b << k
        new_start = start // s * s
        if new_start + s > self.n:   # a pool of 24 has one block of 16: [0, 16)
            return NONE, 0.0
        added = -math.inf
        while k < k_s:   # the sibling block at each level up to s
            sibling = q[levels[k][b ^ 1]]
            added = sibling if sibling > added else added
            b, k = b // 2, k + 1
        return self.first_id[k_s] + new_start // s, added

    def _whole_nodes(self) -> list[int]:
        """The nodes with node_size instances (only the last can be short) by their longest
        queue, ties to the lower node; sorted once per plan, when first needed."""
        if not self.whole_nodes:
            qs, size = self.qs, self.node_size
            longest = [q[-1] for q in qs] if len(qs[-1]) == size else [q[-1] for q in qs[:-1]]
            if len(longest) > 32:
                self.whole_nodes = sorted(range(len(longest)), key=longest.__getitem__)
            else:   # few nodes: an insertion sort (stable), a C loop when compiled
                for node in range(len(longest)):
                    at = len(self.whole_nodes)
                    while at and longest[self.whole_nodes[at - 1]] > longest[node]:
                        at -= 1
                    self.whole_nodes.insert(at, node)
        return self.whole_nodes

    def _new_group(self, size: int, mask: int, part: dict[int, int]) -> int:
        self.sizes.append(size)
        self.masks.append(mask)
        self.parts.append(part)
        self.memo.extend(self.unset)
        return len(self.sizes) - 1

    def _extend(self, group: int, s: int) -> tuple[int, float]:
        size, mask, part = self.sizes[group], self.masks[group], self.parts[group]
        need = s - size
        if need < 0:   # (s > n is refused by extend)
            return NONE, 0.0
        if need == 0:
            return group, -math.inf
        qs, node_size = self.qs, self.node_size
        added = -math.inf
        if part:
            # Rule (2): first the shortest-queued instances of the nodes the group uses (only
            # those it takes in part have any left).
            if len(part) == 1:   # one node's sorted tail: a prefix of it, no merge
                for node, k in part.items():
                    left = len(qs[node]) - k
                    if need < left:
                        return (self._new_group(s, mask, {node: k + need}),
                                qs[node][k + need - 1])
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
            ranking = self._whole_nodes()
            t = 0
            while whole:
                if t == len(ranking):
                    return NONE, 0.0
                node = ranking[t]
                if not mask >> node & 1:
                    mask |= 1 << node
                    whole -= 1
                t += 1
            last = qs[ranking[t - 1]][-1]   # the last node taken has the longest queue
            added = last if last > added else added
            need %= node_size
        if need:    # rule (1) in a node: the node whose need-th shortest queue is shortest
            node, kth_queue = NONE, math.inf
            for candidate in range(len(qs)):
                if not mask >> candidate & 1 and len(qs[candidate]) >= need and (
                        node == NONE or qs[candidate][need - 1] < kth_queue):
                    node, kth_queue = candidate, qs[candidate][need - 1]
            if node == NONE:
                return NONE, 0.0
            mask |= 1 << node
            if need < len(qs[node]):
                part = {**part, node: need}
            added = kth_queue if kth_queue > added else added
        return self._new_group(s, mask, part), added


class ChunkSearch:
    """Algorithms 1-3 for one pool: its SP sizes, their chunk models and the config's
    chunking rules. `run` plans one prompt over one `Groups`."""

    def __init__(self, sizes: list[int], models: list[ChunkLatency], chunking: bool,
                 chunk_multiple: int, min_chunk_tokens: int) -> None:
        self.sizes = sizes
        self.last = len(sizes) - 1
        # Eq. 1 models called as themselves (a direct call when compiled); any other
        # ChunkLatency (a table) through the protocol.
        self.eq1: list[LatencyModel] = []
        self.other: list[ChunkLatency] = []
        if all(isinstance(m, LatencyModel) for m in models):
            self.eq1 = [m for m in models if isinstance(m, LatencyModel)]
        else:
            self.other = models
        self.chunking = chunking
        self.multiple = chunk_multiple
        self.min_tokens = min_chunk_tokens

    def seconds(self, i: int, history: float, tokens: float) -> float:
        if self.eq1:
            return self.eq1[i].seconds(history, tokens)
        return self.other[i].seconds(history, tokens)

    def tokens_within(self, i: int, history: float, budget_s: float) -> float:
        if self.eq1:
            return self.eq1[i].tokens_within(history, budget_s)
        return self.other[i].tokens_within(history, budget_s)

    def plan(self, tokens: int, queues: Sequence[float], node_size: int, aligned: bool,
             r: float) -> list[tuple[int, int, tuple[int, ...], float, float]]:
        """The chunks of a `tokens`-token prompt's plan as (tokens, history, instances,
        start, end); [] if no group of any size fits the pool."""
        groups = Groups(queues, node_size, aligned, self.sizes)
        found = self.search(groups, tokens, 0, 0, 0.0, 0, 0, r, math.inf)
        chunks = []
        while found is not None:
            chunks.append((found.tokens, found.history, groups.members(found.group),
                           found.start, found.end))
            found = found.rest
        return chunks

    def single_chunk(self, groups: Groups, tokens: int, group: int, size: int,
                     end_prev: float, history: int, first: int, r: float) -> Found | None:
        """Algorithm 2: all remaining tokens as one chunk on the group grown from the last; a
        larger SP is taken only if it cuts TTFT by more than r relative to the best so far.

        A size whose chunk could not pass even starting at end_prev is skipped before its
        group is built: it starts no sooner, and float addition and subtraction are
        monotone, so the test fails on its real end too."""
        best_end, best_start, best_group, best_i = math.inf, 0.0, NONE, -1
        sizes = self.sizes
        for i in range(first, len(sizes)):
            s = sizes[i]
            if s < size:
                continue
            t = self.seconds(i, history, tokens)
            if best_i >= 0 and (best_end - (end_prev + t)) <= r * best_end:
                continue
            g, free_at = groups.extend(group, i)
            if g == NONE:
                continue
            start = end_prev if end_prev > free_at else free_at
            end = start + t
            if best_i < 0 or (best_end - end) > r * best_end:
                best_end, best_start, best_group, best_i = end, start, g, i
        if best_i < 0:
            return None
        return Found(best_end, best_i, tokens, history, best_group, best_start, best_end, None)

    def search(self, groups: Groups, tokens: int, group: int, size: int, end_prev: float,
               history: int, first: int, r: float, bound: float) -> Found | None:
        """Algorithm 1 for the last `tokens` tokens after `history`, the previous chunk on
        `group` of `size` instances ending at end_prev, with candidate sizes
        sizes[first:]: the best plan found (its TTFT, the index of Alg. 2's SP size, its
        chunks) or None.

        `bound`: the caller takes the result only if its TTFT is below this, so a chunked
        candidate whose chunk cannot end before min(bound, best so far) is skipped
        unexplored: a chunk's seconds are >= 0 and every later chunk starts after it ends,
        so no plan through it ends sooner. Exact by induction on the recursion: where the
        unpruned search's plan ends before `bound`, this returns that same plan (the first
        plan at the least TTFT; only TTFTs above it are skipped); elsewhere it returns a
        plan ending no sooner than the unpruned one, so not before `bound` either. At the
        top, bound is inf (tests/test_cdsp.py pins the plans). Alg. 2's plan is always
        computed: it sets sp_max."""
        best = self.single_chunk(groups, tokens, group, size, end_prev, history, first,
                                 r)                                    # line 3
        sizes = self.sizes
        if best is None or not self.chunking or first == self.last:
            return best                                                # line 5
        top = best.sp_index                                            # line 4: sp_max
        lo = first
        while sizes[lo] < size:
            lo += 1
        multiple, min_tokens = self.multiple, self.min_tokens
        limit = best.ttft if best.ttft < bound else bound
        for i in range(lo, top + 1):                                   # lines 6-7
            # Algorithm 3 (line 10): the chunk on G_cur that ends when G_next is free.
            g, free_at = groups.extend(group, i)
            if g == NONE:
                continue
            start = end_prev if end_prev > free_at else free_at
            if start >= limit:
                continue
            for j in range(i + 1, top + 1):
                nxt, next_free_at = groups.extend(g, j)
                if nxt == NONE or next_free_at <= start:
                    continue
                l_c = int(min(self.tokens_within(i, history, next_free_at - start), tokens)
                          // multiple) * multiple
                # Lines 11-12: too short to pay for a chunk, or leaving too little after it.
                if l_c < min_tokens or tokens - l_c < min_tokens:
                    continue
                end = start + self.seconds(i, history, l_c)
                if end >= limit:
                    continue
                # Lines 14-18: Eq. 2 for the chunk (its group is busy until it ends), then
                # the rest with the sizes >= s_next.
                rest = self.search(groups, tokens - l_c, g, sizes[i], end, history + l_c, j,
                                   r, limit)
                if rest is not None and rest.ttft < best.ttft:         # lines 20-21
                    best = Found(rest.ttft, best.sp_index, l_c, history, g, start, end,
                                 rest)
                    limit = best.ttft if best.ttft < bound else bound
        return best                                                    # line 22


class Found:
    """A plan (or the rest of one) the search found, as a linked list of its chunks (one
    object per chunk: the search makes and drops many). ttft: when its last chunk ends;
    sp_index: the index of Alg. 2's SP size at its first chunk (sp_max for the caller);
    the first chunk: `tokens` after `history` on `group`, from start to end; `rest`: the
    chunks after it (None: this is the last)."""

    def __init__(self, ttft: float, sp_index: int, tokens: int, history: int, group: int,
                 start: float, end: float, rest: Found | None) -> None:
        self.ttft = ttft
        self.sp_index = sp_index
        self.tokens = tokens
        self.history = history
        self.group = group
        self.start = start
        self.end = end
        self.rest = rest
