"""BitPipe as its authors wrote it (Wu et al. 2024, arXiv 2410.19367; their Megatron-LM fork's
``bitpipe_schedule.py``), with its eager gradient synchronisation between the two replicas in the step model.

The expected orders below were derived by hand from the fork's algorithm (its per-rank microbatch index lists
``get_microbatch_idx``/``get_bkmicrobatch_idx``, whose comments list the p = 4, m = 8 sequences, and its phases:
warm-up, 1F1B pairs, cool-down), then mapped to our ids: down replica microbatches 0 … m/2−1 on stage ids
0 … 2p−1 (rank r holds r and 2p−1−r), up replica microbatches m/2 … m−1 on ids 2p … 4p−1 (rank r holds
3p−1−r and 3p+r). They hold on the fork's own domain: even p, m a multiple of p.
"""

from __future__ import annotations

import pytest

from pipesched.optimizer.derive import load_problem
from pipesched.optimizer.families import FamilyDomainError, get_family
from pipesched.optimizer.ir import ActionKind
from pipesched.optimizer.solve import solve_family
from tests.conftest import uniform_problem

# p = 4, m = 4: warm-up of w = 6, 7, 7, 6 forwards, then u = 2, 1, 1, 2 pairs (F, B), then the backwards.
AUTHORS_P4_M4 = [
    "0F0 0F1 11F2 12F2 11F3 12F3 7F0 7B0 7F1 7B1 12B2 11B2 12B3 11B3 0B0 0B1",
    "1F0 10F2 1F1 10F3 13F2 6F0 13F3 6F1 6B0 13B2 6B1 13B3 10B2 1B0 10B3 1B1",
    "9F2 2F0 9F3 2F1 5F0 14F2 5F1 14F3 14B2 5B0 14B3 5B1 2B0 9B2 2B1 9B3",
    "8F2 8F3 3F0 4F0 3F1 4F1 15F2 15B2 15F3 15B3 4B0 3B0 4B1 3B1 8B2 8B3",
]

# p = 4, m = 8, rank 0: the fork's comment lists its forward index sequence [0, 1, 2, 10, 3, 11, 8, 9, 4, 5, 6,
# 14, 7, 15, 12, 13] and backward [8, 9, 10, 2, 11, 3, 0, 1, 12, 13, 14, 6, 15, 7, 4, 5] (ids 0, 1, 4, 5: down
# replica first arm; 2, 3, 6, 7: up first arm; 8, 9, 12, 13: down second arm; 10, 11, 14, 15: up second arm).
# Two blocks: warm-up 6, 2 pairs, 5 backwards, 1 pair, 5 forwards, then 2 pairs and 6 backwards.
AUTHORS_P4_M8_RANK0 = (
    "0F0 0F1 11F4 12F4 11F5 12F5 7F0 7B0 7F1 7B1 12B4 11B4 12B5 11B5 0B0 0F2 0B1 0F3 11F6 12F6 11F7 12F7 "
    "7F2 7B2 7F3 7B3 12B6 11B6 12B7 11B7 0B2 0B3"
)


def _bitpipe(num_ranks: int, num_microbatches: int, *, reduce_grad: float = 0.5, split_backward: bool = False):  # type: ignore[no-untyped-def]
    return uniform_problem(
        num_ranks,
        num_microbatches,
        stages_per_rank=2,
        placement="bidirectional",
        split_backward=split_backward,
        reduce_grad=reduce_grad,
    )


def _rows(orders) -> list[str]:  # type: ignore[no-untyped-def]
    return [" ".join(str(action) for action in row) for row in orders]


def test_the_authors_order_at_p4_m4() -> None:
    assert _rows(get_family("bitpipe").generate(_bitpipe(4, 4))) == AUTHORS_P4_M4


def test_the_authors_order_at_p4_m8_with_a_middle_block() -> None:
    assert _rows(get_family("bitpipe").generate(_bitpipe(4, 8)))[0] == AUTHORS_P4_M8_RANK0


def test_split_backward_writes_each_backward_as_i_then_w() -> None:
    split = get_family("bitpipe").generate(_bitpipe(4, 4, split_backward=True))
    fused = AUTHORS_P4_M4[0].split()
    written = [str(a) for a in split[0]]
    assert written == [
        x for cell in fused for x in ([cell] if "F" in cell else [cell.replace("B", "I"), cell.replace("B", "W")])
    ]


def test_outside_the_forks_domain_is_a_clear_error() -> None:
    with pytest.raises(FamilyDomainError, match="num_microbatches a multiple of num_ranks") as error:
        get_family("bitpipe").generate(_bitpipe(4, 6))
    assert "use num_microbatches 8" in str(error.value)


