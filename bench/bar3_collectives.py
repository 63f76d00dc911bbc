"""Issue 25's bar 3 shape, every step's collectives: where pipeline rank 0's hidden time goes over a run's steps.

Breadth-first (looped-bfs, two stages a rank) pp 2 × dp 2 FSDP on gpt-small, one problem (profiled once and kept in
``--problem``), run ``STEPS`` steps on the own executor; for every process and step: its minor page faults, the sum
of its passes' spans, and each communication action's span (from its last dp peer's start, as the report joins them)
with the part of it its passes overlapped (hidden). The report keeps only the last step's collectives; this reads
the launch's raw per-rank results. Run (heavy: hold the team lock):
``python bench/bar3_collectives.py --steps 8 --problem /tmp/bar3_problem.json --output FILE.jsonl``
(``PIPESCHED_MALLOC`` as the launcher reads it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _counting_faults(job: Any, global_rank: int, device: Any, timeout_s: float) -> tuple[Any, list[int]]:
    """A rank's run (:func:`~pipesched.runtime.training.train_rank`) and its minor page faults per step."""
    import resource

    from pipesched.runtime import training

    step = training.RankTrainer.step
    faults: list[int] = []

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        record = step(self, *args, **kwargs)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        return record

    training.RankTrainer.step = counted  # type: ignore[method-assign]
    return training.train_rank(job, global_rank, device, timeout_s), faults


def _problem(path: Path) -> Any:
    from pipesched.optimizer.problem import Problem

    if not path.exists():
        from pipesched.runtime.options import TrainingOptions
        from pipesched.runtime.profile import measure_model

        options = TrainingOptions(data_parallel=2, sharding="full")
        profile = measure_model(
            num_ranks=2, num_microbatches=8, stages_per_rank=2, model="gpt-small", repeats=6, training=options
        )
        path.write_text(profile.problem.model_dump_json())
    return Problem.model_validate_json(path.read_text())


def _rows(results: list[Any], faults: dict[int, list[int]], steps: int) -> list[dict[str, Any]]:
    from pipesched.runtime.records import joined_communication
    from pipesched.runtime.report import communication_overlap

    rows = []
    for pp in (0, 1):
        group = sorted((r for r in results if r.pp_rank == pp), key=lambda r: r.dp_rank)
        for k in range(steps):
            joined = joined_communication([r.steps[k].communication for r in group])
            for result, communication in zip(group, joined, strict=True):
                passes = [(a.start, a.end) for a in result.steps[k].actions]
                spans = [
                    (
                        c.action,
                        round(c.end - c.start, 1),
                        round(communication_overlap(passes, [(c.start, c.end)])[0], 1),
                    )
                    for c in communication
                ]
                rows.append(
                    {
                        "rank": result.rank,
                        "pp": pp,
                        "step": k,
                        "faults": faults[result.rank][k],
                        "compute_ms": round(sum(end - start for start, end in passes), 1),
                        "communication": spans,
                    }
                )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--problem", type=Path, required=True, help="profiled once and kept here")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    from pipesched.optimizer.solve import solve_family
    from pipesched.runtime.launch import launch_jobs, plan_runs
    from pipesched.runtime.options import TrainingOptions
    from pipesched.runtime.records import RankJob

    schedule = solve_family(_problem(args.problem), "looped-bfs")
    options = TrainingOptions(steps=args.steps, lr=0.01, data_parallel=2, sharding="full")
    runs = plan_runs([schedule], model="gpt-small", engine="pipesched", training=[options], seed=0, validate=True)
    with tempfile.TemporaryDirectory(prefix="bar3-collectives-") as workdir:
        jobs = [RankJob(r.schedule, r.model, 0, r.engine, workdir, 0, r.training, r.steady_steps) for r in runs]
        per_job = launch_jobs(_counting_faults, jobs, world=4, timeout_s=900, replicas=2)
    assert per_job is not None
    results = [result for result, _ in per_job[0]]
    faults = {result.rank: counted for result, counted in per_job[0]}
    record = {
        "malloc": os.environ.get("PIPESCHED_MALLOC", "keep"),
        "utc": time.strftime("%H:%M:%S", time.gmtime()),
        "ranks": _rows(results, faults, args.steps),
    }
    with args.output.open("a") as out:
        out.write(json.dumps(record) + "\n")
    print(f"{args.steps} steps of 4 processes written to {args.output}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
