"""The periodic sweep over the service's jobs (those the Celery workers run, not `tokenmill run`'s), on the
database's clock:

- a running shard whose lease lapsed (its worker stopped renewing it: dead, paused, cut off) is fenced, goes
  back to pending and is queued again; the attempt limit is applied when a worker claims it;
- a plan or finalize step whose holder's lease lapsed is fenced and sent again;
- except within one lease of the sweep seeing the database again after an outage (a restart, or no sweep
  reaching it for longer than `storage.liveness.OUTAGE_GAP`: a partition, a failover): every lease lapsed
  meanwhile, and the holders get one whole lease to renew before such a lapse counts (a sweep right after
  took shards from live workers and used an attempt each);
- a cancel request whose shards' leases all ended finishes the job `cancelled`;
- the reconciler: the database is the record, the broker only a hint. A shard `pending` or `failed` (to be
  retried) for longer than the grace period since it was last sent lost its task and is sent again, however
  busy its model's queue (under steady work it is never empty); so is a plan step that no one took. A finalize
  step that no one holds is sent again after `finalize_wait` (about a sweep interval: its task may have been
  lost while the broker was down), or after the grace while the control queue holds tasks. When the broker lost
  its state (a Redis FLUSHALL, restart or restore, seen by the broker marker, `workers.broker_marker`), there is
  no wait: everything waiting for a task is sent at once. Tasks are idempotent, so a duplicate costs a claim,
  never data; a task merely queued longer than the grace gets one duplicate per grace, no more. The wait is
  measured on the database's clock alone, never against times the hosts stamped (their clocks may be off by an
  hour): the first sweep that sees a shard or step waiting with no holder stamps `lease_expires_at` (with no
  holder: "waiting, seen at"), and a resend stamps it again ("resent at").
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
from storage.liveness import db_now, holder_alive, lapses_count_by, runner_alive, shard_runner_alive
from storage.models import Job, JobStatus, ShardStatus

log = logging.getLogger("tokenmill.sweep")

S = JobStatus
STALE = timedelta(minutes=10)
FINALIZE_WAIT = timedelta(seconds=15)  # finalize is idempotent: a step no one holds is resent at the next sweep


@dataclass
class SweepResult:
    requeue: list[tuple[str, int, str]] = field(default_factory=list)  # (job id, shard id, model)
    plan: list[str] = field(default_factory=list)  # job ids to validate again
    finalize: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    expired: list[str] = field(default_factory=list)


def sweep(sessions: sessionmaker[Session], now: datetime | None = None, stale: timedelta = STALE,
          queued: Callable[[str | None], int] | None = None, broker_lost: bool = False,
          finalize_wait: timedelta = FINALIZE_WAIT) -> SweepResult:
    """Find the work that was lost; the caller sends the tasks (after this commits). `queued(None)` is how many
    tasks wait in the control queue (unknown counts as none): a busy one makes a finalize step wait out the
    grace. `now` defaults to the database's clock."""
    result = SweepResult()
    waiting = functools.cache(queued or (lambda model: 0))
    grace = timedelta(0) if broker_lost else stale
    with sessions.begin() as session:
        now = now or db_now(session)
        lapsed_by = _database_settling(session, now)  # now, or earlier while settling after an outage
        result.expired = expire_overdue(session, now, CELERY)
        for job in _service_jobs(session, (S.QUEUED, S.IN_PROGRESS, S.CANCELLING)):
            _requeue_lapsed_shards(job, lapsed_by, result)  # a lease that lapsed after `lapsed_by` waits
            if job.status == S.CANCELLING and not runner_alive(job, now):
                mark_cancelled(job)
                result.cancelled.append(job.id)
            elif job.status != S.CANCELLING:
                _resend_lost_shards(job, now, grace, result)
        for job in _service_jobs(session, (S.VALIDATING, S.FINALIZING)):
            if holder_alive(job.worker, job.lease_expires_at, lapsed_by):
                continue
            soon = job.status == S.FINALIZING and not waiting(None)  # else its task may be queued: wait the grace
            if _step_lost(job, now, min(grace, finalize_wait) if soon else grace):
                (result.plan if job.status == S.VALIDATING else result.finalize).append(job.id)
    if any((result.requeue, result.plan, result.finalize, result.cancelled, result.expired)):
        log.info("sweep: requeued shards %s, validating again %s, finalizing again %s, cancelled %s, expired %s%s",
                 [shard for _, shard, _ in result.requeue], result.plan, result.finalize, result.cancelled,
                 result.expired, " (the broker lost its state)" if broker_lost else "")
    return result


