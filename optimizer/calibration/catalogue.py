"""From a fit to the catalogue the planner reads: every accelerator's profile, its interval and its MFU ceiling.

- **Fitted** accelerators take the fitted efficiencies (:mod:`.fit`).
- **Unmeasured** ones (no public run with a layout in ``data/``) borrow from their nearest measured sibling,
  said in their ``source``: H100-PCIe and H200 are the H100's die (GH100) and take its efficiencies over their
  own peaks and bandwidth; L40S takes the A100's; AMD's CDNA3 chips take the H100's matrix-multiply and attention
  efficiencies times one scale a chip: the MI300X 0.7 (AMD's hipBLASLt reaches about 70% of what cuBLAS does of its
  peak in public GEMM sweeps; an estimate, checked since by a tuned run), the MI325X that scale fitted to its
  published FP8 runs (``bench/amd_bench.py``, :mod:`.scale`; a few runs carry one number, not the efficiencies), the
  CDNA 4 MI355X and MI350X each its own scale fitted to MLPerf submissions of one recipe. Their
  interval is the pooled one widened by half; :func:`with_borrowed` re-borrows them from a shipped catalogue.
- **Interval**: the 10th and 90th percentile of the accelerator's leave-one-group-out log(published /
  predicted), pooled over all rows when it has fewer than :data:`MIN_ROWS_FOR_OWN_INTERVAL`.
- **Memory**: ``activation_memory_factor`` fitted (one number for all: it is PyTorch's caching allocator and
  the framework, not the chip) to the published peaks, minimising Σ log(published / predicted)² with every row
  fitting its GPU (:mod:`.peaks`); ``peak_memory_log_error``, the 80% interval of a plan's peak, the 10th and 90th
  percentile of the published peaks' leave-one-out log(published / predicted), one for all as the factor is.
- **Unknown kernels**: a layout given without its framework (kernels ``unknown``, the default) takes the
  expected time over the frameworks that publish runs of its kind
  (:func:`pipesched.optimizer.cost.stages.blended`). Its kind is its data-parallel sharding
  (:func:`~pipesched.optimizer.cost.profile.unknown_kernels_class`): fully sharded weights (FSDP, ZeRO-3) are
  PyTorch's FSDP stacks (torchtitan, llm-foundry, NeMo AutoModel, Megatron's FSDP); replicated weights (DDP,
  ZeRO-1/2) Megatron-LM and NeMo's distributed optimizer (torchtitan has none); each with model parallelism (a
  tensor, pipeline, context or expert degree > 1) a class of its own, which fewer frameworks run (Composer has no
  pipeline or context parallelism; torchtitan's DDP refused a second mesh dimension). The share of each kernels mode
  in a class is that of the calibration data's source-and-accelerator groups of the class, each group one vote
  (:func:`unknown_kernels_shares`): a stated prior from who published what, counted, not fitted to the errors.
  Before, one elementwise-traffic factor was fitted over every row, each kernels mode weighing the same: it
  predicted an eager torchtitan run 14–22% too fast (the unfused RMSNorm/RoPE/SwiGLU traffic of eager
  PyTorch was in no mode's mix) and a fused Megatron/NeMo run 15% too slow. Each class's interval: the 10th and
  90th percentile of its rows' log(published / predicted) as ``unknown``, every source, accelerator and mode
  group weighing the same (:func:`class_weights`; no parameter is fitted, so these are held-out errors).
- **Context/expert-parallel layouts** (issues 24, 28): the interval above is the dense rows' (every fitted row is
  dense), so a plan with context or expert parallelism would claim the dense fit's certainty. Each class of
  :data:`~pipesched.optimizer.cost.profile.PARALLEL_CLASSES` takes the weighted 10th and 90th percentile of
  log(published / predicted) over the context/expert-parallel check rows of that class (``bench/cpep_bench.py``'s
  rows, each planned on its published layout with its own kernels; never fitted, so held-out errors), every
  source-and-accelerator group weighing the same (:func:`parallel_log_errors`); a plan of that class carries the
  union of it and its accelerator's (:meth:`~pipesched.optimizer.cost.profile.SoftwareProfile.layout_log_error`).
  Written by ``python -m bench.calibration_bench --write`` (or ``--parallel-only --write``).
- **MFU ceiling**: the highest MFU (the planner's definition, 6·N + 12·l·h·s per token over the bf16 peak) a row
  of the accelerator reached, by precision.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from pipesched.optimizer.accelerators import CATALOGUE
from pipesched.optimizer.calibration.fit import FitResult, predict_rows, quantile, weighted_quantile
from pipesched.optimizer.calibration.peaks import fit_memory_factor
from pipesched.optimizer.calibration.predict import estimator, kernels_mode
from pipesched.optimizer.cost.calibration.measurements import Measurement
from pipesched.optimizer.cost.profile import (
    PARALLEL_CLASSES,
    RUN_KERNELS,
    SHARDING_CLASSES,
    UNKNOWN_KERNELS_CLASSES,
    AcceleratorProfile,
    ProfileCatalogue,
    SoftwareProfile,
    layout_sharding,
    sharding_class,
    unknown_kernels_class,
)
from pipesched.optimizer.planner.evaluate import model_flops_per_token

__all__ = [
    "BORROWED",
    "CDNA3",
    "INSTINCT",
    "MIN_ROWS_FOR_OWN_INTERVAL",
    "borrowed_profile",
    "build_catalogue",
    "class_weights",
    "fit_memory_factor",
    "fit_unknown_kernels",
    "measured_mfu",
    "parallel_log_errors",
    "row_kernels_class",
    "unknown_kernels_shares",
    "with_borrowed",
]

#: Rows an accelerator needs for an interval of its own.
MIN_ROWS_FOR_OWN_INTERVAL = 20

#: Unmeasured accelerator → (measured sibling, scale of its matrix-multiply and attention efficiencies, its profile's
#: ``source``: why).
BORROWED: dict[str, tuple[str, float, str]] = {
    "H100-PCIe": (
        "H100-SXM",
        1.0,
        "not fitted: the H100-SXM's efficiencies (same GH100 die) over the PCIe card's peaks",
    ),
    "H200": (
        "H100-SXM",
        1.0,
        "not fitted: the H100-SXM's efficiencies (same GH100 die) over the H200's bandwidth and memory",
    ),
    "L40S": ("A100-80GB", 1.0, "not fitted: the A100's efficiencies (no public training run with a layout found)"),
    "MI300X": (
        "H100-SXM",
        0.7,
        "not fitted: 0.7 × the H100-SXM's efficiencies (hipBLASLt reaches about 70% of cuBLAS's fraction of peak in "
        "public GEMM sweeps), an estimate checked since by the one tuned MI300X run with a layout found (Primus, "
        "Llama 3.1 8B FP8 on 8 GPUs: predicted +2.2%; bench/data/calibration_amd.json, bench/amd_bench.py); the "
        "MI325X's fitted 0.8051 (same CDNA3 die at 1,000 W against 750 W) would predict it +13.0%; an untuned ROCm "
        "Megatron-LM build (no hipBLASLt tuning, no flash-attn package) runs 30% below the estimate",
    ),
    "MI325X": (
        "H100-SXM",
        0.8051,
        "one scale fitted, not the efficiencies: 0.8051 × the H100-SXM's efficiencies over the MI325X's peaks and "
        "bandwidth, the scale fitted to 6 published FP8 runs in 3 sources (Primus and ROCm Megatron-LM v25.9 logs, "
        "AMD's performance-results table as its Primus blog quotes it; 8-64 GPUs; bench/data/calibration_amd.json), "
        "each source held out: median 4.4%, largest 9.3% (bench/amd_bench.py); BF16 is the H100's BF16 efficiency "
        "times this FP8-fitted scale: AMD's two published BF16 runs (Llama 3.1 70B FSDP, one source, never fitted) "
        "are predicted 8.1% and 11.0% slow with that source held out; how the efficiencies vary with shape is the "
        "H100's",
    ),
    "MI355X": (
        "H100-SXM",
        0.9469,
        "one scale fitted, not the efficiencies: 0.9469 × the H100-SXM's efficiencies over the MI355X's own peaks "
        "(CDNA 4: BF16 2,516.6 / FP8 5,033.2 TFLOPS dense) and bandwidth, the scale fitted to 4 MLPerf Training v5.1 "
        "submissions (AMD, Dell, GigaComputing, Supermicro: AMD's one recipe, Llama 3.1 8B FP8, DP 8 on one node; "
        "bench/data/calibration_amd.json), each held out: median 2.2%, largest 4.2%, against 8.7-13.4% slow at the "
        "MI325X's 0.8051 (bench/amd_bench.py); one workload and one software stack, so how the efficiencies vary "
        "with shape, layout and precision (BF16 included) is the H100's",
    ),
    "MI350X": (
        "H100-SXM",
        0.7834,
        "one scale fitted, not the efficiencies: 0.7834 × the H100-SXM's efficiencies over the MI350X's own peaks "
        "(the MI355X's CDNA 4 die at 2.2 GHz and 1,000 W: BF16 2,306.9 / FP8 4,613.7 TFLOPS dense), the scale fitted "
        "to 2 MLPerf Training v5.1 submissions (AMD, Cisco: AMD's Llama 3.1 8B FP8 recipe, DP 8 on one node; "
        "bench/data/calibration_amd.json), each held out: -3.2%, +3.4%; the MI355X's 0.9469 would predict them "
        "12-16% fast (its 1,400 W sustains more of its peak; bench/amd_bench.py); one workload, so how the "
        "efficiencies vary with shape, layout and precision is the H100's",
    ),
}

#: AMD's CDNA3 accelerators (one die: the MI325X is the MI300X's compute with HBM3E), each borrowed at a scale of
#: its own.
CDNA3 = ("MI300X", "MI325X")
#: AMD's Instinct accelerators in the catalogue: CDNA3 and the CDNA 4 MI355X and MI350X (each borrowed at a scale of
#: its own).
INSTINCT = (*CDNA3, "MI355X", "MI350X")


def measured_mfu(row: Measurement) -> float:
    """The row's MFU as the planner defines it (6·N + 12·l·h·s per token over the dense bf16 peak)."""
    est = estimator(row)
    return row.measured.tokens_per_s_per_gpu * model_flops_per_token(est) / est.hardware.flops_per_s


