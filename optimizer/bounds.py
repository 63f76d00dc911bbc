"""Lower bounds on makespan and stage_span (ms), valid for every schedule of a compiled problem.

Each rank r runs its own work ``compute[r]`` one action at a time, so its span (last end − first
start) is its work plus its idle time. Two idle windows no schedule can avoid:

* **Warm-up** (Zero Bubble paper, arXiv 2401.10241, App. B, generalised): between the rank's first
  action and its first backward (I or B) the rank can run only forwards (a W needs its own I first).
  That backward depends on a chain through the rest of the pipeline, of length at least ``D_r`` from
  the start of the rank's first forward of the same microbatch. The forwards that fit in between are
  limited by memory: nothing is freed before the first backward, so their activations sum to at most
  ``limit − static``. With ``Fmax_r`` the most forward time that fits (a fractional knapsack, an upper
  bound on any integer choice), the warm-up idle is at least ``D_r − Fmax_r``. For one stage per rank,
  uniform costs and ``k = ⌊limit / activation⌋`` forwards this is the paper's
  ``(p−1)(T_I + 2·p2p) + (p−k)·T_F`` on rank 0.
* **Cool-down**: after the rank's last forward starts, the rank can only finish the backward work that
  is pending then; every pending backward holds memory (its activation, or the part retained for W),
  so that work is at most a knapsack of capacity ``limit − static``. The rank's last action ends at
  least ``T_r`` after the last forward ends (the microbatch's path back through the pipeline), so the
  cool-down idle is at least ``T_r − pending_max``.

The two windows are disjoint when the rank cannot hold all its forwards at once (then its last
forward comes after its first backward), so the idle bounds add; otherwise the larger one counts.
Makespan adds to a rank's span the earliest time any of its actions can start (head) and the least
time the pipeline needs after its last action (tail); it is also at least one microbatch's critical
path.

**Bottleneck rank** (the one-machine relaxation of shop scheduling, with release times and delivery
times): a rank ``r`` runs a set ``S`` of its actions one at a time, none starting before its head and
each followed by at least its tail, so the span that encloses them is at least
``min_S head + Σ_S duration + min_S tail``; taken over the sets ``{head ≥ H, tail ≥ T}`` for every
threshold pair. For stage_span the frame is the span of the rank ``q`` where a microbatch enters the
pipeline: heads count from ``q``'s forward of the same microbatch, tails run to the end of that
microbatch's last action on ``q``. On rank 0 of a one-stage-per-rank pipeline, with ``r`` the last rank,
this is ``(p−1)(T_F + T_I + 2·p2p) + m·(T_F + T_I)_r + T_W``: rank ``p−1`` must run every forward and
input backward before rank 0's last input backward can start, which no memory limit relaxes (the
Zero Bubble paper's ZB-2p 1.5B p=8 m=24 span is exactly this).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipesched.optimizer.instance import Instance
from pipesched.optimizer.ir import Action, ActionKind
from pipesched.optimizer.progress import NO_DEADLINE, Deadline, SearchStopped

__all__ = ["LowerBounds", "lower_bound", "lower_bounds"]


@dataclass(frozen=True)
class LowerBounds:
    """Per-rank ingredients and the two bounds, all in ms.

    Attributes:
        compute: per-rank work.
        warmup_idle: per-rank idle before the first backward no schedule avoids.
        cooldown_idle: per-rank idle after the last forward no schedule avoids.
        head: per-rank earliest start of any action (from the first start overall).
        tail: per-rank least time from the rank's last end to the pipeline's last end.
        critical_path: one microbatch's longest dependency chain.
        stage_span: the stage_span bound.
        makespan: the makespan bound.
    """

    compute: list[float]
    warmup_idle: list[float]
    cooldown_idle: list[float]
    head: list[float]
    tail: list[float]
    critical_path: float
    stage_span: float
    makespan: float

    def value(self, objective: str) -> float:
        """The bound for ``"makespan"`` or ``"stage_span"``, ms."""
        return self.makespan if objective == "makespan" else self.stage_span


def _knapsack(capacity: float, items: list[tuple[float, float, int]]) -> float:
    """Fractional knapsack: the most value with total weight ≤ capacity.

    ``items`` are ``(weight bytes, value ms, count)``; an upper bound on any integer selection.
    """
    if capacity < 0:
        return 0.0
    total = 0.0
    free = [(v, c) for w, v, c in items if w <= 0]
    for v, c in free:
        total += v * c
    weighted = sorted(((v / w, w, v, c) for w, v, c in items if w > 0), reverse=True)
    left = capacity
    for _, w, v, c in weighted:
        if left <= 0:
            break
        take = min(c, left / w)
        total += take * v
        left -= take * w
    return total


def _topological(inst: Instance, members: list[int]) -> list[int]:
    """``members`` (one microbatch's actions) in an order where every predecessor comes first."""
    inside = set(members)
    indeg = {a: sum(1 for q, _ in inst.preds[a] if q in inside) for a in members}
    queue = [a for a in members if indeg[a] == 0]
    order: list[int] = []
    while queue:
        a = queue.pop()
        order.append(a)
        for b, _ in inst.succs[a]:
            if b in indeg:
                indeg[b] -= 1
                if indeg[b] == 0:
                    queue.append(b)
    return order


def _longest_from(inst: Instance, source: int, order: list[int]) -> dict[int, float]:
    """Longest path (ms) from the START of ``source`` to the start of every action it reaches.

    ``order`` is one microbatch's passes in topological order; paths leave it for nothing else (a relaxation).
    """
    dist = {source: 0.0}
    inside = set(order)
    for a in order:
        da = dist.get(a)
        if da is None:
            continue
        for b, latency in inst.succs[a]:
            if b not in inside:
                continue
            cand = da + inst.duration[a] + latency
            if cand > dist.get(b, -math.inf):
                dist[b] = cand
    return dist


def _to_rank(inst: Instance, order: list[int], rank: int) -> dict[int, float]:
    """Longest path (ms) from an action's END to the END of an action on ``rank`` reached strictly after it.

    ``order`` is one microbatch's actions in topological order; actions that reach nothing on ``rank``
    are absent. O(actions + dependencies) of the microbatch.
    """
    reach_of: dict[int, float] = {}
    duration, succs, ranks = inst.duration, inst.succs, inst.rank
    inside = set(order)
    for a in reversed(order):
        reach = -math.inf
        for b, latency in succs[a]:
            if b not in inside:
                continue
            after_b = reach_of.get(b, -math.inf)
            if ranks[b] == rank and after_b < 0.0:
                after_b = 0.0
            if after_b > -math.inf:
                reach = max(reach, latency + duration[b] + after_b)
        if reach > -math.inf:
            reach_of[a] = reach
    return reach_of


def _one_machine(groups: dict[tuple[float, float], float], deadline: Deadline) -> float:
    """``max over H, T of H + Σ{duration : head ≥ H, tail ≥ T} + T`` for ``(head, tail) → duration`` groups.

    O(heads × tails): heads are swept from the largest down while a per-tail column accumulates, and a
    suffix sum over the tails gives every ``(H, T)`` at once.

    Raises:
        SearchStopped: when ``deadline`` expires (polled once per head).
    """
    tails = sorted({t for _, t in groups})
    tail_index = {t: i for i, t in enumerate(tails)}
    by_head: dict[float, list[tuple[int, float]]] = {}
    for (h, t), d in groups.items():
        by_head.setdefault(h, []).append((tail_index[t], d))
    column = [0.0] * len(tails)
    best = 0.0
    for head in sorted(by_head, reverse=True):
        deadline.check()
        for i, d in by_head[head]:
            column[i] += d
        work = 0.0
        for i in range(len(tails) - 1, -1, -1):
            work += column[i]
            if work > 0 and head + work + tails[i] > best:
                best = head + work + tails[i]
    return best


@dataclass
class _Chain:
    """One distinct chain's microbatch: its actions in topological order, heads and tails (ms)."""

    microbatch: int
    count: int
    members: list[int]
    order: list[int]
    head: dict[int, float]
    tail: dict[int, float]
    by_rank: dict[int, list[int]]


def _chains(inst: Instance, deadline: Deadline) -> list[_Chain]:
    """One :class:`_Chain` per distinct chain (identical chains give identical paths). O(actions of those)."""
    counts: dict[tuple[int, ...], int] = {}
    rep: dict[tuple[int, ...], int] = {}
    for j, chain in enumerate(inst.chains):
        key = tuple(chain)
        counts[key] = counts.get(key, 0) + 1
        rep.setdefault(key, j)
    wanted = set(rep.values())
    microbatch_actions: dict[int, list[int]] = {j: [] for j in wanted}
    for idx, action in enumerate(inst.actions):
        # Passes only: communication actions run on their own stream beside the passes (leaving them and
        # their dependencies out relaxes the problem, so every bound stays valid).
        if action.microbatch in wanted and action.is_compute:
            microbatch_actions[action.microbatch].append(idx)
    out: list[_Chain] = []
    for key, j in rep.items():
        deadline.check()
        members = microbatch_actions[j]
        order = _topological(inst, members)
        # Heads: longest path from the microbatch's sources (all may start at the first start).
        head = {a: 0.0 for a in members}
        for a in order:
            for b, latency in inst.succs[a]:
                if b in head:
                    head[b] = max(head[b], head[a] + inst.duration[a] + latency)
        # Tails: longest path from an action's end to the end of the microbatch's last action.
        tail: dict[int, float] = {}
        for a in reversed(order):
            tail[a] = max(
                (latency + inst.duration[b] + tail[b] for b, latency in inst.succs[a] if b in tail), default=0.0
            )
        by_rank: dict[int, list[int]] = {}
        for a in members:
            by_rank.setdefault(inst.rank[a], []).append(a)
        out.append(_Chain(j, counts[key], members, order, head, tail, by_rank))
    return out


def _bottleneck_bounds(inst: Instance, chains: list[_Chain], deadline: Deadline) -> tuple[float, float]:
    """The bottleneck-rank bounds of the module docstring: ``(stage_span, makespan)``, ms.

    Each rank's one-machine bound holds alone, so when ``deadline`` expires the ranks done so far count
    and the rest are left out (0 when it expires before any).
    """
    span_groups: dict[tuple[int, int], dict[tuple[float, float], float]] = {}
    makespan_groups: dict[int, dict[tuple[float, float], float]] = {}
    try:
        for chain in chains:
            deadline.check()
            count = chain.count
            for a in chain.members:
                group = makespan_groups.setdefault(inst.rank[a], {})
                key = (chain.head[a], chain.tail[a])
                group[key] = group.get(key, 0.0) + inst.duration[a] * count
            # Stage_span frame of the entry rank q: from q's forward of the microbatch to its last end on q.
            entry = inst.index[_entry_forward(inst, chain.microbatch)]
            q = inst.rank[entry]
            start = _longest_from(inst, entry, chain.order)
            to_q = _to_rank(inst, chain.order, q)
            for a in chain.members:
                if a not in start:
                    continue
                reach = to_q.get(a, -math.inf)
                if inst.rank[a] == q:
                    reach = max(reach, 0.0)
                if not math.isfinite(reach):
                    continue
                group = span_groups.setdefault((q, inst.rank[a]), {})
                key = (start[a], reach)
                group[key] = group.get(key, 0.0) + inst.duration[a] * count
    except SearchStopped:
        return 0.0, 0.0
    stage_span = makespan = 0.0
    try:
        for span_group in span_groups.values():
            stage_span = max(stage_span, _one_machine(span_group, deadline))
        for makespan_group in makespan_groups.values():
            makespan = max(makespan, _one_machine(makespan_group, deadline))
    except SearchStopped:
        pass
    return stage_span, makespan


def _entry_forward(inst: Instance, microbatch: int) -> Action:
    """The forward where ``microbatch`` enters the pipeline (its chain's first stage)."""
    return Action(inst.chains[microbatch][0], ActionKind.FORWARD, microbatch)


def _trivial(inst: Instance) -> LowerBounds:
    """Each rank's work alone: the bound that costs nothing beyond the compiled instance."""
    p = inst.num_ranks
    work = max(inst.compute, default=0.0)
    return LowerBounds(
        compute=list(inst.compute),
        warmup_idle=[0.0] * p,
        cooldown_idle=[0.0] * p,
        head=[0.0] * p,
        tail=[0.0] * p,
        critical_path=0.0,
        stage_span=work,
        makespan=work,
    )


def lower_bounds(inst: Instance, deadline: Deadline | None = None) -> LowerBounds:
    """Compute the bounds of the module docstring for ``inst``.

    Args:
        inst: the compiled problem.
        deadline: when it expires (time or stop flag) the bounds computed so far are returned: each
            rank's work (always), heads, tails and the critical path (O(actions of one microbatch per
            distinct chain)), then the warm-up/cool-down idle rank by rank (O(ranks × actions of one
            microbatch)), then the bottleneck-rank bounds rank by rank. Every partial answer is a valid
            (weaker) bound.

    Returns:
        :class:`LowerBounds`, all times in ms. Ranks without actions get zeros.
    """
    deadline = deadline or NO_DEADLINE
    p = inst.num_ranks
    try:
        chains = _chains(inst, deadline)
    except SearchStopped:
        return _trivial(inst)
    head, tail, critical_path = _heads_and_tails(inst, chains)
    window_warm, window_cool, done = _windows(inst, chains, deadline)
    warm_idle = [0.0] * p
    cool_idle = [0.0] * p
    span = list(inst.compute)
    for r in range(p):
        if not inst.rank_actions[r] or not done[r]:
            continue
        warm_idle[r], cool_idle[r], span[r] = _rank_idle(inst, r, window_warm[r], window_cool[r])
    bottleneck_span, bottleneck_makespan = _bottleneck_bounds(inst, chains, deadline)
    stage_span = max([bottleneck_span, *span])
    makespan = max([critical_path, bottleneck_makespan] + [head[r] + span[r] + tail[r] for r in range(p)])
    return LowerBounds(
        compute=list(inst.compute),
        warmup_idle=warm_idle,
        cooldown_idle=cool_idle,
        head=head,
        tail=tail,
        critical_path=critical_path,
        stage_span=stage_span,
        makespan=makespan,
    )


def _heads_and_tails(inst: Instance, chains: list[_Chain]) -> tuple[list[float], list[float], float]:
    """Per rank the least time before its first action can start and after its last can end, and the critical
    path, over every distinct chain (ms)."""
    p = inst.num_ranks
    head = [math.inf] * p
    tail = [math.inf] * p
    critical_path = 0.0
    for chain in chains:
        for a in chain.members:
            critical_path = max(critical_path, chain.head[a] + inst.duration[a] + chain.tail[a])
        for r, acts in chain.by_rank.items():
            head[r] = min(head[r], min(chain.head[a] for a in acts))
            tail[r] = min(tail[r], min(chain.tail[a] for a in acts))
    for r in range(p):
        if not inst.rank_actions[r] or not math.isfinite(head[r]):
            head[r] = 0.0
        if not inst.rank_actions[r] or not math.isfinite(tail[r]):
            tail[r] = 0.0
    return head, tail, critical_path


def _windows(inst: Instance, chains: list[_Chain], deadline: Deadline) -> tuple[list[float], list[float], list[bool]]:
    """Per rank the warm-up window D_r (first forward to the first backward it can reach) and the cool-down
    window T_r (a forward's end to its microbatch's last action on the rank), rank by rank until ``deadline``; a
    rank's windows count (``done``) only once every chain has been seen on it."""
    p = inst.num_ranks
    window_warm = [math.inf] * p
    window_cool = [math.inf] * p
    done = [False] * p
    try:
        for r in range(p):
            for chain in chains:
                deadline.check()
                acts = chain.by_rank.get(r, [])
                forwards = [a for a in acts if inst.actions[a].kind == ActionKind.FORWARD]
                backwards = [a for a in acts if inst.actions[a].kind == inst.backward_kind]
                if not forwards or not backwards:
                    continue
                first_forward = min(forwards, key=lambda a: chain.head[a])
                dist = _longest_from(inst, first_forward, chain.order)
                window_warm[r] = min(window_warm[r], min(dist.get(b, 0.0) for b in backwards))
                reach = _to_rank(inst, chain.order, r)
                window_cool[r] = min(window_cool[r], min(reach.get(f, 0.0) for f in forwards))
            done[r] = True
    except SearchStopped:
        pass
    return window_warm, window_cool, done


def _rank_idle(inst: Instance, r: int, window_warm: float, window_cool: float) -> tuple[float, float, float]:
    """Rank ``r``'s forced warm-up and cool-down idle (its window less the most work its free memory lets it do
    there: a knapsack over its stages' passes) and its span bound, ms."""
    capacity = inst.limit[r] - inst.static[r]
    stage_ids = sorted({inst.actions[a].stage for a in inst.rank_actions[r]})
    f_items: list[tuple[float, float, int]] = []
    pending_items: list[tuple[float, float, int]] = []
    total_activation = 0.0
    for s in stage_ids:
        count = sum(1 for chain in inst.chains if s in chain)
        j = inst.first_microbatch(s)
        f_idx = inst.action_id(s, ActionKind.FORWARD, j)
        act = inst.mem_delta[f_idx]
        total_activation += act * count
        f_items.append((act, inst.duration[f_idx], count))
        if inst.split_backward:
            i_idx = inst.action_id(s, ActionKind.BACKWARD_INPUT, j)
            w_idx = inst.action_id(s, ActionKind.BACKWARD_WEIGHT, j)
            retained = -inst.mem_delta[w_idx]
            pending_items.append((act, inst.duration[i_idx] + inst.duration[w_idx], count))
            pending_items.append((retained, inst.duration[w_idx], count))
        else:
            b_idx = inst.action_id(s, ActionKind.BACKWARD, j)
            pending_items.append((act, inst.duration[b_idx], count))
    warm_idle = cool_idle = 0.0
    if math.isfinite(capacity) and math.isfinite(window_warm):
        warm_idle = max(0.0, window_warm - _knapsack(capacity, f_items))
    if math.isfinite(capacity) and math.isfinite(window_cool):
        cool_idle = max(0.0, window_cool - _knapsack(capacity, pending_items))
    disjoint = total_activation > capacity * (1 + 1e-12) and inst.num_microbatches > 0
    idle = warm_idle + cool_idle if disjoint else max(warm_idle, cool_idle)
    return warm_idle, cool_idle, inst.compute[r] + idle


def lower_bound(inst: Instance, objective: str, deadline: Deadline | None = None) -> float:
    """The tightest of this module's bounds on ``objective`` (``"makespan"``/``"stage_span"``), ms, that
    :func:`lower_bounds` reaches before ``deadline``."""
    return lower_bounds(inst, deadline).value(objective)
