"""PyTorch's built-in pipeline schedules as data: their per-rank compute orders, read without a process group.

Every schedule class of ``torch.distributed.pipelining.schedules`` computes its whole
``pipeline_order`` (one list of actions per rank, ``None`` for an idle lockstep slot) in its
constructor from the stages' ``stage_index``, ``num_stages``, ``group_size``, ``group_rank``,
``is_first``, ``is_last`` and ``submod`` alone (``docs/RUNTIME.md``, "PyTorch facts").
:func:`torch_compute_orders` builds a schedule on such stand-in stages and keeps the compute actions
(F, I, W, B) in order: idle slots and bookkeeping actions (REDUCE_GRAD, UNSHARD, RESHARD, sends and
receives) are dropped, and DualPipeV's ``OVERLAP_F_B`` pairs are flattened into their two passes, forward
first. The result is what pipesched's simulator times (:mod:`pipesched.optimizer.simulate`).

Known defect (torch 2.13): ``Schedule1F1B.pipeline_order`` numbers the last rank's forwards 1 … m
instead of 0 … m−1 (what ``_step_microbatches`` runs is right); ``repair=True`` renumbers them.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Literal

from pipesched.optimizer.families import FamilySpec, registry
from pipesched.optimizer.problem import stage_to_rank

__all__ = ["TORCH_SCHEDULES", "TorchSchedule", "torch_compute_orders", "torch_schedule", "torch_schedules_for"]


@dataclass(frozen=True)
class TorchSchedule:
    """One of PyTorch's built-in schedules.

    Attributes:
        name: the name ``get_schedule_class`` takes, e.g. ``"InterleavedZeroBubble"``.
        placement: ``"loop"`` or ``"v"``.
        stages_per_rank: ``None`` for any, else the only value it takes.
        min_stages_per_rank: the least stages per rank (multi-stage schedules need 2 or more in 2.13).
        split_backward: whether its backward is I + W (``"mixed"``: DualPipeV runs both forms).
        family: pipesched's family of the same schedule.
    """

    name: str
    placement: Literal["loop", "v"]
    stages_per_rank: int | None
    min_stages_per_rank: int
    split_backward: bool | Literal["mixed"]
    family: str


_SPLIT_BACKWARD: dict[str, bool | Literal["mixed"]] = {"fused": False, "split": True, "mixed": "mixed"}


def _torch_schedule_of(family: FamilySpec) -> TorchSchedule:
    """The PyTorch schedule a family declares it mirrors (its ``torch``), with the family's layouts."""
    assert family.torch is not None
    layouts = family.stages_per_rank
    backward = _SPLIT_BACKWARD[family.torch.backward]
    placement = family.placements[0]
    assert placement in ("loop", "v")
    return TorchSchedule(
        name=family.torch.name,
        placement=placement,
        stages_per_rank=layouts.start if len(layouts) == 1 else None,
        min_stages_per_rank=layouts.start,
        split_backward=backward,
        family=family.name,
    )


TORCH_SCHEDULES: tuple[TorchSchedule, ...] = tuple(
    _torch_schedule_of(family) for family in registry().values() if family.torch is not None
)
"""PyTorch 2.13's schedules with a static order, with the pipesched family that builds the same schedule (from
the families' declarations: :class:`~pipesched.optimizer.families.TorchClass`)."""


def torch_schedules_for(placement: str, stages_per_rank: int) -> list[TorchSchedule]:
    """The built-in schedules that run a pipeline of this placement and stages per rank."""
    return [
        s
        for s in TORCH_SCHEDULES
        if s.placement == placement
        and stages_per_rank >= s.min_stages_per_rank
        and (s.stages_per_rank is None or s.stages_per_rank == stages_per_rank)
    ]


def _stand_in_stages(num_ranks: int, stages_per_rank: int, placement: str, rank: int) -> list[SimpleNamespace]:
    num_stages = num_ranks * stages_per_rank
    ids = [s for s, holder in enumerate(stage_to_rank(num_ranks, stages_per_rank, placement)) if holder == rank]
    return [
        SimpleNamespace(
            stage_index=s,
            num_stages=num_stages,
            group_size=num_ranks,
            group_rank=rank,
            is_first=s == 0,
            is_last=s == num_stages - 1,
            submod=None,
        )
        for s in ids
    ]


def torch_schedule(name: str, num_ranks: int, stages_per_rank: int, num_microbatches: int) -> Any:
    """PyTorch's schedule object ``name`` built on stand-in stages for rank 0 (its ``pipeline_order`` covers every
    rank; ``_dump_csv(path, "compute_only" | "compute_comms")`` writes it as PyTorch writes schedule CSVs).

    Raises:
        ValueError: for an unknown name, or when PyTorch rejects the shape (its message kept).
    """
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    spec = next((s for s in TORCH_SCHEDULES if s.name == name), None)
    if spec is None:
        raise ValueError(
            f"unknown PyTorch schedule {name!r}: choose one of {', '.join(s.name for s in TORCH_SCHEDULES)}"
        )
    cls = get_schedule_class(name)
    stages = _stand_in_stages(num_ranks, stages_per_rank, spec.placement, 0)
    try:
        return cls(stages[0] if issubclass(cls, PipelineScheduleSingle) else stages, num_microbatches)
    except (AssertionError, RuntimeError, ValueError) as error:
        raise ValueError(
            f"PyTorch's {name} rejects p={num_ranks}, v={stages_per_rank}, m={num_microbatches}: {error}"
        ) from error


