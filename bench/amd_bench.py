"""AMD Instinct profiles against published training runs: the borrowed scales before and after their fit.

The MI300X and the MI325X (one CDNA3 die, 304 compute units, the same BF16/FP8 peaks; the MI325X has 256 GB of
HBM3E at 6 TB/s and a 1,000 W limit against the MI300X's 192 GB, 5.3 TB/s, 750 W) and the CDNA 4 MI355X (256
compute units, BF16 2,516.6 / FP8 5,033.2 TFLOPS dense, 288 GB at 8 TB/s, 1,400 W) and MI350X (the same die at 2.2
GHz and 1,000 W: 2,306.9 / 4,613.7) have no fitted profile: each
borrows the H100-SXM's matrix-multiply and attention efficiencies times one scale
(:data:`pipesched.optimizer.calibration.catalogue.BORROWED`). This bench predicts the AMD runs of
``bench/data/calibration_amd.json`` (never in the main fit, ``bench/calibration_bench.py``) with

- **before**: the catalogue as main shipped it before this round (:data:`BEFORE`: the MI300X at the 0.7 estimate,
  the MI325X at 0.7745, its scale fitted to its first two sources; no MI355X, so its run is not predicted there);
- **the fits**: the scale minimising Σ log(published / predicted)² over a set of runs, every other parameter the
  shipped one (a one-parameter fit: the MI325X's shipped scale is fitted to its FP8 runs, three sources; its BF16
  runs, one source, are never fitted; :data:`UNTUNED` never fitted; the MI355X's and the MI350X's scales are fitted
  to their MLPerf submissions, one recipe on four and two vendors' servers);
- **leave one source out**: the scale fitted without a source (to the other sources' FP8 runs for the shipped
  fit), every run of that source predicted, BF16 ones included (its held-out error);
- **what-ifs**, in-sample and not shipped: the scale the BF16 runs alone would take; the MI355X's runs at the
  MI325X's scale (carrying the CDNA3 scale to CDNA 4 by rule); the MI350X's at the MI355X's;
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
from pipesched.optimizer.calibration.catalogue import BORROWED, CDNA3, INSTINCT, with_borrowed
from pipesched.optimizer.calibration.fit import predict_rows
from pipesched.optimizer.calibration.scale import fit_scale, leave_one_source_out, scaled
from pipesched.optimizer.cost.calibration.measurements import Measurement, parse_measurements
from pipesched.optimizer.cost.profile import ProfileCatalogue, builtin_catalogue

#: AMD runs with their layouts, never fitted by bench/calibration_bench.py.
AMD = Path(__file__).resolve().parent / "data" / "calibration_amd.json"
#: The scales main shipped before this round (the MI300X's estimate; the MI325X's fit to its first two sources).
BEFORE = {"MI300X": 0.7, "MI325X": 0.7745}


def amd_rows(path: Path = AMD) -> list[Measurement]:
    """The rows of ``path``, every source's."""
    return [row for entry in json.loads(path.read_text())["files"] for row in parse_measurements(entry)]


#: Sources whose run is not the stack tuned for the chip (the MI300X's ROCm Megatron-LM build without hipBLASLt
#: tuning or the flash-attn package, "the baseline" in its author's words): predicted, never fitted.
UNTUNED = ("hisohara_megatron_mi300x",)


def _is_fp8(row: Measurement) -> bool:
    return row.training.precision == "fp8"


def _errors(rows: list[Measurement], catalogue: ProfileCatalogue) -> list[dict[str, Any]]:
    return [
        {"row": row.key, "error": round(p / row.measured.tokens_per_s_per_gpu - 1, 4)}
        for row, p in zip(rows, predict_rows(rows, catalogue), strict=True)
    ]


