"""Queries and updates of job state. Every function takes a Session; the caller owns the transaction."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from datetime import datetime

from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from storage.models import FailedRow, Job, ServiceMarker, Shard, ShardStatus, utcnow

UPLOAD_NOTE = "part-upload:"  # service_markers naming a part before its upload: `note_upload`


class JobNotFound(LookupError):
    pass


def _by_id(session: Session, model, row_id, for_update: bool):
    """The row of model with this primary key, locked for the transaction when asked; None if absent."""
    query = select(model).where(model.id == row_id)
    if for_update:  # the row as it is once locked, even if this session loaded it before
        query = query.with_for_update().execution_options(populate_existing=True)
    return session.scalars(query).one_or_none()


def get_job(session: Session, job_id: str, *, for_update: bool = False) -> Job:
    job = _by_id(session, Job, job_id, for_update)
    if job is None:
        raise JobNotFound(f"no job {job_id!r}")
    return job


def job_by_key(session: Session, idempotency_key: str) -> Job | None:
    return session.scalars(select(Job).where(Job.idempotency_key == idempotency_key)).one_or_none()


def find_job(session: Session, ref: str) -> Job:
    """A job by its id or by a unique prefix of it (as `tokenmill status 3f2a` allows)."""
    if job := session.get(Job, ref):
        return job
    matches = session.scalars(select(Job).where(Job.id.startswith(ref, autoescape=True)).limit(2)).all()
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise JobNotFound(f"{ref!r} matches several jobs; give more of the id")
    raise JobNotFound(f"no job matches {ref!r}")


def list_jobs(session: Session, *, limit: int = 50, status: str | None = None) -> list[Job]:
    query = select(Job).order_by(Job.created_at.desc(), Job.id).limit(limit)
    if status:
        query = query.where(Job.status == status)
    return list(session.scalars(query))


def jobs_in(session: Session, statuses: Iterable[str], *, for_update: bool = False) -> list[Job]:
    query = select(Job).where(Job.status.in_([str(s) for s in statuses])).order_by(Job.created_at)
    return list(session.scalars(query.with_for_update() if for_update else query))


def job_status(session: Session, job_id: str) -> str | None:
    """Just the status column (cheap enough to poll between engine steps)."""
    return session.scalar(select(Job.status).where(Job.id == job_id))


def shards(session: Session, job_id: str) -> list[Shard]:
    return list(session.scalars(select(Shard).where(Shard.job_id == job_id).order_by(Shard.index)))


def get_shard(session: Session, job_id: str, index: int) -> Shard:
    shard = session.scalars(select(Shard).where(Shard.job_id == job_id, Shard.index == index)).one_or_none()
    if shard is None:
        raise LookupError(f"job {job_id} has no shard {index}")
    return shard


def get_shard_by_id(session: Session, shard_id: int, *, for_update: bool = False) -> Shard:
    shard = _by_id(session, Shard, shard_id, for_update)
    if shard is None:
        raise LookupError(f"no shard with id {shard_id}")
    return shard


def add_shards(session: Session, job: Job, ranges: Iterable[tuple[int, int]]) -> list[Shard]:
    created = [Shard(job_id=job.id, index=i, row_start=start, row_end=end) for i, (start, end) in enumerate(ranges)]
    session.add_all(created)
    return created


def start_shard(shard: Shard, worker: str, lease_until: datetime) -> None:
    """A new claim of the shard: its token goes up, which fences every earlier claim's writes."""
    shard.claim_token = (shard.claim_token or 0) + 1
    shard.status = ShardStatus.RUNNING.value
    shard.attempts += 1
    shard.worker = worker
    shard.started_at = utcnow()
    shard.finished_at = None
    shard.lease_expires_at = lease_until
    shard.error = None


def renew_lease(session: Session, shard_id: int, claim_token: int, lease_until: datetime) -> bool:
    """Extend a running shard's lease if the claim is still this token's; False when it was lost. A shard this
    very claim completed (its commit came between the heartbeat reading its claims and this renewal) is not
    lost: its work is done."""
    result = session.execute(update(Shard).where(Shard.id == shard_id, Shard.claim_token == claim_token,
                                                 Shard.status == ShardStatus.RUNNING.value)
                             .values(lease_expires_at=lease_until))
    if result.rowcount == 1:
        return True
    return session.scalar(select(func.count()).select_from(Shard).where(
        Shard.id == shard_id, Shard.claim_token == claim_token, Shard.status == ShardStatus.COMPLETED.value)) == 1


def renew_job_lease(session: Session, job_id: str, claim_token: int, lease_until: datetime) -> bool:
    """Extend the lease of the job's step holder if its claim is still this token's; False when it was lost."""
    result = session.execute(update(Job).where(Job.id == job_id, Job.claim_token == claim_token)
                             .values(lease_expires_at=lease_until))
    return result.rowcount == 1


