"""From a fit to the catalogue the planner reads: every accelerator's profile, its interval and its MFU ceiling.

- **Fitted** accelerators take the fitted efficiencies (:mod:`.fit`).
- **Unmeasured** ones (no public run with a layout in ``data/``) borrow from their nearest measured sibling,
  said in their ``source``: H100-PCIe and H200 are the H100's die (GH100) and take its efficiencies over their
  own peaks and bandwidth; L40S takes the A100's; MI300X takes the H100's matrix-multiply efficiencies scaled
  by 0.7 (AMD's hipBLASLt reaches about 70% of what cuBLAS does of its peak in public GEMM sweeps; an estimate,
  not a fit). Their interval is the pooled one widened by half.
- **Interval**: the 10th and 90th percentile of the accelerator's leave-one-group-out log(published /
  predicted), pooled over all rows when it has fewer than :data:`MIN_ROWS_FOR_OWN_INTERVAL`.
- **Memory**: ``activation_memory_factor`` fitted (one number for all: it is PyTorch's caching allocator and
  the framework, not the chip) to the published peaks, minimising Σ log(published / predicted)².
- **Unknown kernels**: the elementwise traffic of kernels mode ``unknown`` (the default: a layout given without
  its framework) is the one factor that best predicts every row with its own mode ignored (golden-section
  search on its logarithm, least squares of log(published / predicted)). What is unknown is the framework, so
  each kernels mode the rows ran (eager, compiled, fused) weighs the same, and within a mode each
  source-and-accelerator group (:func:`framework_weights`): weighing groups alone counted tables, and the
  fused Megatron/NeMo tables outnumber the torchtitan ones, which left every eager or compiled torchtitan run
  predicted 14–30% too fast. The 10th and 90th percentile of those rows' log(published / predicted), with
  the same weights (the spread between frameworks, not within MosaicML's many rows), become the least
  interval of a plan in that mode (one parameter over hundreds of rows: its held-out error is its fit error
  within a percent).
- **MFU ceiling**: the highest MFU (the planner's definition, 6·N + 12·l·h·s per token over the bf16 peak) a row
  of the accelerator reached, by precision.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from pipesched.optimizer.accelerators import CATALOGUE
from pipesched.optimizer.calibration.fit import FitResult, predict_rows, quantile, weighted_quantile
from pipesched.optimizer.calibration.predict import estimator, kernels_mode, predict
from pipesched.optimizer.cost.calibration.measurements import Measurement
from pipesched.optimizer.cost.profile import AcceleratorProfile, ProfileCatalogue, use_catalogue
from pipesched.optimizer.planner.evaluate import model_flops_per_token

__all__ = [
    "BORROWED",
    "MIN_ROWS_FOR_OWN_INTERVAL",
    "build_catalogue",
    "fit_memory_factor",
    "fit_unknown_kernels",
    "framework_weights",
    "measured_mfu",
]

#: Rows an accelerator needs for an interval of its own.
MIN_ROWS_FOR_OWN_INTERVAL = 20

#: Unmeasured accelerator → (measured sibling, scale of its matrix-multiply and attention efficiencies, why).
BORROWED: dict[str, tuple[str, float, str]] = {
    "H100-PCIe": ("H100-SXM", 1.0, "the H100-SXM's efficiencies (same GH100 die) over the PCIe card's peaks"),
    "H200": ("H100-SXM", 1.0, "the H100-SXM's efficiencies (same GH100 die) over the H200's bandwidth and memory"),
    "L40S": ("A100-80GB", 1.0, "the A100's efficiencies (no public training run with a layout found)"),
    "MI300X": (
        "H100-SXM",
        0.7,
        "0.7 × the H100-SXM's efficiencies (hipBLASLt reaches about 70% of cuBLAS's fraction of peak in public "
        "GEMM sweeps; no public training run with a layout found): an estimate, not a fit",
    ),
}


def measured_mfu(row: Measurement) -> float:
    """The row's MFU as the planner defines it (6·N + 12·l·h·s per token over the dense bf16 peak)."""
    est = estimator(row)
    return row.measured.tokens_per_s_per_gpu * model_flops_per_token(est) / est.hardware.flops_per_s


def fit_memory_factor(rows: Sequence[Measurement], catalogue: ProfileCatalogue) -> tuple[float, list[float]]:
    """The ``activation_memory_factor`` (one for every profile) that best matches the rows' published peaks, and
    the log(published / predicted) peak of each row with a peak at that factor (module docstring)."""
    with_peak = [row for row in rows if row.measured.peak_memory_bytes]
    if not with_peak:
        return 1.0, []

    def errors(factor: float) -> list[float]:
        trial = _with_factor(catalogue, factor)
        with use_catalogue(trial):
            predicted = [predict(row).peak_memory_bytes or 1.0 for row in with_peak]
        return [math.log(row.measured.peak_memory_bytes / p) for row, p in zip(with_peak, predicted, strict=True)]  # type: ignore[operator]

    best = min((1.0 + 0.05 * step for step in range(41)), key=lambda factor: sum(e * e for e in errors(factor)))
    return best, errors(best)


