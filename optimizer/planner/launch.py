"""From a plan to the argv its training framework takes: torchtitan ≥ 0.3 and Megatron-LM.

Pure functions of a :class:`LaunchSpec` (a plan, its request's model, cluster and batch, and the layer
partition its schedule was simulated with); no torch, no files. The job-scheduler files around these argv
(torchrun, Slurm, Kubernetes, SkyPilot) are :mod:`pipesched.api.launch`'s.

Sources of the names:

* torchtitan 0.3.0 (``torchtitan/config/manager.py``, ``config/configs.py``, ``trainer.py``,
  ``distributed/pipeline_parallel.py``): ``--module``/``--config`` name a function of
  ``torchtitan/models/<module>/config_registry.py`` (or of any importable module); ``--parallelism.*`` and
  ``--training.*`` are tyro overrides; activation checkpointing is a tyro subcommand
  (``activation-checkpoint:none|selective|full``) that must come last; pipeline parallelism is refused unless
  ``--training.disable_cuda_graphs``; with ``--parallelism.pipeline_parallel_schedule_csv`` the schedule is
  ``_PipelineScheduleRuntime`` loading the CSV, the stage → rank placement follows
  ``pipeline_parallel_schedule`` (V for ``ZBVZeroBubble``, loop otherwise), and
  ``module_fqns_per_model_part`` fixes the stages' layers. FP8 is a model converter (``Float8LinearConverter``)
  set in a config function: where the preset's function has another precision than the plan (and the module
  ships no Float8 function, as ``deepseek_v3_671b_float8``), or where torchtitan registers the preset's flavor
  without a function that builds it (Qwen3 ``235B-A22B``), or where torchtitan ships no model of the preset
  (Mixtral: built from its common attention and MoE blocks, ``models/common/config_utils.py``), a config module
  is written beside the args (:attr:`TorchtitanLaunch.config_source`).
* Megatron-LM (``megatron/training/arguments.py`` and the dataclasses it builds arguments from,
  ``megatron/core/model_parallel_config.py``, ``megatron/core/transformer/transformer_config.py``).
"""

from __future__ import annotations

import shlex
import string
from dataclasses import dataclass, field
from importlib import resources
from typing import TYPE_CHECKING

from pipesched.optimizer.configs import ModelConfig
from pipesched.optimizer.cost.profile import active_catalogue, layout_sharding
from pipesched.optimizer.planner.space import DIMENSIONS, Configuration
from pipesched.optimizer.planner.torchtitan_toml import ACTIVATION_CHECKPOINT_PREFIX

if TYPE_CHECKING:
    from pipesched.optimizer.planner.request import Plan

__all__ = [
    "CONFIG_MODULE_NAME",
    "TORCHTITAN_CONFIGS",
    "LaunchError",
    "LaunchSpec",
    "TorchtitanConfig",
    "TorchtitanLaunch",
    "megatron_args",
    "module_fqns_per_stage",
    "plan_configuration",
    "torchrun_command",
    "torchtitan_compiles",
    "torchtitan_launch",
]

#: The config module written beside ``torchtitan.args`` when the plan's precision is not the preset's.
CONFIG_MODULE_NAME = "pipesched_torchtitan"
#: The config module written beside a plan whose precision is not the one of torchtitan's config (``$`` placeholders).
CONFIG_TEMPLATE = "templates/torchtitan_config.py.tmpl"
#: The config module written for a Mixtral plan: the model from torchtitan's common blocks, ``base``'s recipe.
MIXTRAL_TEMPLATE = "templates/torchtitan_mixtral.py.tmpl"


class LaunchError(ValueError):
    """The plan cannot be launched as asked; the message names what to change."""


