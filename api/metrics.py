"""Prometheus metrics of one app instance (its own registry, so several apps can live in one process).

- ``pipesched_http_requests_total{method, route, status}``: requests by method (the standard ones, any
  other as ``other``), route template (``unmatched`` for a path no route takes) and status code (a code
  outside 100–599 as its class): every label set is bounded, whatever clients send.
- ``pipesched_http_request_duration_seconds{route}``: request latency, s.
- ``pipesched_solve_seconds{method, mode}``: solve time (``mode``: sync or job), s.
- ``pipesched_cache_lookups_total{result}``: stored-schedule lookups, ``hit`` or ``miss``.
- ``pipesched_jobs{status}``: jobs in the database by status (read at scrape time; their last values while
  the database cannot be reached).
- ``pipesched_database_up``: 1 when the scrape reached the database, else 0.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pipesched.api.storage import is_unreachable

__all__ = ["Metrics", "method_label", "status_label"]

#: HTTP methods counted under their own name; any other is counted as ``other``.
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def method_label(method: str) -> str:
    """``method`` when it is a standard HTTP method, else ``other`` (clients may send any token)."""
    return method if method in KNOWN_METHODS else "other"


def status_label(code: int) -> str:
    """The status code as text (100–599), else its class (e.g. ``6xx``): a bounded set."""
    return str(code) if 100 <= code <= 599 else f"{min(max(code // 100, 0), 9)}xx"


SOLVE_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Metrics:
    """The service's metrics; ``job_counts`` returns jobs per status when scraped."""

    def __init__(self, job_counts: Callable[[], dict[str, int]]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "pipesched_http_requests",
            "HTTP requests by method, route template and status code.",
            ("method", "route", "status"),
            registry=self.registry,
        )
        self.latency = Histogram(
            "pipesched_http_request_duration_seconds",
            "HTTP request latency by route template, s.",
            ("route",),
            registry=self.registry,
        )
        self.solve_seconds = Histogram(
            "pipesched_solve_seconds",
            "Solve time by method and mode (sync or job), s.",
            ("method", "mode"),
            buckets=SOLVE_BUCKETS_S,
            registry=self.registry,
        )
        self.cache_lookups = Counter(
            "pipesched_cache_lookups",
            "Stored-schedule lookups for a posted problem: hit (answered without solving) or miss.",
            ("result",),
            registry=self.registry,
        )
        self.jobs = Gauge("pipesched_jobs", "Jobs in the database by status.", ("status",), registry=self.registry)
        self.database_up = Gauge(
            "pipesched_database_up", "1 when the last scrape reached the database, else 0.", registry=self.registry
        )
        self._job_counts = job_counts

    def render(self) -> bytes:
        """The Prometheus text exposition, job counts refreshed when the database answers."""
        try:
            counts = self._job_counts()
        except Exception as error:
            if not is_unreachable(error):
                raise
            self.database_up.set(0)
        else:
            self.database_up.set(1)
            for status, count in counts.items():
                self.jobs.labels(status=status).set(count)
        return generate_latest(self.registry)