def row_kernels_class(row: Measurement) -> str:
    """The layout class of a row for kernels "unknown" (:func:`~pipesched.optimizer.cost.profile.unknown_kernels_class`
    of its data-parallel sharding, none without data parallelism, tagged where it has model parallelism)."""
    layout = row.layout
    degrees = (layout.tensor_parallel, layout.pipeline_parallel, layout.context_parallel, layout.expert_parallel)
    copies = layout.data_parallel * layout.context_parallel
    return unknown_kernels_class(layout_sharding(layout.sharding, copies, *degrees))


def _group(row: Measurement, *, whole: bool = False) -> tuple[str, str, str, str]:
    """A row's vote for kernels "unknown": its layout class (``whole``: its sharding class, model parallelism or
    not), kernels mode, source and accelerator."""
    name = row_kernels_class(row)
    return sharding_class(name) if whole else name, kernels_mode(row), row.source, row.accelerator


def unknown_kernels_shares(rows: Sequence[Measurement]) -> dict[str, dict[str, float]]:
    """By layout class, the share of each kernels mode among the rows' source-and-accelerator groups of that
    class, each group one vote (module docstring): a sharding class counts all its rows' groups, its
    model-parallel class only those of rows with model parallelism; a class without rows takes every mode's equal
    share."""
    groups = {_group(row) for row in rows} | {_group(row, whole=True) for row in rows}
    shares: dict[str, dict[str, float]] = {}
    for name in UNKNOWN_KERNELS_CLASSES:
        votes = Counter(mode for kind, mode, _, _ in groups if kind == name)
        total = sum(votes.values())
        shares[name] = {mode: round(votes[mode] / total, 4) if total else 1 / 3 for mode in RUN_KERNELS}
    return shares