@dataclass(frozen=True)
class TorchtitanConfig:
    """A torchtitan 0.3 config function: ``--module``, ``--config``, the model flavor its ``model_registry``
    takes, the precision the function sets (``llama3_405b`` converts its linear layers to Float8) and whether it
    compiles the model (``llama3_405b``: ``CompileConfig(enable=True, enable_async_tensor_parallel=True)``, which
    the launch turns off for a plan predicted eager).

    ``compile_components``: what the function compiles once compilation is on (torchtitan's default model and loss;
    ``deepseek_v3_671b``: the loss only, so a plan predicted compiled also names the model). ``float8``: the
    module's function that trains the same model with Float8 linear layers and grouped experts
    (``deepseek_v3_671b_float8``), taken for an FP8 plan. ``base``: set where torchtitan's ``model_registry`` has the
    flavor but no function builds it (Qwen3's ``235B-A22B``): the function of the same model family whose recipe
    (loss, data, optimizer, schedule) a written config module starts from, building ``flavor`` instead, as
    torchtitan's own variants do (``deepseek_v3_16b_hybridep``); ``config`` then names the written function and
    ``assets`` the ``hf_assets_path`` it sets (the flavor's tokenizer and checkpoint). ``attention``: the
    ``attn_backend`` the function's model attends with (``flex``, torchtitan's default; ``varlen`` for GPT-OSS,
    whose context parallelism torchtitan 0.3 does not run). ``max_seq_len``: the longest ``training.seq_len``
    torchtitan trains the function's model at (its RoPE's ``max_seq_len``; the trainer refuses a longer one).
    ``mixtral``: torchtitan ships no model of the preset; the written module builds Mixtral of the plan's shape from
    torchtitan's common blocks (Qwen3's MoE decoder without QK norm; :data:`MIXTRAL_TEMPLATE`) with ``base``'s
    recipe, ``flavor`` naming it."""

    module: str
    config: str
    flavor: str | None = None
    precision: str = "bf16"
    compiles: bool = False
    compile_components: tuple[str, ...] = ("model", "loss")
    float8: str | None = None
    base: str | None = None
    assets: str | None = None
    attention: str = "flex"
    max_seq_len: int | None = None
    mixtral: bool = False


#: Model presets → torchtitan 0.3.0's config functions (``torchtitan/models/<module>/config_registry.py``).
#: Mixtral has no torchtitan model: a written module builds it (Mistral AI's ``config.json``: RoPE theta 1e6 and
#: ``max_position_embeddings`` 32,768 / 65,536). torchtitan's other functions build models no preset names (Qwen3
#: 0.6B-32B dense, the 16B DeepSeek MoE ``deepseek_v3_16b``, Kimi, Qwen3.5, Flux).
TORCHTITAN_CONFIGS: dict[str, TorchtitanConfig] = {
    "llama3.1-8b": TorchtitanConfig("llama3", "llama3_8b", "8B", max_seq_len=131072),
    "llama3.1-70b": TorchtitanConfig("llama3", "llama3_70b", "70B", max_seq_len=131072),
    "llama3.1-405b": TorchtitanConfig(
        "llama3", "llama3_405b", "405B", precision="fp8", compiles=True, max_seq_len=131072
    ),
    "deepseek-v3": TorchtitanConfig(
        "deepseek_v3",
        "deepseek_v3_671b",
        "671B",
        compile_components=("loss",),
        float8="deepseek_v3_671b_float8",
        max_seq_len=16384,
    ),
    "qwen3-30b-a3b": TorchtitanConfig("qwen3", "qwen3_30b_a3b", "30B-A3B", max_seq_len=40960),
    "qwen3-235b-a22b": TorchtitanConfig(
        "qwen3",
        "qwen3_235b_a22b",
        "235B-A22B",
        base="qwen3_30b_a3b",
        assets="./assets/hf/Qwen3-235B-A22B",
        max_seq_len=40960,
    ),
    "mixtral-8x7b": TorchtitanConfig(
        "qwen3",
        "mixtral_8x7b",
        "8x7B",
        base="qwen3_30b_a3b",
        assets="./assets/hf/Mixtral-8x7B-v0.1",
        max_seq_len=32768,
        mixtral=True,
    ),
    "mixtral-8x22b": TorchtitanConfig(
        "qwen3",
        "mixtral_8x22b",
        "8x22B",
        base="qwen3_30b_a3b",
        assets="./assets/hf/Mixtral-8x22B-v0.1",
        max_seq_len=65536,
        mixtral=True,
    ),
    "gpt-oss-20b": TorchtitanConfig("gpt_oss", "gpt_oss_20b", "20b", attention="varlen", max_seq_len=131072),
    "gpt-oss-120b": TorchtitanConfig("gpt_oss", "gpt_oss_120b", "120b", attention="varlen", max_seq_len=131072),
}

