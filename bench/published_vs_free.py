"""Does a free plan search beat the published layouts it should? (issues 24, 28)

The bar: a free ``pipesched plan`` search of a job returns a best plan whose predicted tokens/s per GPU is at least
what the same planner predicts for the published layout of that job. For each case below (a published run of the
calibration data: ``optimizer/cost/calibration/data/*.json`` and ``bench/data/calibration_holdout*.json``, each
row with its source), the planner is asked with the same model, cluster, global batch, precision, kernels,
gradient-reduction dtype and the run's all-to-all dispatch (``bench.cpep_bench.request_for`` and
``run_catalogue``):

- **pinned**: every dimension of the published layout pinned in ``search`` (pipeline, tensor, context, expert and
  data-parallel sizes, sharding, chunks per rank and placement, schedule, micro-batch size, recomputation where
  the source states it; the run's own layer split where it states one);
- **free**: nothing pinned, ``search.top`` and ``search.time_limit_s`` at their defaults (5 plans, 60 s);
- **same degrees, rest free**: the published pipeline, tensor, context, expert and data-parallel degrees pinned,
  everything else searched (a smaller space that holds the published configuration where its chunk count is one
  the search enumerates: 1, 2, 4, 8 or a V).

A ratio search / pinned below 0.995 is a search that lost the published layout (``lost`` in the table). A
published layout the planner's memory model refuses is said with the check and the bytes: its least estimated
peak over the pinned configurations against the GPU's limit (memory less headroom), that configuration's
simulated peak, and its time with memory not enforced (``bench.cpep_bench.unenforced``), which the searches' best
is then set beside. Every search's wall time is set beside ``time_limit_s`` + 2 s. With a loss, the row says where
the search left the published configuration (``diagnosis``, unless ``--no-diagnose``): enumerated or not (a large
space is sampled), fitting by the memory estimate, its place in the estimate order, its quick and tight bounds
against the search's best step.

Run: ``python -m bench.published_vs_free [--time-limit S] [--only SUBSTRING ...] [--searches free,degrees]
[--output FILE.json]`` (prints the table; ``--output`` writes the rows as JSON and the table beside it as ``.md``,
keeping from an earlier run there what is not run now).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from bench.cpep_bench import describe, request_for, run_catalogue, unenforced
from pipesched.optimizer.cost.profile import use_catalogue
from pipesched.optimizer.planner.evaluate import evaluate
from pipesched.optimizer.planner.rank import estimator_for, plan, prepare, space_of
from pipesched.optimizer.planner.request import Plan, PlanRequest, PlanSearch
from pipesched.optimizer.planner.space import DIMENSIONS, Configuration

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "optimizer" / "cost" / "calibration" / "data"
HOLDOUT = ROOT / "bench" / "data"
RESULTS = Path(__file__).resolve().parent / "results"
GIB = 1024**3

#: (row id, short name): well-known published jobs, one per model family and scale.
CASES: tuple[tuple[str, str], ...] = (
    ("torchtitan-8b-8-fsdp", "Llama 3.1 8B, 8 H100, torchtitan FSDP 8"),
    ("torchtitan2506-8b-64-fsdp8-tp8-bf16", "Llama 3.1 8B, 64 H100, torchtitan FSDP 8 × TP 8"),
    ("torchtitan-70b-256-2d", "Llama 3.1 70B, 256 H100, torchtitan FSDP 32 × TP 8, FP8"),
    ("mbridge2509-llama3-70b-64-h100", "Llama 3.1 70B, 64 H100, Megatron Bridge PP 8 × VP 5 × TP 4, FP8"),
    ("torchtitan-405b-512-3d-1f1b", "Llama 3.1 405B, 512 H100, torchtitan PP 8 × TP 8 × FSDP 8, FP8"),
    ("llama3-405b-16384-cp1-s8192", "Llama 3.1 405B, 16,384 H100, 8K (Llama 3 report Table 4)"),
    ("llama3-405b-16384-cp16-s131072", "Llama 3.1 405B, 16,384 H100, 131K, CP 16 (Table 4)"),
    ("nemo2407-gpt3-175b-512", "GPT-3 175B, 512 H100, NeMo 24.07, FP8"),
    ("nemo2407-nemotron-340b-128", "Nemotron-4 340B, 128 H100, NeMo 24.07, FP8"),
    ("modelzoo-h100-235b-tp2-ep32-pp8-vpp4-deepep", "Qwen3-235B-A22B, 256 H100, Megatron MoE Model Zoo"),
    ("nemo2502-mixtral-8x7b-64-b200-ep8", "Mixtral 8x7B, 64 B200, NeMo 25.02, EP 8, FP8"),
    ("mbridge2509-deepseek-v3-1024-h100-tp2pp8cp1vp4ep64-gbs8192-mbs1", "DeepSeek-V3, 1,024 H100, Megatron Bridge"),
    ("automodel-h100-qwen3-30b-a3b-8", "Qwen3-30B-A3B, 8 H100, NeMo AutoModel FSDP 8 × EP 8"),
    ("torchtitan2404-llama3-8b-64-fsdp-sac-op", "Llama 3 8B, 64 A100, torchtitan FSDP 64"),
)

#: What the written table says of itself (``--output``).
HEADER = (
    "Free plan searches against the planner on the published layout of each job (`python -m "
    "bench.published_vs_free --output bench/results/published_vs_free.json`; 60 s per search, default top 5, on "
    "the project's 2-core machine under the team's lock, one case per run; each row's own kernels, gradient "
    'dtype and all-to-all dispatch as `bench/cpep_bench.py` plans it). "Same degrees, rest free": the published '
    "pipeline, tensor, context, expert and data-parallel degrees pinned, the rest searched. A ratio below 0.995 "
    "is a search that lost the published layout (**lost**).\n\n"
)

#: A free best below this share of the pinned published layout's prediction is a loss.
LOSS_TOLERANCE = 0.995


def load_rows() -> dict[str, dict[str, Any]]:
    """Every published row of the calibration data and the held-out files, by id, each with its ``source`` id."""
    documents = [json.loads(path.read_text()) for path in sorted(DATA.glob("*.json"))]
    for path in sorted(HOLDOUT.glob("calibration_holdout*.json")):
        documents += json.loads(path.read_text())["files"]
    return {
        row["id"]: {**row, "source": document["source"]["id"]}
        for document in documents
        for row in document.get("rows", [])
    }


def configuration_of(plan_: Plan) -> Configuration:
    """The planner configuration a plan answers."""
    return Configuration(
        plan_.pipeline_parallel,
        plan_.tensor_parallel,
        plan_.data_parallel.size,
        plan_.data_parallel.sharding,
        plan_.stages_per_rank,
        plan_.placement,
        plan_.micro_batch_size,
        plan_.num_microbatches,
        plan_.activation_recomputation,
        plan_.method,
        precision=plan_.precision,
        context_parallel=plan_.context_parallel,
        expert_parallel=plan_.expert_parallel,
    )


def memory_refusal(request: PlanRequest) -> dict[str, Any]:
    """Why the pinned request has no plan by memory: the least estimated peak over its configurations against the
    GPU's limit (memory less the headroom; the check that prunes before simulation,
    :meth:`~pipesched.optimizer.planner.prune.Estimator.estimate`), the configuration that needs it, and that
    configuration's simulated peak with memory not enforced (the check after simulation)."""
    estimator = estimator_for(request)
    estimates = [(config, estimator.estimate(config)) for config in space_of(request, estimator)]
    if not estimates:
        return {"check": "no configuration admits the pins"}
    config, least = min(estimates, key=lambda item: item[1].peak_memory_bytes)
    simulated = evaluate(estimator, config, least, time_limit_s=request.search.time_limit_s, enforce_memory=False)
    peak = simulated.plan.peak_memory_bytes if simulated.plan else None
    return {
        "check": "Estimator.estimate: static + activations in flight over the GPU's memory less headroom",
        "least_peak_gib": round(least.peak_memory_bytes / GIB, 1),
        "limit_gib": round(estimator.limit_bytes / GIB, 1),
        "over_by_gib": round((least.peak_memory_bytes - estimator.limit_bytes) / GIB, 1),
        "over_by": round(least.peak_memory_bytes / estimator.limit_bytes - 1, 3),
        "simulated_peak_gib": round(peak / GIB, 1) if peak else None,
        "simulated_over_by": round(peak / estimator.limit_bytes - 1, 3) if peak else None,
        "configuration": config.as_dict(),
    }


