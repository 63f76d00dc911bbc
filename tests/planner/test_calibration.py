"""Calibrated predictions: the published rows, the shipped profiles, FP8, memory headroom, intervals, calibrate."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from pipesched.api.cli import app as cli_app
from pipesched.optimizer.accelerators import CATALOGUE
from pipesched.optimizer.calibration.calibrate import calibrate
from pipesched.optimizer.calibration.catalogue import row_kernels_class, unknown_kernels_shares
from pipesched.optimizer.calibration.predict import configuration, estimator, predict, run_software
from pipesched.optimizer.configs import ModelConfig
from pipesched.optimizer.cost.calibration.measurements import (
    CONTEXT_EXPERT_SOURCES,
    Measurement,
    builtin_measurements,
    fitting_measurements,
    parse_measurements,
)
from pipesched.optimizer.cost.flops import layer_parameters
from pipesched.optimizer.cost.overlap import stage_overlap
from pipesched.optimizer.cost.profile import RUN_KERNELS, SoftwareProfile, builtin_catalogue, load_catalogue
from pipesched.optimizer.cost.stages import register_profile
from pipesched.optimizer.partition import TIE_TOLERANCE
from pipesched.optimizer.planner.evaluate import build_problem
from pipesched.optimizer.planner.prune import Estimate
from pipesched.optimizer.planner.rank import plan
from pipesched.optimizer.planner.request import PlanRequest
from pipesched.optimizer.units import format_bytes

GIB = 1024**3
HOLDOUT = Path(__file__).resolve().parents[2] / "bench" / "data" / "calibration_holdout.json"
EXTERNAL = HOLDOUT.with_name("calibration_holdout_external.json")
OWN_H100 = Path(__file__).resolve().parents[2] / "bench" / "results" / "device" / "rows.json"
OWN_H200 = Path(__file__).resolve().parents[2] / "bench" / "results" / "device" / "h200" / "rows.json"
ROWS = {row.id: row for row in builtin_measurements()}
TORCHTITAN_8B = ROWS["torchtitan-8b-8-fsdp"]


def plan_request(preset: str = "llama3.1-8b", nodes: int = 1, batch: int = 16, **fields: Any) -> PlanRequest:
    search = {"time_limit_s": 10, "top": 3, **fields.pop("search", {})}
    cluster = {"accelerator": "H100-SXM", "num_nodes": nodes, **fields.pop("cluster", {})}
    training = {"global_batch_size": batch, **fields.pop("training", {})}
    return PlanRequest.model_validate(
        {"model": {"preset": preset}, "cluster": cluster, "training": training, "search": search}
    )


def test_every_row_names_its_source_and_keeps_its_batch_identity() -> None:
    rows = builtin_measurements()
    assert len(rows) >= 250
    assert {row.accelerator for row in rows} >= {"A100-40GB", "A100-80GB", "H100-SXM", "B200"}
    assert {row.training.precision for row in rows} == {"bf16", "fp8"}
    for row in rows:
        assert row.source and row.key.startswith(row.source + "/")
        layout, run = row.layout, row.training
        assert layout.data_parallel * run.num_microbatches * run.micro_batch_size == run.global_batch_size


def test_the_profile_fit_holds_out_every_context_and_expert_parallel_row() -> None:
    fitted = fitting_measurements()
    held_out = [row for row in builtin_measurements() if row.source in CONTEXT_EXPERT_SOURCES]
    assert len(fitted) >= 250 and len(held_out) >= 50
    for row in fitted:
        assert row.layout.context_parallel == row.layout.expert_parallel == 1 and not row.model.is_moe, row.key
    assert {row.source for row in held_out} == set(CONTEXT_EXPERT_SOURCES)


def test_a_row_whose_batch_does_not_add_up_is_refused_with_the_fix() -> None:
    row = TORCHTITAN_8B.model_dump(mode="json", exclude={"source"})
    row["training"]["global_batch_size"] = 17
    with pytest.raises(ValidationError, match="global_batch_size"):
        parse_measurements([row])


def test_shipped_profiles_predict_torchtitans_8b_fsdp_on_8_h100s_within_15_percent() -> None:
    predicted = predict(TORCHTITAN_8B).tokens_per_s_per_gpu
    assert predicted is not None and abs(predicted / 5762 - 1) <= 0.15
    # the planner itself, torchtitan's layout pinned on its 500 W H100s (their sustained peak), gives the same figure
    pins = {"pipeline_parallel": [1], "tensor_parallel": [1], "sharding": ["full"], "micro_batch_size": [2]}
    sustained = builtin_catalogue().profiles["H100-SXM"].power_limited_peak["500"]
    peak = CATALOGUE["H100-SXM"].flops_per_s * sustained
    cluster = {"memory_bytes": 96 * GIB, "memory_bandwidth_bytes_per_s": 2.4e12, "flops_per_s": peak}
    search = {**pins, "activation_recomputation": ["selective"]}
    answer = plan(plan_request(search=search, cluster=cluster, training={"kernels": "eager"})).answer
    assert answer.plans[0].tokens_per_s_per_gpu == pytest.approx(predicted, rel=0.02)


def test_a_sample_of_published_rows_is_predicted_within_the_bench_targets() -> None:
    sample = [row for row in builtin_measurements() if row.layout.pipeline_parallel == 1][::6]
    errors = [abs(predict(row).tokens_per_s_per_gpu / row.measured.tokens_per_s_per_gpu - 1) for row in sample]  # type: ignore[operator]
    assert statistics.median(errors) <= 0.10


def test_fp8_is_faster_on_h100_and_refused_where_there_are_no_fp8_tensor_cores() -> None:
    by_precision = {}
    for precision in ("bf16", "fp8"):
        search = {"precision": [precision], "pipeline_parallel": [1], "top": 1}
        by_precision[precision] = plan(plan_request(search=search)).answer.plans[0].tokens_per_s_per_gpu
    assert by_precision["fp8"] > by_precision["bf16"]
    with pytest.raises(ValidationError) as excinfo:
        plan(plan_request(cluster={"accelerator": "A100-80GB"}, training={"precision": "fp8"}))
    assert ("training", "precision") in {tuple(error["loc"]) for error in excinfo.value.errors()}


def test_plans_keep_the_headroom_and_say_what_was_reserved() -> None:
    answer = plan(plan_request("llama3.1-70b", nodes=8, batch=64, search={"time_limit_s": 8, "top": 5})).answer
    assert answer.plans
    profile = builtin_catalogue().get("H100-SXM")
    assert profile is not None
    assert answer.memory_headroom_bytes == pytest.approx(profile.headroom_bytes(80 * GIB), rel=1e-6)
    for item in answer.plans:
        assert item.peak_memory_bytes <= 80 * GIB - answer.memory_headroom_bytes
        assert item.peak_memory_bytes <= 0.95 * 80 * GIB
        low, high = item.tokens_per_s_per_gpu_interval
        assert low < item.tokens_per_s_per_gpu < high
    explicit = plan(plan_request(cluster={"memory_headroom_bytes": 10 * GIB}, search={"pipeline_parallel": [1]})).answer
    assert explicit.memory_headroom_bytes == 10 * GIB
    assert all(item.peak_memory_bytes <= 70 * GIB for item in explicit.plans)


def test_the_answer_says_when_the_best_mfu_is_above_any_measured() -> None:
    profile = builtin_catalogue().get("H100-SXM")
    assert profile is not None
    register_profile(profile.model_copy(update={"name": "h100-low-ceiling", "max_measured_mfu": {"bf16": 0.05}}))
    answer = plan(plan_request(cluster={"profile": "h100-low-ceiling"}, search={"pipeline_parallel": [1]})).answer
    assert any("above the highest MFU measured" in note for note in answer.notes)
    # torchtitan's eager kernels as measured; kernels "unknown" may well predict above the measured ceiling
    # (context parallelism pinned off: CP 2 at 8k tokens predicts 45.5%, just above the 45.1% measured, and says so)
    search = {"pipeline_parallel": [1], "context_parallel": [1]}
    ordinary = plan(plan_request(search=search, training={"kernels": "eager"})).answer
    assert not any("above the highest MFU measured" in note for note in ordinary.notes)


def test_an_unknown_profile_is_a_field_error_listing_the_known_ones() -> None:
    with pytest.raises(ValidationError) as excinfo:
        plan(plan_request(cluster={"profile": "no-such-profile"}))
    messages = {tuple(error["loc"]): error["msg"] for error in excinfo.value.errors()}
    assert "H100-SXM" in messages[("cluster", "profile")]


def test_a_profile_of_another_accelerator_is_a_field_error() -> None:
    # An H100 profile named beside an A100 was used as given: the A100's plans took the H100's efficiencies, and
    # the answer's note called the H100 rows' highest MFU (46.4%) "the highest MFU measured on A100-80GB".
    profile = builtin_catalogue().get("H100-SXM")
    assert profile is not None
    register_profile(profile.model_copy(update={"name": "h100-beside-an-a100"}))
    with pytest.raises(ValidationError) as excinfo:
        plan(plan_request(cluster={"accelerator": "A100-80GB", "profile": "h100-beside-an-a100"}))
    messages = {tuple(error["loc"]): error["msg"] for error in excinfo.value.errors()}
    assert "H100-SXM" in messages[("cluster", "profile")] and "A100-80GB" in messages[("cluster", "profile")]
    assert "drop cluster.accelerator" in messages[("cluster", "profile")]
    same = plan(
        plan_request(
            cluster={"accelerator": "h100-sxm", "profile": "h100-beside-an-a100"}, search={"pipeline_parallel": [1]}
        )
    )
    assert same.answer.plans and same.answer.profile and same.answer.profile.startswith("h100-beside-an-a100")


@pytest.mark.parametrize("slower", [1.0, 0.8])
def test_calibrate_refits_a_published_row_to_within_5_percent(tmp_path: Path, slower: float) -> None:
    row = ROWS["mpt-a100-80gb-7b-s2048-g8-b6x2"].model_dump(mode="json", exclude={"source"})
    row["measured"]["tokens_per_s_per_gpu"] *= slower  # the same run on a user's slower cluster
    measurements = tmp_path / "runs.json"
    measurements.write_text(json.dumps({"rows": [row]}))
    output = tmp_path / "profile.json"
    result = CliRunner().invoke(
        cli_app, ["calibrate", str(measurements), "-o", str(output), "--name", f"mine-{slower}"]
    )
    assert result.exit_code == 0, result.output
    profile = next(iter(load_catalogue(output).profiles.values()))
    register_profile(profile)
    refit = predict(parse_measurements([row])[0], profile=f"mine-{slower}").tokens_per_s_per_gpu
    assert refit is not None and abs(refit / row["measured"]["tokens_per_s_per_gpu"] - 1) <= 0.05


def test_calibrate_prints_the_measured_peak_memory_beside_the_predicted(tmp_path: Path) -> None:
    """A measurement file whose row gives ``measured.peak_memory_bytes`` (torchtitan's Llama 3.1 8B on 8 H100s,
    one of mine without it): the table had shown tokens/s only; it now shows the peak measured, the built-in
    profile's prediction and the error, with the calibrated profile's beside it as for tokens/s (the calibration
    refits the activation memory factor to the rows with a peak), and leaves the cells of a row without one empty."""
    with_peak = TORCHTITAN_8B.model_dump(mode="json", exclude={"source"})
    without = {**with_peak, "id": "mine-no-peak", "measured": {"tokens_per_s_per_gpu": 5500.0}}
    measurements = tmp_path / "runs.json"
    measurements.write_text(json.dumps({"rows": [with_peak, without]}))
    result = CliRunner().invoke(cli_app, ["calibrate", str(measurements), "-o", str(tmp_path / "profile.json")])
    assert result.exit_code == 0, result.output
    predicted = predict(TORCHTITAN_8B).peak_memory_bytes
    peak = TORCHTITAN_8B.measured.peak_memory_bytes
    assert peak is not None and predicted is not None
    text = " ".join(result.output.split())
    assert "tokens/s per GPU and peak memory" in text and "peak measured" in text
    line = next(line for line in result.output.splitlines() if TORCHTITAN_8B.id in line)
    assert format_bytes(peak) in line and format_bytes(predicted) in line and f"{predicted / peak - 1:+.1%}" in line
    line = next(line for line in result.output.splitlines() if "mine-no-peak" in line)
    assert line.count("GiB") == 0


def test_calibrate_refuses_rows_of_two_accelerators(tmp_path: Path) -> None:
    rows = [ROWS["mpt-a100-80gb-7b-s2048-g8-b6x2"], TORCHTITAN_8B]
    with pytest.raises(ValidationError, match="calibrate each separately"):
        calibrate(rows)
    measurements = tmp_path / "runs.json"
    measurements.write_text(json.dumps([{"id": "x"}]))
    result = CliRunner().invoke(cli_app, ["calibrate", str(measurements)])
    assert result.exit_code == 2 and "measured" in result.output


def test_calibrate_names_an_unknown_accelerator_on_its_row(tmp_path: Path) -> None:
    """It had said "the rows span H100-SXM, H900: … calibrate each separately", on ``rows``, for a typo."""
    good = ROWS["mpt-a100-80gb-7b-s2048-g8-b6x2"].model_dump(mode="json", exclude={"source"})
    measurements = tmp_path / "runs.json"
    measurements.write_text(json.dumps({"rows": [good, {**good, "id": "typo", "accelerator": "A100-80G"}]}))
    result = CliRunner().invoke(cli_app, ["calibrate", str(measurements)])
    assert result.exit_code == 2, result.output
    assert "rows.1.accelerator: unknown accelerator 'A100-80G'" in result.output and "A100-80GB" in result.output


def _sharding(chosen: Any) -> str | None:
    """The plan's data-parallel sharding, None without data parallelism."""
    copies = chosen.data_parallel.size * chosen.context_parallel
    return chosen.data_parallel.sharding if copies > 1 else None


