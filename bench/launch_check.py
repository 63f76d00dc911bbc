"""The launch check: `pipesched launch` of the top plans of 22 requests' answers, torchtitan.args read by torchtitan.

A new user's plan requests (every preset family on 8 to 16,384 GPUs, and six that search context parallelism,
expert tensor parallelism and FP8), planned with ``pipesched plan --top 3``; then for each of the top plans
``pipesched launch --target torchtitan|megatron --scheduler slurm``. Each written ``torchtitan.args`` is parsed by
torchtitan 0.3.0's own ``ConfigManager`` (the written config module on ``sys.path``), its degrees compared with the
plan's and with ``ParallelDims`` (world size = the plan's GPUs; the expert mesh ``dp_shard·cp·tp/ep`` a whole number
≥ 1), the model config takes the run's options as torchtitan's trainer gives them (``update_from_config``: tensor
parallelism dividing the heads, ``seq_len`` within the RoPE's), and the model its ``model_spec`` builds is built on
the meta device (no memory): its parameters against the answer's ``parameters`` (within 3%). Each
``megatron.args`` is read for its MoE arguments.

Run (under the team's heavy lock; planning takes ~10 s a request)::

    python -m bench.launch_check plan DIR      # writes DIR/<case>.json and DIR/<case>.plans.json
    python -m bench.launch_check check DIR [LABEL] [TOP]   # one line a launch, then the summary line
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

#: Largest relative difference between torchtitan's parameter count and the answer's.
PARAMETER_TOLERANCE = 0.03
PLAN_TIME_LIMIT_S = 10


def _case(name: str, model: dict[str, Any], accelerator: str, nodes: int, training: dict[str, Any], **search: Any):
    cluster = {"accelerator": accelerator, "num_nodes": nodes, "gpus_per_node": 8}
    request = {"model": model, "cluster": cluster, "training": training}
    return name, {**request, "search": {"time_limit_s": PLAN_TIME_LIMIT_S, **search}}


def cases() -> list[tuple[str, dict[str, Any]]]:
    """The 22 requests of the new-user audit (``bench/results/new_user_audit.md``), by file stem."""
    presets = [
        ("llama3.1-8b", "H100-SXM", 1, 32),
        ("llama3.1-8b", "B200", 8, 256),
        ("llama3.1-70b", "H100-SXM", 8, 128),
        ("llama3.1-70b", "H200", 128, 1024),
        ("llama3.1-405b", "H100-SXM", 128, 1024),
        ("llama3.1-405b", "H100-SXM", 2048, 2048),
        ("deepseek-v3", "H100-SXM", 128, 4096),
        ("deepseek-v3", "B200", 2048, 8192),
        ("mixtral-8x7b", "H100-SXM", 1, 32),
        ("mixtral-8x7b", "H200", 8, 256),
        ("qwen3-30b-a3b", "H100-SXM", 1, 64),
        ("qwen3-30b-a3b", "B200", 8, 512),
        ("gpt-oss-120b", "H100-SXM", 8, 256),
        ("gpt-oss-20b", "H200", 1, 64),
        ("mixtral-8x22b", "H100-SXM", 128, 1024),
        ("qwen3-235b-a22b", "H100-SXM", 128, 2048),
    ]
    found = [
        _case(
            f"{preset}-{accelerator}-{nodes * 8}", {"preset": preset}, accelerator, nodes, {"global_batch_size": batch}
        )
        for preset, accelerator, nodes, batch in presets
    ]
    mixtral, qwen, llama_8b = {"preset": "mixtral-8x7b"}, {"preset": "qwen3-30b-a3b"}, {"preset": "llama3.1-8b"}
    long_70b, long_405b = (
        {"preset": "llama3.1-70b", "seq_length": 131072},
        {"preset": "llama3.1-405b", "seq_length": 131072},
    )
    return [
        *found,
        _case(
            "mixtral-ep-et-fp8-64",
            mixtral,
            "H100-SXM",
            8,
            {"global_batch_size": 256},
            expert_parallel=[1, 2, 4, 8],
            expert_tensor_parallel=[1, 2, 4],
            precision=["bf16", "fp8"],
        ),
        _case(
            "qwen3-ep-et-1024",
            qwen,
            "H200",
            128,
            {"global_batch_size": 2048},
            expert_parallel=[8, 16, 32],
            expert_tensor_parallel=[1, 2],
        ),
        _case(
            "8b-131k-cp-64",
            {**llama_8b, "seq_length": 131072},
            "H100-SXM",
            8,
            {"global_batch_size": 16},
            context_parallel=[1, 2, 4, 8, 16],
        ),
        _case("405b-131k-16384", long_405b, "H100-SXM", 2048, {"global_batch_tokens": 16 * 1024 * 1024}),
        _case("70b-131k-fp8-1024", long_70b, "B200", 128, {"global_batch_size": 128}, precision=["bf16", "fp8"]),
        _case(
            "dsv3-fp8-ep-1024",
            {"preset": "deepseek-v3"},
            "H200",
            128,
            {"global_batch_size": 4096},
            precision=["fp8"],
            expert_parallel=[32, 64],
            expert_tensor_parallel=[1],
        ),
    ]


def plan_all(pipesched: str, folder: Path) -> None:
    """``pipesched plan --top 3`` of every case into ``folder``; one JSON line a case (exit code, wall)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, request in cases():
        (folder / f"{name}.json").write_text(json.dumps(request))
        done = subprocess.run(
            [pipesched, "plan", f"{name}.json", "--top", "3", "-o", f"{name}.plans.json"],
            capture_output=True,
            text=True,
            cwd=folder,
        )
        print(json.dumps({"case": name, "rc": done.returncode, "stderr": done.stderr[-200:]}), flush=True)