#: torchtitan's ``pipeline_parallel_schedule`` decides the stage → rank placement of a CSV schedule
#: (``_get_pp_rank_to_stage_indices_mapping``): a V for ZBVZeroBubble, a loop for the others.
_TORCH_PLACEMENT_SCHEDULE = {("loop", False): "1F1B", ("loop", True): "Interleaved1F1B", ("v", True): "ZBVZeroBubble"}

#: torchtitan's FSDP policy by the plan's sharding (ZeRO-1/2 have no exact counterpart: weights stay gathered).
_RESHARD_AFTER_FORWARD = {"optimizer": "never", "gradients": "never"}


def plan_configuration(plan: Plan) -> Configuration:
    """The search space's point a plan answers (its fields by the plan's names)."""
    values = {name: getattr(plan, name) for name in DIMENSIONS if hasattr(plan, name)}
    values.update(data_parallel_size=plan.data_parallel.size, sharding=plan.data_parallel.sharding)
    return Configuration(**values)


@dataclass(frozen=True)
class LaunchSpec:
    """Everything a launcher needs from one plan: its configuration (``layout``) on the request's model (as
    trained: precision and kernels), cluster and batch
    (:func:`pipesched.optimizer.planner.evaluate.launch_spec` builds it as the planner does).

    ``layers_per_stage`` is the transformer-layer partition the plan's schedule was simulated with (stage 0
    also holds the embedding, the last stage the norm and output head); ``None`` leaves the split to the
    framework. Context and expert parallelism and the precision are read from the layout by their plan names
    (1, 1 and bf16 where the planner does not search them). ``async_tensor_parallel``: the request's
    ``training.async_tensor_parallel``, which the launch switches on with tensor parallelism (torchtitan's AsyncTP
    under ``--compile.enable``, where it runs; Megatron-LM's ``--tp-comm-overlap`` with sequence parallelism).
    """

    model: ModelConfig
    num_nodes: int
    gpus_per_node: int
    global_batch_size: int
    layout: Configuration
    sequence_parallel: bool = True
    layers_per_stage: tuple[int, ...] | None = field(default=None)
    async_tensor_parallel: bool = False

    @property
    def context_parallel(self) -> int:
        return int(getattr(self.layout, "context_parallel", 1))

    @property
    def expert_parallel(self) -> int:
        return int(getattr(self.layout, "expert_parallel", 1))

    @property
    def expert_tensor_parallel(self) -> int:
        return int(getattr(self.layout, "expert_tensor_parallel", 1))

    @property
    def precision(self) -> str:
        return str(getattr(self.layout, "precision", "bf16"))

    @property
    def local_batch_size(self) -> int:
        """Sequences one data-parallel rank runs per step: all its microbatches under pipeline parallelism
        (torchtitan splits them), one microbatch per gradient-accumulation step without."""
        layout = self.layout
        if layout.pipeline_parallel > 1:
            return layout.micro_batch_size * layout.num_microbatches
        return layout.micro_batch_size


@dataclass(frozen=True)
class TorchtitanLaunch:
    """torchtitan's argv (after ``-m torchtitan.train``) and, where the plan needs a config function torchtitan
    does not ship, that function's module source (to be saved as ``CONFIG_MODULE_NAME + ".py"`` beside the
    args and put on ``PYTHONPATH``)."""

    args: list[str]
    config_source: str | None = None


