"""Time of each kind of work on an accelerator, from its datasheet and its profile (:mod:`.profile`).

- **Matrix multiplies** of shape (M, N, K): 2MNK / (peak · e) · (1 + d½ · (1/M + 1/N + 1/K)), peak and e the
  bf16 (or FP8) dense peak and efficiency; d½ doubles at FP8 (same bytes per element, twice the FLOP/s; the
  roofline, Williams et al. 2009). In one decoder layer on one of t tensor-parallel ranks, forward, over the
  s·b tokens of a microbatch (all of them with sequence parallelism, gathered first): Q/K/V (s·b, (h + 2k)/t,
  h), output (s·b, h, h/t), FFN in (s·b, g·f/t, h) with g = 2 for SwiGLU (gate and up), FFN out (s·b, h, f/t).
  The input-gradient (I) and weight-gradient (W) passes run the same three-dimensional products with the
  dimensions permuted, so each costs what the forward's does (Narayanan et al. 2021, §3.5: backward = 2 ×
  forward). Queries are a·d wide and keys/values n_kv·d (``head_dim``); multi-head latent attention runs its
  compressions and expansions instead (:mod:`.flops`). Context parallelism c leaves s·b/c tokens to a rank. A
  mixture-of-experts layer runs, besides the shared experts (dense-like, split t ways) and the router
  (s·b, E, h), each of its local experts as its own product (the grouped GEMM of Megatron's and torchtitan's
  MoE layers): with expert parallelism ep > 1 the E/ep whole experts of a rank share the k·imbalance copies of
  its s·b/(c·t) tokens, each expert M = s·b·k·imbalance·ep/(c·t·E) rows; without it every expert is split t
  ways and gets M = s·b·k·imbalance/(c·E). Small M is where fine-grained experts lose speed (the d½ term).
- **FlashAttention** at ``attention_efficiency`` of the bf16 peak (its FLOPs from :mod:`.flops`), in bf16 also
  under FP8 (torchao's Float8Linear and Transformer Engine convert the linear layers only). The efficiency is
  fitted on heads of 128 (nearly every calibration row); other head sizes scale it by
  :func:`attention_head_size_factor`: each score costs its products, 2·(d_qk + d_v) FLOPs forward and
  2·(3·d_qk + 2·d_v) backward (Q·Kᵀ recomputed; dV, dP, dQ, dK: Dao 2023, FlashAttention-2, Alg. 2), plus one
  exponential on the special-function units (forward; the backward recomputes P = exp(S − L)), which run far
  slower than the tensor cores (the accelerator's ``flops_per_exponential``: 989 TFLOPS of matmul beside 3.9
  TFLOPS of exponentials on the H100 SXM, Shah et al. 2024, FlashAttention-3). A score's time is then
  products / peak + 1 / exponential rate, so a head of 64 runs further from peak than one of 128, and one of
  192 closer.
- **Elementwise work** (norms, activations, RoPE, residuals, dropout): ``traffic`` bytes at ``memory_efficiency``
  of the HBM bandwidth, scaled by the software's ``elementwise_traffic`` for the kernels mode.
- **FP8 casts** (torchao Float8 tensorwise / Transformer Engine current scaling): every FP8 operand is cast from
  bf16 once per use: forward the input and the weight, I the output gradient and the weight, W the input and the
  output gradient; ``fp8_cast_bytes_per_element`` per element at HBM speed.
- **Kernel launches**: a pass takes at least kernels × CPU µs per kernel (eager dispatch can starve the GPU on
  small layers; ``kernels_per_layer`` and ``cpu_us_per_kernel`` by kernels mode).
- **Collectives**: the cluster's nominal per-GPU links times the profile's ``collective_efficiency_*`` are the
  achieved NCCL bus bandwidths the ring formulas of :mod:`pipesched.optimizer.cost.collectives` use.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipesched.optimizer.configs import ModelConfig
from pipesched.optimizer.cost.experts import expert_tensor_degree
from pipesched.optimizer.cost.flops import attention_core_width
from pipesched.optimizer.cost.profile import AcceleratorProfile, SoftwareProfile

__all__ = [
    "FITTED_HEAD_SIZE",
    "Hardware",
    "PassTimes",
    "attention_head_size_factor",
    "elementwise_ms",
    "expert_gemms",
    "gemm_ms",
    "gemms_ms",
    "layer_gemm_times",
    "layer_gemms",
]


@dataclass(frozen=True)
class Hardware:
    """Resolved accelerator figures: memory (bytes), dense peaks (FLOP/s), memory bandwidth (bytes/s), the profile.

    ``efficiency`` is the large matrix multiply's fraction of the bf16 peak (the profile's ``gemm_efficiency``,
    or ``cluster.efficiency`` when given). ``fp8_flops_per_s`` is None for accelerators without FP8 tensor cores.
    ``flops_per_exponential``: the catalogue's bf16 FLOPs per special-function exponential (None: not stated).
    """

    name: str
    memory_bytes: float
    flops_per_s: float
    memory_bandwidth_bytes_per_s: float
    efficiency: float
    fp8_flops_per_s: float | None = None
    profile: AcceleratorProfile = field(default_factory=lambda: AcceleratorProfile(name="explicit"))
    software: SoftwareProfile = field(default_factory=SoftwareProfile)
    flops_per_exponential: float | None = None

    @property
    def effective_flops_per_s(self) -> float:
        """FLOP/s the large bf16 matrix multiplies achieve: peak × efficiency."""
        return self.flops_per_s * self.efficiency

    def peak(self, precision: str) -> tuple[float, float]:
        """(dense peak FLOP/s, efficiency) of matrix multiplies in ``precision`` (``bf16`` or ``fp8``)."""
        if precision == "fp8" and self.fp8_flops_per_s is not None:
            return self.fp8_flops_per_s, self.profile.fp8_gemm_efficiency
        return self.flops_per_s, self.efficiency


@dataclass(frozen=True)
class PassTimes:
    """One pass's matrix-multiply, attention, elementwise and FP8-cast time (ms), and its kernel count."""

    gemm_ms: float = 0.0
    attention_ms: float = 0.0
    elementwise_ms: float = 0.0
    cast_ms: float = 0.0
    kernels: float = 0.0

    def total_ms(self, hardware: Hardware, kernels_mode: str) -> float:
        """GPU time, or the CPU's launch time when that is longer."""
        gpu = self.gemm_ms + self.attention_ms + self.elementwise_ms + self.cast_ms
        cpu = self.kernels * hardware.software.cpu_us_per_kernel[kernels_mode] / 1e3
        return max(gpu, cpu)


