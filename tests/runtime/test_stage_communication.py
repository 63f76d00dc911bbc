"""Which thread issues a data-parallel group's collectives: FSDP2 modules that reshard after forward gather inside
their passes on the compute thread, so a pass waits until the communication stream has run what it was given
(two threads' collectives on one group are matched out of order across replicas: gloo aborts on the size)."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")


def _stages(*, reshard_after_forward: bool):  # type: ignore[no-untyped-def]
    from pipesched.runtime.data_parallel import DataParallelStages, MirrorGradients
    from pipesched.runtime.streams import CommunicationStream

    stream = CommunicationStream(torch.device("cpu"))
    mirrors = MirrorGradients([0], [0], size=1, pp_rank=0, dp_rank=0)
    stages = DataParallelStages(
        {},
        group=None,
        size=2,
        sharded=True,
        mirrors=mirrors,
        stream=stream,
        reshard_after_forward=reshard_after_forward,
    )
    return stages, stream


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_a_pass_that_gathers_its_own_weights_waits_for_the_communication_stream(reshard_after_forward: bool) -> None:
    stages, stream = _stages(reshard_after_forward=reshard_after_forward)
    release = threading.Event()
    try:
        pending = stream.submit("2UNSHARD", lambda: release.wait(5))  # another stage's gather, still running
        if reshard_after_forward:
            threading.Timer(0.2, release.set).start()
            stages.before_pass(0, 5.0)
            assert pending.done  # the pass's own gathers start only once the stream is idle
        else:
            stages.before_pass(0, 5.0)  # no collective inside the pass: it overlaps the gather
            assert not pending.done
    finally:
        release.set()
        stream.close()


class _Job:
    def __init__(self, workdir: str) -> None:
        self.workdir = workdir


def _warm(job: _Job, global_rank: int, device: object, timeout_s: float) -> tuple[list[float], list[float]]:
    """Two modules (the larger 64 × 64 + 64 weights) over a 2-process dp group: the warm-up's rounds; then a
    collective of another size on the same group, still matched (the warm-up left both processes in step)."""
    import torch.distributed as dist

    from pipesched.runtime.data_parallel import DataParallelStages, MirrorGradients
    from pipesched.runtime.streams import CommunicationStream

    modules = {0: torch.nn.Linear(64, 64), 2: torch.nn.Linear(8, 8)}
    stream = CommunicationStream(torch.device("cpu"))
    mirrors = MirrorGradients([0, 0], [0, 1], size=2, pp_rank=0, dp_rank=global_rank)
    stages = DataParallelStages(modules, group=dist.group.WORLD, size=2, sharded=False, mirrors=mirrors, stream=stream)
    took = stages.warm_transport(3)
    total = torch.tensor([float(global_rank + 1)])
    dist.all_reduce(total)
    stream.close()
    return took, total.tolist()


def test_the_dp_group_carries_full_size_messages_before_the_first_step_and_stays_in_step(tmp_path) -> None:
    """``warm_transport``: every process of the group all-gathers the largest stage's weights the same number of
    times (real gloo processes), each round timed; a single replica has no group to warm."""
    from pipesched.runtime.data_parallel import WARM_ROUNDS, DataParallelStages, MirrorGradients
    from pipesched.runtime.launch import launch_jobs
    from pipesched.runtime.streams import CommunicationStream

    returned = launch_jobs(_warm, [_Job(str(tmp_path))], world=2, timeout_s=120)
    assert returned is not None
    for took, total in returned[0]:
        assert len(took) == 3 and all(ms > 0 for ms in took)
        assert total == [3.0]
    stream = CommunicationStream(torch.device("cpu"))
    try:
        alone = DataParallelStages(
            {0: torch.nn.Linear(4, 4)},
            group=None,
            size=1,
            sharded=False,
            mirrors=MirrorGradients([0], [0], size=1, pp_rank=0, dp_rank=0),
            stream=stream,
        )
        assert alone.warm_transport() == [] and WARM_ROUNDS >= 6
    finally:
        stream.close()