def test_kernels_not_said_are_unknown_with_the_wider_interval_of_that_fit() -> None:
    software = builtin_catalogue().software
    said = plan(plan_request(training={"kernels": "eager"})).answer.plans[0]
    unsaid = plan(plan_request()).answer.plans[0]
    low, high = software.unknown_interval(_sharding(unsaid))
    assert low < 0 < high
    for chosen in (said, unsaid):
        assert (
            chosen.tokens_per_s_per_gpu_interval[0]
            < chosen.tokens_per_s_per_gpu
            < chosen.tokens_per_s_per_gpu_interval[1]
        )
    spread = unsaid.tokens_per_s_per_gpu_interval[1] / unsaid.tokens_per_s_per_gpu_interval[0]
    assert spread >= math.exp(high - low) * 0.999
    assert spread >= said.tokens_per_s_per_gpu_interval[1] / said.tokens_per_s_per_gpu_interval[0] * 0.999


def test_kernels_not_said_take_the_expected_time_of_the_frameworks_that_run_the_layout() -> None:
    # torchtitan's Llama 3.1 8B FSDP on 8 H100s (5,762 tok/s/GPU, eager): FSDP layouts are mostly published by
    # eager PyTorch stacks, so kernels not said predict it within 15% (a compiled or fused run is faster)
    speeds = {mode: predict(TORCHTITAN_8B, kernels=mode).tokens_per_s_per_gpu for mode in ("unknown", *RUN_KERNELS)}
    shares = builtin_catalogue().software.kernels_shares("unknown", "full")
    expected_time = sum(share / speeds[mode] for mode, share in shares.items())  # type: ignore[operator]
    assert speeds["unknown"] == pytest.approx(1 / expected_time, rel=0.01)  # the time, not the speed, averaged
    assert speeds["eager"] < speeds["unknown"] < speeds["fused"]  # type: ignore[operator]
    assert abs(speeds["unknown"] / TORCHTITAN_8B.measured.tokens_per_s_per_gpu - 1) <= 0.15  # type: ignore[operator]
    # the same layout with replicated weights (ZeRO-1: Megatron's distributed optimizer) leans on fused kernels
    zero1 = TORCHTITAN_8B.model_copy(
        update={"layout": TORCHTITAN_8B.layout.model_copy(update={"sharding": "optimizer"})}
    )
    replicated = builtin_catalogue().software.kernels_shares("unknown", "optimizer")
    assert max(replicated, key=replicated.__getitem__) == "fused"
    assert predict(zero1, kernels="unknown").tokens_per_s_per_gpu > speeds["unknown"]  # type: ignore[operator]