def class_weights(rows: Sequence[Measurement], *, whole: bool = False) -> list[float]:
    """Each row's weight in its class's interval for kernels "unknown" (``whole``: its sharding class's): within a
    class every source, accelerator and kernels-mode group weighs the same (not every row: MosaicML's 216 rows are
    one framework)."""
    keys = [_group(row, whole=whole) for row in rows]
    groups = Counter(keys)
    return [1.0 / groups[key] for key in keys]


def _log_errors(rows: Sequence[Measurement], catalogue: ProfileCatalogue) -> list[float]:
    predicted = predict_rows(rows, catalogue, kernels="unknown")
    return [math.log(row.measured.tokens_per_s_per_gpu / p) for row, p in zip(rows, predicted, strict=True)]


def _interval(errors: list[float], weights: list[float], members: list[int]) -> tuple[float, float]:
    """The weighted 10th and 90th percentile of ``errors`` over ``members`` (every row where there are none)."""
    chosen = [errors[i] for i in members] or errors
    chosen_weights = [weights[i] for i in members] or weights
    return (
        round(weighted_quantile(chosen, chosen_weights, 0.1), 4),
        round(weighted_quantile(chosen, chosen_weights, 0.9), 4),
    )


def parallel_log_errors(
    classes: Sequence[str | None], groups: Sequence[tuple[str, str]], log_errors: Sequence[float]
) -> dict[str, tuple[float, float]]:
    """By class of :data:`~pipesched.optimizer.cost.profile.PARALLEL_CLASSES`, the weighted 10th and 90th
    percentile of ``log_errors`` (log(published / predicted)) over the rows of that class (``classes``: each row's
    :func:`~pipesched.optimizer.cost.profile.parallel_class`; ``None``, a dense row, counts in none), each
    source-and-accelerator group (``groups``) of the class weighing the same (module docstring). A class without
    rows is left out (its plans keep their accelerator's interval)."""
    if not len(classes) == len(groups) == len(log_errors):
        raise ValueError("classes, groups and log_errors must have one entry a row")
    keys = list(zip(classes, groups, strict=True))
    count = Counter(keys)
    weights = [1.0 / count[key] for key in keys]
    intervals: dict[str, tuple[float, float]] = {}
    for name in PARALLEL_CLASSES:
        members = [i for i, kind in enumerate(classes) if kind == name]
        if members:
            intervals[name] = _interval(list(log_errors), weights, members)
    return intervals


