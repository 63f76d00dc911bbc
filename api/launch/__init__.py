"""From a plan to a running job: the files ``pipesched launch`` and ``GET /v1/plans/{id}/launch`` give.

:mod:`.bundle` builds one plan's files, :mod:`.schedulers` renders the job scheduler's file, :mod:`.command`
is the command line; the argv of torchtitan and Megatron-LM are :mod:`pipesched.optimizer.planner.launch`'s.
"""
