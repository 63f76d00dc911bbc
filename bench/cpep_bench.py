"""Context and expert parallelism against published layouts: mixture-of-experts and long-sequence runs.

Every row of the context/expert-parallel calibration data (``optimizer/cost/calibration/data``: Megatron
Bridge, NeMo, NeMo AutoModel, the Megatron MoE Model Zoo, torchtitan, the Llama 3 and DeepSeek-V3 reports;
each file's ``source`` says where and how its figures were read) is planned with every dimension of its
published layout pinned in ``search`` (pipeline, tensor, context, expert and data-parallel degrees, sharding,
chunks per rank, schedule, micro-batch size, and the recomputation where the source states it; the precision
and how kernels ran as ``training``), and the planner's tokens/s per GPU is set beside the published one: the
ratio published / predicted, the error |predicted / published − 1|, their median, worst and spread over the
rows, by precision and by source. Where the planner's memory model refuses a published layout (a run that ran),
the layout is timed with memory not enforced and the refusal is kept beside it. These sources are held out of
the profile fit (``CONTEXT_EXPERT_SOURCES``): the error is a held-out error. A free search of the same model, GPUs
and batch then gives the planner's own best layout for the cases of ``FREE_CASES`` (with its 80% interval where
the plan carries one).

Run: ``python -m bench.cpep_bench [--time-limit S] [--free-time-limit S] [--only SUBSTRING] [--output FILE]
[--default-kernels] [--fit-host]``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from pipesched.optimizer.calibration.predict import FRAMEWORK_SOFTWARE, Prediction, configuration, power_limited
from pipesched.optimizer.calibration.predict import predict as calibration_predict
from pipesched.optimizer.configs import ClusterConfig
from pipesched.optimizer.cost.calibration.measurements import CONTEXT_EXPERT_SOURCES, Measurement
from pipesched.optimizer.cost.profile import ProfileCatalogue, active_catalogue, use_catalogue
from pipesched.optimizer.cost.stages import resolve_hardware
from pipesched.optimizer.planner.rank import plan
from pipesched.optimizer.planner.request import Plan, PlanRequest

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "optimizer" / "cost" / "calibration" / "data"
RESULTS = Path(__file__).resolve().parent / "results"


#: Rows whose model, GPUs and batch also get a free search (the planner's own best layout).
FREE_CASES = (
    "llama3-405b-16384-cp16-s131072",
    "automodel-h100-deepseek-v3-1024",
    "automodel-h100-qwen3-30b-a3b-8",
    "modelzoo-h100-235b-long-s131072-cp8",
    "mbridge260401-gpt-oss-120b-64-h100-tp1pp4cp1vp1ep8-gbs1280-mbs1",
    "torchtitan-8b-8-fsdp1-cp8",
)

_SCHEDULE_PLACEMENT = {"dualpipe-v": "v", "zb-v": "v", "v-half": "v", "v-min": "v"}


def load_rows(sources: tuple[str, ...] = CONTEXT_EXPERT_SOURCES) -> list[dict[str, Any]]:
    """The rows of ``sources``, each with its ``source`` id."""
    rows = []
    for name in sources:
        document = json.loads((DATA / f"{name}.json").read_text())
        rows += [{**row, "source": document["source"]["id"]} for row in document["rows"]]
    return rows


def pins(row: dict[str, Any]) -> dict[str, list[Any]]:
    """The row's published layout as ``search`` pins (recomputation only where the source states it)."""
    layout, run = row["layout"], row["training"]
    schedule = layout.get("schedule", "1f1b")
    pinned: dict[str, list[Any]] = {
        "pipeline_parallel": [layout.get("pipeline_parallel", 1)],
        "tensor_parallel": [layout.get("tensor_parallel", 1)],
        "context_parallel": [layout.get("context_parallel", 1)],
        "expert_parallel": [layout.get("expert_parallel", 1)],
        "data_parallel_size": [layout.get("data_parallel", 1)],
        "stages_per_rank": [layout.get("stages_per_rank", 1)],
        "placement": [_SCHEDULE_PLACEMENT.get(schedule, "loop")],
        "micro_batch_size": [run["micro_batch_size"]],
        "method": [schedule if layout.get("pipeline_parallel", 1) > 1 else "1f1b"],
    }
    if layout.get("expert_tensor_parallel") is not None and layout.get("expert_parallel", 1) > 1:
        pinned["expert_tensor_parallel"] = [layout["expert_tensor_parallel"]]
    if layout.get("data_parallel", 1) * layout.get("context_parallel", 1) > 1:
        pinned["sharding"] = [layout.get("sharding", "none")]
    assumed = " ".join(row.get("software", {}).get("assumed", []))
    if "activation_recomputation" not in assumed:
        pinned["activation_recomputation"] = [run.get("activation_recomputation", "none")]
    return pinned