def fit_unknown_kernels(
    rows: Sequence[Measurement], catalogue: ProfileCatalogue
) -> tuple[ProfileCatalogue, list[float]]:
    """``catalogue`` with the shares and intervals of kernels ``unknown`` set from ``rows`` (module docstring),
    and each row's log(published / predicted) in that mode. A sharding class's interval is that of its rows
    predicted with its own shares (as a search over both its model-parallel and other layouts predicts them:
    :func:`pipesched.optimizer.planner.rank.plan`), a model-parallel class's that of its rows with theirs."""
    software = catalogue.software.model_copy(deep=True)
    software.unknown_kernels_shares = unknown_kernels_shares(rows)
    result = catalogue.model_copy(update={"software": software})
    errors = _log_errors(rows, result)
    whole_shares = {name: software.unknown_kernels_shares[name] for name in SHARDING_CLASSES}
    whole = software.model_copy(update={"unknown_kernels_shares": whole_shares})
    whole_errors = _log_errors(rows, result.model_copy(update={"software": whole}))
    kinds = [row_kernels_class(row) for row in rows]
    intervals = {}
    for name in UNKNOWN_KERNELS_CLASSES:
        if name in SHARDING_CLASSES:
            members = [i for i, kind in enumerate(kinds) if sharding_class(kind) == name]
            intervals[name] = _interval(whole_errors, class_weights(rows, whole=True), members)
        else:
            members = [i for i, kind in enumerate(kinds) if kind == name]
            intervals[name] = _interval(errors, class_weights(rows), members)
    software.unknown_kernels_log_error = intervals
    return result, errors


def _ridge(accelerator: str, scale: float) -> float:
    """The roofline's ridge point (peak · scale / bandwidth, FLOP per byte): d½ scales with it (:mod:`.fit`)."""
    entry = CATALOGUE[accelerator]
    return entry.flops_per_s * scale / entry.memory_bandwidth_bytes_per_s


