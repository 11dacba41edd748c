"""The job state machine (OpenAI Batch statuses). Every transition stamps `<status>_at`; others raise.

    validating -> queued -> in_progress -> finalizing -> completed
    any live status -> failed | cancelling -> cancelled;  validating/queued/in_progress -> expired
    failed | cancelled | expired -> validating  (a retry: resubmitting the same job)

A live job holds its output prefix (`output_claim`, unique): no other live job writes there, nor in a prefix
holding it or under it (`ingest.intake.claim_owner`). Reaching a terminal status lets it go, a retry takes it again.
"""

from __future__ import annotations

import os
from datetime import datetime

from storage.models import Job, JobStatus, utcnow
from storage.objectstore import normalize_uri

S = JobStatus

ALLOWED: dict[JobStatus, frozenset[JobStatus]] = {
    S.VALIDATING: frozenset({S.QUEUED, S.FAILED, S.CANCELLING, S.CANCELLED, S.EXPIRED}),
    S.QUEUED: frozenset({S.IN_PROGRESS, S.FAILED, S.CANCELLING, S.CANCELLED, S.EXPIRED}),
    S.IN_PROGRESS: frozenset({S.FINALIZING, S.FAILED, S.CANCELLING, S.EXPIRED}),
    S.FINALIZING: frozenset({S.COMPLETED, S.FAILED}),
    S.CANCELLING: frozenset({S.CANCELLED, S.FAILED}),
    S.COMPLETED: frozenset(),
    S.FAILED: frozenset({S.VALIDATING}),
    S.CANCELLED: frozenset({S.VALIDATING}),
    S.EXPIRED: frozenset({S.VALIDATING}),
}

TERMINAL = frozenset({S.COMPLETED, S.FAILED, S.CANCELLED, S.EXPIRED})
CANCELLABLE = frozenset({S.VALIDATING, S.QUEUED, S.IN_PROGRESS})


class IllegalTransition(ValueError):
    def __init__(self, job_id: str, current: str, new: str) -> None:
        allowed = ", ".join(sorted(ALLOWED[JobStatus(current)])) or "none: it is final"
        super().__init__(f"job {job_id}: cannot go from {current!r} to {new!r} (allowed: {allowed})")
        self.current, self.new = current, new


def can_transition(current: str, new: str) -> bool:
    return JobStatus(new) in ALLOWED[JobStatus(current)]


def transition(job: Job, new_status: str, *, error: str | None = None, at: datetime | None = None) -> None:
    """Move job to new_status and stamp the time; `error` is recorded on failed, cleared on a retry."""
    new = JobStatus(new_status)
    if not can_transition(job.status, new):
        raise IllegalTransition(job.id, job.status, new.value)
    job.status = new.value
    setattr(job, f"{new.value}_at", at or utcnow())
    if new is S.FAILED:
        job.error = error
    elif new is S.VALIDATING:
        job.error = None
    if new in TERMINAL:
        job.output_claim = None
    elif new is S.VALIDATING and job.output_uri:  # a retry takes the prefix again (submit checks it is free)
        job.output_claim = output_claim(job.output_uri)


def output_claim(output_uri: str) -> str:
    """The key a live job holds its output prefix by: the normalized URI without a trailing slash."""
    normalized = normalize_uri(output_uri).rstrip("/")
    if normalized.startswith("file://"):  # the local store writes through symlinks: so does the claim
        return "file://" + os.path.realpath(normalized[len("file://"):])
    return normalized


def is_terminal(status: str) -> bool:
    return JobStatus(status) in TERMINAL
