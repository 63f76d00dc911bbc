"""Does computing with two weight versions in turn (PipeDream-2BW's steady state) slow a pass against one version?

gpt-small's two stages (of 2), one thread, pinned to a core; per block 8 microbatches of F then the fused backward on
both stages, every microbatch on the same module (one version) or on two copies in turn (two versions); 12 blocks of
each, interleaved, the order turned every block. Prints the medians and the paired differences.

Run: ``python -m bench.two_versions_check [core]`` (under the machine's heavy lock).
"""

from __future__ import annotations

import copy
import os
import statistics
import sys
import time

import torch

from pipesched.runtime.models import load_model
from tests.conftest import uniform_problem


def main() -> None:
    os.sched_setaffinity(0, {int(sys.argv[1]) if len(sys.argv) > 1 else 0})
    torch.set_num_threads(1)
    model = load_model("gpt-small", uniform_problem(2, 8))
    stages = [model.build_stage(0), model.build_stage(1)]
    tokens, target = model.make_microbatch(0)
    with torch.no_grad():
        hidden = stages[0](tokens)
    versions = [[stage, copy.deepcopy(stage)] for stage in stages]

    def one(stage: int, module: torch.nn.Module) -> None:
        x = tokens if stage == 0 else hidden.detach().requires_grad_(True)
        out = module(x)
        loss = model.loss_fn(out, target) if stage == 1 else out.float().pow(2).mean()
        loss.backward()

    def block(two: bool, microbatches: int = 8) -> float:
        total = 0.0
        for j in range(microbatches):
            for stage in (0, 1):
                started = time.perf_counter()
                one(stage, versions[stage][j % 2 if two else 0])
                total += (time.perf_counter() - started) * 1e3
        for pair in versions:
            for module in pair:
                for p in module.parameters():
                    p.grad = None
        return total

    block(False)
    block(True)
    one_version: list[float] = []
    two_versions: list[float] = []
    for r in range(12):
        for two in (False, True) if r % 2 == 0 else (True, False):
            (two_versions if two else one_version).append(block(two))
    a, b = statistics.median(one_version), statistics.median(two_versions)
    print(
        f"8 microbatches F+B both stages: one version {a:.1f} ms, two versions in turn {b:.1f} ms "
        f"({100 * (b / a - 1):+.1f} %); paired differences "
        + ", ".join(f"{y - x:+.0f}" for x, y in zip(one_version, two_versions, strict=True))
    )


if __name__ == "__main__":
    main()
