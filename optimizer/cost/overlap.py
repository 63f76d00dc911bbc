"""How much of a stage's data-parallel communication its own compute hides, FSDP unit by unit.

FSDP (Zhao et al. 2023, §3.3–3.4; torchtitan applies ``fully_shard`` per transformer block) and Megatron's
bucketed ``overlap_grad_reduce`` move a stage's collectives one unit (a layer) at a time: the gather of unit
i + 1 runs while unit i computes its forward, the reduction of unit i while unit i − 1 computes its backward.
Of a stage whose units are a fraction u each of its parameters, a gather of G ms beside a forward of F ms is
exposed for u·G + (1 − u)·max(0, G − F) (the first unit waits; the rest waits only when the link is slower than
the compute), a reduction of R ms beside a backward of B ms for u·R + (1 − u)·max(0, R − B).

- **Pipelines** (a stage's weights gathered once per step, reduced once after its last backward): the step
  model's UNSHARD takes the exposed part of the gather beside one microbatch's forward, REDUCE_GRAD the
  exposed part of the reduction beside one microbatch's backward; the simulator then hides what it can behind
  other stages' compute.
- **Fully sharded pipelined stages** (FSDP under ``torch.distributed.pipelining``: torchtitan, NeMo AutoModel)
  reduce nothing unit by unit: every backward of the stage runs with ``set_requires_gradient_sync(False)``, and
  after the last one returns the stage calls every FSDP group's ``post_backward`` (``backward_maybe_with_nosync``
  → ``run_post_backward`` in torch's ``distributed/pipelining/stage.py`` from late 2024; in later versions a
  ``REDUCE_GRAD`` action after all of the stage's backwards, ``perform_reduce_grad``), so the whole reduction
  starts after the stage's last backward:
  REDUCE_GRAD is all of it, on the communication stream (it still overlaps the rank's other stages' compute).
- **One stage per rank with ``reshard_after_forward``** (FSDP without pipelining, torchtitan's and PyTorch's
  default): every microbatch gathers the weights for its forward and again for its backward and reduces its
  gradients (sharded gradients cannot be accumulated unsharded). The step model keeps one UNSHARD (the first
  unit, free of compute) and one REDUCE_GRAD (the last unit's reduction); every microbatch's F and I carry
  the rest of their exposed collectives, so the sum over the step is m times the per-microbatch exposure.
- **Backward prefetch after the gradient** (PyTorch FSDP1's ``BackwardPrefetch.BACKWARD_POST``, MosaicML
  Composer's default): unit i − 1's gather starts once unit i's gradients are computed, beside only unit i's
  reduction, so every unit's backward waits for its own gather: the backward exposes all of G, and its compute
  overlaps only the reductions, for (1 − u)·max(0, R − B) more.
- **Gradients reduced once a step** (FSDP2's ``set_requires_gradient_sync(False)``, FSDP1's ``no_sync``, on
  all but the last microbatch: the software profile's ``fsdp_gradient_sync`` "last_microbatch"): the weights are
  still gathered every microbatch, but only the last microbatch's backward carries the reduction; the others'
  backward overlaps their gathers alone. The passes take the mean over the step's microbatches.
- **Beside compute**, every collective slows the compute it overlaps by ``overlap_slowdown`` of its own time
  (shared SMs and memory bandwidth), spread over the stage's passes.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StageOverlap", "stage_overlap"]


@dataclass(frozen=True)
class StageOverlap:
    """A stage's collectives as the step model times them, and the time each microbatch's passes gain (ms)."""

    unshard_ms: float
    reduce_grad_ms: float
    forward_extra_ms: float
    backward_input_extra_ms: float


def stage_overlap(
    *,
    gather_ms: float,
    reduce_ms: float,
    forward_ms: float,
    backward_ms: float,
    unit_fraction: float,
    num_microbatches: int,
    per_microbatch: bool,
    slowdown: float,
    prefetch_after_backward: bool = False,
    reduce_every_microbatch: bool = True,
    reduce_after_backward: bool = False,
) -> StageOverlap:
    """The module docstring's exposure of one stage.

    Args:
        gather_ms, reduce_ms: the stage's whole all-gather and reduction (ms).
        forward_ms, backward_ms: one microbatch's forward and backward (I + W) of the stage (ms).
        unit_fraction: u, the largest unit's share of the stage's parameters (1: one unit).
        num_microbatches: m.
        per_microbatch: FSDP without pipelining, resharding after forward (every microbatch gathers twice and
            reduces once).
        slowdown: the profile's ``overlap_slowdown``.
        prefetch_after_backward: FSDP's ``BACKWARD_POST`` prefetch (the software profile's
            ``fsdp_backward_prefetch``): with ``per_microbatch``, the backward's gathers are not overlapped.
        reduce_every_microbatch: with ``per_microbatch``, every microbatch's backward reduces its gradients
            (PyTorch's default); False: only the last one's (the software profile's ``fsdp_gradient_sync``
            "last_microbatch"), the others' backward gathers only.
        reduce_after_backward: without ``per_microbatch``, the reduction starts only after the stage's last
            backward (fully sharded stages under PyTorch's pipelining): REDUCE_GRAD is the whole of it.
    """
    u = min(1.0, max(unit_fraction, 0.0))
    m = max(num_microbatches, 1)
    if not per_microbatch:
        unshard = u * gather_ms + (1 - u) * max(0.0, gather_ms - forward_ms)
        reduce = reduce_ms if reduce_after_backward else u * reduce_ms + (1 - u) * max(0.0, reduce_ms - backward_ms)
        spread = slowdown * (gather_ms + reduce_ms) / m
        return StageOverlap(unshard, reduce, spread / 2, spread / 2)
    forward_stall = (1 - u) * max(0.0, gather_ms - forward_ms)

    def backward(reduce: float) -> float:
        """One microbatch's backward stall and slowdown with ``reduce`` ms of reduction in it."""
        if prefetch_after_backward:  # every unit's gather waits for the gradients before it; compute hides reductions
            return gather_ms + (1 - u) * max(0.0, reduce - backward_ms) + slowdown * reduce
        comm = gather_ms + reduce
        return u * gather_ms + (1 - u) * max(0.0, comm - backward_ms) + slowdown * comm

    first_gather = u * gather_ms
    last_reduce = u * reduce_ms
    # every microbatch but the first waits for its first unit's gather; all but the last for its last reduction
    forward_extra = forward_stall + first_gather * (m - 1) / m + slowdown * gather_ms
    if reduce_every_microbatch:
        backward_extra = backward(reduce_ms) + last_reduce * (m - 1) / m
    else:  # only the last microbatch reduces (its last unit's reduction is REDUCE_GRAD's)
        backward_extra = ((m - 1) * backward(0.0) + backward(reduce_ms)) / m
    return StageOverlap(first_gather, last_reduce, forward_extra, backward_extra)
