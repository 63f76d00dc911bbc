"""The run report (contract, Run report): what the ranks measured against the schedule and the reference.

:class:`RunReport` is the JSON of ``pipesched run -o REPORT.json``: the contract's keys (``verified``, gradient,
parameter and loss errors, ``steps``, ``executed_order_matches``, ``ranks`` with measured actions and peak memory,
predicted and measured makespan and step time, ``backend``, ``device``) and diagnostics. :func:`build_report`
makes it from the ranks' :class:`~pipesched.runtime.records.RankResult` and the single-process
:class:`~pipesched.runtime.verify.Reference`; :func:`print_report` and :func:`print_training_summary` show it.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict
from typing import Any

import torch
from pydantic import BaseModel
from rich.console import Console
from rich.table import Table

from pipesched.optimizer.instance import compile_for_orders
from pipesched.optimizer.ir import COMMUNICATION_KINDS, compute_only, parse_action
from pipesched.optimizer.problem import Problem, weight_version_memory
from pipesched.optimizer.result import Schedule, peak_activation_bytes
from pipesched.optimizer.simulate import indexed_orders, simulate_indexed
from pipesched.optimizer.units import common_unit
from pipesched.runtime.options import TrainingOptions
from pipesched.runtime.records import MeasuredAction, RankResult, StepCheck, joined_steps, occurrence_keys
from pipesched.runtime.verify import TOLERANCE, Comparison, Reference, compare, measured_costs
from pipesched.runtime.verify import simulate_with_measured_costs as simulate_measured

__all__ = [
    "CollectiveSpan",
    "RankReport",
    "RunReport",
    "build_report",
    "communication_overlap",
    "predicted_static_bytes",
    "print_report",
    "print_training_summary",
    "same_step_overlap",
    "steady_steps",
]


def predicted_static_bytes(problem: Problem, pp: int) -> float:
    """Pipeline rank ``pp``'s static bytes as the run report predicts them: ``memory.static`` plus the extra weight
    versions (:func:`~pipesched.optimizer.problem.weight_version_memory`)."""
    return problem.static_memory[pp] + weight_version_memory(problem)[pp]


class CollectiveSpan(BaseModel):
    """One communication action of a rank's step, predicted beside measured (ms from the step's start).

    ``predicted_…``: the schedule's timeline (``None`` where the schedule has no such action: one the runtime added,
    as a REDUCE_GRAD after the step); ``…_hidden_ms``: the part of the span while one of the rank's passes ran.
    ``measured_…``: medians over the steps after the first, the span from the last dp peer's start to the end
    (:func:`~pipesched.runtime.records.joined_communication`); ``replica_wait_ms``: the median wait before it for a
    slower replica."""

    action: str
    predicted_start: float | None
    predicted_end: float | None
    predicted_hidden_ms: float | None
    measured_start: float
    measured_end: float
    measured_hidden_ms: float
    replica_wait_ms: float


class RankReport(BaseModel):
    """One process of the run: measured against predicted (the schedule of its pipeline rank).

    ``communication_hidden_ms`` / ``communication_exposed_ms``, per step: the time the rank's communication (the
    union of its actions' intervals, each collective from the instant its last dp peer entered it to its end, as the
    simulator times it: :func:`~pipesched.runtime.records.joined_communication`) ran while one of its passes ran,
    and the rest (the passes waited, or nothing ran); ``predicted_…``: the same of the schedule's timeline
    (:func:`communication_overlap`). ``communication_replica_wait_ms``, per step: the time the rank's communication
    stream held a collective before its last peer entered it (the wait for a slower replica: in the step time,
    in neither split). ``run_delay_ms``, per step (the own executor, where Linux reports it): the time the rank's
    passes were ready to run but waited for their core (:attr:`MeasuredAction.run_delay_ms`): what other processes
    took of the step. ``compute_ms``, per step: the time the rank's passes of that step ran (the sum of their
    spans); its step time less it is what the schedule leaves idle or spends between passes. ``update_ms`` /
    ``update_wait_ms``, per step: the update's own work (the squared norm's partial sum, the rule's copies,
    ``optimizer.step()``; what ``costs.optimizer_step`` stands for) and its wait for the global check's all-reduce
    (for the other ranks to reach it: the simulator's timeline, not a cost). ``static_bytes_…``:
    weights, gradients, optimizer state, second weight versions and rollback copies, against the problem's
    ``memory.static``. ``predicted_peak_activation_bytes``: the most bytes the rank's passes hold at once on the
    schedule's timeline (:func:`~pipesched.optimizer.result.peak_activation_bytes`; without the gathered weights and
    static memory), the figure ``peak_memory_bytes`` measures where ``memory_measure`` is ``saved-activations``
    (CPU). ``collectives``: each communication action of the step, predicted beside measured
    (:class:`CollectiveSpan`). ``update_parts_ms``, per step: where ``update_ms`` went
    (:attr:`~pipesched.runtime.records.StepRecord.update_parts_ms`).

    ``same_step_predicted_hidden_ms`` / ``same_step_predicted_exposed_ms``, per step (a schedule with communication
    actions run step by step): the prediction of that step's split given the passes as the step ran them — the
    simulator re-run on the schedule's order with every F, I, W, B of the rank's data-parallel replica at its measured
    duration in that step and the problem's collective costs (:func:`same_step_overlap`): the model of overlap judged
    apart from the passes' speed, beside ``predicted_communication_hidden_ms`` (the profile's passes, one figure).
    ``…_measured_collectives``: the same with each collective also at its measured span in that step (from its last dp
    peer's start): the placement judged apart from the collectives' speed too.
    """

    rank: int
    pp_rank: int
    dp_rank: int
    peak_memory_bytes: int
    static_bytes_measured: int
    predicted_peak_memory_bytes: float | None
    predicted_peak_activation_bytes: float | None
    static_bytes_predicted: float
    memory_measure: str
    measured_communication_ms: float
    predicted_communication_ms: float | None
    communication_hidden_ms: list[float]
    communication_exposed_ms: list[float]
    communication_replica_wait_ms: list[float] = []
    run_delay_ms: list[float] = []
    compute_ms: list[float] = []
    update_ms: list[float] = []
    update_wait_ms: list[float] = []
    update_parts_ms: list[dict[str, float]] = []
    same_step_predicted_hidden_ms: list[float] = []
    same_step_predicted_exposed_ms: list[float] = []
    same_step_predicted_hidden_ms_measured_collectives: list[float] = []
    same_step_predicted_exposed_ms_measured_collectives: list[float] = []
    predicted_communication_hidden_ms: float | None
    predicted_communication_exposed_ms: float | None
    communication: list[MeasuredAction]
    collectives: list[CollectiveSpan] = []
    step_times_ms: list[float]
    steps: list[StepCheck]
    actions: list[MeasuredAction]


class OrderMismatch(BaseModel):
    """A process whose executed compute actions differ from its schedule's, from ``position`` on."""

    rank: int
    pp_rank: int
    position: int


class DataParallelReport(BaseModel):
    size: int
    sharding: str
    world_size: int


class RunReport(BaseModel):
    """The run report (module docstring). ``training`` is ``None`` for one verified step without an optimizer."""

    verified: bool
    steps: int
    max_abs_grad_error: float
    max_rel_grad_error: float
    worst_parameter: str | None
    max_abs_param_error: float
    max_rel_param_error: float
    max_rel_param_error_vs_synchronous: float | None
    worst_parameter_after_steps: str | None
    missing_gradients: list[str]
    tolerance: float
    loss: float | None
    reference_loss: float
    losses: list[float | None]
    reference_losses: list[float]
    loss_rel_error: float | None
    missing_losses: list[int]
    rolled_back_steps: list[int]
    reference_skipped_steps: list[int]
    executed_order_matches: bool
    order_mismatches: list[OrderMismatch]
    ranks: list[RankReport]
    predicted_makespan_ms: float | None
    measured_makespan_ms: float
    simulated_makespan_from_measured_costs_ms: float | None
    measured_costs_ms: dict[str, list[float]]
    predicted_step_time_ms: float | None
    predicted_step_time_from: str
    measured_step_time_ms: float
    measured_step_times_ms: list[float]
    training: dict[str, Any] | None
    data_parallel: DataParallelReport
    weight_versions: int
    method: str
    model: str
    engine: str
    backend: str
    device: str
    torch_version: str


def _predicted_step_time(schedule: Schedule) -> tuple[float | None, str]:
    """``schedule.step_period`` (``shape`` ``"pattern"``), else ``step_time``, else the makespan (ms), and which one."""
    for name in ("step_period", "step_time") if schedule.shape == "pattern" else ("step_time",):
        value = getattr(schedule, name, None)
        if value is not None:
            return float(value), name
    return schedule.makespan, "makespan"


def _replica_errors(results: list[RankResult], reference: Reference, model_stage: list[int], kind: str) -> Comparison:
    """The worst error of gradients (``kind`` ``"gradients"``) or parameters over the data-parallel replicas."""
    found = [
        compare(
            {k: v for r in results if r.dp_rank == replica for k, v in getattr(r, kind).items()}, expected, model_stage
        )
        for replica in sorted({r.dp_rank for r in results})
        for expected in [getattr(reference, kind)]
    ]
    worst = max(found, key=lambda c: c.max_rel)
    return Comparison(
        max(c.max_abs for c in found),
        worst.max_rel,
        worst.worst,
        tuple(sorted({key for c in found for key in c.missing})),
        tuple(sorted({key for c in found for key in c.unexpected})),
    )


def _step_losses(results: list[RankResult], steps: int, num_microbatches: int, size: int) -> list[float | None]:
    """Mean loss of every step over the global batch (``None`` when a microbatch's loss is missing)."""
    losses: list[float | None] = []
    for step in range(steps):
        seen = {r.dp_rank * num_microbatches + j: v for r in results for j, v in r.steps[step].losses.items()}
        losses.append(sum(seen.values()) / (size * num_microbatches) if len(seen) == size * num_microbatches else None)
    return losses


def _order_mismatches(schedule: Schedule, results: list[RankResult]) -> list[OrderMismatch]:
    expected = [[str(a) for a in row] for row in compute_only(schedule.orders())]
    mismatches = []
    for result in results:
        executed = result.executed
        want = expected[result.pp_rank]
        if executed != want:
            position = next(
                (k for k, (a, b) in enumerate(zip(executed, want, strict=False)) if a != b),
                min(len(executed), len(want)),
            )
            mismatches.append(OrderMismatch(rank=result.rank, pp_rank=result.pp_rank, position=position))
    return mismatches


#: The communication action kinds (UNSHARD, RESHARD, REDUCE_GRAD, …) as a schedule's actions name them.
_COMMUNICATION = frozenset(kind.value for kind in COMMUNICATION_KINDS)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def communication_overlap(
    compute: list[tuple[float, float]], communication: list[tuple[float, float]]
) -> tuple[float, float]:
    """``(hidden, exposed)`` ms of one rank's step: the length of the union of its communication intervals that
    lies inside the union of its compute intervals (the passes ran meanwhile), and the rest."""
    busy = _union(communication)
    passes = _union(compute)
    hidden = sum(max(0.0, min(end, c_end) - max(start, c_start)) for start, end in busy for c_start, c_end in passes)
    total = sum(end - start for start, end in busy)
    return round(hidden, 6), round(total - hidden, 6)


def collective_spans(
    schedule: Schedule, result: RankResult, joined: list[list[MeasuredAction]]
) -> list[CollectiveSpan]:
    """Per communication action of the rank's step, predicted beside measured (:class:`CollectiveSpan`);
    ``joined``: per step, the rank's communication from each collective's last dp peer's start."""
    actions = schedule.ranks[result.pp_rank].actions
    passes = [(a.start, a.end) for a in actions if a.kind in "FIWB"]
    planned = [a for a in actions if a.kind in _COMMUNICATION]
    predicted = dict(zip(occurrence_keys([str(a.action) for a in planned]), planned, strict=True))
    steps = range(1, len(result.steps)) if len(result.steps) > 1 else range(len(result.steps))
    samples: dict[tuple[str, int], list[tuple[float, float, float, float]]] = {}
    for k in steps:
        compute = [(a.start, a.end) for a in result.steps[k].actions]
        raw = result.steps[k].communication
        for key, span, own in zip(occurrence_keys([c.action for c in joined[k]]), joined[k], raw, strict=True):
            hidden, _ = communication_overlap(compute, [(span.start, span.end)])
            samples.setdefault(key, []).append((span.start, span.end, hidden, span.start - own.start))
    spans = []
    for key, values in samples.items():
        start, end, hidden, wait = (round(statistics.median(v[i] for v in values), 6) for i in range(4))
        plan = predicted.get(key)
        predicted_hidden = None if plan is None else communication_overlap(passes, [(plan.start, plan.end)])[0]
        spans.append(
            CollectiveSpan(
                action=key[0],
                predicted_start=None if plan is None else plan.start,
                predicted_end=None if plan is None else plan.end,
                predicted_hidden_ms=predicted_hidden,
                measured_start=start,
                measured_end=end,
                measured_hidden_ms=hidden,
                replica_wait_ms=wait,
            )
        )
    return spans


def _predicted_overlap(schedule: Schedule, pp: int) -> tuple[float | None, float | None]:
    actions = schedule.ranks[pp].actions
    communication = [(a.start, a.end) for a in actions if a.kind in _COMMUNICATION]
    if not communication:
        return None, None
    return communication_overlap([(a.start, a.end) for a in actions if a.kind in "FIWB"], communication)


def same_step_overlap(
    schedule: Schedule, passes: list[list[MeasuredAction]], collectives: list[list[MeasuredAction]] | None = None
) -> list[tuple[float, float]]:
    """Per pipeline rank, ``(hidden, exposed)`` ms of the schedule's order simulated with its passes as one step of
    one data-parallel replica ran them: ``passes[pp]``, pipeline rank ``pp``'s compute actions of that step (each F,
    I, W, B at its measured duration; an action not measured keeps the problem's cost); the collectives at the
    problem's costs, or, with ``collectives[pp]``, at their measured spans. ``costs.overlap_slowdown`` is left out: a
    measured pass already ran at whatever speed the collectives beside it left it; so is
    ``costs.communication_slowdown`` for collectives at their measured spans (the problem's collective costs are
    slowed beside the passes as the schedule's are). The split is
    :func:`communication_overlap` of the simulated timeline, as the schedule's own prediction is of its timeline."""
    return _SameStep(schedule).overlap(passes, collectives)


class _SameStep:
    """A schedule's order compiled once (``costs.overlap_slowdown`` left out; a second time without
    ``costs.communication_slowdown``, for collectives at their measured spans, where the problem has it), re-timed
    per step by :meth:`overlap` from a copy of its durations (:func:`same_step_overlap`)."""

    def __init__(self, schedule: Schedule) -> None:
        problem = schedule.problem
        assert problem.costs is not None
        if problem.costs.overlap_slowdown:
            problem = problem.with_changes(**{"costs.overlap_slowdown": 0.0})
        orders = schedule.orders()
        self.inst = compile_for_orders(problem, orders)
        self.measured_inst = self.inst
        if problem.costs is not None and problem.costs.communication_slowdown:
            self.measured_inst = compile_for_orders(
                problem.with_changes(**{"costs.communication_slowdown": 0.0}), orders
            )
        self.indexed = indexed_orders(self.inst, orders)
        self.durations = list(self.inst.duration)

    def overlap(
        self, passes: list[list[MeasuredAction]], collectives: list[list[MeasuredAction]] | None = None
    ) -> list[tuple[float, float]]:
        inst = self.inst if collectives is None else self.measured_inst
        duration = list(self.durations)
        for row in [*passes, *(collectives or [])]:
            for record in row:
                idx = inst.index.get(parse_action(record.action))
                if idx is not None:  # a REDUCE_GRAD the runtime added after the schedule's actions has none
                    duration[idx] = record.duration_ms
        inst.duration = duration
        timed = simulate_indexed(inst, self.indexed, check_memory=False)
        found = []
        for row in self.indexed:
            kinds = [(inst.actions[i].kind.value, (timed.start[i], timed.end[i])) for i in row]
            found.append(
                communication_overlap(
                    [span for kind, span in kinds if kind in "FIWB"],
                    [span for kind, span in kinds if kind in _COMMUNICATION],
                )
            )
        return found


def _same_step_predictions(
    schedule: Schedule, results: list[RankResult], joined: dict[int, list[list[MeasuredAction]]]
) -> dict[int, dict[str, list[float]]]:
    """Per process (global rank), per step, :func:`same_step_overlap` of its replica's passes: the
    ``same_step_predicted_…`` fields of :class:`RankReport`; empty when the schedule has no communication action."""
    if not any(a.kind in _COMMUNICATION for rank in schedule.ranks for a in rank.actions):
        return {}
    timer = _SameStep(schedule)
    found: dict[int, dict[str, list[float]]] = {r.rank: {} for r in results}
    for replica in sorted({r.dp_rank for r in results}):
        group = sorted((r for r in results if r.dp_rank == replica), key=lambda r: r.pp_rank)
        if [r.pp_rank for r in group] != list(range(len(schedule.ranks))):
            return {}
        for k in range(min(len(r.steps) for r in group)):
            passes = [r.steps[k].actions for r in group]
            for suffix, collectives in (("", None), ("_measured_collectives", [joined[r.rank][k] for r in group])):
                for r, (hidden, exposed) in zip(group, timer.overlap(passes, collectives), strict=True):
                    found[r.rank].setdefault(f"same_step_predicted_hidden_ms{suffix}", []).append(hidden)
                    found[r.rank].setdefault(f"same_step_predicted_exposed_ms{suffix}", []).append(exposed)
    return found


def _joined(results: list[RankResult]) -> dict[int, list[list[MeasuredAction]]]:
    """Per process (its global rank), per step, its communication with each collective from its last dp peer's
    start (:func:`~pipesched.runtime.records.joined_communication`), each data-parallel group joined once."""
    joined: dict[int, list[list[MeasuredAction]]] = {}
    for pp_rank in {r.pp_rank for r in results}:
        group = sorted((r for r in results if r.pp_rank == pp_rank), key=lambda r: r.dp_rank)
        rows = joined_steps([[step.communication for step in r.steps] for r in group])
        joined.update((r.rank, steps) for r, steps in zip(group, rows, strict=True))
    return joined


def _rank_report(
    schedule: Schedule,
    result: RankResult,
    joined: list[list[MeasuredAction]],
    activations: list[float],
    same_step: dict[str, list[float]] | None = None,
) -> RankReport:
    """One process's report; ``joined``: its communication per step as :func:`_joined` gives it; ``activations``:
    the schedule's :func:`~pipesched.optimizer.result.peak_activation_bytes`; ``same_step``: its
    ``same_step_predicted_…`` fields (:func:`_same_step_predictions`)."""
    pp = result.pp_rank
    communication_per_step = [sum(c.duration_ms for c in step) for step in joined]
    predicted_communication = [a.end - a.start for a in schedule.ranks[pp].actions if a.kind in _COMMUNICATION]
    overlap = [
        communication_overlap([(a.start, a.end) for a in step.actions], [(c.start, c.end) for c in communication])
        for step, communication in zip(result.steps, joined, strict=True)
    ]
    replica_wait = [
        round(sum(c.duration_ms for c in step.communication) - sum(c.duration_ms for c in communication), 6)
        for step, communication in zip(result.steps, joined, strict=True)
    ]
    predicted_hidden, predicted_exposed = _predicted_overlap(schedule, pp)
    static = predicted_static_bytes(schedule.problem, pp)
    peak = schedule.peak_memory[pp] if schedule.peak_memory else None
    return RankReport(
        rank=result.rank,
        pp_rank=pp,
        dp_rank=result.dp_rank,
        peak_memory_bytes=result.peak_memory_bytes,
        static_bytes_measured=result.static_memory_bytes,
        predicted_peak_memory_bytes=peak,
        # Saved activations exclude weights (static and gathered): they compare with the passes' activations alone.
        predicted_peak_activation_bytes=activations[pp] if activations else None,
        static_bytes_predicted=static,
        memory_measure=result.memory_measure,
        measured_communication_ms=round(statistics.mean(communication_per_step), 6) if communication_per_step else 0.0,
        predicted_communication_ms=round(sum(predicted_communication), 6) if predicted_communication else None,
        communication_hidden_ms=[hidden for hidden, _ in overlap],
        communication_exposed_ms=[exposed for _, exposed in overlap],
        communication_replica_wait_ms=replica_wait,
        run_delay_ms=[round(sum(a.run_delay_ms or 0.0 for a in step.actions), 6) for step in result.steps]
        if any(a.run_delay_ms is not None for step in result.steps for a in step.actions)
        else [],
        compute_ms=[round(sum(a.end - a.start for a in step.actions), 6) for step in result.steps],
        update_ms=[step.update_ms for step in result.steps],
        update_wait_ms=[step.update_wait_ms for step in result.steps],
        update_parts_ms=[step.update_parts_ms for step in result.steps],
        **(same_step or {}),
        predicted_communication_hidden_ms=predicted_hidden,
        predicted_communication_exposed_ms=predicted_exposed,
        communication=result.last.communication,
        collectives=collective_spans(schedule, result, joined),
        step_times_ms=[step.time_ms for step in result.steps],
        steps=[step.check or StepCheck(step=k) for k, step in enumerate(result.steps)],
        actions=result.last.actions,
    )


def _verification(
    inst: Any,
    m: int,
    results: list[RankResult],
    reference: Reference,
    options: TrainingOptions | None,
    tolerance: float,
) -> dict[str, Any]:
    """The report's checks: gradients, parameters and losses (``m`` microbatches per step and replica) against the
    reference, per replica."""
    size = options.data_parallel if options else 1
    gradients = _replica_errors(results, reference, inst.model_stage, "gradients")
    parameters = _replica_errors(results, reference, inst.model_stage, "parameters")
    losses = _step_losses(results, options.steps if options else 1, m, size)
    loss_errors = [
        None if got is None else abs(got - want) / max(abs(want), 1e-30)
        for got, want in zip(losses, reference.losses, strict=True)
    ]
    missing = sorted(set(gradients.missing) | set(parameters.missing))
    last_losses = {r.dp_rank * m + j for r in results for j in r.last.losses}
    checks = [check for r in results for check in _checks(r)]
    return {
        "max_abs_grad_error": gradients.max_abs,
        "max_rel_grad_error": gradients.max_rel,
        "worst_parameter": gradients.worst,
        "max_abs_param_error": parameters.max_abs,
        "max_rel_param_error": parameters.max_rel,
        "worst_parameter_after_steps": parameters.worst,
        "missing_gradients": missing,
        "tolerance": tolerance,
        "loss": losses[-1],
        "reference_loss": reference.losses[-1],
        "losses": losses,
        "reference_losses": reference.losses,
        "loss_rel_error": loss_errors[-1],
        "missing_losses": sorted(set(range(size * m)) - last_losses),
        "rolled_back_steps": sorted({c.step for c in checks if (c.rolled_back and c.norm is None) or c.skipped}),
        "reference_skipped_steps": [s.step for s in reference.steps if s.skipped],
        "verified": not missing
        and not gradients.unexpected
        and gradients.max_rel <= tolerance
        and parameters.max_rel <= tolerance
        and all(e is not None and e <= tolerance for e in loss_errors),
    }


def _timing(schedule: Schedule, prediction: Schedule, results: list[RankResult], steps: int) -> dict[str, Any]:
    """Predicted (``prediction``) against measured: makespan, step time, and the simulator fed the measured passes
    (on ``schedule``, the order as run). The measured step time is the median over the steps after the first (its
    lazy initialisation; a no-flush pattern's warm-up), and before the last of a no-flush pattern run in steady
    state (its drain): the steady state its ``step_period`` predicts."""
    predicted_step, predicted_from = _predicted_step_time(prediction)
    per_step = [max(r.steps[k].time_ms for r in results) for k in range(steps)]
    costs = measured_costs(schedule, [r.last.actions for r in sorted(results, key=lambda r: r.rank) if r.dp_rank == 0])
    starts = [a.start for r in results for a in r.last.actions]
    ends = [a.end for r in results for a in r.last.actions]
    return {
        "predicted_makespan_ms": prediction.makespan,
        "measured_makespan_ms": round(max(ends) - min(starts), 6) if starts else 0.0,
        "simulated_makespan_from_measured_costs_ms": simulate_measured(
            schedule, costs, _last_step(prediction, steps) if prediction is not schedule else None
        ),
        "measured_costs_ms": costs,
        "predicted_step_time_ms": predicted_step,
        "predicted_step_time_from": predicted_from,
        "measured_step_time_ms": round(statistics.median(steady_steps(per_step, prediction is not schedule)), 6),
        "measured_step_times_ms": per_step,
    }


def build_report(
    schedule: Schedule,
    results: list[RankResult],
    reference: Reference,
    options: TrainingOptions | None,
    *,
    backend: str,
    device: str,
    engine: str,
    model_name: str,
    synchronous_reference: Reference | None = None,
    prediction: Schedule | None = None,
) -> RunReport:
    """The run report of ``results`` (every process of the run) for ``schedule`` (the order as it ran), against
    ``prediction`` (default ``schedule``; the pattern of a steady no-flush run).

    Verified when, on every rank of every replica, the last step's gathered gradients and the parameters after
    the last step are within the tolerance of the reference (relative, per tensor), the loss of every step too,
    and every rank ran its schedule's compute actions in order. ``synchronous_reference`` (2BW): the synchronous
    rule's reference, reported as ``max_rel_param_error_vs_synchronous``.
    """
    inst = compile_for_orders(schedule.problem, schedule.orders())
    activations = peak_activation_bytes(prediction or schedule) if (prediction or schedule).peak_memory else []
    size = options.data_parallel if options else 1
    m = (prediction or schedule).problem.pipeline.num_microbatches
    tolerance = TOLERANCE["cuda" if device.startswith("cuda") else "cpu"]
    verification = _verification(inst, m, results, reference, options, tolerance)
    mismatches = _order_mismatches(schedule, results)
    joined = _joined(results)
    # A steady no-flush run's steps are cut from one order (its prediction the pattern): not step by step.
    same_step = (
        _same_step_predictions(schedule, results, joined) if prediction is None or prediction is schedule else {}
    )
    verification["verified"] = bool(verification["verified"] and not mismatches)
    versus_synchronous = None
    if synchronous_reference is not None:
        versus_synchronous = _replica_errors(results, synchronous_reference, inst.model_stage, "parameters").max_rel
    return RunReport(
        **verification,
        **_timing(schedule, prediction or schedule, results, options.steps if options else 1),
        steps=options.steps if options else 1,
        max_rel_param_error_vs_synchronous=versus_synchronous,
        executed_order_matches=not mismatches,
        order_mismatches=mismatches,
        ranks=[
            _rank_report(prediction or schedule, r, joined[r.rank], activations, same_step.get(r.rank))
            for r in sorted(results, key=lambda r: r.rank)
        ],
        training=None if options is None else _training_fields(options),
        data_parallel=DataParallelReport(
            size=size, sharding=options.sharding if options and size > 1 else "none", world_size=len(results)
        ),
        weight_versions=2 if options is not None and options.two_weight_versions else 1,
        method=schedule.method,
        model=model_name,
        engine=engine,
        backend=backend,
        device=device,
        torch_version=torch.__version__,
    )


def _last_step(prediction: Schedule, steps: int) -> range | None:
    """A no-flush pattern run in steady state (K steps unrolled into one order): the last step's global microbatch
    ids, the span its measured makespan covers (``None``: one step, the whole order)."""
    if steps < 2:
        return None
    m = prediction.problem.pipeline.num_microbatches
    return range((steps - 1) * m, steps * m)


def steady_steps(per_step: list[float], pattern: bool) -> list[float]:
    """The steps a run's time per step is read from (:func:`_timing`): after the first (lazy initialisation, a
    pattern's warm-up), and for a no-flush ``pattern`` run in steady state before the last (its drain), so that
    every step counted holds the same work, m microbatches and one optimizer step per stage."""
    if pattern and len(per_step) > 2:
        return per_step[1:-1]
    return per_step[1:] if len(per_step) > 1 else per_step


def _checks(result: RankResult) -> list[StepCheck]:
    return [step.check for step in result.steps if step.check is not None]


def _training_fields(options: TrainingOptions) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(options).items()} | {
        "clip_norm": options.clip_norm
    }


