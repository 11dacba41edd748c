"""The job state machine: OpenAI Batch statuses, a timestamp per transition, illegal moves raise."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from storage.models import Job, JobStatus
from storage.states import ALLOWED, IllegalTransition, can_transition, transition


def new_job() -> Job:
    return Job(id="job-1", status=JobStatus.VALIDATING.value)


def test_happy_path_stamps_every_transition() -> None:
    job = new_job()
    for status in ("queued", "in_progress", "finalizing", "completed"):
        before = datetime.now(UTC)
        transition(job, status)
        assert job.status == status
        assert before <= getattr(job, f"{status}_at") <= datetime.now(UTC)
    assert job.failed_at is None and job.cancelled_at is None


@pytest.mark.parametrize(("start", "new"), [
    ("validating", "completed"), ("validating", "in_progress"), ("queued", "finalizing"),
    ("completed", "failed"), ("completed", "validating"), ("finalizing", "cancelling"), ("cancelled", "in_progress"),
])
def test_illegal_transitions_raise_and_change_nothing(start: str, new: str) -> None:
    job = Job(id="job-1", status=start)
    with pytest.raises(IllegalTransition, match=f"cannot go from '{start}' to '{new}'"):
        transition(job, new)
    assert job.status == start
    assert getattr(job, f"{new}_at") is None


def test_unknown_status_is_rejected() -> None:
    with pytest.raises(ValueError):
        transition(new_job(), "done")


def test_failed_records_the_error_and_a_retry_clears_it() -> None:
    job = new_job()
    transition(job, "failed", error="missing required column 'custom_id'")
    assert job.error == "missing required column 'custom_id'" and job.failed_at is not None
    transition(job, "validating")
    assert job.status == "validating" and job.error is None


def test_cancellation_paths() -> None:
    job = new_job()
    for status in ("queued", "in_progress", "cancelling", "cancelled"):
        transition(job, status)
    assert job.cancelling_at <= job.cancelled_at
    assert can_transition("validating", "cancelled") and not can_transition("in_progress", "cancelled")


def test_every_status_has_a_row_in_the_table() -> None:
    assert set(ALLOWED) == set(JobStatus)
    assert ALLOWED[JobStatus.COMPLETED] == frozenset()
