"""What moves a pass's duration between runs on CPU? The same jobs repeated, every pass timed two ways.

Issue 25's bar 2 is read from two separate runs; the same F/B passes drift between runs seconds apart by ±15 % and
once ran 50–60 % slow with no page faults and no run delay (bench/results/two_bw_passes.md). This probe repeats one
job — gpt-small split in two model stages, ``--steps`` steps of ``--microbatches`` microbatches, forward and
backward of each stage, SGD (lr 0.01) after each step, the model rebuilt from its seed for every job as a run does —
in ``--procs`` processes at once (one per core, pinned, one intra-op thread, the heap kept: as the runtime's rank
processes are), and records per job:

* every pass's wall time (``time.perf_counter``) and its thread's CPU time (``time.thread_time``): a pass slow in
  wall time but not in CPU time did not run (the guest's scheduler, or the host taking the vCPU); slow in CPU time
  too, it ran slower (or the host's time was charged to it);
* the job's run delay (``/proc/thread-self/schedstat``: ready but not running, as the guest sees it), the pinned
  core's steal ticks (``/proc/stat``: time the host ran something else on that vCPU), its minor page faults and the
  time Python's garbage collector spent (``gc.callbacks``);
* a canary before the job: fixed work on the same core (matrix products, then copies of 64 MiB), so that a slow
  job can be told from a slow machine;
* the float32 subnormals ("denormals", the x86 slow path) in one microbatch's activations, the gradients and the
  weights at the job's end, and whether the job ran with ``torch.set_flush_denormal(True)`` (every other job when
  ``--flush alternate``).

Run (heavy: hold the team lock): ``python bench/pass_drift.py --jobs 12 --output FILE.jsonl``; ``--summary FILE``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def _steal_ms(core: int) -> float:
    """Steal time of ``core`` since boot, ms (``/proc/stat``'s eighth column, USER_HZ ticks)."""
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith(f"cpu{core} "):
            return int(line.split()[8]) * 1e3 / os.sysconf("SC_CLK_TCK")
    return 0.0


def _run_delay_ms() -> float:
    """This thread's time ready to run but waiting, ms (schedstat's second field, ns)."""
    return int(Path("/proc/thread-self/schedstat").read_text().split()[1]) / 1e6


def _subnormals(tensors: list[Any]) -> tuple[int, int]:
    """Float32 subnormals among ``tensors`` and their element count."""
    import torch

    tiny = torch.finfo(torch.float32).tiny
    found = total = 0
    for tensor in tensors:
        values = tensor.detach().float()
        found += int(((values != 0) & (values.abs() < tiny)).sum())
        total += values.numel()
    return found, total


def _canary() -> dict[str, float]:
    """Fixed work on this core, ms: 20 products of 512×512 float32 matrices, then 8 copies of 64 MiB."""
    import torch

    a = torch.ones(512, 512) / 512
    started = time.perf_counter()
    for _ in range(20):
        a = a @ a
    compute = time.perf_counter() - started
    source = torch.ones(16 << 20)
    target = torch.empty_like(source)
    started = time.perf_counter()
    for _ in range(8):
        target.copy_(source)
    return {"canary_mm_ms": round(compute * 1e3, 3), "canary_copy_ms": round((time.perf_counter() - started) * 1e3, 3)}


class _StepCanary:
    """Fixed work on fixed memory, timed before every step (ms): 10 products of the same two 256×256 float32
    matrices into the same output, allocated once per process — the machine's speed at that moment, apart from
    anything a job allocates or computes."""

    def __init__(self) -> None:
        import torch

        self.a = torch.full((256, 256), 1.0 / 256)
        self.out = torch.empty(256, 256)

    def __call__(self) -> float:
        import torch

        started = time.perf_counter()
        for _ in range(10):
            torch.mm(self.a, self.a, out=self.out)
        return (time.perf_counter() - started) * 1e3


class _GcClock:
    """Time spent in Python's garbage collector while installed, ms."""

    def __init__(self) -> None:
        self.total_ms = 0.0
        self.collections = 0
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.total_ms += (time.perf_counter() - self._started) * 1e3
            self.collections += 1


#: The collector's clock of this process (installed by the worker).
_CLOCK = _GcClock()


def _timed(passes: list[dict[str, Any]], kind: str, step: int, call: Any, *args: Any) -> Any:
    """``call(*args)`` timed as one pass: wall and thread CPU time, and the collector's time inside it (ms)."""
    wall, cpu, collected = time.perf_counter(), time.thread_time(), _CLOCK.total_ms
    result = call(*args)
    passes.append(
        {
            "kind": kind,
            "step": step,
            "ms": (time.perf_counter() - wall) * 1e3,
            "cpu_ms": (time.thread_time() - cpu) * 1e3,
            "gc_ms": _CLOCK.total_ms - collected,
        }
    )
    return result


def _last_forward(model: Any, stage: Any, received: Any, targets: Any) -> Any:
    """The last stage's forward and the loss."""
    return model.loss_fn(stage(received), targets)


def _built(kept: dict[str, Any], reuse: bool) -> tuple[Any, list[Any]]:
    """The model and its two stages: fresh (as a run builds them), or with ``reuse`` the ones built first in this
    process, their weights copied back in place from the first build (the same tensors at the same addresses)."""
    from pipesched.runtime.models import PRESETS, gpt_model

    if reuse and kept:
        for stage, state in zip(kept["stages"], kept["states"], strict=True):
            stage.load_state_dict(state)
            stage.zero_grad(set_to_none=True)
        return kept["model"], kept["stages"]
    model = gpt_model(PRESETS["gpt-small"], 2)
    stages = [model.build_stage(0), model.build_stage(1)]
    if not kept:
        kept.update(
            model=model, stages=stages, states=[{k: v.clone() for k, v in s.state_dict().items()} for s in stages]
        )
    return model, stages


def _job(
    steps: int, microbatches: int, flush: bool, canary: _StepCanary, model: Any, stages: list[Any]
) -> dict[str, Any]:
    """One job on ``model``'s ``stages``: ``steps`` steps, every pass timed; the subnormals at its end."""
    import torch

    torch.set_flush_denormal(flush)
    params = [p for stage in stages for p in stage.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.01)
    activations: list[Any] = []
    passes: list[dict[str, Any]] = []
    step_canary = []
    for step in range(steps):
        step_canary.append(round(canary(), 4))
        for j in range(microbatches):
            tokens, targets = model.make_microbatch(step * microbatches + j)
            hidden = _timed(passes, "F0", step, stages[0], tokens)
            received = hidden.detach().requires_grad_(True)
            loss = _timed(passes, "F1", step, _last_forward, model, stages[1], received, targets)
            _timed(passes, "B1", step, loss.backward)
            _timed(passes, "B0", step, hidden.backward, received.grad)
            if step == steps - 1 and j == 0:
                activations = [hidden, received.grad]
        optimizer.step()
        if step < steps - 1:
            optimizer.zero_grad()
    grads = [p.grad for p in params if p.grad is not None]
    sub = {
        "activations": _subnormals(activations),
        "grads": _subnormals(grads),
        "weights": _subnormals(params),
    }
    torch.set_flush_denormal(False)
    return {"passes": passes, "subnormals": sub, "step_canary_ms": step_canary}


def _worker(core: int, args: argparse.Namespace, queue: Any) -> None:
    import torch

    from pipesched.runtime.launch import keep_freed_memory

    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    keep_freed_memory()
    clock = _CLOCK
    gc.callbacks.append(clock)
    step_canary = _StepCanary()
    kept: dict[str, Any] = {}
    for job in range(args.jobs):
        flush = {"off": False, "on": True, "alternate": job % 2 == 1}[args.flush]
        reuse = {"off": False, "on": True, "alternate": job % 2 == 1}[args.reuse]
        canary = _canary()
        before = (_steal_ms(core), _run_delay_ms(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
        clock.total_ms, clock.collections = 0.0, 0
        started = time.time()
        model, stages = _built(kept, reuse)
        result = _job(args.steps, args.microbatches, flush, step_canary, model, stages)
        result["reused"] = reuse and job > 0
        result.update(canary)
        result.update(
            core=core,
            job=job,
            flush=flush,
            started=started,
            steal_ms=round(_steal_ms(core) - before[0], 1),
            run_delay_ms=round(_run_delay_ms() - before[1], 3),
            faults=resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before[2],
            gc_ms=round(clock.total_ms, 3),
            gc_collections=clock.collections,
            tag=args.tag,
            torch=torch.__version__,
        )
        queue.put(result)
    queue.put(None)


def measure(args: argparse.Namespace) -> None:
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    cores = sorted(os.sched_getaffinity(0))[: args.procs]
    workers = [context.Process(target=_worker, args=(core, args, queue)) for core in cores]
    for worker in workers:
        worker.start()
    done = 0
    with open(args.output, "a") if args.output else sys.stdout as out:
        while done < len(workers):
            record = queue.get()
            if record is None:
                done += 1
                continue
            out.write(json.dumps(record) + "\n")
            out.flush()
    for worker in workers:
        worker.join()


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summary(paths: list[Path], first: int) -> None:
    """Per job: the median pass wall and CPU time per kind (steps from ``first``), the canary, the counters."""
    print(
        "file | core job flush | F0 F1 B1 B0 wall ms (cpu/wall) | canary mm · copy ms "
        "| run delay · steal · gc (in passes) ms | faults | subnormals act · grad · weight"
    )
    for path in paths:
        for line in path.read_text().splitlines():
            job = json.loads(line)
            cells = []
            for kind in ("F0", "F1", "B1", "B0"):
                rows = [p for p in job["passes"] if p["kind"] == kind and p["step"] >= first]
                wall = _median([p["ms"] for p in rows])
                cpu = sum(p["cpu_ms"] for p in rows) / max(1e-9, sum(p["ms"] for p in rows))
                cells.append(f"{wall:.1f} ({cpu:.2f})")
            sub = job["subnormals"]
            reused = " reused" if job.get("reused") else ""
            flush = "on " if job["flush"] else "off"
            in_passes = sum(p.get("gc_ms", 0.0) for p in job["passes"])
            print(
                f"{path.stem} | {job['core']} {job['job']:>2} {flush}{reused} | {' '.join(cells)} | "
                f"{job['canary_mm_ms']:.1f} · {job['canary_copy_ms']:.1f} | {job['run_delay_ms']:.1f} · "
                f"{job['steal_ms']:.0f} · {job['gc_ms']:.1f} ({in_passes:.1f}) | {job['faults']} | "
                f"{sub['activations'][0]} · {sub['grads'][0]} · {sub['weights'][0]}"
            )


def _spread(values: list[float]) -> str:
    """``min … max`` and the coefficient of variation (%) of ``values``."""
    cv = statistics.pstdev(values) / statistics.fmean(values) * 100
    return f"{min(values):.1f} … {max(values):.1f} (CV {cv:.1f} %)"


def steps_against_canary(paths: list[Path], first: int) -> None:
    """Per core: every step's passes (wall ms, summed) beside the canary timed just before it — the spread of each,
    their correlation, and the spread of the step divided by its canary (what is left once the machine's speed at
    that moment is taken out)."""
    by_core: dict[int, list[tuple[float, float, float]]] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            job = json.loads(line)
            for step, canary in enumerate(job.get("step_canary_ms", [])):
                if step < first:
                    continue
                rows = [p for p in job["passes"] if p["step"] == step]
                wall, cpu = sum(p["ms"] for p in rows), sum(p["cpu_ms"] for p in rows)
                by_core.setdefault(job["core"], []).append((wall, cpu, canary))
    print("core | steps | step wall ms | step cpu/wall | canary ms | corr(step, canary) | step/canary")
    for core, rows in sorted(by_core.items()):
        walls, canaries = [r[0] for r in rows], [r[2] for r in rows]
        ratio = [w / c for w, c in zip(walls, canaries, strict=True)]
        share = sum(r[1] for r in rows) / sum(walls)
        print(
            f"{core} | {len(rows)} | {_spread(walls)} | {share:.3f} | {_spread(canaries)} | "
            f"{statistics.correlation(walls, canaries):.2f} | {_spread(ratio)}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=12)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--procs", type=int, default=2, help="processes at once, one per core")
    parser.add_argument("--flush", choices=("off", "on", "alternate"), default="alternate")
    parser.add_argument(
        "--reuse",
        choices=("off", "on", "alternate"),
        default="off",
        help="on: every job trains the process's first model again (weights reset in place), not a fresh build",
    )
    parser.add_argument("--tag", default="")
    parser.add_argument("--output", type=Path)
    parser.add_argument("--summary", type=Path, nargs="*")
    parser.add_argument("--first", type=int, default=1, help="the summary's first step (0: every step)")
    args = parser.parse_args(argv)
    if args.summary:
        summary(args.summary, args.first)
        steps_against_canary(args.summary, args.first)
    else:
        measure(args)


if __name__ == "__main__":
    main()
