"""Calibration of the accelerator profiles on published training runs: fit, predictions beside the published
figures, held-out error.

Data: every row of ``optimizer/cost/calibration/data/*.json`` (sources, URLs and dates inside; format in the
README beside them) but the context/expert-parallel sources, which ``bench/cpep_bench.py`` holds out as the check
of those cost terms (``CONTEXT_EXPERT_SOURCES``). Model: the planner's own prediction of each row's layout
(:mod:`pipesched.optimizer.calibration.predict`). Fit: :mod:`pipesched.optimizer.calibration.fit` (Gauss–Newton on
log errors, each source-and-accelerator group weighing the same, priors on every parameter), then the activation
memory factor on the published peaks, then the catalogue (:mod:`pipesched.optimizer.calibration.catalogue`).

Reported: every row's published and predicted tokens/s per GPU (and peak memory where published), the fit error,
the leave-one-out error (linearised refit without the row) and the leave-one-group-out error (without every row
of the same source, accelerator, precision and model), their medians and the rows beyond 15%; and every row
predicted with kernels "unknown" (its framework ignored, as for a layout given without one).

Held out twice: ``bench/data/calibration_holdout.json`` (torchtitan's later tables) and
``bench/data/calibration_holdout_external.json`` (other stacks, GPUs and eras: MaxText, NeMo BF16 at scale, IBM's
FSDP, BLOOM's Megatron-DeepSpeed), each row's error, interval, predicted peak against 95% of its GPU's memory and
published MFU against the fitted rows' highest.

Run: ``python -m bench.calibration_bench [--write] [--iterations N]``; ``--write`` stores the catalogue the
planner ships (``optimizer/cost/calibration/profiles.json``). Output: ``bench/results/calibration_bench.{md,json}``.
``--held-out-only`` predicts both held-out files with the shipped catalogue, no fit (seconds):
``bench/results/calibration_held_out.{md,json}``. ``--parallel-only`` refits nothing: the context/expert-parallel
check rows (``bench/cpep_bench.py``) planned with the shipped catalogue, each class's interval
(:func:`~pipesched.optimizer.calibration.catalogue.parallel_log_errors`) and how many rows lie inside their plan's
interval before and after it, in-sample and with the row's source left out
(``bench/results/calibration_parallel_intervals.{md,json}``; with ``--write``, only ``parallel_log_error`` stored;
the full ``--write`` stores it too). ``--memory-only`` refits no efficiency: the published peaks' leave-one-out
interval (``peak_memory_log_error``, a plan's 80% interval on its peak) and its coverage, each row also left out of
the interval and on the never-fitted rows with a published peak
(``bench/results/calibration_peak_interval.{md,json}``; with ``--write``, only that interval and its source stored;
the full ``--write`` stores them too). ``--unknown-only`` refits nothing and recounts kernels "unknown" over the
shipped fit (``bench/results/calibration_unknown_kernels.json``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Collection
from importlib import resources
from pathlib import Path
from typing import Any

from bench import cpep_bench
from pipesched.optimizer.calibration.catalogue import (
    build_catalogue,
    fit_memory_factor,
    fit_unknown_kernels,
    measured_mfu,
    parallel_log_errors,
    row_kernels_class,
)
from pipesched.optimizer.calibration.fit import PARAMETERS, fit, predict_rows, quantile
from pipesched.optimizer.calibration.peaks import (
    held_out_interval,
    interval_source,
    leave_one_out,
    nested_coverage,
    peak_lines,
)
from pipesched.optimizer.calibration.predict import estimator, predict
from pipesched.optimizer.cost.calibration.measurements import (
    CONTEXT_EXPERT_SOURCES,
    Measurement,
    builtin_measurements,
    fitting_measurements,
    parse_measurements,
)
from pipesched.optimizer.cost.profile import ProfileCatalogue, builtin_catalogue, parallel_class, use_catalogue

RESULTS = Path(__file__).resolve().parent / "results"
#: Published runs kept out of the fit: the check of layouts the fit was not given.
HOLDOUT = Path(__file__).resolve().parent / "data" / "calibration_holdout.json"
#: Published runs of other stacks, GPUs and eras (MaxText, NeMo BF16 at scale, IBM's FSDP, BLOOM's
#: Megatron-DeepSpeed), also never fitted: the check of layouts written by someone else (``--held-out-only``
#: predicts both files with the shipped profiles).
EXTERNAL = Path(__file__).resolve().parent / "data" / "calibration_holdout_external.json"
GIB = 1024**3


def _percent(log_ratio: float) -> float:
    """log(published / predicted) as the prediction's error relative to published: predicted/published − 1."""
    return math.exp(-log_ratio) - 1


