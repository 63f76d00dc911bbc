"""Run by tests/api/test_launch.py in a folder ``pipesched launch`` wrote: torchtitan 0.3's own parser reads
``torchtitan.args``, then torchtitan's ``_build_pipeline_schedule`` loads ``schedule.csv`` into
``_PipelineScheduleRuntime`` over gloo stages (placed by torchtitan's own rank → stage mapping) and steps once;
each stage's gradients are compared with a single-process reference. Prints one JSON line.

Usage: python launch_consumer.py PORT  (in the folder with torchtitan.args and schedule.csv)
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WIDTH = 8


def layers(num_stages: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(num_stages)]


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, None]:
    return nn.functional.mse_loss(output, target), None  # torchtitan's loss functions return (loss, extra)


def batch(local_batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(local_batch_size, WIDTH, generator=generator), torch.randn(
        local_batch_size, WIDTH, generator=generator
    )


def reference_grads(num_stages: int, local_batch_size: int, microbatch_size: int) -> list[list[torch.Tensor]]:
    """Gradients of the summed microbatch losses (torchtitan builds the schedule with ``scale_grads=False``)."""
    modules = layers(num_stages)
    inputs, targets = batch(local_batch_size)
    for x, y in zip(inputs.split(microbatch_size), targets.split(microbatch_size), strict=True):
        out = x
        for module in modules:
            out = module(out)
        loss_fn(out, y)[0].backward()
    return [[p.grad.clone() for p in module.parameters()] for module in modules]


def rank_main(rank: int, world: int, port: int, parallelism: object, local_batch_size: int, result: object) -> None:
    from torch.distributed.pipelining import PipelineStage
    from torchtitan.distributed.pipeline_parallel import (
        _build_pipeline_schedule,
        _get_pp_rank_to_stage_indices_mapping,
    )

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    num_stages = len(parallelism.module_fqns_per_model_part)  # type: ignore[attr-defined]
    owned = _get_pp_rank_to_stage_indices_mapping(
        rank,
        world,
        parallelism.pipeline_parallel_schedule,
        num_stages,  # type: ignore[attr-defined]
    )
    modules = layers(num_stages)
    stages = [PipelineStage(copy.deepcopy(modules[index]), index, num_stages, torch.device("cpu")) for index in owned]
    schedule = _build_pipeline_schedule(
        parallelism=parallelism, local_batch_size=local_batch_size, stages=stages, loss_fn=loss_fn
    )
    inputs, targets = batch(local_batch_size)
    args = (inputs,) if 0 in owned else ()
    losses: list[torch.Tensor] = []
    schedule.step(*args, target=targets if num_stages - 1 in owned else None, losses=losses)
    expected = reference_grads(num_stages, local_batch_size, parallelism.pipeline_parallel_microbatch_size)  # type: ignore[attr-defined]
    error = max(
        float((p.grad - g).abs().max())
        for stage in stages
        for p, g in zip(stage.submod.parameters(), expected[stage.stage_index], strict=True)
    )
    result[rank] = {"stages": list(owned), "max_grad_error": error, "losses": len(losses)}  # type: ignore[index]
    dist.destroy_process_group()


def main() -> None:
    from torchtitan.config.manager import ConfigManager

    argv = Path("torchtitan.args").read_text().split("\n")
    config = ConfigManager().parse_args([item for item in argv if item])
    parallelism, training = config.parallelism, config.training
    parsed = {
        "pipeline_parallel_degree": parallelism.pipeline_parallel_degree,
        "tensor_parallel_degree": parallelism.tensor_parallel_degree,
        "data_parallel_shard_degree": parallelism.data_parallel_shard_degree,
        "data_parallel_replicate_degree": parallelism.data_parallel_replicate_degree,
        "pipeline_parallel_schedule": parallelism.pipeline_parallel_schedule,
        "csv": parallelism.pipeline_parallel_schedule_csv,
        "csv_exists": Path(parallelism.pipeline_parallel_schedule_csv or "").is_file(),
        "microbatch_size": parallelism.pipeline_parallel_microbatch_size,
        "stages": len(parallelism.module_fqns_per_model_part or []),
        "local_batch_size": training.local_batch_size,
        "global_batch_size": training.global_batch_size,
        "seq_len": training.seq_len,
        "disable_cuda_graphs": training.disable_cuda_graphs,
        "activation_checkpoint": type(config.activation_checkpoint).__qualname__,
    }
    world = parallelism.pipeline_parallel_degree
    with mp.Manager() as manager:
        result = manager.dict()
        port = int(sys.argv[1])
        mp.spawn(rank_main, args=(world, port, parallelism, training.local_batch_size, result), nprocs=world)
        parsed["ranks"] = [result[rank] for rank in range(world)]
    print(json.dumps(parsed))


if __name__ == "__main__":
    main()