def diagnose(free_request: PlanRequest, published: Configuration, free_best_ms: float) -> dict[str, Any]:
    """Where the free search left the published configuration: enumerated (within the enumeration's share of the
    time), estimated (a large space is sampled), fitting by estimate, its place in the estimate order, and its
    quick and tight bounds against the free search's best step (the search prunes a configuration whose bound is
    at or above the k-th best step)."""
    prepared = prepare(free_request)
    estimator = prepared.estimator
    order = [config for config, _ in prepared.candidates]
    enumerated = any(config == published for config in space_of(free_request, estimator))
    estimate = estimator.estimate(published) if enumerated else None
    return {
        "enumerated": enumerated,
        "candidates": len(order),
        "candidate_position": order.index(published) if published in order else None,
        "fits_by_estimate": estimate.fits if estimate else None,
        "estimate_ms": round(estimate.estimate_ms, 2) if estimate else None,
        "quick_bound_ms": round(estimate.bound_ms, 2) if estimate else None,
        "tight_bound_ms": round(estimator.bound_ms(published), 2) if enumerated else None,
        "free_best_step_ms": round(free_best_ms, 2),
        "notes": prepared.notes,
    }


#: The published layout's parallel degrees: what a search "same degrees, the rest free" keeps pinned.
DEGREES = ("pipeline_parallel", "tensor_parallel", "context_parallel", "expert_parallel", "data_parallel_size")