def test_a_search_over_both_layout_classes_favours_no_layout_for_the_frameworks_that_publish_it() -> None:
    # the same 8B layout on 8 H100s, FSDP against ZeRO-1: the framework a user runs does not change with the
    # sharding the planner picks, so kernels not said rank them as some one framework would, not FSDP as eager
    # PyTorch and ZeRO-1 as Megatron's fused kernels
    pins = {"tensor_parallel": [1], "pipeline_parallel": [1], "micro_batch_size": [1], "top": 4}
    pins["activation_recomputation"] = ["full"]

    def by_sharding(sharding: list[str], **training: str) -> tuple[dict[str, float], list[str]]:
        request = plan_request(training=training, search={**pins, "sharding": sharding})
        answer = plan(request).answer
        return {p.data_parallel.sharding: p.tokens_per_s_per_gpu for p in answer.plans}, answer.notes

    unsaid, notes = by_sharding(["full", "optimizer"])
    ratios = {"unknown": unsaid["optimizer"] / unsaid["full"]}
    for mode in ("eager", "fused"):
        said, _ = by_sharding(["full", "optimizer"], kernels=mode)
        ratios[mode] = said["optimizer"] / said["full"]
    assert (
        min(ratios["eager"], ratios["fused"]) * 0.99
        <= ratios["unknown"]
        <= max(ratios["eager"], ratios["fused"]) * 1.01
    )
    assert any("all published runs" in note for note in notes)
    # a search within one class keeps that class's frameworks: FSDP alone is predicted slower than in the mix
    fsdp, fsdp_notes = by_sharding(["full"])
    assert fsdp["full"] < unsaid["full"]
    assert any("published FSDP runs" in note and "eager" in note for note in fsdp_notes)


def test_kernels_not_said_widen_a_context_parallel_plans_interval_down_to_pytorchs_ring() -> None:
    search = {"time_limit_s": 10, "top": 1, "context_parallel": [4], "data_parallel_size": [2], "sharding": ["full"]}
    search.update(tensor_parallel=[1], pipeline_parallel=[1], micro_batch_size=[1], activation_recomputation=["full"])

    def ring_plan(**kernels: str) -> Any:
        request = {
            # 64k tokens: at 128k each CP rank's loss alone (32k tokens × 128k vocabulary, fp32 logits and their
            # gradients: 12 B a logit element) would hold ~50 GB
            "model": {"preset": "llama3.1-8b", "seq_length": 65536},
            "cluster": {"accelerator": "H100-SXM", "num_nodes": 1},
            "training": {"global_batch_size": 8, "precision": "fp8", **kernels},
            "search": search,
        }
        return plan(PlanRequest.model_validate(request)).answer.plans[0]

    unsaid, eager, fused = ring_plan(), ring_plan(kernels="eager"), ring_plan(kernels="fused")
    low = unsaid.tokens_per_s_per_gpu_interval[0]
    assert eager.tokens_per_s_per_gpu < unsaid.tokens_per_s_per_gpu < fused.tokens_per_s_per_gpu
    assert low < eager.tokens_per_s_per_gpu  # PyTorch's FlashAttention-2 ring, the slowest, inside the interval
    assert fused.tokens_per_s_per_gpu_interval[0] > eager.tokens_per_s_per_gpu  # said: no such spread
    # below what the frameworks' spread of FSDP runs alone would give: the ring's own spread on top
    class_low, _ = builtin_catalogue().software.unknown_interval("full")
    assert low < unsaid.tokens_per_s_per_gpu * math.exp(class_low) * 0.95


