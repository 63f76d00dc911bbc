"""Shared helper: generate a schedule for more microbatches than asked, then drop the extra ones."""

from __future__ import annotations

from pipesched.optimizer.ir import Orders

__all__ = ["drop_microbatches"]


def drop_microbatches(orders: Orders, num_microbatches: int) -> Orders:
    """Remove every action of microbatch ``≥ num_microbatches`` from per-rank orders.

    If ``orders`` runs without deadlock, so does the result: each rank's remaining actions keep their
    relative order, and every dependency between remaining actions was already respected (dropping
    nodes from an acyclic precedence graph keeps it acyclic). Peak memory cannot grow.
    """
    return [[action for action in row if action.microbatch < num_microbatches] for row in orders]
