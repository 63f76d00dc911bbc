"""Fit accelerator profiles to measured runs; the held-out error that becomes each plan's interval.

The model of a run is the planner's own (:mod:`.predict`): each row's tokens/s per GPU is predicted from its
layout with a candidate catalogue of profiles in force (:func:`pipesched.optimizer.cost.profile.use_catalogue`).
The fit minimises, over a handful of parameters (:data:`PARAMETERS`: per accelerator the bf16 and fp8
matrix-multiply and FlashAttention efficiencies; shared by all, the elementwise traffic of eager and compiled
kernels, the matrix-multiply shape term, the overlap slowdown, the 2023 flash-attn kernels' speed on
Hopper, the bytes of a fused FP8 cast, and the share of tensor-parallel traffic AsyncTP hides),

    Σ_rows (w · log(predicted / published))² + Σ_parameters ((φ − φ₀) / τ)²

with φ the logarithm of each parameter, φ₀ and τ a prior (a datasheet-level guess and how far to trust it: it
keeps a parameter no row informs at its guess), and w² = (rows / groups) / (rows of the row's source and
accelerator): every source-and-accelerator group weighs the same, so one large table does not outweigh the
others, and the mean weight is 1. Gauss–Newton with a finite-difference Jacobian (each parameter
re-predicts only the rows it touches), damped (Levenberg–Marquardt) and bounded to efficiencies ≤ 1, inside
iteratively reweighted least squares with Huber's weights (Huber 1964): a row the model cannot explain (off by
more than about 15%) pulls the parameters no harder than one off by 15%.

Held-out error: the leave-one-out residual of a row is the full fit's residual over 1 − its leverage
(h = jᵀ(JᵀJ + PᵀP)⁻¹j, the linearised refit without the row; Cook & Weisberg 1982, §2.2); leaving a group
out uses (I − H_GG)⁻¹ r_G. Both are reported; the interval of a plan spans the 10th to 90th percentile of the
leave-one-group-out log ratios (the more pessimistic of the two).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pipesched.optimizer.accelerators import get_accelerator
from pipesched.optimizer.calibration.predict import Prediction, kernels_mode, predict
from pipesched.optimizer.cost.calibration.measurements import Measurement
from pipesched.optimizer.cost.profile import AcceleratorProfile, ProfileCatalogue, use_catalogue

#: Huber's threshold on |log(predicted / published)|: about 15%.
HUBER_LOG = 0.14
#: Rounds of reweighting (iteratively reweighted least squares) around the damped Gauss–Newton descent.
ROBUST_ROUNDS = 3

__all__ = [
    "HUBER_LOG",
    "PARAMETERS",
    "ROBUST_ROUNDS",
    "FitResult",
    "Parameter",
    "apply_parameters",
    "fit",
    "group_of",
    "predict_each",
    "predict_rows",
    "quantile",
    "weighted_quantile",
]


@dataclass(frozen=True)
class Parameter:
    """One fitted number: where it lives, its prior (value, log-scale width), its bounds, which rows it moves."""

    name: str
    accelerators: tuple[str, ...]  # empty: shared by all
    prior: float
    width: float
    lower: float
    upper: float
    touches: Callable[[Measurement], bool] = field(default=lambda row: True)


def _on(*accelerators: str) -> Callable[[Measurement], bool]:
    return lambda row: row.accelerator in accelerators


def _fp8_on(*accelerators: str) -> Callable[[Measurement], bool]:
    return lambda row: row.accelerator in accelerators and row.training.precision == "fp8"


def _kernels(mode: str) -> Callable[[Measurement], bool]:
    return lambda row: kernels_mode(row) == mode


#: The fitted parameters (module docstring). A100-40GB and A100-80GB are one chip: they share efficiencies.
PARAMETERS: tuple[Parameter, ...] = (
    Parameter("gemm_efficiency", ("A100-40GB", "A100-80GB"), 0.75, 0.3, 0.2, 1.0, _on("A100-40GB", "A100-80GB")),
    Parameter("attention_efficiency", ("A100-40GB", "A100-80GB"), 0.5, 0.5, 0.1, 1.0, _on("A100-40GB", "A100-80GB")),
    Parameter("gemm_efficiency", ("H100-SXM",), 0.75, 0.3, 0.2, 1.0, _on("H100-SXM")),
    Parameter("fp8_gemm_efficiency", ("H100-SXM",), 0.6, 0.3, 0.2, 1.0, _fp8_on("H100-SXM")),
    Parameter("attention_efficiency", ("H100-SXM",), 0.5, 0.5, 0.1, 1.0, _on("H100-SXM")),
    Parameter("fp8_gemm_efficiency", ("B200",), 0.6, 0.3, 0.2, 1.0, _fp8_on("B200")),
    Parameter("attention_efficiency", ("B200",), 0.5, 0.5, 0.1, 1.0, _on("B200")),
    # FlashAttention-2 on Hopper (the 2023 package, and PyTorch's SDPA in eager and compiled runs:
    # cost.context.pytorch_attention_speed): FlashAttention-3 (Shah et al. 2024, §4.1) measures it at about half
    # its speed (on Ampere it is today's kernel: the A100 rows run it at the profile's attention efficiency)
    Parameter(
        "attention.flash-attn-2023/H100-SXM",
        (),
        0.5,
        0.5,
        0.1,
        2.0,
        lambda row: (
            row.accelerator == "H100-SXM"
            and (
                row.software.attention_kernel == "flash-attn-2023"
                or (kernels_mode(row) != "fused" and row.software.attention_kernel != "cudnn")
            )
        ),
    ),
    # torchtitan's Grand Teton H100s ran at a 500 W power limit (700 W TDP): a peak between the SXM's and the
    # NVL's (835 of 989 TFLOPS at 400 W), so the prior sits halfway
    Parameter(
        "power_limit.500",
        ("H100-SXM",),
        0.92,
        0.1,
        0.5,
        1.0,
        lambda row: row.accelerator == "H100-SXM" and row.power_limit_w == 500,
    ),
    Parameter("software.eager", (), 1.5, 0.7, 0.3, 8.0, _kernels("eager")),
    Parameter(
        "unfused_traffic",
        (),
        1.0,
        0.5,
        0.1,
        5.0,
        lambda row: kernels_mode(row) == "eager" and row.model.norm == "rmsnorm",
    ),
    Parameter("software.compiled", (), 1.0, 0.7, 0.2, 8.0, _kernels("compiled")),
    # Transformer Engine fuses the input casts into the norm / activation kernels and casts each weight once a step
    Parameter(
        "fp8_cast.fused",
        (),
        1.0,
        1.0,
        0.01,
        5.0,
        lambda row: row.training.precision == "fp8" and kernels_mode(row) == "fused",
    ),
    # torch.compile fuses torchao Float8Linear's absolute-max into the kernel that produces the operand (torchao
    # issue 685: the FP8 layer without compile is slower than bf16; torchtitan's float8 docs call compile
    # required): a cast reads bf16 (2) and writes FP8 (1); FSDP's float8 all-gather with precomputed scales casts
    # each weight once a step, not per use, so 2 of the 6 operands a layer casts per microbatch drop out: 3 · 4/6
    Parameter(
        "fp8_cast.compiled",
        (),
        2.0,
        1.0,
        0.01,
        5.0,
        lambda row: row.training.precision == "fp8" and kernels_mode(row) == "compiled",
    ),
    # AsyncTP's chunked overlap leaves the first and last chunk exposed (SoftwareProfile.async_tensor_parallel_hidden)
    Parameter(
        "async_tensor_parallel_hidden",
        (),
        0.5,
        0.7,
        0.05,
        1.0,
        lambda row: row.software.async_tensor_parallel and row.layout.tensor_parallel > 1,
    ),
    Parameter("shape", (), 1.0, 1.0, 0.01, 20.0),
    Parameter("overlap_slowdown", (), 0.1, 1.0, 0.001, 0.9),
)


def apply_parameters(
    base: ProfileCatalogue, parameters: Sequence[Parameter], values: Sequence[float]
) -> ProfileCatalogue:
    """``base`` with ``values`` of ``parameters`` set; every profile's d½ = shape · peak · e / bandwidth (the
    roofline's ridge point, :mod:`pipesched.optimizer.cost.timing`)."""
    software = base.software.model_copy(deep=True)
    profiles = {name: profile.model_copy() for name, profile in base.profiles.items()}
    shared: dict[str, float] = {}
    touched = {name for parameter in parameters for name in parameter.accelerators} or set(profiles)
    if any(not parameter.accelerators for parameter in parameters):
        touched = set(profiles) | touched
    for parameter, value in zip(parameters, values, strict=True):
        if parameter.name.startswith("software."):
            software.elementwise_traffic[parameter.name.split(".", 1)[1]] = value
        elif parameter.name in ("unfused_traffic", "async_tensor_parallel_hidden"):
            setattr(software, parameter.name, value)
        elif parameter.name.startswith("fp8_cast."):
            software.fp8_cast_bytes_per_element[parameter.name.split(".", 1)[1]] = value
        elif parameter.name.startswith("attention."):
            software.attention_kernel_speed[parameter.name.split(".", 1)[1]] = value
        elif parameter.name.startswith("power_limit."):
            for name in parameter.accelerators:
                profile = profiles.setdefault(name, AcceleratorProfile(name=name, accelerator=name))
                limits = {**profile.power_limited_peak, parameter.name.split(".", 1)[1]: value}
                profiles[name] = profile.model_copy(update={"power_limited_peak": limits})
        elif parameter.name == "scale":
            for name in parameter.accelerators:
                profile = profiles[name]
                profiles[name] = profile.model_copy(
                    update={
                        key: min(1.0, getattr(base.profiles[name], key) * value)
                        for key in ("gemm_efficiency", "fp8_gemm_efficiency", "attention_efficiency")
                    }
                )
        elif not parameter.accelerators:
            shared[parameter.name] = value
        else:
            for name in parameter.accelerators:
                profile = profiles.setdefault(name, AcceleratorProfile(name=name, accelerator=name))
                profiles[name] = profile.model_copy(update={parameter.name: value})
    for name, profile in profiles.items():
        update: dict[str, float | int] = {"fitted_rows": max(profile.fitted_rows, 1)}
        if "overlap_slowdown" in shared:
            update["overlap_slowdown"] = shared["overlap_slowdown"]
        if "shape" in shared and profile.accelerator is not None and name in touched:
            entry = get_accelerator(profile.accelerator)
            ridge = entry.flops_per_s * profile.gemm_efficiency / entry.memory_bandwidth_bytes_per_s
            update["gemm_shape_dimension"] = shared["shape"] * ridge
        profiles[name] = profile.model_copy(update=update)
    return ProfileCatalogue(software=software, profiles=profiles, fitted=base.fitted)


