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
* ``{s}UNSHARD`` (sharding ``full``) once per step, issued ``prefetch`` stages ahead: before the first pass of
  the stage the rank uses ``prefetch`` stages earlier (at the row's start for the first ones), and
  ``{s}RESHARD`` right after the stage's last backward: FSDP2 under pipelining with
  ``reshard_after_forward=False``, as torchtitan configures it, with torch's prefetch of upcoming stages
  (``max_active_stages``). Unlike torch's window of 3 stages, a stage is never evicted and gathered again
  within a step (breadth-first's "gather once per batch").
* With ``reshard_after_forward`` the weights are freed after a stage's last forward and gathered again for its
  backwards (``prefetch`` stages ahead in backward order, never before that RESHARD): only schedules that run
  every forward of a stage before its first backward (GPipe, breadth-first, LGA) admit it.
* ``OPTIMIZER_STEP`` ends every rank's row.

``reduce_after_flush=True`` instead issues every REDUCE_GRAD after the rank's last pass, in the order the
stages finished: Megatron-LM before ``overlap_grad_reduce`` (the data-parallel all-reduce ran after
``forward_backward_func`` returned, i.e. after the flush), the baseline of the breadth-first paper.
"""

from __future__ import annotations

from pipesched.optimizer.instance import Instance
from pipesched.optimizer.ir import Action, ActionKind, Orders

__all__ = ["ReshardOrderError", "add_communication", "with_communication"]


class ReshardOrderError(ValueError):
    """``reshard_after_forward`` with a schedule that interleaves a stage's forwards and backwards."""


def _stage_sequence(row: list[Action], kinds: set[ActionKind]) -> list[tuple[int, int]]:
    """``(stage, position of its first pass of these kinds)`` in order of first use."""
    first: dict[int, int] = {}
    for position, action in enumerate(row):
        if action.kind in kinds and action.stage not in first:
            first[action.stage] = position
    return sorted(((stage, pos) for stage, pos in first.items()), key=lambda item: item[1])


def _place_gather(
    slots: tuple[list[Action], dict[int, list[Action]], dict[int, list[Action]]],
    index: dict[Action, int],
    stage: int,
    occurrence: int,
    sequence: list[tuple[int, int]],
    floor: int,
    prefetch: int,
) -> None:
    """Issue the stage's gather ``prefetch`` stages ahead in ``sequence``, never before position ``floor``."""
    head, before, after = slots
    gather = Action(stage, ActionKind.UNSHARD, occurrence)
    if gather not in index:
        return
    stages = [s for s, _ in sequence]
    if stage not in stages or (stages.index(stage) < prefetch and floor < 0):
        (head if floor < 0 else after.setdefault(floor, [])).append(gather)
        return
    target = sequence[max(0, stages.index(stage) - prefetch)][1]
    if floor >= 0 and target <= floor:
        after.setdefault(floor, []).append(gather)
    else:
        before.setdefault(target, []).append(gather)


def add_communication(inst: Instance, orders: Orders, *, prefetch: int = 1, reduce_after_flush: bool = False) -> Orders:
    """Insert UNSHARD/RESHARD/REDUCE_GRAD and OPTIMIZER_STEP into compute-only ``orders`` (module docstring).

    Args:
        inst: the compiled problem (its step actions say which collectives exist).
        orders: per rank, passes only (F, I, W, B).
        prefetch: how many stages ahead an UNSHARD is issued (0: right before the stage's first pass).
        reduce_after_flush: issue every REDUCE_GRAD after the rank's last pass (module docstring).

    Returns:
        New per-rank orders holding every action of ``inst``; ``orders`` unchanged when the problem has no
        step actions.

    Raises:
        ReshardOrderError: with ``reshard_after_forward``, when a stage's last forward comes after its first
            backward on the rank.
    """
    if not inst.has_step_actions:
        return [list(row) for row in orders]
    index = inst.index
    final_kind = ActionKind.BACKWARD_WEIGHT if inst.split_backward else ActionKind.BACKWARD
    problem = inst.problem
    reshard_after_forward = problem.data_parallel is not None and problem.data_parallel.reshard_after_forward
    result: Orders = []
    for rank, row in enumerate(orders):
        before: dict[int, list[Action]] = {}
        after: dict[int, list[Action]] = {}
        head: list[Action] = []
        tail: list[Action] = []
        slots = (head, before, after)
        local = sorted({s for s, r in enumerate(inst.stage_ranks) if r == rank})
        last_final: dict[int, int] = {}
        last_forward: dict[int, int] = {}
        for position, action in enumerate(row):
            if action.kind == final_kind:
                last_final[action.stage] = position
            elif action.kind == ActionKind.FORWARD:
                last_forward[action.stage] = position

        forward_sequence = _stage_sequence(row, {ActionKind.FORWARD})
        backward_sequence = _stage_sequence(row, {inst.backward_kind})
        for stage in [s for s, _ in forward_sequence] + [s for s in local if s not in dict(forward_sequence)]:
            _place_gather(slots, index, stage, 0, forward_sequence, -1, prefetch)
        flushed: list[tuple[int, Action]] = []
        for stage in local:
            finals = last_final.get(stage)
            reduce = Action(stage, ActionKind.REDUCE_GRAD, 0)
            first_reshard = Action(stage, ActionKind.RESHARD, 0)
            if reshard_after_forward and first_reshard in index:
                first_backward = dict(backward_sequence).get(stage)
                forward_end = last_forward.get(stage)
                if forward_end is not None and first_backward is not None and forward_end > first_backward:
                    raise ReshardOrderError(
                        f"reshard_after_forward frees stage {stage}'s weights after its forwards and gathers them "
                        f"again for its backwards, but rank {rank} runs a backward of stage {stage} before its "
                        "last forward: use a schedule that runs every forward of a stage before its first "
                        "backward (gpipe, looped-bfs, lga), or set data_parallel.reshard_after_forward to false"
                    )
                if forward_end is None:
                    tail.append(first_reshard)
                else:
                    after.setdefault(forward_end, []).append(first_reshard)
                _place_gather(
                    slots, index, stage, 1, backward_sequence, -1 if forward_end is None else forward_end, prefetch
                )
                last_reshard = Action(stage, ActionKind.RESHARD, 1)
            else:
                last_reshard = first_reshard
            for action in (reduce, last_reshard):
                if action not in index:
                    continue
                if reduce_after_flush and action.kind == ActionKind.REDUCE_GRAD:
                    flushed.append((-1 if finals is None else finals, action))
                elif finals is None:
                    tail.append(action)
                else:
                    after.setdefault(finals, []).append(action)
        new_row: list[Action] = list(head)
        for position, action in enumerate(row):
            new_row.extend(before.get(position, []))
            new_row.append(action)
            new_row.extend(after.get(position, []))
        new_row.extend(tail)
        new_row.extend(action for _, action in sorted(flushed))
        new_row.append(Action(rank, ActionKind.OPTIMIZER_STEP, 0))
        result.append(new_row)
    return result


def with_communication(inst: Instance, orders: Orders, *, prefetch: int = 1) -> Orders:
    """``orders`` as they are when they already hold communication actions or the problem has none; else
    :func:`add_communication`."""
    if not inst.has_step_actions or any(not action.is_compute for row in orders for action in row):
        return [list(row) for row in orders]
    return add_communication(inst, orders, prefetch=prefetch)