def gemm_ms(m: float, n: float, k: float, hardware: Hardware, precision: str = "bf16") -> float:
    """One (m, n, k) matrix multiply, ms (module docstring)."""
    peak, efficiency = hardware.peak(precision)
    half = hardware.profile.gemm_shape_dimension * (2.0 if precision == "fp8" and hardware.fp8_flops_per_s else 1.0)
    return 1e3 * 2 * m * n * k / (peak * efficiency) * (1 + half * (1 / m + 1 / n + 1 / k))


#: The head size the fitted ``attention_efficiency`` stands for (the calibration rows' heads: module docstring).
FITTED_HEAD_SIZE = 128


def _score_cost(d_qk: float, d_v: float, flops_per_exponential: float, backward: bool) -> float:
    """One attention score's cost in tensor-core FLOPs: its products plus one exponential (``flops_per_exponential``
    FLOPs' worth of time)."""
    products = 2 * (3 * d_qk + 2 * d_v) if backward else 2 * (d_qk + d_v)
    return products + flops_per_exponential


def attention_head_size_factor(model: ModelConfig, hardware: Hardware, *, backward: bool = False) -> float:
    """FlashAttention's time per FLOP for the model's heads over that of heads of :data:`FITTED_HEAD_SIZE`
    (module docstring); 1.0 where the accelerator's ``flops_per_exponential`` is not stated.

    Per score: (products(d) + r) / products(d) against the same at d = 128, r the FLOPs per exponential, d_qk and
    d_v the query/key and value head sizes (multi-head latent attention: d_nope + d_rope and d_v).
    """
    ratio = hardware.flops_per_exponential
    if ratio is None:
        return 1.0
    width_qk, width_v = attention_core_width(model)
    heads = model.num_attention_heads
    d_qk, d_v = width_qk / heads, width_v / heads
    fitted = FITTED_HEAD_SIZE
    own = _score_cost(d_qk, d_v, ratio, backward) / _score_cost(d_qk, d_v, 0.0, backward)
    reference = _score_cost(fitted, fitted, ratio, backward) / _score_cost(fitted, fitted, 0.0, backward)
    return own / reference


def elementwise_ms(traffic_bytes: float, hardware: Hardware) -> float:
    """Memory-bound work moving ``traffic_bytes``, ms."""
    return 1e3 * traffic_bytes / (hardware.memory_bandwidth_bytes_per_s * hardware.profile.memory_efficiency)


