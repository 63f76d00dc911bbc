"""The transformer cost model split by what it models: :mod:`.flops` (parameters and FLOPs),
:mod:`.memory` (activation and static bytes), :mod:`.collectives` (ring collective times).

:mod:`pipesched.optimizer.costmodel` puts them together into per-stage times and memory.
"""