def module_fqns_per_stage(layers_per_stage: tuple[int, ...] | list[int]) -> list[list[str]]:
    """torchtitan's ``module_fqns_per_model_part`` for a partition: stage 0 also holds ``tok_embeddings``,
    the last stage ``norm`` and ``lm_head`` (the names torchtitan 0.3's ``_generate_llm_fqn_per_model_part``
    gives its decoders)."""
    parts: list[list[str]] = []
    first = 0
    for stage, count in enumerate(layers_per_stage):
        names = [f"layers.{index}" for index in range(first, first + count)]
        first += count
        if stage == 0:
            names.insert(0, "tok_embeddings")
        if stage == len(layers_per_stage) - 1:
            names += ["norm", "lm_head"]
        parts.append(names)
    return parts


def _torchtitan_config(spec: LaunchSpec, module: str | None, config: str | None) -> TorchtitanConfig:
    if module is not None and config is not None:
        return TorchtitanConfig(module, config, precision=spec.precision)
    preset = spec.model.preset
    known = TORCHTITAN_CONFIGS.get(preset or "")
    if known is None:
        model = spec.model
        whose = (
            f"model preset {preset!r}"
            if preset is not None
            else f"model of your own ({model.num_layers} layers, hidden {model.hidden_size}, "
            f"{model.num_attention_heads} heads, vocabulary {model.vocab_size})"
        )
        raise LaunchError(
            f"{whose} has no config function in torchtitan 0.3: write one that builds this model and name it "
            f"(pipesched launch --torchtitan-module M --torchtitan-config F; over HTTP the launch's "
            f"torchtitan_module and torchtitan_config), or plan a preset torchtitan ships "
            f"({', '.join(TORCHTITAN_CONFIGS)}); a config torchtitan ships for another model would train that model"
        )
    return known


def _config_function(known: TorchtitanConfig, precision: str, model: ModelConfig) -> tuple[str, str, str | None]:
    """The ``--module``, ``--config`` and written module source (``None``: torchtitan's own function) that train
    ``known``'s model (``model``'s shape where the module builds Mixtral) in ``precision``.

    Raises:
        LaunchError: an FP8 plan of a model whose torchtitan module has no Float8 function, other than Llama 3's.
    """
    if precision == known.precision and known.base is None:
        return known.module, known.config, None
    if precision == "fp8" and known.float8 is not None:
        return known.module, known.float8, None
    if precision == "fp8" and known.module != "llama3":
        which = f"Mixtral {known.flavor} of its qwen3 blocks" if known.mixtral else f"{known.module} {known.flavor}"
        raise LaunchError(
            f"the plan's precision is fp8, but torchtitan 0.3 has no Float8 config function for its {which} "
            f"(which trains in {known.precision}), and pipesched writes FP8 wrappers for llama3 configs only (Float8 "
            f"linear layers; deepseek_v3 ships its own, deepseek_v3_671b_float8): pin "
            f"search.precision to [{known.precision!r}] or name a config function of your own with --torchtitan-config"
        )
    if known.mixtral:
        return CONFIG_MODULE_NAME, known.config, _mixtral_module(known, model)
    name, source = _written_module(known, precision)
    return CONFIG_MODULE_NAME, name, source


def _mixtral_module(known: TorchtitanConfig, model: ModelConfig) -> str:
    """The config module building Mixtral of ``model``'s shape (layers, hidden size, heads, key/value heads, experts,
    top-k, expert FFN width, vocabulary) from torchtitan 0.3's common blocks, with ``known.base``'s recipe."""
    assert known.base is not None and known.assets is not None and known.max_seq_len is not None
    summary = (
        f"Mixtral {known.flavor}, which torchtitan 0.3 ships no model of, with {known.module} {known.base}'s recipe, "
        f"trained in {known.precision}."
    )
    return string.Template(resources.files(__package__).joinpath(MIXTRAL_TEMPLATE).read_text()).substitute(
        summary=summary,
        config_module=CONFIG_MODULE_NAME,
        name=known.config,
        base=known.base,
        flavor=known.flavor,
        attention=known.attention,
        assets=known.assets,
        dim=model.hidden_size,
        layers=model.num_layers,
        heads=model.num_attention_heads,
        kv_heads=model.key_value_heads,
        head_dim=model.head_size,
        experts=model.num_experts,
        top_k=model.num_experts_per_token,
        expert_ffn=model.expert_ffn_size,
        vocab=model.vocab_size,
        max_seq_len=known.max_seq_len,
    )


