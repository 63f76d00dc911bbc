"""Published rows nobody here had looked at, predicted with the shipped profiles: no refit, no model change.

The rows are ``bench/data/calibration_holdout_unseen.json`` (one entry per source, each commit-pinned with what it
assumes; never fitted). Each row's published layout is planned with every dimension pinned, exactly as
``bench/cpep_bench.py`` plans its context/expert-parallel rows (:func:`bench.cpep_bench.predict`: the run's
dispatcher, kernels and gradient reduction as stated; a layout the memory model refuses is timed with memory not
enforced, the refusal kept). Beside the published tokens/s per GPU it prints the prediction, the error
predicted / published − 1, the plan's 80% interval (the accelerator profile's ``held_out_log_error``, united with its
context/expert-parallel class's, around the prediction: the plan's own interval, or the same band around the
unenforced time) and whether the published figure
lies inside it; then the median error, the rows beyond 20% and 25% and the share inside the interval, over every row
and by group (context- or expert-parallel), source and precision.

Run: ``python -m bench.unseen_rows_bench [--data FILE] [--time-limit S] [--only SUBSTRING] [--output FILE]``
(``bench/results/unseen_rows.{md,json}``). ``--data`` names another file of the same format: round 19's set is
``bench/data/calibration_holdout_unseen_r19.json`` (``bench/results/unseen_rows_r19.md``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

from bench.cpep_bench import expert_tensor_memory, predict
from pipesched.optimizer.cost.profile import active_catalogue

DATA = Path(__file__).resolve().parent / "data" / "calibration_holdout_unseen.json"
RESULTS = Path(__file__).resolve().parent / "results"


def load_rows(path: Path = DATA) -> list[dict[str, Any]]:
    """The rows of ``path`` (the unseen held-out file), each with its source's id."""
    document = json.loads(path.read_text())
    return [{**row, "source": entry["source"]["id"]} for entry in document["files"] for row in entry["rows"]]


def group(row: dict[str, Any]) -> str:
    """The bar a row is judged against: "expert-parallel" (EP > 1), "context-parallel" (CP > 1) or "dense"."""
    layout = row["layout"]
    if layout.get("expert_parallel", 1) > 1:
        return "expert-parallel"
    return "context-parallel" if layout.get("context_parallel", 1) > 1 else "dense"


def interval(row: dict[str, Any], prediction: dict[str, Any]) -> tuple[float, float]:
    """The 80% interval of the prediction: the plan's, or (memory not enforced, no plan) the accelerator profile's
    ``held_out_log_error`` united with the layout class's (``SoftwareProfile.layout_log_error``) around the
    unenforced time, as a plan of the row's own kernels would carry it (``pipesched.optimizer.planner.evaluate``)."""
    if prediction["interval"]:
        low, high = prediction["interval"]
        return float(low), float(high)
    catalogue = active_catalogue()
    layout = row["layout"]
    log_low, log_high = catalogue.software.layout_log_error(
        catalogue.profiles[row["accelerator"]].held_out_log_error,
        layout.get("context_parallel", 1),
        layout.get("expert_parallel", 1),
    )
    value = prediction["predicted_tokens_per_s_per_gpu"]
    return value * math.exp(log_low), value * math.exp(log_high)


def record(row: dict[str, Any], time_limit_s: float) -> dict[str, Any]:
    """One row planned on its published layout (:func:`bench.cpep_bench.predict`), with its error and interval."""
    prediction = predict(row, time_limit_s)
    published = prediction["published_tokens_per_s_per_gpu"]
    low, high = interval(row, prediction)
    return {
        **prediction,
        "group": group(row),
        "error": round(prediction["predicted_tokens_per_s_per_gpu"] / published - 1, 4),
        "interval": [round(low, 1), round(high, 1)],
        "in_interval": low <= published <= high,
    }


def errors(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Median |error|, the rows beyond 20% and 25%, the share inside the 80% interval, the median signed error."""
    absolute = sorted(abs(r["error"]) for r in records)
    return {
        "rows": len(records),
        "median_abs_error": round(statistics.median(absolute), 3),
        "median_error": round(statistics.median(r["error"] for r in records), 3),
        "max_abs_error": round(absolute[-1], 3),
        "beyond_20": sum(e > 0.20 for e in absolute),
        "beyond_25": sum(e > 0.25 for e in absolute),
        "in_interval": round(sum(r["in_interval"] for r in records) / len(records), 3),
    }


def summary(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """:func:`errors` over every row, the context- and expert-parallel rows together (issue 28's bar), then by
    group, source and precision."""
    result = {"all": errors(records)}
    parallel = [r for r in records if r["group"] != "dense"]
    if parallel and len(parallel) < len(records):
        result["context- or expert-parallel"] = errors(parallel)
    for key in ("group", "source", "precision"):
        for value in sorted({r[key] for r in records}):
            result[f"{key} {value}"] = errors([r for r in records if r[key] == value])
    return result


def table(records: list[dict[str, Any]], stats: dict[str, dict[str, Any]]) -> str:
    """Markdown: the summary, then every row beside its published figure."""
    lines = [
        "| rows | n | median abs error | median error | max | beyond 20% | beyond 25% | inside 80% interval |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in stats.items():
        lines.append(
            f"| {name} | {s['rows']} | {s['median_abs_error']:.1%} | {s['median_error']:+.1%} | "
            f"{s['max_abs_error']:.1%} | {s['beyond_20']} | {s['beyond_25']} | {s['in_interval']:.0%} |"
        )
    lines += [
        "",
        "| row (source) | GPUs | precision | published tok/s/GPU | predicted | error | 80% interval | inside |",
        "|---|---:|---|---:|---:|---:|---|---|",
    ]
    for r in records:
        memory = " (over the memory model)" if r["over_memory"] else ""
        low, high = r["interval"]
        lines.append(
            f"| {r['id']} ({r['source']}) | {r['gpus']} {r['accelerator']} | {r['precision']} | "
            f"{r['published_tokens_per_s_per_gpu']:,.1f} | {r['predicted_tokens_per_s_per_gpu']:,.1f}{memory} | "
            f"{r['error']:+.1%} | {low:,.0f}–{high:,.0f} | {'yes' if r['in_interval'] else 'no'} |"
        )
    return "\n".join(lines + expert_tensor_memory(records))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DATA, help="the held-out file (default: round 18's)")
    parser.add_argument("--time-limit", type=float, default=10.0, help="search.time_limit_s of each pinned row")
    parser.add_argument("--only", default="", help="rows whose id contains this")
    parser.add_argument("--output", type=Path, default=RESULTS / "unseen_rows.md")
    args = parser.parse_args()
    records = []
    for row in load_rows(args.data):
        if args.only in row["id"]:
            records.append(record(row, args.time_limit))
            print(json.dumps(records[-1]), flush=True)
    stats = summary(records)
    header = (
        f"Shipped profiles ({active_catalogue().fitted}), no refit; {args.data.name}, layouts pinned as cpep_bench."
    )
    text = header + "\n\n" + table(records, stats)
    args.output.write_text(text + "\n")
    args.output.with_suffix(".json").write_text(json.dumps({"rows": records, "summary": stats}, indent=1) + "\n")
    print(text)


if __name__ == "__main__":
    main()
