"""Check a schedule written elsewhere: read it, time it with the simulator, or show its first violation.

Input (contract, ``pipesched check PROBLEM.json SCHEDULE``):

* PyTorch's compute-only CSV (one row per rank, one action per cell, the format
  ``_PipelineScheduleRuntime._load_csv(path, "compute_only")`` reads; blank cells ignored). The p2p actions
  pipesched does not time — ``SEND_F``, ``RECV_F``, ``SEND_B``, ``RECV_B`` — are skipped with a note (it adds
  the p2p latency itself); ``(a;b)OVERLAP_F_B`` cells are read as their two passes.
* JSON: a list of lists of action strings, one list per rank, or a schedule document with ``ranks``.

Every action the contract names is read: ``{s}UNSHARD``, ``{s}RESHARD``, ``{s}REDUCE_GRAD`` and
``OPTIMIZER_STEP`` too. A schedule that ends its rows with ``OPTIMIZER_STEP`` (pipesched's own, e.g. a solved
data-parallel schedule) is timed with its communication actions as written. PyTorch never writes
``OPTIMIZER_STEP`` and lowers its collectives its own way (several UNSHARDs of a stage per step): such rows'
UNSHARD/RESHARD/REDUCE_GRAD, and any communication action of a problem without data parallelism or optimizer
cost, are set aside with a note, and the problem's own are placed by the communication pass
(:mod:`pipesched.optimizer.communication`).

Each (stage, microbatch) pair's backward may be fused (B) or split (I + W) independently
(:func:`~pipesched.optimizer.instance.compile_for_orders`). The simulator
(:mod:`pipesched.optimizer.simulate`) is the judge: a valid schedule gets its objective, bubble rate
and peak memory per rank; an invalid one its first violation (``deadlock`` with who waits on what,
``missing_action``, ``duplicate_action``, ``unknown_action``, ``wrong_rank``, ``memory_limit``,
``malformed``) and a rank × step grid with the failing steps marked.

Errors: :class:`ScheduleInputError` for input that is not a schedule at all (a cell that is no action,
JSON of the wrong shape): the CLI exits 2, HTTP answers 422.
"""

from __future__ import annotations

import csv
import io
import json
import re
from dataclasses import dataclass, field
from typing import Any

from pipesched.optimizer.communication import with_communication
from pipesched.optimizer.instance import FrameError, compile_for_orders
from pipesched.optimizer.ir import ActionKind, Orders, parse_action, parse_orders
from pipesched.optimizer.problem import Problem
from pipesched.optimizer.simulate import InvalidSchedule, simulate

__all__ = [
    "CheckResult",
    "ScheduleInputError",
    "Violation",
    "check_schedule",
    "read_schedule",
    "render_grid",
]

SKIPPED_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
"""PyTorch's p2p action kinds; pipesched's check does not time them (the problem's ``costs.p2p`` does)."""

_SKIPPED_RE = re.compile(r"(0|[1-9][0-9]*)(" + "|".join(SKIPPED_KINDS) + r")([0-9]*)")
_OVERLAP_RE = re.compile(r"\((.*)\)OVERLAP_F_B")

GRID_WINDOW = 8
"""Steps shown either side of the first marked step in a rendered grid."""


class ScheduleInputError(ValueError):
    """The input is not a schedule (a cell that is no action, JSON of the wrong shape); the message says where."""


@dataclass
class Violation:
    """The first reason the problem cannot run the schedule.

    Attributes:
        reason: the simulator's code (module docstring).
        message: one sentence naming ranks and actions.
        details: the simulator's JSON-able details (``waits`` for a deadlock, ``bytes``/``limit`` for memory).
        marks: ``(rank, step)`` cells of the grid the violation is about (step = position in the rank's
            order; ``len(row)`` for an action missing from the end).
    """

    reason: str
    message: str
    details: dict[str, Any]
    marks: list[tuple[int, int]]