def _written_module(known: TorchtitanConfig, precision: str) -> tuple[str, str]:
    """A config module building ``known``'s flavor from its function (or ``base``) with the plan's precision;
    (function name, source)."""
    called = known.base or known.config
    name = known.config if known.base else f"{known.config}_{'float8' if precision == 'fp8' else 'bf16'}"
    if known.base:
        summary = (
            f"torchtitan's {known.module} flavor {known.flavor}, which torchtitan 0.3 builds in no config function, "
            f"with {known.base}'s recipe, trained in {precision}."
        )
    else:
        summary = f"{known.config} trained in {precision}."
    if precision == "fp8":
        summary += "\nFP8 is torchtitan's Float8 rowwise linear layers (needs torchao and an SM89+ GPU)."
    converters = (
        "[Float8LinearConverter.Config(filter_fqns=['lm_head'], model_compile_enabled=compiled)]"
        if precision == "fp8"
        else "None"
    )
    assets = f'    config.hf_assets_path = "{known.assets}"\n' if known.assets else ""
    source = string.Template(resources.files(__package__).joinpath(CONFIG_TEMPLATE).read_text()).substitute(
        summary=summary,
        config=called,
        config_module=CONFIG_MODULE_NAME,
        name=name,
        module=known.module,
        flavor=known.flavor,
        converters=converters,
        assets=assets,
    )
    return name, source


def _parallelism_args(spec: LaunchSpec, csv_path: str) -> list[str]:
    layout = spec.layout
    replicate, shard = (layout.data_parallel_size, 1) if layout.sharding == "none" else (1, layout.data_parallel_size)
    reshard = _RESHARD_AFTER_FORWARD.get(layout.sharding, "never" if layout.pipeline_parallel > 1 else "always")
    args = [
        "--parallelism.data_parallel_replicate_degree",
        str(replicate),
        "--parallelism.data_parallel_shard_degree",
        str(shard),
        "--parallelism.fsdp_reshard_after_forward",
        reshard,
        "--parallelism.tensor_parallel_degree",
        str(layout.tensor_parallel),
    ]
    if layout.tensor_parallel > 1 and not spec.sequence_parallel:
        args.append("--parallelism.no_enable_sequence_parallel")
    args += ["--parallelism.context_parallel_degree", str(spec.context_parallel)]
    _torchtitan_expert_mesh(spec, shard)
    args += ["--parallelism.expert_parallel_degree", str(spec.expert_parallel)]
    args += ["--parallelism.pipeline_parallel_degree", str(layout.pipeline_parallel)]
    if layout.pipeline_parallel == 1:
        return args
    schedule = _TORCH_PLACEMENT_SCHEDULE.get((layout.placement, layout.stages_per_rank > 1))
    if schedule is None:
        raise LaunchError(
            f"torchtitan places a CSV schedule's stages in a loop or a V of two stages per rank; this plan has "
            f"placement {layout.placement!r} with {layout.stages_per_rank} stages per rank: choose another plan "
            "(--plan N)"
        )
    args += [
        "--parallelism.pipeline_parallel_schedule",
        schedule,
        "--parallelism.pipeline_parallel_schedule_csv",
        csv_path,
        "--parallelism.pipeline_parallel_microbatch_size",
        str(layout.micro_batch_size),
    ]
    if spec.layers_per_stage is not None:
        args.append("--parallelism.module_fqns_per_model_part")
        args += [",".join(names) for names in module_fqns_per_stage(spec.layers_per_stage)]
    return args


