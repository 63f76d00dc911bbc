"""From a plan to a running job: the files ``pipesched launch`` and ``GET /v1/plans/{id}/launch`` give.

:mod:`.bundle` builds one plan's files and :mod:`.schedulers` renders the job scheduler's file;
:mod:`pipesched.api.cli.launch` is the command line. The argv of torchtitan and Megatron-LM are
:mod:`pipesched.optimizer.planner.launch`'s.
"""