def run_case(
    row: dict[str, Any], name: str, time_limit_s: float, pinned_limit_s: float, explain: bool, searches: set[str]
) -> dict[str, Any]:
    """One case: the pinned published layout, and the searches named in ``searches``: ``free`` (nothing pinned)
    and ``degrees`` (the published parallel degrees pinned, the rest free: a smaller space that holds the
    published configuration where its chunk count is one the search enumerates), with the same model, cluster,
    batch and software."""
    published = row["measured"]["tokens_per_s_per_gpu"]
    result: dict[str, Any] = {"id": row["id"], "case": name, "source": row["source"], "published": published}
    with use_catalogue(run_catalogue(row)):
        pinned_request = request_for(row, pinned_limit_s)
        started = time.perf_counter()
        try:
            pinned = plan(pinned_request).answer
            pinned_plan, refusal = (pinned.plans[0] if pinned.plans else None), pinned.error
        except ValidationError as exc:
            pinned_plan, refusal = None, "; ".join(str(item["msg"]) for item in exc.errors())[:400]
        result["pinned_s"] = round(time.perf_counter() - started, 1)
        if pinned_plan is None:
            result["refused"] = refusal
            result["memory"] = memory_refusal(pinned_request)
            result["unenforced_tokens_per_s_per_gpu"] = unenforced(row, pinned_limit_s)
        else:
            result["pinned"] = _plan_fields(pinned_plan)
        pinned_search = pinned_request.search
        requests = {
            "free": request_for(row, time_limit_s, pinned=False),
            "degrees": pinned_request.model_copy(
                update={
                    "search": pinned_search.model_copy(
                        update={name: None for name in PlanSearch.model_fields if name in DIMENSIONS}
                        | {name: getattr(pinned_search, name) for name in DEGREES}
                    )
                }
            ),
        }
        for kind in ("free", "degrees"):
            if kind in searches:
                result.update(_searched(kind, requests[kind], time_limit_s, pinned_plan, result, explain))
    return result