def _torchtitan_expert_mesh(spec: LaunchSpec, shard: int) -> None:
    """torchtitan 0.3 takes the expert-parallel ranks from its FSDP × CP × TP ranks (``ParallelDims.build_mesh``:
    ``efsdp = dp_shard · cp · tp / ep``), never from DDP replicas, so ep must divide ``shard · cp · tp``.

    Raises:
        LaunchError: it does not (a plan with replicated weights, ``sharding`` none, and ep above cp · tp).
    """
    ranks = shard * spec.context_parallel * spec.layout.tensor_parallel
    if ranks % spec.expert_parallel:
        raise LaunchError(
            f"expert_parallel {spec.expert_parallel} does not divide torchtitan's FSDP × context × tensor-parallel "
            f"ranks ({ranks} here: sharding {spec.layout.sharding!r} shards over {shard}), which its expert "
            "parallelism spreads over, never over DDP replicas: choose a plan with sharding optimizer, gradients or "
            "full (--plan N), plan again without sharding none in search.sharding, or --target megatron"
        )


def torchtitan_compiles(spec: LaunchSpec) -> bool:
    """Whether torchtitan runs the plan with ``--compile.enable``: kernels "compiled"; with kernels "unknown", when
    the prediction's larger PyTorch share for the plan's layout class
    (:meth:`~pipesched.optimizer.cost.profile.SoftwareProfile.kernels_shares`) is torch.compile's rather than eager
    PyTorch's, so that the job handed off runs the kernels its prediction leaned on. torchtitan's own default is
    eager (``CompileConfig.enable = False``), as are most published FSDP runs: the shipped shares hand off eager."""
    if spec.model.kernels != "unknown":
        return spec.model.kernels == "compiled"
    layout = spec.layout
    degrees = (layout.tensor_parallel, layout.pipeline_parallel, spec.context_parallel, spec.expert_parallel)
    sharding = layout_sharding(layout.sharding, layout.data_parallel_size * spec.context_parallel, *degrees)
    shares = active_catalogue().software.kernels_shares("unknown", sharding, spec.model.kernels_prior)
    return shares.get("compiled", 0.0) > shares.get("eager", 0.0)


def torchtitan_launch(
    spec: LaunchSpec, *, module: str | None = None, config: str | None = None, csv_path: str = "schedule.csv"
) -> TorchtitanLaunch:
    """torchtitan ≥ 0.3's argv for ``spec`` (one argument per item), and a config module where one is needed.

    ``module``/``config`` name a config function of the user's own (both or neither); otherwise the model
    preset's (:data:`TORCHTITAN_CONFIGS`). The activation-checkpoint subcommand is the last item: torchtitan
    reads options after it as the subcommand's, so overrides of your own go before it.

    Raises:
        LaunchError: no config function for the model, a placement torchtitan cannot run, context parallelism
            over the function's varlen attention, or a precision pipesched cannot write a config function for.
    """
    known = _torchtitan_config(spec, module, config)
    if known.max_seq_len is not None and spec.model.seq_length > known.max_seq_len:
        raise LaunchError(
            f"the plan trains at {spec.model.seq_length} tokens a sequence, but torchtitan builds {known.config}'s "
            f"RoPE for at most {known.max_seq_len} and its trainer refuses a longer training.seq_len: plan again "
            f"with model.seq_length at most {known.max_seq_len}, or name a config function of your own whose model "
            f"is built for the length (--torchtitan-config)"
        )
    if spec.context_parallel > 1 and known.attention == "varlen":
        raise LaunchError(
            f"torchtitan's {known.config} attends with varlen attention, whose context parallelism torchtitan 0.3 "
            f"does not run (apply_cp_to_forward: 'Variable-length attention CP is not yet supported'); this plan has "
            f"context_parallel {spec.context_parallel}: choose a plan with context_parallel 1 (--plan N), plan again "
            f"with search.context_parallel [1], or name a config function of your own whose model attends with "
            f"attn_backend 'flex' (--torchtitan-config)"
        )
    module_name, config_name, source = _config_function(known, spec.precision, spec.model)
    args = ["--module", module_name, "--config", config_name, *_parallelism_args(spec, csv_path)]
    args += [
        "--training.local_batch_size",
        str(spec.local_batch_size),
        "--training.global_batch_size",
        str(spec.global_batch_size),
        "--training.seq_len",
        str(spec.model.seq_length),
    ]
    if spec.layout.pipeline_parallel > 1 or spec.expert_parallel > 1:
        # torchtitan 0.3 refuses CUDA graphs under PP, and under EP with its default all-to-all token dispatcher
        # (a host sync: trainer.py, Config._validate_cuda_graphs)
        args.append("--training.disable_cuda_graphs")
    if torchtitan_compiles(spec):
        args.append("--compile.enable")
        if "model" not in known.compile_components:  # the function compiles its loss only: the plan's model too
            args += ["--compile.components", ",".join(("model", *known.compile_components))]  # tyro: A,B,C
        if spec.async_tensor_parallel and spec.layout.tensor_parallel > 1:  # AsyncTP runs in compiled regions only
            args.append("--compile.enable_async_tensor_parallel")
        elif known.compiles:  # the config function turns AsyncTP on; the plan was timed without it
            args.append("--compile.no_enable_async_tensor_parallel")
    elif known.compiles:  # the config function compiles (and its async TP needs the compiled model): run eager
        args += ["--compile.no_enable", "--compile.no_enable_async_tensor_parallel"]
    args.append(f"{ACTIVATION_CHECKPOINT_PREFIX}{spec.layout.activation_recomputation}")
    return TorchtitanLaunch(args=args, config_source=source)