def test_a_catalogue_written_before_a_kernels_mode_existed_takes_its_defaults() -> None:
    software = SoftwareProfile.model_validate(
        {"elementwise_traffic": {"eager": 1.3}, "unknown_kernels_log_error": [-0.2, 0.25]}
    )
    assert software.elementwise_traffic == {"eager": 1.3, "compiled": 1.0, "fused": 1.0}
    assert set(software.kernels_per_layer) == set(RUN_KERNELS)
    assert software.unknown_interval("full") == software.unknown_interval(None) == (-0.2, 0.25)


def test_the_2023_attention_kernels_run_slower_on_hopper_than_on_ampere() -> None:
    software = builtin_catalogue().software
    hopper = software.attention_speed("flash-attn-2023", "H100-SXM")
    assert hopper < software.attention_speed("flash-attn-2023", "A100-80GB") <= 1.0
    assert software.attention_speed("current", "H100-SXM") == 1.0  # no entry: today's kernels


def test_a_power_capped_run_is_predicted_at_its_sustained_peak() -> None:
    """torchtitan's Grand Teton H100s ran at 500 W: the fitted sustained peak lies between the NVL's (835 of 989
    TFLOPS at 400 W) and the SXM's, and only the compute-bound share of the step slows by it."""
    assert TORCHTITAN_8B.power_limit_w == 500
    sustained = builtin_catalogue().profiles["H100-SXM"].power_limited_peak["500"]
    assert 835 / 989 <= sustained < 1.0
    capped = predict(TORCHTITAN_8B).tokens_per_s_per_gpu
    uncapped = predict(TORCHTITAN_8B.model_copy(update={"power_limit_w": None})).tokens_per_s_per_gpu
    assert capped is not None and uncapped is not None
    assert sustained < capped / uncapped < 1.0


def test_pytorch_runs_on_hopper_spend_longer_in_attention_than_transformer_engine_runs() -> None:
    """PyTorch's SDPA runs FlashAttention-2 on an H100 (cost.context.pytorch_attention_speed): at 32k tokens,
    where attention is about half of the FLOPs, the eager prediction of torchtitan's row loses more to a fused
    one than at 8k."""
    long_row = ROWS["torchtitan-8b-8-fsdp-s32768"]

    def eager_over_fused(row: Measurement) -> float:
        eager = row.model_copy(update={"software": row.software.model_copy(update={"compile": False})})
        fused = row.model_copy(update={"software": row.software.model_copy(update={"fused_kernels": True})})
        return predict(fused).tokens_per_s_per_gpu / predict(eager).tokens_per_s_per_gpu  # type: ignore[operator]

    short_row = long_row.model_copy(update={"model": long_row.model.model_copy(update={"seq_length": 8192})})
    assert eager_over_fused(long_row) > eager_over_fused(short_row) > 1.0


def test_a_pytorch_run_on_cudnns_attention_kernels_times_attention_as_transformer_engine_does() -> None:
    """torch 2.11's SDPA runs cuDNN's Hopper kernels (software.attention_kernel "cudnn", measured by
    bench/device_step_bench.py): the eager row then gains on its FlashAttention-2 self, more at 32k tokens (about
    half the FLOPs in attention) than at 8k."""

    def gain(row: Measurement) -> float:
        eager = row.model_copy(update={"software": row.software.model_copy(update={"compile": False})})
        stated = eager.software.model_copy(update={"attention_kernel": "cudnn"})
        fast, flash = predict(eager.model_copy(update={"software": stated})), predict(eager)
        return fast.tokens_per_s_per_gpu / flash.tokens_per_s_per_gpu  # type: ignore[operator]

    long_row = ROWS["torchtitan-8b-8-fsdp-s32768"]
    short_row = long_row.model_copy(update={"model": long_row.model.model_copy(update={"seq_length": 8192})})
    assert gain(long_row) > gain(short_row) > 1.02
    assert gain(long_row) > 1.1


def test_the_steps_measured_on_an_h100_are_predicted_within_15_percent() -> None:
    """bench/device_step_bench.py's rows (Llama-shaped FSDP2 steps on one H100, torch 2.11, never fitted): each
    within 15% of its measured tokens/s with the attention kernel it ran (cuDNN's), and timed as PyTorch's
    FlashAttention-2 the long-sequence 1B-shaped row falls short by more than 20%."""
    rows = parse_measurements(json.loads(OWN_H100.read_text()))
    assert len(rows) == 6 and all(row.software.attention_kernel == "cudnn" for row in rows)
    for row in rows:
        predicted = predict(row).tokens_per_s_per_gpu
        assert predicted is not None
        assert abs(predicted / row.measured.tokens_per_s_per_gpu - 1) < 0.15, row.id
    long_1b = next(row for row in rows if row.id == "own-h100-llama1b-s8192-b1")
    as_flash = long_1b.model_copy(
        update={"software": long_1b.software.model_copy(update={"attention_kernel": "current"})}
    )
    assert predict(as_flash).tokens_per_s_per_gpu < 0.8 * long_1b.measured.tokens_per_s_per_gpu  # type: ignore[operator]


def test_async_tensor_parallel_hides_part_of_the_tensor_parallel_traffic() -> None:
    vanilla = ROWS["torchtitan-70b-256-2d"]
    asynchronous = ROWS["torchtitan-70b-256-2d-asynctp"]
    hidden = builtin_catalogue().software.async_tensor_parallel_hidden
    assert 0 < hidden < 0.9
    gain = predict(asynchronous).tokens_per_s_per_gpu / predict(vanilla).tokens_per_s_per_gpu  # type: ignore[operator]
    published = asynchronous.measured.tokens_per_s_per_gpu / vanilla.measured.tokens_per_s_per_gpu
    assert 1.0 < gain < 1.25 and published < 1.1


def test_held_out_interval_is_the_calibrations_own() -> None:
    for name in ("A100-80GB", "H100-SXM"):
        profile = builtin_catalogue().get(name)
        assert profile is not None and profile.fitted_rows > 20
        low, high = profile.held_out_log_error
        assert -0.5 < low < 0 < high < 0.5
    assert math.isfinite(builtin_catalogue().software.elementwise_traffic["eager"])


