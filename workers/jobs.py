"""Batch jobs end to end, without Celery: run (validate, plan shards, run them through an engine, finalize; see
`workers.runner`) and cancel. Jobs are made by `ingest.intake.submit`. Celery tasks run the same steps by id.

A job's row ranges (shards) are run in order; a completed shard is never run again, an interrupted
one is redone from scratch (its part file is overwritten atomically), so every input row lands exactly
once in a part file or in the error file.
"""

from __future__ import annotations

from sqlalchemy.orm import Session, sessionmaker

from storage import repository as repo
from storage.claims import mark_cancelled
from storage.liveness import db_now, runner_alive
from storage.models import Job, JobStatus
from storage.states import CANCELLABLE, transition
from workers.job_steps import NoProgress, Progress, discard_if_ended
from workers.runner import EngineProvider, JobBusy, JobRunner

__all__ = ["JobBusy", "NoProgress", "Progress", "cancel_job", "run_job"]

S = JobStatus


def cancel_job(sessions: sessionmaker[Session], ref: str) -> Job:
    """Ask the job to stop. A live runner stops at its next engine step and ends it `cancelled`, keeping the
    finished shards; with no live runner the job is cancelled here and now."""
    with sessions.begin() as session:
        job = repo.get_job(session, repo.find_job(session, ref).id, for_update=True)  # no racing a finalizer
        if job.status in (S.CANCELLING, S.CANCELLED):
            return job
        if JobStatus(job.status) not in CANCELLABLE:
            raise ValueError(f"job {job.id} is {job.status}; only validating, queued or in_progress jobs can be "
                             f"cancelled")
        alive = runner_alive(job, db_now(session))
        if job.status == S.IN_PROGRESS or alive:
            transition(job, S.CANCELLING)
        if not alive:
            mark_cancelled(job)
    discard_if_ended(sessions, job)
    return job


def run_job(sessions: sessionmaker[Session], job_id: str, engine_provider: EngineProvider,
            progress: Progress | None = None) -> Job:
    """Take the job as far as it goes in this process: to completed, failed or cancelled."""
    return JobRunner(sessions, job_id, engine_provider, progress or NoProgress()).run()