def kernels(row: dict[str, Any]) -> str:
    """How the row's elementwise work ran: ``fused`` (hand-fused kernels), ``compiled`` or ``eager``."""
    software = row.get("software", {})
    if software.get("fused_kernels"):
        return "fused"
    return "compiled" if software.get("compile") else "eager"


def request_for(
    row: dict[str, Any], time_limit_s: float, *, pinned: bool = True, default_kernels: bool = False
) -> PlanRequest:
    """The plan request of a row: its model, cluster and batch, its layout pinned (with the run's split of the
    layers where the source states it: ``layout.pipeline_split``, and its ``layout.sequence_parallel``) or free, its
    gradient reduction in the dtype the run states (``software.gradient_reduce_dtype``) and its tensor-parallel
    overlap (``software.async_tensor_parallel``: ``training.async_tensor_parallel``); ``default_kernels`` leaves
    ``training.kernels``, the reduction's dtype and the overlap to their defaults ("unknown", fp32, none), as a user
    who does not say how the framework runs would. These are the fields
    :func:`pipesched.optimizer.calibration.predict.estimator` and ``configuration`` read from a row; the rest of
    what a row's software states goes in through the catalogue (:func:`run_catalogue`)."""
    fields = ClusterConfig.model_validate({"accelerator": row["accelerator"], **row.get("cluster", {})})
    # GPUs run under a power limit (torchtitan's 500 W H100s) at the sustained peak the calibration fitted
    cluster = power_limited(fields, row.get("power_limit_w")).model_dump(exclude_unset=True)
    search: dict[str, Any] = {"time_limit_s": time_limit_s, "top": 1}
    if pinned:
        search.update(pins(row))
        search["sequence_parallel"] = row["layout"].get("sequence_parallel", True)
    training = {
        "global_batch_size": row["training"]["global_batch_size"],
        "precision": row["training"].get("precision", "bf16"),
    }
    if not default_kernels:  # how the framework ran: its kernels and its gradient reduction's dtype
        training["kernels"] = kernels(row)
        training["gradient_reduce_dtype"] = row.get("software", {}).get("gradient_reduce_dtype", "fp32")
        training["async_tensor_parallel"] = row.get("software", {}).get("async_tensor_parallel", False)
    model = dict(row["model"])
    split = Measurement.model_validate(row).layers_per_stage if pinned else None
    if split is not None:  # the published layout's own split of the layers (layout.pipeline_split)
        model["layers_per_stage"] = split
    return PlanRequest.model_validate({"model": model, "cluster": cluster, "training": training, "search": search})


def describe(plan_: Plan) -> str:
    """A short description of a plan's layout."""
    pipeline = (
        f"PP {plan_.pipeline_parallel} {plan_.method} v{plan_.stages_per_rank} × "
        if plan_.pipeline_parallel > 1
        else ""
    )
    etp = (
        f" (ETP {plan_.expert_tensor_parallel})"
        if plan_.expert_parallel > 1 and plan_.expert_tensor_parallel > 1
        else ""
    )
    return (
        f"{pipeline}TP {plan_.tensor_parallel} × CP {plan_.context_parallel} × EP {plan_.expert_parallel}{etp} × "
        f"DP {plan_.data_parallel.size} {plan_.data_parallel.sharding}, mb {plan_.micro_batch_size}×"
        f"{plan_.num_microbatches}, AC {plan_.activation_recomputation}"
    )


def unenforced(row: dict[str, Any], time_limit_s: float, default_kernels: bool = False) -> float | None:
    """The row's layout timed with memory not enforced (:func:`unenforced_prediction`), tokens/s per GPU."""
    return unenforced_prediction(row, time_limit_s, default_kernels).tokens_per_s_per_gpu


def unenforced_prediction(row: dict[str, Any], time_limit_s: float, default_kernels: bool = False) -> Prediction:
    """The row's layout evaluated with memory not enforced (:func:`pipesched.optimizer.calibration.predict.predict`:
    a published run ran), at its stated recomputation or, where the source does not state it, ``full``; with
    ``default_kernels`` as kernels "unknown" (as :func:`request_for`)."""
    measurement = Measurement.model_validate(row)
    if "activation_recomputation" in " ".join(measurement.software.assumed):
        training = measurement.training.model_copy(update={"activation_recomputation": "full"})
        measurement = measurement.model_copy(update={"training": training})
    kernels_ = "unknown" if default_kernels else None
    return calibration_predict(measurement, time_limit_s=time_limit_s, kernels=kernels_)


