"""Schedule exports: PyTorch's compute-only CSV and helpers shared by the other formats."""

from __future__ import annotations

import csv
import io

from optimizer.ir import Orders

__all__ = ["orders_to_torch_csv", "torch_csv_to_orders"]


def orders_to_torch_csv(orders: Orders) -> str:
    """PyTorch's compute-only schedule CSV: one row per rank, one action string per cell.

    Loadable by ``_PipelineScheduleRuntime._load_csv(path, "compute_only")`` and torchtitan's
    ``--parallelism.pipeline_parallel_schedule_csv`` (``shared/NOTES.md`` §3).
    """
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    for row in orders:
        writer.writerow([str(action) for action in row])
    return buffer.getvalue()


def torch_csv_to_orders(text: str) -> list[list[str]]:
    """Rows of action strings from a compute-only CSV (blank cells dropped)."""
    return [[cell.strip() for cell in row if cell.strip()] for row in csv.reader(io.StringIO(text))]
