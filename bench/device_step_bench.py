"""Training steps of a Llama-3-shaped decoder on the one GPU at hand, measured, beside pipesched's prediction.

Three parts, so that the GPU machine needs nothing but torch (only the first runs there):

* ``--measure`` (on the GPU): for each case, a decoder built as torchtitan builds Llama 3 (RMSNorm, rotary
  embeddings applied as complex products, grouped-query attention through ``scaled_dot_product_attention`` with the
  key/value heads repeated, SwiGLU, untied output), wrapped by FSDP2 (``fully_shard`` per block, then the root) on a
  one-rank NCCL mesh with torchtitan's mixed precision (bf16 parameters for compute, fp32 reductions, fp32 master
  weights), AdamW; ``--warmup`` steps, then ``--steps`` timed steps (CUDA-synchronised wall clock); writes one row
  per case in the calibration's row format (``pipesched calibrate`` reads it): tokens/s/GPU and the peak memory
  the allocator reserved. ``compile`` cases compile each block as torchtitan does (``torch.compile`` per block).
* ``--predict ROWS.json`` (anywhere): pipesched's prediction of each row with the built-in profile (the kernels
  the row states, and kernels not said), the error beside the measurement, and a leave-one-out refit through
  ``pipesched calibrate``'s fit: each row predicted by a profile fitted on the others.
* ``--components ROWS.json`` (anywhere): for rows measured with ``--breakdown``, the model's attention, matrix
  multiplies and the rest of the step beside the profiler's attention, GEMM and elementwise kernels
  (``--backward-speed R``: attention's backward at R of its forward's FLOP/s instead of the profile's).

Run on CPU with ``--device cpu --tiny`` to check the script (gloo, float32 compute; the numbers mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Case:
    """One measured configuration: a Llama-3-shaped model (``overrides`` on the ``llama3.1-8b`` preset), one
    sequence length and micro-batch, eager or compiled blocks."""

    name: str
    overrides: dict[str, int]
    seq_length: int
    micro_batch_size: int
    compile: bool = False


_LLAMA_1B = {"num_layers": 16, "hidden_size": 2048, "num_attention_heads": 32, "ffn_hidden_size": 8192}
_LLAMA_8B_4 = {"num_layers": 4, "hidden_size": 4096, "num_attention_heads": 32, "ffn_hidden_size": 14336}
#: The cases, cheapest first (each about 10–40 s on an H100 with its build).
CASES = [
    Case("llama1b-s8192-b1", _LLAMA_1B, 8192, 1),
    Case("llama1b-s2048-b4", _LLAMA_1B, 2048, 4),
    Case("llama8b-L4-s8192-b1", _LLAMA_8B_4, 8192, 1),
    Case("llama8b-L4-s4096-b2", _LLAMA_8B_4, 4096, 2),
    Case("llama1b-s8192-b1-compiled", _LLAMA_1B, 8192, 1, compile=True),
    Case("llama8b-L4-s8192-b1-compiled", _LLAMA_8B_4, 8192, 1, compile=True),
]
_TINY = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 128}
VOCAB = 128_256
KV_HEADS = 8


def _model(overrides: dict[str, int], vocab: int, max_seq: int) -> Any:
    """torchtitan's Llama 3 (``torchtitan/models/llama3/model.py``, Dec 2024) written anew: the same modules and
    kernels, so that eager PyTorch runs the same operations."""
    import torch
    from torch import nn
    from torch.nn import functional

    h, heads, ffn = overrides["hidden_size"], overrides["num_attention_heads"], overrides["ffn_hidden_size"]
    head_dim = h // heads
    kv_heads = min(KV_HEADS, heads)

    def rotary(seq: int) -> torch.Tensor:
        freqs = 1.0 / (500_000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        return torch.polar(torch.ones(seq, head_dim // 2), torch.outer(torch.arange(seq).float(), freqs))

    def rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        complex_x = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        rotated = torch.view_as_real(complex_x * freqs[: x.shape[1]].view(1, x.shape[1], 1, -1)).flatten(3)
        return rotated.type_as(x)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wq = nn.Linear(h, heads * head_dim, bias=False)
            self.wk = nn.Linear(h, kv_heads * head_dim, bias=False)
            self.wv = nn.Linear(h, kv_heads * head_dim, bias=False)
            self.wo = nn.Linear(heads * head_dim, h, bias=False)
            self.w1 = nn.Linear(h, ffn, bias=False)
            self.w2 = nn.Linear(ffn, h, bias=False)
            self.w3 = nn.Linear(h, ffn, bias=False)
            self.attention_norm = nn.RMSNorm(h, eps=1e-5)
            self.ffn_norm = nn.RMSNorm(h, eps=1e-5)

        def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
            batch, seq, _ = x.shape
            y = self.attention_norm(x)
            q = rotate(self.wq(y).view(batch, seq, heads, head_dim), freqs)
            k = rotate(self.wk(y).view(batch, seq, kv_heads, head_dim), freqs)
            v = self.wv(y).view(batch, seq, kv_heads, head_dim)
            repeat = heads // kv_heads
            k = k.unsqueeze(3).expand(batch, seq, kv_heads, repeat, head_dim).reshape(batch, seq, heads, head_dim)
            v = v.unsqueeze(3).expand(batch, seq, kv_heads, repeat, head_dim).reshape(batch, seq, heads, head_dim)
            out = functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
            )
            x = x + self.wo(out.transpose(1, 2).reshape(batch, seq, -1))
            y = self.ffn_norm(x)
            return x + self.w2(functional.silu(self.w1(y)) * self.w3(y))

    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok_embeddings = nn.Embedding(vocab, h)
            self.layers = nn.ModuleList(Block() for _ in range(overrides["num_layers"]))
            self.norm = nn.RMSNorm(h, eps=1e-5)
            self.output = nn.Linear(h, vocab, bias=False)
            self.register_buffer("freqs", rotary(max_seq), persistent=False)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = self.tok_embeddings(tokens)
            for layer in self.layers:
                x = layer(x, self.freqs)
            return self.output(self.norm(x))

    return Decoder()


def _measure_case(
    case: Case, device: Any, tiny: bool, warmup: int, steps: int, breakdown: bool = False
) -> dict[str, Any]:
    """One case's steady-state tokens/s and peak reserved bytes (module docstring)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn import functional

    overrides, vocab = (_TINY, 512) if tiny else (case.overrides, VOCAB)
    seq = 64 if tiny else case.seq_length
    on_gpu = device.type == "cuda"
    with torch.device(device):
        model = _model(overrides, vocab, seq)
    mesh = init_device_mesh(device.type, (1,))
    compute = torch.bfloat16 if on_gpu else torch.float32
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    for index, layer in enumerate(model.layers):
        if case.compile:
            layer.compile(fullgraph=True)
        # torchtitan: every block but the last reshards after its forward; the root keeps its weights.
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=index < len(model.layers) - 1)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=8e-4, weight_decay=0.1, fused=on_gpu)
    generator = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(0, vocab, (case.micro_batch_size, seq + 1), generator=generator).to(device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def step() -> None:
        logits = model(inputs)
        loss = functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    _synchronize(device)
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        _synchronize(device)
        times.append(time.perf_counter() - started)
    median_s = sorted(times)[len(times) // 2]
    kernels = _profiled_step(step, on_gpu) if breakdown else None
    peak_reserved = torch.cuda.max_memory_reserved(device) if on_gpu else 0
    peak_allocated = torch.cuda.max_memory_allocated(device) if on_gpu else 0
    return {
        "step_ms": [round(t * 1e3, 3) for t in times],
        "tokens_per_s_per_gpu": case.micro_batch_size * seq / median_s,
        "peak_memory_bytes": peak_reserved,
        "peak_allocated_bytes": peak_allocated,
        **({"kernels": kernels} if kernels else {}),
    }


#: Kernel classes by name (checked in this order): attention first (its kernels may say "cutlass" or "gemm").
KERNEL_CLASSES = (
    ("attention", ("flash", "fmha", "attention", "cudnn", "sdpa", "mha")),
    ("communication", ("nccl",)),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "matmul", "cublas", "sm90_", "sm80_")),
)