def run_catalogue(row: dict[str, Any]) -> ProfileCatalogue:
    """The active catalogue with the row's mixture-of-experts all-to-alls as they ran, which no request field
    states: ``software.moe_dispatcher`` (the recipe's ``moe_token_dispatcher_type``; hierarchical where the source
    does not say) and ``software.moe_all_to_all_overlap`` (its ``moe_a2a_overlap``); and when its FSDP reduced the
    gradients (``software.fsdp_gradient_sync``: NeMo AutoModel's trainer once a step); and what its framework
    runs under them (``FRAMEWORK_SOFTWARE``: NeMo AutoModel's bf16 model under FSDP; a field the row states wins).
    With ``--default-kernels`` the request says nothing of the framework, so these stay at the planner's defaults
    too."""
    catalogue = active_catalogue()
    software = row.get("software", {})
    stated: dict[str, Any] = dict(FRAMEWORK_SOFTWARE.get(software.get("framework", ""), {}))
    for name in ("moe_dispatcher", "moe_all_to_all_overlap", "fsdp_gradient_sync"):
        stated[name] = software.get(name, stated.get(name, getattr(catalogue.software, name)))
    return catalogue.model_copy(update={"software": catalogue.software.model_copy(update=stated)})


def predict(row: dict[str, Any], time_limit_s: float, default_kernels: bool = False) -> dict[str, Any]:
    """The planner on the row's published layout, beside the published figure; where the planner's memory model
    refuses the layout, its time with memory not enforced (:func:`unenforced_prediction`), the refusal kept in
    ``over_memory``; with the row's resolved expert tensor degree, the predicted peak memory (the plan's, or the
    unenforced layout's) and its GPU's memory, bytes."""
    started = time.perf_counter()
    with use_catalogue(active_catalogue() if default_kernels else run_catalogue(row)):
        try:
            answer = plan(request_for(row, time_limit_s, default_kernels=default_kernels)).answer
            best, error = (answer.plans[0] if answer.plans else None), answer.error
        except ValidationError as exc:  # the layout does not fit the model of memory
            best, error = None, "; ".join(str(item["msg"]) for item in exc.errors())[:300]
        if best is not None:
            predicted, peak = best.tokens_per_s_per_gpu, best.peak_memory_bytes
        else:
            timed = unenforced_prediction(row, time_limit_s, default_kernels)
            predicted, peak = timed.tokens_per_s_per_gpu, timed.peak_memory_bytes
    published = row["measured"]["tokens_per_s_per_gpu"]
    return {
        "id": row["id"],
        "source": row["source"],
        "model": row["model"].get("preset"),
        "seq_length": row["model"].get("seq_length"),
        "accelerator": row["accelerator"],
        "gpus": row["cluster"]["num_nodes"] * row["cluster"]["gpus_per_node"],
        "precision": row["training"]["precision"],
        "published_tokens_per_s_per_gpu": published,
        "predicted_tokens_per_s_per_gpu": predicted,
        "ratio": round(published / predicted, 4) if predicted else None,
        "layout": describe(best) if best else "the published layout, memory not enforced",
        "over_memory": None if best else error,
        "interval": getattr(best, "tokens_per_s_per_gpu_interval", None) if best else None,
        "expert_tensor_parallel": configuration(Measurement.model_validate(row)).expert_tensor_parallel,
        "predicted_peak_memory_bytes": peak,
        "gpu_memory_bytes": gpu_memory_bytes(row),
        "search_s": round(time.perf_counter() - started, 2),
    }


def gpu_memory_bytes(row: dict[str, Any]) -> float:
    """The memory of one of the row's GPUs, bytes (its cluster's ``memory_bytes`` where stated, else the
    accelerator catalogue's)."""
    fields = ClusterConfig.model_validate({"accelerator": row["accelerator"], **row.get("cluster", {})})
    return float(resolve_hardware(fields).memory_bytes)


def free(row: dict[str, Any], time_limit_s: float) -> dict[str, Any]:
    """The planner's own best layout for the row's model, GPUs and batch."""
    answer = plan(request_for(row, time_limit_s, pinned=False)).answer
    best = answer.plans[0] if answer.plans else None
    return {
        "id": row["id"],
        "best_layout": describe(best) if best else answer.error,
        "best_tokens_per_s_per_gpu": best.tokens_per_s_per_gpu if best else None,
        "best_interval": getattr(best, "tokens_per_s_per_gpu_interval", None) if best else None,
        "elapsed_s": answer.elapsed_s,
        "time_limit_s": time_limit_s,
        "searched": answer.searched.model_dump(),
    }