def print_report(report: RunReport, console: Console | None = None) -> None:
    """A one-screen summary of a run report."""
    console = console or Console()
    verdict = "[bold green]verified[/bold green]" if report.verified else "[bold red]NOT verified[/bold red]"
    console.print(
        f"{verdict} · {report.method} · {len(report.ranks)} ranks · {report.backend} on "
        f"{report.device} · engine {report.engine} · model {report.model}",
        highlight=False,
    )
    loss_text = (
        f"{report.loss:.8g}"
        if report.loss is not None
        else f"missing for microbatch(es) {', '.join(map(str, report.missing_losses))}"
    )
    console.print(
        f"loss {loss_text} (reference {report.reference_loss:.8g}) · max gradient error "
        f"{report.max_abs_grad_error:.3g} abs, {report.max_rel_grad_error:.3g} rel (tolerance "
        f"{report.tolerance:g}) · executed order {'matches' if report.executed_order_matches else 'DIFFERS'}",
        highlight=False,
    )
    simulated = report.simulated_makespan_from_measured_costs_ms
    predicted = report.predicted_makespan_ms
    console.print(
        f"makespan: predicted {'—' if predicted is None else f'{predicted:.3f}'} ms · measured "
        f"{report.measured_makespan_ms:.3f} ms"
        + ("" if simulated is None else f" · simulated from measured costs {simulated:.3f} ms"),
        highlight=False,
    )
    console.print(_memory_table(report))
    if report.order_mismatches:
        console.print(f"order mismatches: {[m.model_dump() for m in report.order_mismatches]}", highlight=False)
    if report.missing_gradients:
        console.print(f"missing gradients: {report.missing_gradients[:5]}", highlight=False)


