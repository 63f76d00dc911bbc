"""One plan → the files a job scheduler runs: the schedule's CSV, the training framework's argv, the scheduler's file.

The plan's schedule is the one the service stored (``GET /v1/plans/{id}/launch``), the one ``pipesched plan -o
PLAN.json`` wrote beside the plan file (``PLAN.schedule-N.json``, :func:`plan_schedule_path`), or, without either,
rebuilt from the plan's request and configuration (a family's schedule is generated again exactly; an ``auto``
one is searched again within the request's time limit and may differ: the bundle's notes then say so).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from pipesched.api.launch.schedulers import SCHEDULER_FILES, Job, render_scheduler_file
from pipesched.optimizer.export import orders_to_torch_csv
from pipesched.optimizer.frameworks import FRAMEWORKS
from pipesched.optimizer.planner.evaluate import build_problem, launch_spec
from pipesched.optimizer.planner.launch import (
    CONFIG_MODULE_NAME,
    LaunchError,
    LaunchSpec,
    megatron_args,
    plan_configuration,
    torchtitan_launch,
)
from pipesched.optimizer.planner.rank import estimator_for
from pipesched.optimizer.planner.request import Plan, PlanAnswer, PlanRequest
from pipesched.optimizer.result import Schedule
from pipesched.optimizer.solve import solve, solve_family

__all__ = [
    "SCHEDULERS",
    "TARGETS",
    "LaunchBundle",
    "LaunchOptions",
    "build_bundle",
    "launch_target",
    "pick_plan",
    "plan_schedule",
    "plan_schedule_path",
    "stored_schedule",
    "write_plan_schedules",
]

SCHEDULERS = tuple(SCHEDULER_FILES)
TARGETS = ("torchtitan", "megatron")
#: Kubernetes names (DNS-1123 labels), short enough for JobSet's pod host names.
_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$")
#: A rebuilt schedule whose step differs from the plan's by more than this (relative) gets a note.
_STEP_TOLERANCE = 1e-3


@dataclass(frozen=True)
class LaunchOptions:
    """What the user chooses: the scheduler, the framework, the job's name and image, a config of their own.

    ``target`` None: the launch target of the request's framework where it has one (:func:`launch_target`).
    """

    scheduler: str = "torchrun"
    target: str | None = None
    name: str | None = None
    image: str = "your-registry/torchtitan:0.3.0"
    torchtitan_module: str | None = None
    torchtitan_config: str | None = None

    def check(self) -> None:
        """Raises LaunchError naming the bad option and the allowed values."""
        if self.scheduler not in SCHEDULERS:
            raise LaunchError(f"scheduler {self.scheduler!r} is not one of {', '.join(SCHEDULERS)}")
        if self.target is not None and self.target not in TARGETS:
            raise LaunchError(f"target {self.target!r} is not one of {', '.join(TARGETS)}")
        if self.name is not None and not _NAME.match(self.name):
            raise LaunchError(
                f"name {self.name!r} is not a Kubernetes name: lowercase letters, digits and '-', starting with a "
                "letter, at most 40 characters"
            )
        if (self.torchtitan_module is None) != (self.torchtitan_config is None):
            raise LaunchError(
                "torchtitan module and config: give both (--torchtitan-module and --torchtitan-config; over HTTP "
                "torchtitan_module and torchtitan_config), or neither"
            )


@dataclass
class LaunchBundle:
    """The files (name → text, in writing order), what the user should know, and the scheduler file's name."""

    files: dict[str, str]
    notes: list[str] = field(default_factory=list)
    scheduler_file: str = ""


def pick_plan(answer: PlanAnswer, number: int) -> Plan:
    """Plan ``number`` (1 = best) of ``answer``.

    Raises:
        LaunchError: no such plan.
    """
    if not answer.plans:
        raise LaunchError(f"the plan answer has no plans ({answer.error or answer.status})")
    if not 1 <= number <= len(answer.plans):
        raise LaunchError(f"plan {number} does not exist: the answer has plans 1 to {len(answer.plans)}")
    return answer.plans[number - 1]


def plan_schedule(request: PlanRequest, plan: Plan) -> Schedule:
    """The plan's schedule rebuilt from its request and configuration (simulated, memory not enforced: the
    planner judged the plan's memory against the GPU's with its headroom)."""
    config = plan_configuration(plan)
    problem = build_problem(estimator_for(request), config, time_limit_s=request.search.time_limit_s)
    if config.method == "auto":
        return solve(problem)
    return solve_family(problem, config.method, enforce_memory=False)