def fence(job: Job, shards: Iterable[Shard] = ()) -> None:
    """Move the claim tokens on (job row locked): whoever held the job's step or these shards writes nothing
    more. Cancel, give-up and expiry fence as a claim does."""
    job.claim_token = (job.claim_token or 0) + 1
    for shard in shards:
        shard.claim_token = (shard.claim_token or 0) + 1


def complete_shard(session: Session, shard: Shard, totals: dict[str, int], output_key: str,
                   errors: Iterable[FailedRow]) -> None:
    """Mark shard completed with its counts and its failed rows, then refresh the job's totals."""
    session.execute(delete(FailedRow).where(FailedRow.job_id == shard.job_id, FailedRow.shard == shard.index))
    session.add_all(errors)
    for name, value in totals.items():
        setattr(shard, name, value)
    shard.status = ShardStatus.COMPLETED.value
    shard.output_key = output_key
    shard.finished_at = utcnow()
    shard.lease_expires_at = None
    forget_upload(session, shard.job_id, output_key)  # committed: no cleanup may remove it
    session.flush()
    refresh_job_totals(session, get_job(session, shard.job_id))


def reset_unfinished_shards(session: Session, job_id: str) -> int:
    """Shards left running (by a dead worker), failed or cancelled go back to pending. Returns how many."""
    count = 0
    for shard in shards(session, job_id):
        if shard.status != ShardStatus.COMPLETED and shard.status != ShardStatus.PENDING:
            shard.status = ShardStatus.PENDING.value
            shard.lease_expires_at = None
            count += 1
    return count


def refresh_job_totals(session: Session, job: Job) -> None:
    """Request and token counts of the job = sums over its completed shards (idempotent)."""
    columns = ("rows_completed", "rows_failed", "prompt_tokens", "completion_tokens", "cached_tokens",
               "spec_draft_tokens", "spec_accepted_tokens")
    sums = session.execute(
        select(*(func.coalesce(func.sum(getattr(Shard, c)), 0) for c in columns))
        .where(Shard.job_id == job.id, Shard.status == ShardStatus.COMPLETED.value)).one()
    (job.requests_completed, job.requests_failed, job.prompt_tokens, job.completion_tokens, job.cached_tokens,
     job.spec_draft_tokens, job.spec_accepted_tokens) = (int(v) for v in sums)


def failed_rows(session: Session, job_id: str, shard: int | None = None) -> Iterator[FailedRow]:
    query = select(FailedRow).where(FailedRow.job_id == job_id).order_by(FailedRow.row_index)
    if shard is not None:
        query = query.where(FailedRow.shard == shard)
    yield from session.scalars(query.execution_options(yield_per=1000))


def note_upload(session: Session, job_id: str, key: str) -> None:
    """Record a part key before its upload, so a cleanup knows it even if the uploader dies or raises; its
    commit (`complete_shard`) or its removal forgets it."""
    session.merge(ServiceMarker(name=f"{UPLOAD_NOTE}{job_id}/{key}", value=job_id))


def set_aside_upload(session: Session, job_id: str, key: str, removed_at: datetime) -> None:
    """A noted part the sweep removed as stray: the note stays, marked with when (the database's clock), so later
    sweeps remove it again should a paused upload land late (`workers.finalize.remove_stray_parts`). A note
    forgotten meanwhile (committed, or removed by its own writer) stays forgotten."""
    session.execute(update(ServiceMarker).where(ServiceMarker.name == f"{UPLOAD_NOTE}{job_id}/{key}")
                    .values(value=f"{job_id} {removed_at.isoformat()}"))


def forget_upload(session: Session, job_id: str, key: str) -> None:
    session.execute(delete(ServiceMarker).where(ServiceMarker.name == f"{UPLOAD_NOTE}{job_id}/{key}"))


def upload_notes(session: Session, job_id: str | None = None) -> list[tuple[str, str, datetime | None]]:
    """(job id, key, when the sweep removed it or None) of the recorded part uploads not yet committed or
    forgotten; of one job with `job_id`."""
    prefix = UPLOAD_NOTE + (f"{job_id}/" if job_id else "")
    rows = session.execute(select(ServiceMarker.name, ServiceMarker.value)
                           .where(ServiceMarker.name.startswith(prefix, autoescape=True)))
    notes = []
    for name, value in rows:
        owner, key = name[len(UPLOAD_NOTE):].split("/", 1)
        _, _, removed = value.partition(" ")
        notes.append((owner, key, datetime.fromisoformat(removed) if removed else None))
    return notes


def noted_uploads(session: Session, job_id: str | None = None) -> list[tuple[str, str]]:
    """(job id, key) of the recorded part uploads not yet committed or removed; of one job with `job_id`."""
    return [(owner, key) for owner, key, removed in upload_notes(session, job_id) if removed is None]
