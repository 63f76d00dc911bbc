"""Derive per-stage costs and memory from a model and cluster (filled in by the cost-model work)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from optimizer.configs import ClusterConfig, ModelConfig
    from optimizer.problem import Costs, Memory, Pipeline


def derive_costs_and_memory(model: ModelConfig, cluster: ClusterConfig, pipeline: Pipeline) -> tuple[Costs, Memory]:
    """Per-stage F/I/W times (ms) and memory (bytes) for ``model`` on ``cluster``."""
    raise NotImplementedError("deriving costs from model and cluster is not implemented yet")
