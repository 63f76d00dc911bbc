"""A problem compiled into indexed actions: the one place where precedence and memory deltas live.

Everything that needs the dependency rule (the simulator, the solvers, the families' checks, the
runtime's p2p plan) reads it from :class:`Instance`; nobody writes it again.

Dependencies (Zero Bubble paper, arXiv 2401.10241, Sec. 2), for microbatch j passing the
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

The training step (contract, Terms: data-parallel group, communication actions, step_time), when the
problem has d > 1, an optimizer cost or synchronising replicas (:attr:`Problem.has_step_actions`), adds per
stage id s:

* sharding ``full``: per stage a sequence of *frames*, each an ``UNSHARD(s, n)`` (all-gather, ``costs.unshard``;
  holds ``memory.weights``·(d−1)/d) before every pass of the frame and a ``RESHARD(s, n)`` (no time; frees them)
  after it, frame n+1's gather after frame n's free. By default one frame holds all of s's passes (gathered
  once per step), or with ``reshard_after_forward`` two: the forwards, then the backwards. A schedule's own
  rows may frame the passes otherwise (:func:`frames_of`: the passes of s between its n-th UNSHARD and n-th
  RESHARD on the rank; e.g. one frame per pass, FSDP2 re-gathering per microbatch), and
  :func:`compile_for_orders` follows them. F, I and B need the weights (inside a frame); W may lie outside;
* d > 1, or a bidirectional placement (:attr:`Problem.replicas_synchronise`, also with d = 1):
  ``REDUCE_GRAD(s)`` (``costs.reduce_grad``) after every W (B when fused) of s; on a bidirectional
  placement also after those of the mirror replica's stage (both replicas' gradients are all-reduced
  together, BitPipe §3.3: the eager synchronisation); with sharding ``gradients``/``full`` it frees
  ``memory.gradients``·(d−1)/d;
* per rank ``OPTIMIZER_STEP`` (``costs.optimizer_step``) after the rank's REDUCE_GRADs and, unless
  ``training.post_validation``, after every other action of every rank (the global synchronisation: the
  simulator enforces it, see :attr:`Instance.sync_before_step`).

UNSHARD, RESHARD and REDUCE_GRAD run on the rank's communication stream (``stream`` 1); passes and the
optimizer step on its compute stream (``stream`` 0). ``compute`` counts the passes only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from pipesched.optimizer.ir import Action, ActionKind, Orders
from pipesched.optimizer.problem import Problem

__all__ = [
    "FrameError",
    "Instance",
    "backward_forms_of",
    "compile_for_orders",
    "compile_problem",
    "compute_instance",
    "frames_of",
]

Frames = dict[int, list[list[Action]]]
"""Per stage id, its frames in order, each the passes that run on gathered weights (module docstring)."""


class FrameError(ValueError):
    """A schedule's rows run a pass that needs a stage's weights outside every UNSHARD … RESHARD of the stage."""


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
        stream: index → 0 (compute stream) or 1 (communication stream); empty without step actions.
        has_step_actions: whether the problem has communication actions or optimizer steps.
        optimizer_steps: per rank, the index of its OPTIMIZER_STEP (empty without step actions).
        sync_before_step: whether every OPTIMIZER_STEP waits for every other action (no post-validation).
        num_passes: with step actions, how many passes come first in ``actions`` (−1 without).
        frames: with sharding ``full``, per stage id the passes of each UNSHARD … RESHARD frame.
        replica_wait: index → ms a collective's communication stream holds it, once it could start, before it runs
            (the wait for the last data-parallel replica: ``costs.unshard_wait`` / ``costs.reduce_grad_wait``);
            absent: 0.
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
    stream: list[int] = field(default_factory=list)
    has_step_actions: bool = False
    optimizer_steps: list[int] = field(default_factory=list)
    sync_before_step: bool = False
    num_passes: int = -1
    frames: Frames = field(default_factory=dict)
    replica_wait: dict[int, float] = field(default_factory=dict)

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

    def add(self, action: Action, rank: int, duration: float, delta: float) -> int:
        """Append ``action`` on ``rank`` (``duration`` ms, ``delta`` bytes), without dependencies; its index."""
        idx = len(self.actions)
        self.actions.append(action)
        self.index[action] = idx
        self.rank.append(rank)
        self.duration.append(duration)
        self.preds.append([])
        self.succs.append([])
        self.mem_delta.append(delta)
        self.rank_actions[rank].append(idx)
        return idx

    def link(self, before: int, after: int, latency: float = 0.0) -> None:
        """``after`` starts at least ``latency`` ms after ``before`` ends."""
        self.preds[after].append((before, latency))
        self.succs[before].append((after, latency))


def backward_forms_of(orders: Orders) -> dict[tuple[int, int], bool]:
    """Per (stage, microbatch) pair that ``orders`` runs a backward for: True when split (I or W), False when
    fused (B). A pair with both forms counts as split; the simulator then rejects its B as unknown.
    Communication actions and optimizer steps say nothing about the form (their ``microbatch`` is an
    occurrence, their ``stage`` a rank for OPTIMIZER_STEP) and are ignored."""
    forms: dict[tuple[int, int], bool] = {}
    for row in orders:
        for action in row:
            if action.kind == ActionKind.BACKWARD:
                forms.setdefault((action.stage, action.microbatch), False)
            elif action.kind in (ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT):
                forms[action.stage, action.microbatch] = True
    return forms


_WEIGHT_PASSES = (ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD)
"""The passes that compute with a stage's weights (W needs only the activations and the output gradient)."""


