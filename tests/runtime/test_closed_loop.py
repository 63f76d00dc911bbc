"""The closed loop on real processes: ``pipesched profile`` measures on the processes a run starts, a family's schedule
is solved from that profile, and the run it predicts verifies and holds the static memory the profile predicted, byte
for byte (weights, gradients and optimizer state as the update rule allocates them; FSDP2's shards). The timing claims
(measured step within −20 %/+25 % of predicted) are the bench's (``bench/runtime_bench.py``): on 2 shared cores a test
can only check that the prediction is the profile's."""

from __future__ import annotations

import pytest

from pipesched.optimizer.solve import solve_family

torch = pytest.importorskip("torch")

USER_MODEL = "tests.runtime.user_pipeline_model:tiny_stages"


@pytest.mark.slow  # two launches each (a profile with its calibration run, then the run): 30–90 s on 2 shared cores
@pytest.mark.parametrize(
    "model,family,options",
    [
        ("gpt-tiny", "zb-h1", {"steps": 2, "lr": 0.1, "sharding": "none"}),
        (USER_MODEL, "1f1b", {"steps": 2, "optimizer": "adamw", "lr": 1e-2, "data_parallel": 2, "sharding": "full"}),
    ],
    ids=["sgd", "adamw-fsdp-dp2"],
)
def test_a_profiled_schedule_runs_with_the_static_memory_its_profile_predicted(model, family, options):
    from pipesched.runtime.launch import run_schedule
    from pipesched.runtime.options import TrainingOptions
    from pipesched.runtime.profile import measure_model

    training = TrainingOptions(**options)
    profile = measure_model(num_ranks=2, num_microbatches=4, model=model, repeats=2, warmup=1, training=training)
    assert profile.calibration is not None and profile.p2p is not None
    assert profile.calibration.measured_ms > 0 and profile.p2p.bandwidth_bytes_per_s > 0
    problem = profile.problem
    overlap = profile.calibration.overlap
    assert problem.costs is not None
    # PipeDream-2BW's rule adds a copy of every weight into its second version each step: its optimizer step is
    # the synchronous one plus that copy, on every pipeline rank
    two_versions = profile.two_version_optimizer_step
    assert two_versions is not None and len(two_versions) == 2
    assert all(b > a > 0 for a, b in zip(problem.costs.optimizer_step, two_versions, strict=True))
    if training.data_parallel > 1:
        assert problem.data_parallel is not None and problem.data_parallel.size == 2
        assert set(profile.collectives) == {"unshard", "reduce_grad"}
        # the calibration's passes beside a collective, if any, against the same passes alone: measured and
        # reported, written into the problem only when asked (measure_model's overlap_slowdown)
        assert problem.costs.overlap_slowdown == 0.0
        # each collective's wait for its last replica, from the same calibration run: a wait per stage, ≥ 0;
        # reported, written into the problem only when asked (measure_model's replica_wait)
        waits = profile.calibration.replica_waits
        assert set(waits) == {"unshard_wait", "reduce_grad_wait"}
        assert all(len(values) == 2 and min(values) >= 0 for values in waits.values())
        assert problem.costs.unshard_wait is None and problem.costs.reduce_grad_wait is None
        # the calibration's collectives beside the passes, if any, against the same collectives alone: measured and
        # reported with each stage's cost as seen and alone, written only when asked (communication_slowdown)
        communication = profile.calibration.communication
        assert problem.costs.communication_slowdown == 0.0
        if communication is not None:
            assert communication.slowdown >= 0 and set(communication.seen) == set(communication.work)
            for name, seen in communication.seen.items():  # the problem's costs: the collectives as seen
                assert problem.stage_values(getattr(problem.costs, name)) == pytest.approx(seen, abs=1e-5)
    else:  # no collectives: the one-replica cases stay as they were
        assert overlap is None and problem.costs.overlap_slowdown == 0.0
        assert profile.calibration.communication is None and problem.costs.communication_slowdown == 0.0
        assert not profile.calibration.replica_waits and problem.costs.reduce_grad_wait is None
    schedule = solve_family(problem, family)
    report = run_schedule(schedule, model=model, engine="pipesched", training=training, timeout_s=300)
    assert report is not None and report.verified, report.model_dump(include={"max_rel_param_error", "losses"})
    assert report.predicted_step_time_ms == pytest.approx(schedule.step_time)
    for rank in report.ranks:
        assert rank.static_bytes_measured == rank.static_bytes_predicted
        assert len(rank.communication_hidden_ms) == len(rank.communication_exposed_ms) == training.steps


def test_one_pipeline_rank_closes_the_loop_without_p2p():
    """The loop on a single process (one GPU): nothing crosses processes, so the profile records no p2p cost
    (not a fit of no samples), and the run it predicts verifies with the static memory the profile measured."""
    from pipesched.runtime.launch import run_schedule
    from pipesched.runtime.profile import measure_model

    profile = measure_model(num_ranks=1, num_microbatches=4, model="gpt-tiny", repeats=2, warmup=1)
    problem = profile.problem
    assert profile.p2p is None and problem.costs is not None and problem.costs.p2p == 0.0
    schedule = solve_family(problem, "1f1b")
    report = run_schedule(schedule, model="gpt-tiny", engine="pipesched", timeout_s=120)
    assert report is not None and report.verified
    assert [(rank.static_bytes_measured, rank.static_bytes_predicted) for rank in report.ranks] == [
        (report.ranks[0].static_bytes_predicted,) * 2
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer on a machine without GPUs")
def test_a_profile_on_cuda_without_gpus_names_the_fix_before_starting_processes():
    from pipesched.runtime.launch import ScheduleError
    from pipesched.runtime.profile import measure_model

    with pytest.raises(ScheduleError, match="needs CUDA GPUs; use gloo"):
        measure_model(num_ranks=2, num_microbatches=4, model="gpt-tiny", repeats=1, device="cuda")