def predict_rows(rows: Sequence[Measurement], catalogue: ProfileCatalogue, kernels: str | None = None) -> list[float]:
    """Predicted tokens/s per GPU of each row under ``catalogue`` (the planner's evaluation, :mod:`.predict`),
    each with its own kernels mode or ``kernels``.

    Raises:
        ValueError: a row the planner cannot evaluate (its reason).
    """
    return [result.tokens_per_s_per_gpu or 0.0 for result in predict_each(rows, catalogue, kernels)]


def predict_each(
    rows: Sequence[Measurement], catalogue: ProfileCatalogue, kernels: str | None = None
) -> list[Prediction]:
    """:func:`predict_rows`' whole predictions (tokens/s per GPU, peak memory, step), each row's predicted.

    Raises:
        ValueError: a row the planner cannot evaluate (its reason).
    """
    predicted = []
    with use_catalogue(catalogue):
        for row in rows:
            result = predict(row, kernels=kernels)
            if result.tokens_per_s_per_gpu is None:
                raise ValueError(f"row {row.key} cannot be predicted: {result.reason}")
            predicted.append(result)
    return predicted


def group_of(row: Measurement) -> str:
    """The group a row is held out with: its source, accelerator, precision and model size (rows that differ
    only in batch, sequence or GPU count)."""
    shape = row.model.preset or f"{row.model.num_layers}x{row.model.hidden_size}"
    return f"{row.source}|{row.accelerator}|{row.training.precision}|{shape}"


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (linear interpolation between order statistics)."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def weighted_quantile(values: Sequence[float], weights: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` each counted ``weights`` times (the smallest value whose cumulative
    weight reaches q of the total)."""
    pairs = sorted(zip(values, weights, strict=True))
    if not pairs:
        return 0.0
    target, total = q * sum(weight for _, weight in pairs), 0.0
    for value, weight in pairs:
        total += weight
        if total >= target:
            return value
    return pairs[-1][0]


@dataclass
class FitResult:
    """The fitted catalogue and its errors (log(published / predicted), per row, in row order)."""

    catalogue: ProfileCatalogue
    parameters: list[Parameter]
    values: list[float]
    predicted: list[float]
    fit_log_error: list[float]
    loo_log_error: list[float]
    group_log_error: list[float]
    iterations: int


def _solve(matrix: list[list[float]], vector: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (the systems here are a dozen unknowns)."""
    n = len(vector)
    a = [[*row[:], value] for row, value in zip(matrix, vector, strict=True)]
    for column in range(n):
        pivot = max(range(column, n), key=lambda r: abs(a[r][column]))
        a[column], a[pivot] = a[pivot], a[column]
        if abs(a[column][column]) < 1e-300:
            continue
        for r in range(n):
            if r != column and a[r][column]:
                factor = a[r][column] / a[column][column]
                for c in range(column, n + 1):
                    a[r][c] -= factor * a[column][c]
    return [a[i][n] / a[i][i] if abs(a[i][i]) > 1e-300 else 0.0 for i in range(n)]