@pytest.mark.parametrize("accelerator", sorted(CATALOGUE))
def test_no_plan_peaks_above_95_percent_of_the_gpus_memory(accelerator: str) -> None:
    memory = CATALOGUE[accelerator].memory_bytes
    answer = plan(plan_request(cluster={"accelerator": accelerator}, search={"time_limit_s": 2, "top": 5})).answer
    assert answer.plans and answer.memory_headroom_bytes >= 0.05 * memory
    for item in answer.plans:
        assert item.peak_memory_bytes <= min(0.95 * memory, memory - answer.memory_headroom_bytes)


def test_held_out_rows_stay_out_of_the_fit_and_unknown_kernels_count_who_published_each_layout() -> None:
    held_out = [row for entry in json.loads(HOLDOUT.read_text())["files"] for row in parse_measurements(entry)]
    fitted = fitting_measurements()
    assert len(held_out) >= 19
    assert not {row.key for row in held_out} & {row.key for row in fitted}
    assert not {row.source for row in held_out} & {row.source for row in builtin_measurements()}
    shares = unknown_kernels_shares(fitted)
    assert builtin_catalogue().software.unknown_kernels_shares == shares  # shipped as counted
    for votes in shares.values():
        assert sum(votes.values()) == pytest.approx(1, abs=1e-3)
    # every ZeRO-1/DDP run published with a layout is Megatron/NeMo's (fused) but MosaicML's few ZeRO-2 ones;
    # fully sharded runs are mostly PyTorch's (torchtitan, llm-foundry)
    assert shares["replicated"]["fused"] > 0.5 and shares["full"]["eager"] > 0.5
    full = {(row.source, row.accelerator) for row in fitted if row_kernels_class(row) == "full"}
    assert ("torchtitan_h100_202412", "H100-SXM") in full


def test_external_held_out_rows_parse_and_stay_out_of_the_fit_and_of_the_torchtitan_holdout() -> None:
    # the check of layouts written by someone else: other stacks (MaxText, NeMo BF16 at scale, IBM's FSDP)
    entries = json.loads(EXTERNAL.read_text())["files"]
    external = [row for entry in entries for row in parse_measurements(entry)]
    torchtitan = [row for entry in json.loads(HOLDOUT.read_text())["files"] for row in parse_measurements(entry)]
    assert len(external) >= 20 and len({row.key for row in external}) == len(external)
    assert len({row.source for row in external}) >= 4
    assert {row.accelerator for row in external} >= {"A100-80GB", "H100-SXM"}
    shipped = {row.source for row in builtin_measurements()} | {row.source for row in torchtitan}
    assert not {row.source for row in external} & shipped
    assert all(entry["source"]["commit"] and entry["source"]["url"].startswith("https://") for entry in entries)

    def run(row: Measurement) -> tuple[object, ...]:  # the same run republished under another source's name
        layout, model = row.layout, row.model
        return (
            row.accelerator,
            row.training.precision,
            row.num_gpus,
            layout.tensor_parallel,
            layout.pipeline_parallel,
            layout.stages_per_rank,
            row.training.micro_batch_size,
            row.training.global_batch_size,
            model.num_layers,
            model.hidden_size,
            model.seq_length,
        )

    assert not {run(row) for row in external} & {run(row) for row in [*builtin_measurements(), *torchtitan]}


def test_every_external_held_out_run_fits_its_gpu_under_the_memory_model() -> None:
    # each ran, so its predicted peak (own kernels) stays under 95% of its GPU's memory, the bound on every plan
    for entry in json.loads(EXTERNAL.read_text())["files"]:
        for row in parse_measurements(entry):
            memory = estimator(row).hardware.memory_bytes
            assert predict(row).peak_memory_bytes <= 0.95 * memory, row.key  # type: ignore[operator]


def test_a_layout_with_model_parallelism_takes_the_frameworks_that_publish_such_layouts() -> None:
    # MosaicML's runs are data parallel only and torchtitan's DDP refused a second mesh dimension: every
    # published replicated-weight layout with model parallelism is Megatron's or NeMo's (fused), MosaicML's eager
    # ZeRO-2 runs vote for data-parallel-only layouts only
    fitted = fitting_measurements()
    shares = unknown_kernels_shares(fitted)
    assert shares["replicated+model-parallel"] == {"eager": 0.0, "compiled": 0.0, "fused": 1.0}
    assert shares["replicated"]["eager"] > 0  # the sharding class still counts MosaicML's ZeRO-2 runs
    assert row_kernels_class(ROWS["torchtitan-8b-8-fsdp"]) == "full"
    assert row_kernels_class(ROWS["torchtitan-405b-512-fsdp4-cp2"]) == "full+model-parallel"
    # NeMo 24.07's Llama 3 8B, FP8, TP 1 × CP 2 × distributed optimizer on 8 H100s, recomputation left to the
    # planner: with kernels not said it is the fused run, no recomputation forced by eager PyTorch's memory (main
    # had chosen selective and predicted it 20% slower than the fused figure)
    row = ROWS["nemo2407-llama3-8b-8-cp2"]
    search = {"time_limit_s": 10, "top": 1, "pipeline_parallel": [1], "tensor_parallel": [1], "micro_batch_size": [1]}
    search.update(context_parallel=[2], data_parallel_size=[4], sharding=["optimizer"])

    def predicted(**kernels: str) -> Any:
        training = {"global_batch_size": row.training.global_batch_size, "precision": "fp8", **kernels}
        request = {"model": row.model.model_dump(exclude_none=True), "cluster": {"accelerator": "H100-SXM"}}
        answer = plan(PlanRequest.model_validate({**request, "training": training, "search": search})).answer
        return answer.plans[0], answer.notes

    (unsaid, notes), (fused, _) = predicted(), predicted(kernels="fused")
    assert unsaid.activation_recomputation == fused.activation_recomputation == "none"
    assert unsaid.tokens_per_s_per_gpu == pytest.approx(fused.tokens_per_s_per_gpu, rel=1e-6)
    assert any("replicated weights with model parallelism (fused 100%)" in note for note in notes)