def _memory_table(report: RunReport) -> Table:
    activations_only = all(r.memory_measure == "saved-activations" for r in report.ranks)
    measured_title, predicted_key = (
        ("peak activations", "predicted_peak_activation_bytes")
        if activations_only
        else ("peak memory", "predicted_peak_memory_bytes")
    )
    table = Table(show_header=True, header_style="bold", title=f"per rank · {measured_title}, measured and predicted")
    shown = report.ranks[:16]
    predicted = [getattr(r, predicted_key) for r in shown]
    unit_name, unit = common_unit([r.peak_memory_bytes for r in shown] + [p for p in predicted if p is not None])
    for column in ("rank", "actions", "busy ms", "first start ms", "last end ms"):
        table.add_column(column, justify="right")
    table.add_column(f"measured {unit_name}", justify="right")
    table.add_column(f"predicted {unit_name}", justify="right")
    for rank, expected in zip(shown, predicted, strict=True):
        actions = rank.actions
        table.add_row(
            str(rank.rank),
            str(len(actions)),
            f"{sum(a.duration_ms for a in actions):.3f}",
            f"{actions[0].start:.3f}" if actions else "—",
            f"{actions[-1].end:.3f}" if actions else "—",
            f"{rank.peak_memory_bytes / unit:.3f}",
            "—" if expected is None else f"{expected / unit:.3f}",
        )
    return table