def _attention_gemms(model: ModelConfig, tokens: float, t: int) -> list[tuple[float, float, float]]:
    h = model.hidden_size
    if model.is_mla:
        a = model.num_attention_heads
        nope, rope, value = model.qk_nope_head_dim or 0, model.qk_rope_head_dim or 0, model.v_head_dim or 0
        kv_rank = model.kv_lora_rank or 0
        shapes = [(tokens, (kv_rank + rope), h), (tokens, a * (nope + value) / t, kv_rank), (tokens, h, a * value / t)]
        if model.q_lora_rank is None:
            return [(tokens, a * (nope + rope) / t, h), *shapes]
        return [(tokens, model.q_lora_rank, h), (tokens, a * (nope + rope) / t, model.q_lora_rank), *shapes]
    q = model.head_size * model.num_attention_heads
    k = model.head_size * model.key_value_heads
    return [(tokens, (q + 2 * k) / t, h), (tokens, h, q / t)]


def expert_gemms(
    model: ModelConfig, tokens: float, t: int, expert_parallel: int = 1, expert_tensor_parallel: int | None = None
) -> list[tuple[float, float, float]]:
    """A mixture-of-experts layer's forward products on one rank over ``tokens`` (its s·b/c): the local routed
    experts one by one, the shared experts and the router (module docstring).

    Each of the E/ep local experts sees e_t·ep·k·tokens/(t·E) rows (the s·b/(c·t) tokens each of the ep·e_t GPUs
    dispatches, gathered over the e_t GPUs of its shards; :mod:`pipesched.optimizer.cost.experts`) and is 1/e_t of
    its width; e_t unset is 1 when ep > 1, t otherwise (so ep = 1 gives k·tokens/E rows at width f/t)."""
    h, f = model.hidden_size, model.expert_ffn_size
    gates = 2 if model.ffn_type == "swiglu" else 1
    experts = model.num_experts or 1
    copies = tokens * (model.num_experts_per_token or 1) * model.moe_load_imbalance
    split = expert_tensor_degree(t, expert_parallel, expert_tensor_parallel)
    rows, local = copies / t * split * expert_parallel / experts, experts // expert_parallel
    shapes = [(rows, gates * f / split, h), (rows, h, f / split)] * local
    if model.num_shared_experts:
        shared = model.num_shared_experts * f
        shapes += [(tokens, gates * shared / t, h), (tokens, h, shared / t)]
    return [*shapes, (tokens, experts, h)]


def layer_gemms(
    model: ModelConfig,
    tensor_parallel: int = 1,
    *,
    moe: bool = False,
    context_parallel: int = 1,
    expert_parallel: int = 1,
    expert_tensor_parallel: int | None = None,
) -> list[tuple[float, float, float]]:
    """The forward's (M, N, K) matrix multiplies of one layer on one tensor-parallel rank (module docstring;
    ``expert_tensor_parallel``: :func:`expert_gemms`)."""
    tokens = float(model.seq_length * model.micro_batch_size) / context_parallel
    t = tensor_parallel
    shapes = _attention_gemms(model, tokens, t)
    if moe and model.is_moe:
        return shapes + expert_gemms(model, tokens, t, expert_parallel, expert_tensor_parallel)
    h, f = model.hidden_size, model.ffn_size
    gates = 2 if model.ffn_type == "swiglu" else 1
    return [*shapes, (tokens, gates * f / t, h), (tokens, h, f / t)]


def gemms_ms(shapes: list[tuple[float, float, float]], model: ModelConfig, hardware: Hardware) -> tuple[float, float]:
    """(ms of the products ``shapes`` at the model's precision, FP8 cast bytes per pass).

    The cast bytes are those of the forward (input and weight); I and W cast as many elements within 10%.
    """
    precision = model.precision
    total = sum(gemm_ms(m, n, k, hardware, precision) for m, n, k in shapes)
    cast = 0.0
    if precision == "fp8" and hardware.fp8_flops_per_s is not None:
        per_element = hardware.software.fp8_cast_bytes_per_element[model.kernels]
        cast = per_element * sum(m * k + k * n for m, n, k in shapes)
    return total, cast


def layer_gemm_times(
    model: ModelConfig,
    hardware: Hardware,
    tensor_parallel: int = 1,
    *,
    moe: bool = False,
    context_parallel: int = 1,
    expert_parallel: int = 1,
    expert_tensor_parallel: int | None = None,
) -> tuple[float, float]:
    """(ms of one layer's forward matrix multiplies, FP8 cast bytes per pass) at the model's precision
    (:func:`layer_gemms`, :func:`gemms_ms`)."""
    shapes = layer_gemms(
        model,
        tensor_parallel,
        moe=moe,
        context_parallel=context_parallel,
        expert_parallel=expert_parallel,
        expert_tensor_parallel=expert_tensor_parallel,
    )
    return gemms_ms(shapes, model, hardware)
