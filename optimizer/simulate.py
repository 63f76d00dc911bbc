"""Simulator and validator: time any per-rank order by list scheduling and check it.

Every action starts as soon as its rank is free and all its inputs have arrived (predecessor end +
p2p latency between different ranks, none within a rank). Memory on a rank changes only through the
rank's own actions, which never overlap, so a rank's memory is piecewise constant: F's allocation is
counted from its start, I/W/B's frees from their end.

Rejections raise :class:`InvalidSchedule` with a machine-readable ``reason``:
``malformed`` (wrong number of ranks), ``unknown_action``, ``wrong_rank``, ``missing_action``,
``duplicate_action``, ``deadlock`` (with who waits on what) and ``memory_limit`` (rank, time, bytes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pipesched.optimizer.instance import Instance
from pipesched.optimizer.ir import Orders

__all__ = [
    "InvalidSchedule",
    "SimulationResult",
    "action_orders",
    "indexed_orders",
    "simulate",
    "simulate_indexed",
]


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

    def objective_value(self, objective: str) -> float:
        """``makespan`` or ``stage_span`` in ms."""
        return self.makespan if objective == "makespan" else self.stage_span

    def bubble_rate(self, objective: str) -> float:
        """(objective − ideal) / objective (contract, Terms)."""
        value = self.objective_value(objective)
        return (value - self.ideal) / value if value > 0 else 0.0


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
    seen: dict[int, int] = {}
    for rank, row in enumerate(orders):
        ids = []
        for action in row:
            idx = inst.index.get(action)
            if idx is None:
                raise InvalidSchedule(
                    "unknown_action",
                    f"rank {rank} runs {action}, which this problem does not have "
                    f"(stages 0 … {len(inst.stage_ranks) - 1}, microbatches 0 … {inst.num_microbatches - 1}, "
                    f"kinds {'F, I, W' if inst.split_backward else 'F, B'})",
                    rank=rank,
                    action=str(action),
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
                    f"{action} appears twice (rank {rank})",
                    rank=rank,
                    action=str(action),
                )
            seen[idx] = rank
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

    makespan = 0.0
    stage_span = 0.0
    first_start = min((start[row[0]] for row in orders if row), default=0.0)
    for row in orders:
        if row:
            makespan = max(makespan, end[row[-1]] - first_start)
            stage_span = max(stage_span, end[row[-1]] - start[row[0]])

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
                    raise InvalidSchedule(
                        "memory_limit",
                        f"rank {rank} holds {current:.0f} bytes at {start[idx]:.3f} ms (from the start of "
                        f"{inst.actions[idx]}), over its limit of {limit:.0f} bytes by {current - limit:.0f}",
                        rank=rank,
                        time_ms=start[idx],
                        bytes=current,
                        limit=limit,
                        action=str(inst.actions[idx]),
                    )
                fits = False
        peaks.append(peak)
        timelines.append(timeline)
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
    )


def _deadlock(inst: Instance, orders: list[list[int]], pos: list[int], end: list[float]) -> InvalidSchedule:
    waits = []
    for rank, row in enumerate(orders):
        if pos[rank] >= len(row):
            continue
        idx = row[pos[rank]]
        missing = [pred for pred, _ in inst.preds[idx] if end[pred] != end[pred]]
        blocker = missing[0]
        waits.append(
            {
                "rank": rank,
                "action": str(inst.actions[idx]),
                "waits_for": str(inst.actions[blocker]),
                "on_rank": inst.rank[blocker],
            }
        )
    text = "; ".join(
        f"rank {w['rank']} cannot run {w['action']} before {w['waits_for']} (rank {w['on_rank']})" for w in waits
    )
    return InvalidSchedule("deadlock", f"deadlock: {text}", waits=waits)


def action_orders(inst: Instance, orders: list[list[int]]) -> Orders:
    """Indices back to :class:`Action` orders."""
    return [[inst.actions[i] for i in row] for row in orders]
