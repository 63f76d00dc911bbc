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