def frames_of(orders: Orders) -> Frames:
    """Per stage id that ``orders`` gather (UNSHARD), the passes of each frame: those of the stage between its
    n-th UNSHARD and n-th RESHARD on the rank's row (communication actions numbered per row as
    :func:`pipesched.optimizer.ir.parse_orders` numbers them). Empty when the orders hold no UNSHARD.

    Raises:
        FrameError: an F, I or B of a gathered stage outside all of the stage's frames, naming it and the rank.
    """
    frames: Frames = {}
    for rank, row in enumerate(orders):
        gathered = {action.stage for action in row if action.kind == ActionKind.UNSHARD}
        open_frame: dict[int, list[Action]] = {}
        for action in row:
            if action.kind == ActionKind.UNSHARD:
                open_frame[action.stage] = []
                frames.setdefault(action.stage, []).append(open_frame[action.stage])
            elif action.kind == ActionKind.RESHARD:
                open_frame.pop(action.stage, None)
            elif action.is_compute and action.stage in gathered:
                if action.stage in open_frame:
                    open_frame[action.stage].append(action)
                elif action.kind in _WEIGHT_PASSES:
                    raise FrameError(
                        f"rank {rank} runs {action} outside every {action.stage}UNSHARD … {action.stage}RESHARD: "
                        f"stage {action.stage}'s weights are not gathered then; move the pass between a gather and "
                        "its free, or add a gather before it"
                    )
    return frames


def _membership(frames: Frames) -> dict[int, list[frozenset[Action]]]:
    return {stage: [frozenset(frame) for frame in stage_frames] for stage, stage_frames in frames.items()}


def compile_for_orders(problem: Problem, orders: Orders, *, base: Instance | None = None) -> Instance:
    """:func:`compile_problem` with each pair's backward form (B, or I + W) and each stage's frames (sharding
    ``full``) taken from ``orders``; pairs the orders do not mention keep ``problem.split_backward``, orders
    without UNSHARD keep the default frames. ``base``, an instance of ``problem`` compiled before, is returned
    as it is when the orders' forms and frames are its own (no second compile).

    Raises:
        FrameError: see :func:`frames_of`.
    """
    forms = backward_forms_of(orders)
    frames = frames_of(orders) or None
    mixed = not all(split == problem.split_backward for split in forms.values())
    if base is not None and not mixed and (frames is None or _membership(frames) == _membership(base.frames)):
        return base
    return compile_problem(problem, backward_forms=forms if mixed else None, frames=frames)