def summary(errors: list[float]) -> dict[str, float]:
    """Median and maximum |error| and the shares within 15% and 20%, errors as log(published / predicted)."""
    relative = [abs(_percent(e)) for e in errors]
    return {
        "median": round(statistics.median(relative), 4),
        "max": round(max(relative), 4),
        "within_15": round(sum(r <= 0.15 for r in relative) / len(relative), 4),
        "within_20": round(sum(r <= 0.20 for r in relative) / len(relative), 4),
        "q10_log": round(quantile(errors, 0.1), 4),
        "q90_log": round(quantile(errors, 0.9), 4),
    }


def _inside(log_error: float, accelerator: tuple[float, float], framework: tuple[float, float]) -> bool:
    """Whether log(published / predicted) lies inside the union of the accelerator's and the framework's interval."""
    return min(accelerator[0], framework[0]) <= log_error <= max(accelerator[1], framework[1])


def holdout(
    catalogue: ProfileCatalogue, path: Path = HOLDOUT, accelerators: Collection[str] | None = None
) -> dict[str, Any]:
    """The rows of ``path`` (:data:`HOLDOUT` or :data:`EXTERNAL`; of ``accelerators`` only, where given), never
    fitted, predicted with their own kernels mode and with "unknown": error, whether the published figure lies inside
    the plan's 80% interval, the predicted peak memory against 95% of the GPU's memory (the issue's bound on every
    plan), and whether the published MFU is above the highest the calibration data measured on that accelerator in
    that precision (where a plan's answer calls its MFU optimistic)."""
    rows = [row for entry in json.loads(path.read_text())["files"] for row in parse_measurements(entry)]
    rows = [row for row in rows if accelerators is None or row.accelerator in accelerators]
    records = []
    with use_catalogue(catalogue):
        for mode in (None, "unknown"):
            for row in rows:
                prediction = predict(row, kernels=mode)
                if prediction.tokens_per_s_per_gpu is None or prediction.peak_memory_bytes is None:
                    raise ValueError(f"row {row.key} cannot be predicted: {prediction.reason}")
                value = prediction.tokens_per_s_per_gpu
                accelerator = catalogue.profiles[row.accelerator].held_out_log_error
                framework = catalogue.software.class_log_error(row_kernels_class(row)) if mode else accelerator
                ratio = math.log(row.measured.tokens_per_s_per_gpu / value)
                memory = estimator(row).hardware.memory_bytes
                ceiling = catalogue.profiles[row.accelerator].max_measured_mfu
                records.append(
                    {
                        "row": row.key,
                        "kernels": mode or "own",
                        "published": row.measured.tokens_per_s_per_gpu,
                        "predicted": round(value, 1),
                        "error": round(value / row.measured.tokens_per_s_per_gpu - 1, 4),
                        "in_interval": _inside(ratio, accelerator, framework),
                        "peak_gib": round(prediction.peak_memory_bytes / GIB, 1),
                        "memory_share": round(prediction.peak_memory_bytes / memory, 4),
                        "published_mfu": round(measured_mfu(row), 4),
                        "above_measured_mfu": measured_mfu(row) > ceiling.get(row.training.precision, math.inf),
                    }
                )
    summaries = {}
    sources = sorted({r["row"].split("/")[0] for r in records})
    for mode in ("own", "unknown"):
        for source in ("all", *sources):
            chosen = [r for r in records if r["kernels"] == mode and source in ("all", r["row"].split("/")[0])]
            errors = [math.log(r["published"] / r["predicted"]) for r in chosen]
            summaries[mode if source == "all" else f"{mode}, {source}"] = {
                **summary(errors),
                "in_interval": round(sum(r["in_interval"] for r in chosen) / len(chosen), 4),
                "above_95_percent_memory": sum(r["memory_share"] > 0.95 for r in chosen),
                "above_measured_mfu": sum(r["above_measured_mfu"] for r in chosen),
            }
    return {"rows": records, "summary": summaries}


