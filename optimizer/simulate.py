"""Simulator and validator: time any per-rank order by list scheduling and check it.

Every action starts as soon as its rank is free and all its inputs have arrived (predecessor end +
p2p latency between different ranks, none within a rank). Memory on a rank changes only through the
rank's own actions, which never overlap, so a rank's memory is piecewise constant: F's allocation is
counted from its start, I/W/B's frees from their end.

Rejections raise :class:`InvalidSchedule` with a machine-readable ``reason``:
``malformed`` (wrong number of ranks), ``unknown_action``, ``wrong_rank``, ``missing_action``,
``duplicate_action``, ``deadlock`` (with who waits on what) and ``memory_limit`` (rank, time, bytes).

The training step (contract, step_time): an instance with communication actions or optimizer steps
(:attr:`Instance.has_step_actions`) gives every rank a second resource, its communication stream. A rank's
list is then two in-order queues: its passes and OPTIMIZER_STEP on the compute stream, UNSHARD and
REDUCE_GRAD on the communication stream (they overlap compute, not each other), and RESHARD, a free that
takes no time and occupies neither. A communication action is issued where it stands in the list: it starts
no earlier than the pass before it in the list (PyTorch's runtime issues it when it reaches it), and a collective
with a replica wait (``costs.unshard_wait`` / ``costs.reduce_grad_wait``: the data-parallel replicas of a rank reach
it at different instants and it runs once the last one has entered) starts that many ms after it could, its stream
held meanwhile. With
synchronisation (no ``training.post_validation``) every OPTIMIZER_STEP waits for every other action of every
rank. Memory is then counted event by event in time order (frees before allocations at the same instant).
``step_time``: first start to the last OPTIMIZER_STEP's end, or under post-validation the max over ranks of
(the rank's OPTIMIZER_STEP end − its first start); without step actions it is the makespan, or the
stage_span under post-validation.

Compute beside communication (``costs.overlap_slowdown`` = s > 0, step actions only): while a rank's communication
stream runs an UNSHARD or REDUCE_GRAD, that rank's compute-stream actions progress at 1/(1 + s) speed, so an action
of D ms that a collective overlaps for o ms of wall time ends o·s/(1 + s) ms later (D of work = (wall − o) + o/(1 + s)).
Communication beside compute (``costs.communication_slowdown`` = c > 0) is the same rule the other way: while one of
the rank's compute-stream actions runs, its UNSHARD and REDUCE_GRAD progress at 1/(1 + c) speed (their costs are
their time with nothing beside them). The step is timed as above, then again with every action lengthened to what
the other stream of its rank in that timing makes it, until no action lengthens by more than 1e-6 ms (at most
:data:`SLOWDOWN_ROUNDS` timings). Actions only ever lengthen, so the step never shortens and every lower bound of the
unslowed step still holds. With s = c = 0 nothing of this runs.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any

from pipesched.optimizer.instance import Instance
from pipesched.optimizer.ir import Action, ActionKind, Orders

__all__ = [
    "InvalidSchedule",
    "SimulationResult",
    "action_orders",
    "check_placement",
    "indexed_orders",
    "simulate",
    "simulate_indexed",
]

#: Most timings of the overlap slowdown's fixed point (module docstring); the last is kept when it is reached.
SLOWDOWN_ROUNDS = 20
#: An action lengthened by less than this (ms) counts as settled.
SLOWDOWN_TOLERANCE_MS = 1e-6


class InvalidSchedule(ValueError):
    """A schedule the problem cannot run. ``reason`` is a short code, ``details`` a JSON-able dict."""

    def __init__(self, reason: str, message: str, **details: Any) -> None:
        super().__init__(message)
        self.reason = reason
        self.details = details


@dataclass
class SimulationResult:
    """Times and memory of one schedule.

    Attributes:
        orders: per-rank action indices in execution order.
        start, end: per action index, ms from the first start.
        makespan: last end − first start over all ranks, ms.
        stage_span: max over ranks of (rank's last end − rank's first start), ms.
        peak_memory: per rank, the most bytes held at any instant (static included).
        memory_timeline: per rank, ``(time ms, bytes)`` steps from time 0.
        fits: whether every rank stayed within its limit.
        ideal: max per-rank compute, ms.
        step_time: first start to the end of the last optimizer step, ms (module docstring).
    """

    orders: list[list[int]]
    start: list[float]
    end: list[float]
    makespan: float
    stage_span: float
    peak_memory: list[float]
    memory_timeline: list[list[tuple[float, float]]]
    fits: bool
    ideal: float
    step_time: float = math.nan

    def objective_value(self, objective: str) -> float:
        """``makespan``, ``stage_span`` or ``step_time`` in ms."""
        if objective == "step_time":
            return self.step_time
        return self.makespan if objective == "makespan" else self.stage_span

    def bubble_rate(self, objective: str) -> float:
        """(objective − ideal) / objective (contract, Terms)."""
        value = self.objective_value(objective)
        return (value - self.ideal) / value if value > 0 else 0.0


def _over_limit(
    inst: Instance, rank: int, idx: int, time_ms: float, current: float, limit: float, at: str = ""
) -> InvalidSchedule:
    """The ``memory_limit`` error: ``rank`` holds ``current`` bytes at ``time_ms`` from action ``idx``."""
    return InvalidSchedule(
        "memory_limit",
        f"rank {rank} holds {current:.0f} bytes at {time_ms:.3f} ms (from {at}{inst.actions[idx]}), over its "
        f"limit of {limit:.0f} bytes by {current - limit:.0f}",
        rank=rank,
        time_ms=time_ms,
        bytes=current,
        limit=limit,
        action=str(inst.actions[idx]),
    )


def check_placement(
    inst: Instance, rank: int, action: Action, idx: int | None, seen: set[int], *, unknown: str, twice: str = ""
) -> None:
    """The checks every per-rank order makes of one action: the problem has it (``idx`` is its index, or
    ``None``), its stage is on ``rank``, and it was not ``seen`` before; adds it to ``seen``.

    ``unknown`` ends the message for an action the problem does not have; ``twice`` qualifies a duplicate.

    Raises:
        InvalidSchedule: ``unknown_action``, ``wrong_rank`` or ``duplicate_action``, naming the action and rank.
    """
    if idx is None:
        raise InvalidSchedule(
            "unknown_action", f"rank {rank} runs {action}, which {unknown}", rank=rank, action=str(action)
        )
    if inst.rank[idx] != rank:
        raise InvalidSchedule(
            "wrong_rank",
            f"rank {rank} runs {action}, but stage {action.stage} is placed on rank {inst.rank[idx]}",
            rank=rank,
            action=str(action),
            expected_rank=inst.rank[idx],
        )
    if idx in seen:
        raise InvalidSchedule(
            "duplicate_action",
            f"{action} appears twice{twice} (rank {rank})",
            rank=rank,
            action=str(action),
        )
    seen.add(idx)


def indexed_orders(inst: Instance, orders: Orders) -> list[list[int]]:
    """Map per-rank :class:`Action` orders to indices, checking each rank runs exactly its actions.

    Raises:
        InvalidSchedule: ``malformed``, ``unknown_action``, ``wrong_rank``, ``duplicate_action`` or
            ``missing_action``, naming the action and rank.
    """
    if len(orders) != inst.num_ranks:
        raise InvalidSchedule(
            "malformed",
            f"the schedule has {len(orders)} ranks but the problem has {inst.num_ranks}",
            expected=inst.num_ranks,
            got=len(orders),
        )
    result: list[list[int]] = []
    seen: set[int] = set()
    for rank, row in enumerate(orders):
        ids = []
        for action in row:
            idx = inst.index.get(action)
            check_placement(
                inst,
                rank,
                action,
                idx,
                seen,
                unknown=(
                    f"this problem does not have (stages 0 … {len(inst.stage_ranks) - 1}, microbatches 0 … "
                    f"{inst.num_microbatches - 1}, kinds {'F, I, W' if inst.split_backward else 'F, B'})"
                ),
            )
            assert idx is not None
            ids.append(idx)
        result.append(ids)
    if len(seen) != len(inst.actions):
        missing = [inst.actions[i] for i in range(len(inst.actions)) if i not in seen]
        first = missing[0]
        raise InvalidSchedule(
            "missing_action",
            f"{len(missing)} action(s) missing, first {first} on rank {inst.rank[inst.index[first]]}",
            rank=inst.rank[inst.index[first]],
            action=str(first),
            count=len(missing),
        )
    return result


def simulate(inst: Instance, orders: Orders, *, check_memory: bool = True) -> SimulationResult:
    """Time and check per-rank :class:`Action` orders.

    Raises:
        InvalidSchedule: see the module docstring for the reasons.
    """
    return simulate_indexed(inst, indexed_orders(inst, orders), check_memory=check_memory)


def simulate_indexed(inst: Instance, orders: list[list[int]], *, check_memory: bool = True) -> SimulationResult:
    """Time per-rank orders of action indices (each rank's set already checked).

    Raises:
        InvalidSchedule: ``deadlock`` or (with ``check_memory``) ``memory_limit``.
    """
    if inst.has_step_actions:
        return _simulate_streams(inst, orders, check_memory=check_memory)
    start, end = _time_in_order(inst, orders)
    makespan = 0.0
    stage_span = 0.0
    first_start = min((start[row[0]] for row in orders if row), default=0.0)
    for row in orders:
        if row:
            makespan = max(makespan, end[row[-1]] - first_start)
            stage_span = max(stage_span, end[row[-1]] - start[row[0]])
    peaks, timelines, fits = _memory_in_order(inst, orders, start, end, check_memory)
    return SimulationResult(
        orders=orders,
        start=start,
        end=end,
        makespan=makespan,
        stage_span=stage_span,
        peak_memory=peaks,
        memory_timeline=timelines,
        fits=fits,
        ideal=inst.ideal,
        step_time=stage_span if inst.problem.training.post_validation else makespan,
    )


def _time_in_order(inst: Instance, orders: list[list[int]]) -> tuple[list[float], list[float]]:
    """Start and end (ms) of every action, one stream per rank: each action as soon as its rank is free and its
    predecessors (plus latency) ended. Ranks are revisited only when an action they wait on ends.

    Raises:
        InvalidSchedule: ``deadlock``.
    """
    n = len(inst.actions)
    start = [math.nan] * n
    end = [math.nan] * n
    preds = inst.preds
    duration = inst.duration
    num_ranks = len(orders)
    pos = [0] * num_ranks
    free = [0.0] * num_ranks
    done = 0
    worklist = list(range(num_ranks))
    queued = [True] * num_ranks
    while worklist:
        rank = worklist.pop()
        queued[rank] = False
        row = orders[rank]
        k = pos[rank]
        t_free = free[rank]
        while k < len(row):
            idx = row[k]
            ready = t_free
            for pred, latency in preds[idx]:
                t = end[pred]
                if t != t:  # NaN: not done yet
                    break
                t += latency
                if t > ready:
                    ready = t
            else:
                start[idx] = ready
                t_free = ready + duration[idx]
                end[idx] = t_free
                k += 1
                done += 1
                for succ, _ in inst.succs[idx]:
                    r = inst.rank[succ]
                    if r != rank and not queued[r]:
                        queued[r] = True
                        worklist.append(r)
                continue
            break
        pos[rank] = k
        free[rank] = t_free
    if done != n:
        raise _deadlock(inst, orders, pos, end)
    return start, end


def _memory_in_order(
    inst: Instance, orders: list[list[int]], start: list[float], end: list[float], check_memory: bool
) -> tuple[list[float], list[list[tuple[float, float]]], bool]:
    """Each rank's peak and ``(time, bytes)`` timeline, its actions' deltas in order (allocations at the start,
    frees at the end), and whether every rank fits its limit.

    Raises:
        InvalidSchedule: ``memory_limit`` at the first excess, with ``check_memory``.
    """
    peaks: list[float] = []
    timelines: list[list[tuple[float, float]]] = []
    fits = True
    for rank, row in enumerate(orders):
        current = inst.static[rank]
        peak = current
        timeline = [(0.0, current)]
        limit = inst.limit[rank]
        for idx in row:
            delta = inst.mem_delta[idx]
            current += delta
            timeline.append((start[idx] if delta > 0 else end[idx], current))
            if current > peak:
                peak = current
            if current > limit * (1 + 1e-12) + 1e-9:
                if fits and check_memory:
                    raise _over_limit(inst, rank, idx, start[idx], current, limit, "the start of ")
                fits = False
        peaks.append(peak)
        timelines.append(timeline)
    return peaks, timelines, fits


def _simulate_streams(inst: Instance, orders: list[list[int]], *, check_memory: bool) -> SimulationResult:
    """List scheduling with a compute and a communication stream per rank (module docstring)."""
    is_step = [False] * len(inst.actions)
    for idx in inst.optimizer_steps:
        is_step[idx] = True
    start, end, issue = _time_streams(inst, orders, is_step)
    if any(e != e for e in end):
        raise _stream_deadlock(inst, orders, end, issue)
    assert inst.problem.costs is not None
    slowdowns = (inst.problem.costs.overlap_slowdown, inst.problem.costs.communication_slowdown)
    if max(slowdowns) > 0:
        start, end = _slowed_beside_each_other(inst, orders, is_step, slowdowns, (start, end))
    first_start = min((min(start[i] for i in row) for row in orders if row), default=0.0)
    makespan = stage_span = step_time = 0.0
    for row in orders:
        body = [i for i in row if not is_step[i]]
        if body:
            row_start = min(start[i] for i in body)
            row_end = max(end[i] for i in body)
            makespan = max(makespan, row_end - first_start)
            stage_span = max(stage_span, row_end - row_start)
        if row:
            last = max(end[i] for i in row)
            own_start = min(start[i] for i in row)
            step_time = max(step_time, last - (own_start if not inst.sync_before_step else first_start))
    peaks, timelines, fits = _memory_by_time(inst, orders, start, end, check_memory)
    return SimulationResult(
        orders=orders,
        start=start,
        end=end,
        makespan=makespan,
        stage_span=stage_span,
        peak_memory=peaks,
        memory_timeline=timelines,
        fits=fits,
        ideal=inst.ideal,
        step_time=step_time,
    )


def _stream_lanes(inst: Instance, orders: list[list[int]]) -> tuple[list[list[list[int]]], list[int]]:
    """Each rank's order split into its compute and communication lanes, and for every communication action the
    compute action before it in the rank's order (it is issued when that one starts; −1: at once)."""
    queues: list[list[list[int]]] = []
    issue = [-1] * len(inst.actions)
    for row in orders:
        lanes: list[list[int]] = [[], []]
        previous = -1
        for idx in row:
            lanes[inst.stream[idx]].append(idx)
            if inst.stream[idx] == 1:
                issue[idx] = previous
            else:
                previous = idx
        queues.append(lanes)
    return queues, issue


def _time_streams(
    inst: Instance, orders: list[list[int]], is_step: list[bool], duration: list[float] | None = None
) -> tuple[list[float], list[float], list[int]]:
    """Start and end (ms) of every action on two lanes per rank (NaN where a deadlock left it), and the issue
    points of :func:`_stream_lanes`. An optimizer step waits for every other action when the step synchronises
    (``sync_before_step``); RESHARD takes no time and no lane. ``duration``: per action ms (default the
    instance's)."""
    n = len(inst.actions)
    start = [math.nan] * n
    end = [math.nan] * n
    preds = inst.preds
    duration = inst.duration if duration is None else duration
    num_ranks = len(orders)
    instant = [inst.actions[i].kind == ActionKind.RESHARD for i in range(n)]
    replica_wait = inst.replica_wait
    queues, issue = _stream_lanes(inst, orders)
    pos = [[0, 0] for _ in range(num_ranks)]
    free = [[0.0, 0.0] for _ in range(num_ranks)]
    pending = n - len(inst.optimizer_steps)
    barrier = 0.0
    # Per action, how many predecessors are known to have ended and their latest arrival (ms): an action with
    # many, as a REDUCE_GRAD waiting for every backward of its stage and its mirror's, is woken many times.
    scanned = [0] * n
    arrival = [-math.inf] * n
    worklist = [(r, k) for r in range(num_ranks) for k in (0, 1)]
    queued = {item: True for item in worklist}

    def wake(rank: int) -> None:
        for k in (0, 1):
            if not queued[(rank, k)]:
                queued[(rank, k)] = True
                worklist.append((rank, k))

    while worklist:
        rank, lane = worklist.pop()
        queued[(rank, lane)] = False
        queue = queues[rank][lane]
        k = pos[rank][lane]
        progressed = False
        while k < len(queue):
            idx = queue[k]
            ready = 0.0 if instant[idx] else free[rank][lane]
            if issue[idx] >= 0:
                t = start[issue[idx]]
                if t != t:
                    break
                ready = max(ready, t)
            if is_step[idx] and inst.sync_before_step:
                if pending > 0:
                    break
                ready = max(ready, barrier)
            if not _scan_predecessors(preds[idx], end, idx, scanned, arrival):
                break
            ready = max(ready, arrival[idx])
            start[idx] = ready + replica_wait.get(idx, 0.0)
            end[idx] = start[idx] + duration[idx]
            if not instant[idx]:
                free[rank][lane] = end[idx]
            k += 1
            progressed = True
            if not is_step[idx]:
                pending -= 1
                barrier = max(barrier, end[idx])
                if pending == 0:
                    for r in range(num_ranks):
                        wake(r)
            for succ, _ in inst.succs[idx]:
                if inst.rank[succ] != rank:
                    wake(inst.rank[succ])
        pos[rank][lane] = k
        if progressed:
            wake(rank)
    return start, end, issue


def _slowed_beside_each_other(
    inst: Instance,
    orders: list[list[int]],
    is_step: list[bool],
    slowdowns: tuple[float, float],
    timing: tuple[list[float], list[float]],
) -> tuple[list[float], list[float]]:
    """Start and end (ms) of every action with compute slowed beside its rank's collectives and collectives beside
    its rank's compute (``slowdowns``: ``overlap_slowdown``, ``communication_slowdown``): the module docstring's
    fixed point, from ``timing`` (the unslowed start and end). Unsettled after the last round, each action keeps the
    longer of its last two durations (never shorter than unslowed either way)."""
    start, end = timing
    duration = inst.duration
    for round_ in range(SLOWDOWN_ROUNDS):
        wanted = _slowed_durations(inst, orders, slowdowns, start, end)
        if all(abs(w - d) <= SLOWDOWN_TOLERANCE_MS for w, d in zip(wanted, duration, strict=True)):
            break
        if round_ == SLOWDOWN_ROUNDS - 1:
            wanted = [max(w, d) for w, d in zip(wanted, duration, strict=True)]
        duration = wanted
        start, end, _ = _time_streams(inst, orders, is_step, duration)
    return start, end


def _slowed_durations(
    inst: Instance, orders: list[list[int]], slowdowns: tuple[float, float], start: list[float], end: list[float]
) -> list[float]:
    """Per action, the wall-clock ms it takes from its ``start`` beside the other stream of its rank in this timing:
    a compute action beside the rank's collectives (``slowdowns[0]``), a collective beside the rank's compute
    (``slowdowns[1]``); instants keep their duration."""
    duration = list(inst.duration)
    for row in orders:
        # per lane, the other lane's busy intervals (and their ends) that slow it; none where its slowdown is 0
        beside = [
            sorted((start[i], end[i]) for i in row if inst.stream[i] == 1 - lane and end[i] > start[i])
            if slowdowns[lane] > 0
            else []
            for lane in (0, 1)
        ]
        ends = [[b for _, b in busy] for busy in beside]
        for idx in row:
            lane = inst.stream[idx]
            if beside[lane] and duration[idx] > 0:
                duration[idx] = _wall_time(start[idx], duration[idx], beside[lane], ends[lane], slowdowns[lane])
    return duration


def _wall_time(
    begin: float, work: float, busy: list[tuple[float, float]], busy_ends: list[float], slowdown: float
) -> float:
    """Wall-clock ms that ``work`` ms of one stream's action started at ``begin`` takes when it progresses at
    1/(1 + slowdown) speed inside the other stream's ``busy`` intervals (disjoint, sorted; ``busy_ends`` their ends)
    and at full speed outside."""
    t, left = begin, work
    for k in range(bisect_right(busy_ends, begin), len(busy)):
        low, high = busy[k]
        if low > t:
            if left <= low - t:
                break
            left -= low - t
            t = low
        inside = (high - t) / (1 + slowdown)
        if left <= inside:
            return t + left * (1 + slowdown) - begin
        left -= inside
        t = high
    return t + left - begin


def _scan_predecessors(
    preds: list[tuple[int, float]], end: list[float], idx: int, scanned: list[int], arrival: list[float]
) -> bool:
    """Whether every predecessor of ``idx`` has ended, resuming where the last scan stopped; ``arrival[idx]``
    keeps the latest end plus latency seen."""
    scan, arrived = scanned[idx], arrival[idx]
    while scan < len(preds):
        pred, latency = preds[scan]
        t = end[pred]
        if t != t:
            break
        arrived = max(arrived, t + latency)
        scan += 1
    scanned[idx], arrival[idx] = scan, arrived
    return scan == len(preds)


def _stream_deadlock(inst: Instance, orders: list[list[int]], end: list[float], issue: list[int]) -> InvalidSchedule:
    """The deadlock of a two-stream run: per rank, its first action that never ran and what it waits for."""
    waits = []
    for rank, row in enumerate(orders):
        waiting = [idx for idx in row if end[idx] != end[idx]]
        if not waiting:
            continue
        idx = waiting[0]
        missing = [pred for pred, _ in inst.preds[idx] if end[pred] != end[pred]]
        blocker = missing[0] if missing else (issue[idx] if issue[idx] >= 0 else waiting[-1])
        waits.append((rank, idx, blocker))
    return _deadlock_error(inst, waits)


def _deadlock_error(inst: Instance, waits: list[tuple[int, int, int]]) -> InvalidSchedule:
    """``deadlock`` naming, per stuck rank, the action it cannot run and the one it waits for: ``waits`` holds
    (rank, action index, blocking action index)."""
    details = [
        {
            "rank": rank,
            "action": str(inst.actions[idx]),
            "waits_for": str(inst.actions[blocker]),
            "on_rank": inst.rank[blocker],
        }
        for rank, idx, blocker in waits
    ]
    text = "; ".join(
        f"rank {w['rank']} cannot run {w['action']} before {w['waits_for']} (rank {w['on_rank']})" for w in details
    )
    return InvalidSchedule("deadlock", f"deadlock: {text}", waits=details)


def _memory_by_time(
    inst: Instance, orders: list[list[int]], start: list[float], end: list[float], check_memory: bool
) -> tuple[list[float], list[list[tuple[float, float]]], bool]:
    """Each rank's peak and timeline with its actions' deltas in time order (the lanes overlap): allocations
    at the start, frees at the end, a free before an allocation at the same instant.

    Raises:
        InvalidSchedule: ``memory_limit`` at the first excess, with ``check_memory``.
    """
    peaks: list[float] = []
    timelines: list[list[tuple[float, float]]] = []
    fits = True
    for rank, row in enumerate(orders):
        events = sorted(
            (
                (start[idx] if inst.mem_delta[idx] > 0 else end[idx], 1 if inst.mem_delta[idx] > 0 else 0, k, idx)
                for k, idx in enumerate(row)
                if inst.mem_delta[idx] != 0
            )
        )
        current = inst.static[rank]
        peak = current
        timeline = [(0.0, current)]
        limit = inst.limit[rank]
        for time, _, _, idx in events:
            current += inst.mem_delta[idx]
            timeline.append((time, current))
            peak = max(peak, current)
            if current > limit * (1 + 1e-12) + 1e-9:
                if fits and check_memory:
                    raise _over_limit(inst, rank, idx, time, current, limit)
                fits = False
        peaks.append(peak)
        timelines.append(timeline)
    return peaks, timelines, fits


def _deadlock(inst: Instance, orders: list[list[int]], pos: list[int], end: list[float]) -> InvalidSchedule:
    waits = []
    for rank, row in enumerate(orders):
        if pos[rank] >= len(row):
            continue
        idx = row[pos[rank]]
        missing = [pred for pred, _ in inst.preds[idx] if end[pred] != end[pred]]
        blocker = missing[0]
        waits.append((rank, idx, blocker))
    return _deadlock_error(inst, waits)


def action_orders(inst: Instance, orders: list[list[int]]) -> Orders:
    """Indices back to :class:`Action` orders."""
    return [[inst.actions[i] for i in row] for row in orders]
