"""One expert-parallel rank's mixture-of-experts layer on the GPU at hand, measured, beside pipesched's model of it.

Issue 28: the GPT-OSS rows run 20–50% slower than predicted (``bench/results/cpep_rows_beyond_25.md``), Qwen3's
within ~16%. This measures the work on one rank of EP 8 that the network does not change, so that the lead can
put it beside the model's time for the same work. Two parts, so that the GPU machine needs nothing but torch,
numpy and pipesched:

* ``--measure OUT.json`` (on the GPU): for each case, one EP rank's MoE layer as Megatron-Core and torchtitan run
  it, forward and backward, bf16, timed with CUDA events after warm-up (median of ``--repeats``): the router (a
  linear h → E; GPT-OSS: top-k of the logits, then softmax over the k, with the router's bias; Qwen3: softmax
  over the E, top-k, renormalised), the permutation (the token copies sorted by local expert and padded to
  groups of 16 rows, torchtitan's ``generate_permute_indices``), the local experts' fc1 → activation → fc2 as one
  grouped GEMM each (``torch._grouped_mm`` where it runs; otherwise a loop of ``torch.matmul`` over the experts,
  and the row says which ran), the unpermutation and the probability-weighted combine (``index_add_``). The
  activation is GPT-OSS's clamped SwiGLU with the experts' biases (gate and up interleaved, gate ≤ 7, |up| ≤ 7,
  (up + 1) · gate · σ(1.702 · gate): ``transformers``' ``GptOssExperts``) or a plain SwiGLU without biases. Each
  case's grouped GEMMs are also timed alone (fc1 and fc2, forward and backward, on the same padded rows), and
  the forward's stages one by one. A rank of EP 8 holds E/8 experts and receives s·b·k copies of its s·b tokens'
  worth (balanced), M = s·b·k·8/E rows per local expert; here the rank's own s·b tokens stand in for those the
  all-to-all brings (each copy goes to local expert ``index mod E/8``), so no collective runs. Rows go to the file
  after each case (a cut-off run keeps them); no case starts after ``--budget-s``.
* ``--predict OUT.json`` (anywhere, no GPU): pipesched's model of the same work on the accelerator measured
  (its profile by the GPU's name): the local experts' products and the router's at
  :func:`pipesched.optimizer.cost.timing.expert_gemms`' shapes through
  :func:`pipesched.optimizer.cost.timing.gemms_ms`, three times (forward, input- and weight-gradient: the
  model's F, I and W each run the forward's products); the memory-bound work the model charges the MoE MLP: its
  stored activation bytes (:mod:`pipesched.optimizer.cost.memory`'s MoE widths: permuted input, fc1 and
  activation outputs per routed copy, the router's fp32 logits and probabilities) times the forward's and the
  input-gradient's traffic per activation byte (:mod:`pipesched.optimizer.cost.stages`), plus eager SwiGLU's
  unfused bytes; printed beside the measurement as a markdown table. The model's host floor for a MoE layer
  (``moe_layer_host_ms`` × (1 + 1.5 + 0.5)) is printed beside it: it bounds the whole layer's passes, not this
  part, and the measurement here does not sync with the host.

The model's inputs: the case's preset (``optimizer/presets.py``) as a :class:`pipesched.optimizer.configs.ModelConfig`
at a sequence length and micro-batch whose s·b gives the case's M at EP 8, kernels ``eager`` (PyTorch ops, as
here). Run on CPU with ``--device cpu --tiny`` to check the script (tiny shapes; the numbers mean nothing).

    python -m bench.moe_layer_device --measure moe_layer.json --device cuda
    python -m bench.moe_layer_device --predict moe_layer.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import device_step_bench
from pipesched.optimizer.configs import ClusterConfig, ModelConfig

#: Expert parallelism of every case: the rank holds num_experts / EP experts.
EXPERT_PARALLEL = 8
#: Rows per expert group are padded to a multiple of this (torchtitan pads bf16 groups for the grouped GEMM's
#: 16-byte alignment of the weight gradient's reduction dimension).
GROUP_ALIGN_ROWS = 16
#: GPT-OSS's activation (``transformers`` ``GptOssExperts``: ``alpha = 1.702``, ``limit = 7.0``).
GPT_OSS_ALPHA = 1.702
GPT_OSS_LIMIT = 7.0
#: The forward's stages timed one by one (:meth:`_Layer.forward`).
STAGES = ("router", "permute", "experts", "combine")


@dataclass(frozen=True)
class Case:
    """One measured MoE layer: a preset at ``rows_per_expert`` rows per local expert on one rank of EP 8.

    ``activation``: ``clamped`` (GPT-OSS's clamped SwiGLU, with the experts' fc1 and fc2 biases and the router's
    bias) or ``swiglu`` (plain SwiGLU, no biases); ``topk_then_softmax``: GPT-OSS's router (softmax over the k
    chosen logits) rather than Qwen3's (softmax over all experts, top-k, renormalised)."""

    name: str
    preset: str
    rows_per_expert: int
    activation: str
    topk_then_softmax: bool


