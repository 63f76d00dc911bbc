"""The bar: on the Zero Bubble paper's own inputs, auto is never worse than the paper's ZB-1p / ZB-2p.

Objective stage_span, split backward, memory limit 1.0 and 2.0 × num_ranks · activation (the paper's
ZB-1p and ZB-2p settings); and more memory is never worse than the warm starts at less (3.0 × ≤ ZB-2p).
"""

from __future__ import annotations

import pytest

from pipesched.optimizer.solve import solve
from tests.conftest import paper_problem, paper_settings, stop_on_reaching

SETTINGS = [s for s in paper_settings() if s["num_ranks"] <= 16 and s["num_microbatches"] <= 64]


#: The time each search may take: generous, since the test is about what auto reaches, not how soon. Each search
#: stops once it reaches its paper's figure (or proves its bound): idle, the eight settings take 1.5 s in all
#: (27 s when 2.0× and 3.0× searched their whole 3 s). At 1.5 s a loaded machine (two busy loops beside four test
#: workers on two cores) had left auto only its sequential schedule for 14.6B at p 16, m 64, ZB-1p's memory
#: (24,349 ms against 2,202): the families, priced by the compile's time, no longer fit in what was left.
LIMIT_S = 30.0


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: f"{s['model']}-p{s['num_ranks']}-m{s['num_microbatches']}")
def test_auto_never_worse_than_the_papers_schedules(setting: dict) -> None:
    p, activation = setting["num_ranks"], setting["activation"]
    published = setting["published_stage_span_ms"]
    spans = {}
    # 2.0× and 3.0×'s answers are the best of the authors' scheduler on two and four rungs, reached after the bound
    # and the families' warm starts; 1.0×'s is a family's (ZB-1p's order), proven optimal by the bound.
    for factor, target in ((1.0, published["ZB-1p"]), (2.0, published["ZB-2p"]), (3.0, published["ZB-2p"])):
        problem = paper_problem(setting, **{"memory.limit": factor * p * activation, "solver.time_limit_s": LIMIT_S})
        progress, reached = stop_on_reaching(target)
        schedule = solve(problem, progress=progress, should_stop=reached)
        assert schedule.status in ("optimal", "feasible")
        assert max(schedule.peak_memory) <= factor * p * activation
        assert schedule.lower_bound is not None and schedule.lower_bound <= schedule.stage_span + 1e-6
        assert schedule.stage_span <= target + 1e-6, (factor, schedule.backend)
        spans[factor] = schedule.stage_span
    # More memory is never worse than the warm starts at less: the authors' scheduler runs on a ladder of
    # lower limits (1.0× gives ZB-1p, 2.0× gives ZB-2p). Two time-limited searches are not compared with
    # each other: which of them finds a last 0.05% depends on the load of the machine.
    assert spans[2.0] <= spans[1.0] + 1e-6
