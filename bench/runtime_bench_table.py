"""Issue 25's bars, one row per launch of ``bench.runtime_bench``: read from the launches' output files.

Per launch: the load average before and after, each case's best step after the first against its prediction (bar 1
for 1F1B and ZB-H1: −20 % … +25 %), the static memory's worst error over every rank (bar: within 15 %), 2BW's gain
over 1F1B measured against predicted both ways the bench prints (best step against best step; the median over rounds
of the per-round difference of the two cases' medians; and, where the bench recorded each step's passes, the same
paired median of each round's median step less its busiest process's passes: the gain outside the passes, the same
work in both cases, whatever speed the machine ran them at; bar 2: at least half the predicted gain), and for BF × dp 2
each process's hidden / exposed ms per step against predicted (bar 3: hidden > 0 on every rank and every figure within
30 %), and, where the launch's run reports carry it, the same read on the same steps: per step after the first, the
measured hidden / exposed against the prediction of that step given its passes as they ran (the run report's
``same_step_predicted_…``: the simulator re-run with the step's measured F, I, W, B and the profile's collectives),
bar 3 met when on every process hidden > 0 and the median per-step error of both is within 30 % (``3 same steps``;
``3 same, coll.``: the collectives at their measured spans too, the placement alone — a diagnostic). The verdict
counts, per bar, the launches that met it. Then, per launch, where each case's update went (1F1B against 2BW).

Run: ``python -m bench.runtime_bench_table bench/results/runtime_bench_r10_launch*.txt``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

STEP_BAR = (-0.20, 0.25)
STATIC_BAR = 0.15
GAIN_BAR = 0.5
SPLIT_BAR = 0.30
SPLITS = ("hidden", "exposed")


def launches(path: Path) -> list[dict[str, Any]]:
    """The launches (repeats) one output file holds, as the bench wrote them after its ``rows:`` line."""
    text = path.read_text()
    return list(json.loads(text.split("\nrows:\n", 1)[1]))


def _within(measured: float, predicted: float, bar: float) -> bool:
    return predicted > 0 and abs(measured / predicted - 1) <= bar


def summary(launch: dict[str, Any]) -> dict[str, Any]:
    """The bars' figures of one launch."""
    by_case = {row["case"]: row for row in launch["rows"]}
    steps = {case: row["best_ms"] / row["predicted_ms"] - 1 for case, row in by_case.items()}
    static = max(
        abs(rank["static_measured"] / rank["static_predicted"] - 1)
        for row in launch["rows"]
        for rank in row["ranks"]
        if rank["static_predicted"]
    )
    found: dict[str, Any] = {
        "load": (launch["load_before"][0], launch["load_after"][0]),
        "steps": steps,
        "static": static,
    }
    if "1F1B" in by_case and "2BW" in by_case:
        flushed, steady = by_case["1F1B"], by_case["2BW"]
        predicted = flushed["predicted_ms"] - steady["predicted_ms"]
        per_round = [a - b for a, b in zip(flushed["round_medians_ms"], steady["round_medians_ms"], strict=True)]
        found["gain"] = {
            "predicted": predicted,
            "best": flushed["best_ms"] - steady["best_ms"],
            "paired_median": statistics.median(per_round),
            "per_round": per_round,
        }
        rests = [flushed.get("round_rest_ms") or [], steady.get("round_rest_ms") or []]
        if all(rests) and None not in rests[0] + rests[1]:
            outside = [a - b for a, b in zip(*rests, strict=True)]
            found["gain"]["outside_passes"] = statistics.median(outside)
            found["gain"]["outside_per_round"] = outside
    if "BF×dp2" in by_case:
        ranks = by_case["BF×dp2"]["ranks"]
        found["split"] = [
            (r["hidden_ms"], r["exposed_ms"], r["predicted_hidden_ms"], r["predicted_exposed_ms"]) for r in ranks
        ]
        for key in ("same_steps", "same_steps_measured_collectives"):
            if all(r.get(key) for r in ranks):
                found[key] = [r[key] for r in ranks]
    return found


