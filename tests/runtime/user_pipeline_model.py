"""A user model for ``--model tests.runtime.user_pipeline_model:FUNCTION`` in the runtime tests (not a test module).

:func:`tiny_stages` returns what ``pipesched.runtime.models.load_model`` asks of a ``module:function`` model: one
``nn.Module`` per pipeline stage, the first taking token ids ``(2, 16)`` (it holds an ``nn.Embedding``),
the last returning logits ``(2, 16, VOCAB)``. :func:`stages_with_rank2_dying` is the same model whose
stage-2 module ends its process with ``os._exit`` on its third forward call: a rank dying mid-run;
:func:`stages_with_rank2_raising` raises a ``RuntimeError`` there instead.
"""

from __future__ import annotations

import os

import torch
from torch import nn

VOCAB = 32
HIDDEN = 8
#: Exit status of the process that :func:`stages_with_rank2_dying` ends.
DEATH_EXIT_CODE = 17
#: Message of the error :func:`stages_with_rank2_raising` raises.
FAILURE_MESSAGE = "stage 2 fails on purpose"


class _Middle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class _First(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, HIDDEN)
        self.middle = _Middle()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.middle(self.embedding(tokens))


class _Last(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.middle = _Middle()
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.middle(x))


def tiny_stages(num_stages: int, seed: int) -> list[nn.Module]:
    """``num_stages`` (≥ 2) stage modules with weights from ``torch.manual_seed(seed)`` (identical per call).

    Raises:
        ValueError: for fewer than 2 stages.
    """
    if num_stages < 2:
        raise ValueError(f"tiny_stages needs at least 2 stages, got {num_stages}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return [_First(), *(_Middle() for _ in range(num_stages - 2)), _Last()]


class _FailOnCall(nn.Module):
    """Wraps a stage; its ``fail_on``-th forward call ends the process at once (``os._exit``, no Python
    exception) when ``hard``, else raises ``RuntimeError``."""

    def __init__(self, stage: nn.Module, fail_on: int, *, hard: bool) -> None:
        super().__init__()
        self.stage = stage
        self.fail_on = fail_on
        self.hard = hard
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_on:
            if self.hard:
                os._exit(DEATH_EXIT_CODE)
            raise RuntimeError(FAILURE_MESSAGE)
        return self.stage(x)


def stages_with_rank2_dying(num_stages: int, seed: int) -> list[nn.Module]:
    """:func:`tiny_stages` with stage 2 (rank 2 under loop placement) calling ``os._exit`` on its 3rd forward."""
    stages = tiny_stages(num_stages, seed)
    stages[2] = _FailOnCall(stages[2], fail_on=3, hard=True)
    return stages


def stages_with_rank2_raising(num_stages: int, seed: int) -> list[nn.Module]:
    """:func:`tiny_stages` with stage 2 raising ``RuntimeError(FAILURE_MESSAGE)`` on its 3rd forward."""
    stages = tiny_stages(num_stages, seed)
    stages[2] = _FailOnCall(stages[2], fail_on=3, hard=False)
    return stages


#: File (in the working directory) that :func:`slow_stages` touches on its first forward call: the ranks run.
SLOW_MARKER = "slow_stages_started"


class _Slow(nn.Module):
    """Wraps a stage; every forward call sleeps ``seconds`` first (and the first touches :data:`SLOW_MARKER`)."""

    def __init__(self, stage: nn.Module, seconds: float) -> None:
        super().__init__()
        self.stage = stage
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import time
        from pathlib import Path

        Path(SLOW_MARKER).touch()
        time.sleep(self.seconds)
        return self.stage(x)


def slow_stages(num_stages: int, seed: int) -> list[nn.Module]:
    """:func:`tiny_stages` whose every forward takes 1 s more: a run long enough to be stopped from outside."""
    return [_Slow(stage, 1.0) for stage in tiny_stages(num_stages, seed)]