def _inverse(matrix: list[list[float]]) -> list[list[float]]:
    n = len(matrix)
    columns = [_solve(matrix, [1.0 if i == j else 0.0 for i in range(n)]) for j in range(n)]
    return [[columns[j][i] for j in range(n)] for i in range(n)]


class _Problem:
    """The weighted residuals of a fit and their Jacobian in log-parameter space."""

    def __init__(self, rows: Sequence[Measurement], base: ProfileCatalogue, parameters: Sequence[Parameter]) -> None:
        self.rows, self.base, self.parameters = list(rows), base, list(parameters)
        counts = Counter((row.source, row.accelerator) for row in self.rows)
        scale = len(self.rows) / len(counts)
        self.weights = [math.sqrt(scale / counts[(row.source, row.accelerator)]) for row in self.rows]
        self.published = [row.measured.tokens_per_s_per_gpu for row in self.rows]
        self.robust = [1.0] * len(self.rows)

    def values(self, phi: Sequence[float]) -> list[float]:
        return [min(max(math.exp(x), p.lower), p.upper) for x, p in zip(phi, self.parameters, strict=True)]

    def predict(self, phi: Sequence[float], indices: Sequence[int] | None = None) -> dict[int, float]:
        chosen = range(len(self.rows)) if indices is None else indices
        catalogue = apply_parameters(self.base, self.parameters, self.values(phi))
        rows = [self.rows[i] for i in chosen]
        return dict(zip(chosen, predict_rows(rows, catalogue), strict=True))

    def residuals(self, predicted: dict[int, float]) -> list[float]:
        return [
            w * math.sqrt(self.robust[i]) * math.log(predicted[i] / self.published[i])
            for i, w in enumerate(self.weights)
        ]

    def reweight(self, predicted: dict[int, float]) -> None:
        """Huber's weights (Huber 1964) at :data:`HUBER_LOG`: a row off by more than that pulls no harder."""
        self.robust = [
            min(1.0, HUBER_LOG / max(abs(math.log(predicted[i] / self.published[i])), 1e-12))
            for i in range(len(self.rows))
        ]

    def jacobian(self, phi: list[float], predicted: dict[int, float], step: float = 0.02) -> list[list[float]]:
        """d residual / d φ, one column per parameter (rows the parameter does not touch: 0)."""
        columns = []
        for j, parameter in enumerate(self.parameters):
            touched = [i for i, row in enumerate(self.rows) if parameter.touches(row)]
            moved = list(phi)
            moved[j] += step
            shifted = self.predict(moved, touched) if touched else {}
            column = [0.0] * len(self.rows)
            for i in touched:
                scale = self.weights[i] * math.sqrt(self.robust[i])
                column[i] = scale * math.log(shifted[i] / predicted[i]) / step
            columns.append(column)
        return [[columns[j][i] for j in range(len(columns))] for i in range(len(self.rows))]

    def prior_residuals(self, phi: Sequence[float]) -> list[float]:
        return [(x - math.log(p.prior)) / p.width for x, p in zip(phi, self.parameters, strict=True)]