def _megatron_model_args(model: ModelConfig) -> list[str]:
    args = [
        "--num-layers",
        str(model.num_layers),
        "--hidden-size",
        str(model.hidden_size),
        "--ffn-hidden-size",
        str(model.ffn_size),
        "--num-attention-heads",
        str(model.num_attention_heads),
    ]
    if model.key_value_heads != model.num_attention_heads:
        args += ["--group-query-attention", "--num-query-groups", str(model.key_value_heads)]
    args += ["--seq-length", str(model.seq_length), "--max-position-embeddings", str(model.seq_length)]
    if model.ffn_type == "swiglu":
        args.append("--swiglu")
    if model.norm == "rmsnorm":
        args += ["--normalization", "RMSNorm"]
    if model.position_embedding == "rope":
        args += ["--position-embedding-type", "rope"]
    if not model.tie_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    if not model.bias:
        args.append("--disable-bias-linear")
    return args + _megatron_attention_args(model) + _megatron_expert_args(model)


def _megatron_attention_args(model: ModelConfig) -> list[str]:
    """Per-head sizes Megatron-LM would otherwise take as h / a: multi-head latent attention's ranks and head
    sizes (``--multi-latent-attention``), or ``--kv-channels`` where ``head_dim`` is not h / a (Qwen3: 128)."""
    if model.is_mla:
        args = ["--multi-latent-attention"]
        if model.q_lora_rank is not None:
            args += ["--q-lora-rank", str(model.q_lora_rank)]
        args += ["--kv-lora-rank", str(model.kv_lora_rank)]
        for option, value in (
            ("--qk-head-dim", model.qk_nope_head_dim),
            ("--qk-pos-emb-head-dim", model.qk_rope_head_dim),
            ("--v-head-dim", model.v_head_dim),
        ):
            if value is not None:
                args += [option, str(value)]
        return args
    if model.head_size != model.hidden_size // model.num_attention_heads:
        return ["--kv-channels", str(model.head_size)]
    return []


def _megatron_expert_args(model: ModelConfig) -> list[str]:
    """A mixture-of-experts model's routed experts (``--num-experts``, ``--moe-router-topk``,
    ``--moe-ffn-hidden-size``), shared experts (``--moe-shared-expert-intermediate-size``: their summed width), dense
    first layers (``--moe-layer-freq``) and the all-to-all token dispatcher the plan was timed with (Megatron-LM's
    default is ``allgather``); nothing for a dense model."""
    if not model.is_moe:
        return []
    args = [
        "--num-experts",
        str(model.num_experts),
        "--moe-router-topk",
        str(model.num_experts_per_token),
        "--moe-ffn-hidden-size",
        str(model.expert_ffn_size),
    ]
    if model.num_shared_experts:
        args += ["--moe-shared-expert-intermediate-size", str(model.num_shared_experts * model.expert_ffn_size)]
    if model.first_dense_layers:
        dense, sparse = model.first_dense_layers, model.num_layers - model.first_dense_layers
        args += ["--moe-layer-freq", f"([0]*{dense}+[1]*{sparse})"]
    return [*args, "--moe-token-dispatcher-type", "alltoall"]


