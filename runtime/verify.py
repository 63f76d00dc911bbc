"""Verify a pipelined run against a single-process, non-pipelined run of the same model and data.

Checked (contract, Run report): the loss and every parameter's gradient against the reference (fp32 on
CPU: max relative error ≤ 1e-5), each rank's executed order against the schedule, and reported: the
measured start/end of every action, the peak memory per rank (GPU: ``torch.cuda.max_memory_allocated``;
CPU: the peak bytes of live saved activations, via saved-tensor hooks) and the predicted vs measured
makespan, plus the makespan the project's simulator predicts from the measured per-stage costs.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from pipesched.optimizer.instance import compile_problem
from pipesched.optimizer.ir import parse_action
from pipesched.optimizer.result import Schedule
from pipesched.optimizer.simulate import simulate
from pipesched.optimizer.units import common_unit
from pipesched.runtime.models import PipelineModel

__all__ = ["build_report", "compare_gradients", "measured_costs", "print_report", "reference_run"]

#: Max relative error of loss and gradients accepted per device type (fp32).
TOLERANCE = {"cpu": 1e-5, "cuda": 1e-4}


def reference_run(model: PipelineModel, num_microbatches: int) -> tuple[float, dict[str, torch.Tensor]]:
    """The step without a pipeline: every microbatch through model stages 0 … S−1 in one process.

    Returns the mean loss over microbatches and ``"{model stage}/{parameter}"`` → gradient of that
    mean loss (fp32, CPU).
    """
    modules = [model.build_stage(stage) for stage in range(model.num_model_stages)]
    losses = []
    for microbatch in range(num_microbatches):
        x, target = model.make_microbatch(microbatch)
        for module in modules:
            x = module(x)
        loss = model.loss_fn(x, target)
        (loss / num_microbatches).backward()
        losses.append(float(loss.detach()))
    gradients = {
        f"{stage}/{name}": parameter.grad.detach().float().clone()
        for stage, module in enumerate(modules)
        for name, parameter in module.named_parameters()
        if parameter.grad is not None
    }
    return sum(losses) / num_microbatches, gradients


def compare_gradients(
    gradients: dict[str, torch.Tensor], model_stage: list[int], reference: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """Compare pipelined gradients with the reference.

    ``gradients`` are keyed ``"{stage id}/{name}"``; stage ids map onto model stages by ``model_stage``
    (bidirectional replicas' gradients of one model stage are summed, as the all-reduce between
    mirrored ranks would). Relative error of a parameter: ``max|g − g_ref| / max|g_ref|``.

    Returns ``{"max_abs_grad_error", "max_rel_grad_error", "worst_parameter", "missing", "unexpected"}``.
    """
    summed: dict[str, torch.Tensor] = {}
    for key, gradient in gradients.items():
        stage, name = key.split("/", 1)
        model_key = f"{model_stage[int(stage)]}/{name}"
        summed[model_key] = gradient.clone() if model_key not in summed else summed[model_key] + gradient
    max_abs = max_rel = 0.0
    worst = None
    for key, expected in reference.items():
        if key not in summed:
            continue
        difference = float((summed[key] - expected).abs().max())
        scale = float(expected.abs().max())
        relative = difference / scale if scale > 0 else difference
        max_abs = max(max_abs, difference)
        if relative >= max_rel:
            max_rel, worst = relative, key
    return {
        "max_abs_grad_error": max_abs,
        "max_rel_grad_error": max_rel,
        "worst_parameter": worst,
        "missing": sorted(set(reference) - set(summed)),
        "unexpected": sorted(set(summed) - set(reference)),
    }


def measured_costs(schedule: Schedule, ranks: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per-stage median measured duration (ms) of F, I, W and B, indexed by stage id (0.0 where unseen)."""
    num_ids = len(schedule.stage_to_rank)
    samples: dict[str, list[list[float]]] = {kind: [[] for _ in range(num_ids)] for kind in "FIWB"}
    for rank in ranks:
        for record in rank["actions"]:
            action = parse_action(record["action"])
            samples[action.kind.value][action.stage].append(record["end"] - record["start"])
    return {kind: [statistics.median(s) if s else 0.0 for s in per_stage] for kind, per_stage in samples.items()}


