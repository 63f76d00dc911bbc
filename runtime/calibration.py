"""The per-action overhead of a run, fitted on a real run of a calibration order (``pipesched profile``'s last part).

What the profile times one piece at a time (passes, p2p, collectives, the optimizer step) does not hold what a rank
spends between them: the executor's bookkeeping, handing messages between processes that share cores, the
communication stream's thread. The profile therefore ends with a real run — the runtime's own training steps on the
same processes — of a *calibration order* that none of the families answers (every rank runs its forwards by chain
position, then its backwards in reverse: GPipe generalised to any placement; :func:`calibration_orders`), and fits
one overhead per action, ``o`` ms added to every pass, so that the simulator's step time of that order equals the
measured one (:func:`fit_overhead`, bisection: the step time grows with ``o``). Every schedule solved from the
profile is then a held-out prediction: its order was not the one fitted.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from pipesched.optimizer.communication import with_communication
from pipesched.optimizer.instance import compile_for_orders, compile_problem
from pipesched.optimizer.ir import Action, ActionKind, Orders, parse_action
from pipesched.optimizer.problem import Problem
from pipesched.optimizer.simulate import simulate
from pipesched.runtime.records import MeasuredAction

__all__ = [
    "CommunicationSlowdown",
    "OverlapSlowdown",
    "calibration_orders",
    "calibration_problem",
    "collective_overlaps",
    "fit_communication_slowdown",
    "fit_overhead",
    "fit_overlap_slowdown",
    "pass_overlaps",
    "with_overhead",
]

#: A pass counts as beside a collective from this much overlap (ms); below it, as alone when it has none at all.
OVERLAP_MIN_MS = 1.0
#: The largest slowdown the measurement reports (the problem field's bound).
MAX_SLOWDOWN = 10.0


def calibration_problem(skeleton: Problem, data_parallel: dict[str, object] | None) -> Problem:
    """``skeleton`` with the run's ``data_parallel`` and placeholder collective and optimizer-step costs, so that its
    orders hold the collectives and OPTIMIZER_STEP a profiled problem's schedules hold (the times do not matter)."""
    changes: dict[str, object] = {"costs.optimizer_step": 1.0}
    if data_parallel is not None:
        changes |= {"data_parallel": data_parallel, "costs.unshard": 1.0, "costs.reduce_grad": 1.0}
    return skeleton.with_changes(**changes)


def calibration_orders(problem: Problem) -> Orders:
    """Every rank's forwards by (chain position, microbatch), then its backwards by (reverse position, microbatch) —
    I then W, or B — and the problem's collectives placed by the communication pass. Valid for every placement: a
    pass at chain position k waits only on passes at position k − 1 (forward) or k + 1 (backward), which every
    rank runs first."""
    inst = compile_problem(problem, step_actions=False)
    position = {(stage, j): k for j, chain in enumerate(inst.chains) for k, stage in enumerate(chain)}
    backward = (
        [ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT] if problem.split_backward else [ActionKind.BACKWARD]
    )
    rows: Orders = []
    for rank in range(problem.pipeline.num_ranks):
        mine = [(k, j, stage) for (stage, j), k in position.items() if inst.stage_ranks[stage] == rank]
        row = [Action(stage, ActionKind.FORWARD, j) for k, j, stage in sorted(mine)]
        for _, j, stage in sorted(mine, key=lambda item: (-item[0], item[1])):
            row += [Action(stage, kind, j) for kind in backward]
        rows.append(row)
    return with_communication(compile_problem(problem), rows)


def with_overhead(problem: Problem, overhead_ms: float) -> Problem:
    """``problem`` with ``overhead_ms`` added to every pass's cost (F, I, W; never below 0)."""
    assert problem.costs is not None
    changes = {}
    for name in ("forward", "backward_input", "backward_weight"):
        values = problem.stage_values(getattr(problem.costs, name))
        changes[f"costs.{name}"] = [round(max(0.0, value + overhead_ms), 6) for value in values]
    return problem.with_changes(**changes)