def _kernel_class(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, signs in KERNEL_CLASSES if any(sign in lowered for sign in signs)), "elementwise")


def _profiled_step(step: Any, on_gpu: bool, steps: int = 2) -> dict[str, Any]:
    """GPU time per step of each kernel class over ``steps`` steps (``torch.profiler``), and the top kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        for _ in range(steps):
            step()
        if on_gpu:
            torch.cuda.synchronize()
    classes: dict[str, float] = {}
    kernels: list[tuple[float, str, int]] = []
    for event in prof.key_averages():
        if on_gpu:  # the kernels themselves (an operator's device time repeats its kernels')
            if not str(getattr(event, "device_type", "")).endswith("CUDA"):
                continue
            us = getattr(event, "device_time_total", 0.0)
        else:
            us = getattr(event, "self_cpu_time_total", 0.0)
        if not us:
            continue
        kind = _kernel_class(event.key)
        classes[kind] = classes.get(kind, 0.0) + us / 1e3 / steps
        kernels.append((us / 1e3 / steps, f"{kind}: {event.key[:90]}", event.count // steps))
    kernels.sort(reverse=True)
    return {
        "ms_per_step": {kind: round(ms, 3) for kind, ms in sorted(classes.items())},
        "top_kernels": [[round(ms, 3), name, count] for ms, name, count in kernels[:12]],
    }


def sdpa_backends(device: Any, tiny: bool) -> list[dict[str, Any]]:
    """Forward and backward of causal ``scaled_dot_product_attention`` at the cases' shapes under each backend
    (and the default), ms and TFLOP/s (causal FLOPs: 2·b·a·s²·d forward, 2.5× that backward)."""
    import torch
    from torch.nn import functional
    from torch.nn.attention import SDPBackend, sdpa_kernel

    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    shapes = [(1, 32, 8192, 64), (1, 32, 8192, 128), (4, 32, 2048, 64)] if not tiny else [(1, 2, 64, 16)]
    backends = [None, SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    results = []
    for batch, heads, seq, head_dim in shapes:
        shape = (batch, heads, seq, head_dim)
        q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in "qkv")
        grad = torch.randn(shape, device=device, dtype=dtype)
        forward_flops = 2 * batch * heads * seq * seq * head_dim
        for backend in backends:
            name = "default" if backend is None else backend.name
            try:
                times: dict[str, list[float]] = {"forward": [], "backward": []}
                for repeat in range(6):
                    with sdpa_kernel(backend) if backend is not None else nullcontext():
                        started = time.perf_counter()
                        out = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                        _synchronize(device)
                        middle = time.perf_counter()
                        out.backward(grad)
                        _synchronize(device)
                        ended = time.perf_counter()
                    if repeat >= 2:
                        times["forward"].append(middle - started)
                        times["backward"].append(ended - middle)
                forward_ms = 1e3 * min(times["forward"])
                backward_ms = 1e3 * min(times["backward"])
                results.append(
                    {
                        "shape": [batch, heads, seq, head_dim],
                        "backend": name,
                        "forward_ms": round(forward_ms, 3),
                        "backward_ms": round(backward_ms, 3),
                        "forward_tflops": round(forward_flops / forward_ms / 1e9, 1),
                        "backward_tflops": round(2.5 * forward_flops / backward_ms / 1e9, 1),
                    }
                )
            except Exception as error:
                results.append({"shape": [batch, heads, seq, head_dim], "backend": name, "error": str(error)[:160]})
            print(json.dumps(results[-1]), flush=True)
    return results


def _synchronize(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hardware() -> dict[str, Any]:
    """What the GPU machine says of itself: the name (``cpu`` without a GPU), the power limit and clocks
    (``nvidia-smi``), torch, NCCL."""
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0], "gpu": "cpu"}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        query = "power.limit,power.max_limit,clocks.max.sm,clocks.max.memory"
        try:
            smi = subprocess.run(
                ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True, text=True
            )
            info["nvidia_smi"] = {"query": query, "answer": smi.stdout.strip()}
        except OSError as error:
            info["nvidia_smi"] = {"query": query, "error": str(error)}
    return info


#: The profile (``optimizer/cost/calibration/profiles.json``) of each GPU name torch reports, by a part of the name.
ACCELERATORS = {"H200": "H200", "H100 PCIe": "H100-PCIe", "H100": "H100-SXM", "B200": "B200", "A100": "A100-80GB"}


def accelerator_of(gpu_name: str, default: str = "H100-SXM") -> str:
    """The accelerator profile of a GPU that torch names ``gpu_name`` (``NVIDIA H200`` -> ``H200``); ``default``
    for a name not known (a CPU check)."""
    return next((profile for part, profile in ACCELERATORS.items() if part in gpu_name), default)


def _row(case: Case, measured: dict[str, Any], hardware: dict[str, Any]) -> dict[str, Any]:
    """A calibration row (the format of ``optimizer/cost/calibration/data/*.json``) for one measured case."""
    accelerator = accelerator_of(hardware.get("gpu", ""))
    return {
        "id": f"own-{accelerator.split('-')[0].lower()}-{case.name}",
        "table": "bench/device_step_bench.py --measure, on the GPU lent to this session",
        "model": {"preset": "llama3.1-8b", **case.overrides, "seq_length": case.seq_length},
        "accelerator": accelerator,
        "cluster": {"num_nodes": 1, "gpus_per_node": 1},
        "layout": {"data_parallel": 1, "sharding": "full"},
        "training": {
            "precision": "bf16",
            "activation_recomputation": "none",
            "micro_batch_size": case.micro_batch_size,
            "num_microbatches": 1,
            "global_batch_size": case.micro_batch_size,
        },
        "software": {"framework": "torchtitan", "compile": case.compile, "async_tensor_parallel": False},
        "measured": {
            "tokens_per_s_per_gpu": round(measured["tokens_per_s_per_gpu"], 1),
            "peak_memory_bytes": float(measured["peak_memory_bytes"]) or None,
        },
        "published": {**measured, "hardware": hardware},
    }


def measure(
    device_name: str, tiny: bool, warmup: int, steps: int, budget_s: float, output: Path, breakdown: bool = False
) -> None:
    """Measure every case that the time budget allows, writing the rows after each (a cut-off run keeps them)."""
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    device = torch.device(device_name)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    hardware_info = hardware()
    print(json.dumps(hardware_info), flush=True)
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for case in CASES:
        if time.perf_counter() - started > budget_s:
            print(f"{case.name}: skipped (budget {budget_s:.0f} s spent)", flush=True)
            continue
        try:
            measured = _measure_case(case, device, tiny, warmup, steps, breakdown)
            if device.type == "cuda":  # the case's tensors are gone: give their blocks back before the next
                torch.cuda.empty_cache()
        except Exception as error:  # an out-of-memory case must not lose the others
            print(f"{case.name}: failed: {type(error).__name__}: {str(error)[:300]}", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        rows.append(_row(case, measured, hardware_info))
        print(
            f"{case.name}: {measured['tokens_per_s_per_gpu']:,.0f} tok/s/GPU, steps {measured['step_ms']} ms, "
            f"peak reserved {measured['peak_memory_bytes'] / 2**30:.1f} GiB "
            f"(allocated {measured['peak_allocated_bytes'] / 2**30:.1f})",
            flush=True,
        )
        if "kernels" in measured:
            print(json.dumps(measured["kernels"]), flush=True)
        output.write_text(json.dumps({"source": _source(hardware_info), "rows": rows}, indent=1))
    if breakdown:
        backends = sdpa_backends(device, tiny)
        output.with_name(output.stem + "_sdpa.json").write_text(json.dumps(backends, indent=1))
    dist.destroy_process_group()


def _source(hardware: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": "pipesched_device_step_bench",
        "title": "bench/device_step_bench.py --measure on one GPU lent to a development session",
        "url": "bench/device_step_bench.py",
        "read": time.strftime("%Y-%m-%d"),
        "notes": f"{hardware.get('gpu', 'cpu')}, torch {hardware['torch']}, NCCL {hardware.get('nccl', '-')}, "
        f"nvidia-smi {hardware.get('nvidia_smi', {}).get('answer', '-')}",
    }


def _predict(row: Any, catalogue: Any = None, kernels: str | None = None) -> Any:
    from pipesched.optimizer.calibration.predict import predict as predict_row
    from pipesched.optimizer.cost.profile import active_catalogue, use_catalogue

    with use_catalogue(catalogue or active_catalogue()):
        return predict_row(row, kernels=kernels)


def _refit_catalogue(rows: list[Any]) -> Any:
    """The built-in catalogue with the accelerator's profile refitted on ``rows`` (``pipesched calibrate``)."""
    from pipesched.optimizer.calibration.calibrate import calibrate
    from pipesched.optimizer.cost.profile import ProfileCatalogue, active_catalogue

    profile = calibrate(rows, name="own-measurements")
    catalogue = active_catalogue()
    return ProfileCatalogue(software=catalogue.software, profiles={**catalogue.profiles, rows[0].accelerator: profile})


def predict(rows_path: Path) -> None:
    """Each measured row beside pipesched's prediction (built-in profile; the kernels the row states, and kernels
    not said) and beside a leave-one-out refit (``pipesched calibrate``'s fit on the other rows)."""
    from pipesched.optimizer.cost.calibration.measurements import load_measurements

    rows = load_measurements(rows_path)
    print(
        "| row | measured tok/s/GPU | predicted, kernels stated | error | kernels not said | error |"
        " refit on the other rows | error | peak GiB allocated / reserved measured, predicted |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    errors: dict[str, list[float]] = {"stated": [], "unknown": [], "refit": []}
    for index, row in enumerate(rows):
        measured = row.measured.tokens_per_s_per_gpu
        others = [other for j, other in enumerate(rows) if j != index]
        predictions = {
            "stated": _predict(row),
            "unknown": _predict(row, kernels="unknown"),
            "refit": _predict(row, _refit_catalogue(others)) if others else None,
        }
        cells = [row.id, f"{measured:,.0f}"]
        for key, prediction in predictions.items():
            tokens = prediction.tokens_per_s_per_gpu if prediction is not None else None
            if tokens is None:
                cells += ["–", "–"]
                continue
            errors[key].append(tokens / measured - 1)
            cells += [f"{tokens:,.0f}", f"{(tokens / measured - 1) * 100:+.1f}%"]
        peak = predictions["stated"].peak_memory_bytes
        reserved = row.measured.peak_memory_bytes or 0.0
        allocated = row.published.get("peak_allocated_bytes", 0.0)
        cells.append(f"{allocated / 2**30:.1f} / {reserved / 2**30:.1f}, {peak / 2**30:.1f}" if peak else "–")
        print("| " + " | ".join(cells) + " |")
    for key, values in errors.items():
        if values:
            absolute = sorted(abs(v) for v in values)
            print(f"{key}: median |error| {absolute[len(absolute) // 2] * 100:.1f}%, largest {absolute[-1] * 100:.1f}%")


def components(rows_path: Path, backward_speed: float | None = None) -> None:
    """The model's attention and matrix-multiply time per step beside the profiler's (rows with a
    ``published.kernels`` breakdown, ``--breakdown``), and the rest of the predicted step (elementwise work,
    the optimizer, FSDP's copies) beside the profiler's elementwise kernels: attention as the kernel the profiler
    named (cuDNN's, or PyTorch's FlashAttention-2), its backward at the software profile's ratio or at
    ``backward_speed``; the matrix multiplies of the layers and the output layer (forward and both backward
    products) at the profile's shape-dependent efficiency. No recomputation, one rank."""
    import dataclasses

    from pipesched.optimizer.calibration.predict import estimator, predict, run_software
    from pipesched.optimizer.cost.calibration.measurements import load_measurements
    from pipesched.optimizer.cost.flops import layer_flops
    from pipesched.optimizer.cost.stages import attention_ms, resolve_hardware
    from pipesched.optimizer.cost.timing import gemm_ms, layer_gemm_times

    named = {row["id"]: row["published"]["kernels"] for row in json.loads(rows_path.read_text())["rows"]}
    print("| row | attention ms: model, profiler, error | matrix multiplies | the rest of the step : elementwise |")
    print("|---|---:|---:|---:|")
    for row in load_measurements(rows_path):
        kernels = named.get(row.id)
        if not kernels:
            continue
        cudnn = any("cudnn" in name for _, name, _ in kernels["top_kernels"] if name.startswith("attention"))
        row = row.model_copy(
            update={"software": row.software.model_copy(update={"attention_kernel": "cudnn" if cudnn else "current"})}
        )
        with run_software(row):
            est = estimator(row)
            model = est.model.model_copy(update={"micro_batch_size": row.training.micro_batch_size})
            hardware = resolve_hardware(est.cluster)
            flops = layer_flops(model)
            tokens = model.seq_length * model.micro_batch_size
            head = gemm_ms(tokens, model.vocab_size, model.hidden_size, hardware)
            gemm = 3 * (model.num_layers * layer_gemm_times(model, hardware)[0] + head)
            times = {}
            for speed in (None, backward_speed):
                software = hardware.software.model_copy(update={"attention_backward_speed": speed}) if speed else None
                timed = dataclasses.replace(hardware, software=software) if software else hardware
                backward = attention_ms(flops.attention_backward, model, timed, backward=True)
                times[speed] = model.num_layers * (attention_ms(flops.attention_forward, model, timed) + backward)
        step = predict(row).step_time_ms or 0.0
        rest = step - times[None] - gemm
        attention, measured = times[backward_speed], kernels["ms_per_step"]
        print(
            f"| {row.id} | {attention:.1f}, {measured['attention']:.1f}, {attention / measured['attention'] - 1:+.0%} "
            f"| {gemm:.1f}, {measured['gemm']:.1f}, {gemm / measured['gemm'] - 1:+.0%} "
            f"| {rest:.1f}, {measured['elementwise']:.1f}, {rest / measured['elementwise'] - 1:+.0%} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", type=Path, help="measure every case, write the rows to this file")
    parser.add_argument("--predict", type=Path, help="predict the rows of this file beside their measurements")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU check of the script)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--budget-s", type=float, default=240.0, help="start no case after this many seconds")
    parser.add_argument("--cases", default="", help="comma-separated case names (default: every case)")
    parser.add_argument(
        "--breakdown", action="store_true", help="also each case's GPU time by kernel class, and SDPA's backends"
    )
    parser.add_argument("--components", type=Path, help="attention and matrix multiplies beside the profiler's")
    parser.add_argument(
        "--backward-speed", type=float, help="with --components: attention's backward ratio in place of the profile's"
    )
    args = parser.parse_args()
    if args.components:
        components(args.components, args.backward_speed)
    if args.measure:
        if args.cases:
            chosen = set(args.cases.split(","))
            CASES[:] = [case for case in CASES if case.name in chosen]
        measure(args.device, args.tiny, args.warmup, args.steps, args.budget_s, args.measure, args.breakdown)
    if args.predict:
        predict(args.predict)


if __name__ == "__main__":
    main()
