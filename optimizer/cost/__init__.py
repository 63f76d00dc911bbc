"""The transformer cost model split by what it models: :mod:`.flops` (parameters and FLOPs),
:mod:`.memory` (activation and static bytes), :mod:`.collectives` (ring collective times, the
data-parallel step's collectives and memory, tensor-parallel communication).

:mod:`pipesched.optimizer.cost.stages` puts them together into per-stage times and memory.
"""