def fit_unknown_kernels(
    rows: Sequence[Measurement], catalogue: ProfileCatalogue, *, steps: int = 16
) -> tuple[ProfileCatalogue, list[float]]:
    """``catalogue`` with the elementwise traffic of kernels ``unknown`` fitted and its interval set, and each
    row's log(published / predicted) in that mode (module docstring)."""
    weights = framework_weights(rows)

    def trial(log_factor: float) -> ProfileCatalogue:
        software = catalogue.software.model_copy(deep=True)
        software.elementwise_traffic["unknown"] = math.exp(log_factor)
        return catalogue.model_copy(update={"software": software})

    def errors(log_factor: float) -> list[float]:
        predicted = predict_rows(rows, trial(log_factor), kernels="unknown")
        return [math.log(row.measured.tokens_per_s_per_gpu / p) for row, p in zip(rows, predicted, strict=True)]

    def objective(log_factor: float) -> float:
        return sum(w * e * e for w, e in zip(weights, errors(log_factor), strict=True))

    low, high = math.log(0.3), math.log(8.0)
    ratio = (math.sqrt(5) - 1) / 2
    a, b = high - ratio * (high - low), low + ratio * (high - low)
    fa, fb = objective(a), objective(b)
    for _ in range(steps):
        if fa <= fb:
            high, b, fb = b, a, fa
            a = high - ratio * (high - low)
            fa = objective(a)
        else:
            low, a, fa = a, b, fb
            b = low + ratio * (high - low)
            fb = objective(b)
    best = (low + high) / 2
    fitted = errors(best)
    result = trial(best)
    result.software.unknown_kernels_log_error = (
        round(weighted_quantile(fitted, weights, 0.1), 4),
        round(weighted_quantile(fitted, weights, 0.9), 4),
    )
    return result, fitted


def framework_weights(rows: Sequence[Measurement]) -> list[float]:
    """Each row's weight in the fit of kernels ``unknown`` (module docstring): every kernels mode among the rows
    weighs the same, and within a mode every source-and-accelerator group; the weights sum to 1."""
    groups = Counter((kernels_mode(row), row.source, row.accelerator) for row in rows)
    groups_per_mode = Counter(mode for mode, _, _ in groups)
    modes = len(groups_per_mode)
    return [
        1.0 / (modes * groups_per_mode[mode] * groups[(mode, row.source, row.accelerator)])
        for row, mode in ((row, kernels_mode(row)) for row in rows)
    ]


def _with_factor(catalogue: ProfileCatalogue, factor: float) -> ProfileCatalogue:
    profiles = {
        name: profile.model_copy(update={"activation_memory_factor": factor})
        for name, profile in catalogue.profiles.items()
    }
    return catalogue.model_copy(update={"profiles": profiles})


def _ridge(accelerator: str, scale: float) -> float:
    """The roofline's ridge point (peak · scale / bandwidth, FLOP per byte): d½ scales with it (:mod:`.fit`)."""
    entry = CATALOGUE[accelerator]
    return entry.flops_per_s * scale / entry.memory_bandwidth_bytes_per_s


def build_catalogue(
    rows: Sequence[Measurement], result: FitResult, memory_factor: float, *, fitted: str
) -> ProfileCatalogue:
    """The shipped catalogue (module docstring) from the fit of ``rows``."""
    pooled = (quantile(result.group_log_error, 0.1), quantile(result.group_log_error, 0.9))
    profiles: dict[str, AcceleratorProfile] = {}
    for name, profile in result.catalogue.profiles.items():
        own = [i for i, row in enumerate(rows) if row.accelerator == name]
        errors = [result.group_log_error[i] for i in own]
        interval = (quantile(errors, 0.1), quantile(errors, 0.9)) if len(own) >= MIN_ROWS_FOR_OWN_INTERVAL else pooled
        ceiling: dict[str, float] = {}
        for i in own:
            precision = rows[i].training.precision
            ceiling[precision] = max(ceiling.get(precision, 0.0), round(measured_mfu(rows[i]), 4))
        profiles[name] = profile.model_copy(
            update={
                "activation_memory_factor": memory_factor,
                "held_out_log_error": (round(interval[0], 4), round(interval[1], 4)),
                "max_measured_mfu": ceiling,
                "fitted_rows": len(own),
                "source": f"fitted to {len(own)} published rows (bench/calibration_bench.py)",
            }
        )
    wide = (round(1.5 * pooled[0], 4), round(1.5 * pooled[1], 4))
    for name, (sibling, scale, why) in BORROWED.items():
        if name in profiles or sibling not in profiles:
            continue
        base = profiles[sibling]
        profiles[name] = base.model_copy(
            update={
                "name": name,
                "accelerator": name,
                "gemm_shape_dimension": base.gemm_shape_dimension * _ridge(name, scale) / _ridge(sibling, 1.0),
                "gemm_efficiency": base.gemm_efficiency * scale,
                "fp8_gemm_efficiency": base.fp8_gemm_efficiency * scale,
                "attention_efficiency": base.attention_efficiency * scale,
                "held_out_log_error": wide,
                "max_measured_mfu": {},
                "fitted_rows": 0,
                "source": f"not fitted: {why}",
            }
        )
    ordered = {name: profiles[name] for name in CATALOGUE if name in profiles}
    return ProfileCatalogue(software=result.catalogue.software, profiles=ordered, fitted=fitted)
