"""Where a profile's ``costs.overlap_slowdown`` comes from: per pass of its calibration run, how long it overlapped its
process's collectives and how much longer it took than the same stage and kind with none beside it.

Profiles breadth-first pp 2 × dp 2 (``bench.runtime_bench``'s third shape) and prints, for every microbatch-0 pass and
every pass that overlapped a collective, the median wall time over the calibration's steps after the first and both
replicas, the median of the same stage and kind alone, and for the overlapped samples their median overlap and extra
time (ms). Run: ``python -m bench.overlap_trace [--model gpt-small]``; results in
``bench/results/overlap_trace.txt``.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from pipesched.optimizer.ir import parse_action
from pipesched.runtime.calibration import pass_overlaps


def _samples(results: list[Any]) -> dict[str, list[tuple[float, float]]]:
    """Per pass name, ``(wall ms, overlap ms)`` over every process and calibration step after the first."""
    samples: dict[str, list[tuple[float, float]]] = {}
    for result in results:
        for passes, joined in zip(result.calibration_passes, result.calibration_joined, strict=False):
            for measured, wall, overlap in pass_overlaps(passes, joined):
                samples.setdefault(measured.action, []).append((wall, overlap))
    return samples


def trace_lines(results: list[Any]) -> list[str]:
    """The table (module docstring) from the profile's processes (``RankProfile``)."""
    samples = _samples(results)
    alone: dict[tuple[int, str], list[float]] = {}
    for name, values in samples.items():
        action = parse_action(name)
        alone.setdefault((action.stage, str(action.kind)), []).extend(wall for wall, overlap in values if overlap == 0)
    lines = []
    for name, values in sorted(samples.items()):
        action = parse_action(name)
        walls = alone.get((action.stage, str(action.kind)), [])
        base = statistics.median(walls) if walls else float("nan")
        beside = [(wall, overlap) for wall, overlap in values if overlap > 0]
        if not beside and action.microbatch != 0:
            continue
        line = (
            f"{name:>5}: alone {base:6.1f} · wall {statistics.median(w for w, _ in values):6.1f} · "
            f"beside a collective {len(beside):2}/{len(values)}"
        )
        if beside:
            line += (
                f" · overlap {statistics.median(o for _, o in beside):5.1f} · "
                f"extra {statistics.median(w - base for w, _ in beside):+6.1f}"
            )
        lines.append(line)
    return lines


def main() -> None:
    from pipesched.runtime import profile
    from pipesched.runtime.options import TrainingOptions

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-small")
    args = parser.parse_args()
    captured: list[Any] = []
    fit = profile._overlap_slowdown

    def keep(results: list[Any]) -> Any:
        captured.extend(results)
        return fit(results)

    profile._overlap_slowdown = keep  # the processes' records, read where the profile fits them
    measured = profile.measure_model(
        num_ranks=2,
        num_microbatches=8,
        stages_per_rank=2,
        placement="loop",
        model=args.model,
        repeats=6,
        training=TrainingOptions(data_parallel=2, sharding="full"),
    )
    assert measured.calibration is not None
    print(f"{measured.calibration.overlap} · per-pass overhead {measured.calibration.overhead_ms:+.2f} ms")
    print("\n".join(trace_lines(captured)))


if __name__ == "__main__":
    main()
