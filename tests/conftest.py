"""Shared fixtures: the Zero Bubble paper's settings and problem builders."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pipesched.optimizer.derive import load_problem
from pipesched.optimizer.problem import Problem
from pipesched.optimizer.progress import Progress

REPO = Path(__file__).resolve().parent.parent
PAPER_SETTINGS_PATH = REPO / "bench" / "data" / "zb_paper_settings.json"


#: Test folders whose files start real processes (torch ranks, the command line, a service) and take the longest:
#: collected first, so that pytest-xdist's ``--dist loadfile`` (pyproject.toml) starts the long files while the short
#: ones fill the gaps after them, instead of leaving one worker alone with a long file at the end of the run.
LONG_FIRST = ("runtime", "api")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Put the tests of :data:`LONG_FIRST`'s folders first, in its order, keeping every file's order (a stable
    sort)."""

    def later(item: pytest.Item) -> int:
        parts = item.path.relative_to(REPO / "tests").parts
        return LONG_FIRST.index(parts[0]) if parts and parts[0] in LONG_FIRST else len(LONG_FIRST)

    items.sort(key=later)


def stop_on_reaching(target: float) -> tuple[Callable[[Progress], None], Callable[[], bool]]:
    """A search's ``progress`` and ``should_stop`` that end it once its best objective is at most ``target``: a test
    of what a time-limited search reaches gives it a generous limit and stops it there, so its outcome does not
    depend on how much of a short limit a loaded machine leaves it (and an idle one takes no longer than it needs)."""
    best = [math.inf]

    def progress(update: Progress) -> None:
        if update.best_objective is not None:
            best[0] = min(best[0], update.best_objective)

    return progress, lambda: best[0] <= target + 1e-6


def paper_settings() -> list[dict[str, Any]]:
    """The 12 profiled settings of the Zero Bubble paper (bench/data/zb_paper_settings.json, its source inside)."""
    return json.loads(PAPER_SETTINGS_PATH.read_text())["settings"]


def paper_problem(setting: dict[str, Any], **overrides: Any) -> Problem:
    """A problem for one paper setting; ``overrides`` are top-level or dotted fields."""
    data: dict[str, Any] = {
        "pipeline": {"num_ranks": setting["num_ranks"], "num_microbatches": setting["num_microbatches"]},
        "costs": {
            "forward": setting["forward_ms"],
            "backward_input": setting["backward_input_ms"],
            "backward_weight": setting["backward_weight_ms"],
            "p2p": setting["p2p_ms"],
        },
        "memory": {"activation": setting["activation"], "retained_for_weight": setting["retained_for_weight"]},
        "split_backward": True,
        "objective": "stage_span",
    }
    for key, value in overrides.items():
        target = data
        parts = key.split(".")
        for part in parts[:-1]:
            target = target.setdefault(part, {})
        target[parts[-1]] = value
    return load_problem(data)


def uniform_problem(
    num_ranks: int = 4,
    num_microbatches: int = 8,
    *,
    stages_per_rank: int = 1,
    placement: str | list[int] = "loop",
    forward: float | list[float] = 1.0,
    backward_input: float | list[float] = 1.0,
    backward_weight: float | list[float] = 1.0,
    p2p: float | list[float] = 0.0,
    reduce_grad: float | list[float] | None = None,
    activation: float | list[float] = 100.0,
    retained_for_weight: float | list[float] = 40.0,
    limit: float | list[float] | None = None,
    static: float | list[float] = 0.0,
    split_backward: bool = True,
    objective: str = "makespan",
    method: str = "auto",
    time_limit_s: float = 10.0,
) -> Problem:
    """A small problem with uniform costs unless told otherwise (``reduce_grad``: the stages' gradient
    reduction, which a bidirectional placement needs for its replicas' synchronisation)."""
    return load_problem(
        {
            "pipeline": {
                "num_ranks": num_ranks,
                "num_microbatches": num_microbatches,
                "stages_per_rank": stages_per_rank,
                "placement": placement,
            },
            "costs": {
                "forward": forward,
                "backward_input": backward_input,
                "backward_weight": backward_weight,
                "p2p": p2p,
                **({} if reduce_grad is None else {"reduce_grad": reduce_grad}),
            },
            "memory": {
                "activation": activation,
                "retained_for_weight": retained_for_weight,
                "limit": limit,
                "static": static,
            },
            "split_backward": split_backward,
            "objective": objective,
            "solver": {"method": method, "time_limit_s": time_limit_s},
        }
    )


@pytest.fixture(scope="session")
def settings() -> list[dict[str, Any]]:
    return paper_settings()


def data_parallel_problem(
    num_ranks: int = 2, num_microbatches: int = 4, *, split_backward: bool = True, method: str = "auto", **extra: Any
) -> Problem:
    """Unit costs on ``num_ranks`` × data-parallel 2 with FSDP: unshard 0.5 ms, reduce_grad 0.8 ms, optimizer
    step 0.2 ms per rank, objective step_time; ``extra`` adds or replaces top-level sections."""
    return load_problem(
        {
            "pipeline": {"num_ranks": num_ranks, "num_microbatches": num_microbatches},
            "costs": {
                "forward": 1,
                "backward_input": 1,
                "backward_weight": 1,
                "p2p": 0.1,
                "unshard": 0.5,
                "reduce_grad": 0.8,
                "optimizer_step": 0.2,
            },
            "memory": {"activation": 100},
            "split_backward": split_backward,
            "data_parallel": {"size": 2, "sharding": "full"},
            "objective": "step_time",
            "solver": {"method": method},
            **extra,
        }
    )
