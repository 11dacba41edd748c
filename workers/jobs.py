"""Batch jobs end to end, without Celery: submit (create or resume), run (validate, plan shards, run them
through an engine, finalize; see `workers.runner`), cancel. Celery tasks call these same functions with ids.

A job's row ranges (shards) are run in order; a completed shard is never run again, an interrupted
one is redone from scratch (its part file is overwritten atomically), so every input row lands exactly
once in a part file or in the error file.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from storage import repository as repo
from storage.formats import Limits
from storage.models import Job, JobSource, JobStatus, utcnow
from storage.objectstore import S3Options, check_output_uri, normalize_uri
from storage.states import CANCELLABLE, is_terminal, transition
from workers.runner import (
    EngineProvider,
    JobBusy,
    JobRunner,
    NoProgress,
    Progress,
    mark_cancelled,
    runner_alive,
)

__all__ = ["DEFAULT_SHARD_SIZE", "JobBusy", "JobSpec", "NoProgress", "Progress", "Submission", "cancel_job",
           "idempotency_key", "run_job", "submit"]

log = logging.getLogger("tokenmill.jobs")

DEFAULT_SHARD_SIZE = 500
LOCAL, CELERY = "local", "celery"
S = JobStatus


@dataclass
class JobSpec:
    input_uri: str
    output_uri: str
    model: str
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams defaults; rows may override
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig settings
    shard_size: int = DEFAULT_SHARD_SIZE
    limits: Limits = field(default_factory=Limits)
    s3: S3Options = field(default_factory=S3Options)
    openai_output: bool = False
    source: str = JobSource.CLI.value
    source_ref: str | None = None
    priority: int = 0
    idempotency_key: str | None = None  # default: derived from the input and output URIs
    job_id: str | None = None  # default: a new UUID
    executor: str = LOCAL  # who runs it: `tokenmill run` in process (local), or the Celery workers (celery)
    speculative_config: dict[str, Any] | None = None  # the job's speculative decoding (None: the engine's own)

    def settings(self) -> dict[str, Any]:
        if self.shard_size < 1:
            raise ValueError(f"shard size must be >= 1 row, got {self.shard_size}")
        return {"sampling": self.sampling, "engine": self.engine, "shard_size": self.shard_size,
                "limits": self.limits.to_dict(), "s3": self.s3.to_dict(), "openai_output": self.openai_output,
                "executor": self.executor, "speculative_config": self.speculative_config}


@dataclass
class Submission:
    job: Job
    outcome: str  # created | resumed | retried | finished | duplicate


def idempotency_key(input_uri: str, output_uri: str) -> str:
    """Same input and output means same job: the CLI resumes it instead of starting another."""
    canonical = f"{normalize_uri(input_uri)}\n{normalize_uri(output_uri)}"
    return "cli-" + hashlib.sha256(canonical.encode()).hexdigest()[:40]


def submit(sessions: sessionmaker[Session], spec: JobSpec, reopen: bool = True) -> Submission:
    """Create the job, or find it again by its idempotency key. With `reopen` (the CLI's resubmission) a failed
    or cancelled job is retried; without it (a redelivered message) the job found is left as it is."""
    output_uri = check_output_uri(spec.output_uri)
    input_uri = normalize_uri(spec.input_uri)
    key = spec.idempotency_key or idempotency_key(input_uri, output_uri)
    try:
        with sessions.begin() as session:
            job = repo.job_by_key(session, key)
            if job is not None:
                return Submission(job, _reopen(job, spec) if reopen else "duplicate")
            _check_id_free(session, spec.job_id)
            now = utcnow()
            job = Job(id=spec.job_id or str(uuid.uuid4()), idempotency_key=key, source=spec.source,
                      source_ref=spec.source_ref, status=S.VALIDATING.value, model=spec.model,
                      input_uri=input_uri, output_uri=output_uri, settings=spec.settings(), priority=spec.priority,
                      created_at=now, validating_at=now)
            session.add(job)
            return Submission(job, "created")
    except IntegrityError:  # submitted concurrently by someone else: that one wins
        with sessions() as session:
            job = repo.job_by_key(session, key)
        if job is None:  # the clash was on the job id, not the key
            raise
        return Submission(job, "resumed" if reopen else "duplicate")


def _check_id_free(session: Session, job_id: str | None) -> None:
    if job_id is not None and session.get(Job, job_id) is not None:
        raise ValueError(f"job id {job_id} is taken by a job with another idempotency key")


def _reopen(job: Job, spec: JobSpec) -> str:
    if job.status == S.COMPLETED:
        return "finished"
    _update_settings(job, spec)
    if job.status == S.CANCELLING and not runner_alive(job):
        transition(job, S.CANCELLED)
    if is_terminal(job.status):
        transition(job, S.VALIDATING)
        return "retried"
    return "resumed"


def _update_settings(job: Job, spec: JobSpec) -> None:
    """Before any shard ran, a resubmission may change the settings; afterwards they are fixed."""
    wanted = spec.settings()
    changed = sorted(k for k, v in wanted.items() if job.settings.get(k) != v)
    if not changed and job.model == spec.model:
        return
    if any(shard.attempts for shard in job.shards):
        log.warning("job %s keeps the settings it started with; ignoring changes to %s", job.id,
                    ", ".join(changed + (["model"] if job.model != spec.model else [])))
        return
    job.settings = {**job.settings, **wanted}
    job.model = spec.model


def cancel_job(sessions: sessionmaker[Session], ref: str) -> Job:
    """Ask the job to stop. A live runner stops at its next engine step and ends it `cancelled`, keeping the
    finished shards; with no live runner the job is cancelled here and now."""
    with sessions.begin() as session:
        job = repo.find_job(session, ref)
        if job.status in (S.CANCELLING, S.CANCELLED):
            return job
        if JobStatus(job.status) not in CANCELLABLE:
            raise ValueError(f"job {job.id} is {job.status}; only validating, queued or in_progress jobs can be "
                             f"cancelled")
        alive = runner_alive(job)
        if job.status == S.IN_PROGRESS or alive:
            transition(job, S.CANCELLING)
        if not alive:
            mark_cancelled(job)
        return job


def run_job(sessions: sessionmaker[Session], job_id: str, engine_provider: EngineProvider,
            progress: Progress | None = None) -> Job:
    """Take the job as far as it goes in this process: to completed, failed or cancelled."""
    return JobRunner(sessions, job_id, engine_provider, progress or NoProgress()).run()