def plan_schedule_path(plan_path: Path, number: int) -> Path:
    """Where ``pipesched plan -o PLAN.json`` writes plan ``number``'s schedule (1 = the best): ``PLAN.schedule-N.json``
    beside it, the schedule JSON ``pipesched solve`` writes (``pipesched run``, ``check`` and ``launch`` read it)."""
    return plan_path.with_name(f"{plan_path.stem}.schedule-{number}.json")


def write_plan_schedules(plan_path: Path, plans: list[Plan], schedules: list[Schedule | None]) -> list[Path]:
    """Write each pipelined plan's schedule (the one the planner simulated) beside ``plan_path``, removing those an
    earlier answer left there; returns the paths.

    Raises:
        OSError: a file cannot be written.
    """
    for stale in plan_path.parent.glob(f"{plan_path.stem}.schedule-*.json"):
        if stale.stem.rsplit("-", 1)[-1].isdigit():
            stale.unlink()
    written = []
    for number, (plan, schedule) in enumerate(zip(plans, schedules, strict=True), start=1):
        if schedule is None or plan.pipeline_parallel <= 1:
            continue
        path = plan_schedule_path(plan_path, number)
        path.write_text(schedule.model_dump_json(indent=1))
        written.append(path)
    return written


def stored_schedule(plan_path: Path, number: int, plan: Plan) -> tuple[Schedule | None, list[str]]:
    """The schedule ``pipesched plan`` wrote for plan ``number`` beside ``plan_path`` (:func:`plan_schedule_path`)
    when it is that plan's: the same pipeline (ranks, stages per rank, microbatches) and its step. Returns
    (schedule or ``None``, notes): ``None`` without the file or a pipeline (the schedule is then rebuilt, where
    there is one), or with a note when the file is unreadable or another plan's."""
    path = plan_schedule_path(plan_path, number)
    if plan.pipeline_parallel <= 1 or not path.is_file():
        return None, []
    try:
        schedule = Schedule.model_validate_json(path.read_text())
    except (OSError, ValueError) as error:
        return None, [f"{path.name} could not be read ({str(error).splitlines()[0]}): the schedule was rebuilt"]
    pipeline = schedule.problem.pipeline if schedule.problem is not None else None
    shape = (pipeline.num_ranks, pipeline.stages_per_rank, pipeline.num_microbatches) if pipeline else None
    expected = (plan.pipeline_parallel, plan.stages_per_rank, plan.num_microbatches)
    if shape != expected or not schedule.ranks:
        return None, [
            f"{path.name} is not plan {number}'s schedule (ranks, stages per rank, microbatches {shape} where the "
            f"plan has {expected}): the schedule was rebuilt"
        ]
    mismatch = _schedule_notes(plan, schedule)
    if mismatch:
        return None, [f"{path.name} is not plan {number}'s schedule (its step differs): the schedule was rebuilt"]
    return schedule, []


def _summary(request: PlanRequest, plan: Plan, number: int) -> str:
    cluster = request.cluster
    model = request.model.preset or f"a {request.model.num_layers}-layer model"
    experts = f", experts over ep {plan.expert_parallel}" if plan.expert_parallel > 1 else ""
    if plan.expert_parallel > 1 and plan.expert_tensor_parallel > 1:
        experts += f", each split over etp {plan.expert_tensor_parallel}"
    return (
        f"plan {number} for {model} on {cluster.num_nodes} x {cluster.gpus_per_node} {cluster.accelerator or 'GPUs'}: "
        f"pp {plan.pipeline_parallel} x tp {plan.tensor_parallel} x cp {plan.context_parallel} x dp "
        f"{plan.data_parallel.size} ({plan.data_parallel.sharding}){experts}, {plan.stages_per_rank} stage(s) per "
        f"rank ({plan.placement}), "
        f"{plan.method}, micro-batch {plan.micro_batch_size} x {plan.num_microbatches}, "
        f"recomputation {plan.activation_recomputation}; predicted step {plan.step_time_ms:.1f} ms"
    )


def _schedule_notes(plan: Plan, schedule: Schedule) -> list[str]:
    step = schedule.step_time if schedule.step_time is not None else schedule.makespan
    if step is None or abs(step - plan.pipeline_makespan_ms) <= _STEP_TOLERANCE * plan.pipeline_makespan_ms:
        return []
    if abs(step - plan.step_time_ms) <= _STEP_TOLERANCE * plan.step_time_ms:
        return []
    return [
        f"the schedule was searched again ({plan.method}): its step is {step:.1f} ms where the plan's was "
        f"{plan.step_time_ms:.1f} ms"
    ]