def torch_compute_orders(
    name: str,
    num_ranks: int,
    stages_per_rank: int,
    num_microbatches: int,
    *,
    repair: bool = False,
) -> list[list[str]]:
    """Per-rank compute action strings (``"3F12"``) of PyTorch's schedule ``name``.

    Args:
        name: a name of :data:`TORCH_SCHEDULES` (``get_schedule_class`` spelling).
        num_ranks, stages_per_rank, num_microbatches: the pipeline shape.
        repair: renumber ``Schedule1F1B``'s last-rank forwards (module docstring).

    Raises:
        ValueError: for an unknown name, or when PyTorch rejects the shape (its message kept), e.g.
            interleaved schedules with m not divisible by ``max(1, m // num_ranks)``.
    """
    schedule = torch_schedule(name, num_ranks, stages_per_rank, num_microbatches)
    orders: list[list[str]] = []
    for rank in range(num_ranks):
        row: list[str] = []
        for action in schedule.pipeline_order[rank]:
            if action is None:
                continue
            parts = action.sub_actions if action.sub_actions is not None else (action,)
            for part in parts:
                kind = part.computation_type.value
                if kind in ("F", "I", "W", "B"):
                    row.append(f"{part.stage_index}{kind}{part.microbatch_index}")
        orders.append(row)
    if repair and name == "1F1B":
        last = num_ranks - 1
        forwards = iter(range(num_microbatches))
        orders[last] = [f"{last}F{next(forwards)}" if "F" in a else a for a in orders[last]]
    return orders


@dataclass(frozen=True)
class PeerComparison:
    """``auto`` against one of PyTorch's schedules at the memory that schedule uses.

    Attributes:
        schedule: PyTorch's schedule name.
        torch_value: its objective in pipesched's simulator, ms.
        auto_value: ``auto``'s objective with ``memory.limit`` set to the schedule's per-rank peak, ms.
        torch_peak, auto_peak: peak memory per rank, bytes.
        backend: what found ``auto``'s answer (``family:<name>``, ``heuristic``, …).
    """

    schedule: str
    torch_value: float
    auto_value: float
    torch_peak: list[float]
    auto_peak: list[float]
    backend: str

    @property
    def ratio(self) -> float:
        """auto / torch (≤ 1: auto is at least as fast)."""
        return self.auto_value / self.torch_value


def peer_problem(problem: Any, spec: TorchSchedule) -> Any:
    """``problem`` with the backward form PyTorch's schedule runs: fused for GPipe, 1F1B, Interleaved1F1B and
    LoopedBFS, split for the zero-bubble ones (DualPipeV, which mixes both, is compared on the split problem)."""
    return problem.with_changes(split_backward=spec.split_backward is not False)


def auto_versus_torch(problem: Any, spec: TorchSchedule, time_limit_s: float) -> PeerComparison:
    """Time PyTorch's order for ``problem``'s shape with pipesched's simulator, then solve ``auto`` with
    ``memory.limit`` set to that order's per-rank peak and ``solver.time_limit_s`` to ``time_limit_s``.

    ``problem`` must already have the placement, stages per rank and backward form of ``spec``
    (:func:`peer_problem`). Schedule1F1B's order is repaired (module docstring).

    Raises:
        ValueError: when PyTorch rejects the shape.
    """
    from pipesched.optimizer.instance import compile_for_orders
    from pipesched.optimizer.ir import parse_orders
    from pipesched.optimizer.simulate import simulate
    from pipesched.optimizer.solve import solve

    pipeline = problem.pipeline
    rows = torch_compute_orders(
        spec.name, pipeline.num_ranks, pipeline.stages_per_rank, pipeline.num_microbatches, repair=True
    )
    orders = parse_orders(rows)
    sim = simulate(compile_for_orders(problem, orders), orders, check_memory=False)
    limited = problem.with_changes(
        **{"memory.limit": sim.peak_memory, "solver.method": "auto", "solver.time_limit_s": time_limit_s}
    )
    answer = solve(limited)
    assert answer.objective_value is not None, answer.reason
    return PeerComparison(
        schedule=spec.name,
        torch_value=sim.objective_value(problem.objective),
        auto_value=answer.objective_value,
        torch_peak=sim.peak_memory,
        auto_peak=list(answer.peak_memory),
        backend=answer.backend,
    )
