"""The job scheduler's file around a plan's argv: ``launch.sh`` (torchrun), ``job.sbatch`` (Slurm), ``job.yaml``
(Kubernetes: a ConfigMap with the plan's files and a JobSet), ``task.yaml`` (SkyPilot).

Every file runs torchrun with one process per GPU on every node. The argv comes from ``torchtitan.args`` or
``megatron.args`` beside it (one argument a line); a relative ``schedule.csv`` in it becomes the CSV's path on
the node. torchtitan's activation-checkpoint subcommand stays the last argument: arguments given to the
script (``./launch.sh --hf-assets-path …``) are put before it.

Sources: torchrun's options (``torch/distributed/run.py``: ``--nnodes``, ``--nproc-per-node``, ``--node-rank``,
``--rdzv-backend c10d``, ``--rdzv-endpoint``); Slurm's ``sbatch``/``srun``; JobSet v1alpha2
(``jobset.x-k8s.io``: replicated jobs, pods named ``<jobset>-<job>-<index>-<pod>`` under the subdomain
``<jobset>``); Indexed Jobs' ``batch.kubernetes.io/job-completion-index`` annotation; SkyPilot's task YAML
(``num_nodes``, ``resources.accelerators``, ``workdir``, ``run`` with ``SKYPILOT_NODE_RANK``,
``SKYPILOT_NODE_IPS``, ``SKYPILOT_NUM_NODES``, ``SKYPILOT_NUM_GPUS_PER_NODE``).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any

import yaml

__all__ = ["SCHEDULER_FILES", "Job", "render_scheduler_file"]

#: The file each scheduler gets.
SCHEDULER_FILES = {"torchrun": "launch.sh", "slurm": "job.sbatch", "kubernetes": "job.yaml", "skypilot": "task.yaml"}

#: Where the ConfigMap with the plan's files is mounted in a Kubernetes pod.
K8S_MOUNT = "/etc/pipesched"
#: torchrun's rendezvous port.
PORT = 29500
#: A Kubernetes ConfigMap holds at most 1 MiB.
CONFIG_MAP_LIMIT_BYTES = 1024 * 1024

#: SkyPilot's accelerator names for the catalogue's.
_SKYPILOT_ACCELERATORS = {"H100-SXM": "H100", "H100-PCIe": "H100", "A100-40GB": "A100", "MI300X": "MI300X"}


class _BlockDumper(yaml.SafeDumper):
    """YAML with multi-line strings (a CSV, a script) as literal blocks, and no anchors."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _represent_str(dumper: yaml.SafeDumper, text: str) -> yaml.Node:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_BlockDumper.add_representer(str, _represent_str)


@dataclass(frozen=True)
class Job:
    """What a scheduler file needs: names, the cluster's shape, the target's argv file and entry point.

    ``files`` are the plan's data files (name → text) a Kubernetes ConfigMap carries; ``entry`` is what
    torchrun runs (``["-m", "torchtitan.train"]`` or ``["pretrain_gpt.py"]``); ``subcommand_last`` keeps the
    argv's last item last (torchtitan's activation-checkpoint subcommand).
    """

    name: str
    summary: str
    num_nodes: int
    gpus_per_node: int
    accelerator: str | None
    args_file: str
    args: list[str]
    entry: list[str]
    subcommand_last: bool
    python_path: bool
    image: str
    files: dict[str, str]


def _read_args(job: Job, folder: str) -> list[str]:
    """Shell lines reading the argv file into ARGS (and LAST), with ``schedule.csv`` made a path in ``folder``."""
    lines = [
        f'mapfile -t ARGS < "{folder}/{job.args_file}"',
        'for i in "${!ARGS[@]}"; do  # relative paths in the args file are relative to its folder',
        f'  if [[ "${{ARGS[$i]}}" == schedule.csv ]]; then ARGS[i]="{folder}/schedule.csv"; fi',
        "done",
    ]
    if job.subcommand_last:
        lines += ['LAST="${ARGS[-1]}"  # torchtitan reads options after this subcommand as its own', "unset 'ARGS[-1]'"]
    if job.python_path:
        lines.append(f'export PYTHONPATH="{folder}${{PYTHONPATH:+:$PYTHONPATH}}"  # the config module written beside')
    return lines


