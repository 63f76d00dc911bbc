"""The bar: on the Zero Bubble paper's own inputs, auto is never worse than the paper's ZB-1p / ZB-2p.

Objective stage_span, split backward, memory limit 1.0 and 2.0 × num_ranks · activation (the paper's
ZB-1p and ZB-2p settings); and more memory is never worse than the warm starts at less (3.0 × ≤ ZB-2p).
"""

from __future__ import annotations

import pytest

from pipesched.optimizer.solve import solve
from tests.conftest import paper_problem, paper_settings

SETTINGS = [s for s in paper_settings() if s["num_ranks"] <= 16 and s["num_microbatches"] <= 64]


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: f"{s['model']}-p{s['num_ranks']}-m{s['num_microbatches']}")
def test_auto_never_worse_than_the_papers_schedules(setting: dict) -> None:
    p, activation = setting["num_ranks"], setting["activation"]
    spans = {}
    # 2.0× and 3.0× get more time: their answers are the best of the authors' scheduler on two and four rungs,
    # reached after the bound and the families' warm starts, which a run starving the solve of cores (torch
    # processes beside it) can keep busy for all of 1.5 s (14.6B at p 16, m 64: 2,372 against ZB-2p's 1,973 once).
    for factor, published, limit_s in ((1.0, "ZB-1p", 1.5), (2.0, "ZB-2p", 3.0), (3.0, None, 3.0)):
        problem = paper_problem(setting, **{"memory.limit": factor * p * activation, "solver.time_limit_s": limit_s})
        schedule = solve(problem)
        assert schedule.status in ("optimal", "feasible")
        assert max(schedule.peak_memory) <= factor * p * activation
        assert schedule.lower_bound is not None and schedule.lower_bound <= schedule.stage_span + 1e-6
        spans[factor] = schedule.stage_span
        if published is not None:
            assert schedule.stage_span <= setting["published_stage_span_ms"][published] + 1e-6, published
    # More memory is never worse than the warm starts at less: the authors' scheduler runs on a ladder of
    # lower limits (1.0× gives ZB-1p, 2.0× gives ZB-2p). Two time-limited searches are not compared with
    # each other: which of them finds a last 0.05% depends on the load of the machine.
    assert spans[2.0] <= spans[1.0] + 1e-6
    assert spans[3.0] <= setting["published_stage_span_ms"]["ZB-2p"] + 1e-6
