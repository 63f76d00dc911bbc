"""The allocator reserve over the modelled activations (``activation_memory_factor``), fitted to published peaks
under the constraint that every run that ran fits its GPU.

A row's predicted peak is linear in the factor f: ``fixed + f · scaled`` bytes (weights, gradients, optimizer
state and gathered FSDP units are ``fixed``; the activations in flight and the passes' transients, the loss's
logits and a recomputed layer, scale; :mod:`pipesched.optimizer.cost.memory`). Two predictions of each row, at
f = 1 and f = 2, give both (:func:`peak_lines`); the fit is then closed-form over a grid.

- **Objective**: Σ log(published / predicted)² over the rows with a published peak. What they publish is what
  PyTorch's caching allocator reserved (torchtitan logs ``torch.cuda.memory_stats()["reserved_bytes.all.peak"]``
  as its "memory", ``torchtitan/components/metrics.py``, ``DeviceMemoryMonitor``), so the factor holds the
  allocator's reserve over the allocated tensors, not the tensors' transients (modelled in the cost model).
- **Constraint**: a run without a published peak ran, so its predicted peak is at most its GPU's memory: the
  factor stays at or below min over rows of (memory − fixed) / scaled. A row that does not fit even at the
  grid's lowest factor does not bound it (its excess is not the reserve's to fix; it is reported by the test
  that every run fits, ``tests/optimizer/test_memory_fits.py``).
- **Held out**: :func:`leave_one_out` refits without each published row and predicts it; the 10th and 90th
  percentile of those errors (:func:`held_out_interval`) is every plan's 80% interval on its peak
  (``AcceleratorProfile.peak_memory_log_error``). :func:`nested_coverage` checks it honestly: each row's error
  against the interval of the other rows' errors alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pipesched.optimizer.calibration.fit import quantile
from pipesched.optimizer.calibration.predict import estimator, predict
from pipesched.optimizer.cost.calibration.measurements import Measurement
from pipesched.optimizer.cost.profile import ProfileCatalogue, use_catalogue

__all__ = [
    "FACTOR_GRID",
    "PeakLine",
    "fit_memory_factor",
    "held_out_interval",
    "interval_source",
    "leave_one_out",
    "nested_coverage",
    "peak_lines",
    "with_factor",
]

#: The factors tried: 1.00 to 3.00 by 0.01.
FACTOR_GRID = tuple(round(1.0 + 0.01 * step, 2) for step in range(201))


@dataclass(frozen=True)
class PeakLine:
    """A row's predicted peak at factor f, ``fixed + f · scaled`` bytes; its GPU's memory and published peak."""

    key: str
    fixed: float
    scaled: float
    memory: float
    published: float | None

    def peak(self, factor: float) -> float:
        """Predicted peak bytes at ``factor``."""
        return self.fixed + factor * self.scaled

    def ceiling(self) -> float:
        """The largest factor at which the row fits its GPU (inf when nothing scales)."""
        return (self.memory - self.fixed) / self.scaled if self.scaled > 0 else math.inf


def with_factor(catalogue: ProfileCatalogue, factor: float) -> ProfileCatalogue:
    """``catalogue`` with every profile's ``activation_memory_factor`` set to ``factor``."""
    profiles = {
        name: profile.model_copy(update={"activation_memory_factor": factor})
        for name, profile in catalogue.profiles.items()
    }
    return catalogue.model_copy(update={"profiles": profiles})


def peak_lines(rows: Sequence[Measurement], catalogue: ProfileCatalogue) -> list[PeakLine]:
    """Each row's :class:`PeakLine` under ``catalogue`` (two predictions, module docstring)."""
    peaks = []
    for factor in (1.0, 2.0):
        with use_catalogue(with_factor(catalogue, factor)):
            peaks.append([predict(row).peak_memory_bytes or 0.0 for row in rows])
    with use_catalogue(catalogue):
        memory = [estimator(row).hardware.memory_bytes for row in rows]
    lines = []
    for i, row in enumerate(rows):
        scaled = max(peaks[1][i] - peaks[0][i], 0.0)
        lines.append(
            PeakLine(f"{row.source}/{row.id}", peaks[0][i] - scaled, scaled, memory[i], row.measured.peak_memory_bytes)
        )
    return lines


def _fit(lines: Sequence[PeakLine], ceiling: float = math.inf) -> float:
    """The grid's factor minimising Σ log(published / predicted)² at or below ``ceiling`` and every row's own
    ceiling (rows that do not fit even at the grid's lowest factor left out)."""
    ceiling = min([ceiling, *(line.ceiling() for line in lines if line.ceiling() >= FACTOR_GRID[0])])
    allowed = [factor for factor in FACTOR_GRID if factor <= ceiling] or [FACTOR_GRID[0]]
    published = [line for line in lines if line.published]
    if not published:
        return allowed[-1] if ceiling < math.inf else 1.0

    def loss(factor: float) -> float:
        return sum(math.log((line.published or 1.0) / line.peak(factor)) ** 2 for line in published)

    return min(allowed, key=loss)


def fit_memory_factor(
    rows: Sequence[Measurement], catalogue: ProfileCatalogue, lines: Sequence[PeakLine] | None = None
) -> tuple[float, list[float]]:
    """The ``activation_memory_factor`` (one for every profile) that best matches the rows' published peaks with
    every row fitting its GPU (module docstring), and the log(published / predicted) peak of each row with a peak
    at that factor. ``lines``: the rows' :func:`peak_lines`, when already computed."""
    lines = list(lines) if lines is not None else peak_lines(rows, catalogue)
    factor = _fit(lines)
    errors = [math.log(line.published / line.peak(factor)) for line in lines if line.published]
    return factor, errors


def leave_one_out(lines: Sequence[PeakLine], ceiling: float = math.inf) -> list[float]:
    """For each row with a published peak, log(published / predicted) with the factor refitted without it
    (``ceiling``: a bound known from rows not in ``lines``)."""
    errors = []
    for i, line in enumerate(lines):
        if line.published:
            factor = _fit([other for j, other in enumerate(lines) if j != i], ceiling)
            errors.append(math.log(line.published / line.peak(factor)))
    return errors


def held_out_interval(errors: Sequence[float]) -> tuple[float, float]:
    """The 10th and 90th percentile of held-out log(published / predicted) peaks (:func:`leave_one_out`), to
    4 decimals: the 80% interval a plan's peak carries."""
    return round(quantile(errors, 0.1), 4), round(quantile(errors, 0.9), 4)


def interval_source(count: int) -> str:
    """Where a :func:`held_out_interval` of ``count`` published peaks comes from, as a plan's answer says it."""
    return (
        f"leave one out over {count} published peaks (torchtitan's reserved bytes), the activation memory factor "
        "refitted without each: bench/calibration_bench.py"
    )


def nested_coverage(errors: Sequence[float]) -> list[bool]:
    """For each held-out error, whether it lies inside the :func:`held_out_interval` of the others alone (the row
    counted in neither the factor nor the interval that judges it)."""
    inside = []
    for i, error in enumerate(errors):
        low, high = held_out_interval([other for j, other in enumerate(errors) if j != i])
        inside.append(low <= error <= high)
    return inside
