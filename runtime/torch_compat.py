"""The one module touching private ``torch.distributed.pipelining`` APIs (``shared/NOTES.md`` §3).

Supported torch: 2.13.x (the ``runtime`` extra pins ``torch==2.13.0``). Private names used here:
``torch.distributed.pipelining._backward.stage_backward_input`` / ``stage_backward_weight`` (the
split backward, I and W) and ``torch.distributed.pipelining.schedules._PipelineScheduleRuntime``
(``_load_csv(path, "compute_only")`` / ``_prepare_schedule_with_comms``) to run a compute-only
schedule with PyTorch's own runtime. :func:`check_torch_version` says when the installed torch is
outside the tested range; the launcher and the profiler warn with it.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "SUPPORTED_TORCH",
    "TorchRuntimeRun",
    "backward_input",
    "backward_weight",
    "check_torch_version",
    "run_torch_runtime",
    "warn_if_unsupported_torch",
]

#: torch versions (major.minor) whose private pipelining APIs this module was written against.
SUPPORTED_TORCH = ("2.13",)


def check_torch_version(version: str | None = None) -> str | None:
    """``None`` when ``version`` (default: the installed ``torch.__version__``, e.g. ``"2.13.0+cpu"``) is in
    :data:`SUPPORTED_TORCH`, else a sentence saying so, for a warning. Raises nothing.

    :func:`pipesched.runtime.launch.run_schedules` and :func:`pipesched.runtime.profile.profile_model` warn with it
    (``RuntimeWarning``) and go on: the private APIs may still work, and every run is verified anyway.
    """
    version = str(torch.__version__ if version is None else version).split("+")[0]
    if ".".join(version.split(".")[:2]) in SUPPORTED_TORCH:
        return None
    return (
        f"torch {version} is untested with the pipesched runtime (tested: {', '.join(SUPPORTED_TORCH)}); "
        "install the runtime extra (torch==2.13.0)"
    )


def warn_if_unsupported_torch() -> None:
    """Warn (``RuntimeWarning``, pointing at the caller's caller) when the installed torch is untested."""
    unsupported = check_torch_version()
    if unsupported is not None:
        warnings.warn(unsupported, RuntimeWarning, stacklevel=3)


def backward_input(
    output: torch.Tensor, output_grad: torch.Tensor | None, stage_input: torch.Tensor, module: nn.Module
) -> Any:
    """I: the gradient of ``stage_input`` only (accumulated into ``stage_input.grad``).

    ``output``: the stage output (or the scaled loss on the last stage, then ``output_grad`` is None).
    Returns the parameter groups :func:`backward_weight` needs; the autograd graph is retained until then.
    """
    from torch.distributed.pipelining._backward import stage_backward_input

    _, param_groups = stage_backward_input(
        [output], None if output_grad is None else [output_grad], [stage_input], module.parameters()
    )
    return param_groups


def backward_weight(param_groups: Any, module: nn.Module) -> None:
    """W: accumulate the parameter gradients of one microbatch from :func:`backward_input`'s groups."""
    from torch.distributed.pipelining._backward import stage_backward_weight

    stage_backward_weight(module.parameters(), param_groups, retain_graph=False)


class TorchRuntimeRun:
    """One rank's run under ``_PipelineScheduleRuntime``: the compute actions in executed order with
    their start and end (ms from the step's start), losses of local last-stage microbatches, gradients."""

    def __init__(self) -> None:
        self.actions: list[dict[str, Any]] = []
        self.losses: list[float] = []
        self.gradients: dict[str, torch.Tensor] = {}


def _record(
    run: TorchRuntimeRun,
    origin: float,
    stage_index: int,
    kind_of: Callable[..., str],
    method: Callable,
    memory_bytes: Callable[[], int] | None,
):
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        result = method(*args, **kwargs)
        ended = time.perf_counter()
        action: dict[str, Any] = {
            "action": f"{stage_index}{kind_of(*args, **kwargs)}{args[0]}",
            "start": round((started - origin) * 1e3, 6),
            "end": round((ended - origin) * 1e3, 6),
        }
        if memory_bytes is not None:
            action["memory_bytes"] = int(memory_bytes())
        run.actions.append(action)
        return result

    return wrapped


def run_torch_runtime(
    csv_path: Path,
    modules: dict[int, nn.Module],
    *,
    num_stages: int,
    num_microbatches: int,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device,
    memory_bytes: Callable[[], int] | None = None,
) -> TorchRuntimeRun:
    """Run one step of the compute-only CSV at ``csv_path`` with PyTorch's ``_PipelineScheduleRuntime``.

    ``modules``: this rank's stage index → module (loop or V placement, inferred by torch from the CSV).
    ``inputs``/``targets``: the whole batch, split by torch into ``num_microbatches`` equal chunks on dim 0.
    Gradients are scaled by ``1/num_microbatches`` (``scale_grads``), i.e. those of the mean loss.
    Executed compute actions are recorded by wrapping each stage's ``forward_one_chunk``,
    ``backward_one_chunk`` and ``backward_weight_one_chunk``; ``memory_bytes`` (bytes, e.g. live saved
    activations or ``torch.cuda.memory_allocated``) is read after each one when given.

    Raises:
        RuntimeError: from torch, e.g. "Malformed compute schedule" for an order that deadlocks.
    """
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    stages = [
        PipelineStage(module, stage_index=index, num_stages=num_stages, device=device)
        for index, module in sorted(modules.items())
    ]
    schedule = _PipelineScheduleRuntime(stages, n_microbatches=num_microbatches, loss_fn=loss_fn, scale_grads=True)
    schedule._load_csv(str(csv_path), "compute_only")
    run = TorchRuntimeRun()
    dist.barrier()
    origin = time.perf_counter()
    for stage in stages:
        stage.forward_one_chunk = _record(  # type: ignore[method-assign]
            run, origin, stage.stage_index, lambda *a, **k: "F", stage.forward_one_chunk, memory_bytes
        )
        stage.backward_one_chunk = _record(  # type: ignore[method-assign]
            run,
            origin,
            stage.stage_index,
            lambda *a, **k: "B" if k.get("full_backward", True) else "I",
            stage.backward_one_chunk,
            memory_bytes,
        )
        stage.backward_weight_one_chunk = _record(  # type: ignore[method-assign]
            run, origin, stage.stage_index, lambda *a, **k: "W", stage.backward_weight_one_chunk, memory_bytes
        )
    has_first = any(stage.is_first for stage in stages)
    has_last = any(stage.is_last for stage in stages)
    losses: list[torch.Tensor] = []
    args = (inputs.to(device),) if has_first else ()
    if has_last:
        schedule.step(*args, target=targets.to(device), losses=losses)
    else:
        schedule.step(*args)
    run.losses = [float(loss.detach()) for loss in losses]
    for index, module in sorted(modules.items()):
        for name, parameter in module.named_parameters():
            if parameter.grad is not None:
                run.gradients[f"{index}/{name}"] = parameter.grad.detach().float().cpu()
    return run