def _megatron_pipeline_args(spec: LaunchSpec) -> list[str]:
    if spec.layout.pipeline_parallel == 1:
        return []
    if spec.layout.placement != "loop":
        raise LaunchError(
            f"Megatron-LM places virtual stages in a loop; this plan's placement is {spec.layout.placement!r}: "
            "choose a plan with placement loop (--plan N; the plans' chunks say loop or v), plan again with "
            'search.placement ["loop"] (Megatron\'s layouts only), or --target torchtitan'
        )
    layers = spec.layers_per_stage
    even = layers is None or len(set(layers)) == 1
    if even:
        if spec.layout.stages_per_rank == 1:
            return []
        return ["--num-layers-per-virtual-pipeline-stage", str(spec.model.num_layers // spec.layout.num_stages)]
    assert layers is not None
    stages = [f"t*{count}" if count else "" for count in layers]
    stages[0] = "E" + stages[0]
    stages[-1] += "L"
    return ["--pipeline-model-parallel-layout", "|".join(stages)]


def _megatron_recompute_args(mode: str) -> list[str]:
    if mode == "full":
        return ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    if mode == "selective":
        return ["--recompute-granularity", "selective"]
    return []


def megatron_args(spec: LaunchSpec) -> list[str]:
    """Megatron-LM's ``pretrain_gpt.py`` argv for ``spec``: model shape, parallel degrees, batch, recomputation,
    precision. Megatron runs its own 1F1B (interleaved with virtual stages) rather than the plan's CSV; an
    uneven layer partition becomes ``--pipeline-model-parallel-layout``.

    Raises:
        LaunchError: a placement Megatron-LM cannot run (V, bidirectional).
    """
    args = _megatron_model_args(spec.model)
    args += ["--tensor-model-parallel-size", str(spec.layout.tensor_parallel)]
    if spec.layout.tensor_parallel > 1 and spec.sequence_parallel:
        args.append("--sequence-parallel")
        if spec.async_tensor_parallel:  # Transformer Engine's userbuffers overlap (needs sequence parallelism)
            args.append("--tp-comm-overlap")
    args += ["--pipeline-model-parallel-size", str(spec.layout.pipeline_parallel), *_megatron_pipeline_args(spec)]
    if spec.context_parallel > 1:
        args += ["--context-parallel-size", str(spec.context_parallel)]
    if spec.expert_parallel > 1:  # stated: Megatron-LM's default expert tensor degree is the tensor degree
        args += ["--expert-model-parallel-size", str(spec.expert_parallel)]
        args += ["--expert-tensor-parallel-size", str(spec.expert_tensor_parallel)]
    args += [
        "--micro-batch-size",
        str(spec.layout.micro_batch_size),
        "--global-batch-size",
        str(spec.global_batch_size),
    ]
    args += _megatron_recompute_args(spec.layout.activation_recomputation)
    if spec.layout.sharding == "full":
        args += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]
    elif spec.layout.sharding in ("optimizer", "gradients"):
        args.append("--use-distributed-optimizer")
    args.append("--bf16")
    if spec.precision == "fp8":
        args += ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]
    return args


def torchrun_command(spec: LaunchSpec, entry: list[str]) -> str:
    """One shell line: torchrun over the plan's nodes and GPUs with a c10d rendezvous at ``$MASTER_ADDR``,
    running ``entry`` (e.g. ``["-m", "torchtitan.train", *args]``)."""
    head = [
        "torchrun",
        "--nnodes",
        str(spec.num_nodes),
        "--nproc-per-node",
        str(spec.gpus_per_node),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
    ]
    return " ".join([*map(shlex.quote, head), '"$MASTER_ADDR:29500"', *map(shlex.quote, entry)])
