"""The periodic sweep over the service's jobs (those the Celery workers run, not `tokenmill run`'s), on the
database's clock:

- a running shard whose lease lapsed (its worker stopped renewing it: dead, paused, cut off) is fenced, goes
  back to pending and is queued again; the attempt limit is applied when a worker claims it;
- a plan or finalize step whose holder's lease lapsed is fenced and sent again;
- except within one lease of the database (re)starting: every lease lapsed while it was down, and the holders
  get one whole lease to renew before a lapse counts (a sweep right after a restart took shards from live
  workers and used an attempt each);
- a cancel request whose shards' leases all ended finishes the job `cancelled`;
- the reconciler: the database is the record, the broker only a hint. A shard `pending` or `failed` (to be
  retried) for longer than the grace period while its model's queue is empty lost its task and is sent again;
  so is a step that no one ever took. When the broker lost its state (a Redis FLUSHALL or restart, seen by the
  broker marker, `workers.broker_marker`), there is no grace: everything waiting for a task is sent at once.
  Tasks are idempotent, so a duplicate costs a claim, never data. A resend is stamped in `lease_expires_at`
  (with no holder): it is not resent again within the grace.
- a job past its deadline (`expires_at`, from the spec's `completion_window`) ends `expired`: its completed
  shards and their parts are kept, the others end cancelled and fenced.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy.orm import Session, sessionmaker

from storage import repository as repo
from storage.claims import expire, mark_cancelled
from storage.job_settings import CELERY
from storage.liveness import LEASE, database_started_at, db_now, holder_alive, runner_alive, shard_runner_alive
from storage.models import Job, JobStatus, Shard, ShardStatus

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
          queued: Callable[[str | None], int] | None = None, broker_lost: bool = False) -> SweepResult:
    """Find the work that was lost; the caller sends the tasks (after this commits). `queued(model)` is how
    many tasks wait in that model's queue (`queued(None)`: the control queue); unknown counts as none.
    `now` defaults to the database's clock."""
    result = SweepResult()
    waiting = functools.cache(queued or (lambda model: 0))
    grace = timedelta(0) if broker_lost else stale
    with sessions.begin() as session:
        now = now or db_now(session)
        settling = _database_settling(session, now)
        for job in _service_jobs(session, (S.VALIDATING, S.QUEUED, S.IN_PROGRESS)):
            if job.expires_at is not None and job.expires_at <= now:
                expire(job)
                result.expired.append(job.id)
        for job in _service_jobs(session, (S.QUEUED, S.IN_PROGRESS, S.CANCELLING)):
            if not settling:
                _requeue_lapsed_shards(job, now, result)
            if job.status == S.CANCELLING and not runner_alive(job, now):
                mark_cancelled(job)
                result.cancelled.append(job.id)
            elif job.status != S.CANCELLING:
                _resend_lost_shards(job, now, grace, waiting, result)
        for job in _service_jobs(session, (S.VALIDATING, S.FINALIZING)):
            if not (settling and job.worker is not None) and _step_lost(job, now, grace, waiting):
                (result.plan if job.status == S.VALIDATING else result.finalize).append(job.id)
    if any((result.requeue, result.plan, result.finalize, result.cancelled, result.expired)):
        log.info("sweep: requeued shards %s, validating again %s, finalizing again %s, cancelled %s, expired %s%s",
                 [shard for _, shard, _ in result.requeue], result.plan, result.finalize, result.cancelled,
                 result.expired, " (the broker lost its state)" if broker_lost else "")
    return result


def _database_settling(session: Session, now: datetime) -> bool:
    """Did the database start less than one lease ago? Then no lapsed lease counts yet."""
    started = database_started_at(session)
    if started is None or not timedelta(0) <= now - started < LEASE:
        return False
    log.info("sweep: the database started at %s; lapsed leases count from %s", started, started + LEASE)
    return True


def _service_jobs(session: Session, statuses) -> list[Job]:
    return [job for job in repo.jobs_in(session, statuses, for_update=True)
            if job.settings.executor == CELERY]


def _step_lost(job: Job, now: datetime, grace: timedelta, waiting: Callable[[str | None], int]) -> bool:
    """(job row locked) Is the job's plan or finalize step lost: its holder's lease lapsed, or no one took it
    within the grace while the control queue is empty? Marks it resent (and fences a lapsed holder)."""
    if holder_alive(job.worker, job.lease_expires_at, now):
        return False
    if job.worker is not None:
        log.warning("job %s: its %s step's holder %s let its lease lapse (%s); sending the step again", job.id,
                    job.status, job.worker, job.lease_expires_at)
        repo.fence(job)
    else:
        since = max(t for t in (job.validating_at, job.finalizing_at, job.lease_expires_at, job.created_at)
                    if t is not None)
        if now - since <= grace or waiting(None):
            return False
    job.worker, job.lease_expires_at = None, now  # resent now: not again before another grace period
    return True


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


def _requeue_lapsed_shards(job: Job, now: datetime, result: SweepResult) -> None:
    for shard in job.shards:
        if shard.status != ShardStatus.RUNNING or shard_runner_alive(shard, now):
            continue
        log.warning("job %s: shard %d was running on %s, whose lease lapsed at %s", job.id, shard.index,
                    shard.worker, shard.lease_expires_at)
        shard.lease_expires_at = None
        shard.claim_token += 1  # fenced: should that worker live on, it writes nothing
        if job.status == S.CANCELLING:
            shard.status = ShardStatus.CANCELLED.value
            continue
        shard.status = ShardStatus.PENDING.value
        result.requeue.append((job.id, shard.id, job.model))