def report(catalogue: ProfileCatalogue) -> dict[str, Any]:
    """Before, the fits, leave one source out, the what-ifs and after (module docstring)."""
    rows = amd_rows()
    tuned = [row for row in rows if row.source not in UNTUNED and row.accelerator in CDNA3]
    mi325x = [row for row in tuned if row.accelerator == "MI325X"]
    mi300x = [row for row in rows if row.accelerator == "MI300X"]
    mi355x = [row for row in rows if row.accelerator == "MI355X"]
    mi350x = [row for row in rows if row.accelerator == "MI350X"]
    bf16 = [row for row in tuned if row.training.precision == "bf16"]
    fitted = fit_scale([row for row in mi325x if _is_fp8(row)], catalogue, CDNA3)
    bf16_alone = fit_scale(bf16, catalogue, CDNA3)
    untuned = [row for row in mi300x if row.source in UNTUNED]
    eager = [row.model_copy(update={"model": row.model.model_copy(update={"attention": "eager"})}) for row in untuned]
    return {
        "before": holdout(scaled(catalogue, BEFORE), AMD, CDNA3),
        "after": holdout(with_borrowed(catalogue), AMD),
        "before_scales": BEFORE,
        "shipped_scales": {name: BORROWED[name][1] for name in INSTINCT},
        "fit_mi325x_fp8": fitted,
        "fit_mi325x_every_run": fit_scale(mi325x, catalogue, CDNA3),
        "fit_bf16_alone": bf16_alone,
        "fit_mi300x_tuned": fit_scale([row for row in mi300x if row.source not in UNTUNED], catalogue, CDNA3),
        "fit_mi355x": fit_scale(mi355x, catalogue, ("MI355X",)),
        "fit_mi350x": fit_scale(mi350x, catalogue, ("MI350X",)),
        "fit_tuned_fp8": fit_scale([row for row in tuned if _is_fp8(row)], catalogue, CDNA3),
        "fit_all_cdna3": fit_scale([row for row in rows if row.accelerator in CDNA3], catalogue, CDNA3),
        "bf16_at_their_own_scale": _errors(bf16, scaled(catalogue, dict.fromkeys(CDNA3, bf16_alone))),
        "mi300x_at_the_mi325x_scale": _errors(mi300x, scaled(catalogue, dict.fromkeys(CDNA3, fitted))),
        "mi355x_at_the_mi325x_scale": _errors(mi355x, scaled(catalogue, {"MI355X": fitted})),
        "mi350x_at_the_mi355x_scale": _errors(mi350x, scaled(catalogue, {"MI350X": BORROWED["MI355X"][1]})),
        "untuned_with_unfused_attention": _errors(eager, with_borrowed(catalogue)),
        "leave_one_source_out_mi325x_fp8_fit": leave_one_source_out(mi325x, catalogue, CDNA3, _is_fp8),
        "leave_one_source_out_mi325x_every_run": leave_one_source_out(mi325x, catalogue, CDNA3),
        "leave_one_source_out_tuned_fp8_fit": leave_one_source_out(tuned, catalogue, CDNA3, _is_fp8),
        "leave_one_source_out_mi355x": leave_one_source_out(mi355x, catalogue, ("MI355X",)),
        "leave_one_source_out_mi350x": leave_one_source_out(mi350x, catalogue, ("MI350X",)),
        "leave_one_source_out_all": leave_one_source_out(
            [row for row in rows if row.accelerator in CDNA3], catalogue, CDNA3
        ),
    }


def _errors_line(title: str, rows: list[dict[str, Any]]) -> str:
    """``title`` then each row's name and error (predicted / published − 1), one sentence."""
    return title + "; ".join(f"{r['row']} {r['error']:+.1%}" for r in rows) + "."


def markdown(result: dict[str, Any]) -> str:
    """The report as Markdown: the fits, leave one source out, the what-ifs, then before and after row by row."""
    lines = [
        f"Borrowed scales (× the H100-SXM's efficiencies): before {result['before_scales']}; shipped "
        f"{result['shipped_scales']} (the MI325X's fitted to its FP8 runs, {result['fit_mi325x_fp8']}; the MI355X's "
        f"to its four MLPerf submissions, {result['fit_mi355x']}; the MI350X's to its two, {result['fit_mi350x']}).",
        "",
        f"Other fits: every MI325X run, BF16 included, {result['fit_mi325x_every_run']}; the BF16 runs alone (one "
        f"source, in-sample) {result['fit_bf16_alone']}; the MI300X's tuned run alone {result['fit_mi300x_tuned']}; "
        f"every tuned CDNA3 FP8 run {result['fit_tuned_fp8']}; every CDNA3 run (the untuned MI300X build included) "
        f"{result['fit_all_cdna3']}.",
        "",
        _errors_line(
            "BF16 rows at the scale they alone would fit (in-sample, not shipped): ", result["bf16_at_their_own_scale"]
        ),
        "",
        _errors_line(
            "MI355X rows at the MI325X's fitted scale (carried to CDNA 4 by rule, not fitted): ",
            result["mi355x_at_the_mi325x_scale"],
        ),
        "",
        _errors_line(
            "MI350X rows at the MI355X's fitted scale (the same die at 1,000 W against 1,400 W; not fitted): ",
            result["mi350x_at_the_mi355x_scale"],
        ),
        "",
        _errors_line(
            "MI300X rows at the MI325X's fitted scale (what transferring it would predict): ",
            result["mi300x_at_the_mi325x_scale"],
        ),
        "",
        _errors_line(
            "What-if, the untuned MI300X build with attention timed unfused (model.attention 'eager', the scores "
            "materialised), shipped scale: ",
            result["untuned_with_unfused_attention"],
        ),
        "",
        "| leave one source out, over | row | scale fitted without its source | error (predicted/published − 1) |",
        "|---|---|---:|---:|",
    ]
    for name in ("mi325x_fp8_fit", "mi355x", "mi350x", "mi325x_every_run", "tuned_fp8_fit", "all"):
        for r in result[f"leave_one_source_out_{name}"]:
            lines.append(f"| {name} | {r['row']} | {r['scale_without_source']} | {r['error']:+.1%} |")
    lines += ["", *holdout_table(result["before"], f"before: the catalogue main shipped, {result['before_scales']}")]
    lines += [
        "",
        *holdout_table(
            result["after"],
            "after: the catalogue as shipped (bench/amd_bench.py --write); the MI325X FP8, MI355X and MI350X rows "
            "are their scales' own rows, their held-out errors the leave-one-source-out ones above; the BF16 rows are "
            "never fitted",
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
