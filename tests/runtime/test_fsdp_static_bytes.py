"""The bytes PyTorch's FSDP2 keeps per parameter once a step has run, against the memory model's
(``pipesched.optimizer.cost.memory.FULL_SHARDING_STATES``): 2 gloo processes on the CPU, ``fully_shard`` per layer
and on the root with ``MixedPrecisionPolicy(param_dtype=bf16)`` as torchtitan and NeMo AutoModel apply it, one
forward, backward and ``torch.optim.Adam`` step; each rank's sharded parameters, their gradients and Adam's moments
(its ``step`` counter aside) are summed from the tensors themselves.

A model built in fp32 keeps fp32 shards (4 + 4 + 8 = 16 B a parameter over d) whatever the reduction's dtype, not
ZeRO-3's 2 + 4 + 12 = 18; one built in bf16 (AutoModel's mixture-of-experts models) keeps 2 + 2 + 4 = 8.

Between reductions (``set_requires_gradient_sync(False)`` over 2 microbatches: NeMo AutoModel's trainer, a
pipelined stage) each rank holds every parameter's unsharded gradient in the reduction's dtype: fp32 (4 B) with
``reduce_dtype`` fp32 over a bf16 or an fp32 model, bf16 (2 B) with ``reduce_dtype`` bf16, what the step model's
``memory.gradients`` charges (``pipesched.optimizer.cost.collectives``: Accumulated gradients).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pipesched.optimizer.configs import ClusterConfig, ModelConfig
from pipesched.optimizer.cost.collectives import data_parallel_costs
from pipesched.optimizer.cost.memory import static_bytes_per_parameter_sharded

torch = pytest.importorskip("torch")

WORLD = 2
#: (model dtype, FSDP2 reduce dtype) of each case → the memory model's state for it.
CASES = {
    ("float32", "float32"): "fp32_parameters",  # torchtitan: mixed_precision_reduce float32
    ("float32", "bfloat16"): "fp32_parameters",  # the gradient shard is cast back to the parameter's dtype
    ("bfloat16", "float32"): "bf16_parameters",  # NeMo AutoModel's MoE models: MixedPrecisionPolicy reduce fp32
}


def _local(tensor: Any) -> Any:
    return tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor


def _bytes(tensors: list[Any]) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def _rank(rank: int, init_file: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    measured = {}
    for model_dtype, reduce_dtype in CASES:
        torch.manual_seed(0)
        layers = [torch.nn.Linear(64, 128, bias=False), torch.nn.Linear(128, 64, bias=False)]
        model = torch.nn.Sequential(*layers).to(getattr(torch, model_dtype))
        parameters = sum(p.numel() for p in model.parameters())
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=getattr(torch, reduce_dtype))
        for layer in model:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        model(torch.randn(8, 64)).float().pow(2).mean().backward()
        optimizer.step()
        params = list(model.parameters())
        moments = [value for state in optimizer.state.values() for key, value in state.items() if key != "step"]
        kept = _bytes(params) + _bytes([p.grad for p in params]) + _bytes(moments)
        measured[f"{model_dtype}/{reduce_dtype}"] = kept / parameters
        model.zero_grad(set_to_none=True)
        model.set_requires_gradient_sync(False)  # every microbatch but the last: the gradients accumulate unsharded
        for _ in range(2):
            model(torch.randn(8, 64)).float().pow(2).mean().backward()
        held = [
            fsdp_param.unsharded_accumulated_grad
            if fsdp_param.unsharded_accumulated_grad is not None
            else fsdp_param._unsharded_param.grad
            for layer in model
            for fsdp_param in layer._get_fsdp_state()._fsdp_param_group.fsdp_params  # FSDP2's own, torch 2.13
        ]
        dtypes = sorted({str(gradient.dtype) for gradient in held})
        measured[f"{model_dtype}/{reduce_dtype}/accumulated"] = _bytes(held) / parameters
        measured[f"{model_dtype}/{reduce_dtype}/accumulated_dtype"] = dtypes  # type: ignore[assignment]
    if rank == 0:
        Path(out).write_text(json.dumps(measured))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Bytes rank 0 keeps per parameter of the whole model, by case."""
    import torch.multiprocessing as mp

    folder = tmp_path_factory.mktemp("fsdp_static")
    out = folder / "measured.json"
    mp.spawn(_rank, args=(str(folder / "init"), str(out)), nprocs=WORLD, join=True)
    return json.loads(out.read_text())


@pytest.mark.parametrize(("model_dtype", "reduce_dtype"), list(CASES))
def test_fsdp2_keeps_what_the_memory_model_charges(measured, model_dtype: str, reduce_dtype: str) -> None:
    model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=1, seq_length=8, vocab_size=8)
    state = CASES[(model_dtype, reduce_dtype)]
    reduced = 4.0 if reduce_dtype == "float32" else 2.0
    charged = static_bytes_per_parameter_sharded(model, "full", WORLD, gradient_bytes=reduced, full_state=state)
    assert measured[f"{model_dtype}/{reduce_dtype}"] == pytest.approx(charged)
    if state == "fp32_parameters":  # ZeRO-3's count would charge 2 + g + 12 over d
        assert charged < static_bytes_per_parameter_sharded(model, "full", WORLD, gradient_bytes=4.0)


@pytest.mark.parametrize(("model_dtype", "reduce_dtype"), list(CASES))
def test_fsdp2_accumulates_the_unsharded_gradient_in_the_reduction_dtype(
    measured, model_dtype: str, reduce_dtype: str
) -> None:
    """FSDP2 casts the accumulated unsharded gradient to ``reduce_dtype`` (``to_accumulated_grad_if_needed``), or
    keeps it in ``param_dtype`` where the two are equal; the step model charges the reduction's bytes a parameter for
    the whole stage held until the last microbatch's reduction (every parameter gathered: d ranks hold it whole)."""
    model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=1, seq_length=8, vocab_size=8)
    reduced = 4.0 if reduce_dtype == "float32" else 2.0
    assert measured[f"{model_dtype}/{reduce_dtype}/accumulated_dtype"] == [f"torch.{reduce_dtype}"]
    costs = data_parallel_costs(
        model=model,
        cluster=ClusterConfig(accelerator="H100-SXM"),
        stage_parameters=[1000.0],
        stage_holders=[[0]],
        num_ranks=1,
        data_parallel_size=WORLD,
        sharding="full",
        memory_bandwidth_bytes_per_s=3e12,
        reduce_bytes=reduced,
        reduce_every_microbatch=False,
    )
    assert measured[f"{model_dtype}/{reduce_dtype}/accumulated"] == pytest.approx(costs.gradients_bytes[0] / 1000.0)
