"""Wall time of ``solve`` against ``solver.time_limit_s`` on adversarial shapes (``python -m bench.time_limit_bench``).

Many ranks and stages with one microbatch (the lower bound's worst case), many microbatches, V and
bidirectional placements, ``auto`` and named families, each at the largest size the validation admits for the
limit. The promise: every answer within the limit + 2 s. Results go to ``bench/results/time_limit_bench.txt``.
"""

from __future__ import annotations

import platform
import time
from pathlib import Path

from pipesched.optimizer.derive import load_problem
from pipesched.optimizer.families import FamilyDomainError
from pipesched.optimizer.solve import solve

RESULTS = Path(__file__).resolve().parent / "results" / "time_limit_bench.txt"

# (num_ranks, num_microbatches, stages_per_rank, placement, method, time_limit_s)
CASES = [
    (64, 1, 64, "loop", "auto", 1.0),
    (1024, 1, 8, "loop", "auto", 1.0),
    (1024, 8, 1, "loop", "auto", 1.0),
    (16, 560, 1, "loop", "auto", 1.0),
    (8, 560, 2, "v", "auto", 1.0),
    (8, 560, 2, "bidirectional", "auto", 1.0),
    (512, 8, 2, "v", "auto", 1.0),
    (1024, 1, 64, "loop", "auto", 25.0),
    (64, 1, 64, "loop", "interleaved-1f1b", 1.0),
    (512, 8, 2, "v", "v-half", 1.0),
    (512, 8, 2, "v", "dualpipe-v", 1.0),
]


def _problem(num_ranks: int, num_microbatches: int, stages_per_rank: int, placement: str, method: str, limit: float):
    return load_problem(
        {
            "pipeline": {
                "num_ranks": num_ranks,
                "num_microbatches": num_microbatches,
                "stages_per_rank": stages_per_rank,
                "placement": placement,
            },
            "costs": {
                "forward": 1.0,
                "backward_input": 1.0,
                "backward_weight": 0.5,
                "p2p": 0.1,
                **({"reduce_grad": 0.3} if placement == "bidirectional" else {}),  # the replicas' sync
            },
            "memory": {"activation": 100, "retained_for_weight": 30, "limit": 30 * 100 * stages_per_rank},
            "solver": {"method": method, "time_limit_s": limit},
        }
    )


def main() -> None:
    lines = [
        f"# python -m bench.time_limit_bench on {platform.node()} ({platform.processor() or platform.machine()}), "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "| ranks | microbatches | stages/rank | placement | method | limit s | wall s | wall − limit s | answer |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for ranks, microbatches, stages, placement, method, limit in CASES:
        problem = _problem(ranks, microbatches, stages, placement, method, limit)
        started = time.perf_counter()
        try:
            schedule = solve(problem)
            answer = f"{schedule.status} ({schedule.backend})"
        except FamilyDomainError:
            answer = "422: did not finish, raise the limit"
        wall = time.perf_counter() - started
        line = (
            f"| {ranks} | {microbatches} | {stages} | {placement} | {method} | {limit:g} | {wall:.2f} | "
            f"{wall - limit:+.2f} | {answer} |"
        )
        print(line, flush=True)
        lines.append(line)
    RESULTS.write_text("\n".join(lines) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