def _errors(predictions: list[dict[str, Any]]) -> dict[str, Any]:
    """|predicted / published − 1| (as ``bench/calibration_bench.py`` states its error): median, worst, the share
    within 25%, and the geometric spread of published / predicted."""
    ratios = [p["ratio"] for p in predictions]
    errors = sorted(abs(1 / r - 1) for r in ratios)
    worst = max(predictions, key=lambda p: abs(1 / p["ratio"] - 1))
    return {
        "rows": len(ratios),
        "median_ratio": round(statistics.median(ratios), 3),
        "median_abs_error": round(statistics.median(errors), 3),
        "max_abs_error": round(errors[-1], 3),
        "worst_row": worst["id"],
        "within_25": round(sum(e <= 0.25 for e in errors) / len(errors), 3),
        "geometric_spread": round(math.exp(statistics.pstdev(math.log(r) for r in ratios)), 3),
    }


def summary(predictions: list[dict[str, Any]]) -> dict[str, Any]:
    """The held-out error (:func:`_errors`) over every row, by precision and by source. No parameter of the cost
    model is fitted to these rows (the profiles are fitted without them:
    :data:`~pipesched.optimizer.cost.calibration.measurements.CONTEXT_EXPERT_SOURCES`), so every figure is a
    held-out one: the whole context/expert-parallel set is the group left out."""
    planned = [p for p in predictions if p["ratio"]]
    result: dict[str, Any] = {"held_out": "every row: the profile fit never saw these sources"}
    groups = {"all": planned}
    for key in ("precision", "source"):
        for value in sorted({p[key] for p in planned}):
            groups[value] = [p for p in planned if p[key] == value]
    for name, members in groups.items():
        if members:
            result[name] = _errors(members)
    result["no_plan"] = [p["id"] for p in predictions if p["ratio"] is None]
    result["over_memory"] = [p["id"] for p in predictions if p.get("over_memory")]
    return result