def test_kernels_not_said_plan_the_nemo_70b_fp8_layout_within_the_gpu_and_say_how_to_launch_it() -> None:
    # NeMo 25.02's Llama 3.1 70B FP8 on 512 H100s (TP 4 x PP 8 x VP 5, ZeRO-1, no recomputation) ran: the plan
    # request pinned to it, framework not said, was refused at 82.26 GiB (every mode's largest memory) and is now
    # planned as the frameworks that run such a layout size it (Megatron-Core, fused), under 95% of the GPU; said
    # eager it is still refused (memory limits hold), and the plan says its torchtitan hand-off holds more
    pins = {
        "tensor_parallel": [4],
        "pipeline_parallel": [8],
        "stages_per_rank": [5],
        "data_parallel_size": [16],
        "sharding": ["optimizer"],
        "micro_batch_size": [1],
        "activation_recomputation": ["none"],
        "method": ["interleaved-1f1b"],
        "precision": ["fp8"],
    }
    request = json.loads((EXTERNAL.parent / "plan_nemo_llama31_70b_fp8.json").read_text())
    assert all(request["search"][name] == values for name, values in pins.items())
    answer = plan(PlanRequest.model_validate(request)).answer
    memory = CATALOGUE["H100-SXM"].memory_bytes
    assert answer.plans and answer.plans[0].peak_memory_bytes <= 0.95 * memory
    assert any("pipesched launch --target megatron" in note for note in answer.notes)
    request["training"]["kernels"] = "eager"
    with pytest.raises(ValidationError, match="no configuration fits"):
        plan(PlanRequest.model_validate(request))


def test_the_70b_fp8_layouts_time_tie_goes_to_the_stage_with_the_fewest_microbatches_in_flight() -> None:
    # Llama 3.1 70B FP8 on TP 4 x PP 8 x VP 5 (Megatron Bridge, fused): the LM head in bf16 makes the last of the
    # 40 stages give a layer up and the 38 middle stages tie to the bit. The lowest-index tie-break put the layer
    # on stage 1 (rank 1's first chunk, the one interleaved 1F1B keeps the most microbatches of); the latest
    # stage takes it now: a lower peak, the slowest stage as fast
    row = ROWS["mbridge2509-llama3-70b-64-h100"]
    assert row.layers_per_stage is None  # the run's split is not stated: pipesched balances it
    earliest = [2, 3] + [2] * 37 + [1]  # the split the lowest-index tie-break gave
    pinned = row.model_copy(update={"layout": row.layout.model_copy(update={"pipeline_split": earliest})})
    balanced = build_problem(estimator(row), configuration(row), enforce_memory=False)
    before = build_problem(estimator(pinned), configuration(pinned), enforce_memory=False)
    assert balanced.model is not None and before.model is not None
    split = balanced.model.layers_per_stage
    assert split is not None and split != earliest and sorted(split) == sorted(earliest)

    def slowest_ms(problem: Any) -> float:
        costs = problem.costs
        passes = (costs.forward, costs.backward_input, costs.backward_weight)
        return max(sum(values) for values in zip(*(problem.stage_values(p) for p in passes), strict=True))

    assert slowest_ms(balanced) <= slowest_ms(before) * (1 + TIE_TOLERANCE) + 3e-6  # costs are rounded to 1e-6 ms
    peak, peak_before = predict(row).peak_memory_bytes, predict(pinned).peak_memory_bytes
    assert peak is not None and peak_before is not None and peak < peak_before - 4 * GIB  # 70.2 -> 65.5 GiB


def test_deepseek_v3s_time_tie_on_4_ranks_by_8_chunks_goes_where_the_schedule_peaks_lowest() -> None:
    # NeMo AutoModel's DeepSeek-V3 on PP 4 × VP 8 (61 layers, 32 stages): 27 of the 30 middle stages take a
    # second layer. The model-order rule left ranks 1–3 short and rank 0 with 17 layers (86.3 GiB); the lowest
    # index had left one stage short per rank (81.7 GiB); the schedule's judge 79.3 GiB, the least of all 4,060
    # tied splits (every one simulated once, bench/results/partition_tie.md)
    row = ROWS["automodel-h100-deepseek-v3-256"]
    problem = build_problem(estimator(row), configuration(row), enforce_memory=False)
    assert problem.model is not None and problem.model.layers_per_stage is not None
    split = problem.model.layers_per_stage
    assert len(split) == 32 and split[0] == 3 and split[-1] == 1 and sorted(split[1:-1]) == [1] * 3 + [2] * 27
    peak = predict(row).peak_memory_bytes
    assert peak is not None and peak < 80 * GIB


def test_mosaicmls_64_wide_heads_at_long_sequences_are_predicted_as_closely_as_the_128_wide() -> None:
    # MPT 125M and 350M (heads of 64) from 16k tokens on, where attention is most of the step: before the
    # exponentials' share of a score was modelled they ran 9-17% slower than predicted (attention fitted on 128)
    rows = [
        row
        for row in fitting_measurements()
        if row.source == "mpt_llm_foundry" and row.model.head_size == 64 and row.model.seq_length >= 16384
    ]
    assert len(rows) >= 8
    errors = [predict(row).tokens_per_s_per_gpu / row.measured.tokens_per_s_per_gpu - 1 for row in rows]  # type: ignore[operator]
    assert max(abs(e) for e in errors) <= 0.12
    assert abs(statistics.median(errors)) <= 0.05


def test_prefetching_after_the_backward_exposes_every_units_gather() -> None:
    """FSDP1's BACKWARD_POST gathers unit i − 1 after unit i's gradients: the backward waits for all of G, its
    compute overlaps only the reductions; BACKWARD_PRE hides the gather behind a long enough backward."""
    fields = dict(forward_ms=100.0, unit_fraction=0.025, num_microbatches=1, per_microbatch=True, slowdown=0.1)
    pre = stage_overlap(gather_ms=30.0, reduce_ms=40.0, backward_ms=200.0, **fields)
    post = stage_overlap(gather_ms=30.0, reduce_ms=40.0, backward_ms=200.0, prefetch_after_backward=True, **fields)
    assert post.forward_extra_ms == pre.forward_extra_ms
    assert post.backward_input_extra_ms == pytest.approx(30.0 + 0.1 * 40.0)
    assert pre.backward_input_extra_ms == pytest.approx(0.025 * 30.0 + 0.1 * 70.0)
    # with the weights gathered once (pipelines, SHARD_GRAD_OP) the backward gathers nothing: no change
    once = dict(fields, per_microbatch=False)
    assert stage_overlap(gather_ms=30.0, reduce_ms=40.0, backward_ms=200.0, prefetch_after_backward=True, **once) == (
        stage_overlap(gather_ms=30.0, reduce_ms=40.0, backward_ms=200.0, **once)
    )