def _searched(
    kind: str,
    request: PlanRequest,
    time_limit_s: float,
    pinned_plan: Plan | None,
    result: dict[str, Any],
    explain: bool,
) -> dict[str, Any]:
    """One search of a case (``free`` or ``degrees``) at the default top 5 and ``time_limit_s``, its best plan set
    beside the pinned published layout's (a loss below :data:`LOSS_TOLERANCE`, located by :func:`diagnose`) or,
    where memory refused that layout, beside its time with memory not enforced."""
    prefix = "" if kind == "free" else f"{kind}_"
    request = request.model_copy(
        update={"search": request.search.model_copy(update={"top": 5, "time_limit_s": time_limit_s})}
    )
    started = time.perf_counter()
    answer = plan(request).answer
    wall = time.perf_counter() - started
    best = answer.plans[0] if answer.plans else None
    out: dict[str, Any] = {
        kind: _plan_fields(best) if best else {"error": answer.error},
        f"{kind}_notes": answer.notes,
        f"{prefix}searched": answer.searched.model_dump(),
        "time_limit_s": time_limit_s,
        f"{prefix}wall_s": round(wall, 1),
        f"{prefix}within_limit": wall <= time_limit_s + 2.0,
    }
    out.update(_ratios(kind, {**result, **out}))
    if best and pinned_plan and out.get(f"{prefix}lost") and explain:
        out[f"{prefix}diagnosis"] = diagnose(request, configuration_of(pinned_plan), best.step_time_ms)
    return out


def _plan_fields(plan_: Plan) -> dict[str, Any]:
    return {
        "layout": describe(plan_),
        "tokens_per_s_per_gpu": plan_.tokens_per_s_per_gpu,
        "interval": plan_.tokens_per_s_per_gpu_interval,
        "mfu": plan_.mfu,
        "peak_gib": round(plan_.peak_memory_bytes / GIB, 1),
        "step_ms": plan_.step_time_ms,
        "configuration": configuration_of(plan_).as_dict(),
    }


def _best(found: dict[str, Any] | None) -> str:
    if not found:
        return "not run"
    if "layout" not in found:
        return str(found.get("error"))
    low, high = found["interval"]
    return f"{found['layout']}: {found['tokens_per_s_per_gpu']:,.0f} [{low:,.0f}–{high:,.0f}]"


def _ratio(row: dict[str, Any], kind: str, lost: str) -> str:
    ratio, unenforced = row.get(f"{kind}_over_pinned"), row.get(f"{kind}_over_unenforced")
    text = f"{ratio:.3f}{' **lost**' if row.get(lost) else ''}" if ratio else "—"
    return text + (f" ({unenforced:.3f} of memory not enforced)" if unenforced else "")


def _counts(row: dict[str, Any], prefix: str) -> str:
    searched, wall, within = (row.get(f"{prefix}{name}") for name in ("searched", "wall_s", "within_limit"))
    if not searched:
        return "—"
    limit = row["time_limit_s"]
    return (
        f"{searched['enumerated']:,}, {searched['pruned_memory']:,} / {searched['pruned_bound']:,}, "
        f"{searched['solved']}, {searched['unexplored']:,}; {wall} s ({limit + 2:g}){'' if within else ' **over**'}"
    )


