"""A problem compiled into indexed actions: the one place where precedence and memory deltas live.

Everything that needs the dependency rule (the simulator, the solvers, the families' checks, the
runtime's p2p plan) reads it from :class:`Instance`; nobody writes it again.

Dependencies (Zero Bubble paper, Sec. 2; ``shared/NOTES.md`` §1), for microbatch j passing the
chain of stages ``c_0 … c_{S-1}``:

* ``F(c_k, j)`` after ``F(c_{k-1}, j)``, plus p2p latency when the two stages sit on different ranks;
* the backward (I, or B when fused) of ``c_k`` after the backward of ``c_{k+1}`` (+ p2p), and on the
  last stage after its own F;
* ``W(c_k, j)`` after ``I(c_k, j)`` on the same rank.

The backward of each (stage, microbatch) pair is split (I + W) or fused (B) as ``split_backward`` says,
unless ``backward_forms`` names the form per pair: a schedule may mix them, as DualPipeV does
(DeepSeek; PyTorch's ``ScheduleDualPipeV``). A fused B sends its gradient only when it ends (its
successors depend on its end, like an I's). :func:`compile_for_orders` reads the forms from a schedule.

Memory (contract, Problem): F allocates ``activation``; I frees ``activation − retained_for_weight``;
W frees ``retained_for_weight``; B frees ``activation``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from pipesched.optimizer.ir import Action, ActionKind, Orders
from pipesched.optimizer.problem import Problem

__all__ = ["Instance", "backward_forms_of", "compile_for_orders", "compile_problem", "stage_to_rank"]


def stage_to_rank(problem: Problem) -> list[int]:
    """Rank of every stage id (length ``num_stages``, or ``2 * num_stages`` for bidirectional)."""
    pipeline = problem.pipeline
    p, num_stages = pipeline.num_ranks, pipeline.num_stages
    placement = pipeline.placement
    if isinstance(placement, list):
        return list(placement)
    if placement == "loop":
        return [s % p for s in range(num_stages)]
    v = [s if s < p else 2 * p - 1 - s for s in range(num_stages)]
    if placement == "v":
        return v
    # bidirectional: replica 0 in V placement, replica 1 mirrored.
    return v + [p - 1 - r for r in v]


@dataclass
class Instance:
    """Indexed actions of one problem.

    Attributes:
        problem: the validated problem.
        num_ranks: ranks p.
        num_microbatches: microbatches m.
        num_stages: model stages (per-stage cost lists have this length).
        stage_ranks: rank of each stage id; bidirectional problems have ``2 * num_stages`` ids.
        model_stage: model stage (cost index) of each stage id.
        chains: stage ids microbatch j passes forward, ``chains[j]``.
        split_backward: whether the backward is I + W (else B).
        actions: every action, index → Action.
        index: Action → index.
        rank: index → rank.
        duration: index → ms.
        preds: index → list of ``(predecessor index, latency ms)``.
        succs: index → list of ``(successor index, latency ms)``.
        mem_delta: index → bytes allocated (+) or freed (−) by the action.
        static: per-rank static bytes.
        limit: per-rank limit in bytes (``inf`` for none).
        rank_actions: per rank, the action indices it must run (any order).
        compute: per-rank total busy time, ms (``ideal`` of the bubble rate is its max).
    """

    problem: Problem
    num_ranks: int
    num_microbatches: int
    num_stages: int
    stage_ranks: list[int]
    model_stage: list[int]
    chains: list[list[int]]
    split_backward: bool
    actions: list[Action] = field(default_factory=list)
    index: dict[Action, int] = field(default_factory=dict)
    rank: list[int] = field(default_factory=list)
    duration: list[float] = field(default_factory=list)
    preds: list[list[tuple[int, float]]] = field(default_factory=list)
    succs: list[list[tuple[int, float]]] = field(default_factory=list)
    mem_delta: list[float] = field(default_factory=list)
    static: list[float] = field(default_factory=list)
    limit: list[float] = field(default_factory=list)
    rank_actions: list[list[int]] = field(default_factory=list)
    compute: list[float] = field(default_factory=list)

    @property
    def backward_kind(self) -> ActionKind:
        """The kind that carries the input gradient: I when split, B when fused."""
        return ActionKind.BACKWARD_INPUT if self.split_backward else ActionKind.BACKWARD

    @property
    def ideal(self) -> float:
        """Max over ranks of the rank's total compute time, ms (contract, bubble_rate)."""
        return max(self.compute)

    @property
    def has_memory_limit(self) -> bool:
        """Whether any rank has a finite limit."""
        return any(math.isfinite(x) for x in self.limit)

    def forward_time(self, stage: int) -> float:
        """F time of a stage id, ms."""
        return self.duration[self.index[Action(stage, ActionKind.FORWARD, self.first_microbatch(stage))]]

    def first_microbatch(self, stage: int) -> int:
        """A microbatch that passes through ``stage``."""
        for j, chain in enumerate(self.chains):
            if stage in chain:
                return j
        raise KeyError(stage)

    def action_id(self, stage: int, kind: ActionKind | str, microbatch: int) -> int:
        """Index of an action; raises ``KeyError`` when the problem has no such action."""
        return self.index[Action(stage, ActionKind(kind), microbatch)]


