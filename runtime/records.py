"""What travels between the launcher and the ranks: the job a rank runs and what it measured (no torch here).

:class:`RankJob` goes to every rank; each returns a :class:`RankResult` (its steps as :class:`StepRecord`
with :class:`MeasuredAction` per action, ms from the step's common start). The run report
(:mod:`pipesched.runtime.report`) is built from them on node 0.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, model_serializer

from pipesched.optimizer.result import Schedule
from pipesched.runtime.options import TrainingOptions

__all__ = [
    "MeasuredAction",
    "RankJob",
    "RankResult",
    "StepCheck",
    "StepRecord",
    "joined_communication",
    "joined_steps",
    "occurrence_keys",
    "timed_part",
]

#: Digits kept of measured times (ms): nanoseconds.
_DIGITS = 6


class _WithoutNone(BaseModel):
    """A record whose optional fields are left out of its JSON when they were not measured."""

    model_config = ConfigDict(extra="forbid")

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


def run_delay_ms() -> float | None:
    """The calling thread's time so far ready to run but waiting for a core (ms; Linux's ``schedstat``, second
    field), ``None`` where the kernel does not report it. The difference over a pass is what the machine's other
    load (or the process's other threads) took of it."""
    try:
        with open("/proc/thread-self/schedstat") as stat:
            return int(stat.read().split()[1]) / 1e6
    except (OSError, IndexError, ValueError):
        return None


@contextmanager
def timed_part(parts: dict[str, float], name: str) -> Iterator[None]:
    """Add the wall-clock ms of the ``with`` block to ``parts[name]``, and the calling thread's run delay over it
    (:func:`run_delay_ms`: the block was ready to run but waited for its core) to ``parts["run_delay"]``: where an
    update's own time goes (:attr:`StepRecord.update_parts_ms`)."""
    delay = run_delay_ms()
    started = time.perf_counter()
    try:
        yield
    finally:
        parts[name] = round(parts.get(name, 0.0) + (time.perf_counter() - started) * 1e3, _DIGITS)
        after = run_delay_ms()
        if delay is not None and after is not None:
            parts["run_delay"] = round(parts.get("run_delay", 0.0) + after - delay, _DIGITS)


class MeasuredAction(_WithoutNone):
    """One action as a rank ran it: ``start``/``end`` in ms from the step's common start (a barrier).

    ``wait_ms``: the own executor's wait for the action's input before its compute (a receive, a collective).
    ``memory_bytes``: live saved-activation bytes after the action (CPU) or ``torch.cuda.memory_allocated``.
    ``run_delay_ms``: the own executor's passes only, where Linux reports it (:func:`run_delay_ms`): the time its
    thread was ready to run but waited for its core, from the wait for the pass's input to the pass's end (the core
    taken by the machine's other processes or the process's own other threads).
    """

    action: str
    start: float
    end: float
    wait_ms: float | None = None
    memory_bytes: int | None = None
    run_delay_ms: float | None = None

    @classmethod
    def timed(cls, action: str, origin: float, started: float, ended: float, **measured: Any) -> MeasuredAction:
        """From ``time.perf_counter`` instants (s) and the step's origin (s)."""
        return cls(
            action=action,
            start=round((started - origin) * 1e3, _DIGITS),
            end=round((ended - origin) * 1e3, _DIGITS),
            **measured,
        )

    @property
    def duration_ms(self) -> float:
        return self.end - self.start


def occurrence_keys(names: list[str]) -> list[tuple[str, int]]:
    """Each action name with its occurrence among ``names`` (the n-th action of a name on one process is the n-th
    of that name on its peers and in its row of the schedule)."""
    seen: dict[str, int] = {}
    keys = []
    for name in names:
        keys.append((name, seen.get(name, 0)))
        seen[name] = keys[-1][1] + 1
    return keys


def joined_communication(peers: list[list[MeasuredAction]]) -> list[list[MeasuredAction]]:
    """The communication actions of one step on every process of one data-parallel group (the same pipeline rank,
    one list per replica), each collective starting when its last peer started it.

    A collective runs once every member has entered it: until then the first replica's communication stream only
    waits for its peer (a replica behind it). The simulator's collective starts when the rank issues it, every
    replica alike (one timeline per pipeline rank), and lasts ``costs.unshard`` / ``costs.reduce_grad``; the same
    span on a real run is from the last peer's start to the action's end. The n-th action of a name on one process
    is the n-th of that name on its peers (every peer issues them in its row's order). Times: ms from each process's
    step origin, taken after a common barrier, so comparable across processes within the barrier's skew.
    """
    keyed = [occurrence_keys([record.action for record in row]) for row in peers]
    latest: dict[tuple[str, int], float] = {}
    for row, keys in zip(peers, keyed, strict=True):
        for record, key in zip(row, keys, strict=True):
            latest[key] = max(latest.get(key, record.start), record.start)
    return [
        [r.model_copy(update={"start": min(max(r.start, latest[k]), r.end)}) for r, k in zip(row, keys, strict=True)]
        for row, keys in zip(peers, keyed, strict=True)
    ]


def joined_steps(replicas: list[list[list[MeasuredAction]]]) -> list[list[list[MeasuredAction]]]:
    """:func:`joined_communication` step by step: ``replicas``, per replica of one data-parallel group (dp order),
    per step, its communication records; the same shape back over the steps every replica ran, each collective
    from its last peer's start."""
    steps = min(len(rows) for rows in replicas)
    per_step = [joined_communication([rows[k] for rows in replicas]) for k in range(steps)]
    return [[per_step[k][i] for k in range(steps)] for i in range(len(replicas))]


class StepCheck(_WithoutNone):
    """The global check and optimizer step of one training step on one rank.

    ``norm``: the global gradient norm (``None`` when not finite); ``skipped``: a synchronous step left out for a
    non-finite norm; ``clip_coefficient``: what the gradients were scaled by. Post-validation (Zero Bubble §4):
    ``speculative`` steps, ``speculative_step_finite`` (the speculative parameters), ``rolled_back``,
    ``max_change_after_rollback`` (0.0: restored bit for bit), ``redone_with_clipping``.
    """

    step: int
    norm: float | None = None
    skipped: bool | None = None
    clip_coefficient: float | None = None
    speculative: bool | None = None
    speculative_step_finite: bool | None = None
    rolled_back: bool | None = None
    max_change_after_rollback: float | None = None
    redone_with_clipping: bool | None = None


@dataclass(frozen=True)
class RankJob:
    """One schedule for every rank to run: the schedule as it runs, the model, the engine and the training.

    ``engine``: ``pipesched`` (the own executor) or ``torch`` (``_PipelineScheduleRuntime``). ``workdir``: a folder
    every rank sees (the torch engine's CSV). ``training``: ``None`` for one verified step without an optimizer.
    ``steady_steps``: K when ``schedule`` is K steps of a no-flush pattern run as one (PipeDream-2BW in steady
    state, :mod:`pipesched.runtime.pipedream`), else 0 (steps one after another, a barrier between them).
    """

    schedule: Schedule
    model: str
    seed: int
    engine: str
    workdir: str
    index: int
    training: TrainingOptions | None = None
    steady_steps: int = 0


@dataclass
class StepRecord:
    """One step of one rank: its compute actions and communication, the losses of the microbatches whose last
    stage it holds, its time (ms, from the common start to the end of its optimizer step), its check, and its
    update's own time apart from the update's wait for the global check."""

    actions: list[MeasuredAction] = field(default_factory=list)
    communication: list[MeasuredAction] = field(default_factory=list)
    losses: dict[int, float] = field(default_factory=dict)
    time_ms: float = 0.0
    check: StepCheck | None = None
    #: The update's own work (the squared norm's partial sum, the rule's copies and ``optimizer.step()``), ms, and
    #: its wait for the global check's all-reduce (for the other ranks to reach it), ms.
    update_ms: float = 0.0
    update_wait_ms: float = 0.0
    #: Where ``update_ms`` goes, ms per part summed over the step's stages (:func:`timed_part`): ``norm`` (the
    #: squared norm's partial sum), ``issue`` (PipeDream-2BW: issuing the check's all-reduce), ``copy`` (2BW: U(t+1)
    #: into the other buffer), ``step`` (``optimizer.step()``, with a flushed 2BW's copy), ``release`` (2BW: the
    #: applied version's gradients freed), ``run_delay`` (of those parts, the time the thread waited for its core).
    update_parts_ms: dict[str, float] = field(default_factory=dict)


@dataclass
class RankResult:
    """What one process measured and holds at the end of a run.

    ``gradients``: the last step's, reduced, ``"{stage id}/{parameter}"`` → fp32 CPU tensor; ``parameters``: after
    the last step, same keys. ``peak_memory_bytes``: saved activations (CPU) or ``max_memory_allocated`` (GPU);
    ``static_memory_bytes``: weights, gradients and optimizer state (and what a rollback keeps) at their peak.
    ``executed``: the compute actions in the order they ran (the last step's, or the whole steady run's).
    """

    rank: int
    pp_rank: int
    dp_rank: int
    device: str
    memory_measure: str
    steps: list[StepRecord] = field(default_factory=list)
    peak_memory_bytes: int = 0
    static_memory_bytes: int = 0
    gradients: dict[str, Any] = field(default_factory=dict)
    parameters: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    executed: list[str] = field(default_factory=list)

    @property
    def last(self) -> StepRecord:
        return self.steps[-1]
