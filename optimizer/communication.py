"""The communication pass: place a step's collectives and optimizer steps into compute-only orders.

One list→list function per rank, as PyTorch lowers a compute-only schedule (``_add_unshard_reshard`` then
``_add_reduce_grad`` in ``torch/distributed/pipelining/schedules.py``, torch 2.13), applied to every family
and to ``auto``'s orders; the simulator then times the result with the communication stream:

* ``{s}REDUCE_GRAD`` right after stage s's last backward on the rank (its last W, or B when fused), as
  torch's ``_add_reduce_grad`` does and as Breadth-First PP (Lamy-Poirier 2022, Sec. 4) and LGA (Lamy-Poirier
  2021, Sec. 3) prescribe; Megatron-LM's ``overlap_grad_reduce`` launches a chunk's reduction when its last
  microbatch's backward is done, the same point. Which schedule hides it is then the compute order's doing:
  breadth-first ends a stage's backwards early, depth-first interleaving ends all of them at the flush.
  On a bidirectional placement (BitPipe, Wu et al. 2024, Sec. 3.3) the instance makes it wait for the mirror
  replica too: the eager all-reduce of a chunk as soon as both replicas finished it.
* ``{s}UNSHARD``/``{s}RESHARD`` (sharding ``full``) frame the passes that compute with the stage's weights
  (:mod:`pipesched.optimizer.instance`, frames). The rank's passes fall into *groups*, each framed by one
  gather and one free:

  - without ``reshard_after_forward``: one group per stage, all its passes (FSDP2 under pipelining with
    ``reshard_after_forward=False``, as torchtitan configures it; a stage is never evicted and gathered again
    within a step, unlike torch's window of 3 stages);
  - with ``reshard_after_forward``, per pass (``gather_runs=False``, the default): every F, I and B of the
    stage is its own group, freed right after it and gathered again for the next (FSDP2's
    ``reshard_after_forward=True``: a depth-first schedule re-gathers per microbatch, 2m gathers per stage);
  - with ``reshard_after_forward`` and ``gather_runs=True``: a group is a run of the stage's passes with no
    pass of another stage between them that needs its weights (W needs none): breadth-first and LGA keep a
    stage gathered over all its microbatches in a row, so it is gathered once for its forwards and once for
    its backwards (Lamy-Poirier 2022, Sec. 4: "gather once per batch"). With a ``model``, only stages of one
    transformer layer keep runs: the model counts two FSDP units gathered under ``reshard_after_forward``,
    which is the whole stage there and not for longer stages (those are gathered per pass).

  A group's gather is issued ``prefetch`` groups ahead in the rank's order of groups (before the first pass of
  that earlier group; at the row's start for the first ones), never before the stage's previous free, which
  sits right after the previous group's last pass. The stage is one unit in the time model: a gather between
  two consecutive passes of the same stage is exposed, where FSDP2's per-block units overlap all but the first
  block's gather (an upper bound on the cost of re-gathering).
* ``OPTIMIZER_STEP`` ends every rank's row.

``reduce_after_flush=True`` (the problem's ``data_parallel.overlap_grad_reduce: false``) instead issues every
REDUCE_GRAD after the rank's last pass, in the order the stages finished: Megatron-LM before
``overlap_grad_reduce`` (the data-parallel all-reduce ran after ``forward_backward_func`` returned, i.e. after
the flush), the baseline of the breadth-first paper.
"""

from __future__ import annotations

from pipesched.optimizer.instance import Instance
from pipesched.optimizer.ir import Action, ActionKind, Orders

__all__ = ["add_communication", "pass_groups", "with_communication"]

_WEIGHT_PASSES = (ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD)
_FINAL_KINDS = (ActionKind.BACKWARD_WEIGHT, ActionKind.BACKWARD)
# At one slot of a row: a stage's reduction, then frees, then gathers (a stage's free before its next gather).
_REDUCE, _FREE, _GATHER = 0, 1, 2


def pass_groups(
    row: list[Action], *, reshard_after_forward: bool, gather_runs: bool | frozenset[int]
) -> list[tuple[int, int, int]]:
    """The rank's groups of passes that share one gather (module docstring), ``(stage, first position, last
    position)`` in ``row``, ordered by first position. ``gather_runs`` may name the stages that keep runs (the
    others are gathered per pass)."""
    groups: list[list[int]] = []  # [stage, first, last]
    if not reshard_after_forward:
        by_stage: dict[int, list[int]] = {}
        for position, action in enumerate(row):
            if action.is_compute:
                group = by_stage.setdefault(action.stage, [action.stage, position, position])
                group[2] = position
        groups = list(by_stage.values())
    elif not gather_runs:
        groups = [[a.stage, k, k] for k, a in enumerate(row) if a.kind in _WEIGHT_PASSES]
    else:
        current: dict[int, list[int]] = {}  # the open run of each stage
        for position, action in enumerate(row):
            if action.kind not in _WEIGHT_PASSES:
                if action.is_compute and action.stage in current:
                    current[action.stage][2] = position  # a W inside its stage's run
                continue
            if gather_runs is not True and action.stage not in gather_runs:
                groups.append([action.stage, position, position])
                continue
            for stage in [s for s in current if s != action.stage]:
                del current[stage]  # another stage's pass that needs weights ends the run
            if action.stage in current:
                current[action.stage][2] = position
            else:
                current[action.stage] = [action.stage, position, position]
                groups.append(current[action.stage])
    return sorted(((stage, first, last) for stage, first, last in groups), key=lambda group: group[1])