def _entry(job: Job) -> str:
    if job.entry[0] == "-m":
        return " ".join(map(shlex.quote, job.entry))
    return '"${MEGATRON_LM:-.}/' + job.entry[0] + '"'


def _argv_tail(job: Job, passthrough: bool = True) -> str:
    """The argv after the entry point: the args file's, the script's own arguments, the subcommand last."""
    return '"${ARGS[@]}"' + (' "$@"' if passthrough else "") + (' "$LAST"' if job.subcommand_last else "")


def _launch_sh(job: Job) -> str:
    return "\n".join(
        [
            "#!/usr/bin/env bash",
            f"# {job.summary}",
            "# Written by `pipesched launch`. Run it on each of the nodes, all at once:",
            "#   MASTER_ADDR=<the first node's address> ./launch.sh [more options for the trainer]",
            "set -euo pipefail",
            'PLAN_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"',
            *_read_args(job, "$PLAN_DIR"),
            f"exec torchrun --nnodes {job.num_nodes} --nproc-per-node {job.gpus_per_node} \\",
            '  --rdzv-backend c10d --rdzv-id "${RDZV_ID:-' + job.name + '}" \\',
            '  --rdzv-endpoint "${MASTER_ADDR:?set MASTER_ADDR to the first node}:${MASTER_PORT:-'
            + f"{PORT}"
            + '}" \\',
            f"  {_entry(job)} {_argv_tail(job)}",
            "",
        ]
    )


def _job_sbatch(job: Job) -> str:
    return "\n".join(
        [
            "#!/bin/bash",
            f"#SBATCH --job-name={job.name}",
            f"#SBATCH --nodes={job.num_nodes}",
            "#SBATCH --ntasks-per-node=1",
            f"#SBATCH --gpus-per-node={job.gpus_per_node}",
            "#SBATCH --exclusive",
            f"# {job.summary}",
            "# Written by `pipesched launch`. sbatch runs a copy of this script: submit it from the folder it is in",
            "# (cd DIR && sbatch job.sbatch [more options for the trainer]), or export PLAN_DIR=DIR first.",
            "set -euo pipefail",
            'PLAN_DIR="${PLAN_DIR:-$SLURM_SUBMIT_DIR}"',
            *_read_args(job, "$PLAN_DIR"),
            'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
            f'srun torchrun --nnodes "$SLURM_NNODES" --nproc-per-node {job.gpus_per_node} \\',
            f'  --rdzv-backend c10d --rdzv-id "$SLURM_JOB_ID" --rdzv-endpoint "$MASTER_ADDR:{PORT}" \\',
            f"  {_entry(job)} {_argv_tail(job)}",
            "",
        ]
    )


def _gpu_resource(accelerator: str | None) -> str:
    return "amd.com/gpu" if accelerator and accelerator.upper().startswith("MI") else "nvidia.com/gpu"


def _pod_spec(job: Job) -> dict[str, Any]:
    args = [f"{K8S_MOUNT}/schedule.csv" if item == "schedule.csv" else item for item in job.args]
    entry = job.entry if job.entry[0] == "-m" else [job.entry[0]]
    torchrun = [
        f"--nnodes={job.num_nodes}",
        f"--nproc-per-node={job.gpus_per_node}",
        "--node-rank=$(NODE_RANK)",
        f"--master-addr={job.name}-node-0-0.{job.name}",
        f"--master-port={PORT}",
        *entry,
        *args,
    ]
    index = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    env: list[dict[str, Any]] = [{"name": "NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": index}}}]
    if job.python_path:
        env.append({"name": "PYTHONPATH", "value": K8S_MOUNT})
    gpus = {_gpu_resource(job.accelerator): str(job.gpus_per_node)}
    return {
        "restartPolicy": "Never",
        "containers": [
            {
                "name": "trainer",
                "image": job.image,
                "command": ["torchrun"],
                "args": torchrun,
                "env": env,
                "ports": [{"containerPort": PORT, "protocol": "TCP"}],
                "resources": {"limits": gpus, "requests": gpus},
                "volumeMounts": [
                    {"name": "plan", "mountPath": K8S_MOUNT, "readOnly": True},
                    {"name": "dshm", "mountPath": "/dev/shm"},
                ],
            }
        ],
        "volumes": [
            {"name": "plan", "configMap": {"name": job.name}},
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        ],
    }