def compile_problem(
    problem: Problem,
    *,
    step_actions: bool = True,
    backward_forms: Mapping[tuple[int, int], bool] | None = None,
    frames: Frames | None = None,
) -> Instance:
    """Index every action of ``problem`` with its rank, duration, dependencies and memory delta.

    ``step_actions=False`` leaves out the communication actions and optimizer steps (the passes only, as the
    compute-only generators and searches see the problem). ``backward_forms`` maps (stage id, microbatch) to
    True (split: I + W) or False (fused: B); pairs it omits follow ``problem.split_backward``.
    ``Instance.split_backward`` stays the problem's. ``frames`` (sharding ``full``): each stage's UNSHARD …
    RESHARD frames (:func:`frames_of`); ``None``: the default ones (module docstring)."""
    assert problem.costs is not None
    pipeline = problem.pipeline
    p, m, num_stages = pipeline.num_ranks, pipeline.num_microbatches, pipeline.num_stages
    ranks_of = pipeline.stage_to_rank
    if pipeline.placement == "bidirectional":
        replica0 = (m + 1) // 2
        chains = [
            list(range(num_stages)) if j < replica0 else list(range(num_stages, 2 * num_stages)) for j in range(m)
        ]
    else:
        chains = [list(range(num_stages)) for _ in range(m)]
    inst = Instance(
        problem=problem,
        num_ranks=p,
        num_microbatches=m,
        num_stages=num_stages,
        stage_ranks=ranks_of,
        model_stage=[s % num_stages for s in range(len(ranks_of))],
        chains=chains,
        split_backward=problem.split_backward,
        static=problem.static_memory,
        limit=problem.memory_limits,
        rank_actions=[[] for _ in range(p)],
        compute=[0.0] * p,
    )
    passes = _PassCosts.of(problem)
    for j, chain in enumerate(chains):
        _add_microbatch(inst, passes, j, chain, backward_forms)
    if step_actions and problem.has_step_actions:
        _add_step_actions(inst, problem, frames)
    return inst


@dataclass(frozen=True)
class _PassCosts:
    """Per model stage: F, I, W and p2p times (ms), the activation F allocates and what W still needs (bytes)."""

    forward: list[float]
    backward_input: list[float]
    backward_weight: list[float]
    p2p: list[float]
    activation: list[float]
    retained: list[float]

    @classmethod
    def of(cls, problem: Problem) -> _PassCosts:
        """The problem's per-stage values."""
        assert problem.costs is not None and problem.memory is not None
        costs, memory, values = problem.costs, problem.memory, problem.stage_values
        return cls(
            values(costs.forward),
            values(costs.backward_input),
            values(costs.backward_weight),
            values(costs.p2p),
            values(memory.activation),
            values(memory.retained_for_weight),
        )


def _add_pass(inst: Instance, action: Action, duration: float, delta: float) -> int:
    """A pass on its stage's rank, counted in the rank's compute time."""
    rank = inst.stage_ranks[action.stage]
    inst.compute[rank] += duration
    return inst.add(action, rank, duration, delta)


def _add_microbatch(
    inst: Instance, passes: _PassCosts, j: int, chain: list[int], backward_forms: Mapping[tuple[int, int], bool] | None
) -> None:
    """Microbatch ``j``'s passes along ``chain`` (backward split or fused per pair) and their dependencies: each
    forward after the previous stage's (plus p2p across ranks), each backward after the next stage's, the
    last stage's backward after its forward, W after its I."""
    model_stage, ranks_of, split = inst.model_stage, inst.stage_ranks, inst.split_backward
    fwd_ids: list[int] = []
    for stage in chain:
        ms = model_stage[stage]
        fwd_ids.append(_add_pass(inst, Action(stage, ActionKind.FORWARD, j), passes.forward[ms], passes.activation[ms]))
    bwd_ids: dict[int, int] = {}
    for stage in reversed(chain):
        ms = model_stage[stage]
        activation, retained = passes.activation[ms], passes.retained[ms]
        if split if backward_forms is None else backward_forms.get((stage, j), split):
            input_action = Action(stage, ActionKind.BACKWARD_INPUT, j)
            bwd_ids[stage] = _add_pass(inst, input_action, passes.backward_input[ms], -(activation - retained))
            weight_action = Action(stage, ActionKind.BACKWARD_WEIGHT, j)
            inst.link(bwd_ids[stage], _add_pass(inst, weight_action, passes.backward_weight[ms], -retained))
        else:
            duration = passes.backward_input[ms] + passes.backward_weight[ms]
            bwd_ids[stage] = _add_pass(inst, Action(stage, ActionKind.BACKWARD, j), duration, -activation)
    for k, stage in enumerate(chain):
        if k > 0:
            prev = chain[k - 1]
            latency = passes.p2p[model_stage[prev]] if ranks_of[prev] != ranks_of[stage] else 0.0
            inst.link(fwd_ids[k - 1], fwd_ids[k], latency)
        if k + 1 < len(chain):
            nxt = chain[k + 1]
            latency = passes.p2p[model_stage[nxt]] if ranks_of[nxt] != ranks_of[stage] else 0.0
            inst.link(bwd_ids[nxt], bwd_ids[stage], latency)
        else:
            inst.link(fwd_ids[k], bwd_ids[stage], 0.0)


