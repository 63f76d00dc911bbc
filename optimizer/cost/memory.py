"""Activation bytes of one decoder layer and static bytes per parameter.

**Activations** (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
§4.1, 16-bit elements, one microbatch of s·b tokens): attention 11·sbh + 5·a·s²·b, MLP 19·sbh, two norms 4·sbh:
s·b·h·(34 + 5as/h). Generalised term by term to a key/value width k and an FFN of size f:

- attention: norm output / QKV input 2h, Q 2h, K and V 2k each, the output projection's input 2h, the dropout
  mask h → 7h + 4k (11h at k = h), plus the scores: softmax 2as, its dropout mask as, dropout output 2as per
  token (5as), stored by eager attention only. FlashAttention (Dao et al. 2022) stores the softmax statistics,
  4·a bytes (fp32) per token, instead.
- MLP: its input 2h and the dropout mask h, plus GeLU: the first matrix's output 2f and GeLU's output 2f (19h at
  f = 4h); SwiGLU: gate and up outputs 2f each, SiLU's output 2f and the product 2f (8f).
- norms: their two inputs, 4h.

With tensor parallelism t and sequence parallelism (§4.2.2) every term divides by t; without sequence
parallelism the norms' inputs 4h, the attention and MLP inputs 2h + 2h and the two dropout masks 2h (10·sbh)
stay whole (§4.2.1: sbh·(10 + 24/t + 5as/(ht))). Selective recomputation (§5) drops the 5as score term; full
recomputation keeps each layer's input only (2·sbh/t with sequence parallelism). Under FlashAttention, which
stores no scores, ``selective`` is torchtitan's op-level policy instead (``activation_checkpoint.mode =
"selective"``, ``selective_ac_option = "op"``: keep the attention output and every other matrix-multiply
output, recompute the rest): per token the layer input 2h, the attention output 2h and half of the seven
matrix-multiply outputs Q h, K k, V k, output h, FFN f (and f for SwiGLU's up), down h: 2h + 2h + (3h + 2k +
f·(1 or 2)) bytes, split by t like the rest. On a mixture-of-experts model ``selective`` is Megatron-Core's
fine-grained recipe (norms, activation functions and MLA's up-projections recomputed:
:func:`megatron_selective_bytes`), the one its MoE configurations run.

**Expert tensor parallelism** (e_t GPUs splitting each routed expert, Megatron-Core's
``--expert-tensor-parallel-size``; ``megatron/core/transformer/moe/token_dispatcher.py`` at core_v0.10.0,
7ee599a, and at d98e8a6, 2026-08-22): a GPU's own s·b/(c·t) tokens times k·imbalance copies are R dispatched rows,
and every dispatcher gives its experts e_t·R rows of full width h. ``alltoall`` (``MoEAlltoAllTokenDispatcher``)
receives R rows over the expert-parallel group, then ``gather_from_sequence_parallel_region`` over the e_t GPUs of
its expert shards; ``allgather`` (``MoEAllGatherTokenDispatcher``) gathers all e_t·ep GPUs' tokens over the
tensor-and-expert group into the global memory buffer and permutes out the e_t·R rows of its local experts (that
buffer, ``GlobalMemoryBuffer`` "mpu" in ``megatron/core/utils.py`` at d98e8a6, is kept for the whole run at the
largest size asked, s·b/(c·t)·e_t·ep rows of 2h bytes, so it is live at every peak; not counted here: no plan runs
this dispatcher, ``software.moe_dispatcher`` times the ``alltoall`` and ``flex`` ones and Megatron launches write
``alltoall``; ``bench/results/memory_interval.md`` gives its size on the check rows' layouts); ``flex`` (DeepEP,
``MoEFlexTokenDispatcher``) routes each token to e_t·k expert shards over the same group (``router_topk = tp_size ·
moe_router_topk``). The first expert matrix
saves that input for its backward, so the permuted input held per routed copy is 2h·e_t bytes per token (split by
t like the rest) where e_t = 1 holds 2h; the expert matrices' outputs are e_t times the rows at 1/e_t of the width,
as many bytes as with e_t = 1. W needs that input too. Full recomputation keeps the layer's input only, so the
gathered tokens live in its I only; Megatron's selective recipe recomputes norms and activation functions, not
this input, so they stay held. With ep = 1 the experts are split like a dense FFN (e_t = t) and the same holds
(each GPU computes every routed row of the t GPUs' tokens at 1/t of the width).

Bytes still needed by the weight gradient W after I (Zero Bubble paper, Table 1, M_W = 32·sbh at f = 4h):
the linear layers' inputs and output gradients, 2 bytes each: 12h + 4k + 4f (GeLU) or 12h + 4k + 6f (SwiGLU).

**Static bytes per parameter** (Rajbhandari et al. 2020, ZeRO, §3.1 and §5), mixed precision with Adam: 2 B
16-bit weights, 4 B fp32 gradients (reduced in fp32; 2 B where the reduction runs in bf16, as Megatron-Core keeps
its gradient buffer in the reduction's dtype), 12 B fp32 master weights and two moments. ZeRO-1
(``optimizer``) divides the 12 by the data-parallel size d, ZeRO-2 (``gradients``) the 4 + 12. fp32 training:
4 + 4 + 8. Fully sharded (``full``), every byte a rank keeps is divided by d, the gathered 16-bit weights a rank
holds while it computes counted by the caller; what is kept depends on the stack (:data:`FULL_SHARDING_STATES`):

- ``zero3``: 2 + g + 12 (g the gradient buffer's bytes, the reduction's dtype). ZeRO-3 as the paper counts it,
  (2 + 2 + K)·Ψ/N_d with K = 12 (§3.1, §5.3; DeepSpeed); Megatron-FSDP's ``optim_grads_params``, the FSDP of
  Megatron-LM and Megatron Bridge, shards a 16-bit ``model_weight_buffer``, an fp32 ``main_weight_buffer``
  (``preserve_fp32_weights``) and a ``main_grad_buffer`` in fp32 with ``grad_reduce_in_fp32``, else in the
  parameters' dtype, plus the two fp32 Adam moments: 2 + 4 + g + 8
  (``megatron/core/distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py``,
  ``_init_each_parameter_group_buffers``, Megatron-LM core_v0.14.0).
- ``fp32_parameters``: 4 + 4 + 8. PyTorch FSDP over a model built in fp32 with a 16-bit compute dtype (FSDP2's
  ``MixedPrecisionPolicy(param_dtype=bf16)``, FSDP1's ``MixedPrecision``): the sharded parameter keeps the model's
  fp32 and is the master weight the optimizer steps on; the sharded gradient is cast back to the parameter's
  dtype after the reduce-scatter whatever ``reduce_dtype`` is (FSDP2: ``init_dtype_attrs`` sets ``orig_dtype``
  from the sharded parameter, ``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``; ``foreach_reduce`` casts
  the reduced shard to it, ``_fsdp_collectives.py``, pytorch 010ae4a; FSDP1: ``_cast_grad_to_param_dtype``); Adam's
  two moments take the parameter's dtype. No separate 16-bit copy is kept: the 16-bit weights exist gathered only
  (``tests/runtime/test_fsdp_static_bytes.py`` counts them on a real FSDP2 step). torchtitan (the model built on
  the meta device in fp32, ``apply_fsdp`` with ``mixed_precision_param`` bf16,
  ``torchtitan/models/llama3/infra/parallelize.py`` at 81c1243), llm-foundry's Composer FSDP1.
- ``bf16_parameters``: 2 + 2 + 4. PyTorch FSDP over a model built in bf16: the sharded parameter, its gradient
  (cast back to the parameter's dtype) and ``torch.optim.Adam``'s moments (``zeros_like`` the parameter) are all
  bf16, no fp32 master. NeMo AutoModel's mixture-of-experts models (Qwen3-MoE, GPT-OSS, DeepSeek-V3) build their
  layers in bf16 (``BackendConfig`` linear and norm ``dtype=torch.bfloat16``, ``MoEConfig.dtype``) and
  ``initialize_weights`` ends with ``self.to(torch.bfloat16)``; the benchmark configs step ``torch.optim.Adam``
  (``nemo_automodel/components/models/qwen3_moe/model.py``, ``examples/benchmark/configs/*_te_deepep.yaml`` at
  01926a5c).

**The loss's logits** (s·b·V/t elements on the last stage, :func:`cross_entropy_bytes`): bytes per logit element
held from the loss's forward to its backward, and the most its passes allocate and free on top (a transient the
per-layer count does not hold), by how the framework computes the cross-entropy:

- ``fp32`` (PyTorch's ``F.cross_entropy`` on ``logits.float()``: torchtitan, ``cross_entropy_loss``,
  ``torchtitan/components/loss.py``; eager and compiled plans): log-softmax's fp32 output is saved (4); its
  backward holds that, the fp32 gradient of its output and of its input at once (4 + 4 + 4): transient 8.
- ``vocab_parallel`` (Megatron-Core's ``vocab_parallel_cross_entropy``, ``tensor_parallel/cross_entropy.py``: the
  logits cast to fp32, the softmax computed in place and saved, its gradient written over it: fused plans): 4
  held; the bf16 logits beside their fp32 copy in the forward, the gradient cast back to bf16 in the backward:
  transient 2.
- ``fused`` (flash-attn's ``CrossEntropyLoss``, llm-foundry's default ``loss_fn: fused_crossentropy``,
  ``llmfoundry/models/mpt/modeling_mpt.py``): the bf16 logits saved (2), fp32 only per row; its backward
  allocates their bf16 gradient (2): transient 2.
- ``compiled`` (torchtitan's same ``cross_entropy_loss`` under ``torch.compile``, as a compiled torchtitan run
  compiles it: ``build_cross_entropy_loss`` with ``--training.compile`` from April 2025, PR #1033, commit bbb1b61,
  through v0.1.0; ``--compile.components`` ``["model", "loss"]`` by default from v0.2.0): Inductor's partitioner
  saves the bf16 logits and two fp32 numbers a row (the maximum and the sum of exponentials) and recomputes the
  fp32 log-softmax inside the backward's one kernel, which writes the logits' bf16 gradient: 2 held, transient 2
  (``tests/runtime/test_compiled_loss_bytes.py`` counts the saved bytes on torch's own ``torch.compile``).
  torchtitan 9dec370 (Dec 2024) left the loss eager (``train.py``: "compiling loss function causes CUDA errors,
  turning off for now", commit e8977b0), so its compiled runs are ``fp32``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipesched.optimizer.configs import ModelConfig
from pipesched.optimizer.cost.flops import attention_core_width

__all__ = [
    "CROSS_ENTROPY_BYTES",
    "FULL_SHARDING_STATES",
    "LayerActivation",
    "SelectiveBytes",
    "cross_entropy_bytes",
    "layer_activation",
    "megatron_selective_bytes",
    "static_bytes_per_parameter_sharded",
]


#: Cross-entropy implementation → (bytes per logit element held until the backward, the most a pass adds on top):
#: the module docstring, "The loss's logits".
CROSS_ENTROPY_BYTES: dict[str, tuple[float, float]] = {
    "fp32": (4.0, 8.0),
    "vocab_parallel": (4.0, 2.0),
    "fused": (2.0, 2.0),
    "compiled": (2.0, 2.0),
}


#: How a stack keeps fully sharded (``full``) state → bytes per parameter of (weights, gradients, Adam state),
#: each divided by the data-parallel size; gradients ``None``: the reduction's dtype (``gradient_bytes``). The module
#: docstring, "Static bytes per parameter", gives each layout's source.
FULL_SHARDING_STATES: dict[str, tuple[float, float | None, float]] = {
    "zero3": (2.0, None, 12.0),
    "fp32_parameters": (4.0, 4.0, 8.0),
    "bf16_parameters": (2.0, 2.0, 4.0),
}


def cross_entropy_bytes(implementation: str) -> tuple[float, float]:
    """(held, transient) bytes per logit element of the cross-entropy ``implementation`` (module docstring).

    Raises:
        KeyError: an implementation not in :data:`CROSS_ENTROPY_BYTES`.
    """
    return CROSS_ENTROPY_BYTES[implementation]


@dataclass(frozen=True)
class LayerActivation:
    """Bytes of one layer for one microbatch on one tensor-parallel rank.

    Attributes:
        activation: allocated by F and held until the backward (after recomputation choices).
        retained: the part of it W still needs after I.
        scores: the eager attention's 5as²b bytes inside ``activation`` before recomputation (0 for flash).
        full: what F allocates with no recomputation (the transient peak of a recomputed layer).
    """

    activation: float
    retained: float
    scores: float
    full: float


def _attention_widths(model: ModelConfig) -> tuple[float, float, float]:
    """Per token, in 16-bit bytes: (attention activations split by t, those W still needs, the matrix-multiply
    outputs torchtitan's selective policy keeps). Standard attention: Q 2q, K and V 2k each, the projection's
    input 2q (4h + 4k at q = h); W needs the inputs and output gradients 8h + 4k. Multi-head latent
    attention adds its latents (query 2·r_q, key/value 2·(r_kv + d_rope), each normalised: twice)."""
    h = model.hidden_size
    query_key, value = attention_core_width(model)
    if model.is_mla:
        latents = 4 * (model.q_lora_rank or 0) + 4 * (model.kv_lora_rank or 0) + 2 * (model.qk_rope_head_dim or 0)
        stored = 2 * query_key + 2 * query_key + 2 * value + 2 * value + latents
        retained = 4 * h + 2 * (2 * query_key + value) + 2 * value + latents
        kept = 2 * query_key + value + h + latents / 2
        return stored, retained, kept
    k = model.head_size * model.key_value_heads
    stored = 2 * query_key + 4 * k + 2 * value
    retained = 4 * h + 2 * (query_key + 2 * k) + 2 * value
    return stored, retained, query_key + 2 * k + h


def _mlp_widths(model: ModelConfig, moe: bool, expert_tensor_parallel: int = 1) -> tuple[float, float, float]:
    """Per token, in 16-bit bytes: (FFN activations split by t, those W still needs, the matrix-multiply
    outputs the selective policy keeps). Dense GeLU 4f (W: 4h + 4f), SwiGLU 8f (W: 4h + 6f). A
    mixture-of-experts layer stores what Megatron-Core's grouped MLP keeps (the router's probabilities folded
    into the activation function, so unpermuting the outputs keeps nothing; SwiGLU fused, its gate and up
    outputs kept and SiLU rerun in the backward): for each of its k·imbalance routed copies the permuted input
    2h·e_t (the e_t-gathered dispatched tokens: module docstring, "Expert tensor parallelism"), the first
    matrix's output (SwiGLU 4f, GeLU 2f) and the activation's output 2f; for each shared expert the inner ones;
    the router's fp32 logits and probabilities (8·E bytes). W needs each expert matrix's input and output
    gradient (2h·e_t + 2f per copy). Selective recomputation on a mixture-of-experts model is Megatron's recipe
    (:func:`megatron_selective_bytes`)."""
    h, gelu = model.hidden_size, model.ffn_type == "gelu"
    if not (moe and model.is_moe):
        f = model.ffn_size
        return (4 * f if gelu else 8 * f), 4 * h + (4 * f if gelu else 6 * f), (f if gelu else 2 * f) + h
    f = model.expert_ffn_size
    routed = (model.num_experts_per_token or 1) * model.moe_load_imbalance
    shared = model.num_shared_experts
    inner = 4 * f if gelu else 6 * f
    router = 8 * (model.num_experts or 0)
    gathered = 2 * h * expert_tensor_parallel  # the experts' input: e_t GPUs' dispatched tokens, whole width
    stored = routed * (gathered + inner) + shared * inner + router
    retained = routed * (gathered + 2 * f) + shared * (2 * h + 2 * f) + router
    return stored, retained, stored


@dataclass(frozen=True)
class SelectiveBytes:
    """Per token, 16-bit bytes Megatron's MoE recipe recomputes (:func:`megatron_selective_bytes`).

    Attributes:
        norm_outputs: the two norms' outputs (the attention's and the MLP's inputs), whole without sequence
            parallelism.
        inner: the activation functions' outputs and multi-head latent attention's up-projected queries, keys
            and values, split by t.
    """

    norm_outputs: float
    inner: float


def megatron_selective_bytes(model: ModelConfig, moe: bool) -> SelectiveBytes:
    """What ``selective`` drops on a mixture-of-experts model, Megatron-Core's fine-grained recipe
    (``--recompute-granularity selective --recompute-modules layernorm moe_act`` plus ``mla_up_proj`` with
    multi-head latent attention; the Megatron MoE Model Zoo's and Megatron Bridge's MoE configurations): the
    norms' outputs 4h, the activation's output 2f of each of the k·imbalance routed and the shared experts (a
    dense layer: SiLU's output and the product 4f, GeLU's output 2f), and MLA's up-projected Q, K and V
    (4·a·(d_nope + d_rope) + 2·a·d_v)."""
    h = model.hidden_size
    if moe:  # the activation's output of each expert (its first matrix's output stays: _mlp_widths)
        copies = (model.num_experts_per_token or 1) * model.moe_load_imbalance + model.num_shared_experts
        inner = 2 * copies * model.expert_ffn_size
    else:  # a dense layer's FFN: SiLU's output and the product (SwiGLU), GeLU's output
        inner = (4 if model.ffn_type == "swiglu" else 2) * model.ffn_size
    if model.is_mla:
        query_key, value = attention_core_width(model)
        inner += 4 * query_key + 2 * value
    return SelectiveBytes(norm_outputs=4.0 * h, inner=float(inner))


def _fused_savings(model: ModelConfig, moe: bool) -> tuple[float, float]:
    """Per token, the 16-bit bytes a dense layer does not store with hand-fused kernels (Megatron-Core with
    Transformer Engine), as (whole, split by t) of the module docstring's terms. Stored bytes only: what the kernels
    read and write (the elementwise traffic) stays the layer's ``full``.

    - SwiGLU: Megatron-Core's ``bias_swiglu_impl`` (``megatron/core/fusions/fused_bias_swiglu.py``,
      ``SwiGLUFunction``) saves only its input, the gate and up outputs, and reruns SiLU in its backward: of eager
      PyTorch's gate, up, SiLU output and product (8f) it keeps 4f + the product 2f, 2f less.
    - FP8: Transformer Engine's ``Linear`` and ``LayerNormLinear`` save their input as the FP8 copy the forward's
      GEMM used (``transformer_engine/pytorch/module/linear.py``: ``saved_inputmat``/``saved_inputmat_t``), 1 byte
      an element: the two norms' outputs (the QKV and first MLP inputs, h less each), the projection's input and
      the second MLP matrix's input (half of each).
    """
    if model.kernels != "fused" or (moe and model.is_moe):
        return 0.0, 0.0
    whole, split = 0.0, 0.0
    if model.ffn_type == "swiglu":
        split += 2.0 * model.ffn_size
    if model.precision == "fp8":
        _, value = attention_core_width(model)
        whole += 2.0 * model.hidden_size
        split += value + model.ffn_size
    return whole, split


def layer_activation(
    model: ModelConfig,
    tensor_parallel: int = 1,
    sequence_parallel: bool = True,
    *,
    moe: bool = False,
    context_parallel: int = 1,
    expert_tensor_parallel: int = 1,
) -> LayerActivation:
    """The module docstring's per-layer activation bytes for ``model`` (its recomputation and attention) on one
    of ``tensor_parallel`` × ``context_parallel`` ranks (context parallelism shards the sequence, so every term
    divides by it; Korthikanti et al.'s terms stay per tensor-parallel rank); ``moe``: a mixture-of-experts
    layer (:func:`_mlp_widths`) whose experts are split over ``expert_tensor_parallel`` GPUs (e_t, the resolved
    degree: :func:`pipesched.optimizer.cost.experts.expert_tensor_degree`), which hold the e_t-gathered
    dispatched tokens (module docstring, "Expert tensor parallelism")."""
    s, b, h, a = model.seq_length, model.micro_batch_size, model.hidden_size, model.num_attention_heads
    t = tensor_parallel
    c = context_parallel
    scale = model.dtype_bytes / 2
    tokens = s * b / c
    attention_stored, attention_retained, attention_kept = _attention_widths(model)
    mlp_stored, mlp_retained, mlp_kept = _mlp_widths(model, moe, expert_tensor_parallel)
    split = (attention_stored + mlp_stored) * tokens  # Q, K, V, projection input, FFN inner activations
    whole = 10 * h * tokens  # norm inputs 4h, attention/MLP inputs 4h, dropout masks 2h
    if model.attention == "eager":
        scores = 5.0 * a * s * s * b / c
        statistics = 0.0
    else:
        scores = 0.0
        statistics = 4 * a * tokens / scale  # fp32, not scaled by the 16-bit factor
    if sequence_parallel or t == 1:
        full = (split + whole + scores + statistics) / t
    else:
        full = whole + (split + scores + statistics) / t
    full *= scale
    retained = (attention_retained + mlp_retained) * tokens * scale / t
    scores_bytes = scores * scale / t
    recompute = model.activation_recomputation
    whole_saving, split_saving = _fused_savings(model, moe)
    if sequence_parallel or t == 1:
        full_stored = full - (whole_saving + split_saving) * tokens * scale / t
    else:
        full_stored = full - (whole_saving + split_saving / t) * tokens * scale
    if recompute == "none":
        activation = full_stored
    elif recompute == "selective" and model.is_moe:
        dropped = megatron_selective_bytes(model, moe)
        norms = dropped.norm_outputs * tokens
        inner = dropped.inner * tokens
        dropped_bytes = (norms + inner) / t if (sequence_parallel or t == 1) else norms + inner / t
        activation = full - dropped_bytes * scale
    elif recompute == "selective" and model.attention == "flash":
        saved = (4 * h + attention_kept + mlp_kept) * tokens * scale + statistics * scale
        activation = min(full, saved / t if (sequence_parallel or t == 1) else saved)
    elif recompute == "selective":
        activation = full_stored - scores_bytes
    else:
        layer_input = tokens * h * model.dtype_bytes
        activation = layer_input / t if (sequence_parallel or t == 1) else layer_input
        retained = activation
    return LayerActivation(activation=activation, retained=min(retained, activation), scores=scores_bytes, full=full)


def static_bytes_per_parameter_sharded(
    model: ModelConfig,
    sharding: str,
    data_parallel_size: int,
    *,
    gradient_bytes: float = 4.0,
    full_state: str = "zero3",
) -> float:
    """Bytes per parameter of weights, gradients and Adam state under ``sharding`` (module docstring).

    ``sharding``: ``none`` / ``optimizer`` / ``gradients`` / ``full`` (contract, Terms: data-parallel group);
    ``full`` returns the sharded bytes only (the caller adds the gathered 16-bit weights), as the stack keeps them:
    ``full_state``, a key of :data:`FULL_SHARDING_STATES`. ``gradient_bytes``: the gradient buffer's bytes per
    element, the reduction's dtype (Megatron-Core's DDP keeps its ``main_grad`` buffer in fp32 with
    ``grad_reduce_in_fp32``, otherwise in the parameters' 16-bit dtype: 2); PyTorch FSDP's sharded gradient takes
    its parameter's dtype instead.
    """
    if full_state not in FULL_SHARDING_STATES:
        raise ValueError(f"full_state {full_state!r}: use one of {', '.join(FULL_SHARDING_STATES)}")
    if model.dtype == "fp32":
        weights, gradients, optimizer = 4.0, 4.0, 8.0
    elif sharding == "full":
        weights, kept_gradients, optimizer = FULL_SHARDING_STATES[full_state]
        gradients = gradient_bytes if kept_gradients is None else kept_gradients
    else:
        weights, gradients, optimizer = float(model.dtype_bytes), gradient_bytes, 12.0
    d = float(data_parallel_size)
    if sharding == "optimizer":
        optimizer /= d
    elif sharding == "gradients":
        gradients, optimizer = gradients / d, optimizer / d
    elif sharding == "full":
        weights, gradients, optimizer = weights / d, gradients / d, optimizer / d
    return weights + gradients + optimizer