def describe(plan: dict[str, Any]) -> str:
    """A plan's layout in one bracket: degrees, sharding, placement, method, precision, recomputation."""
    data = plan["data_parallel"]
    return (
        f"pp{plan['pipeline_parallel']} tp{plan['tensor_parallel']} cp{plan['context_parallel']} "
        f"ep{plan['expert_parallel']} et{plan.get('expert_tensor_parallel')} dp{data['size']}/{data['sharding']} "
        f"spr{plan['stages_per_rank']} {plan['placement']} {plan['method']} {plan['precision']} "
        f"{plan['activation_recomputation']}"
    )


def meta_parameters(config: Any) -> int:
    """Parameters of the model torchtitan builds from a parsed config, on the meta device (as its trainer)."""
    import torch

    with torch.device("meta"):
        model = config.model_spec.model.build()
    return sum(parameter.numel() for parameter in model.parameters())


def read_torchtitan(folder: Path, plan: dict[str, Any], gpus: int, parameters: float | None) -> str:
    """``OK``/``MISMATCH`` and what torchtitan read from ``folder/torchtitan.args``, or the error it raised."""
    from torchtitan.config.manager import ConfigManager
    from torchtitan.distributed.parallel_dims import ParallelDims

    argv = [item for item in (folder / "torchtitan.args").read_text().splitlines() if item]
    sys.path.insert(0, str(folder))
    sys.modules.pop("pipesched_torchtitan", None)
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            config = ConfigManager().parse_args(argv)
            config.model_spec.model.update_from_config(config=config)  # the trainer's checks (heads, RoPE length)
            built = meta_parameters(config)
        par = config.parallelism
        dims = ParallelDims.from_config(par, gpus)
        expert_mesh = dims.dp_shard * dims.cp * dims.tp / dims.ep
        got = {
            "pp": par.pipeline_parallel_degree,
            "tp": par.tensor_parallel_degree,
            "cp": par.context_parallel_degree,
            "ep": par.expert_parallel_degree,
            "config": f"{config.model_spec.name} {config.model_spec.flavor}",
            "efsdp": expert_mesh,
            "sched": par.pipeline_parallel_schedule,
            "compile": config.compile.enable and "model" in config.compile.components,
            "params": built,
        }
        planned = (
            plan["pipeline_parallel"],
            plan["tensor_parallel"],
            plan["context_parallel"],
            plan["expert_parallel"],
        )
        near = parameters is not None and abs(built / parameters - 1) <= PARAMETER_TOLERANCE
        ok = (got["pp"], got["tp"], got["cp"], got["ep"]) == planned and expert_mesh == int(expert_mesh) >= 1 and near
        return ("OK " if ok else "MISMATCH ") + json.dumps(got)
    except SystemExit as error:
        return f"ConfigManager SystemExit {error.code}: " + " ".join(errors.getvalue().split())[:300]
    except Exception as error:
        return f"ERROR {type(error).__name__}: {' '.join(str(error).split())[:200]}"
    finally:
        sys.path.remove(str(folder))


def check_all(pipesched: str, folder: Path, label: str, top: int = 3) -> list[str]:
    """Launch the top ``top`` plans of every answer in ``folder`` for both targets; one printed line a launch."""
    lines = []
    for answer_path in sorted(folder.glob("*.plans.json")):
        answer = json.loads(answer_path.read_text())
        cluster = answer["request"]["cluster"]
        gpus = cluster["num_nodes"] * cluster.get("gpus_per_node", 8)
        for number, plan in enumerate(answer["plans"][:top], start=1):
            for target in ("torchtitan", "megatron"):
                out = folder / f"launch-{label}" / f"{answer_path.stem}-{number}-{target}"
                command = [pipesched, "launch", str(answer_path), "--plan", str(number), "--target", target]
                done = subprocess.run(
                    [*command, "--scheduler", "slurm", "-o", str(out)], capture_output=True, text=True
                )
                status = f"rc={done.returncode}"
                if done.returncode != 0:
                    status += " " + " ".join(done.stderr.split())[:200]
                elif target == "torchtitan":
                    status += " " + read_torchtitan(out, plan, gpus, answer.get("parameters"))
                else:
                    status += " " + " ".join((out / "megatron.args").read_text().split())[:200]
                line = f"{answer_path.stem} #{number} [{describe(plan)}] {target}: {status}"
                print(line, flush=True)
                lines.append(line)
    return lines


def summary(label: str, lines: list[str]) -> str:
    """One line: torchtitan launches parsed with the plan's degrees and the model's size, refused, failing."""
    torchtitan = [line for line in lines if "] torchtitan:" in line]
    ok = sum(" OK " in line for line in torchtitan)
    refused = Counter(line.split("] ")[0].split(" #")[0] for line in torchtitan if "rc=2" in line)
    failing = Counter(
        line.split("rc=0 ")[1].split(":")[0] for line in torchtitan if "rc=0" in line and " OK " not in line
    )
    return (
        f"{label}: torchtitan {len(torchtitan)} launches: parsed, degrees, expert mesh and model size OK {ok}, "
        f"refused by pipesched (exit 2) {sum(refused.values())} {dict(refused)}, written but failing "
        f"{sum(failing.values())} {dict(failing)}"
    )


def main() -> None:
    pipesched = str(Path(sys.executable).with_name("pipesched"))
    command, folder = sys.argv[1], Path(sys.argv[2])
    if command == "plan":
        plan_all(pipesched, folder)
        return
    label = sys.argv[3] if len(sys.argv) > 3 else "check"
    lines = check_all(pipesched, folder, label, int(sys.argv[4]) if len(sys.argv) > 4 else 3)
    print(summary(label, lines))


if __name__ == "__main__":
    main()