def compute_instance(inst: Instance) -> Instance:
    """The passes of ``inst`` alone (what ``compile_problem(problem, step_actions=False)`` gives), cut from an
    instance with step actions without compiling again: they are indexed after every pass."""
    if not inst.has_step_actions:
        return inst
    n = inst.num_passes
    actions = inst.actions[:n]
    return replace(
        inst,
        actions=actions,
        index={action: i for i, action in enumerate(actions)},
        rank=inst.rank[:n],
        duration=inst.duration[:n],
        preds=[[(j, t) for j, t in row if j < n] for row in inst.preds[:n]],
        succs=[[(j, t) for j, t in row if j < n] for row in inst.succs[:n]],
        mem_delta=inst.mem_delta[:n],
        rank_actions=[[i for i in row if i < n] for row in inst.rank_actions],
        stream=[],
        has_step_actions=False,
        optimizer_steps=[],
        sync_before_step=False,
        num_passes=-1,
    )


def _default_frames(inst: Instance, stage_ids: range, reshard_after_forward: bool) -> Frames:
    """One frame of all of a stage's passes, or with ``reshard_after_forward`` its forwards then its backwards."""
    frames: Frames = {}
    for action in inst.actions:
        frame = 1 if reshard_after_forward and action.kind != ActionKind.FORWARD else 0
        stage_frames = frames.setdefault(action.stage, [[] for _ in range(2 if reshard_after_forward else 1)])
        stage_frames[frame].append(action)
    return {s: frames.get(s, [[]]) for s in stage_ids}


def _add_step_actions(inst: Instance, problem: Problem, frames: Frames | None = None) -> None:
    """Communication actions and optimizer steps (module docstring), appended after the passes."""
    assert problem.costs is not None
    inst.stream = [0] * len(inst.actions)
    inst.num_passes = len(inst.actions)
    inst.has_step_actions = True
    inst.sync_before_step = not problem.training.post_validation
    collectives = _Collectives.of(problem, inst.num_stages)
    stage_ids = range(len(inst.stage_ranks))
    microbatches = {s: [j for j, chain in enumerate(inst.chains) if s in chain] for s in stage_ids}
    if collectives.sharding == "full":
        # Stages the given frames leave out keep the default ones (their missing UNSHARD is then reported).
        inst.frames = _default_frames(inst, stage_ids, collectives.reshard_after_forward) | (frames or {})
    reduce_ids: dict[int, int] = {}
    for s in stage_ids:
        reduce = _add_stage_collectives(inst, collectives, s, microbatches[s])
        if reduce is not None:
            reduce_ids[s] = reduce
    if problem.pipeline.placement == "bidirectional" and reduce_ids:
        for s in stage_ids:
            mirror = s + inst.num_stages if s < inst.num_stages else s - inst.num_stages
            for j in microbatches[mirror]:
                inst.link(_pass_id(inst, mirror, j, *_FINAL_KINDS), reduce_ids[s])
    optimizer_step = problem.rank_values(problem.costs.optimizer_step, 0.0)
    for rank in range(inst.num_ranks):
        step = _add_step_action(inst, Action(rank, ActionKind.OPTIMIZER_STEP, 0), rank, optimizer_step[rank], 0.0, 0)
        inst.optimizer_steps.append(step)
        for s, idx in reduce_ids.items():
            if inst.stage_ranks[s] == rank:
                inst.link(idx, step)


