"""The periodic sweep over the service's jobs (those the Celery workers run, not `tokenmill run`'s):

- a running shard whose worker died (its process is gone on this host, or its lease expired elsewhere) goes
  back to pending and is queued again; the attempt limit is applied when a worker claims it;
- a cancel request whose shards all stopped ends the job `cancelled`;
- a job left in `validating` or `finalizing` for a while with no live process on it is handed out again
  (its task was lost, e.g. with the broker).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy.orm import Session, sessionmaker

from storage import repository as repo
from storage.job_settings import CELERY
from storage.liveness import runner_alive, shard_runner_alive, worker_alive
from storage.models import Job, JobStatus, ShardStatus, utcnow
from workers.runner import mark_cancelled

log = logging.getLogger("tokenmill.sweep")

S = JobStatus
STALE = timedelta(minutes=10)


@dataclass
class SweepResult:
    requeue: list[tuple[str, int, str]] = field(default_factory=list)  # (job id, shard id, model)
    plan: list[str] = field(default_factory=list)  # job ids to validate again
    finalize: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)


def sweep(sessions: sessionmaker[Session], now: datetime | None = None, stale: timedelta = STALE) -> SweepResult:
    """Find the work that was lost; the caller sends the tasks (after this commits)."""
    now, result = now or utcnow(), SweepResult()
    with sessions.begin() as session:
        for job in _service_jobs(session, (S.QUEUED, S.IN_PROGRESS, S.CANCELLING)):
            _requeue_dead_shards(job, result)
            if job.status == S.CANCELLING and not runner_alive(job):
                mark_cancelled(job)
                result.cancelled.append(job.id)
        for job in _service_jobs(session, (S.VALIDATING, S.FINALIZING)):
            since = job.validating_at if job.status == S.VALIDATING else job.finalizing_at
            if since and now - since > stale and not worker_alive(job.worker):
                (result.plan if job.status == S.VALIDATING else result.finalize).append(job.id)
    if any((result.requeue, result.plan, result.finalize, result.cancelled)):
        log.info("sweep: requeued shards %s, validating again %s, finalizing again %s, cancelled %s",
                 [shard for _, shard, _ in result.requeue], result.plan, result.finalize, result.cancelled)
    return result


def _service_jobs(session: Session, statuses) -> list[Job]:
    return [job for job in repo.jobs_in(session, statuses, for_update=True)
            if job.settings.executor == CELERY]


def _requeue_dead_shards(job: Job, result: SweepResult) -> None:
    for shard in job.shards:
        if shard.status != ShardStatus.RUNNING or shard_runner_alive(shard):
            continue
        log.warning("job %s: shard %d was running on %s, which is gone", job.id, shard.index, shard.worker)
        shard.lease_expires_at = None
        if job.status == S.CANCELLING:
            shard.status = ShardStatus.CANCELLED.value
            continue
        shard.status = ShardStatus.PENDING.value
        result.requeue.append((job.id, shard.id, job.model))