def backward_forms_of(orders: Orders) -> dict[tuple[int, int], bool]:
    """Per (stage, microbatch) pair that ``orders`` runs a backward for: True when split (I or W), False when
    fused (B). A pair with both forms counts as split; the simulator then rejects its B as unknown."""
    forms: dict[tuple[int, int], bool] = {}
    for row in orders:
        for action in row:
            if action.kind == ActionKind.BACKWARD:
                forms.setdefault((action.stage, action.microbatch), False)
            elif action.kind != ActionKind.FORWARD:
                forms[action.stage, action.microbatch] = True
    return forms


def compile_for_orders(problem: Problem, orders: Orders) -> Instance:
    """:func:`compile_problem` with each pair's backward form (B, or I + W) taken from ``orders``; pairs the
    orders do not mention keep ``problem.split_backward``. Equal to ``compile_problem(problem)`` when the orders
    use the problem's form throughout."""
    forms = backward_forms_of(orders)
    if all(split == problem.split_backward for split in forms.values()):
        return compile_problem(problem)
    return compile_problem(problem, backward_forms=forms)


def compile_problem(problem: Problem, *, backward_forms: Mapping[tuple[int, int], bool] | None = None) -> Instance:
    """Index every action of ``problem`` with its rank, duration, dependencies and memory delta.

    ``backward_forms`` maps (stage id, microbatch) to True (split: I + W) or False (fused: B); pairs it
    omits follow ``problem.split_backward``. ``Instance.split_backward`` stays the problem's.
    """
    assert problem.costs is not None and problem.memory is not None
    pipeline = problem.pipeline
    p, m, num_stages = pipeline.num_ranks, pipeline.num_microbatches, pipeline.num_stages
    ranks_of = stage_to_rank(problem)
    model_stage = [s % num_stages for s in range(len(ranks_of))]
    if pipeline.placement == "bidirectional":
        replica0 = (m + 1) // 2
        chains = [
            list(range(num_stages)) if j < replica0 else list(range(num_stages, 2 * num_stages)) for j in range(m)
        ]
    else:
        chains = [list(range(num_stages)) for _ in range(m)]

    forward = problem.stage_values(problem.costs.forward)
    backward_input = problem.stage_values(problem.costs.backward_input)
    backward_weight = problem.stage_values(problem.costs.backward_weight)
    p2p = problem.stage_values(problem.costs.p2p)
    activation = problem.stage_values(problem.memory.activation)
    retained = problem.stage_values(problem.memory.retained_for_weight)

    inst = Instance(
        problem=problem,
        num_ranks=p,
        num_microbatches=m,
        num_stages=num_stages,
        stage_ranks=ranks_of,
        model_stage=model_stage,
        chains=chains,
        split_backward=problem.split_backward,
        static=problem.static_memory,
        limit=problem.memory_limits,
        rank_actions=[[] for _ in range(p)],
        compute=[0.0] * p,
    )

    def add(action: Action, duration: float, delta: float) -> int:
        idx = len(inst.actions)
        inst.actions.append(action)
        inst.index[action] = idx
        rank = ranks_of[action.stage]
        inst.rank.append(rank)
        inst.duration.append(duration)
        inst.preds.append([])
        inst.succs.append([])
        inst.mem_delta.append(delta)
        inst.rank_actions[rank].append(idx)
        inst.compute[rank] += duration
        return idx

    def link(before: int, after: int, latency: float) -> None:
        inst.preds[after].append((before, latency))
        inst.succs[before].append((after, latency))

    split = problem.split_backward
    for j, chain in enumerate(chains):
        fwd_ids: list[int] = []
        for stage in chain:
            ms = model_stage[stage]
            fwd_ids.append(add(Action(stage, ActionKind.FORWARD, j), forward[ms], activation[ms]))
        bwd_ids: dict[int, int] = {}
        for stage in reversed(chain):
            ms = model_stage[stage]
            if split if backward_forms is None else backward_forms.get((stage, j), split):
                bwd_ids[stage] = add(
                    Action(stage, ActionKind.BACKWARD_INPUT, j),
                    backward_input[ms],
                    -(activation[ms] - retained[ms]),
                )
                weight = add(Action(stage, ActionKind.BACKWARD_WEIGHT, j), backward_weight[ms], -retained[ms])
                link(bwd_ids[stage], weight, 0.0)
            else:
                bwd_ids[stage] = add(
                    Action(stage, ActionKind.BACKWARD, j),
                    backward_input[ms] + backward_weight[ms],
                    -activation[ms],
                )
        for k, stage in enumerate(chain):
            if k > 0:
                prev = chain[k - 1]
                latency = p2p[model_stage[prev]] if ranks_of[prev] != ranks_of[stage] else 0.0
                link(fwd_ids[k - 1], fwd_ids[k], latency)
            if k + 1 < len(chain):
                nxt = chain[k + 1]
                latency = p2p[model_stage[nxt]] if ranks_of[nxt] != ranks_of[stage] else 0.0
                link(bwd_ids[nxt], bwd_ids[stage], latency)
            else:
                link(fwd_ids[k], bwd_ids[stage], 0.0)
    return inst