def _simulate_with_measured(schedule: Schedule, costs: dict[str, list[float]]) -> float | None:
    problem = schedule.problem
    inst = compile_problem(problem)
    num_model = problem.pipeline.num_stages

    def per_model_stage(values: list[float]) -> list[float]:
        # Bidirectional ids S…2S−1 run the same model stages: take the larger measured value.
        merged = [0.0] * num_model
        for stage_id, value in enumerate(values):
            model_stage = inst.model_stage[stage_id]
            merged[model_stage] = max(merged[model_stage], value)
        return merged

    if problem.split_backward:
        forward, backward_input, backward_weight = (per_model_stage(costs[k]) for k in "FIW")
    else:
        forward, backward_input = per_model_stage(costs["F"]), per_model_stage(costs["B"])
        backward_weight = [0.0] * num_model
    try:
        measured = problem.with_changes(
            **{
                "costs.forward": forward,
                "costs.backward_input": backward_input,
                "costs.backward_weight": backward_weight,
                "costs.p2p": 0.0,
                "memory.limit": None,
            }
        )
        return simulate(compile_problem(measured), schedule.orders(), check_memory=False).makespan
    except Exception:
        return None


def build_report(
    schedule: Schedule,
    ranks: list[dict[str, Any]],
    losses: dict[int, float],
    gradients: dict[str, torch.Tensor],
    reference_loss: float,
    reference_gradients: dict[str, torch.Tensor],
    *,
    backend: str,
    device: str,
    engine: str,
    model_name: str,
) -> dict[str, Any]:
    """The run report of the contract (plus diagnostics).

    ``ranks``: per rank ``{"rank", "peak_memory_bytes", "actions": [{"action", "start", "end", …}], "executed"}``,
    times in ms from the common start. ``losses``: microbatch → loss from the last-stage ranks.
    """
    inst = compile_problem(schedule.problem)
    comparison = compare_gradients(gradients, inst.model_stage, reference_gradients)
    # Without training the run executes the passes only (UNSHARD/RESHARD/REDUCE_GRAD/OPTIMIZER_STEP are skipped
    # with a note: nothing to reduce or step), so the passes are what is compared.
    passes = {"F", "I", "W", "B"}
    expected_orders = [[a.action for a in rank.actions if a.kind in passes] for rank in schedule.ranks]
    mismatches = []
    for rank in ranks:
        executed = [
            action
            for action in (rank.get("executed") or [a["action"] for a in rank["actions"]])
            if parse_action(action).is_compute
        ]
        if executed != expected_orders[rank["rank"]]:
            position = next(
                (k for k, (a, b) in enumerate(zip(executed, expected_orders[rank["rank"]], strict=False)) if a != b),
                min(len(executed), len(expected_orders[rank["rank"]])),
            )
            mismatches.append({"rank": rank["rank"], "position": position})
    m = inst.num_microbatches
    # Bidirectional schedules compute every microbatch's loss once, on the replica it passes.
    # With a loss missing there is no step loss (None: JSON has no NaN) and the run is not verified.
    missing_losses = sorted(set(range(m)) - set(losses))
    loss = sum(losses.values()) / m if not missing_losses else None
    tolerance = TOLERANCE["cuda" if device.startswith("cuda") else "cpu"]
    loss_error = None if loss is None else abs(loss - reference_loss) / max(abs(reference_loss), 1e-30)
    starts = [a["start"] for rank in ranks for a in rank["actions"]]
    ends = [a["end"] for rank in ranks for a in rank["actions"]]
    measured_makespan = (max(ends) - min(starts)) if starts else 0.0
    costs = measured_costs(schedule, ranks)
    verified = (
        not mismatches
        and not comparison["missing"]
        and not comparison["unexpected"]
        and comparison["max_rel_grad_error"] <= tolerance
        and loss_error is not None
        and loss_error <= tolerance
    )
    return {
        "verified": bool(verified),
        "max_abs_grad_error": comparison["max_abs_grad_error"],
        "max_rel_grad_error": comparison["max_rel_grad_error"],
        "worst_parameter": comparison["worst_parameter"],
        "missing_gradients": comparison["missing"],
        "tolerance": tolerance,
        "loss": loss,
        "reference_loss": reference_loss,
        "loss_rel_error": loss_error,
        "missing_losses": missing_losses,
        "executed_order_matches": not mismatches,
        "order_mismatches": mismatches,
        "ranks": [
            {
                "rank": rank["rank"],
                "peak_memory_bytes": rank["peak_memory_bytes"],
                "predicted_peak_memory_bytes": schedule.peak_memory[rank["rank"]] if schedule.peak_memory else None,
                # Saved activations exclude weights, so they compare with the predicted peak less static.
                "predicted_peak_activation_bytes": (
                    schedule.peak_memory[rank["rank"]] - schedule.problem.static_memory[rank["rank"]]
                    if schedule.peak_memory
                    else None
                ),
                "memory_measure": rank.get("memory_measure", "saved-activations"),
                "actions": rank["actions"],
            }
            for rank in sorted(ranks, key=lambda r: r["rank"])
        ],
        "predicted_makespan_ms": schedule.makespan,
        "measured_makespan_ms": round(measured_makespan, 6),
        "simulated_makespan_from_measured_costs_ms": _simulate_with_measured(schedule, costs),
        "measured_costs_ms": costs,
        "method": schedule.method,
        "model": model_name,
        "engine": engine,
        "backend": backend,
        "device": device,
        "torch_version": torch.__version__,
    }


