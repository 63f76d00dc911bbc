"""How many configurations of the planner bench and the CP/EP bench have the planner's lower bound above their
simulated step, and how close to it each bound comes (bound / step over the configurations), side by side: the
bound ``search`` prunes with (``Estimator.bound_ms``, after the quick ``Estimate.bound_ms``), the former one
(m × the even split's busiest rank + the heaviest rank's optimizer step) and the mean rank's (m × the mean rank's
F + I + W + the mean rank's optimizer step: the quick bound).

Each case's space (its published layout pinned, and the free searches of ``FREE_CASES`` / every planner bench
case) is prepared as ``plan`` prepares it, a CP/EP row's under the software its framework ran as the CP/EP bench
predicts it (``cpep_bench.run_catalogue``: its MoE dispatch, FSDP gradient sync, NeMo AutoModel's bf16 FSDP
state), and up to ``--per-case`` candidates, best estimate first, are simulated with memory not enforced.

``--rows`` checks instead every published calibration row (``optimizer/cost/calibration``), its layout as it ran
under its own software (FSDP prefetch and gradient sync), against its predicted step.

Run: ``python -m bench.bound_check [--per-case N] [--only SUBSTRING] [--rows]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator
from contextlib import nullcontext

from bench import cpep_bench, planner_bench
from pipesched.optimizer.calibration.predict import configuration, estimator, predict, run_software
from pipesched.optimizer.cost.calibration.measurements import builtin_measurements
from pipesched.optimizer.cost.profile import ProfileCatalogue, use_catalogue
from pipesched.optimizer.planner.evaluate import evaluate
from pipesched.optimizer.planner.rank import prepare
from pipesched.optimizer.planner.request import PlanRequest


def requests() -> Iterator[tuple[str, PlanRequest, ProfileCatalogue | None]]:
    """(name, request, the catalogue it runs under: ``None`` for the active one) of every bench case: pinned, and
    free where the bench runs a free search."""
    for name, preset, nodes, batch, pins, *_ in planner_bench.CASES:
        training = planner_bench.TRAINING[name]
        yield f"planner {name} pinned", planner_bench.request(preset, nodes, batch, 30.0, pins, training), None
        yield f"planner {name} free", planner_bench.request(preset, nodes, batch, 30.0, {}, training), None
    for row in cpep_bench.load_rows():
        catalogue = cpep_bench.run_catalogue(row)
        yield f"cpep {row['id']} pinned", cpep_bench.request_for(row, 30.0), catalogue
        if row["id"] in cpep_bench.FREE_CASES:
            yield f"cpep {row['id']} free", cpep_bench.request_for(row, 30.0, pinned=False), catalogue


def check_rows() -> None:
    """Bound over predicted step of every published calibration row (module docstring)."""
    ratios, above = [], []
    for row in builtin_measurements():
        with run_software(row):
            row_estimator, config = estimator(row), configuration(row)
            step = predict(row).step_time_ms
            if step is None:
                continue
            bound = max(row_estimator.bound_ms(config), row_estimator.estimate(config).bound_ms)
        ratios.append(bound / step)
        if bound > step * (1 + 1e-6):
            above.append(row.id)
            print(f"{row.id}: bound {bound:.3f} above step {step:.3f}")
    print(
        f"{len(ratios)} rows, {len(above)} above their step; bound/step median {statistics.median(ratios):.4f}, "
        f"mean {statistics.mean(ratios):.4f}, least {min(ratios):.4f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--per-case", type=int, default=8)
    parser.add_argument("--only", default="")
    parser.add_argument("--rows", action="store_true", help="check the calibration rows instead")
    args = parser.parse_args()
    if args.rows:
        check_rows()
        return
    totals = {"checked": 0, "former_above": 0, "bound_above": 0}
    ratios: dict[str, list[float]] = {"former": [], "mean": [], "bound": []}
    started = time.perf_counter()
    for name, request, catalogue in requests():
        if args.only not in name:
            continue
        with use_catalogue(catalogue) if catalogue is not None else nullcontext():
            try:
                prepared = prepare(request)
            except ValueError as error:
                print(f"{name}: no candidates ({str(error).splitlines()[0]})")
                continue
            estimator = prepared.estimator
            for config, estimate in prepared.candidates[: args.per_case]:
                evaluation = evaluate(estimator, config, estimate, time_limit_s=5.0, enforce_memory=False)
                if evaluation.plan is None:
                    continue
                step = evaluation.plan.step_time_ms
                layout = estimator.layout(config)
                former = config.num_microbatches * layout.rank_compute_ms + estimator.optimizer_ms(config, layout)
                mean_step = estimator.rank_optimizer_ms(config, layout.mean_parameters, layout.mean_expert_parameters)
                mean = config.num_microbatches * layout.mean_compute_ms + mean_step
                bound = estimator.bound_ms(config)
                for label, value in (("former", former), ("mean", mean), ("bound", bound)):
                    ratios[label].append(value / step)
                totals["checked"] += 1
                totals["former_above"] += former > step * (1 + 1e-6)
                totals["bound_above"] += bound > step * (1 + 1e-6) or estimate.bound_ms > step * (1 + 1e-6)
                if former > step * (1 + 1e-6) or bound > step * (1 + 1e-6):
                    print(f"{name}: {config} step {step:.3f} former {former:.3f} bound {bound:.3f}")
    print(f"{totals} in {time.perf_counter() - started:.0f} s")
    for label, values in ratios.items():
        if values:
            ordered = sorted(values)
            print(
                f"{label}/step: mean {sum(values) / len(values):.4f}, median {ordered[len(values) // 2]:.4f}, "
                f"least {ordered[0]:.4f}, most {ordered[-1]:.4f}"
            )


if __name__ == "__main__":
    main()
