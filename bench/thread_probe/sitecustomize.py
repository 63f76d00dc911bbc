"""Per-thread counters of the rank processes, around every step and every communication action (a bench probe).

Put this folder first on ``PYTHONPATH`` and set ``PIPESCHED_THREAD_PROBE`` to a folder: every Python process
started then (the launcher's fork server, so every rank process of a profile and of a run) imports this module at
start-up and wraps :meth:`pipesched.runtime.training.RankTrainer.step` and
:meth:`pipesched.runtime.streams.CommunicationStream.submit`. Around each step (outside its timed part: before
its barrier, after its record) and around each communication action's work (on the communication thread, where it
starts and where its work returns) it reads every thread of the process from ``/proc/self/task``: its name, minor
and major page faults, user and system CPU time (clock ticks → ms), the core it last ran on, and from
``schedstat`` its time on a core and its time ready but waiting for one (ns → ms) and its time slices; and the
machine's per-core steal ticks from ``/proc/stat``. At each trainer's first and last step it also keeps ``ss
-tmie`` of the process's own TCP sockets (receive and send buffers, ``rcv_space``, retransmits). Each process
appends one JSON line per trainer (``probe-<pid>.jsonl``) when its run returns: its global rank, its schedule's
method (``calibration`` for a profile's calibration run), per step the deltas per thread, per action the same.
Nothing of the runtime's own records changes; the reads cost about 0.1–0.3 ms each, outside the step's timing but
inside the action's (they are part of the communication thread's work there).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import subprocess
import threading
import time
from typing import Any

TICK_MS = 1000.0 / os.sysconf("SC_CLK_TCK")


def threads() -> dict[int, list[Any]]:
    """tid → [name, minflt, majflt, cpu ms (user + system), last core, on-core ms, waiting ms, slices]."""
    found: dict[int, list[Any]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                raw = f.read()
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                run, wait, slices = (int(x) for x in f.read().split())
        except (OSError, ValueError):
            continue
        name = raw[raw.index("(") + 1 : raw.rindex(")")]
        fields = raw[raw.rindex(")") + 2 :].split()
        # fields[0] is stat's 3rd field (state): minflt 10, majflt 12, utime 14, stime 15, processor 39
        found[int(tid)] = [
            name,
            int(fields[7]),
            int(fields[9]),
            (int(fields[11]) + int(fields[12])) * TICK_MS,
            int(fields[36]),
            run / 1e6,
            wait / 1e6,
            slices,
        ]
    return found


def steal() -> list[int]:
    """Steal ticks of each core (``/proc/stat``, the 8th value of each ``cpuN`` line)."""
    with open("/proc/stat") as f:
        return [int(line.split()[8]) for line in f if line.startswith("cpu") and line[3].isdigit()]


def snapshot() -> dict[str, Any]:
    return {"t": time.perf_counter(), "threads": threads(), "steal": steal()}


def delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Per thread (tid: name, minflt, majflt, cpu ms, core at the end, on-core ms, waiting ms, slices) over the
    interval; threads born inside it count from zero."""
    rows = {}
    for tid, now in after["threads"].items():
        was = before["threads"].get(tid, [now[0], 0, 0, 0.0, now[4], 0.0, 0.0, 0])
        rows[tid] = [
            now[0],
            now[1] - was[1],
            now[2] - was[2],
            round(now[3] - was[3], 1),
            now[4],
            round(now[5] - was[5], 2),
            round(now[6] - was[6], 2),
            now[7] - was[7],
        ]
    return {
        "ms": round((after["t"] - before["t"]) * 1e3, 2),
        "threads": rows,
        "steal": [b - a for a, b in zip(before["steal"], after["steal"], strict=False)],
    }