def print_report(report: dict[str, Any], console: Console | None = None) -> None:
    """A one-screen summary of a run report."""
    console = console or Console()
    verdict = "[bold green]verified[/bold green]" if report["verified"] else "[bold red]NOT verified[/bold red]"
    console.print(
        f"{verdict} · {report.get('method', '?')} · {len(report['ranks'])} ranks · {report['backend']} on "
        f"{report['device']} · engine {report.get('engine', '?')} · model {report.get('model', '?')}",
        highlight=False,
    )
    loss = report["loss"]
    loss_text = (
        f"{loss:.8g}"
        if loss is not None
        else f"missing for microbatch(es) {', '.join(map(str, report.get('missing_losses', [])))}"
    )
    console.print(
        f"loss {loss_text} (reference {report['reference_loss']:.8g}) · max gradient error "
        f"{report['max_abs_grad_error']:.3g} abs, {report['max_rel_grad_error']:.3g} rel (tolerance "
        f"{report['tolerance']:g}) · executed order {'matches' if report['executed_order_matches'] else 'DIFFERS'}",
        highlight=False,
    )
    simulated = report.get("simulated_makespan_from_measured_costs_ms")
    console.print(
        f"makespan: predicted {report['predicted_makespan_ms']:.3f} ms · measured "
        f"{report['measured_makespan_ms']:.3f} ms"
        + ("" if simulated is None else f" · simulated from measured costs {simulated:.3f} ms"),
        highlight=False,
    )
    activations_only = all(r.get("memory_measure", "saved-activations") == "saved-activations" for r in report["ranks"])
    measured_title, predicted_key = (
        ("peak activations", "predicted_peak_activation_bytes")
        if activations_only
        else ("peak memory", "predicted_peak_memory_bytes")
    )
    table = Table(show_header=True, header_style="bold", title=f"per rank · {measured_title}, measured and predicted")
    shown = report["ranks"][:16]
    unit_name, unit = common_unit(
        [r["peak_memory_bytes"] for r in shown] + [r[predicted_key] for r in shown if r.get(predicted_key) is not None]
    )
    for column in (
        "rank",
        "actions",
        "busy ms",
        "first start ms",
        "last end ms",
        f"measured {unit_name}",
        f"predicted {unit_name}",
    ):
        table.add_column(column, justify="right")
    for rank in shown:
        actions = rank["actions"]
        busy = sum(a["end"] - a["start"] for a in actions)
        predicted = rank.get(predicted_key)
        table.add_row(
            str(rank["rank"]),
            str(len(actions)),
            f"{busy:.3f}",
            f"{actions[0]['start']:.3f}" if actions else "—",
            f"{actions[-1]['end']:.3f}" if actions else "—",
            f"{rank['peak_memory_bytes'] / unit:.3f}",
            "—" if predicted is None else f"{predicted / unit:.3f}",
        )
    console.print(table)
    if report.get("order_mismatches"):
        console.print(f"order mismatches: {report['order_mismatches']}", highlight=False)
    if report.get("missing_gradients"):
        console.print(f"missing gradients: {report['missing_gradients'][:5]}", highlight=False)
