"""The schedule IR: actions and per-rank orders.

An action is one pass of one microbatch through one stage, written as PyTorch's
``torch.distributed.pipelining`` writes it: ``"{stage}{kind}{microbatch}"``, e.g. ``"3F12"``.
A schedule is a list with one ordered list of actions per rank.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import NamedTuple

__all__ = ["Action", "ActionKind", "Orders", "format_orders", "parse_action", "parse_orders"]


class ActionKind(StrEnum):
    """F forward · I backward for the input gradient · W backward for the weight gradient · B fused."""

    FORWARD = "F"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    BACKWARD = "B"

    def __str__(self) -> str:
        return self.value


F = ActionKind.FORWARD
I = ActionKind.BACKWARD_INPUT  # noqa: E741 - the field's own letter
W = ActionKind.BACKWARD_WEIGHT
B = ActionKind.BACKWARD

_ACTION_RE = re.compile(r"(0|[1-9][0-9]*)([FIWB])(0|[1-9][0-9]*)")


class Action(NamedTuple):
    """One pass: ``stage`` (0-based stage id), ``kind``, ``microbatch`` (0-based)."""

    stage: int
    kind: ActionKind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({self})"


def parse_action(text: str) -> Action:
    """Parse ``"3F12"`` strictly.

    Raises:
        ValueError: for anything but digits, one of F/I/W/B, digits (``"0F1x"``, ``" 0F1"``,
            ``"01F1"`` and ``"0SEND_F1"`` are rejected, unlike PyTorch's lenient parser).
    """
    match = _ACTION_RE.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise ValueError(
            f'{text!r} is not an action: write {{stage}}{{kind}}{{microbatch}} with kind one of F, I, W, B, e.g. "3F12"'
        )
    return Action(int(match.group(1)), ActionKind(match.group(2)), int(match.group(3)))


Orders = list[list[Action]]
"""One ordered action list per rank: ``orders[rank][k]`` is the k-th action rank runs."""


def parse_orders(rows: list[list[str]]) -> Orders:
    """Parse one list of action strings per rank.

    Raises:
        ValueError: naming the rank and position of the first malformed action.
    """
    orders: Orders = []
    for rank, row in enumerate(rows):
        parsed = []
        for position, text in enumerate(row):
            try:
                parsed.append(parse_action(text))
            except ValueError as error:
                raise ValueError(f"rank {rank}, position {position}: {error}") from None
        orders.append(parsed)
    return orders


def format_orders(orders: Orders) -> list[list[str]]:
    """The string form of every action, rank by rank."""
    return [[str(action) for action in row] for row in orders]