CASES = [
    Case("gpt-oss-120b-ep8-m1024", "gpt-oss-120b", 1024, "clamped", True),
    Case("gpt-oss-120b-ep8-m4096", "gpt-oss-120b", 4096, "clamped", True),
    Case("gpt-oss-120b-plain-swiglu-ep8-m1024", "gpt-oss-120b", 1024, "swiglu", True),
    Case("gpt-oss-120b-plain-swiglu-ep8-m4096", "gpt-oss-120b", 4096, "swiglu", True),
    Case("qwen3-235b-a22b-ep8-m2048", "qwen3-235b-a22b", 2048, "swiglu", False),
    Case("qwen3-235b-a22b-ep8-m4096", "qwen3-235b-a22b", 4096, "swiglu", False),
    Case("qwen3-30b-a3b-ep8-m2048", "qwen3-30b-a3b", 2048, "swiglu", False),
]
#: ``--tiny``: the presets shrunk to this (h, expert width, experts) at this M (a CPU check of the script).
TINY = {"hidden_size": 64, "ffn_hidden_size": 64, "moe_ffn_hidden_size": 32, "num_experts": 16}
TINY_ROWS_PER_EXPERT = 32


def case_model(case: Case, tiny: bool = False) -> ModelConfig:
    """The case as pipesched's model input: the preset at an s·b that gives ``rows_per_expert`` rows per local
    expert at EP 8 (M = s·b·k·ep/E, :func:`pipesched.optimizer.cost.timing.expert_gemms`), eager kernels."""
    base = ModelConfig.model_validate({"preset": case.preset, **(TINY if tiny else {})})
    rows = TINY_ROWS_PER_EXPERT if tiny else case.rows_per_expert
    experts, top_k = base.num_experts or 1, base.num_experts_per_token or 1
    tokens, remainder = divmod(rows * experts, top_k * EXPERT_PARALLEL)
    if remainder:
        raise ValueError(f"{case.name}: rows_per_expert {rows} gives no whole token count at EP {EXPERT_PARALLEL}")
    seq = base.seq_length if tokens % base.seq_length == 0 else tokens
    overrides = {**(TINY if tiny else {}), "seq_length": seq, "micro_batch_size": tokens // seq, "kernels": "eager"}
    return ModelConfig.model_validate({"preset": case.preset, **overrides})


def accelerator_of(gpu_name: str) -> str:
    """The profile name of a GPU (``torch.cuda.get_device_name``, as the step bench maps it); H200 for anything else
    (a CPU check)."""
    return device_step_bench.accelerator_of(gpu_name, default="H200")


# --- the measurement (torch) ---------------------------------------------------------------------------------


def _grouped_path(device: Any, dtype: Any) -> str:
    """``torch._grouped_mm`` if it runs forward and backward here and matches a loop of matmuls; else ``loop``."""
    import torch

    if not hasattr(torch, "_grouped_mm"):
        return "loop"
    try:
        a = torch.randn(48, 32, device=device, dtype=dtype, requires_grad=True)
        b = torch.randn(3, 32, 48, device=device, dtype=dtype, requires_grad=True)
        offsets = torch.tensor([16, 32, 48], device=device, dtype=torch.int32)
        out = torch._grouped_mm(a, b, offs=offsets)
        out.backward(torch.randn_like(out))
        reference = torch.cat([a[16 * g : 16 * (g + 1)] @ b[g] for g in range(3)])
        if not torch.allclose(out.float(), reference.float(), rtol=2e-2, atol=2e-1):
            return "loop"
    except (RuntimeError, NotImplementedError):
        return "loop"
    return "grouped_mm"


def _grouped(path: str) -> Callable[..., Any]:
    """(rows, weights (G, K, N), group ends (G,) int32) → rows @ their group's weight."""
    import torch

    if path == "grouped_mm":
        return lambda rows, weights, ends: torch._grouped_mm(rows, weights, offs=ends)

    def loop(rows: Any, weights: Any, ends: Any) -> Any:
        bounds = [0, *ends.tolist()]  # the host learns the group sizes (Transformer Engine's grouped linear does)
        parts = [rows[start:end] @ weights[g] for g, (start, end) in enumerate(itertools.pairwise(bounds))]
        return torch.cat([*parts, rows.new_zeros(rows.shape[0] - bounds[-1], weights.shape[-1])])

    return loop


class _Layer:
    """One EP rank's MoE layer (module docstring): router weights over all E experts, the E/ep local experts."""

    def __init__(self, model: ModelConfig, case: Case, device: Any, dtype: Any, path: str) -> None:
        import torch

        h, f = model.hidden_size, model.expert_ffn_size
        self.experts, self.top_k = model.num_experts or 1, model.num_experts_per_token or 1
        self.local = self.experts // EXPERT_PARALLEL
        self.case, self.matmul = case, _grouped(path)
        biased = case.activation == "clamped"
        generator = torch.Generator(device="cpu").manual_seed(0)

        def weight(*shape: int, scale: float) -> Any:
            values = torch.randn(*shape, generator=generator) * scale
            return values.to(device=device, dtype=dtype).requires_grad_()

        self.router = weight(self.experts, h, scale=h**-0.5)
        self.router_bias = weight(self.experts, scale=0.1) if biased else None
        self.fc1 = weight(self.local, h, 2 * f, scale=h**-0.5)
        self.fc2 = weight(self.local, f, h, scale=f**-0.5)
        self.fc1_bias = weight(self.local, 2 * f, scale=0.1) if biased else None
        self.fc2_bias = weight(self.local, h, scale=0.1) if biased else None

    def parameters(self) -> list[Any]:
        candidates = [self.router, self.router_bias, self.fc1, self.fc2, self.fc1_bias, self.fc2_bias]
        return [p for p in candidates if p is not None]

    def route(self, x: Any) -> tuple[Any, Any]:
        """(probabilities (T, k) in x's dtype, expert indices (T, k))."""
        import torch
        from torch.nn import functional

        logits = functional.linear(x, self.router, self.router_bias)
        if self.case.topk_then_softmax:  # GPT-OSS: top-k of the logits, softmax over the k
            values, indices = torch.topk(logits, self.top_k, dim=-1)
            return torch.softmax(values.float(), dim=-1).to(x.dtype), indices
        probabilities = torch.softmax(logits.float(), dim=-1)  # Qwen3: softmax, top-k, renormalised
        values, indices = torch.topk(probabilities, self.top_k, dim=-1)
        return (values / values.sum(dim=-1, keepdim=True)).to(x.dtype), indices

    def permute(self, indices: Any) -> tuple[Any, Any, Any, Any]:
        """(the copies (token · k + slot) sorted by local expert, each sorted copy's padded row, group ends (int32),
        each padded row's expert), without a host sync."""
        import torch

        local = (indices.flatten() % self.local).to(torch.int64)
        order = torch.argsort(local, stable=True)
        counts = torch.zeros(self.local, dtype=torch.int64, device=local.device).scatter_add_(
            0, local, torch.ones_like(local)
        )
        starts = torch.cumsum(counts, 0) - counts
        padded = (counts + GROUP_ALIGN_ROWS - 1) // GROUP_ALIGN_ROWS * GROUP_ALIGN_ROWS
        ends = torch.cumsum(padded, 0)
        sorted_expert = local[order]
        position = torch.arange(order.numel(), device=order.device)
        destination = position - starts[sorted_expert] + (ends - padded)[sorted_expert]
        rows = order.numel() + self.local * GROUP_ALIGN_ROWS  # a static bound: no host sync
        row_expert = torch.searchsorted(ends, torch.arange(rows, device=order.device), right=True)
        return order, destination, ends.to(torch.int32), row_expert  # rows past the last group: expert ``local``

    def activation(self, inner: Any) -> Any:
        from torch.nn import functional

        if self.case.activation == "clamped":  # transformers' GptOssExperts
            gate, up = inner[..., ::2], inner[..., 1::2]
            gate = gate.clamp(max=GPT_OSS_LIMIT)
            up = up.clamp(min=-GPT_OSS_LIMIT, max=GPT_OSS_LIMIT)
            return (up + 1) * (gate * (gate * GPT_OSS_ALPHA).sigmoid())
        gate, up = inner.chunk(2, dim=-1)
        return functional.silu(gate) * up

    def experts_forward(self, rows: Any, ends: Any, row_expert: Any) -> Any:
        inner = self.matmul(rows, self.fc1, ends)
        if self.fc1_bias is not None:
            inner = inner + _bias_rows(self.fc1_bias, row_expert)
        out = self.matmul(self.activation(inner), self.fc2, ends)
        if self.fc2_bias is not None:
            out = out + _bias_rows(self.fc2_bias, row_expert)
        return out

    def forward(self, x: Any, marks: list[Any] | None = None) -> Any:
        """The layer's output (T, h); ``marks``: a timing mark appended after each of :data:`STAGES`."""

        def mark() -> None:
            if marks is not None:
                marks.append(_event(x.device))

        probabilities, indices = self.route(x)
        mark()
        order, destination, ends, row_expert = self.permute(indices)
        tokens = order // self.top_k
        rows = x.new_zeros(row_expert.numel(), x.shape[1]).index_copy(0, destination, x[tokens])
        mark()
        out = self.experts_forward(rows, ends, row_expert)
        mark()
        weights = probabilities.flatten()[order].unsqueeze(1)
        combined = x.new_zeros(x.shape).index_add(0, tokens, out[destination] * weights)
        mark()
        return combined


def _bias_rows(bias: Any, row_expert: Any) -> Any:
    """Each padded row's expert bias; none past the last group (the grouped GEMM leaves those rows unset, so their
    gradients must not reach a bias)."""
    import torch

    return torch.cat([bias, bias.new_zeros(1, bias.shape[1])])[row_expert]


def _event(device: Any) -> Any:
    """A recorded timing mark: a CUDA event, or the CPU clock off the GPU."""
    import torch

    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _elapsed_ms(start: Any, end: Any) -> float:
    if isinstance(start, float):
        return (end - start) * 1e3
    return float(start.elapsed_time(end))


def _timed(
    run: Callable[[], None], device: Any, warmup: int, repeats: int, issued: list[float] | None = None
) -> list[float]:
    """ms of each of ``repeats`` runs after ``warmup`` (CUDA events; the CPU clock off the GPU); ``issued``
    receives the host's ms to issue each run (near the measured time: the run is launch-bound)."""
    import torch

    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        start = _event(device)
        host = time.perf_counter()
        run()
        if issued is not None:
            issued.append((time.perf_counter() - host) * 1e3)
        end = _event(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(_elapsed_ms(start, end))
    return times


def _measure_case(case: Case, device: Any, tiny: bool, warmup: int, repeats: int, path: str) -> dict[str, Any]:
    """The case's layer (forward, forward + backward, its forward's stages) and its grouped GEMMs alone, ms."""
    import torch

    dtype = torch.bfloat16
    model = case_model(case, tiny)
    layer = _Layer(model, case, device, dtype, path)
    tokens = model.seq_length * model.micro_batch_size
    generator = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(tokens, model.hidden_size, generator=generator).to(device=device, dtype=dtype)
    x.requires_grad_()
    grad = torch.randn(tokens, model.hidden_size, generator=generator).to(device=device, dtype=dtype)

    def zero() -> None:
        for tensor in [x, *layer.parameters()]:
            tensor.grad = None

    def forward_backward() -> None:
        layer.forward(x).backward(grad)
        zero()

    def forward() -> None:
        with torch.no_grad():
            layer.forward(x)

    issued: list[float] = []
    layer_ms = _timed(forward_backward, device, warmup, repeats, issued)
    forward_ms = _timed(forward, device, warmup, repeats)
    stages: dict[str, list[float]] = {name: [] for name in STAGES}
    for repeat in range(warmup + repeats):
        marks = [_event(device)]
        with torch.no_grad():
            layer.forward(x, marks)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if repeat >= warmup:
            for name, start, end in zip(stages, marks[:-1], marks[1:], strict=True):
                stages[name].append(_elapsed_ms(start, end))
    with torch.no_grad():
        _, indices = layer.route(x)
        _, destination, ends, row_expert = layer.permute(indices)
    padded = torch.diff(ends, prepend=ends.new_zeros(1)).tolist()
    counts = torch.bincount(indices.flatten() % layer.local, minlength=layer.local).tolist()
    fc1_in = torch.randn(row_expert.numel(), model.hidden_size, generator=generator).to(device=device, dtype=dtype)
    fc2_in = torch.randn(row_expert.numel(), model.expert_ffn_size, generator=generator).to(device, dtype)
    fc1_grad = torch.randn(row_expert.numel(), 2 * model.expert_ffn_size, generator=generator).to(device, dtype)
    fc2_grad = torch.randn(row_expert.numel(), model.hidden_size, generator=generator).to(device, dtype)
    fc1_in.requires_grad_()
    fc2_in.requires_grad_()

    def gemms() -> None:
        layer.matmul(fc1_in, layer.fc1, ends).backward(fc1_grad)
        layer.matmul(fc2_in, layer.fc2, ends).backward(fc2_grad)
        for tensor in (fc1_in, fc2_in, layer.fc1, layer.fc2):
            tensor.grad = None

    def gemms_forward() -> None:
        with torch.no_grad():
            layer.matmul(fc1_in, layer.fc1, ends)
            layer.matmul(fc2_in, layer.fc2, ends)

    gemm_ms = _timed(gemms, device, warmup, repeats)
    gemm_forward_ms = _timed(gemms_forward, device, warmup, repeats)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return {
        "layer_ms": statistics.median(layer_ms),
        "layer_forward_ms": statistics.median(forward_ms),
        "layer_host_issue_ms": statistics.median(issued),
        "forward_stages_ms": {name: round(statistics.median(times), 4) for name, times in stages.items()},
        "gemm_ms": statistics.median(gemm_ms),
        "gemm_forward_ms": statistics.median(gemm_forward_ms),
        "layer_ms_all": [round(t, 4) for t in layer_ms],
        "gemm_ms_all": [round(t, 4) for t in gemm_ms],
        "rows_per_expert": {"min": min(counts), "max": max(counts), "padded_total": sum(padded)},
        "copies": int(destination.numel()),
        "peak_allocated_bytes": peak,
    }


def measure(
    device_name: str,
    tiny: bool,
    warmup: int,
    repeats: int,
    budget_s: float,
    output: Path,
    cases: list[Case] | None = None,
) -> list[dict[str, Any]]:
    """Measure each of ``cases`` (default :data:`CASES`) the budget allows, writing the rows after each (module
    docstring)."""
    import torch

    device = torch.device(device_name)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
    hardware = device_step_bench.hardware()
    path = _grouped_path(device, torch.bfloat16)
    print(json.dumps({**hardware, "gemm_path": path}), flush=True)
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for case in CASES if cases is None else cases:
        if time.perf_counter() - started > budget_s:
            print(f"{case.name}: skipped (budget {budget_s:.0f} s spent)", flush=True)
            continue
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        measured, ran = None, path
        for ran in dict.fromkeys((path, "loop")):  # a grouped GEMM that refuses the case's shapes: the loop
            try:
                measured = _measure_case(case, device, tiny, warmup, repeats, ran)
                break
            except Exception as error:  # an out-of-memory case must not lose the others
                print(f"{case.name} ({ran}): failed: {type(error).__name__}: {str(error)[:300]}", flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if measured is None:
            continue
        model = case_model(case, tiny)
        rows.append(
            {
                "case": case.name,
                "model": {
                    "preset": case.preset,
                    **(TINY if tiny else {}),
                    "seq_length": model.seq_length,
                    "micro_batch_size": model.micro_batch_size,
                    "kernels": "eager",
                },
                "expert_parallel": EXPERT_PARALLEL,
                "rows_per_expert": TINY_ROWS_PER_EXPERT if tiny else case.rows_per_expert,
                "activation": case.activation,
                "accelerator": accelerator_of(hardware["gpu"]),
                "gemm_path": ran,
                "tiny": tiny,
                "measured": measured,
            }
        )
        print(
            f"{case.name}: layer {measured['layer_ms']:.3f} ms (forward {measured['layer_forward_ms']:.3f}), "
            f"grouped GEMMs {measured['gemm_ms']:.3f} ms (forward {measured['gemm_forward_ms']:.3f}), "
            f"stages {measured['forward_stages_ms']}, peak {measured['peak_allocated_bytes'] / 2**30:.1f} GiB",
            flush=True,
        )
        output.write_text(json.dumps({"hardware": {**hardware, "gemm_path": path}, "rows": rows}, indent=1))
    return rows


# --- the model (no torch) ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Predicted:
    """pipesched's time for one case's MoE work on one rank, forward + backward (F + I + W), ms."""

    expert_gemm_ms: float
    router_gemm_ms: float
    elementwise_ms: float
    host_floor_ms: float

    @property
    def total_ms(self) -> float:
        return self.expert_gemm_ms + self.router_gemm_ms + self.elementwise_ms


def predict_row(row: dict[str, Any], kernels: str | None = None) -> Predicted:
    """The model's time for a measured row's work (module docstring), on the row's accelerator; ``kernels``: in
    place of the row's (``fused``: as the model times Megatron-Core with Transformer Engine)."""
    from pipesched.optimizer.cost.memory import _mlp_widths
    from pipesched.optimizer.cost.stages import (
        BACKWARD_INPUT_TRAFFIC_PER_ACTIVATION_BYTE,
        FORWARD_TRAFFIC_PER_ACTIVATION_BYTE,
        UNFUSED_BYTES_PER_ELEMENT,
        resolve_hardware,
    )
    from pipesched.optimizer.cost.timing import elementwise_ms, expert_gemms, gemms_ms

    model = ModelConfig.model_validate({**row["model"], **({"kernels": kernels} if kernels else {})})
    hardware = resolve_hardware(ClusterConfig.model_validate({"accelerator": row["accelerator"]}))
    tokens = float(model.seq_length * model.micro_batch_size)
    shapes = expert_gemms(model, tokens, 1, row["expert_parallel"])
    experts_forward, _ = gemms_ms(shapes[:-1], model, hardware)  # the local experts (no shared ones here)
    router_forward, _ = gemms_ms(shapes[-1:], model, hardware)
    stored, _, _ = _mlp_widths(model, True)  # 16-bit bytes per token the model stores for the MoE MLP
    software = hardware.software
    per_byte = FORWARD_TRAFFIC_PER_ACTIVATION_BYTE + BACKWARD_INPUT_TRAFFIC_PER_ACTIVATION_BYTE
    traffic = per_byte * software.elementwise_traffic[model.kernels] * stored * tokens * model.dtype_bytes / 2
    if model.kernels == "eager" and model.ffn_type == "swiglu":  # forward once, input-gradient twice
        active = (model.num_experts_per_token or 1) * model.moe_load_imbalance * model.expert_ffn_size
        traffic += 3 * UNFUSED_BYTES_PER_ELEMENT["swiglu"] * active * tokens * software.unfused_traffic
    return Predicted(
        expert_gemm_ms=3 * experts_forward,
        router_gemm_ms=3 * router_forward,
        elementwise_ms=elementwise_ms(traffic, hardware),
        host_floor_ms=3 * software.moe_layer_host_ms,
    )


def predict(rows_path: Path) -> str:
    """The markdown table of measured beside predicted for every row of ``rows_path`` (printed and returned)."""
    document = json.loads(rows_path.read_text())
    hardware = document.get("hardware", {})
    lines = [
        f"GPU: {hardware.get('gpu', '?')}, torch {hardware.get('torch', '?')}, expert GEMMs: "
        f"{hardware.get('gemm_path', '?')} where it runs; forward + backward of one EP-8 rank's MoE layer, ms (median)",
        "",
        "| case | profile | expert GEMMs | M | measured | predicted | measured / predicted | GEMMs measured "
        "| GEMMs predicted | ratio | rest measured | rest predicted (router GEMM + memory-bound) "
        "| predicted, kernels fused | host floor (model) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in document["rows"]:
        measured, model, fused = row["measured"], predict_row(row), predict_row(row, "fused")
        rest = measured["layer_ms"] - measured["gemm_ms"]
        lines.append(
            f"| {row['case']} | {row['accelerator']} | {row['gemm_path']} | {row['rows_per_expert']:,} "
            f"| {measured['layer_ms']:.4g} | {model.total_ms:.4g} | {measured['layer_ms'] / model.total_ms:.2f} "
            f"| {measured['gemm_ms']:.4g} | {model.expert_gemm_ms:.4g} "
            f"| {measured['gemm_ms'] / model.expert_gemm_ms:.2f} "
            f"| {rest:.4g} | {model.router_gemm_ms:.4g} + {model.elementwise_ms:.4g} | {fused.total_ms:.4g} "
            f"| {model.host_floor_ms:.4g} |"
        )
    lines += [
        "",
        "Measured forward by stage, ms (no backward): router, permute, experts (fc1, activation, fc2, biases), "
        "combine; grouped GEMMs alone, forward; the host's time to issue the layer's forward + backward (close to "
        "the measured layer: launch-bound)",
        "",
        "| case | router | permute | experts | combine | forward | GEMMs alone, forward "
        "| host's issue of forward + backward |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in document["rows"]:
        measured = row["measured"]
        stages = " | ".join(f"{measured['forward_stages_ms'][name]:.4g}" for name in STAGES)
        lines.append(
            f"| {row['case']} | {stages} | {measured['layer_forward_ms']:.4g} | {measured['gemm_forward_ms']:.4g} "
            f"| {measured['layer_host_issue_ms']:.4g} |"
        )
    table = "\n".join(lines)
    print(table)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", type=Path, metavar="OUT.json", help="measure the cases, write rows here")
    parser.add_argument("--predict", type=Path, metavar="OUT.json", help="the model beside these measured rows")
    parser.add_argument("--device", default="cuda", help="torch device of --measure (cpu: with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: a CPU check that the script runs")
    parser.add_argument("--budget-s", type=float, default=150.0, help="--measure starts no case after this")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs before each measurement")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per measurement (their median)")
    names = [case.name for case in CASES]
    parser.add_argument("--cases", nargs="+", choices=names, default=names, metavar="CASE", help=", ".join(names))
    args = parser.parse_args()
    if not (args.measure or args.predict):
        parser.error("give --measure OUT.json (on the GPU), --predict OUT.json, or both")
    if args.measure:
        chosen = [case for case in CASES if case.name in args.cases]
        measure(args.device, args.tiny, args.warmup, args.repeats, args.budget_s, args.measure, chosen)
    if args.predict:
        predict(args.predict)


if __name__ == "__main__":
    main()