def _abs_median(errors: list[float]) -> float:
    return statistics.median(abs(e) for e in errors) if errors else 0.0


def _abs_max(errors: list[float]) -> float:
    return max((abs(e) for e in errors), default=0.0)


def run(iterations: int) -> dict[str, Any]:
    """Fit, evaluate, and return the report (module docstring)."""
    rows = fitting_measurements()  # the context/expert-parallel rows stay out: bench/cpep_bench.py's check
    started = time.perf_counter()
    result = fit(rows, ProfileCatalogue(), PARAMETERS, iterations=iterations, progress=lambda m: print(m, flush=True))
    fit_s = time.perf_counter() - started
    lines = peak_lines(rows, result.catalogue)
    factor, memory_errors = fit_memory_factor(rows, result.catalogue, lines)
    memory_loo = leave_one_out(lines)
    fitted = f"bench/calibration_bench.py, {len(rows)} rows, {time.strftime('%Y-%m-%d')}"
    peak_memory = (held_out_interval(memory_loo), interval_source(len(memory_loo)))
    catalogue = build_catalogue(rows, result, factor, fitted=fitted, peak_memory=peak_memory)
    catalogue, unknown_errors = fit_unknown_kernels(rows, catalogue)
    parallel = parallel_check(catalogue)
    catalogue = parallel["catalogue"]
    predicted = predict_rows(rows, catalogue)
    records = []
    with use_catalogue(catalogue):
        for i, row in enumerate(rows):
            peak = predict(row).peak_memory_bytes if row.measured.peak_memory_bytes else None
            low, high = catalogue.profiles[row.accelerator].held_out_log_error
            records.append(
                {
                    "row": row.key,
                    "accelerator": row.accelerator,
                    "precision": row.training.precision,
                    "published": row.measured.tokens_per_s_per_gpu,
                    "predicted": predicted[i],
                    "error": round(predicted[i] / row.measured.tokens_per_s_per_gpu - 1, 4),
                    "loo_error": round(_percent(result.loo_log_error[i]), 4),
                    "group_error": round(_percent(result.group_log_error[i]), 4),
                    "unknown_kernels_error": round(_percent(unknown_errors[i]), 4),
                    "unknown_kernels_in_interval": _inside(
                        unknown_errors[i],
                        (low, high),
                        catalogue.software.class_log_error(row_kernels_class(row)),
                    ),
                    "in_interval": predicted[i] * math.exp(low)
                    <= row.measured.tokens_per_s_per_gpu
                    <= predicted[i] * math.exp(high),
                    "published_mfu": round(measured_mfu(row), 4),
                    "published_peak_gib": round(row.measured.peak_memory_bytes / GIB, 1) if peak else None,
                    "predicted_peak_gib": round(peak / GIB, 1) if peak else None,
                }
            )
    final_errors = [math.log(r["published"] / r["predicted"]) for r in records]
    return {
        "rows": records,
        "parameters": [
            {"name": p.name, "accelerators": list(p.accelerators), "value": round(v, 4), "prior": p.prior}
            for p, v in zip(result.parameters, result.values, strict=True)
        ],
        "activation_memory_factor": factor,
        "memory_log_errors": [round(e, 4) for e in memory_errors],
        "memory_loo_log_errors": [round(e, 4) for e in memory_loo],
        "memory_ceiling": round(min(line.ceiling() for line in lines if line.ceiling() >= 1.0), 4),
        "memory_interval": peak_memory[0],
        "memory_nested_coverage": round(sum(nested_coverage(memory_loo)) / len(memory_loo), 4),
        "fit": summary(final_errors),
        "leave_one_out": summary(result.loo_log_error),
        "leave_one_group_out": summary(result.group_log_error),
        "unknown_kernels": summary(unknown_errors),
        "unknown_kernels_shares": catalogue.software.unknown_kernels_shares,
        "unknown_kernels_in_interval": round(sum(r["unknown_kernels_in_interval"] for r in records) / len(records), 4),
        "in_interval": round(sum(r["in_interval"] for r in records) / len(records), 4),
        "holdout": holdout(catalogue),
        "external": holdout(catalogue, EXTERNAL),
        "parallel_log_error": catalogue.software.parallel_log_error,
        "parallel_check": parallel["summary"],
        "fit_s": round(fit_s, 1),
        "iterations": result.iterations,
        "catalogue": catalogue.model_dump(mode="json"),
    }