def _normal_equations(
    jac: list[list[float]], res: list[float], prior: list[float], widths: list[float], damping: float
) -> tuple[list[list[float]], list[float]]:
    k = len(widths)
    matrix = [[sum(row[a] * row[b] for row in jac) for b in range(k)] for a in range(k)]
    gradient = [sum(row[a] * r for row, r in zip(jac, res, strict=True)) for a in range(k)]
    for a in range(k):
        matrix[a][a] += 1 / widths[a] ** 2
        gradient[a] += prior[a] / widths[a]
        matrix[a][a] *= 1 + damping
    return matrix, [-g for g in gradient]


def _objective(res: list[float], prior: list[float]) -> float:
    return sum(r * r for r in res) + sum(p * p for p in prior)


def fit(
    rows: Sequence[Measurement],
    base: ProfileCatalogue,
    parameters: Sequence[Parameter] = PARAMETERS,
    *,
    iterations: int = 6,
    robust: bool = True,
    progress: Callable[[str], None] | None = None,
) -> FitResult:
    """Fit ``parameters`` to ``rows`` starting from ``base`` (module docstring).

    Parameters that touch no row are left at their prior; ``robust=False`` fits plain least squares (a user's
    few rows: none of them is an outlier to discount). Raises ValueError when a row cannot be predicted.
    """
    used = [p for p in parameters if any(p.touches(row) for row in rows)]
    problem = _Problem(rows, base, used)
    phi = [math.log(p.prior) for p in used]
    predicted = problem.predict(phi)
    done = 0
    for _ in range(ROBUST_ROUNDS if robust else 1):
        if robust:
            problem.reweight(predicted)
        phi, predicted, jac, rounds = _descend(problem, phi, predicted, iterations, progress)
        done += rounds
    res = problem.residuals(predicted)
    widths = [p.width for p in used]
    prior = problem.prior_residuals(phi)
    matrix, _ = _normal_equations(jac, res, prior, widths, 0.0)
    inverse = _inverse(matrix)
    loo, group = _held_out(problem, jac, res, inverse)
    values = problem.values(phi)
    catalogue = apply_parameters(base, used, values)
    return FitResult(
        catalogue=catalogue,
        parameters=used,
        values=values,
        predicted=[predicted[i] for i in range(len(problem.rows))],
        fit_log_error=[
            -r / w / math.sqrt(problem.robust[i]) for i, (r, w) in enumerate(zip(res, problem.weights, strict=True))
        ],
        loo_log_error=loo,
        group_log_error=group,
        iterations=done,
    )