def fit_overhead(problem: Problem, orders: Orders, measured_ms: float, *, iterations: int = 40) -> float:
    """The overhead ``o`` (ms per pass) for which the simulator's step time of ``orders`` on
    :func:`with_overhead`\\ ``(problem, o)`` equals ``measured_ms``; at most ``measured_ms``, at least minus half the
    smallest forward (a profile slower than the run)."""
    assert problem.costs is not None

    def step_time(overhead: float) -> float:
        shifted = with_overhead(problem, overhead)
        return simulate(compile_for_orders(shifted, orders), orders, check_memory=False).step_time

    low = -0.5 * min(problem.stage_values(problem.costs.forward))
    high = measured_ms
    if step_time(low) >= measured_ms:
        return low
    for _ in range(iterations):
        middle = (low + high) / 2
        if step_time(middle) < measured_ms:
            low = middle
        else:
            high = middle
    return round((low + high) / 2, 6)


@dataclass(frozen=True)
class OverlapSlowdown:
    """How much a collective on a process's communication stream slowed the passes beside it, measured on the
    calibration run (:func:`fit_overlap_slowdown`): ``passes`` passes overlapped collectives for ``overlapped_ms`` of
    wall time in all and took ``extra_ms`` longer than the same passes (stage and kind) alone, ``alone`` passes
    with no collective beside them; ``slowdown`` is the problem's ``costs.overlap_slowdown``."""

    passes: int
    alone: int
    overlapped_ms: float
    extra_ms: float
    slowdown: float


def fit_overlap_slowdown(steps: list[tuple[list[MeasuredAction], list[MeasuredAction]]]) -> OverlapSlowdown | None:
    """The slowdown s of the simulator's rule (compute at 1/(1 + s) speed while the rank's communication stream
    runs a collective: a pass overlapped for o ms takes o·s/(1 + s) ms more) from measured steps: per process and
    step, its passes and its collectives (each from its last dp peer's start, the span the simulator times).

    Each pass overlapped for at least :data:`OVERLAP_MIN_MS` is compared with the median of the same stage and kind
    with no overlap at all: r = Σ (wall − that median) / Σ overlap, per overlapped ms, and s = r / (1 − r), between 0
    and :data:`MAX_SLOWDOWN`. ``None`` when no pass overlapped a collective or none of those has a pass alone to be
    compared with. Times in ms."""
    alone: dict[tuple[int, str], list[float]] = {}
    beside: list[tuple[tuple[int, str], float, float]] = []
    for passes, collectives in steps:
        for measured, wall, overlap in pass_overlaps(passes, collectives):
            action = parse_action(measured.action)
            if action.kind not in _PASS_KINDS:
                continue
            key = (action.stage, action.kind.value)
            if overlap == 0:
                alone.setdefault(key, []).append(wall)
            elif overlap >= OVERLAP_MIN_MS:
                beside.append((key, wall, overlap))
    baseline = {key: statistics.median(walls) for key, walls in alone.items()}
    compared = [(wall - baseline[key], overlap) for key, wall, overlap in beside if key in baseline]
    if not compared:
        return None
    extra = sum(e for e, _ in compared)
    overlapped = sum(o for _, o in compared)
    ratio = _lost_share(extra, overlapped)
    return OverlapSlowdown(
        passes=len(compared),
        alone=sum(len(walls) for walls in alone.values()),
        overlapped_ms=round(overlapped, 6),
        extra_ms=round(extra, 6),
        slowdown=round(ratio / (1 - ratio), 6),
    )


def pass_overlaps(
    passes: list[MeasuredAction], collectives: list[MeasuredAction]
) -> list[tuple[MeasuredAction, float, float]]:
    """Per measured action of one process's step: (the action, its wall time, how long the process's UNSHARD and
    REDUCE_GRAD of that step ran beside it), ms."""
    return _beside(passes, collectives, _COLLECTIVES)


@dataclass(frozen=True)
class CommunicationSlowdown:
    """How much the passes beside a collective slowed it, measured on the calibration run
    (:func:`fit_communication_slowdown`): ``collectives`` collectives ran beside their process's passes for
    ``overlapped_ms`` of wall time in all and took ``extra_ms`` longer than the same collectives alone would have
    (``lone`` collectives with no pass beside them gave that baseline); ``ratio`` r = extra / overlapped, the share
    of each overlapped ms the collective lost, and ``slowdown`` c = r / (1 − r), the problem's
    ``costs.communication_slowdown``. ``seen`` / ``work``: per ``"unshard"`` / ``"reduce_grad"``, each model stage's
    cost as the calibration run saw it (beside whatever passes it ran) and its time alone (the overlapped part at
    full speed: what ``costs.unshard`` / ``costs.reduce_grad`` hold when the problem carries ``c``), ms."""

    collectives: int
    lone: int
    overlapped_ms: float
    extra_ms: float
    ratio: float
    slowdown: float
    seen: dict[str, list[float]] = field(default_factory=dict)
    work: dict[str, list[float]] = field(default_factory=dict)