def sockets() -> str:
    """``ss -tmie`` lines of this process's TCP sockets (by inode), or the error's text."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    try:
        text = subprocess.run(["ss", "-tmieH"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError) as error:
        return f"{type(error).__name__}: {error}"
    lines, keep = [], False
    for line in text.splitlines():
        if not line.startswith((" ", "\t")):
            keep = any(f"ino:{inode} " in line or line.endswith(f"ino:{inode}") for inode in inodes)
        if keep:
            lines.append(line.strip())
    return "\n".join(lines)


def tcp_sockets(least_bytes: int = 1 << 20) -> list[list[int]]:
    """This process's TCP sockets that have received at least ``least_bytes``: [fd, SO_RCVBUF, SO_SNDBUF (bytes, as
    the kernel's autotuning left them), ``tcpi_rcv_space``, ``tcpi_rcv_ssthresh``, ``tcpi_total_retrans``,
    ``tcpi_bytes_received``] (``struct tcp_info`` offsets 96, 64, 100, 128: Linux's ``include/uapi/linux/tcp.h``)."""
    rows = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:["):
                continue
            sock = socket.fromfd(int(fd), socket.AF_INET, socket.SOCK_STREAM)
        except OSError:
            continue
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 136)
            received = struct.unpack_from("Q", info, 128)[0]
            if received >= least_bytes:
                rows.append(
                    [
                        int(fd),
                        sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF),
                        sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF),
                        struct.unpack_from("I", info, 96)[0],
                        struct.unpack_from("I", info, 64)[0],
                        struct.unpack_from("I", info, 100)[0],
                        received,
                    ]
                )
        except OSError:
            pass
        finally:
            sock.close()
    return rows


class Probe:
    """One trainer's records (see the module docstring)."""

    def __init__(self, trainer: Any) -> None:
        self.rank = trainer.global_rank
        self.pp_rank, self.dp_rank = trainer.pp_rank, trainer.dp_rank
        self.steps: list[dict[str, Any]] = []
        self.actions: list[dict[str, Any]] = []
        self.sockets: list[str] = []
        self.lock = threading.Lock()

    def write(self, method: str) -> None:
        folder = os.environ["PIPESCHED_THREAD_PROBE"]
        record = {
            "pid": os.getpid(),
            "rank": self.rank,
            "pp": self.pp_rank,
            "dp": self.dp_rank,
            "method": method,
            "utc": time.strftime("%H:%M:%S", time.gmtime()),
            "steps": self.steps,
            "actions": self.actions,
            "sockets": self.sockets,
        }
        with open(os.path.join(folder, f"probe-{os.getpid()}.jsonl"), "a") as out:
            out.write(json.dumps(record) + "\n")


def install() -> None:
    """Wrap the trainer's step and run and the stream's submit (module docstring)."""
    from pipesched.runtime import streams, training

    step, run, submit = training.RankTrainer.step, training.RankTrainer.run, streams.CommunicationStream.submit

    def probed_step(self: Any, number: int, **kwargs: Any) -> Any:
        probe = self.__dict__.setdefault("_probe", Probe(self))
        self.stream._probe = probe
        if number == 0:
            probe.sockets.append(sockets())
        before = snapshot()
        record = step(self, number, **kwargs)
        probe.steps.append({"step": number, **delta(before, snapshot()), "tcp": tcp_sockets()})
        if kwargs.get("last"):
            probe.sockets.append(sockets())
        return record

    def probed_run(self: Any) -> Any:
        result = run(self)
        probe = self.__dict__.get("_probe")
        if probe is not None:
            probe.write(str(getattr(self.program, "method", "") or self._method))
        return result

    def probed_submit(self: Any, action: str, work: Any) -> Any:
        probe = getattr(self, "_probe", None)
        if probe is None:
            return submit(self, action, work)
        step_number = len(probe.steps)

        def measured() -> Any:
            before = snapshot()
            try:
                return work()
            finally:
                row = {"step": step_number, "action": action, **delta(before, snapshot())}
                with probe.lock:
                    probe.actions.append(row)

        return submit(self, action, measured)

    init = training.RankTrainer.__init__

    def probed_init(self: Any, job: Any, *args: Any, **kwargs: Any) -> None:
        init(self, job, *args, **kwargs)
        self._method = getattr(job.schedule, "method", "")

    training.RankTrainer.step = probed_step  # type: ignore[method-assign]
    training.RankTrainer.run = probed_run  # type: ignore[method-assign]
    training.RankTrainer.__init__ = probed_init  # type: ignore[method-assign]
    streams.CommunicationStream.submit = probed_submit  # type: ignore[method-assign]


if os.environ.get("PIPESCHED_THREAD_PROBE"):
    with contextlib.suppress(ImportError):  # an interpreter without pipesched (pip, tools): nothing to probe
        install()