def _frame_slots(
    row: list[Action], groups: list[tuple[int, int, int]], prefetch: int
) -> list[tuple[int, int, int, Action]]:
    """``(position, before 0 / after 1, order, action)`` of every UNSHARD and RESHARD (module docstring)."""
    slots: list[tuple[int, int, int, Action]] = []
    previous_last: dict[int, int] = {}
    occurrence: dict[int, int] = {}
    for k, (stage, _first, last) in enumerate(groups):
        n = occurrence.get(stage, 0)
        occurrence[stage] = n + 1
        gather = Action(stage, ActionKind.UNSHARD, n)
        floor = previous_last.get(stage)
        target = groups[k - prefetch][1] if k >= prefetch else -1
        if floor is not None and target <= floor:
            slots.append((floor, 1, _GATHER, gather))  # right after the stage's previous free
        elif target < 0:
            slots.append((-1, 1, _GATHER, gather))  # the row's start
        else:
            slots.append((target, 0, _GATHER, gather))
        slots.append((last, 1, _FREE, Action(stage, ActionKind.RESHARD, n)))
        previous_last[stage] = last
    return slots


def _run_stages(inst: Instance) -> bool | frozenset[int]:
    """The stages that may stay gathered over a run of passes: all without a model; with one, the stages of
    one transformer layer (with the embedding or the head: at most two FSDP units), whose ``memory.weights``
    under ``reshard_after_forward`` (two units) is the whole stage. A longer stage kept gathered would hold more
    than the model counts, so it is gathered per pass."""
    model = inst.problem.model
    layers = model.layers_per_stage if model is not None else None
    if layers is None:
        return True
    return frozenset(s for s, ms in enumerate(inst.model_stage) if layers[ms] <= 1)


def add_communication(
    inst: Instance,
    orders: Orders,
    *,
    prefetch: int = 1,
    reduce_after_flush: bool | None = None,
    gather_runs: bool = False,
) -> Orders:
    """Insert UNSHARD/RESHARD/REDUCE_GRAD and OPTIMIZER_STEP into compute-only ``orders`` (module docstring).

    Args:
        inst: the compiled problem (its step actions say which collectives exist).
        orders: per rank, passes only (F, I, W, B).
        prefetch: how many groups ahead a gather is issued (0: right before the group's first pass).
        reduce_after_flush: issue every REDUCE_GRAD after the rank's last pass (module docstring); ``None``:
            as the problem says (``data_parallel.overlap_grad_reduce`` false).
        gather_runs: with ``reshard_after_forward``, one gather per run of a stage's passes (breadth-first)
            instead of one per pass (FSDP2).

    Returns:
        New per-rank orders holding every action of the problem's step; ``orders`` unchanged when the problem
        has no step actions. Compile them with :func:`pipesched.optimizer.instance.compile_for_orders` (their
        frames may differ from ``inst``'s default ones).
    """
    if not inst.has_step_actions:
        return [list(row) for row in orders]
    problem = inst.problem
    dp = problem.data_parallel
    if reduce_after_flush is None:
        reduce_after_flush = dp is not None and not dp.overlap_grad_reduce
    gathers = dp is not None and dp.sharding == "full" and dp.size > 1
    reduces = problem.data_parallel_size > 1 or problem.replicas_synchronise
    result: Orders = []
    for rank, row in enumerate(orders):
        slots: list[tuple[int, int, int, Action]] = []
        if gathers:
            assert dp is not None
            runs = _run_stages(inst) if gather_runs else False
            groups = pass_groups(row, reshard_after_forward=dp.reshard_after_forward, gather_runs=runs)
            slots += _frame_slots(row, groups, prefetch)
        last_final: dict[int, int] = {}
        for position, action in enumerate(row):
            if action.kind in _FINAL_KINDS:
                last_final[action.stage] = position
        flushed: list[tuple[int, Action]] = []
        for stage in sorted(s for s, r in enumerate(inst.stage_ranks) if r == rank) if reduces else []:
            reduce = Action(stage, ActionKind.REDUCE_GRAD, 0)
            finals = last_final.get(stage, len(row) - 1)
            if reduce_after_flush:
                flushed.append((finals, reduce))
            else:
                slots.append((finals, 1, _REDUCE, reduce))
        new_row: list[Action] = [a for pos, _, _, a in sorted(slots, key=lambda x: x[:3]) if pos < 0]
        before: dict[int, list[Action]] = {}
        after: dict[int, list[Action]] = {}
        for position, side, _, action in sorted(slots, key=lambda x: x[:3]):
            if position >= 0:
                (after if side else before).setdefault(position, []).append(action)
        for position, action in enumerate(row):
            new_row.extend(before.get(position, []))
            new_row.append(action)
            new_row.extend(after.get(position, []))
        new_row.extend(action for _, action in sorted(flushed))
        new_row.append(Action(rank, ActionKind.OPTIMIZER_STEP, 0))
        result.append(new_row)
    return result


def with_communication(inst: Instance, orders: Orders, *, prefetch: int = 1, gather_runs: bool = False) -> Orders:
    """``orders`` as they are when they already hold communication actions or the problem has none; else
    :func:`add_communication`."""
    if not inst.has_step_actions or any(not action.is_compute for row in orders for action in row):
        return [list(row) for row in orders]
    return add_communication(inst, orders, prefetch=prefetch, gather_runs=gather_runs)
