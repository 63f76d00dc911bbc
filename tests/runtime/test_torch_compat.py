"""torch 2.11's stage warm-up on gloo: each stage's p2p warm-up with its neighbours includes a neighbour on its own
rank (a V placement puts stages 1 and 2 on pipeline rank 1), which gloo cannot send to. The runtime drops those
operations (:func:`pipesched.runtime.torch_compat._without_own_rank`). Two real gloo processes run the warm-up as
torch 2.11's ``_PipelineScheduleMulti._initialize_stages`` does, on whatever torch is installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

WARM_UP = """
import datetime, sys
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from pipesched.runtime.torch_compat import _without_own_rank

rank, store_path, filtered = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "filtered"
dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=15))
v_placement = {0: 0, 1: 1, 2: 1, 3: 0}
stages = []
for index in sorted(s for s, r in v_placement.items() if r == rank):
    stage = PipelineStage(nn.Linear(4, 4), stage_index=index, num_stages=4, device=torch.device("cpu"))
    stage.stage_index_to_group_rank = dict(v_placement)
    stages.append(stage)
operations = [op for stage in stages for op in (_without_own_rank(stage)() if filtered else
              stage._get_init_p2p_neighbors_ops())]
print("peers", sorted(op.group_peer for op in operations), flush=True)
try:
    for work in dist.batch_isend_irecv(operations):
        work.wait()
    print("warmed up", flush=True)
except RuntimeError as error:
    print("failed:", str(error).splitlines()[0], flush=True)
dist.destroy_process_group()
"""


def _warm_up(tmp_path: Path, mode: str) -> list[str]:
    store = tmp_path / f"store-{mode}"
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", WARM_UP, str(rank), str(store), mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = []
    for process in processes:
        try:
            out, _ = process.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            raise
        outputs.append(out)
    return outputs


def test_stage_warm_up_skips_the_neighbour_on_its_own_rank(tmp_path: Path) -> None:
    rank0, rank1 = _warm_up(tmp_path, "filtered")
    # rank 0 (stages 0 and 3) talks to rank 1 both ways for each; rank 1 (stages 1 and 2) keeps only rank 0
    assert "peers [1, 1, 1, 1]" in rank0 and "warmed up" in rank0, rank0
    assert "peers [0, 0, 0, 0]" in rank1 and "warmed up" in rank1, rank1


def test_stage_warm_up_of_every_neighbour_fails_on_gloo(tmp_path: Path) -> None:
    """What the filter is for: the same warm-up with rank 1's stage 1 → stage 2 operations (to itself) kept."""
    _, rank1 = _warm_up(tmp_path, "every")
    assert "peers [0, 0, 0, 0, 1, 1, 1, 1]" in rank1, rank1
    assert "Pair is not connected" in rank1, rank1
