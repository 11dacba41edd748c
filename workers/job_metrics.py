"""Job-level Prometheus metrics of the service, read from SQL when Prometheus scrapes.

The collector runs three small aggregate queries through a callable that runs SQL text on the caller's own
connection, so this module imports no database library:

    from sqlalchemy import text

    def query(sql):
        with sessions() as session:
            return session.execute(text(sql)).all()

    registry.register(JobMetricsCollector(query))      # or: serve_job_metrics(query, port)

One process per deployment exports these, one that lives when the workers do not (beat, or `tokenmill run`);
several exporting them is harmless: the alerts take `max` over instances.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.prometheus import PREFIX, new_registry, start_metrics_server

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

log = logging.getLogger("tokenmill.metrics")

Query = Callable[[str], Iterable[Sequence]]

# The OpenAI Batch lifecycle (storage.models.JobStatus, storage.states): each is exported, zeros included, so a
# status's first job is a change an alert can see.
JOB_STATUSES = ("validating", "queued", "in_progress", "finalizing", "completed", "failed", "cancelling",
                "cancelled", "expired")
LIVE_STATUSES = ("validating", "queued", "in_progress", "finalizing", "cancelling")

JOBS_BY_STATUS_SQL = "SELECT status, COUNT(*) FROM jobs GROUP BY status"
LIVE_JOBS_SQL = f"""
SELECT j.id, j.status, j.requests_total, j.requests_completed, j.requests_failed,
       COALESCE(SUM(CASE WHEN s.attempts > 1 THEN s.attempts - 1 ELSE 0 END), 0)
FROM jobs j LEFT JOIN shards s ON s.job_id = j.id
WHERE j.status IN ({", ".join(f"'{s}'" for s in LIVE_STATUSES)})
GROUP BY j.id, j.status, j.requests_total, j.requests_completed, j.requests_failed"""
SHARD_RETRIES_SQL = "SELECT COALESCE(SUM(attempts - 1), 0) FROM shards WHERE attempts > 1"


class JobMetricsCollector(Collector):
    """Jobs by status; rows total / done / failed and shard retries of each live job; shard retries ever.
    `tokenmill:job_metrics_up` is 0 when the database did not answer (the other families are then empty)."""

    def __init__(self, query: Query, statuses: Sequence[str] = JOB_STATUSES) -> None:
        self.query = query
        self.statuses = tuple(statuses)

    def describe(self) -> list[Metric]:
        return [*self._families().values(), up_gauge()]  # names only: registering must not query the database

    def collect(self) -> Iterator[Metric]:
        families = self._families()
        try:
            self._fill(families)
            up = 1
        except Exception:
            log.exception("job metrics: the database query failed")
            families = self._families()
            up = 0
        yield from families.values()
        yield up_gauge(up)

    def _families(self) -> dict[str, Metric]:
        per_job = ("job_id", "status")
        return {
            "jobs": GaugeMetricFamily(PREFIX + "jobs", "Jobs by status.", labels=["status"]),
            "rows_total": GaugeMetricFamily(PREFIX + "job_rows_total", "Input rows of a live job (0 until "
                                            "validated).", labels=per_job),
            "rows_done": GaugeMetricFamily(PREFIX + "job_rows_done", "Rows of a live job with an output or an "
                                           "error, over its completed shards.", labels=per_job),
            "rows_failed": GaugeMetricFamily(PREFIX + "job_rows_failed", "Rows of a live job that failed.",
                                             labels=per_job),
            "retries": GaugeMetricFamily(PREFIX + "job_shard_retries", "Shard attempts beyond the first, of a "
                                         "live job.", labels=per_job),
            "retries_total": CounterMetricFamily(PREFIX + "shard_retries", "Shard attempts beyond the first, "
                                                 "over all jobs."),
        }

    def _fill(self, families: dict[str, Metric]) -> None:
        counts = {status: int(count) for status, count in self.query(JOBS_BY_STATUS_SQL)}
        for status in (*self.statuses, *sorted(set(counts) - set(self.statuses))):
            families["jobs"].add_metric([status], counts.get(status, 0))
        for job_id, status, total, completed, failed, retries in self.query(LIVE_JOBS_SQL):
            labels = [str(job_id), status]
            families["rows_total"].add_metric(labels, total)
            families["rows_done"].add_metric(labels, completed + failed)
            families["rows_failed"].add_metric(labels, failed)
            families["retries"].add_metric(labels, retries)
        retries_total = next(iter(self.query(SHARD_RETRIES_SQL)))[0]
        families["retries_total"].add_metric([], retries_total)


def up_gauge(value: int | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + "job_metrics_up", "1 when the job database answered this scrape.", value=value)


def serve_job_metrics(query: Query, port: int, addr: str = "127.0.0.1") -> WSGIServer:
    """The job gauges and this process's own metrics at http://addr:port/metrics, from a daemon thread."""
    registry = new_registry()
    registry.register(JobMetricsCollector(query))
    return start_metrics_server(registry, port, addr)