def _database_settling(session: Session, now: datetime) -> datetime:
    """By when a lapsed lease must have lapsed to count (`storage.liveness.lapses_count_by`): `now`, but earlier
    within one lease of the database (re)starting or coming back from a partition or failover."""
    lapsed_by = lapses_count_by(session, now)
    if lapsed_by < now:
        log.info("sweep: settling after a database outage; only leases lapsed by %s count yet", lapsed_by)
    return lapsed_by


def expire_overdue(session: Session, now: datetime, executor: str) -> list[str]:
    """(in the caller's transaction) End `expired` the live jobs of this executor past their deadline; their
    ids. The Celery sweep calls it for the workers' jobs, `workers.inprocess.LocalExecutor` for its own."""
    overdue = [job for job in _service_jobs(session, (S.VALIDATING, S.QUEUED, S.IN_PROGRESS), executor)
               if job.expires_at is not None and job.expires_at <= now]
    for job in overdue:
        expire(job)
    return [job.id for job in overdue]


def _service_jobs(session: Session, statuses, executor: str = CELERY) -> list[Job]:
    return [job for job in repo.jobs_in(session, statuses, for_update=True)
            if job.settings.executor == executor]


def _step_lost(job: Job, now: datetime, wait: timedelta) -> bool:
    """(job row locked) Is the job's plan or finalize step lost: its holder's lease lapsed, or no one took it
    for `wait` since a sweep first saw it so or last resent it? Marks it resent (and fences a lapsed holder)."""
    if holder_alive(job.worker, job.lease_expires_at, now):
        return False
    if job.worker is not None:
        log.warning("job %s: its %s step's holder %s let its lease lapse (%s); sending the step again", job.id,
                    job.status, job.worker, job.lease_expires_at)
        repo.fence(job)
    else:
        if job.lease_expires_at is None:  # first seen with no holder (a claim's release clears the stamp)
            job.lease_expires_at = now
        if now - job.lease_expires_at < wait:
            return False
        log.warning("job %s: its %s step has had no holder since %s or earlier and no task; sending it again",
                    job.id, job.status, job.lease_expires_at)
    job.worker, job.lease_expires_at = None, now  # resent now: not again before another wait
    return True


def _resend_lost_shards(job: Job, now: datetime, grace: timedelta, result: SweepResult) -> None:
    """Shards waiting for a task (pending, or failed and to be retried) for `grace` since a sweep first saw them
    so or last resent them: their task was lost, or has waited in a queue that long. No queue depth holds this
    back: other jobs' tasks keep a busy queue from ever emptying. The claim applies the attempt limit as usual."""
    sent = {shard_id for _, shard_id, _ in result.requeue}
    for shard in job.shards:
        if shard.status not in (ShardStatus.PENDING, ShardStatus.FAILED) or shard.id in sent:
            continue
        if shard.lease_expires_at is None:  # first seen waiting (a claim, failure or completion clears the stamp)
            shard.lease_expires_at = now
        if now - shard.lease_expires_at < grace:
            continue
        log.warning("job %s: shard %d has been %s since %s or earlier with no task; sending it again", job.id,
                    shard.index, shard.status, shard.lease_expires_at)
        shard.lease_expires_at = now  # resent now: not again before another grace period
        result.requeue.append((job.id, shard.id, job.model))


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
