"""The closed loop on activation memory (issue 25): a run's measured peak activations are what the same machine's
profile predicts, on real gloo processes with FSDP2 (pp 2 × dp 2, sharding full), on PyTorch's runtime and on the
own executor.

The measured figure is the bytes autograd saved, live (:class:`pipesched.runtime.executor.SavedActivationMeter`);
the predicted one the most bytes the rank's passes hold at once on the schedule's timeline
(:func:`pipesched.optimizer.result.peak_activation_bytes`). FSDP2's gathered weights belong to neither: a linear
layer saves its (unsharded) weight for the backward, which the meter had counted as activations, and the report had
predicted "peak less static", which holds the UNSHARD's gathered weights; the two differed by 17–18% on the demo's
dualpipe-v (pp 2 × dp 2 FSDP, torch engine)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

NUM_RANKS = 2
NUM_MICROBATCHES = 8
MODEL = "gpt-tiny"
#: The error the issue's loop asks of a prediction from this machine's profile (measured / predicted − 1).
TOLERANCE = 0.10


@pytest.mark.slow  # a profile (no calibration run) and one launch of two runs on 4 processes: about 40 s on 2 cores
def test_a_runs_peak_activations_are_what_its_profile_predicts_with_fsdp():
    from pipesched.optimizer.solve import solve_family
    from pipesched.runtime.launch import run_schedules
    from pipesched.runtime.options import TrainingOptions
    from pipesched.runtime.profile import measure_model

    training = TrainingOptions(steps=2, lr=0.05, data_parallel=2, sharding="full")
    profile = measure_model(
        num_ranks=NUM_RANKS,
        num_microbatches=NUM_MICROBATCHES,
        stages_per_rank=2,
        placement="v",
        model=MODEL,
        repeats=1,
        warmup=1,
        training=training,
        calibrate=False,  # bytes only: the calibration run times passes and collectives
    )
    runs = [
        (solve_family(profile.problem, "dualpipe-v"), "torch"),
        (solve_family(profile.problem, "zb-v"), "pipesched"),
    ]
    reports = run_schedules(
        [schedule for schedule, _ in runs],
        model=MODEL,
        engine=[engine for _, engine in runs],
        training=[training, training],
        timeout_s=300,
    )
    errors = {}
    for (schedule, engine), report in zip(runs, reports, strict=True):
        assert report is not None and report.verified, (schedule.method, engine)
        for rank in report.ranks:
            assert rank.memory_measure == "saved-activations"
            predicted = rank.predicted_peak_activation_bytes
            assert predicted is not None and predicted > 0
            errors[schedule.method, engine, rank.rank] = (rank.peak_memory_bytes, predicted)
    # before: +12 … +15% on every rank (the saved gathered weights against the UNSHARD's (d−1)/d of them)
    assert all(abs(measured / predicted - 1) <= TOLERANCE for measured, predicted in errors.values()), errors
