"""What each part of the modelled MoE step would have to cost to close a held-out row's gap (issue 28).

For every held-out row with routed experts (the context/expert-parallel sources of ``bench.cpep_bench``, each with
its own kernels and on its published layout, as that bench times it), the planner's step is timed again with one
part of the model taken out, and the part's share of the predicted step is s = 1 − t_without / t (t = 1 / the
predicted tokens/s per GPU). The parts, each a function of :mod:`pipesched.optimizer.cost.stages`:

- ``all-to-all``: the dispatch and combine of every MoE layer (:func:`~pipesched.optimizer.cost.experts.
  expert_traffic` with no bytes);
- ``memory-bound``: every elementwise pass, FP8 cast and ring-attention merge at HBM speed
  (:func:`~pipesched.optimizer.cost.timing.elementwise_ms` at zero);
- ``layer GEMMs``: every transformer layer's matrix multiplies, experts included, with their FP8 casts
  (:func:`~pipesched.optimizer.cost.stages._layer_gemm` at zero; the embedding and the head keep theirs);
- ``attention``: the attention core (:func:`~pipesched.optimizer.cost.stages.attention_ms` at zero);
- ``host floor``: the MoE layer's host time (``SoftwareProfile.moe_layer_host_ms`` at zero; a share of zero
  says no MoE layer is host-bound in the model);
- ``network``, ``NVLink``: every collective's and transfer's time between nodes, inside a node (the profile's
  ``collective_efficiency_inter`` / ``_intra`` a hundred times over: the links all but free), all-to-alls,
  gradient reductions, FSDP's gathers, tensor- and pipeline-parallel transfers alike.

With the row's published / predicted ratio r, the step is 1/r times the model's, and the part alone would have to
take f = 1 + (1/r − 1) / s times what the model charges it to close the gap. A factor of several for a part the
device measurements put within tens of percent rules it out as the row's cause. Taking a part out can change
what the planner picks where the row leaves something to it (recomputation): the share is then an upper bound.
Nothing here feeds the model.

    python -m bench.moe_components [--only SUBSTRING] [--output FILE]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

from bench.cpep_bench import _is_moe, load_rows, predict
from pipesched.optimizer.cost import stages
from pipesched.optimizer.cost.experts import ExpertTraffic
from pipesched.optimizer.cost.profile import active_catalogue, use_catalogue

RESULTS = Path(__file__).resolve().parent / "results"


def _no_traffic(*_: Any, **__: Any) -> ExpertTraffic:
    return ExpertTraffic(0.0, 0.0, 0.0, 0.0, "none")


def _zero(*_: Any, **__: Any) -> float:
    return 0.0


def _no_gemms(*_: Any, **__: Any) -> tuple[float, float, float]:
    return 0.0, 0.0, 0.0


@contextmanager
def _without_host() -> Iterator[None]:
    catalogue = active_catalogue()
    software = catalogue.software.model_copy(update={"moe_layer_host_ms": 0.0})
    with use_catalogue(catalogue.model_copy(update={"software": software})):
        yield


@contextmanager
def _links_free(field: str) -> Iterator[None]:
    catalogue = active_catalogue()
    profiles = {name: p.model_copy(update={field: 100 * getattr(p, field)}) for name, p in catalogue.profiles.items()}
    with use_catalogue(catalogue.model_copy(update={"profiles": profiles})):
        yield


#: Part name → a context in which the model charges nothing for it.
PARTS: dict[str, Callable[[], Any]] = {
    "all-to-all": lambda: mock.patch.object(stages, "expert_traffic", _no_traffic),
    "memory-bound": lambda: mock.patch.object(stages, "elementwise_ms", _zero),
    "layer GEMMs": lambda: mock.patch.object(stages, "_layer_gemm", _no_gemms),
    "attention": lambda: mock.patch.object(stages, "attention_ms", _zero),
    "host floor": _without_host,
    "network": lambda: _links_free("collective_efficiency_inter"),
    "NVLink": lambda: _links_free("collective_efficiency_intra"),
}


def _step(prediction: dict[str, Any]) -> float:
    """Seconds per token per GPU of a prediction."""
    return 1.0 / prediction["predicted_tokens_per_s_per_gpu"]


def components(row: dict[str, Any], time_limit_s: float) -> dict[str, Any]:
    """The row's prediction, each part's share of its step and the factor that part would need (module
    docstring)."""
    base = predict(row, time_limit_s)
    ratio = base["ratio"]
    parts: dict[str, dict[str, float | None]] = {}
    for name, without in PARTS.items():
        with without():
            share = 1.0 - _step(predict(row, time_limit_s)) / _step(base)
        needed = 1.0 + (1.0 / ratio - 1.0) / share if share > 1e-4 else None
        parts[name] = {"share": round(share, 4), "needed_factor": round(needed, 2) if needed else None}
    return {"id": row["id"], "ratio": ratio, "error": round(1.0 / ratio - 1.0, 4), "parts": parts}


def table(results: list[dict[str, Any]]) -> str:
    """Markdown: per row, each part's share of the predicted step and the factor it would need."""
    names = list(PARTS)
    head = " | ".join(f"{name}: share, needed ×" for name in names)
    lines = [f"| row | error | {head} |", "|---|---:|" + "---:|" * len(names)]
    for result in results:
        cells = []
        for name in names:
            part = result["parts"][name]
            needed = "—" if part["needed_factor"] is None else f"{part['needed_factor']:.2f}"
            cells.append(f"{100 * part['share']:.1f}%, {needed}")
        lines.append(f"| {result['id']} | {100 * result['error']:+.0f}% | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--time-limit", type=float, default=10.0, help="search.time_limit_s of each pinned row")
    parser.add_argument("--only", default="", help="rows whose id contains this")
    parser.add_argument("--output", type=Path, default=RESULTS / "moe_components.md")
    args = parser.parse_args()
    rows = [row for row in load_rows() if args.only in row["id"] and _is_moe(row)]
    results = [components(row, args.time_limit) for row in rows]
    args.output.write_text(table(results) + "\n")
    args.output.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
