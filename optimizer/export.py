"""Schedule exports: PyTorch's compute-only CSV and helpers shared by the other formats."""

from __future__ import annotations

import csv
import io
from typing import TYPE_CHECKING, Any

from pipesched.optimizer.ir import Orders

if TYPE_CHECKING:
    from pipesched.optimizer.result import Schedule

__all__ = ["orders_to_torch_csv", "run_report_to_chrome_trace", "schedule_to_chrome_trace", "torch_csv_to_orders"]


def orders_to_torch_csv(orders: Orders) -> str:
    """PyTorch's compute-only schedule CSV: one row per rank, one action string per cell.

    Loadable by ``_PipelineScheduleRuntime._load_csv(path, "compute_only")`` and torchtitan's
    ``--parallelism.pipeline_parallel_schedule_csv`` (torchtitan ``build_pipeline_schedule`` in
    ``torchtitan/distributed/pipeline_parallel.py``). Communication actions and optimizer steps
    are left out (the format is compute-only; torch's lowering inserts its own UNSHARD, RESHARD and
    REDUCE_GRAD).
    """
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    for row in orders:
        writer.writerow([str(action) for action in row if action.is_compute])
    return buffer.getvalue()


def torch_csv_to_orders(text: str) -> list[list[str]]:
    """Rows of action strings from a compute-only CSV (blank cells dropped)."""
    return [[cell.strip() for cell in row if cell.strip()] for row in csv.reader(io.StringIO(text))]


# --- Chrome trace (Perfetto, chrome://tracing): the Trace Event Format's JSON object form --------------------


def _trace_process(events: list[dict[str, Any]], pid: int, name: str) -> None:
    events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}})
    events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
    events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 0, "args": {"name": "compute"}})
    events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 1, "args": {"name": "communication"}})


def _trace_action(pid: int, text: str, trace_start_ms: float, trace_end_ms: float, **args: Any) -> dict[str, Any]:
    from pipesched.optimizer.ir import COMMUNICATION_KINDS, ActionKind, parse_action

    action = parse_action(text)
    if action.is_compute:
        name, stage, microbatch = (
            f"{action.kind.value}{action.microbatch} (stage {action.stage})",
            action.stage,
            action.microbatch,
        )
    elif action.kind == ActionKind.OPTIMIZER_STEP:
        name, stage, microbatch = "OPTIMIZER_STEP", None, None
    else:
        name, stage, microbatch = f"{action.kind.value} (stage {action.stage})", action.stage, None
    return {
        "name": name,
        "cat": action.kind.value,
        "ph": "X",
        "pid": pid,
        "tid": 1 if action.kind in COMMUNICATION_KINDS else 0,
        "ts": round(trace_start_ms * 1000.0, 3),
        "dur": round((trace_end_ms - trace_start_ms) * 1000.0, 3),
        "args": {"action": text, "stage": stage, "microbatch": microbatch, **args},
    }


def schedule_to_chrome_trace(schedule: Schedule, *, label: str = "") -> dict[str, Any]:
    """A schedule as a Chrome trace (open in https://ui.perfetto.dev or chrome://tracing).

    One process per rank (``pid`` = rank, named ``"rank r"``, then ``label`` when given: ``"rank r (predicted)"``)
    with two threads, ``compute`` (tid 0) and ``communication`` (tid 1: UNSHARD, RESHARD, REDUCE_GRAD), one
    complete event (``"ph": "X"``) per action named like ``"F12 (stage 3)"`` with category its kind,
    ``ts``/``dur`` in microseconds (the schedule's ms × 1000), and each rank's memory as a counter track
    ``"memory"`` (``"ph": "C"``, bytes, from the simulator's ``memory_timeline``).

    Raises:
        ValueError: for an infeasible schedule (no actions to trace).
    """
    from pipesched.optimizer.pattern import memory_timelines

    if schedule.status == "infeasible" or not schedule.ranks:
        raise ValueError(f"schedule is infeasible ({schedule.reason}): there is no timeline to trace")
    memory_timeline, _ = memory_timelines(schedule)
    events: list[dict[str, Any]] = []
    for rank_schedule in schedule.ranks:
        rank = rank_schedule.rank
        _trace_process(events, rank, f"rank {rank} {label}".rstrip())
        for a in rank_schedule.actions:
            events.append(_trace_action(rank, a.action, a.start, a.end, start_ms=a.start, end_ms=a.end))
        for time_ms, held in memory_timeline[rank]:
            events.append(
                {"name": "memory", "ph": "C", "pid": rank, "ts": round(time_ms * 1000.0, 3), "args": {"bytes": held}}
            )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "source": "pipesched schedule (predicted)",
            "method": schedule.method,
            "objective": schedule.objective,
            "makespan_ms": schedule.makespan,
            "stage_span_ms": schedule.stage_span,
            "step_time_ms": schedule.step_time,
            "bubble_rate": schedule.bubble_rate,
            "peak_memory_bytes": schedule.peak_memory,
        },
    }