def bars(found: dict[str, Any]) -> dict[str, bool | None]:
    """Each bar met or not (``None``: the launch did not run its cases)."""
    low, high = STEP_BAR
    steps = found["steps"]
    met: dict[str, bool | None] = {
        "1: step": all(low <= steps[c] <= high for c in ("1F1B", "ZB-H1") if c in steps)
        if {"1F1B", "ZB-H1"} & steps.keys()
        else None,
        "1: static": found["static"] <= STATIC_BAR,
    }
    gain = found.get("gain")
    for name in ("best", "paired_median", "outside_passes"):
        met[f"2: gain, {name}"] = (
            None if gain is None or name not in gain else gain[name] >= GAIN_BAR * gain["predicted"]
        )
    split = found.get("split")
    met["3: BF×dp2 split"] = (
        None
        if split is None
        else all(h > 0 and _within(h, ph, SPLIT_BAR) and _within(e, pe, SPLIT_BAR) for h, e, ph, pe in split)
    )
    for key, name in (("same_steps", "3: same steps"), ("same_steps_measured_collectives", "3: same, coll.")):
        met[name] = None if key not in found else all(_same_step_met(rank) for rank in found[key])
    return met


def _same_step_met(rank: dict[str, Any]) -> bool:
    """One process read on the same steps: hidden > 0 and both median per-step errors within the bar."""
    return bool(
        rank["hidden_ms"] > 0
        and all(rank[f"{split}_error"] is not None and abs(rank[f"{split}_error"]) <= SPLIT_BAR for split in SPLITS)
    )


def _cell(value: bool | None) -> str:
    return "—" if value is None else ("yes" if value else "no")


