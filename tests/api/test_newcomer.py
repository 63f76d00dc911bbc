"""A newcomer's first hour: every mistake answers with what to do, exit 2, never a traceback."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipesched.api.settings import Settings
from tests.api.test_api_served import ServedApi
from tests.conftest import REPO, data_parallel_problem

PROBLEM = {
    "pipeline": {"num_ranks": 4, "num_microbatches": 8},
    "costs": {"forward": 1.0, "backward_input": 1.0, "backward_weight": 1.0, "p2p": 0.1},
    "memory": {"activation": 100, "retained_for_weight": 40, "limit": 400},
}
CONSOLE_SCRIPT = Path(sys.executable).with_name("pipesched")


def pipesched(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The installed console script as a user types it (no PYTHONPATH, so the cwd is not on sys.path)."""
    if not CONSOLE_SCRIPT.exists():
        pytest.skip(f"no console script at {CONSOLE_SCRIPT}: install with pip install -e .")
    return subprocess.run(
        [str(CONSOLE_SCRIPT), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "COLUMNS": "120", "HOME": str(cwd), **(env or {})},
    )


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedApi]:
    """A real `pipesched serve` on a loopback port, as the README's client reaches it."""
    directory = tmp_path_factory.mktemp("newcomer-served")
    server = ServedApi(f"sqlite:///{directory / 'served.sqlite3'}", directory / "server.log")
    yield server
    server.stop()


@pytest.fixture()
def problem_file(tmp_path: Path) -> Path:
    path = tmp_path / "problem.json"
    path.write_text(json.dumps(PROBLEM))
    return path


def test_a_misspelt_method_blames_the_option_and_suggests_names(problem_file: Path) -> None:
    result = pipesched("solve", str(problem_file), "--method", "zb-h3", cwd=problem_file.parent)
    assert result.returncode == 2
    assert "--method 'zb-h3'" in result.stderr and "did you mean zb-h2" in result.stderr
    assert "not a valid problem" not in result.stderr and "Traceback" not in result.stderr