def run_report_to_chrome_trace(
    report: dict[str, Any], *, pid_offset: int = 0, predicted: Schedule | None = None
) -> dict[str, Any]:
    """A run report's measured timeline (``docs/CONTRACT.md``, Run report) as a Chrome trace.

    Same layout as :func:`schedule_to_chrome_trace`: one process per rank (``pid`` = rank + ``pid_offset``,
    named ``"rank r (measured)"``; with more than one data-parallel replica ``"rank r (measured: pipeline rank q,
    replica d)"``, from the report's ``pp_rank`` and ``dp_rank``), complete events ``"F12 (stage 3)"`` in
    microseconds. Times are shifted so the earliest measured start is 0, as in a schedule. An action carrying
    ``memory_bytes`` (the runtime records the live bytes after every action, on either engine) adds a sample to
    the rank's ``"memory"`` counter (``"ph": "C"``, bytes) at the action's end; each rank's ``peak_memory_bytes``
    becomes a one-sample ``"peak memory"`` counter. With ``predicted`` (the schedule that was run) the trace also
    holds that schedule's events (:func:`schedule_to_chrome_trace`, ``pid`` = pipeline rank, named
    ``"rank r (predicted)"``) and the measured ranks come after them (``pid_offset`` defaults to the number of
    ranks), so one file shows predicted above measured, each process saying which it is.

    Raises:
        ValueError: naming the field (e.g. ``ranks[1].actions[4].start``) when the report is malformed.
    """
    ranks = report.get("ranks") if isinstance(report, dict) else None
    if not isinstance(ranks, list):
        raise ValueError("ranks: the run report needs a list of ranks, each {rank, peak_memory_bytes, actions}")
    starts = []
    for i, entry in enumerate(ranks):
        actions = entry.get("actions") if isinstance(entry, dict) else None
        if not isinstance(actions, list):
            raise ValueError(f"ranks[{i}].actions: expected a list of {{action, start, end}} (ms)")
        for k, item in enumerate(actions):
            for key in ("start", "end"):
                value = item.get(key) if isinstance(item, dict) else None
                if not isinstance(value, int | float) or isinstance(value, bool):
                    raise ValueError(f"ranks[{i}].actions[{k}].{key}: expected a number of ms, got {value!r}")
            starts.append(float(item["start"]))
    origin = min(starts, default=0.0)
    events: list[dict[str, Any]] = []
    if predicted is not None:
        events += schedule_to_chrome_trace(predicted, label="(predicted)")["traceEvents"]
        pid_offset = pid_offset or len(predicted.ranks)
    replicated = any(isinstance(entry, dict) and entry.get("dp_rank", 0) for entry in ranks)
    for i, entry in enumerate(ranks):
        rank = entry.get("rank", i)
        if not isinstance(rank, int):
            raise ValueError(f"ranks[{i}].rank: expected an integer rank, got {rank!r}")
        pid = rank + pid_offset
        where = f": pipeline rank {entry.get('pp_rank')}, replica {entry.get('dp_rank')}" if replicated else ""
        _trace_process(events, pid, f"rank {rank} (measured{where})")
        for k, item in enumerate(entry["actions"]):
            try:
                event = _trace_action(
                    pid,
                    item.get("action"),
                    item["start"] - origin,
                    item["end"] - origin,
                    start_ms=item["start"],
                    end_ms=item["end"],
                )
            except ValueError as error:
                raise ValueError(f"ranks[{i}].actions[{k}].action: {error}") from None
            events.append(event)
            held = item.get("memory_bytes")
            if isinstance(held, int | float) and not isinstance(held, bool):
                # The executor's live memory after this action: a sample at its end.
                events.append(
                    {
                        "name": "memory",
                        "ph": "C",
                        "pid": pid,
                        "ts": round((item["end"] - origin) * 1000.0, 3),
                        "args": {"bytes": held},
                    }
                )
        peak = entry.get("peak_memory_bytes")
        if isinstance(peak, int | float) and entry["actions"]:
            first = min(item["start"] for item in entry["actions"]) - origin
            events.append(
                {"name": "peak memory", "ph": "C", "pid": pid, "ts": round(first * 1000.0, 3), "args": {"bytes": peak}}
            )
    other = {
        key: report[key]
        for key in ("verified", "predicted_makespan_ms", "measured_makespan_ms", "backend", "device")
        if key in report
    }
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"source": "pipesched run report (measured)", **other},
    }