def test_composers_backward_post_prefetch_slows_mosaicmls_2023_rows_and_not_a_plan() -> None:
    """MosaicML's 2023 tables ran Composer's default BACKWARD_POST (the row's software.fsdp_backward_prefetch):
    its 13B on H100s at one microbatch of 2 without recomputation, the runs where the gathers weigh most beside the
    compute, lose more than 5% to it at every GPU count, and on 64 GPUs come within 15% only with it; the January
    2024 large-scale rows stated BACKWARD_PRE; a plan (kernels "unknown", the framework not said) keeps the
    planner's BACKWARD_PRE."""

    def as_pre(row: Measurement) -> Measurement:
        software = row.software.model_copy(update={"fsdp_backward_prefetch": "BACKWARD_PRE"})
        return row.model_copy(update={"software": software})

    for gpus in (8, 16, 32, 64):
        row = ROWS[f"mpt-h100-80gb-bf16-13b-s2048-g{gpus}-b2x1"]
        assert row.software.fsdp_backward_prefetch == "BACKWARD_POST"
        post, pre = predict(row).tokens_per_s_per_gpu, predict(as_pre(row)).tokens_per_s_per_gpu
        assert post is not None and pre is not None
        assert post < 0.95 * pre
    published = row.measured.tokens_per_s_per_gpu
    assert abs(post / published - 1) <= 0.15 < pre / published - 1
    as_plan = predict(row, kernels="unknown").tokens_per_s_per_gpu
    assert as_plan == predict(as_pre(row), kernels="unknown").tokens_per_s_per_gpu
    large_scale = [r for r in fitting_measurements() if r.source == "mpt_llm_foundry" and "large-scale" in r.id]
    assert large_scale and {r.software.fsdp_backward_prefetch for r in large_scale} == {"BACKWARD_PRE"}
    assert builtin_catalogue().software.fsdp_backward_prefetch == "BACKWARD_PRE"


def test_reducing_once_a_step_takes_m_minus_one_reductions_out_of_the_backward() -> None:
    """FSDP with no_sync / set_requires_gradient_sync(False) on all but the last microbatch (fsdp_gradient_sync
    "last_microbatch"): m microbatches still gather the weights each, but only the last one's backward reduces,
    so of the m reductions' stall and slowdown per microbatch only one is left; the once-a-step actions and the
    forward are unchanged, and one microbatch is the same either way."""
    m, u, slowdown, reduce_ms = 8, 0.025, 0.1, 40.0
    fields = dict(gather_ms=30.0, forward_ms=100.0, backward_ms=200.0, unit_fraction=u, slowdown=slowdown)
    every = stage_overlap(reduce_ms=reduce_ms, num_microbatches=m, per_microbatch=True, **fields)
    last = stage_overlap(
        reduce_ms=reduce_ms, num_microbatches=m, per_microbatch=True, reduce_every_microbatch=False, **fields
    )
    assert (last.unshard_ms, last.reduce_grad_ms, last.forward_extra_ms) == (
        every.unshard_ms,
        every.reduce_grad_ms,
        every.forward_extra_ms,
    )
    # the backward (200 ms) hides the gather and reduction: each microbatch pays slowdown · R and waits for its
    # last unit's reduction (u · R, all but the last); once a step, one microbatch in m pays slowdown · R
    step_every = m * every.backward_input_extra_ms + every.reduce_grad_ms
    step_last = m * last.backward_input_extra_ms + last.reduce_grad_ms
    assert step_every - step_last == pytest.approx((m - 1) * (slowdown + u) * reduce_ms)
    assert last.backward_input_extra_ms == pytest.approx(u * 30.0 + slowdown * 30.0 + slowdown * reduce_ms / m)
    one = dict(fields, reduce_ms=reduce_ms, num_microbatches=1, per_microbatch=True)
    assert stage_overlap(**one) == stage_overlap(**one, reduce_every_microbatch=False)
    # a pipeline stage reduces once a step whatever the framework does between microbatches
    once = dict(fields, reduce_ms=reduce_ms, num_microbatches=m, per_microbatch=False)
    assert stage_overlap(**once) == stage_overlap(**once, reduce_every_microbatch=False)


def test_a_fully_sharded_pipeline_stage_reduces_all_of_its_gradient_after_its_last_backward() -> None:
    """PyTorch's pipelining runs every backward of an FSDP stage without gradient sync and calls FSDP's
    post_backward once the last has returned: nothing of the reduction hides unit by unit behind that backward,
    REDUCE_GRAD is all of it (the communication stream still overlaps the rank's other stages)."""
    fields = dict(gather_ms=30.0, reduce_ms=400.0, forward_ms=100.0, backward_ms=300.0, unit_fraction=1 / 16)
    once = dict(fields, num_microbatches=8, per_microbatch=False, slowdown=0.1)
    unit_by_unit = stage_overlap(**once)
    after = stage_overlap(**once, reduce_after_backward=True)
    assert unit_by_unit.reduce_grad_ms == pytest.approx(400.0 / 16 + 15 / 16 * 100.0)
    assert after.reduce_grad_ms == 400.0
    assert (after.unshard_ms, after.forward_extra_ms) == (unit_by_unit.unshard_ms, unit_by_unit.forward_extra_ms)
    # resharding after forward (FSDP without a pipeline) reduces unit by unit inside the backward: no change
    every = dict(fields, num_microbatches=1, per_microbatch=True, slowdown=0.1)
    assert stage_overlap(**every, reduce_after_backward=True) == stage_overlap(**every)

    # torchtitan's 405B on PP 8 x TP 8 x FSDP 8: a middle stage's 16 layers reduce 16 x 3.19e9 / 8 parameters in
    # fp32 over 8 nodes, at least 447 ms on a 50 GB/s NIC; unit by unit 1/16 of it had been left exposed
    row = ROWS["torchtitan-405b-512-3d-1f1b"]
    problem = build_problem(estimator(row), configuration(row), enforce_memory=False)
    assert problem.model is not None and problem.model.layers_per_stage is not None
    parameters = 16 * layer_parameters(ModelConfig.model_validate(row.model.model_dump(exclude_none=True))) / 8
    least_ms = 1e3 * parameters * 4 * 7 / 8 / 50e9
    assert least_ms > 440
    middle = [i for i, count in enumerate(problem.model.layers_per_stage) if count == 16]
    assert middle and all(problem.stage_values(problem.costs.reduce_grad)[i] >= least_ms for i in middle)
    # the same pipeline over replicated weights (Megatron's distributed optimizer) still overlaps its buckets
    layout = row.layout.model_copy(update={"sharding": "optimizer"})
    replicated = build_problem(
        estimator(row), configuration(row.model_copy(update={"layout": layout})), enforce_memory=False
    )
    assert all(problem.stage_values(replicated.costs.reduce_grad)[i] < least_ms / 4 for i in middle)


