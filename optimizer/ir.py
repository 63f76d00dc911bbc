"""The schedule IR: actions and per-rank orders.

An action is one pass of one microbatch through one stage, written as PyTorch's
``torch.distributed.pipelining`` writes it: ``"{stage}{kind}{microbatch}"``, e.g. ``"3F12"``.
A schedule is a list with one ordered list of actions per rank.

Data parallelism adds communication actions, written as PyTorch writes them (``_Action.__repr__`` in
``torch/distributed/pipelining/schedules.py``): ``"{stage}UNSHARD"``, ``"{stage}RESHARD"``,
``"{stage}REDUCE_GRAD"``, and the per-rank ``"OPTIMIZER_STEP"`` (pipesched's own; torch's lowering has none).
They carry no microbatch. Internally a stage's second UNSHARD/RESHARD pair (``reshard_after_forward``) has
``microbatch`` 1 (its occurrence), and OPTIMIZER_STEP has ``stage`` = its rank (:func:`parse_orders`
fills it in; a lone :func:`parse_action` gives −1).
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import NamedTuple

__all__ = [
    "COMMUNICATION_KINDS",
    "COMPUTE_KINDS",
    "Action",
    "ActionKind",
    "Orders",
    "compute_only",
    "format_orders",
    "parse_action",
    "parse_orders",
]


class ActionKind(StrEnum):
    """F forward · I backward for the input gradient · W backward for the weight gradient · B fused."""

    FORWARD = "F"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    BACKWARD = "B"
    UNSHARD = "UNSHARD"
    RESHARD = "RESHARD"
    REDUCE_GRAD = "REDUCE_GRAD"
    OPTIMIZER_STEP = "OPTIMIZER_STEP"

    def __str__(self) -> str:
        return self.value


F = ActionKind.FORWARD
I = ActionKind.BACKWARD_INPUT  # noqa: E741 - the field's own letter
W = ActionKind.BACKWARD_WEIGHT
B = ActionKind.BACKWARD

#: The passes that run on a rank's compute stream (OPTIMIZER_STEP runs there too, once per rank).
COMPUTE_KINDS = frozenset({F, I, W, B})
#: The data-parallel collectives and the weight free, on a rank's communication stream.
COMMUNICATION_KINDS = frozenset({ActionKind.UNSHARD, ActionKind.RESHARD, ActionKind.REDUCE_GRAD})

_ACTION_RE = re.compile(r"(0|[1-9][0-9]*)([FIWB])(0|[1-9][0-9]*)")
_COMM_RE = re.compile(r"(0|[1-9][0-9]*)(UNSHARD|RESHARD|REDUCE_GRAD)")
_OPTIMIZER_STEP = "OPTIMIZER_STEP"


class Action(NamedTuple):
    """One pass: ``stage`` (0-based stage id), ``kind``, ``microbatch`` (0-based)."""

    stage: int
    kind: ActionKind
    microbatch: int

    def __str__(self) -> str:
        if self.kind in COMPUTE_KINDS:
            return f"{self.stage}{self.kind.value}{self.microbatch}"
        if self.kind == ActionKind.OPTIMIZER_STEP:
            return _OPTIMIZER_STEP
        return f"{self.stage}{self.kind.value}"

    @property
    def is_compute(self) -> bool:
        """Whether this is a pass (F, I, W, B) of one microbatch through one stage."""
        return self.kind in COMPUTE_KINDS

    def __repr__(self) -> str:
        return f"Action({self})"


def parse_action(text: str) -> Action:
    """Parse ``"3F12"`` strictly.

    Also ``"3UNSHARD"``, ``"3RESHARD"``, ``"3REDUCE_GRAD"`` (microbatch 0) and ``"OPTIMIZER_STEP"``
    (stage −1: :func:`parse_orders` sets it to the rank).

    Raises:
        ValueError: for anything but digits, one of F/I/W/B, digits (``"0F1x"``, ``" 0F1"``,
            ``"01F1"`` and ``"0SEND_F1"`` are rejected, unlike PyTorch's lenient parser), or a stage and
            UNSHARD/RESHARD/REDUCE_GRAD with nothing after it (``"0UNSHARD1"`` is rejected).
    """
    match = _ACTION_RE.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        comm = _COMM_RE.fullmatch(text) if isinstance(text, str) else None
        if comm is not None:
            return Action(int(comm.group(1)), ActionKind(comm.group(2)), 0)
        if text == _OPTIMIZER_STEP:
            return Action(-1, ActionKind.OPTIMIZER_STEP, 0)
        raise ValueError(
            f"{text!r} is not an action: write {{stage}}{{kind}}{{microbatch}} with kind one of F, I, W, B "
            '(e.g. "3F12"), or {stage}UNSHARD, {stage}RESHARD, {stage}REDUCE_GRAD, OPTIMIZER_STEP'
        )
    return Action(int(match.group(1)), ActionKind(match.group(2)), int(match.group(3)))


Orders = list[list[Action]]
"""One ordered action list per rank: ``orders[rank][k]`` is the k-th action rank runs."""


def parse_orders(rows: list[list[str]]) -> Orders:
    """Parse one list of action strings per rank.

    Raises:
        ValueError: naming the rank and position of the first malformed action.

    Communication actions get their internal identity here: a stage's n-th UNSHARD (RESHARD) in the row
    has ``microbatch`` n, and OPTIMIZER_STEP has ``stage`` = the rank.
    """
    orders: Orders = []
    for rank, row in enumerate(rows):
        parsed = []
        seen: dict[tuple[int, ActionKind], int] = {}
        for position, text in enumerate(row):
            try:
                action = parse_action(text)
            except ValueError as error:
                raise ValueError(f"rank {rank}, position {position}: {error}") from None
            parsed.append(_identify(action, rank, seen))
        orders.append(parsed)
    return orders


def _identify(action: Action, rank: int, seen: dict[tuple[int, ActionKind], int]) -> Action:
    """Number repeated UNSHARD/RESHARD of a stage within a row; give OPTIMIZER_STEP its rank."""
    if action.kind == ActionKind.OPTIMIZER_STEP:
        return Action(rank, action.kind, 0)
    if action.kind in (ActionKind.UNSHARD, ActionKind.RESHARD):
        key = (action.stage, action.kind)
        occurrence = seen.get(key, 0)
        seen[key] = occurrence + 1
        return Action(action.stage, action.kind, occurrence)
    return action


def compute_only(orders: Orders) -> Orders:
    """The passes of every rank, communication actions and optimizer steps removed."""
    return [[action for action in row if action.is_compute] for row in orders]


def format_orders(orders: Orders) -> list[list[str]]:
    """The string form of every action, rank by rank."""
    return [[str(action) for action in row] for row in orders]