def table(named: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """The per-launch table and the count of launches meeting each bar."""
    cases = ("1F1B", "ZB-H1", "2BW", "ZB-V", "BF×dp2")
    lines = [
        "| launch (load) | " + " / ".join(cases) + " best vs predicted | static | 2BW gain predicted · best · paired "
        "median (per round) · outside the passes (per round) | BF×dp2 hidden/exposed measured (predicted) "
        "r0 · r1 · r2 · r3 | the same on the same steps: median per-step error hidden/exposed, r0 · r1 · r2 · r3 "
        "(with the collectives as measured) | bars 1 step, 1 static, 2 best, 2 paired, 2 outside, 3, 3 same steps, "
        "3 same coll. |",
        "|---|---|---|---|---|---|---|",
    ]
    counts: dict[str, list[int]] = {}
    for name, found in named:
        steps = " / ".join(f"{100 * found['steps'][c]:+.0f}" if c in found["steps"] else "—" for c in cases)
        gain = found.get("gain")
        gain_text = (
            "—"
            if gain is None
            else f"{gain['predicted']:.0f} · {gain['best']:+.0f} ({100 * gain['best'] / gain['predicted']:.0f} %) · "
            f"{gain['paired_median']:+.0f} ({100 * gain['paired_median'] / gain['predicted']:.0f} %; "
            + ", ".join(f"{g:+.0f}" for g in gain["per_round"])
            + ")"
            + (
                ""
                if "outside_passes" not in gain
                else f" · outside the passes {gain['outside_passes']:+.0f} "
                f"({100 * gain['outside_passes'] / gain['predicted']:.0f} %; "
                + ", ".join(f"{g:+.0f}" for g in gain["outside_per_round"])
                + ")"
            )
        )
        split = found.get("split")
        split_text = (
            "—" if split is None else " · ".join(f"{h:.0f}/{e:.0f} ({ph:.0f}/{pe:.0f})" for h, e, ph, pe in split)
        )
        same = found.get("same_steps")
        same_text = (
            "—"
            if same is None
            else " · ".join(f"{_signed(r['hidden_error'])}/{_signed(r['exposed_error'])}" for r in same)
            + (
                ""
                if "same_steps_measured_collectives" not in found
                else " ("
                + " · ".join(
                    f"{_signed(r['hidden_error'])}/{_signed(r['exposed_error'])}"
                    for r in found["same_steps_measured_collectives"]
                )
                + ")"
            )
        )
        met = bars(found)
        for bar, value in met.items():
            if value is not None:
                counts.setdefault(bar, [0, 0])
                counts[bar][0] += int(value)
                counts[bar][1] += 1
        load = found["load"]
        lines.append(
            f"| {name} ({load[0]:.1f} → {load[1]:.1f}) | {steps} % | {100 * found['static']:+.0f} % | {gain_text} | "
            f"{split_text} | {same_text} | " + " ".join(_cell(v) for v in met.values()) + " |"
        )
    lines.append("")
    lines += [f"bar {bar}: met in {met} of {total} launches" for bar, (met, total) in counts.items()]
    return lines


def _signed(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:+.0f} %"


def update_parts(launch: dict[str, Any], cases: tuple[str, ...] = ("1F1B", "2BW")) -> list[str]:
    """Per case and process, the median update and its parts (ms per step; the bench's ``update_parts``)."""
    lines = []
    for row in launch["rows"]:
        if row["case"] not in cases:
            continue
        for rank in row["ranks"]:
            parts = rank.get("update_parts") or {}
            if parts:
                lines.append(
                    f"  {row['case']} r{rank['rank']}: update {parts['update']:.1f} ms = "
                    + " + ".join(f"{name} {v:.1f}" for name, v in parts.items() if name not in ("update", "run_delay"))
                    + f" (of which run delay {parts.get('run_delay', 0.0):.1f})"
                )
    return lines


def _busy_share(span: tuple[float, float], others: list[tuple[float, float]]) -> float:
    """The share of ``span`` during which one of ``others`` ran."""
    start, end = span
    covered, cursor = 0.0, start
    for s, e in sorted(others):
        s, e = max(s, cursor), min(e, end)
        if e > s:
            covered += e - s
            cursor = e
    return covered / (end - start) if end > start else 0.0


def passes_beside_an_idle_core(launch: dict[str, Any], cases: tuple[str, ...] = ("1F1B", "ZB-H1")) -> list[str]:
    """One replica, one core per process: each pass of the last step of every round, by whether the other process
    ran a pass beside it (at least 90 % of its span: "beside") or not (at most 10 %: "alone"); per pass kind and
    stage the medians and their ratio. The profile times every pass beside a busy core (the run's usual case); a
    pass that runs while the other core idles (the warm-up's first forwards, the cool-down's last backwards: a
    flushed schedule's bubble) runs faster than that."""
    lines = []
    for row in launch["rows"]:
        if row["case"] not in cases or "last_step_actions" not in row:
            continue
        alone: dict[str, list[float]] = {}
        beside: dict[str, list[float]] = {}
        for ranks in row["last_step_actions"]:
            spans = [[(s, e) for _, s, e in rank] for rank in ranks]
            for k, rank in enumerate(ranks):
                others = [span for j, rank_spans in enumerate(spans) if j != k for span in rank_spans]
                for action, start, end in rank:
                    if end - start < 1.0:  # stage 0's I: no work
                        continue
                    key = "".join(c for c in action if not c.isdigit()) + action[0]
                    share = _busy_share((start, end), others)
                    if share >= 0.9:
                        beside.setdefault(key, []).append(end - start)
                    elif share <= 0.1:
                        alone.setdefault(key, []).append(end - start)
        for key in sorted(alone.keys() & beside.keys()):
            a, b = statistics.median(alone[key]), statistics.median(beside[key])
            lines.append(
                f"  {row['case']} stage {key[-1]} {key[:-1]}: alone {a:.1f} ms ({len(alone[key])}), beside a busy core "
                f"{b:.1f} ms ({len(beside[key])}): {100 * (a / b - 1):+.0f} %"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path, help="runtime_bench output files (--output)")
    args = parser.parse_args()
    named = [
        (path.stem if len(found) == 1 else f"{path.stem} #{k + 1}", summary(launch))
        for path in args.files
        for found in [launches(path)]
        for k, launch in enumerate(found)
    ]
    print("\n".join(table(named)))
    for read, title in (
        (update_parts, "the update's own time, median per step, by part"),
        (passes_beside_an_idle_core, "passes of the last step, alone on the machine or beside the other rank's"),
    ):
        for path in args.files:
            for launch in launches(path):
                lines = read(launch)
                if lines:
                    print(f"{path.stem}: {title}")
                    print("\n".join(lines))


if __name__ == "__main__":
    main()