def test_the_replicas_synchronisation_is_costed_without_data_parallelism() -> None:
    """d = 1: each stage id's REDUCE_GRAD (the all-reduce with its mirror replica's copy) waits for both
    replicas' last backward of the stage, runs on the communication stream, and only the last is exposed."""
    schedule = solve_family(_bitpipe(4, 8, reduce_grad=0.5), "bitpipe")
    free = solve_family(_bitpipe(4, 8, reduce_grad=0.0), "bitpipe")
    assert not any(a.kind == "REDUCE_GRAD" for r in free.ranks for a in r.actions)
    actions = {a.action: a for r in schedule.ranks for a in r.actions if a.kind != "OPTIMIZER_STEP"}
    reductions = [a for a in actions.values() if a.kind == ActionKind.REDUCE_GRAD]
    assert len(reductions) == 4 * 4  # four stage ids per rank
    stages = 2 * 4
    for reduction in reductions:
        assert reduction.stage is not None
        mirror = (reduction.stage + stages) % (2 * stages)
        last = max(a.end for a in actions.values() if a.kind == "B" and a.stage in (reduction.stage, mirror))
        assert reduction.start >= last - 1e-9 and reduction.end - reduction.start == pytest.approx(0.5)
    assert schedule.makespan == pytest.approx(free.makespan + 0.5)


def test_a_bidirectional_problem_without_the_synchronisation_cost_is_refused() -> None:
    with pytest.raises(ValueError, match=r"costs\.reduce_grad") as error:
        uniform_problem(4, 8, stages_per_rank=2, placement="bidirectional")
    assert "BitPipe's eager synchronisation" in str(error.value)


def test_the_synchronisation_is_derived_from_the_model() -> None:
    """With model and cluster: the all-reduce of each stage's fp32 gradients over the two replicas' ranks, what a
    DDP all-reduce of the same stage over two data-parallel copies costs (a ring of 2, whose formula
    tests/optimizer/test_data_parallel.py pins); no optimizer or gather cost (there is no data parallelism)."""
    model = {"num_layers": 16, "hidden_size": 1024, "num_attention_heads": 16, "seq_length": 1024, "vocab_size": 32000}
    cluster = {"accelerator": "A100-80GB", "gpus_per_node": 8, "intra_node_bandwidth_bytes_per_s": 200e9}
    pipeline = {"num_ranks": 4, "num_microbatches": 8, "stages_per_rank": 2}
    bidirectional = load_problem(
        {"pipeline": {**pipeline, "placement": "bidirectional"}, "model": model, "cluster": cluster}
    )
    replicated = load_problem(
        {
            "pipeline": {**pipeline, "placement": "v"},
            "model": model,
            "cluster": cluster,
            "data_parallel": {"size": 2, "sharding": "none"},
            "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1},
            "memory": {"activation": 1},
        }
    )
    assert bidirectional.costs is not None and bidirectional.costs.reduce_grad is not None
    assert replicated.costs is not None and replicated.costs.reduce_grad is not None
    assert bidirectional.stage_values(bidirectional.costs.reduce_grad) == pytest.approx(
        replicated.stage_values(replicated.costs.reduce_grad)
    )
    assert min(bidirectional.stage_values(bidirectional.costs.reduce_grad)) > 0
    assert bidirectional.costs.optimizer_step is None and bidirectional.costs.unshard is None
    assert bidirectional.has_step_actions


@pytest.mark.parametrize(("num_microbatches", "bitpipe_ms", "interleaved_ms"), [(4, 28.5, 33.0), (8, 54.5, 57.0)])
def test_bitpipe_within_interleaved_one_f_one_b_at_small_batches(
    num_microbatches: int, bitpipe_ms: float, interleaved_ms: float
) -> None:
    """Issue 27's bar: p = 4, F = 1 ms and B = 2 ms per stage, fused, no limit, the replicas' all-reduce 0.5 ms
    per stage: the authors' order at most interleaved 1F1B (v = 2, no replicas to synchronise) at m = 4 and 8,
    at the same peak (8 stage activations per rank) or lower."""
    bitpipe = solve_family(_bitpipe(4, num_microbatches), "bitpipe")
    interleaved = solve_family(
        uniform_problem(4, num_microbatches, stages_per_rank=2, split_backward=False), "interleaved-1f1b"
    )
    assert (bitpipe.makespan, interleaved.makespan) == (bitpipe_ms, interleaved_ms)
    assert max(bitpipe.peak_memory) <= max(interleaved.peak_memory)


def test_at_many_microbatches_interleaved_catches_up() -> None:
    """Where the bidirectional fill no longer pays: p = 4, m = 16 (4 blocks) the authors' order runs each
    block's 2p backwards with a cool-down of w − u + 1 backwards in a row, 106 ms of compute, while interleaved
    1F1B's steady state is bubble-free (105 ms); plus the exposed last all-reduce (0.5 ms)."""
    bitpipe = solve_family(_bitpipe(4, 16), "bitpipe")
    interleaved = solve_family(uniform_problem(4, 16, stages_per_rank=2, split_backward=False), "interleaved-1f1b")
    assert (bitpipe.makespan, interleaved.makespan) == (106.5, 105.0)
