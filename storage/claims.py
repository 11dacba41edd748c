"""State changes that end claims (job row locked by the caller): each one fences, moving the claim tokens on,
so a worker still running the job's step or shards writes nothing more."""

from __future__ import annotations

import logging

from sqlalchemy import func, select
from sqlalchemy.orm import object_session

from storage.models import Job, JobStatus, Shard, ShardStatus, utcnow
from storage.repository import fence
from storage.states import is_terminal, transition

log = logging.getLogger("tokenmill.jobs")

S = JobStatus
UNFINISHED = (ShardStatus.PENDING, ShardStatus.RUNNING, ShardStatus.FAILED)


def mark_cancelled(job: Job) -> None:
    """End the job `cancelled`: shards caught running or not yet started are marked cancelled, completed ones
    are kept (a retry of the job runs the cancelled ones again)."""
    _stop_unfinished(job, (ShardStatus.RUNNING, ShardStatus.PENDING))
    transition(job, S.CANCELLED)


def expire(job: Job) -> None:
    """The deadline passed: completed shards are kept, the rest end cancelled."""
    _stop_unfinished(job, UNFINISHED)
    done = sum(1 for s in job.shards if s.status == ShardStatus.COMPLETED)
    log.warning("job %s: past its deadline %s; expired with %d of %d shard(s) completed", job.id,
                job.expires_at, done, len(job.shards))
    transition(job, S.EXPIRED)


def _stop_unfinished(job: Job, statuses, fence_also: list[Shard] | None = None) -> None:
    stopped = [s for s in job.shards if s.status in statuses]
    for shard in stopped:
        shard.status, shard.lease_expires_at = ShardStatus.CANCELLED.value, None
    fence(job, stopped + list(fence_also or ()))


def attempts_used(shard: Shard) -> str:
    """Why a shard stopped for good: the attempts it used, and the last one's cause."""
    cause = shard.error or f"its worker ({shard.worker}) died while running it"
    return (f"shard {shard.index} (rows {shard.row_start}-{shard.row_end - 1}) failed {shard.attempts} "
            f"attempt(s), the limit; last: {cause}")


def give_up(job: Job, shard: Shard) -> None:
    """The shard used all its attempts and cannot end otherwise: it fails, and the job with it."""
    message = attempts_used(shard)
    shard.status, shard.error, shard.lease_expires_at, shard.finished_at = (
        ShardStatus.FAILED.value, message, None, utcnow())
    log.error("job %s: %s", job.id, message)
    fail(job, message, [shard])


def fail(job: Job, error: str, shards: list[Shard] | None = None) -> bool:
    """End the job `failed` unless it already ended: shards still running end cancelled and, with `shards`, are
    fenced (their workers write nothing more). True if it failed."""
    if is_terminal(job.status):
        return False
    _stop_unfinished(job, (ShardStatus.RUNNING,), shards)  # fences the job, them and `shards`
    transition(job, S.FAILED, error=error)
    return True


def settle(job: Job) -> JobStatus | None:
    """After a shard changed: the last completed shard moves the job to `finalizing`; a cancel request whose
    last running shard stopped ends `cancelled`. Returns the new status, if any."""
    if job.status == S.IN_PROGRESS and _count_shards(job) and not _count_shards(job, ShardStatus.COMPLETED, False):
        transition(job, S.FINALIZING)
        return S.FINALIZING
    if job.status == S.CANCELLING and not _count_shards(job, ShardStatus.RUNNING):
        mark_cancelled(job)
        return S.CANCELLED
    return None


def _count_shards(job: Job, status: ShardStatus | None = None, equal: bool = True) -> int:
    """The job's shards (of `status`, or of another status when not `equal`), counted by the database when the
    job is in a session: a job of thousands of shards settles after each one without loading them all."""
    session = object_session(job)
    if session is None or "shards" in job.__dict__:  # detached, or its shards already loaded (maybe changed)
        return sum(1 for s in job.shards if status is None or (s.status == status) == equal)
    query = select(func.count()).select_from(Shard).where(Shard.job_id == job.id)
    if status is not None:
        query = query.where(Shard.status == status.value if equal else Shard.status != status.value)
    return session.scalar(query)
