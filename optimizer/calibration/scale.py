"""One borrowed scale fitted to an accelerator family's published runs (AMD's CDNA3: ``bench/amd_bench.py``).

An accelerator without enough runs of its own for a fit of its efficiencies borrows a measured sibling's times one
scale (:data:`~pipesched.optimizer.calibration.catalogue.BORROWED`). Where a few runs with their layouts exist, the
scale is the one number they can carry: :func:`fit_scale` minimises Σ log(published / predicted)² over them with
every other parameter the shipped catalogue's, and :func:`leave_one_source_out` gives each source's held-out error
(the scale fitted without it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from pipesched.optimizer.calibration.catalogue import BORROWED, with_borrowed
from pipesched.optimizer.calibration.fit import predict_rows
from pipesched.optimizer.cost.calibration.measurements import Measurement
from pipesched.optimizer.cost.profile import ProfileCatalogue

__all__ = ["fit_scale", "leave_one_source_out", "scale_log_errors", "scaled"]

#: The scales searched (golden section on [LOW, HIGH] down to TOLERANCE).
LOW, HIGH, TOLERANCE = 0.3, 1.3, 1e-4


def scaled(catalogue: ProfileCatalogue, scales: dict[str, float]) -> ProfileCatalogue:
    """``catalogue`` with the borrowed accelerators of ``scales`` at those scales of their sibling's efficiencies
    (every other borrowed one as :data:`BORROWED` has it; the measured profiles untouched)."""
    table = dict(BORROWED)
    for name, scale in scales.items():
        if name not in BORROWED:
            raise ValueError(f"{name} borrows no sibling's efficiencies: one of {sorted(BORROWED)}")
        sibling, _, _ = BORROWED[name]
        table[name] = (sibling, scale, f"not fitted: {scale:.4f} × the {sibling}'s efficiencies (a trial scale)")
    return with_borrowed(catalogue, table)


def scale_log_errors(
    rows: Sequence[Measurement], catalogue: ProfileCatalogue, names: Sequence[str], scale: float
) -> list[float]:
    """log(published / predicted) of ``rows`` with every accelerator of ``names`` borrowed at ``scale``."""
    predicted = predict_rows(rows, scaled(catalogue, dict.fromkeys(names, scale)))
    return [math.log(row.measured.tokens_per_s_per_gpu / p) for row, p in zip(rows, predicted, strict=True)]


def fit_scale(rows: Sequence[Measurement], catalogue: ProfileCatalogue, names: Sequence[str]) -> float:
    """The scale of ``names`` minimising Σ log(published / predicted)² over ``rows`` (golden-section search: the
    predictions fall monotonically as the scale falls, so the sum has one minimum on [LOW, HIGH])."""
    if not rows:
        raise ValueError("no rows to fit a scale to")
    ratio = (math.sqrt(5) - 1) / 2

    def cost(scale: float) -> float:
        return sum(e * e for e in scale_log_errors(rows, catalogue, names, scale))

    low, high = LOW, HIGH
    a, b = high - ratio * (high - low), low + ratio * (high - low)
    fa, fb = cost(a), cost(b)
    while high - low > TOLERANCE:
        if fa < fb:
            high, b, fb = b, a, fa
            a = high - ratio * (high - low)
            fa = cost(a)
        else:
            low, a, fa = a, b, fb
            b = low + ratio * (high - low)
            fb = cost(b)
    return round((low + high) / 2, 4)


def leave_one_source_out(
    rows: Sequence[Measurement],
    catalogue: ProfileCatalogue,
    names: Sequence[str],
    fit_on: Callable[[Measurement], bool] | None = None,
) -> list[dict[str, object]]:
    """Every source of ``rows`` held out in turn: the scale fitted to the other sources' rows (those of them
    ``fit_on`` accepts, default all: e.g. only their FP8 rows, so a source's bf16 rows are predicted by an FP8 fit),
    and each held-out row's error as predicted/published − 1 at that scale (every row of the source, whether
    ``fit_on`` accepts it or not; ``rows`` of one source: nothing to hold out against)."""
    sources = sorted({row.source for row in rows})
    if len(sources) < 2:
        raise ValueError(f"leaving a source out needs two sources, not {sources}")
    records: list[dict[str, object]] = []
    for source in sources:
        held = [row for row in rows if row.source == source]
        others = [row for row in rows if row.source != source and (fit_on is None or fit_on(row))]
        scale = fit_scale(others, catalogue, names)
        for row, error in zip(held, scale_log_errors(held, catalogue, names, scale), strict=True):
            records.append({"row": row.key, "scale_without_source": scale, "error": round(math.exp(-error) - 1, 4)})
    return records