def holdout_table(held: dict[str, Any], title: str) -> list[str]:
    """Markdown lines of a held-out check (:func:`holdout`): summaries by kernels mode and source, then every row."""
    lines = [
        f"Held out ({title}):",
        "",
        "| kernels (, source) | median | max | within 15% | within 20% | in 80% interval "
        "| peaks above 95% of the GPU | published MFU above the fitted rows' highest |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, s in held["summary"].items():
        lines.append(
            f"| {mode} | {s['median']:.1%} | {s['max']:.1%} | {s['within_15']:.0%} | {s['within_20']:.0%} "
            f"| {s['in_interval']:.0%} | {s['above_95_percent_memory']} | {s['above_measured_mfu']} |"
        )
    lines += ["", "| held-out row | kernels | published | predicted | error | in 80% interval | peak GiB (GPU) | MFU |"]
    lines.append("|---|---|---:|---:|---:|---|---:|---:|")
    for r in held["rows"]:
        lines.append(
            f"| {r['row']} | {r['kernels']} | {r['published']:,.0f} | {r['predicted']:,.0f} | {r['error']:+.1%} "
            f"| {'yes' if r['in_interval'] else 'no'} | {r['peak_gib']} ({r['memory_share']:.0%}) "
            f"| {r['published_mfu']:.1%}{' (above)' if r['above_measured_mfu'] else ''} |"
        )
    return lines


def held_out_tables(report: dict[str, Any]) -> list[str]:
    """Markdown lines of both held-out checks of a report: torchtitan's later tables, then the external one."""
    return [
        *holdout_table(report["holdout"], "bench/data/calibration_holdout.json: published runs the fit never saw"),
        "",
        *holdout_table(
            report["external"], "bench/data/calibration_holdout_external.json: other stacks, GPUs, eras; never fitted"
        ),
    ]


def table(report: dict[str, Any]) -> str:
    """Markdown: the summary, the parameters, then every row."""
    lines = [
        "| errors (predicted/published − 1) | median | max | within 15% | within 20% |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in ("fit", "leave_one_out", "leave_one_group_out", "unknown_kernels"):
        s = report[name]
        lines.append(
            f"| {name.replace('_', ' ')} | {s['median']:.1%} | {s['max']:.1%} | {s['within_15']:.0%} "
            f"| {s['within_20']:.0%} |"
        )
    lines += [
        "",
        f"Published figure inside the 80% interval: {report['in_interval']:.0%} of rows. "
        f"Activation memory factor {report['activation_memory_factor']:.2f} (every fitted run fits its GPU up to "
        f"{report['memory_ceiling']:.2f}); published peaks, |log(published / predicted)| median / largest: fit "
        f"{_abs_median(report['memory_log_errors']):.3f} / {_abs_max(report['memory_log_errors']):.3f}, leave one "
        f"out {_abs_median(report['memory_loo_log_errors']):.3f} / {_abs_max(report['memory_loo_log_errors']):.3f}; "
        f"a plan's 80% peak interval: log {report['memory_interval'][0]:+.3f} to {report['memory_interval'][1]:+.3f}, "
        f"each published peak inside the interval of the others' in {report['memory_nested_coverage']:.0%}. "
        f"Kernels 'unknown' (every row predicted "
        f"with its framework ignored): kernels shares by layout class {report['unknown_kernels_shares']}, published "
        f"figure inside that mode's 80% interval in {report['unknown_kernels_in_interval']:.0%} of rows.",
        "",
    ]
    lines += held_out_tables(report)
    lines += [
        "",
        "| parameter | accelerators | fitted | prior |",
        "|---|---|---:|---:|",
    ]
    for p in report["parameters"]:
        lines.append(f"| {p['name']} | {', '.join(p['accelerators']) or 'all'} | {p['value']:.4g} | {p['prior']:.4g} |")
    lines += [
        "",
        "| row | accelerator | precision | published tok/s/GPU | predicted | error | held out (row / group) "
        "| in 80% interval | kernels unknown | published MFU | peak GiB published / predicted |",
        "|---|---|---|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in report["rows"]:
        peak = f"{r['published_peak_gib']} / {r['predicted_peak_gib']}" if r["published_peak_gib"] else ""
        lines.append(
            f"| {r['row']} | {r['accelerator']} | {r['precision']} | {r['published']:,.0f} | {r['predicted']:,.0f} | "
            f"{r['error']:+.1%} | {r['loo_error']:+.1%} / {r['group_error']:+.1%} | "
            f"{'yes' if r['in_interval'] else 'no'} | {r['unknown_kernels_error']:+.1%} | {r['published_mfu']:.1%} "
            f"| {peak} |"
        )
    return "\n".join(lines)


def _parallel_inside(log_error: float, interval: tuple[float, float]) -> bool:
    return interval[0] <= log_error <= interval[1]


def parallel_check(catalogue: ProfileCatalogue, time_limit_s: float = 10.0) -> dict[str, Any]:
    """The context/expert-parallel check rows (:func:`bench.cpep_bench.load_rows`, never fitted) planned on their
    published layouts with their own kernels under ``catalogue`` (:func:`bench.cpep_bench.predict`), each class's
    interval from their log(published / predicted)
    (:func:`~pipesched.optimizer.calibration.catalogue.parallel_log_errors`), and, by class, the share inside the
    plan's interval: the accelerator's alone (before), its union with the class's (in-sample: the class's interval
    is these rows'), and that union with the class's interval counted without the row's source (held out). Returns
    the ``catalogue`` with ``parallel_log_error`` set, every row and the summary."""
    rows = cpep_bench.load_rows()
    records = []
    with use_catalogue(catalogue):
        for row in rows:
            prediction = cpep_bench.predict(row, time_limit_s)
            published = prediction["published_tokens_per_s_per_gpu"]
            layout = row["layout"]
            records.append(
                {
                    "id": row["id"],
                    "source": row["source"],
                    "accelerator": row["accelerator"],
                    "degrees": (layout.get("context_parallel", 1), layout.get("expert_parallel", 1)),
                    "class": parallel_class(layout.get("context_parallel", 1), layout.get("expert_parallel", 1)),
                    "log_error": round(math.log(published / prediction["predicted_tokens_per_s_per_gpu"]), 4),
                }
            )
    classes = [r["class"] for r in records]
    groups = [(r["source"], r["accelerator"]) for r in records]
    errors = [r["log_error"] for r in records]
    intervals = parallel_log_errors(classes, groups, errors)
    software = catalogue.software.model_copy(update={"parallel_log_error": intervals})
    result = catalogue.model_copy(update={"software": software})
    for r in records:
        accelerator = catalogue.profiles[r["accelerator"]].held_out_log_error
        others = [i for i, other in enumerate(records) if other["source"] != r["source"]]
        without = parallel_log_errors(
            [classes[i] for i in others], [groups[i] for i in others], [errors[i] for i in others]
        )
        held = software.model_copy(update={"parallel_log_error": without})
        cp, ep = r["degrees"]
        r["in_accelerator_interval"] = _parallel_inside(r["log_error"], accelerator)
        r["in_class_interval"] = _parallel_inside(r["log_error"], software.layout_log_error(accelerator, cp, ep))
        r["in_class_interval_source_out"] = _parallel_inside(r["log_error"], held.layout_log_error(accelerator, cp, ep))
    summary_: dict[str, Any] = {"parallel_log_error": intervals}
    for name in ("all", "context-parallel", "expert-parallel", None):
        chosen = [r for r in records if name == "all" or r["class"] == name]
        summary_[name or "dense"] = {
            "rows": len(chosen),
            **{
                key: round(sum(r[key] for r in chosen) / len(chosen), 3)
                for key in ("in_accelerator_interval", "in_class_interval", "in_class_interval_source_out")
            },
        }
    return {"catalogue": result, "rows": records, "summary": summary_}


def parallel_only(write: bool, output: Path) -> None:
    """``--parallel-only``: :func:`parallel_check` under the shipped catalogue, no refit (with ``write``, only
    ``software.parallel_log_error`` stored in ``profiles.json``)."""
    report = parallel_check(builtin_catalogue())
    kept = {"rows": report["rows"], "summary": report["summary"]}
    lines = [
        f"Shipped profiles ({builtin_catalogue().fitted}), no refit; context/expert-parallel check rows "
        "(bench/cpep_bench.py), own kernels.",
        "",
        f"parallel_log_error: {json.dumps(report['summary']['parallel_log_error'])}",
        "",
        "| rows | n | inside the accelerator's interval | inside the union with the class's (in-sample) "
        "| the same, the row's source left out |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, s in report["summary"].items():
        if name != "parallel_log_error":
            lines.append(
                f"| {name} | {s['rows']} | {s['in_accelerator_interval']:.0%} | {s['in_class_interval']:.0%} | "
                f"{s['in_class_interval_source_out']:.0%} |"
            )
    text = "\n".join(lines)
    output.write_text(text + "\n")
    output.with_suffix(".json").write_text(json.dumps(kept, indent=1) + "\n")
    print(text)
    if write:
        target = Path(str(resources.files("pipesched.optimizer.cost.calibration") / "profiles.json"))
        document = json.loads(target.read_text())
        document["software"]["parallel_log_error"] = report["summary"]["parallel_log_error"]
        target.write_text(json.dumps(document, indent=1) + "\n")
        print(f"wrote {target}")


def _unseen_peaks(catalogue: ProfileCatalogue, interval: tuple[float, float]) -> list[dict[str, Any]]:
    """Every never-fitted row with a published peak (the context/expert-parallel sources', both held-out files'),
    predicted on its published layout under ``catalogue``: log(published / predicted) peak, inside ``interval``."""
    files = (HOLDOUT, EXTERNAL)
    rows: list[Measurement] = [row for row in builtin_measurements() if row.source in CONTEXT_EXPERT_SOURCES]
    rows += [
        row for path in files for entry in json.loads(path.read_text())["files"] for row in parse_measurements(entry)
    ]
    records = []
    with use_catalogue(catalogue):
        for row in rows:
            published = row.measured.peak_memory_bytes
            predicted = predict(row).peak_memory_bytes if published else None
            if published and predicted:
                error = math.log(published / predicted)
                records.append(
                    {
                        "row": row.key,
                        "published_gib": round(published / GIB, 1),
                        "predicted_gib": round(predicted / GIB, 1),
                        "log_error": round(error, 4),
                        "inside": interval[0] <= error <= interval[1],
                    }
                )
    return records


def memory_only(write: bool, output: Path) -> None:
    """``--memory-only``: no refit of the efficiencies; the shipped fit's published peaks, the memory factor
    refitted (as the full run does), their leave-one-out errors and the interval a plan's peak carries
    (:func:`~pipesched.optimizer.calibration.peaks.held_out_interval`), its coverage with each row also out of the
    interval (:func:`~pipesched.optimizer.calibration.peaks.nested_coverage`) and on the never-fitted rows with a
    published peak (:func:`_unseen_peaks`). With ``write``, only each profile's ``peak_memory_log_error`` and
    ``peak_memory_source`` stored in ``profiles.json``."""
    shipped = builtin_catalogue()
    rows = fitting_measurements()
    lines = peak_lines(rows, shipped)
    factor, errors = fit_memory_factor(rows, shipped, lines)
    loo = leave_one_out(lines)
    interval, source = held_out_interval(loo), interval_source(len(loo))
    nested = nested_coverage(loo)
    unseen = _unseen_peaks(shipped, interval)
    published = [line for line in lines if line.published]
    report = {
        "activation_memory_factor": {
            "refitted": factor,
            "shipped": shipped.profiles["H100-SXM"].activation_memory_factor,
        },
        "peak_memory_log_error": interval,
        "peak_memory_source": source,
        "fitted_rows": [
            {"row": line.key, "fit_log_error": round(fit, 4), "loo_log_error": round(out, 4), "inside_others": inside}
            for line, fit, out, inside in zip(published, errors, loo, nested, strict=True)
        ],
        "nested_coverage": round(sum(nested) / len(nested), 4),
        "unseen_rows": unseen,
        "unseen_coverage": round(sum(r["inside"] for r in unseen) / len(unseen), 4) if unseen else None,
    }
    text = _memory_table(report)
    output.write_text(text + "\n")
    output.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    print(text)
    if write:
        target = Path(str(resources.files("pipesched.optimizer.cost.calibration") / "profiles.json"))
        document = json.loads(target.read_text())
        for profile in document["profiles"].values():
            profile["peak_memory_log_error"] = list(interval)
            profile["peak_memory_source"] = source
        target.write_text(json.dumps(document, indent=1) + "\n")
        print(f"wrote {target}")


def _memory_table(report: dict[str, Any]) -> str:
    """Markdown of :func:`memory_only`'s report."""
    low, high = report["peak_memory_log_error"]
    factor = report["activation_memory_factor"]
    lines = [
        f"Shipped profiles, no refit of the efficiencies; activation memory factor refitted {factor['refitted']} "
        f"(shipped {factor['shipped']}). A plan's 80% peak interval: log(published / predicted) {low:+.4f} to "
        f"{high:+.4f} (× {math.exp(low):.3f} to × {math.exp(high):.3f} the predicted peak), "
        f"{report['peak_memory_source']}.",
        "",
        f"Coverage: each fitted published peak inside the interval of the other rows' held-out errors (the row in "
        f"neither the factor nor the interval): {report['nested_coverage']:.0%} of {len(report['fitted_rows'])}; "
        f"never-fitted rows with a published peak inside the interval: "
        + (f"{report['unseen_coverage']:.0%} of {len(report['unseen_rows'])}." if report["unseen_rows"] else "none."),
        "",
        "| fitted row | log(published / predicted), fit | left out | inside the others' interval |",
        "|---|---:|---:|---|",
    ]
    for r in report["fitted_rows"]:
        lines.append(
            f"| {r['row']} | {r['fit_log_error']:+.4f} | {r['loo_log_error']:+.4f} "
            f"| {'yes' if r['inside_others'] else 'no'} |"
        )
    lines += ["", "| never-fitted row | published GiB | predicted GiB | log(published / predicted) | inside |"]
    lines.append("|---|---:|---:|---:|---|")
    for r in report["unseen_rows"]:
        lines.append(
            f"| {r['row']} | {r['published_gib']} | {r['predicted_gib']} | {r['log_error']:+.4f} "
            f"| {'yes' if r['inside'] else 'no'} |"
        )
    return "\n".join(lines)


def held_out_only(output: Path) -> None:
    """Both held-out checks under the shipped catalogue (``profiles.json``), without a refit: seconds, no lock."""
    catalogue = builtin_catalogue()
    report = {"fitted": catalogue.fitted, "holdout": holdout(catalogue), "external": holdout(catalogue, EXTERNAL)}
    lines = [f"Shipped profiles ({catalogue.fitted}), no refit.", ""]
    lines += held_out_tables(report)
    text = "\n".join(lines)
    output.write_text(text + "\n")
    output.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    print(text)


def unknown_only(write: bool) -> None:
    """``--unknown-only``: kernels "unknown" recounted over the shipped fit (the fit predicts every row with its own
    kernels, so no fitted value depends on them), the held-out rows predicted before and after."""
    shipped = builtin_catalogue()
    catalogue, _ = fit_unknown_kernels(fitting_measurements(), shipped)
    software = catalogue.software
    report = {
        "unknown_kernels_shares": software.unknown_kernels_shares,
        "unknown_kernels_log_error": software.unknown_kernels_log_error,
        "holdout_before": holdout(shipped)["summary"],
        "holdout_after": holdout(catalogue),
    }
    (RESULTS / "calibration_unknown_kernels.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({key: value for key, value in report.items() if key != "holdout_after"}, indent=1))
    print(json.dumps(report["holdout_after"]["summary"], indent=1))
    if write:
        target = Path(str(resources.files("pipesched.optimizer.cost.calibration") / "profiles.json"))
        document = json.loads(target.read_text())
        for name in ("unknown_kernels_shares", "unknown_kernels_log_error"):
            document["software"][name] = report[name]
        target.write_text(json.dumps(document, indent=1) + "\n")
        print(f"wrote {target}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=12, help="Gauss–Newton iterations at most")
    parser.add_argument("--write", action="store_true", help="store the catalogue the planner ships")
    parser.add_argument("--output", type=Path, default=RESULTS / "calibration_bench.md")
    parser.add_argument(
        "--held-out-only",
        action="store_true",
        help="no fit: predict the two held-out files with the shipped profiles.json "
        "(bench/results/calibration_held_out.{md,json})",
    )
    parser.add_argument(
        "--unknown-only",
        action="store_true",
        help="no refit: the shipped catalogue's kernels-'unknown' shares and intervals recounted, and the held-out "
        "rows predicted (with --write, only those fields stored)",
    )
    parser.add_argument(
        "--parallel-only",
        action="store_true",
        help="no refit: the context/expert-parallel check rows' class intervals and coverage "
        "(bench/results/calibration_parallel_intervals.{md,json}; with --write, only parallel_log_error stored)",
    )
    parser.add_argument(
        "--memory-only",
        action="store_true",
        help="no refit of the efficiencies: the published peaks' held-out interval and its coverage "
        "(bench/results/calibration_peak_interval.{md,json}; with --write, only peak_memory_log_error stored)",
    )
    args = parser.parse_args()
    if args.memory_only:
        memory_only(args.write, RESULTS / "calibration_peak_interval.md")
        return
    if args.parallel_only:
        parallel_only(args.write, RESULTS / "calibration_parallel_intervals.md")
        return
    if args.held_out_only:
        held_out_only(RESULTS / "calibration_held_out.md")
        return
    if args.unknown_only:
        unknown_only(args.write)
        return
    report = run(args.iterations)
    text = table(report)
    args.output.write_text(text + "\n")
    kept = {key: value for key, value in report.items() if key != "catalogue"}
    args.output.with_suffix(".json").write_text(json.dumps(kept, indent=1) + "\n")
    if args.write:
        target = Path(str(resources.files("pipesched.optimizer.cost.calibration") / "profiles.json"))
        target.write_text(json.dumps(report["catalogue"], indent=1) + "\n")
        print(f"wrote {target}")
    print(text[:3000])


if __name__ == "__main__":
    main()