def kubernetes_objects(job: Job) -> list[dict[str, Any]]:
    """A ConfigMap with the plan's files and a JobSet of ``num_nodes`` pods, each with ``gpus_per_node`` GPUs.

    Raises:
        ValueError: the files exceed a ConfigMap's 1 MiB.
    """
    size = sum(len(text.encode()) for text in job.files.values())
    if size > CONFIG_MAP_LIMIT_BYTES:
        raise ValueError(
            f"the plan's files take {size} bytes, over a Kubernetes ConfigMap's {CONFIG_MAP_LIMIT_BYTES}: use "
            "--scheduler torchrun or slurm, or mount the files from a volume of your own"
        )
    labels = {"app.kubernetes.io/name": "pipesched", "app.kubernetes.io/instance": job.name}
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": job.name, "labels": labels}}
    config_map["data"] = dict(job.files)
    job_spec = {
        "parallelism": job.num_nodes,
        "completions": job.num_nodes,
        "completionMode": "Indexed",
        "backoffLimit": 0,
        "template": {"metadata": {"labels": labels}, "spec": _pod_spec(job)},
    }
    jobset = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": job.name, "labels": labels, "annotations": {"pipesched/plan": job.summary}},
        "spec": {
            "network": {"enableDNSHostnames": True},
            "failurePolicy": {"maxRestarts": 0},
            "replicatedJobs": [{"name": "node", "replicas": 1, "template": {"spec": job_spec}}],
        },
    }
    return [config_map, jobset]


def _job_yaml(job: Job) -> str:
    header = (
        f"# {job.summary}\n# Written by `pipesched launch`: kubectl apply -f job.yaml (needs the JobSet controller, "
        "which Kubeflow Trainer and Kueue install)\n"
    )
    return header + yaml.dump_all(kubernetes_objects(job), Dumper=_BlockDumper, sort_keys=False, width=1000)


def _task_yaml(job: Job) -> str:
    accelerator = _SKYPILOT_ACCELERATORS.get(job.accelerator or "", job.accelerator or "H100")
    run = "\n".join(
        [
            "set -euo pipefail",
            *_read_args(job, "$PWD"),
            'MASTER_ADDR="$(echo "$SKYPILOT_NODE_IPS" | head -n 1)"',
            'torchrun --nnodes "$SKYPILOT_NUM_NODES" --nproc-per-node "$SKYPILOT_NUM_GPUS_PER_NODE" \\',
            f'  --node-rank "$SKYPILOT_NODE_RANK" --master-addr "$MASTER_ADDR" --master-port {PORT} \\',
            f"  {_entry(job)} {_argv_tail(job, passthrough=False)}",
            "",
        ]
    )
    task = {
        "name": job.name,
        "num_nodes": job.num_nodes,
        "resources": {"accelerators": f"{accelerator}:{job.gpus_per_node}"},
        "workdir": ".",
        "run": run,
    }
    header = f"# {job.summary}\n# Written by `pipesched launch`: cd DIR && sky launch task.yaml\n"
    return header + yaml.dump(task, Dumper=_BlockDumper, sort_keys=False, width=1000)


_RENDERERS = {"torchrun": _launch_sh, "slurm": _job_sbatch, "kubernetes": _job_yaml, "skypilot": _task_yaml}


def render_scheduler_file(scheduler: str, job: Job) -> tuple[str, str]:
    """(file name, text) of ``scheduler``'s file for ``job``.

    Raises:
        KeyError: an unknown scheduler (the CLI and the route check the name first).
        ValueError: as :func:`kubernetes_objects`.
    """
    return SCHEDULER_FILES[scheduler], _RENDERERS[scheduler](job)