@dataclass
class CheckResult:
    """What :func:`check_schedule` found.

    Attributes:
        valid: whether the schedule runs within the problem (memory limit included).
        orders: the per-rank action strings that were checked.
        notes: what the reader skipped and why.
        objective: the problem's objective name; ``objective_value``, ``makespan``, ``stage_span`` in ms.
        bubble_rate: (objective − ideal) / objective.
        peak_memory: per rank, bytes (static included).
        violation: the first violation when not valid.
    """

    valid: bool
    orders: list[list[str]]
    notes: list[str] = field(default_factory=list)
    objective: str = "makespan"
    objective_value: float | None = None
    makespan: float | None = None
    stage_span: float | None = None
    bubble_rate: float | None = None
    peak_memory: list[float] | None = None
    violation: Violation | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON answer of ``POST /v1/schedules/check`` and ``pipesched check --json``."""
        answer: dict[str, Any] = {"valid": self.valid, "objective": self.objective, "notes": self.notes}
        if self.valid:
            answer |= {
                "objective_value": self.objective_value,
                "makespan": self.makespan,
                "stage_span": self.stage_span,
                "bubble_rate": self.bubble_rate,
                "peak_memory": self.peak_memory,
            }
        else:
            assert self.violation is not None
            answer["violation"] = {
                "reason": self.violation.reason,
                "message": self.violation.message,
                "details": self.violation.details,
                "marks": [list(mark) for mark in self.violation.marks],
                "grid": render_grid(self.orders, self.violation.marks),
            }
        answer["ranks"] = self.orders
        return answer


def _cells_from_text(text: str) -> list[list[str]]:
    stripped = text.lstrip()
    if stripped.startswith(("[", "{")):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ScheduleInputError(
                f"the schedule is not valid JSON: {error.msg} at line {error.lineno}, column {error.colno}"
            ) from None
        return _cells_from_json(data)
    try:
        return [[cell.strip() for cell in row] for row in csv.reader(io.StringIO(text))]
    except csv.Error as error:
        raise ScheduleInputError(f"the schedule is not CSV: {error}") from None


def _cells_from_json(data: Any) -> list[list[str]]:
    if isinstance(data, dict) and isinstance(data.get("ranks"), list):
        rows = []
        for position, rank in enumerate(data["ranks"]):
            actions = rank.get("actions") if isinstance(rank, dict) else None
            if not isinstance(actions, list):
                raise ScheduleInputError(f"ranks[{position}] has no list of actions")
            rows.append([a.get("action") if isinstance(a, dict) else a for a in actions])
        data = rows
    if not isinstance(data, list) or not all(isinstance(row, list) for row in data):
        raise ScheduleInputError(
            'a JSON schedule is a list with one list of action strings per rank, e.g. [["0F0", "0I0", "0W0"], …]'
        )
    for rank, row in enumerate(data):
        for step, cell in enumerate(row):
            if not isinstance(cell, str):
                raise ScheduleInputError(f"rank {rank}, step {step}: expected an action string, got {cell!r}")
    return data


def read_schedule(data: str | list[Any] | dict[str, Any]) -> tuple[Orders, list[str]]:
    """Per-rank actions from CSV or JSON text (or already-parsed JSON), and notes on what was skipped.

    Communication actions get their identity as :func:`~pipesched.optimizer.ir.parse_orders` gives it (a
    stage's n-th UNSHARD has occurrence n; OPTIMIZER_STEP the rank).

    Raises:
        ScheduleInputError: naming the rank and step of the first cell that is no action.
    """
    rows = _cells_from_text(data) if isinstance(data, str) else _cells_from_json(data)
    kept: list[list[str]] = []
    skipped: dict[str, int] = {}
    for rank, row in enumerate(rows):
        parsed: list[str] = []
        for step, cell in enumerate(row):
            if not cell:
                continue
            overlap = _OVERLAP_RE.fullmatch(cell)
            parts = [part.strip() for part in overlap.group(1).split(";")] if overlap else [cell]
            for part in parts:
                skip = _SKIPPED_RE.fullmatch(part)
                if skip is not None:
                    skipped[skip.group(2)] = skipped.get(skip.group(2), 0) + 1
                    continue
                try:
                    parse_action(part)
                except ValueError as error:
                    raise ScheduleInputError(f"rank {rank}, step {step}: {error}") from None
                parsed.append(part)
        kept.append(parsed)
    orders = parse_orders(kept)
    notes = []
    if skipped:
        counts = ", ".join(f"{count} {kind}" for kind, count in skipped.items())
        notes.append(
            f"skipped {sum(skipped.values())} action(s) pipesched does not time ({counts}): it adds the p2p "
            "latency between ranks itself"
        )
    return orders, notes


def _position(row: list[str], action: str, occurrence: int = 1) -> int:
    seen = 0
    for step, text in enumerate(row):
        if text == action:
            seen += 1
            if seen == occurrence:
                return step
    return len(row)


def _marks(error: InvalidSchedule, rows: list[list[str]]) -> list[tuple[int, int]]:
    details = error.details
    if error.reason == "deadlock":
        return [(w["rank"], _position(rows[w["rank"]], w["action"])) for w in details.get("waits", [])]
    if error.reason == "malformed" or "rank" not in details:
        return []
    rank, action = details["rank"], details.get("action", "")
    if error.reason == "duplicate_action":
        first_rank = next((r for r, row in enumerate(rows) if action in row), rank)
        if first_rank != rank:
            return [(first_rank, _position(rows[first_rank], action)), (rank, _position(rows[rank], action))]
        return [(rank, _position(rows[rank], action)), (rank, _position(rows[rank], action, 2))]
    if error.reason == "missing_action":
        return [(rank, len(rows[rank]))]
    return [(rank, _position(rows[rank], action))]


def _own_communication(problem: Problem, orders: Orders, notes: list[str]) -> Orders:
    """``orders`` with their communication actions as written when they are pipesched's (rows that hold
    OPTIMIZER_STEP, for a problem with step actions); else without them, noted (module docstring)."""
    written = [action for row in orders for action in row if not action.is_compute]
    if not written:
        return orders
    ours = any(action.kind == ActionKind.OPTIMIZER_STEP for action in written)
    if problem.has_step_actions and ours:
        return orders
    kinds = sorted({str(action.kind) for action in written})
    why = (
        "the problem has no data parallelism nor optimizer cost"
        if not problem.has_step_actions
        else "the rows hold no OPTIMIZER_STEP (PyTorch's lowering, not pipesched's): pipesched places the problem's own"
    )
    notes.append(f"set aside {len(written)} communication action(s) ({', '.join(kinds)}): {why}")
    return [[action for action in row if action.is_compute] for row in orders]


def check_schedule(problem: Problem, orders: Orders, notes: list[str] | None = None) -> CheckResult:
    """Time and check ``orders`` on ``problem`` with the simulator (module docstring).

    Returns:
        A :class:`CheckResult`: valid with objective (ms), bubble rate and peak memory per rank (bytes), or
        invalid with the first :class:`Violation`.
    """
    notes = list(notes or [])
    orders = _own_communication(problem, orders, notes)
    if problem.has_step_actions and all(action.is_compute for row in orders for action in row):
        orders = with_communication(compile_for_orders(problem, orders), orders)
        notes.append(
            "the problem's collectives and optimizer steps (data_parallel, costs.optimizer_step) are placed "
            "as pipesched's families place them (optimizer/communication.py)"
        )
    rows = [[str(action) for action in row] for row in orders]
    result = CheckResult(valid=False, orders=rows, notes=notes, objective=problem.objective)
    try:
        inst = compile_for_orders(problem, orders)
    except FrameError as error:
        result.violation = Violation("unframed_pass", str(error), {}, [])
        return result
    try:
        sim = simulate(inst, orders, check_memory=True)
    except InvalidSchedule as error:
        result.violation = Violation(error.reason, str(error), error.details, _marks(error, rows))
        return result
    value = sim.objective_value(problem.objective)
    result.valid = True
    result.objective_value = value
    result.makespan = sim.makespan
    result.stage_span = sim.stage_span
    result.bubble_rate = sim.bubble_rate(problem.objective)
    result.peak_memory = sim.peak_memory
    return result


def render_grid(rows: list[list[str]], marks: list[tuple[int, int]], window: int = GRID_WINDOW) -> str:
    """A rank × step text grid of ``rows`` with the ``marks`` cells bracketed (``>3F2<``; ``>??<`` past a row's
    end). Shows ``window`` steps either side of the marked steps; ``…`` where steps are left out."""
    if not rows:
        return ""
    longest = max(len(row) for row in rows) + (1 if any(step >= len(rows[r]) for r, step in marks) else 0)
    steps = [s for _, s in marks] or [0]
    first, last = max(0, min(steps) - window), min(longest, max(steps) + window + 1)
    marked = set(marks)
    width = max([len(cell) for row in rows for cell in row[first:last]] + [2]) + 3
    header = "rank │" + "".join(f"{step:>{width}}" for step in range(first, last))
    lines = [("… " if first > 0 else "") + header, "─" * len(header)]
    for rank, row in enumerate(rows):
        cells = []
        for step in range(first, last):
            text = row[step] if step < len(row) else ""
            if (rank, step) in marked:
                text = f">{text or '??'}<"
            cells.append(f"{text:>{width}}")
        lines.append(("  " if first > 0 else "") + f"{rank:>4} │" + "".join(cells) + (" …" if last < longest else ""))
    return "\n".join(lines)
