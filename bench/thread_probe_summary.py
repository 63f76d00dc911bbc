"""Read ``bench/thread_probe``'s records: one collective in the calibration run beside the same in the run.

For each launch folder (``probe-<pid>.jsonl`` files, or gzipped, one line per trainer: ``method`` ``calibration``
for the profile's calibration run, the schedule's method for the run), per pipeline rank and ``--action`` (default
``3REDUCE_GRAD``), the medians over the steps after the first of: the action's span on its communication thread
(ms, from its work's start, before its peer joined), the process's minor faults inside it, and per kind of thread
(``compute``: the process's main thread; ``comm``: its other Python thread, the communication stream;
``gloo``: gloo's ``pt_gloo_runloop`` / ``gloo_tcp_loop`` threads) the ms on a core and the ms ready but waiting
for one; the cores its threads last ran on; and per step the process's faults and its compute thread's waiting ms.
``faulted``: the intervals with over :data:`FAULTED` minor faults. ``--json`` prints the same as one JSON object
per launch. Run: ``python bench/thread_probe_summary.py DIR …``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from pathlib import Path
from typing import Any

ON_CORE, WAITING, FAULTS = 5, 6, 1


def kind(tid: str, name: str, pid: int) -> str:
    """The thread's kind: compute (the main thread), comm (another Python thread), gloo, or other."""
    if int(tid) == pid:
        return "compute"
    if name.startswith(("pt_gloo", "gloo")):
        return "gloo"
    return "comm" if name.startswith("python") else "other"


def split(row: dict[str, Any], pid: int) -> dict[str, float]:
    """One interval's totals: faults, and per kind on-core and waiting ms."""
    out: dict[str, float] = {"faults": 0.0}
    for tid, values in row["threads"].items():
        k = kind(tid, values[0], pid)
        out["faults"] += values[FAULTS]
        out[f"{k}_on"] = out.get(f"{k}_on", 0.0) + values[ON_CORE]
        out[f"{k}_wait"] = out.get(f"{k}_wait", 0.0) + values[WAITING]
    out["ms"] = row["ms"]
    out["cores"] = len({v[4] for v in row["threads"].values() if v[ON_CORE] > 0})
    return out


#: Minor faults in one interval above which a 10.5 MB buffer's pages were faulted afresh (gpt-small's last stage:
#: 2,570 pages of 4 KiB).
FAULTED = 1000


def medians(rows: list[dict[str, float]]) -> dict[str, float]:
    """Each value's median over ``rows``, their count ``n`` and ``faulted``: how many had over :data:`FAULTED`."""
    keys = sorted({k for r in rows for k in r})
    found = {k: round(statistics.median(r.get(k, 0.0) for r in rows), 2) for k in keys}
    return found | {"n": len(rows), "faulted": sum(r["faults"] > FAULTED for r in rows)}


def launch(folder: Path, action: str) -> dict[str, Any]:
    """Per (method, pipeline rank): the action's medians and the steps' medians, steps after the first."""
    files = sorted(folder.glob("probe-*.jsonl")) + sorted(folder.glob("probe-*.jsonl.gz"))
    texts = [gzip.decompress(f.read_bytes()).decode() if f.suffix == ".gz" else f.read_text() for f in files]
    records = [json.loads(line) for text in texts for line in text.splitlines()]
    out: dict[str, Any] = {}
    for record in records:
        method = "calibration" if record["method"] == "calibration" else "run"
        key = f"{method} pp{record['pp']}"
        pid = record["pid"]
        actions = [split(a, pid) for a in record["actions"] if a["action"] == action and a["step"] > 0]
        steps = [split(s, pid) for s in record["steps"] if s["step"] > 0]
        out.setdefault(key, {"action": [], "step": []})
        out[key]["action"] += actions
        out[key]["step"] += steps
    return {key: {part: medians(rows) for part, rows in value.items() if rows} for key, value in sorted(out.items())}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", type=Path, nargs="+")
    parser.add_argument("--action", default="3REDUCE_GRAD")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    for folder in args.folders:
        found = launch(folder, args.action)
        if args.json:
            print(json.dumps({"folder": str(folder), "action": args.action, **found}))
            continue
        print(f"== {folder} ({args.action}; medians of steps after the first, both replicas pooled)")
        for key, parts in found.items():
            for part, values in parts.items():
                print(f"  {key:16} {part:6} " + " ".join(f"{k}={v:g}" for k, v in values.items()))


if __name__ == "__main__":
    main()
