"""AMD Instinct (CDNA3) profiles against published training runs: the borrowed scale before and after its fit.

The MI300X and the MI325X (one CDNA3 die, 304 compute units, the same BF16/FP8 peaks; the MI325X has 256 GB of
HBM3E at 6 TB/s and a 1,000 W limit against the MI300X's 192 GB, 5.3 TB/s, 750 W) have no fitted profile: each
borrows the H100-SXM's matrix-multiply and attention efficiencies times one scale
(:data:`pipesched.optimizer.calibration.catalogue.BORROWED`). This bench predicts the AMD runs of
``bench/data/calibration_amd.json`` (never in the main fit, ``bench/calibration_bench.py``) with

- **before**: the shipped catalogue as it was, both at 0.7 (the estimate: hipBLASLt's share of peak against
  cuBLAS's in public GEMM sweeps), the MI325X taking the MI300X's rule over its own bandwidth and memory;
- **the fit**: the scale minimising Σ log(published / predicted)² over a set of sources, every other parameter the
  shipped one (a one-parameter fit: the data are five runs, all FP8, from the logs of two engineers; the MI325X's
  scale is fitted to its runs, the MI300X's estimate checked by its tuned run, :data:`UNTUNED` never fitted);
- **leave one source out**: the scale fitted without a source, that source predicted (its held-out error);
- **after**: the catalogue as shipped now (``--write`` stores it, :func:`with_borrowed`: the measured profiles
  untouched).

Run: ``python -m bench.amd_bench [--write]`` (seconds). Output: ``bench/results/amd_bench.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
from importlib import resources
from pathlib import Path
from typing import Any

from bench.calibration_bench import RESULTS, holdout, holdout_table
from pipesched.optimizer.calibration.catalogue import BORROWED, CDNA3, with_borrowed
from pipesched.optimizer.calibration.fit import predict_rows
from pipesched.optimizer.calibration.scale import fit_scale, leave_one_source_out, scaled
from pipesched.optimizer.cost.calibration.measurements import Measurement, parse_measurements
from pipesched.optimizer.cost.profile import ProfileCatalogue, builtin_catalogue

#: AMD runs with their layouts, never fitted by bench/calibration_bench.py.
AMD = Path(__file__).resolve().parent / "data" / "calibration_amd.json"
#: The scale the shipped catalogue borrowed with before this bench (the estimate).
ESTIMATE = 0.7


def amd_rows(path: Path = AMD) -> list[Measurement]:
    """The rows of ``path``, every source's."""
    return [row for entry in json.loads(path.read_text())["files"] for row in parse_measurements(entry)]


#: Sources whose run is not the stack tuned for the chip (the MI300X's ROCm Megatron-LM build without hipBLASLt
#: tuning or the flash-attn package, "the baseline" in its author's words): predicted, never fitted.
UNTUNED = ("hisohara_megatron_mi300x",)


def report(catalogue: ProfileCatalogue) -> dict[str, Any]:
    """Before, the fits, leave one source out and after (module docstring)."""
    rows = amd_rows()
    tuned = [row for row in rows if row.source not in UNTUNED]
    mi325x = [row for row in tuned if row.accelerator == "MI325X"]
    mi300x = [row for row in rows if row.accelerator == "MI300X"]
    before = scaled(catalogue, dict.fromkeys(CDNA3, ESTIMATE))
    after = with_borrowed(catalogue)
    fitted = fit_scale(mi325x, catalogue, CDNA3)
    transferred = predict_rows(mi300x, scaled(catalogue, dict.fromkeys(CDNA3, fitted)))
    untuned = [row for row in mi300x if row.source in UNTUNED]
    eager = [row.model_copy(update={"model": row.model.model_copy(update={"attention": "eager"})}) for row in untuned]
    return {
        "before": holdout(before, AMD),
        "after": holdout(after, AMD),
        "shipped_scales": {name: BORROWED[name][1] for name in CDNA3},
        "fit_mi325x": fitted,
        "fit_mi300x_tuned": fit_scale([row for row in mi300x if row.source not in UNTUNED], catalogue, CDNA3),
        "fit_tuned": fit_scale(tuned, catalogue, CDNA3),
        "fit_all": fit_scale(rows, catalogue, CDNA3),
        "mi300x_at_the_mi325x_scale": [
            {"row": row.key, "error": round(p / row.measured.tokens_per_s_per_gpu - 1, 4)}
            for row, p in zip(mi300x, transferred, strict=True)
        ],
        "untuned_with_unfused_attention": [
            {"row": row.key, "error": round(p / row.measured.tokens_per_s_per_gpu - 1, 4)}
            for row, p in zip(eager, predict_rows(eager, with_borrowed(catalogue)), strict=True)
        ],
        "leave_one_source_out_mi325x": leave_one_source_out(mi325x, catalogue, CDNA3),
        "leave_one_source_out_tuned": leave_one_source_out(tuned, catalogue, CDNA3),
        "leave_one_source_out_all": leave_one_source_out(rows, catalogue, CDNA3),
    }


def markdown(result: dict[str, Any]) -> str:
    """The report as Markdown: the fits, leave one source out, then before and after row by row."""
    lines = [
        f"CDNA3 borrowed scale (× the H100-SXM's efficiencies): estimate {ESTIMATE}; fitted to the MI325X's sources "
        f"{result['fit_mi325x']}; to the MI300X's tuned run alone {result['fit_mi300x_tuned']}; one scale for every "
        f"tuned source {result['fit_tuned']}; every source (the untuned MI300X build included) {result['fit_all']}; "
        f"shipped {result['shipped_scales']}.",
        "",
        "MI300X rows at the MI325X's fitted scale (what transferring it would predict): "
        + "; ".join(f"{r['row']} {r['error']:+.1%}" for r in result["mi300x_at_the_mi325x_scale"])
        + ".",
        "",
        "What-if, the untuned MI300X build with attention timed unfused (model.attention 'eager', the scores "
        "materialised), shipped scale: "
        + "; ".join(f"{r['row']} {r['error']:+.1%}" for r in result["untuned_with_unfused_attention"])
        + ".",
        "",
        "| leave one source out, over | row | scale fitted without its source | error (predicted/published − 1) |",
        "|---|---|---:|---:|",
    ]
    for name in ("mi325x", "tuned", "all"):
        for r in result[f"leave_one_source_out_{name}"]:
            lines.append(f"| {name} | {r['row']} | {r['scale_without_source']} | {r['error']:+.1%} |")
    lines += ["", *holdout_table(result["before"], f"before: every CDNA3 accelerator at {ESTIMATE} × the H100-SXM")]
    lines += [
        "",
        *holdout_table(
            result["after"],
            "after: the catalogue as shipped (bench/amd_bench.py --write); the MI325X rows are its scale's own "
            "rows, their held-out errors the leave-one-source-out ones above",
        ),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="store the borrowed profiles the planner ships")
    args = parser.parse_args()
    shipped = builtin_catalogue()
    result = report(shipped)
    text = markdown(result)
    (RESULTS / "amd_bench.md").write_text(text + "\n")
    (RESULTS / "amd_bench.json").write_text(json.dumps(result, indent=1) + "\n")
    print(text)
    if args.write:
        target = Path(str(resources.files("pipesched.optimizer.cost.calibration") / "profiles.json"))
        target.write_text(json.dumps(with_borrowed(shipped).model_dump(mode="json"), indent=1) + "\n")
        print(f"wrote {target}")


if __name__ == "__main__":
    main()