def build_catalogue(
    rows: Sequence[Measurement],
    result: FitResult,
    memory_factor: float,
    *,
    fitted: str,
    peak_memory: tuple[tuple[float, float], str] | None = None,
) -> ProfileCatalogue:
    """The shipped catalogue (module docstring) from the fit of ``rows``; ``peak_memory``: the held-out interval
    of log(published / predicted) peaks and its source (:func:`~pipesched.optimizer.calibration.peaks.
    held_out_interval`), one for every profile as the memory factor is."""
    memory_interval, memory_source = peak_memory if peak_memory is not None else (None, "")
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
                "peak_memory_log_error": memory_interval,
                "peak_memory_source": memory_source,
                "held_out_log_error": (round(interval[0], 4), round(interval[1], 4)),
                "max_measured_mfu": ceiling,
                "fitted_rows": len(own),
                "source": f"fitted to {len(own)} published rows (bench/calibration_bench.py)",
            }
        )
    wide = (round(1.5 * pooled[0], 4), round(1.5 * pooled[1], 4))
    for name, (sibling, scale, why) in BORROWED.items():
        if name not in profiles and sibling in profiles:
            profiles[name] = borrowed_profile(profiles[sibling], name, sibling, scale, why, wide)
    ordered = {name: profiles[name] for name in CATALOGUE if name in profiles}
    software = _borrowed_kernel_speeds(result.catalogue.software)
    return ProfileCatalogue(software=software, profiles=ordered, fitted=fitted)


def borrowed_profile(
    base: AcceleratorProfile, name: str, sibling: str, scale: float, why: str, interval: tuple[float, float]
) -> AcceleratorProfile:
    """``name``'s profile borrowed from ``base``, its measured ``sibling``'s (module docstring): the sibling's
    matrix-multiply and attention efficiencies times ``scale`` over ``name``'s own peaks, d½ moved with the
    roofline's ridge point, the widened ``interval``, no MFU ceiling, ``why`` as its ``source``."""
    return base.model_copy(
        update={
            "name": name,
            "accelerator": name,
            "gemm_shape_dimension": base.gemm_shape_dimension * _ridge(name, scale) / _ridge(sibling, 1.0),
            "gemm_efficiency": base.gemm_efficiency * scale,
            "fp8_gemm_efficiency": base.fp8_gemm_efficiency * scale,
            "attention_efficiency": base.attention_efficiency * scale,
            "held_out_log_error": interval,
            "max_measured_mfu": {},
            "fitted_rows": 0,
            "source": why,
        }
    )


def with_borrowed(
    catalogue: ProfileCatalogue, borrowed: dict[str, tuple[str, float, str]] | None = None
) -> ProfileCatalogue:
    """``catalogue`` (a shipped one: its fitted profiles kept as they are) with every unmeasured accelerator's
    profile borrowed again by ``borrowed`` (default :data:`BORROWED`), over the same widened interval the
    catalogue's borrowed profiles carry: a borrowed scale changed without refitting the measured ones."""
    table = BORROWED if borrowed is None else borrowed
    measured = {name: p for name, p in catalogue.profiles.items() if name not in table}
    wide = next((p.held_out_log_error for name, p in catalogue.profiles.items() if name in table), None)
    if wide is None:
        raise ValueError("the catalogue has no borrowed profile to take the widened interval from")
    profiles = dict(measured)
    for name, (sibling, scale, why) in table.items():
        if sibling in measured:
            profiles[name] = borrowed_profile(measured[sibling], name, sibling, scale, why, wide)
    ordered = {name: profiles[name] for name in CATALOGUE if name in profiles}
    software = catalogue.software.model_copy(
        update={"attention_kernel_speed": _borrowed_kernel_speeds(catalogue.software, table).attention_kernel_speed}
    )
    return catalogue.model_copy(update={"profiles": ordered, "software": software})


def _borrowed_kernel_speeds(
    software: SoftwareProfile, borrowed: dict[str, tuple[str, float, str]] | None = None
) -> SoftwareProfile:
    """``software`` with each unmeasured accelerator's attention-kernel speeds those of its sibling of the same
    die (:data:`BORROWED` at scale 1: FlashAttention-2 runs as far from a Hopper's peak on an H200 as on an H100)."""
    speeds = dict(software.attention_kernel_speed)
    for name, (sibling, scale, _) in (BORROWED if borrowed is None else borrowed).items():
        for key, value in software.attention_kernel_speed.items():
            kernel, _, accelerator = key.partition("/")
            if accelerator == sibling and scale == 1.0:
                speeds.setdefault(f"{kernel}/{name}", value)
    return software.model_copy(update={"attention_kernel_speed": speeds})
