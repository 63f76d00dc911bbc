"""The schedule answer of ``docs/CONTRACT.md`` (Schedule) and its construction from a simulation."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pipesched.optimizer.instance import Instance, compile_for_orders
from pipesched.optimizer.ir import Action, ActionKind, Orders, parse_orders
from pipesched.optimizer.problem import DataParallel, Problem, weight_version_memory
from pipesched.optimizer.simulate import SimulationResult, simulate

__all__ = [
    "OPTIMALITY_TOLERANCE_MS",
    "ActionTiming",
    "RankSchedule",
    "Schedule",
    "ScheduleShape",
    "build_schedule",
    "infeasible_schedule",
    "peak_activation_bytes",
    "schedule_from_simulation",
]

Status = Literal["optimal", "feasible", "infeasible"]

#: What a schedule's ranks hold: one flushed ``"step"``, or the repeating per-rank ``"pattern"`` of a schedule
#: without a flush (:mod:`pipesched.optimizer.pattern`; ``step_period`` is its time per step).
ScheduleShape = Literal["step", "pattern"]

OPTIMALITY_TOLERANCE_MS = 1e-5
"""A lower bound this close to the objective (ms) proves it optimal: the exact backends' numeric
tolerance (the MILP lowers its proven bound by 1e-6 ms so it never overstates it)."""


class ActionTiming(BaseModel):
    """One action with its simulated start and end, ms from the step's first start."""

    model_config = ConfigDict(extra="forbid")

    action: str = Field(description='String form, e.g. "3F12", "3REDUCE_GRAD", "OPTIMIZER_STEP".')
    stage: int | None = Field(description="Stage id; null for OPTIMIZER_STEP.")
    kind: Literal["F", "I", "W", "B", "UNSHARD", "RESHARD", "REDUCE_GRAD", "OPTIMIZER_STEP"]
    microbatch: int | None = Field(description="Microbatch; null for communication actions and OPTIMIZER_STEP.")
    start: float = Field(description="ms")
    end: float = Field(description="ms")


class RankSchedule(BaseModel):
    """One rank's actions in execution order."""

    model_config = ConfigDict(extra="forbid")

    rank: int
    actions: list[ActionTiming]


class Schedule(BaseModel):
    """The answer: per-rank schedules with their simulated figures (contract, Schedule).

    ``makespan``, ``stage_span``, ``bubble_rate`` and ``peak_memory`` are always recomputed by the
    simulator, never taken from a solver. ``lower_bound`` and ``gap`` refer to ``objective``;
    ``gap = (value − lower_bound) / value``. An infeasible answer has no ranks, a ``reason`` and,
    where it is known, ``min_memory_limit``: the least per-rank limit (bytes) that admits a schedule
    (for ``auto``: any schedule; for a named family: that family's schedule, i.e. its peak per rank).
    """

    model_config = ConfigDict(extra="forbid")

    id: str | None = None
    status: Status
    method: str
    backend: str
    objective: Literal["makespan", "stage_span", "step_time", "step_period"]
    makespan: float | None = Field(None, description="ms")
    stage_span: float | None = Field(None, description="ms")
    step_time: float | None = Field(
        None,
        description="ms: first start to the end of the last optimizer step (contract, Terms); equals the makespan "
        "(stage_span under post-validation) without data parallelism and optimizer cost",
    )
    step_period: float | None = Field(
        None, description="ms, schedules without flushes: steady-state time between two steps on every rank"
    )
    lower_bound: float | None = Field(None, description="ms, on the objective")
    gap: float | None = None
    bubble_rate: float | None = None
    peak_memory: list[float] = Field(default_factory=list, description="bytes per rank")
    solve_time_s: float = 0.0
    stage_to_rank: list[int]
    ranks: list[RankSchedule] = Field(default_factory=list)
    problem: Problem
    reason: str | None = None
    min_memory_limit: list[float] | None = Field(
        None,
        description=(
            "bytes per rank (infeasible answers): the least limit admitting any schedule (auto), or a family's peak"
        ),
    )
    fits_memory: bool | None = Field(None, description="Whether every rank stays within its limit.")
    cache: Literal["hit", "miss"] | None = Field(
        None,
        exclude=True,
        description="Set by the service (hit: a stored schedule); accepted on input, never written.",
    )

    def orders(self) -> Orders:
        """Per-rank :class:`Action` orders."""
        return parse_orders([[a.action for a in rank.actions] for rank in self.ranks])

    @property
    def shape(self) -> ScheduleShape:
        """``"pattern"`` for a problem without a flush (its ranks repeat), else ``"step"``: the one place that
        tells them apart, from ``problem.training.flush``."""
        return "step" if self.problem.training.flush else "pattern"

    @property
    def data_parallel(self) -> DataParallel:
        """The data-parallel group (size, sharding) the schedule was solved for: a run must use the same."""
        return self.problem.data_parallel_group

    @property
    def objective_value(self) -> float | None:
        """The value of ``objective``, ms."""
        if self.objective == "step_period":
            return self.step_period
        if self.objective == "step_time":
            return self.step_time
        return self.makespan if self.objective == "makespan" else self.stage_span