def test_nemo_automodels_once_a_step_gradient_sync_speeds_its_run_and_holds_the_whole_gradient() -> None:
    """NeMo AutoModel's trainer sets FSDP2's set_requires_gradient_sync(is_last_microbatch) (the row's
    software.fsdp_gradient_sync): GPT-OSS 120B on 64 H100s, 4 microbatches, predicted faster than with PyTorch's
    default every-microbatch reduction, and with a higher peak (the whole unsharded gradient held to the step's
    end); a plan (kernels "unknown") and MosaicML's rows (Composer applies no_sync to DDP only) keep the default."""
    row = ROWS["automodel-h100-gpt-oss-120b-64"]
    assert row.software.fsdp_gradient_sync == "last_microbatch" and row.training.num_microbatches > 1
    software = row.software.model_copy(update={"fsdp_gradient_sync": "every_microbatch"})
    as_every = row.model_copy(update={"software": software})
    once, every = predict(row), predict(as_every)
    assert once.step_time_ms is not None and every.step_time_ms is not None
    assert once.step_time_ms < every.step_time_ms
    assert once.peak_memory_bytes is not None and every.peak_memory_bytes is not None
    assert once.peak_memory_bytes > every.peak_memory_bytes
    assert predict(row, kernels="unknown") == predict(as_every, kernels="unknown")
    assert builtin_catalogue().software.fsdp_gradient_sync == "every_microbatch"
    mosaic = [r for r in fitting_measurements() if r.source == "mpt_llm_foundry"]
    assert mosaic and {r.software.fsdp_gradient_sync for r in mosaic} == {"every_microbatch"}


def test_the_planners_bound_stays_below_the_step_when_fsdp_reduces_once_a_step() -> None:
    """The search's cheap bound (prune.Estimator) charges one reduction a step under "last_microbatch": never more
    exposed collective time than with a reduction every microbatch, and still below the simulated step."""
    row = ROWS["automodel-h100-gpt-oss-120b-64"]
    as_every = row.model_copy(
        update={"software": row.software.model_copy(update={"fsdp_gradient_sync": "every_microbatch"})}
    )

    def estimate(measurement: Measurement) -> Estimate:
        with run_software(measurement):
            return estimator(measurement).estimate(configuration(measurement))

    once, every = estimate(row), estimate(as_every)
    assert 0 < once.data_parallel_exposed_ms <= every.data_parallel_exposed_ms
    step = predict(row).step_time_ms
    assert step is not None and once.bound_ms <= step


GPT_OSS_H100 = ROWS["mbridge260401-gpt-oss-120b-64-h100-tp1pp4cp1vp1ep8-gbs1280-mbs1"]


def test_a_published_runs_own_pipeline_split_is_timed_as_it_ran() -> None:
    # Megatron splits GPT-OSS's 36 layers evenly over PP 4: the last stage also runs the 201k-vocabulary head
    assert GPT_OSS_H100.layers_per_stage == [9, 9, 9, 9]
    balanced = GPT_OSS_H100.model_copy(
        update={"layout": GPT_OSS_H100.layout.model_copy(update={"pipeline_split": "balanced"})}
    )
    assert balanced.layers_per_stage is None
    as_ran, own = predict(GPT_OSS_H100).tokens_per_s_per_gpu, predict(balanced).tokens_per_s_per_gpu
    assert as_ran is not None and own is not None and as_ran < 0.95 * own


def test_a_pipeline_split_that_does_not_cover_the_layers_is_refused_with_the_fix() -> None:
    row = GPT_OSS_H100.model_dump(mode="json", exclude={"source"})
    row["layout"]["pipeline_split"] = [10, 9, 9, 9]
    with pytest.raises(ValidationError, match="pipeline_split"):
        parse_measurements([row])
    row["layout"]["pipeline_split"] = "embedding_and_loss"  # 38 counted layers do not split over 4 stages
    with pytest.raises(ValidationError, match="do not split evenly"):
        parse_measurements([row])


def test_a_request_states_its_gradient_reduction_dtype_and_bf16_halves_the_traffic() -> None:
    def best(dtype: str) -> Any:
        request = plan_request(
            "mixtral-8x7b",
            nodes=8,
            batch=256,
            training={"precision": "fp8", "kernels": "fused", "gradient_reduce_dtype": dtype},
            cluster={"accelerator": "B200"},
            search={
                "pipeline_parallel": [1],
                "tensor_parallel": [1],
                "expert_parallel": [8],
                "micro_batch_size": [2],
                "sharding": ["optimizer"],
                "activation_recomputation": ["none"],
            },
        )
        return plan(request).answer.plans[0]

    fp32, bf16 = best("fp32"), best("bf16")
    assert (fp32.data_parallel.reduce_dtype, bf16.data_parallel.reduce_dtype) == ("fp32", "bf16")
    assert bf16.tokens_per_s_per_gpu > 1.1 * fp32.tokens_per_s_per_gpu  # the experts' reduction dominates here
    # Megatron-Core keeps its gradient buffer in the reduction's dtype: 2 bytes fewer per parameter a GPU holds
    # (the experts' 5.6B and 1/8 of the rest, about 11.5 GiB)
    assert fp32.peak_memory_bytes - bf16.peak_memory_bytes > 10 * 2**30


def test_the_steps_measured_on_an_h200_are_held_out_and_predicted_within_20_percent() -> None:
    """The same six cases measured on an H200 (bench/results/device/h200/, torch 2.11, cuDNN's attention), a GPU
    whose profile no row of ours was fitted on: each within 20% of its measured tokens/s, the median within 12%
    (issue 24's bar for layouts the calibration was not given), and faster than the same row on the H100's profile
    (the H200's bandwidth, the same matrix peak)."""
    rows = parse_measurements(json.loads(OWN_H200.read_text()))
    assert len(rows) == 6 and {row.accelerator for row in rows} == {"H200"}
    errors = []
    for row in rows:
        predicted = predict(row).tokens_per_s_per_gpu
        assert predicted is not None
        errors.append(abs(predicted / row.measured.tokens_per_s_per_gpu - 1))
        assert errors[-1] < 0.20, row.id
        on_h100 = predict(row.model_copy(update={"accelerator": "H100-SXM"})).tokens_per_s_per_gpu
        assert on_h100 is not None and on_h100 < predicted, row.id
    assert sorted(errors)[len(errors) // 2] < 0.12
