"""The periodic sweep over the service's jobs (those the Celery workers run, not `tokenmill run`'s):

- a running shard whose worker died (its process is gone on this host, or its lease expired elsewhere) goes
  back to pending and is queued again; the attempt limit is applied when a worker claims it;
- a cancel request whose shards all stopped ends the job `cancelled`;
- the reconciler: the database is the record, the broker only a hint. A shard `pending` or `failed` (to be
  retried) for longer than the grace period while its model's queue is empty lost its task (e.g. a Redis
  FLUSHALL or restart) and is sent again; so is a job left in `validating` or `finalizing` with no live process
  on it while the control queue is empty. Tasks are idempotent, so a duplicate costs a claim, never data.
  A resent shard's `lease_expires_at` records when it was resent: it is not resent again within the grace.
- a job past its deadline (`expires_at`, from the spec's `completion_window`) ends `expired`: its completed
  shards and their parts are kept, the others end cancelled (their running workers see it and stop).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy.orm import Session, sessionmaker

from storage import repository as repo
from storage.job_settings import CELERY
from storage.liveness import runner_alive, shard_runner_alive, worker_alive
from storage.models import Job, JobStatus, Shard, ShardStatus, utcnow
from storage.states import transition
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
    expired: list[str] = field(default_factory=list)


def sweep(sessions: sessionmaker[Session], now: datetime | None = None, stale: timedelta = STALE,
          queued: Callable[[str | None], int] | None = None) -> SweepResult:
    """Find the work that was lost; the caller sends the tasks (after this commits). `queued(model)` is how
    many tasks wait in that model's queue (`queued(None)`: the control queue); unknown counts as none."""
    now, result = now or utcnow(), SweepResult()
    waiting = functools.cache(queued or (lambda model: 0))
    with sessions.begin() as session:
        for job in _service_jobs(session, (S.VALIDATING, S.QUEUED, S.IN_PROGRESS)):
            if job.expires_at is not None and job.expires_at <= now:
                expire(job)
                result.expired.append(job.id)
        for job in _service_jobs(session, (S.QUEUED, S.IN_PROGRESS, S.CANCELLING)):
            _requeue_dead_shards(job, result)
            if job.status == S.CANCELLING and not runner_alive(job):
                mark_cancelled(job)
                result.cancelled.append(job.id)
            elif job.status != S.CANCELLING:
                _resend_lost_shards(job, now, stale, waiting, result)
        for job in _service_jobs(session, (S.VALIDATING, S.FINALIZING)):
            since = job.validating_at if job.status == S.VALIDATING else job.finalizing_at
            if since and now - since > stale and not worker_alive(job.worker) and not waiting(None):
                (result.plan if job.status == S.VALIDATING else result.finalize).append(job.id)
    if any((result.requeue, result.plan, result.finalize, result.cancelled, result.expired)):
        log.info("sweep: requeued shards %s, validating again %s, finalizing again %s, cancelled %s, expired %s",
                 [shard for _, shard, _ in result.requeue], result.plan, result.finalize, result.cancelled,
                 result.expired)
    return result


def _service_jobs(session: Session, statuses) -> list[Job]:
    return [job for job in repo.jobs_in(session, statuses, for_update=True)
            if job.settings.executor == CELERY]


def _resend_lost_shards(job: Job, now: datetime, grace: timedelta, waiting: Callable[[str | None], int],
                        result: SweepResult) -> None:
    """Shards waiting for a task (pending, or failed and to be retried) for longer than grace, while their
    model's queue is empty: their task was lost. The claim applies the attempt limit as usual."""
    sent = {shard_id for _, shard_id, _ in result.requeue}
    for shard in job.shards:
        if shard.status not in (ShardStatus.PENDING, ShardStatus.FAILED) or shard.id in sent \
                or now - _waiting_since(job, shard) <= grace:
            continue
        if waiting(job.model):
            return
        log.warning("job %s: shard %d has been %s since %s with no task; sending it again", job.id, shard.index,
                    shard.status, _waiting_since(job, shard))
        shard.lease_expires_at = now  # resent now: not again before another grace period
        result.requeue.append((job.id, shard.id, job.model))


def _waiting_since(job: Job, shard: Shard) -> datetime:
    """When the shard's latest task was sent: at planning, its last failure, or the sweep's last resend."""
    times = [job.created_at, job.queued_at, shard.finished_at, shard.lease_expires_at]
    return max(t for t in times if t is not None)


def expire(job: Job) -> None:
    """(job row locked) The deadline passed: completed shards are kept, the rest end cancelled."""
    for shard in job.shards:
        if shard.status in (ShardStatus.PENDING, ShardStatus.RUNNING, ShardStatus.FAILED):
            shard.status, shard.lease_expires_at = ShardStatus.CANCELLED.value, None
            shard.claim_token += 1  # a worker still on it writes nothing
    done = sum(1 for s in job.shards if s.status == ShardStatus.COMPLETED)
    log.warning("job %s: past its deadline %s; expired with %d of %d shard(s) completed", job.id,
                job.expires_at, done, len(job.shards))
    transition(job, S.EXPIRED)


def _requeue_dead_shards(job: Job, result: SweepResult) -> None:
    for shard in job.shards:
        if shard.status != ShardStatus.RUNNING or shard_runner_alive(shard):
            continue
        log.warning("job %s: shard %d was running on %s, which is gone", job.id, shard.index, shard.worker)
        shard.lease_expires_at = None
        shard.claim_token += 1  # fenced: should that worker live on (elsewhere), it writes nothing
        if job.status == S.CANCELLING:
            shard.status = ShardStatus.CANCELLED.value
            continue
        shard.status = ShardStatus.PENDING.value
        result.requeue.append((job.id, shard.id, job.model))
