"""Layered gradient accumulation with modular pipeline parallelism (Lamy-Poirier, "Layered gradient
accumulation and modular pipeline parallelism: fast and efficient training of large language models", 2021).

One layer per stage, placed modularly: layer l on rank ``l mod p`` (the ``"loop"`` placement with
``stages_per_rank = num_layers / p``). Every microbatch passes a layer before the next layer starts
(Sec. 3, "layered gradient accumulation"), forward up and backward down, so each layer's gradient
reduction (``{l}REDUCE_GRAD``, placed by :mod:`pipesched.optimizer.communication` right after the layer's
last backward) and each layer's weight gather overlap the remaining layers' compute (Sec. 3–4).

Identical to breadth-first at one layer per stage, on purpose: the paper's layer-wise order (Sec. 3: every
microbatch's forward through layer l before layer l+1, backwards layer by layer in reverse) *is*
:mod:`.looped_bfs`'s order when each stage is one layer (both run a rank's local stages in turn, all
microbatches through each), and its per-layer reduction and single gather per run are what the communication
pass gives every stage of a ``gather_runs`` family. What sets the family apart is its domain: with a ``model``
given, the pipeline must have one stage per layer (``tests/optimizer/test_families.py`` asserts both).
"""

from __future__ import annotations

import dataclasses

from pipesched.optimizer.families._base import FamilySpec, require
from pipesched.optimizer.families.looped_bfs import BREADTH_FIRST_ESTIMATE
from pipesched.optimizer.families.looped_bfs import _build as _breadth_first
from pipesched.optimizer.problem import Problem


def _check(problem: Problem) -> None:
    pipeline = problem.pipeline
    if problem.model is not None:
        layers = problem.model.num_layers
        fix = (
            f"set stages_per_rank to {layers // pipeline.num_ranks}"
            if layers % pipeline.num_ranks == 0
            else f"use a num_ranks dividing {layers}"
        )
        require(
            pipeline.num_stages == layers,
            "lga",
            f"needs one layer per stage: the model has {layers} layers but the pipeline has {pipeline.num_stages} "
            f"stages: {fix} so that num_ranks × stages_per_rank = {layers}",
        )


FAMILIES = [
    FamilySpec(
        name="lga",
        description="Layered gradient accumulation + modular pipeline: one layer per stage, layer l on rank l mod p, "
        "all microbatches through a layer before the next, each layer's reduction right after its last backward.",
        build=_breadth_first,
        listing_order=130,
        stages_per_rank=range(1, 65),
        domain_note="one layer per stage (num_stages = model.num_layers when a model is given)",
        check_problem=_check,
        # looped-bfs's order (module docstring) at one layer per stage: tried when search.method names it.
        planner=dataclasses.replace(BREADTH_FIRST_ESTIMATE, by_default=False),
        gather_runs=True,  # a stage's weights gathered once per run of its microbatches (Sec. 4)
    )
]
