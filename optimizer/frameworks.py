"""The training frameworks a plan may name (``training.framework``, ``model.framework``) and what each runs.

One table, :data:`FRAMEWORKS`: for each framework the calibration data names (its rows' ``software.framework``),
the kernels it runs when ``kernels`` is not said and the ones it may be told to run, the software-profile fields
(:class:`~pipesched.optimizer.cost.profile.SoftwareProfile`) it runs that no request field states, and the
``pipesched launch`` target that runs its plans. A calibration row is timed with its framework's software fields
under the row's own stated ones (:func:`pipesched.optimizer.calibration.predict.run_software`); a plan naming the
framework with them (:func:`pipesched.optimizer.cost.stages.resolve_hardware`).

- ``torchtitan``: eager PyTorch (``CompileConfig.enable = False``), ``compiled`` with ``--compile.enable``; FSDP2
  over the fp32 model (``fp32_parameters``), its implicit backward prefetch, the gradients reduced every
  microbatch, ``F.cross_entropy`` on fp32 logits (``torchtitan/components/loss.py``): the software profile's
  defaults, stated here so that a plan naming it does not move with them.
- ``megatron`` (Megatron-LM, Megatron-Core, Megatron Bridge, NeMo 2): its own 1F1B schedule, interleaved over
  virtual stages placed in a loop (no schedule CSV: ``megatron/core/pipeline_parallel/schedules.py``), so its
  plans are searched among those where ``search.method`` pins none; Transformer Engine's fused kernels;
  Megatron-FSDP's ``optim_grads_params`` (``zero3``: 2 + 4 + g + 8 bytes a parameter) reducing every microbatch
  (``megatron_fsdp.py`` ``grad_reduce_every_bprop``); DeepEP / the flex dispatcher for experts over nodes
  (``hierarchical``), no all-to-all overlap unless a recipe turns it on (a calibration row says so).
- ``automodel`` (NeMo AutoModel): Transformer Engine's kernels under PyTorch FSDP2 over a model built in bf16
  (``bf16_parameters``: 2 + 2 + 4 bytes a parameter, ``nemo_automodel/components/models/qwen3_moe/model.py`` and
  the benchmark configs at 01926a5c), its trainer's ``get_sync_ctx`` reducing on the last microbatch only
  (``last_microbatch``, ``nemo_automodel/recipes/llm/train_ft.py``), DeepEP dispatch.
- ``composer`` (MosaicML Composer, llm-foundry): eager PyTorch FSDP1 over the fp32 model, ``BACKWARD_POST``
  prefetch (Composer's default, ``composer/trainer/dist_strategy.py`` v0.13–v0.18), gradients reduced every
  microbatch (its ``no_sync`` is DDP's only), flash-attn's fused cross-entropy (llm-foundry's default
  ``loss_fn: fused_crossentropy``, ``llmfoundry/models/mpt/modeling_mpt.py``).

Each reduces its data-parallel gradients in fp32 unless told otherwise (:attr:`Framework.gradient_reduce_dtype`, the
request's ``training.gradient_reduce_dtype`` default, which a plan naming the framework states in its note):
torchtitan's ``mixed_precision_reduce`` ("float32" by default; early releases take no other value); Megatron-LM's
``--bf16``, which turns on ``accumulate_allreduce_grads_in_fp32`` unless ``--grad-reduce-in-bf16`` is said
(``megatron/training/arguments.py``), and Megatron Bridge's and NeMo's
``bf16_mixed`` precision (``grad_reduce_in_fp32=True``), though their published performance recipes set
``grad_reduce_in_fp32 = False`` (the calibration rows of those recipes say ``software.gradient_reduce_dtype`` "bf16");
NeMo AutoModel's ``FSDP2Config.mp_policy`` (``reduce_dtype=torch.float32``,
``nemo_automodel/components/distributed/config.py``); Composer's FSDP ``mixed_precision`` default ``DEFAULT``
(``reduce_dtype`` fp32 in ``get_mixed_precision`` of its current releases, though early ones, whose
``dist_strategy.py`` built it inline, reduced ``DEFAULT`` in the autocast precision; its ``PURE`` reduces in bf16, as
llm-foundry's rows that ran it say).

The rows of ``software.framework`` "meta" (the Llama 3 report) and "deepseek" (the DeepSeek-V3 report) ran in-house
stacks nobody else can run: no entry.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "FRAMEWORKS",
    "FRAMEWORK_SOFTWARE",
    "Framework",
    "framework_kernels",
    "framework_name",
    "framework_names",
]


@dataclass(frozen=True)
class Framework:
    """One training framework.

    Attributes:
        name: the key of :data:`FRAMEWORKS`, a calibration row's ``software.framework``.
        title: what it is, for messages and notes.
        kernels: the kernels mode it runs when ``kernels`` is not said.
        also_kernels: other kernels modes it runs when told (torch.compile).
        software: software-profile fields it runs that no request field states (field → value).
        launch_target: the ``pipesched launch --target`` that runs its plans; None: none does.
        aliases: other names accepted for it.
        methods: the pipeline schedules it runs (``search.method`` where the request pins none); None: any, from
            the schedule's CSV (torchtitan's ``pipeline_parallel_schedule_csv``).
        gradient_reduce_dtype: the dtype it reduces gradients in unless told otherwise (module docstring).
        reduce_hint: what a plan's note adds beside that default, where its published runs often differ.
    """

    name: str
    title: str
    kernels: str
    also_kernels: tuple[str, ...] = ()
    software: dict[str, str] = field(default_factory=dict)
    launch_target: str | None = None
    aliases: tuple[str, ...] = ()
    methods: tuple[str, ...] | None = None
    gradient_reduce_dtype: str = "fp32"
    reduce_hint: str | None = None

    @property
    def runs_kernels(self) -> tuple[str, ...]:
        """Every kernels mode it runs, its default first."""
        return (self.kernels, *self.also_kernels)


#: The frameworks (module docstring): name → what it runs.
FRAMEWORKS: dict[str, Framework] = {
    framework.name: framework
    for framework in (
        Framework(
            "torchtitan",
            "torchtitan",
            kernels="eager",
            also_kernels=("compiled",),
            software={
                "pytorch_cross_entropy": "fp32",
                "fsdp_backward_prefetch": "BACKWARD_PRE",
                "fsdp_gradient_sync": "every_microbatch",
            },
            launch_target="torchtitan",
        ),
        Framework(
            "megatron",
            "Megatron-LM / Megatron Bridge / NeMo",
            kernels="fused",
            software={"fused_fsdp_state": "zero3", "fsdp_gradient_sync": "every_microbatch"},
            launch_target="megatron",
            aliases=("megatron-lm", "megatron-core", "megatron-bridge", "nemo"),
            methods=("1f1b", "interleaved-1f1b"),
            reduce_hint="Megatron Bridge's and NeMo's performance recipes reduce in bf16 (grad_reduce_in_fp32 False): "
            "say training.gradient_reduce_dtype bf16 to plan one",
        ),
        Framework(
            "automodel",
            "NeMo AutoModel",
            kernels="fused",
            software={"fused_fsdp_state": "bf16_parameters", "fsdp_gradient_sync": "last_microbatch"},
            aliases=("nemo-automodel",),
        ),
        Framework(
            "composer",
            "MosaicML Composer / llm-foundry",
            kernels="eager",
            also_kernels=("compiled",),
            software={
                "pytorch_cross_entropy": "fused",
                "fsdp_backward_prefetch": "BACKWARD_POST",
                "fsdp_gradient_sync": "every_microbatch",
            },
            aliases=("llm-foundry", "mosaicml"),
        ),
    )
}

#: What each framework runs that no request field states, as software-profile fields (:attr:`Framework.software`).
FRAMEWORK_SOFTWARE: dict[str, dict[str, str]] = {name: framework.software for name, framework in FRAMEWORKS.items()}

_BY_NAME: dict[str, str] = {
    alias: framework.name for framework in FRAMEWORKS.values() for alias in (framework.name, *framework.aliases)
}


def framework_names() -> list[str]:
    """Every accepted name: the frameworks and their aliases."""
    return list(_BY_NAME)


def framework_name(value: str) -> str:
    """The framework ``value`` names (case-insensitive, an alias allowed).

    Raises:
        ValueError: not a known framework (the message lists them).
    """
    name = _BY_NAME.get(value.strip().lower())
    if name is None:
        known = "; ".join(
            framework.name + (f" ({', '.join(framework.aliases)})" if framework.aliases else "")
            for framework in FRAMEWORKS.values()
        )
        raise ValueError(f"{value!r} is not a framework pipesched knows: use one of {known}, or leave it out")
    return name


def framework_kernels(
    framework: str, kernels: str | None, fields: tuple[str, str] = ("model.kernels", "model.framework")
) -> str:
    """The kernels mode a run of ``framework`` takes: ``kernels`` where said (not None, not "unknown"), else the
    framework's own. ``fields``: the request's names of the two, for the message.

    Raises:
        ValueError: ``kernels`` a mode the framework does not run (the message names both fields and what it runs).
    """
    known = FRAMEWORKS[framework]
    if kernels is None or kernels == "unknown":
        return known.kernels
    if kernels not in known.runs_kernels:
        runs = " or ".join(known.runs_kernels)
        raise ValueError(
            f"{fields[0]} {kernels!r} contradicts {fields[1]} {framework!r}: {known.title} runs {runs} kernels; say "
            f"{runs}, or leave {fields[0]} out to take the framework's"
        )
    return kernels
