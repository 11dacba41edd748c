"""OpenAI's file and batch objects, made from tokenmill's rows (`ApiFile`, `ApiBatch` and its `Job`)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel

from storage.models import ApiBatch, ApiFile, Job, JobStatus
from storage.public_text import public_message

BATCH_STATUS = {JobStatus.QUEUED: "in_progress"}  # validated, waiting for a worker: OpenAI has no `queued`
TIMESTAMPS = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at",
              "cancelled_at")


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.kind = status, message, code, param, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def not_found(what: str, object_id: str) -> ApiError:
    return ApiError(404, f"No {what} found with id '{object_id}'.", code="not_found")


class FileObject(BaseModel):
    id: str
    object: str = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class Deleted(BaseModel):
    id: str
    object: str = "file"
    deleted: bool = True


def unix(moment: datetime | None) -> int | None:
    return None if moment is None else int(moment.timestamp())


def file_object(row: ApiFile) -> FileObject:
    return FileObject(id=row.id, bytes=row.bytes, created_at=unix(row.created_at), filename=row.filename,
                      purpose=row.purpose, expires_at=unix(row.expires_at))


def batch_object(batch: ApiBatch, job: Job, counts: tuple[int, int] | None = None) -> dict[str, Any]:
    """The batch as OpenAI's `Batch`: its status, the time of each status reached, counts, usage, files. Its
    errors are the lines refused at creation, else the job's error; `counts` (completed, failed) replace the
    job's."""
    status = BATCH_STATUS.get(JobStatus(job.status), job.status)
    times = {name: unix(getattr(job, name)) for name in TIMESTAMPS}
    if status == "in_progress" and times["in_progress_at"] is None:
        times["in_progress_at"] = unix(job.queued_at)
    errors = None
    if batch.errors:
        errors = {"object": "list", "data": batch.errors}
    elif job.error:
        errors = {"object": "list", "data": [{"code": "failed" if job.status == JobStatus.FAILED else job.status,
                                              "message": public_message(job.error), "param": None, "line": None}]}
    completed, failed = counts or (job.requests_completed, job.requests_failed)
    return {
        "id": job.id, "object": "batch", "endpoint": batch.endpoint, "model": job.model, "errors": errors,
        "input_file_id": batch.input_file_id, "completion_window": batch.completion_window, "status": status,
        "output_file_id": batch.output_file_id, "error_file_id": batch.error_file_id,
        "created_at": unix(job.created_at), "expires_at": unix(job.expires_at), **times,
        "request_counts": {"total": job.requests_total, "completed": completed, "failed": failed},
        "usage": {"input_tokens": job.prompt_tokens, "input_tokens_details": {"cached_tokens": job.cached_tokens},
                  "output_tokens": job.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": job.prompt_tokens + job.completion_tokens},
        "metadata": batch.metadata_,
    }