def test_profile_with_a_function_of_the_wrong_signature_exits_2_without_a_traceback(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    result = pipesched("profile", "--model", "json:loads", "--num-ranks", "2", "-o", "p.json", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "json.loads" in result.stderr and "build(num_stages" in result.stderr


@pytest.fixture(scope="module")
def profiled_from_the_current_directory(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """`pipesched profile` of a module:function model in the current directory, 2 ranks, 3 repeats (and the folder):
    one profile (a launch of its own, 10–20 s on 2 cores) that two tests read, each for its own claim."""
    pytest.importorskip("torch")
    folder = tmp_path_factory.mktemp("profile")
    shutil.copy(REPO / "tests" / "runtime" / "user_pipeline_model.py", folder / "mystages.py")
    result = pipesched(
        "profile", "--model", "mystages:tiny_stages", "--num-ranks", "2", "--repeats", "3", "-o", "p.json", cwd=folder
    )
    return result, folder


def test_module_function_models_import_from_the_current_directory(
    profiled_from_the_current_directory: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    result, folder = profiled_from_the_current_directory
    assert result.returncode == 0, result.stderr
    assert json.loads((folder / "p.json").read_text())["pipeline"]["num_ranks"] == 2


def test_serve_help_lists_every_environment_variable(tmp_path: Path) -> None:
    result = pipesched("serve", "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    for name in Settings.model_fields:
        assert f"PIPESCHED_{name.upper()}" in text


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_serve_says_which_database_it_uses(tmp_path: Path) -> None:
    if not CONSOLE_SCRIPT.exists():
        pytest.skip(f"no console script at {CONSOLE_SCRIPT}")
    database = tmp_path / "here.sqlite3"
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "PIPESCHED_DATABASE_URL": f"sqlite:///{database}",
        "PIPESCHED_PORT": str(_free_port()),
        "PIPESCHED_SOLVER_WORKERS": "1",
    }
    process = subprocess.Popen(
        [str(CONSOLE_SCRIPT), "serve"],
        cwd=tmp_path,
        env=env,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert process.stderr is not None
        deadline = time.monotonic() + 60
        lines = []
        while time.monotonic() < deadline:
            line = process.stderr.readline()
            lines.append(line)
            if "database" in line or not line:
                break
        assert any(f"SQLite file {database}" in line for line in lines), lines
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_database_description_resolves_relative_sqlite_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pipesched.api.cli.service import database_description

    monkeypatch.chdir(tmp_path)
    assert database_description("sqlite:///rel.sqlite3") == f"SQLite file {tmp_path / 'rel.sqlite3'}"
    assert "secret" not in database_description("postgresql+psycopg://user:secret@db/pipesched")
    assert os.getcwd() == str(tmp_path)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_run_stopped_from_outside_says_so(tmp_path: Path, signum: signal.Signals) -> None:
    pytest.importorskip("torch")
    if not CONSOLE_SCRIPT.exists():
        pytest.skip(f"no console script at {CONSOLE_SCRIPT}")
    from tests.runtime.user_pipeline_model import SLOW_MARKER

    problem = tmp_path / "problem.json"
    problem.write_text(json.dumps({**PROBLEM, "pipeline": {"num_ranks": 2, "num_microbatches": 8}}))
    schedule = tmp_path / "schedule.json"
    solved = pipesched("solve", str(problem), "--method", "1f1b", "-o", str(schedule), cwd=tmp_path)
    assert solved.returncode == 0, solved.stderr
    shutil.copy(REPO / "tests" / "runtime" / "user_pipeline_model.py", tmp_path / "slowmodel.py")
    process = subprocess.Popen(
        [str(CONSOLE_SCRIPT), "run", str(schedule), "--model", "slowmodel:slow_stages", "--timeout", "120"],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "COLUMNS": "200"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 180
    while not (tmp_path / SLOW_MARKER).exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert (tmp_path / SLOW_MARKER).exists(), "the ranks never started"
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signum, stderr
    assert "interrupted" in stderr and signum.name in stderr, stderr
    assert "rank_failed" not in stderr and "Traceback" not in stderr, stderr


README_62B = {
    "pipeline": {"num_ranks": 8, "num_microbatches": 24},
    "model": {
        "num_layers": 30,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "seq_length": 1024,
        "vocab_size": 50304,
        "micro_batch_size": 3,
        "dtype": "bf16",
    },
    "cluster": {"accelerator": "H100-SXM", "p2p_bandwidth_bytes_per_s": 50e9, "p2p_latency_ms": 0.01},
    "solver": {"method": "1f1b"},
}


def test_the_run_memory_estimate_counts_parameters_and_refuses_what_does_not_fit() -> None:
    from pipesched.optimizer.derive import load_problem
    from pipesched.optimizer.solve import solve
    from pipesched.runtime.memory_check import check_run_memory, gpt_parameters, run_memory_bytes

    pytest.importorskip("torch")
    from pipesched.runtime.models import PRESETS, GPTStage

    # The parameter count matches the modules the runtime builds.
    tiny = PRESETS["gpt-tiny"]
    built = sum(p.numel() for p in GPTStage(tiny, tiny.num_layers, first=True, last=True).parameters())
    assert gpt_parameters(tiny) == built

    schedule = solve(load_problem(README_62B))
    from pipesched.runtime.models import load_model

    config = load_model("problem", schedule.problem).config
    total, parameters, _ = run_memory_bytes(schedule, config)
    assert 6.0e9 < parameters < 7.0e9 and total > 6 * 4 * parameters
    with pytest.raises(ValueError, match=r"only 16 GiB is available: run a smaller model"):
        check_run_memory(schedule, config, "problem", available=16 * 1024**3)
    check_run_memory(schedule, config, "problem", available=2 * total)  # fits: no error


def test_run_refuses_the_readme_62b_model_on_this_machine(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from pipesched.runtime.memory_check import available_memory_bytes

    available = available_memory_bytes()
    if available is None or available > 400 * 1024**3:
        pytest.skip("this machine could hold the 6.2B model")
    problem = tmp_path / "big.json"
    problem.write_text(json.dumps(README_62B))
    solved = pipesched("solve", str(problem), "-o", "schedule.json", cwd=tmp_path)
    assert solved.returncode == 0, solved.stderr
    started = time.monotonic()
    result = pipesched("run", "schedule.json", "--model", "problem", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "is available" in result.stderr and "parameters" in result.stderr and "Traceback" not in result.stderr
    assert time.monotonic() - started < 120  # refused before anything was built


def test_a_fitting_peak_never_reads_over_its_limit() -> None:
    from pipesched.optimizer.units import decimals_against_limit

    mib = 2**20
    # The demo's case: 5.9549 MiB under 5.9551 MiB; two decimals of one unit keep the order.
    assert decimals_against_limit([5.9549 * mib], 5.9551 * mib, mib) == 2
    # Over the limit by less than the last decimal: more decimals until it reads over.
    assert decimals_against_limit([5.9553 * mib], 5.9551 * mib, mib) == 4
    assert decimals_against_limit([1.0], float("inf"), mib) == 2


def test_the_demo_table_prints_peak_and_limit_alike() -> None:
    from rich.console import Console

    from pipesched.api.cli.demo import _plans_table

    # A peak of 5.95521 MiB under a limit of 5.95540 MiB (printed "5.96" against "5.955 MiB" before).
    mib = 2**20
    limit = 5.95540 * mib
    plan = {
        "pipeline_parallel": 2,
        "data_parallel": {"size": 2, "sharding": "full"},
        "placement": "loop",
        "stages_per_rank": 1,
        "num_microbatches": 8,
        "micro_batch_size": 1,
        "activation_recomputation": "none",
        "method": "1f1b",
        "step_time_ms": 10.0,
        "lower_bound_ms": 9.0,
        "tokens_per_s_per_gpu": 1000.0,
        "peak_memory_bytes": 5.95521 * mib,
    }
    answer = {"plans": [plan], "searched": {"enumerated": 1, "pruned_memory": 0, "pruned_bound": 0, "solved": 1}}
    console = Console(record=True, width=200)
    _plans_table(answer, plan, console, limit)
    text = console.export_text()
    limit_shown = float(text.split("limit of ")[1].split()[0])
    peaks_shown = [float(line.split("│")[-2]) for line in text.splitlines() if "1f1b" in line and "│" in line]
    assert peaks_shown and max(peaks_shown) <= limit_shown, text


def test_profile_reports_the_spread_of_every_pass(
    profiled_from_the_current_directory: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    pytest.importorskip("torch")
    from pipesched.runtime.profile import PassSpread, measure_model

    # passes timed on their own: the problem's F, I, W from the spreads (by default they come from the calibration run)
    measured = measure_model(num_ranks=2, num_microbatches=4, repeats=4, warmup=1, pass_source="timed")
    assert {(x.kind, x.stage) for x in measured.spreads} == {(k, s) for k in "FIW" for s in range(2)}
    assert all(len(x.samples) == 4 and x.low <= x.median <= x.high for x in measured.spreads)
    forward = measured.problem.stage_values(measured.problem.costs.forward)  # type: ignore[union-attr]
    # the problem's passes: the medians plus the per-pass overhead fitted on the profile's calibration run
    overhead = measured.calibration.overhead_ms if measured.calibration is not None else 0.0
    assert [round(x.median + overhead, 6) for x in measured.spreads if x.kind == "F"] == pytest.approx(
        forward, abs=2e-6
    )
    # A pass whose samples moved 10× is reported as unsteady, worst first.
    steady = PassSpread("F", 0, (1.0, 1.01, 0.99, 1.0))
    moving = PassSpread("W", 1, (1.0, 10.0, 1.2, 9.0))
    assert steady.relative_iqr < 0.05 and moving.relative_iqr > 1
    assert type(measured)(measured.problem, [steady, moving]).unsteady() == [moving]
    # the command line prints each pass's spread (the profile of a model of the user's, 2 ranks, 3 repeats)
    result, _ = profiled_from_the_current_directory
    assert result.returncode == 0, result.stderr
    assert "min–max over 3 runs" in " ".join(result.stdout.split())


@pytest.mark.slow  # four processes (pp 2 × dp 2), a profile and its calibration run: 15–40 s on 2 shared cores
def test_a_data_parallel_profile_says_how_much_compute_slowed_beside_its_collectives(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    shape = ["--num-ranks", "2", "--stages-per-rank", "2", "--data-parallel", "2", "--repeats", "2"]
    asked = ["--overlap-slowdown", "--communication-slowdown"]
    result = pipesched("profile", *shape, *asked, "-o", "p.json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    costs = json.loads((tmp_path / "p.json").read_text())["costs"]
    written = costs["overlap_slowdown"]
    said = " ".join(result.stdout.split())
    # breadth-first's calibration runs stage 3's reduction beside stage 1's backwards: always some pass beside it
    assert "compute beside communication:" in said and f"costs.overlap_slowdown {written:.3f}" in said
    assert 0 <= written <= 10
    # and the other way: that reduction against the same collective alone, the collectives' costs then their time
    # alone (stage 3's reduce-scatter, the one beside passes, no longer than as the calibration saw it)
    slowed = costs["communication_slowdown"]
    assert "communication beside compute:" in said and f"costs.communication_slowdown {slowed:.3f}" in said
    assert 0 <= slowed <= 10 and len(costs["reduce_grad"]) == 4


def test_the_field_reference_documents_every_model_and_cluster_field() -> None:
    from pipesched.optimizer.configs import ClusterConfig, ModelConfig

    reference = (REPO / "docs" / "FIELDS.md").read_text()
    missing = [
        f"{prefix}.{name}"
        for cls, prefix in ((ModelConfig, "model"), (ClusterConfig, "cluster"))
        for name in cls.model_fields
        if f"{prefix}.{name}" not in reference
    ]
    assert not missing, f"document {missing} in the field table of docs/FIELDS.md"


def test_piped_tables_and_help_keep_whole_cells(problem_file: Path) -> None:
    """`pipesched solve … | cat` and `run --help | cat`: no 80-column cut (`stage_…`, help lines broken)."""
    piped = {"COLUMNS": ""}  # no width given: what a pipe in a plain shell has
    solved = pipesched("solve", problem_file.name, "-o", "out.json", cwd=problem_file.parent, env=piped)
    assert solved.returncode == 0, solved.stderr
    assert "stage_span ms" in solved.stdout and "step_time ms" in solved.stdout and "…" not in solved.stdout
    helped = pipesched("run", "--help", cwd=problem_file.parent, env=piped)
    first = "Execute a schedule with torch.distributed and verify it against a single-process reference."
    assert any(first in line for line in helped.stdout.splitlines()), helped.stdout


def test_check_names_the_reason_once(tmp_path: Path) -> None:
    problem = {**PROBLEM, "pipeline": {"num_ranks": 2, "num_microbatches": 1}}
    (tmp_path / "problem.json").write_text(json.dumps(problem))
    (tmp_path / "deadlock.json").write_text(json.dumps([["0F0", "0I0", "0W0"], ["1I0", "1F0", "1W0"]]))
    checked = pipesched("check", "problem.json", "deadlock.json", cwd=tmp_path)
    assert checked.returncode == 1
    assert "invalid (deadlock): rank" in checked.stderr and "deadlock: deadlock" not in checked.stderr


def test_run_says_whose_predictions_it_prints() -> None:
    from pipesched.api.cli.runs import prediction_note
    from pipesched.optimizer.derive import load_problem

    given = prediction_note(load_problem(PROBLEM), "gpt-tiny")
    assert "the problem's costs and memory as written (measured on no model pipesched knows" in given
    assert "ran --model gpt-tiny" in given
    assert "--model problem" not in given  # a problem without a model cannot be run as its own model
    derived = load_problem(
        {
            "pipeline": {"num_ranks": 8, "num_microbatches": 8},
            "model": {"preset": "llama3.1-8b", "activation_recomputation": "full"},
            "cluster": {"accelerator": "H100-SXM", "gpus_per_node": 8},
        }
    )
    assert "the problem's model (llama3.1-8b" in prediction_note(derived, "gpt-tiny")


def test_the_gantt_legend_fits_the_figure() -> None:
    """Every kind of a data-parallel V schedule, and the later-stage shade: wrapped, never clipped."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from pipesched.api.render.figure import _figure
    from pipesched.optimizer.solve import solve_family

    v_pipeline = {"num_ranks": 2, "num_microbatches": 4, "stages_per_rank": 2, "placement": "v"}
    problem = data_parallel_problem(pipeline=v_pipeline, memory={"activation": 100, "retained_for_weight": 40})
    figure = _figure(solve_family(problem, "zb-v"), None, 100)
    FigureCanvasAgg(figure).draw()
    (legend,) = figure.legends
    box = legend.get_window_extent()
    assert len(legend.get_texts()) == 9  # F, I, W, the four collectives' kinds, the later stage, idle
    assert box.x0 >= 0 and box.x1 <= figure.bbox.width


def test_calibrate_given_a_problem_says_which_file_it_takes(problem_file: Path) -> None:
    # Was "rows: Field required" and one "Extra inputs are not permitted" per problem section.
    result = pipesched("calibrate", str(problem_file), cwd=problem_file.parent)
    assert result.returncode == 2
    assert f"{problem_file} is a problem, not a measurement file" in result.stderr, result.stderr
    assert "optimizer/cost/calibration/README.md" in result.stderr and "Traceback" not in result.stderr


def test_a_microbatch_pin_the_batch_contradicts_is_named_with_fixes_that_work(
    tmp_path: Path, served: ServedApi
) -> None:
    """32 sequences on 8 GPUs with search.num_microbatches [7]: was only 'global batch 32 is not divisible by … (those
    products: 1, 2, 4, 8, 16, 32, …): use e.g. 32, 64, 128': the pin unnamed, the batch offered back as its own fix."""
    request = {
        "model": {"preset": "llama3.1-8b"},
        "cluster": {"accelerator": "H100-SXM", "num_nodes": 1, "gpus_per_node": 8},
        "training": {"global_batch_size": 32},
        "search": {"time_limit_s": 3, "num_microbatches": [7]},
    }
    (tmp_path / "plan.json").write_text(json.dumps(request))
    result = pipesched("plan", "plan.json", "-o", "plans.json", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "search.num_microbatches: search.num_microbatches = [7] admits no configuration with global batch 32 " in (
        result.stderr
    )
    assert "use values among [1, 2, 4, 8, 16, 32], or drop it" in result.stderr, result.stderr
    assert "(those products: 7, 14, 28, 56, " in result.stderr and "use e.g. 28, 35, 42, 56" in result.stderr
    assert "Traceback" not in result.stderr
    answer = served.client.post("/v1/plans", json=request)
    assert answer.status_code == 422, answer.text
    errors = {tuple(error["loc"]): error["msg"] for error in answer.json()["detail"]}
    assert set(errors) == {("body", "training", "global_batch_size"), ("body", "search", "num_microbatches")}
    assert "use e.g. 28, 35, 42, 56" in errors[("body", "training", "global_batch_size")]
    # two pins: only the one whose removal lets the batch through is named (data-parallel 8 cannot split 36)
    request["search"] = {"time_limit_s": 3, "micro_batch_size": [4], "data_parallel_size": [8]}
    request["training"] = {"global_batch_size": 36}
    answer = served.client.post("/v1/plans", json=request)
    assert answer.status_code == 422, answer.text
    named = [tuple(error["loc"]) for error in answer.json()["detail"]]
    assert named == [("body", "training", "global_batch_size"), ("body", "search", "data_parallel_size")]


def test_launching_a_model_of_your_own_for_torchtitan_says_how_on_either_surface(
    tmp_path: Path, served: ServedApi
) -> None:
    """Was "model preset None has no torchtitan 0.3 config function: name one with --torchtitan-module … (e.g.
    --torchtitan-module llama3 --torchtitan-config llama3_debugmodel)": a job that trains torchtitan's debug model,
    and flags the HTTP launch had no parameters for."""
    own = {"num_layers": 8, "hidden_size": 1024, "num_attention_heads": 16, "seq_length": 2048, "vocab_size": 32000}
    request = {
        "model": own,
        "cluster": {"accelerator": "H100-SXM", "num_nodes": 1, "gpus_per_node": 8},
        "training": {"global_batch_size": 32},
        "search": {"time_limit_s": 3, "pipeline_parallel": [2]},
    }
    posted = served.client.post("/v1/plans", json=request)
    assert posted.status_code == 202, posted.text
    deadline = time.monotonic() + 120
    while (answer := served.client.get(f"/v1/plans/{posted.json()['id']}").json())["status"] not in ("done", "failed"):
        assert time.monotonic() < deadline, answer
        time.sleep(0.2)
    assert answer["status"] == "done", answer
    launch = f"/v1/plans/{answer['id']}/launch"
    refused = served.client.get(launch, params={"target": "torchtitan"})
    assert refused.status_code == 422, refused.text
    (error,) = refused.json()["detail"]
    assert error["loc"] == ["query", "torchtitan_module"]
    said = error["msg"]
    assert said.startswith("model of your own (8 layers, hidden 1024, 16 heads, vocabulary 32000) has no config ")
    assert "torchtitan_module and torchtitan_config" in said and "debugmodel" not in said and "None" not in said
    own_config = {"target": "torchtitan", "torchtitan_module": "mymodels", "torchtitan_config": "my_1b"}
    files = served.client.get(launch, params=own_config)
    assert files.status_code == 200, files.text
    assert files.json()["files"]["torchtitan.args"].startswith("--module\nmymodels\n--config\nmy_1b\n")
    half = served.client.get(launch, params={"torchtitan_module": "mymodels"})
    assert half.status_code == 422 and half.json()["detail"][0]["loc"] == ["query", "torchtitan_module"]
    # the command line, on the same answer saved as GET /v1/plans/{id} gave it
    (tmp_path / "plans.json").write_text(json.dumps(answer))
    result = pipesched("launch", "plans.json", "-o", "job", cwd=tmp_path)
    assert result.returncode == 2 and "model of your own (8 layers" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    result = pipesched(
        "launch",
        "plans.json",
        "-o",
        "job",
        "--torchtitan-module",
        "mymodels",
        "--torchtitan-config",
        "my_1b",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "job" / "torchtitan.args").read_text().startswith("--module\nmymodels\n--config\nmy_1b\n")


def test_plan_prints_what_search_explain_found_did_not_fit(tmp_path: Path) -> None:
    """search.explain: true had printed nothing on the terminal; the reasons were only in the -o file's JSON."""
    request = {
        "model": {"preset": "llama3.1-8b"},
        "cluster": {"accelerator": "A100-40GB", "num_nodes": 1, "gpus_per_node": 8},
        "training": {"global_batch_size": 32},
        "search": {"time_limit_s": 3, "explain": True, "pipeline_parallel": [1, 2]},
    }
    (tmp_path / "plan.json").write_text(json.dumps(request))
    result = pipesched("plan", "plan.json", "-o", "plans.json", cwd=tmp_path, env={"COLUMNS": "400"})
    assert result.returncode == 0, result.stderr
    listed = json.loads((tmp_path / "plans.json").read_text())["explain"]
    assert f"did not fit (search.explain: {len(listed)} configurations listed in the answer's explain" in result.stdout
    first = listed[0]
    assert f"{first['configuration']['method']}: {first['reason']}" in result.stdout, result.stdout
    shown = [line for line in result.stdout.splitlines() if line.startswith("  pp ")]
    assert 1 < len(shown) <= 12 and len(set(line.split(",")[0] for line in shown)) == len(shown)


def test_a_run_of_a_profiled_problem_says_whose_passes_it_predicts(
    profiled_from_the_current_directory: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    """profile --model M → solve → run: the run's note had said the predictions were 'the problem's costs and memory
    as given' and compared 'only for a problem profiled from gpt-tiny' (the problem was profiled, from M), and the
    run without --model ran gpt-tiny, not M. The profile now records M (costs.profiled_model) and a run defaults
    to it."""
    profiled, folder = profiled_from_the_current_directory
    assert profiled.returncode == 0, profiled.stderr
    written = json.loads((folder / "p.json").read_text())
    assert written["costs"]["profiled_model"] == "mystages:tiny_stages"
    solved = pipesched("solve", "p.json", "--method", "1f1b", "-o", "s.json", cwd=folder)
    assert solved.returncode == 0, solved.stderr
    ran = pipesched("run", "s.json", cwd=folder)
    assert ran.returncode == 0, ran.stderr
    said = " ".join(ran.stdout.split())
    assert (
        "predicted times and memory are mystages:tiny_stages's, as pipesched profile --model mystages:tiny_stages "
        "measured them (costs.profiled_model); the ranks ran mystages:tiny_stages, so they compare." in said
    ), said
    assert "as given" not in said and "as written" not in said
    other = pipesched("run", "s.json", "--model", "gpt-tiny", cwd=folder)
    assert other.returncode == 0, other.stderr
    assert "the ranks ran --model gpt-tiny, so they do not compare: run --model mystages:tiny_stages" in " ".join(
        other.stdout.split()
    )


def test_plan_given_runs_as_its_profile_says_to_calibrate_them_first(tmp_path: Path) -> None:
    """plan --profile runs.json (calibrate's input, not its output) had answered 'is not a profile' and one line per
    field a profile has; a plan answer given as the profile, a line per top-level field of the answer."""
    request = {
        "model": {"preset": "llama3.1-8b"},
        "cluster": {"accelerator": "H100-SXM", "num_nodes": 1, "profile": "mine"},
        "training": {"global_batch_size": 32},
    }
    (tmp_path / "plan.json").write_text(json.dumps(request))
    (tmp_path / "runs.json").write_text(json.dumps({"rows": [{"id": "mine", "accelerator": "H100-SXM"}]}))
    result = pipesched("plan", "plan.json", "--profile", "runs.json", cwd=tmp_path, env={"COLUMNS": "300"})
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        "error: runs.json is a measurement file, not a profile: make a profile of its runs with `pipesched calibrate "
        "runs.json -o profile.json`, then give that"
    )
    result = pipesched("plan", "plan.json", "--profile", "plan.json", cwd=tmp_path, env={"COLUMNS": "300"})
    assert result.returncode == 2 and "plan.json is a plan request, not a profile" in result.stderr, result.stderr
    assert "Extra inputs" not in result.stderr


def test_a_v_shaped_plan_for_megatron_says_how_to_get_a_loop_one(tmp_path: Path) -> None:
    """Mixtral at 32K tokens on 32 H100s: every top plan V-shaped, and Megatron's refusal said only 'choose a plan
    with placement loop (--plan N)', which none was."""
    request = {
        "model": {
            "num_layers": 8,
            "hidden_size": 1024,
            "num_attention_heads": 16,
            "seq_length": 2048,
            "vocab_size": 32000,
        },
        "cluster": {"accelerator": "H100-SXM", "num_nodes": 1, "gpus_per_node": 8},
        "training": {"global_batch_size": 32},
        "search": {"time_limit_s": 3, "pipeline_parallel": [2], "placement": ["v"], "top": 2},
    }
    (tmp_path / "plan.json").write_text(json.dumps(request))
    planned = pipesched("plan", "plan.json", "-o", "plans.json", cwd=tmp_path)
    assert planned.returncode == 0, planned.stderr
    result = pipesched("launch", "plans.json", "--target", "megatron", "-o", "job", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    said = " ".join(result.stderr.split())
    assert "this plan's placement is 'v'" in said and 'plan again with search.placement ["loop"]' in said, said
    assert "Traceback" not in result.stderr