def _descend(
    problem: _Problem,
    phi: list[float],
    predicted: dict[int, float],
    iterations: int,
    progress: Callable[[str], None] | None,
) -> tuple[list[float], dict[int, float], list[list[float]], int]:
    """Damped Gauss–Newton at fixed robust weights; the parameters, predictions and Jacobian it ends at."""
    used = problem.parameters
    res, prior = problem.residuals(predicted), problem.prior_residuals(phi)
    damping, done = 1e-3, 0
    widths = [p.width for p in used]
    jac = problem.jacobian(phi, predicted)
    for done in range(1, iterations + 1):
        matrix, rhs = _normal_equations(jac, res, prior, widths, damping)
        delta = _solve(matrix, rhs)
        trial = [
            min(max(x + d, math.log(p.lower)), math.log(p.upper)) for x, d, p in zip(phi, delta, used, strict=True)
        ]
        trial_predicted = problem.predict(trial)
        trial_res, trial_prior = problem.residuals(trial_predicted), problem.prior_residuals(trial)
        if _objective(trial_res, trial_prior) < _objective(res, prior):
            phi, predicted, res, prior = trial, trial_predicted, trial_res, trial_prior
            damping = max(damping / 10, 1e-6)
            if progress is not None:
                progress(f"iteration {done}: objective {_objective(res, prior):.4f}")
            if max(abs(d) for d in delta) < 2e-3:
                break
            jac = problem.jacobian(phi, predicted)
        else:
            damping *= 10
            if progress is not None:
                progress(f"iteration {done}: step rejected, damping {damping:g}")
            if damping > 1.0:
                break  # no step along the gradient helps: converged
    return phi, predicted, jac, done


def _held_out(
    problem: _Problem, jac: list[list[float]], res: list[float], inverse: list[list[float]]
) -> tuple[list[float], list[float]]:
    """Leave-one-out and leave-one-group-out log(published / predicted) (module docstring)."""

    def leverage(a: int, b: int) -> float:
        return sum(jac[a][x] * inverse[x][y] * jac[b][y] for x in range(len(inverse)) for y in range(len(inverse)))

    n = len(problem.rows)
    scale = [problem.weights[i] * math.sqrt(problem.robust[i]) for i in range(n)]
    loo = [-res[i] / (1 - min(leverage(i, i), 0.99)) / scale[i] for i in range(n)]
    groups: dict[str, list[int]] = {}
    for i, row in enumerate(problem.rows):
        groups.setdefault(group_of(row), []).append(i)
    group = [0.0] * n
    for members in groups.values():
        system = [[(1.0 if a == b else 0.0) - leverage(a, b) for b in members] for a in members]
        held = _solve(system, [res[i] for i in members])
        for i, value in zip(members, held, strict=True):
            group[i] = -value / scale[i]
    return loo, group