def print_training_summary(report: RunReport, console: Any = None) -> None:
    """Lines a person reads after :func:`print_report` for a training run."""
    console = console or Console()
    dp, training = report.data_parallel, report.training or {}
    rule = "2bw (W(t+1) = W(t) − ν·∇f(W(t−1)))" if training.get("weight_update") == "2bw" else "synchronous"
    if training.get("post_validation"):
        rule = "post-validated (speculative steps, rollback)"
    console.print(
        f"{report.steps} step(s) · {training.get('optimizer', 'no optimizer')} lr {training.get('lr', 0):g} · {rule} · "
        f"clip {training.get('clip_norm')} · data-parallel {dp.size} ({dp.sharding}) on {dp.world_size} "
        f"processes · max parameter error {report.max_rel_param_error:.3g} rel",
        highlight=False,
    )
    if report.max_rel_param_error_vs_synchronous is not None:
        console.print(
            f"differs from the synchronous rule by {report.max_rel_param_error_vs_synchronous:.3g} rel", highlight=False
        )
    if report.rolled_back_steps:
        console.print(f"rolled back (or skipped): step(s) {report.rolled_back_steps}", highlight=False)
    predicted = report.predicted_step_time_ms
    console.print(
        f"step time: predicted {'—' if predicted is None else f'{predicted:.3f}'} ms "
        f"({report.predicted_step_time_from}) · measured {report.measured_step_time_ms:.3f} ms (median, first step "
        "excluded when K > 1)",
        highlight=False,
    )
    for rank in report.ranks[:16]:
        expected = rank.predicted_communication_ms
        console.print(
            f"rank {rank.rank} (pp {rank.pp_rank}, dp {rank.dp_rank}): communication measured "
            f"{rank.measured_communication_ms:.3f} ms/step"
            + ("" if expected is None else f", predicted {expected:.3f} ms")
            + _overlap_text(rank)
            + f" · static {rank.static_bytes_measured} B measured, {rank.static_bytes_predicted:.0f} B predicted",
            highlight=False,
        )


def _overlap_text(rank: RankReport) -> str:
    """``hidden h / exposed e ms`` (median over steps after the first), with the prediction when there is one, and
    the wait for a slower replica."""
    if not rank.communication_hidden_ms:
        return ""
    steady = slice(1, None) if len(rank.communication_hidden_ms) > 1 else slice(None)
    hidden = statistics.median(rank.communication_hidden_ms[steady])
    exposed = statistics.median(rank.communication_exposed_ms[steady])
    text = f" (hidden {hidden:.3f} / exposed {exposed:.3f} ms"
    if rank.predicted_communication_hidden_ms is not None:
        text += (
            f"; predicted {rank.predicted_communication_hidden_ms:.3f} / "
            f"{rank.predicted_communication_exposed_ms:.3f} ms"
        )
    if any(rank.communication_replica_wait_ms):
        text += f"; waited {statistics.median(rank.communication_replica_wait_ms[steady]):.3f} ms for a slower replica"
    return text + ")"
