"""Before a run builds a model on this machine: how much memory it will take, and whether that is available.

``pipesched run`` builds every stage in its rank processes and the whole model once more for the
single-process reference, all in fp32 on CPU (gloo) or in host memory before moving to the GPU. A
``--model problem`` of billions of parameters would be built until the machine swaps or the kernel's
out-of-memory killer ends it; this module refuses such a run first, with the number and the fix.

No torch here: the estimate is arithmetic on the model's sizes (:class:`~pipesched.runtime.models.GPTConfig`
fields, read duck-typed) and the schedule's predicted activation peaks.
"""

from __future__ import annotations

import os
from typing import Any

from pipesched.optimizer.result import Schedule
from pipesched.optimizer.units import format_bytes

__all__ = ["COPIES", "available_memory_bytes", "check_run_memory", "gpt_parameters", "run_memory_bytes"]

#: fp32 copies of the parameters a run holds at its peak: weights and gradients on the ranks (2), weights,
#: gradients and the gradients' clones of the reference (3), the ranks' gradients gathered for the check (1).
COPIES = 6

#: Bytes per element of the runtime's parameters and activations (fp32).
RUNTIME_BYTES = 4


def gpt_parameters(config: Any) -> int:
    """Parameters of :class:`~pipesched.runtime.models.GPTStage` stages for ``config`` (a ``GPTConfig``).

    Per block: two LayerNorms (4h), QKV (3h² + 3h), projection (h² + h), MLP (2·h·f + f + h) with f the FFN
    size; plus token and position embeddings (V·h + s·h), the final LayerNorm (2h) and the LM head (V·h).
    """
    h = config.hidden_size
    f = config.ffn_hidden_size or 4 * h
    per_block = 4 * h * h + 2 * h * f + 9 * h + f
    return config.num_layers * per_block + 2 * config.vocab_size * h + config.seq_length * h + 2 * h


def run_memory_bytes(schedule: Schedule, config: Any) -> tuple[float, int, float]:
    """``(total bytes, parameters, activation bytes)`` a run of ``schedule`` with model ``config`` needs here.

    Activations: the schedule's predicted per-rank activation peak (its ``peak_memory`` minus static), for
    every rank (all run on this machine), plus one microbatch through every stage for the reference; scaled
    from the problem's dtype to fp32.
    """
    problem = schedule.problem
    parameters = gpt_parameters(config)
    dtype_bytes = problem.model.dtype_bytes if problem.model is not None else RUNTIME_BYTES
    scale = RUNTIME_BYTES / dtype_bytes
    static = problem.static_memory
    in_flight = sum(max(0.0, peak - static[rank]) for rank, peak in enumerate(schedule.peak_memory))
    one_microbatch = 0.0
    if problem.memory is not None:
        one_microbatch = sum(problem.stage_values(problem.memory.activation))
    activations = scale * (in_flight + one_microbatch)
    return COPIES * RUNTIME_BYTES * parameters + activations, parameters, activations


def available_memory_bytes() -> float | None:
    """Memory this machine can still give (``MemAvailable`` of /proc/meminfo, else free pages), or ``None``."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def check_run_memory(schedule: Schedule, config: Any, model_name: str, available: float | None = None) -> None:
    """Refuse a run whose model would not fit this machine's available memory.

    Raises:
        ValueError: with the estimate (parameters, bytes), what is available and the fix.
    """
    available = available_memory_bytes() if available is None else available
    if available is None:
        return
    total, parameters, activations = run_memory_bytes(schedule, config)
    if total <= available:
        return
    raise ValueError(
        f"--model {model_name}: the run would need about {format_bytes(total)} of memory on this machine "
        f"({parameters:.3g} parameters × {COPIES} fp32 copies (weights and gradients on the ranks, in the "
        f"single-process reference and gathered for the check) + {format_bytes(activations)} of activations), "
        f"but only {format_bytes(available)} is available: run a smaller model (--model gpt-small, or fewer "
        "layers or a smaller hidden_size in the problem's model section) or on a machine with more memory"
    )