def build_schedule(
    problem: Problem,
    orders: Orders,
    *,
    method: str,
    backend: str,
    lower_bound: float | None = None,
    solve_time_s: float = 0.0,
    instance: Instance | None = None,
    check_memory: bool = True,
    optimal_tolerance: float = 1e-9,
) -> Schedule:
    """Simulate ``orders`` and wrap them as a :class:`Schedule`.

    The status is ``optimal`` when ``lower_bound`` meets the simulated objective, else ``feasible``.

    Raises:
        InvalidSchedule: when the simulator rejects the orders (memory only with ``check_memory``).
    """
    inst = instance or compile_for_orders(problem, orders)
    sim = simulate(inst, orders, check_memory=check_memory)
    return schedule_from_simulation(
        problem,
        inst,
        sim,
        method=method,
        backend=backend,
        lower_bound=lower_bound,
        solve_time_s=solve_time_s,
        optimal_tolerance=optimal_tolerance,
    )


def schedule_from_simulation(
    problem: Problem,
    inst: Instance,
    sim: SimulationResult,
    *,
    method: str,
    backend: str,
    lower_bound: float | None = None,
    solve_time_s: float = 0.0,
    optimal_tolerance: float = 1e-9,
) -> Schedule:
    """Wrap an existing simulation as a :class:`Schedule`."""
    value = sim.objective_value(problem.objective)
    gap = None
    status: Status = "feasible"
    if lower_bound is not None:
        lower_bound = min(lower_bound, value)
        gap = max(0.0, (value - lower_bound) / value) if value > 0 else 0.0
        if gap <= optimal_tolerance or value - lower_bound <= OPTIMALITY_TOLERANCE_MS:
            gap = 0.0
            status = "optimal"
    ranks = []
    for rank, row in enumerate(sim.orders):
        timings = []
        for idx in row:
            action: Action = inst.actions[idx]
            timings.append(
                ActionTiming(
                    action=str(action),
                    stage=None if action.kind == ActionKind.OPTIMIZER_STEP else action.stage,
                    kind=action.kind.value,
                    microbatch=action.microbatch if action.is_compute else None,
                    start=round(sim.start[idx], 6),
                    end=round(sim.end[idx], 6),
                )
            )
        ranks.append(RankSchedule(rank=rank, actions=timings))
    return Schedule(
        status=status,
        method=method,
        backend=backend,
        objective=problem.objective,
        makespan=round(sim.makespan, 6),
        stage_span=round(sim.stage_span, 6),
        step_time=round(sim.step_time, 6),
        lower_bound=None if lower_bound is None else round(lower_bound, 6),
        gap=gap,
        bubble_rate=round(sim.bubble_rate(problem.objective), 6),
        peak_memory=sim.peak_memory,
        solve_time_s=round(solve_time_s, 4),
        stage_to_rank=inst.stage_ranks,
        ranks=ranks,
        problem=problem,
        fits_memory=sim.fits,
    )


def infeasible_schedule(
    problem: Problem,
    *,
    method: str,
    backend: str,
    reason: str,
    min_memory_limit: list[float] | None = None,
    solve_time_s: float = 0.0,
) -> Schedule:
    """An answer saying no schedule exists (or the family cannot fit), with the reason."""
    return Schedule(
        status="infeasible",
        method=method,
        backend=backend,
        objective=problem.objective,
        solve_time_s=round(solve_time_s, 4),
        stage_to_rank=problem.pipeline.stage_to_rank,  # not compile_problem: an infeasible answer needs no actions
        problem=problem,
        reason=reason,
        min_memory_limit=min_memory_limit,
        fits_memory=False,
    )


#: The passes, whose memory is the microbatches' activations (contract, Problem: F allocates, I, W and B free).
_PASS_KINDS = frozenset({"F", "I", "W", "B"})


def peak_activation_bytes(schedule: Schedule) -> list[float]:
    """Per rank, the most activation bytes its passes hold at once on the schedule's timeline: ``memory.activation``
    from each F's start, freed by its I (less ``retained_for_weight``), W and B at their ends, a free before an
    allocation at the same instant, as the simulator counts them. ``peak_memory`` less static memory is not this
    figure where the schedule gathers weights: sharding ``full`` adds each UNSHARD's gathered weights (and frees
    gradient shards at REDUCE_GRAD); a run's saved activations hold neither (dualpipe-v, pp 2 × dp 2 FSDP: 400–470 KB
    of gathered weights in a 1.7–1.8 MB "peak less static"). A pattern (no flush) holds its passes' activations
    beside static memory and the extra weight versions only (:meth:`pipesched.optimizer.pattern.SteadyStateEvaluator
    .peak_memory`, from its warm-up copy on): its peak less those two."""
    if not schedule.ranks:
        return []
    problem = schedule.problem
    if schedule.shape == "pattern":
        extra = weight_version_memory(problem)
        return [
            peak - static - versions
            for peak, static, versions in zip(schedule.peak_memory, problem.static_memory, extra, strict=True)
        ]
    inst = compile_for_orders(problem, schedule.orders())
    peaks: list[float] = []
    for rank, order in zip(schedule.ranks, schedule.orders(), strict=True):
        events = []
        for position, (timing, action) in enumerate(zip(rank.actions, order, strict=True)):
            delta = inst.mem_delta[inst.index[action]] if timing.kind in _PASS_KINDS else 0.0
            if delta:
                events.append((timing.start if delta > 0 else timing.end, delta > 0, position, delta))
        held = peak = 0.0
        for *_, delta in sorted(events):
            held += delta
            peak = max(peak, held)
        peaks.append(peak)
    return peaks