def table(rows: list[dict[str, Any]]) -> str:
    """The cases side by side (markdown)."""
    lines = [
        "| case (row) | published tok/s/GPU | planner on the published layout [80% interval] (MFU, GiB) | free best "
        "[interval] | free / pinned | free: enumerated, pruned memory / bound, simulated, unexplored; wall s "
        "(limit + 2) | same degrees, rest free: best | / pinned | its counts; wall s |",
        "|---|---:|---:|---|---:|---|---|---:|---|",
    ]
    for row in rows:
        pinned = row.get("pinned")
        if pinned:
            low, high = pinned["interval"]
            ours = (
                f"{pinned['tokens_per_s_per_gpu']:,.0f} [{low:,.0f}–{high:,.0f}] ({pinned['mfu']:.0%}, "
                f"{pinned['peak_gib']})"
            )
        else:
            memory = row["memory"]
            ours = (
                f"refused by memory: estimated peak {memory.get('least_peak_gib')} GiB, simulated "
                f"{memory.get('simulated_peak_gib')}, of the {memory.get('limit_gib')} GiB a GPU offers; "
                f"{row['unenforced_tokens_per_s_per_gpu'] or 0:,.0f} with memory not enforced"
            )
        lines.append(
            f"| {row['case']} (`{row['id']}`) | {row['published']:,.0f} | {ours} | {_best(row.get('free'))} | "
            f"{_ratio(row, 'free', 'lost')} | "
            f"{_counts(row, '')} | "
            f"{_best(row.get('degrees'))} | {_ratio(row, 'degrees', 'degrees_lost')} | "
            f"{_counts(row, 'degrees_')} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--time-limit", type=float, default=60.0, help="search.time_limit_s of each search")
    parser.add_argument("--pinned-time-limit", type=float, default=20.0, help="of each pinned search")
    parser.add_argument("--only", action="append", help="cases whose row id contains this (repeatable)")
    parser.add_argument(
        "--searches",
        default="free,degrees",
        help="which searches beside the pinned one: free (nothing pinned), degrees (the published degrees pinned)",
    )
    parser.add_argument("--no-diagnose", action="store_true", help="skip locating a lost published layout")
    parser.add_argument(
        "--output",
        type=Path,
        help="write the rows as JSON (and the table as .md beside it); what is not run now is kept from there",
    )
    args = parser.parse_args()
    data = load_rows()
    searches = set(args.searches.split(","))
    rows = []
    for row_id, name in CASES:
        if not args.only or any(part in row_id for part in args.only):
            row = run_case(data[row_id], name, args.time_limit, args.pinned_time_limit, not args.no_diagnose, searches)
            rows.append(row)
            print(json.dumps(row, default=str), flush=True)
    if args.output:
        rows = merged(args.output, rows)
        args.output.write_text(json.dumps(rows, indent=1, default=str) + "\n")
        args.output.with_suffix(".md").write_text(HEADER + table(rows) + "\n")
    print(table(rows))


def merged(path: Path, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` over ``path``'s earlier run, case by case and field by field (a search not run now keeps its
    earlier result: ``--only``, ``--searches``), in the order of :data:`CASES`."""
    kept = {row["id"]: row for row in json.loads(path.read_text())} if path.exists() else {}
    for row in rows:
        kept[row["id"]] = {**_without_the_pinned_run(kept.get(row["id"], {})), **row}
        for kind in ("free", "degrees"):
            if kind not in row:
                kept[row["id"]].update(_ratios(kind, kept[row["id"]]))
    return [kept[row_id] for row_id, _ in CASES if row_id in kept]


#: A case's fields from its pinned search (run every time), which an earlier run's must not outlive.
PINNED_FIELDS = ("pinned", "pinned_s", "refused", "memory", "unenforced_tokens_per_s_per_gpu")


def _without_the_pinned_run(row: dict[str, Any]) -> dict[str, Any]:
    """An earlier run's row less what its pinned search gave and the ratios to it (``…_over_pinned``,
    ``…_over_unenforced``, ``…lost``): a layout refused then may fit now, and the reverse."""
    return {
        key: value
        for key, value in row.items()
        if key not in PINNED_FIELDS and not key.endswith(("_over_pinned", "_over_unenforced", "lost"))
    }


def _ratios(kind: str, row: dict[str, Any]) -> dict[str, Any]:
    """A search's best (``kind``) beside the pinned published layout's figure (``…_over_pinned``, a loss below
    :data:`LOSS_TOLERANCE`) or, where memory refused that layout, beside its time with memory not enforced
    (``…_over_unenforced``)."""
    best = (row.get(kind) or {}).get("tokens_per_s_per_gpu")
    prefix = "" if kind == "free" else f"{kind}_"
    if not best:
        return {}
    if row.get("pinned"):
        ratio = best / row["pinned"]["tokens_per_s_per_gpu"]
        return {f"{kind}_over_pinned": round(ratio, 4), f"{prefix}lost": ratio < LOSS_TOLERANCE}
    if row.get("unenforced_tokens_per_s_per_gpu"):
        return {f"{kind}_over_unenforced": round(best / row["unenforced_tokens_per_s_per_gpu"], 4)}
    return {}


if __name__ == "__main__":
    main()