def fit_communication_slowdown(
    steps: list[tuple[list[MeasuredAction], list[MeasuredAction]]], alone: dict[tuple[str, int], float]
) -> CommunicationSlowdown | None:
    """The slowdown c of the simulator's rule (a collective at 1/(1 + c) speed while a pass of its rank runs: one
    overlapped for o ms takes o·c/(1 + c) ms more) from measured steps: per process and step, its passes and its
    collectives (each from its last dp peer's start, the span the simulator times). ``alone``: per (``"UNSHARD"`` |
    ``"REDUCE_GRAD"``, stage id), the collective timed with no pass running (the profile's own timing), ms — the
    size scale between stages.

    A collective with less than :data:`OVERLAP_MIN_MS` of passes beside it is lone: its span over its ``alone`` time
    is its kind's lone factor (the median over the lone ones; both kinds pooled for a kind with none). Each
    collective overlapped for at least :data:`OVERLAP_MIN_MS` is compared with its ``alone`` time × that factor:
    r = Σ (span − baseline) / Σ overlap, and c = r / (1 − r), between 0 and :data:`MAX_SLOWDOWN`. ``None`` when no
    collective overlapped a pass or there is no lone one to scale from. The ``seen`` / ``work`` costs are left
    empty (:mod:`pipesched.runtime.profile` reads them per stage). Times in ms."""
    lone: dict[str, list[float]] = {}
    beside: list[tuple[tuple[str, int], float, float]] = []
    for passes, collectives in steps:
        for measured, span, overlap in collective_overlaps(passes, collectives):
            action = parse_action(measured.action)
            key = (action.kind.value, action.stage)
            if key not in alone or alone[key] <= 0:
                continue
            if overlap < OVERLAP_MIN_MS:
                lone.setdefault(key[0], []).append(span / alone[key])
            else:
                beside.append((key, span, overlap))
    pooled = [factor for factors in lone.values() for factor in factors]
    if not beside or not pooled:
        return None
    factor = {kind: statistics.median(lone.get(kind) or pooled) for kind in ("UNSHARD", "REDUCE_GRAD")}
    extra = sum(span - factor[key[0]] * alone[key] for key, span, _ in beside)
    overlapped = sum(overlap for _, _, overlap in beside)
    ratio = _lost_share(extra, overlapped)
    return CommunicationSlowdown(
        collectives=len(beside),
        lone=len(pooled),
        overlapped_ms=round(overlapped, 6),
        extra_ms=round(extra, 6),
        ratio=round(ratio, 6),
        slowdown=round(ratio / (1 - ratio), 6),
    )


def collective_overlaps(
    passes: list[MeasuredAction], collectives: list[MeasuredAction]
) -> list[tuple[MeasuredAction, float, float]]:
    """Per UNSHARD / REDUCE_GRAD of one process's step: (the action, its span, how long the process's passes of that
    step ran beside it), ms."""
    return _beside([c for c in collectives if parse_action(c.action).kind in _COLLECTIVES], passes, _PASS_KINDS)


def _beside(
    actions: list[MeasuredAction], others: list[MeasuredAction], kinds: frozenset[ActionKind]
) -> list[tuple[MeasuredAction, float, float]]:
    """Per action: (it, its span, how long the ``others`` of ``kinds`` ran beside it), ms."""
    busy = [(o.start, o.end) for o in others if o.end > o.start and parse_action(o.action).kind in kinds]
    return [
        (
            measured,
            measured.end - measured.start,
            sum(max(0.0, min(measured.end, b) - max(measured.start, a)) for a, b in busy),
        )
        for measured in actions
    ]


def _lost_share(extra: float, overlapped: float) -> float:
    """r = extra / overlapped, the share of each overlapped ms lost, between 0 and the one of :data:`MAX_SLOWDOWN`."""
    return min(max(extra / overlapped, 0.0), MAX_SLOWDOWN / (1 + MAX_SLOWDOWN))


_COLLECTIVES = frozenset({ActionKind.UNSHARD, ActionKind.REDUCE_GRAD})
_PASS_KINDS = frozenset(
    {ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT, ActionKind.BACKWARD}
)