def expert_tensor_memory(predictions: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: each row whose experts are split over e_t > 1 GPUs (its mixture-of-experts layers hold the
    e_t-gathered dispatched tokens), its predicted peak memory beside its GPU's (a run that ran must fit it)."""
    split = [p for p in predictions if (p.get("expert_tensor_parallel") or 1) > 1]
    if not split:
        return []
    lines = ["", "| row with e_t > 1 | e_t | predicted peak GiB | GPU GiB | peak / GPU |", "|---|---:|---:|---:|---:|"]
    for p in split:
        peak, gpu = p["predicted_peak_memory_bytes"], p["gpu_memory_bytes"]
        shown = (
            f"{peak / 2**30:,.1f} | {gpu / 2**30:,.1f} | {peak / gpu:.2f}" if peak else f"— | {gpu / 2**30:,.1f} | —"
        )
        lines.append(f"| {p['id']} | {p['expert_tensor_parallel']} | {shown} |")
    return lines


def table(predictions: list[dict[str, Any]], free_rows: list[dict[str, Any]]) -> str:
    """The markdown tables: every row, then the free searches."""
    lines = [
        "| row (source) | model, tokens | GPUs | precision | published tok/s/GPU | predicted | published / predicted "
        "| error |",
        "|---|---|---:|---|---:|---:|---:|---:|",
    ]
    for p in predictions:
        predicted = f"{p['predicted_tokens_per_s_per_gpu']:,.0f}" if p["predicted_tokens_per_s_per_gpu"] else "—"
        ratio = f"{p['ratio']:.2f}" if p["ratio"] else "—"
        error = f"{1 / p['ratio'] - 1:+.0%}" if p["ratio"] else "—"
        if p.get("over_memory"):
            ratio += " (over the memory model)"
        lines.append(
            f"| {p['id']} ({p['source']}) | {p['model']}, {p['seq_length']} | {p['gpus']} {p['accelerator']} | "
            f"{p['precision']} | {p['published_tokens_per_s_per_gpu']:,.0f} | {predicted} | {ratio} | {error} |"
        )
    lines += expert_tensor_memory(predictions)
    lines += [
        "",
        "| case | planner's best layout | its tok/s/GPU | interval | search s (limit) |",
        "|---|---|---:|---|---:|",
    ]
    for f in free_rows:
        best = f"{f['best_tokens_per_s_per_gpu']:,.0f}" if f["best_tokens_per_s_per_gpu"] else "—"
        lines.append(
            f"| {f['id']} | {f['best_layout']} | {best} | {f['best_interval'] or '—'} | "
            f"{f['elapsed_s']} ({f['time_limit_s']:g}) |"
        )
    return "\n".join(lines)


#: Candidate host times of one MoE layer's forward (ms) for ``--fit-host`` (``SoftwareProfile.moe_layer_host_ms``).
HOST_GRID = (0.0, 1.0, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0)


def _median_log_error(predictions: list[dict[str, Any]]) -> float:
    return statistics.median(abs(math.log(p["ratio"])) for p in predictions) if predictions else 0.0


def fit_software(
    rows: list[dict[str, Any]],
    field: str,
    grid: tuple[float, ...],
    time_limit_s: float,
    *,
    default_kernels: bool = False,
    objective: Callable[[list[dict[str, Any]]], float] = _median_log_error,
) -> dict[str, Any]:
    """Fit the software profile's ``field`` on ``rows`` (the value of ``grid`` with the least ``objective``) and
    give its held-out error: each source predicted at the value fitted on the other sources (leave one source
    out), beside every row's prediction at each candidate."""
    by_value: dict[float, list[dict[str, Any]]] = {}
    for value in grid:
        catalogue = active_catalogue()
        software = catalogue.software.model_copy(update={field: value})
        with use_catalogue(catalogue.model_copy(update={"software": software})):
            by_value[value] = [predict(row, time_limit_s, default_kernels) for row in rows]
        print(json.dumps({field: value, "objective": objective(by_value[value])}))
    sources = sorted({row["source"] for row in rows})
    held_out: list[dict[str, Any]] = []
    chosen: dict[str, float] = {}
    for source in sources:

        def rest_error(value: float, source: str = source) -> float:
            return objective([p for p in by_value[value] if p["source"] != source])

        chosen[source] = min(grid, key=rest_error)
        held_out += [p for p in by_value[chosen[source]] if p["source"] == source]
    best = min(grid, key=lambda value: objective(by_value[value]))
    return {
        f"fitted_{field}": best,
        "chosen_without_source": chosen,
        "leave_one_source_out": _errors(held_out),
        "fit": _errors(by_value[best]),
        "grid": {str(value): _errors(predictions) for value, predictions in by_value.items()},
    }


def _is_moe(row: dict[str, Any]) -> bool:
    """Whether the row's model is a mixture of experts (its preset or its own fields)."""
    return bool(request_for(row, 1.0).model.is_moe)


def _fit(rows: list[dict[str, Any]], time_limit_s: float, *, default: bool) -> dict[str, Any]:
    """``--fit-host``: ``moe_layer_host_ms`` on the mixture-of-experts rows, each with its own kernels (with
    ``default``: kernels "unknown"; median |log error| over the rows). Written to ``bench/results/``."""
    fitted = fit_software(
        [row for row in rows if _is_moe(row)], "moe_layer_host_ms", HOST_GRID, time_limit_s, default_kernels=default
    )
    name = "cpep_moe_host_fit_default_kernels.json" if default else "cpep_moe_host_fit.json"
    (RESULTS / name).write_text(json.dumps(fitted, indent=1) + "\n")
    return fitted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--time-limit", type=float, default=10.0, help="search.time_limit_s of each pinned row")
    parser.add_argument("--free-time-limit", type=float, default=60.0, help="search.time_limit_s of each free search")
    parser.add_argument("--only", default="", help="rows whose id contains this")
    parser.add_argument("--no-free", action="store_true", help="skip the free searches")
    parser.add_argument("--output", type=Path, default=RESULTS / "cpep_bench.md")
    parser.add_argument("--fit-host", action="store_true", help="fit moe_layer_host_ms (leave one source out)")
    parser.add_argument("--default-kernels", action="store_true", help="leave training.kernels to its default")
    args = parser.parse_args()
    rows = [row for row in load_rows() if args.only in row["id"]]
    if args.fit_host:
        fitted = _fit(rows, args.time_limit, default=args.default_kernels)
        print(json.dumps({k: v for k, v in fitted.items() if k != "grid"}, indent=1))
        return
    predictions = []
    for row in rows:
        predictions.append(predict(row, args.time_limit, args.default_kernels))
        print(json.dumps(predictions[-1]), flush=True)
    free_rows = []
    if not args.no_free:
        for row in rows:
            if row["id"] in FREE_CASES:
                free_rows.append(free(row, args.free_time_limit))
                print(json.dumps(free_rows[-1]), flush=True)
    stats = summary(predictions)
    text = table(predictions, free_rows) + "\n\n" + json.dumps(stats, indent=1)
    args.output.write_text(text + "\n")
    args.output.with_suffix(".json").write_text(
        json.dumps({"predictions": predictions, "free": free_rows, "summary": stats}, indent=1) + "\n"
    )
    print(text)


if __name__ == "__main__":
    main()