@dataclass(frozen=True)
class _Collectives:
    """The data-parallel group and, per model stage, its collectives' times (ms) and the bytes they hold/free."""

    size: int
    sharding: str
    reshard_after_forward: bool
    reduces: bool
    unshard: list[float]
    reduce_grad: list[float]
    unshard_wait: list[float]
    reduce_grad_wait: list[float]
    weights: list[float]
    gradients: list[float]

    @classmethod
    def of(cls, problem: Problem, num_stages: int) -> _Collectives:
        """The problem's (zeros where a cost or size is not given)."""
        assert problem.costs is not None and problem.memory is not None
        costs, memory, group = problem.costs, problem.memory, problem.data_parallel_group

        def values(value: float | list[float] | None) -> list[float]:
            return problem.stage_values(value) if value is not None else [0.0] * num_stages

        return cls(
            size=group.size,
            sharding=group.sharding,
            reshard_after_forward=group.reshard_after_forward,
            reduces=group.size > 1 or problem.replicas_synchronise,
            unshard=values(costs.unshard),
            reduce_grad=values(costs.reduce_grad),
            unshard_wait=values(costs.unshard_wait),
            reduce_grad_wait=values(costs.reduce_grad_wait),
            weights=values(memory.weights),
            gradients=values(memory.gradients),
        )


_FINAL_KINDS = (ActionKind.BACKWARD_WEIGHT, ActionKind.BACKWARD)


def _pass_id(inst: Instance, stage: int, microbatch: int, *kinds: ActionKind) -> int:
    """The first of ``kinds`` the pair has: its backward form may be split or fused (:func:`compile_for_orders`)."""
    for kind in kinds:
        idx = inst.index.get(Action(stage, kind, microbatch))
        if idx is not None:
            return idx
    raise KeyError((stage, kinds, microbatch))


def _add_step_action(inst: Instance, action: Action, rank: int, duration: float, delta: float, stream: int) -> int:
    """A communication action (stream 1) or optimizer step (stream 0) on ``rank``."""
    idx = inst.add(action, rank, duration, delta)
    inst.stream.append(stream)
    return idx


def _wait_for_replicas(inst: Instance, idx: int, wait_ms: float) -> None:
    """The collective ``idx`` starts ``wait_ms`` after it could (:attr:`Instance.replica_wait`)."""
    if wait_ms > 0:
        inst.replica_wait[idx] = wait_ms


def _add_stage_collectives(inst: Instance, group: _Collectives, s: int, microbatches: list[int]) -> int | None:
    """Stage ``s``'s UNSHARD/RESHARD frames (sharding ``full``: :attr:`Instance.frames`, each gathered before its
    passes and freed after them, one after the other) and REDUCE_GRAD (after its last backward: d > 1, or the
    replicas' synchronisation of a bidirectional placement); the REDUCE_GRAD's index, or ``None``."""
    rank, ms = inst.stage_ranks[s], inst.model_stage[s]
    fraction = (group.size - 1) / group.size
    finals = [_pass_id(inst, s, j, *_FINAL_KINDS) for j in microbatches]
    if group.sharding == "full":
        held = group.weights[ms] * fraction
        previous = -1
        for n, frame in enumerate(inst.frames[s]):
            gather = _add_step_action(inst, Action(s, ActionKind.UNSHARD, n), rank, group.unshard[ms], held, 1)
            _wait_for_replicas(inst, gather, group.unshard_wait[ms])
            free = _add_step_action(inst, Action(s, ActionKind.RESHARD, n), rank, 0.0, -held, 1)
            if previous >= 0:
                inst.link(previous, gather)
            for action in frame:
                inst.link(gather, inst.index[action])
                inst.link(inst.index[action], free)
            previous = free
    if not group.reduces:
        return None
    freed = -group.gradients[ms] * fraction if group.sharding in ("gradients", "full") else 0.0
    reduce = _add_step_action(inst, Action(s, ActionKind.REDUCE_GRAD, 0), rank, group.reduce_grad[ms], freed, 1)
    _wait_for_replicas(inst, reduce, group.reduce_grad_wait[ms])
    for idx in finals:
        inst.link(idx, reduce)
    return reduce
