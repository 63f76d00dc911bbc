"""The bar: on the Zero Bubble paper's own inputs, auto is never worse than the paper's ZB-1p / ZB-2p.

Objective stage_span, split backward, memory limit 1.0 and 2.0 × num_ranks · activation (the paper's
ZB-1p and ZB-2p settings); and more memory never gives a worse answer (3.0 × ≤ 2.0 ×).
"""

from __future__ import annotations

import pytest

from optimizer.solve import solve
from tests.conftest import paper_problem, paper_settings

SETTINGS = [s for s in paper_settings() if s["num_ranks"] <= 16 and s["num_microbatches"] <= 64]


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: f"{s['model']}-p{s['num_ranks']}-m{s['num_microbatches']}")
def test_auto_never_worse_than_the_papers_schedules(setting: dict) -> None:
    p, activation = setting["num_ranks"], setting["activation"]
    spans = {}
    for factor, published in ((1.0, "ZB-1p"), (2.0, "ZB-2p"), (3.0, None)):
        problem = paper_problem(setting, **{"memory.limit": factor * p * activation, "solver.time_limit_s": 1.5})
        schedule = solve(problem)
        assert schedule.status in ("optimal", "feasible")
        assert max(schedule.peak_memory) <= factor * p * activation
        assert schedule.lower_bound is not None and schedule.lower_bound <= schedule.stage_span + 1e-6
        spans[factor] = schedule.stage_span
        if published is not None:
            assert schedule.stage_span <= setting["published_stage_span_ms"][published] + 1e-6, published
    assert spans[3.0] <= spans[2.0] + 1e-6 <= spans[1.0] + 2e-6
