"""A rank's communication stream: collectives issued where the schedule places them, waited only where needed.

The contract's model of a step (Terms: communication actions) gives every rank a compute stream and a
communication stream; the simulator times UNSHARD and REDUCE_GRAD on the second one, beside the passes, each
issued when the rank reaches it in its row (:mod:`pipesched.optimizer.simulate`). :class:`CommunicationStream`
is that second stream on a real rank:

* **gloo (CPU)**: one worker thread per rank runs the actions in issue order, as a CUDA stream would. A gloo
  collective blocks only that thread (it releases the GIL), so the rank's passes go on beside it. An action may
  return a ``torch.futures.Future`` (a collective issued with ``async_op=True``): the thread then moves on and the
  action completes when the future does.
* **NCCL (GPU)**: the same thread issues on its own ``torch.cuda.Stream``, first waiting (an event) for the
  compute stream's work queued before the action was issued; an action ends when its stream work has.

:meth:`PendingCommunication.wait` is called where a dependency requires it (a stage's first pass after its
UNSHARD, the optimizer step after the REDUCE_GRADs) and records how long the compute stream was held: the
measured exposure. All collectives of one process group are issued by this one thread, in the row's order, so
every peer issues them in the same order.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pipesched.runtime.records import MeasuredAction

__all__ = ["CommunicationStream", "PendingCommunication"]


@dataclass
class PendingCommunication:
    """One communication action on the stream: when it was issued, started and ended (``time.perf_counter`` s),
    and how long the compute stream waited for it (ms)."""

    action: str
    issued: float
    started: float | None = None
    ended: float | None = None
    waited_ms: float = 0.0
    error: BaseException | None = None
    _done: threading.Event = field(default_factory=threading.Event, repr=False)

    def finish(self, error: BaseException | None = None) -> None:
        self.ended = time.perf_counter()
        self.error = error
        self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until the action has ended; the time blocked counts as exposed communication.

        Raises:
            RuntimeError: the action failed on the stream (its error chained), or did not end within ``timeout_s``.
        """
        if not self._done.is_set():
            began = time.perf_counter()
            finished = self._done.wait(timeout_s)
            self.waited_ms += (time.perf_counter() - began) * 1e3
            if not finished:
                raise RuntimeError(f"{self.action} did not complete within {timeout_s:g} s on the communication stream")
        if self.error is not None:
            raise RuntimeError(f"{self.action} failed on the communication stream: {self.error}") from self.error

    def record(self, origin: float) -> MeasuredAction:
        """The action as measured: from the stream starting it to its end, ms from ``origin``; ``wait_ms`` is the
        compute stream's wait for it."""
        assert self.started is not None and self.ended is not None
        return MeasuredAction.timed(self.action, origin, self.started, self.ended, wait_ms=round(self.waited_ms, 6))


class CommunicationStream:
    """The rank's communication stream (module docstring). ``device``: where the compute runs (``cuda`` adds the
    CUDA stream and events). Close it when the run ends."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.issued: list[PendingCommunication] = []
        self._queue: queue.Queue[tuple[PendingCommunication, Callable[[], Any], Any] | None] = queue.Queue()
        self._cuda = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._thread = threading.Thread(target=self._serve, name="pipesched-communication", daemon=True)
        self._thread.start()

    def submit(self, action: str, run: Callable[[], Any]) -> PendingCommunication:
        """Issue ``run`` (the action's work) behind every action issued before it; returns at once."""
        pending = PendingCommunication(action, time.perf_counter())
        event = None
        if self._cuda is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        self.issued.append(pending)
        self._queue.put((pending, run, event))
        return pending

    def _serve(self) -> None:
        if self._cuda is not None:
            torch.cuda.set_device(self.device)
        while (item := self._queue.get()) is not None:
            pending, run, event = item
            pending.started = time.perf_counter()
            try:
                result = self._run(run, event)
            except BaseException as error:  # handed to the waiter
                pending.finish(error)
                continue
            if callable(getattr(result, "add_done_callback", None)):  # a torch future (torch.futures or torch._C)
                result.add_done_callback(lambda future, pending=pending: _finish_future(pending, future))
            else:
                pending.finish()

    def _run(self, run: Callable[[], Any], event: Any) -> Any:
        if self._cuda is None:
            return run()
        self._cuda.wait_event(event)
        with torch.cuda.stream(self._cuda):
            result = run()
        self._cuda.synchronize()
        return result

    def wait_all(self, timeout_s: float | None = None) -> None:
        """Wait for every action issued so far (the optimizer step's dependency on the reductions)."""
        for pending in self.issued:
            pending.wait(timeout_s)

    def take(self, origin: float) -> list[MeasuredAction]:
        """The records of every action issued since the last call (all must have ended), ms from ``origin``."""
        records = [pending.record(origin) for pending in self.issued]
        self.issued = []
        return records

    def close(self) -> None:
        """Stop the worker after the actions already issued."""
        self._queue.put(None)
        self._thread.join(timeout=5)


def _finish_future(pending: PendingCommunication, future: Any) -> None:
    try:
        future.wait()
    except BaseException as error:
        pending.finish(error)
        return
    pending.finish()