def launch_target(request: PlanRequest, target: str | None) -> tuple[str, list[str]]:
    """The target that runs the plans of ``request`` (``target`` where given, else its framework's,
    :attr:`~pipesched.optimizer.frameworks.Framework.launch_target`, else torchtitan) and what to know of it: a
    target other than the framework the prediction assumed."""
    name = request.training.framework or request.model.framework
    framework = FRAMEWORKS[name] if name is not None else None
    if framework is None:
        return target or "torchtitan", []
    chosen = target or framework.launch_target or "torchtitan"
    if chosen == framework.launch_target:
        return chosen, []
    why = "given" if target is not None else f"pipesched writes no {framework.title} launch"
    return chosen, [
        f"the plan's prediction assumed {framework.title} (training.framework {framework.name}); this is a {chosen} "
        f"launch ({why}): {chosen} runs it with its own kernels and memory, not the ones predicted"
    ]


def _target_files(spec: LaunchSpec, options: LaunchOptions) -> tuple[dict[str, str], list[str], list[str], list[str]]:
    """(files, argv, entry point, notes) of the target framework."""
    if options.target == "megatron":
        notes = []
        if spec.layout.pipeline_parallel > 1:
            notes.append(
                "Megatron-LM runs its own 1F1B schedule (interleaved with virtual stages), not schedule.csv; "
                "add your data and tokenizer options (--data-path, --tokenizer-type, …) to the script's arguments"
            )
        args = megatron_args(spec)
        return {"megatron.args": "\n".join(args) + "\n"}, args, ["pretrain_gpt.py"], notes
    launch = torchtitan_launch(spec, module=options.torchtitan_module, config=options.torchtitan_config)
    files = {"torchtitan.args": "\n".join(launch.args) + "\n"}
    if launch.config_source is not None:
        files[f"{CONFIG_MODULE_NAME}.py"] = launch.config_source
    notes = []
    if spec.expert_parallel > 1 and spec.expert_tensor_parallel > 1:
        notes.append(
            f"the plan splits each routed expert over {spec.expert_tensor_parallel} GPUs (expert_tensor_parallel), "
            "which torchtitan 0.3 has no option for: it runs the experts whole on each expert-parallel rank "
            "(e_t 1), so its step and memory are not this plan's; plan with search.expert_tensor_parallel [1] for "
            "torchtitan, or --target megatron (--expert-tensor-parallel-size)"
        )
    if spec.async_tensor_parallel and spec.layout.tensor_parallel > 1 and "--compile.enable" not in launch.args:
        notes.append(
            "the plan assumes the tensor-parallel overlap (training.async_tensor_parallel), which torchtitan 0.3 runs "
            "only under --compile.enable; this plan runs eager, so its tensor-parallel collectives are exposed and "
            "its step is slower than predicted: plan with training.kernels compiled for torchtitan, or "
            "--target megatron (--tp-comm-overlap)"
        )
    return files, launch.args, ["-m", "torchtitan.train"], notes


def build_bundle(
    request: PlanRequest, plan: Plan, number: int, schedule: Schedule | None, options: LaunchOptions
) -> LaunchBundle:
    """The files for plan ``number`` (1 = best): ``schedule.csv`` (with pipeline parallelism), the target's
    argv file (and config module), the scheduler's file.

    Raises:
        LaunchError: a bad option, or a plan the target cannot run (the message names the fix).
        ValueError: the files do not fit a Kubernetes ConfigMap.
    """
    options.check()
    target, notes = launch_target(request, options.target)
    options = replace(options, target=target)
    files: dict[str, str] = {}
    if plan.pipeline_parallel > 1 and schedule is None:
        schedule = plan_schedule(request, plan)
        notes += _schedule_notes(plan, schedule)
    if schedule is not None and plan.pipeline_parallel > 1:
        files["schedule.csv"] = orders_to_torch_csv(schedule.orders())
    layers = schedule.problem.model.layers_per_stage if schedule is not None and schedule.problem.model else None
    spec = launch_spec(estimator_for(request), plan_configuration(plan), layers)
    target_files, args, entry, target_notes = _target_files(spec, options)
    files.update(target_files)
    notes += target_notes
    job = Job(
        name=options.name or f"pipesched-plan-{number}",
        summary=_summary(request, plan, number),
        num_nodes=spec.num_nodes,
        gpus_per_node=spec.gpus_per_node,
        accelerator=request.cluster.accelerator,
        args_file=f"{options.target}.args",
        args=args,
        entry=entry,
        subcommand_last=options.target == "torchtitan",
        python_path=f"{CONFIG_MODULE_NAME}.py" in files,
        image=options.image,
        files={name: text for name, text in files.items() if not name.endswith(".args")},
    )
    scheduler_file, text = render_scheduler_file(options.scheduler, job)
    files[scheduler_file] = text
    return LaunchBundle(files=files, notes=notes, scheduler_file=scheduler_file)
